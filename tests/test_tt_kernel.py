"""Native TTMatMul kernel (libortlean_ops.so) against the numpy reference custom_ops.reference.tt.

Models are built by hand with onnx.helper: one TTMatMul node, cores as initializers (or as graph
inputs for the non-constant path). The ISA path is chosen once per process, so the per-ISA runs
happen in subprocesses with ORTLEAN_ISA set before the library loads.
"""
from __future__ import annotations

import json
import os
import shutil
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
from custom_ops.reference.tt import lowrank_cores, tt_matmul  # noqa: E402


def _native() -> bool:
    try:
        custom_ops.load_library()
        return True
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _native() and not os.environ.get("CI"),
                                reason="ortlean library not built (pip install -e .)")

ATTRS = dict(method="svd", gap=0.01, speedup=0.0, layer="layers.0", target="mlp")


# --------------------------------------------------------------------------- model building
def tt_model(cores, *, name="tt", scale=None, const=True, xshape=None, attrs=None, drop=(),
             core_dtype=None) -> bytes:
    mk = [int(c.shape[1]) for c in cores]
    mn = [int(c.shape[2]) for c in cores]
    ranks = [int(cores[0].shape[0])] + [int(c.shape[3]) for c in cores]
    K, N = int(np.prod(mk)), int(np.prod(mn))
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, xshape or ["M", K])]
    inits, names = [], ["X"]
    for i, c in enumerate(cores):
        nm = f"G{i + 1}"
        if core_dtype is not None:
            c = c.astype(core_dtype)
        if const:
            inits.append(numpy_helper.from_array(c, nm))
        else:
            elem = helper.np_dtype_to_tensor_dtype(c.dtype)
            inputs.append(helper.make_tensor_value_info(nm, elem, list(c.shape)))
        names.append(nm)
    names += [""] * (5 - len(names))
    if scale is not None:
        if const:
            inits.append(numpy_helper.from_array(scale, "x_scale"))
        else:
            inputs.append(helper.make_tensor_value_info("x_scale", TensorProto.FLOAT, [K]))
        names.append("x_scale")
    a = dict(modes_k=mk, modes_n=mn, ranks=ranks, params_dense=K * N,
             params_stored=int(sum(c.size for c in cores)), **ATTRS)
    a.update(attrs or {})
    for k in drop:
        a.pop(k)
    node = helper.make_node("TTMatMul", names, ["Y"], name=name, domain="ai.ortlean", **a)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.ortlean", 1)])
    model.ir_version = 10
    return model.SerializeToString()


def random_cores(rng, mk, mn, ranks, scale=1.0):
    return [(rng.standard_normal((ranks[i], mk[i], mn[i], ranks[i + 1])) * scale / np.sqrt(ranks[i] * mk[i]))
            .astype(np.float32) for i in range(len(mk))]


def tt_svd(W: np.ndarray, mk, mn) -> list[np.ndarray]:
    """Exact (untruncated) TT-matrix decomposition of W [K, N] (float64)."""
    d = len(mk)
    T = W.reshape(*mk, *mn)
    T = T.transpose([x for i in range(d) for x in (i, d + i)])  # (k1, n1, k2, n2, ...)
    cores, r = [], 1
    rest = T.reshape(r * mk[0] * mn[0], -1)
    for i in range(d - 1):
        U, s, Vt = np.linalg.svd(rest, full_matrices=False)
        keep = int((s > s[0] * 1e-13).sum()) if s.size else 0
        keep = max(keep, 1)
        cores.append(U[:, :keep].reshape(r, mk[i], mn[i], keep))
        rest = (s[:keep, None] * Vt[:keep]).reshape(keep * mk[i + 1] * mn[i + 1], -1)
        r = keep
    cores.append(rest.reshape(r, mk[-1], mn[-1], 1))
    return cores


