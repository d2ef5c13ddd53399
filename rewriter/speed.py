"""Quick kernel-vs-dense timing at rewrite time (the planner keeps a layer dense when its factored
kernel is not faster on this CPU). Results are cached per CPU, library build and shape."""
from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from . import DOMAIN

IR_VERSION = 10
OPSET = 17


def cache_file() -> Path:
    root = Path(os.environ.get("ORTLEAN_CACHE", Path.home() / ".cache" / "ortlean"))
    root.mkdir(parents=True, exist_ok=True)
    return root / "speed.json"


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


def tt_model(K: int, N: int, modes_k, modes_n, ranks, x_scale: bool = False, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    inits, names = [], []
    for i in range(len(modes_k)):
        c = (rng.standard_normal((ranks[i], modes_k[i], modes_n[i], ranks[i + 1])) * 0.05).astype(np.float32)
        names.append(f"g{i}")
        inits.append(onnx.numpy_helper.from_array(c, f"g{i}"))
    ins = ["x"] + names + [""] * (4 - len(names))
    if x_scale:
        inits.append(onnx.numpy_helper.from_array(np.ones(K, np.float32), "xs"))
        ins.append("xs")
    while ins and ins[-1] == "":
        ins.pop()
    node = helper.make_node("TTMatMul", ins, ["y"], domain=DOMAIN, name="tt", modes_k=list(modes_k), modes_n=list(modes_n),
                            ranks=list(ranks), method="svd", gap=0.0, params_dense=K * N,
                            params_stored=int(sum(i.dims[0] * i.dims[1] * i.dims[2] * i.dims[3] for i in inits if len(i.dims) == 4)),
                            speedup=0.0, layer="bench", target="mlp")
    g = helper.make_graph([node], "tt", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)])
    m.ir_version = IR_VERSION
    return m.SerializeToString()


def dense_model(K: int, N: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    g = helper.make_graph([node], "dense", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])],
                          initializer=[onnx.numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    m.ir_version = IR_VERSION
    return m.SerializeToString()


def measure_vs_dense(tag: str, key_parts: list, op_model, K: int, N: int, Ms=(1, 128), threads: int = 1,
                     timer=None, use_cache: bool = True) -> dict[int, dict[str, float]]:
    """{M: {"dense": s, tag: s, "speedup": dense/op}}: a one-node custom-op model (`op_model()`
    returns its bytes; built only on a cache miss) against a dense
    MatMul of the same shape, timed in one process, interleaved (`timer`, default
    time_sessions); cached in speed.json under key_parts + CPU + library build + ORT version."""
    import custom_ops
    import onnxruntime as ort
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


def measure_tt(K: int, N: int, modes_k, modes_n, ranks, Ms=(1, 128), threads: int = 1, x_scale: bool = False,
               use_cache: bool = True) -> dict[int, dict[str, float]]:
    """{M: {"dense": s, "tt": s, "speedup": dense/tt}} measured in one process, interleaved."""
    return measure_vs_dense("tt", ["tt", K, N, list(modes_k), list(modes_n), list(ranks), bool(x_scale)],
                            lambda: tt_model(K, N, modes_k, modes_n, ranks, x_scale), K, N, Ms, threads, use_cache=use_cache)
