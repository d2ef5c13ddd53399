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
}
# input element types other than all-float32 (index → onnxruntime_extensions PyCustomOpDef dt_* name)
_INPUT_TYPES: dict[str, dict[int, str]] = {
    "ProcSparseMatMul": {1: "dt_int32", 2: "dt_int32"},
}


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

    for op_type, (fn, n_inputs) in OPS.items():
        types = _ATTR_TYPES[op_type]

        def body(*inputs, _fn=fn, _types=types, **attrs):
            args = [None if (i is not None and np.asarray(i).size == 0 and k > 0) else np.asarray(i)
                    for k, i in enumerate(inputs)]
            kw = {k: (json.loads(v) if _types.get(k) in (AttributeProto.INTS, AttributeProto.FLOATS) else v)
                  for k, v in attrs.items()}
            return np.ascontiguousarray(_fn(*args, **kw), dtype=np.float32)

        in_types = [getattr(PyCustomOpDef, _INPUT_TYPES.get(op_type, {}).get(i, "dt_float")) for i in range(n_inputs)]
        onnx_op(op_type=f"ortlean_{op_type}", inputs=in_types,
                outputs=[PyCustomOpDef.dt_float], attrs={k: _dt(t) for k, t in types.items()})(body)
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
