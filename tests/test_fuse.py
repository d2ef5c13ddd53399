"""The fusion pass (optimum decoder → GroupQueryAttention / SkipSimplifiedLayerNormalization graph)
and --weights quantization, on tiny random-weight decoders exported by optimum (tests/tiny_hf.py)."""
from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

import tiny_hf
from custom_ops import runtime
from rewriter.fuse import FuseError, fuse_decoder, is_fused
from rewriter.quantize import quantize_weights

FAMILIES = sorted(tiny_hf.FAMILIES)


@pytest.fixture(scope="session")
def tiny():
    return tiny_hf.models()


@pytest.fixture(scope="session")
def fused(tiny, tmp_path_factory):
    out = {}
    for fam, d in tiny.items():
        model, report = fuse_decoder(ir.load(d / "model.onnx"))
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


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("batch", [1, 2])
def test_fused_matches_unfused_prefill_and_decode(tiny, fused, fam, batch):
    s0, s1 = _sess(tiny[fam] / "model.onnx"), _sess(fused[fam][0])
    io0, io1 = runtime.ModelIO.from_session(s0), runtime.ModelIO.from_session(s1)
    assert io1.inputs == io0.inputs and io1.outputs == io0.outputs and io1.past_to_present == io0.past_to_present
    rng = np.random.default_rng(batch)
    ids = rng.integers(3, 250, (batch, 9))
    o0, o1 = runtime.run(s0, io0, runtime.feeds(io0, ids)), runtime.run(s1, io1, runtime.feeds(io1, ids))
    for name in o0:
        assert _rel(o0[name], o1[name]) < 1e-4, (name, "prefill")
    p0, p1, plen = io0.next_state(o0), io1.next_state(o1), ids.shape[1]
    for step in range(4):
        nid = rng.integers(3, 250, (batch, 1))
        o0 = runtime.run(s0, io0, runtime.feeds(io0, nid, p0, plen))
        o1 = runtime.run(s1, io1, runtime.feeds(io1, nid, p1, plen))
        for name in o0:
            assert _rel(o0[name], o1[name]) < 1e-4, (name, f"decode step {step}")
        p0, p1, plen = io0.next_state(o0), io1.next_state(o1), plen + 1


@pytest.mark.parametrize("fam", FAMILIES)
def test_fused_right_padded_batch(tiny, fused, fam):
    """GQA's padding contract: right-padded rows, positions = count of valid tokens before."""
    s0, s1 = _sess(tiny[fam] / "model.onnx"), _sess(fused[fam][0])
    io = runtime.ModelIO.from_session(s0)
    rng = np.random.default_rng(7)
    ids = rng.integers(3, 250, (2, 8))
    mask = np.ones((2, 8), np.int64)
    mask[0, -3:] = 0
    f = runtime.feeds(io, ids, attention_mask=mask)
    o0, o1 = runtime.run(s0, io, f), runtime.run(s1, io, f)
    valid = mask.astype(bool)
    assert _rel(o0["logits"][valid], o1["logits"][valid]) < 1e-4
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
def test_fused_graph_shape(tiny, fused, fam):
    path, report = fused[fam]
    m = ir.load(path)
    ops = [n.op_type for n in m.graph]
    layers = report.layers
    assert ops.count("GroupQueryAttention") == layers == 2
    assert ops.count("SkipSimplifiedLayerNormalization") == 2 * layers
    assert ops.count("SimplifiedLayerNormalization") == 1
    for gone in ("Softmax", "RotaryEmbedding", "Pow", "Sqrt", "Expand", "Where", "Concat", "Transpose"):
        assert gone not in ops, gone
    # q/k/v packed into one MatMul per layer: qkv, o, gate, up, down per layer + the head
    assert ops.count("MatMul") == 5 * layers + 1
    gqa = next(n for n in m.graph if n.op_type == "GroupQueryAttention")
    assert gqa.inputs[1] is None and gqa.inputs[2] is None
    # the normalizations' mean / inverse std-dev outputs are absent (nothing reads them), as in genai's graph
    for n in m.graph:
        if n.op_type == "SkipSimplifiedLayerNormalization":
            assert [o.name for o in n.outputs[1:3]] in ([], ["", ""]), n.name
    assert gqa.attributes["do_rotary"].value == 1
    assert report.nodes_after < report.nodes_before / 8
    assert report.fusions["GroupQueryAttention"] == layers and report.fusions["packed_qkv"] == layers


