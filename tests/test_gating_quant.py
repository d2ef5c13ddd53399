"""EventGatedMatMul with quantized weights (weight_format int8 | int4): the numpy format definition
(custom_ops/reference/gating_quant.py), the native kernel against the reference on every gating
mode, odd shapes (K, N not multiples of the group or the 16-output int4 chunk), M in {1, 3, 128},
every ISA path this machine runs, and construction errors naming the node."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import custom_ops  # noqa: E402
from custom_ops import schema  # noqa: E402
from custom_ops.reference import gating_quant as gq  # noqa: E402
from custom_ops.reference.gating import event_gated_matmul, stateful  # noqa: E402
from conftest import requires_native  # noqa: E402
from test_gating_kernel import relu_x, run  # noqa: E402  (the f32 op's feeds and inputs, shared)

# (weight_format, zero points)
FORMATS = [("int8", False), ("int4", False), ("int4", True), ("int4k", False)]
FMT_IDS = ["int8", "int4", "int4_zp", "int4k"]


def _seed(key) -> int:
    """A seed per parameter set, the same in every process (hash() of strings is salted per process:
    the inputs, and a rare near-tie of the kernel's and the reference's block selection, changed
    from run to run)."""
    return zlib.crc32(repr(key).encode())


def grp(fmt, group):
    """int4k groups input rows in 16 | 32: the other formats' larger groups map to 32."""
    return min(group, 32) if fmt == "int4k" else group


def qmodel(W, fmt, group=32, zp=False, attrs=None, name="gate", with_state=None, extra_inputs=None,
           omit=(), extra_attrs=None):
    """A one-node model of the quantized op: W is quantized here with the reference."""
    attrs = dict(attrs or {})
    K, N = W.shape
    wq, s, z = gq.quantize(W, fmt, group, zp)
    st = stateful(attrs) if with_state is None else with_state
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)]
    inits = {"Wq": numpy_helper.from_array(wq, "Wq"), "scales": numpy_helper.from_array(s, "scales")}
    if z is not None:
        inits["zero_points"] = numpy_helper.from_array(z, "zero_points")
    for k, v in (extra_inputs or {}).items():
        inits[k] = numpy_helper.from_array(v, k)
    ins = ["X", "W" if "W" in inits else "", "past_state" if st else "", "Wq", "scales",
           "zero_points" if "zero_points" in inits else ""]
    ins = ["" if i in omit else i for i in ins]
    while ins[-1] == "":
        ins.pop()
    outs = ["Y"]
    out_vi = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)]
    if st:
        inputs.append(helper.make_tensor_value_info("past_state", TensorProto.FLOAT, ["batch", "past_len"]))
        outs.append("present_state")
        out_vi.append(helper.make_tensor_value_info("present_state", TensorProto.FLOAT, None))
    node_attrs = dict(attrs, weight_format=fmt, weight_group=group, weight_shape=[K, N])
    node_attrs.update(extra_attrs or {})
    node_attrs = {k: v for k, v in node_attrs.items() if v is not None}
    node = helper.make_node("EventGatedMatMul", ins, outs, name=name, domain="ai.ortlean", **node_attrs)
    g = helper.make_graph([node], "g", inputs, out_vi, initializer=[inits[i] for i in ins if i in inits])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortlean", 1)])
    m.ir_version = 10
    return m.SerializeToString(), (wq, s, z)


def ref(x, q, fmt, group, K, N, attrs, state=None):
    wq, s, z = q
    return event_gated_matmul(x, None, state, wq, s, z, weight_format=fmt, weight_group=group,
                              weight_shape=[K, N], **attrs)


