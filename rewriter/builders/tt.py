"""Offline math for TTMatMul: activation-aware whitening, TT-SVD, TT-cross with maxvol, mode
factorisation (the gap metrics are kit.gaps).

Conventions (see DEVELOPERS.md): W is [K, N]; TT-matrix cores are G_i [r_{i-1}, k_i, n_i, r_i];
the calibration statistic is the Gram matrix G = XᵀX of the layer's inputs, so the relative
output error on the calibration set is ‖X(W − Ŵ)‖_F / ‖XW‖_F = sqrt(tr(EᵀGE) / tr(WᵀGW)).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.linalg as sla

from custom_ops.reference.tt import tt_full, tt_params

from ..kit.gaps import layer_gap


# --------------------------------------------------------------------------- whitening
_WHITE_CACHE: dict = {}


def whitening(G: np.ndarray, ridge: float = 1e-6) -> np.ndarray:
    """Upper-triangular R with RᵀR = G + ridge·mean(diag)·I, so ‖XE‖ ≈ ‖RE‖. The last result is
    cached (q/k/v and gate/up share one input, hence one G)."""
    key = (id(G), G.shape, float(G.flat[0]), float(G.flat[-1]), ridge)
    if key in _WHITE_CACHE:
        return _WHITE_CACHE[key]
    R = _whitening(G, ridge)
    _WHITE_CACHE.clear()
    _WHITE_CACHE[key] = R
    return R


def _whitening(G: np.ndarray, ridge: float) -> np.ndarray:
    G = np.asarray(G, np.float64)
    K = G.shape[0]
    lam = ridge * max(float(np.trace(G)) / K, 1e-12)
    for _ in range(6):
        try:
            L = np.linalg.cholesky(G + lam * np.eye(K))
            return L.T
        except np.linalg.LinAlgError:
            lam *= 100.0
    raise np.linalg.LinAlgError("calibration Gram matrix is not positive definite even with a ridge")


# --------------------------------------------------------------------------- low rank (d = 2)
@dataclass
class LowRankSpectrum:
    """Whitened SVD of W: Ŵ_r = R⁻¹ U_r S_r V_rᵀ; gap(r) is exact on the calibration Gram."""
    R: np.ndarray | None
    U: np.ndarray
    s: np.ndarray
    Vt: np.ndarray

    def gap_curve(self) -> np.ndarray:
        """gap[r] for r = 0..len(s) (whitened residual energy)."""
        e = self.s.astype(np.float64) ** 2
        tail = np.concatenate([np.cumsum(e[::-1])[::-1], [0.0]])
        return np.sqrt(tail / max(e.sum(), 1e-300))

    def factors(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        sq = np.sqrt(self.s[:r])
        left = self.U[:, :r] * sq
        if self.R is not None:
            left = sla.solve_triangular(self.R, left, lower=False)
        return left.astype(np.float32), (sq[:, None] * self.Vt[:r]).astype(np.float32)


def lowrank_svd(W: np.ndarray, G: np.ndarray | None, whiten: str = "full") -> LowRankSpectrum:
    W = np.asarray(W, np.float64)
    R = None
    if G is not None and whiten == "full":
        R = whitening(G)
        Ww = R @ W
    elif G is not None and whiten == "diag":
        d = np.sqrt(np.maximum(np.diag(G), 1e-30))
        R = np.diag(d)
        Ww = d[:, None] * W
    else:
        Ww = W
    U, s, Vt = np.linalg.svd(Ww, full_matrices=False)
    return LowRankSpectrum(R=R, U=U, s=s, Vt=Vt)


def maxvol(A: np.ndarray, tol: float = 1.05, max_iters: int = 100) -> np.ndarray:
    """Row indices of a (quasi-)maximal-volume r×r submatrix of the tall matrix A [m, r]
    (Goreinov–Tyrtyshnikov: start from LU pivots, swap rows while some |B_ij| > tol)."""
    A = np.asarray(A, np.float64)
    m, r = A.shape
    if r >= m:
        return np.arange(m)
    _, piv, _ = sla.lapack.dgetrf(A)  # partial pivoting: LAPACK row swaps
    perm = np.arange(m)
    for i in range(r):
        perm[i], perm[piv[i]] = perm[piv[i]], perm[i]
    idx = perm[:r].copy()
    B = A @ np.linalg.solve(A[idx].T, np.eye(r)).T  # A · A[idx]^{-1}
    for _ in range(max_iters):
        i, j = np.unravel_index(np.argmax(np.abs(B)), B.shape)
        if abs(B[i, j]) <= tol:
            break
        idx[j] = i
        bj = B[:, j].copy()
        bi = B[i, :].copy()
        bi[j] -= 1.0
        B -= np.outer(bj, bi / B[i, j])
    return idx


def cross_lowrank(A: np.ndarray, r: int, sweeps: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Skeleton (cross) approximation A ≈ C·Â⁻¹·R with rows/columns picked by alternating
    maxvol sweeps. Returns (left [m, r], right [r, n]) with left = C·Â⁻¹ (interpolative)."""
    A = np.asarray(A, np.float64)
    m, n = A.shape
    r = min(r, m, n)
    rng = np.random.default_rng(seed)
    J = np.sort(rng.choice(n, r, replace=False))
    I = np.arange(r)
    for _ in range(max(1, sweeps)):
        Q, _ = np.linalg.qr(A[:, J])
        I = maxvol(Q)
        Q2, _ = np.linalg.qr(A[I, :].T)
        J = maxvol(Q2)
    Q, _ = np.linalg.qr(A[:, J])
    left = Q @ np.linalg.pinv(Q[I, :])          # stable form of C·A[I,J]⁻¹
    return left, A[I, :]


