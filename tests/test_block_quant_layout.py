"""W's row layout "split" of BlockQuantMatMul / BlockQuantGather (custom_ops/reference/blockquant.py:
``to_split`` / ``from_split`` / ``split_refusal``) and the rewriter's ``--weights-layout auto|blocks|split``
(rewriter/backends/weights.py, rewriter/builders/blockgraph.py).

The reference: the split bytes are a permutation within each row, laid out as documented; op and
gather give the same numbers in both layouts. The rewriter, on a tiny GGUF and ONNX model (q4_0, q4_1
gate/up fused into a glu, q8_0 down, a q4_K projection that cannot split, a q8_0 head tied to the
embedding, a weight the GGUF lacks quantized to q4_0 at K = 40): split where the format and act_bits take
it (every act_bits; a tied embedding reads the head's initializer with the head's layout), blocks with
--weights-layout blocks, the same bit-exact report, the same reference outputs bit for bit. The native kernels run the split
model only where the library knows the attribute (``custom_ops.op_schema()`` lists it)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import native_available
from custom_ops import schema
from custom_ops.reference import blockquant as bq
from rewriter import cli

SPLIT = [("q4_0", None), ("q4_1", None), ("q5_0", None), ("q5_1", None), ("q8_0", None), ("q4_f", 32)]


# --------------------------------------------------------------------------- the reference
def _expected_split(W: np.ndarray, fmt: str, K: int, bs) -> np.ndarray:
    """The layout as the docs state it, written out block by block (independent of to_split)."""
    nb, ts, h = bq.blocks_per_row(fmt, K, bs), bq.type_size(fmt, bs), bq.SPLIT_HEADER[fmt]
    out = []
    for row in W:
        blk = row.reshape(nb, ts)
        qs = b"".join(blk[b, h:].tobytes() for b in range(nb))
        fields = [b"".join(blk[b, 2 * f:2 * f + 2].tobytes() for b in range(nb)) for f in range(h // 2)]
        out.append(np.frombuffer(qs + b"".join(fields), np.uint8))
    return np.stack(out)


@pytest.mark.parametrize("fmt,bs", SPLIT)
@pytest.mark.parametrize("K,N", [(33, 5), (100, 7), (576, 3), (8960, 3)])
def test_split_round_trip_and_layout(fmt, bs, K, N):
    rng = np.random.default_rng(K + N)
    W = bq.random_blocks(fmt, N, K, rng, bs)
    S = bq.to_split(W, fmt, K, bs)
    assert S.dtype == np.uint8 and S.shape == W.shape and S.flags.c_contiguous
    assert np.array_equal(S, _expected_split(W, fmt, K, bs))
    assert np.array_equal(np.sort(S, axis=1), np.sort(W, axis=1))        # a permutation within each row
    assert np.array_equal(bq.from_split(S, fmt, K, bs), W)
    nb, h = bq.blocks_per_row(fmt, K, bs), bq.SPLIT_HEADER[fmt]
    qb = nb * (bq.type_size(fmt, bs) - h)
    d = S[:, qb:qb + 2 * nb].copy().view("<f2")                          # the scale array: each block's d
    assert np.array_equal(d, W.reshape(N, nb, -1)[:, :, 0:2].copy().view("<f2").reshape(N, nb))
    with pytest.raises(ValueError, match="expected uint8"):
        bq.to_split(W[:, :-1], fmt, K, bs)


@pytest.mark.parametrize("fmt,bs", SPLIT)
def test_op_and_gather_are_the_same_in_both_layouts(fmt, bs):
    rng = np.random.default_rng(7)
    K, N = 100, 6
    W = bq.random_blocks(fmt, N, K, rng, bs)
    S = bq.to_split(W, fmt, K, bs)
    attrs = {"format": fmt, "K": K, "N": N, **({"block_size": bs} if bs else {})}
    X = rng.standard_normal((2, 3, K)).astype(np.float32)
    X[1, 2, 5] = np.nan
    bias = rng.standard_normal(N).astype(np.float32)
    for extra in ({}, {"glu": "silu"}):
        a = np.asarray(bq.op(X, W, bias, **attrs, **extra))
        b = np.asarray(bq.op(X, S, bias, **attrs, **extra, layout="split"))
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert np.array_equal(bq.op(X, W, **attrs, layout="blocks"), bq.op(X, W, **attrs), equal_nan=True)
    idx = np.array([[0, -1, 3], [5, -6, 2]], np.int64)
    g = bq.gather(S, idx, **attrs, layout="split")
    assert np.array_equal(g.view(np.uint32), bq.gather(W, idx, **attrs).view(np.uint32))
    assert np.array_equal(g[0, 0].view(np.uint32), bq.dequantize(W, fmt, K, bs)[0].view(np.uint32))


def test_split_refusal():
    for fmt, bs in SPLIT:           # every act_bits takes it
        assert bq.split_refusal(fmt, bs) is None and bq.split_refusal(fmt, bs, 8) is None
        assert bq.split_refusal(fmt, bs, 16) is None
    for fmt in ("q4_K", "q5_K", "q6_K"):
        assert f"not {fmt}" in bq.split_refusal(fmt)
    for B in (16, 64, 128, 256):
        assert f"block 32, not {B}" in bq.split_refusal("q4_f", B)
    rng = np.random.default_rng(0)
    W = bq.random_blocks("q4_K", 2, 256, rng)
    with pytest.raises(ValueError, match="not q4_K"):
        bq.op(np.zeros((1, 256), np.float32), W, format="q4_K", K=256, N=2, layout="split")
    W = bq.random_blocks("q4_0", 2, 64, rng)
    X = rng.standard_normal((3, 64)).astype(np.float32)
    assert np.array_equal(bq.op(X, bq.to_split(W, "q4_0", 64), format="q4_0", K=64, N=2, layout="split", act_bits=16),
                          bq.op(X, W, format="q4_0", K=64, N=2, act_bits=16))
    with pytest.raises(ValueError, match="layout must be one of"):
        bq.op(np.zeros((1, 64), np.float32), W, format="q4_0", K=64, N=2, layout="rows")
    with pytest.raises(ValueError, match="not q6_K"):
        bq.to_split(bq.random_blocks("q6_K", 2, 256, rng), "q6_K", 256)
    mm = schema.get("BlockQuantMatMul")
    assert not mm.problems({"format": "q4_f", "K": 64, "N": 2, "layout": "split"})
    assert mm.problems({"format": "q4_f", "K": 64, "N": 2, "block_size": 64, "layout": "split"})
    assert not mm.problems({"format": "q8_0", "K": 64, "N": 2, "act_bits": 16, "layout": "split"})
    assert mm.problems({"format": "q4_K", "K": 256, "N": 2, "layout": "split"})
    assert not schema.get("BlockQuantGather").problems({"format": "q8_0", "K": 64, "N": 2, "layout": "split"})


def test_layout_bytes_checks_and_chunks(monkeypatch):
    """The rewriter's conversion: a chunk of rows at a time, each chunk checked to give the blocks back."""
    from rewriter.builders import blockgraph as BG
    from rewriter.errors import OrtleanError

    rng = np.random.default_rng(1)
    W = bq.random_blocks("q4_1", 9, 100, rng)
    monkeypatch.setattr(BG, "_SPLIT_ROWS_BYTES", 2 * W.shape[1])     # 2 rows a chunk
    assert BG.layout_bytes(W, "blocks", "q4_1", 100) is W
    assert np.array_equal(BG.layout_bytes(W, "split", "q4_1", 100), bq.to_split(W, "q4_1", 100))
    assert BG.row_layout("auto", "q4_1", None, 8) == ("split", None)
    assert BG.row_layout("split", "q4_K", None, 8)[0] == "blocks"
    assert BG.row_layout("blocks", "q4_1", None, 8) == ("blocks", None)
    assert BG.row_layout("auto", "q4_1", None, 16) == ("split", None)
    assert BG.row_layout("auto", "q4_f", 64, 8) == ("blocks", bq.split_refusal("q4_f", 64))
    monkeypatch.setattr(bq, "from_split", lambda S, *a: S)                # a broken inverse is caught
    with pytest.raises(OrtleanError, match="does not give the blocks back"):
        BG.layout_bytes(W, "split", "q4_1", 100)


