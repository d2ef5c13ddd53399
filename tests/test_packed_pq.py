"""PackedAttention's pq key codes (mode "pq", cache mode): product-quantization codes of the keys
(D/4 subspaces of 4 dims, 16 centroids each: one nibble a subspace, the same key-bits words as sign)
scored by the nibble tables of the group query. Native kernel vs the numpy reference
(custom_ops/reference/attn.py) on random and adversarial shapes, every ISA path, the GQA layout with
rotary, the refusal of bad nodes, and the candidates themselves: keys that are codewords are ranked
as exact scores rank them."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import custom_ops  # noqa: E402
from custom_ops.reference.attn import (n_words, pack_cache, pack_keys, pq_encode, pq_params, pq_tables,  # noqa: E402
                                       pq_unpack, pq_words)

from conftest import requires_native  # noqa: E402
from test_packed_gqa import (assert_native_equals_reference, case, gqa_case, kv_model, run_native,  # noqa: E402
                             run_ref, run_ref_op)


def book_for(Hkv, D, seed=0, scale=1.0):
    r = np.random.default_rng(seed)
    return (scale * r.standard_normal((Hkv, D // 4, 16, 4))).astype(np.float32)


def pq_case(B=1, Hq=9, Hkv=3, S=1, P=700, D=64, Dv=None, q="int8", seed=0, dims=None, book=None):
    """test_packed_gqa.case's feed (hot keys aligned with the queries) packed with pq codes of a random
    codebook; returns (feed, the node's pq attributes)."""
    book = book_for(Hkv, D, seed + 100) if book is None else book
    dims = np.arange(D) if dims is None else np.asarray(dims)
    feed = case(B=B, Hq=Hq, Hkv=Hkv, S=S, P=P, D=D, Dv=Dv, q=q, seed=seed, mode="pq", pq=(book, dims))
    attrs = dict(mode="pq", pq_book=[float(x) for x in book.ravel()])
    if not np.array_equal(dims, np.arange(D)):
        attrs["pq_dims"] = [int(x) for x in dims]
    return feed, attrs


# --------------------------------------------------------------------------- reference
def test_reference_codes_are_nearest_centroids_and_roundtrip():
    r = np.random.default_rng(0)
    D = 40
    book = book_for(1, D)[0]
    dims = r.permutation(D)
    K = r.standard_normal((50, D)).astype(np.float32)
    codes = pq_encode(K, book, dims)
    x = K[:, dims].reshape(50, D // 4, 1, 4).astype(np.float64)
    np.testing.assert_array_equal(codes, ((x - book) ** 2).sum(-1).argmin(-1))
    np.testing.assert_array_equal(pq_unpack(pq_words(codes, D), D), codes)
    # words: code s at bits 4 (s % 8) of word s // 8
    w = pq_words(codes[:1], D)[0]
    assert int(w[0]) & 15 == codes[0, 0] and (int(w[0]) >> 28) & 15 == codes[0, 7] and int(w[1]) & 15 == codes[0, 8]
    # ties: the lower centroid; NaN distances count as +inf; all NaN: code 0
    b2 = book.copy()
    b2[0, 5] = b2[0, 9] = 0.0
    b2[0, :5] = b2[0, 6:9] = b2[0, 10:] = 50.0
    z = np.zeros((1, D), np.float32)
    assert pq_encode(z, b2, np.arange(D))[0, 0] == 5
    b2[0, 5] = np.nan
    assert pq_encode(z, b2, np.arange(D))[0, 0] == 9
    zn = z.copy()
    zn[0, 0] = np.nan
    assert pq_encode(zn, b2, np.arange(D))[0, 0] == 0
    # no gamma word: the key-bits row is the codes alone, one word less than sign bits'
    bits = pack_keys(K[None, None], "pq", pq=(book[None], dims))
    assert bits.shape[-1] == n_words(D, "pq") == pack_keys(K[None, None], "sign").shape[-1] - 1 == (D + 31) // 32
    np.testing.assert_array_equal(bits[0, 0], pq_words(pq_encode(K, book, dims), D).view(np.int32))


def test_reference_tables():
    r = np.random.default_rng(1)
    D = 16
    book = book_for(1, D)[0]
    q = r.standard_normal(D).astype(np.float32)
    ti, coef = pq_tables(q, book, np.arange(D), 8)
    t = (q.reshape(-1, 1, 4).astype(np.float64) * book).sum(-1)
    assert np.abs(ti).max() == 127
    np.testing.assert_allclose(ti * coef, t, atol=float(coef) * 0.5 + 1e-6)
    assert pq_tables(np.zeros(D, np.float32), book, np.arange(D), 8) is None
    q[3] = np.inf
    assert pq_tables(q, book, np.arange(D), 8) is None


def test_reference_checks_params():
    with pytest.raises(ValueError, match="divisible by 4"):
        pq_params(np.zeros(2 * 18 * 16), None, 2, 18)
    with pytest.raises(ValueError, match="pq_book has 10 values"):
        pq_params(np.zeros(10), None, 2, 16)
    with pytest.raises(ValueError, match="permutation"):
        pq_params(np.zeros(16 * 16), [0] * 16, 1, 16)


# --------------------------------------------------------------------------- native vs reference
PQ_CASES = [
    # (B, Hq, Hkv, S, P, D, Dv, q, attrs, permuted dims)
    (1, 9, 3, 1, 700, 64, 64, "int8", dict(budget=0.25, window=64, min_context=128), False),   # SmolLM2
    (1, 9, 3, 1, 700, 64, 64, "int4", dict(budget=0.125, window=32, min_context=128), True),
    (1, 6, 2, 1, 300, 24, 20, "fp32", dict(budget=0.3, window=16, min_context=32), True),      # 6 subspaces
    (1, 4, 2, 1, 300, 20, 12, "fp32", dict(budget=0.3, window=8, min_context=0), False),       # 5: an odd count
    (2, 4, 2, 1, 333, 48, 40, "int8", dict(budget=0.3, window=17, sinks=3, min_candidates=5, min_context=10), True),
    (1, 4, 2, 1, 1100, 128, 64, "int8", dict(budget=0.2, window=16), False),                  # 16 key bytes
    (1, 6, 3, 1, 2300, 64, 64, "int8", dict(budget=0.2, window=32), False),                   # two key ranges
    (1, 4, 2, 1, 61, 64, 64, "int8", dict(budget=0.5, window=4, sinks=0, min_candidates=0, min_context=0), False),
    (1, 6, 3, 1, 1000, 64, 64, "int8", dict(budget=0.2, window=8, qbits=16), False),           # wide tables
    (1, 4, 2, 1, 900, 32, 32, "int8", dict(budget=0.2, qbits=2, min_context=0), False),        # heavy ties
    (1, 9, 3, 1, 1000, 64, 64, "int8", dict(budget=0.25, window=61, sinks=3, min_context=64, cand_block=16), False),
    (1, 6, 2, 4, 700, 64, 64, "int8", dict(budget=0.25, approx_prefill=1, min_context=64), False),
    (1, 4, 2, 1, 700, 64, 64, "int8", dict(budget=0.25, local_window=300, min_context=64, softcap=5.0), True),
    (1, 4, 2, 5, 90, 16, 16, "int8", dict(budget=0.0), False),                                  # prefill rows
    (1, 4, 2, 7, 0, 16, 16, "int4", dict(), False),                                              # first prompt
]


@requires_native
@pytest.mark.parametrize("B,Hq,Hkv,S,P,D,Dv,q,attrs,perm", PQ_CASES)
def test_kernel_vs_reference(B, Hq, Hkv, S, P, D, Dv, q, attrs, perm):
    dims = np.random.default_rng(D).permutation(D) if perm else None
    f, pa = pq_case(B=B, Hq=Hq, Hkv=Hkv, S=S, P=P, D=D, Dv=Dv, q=q, dims=dims)
    attrs = dict(kv_quant=q, scale=float(D) ** -0.5, **pa, **attrs)
    if not P:
        f.pop("past_kv"), f.pop("past_bits")
    assert_native_equals_reference(attrs, f)


@requires_native
def test_kernel_vs_reference_mask_zero_query_and_nan_key():
    """An additive mask with -inf stretches, a zero query (all scores 0: ties by index), a new key
    with a NaN component (its subspace's code 0)."""
    f, pa = pq_case(B=2, Hq=4, Hkv=2, P=500, seed=11)
    f["Q"][1] = 0.0
    f["K"][0, 1, 0, 5] = np.nan
    mask = np.zeros((2, 4, 1, 501), np.float32)
    mask[0, :, :, 100:300] = -np.inf
    mask[1, 1, :, :50] = -np.inf
    f["mask"] = mask
    attrs = dict(kv_quant="int8", scale=0.125, budget=0.15, window=8, sinks=2, min_candidates=4, min_context=16, **pa)
    Yr, br, kr = run_ref(attrs, f)
    Y, bits, kv = run_native(attrs, f)
    np.testing.assert_array_equal(bits[..., :2], br[..., :2])  # codes (the NaN row's int8 scale aside)
    assert (pq_unpack(bits[0, 1, 500], 64)[1] == 0)
    np.testing.assert_allclose(Y[1], Yr[1], atol=2e-5, rtol=1e-4)  # batch row 1: no NaN key


@requires_native
def test_new_key_codes_at_ties_nan_centroids_and_overflow():
    """The kernel's codes of new keys (branch-free minimum: the first lane equal to it) against the
    reference's at equal nearest centroids (the lower one), a NaN component (its subspace's distances
    NaN: code 0), distances that overflow to +inf for every centroid (code 0) or for all but one, and a
    key on a centroid. (The node refuses a book with NaN: test_invalid_node_fails_with_name.)"""
    D, Hkv = 16, 2
    book = book_for(Hkv, D, seed=5)
    book[0, 0, :, :] = 50.0
    book[0, 0, 5] = book[0, 0, 9] = 0.0           # subspace 0 of head 0: centroids 5 and 9 tie at 0
    book[1, 2, :, :] = 1e30                        # head 1 subspace 2: all but centroid 11 overflow
    book[1, 2, 11] = 0.0
    f, pa = pq_case(B=1, Hq=4, Hkv=Hkv, S=4, P=40, D=D, seed=3, book=book)
    K = f["K"]
    K[0, 0, :, 0:4] = 0.0                          # every new key of head 0: the tie
    K[0, 0, 1, 5] = np.nan                         # NaN distances: code 0
    K[0, 0, 2, 4:8] = book[0, 1, 7]                # exactly on centroid 7
    K[0, 1, 0, 8:12] = 3e38                        # every distance of subspace 2 overflows: code 0
    K[0, 1, 1, 8:12] = 0.0                         # only centroid 11 finite
    attrs = dict(kv_quant="int8", scale=0.5, budget=0.3, window=4, sinks=1, min_context=0, **pa)
    with np.errstate(over="ignore", invalid="ignore"):  # huge keys: the reference's logits overflow
        Yr, br, kr = run_ref(attrs, f)
    Y, bits, kv = run_native(attrs, f)
    np.testing.assert_array_equal(bits[..., :1], br[..., :1])  # codes (D 16: one word)
    new = [pq_unpack(bits[0, h, 40 + m], D) for h in range(Hkv) for m in range(4)]
    assert all(c[0] == 5 for c in new[:4])
    assert new[1][1] == 0 and new[2][1] == 7 and new[4][2] == 0 and new[5][2] == 11


@requires_native
@pytest.mark.parametrize("scale", [-0.125, 0.0, 1e-39])
def test_selection_order_at_edge_scales(scale):
    """Without a mask the kernel selects on the integer core where float(core) * coef orders keys
    alike; a negative scale reverses the order, and zero (or a denormal coef) ties keys that the core
    would separate: those take the float scores, as the reference does."""
    f, pa = pq_case(Hq=6, Hkv=3, P=900, seed=12)
    attrs = dict(kv_quant="int8", scale=scale, budget=0.2, window=8, sinks=2, min_context=0, **pa)
    assert_native_equals_reference(attrs, f)


@requires_native
def test_selection_with_few_distinct_codes():
    """Every cached key one of two codewords: the k-th largest score's bucket is mostly ties, which the
    order breaks by index."""
    Hkv, D = 2, 32
    book = book_for(Hkv, D, 9)
    f, pa = pq_case(Hq=4, Hkv=Hkv, P=777, D=D, Dv=D, book=book, seed=13)
    r = np.random.default_rng(13)
    pick = r.integers(0, 2, (1, Hkv, 777))
    words = pq_words(np.where(pick[..., None] == 1, 3, 0) * np.ones((1, 1, 1, D // 4), np.int64), D)
    f["past_bits"][..., :words.shape[-1]] = words
    attrs = dict(kv_quant="int8", scale=D ** -0.5, budget=0.3, window=5, sinks=1, min_context=0, **pa)
    assert_native_equals_reference(attrs, f)


@requires_native
@pytest.mark.parametrize("pattern", ["random", "every8_a", "every8_b", "two_codewords"])
def test_selection_through_a_sampled_threshold(pattern):
    """Rows of 1,024 keys or more select among the keys above a threshold that a sample of every 8th
    key gives (the whole row when fewer than k pass): random codes (the SmolLM2 shape at past 4096);
    every 8th key one codeword and the others another, both ways round (the sample sees only the
    higher, then too few keys pass and the whole row is taken; or only the lower); heavy ties."""
    Hkv, D, P = 3, 64, 4096
    book = book_for(Hkv, D, 17)
    f, pa = pq_case(Hq=9, Hkv=Hkv, P=P, D=D, Dv=D, book=book, seed=17)
    if pattern != "random":
        t = np.arange(P)
        if pattern == "two_codewords":
            pick = np.random.default_rng(17).integers(0, 2, (1, Hkv, P))
        else:
            pick = np.broadcast_to(((t % 8 == 0) == (pattern == "every8_a")).astype(np.int64), (1, Hkv, P))
        words = pq_words(np.where(pick[..., None] == 1, 3, 0) * np.ones((1, 1, 1, D // 4), np.int64), D)
        f["past_bits"][..., :words.shape[-1]] = words
    attrs = dict(kv_quant="int8", scale=D ** -0.5, budget=0.2, window=8, sinks=0, min_context=0, **pa)
    assert_native_equals_reference(attrs, f)


@requires_native
def test_phase_times_metrics(monkeypatch):
    """ORTLEAN_PHASE_TIMES=1 at kernel construction: each cache-mode call adds its phases' wall times
    (time.*_us, non-negative, their sum within the total) and time.calls; the scoring takes time only
    on a call that approximates. Without it the node has no time.* metrics."""
    from test_packed_gqa import kv_model

    f, pa = pq_case(Hq=6, Hkv=3, P=2000, seed=14)
    attrs = dict(kv_quant="int8", scale=0.125, budget=0.25, window=16, min_context=64, **pa)
    monkeypatch.setenv("ORTLEAN_PHASE_TIMES", "1")
    s = custom_ops.session(kv_model(attrs, use=tuple(f), name="pa_timed"), threads=1)
    exact = custom_ops.session(kv_model({**attrs, "budget": 0.0}, use=tuple(f), name="pa_timed_exact"), threads=1)
    monkeypatch.delenv("ORTLEAN_PHASE_TIMES")
    untimed = custom_ops.session(kv_model(attrs, use=tuple(f), name="pa_untimed"), threads=1)
    custom_ops.reset_metrics()
    for _ in range(3):
        s.run(None, f)
    exact.run(None, f)
    untimed.run(None, f)
    m = custom_ops.metrics()["pa_timed"]
    phases = ("inputs", "store", "score", "select", "attend")
    assert m["time.calls"] == 3
    assert all(m[f"time.{k}_us"] >= 0 for k in phases) and m["time.score_us"] > 0 and m["time.attend_us"] > 0
    assert sum(m[f"time.{k}_us"] for k in phases) <= m["time.total_us"] * 1.001 + 1e-3
    m = custom_ops.metrics()
    assert m["pa_timed_exact"]["time.calls"] == 1 and m["pa_timed_exact"]["time.score_us"] == 0
    assert m["pa_timed_exact"]["time.attend_us"] > 0
    assert not any(k.startswith("time.") for k in m["pa_untimed"])


@requires_native
def test_codeword_keys_pick_the_exact_candidates():
    """Keys made of codewords (every subspace exactly a centroid) and fp32 rows: the pq score is the
    exact group score up to the tables' rounding (qbits 16), so the candidates, and Y, are the
    oracle's (select = exact); sign bits pick other keys."""
    r = np.random.default_rng(5)
    Hq, Hkv, D, P = 6, 2, 32, 1500
    book = book_for(Hkv, D, 7)
    codes = r.integers(0, 16, (1, Hkv, P, D // 4))
    Kp = np.stack([book[h][np.arange(D // 4), codes[0, h]].reshape(P, D) for h in range(Hkv)])[None]
    Vp = r.standard_normal((1, Hkv, P, D)).astype(np.float32)
    feed = {"Q": r.standard_normal((1, Hq, 1, D)).astype(np.float32),
            "K": book[:, np.arange(D // 4), 0].reshape(1, Hkv, 1, D).copy(),
            "V": r.standard_normal((1, Hkv, 1, D)).astype(np.float32)}
    base = dict(kv_quant="fp32", scale=D ** -0.5, budget=0.1, window=8, sinks=0, min_candidates=0, min_context=0)
    bits, rows = pack_cache(Kp, Vp, "fp32", "pq", pq=(book, np.arange(D)))
    assert (pq_unpack(bits[..., :2], D) == codes).all()
    pa = dict(mode="pq", pq_book=[float(x) for x in book.ravel()], qbits=16)
    Y_pq = run_native({**base, **pa}, {**feed, "past_bits": bits, "past_kv": rows})[0]
    Y_or = run_native({**base, **pa, "select": "exact"}, {**feed, "past_bits": bits, "past_kv": rows})[0]
    np.testing.assert_allclose(Y_pq, Y_or, atol=1e-5)
    sb, sr = pack_cache(Kp, Vp, "fp32", "sign")
    Y_sign = run_native(base, {**feed, "past_bits": sb, "past_kv": sr})[0]
    assert np.abs(Y_sign - Y_or).max() > 1e-3


@requires_native
@pytest.mark.parametrize("seqlens,P,S", [([300], 300, 1), ([16, 13], 12, 5)])
def test_gqa_layout_with_rotary(seqlens, P, S):
    """GroupQueryAttention's layout: the keys rotated inside the op, then coded; padding rows."""
    B = len(seqlens)
    D = 64 if B == 1 else 32
    feed = gqa_case(B, 9 if B == 1 else 6, 3 if B == 1 else 2, S, P, D, D, "int8", packed=True, rot_half=D // 2,
                    seqlens=seqlens)
    Hkv = 3 if B == 1 else 2
    book = book_for(Hkv, D, 3)
    if P:  # the past re-packed with pq codes (same rows)
        from custom_ops.reference.attn import unpack_kv
        Kd, _ = unpack_kv(feed["past_kv"], feed["past_bits"], D, D, "int8")
        pb = pack_keys(Kd, "pq", pq=(book, np.arange(D)))
        feed["past_bits"] = np.concatenate([pb, feed["past_bits"][..., -2:]], -1)
    attrs = dict(kv_quant="int8", scale=D ** -0.5, num_heads=9 if B == 1 else 6, kv_num_heads=Hkv, mode="pq",
                 pq_book=[float(x) for x in book.ravel()], budget=0.25, window=8, min_context=16)
    Yr, br, kr = run_ref_op(attrs, feed)
    Y, bits, kv = run_native(attrs, feed)
    np.testing.assert_array_equal(bits, br)
    np.testing.assert_allclose(Y, Yr, atol=2e-5, rtol=1e-4)


def _isa_worker() -> None:
    # P=1500: a row long enough for the sampled threshold (select_ge)
    for shape in (dict(P=500), dict(Hq=10, Hkv=2, P=601, D=40, Dv=24), dict(P=1500)):
        f, pa = pq_case(seed=8, **shape)
        attrs = dict(kv_quant="int8", scale=0.125, budget=0.25, window=32, min_context=64, **pa)
        Y, bits, kv = run_native(attrs, f)
        Yr, br, kr = run_ref(attrs, f)
        np.testing.assert_allclose(Y, Yr, atol=2e-5)
        assert (bits == br).all() and (kv == kr).all()
    print("ok", custom_ops.isa())


@requires_native
@pytest.mark.parametrize("isa", ["scalar", "avx2"])
def test_isa_paths(isa):
    env = dict(os.environ, ORTLEAN_ISA=isa)
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_packed_pq as t; t._isa_worker()"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == isa


# --------------------------------------------------------------------------- bad nodes
BOOK = [0.5] * (2 * 16 * 16)


@requires_native
@pytest.mark.parametrize("attrs,needle", [
    (dict(kv_quant="none", mode="pq", pq_book=BOOK), "mode pq needs kv_quant"),
    (dict(kv_quant="int8", mode="pq"), "needs pq_book"),
    (dict(kv_quant="int8", mode="pq", pq_book=BOOK, kscale=[1.0] * 32), "kscale"),
    (dict(kv_quant="int8", mode="pq", pq_book=BOOK, pq_dims=[0, 1, 2, 2]), "pq_dims"),
    (dict(kv_quant="int8", mode="pq", pq_book=BOOK, pq_dims=[0, 1, 2, 9]), "pq_dims"),
    (dict(kv_quant="int8", mode="sign", pq_book=BOOK), "need mode pq"),
    (dict(kv_quant="int8", mode="pq", pq_book=[float("nan")] * 512), "pq_book"),
])
def test_invalid_node_fails_with_name(attrs, needle):
    with pytest.raises(Exception) as e:
        custom_ops.session(kv_model(attrs, name="bad_pq_node"))
    assert "bad_pq_node" in str(e.value) and needle in str(e.value)


@requires_native
def test_book_and_dims_lengths_checked_at_run():
    f, pa = pq_case(Hq=4, Hkv=2, P=20, D=16)
    for bad, needle in ((dict(pa, pq_book=pa["pq_book"][:-16]), "pq_book has 496 values"),
                        (dict(pa, pq_dims=list(range(8))), "pq_dims has 8 values")):
        with pytest.raises(Exception, match=needle):
            run_native(dict(kv_quant="int8", budget=0.5, **bad), f)


@requires_native
def test_key_bits_rows_of_the_old_width_fail_with_a_hint():
    """pq key-bits rows are the codes and the K / V scales (no gamma word): a cache of
    the old width (one word more) is refused by name with the fix, not read as shifted rows."""
    f, pa = pq_case(Hq=4, Hkv=2, P=20, D=64)
    assert f["past_bits"].shape[-1] == n_words(64, "pq") + 2 == 4
    old = dict(f, past_bits=np.concatenate([f["past_bits"][..., :2], np.ones_like(f["past_bits"][..., :1]),
                                            f["past_bits"][..., 2:]], -1))
    with pytest.raises(Exception, match=r"past_bits \[1, 2, 20, 5\] must be .*no longer carry a gamma word"):
        run_native(dict(kv_quant="int8", budget=0.5, **pa), old)