# --------------------------------------------------------------------------- TT (d ≥ 2)
def factorize(n: int, d: int) -> list[int]:
    """Split n into d balanced integer factors (largest first); 1s when n has too few factors."""
    primes = []
    m, p = n, 2
    while p * p <= m:
        while m % p == 0:
            primes.append(p)
            m //= p
        p += 1
    if m > 1:
        primes.append(m)
    buckets = [1] * d
    for q in sorted(primes, reverse=True):
        i = int(np.argmin(buckets))
        buckets[i] *= q
    return sorted(buckets, reverse=True)


def choose_modes(K: int, N: int, d: int) -> tuple[list[int], list[int]] | None:
    if d == 2:
        return [K, 1], [1, N]  # plain low rank
    mk, mn = factorize(K, d), factorize(N, d)
    if min(mk) == 1 or min(mn) == 1:
        return None  # not factorisable into d non-trivial modes
    # pair big input modes with small output modes keeps the middle bond dims balanced
    return mk, sorted(mn)


def _to_tt_tensor(W: np.ndarray, mk: list[int], mn: list[int]) -> np.ndarray:
    d = len(mk)
    T = W.reshape(*mk, *mn)
    perm = [x for i in range(d) for x in (i, d + i)]
    return T.transpose(perm).reshape([mk[i] * mn[i] for i in range(d)])


def tt_decompose(W: np.ndarray, mk: list[int], mn: list[int], max_rank: int, method: str = "svd",
                 maxvol_sweeps: int = 8, seed: int = 0) -> list[np.ndarray]:
    """TT-matrix cores of W [K, N] with bond ranks ≤ max_rank, by TT-SVD or TT-cross (maxvol
    skeletons on each unfolding, left to right)."""
    d = len(mk)
    T = _to_tt_tensor(np.asarray(W, np.float64), mk, mn)
    dims = [mk[i] * mn[i] for i in range(d)]
    cores = []
    r_prev = 1
    C = T.reshape(1, -1)
    for i in range(d - 1):
        C = C.reshape(r_prev * dims[i], -1)
        r = min(max_rank, C.shape[0], C.shape[1])
        if method == "svd":
            U, s, Vt = np.linalg.svd(C, full_matrices=False)
            left, right = U[:, :r], s[:r, None] * Vt[:r]
        elif method == "cross":
            left, right = cross_lowrank(C, r, maxvol_sweeps, seed=seed + i)
        else:
            raise ValueError(f"unknown TT method {method!r}")
        cores.append(left.reshape(r_prev, mk[i], mn[i], r))
        C = right
        r_prev = r
    cores.append(C.reshape(r_prev, mk[-1], mn[-1], 1))
    return cores


@dataclass
class TTFactor:
    cores: list[np.ndarray]      # float32
    modes_k: list[int]
    modes_n: list[int]
    ranks: list[int]
    x_scale: np.ndarray | None   # float32 [K] or None
    gap: float
    method: str

    @property
    def params(self) -> int:
        return tt_params(self.cores) + (0 if self.x_scale is None else self.x_scale.size)

    def dense(self) -> np.ndarray:
        W = tt_full([c.astype(np.float64) for c in self.cores])
        if self.x_scale is not None:
            W = self.x_scale.astype(np.float64)[:, None] * W
        return W


