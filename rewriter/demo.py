"""`ortlean demo NAME`: the best recipes the tool has for a packaged model, quality first, then speed
against the peers a user would pick instead — one run, one table, one plot.

For a GGUF-packaged causal LM (SmolLM2, Qwen2.5-Coder) the recipes are
- **lossless**: every weight MatMul holds the GGUF's own blocks (BlockQuantMatMul, bit-exact), fused
  graph, exact attention;
- **long-context**: the same weights with PackedAttention's tuned candidate attention over a quantized
  KV cache (`--state-pack binary`: pq key codes, budget / window / min_context tuned on the calibration
  novel within `--quality-budget`).
Both are calibrated on one Austen novel and measured on another: Δppl against the source weights (the
fp32 export) for every row — the peers' too (onnxruntime-genai's builder models, llama.cpp's GGUF scored
by llama.cpp itself) — beside decode tokens/s after 128 / 4k / 8k cached tokens (capped by the model's
positions), 1 and 2 threads, prefill of 128 tokens, and the time to first token (TTFT) of prompts of
4,096 tokens (qwen2.5-coder-1.5b: 4,096, 16,384 and 32,768, capped by its positions as the decode pasts
are: 32,760; ``--prompt``). Writes ``results.json`` (ortlean-results/1), a markdown table,
``speed-vs-context.png`` and ``ttft-vs-prompt.png`` into the work directory.

Backend flags on the command line replace the two recipes by one rewrite with those flags. An encoder
(MiniLM) gets int8 weights (its quality is the embedding cosine).

Speed rows: each model once, under its fastest driver (`ortlean bench --rows best`: ours with shared
K/V buffers, genai's int4 model in its own generator, llama.cpp in llama-bench); the dense export is
the quality reference.

The rewritten models are kept in the work directory with a stamp of what made them (source model,
flags, ortlean's Python code and op library), and so is every row's quality score (stamped by its
files, the text and mode, the code and library: ``quality-cache/``); a later run with the same stamp
reuses them (`--fresh` redoes both), so a warm demo spends its time measuring speed.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from .errors import OrtleanError


# the demo's time-to-first-token prompts (--prompt), by packaged model; every other causal LM: DEMO_PROMPTS
DEMO_PROMPTS = (4096,)
PROMPTS_BY_MODEL = {"qwen2.5-coder-1.5b": (4096, 16384, 32768)}


def demo_prompts(name: str, asked=None) -> list[int]:
    """The TTFT prompt lengths of the demo of ``name``: ``asked`` (--prompt; [] = none) or its default."""
    if asked is not None:
        return sorted({int(n) for n in asked})
    return list(PROMPTS_BY_MODEL.get(name, DEMO_PROMPTS))


def _say(step: int, total: int, msg: str) -> None:
    print(f"[demo {step}/{total}] {msg}", file=sys.stderr, flush=True)


def _stamp(source: Path, flags: list[str]) -> str:
    """What a rewritten model depends on: the source export, the flags, ortlean's code and library."""
    from .kit import stamps

    parts = {"source": str(source.resolve()), "source_mtime": int(source.stat().st_mtime), "flags": flags,
             "code": stamps.code_hash(), "library": stamps.library_hash()}
    return stamps.stamp(parts)


