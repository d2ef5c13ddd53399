"""Numpy reference of PackedAttention: the normative definition of the op (see DEVELOPERS.md).

    Y, present_bits = PackedAttention(Q, K, V, [mask], [past_bits])

Q [B, Hq, M, D]; K [B, Hkv, T, D] (k_layout "bhtd") or [B, Hkv, D, T] ("bhdt"); V [B, Hkv, T, Dv];
query head h reads KV head h // (Hq / Hkv) (GQA repeat); mask additive float, broadcastable to
[B, Hq, M, T] (rank 4, each dim 1 or full); past_bits int32 [B, Hkv, P, W] (P = T - new tokens).

Key bits (one row of W int32 words per key, W = planes * ceil(D / 32) + 1, pq: ceil(D / 32)):
  sign    plane 0 bit d = k_d > 0                                  (planes = 1)
  ternary plane 0 bit d = k_d > eps, plane 1 bit d = k_d < -eps      (planes = 2)
  binary  plane 0 bit d = |k_d| > eps                               (planes = 1)
  pq      (cache mode only) product-quantization codes: D/4 subspaces, subspace s the dims
          pq_dims[4s .. 4s+3] (pq_dims empty: 4s .. 4s+3), its code the nearest of the KV head's 16
          centroids pq_book[hk, s, c, 0:4] ([Hkv, D/4, 16, 4] flattened): squared distance in float32,
          the four terms summed in order, NaN counted as +inf, ties to the lower c (none finite: 0);
          code s is bits 4 (s % 8) .. 4 (s % 8) + 3 of word s // 8 (planes = 1, the same words as sign)
  (eps: the attribute, or eps_heads[kv head] when given)
  bit d of plane p is bit d % 32 of word p * ceil(D/32) + d // 32; the last word holds gamma
  (float32 bits): sign → mean |k|, ternary/binary → mean |k_d| over the set bits (eps if none).
  pq rows have no gamma word (its score has no key scale): n_words(D, "pq") = ceil(D/32), so a
  cache-mode pq row of D = 64 is 16 bytes with its K / V scales, four to a cache line.

Approximate score of a query row q (only used to pick candidates, never as the output), after
q ← q * kscale[kv head] when the per-channel key scale kscale [Hkv * D] is given (calibrated mean
|k_d|: sign bits lose the channel magnitudes, RoPE'd keys have a few large channels):
  a = max|q|, L = 2^(qbits-1) - 1, qi = rint(q * (L / a)) (integers in [-L, L]);
  sign: Σ qi_d (2 bit_d - 1); ternary: Σ qi_d (pos_d - neg_d); binary: Σ qi_d bit_d
  (evaluated with popcounts over the bit planes of |qi|), times gamma_k * ((a / L) * scale), plus mask.
  pq (kscale does not apply): the table t[s, c] = Σ_j q[dims[4s+j]] · pq_book[hk, s, c, j] (float32,
  j in order), a = max|t|, ti = rint(t · (L / a)); score Σ_s ti[s, code_s] times (a / L) * scale, plus
  mask (all scores 0, plus mask, when a = 0 or some t is not finite).
With approx_prefill = 1, rows of M > 1 also use candidates, each as a decode step would: its
context is the keys up to its last unmasked one (T_m), and every rule below uses T_m for T.
select = "exact" replaces the approximate score by the exact one (oracle: measures what the budget
alone costs; no speed benefit). Candidates: the first `sinks` keys, the last `window` keys and the best of the rest by that score
(ties: lower index first), `C = max(min_candidates, ceil(budget * T))` keys in total. Exact
attention (all keys) when M > 1 (unless approx_prefill), T <= min_context, budget <= 0 or >= 1, C >= T, or (ternary /
binary) the key-bit density is above rho. On the candidate set S: logits = scale * q·k + mask
(+ mix * (approx - exact logits) when mix > 0), softmax over S, Y = Σ p v; a row whose logits
are all -inf gives Y = 0 (the dense graph's IsNaN → 0).

Cache mode (kv_quant = "fp32" | "int8" | "int4"; "none" is the mode above): K [B, Hkv, S, D] and V [B, Hkv, S, Dv] are the
NEW tokens only; the cache is graph state (int32 rows, like the key bits):
  past_kv int32 [B, Hkv, P, R] → present_kv [B, Hkv, Tc, R], one row per key (kv_row_words):
    K codes (D bytes int8, or D/2 bytes of int4 pairs: element 2i low nibble, 2i+1 high, two's
    complement), then V codes; scale = max|x| / L (L = 127 | 7), code = clip(rint(x * (L /
    max|x|)), -L, L) (all zero when max|x| = 0); x̂ = code * scale. fp32: the "codes" are the
    float32 values and both scales 1 (exact; GroupQueryAttention's cache). The row's K scale and
    V scale (float32) are the last two words of its key-bits row: past_bits / present_bits rows
    have cache_bits_words(D, mode) = W + 2 words in this mode (pack_cache), so a row of D = Dv =
    64 int8 codes is 128 bytes (two cache lines, where codes and scales together took three).
    past_bits is required whenever past_kv has rows.
  seqlens_k int32 [B] (optional, GroupQueryAttention's: total length − 1 per sequence; default
    P + S for all): total_b = seqlens_k[b] + 1, the new rows go to positions
    pos0_b = max(0, total_b − S) .. total_b − 1 (rows at or beyond total_b are padding: not stored,
    Y = 0). Tc = max(P, max_b total_b): present = past (zero-padded to Tc) with the new rows
    written, so a caller may bind past and present to one buffer of capacity Tc (the kernel then
    writes only the new rows). past_bits/present_bits follow the same rows.
  Query row m of sequence b sits at pos = pos0_b + m and attends keys [lo, pos] (causal), lo =
  max(0, pos − local_window + 1) when local_window > 0: the last local_window keys, as ONNX
  Runtime's GroupQueryAttention local_window_size (checked against ORT 1.32).
  Logits scale · q·k̂ (softcap > 0: softcap · tanh(logits / softcap)) + mask (mask broadcast to
  [B, Hq, M, Tc]); softmax · V̂ over the context or the candidates. int8 / int4: q·k̂ is an integer
  dot (query_int16): per query head a = max|q|, qi = clip(rint(q · (QK_LEVELS / a)), ±QK_LEVELS)
  (QK_LEVELS = 32767), qs = a / QK_LEVELS (a = 0: qi = 0, qs = 0; a not finite: qs = NaN), and
  scale · q·k̂ := float32(Σ_d qi_d · code_d) · (qs · (kscale · scale)) (the sum exact); fp32 keeps
  the float dot (q·k) · scale. Candidates are chosen once per
  KV-head group (all query heads of a KV head read the same keys): group score = the approximate
  score above of the group query q_g = Σ_h q_h (float32, heads in order), plus the mask row of
  the group's first head; the sinks are the first `sinks` keys of the context, the window its
  last `window` keys; decode rows (M == 1, or approx_prefill) use them under the same rules as
  above with the context length pos − lo + 1 for T. `mix` must be 0 in this mode. cand_block = B > 1
  (this mode only) chooses the best of the rest in blocks: the rest (between sinks and window) cut
  into blocks of B consecutive keys from its start (the last may be shorter), a block scored by
  its best key's group score, the top ceil(n_top / B) blocks taken whole (ties: lower index
  first; n_top = C − sinks − window keys): the rows read run in order, at most B − 1 keys over C.

Sparse prefill (cache mode, 0 < prefill_budget < 1, M > 1, no mask, no local_window, approx_prefill 0):
the call's prompt rows are cut into tiles by position (pos // prefill_block); the keys into blocks
of prefill_block from key 0. A tile whose last row pb has pb + 1 <= prefill_min_context is exact.
Else, with pa its first row, nb = pb // block + 1 context blocks: sink blocks j < ceil(sinks /
block), local blocks j >= max(0, pa − prefill_window) // block (up to the tile's own), and the
middle blocks between them, nmid of them (the last prefill_tail rows of the sequence's rows in the call
are left out of the tiles: they are exact, and a tile's first row pa is its first row before them); keep = ceil(prefill_budget · nmid) middle blocks are kept
(float64 product; exact when that is all of them): the budget is the share of the middle the tile
reads, the sinks and the local window always read. A middle block j is scored from boxes of 16
consecutive keys (BOUND_KEYS; the whole block when its size is not a multiple of 16): per box the keys'
per-dimension max and min as decoded (k̂), centre c = (max + min) · 0.5, radius r = (max − min) · 0.5,
and each query row q of each head of the group bounds its logits by u(box) = (q·c + |q|·r) · scale
(Quest's bound: no key of the box has a larger q·k̂; NaN: −inf), u(j) the largest over its boxes;
per query row the bounds as a softmax's weights
exp(u(j) − max_j u) (float64; NaN: weight 0; a row without a finite max adds nothing), summed per block
over the tile's rows and heads — the attention mass the block could hold for the tile; the `keep`
heaviest blocks (ties: lower index). Each row of the tile attends, exactly as above, to the keys of the
sink, chosen and local blocks up to its own position (causal).

GroupQueryAttention's layout (cache mode with num_heads = Hq > 0, kv_num_heads = Hkv): the node
takes GQA's own inputs, so no Split / RotaryEmbedding / Reshape / Transpose nodes surround it:
  Q [B, S, Hq·D], K [B, S, Hkv·D], V [B, S, Hkv·Dv] — or K and V absent and Q the packed
  [B, S, (Hq + 2 Hkv)·D] (query heads, then key heads, then value heads; Dv = D); Y [B, S, Hq·Dv].
  Optional inputs 7, 8: cos_cache / sin_cache [max_pos, r/2] (r ≤ D): the first r dims of every Q
  and K head of row m of sequence b are rotated at pos = pos0_b + m (GQA's do_rotary), pairs
  (i, i + r/2), or (2i, 2i + 1) with rotary_interleaved = 1: x1' = x1 cos − x2 sin,
  x2' = x2 cos + x1 sin (padding rows, pos ≥ total_b, are not rotated). Then as above on
  [B, H, S, D].
  Key smoothing, ksmooth [Hkv·D] (floats > 0, finite; empty: none): before the rotation each query
  head of KV head hk is multiplied by s = ksmooth[hk] and each new key by float32(1 / s), so the cache
  rows hold K / s and every logit (Q·s)·(K/s) equals Q·K in real arithmetic, while the per-row
  int8 / int4 scale of K / s no longer spends its levels on a few outlier channels (Qwen2's keys).
  s must be equal on both dims of every rotary pair (else it would not commute with the rotation).
"""
from __future__ import annotations

