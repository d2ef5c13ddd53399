// BlockQuantMatMul and BlockQuantGather (domain ai.ortlean, opset 1): weights in ggml's block formats,
// read in place from the session's constant initializer. Y = x̂ · Ŵᵀ + bias with int8 activations per
// block of 32, and Ŵ[indices]. Contract: DEVELOPERS.md and docs/block-quant.md; semantics:
// custom_ops/reference/blockquant.py; block structs and kernels: kernels/blockquant.h.
#pragma once
#include <array>
#include <string>
#include <vector>

#include "isa.h"
#include "kernels/blockquant.h"
#include "metrics.h"
#include "op.h"
#include "parallel.h"

namespace ortlean {

constexpr ONNXTensorElementDataType kAnyType = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;

// The attributes both ops share (names and defaults: kBqAttrs).
constexpr AttrSpec kBqOwnAttrs[] = {
    attr_required("format", AttrType::String).one_of("q4_0|q4_1|q5_0|q5_1|q8_0|q4_K|q5_K|q6_K|q4_f"),
    attr_required("K", AttrType::Int).range(1, kMaxDim),
    attr_required("N", AttrType::Int).range(1, kMaxDim),
    // q4_f: 16 | 32 | 64 | 128 | 256, absent = 32; another format: absent or its own block
    attr_optional("block_size", AttrType::Int).range(16, 256),
    // W's row layout: blocks (ggml's) | split (a row's integers, then its fp16 d array, then its m array)
    attr_string("layout", "blocks").one_of("blocks|split"),
    attr_optional("source", AttrType::String),
    attr_optional("bits_per_weight", AttrType::Float).positive(),
    attr_float("gap", NAN).at_least(0).or_nan(),  // NaN: not measured
};
constexpr auto kBqAttrs = join(kBqOwnAttrs, kLayerMetadata);
// BlockQuantMatMul's own: the activation integers, 8 (int8, default) | 16 (int16) bits per block of 32;
// glu: none (default) | silu — the gated unit of a SwiGLU MLP in the op: W's rows are the gate's N/2
// rows then the up projection's N/2, and Y[:, j] = silu(P[:, j]) * P[:, N/2 + j] of the product P
// (N/2 outputs; bias, when given, has the product's N); prefill_act_bits: the activation integers of the
// calls with M > 1 (prompt rows), 0 (default: act_bits) | 8 | 16 — M = 1 (decode) keeps act_bits
constexpr AttrSpec kBqActAttrs[] = {attr_int("act_bits", 8).range(8, 16), attr_string("glu", "none").one_of("none|silu"),
                                    attr_int("prefill_act_bits", 0)};  // 0 | 8 | 16: checked in the constructor
template <size_t A, size_t B>
constexpr std::array<AttrSpec, A + B> join_bq(const std::array<AttrSpec, A>& a, const AttrSpec (&b)[B]) {
  std::array<AttrSpec, A + B> r{};
  for (size_t i = 0; i < A; ++i) r[i] = a[i];
  for (size_t i = 0; i < B; ++i) r[A + i] = b[i];
  return r;
}
constexpr auto kBqMatMulAttrs = join_bq(kBqAttrs, kBqActAttrs);

// The extra CPU features of the copies: F16C (AVX2), AVX512_VNNI (AVX-512; without it the AVX2 copy runs).
constexpr CpuFeature kBqAvx2Needs = CpuFeature::F16c;
constexpr CpuFeature kBqAvx512Needs = CpuFeature::Avx512Vnni;

// A node's weights, validated (format, shape, finite fp16 scales) and its kernel table.
struct BqNode {
  BqLayer w{};
  std::vector<int32_t> plan;  // the kernels' per-node tables (w.plan points into it)
  const BlockQuantKernels* k = nullptr;
  Isa level = Isa::Scalar;
  float bits_per_weight = 0.0f;
};
// (the node is built in place: w.plan points into its own plan); act_bits: 8 | 16 (the gather: 8)
void read_bq_node(const Ort::ConstKernelInfo& info, const Attrs& at, size_t w_input, int act_bits, BqNode& nd);

class BlockQuantMatMulKernel : public OpKernel<BlockQuantMatMulKernel> {
 public:
  static constexpr const char* kOpType = "BlockQuantMatMul";
  // X, W, [bias]
  static constexpr IoSpec kInputs[] = {{kF32}, {kU8}, {kF32, kOptional}};
  static constexpr IoSpec kOutputs[] = {{kF32}};
  static constexpr auto kAttrs = kBqMatMulAttrs;

  explicit BlockQuantMatMulKernel(const Ort::ConstKernelInfo& info);  // throws on an invalid node
  void Compute(Ort::KernelContext& ctx) const;

 private:
  friend class BqCall;
  // the layer of a call with M rows: node_.w (act_bits) for M = 1, prefill_ (prefill_act_bits) for M > 1
  const BqLayer& layer(int64_t M) const { return M > 1 ? prefill_ : node_.w; }
  BqNode node_;
  // node_.w with prefill_act_bits (the same weight bytes; its own kernel plan when the bits differ)
  BqLayer prefill_{};
  std::vector<int32_t> prefill_plan_;
  const float* bias_ = nullptr;  // constant bias (else read per call)
  bool has_bias_ = false;
  bool glu_ = false;  // glu = "silu": N/2 outputs, silu(gate) * up
  mutable PoolProbe pool_;  // one-thread sessions keep the matvec in one task
  metrics::Value *m_calls_ = nullptr, *m_rows_ = nullptr, *m_nonfinite_ = nullptr;
  // decode calls (M = 1) with ORTLEAN_PHASE_TIMES=1 in the environment at construction (null otherwise):
  // wall microseconds of the whole call, of the pool's run, from its start to the first and to the last
  // task's start, of the longest task, from the last task's end to the run's return; and the calls
  std::array<metrics::Value*, 7> m_time_{};
};

class BlockQuantGatherKernel : public OpKernel<BlockQuantGatherKernel> {
 public:
  static constexpr const char* kOpType = "BlockQuantGather";
  // W, indices (int64 | int32)
  static constexpr IoSpec kInputs[] = {{kU8}, {kAnyType}};
  static constexpr IoSpec kOutputs[] = {{kF32}};
  static constexpr auto kAttrs = kBqAttrs;

  explicit BlockQuantGatherKernel(const Ort::ConstKernelInfo& info);
  void Compute(Ort::KernelContext& ctx) const;

 private:
  BqNode node_;
  metrics::Value *m_calls_ = nullptr, *m_rows_ = nullptr;
};

}  // namespace ortlean
