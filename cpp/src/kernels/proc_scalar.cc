// scalar build of kernels/proc_impl.inc (flags set per source file in cpp/CMakeLists.txt).
#define ORTLEAN_PROC_SCALAR 1
#define ORTLEAN_PROC_NS pk_scalar
#define ORTLEAN_PROC_NAME "scalar"
#include "kernels/proc_impl.inc"

namespace ortlean {
const ProcKernels* proc_kernels_scalar() { return &pk_scalar::table; }
}  // namespace ortlean
