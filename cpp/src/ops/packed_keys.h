// The packed key format of PackedAttention (DEVELOPERS.md; custom_ops/reference/attn.py): one row
// of `words` uint32 per key, the graph I/O past_bits / present_bits (int32 [B, Hkv, T, words]).
//   plane words [planes * nw]: bit d of plane p is bit (d % 32) of word p*nw + d/32
//                              (sign: 1 plane, bit = k > 0; binary: 1 plane, |k| > eps;
//                               ternary: 2 planes, k > eps / k < -eps)
//                              (pq: the nibble codes, subspace s at bits 4 (s % 8) of word s / 8)
//   gamma [1]:                 float32 bits of the key's scale (mean |k| over the set bits, or
//                              over all d in sign mode; eps when no bit is set). pq rows have no gamma
//                              word (their score has no key scale): nw words, a 16-byte row at D = 64
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <emmintrin.h>

namespace ortlean {

enum class KeyMode { Sign = 0, Ternary = 1, Binary = 2, Pq = 3 };

constexpr int kPqWidth = 4, kPqCodes = 16;  // pq mode: dims per subspace, centroids per subspace

// Every lane the minimum / maximum of v's four lanes (SSE2; _mm_min_ps / _mm_max_ps semantics, the
// shuffled copy the second operand).
inline __m128 fold_min4(__m128 v) {
  v = _mm_min_ps(v, _mm_shuffle_ps(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_min_ps(v, _mm_shuffle_ps(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
}
inline __m128 fold_max4(__m128 v) {
  v = _mm_max_ps(v, _mm_shuffle_ps(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_max_ps(v, _mm_shuffle_ps(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
}

struct PackedKeyFormat {
  KeyMode mode;
  int64_t D;       // head dim
  int planes;      // 2 for ternary, else 1
  int64_t nw;      // words per plane, ceil(D / 32)
  int64_t words;   // per key: planes * nw + 1 (pq: nw)
  int64_t gamma;   // index of the gamma word (pq: -1, none)

  PackedKeyFormat(KeyMode m, int64_t d)
      : mode(m), D(d), planes(m == KeyMode::Ternary ? 2 : 1), nw((d + 31) / 32),
        words(planes * nw + (m == KeyMode::Pq ? 0 : 1)), gamma(m == KeyMode::Pq ? -1 : planes * nw) {}

  float gamma_of(const uint32_t* row) const {
    if (gamma < 0) return 1.0f;
    float g;
    std::memcpy(&g, row + gamma, 4);
    return g;
  }

  // Packs key k (element d at k[d * ldd]) into row (words uint32); eps: the eps modes' threshold.
  void pack(const float* k, int64_t ldd, float eps, uint32_t* row) const {
    if (ldd == 1 && D % 4 == 0 && mode != KeyMode::Pq) return pack4(k, eps, row);
    std::memset(row, 0, sizeof(uint32_t) * static_cast<size_t>(words));
    double asum = 0.0;
    int64_t cnt = 0;
    for (int64_t d = 0; d < D; ++d) {
      const float x = k[d * ldd];
      const float ax = std::fabs(x);
      const uint32_t bit = 1u << (d & 31);
      if (mode == KeyMode::Sign) {
        if (x > 0) row[d >> 5] |= bit;
        asum += ax;
      } else {
        if (ax > eps) {
          asum += ax;
          ++cnt;
        }
        if (mode == KeyMode::Ternary) {
          if (x > eps) row[d >> 5] |= bit;
          if (x < -eps) row[nw + (d >> 5)] |= bit;
        } else if (ax > eps) {
          row[d >> 5] |= bit;
        }
      }
    }
    const float g = mode == KeyMode::Sign ? static_cast<float>(asum / static_cast<double>(D))
                                          : (cnt ? static_cast<float>(asum / static_cast<double>(cnt)) : eps);
    std::memcpy(row + gamma, &g, 4);
  }

  // pack() of a contiguous key, four elements an SSE2 step (the baseline build): the same bits (NaN sets
  // none; sign mode adds its |x| to the sum, the eps modes skip it, as the scalar loop) and gamma from the
  // same double sum in another order — exact in practice (64 floats' magnitudes within 2^23 of each other
  // sum exactly in a double's 53 bits), as the reference's pairwise float64 sum. The scalar loop's branch
  // on each element's sign mispredicted about every other element of a key (~0.3 us a key).
  void pack4(const float* k, float eps, uint32_t* row) const {
    std::memset(row, 0, sizeof(uint32_t) * static_cast<size_t>(words));
    const __m128 absm = _mm_castsi128_ps(_mm_set1_epi32(0x7FFFFFFF)), zero = _mm_setzero_ps();
    const __m128 ve = _mm_set1_ps(eps), vne = _mm_set1_ps(-eps);
    __m128d s0 = _mm_setzero_pd(), s1 = _mm_setzero_pd();
    int64_t cnt = 0;
    for (int64_t d = 0; d < D; d += 4) {
      const __m128 x = _mm_loadu_ps(k + d), ax = _mm_and_ps(x, absm);
      const int sh = static_cast<int>(d & 31);
      __m128 add = ax;
      if (mode == KeyMode::Sign) {
        row[d >> 5] |= static_cast<uint32_t>(_mm_movemask_ps(_mm_cmpgt_ps(x, zero))) << sh;
      } else {
        const __m128 set = _mm_cmpgt_ps(ax, ve);
        const int ms = _mm_movemask_ps(set);
        add = _mm_and_ps(ax, set);
        cnt += __builtin_popcount(static_cast<unsigned>(ms));
        if (mode == KeyMode::Ternary) {
          row[d >> 5] |= static_cast<uint32_t>(_mm_movemask_ps(_mm_cmpgt_ps(x, ve))) << sh;
          row[nw + (d >> 5)] |= static_cast<uint32_t>(_mm_movemask_ps(_mm_cmplt_ps(x, vne))) << sh;
        } else {
          row[d >> 5] |= static_cast<uint32_t>(ms) << sh;
        }
      }
      s0 = _mm_add_pd(s0, _mm_cvtps_pd(add));
      s1 = _mm_add_pd(s1, _mm_cvtps_pd(_mm_movehl_ps(add, add)));
    }
    const __m128d t = _mm_add_pd(s0, s1);
    const double asum = _mm_cvtsd_f64(_mm_add_sd(t, _mm_unpackhi_pd(t, t)));
    const float g = mode == KeyMode::Sign ? static_cast<float>(asum / static_cast<double>(D))
                                          : (cnt ? static_cast<float>(asum / static_cast<double>(cnt)) : eps);
    std::memcpy(row + gamma, &g, 4);
  }

  // pq mode: subspace s of key k (element d at k[d]) is k[dims[4s + j]] (dims null: 4s + j), its code
  // the nearest of the 16 centroids of subspace s, centroid c's element j at bt[(s * 4 + j) * 16 + c] (the
  // node's book [D / 4][16][4] transposed: transpose_book; the 16 distances computed side by side)
  // (squared distance in float32, j summed in order; NaN counts as +inf; ties: the lower c; none finite:
  // 0). The reference (custom_ops/reference/attn.py pq_encode) matches this bit for bit: this file is
  // compiled without FMA contraction.
  void pack_pq(const float* k, const float* bt, const int64_t* dims, uint32_t* row) const {
    std::memset(row, 0, sizeof(uint32_t) * static_cast<size_t>(words));
    const int64_t ns = D / kPqWidth;
    for (int64_t s = 0; s < ns; ++s) {
      float x[kPqWidth];
      for (int j = 0; j < kPqWidth; ++j) x[j] = k[dims ? dims[s * kPqWidth + j] : s * kPqWidth + j];
      const float* b = bt + s * kPqWidth * kPqCodes;
      // 4 centroids an SSE2 instruction (x86-64 only: cpp/CMakeLists.txt); NaN distances become +inf,
      // then the code is the first lane equal to the minimum (all +inf: lane 0). Branch-free: the
      // running-minimum branch mispredicted ~3 times a subspace (~2,300 cycles a key in the model).
      static_assert(kPqCodes == 16, "the minimum below folds 4 vectors of 4");
      const __m128 inf = _mm_set1_ps(__builtin_inff());
      __m128 d4[kPqCodes / 4];
      for (int q = 0; q < kPqCodes / 4; ++q) {
        const int c0 = 4 * q;
        __m128 e = _mm_sub_ps(_mm_set1_ps(x[0]), _mm_loadu_ps(b + c0));
        __m128 acc = _mm_mul_ps(e, e);
        for (int j = 1; j < kPqWidth; ++j) {
          e = _mm_sub_ps(_mm_set1_ps(x[j]), _mm_loadu_ps(b + j * kPqCodes + c0));
          acc = _mm_add_ps(acc, _mm_mul_ps(e, e));
        }
        const __m128 ord = _mm_cmpord_ps(acc, acc);
        d4[q] = _mm_or_ps(_mm_and_ps(ord, acc), _mm_andnot_ps(ord, inf));
      }
      const __m128 mn = fold_min4(_mm_min_ps(_mm_min_ps(d4[0], d4[1]), _mm_min_ps(d4[2], d4[3])));
      unsigned eq = 0;
      for (int q = 0; q < kPqCodes / 4; ++q)
        eq |= static_cast<unsigned>(_mm_movemask_ps(_mm_cmpeq_ps(d4[q], mn))) << (4 * q);
      const uint32_t code = static_cast<uint32_t>(__builtin_ctz(eq));
      row[s / 8] |= code << (4 * (s % 8));
    }
  }

  // pack_pq's bt from n centroid groups of 16 x 4 (book [n][16][4] -> [n][4][16])
  static std::vector<float> transpose_book(const std::vector<float>& book) {
    std::vector<float> bt(book.size());
    const size_t g = static_cast<size_t>(kPqCodes * kPqWidth);
    for (size_t s = 0; s < book.size() / g; ++s)
      for (int c = 0; c < kPqCodes; ++c)
        for (int j = 0; j < kPqWidth; ++j) bt[s * g + j * kPqCodes + c] = book[s * g + c * kPqWidth + j];
    return bt;
  }
};

}  // namespace ortlean
