"""Where do int8 K/V cache rows lose, per layer: keys or values? And how much does key smoothing win back?
An offline study on a model's own queries, keys and values (not part of the test run):

    python tests/bench/kv_quant_study.py MODEL --calib-text EMMA --text PERSUASION [--context 2048]
                                         [--steps 32] [--alphas 0.5,1] [--json out.json]

MODEL is a fused decoder whose attention is GroupQueryAttention or PackedAttention on GQA's layout
(packed QKV input 0, rotary from its cos/sin caches): every attention node's input 0 (the QKV rows
before rotary) becomes an extra graph output, and the first --context tokens of each text run as one
prefill. Per layer, at --steps query positions spread over the last quarter of the held-out context,
exact attention over every earlier key (float64) is compared with attention over

  k8      int8 keys (per token and KV head, PackedAttention's rows), fp32 values
  v8      fp32 keys, int8 values
  kv8     both int8 (what --attn-kv int8 stores)
  kv8s@a  both int8, keys smoothed: K' = K / s, Q' = Q * s per KV head and rotary pair,
          s = (max|K| / max|Q|) ^ a over the calibration text's pair norms (rotation invariant)
          normalised to geometric mean 1 (rewriter.backends.packed_attention.smooth_scales)

with the op's integer q.k (each query head to ±32767 levels, custom_ops.reference.attn.query_int16).
Printed per layer and overall: mean over query heads and steps of |y' - y| / |y| (y = softmax . V)
and of the logits' max abs error times the scale (what the softmax sees).

Result (Qwen2.5-Coder-1.5B on its GGUF weights, results/packed-attention/kv-int8-error-by-layer-qwen.log):
keys lose, values barely — mean over layers k8 0.0236, v8 0.0064, kv8 0.0258; layer 0 (a key channel
88x the median) 0.227, layer 1 (41x) 0.047; smoothed kv8s@1 0.0149 (layer 0 0.036), kv8s@0.5 0.0177.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def probe_model(path: str) -> tuple[Path, list[dict]]:
    """A copy of the model file (beside it, sharing its external data) with every attention node's input 0 as a graph output; per node its heads,
    scale, rotary caches (numpy) and interleaving."""
    import onnx
    from onnx import numpy_helper

    src = Path(path)
    m = onnx.load(str(src), load_external_data=False)
    inits = {i.name: i for i in m.graph.initializer}
    nodes = []
    for n in m.graph.node:
        if n.op_type not in ("GroupQueryAttention", "PackedAttention"):
            continue
        at = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        if not at.get("num_heads") or (len(n.input) > 1 and n.input[1]):
            continue   # only GQA's packed-QKV layout
        rot = None
        if len(n.input) > 8 and n.input[7] and n.input[7] in inits:
            rot = (numpy_helper.to_array(inits[n.input[7]], base_dir=str(src.parent)).astype(np.float32),
                   numpy_helper.to_array(inits[n.input[8]], base_dir=str(src.parent)).astype(np.float32),
                   bool(at.get("rotary_interleaved", 0)))
        nodes.append({"name": n.name, "qkv": n.input[0], "Hq": int(at["num_heads"]), "Hkv": int(at["kv_num_heads"]),
                      "scale": float(at.get("scale", 0.0)), "rotary": rot})
        m.graph.output.append(onnx.helper.make_tensor_value_info(n.input[0], onnx.TensorProto.FLOAT, None))
    if not nodes:
        raise SystemExit(f"{path}: no GroupQueryAttention / PackedAttention on GQA's packed-QKV layout")
    probe = src.parent / f".kv-quant-study-probe-{os.getpid()}.onnx"   # beside its external data; removed after
    onnx.save(m, str(probe))
    return probe, nodes


def capture(probe: Path, nodes: list[dict], ids: np.ndarray, threads: int) -> list[tuple]:
    """Per attention node: (Q [Hq, T, D], K [Hkv, T, D], V [Hkv, T, D]) before rotary."""
    import custom_ops
    from custom_ops import runtime

    sess = custom_ops.session(str(probe), threads=threads)
    io = runtime.ModelIO.from_session(sess)
    names = [n["qkv"] for n in nodes]
    out = sess.run(names, runtime.feeds(io, ids[None, :]))
    res = []
    for n, x in zip(nodes, out):
        Hq, Hkv = n["Hq"], n["Hkv"]
        T, X = x.shape[1], x.shape[2]
        D = X // (Hq + 2 * Hkv)
        h = x[0].reshape(T, Hq + 2 * Hkv, D).transpose(1, 0, 2)
        res.append((np.ascontiguousarray(h[:Hq]), np.ascontiguousarray(h[Hq:Hq + Hkv]),
                    np.ascontiguousarray(h[Hq + Hkv:])))
    return res


def rope(x: np.ndarray, rot) -> np.ndarray:
    from custom_ops.reference.attn import rotary

    if rot is None:
        return x
    T = x.shape[1]
    return rotary(x[None], np.arange(T)[None], rot[0], rot[1], rot[2])[0]


def study_layer(q, k, v, node, steps, smooth: dict, kv_quant="int8") -> dict:
    """Errors of each variant at `steps` query positions (module docstring)."""
    from custom_ops.reference.attn import query_int16, quantize_rows

    Hq, Hkv = node["Hq"], node["Hkv"]
    D = q.shape[-1]
    scale = node["scale"] or 1.0 / np.sqrt(D)
    g = Hq // Hkv
    qr, kr = rope(q, node["rotary"]), rope(k, node["rotary"])

    def deq(x):
        c, s = quantize_rows(x, kv_quant)
        return c.astype(np.float32) * s[..., None]

    k8, v8 = deq(kr), deq(v)
    variants = {"k8": (qr, k8, v, None), "v8": (qr, kr, v8, None), "kv8": (qr, k8, v8, None)}
    for name, s in smooth.items():          # s [Hkv, D]
        sq = np.repeat(s, g, axis=0)[:, None, :]
        variants[name] = (rope(q * sq, node["rotary"]), deq(rope(k / s[:, None, :], node["rotary"])), v8, None)
    errs = {n: [] for n in variants}
    lerr = {n: [] for n in variants}
    for t in steps:
        for h in range(Hq):
            hk = h // g
            lg = (kr[hk, :t + 1].astype(np.float64) @ qr[h, t].astype(np.float64)) * scale
            p = np.exp(lg - lg.max())
            p /= p.sum()
            y = p @ v[hk, :t + 1].astype(np.float64)
            ny = np.linalg.norm(y) + 1e-30
            for n, (qq, kk, vv, _) in variants.items():
                qi, qs = query_int16(qq[h, t])
                l2 = (kk[hk, :t + 1].astype(np.float64) @ (qi.astype(np.float64) * float(qs))) * scale
                p2 = np.exp(l2 - l2.max())
                p2 /= p2.sum()
                y2 = p2 @ vv[hk, :t + 1].astype(np.float64)
                errs[n].append(np.linalg.norm(y2 - y) / ny)
                lerr[n].append(np.abs(l2 - lg).max())
    return {n: {"err": float(np.mean(errs[n])), "logit_err": float(np.mean(lerr[n]))} for n in variants}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--calib-text", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--alphas", default="0.5,1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()

    from custom_ops import runtime
    from rewriter.backends.packed_attention import smooth_scales

    t0 = time.time()
    tok = runtime.load_tokenizer(a.model)
    probe, nodes = probe_model(a.model)
    ids_c = runtime.tokenize(tok, Path(a.calib_text).read_text(encoding="utf-8", errors="replace"))[: a.context]
    ids_e = runtime.tokenize(tok, Path(a.text).read_text(encoding="utf-8", errors="replace"))[: a.context]
    try:
        cal = capture(probe, nodes, np.asarray(ids_c, np.int64), a.threads)
        ev = capture(probe, nodes, np.asarray(ids_e, np.int64), a.threads)
    finally:
        probe.unlink()
    T = len(ids_e)
    steps = np.unique(np.linspace(3 * T // 4, T - 1, a.steps).astype(int))
    alphas = [float(x) for x in a.alphas.split(",") if x]
    rows = []
    print(f"{a.model}: {len(nodes)} layers, context {T}, {len(steps)} decode positions in its last quarter; "
          f"calibration {Path(a.calib_text).name} ({len(ids_c)} tokens), held-out {Path(a.text).name}")
    for i, (node, (qc, kc, _), (q, k, v)) in enumerate(zip(nodes, cal, ev)):
        smooth = {f"kv8s@{al:g}": smooth_scales(kc, node["rotary"], q=qc, alpha=al) for al in alphas}
        r = study_layer(q, k, v, node, steps, smooth)
        kmax = np.abs(kc).max(axis=1)          # [Hkv, D]
        r["k_outlier"] = float((kmax.max(-1) / np.median(kmax, -1)).max())
        rows.append({"layer": i, **r})
        print(f"layer {i:2d}  max/median |k| channel {r['k_outlier']:6.1f}  " +
              "  ".join(f"{n} {v['err']:.4f}" for n, v in r.items() if isinstance(v, dict)), flush=True)
    names = [n for n, v in rows[0].items() if isinstance(v, dict)]
    mean = {n: float(np.mean([r[n]["err"] for r in rows])) for n in names}
    lmean = {n: float(np.mean([r[n]["logit_err"] for r in rows])) for n in names}
    print("mean over layers: " + "  ".join(f"{n} {mean[n]:.4f} (logit {lmean[n]:.4f})" for n in names))
    print(f"{time.time() - t0:.0f} s")
    if a.json:
        from rewriter.results import provenance, write_json

        write_json(a.json, {**provenance(), "command": " ".join(sys.argv), "model": a.model, "context": T,
                            "steps": len(steps), "layers": rows, "mean": mean, "logit_mean": lmean})


if __name__ == "__main__":
    main()
