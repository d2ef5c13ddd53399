"""Rewriter end to end on a hand-built Llama-shaped model: classification, calibration, planning,
emission, onnx.checker, running in ORT (native library and numpy references), idempotence,
atomic output and the bad inputs the CLI must name."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import custom_ops
from conftest import requires_native
from rewriter.kit import candidates, modelfile

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, cwd=None):
    """Run the real CLI in a subprocess: exit code, stdout, stderr."""
    p = subprocess.run([sys.executable, "-m", "rewriter.cli", *map(str, args)], capture_output=True, text=True,
                       cwd=cwd or ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return p.returncode, p.stdout, p.stderr


def test_classification(toy_model):
    cands = candidates.find_candidates(modelfile.load_model(toy_model))
    roles = {c.name: (c.target, c.role, c.layer) for c in cands}
    assert roles["/model/layers.0/self_attn/q_proj/MatMul"] == ("attn", "q", 0)
    assert roles["/model/layers.1/self_attn/o_proj/MatMul"] == ("attn", "o", 1)
    assert roles["/model/layers.1/mlp/gate_proj/MatMul"][:2] == ("mlp", "gate")
    assert roles["/model/layers.0/mlp/up_proj/MatMul"][:2] == ("mlp", "up")
    assert roles["/model/layers.0/mlp/down_proj/MatMul"][:2] == ("mlp", "down")
    head = [c for c in cands if c.target == "head"]
    assert len(head) == 1 and head[0].transposed  # tied lm_head through a Transpose
    assert all(c.how == "structure" for c in cands)


def test_classification_ignores_misleading_names(tmp_path):
    """Structure wins over names: rename every node to garbage and the classes stay."""
    import toy

    p = toy.build(tmp_path / "m.onnx")
    m = onnx.load(str(p))
    for i, n in enumerate(m.graph.node):
        n.name = f"node_{i}"
    onnx.save(m, str(p))
    cands = candidates.find_candidates(modelfile.load_model(p))
    assert [c.target for c in cands].count("attn") == 8
    assert [c.target for c in cands].count("mlp") == 6
    assert [c.target for c in cands].count("head") == 1


def _rewrite(toy_model, toy_text, out, *extra):
    return run_cli("rewrite", toy_model, "-o", out, "--tt=on", "--tt-target=all", "--tt-gap=0.05",
                   "--tt-speed-check=off", "--calib-text", toy_text, "--calib-tokens", "1024", "--calib-window", "64",
                   "-q", *extra)


def _toy_feeds(n=12, seed=0):
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(2, 50, (1, n)).astype(np.int64)}


def test_rewrite_end_to_end_reference_backend(toy_model, toy_text, tmp_path):
    out = tmp_path / "lean.onnx"
    rep = tmp_path / "report.json"
    code, so, se = _rewrite(toy_model, toy_text, out, "--report", rep)
    assert code == 0, se
    report = json.loads(rep.read_text())
    assert report["factored"] >= 1
    for L in report["layers"]:
        assert set(L) >= {"layer", "target", "shape", "backend", "params_before", "params_after", "gap", "decision"}
        if L["backend"] == "tt":
            assert L["gap"] <= 0.05 and L["params_after"] < L["params_before"]
    assert "factored" in so and "kept dense" in so
    model = onnx.load(str(out))
    onnx.checker.check_model(model)
    tt_nodes = [n for n in model.graph.node if n.op_type == "TTMatMul"]
    assert len(tt_nodes) == report["factored"]
    names = {L["layer"] for L in report["layers"] if L["backend"] == "tt"}
    assert {n.name for n in tt_nodes} == names  # nodes keep the original names
    attrs = {a.name for a in tt_nodes[0].attribute}
    assert attrs >= {"modes_k", "modes_n", "ranks", "method", "gap", "params_dense", "params_stored", "layer", "target"}
    # runs in ORT on the numpy references, close to dense
    import onnxruntime as ort

    dense = ort.InferenceSession(str(toy_model), providers=["CPUExecutionProvider"]).run(None, _toy_feeds())[0]
    lean = custom_ops.session(str(out), backend="reference").run(None, _toy_feeds())[0]
    rel = np.linalg.norm(lean - dense) / np.linalg.norm(dense)
    assert rel < 0.25
    assert not np.allclose(lean, dense)  # something was really replaced


@requires_native
def test_rewritten_model_native_matches_reference(toy_model, toy_text, tmp_path):
    out = tmp_path / "lean.onnx"
    code, _, se = _rewrite(toy_model, toy_text, out)
    assert code == 0, se
    ref = custom_ops.session(str(out), backend="reference").run(None, _toy_feeds(17, 3))[0]
    nat = custom_ops.session(str(out), threads=2).run(None, _toy_feeds(17, 3))[0]
    np.testing.assert_allclose(nat, ref, rtol=1e-4, atol=1e-4)
    m = custom_ops.metrics()
    tt_nodes = [n.name for n in onnx.load(str(out)).graph.node if n.op_type == "TTMatMul"]
    assert set(tt_nodes) <= set(m)
    one = m[tt_nodes[0]]
    for k in ("tt.enabled", "tt.rank", "tt.gap", "tt.speedup", "tt.mem_saved"):
        assert k in one
    assert one["tt.enabled"] == 1 and 0 < one["tt.mem_saved"] < 1


def test_rewrite_refuses_already_rewritten_layer(toy_model, toy_text, tmp_path):
    out = tmp_path / "lean.onnx"
    assert _rewrite(toy_model, toy_text, out)[0] == 0
    rewritten = [n.name for n in onnx.load(str(out)).graph.node if n.op_type == "TTMatMul"]
    out2 = tmp_path / "lean2.onnx"
    code, _, se = _rewrite(out, toy_text, out2, "--include", rewritten[0])
    assert code == 2 and "already rewritten" in se and rewritten[0] in se
    assert not out2.exists()


def test_rewrite_never_overwrites_input(toy_model, toy_text):
    before = Path(toy_model).read_bytes()
    code, _, se = _rewrite(toy_model, toy_text, toy_model)
    assert code == 2 and "overwrite" in se
    assert Path(toy_model).read_bytes() == before


def test_quality_forbids_factoring_says_so(toy_model, toy_text, tmp_path):
    out = tmp_path / "none.onnx"
    code, so, se = _rewrite(toy_model, toy_text, out, "--tt-gap=0.02", "--tt-rank=1")
    assert code == 3
    assert "gap too high" in so and "no model written" in so
    assert not out.exists()


def test_include_exclude_globs(toy_model, toy_text, tmp_path):
    out = tmp_path / "inc.onnx"
    rep = tmp_path / "r.json"
    code, _, se = _rewrite(toy_model, toy_text, out, "--include", "*/mlp/*", "--exclude", "*down_proj*", "--report", rep)
    assert code == 0, se
    for L in json.loads(rep.read_text())["layers"]:
        if "/mlp/" not in L["layer"] or "down_proj" in L["layer"]:
            assert L["backend"] == "dense" and ("exclude" in L["decision"] or "include" in L["decision"])
    code, _, se = _rewrite(toy_model, toy_text, tmp_path / "x.onnx", "--include", "*nothing_like_this*")
    assert code == 2 and "*nothing_like_this*" in se and "matches no" in se
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.parametrize("flags,needle", [
    (["--tt-rank=0"], "--tt-rank 0"),
    (["--tt-gap=-0.1"], "--tt-gap -0.1"),
    (["--tt-target=everything"], "unknown target 'everything'"),
    (["--tt-method=qr"], "--tt-method 'qr'"),
    (["--tt-d=7"], "--tt-d '7'"),
])
def test_bad_flags(toy_model, toy_text, tmp_path, flags, needle):
    out = tmp_path / "bad.onnx"
    code, _, se = _rewrite(toy_model, toy_text, out, *flags)
    assert code == 2, se
    assert needle in se
    assert not out.exists()


def test_unsupported_weight_matmul_is_reported(tmp_path, toy_text):
    """A MatMul with a constant B the backends cannot take (here float16) is one report row that
    says why; the rest of the model is rewritten as usual."""
    import toy
    from onnx import TensorProto, helper, numpy_helper

    p = toy.build(tmp_path / "m.onnx")
    m = onnx.load(str(p))
    w16 = np.random.default_rng(0).standard_normal((48, 8)).astype(np.float16)
    m.graph.initializer.append(numpy_helper.from_array(w16, "aux_w16"))
    m.graph.node.extend([
        helper.make_node("Cast", ["h0"], ["h0_16"], to=TensorProto.FLOAT16, name="/aux/Cast"),
        helper.make_node("MatMul", ["h0_16", "aux_w16"], ["aux16"], name="/aux/MatMul"),
        helper.make_node("Cast", ["aux16"], ["aux"], to=TensorProto.FLOAT, name="/aux/Cast_1")])
    m.graph.output.append(helper.make_tensor_value_info("aux", TensorProto.FLOAT, ["batch", "seq", 8]))
    onnx.save(m, str(p))
    out, rep = tmp_path / "o.onnx", tmp_path / "r.json"
    code, so, se = _rewrite(p, toy_text, out, "--report", rep)
    assert code == 0, se
    r = json.loads(rep.read_text())
    row = next(L for L in r["layers"] if L["layer"] == "/aux/MatMul")
    assert row["backend"] == "dense" and row["decision"] == "kept: unsupported (weight aux_w16 is float16, not float32)"
    assert row["shape"] == [48, 8] and row["params_before"] == row["params_after"] == 384
    assert r["factored"] >= 1 and "kept: unsupported" in so


def test_bad_files(tmp_path, toy_text):
    out = tmp_path / "o.onnx"
    code, _, se = run_cli("rewrite", tmp_path / "missing.onnx", "-o", out, "--tt=on", "--calib-text", toy_text)
    assert code == 2 and "missing.onnx: no such file" in se
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00\x01garbage" * 100)
    code, _, se = run_cli("rewrite", junk, "-o", out, "--tt=on", "--calib-text", toy_text)
    assert code == 2 and "junk.onnx" in se and "ONNX" in se
    txt = tmp_path / "notes.onnx"
    txt.write_text("this is not a model\n")
    code, _, se = run_cli("rewrite", txt, "-o", out, "--tt=on", "--calib-text", toy_text)
    assert code == 2 and "notes.onnx" in se
    assert not out.exists()
    assert not list(tmp_path.glob(".ortlean-*"))


def test_no_eligible_matmul(tmp_path, toy_text):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    m = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    p = tmp_path / "relu.onnx"
    onnx.save(m, str(p))
    code, _, se = run_cli("rewrite", p, "-o", tmp_path / "o.onnx", "--tt=on", "--calib-text", toy_text)
    assert code == 2 and "no eligible MatMul" in se and "relu.onnx" in se


def test_missing_tokenizer(tmp_path, toy_text):
    import toy

    p = toy.build(tmp_path / "m.onnx", tokenizer=False)
    code, _, se = run_cli("rewrite", p, "-o", tmp_path / "o.onnx", "--tt=on", "--calib-text", toy_text)
    assert code == 2 and "tokenizer" in se.lower()
    assert not (tmp_path / "o.onnx").exists()


def test_missing_calib_text(toy_model, tmp_path):
    code, _, se = run_cli("rewrite", toy_model, "-o", tmp_path / "o.onnx", "--tt=on")
    assert code == 2 and "--calib-text" in se
    code, _, se = run_cli("rewrite", toy_model, "-o", tmp_path / "o.onnx", "--tt=on", "--calib-text", tmp_path / "nope.txt")
    assert code == 2 and "nope.txt" in se


def test_library_not_registered_error(toy_model, toy_text, tmp_path):
    """A rewritten model loaded without the library: ORT's error names the custom op."""
    import onnxruntime as ort

    out = tmp_path / "lean.onnx"
    assert _rewrite(toy_model, toy_text, out)[0] == 0
    with pytest.raises(Exception, match="TTMatMul|ai.ortlean"):
        ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])


