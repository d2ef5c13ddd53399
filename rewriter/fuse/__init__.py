"""The fast form of a decoder: an optimum `text-generation-with-past` export (Llama family) rewritten
into ONNX Runtime's fused contrib ops, the graph the onnxruntime-genai model builder writes.

    import onnx_ir as ir
    from rewriter.fuse import fuse_decoder
    fused, report = fuse_decoder(ir.load("model.onnx"))     # a new ir.Model; the input is not changed
    ir.save(fused, "model.fused.onnx")

Who does what (in this order):

1. ORT's transformer optimizer (``onnxruntime.transformers.optimizer``, only its normalization and
   rotary fusions): RMSNorm → ``SimplifiedLayerNormalization``, residual Add + RMSNorm →
   ``SkipSimplifiedLayerNormalization``, the rotate-half rotary → ``com.microsoft.RotaryEmbedding``
   with ``cos_cache``/``sin_cache`` initializers computed from the export's ``inv_freq``.
   onnxscript's RMSNorm rule does not match the optimum form (``Div(1, Sqrt)`` instead of
   ``Reciprocal``) and its rotary rules expect the dynamo exporter's graph, so ORT's code does it.
2. :mod:`rewriter.fuse.rules` (onnxscript rewriter patterns written here): the attention core →
   ``GroupQueryAttention`` with ``do_rotary=1`` (the RotaryEmbedding nodes go into it), then q/k/v
   packed into one MatMul feeding GQA's packed input.
3. onnx-ir passes: common-subexpression elimination (one ``seqlens_k``/``total_sequence_length``
   subgraph for all layers) and dead-code removal — which takes the optimum export's shape
   subgraphs (Shape/Gather/Unsqueeze/Concat/Expand/Where …) and its 4-D mask computation with it.

The graph I/O does not change: ``input_ids``, ``attention_mask``, ``position_ids`` (kept as an
input, no longer read: GQA computes positions from ``attention_mask`` as the genai builder's graph
does), ``past_key_values.N.key/value`` → ``logits``, ``present.N.key/value`` in the export's
``[batch, kv_heads, seq, head_dim]`` layout, so :mod:`custom_ops.runtime`'s loop (``ModelIO``,
``feeds``, ``perplexity``, ``generate``) drives it unchanged. Contract of the fused graph (GQA's):
each sequence's tokens are contiguous from position 0 — ``attention_mask`` all ones for batch 1 or
equal-length batches, which is what ``runtime.feeds`` builds; left-padded batches are not
equivalent (GQA takes ``sum(attention_mask) - 1`` as the last position of every row).
"""
from __future__ import annotations

import collections
import logging
import re
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from ..errors import OrtleanError
from ..kit import modelfile
from . import rules

__all__ = ["FuseError", "FuseReport", "fuse_decoder", "is_fused", "FUSED_OPS"]

FUSED_OPS = ("GroupQueryAttention", "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization")
_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")


class FuseError(OrtleanError):
    """The model is not a graph this pass can fuse; the message names the node and the reason."""


@dataclass
class FuseReport:
    nodes_before: int
    nodes_after: int
    layers: int
    fusions: dict = field(default_factory=dict)      # what each step fused (counts)
    ops_after: dict = field(default_factory=dict)    # op_type -> count in the result
    note: str = ""

    def summary(self) -> str:
        f = ", ".join(f"{k} {v}" for k, v in self.fusions.items())
        return (f"fused {self.layers} layers: {self.nodes_before} -> {self.nodes_after} nodes ({f})"
                + (f"; {self.note}" if self.note else ""))


def is_fused(model: ir.Model) -> bool:
    return any(n.op_type == "GroupQueryAttention" for n in model.graph)


def _layers(model: ir.Model) -> list[int]:
    return sorted({int(m.group(1)) for i in model.graph.inputs if (m := _PAST.match(i.name))})


def _check_input(model: ir.Model) -> list[int]:
    names = {i.name for i in model.graph.inputs}
    outs = {o.name for o in model.graph.outputs}
    missing = [n for n in ("input_ids", "attention_mask", "position_ids") if n not in names]
    layers = _layers(model)
    if missing or not layers or "logits" not in outs:
        raise FuseError("fuse: not an optimum text-generation-with-past decoder: "
                        + (f"inputs {missing} missing" if missing else
                           "no past_key_values.N.key/value inputs" if not layers else "no logits output"))
    for i in layers:
        for kv in ("key", "value"):
            if f"present.{i}.{kv}" not in outs:
                raise FuseError(f"fuse: input past_key_values.{i}.{kv} has no present.{i}.{kv} output")
    return layers


