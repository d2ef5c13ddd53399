"""`ortlean perf` (what onnxruntime_perf_test does, with ortlean's library registered) and
`ortlean --library-path` (the library to give onnxruntime_perf_test -R)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="needs the native library")


@pytest.fixture(scope="module")
def tiny():
    import tiny_hf

    return tiny_hf.models()


def _perf(capsys, *args):
    from rewriter import cli

    rc = cli.main(["perf", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _stats_ok(r, iterations):
    lat = r["latency_ms"]
    assert r["iterations"] == iterations
    assert 0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p95"] <= lat["p99"] <= lat["max"]
    assert lat["min"] <= lat["mean"] <= lat["max"] and lat["std"] >= 0
    assert r["throughput"]["runs_per_s"] > 0


def test_library_path_prints_the_registered_library(capsys):
    import custom_ops
    from rewriter import cli

    assert cli.main(["--library-path"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == custom_ops.library_path() and Path(out).is_file()


def test_perf_on_a_model_with_ortlean_ops(toy_model, toy_text, tmp_path, capsys):
    """The TT-rewritten toy (TTMatMul nodes: the library must be registered): random token ids of the
    declared inputs, percentiles in order, tokens/s = tokens per run x runs/s; --json is the same result."""
    import custom_ops
    from rewriter import cli

    lean = tmp_path / "lean.onnx"
    assert cli.main(["rewrite", str(toy_model), "-o", str(lean), "--tt=on", "--tt-target=all", "--tt-gap=0.05",
                     "--tt-speed-check=off", "--calib-text", str(toy_text), "--calib-tokens", "1024",
                     "--calib-window", "64", "-q", "--quality-budget=off"]) == 0
    capsys.readouterr()
    rc, so, se = _perf(capsys, lean, "--iterations", 20, "--warmup", 2, "--seq", 12, "--json")
    assert rc == 0, se
    r = json.loads(so)
    _stats_ok(r, 20)
    assert r["tokens_per_run"] == 12 and r["library"] == custom_ops.library_path()
    assert r["throughput"]["tokens_per_s"] == pytest.approx(12 * r["throughput"]["runs_per_s"])
    assert "input_ids [1, 12] random token ids" in r["inputs"]
    rc, so, se = _perf(capsys, lean, "-r", 5, "--threads", 2)
    assert rc == 0, se
    assert "5 runs after 5 warm-up, 2 threads" in so and "latency ms: mean " in so and " p99 " in so
    assert "tokens/s (128 tokens a run)" in so and "library " in so


def test_perf_decode_step_after_a_past(tiny, capsys):
    """A decoder with a KV cache: --past P builds the cache by the model's own prefill and times one
    new token after it (the state's sequence axis holds P)."""
    from custom_ops.runtime import perf

    m = tiny["llama"] / "model.onnx"
    rc, so, se = _perf(capsys, m, "--past", 40, "-r", 10, "--json")
    assert rc == 0, se
    r = json.loads(so)
    _stats_ok(r, 10)
    assert r["tokens_per_run"] == 1 and "after 40 cached tokens" in r["inputs"] and "own cache" in r["inputs"]
    import custom_ops

    sess = custom_ops.session(str(m), threads=1)
    f, _ = perf.make_inputs(sess, m, seq=1, past=40)
    assert f["past_key_values.0.key"].shape[2] == 40 and f["attention_mask"].shape == (1, 41)
    assert f["position_ids"].tolist() == [[40]] and f["input_ids"].shape == (1, 1)


def test_perf_given_inputs_and_clear_errors(toy_model, tmp_path, capsys):
    ids = np.arange(3, 19, dtype=np.int64)[None, :]
    good = tmp_path / "in.npz"
    np.savez(good, input_ids=ids)
    rc, so, se = _perf(capsys, toy_model, "--inputs", good, "-r", 3, "--json")
    assert rc == 0, se
    r = json.loads(so)
    assert r["inputs"] == f"inputs from {good}" and r["tokens_per_run"] == 16
    # bad inputs: one line naming the file and what is wrong, exit 2
    np.savez(tmp_path / "missing.npz", other=ids)
    np.savez(tmp_path / "dtype.npz", input_ids=ids.astype(np.float32))
    np.savez(tmp_path / "shape.npz", input_ids=ids[0])
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    for name, words in (("missing.npz", ["missing input_ids", "not inputs of the model: other"]),
                        ("dtype.npz", ["input_ids is float32", "tensor(int64)"]),
                        ("shape.npz", ["the run failed with these inputs"]),
                        ("junk.npz", ["not a readable .npz"]),
                        ("nofile.npz", ["no such file"])):
        rc, so, se = _perf(capsys, toy_model, "--inputs", tmp_path / name, "-r", 1)
        assert rc == 2 and len(se.strip().splitlines()) == 1, (name, se)
        assert all(w in se for w in words) and name in se, (name, se)
    rc, so, se = _perf(capsys, toy_model, "--past", 8)
    assert rc == 2 and "no past_key_values inputs" in se
    rc, so, se = _perf(capsys, tmp_path / "none.onnx")
    assert rc == 2 and "none.onnx" in se


def test_perf_random_inputs_from_declared_shapes(tmp_path, capsys):
    """A graph whose inputs runtime.io does not know (a float X, a symbolic batch): random values of the
    declared type and shape."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 8])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 4])
    w = onnx.numpy_helper.from_array(np.ones((8, 4), np.float32), "W")
    g = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "g", [x], [y], [w])
    p = tmp_path / "mm.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), p)
    rc, so, se = _perf(capsys, p, "-r", 4, "--batch", 3, "--json")
    assert rc == 0, se
    r = json.loads(so)
    assert r["inputs"].startswith("X [3, 8] float32") and r["tokens_per_run"] is None
    assert "tokens_per_s" not in r["throughput"]


def test_perf_prompt_time_to_first_token_and_profile(tiny, tmp_path, capsys):
    """--prompt N: a run is an N-token prompt read from an empty cache in --chunk-token runs, as
    generate reads it; --profile: ORT's per-node profile of those runs in a second session — op types'
    time per run, their shares and the attention nodes' share (here GroupQueryAttention: a fused graph)."""
    from custom_ops.runtime.profile import ATTENTION_OPS
    from rewriter import cli

    q = tmp_path / "gqa" / "model.onnx"
    assert cli.main(["rewrite", str(tiny["llama"] / "model.onnx"), "-o", str(q), "-q", "--fuse", "on",
                     "--attn-exact", "off"]) == 0
    capsys.readouterr()
    rc, so, se = _perf(capsys, q, "--prompt", 40, "--chunk", 16, "-r", 2, "--warmup", 0, "--profile", "--json")
    assert rc == 0, se
    r = json.loads(so)
    _stats_ok(r, 2)
    assert r["tokens_per_run"] == 40 and "a 40-token prompt" in r["inputs"] and "16-token runs" in r["inputs"]
    assert {"commit", "date", "machine", "command"} <= set(r) and "--prompt 40" in r["command"]
    pr = r["profile"]
    assert pr["runs"] == 1 and pr["ort_runs_per_run"] == 3          # 16 + 16 + 8 tokens
    ops = {o["op_type"]: o for o in pr["op_types"]}
    assert "GroupQueryAttention" in ops and ops["GroupQueryAttention"]["count"] > 0
    assert pr["attention_pct"] == pytest.approx(sum(o["pct"] for o in pr["op_types"] if o["op_type"] in ATTENTION_OPS))
    assert 0 < pr["attention_pct"] < 100
    assert sum(o["pct"] for o in pr["op_types"]) == pytest.approx(100.0, abs=0.1)
    assert pr["node_ms_per_run"] == pytest.approx(sum(o["total_ms"] for o in pr["op_types"]), rel=1e-6)
    rc, so, se = _perf(capsys, q, "--prompt", 24, "-r", 1, "--warmup", 0, "--profile")
    assert rc == 0, se
    assert "ORT profile (1 run in a profiled session, 1 ORT run each)" in so and "attention " in so
    assert "GroupQueryAttention" in so
    # bad combinations: one clear line, exit 2
    rc, so, se = _perf(capsys, q, "--chunk", 16)
    assert rc == 2 and "--chunk needs --prompt" in se
    rc, so, se = _perf(capsys, q, "--prompt", 16, "--past", 8)
    assert rc == 2 and "--prompt 16" in se and "--past" in se
    rc, so, se = _perf(capsys, tmp_path / "gqa", "--prompt", 16)
    assert rc == 2
