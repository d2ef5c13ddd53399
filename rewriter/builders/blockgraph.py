"""Graph surgery around BlockQuantMatMul / BlockQuantGather that the weights backend and its float path
share: a MatMul's bias Add, the new op taking the MatMul's place, an embedding Gather turned into
BlockQuantGather over a head's blocks, and W's row layout (``--weights-layout``: ggml's blocks, or
"split", the same bytes reordered within each row; ``custom_ops/reference/blockquant.py``)."""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from custom_ops.reference import blockquant as bq

from ..errors import OrtleanError
from ..kit import surgery

# --weights-layout: auto (split wherever the op takes it) | blocks (ggml's everywhere) | split (as auto,
# and an error when no layer takes it)
LAYOUT_CHOICES = ("auto", "blocks", "split")
_SPLIT_ROWS_BYTES = 64 << 20      # rows converted (and checked) per chunk: a 151k-row head is ~1 GB


def row_layout(choice: str, fmt: str, block_size: int | None, act_bits: int) -> tuple[str, str | None]:
    """(W's layout, why not "split") of a BlockQuantMatMul in ``fmt`` / ``block_size`` (``act_bits``: passed
    on to ``blockquant.split_refusal``, which takes every act_bits today) under --weights-layout ``choice``:
    "split" wherever ``split_refusal`` lets it (auto, split), else "blocks" and the refusal (None when
    ``choice`` is "blocks": nothing was refused)."""
    if choice == "blocks":
        return "blocks", None
    why = bq.split_refusal(fmt, block_size, act_bits)
    return ("blocks", why) if why else ("split", None)


def layout_bytes(W: np.ndarray, layout: str, fmt: str, K: int, block_size: int | None = None) -> np.ndarray:
    """The initializer's bytes of ggml blocks ``W`` [N, row_bytes] in ``layout``: W itself for "blocks";
    for "split" ``blockquant.to_split``, a chunk of rows at a time, each chunk checked to give W's bytes
    back (``from_split``) — so a split W dequantizes exactly as the blocks it was made of (raises
    ``OrtleanError`` otherwise: a bug, never written)."""
    if layout == "blocks":
        return W
    W = np.asarray(W)
    out = np.empty_like(W)
    step = max(1, _SPLIT_ROWS_BYTES // max(1, W.shape[1]))
    for lo in range(0, W.shape[0], step):
        hi = min(W.shape[0], lo + step)
        out[lo:hi] = bq.to_split(W[lo:hi], fmt, K, block_size)
        if not np.array_equal(bq.from_split(out[lo:hi], fmt, K, block_size), W[lo:hi]):
            raise OrtleanError(f"layout split of {fmt} rows {lo}..{hi - 1} (K = {K}) does not give the blocks "
                               "back byte for byte")
    return out


def layout_of(node: ir.Node) -> str:
    """A BlockQuantMatMul / BlockQuantGather node's ``layout`` (absent: "blocks")."""
    a = node.attributes.get("layout")
    return a.as_string() if a is not None else "blocks"


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


def _only_use(v: ir.Value) -> ir.Node | None:
    """The single consumer of ``v`` (None when it has several or is a graph output)."""
    uses = list(v.uses())
    return uses[0].node if len(uses) == 1 and not v.is_graph_output() else None


def _std(node: ir.Node, op: str) -> bool:
    return node.op_type == op and node.domain in ("", "ai.onnx")


def bias_add(node: ir.Node, N: int):
    """(Add node, bias value) when the MatMul's only consumer is an Add of a constant float32 [N]
    (either operand order) and the MatMul output is no graph output; else None."""
    out = node.outputs[0]
    add = _only_use(out)
    if add is None or not _std(add, "Add") or len(add.inputs) != 2:
        return None
    other = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
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
                   source: str, layer: str, block_size: int | None = None, layout: str = "blocks") -> None:
    """Replace the embedding ``gather`` by BlockQuantGather over the blocks ``w`` ([N rows of K]; q4_f's
    ``block_size``; ``layout``: w's row layout, a tied head's own when w is its initializer)."""
    qk = 8.0 * int(w.const_value.shape[1]) / K
    attrs = {"format": fmt, "K": K, "N": N, "layer": layer, "target": target, "source": source,
             "bits_per_weight": float(qk), "params_dense": K * N, "params_stored": K * N}
    if block_size is not None:
        attrs["block_size"] = int(block_size)
    if layout != "blocks":
        attrs["layout"] = layout
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


