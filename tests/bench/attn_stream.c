/* Streaming-read bound for tests/bench/attn_speed.py decode: reads `bytes` bytes from the start of
   each of n buffers (as the op reads its layers' caches), 4 independent 256-bit accumulators (the
   compiler vectorizes the 64-bit xor with -O3 -mavx2). Built by the bench with the system C
   compiler; not part of the library. */
#include <stddef.h>
#include <stdint.h>

uint64_t stream_read(const uint64_t* const* bufs, int n, size_t off_words, size_t words) {
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
  for (int b = 0; b < n; ++b) {
    const uint64_t* p = bufs[b] + off_words;
    size_t i = 0;
    for (; i + 8 <= words; i += 8) {
      a0 ^= p[i]; a1 ^= p[i + 1]; a2 ^= p[i + 2]; a3 ^= p[i + 3];
      a4 ^= p[i + 4]; a5 ^= p[i + 5]; a6 ^= p[i + 6]; a7 ^= p[i + 7];
    }
    for (; i < words; ++i) a0 ^= p[i];
  }
  return a0 ^ a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7;
}

/* The same read split over `threads` threads (each a contiguous share of every buffer's first `words`
   words), timed from the moment all threads are up (a spin barrier) to the last one's finish:
   nanoseconds (thread start-up is not timed; creating threads from Python was most of the 2-thread
   "bound" before). */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include <immintrin.h>

/* Words [off, off + words) of each of n buffers read as four interleaved streams (quarters of the
   range) with software prefetch pf bytes ahead on each: on some machines this reads faster than the
   one sequential stream above (tests/bench/bench_blockquant_op.py takes the faster of the two).
   Reads whole 32-byte chunks (a tail under 32 bytes is not read); returns the xor of the words read. */
uint64_t stream_read4(const uint64_t* const* bufs, int n, size_t off_words, size_t words, size_t pf) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  const size_t len = words * 8, q = len / 4 / 64 * 64;
  for (int b = 0; b < n; ++b) {
    const uint8_t* p = (const uint8_t*)(bufs[b] + off_words);
    for (size_t i = 0; i < q; i += 64) {
      const uint8_t* x0 = p + i;
      const uint8_t* x1 = x0 + q;
      const uint8_t* x2 = x1 + q;
      const uint8_t* x3 = x2 + q;
      _mm_prefetch((const char*)(x0 + pf), _MM_HINT_T0);
      _mm_prefetch((const char*)(x1 + pf), _MM_HINT_T0);
      _mm_prefetch((const char*)(x2 + pf), _MM_HINT_T0);
      _mm_prefetch((const char*)(x3 + pf), _MM_HINT_T0);
      a0 = _mm256_xor_si256(a0, _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)x0),
                                                 _mm256_loadu_si256((const __m256i*)(x0 + 32))));
      a1 = _mm256_xor_si256(a1, _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)x1),
                                                 _mm256_loadu_si256((const __m256i*)(x1 + 32))));
      a2 = _mm256_xor_si256(a2, _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)x2),
                                                 _mm256_loadu_si256((const __m256i*)(x2 + 32))));
      a3 = _mm256_xor_si256(a3, _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)x3),
                                                 _mm256_loadu_si256((const __m256i*)(x3 + 32))));
    }
    for (size_t i = 4 * q; i + 32 <= len; i += 32) a0 = _mm256_xor_si256(a0, _mm256_loadu_si256((const __m256i*)(p + i)));
  }
  a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
  return (uint64_t)_mm256_extract_epi64(a0, 0) ^ (uint64_t)_mm256_extract_epi64(a0, 1) ^
         (uint64_t)_mm256_extract_epi64(a0, 2) ^ (uint64_t)_mm256_extract_epi64(a0, 3);
}

/* A spin barrier for `n` threads (sense by generation): the per-layer barrier of stream_sync_mt */
typedef struct {
  atomic_int count, gen;
  int n;
} spin_barrier;

static void spin_wait(spin_barrier* b) {
  const int g = atomic_load(&b->gen);
  if (atomic_fetch_add(&b->count, 1) == b->n - 1) {
    atomic_store(&b->count, 0);
    atomic_fetch_add(&b->gen, 1);
  } else {
    while (atomic_load(&b->gen) == g) _mm_pause();
  }
}

