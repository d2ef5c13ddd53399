"""PackedAttention's quantized cache mode (kv_quant = int8 | int4): native kernel vs the numpy
reference (custom_ops/reference/attn.py: packed_attention_kv) on random and adversarial shapes,
every ISA path, exact at full budget against dense attention over the dequantized cache, carried
state across steps, one shared past/present buffer (seqlens_k), sliding window, softcap, batch
with padding, and the refusal of bad nodes."""
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
from custom_ops.reference.attn import (cache_bits_words, kv_row_words, pack_cache, pack_kv,  # noqa: E402
                                       packed_attention_kv, unpack_kv)

from conftest import requires_native  # noqa: E402

IN_NAMES = ("Q", "K", "V", "mask", "past_bits", "past_kv", "seqlens_k", "cos_cache", "sin_cache", "prompt_continues")


def kv_model(attrs, *, use=("Q", "K", "V", "past_bits", "past_kv"), outs=3, name="pkv") -> bytes:
    types = {"past_bits": TP.INT32, "past_kv": TP.INT32, "seqlens_k": TP.INT32, "prompt_continues": TP.INT32}
    ins = [helper.make_tensor_value_info(n, types.get(n, TP.FLOAT), None) for n in IN_NAMES if n in use]
    names = [n if n in use else "" for n in IN_NAMES]
    while names and not names[-1]:
        names.pop()
    out_vi = [helper.make_tensor_value_info(n, TP.FLOAT if n == "Y" else TP.INT32, None)
              for n in ("Y", "bits", "kv")[:outs]]
    node = helper.make_node("PackedAttention", names, [o.name for o in out_vi], domain="ai.ortlean", name=name,
                            **attrs)
    m = helper.make_model(helper.make_graph([node], "g", ins, out_vi),
                          opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.ortlean", 1)])
    m.ir_version = 10
    return m.SerializeToString()


def case(B=1, Hq=9, Hkv=3, S=1, P=700, D=64, Dv=None, q="int8", seed=0, mode="sign", eps=0.0, pq=None):
    """Random new tokens and a past cache whose keys have a few hot rows aligned with the queries
    (pq: mode pq's (book, dims))."""
    r = np.random.default_rng(seed)
    Dv = Dv or D
    Q = r.standard_normal((B, Hq, S, D), dtype=np.float32)
    Kp = r.standard_normal((B, Hkv, P, D), dtype=np.float32)
    if P:
        hot = r.choice(P, size=max(1, P // 20), replace=False)
        Kp[:, :, hot] += 2.0 * Q.reshape(B, Hkv, Hq // Hkv, S, D).mean((2, 3))[:, :, None]
    Vp = r.standard_normal((B, Hkv, P, Dv), dtype=np.float32)
    K = r.standard_normal((B, Hkv, S, D), dtype=np.float32)
    V = r.standard_normal((B, Hkv, S, Dv), dtype=np.float32)
    bits, rows = pack_cache(Kp, Vp, q, mode, eps, None, pq)
    feed = {"Q": Q, "K": K, "V": V, "past_kv": rows, "past_bits": bits}
    return feed


def run_native(attrs, feed, outs=3):
    use = tuple(feed)
    s = custom_ops.session(kv_model(attrs, use=use, outs=outs), threads=2)
    return s.run(None, feed)


def run_ref(attrs, feed):
    f = dict(feed)
    return packed_attention_kv(f.pop("Q"), f.pop("K"), f.pop("V"), f.pop("mask", None), f.pop("past_bits", None),
                               f.pop("past_kv", None), f.pop("seqlens_k", None), f.pop("prompt_continues", None),
                               **attrs)


def dense_over_cache(feed, kv, bits, D, Dv, q, scale, total=None, local_window=-1, softcap=0.0):
    """Plain attention (float64) of the new query rows over the dequantized present cache (rows kv,
    their scales in the key-bits rows bits)."""
    Kd, Vd = unpack_kv(kv, bits, D, Dv, q)
    Q = feed["Q"]
    B, Hq, S, _ = Q.shape
    rep = Hq // Kd.shape[1]
    Y = np.zeros((B, Hq, S, Dv), np.float32)
    for b in range(B):
        tot = kv.shape[2] if total is None else total[b]
        for h in range(Hq):
            for m in range(S):
                pos = max(0, tot - S) + m
                if pos >= tot:
                    continue
                lo = max(0, pos - local_window + 1) if local_window > 0 else 0
                l = (Kd[b, h // rep, lo:pos + 1].astype(np.float64) @ Q[b, h, m].astype(np.float64)) * scale
                if softcap > 0:
                    l = softcap * np.tanh(l / softcap)
                e = np.exp(l - l.max())
                Y[b, h, m] = (e / e.sum()) @ Vd[b, h // rep, lo:pos + 1]
    return Y


# --------------------------------------------------------------------------- reference
@pytest.mark.parametrize("q", ["int8", "int4"])
def test_reference_row_format_roundtrip(q):
    r = np.random.default_rng(1)
    K = r.standard_normal((2, 3, 7, 16), dtype=np.float32)
    V = r.standard_normal((2, 3, 7, 24), dtype=np.float32)
    K[0, 0, 0] = 0.0                                   # an all-zero row: scale 0, codes 0
    rows, sc = pack_kv(K, V, q)
    assert rows.shape == (2, 3, 7, kv_row_words(16, 24, q)) and rows.dtype == np.int32
    assert sc.shape == (2, 3, 7, 2) and sc.dtype == np.int32
    Kd, Vd = unpack_kv(rows, sc, 16, 24, q)
    L = 127 if q == "int8" else 7
    tolk = np.abs(K).max(-1, keepdims=True) / L / 2 + 1e-7
    assert (np.abs(Kd - K) <= tolk).all() and (np.abs(Vd - V) <= np.abs(V).max(-1, keepdims=True) / L / 2 + 1e-7).all()
    assert (Kd[0, 0, 0] == 0).all()
    # bytes: int8 row = D + Dv bytes, int4 = (D + Dv) / 2 (vs 4 (D + Dv) in fp32); the two scales are
    # words of the key-bits row (cache_bits_words = n_words + 2)
    assert rows.shape[-1] * 4 == ((16 + 24) if q == "int8" else 20)
    bits, rows2 = pack_cache(K, V, q)
    assert (rows2 == rows).all() and bits.shape[-1] == cache_bits_words(16) == 2 + 2 and (bits[..., -2:] == sc).all()


# int8 / int4 score with the query quantized to 32767 levels per head (query_int16): a logit moves by at
# most scale * max|q| / 65534 * sum|k̂| (~1e-5 for these feeds), Y by that much times |v|
INT16_Q_ATOL = 1e-4


def test_reference_full_budget_is_dense_over_cache():
    f = case(P=300, S=1)
    for budget in (0.0, 1.0):
        Y, bits, kv = run_ref(dict(kv_quant="int8", scale=0.125, budget=budget, min_context=0), f)
        np.testing.assert_allclose(Y, dense_over_cache(f, kv, bits, 64, 64, "int8", 0.125), atol=INT16_Q_ATOL)
        Y32, bits32, kv32 = run_ref(dict(kv_quant="fp32", scale=0.125, budget=budget, min_context=0),
                                    case(P=300, S=1, q="fp32"))
        np.testing.assert_allclose(Y32, dense_over_cache(case(P=300, S=1, q="fp32"), kv32, bits32, 64, 64, "fp32", 0.125),
                                   atol=1e-5)
    assert (bits[:, :, :300] == f["past_bits"]).all() and (kv[:, :, :300] == f["past_kv"]).all()


# --------------------------------------------------------------------------- kernel vs reference
KERNEL_CASES = [
    (1, 6, 2, 1, 300, 24, 20, "fp32", dict(budget=0.3, window=16, min_context=32)),
    # (B, Hq, Hkv, S, P, D, Dv, q, attrs)
    (1, 9, 3, 1, 700, 64, 64, "int8", dict(budget=0.25, window=64, min_context=128)),
    (1, 9, 3, 1, 700, 64, 64, "int4", dict(budget=0.25, window=64, min_context=128)),
    (2, 4, 2, 1, 333, 48, 40, "int8", dict(budget=0.3, window=17, sinks=3, min_candidates=5, min_context=10)),
    (1, 4, 1, 1, 1100, 64, 64, "int8", dict(budget=0.1, window=32, mode="ternary", eps=0.5)),
    # contexts of >= 2048 keys: scored in two key ranges per row on 2 threads (ternary planes, the oracle)
    (1, 6, 3, 1, 2300, 64, 64, "int8", dict(budget=0.2, window=32, mode="ternary", eps=0.5)),
    (1, 4, 2, 1, 2100, 32, 32, "int8", dict(budget=0.2, select="exact")),
    # the scores by nibble tables (32 keys a block; D 128: two 8-byte halves; a tail of 13 keys):
    # qbits 10 at D 64 sums up to 16 x 4 x 511 (int16's edge), qbits 16 too wide (the byte tables)
    (1, 4, 2, 1, 1100, 128, 64, "int8", dict(budget=0.2, window=16)),
    (1, 6, 3, 1, 1000, 64, 64, "int8", dict(budget=0.2, window=8, qbits=10)),
    (1, 6, 3, 1, 1000, 64, 64, "int8", dict(budget=0.2, window=8, qbits=16)),
    # 61 keys: one 32-key block + a 29-key tail by nibble sums; qbits 16: all 61 by nibble sums (under
    # the byte tables' 64 keys); D 576 (72 key bytes, past the nibble-table path): byte tables
    (1, 4, 2, 1, 60, 64, 64, "int8", dict(budget=0.5, window=4, sinks=0, min_candidates=0, min_context=0)),
    (1, 4, 2, 1, 60, 64, 64, "int8", dict(budget=0.5, window=4, sinks=0, min_candidates=0, min_context=0,
                                          qbits=16)),
    (1, 2, 2, 1, 300, 576, 16, "int8", dict(budget=0.3, window=8, min_context=0, qbits=16)),
    (1, 2, 2, 1, 600, 32, 32, "int8", dict(budget=0.5, window=0, sinks=0, min_candidates=0, min_context=0, qbits=3)),
    (1, 6, 3, 1, 640, 64, 64, "int8", dict(budget=0.2, select="exact")),
    (1, 4, 2, 5, 90, 16, 16, "int8", dict(budget=0.0)),                              # prefill continuation
    (1, 4, 2, 7, 0, 16, 16, "int4", dict()),                                          # first prompt
    (1, 4, 2, 1, 0, 8, 8, "int8", dict(budget=0.5, min_context=0)),                   # a single key
    (1, 6, 2, 4, 700, 64, 64, "int8", dict(budget=0.25, approx_prefill=1, min_context=64)),
    (1, 4, 2, 1, 700, 64, 64, "int8", dict(budget=0.25, local_window=300, min_context=64, softcap=5.0)),
    (1, 4, 2, 1, 900, 32, 32, "int8", dict(budget=0.2, qbits=2, min_context=0)),       # heavy score ties
    # fused row kernels: heads in groups of 3 (rep 5, 7), int4 dims 8 mod 16, key blocks not of 4 / 32
    (1, 10, 2, 1, 2500, 40, 24, "int4", dict(budget=0.2, window=16, min_context=64)),
    (1, 14, 2, 1, 1501, 24, 56, "int8", dict(budget=1.0)),
    # groups of 3 heads over int8 keys of D 128 (AVX-512: 4 x 32-code steps, then reduce12), 4k + 3 keys
    (1, 6, 2, 1, 503, 128, 96, "int8", dict(budget=0.3, window=8, min_context=0)),
    # candidates in blocks (cand_block): the rest not a multiple of the block (a short last block),
    # a budget not a multiple of it, blocks of 1 key's worth of budget, int4 / fp32 rows, rep 1
    (1, 9, 3, 1, 1000, 64, 64, "int8", dict(budget=0.25, window=61, sinks=3, min_context=64, cand_block=16)),
    (2, 4, 2, 1, 333, 48, 40, "int4", dict(budget=0.3, window=17, sinks=3, min_candidates=5, min_context=10,
                                           cand_block=7)),
    (1, 6, 2, 1, 300, 24, 20, "fp32", dict(budget=0.3, window=16, min_context=32, cand_block=5)),
    (1, 3, 3, 1, 3000, 64, 64, "int8", dict(budget=0.125, qbits=2, min_context=0, cand_block=32)),  # ties
    (1, 2, 2, 1, 600, 32, 32, "int8", dict(budget=0.02, window=0, sinks=0, min_candidates=0, min_context=0,
                                           cand_block=100)),
    (1, 3, 3, 1, 3000, 64, 64, "int8", dict(budget=0.125, qbits=2, min_context=0)),     # ties, long context
    # integer q.k: head dim 8 mod 16 (int8, codes past D read x 0), D > 512 (the int64 fallback), rep 1 / 5
    (1, 5, 1, 1, 77, 72, 8, "int8", dict(budget=1.0)),
    (1, 2, 2, 1, 40, 520, 16, "int4", dict(budget=1.0)),
]


@requires_native
def test_kernel_vs_reference_with_mask_ties_and_zero_query():
    """An additive mask with -inf stretches (per head), a query of zeros (all scores equal: ties
    broken by index), scores with few distinct values: the selection equals the reference's."""
    attrs = dict(kv_quant="int8", scale=0.125, budget=0.15, window=8, sinks=2, min_candidates=4, min_context=16)
    for seed, zero in ((11, False), (12, True)):
        f = case(B=2, Hq=4, Hkv=2, P=500, seed=seed)
        if zero:
            f["Q"][1] = 0.0
        mask = np.zeros((2, 4, 1, 501), np.float32)
        mask[0, :, :, 100:300] = -np.inf
        mask[1, 1, :, :50] = -np.inf
        f = {"Q": f["Q"], "K": f["K"], "V": f["V"], "mask": mask, "past_bits": f["past_bits"], "past_kv": f["past_kv"]}
        Yr, br, kr = run_ref(attrs, f)
        Y, bits, kv = run_native(attrs, f)
        np.testing.assert_allclose(Y, Yr, atol=2e-5, rtol=1e-4)


@requires_native
@pytest.mark.parametrize("B,Hq,Hkv,S,P,D,Dv,q,attrs", KERNEL_CASES)
def test_kernel_vs_reference(B, Hq, Hkv, S, P, D, Dv, q, attrs):
    attrs = dict(kv_quant=q, scale=float(D) ** -0.5, **attrs)
    f = case(B=B, Hq=Hq, Hkv=Hkv, S=S, P=P, D=D, Dv=Dv, q=q, mode=attrs.get("mode", "sign"),
             eps=attrs.get("eps", 0.0))
    if not P:
        f.pop("past_kv"), f.pop("past_bits")
    assert_native_equals_reference(attrs, f)


def prompt_atol(q, f, base=2e-5) -> float:
    """Kernel vs reference on sparse-prefill prompt rows (M > 1; tests/test_sparse_prefill.py): int8 /
    int4 rows take P.V on 15-bit weights per row of each 256-key chunk (kernels/attn.h p16_row), so an
    output may move by a few steps of 1/32767 of the chunk row's largest weight times |v| — under 1 % of
    what the rows' own codes move it (a step of 1/127 of a row's largest |v|); fp32 rows run in float."""
    if q not in ("int8", "int4") or f["Q"].shape[2] < 2:
        return base
    vmax = float(np.abs(f["V"]).max())
    if "past_kv" in f and np.asarray(f["past_kv"]).size:
        vmax = max(vmax, float(np.abs(unpack_kv(f["past_kv"], f["past_bits"], f["Q"].shape[-1], f["V"].shape[-1],
                                                q)[1]).max()))
    return base + 2e-4 * vmax


def assert_native_equals_reference(attrs, feed):
    """The kernel's cache rows and key-bits rows equal the reference's, Y to 2e-5."""
    Yr, br, kr = run_ref(attrs, feed)
    Y, bits, kv = run_native(attrs, feed)
    np.testing.assert_array_equal(kv, kr)
    np.testing.assert_array_equal(bits, br)
    np.testing.assert_allclose(Y, Yr, atol=2e-5, rtol=1e-4)


@requires_native
@pytest.mark.parametrize("q", ["int8", "int4"])
@pytest.mark.parametrize("D,Dv", [(24, 40), (64, 64), (8, 16)])
def test_new_row_quantization_edges(q, D, Dv):
    """New K / V rows quantized as the reference does (codes and scales bit for bit): rounding ties
    (half to even), a row of zeros (scale 0), huge and denormal values, values beyond the level
    range's rounding, head dims with 16 codes a step and a tail (24, 40, 8)."""
    f = case(B=1, Hq=4, Hkv=2, S=4, P=30, D=D, Dv=Dv, q=q, seed=31)
    L = 127.0 if q == "int8" else 7.0
    for name, n in (("K", D), ("V", Dv)):
        x = f[name]
        # scale 1 exactly (max |x| = L at d 0), the rest k + 0.5 (half to even) and beyond +-L
        x[0, 0, 0] = np.where(np.arange(n) == 0, -L, (np.arange(n) - n / 2) + 0.5).astype(np.float32)
        x[0, 0, 1] = 0.0                                             # scale 0, codes 0
        x[0, 1, 0] = np.float32(3e38) * np.sign(np.arange(n) % 3 - 1).astype(np.float32)
        x[0, 1, 0, 1] = np.float32(1e-45)                            # denormal beside huge values
        x[0, 1, 1] = np.float32(1e-44) * (np.arange(n) % 5)          # all denormal
    attrs = dict(kv_quant=q, scale=float(D) ** -0.5, budget=0.5, window=4, sinks=1, min_context=0)
    with np.errstate(over="ignore", invalid="ignore"):  # huge keys: the reference's logits overflow
        Yr, br, kr = run_ref(attrs, f)
    Y, bits, kv = run_native(attrs, f)
    np.testing.assert_array_equal(kv, kr)
    np.testing.assert_array_equal(bits, br)


@requires_native
@pytest.mark.parametrize("P,D,q", [(1500, 64, "int8"), (1500, 64, "int4"), (300, 1032, "int8"), (2700, 64, "int8")])
def test_long_candidate_lists_with_mask(P, D, q):
    """Candidate lists longer than the attend kernel's blocks (128 rows; D 1032: fewer, the scratch
    room) and its prefetch distance, ending mid-block, with an additive mask read at the listed
    positions (-inf and finite values); past 2700: the scores in two key ranges (2 threads), the mask
    read at each range's positions."""
    attrs = dict(kv_quant=q, scale=float(D) ** -0.5, budget=0.3, window=8, sinks=2, min_context=16)
    f = case(B=1, Hq=6, Hkv=2, P=P, D=D, q=q, seed=21)
    r = np.random.default_rng(22)
    mask = r.standard_normal((1, 6, 1, P + 1)).astype(np.float32)
    mask[r.random(mask.shape) < 0.1] = -np.inf
    feed = {"Q": f["Q"], "K": f["K"], "V": f["V"], "mask": mask, "past_bits": f["past_bits"], "past_kv": f["past_kv"]}
    Yr, br, kr = run_ref(attrs, feed)
    Y, bits, kv = run_native(attrs, feed)
    np.testing.assert_array_equal(kv, kr)
    np.testing.assert_allclose(Y, Yr, atol=2e-5, rtol=1e-4)


@requires_native
def test_block_candidates_run_in_order_and_differ_from_keywise():
    """cand_block: the reference's candidate set is whole blocks of the rest (plus sinks and window)
    and the kernel attends exactly it (a mask that leaves one key per block finite in some blocks);
    the block choice changes Y against key-by-key choice (the attribute is not ignored)."""
    from custom_ops.reference.attn import select_candidates

    r = np.random.default_rng(31)
    g = r.standard_normal(1000).astype(np.float32)
    idx = select_candidates(1000, g, 0.25, 64, 4, 64, cand_block=16)
    rest = idx[(idx >= 4) & (idx < 1000 - 64)] - 4
    assert rest.size == -(-(250 - 68) // 16) * 16 and (rest % 16 == np.arange(rest.size) % 16).all()
    attrs = dict(kv_quant="int8", scale=0.125, budget=0.2, window=8, sinks=2, min_candidates=4, min_context=16)
    f = case(B=1, Hq=4, Hkv=2, P=800, seed=33)
    mask = np.zeros((1, 4, 1, 801), np.float32)
    mask[..., 100:400] = -np.inf
    mask[..., 100:400:23] = 0.0
    feed = {"Q": f["Q"], "K": f["K"], "V": f["V"], "mask": mask, "past_bits": f["past_bits"], "past_kv": f["past_kv"]}
    Yb, _, _ = run_native(dict(attrs, cand_block=12), feed)
    Yr, _, _ = run_ref(dict(attrs, cand_block=12), feed)
    np.testing.assert_allclose(Yb, Yr, atol=2e-5, rtol=1e-4)
    Yk, _, _ = run_native(attrs, feed)
    assert np.abs(Yb - Yk).max() > 1e-3


@requires_native
def test_carried_state_across_steps_equals_one_call():
    """Decode steps feeding present_* back as past_* equal one call over the same tokens."""
    attrs = dict(kv_quant="int8", scale=0.125, budget=0.3, window=16, min_context=32)
    f = case(P=200, S=1, seed=3)
    r = np.random.default_rng(4)
    s = custom_ops.session(kv_model(attrs), threads=1)
    past_kv, past_bits = f["past_kv"], f["past_bits"]
    for step in range(5):
        feed = {"Q": r.standard_normal((1, 9, 1, 64), dtype=np.float32),
                "K": r.standard_normal((1, 3, 1, 64), dtype=np.float32),
                "V": r.standard_normal((1, 3, 1, 64), dtype=np.float32), "past_bits": past_bits, "past_kv": past_kv}
        Y, past_bits, past_kv = s.run(None, feed)
        Yr, br, kr = run_ref(attrs, feed)
        np.testing.assert_allclose(Y, Yr, atol=2e-5)
        assert past_kv.shape[2] == 201 + step and (past_kv == kr).all() and (past_bits == br).all()


@requires_native
def test_shared_buffer_with_seqlens_and_padding():
    """seqlens_k: a buffer of capacity Tc holds sequences of different lengths (batch 2); present
    has the buffer's shape, the new row of each sequence lands at its own position, padding rows
    are untouched, and binding past and present to one OrtValue (IOBinding) gives the same Y."""
    import onnxruntime as ort

    attrs = dict(kv_quant="int8", scale=0.125, budget=0.25, window=32, min_context=64)
    cap = 512
    f = case(B=2, Hq=4, Hkv=2, P=cap, S=1, D=32, seed=5)
    f["seqlens_k"] = np.array([300, 450], np.int32)          # totals 301 and 451 (new row at 300 / 450)
    Yr, br, kr = run_ref(attrs, f)
    Y, bits, kv = run_native(attrs, f)
    np.testing.assert_allclose(Y, Yr, atol=2e-5)
    assert kv.shape == f["past_kv"].shape and (kv == kr).all() and (bits == br).all()
    assert (kv[0, :, 301:] == f["past_kv"][0, :, 301:]).all()
    sess = custom_ops.session(kv_model(attrs, use=tuple(f)), threads=2)
    kv_buf = f["past_kv"].copy()
    bits_buf = f["past_bits"].copy()
    b = sess.io_binding()
    ov_kv, ov_bits = ort.OrtValue.ortvalue_from_numpy(kv_buf), ort.OrtValue.ortvalue_from_numpy(bits_buf)
    for n in ("Q", "K", "V", "seqlens_k"):
        b.bind_cpu_input(n, f[n])
    b.bind_ortvalue_input("past_kv", ov_kv)
    b.bind_ortvalue_input("past_bits", ov_bits)
    b.bind_output("Y")
    b.bind_ortvalue_output("bits", ov_bits)
    b.bind_ortvalue_output("kv", ov_kv)
    sess.run_with_iobinding(b)
    np.testing.assert_allclose(b.get_outputs()[0].numpy(), Yr, atol=2e-5)
    assert (ov_kv.numpy() == kr).all() and (ov_bits.numpy() == br).all()


@requires_native
def test_padded_first_prompt_rows_are_zero():
    attrs = dict(kv_quant="int4", scale=0.25)
    f = case(B=2, Hq=2, Hkv=1, P=0, S=6, D=16, seed=6)
    f.pop("past_kv"), f.pop("past_bits")
    f["seqlens_k"] = np.array([5, 2], np.int32)               # lengths 6 and 3 (rows 3..5 of b=1: padding)
    Y, bits, kv = run_native(attrs, f)
    Yr, br, kr = run_ref(attrs, f)
    np.testing.assert_allclose(Y, Yr, atol=2e-5)
    assert (Y[1, :, 3:] == 0).all() and (kv == kr).all()


@requires_native
def test_exact_at_full_budget_matches_dense_and_gqa_shapes():
    """budget 1 (exact): dense attention over the dequantized cache to 1e-5, for GQA ratios 1, 3, 8."""
    for Hq, Hkv in ((3, 3), (9, 3), (8, 1)):
        f = case(Hq=Hq, Hkv=Hkv, P=257, D=64)
        Y, bits, kv = run_native(dict(kv_quant="int8", scale=0.125, budget=1.0), f)
        np.testing.assert_allclose(Y, dense_over_cache(f, kv, bits, 64, 64, "int8", 0.125), atol=INT16_Q_ATOL)
        f32 = case(Hq=Hq, Hkv=Hkv, P=257, D=64, q="fp32")
        Y, bits, kv = run_native(dict(kv_quant="fp32", scale=0.125, budget=1.0), f32)
        np.testing.assert_allclose(Y, dense_over_cache(f32, kv, bits, 64, 64, "fp32", 0.125), atol=1e-5)


# fp32 cache rows (kv_attend_f32: K / V read in place, heads in groups of 3 x 4 keys, masked tails
# for head dims not multiples of 8; attend tasks: one per row on one thread, equal chunks otherwise)
FP32_CASES = [
    # (B, Hq, Hkv, S, P, D, Dv, seqlens, attrs)
    (1, 9, 3, 1, 128, 64, 64, None, dict()),                          # SmolLM2 decode
    (1, 9, 3, 1, 1337, 64, 64, None, dict()),                         # odd past, several chunks on 2 threads
    (1, 8, 2, 1, 77, 12, 20, None, dict()),                           # rep 4 (3 + 1), D / Dv not multiples of 8
    (1, 10, 2, 1, 301, 36, 9, None, dict()),                          # rep 5 (3 + 2), Dv < 16 with a tail
    (1, 3, 3, 1, 65, 5, 3, None, dict()),                             # rep 1, dims below 8
    (1, 6, 2, 7, 93, 64, 64, None, dict()),                           # M > 1 prefill continuation
    (1, 4, 2, 6, 0, 24, 24, None, dict()),                            # first prompt, M > 1
    (2, 6, 2, 1, 700, 40, 40, [650, 123], dict()),                    # B = 2, shared buffer, padding
    (2, 6, 2, 3, 400, 20, 28, [399, 1], dict()),                      # B = 2, M > 1, a padded row
    (1, 6, 2, 1, 999, 64, 64, None, dict(softcap=4.0, local_window=257)),
]


@requires_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("B,Hq,Hkv,S,P,D,Dv,seqlens,attrs", FP32_CASES)
def test_fp32_rows_vs_reference(B, Hq, Hkv, S, P, D, Dv, seqlens, attrs, threads):
    """fp32 cache at full budget: the reference's Y (and dense attention over the cache) to 1e-5, the
    cache rows bit-exact, on 1 and 2 threads; repeated calls (the kernel learns the pool's width after
    its first calls and then splits the keys differently) give the same Y."""
    attrs = dict(kv_quant="fp32", scale=float(D) ** -0.5, budget=1.0, **attrs)
    f = case(B=B, Hq=Hq, Hkv=Hkv, S=S, P=P, D=D, Dv=Dv, q="fp32", seed=P + D)
    if not P:
        f.pop("past_kv"), f.pop("past_bits")
    if seqlens is not None:
        f["seqlens_k"] = np.array(seqlens, np.int32)
    Yr, br, kr = run_ref(attrs, f)
    s = custom_ops.session(kv_model(attrs, use=tuple(f)), threads=threads)
    for _ in range(10):
        Y, bits, kv = s.run(None, f)
        np.testing.assert_array_equal(kv, kr)
        np.testing.assert_array_equal(bits, br)
        np.testing.assert_allclose(Y, Yr, atol=1e-5, rtol=1e-5)
    if not attrs.get("softcap") and not attrs.get("local_window"):
        total = None if seqlens is None else [x + 1 for x in seqlens]
        np.testing.assert_allclose(Y, dense_over_cache(f, kv, bits, D, Dv or D, "fp32", attrs["scale"], total=total),
                                   atol=1e-5)


@requires_native
def test_fp32_rows_mask_nonunit_scales_and_extremes():
    """Per-head additive mask with -inf stretches (a head fully masked: Y = 0), cache rows whose K / V
    scale words are not 1 (the reference multiplies them in), and large logits (online-softmax
    rescaling across blocks and chunks)."""
    f = case(B=1, Hq=6, Hkv=2, P=600, D=40, q="fp32", seed=21)
    kv = f["past_kv"].copy().view(np.float32)
    sc = f["past_bits"].copy().view(np.float32)
    r = np.random.default_rng(22)
    sc[..., -2] = r.uniform(0.5, 2.0, sc.shape[:-1])                    # K scale word
    sc[..., -1] = r.uniform(0.5, 2.0, sc.shape[:-1])                    # V scale word
    kv[0, 1, 300:340, :40] *= 30.0                                       # a block of dominant keys
    f["past_kv"] = kv.view(np.int32)
    f["past_bits"] = sc.view(np.int32)
    mask = np.zeros((1, 6, 1, 601), np.float32)
    mask[0, 0, :, 100:400] = -np.inf
    mask[0, 4] = -np.inf
    f["mask"] = mask
    attrs = dict(kv_quant="fp32", scale=40 ** -0.5, budget=1.0)
    Yr, _, kr = run_ref(attrs, f)
    for threads in (1, 2):
        s = custom_ops.session(kv_model(attrs, use=tuple(f)), threads=threads)
        for _ in range(10):
            Y, _, kv_out = s.run(None, f)
            np.testing.assert_allclose(Y, Yr, atol=1e-5, rtol=1e-5)
        assert (Y[0, 4] == 0).all() and (kv_out == kr).all()


def test_reference_query_int16():
    """The integer query of the int8 / int4 q·k: levels ±32767 at max|q|, zero and non-finite heads."""
    from custom_ops.reference.attn import QK_LEVELS, query_int16
    q = np.array([0.5, -2.0, 1e-3, 1.0], np.float32)
    qi, qs = query_int16(q)
    assert qi.tolist() == [8192, -QK_LEVELS, 16, 16384] and qs == np.float32(2.0 / QK_LEVELS)
    assert np.abs(qi * qs - q).max() <= qs / 2 * 1.0001
    assert query_int16(np.zeros(4, np.float32))[1] == 0
    assert np.isnan(query_int16(np.array([1.0, np.inf], np.float32))[1])


def _isa_worker() -> None:
    # SmolLM2 shapes, then 5 query heads per KV head with head dims 40 / 24 (8 mod 16)
    shapes = [dict(P=500), dict(Hq=10, Hkv=2, P=601, D=40, Dv=24)]
    if sys.argv[2] == "fp32":  # head dims not multiples of 8 (masked tails), rep 4
        shapes += [dict(Hq=8, Hkv=2, P=333, D=20, Dv=13), dict(Hq=3, Hkv=3, P=70, D=5, Dv=7)]
    for shape in shapes:
        f = case(seed=8, q=sys.argv[2], **shape)
        for budget in ((0.25, 1.0) if sys.argv[2] == "fp32" else (0.25,)):
            attrs = dict(kv_quant=sys.argv[2], scale=0.125, budget=budget, window=32, min_context=64)
            Y, bits, kv = run_native(attrs, f)
            Yr, _, kr = run_ref(attrs, f)
            np.testing.assert_allclose(Y, Yr, atol=2e-5)
            assert (kv == kr).all()
    print("ok", custom_ops.isa())


@requires_native
@pytest.mark.parametrize("isa", ["scalar", "avx2"])
@pytest.mark.parametrize("q", ["int8", "int4", "fp32"])
def test_isa_paths(isa, q):
    env = dict(os.environ, ORTLEAN_ISA=isa)
    code = f"import sys; sys.argv=['x', 'w', '{q}']; sys.path.insert(0, {str(ROOT / 'tests')!r}); " \
           "import test_packed_gqa as t; t._isa_worker()"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == isa


@requires_native
@pytest.mark.parametrize("attrs,needle", [
    (dict(kv_quant="int9"), "kv_quant"),
    (dict(kv_quant="int8", mix=0.5), "mix"),
    (dict(kv_quant="int8", k_layout="bhdt"), "k_layout"),
    (dict(kv_quant="int8", local_window=-2), "local_window"),
    (dict(kv_quant="int8", softcap=-1.0), "softcap"),
    (dict(kv_quant="int8", cand_block=0), "cand_block"),
    (dict(kv_quant="none", cand_block=16), "cand_block"),
])
def test_invalid_node_fails_with_name(attrs, needle):
    with pytest.raises(Exception) as e:
        custom_ops.session(kv_model(attrs, name="bad_kv_node"))
    assert "bad_kv_node" in str(e.value) and needle in str(e.value)


@requires_native
def test_bad_shapes_are_refused():
    f = case(P=10, D=12)  # D not a multiple of 8
    with pytest.raises(Exception, match="multiples of 8"):
        run_native(dict(kv_quant="int8"), f)
    f = case(P=10)
    f["past_bits"] = f["past_bits"][:, :, :5]
    with pytest.raises(Exception, match="past_bits"):
        run_native(dict(kv_quant="int8"), f)
    f = case(P=10)
    f["past_bits"] = f["past_bits"][..., :-2]  # the key bits without the rows' scales (the old width)
    with pytest.raises(Exception, match=r"past_bits .* must be \[B, Hkv, P, W\] = \[1, 3, 10, 5\]"):
        run_native(dict(kv_quant="int8"), f)


@requires_native
def test_past_kv_without_past_bits_is_refused():
    """The cached rows' scales live in their key-bits rows: past_kv with rows needs past_bits (kernel and
    reference both refuse, naming the missing input), an empty past_kv does not."""
    f = case(P=10)
    f.pop("past_bits")
    with pytest.raises(Exception, match="past_bits is missing"):
        run_native(dict(kv_quant="int8"), f)
    with pytest.raises(ValueError, match="past_bits is missing"):
        run_ref(dict(kv_quant="int8"), f)
    f = case(P=0)
    f.pop("past_bits")
    Y, bits, kv = run_native(dict(kv_quant="int8", scale=0.125), f)
    Yr, br, kr = run_ref(dict(kv_quant="int8", scale=0.125), f)
    np.testing.assert_allclose(Y, Yr, atol=INT16_Q_ATOL)
    assert (bits == br).all() and (kv == kr).all()


# --------------------------------------------------------------------------- GroupQueryAttention's layout
def gqa_case(B, Hq, Hkv, S, P, D, Dv, q, *, packed, rot_half, seqlens=None, seed=0):
    """Feeds in GroupQueryAttention's layout: Q/K/V [B, S, H·D] (or Q packed), a past cache of P rows,
    rotary caches of rot_half columns (0: none)."""
    r = np.random.default_rng(seed)
    f = case(B=B, Hq=Hq, Hkv=Hkv, S=S, P=P, D=D, Dv=Dv, q=q, seed=seed)
    flat = {n: f[n].transpose(0, 2, 1, 3).reshape(B, S, -1) for n in ("Q", "K", "V")}
    feed = ({"Q": np.concatenate([flat["Q"], flat["K"], flat["V"]], -1)} if packed else flat)
    if P:
        feed.update(past_bits=f["past_bits"], past_kv=f["past_kv"])
    if seqlens is not None:
        feed["seqlens_k"] = np.asarray(seqlens, np.int32)
    if rot_half:
        ang = r.uniform(0, 2 * np.pi, (P + S + 8, rot_half)).astype(np.float32)
        feed.update(cos_cache=np.cos(ang), sin_cache=np.sin(ang))
    return feed


def run_ref_op(attrs, feed):
    from custom_ops.reference.attn import op

    f = dict(feed)
    return op(f.pop("Q"), f.pop("K", None), f.pop("V", None), f.pop("mask", None), f.pop("past_bits", None),
              f.pop("past_kv", None), f.pop("seqlens_k", None), f.pop("cos_cache", None), f.pop("sin_cache", None),
              **attrs)


GQA_LAYOUT_CASES = [  # B, Hq, Hkv, S, P, D, Dv, q, packed, rot_half, interleaved, seqlens, extra attrs
    (1, 9, 3, 1, 40, 64, 64, "int8", True, 32, 0, [40], dict(budget=1.0)),            # SmolLM2 decode step
    (1, 9, 3, 1, 300, 64, 64, "int8", True, 32, 0, [300], dict(budget=0.25, window=8, min_context=16)),
    (2, 6, 2, 5, 12, 32, 32, "fp32", True, 8, 1, [16, 13], dict(budget=1.0)),         # r < D, interleaved, padding
    (2, 4, 1, 7, 0, 16, 24, "int8", False, 8, 0, [6, 3], dict(budget=1.0)),           # separate K/V, Dv != D, prefill
    (1, 4, 2, 3, 20, 32, 32, "int4", False, 0, 0, None, dict(budget=1.0, local_window=6)),  # no rotary
    # fp32 prompt rows (the blocked-GEMM prefill): 45 rows = a full and a partial tile of 32, padding,
    # D 24; a window, softcap and no past; budget 0 (the --attn-exact node)
    (2, 6, 2, 45, 30, 24, 24, "fp32", True, 8, 0, [74, 50], dict(budget=0.0)),
    (1, 4, 1, 70, 0, 40, 40, "fp32", False, 0, 0, None, dict(budget=1.0, local_window=20, softcap=4.0)),
    (2, 8, 2, 33, 5, 32, 32, "fp32", False, 16, 1, [37, 6], dict(budget=1.0)),
    # the same prompt path over int8 / int4 rows (query_int16 logits, V scales folded into P)
    (2, 6, 2, 45, 30, 24, 24, "int8", True, 8, 0, [74, 50], dict(budget=0.0)),
    (1, 9, 3, 70, 100, 64, 64, "int4", True, 32, 0, None, dict(budget=1.0, local_window=50, softcap=4.0)),
    (1, 4, 2, 40, 0, 16, 24, "int8", False, 8, 1, None, dict(budget=0.25)),          # prompt rows stay exact
]


@requires_native
@pytest.mark.parametrize("B,Hq,Hkv,S,P,D,Dv,q,packed,rot_half,inter,seqlens,extra", GQA_LAYOUT_CASES)
def test_gqa_layout_kernel_vs_reference(B, Hq, Hkv, S, P, D, Dv, q, packed, rot_half, inter, seqlens, extra):
    """num_heads > 0: the node reads GQA's own inputs (packed or separate Q/K/V, rotary from cos/sin
    caches at pos0 + m, padding rows unrotated) and writes Y [B, S, Hq·Dv]: the kernel equals the
    reference (which rotates and transposes in numpy, then runs the cache mode), for prefill and
    decode rows, and equals the [B, H, S, D] node on the same (rotated) values."""
    if packed:
        Dv = D
    attrs = dict(kv_quant=q, scale=float(D) ** -0.5, num_heads=Hq, kv_num_heads=Hkv, rotary_interleaved=inter, **extra)
    feed = gqa_case(B, Hq, Hkv, S, P, D, Dv, q, packed=packed, rot_half=rot_half, seqlens=seqlens)
    Yr, br, kr = run_ref_op(attrs, feed)
    Y, bits, kv = run_native(attrs, feed)
    assert Y.shape == (B, S, Hq * Dv)
    np.testing.assert_array_equal(kv, kr)
    np.testing.assert_array_equal(bits, br)
    np.testing.assert_allclose(Y, Yr, atol=2e-5, rtol=1e-4)
    if not rot_half:   # without rotary the layouts differ only by the transposes
        f4 = {n: feed[n].reshape(B, S, H, -1).transpose(0, 2, 1, 3).copy()
              for n, H in (("Q", Hq), ("K", Hkv), ("V", Hkv)) if n in feed}
        f4.update({k: v for k, v in feed.items() if k not in ("Q", "K", "V")})
        core = {k: v for k, v in attrs.items() if k not in ("num_heads", "kv_num_heads", "rotary_interleaved")}
        Y4, _, _ = run_native(core, f4)
        np.testing.assert_array_equal(Y, Y4.transpose(0, 2, 1, 3).reshape(B, S, -1))


@requires_native
@pytest.mark.parametrize("attrs,needle", [
    (dict(num_heads=4), "kv_num_heads"),
    (dict(kv_quant="none", num_heads=4, kv_num_heads=2), "kv_quant"),
    (dict(num_heads=6, kv_num_heads=4), "multiple"),
])
def test_gqa_layout_invalid_node_fails_with_name(attrs, needle):
    attrs = {"kv_quant": "int8", **attrs}
    with pytest.raises(Exception) as e:
        custom_ops.session(kv_model(attrs, name="bad_gqa_node"))
    assert "bad_gqa_node" in str(e.value) and needle in str(e.value)


@requires_native
def test_gqa_layout_bad_inputs_are_refused():
    attrs = dict(kv_quant="int8", num_heads=9, kv_num_heads=3)
    f = gqa_case(1, 9, 3, 1, 10, 64, 64, "int8", packed=True, rot_half=32, seqlens=[10])
    bad = {**f, "Q": f["Q"][..., :-8]}
    with pytest.raises(Exception, match="packed QKV"):
        run_native(attrs, bad)
    with pytest.raises(Exception, match="rotary caches"):
        run_native(attrs, {**f, "seqlens_k": np.array([70], np.int32)})   # position 70 of 19 rows
    with pytest.raises(Exception, match="cos_cache"):
        run_native(attrs, {**f, "cos_cache": f["cos_cache"][:, :7]})


# --------------------------------------------------------------------------- GroupQueryAttention → PackedAttention
def _fused(family):
    import onnx_ir as ir

    import tiny_hf
    from rewriter.fuse import fuse_decoder

    fused, _ = fuse_decoder(ir.load(str(tiny_hf.models()[family] / "model.onnx")))
    return fused


def _rewrite_gqa(model, **cfg):
    from rewriter.backends import packed_attention as attn

    c = attn.AttnConfig(enabled=True, **cfg)
    c.validate()
    recs = attn.apply_gqa(model, c)
    return model, recs


def _save(model, path):
    import onnx_ir as ir

    ir.save(model, str(path))
    return str(path)


def _decode_logits(sess, ids_prompt, steps, batch_mask=None):
    from custom_ops import runtime

    io = runtime.ModelIO.from_session(sess)
    out = runtime.run(sess, io, runtime.feeds(io, ids_prompt))
    logits = [out[io.logits_name][:, -1]]
    past, plen = io.next_state(out), ids_prompt.shape[1]
    for t in steps.T:
        out = runtime.run(sess, io, runtime.feeds(io, t[:, None], past, plen))
        logits.append(out[io.logits_name][:, -1])
        past, plen = io.next_state(out), plen + 1
    return np.stack(logits, 1), past


@requires_native
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gqa_replaced_exact_at_full_budget(tmp_path, family):
    """Fused tiny Llama (head dim 16) / Qwen2 (head dim 32, biases): GroupQueryAttention →
    PackedAttention (fp32 rows, budget 1) gives the same logits to 1e-5 over a prompt and decode
    steps; the GQA cache I/O is replaced by .kv / .key_bits state."""
    import onnxruntime as ort

    g = _fused(family)
    src = _save(g, tmp_path / "gqa.onnx")
    m, recs = _rewrite_gqa(_fused(family), kv_quant="fp32", budget=1.0)
    assert [r["backend"] for r in recs] == ["packed_attention"] * 2, recs
    assert not any(n.op_type == "GroupQueryAttention" for n in m.graph)
    # one PackedAttention in place of each GroupQueryAttention, on its own inputs: no nodes around it
    assert sorted(n.op_type for n in m.graph) == sorted(
        "PackedAttention" if n.op_type == "GroupQueryAttention" else n.op_type for n in g.graph), \
        [n.op_type for n in m.graph]
    names = {i.name for i in m.graph.inputs}
    assert "past_key_values.0.kv" in names and "past_key_values.0.key" not in names
    dst = _save(m, tmp_path / "packed.onnx")
    r = np.random.default_rng(0)
    prompt, steps = r.integers(0, 256, (1, 23)), r.integers(0, 256, (1, 6))
    ref, _ = _decode_logits(ort.InferenceSession(src, providers=["CPUExecutionProvider"]), prompt, steps)
    got, past = _decode_logits(custom_ops.session(dst, threads=2), prompt, steps)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
    assert past["past_key_values.1.kv"].shape[2] == 23 + 6


@requires_native
def test_gqa_replaced_int8_close_and_shared_buffer(tmp_path):
    """int8 rows: logits close to GQA's; the shared-buffer decode loop (runtime.shared_kv, one
    buffer per state, capacity > length) gives the same logits as the growing-state loop."""
    import onnxruntime as ort

    from custom_ops import runtime
    from custom_ops.runtime.shared_kv import SharedKV

    src = _save(_fused("qwen2"), tmp_path / "gqa.onnx")
    r = np.random.default_rng(1)
    prompt, steps = r.integers(0, 256, (1, 40)), r.integers(0, 256, (1, 5))
    ref, _ = _decode_logits(ort.InferenceSession(src, providers=["CPUExecutionProvider"]), prompt, steps)
    exact8, _ = _rewrite_gqa(_fused("qwen2"), kv_quant="int8", budget=1.0)
    got8, _ = _decode_logits(custom_ops.session(_save(exact8, tmp_path / "p8.onnx"), threads=1), prompt, steps)
    assert np.abs(got8 - ref).max() < 0.02 * np.abs(ref).max()       # int8 rows: quantization error only
    m, _ = _rewrite_gqa(_fused("qwen2"), kv_quant="int8", budget=0.5, min_context=8, window=4, sinks=2,
                        min_candidates=4)
    sess = custom_ops.session(_save(m, tmp_path / "packed.onnx"), threads=1)
    got, _ = _decode_logits(sess, prompt, steps)
    kv = SharedKV(sess, runtime.ModelIO.from_session(sess), max_len=64)
    shared = [kv.prefill(prompt)[:, -1]] + [kv.step(t[:, None])[:, -1] for t in steps.T]
    np.testing.assert_allclose(np.stack(shared, 1), got, atol=1e-5)


@requires_native
def test_shared_kv_binds_its_own_output_arrays(tmp_path):
    """SharedKV binds the non-cache outputs to arrays of its own per tokens-per-run (their shapes learned
    from the first such run): every step returns fresh arrays (a kept step's logits are not overwritten by
    the next), equal to the growing-state loop's; an output whose shape changes with the context (here the
    attention mask, echoed) makes that run fall back to ORT-allocated outputs, with the same logits."""
    import onnx
    from onnx import helper

    from custom_ops import runtime
    from custom_ops.runtime.shared_kv import SharedKV

    m, _ = _rewrite_gqa(_fused("qwen2"), kv_quant="int8", budget=0.5, min_context=8, window=4, sinks=2,
                        min_candidates=4)
    r = np.random.default_rng(3)
    prompt, steps = r.integers(0, 256, (1, 20)), r.integers(0, 256, (1, 4))
    sess = custom_ops.session(_save(m, tmp_path / "packed.onnx"), threads=1)
    want, _ = _decode_logits(sess, prompt, steps)
    kv = SharedKV(sess, runtime.ModelIO.from_session(sess), max_len=32)
    first = kv.prefill(prompt)
    outs = [kv.step(t[:, None]) for t in steps.T]
    assert kv._out_bufs[1] is not None and kv._bound_t == 1     # decode steps write into bound arrays
    assert not any(np.shares_memory(a, b) for i, a in enumerate(outs) for b in outs[i + 1:])
    assert not any(np.shares_memory(a, kv._out_bufs[1]["logits"]) for a in outs)
    np.testing.assert_allclose(np.concatenate([first[:, -1:]] + outs, axis=1), want, atol=1e-5)

    p = onnx.load(str(tmp_path / "packed.onnx"))
    mask_type = next(i.type.tensor_type.elem_type for i in p.graph.input if i.name == "attention_mask")
    p.graph.node.append(helper.make_node("Identity", ["attention_mask"], ["mask_seen"]))
    p.graph.output.append(helper.make_tensor_value_info("mask_seen", mask_type, ["batch", "total"]))
    onnx.save(p, str(tmp_path / "echo.onnx"))
    sess = custom_ops.session(str(tmp_path / "echo.onnx"), threads=1)
    kv = SharedKV(sess, runtime.ModelIO.from_session(sess), max_len=32)
    kv.prefill(prompt)
    got = []
    for j, t in enumerate(steps.T):
        o = kv._run(t[:, None])
        assert o["mask_seen"].shape == (1, 21 + j)                  # the context's length, every step
        got.append(o["logits"])
    assert kv._out_bufs[1] is None and kv._bound_t is None        # shapes did not hold: ORT allocates
    np.testing.assert_allclose(np.concatenate(got, axis=1), want[:, 1:], atol=1e-5)


@requires_native
def test_shared_kv_reuses_its_bound_input_arrays(tmp_path):
    """Decode-sized runs write input_ids and position_ids into arrays bound once per tokens-per-run:
    runs of 1, 2, 1 and 3 tokens, a new prompt (a longer run, bound anew), then single steps again give
    the logits of the growing-state loop on the same tokens, and the arrays stay the ones first bound."""
    from custom_ops import runtime
    from custom_ops.runtime.shared_kv import SharedKV

    m, _ = _rewrite_gqa(_fused("qwen2"), kv_quant="fp32", budget=0.0)
    r = np.random.default_rng(4)
    sess = custom_ops.session(_save(m, tmp_path / "packed.onnx"), threads=1)
    kv = SharedKV(sess, runtime.ModelIO.from_session(sess), max_len=48)
    for prompt in (r.integers(0, 256, (1, 12)), r.integers(0, 256, (1, 15))):
        toks = r.integers(0, 256, (1, 9))
        want, _ = _decode_logits(sess, prompt, toks)  # the prompt's last logits, then one a token
        got = [kv.prefill(prompt)[:, -1:]]
        kept = {t: {k: v for k, v in b.items()} for t, b in kv._in_bufs.items()}
        j = 0
        for n in (1, 2, 1, 3, 1, 1):
            got.append(kv.step(toks[:, j:j + n]))
            j += n
            # the graph reads its positions from the mask (GroupQueryAttention): the bound array is checked
            np.testing.assert_array_equal(kv._in_bufs[n]["position_ids"], np.arange(kv.length - n, kv.length)[None])
        assert all(kv._in_bufs[t][k] is v for t, b in kept.items() for k, v in b.items())
        assert sorted(kv._in_bufs) == [1, 2, 3]
        np.testing.assert_allclose(np.concatenate(got, axis=1), want, atol=1e-5)


@requires_native
@pytest.mark.parametrize("which", ["gqa", "packed"])
def test_shared_kv_chunked_prefill(tmp_path, which):
    """SharedKV.prefill(chunk=c): the prompt in runs of c tokens (the last one short), each after the
    cached ones, gives the last chunk's logits and the cache one run gives (GroupQueryAttention, and
    PackedAttention int8 rows with its candidate path on), and the decode steps after it agree."""
    from custom_ops import runtime
    from custom_ops.runtime.shared_kv import SharedKV

    if which == "gqa":
        path = _save(_fused("qwen2"), tmp_path / "gqa.onnx")
    else:
        m, _ = _rewrite_gqa(_fused("qwen2"), kv_quant="int8", budget=0.5, min_context=8, window=4, sinks=2,
                            min_candidates=4)
        path = _save(m, tmp_path / "packed.onnx")
    sess = custom_ops.session(path, threads=1)
    io = runtime.ModelIO.from_session(sess)
    r = np.random.default_rng(3)
    prompt, steps = r.integers(0, 256, (1, 47)), r.integers(0, 256, (1, 4))
    one, chunked = SharedKV(sess, io, max_len=64), SharedKV(sess, io, max_len=64)
    full = one.prefill(prompt)
    last = chunked.prefill(prompt, chunk=10)
    assert last.shape[1] == 7 and chunked.length == one.length == 47
    np.testing.assert_allclose(last, full[:, -7:], atol=1e-5)
    for name in one.arrays:
        np.testing.assert_allclose(chunked.arrays[name][:, :, :47], one.arrays[name][:, :, :47], atol=1e-5)
    for t in steps.T:
        np.testing.assert_allclose(chunked.step(t[:, None]), one.step(t[:, None]), atol=1e-5)


@requires_native
def test_shared_kv_adopts_given_buffers(tmp_path):
    """SharedKV(arrays=, length=): a cache prefilled into batch-row slices of SharedKV.alloc's buffers
    decodes in a batch SharedKV over the same buffers (no copy) as each row's own SharedKV does;
    buffers of the wrong shape, dtype or layout are refused naming the state."""
    from custom_ops import runtime
    from custom_ops.runtime.shared_kv import SharedKV, SharedKVError

    m, _ = _rewrite_gqa(_fused("qwen2"), kv_quant="int8", budget=0.5, min_context=8, window=4, sinks=2,
                        min_candidates=4)
    sess = custom_ops.session(_save(m, tmp_path / "packed.onnx"), threads=1)
    io = runtime.ModelIO.from_session(sess)
    r = np.random.default_rng(5)
    prompts, steps = r.integers(0, 256, (2, 30)), r.integers(0, 256, (2, 3))
    bufs = SharedKV.alloc(io, 40, batch=2)
    want = []
    for i in range(2):
        SharedKV(sess, io, max_len=40, arrays={k: v[i:i + 1] for k, v in bufs.items()}).prefill(prompts[i:i + 1])
        own = SharedKV(sess, io, max_len=40)
        own.prefill(prompts[i:i + 1])
        want.append(np.concatenate([own.step(t[None, None]) for t in steps[i]], axis=1))
    kv = SharedKV(sess, io, max_len=40, batch=2, arrays=bufs, length=30)
    assert all(kv.arrays[k] is bufs[k] for k in bufs)
    got = np.concatenate([kv.step(steps[:, j:j + 1]) for j in range(3)], axis=1)
    np.testing.assert_allclose(got, np.concatenate(want), atol=1e-5)
    name = next(iter(bufs))
    with pytest.raises(SharedKVError, match=f"buffer for {name}"):
        SharedKV(sess, io, max_len=41, batch=2, arrays=bufs)
    with pytest.raises(SharedKVError, match="strided"):
        SharedKV(sess, io, max_len=40, batch=2, arrays={k: np.asfortranarray(v) for k, v in bufs.items()})
    with pytest.raises(SharedKVError, match="length 41"):
        SharedKV(sess, io, max_len=40, batch=2, arrays=bufs, length=41)


def _gqa_layer_model(Hq, Hkv, D, *, window=-1, softcap=0.0, packed=True, rotary=True, max_pos=256):
    """One GroupQueryAttention node as the genai builder writes it (packed QKV, rotary inside),
    with its own seqlens_k / total_sequence_length inputs."""
    from onnx import numpy_helper

    r = np.random.default_rng(7)
    inv = 1.0 / (10000 ** (np.arange(0, D, 2) / D))
    ang = np.arange(max_pos)[:, None] * inv[None]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    ins = [helper.make_tensor_value_info("qkv", TP.FLOAT, ["batch_size", "sequence_length", (Hq + 2 * Hkv) * D]),
           helper.make_tensor_value_info("past_key_values.0.key", TP.FLOAT, ["batch_size", Hkv, "past_sequence_length", D]),
           helper.make_tensor_value_info("past_key_values.0.value", TP.FLOAT, ["batch_size", Hkv, "past_sequence_length", D]),
           helper.make_tensor_value_info("seqlens_k", TP.INT32, ["batch_size"]),
           helper.make_tensor_value_info("total_sequence_length", TP.INT32, [])]
    outs = [helper.make_tensor_value_info("y", TP.FLOAT, None),
            helper.make_tensor_value_info("present.0.key", TP.FLOAT, ["batch_size", Hkv, "total_sequence_length", D]),
            helper.make_tensor_value_info("present.0.value", TP.FLOAT, ["batch_size", Hkv, "total_sequence_length", D])]
    attrs = dict(num_heads=Hq, kv_num_heads=Hkv, do_rotary=int(rotary), local_window_size=window)
    if softcap:
        attrs["softcap"] = softcap
    node = helper.make_node("GroupQueryAttention", ["qkv", "", "", "past_key_values.0.key", "past_key_values.0.value",
                                                    "seqlens_k", "total_sequence_length", "cos_cache", "sin_cache"],
                            ["y", "present.0.key", "present.0.value"], domain="com.microsoft",
                            name="/model/layers.0/attn/GroupQueryAttention", **attrs)
    g = helper.make_graph([node], "g", ins, outs, initializer=[numpy_helper.from_array(cos, "cos_cache"),
                                                               numpy_helper.from_array(sin, "sin_cache")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    del r
    return m


@requires_native
@pytest.mark.parametrize("Hq,Hkv,D,window,softcap", [(6, 2, 48, 7, 0.0), (4, 1, 32, -1, 3.0), (8, 4, 16, 20, 0.0)])
def test_gqa_layer_semantics(tmp_path, Hq, Hkv, D, window, softcap):
    """One GQA layer (packed QKV, rotary inside, sliding window, softcap, head dims 48/32/16, batch 2
    with right padding in the prompt, then decode steps of different lengths per sequence) →
    PackedAttention fp32 at full budget: the same outputs to 1e-5."""
    import onnx
    import onnx_ir as ir
    import onnxruntime as ort

    if D % 16:
        pytest.skip("ORT's CPU GroupQueryAttention needs head_dim % 16 == 0")
    m = _gqa_layer_model(Hq, Hkv, D, window=window, softcap=softcap)
    onnx.save(m, tmp_path / "gqa.onnx")
    lean, recs = _rewrite_gqa(ir.from_proto(m), kv_quant="fp32", budget=1.0)
    assert recs[0]["backend"] == "packed_attention", recs
    dst = _save(lean, tmp_path / "packed.onnx")
    gq = ort.InferenceSession(str(tmp_path / "gqa.onnx"), providers=["CPUExecutionProvider"])
    pa = custom_ops.session(dst, threads=2)
    r = np.random.default_rng(2)
    B, S, W = 2, 11, (Hq + 2 * Hkv) * D
    lens = np.array([11, 8])
    qkv = r.standard_normal((B, S, W), dtype=np.float32)
    f = {"qkv": qkv, "seqlens_k": (lens - 1).astype(np.int32), "total_sequence_length": np.array(S, np.int32)}
    g_out = gq.run(None, {**f, "past_key_values.0.key": np.zeros((B, Hkv, 0, D), np.float32),
                          "past_key_values.0.value": np.zeros((B, Hkv, 0, D), np.float32)})
    p_out = pa.run(None, {"qkv": qkv, "seqlens_k": f["seqlens_k"], "total_sequence_length": f["total_sequence_length"],
                          "past_key_values.0.key_bits": np.zeros((B, Hkv, 0, cache_bits_words(D)), np.int32),
                          "past_key_values.0.kv": np.zeros((B, Hkv, 0, kv_row_words(D, D, "fp32")), np.int32)})
    for b in range(B):  # padding rows are unspecified in GQA (0 here)
        np.testing.assert_allclose(p_out[0][b, :lens[b]], g_out[0][b, :lens[b]], atol=1e-5)
    pk, pv, pbits, pkv = g_out[1], g_out[2], p_out[1], p_out[2]
    for step in range(4):  # decode: sequence 1 continues after its own length (right padding)
        x = r.standard_normal((B, 1, W), dtype=np.float32)
        lens = lens + 1
        sl = (lens - 1).astype(np.int32)
        tot = np.array(max(lens.max(), pk.shape[2] + 1), np.int32)
        g_out = gq.run(None, {"qkv": x, "seqlens_k": sl, "total_sequence_length": tot,
                              "past_key_values.0.key": pk, "past_key_values.0.value": pv})
        p_out = pa.run(None, {"qkv": x, "seqlens_k": sl, "total_sequence_length": tot, "past_key_values.0.key_bits": pbits,
                              "past_key_values.0.kv": pkv})
        np.testing.assert_allclose(p_out[0], g_out[0], atol=1e-5)
        pk, pv, pbits, pkv = g_out[1], g_out[2], p_out[1], p_out[2]


# --------------------------------------------------------------------------- decode-mode quality
@requires_native
def test_decode_perplexity_equals_full_forward_and_sees_the_budget(tmp_path):
    """Teacher-forced decode through the cache scores the same NLL as one forward pass over the
    same tokens (exact graph: fused GQA, shared and growing loops); a PackedAttention model with
    a candidate budget is detected as approximate and its decode-mode NLL differs from its exact
    prefill's (what window perplexity would report)."""
    import onnxruntime as ort

    from custom_ops import runtime

    src = _save(_fused("llama"), tmp_path / "gqa.onnx")
    sess = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    io = runtime.ModelIO.from_session(sess)
    ids = np.random.default_rng(3).integers(0, 256, 200)
    c, s = 60, 30
    full = runtime.run(sess, io, runtime.feeds(io, ids[None, :c + s + 1]))[io.logits_name][0]
    lp = full[c:c + s].astype(np.float64)
    lp = lp - lp.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    nll = -lp[np.arange(s), ids[c + 1:c + s + 1]].mean()
    for shared in (True, False):
        d = runtime.decode_perplexity(sess, io, ids, context=c, score=s, windows=1, shared=shared)
        assert d["tokens"] == s and d["loop"] == ("shared" if shared else "growing")
        assert abs(d["nll"] - nll) < 1e-4
    assert not runtime.approximate_decode(src)
    m, _ = _rewrite_gqa(_fused("llama"), kv_quant="fp32", budget=0.25, min_context=16, window=4, sinks=2,
                        min_candidates=4)
    dst = _save(m, tmp_path / "packed.onnx")
    assert runtime.approximate_decode(dst)
    assert runtime.approximate_from(dst) == 17 and runtime.approximate_from(src) is None   # min_context + 1
    ps = custom_ops.session(dst, threads=1)
    pio = runtime.ModelIO.from_session(ps)
    d = runtime.decode_perplexity(ps, pio, ids, context=c, score=s, windows=1)
    assert d["loop"] == "shared" and abs(d["nll"] - nll) > 1e-3   # the decode-time approximation is seen


def test_fit_pasts_at_the_rotary_limit(tmp_path):
    """rewriter.evaluate.fit_pasts (`ortlean bench` and bench_longctx.py): a past beyond the rotary
    cache's rows minus the decode steps runs at that limit, with a note; the limit is read from a
    GroupQueryAttention graph and from its PackedAttention rewrite (cos_cache on the op)."""
    import onnx
    import onnx_ir as ir

    from rewriter.evaluate import fit_pasts, max_positions

    m = _gqa_layer_model(4, 2, 32, max_pos=256)
    onnx.save(m, tmp_path / "gqa.onnx")
    lean, _ = _rewrite_gqa(ir.from_proto(m), kv_quant="int8", budget=1.0)
    packed = _save(lean, tmp_path / "packed.onnx")
    assert max_positions(str(tmp_path / "gqa.onnx")) == max_positions(packed) == 256
    assert fit_pasts([64, 128], 8, [packed]) == ([64, 128], None)
    pasts, note = fit_pasts([64, 256, 1000], 8, [tmp_path / "gqa.onnx", packed])
    assert pasts == [64, 248] and "256 positions" in note and "ran at 248" in note
