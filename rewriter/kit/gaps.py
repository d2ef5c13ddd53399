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


def layer_gap(W: np.ndarray, W_hat: np.ndarray, G: np.ndarray | None) -> float:
    """The gap a layer must meet: the larger of the Frobenius and the channel-averaged relative
    output errors on the calibration inputs."""
    return max(output_gap(W, W_hat, G), channel_gap(W, W_hat, G))
