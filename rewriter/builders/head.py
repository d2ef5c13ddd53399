"""Offline math and matching for the cheap head (``backends/head.py``): which node is the model's
head and where its exact rows live, and the whitened low-rank factor of the head.

The factor minimises the calibration output error ‖X(W − A·B)‖ (``G = XᵀX``, ``R`` its
whitening, ``RᵀR = G``): ``R·W = U S Vᵀ``, ``A = R⁻¹ U_r S_r^½``, ``B = S_r^½ V_rᵀ`` (the singular
values split between the factors so ``B``'s blocks along r have similar magnitudes before they are
quantized to MatMulNBits int4/int8)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from custom_ops import schema
from custom_ops.reference import blockquant as bq
from custom_ops.reference.head import dequant_nbits, quant_nbits, topk_indices

from ..kit import candidates
from .tt import whitening

NBITS_BLOCK = 32      # block of the factor B along r (MatMulNBits block_size)


@dataclass
class HeadMatch:
    """The head: ``y = x · W`` whose output ``y`` is the graph output ``logits``."""
    node: ir.Node
    x: ir.Value                  # the head's input [.., S, D]
    y: ir.Value                  # the logits graph output
    D: int
    V: int
    kind: str                    # "matmul" | "nbits" | "blockquant"
    W: np.ndarray                # float32 [D, V] (dequantized for MatMulNBits / BlockQuantMatMul)
    rows: ir.Value | None        # an initializer holding Wᵀ [V, D] exactly (tied embedding / transposed weight)
    nbits: dict | None = None    # MatMulNBits head: blob, scales, zero_points (ir.Value), bits, block
    blocks: dict | None = None   # BlockQuantMatMul head: W (ir.Value, its blocks), attrs (format, K, N, block_size, layout)

    @property
    def rows_array(self) -> np.ndarray:
        """Wᵀ [V, D] float32, the rows the candidates' exact logits use."""
        return np.ascontiguousarray(self.W.T)


def _attr(node: ir.Node, name: str, default=None):
    a = node.attributes.get(name)
    return default if a is None else a.value


def _const(v: ir.Value | None) -> np.ndarray | None:
    if v is None or not v.is_initializer() or v.const_value is None:
        return None
    return v.const_value.numpy()


def find_head(model: ir.Model) -> tuple[HeadMatch | None, str]:
    """(the head, "") or (None, why no head is recognised)."""
    g = model.graph
    outs = {o.name: o for o in g.outputs}
    y = outs.get("logits")
    if y is None:
        return None, f"no graph output named 'logits' (outputs: {', '.join(list(outs)[:4])})"
    node = y.producer()
    if node is None:
        return None, "'logits' is not produced by a node"
    if node.op_type == "MatMul" and node.domain in ("", "ai.onnx"):
        cand = next((c for c in candidates.find_candidates(model) if c.node is node), None)
        if cand is None:
            return None, f"'logits' comes from MatMul {node.name!r} whose weight is not a constant float32 initializer"
        W = cand.weight_array()
        rows = cand.weight if cand.transposed else _tied_rows(g, W)
        return HeadMatch(node, node.inputs[0], y, cand.K, cand.N, "matmul", W, rows), ""
    if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
        K, N = _attr(node, "K"), _attr(node, "N")
        bits, block = _attr(node, "bits", 4), _attr(node, "block_size")
        blob, scales = _const(node.inputs[1]), _const(node.inputs[2])
        zp_v = node.inputs[3] if len(node.inputs) > 3 else None
        zp = _const(zp_v)
        extra = [v for v in node.inputs[4:] if v is not None]
        if blob is None or scales is None or (zp_v is not None and zp is None) or extra:
            return None, f"'logits' comes from MatMulNBits {node.name!r} with non-constant weights or g_idx/bias inputs"
        if bits not in (4, 8) or blob.dtype != np.uint8 or zp is not None and zp.dtype != np.uint8:
            return None, f"'logits' comes from MatMulNBits {node.name!r} with bits={bits} (4 and 8 are supported)"
        W = dequant_nbits(blob, scales, zp, K, bits, block)
        return HeadMatch(node, node.inputs[0], y, K, N, "nbits", W, None,
                         nbits=dict(blob=node.inputs[1], scales=node.inputs[2], zero_points=zp_v, zp=zp,
                                    bits=bits, block=block)), ""
    if node.op_type == "BlockQuantMatMul" and node.domain == schema.DOMAIN:
        Wv = node.inputs[1]
        blob = _const(Wv)
        if blob is None or (len(node.inputs) > 2 and node.inputs[2] is not None):
            return None, f"'logits' comes from BlockQuantMatMul {node.name!r} with non-constant blocks or a bias"
        if str(_attr(node, "glu", "none")) != "none":
            return None, f"'logits' comes from BlockQuantMatMul {node.name!r} with glu (not a head)"
        a = {k: _attr(node, k) for k in ("format", "K", "N", "block_size", "layout")}
        a = {k: v for k, v in a.items() if v is not None}
        fmt, K, N, bs = str(a["format"]), int(a["K"]), int(a["N"]), a.get("block_size")
        rows = bq.from_split(blob, fmt, K, bs) if a.get("layout", "blocks") == "split" else blob
        W = np.ascontiguousarray(bq.dequantize(rows, fmt, K, bs).T)       # [K, N] = [D, V]
        return HeadMatch(node, node.inputs[0], y, K, N, "blockquant", W, None, blocks=dict(W=Wv, attrs=a)), ""
    return None, f"'logits' comes from {node.op_type} {node.name!r}, not a MatMul/MatMulNBits/BlockQuantMatMul head"


