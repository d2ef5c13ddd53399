// ONNX Runtime C++ API (headers only; the library never links libonnxruntime: the API table is
// set in RegisterCustomOps) and helpers shared by every op.
#pragma once
#ifndef ORT_API_MANUAL_INIT
#define ORT_API_MANUAL_INIT
#endif
#include <onnxruntime_cxx_api.h>

#include <atomic>
#include <cmath>
#include <functional>
#include <thread>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace ortlean {

// The C API version the library asks for: that of ORT 1.21, so it loads in every runtime >= 1.21.
constexpr uint32_t kOrtApiVersion = 21;
static_assert(ORT_API_VERSION >= kOrtApiVersion, "ONNX Runtime headers older than 1.21");

// Error carrying an OrtErrorCode (validation failures use ORT_INVALID_ARGUMENT).
struct OpError : std::runtime_error {
  OrtErrorCode code;
  OpError(OrtErrorCode c, const std::string& msg) : std::runtime_error(msg), code(c) {}
};
[[noreturn]] inline void fail(const std::string& msg) { throw OpError(ORT_INVALID_ARGUMENT, msg); }

// Runs f() and turns any exception into an OrtStatus (nothing may cross the C boundary).
template <class F>
OrtStatus* status_guard(const std::string& prefix, F&& f) noexcept {
  const OrtApi& api = Ort::GetApi();
  try {
    f();
    return nullptr;
  } catch (const OpError& e) {
    return api.CreateStatus(e.code, (prefix + e.what()).c_str());
  } catch (const Ort::Exception& e) {
    return api.CreateStatus(e.GetOrtErrorCode(), (prefix + e.what()).c_str());
  } catch (const std::bad_alloc&) {
    return api.CreateStatus(ORT_FAIL, (prefix + "out of memory").c_str());
  } catch (const std::exception& e) {
    return api.CreateStatus(ORT_FAIL, (prefix + e.what()).c_str());
  } catch (...) {
    return api.CreateStatus(ORT_FAIL, (prefix + "unknown error").c_str());
  }
}

// "[2, 3, 4]": shapes in error messages.
inline std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

// The float attribute as the shortest decimal that rounds back to it (0.01f -> 0.01, not
// 0.009999999776), so metrics show what the rewriter wrote.
inline double float_attr_value(float f) {
  if (!std::isfinite(f)) return static_cast<double>(f);
  char buf[32];
  for (int prec = 6; prec <= 9; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, static_cast<double>(f));
    if (std::strtof(buf, nullptr) == f) return std::strtod(buf, nullptr);
  }
  return static_cast<double>(f);
}

// CreateKernelV2 body shared by every op: builds Kernel(api, info) and turns any failure into a
// status whose message names the op and the node ("ortlean TTMatMul node '/x/MatMul': ...").
template <class Kernel>
OrtStatus* create_kernel_guarded(const char* op_type, const OrtApi& api, const OrtKernelInfo* info,
                                 void** op_kernel) noexcept {
  *op_kernel = nullptr;
  std::string prefix = std::string("ortlean ") + op_type + ": ";
  if (OrtStatus* st = status_guard(prefix, [&] {
        prefix = std::string("ortlean ") + op_type + " node '" + Ort::ConstKernelInfo{info}.GetNodeName() + "': ";
      }))
    return st;
  return status_guard(prefix, [&] { *op_kernel = new Kernel(api, info); });
}

