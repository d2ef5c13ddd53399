// BlockQuantMatMul / BlockQuantGather: weights in ggml's block formats, byte for byte (a GGUF tensor
// with ne = [K, N] is W [N, row_bytes]), and the per-ISA kernels that multiply them. Normative
// definition (layouts, dequantization, activation numerics): custom_ops/reference/blockquant.py;
// page for readers: docs/block-quant.md. Same rules as gemm.h: plain C-like (no inline functions),
// included by -mavx* translation units.
//
// Block structs: ggml-common.h's layouts (fp16 scales as their IEEE bits, little endian). Every block
// size is even and every row starts at a multiple of its block size, so the 16-bit fields are 2-byte
// aligned; the kernels read them with memcpy / unaligned vector loads all the same.
#pragma once
#include <cstddef>
#include <cstdint>

namespace ortlean {

constexpr int kBqQK = 32;      // q4_0 .. q8_0, and the activation block
constexpr int kBqQKK = 256;    // q4_K, q5_K, q6_K super-blocks
constexpr int kBqActBlock = 32;
// the largest activation integer of act_bits 8 | 16
constexpr int kBqActMax8 = 127, kBqActMax16 = 32767;

// w = d * (q - 8); element j < 16: low nibble of qs[j], j + 16: its high nibble
struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[kBqQK / 2];
};
// w = d * q + m
struct BlockQ4_1 {
  uint16_t d, m;
  uint8_t qs[kBqQK / 2];
};
// w = d * (q - 16); bit 4 of element j: bit j of the little-endian uint32 qh
struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[kBqQK / 2];
};
// w = d * q + m
struct BlockQ5_1 {
  uint16_t d, m;
  uint8_t qh[4];
  uint8_t qs[kBqQK / 2];
};
// w = d * q
struct BlockQ8_0 {
  uint16_t d;
  int8_t qs[kBqQK];
};
// 8 sub-blocks of 32: w = (d * sc_j) * q - (dmin * m_j), 6-bit sc_j / m_j packed in scales[12];
// sub-block 2c + h: nibble h of qs[32c .. 32c + 31]
struct BlockQ4_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qs[kBqQKK / 2];
};
// as q4_K; bit 4 of element i of sub-block j: bit j of qh[i]
struct BlockQ5_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qh[kBqQKK / 8];
  uint8_t qs[kBqQKK / 2];
};
// 16 sub-blocks of 16: w = (d * scales[j]) * (q - 32); q: 4 low bits in ql, 2 high bits in qh
struct BlockQ6_K {
  uint8_t ql[kBqQKK / 2];
  uint8_t qh[kBqQKK / 4];
  int8_t scales[kBqQKK / 16];
  uint16_t d;
};
// q4_f (block B in {16, 32, 64, 128, 256}): this header, then qs[B / 2]; w = d * q + m, element
// j < B/2: low nibble of qs[j], j + B/2: its high nibble. B = 32 is byte for byte BlockQ4_1.
struct BlockQ4_FHead {
  uint16_t d, m;
};

static_assert(sizeof(BlockQ4_0) == 18, "ggml block_q4_0");
static_assert(sizeof(BlockQ4_1) == 20, "ggml block_q4_1");
static_assert(sizeof(BlockQ5_0) == 22, "ggml block_q5_0");
static_assert(sizeof(BlockQ5_1) == 24, "ggml block_q5_1");
static_assert(sizeof(BlockQ8_0) == 34, "ggml block_q8_0");
static_assert(sizeof(BlockQ4_K) == 144, "ggml block_q4_K");
static_assert(sizeof(BlockQ5_K) == 176, "ggml block_q5_K");
static_assert(sizeof(BlockQ6_K) == 210, "ggml block_q6_K");
static_assert(sizeof(BlockQ4_FHead) == 4, "q4_f header");

enum BqFormat : int { kBqQ4_0, kBqQ4_1, kBqQ5_0, kBqQ5_1, kBqQ8_0, kBqQ4_K, kBqQ5_K, kBqQ6_K, kBqQ4_F, kBqFormats };

// name (the attribute value), block (QK; q4_f: 0 = from block_size), bytes per block (q4_f: 4 + B/2),
// byte offsets of the block's fp16 scale / min fields (-1: none): validated finite at construction
struct BqFormatInfo {
  const char* name;
  int block;
  int type_size;
  int scale_off[2];
};
constexpr BqFormatInfo kBqFormatInfo[kBqFormats] = {
    {"q4_0", 32, 18, {0, -1}},  {"q4_1", 32, 20, {0, 2}},    {"q5_0", 32, 22, {0, -1}},
    {"q5_1", 32, 24, {0, 2}},   {"q8_0", 32, 34, {0, -1}},   {"q4_K", 256, 144, {0, 2}},
    {"q5_K", 256, 176, {0, 2}}, {"q6_K", 256, 210, {208, -1}}, {"q4_f", 0, 0, {0, 2}},
};

