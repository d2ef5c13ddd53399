// scalar build of kernels/attn_impl.inc (flags set per source file in cpp/CMakeLists.txt).

#define ORTLEAN_ATTN_NS attn_scalar
#define ORTLEAN_ATTN_NAME "scalar"
#include "kernels/attn_impl.inc"

namespace ortlean {
const AttnKernels* attn_kernels_scalar() { return &attn_scalar::table; }
}  // namespace ortlean