// 64-byte aligned float buffer (packed weights).
class AlignedBuf {
 public:
  AlignedBuf() = default;
  explicit AlignedBuf(size_t n) { resize(n); }
  AlignedBuf(const AlignedBuf&) = delete;
  AlignedBuf& operator=(const AlignedBuf&) = delete;
  AlignedBuf(AlignedBuf&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  AlignedBuf& operator=(AlignedBuf&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~AlignedBuf() { std::free(p_); }
  void resize(size_t n) {
    std::free(p_);
    p_ = nullptr;
    n_ = 0;
    if (!n) return;
    const size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
    p_ = static_cast<float*>(std::aligned_alloc(64, bytes));
    if (!p_) throw std::bad_alloc();
    n_ = n;
  }
  float* data() { return p_; }
  const float* data() const { return p_; }
  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }

 private:
  float* p_ = nullptr;
  size_t n_ = 0;
};

// Per-thread scratch that only grows (no heap traffic per call once warm). Two levels so a
// Compute() on a thread can hold the "outer" buffer while ORT's ParallelFor runs tasks (which use
// the "task" buffer) on the same thread.
struct Scratch {
  AlignedBuf buf;
  float* get(size_t n) {
    if (buf.size() < n) buf.resize(n + n / 4 + 64);
    return buf.data();
  }
};
Scratch& outer_scratch();
Scratch& task_scratch();
Scratch& gemm_scratch();  // innermost: within one product (never held across a call into others)

inline size_t round_up16(size_t n) { return (n + 15) / 16 * 16; }

// Runs f(i) for i in [0, n) on ORT's intra-op pool (inline when n == 1). f must not throw.
template <class F>
void parallel_for(const Ort::KernelContext& ctx, size_t n, F& f) {
  if (n == 0) return;
  if (n == 1) {
    f(size_t{0});
    return;
  }
  ctx.ParallelFor([](void* u, size_t i) { (*static_cast<F*>(u))(i); }, n, 0, &f);
}

// Whether the session's intra-op pool runs tasks on more than one thread. The C API does not
// expose the pool size, so a kernel learns it from its own parallel_for calls: tasks record the
// thread that ran them; one call seen on two threads = parallel (sticky), 8 calls of >= 2 tasks
// all on the calling thread = sequential (intra_op_num_threads = 1). Splitting a memory-bound
// matvec into tasks that then run one after another only restarts the streams and adds partial
// sums (measured: 20.4 vs 19.7 ms per SmolLM2 decode step). Thread-safe; one per kernel.
class PoolProbe {
 public:
  // 0 unknown, 1 sequential, 2 parallel
  int width() const { return width_.load(std::memory_order_relaxed); }

  template <class F>
  void run(const Ort::KernelContext& ctx, size_t n, F& f) {
    if (n < 2 || width() != 0) {
      parallel_for(ctx, n, f);
      return;
    }
    const size_t me = std::hash<std::thread::id>{}(std::this_thread::get_id());
    std::atomic<bool> other{false};
    auto g = [&](size_t i) noexcept {
      if (std::hash<std::thread::id>{}(std::this_thread::get_id()) != me) other.store(true, std::memory_order_relaxed);
      f(i);
    };
    parallel_for(ctx, n, g);
    if (other.load()) {
      width_.store(2, std::memory_order_relaxed);
    } else if (probes_.fetch_add(1, std::memory_order_relaxed) + 1 >= 8) {
      int expect = 0;
      width_.compare_exchange_strong(expect, 1, std::memory_order_relaxed);
    }
  }

 private:
  std::atomic<int> width_{0};
  std::atomic<int> probes_{0};
};

// Reads attribute `name` into out; false when the node has no such attribute (any other error,
// e.g. a type mismatch, propagates).
template <class T>
bool try_attribute(const Ort::ConstKernelInfo& info, const char* name, T& out) {
  try {
    out = info.GetAttribute<T>(name);
    return true;
  } catch (const Ort::Exception& e) {
    if (std::strstr(e.what(), "No attribute")) return false;
    throw;
  }
}
inline bool try_attributes(const Ort::ConstKernelInfo& info, const char* name, std::vector<int64_t>& out) {
  try {
    out = info.GetAttributes<int64_t>(name);
    return true;
  } catch (const Ort::Exception& e) {
    if (std::strstr(e.what(), "No attribute")) return false;
    throw;
  }
}

}  // namespace ortlean
