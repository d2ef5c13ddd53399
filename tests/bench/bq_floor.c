/* Compute floor of a 4-bit M = 1 row dot, for tests/bench/bench_blockquant_op.py: the least work any
   kernel of BlockQuantMatMul's numerics (u8 weights x s8 activations by vpdpbusd, int32 lanes to float,
   a float scale per lane) does per 64 weight bytes, with nothing else (no block headers, no scale
   extraction, no activation layout, no ORT call). Built by the bench with the system C compiler for
   AVX-512 VNNI (only where the CPU has it); not part of the library.

   bq_floor_ns(W, rows, row_bytes, xl, xh, lanes, mode, reps): nanoseconds for reps passes over the rows
   of W (row_bytes a multiple of 64; rows a multiple of 4; 4 rows interleaved, as the op's kernel), the
   activations xl / xh of row_bytes bytes each, lanes 16 int32 lane indices (< 16).
     mode 1: per vector: and, shift, and, two vpdpbusd into the row's int32 accumulator;
     mode 2: per vector: the same into a fresh int32 sum, to float, times a per-lane scale (vpermps of the
             row's 16 scales by the lane map), into the row's float accumulator (what a kernel must do
             when a vector's lanes hold several blocks with their own scales). */
#include <immintrin.h>
#include <stdint.h>
#include <time.h>

static double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return 1e9 * (double)t.tv_sec + (double)t.tv_nsec;
}

static float pass_int(const uint8_t* W, int64_t rows, int64_t nv, const int8_t* xl, const int8_t* xh) {
  const __m512i m4 = _mm512_set1_epi8(15);
  __m512i tot = _mm512_setzero_si512();
  for (int64_t n = 0; n + 4 <= rows; n += 4) {
    const uint8_t* r0 = W + n * nv * 64;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t p = 0; p < nv; ++p) {
      const __m512i x = _mm512_loadu_si512(xl + 64 * p), y = _mm512_loadu_si512(xh + 64 * p);
      __m512i L;
#define ROW(a, r)                                                                                     \
  L = _mm512_loadu_si512(r0 + (r) * nv * 64 + 64 * p);                                                \
  a = _mm512_dpbusd_epi32(a, _mm512_and_si512(L, m4), x);                                            \
  a = _mm512_dpbusd_epi32(a, _mm512_and_si512(_mm512_srli_epi16(L, 4), m4), y);
      ROW(a0, 0) ROW(a1, 1) ROW(a2, 2) ROW(a3, 3)
#undef ROW
    }
    tot = _mm512_add_epi32(tot, _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)));
  }
  return (float)_mm512_reduce_add_epi32(tot);
}

static float pass_scaled(const uint8_t* W, int64_t rows, int64_t nv, const int8_t* xl, const int8_t* xh,
                         const int32_t* lanes) {
  const __m512i m4 = _mm512_set1_epi8(15), z = _mm512_setzero_si512(), e = _mm512_loadu_si512(lanes);
  __m512 tot = _mm512_setzero_ps();
  for (int64_t n = 0; n + 4 <= rows; n += 4) {
    const uint8_t* r0 = W + n * nv * 64;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const __m512 s0 = _mm512_set1_ps(1.0f + (float)n), s1 = _mm512_add_ps(s0, s0), s2 = _mm512_mul_ps(s0, s0),
                 s3 = _mm512_sub_ps(s2, s0);
    for (int64_t p = 0; p < nv; ++p) {
      const __m512i x = _mm512_loadu_si512(xl + 64 * p), y = _mm512_loadu_si512(xh + 64 * p);
      __m512i L, d;
#define ROW(a, s, r)                                                                                  \
  L = _mm512_loadu_si512(r0 + (r) * nv * 64 + 64 * p);                                                \
  d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, _mm512_and_si512(L, m4), x),                         \
                          _mm512_and_si512(_mm512_srli_epi16(L, 4), m4), y);                          \
  a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(e, s), a);
      ROW(a0, s0, 0) ROW(a1, s1, 1) ROW(a2, s2, 2) ROW(a3, s3, 3)
#undef ROW
    }
    tot = _mm512_add_ps(tot, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
  return _mm512_reduce_add_ps(tot);
}

volatile float bq_floor_sink;

double bq_floor_ns(const uint8_t* W, int64_t rows, int64_t row_bytes, const int8_t* xl, const int8_t* xh,
                   const int32_t* lanes, int mode, int64_t reps) {
  const int64_t nv = row_bytes / 64;
  float s = 0.0f;
  const double t0 = now_ns();
  for (int64_t i = 0; i < reps; ++i)
    s += mode == 1 ? pass_int(W, rows, nv, xl, xh) : pass_scaled(W, rows, nv, xl, xh, lanes);
  const double t = now_ns() - t0;
  bq_floor_sink = s;
  return t;
}
