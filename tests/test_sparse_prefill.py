"""PackedAttention's sparse prefill (prefill_budget in (0, 1), cache mode, prompt rows): the kernel
against the numpy reference (custom_ops/reference/attn.py: prefill_keys) on random and adversarial
shapes — tiles cut by chunk boundaries and sequence ends, sizes not divisible by the block, one
query head per KV head and several, int8 / int4 / fp32 rows, padding rows — on every ISA path;
exact where the rules say so; a planted block every row needs is chosen; chunked prompts equal one
call when the chunks are tile-aligned; the metrics; bad nodes refused by name."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import custom_ops  # noqa: E402
from custom_ops.reference.attn import pack_cache, prefill_keys, unpack_kv  # noqa: E402

from conftest import requires_native  # noqa: E402
from test_packed_gqa import kv_model, prompt_atol, run_native, run_ref  # noqa: E402

SPARSE = dict(prefill_budget=0.25, prefill_block=16, prefill_window=48, prefill_min_context=96, sinks=4)


def prompt_case(B=1, Hq=6, Hkv=2, M=200, P=300, D=32, Dv=None, q="int8", seed=0, hot=True):
    """M new prompt rows after a past of P rows; when `hot`, a few past blocks hold keys aligned with
    some query rows (the blocks a good selection must find)."""
    r = np.random.default_rng(seed)
    Dv = Dv or D
    Q = r.standard_normal((B, Hq, M, D), dtype=np.float32)
    Kp = r.standard_normal((B, Hkv, P, D), dtype=np.float32)
    if hot and P > 64:
        rep = Hq // Hkv
        for b in range(B):
            for hk in range(Hkv):
                for _ in range(3):
                    t0 = int(r.integers(16, P - 16))
                    m = int(r.integers(0, M))
                    Kp[b, hk, t0:t0 + 3] += 3.0 * Q[b, hk * rep, m] / np.linalg.norm(Q[b, hk * rep, m]) * np.sqrt(D)
    Vp = r.standard_normal((B, Hkv, P, Dv), dtype=np.float32)
    K = r.standard_normal((B, Hkv, M, D), dtype=np.float32)
    V = r.standard_normal((B, Hkv, M, Dv), dtype=np.float32)
    feed = {"Q": Q, "K": K, "V": V}
    if P:
        bits, rows = pack_cache(Kp, Vp, q)
        feed.update(past_kv=rows, past_bits=bits)
    return feed


def _atol(q, f) -> float:
    return prompt_atol(q, f, base=3e-5)


def _attrs(q, D, **kw):
    return {"kv_quant": q, "scale": float(D) ** -0.5, **SPARSE, **kw}


CASES = [  # (B, Hq, Hkv, M, P, D, Dv, q, extra)
    (1, 6, 2, 200, 300, 32, None, "int8", {}),
    (1, 3, 3, 77, 501, 64, None, "int8", {}),          # one head per KV head, M odd, P not block-aligned
    (1, 8, 2, 130, 333, 24, 40, "int4", {}),
    (1, 4, 1, 64, 700, 16, 8, "fp32", {}),
    (2, 6, 2, 100, 250, 32, None, "int8", dict(prefill_block=32, prefill_window=0)),  # no local window
    (1, 6, 2, 150, 400, 32, None, "int8", dict(sinks=0, prefill_budget=0.1)),
    (1, 6, 2, 90, 400, 32, None, "int8", dict(softcap=2.0)),
    # blocks of several 16-key boxes (the bound the largest of theirs), and a block that is not a multiple
    (1, 6, 2, 160, 900, 32, None, "int8", dict(prefill_block=64, prefill_window=128, prefill_min_context=256)),
    (1, 4, 2, 97, 700, 24, 16, "fp32", dict(prefill_block=48, prefill_window=96, prefill_budget=0.2)),
    (1, 6, 2, 120, 650, 32, None, "int4", dict(prefill_block=40, prefill_window=80)),
    # an exact tail: cut inside a tile (200 - 37), on a tile's edge, longer than the call, two sequences
    (1, 6, 2, 200, 300, 32, None, "int8", dict(prefill_tail=37)),
    (1, 4, 2, 97, 700, 24, 16, "fp32", dict(prefill_block=48, prefill_window=96, prefill_tail=49)),
    (1, 6, 2, 60, 500, 32, None, "int4", dict(prefill_tail=61)),
    (2, 6, 2, 100, 250, 32, None, "int8", dict(prefill_block=32, prefill_window=0, prefill_tail=1)),
]


@requires_native
@pytest.mark.parametrize("B,Hq,Hkv,M,P,D,Dv,q,extra", CASES)
def test_kernel_vs_reference(B, Hq, Hkv, M, P, D, Dv, q, extra):
    attrs = _attrs(q, D, **extra)
    f = prompt_case(B=B, Hq=Hq, Hkv=Hkv, M=M, P=P, D=D, Dv=Dv, q=q, seed=M + P)
    Yr, br, kr = run_ref(attrs, f)
    Y, bits, kv = run_native(attrs, f)
    np.testing.assert_array_equal(kv, kr)
    np.testing.assert_array_equal(bits, br)
    np.testing.assert_allclose(Y, Yr, atol=_atol(q, f), rtol=1e-4)


def test_reference_selection_rules():
    """Which rows are sparse and which keys a sparse row reads: sinks, the chosen middle blocks and the
    local blocks, causal; tiles below prefill_min_context or whose budget covers every block are exact."""
    f = prompt_case(M=64, P=500, q="fp32", seed=3)
    Kd, _ = unpack_kv(f["past_kv"], f["past_bits"], 32, 32, "fp32")
    T = 500 + 64
    Kh = np.concatenate([Kd[0, 0], f["K"][0, 0]], 0)
    Qg = f["Q"][0, :3]
    sel = prefill_keys(Qg, Kh[:T], 500, list(range(64)), 0.25, 16, 48, 96, 4, 0.125)
    assert set(sel) == set(range(64))
    for m, keys in sel.items():
        pos = 500 + m
        pa, pb = max(500, pos // 16 * 16), min(563, pos // 16 * 16 + 15)
        assert keys.max() == pos and np.all(np.diff(keys) > 0)
        assert set(range(16)) <= set(keys.tolist())                              # the sink block
        local = max(0, pa - 48) // 16 * 16
        assert set(range(local, pos + 1)) <= set(keys.tolist())                  # the local blocks, causal
        nb, jl = pb // 16 + 1, local // 16
        blocks = 1 + int(np.ceil(0.25 * (jl - 1))) + (nb - jl)              # sink, the budget's middle, local
        assert len(keys) <= blocks * 16 and len(keys) < pos + 1                  # the budget; sparse
        assert len(keys) > (1 + (nb - jl) - 1) * 16                              # some middle block read
    # a budget smaller than the local window's share of the context still reads middle blocks: the
    # budget is the share of the middle (the rule it replaced kept none here, a sliding window)
    sel = prefill_keys(Qg, Kh[:T], 500, list(range(64)), 0.1, 16, 48, 96, 4, 0.125)
    for m, keys in sel.items():
        pos = 500 + m
        jl = max(0, max(500, pos // 16 * 16) - 48) // 16
        middle = [k for k in keys.tolist() if 16 <= k < jl * 16]
        assert len(middle) == int(np.ceil(0.1 * (jl - 1))) * 16
    # below min_context: no row is sparse; a budget that covers every block: exact
    assert prefill_keys(Qg, Kh[:T], 500, list(range(64)), 0.25, 16, 48, 10_000, 4, 0.125) == {}
    assert prefill_keys(Qg, Kh[:T], 500, list(range(64)), 0.999, 16, 48, 96, 4, 0.125) == {}


def test_reference_exact_tail():
    """The last `tail` rows of the call are exact (absent from the selection); the rows before them keep
    the tiles they would have, cut at the tail: a tile's rows before the cut are scored without the
    rows after it."""
    f = prompt_case(M=64, P=500, q="fp32", seed=3)
    Kd, _ = unpack_kv(f["past_kv"], f["past_bits"], 32, 32, "fp32")
    Kh = np.concatenate([Kd[0, 0], f["K"][0, 0]], 0)
    Qg = f["Q"][0, :3]
    args = (0.25, 16, 48, 96, 4, 0.125)
    full = prefill_keys(Qg, Kh, 500, list(range(64)), *args)
    tail = prefill_keys(Qg, Kh, 500, list(range(64)), *args, tail=20)
    assert set(tail) == set(range(44))
    for m in range(32):                       # whole tiles before the cut: as without a tail
        np.testing.assert_array_equal(tail[m], full[m])
    cut = prefill_keys(Qg, Kh, 500, list(range(44)), *args)   # the cut tile scored on its rows 32..43
    for m in range(32, 44):
        np.testing.assert_array_equal(tail[m], cut[m])
    assert prefill_keys(Qg, Kh, 500, list(range(64)), *args, tail=64) == {}


def test_planted_key_in_a_block_of_boxes_is_chosen():
    """64-key blocks (four 16-key boxes each, a block's bound the largest of its boxes'): the block
    holding one key aligned with a query row is read by every sparse tile row from that row on."""
    r = np.random.default_rng(7)
    D, P, M = 32, 1600, 64
    Q = r.standard_normal((2, M, D), dtype=np.float32)
    K = r.standard_normal((P + M, D), dtype=np.float32)
    K[611] = 3.0 * Q[0, 40] / np.linalg.norm(Q[0, 40]) * np.sqrt(D)
    sel = prefill_keys(Q, K, P, list(range(M)), 0.05, 64, 128, 256, 4, D ** -0.5)
    assert sel and all(611 in sel[m] for m in range(40, M))


def test_planted_block_is_chosen():
    """A past block whose keys align with one query row beats the rest: every sparse tile holding
    that row reads it."""
    r = np.random.default_rng(1)
    D, P, M = 32, 800, 32
    Q = r.standard_normal((3, M, D), dtype=np.float32)
    K = r.standard_normal((P + M, D), dtype=np.float32) * 0.3
    K[403] = 4.0 * Q[1, 20] / np.linalg.norm(Q[1, 20]) * np.sqrt(D)
    sel = prefill_keys(Q, K, P, list(range(M)), 0.1, 16, 32, 64, 4, D ** -0.5)
    assert sel and all(403 in sel[m] for m in range(16, 32))


@requires_native
def test_budget_zero_and_one_are_the_exact_path():
    f = prompt_case(M=100, P=300, q="int8", seed=5)
    exact = run_native(dict(kv_quant="int8", scale=0.2), f)[0]
    for b in (0.0, 1.0):
        np.testing.assert_array_equal(run_native(_attrs("int8", 32, prefill_budget=b, scale=0.2), f)[0], exact)
    sparse = run_native(_attrs("int8", 32, scale=0.2), f)[0]
    assert not np.array_equal(sparse, exact)


@requires_native
@pytest.mark.parametrize("q", ["int8", "fp32"])
def test_exact_prompt_rows_of_a_long_context(q):
    """Without a sparse budget, a call whose context reaches kFlashMinContext (2048) keys runs its exact
    prompt rows through the chunked online softmax (every tile exact): the reference's exact rows."""
    f = prompt_case(Hq=6, Hkv=2, M=70, P=2100, D=32, q=q, seed=11)
    attrs = {"kv_quant": q, "scale": 32 ** -0.5}
    Y = run_native(attrs, f)[0]
    Yr = run_ref(attrs, f)[0]
    np.testing.assert_allclose(Y, Yr, atol=_atol(q, f), rtol=1e-4)


