"""Text generation with the KV cache, for every graph form ortlean writes: token by token, streamed.

    from custom_ops import runtime
    io = runtime.ModelIO.from_session(sess, model_path)
    g = runtime.generate(sess, io, tok, "Once upon a time", 64, eos=runtime.model_eos_ids(model_path, tok),
                         sampling=runtime.Sampling(temperature=0.7, top_p=0.9, seed=1),
                         on_text=lambda s: print(s, end="", flush=True), model_path=model_path)
    text, ids = g               # g.stats: prompt tokens, prefill / decode seconds, loop, why it stopped

The loop (:class:`Decoder`) is chosen from the graph:

* ``shared`` — every state is the cache of a GroupQueryAttention or cache-mode PackedAttention node
  (fused graphs, the genai builder's, ``--attn-exact`` / ``--state-pack``): one buffer per state
  bound as past and present through IOBinding (:class:`runtime.shared_kv.SharedKV`), so a step writes
  only the new token's rows;
* ``growing`` — any other state (an optimum export's concatenating cache, EventGatedMatMul's
  ``past_event.*``): each run's ``present*`` outputs are fed back as ``past*`` inputs;
* ``rerun`` — no state at all: the whole sequence is run again for every token.

The prompt is prefilled in chunks (``prefill_chunk`` tokens, 512 by default) when every state is a
KV cache: attention over a chunk needs scores of chunk x context, not prompt x prompt (a 4,096-token
prompt in one run of the unfused export holds 9 heads x 4,096² float scores per layer, 600 MB). A
graph with a gate's state (EventGatedMatMul's duty cycle and event steps count runs) takes the
prompt in one run, as it was calibrated.

A prompt cache (``prompt_cache=``, :mod:`runtime.prompt_cache`) keeps the state of the prompt's shared
beginning (a document) in a file: a later prompt that starts with the same tokens restores it
(:meth:`Decoder.restore`) and prefills only the rest; either loop's state goes there (every state a KV
cache). :attr:`Generation.ttft_seconds` is the time to the first token.

Text is streamed as it is decoded (:class:`TextStream`): the delta of the decoded text over a short
window of tokens, held back while it ends in an incomplete UTF-8 sequence (byte-level BPE and
byte-fallback tokenizers split one character over several tokens), so the streamed pieces add up to
``tokenizer.decode(new ids)``.
"""
from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from custom_ops import prompt_continues

from .io import ModelIO, feeds, run

__all__ = ["EOS_TOKENS", "Sampling", "Sampler", "TextStream", "Decoder", "Generation", "generate", "model_eos_ids",
           "model_positions", "chat_template", "special_tokens", "render_chat", "shares_kv"]

# end tokens tried by eos="auto" when a model carries no eos ids of its own
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>", "<|end_of_text|>", "<eos>")
PREFILL_CHUNK = 512


# --------------------------------------------------------------------------- end of sequence
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


def _json(path: Path) -> dict:
    try:
        v = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return v if isinstance(v, dict) else {}


def _ids(v) -> list[int]:
    if isinstance(v, bool) or v is None:
        return []
    if isinstance(v, int):
        return [v]
    if isinstance(v, list):
        return [int(x) for x in v if isinstance(x, int) and not isinstance(x, bool)]
    return []


def model_eos_ids(model_path, tokenizer=None) -> list[int] | str:
    """The model's end-of-sequence ids: ``eos_token_id`` of ``generation_config.json``, else of
    ``config.json``, else ``model.eos_token_id`` of ``genai_config.json`` (files beside the model, as
    Hugging Face's generate reads them); "auto" (the usual end tokens) when none of them names one."""
    p = Path(model_path)
    d = p if p.is_dir() else p.parent
    for name in ("generation_config.json", "config.json"):
        ids = _ids(_json(d / name).get("eos_token_id"))
        if ids:
            return sorted(set(ids))
    ids = _ids(_json(d / "genai_config.json").get("model", {}).get("eos_token_id"))
    return sorted(set(ids)) if ids else "auto"


