"""`--weights gguf`: weight MatMuls matched to a GGUF's tensors and emitted as BlockQuantMatMul with
the GGUF's own bytes (rewriter/builders/gguf.py, rewriter/backends/weights.py).

A tiny GGUF (gguf.GGUFWriter, blocks from gguf.quants.quantize in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and a
tiny ONNX model whose initializers are its dequantized tensors: stored transposed ([K, N]), behind a
Transpose node, rows permuted, two tensors concatenated (+ a bias Add), two formats concatenated (two
nodes + Concat), a tied head/embedding, rows that repeat (ties), and one weight the GGUF does not hold.
The real-model test (SmolLM2's export and its Q4_1 GGUF) checks every layer bit-exact and the node
counts of the fused and the unfused graph."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

from custom_ops.reference import blockquant  # noqa: E402
from rewriter import cli  # noqa: E402
from rewriter.builders import gguf as gg  # noqa: E402
from rewriter.errors import OrtleanError  # noqa: E402
from rewriter.kit import candidates  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
D = 64            # K of every matched projection
K2 = 40           # K of the weight the GGUF does not hold (not a multiple of 32: the q8_0 fallback pads)
V = 80            # vocabulary of the tied embedding / head
K3 = 512          # K of the K-format projection (two 256-blocks a row)
S = 5             # tokens in the test feeds


def _quant(rng, N, K, qt, zero_rows=(), dup=None):
    x = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
    for r in zero_rows:
        x[r] = 0
    if dup is not None:                  # row dup[1] repeats row dup[0]: a tie
        x[dup[1]] = x[dup[0]]
    q = quants.quantize(x, qt)
    return q, np.ascontiguousarray(quants.dequantize(q, qt), dtype=np.float32)


def _build(d: Path, seed: int = 0) -> dict:
    """The GGUF, the ONNX model and what each MatMul should become."""
    rng = np.random.default_rng(seed)
    t = {}
    t["a"] = _quant(rng, 48, D, T.Q4_0)
    t["b"] = _quant(rng, 40, D, T.Q4_1)
    t["c"] = _quant(rng, 32, D, T.Q5_0)
    t["d"] = _quant(rng, 24, D, T.Q5_1)
    t["e"] = _quant(rng, 16, D, T.Q5_1)
    t["f"] = _quant(rng, 8, D, T.Q8_0, zero_rows=(2, 5))
    t["g"] = _quant(rng, 8, D, T.Q4_0)
    t["token_embd"] = _quant(rng, V, D, T.Q8_0, dup=(3, 7))
    qt = {"a": T.Q4_0, "b": T.Q4_1, "c": T.Q5_0, "d": T.Q5_1, "e": T.Q5_1, "f": T.Q8_0, "g": T.Q4_0, "token_embd": T.Q8_0}
    for k, fmt, n in (("q", "q4_K", 32), ("k", "q4_K", 16), ("v", "q6_K", 16)):   # Qwen2-like: gguf-py has no
        blocks = blockquant.random_blocks(fmt, n, K3, rng)                       # K quantizer: random valid blocks
        t[k] = (blocks, blockquant.dequantize(blocks, fmt, K3))
        qt[k] = gg.ggml_type(fmt)
    path = d / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for k, (q, _) in t.items():
        w.add_tensor(f"{k}.weight", q, raw_dtype=qt[k])
    w.add_tensor("norm.weight", np.ones(D, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    deq = {k: v[1] for k, v in t.items()}
    perm_c = rng.permutation(32)
    perm_d = rng.permutation(24)
    bias = (rng.standard_normal(40) * 0.1).astype(np.float32)
    qkv_bias = (rng.standard_normal(64) * 0.1).astype(np.float32)
    perm_q = rng.permutation(32)
    extra = (rng.standard_normal((K2, 16)) * 0.05).astype(np.float32)
    WT = {  # the weight transposed ([N, K], rows = outputs) each MatMul must reproduce
        "/plain/MatMul": deq["a"],
        "/tr/MatMul": deq["b"],
        "/perm/MatMul": deq["c"][perm_c],
        "/cat/MatMul": np.concatenate([deq["d"][perm_d], deq["e"]]),
        "/mixed/MatMul": np.concatenate([deq["g"], deq["f"]]),
        "/lm_head/MatMul": deq["token_embd"],
        "/qkv/MatMul": np.concatenate([deq["q"][perm_q], deq["k"], deq["v"]]),
    }
    inits = [numpy_helper.from_array(np.ascontiguousarray(WT[n].T), f"W{i}") for i, n in enumerate(WT)]
    names = {n: f"W{i}" for i, n in enumerate(WT)}
    inits[1] = numpy_helper.from_array(deq["b"], "W1")          # /tr: B = Transpose(W1), W1 [N, K]
    inits += [numpy_helper.from_array(bias, "bias"), numpy_helper.from_array(qkv_bias, "qkv_bias"),
              numpy_helper.from_array(extra, "Wx"),
              numpy_helper.from_array(deq["token_embd"].copy(), "embed.weight")]
    nodes = [helper.make_node("MatMul", ["x", names["/plain/MatMul"]], ["y_plain"], name="/plain/MatMul"),
             helper.make_node("Transpose", ["W1"], ["W1t"], perm=[1, 0], name="/tr/Transpose"),
             helper.make_node("MatMul", ["x", "W1t"], ["y_tr"], name="/tr/MatMul"),
             helper.make_node("MatMul", ["x", names["/perm/MatMul"]], ["y_perm"], name="/perm/MatMul"),
             helper.make_node("MatMul", ["x", names["/cat/MatMul"]], ["cat_mm"], name="/cat/MatMul"),
             helper.make_node("Add", ["cat_mm", "bias"], ["y_cat"], name="/cat/Add"),
             helper.make_node("MatMul", ["x", names["/mixed/MatMul"]], ["y_mixed"], name="/mixed/MatMul"),
             helper.make_node("MatMul", ["x", names["/lm_head/MatMul"]], ["logits"], name="/lm_head/MatMul"),
             helper.make_node("Gather", ["embed.weight", "ids"], ["emb"], name="/embed_tokens/Gather"),
             helper.make_node("MatMul", ["x2", "Wx"], ["y_extra"], name="/extra/MatMul"),
             helper.make_node("MatMul", ["x3", names["/qkv/MatMul"]], ["qkv_mm"], name="/qkv/MatMul"),
             helper.make_node("Add", ["qkv_bias", "qkv_mm"], ["y_qkv"], name="/qkv/Add")]
    f = TensorProto.FLOAT
    outs = [("y_plain", 48), ("y_tr", 40), ("y_perm", 32), ("y_cat", 40), ("y_mixed", 16), ("logits", V),
            ("y_extra", 16), ("y_qkv", 64)]
    graph = helper.make_graph(
        nodes, "tiny_gguf",
        [helper.make_tensor_value_info("x", f, [1, S, D]), helper.make_tensor_value_info("x2", f, [1, S, K2]),
         helper.make_tensor_value_info("x3", f, [1, S, K3]), helper.make_tensor_value_info("ids", TensorProto.INT64, [1, S])],
        [helper.make_tensor_value_info(n, f, [1, S, c]) for n, c in outs]
        + [helper.make_tensor_value_info("emb", f, [1, S, D])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    mp = d / "model.onnx"
    onnx.save(model, str(mp))
    return {"gguf": path, "model": mp, "WT": WT, "bias": bias, "qkv_bias": qkv_bias, "deq": deq, "quant": t,
            "perm_c": perm_c, "perm_d": perm_d}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    return _build(tmp_path_factory.mktemp("gguf"))


def _feeds(seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((1, S, D)).astype(np.float32),
            "x2": rng.standard_normal((1, S, K2)).astype(np.float32),
            "x3": rng.standard_normal((1, S, K3)).astype(np.float32),
            "ids": rng.integers(-V, V, (1, S)).astype(np.int64)}


def _rewrite(tiny, out: Path, *flags) -> int:
    return cli.main(["rewrite", str(tiny["model"]), "-o", str(out), "--gguf", str(tiny["gguf"]), "-q", *flags])


def _nodes(path: Path):
    m = onnx.load(str(path))
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    return m, inits


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _s(v):
    return v.decode() if isinstance(v, bytes) else v


def _blocks(W, a: dict):
    """A node's W as ggml's blocks: un-split when its ``layout`` is split (--weights-layout auto: q4_0, q4_1,
    q8_0; tests/test_block_quant_layout.py)."""
    if _s(a.get("layout", "blocks")) != "split":
        return W
    bs = a.get("block_size")
    return blockquant.from_split(W, _s(a["format"]), int(a["K"]), int(bs) if bs else None)


# --------------------------------------------------------------------------- matching (no op needed)
def test_match_finds_every_form(tiny):
    src = gg.GGUFSource(tiny["gguf"])
    names = [t.name for t in src.tensors]
    assert "norm.weight" not in names          # 1-D tensors are not weights
    for n, WT in tiny["WT"].items():
        m = src.match(WT)
        assert m.complete, n
        parts = src.assemble(WT, m)
        for p in parts:  # the bytes are the GGUF's own rows, and they dequantize to the weight's rows bit for bit
            deq = blockquant.dequantize(p.W, p.format, WT.shape[1])
            assert deq.view(np.uint32).tobytes() == WT[p.start:p.stop].view(np.uint32).tobytes()
            rows = [src.by_name[src.tensors[t].name].data[r] for t, r in zip(m.tensor[p.start:p.stop], m.row[p.start:p.stop])]
            assert np.array_equal(p.W, np.stack(rows))
    m = src.match(tiny["WT"]["/perm/MatMul"])
    assert np.array_equal(m.row, tiny["perm_c"])             # the permutation itself is recovered
    parts = src.assemble(tiny["WT"]["/cat/MatMul"], src.match(tiny["WT"]["/cat/MatMul"]))
    assert [(p.format, p.start, p.stop, p.tensors) for p in parts] == [("q5_1", 0, 40, ["d.weight", "e.weight"])]
    parts = src.assemble(tiny["WT"]["/mixed/MatMul"], src.match(tiny["WT"]["/mixed/MatMul"]))
    assert [(p.format, p.start, p.stop) for p in parts] == [("q4_0", 0, 8), ("q8_0", 8, 16)]
    parts = src.assemble(tiny["WT"]["/qkv/MatMul"], src.match(tiny["WT"]["/qkv/MatMul"]))
    assert [(p.format, p.start, p.stop, p.tensors) for p in parts] == [("q4_K", 0, 48, ["q.weight", "k.weight"]),
                                                                       ("q6_K", 48, 64, ["v.weight"])]


def test_match_and_assemble_a_chunk_of_rows_at_a_time(tiny, monkeypatch):
    """A weight is hashed and verified a chunk of rows at a time, from a transposed view (a 1.5B
    model's head is ~1 GB: never copied or dequantized whole): the same match and parts as in one
    piece; a row changed in a later chunk is still refused; the GGUF's pages can be released and
    its tensors stay readable."""
    src = gg.GGUFSource(tiny["gguf"])
    whole = {n: src.assemble(WT, src.match(WT)) for n, WT in tiny["WT"].items()}
    assert src.release_pages() == tiny["gguf"].stat().st_size
    monkeypatch.setattr(gg, "_CHUNK_BYTES", 3 * 4 * D)      # 3 rows of K = D a chunk (one of K3)
    for n, WT in tiny["WT"].items():
        view = np.ascontiguousarray(WT.T).T                  # what the backend passes: W.T, not contiguous
        assert not view.flags.c_contiguous
        m = src.match(view)
        assert m.complete and np.array_equal(m.row, src.match(WT).row), n
        parts = src.assemble(view, m)
        assert [(p.format, p.start, p.stop, p.tensors) for p in parts] == \
            [(p.format, p.start, p.stop, p.tensors) for p in whole[n]], n
        assert all(np.array_equal(p.W, q.W) for p, q in zip(parts, whole[n])), n
    WT = tiny["WT"]["/plain/MatMul"]
    bad = WT.copy()
    bad[-1, 0] = np.nextafter(bad[-1, 0], np.float32(1))    # the last chunk's last row, one ulp
    with pytest.raises(OrtleanError, match="do not dequantize bit-exactly to the weight's rows 0..47"):
        src.assemble(bad, src.match(WT))


def test_ties_resolve_to_a_correct_assembly(tiny):
    src = gg.GGUFSource(tiny["gguf"])
    f = tiny["deq"]["f"]
    m = src.match(f)                       # rows 2 and 5 are both all-zero: either place is exact
    assert m.complete and m.ties >= 2
    assert sorted(m.row.tolist()) == list(range(8))      # a permutation, no row used twice
    (p,) = src.assemble(f, m)
    assert np.array_equal(blockquant.dequantize(p.W, "q8_0", D).view(np.uint32), f.view(np.uint32))
    zeros = np.zeros((3, D), np.float32)   # a weight of only repeated rows still assembles exactly
    m = src.match(zeros)
    assert m.complete
    (p,) = src.assemble(zeros, m)
    assert np.array_equal(blockquant.dequantize(p.W, p.format, D).view(np.uint32), zeros.view(np.uint32))
    emb = tiny["deq"]["token_embd"]        # rows 3 and 7 repeat: the table keeps its order
    m = src.match(emb)
    assert np.array_equal(m.row, np.arange(V))


def test_a_changed_row_is_a_miss_named(tiny):
    src = gg.GGUFSource(tiny["gguf"])
    WT = tiny["WT"]["/plain/MatMul"].copy()
    WT[7, 3] = np.nextafter(WT[7, 3], np.float32(1))     # one ulp
    m = src.match(WT)
    assert not m.complete and m.found == 47
    msg = src.describe_miss(m, D)
    assert "row 7" in msg and "a.weight" in msg
    assert "K=40" in src.describe_miss(src.match(np.zeros((2, K2), np.float32) + 1), K2)


def test_bad_gguf_file(tmp_path):
    with pytest.raises(OrtleanError, match="nope.gguf: no such file"):
        gg.GGUFSource(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(OrtleanError, match="bad.gguf: not a GGUF file"):
        gg.GGUFSource(bad)


# --------------------------------------------------------------------------- the rewrite
def test_rewrite_emits_the_gguf_blocks(tiny, tmp_path):
    out, rep = tmp_path / "out.onnx", tmp_path / "r.json"
    assert _rewrite(tiny, out, "--weights", "gguf", "--exclude", "/extra/*", "--report", str(rep)) == 0
    m, inits = _nodes(out)
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("BlockQuantMatMul") == 9 and ops.count("BlockQuantGather") == 1
    assert ops.count("Concat") == 2 and "Add" not in ops and "Transpose" not in ops and "Gather" not in ops
    assert ops.count("MatMul") == 1                            # the excluded one
    assert "embed.weight" not in inits and "W1" not in inits   # float tables dropped
    by_name = {n.name: n for n in m.graph.node}
    for name, WT in tiny["WT"].items():
        nodes = [n for n in m.graph.node if n.op_type == "BlockQuantMatMul" and n.name.startswith(name + "_BQ")]
        assert nodes, name
        start = 0
        for n in nodes:
            a = _attrs(n)
            W = _blocks(inits[n.input[1]], a)
            assert _s(a.get("layout", "blocks")) == ("split" if _s(a["format"]) in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0") else "blocks")
            assert (a["K"], W.shape[0]) == (WT.shape[1], a["N"])
            deq = blockquant.dequantize(W, _s(a["format"]), a["K"])
            assert np.array_equal(deq.view(np.uint32), WT[start:start + a["N"]].view(np.uint32)), n.name
            assert _s(a["source"]).startswith("gguf:") and a["act_bits"] == 16     # auto: exact weights, int16 x
            assert a["bits_per_weight"] == pytest.approx(8 * W.shape[1] / a["K"])
            start += a["N"]
        assert start == WT.shape[0]
    cat = by_name["/cat/MatMul_BQ"]
    assert len(cat.input) == 3 and np.array_equal(inits[cat.input[2]], tiny["bias"])     # bias folded
    assert _s(_attrs(cat)["source"]) == "gguf:d.weight,e.weight"
    qkv = [by_name["/qkv/MatMul_BQ_0"], by_name["/qkv/MatMul_BQ_1"]]       # two formats: two nodes, bias split
    assert [_s(_attrs(n)["format"]) for n in qkv] == ["q4_K", "q6_K"]
    assert np.array_equal(np.concatenate([inits[n.input[2]] for n in qkv]), tiny["qkv_bias"])
    g = next(n for n in m.graph.node if n.op_type == "BlockQuantGather")
    assert g.input[0] == by_name["/lm_head/MatMul_BQ"].input[1]       # the head's blocks, no bytes of its own
    assert _s(_attrs(g)["layout"]) == _s(_attrs(by_name["/lm_head/MatMul_BQ"])["layout"]) == "split"   # and its layout
    summary = json.loads(rep.read_text())
    rows = {r["layer"]: r for r in summary["layers"]}
    assert rows["/perm/MatMul"]["backend"] == "gguf (BlockQuantMatMul)"
    assert "bit-exact: dequantized bytes equal the source initializer" in rows["/perm/MatMul"]["decision"]
    assert "c.weight rows permuted" in rows["/perm/MatMul"]["decision"]
    assert "bias Add folded" in rows["/cat/MatMul"]["decision"]
    assert "tied token embedding" in rows["/lm_head/MatMul"]["decision"]
    assert rows["/mixed/MatMul"]["extra"]["format"] == "q4_0+q8_0"
    assert rows["/qkv/MatMul"]["extra"]["format"] == "q4_K+q6_K"
    assert any("7 layers hold the GGUF's blocks" in line for line in summary["notes"])
    assert "bit for bit" in summary["quality"]["skipped"]        # no --calib-text: exact weights are written


def test_rewritten_model_runs_on_the_reference(tiny, tmp_path):
    """Outputs of the reference backend: the embedding bit-exact, every projection the op's own
    definition (x̂ · Ŵᵀ + bias) — and within activation rounding of the float model."""
    import custom_ops
    import onnxruntime as ort

    out = tmp_path / "out.onnx"
    assert _rewrite(tiny, out, "--weights", "gguf", "--exclude", "/extra/*") == 0
    feeds = _feeds()
    dense = ort.InferenceSession(str(tiny["model"]), providers=["CPUExecutionProvider"])
    ref = dense.run(None, feeds)
    names = [o.name for o in dense.get_outputs()]
    got = custom_ops.session(str(out), backend="reference").run(names, feeds)
    r, g = dict(zip(names, ref)), dict(zip(names, got))
    assert np.array_equal(g["emb"], r["emb"])
    assert np.array_equal(g["y_extra"], r["y_extra"])
    for o, name, b, xin in (("y_plain", "/plain/MatMul", 0, "x"), ("y_perm", "/perm/MatMul", 0, "x"),
                            ("logits", "/lm_head/MatMul", 0, "x"), ("y_qkv", "/qkv/MatMul", tiny["qkv_bias"], "x3"),
                            ("y_cat", "/cat/MatMul", tiny["bias"], "x")):
        WT = tiny["WT"][name]
        q, d, _ = blockquant.quantize_activations(feeds[xin], 16)     # --weights-act-bits auto: 16 on exact blocks
        want = (blockquant.dequantize_activations(q, d, WT.shape[1]) @ WT.astype(np.float64).T + b).astype(np.float32)
        np.testing.assert_allclose(g[o], want, rtol=1e-5, atol=1e-6)
    for o in ("y_plain", "y_tr", "y_perm", "y_cat", "y_mixed", "logits", "y_qkv"):
        err = np.abs(g[o] - r[o]).max() / np.abs(r[o]).max()
        assert err < 1e-3, (o, err)     # int16 activations per block of 32: ~256x finer than int8's ~1 %
    from conftest import native_available

    if native_available():             # the library's kernels run the same model (float32 sums in another order)
        nat = dict(zip(names, custom_ops.session(str(out), threads=1).run(names, feeds)))
        assert np.array_equal(nat["emb"], g["emb"])
        for o in ("y_plain", "y_tr", "y_perm", "y_cat", "y_mixed", "logits", "y_qkv"):
            np.testing.assert_allclose(nat[o], g[o], rtol=1e-4, atol=1e-5 * np.abs(g[o]).max())


# --------------------------------------------------------------------------- the gated unit (--weights-glu)
F = 64   # the MLPs' intermediate width (down: K = F, whole blocks of 32)


def _mlp_model(d: Path) -> dict:
    """Three SwiGLU MLPs on one input: Sigmoid + Mul (fused), com.microsoft QuickGelu (fused), and one
    whose gate output is also a graph output (left as it is); their GGUF in Q4_1 (gate, up) and Q8_0 (down)."""
    rng = np.random.default_rng(3)
    t = {f"{m}{k}": _quant(rng, *shape, qt) for m in "abc"
         for k, shape, qt in (("gate", (F, D), T.Q4_1), ("up", (F, D), T.Q4_1), ("down", (D, F), T.Q8_0))}
    path = d / "mlp.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for k, (q, _) in t.items():
        w.add_tensor(f"{k}.weight", q, raw_dtype=T.Q4_1 if "down" not in k else T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    inits, nodes = [], []
    for m in "abc":
        for k in ("gate", "up", "down"):
            inits.append(numpy_helper.from_array(np.ascontiguousarray(t[f"{m}{k}"][1].T), f"{m}.{k}"))
        p = f"/{m}/mlp"
        nodes += [helper.make_node("MatMul", ["x", f"{m}.gate"], [f"{m}_g"], name=f"{p}/gate_proj/MatMul"),
                  helper.make_node("MatMul", ["x", f"{m}.up"], [f"{m}_u"], name=f"{p}/up_proj/MatMul")]
        if m == "b":
            nodes.append(helper.make_node("QuickGelu", [f"{m}_g"], [f"{m}_act"], name=f"{p}/act", alpha=1.0,
                                          domain="com.microsoft"))
        else:
            nodes += [helper.make_node("Sigmoid", [f"{m}_g"], [f"{m}_sig"], name=f"{p}/act_fn/Sigmoid"),
                      helper.make_node("Mul", [f"{m}_sig", f"{m}_g"], [f"{m}_act"], name=f"{p}/act_fn/Mul")]
        nodes += [helper.make_node("Mul", [f"{m}_u", f"{m}_act"], [f"{m}_h"], name=f"{p}/Mul"),
                  helper.make_node("MatMul", [f"{m}_h", f"{m}.down"], [f"y_{m}"], name=f"{p}/down_proj/MatMul")]
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "mlps", [helper.make_tensor_value_info("x", f, [1, S, D])],
                              [helper.make_tensor_value_info(f"y_{m}", f, [1, S, D]) for m in "abc"]
                              + [helper.make_tensor_value_info("c_g", f, [1, S, F])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    mp = d / "mlp.onnx"
    onnx.save(model, str(mp))
    return {"gguf": path, "model": mp, "deq": {k: v[1] for k, v in t.items()}}


@pytest.mark.parametrize("glu", ["on", "off"])
def test_glu_fuses_the_mlps_gate_and_up(tmp_path, glu):
    import custom_ops

    mlp = _mlp_model(tmp_path)
    out, rep = tmp_path / "out.onnx", tmp_path / "r.json"
    assert cli.main(["rewrite", str(mlp["model"]), "-o", str(out), "--gguf", str(mlp["gguf"]), "-q",
                     "--weights", "gguf", "--weights-glu", glu, "--report", str(rep)]) == 0
    m, inits = _nodes(out)
    ops = [n.op_type for n in m.graph.node]
    bq = [n for n in m.graph.node if n.op_type == "BlockQuantMatMul"]
    glus = [n for n in bq if _s(_attrs(n).get("glu", b"none")) == "silu"]
    if glu == "off":
        assert not glus and len(bq) == 9
        return
    assert len(glus) == 2 and len(bq) == 7                      # a, b fused; c's gate is a graph output
    assert "QuickGelu" not in ops and ops.count("Sigmoid") == 1 and ops.count("Mul") == 2
    for n in glus:
        a = _attrs(n)
        W = _blocks(inits[n.input[1]], a)
        mname = n.name.split("/")[1]
        assert a["N"] == 2 * F and W.shape[0] == 2 * F and a["act_bits"] == 16 and _s(a["layout"]) == "split"
        assert _s(a["source"]) == f"gguf:{mname}gate.weight,{mname}up.weight"
        deq = blockquant.dequantize(W, "q4_1", D)                 # the GGUF's blocks, gate rows then up rows
        want = np.concatenate([mlp["deq"][f"{mname}gate"], mlp["deq"][f"{mname}up"]])
        assert np.array_equal(deq.view(np.uint32), want.view(np.uint32))
    summary = json.loads(rep.read_text())
    assert any(r.get("backend") == "weights_glu" and "2 MLPs" in r["decision"] for r in summary["graph_passes"])
    x = np.random.default_rng(4).standard_normal((1, S, D)).astype(np.float32)
    names = ["y_a", "y_b", "y_c", "c_g"]
    got = dict(zip(names, custom_ops.session(str(out), backend="reference").run(names, {"x": x})))
    for mname in "ab":     # the reference, layer by layer: the gated unit, then the down projection
        Wg, Wu = mlp["deq"][f"{mname}gate"], mlp["deq"][f"{mname}up"]
        q, d, _ = blockquant.quantize_activations(x, 16)
        P = (blockquant.dequantize_activations(q, d, D) @ np.concatenate([Wg, Wu]).astype(np.float64).T).astype(np.float32)
        h = blockquant.silu_mul(P)
        q, d, _ = blockquant.quantize_activations(h, 16)
        y = (blockquant.dequantize_activations(q, d, F) @ mlp["deq"][f"{mname}down"].astype(np.float64).T).astype(np.float32)
        np.testing.assert_allclose(got[f"y_{mname}"], y, rtol=1e-5, atol=1e-6)
    from conftest import native_available

    if native_available():
        nat = dict(zip(names, custom_ops.session(str(out), threads=2).run(names, {"x": x})))
        for k in names:
            np.testing.assert_allclose(nat[k], got[k], rtol=1e-4, atol=1e-5 * np.abs(got[k]).max())


def test_unmatched_weight_is_refused_by_name(tiny, tmp_path):
    out = tmp_path / "out.onnx"
    p = subprocess.run([sys.executable, "-m", "rewriter.cli", "rewrite", str(tiny["model"]), "-o", str(out),
                        "--weights", "gguf", "--gguf", str(tiny["gguf"]), "-q"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2, p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "'/extra/MatMul'" in err[0] and "K=40" in err[0] and "gguf,q8_0" in err[0]
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("fallback", ["q8_0", "q4_1", "int8", "fp32"])
def test_fallback_quantizes_what_the_gguf_lacks(tiny, tmp_path, fallback):
    out, rep = tmp_path / "out.onnx", tmp_path / "r.json"
    if fallback != "fp32":     # a lossy layer: measured on --calib-text, or written unmeasured with the budget off
        assert _rewrite(tiny, out, "--weights", f"gguf,{fallback}") == 2 and not out.exists()
    assert _rewrite(tiny, out, "--weights", f"gguf,{fallback}", "--quality-budget", "off", "--report", str(rep)) == 0
    m, inits = _nodes(out)
    row = {r["layer"]: r for r in json.loads(rep.read_text())["layers"]}["/extra/MatMul"]
    assert "not in the GGUF" in row["decision"]
    extra = [n for n in m.graph.node if n.name.startswith("/extra/MatMul")]
    assert len(extra) == 1
    n = extra[0]
    if fallback in ("q8_0", "q4_1"):
        a = _attrs(n)
        assert n.op_type == "BlockQuantMatMul" and _s(a["format"]) == fallback and a["K"] == K2
        assert _s(a["source"]) == f"quantize:{fallback}" and a["act_bits"] == 8   # auto: lossy weights, int8 x
        assert _s(a["layout"]) == "split"          # --weights-layout auto: q8_0 / q4_1 take it
        W = blockquant.from_split(inits[n.input[1]], fallback, K2)   # gguf.quants.quantize's blocks of the padded rows
        x = np.zeros((16, 64), np.float32)
        x[:, :K2] = _orig_extra(tiny).T
        assert np.array_equal(W, quants.quantize(x, gg.ggml_type(fallback)))
        assert row["backend"] == f"{fallback} (BlockQuantMatMul)" and row["gap"] > 0
    elif fallback == "int8":
        assert n.op_type == "MatMulNBits" and row["backend"] == "int8 (MatMulNBits)"
    else:
        assert n.op_type == "MatMul" and row["backend"] == "dense"
    assert sum(1 for n in m.graph.node if n.op_type == "BlockQuantMatMul") == 9 + (fallback in ("q8_0", "q4_1"))


def _orig_extra(tiny) -> np.ndarray:
    m = onnx.load(str(tiny["model"]))
    return next(numpy_helper.to_array(t) for t in m.graph.initializer if t.name == "Wx")


@pytest.mark.parametrize("bits", ["8", "16"])
def test_act_bits_flag(tiny, tmp_path, bits):
    """--weights-act-bits 8|16 sets every BlockQuantMatMul's act_bits, exact and fallback layers alike."""
    out = tmp_path / "out.onnx"
    assert _rewrite(tiny, out, "--weights", "gguf,q8_0", "--quality-budget", "off", "--weights-act-bits", bits) == 0
    m, _ = _nodes(out)
    got = {_attrs(n)["act_bits"] for n in m.graph.node if n.op_type == "BlockQuantMatMul"}
    assert got == {int(bits)}


def test_bias_kept_when_the_matmul_has_other_consumers(tiny, tmp_path):
    """The bias folds only when the Add is the MatMul output's one consumer."""
    m = onnx.load(str(tiny["model"]))
    m.graph.node.append(helper.make_node("Identity", ["cat_mm"], ["cat_raw"], name="/cat/Identity"))
    m.graph.output.append(helper.make_tensor_value_info("cat_raw", TensorProto.FLOAT, [1, S, 40]))
    src = tmp_path / "m.onnx"
    onnx.save(m, str(src))
    out = tmp_path / "out.onnx"
    assert cli.main(["rewrite", str(src), "-o", str(out), "--gguf", str(tiny["gguf"]), "--exclude", "/extra/*",
                     "-q"]) == 0            # --weights auto with --gguf: gguf
    m2, inits = _nodes(out)
    bq = next(n for n in m2.graph.node if n.name == "/cat/MatMul_BQ")
    assert len(bq.input) == 2 and any(n.op_type == "Add" for n in m2.graph.node)


def test_embed_fp32_keeps_the_table(tiny, tmp_path):
    out = tmp_path / "out.onnx"
    assert _rewrite(tiny, out, "--weights", "gguf", "--exclude", "/extra/*", "--weights-embed", "fp32") == 0
    m, inits = _nodes(out)
    assert "embed.weight" in inits and not any(n.op_type == "BlockQuantGather" for n in m.graph.node)


def _with_table(tiny, tmp_path, table: np.ndarray) -> Path:
    m = onnx.load(str(tiny["model"]))
    for t in m.graph.initializer:
        if t.name == "embed.weight":
            t.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(table), "embed.weight"))
    src = tmp_path / "m.onnx"
    onnx.save(m, str(src))
    return src


