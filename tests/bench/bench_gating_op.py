"""EventGatedMatMul alone vs ORT's dense MatMul, same process, interleaved medians.

    python tests/bench/bench_gating_op.py [--threads 1,2] [--M 1] [--copies 8] [--json out.json]

For K×N in 576×1536, 1536×576, 768×3072 and keep ∈ {1.0, 0.75, 0.5, 0.25}: the KWTA threshold
(the planner's online mode: one compare per channel) is set so that exactly `keep` of the input
channels pass for the benchmark input. Reports time ratio gated/dense and the efficiency vs the
ideal (ideal time ratio = keep): eff = keep / ratio (target ≥ 0.85).

Each model holds `--copies` independent layers (own weights, same input) so that one Run() costs
what that many layers cost inside a graph: ORT's fixed Run() overhead (~3.5 µs here, paid once per
Run whatever the graph) is spread over the copies instead of being charged to one 40 µs op, and
the weights come from DRAM as in a real model's decode step (SmolLM2: 540 MB of weights): default
`--copies` 0 = enough layers for ≥ 96 MB per model, and the caches are flushed before each timed
Run (see _time_cold). `--copies 1` = one node per model (Run() overhead included).

Quantized weights (issue 11):

    python tests/bench/bench_gating_op.py --weights int4,int8 [--threads 1,2] [--M 1] [--json out.json]

For each shape and bits: the gated op with weight_format int4|int8 (group 32, threshold KWTA at
keep 1.0, 0.75, 0.5) against ORT's MatMulNBits of the same bits (block 32, symmetric,
accuracy_level 4) on the same shape, and against the memory bound: bytes the gated op reads
(kept rows' bytes + their scales) ÷ the streaming read bandwidth measured in the same run
(numpy reductions over a 64 MB buffer, one slice per thread, timed between the model runs).
`bound_x` = gated time / that bound (acceptance ≤ 1.2 at keep 0.5 and 0.75); `vs_mnb` = gated
time / MatMulNBits time. Weights are random bytes (timing does not depend on their values).

int4k (scales along K, int8 activations, rows in pairs; issue 11 fast M = 1 path):

    python tests/bench/bench_gating_op.py --weights int4,int4k --threads 1,2 --json tests/bench/results/gating_int4k.json

Formats of the same bits are timed in ONE interleaved set with their MatMulNBits (`vs_old` = int4k
time / int4 time at the same keep, same run). int4k bytes read = the pairs with a nonzero quantized
channel (`pair_keep`, element-wise masks: a pair is read when either channel is kept) + the scales of
the groups holding them; `eff_keep` = pair_keep."""
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
WEIGHT_BYTES = 96 << 20  # per model with the default --copies 0: 3x the L3 of this machine


def _model(Ws, attrs=None) -> bytes:
    """`len(Ws)` independent layers on one input: MatMul (attrs None) or EventGatedMatMul."""
    from onnx import helper, numpy_helper, TensorProto

    from rewriter.kit import timing

    K, N = Ws[0].shape
    nodes, inits, outs = [], [], []
    for i, W in enumerate(Ws):
        inits.append(numpy_helper.from_array(W, f"W{i}"))
        if attrs is None:
            nodes.append(helper.make_node("MatMul", ["X", f"W{i}"], [f"Y{i}"], name=f"mm{i}"))
        else:
            nodes.append(helper.make_node("EventGatedMatMul", ["X", f"W{i}"], [f"Y{i}"], name=f"g{K}x{N}_{i}_{id(attrs)}",
                                          domain="ai.ortlean", **attrs[i]))
        outs.append(helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, ["M", N]))
    g = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", K])], outs,
                          initializer=inits)
    ops = [helper.make_opsetid("", timing.OPSET)] + ([helper.make_opsetid("ai.ortlean", 1)] if attrs else [])
    m = helper.make_model(g, opset_imports=ops)
    m.ir_version = timing.IR_VERSION
    return m.SerializeToString()


