// The shared GEMM / elementwise kernel table (used by every op). kernels/gemm_impl.inc is compiled
// once per ISA with its own -m flags (CMake ortlean_isa_kernels) into gemm_kernels_<isa>;
// isa.h gemm_kernels() returns the one of the process ISA. Each other kernel family
// (proc.h, gating.h, attn.h) follows the same pattern.
//
// This header must stay plain C-like (no std:: templates, no inline functions): it is included by
// translation units built with -mavx2/-mavx512*, and an inline function emitted there could be
// merged by the linker into code that runs on CPUs without those instructions.
#pragma once
#include <cstddef>
#include <cstdint>

namespace ortlean {

struct GemmKernels {
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

// kernels/gemm_impl.inc per ISA
extern const GemmKernels gemm_kernels_scalar, gemm_kernels_avx2, gemm_kernels_avx512;

}  // namespace ortlean
