"""Where a decode step's time goes, node kind by node kind, beside the memory floor of its weights (not
part of the test run):

    python tests/bench/step_breakdown.py MODEL [--past 128] [--threads 1,2] [--steps 200] [--rounds 3] [--json FILE]

MODEL is a rewritten decoder (BlockQuantMatMul weights; PackedAttention with a cache), e.g. SmolLM2's
``ortlean rewrite`` output. A random prompt of --past tokens is prefilled, then --steps single-token
steps each after that same past run in the shared-KV loop (``runtime.bench.FixedPast`` over
``runtime.shared_kv``, the driver of ``ortlean bench``'s rows and ``ortlean generate``; the process's memory
on 2 MiB pages) with the kernels'
clocks on (ORTLEAN_PHASE_TIMES=1, read at kernel construction). Per thread count, medians over --rounds
rounds, in microseconds per step:

* ``step``: the median step's wall time (the driver's Python included), and the mean, which the parts
  below (sums over the round's steps, per step) add up to;
* ``BlockQuantMatMul``: its decode calls summed over the nodes; ``tasks``: each call's longest task (the
  weights streamed and multiplied; the caller's task quantizes the row first), ``pool``: the rest of
  ORT's ParallelFor (the first task's start, the later start of the other thread's, the wait for the
  last and the return), ``call``: outside the pool run (reading the inputs, the output's allocation,
  the non-finite check, the gated unit); per call, the pool's start of its first and its last task and
  the time from the last task's end to the run's return;
* ``PackedAttention``: its phases summed over the nodes (``docs/packed-attention.md``);
* ``rest``: the mean step less both ops: ONNX Runtime's other nodes (norms, the mask's arithmetic), the
  executor's per-node costs, the driver;
* ``floor``: the model's weight bytes read once with a barrier after each node's
  (``custom_ops.runtime.floor``, as ``ortlean bench`` prints it), the faster read pattern, the best of
  the round's passes.

A node-at-a-time runtime pays ``call + pool`` once per weight node whatever its kernels do; ``tasks``
against ``floor`` is how close the kernels stream.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ["ORTLEAN_PHASE_TIMES"] = "1"  # read by each kernel at construction

BQ_KEYS = ("total", "run", "first_start", "last_start", "task", "join")
PA_KEYS = ("inputs", "store", "score", "select", "attend", "total")


def _sums(metrics: dict, op_nodes: set, keys) -> tuple[dict, float]:
    """time.<key>_us summed over the named nodes, and their timed calls."""
    nodes = [v for k, v in metrics.items() if k in op_nodes and "time.calls" in v]
    return {k: sum(v.get(f"time.{k}_us", 0.0) for v in nodes) for k in keys}, sum(v["time.calls"] for v in nodes)


def _floor_us(model: str, threads: int, passes: int = 5) -> float:
    from custom_ops.runtime.floor import CONFIGS, aligned_buffers, stream_ns, weight_reads

    bufs = aligned_buffers([n for _, n in weight_reads(model)])
    best = min(stream_ns(bufs, threads, s, pf, True)[0] for s, pf in CONFIGS for _ in range(passes))
    del bufs
    return best / 1e3


def run(a) -> list[dict]:
    import onnx

    import custom_ops
    from custom_ops import runtime
    from custom_ops.runtime.bench import FixedPast

    g = onnx.load(a.model, load_external_data=False).graph
    bq_nodes = {n.name for n in g.node if n.op_type == "BlockQuantMatMul"}
    pa_nodes = {n.name for n in g.node if n.op_type == "PackedAttention"}
    if not bq_nodes:
        raise SystemExit(f"{a.model}: no BlockQuantMatMul node (rewrite the model with ortlean first)")
    out = []
    for t in (int(x) for x in a.threads.split(",")):
        sess = custom_ops.session(a.model, threads=t)
        io = runtime.ModelIO.from_session(sess, a.model)
        fixed = FixedPast(sess, io, a.past, a.steps)
        rounds = []
        for _ in range(a.rounds):
            steps = fixed.steps(a.steps, before=custom_ops.reset_metrics)
            m = custom_ops.metrics()
            bq, bq_calls = _sums(m, bq_nodes, BQ_KEYS)
            pa, _ = _sums(m, pa_nodes, PA_KEYS)
            n = len(steps)
            step_us = statistics.median(steps) * 1e6
            r = {"step": step_us, "step_mean": statistics.mean(steps) * 1e6, "bq": bq["total"] / n, "tasks": bq["task"] / n, "pool": (bq["run"] - bq["task"]) / n,
                 "call": (bq["total"] - bq["run"]) / n, "pa": pa["total"] / n,
                 "first_start": bq["first_start"] / max(bq_calls, 1), "last_start": bq["last_start"] / max(bq_calls, 1),
                 "join": bq["join"] / max(bq_calls, 1), "bq_calls": bq_calls / n,
                 **{f"pa_{k}": pa[k] / n for k in PA_KEYS if k != "total"}}
            r["rest"] = r["step_mean"] - r["bq"] - r["pa"]
            rounds.append(r)
        del fixed, sess
        med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        med["floor"] = _floor_us(a.model, t)
        row = {"threads": t, "past": a.past, "steps": a.steps, "rounds": a.rounds, "isa": custom_ops.isa_label(),
               **{k: round(v, 2) for k, v in med.items()}}
        out.append(row)
        print(f"[{row['isa']}, {t} thread{'s' if t > 1 else ''}] past {a.past}, us a step (median of {a.rounds} rounds "
              f"of {a.steps} steps): step {med['step']:.0f} (mean {med['step_mean']:.0f} = BlockQuantMatMul {med['bq']:.0f} "
              f"({med['bq_calls']:.0f} calls: tasks {med['tasks']:.0f}, pool {med['pool']:.0f}, call {med['call']:.0f}) "
              f"+ PackedAttention {med['pa']:.0f} (inputs {med['pa_inputs']:.0f}, store {med['pa_store']:.0f}, "
              f"attend {med['pa_attend']:.0f}) + rest {med['rest']:.0f}); weights floor with a barrier a node "
              f"{med['floor']:.0f} (tasks / floor {med['tasks'] / med['floor']:.2f}x). Per call: first task starts "
              f"{med['first_start']:.2f}, last {med['last_start']:.2f}, return {med['join']:.2f} after the last ends",
              flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the rows here, with the machine and commit")
    a = ap.parse_args(argv)
    if not Path(a.model).is_file():
        raise SystemExit(f"no model file {a.model}")
    from rewriter import results

    start = results.git_commit()
    rows = run(a)
    if a.json:
        results.write_json(a.json, {**results.provenance(start), "command": " ".join(["python", *sys.argv]),
                                    "model": str(a.model), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
