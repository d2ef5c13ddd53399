// ProcSparseMatMul (domain ai.ortlean, opset 1): Y = X . W_hat, W_hat = hash base * base_scale + block
// deltas on the stored blocks of each output row (zero elsewhere). Contract: DEVELOPERS.md;
// semantics: custom_ops/reference/procsparse.py.
#pragma once
#include <cmath>

#include "kernels/proc.h"
#include "metrics.h"
#include "op.h"
#include "scratch.h"

namespace ortlean {

class ProcSparseMatMulKernel : public OpKernel<ProcSparseMatMulKernel> {
 public:
  static constexpr const char* kOpType = "ProcSparseMatMul";
  // X, row_ptr, block_idx, deltas, [block_mask]
  static constexpr IoSpec kInputs[] = {{kF32}, {kI32}, {kI32}, {kF32}, {kF32, kOptional}};
  static constexpr IoSpec kOutputs[] = {{kF32}};
  static constexpr auto kAttrs = join(
      {
          attr_required("shape", AttrType::Ints).range(1, kMaxDim),  // [K, N]
          attr_required("block", AttrType::Int),                     // 32 | 64
          attr_required("seed", AttrType::Int),                      // any (used as uint64)
          attr_required("base_scale", AttrType::Float),              // any finite value
          attr_int("fanout", 0).at_least(0),                         // <= ceil(K / block); 0: no cap
          attr_int("watermark", 0).range(0, kMaxDim),                // 0: no cap
          attr_float("shed_eps", 0.0f).at_least(0),
          attr_int("trims", 0).at_least(0),
          attr_float("gap", NAN).at_least(0).or_nan(),  // NaN: not measured
          attr_optional("bytes_stored", AttrType::Int).at_least(0),
          attr_float("speedup", 0.0f).at_least(0),  // 0: not measured
      },
      kLayerMetadata);

  explicit ProcSparseMatMulKernel(const Ort::ConstKernelInfo& info);  // throws on an invalid node
  void Compute(Ort::KernelContext& ctx) const;

 private:
  int64_t guard_nonfinite(const float* X, float* Y, int64_t M, const float* mask, int64_t ldmask) const;

  // the layer's constant inputs, validated and copied at construction; L_ points into them
  std::vector<int32_t> row_ptr_, bidx_;
  AlignedBuf deltas_;
  ProcLayer L_{};
  int64_t nnzb_ = 0, max_row_ = 0;  // stored blocks, most blocks in one row
  bool has_mask_input_ = false;
  const ProcKernels* pk_ = nullptr;
  metrics::Value* m_calls_ = nullptr;
  metrics::Value* m_rows_ = nullptr;
  metrics::Value* m_visited_ = nullptr;
  metrics::Value* m_nonfinite_ = nullptr;
};

}  // namespace ortlean
