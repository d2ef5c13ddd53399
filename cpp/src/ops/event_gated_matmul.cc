#include "ops/event_gated_matmul.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>

#include "blas.h"
#include "isa.h"

namespace ortlean {
namespace {

// weights per matvec task (384 KB). From DRAM at 2 threads, 1536x576 keep 0.25 (221k weights)
// took 29 us in two tasks vs 47 us in one; one-thread sessions never split (PoolProbe).
constexpr int64_t kGrain = 96 * 1024;
constexpr int64_t kMaxTasks = 16;
constexpr int64_t kMinCols = 384;
constexpr int64_t kBlasMinRows = 16;
constexpr int64_t kEventChunk = 256;  // event rows applied per step between budget checks
constexpr int64_t kQTile = 64;        // quantized dense product: columns dequantized per tile
// int4k matvec: at most 4 tasks (768x3072 at 2 threads, cold: 16 tasks of row slices with partial
// sums took 1.5-1.9x the time of 2-4 column tasks; bench_gating_op.py-style runs, loaded machine)
constexpr int64_t kKMaxTasks = 4;

// per-thread scratch of this op (grows only)
struct RowScratch {
  std::vector<float> f;
  std::vector<int32_t> i;
  std::vector<uint8_t> u8;
  std::vector<int64_t> i64;
  std::vector<int8_t> xq;   // int4k: the quantized vector of a product
  std::vector<int32_t> pl;  // int4k: its nonzero pairs
};
RowScratch& row_scratch() {
  thread_local RowScratch s;
  return s;
}

// Per-row gated matvecs or one dense product for m rows keeping `kept_frac_sum` (sum over the rows
// of each row's kept fraction)? In units of one dense matvec of the format: per-row costs
// ~row_cost * kept; the dense product costs `fixed` (reading / dequantizing W once) plus m times
// `per_row` (the GEMM's multiply-adds). f32: memory-bound matvecs read kept rows of W at ~0.87 of the
// dense streaming rate, the dense product does m*K*N multiply-adds at ~11x that rate
// (tests/bench/bench_gating_op.py): 1.15 * sum(kept) < 1 + 0.09 * m, e.g. m = 2 at keep <= 0.5,
// m = 8 at keep <= 0.19; never at m = 128. Quantized rows: see kQuantCost.
constexpr RowCost kF32Cost{1.15, 1.0, 0.09};
// Quantized rows: the row matvec is compute-bound (dequantize + FMA, ~1.2x the f32 matvec over
// cached rows, /tmp timing on the loaded 2-core machine) and the dense product dequantizes W once
// per task then runs the same f32 GEMM, so the f32 balance is kept; not re-measured on a quiet
// machine (the decision only picks between two exact paths: it affects speed, not results).
constexpr RowCost kQuantCost = kF32Cost;
inline bool per_row_wins(const RowCost& c, double kept_frac_sum, int64_t m) {
  return c.row_cost * kept_frac_sum < c.fixed + c.per_row * static_cast<double>(m);
}
// int4k: one pending row is an int8-activation product, several are one dense product with f32
// activations (the semantics of custom_ops/reference/gating.py: the choice changes results, so it
// is not a cost decision).
constexpr RowCost kInt4KCost{1.0, 0.0, 0.0};

// X [..., T, K] (rank >= 3): B = prod(leading) sequences of T tokens; X [M, K]: M sequences of one.
struct Batch {
  int64_t B, T;
};
Batch batch_of(const RowsIO& io) {
  Batch bt{1, 1};
  if (io.rank >= 3) {
    bt.T = io.dims[io.rank - 2];
    for (size_t i = 0; i + 2 < io.rank; ++i) bt.B *= io.dims[i];
  } else {
    for (size_t i = 0; i + 1 < io.rank; ++i) bt.B *= io.dims[i];
  }
  return bt;
}

}  // namespace

// One Compute() call: its buffers (thread-local of the calling thread), the per-call metric
// accumulators, and the steps of the op.
class GatingCall {
 public:
  GatingCall(const EventGatedMatMulKernel& k, const Ort::KernelContext& ctx, const RowsIO& io, Batch bt);

  // The planner's online mode (stateless, per-channel threshold): true when it handled the call.
  bool threshold_fast_path();
  // Per sequence and token: gate the row; event rows of running sequences are computed now, the
  // others are left pending for the batched product. states: [B, S] or nullptr (stateless).
  void gate_rows(float* states);
  // The pending rows: per-row skipping matvecs or dense products over x~.
  void product_pending();
  // Sequences that were not running: their state starts from their last token.
  void start_sequences(float* states);
  void publish_metrics() const;

 private:
  int64_t blk0(int64_t b) const { return b * k.a_.block; }
  int64_t blk1(int64_t b) const { return std::min(k.K_, (b + 1) * k.a_.block); }
  uint8_t* keep_of(int64_t r) const { return masks + 2 * r * k.nb_; }
  uint8_t* cand_of(int64_t r) const { return masks + 2 * r * k.nb_ + k.nb_; }

  void matvec(const float* x, const int32_t* rows, const float* v, int64_t n, float* y, bool acc) const;
  // int4k: the same product with v quantized to int8 (custom_ops/reference/gating_quant.py)
  void kmatvec(const float* x, const int32_t* rows, const float* v, int64_t n, float* y, bool acc) const;
  // The one format-dependent step of a matvec: y[0:ncols] (+)= sum_j v[j] * W[rows[j], c0 : c0 + ncols].
  void axpy_rows(const int32_t* rows, const float* v, int64_t n, int64_t c0, int64_t ncols, float* y, bool acc) const;
  // y[0:N] (+)= the sum over n rows, as nt > 1 pool tasks: 64-column chunks when the output is wide,
  // else row chunks with partial sums in ptmp [nt, N]. part(r0, nr, c0, nc, out, acc) computes rows
  // [r0, r0 + nr) into out[0:nc] = columns [c0, c0 + nc).
  template <class Part>
  void split_matvec(int64_t n, int64_t nt, float* y, bool acc, Part&& part) const;
  void dense_product(const float* A, int64_t m, float* C) const;
  // gating of one row: candidates (zero-skip) -> kept blocks (KWTA) -> x~
  int64_t gate(const float* x, float* xt, uint8_t* keep, uint8_t* cand, const float* reuse, bool dense_row);
  int64_t zero_skip(const float* x, uint8_t* cand);
  int64_t kwta_keep(const float* x, const uint8_t* cand, uint8_t* keep, const float* reuse);
  void write_gated(const float* x, const uint8_t* cand, const uint8_t* keep, int64_t nkeep, float* xt) const;
  void gated_row(const float* xt, const uint8_t* keep, int64_t nkeep, float* y);
  // event mode, one row of a running sequence
  void event_row(const float* xt, const uint8_t* cand, EventState& st, int64_t step, float* y);
  int64_t event_order(const float* xt, const uint8_t* cand, const EventState& st, bool* quorum_hit);
  int64_t apply_events(const float* xt, EventState& st, int64_t nt, std::chrono::steady_clock::time_point t0);
  void gap_check(const float* xt, EventState& st, float* y);

