"""Run rewritten models on the numpy references inside ONNX Runtime, through
onnxruntime-extensions Python ops.

onnxruntime-extensions Python ops live in domain `ai.onnx.contrib`, take a fixed number of
inputs and only scalar int/float/string attributes. `map_model` therefore rewrites a copy of the
model: every `ai.ortlean` node becomes `ai.onnx.contrib::ortlean_<Op>` with all optional inputs
present (absent ones fed an empty tensor) and list attributes as JSON strings."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper

from . import OPS

DOMAIN = "ai.ortlean"
EXT_DOMAIN = "ai.onnx.contrib"
EMPTY = "ortlean_ref_empty"
_registered = False
_ATTR_TYPES: dict[str, dict[str, int]] = {
    "TTMatMul": {"modes_k": AttributeProto.INTS, "modes_n": AttributeProto.INTS, "ranks": AttributeProto.INTS,
                 "method": AttributeProto.STRING, "gap": AttributeProto.FLOAT, "params_dense": AttributeProto.INT,
                 "params_stored": AttributeProto.INT, "speedup": AttributeProto.FLOAT, "layer": AttributeProto.STRING,
                 "target": AttributeProto.STRING},
    "ProcSparseMatMul": {"shape": AttributeProto.INTS, "block": AttributeProto.INT, "seed": AttributeProto.INT,
                         "base_scale": AttributeProto.FLOAT, "fanout": AttributeProto.INT, "watermark": AttributeProto.INT,
                         "shed_eps": AttributeProto.FLOAT, "trims": AttributeProto.INT, "gap": AttributeProto.FLOAT,
                         "params_dense": AttributeProto.INT, "params_stored": AttributeProto.INT,
                         "bytes_stored": AttributeProto.INT, "speedup": AttributeProto.FLOAT,
                         "layer": AttributeProto.STRING, "target": AttributeProto.STRING},
    "EventGatedMatMul": {
        **{k: AttributeProto.INT for k in ("block", "kwta", "kwta_k", "kwta_duty", "kwta_renorm", "event",
                                           "event_gap_every", "event_age_max", "dense_prefill", "params_dense",
                                           "params_stored")},
        **{k: AttributeProto.FLOAT for k in ("pack_eps", "pack_rho", "kwta_threshold", "kwta_mass", "kwta_temp",
                                             "event_topk", "event_quorum", "event_theta", "event_budget_ms",
                                             "event_gap_tol", "event_beta", "event_lambda", "gap", "keep_ratio")},
        **{k: AttributeProto.STRING for k in ("pack", "kwta_select", "kwta_score", "layer", "target")},
    },
    "PackedAttention": {"scale": AttributeProto.FLOAT, "mode": AttributeProto.STRING, "eps": AttributeProto.FLOAT,
                        "budget": AttributeProto.FLOAT, "min_candidates": AttributeProto.INT,
                        "sinks": AttributeProto.INT, "window": AttributeProto.INT, "min_context": AttributeProto.INT,
                        "rho": AttributeProto.FLOAT, "qbits": AttributeProto.INT, "mix": AttributeProto.FLOAT,
                        "popcnt": AttributeProto.STRING, "k_layout": AttributeProto.STRING,
                        "layer": AttributeProto.STRING, "approx_prefill": AttributeProto.INT,
                        "eps_heads": AttributeProto.FLOATS, "kscale": AttributeProto.FLOATS,
                        "select": AttributeProto.STRING},
}
# ops whose inputs/outputs are not all float32 (index → TensorProto type); outputs: the full list
_IN_TYPES: dict[str, dict[int, int]] = {
    "ProcSparseMatMul": {1: TensorProto.INT32, 2: TensorProto.INT32},
    "PackedAttention": {4: TensorProto.INT32},
}
_OUT_TYPES: dict[str, list[int]] = {"PackedAttention": [TensorProto.FLOAT, TensorProto.INT32]}
EMPTY_I32 = "ortlean_ref_empty_i32"
# attributes the ext op must see even when the node omits them (ext ops require every declared one)
_ATTR_DEFAULTS: dict[str, dict] = {
    "PackedAttention": {"scale": 1.0, "mode": "sign", "eps": 0.0, "budget": 0.0, "min_candidates": 64, "sinks": 4,
                        "window": 64, "min_context": 256, "rho": 0.15, "qbits": 8, "mix": 0.0, "popcnt": "auto",
                        "k_layout": "bhtd", "layer": "", "approx_prefill": 0, "eps_heads": "[]",
                        "kscale": "[]", "select": "popcount"},
}


def _attr_defaults(op_type: str) -> dict:
    """Values for attributes a node may omit (onnxruntime-extensions Python ops need them all)."""
    if op_type in _ATTR_DEFAULTS:
        return _ATTR_DEFAULTS[op_type]
    if op_type == "EventGatedMatMul":
        from .gating import DEFAULTS

        return {**DEFAULTS, "gap": 0.0, "keep_ratio": 1.0, "params_dense": 0, "params_stored": 0, "layer": "",
                "target": "mlp"}
    return {}


def library_path() -> str:
    from onnxruntime_extensions import get_library_path

    return get_library_path()


def _dt(a: int):
    from onnxruntime_extensions import PyCustomOpDef

    return {AttributeProto.INT: PyCustomOpDef.dt_int64, AttributeProto.FLOAT: PyCustomOpDef.dt_float}.get(a, PyCustomOpDef.dt_string)


def register() -> None:
    """Declare one Python op per ortlean op (idempotent)."""
    global _registered
    if _registered:
        return
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    def _pt(t):
        return PyCustomOpDef.dt_int32 if t == TensorProto.INT32 else PyCustomOpDef.dt_float

    for op_type, spec in OPS.items():
        fn, n_inputs = spec[0], spec[1]
        n_outputs = spec[2] if len(spec) > 2 else 1
        types = _ATTR_TYPES[op_type]
        in_types = [_pt(_IN_TYPES.get(op_type, {}).get(k, TensorProto.FLOAT)) for k in range(n_inputs)]
        out_proto = _OUT_TYPES.get(op_type, [TensorProto.FLOAT] * n_outputs)
        out_np = [np.int32 if t == TensorProto.INT32 else np.float32 for t in out_proto]

        def body(*inputs, _fn=fn, _types=types, _out_np=out_np, **attrs):
            args = [None if (i is not None and np.asarray(i).size == 0 and k > 0) else np.asarray(i)
                    for k, i in enumerate(inputs)]
            kw = {k: (json.loads(v) if _types.get(k) in (AttributeProto.INTS, AttributeProto.FLOATS) else v)
                  for k, v in attrs.items()}
            res = _fn(*args, **kw)
            if len(_out_np) > 1:
                return tuple(np.ascontiguousarray(r, dtype=t) for r, t in zip(res, _out_np))
            return np.ascontiguousarray(res, dtype=_out_np[0])

        onnx_op(op_type=f"ortlean_{op_type}", inputs=in_types,
                outputs=[_pt(t) for t in out_proto], attrs={k: _dt(t) for k, t in types.items()})(body)
    _registered = True


def map_model(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    need_empty = False
    need_empty_i32 = False
    for node in m.graph.node:
        if node.domain != DOMAIN:
            continue
        if node.op_type not in OPS:
            raise ValueError(f"node {node.name!r}: no reference for {DOMAIN}::{node.op_type}")
        n_inputs = OPS[node.op_type][1]
        n_outputs = OPS[node.op_type][2] if len(OPS[node.op_type]) > 2 else 1
        if len(node.output) < n_outputs or any(o == "" for o in node.output):
            outs = [o or f"{node.name or node.op_type}.ortlean_unused{k}" for k, o in enumerate(node.output)]
            outs += [f"{node.name or node.op_type}.ortlean_unused{k}" for k in range(len(outs), n_outputs)]
            del node.output[:]
            node.output.extend(outs)
        ins = list(node.input) + [""] * (n_inputs - len(node.input))
        int_ins = _IN_TYPES.get(node.op_type, {})
        if any(i == "" and k not in int_ins for k, i in enumerate(ins)):
            need_empty = True
        if any(i == "" and k in int_ins for k, i in enumerate(ins)):
            need_empty_i32 = True
        ins = [(EMPTY_I32 if k in int_ins else EMPTY) if i == "" else i for k, i in enumerate(ins)]
        n_out = len(_OUT_TYPES.get(node.op_type, [TensorProto.FLOAT]))
        if len(node.output) < n_out:  # the ext op has a fixed output list: name the unused ones
            node.output.extend([f"{node.name or node.op_type}_ortlean_unused{k}" for k in range(len(node.output), n_out)])
        del node.input[:]
        node.input.extend(ins)
        attrs = []
        for a in node.attribute:
            if a.type in (AttributeProto.INTS, AttributeProto.FLOATS):
                v = list(a.ints) if a.type == AttributeProto.INTS else list(a.floats)
                attrs.append(helper.make_attribute(a.name, json.dumps(v)))
            else:
                attrs.append(a)
        have = {a.name for a in attrs}
        for k, v in _attr_defaults(node.op_type).items():
            if k not in have and k in _ATTR_TYPES[node.op_type]:
                attrs.append(helper.make_attribute(k, v))
        del node.attribute[:]
        node.attribute.extend(attrs)
        node.op_type = f"ortlean_{node.op_type}"
        node.domain = EXT_DOMAIN
    if need_empty:
        m.graph.initializer.append(helper.make_tensor(EMPTY, TensorProto.FLOAT, [0], []))
    if need_empty_i32:
        m.graph.initializer.append(helper.make_tensor(EMPTY_I32, TensorProto.INT32, [0], []))
    ops = [o for o in m.opset_import if o.domain != DOMAIN]
    del m.opset_import[:]
    m.opset_import.extend(ops + [helper.make_opsetid(EXT_DOMAIN, 1)])
    return m


def prepare(model) -> tuple[bytes, str | None]:
    """A model (path, bytes or ModelProto) mapped for the reference backend, as bytes, plus the
    directory its external data lives in (None when it has none): ONNX Runtime is pointed there
    with the `session.model_external_initializers_file_folder_path` config entry."""
    base = None
    if isinstance(model, (str, Path)):
        path = Path(model)
        proto = onnx.load(str(path), load_external_data=False)
        base = str(path.resolve().parent)
    elif isinstance(model, bytes):
        proto = onnx.load_from_string(model)
    else:
        proto = model
    mapped = map_model(proto)
    has_external = any(t.data_location == TensorProto.EXTERNAL for t in mapped.graph.initializer)
    return mapped.SerializeToString(), (base if has_external else None)