@requires_native
def test_tile_aligned_chunks_equal_one_call():
    """A prompt fed in chunks whose boundaries are multiples of the block (the state carried) gives the
    rows one call gives: a tile's rows are the same in both."""
    q, D = "int8", 32
    attrs = _attrs(q, D)
    f = prompt_case(M=160, P=320, q=q, seed=9)
    Y1, bits1, kv1 = run_native(attrs, f)
    Ys, state = [], {k: f[k] for k in ("past_kv", "past_bits")}
    for lo, hi in ((0, 48), (48, 112), (112, 160)):
        part = {"Q": f["Q"][:, :, lo:hi], "K": f["K"][:, :, lo:hi], "V": f["V"][:, :, lo:hi], **state}
        Y, bits, kv = run_native(attrs, part)
        Ys.append(Y)
        state = {"past_kv": kv, "past_bits": bits}
    np.testing.assert_allclose(np.concatenate(Ys, 2), Y1, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(state["past_kv"], kv1)


@requires_native
@pytest.mark.parametrize("tail", [37, 200])
def test_prompt_continues_drops_the_tail(tail):
    """Input prompt_continues = 1 (a later call continues the prompt): the call's last rows are not an
    exact tail — the kernel equals the reference and the same node without a tail; 0: the tail as the
    attribute says (differs from no tail); absent: the calling thread's custom_ops.prompt_continues()."""
    attrs = _attrs("int8", 32, prefill_tail=tail)
    f = prompt_case(M=200, P=300, q="int8", seed=11)
    no_tail = run_native(_attrs("int8", 32), f)[0]
    with_tail = run_native(attrs, f)[0]
    for flag, want in ((1, no_tail), (0, with_tail), (7, no_tail)):
        g = {**f, "prompt_continues": np.array([flag], np.int32)}
        Y = run_native(attrs, g)[0]
        np.testing.assert_allclose(Y, run_ref(attrs, g)[0], atol=_atol("int8", f), rtol=1e-4)
        np.testing.assert_allclose(Y, want, atol=1e-6, rtol=1e-6)
    assert not np.allclose(no_tail, with_tail, atol=1e-3)     # the tail did change rows
    with custom_ops.prompt_continues():                       # the calling thread's flag, input absent
        np.testing.assert_allclose(run_native(attrs, f)[0], no_tail, atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(run_ref(attrs, f)[0], run_ref(_attrs("int8", 32), f)[0], atol=1e-6)
    np.testing.assert_allclose(run_native(attrs, f)[0], with_tail, atol=1e-6, rtol=1e-6)


@requires_native
def test_prompt_continues_of_two_values_fails_naming_it():
    f = {**prompt_case(M=40, P=300, q="int8", seed=12), "prompt_continues": np.array([1, 0], np.int32)}
    s = custom_ops.session(kv_model(_attrs("int8", 32, prefill_tail=8), use=tuple(f), name="bad_cont"), threads=1)
    with pytest.raises(Exception) as e:
        s.run(None, f)
    assert "bad_cont" in str(e.value) and "prompt_continues" in str(e.value)
    with pytest.raises(ValueError, match="prompt_continues"):
        run_ref(_attrs("int8", 32, prefill_tail=8), f)


@requires_native
def test_metrics_count_the_attended_keys():
    attrs = _attrs("int8", 32)
    f = prompt_case(M=128, P=600, q="int8", seed=2)
    s = custom_ops.session(kv_model(attrs, use=tuple(f), name="pf_metrics"), threads=2)
    before = custom_ops.metrics().get("pf_metrics", {})
    s.run(None, f)
    m = custom_ops.metrics()["pf_metrics"]
    ctx = m["pack.prefill_keys"] - before.get("pack.prefill_keys", 0)
    att = m["pack.prefill_attended"] - before.get("pack.prefill_attended", 0)
    assert ctx == 2 * sum(600 + i + 1 for i in range(128))   # 2 KV heads
    assert 0 < att < 0.6 * ctx


def _isa_worker() -> None:
    for q, D, Dv in (("int8", 32, 32), ("int4", 24, 40), ("fp32", 20, 13)):
        for Hq, Hkv in ((6, 2), (3, 3)):
            attrs = _attrs(q, D, prefill_tail=13 if Hq == 6 else 0)
            f = prompt_case(Hq=Hq, Hkv=Hkv, M=70, P=400, D=D, Dv=Dv, q=q, seed=4)
            for g in (f, {**f, "prompt_continues": np.ones(1, np.int32)}):
                Y = run_native(attrs, g)[0]
                Yr = run_ref(attrs, g)[0]
                np.testing.assert_allclose(Y, Yr, atol=_atol(q, f), rtol=1e-4)
        f = prompt_case(Hq=6, Hkv=2, M=40, P=2050, D=D, Dv=Dv, q=q, seed=5)   # exact rows, long context
        attrs = {"kv_quant": q, "scale": 0.2}
        np.testing.assert_allclose(run_native(attrs, f)[0], run_ref(attrs, f)[0], atol=_atol(q, f), rtol=1e-4)
    print("ok", custom_ops.isa())


@requires_native
@pytest.mark.parametrize("isa", ["scalar", "avx2"])
def test_isa_paths(isa):
    env = dict(os.environ, ORTLEAN_ISA=isa)
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_sparse_prefill as t; t._isa_worker()"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == isa


@requires_native
@pytest.mark.parametrize("attrs,needle", [
    (dict(prefill_budget=0.5), "prefill_budget"),                 # without kv_quant
    (dict(kv_quant="int8", prefill_block=4), "prefill_block"),
    (dict(kv_quant="int8", prefill_budget=1.5), "prefill_budget"),
])
def test_invalid_node_fails_with_name(attrs, needle):
    with pytest.raises(Exception) as e:
        custom_ops.session(kv_model(dict(scale=0.1, **attrs), name="bad_pf"), threads=1)
    assert "bad_pf" in str(e.value) and needle in str(e.value)
