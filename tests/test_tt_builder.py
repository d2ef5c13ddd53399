"""Offline TT math: exactness at full rank, gap formula vs direct measurement, maxvol, modes."""
import numpy as np
import pytest

from custom_ops.reference import tt_full, tt_matmul
from rewriter.builders import tt as ttmath
from rewriter.kit import gaps


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    K, N = 36, 40
    W = rng.standard_normal((K, N))
    X = rng.standard_normal((400, K)) * np.linspace(0.05, 4.0, K)  # anisotropic activations
    return W, X, X.T @ X


def test_gap_formula_matches_direct_output_error(data):
    W, X, G = data
    rng = np.random.default_rng(1)
    W_hat = W + 0.1 * rng.standard_normal(W.shape)
    direct = np.linalg.norm(X @ W - X @ W_hat) / np.linalg.norm(X @ W)
    assert gaps.output_gap(W, W_hat, G) == pytest.approx(direct, rel=1e-9)


@pytest.mark.parametrize("method", ["svd", "cross"])
def test_full_rank_lowrank_is_exact(data, method):
    W, X, G = data
    spec = ttmath.lowrank_svd(W, G)
    f = ttmath.lowrank_factor(spec, W, G, min(W.shape), method=method)
    x = X[:7].astype(np.float32)
    ref = x.astype(np.float64) @ W
    got = tt_matmul(x.astype(np.float64), [c.astype(np.float64) for c in f.cores])
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-4
    assert f.gap < 1e-4


@pytest.mark.parametrize("d", [3, 4])
@pytest.mark.parametrize("method", ["svd", "cross"])
def test_full_rank_tt_is_exact(data, d, method):
    W, X, G = data
    mk, mn = ttmath.choose_modes(*W.shape, d)
    f = ttmath.tt_factor(W, G, mk, mn, max_rank=10_000, method=method)
    assert f.gap < 1e-4
    x = X[:5]
    got = tt_matmul(x, [c.astype(np.float64) for c in f.cores], f.x_scale.astype(np.float64))
    assert np.linalg.norm(got - x @ W) / np.linalg.norm(x @ W) < 1e-4


def test_whitened_gap_curve_predicts_measured_gap(data):
    W, X, G = data
    spec = ttmath.lowrank_svd(W, G)
    curve = spec.gap_curve()
    for r in (1, 5, 17, 30):
        f = ttmath.lowrank_factor(spec, W, G, r)
        measured = np.linalg.norm(X @ W - X @ f.dense()) / np.linalg.norm(X @ W)
        assert measured == pytest.approx(curve[r], rel=1e-3, abs=1e-5)
        assert gaps.output_gap(W, f.dense(), G) == pytest.approx(measured, rel=1e-3, abs=1e-5)
        assert f.gap >= gaps.output_gap(W, f.dense(), G) - 1e-12  # layer gap = max(frobenius, channel)


def test_activation_aware_beats_plain_svd_on_anisotropic_inputs(data):
    W, X, G = data
    r = 8
    aware = ttmath.lowrank_factor(ttmath.lowrank_svd(W, G), W, G, r)
    plain = ttmath.lowrank_factor(ttmath.lowrank_svd(W, None), W, G, r)
    assert aware.gap < plain.gap


def test_maxvol_dominance():
    rng = np.random.default_rng(3)
    A = rng.standard_normal((300, 7))
    idx = ttmath.maxvol(A, tol=1.01)
    assert len(set(idx.tolist())) == 7
    B = A @ np.linalg.inv(A[idx])
    assert np.abs(B).max() <= 1.01 + 1e-9


def test_cross_recovers_exact_low_rank_matrix():
    rng = np.random.default_rng(4)
    A = rng.standard_normal((50, 6)) @ rng.standard_normal((6, 70))
    left, right = ttmath.cross_lowrank(A, 6, sweeps=3)
    assert np.linalg.norm(left @ right - A) / np.linalg.norm(A) < 1e-8


@pytest.mark.parametrize("n,d", [(576, 3), (1536, 3), (384, 4), (97, 3), (49152, 3)])
def test_factorize(n, d):
    f = ttmath.factorize(n, d)
    assert len(f) == d and int(np.prod(f)) == n


def test_choose_modes_rejects_prime_dims():
    assert ttmath.choose_modes(97, 64, 3) is None
    assert ttmath.choose_modes(97, 64, 2) == ([97, 1], [1, 64])


def test_tt_full_of_lowrank_cores():
    rng = np.random.default_rng(5)
    A, B = rng.standard_normal((9, 3)), rng.standard_normal((3, 11))
    from custom_ops.reference import lowrank_cores

    assert np.allclose(tt_full([c.astype(np.float64) for c in lowrank_cores(A, B)]), A.astype(np.float32) @ B.astype(np.float32), atol=1e-5)


def test_channel_gap_catches_massive_activation_channel():
    """One output channel 1000x larger than the rest: a rank-1 factor reproducing it has a tiny
    Frobenius gap but destroys every other channel; the layer gap must say so."""
    rng = np.random.default_rng(7)
    K, N = 40, 30
    W = rng.standard_normal((K, N))
    W[:, 0] *= 1000.0
    X = rng.standard_normal((300, K))
    G = X.T @ X
    f = ttmath.lowrank_factor(ttmath.lowrank_svd(W, G), W, G, 1)
    assert gaps.output_gap(W, f.dense(), G) < 0.05
    assert gaps.channel_gap(W, f.dense(), G) > 0.8
    assert f.gap > 0.8


def test_channel_gap_direct():
    rng = np.random.default_rng(8)
    W = rng.standard_normal((12, 9))
    Wh = W + 0.1 * rng.standard_normal(W.shape)
    X = rng.standard_normal((100, 12))
    per = np.sum((X @ (W - Wh)) ** 2, axis=0) / np.sum((X @ W) ** 2, axis=0)
    assert gaps.channel_gap(W, Wh, X.T @ X) == pytest.approx(np.sqrt(per.mean()), rel=1e-9)
