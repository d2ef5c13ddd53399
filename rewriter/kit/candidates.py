"""The units a weight backend plans: weight MatMuls (a MatMul whose B is a constant float
initializer, or a Transpose of one) classified attn | mlp | head from the graph structure (names
are only a tie-breaking hint), and groups of them planned as one unit."""
from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from custom_ops.schema import DOMAIN

from ..errors import OrtleanError


@dataclass
class Candidate:
    node: ir.Node
    name: str
    weight: ir.Value            # the initializer holding W (or W^T when transposed)
    transposed: bool            # B = Transpose(weight)
    K: int
    N: int
    target: str                 # attn | mlp | head
    role: str                   # q/k/v/o/gate/up/down/fc1/fc2/head/? (best effort)
    layer: int | None           # transformer block index when it can be told
    how: str                    # "structure" | "name"
    input: ir.Value = field(repr=False, default=None)

    def weight_array(self) -> np.ndarray:
        w = np.asarray(self.weight.const_value.numpy(), dtype=np.float32)
        return np.ascontiguousarray(w.T if self.transposed else w)

    @property
    def params(self) -> int:
        return self.K * self.N

    @property
    def label(self) -> str:
        """The node's `layer` attribute: the block index, else the target."""
        return str(self.layer) if self.layer is not None else self.target

    def rebind(self, nodes: dict[int, ir.Node], graph: ir.Graph) -> "Candidate":
        """The same candidate in a clone of its model: `nodes` maps id(original node) → clone."""
        node = nodes[id(self.node)]
        return dataclasses.replace(self, node=node, weight=graph.initializers[self.weight.name], input=node.inputs[0])


_SHAPE_OPS = {"Reshape", "Transpose", "Identity", "Cast", "Squeeze", "Unsqueeze", "Flatten"}
_ACT_OPS = {"Relu", "Gelu", "Sigmoid", "Tanh", "Erf", "FastGelu", "BiasGelu", "QuickGelu", "Elu", "Selu",
            "LeakyRelu", "Softplus", "HardSigmoid", "HardSwish", "Mish"}
_NORM_OPS = {"LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
             "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization", "RMSNormalization", "ReduceMean",
             "Pow", "Sqrt"}
# fused attention cores (ONNX Runtime contrib ops, ONNX 23 Attention, ortlean's PackedAttention): a weight
# MatMul feeding one is q/k/v (or packed qkv), one reading its output is o
_ATTN_CORE_OPS = {"GroupQueryAttention", "MultiHeadAttention", "Attention", "PackedAttention",
                  "PackedMultiHeadAttention", "SparseAttention", "DecoderMaskedMultiHeadAttention",
                  "DecoderMaskedSelfAttention", "QAttention", "LongformerAttention"}
# ops holding an already quantized weight (no backend takes it): op → index of the weight input
_QUANTIZED_OPS = {"MatMulNBits": 1, "MatMulBnb4": 1, "MatMulFpQ4": 1, "MatMulInteger": 1, "QLinearMatMul": 3,
                  "DynamicQuantizeMatMul": 1, "MatMulIntegerToFloat": 1, "QOrderedMatMul": 4,
                  "GatherBlockQuantized": 0}
# fused ops that carry their projection weights inside: op → index of the weight input
_FUSED_WEIGHT_OPS = {"Attention": 1, "QAttention": 1, "Gemm": 1, "FusedMatMul": 1, "FusedGemm": 1}


def _weight_of(node: ir.Node) -> tuple[ir.Value, bool] | None:
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    b = node.inputs[1]
    if b is None:
        return None
    if b.is_initializer() and b.const_value is not None:
        return b, False
    prod = b.producer()
    if prod is not None and prod.op_type == "Transpose" and prod.domain in ("", "ai.onnx"):
        src = prod.inputs[0]
        perm = prod.attributes.get("perm")
        perm = list(perm.as_ints()) if perm is not None else [1, 0]
        if src is not None and src.is_initializer() and src.const_value is not None and perm == [1, 0]:
            return src, True
    return None


def _is_weight_matmul(node: ir.Node) -> bool:
    return _weight_of(node) is not None


