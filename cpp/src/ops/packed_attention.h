// PackedAttention (domain ai.ortlean, opset 1): attention over a bit-packed key cache, with
// popcount candidate search and exact refinement. Contract: DEVELOPERS.md; semantics:
// custom_ops/reference/attn.py. Key format: packed_keys.h.
#pragma once
#include <array>
#include <vector>

#include "isa.h"
#include "kernels/attn.h"
#include "kernels/gemm.h"
#include "metrics.h"
#include "op.h"
#include "ops/packed_keys.h"
#include "parallel.h"

namespace ortlean {

// The CPU features PackedAttention's kernel copies need beyond their ISA level: POPCNT (AVX2 copy),
// AVX512_VPOPCNTDQ and AVX512_VNNI (AVX-512 copy). Without them a node runs the copy below (also what
// ortlean_op_isa reports, so a figure's ISA label is the op's, not only the process's).
inline constexpr CpuFeature kAttnAvx2Needs = CpuFeature::Popcnt;
inline constexpr CpuFeature kAttnAvx512Needs = CpuFeature::Avx512VpopcntdqVnni;

struct AttnCall;

// The node's attribute values (names and defaults: PackedAttentionKernel::kAttrs).
struct AttnParams {
  float scale, eps, budget, rho, mix;
  int64_t approx_prefill, min_candidates, sinks, window, min_context, qbits;
  KeyMode mode;
  bool oracle;                   // select = "exact": candidates by exact scores (measurement only)
  bool k_bhdt;                   // K is [B, Hkv, D, T]
  std::vector<float> kscale;     // [Hkv * D] per-channel key scale folded into q for the popcount score
  std::vector<float> eps_heads;  // per KV head (eps modes), empty = eps for all
  std::vector<float> pq_book_t;  // pq mode: the pq_book attribute's centroids ([Hkv][D / 4][16][4]) transposed,
                                 // [Hkv][D / 4][4][16] (PackedKeyFormat::transpose_book)
  std::vector<int64_t> pq_dims;  // pq mode: subspace s = dims pq_dims[4s .. 4s + 3] (empty: 4s .. 4s + 3)
  int kv_bits = 0;               // 0: K/V are the context; 32 / 8 / 4: cache rows (past_kv) of fp32 / int8 / int4
  int64_t local_window = -1;     // kv cache mode: the last w keys [pos - w + 1, pos] when > 0
  float softcap = 0.0f;          // kv cache mode: softcap * tanh(logit / softcap) when > 0
  // kv cache mode, GroupQueryAttention's layout when > 0: Q/K/V [B, S, H * D] (K and V absent: Q
  // holds the packed [B, S, (Hq + 2 Hkv) * D]), Y [B, S, Hq * Dv]; rotary from cos/sin caches
  int64_t num_heads = 0, kv_num_heads = 0, rotary_interleaved = 0;
  // GroupQueryAttention's layout: key smoothing [Hkv * D] (empty: none): each query head times
  // ksmooth of its KV head, each new key times kinv = float(1 / ksmooth), before rotary — the cache
  // holds K / s, every logit is unchanged in real arithmetic; equal within each rotary pair
  std::vector<float> ksmooth, kinv;
  // kv cache mode: candidates chosen in blocks of this many consecutive keys (block score: the max of
  // its keys' scores), so that the rows read run in order; 1: key by key
  int64_t cand_block = 1;
  // kv cache mode, prompt rows: sparse prefill (prefill_sparse) when 0 < prefill_budget < 1
  float prefill_budget = 0.0f;
  int64_t prefill_block = 64, prefill_window = 1024, prefill_min_context = 4096;
  // sparse prefill: the last prefill_tail rows of each sequence's prompt rows in a call attend to every
  // key (the rows a reply is read from: the end of a prompt asks the question)
  int64_t prefill_tail = 0;
};

struct KvCall;

// set by ortlean_prompt_continues (register.cc) on the thread that runs the session: 1 while a driver
// runs a chunk of a prompt that a later run continues
extern thread_local int prompt_continues_flag;

class PackedAttentionKernel : public OpKernel<PackedAttentionKernel> {
 public:
  static constexpr const char* kOpType = "PackedAttention";
  // Q, [K], [V], [mask], [past_bits], [past_kv], [seqlens_k], [cos_cache], [sin_cache], [prompt_continues]
  //   -> Y, [present_bits], [present_kv]   (K, V absent only in the packed-QKV GQA layout)
  // prompt_continues: int32, one element; nonzero: a later call continues this call's prompt rows, so
  // they take no exact prefill_tail (the tail is the prompt's last rows, where a question is read);
  // absent: the calling thread's prompt_continues_flag says it
  static constexpr IoSpec kInputs[] = {{kF32}, {kF32, kOptional}, {kF32, kOptional}, {kF32, kOptional},
                                       {kI32, kOptional}, {kI32, kOptional}, {kI32, kOptional},
                                       {kF32, kOptional}, {kF32, kOptional}, {kI32, kOptional}};
  static constexpr IoSpec kOutputs[] = {{kF32}, {kI32, kOptional}, {kI32, kOptional}};
  static constexpr AttrSpec kAttrs[] = {
      attr_float("scale", 1.0f),  // any finite value
      attr_string("mode", "sign").one_of("sign|ternary|binary|pq"),
      attr_float("eps", 0.0f).at_least(0),
      attr_float("budget", 0.0f).range(0, 1),  // 0 or 1: exact
      attr_int("min_candidates", 64).range(0, kMaxDim),
      attr_int("sinks", 4).range(0, kMaxDim),
      attr_int("window", 64).range(0, kMaxDim),
      attr_int("min_context", 256).range(0, kMaxDim),
      attr_int("cand_block", 1).range(1, 4096),
      attr_float("prefill_budget", 0.0f).range(0, 1),  // 0 or 1: exact prompt rows
      attr_int("prefill_block", 64).range(8, 4096),
      attr_int("prefill_window", 1024).range(0, kMaxDim),
      attr_int("prefill_min_context", 4096).range(0, kMaxDim),
      attr_int("prefill_tail", 0).range(0, kMaxDim),
      attr_float("rho", 0.15f).range(0, 1),
      attr_int("qbits", 8).range(2, 16),
      attr_float("mix", 0.0f).range(0, 1),
      attr_string("popcnt", "auto").one_of("auto|vpopcntdq|avx2|scalar"),
      attr_string("k_layout", "bhtd").one_of("bhtd|bhdt"),
      attr_int("approx_prefill", 0).flag(),
      attr_list("eps_heads", AttrType::Floats).at_least(0),  // one per KV head
      attr_list("kscale", AttrType::Floats).at_least(0),     // KV heads x head dim
      attr_list("pq_book", AttrType::Floats),                // pq: KV heads x head dim x 16 (finite)
      attr_list("pq_dims", AttrType::Ints).range(0, kMaxDim),  // pq: a permutation of 0 .. D - 1, or empty
      attr_string("select", "popcount").one_of("popcount|exact"),
      attr_string("kv_quant", "none").one_of("none|fp32|int8|int4"),
      attr_int("local_window", -1).range(-1, kMaxDim),
      attr_float("softcap", 0.0f).at_least(0),
      attr_int("num_heads", 0).range(0, kMaxDim),     // > 0: GroupQueryAttention's Q/K/V/Y layout
      attr_int("kv_num_heads", 0).range(0, kMaxDim),
      attr_int("rotary_interleaved", 0).flag(),
      attr_list("ksmooth", AttrType::Floats),  // GQA layout: KV heads x head dim, > 0 and finite
      attr_optional("layer", AttrType::String),
  };