def test_library_path_missing_gives_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("ORTLEAN_LIBRARY", str(tmp_path / "nope.so"))
    import importlib

    import custom_ops as co

    with pytest.raises(co.LibraryNotFoundError, match="ORTLEAN_LIBRARY=.*nope.so: no such file"):
        co.library_path()  # an override naming no file is refused, not skipped for the installed build
    monkeypatch.delenv("ORTLEAN_LIBRARY")
    monkeypatch.setattr(co, "_candidates", lambda: [tmp_path / "nope.so"])
    with pytest.raises(co.LibraryNotFoundError, match="pip install -e"):
        co.library_path()


def test_inspect(toy_model, toy_text, tmp_path):
    out = tmp_path / "lean.onnx"
    assert _rewrite(toy_model, toy_text, out)[0] == 0
    code, so, se = run_cli("inspect", out)
    assert code == 0, se
    assert "TTMatMul" in so and "ranks=" in so
    code, so, _ = run_cli("inspect", out, "--json")
    info = json.loads(so)
    assert info["ortlean_nodes"] and "ranks" in info["ortlean_nodes"][0]["attributes"]


def test_external_data_roundtrip(toy_model, toy_text, tmp_path, monkeypatch):
    """Saving with external data (forced by a low threshold) keeps the model runnable, atomic."""
    out = tmp_path / "ext" / "lean.onnx"
    p = subprocess.run([sys.executable, "-m", "rewriter.cli", "rewrite", str(toy_model), "-o", str(out), "--tt=on",
                        "--tt-target=mlp", "--tt-gap=0.05", "--tt-speed-check=off", "--calib-text", str(toy_text),
                        "--calib-tokens", "512", "-q"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "ORTLEAN_EXTERNAL_DATA_THRESHOLD": "1000"})
    assert p.returncode == 0, p.stderr
    assert (out.parent / "lean.onnx.data").is_file()
    m = onnx.load(str(out), load_external_data=False)
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in m.graph.initializer)
    y = custom_ops.session(str(out), backend="reference").run(None, _toy_feeds())[0]
    assert np.isfinite(y).all()
    # the rewritten-with-external-data model is itself a valid input
    code, _, se = _rewrite(out, toy_text, tmp_path / "again.onnx", "--exclude", "*q_proj*")
    assert code in (0, 3), se


