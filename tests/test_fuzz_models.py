"""No malformed model crashes the host: attributes and initializers of rewritten small models are
mutated, and every mutant is loaded and run (prefill, then decode steps with the state / key bits
fed back) in a subprocess. Every outcome must be success or a Python exception, never a signal, an
abort or a hang.

Base models: the toy LM (tests/toy.py) rewritten with TTMatMul + ProcSparseMatMul + stateful
EventGatedMatMul (event mode, duty cycle); the toy LM with stateless KWTA (threshold fast path,
fused q/k/v) + zero-skip; an optimum-style attention block rewritten to PackedAttention (ternary,
cached key bits, eps_heads, kscale). Mutations, one per mutant, drawn with a fixed seed: each
attribute of each ortlean node set to boundary / non-finite / huge / wrong-typed values, removed,
or (schema attributes the node lacks) added; each initializer of an ortlean node reshaped,
truncated, extended, emptied, retyped, and the ProcSparse index arrays given out-of-range values.
Mutants run in batches (FUZZ_BATCH per subprocess, two subprocesses at a time); a batch that dies
is re-run one mutant per subprocess to name the culprit(s)."""
from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import AttributeProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conftest import requires_native  # noqa: E402

pytestmark = requires_native
DOMAIN = "ai.ortlean"
N_MUTANTS = int(os.environ.get("FUZZ_MUTANTS", "600"))
BATCH = int(os.environ.get("FUZZ_BATCH", "60"))
SEED = int(os.environ.get("FUZZ_SEED", "13"))
CAL = ["--calib-tokens", "1024", "--calib-window", "64", "--quality-budget=off", "-q"]
REWRITES = {
    # every weight op, EventGatedMatMul stateful (event mode + KWTA duty cycle)
    "weights": ["--tt=on", "--tt-target=attn", "--tt-gap=0.2", "--tt-speed-check=off",
                "--proc-sparse=on", "--proc-target=head", "--proc-gap=0.6", "--proc-fanout=all",
                "--proc-max-bytes=1.0", "--proc-speed-check=off", "--proc-block=32",
                "--event-driven=on", "--kwta=on", "--kwta-k", "0.5", "--kwta-duty", "2", "--kwta-target=mlp"],
    # stateless KWTA threshold (fused q/k/v: the fast path) and zero-skip on the MLP
    "gating": ["--kwta=on", "--kwta-k", "0.5", "--kwta-target=attn", "--state-pack=ternary",
               "--state-pack-target=mlp"],
}

INTS = [0, -1, 1, 2, 3, 5, 7, 16, 64, 2 ** 24 + 1, 2 ** 31, 10 ** 9, -(2 ** 63), 2 ** 63 - 1]
FLOATS = [0.0, -0.5, 0.5, 1.0, 7.0, math.nan, math.inf, -math.inf, 1e30, -1e-30, 3.4e38]
STRINGS = ["", "bogus", "sign", "ternary", "binary", "topk", "mass", "x", "xw", "svd", "head", "bhdt", "scalar",
           "exact", "threshold", "none", "a" * 300]


# --------------------------------------------------------------------------- base models
def _attention_model(path: Path) -> Path:
    from rewriter.backends import packed_attention as attn
    from rewriter.kit import modelfile
    from test_packed_attention import optimum_block

    model = modelfile.load_model(optimum_block(path.with_name("blk.onnx")))
    cfg = attn.AttnConfig(enabled=True, mode="ternary", eps=0.1, budget=0.5, min_context=8, window=4, sinks=2,
                          min_candidates=4)
    attn.apply(model, cfg, eps_heads={0: [0.1, 0.2]}, kscale={0: [1.0] * 32})
    modelfile.save_model_atomic(model, path)
    return path


