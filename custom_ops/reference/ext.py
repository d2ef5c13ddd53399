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

from .. import schema
from ..schema import DOMAIN

EXT_DOMAIN = "ai.onnx.contrib"
EMPTY = {"float32": "ortlean_ref_empty", "int32": "ortlean_ref_empty_i32", "int64": "ortlean_ref_empty_i64",
         "uint8": "ortlean_ref_empty_u8"}
_PROTO = {"float32": TensorProto.FLOAT, "int32": TensorProto.INT32, "int64": TensorProto.INT64, "uint8": TensorProto.UINT8}
_NP = {"float32": np.float32, "int32": np.int32, "int64": np.int64, "uint8": np.uint8}
# ext ops take scalar int/float/string attributes: lists travel as JSON strings
_ATTR_PROTO = {"int": AttributeProto.INT, "float": AttributeProto.FLOAT, "string": AttributeProto.STRING,
               "ints": AttributeProto.STRING, "floats": AttributeProto.STRING}
_FILL = {"int": 0, "float": 0.0, "string": "", "ints": "[]", "floats": "[]"}
_registered = False


def _fill_values(s: schema.OpSchema) -> dict:
    """What the ext op sees for attributes a node omits (it needs every declared one): the
    kernel's default, else an empty value (required attributes are never filled in)."""
    out = {}
    for a in s.attrs:
        if a.required:
            continue
        v = a.default if a.default is not None else _FILL[a.type]
        out[a.name] = json.dumps(list(v)) if a.type in ("ints", "floats") and not isinstance(v, str) else v
    return out


def library_path() -> str:
    from onnxruntime_extensions import get_library_path

    return get_library_path()


def _dt(t: str):
    from onnxruntime_extensions import PyCustomOpDef

    return {"int": PyCustomOpDef.dt_int64, "float": PyCustomOpDef.dt_float, "int32": PyCustomOpDef.dt_int32,
            "float32": PyCustomOpDef.dt_float, "int64": PyCustomOpDef.dt_int64,
            "uint8": PyCustomOpDef.dt_uint8}.get(t, PyCustomOpDef.dt_string)


def register() -> None:
    """Declare one Python op per ortlean op (idempotent)."""
    global _registered
    if _registered:
        return
    from onnxruntime_extensions import onnx_op

    for s in schema.SCHEMAS:
        lists = {a.name for a in s.attrs if a.type in ("ints", "floats")}
        out_np = [_NP[o.type] for o in s.outputs]

        def body(*inputs, _fn=s.reference_fn(), _lists=lists, _out_np=out_np, **attrs):
            args = [None if (i is not None and np.asarray(i).size == 0 and k > 0) else np.asarray(i)
                    for k, i in enumerate(inputs)]
            kw = {k: (json.loads(v) if k in _lists else v) for k, v in attrs.items()}
            res = _fn(*args, **kw)
            if len(_out_np) > 1:
                return tuple(np.ascontiguousarray(r, dtype=t) for r, t in zip(res, _out_np))
            return np.ascontiguousarray(res, dtype=_out_np[0])

        onnx_op(op_type=f"ortlean_{s.op_type}", inputs=[_dt(i.type) for i in s.inputs],
                outputs=[_dt(o.type) for o in s.outputs], attrs={a.name: _dt(a.type) for a in s.attrs})(body)
    _registered = True


def map_model(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    empties: set[str] = set()
    for node in m.graph.node:
        if node.domain != DOMAIN:
            continue
        try:
            s = schema.get(node.op_type)
        except KeyError:
            raise ValueError(f"node {node.name!r}: no reference for {DOMAIN}::{node.op_type}") from None
        n_outputs = len(s.outputs)
        if len(node.output) < n_outputs or any(o == "" for o in node.output):  # the ext op has a fixed output list
            outs = [o or f"{node.name or node.op_type}.ortlean_unused{k}" for k, o in enumerate(node.output)]
            outs += [f"{node.name or node.op_type}.ortlean_unused{k}" for k in range(len(outs), n_outputs)]
            del node.output[:]
            node.output.extend(outs)
        ins = list(node.input) + [""] * (len(s.inputs) - len(node.input))
        ins = [EMPTY[port.type] if i == "" else i for i, port in zip(ins, s.inputs)]
        empties.update(i for i in ins if i in EMPTY.values())
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
        for k, v in _fill_values(s).items():
            if k not in have:
                attrs.append(helper.make_attribute(k, v, attr_type=_ATTR_PROTO[s.attr(k).type]))
        del node.attribute[:]
        node.attribute.extend(attrs)
        node.op_type = f"ortlean_{node.op_type}"
        node.domain = EXT_DOMAIN
    for t, name in EMPTY.items():
        if name in empties:
            m.graph.initializer.append(helper.make_tensor(name, _PROTO[t], [0], []))
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