def model_positions(model_path) -> int | None:
    """The positions the model takes: the smaller of ``max_position_embeddings`` (config.json) and
    ``model.context_length`` (genai_config.json) beside it; None when neither names one."""
    p = Path(model_path)
    d = p if p.is_dir() else p.parent
    vals = [_json(d / "config.json").get("max_position_embeddings"),
            (_json(d / "genai_config.json").get("model") or {}).get("context_length")]
    vals = [int(v) for v in vals if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min(vals) if vals else None


# --------------------------------------------------------------------------- chat template
def chat_template(model_path, tokenizer_path=None) -> tuple[str, Path] | None:
    """(template, the file it came from): ``chat_template.jinja`` or ``tokenizer_config.json``'s
    ``chat_template`` (a string, or a list of named templates: the one named "default") in the
    tokenizer's directory (``tokenizer_path``, when given) or the model's; None when there is none."""
    dirs = []
    for q in (tokenizer_path, model_path):
        if q is None:
            continue
        q = Path(q)
        d = q if q.is_dir() else q.parent
        if d not in dirs:
            dirs.append(d)
    for d in dirs:
        f = d / "chat_template.jinja"
        if f.is_file():
            return f.read_text(encoding="utf-8"), f
        cfg = d / "tokenizer_config.json"
        t = _json(cfg).get("chat_template")
        if isinstance(t, list):
            t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
        if isinstance(t, str) and t.strip():
            return t, cfg
    return None


def special_tokens(model_path, tokenizer_path=None) -> dict[str, str]:
    """bos_token, eos_token, ... of tokenizer_config.json (a template may print them)."""
    out: dict[str, str] = {}
    for q in (model_path, tokenizer_path):  # the tokenizer's directory last: it wins
        if q is None:
            continue
        q = Path(q)
        cfg = _json((q if q.is_dir() else q.parent) / "tokenizer_config.json")
        for k, v in cfg.items():
            if k.endswith("_token") and k != "chat_template":
                v = v.get("content") if isinstance(v, dict) else v
                if isinstance(v, str):
                    out[k] = v
    return out


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True, **special) -> str:
    """The chat template rendered as Hugging Face's ``apply_chat_template`` renders it: jinja2's
    sandboxed environment with trim_blocks, lstrip_blocks and loop controls, ``raise_exception``,
    ``strftime_now`` and a ``tojson`` that keeps non-ASCII characters; ``special`` (bos_token,
    eos_token, ...) are template variables. A template error raises ValueError with its message."""
    from datetime import datetime

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **special)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template: {e}") from None


