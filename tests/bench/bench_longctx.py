"""Long-context decode: SmolLM2 int4 (ortlean's fused graph, MatMulNBits int4 + GroupQueryAttention,
tests/bench/fastgraph_models.py) vs the same graph with every GroupQueryAttention replaced by
PackedAttention at several K/V formats and budgets, each made by the CLI path (`ortlean rewrite
--state-pack binary --attn-kv Q --attn-budget B --attn-tune off`; budget "auto": the rewriter's
own choice, --attn-tune with the calibration novel).

    python tests/bench/bench_longctx.py run  [--pasts 128,1024,4096,8192] [--threads 1,2]
                                             [--variants int8:1,int8:0.25,int8:0.25:k16,int8:0.125:w64,int8:0.25:w128:c,int8:0.125:w128:o,int8:auto]
                                             [--steps 8] [--rounds 3] [--sessions 1] [--ppl-context 4096]
                                             [--ppl-score 64] [--ppl-windows 1] [--extra NAME=MODEL,...]
                                             [--huge-weights on|off] [--json FILE]
    python tests/bench/bench_longctx.py plot --json FILE [--quality-json FILE] [--png FILE]

run: per past length, every model decodes 1 + --steps tokens after a cache of that many tokens (the
first untimed), in interleaved rounds (rotating order; round 0 untimed), each with one K/V buffer per
state bound to past and present (runtime.shared_kv, as onnxruntime-genai runs these graphs); the
median step → tokens/s and the ratio to the GQA model in the same run. The caches: GQA's from its own chunked prefill of the same
random tokens; PackedAttention's from that cache's K/V quantized and packed exactly as the op stores
new rows (custom_ops.runtime.bench.state_from_kv), so no model pays a slow prefill. Also per
variant: KV-cache bytes per token (all layers) against GQA's fp32 cache, and decode-mode Δppl on
held-out Persuasion (runtime.decode_perplexity: --ppl-context tokens of prefill through the model
itself, then --ppl-score teacher-forced decode steps scored) against the GQA model.
--extra: more models with the same interface in the same interleaved rounds (e.g. a build of another
revision: before/after rows measured together). --huge-weights on (default): before each past's
rounds every session's weights (ONNX Runtime's malloc'd initializers) are moved to 2 MiB pages, as the
caches already are; off: on malloc's 4 KiB pages (as ONNX Runtime leaves them).
A past of 1 (--pasts 1,128,4096,8192) adds the attention-free estimate per past: GQA's step there over
the fastest model's step after 1 token (whose attention costs next to nothing; the rest of the graph is
the same in every model): about the most any attention kernel can make the model faster, a little
under it by what attention over 1 token costs (printed, and "attention_free" in the JSON).
plot: the quality/speed frontier (Δppl vs speedup at each past, one point per variant) to a PNG;
--quality-json takes Δppl from other runs of the same variants (a speed-only run has none).
Every line printed carries the ISA and thread count; --json writes everything.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _variant_models(base: Path, variants: list[tuple[str, ...]], out: Path, calib: str | None) -> dict[str, Path]:
    """One model per variant through the CLI path (`ortlean rewrite BASE --state-pack binary
    --attn-kv Q --attn-budget B --attn-tune off [--attn-cand-block N]`; budget "auto": --attn-tune
    with --calib-text)."""
    from rewriter import cli

    paths = {}
    for kvq, budget, *more in variants:
        # kN: --attn-cand-block N, wN: --attn-window N, c: --calib-text, o: --attn-select exact (oracle),
        # p: --attn-pack-bits pq (pq key codes, fitted on the calibration text)
        opts = {m[0]: int(m[1:] or 1) for m in more}
        if set(opts) - {"k", "w", "c", "o", "p"}:
            raise SystemExit(f"variant {kvq}:{budget}:{':'.join(more)}: options are kN (candidate blocks), wN (window), "
                             "c (calibration text: per-channel key scales for the popcount score), o (oracle: "
                             "candidates by exact scores, what the budget alone costs; no speed benefit), p (pq key "
                             "codes fitted on the calibration text)")
        blk = opts.get("k", 1)
        name = f"packed {kvq} b{budget}" + (f" k{blk}" if blk != 1 else "") + (f" w{opts['w']}" if "w" in opts else "") \
            + (" cal" if "c" in opts else "") + (" oracle" if "o" in opts else "") + (" pq" if "p" in opts else "")
        p = out / name.replace(" ", "_") / "model.onnx"
        p.parent.mkdir(parents=True, exist_ok=True)
        flags = ["--state-pack", "binary", "--attn-kv", kvq] + (["--attn-cand-block", str(blk)] if blk != 1 else [])
        flags += ["--attn-window", str(opts["w"])] if "w" in opts else []
        flags += ["--attn-select", "exact"] if "o" in opts else []
        # c alone: sign bits with the calibrated key scales (a rewrite with --calib-text packs pq codes by default)
        flags += ["--attn-pack-bits", "pq" if "p" in opts else "sign"] if "p" in opts or "c" in opts else []
        if ("c" in opts or "p" in opts) and budget != "auto":
            flags += ["--calib-text", calib]
        if budget == "auto":
            if not calib:
                raise SystemExit("variant budget 'auto' needs the calibration novel (models.corpus)")
            flags += ["--calib-text", calib, "--report", str(p.parent / "report.json")]
        else:
            flags += ["--attn-budget", budget, "--attn-tune", "off"]
        rc = cli.main(["rewrite", str(base), "-o", str(p), "-q", *flags])
        if rc != 0:
            raise SystemExit(f"{base}: rewrite {flags} failed ({rc})")
        if budget == "auto":
            tune = next(r["tune"] for r in json.loads((p.parent / "report.json").read_text())["graph_passes"]
                        if "tune" in r)
            print(f"packed {kvq} auto: {tune['summary']}", flush=True)
        paths[name] = p
    return paths


def _kv_bytes_per_token(io) -> int:
    import numpy as np

    n = 0
    for name, shape in io.state_shapes.items():
        ax = io.state_seq_axis[name]
        per = np.dtype(io.state_types[name]).itemsize
        for i, d in enumerate(shape):
            if i not in (0, ax):
                per *= int(d)
        n += per
    return n


def run(a) -> dict:
    import numpy as np

    import custom_ops
    from custom_ops import runtime
    from custom_ops.runtime import bench as rb
    from custom_ops.runtime import memory
    from custom_ops.runtime.shared_kv import SharedKV
    from fastgraph_models import fused_model, quantized_model
    from rewriter.quantize import DEFAULTS

    malloc_note = rb.fix_malloc_threshold()  # every session's weights placed alike, not by build order
    if malloc_note:
        print(f"[{custom_ops.isa()}] note: {malloc_note}", flush=True)
    c = DEFAULTS["int4"]
    base = quantized_model(fused_model("smollm2"), c.bits, c.block_size, c.symmetric, c.accuracy_level)
    variants = [tuple(v.split(":")) for v in a.variants.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="ortlean-longctx-"))
    from models import corpus

    calib = str(corpus.novels()[corpus.CALIB_NOVEL]) if any(v[1] == "auto" or "c" in v[2:] or "p" in v[2:] for v in variants) \
        else None
    paths = {"gqa int4": base, **_variant_models(base, variants, tmp, calib)}
    for e in filter(None, a.extra.split(",")):
        name, _, path = e.partition("=")
        if not Path(path).is_file():
            raise SystemExit(f"--extra {e}: no model file {path}")
        paths[name] = Path(path)
    from rewriter.evaluate import fit_pasts

    pasts, note = fit_pasts([int(x) for x in a.pasts.split(",") if x], a.steps + 1, paths.values())  # "": quality only
    if note:
        print(f"[{custom_ops.isa()}] note: {note}", flush=True)
    threads = [int(x) for x in a.threads.split(",")]
    isa = custom_ops.isa_label()
    res = {"isa": isa, "model": "SmolLM2 int4 fused (fastgraph_models.quantized_model)", "steps": a.steps,
           "rounds": a.rounds, "sessions": a.sessions, "huge_weights": a.huge_weights, "variants": list(paths),
           "decode": {},
           "kv_bytes_per_token": {}, "quality": {}, "pasts": pasts, "notes": [n for n in (malloc_note, note) if n]}
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 49000, size=max(pasts + [1]), dtype=np.int64)
    steps = rng.integers(100, 49000, size=a.steps + 1, dtype=np.int64)
    for th in threads if pasts else []:
        # --sessions N: N sessions of each model, all in the interleaved rounds (a session's memory
        # placement, not its graph, moved 2-thread tokens/s by up to 30 % on a shared VM: the median
        # over several sessions is what a model gets)
        keys = [(n, j) for j in range(a.sessions) for n in paths]
        sess = {(n, j): custom_ops.session(str(paths[n]), threads=th) for n, j in keys}
        ios = {key: runtime.ModelIO.from_session(s, paths[key[0]]) for key, s in sess.items()}
        if th == threads[0]:
            g = _kv_bytes_per_token(ios[("gqa int4", 0)])
            for n in paths:
                b = _kv_bytes_per_token(ios[(n, 0)])
                res["kv_bytes_per_token"][n] = {"bytes": b, "vs_gqa_fp32": round(b / g, 3)}
                print(f"[{isa}] {n:20s} KV cache {b} bytes/token ({b / g:.3f}x GQA fp32)", flush=True)
        for past in pasts:
            kvs = {key: SharedKV(s, ios[key], max_len=past + a.steps + 1) for key, s in sess.items()}
            g = kvs[("gqa int4", 0)]
            g.prefill(prompt[None, :min(512, past)])
            for c0 in range(min(512, past), past, 512):
                g.step(prompt[None, c0:min(c0 + 512, past)])
            built = {k: arr[:, :, :past] for k, arr in g.arrays.items()}
            for key in keys:   # the other caches: GQA's K/V (packed models: quantized and packed as the op stores them)
                if key != ("gqa int4", 0):
                    kvs[key].fill(past, built if key[0] == "gqa int4" else rb.state_from_kv(ios[key], built))
            del built
            if a.huge_weights == "on":   # every session's weights (and caches) alike on 2 MiB pages
                n = memory.huge_pages_for_process()
                print(f"[{isa}, {th} thr] past {past}: {n >> 20} MiB of the process's memory moved to 2 MiB pages",
                      flush=True)
            times = {key: [] for key in keys}
            # interleaved rounds (rotating order); in each, a pause (settle: the other sessions' pools
            # stop spinning on the cores, which takes tens of ms), then a session's first step untimed
            # (measured: timing every step of models alternating step by step halved 2-thread tokens/s,
            # GQA's too; with only the untimed step, 2-thread sessions of one model came out bimodal)
            for r in range(a.rounds + 1):
                order = keys[r % len(keys):] + keys[: r % len(keys)]
                for key in order:
                    rb.settle(th)
                    kv = kvs[key]
                    kv.length = past
                    for k in range(a.steps + 1):
                        t0 = time.perf_counter()
                        kv.step(steps[None, k:k + 1])
                        dt = time.perf_counter() - t0
                        if r > 0 and k > 0:
                            times[key].append(dt)
            row = {}
            med = {n: statistics.median([t for j in range(a.sessions) for t in times[(n, j)]]) for n in paths}
            tg = med["gqa int4"]
            for n in paths:
                t = med[n]
                per = [round(1 / statistics.median(times[(n, j)]), 2) for j in range(a.sessions)]
                row[n] = {"ms": round(t * 1e3, 2), "tok_s": round(1 / t, 2), "vs_gqa": round(tg / t, 3),
                          "tok_s_per_session": per}
                sp = f"  sessions {' / '.join(f'{x:.1f}' for x in per)}" if a.sessions > 1 else ""
                print(f"[{isa}, {th} thr] past {past:5d} {n:20s} {1 / t:7.2f} tok/s  x{tg / t:5.2f} vs GQA{sp}",
                      flush=True)
            res["decode"].setdefault(str(th), {})[str(past)] = row
            del kvs, g
        dec = res["decode"].get(str(th), {})
        if "1" in dec:  # after 1 token every model's attention costs next to nothing: the rest of the step
            x1 = min(r["ms"] for r in dec["1"].values())
            for past in pasts:
                if past > 1:
                    b = dec[str(past)]["gqa int4"]["ms"] / x1
                    res.setdefault("attention_free", {}).setdefault(str(th), {})[str(past)] = round(b, 3)
                    print(f"[{isa}, {th} thr] past {past:5d} attention-free estimate: GQA's step {b:.2f}x the fastest "
                          "step after 1 token (about what an attention that cost nothing would reach)", flush=True)
        del sess
    if a.ppl_windows > 0:
        novel = corpus.CALIB_NOVEL if a.ppl_novel == "calib" else corpus.EVAL_NOVEL
        ids = np.asarray(_eval_ids(novel), dtype=np.int64)
        sess = {n: custom_ops.session(str(p), threads=threads[-1]) for n, p in paths.items()}
        dm = dict(context=a.ppl_context, score=a.ppl_score, windows=a.ppl_windows)
        ref = None
        for n, s in sess.items():
            t0 = time.monotonic()
            d = runtime.decode_perplexity(s, runtime.ModelIO.from_session(s), ids, **dm)
            ref = ref or d
            up = runtime.paired_delta(d["token_nll"], ref["token_nll"])[1]   # paired, same tokens
            res["quality"][n] = {"ppl": round(d["ppl"], 4), "delta_ppl": round(d["ppl"] / ref["ppl"] - 1, 4),
                                 "delta_ppl_upper": round(up, 4), "tokens": d["tokens"], "loop": d["loop"],
                                 "novel": novel, **dm}
            print(f"[{isa}] {n:20s} decode-mode ppl {d['ppl']:.4f}  Δppl {100 * (d['ppl'] / ref['ppl'] - 1):+.2f} % "
                  f"(one-sided 95 % bound {100 * up:+.2f} %) "
                  f"({d['tokens']} tokens after {a.ppl_context}-token prefills, {novel}; "
                  f"{time.monotonic() - t0:.0f} s)", flush=True)
    return res


def _eval_ids(novel):
    from tokenizers import Tokenizer

    from models import corpus, prepare

    tok = Tokenizer.from_file(str(prepare.prepare("smollm2") / "tokenizer.json"))
    return tok.encode(corpus.text(novel), add_special_tokens=False).ids


def plot(a) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit("bench_longctx plot needs matplotlib: pip install -e '.[plot]'")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(Path(a.json).read_text())
    q = res.get("quality", {})
    for qj in filter(None, (a.quality_json or "").split(",")):  # Δppl from other runs of the same variants
        q = {**q, **json.loads(Path(qj).read_text()).get("quality", {})}  # (a speed-only run has none)
    fig, axes = plt.subplots(1, len(res["decode"]), figsize=(6 * len(res["decode"]), 4.5), squeeze=False)
    for ax, (th, by_past) in zip(axes[0], res["decode"].items()):
        for past, row in by_past.items():
            if past == "1":  # the attention-free estimate's reference step, not a point of the frontier
                continue
            xs, ys, labels = [], [], []
            for n, r in row.items():
                if n in q:
                    xs.append(r["vs_gqa"])
                    ys.append(100 * q[n]["delta_ppl"])
                    labels.append(n.replace("packed ", ""))
            ax.plot(xs, ys, "o-", label=f"past {past}")
            for x, y, lab in zip(xs, ys, labels):
                ax.annotate(lab, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axhline(2.0, color="grey", ls="--", lw=0.8)
        ax.set_xlabel("decode tok/s vs GroupQueryAttention (same run)")
        ctx = next(iter(q.values()), {}).get("context", "?")
        ax.set_ylabel(f"decode-mode Δppl vs GQA, % (Persuasion, {ctx}-token context)")
        ax.set_title(f"SmolLM2 int4, {th} thread(s), {res['isa']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(a.png or Path(a.json).with_suffix(".png"))
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["run", "plot"])
    ap.add_argument("--pasts", default="128,1024,4096,8192")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--variants", default="int8:1,int8:0.25,int8:0.125,int4:0.125",
                    help="K/V format:budget[:kN][:wN][:c][:o] list; budget 'auto' = chosen by --attn-tune; kN: "
                         "candidates in blocks of N keys (--attn-cand-block); wN: a recent window of N keys "
                         "(--attn-window); c: --calib-text (the calibration novel: per-channel key scales in the "
                         "popcount score, as a rewrite with calibration text gets them); o: --attn-select exact "
                         "(oracle candidates: what the budget alone costs); p: --attn-pack-bits pq (pq key codes "
                         "fitted on the calibration novel)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=1,
                    help="sessions of each model in the rounds (medians over all of a model's sessions' steps)")
    ap.add_argument("--ppl-context", type=int, default=4096)
    ap.add_argument("--ppl-score", type=int, default=64)
    ap.add_argument("--ppl-windows", type=int, default=1)
    ap.add_argument("--ppl-novel", choices=("eval", "calib"), default="eval",
                    help="the quality's text: the held-out novel (default) or the calibration one (what --attn-tune "
                         "sees; in-sample for pq codes and key scales)")
    ap.add_argument("--extra", default="", help="NAME=MODEL,... more models in the same rounds")
    ap.add_argument("--huge-weights", choices=("on", "off"), default="on",
                    help="before each past's rounds, the process's memory (every session's weights alike) on 2 MiB "
                    "pages (runtime.memory.huge_pages_for_process); off: malloc's 4 KiB pages")
    ap.add_argument("--json")
    ap.add_argument("--quality-json", help="plot: take Δppl from these runs' JSON (comma-separated, later ones "
                    "win; same variant names)")
    ap.add_argument("--png")
    a = ap.parse_args(argv)
    if a.what == "plot":
        plot(a)
        return 0
    res = run(a)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
