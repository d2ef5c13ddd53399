"""The fast form of a decoder: an optimum `text-generation-with-past` export (Llama, Qwen2,
Mistral, Phi-3, Gemma 2, Gemma 3 …) rewritten into ONNX Runtime's fused contrib ops, the graph the
onnxruntime-genai model builder writes.

    import onnx_ir as ir
    from rewriter.fuse import fuse_decoder
    fused, report = fuse_decoder(ir.load("model.onnx"))     # a new ir.Model; the input is not changed
    ir.save(fused, "model.fused.onnx")

Who does what (in this order):

1. ORT's transformer optimizer (``onnxruntime.transformers.optimizer``, only its normalization
   fusions): RMSNorm → ``SimplifiedLayerNormalization`` (Gemma's (1 + w) folded into the scale by
   the export), residual Add + RMSNorm → ``SkipSimplifiedLayerNormalization``. onnxscript's RMSNorm
   rule does not match the optimum form (``Div(1, Sqrt)`` instead of ``Reciprocal``). ORT's rotary
   fusion is not used: it knows a few rope forms and writes one cos/sin cache for every layer.
2. :mod:`rewriter.fuse.rules` (onnxscript rewriter patterns written here): the attention core →
   ``GroupQueryAttention`` with ``do_rotary=1``: the rotate-half rotary (whole head or partial),
   the scale, a logit soft-cap (``softcap``), a sliding window (``local_window_size``) and per-head
   q/k RMSNorms (kept in front of GQA) are read from the graph; the masks and rotary tables the
   export computes from its inputs are measured by :mod:`rewriter.fuse.probe` (sub-graphs cut out
   and run in ORT for chosen lengths) and must be what GQA computes itself: the rotary rows become
   ``cos_cache``/``sin_cache`` (``max_positions`` rows; one pair per distinct table). Then q/k/v
   packed into one MatMul feeding GQA's packed input (or read packed when the checkpoint packs
   them, Phi-3's ``qkv_proj``).
3. onnx-ir passes: common-subexpression elimination (one ``seqlens_k``/``total_sequence_length``
   subgraph for all layers) and dead-code removal — which takes the optimum export's shape
   subgraphs (Shape/Gather/Unsqueeze/Concat/Expand/Where …), its 4-D mask and rotary computations
   with it.

The graph I/O does not change: ``input_ids``, ``attention_mask``, ``position_ids`` when the export
has it (kept as an input, no longer read: GQA computes positions from ``attention_mask`` as the
genai builder's graph does; Gemma's exports have none), ``past_key_values.N.key/value`` →
``logits``, ``present.N.key/value`` in the export's ``[batch, kv_heads, seq, head_dim]`` layout,
so :mod:`custom_ops.runtime`'s loop (``ModelIO``, ``feeds``, ``perplexity``, ``generate``) drives it
unchanged. Contract of the fused graph (GQA's): each sequence's tokens are contiguous from position
0 — ``attention_mask`` all ones for batch 1 or equal-length batches, which is what
``runtime.feeds`` builds; left-padded batches are not equivalent (GQA takes ``sum(attention_mask)
- 1`` as the last position of every row), and after a right-padded prefill an export without
position_ids or with a sliding window counts the padding slots where GQA does not.
"""
from __future__ import annotations

import collections
import logging
import re
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from ..errors import OrtleanError
from ..kit import modelfile
from . import rules
from .probe import GraphProbe, ProbeError, mask_window, rotary_table

__all__ = ["FuseError", "FuseReport", "fuse_decoder", "is_fused", "FUSED_OPS"]

FUSED_OPS = ("GroupQueryAttention", "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization")
DEFAULT_ROTARY_ROWS = 131072   # as ORT's rotary fusion: most contexts up to 128k
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
    missing = [n for n in ("input_ids", "attention_mask") if n not in names]
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


