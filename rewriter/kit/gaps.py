"""The gap metrics every planner measures: relative output errors of a stored layer Ŵ against the
dense W on the calibration inputs, exact from their Gram matrix G = XᵀX (see DEVELOPERS.md,
"Planner conventions"): ‖X(W − Ŵ)‖_F / ‖XW‖_F = sqrt(tr(EᵀGE) / tr(WᵀGW))."""
from __future__ import annotations

import math

import numpy as np


def energy(E: np.ndarray, G: np.ndarray | None) -> float:
    """tr(EᵀGE) = ‖XE‖²_F on the calibration inputs (‖E‖²_F without calibration)."""
    if G is None:
        return float(np.einsum("kn,kn->", E, E))
    return float(np.einsum("kn,kn->", G @ E, E))


def output_gap(W: np.ndarray, W_hat: np.ndarray, G: np.ndarray | None) -> float:
    """Relative output error on calibration inputs (G = XᵀX); plain Frobenius error if G is None."""
    E = np.asarray(W, np.float64) - np.asarray(W_hat, np.float64)
    W = np.asarray(W, np.float64)
    if G is None:
        return float(np.linalg.norm(E) / max(np.linalg.norm(W), 1e-30))
    return math.sqrt(max(energy(E, G), 0.0) / max(energy(W, G), 1e-30))


def channel_gap(W: np.ndarray, W_hat: np.ndarray, G: np.ndarray | None) -> float:
    """RMS over output channels of each channel's relative error on the calibration inputs:
    sqrt(mean_n eₙᵀGeₙ / wₙᵀGwₙ). Unlike the Frobenius gap it cannot be met by reproducing only
    a few massive-activation channels (Llama down-projections: a rank-1 factor of layer 11 of
    SmolLM2 has a 2 % Frobenius gap and costs +11 % perplexity)."""
    W = np.asarray(W, np.float64)
    E = W - np.asarray(W_hat, np.float64)
    if G is None:
        num, den = np.sum(E * E, axis=0), np.sum(W * W, axis=0)
    else:
        num, den = np.sum((G @ E) * E, axis=0), np.sum((G @ W) * W, axis=0)
    ok = den > 1e-12 * max(float(den.max(initial=0.0)), 1e-300)
    if not ok.any():
        return 0.0
    return float(np.sqrt(np.mean(np.maximum(num[ok], 0.0) / den[ok])))


# columns per step of layer_gap: its float64 temporaries stay near 64 MiB whatever the layer's size
# (an lm_head of 1536 x 151936 in float64 is 1.9 GB per array)
GAP_CHUNK_BYTES = 64 << 20


def layer_gap(W: np.ndarray, W_hat, G: np.ndarray | None) -> float:
    """The gap a layer must meet: the larger of the Frobenius and the channel-averaged relative
    output errors on the calibration inputs — ``max(output_gap, channel_gap)``, computed a block
    of output columns at a time from each column's error and weight energies. ``W_hat`` may be an
    array or anything whose ``[:, j0:j1]`` gives those columns (e.g. ``rewriter.quantize``'s
    dequantized view): the full Ŵ and the float64 copies are never made."""
    K, N = W.shape
    step = max(1, GAP_CHUNK_BYTES // max(8 * K, 1))
    num = np.empty(N, np.float64)
    den = np.empty(N, np.float64)
    for j in range(0, N, step):
        w = np.asarray(W[:, j: j + step], np.float64)
        e = w - np.asarray(W_hat[:, j: j + step], np.float64)
        if G is None:
            num[j: j + step] = np.einsum("kn,kn->n", e, e)
            den[j: j + step] = np.einsum("kn,kn->n", w, w)
        else:
            num[j: j + step] = np.einsum("kn,kn->n", G @ e, e)
            den[j: j + step] = np.einsum("kn,kn->n", G @ w, w)
    if G is None:
        out = math.sqrt(max(float(num.sum()), 0.0)) / max(math.sqrt(max(float(den.sum()), 0.0)), 1e-30)
    else:
        out = math.sqrt(max(float(num.sum()), 0.0) / max(float(den.sum()), 1e-30))
    ok = den > 1e-12 * max(float(den.max(initial=0.0)), 1e-300)
    ch = float(np.sqrt(np.mean(np.maximum(num[ok], 0.0) / den[ok]))) if ok.any() else 0.0
    return max(out, ch)


def layer_gaps(W: np.ndarray, W_hats: list, G: np.ndarray | None) -> list[float]:
    """:func:`layer_gap` of several stored versions of one layer, sharing the work that does not depend on
    Ŵ (G·W and its energies): one K×K product per Ŵ and column block instead of two; a block of output
    columns at a time, as :func:`layer_gap`."""
    K, N = W.shape
    step = max(1, GAP_CHUNK_BYTES // max(8 * K, 1))
    den = np.empty(N, np.float64)
    num = np.empty((len(W_hats), N), np.float64)
    for j in range(0, N, step):
        w = np.asarray(W[:, j: j + step], np.float64)
        den[j: j + step] = np.einsum("kn,kn->n", w if G is None else G @ w, w)
        for i, Wh in enumerate(W_hats):
            e = w - np.asarray(Wh[:, j: j + step], np.float64)
            num[i, j: j + step] = np.einsum("kn,kn->n", e if G is None else G @ e, e)
    tot = max(float(den.sum()), 1e-30)
    ok = den > 1e-12 * max(float(den.max(initial=0.0)), 1e-300)
    out = []
    for col_e in num:
        frob = math.sqrt(max(float(col_e.sum()), 0.0) / tot)
        chan = float(np.sqrt(np.mean(np.maximum(col_e[ok], 0.0) / den[ok]))) if ok.any() else 0.0
        out.append(max(frob, chan))
    return out
