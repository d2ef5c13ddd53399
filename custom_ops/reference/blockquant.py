"""BlockQuantMatMul and BlockQuantGather: weights held in ggml's block formats, byte for byte, and the
normative definition of what the ops compute (page for readers: docs/block-quant.md).

W is uint8 ``[N, row_bytes]``: row n holds output n's weights along K as ``nb = ceil(K / QK)``
consecutive blocks of the format (ggml's tensor layout: a GGUF tensor with ne = [K, N] is exactly
these bytes), ``row_bytes = nb · type_size``. Weights at positions >= K in the last block are ignored.
All scales are IEEE fp16, little endian. Block layouts (ggml-common.h; ``q`` are the stored integers):

  q4_0  (QK 32, 18 B)  {fp16 d; u8 qs[16]}              w = d · (q − 8)
  q4_1  (QK 32, 20 B)  {fp16 d, m; u8 qs[16]}           w = d · q + m
  q5_0  (QK 32, 22 B)  {fp16 d; u8 qh[4]; u8 qs[16]}    w = d · (q − 16)
  q5_1  (QK 32, 24 B)  {fp16 d, m; u8 qh[4]; u8 qs[16]} w = d · q + m
  q8_0  (QK 32, 34 B)  {fp16 d; i8 qs[32]}              w = d · q
  q4_K  (QK 256, 144 B) {fp16 d, dmin; u8 scales[12]; u8 qs[128]}            w = (d·sc_j) · q − (dmin·m_j)
  q5_K  (QK 256, 176 B) {fp16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]} w = (d·sc_j) · q − (dmin·m_j)
  q6_K  (QK 256, 210 B) {u8 ql[128]; u8 qh[64]; i8 scales[16]; fp16 d}      w = (d·sc_j) · (q − 32)
  q4_f  (QK B ∈ {16, 32, 64, 128, 256}, 4 + B/2 B) {fp16 d, m; u8 qs[B/2]}  w = d · q + m

Where the integers sit:
  4-bit (q4_0, q4_1, q4_f): element j < QK/2 is the low nibble of qs[j], element j + QK/2 its high nibble.
  5-bit (q5_0, q5_1): the low 4 bits as 4-bit; bit 4 of element j is bit j of the little-endian
      uint32 qh.
  q4_K / q5_K: 8 sub-blocks j of 32; sub-block j = 2c + h takes nibble h (0 low, 1 high) of
      qs[32c : 32c + 32]; q5_K's bit 4 of element i of sub-block j is bit j of qh[i]. The 6-bit sc_j,
      m_j: for j < 4 sc = scales[j] & 63, m = scales[j + 4] & 63; for j >= 4
      sc = (scales[j + 4] & 15) | (scales[j − 4] >> 6) << 4, m = (scales[j + 4] >> 4) | (scales[j] >> 6) << 4.
  q6_K: 16 sub-blocks of 16 with int8 scales; element e = 128c + 64h + i (i < 64) takes nibble h of
      ql[64c + i] as its low 4 bits; with e = 128c + 32s + i (i < 32) bits 2s, 2s+1 of qh[32c + i]
      are its bits 4, 5; sub-block e // 16.
  q4_f with B = 32 is byte for byte q4_1.

Row layout (attribute ``layout``): "blocks" (default) is ggml's, above. "split" holds the same bytes
reordered within each row: the integer bytes of every block (``qs``) one after the other, then each
2-byte header field as its own array over the row's blocks — ``[qs_0 … qs_{nb−1} | d_0 … d_{nb−1}]``, and
``| m_0 … m_{nb−1}`` for the formats with a min; q5_0 / q5_1 then hold ``qh``'s low 16 bits and its high
16 bits as two more arrays (``| qhl_0 … qhl_{nb−1} | qhh_0 … qhh_{nb−1}``: bit j of qhl_b is element j's
5th bit, of qhh_b element j + 16's). Only q4_0, q4_1, q5_0, q5_1, q8_0 and q4_f with block 32 (whose
blocks are 2-byte header fields and one byte stream) take it: the layout lets the AVX-512 M = 1 kernel
read a row's integers as whole vectors (4 or 2 blocks per 64 bytes), its scales 16 at a time and q5's
5th bits of 4 blocks as one 64-bit mask per nibble half. ``to_split`` / ``from_split`` convert; a split W dequantizes exactly as its blocks.

Ŵ = dequantize(W)[:, :K] is float32 computed with exactly the float32 operations of gguf-py's
``gguf.quants`` (one product, then one sum, in the order written above; ``d·sc_j`` and ``dmin·m_j``
rounded to float32 first), so it equals ``gguf.quants.dequantize`` bit for bit (tests/test_block_quant.py).

Activations (the op's numerics): each row of X is quantized on its own in blocks of 32 along K (the
last block zero-padded) to integers of act_bits bits (attribute, 8 default | 16), Q = 127 | 32767:
amax = max|x| over the block, d_x = amax / Q, q = rint(x · (Q / amax)) (float32 operations, round half
to even), clamped to [−Q, Q]; a block whose Q / amax is not finite (all zero, or amax < Q / FLT_MAX,
≈ 3.7e-37 | 9.6e-35) has q = 0, d_x = 0. x̂ = d_x · q (exact).
Y = x̂ · Ŵᵀ + bias: the exact product of the quantized activations with the exact weights (here in
float64, rounded to float32 once); the kernels sum in float32 in any order. A row of X holding a NaN or
an infinity gives a row of NaN. Rows never interact.
prefill_act_bits (BlockQuantMatMul; attribute, 0 default | 8 | 16): the act_bits of the rows of a call
with M > 1 rows (M = the product of X's leading dims: a prompt's prefill); 0 means act_bits. A call with
M = 1 (decode) always uses act_bits. So with prefill_act_bits = act_bits (or 0) a row's result does not
depend on M; with another value the rows of an M > 1 call are those of act_bits = prefill_act_bits.

glu = "silu" (BlockQuantMatMul; N even): the gated unit of a SwiGLU MLP in the op. W's rows are a gate
projection's N/2 rows followed by an up projection's N/2; P = x̂ · Ŵᵀ + bias as above (float32, bias of
length N), and Y[..., j] = silu(P[..., j]) · P[..., N/2 + j] with silu(g) = g / (1 + exp(−g)) (here in
float64 from P's float32 values, rounded once; the kernels in float32 with an exp of ~1e-7 relative
error), shape [..., N/2]. A NaN row of P stays NaN.

BlockQuantGather(W, indices) = Ŵ[indices] (float32, bit for bit), indices int64 or int32 of any
shape, negative indices count from the end (−N..N−1), shape [*indices.shape, K].
"""
from __future__ import annotations

