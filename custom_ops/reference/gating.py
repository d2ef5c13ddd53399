"""Numpy reference of EventGatedMatMul: the normative definition of the op (see DEVELOPERS.md).

    Y, state_out = EventGatedMatMul(X, W, state_in, Wq, scales, zero_points)

W [K, N] is the layer's dense weight (`weight_format` = f32, the default), or, for the quantized
formats (`weight_format` = int8 | int4), W is absent and the weight is Ŵ = dequantize(Wq, scales,
zero_points) as defined in custom_ops/reference/gating_quant.py (input-channel-major rows, scales per
`weight_group` outputs of a row); everything below then reads Ŵ for W. Per row x (one token of one sequence) the op decides which
input channels — rows of W, in blocks of `block` channels (block = 1: single channels; the last
block may be shorter) — take part, in one ordering:

1. zero-skip (seed 001, `pack` = binary|ternary): blocks whose channels all have |x| ≤ pack_eps
   are skipped (exact when eps = 0). When the fraction of active blocks exceeds `pack_rho` the
   row runs dense (no zero-skip).
2. KWTA (seed 003, `kwta` = 1), among the blocks left by 1: block score
   s_b = sqrt(Σ_{k∈b} (|x_k|·‖W_k‖)²) (`kwta_score` = "xw") or sqrt(Σ x_k²) ("x");
   `kwta_select` = threshold: keep s_b / sqrt(|b|) > kwta_threshold (calibrated offline, a compare);
   topk: the kwta_k highest blocks (ties: lower index); mass: the fewest highest blocks whose
   softmax(s / (kwta_temp · max s)) mass reaches kwta_mass. With `kwta_duty` > 1 and a state, the
   mask is refreshed on steps ≡ 0 (mod duty) and reused in between. `kwta_renorm` = 1 scales the
   gated input by (#candidate blocks / #kept blocks).
   The gated input is x̃ = x ⊙ mask (· renorm); without event mode Y = x̃ · W.
3. event (seed 004, `event` = 1, needs a state): Y approximates x̃ · W by delta updates of a cached
   y: d = x̃ − x_ref; block delta e_b = sqrt(Σ (d_k ‖W_k‖)²); staleness weight
   w_b = event_beta · exp(−event_lambda · age_b); priority e_b / w_b. Blocks with age ≥ event_age_max
   are always refreshed; the others are eligible when e_b > event_theta · ‖x̃ ⊙ ‖W‖‖ / sqrt(nb) and
   they are KWTA/zero-skip candidates; eligible blocks are taken by priority (descending, ties by
   index) until event_topk · nb blocks are taken or their Σe_b reaches event_quorum · Σ_eligible e_b
   (or, in the kernel only, the event_budget_ms time budget runs out). Taken blocks:
   y_cache += d_b · W_b, x_ref_b = x̃_b, age_b = 0; others age_b += 1. Y = y_cache.
   On steps 1, 2, 4, … (< event_gap_every) and then every event_gap_every steps the row is
   computed densely too (checks are frequent at the start of a sequence): gap = ‖y − x̃W‖ / ‖x̃W‖; the output
   of that step is x̃W and the cache is resynchronised; gap > event_gap_tol disables event mode for
   the rest of the sequence (state flag).

State (per batch row; float32 [B, S], S = 8 + K + N + 2·nb; [B, 0] = new sequence):
  [0] initialised, [1] step, [2] event disabled, [3] last gap, [4..8) reserved,
  x_ref [K], y_cache [N], age [nb], KWTA block mask [nb].
A row with an uninitialised state (a prefill) is computed without event mode (x̃ · W, or x · W
when `dense_prefill` = 1 and the call has T > 1 tokens per sequence) and initialises the state
from its last token (step 0). Each later token increments step. X [..., T, K] (rank ≥ 3) has
B = prod(leading dims) sequences of T tokens; X [M, K] is M sequences of one token.
"""
from __future__ import annotations

import math

import numpy as np

from ..schema import get as _schema
from . import gating_quant as _q

HDR = 8

_SCHEMA = _schema("EventGatedMatMul")


