/* The int8 multiply-add peak of this core and its clock, for tests/bench/bench_blockquant_op.py's prefill rows
   (issue 58: BlockQuantMatMul at M >= 64 against the int8 peak of the ISA it runs). Built by the bench with
   the system C compiler; each loop carries its own target attribute and the bench calls only those the
   CPU has (cpu flags). Not part of the library.

   clock_ns(n):  n iterations of 8 dependent integer adds (1 cycle each): cycles = 8 n, so 8 n / ns = GHz.
   peak_ns(isa, reps): reps iterations of independent multiply-add chains of the ISA's widest int8 dot:
     isa 2: 12 chains of AVX-512 VNNI vpdpbusd zmm (64 u8 x s8 products into 16 int32 lanes, one
            instruction): reps * 12 * 64 products;
     isa 1: 6 chains of AVX2 vpmaddubsw + vpmaddwd + vpaddd (32 products, three instructions), the u8 x s8
            dot of a CPU without VNNI: reps * 6 * 32 products;
   products / ns = the core's int8 multiply-adds per ns. */
#include <immintrin.h>
#include <stdint.h>
#include <time.h>

static double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return 1e9 * (double)t.tv_sec + (double)t.tv_nsec;
}

volatile int64_t int8_peak_sink;

double clock_ns(int64_t n) {
  int64_t x = 0;
  const double t0 = now_ns();
  for (int64_t i = 0; i < n; ++i)
    __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                     "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  const double t = now_ns() - t0;
  int8_peak_sink = x;
  return t;
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static double peak512(int64_t reps) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
          a9 = a0, a10 = a0, a11 = a0;
  const __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(-2);
  const double t0 = now_ns();
  for (int64_t i = 0; i < reps; ++i) {
    // every chain opaque every iteration: the 12 chains start equal and take equal inputs, so a compiler
    // that sees through them merges them into one (GCC 12 -O2 kept 5 of 12: a peak 2.4x too high)
    __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7),
                     "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
    a0 = _mm512_dpbusd_epi32(a0, u, s);
    a1 = _mm512_dpbusd_epi32(a1, u, s);
    a2 = _mm512_dpbusd_epi32(a2, u, s);
    a3 = _mm512_dpbusd_epi32(a3, u, s);
    a4 = _mm512_dpbusd_epi32(a4, u, s);
    a5 = _mm512_dpbusd_epi32(a5, u, s);
    a6 = _mm512_dpbusd_epi32(a6, u, s);
    a7 = _mm512_dpbusd_epi32(a7, u, s);
    a8 = _mm512_dpbusd_epi32(a8, u, s);
    a9 = _mm512_dpbusd_epi32(a9, u, s);
    a10 = _mm512_dpbusd_epi32(a10, u, s);
    a11 = _mm512_dpbusd_epi32(a11, u, s);
  }
  const double t = now_ns() - t0;
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                               _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
  r = _mm512_add_epi32(r, _mm512_add_epi32(_mm512_add_epi32(a8, a9), _mm512_add_epi32(a10, a11)));
  int8_peak_sink = _mm512_reduce_add_epi32(r);
  return t;
}

__attribute__((target("avx2"))) static double peak256(int64_t reps) {
  // 6 chains of different inputs (12 would need more than the 16 ymm registers), each input made opaque
  // every iteration so that the products are computed, not hoisted
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
  __m256i u0 = _mm256_set1_epi8(3), u1 = _mm256_set1_epi8(5), u2 = _mm256_set1_epi8(7), u3 = _mm256_set1_epi8(9),
          u4 = _mm256_set1_epi8(11), u5 = _mm256_set1_epi8(13);
  const __m256i s = _mm256_set1_epi8(-2), one = _mm256_set1_epi16(1);
  const double t0 = now_ns();
  for (int64_t i = 0; i < reps; ++i) {
    __asm__ volatile("" : "+x"(u0), "+x"(u1), "+x"(u2), "+x"(u3), "+x"(u4), "+x"(u5));
    a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_maddubs_epi16(u0, s), one));
    a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_maddubs_epi16(u1, s), one));
    a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(_mm256_maddubs_epi16(u2, s), one));
    a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(_mm256_maddubs_epi16(u3, s), one));
    a4 = _mm256_add_epi32(a4, _mm256_madd_epi16(_mm256_maddubs_epi16(u4, s), one));
    a5 = _mm256_add_epi32(a5, _mm256_madd_epi16(_mm256_maddubs_epi16(u5, s), one));
  }
  const double t = now_ns() - t0;
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)),
                               _mm256_add_epi32(a4, a5));
  int32_t o[8];
  _mm256_storeu_si256((__m256i*)o, r);
  int8_peak_sink = o[0] + o[7];
  return t;
}

double peak_ns(int isa, int64_t reps) { return isa == 2 ? peak512(reps) : peak256(reps); }

/* mix_ns(fmas, reps): reps iterations of 8 independent vpdpbusd zmm chains plus `fmas` (0 or 4) independent
   vfmadd231ps zmm chains, in registers (inline asm: nothing to merge): the cycles an iteration takes with and
   without the FMAs say whether the float epilogue of a block-quant product competes with vpdpbusd for its
   pipes (bench_blockquant_op.py prints both, as cycles per iteration at the measured clock). */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) double mix_ns(int fmas, int64_t reps) {
#define ORT_DP(r) "vpdpbusd %%zmm12, %%zmm13, %%zmm" #r "\n\t"
#define ORT_FMA(r) "vfmadd231ps %%zmm14, %%zmm15, %%zmm" #r "\n\t"
  const double t0 = now_ns();
  if (fmas)
    for (int64_t i = 0; i < reps; ++i)
      __asm__ volatile(ORT_DP(0) ORT_DP(1) ORT_DP(2) ORT_DP(3) ORT_DP(4) ORT_DP(5) ORT_DP(6) ORT_DP(7)
                       ORT_FMA(8) ORT_FMA(9) ORT_FMA(10) ORT_FMA(11)
                       ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                       "xmm10", "xmm11");
  else
    for (int64_t i = 0; i < reps; ++i)
      __asm__ volatile(ORT_DP(0) ORT_DP(1) ORT_DP(2) ORT_DP(3) ORT_DP(4) ORT_DP(5) ORT_DP(6) ORT_DP(7)
                       ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7");
#undef ORT_DP
#undef ORT_FMA
  return now_ns() - t0;
}
