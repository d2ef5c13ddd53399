#include "ops/block_quant.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "scratch.h"

namespace ortlean {
namespace {

// M = 1: weight bytes per pool task at least this (a matvec task restarts the streams: fewer, larger
// tasks) and at most kMaxTasks tasks; rows per task a multiple of kRowGroup (the kernels' row groups)
constexpr int64_t kTaskBytes = 48 * 1024;
constexpr int64_t kMaxTasks = 8;
constexpr int64_t kRowGroup = 8;
// M > 1: tasks of kTileN weight rows (decoded once per task into the kernels' panel) x up to kTileM
// activation rows
constexpr int64_t kTileM = 512;
constexpr int64_t kTileN = 64;

std::string fmt_list() {
  std::string s;
  for (int f = 0; f < kBqFormats; ++f) s += (f ? "|" : "") + std::string(kBqFormatInfo[f].name);
  return s;
}

uint16_t ld16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Rows of X, quantized as the reference (custom_ops/reference/blockquant.py) into float64 x̂:
// the non-finite guard's recompute, off the hot path.
void dequantized_activations(const float* x, int64_t K, int act_bits, std::vector<double>& xh) {
  const float qm = static_cast<float>(act_bits == 16 ? kBqActMax16 : kBqActMax8);
  xh.assign(static_cast<size_t>(K), 0.0);
  for (int64_t k0 = 0; k0 < K; k0 += kBqActBlock) {
    const int64_t n = std::min<int64_t>(kBqActBlock, K - k0);
    float amax = 0.0f;
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[k0 + i]));
    const float inv = qm / amax;
    if (!(inv <= FLT_MAX)) continue;
    const float d = amax / qm;
    for (int64_t i = 0; i < n; ++i) {
      float v = std::nearbyint(x[k0 + i] * inv);
      v = std::min(qm, std::max(-qm, v));
      xh[static_cast<size_t>(k0 + i)] = static_cast<double>(d) * static_cast<double>(v);
    }
  }
}

}  // namespace

