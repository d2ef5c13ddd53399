#include "ops/packed_attention.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <chrono>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <functional>

#include <emmintrin.h>

#include "blas.h"
#include "isa.h"
#include "parallel.h"
#include "scratch.h"

namespace ortlean {

thread_local int prompt_continues_flag = 0;

// One Compute() call: shapes, inputs, the key bits, and what the call may approximate.
struct AttnCall {
  int64_t B, Hq, M, D, Hkv, T, Dv, rep;
  PackedKeyFormat fmt;
  const float *Q = nullptr, *K = nullptr, *V = nullptr;
  float* Y = nullptr;
  // additive mask: element (b, h, m, t) at mask + b*msb + h*msh + m*msm + t*mst (broadcast dims: 0)
  const float* mask = nullptr;
  int64_t msb = 0, msh = 0, msm = 0, mst = 0;
  const int32_t* past = nullptr;  // [B, Hkv, P, words] or nullptr
  int64_t P = 0;
  bool want_bits = false;     // present_bits is wired
  uint32_t* bits = nullptr;   // [B, Hkv, T, words] once packed
  bool global_exact = false;  // no row may use candidates (budget outside (0, 1), or auto-disabled)
  bool exact = false;         // no row of this call uses candidates

  const float* mask_row(int64_t b, int64_t h, int64_t m) const {
    return mask ? mask + b * msb + h * msh + m * msm : nullptr;
  }
};

namespace {

constexpr int64_t kRowBlock = 32;  // query rows per task in the exact (prefill) path
constexpr int64_t kAhead = 6;      // candidate rows are scattered: prefetch a few rows ahead

inline int popc(uint32_t x) { return __builtin_popcount(x); }

// Candidates for a context of t keys: max(min_candidates, ceil(budget * t)).
int64_t n_candidates(const AttnParams& p, int64_t t) {
  return std::max<int64_t>(p.min_candidates, static_cast<int64_t>(std::ceil(static_cast<double>(p.budget) * t)));
}

// Per-row working memory of the row path, carved from the task scratch.
struct RowBufs {
  float* s;       // [T] logits (also the ternary popcount of plane 1)
  float* approx;  // [T] approximate scores
  int64_t* idx;   // [T] candidate keys
  uint32_t* qp;   // [16, nw] bit planes of the positive quantized query
  uint32_t* qn;   // [16, nw] negative
  float* y;       // [Dv]
  float* qk;      // [D] K column gather (bhdt), then [D] q * kscale
  float* tmp;     // [T] selection copy

  // false when the scratch cannot grow (out of memory)
  bool bind(int64_t T, int64_t nw, int64_t D, int64_t Dv) noexcept {
    try {
      s = task_scratch().get(static_cast<size_t>(5 * T + 2 * 16 * nw + Dv + 2 * D + 64));
    } catch (...) {
      return false;
    }
    approx = s + T;
    idx = reinterpret_cast<int64_t*>(approx + T);
    qp = reinterpret_cast<uint32_t*>(idx + T);
    qn = qp + 16 * nw;
    y = reinterpret_cast<float*>(qn + 16 * nw);
    qk = y + Dv;
    tmp = qk + 2 * D;
    return true;
  }
};

// The popcount score of every key for query q of KV head hk (approx[t]), or exact scores with the
// oracle; 0 when q is all zeros.
void approx_scores(const AttnParams& p, const AttnCall& c, const AttnKernels& ak, int64_t b, int64_t hk,
                   const float* q, const float* Kh, RowBufs& w) {
  const int64_t T = c.T, D = c.D, nw = c.fmt.nw;
  if (p.oracle && !p.k_bhdt) {
    for (int64_t t = 0; t < T; ++t) w.approx[t] = ak.dot(q, Kh + t * D, D) * p.scale;
    return;
  }
  const float* qa = q;  // the query of the popcount score: q, or q * kscale of this KV head
  if (!p.kscale.empty()) {
    float* qsc = w.qk + D;
    const float* ks = p.kscale.data() + hk * D;
    for (int64_t d = 0; d < D; ++d) qsc[d] = q[d] * ks[d];
    qa = qsc;
  }
  float a = 0.0f;
  for (int64_t d = 0; d < D; ++d) a = std::max(a, std::fabs(qa[d]));
  if (!(a > 0)) {
    std::fill(w.approx, w.approx + T, 0.0f);
    return;
  }
  const float L = static_cast<float>((1 << (p.qbits - 1)) - 1);
  const int nb = static_cast<int>(p.qbits - 1);
  const float inv = L / a;
  std::memset(w.qp, 0, sizeof(uint32_t) * 2 * 16 * nw);
  int64_t qsum = 0;
  for (int64_t d = 0; d < D; ++d) {
    const float v = qa[d] * inv;  // in [-L, L], or NaN when q holds NaN / inf
    const int32_t qi = std::isnan(v) ? 0 : static_cast<int32_t>(std::nearbyint(v));
    qsum += qi;
    const uint32_t mag = static_cast<uint32_t>(qi < 0 ? -qi : qi);
    uint32_t* pl = qi < 0 ? w.qn : w.qp;
    for (int bb = 0; bb < nb; ++bb)
      if (mag >> bb & 1u) pl[bb * nw + (d >> 5)] |= 1u << (d & 31);
  }
  const int64_t W = c.fmt.words;
  const uint32_t* kb = c.bits + (b * c.Hkv + hk) * T * W;
  int32_t* core = reinterpret_cast<int32_t*>(w.approx);
  ak.popcore(kb, W, T, nw, w.qp, w.qn, nb, core);
  if (p.mode == KeyMode::Ternary) {
    int32_t* core1 = reinterpret_cast<int32_t*>(w.s);
    ak.popcore(kb + nw, W, T, nw, w.qp, w.qn, nb, core1);
    for (int64_t t = 0; t < T; ++t) core[t] -= core1[t];
  } else if (p.mode == KeyMode::Sign) {
    for (int64_t t = 0; t < T; ++t) core[t] = 2 * core[t] - static_cast<int32_t>(qsum);
  }
  const float coef = (a / L) * p.scale;
  for (int64_t t = 0; t < T; ++t) w.approx[t] = static_cast<float>(core[t]) * c.fmt.gamma_of(kb + t * W) * coef;
}

// Candidate keys in w.idx (index order): the first `sinks`, the last `window`, and the best C - those
// of the rest by approx + mask (ties: lower index). Returns how many.
int64_t select_candidates(const AttnParams& p, const AttnCall& c, const float* mr, int64_t Tr, int64_t C,
                          RowBufs& w) {
  const int64_t ns = std::min(p.sinks, Tr), w0 = std::max(ns, Tr - p.window);
  int64_t n = 0;
  for (int64_t t = 0; t < ns; ++t) w.idx[n++] = t;
  const int64_t n_top = std::max<int64_t>(0, C - ns - (Tr - w0));
  const int64_t nr = w0 - ns, k = std::min(n_top, nr);
  // scores of the middle keys; the k-th largest by nth_element on a contiguous copy, then one
  // forward pass keeps those above it and the first ties (lower index first): the result is in
  // index order (no sort) and equals "top k by (score desc, index asc)".
  float* s = w.s;
  float* sc = s + ns;  // s[t] for t in [ns, w0)
  for (int64_t t = ns; t < w0; ++t) {
    const float v = w.approx[t] + (mr ? mr[t * c.mst] : 0.0f);
    s[t] = std::isnan(v) ? -INFINITY : v;  // NaN ranks last (nth_element needs a strict weak order)
  }
  if (k >= nr) {
    for (int64_t t = ns; t < w0; ++t) w.idx[n++] = t;
  } else if (k > 0) {
    std::memcpy(w.tmp, sc, sizeof(float) * nr);
    std::nth_element(w.tmp, w.tmp + (k - 1), w.tmp + nr, std::greater<float>());
    const float thr = w.tmp[k - 1];
    int64_t above = 0;
    for (int64_t i = 0; i < nr; ++i) above += sc[i] > thr;
    int64_t ties = k - above;
    for (int64_t t = ns; t < w0; ++t) {
      const float v = s[t];
      if (v > thr || (v == thr && ties-- > 0)) w.idx[n++] = t;
    }
  }
  for (int64_t t = w0; t < Tr; ++t) w.idx[n++] = t;
  return n;
}

// yo = softmax(scale * q.k + mask (+ mix)) . V over the n keys w.idx[0:n) (a row with every logit
// -inf gives 0).
void attend_candidates(const AttnParams& p, const AttnCall& c, const AttnKernels& ak, const float* q,
                       const float* Kh, const float* Vh, const float* mr, int64_t n, bool gaps, RowBufs& w,
                       float* yo) {
  const int64_t T = c.T, D = c.D, Dv = c.Dv;
  float* s = w.s;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = w.idx[i];
    if (gaps && !p.k_bhdt && i + kAhead < n) {
      const char* pk = reinterpret_cast<const char*>(Kh + w.idx[i + kAhead] * D);
      for (int64_t o = 0; o < D * 4; o += 64) __builtin_prefetch(pk + o);
    }
    float l;
    if (!p.k_bhdt) {
      l = ak.dot(q, Kh + t * D, D) * p.scale;
    } else {
      for (int64_t d = 0; d < D; ++d) w.qk[d] = Kh[d * T + t];
      l = ak.dot(q, w.qk, D) * p.scale;
    }
    if (p.mix > 0) l = l + p.mix * (w.approx[t] - l);
    s[i] = l + (mr ? mr[t * c.mst] : 0.0f);
  }
  const float mx = ak.maxv(s, n);
  if (!(mx > -INFINITY)) {
    std::fill(yo, yo + Dv, 0.0f);
    return;
  }
  const float sum = ak.expsum(s, mx, n);
  std::fill(w.y, w.y + Dv, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    if (gaps && i + kAhead < n) {
      const char* pv = reinterpret_cast<const char*>(Vh + w.idx[i + kAhead] * Dv);
      for (int64_t o = 0; o < Dv * 4; o += 64) __builtin_prefetch(pv + o);
    }
    if (s[i] != 0.0f) ak.axpy(s[i], Vh + w.idx[i] * Dv, w.y, Dv);
  }
  const float inv = 1.0f / sum;
  for (int64_t d = 0; d < Dv; ++d) yo[d] = w.y[d] * inv;
}

}  // namespace

// ------------------------------------------------------------------ construction
PackedAttentionKernel::PackedAttentionKernel(const Ort::ConstKernelInfo& info) : OpKernel(info) {
  const Attrs at(info, kAttrs);
  AttnParams& p = p_;
  std::string mode, layout, popcnt, select;
  at.read({{"scale", &p.scale}, {"eps", &p.eps}, {"budget", &p.budget}, {"rho", &p.rho}, {"mix", &p.mix},
           {"mode", &mode}, {"k_layout", &layout}, {"popcnt", &popcnt}, {"select", &select}});
  at.read({{"min_candidates", &p.min_candidates}, {"sinks", &p.sinks}, {"window", &p.window},
           {"min_context", &p.min_context}, {"qbits", &p.qbits}, {"approx_prefill", &p.approx_prefill},
           {"eps_heads", &p.eps_heads}, {"kscale", &p.kscale}});
  std::vector<float> pq_book;  // kept only as pq_book_t, its transpose
  at.read({{"pq_book", &pq_book}, {"pq_dims", &p.pq_dims}});
  std::string kvq;
  at.read({{"kv_quant", &kvq}, {"softcap", &p.softcap}});
  at.read({{"local_window", &p.local_window}, {"num_heads", &p.num_heads}, {"kv_num_heads", &p.kv_num_heads},
           {"rotary_interleaved", &p.rotary_interleaved}, {"cand_block", &p.cand_block}});
  at.read({{"ksmooth", &p.ksmooth}});
  at.read({{"prefill_budget", &p.prefill_budget}, {"prefill_block", &p.prefill_block},
           {"prefill_window", &p.prefill_window}, {"prefill_min_context", &p.prefill_min_context},
           {"prefill_tail", &p.prefill_tail}});
  p.kv_bits = kvq == "fp32" ? 32 : kvq == "int8" ? 8 : kvq == "int4" ? 4 : 0;
  if (!p.kv_bits && p.prefill_budget > 0 && p.prefill_budget < 1)
    fail("attribute prefill_budget " + std::to_string(p.prefill_budget) + " needs kv_quant fp32 | int8 | int4");
  if (p.kv_bits && p.mix > 0) fail("attribute mix must be 0 with kv_quant " + kvq);
  if (p.kv_bits && layout != "bhtd") fail("attribute k_layout must be bhtd with kv_quant " + kvq);
  if (!p.kv_bits && p.cand_block != 1)
    fail("attribute cand_block " + std::to_string(p.cand_block) + " needs kv_quant fp32 | int8 | int4 (1 without)");
  if ((p.num_heads > 0) != (p.kv_num_heads > 0))
    fail("attributes num_heads and kv_num_heads go together (GroupQueryAttention's layout)");
  if (p.num_heads > 0 && !p.kv_bits) fail("attribute num_heads needs kv_quant fp32 | int8 | int4");
  if (p.num_heads > 0 && p.num_heads % p.kv_num_heads)
    fail("num_heads " + std::to_string(p.num_heads) + " not a multiple of kv_num_heads " +
         std::to_string(p.kv_num_heads));
  if (!p.ksmooth.empty()) {
    if (p.num_heads <= 0) fail("attribute ksmooth needs GroupQueryAttention's layout (num_heads > 0)");
    if (p.num_heads > 0 && static_cast<int64_t>(p.ksmooth.size()) % p.kv_num_heads)
      fail("attribute ksmooth has " + std::to_string(p.ksmooth.size()) + " values, not KV heads (" +
           std::to_string(p.kv_num_heads) + ") x head dim");
    for (size_t i = 0; i < p.ksmooth.size(); ++i) {
      const float s = p.ksmooth[i];
      if (!(s > 0.0f) || !std::isfinite(s) || !std::isfinite(1.0f / s))
        fail("attribute ksmooth[" + std::to_string(i) + "] = " + std::to_string(s) +
             ": must be finite and > 0 (with a finite reciprocal)");
      p.kinv.push_back(1.0f / s);
    }
  }
  p.mode = mode == "ternary" ? KeyMode::Ternary : mode == "binary" ? KeyMode::Binary : mode == "pq" ? KeyMode::Pq
                                                                                               : KeyMode::Sign;
  if (p.mode == KeyMode::Pq) {
    if (!p.kv_bits) fail("attribute mode pq needs kv_quant fp32 | int8 | int4");
    if (pq_book.empty()) fail("attribute mode pq needs pq_book (KV heads x head dim x 16 centroid values)");
    if (!p.kscale.empty()) fail("attribute kscale does not apply to mode pq (the centroids keep the magnitudes)");
    std::vector<char> seen(p.pq_dims.size(), 0);
    for (const int64_t d : p.pq_dims) {
      if (d >= static_cast<int64_t>(seen.size()) || seen[static_cast<size_t>(d)])
        fail("attribute pq_dims must be a permutation of 0 .. " + std::to_string(p.pq_dims.size() - 1) + ", has " +
             std::to_string(d) + (d < static_cast<int64_t>(seen.size()) ? " twice" : ""));
      seen[static_cast<size_t>(d)] = 1;
    }
    p.pq_book_t = PackedKeyFormat::transpose_book(pq_book);
  } else if (!pq_book.empty() || !p.pq_dims.empty()) {
    fail("attributes pq_book / pq_dims need mode pq, got mode " + mode);
  }
  p.k_bhdt = layout == "bhdt";
  p.oracle = select == "exact";
  check_list_lengths(info);
  // popcount path: requested (auto | vpopcntdq | avx2 | scalar), clamped to the CPU and ORTLEAN_ISA
  const Isa cap = popcnt == "scalar" ? Isa::Scalar : popcnt == "avx2" ? Isa::Avx2 : Isa::Avx512;
  Isa level;
  ak_ = &pick(IsaTables<AttnKernels>{attn_kernels_scalar, attn_kernels_avx2, attn_kernels_avx512, kAttnAvx2Needs,
                                     kAttnAvx512Needs},
              cap, &level);
  gemm_ = &gemm_kernels();

  metrics::Node* n = metrics::node(name_);
  n->set({{"pack.enabled", p.budget > 0 && p.budget < 1 ? 1.0 : 0.0},
          {"pack.mode", static_cast<double>(p.mode)},
          {"pack.popcnt", static_cast<double>(level)},
          {"pack.budget", p.budget}});
  n->gauges({{&m_density_, "pack.density"}});
  n->counters({{&m_active_, "pack.active"}, {&m_calls_, "pack.calls"}, {&m_cands_, "pack.candidates"},
               {&m_keys_, "pack.keys"}, {&m_packed_, "pack.packed_keys"},
               {&m_pf_keys_, "pack.prefill_keys"}, {&m_pf_attended_, "pack.prefill_attended"}});
  if (p.kv_bits && metrics::phase_times())
    n->counters({{&m_time_[0], "time.inputs_us"}, {&m_time_[1], "time.store_us"}, {&m_time_[2], "time.score_us"},
                 {&m_time_[3], "time.select_us"}, {&m_time_[4], "time.attend_us"}, {&m_time_[5], "time.total_us"},
                 {&m_time_[6], "time.calls"}});
}