def relerr(y, ref) -> float:
    return float(np.abs(y.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


def run(model: bytes, feeds: dict, threads=2):
    sess = custom_ops.session(model, threads=threads)
    return sess.run(None, feeds)[0]


# --------------------------------------------------------------------------- cases
# (id, modes_k, modes_n, ranks)
CASES = [
    ("lowrank_97x131_r13", [97, 1], [1, 131], [1, 13, 1]),
    ("lowrank_64x48_r1", [64, 1], [1, 48], [1, 1, 1]),
    ("lowrank_576x1536_r64", [576, 1], [1, 1536], [1, 64, 1]),
    ("d2_modes_7x9", [7, 9], [5, 11], [1, 6, 1]),
    ("d3_odd", [3, 5, 7], [4, 3, 11], [1, 6, 9, 1]),
    ("d3_rank1_tail", [8, 8, 9], [8, 12, 16], [1, 32, 24, 1]),
    ("d4_odd", [3, 1, 5, 3], [2, 5, 1, 7], [1, 4, 5, 3, 1]),
]


def check_case(mk, mn, ranks, *, M_list=(1, 7, 128), scale=False, const=True, threads=2, seed=0, tol=2e-5):
    rng = np.random.default_rng(seed)
    cores = random_cores(rng, mk, mn, ranks)
    K = int(np.prod(mk))
    s = rng.uniform(0.25, 2.0, K).astype(np.float32) if scale else None
    sess = custom_ops.session(tt_model(cores, scale=s, const=const), threads=threads)
    for M in M_list:
        x = rng.standard_normal((M, K)).astype(np.float32)
        feeds = {"X": x}
        if not const:
            feeds.update({f"G{i + 1}": c for i, c in enumerate(cores)})
            if s is not None:
                feeds["x_scale"] = s
        y = sess.run(None, feeds)[0]
        ref = tt_matmul(x.astype(np.float64), cores, s)
        assert y.shape == ref.shape and y.dtype == np.float32
        err = relerr(y, ref)
        assert err < tol, f"M={M} modes_k={mk} modes_n={mn} ranks={ranks}: rel err {err}"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("scale", [False, True], ids=["noscale", "scale"])
def test_matches_reference(case, scale):
    _, mk, mn, ranks = case
    check_case(mk, mn, ranks, scale=scale)


@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[6]], ids=[CASES[0][0], CASES[4][0], CASES[6][0]])
@pytest.mark.parametrize("scale", [False, True], ids=["noscale", "scale"])
def test_nonconstant_cores(case, scale):
    _, mk, mn, ranks = case
    check_case(mk, mn, ranks, scale=scale, const=False)


@pytest.mark.parametrize("threads", [1, 2])
def test_threads(threads):
    for _, mk, mn, ranks in (CASES[2], CASES[5]):
        check_case(mk, mn, ranks, threads=threads, M_list=(1, 3, 33))


def test_3d_input():
    rng = np.random.default_rng(1)
    for _, mk, mn, ranks in (CASES[0], CASES[4]):
        cores = random_cores(rng, mk, mn, ranks)
        K, N = int(np.prod(mk)), int(np.prod(mn))
        m = tt_model(cores, xshape=["B", "S", K])
        for shape in [(2, 5, K), (1, 1, K), (3, 64, K)]:
            x = rng.standard_normal(shape).astype(np.float32)
            y = run(m, {"X": x})
            assert y.shape == shape[:-1] + (N,)
            assert relerr(y, tt_matmul(x.astype(np.float64), cores)) < 2e-5


def test_1d_input_and_long_prefill():
    rng = np.random.default_rng(8)
    for _, mk, mn, ranks in (CASES[0], CASES[4]):
        cores = random_cores(rng, mk, mn, ranks)
        K, N = int(np.prod(mk)), int(np.prod(mn))
        x = rng.standard_normal(K).astype(np.float32)
        y = run(tt_model(cores, xshape=[K]), {"X": x})
        assert y.shape == (N,) and relerr(y, tt_matmul(x.astype(np.float64), cores)) < 2e-5
        x = rng.standard_normal((1001, K)).astype(np.float32)  # many row chunks and a ragged tail
        y = run(tt_model(cores), {"X": x})
        assert relerr(y, tt_matmul(x.astype(np.float64), cores)) < 2e-5


def test_empty_batch():
    rng = np.random.default_rng(2)
    cores = random_cores(rng, [5, 7], [3, 4], [1, 3, 1])
    y = run(tt_model(cores, xshape=["B", "S", 35]), {"X": np.zeros((0, 4, 35), np.float32)})
    assert y.shape == (0, 4, 12)


