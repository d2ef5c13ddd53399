"""Kernels are re-entrant: one InferenceSession per op (stateless and stateful) called from 4 threads
with different inputs gives exactly the serial results; two sessions in one process share no state.

Metrics are the one thing sessions share: the registry is process-wide and keyed by node name, so
two sessions holding a node of the same name report into one entry (counters are the sum over both,
static values and gauges are the last written). Checked below so that the behaviour is deliberate."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import custom_ops  # noqa: E402
from conftest import requires_native  # noqa: E402
from custom_ops.reference import blockquant as bq  # noqa: E402
from test_block_quant import bq_model, gather_model  # noqa: E402
from test_gating_kernel import gate_model  # noqa: E402
from test_packed_attention import n_words, op_model  # noqa: E402
from test_procsparse import proc_model, random_layer  # noqa: E402
from test_tt_kernel import random_cores, tt_model  # noqa: E402

pytestmark = requires_native
THREADS, REPEATS = 4, 5


def _tt():
    cores = random_cores(np.random.default_rng(1), [4, 6, 5], [3, 7, 4], [1, 6, 5, 1])

    def drive(s, seed):
        r = np.random.default_rng(seed)
        return [s.run(None, {"X": r.standard_normal((m, 120)).astype(np.float32)})[0] for m in (1, 7, 64)]
    return tt_model(cores, name="cc_tt"), drive


def _proc():
    K, N, B = 300, 200, 32
    rp, bi, d = random_layer(K, N, B, 6, rng_seed=2)

    def drive(s, seed):
        r = np.random.default_rng(seed)
        out = []
        for m in (1, 9, 40):
            x = r.standard_normal((m, K)).astype(np.float32)
            mask = (r.random((m, 10)) < 0.6).astype(np.float32)
            out.append(s.run(None, {"X": x, "mask": mask})[0])
        return out
    return proc_model(K, N, B, rp, bi, d, scale=0.05, mask=True, name="cc_proc"), drive


def _gate_stateless():
    W = np.random.default_rng(3).standard_normal((384, 512)).astype(np.float32)
    attrs = dict(kwta=1, kwta_select="threshold", kwta_threshold=8.0)

    def drive(s, seed):
        r = np.random.default_rng(seed)
        return [s.run(None, {"X": r.standard_normal((m, 384)).astype(np.float32)})[0] for m in (1, 3, 64)]
    return gate_model(W, attrs, name="cc_gate", xshape=["M", 384]), drive


def _gate_stateful():
    W = (np.random.default_rng(4).standard_normal((256, 192)) * 0.1).astype(np.float32)
    attrs = dict(event=1, kwta=1, kwta_select="topk", kwta_k=24, kwta_duty=3, block=8, event_topk=0.5,
                 event_gap_every=5, event_gap_tol=0.5, event_age_max=4)

    def drive(s, seed):
        r = np.random.default_rng(seed)
        base = r.standard_normal((1, 1, 256)).astype(np.float32)
        y, st = s.run(None, {"X": r.standard_normal((1, 4, 256)).astype(np.float32),
                             "past_state": np.zeros((1, 0), np.float32)})
        out = [y, st]
        for _ in range(12):  # decode steps on a slowly moving stream, the state fed back
            base = base + 0.05 * r.standard_normal(base.shape).astype(np.float32)
            y, st = s.run(None, {"X": base, "past_state": st})
            out += [y, st]
        return out
    return gate_model(W, attrs, name="cc_event", xshape=[1, "T", 256]), drive


def _attention():
    attrs = dict(scale=0.125, budget=0.25, min_context=16, window=8, sinks=2, min_candidates=8, mode="ternary",
                 eps=0.3, kscale=[1.5] * 128)

    def drive(s, seed):
        r = np.random.default_rng(seed)
        B, Hq, Hkv, D = 1, 4, 2, 64
        K = r.standard_normal((B, Hkv, 48, D)).astype(np.float32)
        V = r.standard_normal((B, Hkv, 48, D)).astype(np.float32)
        bits = np.zeros((B, Hkv, 0, n_words(D, "ternary")), np.int32)
        out = []
        for T in (40, 41, 42, 43, 44):  # prefill then decode, the key bits carried
            M = 40 if T == 40 else 1
            Q = r.standard_normal((B, Hq, M, D)).astype(np.float32)
            mask = np.triu(np.full((M, T), -np.inf, np.float32), k=T - M + 1)[None, None]
            y, bits = s.run(None, {"Q": Q, "K": K[:, :, :T], "V": V[:, :, :T], "mask": mask, "past_bits": bits})
            out += [y, bits]
        return out
    return op_model(attrs, name="cc_attn"), drive


def _block_quant():
    K, N = 576, 700
    W = bq.random_blocks("q4_1", N, K, np.random.default_rng(5))
    b = np.random.default_rng(6).standard_normal(N).astype(np.float32)

    def drive(s, seed):
        r = np.random.default_rng(seed)
        return [s.run(None, {"X": r.standard_normal((m, K)).astype(np.float32)})[0] for m in (1, 7, 64)]
    return bq_model(W, "q4_1", K, N, bias=b, name="cc_bq"), drive


def _block_quant_gather():
    K, N = 256, 300
    W = bq.random_blocks("q6_K", N, K, np.random.default_rng(7))

    def drive(s, seed):
        r = np.random.default_rng(seed)
        return [s.run(None, {"ids": r.integers(-N, N, size=n).astype(np.int64)})[0] for n in (1, 5, 400)]
    return gather_model(W, "q6_K", K, N, name="cc_bqg"), drive


CASES = {"TTMatMul": _tt, "ProcSparseMatMul": _proc, "EventGatedMatMul-stateless": _gate_stateless,
         "EventGatedMatMul-event-duty": _gate_stateful, "PackedAttention-bits": _attention,
         "BlockQuantMatMul": _block_quant, "BlockQuantGather": _block_quant_gather}


@pytest.mark.parametrize("case", list(CASES))
def test_one_session_four_threads_equal_serial(case):
    model, drive = CASES[case]()
    s = custom_ops.session(model, threads=2)
    expect = [drive(s, seed) for seed in range(THREADS)]
    got: list = [None] * THREADS
    errs: list = []
    start = threading.Barrier(THREADS)

    def worker(i):
        try:
            start.wait()
            for _ in range(REPEATS):
                out = drive(s, i)
                for a, b in zip(out, expect[i]):
                    if not np.array_equal(a, b):
                        raise AssertionError(f"thread {i}: output differs from the serial run")
            got[i] = True
        except Exception as e:  # noqa: BLE001
            errs.append(repr(e))

    th = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    assert not errs, errs
    assert all(got)


@pytest.mark.parametrize("case", ["EventGatedMatMul-event-duty", "PackedAttention-bits"])
def test_two_sessions_share_no_state(case):
    """Two sessions of one stateful model, driven alternately from two threads with different
    sequences, each give what that sequence gives on a session of its own."""
    model, drive = CASES[case]()
    alone = [drive(custom_ops.session(model, threads=1), seed) for seed in (10, 11)]
    s = [custom_ops.session(model, threads=1), custom_ops.session(model, threads=1)]
    got: list = [None, None]

    def worker(i):
        got[i] = [drive(s[i], 10 + i) for _ in range(REPEATS)]

    th = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    for i in range(2):
        for run in got[i]:
            assert all(np.array_equal(a, b) for a, b in zip(run, alone[i]))


def test_metrics_of_same_named_nodes_are_shared():
    model, drive = _gate_stateless()
    s1, s2 = custom_ops.session(model, threads=1), custom_ops.session(model, threads=1)
    custom_ops.reset_metrics()
    drive(s1, 0)
    drive(s2, 1)
    drive(s2, 2)
    m = custom_ops.metrics()["cc_gate"]
    assert m["gate.calls"] == 9  # 3 calls per drive, both sessions into one entry
    assert m["kwta.threshold"] == 8.0
