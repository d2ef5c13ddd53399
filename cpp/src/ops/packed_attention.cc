#include "ops/packed_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>

#include "isa.h"
#include "parallel.h"
#include "scratch.h"

namespace ortlean {

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
  p.mode = mode == "ternary" ? KeyMode::Ternary : mode == "binary" ? KeyMode::Binary : KeyMode::Sign;
  p.k_bhdt = layout == "bhdt";
  p.oracle = select == "exact";
  check_list_lengths(info);
  // popcount path: requested (auto | vpopcntdq | avx2 | scalar), clamped to the CPU and ORTLEAN_ISA
  const Isa cap = popcnt == "scalar" ? Isa::Scalar : popcnt == "avx2" ? Isa::Avx2 : Isa::Avx512;
  Isa level;
  ak_ = &pick(IsaTables<AttnKernels>{attn_kernels_scalar, attn_kernels_avx2, attn_kernels_avx512, CpuFeature::Popcnt,
                                     CpuFeature::Avx512Vpopcntdq},
              cap, &level);
  gemm_ = &gemm_kernels();

  metrics::Node* n = metrics::node(name_);
  n->set({{"pack.enabled", p.budget > 0 && p.budget < 1 ? 1.0 : 0.0},
          {"pack.mode", static_cast<double>(p.mode)},
          {"pack.popcnt", static_cast<double>(level)},
          {"pack.budget", p.budget}});
  n->gauges({{&m_density_, "pack.density"}});
  n->counters({{&m_active_, "pack.active"}, {&m_calls_, "pack.calls"}, {&m_cands_, "pack.candidates"},
               {&m_keys_, "pack.keys"}, {&m_packed_, "pack.packed_keys"}});
}

// eps_heads / kscale against the KV heads and head dim of K when its static shape says them (else
// at the first Run).
void PackedAttentionKernel::check_list_lengths(const Ort::ConstKernelInfo& info) const {
  if (p_.eps_heads.empty() && p_.kscale.empty()) return;
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
}

// ------------------------------------------------------------------ compute
AttnCall PackedAttentionKernel::read_inputs(Ort::KernelContext& ctx) const {
  const AttnParams& p = p_;
  Ort::ConstValue qv = ctx.GetInput(0), kv = ctx.GetInput(1), vv = ctx.GetInput(2);
  const auto qs = qv.GetTensorTypeAndShapeInfo().GetShape();
  const auto ks = kv.GetTensorTypeAndShapeInfo().GetShape();
  const auto vs = vv.GetTensorTypeAndShapeInfo().GetShape();
  if (qs.size() != 4 || ks.size() != 4 || vs.size() != 4)
    fail("Q, K, V must have rank 4, got " + shape_str(qs) + ", " + shape_str(ks) + ", " + shape_str(vs));
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

}  // namespace ortlean
