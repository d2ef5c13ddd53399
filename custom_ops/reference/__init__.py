"""Numpy references of every ortlean op: the normative semantics, the oracle of the tests, and —
through onnxruntime-extensions (see `ext`) — a way to run any rewritten model without the C++
library: `custom_ops.session(model, backend="reference")`."""
from .tt import lowrank_cores, tt_full, tt_matmul, tt_params

__all__ = ["tt_matmul", "tt_full", "lowrank_cores", "tt_params", "OPS"]


def _tt_op(x, g1, g2, g3=None, g4=None, x_scale=None, **attrs):
    cores = [c for c in (g1, g2, g3, g4) if c is not None]
    return tt_matmul(x, cores, x_scale)


def _pa_op(q, k, v, mask=None, past_bits=None, **attrs):
    from .attn import packed_attention

    return packed_attention(q, k, v, mask, past_bits, **attrs)


# op_type → (callable(*inputs, **attributes), number of inputs incl. optional ones)
OPS = {
    "TTMatMul": (_tt_op, 6),
    "PackedAttention": (_pa_op, 5),
}
