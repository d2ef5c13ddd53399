#include "event_gated_matmul.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <sstream>

#include "blas.h"
#include "isa.h"

namespace ortlean {

const GatingKernels& gating_kernels() {
  static const GatingKernels* k = isa() == Isa::Avx512 ? gating_kernels_avx512()
                                  : isa() == Isa::Avx2 ? gating_kernels_avx2()
                                                       : gating_kernels_scalar();
  return *k;
}

namespace {

constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;
// weights per matvec task (384 KB). From DRAM at 2 threads, 1536x576 keep 0.25 (221k weights)
// took 29 us in two tasks vs 47 us in one; one-thread sessions never split (PoolProbe).
constexpr int64_t kGrain = 96 * 1024;
constexpr int64_t kMaxTasks = 16;
constexpr int64_t kMinCols = 384;
constexpr int64_t kBlasMinRows = 16;

// per-thread scratch of this op (grows only)
struct RowScratch {
  std::vector<float> f;
  std::vector<int32_t> i;
  std::vector<uint8_t> u8;
  std::vector<int64_t> i64;
};
RowScratch& row_scratch() {
  thread_local RowScratch s;
  return s;
}

// Per-row gated matvecs or one dense product for m rows keeping `kept_frac_sum` (sum over the rows
// of each row's kept fraction)? Memory-bound matvecs cost ~kept bytes of W at ~0.87 of the dense
// streaming rate (scattered rows, measured from DRAM); the dense product reads W once and does
// m*K*N multiply-adds at ~11x the streaming rate (AVX-512: ~100 G FMA/s vs ~9 G floats/s from
// DRAM on this machine, tests/bench/bench_gating_op.py). So per-row wins while
// 1.15 * sum(kept) < 1 + 0.09 * m: e.g. m = 2 at keep <= 0.5, m = 8 at keep <= 0.19; never at m = 128.
inline bool per_row_wins(double kept_frac_sum, int64_t m) {
  return 1.15 * kept_frac_sum < 1.0 + 0.09 * static_cast<double>(m);
}

}  // namespace

// Everything one Compute() needs, plus the row-level pieces shared by the paths.
struct GatingCall {
  const EventGatedMatMulKernel& k;
  const Ort::KernelContext& ctx;
  const Kernels& kr;
  const GatingKernels& gk;
  // per-row buffers (thread-local of the calling thread)
  float* sc;     // [K] channel scores / deltas
  float* bs;     // [nb] block scores
  float* vals;   // [K]
  float* ytmp;   // [N]
  int32_t* idx;  // [K]
  int32_t* ord;  // [nb]
  float* ptmp = nullptr;  // [kMaxTasks, N] partial sums
  // per-call metric accumulators
  double kept = 0, chans = 0, duty_hits = 0, density_sum = 0, density_rows = 0, active = 0, pack_dense = 0;
  double ev_ms = 0, ev_quorum = 0, ev_checks = 0, ev_disables = 0, ev_rows = 0;
  double ev_topk_last = -1, ev_stale_last = -1, ev_gap_last = -1, ev_enabled_last = -1;

  int64_t blk0(int64_t b) const { return b * k.a_.block; }
  int64_t blk1(int64_t b) const { return std::min(k.K_, (b + 1) * k.a_.block); }

  // y[0:N] (+)= x . W over the listed rows (all rows when rows == nullptr: v = x), split on the
  // pool by columns (wide outputs) or by rows with partial sums (narrow outputs).
  void matvec(const float* x, const int32_t* rows, const float* v, int64_t n, float* y, bool acc) const {
    const int64_t N = k.N_;
    if (!rows) {
      rows = k.iota_.data();
      v = x;
      n = k.K_;
    }
    const int64_t work = n * N;
    int64_t nt = std::max<int64_t>(1, std::min<int64_t>(kMaxTasks, work / kGrain));
    if (k.pool_.width() == 1) nt = 1;  // one thread: one pass over the kept rows, no partial sums
    if (nt == 1) {
      gk.gather_axpy(rows, v, n, k.W_, N, y, N, acc ? 1 : 0);
      return;
    }
    if (N / nt >= kMinCols) {
      const int64_t chunk = ((N + nt - 1) / nt + 63) / 64 * 64;
      nt = (N + chunk - 1) / chunk;
      auto task = [&](size_t t) noexcept {
        const int64_t c0 = static_cast<int64_t>(t) * chunk;
        gk.gather_axpy(rows, v, n, k.W_ + c0, N, y + c0, std::min(chunk, N - c0), acc ? 1 : 0);
      };
      k.pool_.run(ctx, static_cast<size_t>(nt), task);
      return;
    }
    // split the rows; partial sums in ptmp [nt, N]
    const int64_t rchunk = (n + nt - 1) / nt;
    nt = (n + rchunk - 1) / rchunk;
    auto task = [&](size_t t) noexcept {
      const int64_t r0 = static_cast<int64_t>(t) * rchunk;
      gk.gather_axpy(rows + r0, v + r0, std::min(rchunk, n - r0), k.W_, N, ptmp + t * N, N, 0);
    };
    k.pool_.run(ctx, static_cast<size_t>(nt), task);
    for (int64_t o = 0; o < N; ++o) {
      float s = acc ? y[o] : 0.0f;
      for (int64_t t = 0; t < nt; ++t) s += ptmp[t * N + o];
      y[o] = s;
    }
  }