// eps_heads / kscale against the KV heads and head dim of K when its static shape says them (else
// at the first Run).
void PackedAttentionKernel::check_list_lengths(const Ort::ConstKernelInfo& info) const {
  if (p_.eps_heads.empty() && p_.kscale.empty() && p_.pq_book_t.empty()) return;
  if (info.GetInputCount() < 2 || p_.num_heads > 0) return;  // no K, or GQA's layout: checked on the first Run()
  auto ti = info.GetInputTypeInfo(1);
  if (ti.GetONNXType() != ONNX_TYPE_TENSOR) return;
  const auto ks = ti.GetTensorTypeAndShapeInfo().GetShape();
  if (ks.size() != 4) return;
  check_list_lengths(ks[1], p_.k_bhdt ? ks[2] : ks[3]);
}

void PackedAttentionKernel::check_list_lengths(int64_t Hkv, int64_t D) const {
  const AttnParams& p = p_;
  if (Hkv > 0 && !p.eps_heads.empty() && static_cast<int64_t>(p.eps_heads.size()) != Hkv)
    fail("attribute eps_heads has " + std::to_string(p.eps_heads.size()) + " values, K has " + std::to_string(Hkv) +
         " heads");
  if (Hkv > 0 && D > 0 && !p.kscale.empty() && static_cast<int64_t>(p.kscale.size()) != Hkv * D)
    fail("attribute kscale has " + std::to_string(p.kscale.size()) + " values, expected KV heads x head dim = " +
         std::to_string(Hkv * D));
  if (p.mode == KeyMode::Pq && D > 0) {
    if (D % kPqWidth)
      fail("mode pq needs a head dim divisible by " + std::to_string(kPqWidth) + ", got " + std::to_string(D));
    if (Hkv > 0 && static_cast<int64_t>(p.pq_book_t.size()) != Hkv * D * kPqCodes)  // the attribute's count
      fail("attribute pq_book has " + std::to_string(p.pq_book_t.size()) +
           " values, expected KV heads x head dim x 16 = " + std::to_string(Hkv * D * kPqCodes));
    if (!p.pq_dims.empty() && static_cast<int64_t>(p.pq_dims.size()) != D)
      fail("attribute pq_dims has " + std::to_string(p.pq_dims.size()) + " values, expected head dim " +
           std::to_string(D));
  }
}

// ksmooth against the heads and head dim of the call, and equal within each rotary pair (a scale that
// differs inside a pair does not commute with the rotation: logits would change)
void PackedAttentionKernel::check_ksmooth(int64_t Hkv, int64_t D, int64_t half) const {
  const std::vector<float>& s = p_.ksmooth;
  if (s.empty()) return;
  if (static_cast<int64_t>(s.size()) != Hkv * D)
    fail("attribute ksmooth has " + std::to_string(s.size()) + " values, expected KV heads x head dim = " +
         std::to_string(Hkv * D));
  const bool inter = p_.rotary_interleaved != 0;
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t i = 0; i < half; ++i) {
      const int64_t i1 = inter ? 2 * i : i, i2 = inter ? 2 * i + 1 : i + half;
      if (s[static_cast<size_t>(h * D + i1)] != s[static_cast<size_t>(h * D + i2)])
        fail("attribute ksmooth differs within rotary pair (" + std::to_string(i1) + ", " + std::to_string(i2) +
             ") of KV head " + std::to_string(h) + ": " + std::to_string(s[static_cast<size_t>(h * D + i1)]) +
             " vs " + std::to_string(s[static_cast<size_t>(h * D + i2)]) + " (the scale must commute with the rotation)");
    }
}

// ------------------------------------------------------------------ compute
std::array<std::vector<int64_t>, 3> PackedAttentionKernel::qkv_shapes(Ort::KernelContext& ctx) const {
  std::array<std::vector<int64_t>, 3> s;
  for (size_t i = 0; i < 3; ++i) {
    Ort::ConstValue v = ctx.GetInput(i);
    if (!v) fail(std::string(i == 1 ? "K" : "V") + " is absent (only GroupQueryAttention's packed QKV layout omits it)");
    s[i] = v.GetTensorTypeAndShapeInfo().GetShape();
  }
  if (s[0].size() != 4 || s[1].size() != 4 || s[2].size() != 4)
    fail("Q, K, V must have rank 4, got " + shape_str(s[0]) + ", " + shape_str(s[1]) + ", " + shape_str(s[2]));
  return s;
}

AttnCall PackedAttentionKernel::read_inputs(Ort::KernelContext& ctx) const {
  const AttnParams& p = p_;
  Ort::ConstValue qv = ctx.GetInput(0), kv = ctx.GetInput(1), vv = ctx.GetInput(2);
  const auto [qs, ks, vs] = qkv_shapes(ctx);
  const int64_t B = qs[0], Hq = qs[1], M = qs[2], D = qs[3];
  const int64_t Hkv = ks[1], T = p.k_bhdt ? ks[3] : ks[2], Dk = p.k_bhdt ? ks[2] : ks[3], Dv = vs[3];
  if (ks[0] != B || vs[0] != B || vs[1] != Hkv || vs[2] != T || Dk != D)
    fail("shapes do not agree: Q " + shape_str(qs) + ", K " + shape_str(ks) + " (" + (p.k_bhdt ? "bhdt" : "bhtd") +
         "), V " + shape_str(vs));
  if (Hkv < 1 || Hq % Hkv != 0)
    fail("query heads " + std::to_string(Hq) + " not a multiple of KV heads " + std::to_string(Hkv));
  check_list_lengths(Hkv, D);
  AttnCall c{B, Hq, M, D, Hkv, T, Dv, Hq / Hkv, PackedKeyFormat(p.mode, D)};
  const int64_t W = c.fmt.words;

  // mask: additive, rank 4, each dim 1 or full
  const size_t n_in = ctx.GetInputCount();
  if (n_in > 3) {
    Ort::ConstValue mv = ctx.GetInput(3);
    if (mv) {
      const auto ms = mv.GetTensorTypeAndShapeInfo().GetShape();
      const int64_t full[4] = {B, Hq, M, T};
      bool ok = ms.size() == 4;
      for (size_t i = 0; ok && i < 4; ++i) ok = ms[i] == 1 || ms[i] == full[i];
      if (!ok) fail("mask " + shape_str(ms) + " does not broadcast to [B, Hq, M, T] = " + shape_str({B, Hq, M, T}));
      c.mask = mv.GetTensorData<float>();
      c.mst = ms[3] == 1 ? 0 : 1;
      c.msm = ms[2] == 1 ? 0 : ms[3];
      c.msh = ms[1] == 1 ? 0 : ms[2] * ms[3];
      c.msb = ms[0] == 1 ? 0 : ms[1] * ms[2] * ms[3];
    }
  }
  if (n_in > 4) {
    Ort::ConstValue pv = ctx.GetInput(4);
    if (pv) {
      const auto ps = pv.GetTensorTypeAndShapeInfo().GetShape();
      if (ps.size() != 4 || ps[0] != B || ps[1] != Hkv || ps[2] > T || ps[3] != W)
        fail("past_bits " + shape_str(ps) + " must be [B, Hkv, P <= T, W] = [" + std::to_string(B) + ", " +
             std::to_string(Hkv) + ", <=" + std::to_string(T) + ", " + std::to_string(W) + "]");
      c.past = pv.GetTensorData<int32_t>();
      c.P = ps[2];
    }
  }
  c.Q = qv.GetTensorData<float>();
  c.K = kv.GetTensorData<float>();
  c.V = vv.GetTensorData<float>();
  c.Y = ctx.GetOutput(0, {B, Hq, M, Dv}).GetTensorMutableData<float>();
  c.want_bits = ctx.GetOutputCount() > 1;
  // `exact` here: no row can use candidates (per-row decisions in attend_rows)
  const bool approx_rows = M == 1 || p.approx_prefill != 0;
  c.global_exact = !(p.budget > 0 && p.budget < 1);
  c.exact = c.global_exact || !approx_rows ||
            (M == 1 && (T <= p.min_context || n_candidates(p, T) >= T));
  return c;
}

// Key bits: carried rows copied from past_bits, new rows packed (O(new tokens)); the plane-0 bit
// density (eps modes: too dense -> exact attention for the whole call).
void PackedAttentionKernel::pack_keys(AttnCall& c, Ort::KernelContext& ctx) const {
  const AttnParams& p = p_;
  const int64_t T = c.T, D = c.D, W = c.fmt.words, BH = c.B * c.Hkv;
  if (c.want_bits) {
    c.bits = reinterpret_cast<uint32_t*>(ctx.GetOutput(1, {c.B, c.Hkv, T, W}).GetTensorMutableData<int32_t>());
  } else {
    c.bits = reinterpret_cast<uint32_t*>(outer_scratch().get(static_cast<size_t>(BH * T * W)));
    c.past = nullptr;
    c.P = 0;
  }
  const int64_t P = c.P;
  const int64_t ldt = p.k_bhdt ? 1 : D, ldd = p.k_bhdt ? T : 1;  // K element (t, d) at t*ldt + d*ldd
  for (int64_t bh = 0; bh < BH; ++bh) {
    uint32_t* dst = c.bits + bh * T * W;
    if (P) std::memcpy(dst, c.past + bh * P * W, sizeof(uint32_t) * P * W);
    const float* Kh = c.K + bh * T * D;
    const float eps = p.eps_heads.empty() ? p.eps : p.eps_heads[static_cast<size_t>(bh % c.Hkv)];
    for (int64_t t = P; t < T; ++t) c.fmt.pack(Kh + t * ldt, ldd, eps, dst + t * W);
  }
  metrics::add(m_packed_, static_cast<double>(BH * (T - P)));
  // density of plane 0: over all keys in the eps modes (it decides the auto-disable), over the
  // newly packed keys in sign mode (informational: ~0.5 by construction)
  const int64_t t0 = p.mode == KeyMode::Sign ? P : 0;
  const int64_t plane_words = c.fmt.planes * c.fmt.nw;
  int64_t set = 0;
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t t = t0; t < T; ++t)
      for (int64_t j = 0; j < plane_words; ++j) set += popc(c.bits[(bh * T + t) * W + j]);
  const int64_t nbits = BH * (T - t0) * D;
  if (nbits > 0) {
    const double dens = static_cast<double>(set) / static_cast<double>(nbits);
    metrics::set(m_density_, dens);
    if (p.mode != KeyMode::Sign && dens > p.rho) c.exact = c.global_exact = true;  // auto-disable: too dense to help
  }
}

// M == 1 (decode) or candidate path: one task per (b, h, m) query row.
void PackedAttentionKernel::attend_rows(AttnCall& c, Ort::KernelContext& ctx) const {
  const AttnParams& p = p_;
  const AttnKernels& ak = *ak_;
  const int64_t M = c.M, T = c.T, D = c.D, Dv = c.Dv, Hq = c.Hq;
  std::atomic<int64_t> n_cands{0};
  std::atomic<bool> oom{false};
  auto task = [&](size_t r_) noexcept {
    const int64_t r = static_cast<int64_t>(r_);
    const int64_t b = r / (Hq * M), h = (r / M) % Hq, m = r % M, hk = h / c.rep;
    const float* q = c.Q + r * D;
    const float* Kh = c.K + (b * c.Hkv + hk) * T * D;
    const float* Vh = c.V + (b * c.Hkv + hk) * T * Dv;
    const float* mr = c.mask_row(b, h, m);
    // this row's context: all T keys in decode; with approx_prefill, up to the last unmasked key
    int64_t Tr = T;
    if (M > 1 && p.approx_prefill && mr) {
      while (Tr > 0 && !(mr[(Tr - 1) * c.mst] > -INFINITY)) --Tr;
    }
    const int64_t C = n_candidates(p, Tr);
    const bool exact_row = c.global_exact || (M > 1 && !p.approx_prefill) || Tr <= p.min_context || C >= Tr;
    RowBufs w;
    if (!w.bind(T, c.fmt.nw, D, Dv)) {
      oom = true;
      return;
    }
    if (!exact_row || p.mix > 0) approx_scores(p, c, ak, b, hk, q, Kh, w);
    int64_t n = Tr;
    if (exact_row) {
      for (int64_t t = 0; t < Tr; ++t) w.idx[t] = t;
    } else {
      n = select_candidates(p, c, mr, Tr, C, w);
    }
    n_cands.fetch_add(n, std::memory_order_relaxed);
    attend_candidates(p, c, ak, q, Kh, Vh, mr, n, n < Tr, w, c.Y + r * Dv);
  };
  parallel_for(ctx, static_cast<size_t>(c.B * Hq * M), task);
  if (oom) throw std::bad_alloc();
  metrics::add(m_cands_, static_cast<double>(n_cands.load()));
}

// Exact blocked path (M > 1): per block of query rows S = Q_blk K^T (GEMM), + mask, softmax,
// Y = P V (GEMM).
void PackedAttentionKernel::attend_blocked(const AttnCall& c, Ort::KernelContext& ctx) const {
  const AttnParams& p = p_;
  const AttnKernels& ak = *ak_;
  const GemmKernels& kr = *gemm_;
  const int64_t M = c.M, T = c.T, D = c.D, Dv = c.Dv, Hq = c.Hq;
  metrics::add(m_cands_, static_cast<double>(c.B * Hq * M * T));
  const int64_t nblk = (M + kRowBlock - 1) / kRowBlock;
  std::atomic<bool> oom{false};
  auto task = [&](size_t i_) noexcept {
    const int64_t i = static_cast<int64_t>(i_);
    const int64_t blk = i % nblk, h = (i / nblk) % Hq, b = i / (nblk * Hq), hk = h / c.rep;
    const int64_t m0 = blk * kRowBlock, mb = std::min(kRowBlock, M - m0);
    const float* Kh = c.K + (b * c.Hkv + hk) * T * D;
    const float* Vh = c.V + (b * c.Hkv + hk) * T * Dv;
    const size_t s_size = round_up16(static_cast<size_t>(kRowBlock * T));
    float* buf;
    try {
      buf = task_scratch().get(s_size + static_cast<size_t>(kRowBlock) + (p.k_bhdt ? 0 : static_cast<size_t>(D * T)));
    } catch (...) {
      oom = true;
      return;
    }
    float* S = buf;
    float* inv = buf + s_size;  // [mb] 1 / softmax sums
    const float* KT = Kh;
    if (!p.k_bhdt) {
      float* kt = inv + kRowBlock;
      kr.transpose(Kh, D, kt, T, T, D, nullptr);  // [T, D] -> [D, T]
      KT = kt;
    }
    const float* Qb = c.Q + ((b * Hq + h) * M + m0) * D;
    kr.sgemm_nn(mb, T, D, Qb, D, KT, T, S, T);
    float* Yb = c.Y + ((b * Hq + h) * M + m0) * Dv;
    for (int64_t r = 0; r < mb; ++r) {
      float* row = S + r * T;
      const float* mr = c.mask_row(b, h, m0 + r);
      if (mr) {
        for (int64_t t = 0; t < T; ++t) row[t] = row[t] * p.scale + mr[t * c.mst];
      } else {
        ak.scal(p.scale, row, T);
      }
      const float mx = ak.maxv(row, T);
      if (!(mx > -INFINITY)) {
        std::fill(row, row + T, 0.0f);
        inv[r] = 0.0f;
        continue;
      }
      inv[r] = 1.0f / ak.expsum(row, mx, T);
    }
    kr.sgemm_nn(mb, Dv, T, S, T, Vh, Dv, Yb, Dv);
    for (int64_t r = 0; r < mb; ++r) ak.scal(inv[r], Yb + r * Dv, Dv);
  };
  parallel_for(ctx, static_cast<size_t>(c.B * Hq * nblk), task);
  if (oom) throw std::bad_alloc();
}

