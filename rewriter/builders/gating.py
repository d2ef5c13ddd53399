"""EventGatedMatMul's offline statistics: calibration activations sampled per layer and, per keep
ratio, the TEAL threshold on the score |x_k|·‖W_k‖ with the output error it costs (the planner
that spends the quality budget on them is backends/gating.py)."""
from __future__ import annotations

import numpy as np

KEEP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2)


class Samples:
    """Up to `rows` calibration rows per captured value (evenly strided over the calibration run)."""

    def __init__(self, names, rows: int, total_rows_hint: int):
        self.names = set(names)
        self.rows = rows
        self.stride = max(1, total_rows_hint // rows)
        self.data: dict[str, list[np.ndarray]] = {}
        self.seen: dict[str, int] = {}

    def __call__(self, name: str, x: np.ndarray) -> None:
        if name not in self.names:
            return
        s = self.seen.get(name, 0)
        idx = np.arange((-s) % self.stride, x.shape[0], self.stride)
        self.seen[name] = s + x.shape[0]
        if idx.size:
            have = sum(a.shape[0] for a in self.data.get(name, []))
            idx = idx[: max(0, self.rows - have)]
            if idx.size:
                self.data.setdefault(name, []).append(np.ascontiguousarray(x[idx], dtype=np.float32))

    def get(self, name: str) -> np.ndarray | None:
        d = self.data.get(name)
        return np.concatenate(d, 0) if d else None


def layer_curve(X: np.ndarray, W: np.ndarray, score: str = "xw", grid=KEEP_GRID) -> list[dict]:
    """For each keep ratio p: TEAL threshold τ (quantile of the calibration scores) and the
    relative output error of gating the rows X with it."""
    norms = np.linalg.norm(W.astype(np.float64), axis=1).astype(np.float32)
    S = np.abs(X) * (norms[None, :] if score == "xw" else 1.0)
    Y = X @ W
    ny = float(np.linalg.norm(Y)) or 1.0
    flat = np.sort(S.ravel())
    out = []
    for p in grid:
        if p >= 1.0:
            out.append({"keep": 1.0, "threshold": 0.0, "gap": 0.0, "measured_keep": 1.0})
            continue
        q = int(min(len(flat) - 1, max(0, round((1 - p) * len(flat)))))
        thr = float(flat[q])
        drop = S <= thr
        D = np.where(drop, X, 0.0).astype(np.float32)
        gap = float(np.linalg.norm(D @ W)) / ny
        out.append({"keep": p, "threshold": thr, "gap": gap, "measured_keep": float(1.0 - drop.mean())})
    return out


def pick(curve: list[dict], g: float) -> dict:
    """The smallest keep ratio whose gap ≤ g (keep 1.0 when none)."""
    best = curve[0]
    for c in curve:
        if c["gap"] <= g and c["keep"] < best["keep"]:
            best = c
    return best
