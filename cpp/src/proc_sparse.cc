#include "proc_sparse.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "isa.h"
#include "kernels/proc_kernels.h"

namespace ortlean {
namespace {

constexpr AttrSpec kAttrSpecs[] = {
    attr_required("shape", AttrType::Ints),      attr_required("block", AttrType::Int),
    attr_required("seed", AttrType::Int),        attr_required("base_scale", AttrType::Float),
    attr_int("fanout", 0),                       attr_int("watermark", 0),
    attr_float("shed_eps", 0.0f),                attr_int("trims", 0),
    attr_float("gap", NAN),                      attr_optional("params_dense", AttrType::Int),
    attr_optional("params_stored", AttrType::Int), attr_optional("bytes_stored", AttrType::Int),
    attr_float("speedup", 0.0f),                 attr_optional("layer", AttrType::String),
    attr_optional("target", AttrType::String),
};

constexpr int64_t kGrain = 64 * 1024;  // multiply-adds per ParallelFor task (a few microseconds)
constexpr int64_t kMaxTasks = 16;
constexpr int64_t kRowChunk = 32;     // input rows per pass in the M > 1 path (the X chunk stays in L2)
constexpr int64_t kSliceBytes = 192 * 1024;  // deltas per task in the M > 1 path (stay in L2 across row chunks)

const ProcKernels& proc_kernels() {
  static const ProcKernels* k = isa() == Isa::Avx512 ? proc_kernels_avx512()
                                : isa() == Isa::Avx2 ? proc_kernels_avx2()
                                                     : proc_kernels_scalar();
  return *k;
}

// A constant initializer input of the expected element type, or a clear error.
Ort::ConstValue const_input(const Ort::ConstKernelInfo& info, size_t i, const char* what,
                            ONNXTensorElementDataType type, const char* type_name) {
  int is_const = 0;
  Ort::ConstValue v = info.GetTensorConstantInput(i, &is_const);
  if (!is_const)
    fail(std::string("input ") + what + " (input " + std::to_string(i) +
         ") must be a constant initializer (the kernel validates and packs it once)");
  if (v.GetTensorTypeAndShapeInfo().GetElementType() != type) fail(std::string("input ") + what + " must be " + type_name);
  return v;
}

}  // namespace

// ------------------------------------------------------------------ construction
const AttrTable ProcSparseMatMulKernel::kAttrs{kAttrSpecs};

ProcSparseMatMulKernel::ProcSparseMatMulKernel(const OrtApi&, const OrtKernelInfo* info_ptr) {
  Ort::ConstKernelInfo info{info_ptr};
  name_ = info.GetNodeName();
  err_prefix_ = "ortlean ProcSparseMatMul node '" + name_ + "': ";

  const Attrs at(info, kAttrs);
  const std::vector<int64_t>& shape = at.ints("shape");
  const int64_t block = at.i("block"), seed = at.i("seed");
  const float base_scale = at.f("base_scale");
  if (shape.size() != 2 || shape[0] < 1 || shape[1] < 1)
    fail("attribute shape must be [K, N] with K, N >= 1, got " + shape_str(shape));
  if (shape[0] > (int64_t{1} << 31) - 1 || shape[1] > (int64_t{1} << 31) - 1) fail("attribute shape too large");
  if (block != 32 && block != 64) fail("attribute block must be 32 or 64, got " + std::to_string(block));
  if (!std::isfinite(base_scale)) fail("attribute base_scale must be finite");
  K_ = shape[0];
  N_ = shape[1];
  B_ = block;
  nb_ = (K_ + B_ - 1) / B_;
  seed_ = static_cast<uint64_t>(seed);
  scale_ = base_scale;

  const int64_t fanout = at.i("fanout"), watermark = at.i("watermark"), trims = at.i("trims");
  const float shed_eps = at.f("shed_eps"), gap = at.f("gap"), speedup = at.f("speedup");
  const std::string& target = at.s("target");
  if (fanout < 0) fail("attribute fanout must be >= 0 (0: no cap), got " + std::to_string(fanout));
  if (watermark < 0) fail("attribute watermark must be >= 0 (0: no cap), got " + std::to_string(watermark));
  if (!(shed_eps >= 0.0f)) fail("attribute shed_eps must be >= 0");
  if (trims < 0) fail("attribute trims must be >= 0");
  if (!target.empty() && target != "mlp" && target != "attn" && target != "head")
    fail("attribute target must be 'mlp', 'attn' or 'head', got '" + target + "'");

  const size_t n_in = info.GetInputCount();
  has_mask_input_ = n_in > 4 && !info.GetInputName(4).empty();

  // row_ptr [N+1]
  {
    Ort::ConstValue v = const_input(info, 1, "row_ptr", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32, "int32");
    const auto shp = v.GetTensorTypeAndShapeInfo().GetShape();
    if (shp != std::vector<int64_t>{N_ + 1})
      fail("row_ptr has shape " + shape_str(shp) + ", expected [N+1] = [" + std::to_string(N_ + 1) + "]");
    const int32_t* rp = v.GetTensorData<int32_t>();
    row_ptr_.assign(rp, rp + N_ + 1);
    if (row_ptr_[0] != 0) fail("row_ptr[0] must be 0, got " + std::to_string(row_ptr_[0]));
    for (int64_t n = 0; n < N_; ++n) {
      const int64_t c = int64_t{row_ptr_[n + 1]} - row_ptr_[n];
      if (c < 0) fail("row_ptr must be non-decreasing (row " + std::to_string(n) + ")");
      if (c > nb_)
        fail("row " + std::to_string(n) + " stores " + std::to_string(c) + " blocks, more than K/block = " +
             std::to_string(nb_));
      if (fanout > 0 && c > fanout)
        fail("row " + std::to_string(n) + " stores " + std::to_string(c) + " blocks > fanout " + std::to_string(fanout));
      if (watermark > 0 && c * B_ > watermark)
        fail("row " + std::to_string(n) + " stores " + std::to_string(c * B_) + " deltas > watermark " +
             std::to_string(watermark));
      max_row_ = std::max(max_row_, c);
    }
    nnzb_ = row_ptr_[N_];
  }
  // block_idx [nnzb]
  {
    Ort::ConstValue v = const_input(info, 2, "block_idx", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32, "int32");
    const auto shp = v.GetTensorTypeAndShapeInfo().GetShape();
    if (shp != std::vector<int64_t>{nnzb_})
      fail("block_idx has shape " + shape_str(shp) + ", expected [row_ptr[N]] = [" + std::to_string(nnzb_) + "]");
    const int32_t* bi = v.GetTensorData<int32_t>();
    bidx_.assign(bi, bi + nnzb_);
    for (int64_t n = 0; n < N_; ++n)
      for (int64_t j = row_ptr_[n]; j < row_ptr_[n + 1]; ++j) {
        if (bidx_[j] < 0 || bidx_[j] >= nb_)
          fail("block_idx[" + std::to_string(j) + "] = " + std::to_string(bidx_[j]) + " outside [0, " +
               std::to_string(nb_) + ")");
        if (j > row_ptr_[n] && bidx_[j] <= bidx_[j - 1])
          fail("block indices of row " + std::to_string(n) + " must be strictly increasing");
      }
  }
  // deltas [nnzb, block]
  {
    Ort::ConstValue v = const_input(info, 3, "deltas", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, "float32");
    const auto shp = v.GetTensorTypeAndShapeInfo().GetShape();
    if (shp != std::vector<int64_t>{nnzb_, B_})
      fail("deltas has shape " + shape_str(shp) + ", expected [nnzb, block] = [" + std::to_string(nnzb_) + ", " +
           std::to_string(B_) + "]");
    deltas_.resize(static_cast<size_t>(nnzb_ * B_));
    if (nnzb_) std::memcpy(deltas_.data(), v.GetTensorData<float>(), sizeof(float) * nnzb_ * B_);
  }

  const int64_t params_dense = at.given("params_dense") ? at.i("params_dense") : K_ * N_;
  const int64_t params_stored = at.given("params_stored") ? at.i("params_stored") : nnzb_ * B_ + nnzb_ + N_ + 1;
  const int64_t bytes_stored = at.given("bytes_stored") ? at.i("bytes_stored") : 4 * params_stored;

  metrics::Node* m = metrics::node(name_);
  metrics::set(m->metric("proc.enabled", false), 1.0);
  metrics::set(m->metric("proc.block", false), static_cast<double>(B_));
  metrics::set(m->metric("proc.fanout", false), static_cast<double>(fanout ? fanout : nb_));
  m_eff_fanout_ = m->metric("proc.effective_fanout", false);
  metrics::set(m_eff_fanout_, static_cast<double>(nnzb_) / static_cast<double>(N_));
  metrics::set(m->metric("proc.blocks_total", false), static_cast<double>(nb_));
  metrics::set(m->metric("proc.base_scale", false), float_attr_value(base_scale));
  metrics::set(m->metric("proc.trims", false), static_cast<double>(trims));
  metrics::set(m->metric("proc.watermark", false), static_cast<double>(watermark));
  metrics::set(m->metric("proc.shed_eps", false), float_attr_value(shed_eps));
  metrics::set(m->metric("proc.gap", false), float_attr_value(gap));
  metrics::set(m->metric("proc.speedup", false), float_attr_value(speedup));
  metrics::set(m->metric("proc.mem_saved", false),
               1.0 - static_cast<double>(bytes_stored) / static_cast<double>(4 * std::max<int64_t>(params_dense, 1)));
  m_calls_ = m->metric("proc.calls", true);
  m_rows_ = m->metric("proc.rows", true);
  m_visited_ = m->metric("proc.blocks_visited", true);
  m_nonfinite_ = m->metric("proc.nonfinite_recomputes", true);
}

OrtStatusPtr ProcSparseMatMulOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** op_kernel) const {
  return create_kernel_guarded<ProcSparseMatMulKernel>("ProcSparseMatMul", api, info, op_kernel);
}

