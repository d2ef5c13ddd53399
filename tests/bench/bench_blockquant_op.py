"""BlockQuantMatMul alone: every block format at the decode (M = 1) and prefill (M = 128) shapes, against
the time to stream the same bytes from DRAM and against ONNX Runtime's MatMulNBits (int4, symmetric,
block 32, accuracy_level 4) on the same shape.

    python tests/bench/bench_blockquant_op.py [--formats q4_0,q4_1,...] [--shapes 576x1536,...]
        [--threads 1,2] [--act-bits 8,16] [--mib N] [--llc-x 4] [--min-time 0.3] [--no-prefill]
        [--no-in-cache] [--json FILE]

Shapes are K x N (inputs x outputs): SmolLM2's 576x576, 576x1536, 1536x576 and its 576x49152 head, and
1536x8960 / 8960x1536. Formats: the ggml ones and q4_f at blocks 32 and 64 (HQQ's usual group).

M = 1, from DRAM: a model holds L independent layers of the shape (their own random, valid blocks; one
input), L chosen so that their bytes exceed the layer set size: by default --llc-x (4) times the
last-level cache that sysfs reports for cpu0 (/sys/devices/system/cpu/cpu0/cache, the highest level),
capped so that the models, the MatMulNBits twin and the streaming buffers fit in a sixth of MemAvailable
each (--mib sets it in MiB instead). One Run reads every layer's weights once, from DRAM; us per layer
= median Run time / L (the input and the L outputs bound once with IOBinding, so a Run allocates
nothing). The streaming bound is the faster of two C loops reading the same number of
bytes from L buffers of the layer's size with the same threads, timed in the same rounds as the runs:
tests/bench/attn_stream.c's sequential loop and a loop of four interleaved streams with software
prefetch (both in C, threads timed from the moment they are up); bound_x = op time / streaming time
(target <= 1.25). The header prints the LLC size, the layer set size and the streaming rate over one
set-sized buffer. MatMulNBits runs on the same shape with its own L layers (4 bits + an fp32 scale per
32 weights); vs_mnb = MatMulNBits time / op time (target >= 1.2).

M = 1, in cache (--no-in-cache skips it): L nodes share one W, so a Run reads the same bytes L times
from the core's caches (the layer must fit its L2): the kernel's own rate, GB/s of weight bytes.
node = the time of one node of the same K and 16 rows (W in cache; 256 nodes a Run): what a layer costs
besides its bytes -- ONNX Runtime's work per node, the op's activation quantization and, at > 1 thread,
one parallel section of 2 tasks on ORT's pool. (stream + node) / stream is the least bound_x a kernel
that streams its bytes perfectly could show in this model of 1 node a layer.
sync_x (> 1 thread): the stream loops again, every thread waiting at a spin barrier for the others after
its share of each layer (tests/bench/attn_stream.c's stream_sync_mt), over the free-running stream: what
one synchronization per layer costs pure streaming (shares restart cold, the faster thread waits) --
a runtime that runs a node at a time across its threads pays it besides the node column.
The compute floor (1 thread, AVX-512 VNNI machines; the C loops of tests/bench/bq_floor.c, same rounds as
the in-cache runs, the same number of bytes read as often from the caches): floor_int = only the integer
dots of 4-bit weights (and, shift, and, two vpdpbusd per 64 bytes), floor = those plus the per-lane float
scale (to float, vpermps, FMA). No kernel of the op's numerics does less per vector than floor; the op's
in-cache rate over floor's says how much of its time goes to the rest (block headers, scales, layout).

M = 128 (--prefill-m): one layer per model (compute-bound), op vs MatMulNBits (target >= 1), and of_peak:
its multiply-adds per second over the int8 peak of the ISA the op runs at on this CPU (AVX-512 VNNI's
vpdpbusd, or AVX2's vpmaddubsw + vpmaddwd), computed from the core's measured clock and that dot's
measured throughput (tests/bench/int8_peak.c), times the threads; the header prints the peak (issue 58:
>= 70 % at M = 512 on AVX-512 VNNI, >= 60 % on AVX2). --act-bits 8,16 times both activation precisions
(the act column). Sessions take turns in blocks of timed runs after an
untimed one, with a pause between sessions at > 1 thread (custom_ops.runtime.bench.settle: a pool's
threads spin after a Run).

The header names the ISA the op runs at (custom_ops.isa_label()), the CPU model, the commit, the date
and the load average; --json writes the same. Do not time on a machine others are using: the figures
are memory-bound.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "bench"))

import numpy as np  # noqa: E402

SHAPES = [(576, 576), (576, 1536), (1536, 576), (576, 49152), (1536, 8960), (8960, 1536)]
FORMATS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_K", "q5_K", "q6_K", "q4_f/32", "q4_f/64"]
OPSET, IR = 17, 10


# the node column: NODE_LAYERS nodes of K x NODE_ROWS on one W
NODE_ROWS, NODE_LAYERS = 16, 256


def _size_bytes(text: str) -> int:
    """sysfs cache sizes: '48K', '2048K', '260M' -> bytes."""
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(t.rstrip("KMG")) * mult


def llc() -> dict:
    """The last-level cache cpu0 sees (the highest level in /sys/devices/system/cpu/cpu0/cache): its
    level, size in bytes and how many CPUs share it; {} when sysfs does not say."""
    best: dict = {}
    for d in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = int((d / "level").read_text())
            if (d / "type").read_text().strip() == "Instruction":
                continue
            size = _size_bytes((d / "size").read_text())
            shared = (d / "shared_cpu_list").read_text().strip()
        except (OSError, ValueError):
            continue
        if not best or level > best["level"]:
            best = {"level": level, "bytes": size, "shared_cpus": shared}
    return best


def mem_available() -> int:
    """MemAvailable (bytes) from /proc/meminfo; 0 when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def set_size(mib: int | None, llc_x: float) -> tuple[int, str]:
    """Bytes of one M = 1 layer set and why: --mib, else llc_x times the LLC, capped at a sixth of
    MemAvailable (the op's layers, their serialized model, MatMulNBits' layers and the streaming
    buffers live at once)."""
    if mib:
        return mib << 20, f"--mib {mib}"
    c = llc()
    if not c:
        return 1 << 30, "1 GiB (no LLC size in sysfs)"
    want = int(llc_x * c["bytes"])
    avail = mem_available()
    if avail and want > avail // 6:
        return avail // 6, (f"{avail // 6 >> 20} MiB: a sixth of MemAvailable, short of {llc_x:g} x the "
                            f"{c['bytes'] >> 20} MiB LLC")
    return want, f"{llc_x:g} x the {c['bytes'] >> 20} MiB L{c['level']} cache"


