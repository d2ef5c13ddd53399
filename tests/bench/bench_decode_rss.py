"""Memory of decoding after a long past, one process per row: what each model keeps resident while it
decodes (weights, its cache of the past, the runtime), which one `ortlean bench` process holding every
row cannot say.

    python tests/bench/bench_decode_rss.py --model long-context=qwen-long/model.onnx \
        --model lossless=qwen-lossless/model.onnx --genai qwen2.5-coder-1.5b \
        --decode-past 16384,32768 --threads 2 --steps 8 --json FILE

Each row runs in a child process of its own: an ONNX model (`custom_ops.session`, the shared-KV driver
`ortlean bench --rows best` times it with) gets the cache of the longest past from `ortlean bench`'s
past cache (`--past-cache`, default ``<ortlean cache>/pasts``; the same ids as a bench run with the same
``--decode-past``, ``--prefill`` and ``--steps``, built by ``--cache-from``: by default the first model
with a float cache, as bench builds them), or prefills it itself (chunked) when the cache is not there;
then it drops the loaded cache and decodes ``--steps`` tokens twice. ``--genai NAME``: onnxruntime-genai's
int4 model of packaged model NAME in its own generator, which prefills the past itself (chunked
``append_tokens``), then decodes. Per row: ``rss_decode`` = VmRSS after the decode steps (what stays
resident while decoding), ``peak`` = VmHWM of the child (loading or prefilling the past included),
``baseline`` = VmRSS before the model was loaded (Python, numpy, onnxruntime), the model's weight bytes
and its cache bytes at that past, and the decode tok/s of the second pass (one process alone on the
machine, not a comparison: `ortlean bench` gives those). llama.cpp's peak per depth is llama-bench's
own VmHWM in `ortlean bench`'s results (``llama_cpp.rows``). The JSON carries commit, machine and date.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "bench"))

from bench_rewrite_memory import proc_status  # noqa: E402


def _ids(a, vocab: int, past: int):
    from custom_ops.runtime import bench as rb

    _, past_ids, step_ids = rb.bench_ids(vocab, a.pasts, a.prefill, a.steps)
    return past_ids[past], step_ids


def _row(base: int, loaded: int, past: int, how: str, t_past: float, ts, model: str) -> dict:
    """A child's result after its second decode pass ``ts`` (seconds per step) on ``model``."""
    from custom_ops import runtime

    st = proc_status("self")
    return {"baseline": base, "after_load": loaded, "rss_decode": st["VmRSS"], "peak": st["VmHWM"], "past": past,
            "past_how": how, "past_s": round(t_past, 1), "tok_s": 1.0 / statistics.median(ts),
            "weight_bytes": runtime.weight_bytes(model),
            "cache_bytes": (runtime.cache_bytes_per_token(model) or 0) * past}


def child_onnx(a) -> dict:
    import custom_ops
    from custom_ops import runtime
    from custom_ops.runtime import bench as rb
    from rewriter.kit import stamps

    rb.fix_malloc_threshold()
    base = proc_status("self")["VmRSS"]
    s = custom_ops.session(a.path, threads=a.threads)
    io = runtime.ModelIO.from_session(s, a.path)
    loaded = proc_status("self")["VmRSS"]
    past = max(a.pasts)
    past_ids, step_ids = _ids(a, a.vocab, past)
    store = rb.PastStore(None if a.past_cache == "off" else a.past_cache, {"model": stamps.file_stamp(a.cache_from), "format": 1})
    t0 = time.perf_counter()
    kv = store.get(past_ids)
    how = f"loaded from {a.past_cache}" if kv is not None else "prefilled here (chunked)"
    if kv is None:
        kv = rb.chunked_state(s, io, past_ids)
    state = rb.state_from_kv(io, kv)
    del kv, store
    row = rb.SharedRow(s, io, {past: state}, a.steps, a.prefill)
    del state
    gc.collect()
    t_past = time.perf_counter() - t0
    row.decode(past, step_ids)   # first pass: warm-up
    return _row(base, loaded, past, how, t_past, row.decode(past, step_ids), a.path)


def child_genai(a) -> dict:
    from custom_ops.runtime import bench as rb
    from models import peers as pm

    base = proc_status("self")["VmRSS"]
    d = pm.genai_model(a.path, "int4", progress=False)
    past = max(a.pasts)
    past_ids, step_ids = _ids(a, a.vocab, past)
    t0 = time.perf_counter()
    row = rb.OgRow(d, a.threads, {past: past_ids}, a.steps, 2)
    loaded = proc_status("self")["VmRSS"]
    row.decode(past, step_ids)   # builds the generator: its own prefill of the past, then the steps
    t_past = time.perf_counter() - t0
    return _row(base, loaded, past, "prefilled by its generator (append_tokens)", t_past,
                row.decode(past, step_ids), str(Path(d) / "model.onnx"))


