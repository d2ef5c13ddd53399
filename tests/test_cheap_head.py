"""--cheap-head=lowrank (rewriter/backends/head.py; meaning: custom_ops/reference/head.py) on the toy
model (fp32 tied head through Transpose), its int4 MatMulNBits quantization, and tiny optimum exports
(tests/tiny_hf.py: llama with a tied head, qwen2 with an untied one) with the KV cache."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import tiny_hf
from custom_ops import runtime
from custom_ops.reference.head import cheap_head, dequant_nbits, dequant_rows, quant_nbits, topk_indices
from rewriter import cli


def _sess(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _rewrite(model, out, text, *extra, tokenizer=None):
    rep = out.with_suffix(".json")
    args = ["rewrite", str(model), "-o", str(out), "--cheap-head=lowrank", "--calib-text", str(text),
            "--calib-tokens", "1024", "--calib-window", "64", "--report", str(rep), "-q", *extra]
    if tokenizer:
        args += ["--tokenizer", str(tokenizer)]
    code = cli.main(args)
    return code, json.loads(rep.read_text())


def _init(path, suffix):
    m = onnx.load(str(path))
    for t in m.graph.initializer:
        if t.name.endswith(suffix):
            return onnx.numpy_helper.to_array(t)
    raise KeyError(suffix)


def _head_input(path, feeds):
    """The head's input in the dense model for `feeds` (as an extra output)."""
    import onnxruntime as ort

    m = onnx.load(str(path))
    x = next(n for n in m.graph.node if "logits" in n.output).input[0]
    m.graph.output.append(onnx.helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, None))
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run([x], feeds)[0]


# ------------------------------------------------------------------------- reference pieces
def test_nbits_round_trip_and_topk_order():
    rng = np.random.default_rng(0)
    for bits in (4, 8):
        for K in (7, 32, 45):              # not multiples of the block
            B = rng.standard_normal((K, 13)).astype(np.float32)
            blob, sc = quant_nbits(B, bits, 32)
            D = dequant_nbits(blob, sc, None, K, bits, 32)
            step = np.abs(B).max() / ((1 << (bits - 1)) - 1)
            assert D.shape == B.shape and np.abs(D - B).max() <= step / 2 + 1e-6
            assert np.array_equal(dequant_rows(blob, sc, None, K, bits, 32), D.T)
    a = np.array([[1.0, 3.0, 3.0, 0.0, 3.0]], np.float32)
    assert topk_indices(a, 3).tolist() == [[1, 2, 4]]          # ties: lower index first


def test_reference_covers_vocab_is_exact_and_fill():
    rng = np.random.default_rng(1)
    D, V, r = 16, 40, 4
    rows = rng.standard_normal((V, D)).astype(np.float32)
    A, B = rng.standard_normal((D, r)).astype(np.float32), rng.standard_normal((r, V)).astype(np.float32)
    h = rng.standard_normal((3, 1, D)).astype(np.float32)
    np.testing.assert_allclose(cheap_head(h, rows, A, B, V), h @ rows.T, rtol=1e-5, atol=1e-5)
    out = cheap_head(h, rows, A, B, 5)
    assert (np.isfinite(out).sum(-1) == 5).all()
    ap = cheap_head(h, rows, A, B, 5, fill="approx")
    assert np.isfinite(ap).all() and np.array_equal(ap[np.isfinite(out)], out[np.isfinite(out)])
    hp = rng.standard_normal((2, 4, D)).astype(np.float32)      # prefill: exact
    np.testing.assert_allclose(cheap_head(hp, rows, A, B, 5), hp @ rows.T, rtol=1e-6)


# ------------------------------------------------------------------------- the toy model (no KV cache)
def test_toy_covering_vocab_equals_exact_head(toy_model, toy_text, tmp_path):
    V = int(_init(toy_model, "embed_tokens.weight").shape[0])
    code, rep = _rewrite(toy_model, tmp_path / "c.onnx", toy_text, "--head-rank", "6",
                         "--head-candidates", str(V + 10))
    assert code == 0
    row = rep["graph_passes"][-1]
    assert row["backend"] == "cheap_head" and row["candidates"] == V and row["calib_recall"] == 1.0
    d, c = _sess(toy_model), _sess(tmp_path / "c.onnx")
    io = runtime.ModelIO.from_session(d)
    rng = np.random.default_rng(0)
    for _ in range(5):
        f = runtime.feeds(io, rng.integers(2, V, (2, 1)))
        a, b = d.run(None, f)[0], c.run(None, f)[0]
        assert np.isfinite(b).all() and np.array_equal(a.argmax(-1), b.argmax(-1))
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    f = runtime.feeds(io, rng.integers(2, V, (2, 9)))
    assert np.array_equal(d.run(None, f)[0], c.run(None, f)[0])         # prefill: the same node, bit-exact


