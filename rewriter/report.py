"""The rewrite's report: one record per candidate layer (what was decided and why), the summary
written with --report, and its text form."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np


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


def config_dict(c) -> dict:
    d = {f.name: getattr(c, f.name) for f in fields(c)}
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def record(c, plan) -> LayerRecord:
    return LayerRecord(c.name, c.layer, c.target, c.role, [c.K, c.N], plan.decision, c.params, plan.params_after,
                       plan.gap, plan.reason, rank=plan.attrs.get("rank"), method=plan.attrs.get("method"),
                       speed=plan.speed or None, extra=_extra(plan))


def _extra(plan) -> dict | None:
    return {k: v for k, v in plan.attrs.items() if k not in ("rank", "method")} or None


def all_dense(c, plans: list) -> LayerRecord:
    """Every backend that targets the layer planned it dense: their reasons, the last one's gap."""
    last = plans[-1]
    return LayerRecord(c.name, c.layer, c.target, c.role, [c.K, c.N], "dense", c.params, c.params, last.gap,
                       "; ".join(p.reason for p in plans), speed=last.speed or None, extra=_extra(last))


def unsupported(u) -> LayerRecord:
    """A weight MatMul the backends cannot take (kit.candidates.Unsupported)."""
    shape = list(u.shape) if getattr(u, "shape", None) else [int(d) for d in u.weight.const_value.shape]
    n = int(np.prod(shape))
    return LayerRecord(u.name, None, "?", "?", shape, "dense", n, n, None, f"kept: unsupported ({u.why})")


def dense(c, why: str) -> LayerRecord:
    return LayerRecord(c.name, c.layer, c.target, c.role, [c.K, c.N], "dense", c.params, c.params, None, f"kept dense: {why}")


def write_json_atomic(path: Path, obj) -> None:
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
    for r in summary.get("graph_passes") or []:
        if r.get("tune"):
            lines.append(tune_line(r["tune"]))
    pb, pa = summary["params_before"], summary["params_after"]
    lines.append("")
    q = summary.get("quality")
    if q and "skipped" in q:
        lines.append(f"end-to-end check skipped: {q['skipped']}")
    elif q:
        pin = f" and {q['pinned']} {'/'.join(q['weights_by'])} layers" if q.get("pinned") else ""
        val = (f"{q['mean']:+.4f} (one-sided 95 % bound {q['loss']:+.4f}, held to the budget)"
               if "mean" in q and q["mean"] != q["loss"] else f"{q['loss']:+.4f}")
        lines.append(f"end-to-end check on held-out calibration text ({q['probe_size']} {q['probe']}): {q['metric']} "
                     f"{val} against the source weights with {q['kept']} of {q['planned']} planned layers"
                     f"{pin} (budget {q['budget']})"
                     + (f"; the weights alone ({', '.join(q['weights_by'])}): {q['weights_alone']:+.4f}"
                        if "weights_alone" in q else ""))
        if q.get("note"):
            lines.append(f"note: {q['note']}")
    if summary["layers"]:
        by: dict[str, int] = {}
        for r in summary["layers"]:
            if r["backend"] != "dense":
                by[r["backend"]] = by.get(r["backend"], 0) + 1
        how = f" ({', '.join(f'{k}: {v}' for k, v in by.items())})" if by else ""
        lines.append(f"{summary['factored']} layers rewritten{how}, {summary['kept_dense']} kept dense; candidate params "
                     f"{pb:,} → {pa:,} ({100 * (1 - pa / max(pb, 1)):.1f} % saved)")
    else:  # graph passes only
        by = {}
        for r in summary.get("graph_passes") or []:
            if r["backend"] != "dense":
                by[r["backend"]] = by.get(r["backend"], 0) + 1
        how = f" ({', '.join(f'{k}: {v}' for k, v in by.items())})" if by else ""
        lines.append(f"{summary['factored']} rewritten by graph passes{how}, {summary['kept_dense']} left as they were")
    lines += summary.get("notes") or []
    if summary["output"]:
        lines.append(f"wrote {', '.join(summary['written'])}")
        g = summary.get("genai")
        if g:
            lines.append(f"onnxruntime-genai: {g.get('note') or g.get('skipped')}")
    elif summary.get("refused"):
        lines.append(summary["refused"])
    else:
        lines.append("no layer met the quality and speed bars: no model written (the dense model is the better one)")
    return "\n".join(lines)


def tune_line(t: dict) -> str:
    """One paragraph: what --attn-tune tried and chose (PackedAttention on fused graphs)."""
    out = f"attention tune: {t['summary']}"
    q = t.get("quality")
    if isinstance(q, dict):
        tr = ", ".join(f"b{x['budget']:g}/w{x['window']} {100 * x['delta_ppl']:+.2f} %"
                       + (f" (≤ {100 * x['delta_ppl_upper']:+.2f})" if "delta_ppl_upper" in x else "")
                       for x in q["trials"])
        out += (f"\n  decode-mode Δppl vs exact attention ({q['context']}-token context, {q['scored']} decode steps "
                f"of the calibration text; budget {100 * q['budget']:g} %, met by the one-sided 95 % upper bound in "
                f"brackets): {tr}")
    elif q:
        out += f"\n  budget/window not calibrated: {q}"
    m = t.get("min_context_measured")
    if m:
        sp = ", ".join(f"P{p} {v:.2f}x" for p, v in m["speedup"].items())
        out += f"\n  min_context: candidate/exact crossover of the op at {m['threads']} thread(s): {sp}"
    if t.get("note"):
        out += f"\n  note: {t['note']}"
    return out
