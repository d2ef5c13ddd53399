"""The attention core of optimum-exported graphs: QKᵀ → scale → (+mask) → Softmax → (IsNaN→0) → ·V,
including GQA's repeat of K/V heads (Unsqueeze → Expand → Reshape) and the Concat with
``past_key_values.N.*`` — what PackedAttention replaces (and what a fusion pass into ONNX
Runtime's attention ops would match). `find_attention` returns the matches and, for every Softmax
that is not such a core, why."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

@dataclass
class Match:
    softmax: ir.Node
    final: ir.Node                  # the P·V MatMul whose output the new node takes over
    q: ir.Value
    k: ir.Value
    v: ir.Value
    mask: ir.Value | None
    scale: float
    k_layout: str                   # bhtd | bhdt
    layer: str
    cache: int | None = None        # N of past_key_values.N.key when K is the cache
    notes: list = field(default_factory=list)


class NoMatch(Exception):
    pass


def _prod(v: ir.Value | None) -> ir.Node | None:
    return None if v is None else v.producer()


def _const_scalar(v: ir.Value) -> float | None:
    cv = v.const_value
    if cv is None:
        p = v.producer()
        if p is not None and p.op_type == "Constant" and "value" in p.attributes:
            cv = p.attributes["value"].value
    if cv is None:
        return None
    a = np.asarray(cv.numpy())
    if a.size != 1 or a.dtype.kind != "f":
        return None
    return float(a.reshape(()))


def _peel_scale(v: ir.Value) -> tuple[ir.Value, float]:
    """Strip Mul/Div by constant scalars; returns (inner value, accumulated factor)."""
    s = np.float32(1.0)
    while True:
        p = _prod(v)
        if p is None or p.op_type not in ("Mul", "Div") or len(p.inputs) != 2:
            return v, float(s)
        c1 = _const_scalar(p.inputs[1])
        c0 = _const_scalar(p.inputs[0]) if p.op_type == "Mul" else None
        if c1 is not None:
            s = np.float32(s * (np.float32(c1) if p.op_type == "Mul" else np.float32(1.0) / np.float32(c1)))
            v = p.inputs[1 - 1]
        elif c0 is not None:
            s = np.float32(s * np.float32(c0))
            v = p.inputs[1]
        else:
            return v, float(s)


def _strip_repeat(v: ir.Value) -> tuple[ir.Value, bool]:
    """GQA repeat_kv: Reshape(Expand(Unsqueeze(x, axis 2))) → x."""
    r = _prod(v)
    if r is None or r.op_type != "Reshape":
        return v, False
    e = _prod(r.inputs[0])
    if e is None or e.op_type != "Expand":
        return v, False
    u = _prod(e.inputs[0])
    if u is None or u.op_type != "Unsqueeze":
        return v, False
    if len(u.inputs) > 1 and u.inputs[1] is not None:
        ax = u.inputs[1].const_value
        if ax is None and _prod(u.inputs[1]) is not None and _prod(u.inputs[1]).op_type == "Constant":
            ax = _prod(u.inputs[1]).attributes["value"].value
        if ax is not None and [int(x) for x in np.asarray(ax.numpy()).ravel()] not in ([2], [-3]):
            raise NoMatch(f"K/V head repeat unsqueezes axis {np.asarray(ax.numpy()).ravel().tolist()}, not 2")
    return u.inputs[0], True


def _layer_name(node: ir.Node) -> str:
    m = re.search(r"(layers?)\.(\d+)", node.name or "")
    return f"{m.group(1)}.{m.group(2)}" if m else (node.name or "?")


def _match_one(sm: ir.Node, graph: ir.Graph) -> Match:
    axis = sm.attributes["axis"].value if "axis" in sm.attributes else -1
    if axis not in (-1, 3):
        raise NoMatch(f"Softmax over axis {axis}, not the key axis")
    x = sm.inputs[0]
    p = _prod(x)
    mask = None
    scores = x
    if p is not None and p.op_type == "Add":
        a, b = p.inputs
        def leads_to_mm(v):
            inner, _ = _peel_scale(v)
            return _prod(inner) is not None and _prod(inner).op_type == "MatMul"
        if leads_to_mm(a):
            scores, mask = a, b
        elif leads_to_mm(b):
            scores, mask = b, a
        else:
            raise NoMatch("Softmax input is an Add with no QKᵀ MatMul on either side")
    inner, scale = _peel_scale(scores)
    mm = _prod(inner)
    if mm is None or mm.op_type != "MatMul":
        raise NoMatch(f"no QKᵀ MatMul before the Softmax (found {mm.op_type if mm else 'a graph input'})")
    q, sq = _peel_scale(mm.inputs[0])
    kt, sk = _peel_scale(mm.inputs[1])
    scale = float(np.float32(scale) * np.float32(sq) * np.float32(sk))
    tp = _prod(kt)
    if tp is not None and tp.op_type == "Transpose" and list(tp.attributes["perm"].value) == [0, 1, 3, 2]:
        k, rep_k = _strip_repeat(tp.inputs[0])
        layout = "bhtd"
    else:
        k, rep_k, layout = kt, False, "bhdt"
    # Softmax → [IsNaN/Where → 0] → MatMul(P, V)
    out = sm.outputs[0]
    cons = list(out.consumers())
    notes = []
    if len(cons) == 2 and {c.op_type for c in cons} == {"IsNaN", "Where"}:
        isn = next(c for c in cons if c.op_type == "IsNaN")
        wh = next(c for c in cons if c.op_type == "Where")
        z = _const_scalar(wh.inputs[1])
        if wh.inputs[0] is not isn.outputs[0] or wh.inputs[2] is not out or z != 0.0:
            raise NoMatch("Softmax followed by IsNaN/Where that is not 'NaN → 0'")
        out = wh.outputs[0]
        cons = list(out.consumers())
        notes.append("IsNaN→0 folded (fully masked rows give 0)")
    if len(cons) != 1 or cons[0].op_type != "MatMul" or cons[0].inputs[0] is not out:
        raise NoMatch("Softmax output does not feed exactly one MatMul as its left operand (·V)")
    final = cons[0]
    v, rep_v = _strip_repeat(final.inputs[1])
    if rep_k != rep_v:
        raise NoMatch("K and V heads are repeated differently")
    if mask is not None:
        if mask.dtype is not None and mask.dtype != ir.DataType.FLOAT:
            raise NoMatch(f"additive mask of type {mask.dtype}, not float")
        if mask.shape is not None and len(mask.shape) != 4:
            raise NoMatch(f"mask of rank {len(mask.shape)}, expected 4")
    for name, val in (("Q", q), ("V", v)):
        if val.dtype is not None and val.dtype != ir.DataType.FLOAT:
            raise NoMatch(f"{name} is {val.dtype}, not float")
    # the cache: K is present.N.key, Concat(past_key_values.N.key, new) on the sequence axis
    cache = None
    outs = {o.name: o for o in graph.outputs}
    pm = re.match(r"^present\.(\d+)\.key$", k.name or "")
    if pm and outs.get(k.name) is k and layout == "bhtd":
        c = _prod(k)
        if c is not None and c.op_type == "Concat" and c.inputs[0] is not None and \
                c.inputs[0].name == f"past_key_values.{pm.group(1)}.key":
            cache = int(pm.group(1))
        else:
            notes.append("present key is not Concat(past_key_values.N.key, …): bits recomputed per call")
    layer = f"layers.{cache}" if cache is not None else _layer_name(sm)
    return Match(sm, final, q, k, v, mask, scale, layout, layer, cache, notes)


def find_attention(model: ir.Model) -> tuple[list[Match], list[dict]]:
    matches, skipped = [], []
    for node in list(model.graph):
        if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx"):
            continue
        try:
            matches.append(_match_one(node, model.graph))
        except NoMatch as e:
            skipped.append({"layer": _layer_name(node), "node": node.name, "reason": str(e)})
    return matches, skipped