void PackedAttentionKernel::Compute(Ort::KernelContext& ctx) const {
  if (p_.kv_bits) {
    compute_kv(ctx);
    return;
  }
  AttnCall c = read_inputs(ctx);
  if (c.want_bits || !c.exact || p_.mix > 0) pack_keys(c, ctx);
  metrics::add(m_calls_, 1.0);
  metrics::add(m_keys_, static_cast<double>(c.B * c.Hq * c.M * c.T));
  if (!c.exact) metrics::add(m_active_, 1.0);
  if (c.M == 1 || !c.exact || p_.mix > 0)
    attend_rows(c, ctx);
  else
    attend_blocked(c, ctx);
}

// ================================================================== cache mode (kv_quant)
// K/V are the new tokens; the cache is past_kv rows (KvRowFormat: codes) + past_bits rows (key bits,
// then the row's K / V scales); new rows go to
// positions pos0_b .. total_b - 1. Decode: candidates chosen once per KV-head group (popcount score
// of the group query, lutscore), then the group's query heads read each selected row once
// (online softmax in blocks, split over ORT's pool by (row, block of keys), merged at the end).

// Round half to even (np.rint) of |v| < 2^22 (NaN stays NaN) without a libm call: the generic x86-64
// build has no SSE4.1 round, and nearbyintf per element was a visible share of a short decode step.
constexpr float kRintMagic = 12582912.0f;  // 1.5 * 2^23: the sum rounds to an integer (ties to even)
inline float rint_small(float v) { return (v + kRintMagic) - kRintMagic; }
inline __m128 rint_small4(__m128 v) {  // rint_small on four lanes (the same adds)
  const __m128 m = _mm_set1_ps(kRintMagic);
  return _mm_sub_ps(_mm_add_ps(v, m), m);
}

// One cached key row (int32 words): K codes, V codes (custom_ops/reference/attn.py); the row's K scale
// and V scale are the last two words of its key-bits row (scales(bits row): sc[0], sc[1]). Rows of
// D = Dv = 64 int8 codes are 128 bytes, two cache lines, where codes and scales together took three
// (a selected row read from DRAM costs its lines; the scales' words were just read by the scoring).
struct KvRowFormat {
  int bits;             // 32 | 8 | 4
  int64_t kbytes, vbytes, words;
  KvRowFormat(int b, int64_t D, int64_t Dv)
      : bits(b), kbytes(D * b / 8), vbytes(Dv * b / 8), words(kbytes / 4 + vbytes / 4) {}
  const uint8_t* k(const uint32_t* row) const { return reinterpret_cast<const uint8_t*>(row); }
  const uint8_t* v(const uint32_t* row) const { return reinterpret_cast<const uint8_t*>(row + kbytes / 4); }
  static float f32(const uint32_t* w) {
    float f;
    std::memcpy(&f, w, 4);
    return f;
  }
  // quantizes x[0:n) into codes (n bytes int8, or n/2 bytes of int4 pairs), returns the scale
  float quantize(const float* x, int64_t n, uint8_t* codes) const {
    if (bits == 32) {
      std::memcpy(codes, x, sizeof(float) * static_cast<size_t>(n));
      return 1.0f;
    }
    const float L = bits == 8 ? 127.0f : 7.0f;
    float a = 0.0f;
    int64_t d0 = 0;
    // SSE2 (the baseline build), 16 values a step: the same max (NaN ignored), products, rounding and
    // clamps as the scalar loops below, which finish the rest (scalar, they were ~0.25 us a key)
    const __m128 absm = _mm_castsi128_ps(_mm_set1_epi32(0x7FFFFFFF));
    __m128 am = _mm_setzero_ps();
    for (; d0 + 4 <= n; d0 += 4) am = _mm_max_ps(_mm_and_ps(_mm_loadu_ps(x + d0), absm), am);  // NaN: am kept
    a = _mm_cvtss_f32(fold_max4(am));
    for (int64_t d = d0; d < n; ++d) a = std::max(a, std::fabs(x[d]));
    const float inv = a > 0 ? L / a : 0.0f;
    int64_t dq = 0;
    if (bits == 8) {
      const __m128 vinv = _mm_set1_ps(inv), hi = _mm_set1_ps(L), lo = _mm_set1_ps(-L);
      auto q4 = [&](int64_t d) {
        __m128 v = rint_small4(_mm_mul_ps(_mm_loadu_ps(x + d), vinv));
        v = _mm_max_ps(lo, _mm_min_ps(hi, v));  // clamps; NaN passes both (second operand)
        return _mm_and_si128(_mm_cvtps_epi32(v), _mm_castps_si128(_mm_cmpord_ps(v, v)));  // NaN -> 0
      };
      for (; dq + 16 <= n; dq += 16) {
        const __m128i w = _mm_packs_epi16(_mm_packs_epi32(q4(dq), q4(dq + 4)), _mm_packs_epi32(q4(dq + 8), q4(dq + 12)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + dq), w);
      }
    }
    for (int64_t d = dq; d < n; ++d) {
      float v = rint_small(x[d] * inv);  // |x * inv| <= L (or NaN)
      v = v > L ? L : v < -L ? -L : v;  // NaN stays NaN -> cast below gives 0 via the check
      const int c = std::isnan(v) ? 0 : static_cast<int>(v);
      if (bits == 8) {
        codes[d] = static_cast<uint8_t>(static_cast<int8_t>(c));
      } else {
        const uint8_t nb = static_cast<uint8_t>(c & 0x0F);
        if (d & 1) codes[d >> 1] = static_cast<uint8_t>(codes[d >> 1] | (nb << 4));
        else codes[d >> 1] = nb;
      }
    }
    return a / L;
  }
  // codes into row, the K / V scales into sc[0], sc[1] (the key-bits row's last two words)
  void store(const float* kx, int64_t D, const float* vx, int64_t Dv, uint32_t* row, uint32_t* sc) const {
    uint8_t* b = reinterpret_cast<uint8_t*>(row);
    const float ks = quantize(kx, D, b);
    const float vs = quantize(vx, Dv, b + kbytes);
    std::memcpy(sc, &ks, 4);
    std::memcpy(sc + 1, &vs, 4);
  }
};

struct KvCall {
  int64_t B, Hq, M, D, Hkv, S, Dv, rep, P = 0, Tc = 0;
  PackedKeyFormat fmt;
  KvRowFormat kf;
  int64_t W = fmt.words + 2;  // key-bits row: fmt's words, then the K / V scales of the cached row
  const float *Q = nullptr, *K = nullptr, *V = nullptr;
  float* Y = nullptr;
  float* y_bsh = nullptr;  // GQA layout with M > 1: the output [B, M, Hq * Dv] (Y is then staged)
  const float* mask = nullptr;
  int64_t msb = 0, msh = 0, msm = 0, mst = 0;
  const uint32_t *past_bits = nullptr, *past_kv = nullptr;
  uint32_t *bits = nullptr, *kv = nullptr;  // [B, Hkv, Tc, W] / [.., R]
  float kscale(int64_t bh, int64_t t) const { return KvRowFormat::f32(bits + (bh * Tc + t) * W + fmt.words); }
  float vscale(int64_t bh, int64_t t) const { return KvRowFormat::f32(bits + (bh * Tc + t) * W + fmt.words + 1); }
  std::vector<int64_t> total, pos0;         // per sequence
  bool global_exact = false;
  bool continues = false;  // prompt_continues: no exact prefill_tail in this call
  // per query row r = (b, hk, m): context [lo, hi), candidate count n (idx list when approx)
  std::vector<int64_t> lo, hi, n, off;      // off: candidate list offset (or -1: the range)
  std::vector<int32_t> idx;  // candidate lists of the approximating rows (each row's context length apart)
  std::chrono::steady_clock::time_point scored{};  // phase times on (m_time_): the end of the scoring
  const float* mask_row(int64_t b, int64_t h, int64_t m) const {
    return mask ? mask + b * msb + h * msh + m * msm : nullptr;
  }
};

namespace {
constexpr int64_t kKvChunk = 1024;       // keys per task in the attend phase
// exact prompt rows (no sparse budget) of a call whose context reaches this many keys run prefill_sparse's
// chunked online softmax, every tile exact, instead of prefill_gemm (measured: tests/bench/attn_speed.py prefill)
constexpr int64_t kFlashMinContext = 2048;
constexpr int64_t kPrefetchNewRows = 4;  // at most this many new tokens a call: read_kv_inputs prefetches their rows

template <class T>
const T* data_or_null(Ort::KernelContext& ctx, size_t i) {
  if (ctx.GetInputCount() <= i) return nullptr;
  Ort::ConstValue v = ctx.GetInput(i);
  return v ? v.GetTensorData<T>() : nullptr;
}
}  // namespace

KvCall PackedAttentionKernel::read_kv_inputs(Ort::KernelContext& ctx) const {
  const AttnParams& p = p_;
  Ort::ConstValue qv = ctx.GetInput(0), kv = ctx.GetInput(1), vv = ctx.GetInput(2);
  const auto [qs, ks, vs] = p.num_heads > 0 ? gqa_shapes(ctx) : qkv_shapes(ctx);
  const int64_t B = qs[0], Hq = qs[1], M = qs[2], D = qs[3], Hkv = ks[1], S = ks[2], Dv = vs[3];
  if (ks[0] != B || vs[0] != B || vs[1] != Hkv || vs[2] != S || ks[3] != D)
    fail("shapes do not agree: Q " + shape_str(qs) + ", K (new tokens) " + shape_str(ks) + ", V " + shape_str(vs));
  if (Hkv < 1 || Hq % Hkv != 0)
    fail("query heads " + std::to_string(Hq) + " not a multiple of KV heads " + std::to_string(Hkv));
  if (M != S) fail("kv_quant: Q has " + std::to_string(M) + " rows, K " + std::to_string(S) + " new tokens");
  if (p.kv_bits != 32 && (D % 8 || Dv % 8))
    fail("kv_quant: head dims must be multiples of 8, got D " + std::to_string(D) + ", Dv " + std::to_string(Dv));
  check_list_lengths(Hkv, D);
  KvCall c{B, Hq, M, D, Hkv, S, Dv, Hq / Hkv, 0, 0, PackedKeyFormat(p.mode, D), KvRowFormat(p.kv_bits, D, Dv)};
  const int64_t W = c.W, R = c.kf.words;
  if (ctx.GetInputCount() > 5) {
    Ort::ConstValue pv = ctx.GetInput(5);
    if (pv) {
      const auto ps = pv.GetTensorTypeAndShapeInfo().GetShape();
      if (ps.size() != 4 || ps[0] != B || ps[1] != Hkv || ps[3] != R)
        fail("past_kv " + shape_str(ps) + " must be [B, Hkv, P, R] = [" + std::to_string(B) + ", " +
             std::to_string(Hkv) + ", P, " + std::to_string(R) + "]");
      c.P = ps[2];
      c.past_kv = reinterpret_cast<const uint32_t*>(pv.GetTensorData<int32_t>());
    }
  }
  if (ctx.GetInputCount() > 4) {
    Ort::ConstValue pv = ctx.GetInput(4);
    if (pv) {
      const auto ps = pv.GetTensorTypeAndShapeInfo().GetShape();
      if (ps.size() != 4 || ps[0] != B || ps[1] != Hkv || ps[2] != c.P || ps[3] != W)
        fail("past_bits " + shape_str(ps) + " must be [B, Hkv, P, W] = [" + std::to_string(B) + ", " +
             std::to_string(Hkv) + ", " + std::to_string(c.P) + ", " + std::to_string(W) + "] (P of past_kv)" +
             (p.mode == KeyMode::Pq && ps.size() == 4 && ps[3] == W + 1
                  ? std::string("; pq key-bits rows no longer carry a gamma word: rewrite the model again")
                  : std::string()));
      if (c.P) c.past_bits = reinterpret_cast<const uint32_t*>(pv.GetTensorData<int32_t>());
    }
  }
  if (c.P && !c.past_bits)
    fail("past_kv holds " + std::to_string(c.P) + " rows but past_bits is missing: the cached rows' K / V scales "
         "are in their key-bits rows (past_bits [B, Hkv, P, " + std::to_string(W) + "])");
  c.total.assign(static_cast<size_t>(B), c.P + S);
  if (ctx.GetInputCount() > 6) {
    Ort::ConstValue sv = ctx.GetInput(6);
    if (sv) {
      const auto ss = sv.GetTensorTypeAndShapeInfo().GetShape();
      if (sv.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(B))
        fail("seqlens_k " + shape_str(ss) + " must hold one length per sequence (B = " + std::to_string(B) + ")");
      const int32_t* sl = sv.GetTensorData<int32_t>();
      for (int64_t b = 0; b < B; ++b) {
        if (sl[b] < 0 || sl[b] >= kMaxDim) fail("seqlens_k[" + std::to_string(b) + "] = " + std::to_string(sl[b]));
        c.total[static_cast<size_t>(b)] = int64_t{sl[b]} + 1;
      }
    }
  }
  c.continues = prompt_continues_flag != 0;
  if (ctx.GetInputCount() > 9) {
    Ort::ConstValue cv = ctx.GetInput(9);
    if (cv) {
      if (cv.GetTensorTypeAndShapeInfo().GetElementCount() != 1)
        fail("prompt_continues " + shape_str(cv.GetTensorTypeAndShapeInfo().GetShape()) +
             " must hold one value (nonzero: a later call continues the prompt)");
      c.continues = cv.GetTensorData<int32_t>()[0] != 0;
    }
  }
  c.Tc = c.P;
  c.pos0.resize(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    c.Tc = std::max(c.Tc, c.total[static_cast<size_t>(b)]);
    c.pos0[static_cast<size_t>(b)] = std::max<int64_t>(0, c.total[static_cast<size_t>(b)] - S);
  }
  // Decode into a past buffer that is also the present (a caller's shared K/V buffer: the new rows lie
  // inside it): the new rows' lines are requested now, so their misses overlap the staging below instead
  // of stalling store_kv's writes (rows written a while ago are rarely still cached). Dev A/B, SmolLM2 at
  // past 128, 1 thread, 4 processes each (ORTLEAN_PHASE_TIMES): the store phase 1.2-3.8 us a layer -> 0.84-0.98,
  // the input phase 2.5 -> 2.8; the step within its noise
  if (S <= kPrefetchNewRows && c.past_kv && c.past_bits)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t hk = 0; hk < Hkv; ++hk)
        for (int64_t t = c.pos0[static_cast<size_t>(b)]; t < std::min(c.P, c.total[static_cast<size_t>(b)]); ++t) {
          const char* kvr = reinterpret_cast<const char*>(c.past_kv + ((b * Hkv + hk) * c.P + t) * R);
          const char* br = reinterpret_cast<const char*>(c.past_bits + ((b * Hkv + hk) * c.P + t) * W);
          for (int64_t o = 0; o < R * 4; o += 64) __builtin_prefetch(kvr + o, 1);
          __builtin_prefetch(br, 1);
          __builtin_prefetch(br + W * 4 - 1, 1);
        }
  if (ctx.GetInputCount() > 3) {
    Ort::ConstValue mv = ctx.GetInput(3);
    if (mv) {
      const auto ms = mv.GetTensorTypeAndShapeInfo().GetShape();
      const int64_t full[4] = {B, Hq, M, c.Tc};
      bool ok = ms.size() == 4;
      for (size_t i = 0; ok && i < 4; ++i) ok = ms[i] == 1 || ms[i] == full[i];
      if (!ok) fail("mask " + shape_str(ms) + " does not broadcast to [B, Hq, M, Tc] = " + shape_str({B, Hq, M, c.Tc}));
      c.mask = mv.GetTensorData<float>();
      c.mst = ms[3] == 1 ? 0 : 1;
      c.msm = ms[2] == 1 ? 0 : ms[3];
      c.msh = ms[1] == 1 ? 0 : ms[2] * ms[3];
      c.msb = ms[0] == 1 ? 0 : ms[1] * ms[2] * ms[3];
    }
  }
  if (p.num_heads > 0) {
    stage_gqa(c, ctx);
  } else {
    c.Q = qv.GetTensorData<float>();
    c.K = kv.GetTensorData<float>();
    c.V = vv.GetTensorData<float>();
    c.Y = ctx.GetOutput(0, {B, Hq, M, Dv}).GetTensorMutableData<float>();
  }
  c.global_exact = !(p.budget > 0 && p.budget < 1);
  return c;
}