@pytest.mark.parametrize("mk,mn", [([97, 1], [1, 131]), ([4, 6, 5], [3, 7, 4]), ([2, 3, 2, 3], [3, 2, 2, 2])])
def test_full_rank_reproduces_dense(mk, mn):
    rng = np.random.default_rng(3)
    K, N = int(np.prod(mk)), int(np.prod(mn))
    W = rng.standard_normal((K, N))
    if len(mk) == 2 and mk[1] == 1:
        cores = lowrank_cores(W, np.eye(N))  # exact, rank N
    else:
        cores = [c.astype(np.float32) for c in tt_svd(W, mk, mn)]
    W32 = W.astype(np.float32).astype(np.float64)
    for M in (1, 7, 128):
        x = rng.standard_normal((M, K)).astype(np.float32)
        y = run(tt_model(cores), {"X": x})
        ref = x.astype(np.float64) @ W32
        assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-4


# --------------------------------------------------------------------------- validation
def _bad(rng):
    return random_cores(rng, [6, 5], [4, 3], [1, 3, 1])


def _expect_creation_error(model: bytes, node: str, *words):
    with pytest.raises(Exception) as ei:
        custom_ops.session(model, threads=1)
    msg = str(ei.value)
    assert node in msg, msg
    for w in words:
        assert w in msg, msg


def test_bad_ranks_length():
    cores = _bad(np.random.default_rng(0))
    _expect_creation_error(tt_model(cores, name="bad_ranks_len", attrs={"ranks": [1, 3, 3, 1]}), "bad_ranks_len",
                           "ranks")


def test_bad_rank_zero():
    cores = _bad(np.random.default_rng(0))
    _expect_creation_error(tt_model(cores, name="bad_rank0", attrs={"ranks": [1, 0, 1]}), "bad_rank0", "ranks")


def test_bad_modes_vs_core_shape():
    cores = _bad(np.random.default_rng(0))
    _expect_creation_error(tt_model(cores, name="bad_modes", attrs={"modes_k": [5, 6]}), "bad_modes", "shape")
    # graph-input cores with a static shape are checked too
    _expect_creation_error(tt_model(cores, name="bad_modes_in", const=False, attrs={"modes_n": [3, 4]}),
                           "bad_modes_in", "shape")


def test_bad_missing_attribute():
    cores = _bad(np.random.default_rng(0))
    _expect_creation_error(tt_model(cores, name="no_modes_n", drop=("modes_n",)), "no_modes_n", "modes_n")


def test_bad_core_dtype():
    cores = _bad(np.random.default_rng(0))
    _expect_creation_error(tt_model(cores, name="bad_dtype", core_dtype=np.float64), "bad_dtype")


def test_bad_scale_shape():
    rng = np.random.default_rng(0)
    cores = _bad(rng)
    _expect_creation_error(tt_model(cores, name="bad_scale", scale=np.ones(7, np.float32)), "bad_scale", "x_scale")


def test_bad_input_last_dim_at_run():
    rng = np.random.default_rng(0)
    cores = _bad(rng)
    sess = custom_ops.session(tt_model(cores, name="bad_x", xshape=["M", "K"]), threads=1)
    with pytest.raises(Exception) as ei:
        sess.run(None, {"X": np.zeros((2, 31), np.float32)})
    assert "bad_x" in str(ei.value) and "30" in str(ei.value)
    # the session still works afterwards
    x = rng.standard_normal((2, 30)).astype(np.float32)
    assert relerr(sess.run(None, {"X": x})[0], tt_matmul(x.astype(np.float64), cores)) < 2e-5


def test_bad_nonconstant_core_shape_at_run():
    rng = np.random.default_rng(0)
    cores = _bad(rng)
    m = tt_model([c for c in cores], name="bad_dyn", const=False)
    # make the declared input shapes symbolic so the mismatch reaches the kernel
    import onnx

    mp = onnx.load_from_string(m)
    for vi in mp.graph.input[1:]:
        for dim in vi.type.tensor_type.shape.dim:
            dim.dim_param = "d"
    sess = custom_ops.session(mp.SerializeToString(), threads=1)
    with pytest.raises(Exception) as ei:
        sess.run(None, {"X": np.zeros((1, 30), np.float32), "G1": cores[0], "G2": np.zeros((3, 5, 4, 1), np.float32)})
    assert "bad_dyn" in str(ei.value) and "G2" in str(ei.value)


