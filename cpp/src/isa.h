// Runtime ISA dispatch, the one place that decides which compiled kernel path runs.
//
// Every kernel family (kernels/<family>.h) is compiled three times from kernels/<family>_impl.inc
// (CMake: ortlean_isa_kernels) into tables <family>_kernels_{scalar,avx2,avx512}. The process ISA
// is chosen once from CPUID, optionally forced lower with ORTLEAN_ISA=scalar|avx2|avx512 (a higher
// ISA than the CPU has is clamped down with a message on stderr); pick() returns a family's table
// for it, lowered further to a cap (an op attribute such as PackedAttention's popcnt) and to the
// highest level whose extra CPU feature (e.g. AVX512_VPOPCNTDQ) the CPU has.
#pragma once
#include "kernels/gemm.h"

namespace ortlean {

enum class Isa { Scalar = 0, Avx2 = 1, Avx512 = 2 };

// CPU features a family may need beyond its ISA level's flags.
// Avx512VpopcntdqVnni: AVX512_VPOPCNTDQ and AVX512_VNNI both (PackedAttention's AVX-512 copy);
// F16c: fp16 conversions (BlockQuantMatMul's AVX2 copy); Avx512Vnni: AVX512_VNNI and F16C (its AVX-512 copy)
enum class CpuFeature { None, Popcnt, Avx512Vpopcntdq, Avx512VpopcntdqVnni, F16c, Avx512Vnni };

Isa isa();  // the process ISA (decided on first call, then fixed for the process)
const char* isa_name(Isa i);
inline const char* isa_name() { return isa_name(isa()); }

// A family's three tables and the extra CPU feature each vector level needs.
template <class T>
struct IsaTables {
  const T& scalar;
  const T& avx2;
  const T& avx512;
  CpuFeature avx2_needs = CpuFeature::None;
  CpuFeature avx512_needs = CpuFeature::None;
};

// The level a family runs at: the process ISA, at most `cap`, lowered while the level's feature
// is missing.
Isa isa_level(CpuFeature avx2_needs, CpuFeature avx512_needs, Isa cap = Isa::Avx512);

template <class T>
const T& pick(const IsaTables<T>& t, Isa cap = Isa::Avx512, Isa* level = nullptr) {
  const Isa l = isa_level(t.avx2_needs, t.avx512_needs, cap);
  if (level) *level = l;
  return l == Isa::Avx512 ? t.avx512 : l == Isa::Avx2 ? t.avx2 : t.scalar;
}

// The shared GEMM / elementwise table (kernels/gemm.h) of the process ISA.
const GemmKernels& gemm_kernels();

}  // namespace ortlean
