"""Issue 9's comparison table: ortlean's fast form of SmolLM2-135M against what a speed-minded user
would otherwise run, all in ONE process on this machine.

    python tests/bench/bench_fastgraph.py [--threads 1,2] [--pasts 128,4096] [--repeats 7]
        [--steps 16] [--windows 8] [--no-llama] [--no-og] [--no-shared] [--profile] [--json FILE]

Models (ONNX Runtime CPU EP):
  optimum fp32     the optimum export, unfused (the reference of every Δppl)
  fused fp32       rewriter.fuse.fuse_decoder(optimum export)
  fused int8/int4  + rewriter.quantize.quantize_weights(..., "int8" / "int4")  (its DEFAULTS)
  genai fp32/int4  onnxruntime-genai 0.15.2's model builder on the same fp32 checkpoint (models.peers)
Drivers (the row name says which):
  "<model>"              custom_ops.runtime's loop on a plain InferenceSession: feeds with
                         past_key_values.*, the presents (new arrays, the cache copied) fed back
  "<model> | shared KV"  custom_ops.runtime.shared_kv on the same kind of session: past and present bound to
                         one buffer per layer (IOBinding; GQA graphs only)
  "<model> | og"         onnxruntime_genai's own generator (append_tokens / generate_next_token, greedy,
                         its shared KV buffers) — how the genai builder's models are meant to run
Beside them, in its own runtime: llama.cpp's llama-bench on the Q4_1 GGUF the package ships
(``../shared/anchors/llama-cpp.sh``, or $ORTLEAN_ANCHORS_SCRIPT; skipped with a note when absent).

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
# the three ways a row is driven; each has prefill(ids) -> seconds and decode(past, steps) -> [seconds]
class OrtRow:
    """custom_ops.runtime's loop on a plain InferenceSession: presents come back as new arrays."""

    def __init__(self, sess, io, states):
        from custom_ops import runtime

        self.runtime, self.sess, self.io, self.states = runtime, sess, io, states

    def prefill(self, ids) -> float:
        f = self.runtime.feeds(self.io, ids)
        self.sess.run(None, f)  # untimed first: another session's spinning pool must not steal the cores
        t0 = time.perf_counter()
        self.sess.run(None, f)
        return time.perf_counter() - t0

    def decode(self, p: int, step_ids) -> list[float]:
        past, plen, out_t = self.states[p], p, []
        for s in range(step_ids.shape[1]):
            f = self.runtime.feeds(self.io, step_ids[:, s: s + 1], past, plen)
            t0 = time.perf_counter()
            out = self.runtime.run(self.sess, self.io, f)
            out_t.append(time.perf_counter() - t0)
            past, plen = self.io.next_state(out), plen + 1
        return out_t


class SharedRow:
    """custom_ops.runtime.shared_kv: the same session, past and present bound to one buffer per layer."""

    def __init__(self, sess, io, states, steps, prefill_len):
        from custom_ops.runtime.shared_kv import SharedKV

        self.kv = {p: SharedKV(sess, io, max_len=p + steps) for p in states}
        for p, st in states.items():
            self.kv[p].fill(p, st)
        self.kv_prefill = SharedKV(sess, io, max_len=prefill_len)

    def prefill(self, ids) -> float:
        self.kv_prefill.prefill(ids)  # untimed first (see OrtRow.prefill)
        t0 = time.perf_counter()
        self.kv_prefill.prefill(ids)
        return time.perf_counter() - t0

    def decode(self, p: int, step_ids) -> list[float]:
        kv = self.kv[p]
        kv.length = p  # rows beyond the length are masked by seqlens_k; the cache itself is unchanged
        out_t = []
        for s in range(step_ids.shape[1]):
            t0 = time.perf_counter()
            kv.step(step_ids[:, s: s + 1])
            out_t.append(time.perf_counter() - t0)
        return out_t


