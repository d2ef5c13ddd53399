"""Latency of one model's ``Run()`` with ortlean's library registered: what ONNX Runtime's
``onnxruntime_perf_test`` / ``onnxruntime_test`` do (which cannot register a custom-op library from
the wheel, and the first ships in neither the wheel nor Debian), as ``ortlean perf MODEL``.

    from custom_ops.runtime import perf
    r = perf.perf("model.onnx", threads=2, past=4096)      # a decode step after 4,096 cached tokens
    r["latency_ms"]["p50"], r["throughput"]["runs_per_s"]

Inputs are given (an ``.npz`` of name -> array) or made from the model's declared inputs: token ids
random in the vocabulary (past its first 100 special ids), attention masks of ones over past +
new tokens, positions counting on from the past, token types zero; the cache of a causal LM
(``past_key_values.*``, PackedAttention's packed state too) is the model's own, from a prefill of
``past`` random tokens (``bench.chunked_state``), so every state holds values the model really
produces. Inputs ``runtime.io`` does not know get random values of their declared type and shape,
symbolic dimensions read by name (batch, past, total, sequence). Every timed run gets the same inputs
(a step after the same past, as the ORT tools repeat one input set).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .io import ModelIO, feeds as make_feeds, token_range

__all__ = ["PerfError", "load_inputs", "make_inputs", "perf", "format_perf"]


class PerfError(ValueError):
    """Bad input to perf (the message names the file, input or value)."""


def load_inputs(path, sess) -> dict[str, np.ndarray]:
    """The feeds in an ``.npz`` file, checked against the session's inputs by name and type."""
    p = Path(path)
    if not p.is_file():
        raise PerfError(f"--inputs {p}: no such file")
    try:
        with np.load(p, allow_pickle=False) as z:
            given = {k: z[k] for k in z.files}
    except Exception as e:
        raise PerfError(f"--inputs {p}: not a readable .npz file ({type(e).__name__}: {e})") from None
    want = {i.name: i for i in sess.get_inputs()}
    missing = [n for n in want if n not in given]
    extra = [n for n in given if n not in want]
    if missing or extra:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + ([f"not inputs of the model: {', '.join(extra)}"]
                                                                           if extra else [])
        raise PerfError(f"--inputs {p}: {'; '.join(parts)} (the model's inputs: {', '.join(want)})")
    from .io import _ONNX_TO_NP

    for n, a in given.items():
        t = _ONNX_TO_NP.get(want[n].type)
        if t is not None and a.dtype != np.dtype(t):
            raise PerfError(f"--inputs {p}: input {n} is {a.dtype}, the model declares {want[n].type}")
    return given


def _dim(d, name: str, batch: int, seq: int, past: int) -> int:
    if isinstance(d, int) and d > 0:
        return d
    s = str(d or "").lower()
    if "batch" in s:
        return batch
    if "total" in s:
        return past + seq
    if "past" in s:
        return past
    if "seq" in s or "len" in s:
        return seq
    return 1


def _random_input(arg, rng, batch: int, seq: int, past: int, vocab: int | None) -> np.ndarray:
    from .io import _ONNX_TO_NP

    shape = [_dim(d, arg.name, batch, seq, past) for d in (arg.shape or [])]
    t = np.dtype(_ONNX_TO_NP.get(arg.type, np.float32))
    n = arg.name.lower()
    if "mask" in n:
        return np.ones(shape, t)
    if t.kind == "f":
        return rng.standard_normal(shape).astype(t)
    if t.kind == "b":
        return np.ones(shape, t)
    if "ids" in n and "position" not in n and "type" not in n:
        return rng.integers(*token_range(vocab), shape).astype(t)
    if "position" in n:
        return np.broadcast_to(np.arange(past, past + (shape[-1] if shape else 1)), shape).astype(t)
    return np.zeros(shape, t)


def make_inputs(sess, model_path, seq: int = 1, past: int = 0, batch: int = 1, seed: int = 0) -> tuple[dict, str]:
    """Feeds for one run and a line saying what they are (see the module docstring)."""
    rng = np.random.default_rng(seed)
    io = ModelIO.from_session(sess, str(model_path))
    lo, hi = token_range(io.vocab_size)
    known = "input_ids" in io.inputs
    if known:
        ids = rng.integers(lo, hi, (batch, past + seq))
        state, how = None, ""
        if io.past_to_present:
            if past > 0:
                from .bench import chunked_state

                t0 = time.perf_counter()
                state = chunked_state(sess, io, ids[:, :past])
                how = (f"; past_* states: the model's own cache after {past} random tokens "
                       f"(built in {time.perf_counter() - t0:.1f} s)")
            else:
                how = "; past_* states empty"
        elif past:
            raise PerfError(f"--past {past}: {model_path} has no past_key_values inputs")
        try:
            f = make_feeds(io, ids[:, past:], state, past)
            desc = (f"input_ids [{batch}, {seq}] random token ids after {past} cached tokens" if io.past_to_present
                    else f"input_ids [{batch}, {seq}] random token ids") + how
            return f, desc
        except ValueError:  # inputs runtime.io does not know: every input from its declaration
            pass
    f = {a.name: _random_input(a, rng, batch, seq, past, io.vocab_size) for a in sess.get_inputs()}
    desc = ", ".join(f"{k} {list(v.shape)} {v.dtype}" for k, v in f.items()) + " (random from the declared shapes)"
    return f, desc