import math

import numpy as np

QK_K = 256
FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_K", "q5_K", "q6_K", "q4_f")
# block (QK) and bytes per block of the fixed formats (q4_f: block_size B, 4 + B/2 bytes)
QK = {"q4_0": 32, "q4_1": 32, "q5_0": 32, "q5_1": 32, "q8_0": 32, "q4_K": QK_K, "q5_K": QK_K, "q6_K": QK_K}
TYPE_SIZE = {"q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_0": 34, "q4_K": 144, "q5_K": 176, "q6_K": 210}
Q4F_BLOCKS = (16, 32, 64, 128, 256)
Q4F_DEFAULT = 32
# formats whose weights have a float offset (min) per block / sub-block
WITH_MIN = ("q4_1", "q5_1", "q4_K", "q5_K", "q4_f")
# ggml's type names (gguf.GGMLQuantizationType) of the formats that are GGUF types
GGML_TYPE = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1", "q8_0": "Q8_0",
             "q4_K": "Q4_K", "q5_K": "Q5_K", "q6_K": "Q6_K"}
FROM_GGML = {v: k for k, v in GGML_TYPE.items()}
# byte offsets of the fp16 scale fields in a block (validated finite by the kernels)
SCALE_FIELDS = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,), "q4_K": (0, 2),
                "q5_K": (0, 2), "q6_K": (208,), "q4_f": (0, 2)}