def test_fuse_is_idempotent(fused):
    m = ir.load(fused["llama"][0])
    assert is_fused(m)
    again, report = fuse_decoder(m)
    assert again is m and "already fused" in report.note


def test_fuse_refuses_a_model_without_kv_cache(toy_model):
    with pytest.raises(FuseError, match="not an optimum text-generation-with-past decoder"):
        fuse_decoder(ir.load(toy_model))


def test_fuse_names_the_attention_it_cannot_match(tiny):
    m = ir.load(tiny["llama"] / "model.onnx")
    sm = [n for n in m.graph if n.op_type == "Softmax"][1]
    sm.attributes["axis"] = ir.AttrInt64("axis", 1)          # not attention over the keys any more
    with pytest.raises(FuseError) as e:
        fuse_decoder(m)
    msg = str(e.value)
    assert "1 of 2 attention layers matched" in msg and sm.name in msg and "\n" not in msg


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_fused_model_runs(tiny, fused, weights, tmp_path):
    m = ir.load(fused["qwen2"][0])
    q, info = quantize_weights(m, weights)
    n_mm = sum(1 for n in m.graph if n.op_type == "MatMul")
    assert len(info["quantized"]) == n_mm and not info["kept"]
    assert "/lm_head/MatMul" in info["quantized"]
    ops = [n.op_type for n in q.graph]
    assert info["packed"] == [] and ops.count("MatMulNBits") == n_mm and "MatMul" not in ops
    bits = {n.attributes["bits"].value for n in q.graph if n.op_type == "MatMulNBits"}
    assert bits == {int(weights[3:])}
    p = tmp_path / "q.onnx"
    ir.save(q, p)
    s0, s1 = _sess(tiny["qwen2"] / "model.onnx"), _sess(p)
    io = runtime.ModelIO.from_session(s0)
    ids = np.random.default_rng(3).integers(3, 250, 64)
    ppl0 = runtime.perplexity(s0, io, ids, window=32)["ppl"]
    ppl1 = runtime.perplexity(s1, io, ids, window=32)["ppl"]
    assert abs(ppl1 / ppl0 - 1) < (0.01 if weights == "int8" else 0.05)


def _logits_steps(path, ids, steps=3):
    """Prefill logits of ``ids`` and of ``steps`` decode steps after it (the plain loop)."""
    s = _sess(path)
    io = runtime.ModelIO.from_session(s)
    o = runtime.run(s, io, runtime.feeds(io, ids))
    out, past, plen = [o["logits"]], io.next_state(o), ids.shape[1]
    for t in range(steps):
        o = runtime.run(s, io, runtime.feeds(io, ids[:, t: t + 1], past, plen))
        out.append(o["logits"])
        past, plen = io.next_state(o), plen + 1
    return out


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("weights,symmetric,acc", [("int4", True, 4), ("int4", False, 4), ("int8", True, 4),
                                                   ("int4", True, 0)])
def test_packed_gate_up_equals_unpacked(tiny, fused, fam, weights, symmetric, acc, tmp_path):
    """gate and up (MatMulNBits reading one input) packed into one MatMulNBits + Split compute the
    same numbers as the two of them: every column keeps its blocks along K, the activations' int8
    blocks are the same. Prefill (M > 1) and decode (M = 1), batch 2."""
    m = ir.load(fused[fam][0])
    layers = fused[fam][1].layers
    paths, nbytes = [], []
    for pack in (False, True):
        q, info = quantize_weights(m, weights, symmetric=symmetric, accuracy_level=acc, pack=pack)
        ops = [n.op_type for n in q.graph]
        assert ops.count("Split") == (layers if pack else 0)
        assert ops.count("MatMulNBits") == (4 if pack else 5) * layers + 1
        assert len(info["packed"]) == (layers if pack else 0)
        assert all("/mlp/gate_up_proj/" in n for n in info["packed"])
        nbytes.append(sum(v.const_value.nbytes for v in q.graph.initializers.values()))
        if pack:   # the separate blocks are gone, not kept beside the packed ones: the same bytes + the split sizes
            assert nbytes[1] - nbytes[0] == layers * 2 * 8
            packed = next(n for n in q.graph if n.op_type == "MatMulNBits" and "gate_up" in n.name)
            assert packed.attributes["N"].as_int() == 2 * tiny_hf.FAMILIES[fam]["intermediate_size"]
            assert (len(packed.inputs) > 3) == (not symmetric)
        paths.append(tmp_path / f"q{int(pack)}.onnx")
        ir.save(q, paths[-1])
    ids = np.random.default_rng(11).integers(3, 250, (2, 6))
    for a, b in zip(_logits_steps(paths[0], ids), _logits_steps(paths[1], ids)):
        np.testing.assert_array_equal(a, b)


