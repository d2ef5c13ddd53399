"""Timing models: a layer's ortlean op alone against a dense MatMul of the same shape, timed at
rewrite time in one process, interleaved (a planner keeps a layer dense when its op is not faster
on this CPU). The one-node models take their attribute types from the op schema; results are
cached per CPU, library build, thread count, ONNX Runtime version and the caller's key."""
from __future__ import annotations

import hashlib
import math
import json
import os
import platform
from pathlib import Path

import numpy as np
import onnx_ir as ir

from custom_ops.schema import DOMAIN

from ..errors import OrtleanError
from . import surgery

IR_VERSION = 10
OPSET = 17


def cache_file() -> Path:
    from models.cache import cache_root

    return cache_root() / "speed.json"


def _cpu_id() -> str:
    try:
        txt = Path("/proc/cpuinfo").read_text()
        model = next((l.split(":", 1)[1].strip() for l in txt.splitlines() if l.startswith("model name")), "")
    except OSError:
        model = platform.processor()
    return model


def _lib_sig() -> str:
    import custom_ops

    p = Path(custom_ops.library_path())
    st = p.stat()
    return f"{st.st_size}-{int(st.st_mtime)}-{custom_ops.isa()}"


def _serialize(node: ir.Node, x: ir.Value, N: int, inits: list[ir.Value]) -> bytes:
    y = node.outputs[0]
    y.name, y.type, y.shape = "y", ir.TensorType(ir.DataType.FLOAT), ir.Shape(["M", N])
    opsets = {"": OPSET, **({DOMAIN: 1} if node.domain == DOMAIN else {})}
    g = ir.Graph([x], [y], nodes=[node], initializers=inits, opset_imports=opsets, name=node.name)
    return ir.serde.serialize_model(ir.Model(g, ir_version=IR_VERSION)).SerializeToString()


def _input(K: int) -> ir.Value:
    return ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["M", K]))


def op_model(op_type: str, K: int, N: int, consts: list[np.ndarray | None], attrs: dict) -> bytes:
    """One `op_type` node: input x [M, K] → y [M, N], its other inputs the constants `consts`
    (None: an absent optional input), `attrs` typed by the op schema."""
    x = _input(K)
    vals = [None if c is None else ir.Value(name=f"c{i}", const_value=ir.tensor(np.ascontiguousarray(c), name=f"c{i}"))
            for i, c in enumerate(consts)]
    return _serialize(surgery.op_node(op_type, [x, *vals], attrs, name=op_type), x, N, [v for v in vals if v is not None])


def dense_model(K: int, N: int, seed: int = 0) -> bytes:
    """y = x · W, W [K, N] random."""
    x = _input(K)
    w = (np.random.default_rng(seed).standard_normal((K, N)) * 0.05).astype(np.float32)
    wv = ir.Value(name="w", const_value=ir.tensor(w, name="w"))
    return _serialize(ir.Node("", "MatMul", [x, wv], name="mm"), x, N, [wv])


def measure_vs_dense(tag: str, key_parts: list, op_model, K: int, N: int, Ms=(1, 128), threads: int = 1,
                     timer=None, use_cache: bool = True) -> dict[int, dict[str, float]]:
    """{M: {"dense": s, tag: s, "speedup": dense/op}}: a one-node custom-op model (`op_model()`
    returns its bytes; built only on a cache miss) against a dense MatMul of the same shape, timed
    in one process, interleaved (`timer`, default runtime.time_sessions); cached in speed.json
    under key_parts + CPU + library build + ORT version."""
    import onnxruntime as ort

    import custom_ops
    from custom_ops import runtime

    key = hashlib.sha1(json.dumps([*key_parts, _cpu_id(), _lib_sig(), threads, ort.__version__]).encode()).hexdigest()
    cf = cache_file()
    cache = {}
    if use_cache and cf.exists():
        try:
            cache = json.loads(cf.read_text())
        except Exception:
            cache = {}
    res, todo = {}, []
    for M in Ms:
        if use_cache and f"{key}-{M}" in cache:
            res[M] = cache[f"{key}-{M}"]
        else:
            todo.append(M)
    if todo:
        timer = timer or runtime.time_sessions
        so = custom_ops.session_options(threads)
        so_d = ort.SessionOptions()
        so_d.intra_op_num_threads = threads
        so_d.inter_op_num_threads = 1
        s_op = ort.InferenceSession(op_model(), so, providers=["CPUExecutionProvider"])
        s_d = ort.InferenceSession(dense_model(K, N), so_d, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(1)
        for M in todo:
            x = rng.standard_normal((M, K)).astype(np.float32)
            t = timer({"dense": s_d, tag: s_op}, {"x": x})
            res[M] = {"dense": t["dense"], tag: t[tag], "speedup": t["dense"] / max(t[tag], 1e-12)}
            cache[f"{key}-{M}"] = res[M]
        if use_cache:
            tmp = cf.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(cache))
            os.replace(tmp, cf)
    return res