def _is_weight_layer(node: ir.Node) -> bool:
    """A weight MatMul, or an op standing for one (already quantized, or a fused op with its weight)."""
    return _is_weight_matmul(node) or (node.op_type in _QUANTIZED_OPS and node.op_type != "GatherBlockQuantized"
                                       and _const_input(node, _QUANTIZED_OPS[node.op_type]) is not None) or (
        node.op_type in _FUSED_WEIGHT_OPS and _const_input(node, _FUSED_WEIGHT_OPS[node.op_type]) is not None)


def _const_input(node: ir.Node, idx: int) -> ir.Value | None:
    v = node.inputs[idx] if idx < len(node.inputs) else None
    return v if v is not None and v.is_initializer() and v.const_value is not None else None


def _is_attn_core(node: ir.Node) -> bool:
    return node.op_type in _ATTN_CORE_OPS and node.domain not in ("", "ai.onnx") or (
        node.op_type == "Attention" and node.domain in ("", "ai.onnx"))


def _is_act_matmul(node: ir.Node) -> bool:
    """MatMul of two activations (QK^T or attn·V)."""
    return node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and not _is_weight_matmul(node)


def _consumers(v: ir.Value) -> list[ir.Node]:
    return [u.node for u in v.uses()]


def _walk(start: list, step, limit: int):
    """Breadth-first (node, depth) from `start` [(node, 1)], `step(node)` giving the next nodes; weight
    MatMuls are reached but not crossed."""
    seen: set[int] = set()
    q = deque(start)
    while q:
        n, depth = q.popleft()
        if n is None or id(n) in seen or depth > limit:
            continue
        seen.add(id(n))
        yield n, depth
        if _is_weight_layer(n):
            continue
        q.extend((m, depth + 1) for m in step(n))


def _downstream(node: ir.Node, limit: int = 40):
    """Nodes reachable from node's outputs, stopping at weight MatMuls (not crossed)."""
    def consumers(n: ir.Node) -> list[ir.Node]:
        return [c for o in n.outputs for c in _consumers(o)]

    return _walk([(c, 1) for c in consumers(node)], consumers, limit)


def _upstream(v: ir.Value, limit: int = 12):
    def producers(n: ir.Node) -> list[ir.Node | None]:
        return [i.producer() for i in n.inputs if i is not None and not i.is_initializer()]

    return _walk([(v.producer(), 1)], producers, limit)


def _reaches_output_plainly(node: ir.Node) -> bool:
    """Output reaches a graph output through shape ops / bias Add only (a head projection)."""
    frontier = list(node.outputs)
    seen = set()
    while frontier:
        v = frontier.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if v.is_graph_output():
            return True
        for c in _consumers(v):
            if c.op_type in _SHAPE_OPS or (c.op_type == "Add" and any(i is not None and i.is_initializer() for i in c.inputs)):
                frontier.extend(c.outputs)
    return False


_NAME_HINTS = [
    (re.compile(r"lm_head|classifier|\bhead\b"), "head", "head"),
    (re.compile(r"q_proj|query"), "attn", "q"),
    (re.compile(r"k_proj|\bkey\b|\.key"), "attn", "k"),
    (re.compile(r"v_proj|value"), "attn", "v"),
    (re.compile(r"o_proj|out_proj|attention\.output|attn.*dense|self_attn"), "attn", "o"),
    (re.compile(r"gate_proj"), "mlp", "gate"),
    (re.compile(r"up_proj"), "mlp", "up"),
    (re.compile(r"down_proj"), "mlp", "down"),
    (re.compile(r"fc1|intermediate"), "mlp", "fc1"),
    (re.compile(r"fc2|\.output\.dense|mlp"), "mlp", "fc2"),
]
_LAYER_RE = re.compile(r"(?:layers?|h|blocks?)[._/](\d+)[._/]")