def test_pack_needs_the_same_input_and_settings(fused):
    """Only MatMulNBits of one input with the same K / bits / block / accuracy / zero-point form pack:
    a layer whose up projection stays a float MatMul keeps its gate alone."""
    m = ir.load(fused["llama"][0])
    up0 = next(n.name for n in m.graph if n.op_type == "MatMul" and "layers.0/mlp/up_proj" in n.name)
    q, info = quantize_weights(m, "int4", exclude=[up0], pack=True)
    assert info["packed"] == ["/model/layers.1/mlp/gate_up_proj/MatMul_Q4"]
    assert any(n.op_type == "MatMulNBits" and "layers.0/mlp/gate_proj" in n.name for n in q.graph)


def test_quantize_excludes_and_rejects(fused):
    m = ir.load(fused["llama"][0])
    q, info = quantize_weights(m, "int4", exclude=["/lm_head/MatMul"])
    assert info["kept"] == ["/lm_head/MatMul"]
    assert any(n.op_type == "MatMul" and n.name == "/lm_head/MatMul" for n in q.graph)
    assert quantize_weights(m, "fp32")[0] is m
    with pytest.raises(ValueError, match="int2"):
        quantize_weights(m, "int2")
    with pytest.raises(ValueError, match="not in the model"):
        quantize_weights(m, "int8", exclude=["/nope"])


