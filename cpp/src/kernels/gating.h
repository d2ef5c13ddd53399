// Per-ISA kernels of EventGatedMatMul (row-skipping matvec). Same rules as gemm.h: plain
// C-like, included by -mavx* translation units.
#pragma once
#include <cstddef>
#include <cstdint>

namespace ortlean {

struct GatingKernels {
  const char* name;
  // y[0:ncols] (+)= sum_j v[j] * W[idx[j] * ldw + 0:ncols]: reads only the listed rows of W
  // (prefetching ahead, several rows per pass). acc = 0 overwrites y.
  void (*gather_axpy)(const int32_t* idx, const float* v, int64_t n, const float* W, int64_t ldw, float* y,
                      int64_t ncols, int acc);
  // score[k] = |x[k]| * norm[k] (norm may be null: |x[k]|)
  void (*abs_scale)(const float* x, const float* norm, float* score, int64_t n);
  // Channels with |x[k]| * norm[k] > thr (norm may be null): their indices and values, in order;
  // returns how many (the KWTA threshold mask built in one pass over x).
  int64_t (*threshold_compress)(const float* x, const float* norm, float thr, int64_t n, int32_t* idx, float* vals);
  // xt[k] = x[k] when |x[k]| * norm[k] > thr (norm may be null), else 0; returns how many kept
  // (the same mask as threshold_compress, written densely for the batched product).
  int64_t (*threshold_mask)(const float* x, const float* norm, float thr, int64_t n, float* xt);
};

// kernels/gating_impl.inc per ISA (picked by isa.h pick())
extern const GatingKernels gating_kernels_scalar, gating_kernels_avx2, gating_kernels_avx512;

}  // namespace ortlean
