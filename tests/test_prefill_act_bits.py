"""BlockQuantMatMul's prefill_act_bits: the activation integers of calls with M > 1 rows (a prompt's
prefill), while M = 1 (decode) keeps act_bits (docs/block-quant.md). The numpy reference's rule, the
kernels against it on every format, both row layouts, with and without glu, odd shapes and M = 1, 2, 7, 64
on every ISA path this machine runs; M = 1 bit for bit unchanged by the attribute, M > 1 bit for bit a
node of act_bits = prefill_act_bits; bad values refused naming the node; the rewriter's flag."""
from __future__ import annotations

import json
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
from conftest import requires_native  # noqa: E402
from custom_ops import schema  # noqa: E402
from custom_ops.reference import blockquant as bq  # noqa: E402
from test_block_quant import bq_model, glu_tolerance, tolerance, within  # noqa: E402

# every format the brief names (and q5_1, q4_f/32); split: the formats that take it
FORMATS = [("q4_0", None), ("q4_1", None), ("q5_0", None), ("q5_1", None), ("q8_0", None), ("q4_K", None),
           ("q5_K", None), ("q6_K", None), ("q4_f", 32), ("q4_f", 64)]
SPLIT = [("q4_0", None), ("q4_1", None), ("q5_0", None), ("q8_0", None), ("q4_f", 32)]
# K not a multiple of 32 nor 256 (300, 1000), one block (40 < 256 for the K formats); N odd and not a multiple
# of the kernels' row groups (8) or tiles (64): 17, 13, 67; glu needs an even N
SHAPES = [(40, 17), (300, 13), (1000, 67)]
GLU_SHAPES = [(40, 18), (300, 14), (1000, 66)]
MS = (1, 2, 7, 64)
# (act_bits, prefill_act_bits): the lossless recipe's 16 with int8 prompts, and the other way round
PAIRS = ((16, 8), (8, 16))


def _x(rng, M, K):
    X = (rng.standard_normal((M, K)) * rng.uniform(0.1, 10, (M, 1))).astype(np.float32)
    if M > 1:   # int16's worst case: every block at the clamp
        X[-1] = np.where(rng.random(K) < 0.5, -3.0, 3.0)
    return X


def _warm(*sessions, K):
    """Past the kernel's pool probe (its first 8 decode calls): until then an M = 1 call's tasks, and so its
    rows' summation order, follow the pool's threads as counted so far; after it they are fixed."""
    x = np.ones((1, K), np.float32)
    for s in sessions:
        for _ in range(9):
            s.run(None, {"X": x})
    return sessions


def _check(cases, shapes, ms, seed=0, layout="blocks", glu=False) -> list:
    """Kernel vs reference for every case x shape x (act_bits, prefill_act_bits) x M, bias on odd shapes;
    and bit for bit: M > 1 equals the node of act_bits = prefill_act_bits (2 threads: the M > 1 tiles do not
    depend on the pool), M = 1 the node without the attribute (1 thread: the M = 1 tasks' rows, and so a
    row's summation order, follow the pool's threads as the kernel counts them). Returns the failures."""
    bad = []
    for ci, (fmt, bs) in enumerate(cases):
        for K, N in shapes:
            rng = np.random.default_rng([seed, ci, K, N, int(glu)])
            W = bq.random_blocks(fmt, N, K, rng, bs)
            Wl = bq.to_split(W, fmt, K, bs) if layout == "split" else W
            la = {"layout": "split"} if layout == "split" else {}
            if glu:
                la["glu"] = "silu"
            bias = rng.standard_normal(N).astype(np.float32) if N % 2 else None
            for ab, pb in PAIRS:
                def sess(bits, pre=None, tag="", threads=2):
                    a = dict(la, **({"prefill_act_bits": pre} if pre is not None else {}))
                    return custom_ops.session(bq_model(Wl, fmt, K, N, bs, bias, name=f"pab_{fmt}{tag}",
                                                       act_bits=bits, attrs=a), threads=threads)
                s, other = sess(ab, pb), sess(pb, tag="_other")
                s1, plain1 = _warm(sess(ab, pb, "_1", threads=1), sess(ab, tag="_plain1", threads=1), K=K)
                for M in ms:
                    X = _x(rng, M, K)
                    y = s.run(None, {"X": X})[0]
                    kw = dict(format=fmt, K=K, N=N, block_size=bs, act_bits=ab, prefill_act_bits=pb)
                    ref = bq.op(X, W, bias, **kw, **({"glu": "silu"} if glu else {}))
                    bits = pb if M > 1 else ab
                    if glu:
                        tol = glu_tolerance(X, W, fmt, K, bs, bits, bq.op(X, W, bias, **kw))
                    else:
                        tol = tolerance(X, W, fmt, K, bs, bits) + 1e-6 * (bias is not None)
                    r = within(y, ref, tol) if y.shape == ref.shape else float("inf")
                    if not r <= 1.0:
                        bad.append((layout, fmt, bs, K, N, M, ab, pb, glu, "ref", r))
                    y, twin = (y, other.run(None, {"X": X})[0]) if M > 1 else \
                        (s1.run(None, {"X": X})[0], plain1.run(None, {"X": X})[0])
                    if not np.array_equal(y, twin, equal_nan=True):
                        bad.append((layout, fmt, bs, K, N, M, ab, pb, glu, "twin",
                                    float(np.nanmax(np.abs(y - twin)))))
    return bad


