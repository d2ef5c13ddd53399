// ProcSparseMatMul (domain ai.ortlean, opset 1): Y = X . W_hat, W_hat = hash base * base_scale + block
// deltas on the stored blocks of each output row (zero elsewhere). Contract: DEVELOPERS.md;
// semantics: custom_ops/reference/procsparse.py.
#pragma once
#include "attrs.h"
#include "metrics.h"
#include "ort_common.h"

namespace ortlean {

class ProcSparseMatMulKernel {
 public:
  ProcSparseMatMulKernel(const OrtApi& api, const OrtKernelInfo* info);  // throws on invalid node
  OrtStatusPtr ComputeV2(OrtKernelContext* context) noexcept;
  static const AttrTable kAttrs;  // attribute names, types, defaults (ortlean_op_schema_json)

 private:
  void Compute(OrtKernelContext* context) const;

  std::string name_;

  std::string err_prefix_;  // "ortlean ProcSparseMatMul node '<name>': " (built once: Compute allocates nothing for it)
  int64_t K_ = 0, N_ = 0, B_ = 0, nb_ = 0, nnzb_ = 0, max_row_ = 0;
  uint64_t seed_ = 0;
  float scale_ = 0.0f;
  bool has_mask_input_ = false;
  std::vector<int32_t> row_ptr_, bidx_;
  AlignedBuf deltas_;
  metrics::Value* m_calls_ = nullptr;
  metrics::Value* m_rows_ = nullptr;
  metrics::Value* m_visited_ = nullptr;
  metrics::Value* m_eff_fanout_ = nullptr;
  metrics::Value* m_nonfinite_ = nullptr;
};

struct ProcSparseMatMulOp : Ort::CustomOpBase<ProcSparseMatMulOp, ProcSparseMatMulKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** op_kernel) const;
  const char* GetName() const { return "ProcSparseMatMul"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  // X, row_ptr, block_idx, deltas, [block_mask]
  size_t GetInputTypeCount() const { return 5; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return (i == 1 || i == 2) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i < 4 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED
                 : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace ortlean
