"""Timing models: a layer's ortlean op alone against a dense MatMul of the same shape, timed at
rewrite time in one process, interleaved (a planner keeps a layer dense when its op is not faster
on this CPU). The one-node models take their attribute types from the op schema; results are
cached per CPU, library build, thread count, ONNX Runtime version and the caller's key."""
from __future__ import annotations

import hashlib
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
