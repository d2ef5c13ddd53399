"""`ortlean rewrite`: load → "pre" graph passes → candidates → calibrate → plan per layer → quality
guard → emit → "post" graph passes → check → save. The backends are the registry's
(``rewriter.backends``); what they get is ``kit.backend.Context``."""
from __future__ import annotations

import fnmatch
import os
import time
from pathlib import Path

from custom_ops.schema import DOMAIN

from . import backends, genai, report
from .errors import OrtleanError
from .kit import calib, candidates, modelfile, stream
from .kit.backend import Context
from .kit.options import RewriteConfig
from .kit.progress import Progress
from .kit.quality import BudgetRefused, largest_passing
from .report import LayerRecord

__all__ = ["RewriteConfig", "LayerRecord", "run", "default_output", "format_report", "Resources"]
default_output = modelfile.default_output


def format_report(summary: dict) -> str:
    """The report's table and closing lines, then what the rewrite itself cost (peak RSS, wall time)."""
    out = report.format_report(summary)
    res = summary.get("resources")
    if res:
        out += "\n" + Resources.line(res)
    return out


def _rss_mb() -> tuple[float, float]:
    """(peak, current) resident set of this process and its waited-for children, in MiB: the peak
    from resource.getrusage (ru_maxrss, KiB on Linux), the current from /proc/self/status."""
    import resource

    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
    cur = float("nan")
    try:
        with open("/proc/self/status") as fh:
            cur = next(int(ln.split()[1]) for ln in fh if ln.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration, ValueError):
        pass
    return peak, cur


class Resources:
    """Wall time and resident memory of one rewrite, stage by stage (the closing line of the report
    and ``summary["resources"]``)."""

    def __init__(self, progress: bool = False):
        self.t0 = time.monotonic()
        self.last = self.t0
        self.stages: list[dict] = []
        self.progress = progress

    def mark(self, stage: str) -> None:
        """`stage` just ended: its seconds, the peak RSS so far and the RSS now (a line on stderr
        with progress on once the rewrite has run 5 s, or always with ORTLEAN_TRACE_MEMORY set: a long
        rewrite says where it is)."""
        now = time.monotonic()
        import gc

        gc.collect()
        stream.release_heap()        # what the stage's sessions freed goes back to the system
        peak, cur = _rss_mb()
        self.stages.append({"stage": stage, "seconds": round(now - self.last, 2), "peak_rss_mb": round(peak),
                            "rss_mb": round(cur)})
        # a quick rewrite (or an early refusal) stays quiet
        if (self.progress and now - self.t0 >= 5.0) or os.environ.get("ORTLEAN_TRACE_MEMORY"):
            import sys

            print(f"[ortlean] {stage}: {now - self.last:.1f} s (RSS {cur / 1024:.2f} GiB, peak so far "
                  f"{peak / 1024:.2f} GiB)", file=sys.stderr, flush=True)
        self.last = now

    def summary(self) -> dict:
        peak, _ = _rss_mb()
        return {"peak_rss_mb": round(peak), "seconds": round(time.monotonic() - self.t0, 1), "stages": self.stages}

    @staticmethod
    def line(res: dict) -> str:
        st = ", ".join(f"{s['stage']} {s['seconds']:.1f} s" for s in res["stages"] if s["seconds"] >= 0.05)
        return (f"rewrite: peak RSS {res['peak_rss_mb'] / 1024:.2f} GiB (getrusage: this process and its children), "
                f"wall {res['seconds']:.1f} s" + (f" ({st})" if st else ""))


def _enabled(cfg: RewriteConfig, registered: list) -> list:
    """One instance per enabled registered backend, in registry order."""
    return [B(cfg.backends[B.name]) for B in registered if B.name in cfg.backends and cfg.backends[B.name].enabled]


