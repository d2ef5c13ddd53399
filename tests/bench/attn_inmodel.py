"""PackedAttention's phase times inside a whole decoder, decoding after a long past (not part of the
test run):

    python tests/bench/attn_inmodel.py MODEL [--past 4096] [--threads 1,2] [--steps 64] [--repeats 2]

MODEL is a rewritten decoder whose PackedAttention nodes carry a cache (``ortlean rewrite
--state-pack binary`` on a fused graph). Its own chunked prefill of --past random tokens builds the
cache (custom_ops.runtime.bench.chunked_state); then --steps single-token steps in the shared-KV loop,
each after the same past (custom_ops.runtime.bench.FixedPast; the process's memory on 2 MiB pages), with the
kernel's phase clocks on (ORTLEAN_PHASE_TIMES=1: reading the inputs, storing the new rows, scoring,
selecting, attending; wall time of each phase). Printed per thread count: the median step and the
op's phases per call, averaged over the nodes and steps, and the nodes' share of the step.

Between two attention nodes the model streams its weights (int4 MatMulNBits), so every call starts
with cold caches, as in a real decode; ``tests/bench/attn_speed.py decode`` times the op alone (30
attention nodes in a graph, each with its own cache), which this checks against.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ["ORTLEAN_PHASE_TIMES"] = "1"  # read by each PackedAttention kernel at construction

PHASES = ("inputs", "store", "score", "select", "attend", "total")


def _totals(metrics: dict, pa_nodes: set) -> tuple[dict, int]:
    """Phase times summed over the PackedAttention nodes (those with phase clocks; BlockQuantMatMul's
    nodes have clocks of their own) and their calls."""
    nodes = [v for k, v in metrics.items() if k in pa_nodes and "time.calls" in v]
    tot = {k: sum(v.get(f"time.{k}_us", 0.0) for v in nodes) for k in PHASES}
    tot["calls"] = sum(v["time.calls"] for v in nodes)
    return tot, len(nodes)


def run(a) -> list[dict]:
    import onnx

    import custom_ops
    from custom_ops import runtime
    from custom_ops.runtime.bench import FixedPast

    g = onnx.load(a.model, load_external_data=False).graph
    pa_nodes = {n.name for n in g.node if n.op_type == "PackedAttention"}
    out = []
    for t in (int(x) for x in a.threads.split(",")):
        custom_ops.reset_metrics()
        sess = custom_ops.session(a.model, threads=t)
        io = runtime.ModelIO.from_session(sess, a.model)
        fixed = FixedPast(sess, io, a.past, a.steps, chunked=True)
        for rep in range(a.repeats):
            got = {}   # the totals after the warm-up steps
            steps = fixed.steps(a.steps, before=lambda: got.update(start=_totals(custom_ops.metrics(), pa_nodes)))
            before, nodes = got["start"]
            if not nodes:
                raise SystemExit(f"{a.model}: no PackedAttention node with a K/V cache (phase clocks) ran")
            after, _ = _totals(custom_ops.metrics(), pa_nodes)
            calls = after["calls"] - before["calls"]
            ph = {k: (after[k] - before[k]) / calls for k in PHASES}
            step_ms = statistics.median(steps) * 1e3
            share = ph["total"] * nodes / 1e3 / (sum(steps) * 1e3 / len(steps))
            row = {"threads": t, "past": a.past, "step_ms": round(step_ms, 3), "nodes": nodes,
                   "phases_us": {k: round(v, 2) for k, v in ph.items()}, "share": round(share, 3)}
            out.append(row)
            print(f"[{custom_ops.isa_label()}, {t} thr] past {a.past}: step {step_ms:.2f} ms (median of {a.steps}); "
                  f"PackedAttention per call, us: " + "  ".join(f"{k} {v:.1f}" for k, v in ph.items()) +
                  f"; {nodes} nodes = {100 * share:.0f} % of the mean step", flush=True)
        del fixed, sess
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--past", type=int, default=4096)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)
    if not Path(a.model).is_file():
        raise SystemExit(f"no model file {a.model}")
    run(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