# --------------------------------------------------------------------------- the rewriter (--weights gguf)
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

D, F, V, K2, K3, S = 64, 96, 80, 40, 256, 4


def _quant(rng, N, K, qt):
    if qt == T.Q4_K:   # gguf-py does not quantize the K formats: random blocks, its own dequantization
        q = bq.random_blocks("q4_K", N, K, rng)
    else:
        q = quants.quantize((rng.standard_normal((N, K)) * 0.05).astype(np.float32), qt)
    return q, np.ascontiguousarray(quants.dequantize(q, qt), dtype=np.float32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("layout")
    rng = np.random.default_rng(11)
    qt = {"a": T.Q4_0, "b": T.Q4_K, "gate": T.Q4_1, "up": T.Q4_1, "down": T.Q8_0, "token_embd": T.Q8_0}
    shapes = {"a": (48, D), "b": (32, K3), "gate": (F, D), "up": (F, D), "down": (D, F), "token_embd": (V, D)}
    t = {k: _quant(rng, *shapes[k], qt[k]) for k in qt}
    path = d / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for k, (q, _) in t.items():
        w.add_tensor(f"{k}.weight", q, raw_dtype=qt[k])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    deq = {k: v[1] for k, v in t.items()}
    extra = (rng.standard_normal((K2, 16)) * 0.05).astype(np.float32)
    inits = [numpy_helper.from_array(np.ascontiguousarray(deq[k].T), f"{k}.w") for k in ("a", "b", "gate", "up", "down")]
    inits += [numpy_helper.from_array(np.ascontiguousarray(deq["token_embd"].T), "head.w"),
              numpy_helper.from_array(deq["token_embd"].copy(), "embed.weight"), numpy_helper.from_array(extra, "Wx")]
    p = "/model/layers.0/mlp"
    nodes = [helper.make_node("MatMul", ["x", "a.w"], ["y_a"], name="/a/MatMul"),
             helper.make_node("MatMul", ["x3", "b.w"], ["y_b"], name="/b/MatMul"),
             helper.make_node("MatMul", ["x", "gate.w"], ["g"], name=f"{p}/gate_proj/MatMul"),
             helper.make_node("MatMul", ["x", "up.w"], ["u"], name=f"{p}/up_proj/MatMul"),
             helper.make_node("Sigmoid", ["g"], ["sig"], name=f"{p}/act_fn/Sigmoid"),
             helper.make_node("Mul", ["g", "sig"], ["act"], name=f"{p}/act_fn/Mul"),
             helper.make_node("Mul", ["act", "u"], ["h"], name=f"{p}/Mul"),
             helper.make_node("MatMul", ["h", "down.w"], ["y_mlp"], name=f"{p}/down_proj/MatMul"),
             helper.make_node("MatMul", ["x", "head.w"], ["logits"], name="/lm_head/MatMul"),
             helper.make_node("Gather", ["embed.weight", "ids"], ["emb"], name="/embed_tokens/Gather"),
             helper.make_node("MatMul", ["x2", "Wx"], ["y_extra"], name="/extra/MatMul")]
    f = TensorProto.FLOAT
    outs = [("y_a", 48), ("y_b", 32), ("y_mlp", D), ("logits", V), ("emb", D), ("y_extra", 16)]
    graph = helper.make_graph(
        nodes, "tiny_layout",
        [helper.make_tensor_value_info("x", f, [1, "S", D]), helper.make_tensor_value_info("x2", f, [1, "S", K2]),
         helper.make_tensor_value_info("x3", f, [1, "S", K3]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "S"])],
        [helper.make_tensor_value_info(n, f, [1, "S", c]) for n, c in outs], inits)
    mp = d / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(mp))
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((1, S, D)).astype(np.float32),
             "x2": rng.standard_normal((1, S, K2)).astype(np.float32),
             "x3": rng.standard_normal((1, S, K3)).astype(np.float32),
             "ids": rng.integers(-V, V, (1, S)).astype(np.int64)}
    return {"gguf": path, "model": mp, "deq": deq, "feeds": feeds, "outs": [n for n, _ in outs]}


