/* XLA FFI handler "traintape_raw_stats": the fused stat kernel (core/_fused_stats.c)
 * called from inside a compiled JAX computation on the CPU backend.
 *
 * Operands: any number of float32/float64 buffers (XLA passes them as they are: on the
 * CPU backend device memory is host memory, so nothing is copied), optionally followed
 * by one int32 buffer of TT_MAP_WORDS words per data buffer: their index maps for the
 * sig field (core/_fused_stats.c tt_plan_new_mapped; offset and strides as uint32 bit
 * patterns; absent: identity maps). Result: one buffer
 * of [n, RAW] doubles (declared as uint32 [n, 2 * RAW] so that it needs no float64
 * support in JAX), the mergeable raw rows of traintape.schema.stats.RAW_NAMES.
 *
 * Execution: the blocks of all operands are spread over XLA:CPU's own intra-op thread
 * pool (XLA_FFI_ThreadPool_Schedule, one task per pool thread, each taking GRAIN blocks
 * at a time) and the handler returns at once with an FFI future that the worker
 * finishing the last block completes, after merging the rows: XLA's runtime keeps the
 * operands alive until then and can run independent work meanwhile (e.g. param stats
 * during the backward pass). No threads of our own, so nothing competes with XLA's
 * (OpenMP inside a custom call oversubscribes the cores XLA already uses). Small
 * operand sets, or no thread pool (an older runtime), run on the calling thread.
 *
 * Written against the C API of the FFI header shipped with the installed jaxlib
 * (xla/ffi/api/c_api.h; no C++ needed): it answers XLA's metadata query with the header's
 * API version and runs in the EXECUTE stage only.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "xla/ffi/api/c_api.h"

typedef struct tt_plan tt_plan;
tt_plan *tt_plan_new_mapped(int64_t n, const uintptr_t *ptrs, const int64_t *lens,
                            const int32_t *dtypes, const int64_t *maps);
int tt_map_words(void);
int64_t tt_plan_blocks(const tt_plan *p);
void tt_plan_run(tt_plan *p, int64_t b0, int64_t b1);
void tt_plan_finish(const tt_plan *p, double *out);
void tt_plan_free(tt_plan *p);

/* Blocks (of 32768 elements) taken at a time by a worker, and the smallest plan worth
 * spreading over XLA's thread pool (below it the caller's thread does it all). */
#define GRAIN 4
#define MIN_ASYNC_BLOCKS 16

static XLA_FFI_Error *fail(const XLA_FFI_Api *api, XLA_FFI_Error_Code code, const char *msg) {
    XLA_FFI_Error_Create_Args a = {0};
    a.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
    a.message = msg;
    a.errc = code;
    return api->XLA_FFI_Error_Create(&a);
}

typedef struct {
    tt_plan *plan;
    double *out;
    const XLA_FFI_Api *api;
    XLA_FFI_Future *future;
    int64_t total;
    atomic_llong next; /* next block to take */
    atomic_llong done; /* blocks reduced */
    atomic_int refs;   /* scheduled tasks not yet returned */
} job_t;

static void destroy_error(const XLA_FFI_Api *api, XLA_FFI_Error *e) {
    if (!e) return;
    XLA_FFI_Error_Destroy_Args a = {0};
    a.struct_size = XLA_FFI_Error_Destroy_Args_STRUCT_SIZE;
    a.error = e;
    api->XLA_FFI_Error_Destroy(&a);
}

static void job_release(job_t *j) {
    if (atomic_fetch_sub(&j->refs, 1) == 1) {
        tt_plan_free(j->plan);
        free(j);
    }
}

/* One pool task: take blocks until none are left; the worker that reduces the last
 * block merges the rows and completes the future (after that, nothing touches XLA's
 * buffers: the runtime may free them). */
static void work(void *data) {
    job_t *j = (job_t *)data;
    for (;;) {
        int64_t b = atomic_fetch_add(&j->next, GRAIN);
        if (b >= j->total) break;
        int64_t e = b + GRAIN < j->total ? b + GRAIN : j->total;
        tt_plan_run(j->plan, b, e);
        if (atomic_fetch_add(&j->done, e - b) + (e - b) == j->total) {
            tt_plan_finish(j->plan, j->out);
            XLA_FFI_Future_SetAvailable_Args a = {0};
            a.struct_size = XLA_FFI_Future_SetAvailable_Args_STRUCT_SIZE;
            a.future = j->future;
            destroy_error(j->api, j->api->XLA_FFI_Future_SetAvailable(&a));
        }
    }
    job_release(j);
}

/* Spread the plan over XLA's thread pool; 0 if it did (the future is set in cf), -1 if
 * there is no pool or nothing was scheduled (the caller runs the plan itself). */
