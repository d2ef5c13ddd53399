// ortlean_stream_floor_ns: the time to read a model's weight buffers once with nothing else done -- the
// memory floor of a decode step that `ortlean bench` prints beside the model's own step. Not a kernel
// (it runs no ORT node and uses no ORT pool): its own threads, created and parked before the clock starts.
//
// Each buffer is split into `threads` contiguous shares of whole 64-byte lines; a thread reads its share
// of every buffer as `streams` sub-ranges in lockstep (1: one sequential pass; the block-quant kernels read
// 4-8 rows an eighth of a task apart), each prefetched `pf` bytes ahead (0: no software prefetch). With
// `sync`, every thread waits at a spin barrier after its share of each buffer, as a runtime that runs one
// node at a time across its threads must wait for the node's slowest thread before the next node (ORT's
// executor, ggml's graph compute): what that costs pure streaming is the step's synchronization floor.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <chrono>
#include <thread>
#include <vector>

#include <emmintrin.h>
#include <pthread.h>
#include <sched.h>
#include <xmmintrin.h>

#define ORTLEAN_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

struct SpinBarrier {
  std::atomic<int> count{0}, gen{0};
  int n = 1;
  void wait() {
    const int g = gen.load(std::memory_order_acquire);
    if (count.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      count.store(0, std::memory_order_relaxed);
      gen.fetch_add(1, std::memory_order_acq_rel);
    } else {
      while (gen.load(std::memory_order_acquire) == g) _mm_pause();
    }
  }
};

// XOR of the 16-byte words of [p, p + n) (n a multiple of 64) read as `streams` equal runs of whole lines
// in lockstep, each prefetched pf bytes ahead; the tail lines past streams * run are read after.
__m128i read_range(const uint8_t* p, int64_t n, int streams, int64_t pf) {
  __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
  const int64_t lines = n / 64, run = lines / streams * 64;
  for (int64_t o = 0; o < run; o += 64) {
    for (int s = 0; s < streams; ++s) {
      const uint8_t* q = p + s * run + o;
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(q + pf), _MM_HINT_T0);
      a0 = _mm_xor_si128(a0, _mm_load_si128(reinterpret_cast<const __m128i*>(q)));
      a1 = _mm_xor_si128(a1, _mm_load_si128(reinterpret_cast<const __m128i*>(q + 16)));
      a2 = _mm_xor_si128(a2, _mm_load_si128(reinterpret_cast<const __m128i*>(q + 32)));
      a3 = _mm_xor_si128(a3, _mm_load_si128(reinterpret_cast<const __m128i*>(q + 48)));
    }
  }
  for (int64_t o = streams * run; o < lines * 64; o += 64) {
    a0 = _mm_xor_si128(a0, _mm_load_si128(reinterpret_cast<const __m128i*>(p + o)));
    a1 = _mm_xor_si128(a1, _mm_load_si128(reinterpret_cast<const __m128i*>(p + o + 16)));
    a2 = _mm_xor_si128(a2, _mm_load_si128(reinterpret_cast<const __m128i*>(p + o + 32)));
    a3 = _mm_xor_si128(a3, _mm_load_si128(reinterpret_cast<const __m128i*>(p + o + 48)));
  }
  return _mm_xor_si128(_mm_xor_si128(a0, a1), _mm_xor_si128(a2, a3));
}

// Pins the calling thread to one CPU for the life of the object and restores its mask after. The pass's
// threads each take their own CPU of the caller's mask (when it has enough): a new thread starts on its
// parent's CPU, and two spinning threads on one CPU turn every barrier into a scheduler time slice
// (measured: a 2-thread barrier floor 4x too slow in most passes until pinned).
struct PinGuard {
  cpu_set_t saved;
  bool ok = false;
  explicit PinGuard(int cpu) {
    if (cpu < 0 || pthread_getaffinity_np(pthread_self(), sizeof saved, &saved) != 0) return;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    ok = pthread_setaffinity_np(pthread_self(), sizeof one, &one) == 0;
  }
  ~PinGuard() {
    if (ok) pthread_setaffinity_np(pthread_self(), sizeof saved, &saved);
  }
};