def _rewrite(tiny, out: Path, *flags) -> int:
    return cli.main(["rewrite", str(tiny["model"]), "-o", str(out), "--gguf", str(tiny["gguf"]), "-q",
                     "--weights", "gguf,q4_0", "--quality-budget", "off", "--fuse", "off", *flags])


def _a(node) -> dict:
    return {a.name: (lambda v: v.decode() if isinstance(v, bytes) else v)(helper.get_attribute_value(a))
            for a in node.attribute}


def _bq(path: Path):
    m = onnx.load(str(path))
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    return [n for n in m.graph.node if n.op_type.startswith("BlockQuant")], inits


def _blocks_of(node, inits) -> np.ndarray:
    """The node's W as ggml blocks (un-split when its layout is split)."""
    a, W = _a(node), inits[node.input[0 if node.op_type == "BlockQuantGather" else 1]]
    return bq.from_split(W, a["format"], a["K"], a.get("block_size")) if a.get("layout") == "split" else W


@pytest.fixture(scope="module")
def both(tiny, tmp_path_factory) -> dict:
    """The same rewrite with --weights-layout auto (the default) and blocks (--weights-act-bits auto: 16 on
    the GGUF's own blocks, 8 on the fallback's)."""
    d = tmp_path_factory.mktemp("both")
    out = {}
    for lay in ("auto", "blocks"):
        o, r = d / lay / "model.onnx", d / lay / "report.json"
        assert _rewrite(tiny, o, "--report", str(r), *(["--weights-layout", lay] if lay != "auto" else [])) == 0
        out[lay] = (o, json.loads(r.read_text()))
    return out


