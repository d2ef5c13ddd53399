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

}  // namespace ortlean