def test_untied_embedding_reads_its_own_blocks(tiny, tmp_path):
    """An embedding that is not the head's table but a GGUF tensor (rows in any order): a
    BlockQuantGather of its own bytes, exact rows."""
    table = tiny["deq"]["a"][::-1]
    src, out = _with_table(tiny, tmp_path, table), tmp_path / "out.onnx"
    assert cli.main(["rewrite", str(src), "-o", str(out), "--weights", "gguf", "--gguf", str(tiny["gguf"]),
                     "--exclude", "/extra/*", "-q"]) == 0
    m2, inits = _nodes(out)
    g = next(n for n in m2.graph.node if n.op_type == "BlockQuantGather")
    a = _attrs(g)
    assert _s(a["format"]) == "q4_0" and a["N"] == 48 and _s(a["source"]) == "gguf:a.weight"
    assert "layout" not in a                    # an untied embedding keeps ggml's blocks (--weights-layout auto)
    assert "embed.weight" not in inits and inits[g.input[0]].shape == (48, 36)
    got = blockquant.gather(inits[g.input[0]], np.arange(-48, 48), format="q4_0", K=D, N=48)
    assert np.array_equal(got.view(np.uint32), np.concatenate([table, table]).view(np.uint32))


def test_untied_embedding_of_two_formats_stays(tiny, tmp_path):
    """A table made of two GGUF tensors in different formats has no one BlockQuantGather: kept."""
    table = np.concatenate([tiny["deq"]["a"], tiny["deq"]["b"]])
    src, out = _with_table(tiny, tmp_path, table), tmp_path / "out.onnx"
    assert cli.main(["rewrite", str(src), "-o", str(out), "--weights", "gguf", "--gguf", str(tiny["gguf"]),
                     "--exclude", "/extra/*", "-q"]) == 0
    m2, inits = _nodes(out)
    assert any(n.op_type == "Gather" for n in m2.graph.node) and "embed.weight" in inits
    assert not any(n.op_type == "BlockQuantGather" for n in m2.graph.node)


