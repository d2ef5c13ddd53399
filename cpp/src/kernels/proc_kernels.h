// Per-ISA kernels of ProcSparseMatMul (hash-base regeneration + block-sparse row dots).
// Plain C-like, like kernels.h: included by translation units built with -mavx2/-mavx512*.
#pragma once
#include <cstddef>
#include <cstdint>

namespace ortlean {

// One stored layer plus one chunk of input rows, as the row kernel sees it.
struct ProcRowsArgs {
  int64_t K;             // input features
  int64_t B;             // block size (32 | 64)
  uint64_t seed;
  float scale;           // base_scale (0: the base is not regenerated at all)
  const int32_t* row_ptr;  // [N+1]
  const int32_t* bidx;     // [nnzb] input-block index per stored block
  const float* deltas;     // [nnzb, B]
  const float* X;          // chunk of input rows, [mb, ldx]
  int64_t ldx;
  int64_t mb;
  const float* mask;       // nullptr, or [mb, ldmask] (ldmask 0: one mask row for all) block mask
  int64_t ldmask;
  float* Y;                // [mb, ldy], columns n0..n1 written
  int64_t ldy;
  float* wbuf;             // scratch: max blocks per row * B floats (used when scale != 0)
};

struct ProcKernels {
  const char* name;
  // w[i] = fl(fl(scale * h(seed, idx0 + i)) + d[i]) for i < len (the reference's exact weights)
  void (*base_block)(uint64_t seed, uint64_t idx0, float scale, const float* d, int64_t len, float* w);
  // Y[m, n] = sum over the stored (and, with a mask, unmasked) blocks of row n of dot(w, X[m, block])
  // for n in [n0, n1), m < mb. Returns the number of (row m, block) pairs visited.
  int64_t (*rows)(const ProcRowsArgs* a, int64_t n0, int64_t n1);
};

const ProcKernels* proc_kernels_scalar();
const ProcKernels* proc_kernels_avx2();
const ProcKernels* proc_kernels_avx512();

}  // namespace ortlean