def state_size(K: int, N: int, block: int) -> int:
    nb = -(-K // block)
    return HDR + K + N + 2 * nb


def stateful(a: dict) -> bool:
    return bool(a.get("event", 0)) or int(a.get("kwta_duty", 1)) > 1


def _blocks(K, bs):
    return [(s, min(s + bs, K)) for s in range(0, K, bs)]


def _gate(x, norms, a, blocks, st_mask):
    """(gated input x̃ [K] float64, block mask [nb] bool, candidate mask [nb] bool)."""
    nb = len(blocks)
    cand = np.ones(nb, bool)
    if a["pack"] != "none":
        act = np.array([np.any(np.abs(x[s:e]) > a["pack_eps"]) for s, e in blocks])
        if act.mean() <= a["pack_rho"]:
            cand = act
    keep = cand.copy()
    if a["kwta"]:
        if st_mask is not None:
            keep = st_mask & cand
        else:
            sc = np.abs(x) * norms if a["kwta_score"] == "xw" else np.abs(x)
            s = np.array([math.sqrt(float(np.sum(sc[b0:b1] ** 2))) for b0, b1 in blocks])
            sel = a["kwta_select"]
            if sel == "threshold":
                lens = np.array([e - s0 for s0, e in blocks], np.float64)
                keep = cand & (s / np.sqrt(lens) > a["kwta_threshold"])
            elif sel == "topk":
                idx = [i for i in np.lexsort((np.arange(nb), -s)) if cand[i]][: int(a["kwta_k"])]
                keep = np.zeros(nb, bool)
                keep[idx] = True
            elif sel == "mass":
                idx = [i for i in np.lexsort((np.arange(nb), -s)) if cand[i]]
                keep = np.zeros(nb, bool)
                if idx:
                    smax = s[idx[0]]
                    t = max(a["kwta_temp"], 1e-6) * (smax if smax > 0 else 1.0)
                    z = np.exp((s[idx] - smax) / t)
                    p = np.cumsum(z) / z.sum()
                    n = int(np.searchsorted(p, a["kwta_mass"] - 1e-12)) + 1
                    keep[idx[:n]] = True
            else:
                raise ValueError(f"kwta_select {sel!r}")
    m = np.zeros(x.shape[0])
    for i, (s0, e) in enumerate(blocks):
        if keep[i]:
            m[s0:e] = 1.0
    xt = x * m
    if a["kwta_renorm"] and keep.any():
        xt = xt * (cand.sum() / keep.sum())
    return xt, keep, cand


def weights(w, wq, scales, zero_points, a: dict) -> np.ndarray:
    """The float32 [K, N] weight the op multiplies: W (f32) or Ŵ = dequantize(...) (int8 | int4,
    shape from the `weight_shape` attribute [K, N]: int4 rows are padded to 16 outputs)."""
    fmt = a["weight_format"]
    if fmt == "f32":
        if w is None:
            raise ValueError("EventGatedMatMul: weight_format f32 needs W")
        return np.asarray(w, np.float32)
    if wq is None or scales is None:
        raise ValueError(f"EventGatedMatMul: weight_format {fmt} needs Wq and scales")
    K, N = (int(v) for v in a["weight_shape"])
    if fmt in _q.KFORMATS:
        return _q.dequantize_k(wq, scales, int(a["weight_group"]), K, N)
    W = _q.dequantize(wq, scales, fmt, int(a["weight_group"]), N, zero_points)
    if W.shape != (K, N):
        raise ValueError(f"EventGatedMatMul: weight_shape {[K, N]} does not match Wq/scales")
    return W


def event_gated_matmul(x, w, state=None, wq=None, scales=None, zero_points=None, **attrs):
    """Returns (Y [..., N] float32, state_out [B, S] float32 or None when the node is stateless).
    Quantized formats: w is None, the weight is wq, scales, [zero_points] and attribute weight_shape."""
    a = _SCHEMA.resolve(attrs)
    for k in ("pack", "kwta_select", "kwta_score", "weight_format"):
        if isinstance(a[k], bytes):
            a[k] = a[k].decode()
    x = np.asarray(x, np.float32)
    W = weights(w, wq, scales, zero_points, a)
    K, N = W.shape
    if x.shape[-1] != K:
        raise ValueError(f"EventGatedMatMul: X last dim {x.shape[-1]} != K {K}")
    Wd = W.astype(np.float64)
    norms = np.sqrt(np.sum(Wd * Wd, axis=1))
    # products of one vector: int8 activations with int4k (gating_quant.py), else v · W
    if a["weight_format"] in _q.KFORMATS:
        vec = lambda v: _q.qmatvec_k(v, wq, scales, int(a["weight_group"]), K, N)  # noqa: E731
    else:
        vec = lambda v: v @ Wd  # noqa: E731
    bs = int(a["block"])
    blocks = _blocks(K, bs)
    nb = len(blocks)
    S = state_size(K, N, bs)
    if x.ndim >= 3:
        T = x.shape[-2]
        B = int(np.prod(x.shape[:-2]))
    else:
        T = 1
        B = int(np.prod(x.shape[:-1]))
    X = x.reshape(B, T, K).astype(np.float64)
    Y = np.zeros((B, T, N), np.float64)
    sf = stateful(a)
    st_in = None
    if state is not None and np.asarray(state).size:
        st_in = np.asarray(state, np.float32).reshape(B, S).astype(np.float64)
    st_out = np.zeros((B, S), np.float64)
    nsl = lambda: (slice(HDR, HDR + K), slice(HDR + K, HDR + K + N), slice(HDR + K + N, HDR + K + N + nb),
                   slice(HDR + K + N + nb, S))
    sx, sy, sa, sm = nsl()
    # rows left to the batched product (not event rows of running sequences): with int4k a call
    # with one such row computes it as a one-vector product, several take f32 activations
    init = [sf and st_in is not None and st_in[b, 0] == 1.0 for b in range(B)]
    npending = sum(T for b in range(B) if not (a["event"] and init[b]))
    for b in range(B):
        st = st_in[b].copy() if st_in is not None else np.zeros(S)
        was_init = sf and st[0] == 1.0
        for t in range(T):
            xr = X[b, t]
            step = 0
            if was_init:
                st[1] += 1
                step = int(st[1])
            reuse = None
            if a["kwta"] and was_init and int(a["kwta_duty"]) > 1 and step % int(a["kwta_duty"]) != 0:
                reuse = st[sm] > 0.5
            if not was_init and a["dense_prefill"] and T > 1:
                xt, keep = xr.copy(), np.ones(nb, bool)
                cand = keep
            else:
                xt, keep, cand = _gate(xr, norms, a, blocks, reuse)
            if sf and reuse is None:
                st[sm] = keep.astype(np.float64)
            if a["event"] and was_init and st[2] == 0.0:
                y = _event_row(xt, Wd, norms, a, blocks, cand, st, sx, sy, sa, step, vec)
            else:
                y = vec(xt) if (a["event"] and was_init) or npending == 1 else xt @ Wd
                if sf and not was_init and t == T - 1:  # a new sequence: state from its last token
                    st[0], st[1] = 1.0, 0.0
                    st[sx] = xt
                    st[sy] = y
                    st[sa] = 0.0
            Y[b, t] = y
        st_out[b] = st
    Yo = Y.reshape(*x.shape[:-1], N).astype(np.float32)
    return Yo, (st_out.astype(np.float32) if sf else None)


def _event_row(xt, Wd, norms, a, blocks, cand, st, sx, sy, sa, step, vec):
    nb = len(blocks)
    xref, ycache, age = st[sx].copy(), st[sy].copy(), st[sa].copy()
    d = xt - xref
    dn = d * norms
    e = np.array([math.sqrt(float(np.sum(dn[s:t] ** 2))) for s, t in blocks])
    xn = xt * norms
    thr = a["event_theta"] * math.sqrt(float(np.sum(xn * xn))) / math.sqrt(nb)
    wst = a["event_beta"] * np.exp(-a["event_lambda"] * age)
    prio = e / np.maximum(wst, 1e-30)
    agemax = int(a["event_age_max"])
    forced = (age >= agemax) if agemax > 0 else np.zeros(nb, bool)
    elig = cand & (e > thr) & ~forced
    order = [i for i in np.lexsort((np.arange(nb), -prio)) if elig[i]]
    limit = max(int(math.ceil(float(np.float32(a["event_topk"])) * nb - 1e-6)), 0)
    total = float(sum(e[i] for i in order))
    taken = [i for i in range(nb) if forced[i]]
    acc = 0.0
    for i in order:
        if len(taken) >= limit and limit < nb:
            break
        if a["event_quorum"] < 1.0 and total > 0 and acc >= a["event_quorum"] * total:
            break
        taken.append(i)
        acc += e[i]
    tk = np.zeros(nb, bool)
    tk[taken] = True
    dt = np.zeros_like(d)  # the deltas of every taken block: one product
    for i, (s, t) in enumerate(blocks):
        if tk[i]:
            dt[s:t] = d[s:t]
    if tk.any():
        ycache += vec(dt)
    for i, (s, t) in enumerate(blocks):
        if tk[i]:
            xref[s:t] = xt[s:t]
            age[i] = 0.0
        else:
            age[i] += 1.0
    y = ycache
    ge = int(a["event_gap_every"])
    if ge > 0 and (step % ge == 0 or (step < ge and step & (step - 1) == 0)):  # 1, 2, 4, … then every ge
        yf = vec(xt)
        nf = float(np.linalg.norm(yf))
        gap = float(np.linalg.norm(y - yf)) / nf if nf > 0 else float(np.linalg.norm(y - yf))
        st[3] = gap
        if gap > a["event_gap_tol"]:
            st[2] = 1.0
        y = yf
        xref, ycache, age = xt.copy(), yf.copy(), np.zeros(nb)
    st[sx], st[sy], st[sa] = xref, ycache, age
    return y


def op(x, w=None, state=None, wq=None, scales=None, zero_points=None, **attrs):
    """The op as ONNX Runtime calls it (custom_ops.schema: EventGatedMatMul.reference): the state
    output is an empty [B, 0] tensor for a stateless node."""
    y, st = event_gated_matmul(x, w, state, wq, scales, zero_points, **attrs)
    if st is None:
        b = int(np.prod(x.shape[:-2])) if x.ndim >= 3 else int(np.prod(x.shape[:-1]))
        st = np.zeros((b, 0), np.float32)
    return y, st