def _rewrite(source: Path, out: Path, flags: list[str], fresh: bool, config) -> dict:
    """`ortlean rewrite SOURCE -o OUT FLAGS` unless OUT holds a rewrite with the same stamp;
    ``config(argv)``: the RewriteConfig of an `ortlean rewrite` command line (rewriter.cli.rewrite_config)."""
    stamp = _stamp(source, flags)
    rep, st = out.parent / "report.json", out.parent / "stamp.txt"
    if not fresh and out.is_file() and rep.is_file() and st.is_file() and st.read_text().strip() == stamp:
        print(f"  reusing {out} (same source, flags, code and library; --fresh redoes it)", file=sys.stderr)
        return json.loads(rep.read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    st.unlink(missing_ok=True)
    from . import pipeline

    cfg = config([str(source), "-o", str(out), "--report", str(rep), *flags])
    summary = pipeline.run(cfg)   # its stage lines on stderr; the per-layer table stays in report.json
    if summary.get("output"):
        st.write_text(stamp + "\n")
    return summary


def plot_line(ax, xs, ys, row: dict, dppl: float | None, **kw) -> None:
    """One row's line: solid for ours, dashed for peers, dotted for the reference; its Δppl against
    the source weights in the legend."""
    q = "Δppl —" if dppl is None else f"Δppl {100 * dppl:+.2f} %"
    style = "-o" if row["side"] == "ours" else "--s" if row["side"] == "peer" else ":^"
    ax.plot(xs, ys, style, label=f"{row['name']} ({q})", **kw)


def plot(doc: dict, path: Path) -> Path | None:
    """Decode tokens/s against the context for every row at the largest thread count (one line per
    model, its fastest driver), Δppl against the source weights in the legend. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from . import results

    ctxs = doc.get("contexts") or []
    if not ctxs:
        return None
    t = str(max(doc["threads"]))
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results.pick_rows(doc):
        per = (r.get("tok_s") or {}).get(t) or {}
        xs = [c for c in ctxs if per.get(str(c))]
        if not xs:
            continue
        plot_line(ax, xs, [per[str(c)] for c in xs], r, r.get("delta_ppl"))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ctxs)
    ax.set_xticklabels([f"{c:,}" for c in ctxs])
    ax.set_xlabel("tokens in the cache before the decode step")
    ax.set_ylabel(f"decode tokens/s, {t} thread{'s' if t != '1' else ''}")
    m = doc.get("machine") or {}
    ax.set_title(f"{doc.get('model_name')}: {m.get('cpu', '?')}, {m.get('isa', '?')} "
                 f"({(doc.get('commit') or '?')[:7]}, {doc.get('date', '')[:10]})", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def ttft_points(docs: list[dict]) -> tuple[list[int], dict[int, dict[str, dict]]]:
    """The time to first token over results files: ({threads: {model: {"row": its TTFT row, "dppl": the
    first Δppl a file gives for the model, "pts": {prompt length: seconds}}}}), a later file's cell
    replacing an earlier one's; and the thread counts."""
    out: dict[int, dict[str, dict]] = {}
    dppl: dict[str, float] = {}
    for d in docs:
        for r in d.get("rows") or []:
            if r.get("delta_ppl") is not None:
                dppl.setdefault(r["model"], r["delta_ppl"])
            for t, per in (r.get("ttft") or {}).items():
                e = out.setdefault(int(t), {}).setdefault(r["model"], {"row": r, "pts": {}})
                e["pts"].update({int(n): c["seconds"] for n, c in per.items() if c and c.get("seconds")})
    for per_t in out.values():
        for name, e in per_t.items():
            e["dppl"] = dppl.get(name)
    return sorted(out), out


def plot_panels(docs: list[dict], threads: list[int], by_t: dict, path: Path, xlabel: str, ylabel, what: str = "",
                minor_labels: bool = False) -> Path | None:
    """One log-log panel per thread count in ``threads``, one line per model of ``by_t[t]`` ({model:
    {"row", "pts": {x: y}, "dppl"}}: ours solid, peers dashed, the reference dotted, Δppl in the
    legend; a model keeps its colour in every panel); ``ylabel(t)`` names a panel's y axis; the title
    names the model, ``what``, the machine and every run (commit, date). None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return None
    from . import results

    fig, axes = plt.subplots(1, len(threads), figsize=(6.5 * len(threads), 5.2), squeeze=False)
    rows = {n: e["row"] for per_t in by_t.values() for n, e in per_t.items()}
    names = sorted(rows, key=lambda n: (results.SIDE_ORDER.get(rows[n]["side"], 1), n))
    color = {n: f"C{i % 10}" for i, n in enumerate(names)}
    for ax, t in zip(axes[0], threads):
        xs_all: set[int] = set()
        for name in (n for n in names if n in by_t[t]):
            e = by_t[t][name]
            xs = sorted(e["pts"])
            if not xs:
                continue
            xs_all.update(xs)
            plot_line(ax, xs, [e["pts"][x] for x in xs], e["row"], e["dppl"], color=color[name])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted(xs_all))
        ax.set_xticklabels([f"{x:,}" for x in sorted(xs_all)], fontsize=8)
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        if minor_labels:
            ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
        ax.tick_params(axis="y", which="both", labelsize=7)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel(t))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    m = docs[-1].get("machine") or {}
    runs = "; ".join(f"{(d.get('commit') or '?')[:7]} {d.get('date', '')[:16]}" for d in docs)
    fig.suptitle(f"{docs[-1].get('model_name')}: {what}{m.get('cpu', '?')}, {m.get('isa', '?')}\n"
                 f"{len(docs)} run{'s' if len(docs) > 1 else ''} (commit, date): {runs}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft(docs: list[dict], path: Path) -> Path | None:
    """Time to first token against the prompt's length, log-log, one panel per thread count, one line
    per model (the driver it generates with: ours solid, peers dashed, the reference dotted, Δppl in the
    legend), from one or several results files. None without matplotlib or without TTFT in any file."""
    threads, by_t = ttft_points(docs)
    if not threads:
        return None
    return plot_panels(docs, threads, by_t, path, "prompt tokens",
                       lambda t: f"time to first token, s ({t} thread{'s' if t != 1 else ''}; lower is better)",
                       what="time to first token, ")


def _summary(rep: dict) -> str:
    """Two lines of a rewrite's report: what it wrote and what its quality check measured."""
    q = rep.get("quality") or {}
    by: dict[str, int] = {}
    for r in rep.get("layers") or []:
        if r["backend"] != "dense":
            by[r["backend"]] = by.get(r["backend"], 0) + 1
    out = f"  {', '.join(f'{v} {k}' for k, v in by.items()) or 'no weight layer rewritten'}"
    tune = next((r["tune"] for r in rep.get("graph_passes") or [] if "tune" in r), None)
    if tune:
        out += f"; attention: {tune['summary']}"
    if "loss" in q:
        out += (f"\n  quality check on held-out calibration text: {q['metric']} {100 * q['loss']:+.2f} % against the "
                f"source weights (budget {100 * q['budget']:g} %)")
    elif q.get("skipped"):
        out += f"\n  {q['skipped']}"
    return out


def run(args, config, custom=None) -> int:
    """The demo (see the module docstring); ``config(argv)``: the RewriteConfig of an `ortlean rewrite`
    command line; ``custom``: a RewriteConfig maker for the backends the command line asked for (their
    one recipe replaces the default ones)."""
    from models import corpus, prepare
    from models.cache import cache_root

    from . import evaluate, results

    spec = prepare.MODELS[args.name]
    causal = spec.kind == "causal-lm"
    total = 5
    t0 = time.time()
    dense = prepare.prepare(args.name) / "model.onnx"     # a missing package: one error line, before any stage line
    _say(1, total, f"{args.name}: the prepared export {dense} (built once, cached)")
    _say(2, total, "corpus: Jane Austen's novels (Debian r-cran-janeaustenr)")
    novels = corpus.novels()
    calib, held = str(novels[corpus.CALIB_NOVEL]), str(novels[corpus.EVAL_NOVEL])
    work = Path(args.out) if args.out else cache_root() / "demo" / args.name
    work.mkdir(parents=True, exist_ok=True)
    budget = ["--quality-budget", "off" if args.quality_budget is None else str(args.quality_budget)]
    if custom is not None:    # the command line's own recipe: one rewrite, not cached
        recipes = {"ortlean": None}
    elif causal and spec.gguf:
        recipes = {"long-context": ["--state-pack", "binary", "--calib-text", calib, *budget],
                   "lossless": ["--calib-text", calib, *budget]}
    elif causal:
        recipes = {"ortlean": ["--calib-text", calib, *budget]}
    else:
        recipes = {"int8": ["--weights", "int8", "--calib-text", calib, *budget]}
    models: dict[str, str] = {}
    for i, (name, flags) in enumerate(recipes.items()):
        out = work / name / "model.onnx"
        if flags is None:
            from . import pipeline

            _say(3, total, f"rewrite: the command line's recipe, calibrated on {corpus.CALIB_NOVEL}")
            rep = pipeline.run(custom(str(dense), str(out), calib, str(work / name / "report.json")))
        else:
            _say(3, total, f"rewrite {i + 1}/{len(recipes)}: {name} ({' '.join(f for f in flags if f != calib)}), "
                           f"calibrated on {corpus.CALIB_NOVEL}")
            rep = _rewrite(dense, out, flags, args.fresh, config)
        if not rep.get("output"):
            raise OrtleanError(f"{name}: {rep.get('refused') or 'nothing written'}")
        print(_summary(rep), file=sys.stderr)
        models[name] = str(out)
    main, *rest = models
    if not causal:
        _say(4, total, f"quality on held-out {corpus.EVAL_NOVEL}: embedding cosine")
        res = evaluate.evaluate(models[main], str(dense), held, threads=max(args.threads))
        print(evaluate.format_eval(res))
        if not args.no_bench:
            _say(5, total, "speed (same run, interleaved)")
            b = evaluate.bench(models[main], str(dense), threads=args.threads, nbits=[8], profile=False,
                               decode_past=[128])
            print(evaluate.format_bench(b))
        return 0
    if args.no_bench:
        _say(4, total, f"quality on held-out {corpus.EVAL_NOVEL} (--no-bench: no speed table)")
        for name, path in models.items():
            print(f"{name}: " + evaluate.format_eval(evaluate.evaluate(path, str(dense), held,
                                                                       threads=max(args.threads), peers="auto")))
        return 0
    pasts = [p for p in args.decode_past]
    prompts = demo_prompts(args.name, getattr(args, "prompt", None))
    qcache = work / "quality-cache"   # each row's Δppl scores by stamp (files, text, code): a warm demo reuses them
    if args.fresh and qcache.is_dir():
        shutil.rmtree(qcache)
    _say(4, total, f"quality and speed: Δppl on held-out {corpus.EVAL_NOVEL} for every row, then decode after "
                   f"{', '.join(map(str, pasts))} cached tokens"
                   + (f" and the time to first token of {', '.join(map(str, prompts))}-token prompts" if prompts else "")
                   + f" with {', '.join(map(str, args.threads))} threads, ours against onnxruntime-genai and llama.cpp "
                   "in one run")
    res = evaluate.bench(models[main], str(dense), threads=args.threads, decode_past=pasts, nbits=(), profile=False,
                         repeats=args.repeats, steps=args.steps, also={k: models[k] for k in rest},
                         quality_text=held, rows=args.rows, quality_cache=str(qcache),
                         past_cache=evaluate.past_cache_dir(), prompts=prompts, prompt_room=args.steps)
    print(evaluate.format_bench(res))
    _say(5, total, f"results: {work / 'results.json'}, {work / 'results.md'}, {work / 'speed-vs-context.png'}"
                   + (f", {work / 'ttft-vs-prompt.png'}" if prompts else ""))
    doc = results.from_bench(res, "ortlean " + " ".join(args.argv), labels={"lean": main})
    results.write_json(work / "results.json", doc)
    table = results.render(doc, str(work / "results.json"))
    (work / "results.md").write_text(table + "\n")
    print("\n" + table)
    png = plot(doc, work / "speed-vs-context.png")
    if png is not None and doc.get("prompt_lengths"):
        plot_ttft([doc], work / "ttft-vs-prompt.png")
    if png is None:
        print("note: no plot (matplotlib is not installed: pip install 'ortlean[plot]')", file=sys.stderr)
    print(f"\ndemo finished in {time.time() - t0:.0f} s; results in {work}", file=sys.stderr)
    return 0
