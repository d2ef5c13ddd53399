"""Quality of a model on text: perplexity of a causal LM, sentence embeddings of an encoder, and
the sentences of a text those are computed on."""
from __future__ import annotations

import math
import re

import numpy as np

from .io import ModelIO, feeds, run

# quality
def _log_softmax_rows(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _target_logprobs(logits: np.ndarray, targets: np.ndarray, rows: int = 16) -> np.ndarray:
    """``_log_softmax_rows(logits)[i, targets[i]]`` for every row ``i`` of ``logits`` [T, V] (float64,
    the same values bit for bit: each row's max, sum and log as the whole-array formula computes
    them), ``rows`` rows at a time: the whole-array formula holds about four float64 copies of the
    logits at once (a 256-token window of a 151,936-token vocabulary: 1.2 GB), this one a block's."""
    targets = np.asarray(targets).reshape(-1)
    out = np.empty(targets.size, np.float64)
    for lo in range(0, targets.size, rows):
        x = logits[lo:lo + rows].astype(np.float64)
        m = x.max(axis=-1, keepdims=True)
        s = np.exp(x - m).sum(axis=-1, keepdims=True)
        out[lo:lo + rows] = x[np.arange(x.shape[0]), targets[lo:lo + rows]] - m[:, 0] - np.log(s[:, 0])
    return out


def perplexity(sess, io: ModelIO, ids, window: int = 512, stride: int | None = None,
               max_windows: int | None = None, progress: bool = False, prefix=None) -> dict:
    """Perplexity of a causal LM on the token sequence ``ids``.

    Windows of ``window`` tokens start every ``stride`` tokens (default ``stride = window``:
    non-overlapping). Each window is one forward pass from an empty cache, ``prefix`` (the
    tokenizer's :func:`text_prefix`, context only) first; the tokens of a window that an earlier
    window already scored are context only (with overlap), so every token after the first is scored
    once (a window's first token is context, as without a prefix). Returns ``ppl = exp(nll)``,
    ``nll`` (mean negative log-likelihood per scored token, nats), ``tokens`` (scored), ``windows``,
    ``token_nll`` (each scored token's NLL, in order: ``paired_delta`` against another model's)."""
    if io.kind != "causal-lm" or not io.logits_name:
        raise ValueError("perplexity needs a causal LM with a logits output")
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    stride = int(stride or window)
    if not 0 < stride <= window:
        raise ValueError(f"stride must be in 1..window ({window}), got {stride}")
    pre = np.asarray(prefix if prefix is not None else (), np.int64).reshape(-1)
    p = pre.size
    n = ids.size
    total_nll = 0.0
    count = 0
    windows = 0
    parts = []
    scored_to = 1  # positions < scored_to are already scored (position 0 never is)
    starts = range(0, max(n - 1, 0), stride)
    it = starts
    if progress:
        from tqdm import tqdm

        nwin = len(starts) if max_windows is None else min(len(starts), max_windows)
        it = tqdm(starts, total=nwin, desc="perplexity", unit="win", leave=False)
    for begin in it:
        if max_windows is not None and windows >= max_windows:
            break
        end = min(begin + window, n)
        chunk = ids[begin:end]
        if chunk.size < 2:
            break
        out = run(sess, io, feeds(io, np.concatenate([pre, chunk])[None, :] if p else chunk[None, :]))
        logits = out[io.logits_name][0]                   # [p + T, V]
        first = max(scored_to, begin + 1)                 # first absolute position to score
        if first < end:
            rows = logits[p + first - begin - 1: p + end - begin - 1]
            tgt = ids[first:end]
            lp = _target_logprobs(rows, tgt)
            parts.append(-lp)
            total_nll -= float(lp.sum())
            count += int(tgt.size)
            scored_to = end
        windows += 1
        if end >= n:
            break
    if count == 0:
        raise ValueError("perplexity: fewer than 2 tokens to score")
    nll = total_nll / count
    return {"ppl": math.exp(nll), "nll": nll, "tokens": count, "windows": windows,
            "window": window, "stride": stride, "prefix": [int(x) for x in pre],
            "token_nll": np.concatenate(parts)}


def embeddings(sess, io: ModelIO, tokenizer, sentences: list[str], max_len: int = 128,
               batch: int = 16, normalize: bool = True) -> np.ndarray:
    """Sentence embeddings [N, H] (float32): mean of ``last_hidden_state`` over the attention
    mask, L2-normalized (sentence-transformers' recipe for all-MiniLM-L6-v2)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer.to_str())  # don't change the caller's settings
    tok.enable_truncation(max_length=max_len)
    pad_id = tok.token_to_id("[PAD]")
    if pad_id is None:
        pad_id = tok.token_to_id("<pad>")
    tok.enable_padding(pad_id=pad_id if pad_id is not None else 0)
    out = []
    for i in range(0, len(sentences), batch):
        encs = tok.encode_batch(list(sentences[i: i + batch]))
        ids = np.array([e.ids for e in encs], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encs], dtype=np.int64)
        f = feeds(io, ids, attention_mask=mask)
        if "token_type_ids" in f:
            f["token_type_ids"] = np.array([e.type_ids for e in encs], dtype=f["token_type_ids"].dtype)
        h = run(sess, io, f)[io.hidden_name].astype(np.float32)  # [B, T, H]
        m = mask[..., None].astype(np.float32)
        pooled = (h * m).sum(axis=1) / np.clip(m.sum(axis=1), 1e-9, None)
        if normalize:
            pooled /= np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)
        out.append(pooled)
    if not out:
        return np.zeros((0, io.hidden_size or 0), dtype=np.float32)
    return np.concatenate(out, axis=0)


_SENT_SPLIT = re.compile(r"(?<=[.!?])[\"'”’)]*\s+(?=[\"'“‘(]*[A-Z])")


def sentences_from_text(text: str, n: int, min_words: int = 8, max_words: int = 60) -> list[str]:
    """``n`` sentences of ``min_words``..``max_words`` words, spread evenly over ``text``
    (deterministic). Line wrapping is undone; paragraphs (blank lines) always end a sentence."""
    sents: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        if not para:
            continue
        for s in _SENT_SPLIT.split(para):
            s = s.strip()
            w = len(s.split())
            if min_words <= w <= max_words:
                sents.append(s)
    if n >= len(sents):
        return sents
    idx = np.linspace(0, len(sents) - 1, n).round().astype(int)
    return [sents[i] for i in idx]




# decode-mode quality (approximate decode paths: PackedAttention's candidate budget)
def approximate_from(model) -> int | None:
    """The shortest context at which a model (path or ModelProto) decodes through an approximation
    that its prefill does not use — an ai.ortlean PackedAttention node with 0 < budget < 1 takes its
    candidate path above its min_context (the schema's default when a node omits it) — or None when
    none does."""
    import onnx

    from .. import schema

    default_mc = schema.get("PackedAttention").attr("min_context").default
    m = onnx.load(str(model), load_external_data=False) if not isinstance(model, onnx.ModelProto) else model
    best = None
    for n in m.graph.node:
        if n.op_type == "PackedAttention" and n.domain == "ai.ortlean":
            at = {a.name: a for a in n.attribute}
            if "budget" in at and 0.0 < at["budget"].f < 1.0:
                mc = at["min_context"].i if "min_context" in at else default_mc
                best = mc + 1 if best is None else min(best, mc + 1)
    return best


def approximate_decode(model) -> bool:
    """Whether a model (path or ModelProto) decodes through an approximation that its prefill does
    not use: an ai.ortlean PackedAttention node with 0 < budget < 1 (perplexity over prompt windows
    runs its exact prefill path and cannot see it)."""
    return approximate_from(model) is not None


Z_UPPER = 1.645  # one-sided 95 %


def paired_delta(nll, nll_ref) -> tuple[float, float]:
    """Δppl of per-token NLLs against the reference's on the same tokens, and its one-sided 95 %
    upper confidence bound exp(mean d + Z_UPPER · se(d)) − 1 (d: the paired per-token differences).
    Samples of ~1,000 tokens are small: on SmolLM2 an attention budget measured +1.82 % on 1,024
    calibration tokens gave +2.71 % on the held-out novel (``--attn-tune`` checks the bound)."""
    d = np.asarray(nll, np.float64).ravel() - np.asarray(nll_ref, np.float64).ravel()
    se = float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else 0.0
    return math.exp(float(d.mean())) - 1.0, math.exp(float(d.mean()) + Z_UPPER * se) - 1.0


def decode_perplexity(sess, io: ModelIO, ids, context: int = 1024, score: int = 128, windows: int = 2,
                      shared: bool = True, progress: bool = False, prefix=None) -> dict:
    """Teacher-forced decode-mode perplexity: per window, the first ``context`` tokens are one
    prefill, then the next ``score`` tokens are fed one at a time through the KV cache (the decode
    path), each step's logits scoring the following token — so every scored token is predicted by
    a decode step after a past of ``context`` .. ``context + score - 1`` tokens. Windows start
    ``context + score + 1`` tokens apart. ``shared``: one K/V buffer per state (runtime.shared_kv,
    as onnxruntime-genai runs fused graphs) when the graph allows it, else the growing-state loop.
    Returns ``ppl``, ``nll``, ``tokens``, ``windows``, ``context``, ``loop`` (shared | growing),
    ``token_nll`` (each scored token's NLL, in order: paired_delta against another model's).
    ``prefix`` (the tokenizer's :func:`text_prefix`) goes before every window's prefill, which is then
    ``len(prefix) + context`` tokens (the caller leaves room for it within the positions)."""
    from .shared_kv import PREFILL_CHUNK, SharedKV, SharedKVError

    if io.kind != "causal-lm" or not io.logits_name:
        raise ValueError("decode_perplexity needs a causal LM with a logits output")
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    pre = np.asarray(prefix if prefix is not None else (), np.int64).reshape(-1)
    span = context + score + 1
    n_win = min(windows, ids.size // span)
    if n_win < 1:
        raise ValueError(f"decode_perplexity: {ids.size} tokens, need context {context} + score {score} + 1")
    kv = None
    if shared and io.has_past:
        try:
            kv = SharedKV(sess, io, max_len=pre.size + context + score)
        except SharedKVError:
            kv = None
    total, count, token_nll = 0.0, 0, []
    loop = "shared" if kv is not None else "growing"
    it = range(n_win)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="decode-mode ppl", unit="win", leave=False)
    for w in it:
        chunk = ids[w * span:(w + 1) * span]
        head = np.concatenate([pre, chunk[:context]])[None, :]
        if kv is not None:
            try:
                kv.prefill(head, chunk=PREFILL_CHUNK)
            except SharedKVError:
                kv, loop = None, "growing"
        if kv is None:
            out = run(sess, io, feeds(io, head))
            past, plen = io.next_state(out), head.shape[1]
        for i in range(score):
            tok = chunk[context + i: context + i + 1][None, :]
            if kv is not None:
                logits = kv.step(tok)[0, -1]
            else:
                out = run(sess, io, feeds(io, tok, past, plen))
                logits = out[io.logits_name][0, -1]
                past, plen = io.next_state(out), plen + 1
            lp = _log_softmax_rows(logits[None, :])[0]
            token_nll.append(-float(lp[chunk[context + i + 1]]))
            total += token_nll[-1]
            count += 1
    nll = total / count
    return {"ppl": math.exp(nll), "nll": nll, "tokens": count, "windows": n_win, "context": context,
            "score": score, "loop": loop, "token_nll": np.asarray(token_nll), "prefix": [int(x) for x in pre]}
