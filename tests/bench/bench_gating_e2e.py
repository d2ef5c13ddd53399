"""SmolLM2-135M end to end with the KWTA planner: rewrite at a quality budget (calibrated on
Sense & Sensibility), Δppl on held-out Persuasion, decode tokens/s vs dense at 1 and 2 threads
(same process, interleaved medians).

    python tests/bench/bench_gating_e2e.py [--budget 0.02] [--out DIR] [--json FILE]

Equivalent CLI:
    M=$(ortlean models path smollm2)
    ortlean rewrite $M -o DIR/model.kwta.onnx --kwta=on --quality-budget 0.02 --calib-text "$(ortlean corpus --calib)"
    ortlean eval DIR/model.kwta.onnx --ref $M --text "$(ortlean corpus --eval)"
    ortlean bench DIR/model.kwta.onnx --ref $M --threads 1,2 --nbits none --no-profile
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", default="0.02")
    ap.add_argument("--out", default="/tmp/ortlean-bench-gating")
    ap.add_argument("--model", help="an already rewritten model (skip the rewrite)")
    ap.add_argument("--extra", default="", help="extra rewrite flags, space separated")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json")
    a = ap.parse_args()
    from models import corpus, prepare

    from rewriter import cli, evaluate

    dense = str(prepare.prepare("smollm2") / "model.onnx")
    novels = corpus.novels()
    out = Path(a.model) if a.model else Path(a.out) / f"model.kwta.b{a.budget}.onnx"
    res = {"dense": dense, "model": str(out), "budget": a.budget}
    if not a.model:
        out.parent.mkdir(parents=True, exist_ok=True)
        rep = out.with_suffix(".report.json")
        rc = cli.main(["rewrite", dense, "-o", str(out), "--kwta=on", "--quality-budget", a.budget, "--threads", "2",
                       "--calib-text", str(novels[corpus.CALIB_NOVEL]), "--report", str(rep), "-q", *a.extra.split()])
        assert rc == 0, rc
        r = json.loads(rep.read_text())
        res["rewrite"] = {"quality": r["quality"],
                          "keep": {L["layer"]: L["decision"] for L in r["layers"] if L["backend"] == "gating"}}
    ev = evaluate.evaluate(str(out), dense, str(novels[corpus.EVAL_NOVEL]), threads=2, window=512, windows=a.windows)
    print(evaluate.format_eval(ev))
    res["eval"] = ev
    b = evaluate.bench(str(out), dense, threads=(1, 2), repeats=a.repeats, nbits=(), profile=False)
    print(evaluate.format_bench(b))
    res["bench"] = {run["threads"]: run["results"]["ratios"]["lean"] for run in b["runs"]}
    print(json.dumps(res["bench"]))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
