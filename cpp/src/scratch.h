// Buffers: 64-byte aligned float storage and the per-thread scratch every op uses for per-call
// work (kernels keep no per-call state in the instance: one kernel serves concurrent Run()s).
#pragma once
#include <cstddef>
#include <cstdlib>
#include <new>
#include <utility>

namespace ortlean {

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

}  // namespace ortlean
