"""Numpy references of every ortlean op: the normative semantics, the oracle of the tests, and —
through onnxruntime-extensions (see `ext`) — a way to run any rewritten model without the C++
library: `custom_ops.session(model, backend="reference")`. Which function implements which op is
written in the op's schema (`custom_ops.schema`, field `reference`)."""
from .attn import packed_attention
from .gating import event_gated_matmul
from .procsparse import hash_base, proc_full, proc_sparse_matmul
from .tt import lowrank_cores, tt_full, tt_matmul, tt_params

__all__ = ["tt_matmul", "tt_full", "lowrank_cores", "tt_params", "proc_sparse_matmul", "proc_full", "hash_base",
           "event_gated_matmul", "packed_attention"]
