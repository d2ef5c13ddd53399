"""A synthetic model over 2 GB: loads with external data, is rewritten without reading the big
tensor into a protobuf, saves with external data atomically, and runs in ORT."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("big")
    K, NB = 8192, 65600  # 8192 * 65600 * 4 B = 2.15 GB
    rng = np.random.default_rng(0)
    x = ir.val("x", ir.DataType.FLOAT, ["M", K])
    wb = ir.Value(name="W_big", const_value=ir.tensor(np.ones((K, NB), np.float32) * 1e-3, name="W_big"))
    w1 = ir.Value(name="W_small", const_value=ir.tensor(rng.standard_normal((K, 64)).astype(np.float32), name="W_small"))
    n_big = ir.Node("", "MatMul", [x, wb], name="big_MatMul", num_outputs=1)
    n_small = ir.Node("", "MatMul", [x, w1], name="small_MatMul", num_outputs=1)
    n_big.outputs[0].name = "big"
    n_small.outputs[0].name = "small"
    for v, n in ((n_big.outputs[0], NB), (n_small.outputs[0], 64)):
        v.type = ir.TensorType(ir.DataType.FLOAT)
        v.shape = ir.Shape(["M", n])
    g = ir.Graph([x], [n_big.outputs[0], n_small.outputs[0]], nodes=[n_big, n_small], initializers=[wb, w1],
                 opset_imports={"": 17}, name="big")
    m = ir.Model(g, ir_version=10)
    p = d / "big.onnx"
    ir.save(m, p, external_data="big.onnx.data")
    assert (d / "big.onnx.data").stat().st_size > 2**31
    return p


@pytest.mark.heavy  # ~40 s: writes, rewrites and runs a 2.15 GB model
def test_rewrite_model_over_2gb(big_model, tmp_path):
    out = tmp_path / "lean" / "big.lean.onnx"
    p = subprocess.run([sys.executable, "-m", "rewriter.cli", "rewrite", str(big_model), "-o", str(out), "--tt=on",
                        "--tt-target=all", "--include", "small_*", "--tt-whiten=none", "--tt-gap=1.0",
                        "--tt-speed-check=off", "--quality-budget=off", "-q"],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    assert (out.parent / "big.lean.onnx.data").stat().st_size > 2**31
    proto = onnx.load(str(out), load_external_data=False)
    assert any(n.op_type == "TTMatMul" for n in proto.graph.node)
    assert not [f for f in out.parent.iterdir() if f.name.startswith(".ortlean-")]  # no temp leftovers
    import custom_ops

    sess = custom_ops.session(str(out), threads=2, backend="auto")
    x = np.random.default_rng(1).standard_normal((1, 8192)).astype(np.float32)
    big, small = sess.run(["big", "small"], {"x": x})
    np.testing.assert_allclose(big, np.full((1, 65600), x.sum() * 1e-3, np.float32), rtol=1e-3, atol=1e-3)
    assert small.shape == (1, 64) and np.isfinite(small).all()