# --------------------------------------------------------------------------- concurrency, metrics
def test_concurrent_runs_one_session():
    rng = np.random.default_rng(4)
    for _, mk, mn, ranks in (CASES[2], CASES[4]):
        cores = random_cores(rng, mk, mn, ranks)
        K = int(np.prod(mk))
        sess = custom_ops.session(tt_model(cores), threads=2)
        xs = [rng.standard_normal((M, K)).astype(np.float32) for M in (1, 5, 64, 1, 17, 128, 1, 2)]
        refs = [tt_matmul(x.astype(np.float64), cores) for x in xs]
        errors = []

        def worker(tid):
            try:
                for it in range(25):
                    i = (tid + it) % len(xs)
                    y = sess.run(None, {"X": xs[i]})[0]
                    if relerr(y, refs[i]) > 2e-5:
                        errors.append((tid, it, relerr(y, refs[i])))
            except Exception as e:  # pragma: no cover - reported below
                errors.append(repr(e))

        ts = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors[:5]


def test_metrics_keys_and_counts():
    rng = np.random.default_rng(5)
    cores = random_cores(rng, [3, 5, 7], [4, 3, 11], [1, 6, 9, 1])
    sess = custom_ops.session(tt_model(cores, name="metrics_node", attrs={"gap": 0.03, "speedup": 1.5}), threads=2)
    custom_ops.reset_metrics()
    for M in (1, 7, 128):
        sess.run(None, {"X": rng.standard_normal((M, 105)).astype(np.float32)})
    m = custom_ops.metrics()["metrics_node"]
    expected = {"tt.enabled", "tt.rank", "tt.gap", "tt.speedup", "tt.mem_saved", "tt.calls", "tt.rows",
                "tt.nonfinite_recomputes"}
    assert expected <= set(m)
    assert m["tt.enabled"] == 1 and m["tt.rank"] == 9
    assert m["tt.gap"] == pytest.approx(0.03) and m["tt.speedup"] == pytest.approx(1.5)
    stored = sum(c.size for c in cores)
    assert m["tt.mem_saved"] == pytest.approx(1 - stored / (105 * 132))
    assert m["tt.calls"] == 3 and m["tt.rows"] == 136 and m["tt.nonfinite_recomputes"] == 0
    custom_ops.reset_metrics()
    m = custom_ops.metrics()["metrics_node"]
    assert m["tt.calls"] == 0 and m["tt.rows"] == 0 and m["tt.rank"] == 9  # static values kept


def test_metrics_json_nonfinite_is_valid():
    rng = np.random.default_rng(6)
    cores = random_cores(rng, [6, 1], [1, 4], [1, 2, 1])
    custom_ops.session(tt_model(cores, name="nan_gap", attrs={"gap": float("nan")}), threads=1)
    lib = custom_ops.load_library()
    n = lib.ortlean_metrics_json(None, 0)
    import ctypes

    buf = ctypes.create_string_buffer(n + 1)
    assert lib.ortlean_metrics_json(buf, n + 1) == n
    data = json.loads(buf.value.decode())
    assert data["nan_gap"]["tt.gap"] is None
    small = ctypes.create_string_buffer(4)
    assert lib.ortlean_metrics_json(small, 4) == n  # too small: length still reported