# ------------------------------------------------------------------ the format (numpy only)
@pytest.mark.parametrize("fmt,zp", FORMATS[:3], ids=FMT_IDS[:3])  # row formats (int4k: below)
@pytest.mark.parametrize("group", [16, 32, 128])
def test_quantize_error_is_half_a_step(fmt, zp, group):
    rng = np.random.default_rng(group)
    K, N = 9, 77
    W = (rng.standard_normal((K, N)) * rng.uniform(0.01, 3, (K, 1))).astype(np.float32)
    W[3, :20] = 0.0  # an all-zero group keeps scale 1 and dequantizes to 0
    wq, s, z = gq.quantize(W, fmt, group, zp)
    assert wq.dtype == np.uint8 and wq.shape == (K, gq.row_bytes(fmt, N))
    assert s.shape == (K, -(-N // group)) and s.dtype == np.float32
    D = gq.dequantize(wq, s, fmt, group, N, z)
    step = np.repeat(s, group, axis=1)[:, :N].astype(np.float64)
    assert np.all(np.abs(D.astype(np.float64) - W) <= 0.5 * step * (1 + 1e-5) + 1e-12)
    if group <= 16:
        assert np.all(D[3, :16] == 0)


def test_int4_chunk_layout():
    """Output 16j + i: byte 8j + i % 8, low nibble for i < 8, high for i >= 8; nibbles past N are 0."""
    u = np.arange(20, dtype=np.uint8).reshape(1, 20) % 16
    p = gq.pack_int4(u)
    assert p.shape == (1, 16)
    assert p[0, 0] == (0 | (8 << 4)) and p[0, 7] == (7 | (15 << 4))
    assert p[0, 8] == (0 | (0 << 4)) and p[0, 11] == 3 and p[0, 12] == 0
    assert np.array_equal(gq.unpack_int4(p, 20), u)


def test_int8_is_twos_complement():
    W = np.array([[-1.0, 1.0, 0.5, -0.25]], np.float32)
    wq, s, _ = gq.quantize(W, "int8", 16)
    assert s[0, 0] == np.float32(1.0 / 127) and list(wq[0].view(np.int8)) == [-127, 127, 64, -32]


@pytest.mark.parametrize("group", [16, 32])
def test_int4k_quantize_error_is_half_a_step(group):
    rng = np.random.default_rng(group)
    K, N = 71, 45  # odd K (a padded last pair), N not a multiple of the 32-output chunk
    W = (rng.standard_normal((K, N)) * rng.uniform(0.01, 3, (1, N))).astype(np.float32)
    W[:group, 5] = 0.0  # an all-zero group keeps scale 1 and dequantizes to 0
    wq, s, z = gq.quantize(W, "int4k", group)
    assert z is None and wq.shape == (36, 64) and s.shape == (-(-K // group), N)
    D = gq.dequantize_k(wq, s, group, K, N)
    step = np.repeat(s, group, axis=0)[:K].astype(np.float64)
    assert np.all(np.abs(D.astype(np.float64) - W) <= 0.5 * step * (1 + 1e-5) + 1e-12)
    assert np.all(D[:group, 5] == 0) and s[0, 5] == 1.0
    # the weight of D is the reference's weight
    from custom_ops.reference.gating import weights
    assert np.array_equal(weights(None, wq, s, None, dict(weight_format="int4k", weight_group=group,
                                                          weight_shape=[K, N])), D)


def test_int4k_pair_layout():
    """byte (p, n) = u[2p, n] | u[2p+1, n] << 4 with u = q + 8; the missing odd row and outputs past N are 8."""
    q = (np.arange(3 * 33).reshape(3, 33) % 16 - 8).astype(np.int8)
    p = gq.pack_int4k(q, 33)
    q = q.astype(np.int32)
    assert p.shape == (2, 64)
    assert p[0, 0] == (q[0, 0] + 8) | ((q[1, 0] + 8) << 4) and p[0, 32] == (q[0, 32] + 8) | ((q[1, 32] + 8) << 4)
    assert p[1, 3] == (q[2, 3] + 8) | (8 << 4) and np.all(p[:, 33:] == 0x88)
    assert np.array_equal(gq.unpack_int4k(p, 3, 33).astype(np.int32), q)


def test_int4k_activation_product_definition():
    """quantize_activation: symmetric int8, ties to even; qmatvec_k = the integer sums scaled; it is
    NOT the f32 product (the tolerance of the kernel tests below tells them apart)."""
    v = np.array([127.0, 0.5, 1.5, -2.5, 0.0, -127.0], np.float32)
    xq, xs = gq.quantize_activation(v)
    assert list(xq) == [127, 0, 2, -2, 0, -127] and xs == np.float32(1.0)
    assert gq.quantize_activation(np.zeros(4, np.float32))[1] == 0
    rng = np.random.default_rng(2)
    K, N, G = 45, 40, 16
    W = rng.standard_normal((K, N)).astype(np.float32)
    wq, s, _ = gq.quantize(W, "int4k", G)
    x = rng.standard_normal(K).astype(np.float32)
    xq, xs = gq.quantize_activation(x)
    q = gq.unpack_int4k(wq, K, N).astype(np.int64)
    want = np.zeros(N)
    for g in range(-(-K // G)):
        acc = xq[g * G:(g + 1) * G].astype(np.int64) @ q[g * G:(g + 1) * G]
        want += float(xs) * acc * s[g].astype(np.float64)
    y = gq.qmatvec_k(x, wq, s, G, K, N)
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
    yf = x.astype(np.float64) @ gq.dequantize_k(wq, s, G, K, N)
    assert np.abs(y - yf).max() > 1e-3 * np.abs(yf).max()
    assert np.all(np.isnan(gq.qmatvec_k(np.where(np.arange(K) == 3, np.nan, x), wq, s, G, K, N)))
    # pair_keep: a pair is read when either channel is nonzero after quantization
    v = np.zeros(8, np.float32)
    v[[0, 5]] = 1.0
    v[2] = 1e-4  # quantizes to 0
    assert gq.pair_keep(v) == 0.5


def test_int4k_refuses_bad_groups_and_zero_points():
    W = np.ones((4, 8), np.float32)
    with pytest.raises(ValueError, match="int4k needs one of"):
        gq.quantize(W, "int4k", 64)
    with pytest.raises(ValueError, match="no zero points"):
        gq.quantize(W, "int4k", 32, True)


def test_schema_validates_the_format():
    s = schema.get("EventGatedMatMul")
    assert s.problems({"weight_format": "int3"}) == ["weight_format = 'int3': must be one of f32, int8, int4, int4k"]
    assert s.problems({"weight_group": 48})
    assert s.problems({"weight_format": "int4"}) == ["weight_format int8 | int4 needs weight_shape [K, N]"]
    assert s.problems({"weight_format": "int4", "weight_shape": [4, 8]}) == []
    assert s.problems({"weight_format": "int4k", "weight_shape": [4, 8], "weight_group": 64}) == [
        "weight_format int4k needs weight_group 16 | 32"]
    assert s.problems({"weight_format": "int4k", "weight_shape": [4, 8], "weight_group": 16}) == []


# ------------------------------------------------------------------ kernel vs reference
MODES = {
    "none": {},
    "zero_skip": dict(pack="binary"),
    "kwta_thr": dict(kwta=1, kwta_threshold=0.6),
    "kwta_thr_x": dict(kwta=1, kwta_threshold=0.5, kwta_score="x"),
    "kwta_topk": dict(kwta=1, kwta_select="topk", kwta_k=9),
    "kwta_mass_renorm": dict(kwta=1, kwta_select="mass", kwta_mass=0.6, kwta_temp=0.5, kwta_renorm=1),
    "zero_kwta": dict(pack="binary", kwta=1, kwta_threshold=0.4),
    "kwta_block16": dict(kwta=1, kwta_select="topk", kwta_k=3, block=16),
}


def _check(W, x, fmt, zp, group, attrs, threads=2):
    K, N = W.shape
    model, q = qmodel(W, fmt, group, zp, attrs)
    y, _ = run(custom_ops.session(model, threads=threads), x)
    yr, _ = ref(x, q, fmt, group, K, N, attrs)
    np.testing.assert_allclose(y, yr, rtol=2e-4, atol=2e-4 * np.abs(yr).max() + 1e-5)


@requires_native
@pytest.mark.parametrize("fmt,zp", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("M", [1, 3, 128])
def test_stateless_modes_vs_reference(fmt, zp, mode, M):
    rng = np.random.default_rng(_seed((fmt, zp, mode, M)))
    K, N = 70, 45  # N: not a multiple of the group (16) nor of the int4 chunk
    W = rng.standard_normal((K, N)).astype(np.float32) * 0.2
    _check(W, relu_x(rng, (M, K)), fmt, zp, 16, MODES[mode])


@requires_native
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("M", [1, 3, 128])
@pytest.mark.parametrize("group", [16, 32])
def test_int4k_odd_shapes_vs_reference(mode, M, group):
    """int4k: odd K (a padded last pair), K and N not multiples of the group or the 32-output chunk."""
    rng = np.random.default_rng(_seed((mode, M, group)))
    K, N = 71, 77
    W = rng.standard_normal((K, N)).astype(np.float32) * 0.2
    a = dict(MODES[mode])
    _check(W, relu_x(rng, (M, K)), "int4k", False, group, a)


@requires_native
@pytest.mark.parametrize("fmt,zp", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("M", [1, 3, 128])
@pytest.mark.parametrize("group", [32, 128])
def test_wide_shapes_split_on_the_pool(fmt, zp, M, group):
    """K, N large enough for column / row task splits and the dequantized-tile dense product."""
    rng = np.random.default_rng(M * 7 + group)
    K, N = 577, 1001
    W = rng.standard_normal((K, N)).astype(np.float32) * 0.05
    x = rng.standard_normal((M, K)).astype(np.float32)
    group = grp(fmt, group)
    _check(W, x, fmt, zp, group, dict(kwta=1, kwta_threshold=0.8))
    _check(W, x, fmt, zp, group, dict(kwta=1, kwta_select="topk", kwta_k=200))
    _check(W, x, fmt, zp, group, {})


@requires_native
@pytest.mark.parametrize("K,N", [(301, 1601), (577, 1001)])  # column tasks (N / 4 >= 384) / pair-row tasks
def test_int4k_matvec_task_splits(K, N):
    rng = np.random.default_rng(K)
    W = rng.standard_normal((K, N)).astype(np.float32) * 0.05
    for M in (1, 2):  # M = 2: the dense product over dequantized tiles
        x = relu_x(rng, (M, K), 0.3)
        _check(W, x, "int4k", False, 32, dict(kwta=1, kwta_threshold=0.02))
        _check(W, x, "int4k", False, 16, {})


@requires_native
@pytest.mark.parametrize("fmt,zp", FORMATS, ids=FMT_IDS)
def test_batched_rows_take_both_paths(fmt, zp):
    """Several rows: per-row matvecs over the quantized rows when little is kept, one dense product
    over dequantized tiles when much is kept; both equal the reference. int4k: several rows are
    always one dense product (its one-row products quantize the activations)."""
    rng = np.random.default_rng(3)
    K, N = 577, 300
    W = rng.standard_normal((K, N)).astype(np.float32) * 0.05
    wq, sc, z = gq.quantize(W, fmt, 32, zp)
    D = gq.dequantize_k(wq, sc, 32, K, N) if fmt == "int4k" else gq.dequantize(wq, sc, fmt, 32, N, z)
    norms = np.linalg.norm(D, axis=1)
    for M in (3, 8):
        x = relu_x(rng, (M, K), 0.2)
        score = np.abs(x) * norms[None, :]
        for keep, dense in ((0.03, False), (0.9, True)):
            a = dict(kwta=1, kwta_threshold=float(np.quantile(score, 1 - keep)))
            custom_ops.reset_metrics()
            _check(W, x, fmt, zp, 32, a)
            m = custom_ops.metrics()["gate"]
            assert m["gate.rows"] == M
            assert (m["gate.dense_product_rows"] == M) == (dense or fmt == "int4k"), (M, keep, m)


@requires_native
@pytest.mark.parametrize("fmt,zp", FORMATS, ids=FMT_IDS)
def test_keep_all_equals_ungated_exactly(fmt, zp):
    rng = np.random.default_rng(5)
    K, N = 130, 211
    W = rng.standard_normal((K, N)).astype(np.float32)
    for M in (1, 3, 128):
        x = rng.standard_normal((M, K)).astype(np.float32)
        yd, _ = run(custom_ops.session(qmodel(W, fmt, 32, zp, {})[0], threads=2), x)
        yk, _ = run(custom_ops.session(qmodel(W, fmt, 32, zp, dict(kwta=1, kwta_select="topk", kwta_k=K))[0],
                                       threads=2), x)
        assert np.array_equal(yd, yk)


EVENT_MODES = {
    "event": dict(event=1, event_gap_every=0),
    "event_topk_stale": dict(event=1, event_topk=0.3, event_beta=0.9, event_lambda=0.3, event_age_max=4,
                             event_gap_every=0),
    "event_quorum_block16": dict(event=1, event_quorum=0.7, event_theta=0.01, block=16, event_gap_every=5,
                                 event_gap_tol=10.0),
    "event_kwta_duty_zero": dict(event=1, kwta=1, kwta_select="topk", kwta_k=40, kwta_duty=3, pack="binary",
                                 event_topk=0.6, event_gap_every=4, event_gap_tol=10.0),
    "duty_only": dict(kwta=1, kwta_select="topk", kwta_k=30, kwta_duty=4),
}


def _stream(rng, T, K, change=0.15):
    x = rng.standard_normal(K).astype(np.float32)
    out = []
    for _ in range(T):
        m = rng.random(K) < change
        x = x.copy()
        x[m] = rng.standard_normal(int(m.sum())).astype(np.float32)
        out.append(x)
    xs = np.stack(out)
    xs[:, : K // 5] = 0.0
    return xs


@requires_native
@pytest.mark.parametrize("fmt,zp", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("mode", list(EVENT_MODES))
def test_stateful_modes_vs_reference(fmt, zp, mode):
    rng = np.random.default_rng(_seed((fmt, zp, mode)))
    K, N, B, T, P = 70, 45, 2, 12, 3
    W = rng.standard_normal((K, N)).astype(np.float32) * 0.2
    a = EVENT_MODES[mode]
    model, q = qmodel(W, fmt, 16, zp, a)
    s = custom_ops.session(model, threads=2)
    xs = np.stack([_stream(rng, T, K) for _ in range(B)])
    y, st = run(s, xs[:, :P], B=B)
    yr, sr = ref(xs[:, :P], q, fmt, 16, K, N, a)
    ys, yrs = [y], [yr]
    for t in range(P, T):
        y, st = run(s, xs[:, t:t + 1], st)
        yr, sr = ref(xs[:, t:t + 1], q, fmt, 16, K, N, a, sr)
        ys.append(y)
        yrs.append(yr)
    y, yr = np.concatenate(ys, 1), np.concatenate(yrs, 1)
    np.testing.assert_allclose(y, yr, rtol=1e-3, atol=1e-3 * np.abs(yr).max())
    np.testing.assert_allclose(st, sr, rtol=1e-3, atol=1e-3 * max(np.abs(sr).max(), 1))


# ------------------------------------------------------------------ every ISA path
_ISA_SCRIPT = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests")
import custom_ops
from test_gating_quant import qmodel, ref, run, relu_x, grp, FORMATS, MODES
bad = []
rng = np.random.default_rng(0)
for (K, N, group0) in ((70, 45, 16), (33, 100, 32), (577, 1001, 64)):
    W = rng.standard_normal((K, N)).astype(np.float32) * 0.1
    for fmt, zp in FORMATS:
        group = grp(fmt, group0)
        for mode in ("none", "kwta_thr", "kwta_topk", "zero_kwta", "kwta_block16"):
            a = dict(MODES[mode])
            if "kwta_k" in a:
                a["kwta_k"] = min(a["kwta_k"], -(-K // a.get("block", 1)))
            model, q = qmodel(W, fmt, group, zp, a)
            s = custom_ops.session(model, threads=2)
            for M in (1, 3, 128):
                x = relu_x(rng, (M, K))
                y, _ = run(s, x)
                yr, _ = ref(x, q, fmt, group, K, N, a)
                if not np.allclose(y, yr, rtol=2e-4, atol=2e-4 * np.abs(yr).max() + 1e-5):
                    bad.append((K, N, fmt, zp, mode, M, float(np.abs(y - yr).max())))
print(json.dumps({"isa": custom_ops.isa(), "bad": bad}))
"""


@requires_native
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_isa_paths(isa):
    env = dict(os.environ, ORTLEAN_ISA=isa)
    r = subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(ROOT)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    if res["isa"] != isa:
        pytest.skip(f"CPU has no {isa} (ran {res['isa']})")
    assert not res["bad"], res["bad"]


# ------------------------------------------------------------------ construction errors
W0 = np.random.default_rng(1).standard_normal((40, 24)).astype(np.float32)
_BAD = {
    "with_W": (dict(extra_inputs={"W": W0}), "not input W"),
    "no_shape": (dict(extra_attrs={"weight_shape": None}), "needs attribute weight_shape"),
    "shape_mismatch": (dict(extra_attrs={"weight_shape": [40, 40]}), "input Wq has shape"),
    "group_not_pow2": (dict(extra_attrs={"weight_group": 48}), "weight_group must be a power of two"),
    "group_small": (dict(extra_attrs={"weight_group": 8}), "weight_group"),
    "format_bogus": (dict(extra_attrs={"weight_format": "int3"}), "weight_format"),
    "no_scales": (dict(omit=("scales",)), "scales"),
    "no_wq": (dict(omit=("Wq",)), "Wq"),
}


@requires_native
@pytest.mark.parametrize("bad", list(_BAD))
def test_bad_quantized_nodes_refused_naming_the_node(bad):
    kw, msg = _BAD[bad]
    model, _ = qmodel(W0, "int4", 16, False, {}, name=f"bad_{bad}", **kw)
    with pytest.raises(Exception, match=f"node 'bad_{bad}'.*{msg}"):
        custom_ops.session(model)


_BAD_K = {
    "group64": (dict(extra_attrs={"weight_group": 64}), "int4k needs attribute weight_group 16 or 32"),
    "shape_mismatch": (dict(extra_attrs={"weight_shape": [41, 24]}), "input Wq has shape"),
    "zero_points": (dict(extra_inputs={"zero_points": np.zeros((3, 24), np.uint8)}), "int4k is symmetric"),
    "scales_rows_major": (dict(extra_inputs={"scales": np.ones((40, 2), np.float32)}), "input scales has shape"),
    "with_W": (dict(extra_inputs={"W": W0}), "not input W"),
}


@requires_native
@pytest.mark.parametrize("bad", list(_BAD_K))
def test_bad_int4k_nodes_refused_naming_the_node(bad):
    kw, msg = _BAD_K[bad]
    model, _ = qmodel(W0, "int4k", 16, False, {}, name=f"badk_{bad}", **kw)
    with pytest.raises(Exception, match=f"node 'badk_{bad}'.*{msg}"):
        custom_ops.session(model)


@requires_native
def test_bad_zero_points_refused():
    wq, s, z = gq.quantize(W0, "int4", 16, True)
    z = z.copy()
    z[0, 0] = 16
    model, _ = qmodel(W0, "int4", 16, True, {}, name="zp16", extra_inputs={"zero_points": z})
    with pytest.raises(Exception, match="node 'zp16'.*zero_points must be in"):
        custom_ops.session(model)
    # int8 is symmetric: zero points are refused
    wq8, s8, _ = gq.quantize(W0, "int8", 16)
    model, _ = qmodel(W0, "int8", 16, False, {}, name="zp8",
                      extra_inputs={"zero_points": np.zeros_like(s8, dtype=np.uint8)})
    with pytest.raises(Exception, match="node 'zp8'.*int4 only"):
        custom_ops.session(model)
    # a non-finite scale
    s_bad = s.copy()
    s_bad[1, 0] = np.inf
    model, _ = qmodel(W0, "int4", 16, False, {}, name="inf_scale", extra_inputs={"scales": s_bad})
    with pytest.raises(Exception, match="node 'inf_scale'.*non-finite"):
        custom_ops.session(model)


@requires_native
def test_f32_node_refuses_quantized_inputs():
    wq, s, _ = gq.quantize(W0, "int8", 16)
    inits = [numpy_helper.from_array(W0, "W"), numpy_helper.from_array(wq, "Wq"), numpy_helper.from_array(s, "scales")]
    node = helper.make_node("EventGatedMatMul", ["X", "W", "", "Wq", "scales"], ["Y"], name="f32q", domain="ai.ortlean")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortlean", 1)])
    m.ir_version = 10
    with pytest.raises(Exception, match="node 'f32q'.*weight_format int8 | int4"):
        custom_ops.session(m.SerializeToString())