def _check_every(seed=0, ms=MS) -> list:
    bad = _check(FORMATS, SHAPES, ms, seed)
    bad += _check(SPLIT, [(40, 17), (576, 13), (1000, 67)], ms, seed, layout="split")
    bad += _check([("q4_1", None), ("q8_0", None), ("q4_K", None), ("q6_K", None)], GLU_SHAPES, ms, seed, glu=True)
    bad += _check([("q4_1", None), ("q5_0", None)], [(576, 14)], ms, seed, layout="split", glu=True)
    return bad


# ------------------------------------------------------------------ the reference (numpy only)
def test_reference_rule():
    """Rows of a call with M > 1 are those of act_bits = prefill_act_bits; M = 1 (any leading dims of 1)
    keeps act_bits; 0 / absent = act_bits; a bad value is refused."""
    rng = np.random.default_rng(3)
    K, N = 300, 9
    W = bq.random_blocks("q4_K", N, K, rng)
    X = rng.standard_normal((5, K)).astype(np.float32)
    kw = dict(format="q4_K", K=K, N=N)
    for ab, pb in PAIRS:
        y = bq.op(X, W, act_bits=ab, prefill_act_bits=pb, **kw)
        assert np.array_equal(y, bq.op(X, W, act_bits=pb, **kw))
        for shape in ((1, K), (1, 1, K), (K,)):
            x1 = X[0].reshape(shape)
            assert np.array_equal(bq.op(x1, W, act_bits=ab, prefill_act_bits=pb, **kw), bq.op(x1, W, act_bits=ab, **kw))
        x3 = X[:2].reshape(2, 1, K)     # M = 2 through leading dims
        assert np.array_equal(bq.op(x3, W, act_bits=ab, prefill_act_bits=pb, **kw), bq.op(x3, W, act_bits=pb, **kw))
        assert np.array_equal(bq.op(X, W, act_bits=ab, prefill_act_bits=0, **kw), bq.op(X, W, act_bits=ab, **kw))
    assert not np.array_equal(bq.op(X, W, act_bits=16, prefill_act_bits=8, **kw), bq.op(X, W, act_bits=16, **kw))
    assert bq.call_act_bits(1, 16, 8) == 16 and bq.call_act_bits(2, 16, 8) == 8 and bq.call_act_bits(7, 16, 0) == 16
    for bad in (4, 12, 32, -1):
        with pytest.raises(ValueError, match=f"prefill_act_bits must be 0 \\(as act_bits\\), 8 or 16, got {bad}"):
            bq.op(X, W, prefill_act_bits=bad, **kw)
    s = schema.get("BlockQuantMatMul")
    assert s.defaults()["prefill_act_bits"] == 0
    assert not s.problems({"format": "q4_0", "K": 5, "N": 2, "act_bits": 16, "prefill_act_bits": 8})
    assert s.problems({"format": "q4_0", "K": 5, "N": 2, "prefill_act_bits": 12})
    assert "prefill_act_bits" not in {a.name for a in schema.get("BlockQuantGather").attrs}


def test_reference_backend_follows_the_rule():
    """The reference inside ORT (onnxruntime-extensions, tables from the schema): the same rule."""
    pytest.importorskip("onnxruntime_extensions")
    rng = np.random.default_rng(4)
    K, N = 96, 6
    W = bq.random_blocks("q5_0", N, K, rng)
    r = custom_ops.session(bq_model(W, "q5_0", K, N, act_bits=16, attrs={"prefill_act_bits": 8}), backend="reference")
    for M in (1, 3):
        X = rng.standard_normal((M, K)).astype(np.float32)
        assert np.array_equal(r.run(None, {"X": X})[0], bq.op(X, W, format="q5_0", K=K, N=N, act_bits=8 if M > 1 else 16))


