"""Peers a user compares ortlean with, built from the same weights and cached:

* the onnxruntime-genai model builder's ONNX models (fp32, int4) of a causal LM, built from the
  same fp32 Hugging Face checkpoint :mod:`models.prepare` exports with optimum;
* llama.cpp's ``llama-bench`` on the GGUF the weight package ships (:mod:`models.llamacpp`: Debian's
  llama.cpp build, fetched into the cache on first use).

    from models import peers
    d = peers.genai_model("smollm2", "int4")     # dir: model.onnx(.data), genai_config.json, tokenizer
    io = peers.genai_io(sess, d)                  # runtime.ModelIO for a plain InferenceSession loop
    rows, note, stopped = peers.llama_bench("smollm2", threads=(1, 2), prompt=128, gen=64, depths=(128,))

Cache layout (``models.cache.cache_root()``): ``hf/<name>-<key>`` (the fp32 checkpoint, rebuilt
exactly as ``models/_build.py`` does before its export), ``peers/genai-<name>-<precision>-<key>``.
Keys cover the weight package, torch/transformers/gguf (checkpoint) and onnxruntime-genai /
onnxruntime / onnx (builder) versions plus :data:`RECIPE`. Heavy work runs in child processes
(torch is never imported here).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from .cache import artifact_key, atomic_dir, cache_root, pkg_version, versions
from .prepare import PrepareError, _hf_key, _spec, gguf_path, hf_checkpoint

__all__ = ["RECIPE", "PeerError", "hf_checkpoint", "genai_model", "genai_io", "genai_available",
           "llama_bench", "LlamaBench", "LlamaBenchRow", "GENAI_PRECISIONS"]

RECIPE = 1
GENAI_PRECISIONS = ("fp32", "int4")   # the peer rows of `ortlean eval` / `bench`
# the builder's arguments per precision; int4-k_quant_mixed (built on request, e.g. by
# tests/bench/bench_float_weights.py) is its best-quality int4 recipe: k_quant blocks, the last MatMul and
# the "mixed" layers in int8 (onnxruntime_genai/models/builders/quant_config.py)
_GENAI_ARGS = {"fp32": ["-p", "fp32"], "int4": ["-p", "int4"],
               "int4-k_quant_mixed": ["-p", "int4", "--extra_options", "algo_config=k_quant_mixed"]}
GENAI_TOOLS = ("onnxruntime-genai", "onnxruntime", "onnx", "transformers")


class PeerError(PrepareError):
    pass


def _env() -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    parent = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([parent] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _run(cmd: list[str], log: Path, cwd: Path, what: str) -> None:
    with open(log, "wb") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(), cwd=str(cwd)).returncode
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise PeerError(f"{what} failed (exit {rc}):\n{tail}")


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"[ortlean] {msg}", file=sys.stderr, flush=True)


def genai_available() -> str | None:
    """None when onnxruntime-genai is importable, else the reason (one line, with the fix)."""
    if pkg_version("onnxruntime-genai") is None:
        return ("onnxruntime-genai is not installed: `pip install 'ortlean[peers]'` "
                "(onnxruntime-genai==0.15.2, whose builder works with transformers 4.57)")
    return None


def genai_model(name: str = "smollm2", precision: str = "int4", progress: bool = True) -> Path:
    """Directory with the genai builder's ``model.onnx`` (+ ``.data``), ``genai_config.json`` and
    tokenizer for ``precision`` in :data:`GENAI_PRECISIONS`, built with
    ``python -m onnxruntime_genai.models.builder -m HF -i HF -o OUT -p PRECISION -e cpu`` (or another
    precision of ``_GENAI_ARGS``)."""
    if precision not in _GENAI_ARGS:
        raise PeerError(f"genai precision {precision!r}: one of {', '.join(_GENAI_ARGS)}")
    why = genai_available()
    if why:
        raise PeerError(why)
    hf_key = _hf_key(name)
    key = artifact_key(f"genai-{name}-{precision}", {"recipe": RECIPE, "hf": hf_key, "tools": versions(GENAI_TOOLS)})
    target = cache_root() / "peers" / key
    if (target / "genai_config.json").is_file():
        return target
    hf = hf_checkpoint(name, progress=progress)
    _say(progress, f"{name}: onnxruntime-genai builder, {precision} -> {target}")
    t0 = time.monotonic()
    with atomic_dir(target) as tmp:
        if tmp is None:
            return target
        work = tmp / "_work"
        work.mkdir()
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(hf), "-i", str(hf),
               "-o", str(tmp), *_GENAI_ARGS[precision], "-e", "cpu", "-c", str(work / "hf_cache")]
        _run(cmd, tmp.parent / f".{target.name}.log", work, f"onnxruntime-genai builder ({precision})")
        shutil.rmtree(work)
        meta = {"name": name, "precision": precision, "command": " ".join(cmd[1:]).replace(str(tmp), "OUT"),
                "hf_checkpoint": hf.name, "tools": versions(GENAI_TOOLS),
                "build_seconds": round(time.monotonic() - t0, 1)}
        (tmp / "ortlean_peer.json").write_text(json.dumps(meta, indent=1))
    return target


def genai_io(sess, model_dir):
    """``runtime.ModelIO`` of a genai builder model for a plain InferenceSession loop (its KV inputs
    declare the head size as a symbolic ``kv_cache_dim``: ``ModelIO.resolve_dims`` reads it from
    genai_config.json)."""
    from custom_ops import runtime

    return runtime.ModelIO.from_session(sess, Path(model_dir) / "model.onnx")


# ---------------------------------------------------------------------------------------------
# llama.cpp
class LlamaBench(NamedTuple):
    rows: list            # one dict per test and thread count (llama_bench's docstring)
    note: str             # the commands and what ran them, or why the rows were skipped
    stopped: str | None   # the run that stopped and why, when some rows were kept before it


def _bench_run(args: list[str], timeout: float):
    """One ``llama-bench ARGS`` process: (its JSON, None, how, process) when it printed JSON, else
    (None, why not, how, process or None); how is what ran it (None when it timed out). Raises
    ``llamacpp.LlamaCppError`` when llama.cpp's tools cannot be had."""
    from . import llamacpp

    try:
        res, how = llamacpp.run_tool("llama-bench", args, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"did not finish in {timeout:.0f} s", None, None
    if res.returncode != 0:
        last = (res.stderr or "").strip().splitlines()[-1:] or ["?"]
        return None, f"exited {res.returncode}: {last[0]}", how, res
    try:
        return json.loads(res.stdout), None, how, res
    except json.JSONDecodeError:
        return None, "printed no JSON", how, res


class LlamaBenchRow:
    """llama-bench as a row of :func:`custom_ops.runtime.bench.decode_table`: it takes its turn in every
    round as the ONNX rows do, so that its figures and theirs come from the same minutes (a VM's speed
    drifts: llama-bench run after the table measured 48.1 then 59.7 tok/s for the same decode in two runs
    an hour apart). Each round: ``llama-bench -m GGUF -t T -p P -n 0 -r 1`` for the prefill and, per
    past, ``-p 0 -n STEPS -d PAST -r 1`` (one sample of the mean step time) on the package's GGUF, with
    llama-bench's own tokens (it takes no ids). The first run that fails ends the row: ``failed`` says
    why, and later rounds return nothing for it. The build, model type, peak RSS, commands and samples
    it keeps are what :func:`rows_from_table` reads."""

    def __init__(self, name: str, threads: int, timeout: float = 600):
        spec = _spec(name)
        if not spec.gguf:
            raise PeerError(f"{name} has no GGUF in its package")
        self.spec, self.gguf = spec, gguf_path(name)
        self.threads, self.timeout = int(threads), float(timeout)
        self.failed: str | None = None
        self.how, self.build, self.model_type, self.peak_kb = "llama.cpp", "", "", 0
        self.commands: dict[str, str] = {}
        self.samples: dict[str, list[float]] = {}   # test -> seconds per run (per step for decode), in order

    def _run(self, test: str, args: list[str]) -> float | None:
        from . import llamacpp

        if self.failed:
            return None
        full = ["-m", str(self.gguf), "-t", str(self.threads), *args, "-r", "1", "-o", "json"]
        cmd = " ".join(["llama-bench", *full]).replace(str(self.gguf), self.spec.gguf)
        try:
            data, why, how, res = _bench_run(full, self.timeout)
        except llamacpp.LlamaCppError as e:
            self.failed = f"{cmd}: {e}"
            return None
        self.how = how or self.how
        if why is not None:
            self.failed = f"{cmd} {why}"
            return None
        try:
            r = data[0]
            ns = r.get("samples_ns") or [1e9 * (r["n_prompt"] + r["n_gen"]) / float(r["avg_ts"])]
            sec = float(ns[0]) * 1e-9
        except (IndexError, KeyError, TypeError, ValueError):
            self.failed = f"{cmd} printed no usable JSON"
            return None
        self.commands[test] = cmd
        self.build = f"{r.get('build_commit')} {r.get('build_number')}"
        self.model_type = r.get("model_type") or self.model_type
        self.peak_kb = max(self.peak_kb, getattr(res, "peak_rss_kb", None) or 0)
        return sec

    def prefill(self, ids) -> float | None:
        n = int(getattr(ids, "size", len(ids)))
        t = self._run(f"pp{n}", ["-p", str(n), "-n", "0"])
        if t is not None:
            self.samples.setdefault("prefill", []).append(t)
        return t

    def decode(self, p: int, step_ids) -> list[float]:
        n = int(step_ids.shape[1])
        t = self._run(f"tg{n}@d{p}", ["-p", "0", "-n", str(n), "-d", str(p)])
        if t is None:
            return []
        self.samples.setdefault(f"decode{p}", []).append(t / n)
        return [t / n]


def rows_from_table(row: "LlamaBenchRow", cells: dict, prefill: int, pasts, steps: int) -> list[dict]:
    """llama_bench-style rows (``test``, ``threads``, ``tok_s``, ``tok_s_std``, ``depth``, ...) from a
    decode_table row's medians ({"prefill": ms, "decode<P>": ms per step}) of a :class:`LlamaBenchRow`;
    the spread over the timed rounds (the row's samples after the table's warm-up round)."""
    import statistics

    base = {"threads": row.threads, "model_type": row.model_type, "build": row.build,
            "peak_rss_mb": round(row.peak_kb / 1024) if row.peak_kb else None, "interleaved": True}

    def sd(key: str, tokens: int) -> float:
        tok_s = [tokens / t for t in row.samples.get(key, [])[1:]]
        return statistics.stdev(tok_s) if len(tok_s) > 1 else 0.0

    out = []
    if cells.get("prefill"):
        out.append({**base, "test": f"pp{prefill}", "depth": 0, "tok_s": prefill * 1e3 / cells["prefill"],
                    "tok_s_std": sd("prefill", prefill)})
    for p in pasts:
        if cells.get(f"decode{p}"):
            out.append({**base, "test": f"tg{steps}@d{p}" if p else f"tg{steps}", "depth": int(p),
                        "tok_s": 1e3 / cells[f"decode{p}"], "tok_s_std": sd(f"decode{p}", 1)})
    return out


def llama_bench(name: str = "smollm2", threads=(1, 2), prompt: int = 128, gen: int = 64,
                depths=(), repetitions: int = 5, timeout: float = 1800) -> LlamaBench:
    """Run ``llama-bench -m GGUF -t T.. -p P -n N -r R -o json`` on the package's GGUF (with depths:
    ``-p P -n 0``, then ``-p 0 -n N -d D`` once per depth, so that no depth is prefilled for a prompt
    test and a depth that fails or runs out of time keeps the rows before it) with llama.cpp's tools
    from :mod:`models.llamacpp` (Debian's build, fetched on first use; or ``$ORTLEAN_ANCHORS_SCRIPT``).
    Returns (rows, note, stopped): rows are dicts with ``test`` ("pp128", "tg64", "tg64@d4096"), ``threads``,
    ``tok_s`` (mean), ``tok_s_std``, ``depth``; note is the commands and what ran them (and which run
    stopped, and why), or — rows == [] — one line saying why the rows were skipped; stopped: that
    run and why (None when every run finished, or none gave rows)."""
    from . import llamacpp

    spec = _spec(name)
    if not spec.gguf:
        return [], f"llama.cpp rows skipped: {name} has no GGUF in its package"
    gguf = gguf_path(name)
    base = ["-m", str(gguf), "-t", ",".join(map(str, threads))]
    tail = ["-r", str(repetitions), "-o", "json"]
    # llama-bench prefills every depth again for each test and repetition, and a prompt test at a depth
    # prefills it too: with depths, the prompt runs once at depth 0 and each depth only decodes, in a
    # run of its own (llama-bench reports at its end: a 32k depth is most of an hour on two cores)
    if depths:
        runs = [(base + ["-p", str(prompt), "-n", "0"] + tail, 0)]
        runs += [(base + ["-p", "0", "-n", str(gen)] + tail + ["-d", str(d)], int(d)) for d in depths]
    else:
        runs = [(base + ["-p", str(prompt), "-n", str(gen)] + tail, 0)]
    rows, notes, how, stopped = [], [], "llama.cpp", None
    for args, depth in runs:
        # the timeout grows with the depth's prefills (about 0.1 s a token on one core, with room)
        limit = timeout + 0.1 * depth * int(repetitions) * len(tuple(threads))
        cmd = " ".join(["llama-bench"] + args).replace(str(gguf), spec.gguf)
        try:
            data, why, ran, res = _bench_run(args, limit)
        except llamacpp.LlamaCppError as e:
            return LlamaBench([], f"llama.cpp rows skipped: {e}", None)
        how = ran or how
        if why is not None:
            if not rows:
                return LlamaBench([], f"llama.cpp rows skipped: llama-bench ({how}) {why}", None)
            stopped = f"{cmd} stopped: {why} (later runs not started)"
            notes.append(stopped)
            break
        for r in data:
            test = f"pp{r['n_prompt']}" if r.get("n_prompt") else f"tg{r['n_gen']}"
            if r.get("n_depth"):
                test += f"@d{r['n_depth']}"
            rows.append({"test": test, "threads": int(r["n_threads"]), "tok_s": float(r["avg_ts"]),
                         "tok_s_std": float(r.get("stddev_ts", 0.0)), "depth": int(r.get("n_depth", 0)),
                         "model_type": r.get("model_type"),
                         "build": f"{r.get('build_commit')} {r.get('build_number')}",
                         "peak_rss_mb": (round(res.peak_rss_kb / 1024)
                                         if getattr(res, "peak_rss_kb", None) else None)})
        notes.append(cmd)
    return LlamaBench(rows, "; ".join(notes) + f" ({how})", stopped)
