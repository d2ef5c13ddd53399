// scalar build of kernels/gating_impl.inc (flags set per source file in cpp/CMakeLists.txt).
#define ORTLEAN_KERNELS_SCALAR 1
#define ORTLEAN_KERNELS_NS g_scalar
#define ORTLEAN_KERNELS_NAME "scalar"
#include "kernels/gating_impl.inc"

namespace ortlean {
const GatingKernels* gating_kernels_scalar() { return &g_scalar::table; }
}  // namespace ortlean
