// Runtime ISA dispatch: one kernel table chosen once per process from CPUID, optionally forced
// lower with ORTLEAN_ISA=scalar|avx2|avx512 (a higher ISA than the CPU has is clamped down with
// a message on stderr).
#pragma once
#include "kernels/kernels.h"

namespace ortlean {

enum class Isa { Scalar = 0, Avx2 = 1, Avx512 = 2 };

// The chosen ISA / kernel table (decided on first call, then fixed for the process).
Isa isa();
const char* isa_name();
const Kernels& kernels();

}  // namespace ortlean