def test_rewrite_splits_where_it_applies(tiny, both):
    nodes, inits = _bq(both["auto"][0])
    by = {n.name: n for n in nodes}
    lay = {n.name: _a(n).get("layout", "blocks") for n in nodes}
    glu = next(n for n in nodes if _a(n).get("glu") == "silu")
    assert lay == {"/a/MatMul_BQ": "split", "/b/MatMul_BQ": "blocks", glu.name: "split",
                   "/model/layers.0/mlp/down_proj/MatMul_BQ": "split", "/lm_head/MatMul_BQ": "split",
                   "/embed_tokens/Gather_BQ": "split", "/extra/MatMul_BQ": "split"}
    assert {n.name: _a(n).get("act_bits") for n in nodes if n.op_type == "BlockQuantMatMul" and _a(n).get("act_bits") != 16} \
        == {"/extra/MatMul_BQ": 8}                          # split with either act_bits
    g = by["/embed_tokens/Gather_BQ"]                     # the tied embedding: the head's initializer and layout
    assert g.input[0] == by["/lm_head/MatMul_BQ"].input[1]
    # the written bytes, un-split, are the GGUF's blocks (gate rows then up rows in the glu)
    deq, K = tiny["deq"], {"a": D, "b": K3, "down": F, "token_embd": D}
    want = {"/a/MatMul_BQ": "a", "/b/MatMul_BQ": "b", "/model/layers.0/mlp/down_proj/MatMul_BQ": "down",
            "/lm_head/MatMul_BQ": "token_embd"}
    for name, t in want.items():
        a = _a(by[name])
        got = bq.dequantize(_blocks_of(by[name], inits), a["format"], a["K"])
        assert a["K"] == K[t] and np.array_equal(got.view(np.uint32), deq[t].view(np.uint32)), name
    got = bq.dequantize(_blocks_of(glu, inits), "q4_1", D)
    assert np.array_equal(got.view(np.uint32), np.concatenate([deq["gate"], deq["up"]]).view(np.uint32))
    assert glu.input[1] != by["/a/MatMul_BQ"].input[1]
    # blocks: no layout attribute anywhere, the same blocks
    bnodes, binits = _bq(both["blocks"][0])
    assert all("layout" not in _a(n) for n in bnodes)
    bby = {n.name: n for n in bnodes}
    assert set(bby) == set(by)
    for name in by:
        assert np.array_equal(_blocks_of(by[name], inits), binits[bby[name].input[0 if name.endswith("Gather_BQ") else 1]]), name


