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
