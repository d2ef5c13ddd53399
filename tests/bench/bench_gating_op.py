"""EventGatedMatMul alone vs ORT's dense MatMul, same process, interleaved medians.

    python tests/bench/bench_gating_op.py [--threads 1,2] [--M 1] [--json out.json]

For K×N in 576×1536, 1536×576, 768×3072 and keep ∈ {1.0, 0.75, 0.5, 0.25}: the KWTA threshold
(the planner's online mode: one compare per channel) is set so that exactly `keep` of the input
channels pass for the benchmark input. Reports time ratio gated/dense and the efficiency vs the
ideal (ideal time ratio = keep): eff = keep / ratio (target ≥ 0.85)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

SHAPES = [(576, 1536), (1536, 576), (768, 3072)]
KEEPS = [1.0, 0.75, 0.5, 0.25]


def run(threads=(1, 2), Ms=(1,), min_time=0.4, select="threshold") -> list[dict]:
    import onnxruntime as ort

    import custom_ops
    from rewriter import speed
    from test_gating_kernel import gate_model

    rows = []
    rng = np.random.default_rng(0)
    for K, N in SHAPES:
        W = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
        norms = np.linalg.norm(W, axis=1)
        dense = speed.dense_model(K, N)
        for th in threads:
            so = ort.SessionOptions()
            so.intra_op_num_threads = th
            so.inter_op_num_threads = 1
            s_d = ort.InferenceSession(dense, so, providers=["CPUExecutionProvider"])
            for M in Ms:
                x = rng.standard_normal((M, K)).astype(np.float32)
                sess = {"dense": s_d}
                for keep in KEEPS:
                    score = np.abs(x) * norms[None, :]
                    if select == "threshold":
                        if keep >= 1.0:
                            thr = 0.0
                        else:
                            thr = float(np.quantile(score[0], 1 - keep))
                        a = dict(kwta=1, kwta_threshold=thr)
                    else:
                        a = dict(kwta=1, kwta_select="topk", kwta_k=max(1, int(round(keep * K))))
                    sess[f"keep{keep}"] = custom_ops.session(gate_model(W, a, name=f"b{K}x{N}k{keep}"), threads=th)
                feeds_d = {"x": x}
                feeds_g = {"X": x}
                # interleave: dense and each gated variant, rounds alternate
                times = {k: [] for k in sess}
                for s_name, s in sess.items():
                    for _ in range(5):
                        s.run(None, feeds_d if s_name == "dense" else feeds_g)
                import time

                t_end = time.perf_counter() + min_time * len(sess)
                reps = 0
                while reps < 20 or time.perf_counter() < t_end:
                    for s_name, s in sess.items():
                        f = feeds_d if s_name == "dense" else feeds_g
                        t0 = time.perf_counter()
                        s.run(None, f)
                        times[s_name].append(time.perf_counter() - t0)
                    reps += 1
                    if reps > 3000:
                        break
                med = {k: float(np.median(v)) for k, v in times.items()}
                for keep in KEEPS:
                    r = med[f"keep{keep}"] / med["dense"]
                    rows.append({"K": K, "N": N, "M": M, "threads": th, "keep": keep, "select": select,
                                 "dense_us": med["dense"] * 1e6, "gated_us": med[f"keep{keep}"] * 1e6,
                                 "ratio": r, "ideal": keep, "eff": keep / r})
    return rows


def fmt(rows) -> str:
    out = [f"{'K x N':>11} {'M':>3} {'thr':>3} {'keep':>5} {'dense us':>9} {'gated us':>9} {'ratio':>6} {'eff':>5}"]
    for r in rows:
        out.append(f"{r['K']:>5}x{r['N']:<5} {r['M']:>3} {r['threads']:>3} {r['keep']:>5} {r['dense_us']:>9.1f} "
                   f"{r['gated_us']:>9.1f} {r['ratio']:>6.3f} {r['eff']:>5.2f}")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--M", default="1")
    ap.add_argument("--select", default="threshold", choices=["threshold", "topk"])
    ap.add_argument("--min-time", type=float, default=0.4)
    ap.add_argument("--json")
    a = ap.parse_args()
    import custom_ops

    rows = run(tuple(int(t) for t in a.threads.split(",")), tuple(int(m) for m in a.M.split(",")), a.min_time, a.select)
    print(f"isa {custom_ops.isa()}")
    print(fmt(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