  // Gating of one row: writes x~ into xt, the kept block mask into keep (uint8 as float 0/1 in
  // mask_out when given), candidate mask into cand; returns the number of kept blocks.
  // reuse: the stored KWTA mask (duty), or nullptr.
  int64_t gate(const float* x, float* xt, uint8_t* keep, uint8_t* cand, const float* reuse, bool dense_row) {
    const GatingAttrs& a = k.a_;
    const int64_t K = k.K_, nb = k.nb_;
    if (dense_row) {
      std::memcpy(xt, x, sizeof(float) * K);
      std::fill(keep, keep + nb, 1);
      std::fill(cand, cand + nb, 1);
      return nb;
    }
    std::fill(cand, cand + nb, 1);
    int64_t ncand = nb;
    if (a.pack) {
      int64_t act = 0;
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t on = 0;
        for (int64_t j = blk0(b); j < blk1(b); ++j) on |= std::fabs(x[j]) > a.pack_eps;
        cand[b] = on;
        act += on;
      }
      const double density = static_cast<double>(act) / static_cast<double>(nb);
      density_sum += density;
      density_rows += 1;
      active += static_cast<double>(act);
      if (density > static_cast<double>(a.pack_rho)) {
        std::fill(cand, cand + nb, 1);
        pack_dense += 1;
      } else {
        ncand = act;
      }
    }
    std::copy(cand, cand + nb, keep);
    int64_t nkeep = ncand;
    if (a.kwta) {
      if (reuse) {
        nkeep = 0;
        for (int64_t b = 0; b < nb; ++b) {
          keep[b] = cand[b] && reuse[b] > 0.5f;
          nkeep += keep[b];
        }
        duty_hits += 1;
      } else {
        gk.abs_scale(x, a.score_xw ? k.norms_.data() : nullptr, sc, K);
        if (a.block == 1) {
          std::memcpy(bs, sc, sizeof(float) * nb);
        } else {
          for (int64_t b = 0; b < nb; ++b) {
            float s = 0.0f;
            for (int64_t j = blk0(b); j < blk1(b); ++j) s += sc[j] * sc[j];
            bs[b] = std::sqrt(s);
          }
        }
        if (a.kwta_select == 0) {
          nkeep = 0;
          const float thr = a.kwta_threshold;
          const int64_t bsz = a.block;
          if (bsz == 1) {
            for (int64_t b = 0; b < nb; ++b) {
              const uint8_t kb = cand[b] & static_cast<uint8_t>(bs[b] > thr);
              keep[b] = kb;
              nkeep += kb;
            }
          } else {
            const float full = std::sqrt(static_cast<float>(bsz));
            const int64_t last = K - (nb - 1) * bsz;
            const float lastlen = std::sqrt(static_cast<float>(last));
            for (int64_t b = 0; b < nb; ++b) {
              const float len = b == nb - 1 ? lastlen : full;
              const uint8_t kb = cand[b] & static_cast<uint8_t>(bs[b] / len > thr);
              keep[b] = kb;
              nkeep += kb;
            }
          }
        } else {
          int64_t n = 0;
          for (int64_t b = 0; b < nb; ++b)
            if (cand[b]) ord[n++] = static_cast<int32_t>(b);
          auto cmp = [&](int32_t p, int32_t q) { return bs[p] > bs[q] || (bs[p] == bs[q] && p < q); };
          std::fill(keep, keep + nb, 0);
          int64_t take;
          if (a.kwta_select == 1) {
            take = std::min<int64_t>(a.kwta_k, n);
            if (take < n) std::nth_element(ord, ord + take, ord + n, cmp);
          } else {
            std::sort(ord, ord + n, cmp);
            take = 0;
            if (n) {
              const double smax = bs[ord[0]];
              const double t = std::max<double>(a.kwta_temp, 1e-6) * (smax > 0 ? smax : 1.0);
              double z = 0;
              for (int64_t i = 0; i < n; ++i) z += std::exp((bs[ord[i]] - smax) / t);
              double c = 0;
              const double goal = (static_cast<double>(a.kwta_mass) - 1e-12) * z;
              while (take < n) {
                c += std::exp((bs[ord[take]] - smax) / t);
                ++take;
                if (c >= goal) break;
              }
            }
          }
          for (int64_t i = 0; i < take; ++i) keep[ord[i]] = 1;
          nkeep = take;
        }
      }
    }
    float r = 1.0f;
    if (a.kwta && a.kwta_renorm && nkeep > 0) {
      int64_t nc = 0;
      for (int64_t b = 0; b < nb; ++b) nc += cand[b];
      r = static_cast<float>(nc) / static_cast<float>(nkeep);
    }
    if (a.block == 1) {
      for (int64_t j = 0; j < K; ++j) xt[j] = x[j] * (r * static_cast<float>(keep[j]));  // branch-free
    } else {
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t j0 = blk0(b), j1 = blk1(b);
        if (keep[b])
          for (int64_t j = j0; j < j1; ++j) xt[j] = x[j] * r;
        else
          for (int64_t j = j0; j < j1; ++j) xt[j] = 0.0f;
      }
    }
    return nkeep;
  }

  // Non-event row: y = xt . W reading only the kept blocks (dense kernel when all are kept).
  void gated_row(const float* xt, const uint8_t* keep, int64_t nkeep, float* y) {
    if (nkeep == k.nb_) {
      matvec(xt, nullptr, nullptr, 0, y, false);
      return;
    }
    int64_t n = 0;
    if (k.a_.block == 1) {
      for (int64_t j = 0; j < k.K_; ++j) {  // branch-free append
        idx[n] = static_cast<int32_t>(j);
        vals[n] = xt[j];
        n += keep[j];
      }
    } else {
      for (int64_t b = 0; b < k.nb_; ++b)
        if (keep[b])
          for (int64_t j = blk0(b); j < blk1(b); ++j) {
            idx[n] = static_cast<int32_t>(j);
            vals[n++] = xt[j];
          }
    }
    if (n == 0) {
      std::fill(y, y + k.N_, 0.0f);
      return;
    }
    matvec(nullptr, idx, vals, n, y, false);
  }

  // Event row (state initialised, enabled). st: this row's state [S]; writes y.
  void event_row(const float* xt, const uint8_t* cand, float* st, int64_t step, float* y) {
    const GatingAttrs& a = k.a_;
    const int64_t K = k.K_, N = k.N_, nb = k.nb_;
    float* xref = st + EventGatedMatMulKernel::kHdr;
    float* ycache = xref + K;
    float* age = ycache + N;
    const float* norms = k.norms_.data();
    const auto t0 = std::chrono::steady_clock::now();
    double xn2 = 0;
    for (int64_t j = 0; j < K; ++j) {
      sc[j] = (xt[j] - xref[j]) * norms[j];
      const double q = static_cast<double>(xt[j]) * norms[j];
      xn2 += q * q;
    }
    for (int64_t b = 0; b < nb; ++b) {
      double s = 0;
      for (int64_t j = blk0(b); j < blk1(b); ++j) s += static_cast<double>(sc[j]) * sc[j];
      bs[b] = static_cast<float>(std::sqrt(s));
    }
    const double thr = static_cast<double>(a.event_theta) * std::sqrt(xn2) / std::sqrt(static_cast<double>(nb));
    // ord: forced first, then eligible by priority
    int64_t nf = 0, ne = 0;
    float* prio = vals;  // vals is free here (size K >= nb)
    for (int64_t b = 0; b < nb; ++b) {
      const bool forced = a.event_age_max > 0 && age[b] >= static_cast<float>(a.event_age_max);
      if (forced) {
        ord[nf++] = static_cast<int32_t>(b);
        continue;
      }
      if (!cand[b] || !(bs[b] > thr)) continue;
      const double w = static_cast<double>(a.event_beta) * std::exp(-static_cast<double>(a.event_lambda) * age[b]);
      prio[b] = static_cast<float>(bs[b] / std::max(w, 1e-30));
      idx[ne++] = static_cast<int32_t>(b);
    }
    auto cmp = [&](int32_t p, int32_t q) { return prio[p] > prio[q] || (prio[p] == prio[q] && p < q); };
    const int64_t limit = std::max<int64_t>(0, static_cast<int64_t>(std::ceil(static_cast<double>(a.event_topk) * nb - 1e-6)));
    const bool quorum = a.event_quorum < 1.0f;
    int64_t room = limit < nb ? std::max<int64_t>(0, limit - nf) : ne;
    if (quorum || a.event_budget_ms > 0) {
      std::sort(idx, idx + ne, cmp);
    } else if (room < ne) {
      std::nth_element(idx, idx + room, idx + ne, cmp);
    }
    double total = 0;
    if (quorum)
      for (int64_t i = 0; i < ne; ++i) total += bs[idx[i]];
    int64_t nt = nf;
    double accq = 0;
    bool qhit = false;
    for (int64_t i = 0; i < ne; ++i) {
      if (limit < nb && nt >= limit) break;
      if (quorum && total > 0 && accq >= static_cast<double>(a.event_quorum) * total) {
        qhit = true;
        break;
      }
      ord[nt++] = idx[i];
      accq += bs[idx[i]];
    }
    // compute the taken blocks' deltas in priority order (in chunks when a budget is set)
    int64_t done_blocks = 0;
    {
      const double budget = a.event_budget_ms;
      const int64_t cap = budget > 0 ? 256 : INT64_MAX;
      int64_t i = 0;
      while (i < nt) {
        int64_t n = 0, i1 = i;
        while (i1 < nt && n < cap) {
          const int64_t b = ord[i1++];
          for (int64_t j = blk0(b); j < blk1(b); ++j) {
            const float d = xt[j] - xref[j];
            if (d != 0.0f) {
              idx[n] = static_cast<int32_t>(j);
              vals[n++] = d;
            }
          }
        }
        if (n) matvec(nullptr, idx, vals, n, ycache, true);
        for (int64_t q = i; q < i1; ++q) {
          const int64_t b = ord[q];
          for (int64_t j = blk0(b); j < blk1(b); ++j) xref[j] = xt[j];
          age[b] = -1.0f;  // taken (reset to 0 below)
        }
        done_blocks = i1;
        i = i1;
        if (budget > 0 && i < nt) {
          const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
          if (ms >= budget) break;
        }
      }
    }
    int64_t stale = 0;
    for (int64_t b = 0; b < nb; ++b) {
      if (age[b] < 0.0f) {
        age[b] = 0.0f;
      } else {
        age[b] += 1.0f;
        ++stale;
      }
    }
    if (qhit) ev_quorum += 1;
    ev_topk_last = static_cast<double>(done_blocks) / static_cast<double>(nb);
    ev_stale_last = 100.0 * static_cast<double>(stale) / static_cast<double>(nb);
    std::memcpy(y, ycache, sizeof(float) * N);
    const int64_t ge = a.event_gap_every;  // checks on steps 1, 2, 4, ... (< ge), then every ge
    if (ge > 0 && (step % ge == 0 || (step < ge && (step & (step - 1)) == 0))) {
      matvec(xt, nullptr, nullptr, 0, ytmp, false);
      double num = 0, den = 0;
      for (int64_t o = 0; o < N; ++o) {
        const double dd = static_cast<double>(y[o]) - ytmp[o];
        num += dd * dd;
        den += static_cast<double>(ytmp[o]) * ytmp[o];
      }
      const double gap = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
      st[3] = static_cast<float>(gap);
      ev_gap_last = gap;
      ev_checks += 1;
      if (gap > static_cast<double>(a.event_gap_tol)) {
        st[2] = 1.0f;
        ev_disables += 1;
      }
      std::memcpy(y, ytmp, sizeof(float) * N);
      std::memcpy(xref, xt, sizeof(float) * K);
      std::memcpy(ycache, ytmp, sizeof(float) * N);
      std::fill(age, age + nb, 0.0f);
    }
    ev_rows += 1;
    ev_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
};

