"""kit.stream: a loaded model runs in ONNX Runtime without a copy of its weights (Runnable), and a
large one segment by segment (Streamed) with the same outputs as one session (issue 35 item 3)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import toy
from custom_ops import runtime
from rewriter.fuse import fuse_decoder
from rewriter.kit import modelfile, stream


@pytest.fixture(scope="module")
def qwen_external(tmp_path_factory) -> Path:
    """The tiny Qwen2 optimum export saved with its weights (and a Constant's value) in one data file."""
    import tiny_hf

    import shutil

    d = tmp_path_factory.mktemp("qwen-ext")
    src = tiny_hf.models()["qwen2"]
    onnx.save(onnx.load(str(src / "model.onnx")), str(d / "model.onnx"),
              save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx_data",
              size_threshold=64, convert_attribute=True)
    shutil.copy(src / "config.json", d / "config.json")
    toy.write_tokenizer(d / "tokenizer.json")      # word-level, ids within the tiny vocabulary
    return d / "model.onnx"


def _ids(n=40, seed=0):
    return np.random.default_rng(seed).integers(3, 250, n)


def _plain(path_or_bytes):
    import custom_ops

    return custom_ops.session(path_or_bytes, threads=1, backend="auto")


def test_runnable_shares_in_memory_tensors_and_maps_external_ones(qwen_external, monkeypatch):
    """A fused model (packed q/k/v made in memory, the rest in the input's data file) runs from a
    Runnable: in-memory tensors handed over in place (ORT sees a change made to the array after the
    session is built only when it reads it in place), the external ones referenced, not inlined;
    the outputs equal the serialized model's."""
    monkeypatch.setattr(stream, "SHARE_BYTES", 1024)
    model = modelfile.load_model(qwen_external)
    fused, _ = fuse_decoder(model)
    r = stream.runnable(fused)
    assert r.folder == str(qwen_external.parent.resolve()) and r.shared
    ext = [t for t in r.proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert len(ext) >= len(r.shared) + 4                       # the untouched weights stay external
    inline = {t.name for t in r.proto.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL}
    assert not inline & set(r.shared)
    # what stays inline is small, or larger than the input's data file (no placeholder fits it)
    room = (qwen_external.parent / "model.onnx_data").stat().st_size
    assert all(fused.graph.initializers[n].const_value.nbytes < 1024 or fused.graph.initializers[n].const_value.nbytes > room
               for n in inline)
    saved = sum(a.nbytes for a in r.shared.values()) + sum(t.nbytes for _, o, t in modelfile.external_tensors(fused)
                                                           if isinstance(o, ir.Value))
    assert len(r.serialized()) < len(modelfile.serialized(fused)) - saved + 1000
    sess = stream.session(fused, threads=1, stream=False)
    ref = _plain(modelfile.serialized(fused))
    io = runtime.ModelIO.from_session(ref)
    f = runtime.feeds(io, _ids()[None, :])
    for a, b in zip(sess.run(None, f), ref.run(None, f)):
        np.testing.assert_array_equal(a, b)
    # in place: the shared array is the model's own tensor memory
    name, arr = next(iter(r.shared.items()))
    assert np.shares_memory(arr, fused.graph.initializers[name].const_value.numpy())
    # the model is unchanged by it
    assert all(not isinstance(v.const_value, ir.ExternalTensor) or v.const_value.location == "model.onnx_data"
               for v in fused.graph.initializers.values())


def test_runnable_shares_tensors_of_a_model_without_external_data(qwen_external, monkeypatch):
    """A model with no external data left (the quality guard's trial model, whose every weight the
    rewrite replaced by arrays in memory) still runs without a copy of them: the placeholders point
    into an empty sparse file of a temporary directory (ORT never reads it: the outputs equal the
    serialized model's, streamed or not), which goes away with the Runnable."""
    import gc

    monkeypatch.setattr(stream, "SHARE_BYTES", 1024)
    model = modelfile.load_model(qwen_external)
    for v in model.graph.initializers.values():        # every tensor in memory, as a rewrite leaves them
        if isinstance(v.const_value, ir.ExternalTensor):
            v.const_value = ir.tensor(np.array(v.const_value.numpy()), name=v.name)
    for _, (node, name, _), t in list(modelfile.external_tensors(model)):
        node.attributes[name] = ir.AttrTensor(name, ir.tensor(t.numpy(), name=t.name))
    assert not list(modelfile.external_tensors(model))
    big = max(v.const_value.nbytes for v in model.graph.initializers.values())
    r = stream.runnable(model)
    assert r.shared and r.folder and Path(r.folder, "placeholder.bin").stat().st_size == big
    assert Path(r.folder, "placeholder.bin").stat().st_blocks == 0      # sparse: no byte written
    assert len(r.serialized()) < len(modelfile.serialized(model)) - sum(a.nbytes for a in r.shared.values()) + 1000
    name, arr = next(iter(r.shared.items()))
    assert np.shares_memory(arr, model.graph.initializers[name].const_value.numpy())
    ref = _plain(modelfile.serialized(model))
    io = runtime.ModelIO.from_session(ref)
    f = runtime.feeds(io, _ids()[None, :])
    want = ref.run(None, f)
    for sess in (stream.session(model, threads=1, stream=False), stream.Streamed(model, threads=1, segment_bytes=40_000)):
        for a, b in zip(sess.run(None, f), want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    folder = r.folder
    del r
    gc.collect()
    assert not Path(folder).exists()


@pytest.mark.parametrize("fused", [False, True], ids=["optimum", "fused"])
@pytest.mark.parametrize("segment_bytes", [1, 40_000, 1 << 40], ids=["node", "layer", "whole"])
def test_streamed_equals_one_session(qwen_external, fused, segment_bytes):
    model = modelfile.load_model(qwen_external)
    if fused:
        model, _ = fuse_decoder(model)
    ref = _plain(modelfile.serialized(model))
    s = stream.Streamed(model, threads=1, segment_bytes=segment_bytes)
    assert len(s.segments) > (20 if segment_bytes == 1 else 2 if segment_bytes == 40_000 else 0)
    assert [a.name for a in s.get_inputs()] == [a.name for a in ref.get_inputs()]
    assert [a.name for a in s.get_outputs()] == [a.name for a in ref.get_outputs()]
    io, io_s = runtime.ModelIO.from_session(ref), runtime.ModelIO.from_session(s)
    assert io_s.inputs == io.inputs and io_s.outputs == io.outputs and io_s.past_to_present == io.past_to_present
    f = runtime.feeds(io, _ids()[None, :])
    for a, b in zip(s.run(None, f), ref.run(None, f)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # many windows: each segment's session built once; intermediate values are streamed out
    feeds = [runtime.feeds(io, _ids(n, seed)[None, :]) for seed, n in enumerate((7, 12, 30))]
    mm = next(n.outputs[0].name for n in model.graph if n.op_type in ("MatMul", "MatMulNBits"))
    got: dict = {}
    s.run_many(["logits", mm], feeds, lambda w, n, a: got.setdefault((w, n), a))
    assert s.sessions_built <= 2 * len(s.segments)
    plain = _plain(_with_output(model, mm))
    for w, f in enumerate(feeds):
        lo, x = plain.run(["logits", mm], f)
        np.testing.assert_allclose(got[w, "logits"], lo, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[w, mm], x, rtol=1e-5, atol=1e-5)


def test_streamed_segments_with_a_large_tensor_are_not_prepacked(qwen_external, monkeypatch):
    """A segment holding a tensor over PREPACK_MAX_BYTES (a 1.5B model's head, 0.9 GB: packing would
    hold it twice) runs with ORT's prepacking off, the others with it on; the outputs are the same."""
    model = modelfile.load_model(qwen_external)
    ref = _plain(modelfile.serialized(model))
    sizes = sorted(v.const_value.nbytes for v in model.graph.initializers.values())
    monkeypatch.setattr(stream, "PREPACK_MAX_BYTES", sizes[-1] - 1)      # the largest tensor only
    flags = []
    real = stream._options
    monkeypatch.setattr(stream, "_options", lambda threads, so=None, prepack=True: (flags.append(prepack),
                                                                                    real(threads, so, prepack))[1])
    s = stream.Streamed(model, threads=1, segment_bytes=40_000)
    f = runtime.feeds(runtime.ModelIO.from_session(ref), _ids()[None, :])
    for a, b in zip(s.run(None, f), ref.run(None, f)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert flags.count(False) == sum(1 for g in s.segments if any(s.sizes[x] == sizes[-1] for x in g.inits)) >= 1
    assert flags.count(True) >= 3


def test_streamed_run_returns_arrays_that_own_their_memory(qwen_external):
    """What Streamed.run returns (and what it keeps between segments) owns its memory: an ONNX Runtime
    output is a view of its session's arena and would keep the whole arena alive after the segment
    (~75 MB a segment of a 1.5B model at 512 tokens, for a present.N.key of 0.5 MB)."""
    import custom_ops

    model = modelfile.load_model(qwen_external)
    plain = _plain(modelfile.serialized(model))
    io = runtime.ModelIO.from_session(plain)
    f = runtime.feeds(io, _ids()[None, :])
    if all(a.flags.owndata for a in plain.run(None, f)):
        pytest.skip("this onnxruntime copies its outputs: nothing to keep apart")
    s = stream.Streamed(model, threads=1, segment_bytes=40_000)
    kept = []
    real = custom_ops.session

    class Spy:               # the arrays each segment session hands out, and the store Streamed keeps
        def __init__(self, sess):
            self.sess = sess

        def run(self, names, feed):
            out = self.sess.run(names, feed)
            kept.extend(out)
            return out

    import unittest.mock as mock

    with mock.patch.object(custom_ops, "session", lambda *a, **k: Spy(real(*a, **k))):
        got = s.run(None, f)
    assert kept and not all(a.flags.owndata for a in kept)
    assert all(a.flags.owndata for a in got)
    for a, b in zip(got, plain.run(None, f)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _with_output(model: ir.Model, name: str) -> bytes:
    proto = onnx.load_from_string(modelfile.serialized(model))
    proto.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    return proto.SerializeToString()


def test_streamed_perplexity_equals_runtime_perplexity(qwen_external):
    model = modelfile.load_model(qwen_external)
    ref = _plain(str(qwen_external))
    io = runtime.ModelIO.from_session(ref)
    ids = _ids(150, 3)
    for window in (16, 64, 150, 400):
        want = runtime.perplexity(ref, io, ids, window=window)
        got = stream.perplexity(stream.Streamed(model, threads=1, segment_bytes=40_000), io, ids, window)
        assert got["tokens"] == want["tokens"] and got["windows"] == want["windows"]
        assert abs(got["nll"] - want["nll"]) < 1e-5 * max(1.0, abs(want["nll"]))


def test_session_picks_streamed_for_large_models(qwen_external, monkeypatch):
    model = modelfile.load_model(qwen_external)
    monkeypatch.setattr(stream, "STREAM_BYTES", 1000)
    assert isinstance(stream.session(model, threads=1), stream.Streamed)
    assert not isinstance(stream.session(model, threads=1, stream=False), stream.Streamed)
    monkeypatch.setattr(stream, "STREAM_BYTES", 1 << 40)
    assert not isinstance(stream.session(model, threads=1), stream.Streamed)


def test_streamed_model_with_external_data_and_no_library_ops(tmp_path):
    """toy's plain decoder (no KV cache) with external data: a Streamed run equals the file's session."""
    from test_external_data import save_layout

    src = save_layout(onnx.load(str(toy.build(tmp_path / "t" / "m.onnx", tokenizer=False))), tmp_path / "in", "one_file")
    model = modelfile.load_model(src)
    s = stream.Streamed(model, threads=1, segment_bytes=20_000)
    assert len(s.segments) > 3
    ref = _plain(str(src))
    f = {"input_ids": np.random.default_rng(0).integers(2, 50, (1, 9))}
    for a, b in zip(s.run(None, f), ref.run(None, f)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the rewrite, streamed
RECIPES = {
    # the quality guard: the dense reference's perplexity and every trial model, run streamed
    "int4-guard": ["--weights", "int4", "--quality-budget", "1.0"],
    # Grams of every weight's input from the dense reference (calibration), streamed
    "tt": ["--tt=on", "--tt-target=all", "--tt-gap=0.3", "--tt-speed-check=off", "--quality-budget=off", "--fuse=off"],
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_rewrite_streamed_equals_rewrite_whole(qwen_external, tmp_path, monkeypatch, recipe):
    """The same rewrite with every measurement of the dense reference and of the trials run whole, and
    segment by segment (ORTLEAN_STREAM_BYTES below the model's weights): the same layer decisions,
    the same gaps and losses (to float rounding), the same written weights."""
    import json

    from rewriter import cli

    calib = tmp_path / "calib.txt"
    calib.write_text(toy.text(1500))
    reports = {}
    runs = []
    real = stream.Streamed.run_many
    monkeypatch.setattr(stream.Streamed, "run_many", lambda self, *a, **k: (runs.append(len(self.segments)),
                                                                            real(self, *a, **k))[1])
    for mode, limit in (("whole", 1 << 40), ("streamed", 1000)):
        if mode == "streamed":
            assert runs == []
        monkeypatch.setattr(stream, "STREAM_BYTES", limit)
        monkeypatch.setattr(stream, "SEGMENT_BYTES", 60_000)
        out, rep = tmp_path / mode / "model.onnx", tmp_path / f"{mode}.json"
        assert cli.main(["rewrite", str(qwen_external), "-o", str(out), *RECIPES[recipe], "--calib-text", str(calib),
                         "--calib-tokens", "256", "--calib-window", "64", "--quality-tokens", "128", "-q",
                         "--report", str(rep)]) == 0
        reports[mode] = json.loads(rep.read_text())
    assert runs and min(runs) > 3      # the streamed rewrite ran its measurements segment by segment
    a, b = reports["whole"], reports["streamed"]
    assert [(r["layer"], r["backend"]) for r in a["layers"]] == [(r["layer"], r["backend"]) for r in b["layers"]]
    for ra, rb in zip(a["layers"], b["layers"]):
        if ra["gap"] is not None:
            assert abs(ra["gap"] - rb["gap"]) < 1e-4 * max(1.0, abs(ra["gap"])), ra["layer"]
    if a["quality"] and "loss" in a["quality"]:
        assert abs(a["quality"]["loss"] - b["quality"]["loss"]) < 1e-4
        for k, v in a["quality"].get("trials", {}).items():
            assert abs(v - b["quality"]["trials"][k]) < 1e-4, k
    if recipe == "int4-guard":   # quantization does not depend on the measurement: the same bytes
        wa = {t.name: t.raw_data for t in onnx.load(str(tmp_path / "whole" / "model.onnx")).graph.initializer}
        wb = {t.name: t.raw_data for t in onnx.load(str(tmp_path / "streamed" / "model.onnx")).graph.initializer}
        assert wa == wb


@pytest.mark.parametrize("form", ["optimum", "fused-int4"])
def test_last_position_logits_keeps_decode_steps(qwen_external, form):
    """The decode view: the head reads the last position only; every decode step's logits are the
    model's own, bit for bit, and the prefill's last row is the model's last row."""
    from rewriter.quantize import quantize_weights

    model = modelfile.load_model(qwen_external)
    if form == "fused-int4":
        model, _ = fuse_decoder(model)
        model = ir.serde.deserialize_model(onnx.load_from_string(modelfile.serialized(model)))   # in memory
        model, _ = quantize_weights(model, "int4")
    view = stream.last_position_logits(model)
    assert view is not None and any(n.op_type == "Slice" and n.name == "ortlean_last_position" for n in view.graph)
    assert not any(n.name == "ortlean_last_position" for n in model.graph)        # the model is not changed
    a = stream.session(model, threads=1, stream=False)
    b = stream.session(model, threads=1, stream=False, last_logits=True)
    io = runtime.ModelIO.from_session(a)
    ids = _ids(20, 5)
    oa = runtime.run(a, io, runtime.feeds(io, ids[None, :12]))
    ob = runtime.run(b, io, runtime.feeds(io, ids[None, :12]))
    assert oa["logits"].shape[1] == 12 and ob["logits"].shape[1] == 1
    np.testing.assert_allclose(ob["logits"][:, -1], oa["logits"][:, -1], rtol=1e-5, atol=1e-5)
    pa, pb, n = io.next_state(oa), io.next_state(ob), 12
    for t in range(12, 19):
        sa = runtime.run(a, io, runtime.feeds(io, ids[None, t:t + 1], pa, n))
        sb = runtime.run(b, io, runtime.feeds(io, ids[None, t:t + 1], pb, n))
        np.testing.assert_array_equal(sa["logits"], sb["logits"]) if t > 12 else None
        pa, pb, n = io.next_state(sa), io.next_state(sb), n + 1
    # the past each step left is the model's own (the prefill's K/V rows do not depend on the head)
    for k in pa:
        np.testing.assert_allclose(pa[k], pb[k], rtol=1e-6, atol=1e-6)


def test_last_position_logits_refuses_what_it_cannot_see():
    """No logits output, or a head whose input feeds something else: None (the model is used as it is)."""
    x = ir.val("x", ir.DataType.FLOAT, [1, "T", 8])
    w = ir.Value(name="W", const_value=ir.tensor(np.ones((8, 4), np.float32)))
    mm = ir.Node("", "MatMul", [x, w], name="head", num_outputs=1)
    mm.outputs[0].name = "logits"
    other = ir.Node("", "Relu", [x], name="other", num_outputs=1)
    other.outputs[0].name = "hidden"
    g = ir.Graph([x], [mm.outputs[0], other.outputs[0]], nodes=[mm, other], initializers=[w], opset_imports={"": 17})
    assert stream.last_position_logits(ir.Model(g, ir_version=10)) is None      # the head's input feeds another node
    assert stream.last_position_logits(ir.Model(g, ir_version=10), logits="nope") is None
    g.remove(other, safe=False)
    g.outputs.pop()
    v = stream.last_position_logits(ir.Model(g, ir_version=10))                  # the head alone reads it: sliced
    assert v is not None and [n.op_type for n in v.graph] == ["Slice", "MatMul"]


def test_runnable_serializes_tensors_that_ort_constant_folds(monkeypatch):
    """ORT folds a node whose inputs are all initializers while it optimizes the graph, before the
    arrays ``add_initializer`` hands over are in place: it read the placeholder's zeros (Gemma 3's
    tied embedding, a Reshape of the head's MatMulNBits scales, made the guard's trial model
    +25,000 % worse than the model it wrote). Such a tensor is serialized; one only a runtime input
    meets is still shared; the outputs equal the serialized model's at every optimization level."""
    import onnxruntime as ort

    monkeypatch.setattr(stream, "SHARE_BYTES", 1024)
    rng = np.random.default_rng(0)
    folded_arr = rng.standard_normal((64, 32)).astype(np.float32)     # 8 KiB: shared by size
    shared_arr = rng.standard_normal((32, 16)).astype(np.float32)
    x = ir.Value(name="x", shape=ir.Shape([4, 32]), type=ir.TensorType(ir.DataType.FLOAT))
    w_fold = ir.Value(name="w_fold", const_value=ir.tensor(folded_arr, name="w_fold"))
    w_mm = ir.Value(name="w_mm", const_value=ir.tensor(shared_arr, name="w_mm"))
    shape = ir.Value(name="shape", const_value=ir.tensor(np.array([32, 64], np.int64), name="shape"))
    r = ir.Node("", "Reshape", [w_fold, shape], name="fold")              # all inputs constant: folded
    t = ir.Node("", "Slice", [r.outputs[0], ir.Value(name="s0", const_value=ir.tensor(np.array([0], np.int64), name="s0")),
                              ir.Value(name="s1", const_value=ir.tensor(np.array([16], np.int64), name="s1")),
                              ir.Value(name="ax", const_value=ir.tensor(np.array([1], np.int64), name="ax"))], name="cut")
    m1 = ir.Node("", "MatMul", [x, w_mm], name="mm")                    # a runtime input: not folded
    add = ir.Node("", "Add", [m1.outputs[0], ir.Value(name="zero", const_value=ir.tensor(np.zeros(16, np.float32), name="zero"))],
                  name="add")
    m2 = ir.Node("", "MatMul", [x, t.outputs[0]], name="mm2")
    y = ir.Node("", "Add", [add.outputs[0], m2.outputs[0]], name="y")
    y.outputs[0].name = "y"
    y.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    consts = [w_fold, w_mm, shape, *t.inputs[1:], add.inputs[1]]
    g = ir.Graph([x], [y.outputs[0]], nodes=[r, t, m1, add, m2, y], initializers=consts, opset_imports={"": 21})
    model = ir.Model(g, ir_version=10)
    run = stream.runnable(model)
    assert "w_mm" in run.shared and "w_fold" not in run.shared
    xv = rng.standard_normal((4, 32)).astype(np.float32)
    want = xv @ shared_arr + xv @ folded_arr.reshape(32, 64)[:, :16]
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        got = stream.session(model, threads=1, so=so, stream=False).run(None, {"x": xv})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