# ------------------------------------------------------------------ the kernels
@requires_native
def test_kernel_vs_reference():
    """This process's ISA path: every format, both layouts, glu, M = 1, 2, 7, 64."""
    assert not _check_every()


_ISA_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests")
import custom_ops
from test_prefill_act_bits import _check_every
bad = _check_every(seed=5)
print(json.dumps({"isa": custom_ops.op_isas()["BlockQuantMatMul"], "bad": bad}))
"""


def _amx_tiles() -> bool:
    """Whether this process's M > 1 products run on AMX tiles (bq.amx_tiles of a node)."""
    W = bq.random_blocks("q4_0", 2, 32, np.random.default_rng(0))
    custom_ops.session(bq_model(W, "q4_0", 32, 2, name="pab_tiles"))
    return custom_ops.metrics()["pab_tiles"].get("bq.amx_tiles") == 1


@requires_native
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512", "avx512-noamx"])
def test_isa_paths(isa):
    """Each ISA path in a subprocess (ORTLEAN_ISA; avx512-noamx: ORTLEAN_AMX=0, the vpdpbusd panels where this
    process runs AMX tiles); the one this process runs is test_kernel_vs_reference's."""
    env = dict(os.environ, ORTLEAN_ISA=isa.split("-")[0])
    if isa == "avx512-noamx":
        if custom_ops.op_isas()["BlockQuantMatMul"] != "avx512" or not _amx_tiles():
            pytest.skip("no AMX tiles here: the avx512 path is the vpdpbusd one")
        env["ORTLEAN_AMX"] = "0"
    elif custom_ops.op_isas()["BlockQuantMatMul"] == isa:
        pytest.skip(f"{isa} is this process's path (test_kernel_vs_reference)")
    r = subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(ROOT)], env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    if res["isa"] != isa.split("-")[0]:
        pytest.skip(f"CPU runs BlockQuantMatMul at {res['isa']}, not {isa}")
    assert not res["bad"], res["bad"]


@requires_native
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_and_prefill_interleaved_on_one_session(threads):
    """One kernel instance serves both: prompt calls and decode calls alternating, and concurrently from two
    threads, each give their own rule's result — no per-call state in the kernel. Bit for bit against the
    nodes of act_bits 16 (M = 1) and 8 (M > 1), past the pool probe (_warm), except M = 1 on 2 threads, whose
    tasks follow the threads the probe saw (within the tolerance there)."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(9)
    K, N = 576, 130
    W = bq.random_blocks("q4_1", N, K, rng)
    S = bq.to_split(W, "q4_1", K)

    def sess(name, bits, **a):
        return custom_ops.session(bq_model(S, "q4_1", K, N, name=name, act_bits=bits, attrs={"layout": "split", **a}),
                                  threads=threads)

    s, plain, eight = _warm(sess("pab_mix", 16, prefill_act_bits=8), sess("pab_mix16", 16), sess("pab_mix8", 8), K=K)
    xs = [rng.standard_normal((m, K)).astype(np.float32) for m in (1, 9, 1, 33, 1, 2) * 3]
    want = [(plain if len(x) == 1 else eight).run(None, {"X": x})[0] for x in xs]

    def same(x, g, w):
        if len(x) > 1 or threads == 1:
            return np.array_equal(g, w)
        return within(g, w, 2 * tolerance(x, W, "q4_1", K, None, 16)) <= 1.0

    assert all(same(x, s.run(None, {"X": x})[0], w) for x, w in zip(xs, want))
    with ThreadPoolExecutor(2) as ex:
        got = list(ex.map(lambda x: s.run(None, {"X": x})[0], xs * 3))
    assert all(same(x, g, w) for x, g, w in zip(xs * 3, got, want * 3))


@requires_native
def test_bad_values_refused_naming_the_node_and_metrics():
    rng = np.random.default_rng(1)
    W = bq.random_blocks("q4_0", 5, 64, rng)
    for bits in (4, 12, 32, -1, 1):
        with pytest.raises(Exception, match=rf"node 'pab_bad'.*attribute prefill_act_bits must be 0 \(as act_bits\), "
                                            rf"8 or 16, got {bits}"):
            custom_ops.session(bq_model(W, "q4_0", 64, 5, name="pab_bad", act_bits=16,
                                        attrs={"prefill_act_bits": bits}))
    for name, ab, pb, want in (("pab_m0", 16, None, 16), ("pab_m1", 16, 8, 8), ("pab_m2", 8, 0, 8), ("pab_m3", 8, 16, 16)):
        attrs = {"prefill_act_bits": pb} if pb is not None else None
        custom_ops.session(bq_model(W, "q4_0", 64, 5, name=name, act_bits=ab, attrs=attrs)).run(
            None, {"X": np.ones((1, 64), np.float32)})
        m = custom_ops.metrics()[name]
        assert m["bq.act_bits"] == ab and m["bq.prefill_act_bits"] == want, (name, m)


# ------------------------------------------------------------------ the rewriter
try:   # the tiny GGUF-born model of the layout tests (needs gguf-py; the tests below skip without it)
    from test_block_quant_layout import _a, _bq, _rewrite, tiny  # noqa: F401 (tiny: a fixture)
except pytest.skip.Exception:
    tiny = None


def test_rewriter_flag():
    """--weights-prefill-act-bits auto|8|16: auto leaves prefill_act_bits out (the decode act_bits), 8 / 16
    resolve per layer and are written only where they differ from the layer's act_bits."""
    from rewriter.backends.weights import WeightsConfig

    cfg = WeightsConfig()
    assert cfg.prefill_act_bits == "auto"
    assert cfg.prefill_act_bits_for(16) == 0 and cfg.prefill_act_bits_for(8) == 0
    cfg.prefill_act_bits = "8"
    assert cfg.prefill_act_bits_for(16) == 8 and cfg.prefill_act_bits_for(8) == 0
    cfg.prefill_act_bits = "16"
    assert cfg.prefill_act_bits_for(8) == 16 and cfg.prefill_act_bits_for(16) == 0