// C[m, N] = A[m, K] . W on the pool: about one task per 4 M multiply-adds (at most kMaxTasks),
// column chunks first (whole tiles), then row blocks (>= 48 rows, on the kernel's 6-row strips)
// until there are about `want` tasks of equal size (9 chunks on 2 threads would leave one idle
// for a ninth of the time: 2 row blocks make it 18).
void EventGatedMatMulKernel::dense_product(const Ort::KernelContext& ctx, const float* A, int64_t m, float* C) const {
  const Kernels& kr = kernels();
  // OpenBLAS only with the scalar table (measured 2x slower than our AVX kernels here)
  const bool blas = isa() == Isa::Scalar && m >= kBlasMinRows;
  const double work = static_cast<double>(m) * static_cast<double>(K_) * static_cast<double>(N_);
  const int64_t want = std::max<int64_t>(1, std::min<int64_t>(kMaxTasks, static_cast<int64_t>(work / 4.0e6)));
  // column chunks: whole 64-column tiles of the register kernel, the same number per chunk when
  // N allows (a 16-column remainder strip runs at a third of the speed)
  int64_t ncb = std::max<int64_t>(1, std::min<int64_t>(N_ / 128, want));
  if (N_ % 64 == 0) {
    const int64_t tiles = N_ / 64;
    int64_t best = 1;
    for (int64_t d = 1; d <= std::min(tiles, want); ++d)
      if (tiles % d == 0) best = d;
    ncb = best;
  }
  const int64_t nrb = std::max<int64_t>(1, std::min<int64_t>((want + ncb - 1) / ncb, m / 48));
  auto row_at = [&](int64_t i) { return i >= nrb ? m : std::min(m, (i * m / nrb + 3) / 6 * 6); };
  auto col_at = [&](int64_t i) {
    if (i >= ncb) return N_;
    return N_ % 64 == 0 ? i * (N_ / ncb) : std::min(N_, (i * N_ / ncb + 8) / 16 * 16);
  };
  auto task = [&](size_t ti) noexcept {
    const int64_t rb = static_cast<int64_t>(ti) / ncb, cb = static_cast<int64_t>(ti) % ncb;
    const int64_t m0 = row_at(rb), rows = row_at(rb + 1) - m0;
    const int64_t c0 = col_at(cb), cols = col_at(cb + 1) - c0;
    if (rows <= 0 || cols <= 0) return;
    if (blas)
      blas::sgemm(false, false, rows, cols, K_, 1.0f, A + m0 * K_, K_, W_ + c0, N_, 0.0f, C + m0 * N_ + c0, N_);
    else
      kr.sgemm_nn(rows, cols, K_, A + m0 * K_, K_, W_ + c0, N_, C + m0 * N_ + c0, N_);
  };
  parallel_for(ctx, static_cast<size_t>(nrb * ncb), task);
}