  const EventGatedMatMulKernel& k;
  const Ort::KernelContext& ctx;
  const GemmKernels& kr;
  const GatingKernels& gk;
  const RowsIO& io;
  const Batch bt;
  // buffers
  float* XT;         // [M, K] gated rows x~
  uint8_t* masks;    // [M, 2, nb] kept blocks, candidate blocks
  uint8_t* pending;  // [M] rows left for the batched product
  int64_t* nkeep;    // [M]
  float* sc;         // [K] channel scores / deltas
  float* bs;         // [nb] block scores
  float* vals;       // [K]
  float* ytmp;       // [N]
  int32_t* idx;      // [K]
  int32_t* ord;      // [nb]
  float* ptmp;       // [kMaxTasks, N] partial sums
  int64_t npending = 0;
  double kept_frac_pending = 0;
  // per-call metric accumulators
  double kept = 0, chans = 0, duty_hits = 0, density_sum = 0, density_rows = 0, active = 0, pack_dense = 0;
  double ev_ms = 0, ev_quorum = 0, ev_checks = 0, ev_disables = 0, ev_rows = 0;
  double ev_topk_last = -1, ev_stale_last = -1, ev_gap_last = -1, ev_enabled_last = -1;
};

GatingCall::GatingCall(const EventGatedMatMulKernel& k_, const Ort::KernelContext& ctx_, const RowsIO& io_, Batch bt_)
    : k(k_), ctx(ctx_), kr(*k_.gemm_), gk(*k_.gk_), io(io_), bt(bt_) {
  const int64_t M = io.M, K = k.K_, N = k.N_, nb = k.nb_;
  RowScratch& rs = row_scratch();
  const size_t nf = static_cast<size_t>(M * K + 3 * K + N + 2 * nb + 64 + kMaxTasks * N);
  if (rs.f.size() < nf) rs.f.resize(nf + nf / 4);
  const size_t ni = static_cast<size_t>(K + nb + 16);
  if (rs.i.size() < ni) rs.i.resize(ni + ni / 4);
  if (rs.u8.size() < static_cast<size_t>(2 * M * nb + M)) rs.u8.resize(static_cast<size_t>(2 * M * nb + M));
  if (rs.i64.size() < static_cast<size_t>(M)) rs.i64.resize(static_cast<size_t>(M));
  XT = rs.f.data();
  sc = XT + M * K;
  bs = sc + K;
  vals = bs + nb + 16;
  ytmp = vals + K;
  ptmp = ytmp + N + 16;
  idx = rs.i.data();
  ord = idx + K;
  masks = rs.u8.data();
  pending = masks + 2 * M * nb;
  std::fill(pending, pending + M, 0);
  nkeep = rs.i64.data();
}

template <class Part>
void GatingCall::split_matvec(int64_t n, int64_t nt, float* y, bool acc, Part&& part) const {
  const int64_t N = k.N_;
  if (N / nt >= kMinCols) {
    const int64_t chunk = ((N + nt - 1) / nt + 63) / 64 * 64;
    nt = (N + chunk - 1) / chunk;
    auto task = [&](size_t t) noexcept {
      const int64_t c0 = static_cast<int64_t>(t) * chunk;
      part(0, n, c0, std::min(chunk, N - c0), y + c0, acc);
    };
    k.pool_.run(ctx, static_cast<size_t>(nt), task);
    return;
  }
  const int64_t rchunk = (n + nt - 1) / nt;
  nt = (n + rchunk - 1) / rchunk;
  auto task = [&](size_t t) noexcept {
    const int64_t r0 = static_cast<int64_t>(t) * rchunk;
    part(r0, std::min(rchunk, n - r0), 0, N, ptmp + t * N, false);
  };
  k.pool_.run(ctx, static_cast<size_t>(nt), task);
  for (int64_t o = 0; o < N; ++o) {
    float s = acc ? y[o] : 0.0f;
    for (int64_t t = 0; t < nt; ++t) s += ptmp[t * N + o];
    y[o] = s;
  }
}

// y[0:N] (+)= x . W over the listed rows (all rows when rows == nullptr: v = x), split on the
// pool by columns (wide outputs) or by rows with partial sums (narrow outputs).
void GatingCall::matvec(const float* x, const int32_t* rows, const float* v, int64_t n, float* y, bool acc) const {
  const int64_t N = k.N_;
  if (k.format_ == kWeightInt4K) {
    kmatvec(x, rows, v, n, y, acc);
    return;
  }
  if (!rows) {
    rows = k.iota_.data();
    v = x;
    n = k.K_;
  }
  const int64_t work = n * N;
  int64_t nt = std::max<int64_t>(1, std::min<int64_t>(kMaxTasks, work / kGrain));
  if (k.pool_.width() == 1) nt = 1;  // one thread: one pass over the kept rows, no partial sums
  if (nt == 1) {
    axpy_rows(rows, v, n, 0, N, y, acc);
    return;
  }
  split_matvec(n, nt, y, acc, [&](int64_t r0, int64_t nr, int64_t c0, int64_t nc, float* out, bool a) {
    axpy_rows(rows + r0, v + r0, nr, c0, nc, out, a);
  });
}

// int4k: quantize v (x over every row, or v over the listed rows) to int8 with one symmetric scale,
// list the pairs with a nonzero channel, then the pair kernel, split over the pool like matvec.
void GatingCall::kmatvec(const float* x, const int32_t* rows, const float* v, int64_t n, float* y, bool acc) const {
  const int64_t K = k.K_, N = k.N_, P = (K + 1) / 2;
  const KQuantRows* w = &k.kq_;
  RowScratch& rs = row_scratch();
  if (rs.xq.size() < static_cast<size_t>(2 * P)) rs.xq.resize(static_cast<size_t>(2 * P));
  if (rs.pl.size() < static_cast<size_t>(P)) rs.pl.resize(static_cast<size_t>(P));
  int8_t* xq = rs.xq.data();
  int32_t* pl = rs.pl.data();
  const float* src = rows ? v : x;
  const int64_t cnt = rows ? n : K;
  float amax = 0.0f;
  bool finite = true;
  for (int64_t j = 0; j < cnt; ++j) {
    const float a = std::fabs(src[j]);
    finite &= a <= 3.4028234663852886e38f;  // false for inf and NaN
    amax = a > amax ? a : amax;
  }
  if (!finite) {  // the reference: a non-finite input makes every output NaN
    for (int64_t o = 0; o < N; ++o) y[o] = acc ? y[o] + NAN : NAN;
    return;
  }
  if (!(amax > 0.0f)) {
    if (!acc) std::fill(y, y + N, 0.0f);
    return;
  }
  const float inv = 127.0f / amax, xs = amax / 127.0f;
  // rint(t * inv) to nearest even: adding 1.5 * 2^23 leaves an integer in float32 (|t * inv| <= 127.5;
  // this translation unit is baseline x86-64, no FMA contraction of the product and the add)
  auto q8 = [inv](float t) {
    const float prod = t * inv;
    const float q = (prod + 12582912.0f) - 12582912.0f;
    return static_cast<int8_t>(q > 127.0f ? 127 : q < -127.0f ? -127 : static_cast<int>(q));
  };
  std::memset(xq, 0, static_cast<size_t>(2 * P));
  if (rows) {
    for (int64_t j = 0; j < n; ++j) xq[rows[j]] = q8(v[j]);
  } else {
    for (int64_t j = 0; j < K; ++j) xq[j] = q8(x[j]);
  }
  int64_t np = 0;
  for (int64_t p = 0; p < P; ++p) {
    pl[np] = static_cast<int32_t>(p);
    np += (xq[2 * p] | xq[2 * p + 1]) != 0;
  }
  const int64_t work = 2 * np * N;
  int64_t nt = std::max<int64_t>(1, std::min<int64_t>(kKMaxTasks, work / kGrain));
  if (k.pool_.width() == 1) nt = 1;
  if (nt == 1 || np < 2) {
    k.qk_->kmatvec(w, xq, pl, np, xs, 0, N, y, acc ? 1 : 0);
    return;
  }
  split_matvec(np, nt, y, acc, [&](int64_t r0, int64_t nr, int64_t c0, int64_t nc, float* out, bool a) {
    k.qk_->kmatvec(w, xq, pl + r0, nr, xs, c0, nc, out, a ? 1 : 0);
  });
}

void GatingCall::axpy_rows(const int32_t* rows, const float* v, int64_t n, int64_t c0, int64_t ncols, float* y,
                           bool acc) const {
  if (k.format_ == kWeightF32)
    gk.gather_axpy(rows, v, n, k.W_ + c0, k.N_, y, ncols, acc ? 1 : 0);
  else
    k.qk_->gather_axpy(rows, v, n, &k.q_, c0, ncols, y, acc ? 1 : 0);
}

// C[m, N] = A[m, K] . W on the pool: about one task per 4 M multiply-adds (at most kMaxTasks),
// column chunks first (whole tiles), then row blocks (>= 48 rows, on the kernel's 6-row strips)
// until there are about `want` tasks of equal size (9 chunks on 2 threads would leave one idle
// for a ninth of the time: 2 row blocks make it 18).
void GatingCall::dense_product(const float* A, int64_t m, float* C) const {
  const int64_t K = k.K_, N = k.N_;
  const float* W = k.W_;
  // OpenBLAS only with the scalar table (measured 2x slower than our AVX kernels here)
  const bool blas = isa() == Isa::Scalar && m >= kBlasMinRows;
  const double work = static_cast<double>(m) * static_cast<double>(K) * static_cast<double>(N);
  const int64_t want = std::max<int64_t>(1, std::min<int64_t>(kMaxTasks, static_cast<int64_t>(work / 4.0e6)));
  // column chunks: whole 64-column tiles of the register kernel, the same number per chunk when
  // N allows (a 16-column remainder strip runs at a third of the speed)
  int64_t ncb = std::max<int64_t>(1, std::min<int64_t>(N / 128, want));
  if (N % 64 == 0) {
    const int64_t tiles = N / 64;
    int64_t best = 1;
    for (int64_t d = 1; d <= std::min(tiles, want); ++d)
      if (tiles % d == 0) best = d;
    ncb = best;
  }
  const int64_t nrb = std::max<int64_t>(1, std::min<int64_t>((want + ncb - 1) / ncb, m / 48));
  auto row_at = [&](int64_t i) { return i >= nrb ? m : std::min(m, (i * m / nrb + 3) / 6 * 6); };
  auto col_at = [&](int64_t i) {
    if (i >= ncb) return N;
    return N % 64 == 0 ? i * (N / ncb) : std::min(N, (i * N / ncb + 8) / 16 * 16);
  };
  auto task = [&](size_t ti) noexcept {
    const int64_t rb = static_cast<int64_t>(ti) / ncb, cb = static_cast<int64_t>(ti) % ncb;
    const int64_t m0 = row_at(rb), rows = row_at(rb + 1) - m0;
    const int64_t c0 = col_at(cb), cols = col_at(cb + 1) - c0;
    if (rows <= 0 || cols <= 0) return;
    if (k.format_ != kWeightF32) {
      // quantized: dequantize kQTile columns of every row into this thread's tile, multiply, next
      // (OpenBLAS on the tile measured 1.2x slower than the register kernel at M = 128, AVX2)
      float* tile = task_scratch().get(static_cast<size_t>(K * kQTile));
      for (int64_t q0 = c0; q0 < c0 + cols; q0 += kQTile) {
        const int64_t w = std::min(kQTile, c0 + cols - q0);
        if (k.format_ == kWeightInt4K)
          k.qk_->kdequant(&k.kq_, 0, K, q0, w, tile, w);
        else
          k.qk_->dequant(&k.q_, 0, K, q0, w, tile, w);
        if (blas)
          blas::sgemm(false, false, rows, w, K, 1.0f, A + m0 * K, K, tile, w, 0.0f, C + m0 * N + q0, N);
        else
          kr.sgemm_nn(rows, w, K, A + m0 * K, K, tile, w, C + m0 * N + q0, N);
      }
      return;
    }
    if (blas)
      blas::sgemm(false, false, rows, cols, K, 1.0f, A + m0 * K, K, W + c0, N, 0.0f, C + m0 * N + c0, N);
    else
      kr.sgemm_nn(rows, cols, K, A + m0 * K, K, W + c0, N, C + m0 * N + c0, N);
  };
  parallel_for(ctx, static_cast<size_t>(nrb * ncb), task);
}

// ------------------------------------------------------------------ gating of one row
// Writes x~ into xt, the kept block mask into keep, the candidate mask into cand; returns the
// number of kept blocks. reuse: the stored KWTA mask (duty cycle), or nullptr.
int64_t GatingCall::gate(const float* x, float* xt, uint8_t* keep, uint8_t* cand, const float* reuse,
                         bool dense_row) {
  const int64_t nb = k.nb_;
  if (dense_row) {
    std::memcpy(xt, x, sizeof(float) * k.K_);
    std::fill(keep, keep + nb, 1);
    std::fill(cand, cand + nb, 1);
    return nb;
  }
  const int64_t ncand = zero_skip(x, cand);
  std::copy(cand, cand + nb, keep);
  const int64_t n = k.a_.kwta ? kwta_keep(x, cand, keep, reuse) : ncand;
  write_gated(x, cand, keep, n, xt);
  return n;
}

// Candidate blocks: all, or (zero-skip) the blocks with a |x| above pack_eps unless they are
// denser than pack_rho. Returns how many.
int64_t GatingCall::zero_skip(const float* x, uint8_t* cand) {
  const GatingAttrs& a = k.a_;
  const int64_t nb = k.nb_;
  std::fill(cand, cand + nb, 1);
  if (!a.pack) return nb;
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
    return nb;
  }
  return act;
}