def run(cfg: RewriteConfig) -> dict:

    t0 = time.time()
    res = Resources(progress=cfg.progress)
    cfg.validate()
    weight = _enabled(cfg, backends.WEIGHT_BACKENDS)
    passes = _enabled(cfg, backends.GRAPH_PASSES)
    if not weight and not [p for p in passes if getattr(p.cfg, "explicit", True)]:  # --fuse=auto alone is no request
        raise OrtleanError("no backend enabled: pass --weights int4|int8, --fuse=on, --tt=on, --kwta=on, "
                           "--event-driven=on or --state-pack=... --state-pack-target=mlp")
    inp, out = Path(cfg.model), Path(cfg.output)
    model = modelfile.load_model(inp)
    if out.resolve() == inp.resolve():
        raise OrtleanError(f"{out}: output would overwrite the input model; choose another --output")
    ctx = Context(cfg, model, modelfile.model_io(model, inp))
    ctx.weight_backends = weight
    res.mark("load")
    graph_records = _graph_passes(passes, "pre", model, ctx, res)
    if weight and not any(getattr(b.cfg, "explicit", True) for b in weight) and not candidates.find_candidates(model):
        # a default that found nothing to take (--weights auto on a packaged model's export whose weights are
        # already quantized, e.g. a rewrite of a rewrite): not an error when something else was asked for
        weight = ctx.weight_backends = []
        if not [p for p in passes if getattr(p.cfg, "explicit", True)]:
            raise OrtleanError(f"{inp}: nothing to rewrite: no float weight MatMul for --weights auto, and no other "
                               "backend asked (--fuse=on, --tt=on, --kwta=on, --state-pack=... )")
    # the dense reference the measurements compare with (ctx.source()): the model before any plan is
    # emitted — a clone sharing its tensors (no weight is copied)
    ctx.reference = model.clone()

    records: dict[str, LayerRecord] = {}
    chosen: list[tuple] = []        # (cand, backend, plan)
    fallback: dict[str, tuple] = {}  # layer → (cand, pinned backend, plan) if the guard drops its plan
    quality = None
    refused = None               # why nothing is written although layers were planned (the budget)
    order: dict[str, int] = {}
    if weight:
        order, records, todo = _candidates(model, cfg, weight, inp)
        for b in weight:  # a backend may plan several MatMuls as one unit (gating: shared-input projections)
            todo = b.group_candidates(todo, weight)
        ctx.todo = todo
        res.mark("candidates")
        grams = ctx.grams = _calibrate(cfg, ctx, weight, todo)   # (ctx.grams: a backend may plan layers ahead)
        if grams:
            res.mark("calibration")

        # plan every layer; the first weight backend that does not say "dense" takes it
        bar = Progress("plan", total=len(todo), unit="layer", enabled=cfg.progress)   # a line every 15 s in a log
        for c in todo:
            bar.status(c.name)
            W = c.weight_array()
            G = grams[c.input.name].G if c.input.name in grams else None
            reasons = []
            for b in weight:
                if c.target not in b.cfg.targets:
                    continue
                plan = b.plan(c, W, G, ctx)
                if plan.decision != "dense":
                    chosen.append((c, b, plan))
                    records[c.name] = report.record(c, plan)
                    if not _pinned(b):  # what this layer becomes if the quality guard drops the plan
                        fb = [(c, p, pp) for p in weight if _pinned(p) and c.target in p.cfg.targets
                              for pp in [p.plan(c, W, G, ctx)] if pp.decision != "dense"]
                        if fb:
                            fallback[c.name] = fb[0]
                    break
                reasons.append(plan)
            else:
                records[c.name] = report.all_dense(c, reasons)
            W = None
            for m in getattr(c, "members", None) or [c]:   # its pages stay in the page cache, not in our RSS
                modelfile.release_pages(m.weight.const_value)
            stream.trace_memory(f"planned {c.name}")
            bar.update(1)
        bar.close()
        W = G = None  # a view of a memory-mapped external weight would block saving (BufferError)
        grams = ctx.grams = None   # the Grams are planned with: not held through the mix and the guard
        for b in weight:  # a backend that plans the whole model at once revises its plans (the --weights mix)
            revised = b.finish_plans([(c, p) for c, bb, p in chosen if bb is b], ctx)
            if revised:
                chosen = [(c, bb, revised.get(c.name, p) if bb is b else p) for c, bb, p in chosen]
                records.update({c.name: report.record(c, p) for c, bb, p in chosen if bb is b and c.name in revised})
        modelfile.release_all(model)
        res.mark("plan")

        # end-to-end quality guard: per-layer gaps compound; keep the largest set of rewritten layers
        # (lowest gap first) whose whole-model loss on held-out calibration text meets the budget
        if chosen and cfg.quality_budget is not None:
            if not cfg.calib_text:   # only pinned plans get here without it (the others calibrate)
                # plans whose weights are the source's bit for bit (--weights gguf) change no weight: they
                # are written unmeasured, as the kernels' own numerics are; any other precision is a loss
                lossy = sorted({p.decision for _, _, p in chosen if not p.attrs.get("bit_exact")})
                if lossy:
                    raise OrtleanError(f"{', '.join(lossy)} changes the model's outputs, and --quality-budget "
                                       f"{cfg.quality_budget} is checked on held-out text: give --calib-text FILE "
                                       "(or --quality-budget off to write the model unmeasured)")
                quality = {"skipped": "no --calib-text: the weights are the source's bit for bit (the ops' int8 "
                                      "activations were not measured; give --calib-text to measure them)"}
            else:
                try:
                    chosen, quality = _quality_guard(chosen, records, ctx.quality, cfg.quality_budget, cfg.progress,
                                                     fallback)
                    ctx.weights_loss = max(0.0, quality.get("mean", quality["loss"]))
                except BudgetRefused as e:
                    refused = str(e)
                    quality, chosen = e.quality, []
            res.mark("quality guard")
        for c, b, plan in chosen:
            b.emit(model.graph, c, plan, ctx)
        res.mark("emit")
    if not refused:   # a post pass that measures its change over what is left of the budget may refuse too
        try:
            graph_records += _graph_passes(passes, "post", model, ctx, res)
        except BudgetRefused as e:
            refused = str(e)
            graph_records.append({"layer": "attention", "backend": "dense", "decision": refused, "quality": e.quality})

    rewritten = sum(1 for r in graph_records if r.get("backend") != "dense")   # by the graph passes
    emitted = 0 if refused else len(chosen) + rewritten
    written, genai_cfg = [], None
    if emitted:
        model.opset_imports.setdefault(DOMAIN, 1)
        model.graph.sort()
        written = modelfile.save_model_atomic(model, out, input_path=inp, check=lambda p: modelfile.check(p, out))
        copied = modelfile.copy_sidecars(inp, out)
        written += copied
        if ctx.io.kind == "causal-lm":  # onnxruntime-genai's config beside it, where genai can run the graph
            genai_cfg = genai.write_config(out, inp, copied)
            written += [Path(p) for p in genai_cfg.get("written", [])]
        res.mark("save")
    recs = sorted(records.values(), key=lambda r: order.get(r.layer, order.get(r.layer.split("+")[0], 1 << 30)))
    summary = {
        "model": str(inp),
        "output": str(out) if emitted else None,
        "written": [str(p) for p in written],
        "kind": ctx.io.kind,
        "layers": [r.as_dict() for r in recs],
        # layers rewritten / kept dense (a graph-pass-only rewrite: the structures it matched)
        "factored": len(chosen) if recs else rewritten,
        "kept_dense": len(recs) - len(chosen) if recs else len(graph_records) - rewritten,
        "params_before": int(sum(r.params_before for r in recs)),
        "params_after": int(sum(r.params_after for r in recs)),
        "quality": quality,
        "refused": refused,
        "genai": genai_cfg,
        "graph_passes": graph_records,
        "config": {"backends": {k: report.config_dict(v) for k, v in cfg.backends.items()}, "calib_text": cfg.calib_text,
                   "calib_tokens": cfg.calib_tokens, "include": cfg.include, "exclude": cfg.exclude,
                   "quality_budget": cfg.quality_budget, "quality_tokens": cfg.quality_tokens},
        "seconds": round(time.time() - t0, 1),
        "resources": res.summary(),
    }
    summary["notes"] = [line for b in [*weight, *passes] for line in getattr(b, "notes", lambda s: [])(summary)]
    if cfg.report:
        report.write_json_atomic(Path(cfg.report), summary)
    return summary


