"""``--weights fp32|int8|int4``: the weight precision of every layer no other backend takes
(the lm_head included) — ONNX Runtime's ``com.microsoft.MatMulNBits``, each weight quantized by
ORT's own block quantizer (``rewriter.quantize``: the code ``MatMulNBitsQuantizer`` runs per node;
block size, symmetry and ``accuracy_level`` are ``rewriter.quantize.DEFAULTS``, chosen by
``tests/bench/bench_weights.py``).

It is the LAST entry of ``WEIGHT_BACKENDS``: the pipeline tries backends in order and the first
non-dense plan takes a layer, so this one sees exactly the layers the others left dense. Its plans
are *pinned* in the end-to-end quality guard: the guard measures quantization plus every other
backend together against the fp32 model, keeps the quantization (the precision the user asked
for) and drops other backends' plans — lowest gap kept first — until the budget holds; a layer a
backend loses to the guard is quantized instead (``fallback``)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from ..kit import gaps, surgery
from ..kit.backend import GraphPassBase, Plan, WeightBackendBase
from ..kit.candidates import Candidate, GroupCandidate
from ..kit.options import Options, flag, from_args, onoff
from .. import quantize

MS_DOMAIN = "com.microsoft"


@dataclass
class WeightsConfig(Options):
    weights: str = flag("--weights", "fp32", "precision of the weights no other backend takes: fp32 (as they are) | "
                        "int8 | int4 (ONNX Runtime MatMulNBits, lm_head included; default fp32)",
                        choices=quantize.WEIGHTS)
    embed: str = flag("--weights-embed", "shared", "with --weights int8|int4, a token embedding tied to the "
                      "lm_head: shared (default: it reads the head's quantized blocks through "
                      "GatherBlockQuantized, no bytes of its own, as ORT's model builder does) | fp32 (keeps "
                      "its float32 table)", choices=quantize.EMBED)
    enabled: bool = False
    targets: tuple = ("mlp", "attn", "head")


class WeightsBackend(WeightBackendBase):
    name = "weights"
    op_type = "MatMulNBits"
    Config = WeightsConfig
    title = "weight precision (ONNX Runtime MatMulNBits, for the layers no other backend takes)"
    pinned = True        # the quality guard keeps these plans (see the module docstring)

    @classmethod
    def config(cls, args, state_pack) -> WeightsConfig:
        cfg = from_args(WeightsConfig, args)
        cfg.enabled = cfg.weights != "fp32"
        cfg.validate()
        return cfg

    @property
    def label(self) -> str:
        return f"{self.cfg.weights} (MatMulNBits)"

    def needs_calibration(self) -> bool:
        return False     # the quantizer needs no data; a gap uses the Gram when another backend collected it

    def plan(self, cand: Candidate, W: np.ndarray, G: np.ndarray | None, ctx) -> Plan:
        if isinstance(cand, GroupCandidate):
            return Plan.dense(cand, "MatMulNBits quantizes single MatMuls, not a gated group")
        cfg = quantize.config_for(self.cfg.weights)
        packed, scales, zp = quantize.quantize_matrix(W, cfg)
        W_hat = quantize.dequantize_matrix(packed, scales, zp, cand.K, cfg)
        gap = gaps.layer_gap(W, W_hat, G)
        stored = packed.nbytes + scales.nbytes + (zp.nbytes if zp is not None else 0)
        how = (f"block {cfg.block_size}, {'symmetric' if cfg.symmetric else 'zero points'}, "
               f"accuracy_level {cfg.accuracy_level}; {stored / max(4 * cand.params, 1):.3f} of the fp32 bytes"
               + ("" if G is not None else "; gap = weight error (no calibration)"))
        tied = None
        if cand.target == "head" and self.cfg.embed == "shared" and ctx is not None and ctx.model is not None:
            g = quantize.tied_embedding(ctx.model.graph, W)
            if g is not None:
                tied = g.name
                how += f"; the tied token embedding ({tied}) reads these blocks (its {4 * W.size / 2**20:.1f} MiB float32 table dropped)"
        return Plan(self.label, how, gap, cand.params, payload=(packed, scales, zp, cfg, tied),
                    attrs={"bits": cfg.bits, "block_size": cfg.block_size, "bytes": int(stored)})

    def emit(self, graph: ir.Graph, cand: Candidate, plan: Plan, ctx) -> None:
        packed, scales, zp, cfg, tied = plan.payload
        base = surgery.safe_name(cand.name)
        inputs = [cand.input, surgery.initializer(graph, f"{base}.weight_Q{cfg.bits}", packed),
                  surgery.initializer(graph, f"{base}.weight_scales", scales)]
        if zp is not None:
            inputs.append(surgery.initializer(graph, f"{base}.weight_zero_points", zp))
        attrs = [ir.Attr("K", ir.AttributeType.INT, int(cand.K)), ir.Attr("N", ir.AttributeType.INT, int(cand.N)),
                 ir.Attr("bits", ir.AttributeType.INT, cfg.bits),
                 ir.Attr("block_size", ir.AttributeType.INT, cfg.block_size)]
        if cfg.accuracy_level:
            attrs.append(ir.Attr("accuracy_level", ir.AttributeType.INT, cfg.accuracy_level))
        node = ir.Node(MS_DOMAIN, "MatMulNBits", inputs, attrs, name=f"{cand.name}_Q{cfg.bits}")
        surgery.replace_node(graph, cand.node, node)
        graph.opset_imports.setdefault(MS_DOMAIN, 1)
        gather = next((n for n in graph if n.name == tied), None) if tied else None
        if gather is not None:
            quantize.share_embedding(graph, gather, node)


# --------------------------------------------------------------------------- --weights-pack (a "post" graph pass)
@dataclass
class PackConfig(Options):
    pack: bool = flag("--weights-pack", False, "with --weights int8|int4: MatMulNBits layers that read one input "
                      "(an MLP's gate and up) become one MatMulNBits over their blocks and a Split — the same "
                      "numbers, one weight stream and one kernel launch; default off: measured no faster on SmolLM2 int4)", type=onoff, metavar="on|off")
    enabled: bool = False
    targets: tuple = ()
    explicit: bool = False     # never a request by itself: --weights is


class WeightsPackPass(GraphPassBase):
    """After every weight backend emitted: ``rewriter.quantize.pack_shared_input`` on the graph
    (MatMulNBits of one input and one setting → one MatMulNBits + Split; layers other backends took
    are not MatMulNBits and stay as they are)."""
    name = "weights_pack"
    stage = "post"
    Config = PackConfig
    title = "packing of the MatMulNBits layers that share an input"

    @classmethod
    def config(cls, args, state_pack) -> PackConfig:
        cfg = from_args(PackConfig, args)
        cfg.enabled = cfg.pack and getattr(args, "weights", "fp32") != "fp32"
        return cfg

    def run(self, model, ctx) -> list[dict]:
        packed = quantize.pack_shared_input(model.graph)
        if not packed:
            return []
        return [{"layer": packed[0] if len(packed) == 1 else f"{packed[0]} … ({len(packed)})", "backend": "weights_pack",
                 "decision": f"{len(packed)} groups of MatMulNBits reading one input packed into one MatMulNBits + Split "
                             "each (the same numbers)"}]
