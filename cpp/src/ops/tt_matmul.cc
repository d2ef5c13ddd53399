#include "ops/tt_matmul.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "blas.h"
#include "isa.h"
#include "parallel.h"

namespace ortlean {
namespace {

// Work (multiply-adds) per ParallelFor task: a task should run a few microseconds so ORT's
// dispatch cost stays small. Matvec steps are memory-bound: ~64K weights per task.
constexpr int64_t kGrainMatvec = 64 * 1024;
constexpr int64_t kGrainRows = 256 * 1024;
constexpr int64_t kMaxTasks = 16;
constexpr int64_t kMaxChunkRows = 48;
constexpr int64_t kNarrowCols = 16;      // below this many columns a step runs transposed    // rows per task in the M > 1 path
constexpr int64_t kMatvecMinCols = 128;  // narrowest column block of a matvec task
// With the scalar kernel table, products at least this big (and with >= 8 rows) go to OpenBLAS.
// With AVX2/AVX-512 our register-blocked kernels are used throughout: measured ~2-3x faster than
// scipy-openblas32 here for these shapes (its DYNAMIC_ARCH picks Haswell kernels on AMD Zen and
// the row chunks are small).
constexpr int64_t kBlasMinWork = 64 * 1024;
constexpr int64_t kBlasMinRows = 8;

int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  if (a > 0 && b > kMaxDim / a) fail(std::string("TTMatMul: ") + what + " too large");
  return a * b;
}

TTPlan make_plan(std::vector<int64_t> mk, std::vector<int64_t> mn, std::vector<int64_t> ranks) {
  TTPlan p;
  const size_t d = mk.size();
  if (d < 2 || d > 4) fail("modes_k must have 2..4 entries (d), got " + std::to_string(d));
  if (mn.size() != d)
    fail("modes_n has " + std::to_string(mn.size()) + " entries, modes_k has " + std::to_string(d));
  if (ranks.size() != d + 1)
    fail("ranks must have d+1 = " + std::to_string(d + 1) + " entries, got " + std::to_string(ranks.size()) + " " +
         shape_str(ranks));
  if (ranks.front() != 1 || ranks.back() != 1) fail("ranks must start and end with 1, got " + shape_str(ranks));
  p.d = static_cast<int>(d);
  p.K = 1;
  p.N = 1;
  for (size_t i = 0; i < d; ++i) {
    p.K = checked_mul(p.K, mk[i], "prod(modes_k)");
    p.N = checked_mul(p.N, mn[i], "prod(modes_n)");
  }
  p.mk = std::move(mk);
  p.mn = std::move(mn);
  p.ranks = std::move(ranks);
  int64_t P = 1;
  p.max_state = std::max(p.K, p.N);
  for (int i = 0; i < p.d; ++i) {
    TTPlan::Step s;
    s.P = P;
    s.r0 = p.ranks[i];
    s.k = p.mk[i];
    s.n = p.mn[i];
    s.r1 = p.ranks[i + 1];
    s.jr = 1;
    for (int j = i + 1; j < p.d; ++j) s.jr *= p.mk[j];
    s.inner = checked_mul(s.r0, s.k, "core");
    s.rows = checked_mul(s.n, s.r1, "core");
    checked_mul(s.inner, s.rows, "core");
    const int64_t in = checked_mul(checked_mul(s.P, s.inner, "state"), s.jr, "state");
    const int64_t out = checked_mul(checked_mul(s.P, s.rows, "state"), s.jr, "state");
    p.max_state = std::max({p.max_state, in, out});
    p.steps.push_back(s);
    P *= s.n;
  }
  p.lowrank = p.d == 2 && p.mk[1] == 1 && p.mn[0] == 1;
  return p;
}

// ------------------------------------------------------------------ per-call compute pieces
struct Call {
  const TTPlan* plan;
  const GemmKernels* kr;
  TTMatMulKernel::CoreRef cores[4];
  const float* scale;  // nullptr when absent
  bool blas;           // products go to OpenBLAS when big enough (only with the scalar kernels)
};

// C[M,N] = A[M,K] . B[K,N], row-major; OpenBLAS for big products, our kernels otherwise.
inline bool use_blas(const Call& c, int64_t M, int64_t N, int64_t K) {
  return c.blas && M >= kBlasMinRows && M * N * K >= kBlasMinWork;
}

inline void gemm_nn(const Call& c, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                    int64_t ldb, float* C, int64_t ldc) {
  if (use_blas(c, M, N, K))
    blas::sgemm(false, false, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc);
  else
    c.kr->sgemm_nn(M, N, K, A, lda, B, ldb, C, ldc);
}

// Step s of the chain on the output region p in [p0, p1), q in [q0, q1) (q indexes (n, r1)).
// in: [P, inner, cols], out: [P, rows, cols], cols = jr * mb (the mb rows innermost).
void step_region(const Call& c, int s, const float* in, float* out, int64_t mb, int64_t p0, int64_t p1, int64_t q0,
                 int64_t q1) {
  const TTPlan::Step& st = c.plan->steps[static_cast<size_t>(s)];
  const int64_t cols = st.jr * mb;
  const TTMatMulKernel::CoreRef& core = c.cores[s];
  if (p1 <= p0 || q1 <= q0) return;
  if (cols == 1) {
    // out[p, q] = sum_t in[p, t] cm[t, q]: one product with P rows
    gemm_nn(c, p1 - p0, q1 - q0, st.inner, in + p0 * st.inner, st.inner, core.cm + q0, st.rows,
            out + p0 * st.rows + q0, st.rows);
    return;
  }
  const int64_t nq = q1 - q0;
  const bool blas = use_blas(c, nq, cols, st.inner);
  if (!blas && cols < kNarrowCols && nq >= 2 * kNarrowCols) {
    // few columns (e.g. jr * mb = 9): vectors would be mostly masked; compute the transposed
    // product out_p^T [cols, nq] = in_p^T [cols, inner] . cm[:, q0:q1] instead (wide in q)
    float* tin = gemm_scratch().get(static_cast<size_t>(cols * (st.inner + nq)));
    float* tout = tin + cols * st.inner;
    for (int64_t p = p0; p < p1; ++p) {
      const float* ip = in + p * st.inner * cols;
      float* op = out + p * st.rows * cols + q0 * cols;
      c.kr->transpose(ip, cols, tin, st.inner, st.inner, cols, nullptr);
      c.kr->sgemm_nn(cols, nq, st.inner, tin, st.inner, core.cm + q0, st.rows, tout, nq);
      c.kr->transpose(tout, nq, op, cols, cols, nq, nullptr);
    }
    return;
  }
  for (int64_t p = p0; p < p1; ++p) {
    const float* ip = in + p * st.inner * cols;
    float* op = out + p * st.rows * cols + q0 * cols;
    if (blas)
      blas::sgemm(true, false, nq, cols, st.inner, 1.0f, core.cm + q0, st.rows, ip, cols, 0.0f, op, cols);
    else
      c.kr->sgemm_nn(nq, cols, st.inner, core.cmt + q0 * st.inner, st.inner, ip, cols, op, cols);
  }
}

// The whole chain for mb consecutive rows X [mb, K] -> Y [mb, N], sequentially.
// scratch: 2 * max_state * mb floats.
void run_chunk(const Call& c, const float* X, float* Y, int64_t mb, float* scratch) {
  const TTPlan& p = *c.plan;
  float* bufs[2] = {scratch, scratch + p.max_state * mb};
  const float* in;
  if (mb == 1) {
    if (c.scale) {
      c.kr->scale(X, c.scale, bufs[0], p.K);
      in = bufs[0];
    } else {
      in = X;
    }
  } else {
    c.kr->transpose(X, p.K, bufs[0], mb, mb, p.K, c.scale);  // [K, mb]
    in = bufs[0];
  }
  int cur = 1;
  for (int s = 0; s < p.d; ++s) {
    const TTPlan::Step& st = p.steps[static_cast<size_t>(s)];
    float* out = (s == p.d - 1 && mb == 1) ? Y : bufs[cur];
    step_region(c, s, in, out, mb, 0, st.P, 0, st.rows);
    in = out;
    cur ^= 1;
  }
  if (mb > 1) c.kr->transpose(in, mb, Y, p.N, p.N, mb, nullptr);  // [N, mb] -> [mb, N]
}

// Low rank W = A B (A [K, r], B [r, N]) for mb rows, row-major. scratch: mb*r (+ mb*K with scale).
void run_lowrank_chunk(const Call& c, const float* X, float* Y, int64_t mb, float* scratch) {
  const TTPlan& p = *c.plan;
  const int64_t r = p.ranks[1];
  float* t = scratch;
  const float* xs = X;
  if (c.scale) {
    float* xb = scratch + round_up16(static_cast<size_t>(mb * r));
    for (int64_t i = 0; i < mb; ++i) c.kr->scale(X + i * p.K, c.scale, xb + i * p.K, p.K);
    xs = xb;
  }
  gemm_nn(c, mb, r, p.K, xs, p.K, c.cores[0].cm, r, t, r);
  gemm_nn(c, mb, p.N, r, t, r, c.cores[1].cm, p.N, Y, p.N);
}

// Scalar double-precision recompute of one row (non-finite guard), from the stored cores.
void row_double(const Call& c, const float* x, float* y) {
  const TTPlan& p = *c.plan;
  std::vector<double> a(static_cast<size_t>(p.max_state)), b(static_cast<size_t>(p.max_state));
  for (int64_t j = 0; j < p.K; ++j) a[j] = static_cast<double>(x[j]) * (c.scale ? static_cast<double>(c.scale[j]) : 1.0);
  for (int s = 0; s < p.d; ++s) {
    const TTPlan::Step& st = p.steps[static_cast<size_t>(s)];
    const float* cm = c.cores[s].cm;  // [r0, k, n, r1]
    std::fill(b.begin(), b.begin() + st.P * st.rows * st.jr, 0.0);
    for (int64_t pp = 0; pp < st.P; ++pp)
      for (int64_t ra = 0; ra < st.r0; ++ra)
        for (int64_t j = 0; j < st.k; ++j) {
          const double* in = &a[((pp * st.r0 + ra) * st.k + j) * st.jr];
          const float* g = cm + (ra * st.k + j) * st.rows;
          for (int64_t q = 0; q < st.rows; ++q) {
            const double w = g[q];
            double* out = &b[(pp * st.rows + q) * st.jr];
            for (int64_t J = 0; J < st.jr; ++J) out[J] += in[J] * w;
          }
        }
    a.swap(b);
  }
  for (int64_t o = 0; o < p.N; ++o) y[o] = static_cast<float>(a[o]);
}

// Non-finite guard over rows [m0, m1): returns the number of rows recomputed.
int64_t guard_rows(const Call& c, const float* X, float* Y, int64_t m0, int64_t m1, bool scale_finite) {
  const TTPlan& p = *c.plan;
  int64_t n = 0;
  for (int64_t m = m0; m < m1; ++m) {
    float* y = Y + m * p.N;
    if (c.kr->all_finite(y, p.N)) continue;
    const float* x = X + m * p.K;
    if (!scale_finite || !c.kr->all_finite(x, p.K)) continue;
    row_double(c, x, y);
    ++n;
  }
  return n;
}

// One row: the chain step by step, each step's matvec split over the pool (memory-bound). work:
// 2 * max_state + kMaxTasks * max(rows) floats. Returns the rows recomputed by the guard.
int64_t matvec_chain(const Ort::KernelContext& ctx, const Call& c, const float* X, float* Y, float* work,
                     bool scale_finite) {
  const TTPlan& p = *c.plan;
  float* bufs[2] = {work, work + p.max_state};
  float* partial = work + round_up16(static_cast<size_t>(2 * p.max_state));
  const float* in = X;
  if (c.scale) {
    c.kr->scale(X, c.scale, bufs[0], p.K);
    in = bufs[0];
  }
  int cur = 1;
  for (int s = 0; s < p.d; ++s) {
    const TTPlan::Step& st = p.steps[static_cast<size_t>(s)];
    float* out = s == p.d - 1 ? Y : bufs[cur];
    const int64_t work = st.P * st.rows * st.inner * st.jr;
    const int64_t ntasks = std::max<int64_t>(1, std::min<int64_t>(kMaxTasks, work / kGrainMatvec));
    if (ntasks > 1 && st.P == 1 && st.jr == 1 && st.rows < ntasks * kMatvecMinCols) {
      // tall-skinny matvec (K large, few outputs): split the reduction, sum the partials
      const int64_t kchunk = static_cast<int64_t>(round_up16(static_cast<size_t>((st.inner + ntasks - 1) / ntasks)));
      const int64_t nt = (st.inner + kchunk - 1) / kchunk;
      const float* cm = c.cores[s].cm;
      auto task = [&](size_t t) noexcept {
        const int64_t k0 = static_cast<int64_t>(t) * kchunk;
        const int64_t kl = std::min(kchunk, st.inner - k0);
        c.kr->sgemm_nn(1, st.rows, kl, in + k0, st.inner, cm + k0 * st.rows, st.rows, partial + t * st.rows, st.rows);
      };
      parallel_for(ctx, static_cast<size_t>(nt), task);
      for (int64_t q = 0; q < st.rows; ++q) {
        float acc = partial[q];
        for (int64_t t = 1; t < nt; ++t) acc += partial[t * st.rows + q];
        out[q] = acc;
      }
    } else {
      // split P when there are enough blocks, else the (n, r1) outputs in wide column blocks
      const bool split_p = st.P >= ntasks;
      const int64_t qchunk =
          split_p ? st.rows : std::max<int64_t>(kMatvecMinCols, ((st.rows + ntasks - 1) / ntasks + 63) / 64 * 64);
      const int64_t pchunk = split_p ? (st.P + ntasks - 1) / ntasks : st.P;
      const int64_t nt = split_p ? (st.P + pchunk - 1) / pchunk : (st.rows + qchunk - 1) / qchunk;
      auto task = [&](size_t t) noexcept {
        const int64_t ti = static_cast<int64_t>(t);
        if (split_p)
          step_region(c, s, in, out, 1, ti * pchunk, std::min(st.P, (ti + 1) * pchunk), 0, st.rows);
        else
          step_region(c, s, in, out, 1, 0, st.P, ti * qchunk, std::min(st.rows, (ti + 1) * qchunk));
      };
      parallel_for(ctx, static_cast<size_t>(nt), task);
    }
    in = out;
    cur ^= 1;
  }
  return guard_rows(c, X, Y, 0, 1, scale_finite);
}

// Several rows: chunks of rows across the pool, each chunk runs the whole chain. Returns the rows
// recomputed by the guard.
int64_t row_chunks(const Ort::KernelContext& ctx, const Call& c, const float* X, float* Y, int64_t M,
                   bool scale_finite) {
  const TTPlan& p = *c.plan;
  int64_t per_row = 0;
  for (const auto& st : p.steps) per_row += st.P * st.rows * st.inner * st.jr;
  const int64_t ntasks0 = std::max<int64_t>(1, std::min<int64_t>({kMaxTasks, M, M * per_row / kGrainRows}));
  // chunks of a multiple of 6 rows (the register block height of the kernels)
  // (capped: bounded scratch and cache-resident blocks for long prefills; more tasks is fine)
  int64_t mb = std::min<int64_t>(((M + ntasks0 - 1) / ntasks0 + 5) / 6 * 6, kMaxChunkRows);
  if (c.blas) mb = std::max<int64_t>(mb, 48);  // OpenBLAS wants taller blocks
  mb = std::min(M, mb);
  const int64_t nt = (M + mb - 1) / mb;
  const int64_t r = p.ranks[1];
  std::atomic<int64_t> recomputed{0};
  std::atomic<bool> oom{false};
  auto task = [&](size_t t) noexcept {
    const int64_t m0 = static_cast<int64_t>(t) * mb;
    const int64_t rows = std::min(mb, M - m0);
    float* scratch;
    try {
      scratch = task_scratch().get(p.lowrank ? round_up16(static_cast<size_t>(rows * r)) +
                                                   (c.scale ? static_cast<size_t>(rows * p.K) : 0)
                                             : static_cast<size_t>(2 * p.max_state * rows));
    } catch (...) {
      oom = true;
      return;
    }
    if (p.lowrank)
      run_lowrank_chunk(c, X + m0 * p.K, Y + m0 * p.N, rows, scratch);
    else
      run_chunk(c, X + m0 * p.K, Y + m0 * p.N, rows, scratch);
    const int64_t n = guard_rows(c, X, Y, m0, m0 + rows, scale_finite);
    if (n) recomputed += n;
  };
  parallel_for(ctx, static_cast<size_t>(nt), task);
  if (oom) throw std::bad_alloc();
  return recomputed.load();
}

}  // namespace

