"""Session I/O of optimum-exported models (dense or rewritten): what a model takes and returns
(`ModelIO`: inputs, outputs, past→present state pairs), the feeds for a token sequence, running a
session into a name→array dict, and the tokenizer next to the model."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

_ONNX_TO_NP = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_, "tensor(int16)": np.int16,
    "tensor(uint16)": np.uint16, "tensor(uint32)": np.uint32, "tensor(uint64)": np.uint64,
}

_PAST_RE = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_PRESENT_RE = re.compile(r"^present\.(\d+)\.(key|value)$")


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
    # PackedAttention's key packing per cache stem ("past_key_values.N" -> the node's mode, eps,
    # eps_heads, pq_book, pq_dims), read from the model file by from_session(model_path): sign and pq
    # key-bits rows have the same width, so the state alone does not say how to pack a key
    key_packing: dict[str, dict] = field(default_factory=dict)

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
    def from_signature(cls, inputs: list[tuple[str, list, Any]], outputs: list[tuple[str, list, Any]]) -> "ModelIO":
        """From (name, shape, numpy type) of every input (initializers excluded) and output; shape
        dims are ints, names of symbolic dims, or None."""
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
        """From a model path (str/Path; external data is not loaded) or an onnx.ModelProto. A path's
        symbolic KV dimensions are resolved from a ``genai_config.json`` beside it (genai builder)."""
        import onnx

        path = None
        if not isinstance(model, onnx.ModelProto):
            path = model
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
        io = cls.from_signature(ins, outs)
        return io.resolve_dims(path) if path is not None else io

    @classmethod
    def from_session(cls, sess, model_path=None) -> "ModelIO":
        """From a session's declared I/O; ``model_path`` (the model file) resolves symbolic KV
        dimensions from a ``genai_config.json`` beside it (genai builder models)."""
        def vi(a):
            shape = [d if isinstance(d, (int, str)) else None for d in (a.shape or [])]
            return a.name, shape, _ONNX_TO_NP.get(a.type, np.float32)

        io = cls.from_signature([vi(a) for a in sess.get_inputs()], [vi(a) for a in sess.get_outputs()])
        if model_path is None:
            return io
        io.key_packing = key_packing(model_path) if any(n.endswith(".key_bits") for n in io.past_to_present) else {}
        return io.resolve_dims(model_path)

    # -- symbolic state dimensions ------------------------------------------------------------
    def _set_kv_dims(self, kv_heads: int | None, head_dim: int | None) -> "ModelIO":
        for n, shape in self.state_shapes.items():
            if not _PAST_RE.match(n) or len(shape) != 4:
                continue
            if kv_heads and not isinstance(shape[1], int):
                shape[1] = int(kv_heads)
            if head_dim and not isinstance(shape[3], int):
                shape[3] = int(head_dim)
        self.kv_heads = self.kv_heads or kv_heads
        self.head_dim = self.head_dim or head_dim
        return self

    def resolve_dims(self, model_path) -> "ModelIO":
        """Fill the KV caches' symbolic head count / head size (the genai builder declares
        ``[batch, kv_heads, past_sequence_length, kv_cache_dim]``) from ``genai_config.json`` next
        to ``model_path`` (``model.decoder.num_key_value_heads`` / ``head_size``); unchanged when
        there is none or nothing is symbolic."""
        import json

        if not self.past_to_present or model_path is None or isinstance(model_path, (bytes, bytearray)):
            return self
        p = Path(model_path)
        cfg = (p if p.is_dir() else p.parent) / "genai_config.json"
        if not cfg.is_file():
            return self
        try:
            dec = json.loads(cfg.read_text())["model"]["decoder"]
            return self._set_kv_dims(int(dec["num_key_value_heads"]), int(dec["head_size"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{cfg}: no model.decoder.num_key_value_heads / head_size ({e})") from None

    def fill_from(self, other: "ModelIO") -> "ModelIO":
        """Symbolic state dimensions taken from ``other`` (the same model before a rewrite)."""
        for n, shape in self.state_shapes.items():
            ref = other.state_shapes.get(n)
            if ref is not None and len(ref) == len(shape):
                for i, (d, r) in enumerate(zip(shape, ref)):
                    if not isinstance(d, int) and isinstance(r, int):
                        shape[i] = r
        self.kv_heads = self.kv_heads or other.kv_heads
        self.head_dim = self.head_dim or other.head_dim
        return self

    # -- states ----------------------------------------------------------------------------
    def state_dims(self, name: str, batch: int, length: int) -> list[int]:
        """The shape of state input ``name`` with ``batch`` rows and ``length`` positions on its
        sequence axis; ValueError naming a symbolic dimension that is neither."""
        dims = []
        for i, d in enumerate(self.state_shapes[name]):
            if i == self.state_seq_axis[name]:
                dims.append(int(length))
            elif i == 0:
                dims.append(int(batch))
            elif isinstance(d, int) and d > 0:
                dims.append(d)
            else:
                raise ValueError(f"state input {name}: dimension {i} is symbolic ({d!r})")
        return dims

    def seq_index(self, name: str, ndim: int, lo: int, hi: int) -> tuple:
        """The index of positions ``lo`` … ``hi - 1`` of an ``ndim``-dimensional state ``name``."""
        ix = [slice(None)] * ndim
        ix[self.state_seq_axis[name]] = slice(lo, hi)
        return tuple(ix)

    def empty_state(self, batch: int = 1) -> dict[str, np.ndarray]:
        """Zero-length past for every state input: [B, kv_heads, 0, head_dim] for KV caches."""
        out = {}
        for n in self.state_shapes:
            try:
                dims = self.state_dims(n, batch, 0)
            except ValueError as e:
                raise ValueError(f"{e}; cannot build an empty initial state (a genai builder model needs its "
                                 "genai_config.json beside it)") from None
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



# GroupQueryAttention's length inputs, when a graph declares them as inputs (older genai builder
# graphs; the current builder computes them from attention_mask inside the graph)
GQA_LENGTH_INPUTS = ("seqlens_k", "total_sequence_length")


def token_range(vocab: int | None) -> tuple[int, int]:
    """[lo, hi) for random token ids (benchmarks, profiles): below ``vocab`` (100 when unknown), from 100
    in a big vocabulary (past the special tokens at its start)."""
    hi = int(vocab or 100)
    return (100 if hi > 1000 else 0), hi


def gqa_lengths(name: str, batch: int, total: int, dtype=np.int32) -> np.ndarray:
    """``seqlens_k`` [B] = total − 1 (the last position of every row) or ``total_sequence_length``
    (a scalar), for sequences of ``total`` tokens from position 0."""
    if name == "seqlens_k":
        return np.full((batch,), total - 1, dtype=dtype)
    return np.asarray(total, dtype=dtype)


def run(sess, io: ModelIO, feed: dict) -> dict[str, np.ndarray]:
    """sess.run returning {output name: array}."""
    vals = sess.run(None, feed)
    return dict(zip([o.name for o in sess.get_outputs()], vals))


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


def text_prefix(tokenizer) -> np.ndarray:
    """The token ids the tokenizer puts before any text (its beginning-of-sequence token: Gemma's
    <bos>, SmolLM2's GGUF tokenizer's <|im_start|>; none for Qwen2's): what a prompt starts with, so
    what every perplexity window of running text starts with (the windows are cut from the middle of
    a text tokenized without special tokens). Measured on Gemma 3 270M, 512-token windows of Persuasion:
    3.71 nats a token with <bos> first, 4.70 without — the model's attention sink is missing."""
    with_sp = list(tokenizer.encode("a", add_special_tokens=True).ids)
    bare = list(tokenizer.encode("a", add_special_tokens=False).ids)
    n = len(with_sp) - len(bare)
    if n <= 0 or with_sp[n:n + len(bare)] != bare:
        return np.zeros(0, np.int64)
    return np.asarray(with_sp[:n], np.int64)


def tokenize(tokenizer, text: str, add_special_tokens: bool = False) -> np.ndarray:
    """Token ids of ``text`` as int64 (no special tokens by default: for perplexity)."""
    return np.asarray(tokenizer.encode(text, add_special_tokens=add_special_tokens).ids, dtype=np.int64)


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
        elif name in GQA_LENGTH_INPUTS:
            out[name] = gqa_lengths(name, b, past_len + t, dt)
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


def key_packing(model_path) -> dict[str, dict]:
    """{cache stem: {mode, eps, eps_heads, pq_book, pq_dims, ksmooth}} of every PackedAttention node of the
    model file (its past_bits input ``<stem>.key_bits``); {} for bytes or no such node."""
    if isinstance(model_path, (bytes, bytearray)):
        return {}
    p = Path(model_path)
    p = p / "model.onnx" if p.is_dir() else p
    if not p.is_file():
        return {}
    import onnx
    from onnx import helper

    out = {}
    for n in onnx.load(str(p), load_external_data=False).graph.node:
        if n.op_type != "PackedAttention" or len(n.input) < 5 or not n.input[4].endswith(".key_bits"):
            continue
        a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        mode = a.get("mode", b"sign")
        out[n.input[4][: -len(".key_bits")]] = {
            "mode": mode.decode() if isinstance(mode, bytes) else mode,
            "eps": float(a.get("eps", 0.0)), "eps_heads": list(a.get("eps_heads", [])),
            "pq_book": list(a.get("pq_book", [])), "pq_dims": list(a.get("pq_dims", [])),
            "ksmooth": list(a.get("ksmooth", []))}
    return out
