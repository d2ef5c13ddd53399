"""``--weights auto|fp32|int8|int4|gguf[,FALLBACK]``: the weight precision of every layer no other
backend takes (the lm_head included).

- ``int8`` / ``int4``: ONNX Runtime's ``com.microsoft.MatMulNBits``, each weight quantized by ORT's
  own block quantizer (``rewriter.quantize``: the code ``MatMulNBitsQuantizer`` runs per node; block
  size, symmetry and ``accuracy_level`` are ``rewriter.quantize.DEFAULTS``, chosen by
  ``tests/bench/bench_weights.py``).
- ``gguf`` (with ``--gguf FILE.gguf``, or by itself on a packaged model's export): every weight
  whose values are a GGUF tensor's dequantized blocks — transposed, rows permuted, several tensors
  concatenated — becomes ortlean's ``BlockQuantMatMul`` holding those blocks' bytes, copied, never
  re-quantized, and checked bit-exact (``rewriter.builders.gguf``); a weight the GGUF does not hold
  is refused by name, unless a fallback follows the comma: ``gguf,fp32`` keeps it, ``gguf,int8`` /
  ``gguf,int4`` quantize it to MatMulNBits, ``gguf,q8_0`` (or q5_1, q5_0, q4_1, q4_0) to
  BlockQuantMatMul blocks with the gguf package's own quantizer. A bias Add right after the MatMul
  (Qwen2's q/k/v) folds into the op's bias input. The token embedding tied to the head reads the
  head's blocks through ``BlockQuantGather`` (``--weights-embed shared``); an untied embedding that
  a GGUF tensor holds becomes a BlockQuantGather of its own blocks. ``--weights-layout`` (auto: split
  where the format takes it) writes W's rows in the op's "split" layout, the same bytes reordered
  (``rewriter.builders.blockgraph.row_layout`` / ``layout_bytes``); the tied embedding follows the head.
- ``int4`` on a float checkpoint (no GGUF): calibrated 4-bit blocks in ``BlockQuantMatMul`` —
  ``--weights-quantizer`` (GPTQ on the calibration Gram by default, or the k-quant search, HQQ, RTN),
  the format of each layer planned for the whole model under ``--quality-budget``
  (``rewriter.builders.floatweights``); ``--weights-quantizer nbits`` keeps MatMulNBits.
- ``auto`` (the default): ``gguf`` when ``--gguf`` is given or the model is a packaged model's
  export whose GGUF is known (``models.prepare.packaged_name`` / ``gguf_path``), else ``fp32``
  (``auto,FALLBACK``: the fallback for what the GGUF does not hold; without a GGUF, every layer).

It is the LAST entry of ``WEIGHT_BACKENDS``: the pipeline tries backends in order and the first
non-dense plan takes a layer, so this one sees exactly the layers the others left dense. Its plans
are *pinned* in the end-to-end quality guard: the guard measures quantization plus every other
backend together against the fp32 model, keeps the quantization (the precision the user asked
for) and drops other backends' plans — lowest gap kept first — until the budget holds; a layer a
backend loses to the guard is quantized instead (``fallback``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir

from custom_ops.reference import blockquant as bq

from ..errors import OrtleanError
from ..kit import gaps, modelfile, surgery
from ..kit.backend import GraphPassBase, Plan, WeightBackendBase
from ..kit.candidates import Candidate, GroupCandidate
from ..kit.options import Options, flag, from_args, onoff
from .. import quantize
from ..builders import blockgraph as BG
from ..builders import floatweights as weights_float

MS_DOMAIN = "com.microsoft"
SOURCES = ("auto", "gguf", *quantize.WEIGHTS)
FALLBACKS = ("fp32", "int8", "int4", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")


def parse_weights(spec: str) -> tuple[str, str | None]:
    """"gguf,q8_0" -> ("gguf", "q8_0"); names the flag and value when it is not one of the forms."""
    parts = [p.strip() for p in str(spec).split(",")]
    src, fb = parts[0], (parts[1] if len(parts) > 1 else None)
    if len(parts) > 2 or src not in SOURCES or (fb is not None and (src not in ("auto", "gguf") or fb not in FALLBACKS)):
        raise OrtleanError(f"--weights {spec!r}: one of {', '.join(SOURCES)}, or gguf,FALLBACK / auto,FALLBACK with "
                           f"FALLBACK one of {', '.join(FALLBACKS)} (what the GGUF does not hold becomes)")
    return src, fb


@dataclass
class WeightsConfig(Options):
    weights: str = flag("--weights", "auto", "precision of the weights no other backend takes: auto (default: gguf "
                        "when --gguf is given or the model is a packaged model's export with a known GGUF, else fp32) "
                        "| fp32 (as they are) | int8 | int4 (ONNX Runtime MatMulNBits, lm_head included) | gguf (the "
                        "GGUF's own blocks in BlockQuantMatMul, bit-exact; a weight the GGUF does not hold is an "
                        "error) | gguf,FALLBACK with FALLBACK fp32, int8, int4, q8_0, q5_1, q5_0, q4_1 or q4_0 (what "
                        "the GGUF does not hold is kept / quantized to that)", metavar="SPEC")
    gguf: str | None = flag("--gguf", None, "with --weights gguf|auto: the GGUF file whose blocks the model's weights "
                            "are (default for a packaged model's export: the GGUF it was built from)",
                            metavar="FILE.gguf")
    embed: str = flag("--weights-embed", "shared", "the token embedding: shared (default: tied to the lm_head, it "
                      "reads the head's quantized blocks — GatherBlockQuantized with int8|int4, BlockQuantGather with "
                      "gguf — no bytes of its own; with gguf an untied embedding the GGUF holds reads its own "
                      "blocks) | fp32 (keeps its float32 table)", choices=quantize.EMBED)
    act_bits: str = flag("--weights-act-bits", "auto", "BlockQuantMatMul's activations: integers of 8 or 16 bits per "
                         "block of 32 (docs/block-quant.md). auto (default): 16 where the weights are the GGUF's own "
                         "blocks (bit-exact weights: activation rounding is all they lose, and 8-bit rounding is "
                         "measurable in perplexity, see docs/weights.md), 8 where the weights "
                         "are quantized here (their own error dominates) | 8 | 16", choices=("auto", "8", "16"))
    prefill_act_bits: str = flag("--weights-prefill-act-bits", "auto", "BlockQuantMatMul's activations in calls of "
                                 "more than one row (a prompt's prefill; decode's one-row calls keep "
                                 "--weights-act-bits): auto (default) = the layer's act_bits (the lossless recipe's 16 "
                                 "stays 16) | 8 | 16. 8 under act_bits 16 halves the prefill's integer products "
                                 "(int16 activations cost two vpdpbusd each) for int8 rounding of the prompt rows; "
                                 "the quality guard measures it (its perplexity windows are such calls). Written as "
                                 "the node attribute prefill_act_bits where it differs from act_bits "
                                 "(docs/block-quant.md)", choices=("auto", "8", "16"))
    layout: str = flag("--weights-layout", "auto", "BlockQuantMatMul's row layout of W (docs/block-quant.md): auto "
                       "(default) = split on every layer whose format takes it (q4_0, q4_1, q5_0, q5_1, q8_0, q4_f "
                       "with block 32), blocks on the others (the K formats, q4_f with another block) | blocks = "
                       "ggml's block bytes, as in the GGUF, everywhere | split = as auto, but an error when no layer "
                       "takes it, and the summary names the layers that kept blocks and why. split reorders each "
                       "row's bytes (every block's integers, then the fp16 scales, then the mins) for the AVX-512 "
                       "M = 1 kernel: the same bytes, the same numbers, checked to give the blocks back; a tied token "
                       "embedding reads the head's initializer in the head's layout, an untied one keeps blocks",
                       choices=BG.LAYOUT_CHOICES)
    quantizer: str = flag("--weights-quantizer", "auto", "with --weights int4 on a float checkpoint: auto (default: "
                          "GPTQ on the calibration Gram with --calib-text, else the weighted k-quant search; nbits with "
                          "--kwta/--event-driven, whose gated layers hold MatMulNBits' values) | gptq | "
                          "kquant | hqq (ONNX Runtime's HQQ) | rtn (asymmetric round-to-nearest) into BlockQuantMatMul "
                          "blocks, the format of each layer planned under --quality-budget; nbits: ONNX Runtime's "
                          "MatMulNBits (symmetric round-to-nearest, block 32)", choices=weights_float.QUANTIZERS)
    max_bits: float | None = flag("--weights-bits", None, "with --weights int4 and a budget: the most bits/weight the "
                                  "planned mix may store (default: as many as the budget needs, up to q8_0's 8.5)",
                                  type=float)
    enabled: bool = False
    targets: tuple = ("mlp", "attn", "head")
    calibrated: bool = False        # --calib-text given (the float path's imatrix, GPTQ, gaps and mix use it)
    source: str = "fp32"            # resolved: fp32 | int8 | int4 | gguf
    fallback: str | None = None     # resolved: what a weight the GGUF does not hold becomes
    requested: str = "auto"         # --weights as given
    packaged: str | None = None     # the packaged model whose GGUF is used by default

    def resolve(self, model_path) -> None:
        """Decide ``source`` / ``fallback`` / ``gguf`` from the flags and the model path, and set
        ``weights`` to the effective spec ("gguf", "gguf,q8_0", "int4", "fp32" …)."""
        self.requested = self.weights
        src, fb = parse_weights(self.weights)
        if self.gguf is not None and src not in ("auto", "gguf"):
            raise OrtleanError(f"--gguf {self.gguf}: only with --weights gguf[,FALLBACK] or auto (not {self.weights!r})")
        if src in ("auto", "gguf") and self.gguf is None and model_path is not None:
            from models import prepare

            name = prepare.packaged_name(model_path)
            if name is not None:
                try:
                    g = prepare.gguf_path(name)
                except prepare.PrepareError:
                    g = None
                if g is not None and g.is_file():
                    self.gguf, self.packaged = str(g), name
        if src == "auto":
            if self.gguf is not None:
                src = "gguf"
            elif fb in (None, "fp32", "int8", "int4"):
                src, fb = (fb or "fp32"), None
            else:
                src = "gguf"        # auto,q8_0 without a GGUF: every layer quantized to q8_0 blocks
        if src == "gguf" and self.gguf is None and fb is None:
            raise OrtleanError(f"--weights {self.requested}: needs --gguf FILE.gguf ({model_path} is not a packaged "
                               "model's export with a known GGUF)")
        self.source, self.fallback = src, fb
        self.weights = src if fb is None else f"{src},{fb}"

    @property
    def float_path(self) -> bool:
        """--weights int4 into BlockQuantMatMul blocks (not MatMulNBits)."""
        return self.source == "int4" and self.quantizer != "nbits"

    def act_bits_for(self, exact: bool) -> int:
        """BlockQuantMatMul's act_bits for a layer whose blocks are the GGUF's own (``exact``) or were
        quantized here: --weights-act-bits, or auto's choice (16 on exact blocks, else 8)."""
        if self.act_bits != "auto":
            return int(self.act_bits)
        return 16 if exact else 8

    def prefill_act_bits_for(self, act_bits: int) -> int:
        """BlockQuantMatMul's prefill_act_bits for a layer of ``act_bits``: --weights-prefill-act-bits where it
        differs from ``act_bits``, else 0 (the attribute left out: calls of any M use act_bits). auto is
        conservative: the layer's act_bits."""
        if self.prefill_act_bits == "auto" or int(self.prefill_act_bits) == int(act_bits):
            return 0
        return int(self.prefill_act_bits)

    def layout_for(self, fmt: str, block_size: int | None, act_bits: int) -> tuple[str, str | None]:
        """W's row layout of a BlockQuantMatMul layer and why it is not "split" (``BG.row_layout``)."""
        return BG.row_layout(self.layout, fmt, block_size, act_bits)

    @property
    def explicit(self) -> bool:
        """Asked for by a flag (not --weights auto's choice for a packaged model's export): a model with
        no float weight MatMul is then an error, not a rewrite with nothing for this backend."""
        return not self.requested.startswith("auto") or (self.gguf is not None and self.packaged is None)

    def validate(self) -> None:
        if self.source == "gguf" and self.gguf is not None and not Path(self.gguf).is_file():
            raise OrtleanError(f"--gguf {self.gguf}: no such file")
        if self.layout == "split" and (self.source in ("fp32", "int8") or (self.source == "int4" and not self.float_path)):
            raise OrtleanError(f"--weights-layout split: only BlockQuantMatMul weights have a row layout, and "
                               f"--weights {self.weights}{' --weights-quantizer nbits' if self.source == 'int4' else ''} "
                               "writes none (--weights gguf, or int4 on a float checkpoint, does)")


