"""PackedAttention speed (not part of the test run):

    python tests/bench/attn_speed.py op    [--contexts 512,2048,8192] [--budgets 0,0.125,0.25,0.5] [--threads 1]
    python tests/bench/attn_speed.py model [--past 4096] [--budget 0.25] [--threads 2]

op: one decode step (M = 1) of one SmolLM2-shaped attention core (9 query heads, 3 KV heads, head
dim 64, RoPE'd Q/K given) — the optimum-style dense subgraph (Concat with the cache, GQA repeat,
QKᵀ·scale + mask, Softmax, IsNaN → 0, ·V) vs the same block after the PackedAttention pass —
in the same process, interleaved, medians; also the 512-row prefill of the same block.
model: SmolLM2 decode tokens/s at a cache of --past tokens, dense vs rewritten
(runtime.bench_sessions: interleaved rounds, medians).

    python tests/bench/attn_speed.py decode [--pasts 128,4096] [--budgets 1,0.25,0.125] [--kv int8,int4] [--mode sign|pq]
                                            [--layers 30] [--threads 1] [--json FILE]

decode: one decode step of attention alone on SmolLM2 shapes (9 query heads, 3 KV heads, head dim
64), --layers independent nodes in one graph (each with its own cache, as a model's layers: the
caches do not stay in the CPU caches between steps), past and present bound to one buffer per
layer (IOBinding; GroupQueryAttention's shared-buffer mode, PackedAttention's seqlens_k mode):
com.microsoft GroupQueryAttention (fp32 cache) vs PackedAttention kv_quant int8/int4 at each budget
(1 = exact over the quantized cache); --lib-a PATH adds the same PackedAttention nodes on another
build of the library (rows "A:…", interleaved with this checkout's: a kernel change's A/B; run it in
both slots, ORTLEAN_LIBRARY=X … --lib-a Y and swapped: one slot's rows were up to 8 % faster than the
other's with the same library, either way from run to run). Beside each: the bytes the op reads per step (GQA: K and V;
PackedAttention: the key bits of the context when it approximates + the selected quantized rows)
and the streaming bound — the time to read those bytes from the same buffers with a plain
streaming loop (tests/bench/attn_stream.c, same threads, same run, interleaved) — and op/bound.
--phases: each PackedAttention row also gets its phase times per op (the kernel's ORTLEAN_PHASE_TIMES
metrics: reading the inputs, storing the new rows, scoring, selecting, attending; medians over the
timed runs; wall time of each phase, so at 2 threads a phase includes waiting for its slowest task).

    python tests/bench/attn_speed.py prefill [--shape qwen|smollm2|gemma3] [--pasts 4096,16384,32256] [--chunk 512]
                                             [--budgets exact,0.25,0.125] [--block 64] [--window 1024] [--threads 2]

prefill: one prompt chunk of one PackedAttention node after a cached past (int8 rows): the exact
prompt path against the sparse prefill at each budget (bench_prefill's docstring).

    python tests/bench/attn_speed.py memory [--threads 2] [--mib 512] [--repeats 30]

memory: the machine's sustained read bandwidth (the bound's streaming loop over a buffer far larger
than the last-level cache) with 1 .. --threads threads, and per CPU (pinned in turn) its single-thread
read bandwidth and dependent-load latency: whether a second thread can add bandwidth to a
memory-bound phase at all. And the fastest a gather of the op's candidate rows can go: a bare C loop
reading random 128-byte rows (768 of each 4,096-row region, ascending, as budget 0.1875 at past 4,096
selects) with software prefetch 0-128 rows ahead, in ns per row and against streaming the same bytes.
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
    res = {"threads": a.threads, "isa": custom_ops.isa_label(), "contexts": {}}
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
           "isa": custom_ops.isa_label(), "sessions": {}}
    for n in names:
        med = statistics.median(times[n])
        res["sessions"][n] = {"median_ms": round(med * 1e3, 2), "p10_ms": round(float(np.percentile(times[n], 10)) * 1e3, 2),
                              "tok_s": round(1.0 / med, 2)}
    res["speedup"] = round(res["sessions"]["dense"]["median_ms"] / res["sessions"]["lean"]["median_ms"], 3)
    res["speedup_p10"] = round(res["sessions"]["dense"]["p10_ms"] / res["sessions"]["lean"]["p10_ms"], 3)
    res["metrics_layer0"] = custom_ops.metrics().get("/ortlean/layers.0/PackedAttention")
    print(json.dumps(res, indent=1))
    return res


def bench_memory(a) -> dict:
    """This machine's memory, for reading the decode rows' op/stream: the sustained read bandwidth of a
    buffer far larger than the last-level cache with 1 .. --threads threads (the streaming loop of the
    bound), and the latency of dependent loads (a random cycle over the buffer's cache lines), each on
    every CPU the process may run on (pinned in turn). Buffer on 2 MiB pages where the kernel allows."""
    import numpy as np

    from custom_ops.runtime.memory import huge_zeros_many, thp_mode

    lib = _stream_lib(Path(tempfile.mkdtemp(prefix="ortlean-mem-")))
    nbytes = a.mib << 20
    (buf,) = huge_zeros_many([((nbytes // 8,), np.uint64)])
    lines = nbytes // 64
    perm = np.random.default_rng(0).permutation(lines).astype(np.uint64)
    words = buf.reshape(lines, 8)
    words[perm, 0] = np.roll(perm, -1) * np.uint64(8)  # line perm[i] -> word of line perm[i + 1]
    if lib.chase(buf.ctypes.data, int(perm[0]) * 8, 1) != int(perm[1]) * 8:
        raise SystemExit("memory bench: the chase cycle is not the permutation written")
    cpus = sorted(os.sched_getaffinity(0))
    res = {"mib": a.mib, "thp": thp_mode(), "cpus": cpus, "read_GBps": {}, "read_GBps_per_cpu": {},
           "latency_ns_per_cpu": {}}

    def read_gbps(threads: int) -> float:  # the bound's own timing (_stream_time) over the whole buffer
        ts = [_stream_time(lib, [buf], nbytes, threads) for _ in range(a.repeats)]
        return round(nbytes / statistics.median(ts) / 1e9, 1)

    steps = 2_000_000
    try:
        for cpu in cpus:
            os.sched_setaffinity(0, {cpu})
            res["read_GBps_per_cpu"][str(cpu)] = read_gbps(1)
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                lib.chase(buf.ctypes.data, int(perm[0]) * 8, steps)
                ts.append(time.perf_counter() - t0)
            res["latency_ns_per_cpu"][str(cpu)] = round(statistics.median(ts) / steps * 1e9, 1)
    finally:
        os.sched_setaffinity(0, set(cpus))
    for t in range(1, a.threads + 1):
        res["read_GBps"][str(t)] = read_gbps(t)
    res["gather"] = _gather_rows(lib, buf, a.repeats, res["read_GBps"]["1"])
    print(f"memory: {a.mib} MiB buffer (THP {res['thp']}), medians of {a.repeats} reads")
    for t, g in res["read_GBps"].items():
        print(f"  read, {t} thread{'s' if t != '1' else ''} (unpinned): {g:6.1f} GB/s")
    for cpu in cpus:
        print(f"  cpu {cpu}: read {res['read_GBps_per_cpu'][str(cpu)]:6.1f} GB/s, dependent-load latency "
              f"{res['latency_ns_per_cpu'][str(cpu)]:6.1f} ns")
    g = res["gather"]
    print(f"  gather, 1 thread (unpinned): {g['rows']} random {g['row_bytes']}-byte rows, {g['per_region']} of each "
          f"region's {g['region_rows']} in ascending order ({g['regions']} regions: the op's candidate rows of "
          f"{g['regions']} KV heads at past {g['region_rows']}, budget {g['per_region'] / g['region_rows']:.4g}; "
          "fresh regions every pass)")
    for ahead, r in g["ahead"].items():
        print(f"    prefetch {ahead:>2} rows ahead: {r['ns_per_row']:5.2f} ns/row = {r['GBps']:5.1f} GB/s of row bytes, "
              f"{r['vs_stream']:.2f}x the time to stream those bytes at {res['read_GBps']['1']} GB/s")
    return res


def _gather_rows(lib, buf, repeats: int, stream_gbps: float, region_rows: int = 4096, per_region: int = 768,
                 row_bytes: int = 128, regions: int = 30) -> dict:
    """The fastest a gather of PackedAttention's candidate rows can go on one thread: ``regions`` regions
    of ``region_rows`` rows (a KV head's cache), ``per_region`` random rows of each in ascending order
    (the op's candidate list), read whole with software prefetch 0 / 8 / 16 / 32 / 64 / 128 rows ahead (32: the kernel's
    distance, kPfList); medians of up to 4 passes after an untimed one. Every pass takes fresh regions
    of the buffer, so no row is cached."""
    import numpy as np

    rng = np.random.default_rng(1)
    span = region_rows * row_bytes
    slots = buf.nbytes // span
    aheads = (0, 8, 16, 32, 64, 128)
    passes = 1 + min(repeats, 4)  # the first untimed
    if slots < regions * passes * len(aheads):
        raise SystemExit(f"memory bench: --mib too small for {passes * len(aheads)} gather passes of fresh regions")
    order = rng.permutation(slots)
    out = {"rows": regions * per_region, "row_bytes": row_bytes, "region_rows": region_rows,
           "per_region": per_region, "regions": regions, "ahead": {}}
    k = 0
    for ahead in aheads:
        ts = []
        for rep in range(passes):
            starts = order[k * regions:(k + 1) * regions].astype(np.uint64) * np.uint64(span)
            k += 1
            rows = np.sort(np.stack([rng.choice(region_rows, per_region, replace=False) for _ in range(regions)]), axis=1)
            offs = (starts[:, None] + rows.astype(np.uint64) * np.uint64(row_bytes)).reshape(-1)
            offs = np.ascontiguousarray(offs)
            t0 = time.perf_counter()
            lib.gather_rows(buf.ctypes.data, offs.ctypes.data, offs.size, row_bytes, ahead)
            if rep:
                ts.append(time.perf_counter() - t0)
        t = statistics.median(ts)
        nbytes = offs.size * row_bytes
        out["ahead"][str(ahead)] = {"ns_per_row": round(t / offs.size * 1e9, 2), "GBps": round(nbytes / t / 1e9, 1),
                                    "vs_stream": round((t / offs.size * 1e9) / (row_bytes / stream_gbps), 2)}
    return out


def _stream_lib(tmp: Path):
    import ctypes
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise SystemExit("decode bench: no C compiler for the streaming bound (tests/bench/attn_stream.c)")
    so = tmp / "attn_stream.so"
    subprocess.run([cc, "-O3", "-mavx2", "-shared", "-fPIC", "-pthread", str(ROOT / "tests" / "bench" / "attn_stream.c"),
                    "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    lib.stream_read.restype = ctypes.c_uint64
    lib.stream_read.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t]
    lib.stream_read_mt.restype = ctypes.c_uint64
    lib.stream_read_mt.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
    lib.stream_read4.restype = ctypes.c_uint64
    lib.stream_read4.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t,
                                 ctypes.c_size_t]
    lib.stream_read4_mt.restype = ctypes.c_uint64
    lib.stream_read4_mt.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_size_t, ctypes.c_int,
                                    ctypes.c_size_t]
    lib.stream_sync_mt.restype = ctypes.c_uint64
    lib.stream_sync_mt.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_size_t, ctypes.c_int,
                                   ctypes.c_size_t]
    lib.chase.restype = ctypes.c_uint64
    lib.chase.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    lib.gather_rows.restype = ctypes.c_uint64
    lib.gather_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t]
    return lib


def _flush(lib, buf) -> None:
    """Read buf (larger than the last-level cache) so the next run finds none of its bytes cached."""
    import ctypes

    ptrs = (ctypes.c_void_p * 1)(buf.ctypes.data)
    lib.stream_read(ptrs, 1, 0, buf.nbytes // 8)


def _stream_time(lib, arrays, nbytes: int, threads: int) -> float:
    """Seconds to read the first nbytes of every array (threads split each array's range; timed in C
    from the moment the threads are up to the last one's finish, thread start-up not timed)."""
    import ctypes

    ptrs = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
    words = nbytes // 8
    if threads <= 1:
        t0 = time.perf_counter()
        lib.stream_read(ptrs, len(arrays), 0, words)
        return time.perf_counter() - t0
    return lib.stream_read_mt(ptrs, len(arrays), words, threads) * 1e-9


def bench_decode(a) -> dict:
    """One decode step of attention alone at each past length (module docstring)."""
    if a.phases:  # read by each PackedAttention kernel at construction
        os.environ["ORTLEAN_PHASE_TIMES"] = "1"
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto as TP, helper

    import custom_ops
    from custom_ops.reference.attn import cache_bits_words, kv_row_words
    from custom_ops.runtime.bench import settle
    from custom_ops.runtime.memory import huge_zeros_many, thp_mode

    Hq, Hkv, D, L = 9, 3, 64, a.layers
    tmp = Path(tempfile.mkdtemp(prefix="ortlean-attnd-"))
    lib = _stream_lib(tmp)
    rng = np.random.default_rng(0)
    flush_buf = np.ones(8 << 20, np.uint64) if a.threads > 1 else None  # 64 MB: twice a 32 MB L3

    def vi(n, t=TP.FLOAT):
        return helper.make_tensor_value_info(n, t, None)

    def model(nodes, ins, outs, ms=False):
        ops = [helper.make_opsetid("", 18), helper.make_opsetid("ai.ortlean", 1)]
        if ms:
            ops.append(helper.make_opsetid("com.microsoft", 1))
        m = helper.make_model(helper.make_graph(nodes, "g", ins, outs), opset_imports=ops)
        m.ir_version = 10
        return m.SerializeToString()

    def gqa_model():
        nodes, ins, outs = [], [vi("query"), vi("key"), vi("value"), vi("seqlens_k", TP.INT32),
                                vi("total_sequence_length", TP.INT32)], []
        for i in range(L):
            ins += [vi(f"pk{i}"), vi(f"pv{i}")]
            outs += [vi(f"y{i}"), vi(f"k{i}"), vi(f"v{i}")]
            nodes.append(helper.make_node("GroupQueryAttention", ["query", "key", "value", f"pk{i}", f"pv{i}",
                                                                  "seqlens_k", "total_sequence_length"],
                                          [f"y{i}", f"k{i}", f"v{i}"], domain="com.microsoft", num_heads=Hq,
                                          kv_num_heads=Hkv, scale=D ** -0.5))
        return model(nodes, ins, outs, ms=True)

    # --mode pq: PackedAttention scores pq key codes (random codebook: the speed does not depend on it)
    pq_attrs = dict(mode="pq", pq_book=[float(x) for x in rng.standard_normal(Hkv * (D // 4) * 16 * 4)]) \
        if a.mode == "pq" else {}

    def packed_model(kvq, budget):
        nodes, ins, outs = [], [vi("Q"), vi("K"), vi("V"), vi("seqlens_k", TP.INT32)], []
        for i in range(L):
            ins += [vi(f"pb{i}", TP.INT32), vi(f"pkv{i}", TP.INT32)]
            outs += [vi(f"y{i}"), vi(f"b{i}", TP.INT32), vi(f"kv{i}", TP.INT32)]
            nodes.append(helper.make_node("PackedAttention", ["Q", "K", "V", "", f"pb{i}", f"pkv{i}", "seqlens_k"],
                                          [f"y{i}", f"b{i}", f"kv{i}"], domain="ai.ortlean", name=f"pa{i}",
                                          scale=D ** -0.5, kv_quant=kvq, budget=float(budget), window=a.window,
                                          min_context=a.min_context, **pq_attrs))
        return model(nodes, ins, outs)

    res = {"threads": a.threads, "isa": custom_ops.isa_label(), "layers": L, "shape": dict(Hq=Hq, Hkv=Hkv, D=D),
           "window": a.window, "min_context": a.min_context, "thp": thp_mode(), "pasts": {}}
    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    so.inter_op_num_threads = 1
    gqa = ort.InferenceSession(gqa_model(), so, providers=["CPUExecutionProvider"])
    configs = [(kvq, float(b)) for kvq in a.kv.split(",") for b in a.budgets.split(",")]
    packed = {("", *c): custom_ops.session(packed_model(*c), threads=a.threads) for c in configs}
    if a.lib_a:
        so_a = ort.SessionOptions()
        so_a.intra_op_num_threads, so_a.inter_op_num_threads = a.threads, 1
        so_a.register_custom_ops_library(str(Path(a.lib_a).resolve()))
        for c in configs:
            packed[("A:", *c)] = ort.InferenceSession(packed_model(*c), so_a, providers=["CPUExecutionProvider"])
    # --hugepages: every row again with its layers' caches in one mapping on 2 MiB pages (rows "hp:…",
    # same run, interleaved; as runtime.shared_kv allocates them)
    page_modes = [False, True] if a.hugepages else [False]

    def place(arr, pool):  # pool: None (the array as made) or an iterator of huge-page arrays
        if pool is None:
            return arr
        out = next(pool)
        out[...] = arr
        return out

    for past in [int(x) for x in a.pasts.split(",")]:
        cap = past + 1
        runs, bytes_read, arrays = {}, {}, {}
        bufs = []  # the arrays behind the bound OrtValues (kept alive)
        for pages in page_modes:
            pre = "hp:" if pages else ""
            # GroupQueryAttention, fp32 cache, one buffer per layer for past and present
            bnd = gqa.io_binding()
            q = rng.standard_normal((1, 1, Hq * D), dtype=np.float32)
            k = rng.standard_normal((1, 1, Hkv * D), dtype=np.float32)
            bnd.bind_cpu_input("query", q)
            bnd.bind_cpu_input("key", k)
            bnd.bind_cpu_input("value", k.copy())
            bnd.bind_cpu_input("seqlens_k", np.array([past], np.int32))
            bnd.bind_cpu_input("total_sequence_length", np.array([past + 1], np.int32))
            gq = []
            pool = iter(huge_zeros_many([((1, Hkv, cap, D), np.float32)] * (2 * L))) if pages else None
            for i in range(L):
                for nm, out in ((f"pk{i}", f"k{i}"), (f"pv{i}", f"v{i}")):
                    arr = place(rng.standard_normal((1, Hkv, cap, D), dtype=np.float32), pool)
                    ov = ort.OrtValue.ortvalue_from_numpy(arr)
                    gq.append((arr, ov))
                    bnd.bind_ortvalue_input(nm, ov)
                    bnd.bind_ortvalue_output(out, ov)
                bnd.bind_output(f"y{i}")
            runs[pre + "gqa_fp32"] = (gqa, bnd)
            bytes_read[pre + "gqa_fp32"] = 2 * Hkv * cap * D * 4
            arrays[pre + "gqa_fp32"] = [(b[0], Hkv * cap * D * 4) for b in gq]
            bufs.append(gq)
            for (tag, kvq, budget), s in packed.items():
                name = f"{pre}{tag}packed_{kvq}_b{budget:g}"
                R, W = kv_row_words(D, D, kvq), cache_bits_words(D, a.mode)
                bnd = s.io_binding()
                bnd.bind_cpu_input("Q", rng.standard_normal((1, Hq, 1, D), dtype=np.float32))
                bnd.bind_cpu_input("K", rng.standard_normal((1, Hkv, 1, D), dtype=np.float32))
                bnd.bind_cpu_input("V", rng.standard_normal((1, Hkv, 1, D), dtype=np.float32))
                bnd.bind_cpu_input("seqlens_k", np.array([past], np.int32))
                kvs = []
                pool = iter(huge_zeros_many([((1, Hkv, cap, R), np.int32), ((1, Hkv, cap, W), np.int32)] * L)) \
                    if pages else None
                for i in range(L):
                    kv = rng.integers(-2**31, 2**31 - 1, size=(1, Hkv, cap, R), dtype=np.int64).astype(np.int32)
                    kv.view(np.uint8).reshape(1, Hkv, cap, R * 4)[..., :] &= 0x3F  # small codes, finite scales
                    bits = rng.integers(-2**31, 2**31 - 1, size=(1, Hkv, cap, W), dtype=np.int64).astype(np.int32)
                    if a.mode != "pq":  # gamma (pq rows have none)
                        bits[..., -3] = np.float32(0.8).view(np.int32)
                    bits[..., -2:] = np.float32(0.01).view(np.int32)      # the row's K / V scales
                    kv, bits = place(kv, pool), place(bits, pool)
                    ov_kv, ov_b = ort.OrtValue.ortvalue_from_numpy(kv), ort.OrtValue.ortvalue_from_numpy(bits)
                    kvs.append((kv, bits, ov_kv, ov_b))
                    bnd.bind_ortvalue_input(f"pkv{i}", ov_kv)
                    bnd.bind_ortvalue_output(f"kv{i}", ov_kv)
                    bnd.bind_ortvalue_input(f"pb{i}", ov_b)
                    bnd.bind_ortvalue_output(f"b{i}", ov_b)
                    bnd.bind_output(f"y{i}")
                runs[name] = (s, bnd)
                approx = 0 < budget < 1 and cap > a.min_context and max(64, int(np.ceil(budget * cap))) < cap
                ncand = max(64, int(np.ceil(budget * cap))) if approx else cap
                # every key's bits row (its scales: the exact path reads those of all keys; the lines are
                # read whole), the selected keys' code rows
                bytes_read[name] = Hkv * (cap * W * 4 + ncand * R * 4)
                arrays[name] = [(x[0], Hkv * ncand * R * 4) for x in kvs] + [(x[1], Hkv * cap * W * 4) for x in kvs]
                bufs.append(kvs)
        names = list(runs)
        times = {n: [] for n in names}
        stream = {n: [] for n in names}
        phases = {n: [] for n in names}  # --phases: the op's phase times (µs per layer op) of each timed run
        for r in range(a.repeats + 2):
            order = names[r % len(names):] + names[: r % len(names)]
            for n in order:
                s, bnd = runs[n]
                if a.threads > 1:
                    # every session owns an intra-op pool whose workers spin for tens of ms after a Run
                    # (custom_ops.runtime.bench.settle): timed right after another session, a run shared
                    # the cores with that spinning worker (2-thread GQA timed at 2x its 1-thread time).
                    # So: a pause, an untimed run (this session's pool awake), the CPU caches flushed
                    # (the untimed run left this session's bytes in L3), then the timed run.
                    settle(a.threads)
                    s.run_with_iobinding(bnd)
                    _flush(lib, flush_buf)
                own = a.phases and "packed" in n and "A:" not in n  # the --lib-a build keeps its own metrics
                if own:
                    custom_ops.reset_metrics()
                t0 = time.perf_counter()
                s.run_with_iobinding(bnd)
                dt = time.perf_counter() - t0
                if own and r >= 2:
                    phases[n].append(_phase_times(custom_ops.metrics(), L))
                # the bytes of every layer: GQA's two arrays (K, V), a packed layer's code rows and bits rows
                if a.threads > 1:
                    _flush(lib, flush_buf)
                ts = sum(_stream_time(lib, [x for x, nb in arrays[n] if nb == k], k, a.threads)
                         for k in sorted({nb for _, nb in arrays[n]}))
                if r >= 2:
                    times[n].append(dt / L)
                    stream[n].append(ts / L)
        row = {}
        g = statistics.median(times["gqa_fp32"])
        for n in names:
            t, sb = statistics.median(times[n]), statistics.median(stream[n])
            row[n] = {"us": round(t * 1e6, 1), "bytes": bytes_read[n], "stream_us": round(sb * 1e6, 1),
                      "vs_stream": round(t / sb, 2), "speedup_vs_gqa": round(g / t, 2),
                      "GBps_stream": round(bytes_read[n] / sb / 1e9, 1)}
            print(f"past {past:5d} {n:24s} {t * 1e6:8.1f} us/op  x{g / t:5.2f} vs GQA  reads {bytes_read[n] / 1e3:8.1f} kB"
                  f"  stream {sb * 1e6:7.1f} us  op/stream {t / sb:5.2f}  [{res['isa']}, {a.threads} thr]", flush=True)
            if phases[n]:
                ph = {k: round(statistics.median(x[k] for x in phases[n]), 2) for k in phases[n][0]}
                row[n]["phases_us"] = ph
                print(f"           {'':24s} phases, us/op (medians): " + "  ".join(f"{k} {v:.1f}" for k, v in ph.items()),
                      flush=True)
        res["pasts"][str(past)] = row
        del bufs, runs, arrays
    return res


def _phase_times(m: dict, layers: int) -> dict:
    """PackedAttention's phase times (ORTLEAN_PHASE_TIMES=1 metrics time.*_us summed over the nodes) per
    layer op of one run."""
    keys = ("inputs", "store", "score", "select", "attend", "total")
    return {k: sum(v.get(f"time.{k}_us", 0.0) for v in m.values()) / layers for k in keys}


def bench_prefill(a) -> dict:
    """One PackedAttention node's prompt chunk (--chunk rows) after a cached past of each of --pasts
    rows, int8 rows (--kv), GQA shapes (--shape qwen: 12 query heads, 2 KV heads, head dim 128;
    smollm2: 9, 3, 64): the exact prompt path (budget 0: prefill_gemm below 2,048 keys of context, the
    chunked online softmax from there on) and the sparse prefill at each of
    --budgets (prefill_sparse; budget "exact" = its own path with every tile exact: the kernel's
    cost without selection), interleaved rounds, medians; the time per chunk, the attention FLOPs it
    did (QK and PV of the keys attended, 4 · heads · D per key and row) per second, and the
    attended fraction (the op's pack.prefill_attended over pack.prefill_keys)."""
    import numpy as np

    import custom_ops
    from custom_ops.reference.attn import pack_cache
    from test_packed_gqa import kv_model

    Hq, Hkv, D = {"qwen": (12, 2, 128), "smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}[a.shape]
    M, q = a.chunk, a.kv.split(",")[0]
    rng = np.random.default_rng(0)
    res = {"shape": a.shape, "heads": [Hq, Hkv, D], "chunk": M, "kv": q, "threads": a.threads,
           "isa": custom_ops.isa_label(), "block": a.block, "window": a.window, "rows": []}
    for past in [int(x) for x in a.pasts.split(",")]:
        Kp = rng.standard_normal((1, Hkv, past, D), dtype=np.float32)
        Vp = rng.standard_normal((1, Hkv, past, D), dtype=np.float32)
        bits, rows = pack_cache(Kp, Vp, q)
        feed = {"Q": rng.standard_normal((1, Hq, M, D), dtype=np.float32),
                "K": rng.standard_normal((1, Hkv, M, D), dtype=np.float32),
                "V": rng.standard_normal((1, Hkv, M, D), dtype=np.float32), "past_bits": bits, "past_kv": rows}
        variants = {"exact (budget 0)": {}}
        for b in a.budgets.split(","):
            if b == "exact":
                variants["sparse path, exact tiles"] = dict(prefill_budget=0.5, prefill_min_context=1 << 30)
            else:
                variants[f"sparse {b}"] = dict(prefill_budget=float(b), prefill_min_context=0)
        sess = {}
        for i, (name, extra) in enumerate(variants.items()):
            attrs = dict(kv_quant=q, scale=float(D) ** -0.5, sinks=4, prefill_block=a.block, prefill_window=a.window,
                         **extra)
            sess[name] = (custom_ops.session(kv_model(attrs, use=tuple(feed), outs=3, name=f"pf{i}_{past}"),
                                             threads=a.threads), f"pf{i}_{past}")
        times = {n: [] for n in sess}
        for r in range(a.repeats + 1):
            names = list(sess)
            for n in names[r % len(names):] + names[:r % len(names)]:
                s, node = sess[n]
                t0 = time.perf_counter()
                s.run(None, feed)
                if r:
                    times[n].append(time.perf_counter() - t0)
        met = custom_ops.metrics()
        for n, (s, node) in sess.items():
            med = statistics.median(times[n])
            m = met.get(node, {})
            frac = (m.get("pack.prefill_attended", 0) / m["pack.prefill_keys"]) if m.get("pack.prefill_keys") else 1.0
            keys = sum(past + i + 1 for i in range(M)) * frac
            flops = 4.0 * Hq * D * keys
            row = {"past": past, "variant": n, "ms": round(med * 1e3, 2), "attended": round(frac, 4),
                   "GFLOPs": round(flops / med / 1e9, 1), "tok_s": round(M / med, 1)}
            res["rows"].append(row)
            print(f"past {past:6d} {n:26s} {row['ms']:9.2f} ms/chunk of {M}  attended {frac:6.3f}  "
                  f"{row['GFLOPs']:7.1f} GFLOP/s  {row['tok_s']:8.1f} rows/s", flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["op", "model", "decode", "memory", "prefill"])
    ap.add_argument("--shape", choices=["qwen", "smollm2", "gemma3"], default="qwen", help="prefill: the heads")
    ap.add_argument("--chunk", type=int, default=512, help="prefill: prompt rows per call")
    ap.add_argument("--block", type=int, default=64, help="prefill: prefill_block")
    ap.add_argument("--mib", type=int, default=512, help="memory: the buffer's size (MiB)")
    ap.add_argument("--pasts", default="128,4096")
    ap.add_argument("--kv", default="int8,int4")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--min-context", type=int, default=256)
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
    ap.add_argument("--phases", action="store_true",
                    help="decode: also PackedAttention's phase times per op (inputs, store, score, select, attend; "
                    "the op's ORTLEAN_PHASE_TIMES metrics, medians over the timed runs)")
    ap.add_argument("--hugepages", action="store_true",
                    help="decode: also time every row with its caches on 2 MiB pages (rows hp:...)")
    ap.add_argument("--mode", choices=["sign", "pq"], default="sign",
                    help="decode: PackedAttention's key codes (pq: a random codebook)")
    ap.add_argument("--lib-a", help="decode: also time PackedAttention on this build of libortlean_ops.so")
    a = ap.parse_args(argv)
    if a.what == "prefill":
        a.budgets = a.budgets if a.budgets != "0,0.125,0.25,0.5" else "exact,0.25,0.125"
        a.window = a.window if a.window != 64 else 1024
        a.pasts = a.pasts if a.pasts != "128,4096" else "4096,16384,32256"
        a.kv = a.kv if a.kv != "int8,int4" else "int8"
        a.repeats = a.repeats if a.repeats != 30 else 3
    res = {"op": bench_op, "model": bench_model, "decode": bench_decode, "memory": bench_memory,
           "prefill": bench_prefill}[a.what](a)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