@pytest.mark.parametrize("fill", ["neginf", "approx"])
def test_toy_equals_reference(toy_model, toy_text, tmp_path, fill):
    out = tmp_path / "c.onnx"
    code, rep = _rewrite(toy_model, out, toy_text, "--head-rank", "5", "--head-candidates", "7",
                         "--head-accuracy", "0", "--head-fill", fill, "--head-bits", "8")
    assert code == 0
    E = _init(toy_model, "embed_tokens.weight")
    A = _init(out, ".cheap.A")
    r = A.shape[1]
    B = dequant_nbits(_init(out, ".cheap.B_q8"), _init(out, ".cheap.B_scales"), None, r, 8, 32)
    d, c = _sess(toy_model), _sess(out)
    io = runtime.ModelIO.from_session(d)
    ids = np.random.default_rng(2).integers(2, E.shape[0], (3, 1))
    f = runtime.feeds(io, ids)
    h = _head_input(toy_model, f)
    ref = cheap_head(h, E, A, B, 7, fill=fill)
    got = c.run(None, f)[0]
    assert np.array_equal(np.isfinite(ref), np.isfinite(got))
    assert np.array_equal(ref.argmax(-1), got.argmax(-1))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    if fill == "neginf":
        assert (np.isfinite(got).sum(-1) == 7).all()


@pytest.mark.parametrize("acc", [0, 4])
def test_toy_int4_head_uses_its_own_blocks(toy_model, toy_text, tmp_path, acc):
    """The candidates of an int4 MatMulNBits head get that head's own logits: its blocks, and at
    accuracy_level 4 its int8 rounding of the activations (else a near tie could flip the argmax)."""
    from rewriter.quantize import quantize_weights

    m = ir.load(toy_model)                 # the head weight as an initializer (what ORT's quantizer takes)
    t = next(n for n in m.graph if n.op_type == "Transpose" and "lm_head" in n.name)
    wt = ir.Value(name="lm_head.weight_t", const_value=ir.tensor(t.inputs[0].const_value.numpy().T.copy()))
    m.graph.register_initializer(wt)
    t.outputs[0].replace_all_uses_with(wt)
    m.graph.remove(t, safe=True)
    q, _ = quantize_weights(m, "int4", accuracy_level=acc)
    qp = tmp_path / "q4" / "model.onnx"
    qp.parent.mkdir()
    ir.save(q, qp)
    (qp.parent / "tokenizer.json").write_bytes((toy_model.parent / "tokenizer.json").read_bytes())
    qm = onnx.load(str(qp))
    hn = next(n for n in qm.graph.node if "logits" in n.output)
    assert hn.op_type == "MatMulNBits"
    V = int(next(a.i for a in hn.attribute if a.name == "N"))
    out = tmp_path / "c.onnx"
    code, rep = _rewrite(qp, out, toy_text, "--head-rank", "5", "--head-candidates", "9", "--head-accuracy", "0")
    assert code == 0 and "GatherBlockQuantized" in rep["graph_passes"][-1]["decision"]
    assert ("int8-activation" in rep["graph_passes"][-1]["decision"]) == (acc == 4)
    d, c = _sess(qp), _sess(out)
    io = runtime.ModelIO.from_session(d)
    f = runtime.feeds(io, np.random.default_rng(3).integers(2, V, (4, 1)))
    a, b = d.run(None, f)[0], c.run(None, f)[0]
    fin = np.isfinite(b)
    assert (fin.sum(-1) == 9).all()
    np.testing.assert_allclose(b[fin], a[fin], rtol=1e-4, atol=1e-4)   # candidates: the int4 head's own logits
    # the reference, with the head's dequantized rows
    ins = {t.name: onnx.numpy_helper.to_array(t) for t in qm.graph.initializer}
    K = int(next(a.i for a in hn.attribute if a.name == "K"))
    blk = int(next(a.i for a in hn.attribute if a.name == "block_size"))
    rows = dequant_rows(ins[hn.input[1]], ins[hn.input[2]], ins[hn.input[3]] if len(hn.input) > 3 else None, K, 4, blk)
    A = _init(out, ".cheap.A")
    B = dequant_nbits(_init(out, ".cheap.B_q4"), _init(out, ".cheap.B_scales"), None, A.shape[1], 4, 32)
    ref = cheap_head(_head_input(qp, f), rows, A, B, 9, act_block=blk if acc == 4 else None)
    assert np.array_equal(np.isfinite(ref), fin)
    np.testing.assert_allclose(b[fin], ref[fin], rtol=1e-4, atol=1e-4)