def _prompt_runner(sess, model_path, prompt: int, chunk: int | None, seed: int):
    """A run = the time to first token of a ``prompt``-token prompt of random ids, from an empty cache,
    as ``ortlean generate`` reads a prompt (``bench.PromptRow``: ``chunk``-token runs, default
    generate's). Returns (run, what it is, tokens a run)."""
    from .bench import PromptRow

    io = ModelIO.from_session(sess, str(model_path))
    if io.kind != "causal-lm" or not io.past_to_present:
        raise PerfError(f"--prompt {prompt}: {model_path} is not a causal LM with a KV cache (kind {io.kind})")
    ids = np.random.default_rng(seed).integers(*token_range(io.vocab_size), prompt)
    row = PromptRow(sess, io, model_path=model_path, chunk=chunk)

    def run():
        row.ttft(ids)

    desc = (f"a {prompt}-token prompt of random token ids from an empty cache to the first new token's logits, "
            f"{row.chunk}-token runs ({row.loop})")
    return run, desc, prompt


def _feeds(sess, model_path, inputs, seq, past, batch, seed):
    if isinstance(inputs, (str, Path)):
        return load_inputs(inputs, sess), f"inputs from {inputs}"
    if inputs is not None:
        return dict(inputs), "given inputs"
    return make_inputs(sess, model_path, seq=seq, past=past, batch=batch, seed=seed)


def perf(model_path, inputs=None, iterations: int = 100, warmup: int = 5, threads: int = 1, seq: int | None = None,
         past: int = 0, batch: int = 1, seed: int = 0, session_factory=None, prompt: int | None = None,
         chunk: int | None = None, profile: bool = False) -> dict:
    """Time ``iterations`` runs of the model after ``warmup`` untimed ones, with ortlean's library
    registered (``custom_ops.session``, or ``session_factory(path, threads)``). ``inputs``: an ``.npz``
    path or a dict of feeds; else made by :func:`make_inputs` (``seq`` new tokens, default 1 after a
    past and 128 without one). ``prompt`` N: a run is instead a whole N-token prompt read from an empty
    cache in ``chunk``-token runs, as ``ortlean generate`` reads it (the time to first token).
    Returns latency statistics in ms (mean, std, min, p50, p90, p95, p99, max), throughput (runs/s,
    and tokens/s when the model takes input_ids) and what ran. ``profile``: also ONNX Runtime's
    per-node profile of the same runs, in a second session with the profiler on after the timed ones
    (so the timings above are not the profiler's; up to 10 runs after one warm-up, a prompt once):
    ``r["profile"]`` = the op types' time per run and share (:func:`profile.profile_summary`'s rows)
    and ``attention_pct``, the attention nodes' share of the node time."""
    import onnxruntime as ort

    import custom_ops

    if iterations < 1 or warmup < 0:
        raise PerfError(f"--iterations {iterations} / --warmup {warmup}: at least 1 timed run, warm-up ≥ 0")
    if prompt is not None and (inputs is not None or past or seq or batch != 1):
        raise PerfError(f"--prompt {prompt}: a run is the whole prompt from an empty cache; it does not take "
                        "--inputs, --past, --seq or --batch")
    seq = int(seq) if seq else (1 if past > 0 else 128)
    factory = session_factory or (lambda p, t, so=None: custom_ops.session(p, threads=t, so=so))
    sess = factory(str(model_path), threads)
    if prompt is not None:
        run0, desc, tokens = _prompt_runner(sess, model_path, int(prompt), chunk, seed)
    else:
        feeds, desc = _feeds(sess, model_path, inputs, seq, past, batch, seed)
        ids = feeds.get("input_ids")
        tokens = int(ids.size) if ids is not None else None

        def run0():
            sess.run(None, feeds)

    def run():
        try:
            run0()
        except Exception as e:  # ORT's message names the node / input; say which inputs ran
            raise PerfError(f"{model_path}: the run failed with these inputs ({desc}): "
                            f"{str(e).splitlines()[0]}") from None

    for _ in range(warmup):
        run()
    times = np.empty(iterations)
    t_all = time.perf_counter()
    for i in range(iterations):
        t0 = time.perf_counter()
        run()
        times[i] = time.perf_counter() - t0
    wall = time.perf_counter() - t_all
    ms = times * 1e3
    lat = {"mean": float(ms.mean()), "std": float(ms.std(ddof=1)) if ms.size > 1 else 0.0, "min": float(ms.min()),
           **{f"p{q}": float(np.percentile(ms, q)) for q in (50, 90, 95, 99)}, "max": float(ms.max())}
    thr = {"runs_per_s": iterations / wall}
    if tokens:
        thr["tokens_per_s"] = tokens * iterations / wall
    try:
        lib, isa = custom_ops.library_path(), custom_ops.isa_label()
    except Exception as e:  # the reference backend or a custom factory: say what we know
        lib, isa = None, str(e).splitlines()[0]
    res = {"model": str(model_path), "iterations": iterations, "warmup": warmup, "threads": threads,
           "inputs": desc, "tokens_per_run": tokens, "latency_ms": lat, "throughput": thr, "library": lib,
           "isa": isa, "onnxruntime": ort.__version__}
    if profile:
        del sess
        res["profile"] = _profile(factory, model_path, threads, inputs, seq, past, batch, seed, prompt, chunk,
                                  min(iterations, 1 if prompt else 10), 0 if prompt else min(warmup, 1))
    return res