def _weightless_proto(model: ir.Model):
    """The model as a ModelProto whose weights (:func:`_weights_as_inputs`) are typed graph inputs
    instead of initializers (small: no 2 GB protobuf limit, less to copy; ORT's optimizer and the
    probe's shape inference need only their shapes), and those weights by name."""
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
    return proto, weights


def _ort_normalization(proto, weights: dict[str, ir.Value]) -> tuple[ir.Model, dict]:
    """Step 1: ORT's own fusions on the ModelProto (only RMSNorm and skip-RMSNorm; its rotary
    fusion writes one cache for every layer and knows a few rope forms, so the attention rule
    measures the tables itself)."""
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    opts = FusionOptions("gpt2")
    for flag in ("enable_gelu", "enable_attention", "enable_embed_layer_norm", "enable_bias_gelu",
                 "enable_bias_skip_layer_norm", "enable_qordered_matmul", "enable_gelu_approximation",
                 "enable_rotary_embeddings"):
        setattr(opts, flag, False)
    opts.enable_layer_norm = True        # includes SimplifiedLayerNormalization (RMSNorm)
    opts.enable_skip_layer_norm = True   # includes SkipSimplifiedLayerNormalization
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
    return out, {k: counts.get(k, 0) for k in ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")}


def _layers_n(n: int) -> str:
    return f"{n} layer" if n == 1 else f"{n} layers"


class Analysis:
    """What the attention rule measures on the export (:mod:`rewriter.fuse.probe`), once per
    value: the sliding window of each distinct mask, the rotary cache pair of each distinct rotary
    table (``rows`` positions), the head count of a head split; and what each fused layer got."""

    def __init__(self, probe: GraphProbe, graph: ir.Graph, rows: int):
        self.probe, self.graph, self.rows = probe, graph, int(rows)
        self._windows: dict[str, int | str] = {}
        self._caches: dict[tuple, tuple] = {}
        self._ints: dict[str, list | None] = {}
        self.layers: dict[str, dict] = {}
        self.last_failure: str | None = None

    def ints(self, v: ir.Value | None) -> list[int] | None:
        """An integer input of a matched node: its constant, else what the export computes for it
        from shapes (evaluated for two input lengths; None unless both agree)."""
        from .rules import _ints

        c = _ints(v)
        if c is not None or v is None or not v.name:
            return c
        if v.name not in self._ints:
            try:
                a = [self.probe.evaluate([v.name], batch=b, seq=s, past=p)[0] for b, s, p in ((1, 3, 2), (2, 6, 3))]
                same = a[0].shape == a[1].shape and np.array_equal(a[0], a[1]) and a[0].dtype.kind == "i"
                self._ints[v.name] = [int(x) for x in a[0].reshape(-1)] if same else None
            except ProbeError:
                self._ints[v.name] = None
        return self._ints[v.name]

    def heads(self, bshd: ir.Value, head_dim: int, where: str) -> int:
        from .rules import Unmatched

        shp = self.probe.shapes(1, 3, 2).get(bshd.name)
        if not shp or len(shp) != 4 or not all(isinstance(d, int) for d in shp) or shp[1] != 3:
            raise Unmatched(f"{bshd.name}: the head split's shape is unknown ({shp}) for 3 tokens")
        if shp[3] != head_dim:
            raise Unmatched(f"{bshd.name}: heads of {shp[3]}, the cache's head_dim is {head_dim}")
        return int(shp[2])

    def window(self, mask: ir.Value, where: str) -> int:
        from .rules import Unmatched

        if mask.name not in self._windows:
            try:
                self._windows[mask.name] = mask_window(self.probe, mask.name, self.rows)
            except ProbeError as e:
                self._windows[mask.name] = str(e)
        w = self._windows[mask.name]
        if isinstance(w, str):
            raise Unmatched(f"mask {w}")
        return w

    def caches(self, cos: ir.Value, sin: ir.Value, dtype: ir.DataType, where: str) -> tuple[ir.Value, ir.Value]:
        """GQA's cos/sin caches (``dtype``: the KV cache's) for the export's rotary tables."""
        from .rules import Unmatched

        key = (cos.name, sin.name, dtype)
        if key not in self._caches:
            try:
                c, s = rotary_table(self.probe, cos.name, sin.name, self.rows)
                i = len([v for v in self._caches.values() if not isinstance(v, str)])
                sfx = "" if i == 0 else f"_{i}"
                vals = []
                for nm, arr in ((f"cos_cache{sfx}", c), (f"sin_cache{sfx}", s)):
                    arr = arr.astype(dtype.numpy())
                    v = ir.Value(name=nm, const_value=ir.tensor(arr, name=nm), type=ir.TensorType(dtype),
                                 shape=ir.Shape(arr.shape))
                    self.graph.initializers[nm] = v
                    vals.append(v)
                self._caches[key] = tuple(vals)
            except ProbeError as e:
                self._caches[key] = str(e)
        got = self._caches[key]
        if isinstance(got, str):
            raise Unmatched(f"rotary {got}")
        return got

    def record(self, where: str, **facts) -> None:
        self.layers[where] = facts

    def summary(self) -> str:
        """One clause per feature of the fused layers (sliding windows, soft-cap, q/k norms,
        partial rotary, rotary caches), empty when none."""
        L = list(self.layers.values())
        out = []
        wins = collections.Counter(f["window"] for f in L if f["window"] > 0)
        for w, n in sorted(wins.items()):
            out.append(f"sliding window {w} on {n} of {len(L)} layers")
        caps = collections.Counter(f["softcap"] for f in L if f["softcap"] > 0)
        for c, n in sorted(caps.items()):
            out.append(f"softcap {c:g} on {n} of {len(L)} layers")
        if any(f["norm"] for f in L):
            out.append(f"q/k RMSNorm before GroupQueryAttention on {sum(f['norm'] for f in L)} of {len(L)} layers")
        part = [f for f in L if f["rotary_dim"] < f["head_dim"]]
        if part:
            out.append(f"partial rotary ({part[0]['rotary_dim']} of {part[0]['head_dim']} dims)")
        caches = sorted({f["cache"].name for f in L})
        if len(caches) > 1:
            out.append("rotary caches " + ", ".join(f"{c} ({_layers_n(sum(f['cache'].name == c for f in L))})"
                                                    for c in caches))
        return "; ".join(out)


def _rule_set(rs):
    from onnxscript.rewriter import pattern

    return pattern.RewriteRuleSet(list(rs))


def _explain_unfused(model: ir.Model, rule, analysis: "Analysis") -> str:
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
                analysis.last_failure = None
                res = rule.match(model, model.graph, n, check_nodes_are_removable=False)
                if not res:
                    reason = (analysis.last_failure or getattr(res, "reason", None)
                              or "not the attention pattern (Softmax(scores + mask) · v)")
                    break
        if reason or not nxt:
            break
        frontier = nxt
    return f"{s.name}: not fused: {reason or 'no o_proj input Reshape after it (not an attention core)'}"


def _name_caches_by_layer_type(model: ir.Model) -> None:
    """Two rotary cache pairs, one read only by sliding-window layers and one only by the others
    (Gemma 3): name them ``cos_cache_local`` / ``cos_cache_global`` as the genai builder does."""
    use: dict[int, tuple[ir.Value, ir.Value, set]] = {}
    for n in model.graph:
        if n.op_type == "GroupQueryAttention" and len(n.inputs) > 8 and n.inputs[7] is not None:
            local = n.attributes.get_int("local_window_size", -1) > 0
            use.setdefault(id(n.inputs[7]), (n.inputs[7], n.inputs[8], set()))[2].add(local)
    if len(use) != 2 or sorted(len(u[2]) for u in use.values()) != [1, 1] \
            or {next(iter(u[2])) for u in use.values()} != {True, False}:
        return
    for cos, sin, kinds in use.values():
        sfx = "local" if True in kinds else "global"
        for v, stem in ((cos, "cos_cache"), (sin, "sin_cache")):
            del model.graph.initializers[v.name]
            v.name = f"{stem}_{sfx}"
            v.const_value.name = v.name
            model.graph.initializers[v.name] = v


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
    """Rewrite an optimum decoder with past (Llama, Qwen2, Mistral, Phi-3, Gemma 2, Gemma 3 …) into
    ORT's fused ops (a new model; the input is not changed). Raises :class:`FuseError` naming the
    node and the reason when an attention core does not match; a model that is already fused
    comes back unchanged with a note.

    ``max_positions``: rows of the rotary cos/sin caches (the config's ``max_position_embeddings``,
    as the genai builder does; 131072 when not given) — positions beyond it fail in
    GroupQueryAttention instead of extrapolating, and a sliding window is detected up to it.
    Measured: the cache length does not change GQA's speed, only the model's size."""
    layers = _check_input(model)
    nodes_before = sum(1 for _ in model.graph)
    if is_fused(model):
        ops = collections.Counter(n.op_type for n in model.graph)
        return model, FuseReport(nodes_before, nodes_before, len(layers), {}, dict(ops),
                                 note="already fused (GroupQueryAttention present): unchanged")
    proto, weights = _weightless_proto(model)
    probe_proto = onnx.ModelProto()
    probe_proto.CopyFrom(proto)           # ORT's optimizer edits the proto it is given
    rows = int(max_positions) if max_positions else DEFAULT_ROTARY_ROWS
    fused, counts = _ort_normalization(proto, weights)
    fusions = {"ort:" + k: v for k, v in counts.items()}
    analysis = Analysis(GraphProbe(probe_proto, weights), fused.graph, rows)
    gqa_rule = rules.OptimumAttentionToGQA.rule(analysis)
    n = _rule_set([gqa_rule]).apply_to_model(fused)
    fusions["GroupQueryAttention"] = n
    rerouted = rules.reroute_presents(fused)
    if n != len(layers) or rerouted != 2 * len(layers):
        raise FuseError(f"fuse: {n} of {len(layers)} attention layers matched; " + _explain_unfused(fused, gqa_rule, analysis))
    common_passes.RemoveUnusedNodesPass()(fused)   # the unfused K/V path, dead since the reroute
    fusions["packed_qkv"] = _rule_set([rules.SlicedQKV.rule()]).apply_to_model(fused)   # packed in the checkpoint
    if pack_qkv:
        fusions["packed_qkv"] += _rule_set([rules.PackQKV.rule()]).apply_to_model(fused)
    _name_caches_by_layer_type(fused)
    fusions["rotary_caches"] = len({id(x.inputs[7]) for x in fused.graph if x.op_type == "GroupQueryAttention"})
    fusions["rotary_cache_rows"] = rows
    common_passes.CommonSubexpressionEliminationPass()(fused)
    common_passes.RemoveUnusedNodesPass()(fused)
    common_passes.RemoveUnusedFunctionsPass()(fused)
    common_passes.RemoveUnusedOpsetsPass()(fused)
    fusions["unused_outputs_dropped"] = _drop_unused_optional_outputs(fused)
    left = [x.name for x in fused.graph if x.op_type in ("RotaryEmbedding", "Softmax", "Cos", "Sin")
            or (x.op_type != "GroupQueryAttention" and any(i is not None and i.name.startswith("past_key_values.")
                                                            for i in x.inputs))]
    if left:
        raise FuseError(f"fuse: {left[0]}: still computed after the attention fusion (another consumer of "
                        "its values keeps the unfused path alive)")
    ops = collections.Counter(x.op_type for x in fused.graph)
    return fused, FuseReport(nodes_before, sum(ops.values()), len(layers), fusions, dict(ops), note=analysis.summary())
