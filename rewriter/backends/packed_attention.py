"""PackedAttention (seed 001, KV-cache half): every matched attention core (builders/attention.py)
becomes one ``ai.ortlean::PackedAttention`` node.

For decoders whose key is the cache (``present.N.key = Concat(past_key_values.N.key, k)``) the
packed key bits become cache state: a graph input ``past_key_values.N.key_bits`` (int32
[batch, kv_heads, past_sequence_length, W]) and output ``present.N.key_bits``, paired by
``custom_ops.runtime.ModelIO`` like the other ``past*``→``present*`` states, so packing costs
O(new tokens) per step. Attention that does not match is left as is and reported with the reason.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from custom_ops import runtime
from custom_ops.reference.attn import n_words
from custom_ops.schema import DOMAIN

from ..builders.attention import find_attention
from ..errors import OrtleanError
from ..kit import options, surgery
from ..kit.backend import GraphPassBase
from ..kit.options import Options, flag

OP_TYPE = "PackedAttention"


@dataclass
class AttnConfig(Options):
    pack_bits: str = flag("--attn-pack-bits", "sign", "--state-pack=binary packs sign bits (binary hashing, default) "
                          "or |k| > eps (seed's bitmap)", choices=("sign", "eps"))
    budget: float = flag("--attn-budget", 0.5, "candidate keys per decode step as a fraction of the context, sinks "
                         "and window included (default 0.5: SmolLM2 on held-out Austen, Δppl ≤ 2 %% with --calib-text; "
                         "0 or 1 = exact)", type=float)
    min_candidates: int = flag("--attn-min-candidates", 64, "at least this many candidates (default 64)", type=int)
    sinks: int = flag("--attn-sinks", 4, "first tokens always attended (default 4)", type=int)
    window: int = flag("--attn-window", 256, "most recent tokens always attended (default 256)", type=int)
    min_context: int = flag("--attn-min-context", 256, "exact attention up to this context length (default 256)",
                            type=int)
    rho: float = flag("--attn-rho", 0.15, "eps modes: exact attention when the key-bit density is above this "
                      "(default 0.15)", type=float)
    qbits: int = flag("--attn-qbits", 8, "query bits for the popcount score (default 8)", type=int)
    approx_prefill: int = flag("--attn-approx-prefill", False, "prompt rows (M > 1) also use candidates, each as its "
                               "decode step would (to measure decode-time quality with perplexity; default off: "
                               "prefill is exact)", action="store_true", parse=lambda v, _: int(bool(v)))
    target_density: float = flag("--attn-target-density", 0.10, "ternary / eps-binary without --state-pack-eps: eps "
                                 "per KV head from the calibration text's keys so that this fraction of components "
                                 "is set (default 0.10)", type=float)
    kscale: str = flag("--attn-kscale", "auto", "fold the per-channel mean |k| (from --calib-text keys) into the query "
                       "of the popcount score (default auto: when --calib-text is given)", choices=("auto", "off"))
    select: str = flag("--attn-select", "popcount", "how candidates are chosen: popcount score (default) or exact "
                       "scores (oracle: measures what the budget alone costs, no speed benefit)",
                       choices=("popcount", "exact"))
    mix: float = flag("--attn-mix", 0.0, "seed behaviour: mix this fraction of the approximate score into the exact "
                      "logits (default 0)", type=float)
    # from the shared --state-pack* group (kit.options.StatePack) and --attn-pack-bits
    enabled: bool = False
    mode: str = "sign"                 # sign | ternary | binary
    eps: float = 0.0
    eps_given: bool = False
    popcnt: str = "auto"
    calib_tokens: int = 512
    targets: tuple = ("kv",)

    def validate(self) -> None:
        if not 0 < self.target_density < 1:
            raise OrtleanError(f"--attn-target-density {self.target_density}: must be in (0, 1)")
        if not 0 <= self.budget <= 1:
            raise OrtleanError(f"--attn-budget {self.budget}: must be in [0, 1]")
        if not 2 <= self.qbits <= 16:
            raise OrtleanError(f"--attn-qbits {self.qbits}: must be in 2..16")
        if not 0 <= self.mix <= 1 or not 0 <= self.rho <= 1:
            raise OrtleanError("--attn-mix and --attn-rho must be in [0, 1]")
        if min(self.min_candidates, self.sinks, self.window, self.min_context) < 0:
            raise OrtleanError("--attn-min-candidates/--attn-sinks/--attn-window/--attn-min-context must be ≥ 0")


def _sym(dim):
    return dim if isinstance(dim, int) else str(dim)


def calibrate_eps(source, calib, cfg: AttnConfig) -> dict[str, dict[int, list[float]]]:
    """Per layer (cache index) and KV head: eps such that a fraction cfg.target_density of the key
    components has |k| > eps, and the per-channel mean |k| (kscale), on the first
    cfg.calib_tokens tokens of the calibration text (the dense model's present.N.key outputs)."""
    import onnxruntime as ort

    ids = np.asarray(calib.ids[: cfg.calib_tokens], np.int64)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
    io = runtime.ModelIO.from_session(sess)
    out = runtime.run(sess, io, runtime.feeds(io, ids[None, :]))
    eps, kscale = {}, {}
    for name, val in out.items():
        m = re.match(r"^present\.(\d+)\.key$", name)
        if m:
            a = np.abs(val[0])                                   # [H, T, D]
            eps[int(m.group(1))] = [float(np.quantile(a[h], 1.0 - cfg.target_density)) for h in range(a.shape[0])]
            ks = a.mean(axis=1)                                  # [H, D]
            kscale[int(m.group(1))] = [float(x) for x in (ks / np.maximum(ks.mean(-1, keepdims=True), 1e-30)).ravel()]
    return {"eps": eps, "kscale": kscale}


def apply(model: ir.Model, cfg: AttnConfig, *, include=None, eps_heads: dict | None = None,
          kscale: dict | None = None) -> list[dict]:
    """Rewrite every matched attention core; returns one report dict per Softmax."""
    matches, skipped = find_attention(model)
    graph = model.graph
    inputs = {i.name: i for i in graph.inputs}
    records = []
    for m in matches:
        if include is not None and not include(m):
            records.append({"layer": m.layer, "backend": "dense", "decision": "kept dense: excluded"})
            continue
        bits_in = None
        W = None
        note = list(m.notes)
        if m.cache is not None:
            pk = inputs.get(f"past_key_values.{m.cache}.key")
            shp = pk.shape if pk is not None else None
            if shp is not None and len(shp) == 4 and isinstance(shp[1], int) and isinstance(shp[3], int):
                hkv, D = shp[1], shp[3]
                W = n_words(D, cfg.mode)
                past_len = shp[2] if not isinstance(shp[2], int) else "past_sequence_length"
                bits_in = ir.Value(name=f"past_key_values.{m.cache}.key_bits",
                                   shape=ir.Shape([_sym(shp[0]), hkv, _sym(past_len), W]), type=ir.TensorType(ir.DataType.INT32))
                graph.inputs.append(bits_in)
            else:
                note.append("cache key shape unknown: bits recomputed per call")
        attrs = dict(scale=float(m.scale), mode=cfg.mode, eps=float(cfg.eps), budget=float(cfg.budget),
                     min_candidates=int(cfg.min_candidates), sinks=int(cfg.sinks), window=int(cfg.window),
                     min_context=int(cfg.min_context), rho=float(cfg.rho), qbits=int(cfg.qbits), mix=float(cfg.mix),
                     popcnt=cfg.popcnt, k_layout=m.k_layout, layer=m.layer, approx_prefill=int(cfg.approx_prefill))
        if cfg.select != "popcount":
            attrs["select"] = cfg.select
        if kscale and m.cache in kscale:
            attrs["kscale"] = kscale[m.cache]
            note.append("per-channel key scale (calibrated)")
        if eps_heads and m.cache in eps_heads and cfg.mode != "sign":
            attrs["eps_heads"] = [float(e) for e in eps_heads[m.cache]]
            note.append(f"eps per head {', '.join(f'{e:.3g}' for e in eps_heads[m.cache])} "
                        f"(target density {cfg.target_density})")
        n_out = 2 if bits_in is not None else 1
        node = surgery.op_node(OP_TYPE, [m.q, m.k, m.v, m.mask, bits_in], attrs,
                               name=f"/ortlean/{m.layer}/PackedAttention", num_outputs=n_out)
        y_old = m.final.outputs[0]
        name = y_old.name
        y_old.name = name + "_dense"
        node.outputs[0].name = name
        node.outputs[0].shape = y_old.shape
        node.outputs[0].type = y_old.type
        graph.insert_after(m.final, node)
        y_old.replace_all_uses_with(node.outputs[0], replace_graph_outputs=True)
        if bits_in is not None:
            bo = node.outputs[1]
            ko = next(o for o in graph.outputs if o.name == f"present.{m.cache}.key")
            bo.name = f"present.{m.cache}.key_bits"
            bo.shape = ir.Shape([_sym(ko.shape[0]) if ko.shape else "batch_size", ko.shape[1] if ko.shape else None,
                                 _sym(ko.shape[2]) if ko.shape else "total_sequence_length", W])
            bo.type = ir.TensorType(ir.DataType.INT32)
            graph.outputs.append(bo)
        records.append({"layer": m.layer, "backend": "packed_attention", "node": node.name, "scale": m.scale,
                        "k_layout": m.k_layout, "cache": m.cache is not None and bits_in is not None,
                        "decision": f"PackedAttention ({cfg.mode}, budget {cfg.budget})" +
                                    (f"; {'; '.join(note)}" if note else "")})
    for s in skipped:
        records.append({"layer": s["layer"], "backend": "dense", "node": s["node"],
                        "decision": f"kept dense: attention not matched ({s['reason']})"})
    if matches:
        surgery.remove_dead(graph)
        model.opset_imports.setdefault(DOMAIN, 1)
    return records



class PackedAttentionPass(GraphPassBase):
    name = "packed_attention"
    stage = "post"
    Config = AttnConfig
    title = ("PackedAttention (seed 001 KV half; enabled by --state-pack=binary|ternary with "
             "--state-pack-target kv|both)")

    @classmethod
    def config(cls, args, state_pack) -> AttnConfig:
        sp = state_pack
        mode = "ternary" if sp.mode == "ternary" else ("sign" if args.attn_pack_bits == "sign" else "binary")
        cfg = options.from_args(AttnConfig, args, enabled=sp.kv, mode=mode, popcnt=sp.popcnt, eps_given=sp.eps is not None,
                                eps=float(sp.eps if sp.eps is not None else (0.0 if mode == "sign" else 1e-4)))
        cfg.validate()
        return cfg

    def run(self, model, ctx) -> list[dict]:
        cfg = self.cfg
        cal = {}
        need_eps = cfg.mode != "sign" and not cfg.eps_given
        if need_eps and not ctx.opts.calib_text:
            raise OrtleanError(f"--state-pack {'ternary' if cfg.mode == 'ternary' else 'binary --attn-pack-bits eps'}: "
                               "give --state-pack-eps E, or --calib-text FILE to choose eps per head for "
                               "--attn-target-density")
        if ctx.opts.calib_text and (need_eps or cfg.kscale == "auto") and ctx.io is not None and ctx.io.has_past:
            cal = calibrate_eps(ctx.source(), ctx.calib, cfg)
        recs = apply(model, cfg, eps_heads=cal.get("eps") if need_eps else None,
                     kscale=cal.get("kscale") if cfg.kscale == "auto" else None)
        if cfg.kscale == "auto" and not cal and any(r.get("cache") for r in recs):
            for r in recs:
                if r.get("cache"):
                    r["decision"] += "; no --calib-text: per-channel key scale off (measured: worse candidates)"
        return recs