@pytest.fixture(scope="module")
def base_models(tmp_path_factory, toy_model, toy_text) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("fuzz")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def rewrite(name):
        out = d / f"{name}.onnx"
        p = subprocess.run([sys.executable, "-m", "rewriter.cli", "rewrite", str(toy_model), "-o", str(out),
                            *REWRITES[name], "--calib-text", str(toy_text), *CAL], capture_output=True, text=True,
                           cwd=ROOT, env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        return name, out

    with ThreadPoolExecutor(2) as ex:
        models = dict(ex.map(rewrite, REWRITES))
    models["attention"] = _attention_model(d / "attention.onnx")
    ops = {k: {n.op_type for n in onnx.load(str(p)).graph.node if n.domain == DOMAIN} for k, p in models.items()}
    assert ops == {"weights": {"TTMatMul", "ProcSparseMatMul", "EventGatedMatMul"}, "gating": {"EventGatedMatMul"},
                   "attention": {"PackedAttention"}}, ops
    return models


# --------------------------------------------------------------------------- mutations
def _attr_values(a: AttributeProto) -> list:
    if a.type == AttributeProto.INT:
        return INTS + [1.5, "1", [1, 2]]
    if a.type == AttributeProto.FLOAT:
        return FLOATS + [1, "0.5", [0.5]]
    if a.type == AttributeProto.STRING:
        return STRINGS + [0, 0.0]
    if a.type == AttributeProto.INTS:
        v = list(a.ints)
        return [[], [0], [1], [-1, 5], v * 2, v[:-1], v + [1], [2 ** 40] * len(v), v[::-1], [x + 1 for x in v], 3]
    if a.type == AttributeProto.FLOATS:
        v = list(a.floats)
        return [[], [math.nan], [-1.0], [1.0] * 3, [math.inf] * max(1, len(v)), v[:-1], v * 2, 0.5]
    return []


def _schema_additions(op_type: str) -> list[tuple[str, object]]:
    """Attributes a node may lack, set to values the contract rejects or that stress the kernel."""
    extra = {"EventGatedMatMul": [("dense_prefill", 5), ("keep_ratio", 0.0), ("keep_ratio", math.nan), ("block", 10 ** 9),
                                  ("kwta_threshold", math.inf), ("event_age_max", 1), ("event_budget_ms", 1e-6),
                                  ("kwta_renorm", 1), ("pack", "binary"), ("pack_rho", 0.01), ("event_quorum", 0.3),
                                  ("kwta_select", "mass"), ("kwta_temp", 0.5), ("event_lambda", 50.0)],
             "PackedAttention": [("approx_prefill", 1), ("select", "exact"), ("popcnt", "scalar"), ("mix", 0.5),
                                 ("k_layout", "bhdt"), ("qbits", 16), ("qbits", 2)],
             "TTMatMul": [("gap", math.inf), ("speedup", -1.0)],
             "ProcSparseMatMul": [("fanout", 1), ("watermark", 32), ("target", "ffn")]}
    return extra.get(op_type, [])


def _init_variants(arr: np.ndarray) -> list[tuple[str, np.ndarray]]:
    out = [("flatten", arr.reshape(-1)), ("lead1", arr[None]), ("scalar", np.asarray(arr.reshape(-1)[:1][0] if arr.size else 0, arr.dtype))]
    if arr.ndim >= 1 and arr.shape[0] > 1:
        out += [("trunc0", arr[:-1]), ("extend0", np.concatenate([arr, arr[:1]]))]
    if arr.ndim >= 2:
        out += [("droplast", arr[..., 0]), ("transpose", arr.T.copy()), ("trunclast", arr[..., :-1])]
    out += [("empty", arr.reshape(-1)[:0]), ("float64", arr.astype(np.float64)), ("int64", arr.astype(np.int64))]
    if arr.dtype == np.int32:
        for tag, f in (("neg", lambda a: a - 3), ("huge", lambda a: a + 2 ** 30), ("shuffle", lambda a: a[::-1].copy()),
                       ("zeros", np.zeros_like), ("float32", lambda a: a.astype(np.float32))):
            out.append((tag, f(arr)))
    else:
        out.append(("int32", arr.astype(np.int32)))
    return out


def mutations(model: onnx.ModelProto) -> list[tuple[str, object]]:
    """(description, apply(ModelProto) -> None) for one model."""
    muts = []
    inits = {t.name: t for t in model.graph.initializer}
    seen_inits = set()
    for ni, node in enumerate(model.graph.node):
        if node.domain != DOMAIN:
            continue
        for a in node.attribute:
            for v in _attr_values(a):
                muts.append((f"{node.op_type} {node.name} {a.name}={v!r}", ("attr", ni, a.name, v)))
            muts.append((f"{node.op_type} {node.name} drop {a.name}", ("drop", ni, a.name, None)))
        for name, v in _schema_additions(node.op_type):
            muts.append((f"{node.op_type} {node.name} add {name}={v!r}", ("attr", ni, name, v)))
        for inp in node.input[1:]:
            if inp in inits and inp not in seen_inits:
                seen_inits.add(inp)
                arr = numpy_helper.to_array(inits[inp])
                for tag, new in _init_variants(arr):
                    muts.append((f"{node.op_type} {node.name} init {inp} {tag} {arr.shape}->{new.shape} {new.dtype}",
                                 ("init", inp, new)))
    return muts


def apply(model: onnx.ModelProto, m) -> bytes:
    mp = onnx.ModelProto()
    mp.CopyFrom(model)
    kind, a, b, v = (m + (None,))[:4] if m[0] == "init" else m
    if kind == "init":
        for t in mp.graph.initializer:
            if t.name == a:
                t.CopyFrom(numpy_helper.from_array(b, a))
    else:
        node = mp.graph.node[a]
        keep = [x for x in node.attribute if x.name != b]
        del node.attribute[:]
        node.attribute.extend(keep)
        if kind == "attr":
            if isinstance(v, list) and not v:
                node.attribute.append(helper.make_attribute(b, [], attr_type=AttributeProto.INTS))
            else:
                node.attribute.append(helper.make_attribute(b, v))
    return mp.SerializeToString()


# --------------------------------------------------------------------------- the runner (child process)
CHILD = r"""
import json, pickle, sys
import numpy as np
import custom_ops

def feeds_for(sess, step, prev):
    names = [i.name for i in sess.get_inputs()]
    rng = np.random.default_rng(step)
    f = {}
    if "input_ids" in names:  # toy LM: prefill 6 tokens, then one token a step
        f["input_ids"] = rng.integers(2, 50, size=(1, 6 if step == 0 else 1)).astype(np.int64)
    else:  # attention block [1, 4 | 2, S, 16]
        S = 20 if step == 0 else 1
        past = 0 if prev is None else prev["present.0.key"].shape[2]
        for n, h in (("q", 4), ("k", 2), ("v", 2)):
            f[n] = rng.standard_normal((1, h, S, 16)).astype(np.float32)
        T = past + S
        f["mask"] = np.triu(np.full((S, T), -np.inf, np.float32), k=T - S + 1)[None, None]
    for i in sess.get_inputs():
        n = i.name
        if n in f:
            continue
        out = n.replace("past_key_values.", "present.").replace("past_event.", "present_event.")
        if prev is not None and out in prev:
            f[n] = prev[out]
        elif n.startswith("past_event."):
            f[n] = np.zeros((1, 0), np.float32)
        elif n.endswith("key_bits"):
            f[n] = np.zeros((1, 2, 0, 3), np.int32)
        else:
            f[n] = np.zeros((1, 2, 0, 16), np.float32)
    return f

items = pickle.load(open(sys.argv[1], "rb"))
for mid, data in items:
    try:
        s = custom_ops.session(data, threads=2)
        prev = None
        for step in range(4):
            outs = s.run(None, feeds_for(s, step, prev))
            prev = {o.name: v for o, v in zip(s.get_outputs(), outs)}
        print(json.dumps({"id": mid, "ok": True}), flush=True)
    except Exception as e:
        print(json.dumps({"id": mid, "ok": False, "err": str(e).splitlines()[0][:200] if str(e) else type(e).__name__}), flush=True)
"""


def _run_batch(items, workdir: Path, tag: str, timeout: float):
    """Runs items [(id, bytes)] in one subprocess: ({id: result}, returncode, stderr tail)."""
    f = workdir / f"batch_{tag}.pkl"
    with open(f, "wb") as fh:
        pickle.dump(items, fh)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        p = subprocess.run([sys.executable, "-c", CHILD, str(f)], capture_output=True, text=True, timeout=timeout,
                           env=env, cwd=ROOT)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), ""
    res = {}
    for line in out.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        res[r["id"]] = r
    return res, rc, err[-2000:]