def speed_check(measure, speed_M: int, flag: str) -> tuple[dict, float]:
    """Run `measure()` ({M: {"dense", tag, "speedup"}}); returns the plan's speed record
    {"M1": …, "M128": …} and the speedup at `speed_M`. Without the library there is no proof of a
    speed gain: an error that names the flag turning the check off."""
    try:
        res = measure()
    except Exception as e:
        raise OrtleanError(f"speed check needs the ortlean library ({e}); pass {flag}=off to skip it") from None
    return {f"M{M}": v for M, v in res.items()}, res[speed_M]["speedup"]


def cached(key_parts: list, threads: int, compute):
    """`compute()` (a JSON value), cached in speed.json under key_parts + CPU + library build +
    thread count + ORT version (the same key as ``measure_vs_dense``)."""
    import onnxruntime as ort

    key = hashlib.sha1(json.dumps([*key_parts, _cpu_id(), _lib_sig(), threads, ort.__version__]).encode()).hexdigest()
    cf = cache_file()
    cache = {}
    if cf.exists():
        try:
            cache = json.loads(cf.read_text())
        except Exception:
            cache = {}
    if key in cache:
        return cache[key]
    val = cache[key] = compute()
    cf.parent.mkdir(parents=True, exist_ok=True)
    tmp = cf.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(cache))
    os.replace(tmp, cf)
    return val


def packed_attention_model(Hq: int, Hkv: int, D: int, Dv: int, attrs: dict) -> bytes:
    """One PackedAttention node in its KV-cache mode (Q, K, V [B, H, 1, D], past_bits, past_kv →
    Y, present_bits, present_kv), `attrs` typed by the op schema."""
    q, k, v = (ir.Value(name=n, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, h, 1, d]))
               for n, h, d in (("Q", Hq, D), ("K", Hkv, D), ("V", Hkv, Dv)))
    pb, pk = (ir.Value(name=n, type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([1, Hkv, "P", "W" + n]))
              for n in ("past_bits", "past_kv"))
    node = surgery.op_node("PackedAttention", [q, k, v, None, pb, pk], attrs, name="pa", num_outputs=3)
    for o, n in zip(node.outputs, ("Y", "bits", "kv")):
        o.name = n
        o.type = ir.TensorType(ir.DataType.FLOAT if n == "Y" else ir.DataType.INT32)
    g = ir.Graph([q, k, v, pb, pk], list(node.outputs), nodes=[node], opset_imports={"": OPSET, DOMAIN: 1}, name="pa")
    return ir.serde.serialize_model(ir.Model(g, ir_version=IR_VERSION)).SerializeToString()