class OgRow:
    """onnxruntime_genai's generator (append_tokens / generate_next_token, shared KV buffers)."""

    def __init__(self, model_dir: Path, threads: int, past_ids: dict, steps: int, rounds: int):
        import onnxruntime_genai as og

        self.og = og
        cfg = og.Config(str(model_dir))
        cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
        self.model = og.Model(cfg)
        self.past_ids, self.steps, self.rounds = past_ids, steps, rounds
        self.gens: dict[int, object] = {}

    def _gen(self, max_length: int):
        p = self.og.GeneratorParams(self.model)
        p.set_search_options(max_length=max_length, do_sample=False)
        return self.og.Generator(self.model, p)

    def prefill(self, ids) -> float:
        ids = np.asarray(ids).reshape(-1).astype(np.int32)
        self._gen(ids.size + 4).append_tokens(ids)
        g = self._gen(ids.size + 4)
        t0 = time.perf_counter()
        g.append_tokens(ids)
        return time.perf_counter() - t0

    def decode(self, p: int, step_ids) -> list[float]:
        # one generator per past length, built once (untimed) and continued: its past grows by
        # `steps` tokens per round (og has no way to rewind a shared-buffer cache cheaply)
        if p not in self.gens:
            g = self._gen(p + self.steps * (self.rounds + 2) + 2)
            g.append_tokens(np.asarray(self.past_ids[p]).reshape(-1).astype(np.int32))
            self.gens[p] = g
        g, out = self.gens[p], []
        for _ in range(step_ids.shape[1]):
            t0 = time.perf_counter()
            g.generate_next_token()
            out.append(time.perf_counter() - t0)
        return out


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
    ap.add_argument("--json")
    a = ap.parse_args()
    threads = [int(x) for x in a.threads.split(",")]
    pasts = [int(x) for x in a.pasts.split(",")]
    t_start = time.monotonic()

    from fastgraph_models import fused_model, ort_session, quantized_model
    from models import corpus, peers, prepare
    from custom_ops import runtime
    from rewriter.quantize import DEFAULTS

    print(isa_line(), flush=True)
    notes = []
    dense = prepare.prepare("smollm2") / "model.onnx"
    fp32 = fused_model("smollm2")
    models: dict[str, Path] = {"optimum fp32": dense, "fused fp32": fp32}
    for w in ("int8", "int4"):
        c = DEFAULTS[w]
        models[f"fused {w}"] = quantized_model(fp32, c.bits, c.block_size, c.symmetric, c.accuracy_level)
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
    gqa = [m for m in models if not m.startswith("optimum")]

    def io_for(name, sess):
        if name in genai_dirs:
            return peers.genai_io(sess, genai_dirs[name])
        return runtime.ModelIO.from_session(sess)

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

    # ---- speed --------------------------------------------------------------------------------
    rng = np.random.default_rng(0)
    prefill_ids = rng.integers(100, 40000, (1, a.prefill))
    past_ids = {p: rng.integers(100, 40000, (1, p)) for p in pasts}
    step_ids = rng.integers(100, 40000, (1, a.steps))
    for t in threads:
        sessions = {n: ort_session(p, t) for n, p in models.items()}
        ios = {n: io_for(n, s) for n, s in sessions.items()}
        # past caches: short ones from each model itself, long ones once from fused fp32 (shared arrays)
        states: dict[str, dict[int, dict]] = {n: {} for n in sessions}
        for p in pasts:
            if p <= 512:
                for n, s in sessions.items():
                    states[n][p] = ios[n].next_state(runtime.run(s, ios[n], runtime.feeds(ios[n], past_ids[p])))
            else:
                t0 = time.perf_counter()
                f = ios["fused fp32"]
                shared = f.next_state(runtime.run(sessions["fused fp32"], f, runtime.feeds(f, past_ids[p])))
                print(f"[t{t}] past {p}: cache built in {time.perf_counter() - t0:.1f} s", flush=True)
                for n in sessions:
                    states[n][p] = {k: shared[k] for k in ios[n].past_to_present}
        drivers = {}
        for r in row_names:
            m, _, how = r.partition(" | ")
            if how == "":
                drivers[r] = OrtRow(sessions[m], ios[m], states[m])
            elif how == "shared KV":
                drivers[r] = SharedRow(sessions[m], ios[m], states[m], a.steps, a.prefill)
            else:
                drivers[r] = OgRow(genai_dirs[m], t, past_ids, a.steps, 1 + a.repeats)
        times = {r: {"prefill": [], **{f"decode{p}": [] for p in pasts}} for r in drivers}
        names = list(drivers)
        for rnd in range(1 + a.repeats):
            k = rnd % len(names)
            for r in names[k:] + names[:k]:
                pt = drivers[r].prefill(prefill_ids)
                dts = {p: drivers[r].decode(p, step_ids) for p in pasts}
                if rnd > 0:  # round 0 warms up
                    times[r]["prefill"].append(pt)
                    for p in pasts:
                        times[r][f"decode{p}"].extend(dts[p])
            print(f"[t{t}] round {rnd}/{a.repeats} ({time.monotonic() - t_start:.0f} s)", flush=True)
        for r, tt in times.items():
            res["rows"][r][f"t{t}"] = {key: float(np.median(v)) * 1e3 for key, v in tt.items()}
        if a.profile:
            res.setdefault("profile", {})[f"t{t}"] = prof = {}
            for n in ("fused int4", "genai int4"):
                if n not in sessions:
                    continue
                for p in pasts:
                    f = runtime.feeds(ios[n], step_ids[:, :1], states[n][p], p)
                    ps = runtime.profile_summary(models[n], lambda path, so=None: _prof_session(path, so, t),
                                                feeds=f, runs=10, warmup=2)
                    prof[f"{n} past{p}"] = {"total_ms": ps.total_ms, "ops": list(ps)[:8]}
        del sessions, drivers, states
        gc.collect()

    # ---- llama.cpp ------------------------------------------------------------------------------
    if not a.no_llama:
        lrows, note = peers.llama_bench("smollm2", threads=threads, prompt=a.prefill, gen=64,
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
             ("fused int4 | shared KV", "genai int4 | og", ""), ("fused fp32", "genai fp32", ""),
             ("fused fp32 | shared KV", "genai fp32 | og", "")]
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