// present_bits / present_kv: the carried rows (skipped when the output is the past buffer: a caller
// binding past and present to one buffer), zeros up to Tc, then the new rows quantized and packed.
void PackedAttentionKernel::store_kv(KvCall& c, Ort::KernelContext& ctx) const {
  const AttnParams& p = p_;
  const int64_t B = c.B, Hkv = c.Hkv, Tc = c.Tc, W = c.W, R = c.kf.words, BH = B * Hkv;
  const size_t nout = ctx.GetOutputCount();
  uint32_t* sb = nullptr;
  const size_t need = (nout > 1 ? 0 : static_cast<size_t>(BH * Tc * W)) + (nout > 2 ? 0 : static_cast<size_t>(BH * Tc * R));
  if (need) sb = reinterpret_cast<uint32_t*>(outer_scratch().get(need + 16));
  c.bits = nout > 1 ? reinterpret_cast<uint32_t*>(ctx.GetOutput(1, {B, Hkv, Tc, W}).GetTensorMutableData<int32_t>()) : sb;
  c.kv = nout > 2 ? reinterpret_cast<uint32_t*>(ctx.GetOutput(2, {B, Hkv, Tc, R}).GetTensorMutableData<int32_t>())
                  : sb + (nout > 1 ? 0 : BH * Tc * W);
  const int64_t P = c.P;
  for (int64_t bh = 0; bh < BH; ++bh) {
    uint32_t* kd = c.kv + bh * Tc * R;
    uint32_t* bd = c.bits + bh * Tc * W;
    if (P && c.past_kv + bh * P * R != kd) std::memcpy(kd, c.past_kv + bh * P * R, sizeof(uint32_t) * P * R);
    if (P && c.past_bits + bh * P * W != bd) std::memcpy(bd, c.past_bits + bh * P * W, sizeof(uint32_t) * P * W);
    if (Tc > P && !(c.past_kv && c.past_kv + bh * P * R == kd)) {
      std::memset(kd + P * R, 0, sizeof(uint32_t) * (Tc - P) * R);
      std::memset(bd + P * W, 0, sizeof(uint32_t) * (Tc - P) * W);
    }
  }
  int64_t packed = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p0 = c.pos0[static_cast<size_t>(b)], nnew = std::min(c.S, c.total[static_cast<size_t>(b)] - p0);
    for (int64_t hk = 0; hk < Hkv; ++hk) {
      const float eps = p.eps_heads.empty() ? p.eps : p.eps_heads[static_cast<size_t>(hk)];
      for (int64_t m = 0; m < nnew; ++m) {
        const float* kx0 = c.K + ((b * Hkv + hk) * c.S + m) * c.D;
        const float* vx0 = c.V + ((b * Hkv + hk) * c.S + m) * c.Dv;
        const int64_t t = p0 + m;
        uint32_t* br = c.bits + ((b * Hkv + hk) * Tc + t) * W;
        if (p.mode == KeyMode::Pq)
          c.fmt.pack_pq(kx0, p.pq_book_t.data() + hk * c.D * kPqCodes, p.pq_dims.empty() ? nullptr : p.pq_dims.data(),
                        br);
        else
          c.fmt.pack(kx0, 1, eps, br);
        c.kf.store(kx0, c.D, vx0, c.Dv, c.kv + ((b * Hkv + hk) * Tc + t) * R, br + c.fmt.words);
        ++packed;
      }
    }
  }
  metrics::add(m_packed_, static_cast<double>(packed));
  // plane-0 density: eps modes over every key in context (auto-disable), sign mode over the new keys
  const int64_t plane_words = c.fmt.planes * c.fmt.nw;
  int64_t set = 0, nbits = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t tot = c.total[static_cast<size_t>(b)];
    const int64_t t0 = p.mode == KeyMode::Sign || p.mode == KeyMode::Pq ? c.pos0[static_cast<size_t>(b)] : 0;
    for (int64_t hk = 0; hk < Hkv; ++hk)
      for (int64_t t = t0; t < tot; ++t)
        for (int64_t j = 0; j < plane_words; ++j) set += popc(c.bits[((b * Hkv + hk) * Tc + t) * W + j]);
    nbits += Hkv * std::max<int64_t>(0, tot - t0) * c.D;
  }
  if (nbits > 0) {
    const double dens = static_cast<double>(set) / static_cast<double>(nbits);
    metrics::set(m_density_, dens);
    if ((p.mode == KeyMode::Ternary || p.mode == KeyMode::Binary) && dens > p.rho) c.global_exact = true;
  }
}

namespace {
// g[t] += mask (the group's first head), NaN -> -inf
void masked_scores(const KvCall& c, int64_t b, int64_t h0, int64_t m, int64_t lo, int64_t n, float* g) {
  const float* mr = c.mask_row(b, h0, m);
  for (int64_t t = 0; t < n; ++t) {
    const float v = g[t] + (mr ? mr[(lo + t) * c.mst] : 0.0f);
    g[t] = v == v ? v : -INFINITY;
  }
}

// cnt[b] = how many ids[i] (i < n, stride st) equal b (b <= top < 65536). In four interleaved uint16
// histograms summed at the end when top < kHist4: a run of equal ids then increments four counters in
// turn, where one counter's increments each waited on the previous one's store (perf, past 4096: the
// increments were ~3/4 of the selection).
constexpr int kHist4 = 2304;
void histogram(const uint16_t* ids, int64_t n, int64_t st, int sh, int top, int32_t* cnt) {
  std::memset(cnt, 0, sizeof(int32_t) * static_cast<size_t>(top + 1));
  const int64_t m = (n + st - 1) / st;  // ids counted
  if (top >= kHist4 || m < 64 || m >= 4 * 65535) {
    for (int64_t i = 0; i < n; i += st) ++cnt[ids[i] >> sh];
    return;
  }
  uint16_t h[4][kHist4];
  for (auto& x : h) std::memset(x, 0, sizeof(uint16_t) * static_cast<size_t>(top + 1));
  int64_t i = 0;
  for (; i + 3 * st < n; i += 4 * st) {
    ++h[0][ids[i] >> sh];
    ++h[1][ids[i + st] >> sh];
    ++h[2][ids[i + 2 * st] >> sh];
    ++h[3][ids[i + 3 * st] >> sh];
  }
  for (; i < n; i += st) ++h[0][ids[i] >> sh];
  for (int b = 0; b <= top; ++b) cnt[b] = int32_t{h[0][b]} + h[1][b] + h[2][b] + h[3][b];
}

// The bucket of the k-th largest of ids[0:n) (bucket ids 0 .. top, a higher id a higher score; 1 <= k <= n)
// by a histogram (cnt: top + 1 int32); *higher: how many keys are in the buckets above it (< k).
int kth_bucket(const uint16_t* ids, int64_t n, int64_t k, int top, int32_t* cnt, int64_t* higher) {
  histogram(ids, n, 1, 0, top, cnt);
  int64_t h = 0;
  int bsel = top;
  for (; bsel > 0; --bsel) {
    if (h + cnt[bsel] >= k) break;
    h += cnt[bsel];
  }
  *higher = h;
  return bsel;
}

// kth_bucket, then the keys of the buckets above it to above as base + i, those of that bucket to at as
// i, both in index order (split_ids: may write 7 entries past either count). Returns how many above
// (< k), *nat how many at.
int64_t split_at_kth(const AttnKernels& ak, const uint16_t* ids, int64_t n, int64_t k, int top, int32_t* cnt,
                     int32_t base, int32_t* above, int32_t* at, int64_t* nat) {
  int64_t higher;
  const int bsel = kth_bucket(ids, n, k, top, cnt, &higher);
  return ak.split_ids(ids, n, bsel, base, above, at, nat);
}

// out[0:na) (ascending) merged with base + ti[0:ns) (ascending, none in out) into out (room for na + ns);
// returns na + ns. The ties are few (the k-th largest's bucket): each goes in at its place found by
// binary search, from the back, the entries above it moved up once (a merge loop over all na + ns
// entries took ~0.3 us a row at past 4096).
int64_t merge_above_ties(int32_t* out, int64_t na, const int32_t* ti, int64_t ns, int32_t base) {
  int64_t end = na;  // out[0:end) not yet placed
  for (int64_t j = ns - 1; j >= 0; --j) {
    const int32_t v = base + ti[j];
    const int64_t at = std::upper_bound(out, out + end, v) - out;
    std::memmove(out + at + j + 1, out + at, sizeof(int32_t) * static_cast<size_t>(end - at));
    out[at + j] = v;
    end = at;
  }
  return na + ns;
}

// The top k of x[0:n) by (value desc, index asc) (1 <= k < n; no NaN), written in index order as
// base + i to out; returns k. A 2048-bucket histogram over [min, max] of the finite values (bucket
// ids kept) finds the bucket of the k-th largest; one pass (split_ids) sends the keys of the buckets
// above it to out and those of its bucket to ti; nth_element on that bucket's values gives the
// threshold, its keys above it and the first ties join, and the two index-ordered lists are merged.
// At most one distinct finite value: nth_element on a copy and one pass. tmp: n floats, ti: n int32.
int64_t top_k(const AttnKernels& ak, const float* x, int64_t n, int64_t k, float* tmp, int32_t* ti, int32_t base,
              int32_t* out) {
  constexpr int kB = 2048;
  float mn, mx;
  ak.minmax_finite(x, n, &mn, &mx);
  const float sc = static_cast<float>(kB - 1) / (mx - mn);
  if (!(mx > mn) || !(sc < INFINITY)) {  // one distinct finite value (or a range too narrow): plain selection
    std::memcpy(tmp, x, sizeof(float) * static_cast<size_t>(n));
    std::nth_element(tmp, tmp + (k - 1), tmp + n, std::greater<float>());
    const float thr = tmp[k - 1];
    int64_t above = 0, c = 0;
    for (int64_t i = 0; i < n; ++i) above += x[i] > thr;
    int64_t ties = k - above;
    for (int64_t i = 0; i < n; ++i)
      if (x[i] > thr || (x[i] == thr && ties-- > 0)) out[c++] = base + static_cast<int32_t>(i);
    return c;
  }
  uint16_t* bk = reinterpret_cast<uint16_t*>(tmp);  // bucket + 1: 0 for -inf, kB + 1 for +inf
  ak.bucket_ids(x, n, mn, sc, kB, bk);
  int32_t cnt[kB + 2];
  int64_t mt = 0;
  const int64_t na = split_at_kth(ak, bk, n, k, kB + 1, cnt, base, out, ti, &mt);  // above -> out, at -> ti
  const int64_t kk = k - na;  // 1 <= kk <= mt
  for (int64_t j = 0; j < mt; ++j) tmp[j] = x[ti[j]];
  std::nth_element(tmp, tmp + (kk - 1), tmp + mt, std::greater<float>());
  const float thr = tmp[kk - 1];
  int64_t gt = 0;
  for (int64_t j = 0; j < mt; ++j) gt += x[ti[j]] > thr;
  int64_t ties = kk - gt, ns = 0;
  for (int64_t j = 0; j < mt; ++j) {
    const float v = x[ti[j]];
    if (v > thr || (v == thr && ties-- > 0)) ti[ns++] = ti[j];
  }
  return merge_above_ties(out, na, ti, ns, base);
}

// top_k on exact integer buckets (ids[i] in [1, nbk], a higher id a higher score; 1 <= k < n): the
// histogram's bucket of the k-th largest holds equal scores only, so its first k - above keys by index
// are the ties the order takes (no nth_element), taken in the same pass as the keys above it (take_ids;
// a split into two lists and their merge was ~1/5 of the selection, perf in the model at past 4096).
// cnt: nbk + 1 int32, tmp and pos: n int32 each.
// A long row first narrows the keys by a sample (kSampleStride): every kSampleStride-th id in a coarse
// histogram gives a threshold that about kSampleSigmas standard deviations more keys than k pass;
// select_ge keeps the keys at or above it (in index order), and the exact histogram runs over those
// alone. The k largest are among them whenever at least k pass (all keys above the k-th largest's
// bucket do, and its ties keep their index order); when fewer pass (a sample far from the row), the
// whole row. The histogram's increments were ~3/4 of the selection (perf, past 4096).
constexpr int64_t kSampleStride = 8, kSampleMinKeys = 1024;
constexpr double kSampleSigmas = 4.0;
// kth_bucket, then the keys above it and its first k - higher (index order) as base + p_i (p_i = pos[i],
// pos null: i) to out, in index order: the top k; returns k.
int64_t take_kth(const AttnKernels& ak, const uint16_t* ids, int64_t n, int64_t k, int top, int32_t* cnt,
                 int32_t base, int32_t* out, const int32_t* pos = nullptr) {
  int64_t higher;
  const int bsel = kth_bucket(ids, n, k, top, cnt, &higher);
  return ak.take_ids(ids, n, bsel, k - higher, base, out, pos);  // 1 <= k - higher <= cnt[bsel]
}

int64_t top_k_ids(const AttnKernels& ak, const uint16_t* ids, int64_t n, int64_t k, int nbk, int32_t* cnt,
                  int32_t* tmp, int32_t* pos, int32_t base, int32_t* out) {
  if (n >= kSampleMinKeys) {
    int sh = 0;
    while ((nbk >> sh) >= 256) ++sh;
    const int top = nbk >> sh;
    int32_t hc[256];
    histogram(ids, n, kSampleStride, sh, top, hc);
    const int64_t ns = (n + kSampleStride - 1) / kSampleStride;
    const double expect = static_cast<double>(k) * static_cast<double>(ns) / static_cast<double>(n);
    const double want = expect + kSampleSigmas * std::sqrt(expect) + 4.0;
    int cb = top;
    for (int64_t cum = 0; cb > 0; --cb) {
      cum += hc[cb];
      if (static_cast<double>(cum) >= want) break;
    }
    if (cb > 0) {  // cb == 0: every key would pass
      const int thr = cb << sh;
      uint16_t* val = reinterpret_cast<uint16_t*>(tmp);  // tmp is free here
      int vtop = 0;
      const int64_t c = ak.select_ge(ids, n, thr, pos, val, &vtop);
      if (c >= k) return take_kth(ak, val, c, k, vtop, cnt, base, out, pos);
    }
  }
  return take_kth(ak, ids, n, k, nbk, cnt, base, out);
}
}  // namespace

namespace {
// a key range [t0, t1) of approximating row r (offsets in its context)
struct ScoreTask {
  int64_t r, t0, t1;
};
struct SelectSched {  // per-call arrays (thread-local storage reused across calls)
  std::vector<float> g;  // the rows' group scores, at their candidate lists' offsets
  // pq rows scored as integer buckets (irange[r] > 0: ids[t] in [1, irange[r]] at the row's offset, g unused)
  std::vector<uint16_t> ids;
  std::vector<int32_t> irange;
  std::vector<ScoreTask> tasks;
};
SelectSched& select_sched() {
  thread_local SelectSched s;
  return s;
}
// keys per scoring task at least (a split costs a second table build and kernel call)
constexpr int64_t kScoreMinChunk = 1024;
// pq scores select by their integer core when its range (from the tables) has at most this many values
constexpr int32_t kIntBuckets = 8192;
}  // namespace