def _weights_as_inputs(model: ir.Model) -> dict[str, ir.Value]:
    """The weights (B of MatMul/Gemm, data of Gather): ORT's optimizer never needs their values,
    so they are handed to it as typed graph inputs instead of initializers — the ModelProto stays
    small (no 2 GB protobuf limit, less to copy)."""
    out = {}
    for name, v in model.graph.initializers.items():
        t = v.const_value
        if t is None or t.nbytes < 1024 or not v.uses():
            continue
        if all(u.node.domain == "" and ((u.node.op_type in ("MatMul", "Gemm") and u.idx == 1)
                                        or (u.node.op_type == "Gather" and u.idx == 0)) for u in v.uses()):
            out[name] = v
    return out


def _ort_normalization_and_rotary(model: ir.Model) -> tuple[ir.Model, dict]:
    """Step 1: ORT's own fusions on the ModelProto (only RMSNorm, skip-RMSNorm and rotary)."""
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    opts = FusionOptions("gpt2")
    for flag in ("enable_gelu", "enable_attention", "enable_embed_layer_norm", "enable_bias_gelu",
                 "enable_bias_skip_layer_norm", "enable_qordered_matmul", "enable_gelu_approximation"):
        setattr(opts, flag, False)
    opts.enable_layer_norm = True        # includes SimplifiedLayerNormalization (RMSNorm)
    opts.enable_skip_layer_norm = True   # includes SkipSimplifiedLayerNormalization
    opts.enable_rotary_embeddings = True
    weights = _weights_as_inputs(model)
    for name, v in weights.items():          # the input model is restored below
        del model.graph.initializers[name]
        model.graph.inputs.append(v)
    try:
        # the other tensors in external data (initializers and Constant nodes' values) go in with
        # their data inline: ORT's shape inference resolves external-data paths against the
        # working directory
        with modelfile.external_inlined(model):
            proto = ir.serde.serialize_model(model)
    finally:
        for name, v in weights.items():
            model.graph.inputs.remove(v)
            model.graph.initializers[name] = v
    quiet = [logging.getLogger(n) for n in ("onnxruntime.transformers", "fusion_base", "onnx_model",
                                            "onnx_model_bert", "optimizer", "fusion_utils")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        om = optimizer.optimize_model(proto, model_type="gpt2", num_heads=0, hidden_size=0, opt_level=0,
                                      optimization_options=opts, use_gpu=False, only_onnxruntime=False)
    finally:
        for lg, lv in zip(quiet, levels):
            lg.setLevel(lv)
    counts = collections.Counter(n.op_type for n in om.model.graph.node)
    out = ir.serde.deserialize_model(om.model)
    by_name = {v.name: v for v in out.graph.inputs}
    for name, v in weights.items():
        nv = by_name.get(name)
        if nv is None:
            raise FuseError(f"fuse: weight {name} disappeared in ORT's optimizer")
        out.graph.inputs.remove(nv)
        nv.const_value = v.const_value
        out.graph.initializers[name] = nv
    return out, {k: counts.get(k, 0) for k in ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
                                               "RotaryEmbedding")}


def _rule_set(rs):
    from onnxscript.rewriter import pattern

    return pattern.RewriteRuleSet(list(rs))


def _explain_unfused(model: ir.Model, rule) -> str:
    """The first attention core (Softmax) the GQA rule did not take, and the matcher's reason for
    the nearest pattern root after it (the Reshape that feeds o_proj)."""
    left = [n for n in model.graph if n.op_type == "Softmax"]
    if not left:
        return "no Softmax attention core found"
    s = left[0]
    reason, frontier = None, [s]
    for _ in range(8):  # Softmax -> [Where] -> MatMul -> Transpose -> Reshape
        nxt = [u.node for n in frontier for o in n.outputs for u in o.uses()]
        for n in nxt:
            if n.op_type == "Reshape":
                res = rule.match(model, model.graph, n, check_nodes_are_removable=False)
                if not res:
                    reason = res.reason
                    break
        if reason or not nxt:
            break
        frontier = nxt
    return f"{s.name}: not fused: {reason or 'no o_proj input Reshape after it (not an attention core)'}"