# --------------------------------------------------------------------------- sampling
@dataclass
class Sampling:
    """Greedy (``temperature`` 0, the default) or sampling from softmax(logits / temperature) after
    top-k (0: all tokens) and top-p (nucleus: the fewest most likely tokens whose probability
    reaches ``top_p``; 1: all). ``seed`` makes a sampled sequence reproducible (None: a fresh one)."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"]
        if self.top_k:
            parts.append(f"top-k {self.top_k}")
        if self.top_p < 1.0:
            parts.append(f"top-p {self.top_p:g}")
        return "sampling " + ", ".join(parts) + f", seed {self.seed}"


class Sampler:
    """Picks the next token from one row of logits by a :class:`Sampling` (its own random stream)."""
    PARTIAL = 1024  # top-p over the 1024 most likely tokens first (a full sort of a 49k vocab costs ~3 ms)

    def __init__(self, sampling: Sampling | None = None):
        self.s = sampling or Sampling()
        self.rng = np.random.default_rng(self.s.seed)

    def __call__(self, logits) -> int:
        s = self.s
        if s.greedy or s.top_k == 1:
            return int(np.argmax(np.asarray(logits).reshape(-1)))
        z = np.asarray(logits, dtype=np.float64).reshape(-1)
        z = z / s.temperature
        V = z.size
        if 0 < s.top_k < V:
            idx = np.argpartition(-z, s.top_k - 1)[: s.top_k]
        else:
            idx = None
        zc = z if idx is None else z[idx]
        m = np.max(zc)
        if not np.isfinite(m):
            raise ValueError("sampling: the logits are not finite")
        p = np.exp(zc - m)
        p /= p.sum()
        if s.top_p < 1.0:
            order = None
            if p.size > self.PARTIAL:  # exact when the most likely PARTIAL tokens already reach top_p
                part = np.argpartition(-p, self.PARTIAL - 1)[: self.PARTIAL]
                if p[part].sum() >= s.top_p:
                    order = part[np.lexsort((part, -p[part]))]
            if order is None:
                order = np.lexsort((np.arange(p.size), -p))
            c = np.cumsum(p[order])  # p sums to 1 over every candidate: the fewest whose mass reaches top_p
            keep = order[: min(int(np.searchsorted(c, s.top_p)) + 1, order.size)]
        else:
            keep = np.arange(p.size)
        pk = p[keep]
        c = np.cumsum(pk)
        j = int(np.searchsorted(c, self.rng.random() * c[-1], side="right"))
        j = min(j, keep.size - 1)
        tok = keep[j]
        return int(tok if idx is None else idx[tok])


# --------------------------------------------------------------------------- streamed text
class TextStream:
    """Incremental detokenization: :meth:`push` ids, get the new text. The text of a window starting
    one decoded piece back is compared with the same window without the new ids (so a decoder that
    treats a sequence's first token specially, e.g. sentencepiece's leading space, sees the same
    start in both); a delta ending in U+FFFD (an incomplete UTF-8 sequence) is held back until the
    character is complete. The pieces add up to ``tokenizer.decode(ids, skip_special_tokens)``."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def _decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=self.skip) if ids else ""

    def push(self, ids) -> str:
        self.ids.extend(int(i) for i in ([ids] if isinstance(ids, (int, np.integer)) else ids))
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd") and now.startswith(before):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        """What is still held back (an incomplete character at the end is printed as U+FFFD)."""
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return now[len(before):] if now.startswith(before) else now


# --------------------------------------------------------------------------- the loop
_CACHE_INPUTS = {"GroupQueryAttention": (3, 4), "PackedAttention": (4, 5)}


def shares_kv(model_path) -> bool | None:
    """Whether every state input of the model file is the past cache of a GroupQueryAttention node
    (inputs 3, 4) or a cache-mode PackedAttention node (inputs 4, 5; kv_quant not none) — the graphs
    whose past and present can be one buffer; None when the file cannot be read."""
    import onnx
    from onnx import helper

    if model_path is None or isinstance(model_path, (bytes, bytearray)):
        return None
    p = Path(model_path)
    p = p / "model.onnx" if p.is_dir() else p
    try:
        proto = onnx.load(str(p), load_external_data=False)
    except Exception:
        return None
    g = proto.graph
    init = {i.name for i in g.initializer}
    io = ModelIO.from_model(proto)
    states = set(io.past_to_present)
    if not states:
        return False
    cache = set()
    for n in g.node:
        if n.op_type not in _CACHE_INPUTS:
            continue
        if n.op_type == "PackedAttention":
            kvq = next((helper.get_attribute_value(a) for a in n.attribute if a.name == "kv_quant"), b"none")
            if (kvq.decode() if isinstance(kvq, bytes) else kvq) == "none":
                continue
        for i in _CACHE_INPUTS[n.op_type]:
            if i < len(n.input) and n.input[i] and n.input[i] not in init:
                cache.add(n.input[i])
    return states <= cache


class Decoder:
    """One sequence through the model: :meth:`feed` token ids (the prompt, in chunks, then one token
    at a time), get the logits of the last one. ``loop`` is "shared", "growing" or "rerun" (module
    docstring); ``max_len`` bounds the shared buffers (prompt + new tokens). ``shared``: None decides from the graph
    (``model_path``, else the file the session was made from; neither: the growing loop)."""

    def __init__(self, sess, io: ModelIO, max_len: int, model_path=None, shared: bool | None = None):
        from .shared_kv import SharedKV, SharedKVError

        self.sess, self.io, self.max_len = sess, io, int(max_len)
        self.kv = None
        self.past, self.length, self.seq = None, 0, []
        # the prompt may go in several runs when every state is a KV cache; a stateful gate's state
        # (EventGatedMatMul's past_event.*: duty cycle, event steps) counts runs, so it gets one
        self.chunkable = io.has_past and all(n.startswith("past_key_values.") for n in io.past_to_present)
        if not io.has_past:
            self.loop = "rerun"
            return
        if shared is None:  # from the graph: a concatenating graph would fail its first shared run (ORT logs it)
            shared = bool(shares_kv(model_path if model_path is not None else getattr(sess, "_model_path", None)))
        self.loop = "growing"
        if shared:
            try:
                self.kv = SharedKV(sess, io, max_len=self.max_len)
                self.loop = "shared"
            except SharedKVError:
                self.kv = None

    # -- the state as a prompt cache sees it (runtime.prompt_cache) ------------------------------------
    def cache_problem(self) -> str | None:
        """Why this model's state cannot go in a prompt cache; None when it can (every state a KV cache)."""
        if self.loop == "rerun":
            return ("the model has no state to cache (no past_key_values inputs: it runs the whole sequence "
                    "again for every token)")
        if not self.chunkable:
            other = next(n for n in self.io.past_to_present if not n.startswith("past_key_values."))
            return (f"the model's state {other} is not a KV cache (a gate's state counts runs, so the prompt "
                    "must go in one run): only KV caches can be cached")
        return None

    def state_rows(self, n: int) -> dict[str, np.ndarray]:
        """Views of every state's first ``n`` positions (``n`` ≤ the tokens fed so far; no copy)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"{n} rows asked, {self.length} tokens fed")
        if self.kv is not None:
            return self.kv.rows(n)
        if self.past is None:
            return {k: v[self.io.seq_index(k, v.ndim, 0, 0)] for k, v in self.io.empty_state(1).items()}
        return {k: v[self.io.seq_index(k, v.ndim, 0, n)] for k, v in self.past.items()}

    def restore(self, n: int, read: Callable[[dict[str, np.ndarray]], None]) -> None:
        """Start after ``n`` tokens whose state comes from elsewhere: ``read(dest)`` fills ``dest``, every
        state's first ``n`` positions (views of the shared buffers, or new arrays for the growing loop)."""
        if self.length or self.cache_problem():
            raise ValueError("restore: a fresh decoder over KV caches only")
        if self.kv is not None:
            read(self.kv.rows(n))
            self.kv.length = int(n)
        else:
            dest = {k: np.empty(self.io.state_dims(k, 1, n), dtype=self.io.state_types[k]) for k in self.io.past_to_present}
            read(dest)
            self.past = dest if n else None
        self.length = int(n)

    def feed(self, ids, more: bool = False) -> np.ndarray:
        """Run ``ids`` (a list or 1-D array) after the tokens fed so far; the last row's logits [V].
        ``more``: a later feed continues this prompt (its last rows are not where a reply is read:
        PackedAttention's sparse prefill gives them no exact tail)."""
        from .shared_kv import PREFILL_CHUNK, SharedKVError

        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        name = self.io.logits_name
        if self.loop == "rerun":
            self.seq.extend(int(i) for i in ids[0])
            out = run(self.sess, self.io, feeds(self.io, np.asarray([self.seq], dtype=np.int64)))
            self.length = len(self.seq)
            return out[name][0, -1]
        if self.kv is not None:
            try:
                logits = (self.kv.prefill(ids, chunk=PREFILL_CHUNK, more=more) if self.length == 0
                          else self.kv.step(ids, more=more))
                self.length = self.kv.length
                return logits[0, -1]
            except SharedKVError:
                if self.kv._ran:
                    raise
                # the graph concatenates: run it the plain way (rows restored from a prompt cache move along)
                self.past = ({n: np.ascontiguousarray(a) for n, a in self.kv.rows(self.length).items()}
                             if self.length else None)
                self.kv, self.loop = None, "growing"
        with prompt_continues(more):
            out = run(self.sess, self.io, feeds(self.io, ids, self.past, self.length))
        self.past = self.io.next_state(out)
        self.length += ids.shape[1]
        return out[name][0, -1]


