"""Gating backend end to end on the hand-built toy LM: flags, calibrated thresholds, the planner,
state I/O of event/duty nodes, native vs reference."""
import json

import numpy as np
import onnx
import pytest

import custom_ops
from conftest import requires_native
from custom_ops import runtime
from test_rewriter import run_cli

CAL = ("--calib-tokens", "1024", "--calib-window", "64")


def _feeds(path, n=12, seed=0):
    import onnxruntime as ort  # noqa: F401

    s = custom_ops.session(str(path), backend="auto")
    io = runtime.ModelIO.from_session(s)
    ids = np.random.default_rng(seed).integers(2, 50, size=(1, n))
    return s, io, runtime.feeds(io, ids)


@requires_native
def test_kwta_fixed_k_threshold_and_keep(toy_model, toy_text, tmp_path):
    out, rep = tmp_path / "k.onnx", tmp_path / "r.json"
    code, so, se = run_cli("rewrite", toy_model, "-o", out, "--kwta=on", "--kwta-k", "0.5", "--calib-text", toy_text,
                           "--report", rep, "--quality-budget", "off", *CAL)
    assert code == 0, se
    m = onnx.load(str(out))
    nodes = [n for n in m.graph.node if n.op_type == "EventGatedMatMul"]
    assert len(nodes) == 4  # per block: gate+up fused (one mask), down; attention untouched (--kwta-target mlp)
    for n in nodes:
        a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
        assert a["kwta"] == 1 and a["kwta_select"] == b"threshold" and abs(a["keep_ratio"] - 0.5) < 1e-6
        assert a["kwta_threshold"] > 0
    # stateless: no extra graph inputs
    assert not [i for i in m.graph.input if i.name.startswith("past_event")]
    s, io, f = _feeds(out, 40)
    custom_ops.reset_metrics()
    yn = s.run(None, f)[0]
    yr = custom_ops.session(str(out), backend="reference").run(None, f)[0]
    np.testing.assert_allclose(yn, yr, rtol=1e-3, atol=1e-3)
    met = custom_ops.metrics()
    keeps = [met[n.name]["kwta.keep_ratio"] for n in nodes]
    assert 0.2 < np.mean(keeps) < 0.8  # calibrated on the same kind of text


@requires_native
def test_planner_under_budget_records_keep_ratios(toy_model, toy_text, tmp_path):
    out, rep = tmp_path / "p.onnx", tmp_path / "r.json"
    code, so, se = run_cli("rewrite", toy_model, "-o", out, "--kwta=on", "--calib-text", toy_text, "--report", rep,
                           "--quality-budget", "0.02", *CAL)
    assert code == 0, se
    r = json.loads(rep.read_text())
    assert r["quality"]["loss"] <= 0.02
    gated = [L for L in r["layers"] if L["backend"] == "gating"]
    assert gated and all("KWTA keep" in L["decision"] for L in gated)
    m = onnx.load(str(out))
    for n in m.graph.node:
        if n.op_type == "EventGatedMatMul":
            a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
            assert 0 < a["keep_ratio"] < 1


@requires_native
def test_event_and_duty_nodes_carry_state_like_the_kv_cache(toy_model, toy_text, tmp_path):
    out = tmp_path / "e.onnx"
    code, so, se = run_cli("rewrite", toy_model, "-o", out, "--kwta=on", "--kwta-k", "0.6", "--kwta-duty", "2",
                           "--event-driven=on", "--event-gap-every", "4", "--calib-text", toy_text,
                           "--quality-budget", "off", *CAL)
    assert code == 0, se
    m = onnx.load(str(out))
    ins = [i.name for i in m.graph.input if i.name.startswith("past_event.")]
    outs = [o.name for o in m.graph.output if o.name.startswith("present_event.")]
    assert len(ins) == 4 and sorted(i.replace("past_event", "present_event") for i in ins) == sorted(outs)  # gate+up fused, down
    s = custom_ops.session(str(out), threads=2)
    io = runtime.ModelIO.from_session(s)
    assert all(i in io.past_to_present for i in ins)
    tok = runtime.load_tokenizer(out)
    text_n, ids_n = runtime.generate(s, io, tok, "the sister of", 12)
    sr = custom_ops.session(str(out), backend="reference")
    text_r, ids_r = runtime.generate(sr, runtime.ModelIO.from_session(sr), tok, "the sister of", 12)
    assert ids_n == ids_r


