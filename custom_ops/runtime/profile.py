"""ONNX Runtime's own per-node profile of a model, summarised per op type and per node."""
from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Callable

import numpy as np

from .io import ModelIO, token_range
from .io import feeds as make_feeds

# profiling
class ProfileSummary(list):
    """Rows per op type (dicts: op_type, count, calls, total_ms, mean_ms, pct), slowest first;
    ``.top_nodes`` holds the slowest nodes (name, op_type, calls, total_ms, pct);
    ``.runs`` the number of measured runs (times are per run); ``.total_ms`` their sum;
    ``.step_ms`` the measured runs' mean wall time (``model_run``, profiler on)."""

    top_nodes: list[dict]
    runs: int
    total_ms: float
    step_ms: float


def _default_factory(model_path, so=None):
    import onnxruntime as ort

    return ort.InferenceSession(str(model_path), sess_options=so, providers=["CPUExecutionProvider"])


def profile_summary(model_path, session_factory: Callable | None = None, feeds=None, runs: int = 5,
                    warmup: int = 1, top: int = 15, so=None, keep_trace: str | None = None) -> ProfileSummary:
    """Per-op-type time from ORT's own profiler.

    ``session_factory(model_path, so=so)`` must return a session built with the given
    SessionOptions (profiling is switched on in them); e.g. ``functools.partial(
    custom_ops.session, threads=2)``, default a plain CPU InferenceSession. ``feeds`` is a
    dict or a callable ``(session) -> dict``. The first ``warmup`` runs are excluded. Times are
    kernel times per run (averaged over ``runs``); ``pct`` is the share of all node time."""
    def drive(sess) -> None:
        f = feeds(sess) if callable(feeds) else feeds
        if f is None:
            f = make_feeds(ModelIO.from_session(sess), np.arange(1, 17, dtype=np.int64)[None, :])
        for _ in range(warmup + runs):
            sess.run(None, f)

    return _summarise(profiled_trace(model_path, drive, session_factory, so, keep_trace), warmup, top)


def profiled_trace(model_path, drive: Callable, session_factory: Callable | None = None, so=None,
                   keep_trace: str | None = None):
    """ORT's profiler trace (the parsed chrome-trace JSON) of what ``drive(sess)`` runs on a session
    built by ``session_factory(model_path, so=so)`` (default a plain CPU InferenceSession) with the
    profiler switched on in ``so``; the session is dropped before returning. ``keep_trace``: the
    trace file is also copied there."""
    import onnxruntime as ort

    factory = session_factory or _default_factory
    so = so or ort.SessionOptions()
    with tempfile.TemporaryDirectory(prefix="ortlean-prof-") as d:
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(d, "ort_profile")
        sess = factory(str(model_path), so=so)
        drive(sess)
        trace_path = sess.end_profiling()
        with open(trace_path) as fh:
            trace = json.load(fh)
        if keep_trace:
            _keep(trace_path, keep_trace)
        del sess
    return trace


def _keep(trace_path: str, dest: str) -> None:
    """ORT's trace file copied to ``dest`` (its directory created), atomically."""
    import shutil

    d = Path(dest)
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = d.with_name(f".{d.name}.tmp")
    shutil.copyfile(trace_path, tmp)
    os.replace(tmp, d)


def _summarise(trace, skip: int, top: int, last: int | None = None) -> ProfileSummary:
    """Node kernel times inside the measured ``model_run`` spans: all but the first ``skip`` runs,
    or (``last``) the last ``last`` runs."""
    events = trace if isinstance(trace, list) else trace.get("traceEvents", [])
    model_runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                        key=lambda e: e["ts"])
    if last is not None:
        measured = model_runs[-last:] if last else []
    else:
        measured = model_runs[skip:] if len(model_runs) > skip else model_runs
    spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in measured]

    def in_measured(ts):
        return any(a <= ts <= b for a, b in spans) if spans else True

    by_op: dict[str, dict] = defaultdict(lambda: {"nodes": set(), "calls": 0, "us": 0.0})
    by_node: dict[str, dict] = defaultdict(lambda: {"op_type": "", "calls": 0, "us": 0.0})
    for e in events:
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith("_kernel_time"):
            continue
        if not in_measured(e.get("ts", 0)):
            continue
        args = e.get("args", {})
        op = args.get("op_name", "?")
        node = e["name"][: -len("_kernel_time")]
        dur = float(e.get("dur", 0))
        by_op[op]["nodes"].add(node)
        by_op[op]["calls"] += 1
        by_op[op]["us"] += dur
        by_node[node]["op_type"] = op
        by_node[node]["calls"] += 1
        by_node[node]["us"] += dur
    nruns = max(len(measured), 1)
    total_us = sum(v["us"] for v in by_op.values()) or 1.0
    rows = ProfileSummary(
        {"op_type": op, "count": len(v["nodes"]), "calls": v["calls"] // nruns,
         "total_ms": v["us"] / 1e3 / nruns, "mean_ms": v["us"] / 1e3 / max(v["calls"], 1),
         "pct": 100.0 * v["us"] / total_us}
        for op, v in sorted(by_op.items(), key=lambda kv: -kv[1]["us"]))
    rows.top_nodes = [
        {"name": n, "op_type": v["op_type"], "calls": v["calls"] // nruns,
         "total_ms": v["us"] / 1e3 / nruns, "pct": 100.0 * v["us"] / total_us}
        for n, v in sorted(by_node.items(), key=lambda kv: -kv[1]["us"])[:top]]
    rows.runs = nruns
    rows.total_ms = total_us / 1e3 / nruns
    rows.step_ms = sum(b - a for a, b in spans) / 1e3 / nruns if spans else 0.0
    return rows


