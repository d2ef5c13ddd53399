#include "ops/proc_sparse.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "isa.h"
#include "parallel.h"

namespace ortlean {
namespace {

constexpr int64_t kGrain = 64 * 1024;  // multiply-adds per ParallelFor task (a few microseconds)
constexpr int64_t kMaxTasks = 16;
constexpr int64_t kRowChunk = 32;     // input rows per pass in the M > 1 path (the X chunk stays in L2)
constexpr int64_t kSliceBytes = 192 * 1024;  // deltas per task in the M > 1 path (stay in L2 across row chunks)

// The optional gating mask: [nb] (all rows) or [..., nb] with the leading dims of X; ld = 0 for
// one row shared by all, nb for one row per input row. data = nullptr: no gating.
struct BlockMask {
  const float* data = nullptr;
  int64_t ld = 0;
};

BlockMask read_mask(Ort::KernelContext& ctx, int64_t nb, int64_t M) {
  BlockMask mk;
  Ort::ConstValue mv = ctx.GetInput(4);
  if (!mv) return mk;
  const auto ms = mv.GetTensorTypeAndShapeInfo().GetShape();
  int64_t cnt = 1;
  for (auto d : ms) cnt *= d;
  if (cnt == 0) return mk;  // an empty tensor: no gating
  if (ms.empty() || ms.back() != nb)
    fail("block_mask has shape " + shape_str(ms) + ": last dim must be ceil(K/block) = " + std::to_string(nb));
  if (cnt == nb)
    mk.ld = 0;
  else if (cnt == M * nb)
    mk.ld = nb;
  else
    fail("block_mask has shape " + shape_str(ms) + ": expected [" + std::to_string(nb) + "] or [M, " +
         std::to_string(nb) + "] with M = " + std::to_string(M) + " input rows");
  mk.data = mv.GetTensorData<float>();
  return mk;
}

}  // namespace

// ------------------------------------------------------------------ construction
ProcSparseMatMulKernel::ProcSparseMatMulKernel(const Ort::ConstKernelInfo& info) : OpKernel(info) {
  const Attrs at(info, kAttrs);
  const std::vector<int64_t>& shape = at.ints("shape");
  const int64_t block = at.i("block"), seed = at.i("seed");
  const float base_scale = at.f("base_scale");
  if (shape.size() != 2) fail("attribute shape must be [K, N], got " + shape_str(shape));
  if (block != 32 && block != 64) fail("attribute block must be 32 or 64, got " + std::to_string(block));
  ProcLayer& L = L_;
  L.K = shape[0];
  L.N = shape[1];
  L.block = block;
  L.nb = (L.K + L.block - 1) / L.block;
  L.seed = static_cast<uint64_t>(seed);
  L.base_scale = base_scale;
  const int64_t K = L.K, N = L.N, B = L.block, nb = L.nb;

  const int64_t fanout = at.i("fanout"), watermark = at.i("watermark"), trims = at.i("trims");
  const float shed_eps = at.f("shed_eps"), gap = at.f("gap"), speedup = at.f("speedup");
  if (fanout > nb)
    fail("attribute fanout must be <= ceil(K / block) = " + std::to_string(nb) + " (0: no cap), got " +
         std::to_string(fanout));

  has_mask_input_ = input_present(info, 4);

  // row_ptr [N+1]
  {
    Ort::ConstValue v = const_input(info, 1, "row_ptr", kI32);
    const auto shp = v.GetTensorTypeAndShapeInfo().GetShape();
    if (shp != std::vector<int64_t>{N + 1})
      fail("row_ptr has shape " + shape_str(shp) + ", expected [N+1] = [" + std::to_string(N + 1) + "]");
    const int32_t* rp = v.GetTensorData<int32_t>();
    row_ptr_.assign(rp, rp + N + 1);
    if (row_ptr_[0] != 0) fail("row_ptr[0] must be 0, got " + std::to_string(row_ptr_[0]));
    for (int64_t n = 0; n < N; ++n) {
      const int64_t c = int64_t{row_ptr_[n + 1]} - row_ptr_[n];
      if (c < 0) fail("row_ptr must be non-decreasing (row " + std::to_string(n) + ")");
      if (c > nb)
        fail("row " + std::to_string(n) + " stores " + std::to_string(c) + " blocks, more than K/block = " +
             std::to_string(nb));
      if (fanout > 0 && c > fanout)
        fail("row " + std::to_string(n) + " stores " + std::to_string(c) + " blocks > fanout " + std::to_string(fanout));
      if (watermark > 0 && c * B > watermark)
        fail("row " + std::to_string(n) + " stores " + std::to_string(c * B) + " deltas > watermark " +
             std::to_string(watermark));
      max_row_ = std::max(max_row_, c);
    }
    nnzb_ = row_ptr_[N];
  }
  // block_idx [nnzb]
  {
    Ort::ConstValue v = const_input(info, 2, "block_idx", kI32);
    const auto shp = v.GetTensorTypeAndShapeInfo().GetShape();
    if (shp != std::vector<int64_t>{nnzb_})
      fail("block_idx has shape " + shape_str(shp) + ", expected [row_ptr[N]] = [" + std::to_string(nnzb_) + "]");
    const int32_t* bi = v.GetTensorData<int32_t>();
    bidx_.assign(bi, bi + nnzb_);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = row_ptr_[n]; j < row_ptr_[n + 1]; ++j) {
        if (bidx_[j] < 0 || bidx_[j] >= nb)
          fail("block_idx[" + std::to_string(j) + "] = " + std::to_string(bidx_[j]) + " outside [0, " +
               std::to_string(nb) + ")");
        if (j > row_ptr_[n] && bidx_[j] <= bidx_[j - 1])
          fail("block indices of row " + std::to_string(n) + " must be strictly increasing");
      }
  }
  // deltas [nnzb, block]
  {
    Ort::ConstValue v = const_input(info, 3, "deltas", kF32);
    const auto shp = v.GetTensorTypeAndShapeInfo().GetShape();
    if (shp != std::vector<int64_t>{nnzb_, B})
      fail("deltas has shape " + shape_str(shp) + ", expected [nnzb, block] = [" + std::to_string(nnzb_) + ", " +
           std::to_string(B) + "]");
    deltas_.resize(static_cast<size_t>(nnzb_ * B));
    if (nnzb_) std::memcpy(deltas_.data(), v.GetTensorData<float>(), sizeof(float) * nnzb_ * B);
  }
  L.row_ptr = row_ptr_.data();
  L.block_idx = bidx_.data();
  L.deltas = deltas_.data();
  pk_ = &pick(IsaTables<ProcKernels>{proc_kernels_scalar, proc_kernels_avx2, proc_kernels_avx512});