def test_flag_errors(tiny, tmp_path):
    out = tmp_path / "x.onnx"
    for flags, words in ((["--weights", "gguf"], ["--weights gguf", "--gguf"]),
                         (["--weights", "int4", "--gguf", str(tiny["gguf"])], ["--gguf", "only with"]),
                         (["--weights", "gguf,int3", "--gguf", str(tiny["gguf"])], ["--weights", "gguf,int3"]),
                         (["--weights", "gguf", "--gguf", str(tmp_path / "no.gguf")], ["no.gguf"])):
        p = subprocess.run([sys.executable, "-m", "rewriter.cli", "rewrite", str(tiny["model"]), "-o", str(out),
                            *flags, "-q"], capture_output=True, text=True, cwd=ROOT)
        assert p.returncode == 2, (flags, p.stderr)
        assert all(w in p.stderr for w in words), (flags, p.stderr)
        assert not out.exists()


def test_auto_without_gguf_is_fp32(tiny, tmp_path):
    """--weights auto (the default) on a model that is no packaged export and without --gguf: fp32,
    so a rewrite without backend flags has nothing to do."""
    from rewriter.backends.weights import WeightsConfig

    c = WeightsConfig()
    c.resolve(tiny["model"])
    assert (c.source, c.weights, c.gguf) == ("fp32", "fp32", None)
    c = WeightsConfig(weights="auto,int4")
    c.resolve(tiny["model"])
    assert (c.source, c.weights) == ("int4", "int4")
    c = WeightsConfig(gguf=str(tiny["gguf"]))
    c.resolve(tiny["model"])
    assert (c.source, c.weights) == ("gguf", "gguf")


