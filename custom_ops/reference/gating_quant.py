"""Quantized weight formats of EventGatedMatMul (`weight_format` = int8 | int4): the normative
definition of the stored bytes, of quantize and of dequantize.

The formats are input-channel-major, like the f32 `W [K, N]`: row k holds the N weights of input
channel k, so a channel the gate drops is a row of bytes (and scales) the kernel never reads.
Scales are per group of `weight_group` consecutive outputs of one row (G, a power of two ≥ 16),
`groups = ceil(N / G)`:

  scales       float32 [K, groups]
  zero_points  uint8   [K, groups]  (int4 only, optional; absent = symmetric, every zero point 8)

int8: `Wq` uint8 [K, N]; byte (k, n) is the two's complement of q ∈ [−128, 127];
      Ŵ[k, n] = scales[k, n // G] · q.
      quantize: s = max|w| / 127 over the group (1 when the group is all zero), q = clip(rint(w/s), −127, 127).
int4: `Wq` uint8 [K, 8·ceil(N/16)]: each row is chunks of 16 outputs in 8 bytes; output n lies in
      chunk j = n // 16 at i = n % 16: byte 8j + (i % 8), low nibble for i < 8, high nibble for i ≥ 8
      (so one 8-byte load widened to 8 lanes gives outputs 0..7 from the low nibbles and 8..15 from
      the high ones). Nibbles past N are 0. u ∈ [0, 15]: Ŵ[k, n] = scales[k, n // G] · (u − z),
      z = zero_points[k, n // G] (8 without zero points).
      quantize, symmetric: s = max|w| / 7, u = clip(rint(w/s), −8, 7) + 8;
      asymmetric (zero points): lo = min(w, 0), hi = max(w, 0), s = (hi − lo) / 15,
      z = clip(rint(−lo/s), 0, 15), u = clip(rint(w/s) + z, 0, 15).
Ŵ is computed in float32 (one product of the scale and a small exact integer).

Zero points exist for int4 only: on SmolLM2's 576/1536-wide weights (every 4th of 210 matrices,
G = 32) they cut the relative Frobenius error from 0.103 to 0.084 at int4 but only from 0.0057 to
0.0049 at int8, where the error is already negligible (measured with this module's quantize).

The op's meaning with a quantized format is the f32 op (custom_ops/reference/gating.py) on Ŵ:
norms ‖Ŵ_k‖ for the `xw` score and the event deltas, every gating mode unchanged.

int4k (`weight_format` = int4k): the integer-activation layout of the M = 1 path. Scales run ALONG K:
one scale per output n per group of G = `weight_group` consecutive input rows (G ∈ {16, 32}: the
kernel sums a group's 16-bit products in int16, 16 pairs · 2 · 127 · 8 = 32512 < 2^15), and rows are
stored in pairs so that a pair of channels the gate drops is a run of bytes never read:

  Wq      uint8   [ceil(K/2), 32·ceil(N/32)]: byte (p, n) = u[2p, n] | u[2p+1, n] << 4, u = q + 8,
          q ∈ [−8, 7]; a missing row 2p+1 (odd K) and the outputs past N hold u = 8 (q = 0)
  scales  float32 [ceil(K/G), N]
  Ŵ[k, n] = scales[k // G, n] · q[k, n]
  quantize: s = max_{k∈group}|w[k, n]| / 7 (1 when all zero), q = clip(rint(w/s), −8, 7). No zero points.

A product v · Ŵ of ONE vector (the only kind an M = 1 call makes) quantizes v per product to int8,
symmetric, after gating: a = max|v|, xs = a / 127, xq = clip(rint(v · (127 / a)), −127, 127) (float32
arithmetic, ties to even; a = 0 gives y = 0); then y[n] = Σ_g xs · scales[g, n] · Σ_{k∈g} xq[k] q[k, n]
(integer inner sums, exact; the kernel's float32 outer sum differs from this float64 one by rounding
only). Which products are single-vector (custom_ops/reference/gating.py): the row of a call with one
pending row (M = 1 decode, threshold fast path at M = 1), each row of a running sequence whose event
mode is disabled, the event update of a row (the deltas of all its taken blocks, one vector) and the
gap check's dense row. A call with several pending rows multiplies them with f32 activations on Ŵ (the
dequantized-tile GEMM of the other formats). A dropped channel is 0 in v, so pairs whose channels are
both 0 after quantization are skipped: the element-wise mask survives; the bytes read are the pairs
with a nonzero channel (`pair_keep`).
"""
from __future__ import annotations

