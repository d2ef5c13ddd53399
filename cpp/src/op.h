// The op base: everything an ortlean op needs from ONNX Runtime's custom-op interface, written once.
//
// An op is a kernel class deriving from OpKernel<Kernel> that declares its signature as static
// members and defines a constructor and Compute():
//
//   class FooKernel : public OpKernel<FooKernel> {
//    public:
//     static constexpr const char* kOpType = "Foo";
//     static constexpr IoSpec kInputs[] = {{kF32}, {kF32, kOptional}};
//     static constexpr IoSpec kOutputs[] = {{kF32}};
//     static constexpr AttrSpec kAttrs[] = {attr_int("block", 1), ...};  // see attrs.h
//     explicit FooKernel(const Ort::ConstKernelInfo& info);  // validates; throws OpError via fail()
//     void Compute(Ort::KernelContext& ctx) const;           // re-entrant; throws OpError
//   };
//
// OpDef<FooKernel> is the OrtCustomOp ORT sees (register.cc lists the ops): it builds the kernel
// and runs Compute behind a guard that turns every exception into an OrtStatus whose message names
// the op and the node ("ortlean Foo node '/x/MatMul': ..."): nothing crosses the C boundary.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include "attrs.h"
#include "ort_api.h"

namespace ortlean {

// Largest dimension / count an op accepts (BLAS and the kernels index with 32-bit ints).
constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;

constexpr ONNXTensorElementDataType kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr ONNXTensorElementDataType kI32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
constexpr ONNXTensorElementDataType kU8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
constexpr bool kOptional = true;

struct IoSpec {
  ONNXTensorElementDataType type;
  bool optional = false;
};

template <class Kernel>
class OpKernel {
 public:
  // ORT calls this for every Run() (concurrently on one instance).
  OrtStatusPtr ComputeV2(OrtKernelContext* context) noexcept {
    return status_guard(err_prefix_, [&] {
      Ort::KernelContext ctx(context);
      static_cast<const Kernel*>(this)->Compute(ctx);
    });
  }
  const std::string& name() const { return name_; }

 protected:
  explicit OpKernel(const Ort::ConstKernelInfo& info)
      : name_(info.GetNodeName()), err_prefix_(std::string("ortlean ") + Kernel::kOpType + " node '" + name_ + "': ") {}

  const std::string name_;        // the node's name (metrics key)
  const std::string err_prefix_;  // built once: Compute allocates nothing for it
};

// "ortlean <op>: " then, once the node name is known, "ortlean <op> node '<name>': " prefixes any
// construction error.
template <class Kernel>
OrtStatus* create_kernel_guarded(const OrtKernelInfo* info, void** op_kernel) noexcept {
  *op_kernel = nullptr;
  std::string prefix = std::string("ortlean ") + Kernel::kOpType + ": ";
  if (OrtStatus* st = status_guard(prefix, [&] {
        prefix = std::string("ortlean ") + Kernel::kOpType + " node '" + Ort::ConstKernelInfo{info}.GetNodeName() + "': ";
      }))
    return st;
  return status_guard(prefix, [&] { *op_kernel = new Kernel(Ort::ConstKernelInfo{info}); });
}

// The OrtCustomOp of a kernel class, from its static signature.
template <class Kernel>
struct OpDef : Ort::CustomOpBase<OpDef<Kernel>, Kernel, true> {
  OpDef() { this->version = kOrtApiVersion; }  // newer headers would announce a newer struct; ask for 1.21's
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** op_kernel) const {
    return create_kernel_guarded<Kernel>(info, op_kernel);
  }
  const char* GetName() const { return Kernel::kOpType; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return std::size(Kernel::kInputs); }
  ONNXTensorElementDataType GetInputType(size_t i) const { return Kernel::kInputs[i].type; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const { return of(Kernel::kInputs[i]); }
  size_t GetOutputTypeCount() const { return std::size(Kernel::kOutputs); }
  ONNXTensorElementDataType GetOutputType(size_t i) const { return Kernel::kOutputs[i].type; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const { return of(Kernel::kOutputs[i]); }

 private:
  static OrtCustomOpInputOutputCharacteristic of(const IoSpec& s) {
    return s.optional ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                      : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
};

// ------------------------------------------------------------------ construction helpers
// Whether input i is wired (optional inputs may be absent or the empty name).
inline bool input_present(const Ort::ConstKernelInfo& info, size_t i) {
  return i < info.GetInputCount() && !info.GetInputName(i).empty();
}

// A constant initializer input of the given element type, or an error naming it (`what`).
Ort::ConstValue const_input(const Ort::ConstKernelInfo& info, size_t i, const char* what,
                            ONNXTensorElementDataType type);

// ------------------------------------------------------------------ compute helpers
constexpr size_t kMaxRank = 16;

// Y = op(X [..., K]) with Y [..., N]: X's shape in a fixed array (no heap allocation per call),
// the output allocated with the same leading dims, M = prod(leading dims) rows.
struct RowsIO {
  const float* X;
  float* Y;
  int64_t M;
  int64_t dims[kMaxRank];  // X's shape
  size_t rank;
};
RowsIO rows_io(Ort::KernelContext& ctx, int64_t K, int64_t N);

}  // namespace ortlean