# --------------------------------------------------------------------------- the gated unit (glu = "silu")
def _silu_of(gate: ir.Value) -> tuple[list[ir.Node], ir.Value] | None:
    """The SiLU applied to ``gate`` and nothing else reading it: Sigmoid(g) and Mul(g, sigmoid) (either
    order), or com.microsoft QuickGelu(g) with alpha 1 → (its nodes, its output)."""
    uses = list(gate.uses())
    if gate.is_graph_output():
        return None
    if len(uses) == 1:
        q = uses[0].node
        alpha = q.attributes.get("alpha")
        if q.op_type == "QuickGelu" and q.domain == "com.microsoft" and (alpha is None or alpha.as_float() == 1.0):
            return [q], q.outputs[0]
        return None
    if len(uses) != 2:
        return None
    sig = next((u.node for u in uses if _std(u.node, "Sigmoid")), None)
    mul = next((u.node for u in uses if _std(u.node, "Mul")), None)
    if sig is None or mul is None or _only_use(sig.outputs[0]) is not mul:
        return None
    if {id(v) for v in mul.inputs} != {id(gate), id(sig.outputs[0])}:
        return None
    return [sig, mul], mul.outputs[0]


_SAME = ("format", "K", "N", "act_bits", "prefill_act_bits", "block_size")


def _bq_key(node: ir.Node) -> tuple | None:
    """What two BlockQuantMatMul must share to be one gated unit (None: not a plain one): the settings
    and W's row layout (rows are independent in both layouts: a split gate and a split up concatenate)."""
    if node.op_type != "BlockQuantMatMul" or node.domain != "ai.ortlean" or len(node.inputs) > 2:
        return None
    a = node.attributes
    if "glu" in a and a["glu"].as_string() != "none":
        return None
    if node.inputs[1] is None or node.inputs[1].const_value is None:
        return None
    return tuple(None if k not in a else a[k].value for k in _SAME) + (layout_of(node),)


def fuse_glu(graph: ir.Graph) -> list[str]:
    """Each SwiGLU MLP whose gate and up projections are BlockQuantMatMul of one input and one setting
    (format, K, N, act_bits, prefill_act_bits, block size, layout; no bias) → one BlockQuantMatMul with glu = "silu" over the
    gate's rows then the up projection's (copied, never re-quantized; whole rows, so either layout): Y = silu(gate) * up in the op.
    The product is the same numbers; the activation is the op's float32 SiLU instead of ONNX Runtime's
    (the exp differs in the last bits). Returns the fused gates' names."""
    import numpy as np

    done = []
    for gate in list(graph):
        key = _bq_key(gate)
        if key is None:
            continue
        silu = _silu_of(gate.outputs[0])
        if silu is None:
            continue
        act_nodes, act = silu
        mul = _only_use(act)
        if mul is None or not _std(mul, "Mul"):
            continue
        up_val = mul.inputs[1] if mul.inputs[0] is act else mul.inputs[0]
        up = up_val.producer() if up_val is not None else None
        if up is None or up is gate or _bq_key(up) != key or up.inputs[0] is not gate.inputs[0] \
                or _only_use(up.outputs[0]) is not mul:
            continue
        a = gate.attributes
        N = int(a["N"].as_int())
        Wg, Wu = gate.inputs[1], up.inputs[1]
        name = gate.name.replace("gate_proj", "gate_up_proj") if "gate_proj" in gate.name else f"{gate.name}_glu"
        w = surgery.initializer(graph, f"{surgery.safe_name(name)}.weight_blocks",
                                np.concatenate([Wg.const_value.numpy(), Wu.const_value.numpy()], axis=0))
        src = [n.attributes["source"].as_string() if "source" in n.attributes else "" for n in (gate, up)]
        pre = src[0].split(":", 1)[0] + ":" if ":" in src[0] else None
        if pre and src[1].startswith(pre):   # "gguf:a,gguf:b" → "gguf:a,b", as a concatenation's source reads
            src[1] = src[1][len(pre):]
        attrs = {k: v.value for k, v in a.items() if k not in ("N", "source", "params_dense", "params_stored")}
        attrs.update(N=2 * N, glu="silu")
        if any(src):
            attrs["source"] = ",".join(s for s in src if s)
        for k in ("params_dense", "params_stored"):
            if k in a and k in up.attributes:
                attrs[k] = int(a[k].as_int()) + int(up.attributes[k].as_int())
        node = surgery.op_node("BlockQuantMatMul", [gate.inputs[0], w], attrs, name=name)
        graph.insert_before(gate, node)
        old = mul.outputs[0]
        out_name = old.name
        node.outputs[0].type, node.outputs[0].shape = old.type, old.shape
        old.replace_all_uses_with(node.outputs[0], replace_graph_outputs=True)
        for n in (mul, *reversed(act_nodes), up, gate):
            graph.remove(n, safe=True)
        node.outputs[0].name = out_name
        surgery.drop_if_unused(graph, Wg)
        surgery.drop_if_unused(graph, Wu)
        done.append(gate.name)
    return done
