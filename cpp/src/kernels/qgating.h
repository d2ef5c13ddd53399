// Quantized weight rows of EventGatedMatMul (weight_format int8 | int4) and their per-ISA kernels.
// Normative format: custom_ops/reference/gating_quant.py. Same rules as gemm.h: plain C-like,
// included by -mavx* translation units.
//
// Rows are input-channel-major like the f32 W [K, N]: row k holds the N weights of input channel k,
// so a channel the gate drops is a row of bytes (and of scales) that is never read. Scales are per
// group of `group` consecutive outputs of a row (a power of two >= 16).
#pragma once
#include <cstddef>
#include <cstdint>

namespace ortlean {

enum WeightFormat : int { kWeightF32 = 0, kWeightInt8 = 1, kWeightInt4 = 2, kWeightInt4K = 3 };

// int8 rows: byte n of row k is the two's complement q in [-128, 127]; w = scale * q.
// row_bytes = N.
struct Int8Rows {
  static constexpr int64_t kOutputsPerChunk = 1;
};

// int4 rows: chunks of 16 outputs in 8 bytes: output 16j + i is in byte 8j + (i % 8), the low
// nibble for i < 8, the high one for i >= 8 (one 8-byte load widened to 8 lanes gives outputs
// 0..7 from the low nibbles and 8..15 from the high ones); w = scale * (u - zero), zero = the
// group's zero point (8 without zero points). row_bytes = 8 * ceil(N / 16).
struct Int4Rows {
  static constexpr int64_t kOutputsPerChunk = 16;
  static constexpr int64_t kBytesPerChunk = 8;
  static constexpr int kSymmetricZero = 8;
};

// One quantized weight [K, N] as the kernels read it.
struct QuantRows {
  int format;              // kWeightInt8 | kWeightInt4
  const uint8_t* data;     // [K, row_bytes]
  const float* scales;     // [K, groups]
  const uint8_t* zeros;    // [K, groups] (int4) or nullptr (int4: 8; int8: none)
  int64_t N;               // outputs per row
  int64_t row_bytes;       // bytes per row of data
  int64_t groups;          // scales per row: ceil(N / group)
  int64_t group;           // outputs per scale
  int group_shift;         // log2(group)
};

// int4k pair rows (scales along K, integer activations; the M = 1 path): byte (p, n) of pair row p
// holds q[2p, n] + 8 in its low nibble and q[2p + 1, n] + 8 in its high one, rows padded to
// kCols outputs (u = 8); scales [ceil(K / group), N], one per output per `group` input rows
// (group 16 | 32: a group's pair products are summed in int16, 16 * 2 * 127 * 8 < 2^15).
struct Int4KPairs {
  static constexpr int64_t kCols = 32;      // outputs per 32-byte chunk of a pair row
  static constexpr int64_t kMaxGroup = 32;  // int16 accumulation bound
};

struct KQuantRows {
  const uint8_t* data;   // [ceil(K / 2), row_bytes]
  const float* scales;   // [groups, N]
  int64_t K, N;
  int64_t row_bytes;     // kCols * ceil(N / kCols)
  int64_t groups;        // ceil(K / group)
  int64_t group;         // input rows per scale
  int pair_shift;        // log2(group / 2): pair p is in group p >> pair_shift
};

struct QGatingKernels {
  const char* name;
  // y[0:ncols] (+)= sum_j v[j] * What[idx[j], c0 : c0 + ncols] (What = the dequantized rows):
  // reads only the listed rows' bytes and scales (several rows per pass, prefetching ahead).
  // c0 must be a multiple of 16. acc = 0 overwrites y.
  void (*gather_axpy)(const int32_t* idx, const float* v, int64_t n, const QuantRows* w, int64_t c0, int64_t ncols,
                      float* y, int acc);
  // out[r * ldo + c] = What[k0 + r, c0 + c] for r < nrows, c < ncols (c0 a multiple of 16).
  void (*dequant)(const QuantRows* w, int64_t k0, int64_t nrows, int64_t c0, int64_t ncols, float* out, int64_t ldo);
  // int4k: y[0:ncols] (+)= xs * sum_g scales[g, c0 + c] * sum_{pairs p of g} xq[2p] q[2p, c0 + c] +
  // xq[2p + 1] q[2p + 1, c0 + c] over the listed pairs (ascending), reading only their bytes.
  // xq [2 * ceil(K / 2)] int8 in [-127, 127]; c0 a multiple of 32; acc = 0 overwrites y.
  void (*kmatvec)(const KQuantRows* w, const int8_t* xq, const int32_t* pairs, int64_t npairs, float xs, int64_t c0,
                  int64_t ncols, float* y, int acc);
  // int4k: out[r * ldo + c] = What[k0 + r, c0 + c]
  void (*kdequant)(const KQuantRows* w, int64_t k0, int64_t nrows, int64_t c0, int64_t ncols, float* out, int64_t ldo);
};

// kernels/qgating_impl.inc per ISA (picked by isa.h pick())
extern const QGatingKernels qgating_kernels_scalar, qgating_kernels_avx2, qgating_kernels_avx512;

}  // namespace ortlean