// Per query row (b, hk, m): its context, and for decode rows that approximate, the candidate list:
// the group query's popcount score (lutscore: nibble / byte tables; tasks of a row's key range), then
// per row the top by a histogram threshold, in index order.
void PackedAttentionKernel::select_kv(KvCall& c, Ort::KernelContext& ctx) const {
  const AttnParams& p = p_;
  const AttnKernels& ak = *ak_;
  const int64_t rows = c.B * c.Hkv * c.M, M = c.M, Tc = c.Tc, D = c.D, W = c.W, nw = c.fmt.nw;
  c.lo.assign(static_cast<size_t>(rows), 0);
  c.hi.assign(static_cast<size_t>(rows), 0);
  c.n.assign(static_cast<size_t>(rows), 0);
  c.off.assign(static_cast<size_t>(rows), -1);
  std::vector<int64_t> approx_rows;
  int64_t n_idx = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = r / (c.Hkv * M), m = r % M;
    const int64_t pos = c.pos0[static_cast<size_t>(b)] + m;
    if (pos >= c.total[static_cast<size_t>(b)]) continue;  // padding row: Y = 0
    const int64_t lo = p.local_window > 0 ? std::max<int64_t>(0, pos - p.local_window + 1) : 0;
    const int64_t nctx = pos + 1 - lo;
    c.lo[static_cast<size_t>(r)] = lo;
    c.hi[static_cast<size_t>(r)] = pos + 1;
    c.n[static_cast<size_t>(r)] = nctx;
    const bool exact = c.global_exact || (M > 1 && !p.approx_prefill) || nctx <= p.min_context ||
                       n_candidates(p, nctx) >= nctx;
    if (!exact) {
      c.off[static_cast<size_t>(r)] = n_idx;  // room for the whole context (not the buffer's capacity Tc)
      n_idx += nctx;
      approx_rows.push_back(r);
    }
  }
  if (approx_rows.empty()) return;
  c.idx.resize(static_cast<size_t>(n_idx));
  SelectSched& sc = select_sched();
  // scores g of every approximating row's context (at off[r]), in tasks of a row's key range: one per
  // row, except on a wider pool with an odd number of rows, where the middle row's keys go in two
  // pieces (of >= kScoreMinChunk): ORT hands the first half of the tasks to one thread and the second
  // to the other, so SmolLM2's 3 KV heads run as 1.5 rows a thread with 4 table builds, not 6 (each
  // piece builds its row's tables: ~0.5 us)
  if (sc.g.size() < static_cast<size_t>(n_idx)) sc.g.resize(static_cast<size_t>(n_idx));
  float* gall = sc.g.data();
  const bool int_ok = p.mode == KeyMode::Pq && !p.oracle && p.cand_block == 1;
  if (int_ok && sc.ids.size() < static_cast<size_t>(n_idx)) sc.ids.resize(static_cast<size_t>(n_idx));
  sc.irange.assign(static_cast<size_t>(rows), 0);  // written by a row's first scoring task only
  uint16_t* idsall = sc.ids.data();
  int32_t* irange = sc.irange.data();
  sc.tasks.clear();
  const size_t mid = pool_.width() != 1 && approx_rows.size() % 2 ? approx_rows.size() / 2 : approx_rows.size();
  for (size_t j = 0; j < approx_rows.size(); ++j) {
    const int64_t r = approx_rows[j], nctx = c.n[static_cast<size_t>(r)];
    const int64_t pieces = j == mid && nctx >= 2 * kScoreMinChunk ? 2 : 1;
    for (int64_t k = 0; k < pieces; ++k) sc.tasks.push_back({r, nctx * k / pieces, nctx * (k + 1) / pieces});
  }
  std::atomic<bool> oom{false};
  auto score_task = [&](size_t i) noexcept {
    const int64_t r = sc.tasks[i].r, t0 = sc.tasks[i].t0, t1 = sc.tasks[i].t1;
    const int64_t b = r / (c.Hkv * M), hk = (r / M) % c.Hkv, m = r % M;
    const int64_t lo = c.lo[static_cast<size_t>(r)] + t0, nt = t1 - t0;
    const int64_t h0 = hk * c.rep;
    float* buf;
    const int64_t nbytes = (D + 7) / 8, lut_n = nbytes * 256;
    try {
      buf = task_scratch().get(static_cast<size_t>(2 * nt + lut_n + 2 * D + nbytes * 8 + nbytes * 32 + 4 * D + 64));
    } catch (...) {
      oom = true;
      return;
    }
    float* g = gall + c.off[static_cast<size_t>(r)] + t0;  // [nt] group score
    int32_t* core = reinterpret_cast<int32_t*>(buf);       // [nt]
    int32_t* core1 = core + nt;                            // [nt] ternary plane 1
    int32_t* lut = core1 + nt;                             // [nbytes][256]
    float* qg = reinterpret_cast<float*>(lut + lut_n);     // [D]
    float* kd = qg + D;                                    // [D]
    int32_t* qi = reinterpret_cast<int32_t*>(kd + D);      // [nbytes * 8] the quantized query
    int32_t* tabs = qi + nbytes * 8;                       // pq: [nbytes][32] the subspaces' integer tables
    float* tf = reinterpret_cast<float*>(tabs + nbytes * 32);  // pq: [D / 4][16] their float values
    const int64_t nctx = nt;  // the scoring below runs over this task's keys [lo, lo + nt)
    // the group query: sum of its heads' rows, in head order
    const float* q0 = c.Q + ((b * c.Hq + h0) * M + m) * D;
    for (int64_t d = 0; d < D; ++d) qg[d] = q0[d];
    for (int64_t h = 1; h < c.rep; ++h) {
      const float* qh = c.Q + ((b * c.Hq + h0 + h) * M + m) * D;
      for (int64_t d = 0; d < D; ++d) qg[d] = qg[d] + qh[d];
    }
    const uint32_t* kb = c.bits + ((b * c.Hkv + hk) * Tc + lo) * W;
    const uint32_t* kvb = c.kv + ((b * c.Hkv + hk) * Tc + lo) * c.kf.words;
    if (p.oracle) {  // exact scores on the dequantized keys (measurement only)
      for (int64_t t = 0; t < nctx; ++t) {
        const uint32_t* row = kvb + t * c.kf.words;
        const uint8_t* kr = c.kf.k(row);
        ak.deq_rows(&kr, 1, D, c.kf.bits, kd);
        const float dot = ak.dot(qg, kd, D);
        // reference: (K̂ @ q) * scale with K̂ = code * kscale
        g[t] = dot * c.kscale(b * c.Hkv + hk, lo + t) * p.scale;
      }
      masked_scores(c, b, h0, m, lo, nctx, g);
    } else if (p.mode == KeyMode::Pq) {
      // tf[s][c] = group query . centroid c of subspace s (float32, j in order), quantized to +-L over the
      // largest |tf|; the score of a key is the sum of its codes' entries (lutscore with these tables)
      // (from the transposed book: 16 centroids a vector, the same products and sums in the same order,
      // and rounded by rint_small, not libm's nearbyint: this setup runs per scoring task, and a 2-thread
      // pool splits a row's keys over two)
      const int64_t ns = D / kPqWidth;
      const float* bt = p.pq_book_t.data() + hk * D * kPqCodes;  // [D / 4][4][16]
      const int64_t* dims = p.pq_dims.empty() ? nullptr : p.pq_dims.data();
      // (SSE2, 4 centroids a step: the same products and sums in the same order as a scalar loop over
      // the centroids, which took ~1/6 of the scoring task with the tables below)
      static_assert(kPqCodes % 4 == 0, "4 centroids a step");
      const __m128 absm = _mm_castsi128_ps(_mm_set1_epi32(0x7FFFFFFF)), vinf = _mm_set1_ps(INFINITY);
      __m128 am = _mm_setzero_ps(), fin4 = _mm_castsi128_ps(_mm_set1_epi32(-1));
      for (int64_t s = 0; s < ns; ++s) {
        __m128 x[kPqWidth];
        for (int j = 0; j < kPqWidth; ++j) x[j] = _mm_set1_ps(qg[dims ? dims[s * kPqWidth + j] : s * kPqWidth + j]);
        const float* b = bt + s * kPqWidth * kPqCodes;
        for (int c4 = 0; c4 < kPqCodes; c4 += 4) {
          __m128 v = _mm_mul_ps(x[0], _mm_loadu_ps(b + c4));
          for (int j = 1; j < kPqWidth; ++j) v = _mm_add_ps(v, _mm_mul_ps(x[j], _mm_loadu_ps(b + j * kPqCodes + c4)));
          _mm_storeu_ps(tf + s * kPqCodes + c4, v);
          const __m128 av = _mm_and_ps(v, absm);
          fin4 = _mm_and_ps(fin4, _mm_cmplt_ps(av, vinf));  // NaN and +-inf: not finite
          am = _mm_max_ps(am, av);
        }
      }
      const float a = _mm_cvtss_f32(fold_max4(am));  // max |tf| (used only when every tf is finite)
      const bool finite = _mm_movemask_ps(fin4) == 0xF;
      if (!(a > 0) || !finite) {  // no information (zero or non-finite query): all scores 0 (then the mask)
        std::fill(g, g + nctx, 0.0f);
        masked_scores(c, b, h0, m, lo, nctx, g);
      } else {
        const float L = static_cast<float>((1 << (p.qbits - 1)) - 1);
        const float inv = L / a;
        std::fill(tabs, tabs + nbytes * 32, 0);
        // the integer tables (rint_small, 4 a step) and the sums of their minima / maxima (the range of a
        // key's score)
        const __m128 vinv = _mm_set1_ps(inv);
        int64_t tlo = 0, thi = 0;
        for (int64_t s = 0; s < ns; ++s) {
          int32_t* ts = tabs + (s / 2) * 32 + (s % 2) * 16;
          __m128 mn = vinf, mx = _mm_set1_ps(-INFINITY);
          for (int c4 = 0; c4 < kPqCodes; c4 += 4) {
            const __m128 v = rint_small4(_mm_mul_ps(_mm_loadu_ps(tf + s * kPqCodes + c4), vinv));
            mn = _mm_min_ps(mn, v);
            mx = _mm_max_ps(mx, v);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(ts + c4), _mm_cvttps_epi32(v));  // integral: exact
          }
          tlo += static_cast<int64_t>(_mm_cvtss_f32(fold_min4(mn)));
          thi += static_cast<int64_t>(_mm_cvtss_f32(fold_max4(mx)));
        }
        const float* mr = c.mask_row(b, h0, m);
        ScoreFinish fin{};
        fin.two = 1;
        fin.qs = 0;
        fin.gword = -1;  // pq rows have no gamma word (the reference's pq score has no key scale)
        fin.coef = (a / L) * p.scale;
        fin.mr = mr ? mr + lo * c.mst : nullptr;
        fin.mst = c.mst;
        fin.g = g;
        // Integer buckets: without a mask the score float(core) * coef orders keys as core does when coef
        // is a positive normal float and no product overflows (|core| < 2^24: distinct cores give distinct
        // products), so the selection can run on the core's exact values, bounded by the tables' extremes
        const double tmax = std::max(std::fabs(static_cast<double>(tlo)), std::fabs(static_cast<double>(thi)));
        if (int_ok && !mr && thi - tlo + 1 <= kIntBuckets && fin.coef >= FLT_MIN &&
            tmax * static_cast<double>(fin.coef) < static_cast<double>(FLT_MAX)) {
          fin.ids = idsall + c.off[static_cast<size_t>(r)] + t0;
          fin.ilo = static_cast<int32_t>(tlo);
          if (t0 == 0) irange[r] = static_cast<int32_t>(thi - tlo + 1);
        }
        ak.lutscore(kb, W, nctx, nbytes, qi, lut, core, &fin, tabs);
      }
    } else {
      const float* qa = qg;
      if (!p.kscale.empty()) {
        const float* ks = p.kscale.data() + hk * D;
        for (int64_t d = 0; d < D; ++d) kd[d] = qg[d] * ks[d];
        qa = kd;
      }
      float a = 0.0f;
      for (int64_t d = 0; d < D; ++d) a = std::max(a, std::fabs(qa[d]));
      if (!(a > 0)) {
        std::fill(g, g + nctx, 0.0f);
        masked_scores(c, b, h0, m, lo, nctx, g);
      } else {
        const float L = static_cast<float>((1 << (p.qbits - 1)) - 1);
        const float inv = L / a;
        // the query quantized per dimension (qi; 0 past D and for NaN), the tables built by lutscore
        int64_t qsum = 0;
        for (int64_t d = 0; d < nbytes * 8; ++d) {
          int32_t v = 0;
          if (d < D) {
            const float x = qa[d] * inv;
            v = std::isnan(x) ? 0 : static_cast<int32_t>(rint_small(x));  // |x| <= L
          }
          qi[d] = v;
          qsum += v;
        }
        // sign mode: the score of the +-1 key is 2 * (sum over its set bits) - sum of all qi
        const float* mr = c.mask_row(b, h0, m);
        ScoreFinish fin{};
        fin.two = p.mode == KeyMode::Sign ? 2 : 1;
        fin.qs = p.mode == KeyMode::Sign ? static_cast<int32_t>(qsum) : 0;
        fin.gword = c.fmt.gamma;
        fin.coef = (a / L) * p.scale;
        fin.mr = mr ? mr + lo * c.mst : nullptr;
        fin.mst = c.mst;
        fin.g = g;
        if (p.mode == KeyMode::Ternary) {  // two planes: core - core1, then the scores
          ak.lutscore(kb, W, nctx, nbytes, qi, lut, core, nullptr, nullptr);
          ak.lutscore(kb + nw, W, nctx, nbytes, qi, lut, core1, nullptr, nullptr);
          for (int64_t t = 0; t < nctx; ++t) core[t] -= core1[t];
          ak.score_finish(core, nctx, fin, kb, W);
        } else {
          ak.lutscore(kb, W, nctx, nbytes, qi, lut, core, &fin, nullptr);
        }
      }
    }
  };
  parallel_for(ctx, sc.tasks.size(), score_task);
  if (m_time_[0]) c.scored = std::chrono::steady_clock::now();
  if (oom) throw std::bad_alloc();
  auto select_task = [&](size_t i) noexcept {
    const int64_t r = approx_rows[i];
    const int64_t lo = c.lo[static_cast<size_t>(r)], nctx = c.n[static_cast<size_t>(r)];
    float* buf;
    const int32_t nbk = irange[r];
    try {
      buf = task_scratch().get(static_cast<size_t>(3 * nctx + 64 + (nbk ? nbk + 1 : 0)));
    } catch (...) {
      oom = true;
      return;
    }
    const float* g = gall + c.off[static_cast<size_t>(r)];  // [nctx] group score
    int32_t* core = reinterpret_cast<int32_t*>(buf);       // [nctx]
    int32_t* core1 = core + nctx;                          // [nctx]
    float* tmp = reinterpret_cast<float*>(core1 + nctx);   // [nctx]
    // candidates: first `sinks` of the context, last `window`, top of the rest (ties: lower index)
    const int64_t C = n_candidates(p, nctx);
    const int64_t ns = std::min(p.sinks, nctx), w0 = std::max(ns, nctx - p.window);
    int32_t* out = c.idx.data() + c.off[static_cast<size_t>(r)];
    int64_t n = 0;
    for (int64_t t = 0; t < ns; ++t) out[n++] = static_cast<int32_t>(lo + t);
    const int64_t nr = w0 - ns, k = std::min(std::max<int64_t>(0, C - ns - (nctx - w0)), nr);
    if (k >= nr) {
      for (int64_t t = ns; t < w0; ++t) out[n++] = static_cast<int32_t>(lo + t);
    } else if (k > 0 && p.cand_block > 1) {
      // blocks of B keys from the region's start (the last may be shorter), scored by their best key;
      // the top ceil(k / B) blocks are taken whole (ties: lower index), expanded in place from the end
      const int64_t B = p.cand_block, nbk = (nr + B - 1) / B, kb = std::min(nbk, (k + B - 1) / B);
      float* bs = reinterpret_cast<float*>(core1);  // free here
      for (int64_t j = 0; j < nbk; ++j) bs[j] = ak.maxv(g + ns + j * B, std::min(B, nr - j * B));
      int32_t* blk = out + n;
      if (kb < nbk) {
        top_k(ak, bs, nbk, kb, tmp, core, 0, blk);
      } else {
        for (int64_t j = 0; j < nbk; ++j) blk[j] = static_cast<int32_t>(j);
      }
      int64_t total = 0;
      for (int64_t j = 0; j < kb; ++j) total += std::min(B, nr - blk[j] * B);
      int64_t pos = n + total;  // block j fills [n + (lengths of blocks < j), ...) >= n + j: ids j' < j unread
      for (int64_t j = kb - 1; j >= 0; --j) {
        const int64_t t0 = blk[j] * B, t1 = std::min(nr, t0 + B);
        for (int64_t t = t1 - 1; t >= t0; --t) out[--pos] = static_cast<int32_t>(lo + ns + t);
      }
      n += total;
    } else if (k > 0 && nbk) {  // integer buckets (pq)
      const uint16_t* ids = idsall + c.off[static_cast<size_t>(r)];
      n += top_k_ids(ak, ids + ns, nr, k, nbk, reinterpret_cast<int32_t*>(tmp + nctx), reinterpret_cast<int32_t*>(tmp),
                     core1, static_cast<int32_t>(lo + ns), out + n);
    } else if (k > 0) {
      n += top_k(ak, g + ns, nr, k, tmp, core, static_cast<int32_t>(lo + ns), out + n);  // core: free here
    }
    for (int64_t t = w0; t < nctx; ++t) out[n++] = static_cast<int32_t>(lo + t);
    c.n[static_cast<size_t>(r)] = n;
  };
  parallel_for(ctx, approx_rows.size(), select_task);
  if (oom) throw std::bad_alloc();
  metrics::add(m_active_, 1.0);
}