@requires_native
@pytest.mark.skipif(tiny is None, reason="needs gguf-py")
def test_rewrite_writes_the_attribute(tiny, tmp_path):
    """--weights-prefill-act-bits 8 on the lossless recipe: every act_bits 16 node (the GGUF's own blocks, the
    fused glu, the head) gets prefill_act_bits 8, the fallback's act_bits 8 node none; the model's one-row
    calls are the auto rewrite's bit for bit, its prompt calls the --weights-act-bits 8 rewrite's.
    16: written only where act_bits is 8. auto: not written."""
    import json

    out = {}
    for tag, flags in (("auto", []), ("p8", ["--weights-prefill-act-bits", "8"]),
                       ("p16", ["--weights-prefill-act-bits", "16"]), ("a8", ["--weights-act-bits", "8"])):
        o, r = tmp_path / tag / "model.onnx", tmp_path / tag / "report.json"
        assert _rewrite(tiny, o, "--report", str(r), *flags) == 0
        out[tag] = (o, json.loads(r.read_text()))
    pab, glu = {}, {}
    for tag in out:
        nodes, _ = _bq(out[tag][0])
        pab[tag] = {n.name: (_a(n).get("act_bits"), _a(n).get("prefill_act_bits"))
                    for n in nodes if n.op_type == "BlockQuantMatMul"}
        glu[tag] = [n.name for n in nodes if _a(n).get("glu") == "silu"]
    assert all(p is None for _, p in pab["auto"].values())
    assert pab["p8"] == {k: (a, 8 if a == 16 else None) for k, (a, _) in pab["auto"].items()}
    assert len(glu["p8"]) == 1 and pab["p8"][glu["p8"][0]] == (16, 8)      # gate and up fused with the attribute
    assert pab["p16"] == {k: (a, 16 if a == 8 else None) for k, (a, _) in pab["auto"].items()}
    assert pab["p16"]["/extra/MatMul_BQ"] == (8, 16)
    assert pab["p8"].keys() == pab["a8"].keys()
    rows = {r["layer"]: r.get("extra") or {} for r in out["p8"][1]["layers"]}
    assert rows["/a/MatMul"]["prefill_act_bits"] == 8 and "prefill_act_bits" not in rows["/extra/MatMul"]
    feeds = tiny["feeds"]
    sess = {t: custom_ops.session(str(out[t][0]), threads=1) for t in ("auto", "p8", "a8")}
    names = tiny["outs"]
    for t in sess:   # past the pool probe of every node (one-row calls)
        for _ in range(9):
            sess[t].run(names, {k: v[:, :1] for k, v in feeds.items()})
    one = {t: sess[t].run(names, {k: v[:, :1] for k, v in feeds.items()}) for t in sess}
    full = {t: sess[t].run(names, feeds) for t in sess}
    for n, a, b in zip(names, one["p8"], one["auto"]):
        assert np.array_equal(a, b), n
    for n, a, b in zip(names, full["p8"], full["a8"]):
        assert np.array_equal(a, b), n
    assert not np.array_equal(full["p8"][names.index("y_a")], full["auto"][names.index("y_a")])