void read_bq_node(const Ort::ConstKernelInfo& info, const Attrs& at, size_t w_input, int act_bits, BqNode& nd) {
  BqLayer& w = nd.w;
  w.act_bits = act_bits;
  std::string fmt;
  int64_t K = 0, N = 0;
  at.read({{"format", &fmt}, {"K", &K}, {"N", &N}});
  w.format = -1;
  for (int f = 0; f < kBqFormats; ++f)
    if (fmt == kBqFormatInfo[f].name) w.format = f;
  if (w.format < 0) fail("attribute format must be one of " + fmt_list() + ", got '" + fmt + "'");
  const BqFormatInfo& fi = kBqFormatInfo[w.format];
  w.K = K;
  w.N = N;
  w.block = fi.block;
  if (at.given("block_size")) {
    const int64_t bs = at.i("block_size");
    if (w.format == kBqQ4_F) {
      if (bs != 16 && bs != 32 && bs != 64 && bs != 128 && bs != 256)
        fail("attribute block_size must be one of 16, 32, 64, 128, 256 for format q4_f, got " + std::to_string(bs));
      w.block = static_cast<int>(bs);
    } else if (bs != fi.block) {
      fail("attribute block_size " + std::to_string(bs) + " does not apply to format " + fmt + " (its blocks hold " +
           std::to_string(fi.block) + " weights; block_size is for q4_f)");
    }
  } else if (w.format == kBqQ4_F) {
    w.block = 32;
  }
  w.type_size = w.format == kBqQ4_F ? 4 + w.block / 2 : fi.type_size;
  w.nb = (K + w.block - 1) / w.block;
  w.row_bytes = w.nb * w.type_size;
  w.Kp = w.nb * w.block;
  w.nbx = (w.Kp + kBqActBlock - 1) / kBqActBlock;
  if (at.given("bits_per_weight")) nd.bits_per_weight = at.f("bits_per_weight");
  std::string layout;
  at.read({{"layout", &layout}});
  w.split = layout == "split" ? 1 : 0;
  const int split_hdr = bq_split_header(w.format, w.block);
  if (w.split && split_hdr == 0)
    fail("attribute layout 'split' takes formats q4_0, q4_1, q5_0, q5_1, q8_0 and q4_f with block 32, not " + fmt +
         (w.format == kBqQ4_F ? " with block " + std::to_string(w.block) : std::string()));

  Ort::ConstValue wv = const_input(info, w_input, "W", kU8);
  const std::vector<int64_t> shp = wv.GetTensorTypeAndShapeInfo().GetShape();
  if (shp.size() != 2 || shp[0] != N || shp[1] != w.row_bytes)
    fail("input W has shape " + shape_str(shp) + ", expected [" + std::to_string(N) + ", " +
         std::to_string(w.row_bytes) + "] (format " + fmt + ", K = " + std::to_string(K) + ": " +
         std::to_string(w.nb) + " blocks of " + std::to_string(w.type_size) + " bytes per row)");
  w.data = wv.GetTensorData<uint8_t>();
  // every block's fp16 scale / min must be finite (exponent bits not all ones)
  for (int s = 0; s < 2; ++s) {
    const int off = fi.scale_off[s];
    if (off < 0) continue;
    const int64_t nblocks = N * w.nb;
    const uint8_t* p = w.data + off;
    for (int64_t i = 0; i < nblocks; ++i, p += w.type_size) {
      // split: field s of row r's block b at r * row_bytes + nb * (type_size - header) + 2 * (s * nb + b)
      const uint8_t* hp = !w.split ? p
                                   : w.data + (i / w.nb) * w.row_bytes + w.nb * (w.type_size - split_hdr) +
                                         2 * ((off / 2) * w.nb + i % w.nb);
      const uint16_t h = ld16(hp);
      if ((h & 0x7C00u) == 0x7C00u) {
        char hex[8];
        std::snprintf(hex, sizeof hex, "%04x", h);
        fail("input W row " + std::to_string(i / w.nb) + " block " + std::to_string(i % w.nb) +
             ": non-finite fp16 " + (s == 0 ? (w.format == kBqQ4_K || w.format == kBqQ5_K ? "d" : "scale d")
                                           : (w.format == kBqQ4_K || w.format == kBqQ5_K ? "dmin" : "min m")) +
             " (0x" + hex + (w.split ? " at byte " + std::to_string(hp - (w.data + (i / w.nb) * w.row_bytes)) + " of the row, layout split)"
                                     : " at byte " + std::to_string(off) + " of the block)"));
      }
    }
  }
  nd.k = &pick(IsaTables<BlockQuantKernels>{blockquant_kernels_scalar, blockquant_kernels_avx2, blockquant_kernels_avx512,
                                            kBqAvx2Needs, kBqAvx512Needs},
               Isa::Avx512, &nd.level);
  nd.plan.assign(nd.k->plan_ints(&w), 0);
  nd.k->make_plan(&w, nd.plan.data());
  w.plan = nd.plan.empty() ? nullptr : nd.plan.data();
}