import math

import numpy as np

from ..schema import get as _schema

MODES = {"sign": 1, "ternary": 2, "binary": 1, "pq": 1}
PQ_WIDTH, PQ_CODES = 4, 16
_SCHEMA = _schema("PackedAttention")


def n_words(D: int, mode: str = "sign") -> int:
    """int32 words per packed key: the bit planes (pq: the codes), then gamma (not in pq mode)."""
    return MODES[mode] * ((D + 31) // 32) + (mode != "pq")


def pq_params(book, dims, Hkv: int, D: int) -> tuple[np.ndarray, np.ndarray]:
    """pq_book / pq_dims attributes → (book [Hkv, D/4, 16, 4] float32, dims [D] int64), checked."""
    if D % PQ_WIDTH:
        raise ValueError(f"mode pq needs a head dim divisible by {PQ_WIDTH}, got {D}")
    book = np.asarray(book if book is not None else (), np.float32).ravel()
    if book.size != Hkv * D * PQ_CODES:
        raise ValueError(f"pq_book has {book.size} values, expected KV heads x head dim x 16 = {Hkv * D * PQ_CODES}")
    dims = np.arange(D) if dims is None or not len(dims) else np.asarray(dims, np.int64)
    if sorted(dims.tolist()) != list(range(D)):
        raise ValueError(f"pq_dims must be a permutation of 0 .. {D - 1}")
    return book.reshape(Hkv, D // PQ_WIDTH, PQ_CODES, PQ_WIDTH), dims


def pq_encode(K: np.ndarray, book: np.ndarray, dims: np.ndarray) -> np.ndarray:
    """K [..., T, D] of one KV head, book [D/4, 16, 4] → codes [..., T, D/4] (module docstring)."""
    K = np.asarray(K, np.float32)
    x = K[..., dims].reshape(K.shape[:-1] + (K.shape[-1] // PQ_WIDTH, 1, PQ_WIDTH))   # [..., S, 1, 4]
    with np.errstate(over="ignore", invalid="ignore"):             # overflow: +inf distances
        e = x - book                                               # [..., S, 16, 4] float32
        sq = e * e
        d2 = sq[..., 0]
        for j in range(1, PQ_WIDTH):
            d2 = d2 + sq[..., j]
    d2 = np.where(np.isnan(d2), np.float32(np.inf), d2)
    return d2.argmin(-1)


def pq_words(codes: np.ndarray, D: int) -> np.ndarray:
    """codes [..., D/4] → plane words [..., ceil(D / 32)] uint32 (code s at bits 4 (s % 8) of word s // 8)."""
    nw = (D + 31) // 32
    S = codes.shape[-1]
    c = np.zeros(codes.shape[:-1] + (nw * 8,), np.uint64)
    c[..., :S] = codes
    c = c.reshape(codes.shape[:-1] + (nw, 8))
    return (c << (4 * np.arange(8, dtype=np.uint64))).sum(-1).astype(np.uint32)


def pq_unpack(bits: np.ndarray, D: int) -> np.ndarray:
    """key-bits rows [..., W] → codes [..., D/4] (int64)."""
    nw = (D + 31) // 32
    w = np.ascontiguousarray(bits[..., :nw]).view(np.uint32).astype(np.uint64)
    c = (w[..., :, None] >> (4 * np.arange(8, dtype=np.uint64))) & 15
    return c.reshape(c.shape[:-2] + (-1,))[..., :D // PQ_WIDTH].astype(np.int64)


def pq_tables(q: np.ndarray, book: np.ndarray, dims: np.ndarray, qbits: int):
    """The integer tables of the pq score of q [D] (one KV head's book [D/4, 16, 4]): (ti int64
    [D/4, 16], a / L float32), or None when a = 0 or some t is not finite (module docstring)."""
    x = np.asarray(q, np.float32)[dims].reshape(-1, 1, PQ_WIDTH)
    pr = x * book                                                  # [S, 16, 4]
    t = pr[..., 0]
    for j in range(1, PQ_WIDTH):
        t = t + pr[..., j]
    if not np.isfinite(t).all():
        return None
    a = np.float32(np.abs(t).max())
    if not a > 0:
        return None
    L = np.float32(2 ** (qbits - 1) - 1)
    return np.rint(t * (L / a)).astype(np.int64), np.float32(a / L)


def pack_keys(K: np.ndarray, mode: str = "sign", eps: float = 0.0, eps_heads=None, pq=None) -> np.ndarray:
    """K [..., T, D] float32 → bits [..., T, W] int32 (eps_heads: per head, K [B, H, T, D]; pq: mode
    pq's (book [H, D/4, 16, 4], dims), K [B, H, T, D])."""
    K = np.asarray(K, dtype=np.float32)
    if mode == "pq":
        if pq is None:
            raise ValueError("mode pq needs its codebook (pq_book)")
        book, dims = pq
        codes = np.stack([pq_encode(K[:, h], book[h], dims) for h in range(K.shape[1])], 1)
        return np.ascontiguousarray(pq_words(codes, K.shape[-1])).view(np.int32)
    if eps_heads is not None and len(eps_heads) and mode != "sign":
        return np.concatenate([pack_keys(K[:, h:h + 1], mode, float(e)) for h, e in enumerate(eps_heads)], 1)
    D = K.shape[-1]
    nw = (D + 31) // 32
    if mode == "sign":
        planes = [K > 0]
        gamma = np.abs(K).astype(np.float64).sum(-1) / D
    else:
        eps = np.float32(eps)
        planes = [K > eps, K < -eps] if mode == "ternary" else [np.abs(K) > eps]
        act = np.abs(K) > eps
        cnt = act.sum(-1)
        s = np.where(act, np.abs(K), 0).astype(np.float64).sum(-1)
        gamma = np.where(cnt > 0, s / np.maximum(cnt, 1), np.float64(eps))
    words = []
    pad = nw * 32 - D
    for pl in planes:
        b = np.concatenate([pl, np.zeros(pl.shape[:-1] + (pad,), bool)], -1) if pad else pl
        b = b.reshape(b.shape[:-1] + (nw, 32)).astype(np.uint64)
        w = (b << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)
        words.append(w)
    g = gamma.astype(np.float32).view(np.uint32)[..., None]
    return np.concatenate(words + [g], -1).view(np.int32)


def unpack_gamma(bits: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(bits[..., -1]).view(np.float32)


def density(bits: np.ndarray, D: int, mode: str) -> float:
    """Fraction of set bits per component (ternary: both planes; sign: fraction of positive components)."""
    nw = (D + 31) // 32
    w = np.ascontiguousarray(bits[..., :MODES[mode] * nw]).view(np.uint32)
    if w.size == 0:
        return 0.0
    cnt = np.unpackbits(w.view(np.uint8)).sum()
    return float(cnt) / float(w.shape[:-1] and np.prod(w.shape[:-1]) * D or 1)


def _bitvec(bits_row_words: np.ndarray, D: int) -> np.ndarray:
    """words [..., nw] uint32 → [..., D] bool."""
    w = bits_row_words.view(np.uint32).astype(np.uint64)
    b = ((w[..., :, None] >> np.arange(32, dtype=np.uint64)) & 1).astype(bool)
    return b.reshape(b.shape[:-2] + (-1,))[..., :D]


def approx_int(q: np.ndarray, bits: np.ndarray, D: int, mode: str, qbits: int) -> tuple[np.ndarray, np.float32]:
    """Integer popcount score of q [D] against keys bits [T, W] and the float coefficient a/L."""
    q = q.astype(np.float32)
    a = np.float32(np.max(np.abs(q))) if q.size else np.float32(0)
    L = np.float32(2 ** (qbits - 1) - 1)
    if not a > 0:
        return np.zeros(bits.shape[0], np.int64), np.float32(0)
    qi = np.rint(q * (L / a)).astype(np.int64)
    nw = (D + 31) // 32
    p0 = _bitvec(bits[:, :nw], D).astype(np.int64)
    if mode == "sign":
        s = (qi[None, :] * (2 * p0 - 1)).sum(-1)
    elif mode == "ternary":
        p1 = _bitvec(bits[:, nw:2 * nw], D).astype(np.int64)
        s = (qi[None, :] * (p0 - p1)).sum(-1)
    else:
        s = (qi[None, :] * p0).sum(-1)
    return s, np.float32(a / L)


def _mask_row(mask, b, h, m, T):
    if mask is None:
        return np.zeros(T, np.float32)
    mb = mask[b if mask.shape[0] > 1 else 0, h if mask.shape[1] > 1 else 0, m if mask.shape[2] > 1 else 0]
    return np.broadcast_to(mb, (T,)).astype(np.float32)


def select_candidates(T, approx_plus_mask, budget, min_candidates, sinks, window, cand_block=1):
    C = max(int(min_candidates), int(math.ceil(budget * T)))
    if C >= T:
        return np.arange(T)
    fixed = np.zeros(T, bool)
    fixed[:min(sinks, T)] = True
    if window > 0:
        fixed[max(0, T - window):] = True
    n_top = max(0, C - int(fixed.sum()))
    rest = np.flatnonzero(~fixed)
    if cand_block > 1 and n_top > 0:
        # blocks of cand_block keys from the start of the rest (the last may be shorter), scored by
        # their best key; the top ceil(n_top / cand_block) blocks whole (ties: lower index first)
        blocks = [rest[j:j + cand_block] for j in range(0, rest.size, cand_block)]
        bs = np.array([approx_plus_mask[x].max() for x in blocks], np.float32)
        kb = min(len(blocks), -(-n_top // cand_block))
        order = np.concatenate([blocks[j] for j in np.argsort(-bs, kind="stable")[:kb]])
    else:
        order = rest[np.argsort(-approx_plus_mask[rest], kind="stable")][:n_top]
    return np.sort(np.concatenate([np.flatnonzero(fixed), order]))


def packed_attention(Q, K, V, mask=None, past_bits=None, **attrs):
    """Returns (Y [B, Hq, M, Dv] float32, present_bits [B, Hkv, T, W] int32). `attrs`: the node's
    attributes; omitted ones take the op schema's defaults (custom_ops.schema)."""
    a = _SCHEMA.resolve(attrs)
    scale, mode, eps, budget, rho, mix = a["scale"], a["mode"], a["eps"], a["budget"], a["rho"], a["mix"]
    min_candidates, sinks, window, min_context = a["min_candidates"], a["sinks"], a["window"], a["min_context"]
    qbits, k_layout, approx_prefill, select = a["qbits"], a["k_layout"], a["approx_prefill"], a["select"]
    eps_heads, kscale = a.get("eps_heads"), a.get("kscale")
    if a["cand_block"] != 1:
        raise ValueError(f"cand_block {a['cand_block']} needs kv_quant fp32 | int8 | int4 (1 without)")
    if mode == "pq":
        raise ValueError("mode pq needs kv_quant fp32 | int8 | int4")
    Q = np.asarray(Q, np.float32)
    K = np.asarray(K, np.float32)
    V = np.asarray(V, np.float32)
    if k_layout == "bhdt":
        K = np.swapaxes(K, -1, -2)
    B, Hq, M, D = Q.shape
    _, Hkv, T, _ = K.shape
    assert Hq % Hkv == 0 and K.shape[-1] == D and V.shape[2] == T
    rep = Hq // Hkv
    scale = np.float32(scale)
    mask = None if mask is None or np.asarray(mask).size == 0 else np.asarray(mask, np.float32)
    if past_bits is not None and np.asarray(past_bits).size == 0 and np.asarray(past_bits).ndim != 4:
        past_bits = None
    if past_bits is not None:
        past_bits = np.asarray(past_bits, np.int32)
        P = past_bits.shape[2]
        bits = np.concatenate([past_bits, pack_keys(K[:, :, P:], mode, eps, eps_heads)], 2)
    else:
        bits = pack_keys(K, mode, eps, eps_heads)
    Dv = V.shape[-1]
    Y = np.zeros((B, Hq, M, Dv), np.float32)
    dens = density(bits, D, mode)
    budget = float(np.float32(budget))
    global_exact = not (0 < budget < 1) or (mode in ("ternary", "binary") and dens > rho)
    for b in range(B):
        for h in range(Hq):
            hk = h // rep
            Kh, Vh = K[b, hk], V[b, hk]
            for m in range(M):
                q = Q[b, h, m]
                mrow = _mask_row(mask, b, h, m, T)
                Tr = T
                if M > 1 and approx_prefill and mask is not None:
                    fin = np.flatnonzero(mrow > -np.inf)
                    Tr = int(fin[-1]) + 1 if fin.size else 0
                exact = (global_exact or (M > 1 and not approx_prefill) or Tr <= min_context
                         or max(min_candidates, math.ceil(budget * Tr)) >= Tr)
                need_approx = not exact or mix > 0
                if need_approx and select == "exact":  # oracle selection (measurement only)
                    approx = (Kh @ q) * scale
                elif need_approx:
                    qa = q if kscale is None or not len(kscale) else \
                        q * np.asarray(kscale, np.float32).reshape(Hkv, D)[hk]
                    s, coef = approx_int(qa, bits[b, hk], D, mode, qbits)
                    approx = s.astype(np.float32) * unpack_gamma(bits[b, hk]) * np.float32(coef * scale)
                idx = (np.arange(Tr) if exact else
                       select_candidates(Tr, (approx + mrow)[:Tr], budget, min_candidates, sinks, window))
                logits = (Kh[idx].astype(np.float32) @ q) * scale
                if mix > 0:
                    logits = logits + np.float32(mix) * (approx[idx] - logits)
                logits = logits + mrow[idx]
                mx = logits.max() if idx.size else -np.inf
                if not np.isfinite(mx):
                    continue
                e = np.exp(logits - mx)
                Y[b, h, m] = (e / e.sum()) @ Vh[idx]
    return Y, bits


KV_LEVELS = {"int8": 127, "int4": 7}


_CODE_BYTES = {"fp32": lambda n: 4 * n, "int8": lambda n: n, "int4": lambda n: n // 2}


def kv_row_words(D: int, Dv: int, kv_quant: str = "int8") -> int:
    """int32 words per cached key row: K codes, V codes (their scales are in the key-bits row)."""
    cb = _CODE_BYTES[kv_quant]
    return cb(D) // 4 + cb(Dv) // 4


def cache_bits_words(D: int, mode: str = "sign") -> int:
    """int32 words per key-bits row in cache mode: the key bits (n_words), K scale, V scale."""
    return n_words(D, mode) + 2


def quantize_rows(x: np.ndarray, kv_quant: str) -> tuple[np.ndarray, np.ndarray]:
    """x [..., n] float32 → (codes [..., n] int8, scale [...] float32), per row."""
    x = np.asarray(x, np.float32)
    if kv_quant == "fp32":
        return x, np.ones(x.shape[:-1], np.float32)
    L = np.float32(KV_LEVELS[kv_quant])
    a = np.abs(x).max(-1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.where(a > 0, L / a, np.float32(0)).astype(np.float32)   # a denormal: L / a may be inf
        q = np.clip(np.rint(x * inv[..., None]), -L, L)
    codes = np.where(np.isnan(q), np.float32(0), q).astype(np.int8)       # NaN (0 * inf, NaN x): code 0
    return codes, (a / L).astype(np.float32)


def _codes_bytes(codes: np.ndarray, kv_quant: str) -> np.ndarray:
    if kv_quant == "fp32":
        return np.ascontiguousarray(codes, np.float32).view(np.uint8)
    if kv_quant == "int8":
        return codes.view(np.uint8)
    c = codes.astype(np.uint8) & 0x0F
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def _bytes_codes(b: np.ndarray, n: int, kv_quant: str) -> np.ndarray:
    if kv_quant == "fp32":
        return np.ascontiguousarray(b).view(np.float32)
    if kv_quant == "int8":
        return b.view(np.int8)
    lo = (b & 0x0F).astype(np.int8)
    hi = (b >> 4).astype(np.int8)
    lo = np.where(lo > 7, lo - 16, lo)
    hi = np.where(hi > 7, hi - 16, hi)
    out = np.empty(b.shape[:-1] + (n,), np.int8)
    out[..., 0::2], out[..., 1::2] = lo, hi
    return out


def pack_kv(K: np.ndarray, V: np.ndarray, kv_quant: str = "int8") -> tuple[np.ndarray, np.ndarray]:
    """K [..., T, D], V [..., T, Dv] float32 → (cache rows [..., T, R] int32, their scales [..., T, 2]
    int32: K scale, V scale as float32 bits, the key-bits row's last two words; module docstring)."""
    kc, ks = quantize_rows(K, kv_quant)
    vc, vs = quantize_rows(V, kv_quant)
    rows = np.ascontiguousarray(np.concatenate([_codes_bytes(kc, kv_quant), _codes_bytes(vc, kv_quant)], -1))
    return rows.view(np.int32), np.ascontiguousarray(np.stack([ks, vs], -1).astype(np.float32)).view(np.int32)


def pack_cache(K: np.ndarray, V: np.ndarray, kv_quant: str = "int8", mode: str = "sign", eps: float = 0.0,
               eps_heads=None, pq=None) -> tuple[np.ndarray, np.ndarray]:
    """K [B, H, T, D], V [B, H, T, Dv] float32 → the cache-mode state as the op stores it:
    (bits [B, H, T, cache_bits_words(D, mode)] int32, kv rows [B, H, T, kv_row_words] int32).
    pq: mode pq's (book, dims) (pq_params)."""
    rows, sc = pack_kv(K, V, kv_quant)
    return np.concatenate([pack_keys(K, mode, eps, eps_heads, pq), sc], -1), rows


def unpack_kv(rows: np.ndarray, bits: np.ndarray, D: int, Dv: int, kv_quant: str = "int8") -> tuple[np.ndarray, np.ndarray]:
    """Cache rows [..., T, R] int32 and their key-bits rows [..., T, W + 2] (scales in the last two
    words) → (K̂ [..., T, D], V̂ [..., T, Dv]) float32 (dequantized)."""
    b = np.ascontiguousarray(rows).view(np.uint8)
    kb, vb = _CODE_BYTES[kv_quant](D), _CODE_BYTES[kv_quant](Dv)
    kc = _bytes_codes(b[..., :kb], D, kv_quant)
    vc = _bytes_codes(b[..., kb:kb + vb], Dv, kv_quant)
    sc = np.ascontiguousarray(np.asarray(bits)[..., -2:]).view(np.float32)
    ks, vs = sc[..., 0:1], sc[..., 1:2]
    return (kc.astype(np.float32) * ks).astype(np.float32), (vc.astype(np.float32) * vs).astype(np.float32)


QK_LEVELS = 32767


def query_int16(q: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """One query head [D] float32 → (qi int64 [D], qs float32): the integer query of the int8 / int4
    cache's q·k (module docstring)."""
    q = np.asarray(q, np.float32)
    a = np.float32(np.abs(q).max()) if q.size else np.float32(0)
    if not np.isfinite(a):
        return np.zeros(q.shape, np.int64), np.float32(np.nan)
    if a == 0:
        return np.zeros(q.shape, np.int64), np.float32(0)
    L = np.float32(QK_LEVELS)
    qi = np.clip(np.rint(q * (L / a)), -QK_LEVELS, QK_LEVELS).astype(np.int64)
    return qi, np.float32(a / L)


def kv_key_codes(rows: np.ndarray, bits: np.ndarray, D: int, kv_quant: str) -> tuple[np.ndarray, np.ndarray]:
    """Cache rows [..., T, R] int32 (int8 / int4) and their key-bits rows → (K codes [..., T, D] int64,
    K scale [..., T] float32)."""
    b = np.ascontiguousarray(rows).view(np.uint8)
    kb = _CODE_BYTES[kv_quant](D)
    return (_bytes_codes(b[..., :kb], D, kv_quant).astype(np.int64),
            np.ascontiguousarray(np.asarray(bits)[..., -2]).view(np.float32))


BOUND_KEYS = 16   # sparse prefill: keys per box of a block's bound (one box when the block is not a multiple)


def prefill_keys(Qg, Kh, pos0: int, rows, budget: float, block: int, window: int, min_context: int, sinks: int,
                 scale, tail: int = 0) -> dict:
    """Sparse prefill (module docstring): the keys each prompt row of one KV head attends to.
    Qg [rep, M, D] the group's query heads, Kh [T, D] the head's keys as the kernel reads them (the
    cache rows decoded: codes · scale), rows the call's row indices m (positions pos0 + m). Returns
    {m: key indices (ascending)} for the rows of tiles that approximate; rows not in it are exact."""
    out = {}
    tiles: dict[int, list[int]] = {}
    rows = list(rows)
    for m in rows[:max(0, len(rows) - tail)]:   # the last `tail` rows are exact
        tiles.setdefault((pos0 + m) // block, []).append(m)
    for t, ms in tiles.items():
        pa, pb = pos0 + ms[0], pos0 + ms[-1]
        if pb + 1 <= min_context:
            continue
        nb = pb // block + 1
        ns = min(nb, -(-sinks // block)) if sinks > 0 else 0
        jl = max(0, pa - window) // block
        nmid = max(0, jl - ns)
        keep = math.ceil(float(budget) * nmid)
        if keep >= nmid:
            continue
        mids = np.arange(ns, jl)
        sbk = BOUND_KEYS if block % BOUND_KEYS == 0 else block
        Kb = Kh[ns * block:jl * block].reshape(nmid * (block // sbk), sbk, -1)      # the blocks' boxes
        kmax, kmin = Kb.max(1), Kb.min(1)
        kc = ((kmax + kmin) * np.float32(0.5)).astype(np.float32)
        kr = ((kmax - kmin) * np.float32(0.5)).astype(np.float32)
        q = Qg[:, ms].reshape(-1, Qg.shape[-1]).astype(np.float32)                  # [rep * rows, D]
        u = ((q @ kc.T + np.abs(q) @ kr.T) * np.float32(scale)).astype(np.float32)  # [rep * rows, boxes]
        u = np.where(np.isnan(u), np.float32(-np.inf), u)
        u = u.reshape(u.shape[0], nmid, block // sbk).max(2)                         # [rep * rows, nmid]
        top = u.max(1, keepdims=True)
        w = np.exp((u - top).astype(np.float64))                                     # 0 where u is -inf
        s_ = np.where(np.isfinite(top), w, 0.0).sum(0)                               # [nmid] mass per block
        chosen = np.sort(mids[np.argsort(-s_, kind="stable")[:keep]])
        blocks = np.concatenate([np.arange(ns), chosen, np.arange(jl, nb)]).astype(np.int64)
        keys = (blocks[:, None] * block + np.arange(block)[None, :]).ravel()
        for m in ms:
            out[m] = keys[keys <= pos0 + m]
    return out


def _continues(prompt_continues) -> bool:
    """Input prompt_continues: absent → the calling thread's custom_ops.prompt_continues block; else its
    one value ≠ 0."""
    if _absent(prompt_continues):
        import custom_ops

        return custom_ops.continuing()
    x = np.asarray(prompt_continues)
    if x.size != 1:
        raise ValueError(f"prompt_continues {list(x.shape)} must hold one value (nonzero: a later call continues "
                         "the prompt)")
    return bool(x.reshape(-1)[0] != 0)


def packed_attention_kv(Q, K, V, mask=None, past_bits=None, past_kv=None, seqlens_k=None, prompt_continues=None,
                        **attrs):
    """The quantized cache mode (module docstring). Returns (Y, present_bits, present_kv).
    ``prompt_continues`` nonzero: a later call holds the prompt's end, no row here is an exact tail row."""
    a = _SCHEMA.resolve(attrs)
    tail = 0 if _continues(prompt_continues) else a["prefill_tail"]
    kvq = a["kv_quant"]
    scale, mode, eps, budget, rho = np.float32(a["scale"]), a["mode"], a["eps"], float(np.float32(a["budget"])), a["rho"]
    min_candidates, sinks, window, min_context = a["min_candidates"], a["sinks"], a["window"], a["min_context"]
    qbits, approx_prefill, select = a["qbits"], a["approx_prefill"], a["select"]
    local_window, softcap = a["local_window"], np.float32(a["softcap"])
    eps_heads, kscale = a.get("eps_heads"), a.get("kscale")
    if a["mix"] > 0 or a["k_layout"] != "bhtd":
        raise ValueError("kv_quant: mix must be 0 and k_layout bhtd")
    if a["cand_block"] < 1:
        raise ValueError(f"cand_block must be >= 1, got {a['cand_block']}")
    Q, K, V = (np.asarray(x, np.float32) for x in (Q, K, V))
    B, Hq, M, D = Q.shape
    _, Hkv, S, _ = K.shape
    Dv = V.shape[-1]
    rep = Hq // Hkv
    R, W0 = kv_row_words(D, Dv, kvq), n_words(D, mode)
    W = W0 + 2  # the key bits, then the row's K / V scales
    P = 0 if past_kv is None or np.asarray(past_kv).size == 0 else np.asarray(past_kv).shape[2]
    total = (np.full(B, P + S, np.int64) if seqlens_k is None or np.asarray(seqlens_k).size == 0
             else np.asarray(seqlens_k, np.int64).reshape(B) + 1)
    Tc = int(max(P, total.max()))
    kv = np.zeros((B, Hkv, Tc, R), np.int32)
    bits = np.zeros((B, Hkv, Tc, W), np.int32)
    if P:
        if past_bits is None or not np.asarray(past_bits).size:
            raise ValueError(f"past_kv holds {P} rows but past_bits is missing: the rows' scales are in the key-bits rows")
        kv[:, :, :P] = past_kv
        bits[:, :, :P] = past_bits
    pq = None
    if mode == "pq":
        if a.get("kscale"):
            raise ValueError("kscale does not apply to mode pq")
        pq = pq_params(a.get("pq_book"), a.get("pq_dims"), Hkv, D)
    new_bits, new_kv = pack_cache(K, V, kvq, mode, eps, eps_heads, pq)
    pos0 = np.maximum(0, total - S)
    for b in range(B):
        n = int(min(S, total[b] - pos0[b]))
        kv[b, :, pos0[b]:pos0[b] + n] = new_kv[b, :, :n]
        bits[b, :, pos0[b]:pos0[b] + n] = new_bits[b, :, :n]
    Kd, Vd = unpack_kv(kv, bits, D, Dv, kvq)
    Kc, Ks = kv_key_codes(kv, bits, D, kvq) if kvq != "fp32" else (None, None)
    mask = None if mask is None or np.asarray(mask).size == 0 else np.asarray(mask, np.float32)
    # density: eps modes over every key in context (auto-disable), sign mode informational
    live = np.concatenate([bits[b, :, :total[b], :W0].reshape(-1, W0) for b in range(B)], 0)
    dens = density(live, D, mode)
    global_exact = not (0 < budget < 1) or (mode in ("ternary", "binary") and dens > rho)
    Y = np.zeros((B, Hq, M, Dv), np.float32)
    sparse = {}   # (b, hk, m) -> the prompt row's keys under sparse prefill (prefill_keys)
    pb_ = float(np.float32(a["prefill_budget"]))
    if M > 1 and not approx_prefill and mask is None and 0 < pb_ < 1 and local_window <= 0:
        for b in range(B):
            rows = [m for m in range(M) if pos0[b] + m < total[b]]
            for hk in range(Hkv):
                sparse.update({(b, hk, m): idx for m, idx in prefill_keys(
                    Q[b, hk * rep:(hk + 1) * rep], Kd[b, hk], int(pos0[b]), rows, pb_, a["prefill_block"],
                    a["prefill_window"], a["prefill_min_context"], sinks, scale, tail).items()})
    ks_all = None if kscale is None or not len(kscale) else np.asarray(kscale, np.float32).reshape(Hkv, D)
    for b in range(B):
        for hk in range(Hkv):
            Kh, Vh = Kd[b, hk], Vd[b, hk]
            for m in range(M):
                pos = int(pos0[b]) + m
                if pos >= total[b]:
                    continue
                lo = max(0, pos - local_window + 1) if local_window > 0 else 0
                ctx = np.arange(lo, pos + 1)
                n_ctx = ctx.size
                heads = range(hk * rep, (hk + 1) * rep)
                mrows = {h: _mask_row(mask, b, h, m, Tc) for h in heads}
                exact = (global_exact or (M > 1 and not approx_prefill) or n_ctx <= min_context
                         or max(min_candidates, math.ceil(budget * n_ctx)) >= n_ctx)
                if (b, hk, m) in sparse:
                    idx = sparse[(b, hk, m)]
                elif exact:
                    idx = ctx
                else:
                    qg = Q[b, hk * rep, m].copy()              # the group's query: sum of its heads' (in order)
                    for h in heads[1:]:
                        qg = (qg + Q[b, h, m]).astype(np.float32)
                    if select == "exact":
                        ap = (Kh[ctx] @ qg) * scale
                    elif mode == "pq":
                        tb = pq_tables(qg, pq[0][hk], pq[1], qbits)
                        if tb is None:
                            ap = np.zeros(n_ctx, np.float32)
                        else:
                            codes = pq_unpack(bits[b, hk, ctx, :W0], D)
                            s_ = np.take_along_axis(tb[0], codes.T, 1).sum(0)
                            ap = s_.astype(np.float32) * np.float32(tb[1] * scale)
                    else:
                        qa = qg if ks_all is None else qg * ks_all[hk]
                        s_, coef = approx_int(qa, bits[b, hk, ctx, :W0], D, mode, qbits)
                        ap = s_.astype(np.float32) * unpack_gamma(bits[b, hk, ctx, :W0]) * np.float32(coef * scale)
                    g = (ap + mrows[hk * rep][ctx]).astype(np.float32)
                    g = np.where(np.isnan(g), np.float32(-np.inf), g)
                    idx = lo + select_candidates(n_ctx, g, budget, min_candidates, sinks, window, a["cand_block"])
                for h in heads:
                    if Kc is None:
                        logits = (Kh[idx] @ Q[b, h, m]) * scale
                    else:
                        qi, qs = query_int16(Q[b, h, m])
                        logits = (Kc[b, hk, idx] @ qi).astype(np.float32) * (qs * (Ks[b, hk, idx] * scale))
                    if softcap > 0:
                        logits = softcap * np.tanh(logits / softcap)
                    logits = logits + mrows[h][idx]
                    mx = logits.max() if idx.size else -np.inf
                    if not np.isfinite(mx):
                        continue
                    e = np.exp(logits - mx)
                    Y[b, h, m] = (e / e.sum()) @ Vh[idx]
    return Y, bits, kv


def _absent(x) -> bool:
    return x is None or np.asarray(x).size == 0


def rotary(x: np.ndarray, pos: np.ndarray, cos_cache, sin_cache, interleaved: bool) -> np.ndarray:
    """x [B, H, S, D] rotated at positions pos [B, S] (< 0: not rotated) by the first r = 2 · cos
    width dims (module docstring: GroupQueryAttention's layout)."""
    cos_cache, sin_cache = np.asarray(cos_cache, np.float32), np.asarray(sin_cache, np.float32)
    half = cos_cache.shape[1]
    i1 = np.arange(half) * 2 if interleaved else np.arange(half)
    i2 = i1 + 1 if interleaved else i1 + half
    p = np.maximum(pos, 0)
    c, s_ = cos_cache[p][:, None], sin_cache[p][:, None]          # [B, 1, S, half]
    x1, x2 = x[..., i1], x[..., i2]
    y = x.copy()
    keep = (pos < 0)[:, None, :, None]
    y[..., i1] = np.where(keep, x1, (x1 * c - x2 * s_).astype(np.float32))
    y[..., i2] = np.where(keep, x2, (x2 * c + x1 * s_).astype(np.float32))
    return y


def check_ksmooth(ksmooth, Hkv: int, D: int, half: int, interleaved: bool) -> np.ndarray:
    """The ksmooth attribute as [Hkv, D] float32; ValueError when its length, a value (finite, > 0,
    finite reciprocal) or a rotary pair (both dims of a pair, (i, i + half) or (2i, 2i + 1), equal)
    does not fit."""
    s = np.asarray(ksmooth, np.float32).reshape(-1)
    if s.size != Hkv * D:
        raise ValueError(f"ksmooth has {s.size} values, expected KV heads x head dim = {Hkv * D}")
    with np.errstate(divide="ignore", over="ignore"):
        bad = ~((s > 0) & np.isfinite(s) & np.isfinite(np.float32(1) / s))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"ksmooth[{i}] = {s[i]}: must be finite and > 0 (with a finite reciprocal)")
    s = s.reshape(Hkv, D)
    i1 = np.arange(half) * 2 if interleaved else np.arange(half)
    i2 = i1 + 1 if interleaved else i1 + half
    diff = s[:, i1] != s[:, i2]
    if diff.any():
        h, i = (int(x[0]) for x in np.nonzero(diff))
        raise ValueError(f"ksmooth differs within rotary pair ({i1[i]}, {i2[i]}) of KV head {h}: "
                         f"{s[h, i1[i]]} vs {s[h, i2[i]]} (the scale must commute with the rotation)")
    return s


def gqa_layout_kv(Q, K, V, mask=None, past_bits=None, past_kv=None, seqlens_k=None, cos_cache=None,
                  sin_cache=None, prompt_continues=None, **attrs):
    """The cache mode on GroupQueryAttention's layout (module docstring). Returns (Y [B, S, Hq·Dv],
    present_bits, present_kv)."""
    a = _SCHEMA.resolve(attrs)
    Hq, Hkv = a["num_heads"], a["kv_num_heads"]
    Q = np.asarray(Q, np.float32)
    B, S, X = Q.shape
    if _absent(K):                                            # packed QKV
        D = Dv = X // (Hq + 2 * Hkv)
        Q, K, V = Q[..., :Hq * D], Q[..., Hq * D:(Hq + Hkv) * D], Q[..., (Hq + Hkv) * D:]
    else:
        K, V = np.asarray(K, np.float32), np.asarray(V, np.float32)
        D, Dv = X // Hq, V.shape[-1] // Hkv

    def heads(x, H, d):
        return np.ascontiguousarray(x.reshape(B, S, H, d).transpose(0, 2, 1, 3))

    Q4, K4, V4 = heads(Q, Hq, D), heads(K, Hkv, D), heads(V, Hkv, Dv)
    sm = np.asarray(a.get("ksmooth") or (), np.float32)
    if sm.size:
        s = check_ksmooth(sm, Hkv, D, 0 if _absent(cos_cache) else np.asarray(cos_cache).shape[1],
                          bool(a["rotary_interleaved"]))
        Q4 = (Q4 * np.repeat(s, Hq // Hkv, axis=0)[None, :, None, :]).astype(np.float32)
        K4 = (K4 * (np.float32(1) / s)[None, :, None, :]).astype(np.float32)
    if not _absent(cos_cache):
        P = 0 if _absent(past_kv) else np.asarray(past_kv).shape[2]
        total = (np.full(B, P + S, np.int64) if _absent(seqlens_k) else np.asarray(seqlens_k, np.int64).reshape(B) + 1)
        pos = np.maximum(0, total - S)[:, None] + np.arange(S)[None]
        pos = np.where(pos < total[:, None], pos, -1)
        if pos.max(initial=-1) >= np.asarray(cos_cache).shape[0]:
            raise ValueError(f"position {pos.max()} beyond the rotary caches' {np.asarray(cos_cache).shape[0]} rows")
        inter = bool(a["rotary_interleaved"])
        Q4, K4 = rotary(Q4, pos, cos_cache, sin_cache, inter), rotary(K4, pos, cos_cache, sin_cache, inter)
    core = {k: v for k, v in attrs.items() if k not in ("num_heads", "kv_num_heads", "rotary_interleaved", "ksmooth")}
    Y, bits, kv = packed_attention_kv(Q4, K4, V4, mask, past_bits, past_kv, seqlens_k, prompt_continues, **core)
    return np.ascontiguousarray(Y.transpose(0, 2, 1, 3)).reshape(B, S, Hq * Dv), bits, kv


def op(q, k=None, v=None, mask=None, past_bits=None, past_kv=None, seqlens_k=None, cos_cache=None,
       sin_cache=None, prompt_continues=None, **attrs):
    """The op as ONNX Runtime calls it (custom_ops.schema: PackedAttention.reference)."""
    a = _SCHEMA.resolve(attrs)
    if a["num_heads"] > 0:
        return gqa_layout_kv(q, k, v, mask, past_bits, past_kv, seqlens_k, cos_cache, sin_cache, prompt_continues,
                             **attrs)
    if a["kv_quant"] != "none":
        return packed_attention_kv(q, k, v, mask, past_bits, past_kv, seqlens_k, prompt_continues, **attrs)
    Y, bits = packed_attention(q, k, v, mask, past_bits, **attrs)
    return Y, bits, np.zeros((0,), np.int32)
