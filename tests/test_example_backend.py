"""A weight backend and a graph pass that live only in this file, registered through the lists of
`rewriter.backends`: what it takes to add one on the Python side (the flags, calibration, the
end-to-end quality guard, the report and the saved model come from the kit and the pipeline).

- `Int8Backend`: per-output-channel symmetric int8 weights, DequantizeLinear → MatMul (standard
  ONNX ops, so no kernel is needed), taken where its gap on the calibration inputs is ≤ --int8-gap;
- `UntransposePass` ("pre" stage): MatMul(X, Transpose(W)) → MatMul(X, Wᵀ stored), before the
  candidates are searched; the rewrite then runs the changed model from memory."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from rewriter import backends, cli
from rewriter.errors import OrtleanError
from rewriter.kit import gaps, surgery
from rewriter.kit.backend import GraphPassBase, Plan, WeightBackendBase
from rewriter.kit.options import Options, flag, onoff, targets_flag


def quantize(W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 [K, N] and float32 scale [N] with W ≈ q · scale."""
    scale = np.maximum(np.abs(W).max(axis=0), 1e-30).astype(np.float32) / np.float32(127)
    return np.clip(np.rint(W / scale), -127, 127).astype(np.int8), scale


@dataclass
class Int8Config(Options):
    enabled: bool = flag("--int8", False, "int8 weights (DequantizeLinear → MatMul)", type=onoff, metavar="on|off")
    gap: float = flag("--int8-gap", 0.01, "max relative output error per layer (default 0.01)", type=float)
    targets: tuple[str, ...] = targets_flag("--int8-target")

    def validate(self) -> None:
        if not self.gap >= 0:
            raise OrtleanError(f"--int8-gap {self.gap}: must be ≥ 0")


class Int8Backend(WeightBackendBase):
    name = "int8"
    op_type = "DequantizeLinear"
    Config = Int8Config
    title = "int8 weights (test example)"

    def plan(self, cand, W, G, ctx) -> Plan:
        q, scale = quantize(W)
        gap = gaps.layer_gap(W, q.astype(np.float64) * scale, G)
        if gap > self.cfg.gap:
            return Plan.dense(cand, f"kept dense: int8 gap {gap:.4f} > {self.cfg.gap}", gap)
        return Plan(self.name, f"int8: gap {gap:.4f}", gap, cand.params, payload=(q, scale))

    def emit(self, graph, cand, plan: Plan, ctx) -> None:
        q, scale = plan.payload
        base = surgery.safe_name(cand.name)
        wq = surgery.initializer(graph, f"{base}.int8_w", q)
        sc = surgery.initializer(graph, f"{base}.int8_scale", scale)
        deq = ir.Node("", "DequantizeLinear", [wq, sc], [ir.AttrInt64("axis", 1)], name=f"{cand.name}/Dequantize")
        deq.outputs[0].name = f"{base}.int8_w_deq"
        mm = ir.Node("", "MatMul", [cand.node.inputs[0], deq.outputs[0]], name=cand.node.name)
        graph.insert_before(cand.node, deq)
        surgery.replace_node(graph, cand.node, mm)


@dataclass
class UntransposeConfig(Options):
    enabled: bool = flag("--untranspose", False, "store Transpose(W) weights transposed", type=onoff,
                         metavar="on|off")


class UntransposePass(GraphPassBase):
    name = "untranspose"
    stage = "pre"
    Config = UntransposeConfig
    title = "untranspose (test example)"

    def run(self, model, ctx) -> list[dict]:
        recs = []
        for node in list(model.graph):
            t = node.inputs[1].producer() if node.op_type == "MatMul" and node.inputs[1] is not None else None
            w = t.inputs[0] if t is not None and t.op_type == "Transpose" else None
            if w is None or not w.is_initializer():
                continue
            wt = surgery.initializer(model.graph, f"{w.name}.T", np.ascontiguousarray(w.const_value.numpy().T))
            node.replace_input_with(1, wt)
            surgery.drop_if_unused(model.graph, t.outputs[0])
            recs.append({"layer": node.name, "backend": self.name, "decision": f"{w.name} stored transposed"})
        return recs


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(backends, "WEIGHT_BACKENDS", [*backends.WEIGHT_BACKENDS, Int8Backend])
    monkeypatch.setattr(backends, "GRAPH_PASSES", [UntransposePass, *backends.GRAPH_PASSES])


def _feeds():
    return {"input_ids": np.random.default_rng(0).integers(2, 50, (1, 12)).astype(np.int64)}


def test_flags_come_from_the_config(registered, capsys):
    assert cli.main(["rewrite", "--help"]) == 0
    out = capsys.readouterr().out
    assert "int8 weights (test example)" in out and "--int8-gap" in out and "--untranspose" in out
    a = cli.build_parser().parse_args(["rewrite", "m.onnx", "--int8=on", "--int8-target", "both"])
    cfg = cli._backend_configs(a)["int8"]
    assert cfg.enabled and cfg.targets == ("mlp", "attn") and cfg.gap == 0.01


def test_example_backend_rewrites_through_the_pipeline(registered, toy_model, toy_text, tmp_path):
    import onnxruntime as ort

    out, rep = tmp_path / "int8.onnx", tmp_path / "r.json"
    code = cli.main(["rewrite", str(toy_model), "-o", str(out), "--int8=on", "--int8-target=all", "--untranspose=on",
                     "--calib-text", str(toy_text), "--calib-tokens", "1024", "--calib-window", "64",
                     "--report", str(rep), "-q"])
    assert code == 0
    r = json.loads(rep.read_text())
    taken = [L for L in r["layers"] if L["backend"] == "int8"]
    assert taken and all(L["gap"] <= 0.01 for L in taken)
    assert r["quality"]["kept"] == len(taken) and r["quality"]["loss"] <= 0.02         # the guard ran on them
    # the pre pass: lm_head (the fusion pass, on by default, only reports why it left the toy unfused)
    assert [p["backend"] for p in r["graph_passes"] if p["layer"] != "decoder"] == ["untranspose"]
    m = onnx.load(str(out))
    assert sum(n.op_type == "DequantizeLinear" for n in m.graph.node) == r["factored"] == len(taken)
    assert r["kept_dense"] == len(r["layers"]) - len(taken)
    assert not any(n.op_type == "Transpose" and n.input[0] == "model.embed_tokens.weight" for n in m.graph.node)
    head = next(L for L in r["layers"] if L["target"] == "head")
    assert head["layer"] == "/lm_head/MatMul"                                          # found after the pre pass
    dense = ort.InferenceSession(str(toy_model), providers=["CPUExecutionProvider"]).run(None, _feeds())[0]
    lean = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, _feeds())[0]
    assert np.linalg.norm(lean - dense) / np.linalg.norm(dense) < 0.05 and not np.allclose(lean, dense)