  // derived defaults when absent
  int64_t params_dense = K * N, params_stored = nnzb_ * B + nnzb_ + N + 1, bytes_stored = -1;
  at.read({{"params_dense", &params_dense}, {"params_stored", &params_stored}, {"bytes_stored", &bytes_stored}});
  // in double: the metadata may be any int64 >= 0 (no overflow in 4 * params)
  const double stored_bytes = bytes_stored >= 0 ? static_cast<double>(bytes_stored) : 4.0 * static_cast<double>(params_stored);
  const double dense_bytes = 4.0 * static_cast<double>(std::max<int64_t>(params_dense, 1));

  metrics::Node* m = metrics::node(name_);
  m->set({{"proc.enabled", 1.0},
          {"proc.block", static_cast<double>(B)},
          {"proc.fanout", static_cast<double>(fanout ? fanout : nb)},
          {"proc.effective_fanout", static_cast<double>(nnzb_) / static_cast<double>(N)},
          {"proc.blocks_total", static_cast<double>(nb)},
          {"proc.base_scale", float_attr_value(base_scale)},
          {"proc.trims", static_cast<double>(trims)},
          {"proc.watermark", static_cast<double>(watermark)},
          {"proc.shed_eps", float_attr_value(shed_eps)},
          {"proc.gap", float_attr_value(gap)},
          {"proc.speedup", float_attr_value(speedup)},
          {"proc.mem_saved", 1.0 - stored_bytes / dense_bytes}});
  m->counters({{&m_calls_, "proc.calls"}, {&m_rows_, "proc.rows"}, {&m_visited_, "proc.blocks_visited"},
               {&m_nonfinite_, "proc.nonfinite_recomputes"}});
}

