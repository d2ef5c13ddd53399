"""How long an idle ONNX Runtime intra-op pool keeps its workers busy after a Run (not part of the
test run): custom_ops.runtime.bench.settle's pause comes from this.

    python tests/bench/pool_spin.py [--threads 2] [--gaps 1,3,10,30,100]

One session (a 512 x 512 MatMul, --threads intra-op threads); after each Run the main thread sleeps
GAP ms and the CPU time the process's other threads used meanwhile (/proc/<pid>/task/*/schedstat)
is printed as a fraction of the sleep: ~1 while a worker spins, 0 once it blocks (schedstat is
updated at scheduler events: gaps of a few ms read low). Result on a 2-core VM:
tests/bench/results/pool-spin.log.
"""
from __future__ import annotations

import argparse
import glob
import os
import threading
import time

import numpy as np


def main() -> None:
    import onnxruntime as ort
    from onnx import TensorProto as TP
    from onnx import helper

    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gaps", default="1,3,10,30,100")
    a = ap.parse_args()
    x_info = helper.make_tensor_value_info("x", TP.FLOAT, [512, 512])
    y_info = helper.make_tensor_value_info("y", TP.FLOAT, [512, 512])
    w = helper.make_tensor("w", TP.FLOAT, [512, 512], np.random.default_rng(0).random(512 * 512, np.float32))
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x_info], [y_info], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).random((512, 512), np.float32)
    for _ in range(5):
        s.run(None, {"x": x})
    me = str(threading.get_native_id())

    def cpu_ns() -> dict[str, int]:
        out = {}
        for f in glob.glob(f"/proc/{os.getpid()}/task/*/schedstat"):
            with open(f) as fh:
                out[f.split("/")[4]] = int(fh.read().split()[0])
        return out

    print(f"onnxruntime {ort.__version__}, {a.threads} intra-op threads, {os.cpu_count()} logical cores")
    for gap in [float(v) / 1e3 for v in a.gaps.split(",")]:
        s.run(None, {"x": x})
        c0, t0 = cpu_ns(), time.perf_counter()
        time.sleep(gap)
        c1, el = cpu_ns(), time.perf_counter() - t0
        busy = sum(c1[k] - c0.get(k, 0) for k in c1 if k != me) / 1e9
        print(f"after a Run, sleep {gap * 1e3:6.1f} ms: the other threads busy {busy / el:4.2f} of it", flush=True)


if __name__ == "__main__":
    main()
