// scalar build of kernels/gemm_impl.inc (flags set per source file in cpp/CMakeLists.txt).
#define ORTLEAN_KERNELS_SCALAR 1
#define ORTLEAN_KERNELS_NS k_scalar
#define ORTLEAN_KERNELS_NAME "scalar"
#include "kernels/gemm_impl.inc"

namespace ortlean {
const Kernels* kernels_scalar() { return &k_scalar::table; }
}  // namespace ortlean
