// avx512 build of kernels/gating_impl.inc (flags set per source file in cpp/CMakeLists.txt).
#define ORTLEAN_KERNELS_AVX512 1
#define ORTLEAN_KERNELS_NS g_avx512
#define ORTLEAN_KERNELS_NAME "avx512"
#include "kernels/gating_impl.inc"

namespace ortlean {
const GatingKernels* gating_kernels_avx512() { return &g_avx512::table; }
}  // namespace ortlean
