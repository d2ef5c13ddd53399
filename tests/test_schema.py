"""The op schemas (custom_ops/schema.py) against what uses them: the numpy references' signatures,
the kernels' constructors (every value the schema calls valid is accepted, values outside it are
refused naming the node) and the kernels' defaults (exported by the library)."""
from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
from onnx import AttributeProto, TensorProto, helper, numpy_helper

import custom_ops
from conftest import requires_native
from custom_ops import schema

_PROTO_ATTR = {"int": AttributeProto.INT, "float": AttributeProto.FLOAT, "string": AttributeProto.STRING,
               "ints": AttributeProto.INTS, "floats": AttributeProto.FLOATS}
_PROTO_TENSOR = {"float32": TensorProto.FLOAT, "int32": TensorProto.INT32, "int64": TensorProto.INT64,
                 "uint8": TensorProto.UINT8}

# a node of each op that its kernel accepts: constant inputs and the required attributes
_OK = {
    "TTMatMul": ({"G1": np.ones((1, 4, 1, 2), np.float32), "G2": np.ones((2, 1, 3, 1), np.float32)},
                 {"modes_k": [4, 1], "modes_n": [1, 3], "ranks": [1, 2, 1]}),
    "ProcSparseMatMul": ({"row_ptr": np.array([0, 1, 2], np.int32), "block_idx": np.array([0, 1], np.int32),
                          "deltas": np.ones((2, 32), np.float32)},
                         {"shape": [64, 2], "block": 32, "seed": 1, "base_scale": 0.0}),
    "EventGatedMatMul": ({"W": np.ones((8, 4), np.float32)}, {}),
    "PackedAttention": ({}, {}),
    "BlockQuantMatMul": ({"W": np.zeros((2, 36), np.uint8)}, {"format": "q4_0", "K": 64, "N": 2}),
    "BlockQuantGather": ({"W": np.zeros((2, 36), np.uint8)}, {"format": "q4_0", "K": 64, "N": 2}),
}
# attributes whose other valid values need other constant inputs (shapes follow from them)
_LAYOUT = {("TTMatMul", "modes_k"), ("TTMatMul", "modes_n"), ("TTMatMul", "ranks"),
           ("ProcSparseMatMul", "shape"), ("ProcSparseMatMul", "block"),
           ("EventGatedMatMul", "weight_format"), ("EventGatedMatMul", "weight_shape"),
           *((op, a) for op in ("BlockQuantMatMul", "BlockQuantGather") for a in ("format", "K", "N"))}


def op_model(op_type: str, attrs: dict, name: str = "node") -> bytes:
    """One node of `op_type` (ports from its schema): constants from _OK, other inputs are graph inputs."""
    s = schema.get(op_type)
    consts, _ = _OK[op_type]
    names, inputs, inits = [], [], []
    for p in s.inputs:
        if p.name in consts:
            inits.append(numpy_helper.from_array(consts[p.name], p.name))
            names.append(p.name)
        elif p.optional:
            names.append("")
        else:
            inputs.append(helper.make_tensor_value_info(p.name, _PROTO_TENSOR[p.type], None))
            names.append(p.name)
    while names[-1] == "":
        names.pop()
    out = s.outputs[0]
    node = helper.make_node(op_type, names, [out.name], name=name, domain=schema.DOMAIN)
    cast = {"int": int, "float": float, "string": str, "ints": lambda v: [int(x) for x in v],
            "floats": lambda v: [float(x) for x in v]}
    node.attribute.extend(helper.make_attribute(k, cast[s.attr(k).type](v), attr_type=_PROTO_ATTR[s.attr(k).type])
                          for k, v in attrs.items())
    g = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info(out.name, _PROTO_TENSOR[out.type], None)],
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, schema.OPSET)])
    m.ir_version = 10
    return m.SerializeToString()


def inside(a: schema.Attr) -> list:
    """Values `a.valid` accepts, at its edges."""
    v = a.valid
    if v.choices is not None:
        return list(v.choices)
    one = 1 if a.type in ("int", "ints") else 0.5
    out = [x for x in (v.lo if not v.lo_open else None, v.hi if not v.hi_open else None) if x is not None]
    if v.lo is not None and v.lo_open:
        out.append(v.lo + (one if v.hi is None else min(one, (v.hi - v.lo) / 2)))
    if not out:
        out = [0 if a.type in ("int", "ints") else 1.5]
    return [[x] if a.type in ("ints", "floats") else x for x in out]


