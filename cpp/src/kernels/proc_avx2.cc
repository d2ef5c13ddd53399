// avx2 build of kernels/proc_impl.inc (flags set per source file in cpp/CMakeLists.txt).
#define ORTLEAN_PROC_AVX2 1
#define ORTLEAN_PROC_NS pk_avx2
#define ORTLEAN_PROC_NAME "avx2"
#include "kernels/proc_impl.inc"

namespace ortlean {
const ProcKernels* proc_kernels_avx2() { return &pk_avx2::table; }
}  // namespace ortlean
