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
}
# input element types other than all-float32 (index → onnxruntime_extensions PyCustomOpDef dt_* name)
_INPUT_TYPES: dict[str, dict[int, str]] = {
    "ProcSparseMatMul": {1: "dt_int32", 2: "dt_int32"},
}


def _attr_defaults(op_type: str) -> dict:
    """Values for attributes a node may omit (onnxruntime-extensions Python ops need them all)."""
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

    for op_type, spec in OPS.items():
        fn, n_inputs = spec[0], spec[1]
        n_outputs = spec[2] if len(spec) > 2 else 1
        types = _ATTR_TYPES[op_type]

        def body(*inputs, _fn=fn, _types=types, _n_out=n_outputs, **attrs):
            args = [None if (i is not None and np.asarray(i).size == 0 and k > 0) else np.asarray(i)
                    for k, i in enumerate(inputs)]
            kw = {k: (json.loads(v) if _types.get(k) in (AttributeProto.INTS, AttributeProto.FLOATS) else v)
                  for k, v in attrs.items()}
            out = _fn(*args, **kw)
            if _n_out > 1:
                return tuple(np.ascontiguousarray(o, dtype=np.float32) for o in out)
            return np.ascontiguousarray(out, dtype=np.float32)

        in_types = [getattr(PyCustomOpDef, _INPUT_TYPES.get(op_type, {}).get(i, "dt_float")) for i in range(n_inputs)]
        onnx_op(op_type=f"ortlean_{op_type}", inputs=in_types,
                outputs=[PyCustomOpDef.dt_float] * n_outputs, attrs={k: _dt(t) for k, t in types.items()})(body)
    _registered = True


def map_model(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    need_empty = False
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
        if any(i == "" for i in ins):
            need_empty = True
        ins = [EMPTY if i == "" else i for i in ins]
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
