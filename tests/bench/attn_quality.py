"""PackedAttention quality on long context (not part of the test run):

    python tests/bench/attn_quality.py [--tokens 8192] [--windows 2048,4096] [--budgets 0.125,0.25,0.5]
                                       [--threads 2] [--json out.json]

SmolLM2 perplexity on held-out Austen (models.corpus.EVAL_NOVEL, "Persuasion"), the first
--tokens tokens in non-overlapping windows, dense vs PackedAttention at each candidate budget.
The packed models are rewritten with approx_prefill = 1 (--attn-approx-prefill): every prompt
row attends only to its candidates, exactly as the decode step at that position would, so the
perplexity measures decode-time quality (a normal rewrite runs prompts exactly). Windows run in
chunks of --chunk tokens through the KV cache (and the packed key-bits cache), which bounds memory.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--windows", default="2048,4096")
    ap.add_argument("--budgets", default="0.125,0.25,0.5")
    ap.add_argument("--mode", default="binary", help="--state-pack value (binary = sign bits by default)")
    ap.add_argument("--extra", default="", help="extra rewrite flags, space separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=512, help="tokens per run inside a window (default 512)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    import numpy as np

    import custom_ops
    from models import corpus, prepare as prep
    from custom_ops import runtime
    from rewriter import cli

    d = prep.prepare("smollm2")
    dense_path = d / "model.onnx"
    tok = runtime.load_tokenizer(d)
    ids = np.asarray(tok.encode(corpus.text(corpus.EVAL_NOVEL), add_special_tokens=False).ids[: a.tokens], np.int64)
    windows = [int(w) for w in a.windows.split(",")]
    budgets = [float(b) for b in a.budgets.split(",")]
    res = {"novel": corpus.EVAL_NOVEL, "tokens": int(ids.size), "windows": windows, "budgets": budgets,
           "mode": a.mode, "extra": a.extra, "dense": {}, "packed": {}}

    def ppl(path, w):
        """Non-overlapping windows of w tokens, each run as chunks of --chunk tokens through the KV
        cache (same logits as one w-token pass; bounded memory: a 4,096-token single pass of the
        dense graph needs > 12 GB). Scores every token of a window but its first."""
        sess = custom_ops.session(str(path), threads=a.threads)
        io = runtime.ModelIO.from_session(sess)
        t = time.perf_counter()
        nll, count = 0.0, 0
        for begin in range(0, ids.size - 1, w):
            win = ids[begin:begin + w]
            past, plen = None, 0
            for c0 in range(0, win.size, a.chunk):
                chunk = win[c0:c0 + a.chunk]
                out = runtime.run(sess, io, runtime.feeds(io, chunk[None, :], past, plen))
                past, plen = io.next_state(out), plen + chunk.size
                logits = out[io.logits_name][0].astype(np.float64)
                tgt_pos = np.arange(c0 + 1, c0 + chunk.size + 1)           # predicted positions
                keep = tgt_pos < win.size
                lg = logits[keep]
                lg = lg - lg.max(-1, keepdims=True)
                lp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
                tg = win[tgt_pos[keep]]
                nll -= float(lp[np.arange(tg.size), tg].sum())
                count += int(tg.size)
        return {"ppl": float(np.exp(nll / count)), "nll": nll / count, "tokens": count,
                "seconds": round(time.perf_counter() - t, 1)}

    for w in windows:
        res["dense"][str(w)] = ppl(dense_path, w)
        print(f"dense window {w}: ppl {res['dense'][str(w)]['ppl']:.4f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="ortlean-attnq-") as tmp:
        for b in budgets:
            out = Path(tmp) / f"packed_{b}.onnx"
            argv = ["rewrite", str(dense_path), "-o", str(out), "--state-pack", a.mode, "--attn-budget", str(b),
                    "--attn-approx-prefill", "-q"] + a.extra.split()
            assert cli.main(argv) == 0
            for w in windows:
                r = ppl(out, w)
                r["delta_ppl"] = r["ppl"] / res["dense"][str(w)]["ppl"] - 1.0
                res["packed"].setdefault(str(b), {})[str(w)] = r
                print(f"budget {b} window {w}: ppl {r['ppl']:.4f}  Δppl {100 * r['delta_ppl']:+.2f} %  ({r['seconds']} s)",
                      flush=True)
            out.unlink()
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