def attention_crossover(Hq: int, Hkv: int, D: int, Dv: int, attrs: dict, pasts=(64, 128, 256, 512, 1024, 2048, 4096),
                        threads: int = 1, use_cache: bool = True) -> dict:
    """One decode step of PackedAttention at the layer's shape: the candidate path (``attrs``,
    min_context 0) against the exact path (budget 1) at each past length, interleaved, medians;
    cached per CPU and library build. Returns {"pasts": {P: {"exact": s, "approx": s,
    "speedup": exact/approx}}, "crossover": the least P from which every longer past is faster on
    the candidate path (None: never within the grid)}."""
    import custom_ops
    from custom_ops import runtime
    from custom_ops.reference.attn import pack_cache, pq_params

    a = {**attrs, "min_context": 0}
    if a.get("mode") == "pq" and not a.get("pq_book"):
        # the step's time does not depend on the centroids' values: a fixed random book (and a short key)
        a["pq_book"] = [float(x) for x in np.random.default_rng(1).standard_normal(Hkv * D * 16, dtype=np.float32)]
        a.pop("pq_dims", None)

    def measure():
        s_ap = custom_ops.session(packed_attention_model(Hq, Hkv, D, Dv, a), threads=threads)
        s_ex = custom_ops.session(packed_attention_model(Hq, Hkv, D, Dv, {**a, "budget": 1.0}), threads=threads)
        rng = np.random.default_rng(0)
        out = {}
        for P in pasts:
            Kp = rng.standard_normal((1, Hkv, P, D), dtype=np.float32)
            Vp = rng.standard_normal((1, Hkv, P, Dv), dtype=np.float32)
            mode = a.get("mode", "sign")
            pq = pq_params(a.get("pq_book"), a.get("pq_dims"), Hkv, D) if mode == "pq" else None
            bits, rows = pack_cache(Kp, Vp, a.get("kv_quant", "int8"), mode, a.get("eps", 0.0), None, pq)
            f = {"Q": rng.standard_normal((1, Hq, 1, D), dtype=np.float32),
                 "K": rng.standard_normal((1, Hkv, 1, D), dtype=np.float32),
                 "V": rng.standard_normal((1, Hkv, 1, Dv), dtype=np.float32),
                 "past_bits": bits, "past_kv": rows}
            t = runtime.time_sessions({"exact": s_ex, "approx": s_ap}, f, min_time=0.1)
            out[str(P)] = {"exact": t["exact"], "approx": t["approx"], "speedup": t["exact"] / max(t["approx"], 1e-12)}
        return out

    key = ["PackedAttention-crossover", Hq, Hkv, D, Dv, sorted((k, v) for k, v in a.items()
                                                               if k not in ("layer", "scale", "pq_book")), list(pasts)]
    res = cached(key, threads, measure) if use_cache else measure()
    ps = sorted(pasts)
    first = len(ps)                      # the first grid past from which every longer one is faster
    while first > 0 and res[str(ps[first - 1])]["speedup"] > 1.0:
        first -= 1
    if first == len(ps):
        cross = None
    elif first == 0:
        cross = ps[0]
    else:                                # speedup 1 interpolated in log(P) between the two grid points
        lo, hi = ps[first - 1], ps[first]
        s_lo, s_hi = res[str(lo)]["speedup"], res[str(hi)]["speedup"]
        f = (1.0 - s_lo) / max(s_hi - s_lo, 1e-12)
        cross = int(round(math.exp(math.log(lo) + f * (math.log(hi) - math.log(lo)))))
    return {"pasts": res, "crossover": cross}


def speedup_at(res: dict, P: int) -> float:
    """The candidate path's speedup over the exact one at past ``P`` from :func:`attention_crossover`'s
    measured grid (``res["pasts"]``): interpolated in log P between grid points, the end values
    beyond the grid."""
    pts = sorted((int(p), v["speedup"]) for p, v in res["pasts"].items())
    if P <= pts[0][0]:
        return float(pts[0][1])
    for (lo, s_lo), (hi, s_hi) in zip(pts, pts[1:]):
        if P <= hi:
            f = (math.log(P) - math.log(lo)) / (math.log(hi) - math.log(lo))
            return float(s_lo + f * (s_hi - s_lo))
    return float(pts[-1][1])