// KWTA among the candidates (keep holds the candidates on entry): the stored mask (duty cycle),
// or block scores by threshold / top-k / softmax mass. Returns the number of kept blocks.
int64_t GatingCall::kwta_keep(const float* x, const uint8_t* cand, uint8_t* keep, const float* reuse) {
  const GatingAttrs& a = k.a_;
  const int64_t K = k.K_, nb = k.nb_;
  if (reuse) {
    int64_t n = 0;
    for (int64_t b = 0; b < nb; ++b) {
      keep[b] = cand[b] && reuse[b] > 0.5f;
      n += keep[b];
    }
    duty_hits += 1;
    return n;
  }
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
  if (a.kwta_select == 0) {  // threshold on the block's RMS score
    int64_t n = 0;
    const float thr = a.kwta_threshold;
    const int64_t bsz = a.block;
    if (bsz == 1) {
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t kb = cand[b] & static_cast<uint8_t>(bs[b] > thr);
        keep[b] = kb;
        n += kb;
      }
    } else {
      const float full = std::sqrt(static_cast<float>(bsz));
      const int64_t last = K - (nb - 1) * bsz;
      const float lastlen = std::sqrt(static_cast<float>(last));
      for (int64_t b = 0; b < nb; ++b) {
        const float len = b == nb - 1 ? lastlen : full;
        const uint8_t kb = cand[b] & static_cast<uint8_t>(bs[b] / len > thr);
        keep[b] = kb;
        n += kb;
      }
    }
    return n;
  }
  // a NaN score (NaN input) ranks last: the orderings below need a strict weak order
  for (int64_t b = 0; b < nb; ++b)
    if (std::isnan(bs[b])) bs[b] = -INFINITY;
  int64_t n = 0;
  for (int64_t b = 0; b < nb; ++b)
    if (cand[b]) ord[n++] = static_cast<int32_t>(b);
  auto cmp = [&](int32_t p, int32_t q) { return bs[p] > bs[q] || (bs[p] == bs[q] && p < q); };
  std::fill(keep, keep + nb, 0);
  int64_t take;
  if (a.kwta_select == 1) {  // top k
    take = std::min<int64_t>(a.kwta_k, n);
    if (take < n) std::nth_element(ord, ord + take, ord + n, cmp);
  } else {  // smallest prefix holding kwta_mass of the softmax mass
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
  return take;
}