@requires_native
def test_shared_input_projections_fused(toy_model, toy_text, tmp_path):
    """--gate-fuse (default on): q/k/v and gate/up read one input, so they are gated as one op
    over [W_1 | W_2 | …] with one mask per token (seed 003: the same mask for K/V), then Split.
    Same bytes as the unfused rewrite; keeping every channel equals the dense model; native =
    reference."""
    fused, unfused, full = tmp_path / "f.onnx", tmp_path / "u.onnx", tmp_path / "k1.onnx"
    common = ("--kwta=on", "--kwta-target", "both", "--calib-text", toy_text, "--quality-budget", "off", *CAL)
    code, so, se = run_cli("rewrite", toy_model, "-o", fused, "--kwta-k", "0.5", *common)
    assert code == 0, se
    code, _, se = run_cli("rewrite", toy_model, "-o", unfused, "--kwta-k", "0.5", "--gate-fuse=off", *common)
    assert code == 0, se
    m = onnx.load(str(fused))
    inits = {i.name: i for i in m.graph.initializer}
    gates = [n for n in m.graph.node if n.op_type == "EventGatedMatMul"]
    splits = [n for n in m.graph.node if n.op_type == "Split"]
    # per block: q+k+v, o, gate+up, down
    assert len(gates) == 8 and len(splits) == 4, [n.name for n in gates]
    fused_nodes = [n for n in gates if "+" in n.name]
    assert len(fused_nodes) == 4
    for n in fused_nodes:
        a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
        members = a["fused"].decode().split(",")
        assert len(members) in (2, 3) and n.name == "+".join(members)
        W = inits[n.input[1]]
        assert W.dims[1] == a["params_dense"] // W.dims[0]
    # the members' own weights are gone (no duplicate bytes)
    mu = onnx.load(str(unfused))
    size = lambda mm: sum(int(np.prod(i.dims)) for i in mm.graph.initializer)  # noqa: E731
    assert abs(size(m) - size(mu)) < 64
    s, io, f = _feeds(fused, 30)
    yn = s.run(None, f)[0]
    yr = custom_ops.session(str(fused), backend="reference").run(None, f)[0]
    np.testing.assert_allclose(yn, yr, rtol=1e-3, atol=1e-3)
    # one mask per token for the whole group: every member keeps the same channels
    custom_ops.reset_metrics()
    s.run(None, f)
    met = custom_ops.metrics()
    assert all(met[n.name]["gate.rows"] == 30 for n in fused_nodes)
    # every channel kept (exact top-K with K ≥ all channels): fused == dense
    code, _, se = run_cli("rewrite", toy_model, "-o", full, "--kwta-k-abs", "100000", *common)
    assert code == 0, se
    dense = custom_ops.session(str(toy_model)).run(None, f)[0]
    y1 = custom_ops.session(str(full)).run(None, f)[0]
    np.testing.assert_allclose(y1, dense, rtol=1e-5, atol=1e-5)


def test_flag_errors(toy_model, toy_text, tmp_path):
    code, _, se = run_cli("rewrite", toy_model, "-o", tmp_path / "x.onnx", "--kwta=on", "--kwta-k", "1.5",
                          "--calib-text", toy_text)
    assert code == 2 and "--kwta-k" in se
    code, _, se = run_cli("rewrite", toy_model, "-o", tmp_path / "x.onnx", "--kwta=on", "--kwta-target", "ffn",
                          "--calib-text", toy_text)
    assert code == 2 and "--kwta-target" in se
    code, _, se = run_cli("rewrite", toy_model, "-o", tmp_path / "x.onnx", "--kwta=on")
    assert code == 2 and "calib" in se