# --------------------------------------------------------------------------- generate
@dataclass
class Generation:
    """What :func:`generate` returns; unpacks as ``text, ids`` (the new ids, an eos included)."""
    text: str
    ids: list[int]
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0          # decode steps: each fed one token and gave the next
    decode_seconds: float = 0.0     # their wall time (model run, sampling, streaming)
    loop: str = ""
    stop: str = ""                  # "eos" | "max_new_tokens" | "context"
    sampling: str = "greedy"
    extra: dict = field(default_factory=dict)
    ttft_seconds: float = 0.0       # time to first token: tokenization, prompt cache load, prefill, first token
    cached_tokens: int = 0          # prompt tokens whose state came from the prompt cache (not prefilled)
    cache: "CacheInfo | None" = None  # what was done with the prompt cache (runtime.prompt_cache.CacheInfo)

    def __iter__(self):
        return iter((self.text, self.ids))

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens run through the model (those not loaded from a prompt cache)."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def prefill_tok_s(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    def summary(self) -> str:
        """The closing line: time to first token, prompt tokens, prefill time and rate, decode tokens and
        rate, and what the prompt cache did."""
        dec = (f"decode {self.decode_tokens:,} tokens in {self.decode_seconds:.2f} s ({self.decode_tok_s:.1f} tok/s)"
               if self.decode_tokens else "decode 0 tokens")
        if self.cached_tokens:
            pre = (f"prompt {self.prompt_tokens:,} tokens: {self.cached_tokens:,} from the prompt cache, "
                   f"{self.prefilled_tokens:,} prefilled in {self.prefill_seconds:.2f} s ({self.prefill_tok_s:.1f} tok/s)")
        else:
            pre = (f"prompt {self.prompt_tokens:,} tokens, prefill {self.prefill_seconds:.2f} s "
                   f"({self.prefill_tok_s:.1f} tok/s)")
        cache = f"; {self.cache.describe()}" if self.cache is not None else ""
        return (f"time to first token {self.ttft_seconds:.2f} s; {pre}; {dec}; {len(self.ids)} new tokens, "
                f"stop: {self.stop}{cache}; {self.sampling}; {self.loop} loop")


