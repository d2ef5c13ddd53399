// Work split over ONNX Runtime's intra-op pool (KernelContext_ParallelFor; never OpenMP).
#pragma once
#include <atomic>
#include <cstddef>
#include <functional>
#include <thread>

#include "ort_api.h"

namespace ortlean {

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

// Whether the session's intra-op pool runs tasks on more than one thread, and on how many. The C API
// does not expose the pool size, so a kernel learns it from its own parallel_for calls: tasks record the
// thread that ran them; one call seen on two threads = parallel (sticky), 8 calls of >= 2 tasks all on
// the calling thread = sequential (intra_op_num_threads = 1). Splitting a memory-bound matvec into tasks
// that then run one after another only restarts the streams and adds partial sums (measured: 20.4 vs
// 19.7 ms per SmolLM2 decode step). The first kProbes calls of >= 2 tasks also count the distinct threads
// that ran them: threads() is the most seen in one call once those calls are done (0 before), a lower
// bound of the pool's size that a kernel may size its tasks by. Thread-safe; one per kernel.
class PoolProbe {
 public:
  static constexpr int kProbes = 8;
  // 0 unknown, 1 sequential, 2 parallel
  int width() const { return width_.load(std::memory_order_relaxed); }
  // 0 while probing; then the most distinct threads one call ran on (1: sequential)
  int threads() const { return done_.load(std::memory_order_acquire) ? threads_.load(std::memory_order_relaxed) : 0; }

  template <class F>
  void run(const Ort::KernelContext& ctx, size_t n, F& f) {
    if (n < 2 || done_.load(std::memory_order_acquire)) {
      parallel_for(ctx, n, f);
      return;
    }
    constexpr size_t kSlots = 16;  // tasks past the first 16 are not recorded
    std::atomic<size_t> ids[kSlots];
    for (auto& v : ids) v.store(0, std::memory_order_relaxed);
    auto g = [&](size_t i) noexcept {
      if (i < kSlots) ids[i].store(std::hash<std::thread::id>{}(std::this_thread::get_id()) | 1, std::memory_order_relaxed);
      f(i);
    };
    parallel_for(ctx, n, g);
    int distinct = 0;
    const size_t m = n < kSlots ? n : kSlots;
    for (size_t i = 0; i < m; ++i) {
      const size_t v = ids[i].load(std::memory_order_relaxed);
      bool seen = false;
      for (size_t j = 0; j < i && !seen; ++j) seen = ids[j].load(std::memory_order_relaxed) == v;
      distinct += seen ? 0 : 1;
    }
    int cur = threads_.load(std::memory_order_relaxed);
    while (distinct > cur && !threads_.compare_exchange_weak(cur, distinct, std::memory_order_relaxed)) {
    }
    if (distinct > 1) width_.store(2, std::memory_order_relaxed);
    if (probes_.fetch_add(1, std::memory_order_relaxed) + 1 >= kProbes) {
      int expect = 0;
      width_.compare_exchange_strong(expect, 1, std::memory_order_relaxed);
      done_.store(true, std::memory_order_release);
    }
  }

 private:
  std::atomic<int> width_{0};
  std::atomic<int> threads_{0};
  std::atomic<int> probes_{0};
  std::atomic<bool> done_{false};
};

}  // namespace ortlean
