"""Which key code picks PackedAttention's candidates best? An offline study on SmolLM2's own
queries, keys and values (not part of the test run):

    python tests/bench/key_scorer_study.py [--context 4096] [--steps 32] [--budgets 0.125,0.25]
                                           [--window 128] [--sinks 4] [--json out.json]

The HF model (models.prepare's cached fp32 SmolLM2) runs the first --context tokens of the
calibration novel and of the held-out one; every layer's post-RoPE queries and keys and its values
are captured. Scorers are fitted on the calibration novel only and judged on the held-out novel at
--steps decode positions spread over the last quarter of the context: each picks, per KV-head group,
the sinks, the window and the best ceil(budget * T) - sinks - window of the rest by its group
score (the group query q_g = sum of the group's query heads, as the op scores), and the attention
over that set is compared with exact attention (all keys):

  mass   mean over query heads of the exact softmax mass the set holds
  err    mean over query heads of |y_set - y| / |y| (y = softmax . V)

Scorers (8 bytes of code per key and head at D = 64 except the oracle):
  oracle    the exact group score (PackedAttention select = "exact")
  sign      sign bits times mean|k| (the op's default)
  sign+cal  sign bits with the query times the calibrated per-channel mean|k_d| (--attn-calibrate)
  pq4       product quantization: 16 subspaces of 4 dims (RoPE pairs (i, i + D/2) and (i + 1,
            i + 1 + D/2) together), 16 k-means centroids each: one nibble per subspace, fitted on
            the calibration keys at their own positions (--calib-tokens of them)
  pq4a      the same, fitted on the calibration keys each rotated back from its position and on to
            --augment random positions of the context (what the rewriter does: fit_pq_book)
  pq8       8 subspaces of 8 dims, 256 centroids: one byte per subspace

Result (AVX-512 machine, results/packed-attention/key-scorer-study.log: --steps 16 --scorers
oracle,sign,sign+cal,pq4,pq4a --calib-tokens 512 --augment 8): attention-output error at budget
0.125, oracle 0.065, sign+cal 0.134, pq4 0.114, pq4a 0.085.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def capture(hf_dir, ids):
    """Per layer: q [Hq, T, D], k [Hkv, T, D] (post-RoPE), v [Hkv, T, Dv] float32 numpy."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama as ml

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    cfg = model.config
    Hkv, D = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    qs, ks, vs = [], [], []
    orig = ml.apply_rotary_pos_emb

    def rope(q, k, cos, sin, *args, **kw):
        qe, ke = orig(q, k, cos, sin, *args, **kw)
        if not ks:
            capture.cos, capture.sin = cos[0].float().numpy().copy(), sin[0].float().numpy().copy()
        qs.append(qe[0].float().numpy().copy())
        ks.append(ke[0].float().numpy().copy())
        return qe, ke

    hooks = [layer.self_attn.v_proj.register_forward_hook(
        lambda m, i, o: vs.append(o[0].detach().float().numpy().reshape(-1, Hkv, D).transpose(1, 0, 2).copy()))
        for layer in model.model.layers]
    ml.apply_rotary_pos_emb = rope
    try:
        with torch.no_grad():
            model(torch.as_tensor(ids[None]), use_cache=False)
    finally:
        ml.apply_rotary_pos_emb = orig
        for h in hooks:
            h.remove()
    capture.inv_freq = model.model.rotary_emb.inv_freq.float().numpy().copy()
    capture.attn_scaling = float(getattr(model.model.rotary_emb, "attention_scaling", 1.0))
    return qs, ks, vs, cfg


def rerotate(k, cos, sin, inv_freq, positions, scaling=1.0):
    """Post-RoPE keys k [T, D] (HF rotate_half layout, cos/sin [T, D] of their positions) turned back
    to pre-RoPE and rotated again to `positions` [T]."""
    half = k.shape[1] // 2
    rh = lambda x: np.concatenate([-x[:, half:], x[:, :half]], 1)
    pre = k * cos - rh(k) * sin  # inverse rotation (cos^2 + sin^2 = scaling^2 folded below)
    pre = pre / (scaling * scaling)
    ang = positions[:, None].astype(np.float64) * inv_freq[None].astype(np.float64)
    c = np.cos(np.concatenate([ang, ang], 1)).astype(np.float32) * scaling
    s = np.sin(np.concatenate([ang, ang], 1)).astype(np.float32) * scaling
    return pre * c + rh(pre) * s


def subspaces(D, width):
    """Dim groups of `width`: RoPE pairs (i, i + D/2) kept together, consecutive pairs grouped."""
    half = D // 2
    per = width // 2
    return [np.array([i for j in range(s, s + per) for i in (j, j + half)]) for s in range(0, half, per)]


def fit_pq(k, D, width, ncent, seed=0):
    """k [T, D] (one layer, one KV head) -> [(dims, centroids [ncent, width])]."""
    from scipy.cluster.vq import kmeans2
    out = []
    for dims in subspaces(D, width):
        x = k[:, dims].astype(np.float64)
        c, _ = kmeans2(x, ncent, minit="++", seed=seed, iter=20)
        out.append((dims, c.astype(np.float32)))
    return out


def pq_codes(k, book):
    codes = []
    for dims, c in book:
        x = k[:, dims]
        d2 = (x * x).sum(1)[:, None] - 2 * x @ c.T + (c * c).sum(1)[None]
        codes.append(d2.argmin(1))
    return codes


