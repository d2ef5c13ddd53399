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
"""
from __future__ import annotations

import numpy as np

FORMATS = ("f32", "int8", "int4")
GROUPS = (16, 32, 64, 128, 256, 512, 1024)
CHUNK = 16  # int4: outputs per 8-byte chunk


def groups_of(N: int, group: int) -> int:
    return -(-N // group)


def row_bytes(fmt: str, N: int) -> int:
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
    g = groups_of(N, group)
    return K * (row_bytes(fmt, N) + 4 * g + (g if zero_points else 0))