def gqa_model(attrs: dict, Hq: int, Hkv: int, D: int, Dv: int, packed_qkv: bool, max_pos: int) -> ir.Model:
    """One com.microsoft GroupQueryAttention node with ``attrs`` (a fused layer's own) in the cache
    layout of a fused decoder: [1, S, H·D] query (packed QKV when ``packed_qkv``), graph inputs
    past_key_values.0.key / .value [1, Hkv, P, D], seqlens_k, total_sequence_length, and (do_rotary)
    cos/sin caches of ``max_pos`` rows as initializers."""
    F, I32 = ir.DataType.FLOAT, ir.DataType.INT32

    def val(name, dt, shape):
        return ir.Value(name=name, type=ir.TensorType(dt), shape=ir.Shape(shape))

    if packed_qkv:
        q, k, v = val("query", F, [1, "S", (Hq + 2 * Hkv) * D]), None, None
    else:
        q, k, v = val("query", F, [1, "S", Hq * D]), val("key", F, [1, "S", Hkv * D]), val("value", F, [1, "S", Hkv * Dv])
    pk, pv = val("past_key_values.0.key", F, [1, Hkv, "P", D]), val("past_key_values.0.value", F, [1, Hkv, "P", Dv])
    sl, tot = val("seqlens_k", I32, [1]), val("total_sequence_length", I32, [])
    inits, ins = [], [q, k, v, pk, pv, sl, tot]
    if attrs.get("do_rotary", 0):
        rng = np.random.default_rng(0)
        for n in ("cos_cache", "sin_cache"):
            t = ir.Value(name=n, type=ir.TensorType(F), shape=ir.Shape([max_pos, D // 2]),
                         const_value=ir.tensor(rng.uniform(-1, 1, (max_pos, D // 2)).astype(np.float32), name=n))
            inits.append(t)
            ins.append(t)
    node = ir.Node("com.microsoft", "GroupQueryAttention", ins, [ir.Attr(k_, *_attr_type(v_)) for k_, v_ in attrs.items()],
                   name="/layers.0/attn/GroupQueryAttention", num_outputs=3)
    for o, n, d in zip(node.outputs, ("y", "present.0.key", "present.0.value"), (None, D, Dv)):
        o.name = n
        o.type = ir.TensorType(F)
        o.shape = ir.Shape([1, "S", Hq * Dv] if d is None else [1, Hkv, "T", d])
    graph_ins = [x for x in (q, k, v, pk, pv, sl, tot) if x is not None]
    g = ir.Graph(graph_ins, list(node.outputs), nodes=[node], initializers=inits,
                 opset_imports={"": OPSET, "com.microsoft": 1}, name="gqa")
    return ir.Model(g, ir_version=IR_VERSION)


def _attr_type(v):
    if isinstance(v, float):
        return ir.AttributeType.FLOAT, v
    return ir.AttributeType.INT, int(v)


def exact_attention_speed(attrs: dict, Hq: int, Hkv: int, D: int, Dv: int, packed_qkv: bool, max_pos: int,
                          replace, pasts=(128, 4096), threads: int = 1, use_cache: bool = True) -> dict:
    """One decode step of a fused layer's GroupQueryAttention (``attrs``) against the PackedAttention
    node that replaces it in its exact fp32 cache mode (``replace(model)`` rewrites the one-node model
    in place: ``packed_attention.apply_gqa`` with kv_quant fp32, budget 0 — the same attention,
    ortlean's kernel), at each past length (< ``max_pos``), interleaved medians, both on
    a plain feed loop (past in, present out); cached per CPU, library build and threads. Returns
    {"pasts": {P: {"gqa": s, "exact": s, "speedup": gqa / exact}}, "min_speedup": the least of them}."""
    import custom_ops
    import onnxruntime as ort
    from custom_ops import runtime
    from custom_ops.reference.attn import pack_cache

    pasts = [int(p) for p in pasts if p + 1 < max_pos] or [max(1, max_pos // 2)]

    def measure():
        gm = gqa_model(attrs, Hq, Hkv, D, Dv, packed_qkv, max_pos)
        pm = gqa_model(attrs, Hq, Hkv, D, Dv, packed_qkv, max_pos)
        replace(pm)
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        s_g = ort.InferenceSession(ir.serde.serialize_model(gm).SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
        s_p = custom_ops.session(ir.serde.serialize_model(pm).SerializeToString(), threads=threads)
        rng = np.random.default_rng(0)
        width = (Hq + 2 * Hkv) * D if packed_qkv else Hq * D
        out = {}
        for P in pasts:
            Kp = rng.standard_normal((1, Hkv, P, D), dtype=np.float32)
            Vp = rng.standard_normal((1, Hkv, P, Dv), dtype=np.float32)
            base = {"query": rng.standard_normal((1, 1, width), dtype=np.float32),
                    "seqlens_k": np.array([P], np.int32), "total_sequence_length": np.array(P + 1, np.int32)}
            if not packed_qkv:
                base["key"] = rng.standard_normal((1, 1, Hkv * D), dtype=np.float32)
                base["value"] = rng.standard_normal((1, 1, Hkv * Dv), dtype=np.float32)
            fg = {**base, "past_key_values.0.key": Kp, "past_key_values.0.value": Vp}
            bits, rows = pack_cache(Kp, Vp, "fp32", "sign", 0.0)
            fp = {**base, "past_key_values.0.kv": rows, "past_key_values.0.key_bits": bits}
            fp = {k_: v_ for k_, v_ in fp.items() if k_ in {i.name for i in s_p.get_inputs()}}
            t = runtime.time_sessions({"gqa": s_g, "exact": s_p}, None, min_time=0.1, feeds_of={"gqa": fg, "exact": fp})
            g_, e_ = t["gqa"], t["exact"]
            out[str(P)] = {"gqa": g_, "exact": e_, "speedup": g_ / max(e_, 1e-12)}
        return out

    key = ["GQA-vs-exact-PackedAttention", Hq, Hkv, D, Dv, bool(packed_qkv), max_pos,
           sorted((k_, v_) for k_, v_ in attrs.items()), list(pasts)]
    res = cached(key, threads, measure) if use_cache else measure()
    return {"pasts": res, "min_speedup": min(v["speedup"] for v in res.values())}
