// EventGatedMatMul (domain ai.ortlean, opset 1): Y = gated(X) . W with the layer's dense weights;
// per call and row it decides which input channels (rows of W) to read: zero-skip -> KWTA ->
// event-driven deltas (one ordering). Contract: DEVELOPERS.md; semantics:
// custom_ops/reference/gating.py. Per-sequence state travels as an extra graph input/output
// (like the KV cache, layout: event_state.h), so the kernel itself holds no per-sequence state.
#pragma once
#include <vector>

#include "kernels/gating.h"
#include "kernels/gemm.h"
#include "kernels/qgating.h"
#include "metrics.h"
#include "op.h"
#include "ops/event_state.h"
#include "parallel.h"
#include "scratch.h"

namespace ortlean {

// The node's gating attributes (names and defaults: EventGatedMatMulKernel::kAttrs).
struct GatingAttrs {
  int64_t block;
  int pack;  // 0 none, 1 binary, 2 ternary
  float pack_eps, pack_rho;
  bool kwta;
  int kwta_select;  // 0 threshold, 1 topk, 2 mass
  bool score_xw;
  float kwta_threshold, kwta_mass, kwta_temp;
  int64_t kwta_k, kwta_duty;
  bool kwta_renorm;
  bool event;
  float event_topk, event_quorum, event_theta, event_budget_ms;
  float event_gap_tol, event_beta, event_lambda;
  int64_t event_gap_every, event_age_max;
  bool dense_prefill;
};

// Cost model of several rows: per-row gated matvecs (row_cost * sum of kept fractions) against one
// dense product (fixed + per_row * rows), in units of one dense matvec of the weight format.
struct RowCost {
  double row_cost, fixed, per_row;
};

class EventGatedMatMulKernel : public OpKernel<EventGatedMatMulKernel> {
 public:
  static constexpr const char* kOpType = "EventGatedMatMul";
  // X, [W], [state_in], [Wq], [scales], [zero_points] -> Y, [state_out]
  // (W with weight_format f32; Wq, scales, [zero_points] with int8 | int4, Wq, scales with int4k:
  // kernels/qgating.h)
  static constexpr IoSpec kInputs[] = {{kF32},           {kF32, kOptional}, {kF32, kOptional},
                                       {kU8, kOptional}, {kF32, kOptional}, {kU8, kOptional}};
  static constexpr IoSpec kOutputs[] = {{kF32}, {kF32, kOptional}};
  // Every attribute and its default (custom_ops/reference/gating.py DEFAULTS must agree:
  // ortlean_op_schema_json exports these).
  static constexpr auto kAttrs = join({
      attr_int("block", 1).at_least(1),  // <= 2^31 - 1; > K: one block
      attr_string("weight_format", "f32").one_of("f32|int8|int4|int4k"),
      attr_int("weight_group", 32).range(16, 1024),  // a power of two; int4k: 16 | 32
      attr_optional("weight_shape", AttrType::Ints).range(1, kMaxDim),  // [K, N], quantized formats
      attr_string("pack", "none").one_of("none|binary|ternary"),
      attr_float("pack_eps", 0.0f).at_least(0),
      attr_float("pack_rho", 1.0f).fraction(),
      attr_int("kwta", 0).flag(),
      attr_string("kwta_select", "threshold").one_of("threshold|topk|mass"),
      attr_string("kwta_score", "xw").one_of("xw|x"),
      attr_float("kwta_threshold", 0.0f).at_least(0),
      attr_int("kwta_k", 0).range(0, kMaxDim),  // <= blocks; topk: >= 1
      attr_float("kwta_mass", 1.0f).fraction(),
      attr_float("kwta_temp", 0.0f).at_least(0),  // mass: > 0
      attr_int("kwta_duty", 1).range(1, kMaxSteps),
      attr_int("kwta_renorm", 0).flag(),
      attr_int("event", 0).flag(),
      attr_float("event_topk", 1.0f).fraction(),
      attr_float("event_quorum", 1.0f).fraction(),
      attr_float("event_theta", 0.0f).at_least(0),
      attr_float("event_budget_ms", 0.0f).at_least(0),
      attr_float("event_gap_tol", 0.03f).at_least(0),
      attr_int("event_gap_every", 16).range(0, kMaxSteps),
      attr_float("event_beta", 1.0f).positive(),
      attr_float("event_lambda", 0.0f).at_least(0),
      attr_int("event_age_max", 0).range(0, kMaxSteps),
      attr_int("dense_prefill", 0).flag(),
      attr_optional("keep_ratio", AttrType::Float).fraction(),
      attr_optional("gap", AttrType::Float).at_least(0).or_nan(),
      attr_optional("fused", AttrType::String),  // members of a fused group (metadata)
  }, kLayerMetadata);

  explicit EventGatedMatMulKernel(const Ort::ConstKernelInfo& info);  // throws on an invalid node
  void Compute(Ort::KernelContext& ctx) const;

 private:
  friend class GatingCall;
  void read_weights(const Ort::ConstKernelInfo& info, const Attrs& at);
  void read_int4k(const Ort::ConstKernelInfo& info, int64_t group);

  GatingAttrs a_{};
  int64_t K_ = 0, N_ = 0, nb_ = 0;
  EventStateLayout state_;     // state row layout (stateful nodes)
  bool stateful_ = false;
  const float* W_ = nullptr;   // f32: the constant initializer (owned by the session)
  int format_ = kWeightF32;    // WeightFormat
  QuantRows q_{};              // int8 | int4: the constant initializers (owned by the session)
  KQuantRows kq_{};            // int4k: the constant initializers (owned by the session)
  AlignedBuf norms_;           // ||W_k|| per row
  std::vector<int32_t> iota_;  // 0..K-1 (the dense path is the row kernel over every row)
  const GemmKernels* gemm_ = nullptr;
  const GatingKernels* gk_ = nullptr;
  const QGatingKernels* qk_ = nullptr;
  RowCost cost_{};             // per-row matvecs vs one dense product (per_row_wins, .cc)
  mutable PoolProbe pool_;     // is the intra-op pool wider than one thread? (matvec task split)
  metrics::Value *m_calls_ = nullptr, *m_rows_ = nullptr, *m_keep_ = nullptr, *m_duty_ = nullptr,
                 *m_density_ = nullptr, *m_active_ = nullptr, *m_pack_dense_ = nullptr, *m_ev_enabled_ = nullptr,
                 *m_ev_ms_ = nullptr, *m_ev_quorum_ = nullptr, *m_ev_topk_ = nullptr, *m_ev_gap_ = nullptr,
                 *m_ev_stale_ = nullptr, *m_ev_disables_ = nullptr, *m_ev_checks_ = nullptr, *m_ev_rows_ = nullptr,
                 *m_kept_ = nullptr, *m_chan_ = nullptr, *m_dense_rows_ = nullptr;
};

}  // namespace ortlean