def _tied_rows(graph: ir.Graph, W: np.ndarray) -> ir.Value | None:
    """An initializer equal to Wᵀ (the tied embedding table), if the model has one."""
    D, V = W.shape
    for v in graph.initializers.values():
        t = v.const_value
        if t is None or tuple(t.shape) != (V, D) or t.dtype != ir.DataType.FLOAT:
            continue
        if np.array_equal(t.numpy(), W.T):
            return v
    return None


@dataclass
class LowRankHead:
    A: np.ndarray          # float32 [D, r]
    blob: np.ndarray       # B in MatMulNBits layout, uint8 [V, nb, block·bits/8]
    scales: np.ndarray     # float32 [V·nb]
    B: np.ndarray          # B dequantized, float32 [r, V] (what the graph computes with)
    rank: int
    bits: int
    gap: float             # relative calibration output error of A·B (quantized)


_COLS = 16384          # columns of W (vocabulary entries) per chunk of the factor's math
_ROWS = 256            # calibration rows per chunk of candidate_recall


def lowrank_head(W: np.ndarray, G: np.ndarray, rank: int, bits: int) -> LowRankHead:
    """The whitened rank-``rank`` factor of ``W`` [D, V], ``B`` quantized to ``bits``. The SVD of
    ``M = R·W`` [D, V] comes from the eigenvectors of ``M·Mᵀ`` [D, D] (float64, W read in chunks of
    columns): a 262,144-entry vocabulary never holds more than a chunk of M, where a full SVD's
    workspace of a [640, 262,144] float64 matrix took minutes and ~15 GB (Gemma 3)."""
    D, V = W.shape
    R = whitening(G)
    K = np.zeros((D, D))
    for c in range(0, V, _COLS):
        Mc = R @ np.asarray(W[:, c:c + _COLS], np.float64)
        K += Mc @ Mc.T
    ev, U = np.linalg.eigh(K)
    order = np.argsort(ev)[::-1]
    s = np.sqrt(np.clip(ev[order], 0.0, None))
    U = U[:, order]
    r = int(min(rank, D, V))
    sq = np.sqrt(s[:r])
    A = np.linalg.solve(R, U[:, :r] * sq).astype(np.float32)
    # B = S_r^½ V_rᵀ = S_r^-½ U_rᵀ R W (a zero singular value: a zero row)
    inv = np.where(sq > 0, 1.0 / np.where(sq > 0, sq, 1.0), 0.0)
    P = (U[:, :r].T @ R) * inv[:, None]                                  # [r, D]
    Bf = np.empty((r, V), np.float32)
    for c in range(0, V, _COLS):
        Bf[:, c:c + _COLS] = P @ np.asarray(W[:, c:c + _COLS], np.float64)
    blob, scales = quant_nbits(Bf, bits, NBITS_BLOCK)
    del Bf
    B = dequant_nbits(blob, scales, None, r, bits, NBITS_BLOCK)
    A64, num, den = A.astype(np.float64), 0.0, 0.0
    for c in range(0, V, _COLS):
        Wc = np.asarray(W[:, c:c + _COLS], np.float64)
        Ec = Wc - A64 @ np.asarray(B[:, c:c + _COLS], np.float64)
        num += float(np.einsum("ij,ij->", Ec, G @ Ec))
        den += float(np.einsum("ij,ij->", Wc, G @ Wc))
    gap = float(np.sqrt(max(num, 0.0) / max(den, 1e-300)))
    return LowRankHead(A, blob, scales, B, r, bits, gap)


def candidate_recall(X: np.ndarray, W: np.ndarray, A: np.ndarray, B: np.ndarray, C: int) -> float:
    """Share of rows of ``X`` whose exact argmax is among the ``C`` candidates of the approximate
    logits — the greedy agreement of the cheap head with the exact one on those rows. Membership
    without sorting: the exact token e is a candidate when fewer than C entries rank above it (larger,
    or equal at a lower index: ONNX TopK's order, custom_ops.reference.head.topk_indices). Rows in
    chunks (a chunk's [rows, V] logits at a time)."""
    X = np.asarray(X, np.float32)
    if len(X) == 0:
        return float("nan")
    V = W.shape[1]
    cols = np.arange(V)
    hit = 0
    for i in range(0, len(X), _ROWS):
        Xi = X[i:i + _ROWS]
        exact = (Xi @ W).argmax(axis=1)
        a = (Xi @ A) @ B
        ae = a[np.arange(len(Xi)), exact][:, None]
        above = (a > ae).sum(axis=1) + ((a == ae) & (cols[None, :] < exact[:, None])).sum(axis=1)
        hit += int((above < min(C, V)).sum())
    return hit / len(X)