// ------------------------------------------------------------------ construction
namespace {

// Every attribute and its default (the numpy reference's DEFAULTS in custom_ops/reference/gating.py
// must agree: ortlean_op_schema_json exports these).
constexpr AttrSpec kAttrSpecs[] = {
    attr_int("block", 1),
    attr_string("pack", "none"),
    attr_float("pack_eps", 0.0f),
    attr_float("pack_rho", 1.0f),
    attr_int("kwta", 0),
    attr_string("kwta_select", "threshold"),
    attr_string("kwta_score", "xw"),
    attr_float("kwta_threshold", 0.0f),
    attr_int("kwta_k", 0),
    attr_float("kwta_mass", 1.0f),
    attr_float("kwta_temp", 0.0f),
    attr_int("kwta_duty", 1),
    attr_int("kwta_renorm", 0),
    attr_int("event", 0),
    attr_float("event_topk", 1.0f),
    attr_float("event_quorum", 1.0f),
    attr_float("event_theta", 0.0f),
    attr_float("event_budget_ms", 0.0f),
    attr_float("event_gap_tol", 0.03f),
    attr_int("event_gap_every", 16),
    attr_float("event_beta", 1.0f),
    attr_float("event_lambda", 0.0f),
    attr_int("event_age_max", 0),
    attr_int("dense_prefill", 0),
    attr_optional("keep_ratio", AttrType::Float),
    attr_optional("gap", AttrType::Float),
    attr_optional("params_dense", AttrType::Int),
    attr_optional("params_stored", AttrType::Int),
    attr_optional("layer", AttrType::String),
    attr_optional("target", AttrType::String),
    attr_optional("fused", AttrType::String),  // members of a fused group (metadata)
};

}  // namespace

