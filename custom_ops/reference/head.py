"""The cheap head (issue 11 item 4, seeds 000 + 001): what logits a model rewritten with
``--cheap-head=lowrank`` outputs. It is built from standard ONNX / com.microsoft ops only (no
ortlean kernel), so this module is the normative definition of the graph the pass writes
(``rewriter/backends/head.py``), not of an op.

For a head ``logits = h · W`` (``h`` [..., S, D], ``W`` [D, V], V the vocabulary):

- ``S > 1`` (prefill, ``ortlean eval``'s perplexity): the exact head, ``h · W``.
- ``S == 1`` (a decode step; every row of the batch independently):
  1. approximate logits ``a = (h · A) · B`` with the low-rank factors ``A`` [D, r] (float32) and
     ``B`` [r, V] (stored as MatMulNBits int4/int8, symmetric, block 32 along r: ``B`` here is its
     dequantized value, :func:`dequant_nbits`);
  2. candidates: the ``C`` largest entries of ``a`` (``TopK``; ties go to the lower index);
  3. exact logits of the candidates only: ``h · rows[c]`` with ``rows`` = Wᵀ [V, D] (the tied
     embedding table, Wᵀ stored once, or the head's own MatMulNBits blocks dequantized — the
     model's own precision). A MatMulNBits head at ``accuracy_level`` 4 computes with int8
     activations; the candidates then use the same rounding of ``h`` (:func:`int8_activations`,
     ``act_block`` = the head's block size), so they equal that head's logits, not a float32 variant;
  4. every other position holds ``-inf`` (``fill="neginf"``, the default: greedy and top-k/top-p
     sampling then run on exact logits of the candidates, and a token outside them can never be
     chosen) or its approximate value ``a`` (``fill="approx"``: a full, approximate distribution;
     an approximate value can then exceed the exact candidates' and win the argmax).

With ``C ≥ V`` the candidates are the whole vocabulary and the output is the exact head's.
"""
from __future__ import annotations

import numpy as np

FILLS = ("neginf", "approx")


def quant_nbits(B: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric round-to-nearest of ``B`` [K, N] into MatMulNBits' layout: ``blob`` uint8
    [N, ceil(K/block), block·bits/8] (4-bit: element 2j in the low nibble of byte j) and
    ``scales`` float32 [N·ceil(K/block)]; no zero points (MatMulNBits' default 2^(bits−1))."""
    K, N = B.shape
    nb = -(-K // block)
    zp = 1 << (bits - 1)
    Bp = np.zeros((nb * block, N), np.float32)
    Bp[:K] = B
    Bb = Bp.T.reshape(N, nb, block)
    amax = np.abs(Bb).max(axis=2)
    scales = np.where(amax > 0, amax / (zp - 1), 1.0).astype(np.float32)
    q = (np.clip(np.rint(Bb / scales[..., None]), -zp, zp - 1) + zp).astype(np.uint8)
    if bits == 4:
        q = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(q), scales.reshape(-1)


def unpack_zero_points(zp: np.ndarray | None, N: int, nb: int, bits: int) -> np.ndarray:
    """MatMulNBits zero points ([N·ceil(nb·bits/8)] uint8, 4-bit packed per column) as uint8 [N, nb]
    (the default 2^(bits−1) when absent)."""
    if zp is None:
        return np.full((N, nb), 1 << (bits - 1), np.uint8)
    z = np.asarray(zp, np.uint8).reshape(N, -1)
    if bits == 4:
        z = np.stack([z & 15, z >> 4], axis=-1).reshape(N, -1)
    return np.ascontiguousarray(z[:, :nb])


def dequant_rows(blob: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, K: int, bits: int,
                 block: int) -> np.ndarray:
    """MatMulNBits weights dequantized as rows: float32 [N, K] (= Wᵀ)."""
    N, nb = blob.shape[0], blob.shape[1]
    q = np.asarray(blob, np.uint8).reshape(N, nb, -1)
    if bits == 4:
        q = np.stack([q & 15, q >> 4], axis=-1).reshape(N, nb, block)
    z = unpack_zero_points(zero_points, N, nb, bits).astype(np.float32)
    s = np.asarray(scales, np.float32).reshape(N, nb)
    w = (q.astype(np.float32) - z[..., None]) * s[..., None]
    return np.ascontiguousarray(w.reshape(N, nb * block)[:, :K])


def dequant_nbits(blob, scales, zero_points, K: int, bits: int, block: int) -> np.ndarray:
    """MatMulNBits weights dequantized: float32 [K, N]."""
    return np.ascontiguousarray(dequant_rows(blob, scales, zero_points, K, bits, block).T)


def int8_activations(x: np.ndarray, block: int) -> np.ndarray:
    """``x`` [..., D] as MatMulNBits at ``accuracy_level`` 4 sees it (MLAS' int8 compute): per block
    of ``block`` values along the last axis (the last block partial, as if zero-padded),
    ``scale = max|x| / 127``, ``q = round_half_even(x · (1 / scale))`` (0 where the block is all
    zero), returned as ``q · scale`` float32. Matches ORT 1.32's CPU MatMulNBits to float rounding."""
    x = np.asarray(x, np.float32)
    D = x.shape[-1]
    nb = -(-D // block)
    xp = np.zeros(x.shape[:-1] + (nb * block,), np.float32)
    xp[..., :D] = x
    xb = xp.reshape(x.shape[:-1] + (nb, block))
    scale = (np.abs(xb).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    inv = np.where(scale > 0, np.float32(1) / safe, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv)
    return np.ascontiguousarray((q * scale).astype(np.float32).reshape(xp.shape)[..., :D])


def topk_indices(a: np.ndarray, C: int) -> np.ndarray:
    """Indices of the C largest entries of each row of ``a`` [M, V], largest first, ties to the
    lower index (ONNX TopK's order)."""
    order = np.lexsort((np.broadcast_to(np.arange(a.shape[-1]), a.shape), -a), axis=-1)
    return order[..., :C]


def cheap_head(h: np.ndarray, rows: np.ndarray, A: np.ndarray, B: np.ndarray, candidates: int,
               fill: str = "neginf", act_block: int | None = None) -> np.ndarray:
    """The rewritten head's logits. ``h`` [..., S, D]; ``rows`` [V, D] the exact weight rows (Wᵀ,
    float32, dequantized for a MatMulNBits head); ``A`` [D, r], ``B`` [r, V] the (dequantized)
    factors; ``candidates`` C; ``fill`` "neginf" | "approx" (module docstring); ``act_block``: the
    block of an int8-activation head (accuracy_level 4), None for float32 arithmetic."""
    if fill not in FILLS:
        raise ValueError(f"fill {fill!r}: one of {FILLS}")
    h = np.asarray(h, np.float32)
    rows = np.asarray(rows, np.float32)
    if h.shape[-2] != 1:
        return (h @ rows.T).astype(np.float32)
    lead = h.shape[:-2]
    V = rows.shape[0]
    x = h.reshape(-1, h.shape[-1])                                   # [M, D]
    a = ((x @ np.asarray(A, np.float32)) @ np.asarray(B, np.float32)).astype(np.float32)
    idx = topk_indices(a, min(int(candidates), V))                    # [M, C]
    xe = x if act_block is None else int8_activations(x, act_block)
    exact = np.einsum("mcd,md->mc", rows[idx], xe).astype(np.float32)
    out = a.copy() if fill == "approx" else np.full_like(a, -np.inf)
    np.put_along_axis(out, idx, exact, axis=-1)
    return out.reshape(*lead, 1, V)
