"""Event-driven mode: where it pays and where it must switch itself off.

    python tests/bench/bench_event.py stream [--K 1536 --N 576 --change 0.05]
    python tests/bench/bench_event.py text   [--tokens 48]      # SmolLM2 on Persuasion

stream: the op alone on a synthetic time-correlated stream (each step redraws `change` of the
channels, the rest stay: slowly changing frames), event mode vs ORT's dense MatMul, per-step
time ratio (same run, interleaved medians), quality gap, and whether the mode stayed on.
text: SmolLM2-135M with every MLP MatMul in event mode (--event-driven=on), greedy decode of a
Persuasion prompt: the gap checks see ~100 % change between tokens and disable the mode
(event.enabled = 0, event.disables per layer), and the text equals the dense model's from the
check step on."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def stream(K=1536, N=576, change=0.05, steps=400, threads=1, topk=0.25, block=1, gap_every=16, tol=0.03, seed=0):
    import onnxruntime as ort

    import custom_ops
    from rewriter.kit import timing
    from test_gating_kernel import _stream, gate_model

    rng = np.random.default_rng(seed)
    W = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    xs = _stream(rng, steps, K, change)
    a = dict(event=1, event_topk=topk, block=block, event_gap_every=gap_every, event_gap_tol=tol,
             event_theta=0.01, event_age_max=64)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    dense = ort.InferenceSession(timing.dense_model(K, N), so, providers=["CPUExecutionProvider"])
    # the dense model with these weights (so the outputs can be compared)
    from onnx import TensorProto, helper, numpy_helper

    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "d",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])],
                          initializer=[numpy_helper.from_array(W, "w")])
    mdl = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    mdl.ir_version = 10
    dense = ort.InferenceSession(mdl.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ev = custom_ops.session(gate_model(W, a, name="event_stream"), threads=threads)
    custom_ops.reset_metrics()
    st = np.zeros((1, 0), np.float32)
    td, te, errs = [], [], []
    for t in range(steps):
        x = xs[t][None]
        order = (0, 1) if t % 2 else (1, 0)
        for o in order:
            if o == 0:
                t0 = time.perf_counter()
                yd = dense.run(None, {"x": x})[0]
                td.append(time.perf_counter() - t0)
            else:
                t0 = time.perf_counter()
                ye, st = ev.run(None, {"X": x[None], "past_state": st})
                te.append(time.perf_counter() - t0)
        errs.append(float(np.linalg.norm(ye[0, 0] - yd[0]) / np.linalg.norm(yd[0])))
    met = custom_ops.metrics()["event_stream"]
    warm = 20
    md, me = float(np.median(td[warm:])), float(np.median(te[warm:]))
    return {"K": K, "N": N, "change": change, "threads": threads, "topk": topk, "block": block,
            "dense_us": md * 1e6, "event_us": me * 1e6, "time_ratio": me / md, "speedup": md / me,
            "median_rel_err": float(np.median(errs[1:])), "max_rel_err": float(np.max(errs[1:])),
            "enabled_at_end": float(st[0, 2] == 0.0), "metrics": met}


def text(tokens=48, threads=2):
    from models import corpus, prepare

    import custom_ops
    from custom_ops import runtime
    from rewriter import cli

    d = prepare.prepare("smollm2")
    out = Path("/tmp/ortlean-bench-event/model.event.onnx")
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists():
        rc = cli.main(["rewrite", str(d / "model.onnx"), "-o", str(out), "--event-driven=on", "--event-topk", "0.4",
                       "--event-gap-every", "8", "--event-gap-tol", "0.03", "--quality-budget", "off", "-q"])
        assert rc == 0
    prompt = corpus.novels()[corpus.EVAL_NOVEL].read_text()[5000:5600]
    s = custom_ops.session(str(out), threads=threads)
    io = runtime.ModelIO.from_session(s)
    tok = runtime.load_tokenizer(d / "model.onnx")
    custom_ops.reset_metrics()
    txt_e, ids_e = runtime.generate(s, io, tok, prompt, tokens, eos=None)
    met = custom_ops.metrics()
    import onnxruntime as ort

    sd = custom_ops.session(str(d / "model.onnx"), threads=threads)
    txt_d, ids_d = runtime.generate(sd, runtime.ModelIO.from_session(sd), tok, prompt, tokens, eos=None)
    ev = {k: v for k, v in met.items() if "event.enabled" in v}
    return {"layers": len(ev), "enabled_layers_at_end": int(sum(v["event.enabled"] for v in ev.values())),
            "disables": int(sum(v.get("event.disables", 0) for v in ev.values())),
            "median_gap_at_check": float(np.median([v["event.quality_gap"] for v in ev.values()])),
            "same_tokens_as_dense": int(sum(a == b for a, b in zip(ids_e, ids_d))), "tokens": len(ids_e),
            "text_event": txt_e[:200], "text_dense": txt_d[:200]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["stream", "text"])
    ap.add_argument("--K", type=int, default=1536)
    ap.add_argument("--N", type=int, default=576)
    ap.add_argument("--change", default="0.02,0.05,0.1,0.3")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.what == "stream":
        rows = [stream(a.K, a.N, float(c), threads=a.threads) for c in a.change.split(",")]
        print(f"{'K x N':>10} {'change':>6} {'dense us':>9} {'event us':>9} {'speedup':>7} {'med err':>8} {'max err':>8} {'on':>3}")
        for r in rows:
            print(f"{r['K']:>5}x{r['N']:<4} {r['change']:>6} {r['dense_us']:>9.1f} {r['event_us']:>9.1f} "
                  f"{r['speedup']:>7.2f} {r['median_rel_err']:>8.4f} {r['max_rel_err']:>8.4f} {int(r['enabled_at_end']):>3}")
        res = rows
    else:
        res = text(a.tokens, a.threads if a.threads > 1 else 2)
        print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
