// avx2 build of kernels/gating_impl.inc (flags set per source file in cpp/CMakeLists.txt).
#define ORTLEAN_KERNELS_AVX2 1
#define ORTLEAN_KERNELS_NS g_avx2
#define ORTLEAN_KERNELS_NAME "avx2"
#include "kernels/gating_impl.inc"

namespace ortlean {
const GatingKernels* gating_kernels_avx2() { return &g_avx2::table; }
}  // namespace ortlean
