// avx2 build of kernels/attn_impl.inc (flags set per source file in cpp/CMakeLists.txt).
#define ORTLEAN_ATTN_AVX2 1
#define ORTLEAN_ATTN_NS attn_avx2
#define ORTLEAN_ATTN_NAME "avx2"
#include "kernels/attn_impl.inc"

namespace ortlean {
const AttnKernels* attn_kernels_avx2() { return &attn_avx2::table; }
}  // namespace ortlean
