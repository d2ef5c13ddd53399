"""ProcSparseMatMul: numpy reference (hash definition, pinned values), native kernel against it on
odd shapes for M ∈ {1, 7, 128} on every ISA path (subprocesses with ORTLEAN_ISA), bit-identical
regenerated weights across ISA paths and numpy, dense reproduction, gating mask, shedding bounds,
attribute validation, re-entrancy, the builder and the rewriter end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import custom_ops  # noqa: E402
from custom_ops.reference.procsparse import (hash_base, hash_unit, proc_full, proc_sparse_matmul,  # noqa: E402
                                             splitmix64)
from rewriter.backends import procsparse as ps  # noqa: E402
from rewriter.builders import procsparse as psb  # noqa: E402


def _native() -> bool:
    try:
        custom_ops.load_library()
        return True
    except Exception:
        return False


native = pytest.mark.skipif(not _native() and not os.environ.get("CI"), reason="ortlean library not built (pip install -e .)")


# --------------------------------------------------------------------------- model building
def random_layer(K, N, B, fan, seed=0, rng_seed=0):
    rng = np.random.default_rng(rng_seed)
    nb = (K + B - 1) // B
    rp, bi = [0], []
    for _ in range(N):
        c = int(rng.integers(0, min(fan, nb) + 1))
        bi += sorted(rng.choice(nb, c, replace=False).tolist())
        rp.append(rp[-1] + c)
    rp = np.array(rp, np.int32)
    bi = np.array(bi, np.int32)
    d = rng.standard_normal((len(bi), B)).astype(np.float32)
    return rp, bi, d


def proc_model(K, N, B, rp, bi, d, *, seed=7, scale=0.05, mask=False, name="ps", attrs=None, drop=(),
               const=True, xshape=None) -> bytes:
    ins = [helper.make_tensor_value_info("X", TensorProto.FLOAT, xshape or ["M", K])]
    names = ["X", "rp", "bi", "d"]
    inits = [numpy_helper.from_array(np.asarray(rp), "rp"), numpy_helper.from_array(np.asarray(bi), "bi")]
    if const:
        inits.append(numpy_helper.from_array(np.asarray(d), "d"))
    else:
        ins.append(helper.make_tensor_value_info("d", TensorProto.FLOAT, list(np.asarray(d).shape)))
    if mask:
        ins.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, None))
        names.append("mask")
    a = dict(shape=[K, N], block=B, seed=seed, base_scale=scale, fanout=0, watermark=0, shed_eps=0.0, trims=0,
             gap=0.0, params_dense=K * N, params_stored=int(len(bi) * (B + 1) + N + 1),
             bytes_stored=4 * int(len(bi) * (B + 1) + N + 1), speedup=0.0, layer="0", target="mlp")
    a.update(attrs or {})
    for k in drop:
        a.pop(k)
    node = helper.make_node("ProcSparseMatMul", names, ["Y"], name=name, domain="ai.ortlean", **a)
    g = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortlean", 1)])
    m.ir_version = 10
    return m.SerializeToString()


def ref(x, K, N, B, rp, bi, d, seed=7, scale=0.05, mask=None):
    return proc_sparse_matmul(np.asarray(x, np.float64), rp, bi, d, mask, shape=[K, N], block=B, seed=seed,
                              base_scale=scale)


# odd shapes: K not a multiple of the block, N odd, tiny and wide
CASES = [(100, 37, 32, 3), (256, 64, 64, 4), (577, 130, 32, 12), (33, 5, 32, 2), (200, 1, 64, 4), (1000, 300, 32, 20)]


# --------------------------------------------------------------------------- reference
def test_splitmix64_known_vector():
    # splitmix64 with state 0: the first output is the published 0xE220A8397B1DCDAF
    assert int(splitmix64(0, np.array([0], np.uint64))[0]) == 0xE220A8397B1DCDAF
    assert int(splitmix64(0, np.array([1], np.uint64))[0]) == 0x6E789E6AA1B965F4


def test_hash_base_pinned_and_range():
    H = hash_base(7, 5, 3)
    assert H.dtype == np.float32 and H.shape == (5, 3)
    # h(seed, n*K + k) layout
    assert H[2, 1] == hash_unit(7, np.array([1 * 5 + 2], np.uint64))[0]
    big = hash_base(123, 300, 200)
    assert big.min() >= -1.0 and big.max() < 1.0
    assert abs(float(big.mean())) < 0.01 and abs(float(big.std()) - 1 / np.sqrt(3)) < 0.01
    # exactly k / 2^23 values
    assert np.all((big.astype(np.float64) * 2 ** 23) == np.round(big.astype(np.float64) * 2 ** 23))
    # pinned: the same seed gives these bits on every machine
    v = hash_unit(0, np.arange(4, dtype=np.uint64))
    z = splitmix64(0, np.arange(4, dtype=np.uint64))
    want = (((z >> np.uint64(40)).astype(np.int64) - (1 << 23)) / 2 ** 23).astype(np.float32)
    assert np.array_equal(v, want)
    assert v[0] == np.float32(((0xE220A8397B1DCDAF >> 40) - (1 << 23)) / 2 ** 23)


def test_reference_full_and_mask():
    K, N, B = 100, 9, 32
    rp, bi, d = random_layer(K, N, B, 3)
    W = proc_full(K, N, B, 7, 0.05, rp, bi, d)
    x = np.random.default_rng(1).standard_normal((4, K))
    np.testing.assert_allclose(ref(x, K, N, B, rp, bi, d), x @ W.astype(np.float64), rtol=1e-12, atol=1e-12)
    mask = np.array([1, 0, 1, 1], np.float32)
    keep = np.repeat(mask != 0, B)[:K]
    np.testing.assert_allclose(ref(x, K, N, B, rp, bi, d, mask=mask), (x * keep) @ W.astype(np.float64), atol=1e-12)
    assert np.array_equal(psb.reconstruct(K, N, B, 7, 0.05, rp, bi, d), W)   # builder's vectorized form


# --------------------------------------------------------------------------- kernel vs reference
def _session(model, **kw):
    return custom_ops.session(model, **kw)


def _check_cases(tag=""):
    rng = np.random.default_rng(5)
    for K, N, B, fan in CASES:
        rp, bi, d = random_layer(K, N, B, fan, rng_seed=K + N)
        for scale in (0.05, 0.0):
            s = _session(proc_model(K, N, B, rp, bi, d, scale=scale))
            for M in (1, 7, 128):
                x = rng.standard_normal((M, K)).astype(np.float32)
                y = s.run(None, {"X": x})[0]
                r = ref(x, K, N, B, rp, bi, d, scale=scale)
                tol = 2e-6 * max(1.0, float(np.abs(r).max()))
                assert np.abs(y - r).max() <= tol * np.sqrt(K), (tag, K, N, B, M, scale, np.abs(y - r).max())
            # regenerated weights bit-identical to numpy: X = I gives Y = Ŵ exactly
            y = s.run(None, {"X": np.eye(K, dtype=np.float32)})[0]
            W = proc_full(K, N, B, 7, scale, rp, bi, d)
            assert np.array_equal(y + 0.0, W + 0.0), (tag, K, N, B, scale)
    # gating mask, [nb] and [M, nb]
    K, N, B = 300, 50, 32
    nb = 10
    rp, bi, d = random_layer(K, N, B, 6)
    s = _session(proc_model(K, N, B, rp, bi, d, mask=True))
    for M in (1, 7, 128):
        x = rng.standard_normal((M, K)).astype(np.float32)
        for mk in ((rng.random(nb) > 0.5).astype(np.float32), (rng.random((M, nb)) > 0.5).astype(np.float32)):
            y = s.run(None, {"X": x, "mask": mk})[0]
            np.testing.assert_allclose(y, ref(x, K, N, B, rp, bi, d, mask=mk), atol=2e-5, rtol=1e-5)
        y = s.run(None, {"X": x, "mask": np.zeros(0, np.float32)})[0]          # empty mask = no gating
        np.testing.assert_allclose(y, ref(x, K, N, B, rp, bi, d), atol=2e-5, rtol=1e-5)


@native
def test_kernel_matches_reference():
    _check_cases(custom_ops.isa())


def _isa_worker():
    want = os.environ["ORTLEAN_ISA"]
    assert custom_ops.isa() == want, (custom_ops.isa(), want)
    _check_cases(want)
    # weights of one fixed layer, for the cross-ISA bit comparison
    K, N, B = 577, 130, 32
    rp, bi, d = random_layer(K, N, B, 12, rng_seed=3)
    s = _session(proc_model(K, N, B, rp, bi, d, seed=-12345, scale=0.7))
    y = s.run(None, {"X": np.eye(K, dtype=np.float32)})[0]
    import hashlib

    print("WEIGHTS", hashlib.sha1((y + 0.0).tobytes()).hexdigest())
    print(f"ISA-OK {want}")


def _cpu_isas():
    txt = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    out = ["scalar"]
    if " avx2" in txt and " fma" in txt:
        out.append("avx2")
        if all(f" {f}" in txt for f in ("avx512f", "avx512bw", "avx512dq", "avx512vl")):
            out.append("avx512")
    return out


@native
def test_every_isa_path_and_bit_identical_weights():
    digests = {}
    for isa in _cpu_isas():
        env = dict(os.environ, ORTLEAN_ISA=isa, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        code = ("import importlib.util, sys; "
                f"spec = importlib.util.spec_from_file_location('psk', {str(Path(__file__))!r}); "
                "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m._isa_worker()")
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"ISA-OK {isa}" in p.stdout
        digests[isa] = next(l.split()[1] for l in p.stdout.splitlines() if l.startswith("WEIGHTS"))
    K, N, B = 577, 130, 32
    rp, bi, d = random_layer(K, N, B, 12, rng_seed=3)
    import hashlib

    want = hashlib.sha1((proc_full(K, N, B, -12345, 0.7, rp, bi, d) + 0.0).tobytes()).hexdigest()
    assert set(digests.values()) == {want}, digests


@native
def test_all_blocks_base_zero_reproduces_dense():
    rng = np.random.default_rng(2)
    K, N = 200, 77
    W = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    cfg = ps.ProcConfig(enabled=True, fanout="all", base_scale="0", shed_eps=0.0, watermark=0, refit=False, block=32)
    nb = (K + 31) // 32
    keep = np.ones((nb, N), bool)
    lay = psb.build_layer(W, None, keep, cfg, nb, psb.block_scores(W, None, 32))
    assert lay.nnzb == nb * N and lay.base_scale == 0.0
    assert np.array_equal(lay.dense(), W)
    s = _session(proc_model(K, N, 32, lay.row_ptr, lay.block_idx, lay.deltas, seed=lay.seed, scale=0.0))
    for M in (1, 7, 128):
        x = rng.standard_normal((M, K)).astype(np.float32)
        np.testing.assert_allclose(s.run(None, {"X": x})[0], x.astype(np.float64) @ W, rtol=1e-5, atol=1e-5)
    # with a base: still the same function (deltas absorb it)
    cfg.base_scale = "0.05"
    lay = psb.build_layer(W, None, keep, cfg, nb, psb.block_scores(W, None, 32))
    np.testing.assert_allclose(lay.dense(), W, atol=1e-7)


@native
def test_metrics_and_reentrancy():
    K, N, B = 577, 130, 32
    rp, bi, d = random_layer(K, N, B, 12)
    s = _session(proc_model(K, N, B, rp, bi, d, name="ps_metrics", attrs={"trims": 5, "speedup": 1.25}))
    rng = np.random.default_rng(9)
    xs = [rng.standard_normal((m, K)).astype(np.float32) for m in (1, 7, 128, 3)]
    want = [ref(x, K, N, B, rp, bi, d) for x in xs]
    errors = []

    def worker():
        try:
            for _ in range(10):
                for x, w in zip(xs, want):
                    np.testing.assert_allclose(s.run(None, {"X": x})[0], w, atol=5e-5, rtol=1e-4)
        except Exception as e:  # pragma: no cover
            errors.append(e)

    ts = [threading.Thread(target=worker) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[0]
    m = custom_ops.metrics()["ps_metrics"]
    assert m["proc.enabled"] == 1 and m["proc.block"] == 32 and m["proc.trims"] == 5 and m["proc.speedup"] == 1.25
    assert m["proc.effective_fanout"] == pytest.approx(len(bi) / N)
    assert m["proc.mem_saved"] == pytest.approx(1 - 4 * (len(bi) * 33 + N + 1) / (4 * K * N))
    assert m["proc.calls"] >= 40 and m["proc.rows"] >= 40 * (1 + 7 + 128 + 3) // 4
    assert m["proc.blocks_visited"] >= len(bi) * 40


@native
def test_leading_dims_and_empty():
    K, N, B = 70, 11, 32
    rp, bi, d = random_layer(K, N, B, 3)
    s = _session(proc_model(K, N, B, rp, bi, d, xshape=["a", "b", K]))
    x = np.random.default_rng(0).standard_normal((2, 3, K)).astype(np.float32)
    np.testing.assert_allclose(s.run(None, {"X": x})[0], ref(x, K, N, B, rp, bi, d), atol=1e-5)
    assert s.run(None, {"X": np.zeros((0, 3, K), np.float32)})[0].shape == (0, 3, N)
    # a layer with no stored block at all is the zero map
    rp0 = np.zeros(N + 1, np.int32)
    s = _session(proc_model(K, N, B, rp0, np.zeros(0, np.int32), np.zeros((0, B), np.float32), xshape=["M", K]))
    assert not s.run(None, {"X": np.ones((2, K), np.float32)})[0].any()


def _create_error(model) -> str:
    with pytest.raises(Exception) as e:
        _session(model)
    return str(e.value)


@native
def test_bad_attributes_rejected_with_node_name():
    K, N, B = 100, 9, 32
    rp, bi, d = random_layer(K, N, B, 3)
    cases = {
        "block must be 32 or 64": dict(attrs={"block": 48}),
        "missing attribute 'shape'": dict(drop=("shape",)),
        "shape must be [K, N]": dict(attrs={"shape": [K]}),
        "base_scale must be finite": dict(attrs={"base_scale": float("nan")}),
        "fanout must be >= 0": dict(attrs={"fanout": -1}),
        "target must be": dict(attrs={"target": "ffn"}),
        "row_ptr has shape": dict(attrs={"shape": [K, N + 1]}),
        "> fanout 1": dict(attrs={"fanout": 1}),
        "> watermark 32": dict(attrs={"watermark": 32}),
        "must be a constant initializer": dict(const=False),
    }
    if not any(np.diff(rp) > 1):
        pytest.skip("random layer has no row with 2 blocks")
    for want, kw in cases.items():
        msg = _create_error(proc_model(K, N, B, rp, bi, d, name="bad_node", **kw))
        assert "bad_node" in msg and want in msg, (want, msg)
    # structural errors in the stored blocks
    bad_bi = bi.copy()
    bad_bi[0] = 99
    msg = _create_error(proc_model(K, N, B, rp, bad_bi, d, name="bad_idx"))
    assert "bad_idx" in msg and "outside [0, 4)" in msg
    j = int(np.nonzero(np.diff(rp) > 1)[0][0])
    bad_bi = bi.copy()
    bad_bi[rp[j] + 1] = bad_bi[rp[j]]
    msg = _create_error(proc_model(K, N, B, rp, bad_bi, d, name="bad_order"))
    assert "strictly increasing" in msg
    msg = _create_error(proc_model(K, N, B, rp, bi, d[:, :16], name="bad_d"))
    assert "deltas has shape" in msg
    bad_rp = rp.copy()
    bad_rp[0] = 1
    assert "row_ptr[0] must be 0" in _create_error(proc_model(K, N, B, bad_rp, bi, d))


@native
def test_bad_runtime_inputs():
    K, N, B = 100, 9, 32
    rp, bi, d = random_layer(K, N, B, 3)
    s = _session(proc_model(K, N, B, rp, bi, d, mask=True, name="rt"))
    x = np.ones((3, K), np.float32)
    with pytest.raises(Exception, match="block_mask has shape"):
        s.run(None, {"X": x, "mask": np.ones(5, np.float32)})
    with pytest.raises(Exception, match="block_mask has shape"):
        s.run(None, {"X": x, "mask": np.ones((2, 4), np.float32)})


@native
def test_reference_backend_runs_the_op():
    K, N, B = 100, 9, 32
    rp, bi, d = random_layer(K, N, B, 3)
    model = proc_model(K, N, B, rp, bi, d, mask=True)
    x = np.random.default_rng(0).standard_normal((4, K)).astype(np.float32)
    mk = np.array([1, 0, 1, 1], np.float32)
    y_ref = custom_ops.session(model, backend="reference").run(None, {"X": x, "mask": mk})[0]
    y_nat = custom_ops.session(model).run(None, {"X": x, "mask": mk})[0]
    np.testing.assert_allclose(y_nat, y_ref, atol=1e-5)


# --------------------------------------------------------------------------- builder
def _gram(rng, K, T=2000):
    X = rng.standard_normal((T, K)) * np.exp(rng.standard_normal(K))   # uneven channel scales
    return X.T @ X


def test_shedding_bounds():
    rng = np.random.default_rng(0)
    K, N, B = 320, 64, 32
    W = (rng.standard_normal((K, N)) * 0.02).astype(np.float32)
    W[:64, :10] *= 1e-3             # two blocks of ten rows are tiny: soft shedding trims them
    nb = K // B
    S = psb.block_scores(W, None, B)
    cfg = ps.ProcConfig(enabled=True, fanout="all", base_scale="0", shed_eps=1e-3, watermark=4 * B, refit=False, block=B)
    lay = psb.build_layer(W, None, np.ones((nb, N), bool), cfg, nb, S)
    counts = np.diff(lay.row_ptr)
    assert counts.max() <= 4                                  # hard: watermark / B blocks per row
    assert np.all(np.abs(lay.deltas).max(axis=1) >= 1e-3)    # soft: no stored block entirely below eps
    assert lay.trims == int(nb * N - lay.nnzb)
    # the kept blocks of a row are its best ones by score
    for n in range(N):
        kept = set(lay.block_idx[lay.row_ptr[n]:lay.row_ptr[n + 1]].tolist())
        order = np.argsort(-S[:, n], kind="stable")
        assert kept == set(order[:len(kept)].tolist()) or len(kept) < 4


def test_config_validation():
    from rewriter.errors import OrtleanError

    for kw in (dict(block=48), dict(gap=-1), dict(watermark=-1), dict(watermark=16), dict(shed_eps=-1),
               dict(max_bytes=0), dict(fanout="0"), dict(fanout="1.5"), dict(fanout="x"), dict(base_scale="abc"),
               dict(base_scale="inf")):
        with pytest.raises(OrtleanError):
            ps.ProcConfig(enabled=True, **kw).validate()
    c = ps.ProcConfig(enabled=True, fanout="0.5", watermark=0)
    assert c.fanout_cap(18) == 9
    c = ps.ProcConfig(enabled=True, fanout="64", watermark=128, block=32)
    assert c.fanout_cap(18) == 4


def test_selection_and_refit_use_calibration():
    """Activation-weighted scores beat |W| on uneven activations; the refit lowers the gap; base_scale
    'fit' is the least-squares value (≈ 0: the hash carries no information about W)."""
    rng = np.random.default_rng(1)
    K, N, B = 256, 96, 32
    W = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    G = _gram(rng, K)
    nb = K // B
    T = nb * N // 2
    base = dict(enabled=True, fanout="all", base_scale="0", shed_eps=0.0, watermark=0, block=B)
    gaps = {}
    for label, S, refit in (("naive", psb.block_scores(W, None, B), False), ("act", psb.block_scores(W, G, B), False),
                            ("act+refit", psb.block_scores(W, G, B), True)):
        cfg = ps.ProcConfig(refit=refit, **base)
        lay = psb.build_layer(W, G, psb.select_blocks(S, T, nb), cfg, nb, S)
        gaps[label] = psb.layer_gap(W, G, lay)
    assert gaps["act"] < gaps["naive"] and gaps["act+refit"] < gaps["act"], gaps
    cfg = ps.ProcConfig(refit=False, **{**base, "base_scale": "fit"})
    S = psb.block_scores(W, G, B)
    lay = psb.build_layer(W, G, psb.select_blocks(S, T, nb), cfg, nb, S)
    assert abs(lay.base_scale) < 0.01


def test_plan_layer_converts_block_sparse_and_refuses_dense():
    rng = np.random.default_rng(3)
    K, N, B = 256, 80, 32
    nb = K // B
    W = np.zeros((K, N), np.float32)
    for n in range(N):                       # truly 3 blocks per row (+ tiny noise)
        for b in rng.choice(nb, 3, replace=False):
            W[b * B:(b + 1) * B, n] = rng.standard_normal(B) * 0.05
    W += (rng.standard_normal((K, N)) * 1e-5).astype(np.float32)
    G = _gram(rng, K)
    cfg = ps.ProcConfig(enabled=True, fanout="all", gap=0.02, speed_check=False, shed_eps=0.0)
    p = ps.plan_layer(W, G, cfg, 1)
    assert p.decision == "procsparse" and p.gap <= 0.02
    assert p.layer.nnzb <= 3 * N + 5 and p.layer.bytes <= 0.5 * 4 * K * N
    # a dense random layer cannot meet 2 % with ≤ 50 % of the bytes: dense, and the reason says so
    Wr = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    p = ps.plan_layer(Wr, G, cfg, 1)
    assert p.decision == "dense" and "gap too high" in p.reason and "of dense bytes" in p.reason


def test_plan_layer_speed_check_measures_against_dense(tmp_path, monkeypatch):
    """With the speed check on, the plan carries a same-run timing of the op vs dense MatMul
    (M = 1 and 128), cached in speed.json."""
    monkeypatch.setenv("ORTLEAN_CACHE", str(tmp_path))
    rng = np.random.default_rng(5)
    K, N, B = 256, 80, 32
    nb = K // B
    W = np.zeros((K, N), np.float32)
    for n in range(N):
        for b in rng.choice(nb, 2, replace=False):
            W[b * B:(b + 1) * B, n] = rng.standard_normal(B) * 0.05
    cfg = ps.ProcConfig(enabled=True, fanout="all", gap=0.02, speed_check=True, min_speedup=1e-6, shed_eps=0.0)
    p = ps.plan_layer(W, _gram(rng, K), cfg, 1)
    assert p.decision == "procsparse"
    for M in ("M1", "M128"):
        r = p.speed[M]
        assert set(r) == {"dense", "proc", "speedup"} and r["dense"] > 0 and r["proc"] > 0
        assert r["speedup"] == pytest.approx(r["dense"] / r["proc"])
    assert (tmp_path / "speed.json").is_file()


def test_channel_gap_rejects_massive_channel_layers():
    """One output channel with a huge activation energy: the plain output gap is met by keeping
    that channel's blocks only; the per-channel gap (default on) refuses it."""
    rng = np.random.default_rng(4)
    K, N, B = 256, 64, 32
    W = (rng.standard_normal((K, N)) * 0.02).astype(np.float32)
    W[:, 0] *= 300.0
    G = _gram(rng, K)
    on = ps.ProcConfig(enabled=True, fanout="all", gap=0.05, speed_check=False, shed_eps=0.0)
    off = ps.ProcConfig(enabled=True, fanout="all", gap=0.05, speed_check=False, shed_eps=0.0, channel_gap=False)
    p_off = ps.plan_layer(W, G, off, 1)
    assert p_off.decision == "procsparse" and p_off.layer.gap_channels > 0.5
    p_on = ps.plan_layer(W, G, on, 1)
    assert p_on.decision == "dense" and "per-channel" in p_on.reason


