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

const char* name_of(Isa i) {
  switch (i) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "scalar";
  }
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
                 name_of(hw));
    return hw;
  }
  if (static_cast<int>(want) > static_cast<int>(hw)) {
    std::fprintf(stderr, "ortlean: ORTLEAN_ISA=%s is not supported by this CPU; using %s\n", env, name_of(hw));
    return hw;
  }
  return want;
}

struct Choice {
  Isa isa;
  const Kernels* k;
  Choice() : isa(choose()) {
    k = isa == Isa::Avx512 ? kernels_avx512() : isa == Isa::Avx2 ? kernels_avx2() : kernels_scalar();
  }
};

const Choice& choice() {
  static const Choice c;  // thread-safe, once per process
  return c;
}

}  // namespace

Isa isa() { return choice().isa; }
const char* isa_name() { return name_of(choice().isa); }
const Kernels& kernels() { return *choice().k; }

}  // namespace ortlean
