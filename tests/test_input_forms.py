"""Input forms besides optimum exports (issue 9, item 1): the fused graph (rewriter.fuse), models
quantized by ORT's MatMulNBits quantizer, onnxruntime-genai builder models (fp32, int4),
ORT-optimizer-fused BERT and torch-dynamo exports — all tiny random-weight models built once and
cached (tests/tiny_hf.py). Each is classified structurally, `ortlean inspect` reads it, and a rewrite
with a weight backend (--weights int8) either rewrites it (outputs close to the input model) or
reports every layer it cannot take as "kept: unsupported (why)"."""
from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

import tiny_hf
from custom_ops import runtime
from rewriter import cli
from rewriter.fuse import fuse_decoder
from rewriter.kit import candidates
from rewriter.quantize import quantize_weights


@pytest.fixture(scope="session")
def tiny():
    return tiny_hf.models()


@pytest.fixture(scope="session")
def forms():
    return tiny_hf.forms()


@pytest.fixture(scope="session")
def fused_llama(tiny, tmp_path_factory):
    m, _ = fuse_decoder(ir.load(tiny["llama"] / "model.onnx"))
    p = tmp_path_factory.mktemp("fused") / "model.onnx"
    ir.save(m, p)
    return p


def _form(forms, name):
    if name not in forms:
        pytest.skip(f"{name} not built (onnxruntime-genai absent?)")
    return forms[name] / "model.onnx"


def _roles(path) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in candidates.find_candidates(ir.load(path)):
        k = f"{c.target}/{c.role}"
        out[k] = out.get(k, 0) + 1
    return out


LLAMA_LAYERS = tiny_hf.FAMILIES["llama"]["num_hidden_layers"]


def test_classify_optimum_fused_and_dynamo(tiny, fused_llama, forms):
    L = LLAMA_LAYERS
    mlp = {"mlp/gate": L, "mlp/up": L, "mlp/down": L}
    # tied embeddings: the head is a MatMul on Transpose(embedding)
    assert _roles(tiny["llama"] / "model.onnx") == {"attn/q": L, "attn/k": L, "attn/v": L, "attn/o": L, **mlp,
                                                   "head/head": 1}
    assert _roles(fused_llama) == {"attn/qkv": L, "attn/o": L, **mlp, "head/head": 1}
    dyn = _roles(_form(forms, "dynamo"))
    assert {k: dyn.get(k) for k in ("attn/o", "mlp/gate", "mlp/up", "mlp/down", "head/head")} == {
        "attn/o": L, **mlp, "head/head": 1}, dyn
    assert sum(v for k, v in dyn.items() if k in ("attn/q", "attn/k", "attn/v", "attn/q|k")) == 3 * L, dyn


def test_classify_genai_builder_models(forms):
    L = LLAMA_LAYERS
    assert _roles(_form(forms, "genai-fp32")) == {"attn/qkv": L, "attn/o": L, "mlp/gate": L, "mlp/up": L,
                                                  "mlp/down": L, "head/head": 1}
    m = ir.load(_form(forms, "genai-int4"))
    assert candidates.find_candidates(m) == []
    un = candidates.find_unsupported(m)
    assert len(un) == 5 * L + 1 and all("already quantized" in u.why and "MatMulNBits" in u.why for u in un)
    assert all(u.shape is not None and len(u.shape) == 2 for u in un)


def test_classify_ort_fused_bert(forms):
    """The issue's example: the MatMul after com.microsoft Attention is attn/o (was mlp/?); the
    Attention op's packed QKV weight is a 'kept: unsupported' row."""
    m = ir.load(_form(forms, "bert-ort-fused"))
    ops = {n.op_type for n in m.graph}
    assert {"Attention", "SkipLayerNormalization", "EmbedLayerNormalization"} <= ops, ops
    L = tiny_hf.BERT["num_hidden_layers"]
    roles = _roles(_form(forms, "bert-ort-fused"))
    assert roles.get("attn/o") == L and roles.get("mlp/fc1") == L and roles.get("mlp/fc2") == L, roles
    un = candidates.find_unsupported(m)
    assert len([u for u in un if u.node.op_type == "Attention"]) == L
    assert all("fused attention op" in u.why for u in un if u.node.op_type == "Attention")
    # the unfused export classifies the same projections
    plain = _roles(_form(forms, "bert"))
    assert plain.get("attn/o") == L and plain.get("mlp/fc1") == L and plain.get("mlp/fc2") == L, plain


def test_classify_partially_quantized(tiny, fused_llama):
    """ORT's MatMulNBits quantizer on part of the model: the quantized layers are unsupported rows,
    the float ones are still classified (the walks do not cross a MatMulNBits)."""
    m = ir.load(fused_llama)
    mlp = [n.name for n in m.graph if n.op_type == "MatMul" and "/mlp/" in n.name]
    q, info = quantize_weights(m, "int4", exclude=mlp)
    roles = {f"{c.target}/{c.role}" for c in candidates.find_candidates(q)}
    assert roles == {"mlp/gate", "mlp/up", "mlp/down"}
    assert len(candidates.find_unsupported(q)) == len(info["quantized"]) == 2 * LLAMA_LAYERS + 1