def pq_score(qg, codes, book):
    s = 0.0
    for (dims, c), cd in zip(book, codes):
        s = s + (c @ qg[dims])[cd]
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--budgets", default="0.0625,0.125,0.25")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--scorers", default="oracle,sign,sign+cal,pq4,pq8")
    ap.add_argument("--calib-tokens", type=int, default=0, help="fit on the first N calibration tokens (default: all)")
    ap.add_argument("--augment", type=int, default=8, help="pq4a: copies of each calibration key at random positions")
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    from models import corpus, prepare as prep
    from custom_ops import runtime

    d = prep.prepare("smollm2")
    hf = sorted((Path.home() / ".cache" / "ortlean" / "hf").glob("smollm2-hf-*"))[-1]
    tok = runtime.load_tokenizer(d)
    enc = lambda t: np.asarray(tok.encode(corpus.text(t), add_special_tokens=False).ids[: a.context], np.int64)
    t0 = time.time()
    _, kc, _, cfg = capture(hf, enc(corpus.CALIB_NOVEL))
    ccos, csin, inv_freq, scl = capture.cos, capture.sin, capture.inv_freq, capture.attn_scaling
    qe, ke, ve, _ = capture(hf, enc(corpus.EVAL_NOVEL))
    print(f"captured {len(ke)} layers in {time.time() - t0:.0f} s", flush=True)
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = cfg.hidden_size // Hq
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D)
    T = ke[0].shape[1]
    steps = np.unique(np.linspace(T * 3 // 4, T - 1, a.steps).astype(int))
    budgets = [float(b) for b in a.budgets.split(",")]
    scorers = a.scorers.split(",")
    res = {s: {b: {"mass": [], "err": []} for b in budgets} for s in scorers}
    t0 = time.time()
    for L in range(len(ke)):
        for hk in range(Hkv):
            kcal = kc[L][hk][: a.calib_tokens or None]
            k, v = ke[L][hk], ve[L][hk]
            q = qe[L][hk * G:(hk + 1) * G]  # [G, T, D]
            kscale = np.abs(kcal).mean(0)
            books = {}
            if "pq4" in scorers:
                books["pq4"] = fit_pq(kcal, D, 4, 16)
            if "pq4a" in scorers:  # calibration keys re-rotated to random positions of the context
                rng = np.random.default_rng(L * 16 + hk)
                n = kcal.shape[0]
                aug = [rerotate(kcal, ccos[:n], csin[:n], inv_freq, rng.integers(0, a.context, n), scl)
                       for _ in range(a.augment)]
                books["pq4a"] = fit_pq(np.concatenate(aug, 0), D, 4, 16)
            if "pq8" in scorers:
                books["pq8"] = fit_pq(kcal, D, 8, 256)
            codes = {n: pq_codes(k, b) for n, b in books.items()}
            sgn = np.where(k > 0, 1.0, -1.0).astype(np.float32)
            gamma = np.abs(k).mean(1)
            for t in steps:
                ctx = t + 1
                logits = (q[:, t] @ k[:ctx].T) * scale  # [G, ctx]
                p = np.exp(logits - logits.max(1, keepdims=True))
                p /= p.sum(1, keepdims=True)
                y = p @ v[:ctx]
                qg = q[:, t].sum(0)
                rest = np.arange(a.sinks, ctx - a.window)
                for s in scorers:
                    if s == "oracle":
                        sc = k[rest] @ qg
                    elif s == "sign":
                        sc = (sgn[rest] @ qg) * gamma[rest]
                    elif s == "sign+cal":
                        sc = (sgn[rest] @ (qg * kscale)) * gamma[rest]
                    else:
                        sc = pq_score(qg, [c[rest] for c in codes[s]], books[s])
                    order = np.argsort(-sc, kind="stable")
                    for b in budgets:
                        C = max(0, math.ceil(b * ctx) - a.sinks - a.window)
                        sel = np.concatenate([np.arange(a.sinks), rest[order[:C]], np.arange(ctx - a.window, ctx)])
                        ps = p[:, sel]
                        mass = ps.sum(1)
                        ys = (ps / mass[:, None]) @ v[sel]
                        err = np.linalg.norm(ys - y, axis=1) / np.maximum(np.linalg.norm(y, axis=1), 1e-12)
                        res[s][b]["mass"].append(float(mass.mean()))
                        res[s][b]["err"].append(float(err.mean()))
        print(f"layer {L} done ({time.time() - t0:.0f} s)", flush=True)
    print(f"\ncontext {T}, {len(steps)} decode steps in [{steps[0]}, {steps[-1]}], window {a.window}, sinks {a.sinks}")
    print(f"{'scorer':10s}" + "".join(f" | b{b:<6g} mass   err(mean) err(p90)" for b in budgets))
    summary = {}
    for s in scorers:
        row = f"{s:10s}"
        for b in budgets:
            m, e = np.array(res[s][b]["mass"]), np.array(res[s][b]["err"])
            summary.setdefault(s, {})[str(b)] = {"mass": float(m.mean()), "err": float(e.mean()),
                                                 "err_p90": float(np.quantile(e, 0.9))}
            row += f" | {m.mean():13.4f} {e.mean():9.4f} {np.quantile(e, 0.9):8.4f}"
        print(row)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "summary": summary}, indent=1))
    return 0


import numpy as np  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