STREAM4_PREFETCH = 4096


def _stream_best(libs, arrays, nbytes: int, threads: int) -> float:
    """Seconds to read the first nbytes of every array: the faster of attn_stream.c's sequential loop
    and the four-stream prefetching loop (the bound is the best way found to read the bytes)."""
    import ctypes

    from attn_speed import _stream_time

    ptrs = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
    t4 = libs.stream_read4_mt(ptrs, len(arrays), nbytes // 8, threads, STREAM4_PREFETCH) * 1e-9
    return min(_stream_time(libs, arrays, nbytes, threads), t4)


def _stream_sync_best(libs, arrays, nbytes: int, threads: int) -> float:
    """_stream_best's two loops with every thread waiting for the others after each array (a spin
    barrier: one synchronization per layer, as a runtime that runs a node at a time)."""
    import ctypes

    ptrs = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
    return min(libs.stream_sync_mt(ptrs, len(arrays), nbytes // 8, threads, pf) for pf in (0, STREAM4_PREFETCH)) * 1e-9


def machine() -> dict:
    import custom_ops
    import onnxruntime as ort

    from rewriter import results

    head, dirty = results.git_commit()
    commit = head[:7] + ("+dirty" if dirty else "") if head else "?"

    return {"cpu": results.machine()["cpu"], "cores": os.cpu_count(), "isa": custom_ops.isa_label(),
            "onnxruntime": ort.__version__,
            "commit": commit, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "load_average": [round(x, 2) for x in os.getloadavg()], "llc": llc(),
            "mem_available_bytes": mem_available()}


def _fmt(spec: str) -> tuple[str, int | None]:
    f, _, b = spec.partition("/")
    return f, (int(b) if b else None)


def _bq_model(K, N, fmt, bs, L, rng, act_bits=8, shared=False, layout="blocks") -> tuple[bytes, int]:
    """L BlockQuantMatMul layers on one input (shared: all on one W, read L times from the caches) in
    W's row layout `layout` (blocks | split); (model, bytes of one layer's W)."""
    from onnx import TensorProto, helper, numpy_helper

    from custom_ops.reference import blockquant as bq

    nodes, inits, outs = [], [], []
    for i in range(L):
        if not shared or i == 0:
            W = bq.random_blocks(fmt, N, K, rng, bs)
            inits.append(numpy_helper.from_array(bq.to_split(W, fmt, K, bs) if layout == "split" else W, f"W{i}"))
        a = dict(format=fmt, K=K, N=N)
        if layout != "blocks":
            a["layout"] = layout
        if bs:
            a["block_size"] = bs
        if act_bits != 8:
            a["act_bits"] = act_bits
        nodes.append(helper.make_node("BlockQuantMatMul", ["X", "W0" if shared else f"W{i}"], [f"Y{i}"], name=f"bq{i}",
                                      domain="ai.ortlean", **a))
        outs.append(helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, ["M", N]))
    g = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", K])], outs,
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("ai.ortlean", 1)])
    m.ir_version = IR
    return m.SerializeToString(), bq.row_bytes(fmt, K, bs) * N