def test_fuzzed_models_never_crash(base_models, tmp_path):
    rng = np.random.default_rng(SEED)
    models = {k: onnx.load(str(p)) for k, p in base_models.items()}
    pool = [(k, desc, m) for k, model in models.items() for desc, m in mutations(model)]
    # every base model and op gets its share: stratified by (model, op type), then random
    rng.shuffle(pool)
    by_group: dict[tuple, list] = {}
    for k, desc, m in pool:
        by_group.setdefault((k, desc.split()[0]), []).append((k, desc, m))
    chosen = []
    while len(chosen) < min(N_MUTANTS, len(pool)):
        for g in list(by_group):
            if by_group[g]:
                chosen.append(by_group[g].pop())
    chosen = chosen[:N_MUTANTS]
    mutants = [(i, apply(models[k], m)) for i, (k, _, m) in enumerate(chosen)]
    batches = [mutants[i:i + BATCH] for i in range(0, len(mutants), BATCH)]
    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(lambda ib: _run_batch(ib[1], tmp_path, str(ib[0]), 300), enumerate(batches)))

    crashed = []
    outcome = {}
    for (res, rc, err), batch in zip(results, batches):
        outcome.update(res)
        if rc == 0 and len(res) == len(batch):
            continue
        for mid, data in batch:  # name the culprit(s): one mutant per subprocess
            r1, rc1, err1 = _run_batch([(mid, data)], tmp_path, f"one_{mid}", 60)
            if rc1 != 0 or mid not in r1:
                crashed.append(f"{chosen[mid][0]}: {chosen[mid][1]} -> rc {rc1}: {err1[-400:]}")
            outcome.update(r1)
    assert not crashed, "\n".join(crashed)
    assert len(outcome) == len(mutants) >= min(500, len(pool))
    n_ok = sum(r["ok"] for r in outcome.values())
    # both outcomes occur: the kernels refuse what the contract forbids and accept what it allows
    assert 0 < n_ok < len(outcome), n_ok
    print(f"\nfuzz: {len(outcome)} mutants, {n_ok} ran, {len(outcome) - n_ok} refused with an exception, 0 crashes")