@pytest.mark.parametrize("case", ["lowrank", "d3"])
def test_nonfinite_guard_recomputes_in_double(case):
    """Intermediate overflow in float32 (state ~1e40) with a finite true result: the guard
    recomputes the row in double precision and gets the finite answer."""
    rng = np.random.default_rng(7)
    if case == "lowrank":
        K, N, r = 40, 24, 4
        A = (rng.uniform(0.5, 1.0, (K, r)) * 1e30).astype(np.float32)
        B = (rng.uniform(0.5, 1.0, (r, N)) * 1e-30).astype(np.float32)
        cores = lowrank_cores(A, B)
    else:
        mk, mn, ranks = [4, 5, 2], [3, 2, 4], [1, 3, 2, 1]
        cores = [np.abs(c) + 0.1 for c in random_cores(rng, mk, mn, ranks)]
        cores[0] = (cores[0] * 1e30).astype(np.float32)
        cores[2] = (cores[2] * 1e-30).astype(np.float32)
        K = 40
    name = f"guard_{case}"
    sess = custom_ops.session(tt_model(cores, name=name), threads=2)
    custom_ops.reset_metrics()
    x = np.abs(rng.standard_normal((5, K))).astype(np.float32) * 1e10
    x[1] = 1e-3  # a row that stays finite in float32
    x[3, 0] = np.inf  # non-finite input row: not recomputed
    y = sess.run(None, {"X": x})[0]
    ref = tt_matmul(x.astype(np.float64), cores)
    ok = [0, 1, 2, 4]
    assert np.isfinite(y[ok]).all()
    assert relerr(y[ok], ref[ok]) < 1e-5
    assert not np.isfinite(y[3]).all()
    y1 = sess.run(None, {"X": x[:1]})[0]  # M = 1 path
    assert np.isfinite(y1).all() and relerr(y1, ref[:1]) < 1e-5
    m = custom_ops.metrics()[name]
    assert m["tt.nonfinite_recomputes"] == 4  # rows 0, 2, 4, then the M = 1 run


# --------------------------------------------------------------------------- ISA paths
def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _isa_supported(isa: str) -> bool:
    f = _cpu_flags()
    if isa == "avx2":
        return {"avx2", "fma"} <= f
    if isa == "avx512":
        return {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma"} <= f
    return True


def _isa_worker() -> None:
    """Runs in a subprocess with ORTLEAN_ISA set: the correctness cases on that ISA path."""
    want = os.environ["ORTLEAN_ISA"]
    got = custom_ops.isa()
    assert got == want, (got, want)
    for i, (_, mk, mn, ranks) in enumerate(CASES):
        for scale in (False, True):
            check_case(mk, mn, ranks, scale=scale, seed=i)
    check_case([97, 1], [1, 131], [1, 13, 1], const=False, scale=True)
    check_case([3, 5, 7], [4, 3, 11], [1, 6, 9, 1], const=False)
    check_case([576, 1], [1, 1536], [1, 64, 1], threads=1, M_list=(1, 2, 5))
    print("ISA-OK", got)


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_isa_paths(isa):
    if not _isa_supported(isa):
        pytest.skip(f"CPU lacks {isa}")
    env = dict(os.environ, ORTLEAN_ISA=isa, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('ttk', {str(Path(__file__))!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m._isa_worker()")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"ISA-OK {isa}" in p.stdout


def test_isa_clamped_or_invalid_env():
    env = dict(os.environ, ORTLEAN_ISA="bogus", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", "import custom_ops; print(custom_ops.isa())"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() in ("scalar", "avx2", "avx512")
    assert "ORTLEAN_ISA=bogus" in p.stderr


# --------------------------------------------------------------------------- the shared object
def _readelf(*args) -> str:
    exe = shutil.which("readelf")
    if not exe:
        pytest.skip("readelf not available")
    return subprocess.run([exe, *args, custom_ops.library_path()], capture_output=True, text=True, check=True).stdout


def test_library_does_not_link_onnxruntime():
    needed = [line.split("[", 1)[1].rstrip("]") for line in _readelf("-d").splitlines() if "(NEEDED)" in line]
    assert needed, "no NEEDED entries parsed"
    assert not any("onnxruntime" in n for n in needed), needed
    assert any("scipy_openblas" in n for n in needed), needed


def test_library_exports_only_api():
    exported = set()
    for line in _readelf("--dyn-syms", "-W").splitlines():
        parts = line.split()
        # Num: Value Size Type Bind Vis Ndx Name
        if len(parts) >= 8 and parts[4] in ("GLOBAL", "WEAK") and parts[6] != "UND":
            exported.add(parts[7].split("@")[0])
    assert "RegisterCustomOps" in exported
    extra = {s for s in exported if s != "RegisterCustomOps" and not s.startswith("ortlean_")}
    assert not extra, sorted(extra)
    assert {"ortlean_metrics_json", "ortlean_metrics_reset", "ortlean_isa", "ortlean_version",
            "ortlean_op_schema_json"} <= exported
