"""onnxscript rewrite rules written for the optimum decoder export (what the libraries do not match).

Run after ORT's own transformer optimizer has fused RMSNorm (SimplifiedLayerNormalization,
SkipSimplifiedLayerNormalization) and the rotary embedding (com.microsoft RotaryEmbedding with
cos/sin caches). Two rules:

* :class:`OptimumAttentionToGQA` — the attention core of an optimum `text-generation-with-past`
  export (RotaryEmbedding'd q/k, Concat with the past → ``present.N.key/value``, repeat_kv
  Unsqueeze/Expand/Reshape, q·kᵀ scaled by two Muls, + mask, Softmax, the NaN guard
  ``Where(IsNaN(p), 0, p)``, ·v, Transpose/Reshape) → one ``com.microsoft.GroupQueryAttention``
  with ``do_rotary=1`` on the same cos/sin caches. Why not onnxscript's own rules: its SDPA rule
  wants the NaN guard's 0 as a scalar (optimum writes a [1] tensor) and its GQA rule requires the
  causal mask subgraph of the dynamo exporter and derives ``seqlens_k`` from ``position_ids``; the
  optimum mask is built from ``attention_mask``, so ``seqlens_k`` / ``total_sequence_length`` are
  derived from ``attention_mask`` here, as the onnxruntime-genai builder does.
* :class:`PackQKV` — GQA fed by three MatMuls of one input with constant weights (and optional
  constant biases) → one MatMul over ``[Wq | Wk | Wv]`` feeding GQA's packed-QKV input (the genai
  builder's layout: one weight stream instead of three, two kernel launches fewer per layer).
  onnxscript's ``gqa_packed_qkv`` goes the other way (Slices of an already packed projection).
"""
from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import _ir_utils, pattern

MS = "com.microsoft"


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


def _fan_in_inputs(v: ir.Value, limit: int = 2000) -> tuple[set[str], bool]:
    """Names of the graph inputs whose *values* a value depends on (walking producers; a Shape
    node reads only its input's shape, so the walk stops there), and whether the walk stayed
    within ``limit`` nodes."""
    seen: set[int] = set()
    names: set[str] = set()
    stack = [v]
    while stack:
        x = stack.pop()
        p = x.producer()
        if p is None:
            if x.const_value is None and x.name:
                names.add(x.name)
            continue
        if id(p) in seen:
            continue
        seen.add(id(p))
        if len(seen) > limit:
            return names, False
        if p.op_type == "Shape" and p.domain == "":
            continue
        stack.extend(i for i in p.inputs if i is not None)
    return names, True


