"""Models whose weights live in external data files (one file next to the model, the dynamo
export's `model.onnx` + `model.onnx.data`; one file per tensor; a file in a subfolder) and
single-file models are rewritten by every backend: the output loads in ONNX Runtime on its own,
equals the rewritten model as it was in memory and the rewrite of the single-file form, and the
input files are never modified. Saving never releases a memory map that numpy views still point
into (issue 13: `BufferError: cannot close exported pointers exist`). The > 2 GB case is
tests/test_large_model.py."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import custom_ops
import toy
from conftest import requires_native
from rewriter import cli
from rewriter.kit import modelfile

LAYOUTS = ("single", "one_file", "per_tensor", "subfolder")


def save_layout(proto: onnx.ModelProto, d: Path, layout: str) -> Path:
    """`proto` saved as d/model.onnx in `layout` (small tensors stay inline, as in real exports:
    ORT's shape inference cannot read a Reshape's shape from external data)."""
    d.mkdir(parents=True, exist_ok=True)
    p = d / "model.onnx"
    proto = onnx.ModelProto.FromString(proto.SerializeToString())
    if layout == "single":
        onnx.save(proto, str(p))
    elif layout == "one_file":       # torch.onnx.export(..., dynamo=True): model.onnx + model.onnx.data
        onnx.save(proto, str(p), save_as_external_data=True, all_tensors_to_one_file=True,
                  location="model.onnx.data", size_threshold=1024)
    elif layout == "per_tensor":     # several data files
        onnx.save(proto, str(p), save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=1024)
    elif layout == "subfolder":
        (d / "weights").mkdir(exist_ok=True)
        onnx.save(proto, str(p), save_as_external_data=True, all_tensors_to_one_file=True,
                  location="weights/model.data", size_threshold=1024)
    else:
        raise ValueError(layout)
    toy.write_tokenizer(d / "tokenizer.json")
    files = [f for f in d.rglob("*") if f.is_file() and f.name != "tokenizer.json"]
    assert len(files) == {"single": 1, "one_file": 2, "subfolder": 2}.get(layout, len(files))
    if layout == "per_tensor":
        assert len(files) > 3
    return p


def digest(d: Path) -> dict[str, str]:
    return {str(f.relative_to(d)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.rglob("*")) if f.is_file()}


# ------------------------------------------------------------------------------- save (unit)
@pytest.mark.parametrize("large", [False, True], ids=["inline", "external"])
def test_save_keeps_memory_maps_under_live_views(tmp_path, monkeypatch, large):
    """A backend holding a numpy view into the input's memory-mapped weights (what a gating plan
    does) must not make saving fail, and saving must not load the untouched tensors into the
    model or release their maps: the loaded model is the same after the save."""
    src = save_layout(toy.cached(), tmp_path / "in", "one_file")
    before = digest(src.parent)
    model = modelfile.load_model(src)
    ext = {n: v.const_value for n, v in model.graph.initializers.items() if isinstance(v.const_value, ir.ExternalTensor)}
    assert len(ext) >= 8
    views = {n: t.numpy() for n, t in ext.items()}      # live views into the maps
    expect = {n: np.array(v) for n, v in views.items()}
    monkeypatch.setattr(modelfile, "EXTERNAL_DATA_THRESHOLD", 0 if large else 1 << 40)
    out = tmp_path / "out" / "m.onnx"
    written = modelfile.save_model_atomic(model, out, input_path=src, check=lambda p: modelfile.check(p, out))
    assert (out.parent / "m.onnx.data").exists() == large and written[0] == out
    # untouched: still the same external tensors, maps open, views valid
    for n, t in ext.items():
        assert model.graph.initializers[n].const_value is t
        np.testing.assert_array_equal(views[n], expect[n])
    # the output stands alone (no reference to the input's data file) and holds the same data
    proto = onnx.load(str(out), load_external_data=False)
    locs = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    assert locs == ({"m.onnx.data"} if large else set())
    saved = {t.name: onnx.numpy_helper.to_array(t, base_dir=str(out.parent)) for t in onnx.load(str(out)).graph.initializer}
    for n, a in expect.items():
        np.testing.assert_array_equal(saved[n], a)
    assert digest(src.parent) == before


def test_serialized_clone_keeps_memory_maps(tmp_path):
    """The in-memory forms the rewrite runs in ORT (quality trials, the model after a "pre" graph
    pass) serialize external tensors without releasing them."""
    src = save_layout(toy.cached(), tmp_path / "in", "subfolder")
    model = modelfile.load_model(src)
    views = [v.const_value.numpy() for v in model.graph.initializers.values() if isinstance(v.const_value, ir.ExternalTensor)]
    assert views
    data = modelfile.serialized(model.clone())
    sess = custom_ops.session(data, threads=1)
    ref = custom_ops.session(str(src), threads=1)
    feeds = _cached_feeds()
    for a, b in zip(sess.run(None, feeds), ref.run(None, feeds)):
        np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(v).all() for v in views)


# ------------------------------------------------------------------------------- every backend × layout
BACKENDS = {
    "tt": ["--tt=on", "--tt-target=all", "--tt-gap=0.3", "--tt-speed-check=off"],
    "procsparse": ["--proc-sparse=on", "--proc-target=all", "--proc-gap=0.6", "--proc-fanout=all", "--proc-max-bytes=1.0",
                   "--proc-speed-check=off", "--proc-block=32"],
    "kwta": ["--kwta=on", "--kwta-k=0.75"],
    "packed_attention": ["--state-pack", "binary", "--attn-budget", "0.5"],
}
OPS = {"tt": "TTMatMul", "procsparse": "ProcSparseMatMul", "kwta": "EventGatedMatMul", "packed_attention": "PackedAttention"}


def _cached_feeds(T: int = 10, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    f = {"input_ids": rng.integers(2, 50, (1, T)).astype(np.int64), "attention_mask": np.ones((1, T), np.int64)}
    for l in range(2):
        for x in ("key", "value"):
            f[f"past_key_values.{l}.{x}"] = np.zeros((1, 2, 0, 12), np.float32)
    return f


def _feeds(sess, T: int = 10) -> dict:
    from custom_ops import runtime

    io = runtime.ModelIO.from_session(sess)
    return runtime.feeds(io, _cached_feeds(T)["input_ids"])


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("calib") / "calib.txt"
    p.write_text(toy.text(2000))
    return p


@pytest.fixture(scope="module")
def protos() -> dict[str, onnx.ModelProto]:
    plain = onnx.load(str(toy.build(Path(__import__("tempfile").mkdtemp()) / "m.onnx", tokenizer=False)))
    return {"plain": plain, "cached": toy.cached()}


@pytest.fixture(scope="module")
def rewrites(tmp_path_factory, protos, calib):
    """{(backend, layout): (input dir, input digest before, output path, in-memory model bytes)}"""
    root = tmp_path_factory.mktemp("layouts")
    grabbed = {}
    real_save = modelfile.save_model_atomic

    def grab(model, out_path, **kw):
        written = real_save(model, out_path, **kw)
        grabbed[Path(out_path)] = modelfile.serialized(model.clone())
        return written

    modelfile.save_model_atomic = grab
    try:
        res = {}
        for backend, flags in BACKENDS.items():
            proto = protos["cached" if backend == "packed_attention" else "plain"]
            for layout in LAYOUTS:
                d = root / backend / layout
                src = save_layout(proto, d / "in", layout)
                before = digest(src.parent)
                out = d / "out" / "model.lean.onnx"
                try:
                    rc = cli.main(["rewrite", str(src), "-o", str(out), *flags, "--quality-budget=off",
                                   "--calib-text", str(calib), "--calib-tokens", "512", "--calib-window", "64", "-q"])
                except Exception as e:  # reported by the test of this backend
                    rc = f"{type(e).__name__}: {e}"
                res[backend, layout] = (rc, src.parent, before, out, grabbed.get(out))
    finally:
        modelfile.save_model_atomic = real_save
    return res


@requires_native
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_rewrite_every_layout(rewrites, backend):
    ref_out = None
    for layout in LAYOUTS:
        rc, d, before, out, mem = rewrites[backend, layout]
        assert rc == 0, (backend, layout, rc)
        assert digest(d) == before, f"{backend}/{layout}: the input was modified"
        proto = onnx.load(str(out), load_external_data=False)
        assert any(n.op_type == OPS[backend] for n in proto.graph.node), (backend, layout)
        # the output stands alone: inline weights (small model), nothing pointing at the input's files
        assert not [t.name for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        assert not [f for f in out.parent.iterdir() if f.name.startswith(".ortlean-")]
        sess = custom_ops.session(str(out), threads=1)
        feeds = _feeds(sess)
        got = sess.run(None, feeds)
        # equals the rewritten model as it was in memory
        for a, b in zip(got, custom_ops.session(mem, threads=1).run(None, feeds)):
            np.testing.assert_array_equal(a, b)
        # and the rewrite of the single-file form (the layout changes nothing)
        if ref_out is None:
            ref_out = got
        else:
            for a, b in zip(got, ref_out):
                np.testing.assert_array_equal(a, b, err_msg=f"{backend}/{layout} differs from the single-file rewrite")


@requires_native
def test_quality_guard_on_external_data(tmp_path, protos, calib):
    """The quality guard runs trial models built in memory from the memory-mapped input (each a
    clone sharing its tensors) while the gating plans hold views of the weights."""
    src = save_layout(protos["plain"], tmp_path / "in", "one_file")
    before = digest(src.parent)
    out = tmp_path / "out" / "m.onnx"
    rc = cli.main(["rewrite", str(src), "-o", str(out), "--kwta=on", "--kwta-k=0.75", "--quality-budget=1.0",
                   "--calib-text", str(calib), "--calib-tokens", "512", "--calib-window", "64", "-q"])
    assert rc == 0 and out.is_file()
    assert any(n.op_type == "EventGatedMatMul" for n in onnx.load(str(out)).graph.node)
    assert digest(src.parent) == before


# ------------------------------------------------------------------------------- Constant values in external data
# optimum saves a model over 2 GB with `onnx.save(..., convert_attribute=True, size_threshold=100)`:
# a Constant node's `value` attribute tensor (Qwen2.5-1.5B's rotary inv_freq, 256 bytes) goes to the
# external data file too. Issue 35: the fusion pass (ORT's optimizer reading it) and the save path
# (the output pointing at the input's data file) both failed on it.
def _constant_in_external_data(d: Path, weight: str = "onnx::MatMul_0g") -> Path:
    """toy's plain decoder with one weight as a Constant node instead of an initializer, saved like
    optimum saves a large export (one data file, attribute tensors converted too)."""
    proto = onnx.load(str(toy.build(Path(__import__("tempfile").mkdtemp()) / "m.onnx", tokenizer=False)))
    init = next(t for t in proto.graph.initializer if t.name == weight)
    proto.graph.initializer.remove(init)
    const = onnx.helper.make_node("Constant", [], [weight], name="Constant_big", value=init)
    proto.graph.node.insert(0, const)
    d.mkdir(parents=True, exist_ok=True)
    p = d / "model.onnx"
    onnx.save(proto, str(p), save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx_data",
              size_threshold=1024, convert_attribute=True)
    toy.write_tokenizer(d / "tokenizer.json")
    saved = onnx.load(str(p), load_external_data=False)
    node = next(n for n in saved.graph.node if n.name == "Constant_big")
    assert node.attribute[0].t.data_location == onnx.TensorProto.EXTERNAL
    return p


def _attr_external(path: Path) -> list[str]:
    proto = onnx.load(str(path), load_external_data=False)
    return [n.name for _, n in modelfile._proto_nodes(proto.graph) if any(
        a.type == onnx.AttributeProto.TENSOR and a.t.data_location == onnx.TensorProto.EXTERNAL for a in n.attribute)]


@pytest.mark.parametrize("large", [False, True], ids=["inline", "external"])
def test_save_carries_constant_values_in_external_data(tmp_path, monkeypatch, large):
    src = _constant_in_external_data(tmp_path / "in")
    before = digest(src.parent)
    model = modelfile.load_model(src)
    (what, owner, t), = [x for x in modelfile.external_tensors(model) if not isinstance(x[1], ir.Value)]
    assert "Constant_big" in what and isinstance(t, ir.ExternalTensor)
    expect = np.array(t.numpy())
    monkeypatch.setattr(modelfile, "EXTERNAL_DATA_THRESHOLD", 0 if large else 1 << 40)
    out = tmp_path / "out" / "m.onnx"
    modelfile.save_model_atomic(model, out, input_path=src, check=lambda p: modelfile.check(p, out))
    # the loaded model is unchanged: the attribute still holds the memory-mapped tensor
    assert model.graph.node("Constant_big").attributes["value"].value is t
    assert (out.parent / "m.onnx.data").exists() == large
    assert _attr_external(out) == []                   # the value is inline in the output
    node = next(n for n in onnx.load(str(out)).graph.node if n.name == "Constant_big")
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(node.attribute[0].t), expect)
    ref = custom_ops.session(str(src), threads=1)
    got = custom_ops.session(str(out), threads=1)
    feeds = {"input_ids": np.array([[3, 5, 7, 9]], np.int64)}
    for a, b in zip(got.run(None, feeds), ref.run(None, feeds)):
        np.testing.assert_array_equal(a, b)
    # the in-memory form (calibration, quality trials) runs too
    mem = custom_ops.session(modelfile.serialized(model), threads=1)
    for a, b in zip(mem.run(None, feeds), ref.run(None, feeds)):
        np.testing.assert_array_equal(a, b)
    assert digest(src.parent) == before


def test_load_names_a_constant_whose_external_data_is_missing(tmp_path):
    src = _constant_in_external_data(tmp_path / "in")
    node = next(n for n in onnx.load(str(src), load_external_data=False).graph.node if n.name == "Constant_big")
    info = {e.key: int(e.value) for e in node.attribute[0].t.external_data if e.key in ("offset", "length")}
    with open(src.parent / "model.onnx_data", "r+b") as fh:   # cut inside the Constant's bytes only
        fh.truncate(info["offset"] + info["length"] - 4)
    with pytest.raises(modelfile.OrtleanError, match=r"Constant_big.*truncated|truncated.*Constant_big"):
        modelfile.load_model(src)
    proto = onnx.load(str(src), load_external_data=False)   # the Constant's bytes in a file that is not there
    node = next(n for n in proto.graph.node if n.name == "Constant_big")
    next(e for e in node.attribute[0].t.external_data if e.key == "location").value = "gone.data"
    onnx.save(proto, str(src))
    with pytest.raises(modelfile.OrtleanError, match="'gone.data' of attribute 'value' of node 'Constant_big'"):
        modelfile.load_model(src)


@requires_native
@pytest.mark.parametrize("large", [False, True], ids=["inline-out", "external-out"])
@pytest.mark.parametrize("fuse", ["auto", "off"])
def test_rewrite_optimum_export_with_constants_in_external_data(tmp_path, monkeypatch, fuse, large):
    """The tiny Qwen2 optimum export re-saved as optimum saves a large one (its rotary inv_freq
    Constant then lives in model.onnx_data): `rewrite --weights int4` (fusion: ORT's optimizer
    reads that Constant) and `--fuse=off` (the save path) give the model the single-file export's
    rewrite gives; also when the output is large enough for its own data file (the fused graph's
    com.microsoft-domain check then ran on a proto without its directory: "not regular file")."""
    import tiny_hf

    monkeypatch.setattr(modelfile, "EXTERNAL_DATA_THRESHOLD", 0 if large else 1 << 40)

    d = tiny_hf.models()["qwen2"]
    single = onnx.load(str(d / "model.onnx"))
    src = tmp_path / "in" / "model.onnx"
    src.parent.mkdir()
    onnx.save(single, str(src), save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx_data",
              size_threshold=64, convert_attribute=True)
    assert _attr_external(src), "no Constant value went to external data"
    before = digest(src.parent)
    outs = {}
    for name, path in (("single", d / "model.onnx"), ("external", src)):
        out = tmp_path / name / "model.lean.onnx"
        # --attn-exact is pinned: auto times GQA against the op per rewrite, and on a loaded machine the
        # two rewrites (same model) decided differently, so their graphs had different inputs.
        rc = cli.main(["rewrite", str(path), "-o", str(out), "--weights", "int4", f"--fuse={fuse}",
                       "--attn-exact=on", "--quality-budget=off", "-q"])
        assert rc == 0, name
        outs[name] = out
    assert digest(src.parent) == before
    assert _attr_external(outs["external"]) == []
    assert (outs["external"].parent / "model.lean.onnx.data").is_file() == large
    ops = {n.op_type for n in onnx.load(str(outs["external"])).graph.node}
    assert "BlockQuantMatMul" in ops and ("PackedAttention" in ops) == (fuse == "auto")
    sessions = [custom_ops.session(str(outs[k]), threads=1) for k in ("single", "external")]
    feeds = _feeds(sessions[0], T=6)
    for a, b in zip(*(s.run(None, feeds) for s in sessions)):
        np.testing.assert_array_equal(a, b)


def test_rewrite_prints_its_peak_memory_and_time(tmp_path, capsys):
    """The closing line of a rewrite: peak RSS (getrusage) and wall time, stage by stage in the report."""
    src = save_layout(toy.cached(), tmp_path / "in", "one_file")
    out, rep = tmp_path / "out" / "m.onnx", tmp_path / "r.json"
    assert cli.main(["rewrite", str(src), "-o", str(out), "--weights", "int8", "--quality-budget=off",
                     "--report", str(rep)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("rewrite: peak RSS ") and " GiB " in line and ", wall " in line
    import json
    res = json.loads(rep.read_text())["resources"]
    import resource
    peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    assert 0 < res["peak_rss_mb"] <= peak / 1024 + 1    # the rewrite's figure counts children (earlier tests' too)
    stages = [s["stage"] for s in res["stages"]]
    assert stages[0] == "load" and "plan" in stages and stages[-1] == "save"
    assert all(s["seconds"] >= 0 and s["rss_mb"] > 0 for s in res["stages"])


def _rss_file_kb() -> int:
    with open("/proc/self/status") as fh:
        return next(int(ln.split()[1]) for ln in fh if ln.startswith("RssFile:"))


def test_release_pages_drops_resident_weight_pages_and_keeps_views(tmp_path):
    """Reading a memory-mapped weight makes its pages resident (RssFile); release_pages gives them back
    to the page cache while numpy views stay valid (the plan loop releases each weight after planning:
    a 7 GB model's pages no longer all stay in the rewrite's RSS)."""
    x = ir.val("x", ir.DataType.FLOAT, [1, 4096])
    w = ir.Value(name="W", const_value=ir.tensor(np.random.default_rng(0).standard_normal((4096, 4096)).astype(np.float32)))
    n = ir.Node("", "MatMul", [x, w], name="mm", num_outputs=1)
    n.outputs[0].name, n.outputs[0].type = "y", ir.TensorType(ir.DataType.FLOAT)
    g = ir.Graph([x], [n.outputs[0]], nodes=[n], initializers=[w], opset_imports={"": 17})
    p = tmp_path / "m.onnx"
    ir.save(ir.Model(g, ir_version=10), p, external_data="m.onnx.data")
    model = modelfile.load_model(p)
    t = model.graph.initializers["W"].const_value
    assert isinstance(t, ir.ExternalTensor)
    before = _rss_file_kb()
    view = t.numpy()
    total = float(view.sum(dtype=np.float64))                 # every page read
    grown = _rss_file_kb() - before
    assert grown > 48_000                                      # 64 MiB of weight resident
    assert modelfile.release_pages(t) >= t.nbytes
    assert _rss_file_kb() - before < grown - 48_000
    assert float(view.sum(dtype=np.float64)) == total          # the view reads the same data again
    assert modelfile.release_pages(model.graph.initializers["W"].const_value) > 0
    assert modelfile.release_all(model) >= t.nbytes