def test_refuses_a_model_without_a_head(toy_model, toy_text, tmp_path):
    m = onnx.load(str(toy_model))
    out = m.graph.output[0]
    out.name = "scores"
    for n in m.graph.node:
        n.output[:] = ["scores" if o == "logits" else o for o in n.output]
    p = tmp_path / "nohead" / "model.onnx"
    p.parent.mkdir()
    onnx.save(m, str(p))
    (p.parent / "tokenizer.json").write_bytes((toy_model.parent / "tokenizer.json").read_bytes())
    code, rep = _rewrite(p, tmp_path / "c.onnx", toy_text)
    assert code != 0 and rep["output"] is None
    row = rep["graph_passes"][-1]
    assert row["backend"] == "dense" and "no recognisable head" in row["decision"] and "logits" in row["decision"]


def test_flags_are_validated(toy_model, toy_text, tmp_path, capsys):
    base = ["rewrite", str(toy_model), "-o", str(tmp_path / "c.onnx"), "--cheap-head=lowrank", "-q"]
    assert cli.main([*base, "--calib-text", str(toy_text), "--head-rank", "0"]) != 0
    assert "--head-rank 0: must be ≥ 1" in capsys.readouterr().err
    assert cli.main(base) != 0
    assert "--cheap-head=lowrank needs --calib-text" in capsys.readouterr().err
    assert not (tmp_path / "c.onnx").exists()


# ------------------------------------------------------------------------- optimum exports with the KV cache
@pytest.fixture(scope="module")
def tiny():
    return tiny_hf.models()


def _decode(sess, io, prompt, steps):
    """Greedy decode through the KV cache: the logits of every decode step."""
    out = runtime.run(sess, io, runtime.feeds(io, prompt))
    logits, nxt = [], out["logits"][:, -1].argmax(-1)[:, None]
    past, n = io.next_state(out), prompt.shape[1]
    for _ in range(steps):
        out = runtime.run(sess, io, runtime.feeds(io, nxt, past=past, past_len=n))
        logits.append(out["logits"])
        past, n = io.next_state(out), n + 1
        nxt = out["logits"][:, -1].argmax(-1)[:, None]
    return out, logits