def _trim_rotary_caches(model: ir.Model, rows: int) -> int:
    seen = set()
    for node in model.graph:
        if node.op_type != "GroupQueryAttention":
            continue
        for v in node.inputs[7:9]:
            if v is None or id(v) in seen or v.const_value is None:
                continue
            seen.add(id(v))
            a = v.const_value.numpy()
            if a.shape[0] > rows:
                v.const_value = ir.tensor(np.ascontiguousarray(a[:rows]), name=v.name)
                v.shape = ir.Shape(v.const_value.shape)
    return rows


# optional outputs nobody reads (ORT's kernels skip what is absent; onnx-ir names empty outputs "v", "v_1" …)
_OPTIONAL_OUTPUTS = {("com.microsoft", "SkipSimplifiedLayerNormalization"): (1, 2, 3),
                     ("com.microsoft", "SkipLayerNormalization"): (1, 2, 3),
                     ("", "SimplifiedLayerNormalization"): (1,), ("", "LayerNormalization"): (1, 2)}


def _drop_unused_optional_outputs(model: ir.Model) -> int:
    """Make the unused optional outputs of the normalizations absent (the mean / inverse std-dev
    SkipSimplifiedLayerNormalization would otherwise allocate and write at every step, as the genai
    builder's graph does not). Returns how many were dropped."""
    n = 0
    for node in model.graph:
        for i in _OPTIONAL_OUTPUTS.get((node.domain, node.op_type), ()):
            if i < len(node.outputs):
                v = node.outputs[i]
                if v.name and not v.uses() and not v.is_graph_output():
                    v.name = ""
                    n += 1
    return n


def fuse_decoder(model: ir.Model, *, pack_qkv: bool = True, max_positions: int | None = None
                 ) -> tuple[ir.Model, FuseReport]:
    """Rewrite an optimum Llama-family decoder with past into ORT's fused ops (a new model; the input
    is not changed). Raises :class:`FuseError` naming the node and the reason when an attention core
    does not match; a model that is already fused comes back unchanged with a note.

    ``max_positions``: rows kept in the rotary cos/sin caches (ORT's rotary fusion writes 131072;
    e.g. the config's ``max_position_embeddings``, as the genai builder does — positions beyond it
    then fail in GroupQueryAttention instead of extrapolating). Measured: the cache length does not
    change GQA's speed, only the model's size."""
    layers = _check_input(model)
    nodes_before = sum(1 for _ in model.graph)
    if is_fused(model):
        ops = collections.Counter(n.op_type for n in model.graph)
        return model, FuseReport(nodes_before, nodes_before, len(layers), {}, dict(ops),
                                 note="already fused (GroupQueryAttention present): unchanged")
    fused, counts = _ort_normalization_and_rotary(model)
    fusions = {"ort:" + k: v for k, v in counts.items()}
    gqa_rule = rules.OptimumAttentionToGQA.rule()
    n = _rule_set([gqa_rule]).apply_to_model(fused)
    fusions["GroupQueryAttention"] = n
    rerouted = rules.reroute_presents(fused)
    if n != len(layers) or rerouted != 2 * len(layers):
        raise FuseError(f"fuse: {n} of {len(layers)} attention layers matched; " + _explain_unfused(fused, gqa_rule))
    common_passes.RemoveUnusedNodesPass()(fused)   # the unfused K/V path, dead since the reroute
    if pack_qkv:
        fusions["packed_qkv"] = _rule_set([rules.PackQKV.rule()]).apply_to_model(fused)
    if max_positions:
        fusions["rotary_cache_rows"] = _trim_rotary_caches(fused, int(max_positions))
    common_passes.CommonSubexpressionEliminationPass()(fused)
    common_passes.RemoveUnusedNodesPass()(fused)
    common_passes.RemoveUnusedFunctionsPass()(fused)
    common_passes.RemoveUnusedOpsetsPass()(fused)
    fusions["unused_outputs_dropped"] = _drop_unused_optional_outputs(fused)
    left = [x.name for x in fused.graph if x.op_type in ("RotaryEmbedding", "Softmax")
            or (x.op_type != "GroupQueryAttention" and any(i is not None and i.name.startswith("past_key_values.")
                                                            for i in x.inputs))]
    if left:
        raise FuseError(f"fuse: {left[0]}: still computed after the attention fusion (another consumer of "
                        "its values keeps the unfused path alive)")
    ops = collections.Counter(x.op_type for x in fused.graph)
    return fused, FuseReport(nodes_before, sum(ops.values()), len(layers), fusions, dict(ops))
