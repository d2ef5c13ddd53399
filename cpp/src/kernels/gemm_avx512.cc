// avx512 build of kernels/gemm_impl.inc (flags set per source file in cpp/CMakeLists.txt).
#define ORTLEAN_KERNELS_AVX512 1
#define ORTLEAN_KERNELS_NS k_avx512
#define ORTLEAN_KERNELS_NAME "avx512"
#include "kernels/gemm_impl.inc"

namespace ortlean {
const Kernels* kernels_avx512() { return &k_avx512::table; }
}  // namespace ortlean