def outside(a: schema.Attr) -> list:
    """Values `a.valid` refuses, just past its edges."""
    v = a.valid
    if v.choices is not None:
        return ["bogus"] if a.type == "string" else [max(v.choices) + 1]
    one = 1 if a.type in ("int", "ints") else 0.5
    out = []
    if v.lo is not None:
        out.append(v.lo if v.lo_open else v.lo - one)
    if v.hi is not None:
        out.append(v.hi if v.hi_open else v.hi + one)
    if v.finite:
        out.append(math.inf)
    return [[x] if a.type in ("ints", "floats") else x for x in out]


def checked_attrs():
    return [(s.op_type, a) for s in schema.SCHEMAS for a in s.attrs
            if a.valid is not None and (s.op_type, a.name) not in _LAYOUT]


def test_reference_functions_take_the_schema_inputs():
    for s in schema.SCHEMAS:
        params = inspect.signature(s.reference_fn()).parameters.values()
        positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
        assert len(positional) == len(s.inputs), (s.op_type, [p.name for p in positional])
        assert [p.default is p.empty for p in positional] == [not port.optional for port in s.inputs], s.op_type


def test_problems_name_the_attribute_and_the_rule():
    egm, tt, pa = schema.get("EventGatedMatMul"), schema.get("TTMatMul"), schema.get("PackedAttention")
    assert egm.problems({"block": 0}) == ["block = 0: must be >= 1"]
    assert egm.problems({"kwta": 1, "kwta_select": "mass"}) == ["kwta_select 'mass' needs kwta_temp > 0"]
    assert egm.problems({"kwta": 1, "kwta_select": "mass", "kwta_temp": 0.5}) == []
    assert egm.problems({"bogus": 1}) == ["unknown attribute 'bogus'"]
    assert tt.problems({}) == [f"missing attribute {n!r}" for n in ("modes_k", "modes_n", "ranks")]
    assert tt.problems({"modes_k": [4, 1], "modes_n": [1, 3], "ranks": [1, 2, 2]}) == [
        "ranks must have len(modes_k) + 1 entries, the first and the last 1"]
    assert pa.problems({"qbits": 17, "budget": 1.0}) == ["qbits = 17: must be in [2, 16]"]
    assert pa.problems({"eps_heads": [0.1, math.nan]}) == ["eps_heads = [0.1, nan]: must be >= 0, finite"]


def test_resolve_puts_the_node_values_on_the_defaults():
    s = schema.get("PackedAttention")
    r = s.resolve({"budget": 0.5, "not_an_attribute": 1})
    assert r["budget"] == 0.5 and r["window"] == s.attr("window").default and "not_an_attribute" not in r
    assert set(schema.defaults_json()) == set(schema.op_types())


@requires_native
@pytest.mark.parametrize("op_type,attr", checked_attrs(), ids=lambda x: x if isinstance(x, str) else x.name)
def test_kernel_accepts_what_the_schema_calls_valid(op_type, attr):
    """...and where a valid value breaks a cross-attribute rule with the other (required) values, the
    kernel refuses it too."""
    _, required = _OK[op_type]
    for v in inside(attr):
        if schema.get(op_type).problems({**required, attr.name: v}):
            with pytest.raises(Exception, match=f"node 'rule_{attr.name}'.*{attr.name}"):
                custom_ops.session(op_model(op_type, {**required, attr.name: v}, name=f"rule_{attr.name}"))
        else:
            custom_ops.session(op_model(op_type, {**required, attr.name: v}))


@requires_native
@pytest.mark.parametrize("op_type,attr", checked_attrs(), ids=lambda x: x if isinstance(x, str) else x.name)
def test_kernel_refuses_what_the_schema_calls_invalid(op_type, attr):
    _, required = _OK[op_type]
    for v in outside(attr):
        assert schema.get(op_type).problems({**required, attr.name: v})
        with pytest.raises(Exception, match=f"node 'bad_{attr.name}'"):
            custom_ops.session(op_model(op_type, {**required, attr.name: v}, name=f"bad_{attr.name}"))


@requires_native
def test_kernel_refuses_nodes_without_required_attributes():
    for s in schema.SCHEMAS:
        _, required = _OK[s.op_type]
        custom_ops.session(op_model(s.op_type, required))
        for a in s.attrs:
            if a.required:
                with pytest.raises(Exception, match=f"node 'no_{a.name}'.*{a.name}"):
                    custom_ops.session(op_model(s.op_type, {k: v for k, v in required.items() if k != a.name},
                                                name=f"no_{a.name}"))


@requires_native
def test_kernel_defaults_are_the_schema_defaults():
    """What the C++ kernels use for an omitted attribute (their attribute tables, exported by the
    library) is what the schema says, value and type."""
    native, ours = custom_ops.op_schema(), schema.defaults_json()
    assert native == ours
    for op, attrs in native.items():
        for k, v in attrs.items():
            assert type(v) is type(ours[op][k]), (op, k, v, ours[op][k])