// softmax . V over each row's keys (range or candidate list) for the rep query heads of its group:
// tasks of up to kKvChunk keys (a row's keys in equal chunks) write partial (max, sum, y) per head,
// merged per row at the end; each task prefetches into the next chunk of its row (a.ahead), which
// the same thread usually runs next. Chunks of at least kKvMinChunk keys, about kKvTasks tasks
// when the keys allow (past 128: 3 rows of 129 keys would be 3 tasks on 2 threads); a pool seen to
// run on one thread (PoolProbe): chunks of kKvChunk (a misjudged probe costs balance only, as before).
// Each task starts its rows' fetches from DRAM anew: 6 tasks and chunks of up to 1024 keys (SmolLM2 at
// past 4096, budget 0.1875: 6 tasks of 384 rows on 2 threads, a row's 768 in one task on 1) made the
// op 2.3 % faster than 16 and 512 (geometric mean of 24 cells: ~4 % with 2 threads, ~1 % with 1; pasts
// 1024 / 4096 / 8184, budgets 0.25 / 0.1875, attn_speed decode A/B in both slots; the logs are in git history).
namespace {
constexpr int64_t kKvMinChunk = 64, kKvTasks = 6;
struct AttendSched {  // per-call scheduling arrays (thread-local storage reused across calls)
  std::vector<int64_t> first_chunk, chunk_row, chunk_len;
  std::vector<float> part;
};
AttendSched& attend_sched() {
  thread_local AttendSched s;
  return s;
}
}  // namespace

void PackedAttentionKernel::attend_kv(KvCall& c, Ort::KernelContext& ctx) const {
  const AttnParams& p = p_;
  const AttnKernels& ak = *ak_;
  const int64_t rows = c.B * c.Hkv * c.M, M = c.M, D = c.D, Dv = c.Dv, rep = c.rep, Tc = c.Tc, R = c.kf.words;
  AttendSched& sc = attend_sched();
  int64_t keys = 0, cands = 0;
  for (int64_t r = 0; r < rows; ++r) keys += c.n[static_cast<size_t>(r)];
  cands = keys * rep;
  metrics::add(m_cands_, static_cast<double>(cands));
  const int width = pool_.width();
  int64_t chunk = kKvChunk;
  if (width != 1) {
    const int64_t even = (keys + kKvTasks - 1) / kKvTasks;
    chunk = std::min(kKvChunk, std::max(kKvMinChunk, (even + 31) / 32 * 32));
  }
  sc.first_chunk.resize(static_cast<size_t>(rows) + 1);
  sc.chunk_len.resize(static_cast<size_t>(rows) + 1);
  int64_t nchunks = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = c.n[static_cast<size_t>(r)];
    int64_t pieces = (n + chunk - 1) / chunk;
    // a split row in an even number of pieces (2-thread pools: 9 tasks of 342 keys ran 5:4, 25 %
    // slower than main's 6 x 512 + 3 x 1 at past 1024)
    if (width != 1 && pieces > 1 && pieces % 2 && pieces < n) ++pieces;
    sc.first_chunk[static_cast<size_t>(r)] = nchunks;
    sc.chunk_len[static_cast<size_t>(r)] = pieces ? (n + pieces - 1) / pieces : 0;  // equal pieces
    nchunks += pieces;
  }
  sc.first_chunk[static_cast<size_t>(rows)] = nchunks;
  const int64_t* first_chunk = sc.first_chunk.data();
  const int64_t* chunk_len = sc.chunk_len.data();
  sc.chunk_row.resize(static_cast<size_t>(nchunks));
  int64_t* chunk_row = sc.chunk_row.data();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = first_chunk[r]; k < first_chunk[r + 1]; ++k) chunk_row[k] = r;
  const int64_t ps = rep * (Dv + 2);
  if (sc.part.size() < static_cast<size_t>(nchunks * ps)) sc.part.resize(static_cast<size_t>(nchunks * ps));
  float* part = sc.part.data();
  std::atomic<bool> oom{false};
  auto task = [&](size_t k_) noexcept {
    const int64_t k = static_cast<int64_t>(k_), r = chunk_row[k];
    const int64_t b = r / (c.Hkv * M), hk = (r / M) % c.Hkv, m = r % M, h0 = hk * rep;
    const int64_t c0 = (k - first_chunk[r]) * chunk_len[r];
    const int irep = static_cast<int>(rep);
    float* buf;
    try {
      buf = task_scratch().get(kv_attend_scratch(irep, D, Dv) + static_cast<size_t>(2 * rep + 2));
    } catch (...) {
      oom = true;
      return;
    }
    const float** mrows = c.mask ? reinterpret_cast<const float**>(buf) : nullptr;  // [rep] mask rows
    if (mrows)
      for (int64_t h = 0; h < rep; ++h) mrows[h] = c.mask_row(b, h0 + h, m);
    KvAttend a{};
    a.q = c.Q + ((b * c.Hq + h0) * M + m) * D;  // heads at stride M * D
    a.ldq = M * D;
    a.nq = irep;
    a.base = reinterpret_cast<const uint8_t*>(c.kv + (b * c.Hkv + hk) * Tc * R);
    a.row_bytes = R * 4;
    a.kbytes = c.kf.kbytes;
    a.vbytes = c.kf.vbytes;
    a.sc = reinterpret_cast<const uint8_t*>(c.bits + ((b * c.Hkv + hk) * Tc) * c.W + c.fmt.words);
    a.sc_stride = c.W * 4;
    a.list = c.off[static_cast<size_t>(r)] >= 0 ? c.idx.data() + c.off[static_cast<size_t>(r)] + c0 : nullptr;
    a.start = c.lo[static_cast<size_t>(r)] + c0;
    a.n = std::min(chunk_len[r], c.n[static_cast<size_t>(r)] - c0);
    a.ahead = std::min(chunk_len[r], c.n[static_cast<size_t>(r)] - c0 - a.n);
    a.bits = c.kf.bits;
    a.D = D;
    a.Dv = Dv;
    a.scale = p.scale;
    a.softcap = p.softcap;
    a.mask = mrows;
    a.mst = c.mst;
    a.part = part + k * ps;
    a.scratch = buf + 2 * rep + 2;
    ak.kv_attend(a);
  };
  pool_.run(ctx, static_cast<size_t>(nchunks), task);
  if (oom) throw std::bad_alloc();
  // merge the chunks of each row into Y (padding rows: 0)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = r / (c.Hkv * M), hk = (r / M) % c.Hkv, m = r % M;
    const int64_t k0 = first_chunk[r], k1 = first_chunk[r + 1];
    for (int64_t h = 0; h < rep; ++h) {
      float* y = c.Y + ((b * c.Hq + hk * rep + h) * M + m) * Dv;
      if (k1 == k0 + 1) {  // one chunk: y / sum
        const float* ph = part + k0 * ps + h * (Dv + 2);
        if (!(ph[0] > -INFINITY)) {
          std::fill(y, y + Dv, 0.0f);
          continue;
        }
        const float inv = 1.0f / ph[1];
        for (int64_t d = 0; d < Dv; ++d) y[d] = ph[2 + d] * inv;
        continue;
      }
      float mx = -INFINITY;
      for (int64_t k = k0; k < k1; ++k) mx = std::max(mx, part[k * ps + h * (Dv + 2)]);
      std::fill(y, y + Dv, 0.0f);
      if (!(mx > -INFINITY)) continue;
      float sum = 0.0f;
      for (int64_t k = k0; k < k1; ++k) {
        const float* ph = part + k * ps + h * (Dv + 2);
        if (!(ph[0] > -INFINITY)) continue;
        const float f = std::exp(ph[0] - mx);
        sum += ph[1] * f;
        ak.axpy(f, ph + 2, y, Dv);
      }
      ak.scal(1.0f / sum, y, Dv);
    }
  }
}

// ------------------------------------------------------------------ GroupQueryAttention's layout
// num_heads > 0: the node takes GQA's own inputs (no Split / RotaryEmbedding / Reshape / Transpose
// nodes around it): Q [B, S, Hq * D], K [B, S, Hkv * D], V [B, S, Hkv * Dv], or Q alone packed
// [B, S, (Hq + 2 Hkv) * D]; inputs 7/8 cos/sin caches [max_pos, r / 2] rotate the first r dims of
// each Q and K head at positions pos0_b + m (GQA's do_rotary; rotary_interleaved: pairs 2i, 2i + 1,
// else halves i, i + r / 2). Returned shapes are the [B, H, S, D] ones the cache mode reads.
std::array<std::vector<int64_t>, 3> PackedAttentionKernel::gqa_shapes(Ort::KernelContext& ctx) const {
  const int64_t Hq = p_.num_heads, Hkv = p_.kv_num_heads;
  const auto qs = ctx.GetInput(0).GetTensorTypeAndShapeInfo().GetShape();
  if (qs.size() != 3) fail("num_heads > 0: Q must be [B, S, H * D], got " + shape_str(qs));
  const int64_t B = qs[0], S = qs[1];
  Ort::ConstValue kv = ctx.GetInputCount() > 1 ? ctx.GetInput(1) : Ort::ConstValue{nullptr};
  Ort::ConstValue vv = ctx.GetInputCount() > 2 ? ctx.GetInput(2) : Ort::ConstValue{nullptr};
  if (static_cast<bool>(kv) != static_cast<bool>(vv)) fail("num_heads > 0: K and V are both given or both absent");
  int64_t D, Dv;
  if (!kv) {
    if (qs[2] % (Hq + 2 * Hkv)) fail("packed QKV " + shape_str(qs) + ": width not a multiple of num_heads + 2 kv_num_heads");
    D = Dv = qs[2] / (Hq + 2 * Hkv);
  } else {
    const auto ks = kv.GetTensorTypeAndShapeInfo().GetShape(), vs = vv.GetTensorTypeAndShapeInfo().GetShape();
    if (qs[2] % Hq || ks.size() != 3 || vs.size() != 3 || ks[0] != B || vs[0] != B || ks[1] != S || vs[1] != S ||
        ks[2] * Hq != qs[2] * Hkv || vs[2] % Hkv)
      fail("num_heads > 0: Q " + shape_str(qs) + ", K " + shape_str(ks) + ", V " + shape_str(vs) +
           " are not [B, S, H * D] of " + std::to_string(Hq) + " / " + std::to_string(Hkv) + " heads");
    D = qs[2] / Hq;
    Dv = vs[2] / Hkv;
  }
  return {std::vector<int64_t>{B, Hq, S, D}, std::vector<int64_t>{B, Hkv, S, D}, std::vector<int64_t>{B, Hkv, S, Dv}};
}

namespace {
Scratch& stage_scratch() {  // the staged Q/K/V/Y of one call (outer and task scratch are taken)
  thread_local Scratch s;
  return s;
}
}  // namespace

void PackedAttentionKernel::stage_gqa(KvCall& c, Ort::KernelContext& ctx) const {
  const int64_t B = c.B, Hq = c.Hq, Hkv = c.Hkv, M = c.M, D = c.D, Dv = c.Dv;
  const float* q = ctx.GetInput(0).GetTensorData<float>();
  const bool packed = data_or_null<float>(ctx, 1) == nullptr;
  const float* k = packed ? q + Hq * D : ctx.GetInput(1).GetTensorData<float>();
  const float* v = packed ? q + (Hq + Hkv) * D : ctx.GetInput(2).GetTensorData<float>();
  const int64_t qw = packed ? (Hq + 2 * Hkv) * D : Hq * D, kw = packed ? qw : Hkv * D, vw = packed ? qw : Hkv * Dv;
  // rotary caches
  const float *cs = data_or_null<float>(ctx, 7), *sn = data_or_null<float>(ctx, 8);
  int64_t half = 0, max_pos = 0;
  if (static_cast<bool>(cs) != static_cast<bool>(sn)) fail("cos_cache and sin_cache are both given or both absent");
  if (cs) {
    const auto cshp = ctx.GetInput(7).GetTensorTypeAndShapeInfo().GetShape();
    const auto sshp = ctx.GetInput(8).GetTensorTypeAndShapeInfo().GetShape();
    if (cshp.size() != 2 || cshp != sshp || 2 * cshp[1] > D || cshp[1] < 1)
      fail("cos_cache " + shape_str(cshp) + " / sin_cache " + shape_str(sshp) + " must both be [max_pos, r / 2], r <= head dim " +
           std::to_string(D));
    max_pos = cshp[0];
    half = cshp[1];
  }
  const size_t nq = static_cast<size_t>(B * Hq * M * D), nk = static_cast<size_t>(B * Hkv * M * D),
               nv = static_cast<size_t>(B * Hkv * M * Dv), ny = M > 1 ? static_cast<size_t>(B * Hq * M * Dv) : 0;
  float* buf = stage_scratch().get(round_up16(nq) + round_up16(nk) + round_up16(nv) + ny + 16);
  float* Q4 = buf;
  float* K4 = Q4 + round_up16(nq);
  float* V4 = K4 + round_up16(nk);
  const bool inter = p_.rotary_interleaved != 0;
  check_ksmooth(Hkv, D, half);
  const float* smq = p_.ksmooth.empty() ? nullptr : p_.ksmooth.data();  // key smoothing: q * s, k * (1 / s)
  const float* smk = p_.kinv.empty() ? nullptr : p_.kinv.data();
  // dst = src (times mul when given), then rotated at pos (pos < 0: not rotated)
  auto put = [&](const float* src, float* dst, int64_t d, int64_t pos, const float* mul) {
    if (mul) {
      for (int64_t j = 0; j < d; ++j) dst[j] = src[j] * mul[j];
    } else {
      std::memcpy(dst, src, sizeof(float) * static_cast<size_t>(d));
    }
    if (pos < 0) return;
    const float* cr = cs + pos * half;
    const float* sr = sn + pos * half;
    for (int64_t i = 0; i < half; ++i) {
      const int64_t i1 = inter ? 2 * i : i, i2 = inter ? 2 * i + 1 : i + half;
      const float x1 = dst[i1], x2 = dst[i2];
      dst[i1] = x1 * cr[i] - x2 * sr[i];
      dst[i2] = x2 * cr[i] + x1 * sr[i];
    }
  };
  const int64_t grp = Hq / Hkv;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t m = 0; m < M; ++m) {
      const int64_t pos = c.pos0[static_cast<size_t>(b)] + m;
      // rows at or beyond the sequence's total are padding (not stored, Y = 0): no rotary
      const int64_t rp = cs && pos < c.total[static_cast<size_t>(b)] ? pos : -1;
      if (rp >= max_pos && cs)
        fail("position " + std::to_string(rp) + " beyond the rotary caches' " + std::to_string(max_pos) + " rows");
      const int64_t row = b * M + m;
      for (int64_t h = 0; h < Hq; ++h)
        put(q + row * qw + h * D, Q4 + ((b * Hq + h) * M + m) * D, D, rp, smq ? smq + (h / grp) * D : nullptr);
      for (int64_t h = 0; h < Hkv; ++h) {
        put(k + row * kw + h * D, K4 + ((b * Hkv + h) * M + m) * D, D, rp, smk ? smk + h * D : nullptr);
        put(v + row * vw + h * Dv, V4 + ((b * Hkv + h) * M + m) * Dv, Dv, -1, nullptr);
      }
    }
  }
  c.Q = Q4;
  c.K = K4;
  c.V = V4;
  float* out = ctx.GetOutput(0, {B, M, Hq * Dv}).GetTensorMutableData<float>();
  if (M == 1) {
    c.Y = out;  // [B, 1, Hq * Dv] is [B, Hq, 1, Dv] in memory
  } else {
    c.Y = V4 + round_up16(nv);
    c.y_bsh = out;
  }
}

