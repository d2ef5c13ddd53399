"""The fusion pass on the other decoder families optimum exports (issue 35): Mistral (sliding
window), Phi-3 (qkv_proj packed in the checkpoint; partial rotary with LongRoPE factors), Gemma 2
(sliding + global layers, soft-capped scores and logits), Qwen 3 (q/k norms) and Gemma 3 (q/k
norms, two rotary bases, no position_ids input) — tiny random-weight exports (tests/tiny_hf.py, MORE_FAMILIES). The fused
graph's logits and cache equal the export's on prefills longer than the window and on decode
steps after them; the layer forms GroupQueryAttention cannot express stay unfused with the reason;
PackedAttention (--state-pack binary --calib-text, --attn-exact on) runs on every fused family."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

import tiny_hf
from conftest import requires_native
from custom_ops import runtime
from rewriter.fuse import FuseError, fuse_decoder
from rewriter.kit import modelfile

FAMILIES = sorted(tiny_hf.MORE_FAMILIES)
LAYERS = 2
# what each tiny export must fuse into: local_window_size per layer, softcap, GQA scale, rotary dims,
# q/k norms in front of GQA, qkv read packed, cache names
EXPECT = {
    "mistral": dict(windows=[8, 8], softcap=0.0, scale=None, rotary=32, qk_norm=False, packed=True,
                    caches=["cos_cache"]),
    "phi3": dict(windows=[-1, -1], softcap=0.0, scale=None, rotary=32, qk_norm=False, packed=True, caches=["cos_cache"]),
    "phi3-partial-longrope": dict(windows=[-1, -1], softcap=0.0, scale=None, rotary=16, qk_norm=False, packed=True,
                                  caches=["cos_cache"]),
    "gemma2": dict(windows=[8, -1], softcap=5.0, scale=24 ** -0.5, rotary=32, qk_norm=False, packed=True,
                   caches=["cos_cache"]),
    "qwen3": dict(windows=[-1, -1], softcap=0.0, scale=None, rotary=32, qk_norm=True, packed=False,
                  caches=["cos_cache"]),
    "gemma3": dict(windows=[8, -1], softcap=0.0, scale=256 ** -0.5,  # query_pre_attn_scalar 256 (default)
                   rotary=32, qk_norm=True, packed=False,
                   caches=["cos_cache_local", "cos_cache_global"]),
}


@pytest.fixture(scope="module")
def fams():
    return tiny_hf.more_models()


@pytest.fixture(scope="module")
def fused(fams, tmp_path_factory):
    out = {}
    for fam, d in fams.items():
        model, report = fuse_decoder(ir.load(d / "model.onnx"), max_positions=modelfile.max_positions(d / "model.onnx"))
        p = tmp_path_factory.mktemp(f"fused-{fam}") / "model.onnx"
        ir.save(model, p)
        out[fam] = (p, report)
    return out


def _sess(path):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-12))


def _gqa(path):
    return [n for n in ir.load(path).graph if n.op_type == "GroupQueryAttention"]


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("batch", [1, 2])
def test_family_fused_matches_unfused(fams, fused, fam, batch):
    """A 13-token prefill (past the window of 8), then decode steps — one token, and for batch 1
    chunks of 3 after a past (GQA takes a chunk after a past only at batch 1): logits and the
    present K/V within 1e-4 of the export's, at every step."""
    s0, s1 = _sess(fams[fam] / "model.onnx"), _sess(fused[fam][0])
    io0, io1 = runtime.ModelIO.from_session(s0), runtime.ModelIO.from_session(s1)
    assert io1.inputs == io0.inputs and io1.outputs == io0.outputs and io1.past_to_present == io0.past_to_present
    rng = np.random.default_rng(batch)
    ids = rng.integers(3, 250, (batch, 13))
    o0, o1 = runtime.run(s0, io0, runtime.feeds(io0, ids)), runtime.run(s1, io1, runtime.feeds(io1, ids))
    for name in o0:
        assert _rel(o0[name], o1[name]) < 1e-4, (name, "prefill")
    p0, p1, plen = io0.next_state(o0), io1.next_state(o1), ids.shape[1]
    for step in range(6):
        nid = rng.integers(3, 250, (batch, 3 if batch == 1 and step % 2 else 1))
        o0 = runtime.run(s0, io0, runtime.feeds(io0, nid, p0, plen))
        o1 = runtime.run(s1, io1, runtime.feeds(io1, nid, p1, plen))
        for name in o0:
            assert _rel(o0[name], o1[name]) < 1e-4, (name, f"decode step {step}")
        p0, p1, plen = io0.next_state(o0), io1.next_state(o1), plen + nid.shape[1]