typedef struct {
  const uint64_t* const* bufs;
  int n;
  size_t off, words, pf;  /* pf > 0: stream_read4 with that prefetch distance; 0: stream_read */
  atomic_int* ready;
  atomic_int* go;
  spin_barrier* sync;     /* non-null: every thread waits for the others after each buffer */
  uint64_t end_ns, sink;
} stream_part;

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static uint64_t stream_part_read(const stream_part* p) {
  if (!p->sync)
    return p->pf ? stream_read4(p->bufs, p->n, p->off, p->words, p->pf) : stream_read(p->bufs, p->n, p->off, p->words);
  uint64_t x = 0;
  for (int b = 0; b < p->n; ++b) {
    x ^= p->pf ? stream_read4(p->bufs + b, 1, p->off, p->words, p->pf) : stream_read(p->bufs + b, 1, p->off, p->words);
    spin_wait(p->sync);
  }
  return x;
}

static void* stream_worker(void* arg) {
  stream_part* p = (stream_part*)arg;
  atomic_fetch_add(p->ready, 1);
  while (!atomic_load(p->go)) {
  }
  p->sink = stream_part_read(p);
  p->end_ns = now_ns();
  return 0;
}

static uint64_t stream_mt(const uint64_t* const* bufs, int n, size_t words, int threads, size_t pf, int sync) {
  enum { kMax = 64 };
  if (threads < 1) threads = 1;
  if (threads > kMax) threads = kMax;
  pthread_t th[kMax];
  stream_part part[kMax];
  atomic_int ready = 0, go = 0;
  spin_barrier bar = {0, 0, threads};
  /* shares of whole 64-byte lines */
  const size_t share = ((words + (size_t)threads - 1) / (size_t)threads + 7) / 8 * 8;
  for (int i = 0; i < threads; ++i) {
    const size_t off = share * (size_t)i < words ? share * (size_t)i : words;
    const size_t w = words - off < share ? words - off : share;
    part[i] = (stream_part){bufs, n, off, w, pf, &ready, &go, sync ? &bar : 0, 0, 0};
  }
  for (int i = 1; i < threads; ++i) pthread_create(&th[i], 0, stream_worker, &part[i]);
  while (atomic_load(&ready) < threads - 1) {
  }
  const uint64_t t0 = now_ns();
  atomic_store(&go, 1);
  part[0].sink = stream_part_read(&part[0]);
  uint64_t end = now_ns();
  for (int i = 1; i < threads; ++i) {
    pthread_join(th[i], 0);
    if (part[i].end_ns > end) end = part[i].end_ns;
  }
  return end - t0;
}

uint64_t stream_read_mt(const uint64_t* const* bufs, int n, size_t words, int threads) {
  return stream_mt(bufs, n, words, threads, 0, 0);
}

/* stream_read_mt with stream_read4's four prefetched streams per thread */
uint64_t stream_read4_mt(const uint64_t* const* bufs, int n, size_t words, int threads, size_t pf) {
  return stream_mt(bufs, n, words, threads, pf ? pf : 64, 0);
}

/* The same reads, buffer by buffer: every thread waits at a spin barrier for the others after its share
   of each buffer, as a runtime that runs one layer (node) at a time across its threads must (pf > 0:
   stream_read4's loop, 0: stream_read's). The cheapest such hand-off; what it adds over stream_mt is
   what one synchronization per layer costs pure streaming (the shares restart, the faster thread waits). */
uint64_t stream_sync_mt(const uint64_t* const* bufs, int n, size_t words, int threads, size_t pf) {
  return stream_mt(bufs, n, words, threads, pf, 1);
}

/* Dependent loads: `steps` reads where each read's word holds the index of the next one (a random
   cycle over a buffer's cache lines, written by the caller): the memory latency, not hidden by any
   prefetcher or by overlap. Returns the last index (kept live). */
uint64_t chase(const uint64_t* buf, uint64_t start, size_t steps) {
  uint64_t i = start;
  for (size_t s = 0; s < steps; ++s) i = buf[i];
  return i;
}

/* A gather of n rows of row_bytes bytes (a multiple of 32) at base + offs[i], in the order given, each
   read whole (4 xor accumulators), with the rows `ahead` places later prefetched line by line (0: no
   software prefetch), as PackedAttention's attend reads its candidate rows. Returns the xor (kept
   live). */
uint64_t gather_rows(const uint8_t* base, const uint64_t* offs, size_t n, size_t row_bytes, size_t ahead) {
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  const size_t words = row_bytes / 8;
  for (size_t i = 0; i < n; ++i) {
    if (ahead && i + ahead < n) {
      const uint8_t* q = base + offs[i + ahead];
      for (size_t l = 0; l < row_bytes; l += 64) __builtin_prefetch(q + l, 0, 3);
    }
    const uint64_t* p = (const uint64_t*)(base + offs[i]);
    for (size_t w = 0; w + 4 <= words; w += 4) {
      a0 ^= p[w]; a1 ^= p[w + 1]; a2 ^= p[w + 2]; a3 ^= p[w + 3];
    }
  }
  return a0 ^ a1 ^ a2 ^ a3;
}