def test_auto_on_a_packaged_export(tiny, tmp_path, monkeypatch):
    """--weights auto (no flag) on a directory whose ortlean.json names a packaged model: that model's
    GGUF; a rewrite of the rewrite (ortlean.json is copied beside it) has no float weight left, which
    auto does not turn into an error of its own when something else is asked — and says so when not."""
    import shutil

    from models import prepare

    monkeypatch.setattr(prepare, "gguf_path", lambda name: tiny["gguf"])
    src = tmp_path / "pkg" / "model.onnx"
    src.parent.mkdir()
    shutil.copy(tiny["model"], src)
    (src.parent / "ortlean.json").write_text(json.dumps({"name": "smollm2"}))
    out = tmp_path / "a" / "model.onnx"
    assert cli.main(["rewrite", str(src), "-o", str(out), "--weights", "auto,q8_0", "--quality-budget", "off", "-q"]) == 0
    m, _ = _nodes(out)
    assert sum(n.op_type == "BlockQuantMatMul" for n in m.graph.node) == 10 and (out.parent / "ortlean.json").is_file()
    again = tmp_path / "b" / "model.onnx"
    p = subprocess.run([sys.executable, "-c", "import sys, models.prepare as p; p.gguf_path = lambda n: __import__('pathlib').Path(sys.argv[1]); "
                        "from rewriter import cli; sys.exit(cli.main(sys.argv[2:]))", str(tiny["gguf"]), "rewrite",
                        str(out), "-o", str(again), "-q"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and "nothing to rewrite" in p.stderr and not again.exists(), p.stderr
    assert cli.main(["rewrite", str(src), "-o", str(tmp_path / "c" / "model.onnx"), "-q"]) == 2   # /extra: refused


def test_packaged_export_lookup(tmp_path):
    from models import prepare

    (tmp_path / "ortlean.json").write_text(json.dumps({"name": "smollm2"}))
    assert prepare.packaged_name(tmp_path / "model.onnx") == "smollm2"
    (tmp_path / "ortlean.json").write_text(json.dumps({"name": "nosuch"}))
    assert prepare.packaged_name(tmp_path / "model.onnx") is None
    assert prepare.packaged_name(tmp_path / "sub" / "model.onnx") is None
    assert prepare.gguf_path("minilm") is None


# --------------------------------------------------------------------------- SmolLM2
def _smollm2():
    from models import prepare

    try:
        g = prepare.gguf_path("smollm2")
        d = prepare.model_dir("smollm2")
    except Exception as e:
        pytest.skip(f"SmolLM2 not available: {e}")
    if not (d / "model.onnx").is_file() or g is None or not g.is_file():
        pytest.skip("SmolLM2's export not prepared (ortlean models prepare smollm2)")
    return d / "model.onnx", g


# the fused graph costs ~1 min of ORT's fusion on top (heavy: `-m heavy`, so that the default run stays within
# ~20 min on 2 cores); the unfused one, in the default run, checks every layer against its initializer
@pytest.mark.parametrize("fuse", [pytest.param("on", marks=pytest.mark.heavy), pytest.param("off", marks=pytest.mark.slow)])
def test_smollm2_every_layer_bit_exact(tmp_path, fuse):
    model, g = _smollm2()
    out, rep = tmp_path / "out.onnx", tmp_path / "r.json"
    assert cli.main(["rewrite", str(model), "-o", str(out), f"--fuse={fuse}", "--attn-exact", "off", "--report", str(rep),
                     "-q"]) == 0
    summary = json.loads(rep.read_text())
    assert summary["config"]["backends"]["weights"]["weights"] == "gguf"     # auto on a packaged export
    m = ir.load(str(out))
    ops = [n.op_type for n in m.graph]
    layers = 30
    per = 4 if fuse == "on" else 6          # qkv packed, o, gate+up (glu), down (fused) | q, k, v, o, gate+up, down
    assert ops.count("BlockQuantMatMul") == layers * per + 1 and ops.count("BlockQuantGather") == 1
    assert "Sigmoid" not in ops and "QuickGelu" not in ops
    assert not candidates.find_candidates(m)                                # no weight MatMul left
    src = gg.GGUFSource(g)
    orig = ir.load(str(model)) if fuse == "off" else None
    fmt = {}
    for n in m.graph:
        if n.op_type != "BlockQuantMatMul":
            continue
        a = {k: v.value for k, v in n.attributes.items()}
        W = _blocks(n.inputs[1].const_value.numpy(), a)        # q4_1 / q8_0: layout split, un-split here
        assert a.get("layout") == "split"
        fmt[a["format"]] = fmt.get(a["format"], 0) + 1
        names = a["source"].removeprefix("gguf:").split(",")
        rows = np.concatenate([src.by_name[t].data for t in names])       # the GGUF's own bytes, some rows permuted
        assert W.shape == (a["N"], rows.shape[1])
        assert sorted(map(bytes, W)) == sorted(map(bytes, rows))
        if orig is not None:       # unfused: the dequantized bytes are the source initializer, bit for bit
            name = n.name.removesuffix("_BQ")     # glu: the gate's rows, then the up projection's
            parts = [name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")] if a.get("glu") == "silu" else [name]
            ref = np.concatenate([next(x for x in orig.graph if x.name == p).inputs[1].const_value.numpy().T
                                  for p in parts])
            assert np.array_equal(blockquant.dequantize(W, a["format"], a["K"]).view(np.uint32),
                                  np.ascontiguousarray(ref).view(np.uint32)), name
    assert fmt == {"q4_1": layers * per, "q8_0": 1}
    rows = summary["layers"]
    assert len(rows) == layers * (per + 1) + 1 and all("bit-exact" in r["decision"] for r in rows)
    size = sum(p.stat().st_size for p in out.parent.iterdir() if p.name.startswith("out.onnx"))
    assert size <= 1.15 * g.stat().st_size


# --------------------------------------------------------------------------- Qwen2.5-Coder-1.5B (Q4_K_M: Q4_K and Q6_K)
@pytest.mark.large
def test_qwen_unfused_every_layer_from_its_gguf(tmp_path):
    """Qwen2's q/k/v biases fold into the op, attn_v / ffn_down come in Q6_K beside Q4_K, the untied
    embedding reads its own Q4_K blocks, the head is output.weight (Q6_K)."""
    from models import prepare

    name = "qwen2.5-coder-1.5b"
    if not prepare.is_prepared(name):
        pytest.skip(f"{name} is not prepared (`ortlean models prepare {name}`)")
    model = prepare.model_dir(name) / "model.onnx"
    g = prepare.gguf_path(name, progress=False)
    out, rep = tmp_path / "out.onnx", tmp_path / "r.json"
    assert cli.main(["rewrite", str(model), "-o", str(out), "--fuse=off", "--attn-exact", "off", "--report", str(rep),
                     "-q"]) == 0
    m = ir.load(str(out))
    bq = [n for n in m.graph if n.op_type == "BlockQuantMatMul"]
    assert len(bq) == 28 * 7 + 1 and not candidates.find_candidates(m)
    assert sum(len(n.inputs) == 3 for n in bq) == 28 * 3                  # q, k, v: the bias folded
    fmts = {n.attributes["format"].value for n in bq}
    assert fmts == {"q4_K", "q6_K"}
    (gather,) = [n for n in m.graph if n.op_type == "BlockQuantGather"]
    assert gather.attributes["source"].value == "gguf:token_embd.weight"
    orig = ir.load(str(model))
    table = next(n for n in orig.graph if n.op_type == "Gather" and n.inputs[0].const_value is not None
                 and len(n.inputs[0].const_value.shape) == 2).inputs[0].const_value.numpy()
    ids = np.array([0, 1, 151643, 151645, 151935, 4096], np.int64)
    a = {k: v.value for k, v in gather.attributes.items()}
    rows = blockquant.gather(gather.inputs[0].const_value.numpy(), ids, format=a["format"], K=a["K"], N=a["N"])
    assert np.array_equal(rows.view(np.uint32), table[ids].view(np.uint32))
    by_name = {n.name: n for n in orig.graph}
    for n in bq:                                                            # layer 0, the last and the head
        if not any(s in n.name for s in ("layers.0/", "layers.27/", "lm_head")):
            continue
        a = {k: v.value for k, v in n.attributes.items()}
        ref = by_name[n.name.removesuffix("_BQ")].inputs[1].const_value.numpy().T
        got = blockquant.dequantize(n.inputs[1].const_value.numpy(), a["format"], a["K"])
        assert np.array_equal(got.view(np.uint32), np.ascontiguousarray(ref).view(np.uint32)), n.name
    assert out.stat().st_size + sum(p.stat().st_size for p in tmp_path.glob("out.onnx*.data")) <= 1.15 * g.stat().st_size
