"""Numpy reference of TTMatMul: the normative definition of the op (see DEVELOPERS.md)."""
from __future__ import annotations

import numpy as np


def tt_full(cores: list[np.ndarray]) -> np.ndarray:
    """Dense W [K, N] represented by TT-matrix cores G_i [r_{i-1}, k_i, n_i, r_i]."""
    K = int(np.prod([c.shape[1] for c in cores]))
    eye = np.eye(K, dtype=np.float64)
    return tt_matmul(eye, cores)


def tt_matmul(x: np.ndarray, cores: list[np.ndarray], x_scale: np.ndarray | None = None) -> np.ndarray:
    """Y = (X * x_scale) @ W(cores), computed by sequential core contractions.

    X is [..., K]; the result has X's dtype (float32 stays float32; computation in float64 for
    float64 input so the reference is also an accurate oracle)."""
    x = np.asarray(x)
    out_dtype = x.dtype
    K = int(np.prod([c.shape[1] for c in cores]))
    N = int(np.prod([c.shape[2] for c in cores]))
    if x.shape[-1] != K:
        raise ValueError(f"TTMatMul: input last dim {x.shape[-1]} != prod(modes_k) {K}")
    lead = x.shape[:-1]
    work = np.float64
    s = x.reshape(-1, K).astype(work)
    if x_scale is not None:
        s = s * np.asarray(x_scale, dtype=work).reshape(1, K)
    # state S: [b, r_{i-1}, J_rest]; b = (m, o_1..o_{i-1})
    s = s.reshape(s.shape[0], 1, K)
    for c in cores:
        r0, k, n, r1 = c.shape
        b, ra, jrest = s.shape
        if ra != r0 or jrest % k:
            raise ValueError(f"TTMatMul: core shape {c.shape} does not chain with state {s.shape}")
        jr = jrest // k
        s4 = s.reshape(b, r0, k, jr)
        out = np.einsum("bajJ,ajnc->bncJ", s4, c.astype(work), optimize=True)  # [b, n, r1, jr]
        s = out.reshape(b * n, r1, jr)
    y = s.reshape(*lead, N)
    return y.astype(out_dtype)


def lowrank_cores(a: np.ndarray, b: np.ndarray) -> list[np.ndarray]:
    """Cores of the plain low-rank case W = A @ B (A [K, r], B [r, N]): d = 2,
    modes_k = [K, 1], modes_n = [1, N]."""
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    return [a[None, :, None, :].copy(), b[:, None, :, None].copy()]


def tt_params(cores: list[np.ndarray]) -> int:
    return int(sum(c.size for c in cores))


def op(x, g1, g2, g3=None, g4=None, x_scale=None, **attrs):
    """The op as ONNX Runtime calls it (custom_ops.schema: TTMatMul.reference)."""
    return tt_matmul(x, [c for c in (g1, g2, g3, g4) if c is not None], x_scale)