def _graph_passes(passes: list, stage: str, model, ctx: Context, res: Resources | None = None) -> list[dict]:
    """Run the graph passes of `stage`; after a "pre" pass changed the model, the rewrite runs it
    from memory (calibration, quality probe) and reads its I/O again."""
    out = []
    for gp in passes:
        if gp.stage != stage:
            continue
        try:
            recs = gp.run(model, ctx)
        except BudgetRefused:
            if res is not None:      # the closing line still says how long the refusing pass ran
                res.mark(gp.name)
            raise
        out += recs
        modelfile.release_all(model)   # weights the pass read: their pages back to the page cache
        if res is not None:
            res.mark(gp.name)
        if stage == "pre" and any(r.get("backend") != "dense" for r in recs):
            ctx.modified = True
            ctx.io = modelfile.model_io(model, ctx.model_path)
    return out


def _candidates(model, cfg: RewriteConfig, weight: list, inp: Path):
    """({weight MatMul name: graph position}, records of those no backend will plan, the ones to plan)."""
    done = candidates.ortlean_nodes(model)
    cands = candidates.find_candidates(model)
    already = [n.name for n in done]
    if already:
        hit = [n for n in already for gl in cfg.include if fnmatch.fnmatchcase(n, gl)]
        if hit:
            kinds = {n.name: n.op_type for n in done}
            raise OrtleanError(f"{inp}: layer {hit[0]!r} is already rewritten ({kinds[hit[0]]}); refusing to rewrite it again")
    unsupported = candidates.find_unsupported(model)
    if not cands:
        extra = f" ({len(already)} layers are already rewritten by ortlean)" if already else ""
        if unsupported:  # name the first node and why (every weight layer is one no backend takes)
            u = unsupported[0]
            more = f" (and {len(unsupported) - 1} more weight layers)" if len(unsupported) > 1 else ""
            extra += f"; node {u.name!r}: {u.why}{more}"
        raise OrtleanError(f"{inp}: no eligible MatMul (a MatMul whose B is a constant float initializer){extra}")
    _, excluded = candidates.select(cands, cfg.include, cfg.exclude)
    records: dict[str, LayerRecord] = {u.name: report.unsupported(u) for u in unsupported}
    todo = []
    for c in cands:
        if c.name in excluded:
            records[c.name] = report.dense(c, f"excluded ({excluded[c.name]})")
        elif not any(c.target in b.cfg.targets for b in weight):
            records[c.name] = report.dense(c, f"target {c.target} not selected by any backend's --*-target")
        else:
            todo.append(c)
    if not todo:
        raise OrtleanError(f"{inp}: no MatMul left to rewrite after the --*-target flags and --include/--exclude")
    pos = {id(n): i for i, n in enumerate(model.graph)}
    order = {x.name: pos[id(x.node)] for x in [*cands, *unsupported]}
    return order, records, todo