def _tied_toy(V: int, D: int, untie: bool = False):
    """Gather(E) → MatMul(·, Eᵀ): a token embedding tied to its head (or, untie, a head that differs)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(V * D)
    E = rng.standard_normal((V, D)).astype(np.float32)
    ET = np.ascontiguousarray(E.T) + (np.float32(1e-3) if untie else np.float32(0))
    g = helper.make_graph(
        [helper.make_node("Gather", ["E", "ids"], ["h"], name="embed"),
         helper.make_node("MatMul", ["h", "ET"], ["logits"], name="lm_head")], "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", V])],
        [numpy_helper.from_array(E, "E"), numpy_helper.from_array(ET, "ET")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return ir.serde.deserialize_model(m), E


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("V,D", [(50, 40), (64, 64), (33, 96), (7, 17)])   # D not a multiple of the block: a Slice
def test_tied_embedding_reads_the_head_blocks(weights, V, D):
    """--weights with the tied embedding shared: the Gather becomes GatherBlockQuantized over the
    head's own blocks (the float32 table is gone, no new weight bytes) and returns exactly the rows
    of the dequantized head (accuracy_level 0: the head is exact too)."""
    from rewriter.quantize import DEFAULTS, dequantize_matrix, quantize_matrix

    m, E = _tied_toy(V, D)
    q, info = quantize_weights(m, weights, accuracy_level=0)
    assert info["embedding_shared"] == "embed"
    ops = [n.op_type for n in q.graph]
    assert "Gather" not in ops and ops.count("GatherBlockQuantized") == 1 and "MatMulNBits" in ops
    assert "E" not in q.graph.initializers
    assert not [v.name for v in q.graph.initializers.values()   # no float table left, only the head's scales
                if v.const_value.dtype == ir.DataType.FLOAT and v.const_value.size >= V * D]
    s = ort.InferenceSession(ir.serde.serialize_model(q).SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([[0, 3 % V, V - 1], [1, 1, 2 % V]], np.int64)
    out = s.run(None, {"ids": ids})[0]
    cfg = DEFAULTS[weights]
    W_hat = dequantize_matrix(*quantize_matrix(np.ascontiguousarray(E.T), cfg), D, cfg)     # [D, V]
    np.testing.assert_allclose(out, W_hat.T[ids] @ W_hat, rtol=1e-5, atol=1e-4)


def test_untied_or_fp32_embedding_stays():
    m, _ = _tied_toy(40, 32, untie=True)
    q, info = quantize_weights(m, "int4")
    assert info["embedding_shared"] is None and "Gather" in [n.op_type for n in q.graph]
    m, _ = _tied_toy(40, 32)
    q, info = quantize_weights(m, "int4", embed="fp32")
    assert info["embedding_shared"] is None and "E" in q.graph.initializers
    with pytest.raises(ValueError, match="--weights-embed"):
        quantize_weights(m, "int4", embed="int4")


def test_shared_kv_loop_matches_the_plain_loop(tiny, fused):
    from custom_ops.runtime.shared_kv import SharedKV, SharedKVError

    s0, s1 = _sess(tiny["qwen2"] / "model.onnx"), _sess(fused["qwen2"][0])
    io = runtime.ModelIO.from_session(s1)
    kv = SharedKV(s1, io, max_len=20)
    ids = np.random.default_rng(5).integers(3, 250, (1, 9))
    o = runtime.run(s0, io, runtime.feeds(io, ids))
    assert _rel(o["logits"], kv.prefill(ids)) < 1e-4
    past, plen = io.next_state(o), 9
    for t in (17, 99, 4):
        step = np.array([[t]])
        o = runtime.run(s0, io, runtime.feeds(io, step, past, plen))
        assert _rel(o["logits"], kv.step(step)) < 1e-4
        past, plen = io.next_state(o), plen + 1
    assert kv.length == 12
    kv2 = SharedKV(s1, io, max_len=20)        # a cache computed elsewhere
    kv2.fill(plen, past)
    assert _rel(runtime.run(s0, io, runtime.feeds(io, np.array([[8]]), past, plen))["logits"],
                kv2.step(np.array([[8]]))) < 1e-4
    with pytest.raises(SharedKVError, match="exceed max_len"):
        kv2.step(np.zeros((1, 10), np.int64))
    with pytest.raises(SharedKVError, match="not a GroupQueryAttention graph"):
        SharedKV(s0, io, max_len=20).prefill(ids)


def test_rotary_cache_trim(tiny, tmp_path):
    m, report = fuse_decoder(ir.load(tiny["llama"] / "model.onnx"), max_positions=64)
    assert m.graph.initializers["cos_cache"].const_value.shape[0] == 64
    p = tmp_path / "m.onnx"
    ir.save(m, p)
    s0, s1 = _sess(tiny["llama"] / "model.onnx"), _sess(p)
    io = runtime.ModelIO.from_session(s0)
    ids = np.arange(3, 40)[None]
    assert _rel(runtime.run(s0, io, runtime.feeds(io, ids))["logits"], runtime.run(s1, io, runtime.feeds(io, ids))["logits"]) < 1e-4


def test_fuse_reads_external_data(tiny, tmp_path):
    import onnx

    src = tmp_path / "ext" / "model.onnx"
    src.parent.mkdir()
    onnx.save_model(onnx.load(str(tiny["llama"] / "model.onnx")), str(src), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=128)
    m = ir.load(src)
    before = (len(m.graph.inputs), len(m.graph.initializers))
    fused_m, report = fuse_decoder(m)
    assert (len(m.graph.inputs), len(m.graph.initializers)) == before      # the input is left as it was
    assert report.fusions["GroupQueryAttention"] == 2 and report.fusions["ort:SkipSimplifiedLayerNormalization"] == 4
    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    ir.save(fused_m, out, external_data="model.onnx.data")
    s0, s1 = _sess(src), _sess(out)
    io = runtime.ModelIO.from_session(s0)
    ids = np.arange(3, 12)[None]
    assert _rel(runtime.run(s0, io, runtime.feeds(io, ids))["logits"], runtime.run(s1, io, runtime.feeds(io, ids))["logits"]) < 1e-4


# --------------------------------------------------------------------------- wired into `ortlean rewrite`
def _cli_rewrite(src, out, *flags):
    import json

    from rewriter import cli

    rep = out.with_suffix(".json")
    rc = cli.main(["rewrite", str(src), "-o", str(out), "--report", str(rep), "-q", *flags])
    return rc, (json.loads(rep.read_text()) if rep.exists() else None)


@pytest.mark.parametrize("fam", FAMILIES)
def test_rewrite_weights_int4_fuses_and_quantizes(tiny, fam, tmp_path):
    """`ortlean rewrite --weights int4 --weights-quantizer nbits` on an optimum decoder: the fusion pass
    runs first (default auto), then every weight MatMul, lm_head included, becomes MatMulNBits int4; the KV I/O is the
    export's, so the plain runtime loop drives it, close to the fp32 model."""
    src = tiny[fam] / "model.onnx"
    out = tmp_path / "model.onnx"
    rc, rep = _cli_rewrite(src, out, "--weights", "int4", "--weights-quantizer", "nbits", "--quality-budget", "off",
                           "--attn-exact", "off")   # GQA kept (see test_exact_attention_*)
    assert rc == 0
    assert [g["backend"] for g in rep["graph_passes"]][0] == "fuse"
    m = ir.load(out)
    ops = {n.op_type for n in m.graph}
    assert "GroupQueryAttention" in ops and "MatMul" not in ops
    rows = rep["layers"]
    assert rows and all(r["backend"] == "int4 (MatMulNBits)" for r in rows)
    assert any(r["target"] == "head" for r in rows)
    n_layers = tiny_hf.FAMILIES[fam]["num_hidden_layers"]
    assert sum(1 for n in m.graph if n.op_type == "MatMulNBits") == 5 * n_layers + 1  # qkv, o, gate, up, down; head
    assert "Split" not in ops and not [g for g in rep["graph_passes"] if g["backend"] == "weights_pack"]
    tied = tiny_hf.FAMILIES[fam]["tie_word_embeddings"]   # the tied embedding reads the head's blocks
    assert ("GatherBlockQuantized" in ops) == tied and ("model.embed_tokens.weight" in m.graph.initializers) != tied
    head = next(r for r in rows if r["target"] == "head")
    assert ("tied token embedding" in head["decision"]) == tied
    s0, s1 = _sess(src), _sess(out)
    io0, io1 = runtime.ModelIO.from_session(s0), runtime.ModelIO.from_session(s1)
    assert io1.inputs == io0.inputs and io1.past_to_present == io0.past_to_present
    ids = np.random.default_rng(0).integers(3, 250, (1, 12))
    a = runtime.run(s0, io0, runtime.feeds(io0, ids))["logits"]
    b = runtime.run(s1, io1, runtime.feeds(io1, ids))["logits"]
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 0.2
    # --weights-pack on: gate and up become one MatMulNBits + Split, and the logits are the same numbers
    rc, rep2 = _cli_rewrite(src, tmp_path / "packed.onnx", "--weights", "int4", "--weights-quantizer", "nbits",
                            "--quality-budget", "off", "--weights-pack", "on", "--attn-exact", "off")
    m2 = ir.load(tmp_path / "packed.onnx")
    assert rc == 0 and sum(1 for n in m2.graph if n.op_type == "MatMulNBits") == 4 * n_layers + 1
    assert sum(1 for n in m2.graph if n.op_type == "Split") == n_layers
    assert rep2["graph_passes"][-1]["backend"] == "weights_pack" and f"{n_layers} groups" in rep2["graph_passes"][-1]["decision"]
    s2 = _sess(tmp_path / "packed.onnx")
    np.testing.assert_array_equal(b, runtime.run(s2, io1, runtime.feeds(io1, ids))["logits"])


