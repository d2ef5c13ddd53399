// avx512 build of kernels/attn_impl.inc (flags set per source file in cpp/CMakeLists.txt).
#define ORTLEAN_ATTN_AVX512 1
#define ORTLEAN_ATTN_NS attn_avx512
#define ORTLEAN_ATTN_NAME "vpopcntdq"
#include "kernels/attn_impl.inc"

namespace ortlean {
const AttnKernels* attn_kernels_avx512() { return &attn_avx512::table; }
}  // namespace ortlean
