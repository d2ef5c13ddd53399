#include "packed_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <sstream>

#include "isa.h"

namespace ortlean {
namespace {

constexpr AttrSpec kAttrSpecs[] = {
    attr_float("scale", 1.0f),          attr_string("mode", "sign"),
    attr_float("eps", 0.0f),            attr_float("budget", 0.0f),
    attr_int("min_candidates", 64),     attr_int("sinks", 4),
    attr_int("window", 64),             attr_int("min_context", 256),
    attr_float("rho", 0.15f),           attr_int("qbits", 8),
    attr_float("mix", 0.0f),            attr_string("popcnt", "auto"),
    attr_string("k_layout", "bhtd"),    attr_int("approx_prefill", 0),
    attr_list("eps_heads", AttrType::Floats), attr_list("kscale", AttrType::Floats),
    attr_string("select", "popcount"),  attr_optional("layer", AttrType::String),
};

constexpr int64_t kRowBlock = 32;  // query rows per task in the exact (prefill) path

// Popcount path: requested (auto | vpopcntdq | avx2 | scalar), clamped to what the CPU has and to
// ORTLEAN_ISA (avx512 → vpopcntdq also needs AVX512_VPOPCNTDQ; avx2 → POPCNT).
const AttnKernels* choose_attn(const std::string& want) {
  __builtin_cpu_init();
  const bool has_vpop = isa() == Isa::Avx512 && __builtin_cpu_supports("avx512vpopcntdq");
  const bool has_pop = isa() >= Isa::Avx2 && __builtin_cpu_supports("popcnt");
  int w = 2;
  if (want == "scalar")
    w = 0;
  else if (want == "avx2")
    w = 1;
  else if (want == "vpopcntdq" || want == "auto" || want.empty())
    w = 2;
  else
    fail("attribute popcnt='" + want + "': expected auto | vpopcntdq | avx2 | scalar");
  if (w >= 2 && has_vpop) return attn_kernels_avx512();
  if (w >= 1 && has_pop) return attn_kernels_avx2();
  return attn_kernels_scalar();
}

inline int popc(uint32_t x) { return __builtin_popcount(x); }

}  // namespace

const AttrTable PackedAttentionKernel::kAttrs{kAttrSpecs};

PackedAttentionKernel::PackedAttentionKernel(const OrtApi&, const OrtKernelInfo* info_ptr) {
  Ort::ConstKernelInfo info{info_ptr};
  name_ = info.GetNodeName();
  err_prefix_ = "ortlean PackedAttention node '" + name_ + "': ";
  const Attrs at(info, kAttrs);
  const std::string &mode = at.s("mode"), &layout = at.s("k_layout"), &popcnt = at.s("popcnt");
  const std::string& select = at.s("select");
  if (select == "exact")
    oracle_ = true;
  else if (select != "popcount")
    fail("attribute select='" + select + "': expected popcount | exact");
  scale_ = at.f("scale");
  eps_ = at.f("eps");
  budget_ = at.f("budget");
  rho_ = at.f("rho");
  mix_ = at.f("mix");
  min_candidates_ = at.i("min_candidates");
  sinks_ = at.i("sinks");
  window_ = at.i("window");
  min_context_ = at.i("min_context");
  qbits_ = at.i("qbits");
  approx_prefill_ = at.i("approx_prefill");
  if (mode == "sign")
    mode_ = kSign;
  else if (mode == "ternary")
    mode_ = kTernary;
  else if (mode == "binary")
    mode_ = kBinary;
  else
    fail("attribute mode='" + mode + "': expected sign | ternary | binary");
  if (layout == "bhtd")
    k_bhdt_ = false;
  else if (layout == "bhdt")
    k_bhdt_ = true;
  else
    fail("attribute k_layout='" + layout + "': expected bhtd | bhdt");
  if (!std::isfinite(scale_)) fail("attribute scale must be finite");
  if (!(eps_ >= 0) || !std::isfinite(eps_)) fail("attribute eps must be finite and >= 0");
  eps_heads_ = at.floats("eps_heads");
  kscale_ = at.floats("kscale");
  for (float e : kscale_)
    if (!(e >= 0) || !std::isfinite(e)) fail("attribute kscale must hold finite values >= 0");
  for (float e : eps_heads_)
    if (!(e >= 0) || !std::isfinite(e)) fail("attribute eps_heads must hold finite values >= 0");
  if (!(budget_ >= 0 && budget_ <= 1)) fail("attribute budget must be in [0, 1] (0 or 1 = exact)");
  if (!(rho_ >= 0 && rho_ <= 1)) fail("attribute rho must be in [0, 1]");
  if (!(mix_ >= 0 && mix_ <= 1)) fail("attribute mix must be in [0, 1]");
  if (min_candidates_ < 0 || sinks_ < 0 || window_ < 0 || min_context_ < 0)
    fail("attributes min_candidates, sinks, window, min_context must be >= 0");
  if (qbits_ < 2 || qbits_ > 16) fail("attribute qbits must be in 2..16, got " + std::to_string(qbits_));
  ak_ = choose_attn(popcnt);

  metrics::Node* n = metrics::node(name_);
  metrics::set(n->metric("pack.enabled", false), budget_ > 0 && budget_ < 1 ? 1.0 : 0.0);
  metrics::set(n->metric("pack.mode", false), mode_);
  metrics::set(n->metric("pack.popcnt", false),
               ak_ == attn_kernels_avx512() ? 2.0 : ak_ == attn_kernels_avx2() ? 1.0 : 0.0);
  metrics::set(n->metric("pack.budget", false), budget_);
  m_density_ = n->metric("pack.density", false);
  m_active_ = n->metric("pack.active", true);
  m_calls_ = n->metric("pack.calls", true);
  m_cands_ = n->metric("pack.candidates", true);
  m_keys_ = n->metric("pack.keys", true);
  m_packed_ = n->metric("pack.packed_keys", true);
}

OrtStatusPtr PackedAttentionOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** op_kernel) const {
  return create_kernel_guarded<PackedAttentionKernel>("PackedAttention", api, info, op_kernel);
}