// ------------------------------------------------------------------ BlockQuantMatMul
BlockQuantMatMulKernel::BlockQuantMatMulKernel(const Ort::ConstKernelInfo& info) : OpKernel(info) {
  const Attrs at(info, kAttrs);
  int64_t act_bits = 8, prefill_act_bits = 0;
  std::string glu;
  at.read({{"act_bits", &act_bits}, {"glu", &glu}, {"prefill_act_bits", &prefill_act_bits}});
  if (act_bits != 8 && act_bits != 16) fail("attribute act_bits must be 8 or 16, got " + std::to_string(act_bits));
  if (prefill_act_bits != 0 && prefill_act_bits != 8 && prefill_act_bits != 16)
    fail("attribute prefill_act_bits must be 0 (as act_bits), 8 or 16, got " + std::to_string(prefill_act_bits));
  read_bq_node(info, at, 1, static_cast<int>(act_bits), node_);
  // calls with M > 1 (prompt rows) run the same bytes at prefill_act_bits: a second layer over node_.w's data
  prefill_ = node_.w;
  if (prefill_act_bits != 0 && prefill_act_bits != act_bits) {
    prefill_.act_bits = static_cast<int>(prefill_act_bits);
    prefill_plan_.assign(node_.k->plan_ints(&prefill_), 0);
    node_.k->make_plan(&prefill_, prefill_plan_.data());
    prefill_.plan = prefill_plan_.empty() ? nullptr : prefill_plan_.data();
  }
  glu_ = glu == "silu";
  if (glu_ && node_.w.N % 2 != 0)
    fail("attribute glu 'silu' needs an even N (the gate's rows, then as many of the up projection's), got N = " +
         std::to_string(node_.w.N));
  has_bias_ = input_present(info, 2);
  if (has_bias_) {
    int is_const = 0;
    Ort::ConstValue bv = info.GetTensorConstantInput(2, &is_const);
    if (is_const) {
      auto ti = bv.GetTensorTypeAndShapeInfo();
      if (ti.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) fail("input bias must be float32");
      if (ti.GetShape() != std::vector<int64_t>{node_.w.N})
        fail("input bias has shape " + shape_str(ti.GetShape()) + ", expected [" + std::to_string(node_.w.N) + "]");
      bias_ = bv.GetTensorData<float>();
    }
  }
  metrics::Node* m = metrics::node(name_);
  m->set({{"bq.format", static_cast<double>(node_.w.format)},
          {"bq.block", static_cast<double>(node_.w.block)},
          {"bq.bits_per_weight", 8.0 * node_.w.type_size / node_.w.block},
          {"bq.act_bits", static_cast<double>(node_.w.act_bits)},
          {"bq.prefill_act_bits", static_cast<double>(prefill_.act_bits)},
          {"bq.glu", glu_ ? 1.0 : 0.0},
          {"bq.isa", static_cast<double>(node_.level)},
          {"bq.amx_tiles", static_cast<double>(node_.k->tiles())}});
  m->counters({{&m_calls_, "bq.calls"}, {&m_rows_, "bq.rows"}, {&m_nonfinite_, "bq.nonfinite_recomputes"}});
  if (metrics::phase_times())
    m->counters({{&m_time_[0], "time.total_us"}, {&m_time_[1], "time.run_us"}, {&m_time_[2], "time.first_start_us"},
                 {&m_time_[3], "time.last_start_us"}, {&m_time_[4], "time.task_us"}, {&m_time_[5], "time.join_us"},
                 {&m_time_[6], "time.calls"}});
}

using Clock = std::chrono::steady_clock;
using metrics::elapsed_us;

// One Compute() call: quantize the rows, multiply, then the NaN rows and the non-finite guard.
class BqCall {
 public:
  BqCall(const BlockQuantMatMulKernel& k, Ort::KernelContext& ctx, const RowsIO& io, const float* bias)
      : k_(k), ctx_(ctx), io_(io), w_(k.layer(io.M)), kr_(*k.node_.k), bias_(bias) {}

  void quantize_rows() {
    ab_ = kr_.act_bytes(&w_, io_.M);
    const size_t M = static_cast<size_t>(io_.M);
    // with glu the product P [M, N] goes to scratch (64-byte aligned, after the activations) and the
    // gated unit writes Y [M, N/2]; without, P is Y
    const size_t head = (M * ab_ + M + 63) / 64 * 64;
    const size_t floats = head / sizeof(float) + (k_.glu_ ? M * static_cast<size_t>(w_.N) : 0) + 16;
    uint8_t* base = reinterpret_cast<uint8_t*>(outer_scratch().get(floats));
    xq_ = base;
    finite_ = base + M * ab_;
    P_ = k_.glu_ ? reinterpret_cast<float*>(base + head) : io_.Y;
    const int64_t K = w_.K;
    auto one = [&](size_t m) noexcept {
      finite_[m] = static_cast<uint8_t>(kr_.quantize(&w_, io_.X + m * K, xq_ + m * ab_, io_.M));
    };
    if (io_.M == 1) {  // in multiply(): by the first of its tasks to start
      x_state_.store(kXPending, std::memory_order_relaxed);
      return;
    }
    if (io_.M < 8) {
      for (size_t m = 0; m < M; ++m) one(m);
      return;
    }
    const size_t nt = std::min<size_t>(M, 8);
    auto task = [&](size_t t) noexcept {
      for (size_t m = t * M / nt; m < (t + 1) * M / nt; ++m) one(m);
    };
    parallel_for(ctx_, nt, task);
  }