class OptimumAttentionToGQA(pattern.RewriteRuleClassBase):
    """Attention core of an optimum Llama-family export → GroupQueryAttention (rotary inside)."""

    def __init__(self):
        super().__init__("OptimumAttentionToGQA", remove_nodes=False)

    def pattern(self, op, q_bsd, k_bsd, v_bsd, past_key, past_value, position_ids, cos, sin,
                mask, q_scale, k_scale, nan_zero, rep_axes_k, rep_axes_v):
        def heads(x, name):  # [B, S, H*D] -> [B, H, S, D]
            return op.Transpose(op.Reshape(x, pattern.ANY_VALUE, _outputs=[f"{name}_bshd"]), perm=[0, 2, 1, 3])

        q = op.RotaryEmbedding(heads(q_bsd, "q"), position_ids, cos, sin, _domain=MS, _outputs=["q_rope"])
        k = op.RotaryEmbedding(heads(k_bsd, "k"), position_ids, cos, sin, _domain=MS, _outputs=["k_rope"])
        v = heads(v_bsd, "v")
        present_key = op.Concat(past_key, k, axis=-2, _outputs=["present_key"])
        present_value = op.Concat(past_value, v, axis=-2, _outputs=["present_value"])
        # repeat_kv (absent when num_heads == kv_heads)
        k_all = pattern.OrValue([
            op.Reshape(op.Expand(op.Unsqueeze(present_key, rep_axes_k), pattern.ANY_VALUE), pattern.ANY_VALUE),
            present_key])
        v_all = pattern.OrValue([
            op.Reshape(op.Expand(op.Unsqueeze(present_value, rep_axes_v), pattern.ANY_VALUE), pattern.ANY_VALUE),
            present_value])
        scores = op.MatMul(op.Mul(q, q_scale), op.Mul(op.Transpose(k_all, perm=[0, 1, 3, 2]), k_scale))
        probs = op.Softmax(op.Add(scores, mask), axis=-1)
        probs = pattern.OrValue([op.Where(op.IsNaN(probs), nan_zero, probs), probs])
        out = op.Transpose(op.MatMul(probs, v_all), perm=[0, 2, 1, 3])
        # One output: a multi-output pattern makes onnxscript's matcher try every combination of
        # candidate nodes (hours on a 30-layer graph). GQA's present outputs are wired to the graph
        # outputs afterwards (:func:`reroute_presents`).
        return op.Reshape(out, pattern.ANY_VALUE, _outputs=["attn"])

    def check(self, context, q_bsd, k_bsd, v_bsd, past_key, past_value, position_ids, cos, sin, mask,
              q_scale, k_scale, q_rope, k_rope, attn, nan_zero=None, rep_axes_k=None, rep_axes_v=None, **_):
        r = pattern.MatchResult()
        model = context.model
        q_node = q_rope.producer()
        where = q_node.name or "attention"
        if not (_graph_input(model, past_key, past_key.name) and past_key.name.startswith("past_key_values.")
                and _graph_input(model, past_value, past_value.name)):
            return r.fail(f"{where}: the past K/V of the Concat are not past_key_values.* graph inputs",
                          [past_key, past_value])
        if not _graph_input(model, position_ids, "position_ids"):
            return r.fail(f"{where}: RotaryEmbedding does not read the position_ids graph input", position_ids)
        ps = past_key.shape
        if ps is None or ps.rank() != 4 or not isinstance(ps[1], int) or not isinstance(ps[3], int):
            return r.fail(f"{where}: past key shape {ps} is not [batch, kv_heads, past, head_dim] "
                          "with static kv_heads and head_dim", past_key)
        kv_heads, head_dim = int(ps[1]), int(ps[3])
        if head_dim % 16:
            return r.fail(f"{where}: head_dim {head_dim} is not a multiple of 16 (ORT's CPU GroupQueryAttention "
                          "requires it)", past_key)
        if past_key.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
            return r.fail(f"{where}: KV cache type {past_key.dtype} (GroupQueryAttention takes float32/float16)",
                          past_key)
        # num_heads: RotaryEmbedding attribute, else the query width / head_dim
        nh = None
        q_width = _proj_width(q_bsd)
        if q_width is not None and q_width % head_dim == 0:
            nh = q_width // head_dim
        if nh is None or nh % kv_heads:
            return r.fail(f"{where}: cannot tell num_heads (query width {q_width}, head_dim {head_dim}, "
                          f"kv_heads {kv_heads})", q_bsd)
        for rot in (q_node, k_rope.producer()):
            rd = rot.attributes.get_int("rotary_embedding_dim", 0)
            if rd not in (0, head_dim):
                return r.fail(f"{rot.name}: partial rotary (rotary_embedding_dim={rd} < head_dim {head_dim}) "
                              "is not fused", rot)
        if q_node.attributes.get_int("interleaved", 0) != k_rope.producer().attributes.get_int("interleaved", 0):
            return r.fail(f"{where}: q and k rotary interleaving differ", [q_rope, k_rope])
        cs = cos.const_value
        if cs is None or len(cs.shape) != 2 or 2 * cs.shape[1] != head_dim:
            return r.fail(f"{where}: cos cache is not a constant [max_pos, head_dim/2]", cos)
        sq, sk = _scalar(q_scale), _scalar(k_scale)
        if sq is None or sk is None:
            return r.fail(f"{where}: q/k scale factors are not constants", [q_scale, k_scale])
        for ax, what in ((rep_axes_k, "key"), (rep_axes_v, "value")):
            if ax is not None and _ints(ax) != [2]:
                return r.fail(f"{where}: repeat_kv of the {what} unsqueezes axes {_ints(ax)}, expected [2]", ax)
        if nan_zero is not None and _scalar(nan_zero) != 0.0:
            return r.fail(f"{where}: the Softmax NaN guard does not write 0", nan_zero)
        # the additive mask must come from attention_mask (causal + padding), nothing learnt
        deps, bounded = _fan_in_inputs(mask)
        if not bounded or deps != {"attention_mask"}:
            return r.fail(f"{where}: the attention mask is not computed from attention_mask alone "
                          f"(depends on {sorted(deps)})", mask)
        self._attention_mask = next(i for i in model.graph.inputs if i.name == "attention_mask")
        self._num_heads, self._kv_heads, self._head_dim = nh, kv_heads, head_dim
        self._interleaved = q_node.attributes.get_int("interleaved", 0)
        self._scale = sq * sk
        return r

    def rewrite(self, op, q_bsd, k_bsd, v_bsd, past_key, past_value, position_ids, cos, sin, attn, **_):
        am = self._attention_mask
        # seqlens_k = sum(attention_mask) - 1 (int32), total_sequence_length = attention_mask.shape[1]
        # (the onnxruntime-genai builder's subgraph; CSE later keeps one copy for all layers)
        one = op.Constant(value=ir.tensor(np.array([1], dtype=np.int64)))
        seqlens = op.Cast(op.Sub(op.ReduceSum(am, one, keepdims=0), op.Constant(value_int=1)),
                          to=ir.DataType.INT32)
        total = op.Cast(op.Gather(op.Shape(am), op.Constant(value_int=1), axis=0), to=ir.DataType.INT32)
        attrs = dict(num_heads=self._num_heads, kv_num_heads=self._kv_heads, do_rotary=1,
                     rotary_interleaved=self._interleaved)
        if not math.isclose(self._scale, 1.0 / math.sqrt(self._head_dim), rel_tol=1e-6):
            attrs["scale"] = float(self._scale)
        scope = (attn.producer().name or "").rsplit("/", 1)[0]
        out, _present_key, _present_value = op.GroupQueryAttention(
            q_bsd, k_bsd, v_bsd, past_key, past_value, seqlens, total, cos, sin, _domain=MS, _outputs=3,
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
