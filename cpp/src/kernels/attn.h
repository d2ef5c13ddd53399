// Per-ISA kernels of PackedAttention (plain C-like, see gemm.h for why), from attn_impl.inc.
#pragma once
#include <cstddef>
#include <cstdint>

namespace ortlean {

// One task of PackedAttention's cache-mode attend phase (kv_attend): online softmax . V over n cached
// rows of one KV head for its nq query heads (custom_ops/reference/attn.py, packed_attention_kv).
struct KvAttend {
  const float* q;        // query heads h < nq at q + h * ldq, D floats each
  int64_t ldq;
  int nq;
  const uint8_t* base;   // row t of the KV head at base + t * row_bytes: K codes (kbytes), V codes
  int64_t row_bytes;     // (vbytes)
  int64_t kbytes, vbytes;
  const uint8_t* sc;     // row t's K scale, V scale (float32 each) at sc + t * sc_stride (its key-bits row)
  int64_t sc_stride;
  const int32_t* list;   // rows list[i] (candidates), or start + i when list is null; i < n
  int64_t start, n;
  int bits;              // 32 (float rows) | 8 | 4
  int64_t D, Dv;
  float scale, softcap;  // softcap > 0: softcap * tanh(logit / softcap)
  const float* const* mask;  // null, or nq rows (each null or the head's mask row: key t at t * mst)
  int64_t mst;
  float* part;           // [nq][Dv + 2]: running max, sum of exp, y (written from scratch)
  float* scratch;        // kv_attend_scratch(nq, D, Dv) floats
  int64_t ahead = 0;     // entries n .. n + ahead - 1 (list or start + i) are the next task's rows:
                         // prefetched near the end of this one, not attended (fp32 rows)
};

// The float scores of the candidate selection from the integer popcount score (lutscore / score_finish).
struct ScoreFinish {
  int32_t two, qs;      // score = two * core - qs (sign keys: 2, sum of qi; else 1, 0)
  int64_t gword;        // the word of a key's row holding its scale gamma (float32 bits); < 0: gamma 1, not read
  float coef;           // times gamma * coef
  const float* mr;      // null, or the mask row: key t's value at mr[t * mst] added
  int64_t mst;
  float* g;             // [T] out
  // non-null: integer buckets instead of g, ids[t] = core[t] - ilo + 1 (two, qs, gword, coef, mr, g
  // unused): pq scores whose order is that of the integer core (ops/packed_attention.cc select_kv)
  uint16_t* ids = nullptr;
  int32_t ilo = 0;
};

// Query levels of the integer q.k of quantized rows: qi = rint(q * (kQLevels / max|q|)) per head.
constexpr int kQLevels = 32767;
// Levels of a prefill chunk's softmax weights times the value rows' scales (p16_row): per row of a chunk
// of keys, rint(p * vscale * kPLevels / its max) — 15 bits, a relative step of 1/32767 of the row's
// largest weight in the chunk
constexpr int kPLevels = 32767;
constexpr int64_t kKvAttendBlock = 32;  // rows per online-softmax block
inline size_t kv_attend_scratch(int nq, int64_t D, int64_t Dv) {
  const int64_t D16 = (D + 15) / 16 * 16;
  return static_cast<size_t>(nq * kKvAttendBlock + nq + nq * D16 / 2 + kKvAttendBlock * (D + Dv) + 32);
}

struct AttnKernels {
  const char* name;  // ISA of this copy; popcount: scalar SWAR, avx2 POPCNT, avx512 VPOPCNTDQ
  // sum_i a[i] * b[i]
  float (*dot)(const float* a, const float* b, int64_t n);
  // y[i] += a * x[i]
  void (*axpy)(float a, const float* x, float* y, int64_t n);
  // y[i] *= a
  void (*scal)(float a, float* y, int64_t n);
  // out[t] = sum_b 2^b (popcount(P[b] & k_t) - popcount(N[b] & k_t)) over nw words, for T keys
  // whose plane words start at kb + t * ldk; P, N: [nb][nw] uint32.
  void (*popcore)(const uint32_t* kb, int64_t ldk, int64_t T, int64_t nw, const uint32_t* P,
                  const uint32_t* N, int nb, int32_t* out);
  // x[i] = exp(x[i] - mx) (x[i] = -inf gives 0); returns the sum
  float (*expsum)(float* x, float mx, int64_t n);
  // max_i x[i] (-inf when n == 0)
  float (*maxv)(const float* x, int64_t n);
  // Cache rows (kv_quant): int8 codes, or int4 pairs (element 2i in the low nibble, two's complement).
  // Tiles of a block of cached rows (fp32 rows, and single rows for key packing / the exact oracle; int8 / int4
  // blocks go through kv_attend): out[i * n + d] = code d of rows[i] as float (bits 8 | 4; 32: the
  // float32 values), i < nb
  void (*deq_rows)(const uint8_t* const* rows, int64_t nb, int64_t n, int bits, float* out);
  // out[h * nb + i] = sum_d q[h * ldq + d] * kf[i * D + d], h < nq, i < nb
  void (*dots_tile)(const float* q, int nq, int64_t ldq, const float* kf, int64_t nb, int64_t D, float* out);
  // y[h * ldy + d] += sum_i p[h * nb + i] * vf[i * Dv + d], h < nq
  void (*pv_tile)(const float* p, int nq, const float* vf, int64_t nb, int64_t Dv, float* y, int64_t ldy);
  // Top-k selection (no NaN in x): *lo, *hi = min and max of the finite x[i] (+inf, -inf when none);
  void (*minmax_finite)(const float* x, int64_t n, float* lo, float* hi);
  // ids[i] = 0 for x[i] = -inf, nbk + 1 for +inf, else 1 + clamp(int((x[i] - mn) * sc), 0, nbk - 1)
  void (*bucket_ids)(const float* x, int64_t n, float mn, float sc, int nbk, uint16_t* ids);
  // Top-k partition: i with ids[i] > bsel to above (as base + i), i with ids[i] == bsel to at (as i),
  // both in index order; returns how many above, *nat how many at. May write up to 7 entries past either
  // count, never past n entries.
  int64_t (*split_ids)(const uint16_t* ids, int64_t n, int bsel, int32_t base, int32_t* above, int32_t* at,
                       int64_t* nat);
  // Top-k take: i with ids[i] > bsel and the first `need` i with ids[i] == bsel (need >= 0), in index
  // order, to out as base + p_i, p_i = pos[i] (pos null: i); returns how many. May write up to 7
  // entries past the count, never past n entries.
  int64_t (*take_ids)(const uint16_t* ids, int64_t n, int bsel, int64_t need, int32_t base, int32_t* out,
                      const int32_t* pos);
  // The keys whose id is at least thr, in index order: their indices i to pos and ids[i] - thr + 1 to val;
  // returns how many, *top the largest val (0: none). May write up to 7 entries past the count, never past
  // n entries.
  int64_t (*select_ge)(const uint16_t* ids, int64_t n, int thr, int32_t* pos, uint16_t* val, int* top);
  // out[t] = sum over the set bits d of key t of qi[d], d < 8 * nbytes (the integer popcount score of a
  // quantized query); key t's plane words start at kb + t * ldk, bit d = bit d % 8 of byte d / 8. lut:
  // scratch of nbytes * 256 int32 (tables built from qi inside, as the path needs them). fin (null:
  // none): also the float scores, as score_finish (a block's keys while their rows are in L1). tables
  // (null: from qi): the nibble tables themselves, tables[j * 32 + n] the value of n as byte j's low
  // nibble, tables[j * 32 + 16 + n] as its high nibble (pq codes: out[t] = sum of its nibbles' values;
  // qi unused).
  void (*lutscore)(const uint32_t* kb, int64_t ldk, int64_t T, int64_t nbytes, const int32_t* qi, int32_t* lut,
                   int32_t* out, const ScoreFinish* fin, const int32_t* tables);
  // f.g[t] = float(f.two * core[t] - f.qs) * gamma_t * f.coef (+ f.mr[t * f.mst] when f.mr), NaN -> -inf,
  // t < T; gamma_t = the float32 bits of word f.gword of key t's row (kb + t * ldk), 1 when f.gword < 0;
  // with f.ids: f.ids[t] = core[t] - f.ilo + 1 instead (the caller keeps it within uint16)
  void (*score_finish)(const int32_t* core, int64_t T, const ScoreFinish& f, const uint32_t* kb, int64_t ldk);
  // Cache-mode attend task (KvAttend above): blocks of kKvAttendBlock rows; float rows: logits =
  // (q.k) * scale; int8 / int4 rows: logits = float(sum_d qi_d * code_d) * (qs * (kscale * scale)),
  // qi / qs the query quantized per head to kQLevels levels (exact integer dot).
  void (*kv_attend)(const KvAttend& a);
  // The query heads quantized to kQLevels levels, as kv_attend does: q16[h * D16 + d] (zero padded to
  // D16), qs[h] = max|q_h| / kQLevels (a head with max|q| = 0: codes 0, qs 0; not finite: codes 0,
  // qs NaN); heads h < nq at q + h * ldq (the reference's query_int16)
  void (*quantize_query)(const float* q, int64_t ldq, int nq, int64_t D, int64_t D16, int16_t* q16, float* qs);
  // Prefill products on the rows' integer codes (int8 / int4 rows, D and Dv multiples of 8 up to 4096):
  // keys j < nk packed for qk_i16 in blocks of 16 keys, dims in pairs within a block:
  // kp[((j / 16) * D / 2 + d / 2) * 32 + (j % 16) * 2 + d % 2] = code d of rows[j]; the last block zero past nk
  void (*pack_k16)(const uint8_t* const* rows, int64_t nk, int64_t D, int bits, int16_t* kp);
  // values packed for pv_i16 in key pairs, dims within a pair: vp[((j / 2) * Dvp + d) * 2 + j % 2] = code d of
  // rows[j], Dvp = Dv rounded up to 16, zero for d >= Dv and for key nk when nk is odd
  void (*pack_v16)(const uint8_t* const* rows, int64_t nk, int64_t Dv, int bits, int16_t* vp);
  // S[i * lds + j] = float(sum_d q16[i * ldq + d] * code(j, d)) * (qs[i] * ks[j]) (exact integer dot), i < nr, j < nk
  void (*qk_i16)(const int16_t* q16, int64_t nr, int64_t ldq, const float* qs, const int16_t* kp, int64_t nk,
                 int64_t D, const float* ks, float* S, int64_t lds);
  // out[j] = rint(s[j] * w[j] * kPLevels / m), m = max_j s[j] * w[j] (s, w >= 0), j < n, out[n] = 0 when n is
  // odd; returns m / kPLevels (0 when m is 0: out all 0; NaN when m is not finite)
  float (*p16_row)(const float* s, const float* w, int64_t n, int16_t* out);
  // y[i * ldy + d] += float(sum_j p16[i * ldp + j] * code(j, d)) * ps[i], i < nr, d < Dv (p16: nk rounded up to
  // even entries per row)
  void (*pv_i16)(const int16_t* p16, int64_t nr, int64_t ldp, const float* ps, const int16_t* vp, int64_t nk,
                 int64_t Dv, float* y, int64_t ldy);
};

// kernels/attn_impl.inc per ISA (picked by isa.h pick(); avx2 needs POPCNT, avx512 VPOPCNTDQ and VNNI)
extern const AttnKernels attn_kernels_scalar, attn_kernels_avx2, attn_kernels_avx512;

}  // namespace ortlean