import numpy as np

FORMATS = ("f32", "int8", "int4", "int4k")
KFORMATS = ("int4k",)  # scales along K, integer activations (M = 1)
KGROUPS = (16, 32)
KCOLS = 32  # int4k: outputs per 32-byte chunk of a pair row
GROUPS = (16, 32, 64, 128, 256, 512, 1024)
CHUNK = 16  # int4: outputs per 8-byte chunk


def groups_of(N: int, group: int) -> int:
    return -(-N // group)


def row_bytes(fmt: str, N: int) -> int:
    if fmt == "int4k":
        return KCOLS * (-(-N // KCOLS))
    if fmt == "int8":
        return N
    if fmt == "int4":
        return 8 * (-(-N // CHUNK))
    raise ValueError(f"weight_format {fmt!r}: no quantized rows")


def _grouped(W: np.ndarray, group: int) -> np.ndarray:
    K, N = W.shape
    g = groups_of(N, group)
    return np.pad(W, ((0, 0), (0, g * group - N))).reshape(K, g, group)


def pack_int4(u: np.ndarray) -> np.ndarray:
    """u uint8 [K, N] in [0, 15] -> the int4 rows [K, 8·ceil(N/16)]."""
    K, N = u.shape
    nc = -(-N // CHUNK)
    p = np.zeros((K, nc * CHUNK), np.uint8)
    p[:, :N] = u
    p = p.reshape(K, nc, 2, 8)
    return (p[:, :, 0, :] | (p[:, :, 1, :] << 4)).reshape(K, nc * 8).astype(np.uint8)


def unpack_int4(wq: np.ndarray, N: int) -> np.ndarray:
    """The int4 rows -> u uint8 [K, N]."""
    K = wq.shape[0]
    b = np.asarray(wq, np.uint8).reshape(K, -1, 8)
    u = np.stack([b & 0x0F, b >> 4], axis=2).reshape(K, -1)
    return u[:, :N]


def quantize(W: np.ndarray, fmt: str, group: int = 32, zero_points: bool = False):
    """W float [K, N] -> (Wq uint8, scales float32 [K, groups], zero_points uint8 [K, groups] or None)."""
    W = np.asarray(W, np.float32)
    K, N = W.shape
    if fmt == "int4k":
        return _quantize_k(W, group, zero_points)
    if group not in GROUPS:
        raise ValueError(f"weight_group {group}: must be one of {GROUPS}")
    Wg = _grouped(W.astype(np.float64), group)
    if fmt == "int8":
        if zero_points:
            raise ValueError("int8 has no zero points (symmetric only)")
        s = np.abs(Wg).max(-1) / 127.0
        s = np.where(s > 0, s, 1.0).astype(np.float32)
        q = np.clip(np.rint(Wg / s[..., None].astype(np.float64)), -127, 127)
        q = q.reshape(K, -1)[:, :N].astype(np.int8)
        return q.view(np.uint8), s, None
    if fmt == "int4":
        if zero_points:
            lo, hi = np.minimum(Wg.min(-1), 0.0), np.maximum(Wg.max(-1), 0.0)
            s = (hi - lo) / 15.0
            s = np.where(s > 0, s, 1.0).astype(np.float32)
            sd = s.astype(np.float64)
            z = np.clip(np.rint(-lo / sd), 0, 15)
            u = np.clip(np.rint(Wg / sd[..., None]) + z[..., None], 0, 15)
            zp = z.astype(np.uint8)
        else:
            s = np.abs(Wg).max(-1) / 7.0
            s = np.where(s > 0, s, 1.0).astype(np.float32)
            u = np.clip(np.rint(Wg / s[..., None].astype(np.float64)), -8, 7) + 8
            zp = None
        u = u.reshape(K, -1)[:, :N].astype(np.uint8)
        return pack_int4(u), s, zp
    raise ValueError(f"weight_format {fmt!r}: must be int8 or int4 to quantize")


def dequantize(wq, scales, fmt: str, group: int, N: int, zero_points=None) -> np.ndarray:
    """The stored format -> Ŵ float32 [K, N] (the weights the op multiplies)."""
    scales = np.asarray(scales, np.float32)
    if fmt == "int4k":
        return _dequantize_k(wq, scales, group, N)
    K = scales.shape[0]
    g = groups_of(N, group)
    if scales.shape != (K, g):
        raise ValueError(f"scales shape {scales.shape}, expected [{K}, {g}]")
    col_scale = np.repeat(scales, group, axis=1)[:, :N]
    if fmt == "int8":
        q = np.asarray(wq, np.uint8).reshape(K, N).view(np.int8).astype(np.float32)
        return (col_scale * q).astype(np.float32)
    if fmt == "int4":
        u = unpack_int4(np.asarray(wq, np.uint8).reshape(K, row_bytes("int4", N)), N).astype(np.float32)
        z = (np.full((K, N), 8.0, np.float32) if zero_points is None
             else np.repeat(np.asarray(zero_points, np.uint8).reshape(K, g), group, axis=1)[:, :N].astype(np.float32))
        return (col_scale * (u - z)).astype(np.float32)
    raise ValueError(f"weight_format {fmt!r}")


def stored_bytes(fmt: str, K: int, N: int, group: int, zero_points: bool = False) -> int:
    """Bytes of the stored weights (what a dense matvec reads)."""
    if fmt == "f32":
        return 4 * K * N
    if fmt == "int4k":
        return -(-K // 2) * row_bytes(fmt, N) + 4 * groups_of(K, group) * N
    g = groups_of(N, group)
    return K * (row_bytes(fmt, N) + 4 * g + (g if zero_points else 0))


# ------------------------------------------------------------------ int4k (scales along K, pairs)
def _quantize_k(W: np.ndarray, group: int, zero_points: bool):
    """W float32 [K, N] -> (Wq uint8 [ceil(K/2), 32·ceil(N/32)], scales float32 [ceil(K/G), N], None)."""
    if zero_points:
        raise ValueError("int4k has no zero points (symmetric only)")
    if group not in KGROUPS:
        raise ValueError(f"weight_group {group}: int4k needs one of {KGROUPS}")
    K, N = W.shape
    gk = groups_of(K, group)
    Wg = np.pad(W.astype(np.float64), ((0, gk * group - K), (0, 0))).reshape(gk, group, N)
    s = np.abs(Wg).max(1) / 7.0
    s = np.where(s > 0, s, 1.0).astype(np.float32)
    q = np.clip(np.rint(Wg / s[:, None, :].astype(np.float64)), -8, 7).reshape(gk * group, N)[:K]
    return pack_int4k(q.astype(np.int8), N), s, None


def pack_int4k(q: np.ndarray, N: int) -> np.ndarray:
    """q int [K, N] in [-8, 7] -> the int4k pair rows."""
    K = q.shape[0]
    u = np.full((2 * (-(-K // 2)), row_bytes("int4k", N)), 8, np.uint8)
    u[:K, :N] = (np.asarray(q, np.int16) + 8).astype(np.uint8)
    return (u[0::2] | (u[1::2] << 4)).astype(np.uint8)


def unpack_int4k(wq: np.ndarray, K: int, N: int) -> np.ndarray:
    """The int4k pair rows -> q int8 [K, N]."""
    b = np.asarray(wq, np.uint8)
    u = np.empty((2 * b.shape[0], b.shape[1]), np.uint8)
    u[0::2], u[1::2] = b & 0x0F, b >> 4
    return (u[:K, :N].astype(np.int16) - 8).astype(np.int8)


def _check_k(wq, scales, group, K, N):
    if group not in KGROUPS:
        raise ValueError(f"weight_group {group}: int4k needs one of {KGROUPS}")
    if scales.shape != (groups_of(K, group), N):
        raise ValueError(f"scales shape {scales.shape}, expected [{groups_of(K, group)}, {N}]")
    if np.asarray(wq).shape != (-(-K // 2), row_bytes("int4k", N)):
        raise ValueError(f"Wq shape {np.asarray(wq).shape}, expected [{-(-K // 2)}, {row_bytes('int4k', N)}]")


def _dequantize_k(wq, scales, group: int, N: int) -> np.ndarray:
    K = 2 * np.asarray(wq).shape[0]
    q = unpack_int4k(wq, K, N).astype(np.float32)
    return (np.repeat(scales, group, axis=0)[:K] * q).astype(np.float32)


def dequantize_k(wq, scales, group: int, K: int, N: int) -> np.ndarray:
    """int4k -> Ŵ float32 [K, N] (K is not recoverable from Wq alone when it is odd)."""
    scales = np.asarray(scales, np.float32)
    _check_k(wq, scales, group, K, N)
    return _dequantize_k(wq, scales, group, N)[:K]


def quantize_activation(v: np.ndarray):
    """v float [K] -> (xq int32 [K] in [-127, 127], xs float32): symmetric, per product."""
    v = np.asarray(v, np.float32)
    a = np.float32(np.abs(v).max()) if v.size else np.float32(0)
    if not a > 0:
        return np.zeros(v.shape, np.int32), np.float32(0)
    inv = np.float32(127.0) / a
    xq = np.clip(np.rint(v * inv), -127, 127).astype(np.int32)
    return xq, np.float32(a / np.float32(127.0))


def qmatvec_k(v, wq, scales, group: int, K: int, N: int) -> np.ndarray:
    """y float64 [N] = the int8-activation product v · Ŵ of one vector (the int4k M = 1 path)."""
    scales = np.asarray(scales, np.float32)
    _check_k(wq, scales, group, K, N)
    if not np.all(np.isfinite(np.asarray(v, np.float32))):
        return np.full(N, np.nan)  # a non-finite input makes every output NaN
    xq, xs = quantize_activation(v)
    q = unpack_int4k(wq, K, N).astype(np.int64)
    gk = groups_of(K, group)
    xg = np.pad(xq.astype(np.int64), (0, gk * group - K)).reshape(gk, group)
    qg = np.pad(q, ((0, gk * group - K), (0, 0))).reshape(gk, group, N)
    acc = np.einsum("gk,gkn->gn", xg, qg)  # exact integers
    return float(xs) * np.sum(acc.astype(np.float64) * scales.astype(np.float64), axis=0)


def pair_keep(v) -> float:
    """Fraction of int4k pairs one product reads (a pair with a nonzero quantized channel)."""
    xq, _ = quantize_activation(v)
    if xq.size % 2:
        xq = np.append(xq, 0)
    return float(np.mean(np.any(xq.reshape(-1, 2) != 0, axis=1)))


def from_matmul_nbits(packed, scales, zero_points, K: int, N: int, bits: int, block_size: int):
    """A symmetric 4-bit ``com.microsoft.MatMulNBits`` weight -> the int4k layout of the SAME values.

    MatMulNBits stores, per output n and block b of ``block_size`` input rows, ``packed [N, nb, bs/2]``
    (element k of the block in byte k // 2, low nibble for even k), ``scales [N·nb]`` and, when
    asymmetric, zero points; Ŵ[k, n] = scales[n, k // bs] · (u − z), z = 8 when symmetric. int4k
    keeps exactly these q = u − 8 ∈ [−8, 7] and the scales transposed to [nb, N] with
    ``weight_group`` = ``block_size`` (16 or 32), so ``dequantize_k`` of the result equals
    MatMulNBits' Ŵ bit for bit. Returns (Wq, scales, weight_group). ValueError when the weight has
    no int4k equivalent (not 4 bits, another block size, zero points other than 8)."""
    if bits != 4:
        raise ValueError(f"MatMulNBits bits={bits}: only 4-bit weights have an int4k layout")
    if block_size not in KGROUPS:
        raise ValueError(f"MatMulNBits block_size={block_size}: int4k needs one of {KGROUPS}")
    nb = groups_of(K, block_size)
    packed = np.asarray(packed, np.uint8).reshape(N, nb, block_size // 2)
    u = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(N, nb * block_size)[:, :K]
    if zero_points is not None:
        zp = np.asarray(zero_points, np.uint8).reshape(N, -1)
        z = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(N, -1)[:, :nb]
        if np.any(z != 8):
            raise ValueError("MatMulNBits with zero points other than 8: int4k is symmetric")
    q = (u.astype(np.int16) - 8).astype(np.int8).T  # [K, N]
    sc = np.ascontiguousarray(np.asarray(scales, np.float32).reshape(N, nb).T)
    return pack_int4k(q, N), sc, block_size
