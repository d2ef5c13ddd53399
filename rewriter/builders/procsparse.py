"""ProcSparseMatMul's stored layer (seed 002): hash base + top-K block deltas per output row,
shedding, least-squares fits on calibration data (the planner is backends/procsparse.py).

The stored layer (semantics: custom_ops/reference/procsparse.py) is, per output row n (a column
of W [K, N]), a set of input blocks S_n of size B; on those blocks Ŵ = base_scale·H + Δ, elsewhere
0. Building one layer:

1. Block scores by the output error they remove: score[b, n] = w_bnᵀ G_bb w_bn (G = XᵀX of the
   calibration activations; the exact error of dropping that block alone, ignoring its
   interaction with other dropped blocks). Without calibration G = I (plain |W|², the naive
   choice).
2. One global ranking of all (block, row) pairs; the kept set is the T best pairs subject to the
   per-row caps fanout and watermark/B. T is the smallest (bisection) whose exact gap
   ‖X(W−Ŵ)‖/‖XW‖ on the calibration Gram is ≤ --proc-gap, within the byte budget
   (--proc-max-bytes of dense); otherwise the layer stays dense and the report says why.
3. Optional refit (--proc-refit, default on): the kept weights are re-solved by least squares so
   XŴ best reproduces XW given the support (batched conjugate gradient on the normal equations,
   monotone in the objective).
4. base_scale: a number (seed default 0.05; 0 ablates the base) or "fit" (least squares of the
   kept weights on the hash base, calibration-weighted); deltas are Δ = Ŵ − fl(base_scale·H).
5. Shedding: a kept block whose |Δ| are all < shed_eps is trimmed (soft); rows beyond the
   watermark lose their lowest-score blocks (hard). Both are counted (`trims`).

The hash base carries no information about W: with exact fp32 deltas it changes nothing in the
stored function (Δ absorbs it) and only costs regeneration time; it is kept because the seed
asks for it and a quantized delta layout (fp16/int8, later) would store Δ relative to it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..kit.gaps import energy


class BuildOptions(Protocol):
    """What build_layer reads from the backend's config (backends.procsparse.ProcConfig)."""
    block: int
    refit: bool
    refit_iters: int
    refit_ridge: float
    seed: int
    shed_eps: float
    watermark: int

    def scale_value(self) -> float | None: ...


# --------------------------------------------------------------------------- the stored layer
@dataclass
class ProcLayer:
    K: int
    N: int
    block: int
    seed: int
    base_scale: float
    row_ptr: np.ndarray        # int32 [N+1]
    block_idx: np.ndarray      # int32 [nnzb]
    deltas: np.ndarray         # float32 [nnzb, B]
    fanout: int                # the per-row cap used
    watermark: int
    shed_eps: float
    trims: int = 0             # blocks removed by shedding (soft eps + hard watermark)
    gap: float = float("nan")
    gap_channels: float = float("nan")   # per-output-channel relative error, averaged (see channel_gap)
    info: dict = field(default_factory=dict)

    @property
    def nnzb(self) -> int:
        return int(self.row_ptr[-1])

    @property
    def params(self) -> int:
        from custom_ops.reference.procsparse import stored_params

        return stored_params(self.N, self.nnzb, self.block)

    @property
    def bytes(self) -> int:
        return 4 * self.params      # fp32 deltas, int32 indices and row pointers

    def dense(self) -> np.ndarray:
        """Ŵ [K, N] float32, exactly as the kernel regenerates it."""
        return reconstruct(self.K, self.N, self.block, self.seed, self.base_scale, self.row_ptr, self.block_idx, self.deltas)


def reconstruct(K, N, B, seed, base_scale, row_ptr, block_idx, deltas) -> np.ndarray:
    """Vectorized form of reference.proc_full (same float32 operations, bit-identical)."""
    from custom_ops.reference.procsparse import hash_base

    nb = (K + B - 1) // B
    Kp = nb * B
    rows = np.repeat(np.arange(N), np.diff(np.asarray(row_ptr, np.int64)))
    Wp = np.zeros((N, Kp), np.float32)
    if len(rows):
        cols = (np.asarray(block_idx, np.int64)[:, None] * B + np.arange(B)[None, :])     # [nnzb, B]
        vals = np.asarray(deltas, np.float32)
        if base_scale != 0.0:
            H = np.zeros((N, Kp), np.float32)
            H[:, :K] = hash_base(seed, K, N).T
            vals = (np.float32(base_scale) * H[rows[:, None], cols]).astype(np.float32) + vals
        Wp[rows[:, None], cols] = vals
    return np.ascontiguousarray(Wp[:, :K].T)


# --------------------------------------------------------------------------- math
def block_scores(W: np.ndarray, G: np.ndarray | None, B: int) -> np.ndarray:
    """score[b, n] = w_bnᵀ G_bb w_bn: output energy of block b of row n alone."""
    K, N = W.shape
    nb = (K + B - 1) // B
    S = np.empty((nb, N), np.float64)
    for b in range(nb):
        k0, k1 = b * B, min(K, (b + 1) * B)
        Wb = W[k0:k1].astype(np.float64)
        S[b] = (Wb * Wb).sum(0) if G is None else ((G[k0:k1, k0:k1] @ Wb) * Wb).sum(0)
    return S


