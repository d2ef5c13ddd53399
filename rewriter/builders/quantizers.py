"""Float weights -> BlockQuantMatMul blocks (``custom_ops/reference/blockquant.py``, the op's contract):
the quantizers ``--weights int4|int8`` uses on a float checkpoint (issue 34, item 3).

Every quantizer takes a layer's weight as ``Wt`` float32 ``[N, K]`` (row n = output n's weights along K,
ggml's layout) and returns :class:`Blocks` — the op's ``W`` bytes, its format and block. K need not be a
multiple of the block: the last block is padded with its last weight (inside the block's range, so the
padding never widens a scale) and the padding has no weight in any fit; the op ignores it.

- ``rtn``: asymmetric round-to-nearest, min/max per block (``q4_f``).
- ``hqq``: ONNX Runtime's HQQ (``HQQWeightOnlyQuantizer.quantize_internal``, the proximal solver of
  Badri & Shaji), its float scale and zero point per block becoming ``q4_f``'s d and m.
- ``kquant``: a weighted scale / offset search per (sub-)block in the spirit of llama.cpp's
  ``make_qkx3_quants`` / ``make_qx_quants`` / ``make_qp_quants`` (re-derived here in vectorised numpy,
  not copied): for each block, rescalings of the min/max grid are tried, the scale and offset refitted
  by weighted least squares for each, and the best kept. Weights are ggml's importance
  ``imp[k] · sqrt(σ² + w²)`` with ``imp`` = the calibration inputs' mean square per input channel (the
  Gram's diagonal: llama.cpp's imatrix) when calibrated, else ``σ + |w|``. Formats ``q4_f`` (any block),
  ``q4_K``, ``q5_K`` (6-bit scales and mins per 32 under an fp16 pair per 256), ``q6_K`` (int8 scales
  per 16) and ``q8_0``.
- ``gptq``: GPTQ (Frantar et al.; the algorithm ONNX Runtime bundles in
  ``onnxruntime.quantization.neural_compressor.weight_only.gptq``): columns quantized one at a time
  along K, each one's error spread over the columns not yet quantized through the inverse Hessian
  (the calibration Gram). Generalised here over the grid: each block's grid (any format above, fitted
  by ``kquant``'s search with the imatrix) is fitted when the sweep reaches the block, on the weights
  as the earlier columns' errors left them; ``tests/test_float_weights.py`` checks it reproduces ORT's
  ``gptq`` exactly on ORT's own grid.

``dequantize`` of any result is the reference's (so it equals ``gguf.quants.dequantize`` bit for bit for
the GGUF types)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from custom_ops.reference import blockquant as bq

QUANTIZERS = ("rtn", "hqq", "kquant", "gptq")
# formats a quantizer here can write
FORMATS = ("q4_f", "q4_0", "q5_0", "q5_1", "q4_K", "q5_K", "q6_K", "q8_0")
# the affine formats' code range, and the symmetric formats' (codes −nmax..nmax−1)
_AFFINE = {"q4_f": 15, "q5_1": 31}
_SYMMETRIC = {"q4_0": 8, "q5_0": 16}
_ROWS = 2048          # rows per chunk in the vectorised searches (bounds their temporaries)


@dataclass
class Blocks:
    """One layer in a BlockQuantMatMul format: ``W`` uint8 [N, row_bytes] (the op's input), ``fmt``,
    ``block`` (q4_f's block_size, else None), ``K``."""
    fmt: str
    W: np.ndarray
    K: int
    block: int | None = None
    source: str = ""
    info: dict = field(default_factory=dict)

    @property
    def N(self) -> int:
        return int(self.W.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.W.nbytes)

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight of this layer (the last block's padding included)."""
        return 8.0 * self.W.nbytes / (self.N * self.K)

    def dequantize(self) -> np.ndarray:
        """Ŵ float32 [N, K] (the op's weights, ``blockquant.dequantize``)."""
        return bq.dequantize(self.W, self.fmt, self.K, self.block)


def layer_bits(fmt: str, K: int, block: int | None = None) -> float:
    """Bits per weight a layer of K inputs costs in ``fmt`` (the padded last block included)."""
    return 8.0 * bq.row_bytes(fmt, K, block) / K


def importance(G: np.ndarray | None, rows: int | None = None) -> np.ndarray | None:
    """The imatrix of a layer: mean square of its calibration inputs per input channel (diag of the
    Gram XᵀX over its rows), float64 [K]; None without calibration."""
    if G is None:
        return None
    d = np.clip(np.diag(np.asarray(G, np.float64)), 0.0, None)
    return d / max(int(rows or 1), 1)


# ------------------------------------------------------------------ helpers
def _f16(v) -> np.ndarray:
    """Rounded to fp16 (and back to float32); values beyond fp16's range are clipped to it."""
    return np.clip(np.asarray(v, np.float32), -65504.0, 65504.0).astype(np.float16).astype(np.float32)


def _pad(Wt: np.ndarray, B: int) -> tuple[np.ndarray, np.ndarray]:
    """Wt [N, K] -> (Wp [N, nb·B] with the last block padded by its last weight, valid [nb·B] bool)."""
    N, K = Wt.shape
    L = -(-K // B) * B
    valid = np.zeros(L, bool)
    valid[:K] = True
    if L == K:
        return np.ascontiguousarray(Wt, np.float32), valid
    return np.pad(np.asarray(Wt, np.float32), ((0, 0), (0, L - K)), mode="edge"), valid


def _weights(Wp: np.ndarray, imp: np.ndarray | None, valid: np.ndarray, group: int) -> np.ndarray:
    """ggml's per-weight importance for the fits, [N, L] float32: with an imatrix ``imp`` [K]
    ``imp[k] · sqrt(σ² + w²)``, σ² the mean square of the row's weights in the group (a super-block
    / block); without, ``σ + |w|``. Padding (``~valid``) weighs 0."""
    N, L = Wp.shape
    g = Wp.reshape(N, L // group, group)
    sig2 = np.mean(g * g, axis=-1, keepdims=True)
    if imp is None:
        w = np.sqrt(sig2) + np.abs(g)
    else:
        qw = np.zeros(L, np.float32)
        qw[: imp.size] = imp
        # a channel the calibration never excited keeps a small weight (its weights still matter a little)
        floor = 1e-3 * float(qw[valid].mean()) if qw[valid].size and qw[valid].mean() > 0 else 1.0
        qw = np.maximum(qw, floor).reshape(L // group, group)
        w = qw[None] * np.sqrt(sig2 + g * g)
    w = w.reshape(N, L).astype(np.float32)
    w[:, ~valid] = 0.0
    return w


def fit_affine(x: np.ndarray, w: np.ndarray, nmax: int, *, offset_le_zero: bool = True, rmin: float = -0.9,
               rdelta: float = 0.05, nstep: int = 36, codes: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weighted affine fit of each row of ``x`` [S, n] on the grid ``scale · L + offset``, L ∈ 0..nmax:
    the min/max grid, then ``nstep + 1`` rescalings ``(nmax + rmin + rdelta·i) / (max − min)`` each with
    its weighted least-squares scale and offset, the lowest weighted squared error kept (the search of
    llama.cpp's make_qkx3_quants). ``offset_le_zero`` keeps offset ≤ 0 (the K formats store −offset
    unsigned). Returns (scale [S], offset [S], L [S, n] uint8), scale ≥ 0; ``codes=False`` (the callers that
    round again on the fp16 grid) returns L None and skips keeping the best codes per candidate (the scale and
    offset are the same bit for bit: the same float operations in the same order)."""
    x = np.asarray(x, np.float32)
    w = np.asarray(w, np.float32)
    lo = x.min(axis=1)
    hi = x.max(axis=1)
    if offset_le_zero:
        lo = np.minimum(lo, 0.0)
    rng = hi - lo
    flat = ~(rng > 0)
    rng = np.where(flat, 1.0, rng).astype(np.float32)
    xs = x - lo[:, None]
    sw = w.sum(axis=1, dtype=np.float64)
    wx = w * x
    sx = wx.sum(axis=1, dtype=np.float64)
    sxx = np.einsum("ij,ij->i", wx, x, dtype=np.float64)

    def err(s, m, sl, sl2, sxl):
        # Σ w (s·L + m − x)², expanded over the sums (float64): no pass over the block per candidate
        return s * s * sl2 + 2 * s * m * sl - 2 * s * sxl + m * m * sw - 2 * m * sx + sxx

    wl = np.empty_like(x)

    def sums(L):  # Σ w·L, Σ w·L², Σ w·L·x per row (float32 sums of ≤ 256 terms, then float64)
        np.multiply(w, L, out=wl)
        return (wl.sum(axis=1).astype(np.float64), np.einsum("ij,ij->i", wl, L).astype(np.float64),
                np.einsum("ij,ij->i", wl, x).astype(np.float64))

    La = np.empty_like(x)
    np.multiply(xs, (nmax / rng)[:, None], out=La)
    np.rint(La, out=La)
    np.clip(La, 0, nmax, out=La)
    L = La.copy() if codes else None
    scale = (rng / nmax).astype(np.float64)
    off = lo.astype(np.float64)
    best = err(scale, off, *sums(La))
    for i in range(nstep + 1):
        iscale = ((nmax + rmin + rdelta * i) / rng).astype(np.float32)
        np.multiply(xs, iscale[:, None], out=La)
        np.rint(La, out=La)
        np.clip(La, 0, nmax, out=La)
        sl, sl2, sxl = sums(La)
        D = sw * sl2 - sl * sl
        ok = D > 1e-12 * sw * sl2
        Ds = np.where(ok, D, 1.0)
        s_ = (sw * sxl - sx * sl) / Ds
        m_ = (sl2 * sx - sl * sxl) / Ds
        if offset_le_zero:
            pos = m_ > 0
            m_ = np.where(pos, 0.0, m_)
            s_ = np.where(pos, sxl / np.where(sl2 > 0, sl2, 1.0), s_)
        ok &= s_ > 0
        e = err(s_, m_, sl, sl2, sxl)
        take = ok & (e < best)
        if take.any():
            np.copyto(best, e, where=take)
            np.copyto(scale, s_, where=take)
            np.copyto(off, m_, where=take)
            if codes:
                L[take] = La[take]
    scale = scale.astype(np.float32)
    off = off.astype(np.float32)
    scale = np.where(flat, 0.0, scale).astype(np.float32)
    off = np.where(flat, np.where(offset_le_zero, np.minimum(x[:, 0], 0.0), x[:, 0]), off).astype(np.float32)
    if offset_le_zero:  # a flat positive block: L·scale cannot reach it with offset ≤ 0 and scale 0
        fp = flat & (x[:, 0] > 0)
        scale[fp] = x[fp, 0] / nmax
    if not codes:
        return scale, off, None
    L[flat] = 0
    if offset_le_zero:
        L[fp] = nmax
    return scale, off, L.astype(np.uint8)


def fit_symmetric(x: np.ndarray, w: np.ndarray, nmax: int, ntry: int = 9) -> tuple[np.ndarray, np.ndarray]:
    """Weighted symmetric fit ``scale · L``, L ∈ −nmax..nmax−1, of each row of ``x`` [S, n]: the grid
    through the largest-magnitude weight (mapped to −nmax), then rescalings ``−(nmax + 0.1·i) / max``
    for |i| ≤ ntry, each with its least-squares scale, the best kept (llama.cpp's make_qx_quants).
    Returns (scale [S] (signed), L [S, n] int8)."""
    x = np.asarray(x, np.float32)
    w = np.asarray(w, np.float32)
    idx = np.abs(x).argmax(axis=1)
    mx = x[np.arange(x.shape[0]), idx]
    zero = mx == 0
    mxs = np.where(zero, 1.0, mx).astype(np.float32)

    def grid(iscale):
        L = np.clip(np.rint(x * iscale[:, None]), -nmax, nmax - 1).astype(np.float32)
        wl = w * L
        return L, (wl * x).sum(axis=1), (wl * L).sum(axis=1)

    L, sxl, sl2 = grid(-nmax / mxs)
    best_num, best_den = sxl * sxl, np.where(sl2 > 0, sl2, 1.0)
    scale = np.where(sl2 > 0, sxl / np.where(sl2 > 0, sl2, 1.0), 1.0 / (-nmax / mxs)).astype(np.float32)
    for i in range(-ntry, ntry + 1):
        if i == 0:
            continue
        La, s_xl, s_l2 = grid(-(nmax + 0.1 * i) / mxs)
        take = (s_l2 > 0) & (s_xl * s_xl * best_den > best_num * s_l2)
        if take.any():
            best_num = np.where(take, s_xl * s_xl, best_num)
            best_den = np.where(take, s_l2, best_den)
            scale = np.where(take, s_xl / np.where(s_l2 > 0, s_l2, 1.0), scale).astype(np.float32)
            L[take] = La[take]
    scale[zero] = 0.0
    L[zero] = 0
    return scale, L.astype(np.int8)


def fit_levels(v: np.ndarray, sw: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Quantize non-negative per-sub-block values ``v`` [S, J] (scales or mins) to ``d · L``, L ∈ 0..nmax
    integers, one d per row, minimising Σ sw·(v − d·L)² (llama.cpp's make_qp_quants, re-derived):
    candidate grids ``(nmax + 0.1·i) / max`` for |i| ≤ 4, then a least-squares d for the best one and a
    few passes moving single L by the rounding of v/d. Returns (d [S], L [S, J] uint8)."""
    v = np.asarray(v, np.float64)
    sw = np.asarray(sw, np.float64)
    mx = v.max(axis=1)
    zero = ~(mx > 1e-30)
    mxs = np.where(zero, 1.0, mx)

    def mse(iscale):
        L = np.clip(np.rint(v * iscale[:, None]), 0, nmax)
        d = 1.0 / iscale
        return L, (sw * (v - d[:, None] * L) ** 2).sum(axis=1)

    best_is = nmax / mxs
    L, best = mse(best_is)
    for i in range(-4, 5):
        if i == 0:
            continue
        isc = (nmax + 0.1 * i) / mxs
        La, e = mse(isc)
        take = e < best
        best = np.where(take, e, best)
        best_is = np.where(take, isc, best_is)
    L = np.clip(np.rint(v * best_is[:, None]), 0, nmax)
    for _ in range(3):  # alternate: least-squares d for L, then L for d
        den = (sw * L * L).sum(axis=1)
        d = np.where(den > 0, (sw * v * L).sum(axis=1) / np.where(den > 0, den, 1.0), 1.0 / best_is)
        L = np.clip(np.rint(v / np.where(d > 0, d, 1.0)[:, None]), 0, nmax)
    den = (sw * L * L).sum(axis=1)
    d = np.where(den > 0, (sw * v * L).sum(axis=1) / np.where(den > 0, den, 1.0), 0.0)
    d[zero] = 0.0
    L[zero] = 0
    return d.astype(np.float32), L.astype(np.uint8)


# ------------------------------------------------------------------ grids: params of one block range
class Grid:
    """The fitted parameters of a run of whole blocks of one format for all N rows: ``quantize(col, j)``
    rounds column j (of the run) to its block's grid, ``value(L, j)`` is the weight of code L there.
    ``pack()`` gives the run's bytes once every column's code is set."""

    # columns sharing one scale (and offset): a column's parameters are gathered once per group (_params)
    group = 32

    def __init__(self, fmt: str, block: int | None, N: int, width: int):
        self.fmt, self.block, self.N, self.width = fmt, block, N, width
        self.codes = np.zeros((N, width), np.int16)
        self._cache = None

    def _params(self, j: int):
        """(s, o, lo, hi, s != 0, s with 1 where 0) of column j, contiguous, kept for its group's columns
        (the same values as ``_col``: GPTQ asks them once per column)."""
        k = j // self.group
        if self._cache is None or self._cache[0] != k:
            s, o, lo, hi = self._col(j)
            s = np.ascontiguousarray(s)
            o = o if np.ndim(o) == 0 else np.ascontiguousarray(o)
            nz = s != 0
            self._cache = (k, s, o, lo, hi, nz, np.where(nz, s, 1.0))
        return self._cache[1:]

    def quantize(self, col: np.ndarray, j: int) -> np.ndarray:
        """Codes of column j for the weights ``col`` [N] (round to nearest on the block's grid)."""
        s, o, lo, hi, nz, sd = self._params(j)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(nz, np.rint((col - o) / sd), 0.0)
        return np.clip(q, lo, hi).astype(np.int16)

    def value(self, q: np.ndarray, j: int) -> np.ndarray:
        s, o = self._params(j)[:2]
        return (s * q.astype(np.float32) + o).astype(np.float32)

    def round_all(self, x: np.ndarray) -> None:
        """``codes[:, j] = quantize(x[:, j], j)`` for every column, a group of columns at a time (the same
        float operations per weight; a column at a time is a strided pass over N rows per column)."""
        g = self.group
        for g0 in range(0, self.width, g):
            s, o, lo, hi, nz, sd = self._params(g0)
            o = o if np.ndim(o) == 0 else o[:, None]
            with np.errstate(divide="ignore", invalid="ignore"):
                q = np.where(nz[:, None], np.rint((x[:, g0:g0 + g] - o) / sd[:, None]), 0.0)
            self.codes[:, g0:g0 + g] = np.clip(q, lo, hi).astype(np.int16)

    def dequantized(self) -> np.ndarray:
        """The run's weights [N, width] as its codes and parameters give them (float32, as the op)."""
        return np.stack([self.value(self.codes[:, j], j) for j in range(self.width)], axis=1)

    def _col(self, j: int):
        raise NotImplementedError

    def pack(self) -> np.ndarray:
        raise NotImplementedError


class AffineGrid(Grid):
    """q4_f (block B) / q5_1 (32): per block fp16 d and m, w = d·q + m, q ∈ 0..nmax."""

    def __init__(self, fmt: str, N: int, width: int, B: int, d: np.ndarray, m: np.ndarray):
        super().__init__(fmt, B, N, width)
        self.d, self.m = d, m                       # [N, width // B] float32 (fp16 values)
        self.nmax = _AFFINE[fmt]
        self.group = B

    def _col(self, j):
        b = j // self.block
        return self.d[:, b], self.m[:, b], 0, self.nmax

    def pack(self) -> np.ndarray:
        if self.fmt == "q4_f":
            return bq.pack_q4_f(self.codes.astype(np.uint8), self.d, self.m, self.block)
        return _pack32(self.fmt, self.codes.astype(np.uint8), self.d, self.m)


class SymGrid(Grid):
    """q4_0 / q5_0: per 32 an fp16 d, w = d·(q − nmax), codes here q − nmax ∈ −nmax..nmax−1."""

    def __init__(self, fmt: str, N: int, width: int, d: np.ndarray):
        super().__init__(fmt, None, N, width)
        self.d = d                                  # [N, width // 32]
        self.nmax = _SYMMETRIC[fmt]

    def _col(self, j):
        return self.d[:, j // 32], np.float32(0.0), -self.nmax, self.nmax - 1

    def value(self, q, j):
        return (self._params(j)[0] * q.astype(np.float32)).astype(np.float32)

    def pack(self) -> np.ndarray:
        return _pack32(self.fmt, (self.codes + self.nmax).astype(np.uint8), self.d, None)


def _pack32(fmt: str, q: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> np.ndarray:
    """ggml's 32-blocks q4_0 / q5_0 / q5_1 from unsigned codes q [N, nb·32] and fp16 d (m) [N, nb]."""
    N, L = q.shape
    nb = L // 32
    qb = q.reshape(N * nb, 32)
    parts = [bq._f16_bytes(d.reshape(-1))]
    if m is not None:
        parts.append(bq._f16_bytes(m.reshape(-1)))
    if fmt in ("q5_0", "q5_1"):
        hi = (qb >> np.uint8(4)) & np.uint8(1)
        parts.append(np.packbits(hi, axis=1, bitorder="little"))          # bit j of the little-endian uint32
    lo = qb & np.uint8(15)
    parts.append(lo[:, :16] | (lo[:, 16:] << np.uint8(4)))
    return np.concatenate(parts, axis=1).reshape(N, nb * bq.TYPE_SIZE[fmt])


class KGrid(Grid):
    """q4_K / q5_K: per 256, fp16 d, dmin; per 32, 6-bit sc, m; w = (d·sc)·q − (dmin·m)."""

    def __init__(self, fmt: str, N: int, width: int, d, dmin, sc, mn):
        super().__init__(fmt, None, N, width)
        self.d, self.dmin, self.sc, self.mn = d, dmin, sc, mn   # [N, nsb], [N, nsb], [N, nsb, 8] uint8 x2
        ns = width // 256
        self.S = (d[:, :, None] * sc.astype(np.float32)).astype(np.float32).reshape(N, ns * 8)
        self.M = (dmin[:, :, None] * mn.astype(np.float32)).astype(np.float32).reshape(N, ns * 8)
        self.nmax = 15 if fmt == "q4_K" else 31

    def _col(self, j):
        s = j // 32
        return self.S[:, s], -self.M[:, s], 0, self.nmax

    def value(self, q, j):  # (d·sc)·q − (dmin·m), the op's float32 order
        s, o = self._params(j)[:2]
        return (s * q.astype(np.float32) - (-o)).astype(np.float32)     # o = −M: −o is M bit for bit

    def pack(self) -> np.ndarray:
        N, ns = self.d.shape
        L = self.codes.astype(np.uint8).reshape(N * ns, 8, 32)
        out = np.zeros((N * ns, 144 if self.fmt == "q4_K" else 176), np.uint8)
        out[:, 0:2] = bq._f16_bytes(self.d.reshape(-1))
        out[:, 2:4] = bq._f16_bytes(self.dmin.reshape(-1))
        out[:, 4:16] = _pack_scales_k4(self.sc.reshape(N * ns, 8), self.mn.reshape(N * ns, 8))
        lo = L & np.uint8(15)
        qs = lo[:, 0::2, :] | (lo[:, 1::2, :] << np.uint8(4))          # [n, 4, 32]: sub-blocks 2c, 2c+1
        if self.fmt == "q4_K":
            out[:, 16:144] = qs.reshape(-1, 128)
        else:
            hb = (L >> np.uint8(4)) & np.uint8(1)                        # [n, 8, 32]
            qh = (hb << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
            out[:, 16:48] = qh
            out[:, 48:176] = qs.reshape(-1, 128)
        return out.reshape(N, ns * out.shape[1])


class Q6KGrid(Grid):
    """q6_K: per 256 fp16 d; per 16 int8 sc; w = (d·sc)·(q − 32), q ∈ 0..63 (codes here: q − 32)."""

    def __init__(self, N: int, width: int, d, sc):
        super().__init__("q6_K", None, N, width)
        self.d, self.sc = d, sc                                          # [N, nsb], [N, nsb, 16] int8
        ns = width // 256
        self.S = (d[:, :, None] * sc.astype(np.float32)).astype(np.float32).reshape(N, ns * 16)

    def _col(self, j):
        return self.S[:, j // 16], np.float32(0.0), -32, 31

    group = 16

    def value(self, q, j):
        return (self._params(j)[0] * q.astype(np.float32)).astype(np.float32)

    def pack(self) -> np.ndarray:
        N, ns = self.d.shape
        q = (self.codes.astype(np.int16) + 32).astype(np.uint8).reshape(N * ns, 2, 4, 32)  # [n, half, quarter, 32]
        lo, hi = q & np.uint8(15), q >> np.uint8(4)
        out = np.zeros((N * ns, 210), np.uint8)
        ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << np.uint8(4)), lo[:, :, 1] | (lo[:, :, 3] << np.uint8(4))],
                            axis=-1)                                     # [n, 2, 64]
        out[:, 0:128] = ql.reshape(-1, 128)
        qh = hi[:, :, 0] | (hi[:, :, 1] << np.uint8(2)) | (hi[:, :, 2] << np.uint8(4)) | (hi[:, :, 3] << np.uint8(6))
        out[:, 128:192] = qh.reshape(-1, 64)
        out[:, 192:208] = self.sc.reshape(N * ns, 16).view(np.uint8)
        out[:, 208:210] = bq._f16_bytes(self.d.reshape(-1))
        return out.reshape(N, ns * 210)


class Q80Grid(Grid):
    """q8_0: per 32 fp16 d, w = d·q, q ∈ −127..127."""

    def __init__(self, N: int, width: int, d):
        super().__init__("q8_0", None, N, width)
        self.d = d                                                       # [N, width // 32]

    def _col(self, j):
        return self.d[:, j // 32], np.float32(0.0), -127, 127

    def value(self, q, j):
        return (q.astype(np.float32) * self._params(j)[0]).astype(np.float32)

    def pack(self) -> np.ndarray:
        N, nb = self.d.shape
        out = np.zeros((N * nb, 34), np.uint8)
        out[:, 0:2] = bq._f16_bytes(self.d.reshape(-1))
        out[:, 2:34] = self.codes.astype(np.int8).reshape(N * nb, 32).view(np.uint8)
        return out.reshape(N, nb * 34)


def _pack_scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit sc, m [n, 8] -> the 12 scale bytes of q4_K / q5_K (the inverse of get_scale_min_k4)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return out


# ------------------------------------------------------------------ fitting one run of blocks
def unit(fmt: str, block: int | None = None) -> int:
    """Columns a format's grid is fitted over at once (its block; 256 for the K formats)."""
    return bq.block_of(fmt, block)


def fit_grid(fmt: str, x: np.ndarray, w: np.ndarray, block: int | None = None, *, rounds: int = 2,
             codes: bool = True) -> Grid:
    """The grid of ``fmt`` for weights ``x`` [N, width] (width a multiple of the format's unit) under
    importance ``w`` [N, width], with the codes of ``x`` on it set (round to nearest; ``codes=False``:
    left for the caller, as GPTQ, which rounds each column itself)."""
    x = np.ascontiguousarray(x, np.float32)
    w = None if w is None and fmt == "q8_0" else np.ascontiguousarray(w, np.float32)   # q8_0 weighs nothing
    N, width = x.shape
    if fmt in _AFFINE:
        B = bq.block_of(fmt, block if fmt == "q4_f" else None)
        nb = width // B
        xb, wb = x.reshape(N * nb, B), w.reshape(N * nb, B)
        d = np.empty(N * nb, np.float32)
        m = np.empty(N * nb, np.float32)
        L = np.empty((N * nb, B), np.uint8)
        for a in range(0, N * nb, _ROWS * 8):
            sl = slice(a, a + _ROWS * 8)
            d[sl], m[sl], L[sl] = _fit_f16_affine(xb[sl], wb[sl], _AFFINE[fmt], rounds)
        g = AffineGrid(fmt, N, width, B, d.reshape(N, nb), m.reshape(N, nb))
        g.codes[:] = L.reshape(N, width)
        return g
    if fmt in _SYMMETRIC:
        nb = width // 32
        xb, wb = x.reshape(N * nb, 32), w.reshape(N * nb, 32)
        S = np.empty(N * nb, np.float32)
        for a in range(0, S.size, _ROWS * 8):
            sl = slice(a, a + _ROWS * 8)
            S[sl], _ = fit_symmetric(xb[sl], wb[sl], _SYMMETRIC[fmt])
        g = SymGrid(fmt, N, width, _f16(S).reshape(N, nb))
    elif fmt in ("q4_K", "q5_K"):
        nmax = 15 if fmt == "q4_K" else 31
        ns = width // 256
        xs, ws = x.reshape(N * ns * 8, 32), w.reshape(N * ns * 8, 32)
        S = np.empty(N * ns * 8, np.float32)
        O = np.empty(N * ns * 8, np.float32)
        for a in range(0, S.size, _ROWS * 8):
            sl = slice(a, a + _ROWS * 8)
            S[sl], O[sl], _ = fit_affine(xs[sl], ws[sl], nmax, offset_le_zero=True, codes=False)
        sw = ws.sum(axis=1).reshape(N * ns, 8)
        d, sc = fit_levels(S.reshape(N * ns, 8), sw, 63)
        dmin, mn = fit_levels((-O).reshape(N * ns, 8), sw, 63)
        g = KGrid(fmt, N, width, _f16(d).reshape(N, ns), _f16(dmin).reshape(N, ns), sc.reshape(N, ns, 8),
                  mn.reshape(N, ns, 8))
    elif fmt == "q6_K":
        ns = width // 256
        xs, ws = x.reshape(N * ns * 16, 16), w.reshape(N * ns * 16, 16)
        S = np.empty(N * ns * 16, np.float32)
        for a in range(0, S.size, _ROWS * 16):
            sl = slice(a, a + _ROWS * 16)
            S[sl], _ = fit_symmetric(xs[sl], ws[sl], 32)
        S = S.reshape(N * ns, 16)
        i = np.abs(S).argmax(axis=1)
        mx = S[np.arange(S.shape[0]), i]
        ok = np.abs(mx) > 1e-15
        iscale = np.where(ok, -128.0 / np.where(ok, mx, 1.0), 0.0)
        sc = np.clip(np.rint(iscale[:, None] * S), -128, 127).astype(np.int8)
        d = _f16(np.where(ok, 1.0 / np.where(ok, iscale, 1.0), 0.0))
        sc[~ok] = 0
        g = Q6KGrid(N, width, d.reshape(N, ns), sc.reshape(N, ns, 16))
    elif fmt == "q8_0":
        nb = width // 32
        amax = np.empty((N, nb), np.float32)
        for a in range(0, N, _ROWS * 8):      # rows at a time: no whole-matrix |x| (a head's 640 MB)
            amax[a:a + _ROWS * 8] = np.abs(x[a:a + _ROWS * 8].reshape(-1, nb, 32)).max(axis=-1)
        g = Q80Grid(N, width, _f16(amax / 127.0))
    else:
        raise ValueError(f"format {fmt!r}: the quantizers write {', '.join(FORMATS)}")
    if codes:
        g.round_all(x)
    return g


def _fit_f16_affine(x, w, nmax, rounds):
    """``fit_affine`` (offset free), then d and m rounded to fp16 and refitted by weighted least squares
    for the codes they give, ``rounds`` times, keeping the best (per block)."""
    s, o, _ = fit_affine(x, w, nmax, offset_le_zero=False, codes=False)
    d, m = _f16(s), _f16(o)

    def codes(d, m):
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(d[:, None] > 0, np.rint((x - m[:, None]) / np.where(d > 0, d, 1.0)[:, None]), 0)
        return np.clip(q, 0, nmax).astype(np.float32)

    def err(d, m, L):
        e = d[:, None] * L + m[:, None] - x
        return (w * e * e).sum(axis=1)

    L = codes(d, m)
    best = err(d, m, L)
    for _ in range(rounds):
        sw, sl, sl2 = w.sum(1), (w * L).sum(1), (w * L * L).sum(1)
        sx, sxl = (w * x).sum(1), (w * L * x).sum(1)
        D = sw * sl2 - sl * sl
        ok = D > 0
        Ds = np.where(ok, D, 1.0)
        d2 = _f16(np.where(ok, (sw * sxl - sx * sl) / Ds, d))
        m2 = _f16(np.where(ok, (sl2 * sx - sl * sxl) / Ds, m))
        d2 = np.where(d2 > 0, d2, d)
        L2 = codes(d2, m2)
        e2 = err(d2, m2, L2)
        take = e2 < best
        d, m, best = np.where(take, d2, d), np.where(take, m2, m), np.where(take, e2, best)
        L = np.where(take[:, None], L2, L)
    return d, m, L.astype(np.uint8)


# ------------------------------------------------------------------ the quantizers
def _result(fmt, block, K, grids: list[Grid], source: str, info: dict | None = None) -> Blocks:
    W = np.concatenate([g.pack() for g in grids], axis=1) if len(grids) > 1 else grids[0].pack()
    return Blocks(fmt, np.ascontiguousarray(W), int(K), block if fmt == "q4_f" else None, source, info or {})


def _check(Wt: np.ndarray, fmt: str, block: int | None):
    Wt = np.asarray(Wt, np.float32)
    if Wt.ndim != 2 or min(Wt.shape) < 1:
        raise ValueError(f"weights must be a 2-D [N, K] matrix, got shape {list(Wt.shape)}")
    step = max(1, (16 << 20) // (4 * Wt.shape[1]))     # rows at a time: no whole-matrix temporary (a head's 640 MB)
    if not all(np.isfinite(Wt[a:a + step]).all() for a in range(0, Wt.shape[0], step)):
        raise ValueError("weights hold NaN or infinite values")
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: the quantizers write {', '.join(FORMATS)}")
    amax = max(float(np.abs(Wt[a:a + step]).max(initial=0.0)) for a in range(0, Wt.shape[0], step))
    if amax > 60000.0:
        raise ValueError(f"weights up to {amax:.3g}: beyond what fp16 scales hold")
    return Wt, bq.block_of(fmt, block if fmt == "q4_f" else None)


def kquant(Wt: np.ndarray, fmt: str, block: int | None = None, imp: np.ndarray | None = None) -> Blocks:
    """The weighted search (module docstring) of ``Wt`` [N, K] into ``fmt`` (q4_f with ``block``), with
    the imatrix ``imp`` [K] when calibrated."""
    Wt, B = _check(Wt, fmt, block)
    Wp, valid = _pad(Wt, B)
    # q8_0's grid is the absmax per 32: no importance (a head's would be four 640 MB temporaries for nothing)
    w = None if fmt == "q8_0" else _weights(Wp, imp, valid, 256 if fmt in ("q4_K", "q5_K", "q6_K") else B)
    g = fit_grid(fmt, Wp, w, B if fmt == "q4_f" else None)
    return _result(fmt, B, Wt.shape[1], [g], "kquant" + ("+imatrix" if imp is not None else ""))


def rtn(Wt: np.ndarray, fmt: str = "q4_f", block: int | None = 32) -> Blocks:
    """Round to nearest: q4_f asymmetric min/max per block (fp16 d = (max − min)/15, m = min), q8_0
    symmetric absmax."""
    Wt, B = _check(Wt, fmt, block)
    if fmt == "q8_0":
        Wp, _ = _pad(Wt, 32)
        return _result(fmt, None, Wt.shape[1], [fit_grid("q8_0", Wp, None)], "rtn")
    if fmt != "q4_f":
        raise ValueError(f"rtn writes q4_f or q8_0 (the K formats: kquant), not {fmt}")
    Wp, _ = _pad(Wt, B)
    return Blocks("q4_f", bq.quantize_q4_f(Wp, B), Wt.shape[1], B, "rtn")


def hqq(Wt: np.ndarray, block: int = 64, bits: int = 4) -> Blocks:
    """ONNX Runtime's HQQ (``HQQWeightOnlyQuantizer.quantize_internal``: min/max init, then its proximal
    solver on the zero point) per block of ``block`` along K -> q4_f: d = its scale, m = −zero · scale."""
    import torch
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig, HQQWeightOnlyQuantizer

    Wt, B = _check(Wt, "q4_f", block)
    Wp, _ = _pad(Wt, B)
    q = HQQWeightOnlyQuantizer(HQQWeightOnlyQuantConfig(block_size=B, bits=bits))
    N, L = Wp.shape
    codes = np.empty((N, L), np.uint8)
    d = np.empty((N, L // B), np.float32)
    m = np.empty((N, L // B), np.float32)
    for a in range(0, N, 4096):   # HQQ's error stop is per call: rows in chunks keep it per chunk, bounded memory
        wq, scale, zero = q.quantize_internal(torch.from_numpy(Wp[a:a + 4096]), bits=bits, group_size=B)
        n = wq.shape[0]
        codes[a:a + n] = wq.numpy().reshape(n, L).astype(np.uint8)
        s = scale.numpy().reshape(n, L // B).astype(np.float32)
        z = zero.numpy().reshape(n, L // B).astype(np.float32)
        d[a:a + n], m[a:a + n] = s, -z * s
    d16, m16 = _f16(d), _f16(m)
    return Blocks("q4_f", bq.pack_q4_f(codes, d16, m16, B), Wt.shape[1], B, "hqq")


def hessian_factor(G: np.ndarray, percdamp: float = 0.01, pad_to: int | None = None) -> np.ndarray:
    """GPTQ's inverse-Hessian factor of a calibration Gram ``G`` [K, K]: U upper triangular with
    Uᵀ U = (G + damp·I)⁻¹, damp = ``percdamp`` × the mean diagonal; channels the calibration never
    excited (and padding up to ``pad_to``) get a unit diagonal. One factor serves every format of every
    layer reading the same input."""
    H0 = np.asarray(G, dtype=np.float64)
    K = H0.shape[0]
    if H0.shape != (K, K) or not np.isfinite(H0).all():
        raise ValueError(f"Gram must be a finite [K, K] matrix, got shape {list(H0.shape)}")
    Lk = max(K, int(pad_to or K))
    H = np.zeros((Lk, Lk))
    H[:K, :K] = H0
    dead = ~(np.diag(H) > 0)
    H[dead, dead] = 1.0
    H[np.diag_indices(Lk)] += percdamp * float(np.mean(np.diag(H)[:K]))   # padding-independent
    # the upper factor of H⁻¹ without forming H⁻¹: with J the reversal, J H J = L Lᵀ gives
    # H⁻¹ = (J L⁻¹ J)ᵀ (J L⁻¹ J), and J L⁻¹ J is upper triangular (one Cholesky, one triangular solve)
    from scipy.linalg import solve_triangular

    L = np.linalg.cholesky(H[::-1, ::-1])
    return np.ascontiguousarray(solve_triangular(L, np.eye(Lk), lower=True)[::-1, ::-1])


def gptq(Wt: np.ndarray, G: np.ndarray, fmt: str = "q4_f", block: int | None = 64, *, rows: int | None = None,
         percdamp: float = 0.01, lazy: int = 128, fit=None, factor: np.ndarray | None = None,
         chunk_rows: int | None = None, pool=None) -> Blocks:
    """GPTQ of ``Wt`` [N, K] with the calibration Gram ``G`` [K, K] (the Hessian up to a factor) into
    ``fmt``: columns in order along K; when the sweep reaches a block (256 columns for the K formats) its
    grid is fitted — the imatrix search, importance = the Gram's diagonal — on the weights as the earlier
    columns' errors left them; each column is rounded on it and its error spread over the remaining
    columns through the Cholesky factor of the damped inverse Hessian (``factor``: a
    :func:`hessian_factor` of G already computed, padded at least to the format's blocks), in lazy
    batches of ``lazy`` columns (ORT's ``blocksize``; rounded up to a multiple of the block).
    ``fit(x [N, width]) -> Grid`` replaces the grid fit (the tests pass ORT's grid).

    Every output row is swept on its own (its grids are its own; only the factor is shared), so inside a
    lazy batch the rows go ``chunk_rows`` at a time (default all; a large layer: a chunk stays in cache),
    on ``pool`` (an executor) when given, each chunk's batch held transposed (a column is contiguous);
    the batch's error then reaches the later columns in one product over all rows, as before. The
    float operations on every weight are the reference sweep's, in its order: the result is the same
    bit for bit whatever ``chunk_rows`` and ``pool`` (``tests/test_float_weights.py`` keeps the
    column-by-column reference and compares)."""
    Wt, B = _check(Wt, fmt, block)
    N, K = Wt.shape
    G = np.asarray(G)
    if G.shape != (K, K):
        raise ValueError(f"Gram has shape {list(G.shape)}, expected [{K}, {K}]")
    qb = B if fmt == "q4_f" else None
    u = unit(fmt, qb)
    lazy = -(-max(int(lazy), u) // u) * u
    Wp, valid = _pad(Wt, u)
    Lk = Wp.shape[1]
    U = factor if factor is not None and factor.shape[0] >= Lk else hessian_factor(G, percdamp, Lk)
    U = np.ascontiguousarray(U[:Lk, :Lk], np.float32)
    diag = np.clip(np.diag(G).astype(np.float64), 0.0, None)
    imp = diag / max(int(rows or 1), 1)
    # float32, as GPTQ's reference implementation sweeps (a copy: the caller's weights stay as they are)
    W = Wp.copy() if np.shares_memory(Wp, Wt) else Wp
    group = 256 if fmt in ("q4_K", "q5_K", "q6_K") else B
    R = max(1, int(chunk_rows or N))
    spans = [(a, min(a + R, N)) for a in range(0, N, R)]
    packed: list[list] = []           # per block: its bytes per row chunk

    def sweep(i1: int, i2: int, a: int, b: int, E1: np.ndarray) -> list[np.ndarray]:
        """Rows a:b of the lazy batch i1:i2: its blocks' grids, codes and errors (E1[a:b]); the blocks' bytes."""
        w = i2 - i1
        W1T = np.ascontiguousarray(W[a:b, i1:i2].T)        # [w, rows]: column i of the batch is W1T[i]
        E1T = np.empty_like(W1T)
        tmp = np.empty_like(W1T)
        U1 = U[i1:i2, i1:i2]
        out, grid = [], None
        for i in range(w):
            if i % u == 0:   # a new block: its grid from the weights as the sweep left them
                x = np.ascontiguousarray(W1T[i:i + u].T)
                if fit is not None:
                    grid = fit(x)
                else:
                    c0 = i1 + i
                    ii = np.zeros(u)
                    ii[:max(0, min(K, c0 + u) - c0)] = imp[c0:c0 + u]
                    grid = fit_grid(fmt, x, _weights(x, ii, valid[c0:c0 + u], group), qb, codes=False)
            j = i % u
            col = W1T[i]
            q = grid.quantize(col, j)
            grid.codes[:, j] = q
            e = (col - grid.value(q, j)) / U1[i, i]
            if i + 1 < w:      # the later columns of the batch (column i itself is done)
                t = tmp[: w - i - 1]
                np.multiply(U1[i, i + 1:, None], e[None, :], out=t)
                np.subtract(W1T[i + 1:], t, out=W1T[i + 1:])
            E1T[i] = e
            if j == u - 1:
                out.append(grid.pack())
        E1[a:b] = E1T.T
        return out

    for i1 in range(0, Lk, lazy):
        i2 = min(i1 + lazy, Lk)
        E1 = np.empty((N, i2 - i1), np.float32)
        jobs = [(i1, i2, a, b, E1) for a, b in spans]
        done = list(pool.map(lambda jb: sweep(*jb), jobs)) if pool is not None and len(jobs) > 1 else \
            [sweep(*jb) for jb in jobs]
        for k in range(len(done[0])):
            packed.append([d[k] for d in done])
        if i2 < Lk:
            W[:, i2:] -= E1 @ U[i1:i2, i2:]
    parts = [p[0] if len(p) == 1 else np.concatenate(p, axis=0) for p in packed]
    Wq = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    return Blocks(fmt, np.ascontiguousarray(Wq), int(K), B if fmt == "q4_f" else None, "gptq",
                  {"percdamp": percdamp, "lazy": lazy})


# ------------------------------------------------------------------ one entry point
def quantize(Wt: np.ndarray, quantizer: str, fmt: str, block: int | None = None, G: np.ndarray | None = None,
             rows: int | None = None) -> Blocks:
    """``Wt`` [N, K] by ``quantizer`` into ``fmt`` (``block``: q4_f's). ``G`` (the calibration Gram over
    ``rows`` input rows) feeds kquant's imatrix and GPTQ's Hessian; GPTQ without it is an error."""
    if quantizer == "kquant":
        return kquant(Wt, fmt, block, importance(G, rows))
    if quantizer == "gptq":
        if G is None:
            raise ValueError("gptq needs the calibration Gram (--calib-text)")
        return gptq(Wt, G, fmt, block, rows=rows)
    if quantizer == "hqq":
        if fmt != "q4_f":
            raise ValueError(f"hqq writes q4_f (a float scale and zero point per block), not {fmt}")
        return hqq(Wt, block or 64)
    if quantizer == "rtn":
        return rtn(Wt, fmt, block)
    raise ValueError(f"quantizer {quantizer!r}: one of {', '.join(QUANTIZERS)}")