// ------------------------------------------------------------------ compute
void ProcSparseMatMulKernel::Compute(Ort::KernelContext& ctx) const {
  const ProcLayer& L = L_;
  const int64_t K = L.K, N = L.N, B = L.block;
  const RowsIO io = rows_io(ctx, K, N);
  const int64_t M = io.M;
  const float* X = io.X;
  float* Y = io.Y;
  const BlockMask mask = has_mask_input_ ? read_mask(ctx, L.nb, M) : BlockMask{};
  if (M == 0) {
    metrics::add(m_calls_, 1.0);
    return;
  }

  ProcRowsArgs base{};
  base.L = L;
  base.ldx = K;
  base.ldy = N;
  base.ldmask = mask.ld;

  // tasks: ranges of output rows n whose deltas fit in L2 (and at least one range per pool task);
  // each task runs every chunk of input rows over its range, so the deltas are streamed from
  // memory once per call and re-read from L2 for the later row chunks
  const bool regen = L.base_scale != 0.0f;
  const int64_t work = M * std::max<int64_t>(nnzb_, 1) * B * (regen ? 2 : 1);
  const int64_t ntasks = std::max<int64_t>(1, std::min<int64_t>(kMaxTasks, work / kGrain));
  const int64_t per_row_bytes = std::max<int64_t>(1, (nnzb_ * B * 4) / N);
  const int64_t by_cache = M > 1 ? (N * per_row_bytes + kSliceBytes - 1) / kSliceBytes : 1;
  const int64_t nsplit = std::max<int64_t>(1, std::min<int64_t>(N, std::max(ntasks, by_cache)));
  const int64_t nchunk = (N + nsplit - 1) / nsplit;
  const int64_t nn = (N + nchunk - 1) / nchunk;
  const int64_t mchunk = M <= kRowChunk ? M : kRowChunk;
  const size_t wneed = regen ? static_cast<size_t>(std::max<int64_t>(max_row_, 1) * B) : 0;
  std::atomic<int64_t> visited{0};
  std::atomic<bool> oom{false};
  auto task = [&](size_t t) noexcept {
    ProcRowsArgs a = base;
    a.wbuf = nullptr;
    if (wneed) {
      try {
        a.wbuf = task_scratch().get(wneed);
      } catch (...) {
        oom = true;
        return;
      }
    }
    const int64_t n0 = static_cast<int64_t>(t) * nchunk, n1 = std::min(N, n0 + nchunk);
    int64_t v = 0;
    for (int64_t m0 = 0; m0 < M; m0 += mchunk) {
      a.mb = std::min(mchunk, M - m0);
      a.X = X + m0 * K;
      a.Y = Y + m0 * N;
      a.mask = mask.data ? mask.data + m0 * mask.ld : nullptr;
      v += pk_->rows(&a, n0, n1);
    }
    visited += v;
  };
  parallel_for(ctx, static_cast<size_t>(nn), task);
  if (oom) throw std::bad_alloc();
  const int64_t recomputed = guard_nonfinite(X, Y, M, mask.data, mask.ld);

  metrics::add(m_calls_, 1.0);
  metrics::add(m_rows_, static_cast<double>(M));
  metrics::add(m_visited_, static_cast<double>(visited.load()));
  if (recomputed) metrics::add(m_nonfinite_, static_cast<double>(recomputed));
}

// Non-finite guard: an output row that is non-finite from a finite input is recomputed in double
// from the same regenerated weights. Returns the number of rows recomputed.
int64_t ProcSparseMatMulKernel::guard_nonfinite(const float* X, float* Y, int64_t M, const float* mask,
                                                int64_t ldmask) const {
  const ProcLayer& L = L_;
  const int64_t K = L.K, N = L.N, B = L.block;
  const GemmKernels& kr = gemm_kernels();
  int64_t recomputed = 0;
  std::vector<float> w;
  for (int64_t m = 0; m < M; ++m) {
    float* y = Y + m * N;
    if (kr.all_finite(y, N)) continue;
    const float* x = X + m * K;
    if (!kr.all_finite(x, K)) continue;
    w.resize(static_cast<size_t>(B));
    const float* mrow = mask ? mask + m * ldmask : nullptr;
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0.0;
      for (int64_t j = L.row_ptr[n]; j < L.row_ptr[n + 1]; ++j) {
        const int64_t b = L.block_idx[j];
        if (mrow && mrow[b] == 0.0f) continue;
        const int64_t k0 = b * B, len = std::min(B, K - k0);
        pk_->base_block(L.seed, static_cast<uint64_t>(n * K + k0), L.base_scale, L.deltas + j * B, len, w.data());
        for (int64_t i = 0; i < len; ++i) acc += static_cast<double>(w[i]) * x[k0 + i];
      }
      y[n] = static_cast<float>(acc);
    }
    ++recomputed;
  }
  return recomputed;
}

}  // namespace ortlean
