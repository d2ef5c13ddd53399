"""Prefill of a long prompt: the time to the first generated token's logits after an N-token prompt,
for ortlean models (what `ortlean generate --prompt-file` runs: shared K/V buffers, the prompt in
chunks), onnxruntime-genai's int4 model in its own generator (``append_tokens`` in chunks) and
llama.cpp on the same GGUF (``llama-bench -p N -n 0``), one run, interleaved.

    python tests/bench/bench_long_prompt.py MODEL_NAME --model LABEL=PATH [--model ...] \\
        [--tokens 4096] [--threads 2] [--repeats 2] [--chunk 1024] [--tokenizer FILE] [--text FILE] \\
        [--no-genai] [--no-llama] [--json OUT]
    python tests/bench/bench_long_prompt.py qwen2.5-coder-1.5b --model long-context=qwen-long/model.onnx \\
        --model lossless=qwen-lossless/model.onnx --tokens 4096 --threads 2 \\
        --json tests/bench/results/qwen2.5-coder-1.5b-long-prompt.json

MODEL_NAME is a packaged model (its genai int4 peer and GGUF). The prompt is the start of the held-out
novel (`ortlean corpus --eval`), tokenized by the model's tokenizer (llama-bench makes its own random
prompt of the same length: a prompt's cost does not depend on its tokens). Every ONNX row prefills
the same tokens from an empty cache; each is timed ``--repeats`` times after one untimed run, rows
rotating; llama-bench reports the mean of its ``--repeats`` repetitions (after its own warm-up).
Printed and kept in ``--json`` (with commit, machine and date): tokens/s of each row, and each row's
time against llama.cpp's. Run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


class OursRow:
    def __init__(self, path: str, threads: int, chunk: int, n: int):
        import custom_ops
        from custom_ops import runtime

        self.sess = custom_ops.session(path, threads=threads)
        self.io = runtime.ModelIO.from_session(self.sess, path)
        self.kv = runtime.SharedKV(self.sess, self.io, n + 8)
        self.chunk = chunk

    def prefill(self, ids) -> float:
        t0 = time.perf_counter()
        self.kv.prefill(ids, chunk=self.chunk)
        return time.perf_counter() - t0


class GenaiRow:
    """genai's generator, as the bench's og rows run it (custom_ops.runtime.bench.OgRow)."""

    def __init__(self, model_dir: str, threads: int, chunk: int):
        from custom_ops.runtime.bench import OgRow

        self.og = OgRow(model_dir, threads, {}, 0, 0)
        self.chunk = chunk

    def prefill(self, ids) -> float:
        g = self.og._gen(ids.size + 8)
        t0 = time.perf_counter()
        self.og.append(g, ids, self.chunk)
        dt = time.perf_counter() - t0
        del g
        return dt


def main(argv=None) -> int:
    import numpy as np

    from custom_ops import runtime
    from custom_ops.runtime.bench import settle
    from models import corpus, peers, prepare
    from rewriter import results
    from rewriter.cli import _labelled

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", help="packaged model: its genai int4 peer, GGUF and tokenizer")
    ap.add_argument("--model", action="append", type=_labelled, default=[], metavar="LABEL=MODEL")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=runtime.PREFILL_CHUNK)
    ap.add_argument("--tokenizer", help="tokenizer.json (default: the packaged model's)")
    ap.add_argument("--text", help="the prompt's text file (default: the held-out novel)")
    ap.add_argument("--no-genai", action="store_true")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if not a.model:
        ap.error("give at least one --model LABEL=PATH")

    def say(msg):
        print(f"[long-prompt] {msg}", file=sys.stderr, flush=True)

    tok = runtime.load_tokenizer(a.tokenizer or str(prepare.model_dir(a.name)))
    source = Path(a.text).name if a.text else corpus.EVAL_NOVEL
    text = Path(a.text).read_text() if a.text else corpus.text(corpus.EVAL_NOVEL)
    ids = runtime.tokenize(tok, text)[: a.tokens]
    if ids.size < a.tokens:
        ap.error(f"{source} has only {ids.size} tokens")
    ids = ids[None, :]
    rows, notes = {}, []
    for label, path in a.model:
        say(f"{label}: session for {path}")
        rows[label] = OursRow(path, a.threads, a.chunk, a.tokens)
    if not a.no_genai:
        why = peers.genai_available()
        if why:
            notes.append(f"genai row skipped: {why}")
        else:
            rows["genai int4 (its generator)"] = GenaiRow(str(peers.genai_model(a.name, "int4")), a.threads, a.chunk)
    times = {k: [] for k in rows}
    order = list(rows)
    for rnd in range(1 + a.repeats):
        k = rnd % len(order)
        for r in order[k:] + order[:k]:
            settle(a.threads)
            dt = rows[r].prefill(ids)
            say(f"round {rnd}: {r} {dt:.1f} s")
            if rnd:
                times[r].append(dt)
    out_rows = [{"name": r, "seconds": statistics.median(v), "seconds_all": v,
                 "tok_s": round(a.tokens / statistics.median(v), 1)} for r, v in times.items()]
    del rows
    llama = None
    if not a.no_llama:
        lrows, note, _ = peers.llama_bench(a.name, threads=(a.threads,), prompt=a.tokens, gen=0,
                                        repetitions=a.repeats)
        pp = [x for x in lrows if x["test"] == f"pp{a.tokens}"]
        if pp:
            llama = {"name": "llama.cpp (llama-bench)", "tok_s": round(pp[0]["tok_s"], 1),
                     "seconds": a.tokens / pp[0]["tok_s"], "command": note, "build": pp[0].get("build")}
            out_rows.append(llama)
        else:
            notes.append(note)
    for r in out_rows:
        if llama:
            r["vs_llama_cpp"] = round(r["tok_s"] / llama["tok_s"], 2)
        print(f"{r['name']:32s} {a.tokens}-token prompt: {r['seconds']:7.1f} s  {r['tok_s']:7.1f} tok/s"
              + (f"  {r['vs_llama_cpp']:.2f}x llama.cpp" if llama else "")
              + f"  ({results.machine()['isa']}, {a.threads} threads)")
    for n in notes:
        print("note:", n)
    if a.json:
        doc = results.provenance()
        doc.update({"what": "prefill of a long prompt (time to the first generated token's logits)",
                    "command": "python tests/bench/bench_long_prompt.py " + " ".join(argv or sys.argv[1:]),
                    "model_name": a.name, "tokens": a.tokens, "threads": a.threads, "repeats": a.repeats,
                    "chunk": a.chunk, "prompt": f"the first {a.tokens} tokens of {source}",
                    "rows": out_rows, "notes": notes})
        results.write_json(a.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