OrtStatusPtr PackedAttentionKernel::ComputeV2(OrtKernelContext* context) noexcept {
  return status_guard(err_prefix_, [&] { Compute(context); });
}

void PackedAttentionKernel::Compute(OrtKernelContext* context) const {
  Ort::KernelContext ctx(context);
  const Kernels& kr = kernels();
  const AttnKernels& ak = *ak_;

  Ort::ConstValue qv = ctx.GetInput(0), kv = ctx.GetInput(1), vv = ctx.GetInput(2);
  const auto qs = qv.GetTensorTypeAndShapeInfo().GetShape();
  const auto ks = kv.GetTensorTypeAndShapeInfo().GetShape();
  const auto vs = vv.GetTensorTypeAndShapeInfo().GetShape();
  if (qs.size() != 4 || ks.size() != 4 || vs.size() != 4)
    fail("Q, K, V must have rank 4, got " + shape_str(qs) + ", " + shape_str(ks) + ", " + shape_str(vs));
  const int64_t B = qs[0], Hq = qs[1], M = qs[2], D = qs[3];
  const int64_t Hkv = ks[1], T = k_bhdt_ ? ks[3] : ks[2], Dk = k_bhdt_ ? ks[2] : ks[3], Dv = vs[3];
  if (ks[0] != B || vs[0] != B || vs[1] != Hkv || vs[2] != T || Dk != D)
    fail("shapes do not agree: Q " + shape_str(qs) + ", K " + shape_str(ks) + " (" + (k_bhdt_ ? "bhdt" : "bhtd") +
         "), V " + shape_str(vs));
  if (Hkv < 1 || Hq % Hkv != 0)
    fail("query heads " + std::to_string(Hq) + " not a multiple of KV heads " + std::to_string(Hkv));
  const int64_t rep = Hq / Hkv;
  const int planes = mode_ == kTernary ? 2 : 1;
  if (!eps_heads_.empty() && static_cast<int64_t>(eps_heads_.size()) != Hkv)
    fail("attribute eps_heads has " + std::to_string(eps_heads_.size()) + " values, K has " + std::to_string(Hkv) +
         " heads");
  if (!kscale_.empty() && static_cast<int64_t>(kscale_.size()) != Hkv * D)
    fail("attribute kscale has " + std::to_string(kscale_.size()) + " values, expected KV heads x head dim = " +
         std::to_string(Hkv * D));
  const int64_t nw = (D + 31) / 32, W = planes * nw + 1;

  // mask: additive, rank 4, each dim 1 or full
  const size_t n_in = ctx.GetInputCount();
  const float* mask = nullptr;
  int64_t msb = 0, msh = 0, msm = 0, mst = 0;
  if (n_in > 3) {
    Ort::ConstValue mv = ctx.GetInput(3);
    if (mv) {
      const auto ms = mv.GetTensorTypeAndShapeInfo().GetShape();
      const int64_t full[4] = {B, Hq, M, T};
      bool ok = ms.size() == 4;
      for (size_t i = 0; ok && i < 4; ++i) ok = ms[i] == 1 || ms[i] == full[i];
      if (!ok) fail("mask " + shape_str(ms) + " does not broadcast to [B, Hq, M, T] = " + shape_str({B, Hq, M, T}));
      mask = mv.GetTensorData<float>();
      mst = ms[3] == 1 ? 0 : 1;
      msm = ms[2] == 1 ? 0 : ms[3];
      msh = ms[1] == 1 ? 0 : ms[2] * ms[3];
      msb = ms[0] == 1 ? 0 : ms[1] * ms[2] * ms[3];
    }
  }
  const int32_t* past = nullptr;
  int64_t P = 0;
  if (n_in > 4) {
    Ort::ConstValue pv = ctx.GetInput(4);
    if (pv) {
      const auto ps = pv.GetTensorTypeAndShapeInfo().GetShape();
      if (ps.size() != 4 || ps[0] != B || ps[1] != Hkv || ps[2] > T || ps[3] != W)
        fail("past_bits " + shape_str(ps) + " must be [B, Hkv, P <= T, W] = [" + std::to_string(B) + ", " +
             std::to_string(Hkv) + ", <=" + std::to_string(T) + ", " + std::to_string(W) + "]");
      past = pv.GetTensorData<int32_t>();
      P = ps[2];
    }
  }

  const float* Q = qv.GetTensorData<float>();
  const float* K = kv.GetTensorData<float>();
  const float* V = vv.GetTensorData<float>();
  float* Y = ctx.GetOutput(0, {B, Hq, M, Dv}).GetTensorMutableData<float>();
  const bool want_bits = ctx.GetOutputCount() > 1;

  auto n_cand = [&](int64_t t) {
    return std::max<int64_t>(min_candidates_, static_cast<int64_t>(std::ceil(static_cast<double>(budget_) * t)));
  };
  // per-row decisions below; `exact` here: no row can use candidates
  const bool approx_rows = M == 1 || approx_prefill_ != 0;
  bool global_exact = !(budget_ > 0 && budget_ < 1);
  bool exact = global_exact || !approx_rows || (M == 1 && (T <= min_context_ || n_cand(T) >= T));
  const bool need_bits = want_bits || !exact || mix_ > 0;

  // ---- key bits: carried rows copied, new rows packed (O(new tokens))
  uint32_t* bits = nullptr;
  if (need_bits) {
    if (want_bits) {
      bits = reinterpret_cast<uint32_t*>(ctx.GetOutput(1, {B, Hkv, T, W}).GetTensorMutableData<int32_t>());
    } else {
      bits = reinterpret_cast<uint32_t*>(outer_scratch().get(static_cast<size_t>(B * Hkv * T * W)));
      past = nullptr;
      P = 0;
    }
    const int64_t ldt = k_bhdt_ ? 1 : D, ldd = k_bhdt_ ? T : 1;  // K element (t, d) at t*ldt + d*ldd
    for (int64_t bh = 0; bh < B * Hkv; ++bh) {
      uint32_t* dst = bits + bh * T * W;
      if (P) std::memcpy(dst, past + bh * P * W, sizeof(uint32_t) * P * W);
      const float* Kh = K + bh * T * D;
      const float eps = eps_heads_.empty() ? eps_ : eps_heads_[static_cast<size_t>(bh % Hkv)];
      for (int64_t t = P; t < T; ++t) {
        uint32_t* row = dst + t * W;
        std::memset(row, 0, sizeof(uint32_t) * W);
        double asum = 0.0;
        int64_t cnt = 0;
        for (int64_t d = 0; d < D; ++d) {
          const float x = Kh[t * ldt + d * ldd];
          const float ax = std::fabs(x);
          const uint32_t bit = 1u << (d & 31);
          if (mode_ == kSign) {
            if (x > 0) row[d >> 5] |= bit;
            asum += ax;
          } else {
            if (ax > eps) {
              asum += ax;
              ++cnt;
            }
            if (mode_ == kTernary) {
              if (x > eps) row[d >> 5] |= bit;
              if (x < -eps) row[nw + (d >> 5)] |= bit;
            } else if (ax > eps) {
              row[d >> 5] |= bit;
            }
          }
        }
        const float gamma = mode_ == kSign ? static_cast<float>(asum / static_cast<double>(D))
                                           : (cnt ? static_cast<float>(asum / static_cast<double>(cnt)) : eps);
        std::memcpy(row + planes * nw, &gamma, 4);
      }
    }
    metrics::add(m_packed_, static_cast<double>(B * Hkv * (T - P)));
    // density of plane 0: over all keys in the eps modes (it decides the auto-disable), over the
    // newly packed keys in sign mode (informational: ~0.5 by construction)
    const int64_t t0 = mode_ == kSign ? P : 0;
    int64_t set = 0;
    for (int64_t bh = 0; bh < B * Hkv; ++bh)
      for (int64_t t = t0; t < T; ++t)
        for (int64_t j = 0; j < planes * nw; ++j) set += popc(bits[(bh * T + t) * W + j]);
    const int64_t nbits = B * Hkv * (T - t0) * D;
    if (nbits > 0) {
      const double dens = static_cast<double>(set) / static_cast<double>(nbits);
      metrics::set(m_density_, dens);
      if (mode_ != kSign && dens > rho_) exact = global_exact = true;  // auto-disable: too dense to help
    }
  }
  metrics::add(m_calls_, 1.0);
  metrics::add(m_keys_, static_cast<double>(B * Hq * M * T));
  if (!exact) metrics::add(m_active_, 1.0);
  const bool row_path = M == 1 || !exact || mix_ > 0;

  auto mask_row = [&](int64_t b, int64_t h, int64_t m) -> const float* {
    return mask ? mask + b * msb + h * msh + m * msm : nullptr;
  };

  // ---- M == 1 (decode) or candidate path: per (b, h, m) rows
  if (row_path) {
    const int64_t rows = B * Hq * M;
    std::atomic<int64_t> n_cands{0};
    const float L = static_cast<float>((1 << (qbits_ - 1)) - 1);
    const int nb = static_cast<int>(qbits_ - 1);
    auto task = [&](size_t r_) {
      const int64_t r = static_cast<int64_t>(r_);
      const int64_t b = r / (Hq * M), h = (r / M) % Hq, m = r % M, hk = h / rep;
      const float* q = Q + r * D;
      const float* Kh = K + (b * Hkv + hk) * T * D;
      const float* Vh = V + (b * Hkv + hk) * T * Dv;
      const float* mr = mask_row(b, h, m);
      // this row's context: all T keys in decode; with approx_prefill, up to the last unmasked key
      int64_t Tr = T;
      if (M > 1 && approx_prefill_ && mr) {
        while (Tr > 0 && !(mr[(Tr - 1) * mst] > -INFINITY)) --Tr;
      }
      const int64_t C = n_cand(Tr);
      const bool exact_row = global_exact || (M > 1 && !approx_prefill_) || Tr <= min_context_ || C >= Tr;
      // scratch: logits [T], approx [T], idx [T] (int64 as 2 floats), q planes
      float* s = task_scratch().get(static_cast<size_t>(5 * T + 2 * 16 * nw + Dv + 2 * D + 64));
      float* approx = s + T;
      int64_t* idx = reinterpret_cast<int64_t*>(approx + T);
      uint32_t* qp = reinterpret_cast<uint32_t*>(idx + T);
      uint32_t* qn = qp + 16 * nw;
      float* y = reinterpret_cast<float*>(qn + 16 * nw);
      float* qk = y + Dv;  // K^T column gather for bhdt
      const bool use_approx = !exact_row || mix_ > 0;
      if (use_approx && oracle_ && !k_bhdt_) {
        for (int64_t t = 0; t < T; ++t) approx[t] = ak.dot(q, Kh + t * D, D) * scale_;
      } else if (use_approx) {
        const float* qa = q;  // the query of the popcount score: q, or q * kscale of this KV head
        if (!kscale_.empty()) {
          float* qsc = qk + D;
          const float* ks = kscale_.data() + hk * D;
          for (int64_t d = 0; d < D; ++d) qsc[d] = q[d] * ks[d];
          qa = qsc;
        }
        float a = 0.0f;
        for (int64_t d = 0; d < D; ++d) a = std::max(a, std::fabs(qa[d]));
        if (a > 0) {
          const float inv = L / a;
          std::memset(qp, 0, sizeof(uint32_t) * 2 * 16 * nw);
          int64_t qsum = 0;
          for (int64_t d = 0; d < D; ++d) {
            const int32_t qi = static_cast<int32_t>(std::nearbyint(qa[d] * inv));
            qsum += qi;
            const uint32_t mag = static_cast<uint32_t>(qi < 0 ? -qi : qi);
            uint32_t* pl = qi < 0 ? qn : qp;
            for (int bb = 0; bb < nb; ++bb)
              if (mag >> bb & 1u) pl[bb * nw + (d >> 5)] |= 1u << (d & 31);
          }
          const uint32_t* kb = bits + (b * Hkv + hk) * T * W;
          int32_t* core = reinterpret_cast<int32_t*>(approx);
          ak.popcore(kb, W, T, nw, qp, qn, nb, core);
          if (mode_ == kTernary) {
            int32_t* core1 = reinterpret_cast<int32_t*>(s);
            ak.popcore(kb + nw, W, T, nw, qp, qn, nb, core1);
            for (int64_t t = 0; t < T; ++t) core[t] -= core1[t];
          } else if (mode_ == kSign) {
            for (int64_t t = 0; t < T; ++t) core[t] = 2 * core[t] - static_cast<int32_t>(qsum);
          }
          const float coef = (a / L) * scale_;
          for (int64_t t = 0; t < T; ++t) {
            float g;
            std::memcpy(&g, kb + t * W + planes * nw, 4);
            approx[t] = static_cast<float>(core[t]) * g * coef;
          }
        } else {
          std::fill(approx, approx + T, 0.0f);
        }
      }
      int64_t n = Tr;
      if (exact_row) {
        for (int64_t t = 0; t < Tr; ++t) idx[t] = t;
      } else {
        // sinks + window + top of the rest by approx + mask (ties: lower index)
        const int64_t ns = std::min(sinks_, Tr), w0 = std::max(ns, Tr - window_);
        n = 0;
        for (int64_t t = 0; t < ns; ++t) idx[n++] = t;
        const int64_t n_top = std::max<int64_t>(0, C - ns - (Tr - w0));
        const int64_t nr = w0 - ns, k = std::min(n_top, nr);
        // scores of the middle keys; the k-th largest by nth_element on a contiguous copy, then
        // one forward pass keeps those above it and the first ties (lower index first): the
        // result is in index order (no sort) and equals "top k by (score desc, index asc)".
        float* sc = s + ns;  // s[t] for t in [ns, w0)
        for (int64_t t = ns; t < w0; ++t) s[t] = approx[t] + (mr ? mr[t * mst] : 0.0f);
        if (k >= nr) {
          for (int64_t t = ns; t < w0; ++t) idx[n++] = t;
        } else if (k > 0) {
          float* tmp = reinterpret_cast<float*>(qn + 16 * nw) + Dv + 2 * D;  // nr floats
          std::memcpy(tmp, sc, sizeof(float) * nr);
          std::nth_element(tmp, tmp + (k - 1), tmp + nr, std::greater<float>());
          const float thr = tmp[k - 1];
          int64_t above = 0;
          for (int64_t i = 0; i < nr; ++i) above += sc[i] > thr;
          int64_t ties = k - above;
          for (int64_t t = ns; t < w0; ++t) {
            const float v = s[t];
            if (v > thr || (v == thr && ties-- > 0)) idx[n++] = t;
          }
        }
        for (int64_t t = w0; t < Tr; ++t) idx[n++] = t;
      }
      n_cands.fetch_add(n, std::memory_order_relaxed);
      // exact logits on the candidates
      constexpr int64_t kAhead = 6;  // candidate rows are scattered: prefetch a few rows ahead
      const bool gaps = n < Tr;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = idx[i];
        if (gaps && !k_bhdt_ && i + kAhead < n) {
          const char* pk = reinterpret_cast<const char*>(Kh + idx[i + kAhead] * D);
          for (int64_t o = 0; o < D * 4; o += 64) __builtin_prefetch(pk + o);
        }
        float l;
        if (!k_bhdt_) {
          l = ak.dot(q, Kh + t * D, D) * scale_;
        } else {
          for (int64_t d = 0; d < D; ++d) qk[d] = Kh[d * T + t];
          l = ak.dot(q, qk, D) * scale_;
        }
        if (mix_ > 0) l = l + mix_ * (approx[t] - l);
        s[i] = l + (mr ? mr[t * mst] : 0.0f);
      }
      float* yo = Y + r * Dv;
      const float mx = ak.maxv(s, n);
      if (!(mx > -INFINITY)) {
        std::fill(yo, yo + Dv, 0.0f);
        return;
      }
      const float sum = ak.expsum(s, mx, n);
      std::fill(y, y + Dv, 0.0f);
      for (int64_t i = 0; i < n; ++i) {
        if (gaps && i + kAhead < n) {
          const char* pv = reinterpret_cast<const char*>(Vh + idx[i + kAhead] * Dv);
          for (int64_t o = 0; o < Dv * 4; o += 64) __builtin_prefetch(pv + o);
        }
        if (s[i] != 0.0f) ak.axpy(s[i], Vh + idx[i] * Dv, y, Dv);
      }
      const float inv = 1.0f / sum;
      for (int64_t d = 0; d < Dv; ++d) yo[d] = y[d] * inv;
    };
    parallel_for(ctx, static_cast<size_t>(rows), task);
    metrics::add(m_cands_, static_cast<double>(n_cands.load()));
    return;
  }

  // ---- exact blocked path (M > 1): S = Q_blk K^T (gemm), + mask, softmax, Y = P V (gemm)
  metrics::add(m_cands_, static_cast<double>(B * Hq * M * T));
  const int64_t nblk = (M + kRowBlock - 1) / kRowBlock;
  auto task = [&](size_t i_) {
    const int64_t i = static_cast<int64_t>(i_);
    const int64_t blk = i % nblk, h = (i / nblk) % Hq, b = i / (nblk * Hq), hk = h / rep;
    const int64_t m0 = blk * kRowBlock, mb = std::min(kRowBlock, M - m0);
    const float* Kh = K + (b * Hkv + hk) * T * D;
    const float* Vh = V + (b * Hkv + hk) * T * Dv;
    float* buf = task_scratch().get(static_cast<size_t>(round_up16(kRowBlock * T) + (k_bhdt_ ? 0 : D * T)));
    float* S = buf;
    const float* KT = Kh;
    if (!k_bhdt_) {
      float* kt = buf + round_up16(kRowBlock * T);
      kr.transpose(Kh, D, kt, T, T, D, nullptr);  // [T, D] -> [D, T]
      KT = kt;
    }
    const float* Qb = Q + ((b * Hq + h) * M + m0) * D;
    kr.sgemm_nn(mb, T, D, Qb, D, KT, T, S, T);
    float* Yb = Y + ((b * Hq + h) * M + m0) * Dv;
    std::vector<float> inv(static_cast<size_t>(mb));
    for (int64_t r = 0; r < mb; ++r) {
      float* row = S + r * T;
      const float* mr = mask_row(b, h, m0 + r);
      if (mr) {
        for (int64_t t = 0; t < T; ++t) row[t] = row[t] * scale_ + mr[t * mst];
      } else {
        ak.scal(scale_, row, T);
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
  parallel_for(ctx, static_cast<size_t>(B * Hq * nblk), task);
}

}  // namespace ortlean