def _prompt_ids(tokenizer, prompt, add_special_tokens: bool, cache_prefix) -> tuple[list[int], int]:
    """The prompt's ids and how many of its first tokens a prompt cache holds (module prompt_cache)."""
    from .prompt_cache import prefix_tokens

    if isinstance(prompt, str):
        enc = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        ids = list(enc.ids)
        if cache_prefix is None or isinstance(cache_prefix, str):
            if isinstance(cache_prefix, str) and not prompt.startswith(cache_prefix):
                raise ValueError("cache_prefix: the prompt does not start with it")
            boundary = len(prompt) if cache_prefix is None else len(cache_prefix)
            return ids, prefix_tokens(enc, boundary) if hasattr(enc, "offsets") else max(len(ids) - 1, 0)
    else:
        ids = [int(x) for x in prompt]
        if isinstance(cache_prefix, str):
            raise ValueError("cache_prefix: text needs a text prompt (give a token count with token ids)")
        if cache_prefix is None:
            return ids, max(len(ids) - 1, 0)
    n = int(cache_prefix)
    if not 0 <= n <= len(ids):
        raise ValueError(f"cache_prefix: {n} tokens, the prompt has {len(ids)}")
    return ids, n


def _load_cache(pc, dec: Decoder, io: ModelIO, ids: list[int], model_path):
    """Restore the decoder from the prompt cache file: the tokens it starts with (CacheInfo)."""
    from .prompt_cache import TAIL_SLACK, CacheInfo, PromptCacheError, open_cache

    t0 = time.perf_counter()
    with open_cache(pc.path, model_path, io) as f:
        cached = f.tokens()
        m = len(cached)
        agree = next((i for i, (a, b) in enumerate(zip(cached, ids)) if a != b), min(m, len(ids)))
        if agree < min(m, len(ids)) and agree < m - min(TAIL_SLACK, m // 4):
            raise PromptCacheError(pc.path, f"written for another prompt: this one does not start with its {m:,} "
                                            f"tokens (they differ from token {agree:,})")
        use = min(agree, len(ids) - 1)
        dec.restore(use, lambda dest: f.read_states(dest, use))
    return CacheInfo(pc.path, "loaded", use, m, f.bytes, time.perf_counter() - t0)


def generate(sess, io: ModelIO, tokenizer, prompt, max_new_tokens: int = 32, eos="auto",
             add_special_tokens: bool = True, *, sampling: Sampling | None = None,
             on_text: Callable[[str], None] | None = None, prefill_chunk: int = PREFILL_CHUNK,
             max_length: int | None = None, model_path=None, shared: bool | None = None,
             prompt_cache=None, cache_prefix: str | int | None = None) -> Generation:
    """Generate up to ``max_new_tokens`` after ``prompt`` (text, encoded with ``add_special_tokens``,
    or a list of ids). ``eos``: "auto" (the usual end tokens the tokenizer knows), an id, a token
    string, a list of ids (:func:`model_eos_ids` gives the model's own), or None; generation stops
    after an eos token (in ``ids``, not in ``text``). ``sampling``: greedy when None. ``on_text`` gets
    the text as it is decoded (pieces that add up to ``text``). ``max_length``: the model's positions
    (prompt + new tokens stop there; a longer prompt is an error). ``model_path`` (the model file)
    lets the loop see the graph (shared K/V buffers where it allows: module docstring); ``shared``
    forces it on or off.

    ``prompt_cache``: a file path or a :class:`runtime.prompt_cache.PromptCache` (``refresh=True``:
    rebuild it). When the file exists, the prompt must start with the tokens it holds (only the last
    ``TAIL_SLACK`` of them, at most a quarter, may differ): their state is loaded and only the rest is
    prefilled; otherwise the prompt's first tokens — ``cache_prefix``: the shared beginning of a text
    prompt (a document; the tokens ending by its end, less the last), or a token count; by default the
    whole prompt less its last token — are saved to it after the first token (atomically).
    A file that cannot be used raises :class:`runtime.prompt_cache.PromptCacheError` (nothing
    changed). ``model_path`` is needed then: the file is bound to the model."""
    from .prompt_cache import PromptCache, PromptCacheError, save

    t_start = time.perf_counter()
    if io.kind != "causal-lm" or not io.logits_name:
        raise ValueError("generate needs a causal LM with a logits output")
    ids, n_save = _prompt_ids(tokenizer, prompt, add_special_tokens, cache_prefix)
    if not ids:
        raise ValueError("empty prompt")
    if max_length is not None and len(ids) >= max_length:
        raise ValueError(f"the prompt has {len(ids):,} tokens: the model takes at most {max_length:,} positions "
                         "(prompt + new tokens)")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    room = max_new_tokens if max_length is None else min(max_new_tokens, max_length - len(ids))
    stop = _eos_ids(tokenizer, eos)
    if sampling is not None and not sampling.greedy and sampling.seed is None:  # a seed anyone can rerun
        sampling = replace(sampling, seed=secrets.randbits(32))
    sampler = Sampler(sampling)
    stream = TextStream(tokenizer)
    dec = Decoder(sess, io, max_len=len(ids) + room, model_path=model_path, shared=shared)

    pc = None if prompt_cache is None else (prompt_cache if isinstance(prompt_cache, PromptCache)
                                            else PromptCache(prompt_cache))
    info, pending = None, False
    if pc is not None:
        if model_path is None:
            model_path = getattr(sess, "_model_path", None)
        if model_path is None or isinstance(model_path, (bytes, bytearray)):
            raise ValueError("prompt_cache: pass model_path (the model file the cache is bound to)")
        problem = dec.cache_problem()
        if problem:
            raise PromptCacheError(pc.path, problem, refresh_helps=False)
        if pc.path.exists() and not pc.refresh:
            info = _load_cache(pc, dec, io, ids, model_path)
        else:
            pending = True

    start = dec.length
    chunk = prefill_chunk if dec.chunkable else len(ids)
    # chunks end at multiples of the chunk size, counted from the sequence's start: a run that starts
    # from a prompt cache makes the runs a run without one makes, past the cached tokens
    ends = list(range((start // chunk + 1) * chunk, len(ids), chunk)) + [len(ids)]
    t0 = time.perf_counter()
    for c0, c1 in zip([start] + ends[:-1], ends):
        logits = dec.feed(ids[c0:c1], more=c1 < len(ids))
    prefill = time.perf_counter() - t0

    new: list[int] = []
    why = "max_new_tokens"
    t1 = time.perf_counter()
    steps = 0
    ttft = None
    saved = 0.0

    def write_cache():
        nonlocal info, pending, saved
        pending = False
        t = time.perf_counter()
        info = save(pc.path, model_path, io, ids[:n_save], dec.state_rows(n_save))
        saved += time.perf_counter() - t

    while True:
        nxt = sampler(logits)
        new.append(nxt)
        if ttft is None:
            ttft = time.perf_counter() - t_start
        if nxt in stop:
            why = "eos"
            break
        if on_text is not None:
            piece = stream.push(nxt)
            if piece:
                on_text(piece)
        if pending:  # after the first token is out; decode steps write only rows past the prompt
            write_cache()
        if len(new) >= room:
            why = "context" if room < max_new_tokens else "max_new_tokens"
            break
        logits = dec.feed([nxt])
        steps += 1
    if pending:
        write_cache()
    decode = time.perf_counter() - t1 - saved if steps else 0.0
    if on_text is not None:
        rest = stream.flush()
        if rest:
            on_text(rest)
    text_ids = [i for i in new if i not in stop]
    return Generation(text=tokenizer.decode(text_ids, skip_special_tokens=True), ids=new, prompt_tokens=len(ids),
                      prefill_seconds=prefill, decode_tokens=steps, decode_seconds=decode, loop=dec.loop,
                      stop=why, sampling=(sampling or Sampling()).describe(), ttft_seconds=ttft,
                      cached_tokens=start, cache=info)