def _layer_index(name: str) -> int | None:
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def _classify(node: ir.Node, K: int, N: int) -> tuple[str, str, str]:
    """(target, role, how)."""
    down = list(_downstream(node))
    up = list(_upstream(node.inputs[0]))
    down_ops = [n for n, _ in down]
    # q/k/v: output flows (via reshape/rope/…) into a MatMul of two activations before any other weight MatMul
    act_mm_down = [n for n, d in down if _is_act_matmul(n)]
    softmax_down = any(n.op_type == "Softmax" for n, d in down if d <= 4)
    weight_mm_down = [n for n, d in down if _is_weight_layer(n)]
    hint = _name_hint(node)
    if _reaches_output_plainly(node) and not any(n.op_type in _NORM_OPS for n in down_ops[:3]):
        # the last projection before a graph output (lm_head / classifier)
        if not act_mm_down:
            return "head", "head", "structure"
    # a fused attention core: o reads its output, q/k/v (or packed qkv) feed it
    for n, d in up:
        if _is_attn_core(n) and d <= 4:
            return "attn", "o", "structure"
        if _is_weight_layer(n):
            break
    core = next(((n, d) for n, d in down if _is_attn_core(n) and d <= 5), None)
    if core is not None and (not weight_mm_down or core[1] < _first_depth(down, weight_mm_down[0])):
        return "attn", _core_role(node, core[0], down), "structure"
    # o-proj: input comes from attn·V (MatMul of activations fed by Softmax)
    for n, d in up:
        if _is_weight_layer(n):
            break
        if _is_act_matmul(n) and d <= 5 and _softmax_fed(n):
            return "attn", "o", "structure"
    if act_mm_down and (not weight_mm_down or _first_depth(down, act_mm_down[0]) < _first_depth(down, weight_mm_down[0])):
        role = hint[1] if hint and hint[0] == "attn" and hint[1] in "qkv" else _qkv_role(node, down)
        return "attn", role, "structure"
    if softmax_down:
        return "attn", "?", "structure"
    # MLP: an elementwise nonlinearity right after (gate/up/fc1) or right before (down/fc2)
    near_down = [n for n, d in down if d <= 3]
    if any(n.op_type in _ACT_OPS for n in near_down) or any(
        n.op_type == "Mul" and _mul_of_two_projections(n) for n in near_down
    ):
        role = hint[1] if hint and hint[0] == "mlp" and hint[1] in ("gate", "up", "fc1") else ("gate" if any(n.op_type == "Sigmoid" for n in near_down) else "up")
        if any(n.op_type in ("Gelu", "Erf", "Relu", "FastGelu", "Tanh") for n in near_down) and not any(n.op_type == "Sigmoid" for n in near_down):
            role = "fc1"
        return "mlp", role, "structure"
    near_up = [n for n, d in up if d <= 4]
    if any(n.op_type in _ACT_OPS for n in near_up) or any(n.op_type == "Mul" and _mul_of_two_projections(n) for n in near_up):
        role = "down" if any(n.op_type == "Sigmoid" for n in near_up) or any(n.op_type == "Mul" and _mul_of_two_projections(n) for n in near_up) else "fc2"
        if hint and hint[0] == "mlp" and hint[1] in ("down", "fc2"):
            role = hint[1]
        return "mlp", role, "structure"
    if hint:
        return hint[0], hint[1], "name"
    return "mlp", "?", "default"


def _core_role(node: ir.Node, core: ir.Node, down) -> str:
    """Which input of a fused attention core the projection feeds: 0 query (packed qkv when the
    key and value inputs are absent), 1 key, 2 value."""
    vals = {id(o) for o in node.outputs} | {id(o) for n, d in down for o in n.outputs if n is not core}
    idx = [i for i, v in enumerate(core.inputs[:3]) if v is not None and id(v) in vals]
    if not idx:
        return "?"
    if idx[0] == 0:
        packed = all(v is None or v.name == "" for v in core.inputs[1:3]) if core.op_type != "Attention" else False
        return "qkv" if packed else "q"
    return "k" if idx[0] == 1 else "v"


def _first_depth(down, node) -> int:
    for n, d in down:
        if n is node:
            return d
    return 1 << 30


def _qkv_role(node: ir.Node, down) -> str:
    # k goes through a Transpose into the QK^T MatMul as its second input, v is the second input of attn·V
    for n, d in down:
        if _is_act_matmul(n):
            return "v" if _softmax_fed(n) else "q|k"
    return "?"


