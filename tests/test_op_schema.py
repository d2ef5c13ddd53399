"""ortlean_op_schema_json: the attribute defaults the native kernels report are the ones they use.

For every op: a node carrying only its required attributes and the same node carrying every
reported default explicitly give bit-identical outputs and the same static metrics."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import AttributeProto, TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import custom_ops  # noqa: E402
from conftest import requires_native  # noqa: E402

pytestmark = requires_native
OPS = ("TTMatMul", "ProcSparseMatMul", "EventGatedMatMul", "PackedAttention", "BlockQuantMatMul", "BlockQuantGather")
OPS_WITH_DEFAULTS = OPS  # every op has a default beyond gap = NaN (BlockQuantGather: layout)


def _attr(name, value):
    if isinstance(value, list) and not value:  # an empty list has no type of its own
        return helper.make_attribute(name, [], attr_type=AttributeProto.FLOATS)
    return helper.make_attribute(name, value)


def _case(op: str, rng, variant: str = ""):
    """(inputs as (name, array) feeds, initializers, required attributes, input names, n outputs)."""
    if op == "TTMatMul":
        K, N, r = 12, 10, 3
        inits = [numpy_helper.from_array(rng.standard_normal((1, K, 1, r)).astype(np.float32), "G1"),
                 numpy_helper.from_array(rng.standard_normal((r, 1, N, 1)).astype(np.float32), "G2")]
        return ({"X": rng.standard_normal((3, K)).astype(np.float32)}, inits,
                dict(modes_k=[K, 1], modes_n=[1, N], ranks=[1, r, 1]), ["X", "G1", "G2"], 1)
    if op == "ProcSparseMatMul":
        K, N, B = 70, 5, 32
        row_ptr = np.array([0, 1, 3, 3, 4, 6], np.int32)
        bidx = np.array([0, 0, 2, 1, 1, 2], np.int32)
        inits = [numpy_helper.from_array(row_ptr, "row_ptr"), numpy_helper.from_array(bidx, "block_idx"),
                 numpy_helper.from_array(rng.standard_normal((6, B)).astype(np.float32), "deltas")]
        return ({"X": rng.standard_normal((2, K)).astype(np.float32)}, inits,
                dict(shape=[K, N], block=B, seed=7, base_scale=0.05), ["X", "row_ptr", "block_idx", "deltas"], 1)
    if op == "BlockQuantMatMul":
        from custom_ops.reference import blockquant as bq

        K, N = 64, 5
        inits = [numpy_helper.from_array(bq.random_blocks("q4_1", N, K, rng), "W")]
        return {"X": rng.standard_normal((2, K)).astype(np.float32)}, inits, dict(format="q4_1", K=K, N=N), ["X", "W"], 1
    if op == "BlockQuantGather":
        from custom_ops.reference import blockquant as bq

        K, N = 64, 5
        inits = [numpy_helper.from_array(bq.random_blocks("q4_1", N, K, rng), "W")]
        return {"ids": np.array([[0, 4], [2, 2]], np.int64)}, inits, dict(format="q4_1", K=K, N=N), ["W", "ids"], 1
    if op == "EventGatedMatMul":
        K, N = 40, 24
        inits = [numpy_helper.from_array(rng.standard_normal((K, N)).astype(np.float32), "W")]
        return {"X": rng.standard_normal((2, 3, K)).astype(np.float32)}, inits, {}, ["X", "W"], 1
    # "approx": a context above the default min_context with a budget, so that the defaults of
    # the candidate search (sinks, window, min_candidates, qbits, mode, eps) decide the output
    B, H, T, D = 1, 2, 300, 16
    feeds = {n: rng.standard_normal((B, H, t, D)).astype(np.float32) for n, t in (("Q", 1), ("K", T), ("V", T))}
    return feeds, [], (dict(budget=0.3) if variant == "approx" else {}), ["Q", "K", "V"], 1


def _run(op, feeds, inits, attrs, ins, n_out, name):
    node = helper.make_node(op, ins, [f"Y{i}" for i in range(n_out)], name=name, domain="ai.ortlean")
    node.attribute.extend(_attr(k, v) for k, v in attrs.items())
    g = helper.make_graph([node], "g",
                          [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                           for k, v in feeds.items()],
                          [helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, None) for i in range(n_out)],
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortlean", 1)])
    m.ir_version = 10
    out = custom_ops.session(m.SerializeToString(), threads=1).run(None, feeds)
    return out, custom_ops.metrics()[name]


def test_schema_lists_every_op_with_typed_defaults():
    schema = custom_ops.op_schema()
    assert set(schema) == set(OPS)
    eg = schema["EventGatedMatMul"]
    # floats stay floats in the JSON (1.0, not 1), ints stay ints
    assert isinstance(eg["pack_rho"], float) and isinstance(eg["block"], int) and eg["kwta_select"] == "threshold"
    assert schema["PackedAttention"]["eps_heads"] == [] and schema["TTMatMul"]["gap"] is None
    # required attributes have no default
    assert "modes_k" not in schema["TTMatMul"] and "block" not in schema["ProcSparseMatMul"]
    assert schema["BlockQuantMatMul"] == {"gap": None, "act_bits": 8, "prefill_act_bits": 0, "glu": "none", "layout": "blocks"}
    assert schema["BlockQuantGather"] == {"gap": None, "layout": "blocks"}


@pytest.mark.parametrize("op,variant", [(op, "") for op in OPS_WITH_DEFAULTS] + [("PackedAttention", "approx")])
def test_reported_defaults_are_the_defaults_used(op, variant):
    rng = np.random.default_rng(0)
    feeds, inits, req, ins, n_out = _case(op, rng, variant)
    defaults = {k: v for k, v in custom_ops.op_schema()[op].items() if v is not None and k not in req}
    assert defaults, op
    y0, m0 = _run(op, feeds, inits, req, ins, n_out, f"schema_{op}{variant}_bare")
    y1, m1 = _run(op, feeds, inits, {**req, **defaults}, ins, n_out, f"schema_{op}{variant}_explicit")
    for a, b in zip(y0, y1):
        assert np.array_equal(a, b)
    assert m0 == m1
