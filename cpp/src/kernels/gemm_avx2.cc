// avx2 build of kernels/gemm_impl.inc (flags set per source file in cpp/CMakeLists.txt).
#define ORTLEAN_KERNELS_AVX2 1
#define ORTLEAN_KERNELS_NS k_avx2
#define ORTLEAN_KERNELS_NAME "avx2"
#include "kernels/gemm_impl.inc"

namespace ortlean {
const Kernels* kernels_avx2() { return &k_avx2::table; }
}  // namespace ortlean