  void multiply() {
    const int64_t N = w_.N;
    if (io_.M == 1) {
      const int64_t total = N * w_.row_bytes;
      // 2 .. kMaxTasks tasks of at least kTaskBytes, and once the pool's threads are counted no more tasks
      // than threads: every task restarts its row streams, and on a 2-core Zen 5 host one task a thread
      // decoded SmolLM2 6 % faster at 2 threads than tasks of 48 KB (dev A/B of the step, 61 alternating
      // rounds). While probing, an even number: ORT's pool hands tasks out dynamically, and 3 tasks on 2
      // threads leave one thread a third of the work to wait for. A one-thread pool: one task.
      int64_t nt = std::min<int64_t>(kMaxTasks, std::max<int64_t>(2, total / kTaskBytes));
      const int threads = k_.pool_.threads();
      nt = k_.pool_.width() == 1 ? 1 : threads >= 2 ? std::min<int64_t>(nt, threads) : nt & ~int64_t{1};
      int64_t rows = (N + nt - 1) / nt;
      rows = (rows + kRowGroup - 1) / kRowGroup * kRowGroup;
      nt = (N + rows - 1) / rows;
      // each task checks its outputs while they are in L1 (finish reads the flags, not the row)
      const bool timed = k_.m_time_[0] != nullptr;
      Clock::time_point span[kMaxTasks][2];
      auto task = [&](size_t t) noexcept {
        if (timed) span[t][0] = Clock::now();
        quantized_x();
        const int64_t n0 = static_cast<int64_t>(t) * rows, n1 = std::min(N, n0 + rows);
        kr_.gemv(&w_, xq_, n0, n1, bias_, P_ + n0);
        task_finite_[t] = gemm_kernels().all_finite(P_ + n0, n1 - n0) != 0;
        if (timed) span[t][1] = Clock::now();
      };
      ntask_ = static_cast<size_t>(nt);
      const Clock::time_point r0 = timed ? Clock::now() : Clock::time_point{};
      k_.pool_.run(ctx_, ntask_, task);
      if (timed) {
        const Clock::time_point r1 = Clock::now();
        Clock::time_point first = span[0][0], last = span[0][0], end = span[0][1];
        double longest = 0;
        for (size_t t = 0; t < ntask_; ++t) {
          first = std::min(first, span[t][0]);
          last = std::max(last, span[t][0]);
          end = std::max(end, span[t][1]);
          longest = std::max(longest, elapsed_us(span[t][0], span[t][1]));
        }
        metrics::add(k_.m_time_[1], elapsed_us(r0, r1));
        metrics::add(k_.m_time_[2], elapsed_us(r0, first));
        metrics::add(k_.m_time_[3], elapsed_us(r0, last));
        metrics::add(k_.m_time_[4], longest);
        metrics::add(k_.m_time_[5], elapsed_us(end, r1));
      }
      return;
    }
    const int64_t tm = (io_.M + kTileM - 1) / kTileM, tn = (N + kTileN - 1) / kTileN;
    auto task = [&](size_t t) noexcept {
      const int64_t i = static_cast<int64_t>(t) / tn, j = static_cast<int64_t>(t) % tn;
      const int64_t m0 = i * kTileM, m1 = std::min(io_.M, m0 + kTileM);
      const int64_t n0 = j * kTileN, n1 = std::min(N, n0 + kTileN);
      kr_.gemm(&w_, xq_ + m0 * ab_, ab_, m1 - m0, n0, n1, bias_, P_ + m0 * N + n0, N);
    };
    parallel_for(ctx_, static_cast<size_t>(tm * tn), task);
  }