def test_quality_guard_reverts_layers_to_meet_budget(toy_model, toy_text, tmp_path):
    rep_off, rep_tight = tmp_path / "off.json", tmp_path / "tight.json"
    code, _, se = _rewrite(toy_model, toy_text, tmp_path / "off.onnx", "--quality-budget=off", "--report", rep_off)
    assert code == 0, se
    n_off = json.loads(rep_off.read_text())["factored"]
    assert n_off >= 2
    code, so, se = _rewrite(toy_model, toy_text, tmp_path / "tight.onnx", "--quality-budget=1e-9", "--report", rep_tight)
    rep = json.loads(rep_tight.read_text())
    q = rep["quality"]
    assert q["planned"] == n_off and q["loss"] <= 1e-9
    assert sum("end-to-end quality budget" in L["decision"] for L in rep["layers"]) == n_off - q["kept"]
    assert rep["factored"] == q["kept"]
    if q["kept"] == 0:  # nothing met the budget: nothing is shipped
        assert code == 3 and not (tmp_path / "tight.onnx").exists()
    else:
        assert code == 0, se


def test_quality_guard_result_is_within_budget(toy_model, toy_text, tmp_path):
    rep = tmp_path / "r.json"
    code, so, se = _rewrite(toy_model, toy_text, tmp_path / "m.onnx", "--quality-budget=0.01", "--report", rep)
    q = json.loads(rep.read_text())["quality"]
    assert q["loss"] <= 0.01
    assert "end-to-end check" in so