# --------------------------------------------------------------------------- non-finite run-time data
NONFINITE_CHILD = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import custom_ops
from test_gating_kernel import gate_model
from test_packed_attention import n_words, op_model
from test_procsparse import proc_model, random_layer
from test_tt_kernel import random_cores, tt_model

def poison(a, r, kind):
    a = np.array(a, copy=True)
    if a.dtype != np.float32 or a.size == 0:
        return a
    flat = a.reshape(-1)
    idx = r.choice(flat.size, size=max(1, flat.size // 7), replace=False)
    flat[idx] = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "huge": 3e38}[kind]
    return a

r = np.random.default_rng(0)
W = r.standard_normal((64, 32)).astype(np.float32)
gates = [dict(kwta=1, kwta_select="topk", kwta_k=5, block=4), dict(kwta=1, kwta_select="mass", kwta_temp=0.5, kwta_mass=0.9),
         dict(kwta=1, kwta_threshold=1.0), dict(pack="ternary", pack_rho=0.9, kwta=1, kwta_select="topk", kwta_k=9),
         dict(event=1, kwta=1, kwta_select="topk", kwta_k=20, kwta_duty=2, event_topk=0.5, event_quorum=0.5,
              event_gap_every=2, event_age_max=2, event_lambda=0.5, event_budget_ms=0.01)]
runs = 0
for kind in ("nan", "inf", "-inf", "huge"):
    for a in gates:
        s = custom_ops.session(gate_model(W, a, xshape=[1, "T", 64]), threads=2)
        st = np.zeros((1, 0), np.float32)
        for step in range(5):
            x = poison(r.standard_normal((1, 3 if step == 0 else 1, 64)).astype(np.float32), r, kind)
            feeds = {"X": x}
            if len(s.get_inputs()) > 1:
                feeds["past_state"] = st
            out = s.run(None, feeds)
            if len(out) > 1:
                st = poison(out[1], r, kind) if step == 2 else out[1]  # a damaged state fed back once
            runs += 1
    s = custom_ops.session(op_model(dict(scale=0.125, budget=0.25, min_context=8, window=4, sinks=2, min_candidates=4,
                                         mode="ternary", eps=0.2, kscale=[1.0] * 64)), threads=2)
    bits = np.zeros((1, 2, 0, n_words(32, "ternary")), np.int32)
    K = r.standard_normal((1, 2, 40, 32)).astype(np.float32)
    V = r.standard_normal((1, 2, 40, 32)).astype(np.float32)
    for T in (30, 31, 32):
        M = 30 if T == 30 else 1
        mask = np.triu(np.full((M, T), -np.inf, np.float32), k=T - M + 1)[None, None]
        feeds = {"Q": poison(r.standard_normal((1, 4, M, 32)).astype(np.float32), r, kind),
                 "K": poison(K[:, :, :T], r, kind), "V": poison(V[:, :, :T], r, kind),
                 "mask": poison(mask, r, kind), "past_bits": bits}
        _, bits = s.run(None, feeds)
        runs += 1
    cores = random_cores(r, [8, 8], [4, 8], [1, 5, 1])
    s = custom_ops.session(tt_model(cores), threads=2)
    for m in (1, 9):
        s.run(None, {"X": poison(r.standard_normal((m, 64)).astype(np.float32), r, kind)})
        runs += 1
    rp, bi, d = random_layer(100, 20, 32, 3)
    s = custom_ops.session(proc_model(100, 20, 32, rp, bi, d, mask=True), threads=2)
    for m in (1, 9):
        s.run(None, {"X": poison(r.standard_normal((m, 100)).astype(np.float32), r, kind),
                     "mask": poison(np.ones((m, 4), np.float32), r, kind)})
        runs += 1
print("runs", runs)
"""


def test_nonfinite_inputs_never_crash():
    """NaN / inf / huge values in X, Q, K, V, the mask and a fed-back event state: every op returns
    (NaN outputs are fine) instead of aborting; the candidate orderings stay strict weak orders."""
    p = subprocess.run([sys.executable, "-c", NONFINITE_CHILD, str(Path(__file__).resolve().parent)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "runs 128" in p.stdout, p.stdout