const AttrTable EventGatedMatMulKernel::kAttrs{kAttrSpecs};

EventGatedMatMulKernel::EventGatedMatMulKernel(const OrtApi&, const OrtKernelInfo* info_ptr) {
  Ort::ConstKernelInfo info{info_ptr};
  name_ = info.GetNodeName();
  err_prefix_ = "ortlean EventGatedMatMul node '" + name_ + "': ";
  const Attrs at(info, kAttrs);
  GatingAttrs& a = a_;
  a.block = at.i("block");
  const std::string& pack = at.s("pack");
  a.pack_eps = at.f("pack_eps");
  a.pack_rho = at.f("pack_rho");
  a.kwta = at.i("kwta") != 0;
  const std::string& sel = at.s("kwta_select");
  const std::string& score = at.s("kwta_score");
  a.kwta_threshold = at.f("kwta_threshold");
  a.kwta_k = at.i("kwta_k");
  a.kwta_mass = at.f("kwta_mass");
  a.kwta_temp = at.f("kwta_temp");
  a.kwta_duty = at.i("kwta_duty");
  a.kwta_renorm = at.i("kwta_renorm") != 0;
  a.event = at.i("event") != 0;
  a.event_topk = at.f("event_topk");
  a.event_quorum = at.f("event_quorum");
  a.event_theta = at.f("event_theta");
  a.event_budget_ms = at.f("event_budget_ms");
  a.event_gap_tol = at.f("event_gap_tol");
  a.event_gap_every = at.i("event_gap_every");
  a.event_beta = at.f("event_beta");
  a.event_lambda = at.f("event_lambda");
  a.event_age_max = at.i("event_age_max");
  a.dense_prefill = at.i("dense_prefill") != 0;
  const std::string& target = at.s("target");

  if (a.block < 1) fail("attribute block must be >= 1, got " + std::to_string(a.block));
  if (pack == "none") a.pack = 0;
  else if (pack == "binary") a.pack = 1;
  else if (pack == "ternary") a.pack = 2;
  else fail("attribute pack must be 'none', 'binary' or 'ternary', got '" + pack + "'");
  if (!(a.pack_eps >= 0.0f)) fail("attribute pack_eps must be >= 0");
  if (!(a.pack_rho > 0.0f && a.pack_rho <= 1.0f)) fail("attribute pack_rho must be in (0, 1]");
  if (sel == "threshold") a.kwta_select = 0;
  else if (sel == "topk") a.kwta_select = 1;
  else if (sel == "mass") a.kwta_select = 2;
  else fail("attribute kwta_select must be 'threshold', 'topk' or 'mass', got '" + sel + "'");
  if (score == "xw") a.score_xw = true;
  else if (score == "x") a.score_xw = false;
  else fail("attribute kwta_score must be 'xw' or 'x', got '" + score + "'");
  if (!(a.kwta_threshold >= 0.0f)) fail("attribute kwta_threshold must be >= 0");
  if (!(a.kwta_mass > 0.0f && a.kwta_mass <= 1.0f)) fail("attribute kwta_mass must be in (0, 1]");
  if (!(a.kwta_temp >= 0.0f)) fail("attribute kwta_temp must be >= 0");
  if (a.kwta && a.kwta_select == 2 && !(a.kwta_temp > 0.0f)) fail("kwta_select 'mass' needs kwta_temp > 0");
  if (a.kwta_duty < 1) fail("attribute kwta_duty must be >= 1, got " + std::to_string(a.kwta_duty));
  if (!(a.event_topk > 0.0f && a.event_topk <= 1.0f)) fail("attribute event_topk must be in (0, 1]");
  if (!(a.event_quorum > 0.0f && a.event_quorum <= 1.0f)) fail("attribute event_quorum must be in (0, 1]");
  if (!(a.event_theta >= 0.0f)) fail("attribute event_theta must be >= 0");
  if (!(a.event_budget_ms >= 0.0f)) fail("attribute event_budget_ms must be >= 0 (0 = no budget)");
  if (!(a.event_gap_tol >= 0.0f)) fail("attribute event_gap_tol must be >= 0");
  if (a.event_gap_every < 0) fail("attribute event_gap_every must be >= 0 (0 = never)");
  if (!(a.event_beta > 0.0f)) fail("attribute event_beta must be > 0");
  if (!(a.event_lambda >= 0.0f)) fail("attribute event_lambda must be >= 0");
  if (a.event_age_max < 0) fail("attribute event_age_max must be >= 0 (0 = unbounded)");
  if (!target.empty() && target != "mlp" && target != "attn" && target != "head")
    fail("attribute target must be 'mlp', 'attn' or 'head', got '" + target + "'");

  const size_t n_in = info.GetInputCount();
  if (n_in < 2 || info.GetInputName(1).empty()) fail("input W (1) is missing");
  int is_const = 0;
  Ort::ConstValue wv = info.GetTensorConstantInput(1, &is_const);
  if (!is_const) fail("input W must be a constant initializer [K, N] (the layer's weight)");
  auto tsi = wv.GetTensorTypeAndShapeInfo();
  if (tsi.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) fail("input W must be float32");
  const auto shp = tsi.GetShape();
  if (shp.size() != 2 || shp[0] < 1 || shp[1] < 1) fail("input W must be 2-D [K, N], got " + shape_str(shp));
  if (shp[0] > kMaxDim || shp[1] > kMaxDim) fail("input W too large " + shape_str(shp));
  K_ = shp[0];
  N_ = shp[1];
  W_ = wv.GetTensorData<float>();
  nb_ = (K_ + a.block - 1) / a.block;
  if (a.kwta && a.kwta_select == 1 && (a.kwta_k < 1 || a.kwta_k > nb_))
    fail("kwta_select 'topk' needs 1 <= kwta_k <= number of blocks (" + std::to_string(nb_) + "), got " +
         std::to_string(a.kwta_k));
  S_ = kHdr + K_ + N_ + 2 * nb_;
  stateful_ = a.event || a.kwta_duty > 1;
  iota_.resize(static_cast<size_t>(K_));
  for (int64_t j = 0; j < K_; ++j) iota_[static_cast<size_t>(j)] = static_cast<int32_t>(j);
  norms_.resize(static_cast<size_t>(K_));
  for (int64_t j = 0; j < K_; ++j) {
    double s = 0;
    const float* r = W_ + j * N_;
    for (int64_t o = 0; o < N_; ++o) s += static_cast<double>(r[o]) * r[o];
    norms_.data()[j] = static_cast<float>(std::sqrt(s));
  }

  metrics::Node* m = metrics::node(name_);
  metrics::set(m->metric("kwta.enabled", false), a.kwta ? 1.0 : 0.0);
  metrics::set(m->metric("kwta.temp", false), a.kwta_temp);
  metrics::set(m->metric("kwta.duty", false), static_cast<double>(a.kwta_duty));
  metrics::set(m->metric("kwta.threshold", false), a.kwta_threshold);
  metrics::set(m->metric("pack.enabled", false), a.pack ? 1.0 : 0.0);
  metrics::set(m->metric("pack.mode", false), a.pack);
  m_keep_ = m->metric("kwta.keep_ratio", false);
  m_duty_ = m->metric("kwta.duty_hits", true);
  m_kept_ = m->metric("kwta.kept_channels", true);
  m_chan_ = m->metric("kwta.channels", true);
  m_density_ = m->metric("pack.density", false);
  m_active_ = m->metric("pack.active", false);
  m_pack_dense_ = m->metric("pack.dense_rows", true);
  m_ev_enabled_ = m->metric("event.enabled", false);
  metrics::set(m_ev_enabled_, a.event ? 1.0 : 0.0);
  m_ev_ms_ = m->metric("event.budget_ms_used", true);
  m_ev_quorum_ = m->metric("event.quorum_hits", true);
  m_ev_topk_ = m->metric("event.topk_kept", false);
  m_ev_gap_ = m->metric("event.quality_gap", false);
  m_ev_stale_ = m->metric("event.stale_pct", false);
  m_ev_disables_ = m->metric("event.disables", true);
  m_ev_checks_ = m->metric("event.gap_checks", true);
  m_ev_rows_ = m->metric("event.rows", true);
  m_calls_ = m->metric("gate.calls", true);
  m_rows_ = m->metric("gate.rows", true);
  m_dense_rows_ = m->metric("gate.dense_product_rows", true);  // rows computed by one dense product over x~
}

