#include "isa.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ortlean {
namespace {

Isa detect() {
  __builtin_cpu_init();
  // libgcc also checks that the OS saves the wider registers (XCR0) before reporting these.
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return Isa::Avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::Avx2;
  return Isa::Scalar;
}

Isa choose() {
  const Isa hw = detect();
  const char* env = std::getenv("ORTLEAN_ISA");
  if (!env || !*env) return hw;
  Isa want;
  if (!std::strcmp(env, "scalar"))
    want = Isa::Scalar;
  else if (!std::strcmp(env, "avx2"))
    want = Isa::Avx2;
  else if (!std::strcmp(env, "avx512"))
    want = Isa::Avx512;
  else {
    std::fprintf(stderr, "ortlean: ORTLEAN_ISA=%s not understood (scalar|avx2|avx512); using %s\n", env,
                 isa_name(hw));
    return hw;
  }
  if (static_cast<int>(want) > static_cast<int>(hw)) {
    std::fprintf(stderr, "ortlean: ORTLEAN_ISA=%s is not supported by this CPU; using %s\n", env, isa_name(hw));
    return hw;
  }
  return want;
}

bool has(CpuFeature f) {
  __builtin_cpu_init();
  switch (f) {
    case CpuFeature::Popcnt: return __builtin_cpu_supports("popcnt");
    case CpuFeature::Avx512Vpopcntdq: return __builtin_cpu_supports("avx512vpopcntdq");
    case CpuFeature::Avx512VpopcntdqVnni:
      return __builtin_cpu_supports("avx512vpopcntdq") && __builtin_cpu_supports("avx512vnni");
    case CpuFeature::F16c: return __builtin_cpu_supports("f16c");
    case CpuFeature::Avx512Vnni: return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
    default: return true;
  }
}

}  // namespace

Isa isa() {
  static const Isa chosen = choose();  // thread-safe, once per process
  return chosen;
}

const char* isa_name(Isa i) {
  switch (i) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "scalar";
  }
}

Isa isa_level(CpuFeature avx2_needs, CpuFeature avx512_needs, Isa cap) {
  Isa l = static_cast<int>(cap) < static_cast<int>(isa()) ? cap : isa();
  if (l == Isa::Avx512 && !has(avx512_needs)) l = Isa::Avx2;
  if (l == Isa::Avx2 && !has(avx2_needs)) l = Isa::Scalar;
  return l;
}

const GemmKernels& gemm_kernels() {
  static const GemmKernels& k = pick(IsaTables<GemmKernels>{gemm_kernels_scalar, gemm_kernels_avx2, gemm_kernels_avx512});
  return k;
}

}  // namespace ortlean