def _profile(factory, model_path, threads, inputs, seq, past, batch, seed, prompt, chunk, runs, warmup) -> dict:
    """ORT's profiler over ``runs`` runs after ``warmup`` (a new session, the profiler on): the op
    types' time per run, their share of the node time, and the attention nodes' share."""
    from .profile import ATTENTION_OPS, _summarise, profiled_trace

    def drive(sess) -> None:
        if prompt is not None:
            run, _, _ = _prompt_runner(sess, model_path, int(prompt), chunk, seed)
        else:
            feeds, _ = _feeds(sess, model_path, inputs, seq, past, batch, seed)

            def run():
                sess.run(None, feeds)
        for _ in range(warmup + runs):
            run()

    def make(path, so):
        try:
            return factory(path, threads, so=so)
        except TypeError as e:  # a factory without SessionOptions cannot profile
            raise PerfError(f"--profile: this session factory takes no SessionOptions ({e})") from None

    trace = profiled_trace(model_path, drive, make)
    events = trace if isinstance(trace, list) else trace.get("traceEvents", [])
    n_runs = sum(1 for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    # ORT runs per call: 1, or a prompt's chunks (then every call the same, and no other runs: the
    # profiled session's ORT runs are the calls'); a --past cache's prefill runs come first
    per_call = n_runs // (warmup + runs) if prompt is not None else 1
    rows = _summarise(trace, 0, 12, last=per_call * runs)
    att = sum(r["pct"] for r in rows if r["op_type"] in ATTENTION_OPS)
    return {"runs": runs, "ort_runs_per_run": per_call, "node_ms_per_run": rows.total_ms * per_call,
            "attention_pct": att,
            "op_types": [{k: r[k] for k in ("op_type", "count", "total_ms", "pct")} | {"total_ms": r["total_ms"] * per_call}
                         for r in rows],
            "top_nodes": [n | {"total_ms": n["total_ms"] * per_call} for n in rows.top_nodes[:8]]}


def format_perf(r: dict) -> str:
    lat, thr = r["latency_ms"], r["throughput"]
    lines = [f"{r['model']}: {r['iterations']} runs after {r['warmup']} warm-up, {r['threads']} thread"
             f"{'s' if r['threads'] != 1 else ''}",
             f"inputs: {r['inputs']}",
             "latency ms: " + ", ".join(f"{k} {lat[k]:.3f}" for k in ("mean", "std", "min", "p50", "p90", "p95", "p99",
                                                                        "max")),
             f"throughput: {thr['runs_per_s']:.2f} runs/s"
             + (f", {thr['tokens_per_s']:.1f} tokens/s ({r['tokens_per_run']} tokens a run)" if "tokens_per_s" in thr
                else ""),
             f"library {r['library']} (isa {r['isa']}), onnxruntime {r['onnxruntime']}"]
    pr = r.get("profile")
    if pr:
        lines.append(f"ORT profile ({pr['runs']} run{'s' if pr['runs'] != 1 else ''} in a profiled session, "
                     f"{pr['ort_runs_per_run']} ORT run{'s' if pr['ort_runs_per_run'] != 1 else ''} each): "
                     f"{pr['node_ms_per_run']:.1f} ms of node time a run, attention {pr['attention_pct']:.1f} %")
        lines += [f"  {o['op_type']:<34} {o['count']:>4} nodes {o['total_ms']:>11.1f} ms {o['pct']:>6.1f} %"
                  for o in pr["op_types"]]
    return "\n".join(lines)