def _time_cold(sess: dict, feeds_d: dict, feeds_g: dict, min_time: float, flush: np.ndarray,
               block: int = 4) -> dict[str, float]:
    """Median seconds per Run of each session. Sessions take turns in blocks of `block` timed runs
    after one untimed run: every session owns an intra-op pool whose threads spin after a Run, and
    with > 1 thread on 2 cores a run-by-run interleave times each session against the previous
    one's spinning threads (measured: MLAS 2-3x slower at 2 threads than at 1). Before every Run a
    64 MB buffer is read (untimed), so the layers' weights come from DRAM as in the decode step of
    a model larger than the 32 MB L3 (otherwise the kept quarter of the weights — 24 MB at keep
    0.25 — would stay cached between runs and flatter gating)."""
    import time

    times = {k: [] for k in sess}
    for name, s in sess.items():
        for _ in range(2):
            s.run(None, feeds_d if name == "dense" else feeds_g)
    t_end = time.perf_counter() + min_time * len(sess)
    rounds = 0
    sink = 0.0
    while rounds < 4 or (time.perf_counter() < t_end and rounds < 100):
        for name, s in sess.items():
            f = feeds_d if name == "dense" else feeds_g
            for i in range(block + 1):  # the first run of a block is untimed
                sink += float(flush.sum())
                t0 = time.perf_counter()
                s.run(None, f)
                if i:
                    times[name].append(time.perf_counter() - t0)
        rounds += 1
    return {k: float(np.median(v)) for k, v in times.items()}