  explicit PackedAttentionKernel(const Ort::ConstKernelInfo& info);  // throws on an invalid node
  void Compute(Ort::KernelContext& ctx) const;

 private:
  void check_list_lengths(const Ort::ConstKernelInfo& info) const;
  void check_list_lengths(int64_t Hkv, int64_t D) const;
  void check_ksmooth(int64_t Hkv, int64_t D, int64_t half) const;
  // Q, K, V shapes (inputs 0-2), each checked to be rank 4
  std::array<std::vector<int64_t>, 3> qkv_shapes(Ort::KernelContext& ctx) const;
  AttnCall read_inputs(Ort::KernelContext& ctx) const;
  void pack_keys(AttnCall& c, Ort::KernelContext& ctx) const;
  void attend_rows(AttnCall& c, Ort::KernelContext& ctx) const;
  void attend_blocked(const AttnCall& c, Ort::KernelContext& ctx) const;
  // quantized cache mode (kv_quant = int8 | int4): packed_attention.cc "cache mode"
  void compute_kv(Ort::KernelContext& ctx) const;
  KvCall read_kv_inputs(Ort::KernelContext& ctx) const;
  // GroupQueryAttention's layout (num_heads > 0): Q/K/V shapes as [B, H, S, D], and the staged
  // [B, H, S, D] copies (rotary applied) the cache mode reads
  std::array<std::vector<int64_t>, 3> gqa_shapes(Ort::KernelContext& ctx) const;
  void stage_gqa(KvCall& c, Ort::KernelContext& ctx) const;
  void store_kv(KvCall& c, Ort::KernelContext& ctx) const;
  void select_kv(KvCall& c, Ort::KernelContext& ctx) const;
  void attend_kv(KvCall& c, Ort::KernelContext& ctx) const;
  // prompt rows (M > 1), every row exact, no mask: blocked GEMMs (true when it ran)
  bool prefill_gemm(KvCall& c, Ort::KernelContext& ctx) const;
  // prompt rows under sparse prefill (0 < prefill_budget < 1, no mask, no local window): tiles of
  // prefill_block rows over the sink, best-bounded middle and local key blocks (true when it ran)
  bool prefill_sparse(KvCall& c, Ort::KernelContext& ctx) const;

  AttnParams p_{};
  const AttnKernels* ak_ = nullptr;
  const GemmKernels* gemm_ = nullptr;
  mutable PoolProbe pool_;  // one-thread sessions: attend tasks of kKvChunk keys (no split for balance)
  metrics::Value *m_density_ = nullptr, *m_active_ = nullptr, *m_calls_ = nullptr, *m_cands_ = nullptr,
                 *m_keys_ = nullptr, *m_packed_ = nullptr;
  // sparse prefill: keys in the prompt rows' causal contexts, and the keys they attended (per KV head row)
  metrics::Value *m_pf_keys_ = nullptr, *m_pf_attended_ = nullptr;
  // cache mode, with ORTLEAN_PHASE_TIMES=1 in the environment at construction (null otherwise): wall
  // time (µs) of each phase of compute_kv, summed over calls (time.inputs_us, time.store_us, time.score_us,
  // time.select_us, time.attend_us, time.total_us; time.calls)
  std::array<metrics::Value*, 7> m_time_{};
};

}  // namespace ortlean