// x~ = x on the kept blocks (times candidates / kept with kwta_renorm), 0 elsewhere.
void GatingCall::write_gated(const float* x, const uint8_t* cand, const uint8_t* keep, int64_t nkeep_row,
                             float* xt) const {
  const GatingAttrs& a = k.a_;
  const int64_t K = k.K_, nb = k.nb_;
  float r = 1.0f;
  if (a.kwta && a.kwta_renorm && nkeep_row > 0) {
    int64_t nc = 0;
    for (int64_t b = 0; b < nb; ++b) nc += cand[b];
    r = static_cast<float>(nc) / static_cast<float>(nkeep_row);
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
}

// Non-event row: y = xt . W reading only the kept blocks (dense kernel when all are kept).
void GatingCall::gated_row(const float* xt, const uint8_t* keep, int64_t nkeep_row, float* y) {
  if (nkeep_row == k.nb_) {
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

// ------------------------------------------------------------------ event mode
// Event row of a running (initialised, enabled) sequence: the blocks whose input moved most since
// the cache (within the candidates, budget, quorum) update the cached output; writes y.
void GatingCall::event_row(const float* xt, const uint8_t* cand, EventState& st, int64_t step, float* y) {
  const int64_t nb = k.nb_;
  const auto t0 = std::chrono::steady_clock::now();
  bool qhit = false;
  const int64_t nt = event_order(xt, cand, st, &qhit);
  const int64_t done_blocks = apply_events(xt, st, nt, t0);
  float* age = st.age();
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
  std::memcpy(y, st.y_cache(), sizeof(float) * k.N_);
  const int64_t ge = k.a_.event_gap_every;  // checks on steps 1, 2, 4, ... (< ge), then every ge
  if (ge > 0 && (step % ge == 0 || (step < ge && (step & (step - 1)) == 0))) gap_check(xt, st, y);
  ev_rows += 1;
  ev_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// The blocks to refresh, in ord[0:n): blocks at the age limit first, then the eligible ones
// (candidates whose delta score is above theta) by priority delta / confidence, cut at event_topk
// and at the quorum share of the eligible score. Returns n.
int64_t GatingCall::event_order(const float* xt, const uint8_t* cand, const EventState& st, bool* quorum_hit) {
  const GatingAttrs& a = k.a_;
  const int64_t K = k.K_, nb = k.nb_;
  const float* xref = st.x_ref();
  const float* age = st.age();
  const float* norms = k.norms_.data();
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
    // confidence of the cached block; a NaN age (a malformed state) counts as confidence 1e-30
    const double w = static_cast<double>(a.event_beta) * std::exp(-static_cast<double>(a.event_lambda) * age[b]);
    prio[b] = static_cast<float>(bs[b] / (w > 1e-30 ? w : 1e-30));
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
  for (int64_t i = 0; i < ne; ++i) {
    if (limit < nb && nt >= limit) break;
    if (quorum && total > 0 && accq >= static_cast<double>(a.event_quorum) * total) {
      *quorum_hit = true;
      break;
    }
    ord[nt++] = idx[i];
    accq += bs[idx[i]];
  }
  return nt;
}

// y_cache += (x~ - x_ref) . W over the blocks ord[0:nt) in priority order, in chunks of
// kEventChunk rows when a budget is set (stopping once event_budget_ms is spent); refreshed blocks
// take x_ref = x~ and age -1 (0 after the call). Returns the number of blocks applied.
int64_t GatingCall::apply_events(const float* xt, EventState& st, int64_t nt,
                                 std::chrono::steady_clock::time_point t0) {
  float* xref = st.x_ref();
  float* age = st.age();
  const double budget = k.a_.event_budget_ms;
  const int64_t cap = budget > 0 ? kEventChunk : INT64_MAX;
  int64_t done_blocks = 0;
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
    if (n) matvec(nullptr, idx, vals, n, st.y_cache(), true);
    for (int64_t q = i; q < i1; ++q) {
      const int64_t b = ord[q];
      for (int64_t j = blk0(b); j < blk1(b); ++j) xref[j] = xt[j];
      age[b] = -1.0f;  // taken (reset to 0 by the caller)
    }
    done_blocks = i1;
    i = i1;
    if (budget > 0 && i < nt) {
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (ms >= budget) break;
    }
  }
  return done_blocks;
}

// A gap check: the dense row; disable the sequence when the cached output is off by more than
// event_gap_tol; output the dense row and resynchronise the cache.
void GatingCall::gap_check(const float* xt, EventState& st, float* y) {
  const int64_t K = k.K_, N = k.N_;
  matvec(xt, nullptr, nullptr, 0, ytmp, false);
  double num = 0, den = 0;
  for (int64_t o = 0; o < N; ++o) {
    const double dd = static_cast<double>(y[o]) - ytmp[o];
    num += dd * dd;
    den += static_cast<double>(ytmp[o]) * ytmp[o];
  }
  const double gap = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  st.set_last_gap(static_cast<float>(gap));
  ev_gap_last = gap;
  ev_checks += 1;
  if (gap > static_cast<double>(k.a_.event_gap_tol)) {
    st.disable();
    ev_disables += 1;
  }
  std::memcpy(y, ytmp, sizeof(float) * N);
  std::memcpy(st.x_ref(), xt, sizeof(float) * K);
  std::memcpy(st.y_cache(), ytmp, sizeof(float) * N);
  std::fill(st.age(), st.age() + k.nb_, 0.0f);
}

// ------------------------------------------------------------------ the steps of a call
bool GatingCall::threshold_fast_path() {
  const GatingAttrs& a = k.a_;
  if (k.stateful_ || !a.kwta || a.kwta_select != 0 || a.block != 1 || a.pack || a.kwta_renorm) return false;
  // One row: mask, indices and values in one pass over x, then the row-skipping matvec. Several
  // rows: the masked rows x~ in one vectorised pass each, then per-row matvecs or one dense product.
  const int64_t M = io.M, K = k.K_, N = k.N_;
  const float* X = io.X;
  float* Y = io.Y;
  const float* nrm = a.score_xw ? k.norms_.data() : nullptr;
  int64_t n_kept = 0;
  if (M == 1) {
    const int64_t n = gk.threshold_compress(X, nrm, a.kwta_threshold, K, idx, vals);
    if (n == K)
      matvec(X, nullptr, nullptr, 0, Y, false);
    else if (n == 0)
      std::fill(Y, Y + N, 0.0f);
    else
      matvec(nullptr, idx, vals, n, Y, false);
    n_kept = n;
  } else {
    for (int64_t r = 0; r < M; ++r) n_kept += gk.threshold_mask(X + r * K, nrm, a.kwta_threshold, K, XT + r * K);
    if (k.format_ != kWeightInt4K && per_row_wins(k.cost_, static_cast<double>(n_kept) / static_cast<double>(K), M)) {
      for (int64_t r = 0; r < M; ++r) {
        const int64_t n = gk.threshold_compress(X + r * K, nrm, a.kwta_threshold, K, idx, vals);
        if (n == 0)
          std::fill(Y + r * N, Y + (r + 1) * N, 0.0f);
        else
          matvec(nullptr, idx, vals, n, Y + r * N, false);
      }
    } else {
      dense_product(XT, M, Y);
      metrics::add(k.m_dense_rows_, static_cast<double>(M));
    }
  }
  metrics::add(k.m_calls_, 1.0);
  metrics::add(k.m_rows_, static_cast<double>(M));
  metrics::add(k.m_kept_, static_cast<double>(n_kept));
  metrics::add(k.m_chan_, static_cast<double>(M * K));
  metrics::set(k.m_keep_, static_cast<double>(n_kept) / static_cast<double>(M * K));
  return true;
}

void GatingCall::gate_rows(float* states) {
  const GatingAttrs& a = k.a_;
  const int64_t K = k.K_, N = k.N_, nb = k.nb_;
  for (int64_t b = 0; b < bt.B; ++b) {
    EventState st(states ? states + b * k.state_.size() : nullptr, k.state_);
    const bool running = states && st.initialised();
    for (int64_t t = 0; t < bt.T; ++t) {
      const int64_t r = b * bt.T + t;
      float* xt = XT + r * K;
      uint8_t* keep = keep_of(r);
      uint8_t* cand = cand_of(r);
      const int64_t step = running ? st.advance() : 0;
      const float* reuse = a.kwta && running && a.kwta_duty > 1 && step % a.kwta_duty != 0 ? st.kwta() : nullptr;
      const bool dense_row = !running && a.dense_prefill && bt.T > 1;
      nkeep[r] = gate(io.X + r * K, xt, keep, cand, reuse, dense_row);
      if (states && !reuse)
        for (int64_t q = 0; q < nb; ++q) st.kwta()[q] = keep[q] ? 1.0f : 0.0f;
      kept += static_cast<double>(nkeep[r]);
      chans += static_cast<double>(nb);
      if (a.event && running) {
        if (!st.disabled()) {
          event_row(xt, cand, st, step, io.Y + r * N);
          ev_enabled_last = st.disabled() ? 0.0 : 1.0;
        } else {
          gated_row(xt, keep, nkeep[r], io.Y + r * N);
          ev_enabled_last = 0.0;
        }
      } else {
        pending[r] = 1;
        ++npending;
        kept_frac_pending += static_cast<double>(nkeep[r]) / static_cast<double>(nb);
      }
    }
  }
}

void GatingCall::product_pending() {
  if (!npending) return;
  const int64_t M = io.M, K = k.K_, N = k.N_;
  // Row-skipping matvecs (read only each row's kept rows of W) when they cost less than one dense
  // product over x~ (same result: dropped channels are 0), see per_row_wins.
  if (npending == 1 || (k.format_ != kWeightInt4K && per_row_wins(k.cost_, kept_frac_pending, npending))) {
    for (int64_t r = 0; r < M; ++r)
      if (pending[r]) gated_row(XT + r * K, keep_of(r), nkeep[r], io.Y + r * N);
    return;
  }
  // contiguous runs of pending rows: product per run, split over the pool
  int64_t r = 0;
  while (r < M) {
    if (!pending[r]) {
      ++r;
      continue;
    }
    int64_t r1 = r;
    while (r1 < M && pending[r1]) ++r1;
    dense_product(XT + r * K, r1 - r, io.Y + r * N);
    metrics::add(k.m_dense_rows_, static_cast<double>(r1 - r));
    r = r1;
  }
}

void GatingCall::start_sequences(float* states) {
  const int64_t K = k.K_, N = k.N_;
  for (int64_t b = 0; b < bt.B; ++b) {
    const int64_t r = b * bt.T + bt.T - 1;
    if (!pending[r]) continue;
    EventState st(states + b * k.state_.size(), k.state_);
    if (st.initialised()) continue;  // a running sequence whose last row was pending: event mode is off
    st.start(XT + r * K, io.Y + r * N);
  }
}

void GatingCall::publish_metrics() const {
  const GatingAttrs& a = k.a_;
  metrics::add(k.m_calls_, 1.0);
  metrics::add(k.m_rows_, static_cast<double>(io.M));
  if (a.kwta) {
    metrics::add(k.m_kept_, kept);
    metrics::add(k.m_chan_, chans);
    metrics::set(k.m_keep_, chans > 0 ? kept / chans : 1.0);
    if (duty_hits) metrics::add(k.m_duty_, duty_hits);
  }
  if (a.pack && density_rows > 0) {
    metrics::set(k.m_density_, density_sum / density_rows);
    metrics::set(k.m_active_, active / density_rows);
    if (pack_dense) metrics::add(k.m_pack_dense_, pack_dense);
  }
  if (a.event) {
    if (ev_enabled_last >= 0) metrics::set(k.m_ev_enabled_, ev_enabled_last);
    if (ev_ms) metrics::add(k.m_ev_ms_, ev_ms);
    if (ev_quorum) metrics::add(k.m_ev_quorum_, ev_quorum);
    if (ev_topk_last >= 0) metrics::set(k.m_ev_topk_, ev_topk_last);
    if (ev_stale_last >= 0) metrics::set(k.m_ev_stale_, ev_stale_last);
    if (ev_gap_last >= 0) metrics::set(k.m_ev_gap_, ev_gap_last);
    if (ev_checks) metrics::add(k.m_ev_checks_, ev_checks);
    if (ev_disables) metrics::add(k.m_ev_disables_, ev_disables);
    if (ev_rows) metrics::add(k.m_ev_rows_, ev_rows);
  }
}

// ------------------------------------------------------------------ construction
namespace {

// A constant initializer input's shape, or an error when it is absent.
std::vector<int64_t> const_shape(const Ort::ConstValue& v) { return v.GetTensorTypeAndShapeInfo().GetShape(); }

std::string dims_str(int64_t a, int64_t b) { return "[" + std::to_string(a) + ", " + std::to_string(b) + "]"; }

}  // namespace

// The weight inputs of the node's weight_format: W (f32) or Wq, scales, [zero_points] (int8 | int4,
// kernels/qgating.h), all constant initializers; sets K_, N_, format_, W_ / q_ and the cost model.
void EventGatedMatMulKernel::read_weights(const Ort::ConstKernelInfo& info, const Attrs& at) {
  std::string fmt;
  int64_t group = 32;
  at.read({{"weight_format", &fmt}, {"weight_group", &group}});
  format_ = fmt == "int8" ? kWeightInt8 : fmt == "int4" ? kWeightInt4 : fmt == "int4k" ? kWeightInt4K : kWeightF32;
  if (group & (group - 1)) fail("attribute weight_group must be a power of two in [16, 1024], got " + std::to_string(group));
  if (format_ == kWeightF32) {
    if (input_present(info, 3) || input_present(info, 4) || input_present(info, 5))
      fail("inputs Wq, scales, zero_points are for weight_format int8 | int4; this node is f32 (input W)");
    Ort::ConstValue wv = const_input(info, 1, "W", kF32);
    const auto shp = const_shape(wv);
    if (shp.size() != 2 || shp[0] < 1 || shp[1] < 1) fail("input W must be 2-D [K, N], got " + shape_str(shp));
    if (shp[0] > kMaxDim || shp[1] > kMaxDim) fail("input W too large " + shape_str(shp));
    K_ = shp[0];
    N_ = shp[1];
    W_ = wv.GetTensorData<float>();
    cost_ = kF32Cost;
    return;
  }
  if (input_present(info, 1)) fail("weight_format " + fmt + " takes Wq, scales, [zero_points], not input W");
  if (!at.given("weight_shape")) fail("weight_format " + fmt + " needs attribute weight_shape [K, N]");
  const std::vector<int64_t>& ws = at.ints("weight_shape");
  if (ws.size() != 2) fail("attribute weight_shape must be [K, N], got " + shape_str(ws));
  K_ = ws[0];
  N_ = ws[1];
  if (format_ == kWeightInt4K) {
    read_int4k(info, group);
    return;
  }
  QuantRows& q = q_;
  q.format = format_;
  q.N = N_;
  q.group = group;
  q.group_shift = 0;
  while ((int64_t{1} << q.group_shift) < group) ++q.group_shift;
  q.groups = (N_ + group - 1) / group;
  q.row_bytes = format_ == kWeightInt8 ? N_ : Int4Rows::kBytesPerChunk * ((N_ + Int4Rows::kOutputsPerChunk - 1) / Int4Rows::kOutputsPerChunk);
  Ort::ConstValue dv = const_input(info, 3, "Wq", kU8);
  if (const_shape(dv) != std::vector<int64_t>{K_, q.row_bytes})
    fail("input Wq has shape " + shape_str(const_shape(dv)) + ", expected " + dims_str(K_, q.row_bytes) + " for " + fmt +
         " weight_shape " + dims_str(K_, N_));
  q.data = dv.GetTensorData<uint8_t>();
  Ort::ConstValue sv = const_input(info, 4, "scales", kF32);
  if (const_shape(sv) != std::vector<int64_t>{K_, q.groups})
    fail("input scales has shape " + shape_str(const_shape(sv)) + ", expected " + dims_str(K_, q.groups) +
         " (ceil(N / weight_group))");
  q.scales = sv.GetTensorData<float>();
  for (int64_t i = 0; i < K_ * q.groups; ++i)
    if (!std::isfinite(q.scales[i])) fail("input scales holds a non-finite value at " + std::to_string(i));
  q.zeros = nullptr;
  if (input_present(info, 5)) {
    if (format_ != kWeightInt4) fail("input zero_points is for weight_format int4 only (int8 is symmetric)");
    Ort::ConstValue zv = const_input(info, 5, "zero_points", kU8);
    if (const_shape(zv) != std::vector<int64_t>{K_, q.groups})
      fail("input zero_points has shape " + shape_str(const_shape(zv)) + ", expected " + dims_str(K_, q.groups));
    q.zeros = zv.GetTensorData<uint8_t>();
    for (int64_t i = 0; i < K_ * q.groups; ++i)
      if (q.zeros[i] > 15) fail("input zero_points must be in [0, 15], got " + std::to_string(q.zeros[i]));
  }
  cost_ = kQuantCost;
}

// int4k: Wq [ceil(K / 2), 32 * ceil(N / 32)], scales [ceil(K / group), N], no zero points.
void EventGatedMatMulKernel::read_int4k(const Ort::ConstKernelInfo& info, int64_t group) {
  if (group != 16 && group != 32)
    fail("weight_format int4k needs attribute weight_group 16 or 32 (int16 group sums), got " + std::to_string(group));
  if (input_present(info, 5)) fail("input zero_points is for weight_format int4 only (int4k is symmetric)");
  KQuantRows& q = kq_;
  q.K = K_;
  q.N = N_;
  q.group = group;
  q.pair_shift = group == 16 ? 3 : 4;
  q.groups = (K_ + group - 1) / group;
  q.row_bytes = Int4KPairs::kCols * ((N_ + Int4KPairs::kCols - 1) / Int4KPairs::kCols);
  const int64_t P = (K_ + 1) / 2;
  Ort::ConstValue dv = const_input(info, 3, "Wq", kU8);
  if (const_shape(dv) != std::vector<int64_t>{P, q.row_bytes})
    fail("input Wq has shape " + shape_str(const_shape(dv)) + ", expected " + dims_str(P, q.row_bytes) +
         " for int4k weight_shape " + dims_str(K_, N_) + " ([ceil(K/2), 32*ceil(N/32)])");
  q.data = dv.GetTensorData<uint8_t>();
  Ort::ConstValue sv = const_input(info, 4, "scales", kF32);
  if (const_shape(sv) != std::vector<int64_t>{q.groups, N_})
    fail("input scales has shape " + shape_str(const_shape(sv)) + ", expected " + dims_str(q.groups, N_) +
         " (int4k: [ceil(K / weight_group), N])");
  q.scales = sv.GetTensorData<float>();
  for (int64_t i = 0; i < q.groups * N_; ++i)
    if (!std::isfinite(q.scales[i])) fail("input scales holds a non-finite value at " + std::to_string(i));
  cost_ = kInt4KCost;
}

EventGatedMatMulKernel::EventGatedMatMulKernel(const Ort::ConstKernelInfo& info) : OpKernel(info) {
  const Attrs at(info, kAttrs);
  GatingAttrs& a = a_;
  std::string pack, sel, score;
  at.read({{"block", &a.block}, {"pack", &pack}, {"pack_eps", &a.pack_eps}, {"pack_rho", &a.pack_rho}});
  at.read({{"kwta", &a.kwta}, {"kwta_select", &sel}, {"kwta_score", &score}, {"kwta_threshold", &a.kwta_threshold},
           {"kwta_k", &a.kwta_k}, {"kwta_mass", &a.kwta_mass}, {"kwta_temp", &a.kwta_temp},
           {"kwta_duty", &a.kwta_duty}, {"kwta_renorm", &a.kwta_renorm}});
  at.read({{"event", &a.event}, {"event_topk", &a.event_topk}, {"event_quorum", &a.event_quorum},
           {"event_theta", &a.event_theta}, {"event_budget_ms", &a.event_budget_ms},
           {"event_gap_tol", &a.event_gap_tol}, {"event_gap_every", &a.event_gap_every},
           {"event_beta", &a.event_beta}, {"event_lambda", &a.event_lambda}, {"event_age_max", &a.event_age_max}});
  at.read({{"dense_prefill", &a.dense_prefill}});
  a.pack = pack == "binary" ? 1 : pack == "ternary" ? 2 : 0;
  a.kwta_select = sel == "topk" ? 1 : sel == "mass" ? 2 : 0;
  a.score_xw = score == "xw";
  if (a.kwta && a.kwta_select == 2 && !(a.kwta_temp > 0.0f)) fail("kwta_select 'mass' needs kwta_temp > 0");

  read_weights(info, at);
  // a block wider than the layer is one block over all K inputs (the rewriter's --kwta-block may
  // exceed a small layer); beyond 2^31 - 1 the block count arithmetic would overflow
  if (a.block > kMaxDim) fail("attribute block must be <= 2147483647, got " + std::to_string(a.block));
  nb_ = (K_ + a.block - 1) / a.block;
  if (a.kwta_k > nb_ || (a.kwta && a.kwta_select == 1 && a.kwta_k < 1))
    fail("attribute kwta_k must be <= the number of blocks (" + std::to_string(nb_) + ") and >= 1 for kwta_select " +
         "'topk', got " + std::to_string(a.kwta_k));
  state_ = EventStateLayout{K_, N_, nb_};
  stateful_ = a.event || a.kwta_duty > 1;
  gemm_ = &gemm_kernels();
  gk_ = &pick(IsaTables<GatingKernels>{gating_kernels_scalar, gating_kernels_avx2, gating_kernels_avx512});
  qk_ = &pick(IsaTables<QGatingKernels>{qgating_kernels_scalar, qgating_kernels_avx2, qgating_kernels_avx512});
  iota_.resize(static_cast<size_t>(K_));
  for (int64_t j = 0; j < K_; ++j) iota_[static_cast<size_t>(j)] = static_cast<int32_t>(j);
  // ||W_k|| per row (of the dequantized rows for a quantized format: the weights the op multiplies)
  norms_.resize(static_cast<size_t>(K_));
  std::vector<float> deq(format_ == kWeightF32 ? 0 : static_cast<size_t>(N_));
  for (int64_t j = 0; j < K_; ++j) {
    double s = 0;
    const float* r = W_ ? W_ + j * N_ : deq.data();
    if (format_ == kWeightInt4K)
      qk_->kdequant(&kq_, j, 1, 0, N_, deq.data(), N_);
    else if (!W_)
      qk_->dequant(&q_, j, 1, 0, N_, deq.data(), N_);
    for (int64_t o = 0; o < N_; ++o) s += static_cast<double>(r[o]) * r[o];
    norms_.data()[j] = static_cast<float>(std::sqrt(s));
  }

  metrics::Node* m = metrics::node(name_);
  m->set({{"kwta.enabled", a.kwta ? 1.0 : 0.0},
          {"kwta.temp", a.kwta_temp},
          {"kwta.duty", static_cast<double>(a.kwta_duty)},
          {"kwta.threshold", a.kwta_threshold},
          {"pack.enabled", a.pack ? 1.0 : 0.0},
          {"pack.mode", static_cast<double>(a.pack)},
          {"event.enabled", a.event ? 1.0 : 0.0}});
  m->gauges({{&m_keep_, "kwta.keep_ratio"}, {&m_density_, "pack.density"}, {&m_active_, "pack.active"},
             {&m_ev_enabled_, "event.enabled"}, {&m_ev_topk_, "event.topk_kept"}, {&m_ev_gap_, "event.quality_gap"},
             {&m_ev_stale_, "event.stale_pct"}});
  m->counters({{&m_duty_, "kwta.duty_hits"}, {&m_kept_, "kwta.kept_channels"}, {&m_chan_, "kwta.channels"},
               {&m_pack_dense_, "pack.dense_rows"}, {&m_ev_ms_, "event.budget_ms_used"},
               {&m_ev_quorum_, "event.quorum_hits"}, {&m_ev_disables_, "event.disables"},
               {&m_ev_checks_, "event.gap_checks"}, {&m_ev_rows_, "event.rows"}, {&m_calls_, "gate.calls"},
               {&m_rows_, "gate.rows"},
               {&m_dense_rows_, "gate.dense_product_rows"}});  // rows computed by one dense product over x~
}

// ------------------------------------------------------------------ compute
namespace {

// The state rows of a stateful node, [B, S]: present_event (or a scratch copy when that output is
// not wired) initialised from past_event, or zeros for new sequences. nullptr when stateless.
float* bind_state(Ort::KernelContext& ctx, bool stateful, int64_t B, int64_t S, std::vector<float>& local) {
  const float* st_in = nullptr;
  if (ctx.GetInputCount() > 2) {
    Ort::ConstValue sv = ctx.GetInput(2);
    if (sv) {
      const auto ss = sv.GetTensorTypeAndShapeInfo().GetShape();
      int64_t numel = 1;
      for (auto d : ss) numel *= d;
      if (numel > 0) {
        if (!stateful) fail("a non-empty state was given but the node is stateless (no event mode, kwta_duty = 1)");
        if (ss.size() != 2 || ss[0] != B || ss[1] != S)
          fail("state input has shape " + shape_str(ss) + ", expected [" + std::to_string(B) + ", " +
               std::to_string(S) + "] ([batch, 8 + K + N + 2*blocks]) or an empty [batch, 0] for a new sequence");
        st_in = sv.GetTensorData<float>();
      }
    }
  }
  float* st_out = nullptr;
  if (ctx.GetOutputCount() > 1) {
    const int64_t sdims[2] = {B, stateful ? S : 0};
    Ort::UnownedValue so = ctx.GetOutput(1, sdims, 2);
    if (stateful) st_out = so.GetTensorMutableData<float>();
  }
  if (!stateful) return nullptr;
  if (!st_out) {  // state output not wired: work on a scratch copy
    local.resize(static_cast<size_t>(B * S));
    st_out = local.data();
  }
  if (st_in)
    std::memcpy(st_out, st_in, sizeof(float) * static_cast<size_t>(B * S));
  else
    std::fill(st_out, st_out + B * S, 0.0f);
  return st_out;
}

}  // namespace

void EventGatedMatMulKernel::Compute(Ort::KernelContext& ctx) const {
  const RowsIO io = rows_io(ctx, K_, N_);
  const Batch bt = batch_of(io);
  std::vector<float> local_state;
  float* states = bind_state(ctx, stateful_, bt.B, state_.size(), local_state);
  if (io.M == 0) {
    metrics::add(m_calls_, 1.0);
    return;
  }
  GatingCall c(*this, ctx, io, bt);
  if (c.threshold_fast_path()) return;
  c.gate_rows(states);
  c.product_pending();
  if (states) c.start_sequences(states);
  c.publish_metrics();
}

}  // namespace ortlean
