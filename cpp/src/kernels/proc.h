// Per-ISA kernels of ProcSparseMatMul (hash-base regeneration + block-sparse row dots).
// Plain C-like, like gemm.h: included by translation units built with -mavx2/-mavx512*.
#pragma once
#include <cstddef>
#include <cstdint>

namespace ortlean {

// The stored layer: the block format of ProcSparseMatMul (DEVELOPERS.md). Input features are cut
// into nb = ceil(K / block) blocks (block b covers [b*block, min(K, (b+1)*block))); output row n
// stores the blocks block_idx[row_ptr[n] : row_ptr[n+1]], stored block j holds `block` delta values
// at deltas + j*block. The hash base (seed, base_scale) is regenerated, never stored.
struct ProcLayer {
  int64_t K, N;
  int64_t block;             // 32 | 64
  int64_t nb;                // ceil(K / block)
  uint64_t seed;
  float base_scale;          // 0: the base is not regenerated at all
  const int32_t* row_ptr;    // [N+1]
  const int32_t* block_idx;  // [nnzb] input-block index per stored block
  const float* deltas;       // [nnzb, block]
};

// One chunk of input rows against the stored layer, as the row kernel sees it.
struct ProcRowsArgs {
  ProcLayer L;
  const float* X;     // chunk of input rows, [mb, ldx]
  int64_t ldx;
  int64_t mb;
  const float* mask;  // nullptr, or [mb, ldmask] (ldmask 0: one mask row for all) block mask
  int64_t ldmask;
  float* Y;           // [mb, ldy], columns n0..n1 written
  int64_t ldy;
  float* wbuf;        // scratch: max blocks per row * block floats (used when base_scale != 0)
};

struct ProcKernels {
  const char* name;
  // w[i] = fl(fl(scale * h(seed, idx0 + i)) + d[i]) for i < len (the reference's exact weights)
  void (*base_block)(uint64_t seed, uint64_t idx0, float scale, const float* d, int64_t len, float* w);
  // Y[m, n] = sum over the stored (and, with a mask, unmasked) blocks of row n of dot(w, X[m, block])
  // for n in [n0, n1), m < mb. Returns the number of (row m, block) pairs visited.
  int64_t (*rows)(const ProcRowsArgs* a, int64_t n0, int64_t n1);
};

// kernels/proc_impl.inc per ISA (picked by isa.h pick())
extern const ProcKernels proc_kernels_scalar, proc_kernels_avx2, proc_kernels_avx512;

}  // namespace ortlean