// Prompt rows (M > 1, every row exact, no mask): per (sequence, KV head, tile of kPrefillTile query
// rows) the group's query heads against the tile's key range [k0, k1) in two GEMMs (OpenBLAS, one
// thread per task), each row's keys outside its [lo, hi) masked, softcap, softmax. fp32 rows: S =
// scale Q.K^T straight from the rows (K's floats at the row start, V's after them,
// leading dimension R), Y = P.V. int8 / int4 rows, as the reference's query_int16 path: the query
// heads quantized per row to kQLevels levels by the decode kernel's quantize_query (qi, qs), the key codes as floats (deq_rows), S = qi.codes
// (integers, exact in float up to 2^24 per product sum), logit = S * (qs * (kscale * scale)), Y =
// (P * vscale).vcodes. The same numbers as attend_kv's per-row online softmax up to float summation
// order, reading each key once per tile instead of once per query row.
bool PackedAttentionKernel::prefill_gemm(KvCall& c, Ort::KernelContext& ctx) const {
  constexpr int64_t kPrefillTile = 32;
  const int64_t M = c.M, rep = c.rep, D = c.D, Dv = c.Dv, R = c.kf.words, Tc = c.Tc;
  if (M < 2 || c.mask || !c.idx.empty()) return false;
  const bool f32 = c.kf.bits == 32;
  const int64_t tiles = (M + kPrefillTile - 1) / kPrefillTile, ntask = c.B * c.Hkv * tiles;
  const float sc = p_.scale, cap = p_.softcap;
  std::atomic<bool> oom{false};
  auto task = [&](size_t t_) noexcept {
    const int64_t t = static_cast<int64_t>(t_), tile = t % tiles, bh = t / tiles, b = bh / c.Hkv, hk = bh % c.Hkv;
    const int64_t m0 = tile * kPrefillTile, mt = std::min(kPrefillTile, M - m0), rows = rep * mt;
    int64_t k0 = INT64_MAX, k1 = 0;
    for (int64_t m = m0; m < m0 + mt; ++m) {
      const size_t r = static_cast<size_t>((b * c.Hkv + hk) * M + m);
      if (c.n[r] <= 0) continue;
      k0 = std::min(k0, c.lo[r]);
      k1 = std::max(k1, c.hi[r]);
    }
    for (int64_t h = 0; h < rep; ++h)  // padding rows (and an all-padding tile): Y = 0
      std::fill(c.Y + ((b * c.Hq + hk * rep + h) * M + m0) * Dv, c.Y + ((b * c.Hq + hk * rep + h) * M + m0 + mt) * Dv, 0.0f);
    if (k1 <= k0) return;
    const int64_t T = k1 - k0;
    float* buf;
    const int64_t D16 = (D + 15) / 16 * 16;
    try {  // Qt, S, Yt; quantized rows also: qs, key scales, V scales, K codes, V codes, 2T row pointers,
           // one row's rep int16 query heads and their scales
      const size_t extra = f32 ? 0 : static_cast<size_t>(rows + 2 * T + T * (D + Dv) + 4 * T + 8 + rep * D16 / 2 + rep + 8);
      buf = task_scratch().get(static_cast<size_t>(rows * (D + T + Dv) + 16) + extra);
    } catch (...) {
      oom = true;
      return;
    }
    float* Qt = buf;               // [rep * mt, D]: head h's rows at h * mt
    float* S = Qt + rows * D;      // [rep * mt, T]
    float* Yt = S + rows * T;      // [rep * mt, Dv]
    const uint32_t* rb = c.kv + ((b * c.Hkv + hk) * Tc + k0) * R;
    const float *Kp, *Vp;
    int64_t ldk, ldv;
    float *qs = nullptr, *ks = nullptr, *vs = nullptr;
    if (f32) {
      for (int64_t h = 0; h < rep; ++h)
        std::memcpy(Qt + h * mt * D, c.Q + ((b * c.Hq + hk * rep + h) * M + m0) * D, sizeof(float) * static_cast<size_t>(mt * D));
      Kp = reinterpret_cast<const float*>(rb);
      Vp = Kp + c.kf.kbytes / 4;
      ldk = ldv = R;
    } else {
      qs = Yt + rows * Dv;
      ks = qs + rows;
      vs = ks + T;
      float* Kc = vs + T;
      float* Vc = Kc + T * D;
      const uint8_t** rp = reinterpret_cast<const uint8_t**>((reinterpret_cast<uintptr_t>(Vc + T * Dv) + 7) & ~uintptr_t{7});
      float* qsm = reinterpret_cast<float*>(rp + 2 * T);       // [rep] one row's head scales
      int16_t* q16 = reinterpret_cast<int16_t*>(qsm + rep);    // [rep][D16] its int16 heads
      for (int64_t m = 0; m < mt; ++m) {  // the decode kernel's query levels (kv_attend), as floats
        ak_->quantize_query(c.Q + ((b * c.Hq + hk * rep) * M + m0 + m) * D, M * D, static_cast<int>(rep), D, D16, q16, qsm);
        for (int64_t h = 0; h < rep; ++h) {
          float* o = Qt + (h * mt + m) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = static_cast<float>(q16[h * D16 + d]);
          qs[h * mt + m] = qsm[h];
        }
      }
      for (int64_t j = 0; j < T; ++j) {
        const uint32_t* row = rb + j * R;
        rp[j] = c.kf.k(row);
        rp[T + j] = c.kf.v(row);
        ks[j] = c.kscale(b * c.Hkv + hk, k0 + j) * sc;
        vs[j] = c.vscale(b * c.Hkv + hk, k0 + j);
      }
      ak_->deq_rows(rp, T, D, c.kf.bits, Kc);
      ak_->deq_rows(rp + T, T, Dv, c.kf.bits, Vc);
      Kp = Kc;
      Vp = Vc;
      ldk = D;
      ldv = Dv;
    }
    blas::sgemm(false, true, rows, T, D, f32 ? sc : 1.0f, Qt, D, Kp, ldk, 0.0f, S, T);
    for (int64_t i = 0; i < rows; ++i) {
      const size_t r = static_cast<size_t>((b * c.Hkv + hk) * M + m0 + i % mt);
      float* s = S + i * T;
      const int64_t lo = c.n[r] > 0 ? c.lo[r] - k0 : T, hi = c.n[r] > 0 ? c.hi[r] - k0 : T;
      if (!f32)
        for (int64_t j = lo; j < hi; ++j) s[j] *= qs[i] * ks[j];
      if (cap > 0)
        for (int64_t j = lo; j < hi; ++j) s[j] = cap * std::tanh(s[j] / cap);
      float mx = -INFINITY;
      for (int64_t j = lo; j < hi; ++j) mx = s[j] > mx ? s[j] : mx;
      for (int64_t j = 0; j < lo; ++j) s[j] = 0.0f;
      for (int64_t j = hi; j < T; ++j) s[j] = 0.0f;
      if (!(mx > -INFINITY)) {  // no key (padding) or every logit -inf / NaN: Y = 0 as attend_kv
        for (int64_t j = lo; j < hi; ++j) s[j] = 0.0f;
        continue;
      }
      const float sum = ak_->expsum(s + lo, mx, hi - lo);
      const float inv = 1.0f / sum;
      if (f32)
        for (int64_t j = lo; j < hi; ++j) s[j] *= inv;
      else
        for (int64_t j = lo; j < hi; ++j) s[j] *= inv * vs[j];
    }
    blas::sgemm(false, false, rows, Dv, T, 1.0f, S, T, Vp, ldv, 0.0f, Yt, Dv);
    for (int64_t h = 0; h < rep; ++h)
      for (int64_t m = 0; m < mt; ++m) {
        const size_t r = static_cast<size_t>((b * c.Hkv + hk) * M + m0 + m);
        if (c.n[r] > 0)
          std::memcpy(c.Y + ((b * c.Hq + hk * rep + h) * M + m0 + m) * Dv, Yt + (h * mt + m) * Dv,
                      sizeof(float) * static_cast<size_t>(Dv));
      }
  };
  parallel_for(ctx, static_cast<size_t>(ntask), task);
  if (oom) throw std::bad_alloc();
  return true;
}

// Sparse prefill (custom_ops/reference/attn.py, prefill_keys): the call's prompt rows in tiles of
// prefill_block rows by position, the keys in blocks of as many from key 0. A tile attends to the sink
// blocks, the local blocks (from prefill_window keys before its first row) and the middle blocks whose
// bound u(j) = (q.c_j + |q|.r_j) * scale — c, r the centre and radius of block j's decoded keys per
// dimension (Quest's bound on q.k), the largest over its sub-blocks of kBoundKeys keys — gives the most mass as a softmax's weights exp(u(j) - max u) per
// query row, summed over the tile's rows and heads; `keep` = ceil(budget * middle blocks) of them (a tile
// below prefill_min_context, or whose budget covers every middle block, or of the last prefill_tail rows of
// its sequence in the call, attends to every block; no tail when prompt_continues — the input, or the
// calling thread's flag — says a later call holds the prompt's end). Phase 1 (tasks of a KV head's
// blocks) decodes the complete past blocks' keys once per call into their centre and radius; phase 2 (tasks of (sequence, KV head, tile))
// scores the middle blocks in one GEMM ([q, |q|] . [c; r]^T), takes the best, and attends the tile's
// query heads to the chosen keys in chunks of kChunk keys: S = Q.K^T, causal mask, online
// softmax, Y += P.V — fp32 rows by OpenBLAS, int8 / int4 rows on integers (qk_i16: the decode kernel's
// int16 query levels times the key codes, exact; pv_i16: 15-bit weights times the value codes).
// keys per box of the blocks' bounds (a block of prefill_block keys not a multiple of it: one box)
constexpr int64_t kBoundKeys = 16;

