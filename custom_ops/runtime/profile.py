"""ONNX Runtime's own per-node profile of a model, summarised per op type and per node."""
from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Callable

import numpy as np

from .io import ModelIO
from .io import feeds as make_feeds

# profiling
class ProfileSummary(list):
    """Rows per op type (dicts: op_type, count, calls, total_ms, mean_ms, pct), slowest first;
    ``.top_nodes`` holds the slowest nodes (name, op_type, calls, total_ms, pct);
    ``.runs`` the number of measured runs (times are per run); ``.total_ms`` their sum."""

    top_nodes: list[dict]
    runs: int
    total_ms: float


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
    import onnxruntime as ort

    factory = session_factory or _default_factory
    so = so or ort.SessionOptions()
    with tempfile.TemporaryDirectory(prefix="ortlean-prof-") as d:
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(d, "ort_profile")
        sess = factory(str(model_path), so=so)
        f = feeds(sess) if callable(feeds) else feeds
        if f is None:
            f = make_feeds(ModelIO.from_session(sess), np.arange(1, 17, dtype=np.int64)[None, :])
        for _ in range(warmup + runs):
            sess.run(None, f)
        trace_path = sess.end_profiling()
        with open(trace_path) as fh:
            trace = json.load(fh)
        if keep_trace:
            Path(keep_trace).write_text(json.dumps(trace))
        del sess
    events = trace if isinstance(trace, list) else trace.get("traceEvents", [])
    model_runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                        key=lambda e: e["ts"])
    measured = model_runs[warmup:] if len(model_runs) > warmup else model_runs
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
    return rows


