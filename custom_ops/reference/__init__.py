"""Numpy references of every ortlean op: the normative semantics, the oracle of the tests, and —
through onnxruntime-extensions (see `ext`) — a way to run any rewritten model without the C++
library: `custom_ops.session(model, backend="reference")`."""
from .procsparse import hash_base, proc_full, proc_sparse_matmul
from .attn import packed_attention  # noqa: F401
from .tt import lowrank_cores, tt_full, tt_matmul, tt_params
from .gating import event_gated_matmul

__all__ = ["tt_matmul", "tt_full", "lowrank_cores", "tt_params", "OPS",
           "proc_sparse_matmul", "proc_full", "hash_base", "event_gated_matmul",
           "packed_attention"]


def _tt_op(x, g1, g2, g3=None, g4=None, x_scale=None, **attrs):
    cores = [c for c in (g1, g2, g3, g4) if c is not None]
    return tt_matmul(x, cores, x_scale)


def _gate_op(x, w, state=None, **attrs):
    import numpy as np

    y, st = event_gated_matmul(x, w, state, **attrs)
    if st is None:
        b = int(np.prod(x.shape[:-2])) if x.ndim >= 3 else int(np.prod(x.shape[:-1]))
        st = np.zeros((b, 0), np.float32)
    return y, st


def _pa_op(q, k, v, mask=None, past_bits=None, **attrs):
    from .attn import packed_attention

    return packed_attention(q, k, v, mask, past_bits, **attrs)


# op_type → (callable(*inputs, **attributes), number of inputs incl. optional ones
#            [, number of outputs incl. optional ones (default 1); callables then return a tuple])
OPS = {
    "TTMatMul": (_tt_op, 6),
    "ProcSparseMatMul": (proc_sparse_matmul, 5),
    "EventGatedMatMul": (_gate_op, 3, 2),
    "PackedAttention": (_pa_op, 5, 2),
}
