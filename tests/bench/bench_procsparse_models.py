"""ProcSparseMatMul on the real models: SmolLM2-135M (Δppl on Persuasion, decode ratio vs dense) and
MiniLM (embedding cosine, M=128 ratio) at --proc-gap 0.02 / 0.05: layers converted, bytes saved.

    python tests/bench/bench_procsparse_models.py [--models smollm2,minilm] [--gaps 0.02,0.05]
        [--out DIR] [-- extra rewrite flags, e.g. --proc-max-bytes=1.0 --proc-speed-check=off]

Runs the real CLI (`ortlean rewrite`, `ortlean eval`, `ortlean bench`) and prints one summary row
per (model, gap); every JSON report stays in --out. Not part of the test run."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def cli(*args) -> int:
    cmd = [sys.executable, "-m", "rewriter.cli", *map(str, args)]
    print("$ ortlean " + " ".join(map(str, args)), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,minilm")
    ap.add_argument("--gaps", default="0.02,0.05")
    ap.add_argument("--out", default="/tmp/ortlean-proc-bench")
    ap.add_argument("--target", default="both")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("extra", nargs="*", help="extra rewrite flags (after --)")
    a = ap.parse_args()
    from models import corpus, prepare

    calib = corpus.novels()[corpus.CALIB_NOVEL]
    evalt = corpus.novels()[corpus.EVAL_NOVEL]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in a.models.split(","):
        dense = Path(prepare.prepare(name)) / "model.onnx"
        for gap in a.gaps.split(","):
            tag = f"{name}_gap{gap}"
            d = out / tag
            d.mkdir(exist_ok=True)
            rep = out / f"{tag}.rewrite.json"
            rc = cli("rewrite", dense, "-o", d / "model.onnx", "--calib-text", calib, "--proc-sparse=on",
                     f"--proc-target={a.target}", f"--proc-gap={gap}", "--report", rep, "-q", *a.extra)
            if rc != 0:
                rows.append({"model": name, "gap": gap, "error": f"rewrite rc={rc}"})
                continue
            r = json.loads(rep.read_text())
            row = {"model": name, "gap": float(gap), "converted": r["factored"], "candidates": len(r["layers"]),
                   "params_before": r["params_before"], "params_after": r["params_after"], "quality_guard": r["quality"]}
            dense_bytes = sum(4 * l["params_before"] for l in r["layers"])
            stored = sum(l["extra"]["bytes_stored"] if l["backend"] == "procsparse" else 4 * l["params_before"]
                         for l in r["layers"])
            row["bytes_saved"] = dense_bytes - stored
            row["bytes_saved_frac"] = 1 - stored / dense_bytes
            if r["output"]:
                ev = out / f"{tag}.eval.json"
                cli("eval", r["output"], "--ref", dense, "--text", evalt, "--json", ev)
                row["eval"] = json.loads(ev.read_text()) if ev.exists() else None
                if not a.no_bench:
                    be = out / f"{tag}.bench.json"
                    cli("bench", r["output"], "--ref", dense, "--threads", a.threads, "--nbits", "none",
                        "--no-profile", "--json", be)
                    row["bench"] = json.loads(be.read_text()) if be.exists() else None
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("eval", "bench")}), flush=True)
    (out / "summary.json").write_text(json.dumps(rows, indent=1, default=str))
    print(f"wrote {out / 'summary.json'}")


if __name__ == "__main__":
    main()