bool PackedAttentionKernel::prefill_sparse(KvCall& c, Ort::KernelContext& ctx) const {
  const AttnParams& p = p_;
  if (c.M < 2 || c.mask || !c.idx.empty() || p.approx_prefill || p.local_window > 0) return false;
  // without a sparse budget, the exact prompt rows of a long context run here too (every tile exact):
  // its key chunks stay in the caches where prefill_gemm's rows x context score matrix does not
  const bool sparse_on = p.prefill_budget > 0 && p.prefill_budget < 1;
  if (!sparse_on && c.Tc < kFlashMinContext) return false;
  const int64_t Bk = p.prefill_block, M = c.M, rep = c.rep, D = c.D, Dv = c.Dv, R = c.kf.words, Tc = c.Tc;
  const int64_t BH = c.B * c.Hkv, D2 = 2 * D;
  const bool f32 = c.kf.bits == 32;
  // int8 / int4 rows: Q.K^T on the int16 query levels and the key codes (the decode kernel's exact integer
  // dot), P.V on 15-bit weights and the value codes (kernels/attn.h: qk_i16, p16_row, pv_i16)
  const bool ints = !f32 && D <= 4096 && Dv <= 4096;
  const float sc = p_.scale, cap = p_.softcap;
  // tiles per sequence: rows m with the same (pos0 + m) / Bk, the rows < total
  struct Tile {
    int64_t b, m0, m1;            // rows [m0, m1), positions [pa, pb]
    int64_t pa, pb, nb, ns, jl;   // context blocks, sink blocks, first local block
    int64_t keep;                 // middle blocks kept; -1: every block (exact)
  };
  std::vector<Tile> tiles;
  int64_t J = 0;  // blocks [0, J) whose centre and radius phase 1 computes (the sparse tiles' largest jl)
  for (int64_t b = 0; b < c.B; ++b) {
    const int64_t p0 = c.pos0[static_cast<size_t>(b)], nrow = std::min(M, c.total[static_cast<size_t>(b)] - p0);
    // rows from tail0 on (the last prefill_tail of the sequence's rows) attend to every key: a tile
    // does not straddle tail0
    const int64_t tail0 = std::max<int64_t>(0, nrow - (c.continues ? 0 : p.prefill_tail));
    for (int64_t m = 0; m < nrow;) {
      int64_t m1 = std::min(nrow, ((p0 + m) / Bk + 1) * Bk - p0);
      if (m < tail0 && m1 > tail0) m1 = tail0;
      Tile tl{b, m, m1, p0 + m, p0 + m1 - 1, 0, 0, 0, -1};
      tl.nb = tl.pb / Bk + 1;
      tl.ns = p.sinks > 0 ? std::min(tl.nb, (p.sinks + Bk - 1) / Bk) : 0;
      tl.jl = std::max<int64_t>(0, tl.pa - p.prefill_window) / Bk;
      const int64_t nmid = std::max<int64_t>(0, tl.jl - tl.ns);
      // the budget is the share of the middle blocks a tile reads (the sinks and the local window always)
      const int64_t keep =
          static_cast<int64_t>(std::ceil(static_cast<double>(p.prefill_budget) * static_cast<double>(nmid)));
      if (sparse_on && m < tail0 && tl.pb + 1 > p.prefill_min_context && keep < nmid) {
        tl.keep = keep;
        J = std::max(J, tl.jl);
      }
      tiles.push_back(tl);
      m = m1;
    }
  }
  if (tiles.empty()) return false;
  // phase 1: centre and radius of the sub-blocks (kBoundKeys keys) of blocks [0, J) of every (b, hk):
  // blk[((bh * J + j) * nsb + s) * 2D + (0 | D) + d]
  const int64_t sbk = Bk % kBoundKeys == 0 ? kBoundKeys : Bk, nsb = Bk / sbk;
  float* blk = nullptr;
  if (J > 0) {
    blk = outer_scratch().get(static_cast<size_t>(BH * J * nsb * D2) + 16);
    constexpr int64_t kBlocksPerTask = 16;
    const int64_t per = (J + kBlocksPerTask - 1) / kBlocksPerTask;
    std::atomic<bool> oom{false};
    auto summarize = [&](size_t t_) noexcept {
      const int64_t t = static_cast<int64_t>(t_), bh = t / per, j0 = (t % per) * kBlocksPerTask,
                    j1 = std::min(J, j0 + kBlocksPerTask);
      float* kf;
      try {
        kf = task_scratch().get(static_cast<size_t>(Bk * D + 2 * Bk) + 16);
      } catch (...) {
        oom = true;
        return;
      }
      const uint8_t** rp = reinterpret_cast<const uint8_t**>(kf + Bk * D);
      for (int64_t j = j0; j < j1; ++j) {
        for (int64_t i = 0; i < Bk; ++i) rp[i] = c.kf.k(c.kv + (bh * Tc + j * Bk + i) * R);
        ak_->deq_rows(rp, Bk, D, c.kf.bits, kf);
        for (int64_t sb = 0; sb < nsb; ++sb) {
          float* cr = blk + ((bh * J + j) * nsb + sb) * D2;
          float* mx = cr;      // max, then the centre
          float* mn = cr + D;  // min, then the radius
          for (int64_t i = sb * sbk; i < (sb + 1) * sbk; ++i) {
            const float s = c.kscale(bh, j * Bk + i);
            const float* x = kf + i * D;
            for (int64_t d = 0; d < D; ++d) {
              const float v = f32 ? x[d] : x[d] * s;
              if (i == sb * sbk) {
                mx[d] = mn[d] = v;
              } else {
                mx[d] = v > mx[d] ? v : mx[d];  // NaN keys do not move the bounds
                mn[d] = v < mn[d] ? v : mn[d];
              }
            }
          }
          for (int64_t d = 0; d < D; ++d) {
            const float hi = mx[d], lo = mn[d];
            mx[d] = (hi + lo) * 0.5f;
            mn[d] = (hi - lo) * 0.5f;
          }
        }
      }
    };
    parallel_for(ctx, static_cast<size_t>(BH * per), summarize);
    if (oom) throw std::bad_alloc();
  }
  // phase 2: per (b, hk, tile)
  constexpr int64_t kChunk = 256;  // keys per S = Q.K^T chunk
  const int64_t ntiles = static_cast<int64_t>(tiles.size());
  std::atomic<int64_t> n_ctx{0}, n_att{0};
  std::atomic<bool> oom{false};
  auto task = [&](size_t t_) noexcept {
    // tiles in the order first, last, second, second last ...: a pool that hands each thread a
    // contiguous range of tasks gets light (early) and heavy (late) tiles alike
    const int64_t t = static_cast<int64_t>(t_), hk = t % c.Hkv, z = t / c.Hkv;
    const Tile& tl = tiles[static_cast<size_t>(z % 2 ? ntiles - 1 - z / 2 : z / 2)];
    const int64_t b = tl.b, bh = b * c.Hkv + hk, mt = tl.m1 - tl.m0, rows = rep * mt;
    const int64_t pa = tl.pa, pb = tl.pb, nb = tl.nb, ns = tl.ns, jl = tl.jl, keep = tl.keep;
    const bool sparse = keep >= 0;
    const int64_t nmid = sparse ? jl - ns : 0;
    const int64_t D16 = (D + 15) / 16 * 16;
    constexpr int64_t ldp = kChunk + 2;  // int16 weights per row (ints)
    float* buf;
    try {
      const size_t need = static_cast<size_t>(rows * (D + Dv + kChunk + 4) + (sparse ? rows * (D2 + nmid * nsb) + 4 * nmid + 4 : 0) +
                                              nb + kChunk * (D + Dv + 2) + 2 * kChunk * 2 + rep * D16 + rep + 64 +
                                              (ints ? rows * (ldp / 2 + 1) + 32 : 0));
      buf = task_scratch().get(need);
    } catch (...) {
      oom = true;
      return;
    }
    float* Qt = buf;                 // [rows, D]: head h's rows at h * mt (int8 / int4: the int16 levels)
    float* qs = Qt + rows * D;       // [rows] the levels' scales
    float* mxr = qs + rows;          // [rows] running max
    float* sum = mxr + rows;         // [rows] running sum
    float* Yt = sum + rows;          // [rows, Dv]
    float* S = Yt + rows * Dv;       // [rows, kChunk]
    float* Kt = S + rows * kChunk;   // [kChunk, D]
    float* Vt = Kt + kChunk * D;     // [kChunk, Dv]
    float* ks = Vt + kChunk * Dv;    // [kChunk]
    float* vs = ks + kChunk;         // [kChunk]
    int32_t* sel = reinterpret_cast<int32_t*>(vs + kChunk);  // [nb] chosen blocks, ascending
    const uint8_t** rp = reinterpret_cast<const uint8_t**>((reinterpret_cast<uintptr_t>(sel + nb) + 7) & ~uintptr_t{7});
    float* rest = reinterpret_cast<float*>(rp + 2 * kChunk);
    int16_t* q16 = reinterpret_cast<int16_t*>(rest);  // [rep][D16] one row's int16 heads
    float* qsm = reinterpret_cast<float*>(q16 + rep * D16 + 16);  // [rep]
    float* more = qsm + rep + 16;
    // ints: the tile's int16 query levels [rows, D16] in Qt's place; the chunk's packed key / value codes
    // in Kt's / Vt's; each row's int16 weights [rows, ldp] and their scales [rows] past the sparse scratch
    int16_t* Q16 = reinterpret_cast<int16_t*>(Qt);
    int16_t* kp = reinterpret_cast<int16_t*>(Kt);
    int16_t* vp = reinterpret_cast<int16_t*>(Vt);
    float* psr = more + (sparse ? rows * (D2 + nmid * nsb) + 4 * nmid + 4 : 0) + 16;
    int16_t* p16 = reinterpret_cast<int16_t*>(psr + rows + 16);
    // the tile's query heads
    for (int64_t m = 0; m < mt; ++m) {
      const float* q = c.Q + ((b * c.Hq + hk * rep) * M + tl.m0 + m) * D;  // heads at stride M * D
      if (f32) {
        for (int64_t h = 0; h < rep; ++h) std::memcpy(Qt + (h * mt + m) * D, q + h * M * D, sizeof(float) * static_cast<size_t>(D));
      } else if (ints) {
        ak_->quantize_query(q, M * D, static_cast<int>(rep), D, D16, q16, qsm);
        for (int64_t h = 0; h < rep; ++h) {
          std::memcpy(Q16 + (h * mt + m) * D16, q16 + h * D16, sizeof(int16_t) * static_cast<size_t>(D16));
          qs[h * mt + m] = qsm[h];
        }
      } else {
        ak_->quantize_query(q, M * D, static_cast<int>(rep), D, D16, q16, qsm);
        for (int64_t h = 0; h < rep; ++h) {  // the levels times their scale: S below is the logits
          float* o = Qt + (h * mt + m) * D;
          const float f = qsm[h];
          for (int64_t d = 0; d < D; ++d) o[d] = static_cast<float>(q16[h * D16 + d]) * f;
          qs[h * mt + m] = qsm[h];
        }
      }
    }
    // the blocks
    int64_t nsel = 0;
    if (!sparse) {
      for (int64_t j = 0; j < nb; ++j) sel[nsel++] = static_cast<int32_t>(j);
    } else {
      for (int64_t j = 0; j < ns; ++j) sel[nsel++] = static_cast<int32_t>(j);
      float* Qx = more;                 // [rows, 2D]: q, |q| (float queries)
      float* U = Qx + rows * D2;        // [rows, nsb * nmid] the sub-blocks' bounds (sub-block s of block j at s * nmid + j)
      double* Sb = reinterpret_cast<double*>((reinterpret_cast<uintptr_t>(U + rows * nmid * nsb) + 7) & ~uintptr_t{7});
      int32_t* order = reinterpret_cast<int32_t*>(Sb + nmid);  // [nmid]
      for (int64_t h = 0; h < rep; ++h)
        for (int64_t m = 0; m < mt; ++m) {
          const float* q = c.Q + ((b * c.Hq + hk * rep + h) * M + tl.m0 + m) * D;
          float* o = Qx + (h * mt + m) * D2;
          for (int64_t d = 0; d < D; ++d) {
            o[d] = q[d];
            o[D + d] = std::fabs(q[d]);
          }
        }
      // U[i, s * nmid + j]: row i's bound on sub-block s of middle block j (one GEMM per sub-block
      // index, so that a block's sub-blocks sit nmid apart and the max over them runs along rows)
      for (int64_t s = 0; s < nsb; ++s)
        blas::sgemm(false, true, rows, nmid, D2, sc, Qx, D2, blk + ((bh * J + ns) * nsb + s) * D2, nsb * D2, 0.0f,
                    U + s * nmid, nsb * nmid);
      // per block the mass a softmax of the bounds gives it, summed over the tile's rows and heads: a
      // block's bound is the largest of its sub-blocks' (NaN: -inf), exp(u - the row's max) in float
      // (kernels' expsum: -inf -> 0), summed over rows in double
      for (int64_t j = 0; j < nmid; ++j) Sb[j] = 0.0;
      for (int64_t i = 0; i < rows; ++i) {
        float* u = U + i * nsb * nmid;
        for (int64_t k = 0; k < nsb * nmid; ++k) u[k] = u[k] != u[k] ? -INFINITY : u[k];
        for (int64_t s = 1; s < nsb; ++s) {
          const float* us = u + s * nmid;
          for (int64_t j = 0; j < nmid; ++j) u[j] = us[j] > u[j] ? us[j] : u[j];
        }
        const float top = ak_->maxv(u, nmid);
        if (!(top > -INFINITY) || top == INFINITY) continue;  // no finite bound: the row ranks nothing
        ak_->expsum(u, top, nmid);
        for (int64_t j = 0; j < nmid; ++j) Sb[j] += static_cast<double>(u[j]);
      }
      for (int64_t j = 0; j < nmid; ++j) order[j] = static_cast<int32_t>(j);
      std::partial_sort(order, order + keep, order + nmid, [&](int32_t x, int32_t y) {
        return Sb[x] > Sb[y] || (Sb[x] == Sb[y] && x < y);  // NaN never: weight 0 above
      });
      std::sort(order, order + keep);
      for (int64_t i = 0; i < keep; ++i) sel[nsel++] = static_cast<int32_t>(ns + order[i]);
      for (int64_t j = jl; j < nb; ++j) sel[nsel++] = static_cast<int32_t>(j);
    }
    // exact attention over the chosen blocks' keys, kChunk at a time
    for (int64_t i = 0; i < rows; ++i) {
      mxr[i] = -INFINITY;
      sum[i] = 0.0f;
    }
    std::fill(Yt, Yt + rows * Dv, 0.0f);
    int64_t attended = 0;
    int64_t bi = 0, off = 0;  // next key: block sel[bi], offset off
    while (bi < nsel) {
      int64_t nk = 0;
      int64_t keys[kChunk];
      while (nk < kChunk && bi < nsel) {
        const int64_t key = static_cast<int64_t>(sel[bi]) * Bk + off;
        if (key > pb) {  // the tile's last block ends at its last row
          bi = nsel;
          break;
        }
        keys[nk++] = key;
        if (++off == Bk) {
          off = 0;
          ++bi;
        }
      }
      if (!nk) break;
      for (int64_t j = 0; j < nk; ++j) {
        const uint32_t* row = c.kv + (bh * Tc + keys[j]) * R;
        rp[j] = c.kf.k(row);
        rp[kChunk + j] = c.kf.v(row);
        ks[j] = f32 ? 1.0f : c.kscale(bh, keys[j]) * sc;
        vs[j] = f32 ? 1.0f : c.vscale(bh, keys[j]);
      }
      if (ints) {  // S = the exact integer q.k times the query level's and the key's scales
        ak_->pack_k16(rp, nk, D, c.kf.bits, kp);
        ak_->pack_v16(rp + kChunk, nk, Dv, c.kf.bits, vp);
        ak_->qk_i16(Q16, rows, D16, qs, kp, nk, D, ks, S, nk);
      } else {
        ak_->deq_rows(rp, nk, D, c.kf.bits, Kt);
        ak_->deq_rows(rp + kChunk, nk, Dv, c.kf.bits, Vt);
        if (!f32)  // each key row times its scale (and the logit scale), each value row times its own
          for (int64_t j = 0; j < nk; ++j) {
            ak_->scal(ks[j], Kt + j * D, D);
            ak_->scal(vs[j], Vt + j * Dv, Dv);
          }
        blas::sgemm(false, true, rows, nk, D, f32 ? sc : 1.0f, Qt, D, Kt, D, 0.0f, S, nk);
      }
      // the rows' causal limits: keys are ascending, so a row's cuts a suffix, and only for the keys
      // past the tile's first row (its local blocks)
      const int64_t ahead = std::upper_bound(keys, keys + nk, pa - 1) - keys;  // keys < pa: every row's
      for (int64_t i = 0; i < rows; ++i) {
        float* s = S + i * nk;
        int64_t hi = nk;
        if (ahead < nk) {
          const int64_t pos = pa + i % mt;
          hi = std::upper_bound(keys + ahead, keys + nk, pos) - keys;
        }
        attended += hi;
        if (cap > 0)
          for (int64_t j = 0; j < hi; ++j) s[j] = cap * std::tanh(s[j] / cap);
        const float mx = hi ? ak_->maxv(s, hi) : -INFINITY;
        if (hi < nk) std::memset(s + hi, 0, sizeof(float) * static_cast<size_t>(nk - hi));
        const float nm = mx > mxr[i] ? mx : mxr[i];
        if (!(nm > -INFINITY) || nm == INFINITY) {  // nothing finite yet (or a NaN / inf logit): no weight
          std::memset(s, 0, sizeof(float) * static_cast<size_t>(hi));
          continue;
        }
        if (nm > mxr[i] && mxr[i] > -INFINITY) {
          const float f = std::exp(mxr[i] - nm);
          sum[i] *= f;
          ak_->scal(f, Yt + i * Dv, Dv);
        }
        mxr[i] = nm;
        sum[i] += ak_->expsum(s, nm, hi);
      }
      if (ints) {  // Y += P.V on the value codes: each row's weights times the value scales, 15-bit levels
        for (int64_t i = 0; i < rows; ++i) psr[i] = ak_->p16_row(S + i * nk, vs, nk, p16 + i * ldp);
        ak_->pv_i16(p16, rows, ldp, psr, vp, nk, Dv, Yt, Dv);
      } else {
        blas::sgemm(false, false, rows, Dv, nk, 1.0f, S, nk, Vt, Dv, 1.0f, Yt, Dv);
      }
    }
    n_att.fetch_add(attended / rep, std::memory_order_relaxed);
    int64_t ctxk = 0;
    for (int64_t m = 0; m < mt; ++m) ctxk += pa + m + 1;
    n_ctx.fetch_add(ctxk, std::memory_order_relaxed);
    for (int64_t h = 0; h < rep; ++h)
      for (int64_t m = 0; m < mt; ++m) {
        const int64_t i = h * mt + m;
        float* y = c.Y + ((b * c.Hq + hk * rep + h) * M + tl.m0 + m) * Dv;
        if (!(mxr[i] > -INFINITY)) {
          std::fill(y, y + Dv, 0.0f);
          continue;
        }
        const float inv = 1.0f / sum[i];
        for (int64_t d = 0; d < Dv; ++d) y[d] = Yt[i * Dv + d] * inv;
      }
  };
  parallel_for(ctx, static_cast<size_t>(ntiles * c.Hkv), task);
  if (oom) throw std::bad_alloc();
  // padding rows (at or beyond a sequence's total): Y = 0
  for (int64_t b = 0; b < c.B; ++b) {
    const int64_t nrow = std::max<int64_t>(0, std::min(M, c.total[static_cast<size_t>(b)] - c.pos0[static_cast<size_t>(b)]));
    for (int64_t h = 0; h < c.Hq; ++h)
      std::fill(c.Y + ((b * c.Hq + h) * M + nrow) * Dv, c.Y + ((b * c.Hq + h) * M + M) * Dv, 0.0f);
  }
  metrics::add(m_pf_keys_, static_cast<double>(n_ctx.load()));
  metrics::add(m_pf_attended_, static_cast<double>(n_att.load()));
  return true;
}

void PackedAttentionKernel::compute_kv(Ort::KernelContext& ctx) const {
  using clock = std::chrono::steady_clock;
  const bool timed = m_time_[0] != nullptr;
  const clock::time_point t0 = timed ? clock::now() : clock::time_point{};
  KvCall c = read_kv_inputs(ctx);
  const clock::time_point t1 = timed ? clock::now() : t0;
  store_kv(c, ctx);
  const clock::time_point t2 = timed ? clock::now() : t0;
  metrics::add(m_calls_, 1.0);
  select_kv(c, ctx);
  const clock::time_point t3 = timed ? clock::now() : t0;
  metrics::add(m_keys_, static_cast<double>(c.B * c.Hq * c.M * c.Tc));
  if (!prefill_sparse(c, ctx) && !prefill_gemm(c, ctx)) attend_kv(c, ctx);
  if (c.y_bsh) {  // staged [B, Hq, M, Dv] -> [B, M, Hq * Dv]
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.Hq; ++h)
        for (int64_t m = 0; m < c.M; ++m)
          std::memcpy(c.y_bsh + ((b * c.M + m) * c.Hq + h) * c.Dv, c.Y + ((b * c.Hq + h) * c.M + m) * c.Dv,
                      sizeof(float) * static_cast<size_t>(c.Dv));
  }
  if (timed) {
    const clock::time_point t4 = clock::now();
    const clock::time_point ts = c.scored == clock::time_point{} ? t2 : c.scored;  // no candidate rows: no scoring
    const auto us = metrics::elapsed_us;
    metrics::add(m_time_[0], us(t0, t1));
    metrics::add(m_time_[1], us(t1, t2));
    metrics::add(m_time_[2], us(t2, ts));
    metrics::add(m_time_[3], us(ts, t3));
    metrics::add(m_time_[4], us(t3, t4));
    metrics::add(m_time_[5], us(t0, t4));
    metrics::add(m_time_[6], 1.0);
  }
}

}  // namespace ortlean
