"""Driving optimum-exported ONNX models in onnxruntime: inputs, perplexity, embeddings,
greedy generation, benchmarking, profiling, weight bytes, ORT's own MatMulNBits baseline.

Works on any optimum export (dense, or rewritten with ortlean's custom ops): the caller builds
the session (``custom_ops.session(path, threads=N)`` for rewritten models, a plain
``onnxruntime.InferenceSession`` for dense ones) and this module only looks at its declared
inputs and outputs.

    io = ModelIO.from_session(sess)
    tok = load_tokenizer(model_path)
    ids = np.array(tok.encode(text, add_special_tokens=False).ids)
    perplexity(sess, io, ids, window=512)          # {"ppl": ..., "nll": ..., "tokens": ...}
    generate(sess, io, tok, "Once upon a time", 32)
    bench_sessions({"dense": s0, "lean": s1}, io)
"""
from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np

__all__ = [
    "ModelIO", "load_tokenizer", "tokenize", "feeds", "run", "perplexity", "embeddings",
    "sentences_from_text", "generate", "bench_sessions", "profile_summary", "ProfileSummary",
    "weight_bytes", "quantize_matmul_nbits", "EOS_TOKENS",
]

_ONNX_TO_NP = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_, "tensor(int16)": np.int16,
    "tensor(uint16)": np.uint16, "tensor(uint32)": np.uint32, "tensor(uint64)": np.uint64,
}

_PAST_RE = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_PRESENT_RE = re.compile(r"^present\.(\d+)\.(key|value)$")


