"""What keeps a large rewrite's memory down, piece by piece (issue 35 item 3): the layer gap computed a
block of columns at a time from a lazily dequantized Ŵ, equal to the whole-matrix formulas; a head
and an embedding table compared a block of rows at a time."""
from __future__ import annotations

import numpy as np
import pytest

from rewriter import quantize
from rewriter.kit import gaps


def _old_dequantize(packed, scales, zero_points, K, cfg):
    """dequantize_matrix as it was (the whole Ŵ through int32 intermediates): the reference."""
    N, kb, _ = packed.shape
    bits = cfg.bits
    if bits == 8:
        q = packed.reshape(N, kb, -1).astype(np.int32)
    else:
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(N, kb, -1).astype(np.int32)
    q = q[:, :, : cfg.block_size]
    mid = 1 << (bits - 1)
    if zero_points is None:
        zp = np.full((N, kb), mid, np.int32)
    elif bits == 8:
        zp = zero_points.reshape(N, -1)[:, :kb].astype(np.int32)
    else:
        zp = np.stack([zero_points & 0x0F, zero_points >> 4], axis=-1).reshape(N, -1)[:, :kb].astype(np.int32)
    w = (q - zp[:, :, None]).astype(np.float32) * scales.reshape(N, kb)[:, :, None]
    return np.ascontiguousarray(w.reshape(N, kb * cfg.block_size)[:, :K].T)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("K, N", [(64, 1), (100, 77), (96, 130), (33, 5)])
def test_lazy_dequantized_equals_whole(bits, symmetric, K, N):
    cfg = quantize.QuantConfig(bits=bits, block_size=32, symmetric=symmetric, accuracy_level=4)
    W = np.random.default_rng(K * N + bits).standard_normal((K, N)).astype(np.float32)
    packed, scales, zp = quantize.quantize_matrix(W, cfg)
    ref = _old_dequantize(packed, scales, zp, K, cfg)
    np.testing.assert_array_equal(quantize.dequantize_matrix(packed, scales, zp, K, cfg), ref)
    D = quantize.dequantized(packed, scales, zp, K, cfg)
    assert D.shape == (K, N)
    np.testing.assert_array_equal(np.asarray(D), ref)
    for j0, j1 in ((0, N), (0, 1), (N // 3, N), (N - 1, N + 5)):
        np.testing.assert_array_equal(D[:, j0:j1], ref[:, j0:j1])
    np.testing.assert_array_equal(D[3], ref[3])          # any other index: through the whole array


@pytest.mark.parametrize("with_gram", [False, True])
@pytest.mark.parametrize("chunk", [8, 1 << 26])
def test_layer_gap_in_column_blocks_equals_the_formulas(monkeypatch, with_gram, chunk):
    rng = np.random.default_rng(1)
    K, N = 48, 301
    W = rng.standard_normal((K, N)).astype(np.float32) * np.exp(rng.standard_normal(N)).astype(np.float32)
    W[:, 7] = 0.0                                         # a dead channel: excluded from the channel gap
    W_hat = (W + 0.05 * rng.standard_normal((K, N))).astype(np.float32)
    X = rng.standard_normal((200, K))
    G = X.T @ X if with_gram else None
    monkeypatch.setattr(gaps, "GAP_CHUNK_BYTES", chunk * 8 * K)
    want = max(gaps.output_gap(W, W_hat, G), gaps.channel_gap(W, W_hat, G))
    assert gaps.layer_gap(W, W_hat, G) == pytest.approx(want, rel=1e-12)
    cfg = quantize.QuantConfig(bits=4, block_size=32, symmetric=True, accuracy_level=4)
    p, s, z = quantize.quantize_matrix(W, cfg)
    D = quantize.dequantized(p, s, z, K, cfg)
    full = _old_dequantize(p, s, z, K, cfg)
    assert gaps.layer_gap(W, D, G) == pytest.approx(max(gaps.output_gap(W, full, G), gaps.channel_gap(W, full, G)),
                                                    rel=1e-12)


def test_equal_tables_in_row_blocks(monkeypatch):
    """quantize.equal_tables is np.array_equal of [rows, cols] tables (one may be a transposed view),
    a block of rows at a time: equal, a difference in the first or the last row or block, NaN
    (equal to nothing, as np.array_equal), a shape difference, one-row and empty tables."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal((1000, 24)).astype(np.float32)
    b = np.ascontiguousarray(a.T).T                              # a transposed view, equal to a
    assert quantize.equal_tables(a, b)
    for r in (0, 1, 500, 999):
        c = a.copy()
        c[r, 5] = np.nextafter(c[r, 5], np.float32(2))
        assert not quantize.equal_tables(a, c) and not quantize.equal_tables(c, b), r
    n = a.copy()
    n[3, 3] = np.nan
    assert not quantize.equal_tables(n, n.copy())
    assert not quantize.equal_tables(a, a[:, :23]) and not quantize.equal_tables(a, a.T)
    assert quantize.equal_tables(a[:1], b[:1]) and quantize.equal_tables(a[:0], b[:0])
    big = rng.standard_normal((3000, 8000)).astype(np.float32)   # 96 MB: rows in two blocks of 64 MiB
    other = big.copy()
    other[-1, -1] += 1
    assert quantize.equal_tables(big, big.copy()) and not quantize.equal_tables(big, other)


@pytest.mark.parametrize("T, rows", [(1, 16), (37, 16), (64, 16), (37, 1), (37, 100)])
def test_target_logprobs_in_row_blocks_equal_the_whole_array(T, rows):
    """Perplexity scores each window's tokens a block of rows at a time (the whole-array log-softmax
    holds four float64 copies of [T, vocabulary] logits): the same values bit for bit, including
    rows of large, equal and -inf logits."""
    from custom_ops.runtime.quality import _log_softmax_rows, _target_logprobs

    rng = np.random.default_rng(T * 1000 + rows)
    V = 3001
    logits = (rng.standard_normal((T, V)) * 8).astype(np.float32)
    logits[0, : V // 2] = -np.inf                  # masked entries
    if T > 2:
        logits[1] = 7.0                            # a flat row
        logits[2] *= 1e4                           # a peaked row: exp underflows for most entries
    tgt = rng.integers(0, V, T)
    tgt[0] = V - 1
    want = _log_softmax_rows(logits)[np.arange(T), tgt]
    got = _target_logprobs(logits, tgt, rows=rows)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))
    assert float(got.sum()) == float(want.sum())