# --------------------------------------------------------------------------- rewriter end to end
def _run_cli(*args):
    p = subprocess.run([sys.executable, "-m", "rewriter.cli", *map(str, args)], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return p.returncode, p.stdout, p.stderr


@native
def test_rewrite_toy_model(toy_model, toy_text, tmp_path):
    out = tmp_path / "lean.onnx"
    rep = tmp_path / "r.json"
    rc, so, se = _run_cli("rewrite", toy_model, "-o", out, "--proc-sparse=on", "--proc-target=all", "--proc-gap=0.6",
                          "--proc-fanout=all", "--proc-max-bytes=1.0", "--proc-speed-check=off", "--proc-block=32",
                          "--calib-text", toy_text, "--calib-tokens", "1024", "--calib-window", "64",
                          "--quality-budget=off", "--report", rep, "-q")
    assert rc == 0, so + se
    r = json.loads(rep.read_text())
    conv = [l for l in r["layers"] if l["backend"] == "procsparse"]
    assert conv, r["layers"]
    assert all(l["gap"] <= 0.6 and l["extra"]["blocks"] >= 1 for l in conv)
    import onnx

    m = onnx.load(str(out))
    nodes = [n for n in m.graph.node if n.op_type == "ProcSparseMatMul"]
    assert len(nodes) == len(conv)
    # the rewritten model runs natively and on the references, with the same outputs
    import onnxruntime as ort  # noqa: F401
    from custom_ops import runtime

    io = runtime.ModelIO.from_model(str(out))
    s_nat = custom_ops.session(str(out))
    s_ref = custom_ops.session(str(out), backend="reference")
    feeds = runtime.feeds(io, np.arange(1, 9, dtype=np.int64)[None, :])
    a = s_nat.run(None, feeds)[0]
    b = s_ref.run(None, feeds)[0]
    np.testing.assert_allclose(a, b, atol=1e-3, rtol=1e-3)
    # exclusive with TT: with both on, a layer is taken by at most one backend
    rc, so, se = _run_cli("rewrite", toy_model, "-o", tmp_path / "both.onnx", "--tt=on", "--tt-target=all",
                          "--tt-gap=0.05", "--tt-speed-check=off", "--proc-sparse=on", "--proc-target=all",
                          "--proc-gap=0.6", "--proc-fanout=all", "--proc-max-bytes=1.0", "--proc-speed-check=off",
                          "--calib-text", toy_text, "--calib-tokens", "1024", "--calib-window", "64",
                          "--quality-budget=off", "--report", tmp_path / "b.json", "-q")
    assert rc == 0, so + se
    rb = json.loads((tmp_path / "b.json").read_text())
    assert {l["backend"] for l in rb["layers"]} <= {"tt", "procsparse", "dense"}