def _mnb_model(K, N, L, rng) -> tuple[bytes, int]:
    """L com.microsoft.MatMulNBits layers (int4, block 32, symmetric, accuracy_level 4), random bytes."""
    from onnx import TensorProto, helper, numpy_helper

    blk, nblk = 32, -(-K // 32)
    nodes, inits, outs = [], [], []
    for i in range(L):
        B = rng.integers(0, 256, (N, nblk, blk // 2), dtype=np.uint8)
        sc = rng.uniform(0.001, 0.01, (N * nblk,)).astype(np.float32)
        inits += [numpy_helper.from_array(B, f"B{i}"), numpy_helper.from_array(sc, f"S{i}")]
        nodes.append(helper.make_node("MatMulNBits", ["X", f"B{i}", f"S{i}"], [f"Y{i}"], name=f"mnb{i}",
                                      domain="com.microsoft", K=K, N=N, bits=4, block_size=blk, accuracy_level=4))
        outs.append(helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, ["M", N]))
    g = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", K])], outs,
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = IR
    return m.SerializeToString(), N * nblk * (blk // 2 + 4)


def _session(model: bytes, threads: int, ours: bool):
    import onnxruntime as ort

    import custom_ops

    if ours:
        return custom_ops.session(model, threads=threads)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _time_rounds(jobs: dict, min_time: float, threads: int, block: int = 3) -> dict[str, float]:
    """Median seconds of each job (a callable), taking turns in blocks of `block` timed calls after an
    untimed one, for at least min_time per job and 4 rounds."""
    from custom_ops.runtime.bench import settle

    times = {k: [] for k in jobs}
    t_end = time.perf_counter() + min_time * len(jobs)
    rounds = 0
    while rounds < 4 or (time.perf_counter() < t_end and rounds < 200):
        for name, job in jobs.items():
            settle(threads)
            for i in range(block + 1):
                t = job()
                if i:
                    times[name].append(t)
        rounds += 1
    return {k: statistics.median(v) for k, v in times.items()}


def _floor_lib(tmp: Path):
    """tests/bench/bq_floor.c built for AVX-512 VNNI with the system C compiler, or None (and why) when this
    CPU lacks it or there is no compiler."""
    import ctypes
    import shutil

    from rewriter import results

    if not {"avx512f", "avx512bw", "avx512_vnni"} <= set(results.machine()["flags"]):
        return None, "the CPU has no AVX-512 VNNI"
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler"
    so = tmp / "bq_floor.so"
    subprocess.run([cc, "-O2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-shared", "-fPIC",
                    str(ROOT / "tests" / "bench" / "bq_floor.c"), "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    lib.bq_floor_ns.restype = ctypes.c_double
    lib.bq_floor_ns.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    return lib, ""


def _floor_jobs(lib, N: int, layer_bytes: int, reps: int, rng) -> tuple[dict, int]:
    """The floor loops over a W of the layer's shape (rows of the layer's bytes rounded up to 64, N rounded
    down to 4 rows), reps passes per call as the in-cache twin's nodes: jobs and the bytes one call reads."""
    rb = -(-(layer_bytes // N) // 64) * 64
    rows = max(4, N // 4 * 4)
    W = rng.integers(0, 256, rows * rb, dtype=np.uint8)
    xl, xh = (rng.integers(-128, 128, rb, dtype=np.int8) for _ in range(2))
    lanes = (np.arange(16, dtype=np.int32) * 5) % 16

    def job(mode):
        def run():
            return lib.bq_floor_ns(W.ctypes.data, rows, rb, xl.ctypes.data, xh.ctypes.data, lanes.ctypes.data,
                                   mode, reps) * 1e-9
        run.keep = (W, xl, xh, lanes)
        return run
    return {"floor_int": job(1), "floor": job(2)}, rows * rb * reps


def _runner(sess, feeds):
    """A timed Run with the input and every output bound once (IOBinding): a model of L layers has L
    outputs, and sess.run would allocate and wrap L new arrays per Run, time the op does not spend in a
    model (q4_1 576x1536, 1,000 layers, M = 1: 76 vs 65 us per layer at 1 thread, 59 vs 52 at 2)."""
    outs = sess.run(None, feeds)
    bind = sess.io_binding()
    for k, v in feeds.items():
        bind.bind_cpu_input(k, v)
    for o, a in zip(sess.get_outputs(), outs):
        bind.bind_output(o.name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)

    def run():
        t0 = time.perf_counter()
        sess.run_with_iobinding(bind)
        return time.perf_counter() - t0
    run.outputs = outs  # the bound buffers live as long as the runner
    return run


def bench_decode(K, N, fmt, bs, threads, set_bytes, min_time, libs, rng, act_bits=(8,), in_cache=True,
                 floor=None, layout="blocks") -> list[dict]:
    from custom_ops.reference import blockquant as bq

    layer_bytes = bq.row_bytes(fmt, K, bs) * N
    L = max(2, -(-set_bytes // layer_bytes))
    mL = max(2, -(-set_bytes // (N * -(-K // 32) * 20)))
    mnb, mlb = _mnb_model(K, N, mL, rng)
    x = {"X": rng.standard_normal((1, K)).astype(np.float32)}
    rows = []
    for ab in act_bits:
        model, lb = _bq_model(K, N, fmt, bs, L, rng, ab, layout=layout)
        # the in-cache twin: enough nodes on one W for a Run of ~1 ms of weight bytes at 20 GB/s
        cL = max(4, min(256, (20 << 20) // max(lb, 1)))
        cache_model = _bq_model(K, N, fmt, bs, cL, rng, ab, shared=True, layout=layout)[0] if in_cache else None
        node_model = _bq_model(K, NODE_ROWS, fmt, bs, NODE_LAYERS, rng, ab, shared=True, layout=layout)[0] \
            if in_cache else None
        bufs = [np.ones(lb // 8 + 8, np.uint64) for _ in range(L)]
        for th in threads:
            s_op, s_mnb = _session(model, th, True), _session(mnb, th, False)
            s_c = _session(cache_model, th, True) if in_cache else None
            s_n = _session(node_model, th, True) if in_cache else None
            for s in (s_op, s_mnb, s_c, s_n):  # first runs (pool probes, allocations) untimed
                for _ in range(3 if s is not None else 0):
                    s.run(None, x)
            jobs = {"op": _runner(s_op, x), "mnb": _runner(s_mnb, x),
                    "stream": lambda: _stream_best(libs, bufs, lb, th)}
            if th > 1:
                jobs["sync"] = lambda: _stream_sync_best(libs, bufs, lb, th)
            fjobs, fbytes = _floor_jobs(floor, N, lb, cL, rng) if floor and in_cache and th == 1 else ({}, 0)
            if in_cache:
                jobs["cache"] = _runner(s_c, x)
                jobs["node"] = _runner(s_n, x)
            jobs.update(fjobs)
            med = _time_rounds(jobs, min_time, th)
            op, stream, mn = med["op"] / L, med["stream"] / L, med["mnb"] / mL
            r = {"format": fmt + (f"/{bs}" if bs else ""), "layout": layout, "K": K, "N": N, "M": 1, "act_bits": ab, "threads": th,
                 "layers": L, "layer_bytes": lb, "op_us": op * 1e6, "stream_us": stream * 1e6,
                 "stream_GBps": lb / stream / 1e9, "op_GBps": lb / op / 1e9, "bound_x": op / stream,
                 "mnb_layers": mL, "mnb_bytes": mlb, "mnb_us": mn * 1e6, "vs_mnb": mn / op}
            if "sync" in med:
                r.update(sync_us=med["sync"] / L * 1e6, sync_x=med["sync"] / med["stream"])
            if in_cache:
                r.update(cache_layers=cL, cache_us=med["cache"] / cL * 1e6, cache_GBps=lb * cL / med["cache"] / 1e9,
                         node_us=med["node"] / NODE_LAYERS * 1e6)
                r["node_bound_x"] = (r["stream_us"] + r["node_us"]) / r["stream_us"]
            if fjobs:
                r.update(floor_int_GBps=fbytes / med["floor_int"] / 1e9, floor_GBps=fbytes / med["floor"] / 1e9)
            rows.append(r)
            del s_op, s_mnb, s_c, s_n
        del model, cache_model, node_model, bufs
    return rows


def _peak_lib(tmp: Path):
    """tests/bench/int8_peak.c built with the system C compiler (each loop carries its target), or None."""
    import ctypes
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    so = tmp / "int8_peak.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", str(ROOT / "tests" / "bench" / "int8_peak.c"), "-o", str(so)],
                   check=True)
    lib = ctypes.CDLL(str(so))
    lib.clock_ns.restype = ctypes.c_double
    lib.clock_ns.argtypes = [ctypes.c_int64]
    lib.peak_ns.restype = ctypes.c_double
    lib.peak_ns.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.mix_ns.restype = ctypes.c_double
    lib.mix_ns.argtypes = [ctypes.c_int, ctypes.c_int64]
    return lib


def int8_peak(lib) -> dict | None:
    """The int8 peak of the ISA BlockQuantMatMul's kernels run at on this CPU, from its measured clock and
    its widest int8 dot's measured throughput (tests/bench/int8_peak.c; best of 5 runs each): GHz, int8
    multiply-adds per cycle per core, and GMAC/s per thread (GOPS = 2 x that). AVX-512 with VNNI:
    vpdpbusd zmm; else AVX2: vpmaddubsw + vpmaddwd + vpaddd (the op's AVX2 path); scalar: none."""
    import custom_ops

    if lib is None:
        return None
    isa = custom_ops.op_isas().get("BlockQuantMatMul", custom_ops.isa())
    flags = set(open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split())
    which = 2 if isa == "avx512" and "avx512_vnni" in flags else 1 if isa in ("avx512", "avx2") else 0
    if not which:
        return None
    n, reps = 20_000_000, 5_000_000
    ghz = max(8 * n / lib.clock_ns(n) for _ in range(5))
    per_ns = max(reps * (12 * 64 if which == 2 else 6 * 32) / lib.peak_ns(which, reps) for _ in range(5))
    mix = None
    if which == 2:  # does the float epilogue compete with vpdpbusd? (int8_peak.c mix_ns)
        mix = {f"8 vpdpbusd + {f} vfmadd231ps": round(min(lib.mix_ns(f, reps) for _ in range(5)) / reps * ghz, 2)
               for f in (0, 4)}
    return {"isa": "AVX-512 VNNI (vpdpbusd zmm)" if which == 2 else "AVX2 (vpmaddubsw + vpmaddwd)",
            "GHz": round(ghz, 2), "macs_per_cycle": round(per_ns / ghz, 1), "GMACps_per_thread": round(per_ns, 1),
            "cycles_per_iteration": mix,
            "how": "tests/bench/int8_peak.c: a chain of dependent adds (the clock) and independent chains of the "
                   "ISA's int8 dot (its throughput), best of 5, 1 thread"}


def bench_prefill(K, N, fmt, bs, threads, min_time, M, rng, act_bits=(8,), layout="blocks", peak=None) -> list[dict]:
    mnb, _ = _mnb_model(K, N, 1, rng)
    x = {"X": rng.standard_normal((M, K)).astype(np.float32)}
    rows = []
    for ab in act_bits:
        model, lb = _bq_model(K, N, fmt, bs, 1, rng, ab, layout=layout)
        for th in threads:
            s_op, s_mnb = _session(model, th, True), _session(mnb, th, False)
            for s in (s_op, s_mnb):
                for _ in range(3):
                    s.run(None, x)
            med = _time_rounds({"op": _runner(s_op, x), "mnb": _runner(s_mnb, x)}, min_time, th)
            row = {"format": fmt + (f"/{bs}" if bs else ""), "layout": layout, "K": K, "N": N, "M": M, "act_bits": ab,
                   "threads": th, "op_us": med["op"] * 1e6, "mnb_us": med["mnb"] * 1e6,
                   "vs_mnb": med["mnb"] / med["op"], "GMACps": M * K * N / med["op"] / 1e9}
            if peak:
                row["of_peak"] = row["GMACps"] / (peak["GMACps_per_thread"] * th)
            rows.append(row)
    return rows


def stream_rates(libs, set_bytes: int, threads) -> dict:
    """GB/s of the streaming bound over one set-sized buffer (median of 5 reads per thread count)."""
    buf = np.ones(set_bytes // 8, np.uint64)
    out = {}
    for th in threads:
        ts = [_stream_best(libs, [buf], buf.nbytes, th) for _ in range(5)]
        out[str(th)] = round(buf.nbytes / statistics.median(ts) / 1e9, 1)
    return out


def table(info: dict, rows: list[dict]) -> str:
    c = info.get("llc") or {}
    out = [f"BlockQuantMatMul op bench — {info['cpu']} ({info['cores']} cores), ISA {info['isa']}, "
           f"onnxruntime {info['onnxruntime']}, commit {info['commit']}, {info['date']}, "
           f"load average {info['load_average']}",
           f"LLC: {c['bytes'] >> 20} MiB (L{c['level']}, cpus {c['shared_cpus']})" if c else "LLC: unknown (no sysfs)"]
    if "set_bytes" in info:
        rates = ", ".join(f"{t} thread{'s' if t != '1' else ''} {g} GB/s" for t, g in info.get("stream_GBps", {}).items())
        out.append(f"M = 1 layer set: {info['set_bytes'] / 2**20:.0f} MiB ({info['set_why']}); streaming a "
                   f"buffer of that size: {rates}")
    dec = [r for r in rows if r["M"] == 1]
    if dec:
        cache = any("cache_GBps" in r for r in dec)
        fl = any("floor_GBps" in r for r in dec)
        sync = any("sync_x" in r for r in dec)
        where = "DRAM" if not c or info.get("set_bytes", 1 << 62) > c["bytes"] else f"the L{c['level']} (the set fits it)"
        out += ["", f"M = 1, weights from {where}: us per layer (Run / layers); stream = the best C loop reading the same "
                "bytes (same threads, same rounds); bound_x = op / stream (<= 1.25); vs_mnb = MatMulNBits / op (>= 1.2)"
                + ("; cache = the same layer read from the caches (GB/s); node = one node of 16 rows (us), "
                   "node_x = (stream + node) / stream" if cache else "")
                + ("; floor_int / floor = the compute floor's loops on those bytes (GB/s, 1 thread)" if fl else "")
                + ("; sync_x = the stream loops with a barrier after each layer / stream (> 1 thread)" if sync else ""),
                f"{'format':>8} {'layout':>6} {'K x N':>11} {'act':>3} {'thr':>3} {'layers':>6} {'KB':>7} {'stream us':>9} {'GB/s':>5} "
                f"{'op us':>8} {'GB/s':>5} {'bound_x':>7} {'MNB us':>8} {'vs_mnb':>6}"
                + (f" {'cache':>6} {'node':>5} {'node_x':>6}" if cache else "")
                + (f" {'floor_int':>9} {'floor':>6}" if fl else "")
                + (f" {'sync_x':>6}" if sync else "")]
        for r in dec:
            out.append(f"{r['format']:>8} {r.get('layout', 'blocks'):>6} {r['K']:>5}x{r['N']:<5} {r.get('act_bits', 8):>3} {r['threads']:>3} "
                       f"{r['layers']:>6} {r['layer_bytes'] / 1024:>7.0f} {r['stream_us']:>9.1f} {r['stream_GBps']:>5.1f} "
                       f"{r['op_us']:>8.1f} {r['op_GBps']:>5.1f} {r['bound_x']:>7.2f} {r['mnb_us']:>8.1f} "
                       f"{r['vs_mnb']:>6.2f}"
                       + (f" {r['cache_GBps']:>6.1f} {r['node_us']:>5.1f} {r['node_bound_x']:>6.2f}" if "cache_GBps" in r else "")
                       + (f" {r['floor_int_GBps']:>9.1f} {r['floor_GBps']:>6.1f}" if "floor_GBps" in r else
                          (f" {'':>9} {'':>6}" if fl else ""))
                       + (f" {r['sync_x']:>6.2f}" if "sync_x" in r else ""))
    pre = [r for r in rows if r["M"] > 1]
    pk = info.get("int8_peak")
    if pre or pk:
        Ms = sorted({r["M"] for r in pre}) or [info.get("prefill_m", 128)]
        out += ["", f"M = {', '.join(map(str, Ms))} (prefill), one layer: us per Run; vs_mnb = MatMulNBits / op (>= 1)"
                + (f"; of_peak = GMAC/s over the int8 peak of {pk['isa']}: {pk['macs_per_cycle']} MACs a cycle x "
                   f"{pk['GHz']} GHz (measured) = {pk['GMACps_per_thread']} GMAC/s a thread, times the threads"
                   if pk else "")
                + ("; cycles an iteration takes: " + ", ".join(f"{k} {v}" for k, v in pk["cycles_per_iteration"].items())
                   if pk and pk.get("cycles_per_iteration") else ""),
                f"{'format':>8} {'layout':>6} {'K x N':>11} {'M':>4} {'act':>3} {'thr':>3} {'op us':>9} {'GMAC/s':>7} "
                f"{'of_peak':>7} {'MNB us':>9} {'vs_mnb':>6}"]
        for r in pre:
            out.append(f"{r['format']:>8} {r.get('layout', 'blocks'):>6} {r['K']:>5}x{r['N']:<5} {r['M']:>4} "
                       f"{r.get('act_bits', 8):>3} {r['threads']:>3} {r['op_us']:>9.1f} {r['GMACps']:>7.1f} "
                       + (f"{100 * r['of_peak']:>6.0f}%" if "of_peak" in r else f"{'':>7}")
                       + f" {r['mnb_us']:>9.1f} {r['vs_mnb']:>6.2f}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma list; q4_f/B sets q4_f's block_size")
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="comma list of KxN")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--act-bits", default="8", help="comma list of 8 | 16 (the op's act_bits)")
    ap.add_argument("--mib", type=int, default=None,
                    help="weight bytes per M = 1 layer set in MiB (default: --llc-x times the LLC, memory permitting)")
    ap.add_argument("--llc-x", type=float, default=4.0, help="layer set size in multiples of the LLC (default 4)")
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds of timed runs per job and cell")
    ap.add_argument("--prefill-m", type=int, default=128)
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--no-in-cache", action="store_true", help="skip the M = 1 in-cache column")
    ap.add_argument("--layouts", default="blocks,split",
                    help="comma list of W's row layouts (blocks | split); split runs only for the formats that take "
                         "it (q4_0, q4_1, q5_0, q5_1, q8_0, q4_f/32)")
    ap.add_argument("--json", help="write the rows and the header here")
    a = ap.parse_args()

    from attn_speed import _stream_lib

    from custom_ops.reference import blockquant as bq

    tmp = Path(tempfile.mkdtemp(prefix="ortlean-bqbench-"))
    libs = _stream_lib(tmp)
    floor, why = (None, "--no-in-cache") if a.no_in_cache else _floor_lib(tmp)
    threads = [int(t) for t in a.threads.split(",")]
    act_bits = tuple(int(b) for b in a.act_bits.split(","))
    layouts = a.layouts.split(",")
    if any(v not in ("blocks", "split") for v in layouts):
        raise SystemExit(f"--layouts {a.layouts}: each must be blocks or split")
    if any(b not in (8, 16) for b in act_bits):
        raise SystemExit(f"--act-bits {a.act_bits}: each must be 8 or 16")
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    info = machine()
    info["prefill_m"] = a.prefill_m
    if not a.no_prefill:
        info["int8_peak"] = int8_peak(_peak_lib(tmp))
    if not a.no_decode:
        info["set_bytes"], info["set_why"] = set_size(a.mib, a.llc_x)
        info["stream_GBps"] = stream_rates(libs, info["set_bytes"], threads)
        info["floor"] = "tests/bench/bq_floor.c, AVX-512 VNNI, 1 thread" if floor else f"not measured: {why}"
    print(table(info, []), flush=True)
    rows = []
    rng = np.random.default_rng(0)
    for K, N in shapes:
        for spec in a.formats.split(","):
            fmt, bs = _fmt(spec)
            for lay in layouts:
                ab = act_bits if lay == "blocks" else tuple(b for b in act_bits if not bq.split_refusal(fmt, bs, b))
                if not ab:
                    continue
                if not a.no_decode:
                    new = bench_decode(K, N, fmt, bs, threads, info["set_bytes"], a.min_time, libs, rng, ab,
                                       not a.no_in_cache, floor, lay)
                    rows += new
                    print("\n".join(table(info, new).splitlines()[-len(new):]), flush=True)
                if not a.no_prefill:
                    new = bench_prefill(K, N, fmt, bs, threads, a.min_time, a.prefill_m, rng, ab, lay,
                                        info.get("int8_peak"))
                    rows += new
                    print("\n".join(table(info, new).splitlines()[-len(new):]), flush=True)
    print()
    print(table(info, rows))
    if a.json:
        from rewriter import results

        results.write_json(a.json, {"machine": info, "rows": rows})  # atomically


if __name__ == "__main__":
    main()