  // M = 1: the row's activations are quantized by the first task to start, while the pool hands out the
  // others; the rest wait for it (it is running: no task waits on one not yet started). Measured in
  // SmolLM2's decode at 2 threads (dev timers): ORT's pool starts the caller's task ~0.55 us into
  // ParallelFor and the other thread's ~1.2 us, and the ~0.5 us of quantization came before both.
  // Dev A/B of the step (3 alternating rounds of 800 steps): lossless 2.81 -> 2.71 ms at 2 threads,
  // 4.30 -> 4.24 at 1; act8 2.64 -> 2.56 at 2, unchanged at 1
  void quantized_x() noexcept {
    int st = x_state_.load(std::memory_order_acquire);
    if (st == kXDone) return;
    if (st == kXPending && x_state_.compare_exchange_strong(st, kXBusy, std::memory_order_acq_rel)) {
      finite_[0] = static_cast<uint8_t>(kr_.quantize(&w_, io_.X, xq_, 1));
      x_state_.store(kXDone, std::memory_order_release);
      return;
    }
    for (int spins = 0; x_state_.load(std::memory_order_acquire) != kXDone; ++spins) {
      if (spins < 4096) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      } else {
        std::this_thread::yield();  // the quantizing thread was descheduled
      }
    }
  }

  // glu: Y[m, j] = silu(P[m, j]) * P[m, N/2 + j], in tasks of whole rows (M > 1) or one row's chunks
  void gated_unit() {
    if (!k_.glu_) return;
    const int64_t H = w_.N / 2;
    if (io_.M == 1) {
      kr_.silu_mul(P_, P_ + H, io_.Y, H);
      return;
    }
    const size_t M = static_cast<size_t>(io_.M), nt = std::min<size_t>(M, 8);
    auto task = [&](size_t t) noexcept {
      for (size_t m = t * M / nt; m < (t + 1) * M / nt; ++m)
        kr_.silu_mul(P_ + m * w_.N, P_ + m * w_.N + H, io_.Y + m * H, H);
    };
    parallel_for(ctx_, nt, task);
  }

  // rows with a non-finite input are NaN; a non-finite output of a finite row is recomputed in double
  void finish() {
    const int64_t N = w_.N, K = w_.K;
    std::vector<float> wrow;
    std::vector<double> xh;
    for (int64_t m = 0; m < io_.M; ++m) {
      float* y = P_ + m * N;
      if (!finite_[m]) {
        std::fill(y, y + N, NAN);
        continue;
      }
      bool ok = true;
      if (ntask_)  // M = 1: the tasks' verdicts
        for (size_t t = 0; t < ntask_; ++t) ok &= task_finite_[t] != 0;
      else
        ok = gemm_kernels().all_finite(y, N) != 0;  // the process ISA's vector check
      if (ok) continue;
      metrics::add(k_.m_nonfinite_, 1.0);
      dequantized_activations(io_.X + m * K, K, w_.act_bits, xh);
      wrow.resize(static_cast<size_t>(K));
      for (int64_t n = 0; n < N; ++n) {
        kr_.dequant_row(&w_, n, wrow.data());
        double s = bias_ ? static_cast<double>(bias_[n]) : 0.0;
        for (int64_t kk = 0; kk < K; ++kk) s += xh[static_cast<size_t>(kk)] * static_cast<double>(wrow[static_cast<size_t>(kk)]);
        y[n] = static_cast<float>(s);
      }
    }
  }

 private:
  const BlockQuantMatMulKernel& k_;
  Ort::KernelContext& ctx_;
  const RowsIO& io_;
  const BqLayer& w_;
  const BlockQuantKernels& kr_;
  const float* bias_;
  size_t ab_ = 0;
  uint8_t* xq_ = nullptr;
  float* P_ = nullptr;  // the product [M, N]: Y, or scratch with glu
  uint8_t* finite_ = nullptr;
  static constexpr int kXDone = 0, kXPending = 1, kXBusy = 2;
  std::atomic<int> x_state_{kXDone};    // M = 1: whether the activations are quantized yet
  size_t ntask_ = 0;                    // M = 1: the tasks of multiply(), each with its outputs' verdict
  uint8_t task_finite_[kMaxTasks] = {};
};