def run(threads=(1, 2), Ms=(1,), min_time=0.4, select="threshold", copies=8) -> list[dict]:
    import onnxruntime as ort

    import custom_ops

    rows = []
    rng = np.random.default_rng(0)
    flush = np.ones(16 << 20, np.float32)  # 64 MB
    for K, N in SHAPES:
        n_copies = copies or -(-WEIGHT_BYTES // (K * N * 4))
        Ws = [(rng.standard_normal((K, N)) * 0.05).astype(np.float32) for _ in range(n_copies)]
        norms = [np.linalg.norm(W, axis=1) for W in Ws]
        dense = _model(Ws)
        for th in threads:
            so = ort.SessionOptions()
            so.intra_op_num_threads = th
            so.inter_op_num_threads = 1
            s_d = ort.InferenceSession(dense, so, providers=["CPUExecutionProvider"])
            for M in Ms:
                x = rng.standard_normal((M, K)).astype(np.float32)
                sess = {"dense": s_d}
                for keep in KEEPS:
                    attrs = []
                    for nrm in norms:
                        score = np.abs(x) * nrm[None, :]
                        if select == "threshold":
                            # the row's (1 - keep) quantile: `keep` of its channels pass (row 0 for M > 1)
                            thr = 0.0 if keep >= 1.0 else float(np.quantile(score[0], 1 - keep))
                            attrs.append(dict(kwta=1, kwta_threshold=thr))
                        else:
                            attrs.append(dict(kwta=1, kwta_select="topk", kwta_k=max(1, int(round(keep * K)))))
                    sess[f"keep{keep}"] = custom_ops.session(_model(Ws, attrs), threads=th)
                feeds_d = {"X": x}
                feeds_g = {"X": x}
                med = _time_cold(sess, feeds_d, feeds_g, min_time, flush)
                for keep in KEEPS:
                    r = med[f"keep{keep}"] / med["dense"]
                    rows.append({"K": K, "N": N, "M": M, "threads": th, "keep": keep, "select": select,
                                 "copies": n_copies, "dense_us": med["dense"] * 1e6 / n_copies,
                                 "gated_us": med[f"keep{keep}"] * 1e6 / n_copies,
                                 "ratio": r, "ideal": keep, "eff": keep / r})
    return rows


QWEIGHT_BYTES = 48 << 20  # quantized layers per model: > the 32 MB L3 (caches are flushed anyway)


def _quant_model(K, N, copies, fmt, thresholds, rng):
    """`copies` gated layers of weight_format fmt (random bytes, group 32) on one input, with the
    KWTA thresholds given (one per copy; None: no gating); returns (model bytes, norms per copy)."""
    from onnx import helper, numpy_helper, TensorProto

    from custom_ops.reference import gating_quant as gq
    from rewriter.kit import timing

    nodes, inits, outs, norms = [], [], [], []
    rb, ng = gq.row_bytes(fmt, N), -(-N // 32)
    kfmt = fmt in gq.KFORMATS
    for i in range(copies):
        wq = rng.integers(0, 256, (-(-K // 2) if kfmt else K, rb), dtype=np.uint8)
        sc = rng.uniform(0.001, 0.01, (-(-K // 32), N) if kfmt else (K, ng)).astype(np.float32)
        if thresholds is None:
            D = gq.dequantize_k(wq, sc, 32, K, N) if kfmt else gq.dequantize(wq, sc, fmt, 32, N)
            norms.append(np.linalg.norm(D, axis=1))
        inits += [numpy_helper.from_array(wq, f"Wq{i}"), numpy_helper.from_array(sc, f"S{i}")]
        a = dict(weight_format=fmt, weight_group=32, weight_shape=[K, N])
        if thresholds is not None:
            a.update(kwta=1, kwta_threshold=float(thresholds[i]))
        nodes.append(helper.make_node("EventGatedMatMul", ["X", "", "", f"Wq{i}", f"S{i}"], [f"Y{i}"],
                                      name=f"q{fmt}{K}x{N}_{i}_{id(thresholds)}", domain="ai.ortlean", **a))
        outs.append(helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, ["M", N]))
    g = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", K])], outs,
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", timing.OPSET), helper.make_opsetid("ai.ortlean", 1)])
    m.ir_version = timing.IR_VERSION
    return m.SerializeToString(), norms


def _mnb_model(K, N, copies, bits, rng) -> bytes:
    """`copies` com.microsoft.MatMulNBits layers (block 32, symmetric, accuracy_level 4), random bytes."""
    from onnx import helper, numpy_helper, TensorProto

    from rewriter.kit import timing

    blk = 32
    nblk = -(-K // blk)
    nodes, inits, outs = [], [], []
    for i in range(copies):
        B = rng.integers(0, 256, (N, nblk, blk * bits // 8), dtype=np.uint8)
        sc = rng.uniform(0.001, 0.01, (N * nblk,)).astype(np.float32)
        inits += [numpy_helper.from_array(B, f"B{i}"), numpy_helper.from_array(sc, f"S{i}")]
        nodes.append(helper.make_node("MatMulNBits", ["X", f"B{i}", f"S{i}"], [f"Y{i}"], name=f"mnb{i}",
                                      domain="com.microsoft", K=K, N=N, bits=bits, block_size=blk, accuracy_level=4))
        outs.append(helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, ["M", N]))
    g = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", K])], outs,
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", timing.OPSET), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = timing.IR_VERSION
    return m.SerializeToString()


def stream_bandwidth(buf: np.ndarray, threads: int, reps: int = 5) -> float:
    """Bytes/s of reading `buf` once (np.max over one slice per thread; numpy releases the GIL)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    parts = np.array_split(buf, threads)
    ts = []
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(reps):
            t0 = time.perf_counter()
            list(ex.map(np.max, parts))
            ts.append(time.perf_counter() - t0)
    return buf.nbytes / float(np.median(ts))


QKEEPS = [1.0, 0.75, 0.5]


def _bytes_read(fmt, K, N, x, norms, thr, layer_bytes):
    """(bytes one M = 1 product reads, pair_keep) averaged over the copies: kept rows (int8 | int4)
    or pairs with a nonzero quantized channel plus their groups' scales (int4k)."""
    from custom_ops.reference import gating_quant as gq

    if fmt not in gq.KFORMATS:
        keep = float(np.mean([np.mean(np.abs(x) * nrm > t) for nrm, t in zip(norms, thr)]))
        return keep * layer_bytes, keep
    nb, pk = [], []
    for nrm, t in zip(norms, thr):
        xq, _ = gq.quantize_activation(np.where(np.abs(x) * nrm > t, x, 0.0))
        pairs = np.any(np.pad(xq, (0, K % 2)).reshape(-1, 2) != 0, axis=1)
        groups = np.any(np.pad(pairs, (0, -len(pairs) % 16)).reshape(-1, 16), axis=1)
        nb.append(pairs.sum() * gq.row_bytes(fmt, N) + groups.sum() * N * 4)
        pk.append(pairs.mean())
    return float(np.mean(nb)), float(np.mean(pk))


def run_quant(weights=("int4", "int8"), threads=(1, 2), Ms=(1,), min_time=0.4, copies=0, warm=False) -> list[dict]:
    """Formats of the same bits (int4, int4k) share one interleaved timing set with their MatMulNBits.
    warm: no cache flush between runs and 4 layers per model (weights stay cached: compute speed;
    bound_x is then not a memory figure)."""
    import onnxruntime as ort

    import custom_ops
    from custom_ops.reference import gating_quant as gq

    rows = []
    rng = np.random.default_rng(0)
    flush = np.ones(16 << 20, np.float32)  # 64 MB
    if warm:
        copies = copies or 4
    by_bits: dict[int, list[str]] = {}
    for fmt in weights:
        by_bits.setdefault(8 if fmt == "int8" else 4, []).append(fmt)
    for K, N in SHAPES:
        for bits, fmts in by_bits.items():
            lb = {f: gq.stored_bytes(f, K, N, 32) for f in fmts}
            n_copies = copies or -(-QWEIGHT_BYTES // max(lb.values()))
            # norms of the layers (same seed: the gated models below rebuild the same bytes)
            seeds = {f: int(rng.integers(1 << 30)) for f in fmts}
            norms = {f: _quant_model(K, N, n_copies, f, None, np.random.default_rng(seeds[f]))[1] for f in fmts}
            mnb = _mnb_model(K, N, n_copies, bits, rng)
            for th in threads:
                so = ort.SessionOptions()
                so.intra_op_num_threads = th
                so.inter_op_num_threads = 1
                s_m = ort.InferenceSession(mnb, so, providers=["CPUExecutionProvider"])
                for M in Ms:
                    x = rng.standard_normal((M, K)).astype(np.float32)
                    sess = {"dense": s_m}
                    thrs = {}
                    for f in fmts:
                        for keep in QKEEPS:
                            thr = [0.0 if keep >= 1.0 else float(np.quantile(np.abs(x[0]) * nrm, 1 - keep))
                                   for nrm in norms[f]]
                            thrs[(f, keep)] = thr
                            model, _ = _quant_model(K, N, n_copies, f, thr, np.random.default_rng(seeds[f]))
                            sess[f"{f}:keep{keep}"] = custom_ops.session(model, threads=th)
                    bws = [stream_bandwidth(flush, th)]
                    med = _time_cold(sess, {"X": x}, {"X": x}, min_time, flush[:16] if warm else flush)
                    bws.append(stream_bandwidth(flush, th))
                    bw = float(np.median(bws))
                    for f in fmts:
                        for keep in QKEEPS:
                            if M == 1:
                                nbytes, ek = _bytes_read(f, K, N, x[0], norms[f], thrs[(f, keep)], lb[f])
                            else:
                                nbytes, ek = lb[f], 1.0
                            tk = med[f"{f}:keep{keep}"]
                            t = tk / n_copies
                            old = med.get(f"int4:keep{keep}") if f in gq.KFORMATS else None
                            rows.append({"K": K, "N": N, "M": M, "threads": th, "weights": f, "keep": keep, "warm": warm,
                                         "eff_keep": ek, "copies": n_copies, "isa": custom_ops.isa(),
                                         "stream_GBps": bw / 1e9, "bytes": nbytes, "bound_us": nbytes / bw * 1e6,
                                         "gated_us": t * 1e6, "bound_x": t / (nbytes / bw),
                                         "mnb_us": med["dense"] / n_copies * 1e6, "vs_mnb": tk / med["dense"],
                                         "vs_old": (tk / old) if old else None})
    return rows


def fmt_quant(rows) -> str:
    out = ["µs per layer = Run time / layers in the model; bound = bytes read / streaming bandwidth (same run)",
           f"{'K x N':>11} {'w':>4} {'layers':>6} {'M':>3} {'thr':>3} {'keep':>5} {'GB/s':>5} {'bound us':>8} "
           f"{'gated us':>8} {'bound_x':>7} {'MNB us':>7} {'vs_MNB':>6} {'effkeep':>7} {'vs_old':>6}"]
    for r in rows:
        out.append(f"{r['K']:>5}x{r['N']:<5} {r['weights']:>4} {r['copies']:>6} {r['M']:>3} {r['threads']:>3} "
                   f"{r['keep']:>5} {r['stream_GBps']:>5.1f} {r['bound_us']:>8.1f} {r['gated_us']:>8.1f} "
                   f"{r['bound_x']:>7.2f} {r['mnb_us']:>7.1f} {r['vs_mnb']:>6.3f} {r.get('eff_keep', r['keep']):>7.3f} "
                   + (f"{r['vs_old']:>6.3f}" if r.get("vs_old") else f"{'':>6}"))
    return "\n".join(out)


def fmt(rows) -> str:
    out = ["µs per layer = Run time / layers in the model",
           f"{'K x N':>11} {'layers':>6} {'M':>3} {'thr':>3} {'keep':>5} {'dense us':>9} {'gated us':>9} {'ratio':>6} {'eff':>5}"]
    for r in rows:
        out.append(f"{r['K']:>5}x{r['N']:<5} {r['copies']:>6} {r['M']:>3} {r['threads']:>3} {r['keep']:>5} {r['dense_us']:>9.1f} "
                   f"{r['gated_us']:>9.1f} {r['ratio']:>6.3f} {r['eff']:>5.2f}")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--M", default="1")
    ap.add_argument("--select", default="threshold", choices=["threshold", "topk"])
    ap.add_argument("--min-time", type=float, default=0.4)
    ap.add_argument("--copies", type=int, default=0,
                    help="independent layers per model (default 0: enough for >= 96 MB of weights)")
    ap.add_argument("--weights", default="",
                    help="int4,int8,int4k: the quantized formats against MatMulNBits and the memory bound")
    ap.add_argument("--warm", action="store_true", help="quantized: no cache flush, 4 layers (compute speed)")
    ap.add_argument("--shapes", default="", help="KxN,... (default: 576x1536,1536x576,768x3072)")
    ap.add_argument("--json")
    a = ap.parse_args()
    import custom_ops

    if a.shapes:
        SHAPES[:] = [tuple(int(v) for v in sh.split("x")) for sh in a.shapes.split(",")]

    if a.weights:
        rows = run_quant(tuple(a.weights.split(",")), tuple(int(t) for t in a.threads.split(",")),
                         tuple(int(m) for m in a.M.split(",")), a.min_time, a.copies, a.warm)
        print(f"isa {custom_ops.isa()}, threads {a.threads}" + (", WARM caches" if a.warm else ""))
        print(fmt_quant(rows))
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))
        return

    rows = run(tuple(int(t) for t in a.threads.split(",")), tuple(int(m) for m in a.M.split(",")), a.min_time, a.select, a.copies)
    print(f"isa {custom_ops.isa()}")
    print(fmt(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