// One layer's weights as the kernels read them (the session's constant initializer, never copied).
struct BqLayer {
  const uint8_t* data;  // [N, row_bytes]
  int64_t N, K;
  int64_t nb;           // weight blocks per row = ceil(K / block)
  int64_t row_bytes;    // nb * type_size
  int64_t Kp;           // nb * block: K padded to whole weight blocks (activations are zero there)
  int64_t nbx;          // activation blocks of 32 per row = ceil(Kp / 32)
  int format;           // BqFormat
  int block;            // weights per block (QK)
  int type_size;        // bytes per block
  int act_bits;         // activation integers: 8 (int8) | 16 (int16) per block of 32
  int split;            // row layout: 0 ggml's blocks; 1 split (q4_0, q4_1, q5_0, q5_1, q8_0, q4_f/32):
                        // [qs of blocks 0..nb-1 | fp16 d[nb] | fp16 m[nb] (with a min) | q5: qh's low
                        // 16 bits [nb] | its high 16 bits [nb]], the same bytes
  const int32_t* plan;  // the ISA copy's per-node tables (make_plan), or nullptr
};

// Layout split: header bytes per block (the 2-byte fields before qs: d, m, qh's two halves) of the formats
// that take it, else 0
constexpr int bq_split_header(int format, int block) {
  return format == kBqQ4_0 || format == kBqQ8_0                     ? 2
         : format == kBqQ4_1 || (format == kBqQ4_F && block == 32) ? 4
         : format == kBqQ5_0                                         ? 6
         : format == kBqQ5_1                                         ? 8
                                                                     : 0;
}
// Layout split: whether a row holds a min array m[nb] after d[nb] (q4_1, q4_f/32, q5_1)
constexpr bool bq_split_has_min(int format) { return format == kBqQ4_1 || format == kBqQ4_F || format == kBqQ5_1; }
// Layout split, q5_0 / q5_1: where qhl[nb] starts after d[nb], in arrays of nb words (after m[nb] with a min)
constexpr int bq_split_qh_at(int format) { return bq_split_has_min(format) ? 2 : 1; }

// Per-ISA kernels. An activation row is quantized once per call into the copy's own layout
// (act_bytes of scratch, 64-byte aligned), then multiplied against any rows of W.
struct BlockQuantKernels {
  const char* name;
  // per-node tables the copy's kernels read (lane maps of the row's byte positions; built once at
  // construction into plan_ints(w) int32s, handed back in BqLayer::plan); 0: none
  size_t (*plan_ints)(const BqLayer* w);
  void (*make_plan)(const BqLayer* w, int32_t* out);
  // bytes of one quantized activation row of this layer in this copy's layout (a multiple of 64), for
  // a product of `rows` activation rows (gemv: 1, gemm: more; the layouts may differ)
  size_t (*act_bytes)(const BqLayer* w, int64_t rows);
  // quantizes x[0:K] (the reference's quantize_activations) into out, for a product of `rows` rows;
  // returns 0 when x holds a NaN or an infinity (that row's outputs are then NaN: the op writes them)
  int (*quantize)(const BqLayer* w, const float* x, uint8_t* out, int64_t rows);
  // y[n - n0] = x̂ · Ŵ[n] (+ bias[n] when bias) for n in [n0, n1): one activation row (M = 1)
  void (*gemv)(const BqLayer* w, const uint8_t* xq, int64_t n0, int64_t n1, const float* bias, float* y);
  // Y[m * ldy + n - n0] for m in [0, mrows), n in [n0, n1): mrows activation rows at xq + m * xstride
  // (quantized for a product of mrows >= 2 rows)
  void (*gemm)(const BqLayer* w, const uint8_t* xq, size_t xstride, int64_t mrows, int64_t n0, int64_t n1,
               const float* bias, float* Y, int64_t ldy);
  // out[0:K] = Ŵ[n, 0:K], bit for bit the reference's float32 dequantization
  void (*dequant_row)(const BqLayer* w, int64_t n, float* out);
  // the gated unit (BlockQuantMatMul glu = "silu"): y[i] = silu(g[i]) * u[i], float32 with an exp of
  // ~1e-7 relative error (y may alias g)
  void (*silu_mul)(const float* g, const float* u, float* y, int64_t n);
  // 1 when gemm multiplies 16 activation rows at a time in AMX tiles (the AVX-512 copy on a CPU and
  // kernel that allow them; ORTLEAN_AMX=0: never), else 0
  int (*tiles)();
};

// kernels/blockquant_impl.inc per ISA (picked once at construction by isa.h pick(); the AVX-512 copy
// needs AVX512_VNNI: CpuFeature::Avx512Vnni)
extern const BlockQuantKernels blockquant_kernels_scalar, blockquant_kernels_avx2, blockquant_kernels_avx512;

}  // namespace ortlean