static int run_async(XLA_FFI_CallFrame *cf, tt_plan *plan, double *out) {
    const XLA_FFI_Api *api = cf->api;
    int64_t threads = 0;
    XLA_FFI_ThreadPool_NumThreads_Args na = {0};
    na.struct_size = XLA_FFI_ThreadPool_NumThreads_Args_STRUCT_SIZE;
    na.ctx = cf->ctx;
    na.num_threads = &threads;
    XLA_FFI_Error *e = api->XLA_FFI_ThreadPool_NumThreads(&na);
    if (e) {
        destroy_error(api, e);
        return -1;
    }
    int64_t total = tt_plan_blocks(plan);
    int64_t tasks = (total + GRAIN - 1) / GRAIN;
    if (threads < tasks) tasks = threads;
    if (tasks < 1) return -1;
    job_t *j = (job_t *)calloc(1, sizeof(job_t));
    if (!j) return -1;
    XLA_FFI_Future_Create_Args fa = {0};
    fa.struct_size = XLA_FFI_Future_Create_Args_STRUCT_SIZE;
    e = api->XLA_FFI_Future_Create(&fa);
    if (e) {
        destroy_error(api, e);
        free(j);
        return -1;
    }
    j->plan = plan;
    j->out = out;
    j->api = api;
    j->future = fa.future;
    j->total = total;
    atomic_init(&j->next, 0);
    atomic_init(&j->done, 0);
    atomic_init(&j->refs, (int)tasks + 1); /* + this thread, until scheduling is over */
    cf->future = fa.future;
    int64_t scheduled = 0;
    for (int64_t t = 0; t < tasks; t++) {
        XLA_FFI_ThreadPool_Schedule_Args sa = {0};
        sa.struct_size = XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE;
        sa.ctx = cf->ctx;
        sa.task = work;
        sa.data = j;
        e = api->XLA_FFI_ThreadPool_Schedule(&sa);
        if (e) {
            destroy_error(api, e);
            break;
        }
        scheduled++;
    }
    /* tasks that could not be scheduled: this thread takes their share (and, with none
     * scheduled, all the work: the future still completes, from here) */
    atomic_fetch_sub(&j->refs, (int)(tasks - scheduled));
    if (scheduled < tasks) {
        atomic_fetch_add(&j->refs, 1);
        work(j);
    }
    job_release(j);
    return 0;
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
    const int32_t *table = NULL; /* index maps: a trailing int32 operand */
    int64_t words = tt_map_words();
    if (n > 0 && cf->args.types[n - 1] == XLA_FFI_ArgType_BUFFER &&
        ((XLA_FFI_Buffer *)cf->args.args[n - 1])->dtype == XLA_FFI_DataType_S32) {
        XLA_FFI_Buffer *t = (XLA_FFI_Buffer *)cf->args.args[n - 1];
        int64_t m = 1;
        for (int64_t d = 0; d < t->rank; d++) m *= t->dims[d];
        if (m != (n - 1) * words)
            return fail(cf->api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                        "traintape_raw_stats: index map operand of the wrong size");
        table = (const int32_t *)t->data;
        n--;
    }
    XLA_FFI_Buffer *out = (XLA_FFI_Buffer *)cf->rets.rets[0];
    size_t cap = (size_t)(n > 0 ? n : 1);
    uintptr_t *ptrs = (uintptr_t *)malloc(sizeof(uintptr_t) * cap);
    int64_t *lens = (int64_t *)malloc(sizeof(int64_t) * cap);
    int32_t *codes = (int32_t *)malloc(sizeof(int32_t) * cap);
    int64_t *maps = table ? (int64_t *)malloc(sizeof(int64_t) * cap * (size_t)words) : NULL;
    XLA_FFI_Error *err = NULL;
    if (!ptrs || !lens || !codes || (table && !maps)) {
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
    for (int64_t k = 0; table && k < n * words; k++) /* offset, strides: uint32 patterns */
        maps[k] = (int64_t)(uint32_t)table[k];
    {
        tt_plan *plan = tt_plan_new_mapped(n, ptrs, lens, codes, maps);
        if (!plan) {
            err = fail(cf->api, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED,
                       "traintape_raw_stats: out of memory (or a malformed index map)");
            goto done;
        }
        if (tt_plan_blocks(plan) >= MIN_ASYNC_BLOCKS &&
            run_async(cf, plan, (double *)out->data) == 0)
            goto done; /* the plan now belongs to the job */
        tt_plan_run(plan, 0, tt_plan_blocks(plan));
        tt_plan_finish(plan, (double *)out->data);
        tt_plan_free(plan);
    }
done:
    free(ptrs);
    free(lens);
    free(codes);
    free(maps);
    return err;
}