class WeightsBackend(WeightBackendBase):
    name = "weights"
    op_type = "MatMulNBits"
    Config = WeightsConfig
    title = "weight precision (ONNX Runtime MatMulNBits or a GGUF's blocks, for the layers no other backend takes)"
    pinned = True        # the quality guard keeps these plans (see the module docstring)

    def __init__(self, cfg):
        super().__init__(cfg)
        self._gguf = None            # builders.gguf.GGUFSource, opened on first use
        self._untied = None          # (owner head's name, the untied embedding's plan) once looked for
        self._float = None           # weights_float.FloatWeights: --weights int4 on a float checkpoint

    @classmethod
    def config(cls, args, state_pack) -> WeightsConfig:
        cfg = from_args(WeightsConfig, args)
        cfg.resolve(getattr(args, "model", None))
        cfg.enabled = cfg.weights != "fp32"
        cfg.calibrated = bool(getattr(args, "calib_text", None))
        cfg.validate()
        return cfg

    def _float_path(self, ctx):
        """The float path's state, or None for MatMulNBits: also when --weights-quantizer is auto and the
        gating backend is enabled (its gated formats hold MatMulNBits' values: int4 compounds with it)."""
        if self._float is None and self.cfg.float_path:
            gating = ctx is not None and any(b.name == "gating" for b in getattr(ctx, "weight_backends", []))
            if self.cfg.quantizer == "auto" and gating:
                return None
            self._float = weights_float.FloatWeights(self.cfg.quantizer, self.cfg.max_bits, self.cfg.embed)
        return self._float

    @property
    def label(self) -> str:
        return f"{self.cfg.weights} (MatMulNBits)"

    def needs_calibration(self) -> bool:
        # MatMulNBits and GGUF blocks need no data (a gap uses the Gram when another backend collected it);
        # the float path uses the Grams (imatrix, GPTQ, gaps, the mix) whenever there is calibration text
        return self.cfg.float_path and self.cfg.calibrated

    def plan(self, cand: Candidate, W: np.ndarray, G: np.ndarray | None, ctx) -> Plan:
        if isinstance(cand, GroupCandidate):
            return Plan.dense(cand, f"--weights {self.cfg.weights} takes single MatMuls, not a gated group")
        if self.cfg.source == "gguf":
            return self._plan_gguf(cand, W, G, ctx)
        if self._float_path(ctx) is not None:
            return self._float.plan(self, cand, W, G, ctx)
        return self._plan_nbits(cand, W, G, ctx, self.cfg.weights)

    def finish_plans(self, planned, ctx) -> dict:
        """--weights int4 on a float checkpoint: the per-layer mix under --quality-budget. --weights-layout
        split with no BlockQuantMatMul layer that takes it: an error (the request would change nothing)."""
        revised = self._float.finish(self, planned, ctx) if self._float is not None else {}
        if self.cfg.layout == "split" and planned:
            final = [revised.get(c.name, p) for c, p in planned]
            if not any("split" in str(p.attrs.get("layout", "")) for p in final):
                why = "; ".join(dict.fromkeys(p.attrs["layout_refused"] for p in final if p.attrs.get("layout_refused")))
                raise OrtleanError(f"--weights-layout split: no layer takes it: {why or 'no layer is BlockQuantMatMul'}"
                                   "; --weights-layout auto writes ggml's blocks where split does not apply")
        return revised

    def _plan_nbits(self, cand: Candidate, W: np.ndarray, G, ctx, weights: str, why: str = "") -> Plan:
        cfg = quantize.config_for(weights)
        packed, scales, zp = quantize.quantize_matrix(W, cfg)
        W_hat = quantize.dequantized(packed, scales, zp, cand.K, cfg)   # never whole: the gap goes by columns
        gap = gaps.layer_gap(W, W_hat, G)
        stored = packed.nbytes + scales.nbytes + (zp.nbytes if zp is not None else 0)
        how = (f"{why}block {cfg.block_size}, {'symmetric' if cfg.symmetric else 'zero points'}, "
               f"accuracy_level {cfg.accuracy_level}; {stored / max(4 * cand.params, 1):.3f} of the fp32 bytes"
               + ("" if G is not None else "; gap = weight error (no calibration)"))
        tied = None
        if cand.target == "head" and self.cfg.embed == "shared" and ctx is not None and ctx.model is not None:
            g = quantize.tied_embedding(ctx.model.graph, W)
            if g is not None:
                tied = g.name
                how += f"; the tied token embedding ({tied}) reads these blocks (its {4 * W.size / 2**20:.1f} MiB float32 table dropped)"
        return Plan(f"{weights} (MatMulNBits)", how, gap, cand.params, payload=("nbits", packed, scales, zp, cfg, tied),
                    attrs={"bits": cfg.bits, "block_size": cfg.block_size, "bytes": int(stored)})

    def emit(self, graph: ir.Graph, cand: Candidate, plan: Plan, ctx) -> None:
        if plan.payload[0] == "blocks":
            return self._emit_blocks(graph, cand, plan)
        if plan.payload[0] == "float":
            # weights quantized here: their own error dominates, --weights-act-bits auto keeps int8 activations
            act_bits = self.cfg.act_bits_for(exact=False)
            return weights_float.emit(graph, cand, plan, act_bits, self.cfg.layout,
                                      prefill_act_bits=self.cfg.prefill_act_bits_for(act_bits))
        _, packed, scales, zp, cfg, tied = plan.payload
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

    # ------------------------------------------------------------------ gguf
    def _source(self):
        from ..builders.gguf import GGUFSource

        if self._gguf is None and self.cfg.gguf is not None:
            self._gguf = GGUFSource(self.cfg.gguf)
        return self._gguf

    def _plan_gguf(self, cand: Candidate, W: np.ndarray, G, ctx) -> Plan:
        from ..builders import gguf as gg

        src = self._source()
        WT = W.T      # a view: the source hashes and verifies it a chunk of rows at a time (a head is ~1 GB)
        m = src.match(WT) if src is not None else None
        if m is not None and m.complete and all(src.tensors[t].is_float for t in set(m.tensor.tolist())):
            held = ", ".join(f"{src.tensors[t].name} ({src.tensors[t].type_name})" for t in dict.fromkeys(m.tensor.tolist()))
            return Plan.dense(cand, f"kept fp32: the GGUF holds it as floats ({held}), not in blocks")
        if m is not None and m.complete:
            try:
                parts = src.assemble(WT, m)
            except OrtleanError as e:
                raise OrtleanError(f"--weights gguf: node {cand.name!r} ({cand.K}x{cand.N}): {e}") from None
            finally:   # the weight's pages read so far back to the page cache (W stays valid)
                modelfile.release_pages(cand.weight.const_value)
            return self._blocks_plan(cand, W, parts, gg.parts_source(parts), 0.0, ctx, exact=True)
        why = (src.describe_miss(m, cand.K) if src is not None else "no GGUF given")
        fb = self.cfg.fallback
        if fb is None:
            raise OrtleanError(f"--weights {self.cfg.requested}: node {cand.name!r} ({cand.K}x{cand.N}, weight "
                               f"{cand.weight.name}): {why}; --weights gguf,q8_0 (or gguf,int8 | gguf,int4 | gguf,fp32) "
                               "quantizes (keeps) what the GGUF does not hold")
        note = f"not in the GGUF ({why}): " if src is not None else ""
        if fb == "fp32":
            return Plan.dense(cand, f"kept fp32: {note}--weights {self.cfg.weights}")
        if fb in ("int8", "int4"):
            return self._plan_nbits(cand, W, G, ctx, fb, why=f"{note}quantized with ORT's MatMulNBits quantizer; ")
        Wq = gg.quantize(fb, WT)
        W_hat = gg.dequantize(fb, Wq, cand.K)
        gap = gaps.layer_gap(W, W_hat.T, G)
        part = gg.Part(fb, 0, cand.N, cand.K, Wq, [], "quantized")
        return self._blocks_plan(cand, W, [part], f"quantize:{fb}", gap, ctx, exact=False,
                                 why=f"{note}quantized to {fb} with gguf.quants.quantize"
                                     + ("" if G is not None else " (gap = weight error, no calibration)"))

    def _blocks_plan(self, cand: Candidate, W: np.ndarray, parts: list, source: str, gap: float, ctx, *,
                     exact: bool, why: str = "") -> Plan:
        stored = int(sum(p.W.nbytes for p in parts))
        fmts = "+".join(dict.fromkeys(p.format for p in parts))
        bpw = 8.0 * stored / max(cand.params, 1)
        if exact:
            srcs = "; ".join(f"{'+'.join(p.tensors)}" + (f" ({p.layout})" if p.layout != "as stored" else "")
                             for p in parts)
            how = (f"BlockQuantMatMul {fmts} (gguf {srcs}), {bpw:.2f} bits/weight; bit-exact: dequantized bytes "
                   "equal the source initializer")
        else:
            how = f"BlockQuantMatMul {fmts}, {bpw:.2f} bits/weight; {why}"
        # W's row layout per part: the blocks are checked (bit-exact, above) before they are reordered, and
        # the reordered rows are checked to give those blocks back byte for byte (BG.layout_bytes)
        act_bits = self.cfg.act_bits_for(exact=exact)
        layouts = [self.cfg.layout_for(p.format, None, act_bits) for p in parts]
        parts = [dataclasses.replace(p, W=BG.layout_bytes(p.W, lay, p.format, p.K)) if lay == "split" else p
                 for p, (lay, _) in zip(parts, layouts)]
        how += "; " + _layout_text(layouts, [p.format for p in parts],
                                   "the GGUF's bytes" if exact else f"{fmts}'s bytes")
        layout = "+".join(lay for lay, _ in layouts) if len({lay for lay, _ in layouts}) > 1 else layouts[0][0]
        if len(parts) > 1:
            how += f"; {len(parts)} nodes (one per format) and a Concat"
        add = BG.bias_add(cand.node, cand.N)
        if add is not None:
            how += "; bias Add folded into the op"
        embed = None
        if cand.target == "head" and self.cfg.embed == "shared" and ctx is not None and ctx.model is not None:
            g = quantize.tied_embedding(ctx.model.graph, W)
            if g is not None and len(parts) == 1:
                embed = ("tied", g.name, None)
                how += (f"; the tied token embedding ({g.name}) reads these blocks through BlockQuantGather (its "
                        f"{4 * W.size / 2**20:.1f} MiB float32 table dropped)")
            elif g is None:
                embed = self._untied_embedding(cand, ctx)
                if embed is not None:
                    how += (f"; the untied token embedding ({embed[1]}) becomes a BlockQuantGather of its own GGUF "
                            f"blocks ({'+'.join(embed[2].tensors)}, {embed[2].format}, bit-exact)")
        label = f"{'gguf' if exact else self.cfg.fallback} (BlockQuantMatMul)"
        return Plan(label, how, gap, cand.params, payload=("blocks", parts, source, gap, embed, [l for l, _ in layouts]),
                    attrs={"format": fmts, "bits_per_weight": round(bpw, 4), "bytes": stored, "source": source,
                           "bit_exact": exact, "layout": layout, "act_bits": act_bits,
                           **({"prefill_act_bits": pab} if (pab := self.cfg.prefill_act_bits_for(act_bits)) else {}),
                           **({"layout_refused": "; ".join(dict.fromkeys(w for _, w in layouts if w))}
                              if any(w for _, w in layouts) else {})})

    def _untied_embedding(self, cand: Candidate, ctx):
        """("own", gather name, Part) when ``cand`` is the first head the rewrite plans and the model
        has an embedding Gather (axis 0, constant float32 [V, D] table, runtime indices) tied to no
        head whose table the GGUF holds in one format (rows in any order); else None."""
        if self._untied is None:
            self._untied = self._find_untied(ctx)
        owner, found = self._untied
        return found if cand.name == owner else None

    def _find_untied(self, ctx) -> tuple:
        src = self._gguf
        heads = [c for c in ctx.todo if c.target == "head" and not isinstance(c, GroupCandidate)]
        if src is None or not heads:
            return None, None
        for node in ctx.model.graph:
            tab = BG.embedding_table(node)
            if tab is None:
                continue
            T = tab.const_value.numpy()
            try:
                if any((c.N, c.K) == T.shape and quantize.equal_tables(c.weight_array().T, T) for c in heads):
                    continue        # tied to a head: that head's blocks serve it
                m = src.match(T)
                if not m.complete or any(src.tensors[t].format is None for t in set(m.tensor.tolist())):
                    continue
                parts = src.assemble(T, m)
            finally:     # the table's pages (and the heads' it was compared with) back to the page cache
                for v in [tab, *(c.weight for c in heads)]:
                    modelfile.release_pages(v.const_value)
            if len(parts) == 1:
                return heads[0].name, ("own", node.name, parts[0])
        return None, None

    def _emit_blocks(self, graph: ir.Graph, cand: Candidate, plan: Plan) -> None:
        _, parts, source, gap, embed, layouts = plan.payload
        node = cand.node
        base = surgery.safe_name(cand.name)
        add = BG.bias_add(node, cand.N)
        bias = add[1].const_value.numpy().reshape(-1).astype(np.float32) if add is not None else None
        multi = len(parts) > 1
        act_bits = self.cfg.act_bits_for(exact=source.startswith("gguf:"))
        prefill = self.cfg.prefill_act_bits_for(act_bits)
        new, weights = [], []
        for i, p in enumerate(parts):
            sfx = f"_{i}" if multi else ""
            w = surgery.initializer(graph, f"{base}.weight_{p.format}{sfx}", p.W)
            b = surgery.initializer(graph, f"{base}.bias{sfx}", bias[p.start:p.stop]) if bias is not None else None
            attrs = {"format": p.format, "K": int(cand.K), "N": int(p.N), "act_bits": act_bits,
                     **({"prefill_act_bits": prefill} if prefill else {}), "layer": cand.label, "target": cand.target,
                     "source": source, "bits_per_weight": float(p.bits_per_weight), "params_dense": int(cand.K * p.N),
                     "params_stored": int(cand.K * p.N), "gap": float(gap)}
            if layouts[i] != "blocks":     # p.W holds that layout's bytes (the plan made them)
                attrs["layout"] = layouts[i]
            new.append(surgery.op_node("BlockQuantMatMul", [cand.input, w, b], attrs, name=f"{cand.name}_BQ{sfx}"))
            weights.append(w)
        graph.insert_before(node, new)
        out = new[0].outputs[0]
        if multi:
            cat = ir.Node("", "Concat", [n.outputs[0] for n in new], [ir.AttrInt64("axis", -1)],
                          name=f"{cand.name}_BQ/Concat")
            graph.insert_before(node, cat)
            out = cat.outputs[0]
        BG.take_over(graph, node, add, out)
        if embed is not None:
            kind, gname, part = embed
            gather = next((n for n in graph if n.name == gname), None)
            if gather is not None:
                if kind == "tied":        # the head's initializer: its layout too
                    BG.gather_blocks(graph, gather, weights[0], parts[0].format, int(cand.K), int(cand.N), "head",
                                   source, cand.label, layout=layouts[0])
                else:
                    w = surgery.initializer(graph, f"{surgery.safe_name(gname)}.weight_{part.format}", part.W)
                    BG.gather_blocks(graph, gather, w, part.format, part.K, part.N, "head",
                                   "gguf:" + ",".join(part.tensors), "embed")

    def notes(self, summary: dict) -> list[str]:
        """The summary's line on a GGUF-sourced rewrite: how many layers hold the GGUF's blocks and
        the written model's bytes (model file + external data) beside the GGUF file's."""
        if self._float is not None:
            return self._float.notes() + layout_notes(summary, self.cfg.layout)
        if self.cfg.source != "gguf":
            return []
        n = sum(1 for r in summary["layers"] if str(r["backend"]).startswith("gguf"))
        line = f"weights: {n} layers hold the GGUF's blocks, bit-exact"
        if self._gguf is not None:
            line += f" ({self._gguf.path.name})"
            files = [Path(p) for p in summary.get("written") or [] if Path(p).suffix in (".onnx", ".data")]
            size = sum(p.stat().st_size for p in files if p.is_file())
            if size:
                line += (f"; the model's files {size / 1e6:.1f} MB ({' + '.join(p.name for p in files)}) vs the "
                         f"GGUF's {self._gguf.file_bytes / 1e6:.1f} MB ({size / self._gguf.file_bytes:.2f}x)")
        return [line] + layout_notes(summary, self.cfg.layout)


