"""Does the attention tuner's quality estimate hold on text it did not see? (issue 34 item 4)

    python tests/bench/bench_tune_heldout.py [--model smollm2] [--heldout Persuasion,Emma] [--budget 0.02]
        [--context 4096] [--score 256] [--windows 8] [--threads 2] [--flags "..."] [--work DIR] [--json FILE]

1. ``ortlean rewrite`` of the packaged model with the long-context recipe (`--state-pack binary
   --calib-text <the calibration novel>`, the source's own weights): the tuner picks budget / window /
   min_context from decode-mode Δppl against the same model with exact attention on spans of the
   calibration novel, its one-sided 95 % bound within what the weights left of --quality-budget.
2. The same rewrite with exact attention (`--attn-exact off`: GroupQueryAttention, the tuner's reference).
3. On every held-out novel: ``--windows`` spans spread over the text, each a ``--context``-token prefill
   and ``--score`` teacher-forced decode steps through the cache (runtime.decode_perplexity), both
   models on the same tokens; Δppl, its one-sided 95 % bound from the paired per-token NLLs, and
   whether Δppl is within the budget the tuner was given.
The JSON (--json) carries the commit, machine and date with the figures.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def spans(ids, n: int, length: int):
    """``n`` spans of ``length`` tokens spread evenly over ``ids`` (none at the very start: title pages)."""
    import numpy as np

    ids = np.asarray(ids, np.int64)
    n = max(1, min(n, ids.size // length))
    starts = [min(ids.size - length, max(0, (k + 1) * ids.size // (n + 1) - length // 2)) for k in range(n)]
    return np.concatenate([ids[s: s + length] for s in starts]), n


def rewrite(src: str, out: Path, flags: list[str]) -> dict:
    from rewriter import cli

    rep = out.with_suffix(".json")
    rc = cli.main(["rewrite", src, "-o", str(out), "--report", str(rep), "-q", *flags])
    if rc != 0:
        raise SystemExit(f"rewrite {' '.join(flags)} exited {rc}")
    return json.loads(rep.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--heldout", default="Persuasion,Emma", help="comma list of novels (never the calibration one)")
    ap.add_argument("--budget", type=float, default=0.02, help="--quality-budget of the rewrite")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--score", type=int, default=256)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flags", default="", help="extra rewrite flags for the tuned model")
    ap.add_argument("--work", default=None, help="where the two models go (default: a cache directory)")
    ap.add_argument("--from-demo", default=None, metavar="DIR",
                    help="measure the models an `ortlean demo` run wrote into DIR (DIR/long-context, tuned; "
                    "DIR/lossless, the same weights with exact attention) instead of rewriting")
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    import numpy as np

    import custom_ops
    from custom_ops import runtime
    from models import corpus, prepare
    from models.cache import cache_root
    from rewriter import results

    M = str(prepare.prepare(a.model) / "model.onnx")
    novels = corpus.novels()
    held = [t.strip() for t in a.heldout.split(",") if t.strip()]
    if corpus.CALIB_NOVEL in held:
        raise SystemExit(f"--heldout: {corpus.CALIB_NOVEL} is the calibration novel")
    work = Path(a.work) if a.work else cache_root() / "bench" / "tune-heldout" / a.model
    work.mkdir(parents=True, exist_ok=True)
    calib = str(novels[corpus.CALIB_NOVEL])
    common = ["--calib-text", calib, "--quality-budget", str(a.budget)]
    t0 = time.time()
    dirs = {"tuned": work / "tuned", "exact": work / "exact"}
    if a.from_demo:
        dirs = {"tuned": Path(a.from_demo) / "long-context", "exact": Path(a.from_demo) / "lossless"}
        rep = json.loads((dirs["tuned"] / "report.json").read_text())
        cf = rep["config"]     # the demo's long-context recipe: --state-pack binary --calib-text --quality-budget
        common = ["--state-pack", "binary", "--calib-text", str(cf["calib_text"]), "--quality-budget",
                  str(cf["quality_budget"])]
    else:
        print(f"[tune-heldout] rewrite: long-context recipe, tuned on {corpus.CALIB_NOVEL}", file=sys.stderr,
              flush=True)
        rep = rewrite(M, dirs["tuned"] / "model.onnx", ["--state-pack", "binary", *common, *shlex.split(a.flags)])
        print("[tune-heldout] rewrite: the same weights with exact attention (GroupQueryAttention)", file=sys.stderr,
              flush=True)
        rewrite(M, dirs["exact"] / "model.onnx", ["--attn-exact", "off", *common])
    tune = next(r["tune"] for r in rep["graph_passes"] if "tune" in r)
    q = tune.get("quality") if isinstance(tune.get("quality"), dict) else {}
    chosen = {"budget": tune["budget"], "window": tune["window"], "min_context": tune["min_context"]}
    trial = next((t for t in q.get("trials", []) if (t["budget"], t["window"]) == (tune["budget"], tune["window"])), {})
    allowed = q.get("budget", rep["config"]["quality_budget"] if a.from_demo else a.budget)      # what the weights left of --quality-budget for attention
    out = {"model": a.model, "models": {k: str(d) for k, d in dirs.items()},
           "recipe": common if a.from_demo else ["--state-pack", "binary", *common, *shlex.split(a.flags)],
           "chosen": chosen, "tuner": {"novel": corpus.CALIB_NOVEL, "context": q.get("context"),
                                       "scored": q.get("scored"), "budget_for_attention": allowed,
                                       "delta_ppl": trial.get("delta_ppl"), "delta_ppl_upper": trial.get("delta_ppl_upper"),
                                       "weights_loss": (rep.get("quality") or {}).get("loss")},
           "heldout": [], "context": a.context, "score": a.score}
    sess = {k: custom_ops.session(str(dirs[k] / "model.onnx"), threads=a.threads) for k in ("exact", "tuned")}
    ios = {k: runtime.ModelIO.from_session(s, str(dirs[k] / "model.onnx")) for k, s in sess.items()}
    tok = runtime.load_tokenizer(M)
    for title in held:
        ids = tok.encode(corpus.text(title), add_special_tokens=False).ids
        seq, n = spans(ids, a.windows, a.context + a.score + 1)
        print(f"[tune-heldout] {title}: {n} spans of {a.context} + {a.score} tokens", file=sys.stderr, flush=True)
        nll = {k: runtime.decode_perplexity(s, ios[k], seq, context=a.context, score=a.score, windows=n)
               for k, s in sess.items()}
        d, up = runtime.paired_delta(nll["tuned"]["token_nll"], nll["exact"]["token_nll"])
        out["heldout"].append({"novel": title, "spans": n, "tokens": int(nll["tuned"]["tokens"]),
                               "ppl_exact": nll["exact"]["ppl"], "ppl_tuned": nll["tuned"]["ppl"],
                               "delta_ppl": round(d, 5), "delta_ppl_upper": round(up, 5),
                               "within_budget": bool(d <= allowed)})
    out["seconds"] = round(time.time() - t0, 1)
    print(f"chosen on {corpus.CALIB_NOVEL}: budget {chosen['budget']:g}, window {chosen['window']}, min_context "
          f"{chosen['min_context']}; tuner's estimate Δppl {100 * (trial.get('delta_ppl') or 0):+.2f} % (bound "
          f"{100 * (trial.get('delta_ppl_upper') or 0):+.2f} %) against {100 * allowed:.2f} % left for attention")
    print(f"{'held-out novel':<22} {'tokens':>7} {'ppl exact':>10} {'ppl tuned':>10} {'Δppl':>8} {'bound':>8}  within")
    for h in out["heldout"]:
        print(f"{h['novel']:<22} {h['tokens']:>7} {h['ppl_exact']:>10.3f} {h['ppl_tuned']:>10.3f} "
              f"{100 * h['delta_ppl']:>+7.2f}% {100 * h['delta_ppl_upper']:>+7.2f}%  {'yes' if h['within_budget'] else 'NO'}")
    if a.json:
        doc = results.provenance()
        doc.update({"command": "python tests/bench/bench_tune_heldout.py " + " ".join(map(shlex.quote, argv or sys.argv[1:])),
                    **out})
        results.write_json(a.json, doc)
    return 0 if all(h["within_budget"] for h in out["heldout"]) else 1


if __name__ == "__main__":
    sys.exit(main())