def test_rewrite_fuse_flags(tiny, toy_model, tmp_path, capsys):
    src = tiny["llama"] / "model.onnx"
    # fusion alone must be asked for; --fuse=on gives the fused fp32 graph
    rc, _ = _cli_rewrite(src, tmp_path / "a.onnx")
    assert rc == 2 and "no backend enabled" in capsys.readouterr().err
    rc, rep = _cli_rewrite(src, tmp_path / "b.onnx", "--fuse=on", "--attn-exact", "off")
    assert rc == 0 and rep["graph_passes"][0]["backend"] == "fuse" and is_fused(ir.load(tmp_path / "b.onnx"))
    # --fuse=off: int8 on the unfused graph
    rc, rep = _cli_rewrite(src, tmp_path / "c.onnx", "--fuse=off", "--weights", "int8", "--quality-budget", "off")
    m = ir.load(tmp_path / "c.onnx")
    assert rc == 0 and not is_fused(m) and {"MatMulNBits", "Softmax"} <= {n.op_type for n in m.graph}
    # a model it cannot fuse: auto → one report line and the rewrite goes on; on → one-line error, exit 2
    rc, rep = _cli_rewrite(toy_model, tmp_path / "d.onnx", "--weights", "int8", "--quality-budget", "off")
    assert rc == 0 and rep["graph_passes"][0]["decision"].startswith("kept unfused: ")
    capsys.readouterr()
    rc, _ = _cli_rewrite(toy_model, tmp_path / "e.onnx", "--weights", "int8", "--quality-budget", "off", "--fuse=on")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--fuse=on" in err and len(err.splitlines()) == 1
    # PackedAttention (KV --state-pack): auto fuses and PackedAttention replaces the GroupQueryAttention;
    # --fuse=off keeps the unfused attention core (tests/test_packed_gqa_cli.py has the rest)
    rc, rep = _cli_rewrite(src, tmp_path / "f.onnx", "--state-pack", "binary", "--quality-budget", "off", "--attn-budget", "0")
    assert rc == 0 and rep["graph_passes"][0]["backend"] == "fuse"
    assert "replaces GroupQueryAttention" in rep["graph_passes"][1]["decision"]
    ops = {n.op_type for n in ir.load(tmp_path / "f.onnx").graph}
    assert "PackedAttention" in ops and "GroupQueryAttention" not in ops
    rc, rep = _cli_rewrite(src, tmp_path / "g.onnx", "--state-pack", "binary", "--attn-budget", "0", "--fuse=off")
    assert rc == 0 and "PackedAttention" in rep["graph_passes"][1]["decision"]
    assert not is_fused(ir.load(tmp_path / "g.onnx"))