def _layout_text(layouts: list[tuple[str, str | None]], formats: list[str], what: str) -> str:
    """The report's words on W's row layout of a layer's parts ([(layout, why not split)], their formats)."""
    out = []
    same = len(set(layouts)) == 1
    for (lay, why), fmt in dict.fromkeys(zip(layouts, formats if not same else ["+".join(dict.fromkeys(formats))] * len(layouts))):
        pre = "" if same else f"{fmt}: "
        why = why[len("layout "):] if why and why.startswith("layout split") else why
        if lay == "split":
            mins = any(f in bq.WITH_MIN for f in fmt.split("+"))
            out.append(f"{pre}layout split ({what} reordered within each row: integers, then scales"
                       f"{', then mins' if mins else ''}; they give the blocks back byte for byte)")
        else:
            out.append(f"{pre}layout blocks" + (f" ({why})" if why else ""))
    return "; ".join(out)


def layout_notes(summary: dict, choice: str) -> list[str]:
    """The summary's line on W's row layout: how many BlockQuantMatMul layers hold split rows, how many
    ggml's blocks, and with --weights-layout split the layers that kept blocks and why."""
    rows = [r for r in summary["layers"] if "layout" in (r.get("extra") or {})]
    if not rows:
        return []
    split = [r for r in rows if r["extra"]["layout"] == "split"]
    mixed = [r for r in rows if "+" in r["extra"]["layout"]]
    kept = [r for r in rows if r["extra"]["layout"] != "split"]
    line = (f"weights layout ({choice}): {len(split)} of {len(rows)} BlockQuantMatMul layers split (the same bytes "
            f"reordered within each row), {len(kept) - len(mixed)} blocks"
            + (f", {len(mixed)} split in some parts (one node per format)" if mixed else ""))
    if choice == "split" and kept:
        why: dict[str, list[str]] = {}
        for r in kept:
            why.setdefault(r["extra"].get("layout_refused") or "?", []).append(r["layer"])
        line += "; kept blocks: " + "; ".join(
            f"{', '.join(ls[:4])}{f' and {len(ls) - 4} more' if len(ls) > 4 else ''} ({w})" for w, ls in why.items())
    return [line]


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
        return _record(packed, self.name, f"{len(packed)} groups of MatMulNBits reading one input packed into one "
                                          "MatMulNBits + Split each (the same numbers)")


