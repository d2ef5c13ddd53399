// Table of the per-ISA compute kernels. Each kernels/gemm_<isa>.cc compiles kernels/gemm_impl.inc
// with its own -m flags and returns one of these tables; isa.cc picks one at load time.
//
// This header must stay plain C-like (no std:: templates, no inline functions): it is included by
// translation units built with -mavx2/-mavx512*, and an inline function emitted there could be
// merged by the linker into code that runs on CPUs without those instructions.
#pragma once
#include <cstddef>
#include <cstdint>

namespace ortlean {

struct Kernels {
  const char* name;
  // C[M,N] = A[M,K] . B[K,N] (row-major, leading dimensions lda/ldb/ldc; C is overwritten).
  // Register-blocked broadcast-FMA kernel for the small / thin products of the TT chain and the
  // M = 1 low-rank matvec (memory-bound: streams B once per 4 rows of A).
  void (*sgemm_nn)(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                   int64_t ldb, float* C, int64_t ldc);
  // y[i] = x[i] * s[i]
  void (*scale)(const float* x, const float* s, float* y, int64_t n);
  // dst[c, r] = src[r, c] * (s ? s[c] : 1) for a rows x cols block (src ld = lds, dst ld = ldd)
  void (*transpose)(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows,
                    int64_t cols, const float* s);
  // 1 if every value is finite (no Inf/NaN)
  int (*all_finite)(const float* x, int64_t n);
};

const Kernels* kernels_scalar();
const Kernels* kernels_avx2();
const Kernels* kernels_avx512();

}  // namespace ortlean
