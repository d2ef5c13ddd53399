"""Issue 9's comparison table: ortlean's fast form of SmolLM2-135M against what a speed-minded user
would otherwise run, all in ONE process on this machine.

    python tests/bench/bench_fastgraph.py [--threads 1,2] [--pasts 128,4096] [--repeats 7]
        [--steps 16] [--windows 8] [--no-llama] [--no-og] [--no-shared] [--profile] [--json FILE]

Models (ONNX Runtime CPU EP):
  optimum fp32     the optimum export, unfused (the reference of every Δppl)
  fused fp32       rewriter.fuse.fuse_decoder(optimum export)
  fused int8/int4  + rewriter.quantize.quantize_weights(..., "int8" / "int4")  (its DEFAULTS: the tied
                   embedding shared)
  fused fp32/int4 pa-exact  fused fp32/int4 with every GroupQueryAttention replaced by ortlean's PackedAttention in
                   its exact fp32 cache mode (fastgraph_models.exact_attention_model: `ortlean rewrite
                   --attn-exact on`, which `--weights int4` does by default where it measures faster): the
                   same attention, ortlean's kernel
  genai fp32/int4  onnxruntime-genai 0.15.2's model builder on the same fp32 checkpoint (models.peers)
  "<model> (twin)" (--twin) a second session of the same file, timed as its own row: an A/A check of
                   the bench's resolution (session order and memory placement, not the graph)
Drivers (the row name says which; custom_ops.runtime.bench.LoopRow / SharedRow / OgRow, the table
loop is custom_ops.runtime.bench.decode_table, the same code `ortlean bench` runs):
  "<model>"              custom_ops.runtime's loop on a plain InferenceSession: feeds with
                         past_key_values.*, the presents (new arrays, the cache copied) fed back
  "<model> | shared KV"  custom_ops.runtime.shared_kv on the same kind of session: past and present bound to
                         one buffer per layer (IOBinding; GQA graphs only)
  "<model> | og"         onnxruntime_genai's own generator (append_tokens / generate_next_token, greedy,
                         its shared KV buffers) — how the genai builder's models are meant to run
Beside them, in its own runtime: llama.cpp's llama-bench on the Q4_1 GGUF the package ships
(``models.llamacpp``: Debian's build fetched into the cache, or $ORTLEAN_ANCHORS_SCRIPT; skipped with a note
when neither can run).

Timing: one warm-up round, then ``--repeats`` rounds; each round runs every row once per measurement
(order rotated every round): a prefill of 128 random tokens from an empty cache (after an untimed one,
so another session's spinning pool does not steal the cores) and ``--steps`` single-token decode steps
after a past of each ``--pasts`` length (short pasts: the model's own cache; longer ones: one cache
built once by fused fp32 and given to every ORT row — values do not change the cost; og rows build
their own once and continue it). Medians over rounds (prefill) and over all steps (decode). Δppl:
runtime.perplexity on ``--windows`` windows of 512 tokens of the held-out novel (Persuasion), each
model against the optimum fp32 export. Models are built once and cached under ~/.cache/ortlean
(fused fp32 about a minute, genai builds about a minute).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402


def isa_line() -> str:
    flags = set()
    model = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    keep = [f for f in ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni",
                        "avx512_bf16", "amx_tile") if f in flags]
    import onnxruntime as ort

    return (f"CPU: {model}, {os.cpu_count()} logical cores; ISA: {' '.join(keep)}; onnxruntime {ort.__version__}; "
            f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


# ---------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--pasts", default="128,4096")
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--llama-reps", type=int, default=3)
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--no-og", action="store_true")
    ap.add_argument("--no-shared", action="store_true")
    ap.add_argument("--no-ppl", action="store_true")
    ap.add_argument("--profile", action="store_true", help="per-op ORT profile of fused int4 vs genai int4 decode")
    ap.add_argument("--models", help="comma list of models (optimum fp32, fused fp32, fused int8, fused int4, "
                                     "genai fp32, genai int4); default all")
    ap.add_argument("--malloc-as-is", action="store_true",
                    help="leave glibc's dynamic mmap threshold (the sessions' weights then sit where the build "
                         "order puts them; see custom_ops.runtime.bench.fix_malloc_threshold)")
    ap.add_argument("--no-exact-attn", action="store_true",
                    help="skip the 'fused fp32/int4 pa-exact' rows (fused graphs with ortlean's exact PackedAttention)")
    ap.add_argument("--twin", default="",
                    help="comma list of models to run twice, as '<model>' and '<model> (twin)': two sessions "
                         "of one file in the same run, an A/A check of what the bench can resolve")
    ap.add_argument("--json")
    a = ap.parse_args()
    from custom_ops.runtime.bench import fix_malloc_threshold

    malloc_note = "" if a.malloc_as_is else fix_malloc_threshold()
    malloc_note += " (--malloc-as-is to skip)" if malloc_note else ""
    threads = [int(x) for x in a.threads.split(",")]
    pasts = [int(x) for x in a.pasts.split(",")]
    t_start = time.monotonic()

    from fastgraph_models import exact_attention_model, fused_model, ort_session, quantized_model
    from models import corpus, peers, prepare
    from custom_ops import runtime
    from rewriter.quantize import DEFAULTS

    print(isa_line(), flush=True)
    notes = [malloc_note] if malloc_note else []
    dense = prepare.prepare("smollm2") / "model.onnx"
    fp32 = fused_model("smollm2")
    models: dict[str, Path] = {"optimum fp32": dense, "fused fp32": fp32}
    for w in ("int8", "int4"):
        c = DEFAULTS[w]
        models[f"fused {w}"] = quantized_model(fp32, c.bits, c.block_size, c.symmetric, c.accuracy_level)
    if not a.no_exact_attn:
        # ortlean's own kernel in place of ORT's GroupQueryAttention, same attention (exact fp32 cache)
        for w in ("fp32", "int4"):
            models[f"fused {w} pa-exact"] = exact_attention_model(models[f"fused {w}"])
    genai_dirs = {}
    why = peers.genai_available()
    if why:
        notes.append(f"genai rows skipped: {why}")
    else:
        for p in ("fp32", "int4"):
            genai_dirs[f"genai {p}"] = peers.genai_model("smollm2", p)
            models[f"genai {p}"] = genai_dirs[f"genai {p}"] / "model.onnx"
    if a.models:
        keep = {m.strip() for m in a.models.split(",")} | {"fused fp32"}  # fused fp32 builds the long past
        models = {k: v for k, v in models.items() if k in keep}
    for m in filter(None, (x.strip() for x in a.twin.split(","))):
        if m not in models:
            raise SystemExit(f"--twin {m}: not one of the models ({', '.join(models)})")
        models[f"{m} (twin)"] = models[m]
        if m in genai_dirs:
            genai_dirs[f"{m} (twin)"] = genai_dirs[m]
    gqa = [m for m in models if not m.startswith("optimum")]

    def io_for(name, sess):
        if name in genai_dirs:
            return peers.genai_io(sess, genai_dirs[name])
        return runtime.ModelIO.from_session(sess, models[name])   # the model file: its key packing for long pasts

    # rows: (model, driver)
    row_names = [f"{m}" for m in models]
    if not a.no_shared:
        row_names += [f"{m} | shared KV" for m in gqa]
    if not a.no_og:
        row_names += [f"{m} | og" for m in models if m in genai_dirs]
    res: dict = {"isa": isa_line(), "params": vars(a), "notes": notes,
                 "models": {n: {"path": str(p), "weight_bytes": runtime.weight_bytes(p)} for n, p in models.items()},
                 "rows": {r: {} for r in row_names}}

    # ---- quality ------------------------------------------------------------------------------
    if not a.no_ppl:
        tok = runtime.load_tokenizer(dense)
        ids = runtime.tokenize(tok, corpus.text(corpus.EVAL_NOVEL))[: 512 * a.windows]
        for n, p in models.items():
            if n.endswith(" (twin)"):  # the same file: the same perplexity
                res["models"][n]["ppl"] = res["models"][n[: -len(" (twin)")]]["ppl"]
                continue
            s = ort_session(p, max(threads))
            res["models"][n]["ppl"] = runtime.perplexity(s, io_for(n, s), ids, window=512)["ppl"]
            del s
            gc.collect()
            print(f"ppl {n:14s} {res['models'][n]['ppl']:.4f}", flush=True)
        if "optimum fp32" in models:
            ref = res["models"]["optimum fp32"]["ppl"]
            for n in models:
                res["models"][n]["delta_ppl"] = res["models"][n]["ppl"] / ref - 1
        res["ppl_tokens"] = int(ids.size)

    # ---- speed: custom_ops.runtime.bench.decode_table (what `ortlean bench` runs) ---------------
    from custom_ops.runtime.bench import decode_table

    for t in threads:
        sessions = {n: ort_session(p, t) for n, p in models.items()}
        table = decode_table({n: (s, io_for(n, s)) for n, s in sessions.items()}, pasts, prefill_len=a.prefill,
                             steps=a.steps, repeats=a.repeats, shared=() if a.no_shared else tuple(gqa),
                             og=None if a.no_og else {m: genai_dirs[m] for m in models if m in genai_dirs},
                             threads=t, long_past_from="fused fp32",
                             say=lambda m: print(f"[t{t}] {m} ({time.monotonic() - t_start:.0f} s)", flush=True))
        for r, v in table.items():
            res["rows"][r][f"t{t}"] = v
        if a.profile:
            res.setdefault("profile", {})[f"t{t}"] = prof = {}
            rng = np.random.default_rng(1)
            for n in ("fused int4", "genai int4"):
                if n not in sessions:
                    continue
                io = io_for(n, sessions[n])
                for p in pasts:
                    past = io.next_state(runtime.run(sessions[n], io, runtime.feeds(io, rng.integers(100, 40000, (1, p)))))
                    f = runtime.feeds(io, rng.integers(100, 40000, (1, 1)), past, p)
                    ps = runtime.profile_summary(models[n], lambda path, so=None: _prof_session(path, so, t),
                                                feeds=f, runs=10, warmup=2)
                    prof[f"{n} past{p}"] = {"total_ms": ps.total_ms, "ops": list(ps)[:8]}
        del sessions
        gc.collect()

    # ---- llama.cpp ------------------------------------------------------------------------------
    if not a.no_llama:
        lrows, note, _ = peers.llama_bench("smollm2", threads=threads, prompt=a.prefill, gen=64,
                                        depths=tuple(pasts), repetitions=a.llama_reps)
        res["llama_cpp"] = {"rows": lrows, "command": note}
        if not lrows:
            notes.append(note)

    res["seconds"] = time.monotonic() - t_start
    print_table(res, threads, pasts, a)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))


def _prof_session(path, so, threads):
    import onnxruntime as ort

    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def print_table(res, threads, pasts, a):
    print(f"\nSmolLM2-135M, one process, medians of {a.repeats} interleaved rounds. decode: tokens/s of "
          f"single-token steps after a past of P; prefill: a {a.prefill}-token prompt, tokens/s. "
          "Drivers: (none) = custom_ops.runtime loop, 'shared KV' = custom_ops.runtime.shared_kv (IOBinding), "
          "'og' = onnxruntime_genai generator")
    cols = [(f"dec P{p} t{t}", ("decode", p, t)) for p in pasts for t in threads] + \
           [(f"pre t{t}", ("prefill", None, t)) for t in threads]
    print(f"{'row':26s} {'MiB':>6s} {'Δppl %':>7s} " + " ".join(f"{c:>11s}" for c, _ in cols))
    for r, row in res["rows"].items():
        m = res["models"][r.partition(" | ")[0]]
        line = f"{r:26s} {m['weight_bytes'] / 2**20:6.1f} "
        line += f"{100 * m['delta_ppl']:+7.2f} " if "delta_ppl" in m else f"{'':>7s} "
        for _, (kind, p, t) in cols:
            ms = row.get(f"t{t}", {}).get(f"decode{p}" if kind == "decode" else "prefill")
            tok = None if not ms else (1e3 / ms if kind == "decode" else a.prefill * 1e3 / ms)
            line += f" {tok:11.1f}" if tok else f" {'-':>11s}"
        print(line)
    lc = res.get("llama_cpp")
    if lc and lc["rows"]:
        print(f"llama.cpp, same machine, its own runtime ({lc['command']}); tokens/s, mean ± sd of its repetitions:")
        for r in lc["rows"]:
            print(f"  {r['test']:>12s} t{r['threads']}: {r['tok_s']:8.1f} ± {r['tok_s_std']:.1f}")
    # issue 9's targets: fused int4 vs genai int4 (and fp32 vs fp32), per driver
    R, M = res["rows"], res["models"]
    pairs = [("fused int4", "genai int4", ""), ("fused int4 | shared KV", "genai int4 | shared KV", ""),
             ("fused int4 | shared KV", "genai int4 | og", ""),
             ("fused int4 pa-exact", "genai int4", ""), ("fused int4 pa-exact | shared KV", "genai int4 | shared KV", ""),
             ("fused int4 pa-exact | shared KV", "genai int4 | og", ""),
             ("fused int4 pa-exact | shared KV", "fused int4 | shared KV", ""),
             ("fused fp32", "genai fp32", ""), ("fused fp32 | shared KV", "genai fp32 | og", ""),
             ("fused fp32 pa-exact | shared KV", "genai fp32 | og", "")]
    pairs += [(f"{r} (twin){d}", f"{r}{d}", "") for r in (x.strip() for x in a.twin.split(",") if x.strip())
              for d in ("", " | shared KV")]
    for ours, peer, _ in pairs:
        if ours not in R or peer not in R:
            continue
        parts = []
        for t in threads:
            x, y = R[ours].get(f"t{t}"), R[peer].get(f"t{t}")
            if not x or not y:
                continue
            parts += [f"P{p} t{t} {y[f'decode{p}'] / x[f'decode{p}']:.2f}x" for p in pasts]
            parts.append(f"prefill t{t} {y['prefill'] / x['prefill']:.2f}x")
        mo, mp = M[ours.partition(" | ")[0]], M[peer.partition(" | ")[0]]
        dp = (f"; Δppl {100 * mo['delta_ppl']:+.2f} % vs {100 * mp['delta_ppl']:+.2f} %"
              if "delta_ppl" in mo and "delta_ppl" in mp else "")
        print(f"speed of [{ours}] / [{peer}]: " + ", ".join(parts) + dp)
    for prof_t, prof in (res.get("profile") or {}).items():
        for k, v in prof.items():
            print(f"ORT profile {prof_t} {k}: {v['total_ms']:.2f} ms/run: "
                  + ", ".join(f"{o['op_type']} {o['total_ms']:.2f}" for o in v["ops"][:5]))
    for n in res["notes"]:
        print("note:", n)
    print(f"({res['seconds']:.0f} s; {isa_line()})")


if __name__ == "__main__":
    main()
