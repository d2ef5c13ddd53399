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
