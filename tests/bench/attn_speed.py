"""PackedAttention speed (not part of the test run):

    python tests/bench/attn_speed.py op    [--contexts 512,2048,8192] [--budgets 0,0.125,0.25,0.5] [--threads 1]
    python tests/bench/attn_speed.py model [--past 4096] [--budget 0.25] [--threads 2]

op: one decode step (M = 1) of one SmolLM2-shaped attention core (9 query heads, 3 KV heads, head
dim 64, RoPE'd Q/K given) — the optimum-style dense subgraph (Concat with the cache, GQA repeat,
QKᵀ·scale + mask, Softmax, IsNaN → 0, ·V) vs the same block after the PackedAttention pass —
in the same process, interleaved, medians; also the 512-row prefill of the same block.
model: SmolLM2 decode tokens/s at a cache of --past tokens, dense vs rewritten
(runtime.bench_sessions: interleaved rounds, medians).
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
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def bench_op(a) -> dict:
    import numpy as np
    import onnxruntime as ort

    import custom_ops
    from custom_ops.reference.attn import pack_keys
    from rewriter.backends import packed_attention as attn
    from rewriter.kit import modelfile
    from test_packed_attention import optimum_block

    Hq, Hkv, D = 9, 3, 64
    tmp = Path(tempfile.mkdtemp(prefix="ortlean-attns-"))
    src = optimum_block(tmp / "blk.onnx", Hq=Hq, Hkv=Hkv, D=D)
    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    so.inter_op_num_threads = 1
    sessions = {"dense": ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])}
    for b in [float(x) for x in a.budgets.split(",")]:
        m = modelfile.load_model(src)
        attn.apply(m, attn.AttnConfig(enabled=True, budget=b, window=64))  # as measured for issue 5
        out = tmp / f"blk_{b}.onnx"
        modelfile.save_model_atomic(m, out)
        sessions[f"packed_{b}"] = custom_ops.session(str(out), threads=a.threads)
    r = np.random.default_rng(0)
    res = {"threads": a.threads, "isa": custom_ops.isa(), "contexts": {}}
    for T in [int(x) for x in a.contexts.split(",")]:
        for M in (1, 512):
            if M > 1 and T != 512 * (T // 512):
                continue
            P = T - M
            feed = {"q": r.standard_normal((1, Hq, M, D), dtype=np.float32),
                    "k": r.standard_normal((1, Hkv, M, D), dtype=np.float32),
                    "v": r.standard_normal((1, Hkv, M, D), dtype=np.float32),
                    "past_key_values.0.key": r.standard_normal((1, Hkv, P, D), dtype=np.float32),
                    "past_key_values.0.value": r.standard_normal((1, Hkv, P, D), dtype=np.float32),
                    "mask": np.triu(np.full((M, T), -np.inf, np.float32), k=T - M + 1)[None, None]}
            bits = pack_keys(feed["past_key_values.0.key"])
            feeds = {n: (feed if n == "dense" else dict(feed, **{"past_key_values.0.key_bits": bits})) for n in sessions}
            times = {n: [] for n in sessions}
            names = list(sessions)
            reps = a.repeats if M == 1 else max(3, a.repeats // 10)
            for i in range(reps + 3):
                order = names[i % len(names):] + names[: i % len(names)]
                for n in order:
                    t0 = time.perf_counter()
                    sessions[n].run(None, feeds[n])
                    dt = time.perf_counter() - t0
                    if i >= 3:
                        times[n].append(dt)
            med = {n: statistics.median(v) * 1e6 for n, v in times.items()}
            p10 = {n: float(np.percentile(v, 10)) * 1e6 for n, v in times.items()}
            key = f"T={T} M={M}"
            res["contexts"][key] = {n: {"median_us": round(med[n], 1), "p10_us": round(p10[n], 1),
                                        "speedup_vs_dense": round(med["dense"] / med[n], 3),
                                        "speedup_p10": round(p10["dense"] / p10[n], 3)} for n in names}
            print(key, "  ".join(f"{n} {med[n]:.0f}us (x{med['dense'] / med[n]:.2f}; p10 x{p10['dense'] / p10[n]:.2f})"
                                 for n in names), flush=True)
    return res


def bench_model(a) -> dict:
    """Decode step latency at a cache of a.past tokens: each session builds its own cache from the
    same random prompt in chunks of 512 tokens (a single 4,096-token dense prefill needs > 12 GB),
    then rounds of a.steps decode steps from that cache run interleaved (rotating order)."""
    import numpy as np

    import custom_ops
    from models import prepare as prep
    from custom_ops import runtime
    from rewriter import cli

    d = prep.prepare("smollm2")
    tmp = Path(tempfile.mkdtemp(prefix="ortlean-attnm-"))
    out = tmp / "smol.lean.onnx"
    assert cli.main(["rewrite", str(d / "model.onnx"), "-o", str(out), "--state-pack", "binary",
                     "--attn-budget", str(a.budget), "--attn-window", str(a.window), "-q"]) == 0
    sessions = {"dense": custom_ops.session(str(d / "model.onnx"), threads=a.threads),
                "lean": custom_ops.session(str(out), threads=a.threads)}
    ios = {n: runtime.ModelIO.from_session(s) for n, s in sessions.items()}
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 49000, size=a.past, dtype=np.int64)
    steps = rng.integers(100, 49000, size=a.steps, dtype=np.int64)
    init = {}
    for n, s in sessions.items():
        past, plen = None, 0
        for c0 in range(0, a.past, 512):
            ch = prompt[c0:c0 + 512]
            o = runtime.run(s, ios[n], runtime.feeds(ios[n], ch[None, :], past, plen))
            past, plen = ios[n].next_state(o), plen + ch.size
        init[n] = past
    times = {n: [] for n in sessions}
    names = list(sessions)
    for r in range(a.repeats + 1):
        order = names[r % 2:] + names[: r % 2]
        for n in order:
            past, plen = init[n], a.past
            for k in range(a.steps):
                f = runtime.feeds(ios[n], steps[None, k:k + 1], past, plen)
                t0 = time.perf_counter()
                o = runtime.run(sessions[n], ios[n], f)
                dt = time.perf_counter() - t0
                past, plen = ios[n].next_state(o), plen + 1
                if r > 0:
                    times[n].append(dt)
    res = {"past": a.past, "budget": a.budget, "threads": a.threads, "steps": a.steps, "rounds": a.repeats,
           "isa": custom_ops.isa(), "sessions": {}}
    for n in names:
        med = statistics.median(times[n])
        res["sessions"][n] = {"median_ms": round(med * 1e3, 2), "p10_ms": round(float(np.percentile(times[n], 10)) * 1e3, 2),
                              "tok_s": round(1.0 / med, 2)}
    res["speedup"] = round(res["sessions"]["dense"]["median_ms"] / res["sessions"]["lean"]["median_ms"], 3)
    res["speedup_p10"] = round(res["sessions"]["dense"]["p10_ms"] / res["sessions"]["lean"]["p10_ms"], 3)
    res["metrics_layer0"] = custom_ops.metrics().get("/ortlean/layers.0/PackedAttention")
    print(json.dumps(res, indent=1))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["op", "model"])
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--budgets", default="0,0.125,0.25,0.5")
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--past", type=int, default=4096)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=30, help="op: timed runs; model: rounds of --steps decode steps")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    res = bench_op(a) if a.what == "op" else bench_model(a)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
