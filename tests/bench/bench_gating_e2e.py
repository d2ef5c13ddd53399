"""SmolLM2-135M end to end with the KWTA planner: rewrite at a quality budget (calibrated on
Sense & Sensibility), Δppl on held-out Persuasion, decode tokens/s vs dense at 1 and 2 threads
(same process, interleaved medians).

    python tests/bench/bench_gating_e2e.py [--budget 0.02] [--out DIR] [--json FILE]

Equivalent CLI:
    M=$(ortlean models path smollm2)
    ortlean rewrite $M -o DIR/model.kwta.onnx --kwta=on --quality-budget 0.02 --calib-text "$(ortlean corpus --calib)"
    ortlean eval DIR/model.kwta.onnx --ref $M --text "$(ortlean corpus --eval)"
    ortlean bench DIR/model.kwta.onnx --ref $M --threads 1,2 --nbits none --no-profile

Gating on quantized weights (issue 11): `--weights int4|int8` compares the gated model
(`--kwta=on --weights W`: gated layers in the op's quantized format, the rest MatMulNBits) with
its ungated twin (`--weights W` alone, same fusion pass), not with fp32:

    python tests/bench/bench_gating_e2e.py --weights int4 [--budget 0.02] [--out DIR] [--json FILE]

held-out Δppl on Persuasion over the twin (`ortlean eval GATED --ref TWIN`), then decode tok/s at
past 128 and prefill of 128 tokens, 1 and 2 threads, both models interleaved in one process
(`runtime.bench.decode_table`, medians), ratios gated/twin; the load average and ISA are printed.
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
    ap.add_argument("--weights", choices=["int4", "int8"], help="gate on quantized weights, vs the ungated twin")
    ap.add_argument("--twin", help="--weights: an already written ungated twin (skip its rewrite)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--no-eval", action="store_true", help="--weights: timing only (Δppl already measured)")
    a = ap.parse_args()
    if a.weights:
        return quantized(a)
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


def quantized(a):
    import os

    from custom_ops.runtime import bench as rb
    from models import corpus, prepare

    import custom_ops
    from rewriter import cli, evaluate

    dense = str(prepare.prepare("smollm2") / "model.onnx")
    novels = corpus.novels()
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    twin = Path(a.twin) if a.twin else out_dir / f"model.{a.weights}.onnx"
    gated = Path(a.model) if a.model else out_dir / f"model.kwta.{a.weights}.b{a.budget}.onnx"
    res = {"dense": dense, "twin": str(twin), "model": str(gated), "budget": a.budget, "weights": a.weights}
    if not a.twin:
        assert cli.main(["rewrite", dense, "-o", str(twin), "--weights", a.weights, "-q"]) == 0
    if not a.model:
        rep = gated.with_suffix(".report.json")
        rc = cli.main(["rewrite", dense, "-o", str(gated), "--kwta=on", "--weights", a.weights, "--quality-budget",
                       a.budget, "--threads", "2", "--calib-text", str(novels[corpus.CALIB_NOVEL]), "--report", str(rep),
                       "-q", *a.extra.split()])
        assert rc == 0, rc
        r = json.loads(rep.read_text())
        res["rewrite"] = {"quality": r["quality"],
                          "keep": {L["layer"]: L["decision"] for L in r["layers"] if L["backend"] == "gating"}}
    if not a.no_eval:
        ev = evaluate.evaluate(str(gated), str(twin), str(novels[corpus.EVAL_NOVEL]), threads=2, window=512,
                               windows=a.windows)
        print(evaluate.format_eval(ev))
        res["eval"] = ev
    res["isa"] = f"{custom_ops.isa()}; load average before timing {os.getloadavg()}"
    res["table"] = {}
    for t in [int(x) for x in a.threads.split(",")]:
        models = {}
        for name, path in (("twin", twin), ("gated", gated)):
            s = evaluate._session(str(path), t)
            models[name] = (s, evaluate.runtime.ModelIO.from_session(s, str(path)))
        tab = rb.decode_table(models, [128], prefill_len=128, steps=16, repeats=a.repeats, threads=t)
        res["table"][t] = {"ms": tab, "decode_ratio": tab["twin"]["decode128"] / tab["gated"]["decode128"],
                           "prefill_ratio": tab["twin"]["prefill"] / tab["gated"]["prefill"]}
        print(f"threads {t}: decode tok/s twin {1e3 / tab['twin']['decode128']:.1f} gated "
              f"{1e3 / tab['gated']['decode128']:.1f} ({res['table'][t]['decode_ratio']:.3f}x); prefill 128 "
              f"twin {tab['twin']['prefill']:.1f} ms gated {tab['gated']['prefill']:.1f} ms "
              f"({res['table'][t]['prefill_ratio']:.3f}x)", flush=True)
        del models
    res["isa"] += f"; load average after {os.getloadavg()}"
    print(res["isa"])
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
