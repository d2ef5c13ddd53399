// PackedAttention (domain ai.ortlean, opset 1): attention over a bit-packed key cache, with
// popcount candidate search and exact refinement. Contract: DEVELOPERS.md; semantics:
// custom_ops/reference/attn.py.
#pragma once
#include "kernels/attn_kernels.h"
#include "attrs.h"
#include "metrics.h"
#include "ort_common.h"

namespace ortlean {

class PackedAttentionKernel {
 public:
  PackedAttentionKernel(const OrtApi& api, const OrtKernelInfo* info);  // throws on invalid node
  OrtStatusPtr ComputeV2(OrtKernelContext* context) noexcept;
  static const AttrTable kAttrs;  // attribute names, types, defaults (ortlean_op_schema_json)

  enum Mode { kSign = 0, kTernary = 1, kBinary = 2 };

 private:
  void Compute(OrtKernelContext* context) const;

  std::string name_;

  std::string err_prefix_;  // "ortlean PackedAttention node '<name>': " (built once: Compute allocates nothing for it)
  // attribute values (defaults: kAttrSpecs in packed_attention.cc)
  float scale_ = 0.0f, eps_ = 0.0f, budget_ = 0.0f, rho_ = 0.0f, mix_ = 0.0f;
  int64_t approx_prefill_ = 0;
  int64_t min_candidates_ = 0, sinks_ = 0, window_ = 0, min_context_ = 0, qbits_ = 0;
  int mode_ = kSign;
  bool oracle_ = false;  // select = "exact": candidates by exact scores (measurement only)
  std::vector<float> kscale_;     // [Hkv * D] per-channel key scale folded into q for the popcount score
  std::vector<float> eps_heads_;  // per KV head (eps modes), empty = eps_ for all
  bool k_bhdt_ = false;
  const AttnKernels* ak_ = nullptr;
  metrics::Value *m_density_ = nullptr, *m_active_ = nullptr, *m_calls_ = nullptr, *m_cands_ = nullptr,
                 *m_keys_ = nullptr, *m_packed_ = nullptr;
};

struct PackedAttentionOp : Ort::CustomOpBase<PackedAttentionOp, PackedAttentionKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** op_kernel) const;
  const char* GetName() const { return "PackedAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 5; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 4 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i < 3 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED
                 : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i == 0 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED
                  : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL;
  }
};

}  // namespace ortlean
