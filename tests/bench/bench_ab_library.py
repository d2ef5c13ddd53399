"""Two builds of libortlean_ops.so, op by op, in one process: did a refactor or a kernel change move
the ops' speed? Every op (TTMatMul, ProcSparseMatMul, EventGatedMatMul stateless/stateful,
PackedAttention) at SmolLM2-135M shapes, M = 1 and a prefill M, sessions of library A, library B
and the dense MatMul run interleaved (medians), so machine drift hits all alike.

    # library A: a build of an older commit
    git worktree add /tmp/ortlean-old <rev> && cmake -S /tmp/ortlean-old -B /tmp/ortlean-old/build -G Ninja \
        && cmake --build /tmp/ortlean-old/build
    python tests/bench/bench_ab_library.py --a /tmp/ortlean-old/build/cpp/libortlean_ops.so \
        [--b <path, default: this checkout's build>] [--threads 1 2] [--json out.json]

Prints per case: A µs, B µs, B/A (≤ 1 is B faster), dense µs; the ISA the library picked and the
thread count. Outputs of A and B are compared too (the refactor must not change results).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]

import custom_ops  # noqa: E402
from custom_ops.runtime.bench import time_sessions  # noqa: E402
from test_gating_kernel import gate_model  # noqa: E402
from test_packed_attention import op_model as attention_model  # noqa: E402
from test_procsparse import proc_model, random_layer  # noqa: E402
from test_tt_kernel import random_cores, tt_model  # noqa: E402

K, N = 576, 1536  # SmolLM2-135M: hidden, MLP width


def _dense(W: np.ndarray) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    g = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "dense",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", W.shape[0]])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(W.astype(np.float32), "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    return m.SerializeToString()


def cases(prefill: int):
    """(name, op model bytes, feeds, dense model bytes or None)."""
    r = np.random.default_rng(0)
    W = (r.standard_normal((K, N)) * 0.05).astype(np.float32)
    dense = _dense(W)
    out = []
    cores = random_cores(r, [8, 8, 9], [8, 12, 16], [1, 16, 16, 1])
    tt = tt_model(cores, name="ab_tt")
    rp, bi, d = random_layer(K, N, 32, 6, rng_seed=1)
    proc = proc_model(K, N, 32, rp, bi, d, scale=0.05, name="ab_proc")
    thr = gate_model(W, dict(kwta=1, kwta_select="threshold", kwta_threshold=0.67), name="ab_thr", xshape=["M", K])
    topk = gate_model(W, dict(kwta=1, kwta_select="topk", kwta_k=288), name="ab_topk", xshape=["M", K])
    for m in (1, prefill):
        x = r.standard_normal((m, K)).astype(np.float32)
        out += [(f"TTMatMul 576x1536 r16 M={m}", tt, {"X": x}, dense),
                (f"ProcSparseMatMul 576x1536 b32 M={m}", proc, {"X": x}, dense),
                (f"EventGated threshold keep~0.5 M={m}", thr, {"X": x}, dense),
                (f"EventGated topk 288/576 M={m}", topk, {"X": x}, dense)]
    ev_attrs = dict(event=1, kwta=1, kwta_select="topk", kwta_k=36, kwta_duty=3, block=8, event_topk=0.5,
                    event_gap_every=5, event_gap_tol=0.5, event_age_max=4)
    ev = gate_model(W, ev_attrs, name="ab_event", xshape=None)
    out.append(("EventGated event decode M=1", ev, {"X": r.standard_normal((1, 1, K)).astype(np.float32),
                                                    "past_state": None}, None))
    Hq, Hkv, D, T = 9, 3, 64, 1024
    q = r.standard_normal((1, Hq, 1, D), dtype=np.float32)
    kk = r.standard_normal((1, Hkv, T, D), dtype=np.float32)
    vv = r.standard_normal((1, Hkv, T, D), dtype=np.float32)
    for budget in (1.0, 0.25):
        a = dict(scale=0.125, budget=budget, min_context=64, window=16, min_candidates=16)
        out.append((f"PackedAttention decode past={T} budget={budget}", attention_model(a, mask=False, bits=False,
                                                                                        name=f"ab_pa{budget}"),
                    {"Q": q, "K": kk, "V": vv}, None))
    return out


def _session(model: bytes, lib: str | None, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    # interleaved sessions: a pool that spins after its run steals the cores of the next session's
    # run (2 threads on 2 cores: swings of 0.5x-5x); no spinning makes the rows comparable
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if lib:
        so.register_custom_ops_library(lib)
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _state_feeds(sess, feeds):
    """A stateful op's decode feed: the state a 4-token prefill leaves."""
    if "past_state" not in feeds:
        return feeds
    K_ = feeds["X"].shape[-1]
    pre = np.random.default_rng(5).standard_normal((1, 4, K_)).astype(np.float32)
    _, st = sess.run(None, {"X": pre, "past_state": np.zeros((1, 0), np.float32)})
    return {**feeds, "past_state": st}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="library A (e.g. a build of the commit before the change)")
    ap.add_argument("--b", default=None, help="library B (default: this checkout's build)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--min-time", type=float, default=0.3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    lib_a, lib_b = str(Path(a.a).resolve()), str(Path(a.b or custom_ops.library_path()).resolve())
    custom_ops.load_library()  # preloads the BLAS both builds link
    res = {"a": lib_a, "b": lib_b, "isa": custom_ops.isa(), "cpu": platform.processor() or platform.machine(),
           "rows": []}
    print(f"A = {lib_a}\nB = {lib_b}\nISA {res['isa']}")
    for t in a.threads:
        print(f"\nthreads={t}\n{'case':<44}{'A µs':>10}{'B µs':>10}{'B/A':>8}{'dense µs':>10}  outputs")
        for name, model, feeds, dense in cases(a.prefill):
            sa, sb = _session(model, lib_a, t), _session(model, lib_b, t)
            fa = _state_feeds(sa, feeds)
            ya, yb = sa.run(None, fa), sb.run(None, fa)
            same = all(np.array_equal(p, q) for p, q in zip(ya, yb))
            close = same or all(np.allclose(p, q, rtol=1e-5, atol=1e-5) for p, q in zip(ya, yb))
            sessions = {"a": sa, "b": sb}
            if dense is not None:
                sessions["dense"] = _session(dense, None, t)
            tm = time_sessions(sessions, fa, min_time=a.min_time)
            row = {"case": name, "threads": t, "a_us": tm["a"] * 1e6, "b_us": tm["b"] * 1e6,
                   "b_over_a": tm["b"] / tm["a"], "dense_us": tm.get("dense", float("nan")) * 1e6,
                   "outputs": "identical" if same else ("close" if close else "DIFFER")}
            res["rows"].append(row)
            print(f"{name:<44}{row['a_us']:>10.1f}{row['b_us']:>10.1f}{row['b_over_a']:>8.3f}"
                  f"{row['dense_us']:>10.1f}  {row['outputs']}")
    ratios = [r["b_over_a"] for r in res["rows"]]
    res["geomean_b_over_a"] = float(np.exp(np.mean(np.log(ratios))))
    print(f"\ngeometric mean B/A over {len(ratios)} cases: {res['geomean_b_over_a']:.3f}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0 if all(r["outputs"] != "DIFFER" for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