# between Softmax and the attn·V MatMul: casts, dropout, and the NaN guard Where(IsNaN(p), 0, p)
# (optimum and torch-dynamo exports)
_PROB_OPS = {"Cast", "Dropout", "Where", "IsNaN", "Identity"}


def _softmax_fed(mm: ir.Node, hops: int = 3) -> bool:
    """An activation MatMul whose input comes from a Softmax (within `hops` of _PROB_OPS): attn·V."""
    frontier = [i.producer() for i in mm.inputs if i is not None]
    for _ in range(hops):
        nxt = []
        for p in frontier:
            if p is None:
                continue
            if p.op_type == "Softmax":
                return True
            if p.op_type in _PROB_OPS:
                nxt += [i.producer() for i in p.inputs if i is not None]
        frontier = nxt
    return False


def _mul_of_two_projections(mul: ir.Node) -> bool:
    """SwiGLU: Mul(act(gate), up) — both sides come from weight MatMuls within a few hops."""
    hits = 0
    for i in mul.inputs:
        if i is None:
            continue
        for n, d in _upstream(i, limit=4):
            if _is_weight_layer(n):
                hits += 1
                break
    return hits == 2


def _name_hint(node: ir.Node):
    name = (node.name or "") + " " + " ".join(v.name or "" for v in node.inputs if v is not None)
    name = name.lower()
    for rx, target, role in _NAME_HINTS:
        if rx.search(name):
            return target, role
    return None


def _unsupported(w: ir.Value) -> str | None:
    """Why the backends cannot take this weight (None: a 2-D float32 initializer, they can)."""
    shape, dtype = w.const_value.shape, w.const_value.dtype
    if dtype != ir.DataType.FLOAT:
        return f"weight {w.name} is {dtype.name.lower()}, not float32"
    if len(shape) != 2:
        return f"weight {w.name} has shape {list(shape)}, not [K, N]"
    return None


@dataclass
class Unsupported:
    """A weight layer no backend can take, and why (one report row): a MatMul whose constant B is
    not a 2-D float32 weight, a weight already quantized (MatMulNBits …), or the weight of a fused
    op (com.microsoft Attention's packed QKV, Gemm)."""
    node: ir.Node
    name: str
    weight: ir.Value
    why: str
    shape: list | None = None       # [K, N] when the stored weight's shape is not it (packed, quantized)


def node_name(node: ir.Node) -> str:
    return node.name or f"{node.op_type}_{node.outputs[0].name}"


def _quantized_why(node: ir.Node) -> tuple[str, list | None]:
    a = {k: v.value for k, v in node.attributes.items()}
    dom = f"{node.domain}::" if node.domain else ""
    if node.op_type == "MatMulNBits":
        return (f"already quantized: {dom}MatMulNBits int{a.get('bits', 4)}, block {a.get('block_size')}",
                [int(a["K"]), int(a["N"])] if "K" in a and "N" in a else None)
    return f"already quantized: {dom}{node.op_type}", None


def find_unsupported(model: ir.Model) -> list[Unsupported]:
    out = []
    for node in model.graph:
        wt = _weight_of(node)
        if wt is not None:
            why = _unsupported(wt[0])
            if why:
                out.append(Unsupported(node, node_name(node), wt[0], why))
            continue
        if node.op_type in _QUANTIZED_OPS and node.op_type != "GatherBlockQuantized":
            w = _const_input(node, _QUANTIZED_OPS[node.op_type])
            if w is not None:
                why, shape = _quantized_why(node)
                out.append(Unsupported(node, node_name(node), w, why, shape))
        elif node.op_type in _FUSED_WEIGHT_OPS and (w := _const_input(node, _FUSED_WEIGHT_OPS[node.op_type])) is not None:
            dom = f"{node.domain}::" if node.domain else ""
            what = ("the packed QKV weight inside a fused attention op" if _is_attn_core(node)
                    else "a weight inside a fused op (MatMul + bias + transposes)")
            out.append(Unsupported(node, node_name(node), w, f"{dom}{node.op_type}: {what}; no weight backend takes it"))
    return out