def test_quality_guard_keeps_pinned_quantization_and_falls_back():
    """The guard measures quantization plus the other backends together against the source weights;
    it drops the other backends' plans (highest gap first), quantizes the layers they lose, and keeps
    the quantization. The budget covers the quantization too (issue 34): when the weights alone cost
    more than the budget, nothing is written (BudgetRefused names the cost and the budget to lift)."""
    from types import SimpleNamespace as NS

    from rewriter import pipeline, report
    from rewriter.kit.backend import Plan

    def cand(name):
        return NS(name=name, layer=0, target="mlp", role="up", K=4, N=4, params=16)

    tt, q = NS(name="tt"), NS(name="weights", pinned=True)
    c1, c2, c3 = cand("a"), cand("b"), cand("c")
    p_tt1 = Plan("tt", "tt a", 0.01, 8)
    p_tt2 = Plan("tt", "tt b", 0.20, 8)
    p_q = {c.name: Plan("int4 (MatMulNBits)", f"q {c.name}", 0.05, 16) for c in (c1, c2, c3)}
    chosen = [(c1, tt, p_tt1), (c2, tt, p_tt2), (c3, q, p_q["c"])]
    fallback = {"a": (c1, q, p_q["a"]), "b": (c2, q, p_q["b"])}
    seen = []

    def loss_of(budget_base):
        def loss(plans):
            seen.append(sorted((c.name, p.decision) for c, _, p in plans))
            return budget_base + sum(0.01 if p.decision == "tt" and c.name == "a" else 0.5 if p.decision == "tt" else 0.0
                                     for c, _, p in plans)
        return loss

    records = {c.name: report.record(c, p) for c, _, p in chosen}
    probe = NS(metric="delta_ppl", unit="tokens", size=64)
    kept, res = pipeline._quality_guard(chosen, records, NS(loss=loss_of(0.005), probe=probe), 0.02, False, fallback)
    assert sorted((c.name, p.decision) for c, _, p in kept) == [("a", "tt"), ("b", "int4 (MatMulNBits)"),
                                                              ("c", "int4 (MatMulNBits)")]
    assert all(("c", "int4 (MatMulNBits)") in s for s in seen)          # quantization in every trial
    assert records["b"].backend == "int4 (MatMulNBits)" and "tt dropped" in records["b"].decision
    assert res["pinned"] == 1 and abs(res["weights_alone"] - 0.005) < 1e-12
    assert abs(res["loss"] - 0.015) < 1e-12                             # against the source weights
    # the weights alone over the budget (0.05 > 0.02): refused, whatever the other backends would add
    records = {c.name: report.record(c, p) for c, _, p in chosen}
    with pytest.raises(pipeline.BudgetRefused, match=r"weights alone \(int4 \(MatMulNBits\)\) cost delta_ppl "
                       r"\+0\.0500 .* over --quality-budget 0\.02: nothing written .*--quality-budget 0\.050") as e:
        pipeline._quality_guard(chosen, records, NS(loss=loss_of(0.05), probe=probe), 0.02, False, fallback)
    assert e.value.quality["refused"] and abs(e.value.quality["weights_alone"] - 0.05) < 1e-12
    # lifted explicitly: written, and tt "a" fits what is left of the budget
    records = {c.name: report.record(c, p) for c, _, p in chosen}
    kept, res = pipeline._quality_guard(chosen, records, NS(loss=loss_of(0.05), probe=probe), 0.07, False, fallback)
    assert sorted((c.name, p.decision) for c, _, p in kept) == [("a", "tt"), ("b", "int4 (MatMulNBits)"),
                                                              ("c", "int4 (MatMulNBits)")]
    assert abs(res["loss"] - 0.06) < 1e-9