// The CPUs of the calling thread's mask, in order (empty when it cannot be read)
std::vector<int> allowed_cpus() {
  cpu_set_t m;
  std::vector<int> out;
  if (pthread_getaffinity_np(pthread_self(), sizeof m, &m) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &m)) out.push_back(c);
  return out;
}

}  // namespace

// One pass over n buffers (bufs[i]: bytes[i] bytes, 64-byte aligned, bytes a multiple of 64) by `threads`
// threads (1..64), as described above. Returns the nanoseconds from the start signal to the last thread's
// end, and in *checksum (when not null) the XOR of every 8-byte word read (so a caller can check that
// every byte was read); 0 on bad arguments.
ORTLEAN_EXPORT uint64_t ortlean_stream_floor_ns(const void* const* bufs, const int64_t* bytes, int n, int threads,
                                                int streams, int64_t pf, int sync, uint64_t* checksum) {
  if (!bufs || !bytes || n < 1 || threads < 1 || threads > 64 || streams < 1 || streams > 64 || pf < 0) return 0;
  for (int i = 0; i < n; ++i)
    if (!bufs[i] || bytes[i] < 0 || bytes[i] % 64 || reinterpret_cast<uintptr_t>(bufs[i]) % 64) return 0;
  try {
    SpinBarrier bar;
    bar.n = threads;
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::vector<uint64_t> sums(static_cast<size_t>(threads));
    std::vector<std::chrono::steady_clock::time_point> ends(static_cast<size_t>(threads));
    auto part = [&](int t) {
      __m128i x = _mm_setzero_si128();
      for (int i = 0; i < n; ++i) {
        const int64_t lines = bytes[i] / 64, share = (lines + threads - 1) / threads;
        const int64_t l0 = std::min<int64_t>(lines, share * t), l1 = std::min<int64_t>(lines, l0 + share);
        x = _mm_xor_si128(x, read_range(static_cast<const uint8_t*>(bufs[i]) + 64 * l0, 64 * (l1 - l0), streams, pf));
        if (sync) bar.wait();
      }
      uint64_t w[2];
      std::memcpy(w, &x, sizeof w);
      sums[static_cast<size_t>(t)] = w[0] ^ w[1];
      ends[static_cast<size_t>(t)] = std::chrono::steady_clock::now();
    };
    const std::vector<int> cpus = allowed_cpus();
    const bool pin = static_cast<int>(cpus.size()) >= threads;  // one CPU a thread, else as the OS places them
    std::atomic<bool> abort{false};
    std::vector<std::thread> pool;
    pool.reserve(static_cast<size_t>(threads - 1));
    try {
      for (int t = 1; t < threads; ++t)
        pool.emplace_back([&, t] {
          if (pin) {
            cpu_set_t one;
            CPU_ZERO(&one);
            CPU_SET(cpus[static_cast<size_t>(t)], &one);
            pthread_setaffinity_np(pthread_self(), sizeof one, &one);
          }
          ready.fetch_add(1, std::memory_order_acq_rel);
          while (!go.load(std::memory_order_acquire)) _mm_pause();
          if (!abort.load(std::memory_order_acquire)) part(t);
        });
    } catch (...) {  // a thread could not be created: release the ones that were, then no figure
      abort.store(true, std::memory_order_release);
      go.store(true, std::memory_order_release);
      for (auto& th : pool) th.join();
      return 0;
    }
    PinGuard main_pin(pin && threads > 1 ? cpus[0] : -1);  // the caller's mask comes back at return
    while (ready.load(std::memory_order_acquire) < threads - 1) _mm_pause();
    const auto t0 = std::chrono::steady_clock::now();
    go.store(true, std::memory_order_release);
    part(0);
    for (auto& th : pool) th.join();
    auto end = ends[0];
    uint64_t x = 0;
    for (int t = 0; t < threads; ++t) {
      if (ends[static_cast<size_t>(t)] > end) end = ends[static_cast<size_t>(t)];
      x ^= sums[static_cast<size_t>(t)];
    }
    if (checksum) *checksum = x;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(end - t0).count();
    return ns > 0 ? static_cast<uint64_t>(ns) : 1;
  } catch (...) {  // the bookkeeping vectors could not be allocated (before any thread): no figure
    return 0;
  }
}
