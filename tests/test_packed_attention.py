"""PackedAttention: native kernel vs the numpy reference, exactness at full budget, carried key
bits, GQA head mapping, masks, ISA/popcount paths, the graph pass on a hand-built optimum-style
attention block, and (slow) the real SmolLM2 / MiniLM graphs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto as TP, helper

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import custom_ops  # noqa: E402
from custom_ops.reference.attn import n_words, pack_keys, packed_attention  # noqa: E402

from conftest import requires_native  # noqa: E402


def dense_attention(Q, K, V, mask=None, scale=1.0):
    rep = Q.shape[1] // K.shape[1]
    Kr, Vr = np.repeat(K, rep, axis=1), np.repeat(V, rep, axis=1)
    s = (Q.astype(np.float64) @ np.swapaxes(Kr, -1, -2).astype(np.float64)) * scale
    if mask is not None:
        s = s + mask
    mx = s.max(-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        e = np.exp(s - mx)
        p = e / e.sum(-1, keepdims=True)
    p = np.where(np.isnan(p), 0.0, p)
    return (p @ Vr.astype(np.float64)).astype(np.float32)


def op_model(attrs, *, mask=True, bits=True, name="pa") -> bytes:
    ins = [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in ("Q", "K", "V")]
    names = ["Q", "K", "V", "mask" if mask else "", "past_bits" if bits else ""]
    if mask:
        ins.append(helper.make_tensor_value_info("mask", TP.FLOAT, None))
    if bits:
        ins.append(helper.make_tensor_value_info("past_bits", TP.INT32, None))
    outs = [helper.make_tensor_value_info("Y", TP.FLOAT, None)]
    if bits:
        outs.append(helper.make_tensor_value_info("bits", TP.INT32, None))
    node = helper.make_node("PackedAttention", names, [o.name for o in outs], domain="ai.ortlean", name=name, **attrs)
    m = helper.make_model(helper.make_graph([node], "g", ins, outs),
                          opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.ortlean", 1)])
    m.ir_version = 10
    return m.SerializeToString()


def data(B=2, Hq=6, Hkv=2, M=1, T=600, D=64, seed=0, structured=True):
    r = np.random.default_rng(seed)
    Q = r.standard_normal((B, Hq, M, D), dtype=np.float32)
    K = r.standard_normal((B, Hkv, T, D), dtype=np.float32)
    if structured:  # a few keys aligned with the queries: a real top set to find
        hot = r.choice(T, size=T // 20, replace=False)
        K[:, :, hot] += 2.0 * np.repeat(Q.mean(2, keepdims=True), 1, 2)[:, ::Hq // Hkv]
    V = r.standard_normal((B, Hkv, T, D), dtype=np.float32)
    return Q, K, V


# --------------------------------------------------------------------------- reference
def test_reference_full_budget_is_dense():
    Q, K, V = data()
    mask = np.zeros((2, 1, 1, 600), np.float32)
    mask[1, ..., 100:200] = -np.inf
    for budget in (0.0, 1.0, 0.999):
        Y, _ = packed_attention(Q, K, V, mask, scale=0.125, budget=budget, min_context=0)
        np.testing.assert_allclose(Y, dense_attention(Q, K, V, mask, 0.125), atol=1e-5)


def test_reference_pack_layout():
    K = np.array([[[[1.0, -2.0, 0.0, 3.0] + [0.0] * 28 + [-1.0]]]], np.float32)  # D = 33
    b = pack_keys(K, "sign")
    assert b.shape == (1, 1, 1, n_words(33, "sign")) == (1, 1, 1, 3)
    assert b[0, 0, 0, 0] == 0b1001 and b[0, 0, 0, 1] == 0
    assert np.isclose(b[..., -1].view(np.float32)[0, 0, 0], 7.0 / 33)
    t = pack_keys(K, "ternary", 0.5)
    assert t.shape[-1] == 5 and t[0, 0, 0, 0] == 0b1001 and t[0, 0, 0, 2] == 0b10 and t[0, 0, 0, 3] == 1
    assert np.isclose(t[..., -1].view(np.float32)[0, 0, 0], 7.0 / 4)


# --------------------------------------------------------------------------- native
@requires_native
@pytest.mark.parametrize("mode", ["sign", "ternary", "binary"])
@pytest.mark.parametrize("budget", [0.0, 0.125, 0.5])
def test_kernel_vs_reference(mode, budget):
    Q, K, V = data(T=700)
    mask = np.zeros((2, 1, 1, 700), np.float32)
    mask[1, ..., 5:60] = -np.inf
    attrs = dict(scale=0.125, budget=budget, min_context=0, mode=mode, eps=0.5, rho=1.0, sinks=4, window=32,
                 min_candidates=16)
    P = 699
    pb = pack_keys(K[:, :, :P], mode, 0.5)
    s = custom_ops.session(op_model(attrs))
    Y, bits = s.run(None, {"Q": Q, "K": K, "V": V, "mask": mask, "past_bits": pb})
    Yr, br = packed_attention(Q, K, V, mask, pb, **attrs)
    np.testing.assert_allclose(Y, Yr, atol=1e-5)
    assert (bits == br).all() and (bits == pack_keys(K, mode, 0.5)).all()
    if budget == 0.0:
        np.testing.assert_allclose(Y, dense_attention(Q, K, V, mask, 0.125), atol=1e-5)


@requires_native
def test_full_budget_matches_dense_native():
    Q, K, V = data(T=1000, seed=3)
    for budget in (0.0, 1.0):
        s = custom_ops.session(op_model(dict(scale=0.2, budget=budget, min_context=0), mask=False, bits=False))
        (Y,) = s.run(None, {"Q": Q, "K": K, "V": V})
        np.testing.assert_allclose(Y, dense_attention(Q, K, V, None, 0.2), atol=1e-5)
    # the candidate budget covering the whole context is exact too
    s = custom_ops.session(op_model(dict(scale=0.2, budget=0.5, min_candidates=1000, min_context=0), mask=False, bits=False))
    (Y,) = s.run(None, {"Q": Q, "K": K, "V": V})
    np.testing.assert_allclose(Y, dense_attention(Q, K, V, None, 0.2), atol=1e-5)


@requires_native
def test_bits_carried_across_steps():
    """A decode loop feeding present bits back: bits equal those packed from scratch, outputs equal
    the reference at every step (candidate path active)."""
    B, Hq, Hkv, D, T0, steps = 1, 4, 2, 64, 300, 6
    r = np.random.default_rng(7)
    K = r.standard_normal((B, Hkv, T0 + steps, D), dtype=np.float32)
    V = r.standard_normal((B, Hkv, T0 + steps, D), dtype=np.float32)
    attrs = dict(scale=0.125, budget=0.25, min_context=64, window=16, min_candidates=8)
    s = custom_ops.session(op_model(attrs, mask=False))
    bits = np.zeros((B, Hkv, 0, n_words(D, "sign")), np.int32)
    # prefill (M > 1, exact) packs T0 keys
    Qp = r.standard_normal((B, Hq, T0, D), dtype=np.float32)
    _, bits = s.run(None, {"Q": Qp, "K": K[:, :, :T0], "V": V[:, :, :T0], "past_bits": bits})
    for t in range(T0, T0 + steps):
        q = r.standard_normal((B, Hq, 1, D), dtype=np.float32)
        Y, bits = s.run(None, {"Q": q, "K": K[:, :, :t + 1], "V": V[:, :, :t + 1], "past_bits": bits})
        assert (bits == pack_keys(K[:, :, :t + 1])).all()
        np.testing.assert_allclose(Y, packed_attention(q, K[:, :, :t + 1], V[:, :, :t + 1], **attrs)[0], atol=1e-5)
    m = custom_ops.metrics()["pa"]
    assert m["pack.active"] >= steps and m["pack.enabled"] == 1 and 0.3 < m["pack.density"] < 0.7


@requires_native
def test_gqa_head_mapping():
    Q, K, V = data(B=1, Hq=6, Hkv=3, T=300, structured=False)
    s = custom_ops.session(op_model(dict(scale=0.125), mask=False, bits=False))
    (Y,) = s.run(None, {"Q": Q, "K": K, "V": V})
    np.testing.assert_allclose(Y, dense_attention(Q, K, V, None, 0.125), atol=1e-5)
    V2 = V.copy()
    V2[:, 1] += 1.0  # KV head 1 serves query heads 2 and 3 only
    (Y2,) = s.run(None, {"Q": Q, "K": K, "V": V2})
    changed = np.abs(Y2 - Y).max(axis=(0, 2, 3)) > 1e-3
    assert changed.tolist() == [False, False, True, True, False, False]


@requires_native
def test_masks_and_prefill():
    B, Hq, Hkv, M, T, D = 2, 4, 2, 40, 100, 32
    Q, K, V = data(B, Hq, Hkv, M, T, D, structured=False)
    causal = np.triu(np.full((M, T), -np.inf, np.float32), k=T - M + 1)[None, None]
    full = np.broadcast_to(causal, (B, Hq, M, T)).copy()
    full[1, 2, 5] = -np.inf                   # a fully masked row → 0 (dense graph's IsNaN → 0)
    full[0, 1, :, :10] += -3.0                # finite additive bias
    s = custom_ops.session(op_model(dict(scale=0.3), bits=False))
    for mask in (causal, full, np.zeros((1, 1, 1, T), np.float32)):
        (Y,) = s.run(None, {"Q": Q, "K": K, "V": V, "mask": mask})
        ref = dense_attention(Q, K, V, mask, 0.3)
        np.testing.assert_allclose(Y, ref, atol=1e-5)
    (Y,) = s.run(None, {"Q": Q, "K": K, "V": V, "mask": full})
    assert not Y[1, 2, 5].any()
    # K given transposed ([B, H, D, T], the encoder layout)
    s = custom_ops.session(op_model(dict(scale=0.3, k_layout="bhdt"), bits=False))
    (Yt,) = s.run(None, {"Q": Q, "K": np.ascontiguousarray(np.swapaxes(K, -1, -2)), "V": V, "mask": causal})
    np.testing.assert_allclose(Yt, dense_attention(Q, K, V, causal, 0.3), atol=1e-5)


@requires_native
def test_approx_prefill_rows_are_decode_steps():
    Q, K, V = data(B=1, Hq=4, Hkv=2, M=200, T=500, D=64, seed=5)
    causal = np.triu(np.full((200, 500), -np.inf, np.float32), k=301)[None, None]
    attrs = dict(scale=0.125, budget=0.25, min_context=100, approx_prefill=1, window=16, min_candidates=8)
    s = custom_ops.session(op_model(attrs, bits=False))
    (Y,) = s.run(None, {"Q": Q, "K": K, "V": V, "mask": causal})
    np.testing.assert_allclose(Y, packed_attention(Q, K, V, causal, **attrs)[0], atol=1e-5)
    # row m equals a decode step over keys [0, 301 + m)
    m = 150
    s1 = custom_ops.session(op_model(dict(attrs, approx_prefill=0), mask=False, bits=False))
    (y1,) = s1.run(None, {"Q": Q[:, :, m:m + 1], "K": K[:, :, :301 + m], "V": V[:, :, :301 + m]})
    np.testing.assert_allclose(Y[:, :, m:m + 1], y1, atol=1e-5)


@requires_native
def test_invalid_node_fails_session_with_name():
    for bad in (dict(mode="quaternary"), dict(budget=2.0), dict(qbits=1), dict(k_layout="x"), dict(popcnt="sse")):
        with pytest.raises(Exception) as e:
            custom_ops.session(op_model(bad, name="my_attn"))
        assert "my_attn" in str(e.value)
    s = custom_ops.session(op_model({}, name="shape_check"))
    Q, K, V = data(B=1, Hq=5, Hkv=2, T=10, structured=False)
    with pytest.raises(Exception, match="not a multiple"):
        s.run(None, {"Q": Q, "K": K, "V": V, "mask": np.zeros((1, 1, 1, 10), np.float32),
                     "past_bits": np.zeros((1, 2, 0, 3), np.int32)})


def test_reference_backend_through_ext():
    pytest.importorskip("onnxruntime_extensions")
    Q, K, V = data(B=1, T=300)
    attrs = dict(scale=0.125, budget=0.25, min_context=0)
    pb = pack_keys(K[:, :, :299])
    s = custom_ops.session(op_model(attrs), backend="reference")
    Y, bits = s.run(None, {"Q": Q, "K": K, "V": V, "mask": np.zeros((1, 1, 1, 300), np.float32), "past_bits": pb})
    Yr, br = packed_attention(Q, K, V, None, pb, **attrs)
    np.testing.assert_allclose(Y, Yr, atol=1e-6)
    assert (bits == br).all()


def _isa_worker() -> None:
    want, pop = os.environ["ORTLEAN_ISA"], os.environ["PA_POPCNT"]
    assert custom_ops.isa() == want
    Q, K, V = data(T=700, seed=11)
    for mode in ("sign", "ternary"):
        attrs = dict(scale=0.125, budget=0.125, min_context=0, mode=mode, eps=0.4, rho=1.0, popcnt=pop, window=16)
        pb = pack_keys(K[:, :, :690], mode, 0.4)
        s = custom_ops.session(op_model(attrs, mask=False))
        Y, bits = s.run(None, {"Q": Q, "K": K, "V": V, "past_bits": pb})
        np.testing.assert_allclose(Y, packed_attention(Q, K, V, None, pb, **attrs)[0], atol=1e-5)
        assert (bits == pack_keys(K, mode, 0.4)).all()
        Qp = np.ascontiguousarray(np.repeat(Q, 33, axis=2))
        s2 = custom_ops.session(op_model(dict(scale=0.125), mask=False, bits=False, name="pa_dense"))
        (Yp,) = s2.run(None, {"Q": Qp, "K": K, "V": V})
        np.testing.assert_allclose(Yp, dense_attention(Qp, K, V, None, 0.125), atol=1e-5)
    got = custom_ops.metrics()["pa"]["pack.popcnt"]
    isas = custom_ops.op_isas()   # what benches label figures with (custom_ops.isa_label)
    assert {t for t, v in isas.items() if v != want} <= {"PackedAttention"}, isas
    print("ISA-OK", want, pop, got, isas["PackedAttention"], custom_ops.isa_label())


@requires_native
@pytest.mark.parametrize("isa,pop,expect", [("scalar", "auto", 0), ("avx2", "auto", 1), ("avx512", "auto", None),
                                            ("avx512", "scalar", 0), ("avx512", "avx2", 1)])
def test_isa_and_popcount_paths(isa, pop, expect):
    flags = open("/proc/cpuinfo").read()
    if isa == "avx512" and "avx512f" not in flags or isa == "avx2" and "avx2" not in flags:
        pytest.skip(f"CPU lacks {isa}")
    if expect is None:  # the AVX-512 copy needs VPOPCNTDQ and VNNI (else the AVX2 copy)
        expect = 2 if "avx512_vpopcntdq" in flags and "avx512_vnni" in flags else 1
    env = dict(os.environ, ORTLEAN_ISA=isa, PA_POPCNT=pop,
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    code = ("import importlib.util; "
            f"spec = importlib.util.spec_from_file_location('pat', {str(Path(__file__))!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m._isa_worker()")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"ISA-OK {isa} {pop} {expect}" in p.stdout, p.stdout
    if pop == "auto":  # custom_ops.op_isas() names the copy the node runs, and the label says when it is lower
        name = ("scalar", "avx2", "avx512")[expect]
        label = isa if name == isa else f"{isa} (PackedAttention {name})"
        assert f"ISA-OK {isa} {pop} {expect} {name} {label}\n" in p.stdout, p.stdout


# --------------------------------------------------------------------------- graph pass
def optimum_block(path, Hq=4, Hkv=2, D=16, nan_guard=True):
    """One optimum-style Llama attention core: Concat with the cache, GQA repeat
    (Unsqueeze → Expand → Reshape), Q·s, Kᵀ·s, + mask, Softmax, IsNaN → 0, ·V."""
    import onnx
    from onnx import numpy_helper as nh

    rep = Hq // Hkv
    f = lambda n, shape: helper.make_tensor_value_info(n, TP.FLOAT, shape)  # noqa: E731
    ins = [f("q", ["batch_size", Hq, "sequence_length", D]), f("k", ["batch_size", Hkv, "sequence_length", D]),
           f("v", ["batch_size", Hkv, "sequence_length", D]),
           f("past_key_values.0.key", ["batch_size", Hkv, "past_sequence_length", D]),
           f("past_key_values.0.value", ["batch_size", Hkv, "past_sequence_length", D]),
           f("mask", ["batch_size", 1, "sequence_length", "total"])]
    outs = [f("attn", None), f("present.0.key", None), f("present.0.value", None)]
    inits = [nh.from_array(np.array([2], np.int64), "ax2"), nh.from_array(np.array([1, 1, rep, 1, 1], np.int64), "eshape"),
             nh.from_array(np.array([0, Hq, -1, D], np.int64), "rshape"),
             nh.from_array(np.array(D ** -0.25, np.float32), "s"), nh.from_array(np.array([0.0], np.float32), "zero")]
    N = helper.make_node
    nodes = [N("Concat", ["past_key_values.0.key", "k"], ["present.0.key"], axis=-2),
             N("Concat", ["past_key_values.0.value", "v"], ["present.0.value"], axis=-2)]
    for x in ("key", "value"):
        nodes += [N("Unsqueeze", [f"present.0.{x}", "ax2"], [f"{x}_u"]), N("Expand", [f"{x}_u", "eshape"], [f"{x}_e"]),
                  N("Reshape", [f"{x}_e", "rshape"], [f"{x}_r"])]
    nodes += [N("Mul", ["q", "s"], ["qs"]), N("Transpose", ["key_r"], ["kt"], perm=[0, 1, 3, 2]), N("Mul", ["kt", "s"], ["kts"]),
              N("MatMul", ["qs", "kts"], ["sc"]), N("Add", ["sc", "mask"], ["scm"]), N("Softmax", ["scm"], ["p"], axis=-1)]
    if nan_guard:
        nodes += [N("IsNaN", ["p"], ["nan"]), N("Where", ["nan", "zero", "p"], ["p0"])]
    nodes += [N("MatMul", ["p0" if nan_guard else "p", "value_r"], ["attn"])]
    m = helper.make_model(helper.make_graph(nodes, "blk", ins, outs, inits), opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.save(m, str(path))
    return path


@requires_native
@pytest.mark.parametrize("budget", [0.0, 0.5])
def test_graph_pass_on_optimum_block(tmp_path, budget):
    import onnxruntime as ort

    from custom_ops import runtime
    from rewriter.backends import packed_attention as attn
    from rewriter.kit import modelfile

    src = optimum_block(tmp_path / "blk.onnx")
    model = modelfile.load_model(src)
    cfg = attn.AttnConfig(enabled=True, budget=budget, min_context=8, window=4, sinks=2, min_candidates=4)
    recs = attn.apply(model, cfg)
    assert [r["backend"] for r in recs] == ["packed_attention"] and recs[0]["cache"]
    assert not any(n.op_type in ("Softmax", "Expand", "IsNaN") for n in model.graph)
    out = tmp_path / "blk.lean.onnx"
    modelfile.save_model_atomic(model, out)
    io = runtime.ModelIO.from_model(str(out))
    assert io.past_to_present["past_key_values.0.key_bits"] == "present.0.key_bits"
    dense = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    lean = custom_ops.session(str(out))
    r = np.random.default_rng(0)
    B, Hq, Hkv, D = 1, 4, 2, 16
    pk = np.zeros((B, Hkv, 0, D), np.float32)
    pv = pk.copy()
    bits = np.zeros((B, Hkv, 0, n_words(D, "sign")), np.int32)
    for S in (20, 1, 1, 1):  # prefill then decode steps
        T = pk.shape[2] + S
        feed = {"q": r.standard_normal((B, Hq, S, D), dtype=np.float32), "k": r.standard_normal((B, Hkv, S, D), dtype=np.float32),
                "v": r.standard_normal((B, Hkv, S, D), dtype=np.float32), "past_key_values.0.key": pk,
                "past_key_values.0.value": pv,
                "mask": np.triu(np.full((S, T), -np.inf, np.float32), k=T - S + 1)[None, None]}
        yd, k1, v1 = dense.run(None, feed)
        yl, k2, v2, b2 = lean.run(None, dict(feed, **{"past_key_values.0.key_bits": bits}))
        assert (b2 == pack_keys(k1)).all()
        if budget == 0.0 or S > 1:
            np.testing.assert_allclose(yl, yd, atol=1e-5)
        else:
            ref = packed_attention(feed["q"], k1, v1, feed["mask"], bits, scale=float(np.float32(D ** -0.25) ** 2),
                                   budget=budget, min_context=8, window=4, sinks=2, min_candidates=4)[0]
            np.testing.assert_allclose(yl, ref, atol=1e-5)
        pk, pv, bits = k1, v1, b2


def test_graph_pass_reports_unmatched(tmp_path):
    import onnx

    from rewriter.backends import packed_attention as attn
    from rewriter.kit import modelfile

    src = optimum_block(tmp_path / "blk.onnx")
    m = onnx.load(str(src))
    for n in m.graph.node:  # Softmax over the head axis: not attention over keys
        if n.op_type == "Softmax":
            n.attribute[0].i = 1
    onnx.save(m, str(src))
    model = modelfile.load_model(src)
    recs = attn.apply(model, attn.AttnConfig(enabled=True))
    assert recs[0]["backend"] == "dense" and "axis 1" in recs[0]["decision"]


def test_flags_and_config():
    from rewriter import cli

    p = cli.build_parser()
    a = p.parse_args(["rewrite", "m.onnx", "--state-pack", "binary", "--attn-budget", "0.125"])
    cfg = cli._backend_configs(a)["packed_attention"]
    assert cfg.enabled and cfg.mode == "sign" and cfg.budget == 0.125
    a = p.parse_args(["rewrite", "m.onnx", "--state-pack", "ternary", "--state-pack-eps", "0.3",
                      "--state-pack-popcnt", "avx2"])
    cfg = cli._backend_configs(a)["packed_attention"]
    assert cfg.mode == "ternary" and cfg.eps == 0.3 and cfg.popcnt == "avx2"
    a = p.parse_args(["rewrite", "m.onnx", "--state-pack", "binary", "--state-pack-target", "mlp"])
    assert not cli._backend_configs(a)["packed_attention"].enabled
    a = p.parse_args(["rewrite", "m.onnx"])
    assert not cli._backend_configs(a)["packed_attention"].enabled


# --------------------------------------------------------------------------- real models (slow)
SMOL = "smollm2"


def _prepared(name):
    try:
        from models import prepare as prep

        return prep.prepare(name)
    except Exception as e:  # pragma: no cover
        pytest.skip(f"{name} unavailable: {e}")


@pytest.mark.heavy  # ~25 s on 2 cores: SmolLM2 rewritten unfused, 24 greedy tokens twice (the fused path: test_packed_gqa_cli)
@requires_native
def test_smollm2_rewrite_full_budget_same_greedy_text(tmp_path):
    from custom_ops import runtime
    from rewriter import cli

    d = _prepared(SMOL)
    out = tmp_path / "smol.lean.onnx"
    assert cli.main(["rewrite", str(d / "model.onnx"), "-o", str(out), "--state-pack", "binary", "--attn-budget", "0",
                     "--fuse=off", "--weights", "fp32", "-q"]) == 0   # the unfused path (the fused one:
    # tests/test_packed_gqa_cli.py), float weights: the same greedy text as the dense model
    dense = custom_ops.session(str(d / "model.onnx"), threads=2)
    lean = custom_ops.session(str(out), threads=2)
    io_d, io_l = runtime.ModelIO.from_session(dense), runtime.ModelIO.from_session(lean)
    assert len([n for n in io_l.past_to_present if n.endswith("key_bits")]) == 30
    tok = runtime.load_tokenizer(d)
    prompt = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
    td, _ = runtime.generate(dense, io_d, tok, prompt, 24)
    tl, _ = runtime.generate(lean, io_l, tok, prompt, 24)
    assert td == tl
    # the bits carried through prefill + decode steps equal the bits packed from scratch
    ids = runtime.tokenize(tok, prompt)
    out = runtime.run(lean, io_l, runtime.feeds(io_l, ids[None, :]))
    past, plen = io_l.next_state(out), ids.size
    for t in (11, 12):
        out = runtime.run(lean, io_l, runtime.feeds(io_l, np.array([[t]]), past, plen))
        past, plen = io_l.next_state(out), plen + 1
    for n in (0, 17, 29):
        assert (out[f"present.{n}.key_bits"] == pack_keys(out[f"present.{n}.key"])).all()


@pytest.mark.slow
@requires_native
def test_minilm_rewrite_matches_dense(tmp_path):
    from custom_ops import runtime
    from rewriter.backends import packed_attention as attn
    from rewriter.kit import modelfile

    d = _prepared("minilm")
    model = modelfile.load_model(d / "model.onnx")
    recs = attn.apply(model, attn.AttnConfig(enabled=True))
    assert len([r for r in recs if r["backend"] == "packed_attention"]) == 6
    assert all(r["k_layout"] == "bhdt" and not r["cache"] for r in recs)
    out = tmp_path / "minilm.lean.onnx"
    modelfile.save_model_atomic(model, out)
    dense = custom_ops.session(str(d / "model.onnx"))
    lean = custom_ops.session(str(out))
    io = runtime.ModelIO.from_session(dense)
    tok = runtime.load_tokenizer(d)
    sents = ["Anne Elliot was a woman of gentle manners.", "Captain Wentworth returned from the sea with a fortune."]
    e1, e2 = runtime.embeddings(dense, io, tok, sents), runtime.embeddings(lean, io, tok, sents)
    np.testing.assert_allclose(e1, e2, atol=1e-4)


@requires_native
def test_eps_per_head_and_density_auto_disable():
    Q, K, V = data(B=1, Hq=6, Hkv=3, T=400, structured=True)
    eh = [0.2, 0.8, 1.5]
    attrs = dict(scale=0.125, budget=0.25, min_context=0, mode="ternary", eps=0.0, eps_heads=eh, rho=1.0, window=8)
    s = custom_ops.session(op_model(attrs, mask=False, name="pa_eps"))
    Y, bits = s.run(None, {"Q": Q, "K": K, "V": V, "past_bits": np.zeros((1, 3, 0, n_words(64, "ternary")), np.int32)})
    assert (bits == pack_keys(K, "ternary", 0.0, eh)).all()
    np.testing.assert_allclose(Y, packed_attention(Q, K, V, **attrs)[0], atol=1e-5)
    m = custom_ops.metrics()["pa_eps"]
    assert m["pack.active"] == 1
    # density above rho: exact attention (auto-disable), still carrying the bits
    s = custom_ops.session(op_model(dict(attrs, rho=0.05), mask=False, name="pa_rho"))
    Y, _ = s.run(None, {"Q": Q, "K": K, "V": V, "past_bits": np.zeros((1, 3, 0, n_words(64, "ternary")), np.int32)})
    np.testing.assert_allclose(Y, dense_attention(Q, K, V, None, 0.125), atol=1e-5)
    m = custom_ops.metrics()["pa_rho"]
    assert m["pack.active"] == 0 and m["pack.density"] > 0.05
    with pytest.raises(Exception, match="eps_heads"):
        custom_ops.session(op_model(dict(attrs, eps_heads=[0.1, 0.2]), mask=False, name="pa_bad")).run(
            None, {"Q": Q, "K": K, "V": V, "past_bits": np.zeros((1, 3, 0, 5), np.int32)})


@requires_native
def test_kscale_folded_into_query():
    Q, K, V = data(B=1, Hq=6, Hkv=3, T=500, structured=True)
    ks = np.random.default_rng(1).uniform(0.1, 3.0, size=3 * 64).astype(np.float32)
    attrs = dict(scale=0.125, budget=0.125, min_context=0, kscale=ks.tolist(), window=8)
    s = custom_ops.session(op_model(attrs, mask=False, bits=False, name="pa_ks"))
    (Y,) = s.run(None, {"Q": Q, "K": K, "V": V})
    np.testing.assert_allclose(Y, packed_attention(Q, K, V, **attrs)[0], atol=1e-5)
    (Y0,) = custom_ops.session(op_model({k: v for k, v in attrs.items() if k != "kscale"}, mask=False, bits=False,
                                         name="pa_ks0")).run(
        None, {"Q": Q, "K": K, "V": V})
    assert np.abs(Y - Y0).max() > 1e-4  # it changes the candidate choice
    with pytest.raises(Exception, match="kscale"):
        custom_ops.session(op_model(dict(attrs, kscale=[1.0] * 5), mask=False, bits=False, name="pa_ks_bad")).run(
            None, {"Q": Q, "K": K, "V": V})


@requires_native
def test_oracle_selection():
    Q, K, V = data(B=1, Hq=6, Hkv=3, T=500, structured=True)
    attrs = dict(scale=0.125, budget=0.125, min_context=0, select="exact", window=8)
    (Y,) = custom_ops.session(op_model(attrs, mask=False, bits=False, name="pa_or")).run(None, {"Q": Q, "K": K, "V": V})
    np.testing.assert_allclose(Y, packed_attention(Q, K, V, **attrs)[0], atol=1e-5)
