// avx512 build of kernels/proc_impl.inc (flags set per source file in cpp/CMakeLists.txt).
#define ORTLEAN_PROC_AVX512 1
#define ORTLEAN_PROC_NS pk_avx512
#define ORTLEAN_PROC_NAME "avx512"
#include "kernels/proc_impl.inc"

namespace ortlean {
const ProcKernels* proc_kernels_avx512() { return &pk_avx512::table; }
}  // namespace ortlean
