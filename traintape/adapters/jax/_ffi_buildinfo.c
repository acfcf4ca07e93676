/* What a prebuilt JAX FFI handler was built from (setup.py links this file into
 * adapters/jax/_ffi_prebuilt*.so together with _ffi_kernel.c and core/_fused_stats.c).
 *
 * ffi_kernel.py reads these before registering the handler: the XLA FFI C API version of
 * the header it was compiled against (XLA accepts a handler whose API version is not newer
 * than its own, within the same major version), the hash of the C sources (an editable
 * install keeps an old build next to edited sources: that one is not used) and the
 * jaxlib whose header it was (for `traintape doctor`).
 */
#include "xla/ffi/api/c_api.h"

#ifndef TT_FFI_SOURCE_HASH
#define TT_FFI_SOURCE_HASH ""
#endif
#ifndef TT_FFI_JAXLIB
#define TT_FFI_JAXLIB ""
#endif

int tt_ffi_api_major(void) { return XLA_FFI_API_MAJOR; }
int tt_ffi_api_minor(void) { return XLA_FFI_API_MINOR; }
const char *tt_ffi_source_hash(void) { return TT_FFI_SOURCE_HASH; }
const char *tt_ffi_jaxlib(void) { return TT_FFI_JAXLIB; }