def select_blocks(S: np.ndarray, T: int, cap: int) -> np.ndarray:
    """bool [nb, N]: the T best (block, row) pairs by score, at most `cap` per row."""
    nb, N = S.shape
    order = np.argsort(-S, axis=0, kind="stable")           # per row, best first
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(nb)[:, None].repeat(N, 1), axis=0)
    eligible = rank < cap
    flat = np.where(eligible, S, -np.inf).ravel()
    T = int(min(T, eligible.sum()))
    keep = np.zeros(nb * N, bool)
    if T > 0:
        idx = np.argpartition(-flat, T - 1)[:T]
        keep[idx] = True
    return keep.reshape(nb, N)


def expand(mask_b: np.ndarray, K: int, B: int) -> np.ndarray:
    return np.repeat(mask_b, B, axis=0)[:K]


def refit_support(W: np.ndarray, G: np.ndarray, Mk: np.ndarray, iters: int) -> np.ndarray:
    """Least squares on a fixed support: min ‖X(W − Ŵ)‖² over Ŵ with Ŵ = 0 off Mk, all rows at
    once by conjugate gradient on the masked normal equations (starting from W·Mk; every
    iteration lowers the objective)."""
    Mk = Mk.astype(np.float64)
    W = W.astype(np.float64)
    Wh = W * Mk
    R = -Mk * (G @ (Wh - W))
    P = R.copy()
    rs = (R * R).sum(0)
    tiny = 1e-30 * max(float(rs.max(initial=0.0)), 1e-30)
    for _ in range(iters):
        if float(rs.max(initial=0.0)) <= tiny:
            break
        Ap = Mk * (G @ P)
        pAp = (P * Ap).sum(0)
        alpha = np.where(pAp > 0, rs / np.where(pAp > 0, pAp, 1.0), 0.0)
        Wh += alpha * P
        R -= alpha * Ap
        rs_new = (R * R).sum(0)
        beta = np.where(rs > 0, rs_new / np.where(rs > 0, rs, 1.0), 0.0)
        P = R + beta * P
        rs = rs_new
    return Wh


def build_layer(W: np.ndarray, G: np.ndarray | None, keep_b: np.ndarray, cfg: BuildOptions, cap: int,
                S: np.ndarray) -> ProcLayer:
    """The stored layer for a chosen support (refit, base_scale, deltas, shedding)."""
    from custom_ops.reference.procsparse import hash_base

    K, N = W.shape
    B = cfg.block
    nb = keep_b.shape[0]
    Mk = expand(keep_b, K, B)
    if cfg.refit and G is not None and cfg.refit_iters:
        # a small ridge (relative to the mean activation energy) keeps the refit from fitting the
        # calibration tokens' null space: measured on MiniLM fc2, held-out gap 0.087 → 0.079
        Gr = G + cfg.refit_ridge * (float(np.trace(G)) / K) * np.eye(K)
        Wh = refit_support(W, Gr, Mk, cfg.refit_iters)
    else:
        Wh = W * Mk
    Wh = Wh.astype(np.float32)
    H = hash_base(cfg.seed, K, N)
    s = cfg.scale_value()
    if s is None:   # least squares of the kept weights on the base, calibration-weighted (diag G)
        g = np.ones(K) if G is None else np.maximum(np.diag(G), 0.0)
        gw = g[:, None] * Mk
        den = float((gw * H.astype(np.float64) ** 2).sum())
        s = float((gw * H * Wh).sum() / den) if den > 0 else 0.0
    s32 = np.float32(s)
    base = (s32 * H).astype(np.float32)
    D = np.where(Mk, Wh - base, 0.0).astype(np.float32)         # [K, N]; Ŵ = fl(base + D) on the support
    # pad K to whole blocks, per (block, row) views
    Kp = nb * B
    Dp = np.zeros((Kp, N), np.float32)
    Dp[:K] = D
    Db = Dp.reshape(nb, B, N)                                     # [nb, B, N]
    # soft shedding: blocks whose deltas are all below eps
    trims = 0
    if cfg.shed_eps > 0:
        small = keep_b & (np.abs(Db).max(axis=1) < cfg.shed_eps)
        trims += int(small.sum())
        keep_b = keep_b & ~small
    # hard shedding: per-row watermark on stored delta values (lowest score first)
    wm_blocks = cfg.watermark // B if cfg.watermark else nb
    counts = keep_b.sum(0)
    over = np.nonzero(counts > wm_blocks)[0]
    for n in over:
        ids = np.nonzero(keep_b[:, n])[0]
        drop = ids[np.argsort(S[ids, n], kind="stable")[: len(ids) - wm_blocks]]
        keep_b[drop, n] = False
        trims += len(drop)
    # CSR by output row, blocks increasing
    nz_n, nz_b = np.nonzero(keep_b.T)                             # row-major over n: sorted by n then b
    row_ptr = np.zeros(N + 1, np.int64)
    np.add.at(row_ptr, nz_n + 1, 1)
    row_ptr = np.cumsum(row_ptr).astype(np.int32)
    deltas = np.ascontiguousarray(Db[nz_b, :, nz_n], dtype=np.float32)  # [nnzb, B]
    layer = ProcLayer(K, N, B, int(cfg.seed), float(s32), row_ptr, nz_b.astype(np.int32), deltas,
                      fanout=cap, watermark=int(cfg.watermark), shed_eps=float(cfg.shed_eps), trims=trims)
    return layer


def layer_gap(W: np.ndarray, G: np.ndarray | None, layer: ProcLayer) -> float:
    Wd = W.astype(np.float64)
    E = Wd - layer.dense().astype(np.float64)
    den = energy(Wd, G)
    return math.sqrt(max(energy(E, G), 0.0) / max(den, 1e-30))
