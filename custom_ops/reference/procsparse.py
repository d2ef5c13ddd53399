"""Numpy reference of ProcSparseMatMul: the normative definition of the op (see DEVELOPERS.md).

Stored layer (W is [K, N], Y = X · W; "row" n below is an output channel = a column of W):

    Ŵ[k, n] = base_scale · h(seed, n, k) + Δ[j, k − b·B]   if k lies in a block b = block_idx[j]
                                                            stored for row n (row_ptr[n] ≤ j < row_ptr[n+1])
    Ŵ[k, n] = 0                                             otherwise

The hash base h ∈ [−1, 1) is `splitmix64` of a per-element counter, mapped to a float exactly:

    i  = n · K + k                                   (uint64)
    z  = seed + (i + 1) · 0x9E3779B97F4A7C15         (mod 2^64; seed as uint64)
    z  = (z ^ (z >> 30)) · 0xBF58476D1CE4E5B9
    z  = (z ^ (z >> 27)) · 0x94D049BB133111EB
    z  =  z ^ (z >> 31)
    h  = ((z >> 40) − 2^23) · 2^-23                  (24 bits → exactly representable in float32)

and the stored weight is `fl32(fl32(base_scale · h) + Δ)` (one float32 multiply, one float32 add;
no fused multiply-add), so every implementation regenerates bit-identical weights.

Gating (optional `block_mask`, float32 `[nb]` or `[M, nb]`, nb = ceil(K / B)): for input row m
only blocks with block_mask[(m,) b] ≠ 0 are visited, i.e. the blocks used are
`blocks of row n ∩ {b : mask[m, b] ≠ 0}` (a KWTA / event mask never asks for a block the layer
does not have).
"""
from __future__ import annotations

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MIX1 = np.uint64(0xBF58476D1CE4E5B9)
MIX2 = np.uint64(0x94D049BB133111EB)
BLOCKS = (32, 64)


def splitmix64(seed: int, idx: np.ndarray) -> np.ndarray:
    """splitmix64 output for counters idx (uint64 array); arithmetic mod 2^64."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed & 0xFFFFFFFFFFFFFFFF) + (np.asarray(idx, np.uint64) + np.uint64(1)) * GOLDEN
        z = (z ^ (z >> np.uint64(30))) * MIX1
        z = (z ^ (z >> np.uint64(27))) * MIX2
        z = z ^ (z >> np.uint64(31))
    return z


def hash_unit(seed: int, idx: np.ndarray) -> np.ndarray:
    """h ∈ [−1, 1) as float32 (exact) for counters idx."""
    z = splitmix64(seed, idx)
    u = (z >> np.uint64(40)).astype(np.int64) - (1 << 23)
    return (u.astype(np.float32) * np.float32(2.0 ** -23)).astype(np.float32)


def hash_base(seed: int, K: int, N: int) -> np.ndarray:
    """The hash base H [K, N] (float32): H[k, n] = h(seed, n·K + k)."""
    n = np.arange(N, dtype=np.uint64)[None, :]
    k = np.arange(K, dtype=np.uint64)[:, None]
    return hash_unit(seed, n * np.uint64(K) + k)


def num_blocks(K: int, block: int) -> int:
    return (K + block - 1) // block


def proc_full(K: int, N: int, block: int, seed: int, base_scale: float, row_ptr, block_idx, deltas) -> np.ndarray:
    """The dense Ŵ [K, N] (float32) the stored layer represents."""
    row_ptr = np.asarray(row_ptr, np.int64)
    block_idx = np.asarray(block_idx, np.int64)
    deltas = np.asarray(deltas, np.float32).reshape(-1, block)
    H = hash_base(seed, K, N)
    s = np.float32(base_scale)
    W = np.zeros((K, N), np.float32)
    for n in range(N):
        for j in range(row_ptr[n], row_ptr[n + 1]):
            b = int(block_idx[j])
            k0, k1 = b * block, min(K, (b + 1) * block)
            base = (s * H[k0:k1, n]).astype(np.float32)
            W[k0:k1, n] = (base + deltas[j, : k1 - k0]).astype(np.float32)
    return W


def validate(K: int, N: int, block: int, row_ptr, block_idx, deltas) -> None:
    if block not in BLOCKS:
        raise ValueError(f"ProcSparseMatMul: block must be one of {BLOCKS}, got {block}")
    nb = num_blocks(K, block)
    row_ptr = np.asarray(row_ptr, np.int64)
    block_idx = np.asarray(block_idx, np.int64)
    if row_ptr.shape != (N + 1,) or row_ptr[0] != 0 or np.any(np.diff(row_ptr) < 0):
        raise ValueError("ProcSparseMatMul: row_ptr must be [N+1], start at 0, non-decreasing")
    nnzb = int(row_ptr[-1])
    if block_idx.shape != (nnzb,) or np.asarray(deltas).shape != (nnzb, block):
        raise ValueError("ProcSparseMatMul: block_idx must be [nnzb], deltas [nnzb, block]")
    if nnzb and (block_idx.min() < 0 or block_idx.max() >= nb):
        raise ValueError(f"ProcSparseMatMul: block indices must lie in [0, {nb})")
    for n in range(N):
        seg = block_idx[row_ptr[n]:row_ptr[n + 1]]
        if np.any(np.diff(seg) <= 0):
            raise ValueError(f"ProcSparseMatMul: block indices of row {n} must be strictly increasing")


def proc_sparse_matmul(x, row_ptr, block_idx, deltas, block_mask=None, *, shape, block, seed, base_scale,
                       **_meta) -> np.ndarray:
    """Y = X · Ŵ with the optional per-row block mask (see module docstring). Computed in float64
    from the exact float32 weights (an accurate oracle); the result has X's dtype."""
    K, N = int(shape[0]), int(shape[1])
    block = int(block)
    x = np.asarray(x)
    if x.shape[-1] != K:
        raise ValueError(f"ProcSparseMatMul: input last dim {x.shape[-1]} != K {K}")
    validate(K, N, block, row_ptr, block_idx, deltas)
    W = proc_full(K, N, block, int(seed), float(base_scale), row_ptr, block_idx, deltas).astype(np.float64)
    lead = x.shape[:-1]
    X = x.reshape(-1, K).astype(np.float64)
    if block_mask is None or np.asarray(block_mask).size == 0:
        Y = X @ W
    else:
        nb = num_blocks(K, block)
        mask = np.asarray(block_mask, np.float32)
        if mask.shape == (nb,):
            mask = np.broadcast_to(mask, (X.shape[0], nb))
        mask = mask.reshape(-1, nb)
        if mask.shape[0] != X.shape[0]:
            raise ValueError(f"ProcSparseMatMul: block_mask must be [{nb}] or [M, {nb}], got {np.asarray(block_mask).shape}")
        keep = np.repeat(mask != 0, block, axis=1)[:, :K]
        Y = np.where(keep, X, 0.0) @ W      # a masked block is not visited: it contributes nothing
    return Y.reshape(*lead, N).astype(x.dtype if x.dtype in (np.float32, np.float64) else np.float32)


def stored_params(N: int, nnzb: int, block: int) -> int:
    """Numbers stored (all 4 bytes now): deltas nnzb·B + block indices nnzb + row_ptr N+1."""
    return int(nnzb * block + nnzb + N + 1)