@pytest.mark.parametrize("form", ["dynamo", "genai-fp32", "genai-int4", "bert", "bert-ort-fused"])
def test_inspect_every_form(forms, form, capsys):
    p = _form(forms, form)
    assert cli.main(["inspect", str(p), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["dense_candidates"] or info["unsupported"]
    if form.startswith("genai"):
        assert info["attention_cores"] == LLAMA_LAYERS


def _sess(path):
    """A CPU session with the ortlean ops registered (a rewritten fused graph's attention may be exact
    PackedAttention: --attn-exact auto); the input forms themselves use none."""
    import custom_ops

    return ort.InferenceSession(str(path), custom_ops.session_options(1, backend="auto"), providers=["CPUExecutionProvider"])


def _rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-12))


def _outputs(path, ids):
    s = _sess(path)
    io = runtime.ModelIO.from_session(s, path)
    if io.kind == "causal-lm":
        return runtime.run(s, io, runtime.feeds(io, ids))[io.logits_name]
    f = runtime.feeds(io, ids)
    return runtime.run(s, io, f)[io.hidden_name]


def _rewrite(src, out, *flags):
    rep = out.with_suffix(".json")
    rc = cli.main(["rewrite", str(src), "-o", str(out), "--quality-budget", "off", "--report", str(rep), "-q", *flags])
    return rc, json.loads(rep.read_text()) if rep.exists() else None


@pytest.mark.parametrize("form", ["dynamo", "genai-fp32", "bert", "bert-ort-fused"])
def test_int8_rewrite_of_every_float_form(forms, form, tmp_path):
    src = _form(forms, form)
    out = tmp_path / "model.onnx"
    rc, rep = _rewrite(src, out, "--weights", "int8")
    assert rc == 0
    rows = rep["layers"]
    assert any(r["backend"] == "int8 (MatMulNBits)" for r in rows)
    for r in rows:  # every row is either rewritten or says why not
        assert r["backend"] == "int8 (MatMulNBits)" or r["decision"].startswith(("kept: unsupported", "kept dense")), r
    if form == "bert-ort-fused":
        assert [r for r in rows if r["decision"].startswith("kept: unsupported")]
    ids = np.random.default_rng(0).integers(4, 250, (1, 12))
    a, b = _outputs(src, ids), _outputs(out, ids)
    assert a.shape == b.shape and _rel(a, b) < 0.05, _rel(a, b)
    if "genai" in form:  # the genai builder's shared-buffer KV graph runs in the plain loop after the rewrite
        s = _sess(out)
        io = runtime.ModelIO.from_session(s, out)
        o = runtime.run(s, io, runtime.feeds(io, ids[:, :8]))
        o2 = runtime.run(s, io, runtime.feeds(io, ids[:, 8:9], io.next_state(o), 8))
        full = runtime.run(s, io, runtime.feeds(io, ids[:, :9]))[io.logits_name]
        assert _rel(full[:, -1], o2[io.logits_name][:, -1]) < 1e-4


def test_genai_int4_is_refused_with_the_node_and_reason(forms, tmp_path, capsys):
    rc, _ = _rewrite(_form(forms, "genai-int4"), tmp_path / "m.onnx", "--weights", "int8")
    err = capsys.readouterr().err
    assert rc == 2 and "no eligible MatMul" in err and "MatMulNBits" in err and "already quantized" in err
    assert len(err.strip().splitlines()) == 1


def test_genai_models_run_in_the_plain_loop(forms):
    """ModelIO resolves the builder's symbolic kv_cache_dim from genai_config.json: prefill + decode
    in the plain loop equal one prefill of the whole sequence, for fp32 and int4."""
    for form in ("genai-fp32", "genai-int4"):
        p = _form(forms, form)
        s = _sess(p)
        io = runtime.ModelIO.from_session(s, p)
        assert io.head_dim == tiny_hf.FAMILIES["llama"]["hidden_size"] // tiny_hf.FAMILIES["llama"]["num_attention_heads"]
        ids = np.random.default_rng(1).integers(4, 250, (1, 10))
        o = runtime.run(s, io, runtime.feeds(io, ids[:, :7]))
        past = io.next_state(o)
        for t in range(7, 10):
            o = runtime.run(s, io, runtime.feeds(io, ids[:, t: t + 1], past, t))
            past = io.next_state(o)
        full = runtime.run(s, io, runtime.feeds(io, ids))[io.logits_name]
        assert _rel(full[:, -1], o[io.logits_name][:, -1]) < 1e-3, form


def test_genai_fp32_matches_the_optimum_export(tiny, forms):
    """The builder's fp32 graph and optimum's export of the same checkpoint compute the same logits
    (so Δppl rows against the optimum model compare like with like)."""
    ids = np.random.default_rng(2).integers(4, 250, (1, 9))
    a = _outputs(tiny["llama"] / "model.onnx", ids)
    b = _outputs(_form(forms, "genai-fp32"), ids)
    assert _rel(a, b) < 1e-3