def test_report_states_the_layout_and_bit_exactness(both):
    rows = {r["layer"]: r for r in both["auto"][1]["layers"]}
    for name in ("/a/MatMul", "/lm_head/MatMul"):
        r = rows[name]
        assert r["extra"]["layout"] == "split" and r["extra"]["bit_exact"] is True
        assert "bit-exact: dequantized bytes equal the source initializer" in r["decision"]
        assert "layout split (the GGUF's bytes reordered within each row" in r["decision"]
    assert rows["/b/MatMul"]["extra"]["layout"] == "blocks" and rows["/a/MatMul"]["extra"]["act_bits"] == 16
    assert "layout blocks (split takes formats q4_0, q4_1, q5_0, q5_1, q8_0 and q4_f with block 32, not q4_K)" in rows["/b/MatMul"]["decision"]
    assert rows["/extra/MatMul"]["extra"]["layout"] == "split" and "q4_0's bytes reordered" in rows["/extra/MatMul"]["decision"]
    notes = both["auto"][1]["notes"]
    assert any("layers hold the GGUF's blocks, bit-exact" in n for n in notes)
    assert any(n.startswith("weights layout (auto): 6 of 7 BlockQuantMatMul layers split") and "1 blocks" in n for n in notes)
    brows = {r["layer"]: r for r in both["blocks"][1]["layers"]}
    assert all(r["extra"]["layout"] == "blocks" and "layout blocks" in r["decision"] for r in brows.values())
    assert any(n.startswith("weights layout (blocks): 0 of 7") for n in both["blocks"][1]["notes"])


def test_split_and_blocks_compute_the_same(tiny, both):
    """The reference backend (ORT running the numpy op): the two models' outputs are bit for bit equal; the
    native kernels agree with it within the kernels' float32 sums."""
    import custom_ops

    names, feeds = tiny["outs"], tiny["feeds"]
    ref = {k: custom_ops.session(str(both[k][0]), backend="reference").run(names, feeds) for k in both}
    for n, a, b in zip(names, ref["auto"], ref["blocks"]):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), n
    if not native_available() and not os.environ.get("CI"):  # as conftest's requires_native
        pytest.skip("ortlean library not built (pip install -e .)")
    for threads in (1, 2):
        sess = custom_ops.session(str(both["auto"][0]), threads=threads)
        for rows in (slice(0, 1), slice(None)):         # M = 1 (the decode kernel) and M = S
            nat = sess.run(names, {k: v[:, rows] for k, v in feeds.items()})
            for n, a, b in zip(names, nat, ref["auto"]):
                b = b[:, rows]
                if n == "emb":
                    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
                else:
                    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max(), err_msg=f"{n} {threads} {rows}")


@pytest.mark.parametrize("bits", ["8"])
def test_act_bits_do_not_change_the_layout(tiny, tmp_path, bits):
    """--weights-act-bits 8 as auto's 16 (the `both` fixture): the same layouts (split takes every act_bits)."""
    out = tmp_path / "m.onnx"
    assert _rewrite(tiny, out, "--weights-act-bits", bits) == 0
    nodes, _ = _bq(out)
    assert all(_a(n).get("act_bits", int(bits)) == int(bits) for n in nodes)
    lay = {n.name: _a(n).get("layout", "blocks") for n in nodes}
    assert lay.pop("/b/MatMul_BQ") == "blocks" and set(lay.values()) == {"split"}