def _record(nodes: list[str], backend: str, decision: str) -> list[dict]:
    """A post pass's one report row for the nodes it changed (none: no row)."""
    if not nodes:
        return []
    return [{"layer": nodes[0] if len(nodes) == 1 else f"{nodes[0]} … ({len(nodes)})", "backend": backend,
             "decision": decision}]


# --------------------------------------------------------------------------- --weights-glu (a "post" graph pass)
@dataclass
class GluConfig(Options):
    glu: bool = flag("--weights-glu", True, "BlockQuantMatMul: an MLP's gate and up projections of one format "
                     "(SwiGLU: gate, SiLU, up, Mul) become one BlockQuantMatMul with glu=silu over both blocks — "
                     "one weight stream, one activation quantization, no separate SiLU and Mul nodes (default on; "
                     "docs/block-quant.md)", type=onoff, metavar="on|off")
    enabled: bool = False
    targets: tuple = ()
    explicit: bool = False     # never a request by itself: --weights is


class WeightsGluPass(GraphPassBase):
    """After every weight backend emitted: ``rewriter.builders.blockgraph.fuse_glu`` (BlockQuantMatMul
    gate + SiLU + up + Mul → one BlockQuantMatMul glu=silu; layers in other ops stay as they are)."""
    name = "weights_glu"
    stage = "post"
    Config = GluConfig
    title = "the MLPs' gate, up and SiLU in one BlockQuantMatMul"

    @classmethod
    def config(cls, args, state_pack) -> GluConfig:
        cfg = from_args(GluConfig, args)
        cfg.enabled = cfg.glu and getattr(args, "weights", "fp32") != "fp32"
        return cfg

    def run(self, model, ctx) -> list[dict]:
        fused = BG.fuse_glu(model.graph)
        return _record(fused, self.name, f"{len(fused)} MLPs' gate and up BlockQuantMatMul (with their SiLU and Mul) "
                                         "in one BlockQuantMatMul glu=silu each (the same blocks)")
