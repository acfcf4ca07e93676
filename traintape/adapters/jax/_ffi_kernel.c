/* XLA FFI handler "traintape_raw_stats": the fused stat kernel (core/_fused_stats.c)
 * called from inside a compiled JAX computation on the CPU backend.
 *
 * Operands: any number of float32/float64 buffers (XLA passes them as they are: on the
 * CPU backend device memory is host memory, so nothing is copied). Result: one buffer
 * of [n, RAW] doubles (declared as uint32 [n, 2 * RAW] so that it needs no float64
 * support in JAX), the mergeable raw rows of traintape.core.fused.RAW_NAMES.
 *
 * Written against the C API of the FFI header shipped with the installed jaxlib
 * (xla/ffi/api/c_api.h; no C++ needed): it answers XLA's metadata query with the header's
 * API version and runs in the EXECUTE stage only.
 */
#include <stdint.h>
#include <stdlib.h>

#include "xla/ffi/api/c_api.h"

int tt_raw_stats(int64_t n, const uintptr_t *ptrs, const int64_t *lens, const int32_t *dtypes,
                 double *out, int nthreads);

static XLA_FFI_Error *fail(const XLA_FFI_Api *api, XLA_FFI_Error_Code code, const char *msg) {
    XLA_FFI_Error_Create_Args a = {0};
    a.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
    a.message = msg;
    a.errc = code;
    return api->XLA_FFI_Error_Create(&a);
}

XLA_FFI_Error *tt_raw_stats_ffi(XLA_FFI_CallFrame *cf) {
    if (cf->extension_start && cf->extension_start->type == XLA_FFI_Extension_Metadata) {
        XLA_FFI_Metadata_Extension *ext = (XLA_FFI_Metadata_Extension *)cf->extension_start;
        ext->metadata->api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
        ext->metadata->api_version.extension_start = NULL;
        ext->metadata->api_version.major_version = XLA_FFI_API_MAJOR;
        ext->metadata->api_version.minor_version = XLA_FFI_API_MINOR;
        ext->metadata->traits = 0;
        return NULL;
    }
    if (cf->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
    if (cf->rets.size != 1)
        return fail(cf->api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                    "traintape_raw_stats: expected exactly one result");
    int64_t n = cf->args.size;
    XLA_FFI_Buffer *out = (XLA_FFI_Buffer *)cf->rets.rets[0];
    size_t cap = (size_t)(n > 0 ? n : 1);
    uintptr_t *ptrs = (uintptr_t *)malloc(sizeof(uintptr_t) * cap);
    int64_t *lens = (int64_t *)malloc(sizeof(int64_t) * cap);
    int32_t *codes = (int32_t *)malloc(sizeof(int32_t) * cap);
    XLA_FFI_Error *err = NULL;
    if (!ptrs || !lens || !codes) {
        err = fail(cf->api, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED,
                   "traintape_raw_stats: out of memory");
        goto done;
    }
    for (int64_t i = 0; i < n; i++) {
        if (cf->args.types[i] != XLA_FFI_ArgType_BUFFER) {
            err = fail(cf->api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                       "traintape_raw_stats: operands must be buffers");
            goto done;
        }
        XLA_FFI_Buffer *b = (XLA_FFI_Buffer *)cf->args.args[i];
        if (b->dtype != XLA_FFI_DataType_F32 && b->dtype != XLA_FFI_DataType_F64) {
            err = fail(cf->api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                       "traintape_raw_stats: operands must be float32 or float64");
            goto done;
        }
        int64_t m = 1;
        for (int64_t d = 0; d < b->rank; d++) m *= b->dims[d];
        ptrs[i] = (uintptr_t)b->data;
        lens[i] = m;
        codes[i] = b->dtype == XLA_FFI_DataType_F64 ? 1 : 0;
    }
    if (tt_raw_stats(n, ptrs, lens, codes, (double *)out->data, 0) != 0)
        err = fail(cf->api, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED,
                   "traintape_raw_stats: out of memory");
done:
    free(ptrs);
    free(lens);
    free(codes);
    return err;
}