@pytest.mark.parametrize("fam", FAMILIES)
def test_family_right_padded_batch(fams, fused, fam):
    """GQA's padding contract on every family: a right-padded prefill. Decode steps after it only
    where the export can count positions as GQA does (the valid tokens before): with a position_ids
    input (Gemma's exports place a token at its slot) and no sliding window (the export's window
    counts the padding slots)."""
    s0, s1 = _sess(fams[fam] / "model.onnx"), _sess(fused[fam][0])
    io = runtime.ModelIO.from_session(s0)
    rng = np.random.default_rng(7)
    ids = rng.integers(3, 250, (2, 12))
    mask = np.ones((2, 12), np.int64)
    mask[0, -3:] = 0
    f = runtime.feeds(io, ids, attention_mask=mask)
    o0, o1 = runtime.run(s0, io, f), runtime.run(s1, io, f)
    valid = mask.astype(bool)
    assert _rel(o0["logits"][valid], o1["logits"][valid]) < 1e-4
    if not io.has_position_ids or max(EXPECT[fam]["windows"]) > 0:
        return
    p0, p1 = io.next_state(o0), io.next_state(o1)
    for _ in range(3):
        nid = rng.integers(3, 250, (2, 1))
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        f0, f1 = runtime.feeds(io, nid, p0, attention_mask=mask), runtime.feeds(io, nid, p1, attention_mask=mask)
        f0["position_ids"] = f1["position_ids"] = mask.sum(axis=1, keepdims=True) - 1
        o0, o1 = runtime.run(s0, io, f0), runtime.run(s1, io, f1)
        assert _rel(o0["logits"], o1["logits"]) < 1e-4
        p0, p1 = io.next_state(o0), io.next_state(o1)