def _child(a) -> int:
    out = child_genai(a) if a.child == "genai" else child_onnx(a)
    print("RESULT " + json.dumps(out), flush=True)
    return 0


def _run_child(kind: str, path: str, a, vocab: int, cache_from: str) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--path", path, "--threads", str(a.threads),
           "--steps", str(a.steps), "--prefill", str(a.prefill), "--pasts", ",".join(map(str, a.pasts)),
           "--vocab", str(vocab), "--cache-from", cache_from, "--past-cache", a.past_cache]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if res.returncode != 0 or line is None:
        tail = (res.stderr or "").strip().splitlines()[-3:]
        raise SystemExit(f"{kind} row {path}: the child process failed (exit {res.returncode}): {' | '.join(tail)}")
    out = json.loads(line[len("RESULT "):])
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def table(doc: dict) -> str:
    gib = 1 << 30
    out = [f"decode memory after {doc['past']:,} tokens, {doc['threads']} thread{'s' if doc['threads'] != 1 else ''}: "
           f"{doc['machine'].get('cpu', '?')}, commit {(doc.get('commit') or '?')[:10]}, {doc.get('date', '')}",
           f"{'row':<26} {'weights GiB':>11} {'cache GiB':>9} {'RSS decoding':>12} {'peak RSS':>9} "
           f"{'baseline':>8} {'tok/s':>6}  past"]
    for name, r in doc["rows"].items():
        out.append(f"{name:<26} {r['weight_bytes'] / gib:>11.2f} {r['cache_bytes'] / gib:>9.2f} "
                   f"{r['rss_decode'] / gib:>12.2f} {r['peak'] / gib:>9.2f} {r['baseline'] / gib:>8.2f} "
                   f"{r['tok_s']:>6.1f}  {r['past_how']} ({r['past_s']} s)")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", default=[], help="NAME=PATH of an ONNX model (repeatable)")
    ap.add_argument("--genai", default=None, help="packaged model name: add onnxruntime-genai's int4 model row")
    ap.add_argument("--decode-past", default="32768", help="the bench run's --decode-past (the longest is measured)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--cache-from", default=None, help="the model whose caches bench built (default: the first "
                    "--model with a float cache, else the first)")
    ap.add_argument("--past-cache", default=None, help="bench's past cache directory (default <ortlean cache>/pasts)")
    ap.add_argument("--json", default=None)
    # the child's arguments
    ap.add_argument("--child", choices=("onnx", "genai"), help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--pasts", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        a.pasts = [int(x) for x in a.pasts.split(",")]
        return _child(a)

    from custom_ops import runtime
    from rewriter import evaluate, results

    models = {}
    for spec in a.model:
        name, sep, path = spec.partition("=")
        if not sep or not Path(path).is_file():
            ap.error(f"--model {spec!r}: expected NAME=PATH of an existing model file")
        models[name] = path
    if not models and not a.genai:
        ap.error("nothing to measure: give --model NAME=PATH and/or --genai NAME")
    a.past_cache = evaluate.past_cache_dir(a.past_cache) or "off"
    paths = list(models.values())
    if a.genai:
        from models import peers as pm

        paths.append(str(pm.genai_model(a.genai, "int4", progress=False) / "model.onnx"))
    pasts, note = evaluate.fit_pasts([int(x) for x in a.decode_past.split(",")], a.steps, paths)
    a.pasts = pasts
    vocab = min((runtime.ModelIO.from_model(p).vocab_size or 100) for p in (list(models.values()) or paths))
    cache_from = a.cache_from or next((p for p in models.values() if evaluate._float_cache(p)),
                                      next(iter(models.values()), ""))
    doc = results.provenance()
    doc.update({"schema": "ortlean-decode-memory/1", "kind": "decode-memory", "past": max(pasts), "threads": a.threads, "steps": a.steps,
                "prefill": a.prefill, "decode_pasts": pasts, "notes": [n for n in (note,) if n],
                "cache_from": cache_from, "past_cache": a.past_cache,
                "command": " ".join(["python", "tests/bench/bench_decode_rss.py", *(argv if argv is not None
                                                                                     else sys.argv[1:])]),
                "rows": {}})
    for name, path in models.items():
        print(f"[rss] {name}: {path}", file=sys.stderr, flush=True)
        doc["rows"][name] = _run_child("onnx", path, a, vocab, cache_from) | {"path": path}
    if a.genai:
        print(f"[rss] genai int4 of {a.genai}: its generator prefills {max(pasts):,} tokens", file=sys.stderr,
              flush=True)
        doc["rows"]["genai int4 (its generator)"] = _run_child("genai", a.genai, a, vocab, cache_from)
    print(table(doc))
    if a.json:
        results.write_json(a.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
