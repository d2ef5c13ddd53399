"""How to quantize the weights (``--weights int8|int4``): block size, symmetric or not, and
MatMulNBits ``accuracy_level``, measured on SmolLM2-135M's fused graph (rewriter.fuse) on this CPU.

    python tests/bench/bench_weights.py [--threads 1,2] [--bits 4,8] [--blocks 32,64,128]
                                        [--levels 4,1] [--windows 8] [--repeats 7] [--json FILE]

For every configuration: decode step latency after a past of 128 tokens and prefill latency of 128
tokens (sessions interleaved in one process, medians; runtime.bench_sessions) at each thread count,
and Δppl on held-out Persuasion (512-token windows) against the unfused fp32 optimum export.
Models are built once under ~/.cache/ortlean/fastgraph (the fused fp32 graph takes ~1 min).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--blocks", default="32,64,128")
    ap.add_argument("--levels", default="4,1")
    ap.add_argument("--symmetric", default="1,0")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args()
    import numpy as np

    from fastgraph_models import fused_model, ort_session, quantized_model
    from models import corpus, prepare
    from custom_ops import runtime

    t_start = time.monotonic()
    dense = prepare.prepare("smollm2") / "model.onnx"
    fp32 = fused_model("smollm2")
    configs = []
    for bits, bs, lvl, sym in itertools.product(map(int, a.bits.split(",")), map(int, a.blocks.split(",")),
                                                map(int, a.levels.split(",")), map(int, a.symmetric.split(","))):
        if bits == 8 and not sym:
            continue  # 8-bit: the asymmetric zero point buys nothing measurable (and ORT packs it the same way)
        configs.append((f"int{bits} b{bs} {'sym' if sym else 'asym'} acc{lvl}",
                        dict(bits=bits, block_size=bs, symmetric=bool(sym), accuracy_level=lvl)))
    paths = {"fused fp32": fp32}
    for name, cfg in configs:
        paths[name] = quantized_model(fp32, **cfg)
    # quality
    tok = runtime.load_tokenizer(dense)
    text = corpus.text(corpus.EVAL_NOVEL)
    ids = runtime.tokenize(tok, text)[: 512 * a.windows]
    ref_s = ort_session(dense, 2)
    ref = runtime.perplexity(ref_s, runtime.ModelIO.from_session(ref_s), ids, window=512)["ppl"]
    del ref_s
    res = {"ppl_ref": ref, "rows": {}}
    for name, p in paths.items():
        s = ort_session(p, 2)
        ppl = runtime.perplexity(s, runtime.ModelIO.from_session(s), ids, window=512)["ppl"]
        res["rows"][name] = {"ppl": ppl, "delta_ppl": ppl / ref - 1, "bytes": runtime.weight_bytes(p)}
        print(f"{name:28s} ppl {ppl:8.3f}  Δppl {100 * (ppl / ref - 1):+6.2f} %", flush=True)
    # speed
    for t in map(int, a.threads.split(",")):
        sessions = {n: ort_session(p, t) for n, p in paths.items()}
        io = runtime.ModelIO.from_session(sessions["fused fp32"])
        r = runtime.bench_sessions(sessions, io, prefill_len=128, decode_past=128, decode_steps=16,
                                  repeats=a.repeats, warmup=1)
        for n, row in r["sessions"].items():
            res["rows"][n][f"t{t}"] = {"decode_ms": row["decode"]["median_ms"], "prefill_ms": row["prefill"]["median_ms"]}
        del sessions
    print(f"\nSmolLM2-135M fused graph; Δppl on {len(ids)} tokens of {corpus.EVAL_NOVEL} vs the optimum fp32 "
          f"export (ppl {ref:.3f}); medians, interleaved")
    hdr = f"{'weights':28s} {'MiB':>6s} {'Δppl %':>7s}"
    for t in a.threads.split(","):
        hdr += f" {'dec ms t' + t:>10s} {'tok/s':>6s} {'pre ms t' + t:>10s}"
    print(hdr)
    for n, row in res["rows"].items():
        line = f"{n:28s} {row['bytes'] / 2**20:6.1f} {100 * row['delta_ppl']:+7.2f}"
        for t in a.threads.split(","):
            s = row[f"t{t}"]
            line += f" {s['decode_ms']:10.2f} {1e3 / s['decode_ms']:6.1f} {s['prefill_ms']:10.1f}"
        print(line)
    print(f"({time.monotonic() - t_start:.0f} s)")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