void BlockQuantMatMulKernel::Compute(Ort::KernelContext& ctx) const {
  const RowsIO io = rows_io(ctx, node_.w.K, glu_ ? node_.w.N / 2 : node_.w.N);
  const float* bias = bias_;
  if (has_bias_ && !bias) {  // a bias computed in the graph: checked per call
    Ort::ConstValue bv = ctx.GetInput(2);
    auto ti = bv.GetTensorTypeAndShapeInfo();
    if (ti.GetShape() != std::vector<int64_t>{node_.w.N})
      fail("input bias has shape " + shape_str(ti.GetShape()) + ", expected [" + std::to_string(node_.w.N) + "]");
    bias = bv.GetTensorData<float>();
  }
  metrics::add(m_calls_, 1.0);
  if (io.M == 0) return;
  metrics::add(m_rows_, static_cast<double>(io.M));
  const bool timed = m_time_[0] && io.M == 1;
  const Clock::time_point t0 = timed ? Clock::now() : Clock::time_point{};
  BqCall c(*this, ctx, io, bias);
  c.quantize_rows();
  c.multiply();
  c.finish();
  c.gated_unit();
  if (timed) {
    metrics::add(m_time_[0], elapsed_us(t0, Clock::now()));
    metrics::add(m_time_[6], 1.0);
  }
}

// ------------------------------------------------------------------ BlockQuantGather
BlockQuantGatherKernel::BlockQuantGatherKernel(const Ort::ConstKernelInfo& info) : OpKernel(info) {
  const Attrs at(info, kAttrs);
  read_bq_node(info, at, 0, 8, node_);
  metrics::Node* m = metrics::node(name_);
  m->set({{"bq.format", static_cast<double>(node_.w.format)},
          {"bq.block", static_cast<double>(node_.w.block)},
          {"bq.bits_per_weight", 8.0 * node_.w.type_size / node_.w.block}});
  m->counters({{&m_calls_, "bq.calls"}, {&m_rows_, "bq.rows"}});
}

void BlockQuantGatherKernel::Compute(Ort::KernelContext& ctx) const {
  const BqLayer& w = node_.w;
  Ort::ConstValue iv = ctx.GetInput(1);
  auto ti = iv.GetTensorTypeAndShapeInfo();
  const ONNXTensorElementDataType t = ti.GetElementType();
  if (t != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 && t != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32)
    fail("input indices must be int64 or int32");
  std::vector<int64_t> shape = ti.GetShape();
  const size_t n = ti.GetElementCount();
  shape.push_back(w.K);
  std::vector<int64_t> rows(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t v = t == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 ? iv.GetTensorData<int64_t>()[i]
                                                                : static_cast<int64_t>(iv.GetTensorData<int32_t>()[i]);
    if (v < -w.N || v >= w.N)
      fail("index " + std::to_string(v) + " (position " + std::to_string(i) + " of indices) out of range [-" +
           std::to_string(w.N) + ", " + std::to_string(w.N - 1) + "]");
    rows[i] = v < 0 ? v + w.N : v;
  }
  float* y = ctx.GetOutput(0, shape.data(), shape.size()).GetTensorMutableData<float>();
  metrics::add(m_calls_, 1.0);
  metrics::add(m_rows_, static_cast<double>(n));
  const BlockQuantKernels& kr = *node_.k;
  const int64_t K = w.K;
  auto one = [&](size_t i) noexcept { kr.dequant_row(&w, rows[i], y + static_cast<int64_t>(i) * K); };
  if (n * static_cast<size_t>(K) < (size_t{1} << 16)) {
    for (size_t i = 0; i < n; ++i) one(i);
    return;
  }
  const size_t nt = std::min<size_t>(n, 16);
  auto task = [&](size_t tk) noexcept {
    for (size_t i = tk * n / nt; i < (tk + 1) * n / nt; ++i) one(i);
  };
  parallel_for(ctx, nt, task);
}

}  // namespace ortlean
