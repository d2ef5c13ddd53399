// EventGatedMatMul (domain ai.ortlean, opset 1): Y = gated(X) . W with the layer's dense weights;
// per call and row it decides which input channels (rows of W) to read: zero-skip -> KWTA ->
// event-driven deltas (one ordering). Contract: DEVELOPERS.md; semantics:
// custom_ops/reference/gating.py. Per-sequence state travels as an extra graph input/output
// (like the KV cache), so the kernel itself holds no per-sequence state.
#pragma once
#include "kernels/gating.h"
#include "attrs.h"
#include "metrics.h"
#include "ort_common.h"

namespace ortlean {

// The node's gating attributes (values and defaults: kAttrSpecs in event_gated_matmul.cc).
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

class EventGatedMatMulKernel {
 public:
  EventGatedMatMulKernel(const OrtApi& api, const OrtKernelInfo* info);  // throws on invalid node
  OrtStatusPtr ComputeV2(OrtKernelContext* context) noexcept;
  static const AttrTable kAttrs;  // attribute names, types, defaults (ortlean_op_schema_json)

  static constexpr int64_t kHdr = 8;

 private:
  void Compute(OrtKernelContext* context) const;
  void dense_product(const Ort::KernelContext& ctx, const float* A, int64_t m, float* C) const;

  std::string name_;

  std::string err_prefix_;  // "ortlean EventGatedMatMul node '<name>': " (built once: Compute allocates nothing for it)
  GatingAttrs a_{};
  int64_t K_ = 0, N_ = 0, nb_ = 0, S_ = 0;
  bool stateful_ = false;
  const float* W_ = nullptr;   // the constant initializer (owned by the session)
  AlignedBuf norms_;           // ||W_k|| per row
  std::vector<int32_t> iota_;  // 0..K-1 (the dense path is the row kernel over every row)
  mutable PoolProbe pool_;     // is the intra-op pool wider than one thread? (matvec task split)
  metrics::Value *m_calls_ = nullptr, *m_rows_ = nullptr, *m_keep_ = nullptr, *m_duty_ = nullptr,
                 *m_density_ = nullptr, *m_active_ = nullptr, *m_pack_dense_ = nullptr, *m_ev_enabled_ = nullptr,
                 *m_ev_ms_ = nullptr, *m_ev_quorum_ = nullptr, *m_ev_topk_ = nullptr, *m_ev_gap_ = nullptr,
                 *m_ev_stale_ = nullptr, *m_ev_disables_ = nullptr, *m_ev_checks_ = nullptr, *m_ev_rows_ = nullptr,
                 *m_kept_ = nullptr, *m_chan_ = nullptr, *m_dense_rows_ = nullptr;

  friend struct GatingCall;
};

struct EventGatedMatMulOp : Ort::CustomOpBase<EventGatedMatMulOp, EventGatedMatMulKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** op_kernel) const;
  const char* GetName() const { return "EventGatedMatMul"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i < 2 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED
                 : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i < 1 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED
                 : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL;
  }
};

const GatingKernels& gating_kernels();

}  // namespace ortlean
