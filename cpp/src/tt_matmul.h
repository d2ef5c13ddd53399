// TTMatMul (domain ai.ortlean, opset 1): Y = (X * x_scale) . W(G1..Gd), W given by TT-matrix cores
// G_i [r_{i-1}, k_i, n_i, r_i]. Contract: DEVELOPERS.md; semantics: custom_ops/reference/tt.py.
#pragma once
#include "attrs.h"
#include "metrics.h"
#include "ort_common.h"

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

class TTMatMulKernel {
 public:
  TTMatMulKernel(const OrtApi& api, const OrtKernelInfo* info);  // throws on invalid node
  OrtStatusPtr ComputeV2(OrtKernelContext* context) noexcept;
  const std::string& name() const { return name_; }
  static const AttrTable kAttrs;  // attribute names, types, defaults (ortlean_op_schema_json)

  struct CoreRef {
    const float* cm;   // [(r0 k), (n r1)] = the core as stored
    const float* cmt;  // [(n r1), (r0 k)] (general path only)
  };

 private:
  void Compute(OrtKernelContext* context) const;

  std::string name_;

  std::string err_prefix_;  // "ortlean TTMatMul node '<name>': " (built once: Compute allocates nothing for it)
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

struct TTMatMulOp : Ort::CustomOpBase<TTMatMulOp, TTMatMulKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** op_kernel) const;
  const char* GetName() const { return "TTMatMul"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 6; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i < 3 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED
                 : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace ortlean