# row layouts (module docstring): ggml's blocks, or a row's integers then its scale arrays
LAYOUTS = ("blocks", "split")
# formats that take layout "split" (q4_f: block 32 only) and their header bytes per block (2-byte fields:
# fp16 d, m; q5's qh as two halves)
SPLIT_HEADER = {"q4_0": 2, "q4_1": 4, "q5_0": 6, "q5_1": 8, "q8_0": 2, "q4_f": 4}
ACT_BLOCK = 32  # activation quantization block
ACT_BITS = (8, 16)  # activation integers: int8 (default) or int16 per block of 32
GLU = ("none", "silu")  # BlockQuantMatMul's gated unit


def block_of(fmt: str, block_size: int | None = None) -> int:
    """QK of a format (q4_f: block_size, absent = 32); a block_size another format does not have is an error."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: must be one of {', '.join(FORMATS)}")
    if fmt == "q4_f":
        B = Q4F_DEFAULT if block_size is None else int(block_size)
        if B not in Q4F_BLOCKS:
            raise ValueError(f"block_size {B}: q4_f takes one of {Q4F_BLOCKS}")
        return B
    if block_size is not None and int(block_size) != QK[fmt]:
        raise ValueError(f"block_size {block_size}: format {fmt} has blocks of {QK[fmt]} (block_size is for q4_f)")
    return QK[fmt]


def type_size(fmt: str, block_size: int | None = None) -> int:
    B = block_of(fmt, block_size)
    return 4 + B // 2 if fmt == "q4_f" else TYPE_SIZE[fmt]


def blocks_per_row(fmt: str, K: int, block_size: int | None = None) -> int:
    return -(-int(K) // block_of(fmt, block_size))


def row_bytes(fmt: str, K: int, block_size: int | None = None) -> int:
    return blocks_per_row(fmt, K, block_size) * type_size(fmt, block_size)


def bits_per_weight(fmt: str, block_size: int | None = None) -> float:
    """Stored bits per weight of a full block (e.g. q4_0 4.5, q4_K 4.5, q6_K 6.5625)."""
    return 8.0 * type_size(fmt, block_size) / block_of(fmt, block_size)


# ------------------------------------------------------------------ row layouts
def split_refusal(fmt: str, block_size: int | None = None, act_bits: int = 8) -> str | None:
    """Why layout "split" does not apply (None: it does): the format or its block size (every act_bits
    takes it; the argument stays for callers that pass it)."""
    if fmt not in SPLIT_HEADER:
        return f"layout split takes formats q4_0, q4_1, q5_0, q5_1, q8_0 and q4_f with block 32, not {fmt}"
    if fmt == "q4_f" and block_of(fmt, block_size) != 32:
        return f"layout split takes q4_f only with block 32, not {block_of(fmt, block_size)}"
    return None


def _split_geometry(W, fmt: str, K: int, block_size: int | None):
    W = np.asarray(W)
    why = split_refusal(fmt, block_size)
    if why:
        raise ValueError(why)
    nb, ts = blocks_per_row(fmt, K, block_size), type_size(fmt, block_size)
    if W.dtype != np.uint8 or W.ndim != 2 or W.shape[1] != nb * ts:
        raise ValueError(f"W has shape {list(W.shape)} ({W.dtype}), expected uint8 [N, {nb * ts}] "
                         f"(format {fmt}, K = {K})")
    return W, nb, ts, SPLIT_HEADER[fmt]


def to_split(W, fmt: str, K: int, block_size: int | None = None) -> np.ndarray:
    """ggml's blocks [N, row_bytes] -> layout "split" (the same bytes, reordered within each row)."""
    W, nb, ts, h = _split_geometry(W, fmt, K, block_size)
    blk = W.reshape(W.shape[0], nb, ts)
    parts = [blk[:, :, h:].reshape(W.shape[0], -1)]
    parts += [blk[:, :, 2 * f:2 * f + 2].reshape(W.shape[0], -1) for f in range(h // 2)]
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


def from_split(W, fmt: str, K: int, block_size: int | None = None) -> np.ndarray:
    """Layout "split" [N, row_bytes] -> ggml's blocks (to_split's inverse, byte for byte)."""
    W, nb, ts, h = _split_geometry(W, fmt, K, block_size)
    n, qb = W.shape[0], nb * (ts - h)
    out = np.empty((n, nb, ts), np.uint8)
    out[:, :, h:] = W[:, :qb].reshape(n, nb, ts - h)
    for f in range(h // 2):
        out[:, :, 2 * f:2 * f + 2] = W[:, qb + 2 * f * nb:qb + 2 * (f + 1) * nb].reshape(n, nb, 2)
    return out.reshape(n, nb * ts)


# ------------------------------------------------------------------ dequantization
def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 (little endian fp16) -> [n, 1] float32."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, h] bytes -> [n, 2h]: the low nibbles, then the high nibbles."""
    return np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes (a little-endian uint32) -> [n, 32] its bits 0..31 as uint8."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q4_K / q5_K scales [n, 12] -> (sc [n, 8], m [n, 8]) 6-bit integers."""
    s = scales.astype(np.uint8)
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, m


def _dequant_blocks(b: np.ndarray, fmt: str, B: int) -> np.ndarray:
    """Blocks [n, type_size] uint8 -> [n, B] float32 (gguf.quants' float32 operations and order)."""
    n = b.shape[0]
    if fmt == "q4_0":
        d = _f16(b[:, 0:2])
        q = (_nibbles(b[:, 2:18]).astype(np.int8) - np.int8(8)).astype(np.float32)
        return d * q
    if fmt in ("q4_1", "q4_f"):
        d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        q = _nibbles(b[:, 4:4 + B // 2]).astype(np.float32)
        return d * q + m
    if fmt in ("q5_0", "q5_1"):
        o = 2 if fmt == "q5_0" else 4
        d = _f16(b[:, 0:2])
        v = _nibbles(b[:, o + 4:o + 20]) | (_bits32(b[:, o:o + 4]) << np.uint8(4))
        if fmt == "q5_0":
            return d * (v.astype(np.int8) - np.int8(16)).astype(np.float32)
        return d * v.astype(np.float32) + _f16(b[:, 2:4])
    if fmt == "q8_0":
        d = _f16(b[:, 0:2])
        return np.ascontiguousarray(b[:, 2:34]).view(np.int8).astype(np.float32) * d
    if fmt in ("q4_K", "q5_K"):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, m = _scale_min_k4(b[:, 4:16])
        D = (d * sc.astype(np.float32))[:, :, None]        # [n, 8, 1]
        DM = (dmin * m.astype(np.float32))[:, :, None]
        qs = b[:, 16:144] if fmt == "q4_K" else b[:, 48:176]
        # sub-block 2c + h = nibble h of qs[32c : 32c + 32]
        q = (qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
        q = q.reshape(n, 8, 32)
        if fmt == "q5_K":
            qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            q = q | ((qh & np.uint8(1)) << np.uint8(4))
        return (D * q.astype(np.float32) - DM).reshape(n, QK_K)
    if fmt == "q6_K":
        ql, qh = b[:, 0:128], b[:, 128:192]
        sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
        d = _f16(b[:, 208:210])
        D = (d * sc)[:, :, None]                            # [n, 16, 1]
        lo = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
        hi = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
        q = (lo.reshape(n, QK_K) | (hi.reshape(n, QK_K) << np.uint8(4))).astype(np.int8) - np.int8(32)
        return (D * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)
    raise ValueError(f"format {fmt!r}: must be one of {', '.join(FORMATS)}")


def _layer(W, fmt: str, K: int, N: int | None, block_size: int | None):
    """W as [N, nb, type_size] blocks, checked against the attributes (what the kernels refuse)."""
    B = block_of(fmt, block_size)
    W = np.asarray(W)
    if W.dtype != np.uint8:
        raise ValueError(f"W must be uint8, got {W.dtype}")
    rb = row_bytes(fmt, K, block_size)
    n_rows = W.shape[0] if W.ndim == 2 else -1
    if W.ndim != 2 or W.shape[1] != rb or (N is not None and W.shape[0] != N):
        raise ValueError(f"W has shape {list(W.shape)}, expected [{N if N is not None else 'N'}, {rb}] "
                         f"(format {fmt}, K = {K}: {blocks_per_row(fmt, K, block_size)} blocks of "
                         f"{type_size(fmt, block_size)} bytes)")
    return W.reshape(n_rows, -1, type_size(fmt, block_size)), B


def check_scales(W, fmt: str, K: int, block_size: int | None = None) -> None:
    """ValueError naming the first block whose fp16 scale / min is NaN or infinite (the kernels refuse
    such a W at session creation)."""
    blk, _ = _layer(W, fmt, K, None, block_size)
    for off in SCALE_FIELDS[fmt]:
        h = blk[:, :, off].astype(np.uint16) | (blk[:, :, off + 1].astype(np.uint16) << np.uint16(8))
        bad = np.argwhere((h & np.uint16(0x7C00)) == np.uint16(0x7C00))
        if bad.size:
            n, b = (int(v) for v in bad[0])
            raise ValueError(f"W row {n} block {b}: non-finite fp16 scale at byte {off} of the block "
                             f"(0x{int(h[n, b]):04x})")


def dequantize(W, fmt: str, K: int, block_size: int | None = None) -> np.ndarray:
    """Ŵ: float32 [N, K], bit for bit gguf.quants.dequantize of the same blocks (cut to K)."""
    blk, B = _layer(W, fmt, K, None, block_size)
    n, nb, ts = blk.shape
    out = _dequant_blocks(blk.reshape(n * nb, ts), fmt, B)
    return np.ascontiguousarray(out.reshape(n, nb * B)[:, :K])


def magnitude(W, fmt: str, K: int, block_size: int | None = None) -> np.ndarray:
    """|scale · q| + |min| per weight, float64 [N, K]: the size of the terms Ŵ is made of (the tests'
    tolerance: the kernels sum scale · Σ q x and min · Σ x, whose rounding scales with these, not with
    |Ŵ|, which may cancel)."""
    blk, B = _layer(W, fmt, K, None, block_size)
    n, nb, ts = blk.shape
    b = blk.reshape(n * nb, ts)
    full = np.abs(_dequant_blocks(b, fmt, B).astype(np.float64))
    if fmt in WITH_MIN:  # |scale·q| + |min| ≥ |scale·q + min|: from the parts
        no_min, no_scale = b.copy(), b.copy()
        no_min[:, 2:4] = 0      # m (dmin) = 0: the scale·q part alone
        no_scale[:, 0:2] = 0    # d = 0: the min part alone
        full = (np.abs(_dequant_blocks(no_min, fmt, B).astype(np.float64))
                + np.abs(_dequant_blocks(no_scale, fmt, B).astype(np.float64)))
    return np.ascontiguousarray(full.reshape(n, nb * B)[:, :K])


# ------------------------------------------------------------------ activations
def act_qmax(act_bits: int = 8) -> int:
    """The largest activation integer: 127 (act_bits 8) or 32767 (act_bits 16)."""
    if act_bits not in ACT_BITS:
        raise ValueError(f"act_bits must be 8 or 16, got {act_bits}")
    return (1 << (act_bits - 1)) - 1


def quantize_activations(x, act_bits: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 [..., K] -> (q int8 | int16 [..., nbx, 32], d float32 [..., nbx], finite bool [...]):
    per block of 32 (zero-padded), with Q = act_qmax(act_bits): amax = max|x|, d = amax / Q,
    q = clip(rint(x · (Q / amax)), ±Q) in float32 (ties to even); blocks whose Q / amax is not finite
    are q = 0, d = 0. `finite`: the row holds no NaN / infinity (a row that does gives NaN outputs)."""
    Q = np.float32(act_qmax(act_bits))
    x = np.asarray(x, np.float32)
    K = x.shape[-1]
    nbx = -(-K // ACT_BLOCK)
    xp = np.zeros(x.shape[:-1] + (nbx * ACT_BLOCK,), np.float32)
    xp[..., :K] = x
    xb = xp.reshape(x.shape[:-1] + (nbx, ACT_BLOCK))
    with np.errstate(all="ignore"):
        amax = np.abs(xb).max(axis=-1)
        inv = Q / amax
        d = amax / Q
        ok = np.isfinite(inv) & np.isfinite(amax)
        q = np.rint(xb * inv[..., None])
        q = np.where(ok[..., None], np.clip(q, -Q, Q), 0).astype(np.int8 if act_bits == 8 else np.int16)
    d = np.where(ok, d, np.float32(0)).astype(np.float32)
    return q, d, np.isfinite(x).all(axis=-1)


def dequantize_activations(q: np.ndarray, d: np.ndarray, K: int) -> np.ndarray:
    """x̂ = d · q (float64, exact) [..., K]."""
    xh = q.astype(np.float64) * d.astype(np.float64)[..., None]
    return xh.reshape(q.shape[:-2] + (-1,))[..., :K]


# ------------------------------------------------------------------ the ops
def _attrs(attrs: dict) -> tuple[str, int, int, int | None]:
    fmt = attrs.get("format")
    if isinstance(fmt, bytes):
        fmt = fmt.decode()
    K, N = int(attrs["K"]), int(attrs["N"])
    bs = attrs.get("block_size")
    bs = None if bs in (None, 0) else int(bs)  # ext.py fills an absent int with 0
    for name, v in (("K", K), ("N", N)):
        if not 1 <= v <= 2**31 - 1:
            raise ValueError(f"attribute {name} must be in [1, 2^31 - 1], got {v}")
    block_of(fmt, bs)
    return fmt, K, N, bs


def _layout(attrs: dict, fmt: str, bs: int | None, act_bits: int = 8) -> str:
    lay = attrs.get("layout")
    lay = "blocks" if lay in (None, "", b"") else (lay.decode() if isinstance(lay, bytes) else lay)
    if lay not in LAYOUTS:
        raise ValueError(f"attribute layout must be one of {', '.join(LAYOUTS)}, got {lay!r}")
    why = split_refusal(fmt, bs, act_bits) if lay == "split" else None
    if why:
        raise ValueError("attribute " + why)
    return lay


def _act_bits(attrs: dict) -> int:
    a = attrs.get("act_bits")
    a = 8 if a is None else int(a)
    act_qmax(a)  # ValueError unless 8 | 16
    return a


def _prefill_act_bits(attrs: dict, act_bits: int) -> int:
    """The act_bits of a call with M > 1 rows: attribute prefill_act_bits (0 or absent: act_bits)."""
    a = attrs.get("prefill_act_bits")
    a = 0 if a is None else int(a)
    if a not in (0, *ACT_BITS):
        raise ValueError(f"attribute prefill_act_bits must be 0 (as act_bits), 8 or 16, got {a}")
    return a or act_bits


def call_act_bits(M: int, act_bits: int = 8, prefill_act_bits: int = 0) -> int:
    """The activation integers of a call with M rows: prefill_act_bits (0: act_bits) when M > 1, else act_bits."""
    return (prefill_act_bits or act_bits) if M > 1 else act_bits


def _glu(attrs: dict, N: int) -> bool:
    g = attrs.get("glu")
    g = "none" if g in (None, "", b"") else (g.decode() if isinstance(g, bytes) else g)
    if g not in GLU:
        raise ValueError(f"attribute glu must be one of {', '.join(GLU)}, got {g!r}")
    if g == "silu" and N % 2:
        raise ValueError(f"attribute glu 'silu' needs an even N (the gate's rows, then as many of the up "
                         f"projection's), got N = {N}")
    return g == "silu"


def silu_mul(P: np.ndarray) -> np.ndarray:
    """The gated unit: silu(P[..., :H]) · P[..., H:] for P [..., 2H] (float64, rounded to float32 once)."""
    H = P.shape[-1] // 2
    g, u = P[..., :H].astype(np.float64), P[..., H:].astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return (g / (1.0 + np.exp(-g)) * u).astype(np.float32)


def op(X, W, bias=None, **attrs) -> np.ndarray:
    """BlockQuantMatMul: Y = x̂ · Ŵᵀ + bias (module docstring); attrs: format, K, N, [block_size],
    [act_bits] (8 | 16, absent: 8), [prefill_act_bits] (0 | 8 | 16, absent / 0: act_bits; the act_bits of
    a call whose X holds M > 1 rows), [glu] (none | silu: Y = silu_mul of that product), [layout]
    (blocks | split: W's row layout)."""
    fmt, K, N, bs = _attrs(attrs)
    act_bits = _act_bits(attrs)
    prefill_bits = _prefill_act_bits(attrs, act_bits)
    glu = _glu(attrs, N)
    _layer(W, fmt, K, N, bs)
    if _layout(attrs, fmt, bs, act_bits) == "split":
        W = from_split(W, fmt, K, bs)
    check_scales(W, fmt, K, bs)
    X = np.asarray(X, np.float32)
    if X.ndim < 1 or X.shape[-1] != K:
        raise ValueError(f"X has shape {list(X.shape)}: last dim must be K = {K}")
    if bias is not None:
        bias = np.asarray(bias, np.float32)
        if bias.shape != (N,):
            raise ValueError(f"bias has shape {list(bias.shape)}, expected [{N}]")
    Wd = dequantize(W, fmt, K, bs).astype(np.float64)
    M = X.size // K
    q, d, finite = quantize_activations(X, call_act_bits(M, act_bits, prefill_bits))
    Y = dequantize_activations(q, d, K) @ Wd.T
    if bias is not None:
        Y = Y + bias.astype(np.float64)
    with np.errstate(over="ignore"):  # a product beyond float32 is +-inf, as the kernels give it
        Y = Y.astype(np.float32)
    Y[~finite] = np.nan
    return silu_mul(Y) if glu else Y


def gather(W, indices, **attrs) -> np.ndarray:
    """BlockQuantGather: Ŵ[indices], float32 [*indices.shape, K] (module docstring)."""
    fmt, K, N, bs = _attrs(attrs)
    _layer(W, fmt, K, N, bs)
    if _layout(attrs, fmt, bs) == "split":
        W = from_split(W, fmt, K, bs)
    check_scales(W, fmt, K, bs)
    idx = np.asarray(indices)
    if idx.dtype not in (np.int64, np.int32):
        raise ValueError(f"indices must be int64 or int32, got {idx.dtype}")
    flat = idx.reshape(-1).astype(np.int64)
    bad = np.flatnonzero((flat < -N) | (flat >= N))
    if bad.size:
        raise IndexError(f"index {int(flat[bad[0]])} (position {int(bad[0])}) out of range [-{N}, {N - 1}]")
    flat = np.where(flat < 0, flat + N, flat)
    rows = dequantize(np.asarray(W)[flat], fmt, K, bs)
    return rows.reshape(idx.shape + (K,))


# ------------------------------------------------------------------ making blocks (tests, float checkpoints)
def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """[n] float values -> [n, 2] uint8 little-endian fp16."""
    return np.ascontiguousarray(np.asarray(v, np.float32).astype("<f2")).view(np.uint8).reshape(-1, 2)


def pack_q4_f(q: np.ndarray, d: np.ndarray, m: np.ndarray, block_size: int = Q4F_DEFAULT) -> np.ndarray:
    """q4_f blocks from integer codes q [N, nb·B] in 0..15 and per-block scale / offset d, m [N, nb]
    (rounded to fp16 here): what an HQQ / asymmetric quantizer's (q, scale, offset) become, w = d·q + m.
    Returns W uint8 [N, nb·(4 + B/2)]."""
    B = block_of("q4_f", block_size)
    q = np.asarray(q)
    N, L = q.shape
    if L % B or np.any((q < 0) | (q > 15)):
        raise ValueError(f"q must be [N, nb·{B}] integers in 0..15")
    nb = L // B
    qb = q.reshape(N * nb, 2, B // 2).astype(np.uint8)
    qs = qb[:, 0] | (qb[:, 1] << np.uint8(4))
    out = np.concatenate([_f16_bytes(np.asarray(d).reshape(-1)), _f16_bytes(np.asarray(m).reshape(-1)), qs], axis=1)
    return out.reshape(N, nb * (4 + B // 2))


def quantize_q4_f(Wf: np.ndarray, block_size: int = Q4F_DEFAULT) -> np.ndarray:
    """Round-to-nearest asymmetric 4-bit of float weights Wf [N, K] (rows = outputs) in blocks of B along
    K, K zero-padded: m = min, d = (max − min) / 15 (both fp16), q = clip(rint((w − m) / d), 0, 15)."""
    B = block_of("q4_f", block_size)
    Wf = np.asarray(Wf, np.float32)
    N, K = Wf.shape
    nb = -(-K // B)
    Wp = np.zeros((N, nb * B), np.float32)
    Wp[:, :K] = Wf
    wb = Wp.reshape(N, nb, B)
    m = wb.min(axis=-1).astype(np.float16).astype(np.float32)
    d = ((wb.max(axis=-1) - m) / 15).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[..., None] > 0, np.rint((wb - m[..., None]) / d[..., None]), 0)
    return pack_q4_f(np.clip(q, 0, 15).astype(np.uint8).reshape(N, nb * B), d, m, B)


def random_blocks(fmt: str, N: int, K: int, rng: np.random.Generator, block_size: int | None = None,
                  scale: float = 0.02) -> np.ndarray:
    """Random but valid W [N, row_bytes]: random integer fields, finite fp16 scales / mins of about
    `scale` (tests; the K formats have no quantizer in gguf-py)."""
    ts = type_size(fmt, block_size)
    nb = blocks_per_row(fmt, K, block_size)
    b = rng.integers(0, 256, size=(N * nb, ts), dtype=np.uint8)
    for off in SCALE_FIELDS[fmt]:
        v = rng.standard_normal(N * nb) * scale
        if fmt in ("q4_K", "q5_K"):
            v = np.abs(v)  # d, dmin ≥ 0 as llama.cpp writes them (the op does not require it)
        b[:, off:off + 2] = _f16_bytes(v)
    return b.reshape(N, nb * ts)


def ggml_blocks(Wf: np.ndarray, fmt: str) -> np.ndarray:
    """gguf-py's own quantizer for the formats it has (q4_0, q4_1, q5_0, q5_1, q8_0): Wf [N, K] (K a
    multiple of 32) -> W [N, row_bytes]."""
    from gguf import GGMLQuantizationType, quants

    return quants.quantize(np.asarray(Wf, np.float32), GGMLQuantizationType[GGML_TYPE[fmt]])