def test_eval_bench_generate_cli_on_toy(toy_model, toy_text, tmp_path):
    out = tmp_path / "lean.onnx"
    assert _rewrite(toy_model, toy_text, out, "--quality-budget=off")[0] == 0
    code, so, se = run_cli("eval", out, "--ref", toy_model, "--text", toy_text, "--window", "64", "--windows", "2",
                           "--json", tmp_path / "e.json")
    assert code == 0, se
    e = json.loads((tmp_path / "e.json").read_text())
    assert e["kind"] == "causal-lm" and np.isfinite(e["ppl"]) and np.isfinite(e["ppl_ref"])
    assert {"commit", "date", "machine", "command"} <= set(e) and e["command"].startswith("ortlean eval ")
    assert "Δppl" in so
    code, so, se = run_cli("bench", out, "--ref", toy_model, "--threads", "1", "--prefill", "16", "--decode-past", "8",
                           "--repeats", "2", "--nbits", "none", "--json", tmp_path / "b.json")
    assert code == 0, se
    b = json.loads((tmp_path / "b.json").read_text())
    assert set(b["table"]["t1"]) == {"dense", "lean"}   # no peers for a toy model (a note says so)
    assert any("2 MiB pages" in n for n in b["notes"])  # --huge-pages on (default)
    assert "MiB of the process's memory moved to 2 MiB pages" in se
    assert all(v["decode8"] > 0 and v["prefill"] > 0 for v in b["table"]["t1"].values())
    assert "ORT profile, lean" in so and "TTMatMul" in so
    # the weights floor of lean's products, timed in the rounds, out of the table
    from custom_ops.runtime import floor

    fl, reads = b["weights_floor"], floor.weight_reads(out)
    assert fl["nodes"] == len(reads) > 0 and fl["bytes"] == sum(n for _, n in reads)
    assert set(fl["table"]["t1"]) == {"weights floor | one pass", "weights floor | barrier per node"}
    assert all(v["decode8"] > 0 and "prefill" not in v for v in fl["table"]["t1"].values())
    assert all(tuple(c) in floor.CONFIGS for c in fl["patterns"]["t1"].values())
    assert f"weights floor of [lean]: its {len(reads)} weight nodes'" in so
    assert "  P8 t1: one pass " in so and "x the barrier floor" in so
    code, so, se = run_cli("generate", out, "--prompt", "the sister", "--max-new-tokens", "4")
    assert code == 0, se