def test_split_flag(tiny, tmp_path, capsys):
    """--weights-layout split: as auto, the layers that kept blocks named in the summary; an error (exit 2,
    nothing written) when no layer takes it or the flags rule it out."""
    out, rep = tmp_path / "m.onnx", tmp_path / "r.json"
    assert _rewrite(tiny, out, "--weights-layout", "split", "--report", str(rep)) == 0
    notes = json.loads(rep.read_text())["notes"]
    line = next(n for n in notes if n.startswith("weights layout (split)"))
    assert "kept blocks: /b/MatMul (layout split takes formats q4_0, q4_1, q5_0, q5_1, q8_0 and q4_f with block 32, not q4_K)" in line
    capsys.readouterr()
    gg = ["--gguf", str(tiny["gguf"]), "--weights", "gguf,q4_0"]
    for flags, msg in ((gg + ["--include", "/b/*"], "no layer takes it: layout split takes formats q4_0, q4_1, q5_0, "
                                                    "q5_1, q8_0 and q4_f with block 32, not q4_K"),
                       (["--weights", "int8"], "only BlockQuantMatMul weights have a row layout"),
                       (["--fuse", "on"], "only BlockQuantMatMul weights have a row layout")):    # --weights auto: fp32
        o = tmp_path / f"bad{len(flags)}.onnx"
        assert cli.main(["rewrite", str(tiny["model"]), "-o", str(o), "-q", "--quality-budget", "off",
                         "--weights-layout", "split", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert msg in err and "--weights-layout split" in err, err
        assert not o.exists()
    assert _rewrite(tiny, out, "--weights-layout", "auto", "--include", "/b/*") == 0     # auto: blocks, no error


@pytest.mark.parametrize("glu", ["on", "off"])
def test_glu_fusion_keeps_the_layout(tiny, both, tmp_path, glu):
    """Gate and up of one layout fuse into one glu node of that layout (whole rows concatenated)."""
    out = both["auto"][0]            # --weights-glu on is the default
    if glu == "off":
        out = tmp_path / "m.onnx"
        assert _rewrite(tiny, out, "--weights-glu", glu) == 0
    nodes, inits = _bq(out)
    mlp = [n for n in nodes if "/mlp/" in n.name and "down" not in n.name]
    assert len(mlp) == (1 if glu == "on" else 2) and all(_a(n)["layout"] == "split" for n in mlp)
    got = np.concatenate([bq.dequantize(_blocks_of(n, inits), "q4_1", D) for n in mlp])
    assert np.array_equal(got.view(np.uint32), np.concatenate([tiny["deq"]["gate"], tiny["deq"]["up"]]).view(np.uint32))


def test_glu_does_not_fuse_mixed_layouts():
    """fuse_glu's key includes the layout: a split gate and a blocks up stay two nodes."""
    import onnx_ir as ir

    from rewriter.builders import blockgraph as BG
    from rewriter.kit import surgery

    rng = np.random.default_rng(3)
    Wg, Wu = (bq.random_blocks("q4_0", 4, 32, rng) for _ in range(2))

    def mm(name, W, layout):
        w = surgery.initializer(graph, f"{name}.w", W if layout == "blocks" else bq.to_split(W, "q4_0", 32))
        attrs = {"format": "q4_0", "K": 32, "N": 4, **({"layout": layout} if layout != "blocks" else {})}
        n = surgery.op_node("BlockQuantMatMul", [x, w], attrs, name=name)
        graph.append(n)
        return n

    for layouts, fused in ((("split", "blocks"), 0), (("split", "split"), 1)):
        x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 32]))
        graph = ir.Graph([x], [], nodes=[], name="g")
        g, u = mm("/mlp/gate_proj/MatMul_BQ", Wg, layouts[0]), mm("/mlp/up_proj/MatMul_BQ", Wu, layouts[1])
        sig = ir.Node("", "Sigmoid", [g.outputs[0]], name="sig")
        act = ir.Node("", "Mul", [g.outputs[0], sig.outputs[0]], name="act")
        h = ir.Node("", "Mul", [act.outputs[0], u.outputs[0]], name="h")
        for n in (sig, act, h):
            graph.append(n)
        h.outputs[0].name = "h_out"
        graph.outputs.append(h.outputs[0])
        assert len(BG.fuse_glu(graph)) == fused, layouts
        if fused:
            n = next(n for n in graph if n.op_type == "BlockQuantMatMul")
            assert n.attributes["layout"].as_string() == "split"
            W = bq.from_split(n.inputs[1].const_value.numpy(), "q4_0", 32)
            assert np.array_equal(W, np.concatenate([Wg, Wu]))