OrtStatusPtr EventGatedMatMulOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** op_kernel) const {
  return create_kernel_guarded<EventGatedMatMulKernel>("EventGatedMatMul", api, info, op_kernel);
}

OrtStatusPtr EventGatedMatMulKernel::ComputeV2(OrtKernelContext* context) noexcept {
  return status_guard(err_prefix_, [&] { Compute(context); });
}

// ------------------------------------------------------------------ compute
void EventGatedMatMulKernel::Compute(OrtKernelContext* context) const {
  Ort::KernelContext ctx(context);
  const GatingAttrs& a = a_;
  Ort::ConstValue xv = ctx.GetInput(0);
  // shapes in fixed arrays: no heap allocation of ours per call
  constexpr size_t kMaxRank = 8;
  int64_t xs[kMaxRank];
  size_t rank = 0;
  {
    auto xi = xv.GetTensorTypeAndShapeInfo();
    rank = xi.GetDimensionsCount();
    if (rank == 0 || rank > kMaxRank) fail("input X must have rank 1.." + std::to_string(kMaxRank) + ", got " + std::to_string(rank));
    Ort::ThrowOnError(Ort::GetApi().GetDimensions(xi, xs, rank));  // C API: the wrapper's array overload is deprecated
  }
  if (xs[rank - 1] != K_)
    fail("input X has shape " + shape_str(std::vector<int64_t>(xs, xs + rank)) + ": last dim must be K = " +
         std::to_string(K_));
  int64_t B = 1, T = 1;
  if (rank >= 3) {
    T = xs[rank - 2];
    for (size_t i = 0; i + 2 < rank; ++i) B *= xs[i];
  } else {
    for (size_t i = 0; i + 1 < rank; ++i) B *= xs[i];
  }
  const int64_t M = B * T;
  int64_t ys[kMaxRank];
  std::copy(xs, xs + rank, ys);
  ys[rank - 1] = N_;
  Ort::UnownedValue yv = ctx.GetOutput(0, ys, rank);
  const float* X = xv.GetTensorData<float>();
  float* Y = yv.GetTensorMutableData<float>();

  // state in/out
  const float* st_in = nullptr;
  if (ctx.GetInputCount() > 2) {
    Ort::ConstValue sv = ctx.GetInput(2);
    if (sv) {
      const auto ss = sv.GetTensorTypeAndShapeInfo().GetShape();
      int64_t numel = 1;
      for (auto d : ss) numel *= d;
      if (numel > 0) {
        if (!stateful_)
          fail("a non-empty state was given but the node is stateless (no event mode, kwta_duty = 1)");
        if (ss.size() != 2 || ss[0] != B || ss[1] != S_)
          fail("state input has shape " + shape_str(ss) + ", expected [" + std::to_string(B) + ", " +
               std::to_string(S_) + "] ([batch, 8 + K + N + 2*blocks]) or an empty [batch, 0] for a new sequence");
        st_in = sv.GetTensorData<float>();
      }
    }
  }
  float* st_out = nullptr;
  if (ctx.GetOutputCount() > 1) {
    const int64_t sdims[2] = {B, stateful_ ? S_ : 0};
    Ort::UnownedValue so = ctx.GetOutput(1, sdims, 2);
    if (stateful_) st_out = so.GetTensorMutableData<float>();
  }
  std::vector<float> st_local;
  if (stateful_ && !st_out) {  // state output not wired: work on a scratch copy
    st_local.resize(static_cast<size_t>(B * S_));
    st_out = st_local.data();
  }
  if (stateful_) {
    if (st_in)
      std::memcpy(st_out, st_in, sizeof(float) * static_cast<size_t>(B * S_));
    else
      std::fill(st_out, st_out + B * S_, 0.0f);
  }
  if (M == 0) {
    metrics::add(m_calls_, 1.0);
    return;
  }

  // buffers: x~ rows [M, K], per-row masks, per-row work
  RowScratch& rs = row_scratch();
  const size_t nf = static_cast<size_t>(M * K_ + 3 * K_ + N_ + 2 * nb_ + 64 + kMaxTasks * N_);
  if (rs.f.size() < nf) rs.f.resize(nf + nf / 4);
  const size_t ni = static_cast<size_t>(K_ + nb_ + 16);
  if (rs.i.size() < ni) rs.i.resize(ni + ni / 4);
  if (rs.u8.size() < static_cast<size_t>(2 * M * nb_ + M)) rs.u8.resize(static_cast<size_t>(2 * M * nb_ + M));
  if (rs.i64.size() < static_cast<size_t>(M)) rs.i64.resize(static_cast<size_t>(M));
  uint8_t* masks = rs.u8.data();
  float* XT = rs.f.data();
  GatingCall c{*this, ctx, kernels(), gating_kernels(), XT + M * K_, nullptr, nullptr, nullptr, rs.i.data(), nullptr};
  c.bs = c.sc + K_;
  c.vals = c.bs + nb_ + 16;
  c.ytmp = c.vals + K_;
  c.ord = c.idx + K_;
  c.ptmp = c.ytmp + N_ + 16;
  int64_t* nkeep = rs.i64.data();
  uint8_t* pending = masks + 2 * M * nb_;  // rows left for the batched product
  std::fill(pending, pending + M, 0);
  int64_t npending = 0;
  double kept_frac_pending = 0;

  // fast path (the planner's online mode): stateless rows, per-channel KWTA threshold. One row:
  // mask, indices and values in one pass over x, then the row-skipping matvec. Several rows: the
  // masked rows x~ in one vectorised pass each, then per-row matvecs or one dense product.
  if (!stateful_ && a.kwta && a.kwta_select == 0 && a.block == 1 && !a.pack && !a.kwta_renorm) {
    const float* nrm = a.score_xw ? norms_.data() : nullptr;
    int64_t kept = 0;
    if (M == 1) {
      const int64_t n = c.gk.threshold_compress(X, nrm, a.kwta_threshold, K_, c.idx, c.vals);
      if (n == K_)
        c.matvec(X, nullptr, nullptr, 0, Y, false);
      else if (n == 0)
        std::fill(Y, Y + N_, 0.0f);
      else
        c.matvec(nullptr, c.idx, c.vals, n, Y, false);
      kept = n;
    } else {
      for (int64_t r = 0; r < M; ++r) kept += c.gk.threshold_mask(X + r * K_, nrm, a.kwta_threshold, K_, XT + r * K_);
      if (per_row_wins(static_cast<double>(kept) / static_cast<double>(K_), M)) {
        for (int64_t r = 0; r < M; ++r) {
          const int64_t n = c.gk.threshold_compress(X + r * K_, nrm, a.kwta_threshold, K_, c.idx, c.vals);
          if (n == 0)
            std::fill(Y + r * N_, Y + (r + 1) * N_, 0.0f);
          else
            c.matvec(nullptr, c.idx, c.vals, n, Y + r * N_, false);
        }
      } else {
        dense_product(ctx, XT, M, Y);
        metrics::add(m_dense_rows_, static_cast<double>(M));
      }
    }
    metrics::add(m_calls_, 1.0);
    metrics::add(m_rows_, static_cast<double>(M));
    metrics::add(m_kept_, static_cast<double>(kept));
    metrics::add(m_chan_, static_cast<double>(M * K_));
    metrics::set(m_keep_, static_cast<double>(kept) / static_cast<double>(M * K_));
    return;
  }

  for (int64_t b = 0; b < B; ++b) {
    float* st = stateful_ ? st_out + b * S_ : nullptr;
    const bool was_init = st && st[0] == 1.0f;
    float* smask = st ? st + kHdr + K_ + N_ + nb_ : nullptr;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t r = b * T + t;
      const float* x = X + r * K_;
      float* xt = XT + r * K_;
      uint8_t* keep = masks + 2 * r * nb_;
      uint8_t* cand = keep + nb_;
      int64_t step = 0;
      if (was_init) {
        st[1] += 1.0f;
        step = static_cast<int64_t>(st[1]);
      }
      const float* reuse = nullptr;
      if (a.kwta && was_init && a.kwta_duty > 1 && step % a.kwta_duty != 0) reuse = smask;
      const bool dense_row = !was_init && a.dense_prefill && T > 1;
      nkeep[r] = c.gate(x, xt, keep, cand, reuse, dense_row);
      if (st && !reuse)
        for (int64_t q = 0; q < nb_; ++q) smask[q] = keep[q] ? 1.0f : 0.0f;
      c.kept += static_cast<double>(nkeep[r]);
      c.chans += static_cast<double>(nb_);
      if (a.event && was_init) {
        if (st[2] == 0.0f) {
          c.event_row(xt, cand, st, step, Y + r * N_);
          c.ev_enabled_last = st[2] == 0.0f ? 1.0 : 0.0;
        } else {
          c.gated_row(xt, keep, nkeep[r], Y + r * N_);
          c.ev_enabled_last = 0.0;
        }
      } else {
        pending[r] = 1;
        ++npending;
        kept_frac_pending += static_cast<double>(nkeep[r]) / static_cast<double>(nb_);
      }
    }
  }

  if (npending) {
    // Batched rows: row-skipping matvecs (read only each row's kept rows of W) when they cost
    // less than one dense product over x~ (same result: dropped channels are 0), see per_row_wins.
    if (npending == 1 || per_row_wins(kept_frac_pending, npending)) {
      for (int64_t r = 0; r < M; ++r)
        if (pending[r]) c.gated_row(XT + r * K_, masks + 2 * r * nb_, nkeep[r], Y + r * N_);
    } else {
      // contiguous runs of pending rows: product per run, split over the pool
      int64_t r = 0;
      while (r < M) {
        if (!pending[r]) {
          ++r;
          continue;
        }
        int64_t r1 = r;
        while (r1 < M && pending[r1]) ++r1;
        const int64_t m = r1 - r;
        const float* A = XT + r * K_;
        float* C = Y + r * N_;
        dense_product(ctx, A, m, C);
        metrics::add(m_dense_rows_, static_cast<double>(m));
        r = r1;
      }
    }
    // fresh sequences: initialise their state from the last token
    if (stateful_) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t r = b * T + T - 1;
        if (!pending[r]) continue;
        float* st = st_out + b * S_;
        if (st[0] == 1.0f) continue;  // an initialised, event-disabled-free row is never pending
        st[0] = 1.0f;
        st[1] = 0.0f;
        std::memcpy(st + kHdr, XT + r * K_, sizeof(float) * K_);
        std::memcpy(st + kHdr + K_, Y + r * N_, sizeof(float) * N_);
        std::fill(st + kHdr + K_ + N_, st + kHdr + K_ + N_ + nb_, 0.0f);
      }
    }
  }

  metrics::add(m_calls_, 1.0);
  metrics::add(m_rows_, static_cast<double>(M));
  if (a.kwta) {
    metrics::add(m_kept_, c.kept);
    metrics::add(m_chan_, c.chans);
    metrics::set(m_keep_, c.chans > 0 ? c.kept / c.chans : 1.0);
    if (c.duty_hits) metrics::add(m_duty_, c.duty_hits);
  }
  if (a.pack && c.density_rows > 0) {
    metrics::set(m_density_, c.density_sum / c.density_rows);
    metrics::set(m_active_, c.active / c.density_rows);
    if (c.pack_dense) metrics::add(m_pack_dense_, c.pack_dense);
  }
  if (a.event) {
    if (c.ev_enabled_last >= 0) metrics::set(m_ev_enabled_, c.ev_enabled_last);
    if (c.ev_ms) metrics::add(m_ev_ms_, c.ev_ms);
    if (c.ev_quorum) metrics::add(m_ev_quorum_, c.ev_quorum);
    if (c.ev_topk_last >= 0) metrics::set(m_ev_topk_, c.ev_topk_last);
    if (c.ev_stale_last >= 0) metrics::set(m_ev_stale_, c.ev_stale_last);
    if (c.ev_gap_last >= 0) metrics::set(m_ev_gap_, c.ev_gap_last);
    if (c.ev_checks) metrics::add(m_ev_checks_, c.ev_checks);
    if (c.ev_disables) metrics::add(m_ev_disables_, c.ev_disables);
    if (c.ev_rows) metrics::add(m_ev_rows_, c.ev_rows);
  }
}

}  // namespace ortlean