def test_generate_refuses_encoder(tmp_path):
    from onnx import TensorProto, helper

    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])
    out = helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["b", "s", 4])
    emb = onnx.numpy_helper.from_array(np.ones((10, 4), np.float32), "E")
    m = helper.make_model(helper.make_graph([helper.make_node("Gather", ["E", "input_ids"], ["last_hidden_state"])],
                                            "enc", [ids], [out], initializer=[emb]),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    p = tmp_path / "enc.onnx"
    onnx.save(m, str(p))
    import toy

    toy.write_tokenizer(tmp_path / "tokenizer.json")
    code, _, se = run_cli("generate", p, "--prompt", "the sister")
    assert code == 2 and "not a causal LM" in se


def test_eval_bad_inputs(toy_model, tmp_path):
    code, _, se = run_cli("eval", toy_model, "--ref", tmp_path / "nope.onnx", "--text", toy_model)
    assert code == 2 and "nope.onnx" in se
    code, _, se = run_cli("eval", toy_model, "--ref", toy_model, "--text", tmp_path / "missing.txt")
    assert code == 2 and "missing.txt" in se


def test_quality_guard_bisection_keeps_largest_prefix():
    """The guard keeps the k lowest-gap layers for the largest k whose loss meets the budget."""
    from types import SimpleNamespace

    from rewriter import pipeline
    from rewriter.kit.backend import Plan

    n = 11
    chosen, records = [], {}
    for i in range(n):
        c = SimpleNamespace(name=f"L{i}", params=100, layer=i, target="mlp", role="up", K=10, N=10)
        plan = Plan("tt", "factored", gap=0.01 * ((i * 7) % n), params_after=40)
        chosen.append((c, None, plan))
        records[c.name] = pipeline.LayerRecord(c.name, i, "mlp", "up", [10, 10], "tt", 100, 40, plan.gap, "factored")

    class FakeQuality:  # loss of a trial model = 0.004 per layer it rewrites
        probe = SimpleNamespace(metric="delta_ppl", unit="tokens", size=5)

        def loss(self, subset):
            return 0.004 * len(subset)

    kept, q = pipeline._quality_guard(chosen, records, FakeQuality(), budget=0.02, progress=False)
    assert q["kept"] == 5 and len(kept) == 5 and q["loss"] == pytest.approx(0.02)
    gaps = sorted(p.gap for _, _, p in chosen)
    assert sorted(p.gap for _, _, p in kept) == gaps[:5]          # the lowest-gap layers stay
    reverted = [r for r in records.values() if r.backend == "dense"]
    assert len(reverted) == 6 and all("end-to-end quality budget" in r.decision for r in reverted)
    assert all(r.params_after == r.params_before for r in reverted)
