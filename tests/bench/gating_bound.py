"""How much faster can gating make a decode step, at most? (issue 11)

A single-token decode step of a quantized small LM is bandwidth-bound: it streams every weight
byte once. Gating can at best skip the bytes of the input channels it drops, so the speedup a
perfect gated kernel (zero gate cost, skipped bytes never read) could reach is

    bound = bytes read per token by the ungated twin / bytes read per token by the gated model

This script measures it on a gated model: it runs teacher-forced decode steps on held-out text
(Persuasion by default) through the KV cache, reads each EventGatedMatMul's *measured* kept
channels from the ops' runtime metrics (decode steps only; prefill is excluded), and counts the
bytes every node reads per token:

- MatMulNBits and ungated weights: all their initializer bytes;
- EventGatedMatMul: kept fraction x (weights + scales) -- the ideal (element-wise skipping
  of whole bytes and scale groups; the int4k layout actually skips channel pairs);
- a Gather/GatherBlockQuantized of a table: one row (a Reshape/Cast of a constant: nothing, ORT
  folds it when the session starts);
- attention: the fp32 K/V cache at the given past, one row of the rotary cos/sin caches.

The twin is the same graph at keep 1. The printed bound ignores the gate's own compute (so it is
an upper bound on what gating can give), and everything in the step that is not weight or cache
traffic (so the true decode time ratio is closer to 1 than the bound).

    python tests/bench/gating_bound.py MODEL [--past 128] [--steps 64] [--text persuasion] [--json F]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _nbytes(t) -> int:
    import onnx

    n = int(np.prod(t.dims)) if len(t.dims) else 1
    return n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def bytes_per_token(model, keep: dict[str, float], kv_cache: float) -> dict:
    """Bytes one decode step reads, per node kind, with gated nodes at their ``keep`` fraction
    (a node missing from ``keep`` is read whole); ``kv_cache``: the cache bytes a step reads."""
    sizes = {t.name: (_nbytes(t), list(t.dims)) for t in model.graph.initializer}
    out = defaultdict(float, kv_cache=float(kv_cache))
    for n in model.graph.node:
        w = [sizes[i] for i in n.input if i in sizes]
        total = sum(b for b, _ in w)
        if n.op_type in ("Gather", "GatherBlockQuantized") and w:
            rows = w[0][1][0] if w[0][1] else 1
            out["embedding"] += total / max(rows, 1)
        elif n.op_type == "EventGatedMatMul":
            out["gated"] += keep.get(n.name, 1.0) * total
        elif n.op_type in ("MatMulNBits", "MatMul", "Gemm"):
            out["head" if "lm_head" in n.name else "matmul"] += total
        elif n.op_type in ("Reshape", "Transpose", "Cast", "Unsqueeze", "Squeeze"):
            continue  # on a constant: folded at session start (the shared embedding's scales view)
        elif n.op_type in ("GroupQueryAttention", "RotaryEmbedding"):
            out["other"] += sum(b / max(d[0], 1) for b, d in w if d)  # one row of the cos/sin caches
        else:
            out["other"] += total
    out["total"] = sum(v for k, v in out.items())
    return dict(out)


def measure_keep(path: str, ids: np.ndarray, past: int, steps: int, threads: int) -> tuple[dict, dict, dict]:
    """Decode ``steps`` tokens after a ``past``-token prefill; per gated node the kept fraction of
    its input channels over the decode steps (runtime metrics), the mean per role, and the bytes
    of the fp32 K/V cache one step reads."""
    import custom_ops
    from custom_ops.runtime.io import ModelIO, feeds, run

    sess = custom_ops.session(path, threads=threads)
    io = ModelIO.from_session(sess, path)
    ids = np.asarray(ids, dtype=np.int64)
    state = io.next_state(run(sess, io, feeds(io, ids[None, :past])))
    custom_ops.reset_metrics()
    for i in range(steps):
        state = io.next_state(run(sess, io, feeds(io, ids[None, past + i: past + i + 1], state, past + i)))
    keep, role = {}, defaultdict(list)
    for name, m in custom_ops.metrics().items():
        if m.get("kwta.channels"):
            keep[name] = m["kwta.kept_channels"] / m["kwta.channels"]
            r = re.search(r"(gate|up|down|q|k|v|o|qkv)_proj", name)
            role[r.group(1) if r else "?"].append(keep[name])
    kv = 2 * io.num_layers * past * io.kv_heads * io.head_dim * 4  # fp32 K and V, every layer
    return keep, {k: float(np.mean(v)) for k, v in role.items()}, kv


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--text", default="persuasion")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    import onnx

    from custom_ops.runtime.io import load_tokenizer, tokenize
    from models import corpus

    tok = load_tokenizer(a.model)
    ids = tokenize(tok, corpus.text(a.text))[: a.past + a.steps + 1]
    keep, roles, kv = measure_keep(a.model, ids, a.past, a.steps, a.threads)
    if not keep:
        sys.exit(f"{a.model}: no EventGatedMatMul node reported kept channels (not a gated model?)")
    m = onnx.load(a.model, load_external_data=False)
    gated = bytes_per_token(m, keep, kv)
    twin = bytes_per_token(m, {}, kv)
    bound = twin["total"] / gated["total"]
    res = {"model": a.model, "past": a.past, "steps": a.steps, "text": a.text, "gated_nodes": len(keep),
           "mean_keep_by_role": roles, "bytes_twin": twin, "bytes_gated": gated, "bound": bound}
    print(f"{a.model}: {len(keep)} gated nodes, decode after a past of {a.past}, {a.steps} steps of {a.text}")
    print("measured keep (mean per role): " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(roles.items())))
    print(f"{'bytes/token (MB)':<18}" + "".join(f"{k:>11}" for k in twin))
    for name, row in (("ungated twin", twin), ("gated, ideal", gated)):
        print(f"{name:<18}" + "".join(f"{row.get(k, 0) / 1e6:>11.2f}" for k in twin))
    print(f"upper bound on decode speedup from gating (bandwidth-bound step, free gate): {bound:.3f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