// ------------------------------------------------------------------ construction
TTMatMulKernel::TTMatMulKernel(const Ort::ConstKernelInfo& info) : OpKernel(info) {
  const Attrs at(info, kAttrs);
  plan_ = make_plan(at.ints("modes_k"), at.ints("modes_n"), at.ints("ranks"));
  const TTPlan& p = plan_;

  // inputs: X, G1..G4 (G_{d+1}.. absent), x_scale
  auto present = [&](size_t i) { return input_present(info, i); };
  for (int i = 0; i < 4; ++i) {
    const bool want = i < p.d;
    if (want && !present(1 + i))
      fail("core G" + std::to_string(i + 1) + " (input " + std::to_string(1 + i) + ") is missing; d = " +
           std::to_string(p.d) + " from modes_k");
    if (!want && present(1 + i))
      fail("input G" + std::to_string(i + 1) + " is given but d = " + std::to_string(p.d) +
           " (len(modes_k)); unused cores must be the empty name");
  }
  has_scale_ = present(5);

  for (int i = 0; i < p.d; ++i) {
    const std::vector<int64_t> want = {p.ranks[i], p.mk[i], p.mn[i], p.ranks[i + 1]};
    // static shape of the graph input / initializer (dims < 0 are symbolic)
    {
      auto ti = info.GetInputTypeInfo(1 + i);
      if (ti.GetONNXType() == ONNX_TYPE_TENSOR) {
        auto tsi = ti.GetTensorTypeAndShapeInfo();
        if (tsi.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
          fail("core G" + std::to_string(i + 1) + " must be float32");
        auto shp = tsi.GetShape();
        bool ok = shp.size() == 4;
        for (size_t j = 0; ok && j < 4; ++j) ok = shp[j] < 0 || shp[j] == want[j];
        if (!ok && !shp.empty())
          fail("core G" + std::to_string(i + 1) + " has shape " + shape_str(shp) + ", expected " + shape_str(want) +
               " = [r" + std::to_string(i) + ", k" + std::to_string(i + 1) + ", n" + std::to_string(i + 1) + ", r" +
               std::to_string(i + 1) + "] from modes_k/modes_n/ranks");
      }
    }
    int is_const = 0;
    Ort::ConstValue v = info.GetTensorConstantInput(1 + i, &is_const);
    if (!is_const) continue;
    auto tsi = v.GetTensorTypeAndShapeInfo();
    if (tsi.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
      fail("core G" + std::to_string(i + 1) + " must be float32");
    const auto shp = tsi.GetShape();
    if (shp != want)
      fail("core G" + std::to_string(i + 1) + " has shape " + shape_str(shp) + ", expected " + shape_str(want) +
           " from modes_k/modes_n/ranks");
    const TTPlan::Step& st = p.steps[static_cast<size_t>(i)];
    const float* src = v.GetTensorData<float>();
    cm_[i].resize(static_cast<size_t>(st.inner * st.rows));
    std::memcpy(cm_[i].data(), src, sizeof(float) * cm_[i].size());
    if (!p.lowrank) {
      cmt_[i].resize(cm_[i].size());
      for (int64_t t = 0; t < st.inner; ++t)
        for (int64_t q = 0; q < st.rows; ++q) cmt_[i].data()[q * st.inner + t] = src[t * st.rows + q];
    }
    core_const_[i] = true;
  }
  if (has_scale_) {
    int is_const = 0;
    Ort::ConstValue v = info.GetTensorConstantInput(5, &is_const);
    if (is_const) {
      auto tsi = v.GetTensorTypeAndShapeInfo();
      if (tsi.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) fail("x_scale must be float32");
      const auto shp = tsi.GetShape();
      if (shp != std::vector<int64_t>{p.K})
        fail("x_scale has shape " + shape_str(shp) + ", expected [" + std::to_string(p.K) + "] (prod(modes_k))");
      scale_.resize(static_cast<size_t>(p.K));
      std::memcpy(scale_.data(), v.GetTensorData<float>(), sizeof(float) * p.K);
      scale_const_ = true;
    }
  }

  // metadata attributes (optional for the kernel)
  const float gap = at.f("gap"), speedup = at.f("speedup");
  int64_t params_stored = 0;
  for (int i = 0; i < p.d; ++i) params_stored += p.core_size(i);
  int64_t params_dense = p.K * p.N;  // derived defaults when absent
  at.read({{"params_dense", &params_dense}, {"params_stored", &params_stored}});

  metrics::Node* m = metrics::node(name_);
  const double mem_saved =
      params_dense > 0 ? 1.0 - static_cast<double>(params_stored) / static_cast<double>(params_dense) : 0.0;
  m->set({{"tt.enabled", 1.0},
          {"tt.rank", static_cast<double>(*std::max_element(p.ranks.begin(), p.ranks.end()))},
          {"tt.gap", float_attr_value(gap)},
          {"tt.speedup", float_attr_value(speedup)},
          {"tt.mem_saved", mem_saved}});
  m->counters({{&m_calls_, "tt.calls"}, {&m_rows_, "tt.rows"}, {&m_nonfinite_, "tt.nonfinite_recomputes"}});
}

// ------------------------------------------------------------------ compute
void TTMatMulKernel::Compute(Ort::KernelContext& ctx) const {
  const TTPlan& p = plan_;
  Call c;
  c.plan = &p;
  c.kr = &gemm_kernels();
  c.blas = isa() == Isa::Scalar;

  const RowsIO io = rows_io(ctx, p.K, p.N);
  const int64_t M = io.M;
  const float* X = io.X;
  float* Y = io.Y;

  // cores / scale: prepacked constants, or read from the inputs (validated, packed per call)
  size_t outer_need = 0;
  const float* dyn_cm[4] = {nullptr, nullptr, nullptr, nullptr};
  for (int i = 0; i < p.d; ++i) {
    if (core_const_[i]) {
      c.cores[i] = {cm_[i].data(), cmt_[i].empty() ? nullptr : cmt_[i].data()};
      continue;
    }
    Ort::ConstValue gv = ctx.GetInput(static_cast<size_t>(1 + i));
    if (!gv) fail("core G" + std::to_string(i + 1) + " is missing");
    const auto shp = gv.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> want = {p.ranks[i], p.mk[i], p.mn[i], p.ranks[i + 1]};
    if (shp != want)
      fail("core G" + std::to_string(i + 1) + " has shape " + shape_str(shp) + ", expected " + shape_str(want));
    dyn_cm[i] = gv.GetTensorData<float>();
    c.cores[i] = {dyn_cm[i], nullptr};
    if (!p.lowrank) outer_need += round_up16(static_cast<size_t>(p.core_size(i)));
  }
  c.scale = nullptr;
  if (has_scale_) {
    if (scale_const_) {
      c.scale = scale_.data();
    } else {
      Ort::ConstValue sv = ctx.GetInput(5);
      if (sv) {
        const auto shp = sv.GetTensorTypeAndShapeInfo().GetShape();
        if (shp != std::vector<int64_t>{p.K})
          fail("x_scale has shape " + shape_str(shp) + ", expected [" + std::to_string(p.K) + "]");
        c.scale = sv.GetTensorData<float>();
      }
    }
  }

  if (M == 0) {
    metrics::add(m_calls_, 1.0);
    return;
  }

  const bool matvec = M == 1;
  int64_t max_rows = 0;
  for (const auto& st : p.steps) max_rows = std::max(max_rows, st.rows);
  if (matvec) outer_need += round_up16(static_cast<size_t>(2 * p.max_state)) + static_cast<size_t>(kMaxTasks * max_rows);
  float* outer = outer_need ? outer_scratch().get(outer_need) : nullptr;
  float* op = outer;
  for (int i = 0; i < p.d; ++i) {
    if (!dyn_cm[i] || p.lowrank) continue;
    const TTPlan::Step& st = p.steps[static_cast<size_t>(i)];
    c.kr->transpose(dyn_cm[i], st.rows, op, st.inner, st.inner, st.rows, nullptr);
    c.cores[i].cmt = op;
    op += round_up16(static_cast<size_t>(p.core_size(i)));
  }

  bool scale_finite = true;
  if (c.scale) scale_finite = c.kr->all_finite(c.scale, p.K) != 0;
  const int64_t recomputed = matvec ? matvec_chain(ctx, c, X, Y, op, scale_finite)
                                    : row_chunks(ctx, c, X, Y, M, scale_finite);

  metrics::add(m_calls_, 1.0);
  metrics::add(m_rows_, static_cast<double>(M));
  if (recomputed) metrics::add(m_nonfinite_, static_cast<double>(recomputed));
}

}  // namespace ortlean
