"""Native EventGatedMatMul against the numpy reference custom_ops.reference.gating, on every ISA
path (forced per subprocess with ORTLEAN_ISA), every mode and combination, odd shapes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import custom_ops  # noqa: E402
from custom_ops.reference.gating import event_gated_matmul, state_size, stateful  # noqa: E402
from conftest import requires_native  # noqa: E402

pytestmark = requires_native


def _seed(key) -> int:
    """A seed per parameter set, the same in every process (hash() of strings is salted per process:
    the inputs, and a rare near-tie of the kernel's and the reference's block selection, changed
    from run to run)."""
    return zlib.crc32(repr(key).encode())


def gate_model(W, attrs, *, name="gate", xshape=None, with_state=None, w_const=True) -> bytes:
    K, N = W.shape
    st = stateful(attrs) if with_state is None else with_state
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, xshape)]
    inits = [numpy_helper.from_array(np.asarray(W, np.float32), "W")] if w_const else []
    if not w_const:
        inputs.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, [K, N]))
    ins, outs = ["X", "W"], ["Y"]
    out_vi = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)]
    if st:
        inputs.append(helper.make_tensor_value_info("past_state", TensorProto.FLOAT, ["batch", "past_len"]))
        ins.append("past_state")
        outs.append("present_state")
        out_vi.append(helper.make_tensor_value_info("present_state", TensorProto.FLOAT, None))
    node = helper.make_node("EventGatedMatMul", ins, outs, name=name, domain="ai.ortlean", **attrs)
    g = helper.make_graph([node], "g", inputs, out_vi, initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortlean", 1)])
    m.ir_version = 10
    return m.SerializeToString()


def sess(model, threads=1):
    return custom_ops.session(model, threads=threads)


def run(s, x, state=None, B=None):
    feeds = {"X": x}
    names = [i.name for i in s.get_inputs()]
    if "past_state" in names:
        if state is None:
            b = B if B is not None else (int(np.prod(x.shape[:-2])) if x.ndim >= 3 else int(np.prod(x.shape[:-1])))
            state = np.zeros((b, 0), np.float32)
        feeds["past_state"] = state
    out = s.run(None, feeds)
    return out[0], (out[1] if len(out) > 1 else None)


def relu_x(rng, shape, frac_zero=0.5):
    x = rng.standard_normal(shape).astype(np.float32)
    x[rng.random(shape) < frac_zero] = 0.0
    return x


# modes and combinations (block 1 and a block that does not divide K)
MODES = {
    "none": {},
    "zero_skip": dict(pack="binary", pack_eps=0.0),
    "zero_skip_eps_rho": dict(pack="ternary", pack_eps=0.3, pack_rho=0.9),
    "kwta_thr": dict(kwta=1, kwta_threshold=0.6),
    "kwta_thr_x": dict(kwta=1, kwta_threshold=0.5, kwta_score="x"),
    "kwta_topk": dict(kwta=1, kwta_select="topk", kwta_k=9),
    "kwta_mass": dict(kwta=1, kwta_select="mass", kwta_mass=0.6, kwta_temp=0.5),
    "kwta_topk_renorm": dict(kwta=1, kwta_select="topk", kwta_k=9, kwta_renorm=1),
    "zero_kwta": dict(pack="binary", kwta=1, kwta_threshold=0.4),
    "kwta_block16": dict(kwta=1, kwta_select="topk", kwta_k=3, block=16),
    "kwta_thr_block16": dict(kwta=1, kwta_threshold=0.5, block=16),
    "zero_block16": dict(pack="binary", block=16),
}


def _check_case(W, x, attrs, threads=1):
    s = sess(gate_model(W, attrs), threads)
    y, st = run(s, x)
    yr, sr = event_gated_matmul(x, W, None, **attrs)
    np.testing.assert_allclose(y, yr, rtol=2e-4, atol=2e-4 * np.abs(yr).max() + 1e-5)
    return s


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("M", [1, 3, 128])
def test_stateless_modes_vs_reference(mode, M):
    rng = np.random.default_rng(_seed((mode, M)))
    K, N = 70, 45  # K not divisible by 16
    W = rng.standard_normal((K, N)).astype(np.float32) * 0.2
    x = relu_x(rng, (M, K))
    a = dict(MODES[mode])
    if a.get("kwta_k"):
        a["kwta_k"] = min(a["kwta_k"], -(-K // a.get("block", 1)))
    _check_case(W, x, a, threads=2)


@pytest.mark.parametrize("M", [1, 3, 128])
def test_big_shape_threshold(M):
    rng = np.random.default_rng(M)
    K, N = 577, 300
    W = rng.standard_normal((K, N)).astype(np.float32) * 0.05
    x = rng.standard_normal((M, K)).astype(np.float32)
    _check_case(W, x, dict(kwta=1, kwta_threshold=0.8), threads=2)
    _check_case(W, x, dict(kwta=1, kwta_select="topk", kwta_k=100), threads=2)


@pytest.mark.parametrize("attrs", [dict(kwta=1), dict(kwta=1, block=16), dict(kwta=1, pack="binary")],
                         ids=["thr", "thr_block16", "thr_zero_skip"])
def test_batched_rows_take_both_paths(attrs):
    """Several rows: per-row gated matvecs when little is kept, one dense product over x~ when
    much is kept (cost rule per_row_wins); both match the reference."""
    rng = np.random.default_rng(11)
    K, N = 577, 300
    W = rng.standard_normal((K, N)).astype(np.float32) * 0.05
    for M in (2, 3, 8):
        x = relu_x(rng, (M, K), 0.2)
        score = np.abs(x) * np.linalg.norm(W, axis=1)[None, :]
        for keep, dense in ((0.05, False), (0.9, True)):
            a = dict(attrs, kwta_threshold=float(np.quantile(score, 1 - keep)))
            custom_ops.reset_metrics()
            _check_case(W, x, a, threads=2)
            m = custom_ops.metrics()["gate"]
            assert m["gate.rows"] == M
            assert (m["gate.dense_product_rows"] == M) == dense, (M, keep, m)


def test_keep_all_equals_dense_exactly():
    rng = np.random.default_rng(5)
    K, N = 577, 311
    W = rng.standard_normal((K, N)).astype(np.float32)
    for M in (1, 3, 128):
        x = rng.standard_normal((M, K)).astype(np.float32)
        yd, _ = run(sess(gate_model(W, {}), 2), x)
        yk, _ = run(sess(gate_model(W, dict(kwta=1, kwta_select="topk", kwta_k=K)), 2), x)
        yt, _ = run(sess(gate_model(W, dict(kwta=1, kwta_threshold=0.0, pack="binary", pack_rho=1.0)), 2), x)
        assert np.array_equal(yd, yk) and np.array_equal(yd, yt)
        np.testing.assert_allclose(yd, x @ W, rtol=1e-4, atol=1e-3)


def _stream(rng, T, K, change=0.05, zero=0.0):
    """Time-correlated stream: each step changes ~`change` of the channels."""
    x = rng.standard_normal(K).astype(np.float32)
    out = []
    for _ in range(T):
        m = rng.random(K) < change
        x = x.copy()
        x[m] = rng.standard_normal(int(m.sum())).astype(np.float32)
        out.append(x)
    xs = np.stack(out)
    if zero:
        xs[:, : int(zero * K)] = 0.0
    return xs


EVENT_MODES = {
    "event": dict(event=1, event_gap_every=0),
    "event_topk": dict(event=1, event_topk=0.3, event_gap_every=0),
    "event_quorum_theta": dict(event=1, event_quorum=0.7, event_theta=0.01, event_gap_every=5, event_gap_tol=10.0),
    "event_stale": dict(event=1, event_topk=0.2, event_beta=0.9, event_lambda=0.3, event_age_max=4, event_gap_every=0),
    "event_block16": dict(event=1, event_topk=0.5, block=16, event_gap_every=7, event_gap_tol=10.0),
    "event_kwta": dict(event=1, kwta=1, kwta_threshold=0.4, event_topk=0.5, event_gap_every=0),
    "event_kwta_duty_zero": dict(event=1, kwta=1, kwta_select="topk", kwta_k=40, kwta_duty=3, pack="binary",
                                 event_topk=0.6, event_gap_every=4, event_gap_tol=10.0),
    "duty_only": dict(kwta=1, kwta_select="topk", kwta_k=30, kwta_duty=4),
}


def _drive(s, xs, B=1, attrs=None, prefill=3):
    """Prefill `prefill` tokens (one call, [B, T, K]), then one call per token; returns Y rows and
    the final state. Same for the reference."""
    K = xs.shape[-1]
    ys, yrs = [], []
    y, st = run(s, xs[:, :prefill], B=B)
    yr, sr = event_gated_matmul(xs[:, :prefill], W_of(s), None, **attrs)
    ys.append(y)
    yrs.append(yr)
    for t in range(prefill, xs.shape[1]):
        y, st = run(s, xs[:, t:t + 1], st)
        yr, sr = event_gated_matmul(xs[:, t:t + 1], W_of(s), sr, **attrs)
        ys.append(y)
        yrs.append(yr)
    return np.concatenate(ys, 1), np.concatenate(yrs, 1), st, sr


_W_REG = {}


def W_of(s):
    return _W_REG[id(s)]


@pytest.mark.parametrize("mode", list(EVENT_MODES))
def test_stateful_modes_vs_reference(mode):
    rng = np.random.default_rng(abs(hash(mode)) % 2**32)
    K, N, B, T = 70, 45, 2, 14
    W = rng.standard_normal((K, N)).astype(np.float32) * 0.2
    a = EVENT_MODES[mode]
    xs = np.stack([_stream(rng, T, K, 0.15, zero=0.2) for _ in range(B)])
    s = sess(gate_model(W, a), 2)
    _W_REG[id(s)] = W
    y, yr, st, sr = _drive(s, xs, B=B, attrs=a)
    np.testing.assert_allclose(y, yr, rtol=1e-3, atol=1e-3 * np.abs(yr).max())
    np.testing.assert_allclose(st, sr, rtol=1e-3, atol=1e-3 * max(np.abs(sr).max(), 1))
    assert st.shape == (B, state_size(K, N, a.get("block", 1)))


def test_event_zero_delta_returns_cache():
    rng = np.random.default_rng(3)
    K, N = 96, 40
    W = rng.standard_normal((K, N)).astype(np.float32)
    a = dict(event=1, event_gap_every=0)
    s = sess(gate_model(W, a))
    x = rng.standard_normal((1, 1, K)).astype(np.float32)
    y0, st = run(s, x)
    cache = st[0, 8 + K: 8 + K + N].copy()
    y1, st1 = run(s, x, st)
    assert np.array_equal(y1[0, 0], cache)
    assert np.array_equal(st1[0, 8 + K: 8 + K + N], cache)
    # the ages grow, step counts
    assert st1[0, 1] == 1 and np.all(st1[0, 8 + K + N: 8 + K + N + K] == 1)


def test_event_delta_is_exact_without_limits():
    rng = np.random.default_rng(4)
    K, N = 200, 64
    W = rng.standard_normal((K, N)).astype(np.float32)
    s = sess(gate_model(W, dict(event=1, event_gap_every=0)))
    xs = _stream(rng, 10, K, 0.1)
    _, st = run(s, xs[None, :1])
    for t in range(1, 10):
        y, st = run(s, xs[None, t:t + 1], st)
        np.testing.assert_allclose(y[0, 0], xs[t] @ W, rtol=1e-4, atol=1e-3)


def test_duty_reuses_mask():
    rng = np.random.default_rng(6)
    K, N = 64, 32
    W = rng.standard_normal((K, N)).astype(np.float32)
    a = dict(kwta=1, kwta_select="topk", kwta_k=8, kwta_duty=3)
    s = sess(gate_model(W, a))
    custom_ops.reset_metrics()
    x = rng.standard_normal((1, 1, K)).astype(np.float32)
    _, st = run(s, x)
    m0 = st[0, -K:].copy()
    for step in range(1, 7):
        x = rng.standard_normal((1, 1, K)).astype(np.float32)
        y, st = run(s, x, st)
        m = st[0, -K:]
        if step % 3:
            assert np.array_equal(m, m0)  # reused between refreshes
            np.testing.assert_allclose(y[0, 0], (x[0, 0] * m0) @ W, rtol=1e-4, atol=1e-4)
        else:
            m0 = m.copy()
            assert m.sum() == 8
    met = custom_ops.metrics()["gate"]
    assert met["kwta.duty_hits"] == 4


def test_staleness_age_max_forces_refresh():
    rng = np.random.default_rng(7)
    K, N = 32, 16
    W = rng.standard_normal((K, N)).astype(np.float32)
    # topk 1/32: one channel per step; age_max 3 forces every channel stale for 3 steps back in
    a = dict(event=1, event_topk=1 / 32, event_age_max=3, event_gap_every=0)
    s = sess(gate_model(W, a))
    x0 = rng.standard_normal((1, 1, K)).astype(np.float32)
    _, st = run(s, x0)
    x1 = x0 + 1.0
    y, st = run(s, x1, st)   # step 1: one channel taken; ages of the rest 1
    y, st = run(s, x1, st)   # step 2: ages 2
    y, st = run(s, x1, st)   # step 3: ages 3 ...
    y, st = run(s, x1, st)   # step 4: every block with age >= 3 is forced: output exact
    np.testing.assert_allclose(y[0, 0], x1[0, 0] @ W, rtol=1e-4, atol=1e-3)
    ages = st[0, 8 + K + N: 8 + K + N + K]
    assert ages.max() <= 3


def test_auto_disable_on_uncorrelated_input():
    rng = np.random.default_rng(8)
    K, N = 128, 64
    W = rng.standard_normal((K, N)).astype(np.float32)
    a = dict(event=1, event_topk=0.25, event_gap_every=4, event_gap_tol=0.03)
    s = sess(gate_model(W, a, name="ev_dis"))
    custom_ops.reset_metrics()
    _, st = run(s, rng.standard_normal((1, 1, K)).astype(np.float32))
    for t in range(1, 9):
        x = rng.standard_normal((1, 1, K)).astype(np.float32)  # every step independent
        y, st = run(s, x, st)
        if t >= 4:
            np.testing.assert_allclose(y[0, 0], x[0, 0] @ W, rtol=1e-4, atol=1e-3)  # check step or disabled
    assert st[0, 2] == 1.0 and st[0, 3] > 0.03
    met = custom_ops.metrics()["ev_dis"]
    assert met["event.disables"] == 1 and met["event.enabled"] == 0.0
    # a new sequence (empty state) starts enabled again
    _, st2 = run(s, rng.standard_normal((1, 1, K)).astype(np.float32))
    assert st2[0, 2] == 0.0


def test_stays_enabled_on_correlated_stream():
    rng = np.random.default_rng(9)
    K, N = 256, 64
    W = rng.standard_normal((K, N)).astype(np.float32)
    a = dict(event=1, event_topk=0.3, event_gap_every=4, event_gap_tol=0.03)
    s = sess(gate_model(W, a))
    xs = _stream(rng, 30, K, 0.05)
    _, st = run(s, xs[None, :1])
    for t in range(1, 30):
        _, st = run(s, xs[None, t:t + 1], st)
    assert st[0, 2] == 0.0


def test_concurrent_runs_isolated():
    """4 threads, one session, different sequences: each thread's outputs equal a sequential
    run of its own sequence (state is graph I/O: no sharing between Run() calls)."""
    rng = np.random.default_rng(10)
    K, N, T = 300, 200, 25
    W = rng.standard_normal((K, N)).astype(np.float32) * 0.1
    a = dict(event=1, kwta=1, kwta_select="topk", kwta_k=200, kwta_duty=2, event_topk=0.5, event_gap_every=6,
             event_gap_tol=0.5)
    s = sess(gate_model(W, a), threads=2)
    seqs = [_stream(np.random.default_rng(100 + i), T, K, 0.1 * (i + 1)) for i in range(4)]

    def drive(xs):
        ys = []
        y, st = run(s, xs[None, :2])
        ys.append(y[0])
        for t in range(2, T):
            y, st = run(s, xs[None, t:t + 1], st)
            ys.append(y[0])
        return np.concatenate(ys), st

    expect = [drive(xs) for xs in seqs]
    got = [None] * 4
    errs = []

    def worker(i):
        try:
            for _ in range(3):
                got[i] = drive(seqs[i])
                assert np.array_equal(got[i][0], expect[i][0]) and np.array_equal(got[i][1], expect[i][1])
        except Exception as e:  # noqa: BLE001
            errs.append(e)

    th = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    assert not errs, errs


def test_two_sessions_isolated():
    rng = np.random.default_rng(11)
    K, N = 64, 32
    W = rng.standard_normal((K, N)).astype(np.float32)
    a = dict(event=1, event_gap_every=0)
    s1, s2 = sess(gate_model(W, a)), sess(gate_model(W, a))
    x = rng.standard_normal((1, 1, K)).astype(np.float32)
    _, st1 = run(s1, x)
    y2, _ = run(s2, x * 2)
    y1, _ = run(s1, x, st1)
    np.testing.assert_allclose(y1, x @ W, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad,msg", [
    (dict(block=0), "block must be >= 1"),
    (dict(pack="quaternary"), "pack must be"),
    (dict(kwta=1, kwta_select="topk", kwta_k=0), "kwta_k"),
    (dict(kwta=1, kwta_select="sort"), "kwta_select"),
    (dict(kwta=1, kwta_select="mass", kwta_temp=0.0), "kwta_temp > 0"),
    (dict(kwta_duty=0), "kwta_duty"),
    (dict(event=1, event_topk=0.0), "event_topk"),
    (dict(event=1, event_quorum=1.5), "event_quorum"),
    (dict(event=1, event_beta=0.0), "event_beta"),
    (dict(target="ffn"), "target"),
])
def test_constructor_validation(bad, msg):
    import onnxruntime as ort

    W = np.ones((8, 4), np.float32)
    with pytest.raises(Exception) as ei:
        sess(gate_model(W, bad, name="badnode"))
    assert "badnode" in str(ei.value) and msg in str(ei.value)


def test_nonconstant_weight_rejected():
    W = np.ones((8, 4), np.float32)
    with pytest.raises(Exception) as ei:
        sess(gate_model(W, {}, name="dynw", w_const=False))
    assert "dynw" in str(ei.value) and "constant initializer" in str(ei.value)


def test_bad_state_shape():
    W = np.ones((8, 4), np.float32)
    s = sess(gate_model(W, dict(event=1), name="stshape"))
    with pytest.raises(Exception) as ei:
        run(s, np.ones((1, 1, 8), np.float32), np.ones((1, 5), np.float32))
    assert "stshape" in str(ei.value) and "state input has shape" in str(ei.value)


def test_metrics_names():
    rng = np.random.default_rng(12)
    K, N = 64, 32
    W = rng.standard_normal((K, N)).astype(np.float32)
    a = dict(pack="binary", kwta=1, kwta_threshold=0.3, kwta_temp=0.5, event=1, event_gap_every=2)
    s = sess(gate_model(W, a, name="metricsnode"))
    xs = _stream(rng, 5, K, 0.1, zero=0.3)
    _, st = run(s, xs[None, :1])
    for t in range(1, 5):
        _, st = run(s, xs[None, t:t + 1], st)
    m = custom_ops.metrics()["metricsnode"]
    for k in ("kwta.keep_ratio", "kwta.duty_hits", "kwta.temp", "pack.density", "pack.active", "event.enabled",
              "event.budget_ms_used", "event.quorum_hits", "event.topk_kept", "event.quality_gap", "event.stale_pct"):
        assert k in m, k
    assert m["kwta.temp"] == pytest.approx(0.5)
    assert 0 < m["pack.density"] <= 1


# --------------------------------------------------------------------------- every ISA path
_ISA_SCRIPT = r"""
import json, sys, numpy as np
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests")
import custom_ops
from test_gating_kernel import gate_model, run, MODES, EVENT_MODES, _stream
from custom_ops.reference.gating import event_gated_matmul
bad = []
rng = np.random.default_rng(0)
for K, N in ((70, 45), (577, 300)):
    W = (rng.standard_normal((K, N)) * 0.1).astype(np.float32)
    for name, a in MODES.items():
        a = dict(a)
        if a.get("kwta_k"): a["kwta_k"] = min(a["kwta_k"], -(-K // a.get("block", 1)))
        s = custom_ops.session(gate_model(W, a), threads=2)
        for M in (1, 3, 128):
            x = rng.standard_normal((M, K)).astype(np.float32); x[rng.random(x.shape) < 0.4] = 0
            y, _ = run(s, x); yr, _ = event_gated_matmul(x, W, None, **a)
            if not np.allclose(y, yr, rtol=2e-4, atol=2e-4 * np.abs(yr).max() + 1e-5): bad.append((K, name, M))
    for name, a in EVENT_MODES.items():
        s = custom_ops.session(gate_model(W, a), threads=2)
        xs = _stream(rng, 10, K, 0.15, zero=0.2)[None]
        y, st = run(s, xs[:, :2]); yr, sr = event_gated_matmul(xs[:, :2], W, None, **a)
        for t in range(2, 10):
            y, st = run(s, xs[:, t:t+1], st); yr, sr = event_gated_matmul(xs[:, t:t+1], W, sr, **a)
            if not np.allclose(y, yr, rtol=1e-3, atol=1e-3 * np.abs(yr).max()): bad.append((K, name, t))
print(json.dumps({"isa": custom_ops.isa(), "bad": bad}))
"""


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


def test_reference_backend_runs_the_op():
    """The same model on the onnxruntime-extensions reference ops gives the reference's numbers."""
    rng = np.random.default_rng(13)
    K, N = 40, 24
    W = rng.standard_normal((K, N)).astype(np.float32)
    for a in (dict(kwta=1, kwta_threshold=0.5), dict(event=1, event_topk=0.5, event_gap_every=0)):
        s = custom_ops.session(gate_model(W, a), backend="reference")
        xs = _stream(rng, 4, K, 0.2)[None]
        y, st = run(s, xs[:, :2])
        yr, sr = event_gated_matmul(xs[:, :2], W, None, **a)
        np.testing.assert_allclose(y, yr, rtol=1e-5, atol=1e-5)
        if stateful(a):
            y, st = run(s, xs[:, 2:3], st)
            yr, sr = event_gated_matmul(xs[:, 2:3], W, sr, **a)
            np.testing.assert_allclose(y, yr, rtol=1e-5, atol=1e-5)


def test_event_budget_stops_after_first_chunk():
    """A budget that is spent at once: the kernel applies the first chunk (256 rows, highest
    priority first) and leaves the rest stale = the reference with topk = 256 rows."""
    rng = np.random.default_rng(14)
    K, N = 1024, 64
    W = rng.standard_normal((K, N)).astype(np.float32)
    a = dict(event=1, event_budget_ms=1e-6, event_gap_every=0)
    s = sess(gate_model(W, a, name="budget"))
    x0 = rng.standard_normal((1, 1, K)).astype(np.float32)
    x1 = rng.standard_normal((1, 1, K)).astype(np.float32)
    _, st = run(s, x0)
    custom_ops.reset_metrics()
    y, st1 = run(s, x1, st)
    ref = dict(event=1, event_topk=256 / K, event_gap_every=0)
    _, sr = event_gated_matmul(x0, W, None, **ref)
    yr, sr1 = event_gated_matmul(x1, W, sr, **ref)
    np.testing.assert_allclose(y, yr, rtol=1e-4, atol=1e-3)
    m = custom_ops.metrics()["budget"]
    assert m["event.topk_kept"] == pytest.approx(0.25) and m["event.budget_ms_used"] > 0
