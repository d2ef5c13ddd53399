"""ProcSparseMatMul alone vs ONNX Runtime's dense MatMul, in the same process, interleaved, medians.

    python tests/bench/bench_procsparse_op.py [--threads 1,2] [--json out.json]

Shapes of SmolLM2-135M's projections; fanout = 25 / 50 / 75 % of each row's blocks (chosen at
random per row), base_scale 0 (no hash regeneration) and 0.05 (the base regenerated in registers);
M = 1 (decode) and M = 128 (prefill). Not part of the test run (file name is not test_*)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import custom_ops  # noqa: E402
import onnxruntime as ort  # noqa: E402
from rewriter.backends.procsparse import proc_model  # noqa: E402
from rewriter.builders.procsparse import ProcLayer  # noqa: E402
from rewriter.kit.timing import dense_model  # noqa: E402


def time_both(sessions: dict, feeds: dict, reps: int = 30, warmup: int = 3) -> dict:
    """Medians of wall and process CPU seconds per run, sessions interleaved. On a shared,
    oversubscribed machine the CPU time is the robust one (a preempted run inflates wall time)."""
    import time

    for s in sessions.values():
        for _ in range(warmup):
            s.run(None, feeds)
    wall = {k: [] for k in sessions}
    cpu = {k: [] for k in sessions}
    for _ in range(reps):
        for k, s in sessions.items():
            c0, t0 = time.process_time(), time.perf_counter()
            s.run(None, feeds)
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    return {k: (float(np.median(wall[k])), float(np.median(cpu[k]))) for k in sessions}


def layer(K, N, B, frac, scale, seed=0):
    rng = np.random.default_rng(seed)
    nb = (K + B - 1) // B
    f = max(1, int(round(frac * nb)))
    bi = np.concatenate([np.sort(rng.choice(nb, f, replace=False)) for _ in range(N)]).astype(np.int32)
    rp = (np.arange(N + 1) * f).astype(np.int32)
    d = (rng.standard_normal((len(bi), B)) * 0.02).astype(np.float32)
    return ProcLayer(K, N, B, 1234, scale, rp, bi, d, fanout=f, watermark=0, shed_eps=0.0, gap=0.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--shapes", default="576x1536,1536x576,576x576")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    print(f"isa {custom_ops.isa()}  ort {ort.__version__}")
    print(f"{'shape':>10} {'thr':>3} {'fan':>4} {'scale':>5} {'M':>4} {'dense us':>9} {'proc us':>9} {'x wall':>7} "
          f"{'dense cpu':>9} {'proc cpu':>9} {'x cpu':>6} {'bytes':>6}")
    for thr in [int(t) for t in a.threads.split(",")]:
        so_d = ort.SessionOptions()
        so_d.intra_op_num_threads = thr
        so_d.inter_op_num_threads = 1
        for shp in a.shapes.split(","):
            K, N = map(int, shp.split("x"))
            s_d = ort.InferenceSession(dense_model(K, N), so_d, providers=["CPUExecutionProvider"])
            for frac in (0.25, 0.5, 0.75):
                for scale in (0.0, 0.05):
                    lay = layer(K, N, a.block, frac, scale)
                    s_p = ort.InferenceSession(proc_model(lay), custom_ops.session_options(thr),
                                               providers=["CPUExecutionProvider"])
                    for M in (1, 128):
                        x = np.random.default_rng(M).standard_normal((M, K)).astype(np.float32)
                        t = time_both({"dense": s_d, "proc": s_p}, {"x": x}, reps=a.reps)
                        (dw, dc), (pw, pc) = t["dense"], t["proc"]
                        r = dict(K=K, N=N, threads=thr, fanout=frac, base_scale=scale, M=M, dense_s=dw, proc_s=pw,
                                 speedup=dw / pw, dense_cpu_s=dc, proc_cpu_s=pc, speedup_cpu=dc / max(pc, 1e-9),
                                 bytes_frac=lay.bytes / (4 * K * N))
                        rows.append(r)
                        print(f"{shp:>10} {thr:>3} {frac:>4.2f} {scale:>5} {M:>4} {dw * 1e6:>9.1f} {pw * 1e6:>9.1f} "
                              f"{r['speedup']:>7.2f} {dc * 1e6:>9.1f} {pc * 1e6:>9.1f} {r['speedup_cpu']:>6.2f} "
                              f"{r['bytes_frac']:>6.2f}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"isa": custom_ops.isa(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
