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
from . import tt as ttb
from .errors import OrtleanError


@dataclass
class RewriteConfig:
    model: str
    output: str
    tt: ttb.TTConfig = field(default_factory=ttb.TTConfig)
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    calib_text: str | None = None
    calib_tokens: int = 4096
    calib_window: int = 256
    tokenizer: str | None = None
    report: str | None = None
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

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def default_output(model: str) -> str:
    p = Path(model)
    return str(p.with_name(p.stem + ".lean.onnx"))


def run(cfg: RewriteConfig) -> dict:
    from tqdm.auto import tqdm

    t0 = time.time()
    cfg.tt.validate()
    if not cfg.tt.enabled:
        raise OrtleanError("no backend enabled: pass --tt=on (the only backend so far)")
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
    records: list[LayerRecord] = []
    todo = []
    for c in cands:
        if c.name in excluded:
            records.append(_dense(c, f"excluded ({excluded[c.name]})"))
        elif c.target not in cfg.tt.targets:
            records.append(_dense(c, f"target {c.target} not in --tt-target"))
        else:
            todo.append(c)
    if not todo:
        raise OrtleanError(f"{inp}: no MatMul left to rewrite after --tt-target {','.join(cfg.tt.targets)} and --include/--exclude")

    # calibration (one run, shared by all layers)
    grams = {}
    if cfg.tt.whiten != "none":
        if not cfg.calib_text:
            raise OrtleanError("activation-aware factorisation needs --calib-text FILE (or --tt-whiten=none, which is "
                               "plain weight SVD and known to wreck real models)")
        from .calibrate import collect_grams

        grams = collect_grams(inp, [c.input.name for c in todo], cfg.calib_text, cfg.tokenizer,
                              cfg.calib_tokens, cfg.calib_window, progress=cfg.progress)
    from . import runner

    io = runner.ModelIO.from_model(str(inp))
    speed_M = cfg.tt.speed_M or (1 if io.kind == "causal-lm" else 128)

    emitted = 0
    bar = tqdm(todo, desc="plan", unit="layer", disable=not cfg.progress, leave=False)
    for c in bar:
        bar.set_postfix_str(c.name[-40:])
        W = c.weight_array()
        G = grams[c.input.name].G if c.input.name in grams else None
        plan = ttb.plan_layer(W, G, cfg.tt, speed_M)
        if plan.decision == "tt":
            f = plan.factor
            sp = plan.speed.get(f"M{speed_M}", {}).get("speedup", 0.0)
            ttb.emit(model.graph, c, f, {"speedup": sp, "layer": _layer_label(c)})
            emitted += 1
            records.append(LayerRecord(c.name, c.layer, c.target, c.role, [c.K, c.N], "tt", c.params, f.params, f.gap,
                                       f"factored: d={len(f.modes_k)} rank {max(f.ranks)}, {plan.reason}",
                                       rank=f.ranks, method=f.method, speed=plan.speed))
        else:
            records.append(LayerRecord(c.name, c.layer, c.target, c.role, [c.K, c.N], "dense", c.params, c.params, plan.gap,
                                       f"kept dense: {plan.reason}", speed=plan.speed or None))
    bar.close()

    order = {c.name: i for i, c in enumerate(cands)}
    records.sort(key=lambda r: order.get(r.layer, 1 << 30))
    if emitted:
        model.opset_imports.setdefault(DOMAIN, 1)
        model.graph.sort()
    written = g.save_model_atomic(model, out, input_path=inp, check=lambda p: check(p, out)) if emitted else []
    if emitted:
        written += copy_sidecars(inp, out)
    summary = {
        "model": str(inp),
        "output": str(out) if emitted else None,
        "written": [str(p) for p in written],
        "kind": io.kind,
        "layers": [r.as_dict() for r in records],
        "factored": emitted,
        "kept_dense": len(records) - emitted,
        "params_before": int(sum(r.params_before for r in records)),
        "params_after": int(sum(r.params_after for r in records)),
        "config": {"tt": cfg.tt.__dict__ | {"targets": list(cfg.tt.targets)}, "calib_text": cfg.calib_text,
                   "calib_tokens": cfg.calib_tokens, "include": cfg.include, "exclude": cfg.exclude},
        "seconds": round(time.time() - t0, 1),
    }
    if cfg.report:
        _write_json_atomic(Path(cfg.report), summary)
    return summary


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


def _layer_label(c) -> str:
    return f"{c.layer}" if c.layer is not None else c.target


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
    for r in summary["layers"]:
        gap = "" if r["gap"] is None else f"{r['gap']:.4f}"
        rows.append((r["layer"], f"{r['target']}/{r['role']}", "x".join(map(str, r["shape"])), r["backend"],
                     f"{r['params_before']:,}", f"{r['params_after']:,}", gap, r["decision"]))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        lines.append("  ".join(str(v).ljust(w) for v, w in zip(row[:-1], widths)) + "  " + row[-1])
    pb, pa = summary["params_before"], summary["params_after"]
    lines.append("")
    lines.append(f"{summary['factored']} layers factored, {summary['kept_dense']} kept dense; candidate params "
                 f"{pb:,} → {pa:,} ({100 * (1 - pa / max(pb, 1)):.1f} % saved)")
    if summary["output"]:
        lines.append(f"wrote {', '.join(summary['written'])}")
    else:
        lines.append("no layer met the quality and speed bars: no model written (the dense model is the better one)")
    return "\n".join(lines)
