"""Does the quality guard's estimate hold on held-out text? Δppl of a rewritten model over its
reference (e.g. `--kwta=on --weights int4` over `--weights int4`) on:

  * the guard's probe: the calibration novel's tokens [calib_tokens, calib_tokens + 1024), windows
    of 256 (what `--quality-tokens 1024`, the default, scores during the rewrite);
  * the same novel, 4096 tokens from the same start (what `--quality-tokens 4096` would score);
  * the evaluation novel (Persuasion), 4096 tokens, windows of 256 and of 512 (`ortlean eval`'s
    8 × 512 windows).

    python tests/bench/bench_gating_guard.py --model GATED.onnx --ref TWIN.onnx [--json out.json]

If the 4096-token calibration figure is close to the 1024-token one but the evaluation novel is
higher, the excess is a shift between texts that more probe tokens cannot remove (only a margin
can); if the 4096-token figure moves toward the evaluation figure, more tokens fix it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ref", required=True)
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    from custom_ops import runtime
    from models import corpus
    from rewriter import evaluate

    novels = corpus.novels()
    tok = runtime.load_tokenizer(a.ref, None)
    cal = tok.encode(Path(novels[corpus.CALIB_NOVEL]).read_text(encoding="utf-8"), add_special_tokens=False).ids
    ev = tok.encode(Path(novels[corpus.EVAL_NOVEL]).read_text(encoding="utf-8"), add_special_tokens=False).ids
    c0 = a.calib_tokens
    texts = {"probe calib 1024 w256": (cal[c0:c0 + 1024], 256), "calib 4096 w256": (cal[c0:c0 + 4096], 256),
             "calib 8192 w256": (cal[c0:c0 + 8192], 256),
             "eval 4096 w256": (ev[:4096], 256), "eval 4096 w512": (ev[:4096], 512)}
    sess = {k: evaluate._session(p, a.threads) for k, p in (("ref", a.ref), ("model", a.model))}
    ios = {k: runtime.ModelIO.from_session(s) for k, s in sess.items()}
    res = {"model": a.model, "ref": a.ref, "load_before": os.getloadavg()}
    for name, (ids, w) in texts.items():
        nll = {k: runtime.perplexity(sess[k], ios[k], np.asarray(ids, np.int64), window=w)["nll"] for k in sess}
        d = float(np.exp(nll["model"] - nll["ref"]) - 1.0)
        res[name] = d
        print(f"{name:<24} Δppl {d:+.4f}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