def lowrank_factor(spec: LowRankSpectrum, W: np.ndarray, G: np.ndarray | None, r: int, method: str = "svd",
                   maxvol_sweeps: int = 8) -> TTFactor:
    K, N = W.shape
    if method == "svd":
        A, B = spec.factors(r)
    else:
        Ww = spec.R @ W if spec.R is not None else np.asarray(W, np.float64)
        left, right = cross_lowrank(Ww, r, maxvol_sweeps)
        if spec.R is not None:
            left = sla.solve_triangular(spec.R, left, lower=False) if np.allclose(spec.R, np.triu(spec.R)) else np.linalg.solve(spec.R, left)
        A, B = _balance(left, right)
    cores = [A[None, :, None, :].copy(), B[:, None, :, None].copy()]
    f = TTFactor(cores=cores, modes_k=[K, 1], modes_n=[1, N], ranks=[1, r, 1], x_scale=None, gap=0.0, method=method)
    f.gap = layer_gap(W, A.astype(np.float64) @ B.astype(np.float64), G)
    return f


def _balance(left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rescale rank components so both factors have equal column/row norms (float32 safety)."""
    a = np.linalg.norm(left, axis=0) + 1e-30
    b = np.linalg.norm(right, axis=1) + 1e-30
    s = np.sqrt(b / a)
    return (left * s).astype(np.float32), (right / s[:, None]).astype(np.float32)


def tt_factor(W: np.ndarray, G: np.ndarray | None, mk: list[int], mn: list[int], max_rank: int,
              method: str = "svd", maxvol_sweeps: int = 8, diag_scale: bool = True) -> TTFactor:
    """d ≥ 3 TT with diagonal activation-aware scaling (a full whitening would mix the K modes
    and break the TT structure): factor diag(s)·W with s = RMS of each input channel, run
    with x_scale = 1/s."""
    W = np.asarray(W, np.float64)
    x_scale = None
    Ws = W
    if G is not None and diag_scale:
        s = np.sqrt(np.maximum(np.diag(G), 0.0))
        s = s / max(float(np.mean(s)), 1e-30)
        s = np.maximum(s, 1e-3)
        Ws = s[:, None] * W
        x_scale = (1.0 / s).astype(np.float32)
    cores = tt_decompose(Ws, mk, mn, max_rank, method, maxvol_sweeps)
    cores32 = [c.astype(np.float32) for c in cores]
    ranks = [1] + [c.shape[3] for c in cores32]
    f = TTFactor(cores=cores32, modes_k=list(mk), modes_n=list(mn), ranks=ranks, x_scale=x_scale, gap=0.0, method=method)
    f.gap = layer_gap(W, f.dense(), G)
    return f


def tt_param_count(mk: list[int], mn: list[int], r: int) -> int:
    ranks = tt_ranks_for_cap(mk, mn, r)
    return int(sum(ranks[i] * mk[i] * mn[i] * ranks[i + 1] for i in range(len(mk))))


def tt_macs(modes_k: list[int], modes_n: list[int], ranks: list[int]) -> int:
    """Multiply-adds per input row of the sequential contraction (first core first), the cost
    model of the TTMatMul kernel: sum_i prod(n_<i)·n_i·r_i·r_{i-1}·k_i·prod(k_>i)."""
    d = len(modes_k)
    total = 0
    for i in range(d):
        total += int(np.prod(modes_n[:i])) * modes_n[i] * ranks[i + 1] * ranks[i] * modes_k[i] * int(np.prod(modes_k[i + 1:]))
    return int(total)


def tt_ranks_for_cap(mk: list[int], mn: list[int], r: int) -> list[int]:
    """Bond ranks TT-SVD produces with a rank cap r (capped by the unfolding sizes)."""
    d = len(mk)
    ranks = [1] + [r] * (d - 1) + [1]
    left = 1
    for i in range(d - 1):
        left *= mk[i] * mn[i]
        right = int(np.prod([mk[j] * mn[j] for j in range(i + 1, d)]))
        ranks[i + 1] = min(r, left, right)
    return ranks
