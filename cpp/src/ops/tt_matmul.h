// TTMatMul (domain ai.ortlean, opset 1): Y = (X * x_scale) . W(G1..Gd), W given by TT-matrix cores
// G_i [r_{i-1}, k_i, n_i, r_i]. Contract: DEVELOPERS.md; semantics: custom_ops/reference/tt.py.
#pragma once
#include <cmath>

#include "metrics.h"
#include "op.h"
#include "scratch.h"

namespace ortlean {

// Static description of the contraction chain (derived from the attributes).
struct TTPlan {
  int d = 0;
  std::vector<int64_t> mk, mn, ranks;
  int64_t K = 0, N = 0;
  // per step i: state in [P, inner, jr*m] -> out [P, rows, jr*m]
  struct Step {
    int64_t P, r0, k, n, r1, jr, inner, rows;
  };
  std::vector<Step> steps;
  int64_t max_state = 0;  // floats per input row, over all intermediate states (incl. K and N)
  bool lowrank = false;   // d == 2, modes_k = [K, 1], modes_n = [1, N]
  int64_t core_size(int i) const { return ranks[i] * mk[i] * mn[i] * ranks[i + 1]; }
};

class TTMatMulKernel : public OpKernel<TTMatMulKernel> {
 public:
  static constexpr const char* kOpType = "TTMatMul";
  // X, G1, G2, [G3], [G4], [x_scale]
  static constexpr IoSpec kInputs[] = {{kF32}, {kF32}, {kF32}, {kF32, kOptional}, {kF32, kOptional}, {kF32, kOptional}};
  static constexpr IoSpec kOutputs[] = {{kF32}};
  static constexpr auto kAttrs = join(
      {
          attr_required("modes_k", AttrType::Ints).range(1, kMaxDim),  // d = 2..4 entries, prod = K
          attr_required("modes_n", AttrType::Ints).range(1, kMaxDim),  // d entries, prod = N
          attr_required("ranks", AttrType::Ints).range(1, kMaxDim),    // d + 1 entries, first and last 1
          attr_optional("method", AttrType::String).one_of("svd|cross"),
          attr_float("gap", NAN).at_least(0).or_nan(),  // NaN: not measured
          attr_float("speedup", 0.0f).at_least(0),      // 0: not measured
      },
      kLayerMetadata);

  explicit TTMatMulKernel(const Ort::ConstKernelInfo& info);  // throws on an invalid node
  void Compute(Ort::KernelContext& ctx) const;

  struct CoreRef {
    const float* cm;   // [(r0 k), (n r1)] = the core as stored
    const float* cmt;  // [(n r1), (r0 k)] (general path only)
  };

 private:
  TTPlan plan_;
  bool has_scale_ = false;
  // constant initializers, packed at construction (empty when the input is not constant)
  AlignedBuf cm_[4], cmt_[4];
  bool core_const_[4] = {false, false, false, false};
  AlignedBuf scale_;
  bool scale_const_ = false;
  metrics::Value* m_calls_ = nullptr;
  metrics::Value* m_rows_ = nullptr;
  metrics::Value* m_nonfinite_ = nullptr;
};

}  // namespace ortlean
