"""Graph surgery around BlockQuantMatMul / BlockQuantGather that the weights backend and its float path
share: a MatMul's bias Add, the new op taking the MatMul's place, an embedding Gather turned into
BlockQuantGather over a head's blocks."""
from __future__ import annotations

import onnx_ir as ir

from ..kit import surgery


def embedding_table(node: ir.Node) -> ir.Value | None:
    """The constant float32 [V, D] table of an embedding Gather (axis 0, indices computed at run time)."""
    if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    axis = node.attributes.get("axis")
    t, idx = node.inputs
    if (axis is not None and axis.as_int() != 0) or t is None or t.const_value is None or idx is None:
        return None
    if idx.const_value is not None or len(t.const_value.shape) != 2 or t.const_value.dtype != ir.DataType.FLOAT:
        return None
    return t


def bias_add(node: ir.Node, N: int):
    """(Add node, bias value) when the MatMul's only consumer is an Add of a constant float32 [N]
    (either operand order) and the MatMul output is no graph output; else None."""
    out = node.outputs[0]
    uses = list(out.uses())
    if out.is_graph_output() or len(uses) != 1:
        return None
    add = uses[0].node
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.inputs) != 2:
        return None
    other = add.inputs[1 - uses[0].idx]
    if other is None or other.const_value is None or not other.is_initializer():
        return None
    c = other.const_value
    if c.dtype != ir.DataType.FLOAT or [int(d) for d in c.shape] not in ([N], [1, N], [1, 1, N]):
        return None
    return add, other


def take_over(graph: ir.Graph, node: ir.Node, add, out: ir.Value) -> None:
    """``out`` takes the place of the MatMul's output (of its bias Add's when folded); the MatMul,
    the Add and the weights nothing else uses go."""
    old = add[0].outputs[0] if add is not None else node.outputs[0]
    name = old.name
    out.type, out.shape = old.type, old.shape
    old.replace_all_uses_with(out, replace_graph_outputs=True)
    if add is not None:
        graph.remove(add[0], safe=True)
        surgery.drop_if_unused(graph, add[1])
    weight_in = node.inputs[1]
    graph.remove(node, safe=True)
    surgery.drop_if_unused(graph, weight_in)
    out.name = name


def gather_blocks(graph: ir.Graph, gather: ir.Node, w: ir.Value, fmt: str, K: int, N: int, target: str,
                   source: str, layer: str, block_size: int | None = None) -> None:
    """Replace the embedding ``gather`` by BlockQuantGather over the blocks ``w`` ([N rows of K]; q4_f's
    ``block_size``)."""
    qk = 8.0 * int(w.const_value.shape[1]) / K
    attrs = {"format": fmt, "K": K, "N": N, "layer": layer, "target": target, "source": source,
             "bits_per_weight": float(qk), "params_dense": K * N, "params_stored": K * N}
    if block_size is not None:
        attrs["block_size"] = int(block_size)
    node = surgery.op_node("BlockQuantGather", [w, gather.inputs[1]], attrs, name=f"{gather.name}_BQ")
    graph.insert_before(gather, node)
    table = gather.inputs[0]
    old = gather.outputs[0]
    name = old.name
    node.outputs[0].type, node.outputs[0].shape = old.type, old.shape
    old.replace_all_uses_with(node.outputs[0], replace_graph_outputs=True)
    graph.remove(gather, safe=True)
    node.outputs[0].name = name
    surgery.drop_if_unused(graph, table)
