"""onnxscript rewrite rules written for the optimum decoder export (what the libraries do not match).

Run after ORT's own transformer optimizer has fused the RMSNorms (SimplifiedLayerNormalization,
SkipSimplifiedLayerNormalization). Three rules:

* :class:`OptimumAttentionToGQA` — the attention core of an optimum `text-generation-with-past`
  export → one ``com.microsoft.GroupQueryAttention`` with ``do_rotary=1``. The pattern holds what
  every family shares: the new K/V concatenated with the past (→ ``present.N.key/value``), the
  optional repeat_kv (Unsqueeze/Expand/Reshape), Softmax over scores + an additive mask, the NaN
  guard ``Where(IsNaN(p), 0, p)`` (SDPA export) or float Casts (eager export), ·v, Transpose/Reshape.
  The parts that differ between families are read by hand in ``check`` (any operand order):
  the scores (SDPA's ``q·s ⋅ kᵀ·s`` or eager's ``(q⋅kᵀ)·s``, and the logit soft-cap
  ``c·tanh(x/c)`` → GQA's ``softcap``), the rotate-half rotary on q and k (whole head or its first
  ``r`` dims, Phi-3's partial rotary), an RMSNorm on each head before it (Gemma 3's / Qwen 3's
  q/k norms: kept in front of GQA, per head, as the onnxruntime-genai builder does on CPU), and
  the head split ``Transpose(Reshape(x))``. What the export computes from the graph inputs — the
  mask and the rotary tables — is measured (:mod:`rewriter.fuse.probe`): the mask must be GQA's own
  (causal, right padding, a sliding window → ``local_window_size``), the rotary rows become the
  ``cos_cache``/``sin_cache`` GQA reads (one pair per distinct table: Gemma 3's local and global
  layers differ), and positions must be past + index, which GQA derives from ``attention_mask``.
  ``seqlens_k`` / ``total_sequence_length`` are derived from ``attention_mask`` as the
  onnxruntime-genai builder does. Why not onnxscript's own rules: its SDPA rule wants the NaN
  guard's 0 as a scalar (optimum writes a [1] tensor) and its GQA rule requires the dynamo
  exporter's causal-mask subgraph and position_ids.
* :class:`PackQKV` — GQA fed by three MatMuls of one input with constant weights (and optional
  constant biases) → one MatMul over ``[Wq | Wk | Wv]`` feeding GQA's packed-QKV input (the genai
  builder's layout: one weight stream instead of three, two kernel launches fewer per layer).
  onnxscript's ``gqa_packed_qkv`` goes the other way (Slices of an already packed projection).
* :class:`SlicedQKV` — GQA fed by three Slices of one projection that is already packed (Phi-3's
  ``qkv_proj``) → GQA reads the projection itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import _ir_utils, pattern

MS = "com.microsoft"
_BIG = 2 ** 62          # a Slice end at or past this is "to the end"


def _scalar(v: ir.Value | None) -> float | None:
    """The value of a one-element constant (scalar or shape [1]), else None."""
    a = _ir_utils.get_numpy_value(v)
    if a is None or a.size != 1:
        return None
    return float(a.reshape(()))


def _ints(v: ir.Value | None) -> list[int] | None:
    a = _ir_utils.get_numpy_value(v)
    return None if a is None else [int(x) for x in a.reshape(-1)]


def _graph_input(model: ir.Model, v: ir.Value | None, name: str) -> bool:
    return v is not None and v.name == name and v in model.graph.inputs


def _op(v: ir.Value | None, *types: str) -> ir.Node | None:
    """The producer of ``v`` when it is one of the ONNX-domain ``types``."""
    p = None if v is None else v.producer()
    return p if p is not None and p.domain in ("", "ai.onnx") and p.op_type in types else None


def _perm(node: ir.Node | None) -> tuple | None:
    a = None if node is None else node.attributes.get("perm")
    return None if a is None else tuple(a.as_ints())


def _last_axis(v: ir.Value | None, rank: int, ints=_ints) -> bool:
    ax = ints(v)
    return ax is not None and len(ax) == 1 and ax[0] in (-1, rank - 1)


def _slice(v: ir.Value, rank: int = 4, ints=_ints) -> tuple[ir.Value, int, int] | None:
    """(data, start, end) of ``v = Slice(data, [start], [end], [last axis] (, [1]))`` (end clipped
    to _BIG), else None. ``ints`` reads an integer input (a constant; the fusion also evaluates
    bounds the export computes from shapes, e.g. head_dim // 2)."""
    p = _op(v, "Slice")
    if p is None or len(p.inputs) < 4:
        return None
    st, en = ints(p.inputs[1]), ints(p.inputs[2])
    if st is None or en is None or len(st) != 1 or len(en) != 1 or not _last_axis(p.inputs[3], rank, ints):
        return None
    if len(p.inputs) > 4 and p.inputs[4] is not None and ints(p.inputs[4]) != [1]:
        return None
    return p.inputs[0], st[0], min(en[0], _BIG)


def _const_operand(node: ir.Node) -> tuple[ir.Value, float] | None:
    """(the other input, the constant) of a binary node with one one-element constant input."""
    a, b = node.inputs[0], node.inputs[1]
    if _scalar(b) is not None:
        return a, _scalar(b)
    if _scalar(a) is not None:
        return b, _scalar(a)
    return None


class Unmatched(Exception):
    """A hand-read part of the attention is not a form the rule knows (the message says which)."""


@dataclass
class Scores:
    q: ir.Value           # the rotated queries [B, H, S, D]
    k_t: ir.Value         # the keys, transposed [B, H, D, T]
    scale: float
    softcap: float        # 0: none


def match_scores(v: ir.Value) -> Scores:
    """``v = softcap(scale · q ⋅ kᵀ)``: SDPA export ``MatMul(q·s1, kᵀ·s2)``, eager export
    ``MatMul(q, kᵀ)·s`` (or ``/s``), soft-cap ``c·tanh(x/c)`` (or ``tanh(x·(1/c))·c``) around it."""
    softcap = 0.0
    m = _op(v, "Mul")
    if m is not None:
        ct = _const_operand(m)
        t = _op(ct[0], "Tanh") if ct else None
        if t is not None:
            c = ct[1]
            inner = _op(t.inputs[0], "Div", "Mul")
            ic = _const_operand(inner) if inner is not None else None
            if ic is None or not math.isclose(ic[1] if inner.op_type == "Div" else 1.0 / ic[1], c, rel_tol=1e-5) or c <= 0:
                raise Unmatched(f"{t.name}: Tanh on the scores is not a soft-cap c·tanh(x/c)")
            softcap, v = float(c), ic[0]
    scale = 1.0
    while True:
        p = _op(v, "Mul", "Div")
        if p is None:
            break
        ct = _const_operand(p)
        if ct is None or (p.op_type == "Div" and ct[0] is not p.inputs[0]):
            raise Unmatched(f"{p.name}: the scores are scaled by a non-constant")
        scale *= ct[1] if p.op_type == "Mul" else 1.0 / ct[1]
        v = ct[0]
    mm = _op(v, "MatMul")
    if mm is None:
        raise Unmatched(f"the scores come from {v.producer().op_type if v.producer() else v.name}, not q ⋅ kᵀ")
    q, k_t = mm.inputs
    for side in ("q", "k"):
        x = q if side == "q" else k_t
        while (p := _op(x, "Mul", "Div")) is not None:
            ct = _const_operand(p)
            if ct is None or (p.op_type == "Div" and ct[0] is not p.inputs[0]):
                raise Unmatched(f"{p.name}: the {side} side of the scores is scaled by a non-constant")
            scale *= ct[1] if p.op_type == "Mul" else 1.0 / ct[1]
            x = ct[0]
        if side == "q":
            q = x
        else:
            k_t = x
    return Scores(q, k_t, scale, softcap)


def match_keys(k_t: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value | None]:
    """(past keys, new rotated keys, repeat_kv's Unsqueeze axes | None) of the scores' keys
    ``Transpose([repeat_kv](Concat(past, new, axis=-2)), [0, 1, 3, 2])``."""
    t = _op(k_t, "Transpose")
    if t is None or _perm(t) != (0, 1, 3, 2):
        raise Unmatched("the scores' keys are not Transpose(keys, [0, 1, 3, 2])")
    k, axes = t.inputs[0], None
    rs = _op(k, "Reshape")
    if rs is not None:
        ex = _op(rs.inputs[0], "Expand")
        un = _op(ex.inputs[0], "Unsqueeze") if ex is not None else None
        if un is None:
            raise Unmatched(f"{rs.name}: the keys' repeat_kv is not Reshape(Expand(Unsqueeze(keys)))")
        k, axes = un.inputs[0], un.inputs[1]
    c = _op(k, "Concat")
    if c is None or len(c.inputs) != 2 or c.attributes.get_int("axis", 0) not in (-2, 2):
        raise Unmatched("the keys are not Concat(past keys, new keys, axis=-2)")
    return c.inputs[0], c.inputs[1], axes


@dataclass
class Rotary:
    x: ir.Value           # the heads before the rotary [B, H, S, D]
    cos: ir.Value         # the export's tables [B, S, r] (rotate-half layout)
    sin: ir.Value
    dim: int              # r: the first r dims of every head are rotated
    partial: bool


def _table(v: ir.Value) -> ir.Value | None:
    """``t`` of ``v = Unsqueeze(t, [1])`` (the per-head broadcast of a [B, S, r] table)."""
    p = _op(v, "Unsqueeze")
    return p.inputs[0] if p is not None and _ints(p.inputs[1]) == [1] else None


def match_rotary(v: ir.Value, ints=_ints) -> Rotary:
    """``v = rope(x)``: ``y·cos + rotate_half(y)·sin`` with ``rotate_half(y) = [-y₂, y₁]`` on the
    whole head (y = x), or on its first r dims and the rest passed through
    (``Concat(rope(x[..., :r]), x[..., r:])``, Phi-3's partial rotary)."""
    x, r, partial = None, None, False
    rot = v
    c = _op(v, "Concat")
    if c is not None and len(c.inputs) == 2 and c.attributes.get_int("axis", 0) in (-1, 3):
        sl = _slice(c.inputs[1], ints=ints)
        if sl is None:
            raise Unmatched(f"{c.name}: a Concat after the rotary that is not rotated part + Slice of the rest")
        x, r, _ = sl
        rot, partial = c.inputs[0], True
    add = _op(rot, "Add")
    if add is None:
        raise Unmatched(f"no rotary embedding on the heads ({rot.producer().op_type if rot.producer() else rot.name} "
                        "where y·cos + rotate_half(y)·sin was expected)")
    terms = [_op(i, "Mul") for i in add.inputs]
    if any(t is None for t in terms):
        raise Unmatched(f"{add.name}: not a sum of two products (y·cos + rotate_half(y)·sin)")
    parts = []
    for t in terms:
        a, b = t.inputs
        ta, tb = _table(a), _table(b)
        if (ta is None) == (tb is None):
            raise Unmatched(f"{t.name}: not a product with Unsqueeze(table, [1])")
        parts.append((b, ta) if ta is not None else (a, tb))
    sin_i = next((i for i, (d, _) in enumerate(parts) if _op(d, "Concat") is not None), None)
    if sin_i is None:
        raise Unmatched(f"{add.name}: no rotate_half (Concat(-y₂, y₁)) term (an interleaved rotary is not fused)")
    (rh, sin), (y, cos) = parts[sin_i], parts[1 - sin_i]
    rc = _op(rh, "Concat")
    neg = _op(rc.inputs[0], "Neg") if len(rc.inputs) == 2 else None
    hi = _slice(neg.inputs[0], ints=ints) if neg is not None else None
    lo = _slice(rc.inputs[1], ints=ints) if neg is not None else None
    if hi is None or lo is None or hi[0] is not y or lo[0] is not y or lo[1] != 0 or lo[2] != hi[1]:
        raise Unmatched(f"{rc.name}: rotate_half is not Concat(-y[..., h:], y[..., :h]) of the rotated input")
    h = hi[1]
    if partial:
        sl = _slice(y, ints=ints)
        if sl is None or sl[0] is not x or sl[1] != 0 or sl[2] != r or 2 * h != r:
            raise Unmatched(f"{c.name}: partial rotary whose rotated part is not x[..., :{r}] with halves of {h}")
    else:
        sl = _slice(y, ints=ints)
        if sl is not None and sl[1] == 0:      # y = x[..., :r] with nothing passed through: r must be D
            x, r = sl[0], sl[2]
        else:
            x, r = y, 2 * h
        if r != 2 * h:
            raise Unmatched(f"{rc.name}: rotary halves of {h} over {r} dims")
    return Rotary(x, cos, sin, r, partial)


@dataclass
class Heads:
    bsd: ir.Value                 # the projection [B, S, H·D]
    bshd: ir.Value                # its Reshape to [B, S, H, D]
    norm: ir.Node | None          # SimplifiedLayerNormalization over each head's D (q/k norm)


def _sln(v: ir.Value) -> ir.Node | None:
    p = v.producer()
    if p is None or p.op_type != "SimplifiedLayerNormalization" or p.domain not in ("", "ai.onnx", MS):
        return None
    return p


def match_heads(v: ir.Value) -> Heads:
    """``v = Transpose(Reshape(x), [0, 2, 1, 3])``, with an RMSNorm over the last axis before or
    after the Transpose (per head)."""
    norm = _sln(v)
    if norm is not None:
        v = norm.inputs[0]
    t = _op(v, "Transpose")
    if t is None or _perm(t) != (0, 2, 1, 3):
        raise Unmatched(f"{v.producer().name if v.producer() else v.name}: the heads are not "
                        "Transpose(Reshape(x), [0, 2, 1, 3])" + (" after the q/k norm" if norm else ""))
    v = t.inputs[0]
    if norm is None and (norm := _sln(v)) is not None:
        v = norm.inputs[0]
    rs = _op(v, "Reshape")
    if rs is None:
        raise Unmatched(f"{t.name}: the heads are not a Reshape of the projection")
    if norm is not None:
        ax = norm.attributes.get_int("axis", -1)
        w = norm.inputs[1] if len(norm.inputs) > 1 else None
        if ax not in (-1, 3) or w is None or w.const_value is None or len(w.const_value.shape) != 1:
            raise Unmatched(f"{norm.name}: q/k norm is not over each head's last axis with a constant scale")
    return Heads(rs.inputs[0], v, norm)


class OptimumAttentionToGQA(pattern.RewriteRuleClassBase):
    """Attention core of an optimum decoder export → GroupQueryAttention (rotary inside).
    ``analysis`` (:class:`rewriter.fuse.Analysis`) measures the masks and rotary tables."""

    def __init__(self, analysis):
        super().__init__("OptimumAttentionToGQA", remove_nodes=False)
        self._an = analysis

    def pattern(self, op, scores, mask, v_bsd, past_value, nan_zero, rep_axes_v):
        v = op.Transpose(op.Reshape(v_bsd, pattern.ANY_VALUE, _outputs=["v_bshd"]), perm=[0, 2, 1, 3])
        present_value = op.Concat(past_value, v, axis=-2, _outputs=["present_value"])
        # repeat_kv (absent when num_heads == kv_heads)
        v_all = pattern.OrValue([
            op.Reshape(op.Expand(op.Unsqueeze(present_value, rep_axes_v), pattern.ANY_VALUE), pattern.ANY_VALUE),
            present_value])
        probs = op.Softmax(op.Add(scores, mask), axis=-1)
        probs = pattern.OrValue([op.Where(op.IsNaN(probs), nan_zero, probs),          # SDPA export
                                 op.Cast(op.Cast(probs, to=1), to=1), op.Cast(probs, to=1),   # eager, float32
                                 probs])
        out = op.Transpose(op.MatMul(probs, v_all), perm=[0, 2, 1, 3])
        # One output: a multi-output pattern makes onnxscript's matcher try every combination of
        # candidate nodes (hours on a 30-layer graph). GQA's present outputs are wired to the graph
        # outputs afterwards (:func:`reroute_presents`). The key side (present keys, repeat_kv,
        # rotary) is read by hand from the scores (:func:`match_keys`).
        return op.Reshape(out, pattern.ANY_VALUE, _outputs=["attn"])

    def _fail(self, r, reason: str, where):
        self._an.last_failure = reason        # onnxscript's match() drops a check's reason
        return r.fail(reason, where)

    def check(self, context, scores, mask, v_bsd, v_bshd, past_value, attn, nan_zero=None, rep_axes_v=None, **_):
        r = pattern.MatchResult()
        model = context.model
        where = attn.producer().name or "attention"
        try:
            sc = match_scores(scores)
            past_key, k_rot, rep_axes_k = match_keys(sc.k_t)
        except Unmatched as e:
            return self._fail(r, f"{where}: {e}", attn)
        if not (_graph_input(model, past_key, past_key.name) and past_key.name.startswith("past_key_values.")
                and _graph_input(model, past_value, past_value.name)
                and past_value.name == past_key.name.replace(".key", ".value")):
            return self._fail(r, f"{where}: the past K/V of the Concats are not one layer's past_key_values.N.* inputs",
                              [past_key, past_value])
        ps = past_key.shape
        if ps is None or ps.rank() != 4 or not isinstance(ps[1], int) or not isinstance(ps[3], int):
            return self._fail(r, f"{where}: past key shape {ps} is not [batch, kv_heads, past, head_dim] "
                              "with static kv_heads and head_dim", past_key)
        kv_heads, head_dim = int(ps[1]), int(ps[3])
        if head_dim % 16:
            return self._fail(r, f"{where}: head_dim {head_dim} is not a multiple of 16 (ORT's CPU GroupQueryAttention "
                              "requires it)", past_key)
        if past_key.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
            return self._fail(r, f"{where}: KV cache type {past_key.dtype} (GroupQueryAttention takes float32/float16)",
                              past_key)
        for ax, what in ((rep_axes_k, "key"), (rep_axes_v, "value")):
            if ax is not None and _ints(ax) != [2]:
                return self._fail(r, f"{where}: repeat_kv of the {what} unsqueezes axes {_ints(ax)}, expected [2]", ax)
        if nan_zero is not None and _scalar(nan_zero) != 0.0:
            return self._fail(r, f"{where}: the Softmax NaN guard does not write 0", nan_zero)
        try:
            qr, kr = match_rotary(sc.q, self._an.ints), match_rotary(k_rot, self._an.ints)
            if qr.cos is not kr.cos or qr.sin is not kr.sin or qr.dim != kr.dim:
                raise Unmatched("q and k are rotated with different tables")
            if qr.dim > head_dim or qr.dim % 2 or (not qr.partial and qr.dim != head_dim):
                raise Unmatched(f"rotary over {qr.dim} of {head_dim} dims")
            qh, kh = match_heads(qr.x), match_heads(kr.x)
            nh = self._an.heads(qh.bshd, head_dim, where)
            if self._an.heads(kh.bshd, head_dim, where) != kv_heads or self._an.heads(v_bshd, head_dim, where) != kv_heads:
                raise Unmatched(f"k/v are not split into the cache's {kv_heads} heads of {head_dim}")
            if nh % kv_heads:
                raise Unmatched(f"{nh} query heads are not a multiple of {kv_heads} KV heads")
            window = self._an.window(mask, where)
            cos, sin = self._an.caches(qr.cos, qr.sin, past_key.dtype, where)
        except Unmatched as e:
            return self._fail(r, f"{where}: {e}", attn)
        self._attention_mask = next(i for i in model.graph.inputs if i.name == "attention_mask")
        self._past_key = past_key
        self._num_heads, self._kv_heads, self._head_dim = nh, kv_heads, head_dim
        self._q, self._k = qh, kh
        self._cos, self._sin, self._window, self._softcap = cos, sin, window, sc.softcap
        self._scale = sc.scale
        self._an.record(where, window=window, softcap=sc.softcap, norm=qh.norm is not None or kh.norm is not None,
                        rotary_dim=qr.dim, head_dim=head_dim, cache=cos)
        return r

    @staticmethod
    def _normed(op, h: Heads, heads: int, head_dim: int):
        """GQA's [B, S, H·D] input: the projection, or its per-head RMSNorm (Reshape → SLN → Reshape)."""
        if h.norm is None:
            return h.bsd
        n = h.norm
        x = op.Reshape(h.bsd, op.Constant(value=ir.tensor(np.array([0, 0, heads, head_dim], np.int64))))
        y = op.SimplifiedLayerNormalization(x, n.inputs[1], _domain=n.domain,
                                            **{a.name: a.value for a in n.attributes.values()},
                                            _name=f"{n.name}/per_head" if n.name else None)
        return op.Reshape(y, op.Constant(value=ir.tensor(np.array([0, 0, heads * head_dim], np.int64))))

    def rewrite(self, op, v_bsd, past_value, attn, **_):
        am, past_key = self._attention_mask, self._past_key
        # seqlens_k = sum(attention_mask) - 1 (int32), total_sequence_length = attention_mask.shape[1]
        # (the onnxruntime-genai builder's subgraph; CSE later keeps one copy for all layers)
        one = op.Constant(value=ir.tensor(np.array([1], dtype=np.int64)))
        seqlens = op.Cast(op.Sub(op.ReduceSum(am, one, keepdims=0), op.Constant(value_int=1)),
                          to=ir.DataType.INT32)
        total = op.Cast(op.Gather(op.Shape(am), op.Constant(value_int=1), axis=0), to=ir.DataType.INT32)
        attrs = dict(num_heads=self._num_heads, kv_num_heads=self._kv_heads, do_rotary=1, rotary_interleaved=0)
        if not math.isclose(self._scale, 1.0 / math.sqrt(self._head_dim), rel_tol=1e-6):
            attrs["scale"] = float(self._scale)
        if self._window > 0:
            attrs["local_window_size"] = int(self._window)
        if self._softcap > 0:
            attrs["softcap"] = float(self._softcap)
        q = self._normed(op, self._q, self._num_heads, self._head_dim)
        k = self._normed(op, self._k, self._kv_heads, self._head_dim)
        scope = (attn.producer().name or "").rsplit("/", 1)[0]
        out, _present_key, _present_value = op.GroupQueryAttention(
            q, k, v_bsd, past_key, past_value, seqlens, total, self._cos, self._sin, _domain=MS, _outputs=3,
            _name=f"{scope}/GroupQueryAttention" if scope else None, **attrs)
        return out


def reroute_presents(model: ir.Model) -> int:
    """Make every GroupQueryAttention's present K/V the graph outputs ``present.N.key/value``
    where those are still the export's ``Concat(past_key_values.N.*, new)`` (left dead for DCE).
    Returns how many outputs were rerouted."""
    outs = {o.name: i for i, o in enumerate(model.graph.outputs)}
    n = 0
    for node in model.graph:
        if node.op_type != "GroupQueryAttention" or node.domain != MS:
            continue
        for past_idx, out_idx in ((3, 1), (4, 2)):
            past = node.inputs[past_idx] if len(node.inputs) > past_idx else None
            if past is None or not past.name.startswith("past_key_values."):
                continue
            name = past.name.replace("past_key_values", "present", 1)
            if name not in outs:
                continue
            old = model.graph.outputs[outs[name]]
            p = old.producer()
            if p is None or p.op_type != "Concat" or p.inputs[0] is not past:
                continue
            new = node.outputs[out_idx]
            old.name = f"{name}.unfused"
            new.name = name
            new.shape, new.type = old.shape, old.type
            model.graph.outputs[outs[name]] = new
            n += 1
    return n


def _proj_width(v: ir.Value) -> int | None:
    """Last dimension of a projection output: its static shape, else the constant weight of the
    MatMul (or MatMul + bias Add) that produces it."""
    if v.shape is not None and v.shape.rank() and isinstance(v.shape[-1], int):
        return int(v.shape[-1])
    w = _projection(v)
    return None if w is None else int(w[1].const_value.shape[-1])


def _projection(v: ir.Value):
    """(x, W, bias | None) when ``v = x @ W (+ b)`` with constant 2-D W (and 1-D b), else None."""
    p = v.producer()
    if p is None:
        return None
    bias = None
    if p.op_type == "Add" and p.domain == "":
        a, b = p.inputs
        for mm, c in ((a, b), (b, a)):
            if mm is not None and mm.producer() is not None and mm.producer().op_type == "MatMul" \
                    and c is not None and c.const_value is not None and len(c.const_value.shape) == 1 \
                    and len(mm.uses()) == 1:
                p, bias = mm.producer(), c
                break
        else:
            return None
    if p.op_type != "MatMul" or p.domain != "":
        return None
    x, w = p.inputs
    if w is None or w.const_value is None or len(w.const_value.shape) != 2:
        return None
    return x, w, bias


class PackQKV(pattern.RewriteRuleClassBase):
    """GQA(x@Wq (+bq), x@Wk (+bk), x@Wv (+bv), …) → GQA(x@[Wq|Wk|Wv] (+[bq|bk|bv]), -, -, …)."""

    def __init__(self):
        super().__init__("PackQKV", remove_nodes=True)

    def pattern(self, op, q, k, v, past_key, past_value, seqlens_k, total_len, cos, sin):
        return op.GroupQueryAttention(q, k, v, past_key, past_value, seqlens_k, total_len, cos, sin,
                                      _domain=MS, _outputs=["attn", "present_key", "present_value"])

    def check(self, context, q, k, v, attn, **_):
        r = pattern.MatchResult()
        projs = [_projection(x) for x in (q, k, v)]
        if any(p is None for p in projs):
            return r.fail("q/k/v are not MatMuls with constant weights", [q, k, v])
        if not (projs[0][0] is projs[1][0] is projs[2][0]):
            return r.fail("q/k/v projections read different inputs", [q, k, v])
        if any(len(x.uses()) != 1 for x in (q, k, v)):
            return r.fail("a q/k/v projection has other consumers", [q, k, v])
        if len({p[1].const_value.shape[0] for p in projs}) != 1:
            return r.fail("q/k/v weights differ in K", [q, k, v])
        if len({p[2] is None for p in projs}) != 1:
            return r.fail("only some of q/k/v have a bias", [q, k, v])
        self._projs = projs
        return r

    def rewrite(self, op, past_key, past_value, seqlens_k, total_len, cos, sin, attn, **_):
        projs = self._projs
        x = projs[0][0]
        node_name, w_name = _packed_names(projs[0][1].uses()[0].node.name or "", projs[0][1].name)
        w = np.concatenate([p[1].const_value.numpy() for p in projs], axis=1)
        wv = op.initializer(ir.tensor(w, name=f"{w_name}.weight"))
        qkv = op.MatMul(x, wv, _name=node_name)
        if projs[0][2] is not None:
            b = np.concatenate([p[2].const_value.numpy() for p in projs])
            qkv = op.Add(qkv, op.initializer(ir.tensor(b, name=f"{w_name}.bias")),
                         _name=node_name.rsplit("/", 1)[0] + "/Add" if node_name else None)
        node = attn.producer()
        return op.GroupQueryAttention(qkv, None, None, past_key, past_value, seqlens_k, total_len, cos, sin,
                                      _domain=MS, _outputs=3, _name=node.name,
                                      **{a.name: a.value for a in node.attributes.values()})


def _packed_names(q_node: str, q_weight: str) -> tuple[str | None, str]:
    """Node and weight names of the packed projection, from the q projection's node name
    ("/model/layers.0/self_attn/q_proj/MatMul" -> ".../qkv_proj/MatMul", "model.layers.0.self_attn.qkv_proj")."""
    if "q_proj" in q_node:
        node = q_node.replace("q_proj", "qkv_proj")
        return node, node.strip("/").rsplit("/", 1)[0].replace("/", ".")
    return (f"{q_node}_qkv" if q_node else None), f"{q_weight}.qkv_proj"


class SlicedQKV(pattern.RewriteRuleClassBase):
    """GQA(x[..., :a], x[..., a:b], x[..., b:]) → GQA(x, -, -): a projection packed in the checkpoint
    (Phi-3's ``qkv_proj``) in GQA's packed layout [q | k | v] is read as it is."""

    def __init__(self):
        super().__init__("SlicedQKV", remove_nodes=True)

    def pattern(self, op, q, k, v, past_key, past_value, seqlens_k, total_len, cos, sin):
        return op.GroupQueryAttention(q, k, v, past_key, past_value, seqlens_k, total_len, cos, sin,
                                      _domain=MS, _outputs=["attn", "present_key", "present_value"])

    def check(self, context, q, k, v, attn, **_):
        r = pattern.MatchResult()
        node = attn.producer()
        sl = [_slice(x, rank=3) if x is not None else None for x in (q, k, v)]
        if any(s is None for s in sl) or not (sl[0][0] is sl[1][0] is sl[2][0]):
            return r.fail("q/k/v are not Slices of one value", [q, k, v])
        nh, kvh = node.attributes.get_int("num_heads"), node.attributes.get_int("kv_num_heads")
        (x, a0, a1), (_, b0, b1), (_, c0, c1) = sl
        width = _proj_width(x)
        if not (a0 == 0 and a1 == b0 and b1 == c0 and a1 % nh == 0):
            return r.fail("q/k/v Slices are not [0, a), [a, b), [b, c)", [q, k, v])
        d = a1 // nh
        if b1 - b0 != kvh * d or width is None or width != c0 + kvh * d or c1 < width:
            return r.fail(f"q/k/v Slices do not split a packed projection of width {width} into "
                          f"{nh}+{kvh}+{kvh} heads of {d}", [q, k, v])
        self._x = x
        return r

    def rewrite(self, op, past_key, past_value, seqlens_k, total_len, cos, sin, attn, **_):
        node = attn.producer()
        return op.GroupQueryAttention(self._x, None, None, past_key, past_value, seqlens_k, total_len, cos, sin,
                                      _domain=MS, _outputs=3, _name=node.name,
                                      **{a.name: a.value for a in node.attributes.values()})