# ---------------------------------------------------------------------------------------------
# model I/O description
@dataclass
class ModelIO:
    """What the model expects and returns, read from its declared graph inputs/outputs.

    ``past_to_present`` pairs every state input (``past_key_values.N.key`` …, and any other
    input whose name maps to an output by ``past_key_values``→``present`` / ``past``→``present``)
    with the output that carries its next value. ``state_shapes`` keeps each state input's
    declared shape (ints, or names for symbolic dims) and ``state_seq_axis`` the axis that grows
    with the sequence, so zero-length initial states can be built for custom layouts too."""

    kind: str                                   # "causal-lm" | "encoder"
    inputs: list[str]
    outputs: list[str]
    input_types: dict[str, Any]                 # name -> numpy dtype
    past_to_present: dict[str, str] = field(default_factory=dict)
    state_shapes: dict[str, list] = field(default_factory=dict)
    state_types: dict[str, Any] = field(default_factory=dict)
    state_seq_axis: dict[str, int] = field(default_factory=dict)
    num_layers: int = 0
    kv_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None

    # -- derived ---------------------------------------------------------------------------
    @property
    def past_inputs(self) -> list[str]:
        return list(self.past_to_present)

    @property
    def present_to_past(self) -> dict[str, str]:
        return {v: k for k, v in self.past_to_present.items()}

    @property
    def has_past(self) -> bool:
        return bool(self.past_to_present)

    @property
    def has_attention_mask(self) -> bool:
        return "attention_mask" in self.inputs

    @property
    def has_position_ids(self) -> bool:
        return "position_ids" in self.inputs

    @property
    def has_token_type_ids(self) -> bool:
        return "token_type_ids" in self.inputs

    @property
    def logits_name(self) -> str | None:
        return "logits" if "logits" in self.outputs else None

    @property
    def hidden_name(self) -> str:
        return "last_hidden_state" if "last_hidden_state" in self.outputs else self.outputs[0]

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def _build(cls, inputs: list[tuple[str, list, Any]], outputs: list[tuple[str, list, Any]]) -> "ModelIO":
        in_names = [n for n, _, _ in inputs]
        out_names = [n for n, _, _ in outputs]
        out_set = set(out_names)
        in_shape = {n: s for n, s, _ in inputs}
        in_type = {n: t for n, _, t in inputs}
        out_shape = {n: s for n, s, _ in outputs}

        pairs: dict[str, str] = {}
        for n in in_names:
            cands = []
            m = _PAST_RE.match(n)
            if m:
                cands.append(f"present.{m.group(1)}.{m.group(2)}")
            if "past_key_values" in n:
                cands.append(n.replace("past_key_values", "present"))
            if "past" in n:
                cands.append(n.replace("past", "present"))
            for c in cands:
                if c in out_set:
                    pairs[n] = c
                    break
        # Any unmatched standard past input: pair by (layer, key|value) index.
        present_idx = {(_PRESENT_RE.match(o).group(1), _PRESENT_RE.match(o).group(2)): o
                       for o in out_names if _PRESENT_RE.match(o)}
        for n in in_names:
            m = _PAST_RE.match(n)
            if m and n not in pairs and (m.group(1), m.group(2)) in present_idx:
                pairs[n] = present_idx[(m.group(1), m.group(2))]

        seq_axis: dict[str, int] = {}
        for n in pairs:
            shape = in_shape[n]
            ax = None
            for i, d in enumerate(shape):
                if isinstance(d, str) and ("past" in d or "sequence" in d or "seq" in d):
                    ax = i
                    break
            if ax is None:  # undeclared: [batch, heads, seq, head_dim] convention, else the
                ax = 2 if len(shape) == 4 else max(len(shape) - 2, 0)  # second to last
            seq_axis[n] = ax

        layers = {int(_PAST_RE.match(n).group(1)) for n in pairs if _PAST_RE.match(n)}
        kv_heads = head_dim = None
        for n in pairs:
            if _PAST_RE.match(n):
                s = in_shape[n]
                if len(s) == 4:
                    kv_heads = s[1] if isinstance(s[1], int) else None
                    head_dim = s[3] if isinstance(s[3], int) else None
                break

        vocab = hidden = None
        if "logits" in out_shape and out_shape["logits"] and isinstance(out_shape["logits"][-1], int):
            vocab = out_shape["logits"][-1]
        if "last_hidden_state" in out_shape and out_shape["last_hidden_state"]:
            h = out_shape["last_hidden_state"][-1]
            hidden = h if isinstance(h, int) else None

        causal = "logits" in out_set or ("input_ids" in in_names and any(_PAST_RE.match(n) for n in in_names))
        kind = "causal-lm" if causal else "encoder"
        return cls(
            kind=kind, inputs=in_names, outputs=out_names, input_types=in_type,
            past_to_present=pairs,
            state_shapes={n: list(in_shape[n]) for n in pairs},
            state_types={n: in_type[n] for n in pairs},
            state_seq_axis=seq_axis, num_layers=len(layers), kv_heads=kv_heads, head_dim=head_dim,
            vocab_size=vocab, hidden_size=hidden,
        )

    @classmethod
    def from_model(cls, model) -> "ModelIO":
        """From a model path (str/Path; external data is not loaded) or an onnx.ModelProto."""
        import onnx

        if not isinstance(model, onnx.ModelProto):
            model = onnx.load(str(model), load_external_data=False)
        g = model.graph
        init_names = {i.name for i in g.initializer}

        def vi(v):
            tt = v.type.tensor_type
            shape = [d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else None)
                     for d in tt.shape.dim]
            np_t = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type) if tt.elem_type else np.float32
            return v.name, shape, np.dtype(np_t).type

        ins = [vi(v) for v in g.input if v.name not in init_names]
        outs = [vi(v) for v in g.output]
        return cls._build(ins, outs)

    @classmethod
    def from_session(cls, sess) -> "ModelIO":
        def vi(a):
            shape = [d if isinstance(d, (int, str)) else None for d in (a.shape or [])]
            return a.name, shape, _ONNX_TO_NP.get(a.type, np.float32)

        return cls._build([vi(a) for a in sess.get_inputs()], [vi(a) for a in sess.get_outputs()])

    # -- states ----------------------------------------------------------------------------
    def empty_state(self, batch: int = 1) -> dict[str, np.ndarray]:
        """Zero-length past for every state input: [B, kv_heads, 0, head_dim] for KV caches."""
        out = {}
        for n, shape in self.state_shapes.items():
            dims = []
            for i, d in enumerate(shape):
                if i == self.state_seq_axis[n]:
                    dims.append(0)
                elif i == 0:
                    dims.append(batch)
                elif isinstance(d, int) and d > 0:
                    dims.append(d)
                else:
                    raise ValueError(f"state input {n}: dimension {i} is symbolic ({d!r}); "
                                     "cannot build an empty initial state")
            out[n] = np.zeros(dims, dtype=self.state_types[n])
        return out

    def state_len(self, past: Mapping[str, np.ndarray]) -> int:
        for n in self.past_to_present:
            if n in past and _PAST_RE.match(n):
                return int(past[n].shape[self.state_seq_axis[n]])
        for n in self.past_to_present:
            if n in past:
                return int(past[n].shape[self.state_seq_axis[n]])
        return 0

    def next_state(self, outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """present.* outputs of a run -> the past.* feeds of the next run."""
        return {p: outputs[o] for p, o in self.past_to_present.items()}


def _outputs_dict(sess, io: ModelIO, feed: dict) -> dict[str, np.ndarray]:
    vals = sess.run(None, feed)
    return dict(zip([o.name for o in sess.get_outputs()], vals))


def run(sess, io: ModelIO, feed: dict) -> dict[str, np.ndarray]:
    """sess.run returning {output name: array}."""
    return _outputs_dict(sess, io, feed)


# ---------------------------------------------------------------------------------------------
# tokenizer
def load_tokenizer(model_path, tokenizer=None):
    """``tokenizers.Tokenizer`` from ``tokenizer`` (a path, or a Tokenizer passed through) or
    from ``tokenizer.json`` next to the model (``model_path`` may be the .onnx file or its dir)."""
    from tokenizers import Tokenizer

    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    if tokenizer is not None:
        p = Path(tokenizer)
        if p.is_dir():
            p = p / "tokenizer.json"
    else:
        mp = Path(model_path)
        p = (mp if mp.is_dir() else mp.parent) / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(
            f"tokenizer file {p} not found: pass the tokenizer.json explicitly "
            "(e.g. --tokenizer PATH), or keep it next to the model as optimum exports it")
    return Tokenizer.from_file(str(p))


def tokenize(tokenizer, text: str, add_special_tokens: bool = False) -> np.ndarray:
    """Token ids of ``text`` as int64 (no special tokens by default: for perplexity)."""
    return np.asarray(tokenizer.encode(text, add_special_tokens=add_special_tokens).ids, dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# feeds
def feeds(io: ModelIO, input_ids, past: Mapping[str, np.ndarray] | None = None, past_len: int = 0,
          attention_mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """All inputs the model declares for ``input_ids`` ([B, T] or [T]) after ``past_len`` cached
    tokens: attention_mask (ones, [B, past_len+T]), position_ids (past_len…), token_type_ids
    (zeros), and the past states (``past``, or zero-length ones). When ``past`` is given and
    ``past_len`` is 0 the past length is read from the states."""
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None, :]
    b, t = ids.shape
    if past is not None and past_len == 0:
        past_len = io.state_len(past)
    out: dict[str, np.ndarray] = {}
    unknown = []
    for name in io.inputs:
        dt = io.input_types.get(name, np.int64)
        if name == "input_ids":
            out[name] = ids.astype(dt, copy=False)
        elif name == "attention_mask":
            if attention_mask is not None:
                out[name] = np.asarray(attention_mask).astype(dt, copy=False)
            else:
                out[name] = np.ones((b, past_len + t), dtype=dt)
        elif name == "position_ids":
            out[name] = np.broadcast_to(np.arange(past_len, past_len + t, dtype=dt), (b, t)).copy()
        elif name == "token_type_ids":
            out[name] = np.zeros((b, t), dtype=dt)
        elif name in io.past_to_present:
            if past is not None:
                if name not in past:
                    raise KeyError(f"past state {name} missing from the given past")
                out[name] = past[name]
        else:
            unknown.append(name)
    if io.past_to_present and past is None:
        out.update(io.empty_state(b))
    if unknown:
        raise ValueError(f"don't know how to feed model inputs {unknown}")
    return out


# ---------------------------------------------------------------------------------------------
# quality
def _log_softmax_rows(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def perplexity(sess, io: ModelIO, ids, window: int = 512, stride: int | None = None,
               max_windows: int | None = None, progress: bool = False) -> dict:
    """Perplexity of a causal LM on the token sequence ``ids``.

    Windows of ``window`` tokens start every ``stride`` tokens (default ``stride = window``:
    non-overlapping). Each window is one forward pass from an empty cache; the tokens of a
    window that an earlier window already scored are context only (with overlap), so every
    token after the first is scored once. Returns ``ppl = exp(nll)``, ``nll`` (mean negative
    log-likelihood per scored token, nats), ``tokens`` (scored), ``windows``."""
    if io.kind != "causal-lm" or not io.logits_name:
        raise ValueError("perplexity needs a causal LM with a logits output")
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    stride = int(stride or window)
    if not 0 < stride <= window:
        raise ValueError(f"stride must be in 1..window ({window}), got {stride}")
    n = ids.size
    total_nll = 0.0
    count = 0
    windows = 0
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
        out = _outputs_dict(sess, io, feeds(io, chunk[None, :]))
        logits = out[io.logits_name][0]                   # [T, V]
        first = max(scored_to, begin + 1)                 # first absolute position to score
        if first < end:
            rows = logits[first - begin - 1: end - begin - 1]
            lp = _log_softmax_rows(rows)
            tgt = ids[first:end]
            total_nll -= float(lp[np.arange(tgt.size), tgt].sum())
            count += int(tgt.size)
            scored_to = end
        windows += 1
        if end >= n:
            break
    if count == 0:
        raise ValueError("perplexity: fewer than 2 tokens to score")
    nll = total_nll / count
    return {"ppl": math.exp(nll), "nll": nll, "tokens": count, "windows": windows,
            "window": window, "stride": stride}


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
        h = _outputs_dict(sess, io, f)[io.hidden_name].astype(np.float32)  # [B, T, H]
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


# ---------------------------------------------------------------------------------------------
# generation
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>", "<|end_of_text|>", "<eos>")


def _eos_ids(tokenizer, eos) -> set[int]:
    if eos is None:
        return set()
    if isinstance(eos, (int, np.integer)):
        return {int(eos)}
    if isinstance(eos, str) and eos != "auto":
        i = tokenizer.token_to_id(eos)
        return {i} if i is not None else set()
    if eos == "auto":
        return {i for t in EOS_TOKENS if (i := tokenizer.token_to_id(t)) is not None}
    return {int(x) for x in eos}


def generate(sess, io: ModelIO, tokenizer, prompt, max_new_tokens: int = 32, eos="auto",
             add_special_tokens: bool = True) -> tuple[str, list[int]]:
    """Greedy decoding with the KV cache: one prefill over the prompt, then one token per run,
    feeding each run's present.* back as past.*. ``prompt`` is text or a list of ids; ``eos``
    is "auto" (the usual end tokens the tokenizer knows), an id, a token string, a list of ids,
    or None. Returns (decoded new text, new ids); generation stops after an eos token (which
    is included in the ids but not in the text)."""
    if io.kind != "causal-lm":
        raise ValueError("generate needs a causal LM")
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids
    else:
        ids = [int(x) for x in prompt]
    if not ids:
        raise ValueError("empty prompt")
    stop = _eos_ids(tokenizer, eos)
    new: list[int] = []
    out = _outputs_dict(sess, io, feeds(io, np.array([ids], dtype=np.int64)))
    past_len = len(ids)
    for step in range(max_new_tokens):
        nxt = int(np.argmax(out[io.logits_name][0, -1]))
        new.append(nxt)
        if nxt in stop or step == max_new_tokens - 1:
            break
        if io.has_past:
            past = io.next_state(out)
            out = _outputs_dict(sess, io, feeds(io, np.array([[nxt]], dtype=np.int64), past, past_len))
            past_len += 1
        else:  # no cache: rerun the whole sequence
            out = _outputs_dict(sess, io, feeds(io, np.array([ids + new], dtype=np.int64)))
    text_ids = [i for i in new if i not in stop]
    return tokenizer.decode(text_ids, skip_special_tokens=True), new


# ---------------------------------------------------------------------------------------------
# benchmarking
def _stats(samples_s: list[float]) -> dict:
    a = np.asarray(samples_s, dtype=np.float64) * 1e3
    return {"median_ms": float(np.median(a)), "p10_ms": float(np.percentile(a, 10)),
            "p90_ms": float(np.percentile(a, 90)), "mean_ms": float(a.mean()), "n": int(a.size)}


def bench_sessions(sessions: Mapping[str, Any], io: ModelIO, prefill_len: int = 128,
                   decode_past: int = 128, decode_steps: int = 16, repeats: int = 7,
                   warmup: int = 2, short_len: int = 16, batch: int = 1, seed: int = 0,
                   baseline: str | None = None, vocab_size: int | None = None,
                   progress: bool = False, ios: Mapping[str, ModelIO] | None = None) -> dict:
    """Time the sessions (same model interface, e.g. dense vs rewritten) on the same inputs.

    Causal LM: prefill latency of ``prefill_len`` tokens from an empty cache, and decode step
    latency — ``decode_steps`` single-token runs starting from a cache of ``decode_past`` tokens
    that the session itself built (untimed), the cache growing as in generation.
    Encoder: latency of one ``prefill_len``-token sequence and of a ``short_len`` one.

    After ``warmup`` untimed rounds, each of ``repeats`` rounds runs every session once per
    measurement, round-robin (the order rotates every round) so drift hits all alike; each timed
    prefill follows an untimed one of the same session (other sessions' pools stop spinning). Reports
    per session the median / p10 / p90 (over rounds for prefill; over all steps for decode),
    tokens/s from the median, and ratios vs ``baseline`` (default: "dense" if present, else the
    first session): ``speedup = baseline_median / session_median``. Token ids are random
    (seeded) below ``vocab_size`` (default: the logits width; 100 when unknown, e.g. encoders)."""
    names = list(sessions)
    if not names:
        raise ValueError("no sessions")
    # per-session interface (a rewritten model may carry extra cache states, e.g. key_bits)
    ios = {n: (ios or {}).get(n, io) for n in names}
    baseline = baseline or ("dense" if "dense" in sessions else names[0])
    rng = np.random.default_rng(seed)
    hi = max(int(vocab_size or io.vocab_size or 100), 2)
    lo = 100 if hi > 1000 else 0  # skip the special tokens at the start of big vocabularies
    long_ids = rng.integers(lo, hi, size=(batch, prefill_len), dtype=np.int64)
    short_ids = rng.integers(lo, hi, size=(batch, short_len), dtype=np.int64)
    past_ids = rng.integers(lo, hi, size=(batch, decode_past), dtype=np.int64)
    step_ids = rng.integers(lo, hi, size=(batch, decode_steps), dtype=np.int64)
    causal = io.kind == "causal-lm"

    results: dict[str, dict[str, list[float]]] = {n: defaultdict(list) for n in names}
    init_state: dict[str, tuple[dict, int]] = {}
    if causal and io.has_past and decode_steps > 0:
        for n in names:
            out = _outputs_dict(sessions[n], ios[n], feeds(ios[n], past_ids))
            init_state[n] = (ios[n].next_state(out), decode_past)

    def t_prefill(n, ids):
        f = feeds(ios[n], ids)
        t0 = time.perf_counter()
        sessions[n].run(None, f)
        return time.perf_counter() - t0

    def t_decode(n) -> list[float]:
        past, plen = init_state[n]
        times = []
        for s in range(decode_steps):
            f = feeds(ios[n], step_ids[:, s: s + 1], past, plen)
            t0 = time.perf_counter()
            out = _outputs_dict(sessions[n], ios[n], f)
            times.append(time.perf_counter() - t0)
            past, plen = ios[n].next_state(out), plen + 1
        return times

    rounds = range(warmup + repeats)
    if progress:
        from tqdm import tqdm

        rounds = tqdm(rounds, desc="bench", unit="round", leave=False)
    for r in rounds:
        k = r % len(names)
        order = names[k:] + names[:k]
        timed = r >= warmup
        for n in order:
            if timed and len(names) > 1:
                # untimed run first: the previous session's intra-op threads spin for a while after
                # its Run and, with > 1 thread on few cores, would compete with this timed one
                # (measured: SmolLM2 prefill at 2 threads 0.78-0.85x in a tight interleave where
                # the per-op ORT profile gives 0.93x)
                t_prefill(n, long_ids)
            dt = t_prefill(n, long_ids)
            if timed:
                results[n]["prefill"].append(dt)
        if causal:
            if init_state:
                for n in order:
                    ts = t_decode(n)
                    if timed:
                        results[n]["decode"].extend(ts)
        else:
            for n in order:
                if timed and len(names) > 1:
                    t_prefill(n, short_ids)  # untimed: see above
                dt = t_prefill(n, short_ids)
                if timed:
                    results[n]["short"].append(dt)

    report: dict[str, Any] = {
        "kind": io.kind, "baseline": baseline,
        "params": {"prefill_len": prefill_len, "decode_past": decode_past, "decode_steps": decode_steps,
                   "repeats": repeats, "warmup": warmup, "short_len": short_len, "batch": batch},
        "sessions": {},
    }
    for n in names:
        row: dict[str, Any] = {}
        if results[n]["prefill"]:
            st = _stats(results[n]["prefill"])
            row["prefill"] = st
            row["prefill_tok_s"] = batch * prefill_len / (st["median_ms"] / 1e3)
        if results[n]["decode"]:
            st = _stats(results[n]["decode"])
            row["decode"] = st
            row["decode_tok_s"] = batch / (st["median_ms"] / 1e3)
        if results[n]["short"]:
            row["short"] = _stats(results[n]["short"])
        report["sessions"][n] = row
    base = report["sessions"][baseline]
    report["ratios"] = {}
    for n in names:
        rr = {}
        for key in ("prefill", "decode", "short"):
            if key in base and key in report["sessions"][n]:
                rr[key] = base[key]["median_ms"] / report["sessions"][n][key]["median_ms"]
        report["ratios"][n] = rr
    return report


# ---------------------------------------------------------------------------------------------
# profiling
class ProfileSummary(list):
    """Rows per op type (dicts: op_type, count, calls, total_ms, mean_ms, pct), slowest first;
    ``.top_nodes`` holds the slowest nodes (name, op_type, calls, total_ms, pct);
    ``.runs`` the number of measured runs (times are per run); ``.total_ms`` their sum."""

    top_nodes: list[dict]
    runs: int
    total_ms: float


def _default_factory(model_path, so=None):
    import onnxruntime as ort

    return ort.InferenceSession(str(model_path), sess_options=so, providers=["CPUExecutionProvider"])


def profile_summary(model_path, session_factory: Callable | None = None, feeds=None, runs: int = 5,
                    warmup: int = 1, top: int = 15, so=None, keep_trace: str | None = None) -> ProfileSummary:
    """Per-op-type time from ORT's own profiler.

    ``session_factory(model_path, so=so)`` must return a session built with the given
    SessionOptions (profiling is switched on in them); e.g. ``functools.partial(
    custom_ops.session, threads=2)``, default a plain CPU InferenceSession. ``feeds`` is a
    dict or a callable ``(session) -> dict``. The first ``warmup`` runs are excluded. Times are
    kernel times per run (averaged over ``runs``); ``pct`` is the share of all node time."""
    import onnxruntime as ort

    factory = session_factory or _default_factory
    so = so or ort.SessionOptions()
    with tempfile.TemporaryDirectory(prefix="ortlean-prof-") as d:
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(d, "ort_profile")
        sess = factory(str(model_path), so=so)
        f = feeds(sess) if callable(feeds) else feeds
        if f is None:
            f = globals()["feeds"](ModelIO.from_session(sess), np.arange(1, 17, dtype=np.int64)[None, :])
        for _ in range(warmup + runs):
            sess.run(None, f)
        trace_path = sess.end_profiling()
        with open(trace_path) as fh:
            trace = json.load(fh)
        if keep_trace:
            Path(keep_trace).write_text(json.dumps(trace))
        del sess
    events = trace if isinstance(trace, list) else trace.get("traceEvents", [])
    model_runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                        key=lambda e: e["ts"])
    measured = model_runs[warmup:] if len(model_runs) > warmup else model_runs
    spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in measured]

    def in_measured(ts):
        return any(a <= ts <= b for a, b in spans) if spans else True

    by_op: dict[str, dict] = defaultdict(lambda: {"nodes": set(), "calls": 0, "us": 0.0})
    by_node: dict[str, dict] = defaultdict(lambda: {"op_type": "", "calls": 0, "us": 0.0})
    for e in events:
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith("_kernel_time"):
            continue
        if not in_measured(e.get("ts", 0)):
            continue
        args = e.get("args", {})
        op = args.get("op_name", "?")
        node = e["name"][: -len("_kernel_time")]
        dur = float(e.get("dur", 0))
        by_op[op]["nodes"].add(node)
        by_op[op]["calls"] += 1
        by_op[op]["us"] += dur
        by_node[node]["op_type"] = op
        by_node[node]["calls"] += 1
        by_node[node]["us"] += dur
    nruns = max(len(measured), 1)
    total_us = sum(v["us"] for v in by_op.values()) or 1.0
    rows = ProfileSummary(
        {"op_type": op, "count": len(v["nodes"]), "calls": v["calls"] // nruns,
         "total_ms": v["us"] / 1e3 / nruns, "mean_ms": v["us"] / 1e3 / max(v["calls"], 1),
         "pct": 100.0 * v["us"] / total_us}
        for op, v in sorted(by_op.items(), key=lambda kv: -kv[1]["us"]))
    rows.top_nodes = [
        {"name": n, "op_type": v["op_type"], "calls": v["calls"] // nruns,
         "total_ms": v["us"] / 1e3 / nruns, "pct": 100.0 * v["us"] / total_us}
        for n, v in sorted(by_node.items(), key=lambda kv: -kv[1]["us"])[:top]]
    rows.runs = nruns
    rows.total_ms = total_us / 1e3 / nruns
    return rows


# ---------------------------------------------------------------------------------------------
# sizes and the MatMulNBits baseline
def _tensor_nbytes(t, base_dir: Path) -> int:
    import onnx

    if t.data_location == onnx.TensorProto.EXTERNAL:
        info = {e.key: e.value for e in t.external_data}
        if "length" in info:
            return int(info["length"])
        p = base_dir / info["location"]
        return max(p.stat().st_size - int(info.get("offset", 0)), 0) if p.is_file() else 0
    if t.raw_data:
        return len(t.raw_data)
    if t.data_type == onnx.TensorProto.STRING:
        return sum(len(s) for s in t.string_data)
    numel = int(np.prod(t.dims)) if len(t.dims) else 1
    bits = {onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4}
    if t.data_type in bits:
        return (numel * bits[t.data_type] + 7) // 8
    fp4 = getattr(onnx.TensorProto, "FLOAT4E2M1", None)
    if fp4 is not None and t.data_type == fp4:
        return (numel * 4 + 7) // 8
    return numel * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize


def weight_bytes(model_path) -> int:
    """Bytes of all initializers (main graph and subgraphs), external data included, as stored."""
    import onnx

    model_path = Path(model_path)
    m = onnx.load(str(model_path), load_external_data=False)
    base = model_path.parent
    total = 0

    def walk(g):
        nonlocal total
        for t in g.initializer:
            total += _tensor_nbytes(t, base)
        for st in g.sparse_initializer:
            total += _tensor_nbytes(st.values, base) + _tensor_nbytes(st.indices, base)
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for sg in a.graphs:
                        walk(sg)

    walk(m.graph)
    return total


def quantize_matmul_nbits(dense_model_path, bits: int, out_path, block_size: int = 32,
                          symmetric: bool = False, accuracy_level: int | None = 4,
                          nodes_to_exclude: Iterable[str] = ()) -> Path:
    """ORT's own weight-only quantization (``MatMulNBitsQuantizer``, QOperator format): every
    MatMul with a constant B becomes ``com.microsoft.MatMulNBits`` with ``bits`` (4 or 8; 2 in
    recent ORT) bit blocks of ``block_size`` along K, asymmetric (ORT's default) unless
    ``symmetric``. ``accuracy_level=4`` lets the CPU kernel compute in int8 (what ORT's model
    builder uses for CPU). The lm_head is quantized too unless listed in ``nodes_to_exclude``. Writes ``out_path`` (weights inline, or external
    data ``<out>.data`` when over 2 GB) and returns it. Caching is the caller's business."""
    import onnx

    from .quantize import QuantConfig, matmul_nbits_proto

    qm = matmul_nbits_proto(onnx.load(str(dense_model_path)),
                            QuantConfig(bits, block_size, symmetric, accuracy_level), nodes_to_exclude)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    big = qm.ByteSize() > 1_900_000_000
    if big:
        data_name = out_path.name + ".data"
        onnx.save_model(qm, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data_name)
    else:
        onnx.save_model(qm, str(tmp))
    os.replace(tmp, out_path)
    return out_path