# --------------------------------------------------------------------------- the float path (--weights int4)
def test_float_path_splits_a_tied_q8_0_head(tmp_path, monkeypatch):
    """--weights int4 on a float checkpoint: a layer planned in a split format (here q8_0: the 4-bit
    default raised past 8.5 bits) is written split, and the tied embedding's BlockQuantGather reads the
    head's initializer with its layout; --weights-layout blocks writes the same blocks unsplit."""
    import custom_ops
    from rewriter.builders import weightplan as WP

    monkeypatch.setattr(WP, "INT4_BITS", 9.0)            # the default becomes the lowest gap: q8_0
    rng = np.random.default_rng(5)
    E = (rng.standard_normal((V, D)) * 0.05).astype(np.float32)
    A = (rng.standard_normal((D, 48)) * 0.05).astype(np.float32)
    nodes = [helper.make_node("Gather", ["embed.weight", "ids"], ["emb"], name="/embed_tokens/Gather"),
             helper.make_node("MatMul", ["emb", "a.w"], ["y_a"], name="/a/MatMul"),
             helper.make_node("MatMul", ["emb", "head.w"], ["logits"], name="/lm_head/MatMul")]
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "tiny_float", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, S])],
                              [helper.make_tensor_value_info("y_a", f, [1, S, 48]),
                               helper.make_tensor_value_info("logits", f, [1, S, V])],
                              [numpy_helper.from_array(E, "embed.weight"), numpy_helper.from_array(A, "a.w"),
                               numpy_helper.from_array(np.ascontiguousarray(E.T), "head.w")])
    src = tmp_path / "float.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    feeds = {"ids": rng.integers(0, V, (1, S)).astype(np.int64)}
    got = {}
    for lay in ("auto", "blocks"):
        out, rep = tmp_path / lay / "m.onnx", tmp_path / f"{lay}.json"
        assert cli.main(["rewrite", str(src), "-o", str(out), "-q", "--weights", "int4", "--weights-quantizer", "rtn",
                         "--quality-budget", "off", "--weights-layout", lay, "--report", str(rep)]) == 0
        nodes, inits = _bq(out)
        by = {n.name: n for n in nodes}
        head, g = by["/lm_head/MatMul_BQ"], by["/embed_tokens/Gather_BQ"]
        assert _a(head)["format"] == "q8_0" and g.input[0] == head.input[1]
        want = "split" if lay == "auto" else "blocks"
        assert _a(head).get("layout", "blocks") == want and _a(g).get("layout", "blocks") == want
        rows = {r["layer"]: r for r in json.loads(rep.read_text())["layers"]}
        assert rows["/lm_head/MatMul"]["extra"]["layout"] == want and f"layout {want}" in rows["/lm_head/MatMul"]["decision"]
        got[lay] = (custom_ops.session(str(out), backend="reference").run(["y_a", "logits"], feeds),
                    {k: _blocks_of(n, inits) for k, n in by.items()})
    for a, b in zip(got["auto"][0], got["blocks"][0]):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    for k in got["auto"][1]:
        assert np.array_equal(got["auto"][1][k], got["blocks"][1][k]), k