def shares_kv(model_path) -> bool:
    """Whether a graph can run with one shared K/V buffer per layer (``runtime.shared_kv``): its
    attention writes the new rows in place — GroupQueryAttention, or PackedAttention in its cache mode
    (a ``seqlens_k`` input) — where an unfused export concatenates its cache."""
    import onnx

    return any(n.op_type == "GroupQueryAttention" or (n.op_type == "PackedAttention" and len(n.input) > 6
                                                      and n.input[6])
               for n in onnx.load(str(model_path), load_external_data=False).graph.node)


# op types whose node is a whole attention (the rest of a decode step does not depend on the past)
ATTENTION_OPS = ("GroupQueryAttention", "PackedAttention", "MultiHeadAttention", "Attention")


def decode_profile(model_path, session_factory: Callable | None = None, past: int = 128, steps: int = 16,
                   warmup: int = 4, seed: int = 0, huge_pages: bool = True, top: int = 15,
                   keep_trace: str | None = None) -> ProfileSummary:
    """Per-op-type time of single-token decode steps of a causal LM after a past of ``past`` tokens.

    The cache is the model's own: its prefill of ``past`` random tokens in 512-token chunks
    (``bench.chunked_state``). The steps are driven as ``ortlean bench`` drives its rows: one shared
    K/V buffer per layer (``bench.SharedRow``) where the graph allows it (a probe step first), else the
    plain loop (``bench.LoopRow``: presents fed back, the past growing by one per step). ``warmup``
    steps are not measured; ``huge_pages``: the
    process's memory on 2 MiB pages before them (``memory.huge_pages_for_process``, as ``ortlean
    bench`` does). Besides :func:`profile_summary`'s fields, ``.step_ms`` is the measured steps' mean
    ``model_run`` time as the profiler saw it, ``.loop`` "shared KV" or "plain", ``.past`` the past,
    and ``.attention_ms`` the time of the attention nodes (:data:`ATTENTION_OPS`) per step.
    ``keep_trace``: ORT's whole trace (chrome trace JSON: the prefill of the past, the warm-up and
    the measured steps) is also written to that path."""
    from .bench import LoopRow, SharedRow, chunked_state

    rng = np.random.default_rng(seed)
    how = {}

    def drive(sess) -> None:
        io = ModelIO.from_session(sess, str(model_path))
        if io.kind != "causal-lm" or not io.past_to_present:
            raise ValueError(f"{model_path}: decode profile needs a causal LM with a KV cache (kind {io.kind})")
        ids = rng.integers(*token_range(io.vocab_size), (1, past + warmup + steps))
        states = {past: chunked_state(sess, io, ids[:, :past])}
        step_ids = ids[:, past:]
        row = None
        if shares_kv(model_path):  # the bench's drivers: shared KV where the graph writes its cache in place
            try:  # (checked first: a graph that concatenates its cache would print ORT's error for the probe)
                row, how["loop"] = SharedRow(sess, io, states, warmup + steps, 1), "shared KV"
                row.decode(past, step_ids[:, :1])
            except Exception:
                row = None
        if row is None:
            row, how["loop"] = LoopRow(sess, io, states), "plain"
        if huge_pages:
            from .memory import huge_pages_for_process

            huge_pages_for_process()
        row.decode(past, step_ids)  # each driver starts again from the same past

    trace = profiled_trace(model_path, drive, session_factory, keep_trace=keep_trace)
    rows = _summarise(trace, 0, top, last=steps)
    rows.loop, rows.past = how["loop"], int(past)
    rows.attention_ms = sum(r["total_ms"] for r in rows if r["op_type"] in ATTENTION_OPS)
    return rows
