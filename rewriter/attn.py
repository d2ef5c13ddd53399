"""PackedAttention graph pass (seed 001, KV-cache half): find the attention core of
optimum-exported graphs — QKᵀ → scale → (+mask) → Softmax → (IsNaN→0) → ·V, including GQA's
repeat of K/V heads (Unsqueeze → Expand → Reshape) and the Concat with ``past_key_values.N.*`` —
and replace it with one ``ai.ortlean::PackedAttention`` node.

For decoders whose key is the cache (``present.N.key = Concat(past_key_values.N.key, k)``) the
packed key bits become cache state: a graph input ``past_key_values.N.key_bits`` (int32
[batch, kv_heads, past_sequence_length, W]) and output ``present.N.key_bits``, paired by
``runtime.ModelIO`` like the other ``past*``→``present*`` states, so packing costs O(new tokens)
per step. Attention that does not match is left as is and reported with the reason.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from . import DOMAIN
from .errors import OrtleanError

OP_TYPE = "PackedAttention"
MODES = {"sign": 1, "ternary": 2, "binary": 1}


@dataclass
class AttnConfig:
    enabled: bool = False
    mode: str = "sign"                 # sign | ternary | binary (from --state-pack + --attn-pack-bits)
    eps: float = 0.0
    budget: float = 0.5                # candidate fraction of the context (0 = exact)
    min_candidates: int = 64
    sinks: int = 4
    window: int = 256
    min_context: int = 256
    rho: float = 0.15
    qbits: int = 8
    mix: float = 0.0
    popcnt: str = "auto"
    approx_prefill: int = 0
    eps_given: bool = False
    target_density: float = 0.10       # eps modes without --state-pack-eps: per-head eps from calibration
    calib_tokens: int = 512
    select: str = "popcount"           # popcount | exact (oracle selection, for measurement)
    kscale: str = "auto"               # auto: per-channel key scale from --calib-text when given | off
    targets: tuple = ("kv",)


def add_flags(p) -> None:
    g = p.add_argument_group("PackedAttention (seed 001 KV half; enabled by --state-pack=binary|ternary with "
                             "--state-pack-target kv|both)")
    g.add_argument("--attn-pack-bits", default="sign", choices=["sign", "eps"],
                   help="--state-pack=binary packs sign bits (binary hashing, default) or |k| > eps (seed's bitmap)")
    g.add_argument("--attn-budget", type=float, default=0.5,
                   help="candidate keys per decode step as a fraction of the context, sinks and window included "
                        "(default 0.5: SmolLM2 on held-out Austen, Δppl ≤ 2 %% with --calib-text; 0 or 1 = exact)")
    g.add_argument("--attn-min-candidates", type=int, default=64, help="at least this many candidates (default 64)")
    g.add_argument("--attn-sinks", type=int, default=4, help="first tokens always attended (default 4)")
    g.add_argument("--attn-window", type=int, default=256, help="most recent tokens always attended (default 256)")
    g.add_argument("--attn-min-context", type=int, default=256,
                   help="exact attention up to this context length (default 256)")
    g.add_argument("--attn-rho", type=float, default=0.15,
                   help="eps modes: exact attention when the key-bit density is above this (default 0.15)")
    g.add_argument("--attn-qbits", type=int, default=8, help="query bits for the popcount score (default 8)")
    g.add_argument("--attn-approx-prefill", action="store_true",
                   help="prompt rows (M > 1) also use candidates, each as its decode step would (to measure "
                        "decode-time quality with perplexity; default off: prefill is exact)")
    g.add_argument("--attn-target-density", type=float, default=0.10,
                   help="ternary / eps-binary without --state-pack-eps: eps per KV head from the calibration "
                        "text's keys so that this fraction of components is set (default 0.10)")
    g.add_argument("--attn-kscale", default="auto", choices=["auto", "off"],
                   help="fold the per-channel mean |k| (from --calib-text keys) into the query of the popcount "
                        "score (default auto: when --calib-text is given)")
    g.add_argument("--attn-select", default="popcount", choices=["popcount", "exact"],
                   help="how candidates are chosen: popcount score (default) or exact scores (oracle: measures what "
                        "the budget alone costs, no speed benefit)")
    g.add_argument("--attn-mix", type=float, default=0.0,
                   help="seed behaviour: mix this fraction of the approximate score into the exact logits (default 0)")


def config(args) -> AttnConfig:
    sp = getattr(args, "state_pack", "none")
    tgt = getattr(args, "state_pack_target", "kv")
    if tgt not in ("kv", "mlp", "both"):
        raise OrtleanError(f"--state-pack-target {tgt!r}: use kv, mlp or both")
    enabled = sp != "none" and tgt in ("kv", "both")
    bits = getattr(args, "attn_pack_bits", "sign")
    mode = "ternary" if sp == "ternary" else ("sign" if bits == "sign" else "binary")
    eps = getattr(args, "state_pack_eps", None)
    cfg = AttnConfig(enabled=enabled, mode=mode, eps=float(eps if eps is not None else (0.0 if mode == "sign" else 1e-4)),
                     budget=float(getattr(args, "attn_budget", 0.5)),
                     min_candidates=int(getattr(args, "attn_min_candidates", 64)),
                     sinks=int(getattr(args, "attn_sinks", 4)), window=int(getattr(args, "attn_window", 256)),
                     min_context=int(getattr(args, "attn_min_context", 256)), rho=float(getattr(args, "attn_rho", 0.15)),
                     qbits=int(getattr(args, "attn_qbits", 8)), mix=float(getattr(args, "attn_mix", 0.0)),
                     popcnt=getattr(args, "state_pack_popcnt", "auto"),
                     approx_prefill=int(bool(getattr(args, "attn_approx_prefill", False))),
                     eps_given=eps is not None, target_density=float(getattr(args, "attn_target_density", 0.10)),
                     kscale=getattr(args, "attn_kscale", "auto"), select=getattr(args, "attn_select", "popcount"))
    if not 0 < cfg.target_density < 1:
        raise OrtleanError(f"--attn-target-density {cfg.target_density}: must be in (0, 1)")
    if not 0 <= cfg.budget <= 1:
        raise OrtleanError(f"--attn-budget {cfg.budget}: must be in [0, 1]")
    if not 2 <= cfg.qbits <= 16:
        raise OrtleanError(f"--attn-qbits {cfg.qbits}: must be in 2..16")
    if not 0 <= cfg.mix <= 1 or not 0 <= cfg.rho <= 1:
        raise OrtleanError("--attn-mix and --attn-rho must be in [0, 1]")
    if min(cfg.min_candidates, cfg.sinks, cfg.window, cfg.min_context) < 0:
        raise OrtleanError("--attn-min-candidates/--attn-sinks/--attn-window/--attn-min-context must be ≥ 0")
    if cfg.eps < 0:
        raise OrtleanError(f"--state-pack-eps {cfg.eps}: must be ≥ 0")
    return cfg


def n_words(D: int, mode: str) -> int:
    return MODES[mode] * ((D + 31) // 32) + 1


# --------------------------------------------------------------------------- matcher
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


# --------------------------------------------------------------------------- rewrite
def _sym(dim):
    return dim if isinstance(dim, int) else str(dim)


def calibrate_eps(model_path, text_path, cfg: AttnConfig, tokenizer=None) -> dict[int, list[float]]:
    """Per layer (cache index) and KV head: eps such that a fraction cfg.target_density of the key
    components has |k| > eps, on the first cfg.calib_tokens tokens of the calibration text (the
    dense model's present.N.key outputs)."""
    import onnxruntime as ort

    from custom_ops import runtime
    from .calibrate import tokenize_text

    tok, text = tokenize_text(model_path, text_path, tokenizer)
    ids = np.asarray(tok.encode(text, add_special_tokens=False).ids[: cfg.calib_tokens], np.int64)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
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
        node = ir.node(OP_TYPE, [m.q, m.k, m.v, m.mask, bits_in], attributes=attrs, domain=DOMAIN,
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
        _remove_dead(graph)
        model.opset_imports.setdefault(DOMAIN, 1)
    return records


def _remove_dead(graph: ir.Graph) -> None:
    outs = set(id(o) for o in graph.outputs)
    changed = True
    while changed:
        changed = False
        for n in reversed(list(graph)):
            if all((not o.uses()) and id(o) not in outs for o in n.outputs):
                graph.remove(n, safe=True)
                changed = True


# --------------------------------------------------------------------------- registry face
class _Pass:
    name = "packed_attention"
    op_type = OP_TYPE

    def add_flags(self, p):
        add_flags(p)

    def config(self, args):
        return config(args)

    def needs_calibration(self, cfg):
        return False

    def run(self, model, ctx, cfg=None):
        cal = {}
        need_eps = cfg.mode != "sign" and not cfg.eps_given
        if need_eps and not ctx.calib_text:
            raise OrtleanError(f"--state-pack {'ternary' if cfg.mode == 'ternary' else 'binary --attn-pack-bits eps'}: "
                               "give --state-pack-eps E, or --calib-text FILE to choose eps per head for "
                               "--attn-target-density")
        if ctx.calib_text and (need_eps or cfg.kscale == "auto") and ctx.io is not None and ctx.io.has_past:
            cal = calibrate_eps(ctx.model_path, ctx.calib_text, cfg, ctx.tokenizer)
        recs = apply(model, cfg, eps_heads=cal.get("eps") if need_eps else None,
                     kscale=cal.get("kscale") if cfg.kscale == "auto" else None)
        if cfg.kscale == "auto" and not cal and any(r.get("cache") for r in recs):
            for r in recs:
                if r.get("cache"):
                    r["decision"] += "; no --calib-text: per-channel key scale off (measured: worse candidates)"
        return recs


PASS = _Pass()