def _calibrate(cfg: RewriteConfig, ctx: Context, weight: list, todo: list) -> dict:
    """One calibration run shared by all backends and layers: the Grams of the planned layers'
    inputs (and every activation to the backends' hooks)."""
    hooks = [h for b in weight for h in [b.calibration_hook(ctx)] if h is not None]
    if not any(b.needs_calibration() for b in weight):
        return {}
    if not cfg.calib_text:
        raise OrtleanError("activation-aware planning needs --calib-text FILE (for TT, --tt-whiten=none skips it: "
                           "plain weight SVD, known to wreck real models)")
    return calib.collect_grams(ctx.source(), ctx.io, [c.input.name for c in todo], ctx.calib, cfg.calib_tokens,
                               cfg.calib_window, progress=cfg.progress,
                               hook=(lambda n, x: [h(n, x) for h in hooks]) if hooks else None)


def _pinned(b) -> bool:
    """A backend whose plans the quality guard keeps (--weights: the precision the user asked for)."""
    return bool(getattr(b, "pinned", False))


def _quality_guard(chosen: list, records: dict, quality, budget: float, progress: bool, fallback: dict | None = None):
    """Keep the k lowest-gap plans for the largest k whose end-to-end loss (quality.loss, against the
    source weights) is within `budget`; the others go back to dense — or to their `fallback` plan
    (the pinned --weights backend), which is in every trial — with the reason in their record.
    The budget covers every change the rewrite makes, weight quantization included (issue 34): the
    pinned plans are always in the trials, and when they alone (every other plan at its fallback,
    k = 0) cost more than the budget, nothing is written (:class:`BudgetRefused`) — the user may lift
    the budget explicitly."""
    fallback = fallback or {}
    pinned = [t for t in chosen if _pinned(t[1])]
    chosen = [t for t in chosen if not _pinned(t[1])]
    order = sorted(chosen, key=lambda t: (t[2].gap if t[2].gap is not None else 0.0, -(t[0].params - t[2].params_after)))
    tried: dict[int, float] = {}
    bar = Progress("quality guard", unit="trial", enabled=progress)

    def plans(k: int) -> list:
        return order[:k] + [fallback[t[0].name] for t in order[k:] if t[0].name in fallback] + pinned

    means: dict[int, float] = {}

    def loss(k: int) -> float:   # the probe's bound (causal LMs), its mean in `means`
        if k not in tried:
            tried[k] = quality.loss(plans(k))
            last = getattr(quality.probe, "last", None)
            means[k] = last[0] if last is not None else tried[k]
            bar.update(1)
        return tried[k]

    probe = quality.probe
    weights_by = sorted({t[2].decision for t in pinned} | {fallback[t[0].name][2].decision for t in order
                                                           if t[0].name in fallback})
    alone = loss(0) if (pinned or any(t[0].name in fallback for t in order)) else None
    if alone is not None and alone > budget:
        bar.close()
        res = {"metric": probe.metric, "budget": budget, "kept": 0, "planned": len(order), "loss": alone,
               "mean": means[0], "weights_alone": alone, "weights_by": weights_by, "refused": True,
               "trials": {"0": alone}, "probe": probe.unit, "probe_size": probe.size, "bound": _BOUND}
        raise BudgetRefused(
            f"the weights alone ({', '.join(weights_by)}) cost {probe.metric} {means[0]:+.4f} (one-sided 95 % bound "
            f"{alone:+.4f}) against the source weights on held-out calibration text ({probe.size} {probe.unit}), over "
            f"--quality-budget {budget}: nothing written (to write them anyway, lift the budget: --quality-budget "
            f"{_lift(alone)})", res)
    n = len(order)  # loss grows with k: all of them, else the largest k by bisection
    k = n if loss(n) <= budget else largest_passing(lambda k: loss(k) <= budget, 0, n - 1)
    bar.close()
    final = loss(k)
    above = [v for kk, v in tried.items() if kk > k] or [final]
    why = (f"kept dense: end-to-end quality budget ({probe.metric} vs the source weights {min(above):+.4f} with more "
           f"layers > {budget}; the {k} lowest-gap layers give {final:+.4f})")
    for c, b, plan in order[k:]:
        if c.name in fallback:
            fc, fb, fplan = fallback[c.name]
            r = records[c.name] = report.record(fc, fplan)
            r.decision = f"{fplan.reason}; {b.name} dropped by the {why[len('kept dense: '):]}; alone: {plan.reason}"
            continue
        r = records[c.name]
        r.decision = f"{why}; alone: {plan.reason}"
        r.backend = "dense"
        r.params_after = r.params_before
    res = {"metric": probe.metric, "budget": budget, "kept": k, "planned": n, "loss": final, "mean": means[k],
           "trials": {str(kk): v for kk, v in sorted(tried.items())}, "probe": probe.unit, "probe_size": probe.size,
           "bound": _BOUND}
    if alone is not None:
        res["pinned"] = len(pinned)
        res["weights_by"] = weights_by
        res["weights_alone"] = alone    # the model at the asked precision, no other backend, vs the source
    return plans(k), res


_BOUND = ("causal LMs: the one-sided 95 % upper bound of Δppl (per-token NLL differences against the source "
          "weights on the same held-out tokens); encoders: 1 − mean cosine")


def _lift(loss: float) -> str:
    """A --quality-budget value just above `loss` (two significant digits, rounded up)."""
    import math

    if loss <= 0:
        return "0.01"
    e = math.floor(math.log10(loss)) - 1
    return f"{math.ceil(loss / 10 ** e) * 10 ** e:.{max(0, -e)}f}"
