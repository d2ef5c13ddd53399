"""`ortlean rewrite`: load → candidates → calibrate → plan per layer → emit → check → save."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from . import DOMAIN, graph as g
from .errors import OrtleanError


@dataclass
class RewriteConfig:
    model: str
    output: str
    backends: dict = field(default_factory=dict)      # backend name → its config (from backend.config(args))
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    calib_text: str | None = None
    calib_tokens: int = 4096
    calib_window: int = 256
    tokenizer: str | None = None
    report: str | None = None
    quality_budget: float | None = 0.02               # end-to-end; None = off
    quality_tokens: int = 1024
    threads: int = 1
    progress: bool = True


@dataclass
class LayerRecord:
    layer: str
    block: int | None
    target: str
    role: str
    shape: list[int]
    backend: str
    params_before: int
    params_after: int
    gap: float | None
    decision: str
    rank: list[int] | None = None
    method: str | None = None
    speed: dict | None = None
    extra: dict | None = None       # backend-specific report fields (fanout, blocks, tried …)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def default_output(model: str) -> str:
    p = Path(model)
    return str(p.with_name(p.stem + ".lean.onnx"))


def run(cfg: RewriteConfig) -> dict:
    from tqdm.auto import tqdm

    from . import backends as reg
    from custom_ops import runtime

    t0 = time.time()
    wbs = [b for b in reg.weight_backends() if b.name in cfg.backends and cfg.backends[b.name].enabled]
    gps = [b for b in reg.graph_passes() if b.name in cfg.backends and cfg.backends[b.name].enabled]
    if not wbs and gps:
        return _run_graph_passes_only(cfg, gps, t0)
    if not wbs:
        raise OrtleanError("no backend enabled: pass --tt=on, --kwta=on, --event-driven=on or --state-pack=... --state-pack-target=mlp")
    if cfg.quality_budget is not None and not (cfg.quality_budget > 0):
        raise OrtleanError(f"--quality-budget {cfg.quality_budget}: must be > 0 (or 'off')")
    inp = Path(cfg.model)
    model = g.load_model(inp)
    out = Path(cfg.output)
    if out.resolve() == inp.resolve():
        raise OrtleanError(f"{out}: output would overwrite the input model; choose another --output")

    done = g.ortlean_nodes(model)
    cands = g.find_candidates(model)
    already = [n.name for n in done]
    if already:
        import fnmatch

        hit = [n for n in already for gl in cfg.include if fnmatch.fnmatchcase(n, gl)]
        if hit:
            kinds = {n.name: n.op_type for n in done}
            raise OrtleanError(f"{inp}: layer {hit[0]!r} is already rewritten ({kinds[hit[0]]}); refusing to rewrite it again")
    if not cands:
        extra = f" ({len(already)} layers are already rewritten by ortlean)" if already else ""
        raise OrtleanError(f"{inp}: no eligible MatMul (a MatMul whose B is a constant float initializer){extra}")
    sel, excluded = g.select(cands, cfg.include, cfg.exclude)
    records: dict[str, LayerRecord] = {}
    todo = []
    for c in cands:
        if c.name in excluded:
            records[c.name] = _dense(c, f"excluded ({excluded[c.name]})")
        elif not any(c.target in cfg.backends[b.name].targets for b in wbs):
            records[c.name] = _dense(c, f"target {c.target} not selected by any backend's --*-target")
        else:
            todo.append(c)
    if not todo:
        raise OrtleanError(f"{inp}: no MatMul left to rewrite after the --*-target flags and --include/--exclude")
    for b in wbs:  # a backend may plan several MatMuls as one unit (gating: shared-input projections)
        if hasattr(b, "group_candidates"):
            todo = b.group_candidates(todo, cfg.backends[b.name], wbs)

    io = runtime.ModelIO.from_model(str(inp))
    ctx = reg.Context(model_path=str(inp), io=io, speed_M=1 if io.kind == "causal-lm" else 128,
                      threads=cfg.threads, calib_text=cfg.calib_text, tokenizer=cfg.tokenizer)

    ctx.extra["todo"] = todo
    ctx.extra["rewrite_cfg"] = cfg
    # calibration (one run, shared by all backends and layers)
    grams = {}
    hooks = [h for b in wbs if hasattr(b, "calibration_hook")
             for h in [b.calibration_hook(cfg.backends[b.name], ctx)] if h is not None]
    if any(b.needs_calibration(cfg.backends[b.name]) for b in wbs):
        if not cfg.calib_text:
            raise OrtleanError("activation-aware planning needs --calib-text FILE (for TT, --tt-whiten=none skips it: "
                               "plain weight SVD, known to wreck real models)")
        from .calibrate import collect_grams

        grams = collect_grams(inp, [c.input.name for c in todo], cfg.calib_text, cfg.tokenizer,
                              cfg.calib_tokens, cfg.calib_window, progress=cfg.progress,
                              hook=(lambda n, x: [h(n, x) for h in hooks]) if hooks else None)

    # plan every layer; the first weight backend that does not say "dense" takes it
    chosen: list[tuple] = []        # (cand, backend, plan)
    bar = tqdm(todo, desc="plan", unit="layer", disable=not cfg.progress, leave=False)
    for c in bar:
        bar.set_postfix_str(c.name[-40:])
        W = c.weight_array()
        G = grams[c.input.name].G if c.input.name in grams else None
        reasons = []
        for b in wbs:
            bcfg = cfg.backends[b.name]
            if c.target not in bcfg.targets:
                continue
            plan = b.plan(c, W, G, bcfg, ctx)
            if plan.decision != "dense":
                chosen.append((c, b, plan))
                records[c.name] = _record(c, plan)
                break
            reasons.append(plan)
        else:
            last = reasons[-1]
            records[c.name] = LayerRecord(c.name, c.layer, c.target, c.role, [c.K, c.N], "dense", c.params, c.params,
                                          last.gap, "; ".join(p.reason for p in reasons), speed=last.speed or None,
                                          extra=_extra(last))
    bar.close()

    # end-to-end quality guard: per-layer gaps compound; keep the largest set of rewritten layers
    # (lowest gap first) whose whole-model loss on held-out calibration text meets the budget
    quality = None
    if chosen and cfg.quality_budget is not None:
        chosen, quality = _quality_guard(cfg, inp, io, chosen, records, ctx)

    for c, b, plan in chosen:
        b.emit(model.graph, c, plan, ctx)
    emitted = len(chosen)
    graph_records = []
    for gp in gps:  # graph passes (PackedAttention …) after the weight backends
        recs = gp.run(model, ctx, cfg.backends[gp.name])
        graph_records += recs
        emitted += sum(1 for r in recs if r.get("backend") != "dense")
    if emitted:
        model.opset_imports.setdefault(DOMAIN, 1)
        model.graph.sort()
    written = g.save_model_atomic(model, out, input_path=inp, check=lambda p: check(p, out)) if emitted else []
    if emitted:
        written += copy_sidecars(inp, out)
    order = {c.name: i for i, c in enumerate(cands)}
    recs = sorted(records.values(), key=lambda r: order.get(r.layer, order.get(r.layer.split("+")[0], 1 << 30)))
    summary = {
        "model": str(inp),
        "output": str(out) if emitted else None,
        "written": [str(p) for p in written],
        "kind": io.kind,
        "layers": [r.as_dict() for r in recs],
        "factored": emitted,
        "kept_dense": len(recs) - emitted,
        "params_before": int(sum(r.params_before for r in recs)),
        "params_after": int(sum(r.params_after for r in recs)),
        "quality": quality,
        "graph_passes": graph_records,
        "config": {"backends": {k: _cfg_dict(v) for k, v in cfg.backends.items()}, "calib_text": cfg.calib_text,
                   "calib_tokens": cfg.calib_tokens, "include": cfg.include, "exclude": cfg.exclude,
                   "quality_budget": cfg.quality_budget, "quality_tokens": cfg.quality_tokens},
        "seconds": round(time.time() - t0, 1),
    }
    if cfg.report:
        _write_json_atomic(Path(cfg.report), summary)
    return summary


def _run_graph_passes_only(cfg: RewriteConfig, gps, t0: float) -> dict:
    """`ortlean rewrite` with only graph passes enabled (e.g. --state-pack=binary for
    PackedAttention): no weight candidates, calibration or quality guard."""
    from . import backends as reg
    from custom_ops import runtime

    inp = Path(cfg.model)
    out = Path(cfg.output)
    if out.resolve() == inp.resolve():
        raise OrtleanError(f"{out}: output would overwrite the input model; choose another --output")
    model = g.load_model(inp)
    io = runtime.ModelIO.from_model(str(inp))
    ctx = reg.Context(model_path=str(inp), io=io, speed_M=1 if io.kind == "causal-lm" else 128,
                      threads=cfg.threads, calib_text=cfg.calib_text, tokenizer=cfg.tokenizer)
    recs = []
    for gp in gps:
        recs += gp.run(model, ctx, cfg.backends[gp.name])
    emitted = sum(1 for r in recs if r.get("backend") != "dense")
    written = []
    if emitted:
        model.opset_imports.setdefault(DOMAIN, 1)
        model.graph.sort()
        written = g.save_model_atomic(model, out, input_path=inp, check=lambda p: check(p, out))
        written += copy_sidecars(inp, out)
    summary = {"model": str(inp), "output": str(out) if emitted else None, "written": [str(p) for p in written],
               "kind": io.kind, "layers": [], "graph_passes": recs, "factored": emitted,
               "kept_dense": len(recs) - emitted, "params_before": 0, "params_after": 0, "quality": None,
               "config": {"backends": {k: _cfg_dict(v) for k, v in cfg.backends.items()}},
               "seconds": round(time.time() - t0, 1)}
    if cfg.report:
        _write_json_atomic(Path(cfg.report), summary)
    return summary


def _cfg_dict(c) -> dict:
    d = dict(getattr(c, "__dict__", {}))
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def _record(c, plan) -> LayerRecord:
    return LayerRecord(c.name, c.layer, c.target, c.role, [c.K, c.N], plan.decision, c.params, plan.params_after,
                       plan.gap, plan.reason, rank=plan.attrs.get("rank"), method=plan.attrs.get("method"),
                       speed=plan.speed or None, extra=_extra(plan))


def _extra(plan) -> dict | None:
    return {k: v for k, v in plan.attrs.items() if k not in ("rank", "method")} or None


# --------------------------------------------------------------------------- quality guard
class QualityProbe:
    """Whole-model loss of a candidate rewrite vs the dense model on held-out calibration text
    (the part after the calibration tokens; never the evaluation text): Δppl for causal LMs,
    1 − mean sentence-embedding cosine for encoders."""

    def __init__(self, inp: Path, io, cfg: RewriteConfig):
        import onnxruntime as ort

        from custom_ops import runtime
        from .calibrate import tokenize_text

        self.io = io
        self.threads = max(1, cfg.threads)
        tok, text = tokenize_text(inp, cfg.calib_text, cfg.tokenizer)
        self.tok = tok
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        dense = _any_session(str(inp), so)
        if io.kind == "causal-lm":
            ids = tok.encode(text, add_special_tokens=False).ids
            held = ids[cfg.calib_tokens: cfg.calib_tokens + cfg.quality_tokens]
            if len(held) < 64:  # short text: score its tail, overlapping calibration
                held = ids[-cfg.quality_tokens:]
            self.ids = np.asarray(held, dtype=np.int64)
            self.window = min(256, len(self.ids))
            self.ref = runtime.perplexity(dense, io, self.ids, window=self.window)["nll"]
        else:
            sents = runtime.sentences_from_text(text, 4 * max(8, cfg.quality_tokens // 16))
            self.sents = sents[1::4][: max(8, cfg.quality_tokens // 16)]  # not the calibration sentences' order
            self.ref = runtime.embeddings(dense, io, tok, self.sents)

    def loss(self, model_bytes_or_path) -> float:
        import onnxruntime as ort

        from custom_ops import runtime

        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        sess = _any_session(model_bytes_or_path, so)
        if self.io.kind == "causal-lm":
            io = runtime.ModelIO.from_session(sess)  # a rewrite may add state inputs (event caches)
            nll = runtime.perplexity(sess, io, self.ids, window=self.window)["nll"]
            return float(np.exp(nll - self.ref) - 1.0)
        e = runtime.embeddings(sess, self.io, self.tok, self.sents)
        cos = np.sum(e * self.ref, axis=1) / (np.linalg.norm(e, axis=1) * np.linalg.norm(self.ref, axis=1) + 1e-30)
        return float(1.0 - cos.mean())


def _any_session(model, so):
    import custom_ops

    return custom_ops.session(model, so=so, backend="auto")


def _trial_model(inp: Path, chosen, ctx) -> bytes:
    m = g.load_model(inp)
    cands = {c.name: c for c in g.find_candidates(m)}
    for c, b, plan in chosen:
        b.emit(m.graph, c.rebind(cands) if hasattr(c, "rebind") else cands[c.name], plan, ctx)
    m.opset_imports.setdefault(DOMAIN, 1)
    ir.external_data.load_to_model(m)
    return ir.serde.serialize_model(m).SerializeToString()


def _quality_guard(cfg: RewriteConfig, inp: Path, io, chosen, records, ctx):
    from tqdm.auto import tqdm

    probe = QualityProbe(inp, io, cfg)
    order = sorted(chosen, key=lambda t: (t[2].gap if t[2].gap is not None else 0.0, -(t[0].params - t[2].params_after)))
    tried: dict[int, float] = {}
    bar = tqdm(desc="quality guard", unit="trial", disable=not cfg.progress, leave=False)

    def loss(k: int) -> float:
        if k not in tried:
            tried[k] = probe.loss(_trial_model(inp, order[:k], ctx)) if k else 0.0
            bar.update(1)
        return tried[k]

    n = len(order)
    if loss(n) <= cfg.quality_budget:
        k = n
    else:  # largest k with loss(k) ≤ budget (loss grows with k), by bisection
        lo, hi = 0, n
        while lo < hi - 1:
            mid = (lo + hi) // 2
            if loss(mid) <= cfg.quality_budget:
                lo = mid
            else:
                hi = mid
        k = lo
    bar.close()
    metric = "delta_ppl" if io.kind == "causal-lm" else "1-cosine"
    final = loss(k)
    above = [v for kk, v in tried.items() if kk > k] or [final]
    why = (f"kept dense: end-to-end quality budget ({metric} {min(above):+.4f} with more layers > {cfg.quality_budget}; "
           f"the {k} lowest-gap layers give {final:+.4f})")
    for c, b, plan in order[k:]:
        r = records[c.name]
        r.decision = f"{why}; alone: {plan.reason}"
        r.backend = "dense"
        r.params_after = r.params_before
    return order[:k], {"metric": metric, "budget": cfg.quality_budget, "kept": k, "planned": n,
                       "loss": final, "trials": {str(kk): v for kk, v in sorted(tried.items())},
                       "probe": ("tokens" if io.kind == "causal-lm" else "sentences"),
                       "probe_size": int(probe.ids.size) if io.kind == "causal-lm" else len(probe.sents)}


SIDECARS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json",
            "generation_config.json", "vocab.txt", "ortlean.json")


def copy_sidecars(inp: Path, out: Path) -> list[Path]:
    """Tokenizer/config files next to the input go next to the output too (when it is another
    directory and they are not there yet), so eval/generate work on the rewritten model alone."""
    import shutil

    copied = []
    if inp.resolve().parent == out.resolve().parent:
        return copied
    for name in SIDECARS:
        src, dst = inp.parent / name, out.parent / name
        if src.is_file() and not dst.exists():
            shutil.copy2(src, dst)
            copied.append(dst)
    return copied


def _dense(c, why: str) -> LayerRecord:
    return LayerRecord(c.name, c.layer, c.target, c.role, [c.K, c.N], "dense", c.params, c.params, None, f"kept dense: {why}")


def check(path: Path, out: Path) -> None:
    """onnx.checker on the saved file (a path handles external data and > 2 GB models). The
    custom domain has no schemas, so the checker validates the graph and the standard nodes."""
    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as e:
        raise OrtleanError(f"{out}: rewritten model fails onnx.checker: {e}") from None


def _write_json_atomic(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, default=_json_default))
    os.replace(tmp, path)


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, tuple):
        return list(o)
    return str(o)


def format_report(summary: dict) -> str:
    rows = [("layer", "target", "shape", "backend", "params", "→ stored", "gap", "decision")]
    if not summary["layers"]:
        rows = []
    for r in summary["layers"]:
        gap = "" if r["gap"] is None else f"{r['gap']:.4f}"
        rows.append((r["layer"], f"{r['target']}/{r['role']}", "x".join(map(str, r["shape"])), r["backend"],
                     f"{r['params_before']:,}", f"{r['params_after']:,}", gap, r["decision"]))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]) - 1)] if rows else []
    lines = []
    for row in rows:
        lines.append("  ".join(str(v).ljust(w) for v, w in zip(row[:-1], widths)) + "  " + row[-1])
    for r in summary.get("graph_passes") or []:
        lines.append(f"{r['layer']}  {r['backend']}  {r['decision']}")
    pb, pa = summary["params_before"], summary["params_after"]
    lines.append("")
    q = summary.get("quality")
    if q:
        lines.append(f"end-to-end check on held-out calibration text ({q['probe_size']} {q['probe']}): {q['metric']} "
                     f"{q['loss']:+.4f} with {q['kept']} of {q['planned']} planned layers (budget {q['budget']})")
    if summary["layers"]:
        by: dict[str, int] = {}
        for r in summary["layers"]:
            if r["backend"] != "dense":
                by[r["backend"]] = by.get(r["backend"], 0) + 1
        how = f" ({', '.join(f'{k}: {v}' for k, v in by.items())})" if by else ""
        lines.append(f"{summary['factored']} layers rewritten{how}, {summary['kept_dense']} kept dense; candidate params "
                     f"{pb:,} → {pa:,} ({100 * (1 - pa / max(pb, 1)):.1f} % saved)")
    else:  # graph passes only
        lines.append(f"{summary['factored']} attention cores rewritten, {summary['kept_dense']} left as they were")
    if summary["output"]:
        lines.append(f"wrote {', '.join(summary['written'])}")
    else:
        lines.append("no layer met the quality and speed bars: no model written (the dense model is the better one)")
    return "\n".join(lines)