@pytest.mark.parametrize("fam", FAMILIES)
def test_family_fused_graph(fams, fused, fam):
    """What each family fuses into: one GroupQueryAttention per layer with the family's
    local_window_size (sliding layers only), softcap, scale and rotary caches (rows =
    max_position_embeddings; Gemma 3: a local and a global pair), q/k RMSNorms in front of it, q/k/v
    read packed where the checkpoint or the pass packs them; no Softmax / rotary / shape subgraph
    left; the report's note names the features."""
    want = EXPECT[fam]
    path, report = fused[fam]
    m = ir.load(path)
    ops = [n.op_type for n in m.graph]
    gqa = _gqa(path)
    assert len(gqa) == report.layers == LAYERS == report.fusions["GroupQueryAttention"]
    for gone in ("Softmax", "Cos", "Sin", "Expand", "Where", "Concat", "Transpose", "Range"):
        assert gone not in ops, gone
    windows = [n.attributes.get_int("local_window_size", -1) for n in sorted(gqa, key=lambda n: n.name)]
    assert windows == want["windows"]
    for n in gqa:
        assert n.attributes.get_float("softcap", 0.0) == pytest.approx(want["softcap"])
        hd = 32
        scale = n.attributes.get_float("scale", 0.0) or 1 / math.sqrt(hd)
        assert scale == pytest.approx(want["scale"] or 1 / math.sqrt(hd), rel=1e-6)
        assert n.attributes.get_int("do_rotary") == 1
        assert n.inputs[7].const_value.shape == (256, want["rotary"] // 2)          # config's 256 positions
        assert (n.inputs[1] is None) == want["packed"]
    assert sorted({n.inputs[7].name for n in gqa}) == sorted(want["caches"])
    assert report.fusions["rotary_caches"] == len(want["caches"])
    sln_before = [n for n in m.graph if n.op_type == "SimplifiedLayerNormalization"
                  and any(u.node.op_type == "Reshape" and any(w.node.op_type == "GroupQueryAttention"
                                                              for w in u.node.outputs[0].uses())
                          for u in n.outputs[0].uses())]
    assert len(sln_before) == (2 * LAYERS if want["qk_norm"] else 0)
    assert ("sliding window 8" in report.note) == (8 in want["windows"])
    assert ("softcap" in report.note) == bool(want["softcap"])
    assert ("q/k RMSNorm" in report.note) == want["qk_norm"]
    assert ("partial rotary (16 of 32 dims)" in report.note) == (want["rotary"] < 32)
    if fam == "gemma2":    # the final logit soft-cap stays in the graph as the export writes it
        assert "Tanh" in ops
    assert report.nodes_after < report.nodes_before / 6


def test_gemma3_local_and_global_tables(fused):
    """Gemma 3's two rotary tables are the two bases' (rope_local_base_freq 100 on the sliding
    layer, rope_theta 1e6 with linear scaling 8 on the global one), rotate-half halves (to float32
    rounding of the angle: the export computes position · inv_freq in float32)."""
    m = ir.load(fused["gemma3"][0])
    pos = np.arange(256, dtype=np.float64)[:, None]
    for name, base, factor in (("cos_cache_local", 100.0, 1.0), ("cos_cache_global", 1e6, 8.0)):
        inv = 1.0 / base ** (np.arange(0, 32, 2) / 32) / factor
        np.testing.assert_allclose(m.graph.initializers[name].const_value.numpy(), np.cos(pos * inv), atol=5e-5)
        np.testing.assert_allclose(m.graph.initializers[name.replace("cos", "sin")].const_value.numpy(),
                                   np.sin(pos * inv), atol=5e-5)


def test_unfusable_forms_name_the_reason(fams):
    """A layer form GroupQueryAttention cannot express keeps the model unfused, with one line that
    names the node and why: a mask that adds a learnt bias, a rope whose table depends on the
    sequence length; a sliding window wider than the model's positions is no window."""
    # a bias on the mask of layer 1: not GQA's mask
    m = ir.load(fams["mistral"] / "model.onnx")
    sm = [n for n in m.graph if n.op_type == "Softmax"][1]
    add = sm.inputs[0].producer()
    bias = ir.Value(name="learnt_bias", const_value=ir.tensor(np.full((1,), 0.5, np.float32), name="learnt_bias"))
    m.graph.initializers["learnt_bias"] = bias
    biased = ir.node("Add", [add.inputs[1], bias], outputs=[ir.Value(name="biased_mask")])
    m.graph.insert_before(add, biased)
    add.replace_input_with(1, biased.outputs[0])
    with pytest.raises(FuseError) as e:
        fuse_decoder(m, max_positions=256)
    msg = str(e.value)
    assert "1 of 2 attention layers matched" in msg and "neither 0 nor a removal" in msg and "\n" not in msg
    # the rope's positions scaled by the sequence length (a stand-in for LongRoPE's switch)
    m = ir.load(fams["phi3"] / "model.onnx")
    cos_v = next(n for n in m.graph if n.op_type == "Cos").inputs[0]
    cos_node = next(n for n in m.graph if n.op_type == "Cos")
    ids = next(i for i in m.graph.inputs if i.name == "input_ids")
    seq = ir.node("Cast", [ir.node("Shape", [ids], attributes={"start": 1}).outputs[0]], attributes={"to": 1})
    for n in (seq.inputs[0].producer(), seq):
        m.graph.insert_before(cos_node, n)
    scaled = ir.node("Mul", [cos_v, seq.outputs[0]])
    m.graph.insert_before(cos_node, scaled)
    cos_node.replace_input_with(0, scaled.outputs[0])
    with pytest.raises(FuseError, match="depends on the sequence length|rotary rows of positions"):
        fuse_decoder(m, max_positions=256)
    # a model of 6 positions never reaches its window of 8: fused without local_window_size
    got, rep = fuse_decoder(ir.load(fams["mistral"] / "model.onnx"), max_positions=6)
    assert all(n.attributes.get_int("local_window_size", -1) == -1 for n in got.graph if n.op_type == "GroupQueryAttention")


def test_optimum_gemma2_sdpa_export_has_no_softcap(fams):
    """Why the tiny Gemma 2 is exported with eager attention: transformers' SDPA attention ignores
    the soft-cap, so the default optimum export of Gemma 2 computes uncapped scores. The eager
    export carries c·tanh(x/c) on every layer's scores (fused into GQA's softcap)."""
    m = ir.load(fams["gemma2"] / "model.onnx")
    tanh_scopes = {n.name.rsplit("/", 1)[0] for n in m.graph if n.op_type == "Tanh"}
    assert {f"/model/layers.{i}/self_attn" for i in range(LAYERS)} <= tanh_scopes


# --------------------------------------------------------------------------- PackedAttention on the fused families
def _rewrite(src, out, *flags):
    from rewriter import cli

    rep = Path(str(out) + ".json")
    rc = cli.main(["rewrite", str(src), "-o", str(out), "-q", "--report", str(rep), *flags])
    return rc, (json.loads(rep.read_text()) if rep.exists() else None)


def _calib_text(path: Path, seed=0, phrases=30, n=400):
    r = np.random.default_rng(seed)
    ph = [" ".join(f"w{x}" for x in r.integers(4, 256, 12)) for _ in range(phrases)]
    path.write_text(" ".join(ph[i] for i in r.integers(0, phrases, n)))
    return path


def _plain_logits(path, prompt, steps, lib=False):
    import custom_ops

    sess = custom_ops.session(str(path), threads=1) if lib else _sess(path)
    io = runtime.ModelIO.from_session(sess, str(path))
    o = runtime.run(sess, io, runtime.feeds(io, prompt))
    out, past, plen = [o["logits"][:, -1]], io.next_state(o), prompt.shape[1]
    for t in steps.T:
        o = runtime.run(sess, io, runtime.feeds(io, t[:, None], past, plen))
        out.append(o["logits"][:, -1])
        past, plen = io.next_state(o), plen + 1
    return np.stack(out, 1)


@requires_native
@pytest.mark.parametrize("fam", FAMILIES)
def test_family_packed_attention_exact(fams, fused, fam, tmp_path):
    """--attn-exact on, and --state-pack binary --calib-text with fp32 rows at full budget: every
    fused layer becomes PackedAttention with the family's window, softcap, scale and rotary caches
    (q/k norms stay in front of it), and the logits over a 20-token prompt and 14 decode steps (well
    past the window) equal the fused GroupQueryAttention graph's to 1e-5."""
    src = fams[fam] / "model.onnx"
    r = np.random.default_rng(2)
    prompt, steps = r.integers(3, 250, (1, 20)), r.integers(3, 250, (1, 14))
    ref = _plain_logits(fused[fam][0], prompt, steps)
    calib = _calib_text(tmp_path / "calib.txt")
    for out, flags in (("ex.onnx", ["--attn-exact", "on"]),
                       ("pa.onnx", ["--state-pack", "binary", "--calib-text", str(calib), "--attn-kv", "fp32",
                                    "--attn-budget", "1", "--attn-tune", "off"])):
        rc, rep = _rewrite(src, tmp_path / out, *flags)
        assert rc == 0, rep
        assert rep["graph_passes"][0]["backend"] == "fuse" and "fused 2 layers" in rep["graph_passes"][0]["decision"]
        m = ir.load(tmp_path / out)
        pa = [n for n in m.graph if n.op_type == "PackedAttention"]
        assert len(pa) == LAYERS and not any(n.op_type == "GroupQueryAttention" for n in m.graph)
        want = EXPECT[fam]
        assert sorted(n.attributes.get_int("local_window", -1) for n in pa) == sorted(want["windows"])
        assert all(n.attributes.get_float("softcap", 0.0) == pytest.approx(want["softcap"]) for n in pa)
        assert all(n.inputs[7].const_value.shape[1] == want["rotary"] // 2 for n in pa)
        got = _plain_logits(tmp_path / out, prompt, steps, lib=True)
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)


@requires_native
def test_gemma3_packed_attention_tuned(fams, tmp_path):
    """The default PackedAttention recipe (pq key codes fitted per layer on its own rotary table,
    int8 K/V rows, the tuner measuring decode-mode Δppl against exact attention) on the fused
    Gemma 3: written within the budget, decodes finite logits."""
    calib = _calib_text(tmp_path / "calib.txt")
    rc, rep = _rewrite(fams["gemma3"] / "model.onnx", tmp_path / "t.onnx", "--state-pack", "binary", "--calib-text",
                       str(calib), "--attn-tune-context", "160", "--attn-tune-score", "48")
    assert rc == 0, rep
    decisions = [g["decision"] for g in rep["graph_passes"]]
    assert "fused 2 layers" in decisions[0] and any("pq key codes" in d for d in decisions[1:])
    r = np.random.default_rng(4)
    logits = _plain_logits(tmp_path / "t.onnx", r.integers(3, 250, (1, 30)), r.integers(3, 250, (1, 10)), lib=True)
    assert np.isfinite(logits).all()