def find_candidates(model: ir.Model) -> list[Candidate]:
    out = []
    for node in model.graph:
        wt = _weight_of(node)
        if wt is None or _unsupported(wt[0]):
            continue
        w, transposed = wt
        shape = w.const_value.shape
        K, N = (int(shape[1]), int(shape[0])) if transposed else (int(shape[0]), int(shape[1]))
        target, role, how = _classify(node, K, N)
        name = node_name(node)
        layer = _layer_index(node.name or "") if node.name else None
        if layer is None:
            layer = _layer_index(w.name or "")
        out.append(Candidate(node=node, name=name, weight=w, transposed=transposed, K=K, N=N,
                             target=target, role=role, layer=layer, how=how, input=node.inputs[0]))
    _fill_layers(out)
    return out


def _fill_layers(cands: list[Candidate]) -> None:
    """When names carry no block index, number blocks in graph order: a new block starts at
    each attention q/k/v group following an MLP."""
    if all(c.layer is not None for c in cands if c.target != "head"):
        return
    layer, prev = -1, None
    for c in cands:
        if c.target == "head":
            c.layer = None
            continue
        if c.target == "attn" and prev in (None, "mlp"):
            layer += 1
        c.layer = max(layer, 0)
        prev = c.target


def ortlean_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.domain == DOMAIN]


def select(cands: list[Candidate], include: list[str], exclude: list[str], all_names: list[str] | None = None) -> tuple[list[Candidate], dict[str, str]]:
    """Filter by node-name globs. A glob that matches no candidate is an error."""
    excluded: dict[str, str] = {}
    names = [c.name for c in cands]
    for g in include + exclude:
        if not any(fnmatch.fnmatchcase(n, g) for n in names):
            raise OrtleanError(
                f"glob {g!r} matches no eligible MatMul (candidates: {', '.join(names[:6])}{' …' if len(names) > 6 else ''})")
    keep = []
    for c in cands:
        if include and not any(fnmatch.fnmatchcase(c.name, g) for g in include):
            excluded[c.name] = "not matched by --include"
            continue
        if any(fnmatch.fnmatchcase(c.name, g) for g in exclude):
            excluded[c.name] = "matched by --exclude"
            continue
        keep.append(c)
    return keep, excluded


# --------------------------------------------------------------------------- groups
@dataclass
class GroupCandidate(Candidate):
    """Projections that read the same input value (q/k/v of an attention block, gate/up of a
    gated MLP), gated as one layer: W = [W_1 | W_2 | …] ([K, ΣN]), one KWTA mask per token scored
    with the rows of the concatenated weight, one row-skipping matvec, then a Split back into the
    members' outputs. Planned, guarded and reported as one unit."""
    members: list = field(default_factory=list)

    def weight_array(self) -> np.ndarray:
        return np.ascontiguousarray(np.concatenate([m.weight_array() for m in self.members], axis=1))

    def rebind(self, nodes: dict[int, ir.Node], graph: ir.Graph) -> "GroupCandidate":
        return make_group([m.rebind(nodes, graph) for m in self.members])


def make_group(members: list) -> GroupCandidate:
    m0 = members[0]
    roles = "+".join(m.role for m in members)
    return GroupCandidate(node=m0.node, name="+".join(m.name for m in members), weight=m0.weight,
                          transposed=False, K=m0.K, N=int(sum(m.N for m in members)), target=m0.target, role=roles,
                          layer=m0.layer, how=m0.how, input=m0.input, members=list(members))


def group_shared_inputs(todo: list, targets) -> list:
    """Candidates of `targets` that read the same value become one GroupCandidate (in graph
    order); everything else passes through."""
    def eligible(c) -> bool:
        return c.target in targets and c.target != "head" and c.input is not None

    by_input: dict[int, list] = {}
    for c in todo:
        if eligible(c):
            by_input.setdefault(id(c.input), []).append(c)
    out, seen = [], set()
    for c in todo:
        grp = by_input.get(id(c.input)) if eligible(c) else None
        if grp and len(grp) > 1:
            if id(c.input) not in seen:
                seen.add(id(c.input))
                out.append(make_group(grp))
            continue
        out.append(c)
    return out