@pytest.mark.parametrize("family", sorted(tiny_hf.FAMILIES))
def test_tiny_export_decode_steps(tiny, family, toy_model, toy_text, tmp_path):
    src = tiny[family] / "model.onnx"
    tok = toy_model.parent / "tokenizer.json"
    V = tiny_hf.FAMILIES[family]["vocab_size"]
    prompt = np.random.default_rng(4).integers(3, V, (2, 6))
    d = _sess(src)
    io = runtime.ModelIO.from_session(d)
    _, dense = _decode(d, io, prompt, 5)
    # candidates cover the vocabulary: the same tokens and logits as the exact head, step by step
    full = tmp_path / "full.onnx"
    # --attn-exact off: the rewritten model is fed with the export's own cache inputs below
    code, rep = _rewrite(src, full, toy_text, "--head-rank", "8", "--head-candidates", str(V), "--attn-exact", "off",
                         tokenizer=tok)
    assert code == 0 and rep["graph_passes"][-1]["backend"] == "cheap_head"
    if family == "qwen2":       # untied: Wᵀ stored instead of W
        assert "stored transposed" in rep["graph_passes"][-1]["decision"]
    else:
        assert "tied embedding" in rep["graph_passes"][-1]["decision"]
    c = _sess(full)
    _, cheap = _decode(c, runtime.ModelIO.from_session(c), prompt, 5)
    for a, b in zip(dense, cheap):
        assert np.array_equal(a.argmax(-1), b.argmax(-1))
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
    f = runtime.feeds(io, prompt)
    np.testing.assert_allclose(c.run(["logits"], f)[0], d.run(["logits"], f)[0], rtol=1e-6, atol=1e-6)  # prefill
    # with exact PackedAttention too (the last pass: the head calibrates on the export's cache I/O)
    code, rep = _rewrite(src, tmp_path / "ex.onnx", toy_text, "--head-rank", "8", "--head-candidates", str(V),
                         "--attn-exact", "on", tokenizer=tok)
    assert code == 0 and [g["backend"] for g in rep["graph_passes"]][-1] == "exact_attention"
    import custom_ops

    e = custom_ops.session(str(tmp_path / "ex.onnx"))
    _, ex = _decode(e, runtime.ModelIO.from_session(e), prompt, 5)
    for a, b in zip(cheap, ex):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
    # few candidates: the candidates' logits are the exact ones, the rest −inf
    few = tmp_path / "few.onnx"
    code, _ = _rewrite(src, few, toy_text, "--head-rank", "4", "--head-candidates", "16", "--attn-exact", "off",
                       tokenizer=tok)
    c = _sess(few)
    cio = runtime.ModelIO.from_session(c)
    out = runtime.run(c, cio, runtime.feeds(cio, prompt))
    ref = runtime.run(d, io, runtime.feeds(io, prompt))
    np.testing.assert_allclose(out["logits"], ref["logits"], rtol=1e-6, atol=1e-6)
    nxt = ref["logits"][:, -1].argmax(-1)[:, None]
    step_c = runtime.run(c, cio, runtime.feeds(cio, nxt, past=cio.next_state(out), past_len=prompt.shape[1]))["logits"]
    step_d = runtime.run(d, io, runtime.feeds(io, nxt, past=io.next_state(ref), past_len=prompt.shape[1]))["logits"]
    fin = np.isfinite(step_c)
    assert (fin.sum(-1) == 16).all() and np.isneginf(step_c[~fin]).all()
    np.testing.assert_allclose(step_c[fin], step_d[fin], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("K", [64, 40, 7])       # K not a multiple of the block: a partial last block
def test_int8_activations_is_matmulnbits_accuracy_4(K):
    """reference.head.int8_activations is the rounding ORT's MatMulNBits applies at accuracy_level 4:
    its float32 product with the dequantized weights equals that op's output (and differs from the
    accuracy_level 0 output by far more), so a cheap head can reproduce that head's logits."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from custom_ops.reference.head import int8_activations

    N, blk = 96, 32
    rng = np.random.default_rng(K)
    blob, scales = quant_nbits(rng.standard_normal((K, N)).astype(np.float32), 4, blk)
    x = (rng.standard_normal((5, K)) * rng.uniform(0.1, 4, K)).astype(np.float32)
    x[1] = 0                                                        # an all-zero row: scale 0

    def run(acc):
        node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=K, N=N, bits=4,
                                block_size=blk, accuracy_level=acc)
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, N])],
                              [numpy_helper.from_array(blob, "w"), numpy_helper.from_array(scales, "s")])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
        m.ir_version = 10
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    rows = dequant_rows(blob, scales, None, K, 4, blk)
    y4, y0 = run(4), run(0)
    ref = int8_activations(x, blk) @ rows.T
    scale = np.abs(y4).max()
    assert np.abs(y4 - ref).max() <= 1e-5 * scale
    assert np.abs(y0 - x @ rows.T).max() <= 1e-5 * scale
    assert np.abs(y4 - y0).max() > 1e-3 * scale                    # the rounding is visible


def test_candidate_recall_is_topk_membership_with_ties():
    """candidate_recall counts without sorting: equal to membership in topk_indices (ONNX TopK order,
    ties to the lower index) on integer logits full of ties, and on a C at the vocabulary's size."""
    from rewriter.builders.head import candidate_recall

    rng = np.random.default_rng(3)
    for V, C in ((40, 3), (257, 16), (64, 64)):
        X = rng.integers(-2, 3, (300, 6)).astype(np.float32)
        W = rng.integers(-2, 3, (6, V)).astype(np.float32)
        A = rng.integers(-1, 2, (6, 2)).astype(np.float32)
        B = rng.integers(-1, 2, (2, V)).astype(np.float32)
        exact = (X @ W).argmax(axis=1)
        want = float((topk_indices((X @ A) @ B, C) == exact[:, None]).any(axis=1).mean())
        assert candidate_recall(X, W, A, B, C) == want


# ------------------------------------------------------------------------- block-quantized heads
@pytest.mark.parametrize("family", ["llama"])      # tied: the embedding reads the head's blocks too
def test_block_quant_head_decode_steps(tiny, family, toy_model, toy_text, tmp_path):
    """A BlockQuantMatMul head (--weights int4: the float checkpoint's calibrated blocks; GGUF-born models'
    own blocks): the exact candidate rows come from the head's blocks through BlockQuantGather; with
    candidates covering the vocabulary a decode step gives the head's tokens, its logits up to the head's
    integer activations (fp32 products here); with few, the rest are −inf; the prefill keeps the head; the
    generator's last-position view sends a prompt's last row down the decode branch."""
    import custom_ops
    from rewriter.kit.stream import last_position_logits

    src = tiny[family] / "model.onnx"
    tok = toy_model.parent / "tokenizer.json"
    V = tiny_hf.FAMILIES[family]["vocab_size"]
    prompt = np.random.default_rng(5).integers(3, V, (2, 6))
    base = tmp_path / "base.onnx"
    code = cli.main(["rewrite", str(src), "-o", str(base), "--weights", "int4", "--calib-text", str(toy_text),
                     "--calib-tokens", "1024", "--calib-window", "64", "--quality-budget", "off", "-q",
                     "--tokenizer", str(tok)])
    assert code == 0
    assert next(n for n in onnx.load(str(base)).graph.node if "logits" in n.output).op_type == "BlockQuantMatMul"

    def decode(path, steps=5):
        s = custom_ops.session(str(path), threads=1)
        io = runtime.ModelIO.from_session(s)
        return _decode(s, io, prompt, steps), s, io

    (out_b, dense), sb, iob = decode(base)
    full = tmp_path / "full.onnx"
    code, rep = _rewrite(src, full, toy_text, "--weights", "int4", "--head-rank", "8", "--head-candidates", str(V),
                         "--quality-budget", "off", tokenizer=tok)
    assert code == 0
    rec = next(g for g in rep["graph_passes"] if g["backend"] == "cheap_head")
    assert "BlockQuantGather" in rec["decision"] and rec["bytes_head"] > 0
    m = onnx.load(str(full))
    assert [n.op_type for n in m.graph.node if n.output[0] == "logits"] == ["If"]
    (out_c, cheap), sc, ioc = decode(full)
    for a, b in zip(dense, cheap):
        assert np.array_equal(a.argmax(-1), b.argmax(-1))
        np.testing.assert_allclose(b, a, rtol=0, atol=0.02 * float(np.abs(a).max()))
    f = runtime.feeds(iob, prompt)
    np.testing.assert_array_equal(runtime.run(sc, ioc, runtime.feeds(ioc, prompt))["logits"],
                                  runtime.run(sb, iob, f)["logits"])           # prefill: the head itself
    # the generator's view: the prompt's last row through the decode branch, [B, 1, V]
    view = last_position_logits(ir.load(str(full)))
    assert view is not None
    p = tmp_path / "view.onnx"
    ir.save(view, str(p))
    sv = custom_ops.session(str(p), threads=1)
    iov = runtime.ModelIO.from_session(sv)
    last = runtime.run(sv, iov, runtime.feeds(iov, prompt))["logits"]
    ref = runtime.run(sb, iob, f)["logits"][:, -1:]
    assert last.shape == ref.shape and np.array_equal(last.argmax(-1), ref.argmax(-1))
    np.testing.assert_allclose(last, ref, rtol=0, atol=0.02 * float(np.abs(ref).max()))
    # few candidates: the rest −inf
    few = tmp_path / "few.onnx"
    code, _ = _rewrite(src, few, toy_text, "--weights", "int4", "--head-rank", "4", "--head-candidates", "16",
                       "--quality-budget", "off", tokenizer=tok)
    assert code == 0
    (_, steps), _, _ = decode(few, 2)
    for st in steps:
        fin = np.isfinite(st)
        assert (fin.sum(-1) == 16).all() and np.isneginf(st[~fin]).all()