// ------------------------------------------------------------------ compute
OrtStatusPtr ProcSparseMatMulKernel::ComputeV2(OrtKernelContext* context) noexcept {
  return status_guard(err_prefix_, [&] { Compute(context); });
}

void ProcSparseMatMulKernel::Compute(OrtKernelContext* context) const {
  Ort::KernelContext ctx(context);
  const ProcKernels& pk = proc_kernels();
  const Kernels& kr = kernels();

  Ort::ConstValue xv = ctx.GetInput(0);
  std::vector<int64_t> yshape = xv.GetTensorTypeAndShapeInfo().GetShape();
  if (yshape.empty()) fail("input X must have rank >= 1, got a scalar");
  if (yshape.back() != K_) fail("input X has shape " + shape_str(yshape) + ": last dim must be K = " + std::to_string(K_));
  int64_t M = 1;
  for (size_t i = 0; i + 1 < yshape.size(); ++i) M *= yshape[i];
  yshape.back() = N_;
  Ort::UnownedValue yv = ctx.GetOutput(0, yshape);
  const float* X = xv.GetTensorData<float>();
  float* Y = yv.GetTensorMutableData<float>();

  // optional gating mask: [nb] (all rows) or [..., nb] with the leading dims of X
  const float* mask = nullptr;
  int64_t ldmask = 0;
  if (has_mask_input_) {
    Ort::ConstValue mv = ctx.GetInput(4);
    if (mv) {
      const auto ms = mv.GetTensorTypeAndShapeInfo().GetShape();
      int64_t cnt = 1;
      for (auto d : ms) cnt *= d;
      if (cnt > 0) {
        if (ms.empty() || ms.back() != nb_)
          fail("block_mask has shape " + shape_str(ms) + ": last dim must be ceil(K/block) = " + std::to_string(nb_));
        if (cnt == nb_) {
          ldmask = 0;
        } else if (cnt == M * nb_) {
          ldmask = nb_;
        } else {
          fail("block_mask has shape " + shape_str(ms) + ": expected [" + std::to_string(nb_) + "] or [M, " +
               std::to_string(nb_) + "] with M = " + std::to_string(M) + " input rows");
        }
        mask = mv.GetTensorData<float>();
      }
    }
  }

  if (M == 0) {
    metrics::add(m_calls_, 1.0);
    return;
  }

  ProcRowsArgs base{};
  base.K = K_;
  base.B = B_;
  base.seed = seed_;
  base.scale = scale_;
  base.row_ptr = row_ptr_.data();
  base.bidx = bidx_.data();
  base.deltas = deltas_.data();
  base.ldx = K_;
  base.ldy = N_;
  base.ldmask = ldmask;

  // tasks: ranges of output rows n whose deltas fit in L2 (and at least one range per pool task);
  // each task runs every chunk of input rows over its range, so the deltas are streamed from
  // memory once per call and re-read from L2 for the later row chunks
  const int64_t work = M * std::max<int64_t>(nnzb_, 1) * B_ * (scale_ != 0.0f ? 2 : 1);
  const int64_t ntasks = std::max<int64_t>(1, std::min<int64_t>(kMaxTasks, work / kGrain));
  const int64_t per_row_bytes = std::max<int64_t>(1, (nnzb_ * B_ * 4) / N_);
  const int64_t by_cache = M > 1 ? (N_ * per_row_bytes + kSliceBytes - 1) / kSliceBytes : 1;
  const int64_t nsplit = std::max<int64_t>(1, std::min<int64_t>(N_, std::max(ntasks, by_cache)));
  const int64_t nchunk = (N_ + nsplit - 1) / nsplit;
  const int64_t nn = (N_ + nchunk - 1) / nchunk;
  const int64_t mchunk = M <= kRowChunk ? M : kRowChunk;
  const size_t wneed = scale_ != 0.0f ? static_cast<size_t>(std::max<int64_t>(max_row_, 1) * B_) : 0;
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
    const int64_t n0 = static_cast<int64_t>(t) * nchunk, n1 = std::min(N_, n0 + nchunk);
    int64_t v = 0;
    for (int64_t m0 = 0; m0 < M; m0 += mchunk) {
      a.mb = std::min(mchunk, M - m0);
      a.X = X + m0 * K_;
      a.Y = Y + m0 * N_;
      a.mask = mask ? mask + m0 * ldmask : nullptr;
      v += pk.rows(&a, n0, n1);
    }
    visited += v;
  };
  parallel_for(ctx, static_cast<size_t>(nn), task);
  if (oom) throw std::bad_alloc();

  // non-finite guard: a row that is non-finite from a finite input is recomputed in double
  int64_t recomputed = 0;
  std::vector<float> w;
  for (int64_t m = 0; m < M; ++m) {
    float* y = Y + m * N_;
    if (kr.all_finite(y, N_)) continue;
    const float* x = X + m * K_;
    if (!kr.all_finite(x, K_)) continue;
    w.resize(static_cast<size_t>(B_));
    const float* mrow = mask ? mask + m * ldmask : nullptr;
    for (int64_t n = 0; n < N_; ++n) {
      double acc = 0.0;
      for (int64_t j = row_ptr_[n]; j < row_ptr_[n + 1]; ++j) {
        const int64_t b = bidx_[j];
        if (mrow && mrow[b] == 0.0f) continue;
        const int64_t k0 = b * B_, len = std::min(B_, K_ - k0);
        pk.base_block(seed_, static_cast<uint64_t>(n * K_ + k0), scale_, deltas_.data() + j * B_, len, w.data());
        for (int64_t i = 0; i < len; ++i) acc += static_cast<double>(w[i]) * x[k0 + i];
      }
      y[n] = static_cast<float>(acc);
    }
    ++recomputed;
  }

  metrics::add(m_calls_, 1.0);
  metrics::add(m_rows_, static_cast<double>(M));
  metrics::add(m_visited_, static_cast<double>(visited.load()));
  if (recomputed) metrics::add(m_nonfinite_, static_cast<double>(recomputed));
}

}  // namespace ortlean
