#include "op.h"

#include <algorithm>

namespace ortlean {
namespace {

const char* type_name(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return "int32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return "uint8";
    default: return "of another type";
  }
}

}  // namespace

Ort::ConstValue const_input(const Ort::ConstKernelInfo& info, size_t i, const char* what,
                            ONNXTensorElementDataType type) {
  if (!input_present(info, i)) fail(std::string("input ") + what + " (" + std::to_string(i) + ") is missing");
  int is_const = 0;
  Ort::ConstValue v = info.GetTensorConstantInput(i, &is_const);
  if (!is_const)
    fail(std::string("input ") + what + " (input " + std::to_string(i) +
         ") must be a constant initializer (the kernel validates and packs it once)");
  if (v.GetTensorTypeAndShapeInfo().GetElementType() != type)
    fail(std::string("input ") + what + " must be " + type_name(type));
  return v;
}

RowsIO rows_io(Ort::KernelContext& ctx, int64_t K, int64_t N) {
  RowsIO io;
  Ort::ConstValue xv = ctx.GetInput(0);
  {
    auto xi = xv.GetTensorTypeAndShapeInfo();
    io.rank = xi.GetDimensionsCount();
    if (io.rank == 0 || io.rank > kMaxRank)
      fail("input X must have rank 1.." + std::to_string(kMaxRank) + ", got " + std::to_string(io.rank));
    Ort::ThrowOnError(Ort::GetApi().GetDimensions(xi, io.dims, io.rank));  // the wrapper's array overload is deprecated
  }
  if (io.dims[io.rank - 1] != K)
    fail("input X has shape " + shape_str(std::vector<int64_t>(io.dims, io.dims + io.rank)) + ": last dim must be K = " +
         std::to_string(K));
  io.M = 1;
  for (size_t i = 0; i + 1 < io.rank; ++i) io.M *= io.dims[i];
  int64_t ys[kMaxRank];
  std::copy(io.dims, io.dims + io.rank, ys);
  ys[io.rank - 1] = N;
  io.X = xv.GetTensorData<float>();
  io.Y = ctx.GetOutput(0, ys, io.rank).GetTensorMutableData<float>();
  return io;
}

}  // namespace ortlean
