"""Float checkpoints get calibrated 4-bit (issue 34 item 3): the quantizers of rewriter.builders.quantizers
on random matrices (every format's blocks dequantize — through the op's reference and through gguf-py's
own dequantizers — to what the quantizer meant, within the error its grid allows; GPTQ reproduces ONNX
Runtime's own gptq on ORT's grid), and the --weights int4 planner on the tiny decoders."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conftest import requires_native  # noqa: E402
from custom_ops.reference import blockquant as bq  # noqa: E402
from rewriter.builders import quantizers as Q  # noqa: E402
from rewriter.kit import gaps  # noqa: E402

# (format, q4_f block): every format the quantizers write
CASES = [("q4_f", 16), ("q4_f", 32), ("q4_f", 64), ("q4_f", 128), ("q4_f", 256), ("q4_0", None), ("q5_0", None),
         ("q5_1", None), ("q4_K", None), ("q5_K", None), ("q6_K", None), ("q8_0", None)]
IDS = [f if b is None else f"{f}_{b}" for f, b in CASES]
# relative Frobenius error of a Gaussian matrix a correct quantizer of each format stays under (the grid's
# rounding: ~range / (2·levels·sqrt 3) per weight; K formats add their 6/8-bit scales)
# (and the outlier channels of _gauss widen the ranges of q4_f's large blocks)
MAX_ERR = {"q4_f": 0.13, "q4_f_large": 0.19, "q4_0": 0.13, "q5_0": 0.065, "q5_1": 0.065, "q4_K": 0.085, "q5_K": 0.045, "q6_K": 0.026, "q8_0": 0.009}


def _gauss(N, K, seed=0, scale=0.02):
    r = np.random.default_rng(seed)
    W = r.standard_normal((N, K)).astype(np.float32) * scale
    W[:, r.integers(0, K, 3)] *= 6          # a few outlier input channels, as real layers have
    return W


def _gram(K, rows=3000, seed=1):
    r = np.random.default_rng(seed)
    X = r.standard_normal((rows, K)).astype(np.float32) * (0.2 + 3 * r.random(K)).astype(np.float32)
    return (X.T.astype(np.float64) @ X), rows


@pytest.mark.parametrize("fmt,B", CASES, ids=IDS)
@pytest.mark.parametrize("K", [256, 576, 300])
def test_kquant_blocks_dequantize_to_what_was_meant(fmt, B, K):
    """The packed blocks dequantize (op reference) to the grid's own values, within the format's error of
    the float weights; the GGUF types equal gguf-py's dequantization bit for bit; K not a multiple of the
    block is padded and cut."""
    from gguf import GGMLQuantizationType, quants

    Wt = _gauss(37, K)
    b = Q.kquant(Wt, fmt, B)
    assert b.W.dtype == np.uint8 and b.W.shape == (37, bq.row_bytes(fmt, K, b.block))
    assert b.bits_per_weight == pytest.approx(Q.layer_bits(fmt, K, b.block))
    What = b.dequantize()
    assert What.shape == (37, K) and np.isfinite(What).all()
    err = np.linalg.norm(What - Wt) / np.linalg.norm(Wt)
    assert err < MAX_ERR["q4_f_large" if fmt == "q4_f" and B >= 128 else fmt], err
    if fmt == "q4_f":   # never worse than min/max rounding at the same block
        assert err <= np.linalg.norm(Q.rtn(Wt, "q4_f", B).dequantize() - Wt) / np.linalg.norm(Wt)
    if fmt in bq.GGML_TYPE:
        g = quants.dequantize(b.W, GGMLQuantizationType[bq.GGML_TYPE[fmt]])[:, :K]
        assert np.array_equal(g, What)
    bq.check_scales(b.W, fmt, K, b.block)


@pytest.mark.parametrize("fmt,B", [("q4_f", 64), ("q4_0", None), ("q5_0", None), ("q5_1", None), ("q4_K", None),
                                   ("q5_K", None), ("q6_K", None), ("q8_0", None)])
def test_grid_codes_round_trip(fmt, B):
    """What fit_grid meant (its codes on its fitted parameters, in the op's float32 order) is exactly what
    the packed bytes dequantize to: packing loses nothing."""
    Wt = _gauss(16, 512, seed=3)
    g = Q.fit_grid(fmt, Wt, np.ones_like(Wt), B)
    W = g.pack()
    assert np.array_equal(bq.dequantize(W, fmt, 512, B if fmt == "q4_f" else None), g.dequantized())


def test_kquant_is_ggml_quality_and_imatrix_helps():
    """The weighted search beats plain min/max rounding (rtn) at the same block, and with the imatrix
    (the Gram's diagonal) it lowers the layer's output gap on those inputs."""
    Wt = _gauss(64, 576, seed=5)
    G, rows = _gram(576)
    e_rtn = np.linalg.norm(Q.rtn(Wt, "q4_f", 64).dequantize() - Wt)
    e_kq = np.linalg.norm(Q.kquant(Wt, "q4_f", 64).dequantize() - Wt)
    assert e_kq < 0.97 * e_rtn
    for fmt, B in (("q4_f", 64), ("q4_K", None), ("q6_K", None)):
        plain = gaps.layer_gap(Wt.T, Q.kquant(Wt, fmt, B).dequantize().T, G)
        imat = gaps.layer_gap(Wt.T, Q.kquant(Wt, fmt, B, Q.importance(G, rows)).dequantize().T, G)
        assert imat < plain, (fmt, imat, plain)


@pytest.mark.parametrize("fmt,B", [("q4_f", 32), ("q4_f", 64), ("q4_0", None), ("q5_1", None), ("q4_K", None),
                                   ("q6_K", None)])
def test_gptq_lowers_the_output_gap(fmt, B):
    """GPTQ with the calibration Gram: lower output gap on those inputs than the imatrix search alone, on
    the same grid family; its blocks are valid and dequantize through gguf-py as well."""
    Wt = _gauss(48, 512, seed=7)
    G, rows = _gram(512)
    kq = Q.kquant(Wt, fmt, B, Q.importance(G, rows))
    gq = Q.gptq(Wt, G, fmt, B, rows=rows)
    assert gq.W.shape == kq.W.shape
    g_kq = gaps.layer_gap(Wt.T, kq.dequantize().T, G)
    g_gq = gaps.layer_gap(Wt.T, gq.dequantize().T, G)
    assert g_gq < 0.97 * g_kq, (g_gq, g_kq)
    bq.check_scales(gq.W, fmt, 512, gq.block)


class _OrtGrid(Q.Grid):
    """ORT's GPTQ grid (weight_only.gptq's find_params, asym, per channel): per output, min/max including
    zero, scale = range / 15, integer zero point; value = scale · (q − zero)."""

    def __init__(self, x):
        N, g = x.shape
        super().__init__("q4_f", g, N, g)
        xmin, xmax = np.minimum(x.min(1), 0), np.maximum(x.max(1), 0)
        both = (xmin == 0) & (xmax == 0)
        xmin[both], xmax[both] = -1, 1
        self.s = (xmax - xmin) / 15
        self.z = np.round(-xmin / self.s)

    def quantize(self, col, j):
        return np.clip(np.round(col / self.s) + self.z, 0, 15).astype(np.int16)

    def value(self, q, j):
        return self.s * (q - self.z)

    def pack(self):
        return bq.pack_q4_f(self.codes.astype(np.uint8), self.s, -self.s * self.z, self.block)

    def dequantized_from(self, x):
        return np.stack([self.value(self.quantize(x[:, j], j), j) for j in range(x.shape[1])], axis=1)


def _textbook_gptq(Wt, G, g, percdamp=0.01):
    """GPTQ as the paper writes it (Frantar et al. 2022, Alg. 1 without lazy batches), on ORT's grid
    fitted per group of g when the sweep reaches it: the values it leaves, float64 [N, K]."""
    N, K = Wt.shape
    H = G.copy()
    H[np.diag_indices(K)] += percdamp * np.mean(np.diag(H))
    U = np.linalg.cholesky(np.linalg.inv(H)).T
    W = Wt.astype(np.float64).copy()
    out = np.zeros_like(W)
    for i in range(K):
        if i % g == 0:
            grid = _OrtGrid(W[:, i:i + g])
        v = grid.value(grid.quantize(W[:, i], i % g), i % g)
        out[:, i] = v
        W[:, i:] -= np.outer((W[:, i] - v) / U[i, i], U[i, i:])
    return out


def test_gptq_is_the_textbook_algorithm():
    """Our lazy-batched sweep (grids fitted on the weights as earlier columns' errors left them) gives the
    paper's algorithm's codes on the same grid (all but float-order ties). (ONNX Runtime 1.32's bundled
    weight_only.gptq is no reference: its port to [K, N] weights reads the upper Cholesky factor's
    zero half, so it spreads no error and equals round-to-nearest on its grid — see docs/weights.md.)"""
    Wt = _gauss(40, 256, seed=11)
    G, _ = _gram(256)
    ref = _textbook_gptq(Wt, G, 32)
    ours = Q.gptq(Wt, G, "q4_f", 32, lazy=64, fit=_OrtGrid)
    q = bq._nibbles(ours.W.reshape(-1, 20)[:, 4:]).astype(np.float64).reshape(40, 256)
    d = np.repeat(bq._f16(ours.W.reshape(-1, 20)[:, 0:2]).reshape(40, 8), 32, axis=1)
    m = np.repeat(bq._f16(ours.W.reshape(-1, 20)[:, 2:4]).reshape(40, 8), 32, axis=1)
    same = np.isclose(ref, d * q + m, atol=2e-3 * float(np.abs(ref).max()))
    assert same.mean() > 0.995, same.mean()
    rtn = np.concatenate([_OrtGrid(Wt[:, i:i + 32]).dequantized_from(Wt[:, i:i + 32]) for i in range(0, 256, 32)], 1)
    assert not np.allclose(ref, rtn)      # the feedback changed codes: the comparison is not vacuous


def test_hqq_and_rtn_write_q4_f():
    """ORT's HQQ and asymmetric RTN into q4_f: valid blocks, HQQ no worse than RTN on the weights; B = 32
    bytes are q4_1's (gguf-py dequantizes them identically)."""
    from gguf import GGMLQuantizationType, quants

    Wt = _gauss(24, 320, seed=13)
    for B in (32, 64):
        r, h = Q.rtn(Wt, "q4_f", B), Q.hqq(Wt, B)
        assert r.fmt == h.fmt == "q4_f" and r.block == h.block == B
        er, eh = (np.linalg.norm(x.dequantize() - Wt) / np.linalg.norm(Wt) for x in (r, h))
        assert eh <= er * 1.02 and er < MAX_ERR["q4_f"]
        if B == 32:
            assert np.array_equal(quants.dequantize(h.W, GGMLQuantizationType.Q4_1)[:, :320], h.dequantize())


def test_quantizer_errors():
    Wt = _gauss(4, 64)
    with pytest.raises(ValueError, match="NaN"):
        Q.kquant(np.full((4, 64), np.nan, np.float32), "q4_K")
    with pytest.raises(ValueError, match="format"):
        Q.kquant(Wt, "q3_K")
    with pytest.raises(ValueError, match="block_size 48"):
        Q.kquant(Wt, "q4_f", 48)
    with pytest.raises(ValueError, match="Gram"):
        Q.quantize(Wt, "gptq", "q4_f", 32)
    with pytest.raises(ValueError, match="hqq writes q4_f"):
        Q.quantize(Wt, "hqq", "q4_K")
    z = Q.kquant(np.zeros((3, 256), np.float32), "q4_K")
    assert np.array_equal(z.dequantize(), np.zeros((3, 256), np.float32))


# --------------------------------------------------------------------------- the fast paths give the same bits
# (issue 59 item 4: the float-weights plan made several times faster without changing its result). The reference
# implementations below are the column-by-column code the fast one replaced, kept verbatim as the definition.
def _fit_affine_ref(x, w, nmax, *, offset_le_zero=True, rmin=-0.9, rdelta=0.05, nstep=36):
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
        return s * s * sl2 + 2 * s * m * sl - 2 * s * sxl + m * m * sw - 2 * m * sx + sxx

    wl = np.empty_like(x)

    def sums(L):
        np.multiply(w, L, out=wl)
        return (wl.sum(axis=1).astype(np.float64), np.einsum("ij,ij->i", wl, L).astype(np.float64),
                np.einsum("ij,ij->i", wl, x).astype(np.float64))

    L = np.clip(np.rint(xs * (nmax / rng)[:, None]), 0, nmax).astype(np.float32)
    scale = (rng / nmax).astype(np.float64)
    off = lo.astype(np.float64)
    best = err(scale, off, *sums(L))
    La = np.empty_like(x)
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
            best = np.where(take, e, best)
            scale = np.where(take, s_, scale)
            off = np.where(take, m_, off)
            L[take] = La[take]
    scale = scale.astype(np.float32)
    off = off.astype(np.float32)
    scale = np.where(flat, 0.0, scale).astype(np.float32)
    off = np.where(flat, np.where(offset_le_zero, np.minimum(x[:, 0], 0.0), x[:, 0]), off).astype(np.float32)
    L[flat] = 0
    if offset_le_zero:
        fp = flat & (x[:, 0] > 0)
        scale[fp] = x[fp, 0] / nmax
        L[fp] = nmax
    return scale, off, L.astype(np.uint8)


def _ref_quantize(grid, col, j):
    s, o, lo, hi = grid._col(j)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s != 0, np.rint((col - o) / np.where(s != 0, s, 1.0)), 0.0)
    return np.clip(q, lo, hi).astype(np.int16)


def _ref_value(grid, q, j):
    qf = q.astype(np.float32)
    if isinstance(grid, Q.SymGrid):
        return (grid.d[:, j // 32] * qf).astype(np.float32)
    if isinstance(grid, Q.KGrid):
        return (grid.S[:, j // 32] * qf - grid.M[:, j // 32]).astype(np.float32)
    if isinstance(grid, Q.Q6KGrid):
        return (grid.S[:, j // 16] * qf).astype(np.float32)
    if isinstance(grid, Q.Q80Grid):
        return (qf * grid.d[:, j // 32]).astype(np.float32)
    s, o, _, _ = grid._col(j)
    return (s * qf + o).astype(np.float32)


def _gptq_ref(Wt, G, fmt, block, rows=None, percdamp=0.01, lazy=128):
    """The column-by-column sweep (every column's error on every later column of its lazy batch at once),
    with the grids fitted by the reference fit_affine."""
    Wt, B = Q._check(Wt, fmt, block)
    N, K = Wt.shape
    qb = B if fmt == "q4_f" else None
    u = Q.unit(fmt, qb)
    lazy = -(-max(int(lazy), u) // u) * u
    Wp, valid = Q._pad(Wt, u)
    Lk = Wp.shape[1]
    U = np.ascontiguousarray(Q.hessian_factor(G, percdamp, Lk)[:Lk, :Lk], np.float32)
    imp = np.clip(np.diag(G).astype(np.float64), 0.0, None) / max(int(rows or 1), 1)
    W = Wp.copy()
    group = 256 if fmt in ("q4_K", "q5_K", "q6_K") else B
    grids = []
    for i1 in range(0, Lk, lazy):
        i2 = min(i1 + lazy, Lk)
        W1 = W[:, i1:i2].copy()
        E1 = np.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            if i % u == 0:
                x = W1[:, i:i + u].copy()
                c0 = i1 + i
                ii = np.zeros(u)
                ii[:max(0, min(K, c0 + u) - c0)] = imp[c0:c0 + u]
                grid = Q.fit_grid(fmt, x, Q._weights(x, ii, valid[c0:c0 + u], group), qb)
                grids.append(grid)
            j = i % u
            q = _ref_quantize(grid, W1[:, i], j)
            grid.codes[:, j] = q
            e = (W1[:, i] - _ref_value(grid, q, j)) / U1[i, i]
            W1[:, i:] -= np.outer(e, U1[i, i:])
            E1[:, i] = e
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    return Q._result(fmt, B, K, grids, "gptq").W


def _adversarial(S, n, seed):
    """Rows of every kind a fit meets: Gaussian, heavy-tailed, flat (zero, positive, negative), a lone
    outlier, values on rounding midpoints, signed zeros, tiny and huge magnitudes; importance with zeros
    (padding) and rows of zero importance."""
    r = np.random.default_rng(seed)
    x = (r.standard_normal((S, n)) * 0.02).astype(np.float32)
    k = S // 12
    x[0:k] *= np.exp(r.standard_normal((k, n)) * 2).astype(np.float32)
    x[k] = 0.0
    x[k + 1] = 0.37
    x[k + 2] = -0.25
    x[k + 3, :] = 0.0
    x[k + 3, n // 2] = 5.0
    x[2 * k:3 * k] = (r.integers(-8, 8, (k, n)) * 0.5 / 15).astype(np.float32)
    x[3 * k:4 * k] = np.where(r.random((k, n)) < 0.5, -0.0, 0.0).astype(np.float32)
    x[3 * k:4 * k, 0] = r.standard_normal(k).astype(np.float32) * 1e-3
    x[4 * k:5 * k] *= np.float32(1e-30)
    x[5 * k:6 * k] = (x[5 * k:6 * k] * 3e6).clip(-6e4, 6e4)
    x[6 * k:7 * k] = np.abs(x[6 * k:7 * k])
    w = np.abs(r.standard_normal((S, n))).astype(np.float32) * np.exp(r.standard_normal((S, 1)) * 3).astype(np.float32)
    w[:, -(n // 5):][r.random(S) < 0.3] = 0.0
    w[7 * k] = 0.0
    w[7 * k + 1:8 * k] = 1.0
    return x, w


@pytest.mark.parametrize("n", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("nmax,off0", [(15, False), (31, False), (15, True), (31, True)])
def test_fit_affine_equals_reference(n, nmax, off0):
    """The fit (with or without its codes) gives the reference's scale, offset and codes bit for bit on
    adversarial rows."""
    x, w = _adversarial(600, n, seed=n + nmax)
    ref = _fit_affine_ref(x, w, nmax, offset_le_zero=off0)
    got = Q.fit_affine(x, w, nmax, offset_le_zero=off0)
    nocodes = Q.fit_affine(x, w, nmax, offset_le_zero=off0, codes=False)
    for a, b in zip(ref, got):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    assert nocodes[2] is None
    for a, b in zip(ref[:2], nocodes[:2]):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("fmt,B", [("q4_f", 32), ("q4_f", 64), ("q4_f", 128), ("q4_f", 256), ("q4_0", None),
                                   ("q5_0", None), ("q5_1", None), ("q4_K", None), ("q5_K", None), ("q6_K", None)])
def test_gptq_fast_equals_reference(fmt, B, monkeypatch):
    """GPTQ's fast sweep (rows in chunks, on threads or not, a column's error only on the later columns,
    grids without their round-to-nearest codes) writes the reference sweep's bytes, bit for bit: on
    adversarial weights (flat, zero, signed-zero, tiny, huge, midpoint rows; K not a multiple of the
    block) and a Gram with a dead channel."""
    from concurrent.futures import ThreadPoolExecutor

    N, K = 90, 300 if fmt.startswith("q4_f") or fmt in ("q4_0", "q5_0", "q5_1") else 512
    Wt, _ = _adversarial(N, K, seed=3)
    Wt = np.clip(Wt, -6e4, 6e4)
    G, rows = _gram(K, seed=4)
    G[7, :] = G[:, 7] = 0.0                          # a channel the calibration never excited
    with monkeypatch.context() as m:                 # the reference: the replaced fit as well
        m.setattr(Q, "fit_affine", lambda x, w, nmax, **kw: _fit_affine_ref(
            x, w, nmax, **{k: v for k, v in kw.items() if k != "codes"}))
        ref = _gptq_ref(Wt, G, fmt, B, rows=rows)
    with ThreadPoolExecutor(2) as pool:
        for chunk, p in ((None, None), (32, None), (40, pool)):
            got = Q.gptq(Wt, G, fmt, B, rows=rows, chunk_rows=chunk, pool=p)
            assert np.array_equal(got.W, ref), (chunk, np.mean(got.W != ref))
    assert np.array_equal(Wt, _adversarial(N, K, seed=3)[0].clip(-6e4, 6e4))      # the input is not changed


def test_kquant_unchanged_by_the_fast_fit(monkeypatch):
    """kquant (fit_grid with its codes) writes the same bytes with the reference fit_affine."""
    Wt = _gauss(50, 512, seed=9)
    G, rows = _gram(512, seed=2)
    imp = Q.importance(G, rows)
    fast = {f: Q.kquant(Wt, f, B, imp).W for f, B in (("q4_f", 64), ("q5_1", None), ("q4_K", None), ("q5_K", None))}
    monkeypatch.setattr(Q, "fit_affine", lambda x, w, nmax, **kw: _fit_affine_ref(
        x, w, nmax, **{k: v for k, v in kw.items() if k != "codes"}))
    for (f, B), W in zip((("q4_f", 64), ("q5_1", None), ("q4_K", None), ("q5_K", None)), fast.values()):
        assert np.array_equal(Q.kquant(Wt, f, B, imp).W, W), f


def test_large_layer_options_in_row_chunks(monkeypatch):
    """A layer over floatweights._LARGE is quantized one format at a time, GPTQ's rows in chunks on the
    threads, its gaps from a block of dequantized columns at a time: the same options, bits and gaps as
    the small-layer path."""
    from rewriter.builders import floatweights as FW

    class C:   # what options() reads of a candidate
        name, role, target, K, params = "/lm_head/MatMul", "head", "head", 320, 320 * 700
        input = type("V", (), {"name": "h"})()

    W = _gauss(700, 320, seed=21).T.copy()
    G, _ = _gram(320, seed=5)
    small = FW.FloatWeights("auto", None, "shared").options(C, W, G)
    monkeypatch.setattr(FW, "_LARGE", 1000)
    monkeypatch.setattr(FW, "_CHUNK_ROWS", 128)
    large = FW.FloatWeights("auto", None, "shared").options(C, W, G)
    assert [o.name for o in small.options] == [o.name for o in large.options]
    for a, b in zip(small.options, large.options):
        assert a.gap == b.gap and a.bits == b.bits and np.array_equal(a.blocks.W, b.blocks.W)


def test_prefetch_workers_give_the_same_layers():
    """A ladder quantized in a worker process (spawned, one BLAS thread: FloatWeights.prefetch) is the one
    this process computes, bit for bit: codes, scales, bits and gaps."""
    from rewriter.builders import floatweights as FW

    r = []
    for N, K in ((300, 576), (160, 1024)):
        W = _gauss(N, K, seed=N).T.copy()
        G, _ = _gram(K, seed=K)
        f = Q.hessian_factor(G, pad_to=-(-K // 256) * 256)
        r.append(("l", "down", K * N, K, "gptq", W, G, f))
    pool = FW._process_pool(2)
    try:
        remote = [pool.submit(FW._ladder_job, a) for a in r]
        for a, fut in zip(r, remote):
            here, there = FW._ladder(*a), fut.result()
            assert [o.name for o in here.options] == [o.name for o in there.options]
            for x, y in zip(here.options, there.options):
                assert x.gap == y.gap and np.array_equal(x.blocks.W, y.blocks.W)
    finally:
        pool.shutdown()


# --------------------------------------------------------------------------- progress in a log
def test_progress_lines_without_a_terminal():
    """Not a terminal: a plain line at least every interval, from the ticker even while one step runs,
    with what kit.progress.status last said; a terminal gets a tqdm bar; disabled says nothing."""
    import io
    import time

    from rewriter.kit import progress as P

    buf = io.StringIO()
    with P.Progress("plan", total=3, unit="layer", stream=buf, tty=False, interval=0.05) as p:
        P.status("/lm_head/MatMul: gptq q4_f/64 (2/5)")
        time.sleep(0.3)                      # one long step: the ticker prints
        p.update(1)
    lines = buf.getvalue().splitlines()
    assert len(lines) >= 3 and all(ln.startswith("[ortlean] plan: ") for ln in lines)
    assert "0/3 layers" in lines[0] and "(/lm_head/MatMul: gptq q4_f/64 (2/5))" in lines[0]
    n = len(lines)
    time.sleep(0.2)
    assert len(buf.getvalue().splitlines()) == n           # closed: no more lines
    quiet = io.StringIO()
    with P.Progress("x", stream=quiet, enabled=False, interval=0.01):
        time.sleep(0.05)
    assert quiet.getvalue() == ""
    term = io.StringIO()
    with P.Progress("mix", unit="trial", stream=term, tty=True, interval=0.01) as p:
        p.update(1, "4.5 b/w")
    assert "mix" in term.getvalue() and "[ortlean]" not in term.getvalue()


# --------------------------------------------------------------------------- the planner (weightplan)
def _layer(name, role, params, opts):
    from rewriter.builders import weightplan as WP

    return WP.Layer(name, role, params, [WP.Option(f, None, b, g) for f, b, g in opts])


def test_plan_mix_takes_the_cheapest_passing_prefix():
    """On a loss that is exactly Σ s_role · gap² (the planner's own model), the mix meets the target, the
    sensitivities it measured are the true ones, and no cheaper prefix of its steps would pass; a cap on
    bits that the target needs more than is reported infeasible."""
    from rewriter.builders import weightplan as WP

    true_s = {"a": 4.0, "b": 0.5}
    layers = [_layer(f"l{i}", "a" if i % 2 else "b", 100 * (i + 1),
                     [("q4_f", 4.5, 0.05 + 0.01 * i), ("q4_f32", 5.0, 0.02), ("q8_0", 8.5, 0.004)]) for i in range(6)]

    def loss(choice):
        return sum(true_s[l.role] * l.options[choice[l.name]].gap ** 2 for l in layers)

    L0 = loss({l.name: 0 for l in layers})
    res = WP.plan_mix(layers, loss, budget=L0 / 2, margin=1.0)
    assert res.feasible and res.loss <= L0 / 2
    for r, s in true_s.items():
        assert res.sensitivity[r] == pytest.approx(s, rel=1e-9)
    assert 4.5 < res.bits < 8.5
    ups = [t for t in res.trials if t["what"].endswith("upgrade steps")]
    k = int(ups[-1]["what"].split()[0])
    fewer = [t for t in ups if int(t["what"].split()[0]) < k]
    assert all(t["loss"] > L0 / 2 for t in fewer)
    capped = WP.plan_mix(layers, loss, budget=L0 / 100, margin=1.0, max_bits=4.6)
    assert not capped.feasible and capped.bits <= 4.6 + 1e-9 and "--weights-bits" in capped.note


def test_plan_mix_cheapest_passes_alone():
    """A target the cheapest options already meet: one trial, every layer at its cheapest option."""
    from rewriter.builders import weightplan as WP

    layers = [_layer("x", "a", 10, [("q4_f", 4.25, 0.05), ("q8_0", 8.5, 0.001)])]
    res = WP.plan_mix(layers, lambda ch: 0.001, budget=0.02)
    assert res.feasible and res.choice == {"x": 0} and len(res.trials) == 1


def test_ladder_and_prune():
    from rewriter.builders import weightplan as WP

    assert WP.ladder(576)[0] == ("q4_f", 64) and ("q4_K", None) not in WP.ladder(576)
    assert ("q4_K", None) in WP.ladder(1536) and WP.ladder(1536)[0] == ("q4_f", 256)
    assert all(Q.layer_bits(f, 1536, b) <= Q.layer_bits(g, 1536, c) + 1e-9
               for (f, b), (g, c) in zip(WP.ladder(1536), WP.ladder(1536)[1:]))
    opts = [WP.Option("a", None, 4.5, 0.05), WP.Option("b", None, 4.5, 0.04), WP.Option("c", None, 5.0, 0.045),
            WP.Option("d", None, 8.5, 0.01)]
    assert [o.fmt for o in WP.prune(opts)] == ["b", "d"]


# --------------------------------------------------------------------------- --weights int4 on the tiny decoders
@pytest.fixture(scope="module")
def tiny():
    import tiny_hf

    return tiny_hf.models()


@pytest.fixture(scope="module")
def tok():
    import tiny_hf

    return str(tiny_hf.forms()["genai-fp32"] / "tokenizer.json")   # the tiny llama's w0..w255 vocabulary


def _graph(path):
    import onnx

    return onnx.load(str(path), load_external_data=False).graph


def _attr(node, name):
    import onnx

    return next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name)


def _bq_layers(path):
    """{node name: (format string, block_size or None, W initializer name)} of a model's BlockQuantMatMul."""
    g = _graph(path)
    out = {}
    for n in g.node:
        if n.op_type == "BlockQuantMatMul":
            f = _attr(n, "format")
            f = f.decode() if isinstance(f, bytes) else f
            out[n.name] = (f, _attr(n, "block_size") if f == "q4_f" else None, n.input[1])
    return out


@requires_native
def test_int4_mix_meets_the_budget_and_reports_bits(tiny, tok, tmp_path, monkeypatch):
    """--weights int4 with --calib-text and a budget the 4-bit layers miss: the planner's trials raise some
    layers above 4.5 bits/weight until the probe meets the budget's target, every weight layer (head
    included) is written as BlockQuantMatMul in the format its record reports, the guard's check is within
    the budget and the summary's note gives the model's bits/weight; a loose budget leaves every layer at
    its cheapest option. (The tiny random decoder's perplexity does not suffer from 4-bit weights, so the
    probe's loss is replaced by one that does: 4 × Σ gap² over the planned layers — the planner's plumbing
    is what this checks; tests/bench/bench_float_weights.py measures the real model.)"""
    from rewriter.kit import quality as kq
    from test_packed_gqa_cli import _calib_text, _rewrite

    monkeypatch.setattr(kq.Quality, "loss", lambda self, chosen: 4.0 * sum(p.gap ** 2 for _, _, p in chosen))
    src = tiny["llama"] / "model.onnx"
    calib = str(_calib_text(tmp_path / "calib.txt"))
    rc, rep = _rewrite(src, tmp_path / "loose.onnx", "--weights", "int4", "--calib-text", calib, "--tokenizer", tok,
                       "--quality-budget", "0.5")
    assert rc == 0
    loose = [r["extra"]["bits_per_weight"] for r in rep["layers"]]
    base = 4.0 * sum(r["gap"] ** 2 for r in rep["layers"])
    rc, rep = _rewrite(src, tmp_path / "tight.onnx", "--weights", "int4", "--calib-text", calib, "--tokenizer", tok,
                       "--quality-budget", f"{base / 2:.6f}", "--weights-glu", "off")   # one node per planned layer
    assert rc == 0, rep.get("refused")
    q = rep["quality"]
    assert q["weights_alone"] <= 0.75 * base / 2 + 1e-9         # the planner's target: MARGIN × budget
    layers = _bq_layers(tmp_path / "tight.onnx")
    assert len(layers) == len(rep["layers"]) == 11          # 2 × (qkv, o, gate, up, down) + head
    for r in rep["layers"]:
        fmt, B, _ = layers[r["layer"] + "_BQ"]
        assert r["extra"]["format"] == (f"q4_f/{B}" if fmt == "q4_f" else fmt)
        assert r["extra"]["bits_per_weight"] == pytest.approx(Q.layer_bits(fmt, r["shape"][0], B), abs=1e-4)
    assert {_attr(n, "act_bits") for n in _graph(tmp_path / "tight.onnx").node if n.op_type == "BlockQuantMatMul"} == {8}
    tight = [r["extra"]["bits_per_weight"] for r in rep["layers"]]
    assert max(tight) > 4.5 and sum(tight) > sum(loose) and max(loose) <= 4.5
    note = next(n for n in rep["notes"] if n.startswith("weights (float checkpoint"))
    params = [r["shape"][0] * r["shape"][1] for r in rep["layers"]]
    model_bits = sum(b * p for b, p in zip(tight, params)) / sum(params)
    assert f"{model_bits:.3f} bits/weight" in note


@requires_native
def test_tied_embedding_reads_the_head_blocks(tiny, tok, tmp_path):
    """The head in BlockQuantMatMul: the token embedding becomes BlockQuantGather on the head's own
    initializer (no table of its own) and returns the head's dequantized rows. --weights-act-bits 16 reaches
    every op (the default, 8 for weights quantized here, is checked above)."""
    import custom_ops
    import onnx
    from onnx import numpy_helper
    from test_packed_gqa_cli import _calib_text, _rewrite

    out = tmp_path / "e.onnx"
    rc, rep = _rewrite(tiny["llama"] / "model.onnx", out, "--weights", "int4", "--calib-text",
                       str(_calib_text(tmp_path / "c.txt")), "--tokenizer", tok, "--quality-budget", "off",
                       "--weights-act-bits", "16")
    assert rc == 0
    g = _graph(out)
    assert {_attr(n, "act_bits") for n in g.node if n.op_type == "BlockQuantMatMul"} == {16}
    gathers = [n for n in g.node if n.op_type == "BlockQuantGather"]
    head = next(n for n in g.node if n.op_type == "BlockQuantMatMul" and n.name.startswith("/lm_head"))
    assert len(gathers) == 1 and gathers[0].input[0] == head.input[1]
    assert not any(n.op_type == "Gather" and n.input[0] in {i.name for i in g.initializer}
                   and len([d for d in next(i for i in g.initializer if i.name == n.input[0]).dims]) == 2
                   for n in g.node)
    m = onnx.load(str(out))
    W = numpy_helper.to_array(next(i for i in m.graph.initializer if i.name == head.input[1]))
    fmt = _attr(head, "format")
    fmt = fmt.decode() if isinstance(fmt, bytes) else fmt
    B = _attr(head, "block_size") if fmt == "q4_f" else None
    K = _attr(head, "K")
    sub = onnx.helper.make_model(onnx.helper.make_graph(
        [gathers[0]], "g", [onnx.helper.make_tensor_value_info(gathers[0].input[1], onnx.TensorProto.INT64, [3])],
        [onnx.helper.make_tensor_value_info(gathers[0].output[0], onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(W, head.input[1])]), opset_imports=list(m.opset_import))
    s = custom_ops.session(sub.SerializeToString())
    idx = np.array([0, 7, 255], np.int64)
    rows = s.run(None, {gathers[0].input[1]: idx})[0]
    assert np.array_equal(rows, bq.dequantize(W, fmt, K, B)[idx])


@requires_native
def test_budget_refusal_and_nbits(tiny, tok, tmp_path, monkeypatch):
    """A budget the capped mix cannot meet is refused (exit 3, nothing written, the message names the
    cost); --weights-quantizer nbits keeps ONNX Runtime's MatMulNBits (the int4 of earlier releases).
    (The probe's loss: 4 × Σ gap², as above.)"""
    from rewriter.kit import quality as kq
    from test_packed_gqa_cli import _calib_text, _rewrite

    monkeypatch.setattr(kq.Quality, "loss", lambda self, chosen: 4.0 * sum(p.gap ** 2 for _, _, p in chosen))

    src = tiny["llama"] / "model.onnx"
    calib = str(_calib_text(tmp_path / "calib.txt"))
    out = tmp_path / "r.onnx"
    rc, rep = _rewrite(src, out, "--weights", "int4", "--calib-text", calib, "--tokenizer", tok,
                       "--quality-budget", "1e-6", "--weights-bits", "4.6")
    assert rc == 3 and not out.exists() and rep["output"] is None
    assert "weights alone" in rep["refused"] and "--quality-budget" in rep["refused"]
    rc, rep = _rewrite(src, out, "--weights", "int4", "--weights-quantizer", "nbits", "--quality-budget", "off")
    assert rc == 0
    ops = {n.op_type for n in _graph(out).node}
    assert "MatMulNBits" in ops and "BlockQuantMatMul" not in ops


@requires_native
def test_rewrite_prints_progress_lines_in_a_log(tiny, tok, tmp_path, monkeypatch, capfd):
    """A rewrite whose stderr is not a terminal (pytest captures it) prints the plan's and the mix's
    progress as plain lines (here every 0.01 s: ORTLEAN_PROGRESS_SECONDS), not a tqdm bar."""
    from rewriter import cli
    from rewriter.kit import quality as kq
    from test_packed_gqa_cli import _calib_text

    import time

    def loss(self, chosen):        # the planner's own model of the loss, a trial taking 30 ms
        time.sleep(0.03)
        return 4.0 * sum(p.gap ** 2 for _, _, p in chosen)

    monkeypatch.setenv("ORTLEAN_PROGRESS_SECONDS", "0.01")
    monkeypatch.setattr(kq.Quality, "loss", loss)
    rc = cli.main(["rewrite", str(tiny["llama"] / "model.onnx"), "-o", str(tmp_path / "p.onnx"), "--weights", "int4",
                   "--calib-text", str(_calib_text(tmp_path / "c.txt")), "--tokenizer", tok, "--quality-budget", "0.001",
                   "--weights-bits", "5"])
    err = capfd.readouterr().err
    assert rc in (0, 3), err
    assert "[ortlean] plan: " in err and " layers, " in err
    assert "[ortlean] weights mix: " in err and " trials, " in err
    assert "\r" not in err                                   # no bar redrawn in a log
