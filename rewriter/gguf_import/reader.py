"""A GGUF file as ``ortlean import`` reads it: its metadata (the model's hyper-parameters, the tokenizer's
vocabulary), its tensors' places in the file, and the checks that make every bad input one line naming
the file and the problem before anything is written.

The file is read with the ``gguf`` package (``gguf.GGUFReader``, ggml's own reader); only what the import
needs is kept (the reader's per-element metadata — ~0.5 GB for a 151k-token vocabulary — is dropped once
read), and the tensors stay in the file's memory map: :meth:`GGUFFile.rows` is a view of a tensor's bytes,
:meth:`GGUFFile.release` gives the pages read back to the page cache."""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import OrtleanError

ARCHS = ("llama", "qwen2", "gemma3")
# ggml type -> BlockQuantMatMul's format (the formats the op runs)
BQ_FORMATS = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q8_0": "q8_0",
              "Q4_K": "q4_K", "Q5_K": "q5_K", "Q6_K": "q6_K"}
FLOAT_TYPES = ("F32", "F16", "BF16")
# metadata arrays read into Python lists (the tokenizer's vocabulary)
_VOCAB_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")


class GGUFImportError(OrtleanError):
    """A GGUF ``ortlean import`` cannot read or does not support; the message names the file and the problem."""


@dataclass
class TensorInfo:
    """One tensor of the file: ggml's shape ``ne`` (ne[0] contiguous: a weight's K, then N), its type, and
    where its bytes are (absolute file offset, length)."""
    name: str
    type_name: str          # ggml type name: "Q4_K", "F32", ...
    ne: tuple
    offset: int
    nbytes: int

    @property
    def format(self) -> str | None:
        """BlockQuantMatMul's format, None for a float or another type."""
        return BQ_FORMATS.get(self.type_name)

    @property
    def is_float(self) -> bool:
        return self.type_name in FLOAT_TYPES

    @property
    def shape_text(self) -> str:
        return "[" + ", ".join(str(x) for x in self.ne) + "]"


@dataclass
class HParams:
    """The model's hyper-parameters, from the ``{arch}.*`` metadata (llama.cpp's keys and defaults)."""
    arch: str
    n_layers: int
    hidden: int
    ffn: int
    n_head: int
    n_kv: int
    head_dim: int
    eps: float
    rope_base: float
    rope_base_local: float | None      # Gemma 3's sliding-window layers (llama.cpp: 10000)
    rope_linear: float                  # linear rope scaling factor (1: none)
    context: int
    vocab: int
    sliding_window: int                 # 0: none
    global_layers: tuple                # layers without the sliding window (all when none)
    attn_scale: float | None            # None: 1/sqrt(head_dim), GroupQueryAttention's default
    name: str = ""
    extra: dict = field(default_factory=dict)


def _fail(path: Path, msg: str) -> GGUFImportError:
    return GGUFImportError(f"{path}: {msg}")


def _line(e: Exception, limit: int = 200) -> str:
    """An exception's text on one line (the error is one line on stderr), at most ``limit`` characters."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


class GGUFFile:
    """The parts of a GGUF ``ortlean import`` uses. Raises :class:`GGUFImportError` on a file the ``gguf``
    package cannot read (not a GGUF, truncated, corrupt header) or whose tensors lie outside the file."""

    def __init__(self, path):
        import gguf

        self.path = Path(path)
        if not self.path.exists():
            raise _fail(self.path, "no such file")
        if self.path.is_dir():
            raise _fail(self.path, "is a directory, expected a .gguf file")
        self.file_bytes = self.path.stat().st_size
        try:
            reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as e:          # ValueError (magic, version), struct / index errors on a cut header
            raise _fail(self.path, f"not a GGUF file the gguf package can read ({type(e).__name__}: {_line(e)}); "
                                   "truncated or corrupt?") from None
        if getattr(reader, "byte_order", "I") != "I":
            raise _fail(self.path, "a big-endian GGUF (ortlean import reads little-endian files)")
        self.meta: dict = {}
        self.vocab: dict[str, list] = {}
        try:
            for key, f in reader.fields.items():
                if not f.types:
                    continue
                if f.types[0] == gguf.GGUFValueType.ARRAY:
                    if key in _VOCAB_KEYS:
                        self.vocab[key] = self._array(f, gguf)
                    elif len(f.data) <= 4096:
                        self.meta[key] = self._array(f, gguf)
                    else:
                        self.meta[key] = None       # a large array the import does not read
                else:
                    v = f.parts[f.data[0]]
                    self.meta[key] = (bytes(v).decode("utf-8", "replace") if f.types[0] == gguf.GGUFValueType.STRING
                                      else v[0].item())
            self.tensors: dict[str, TensorInfo] = {}
            for t in reader.tensors:
                ne = tuple(int(x) for x in t.shape)
                self.tensors[t.name] = TensorInfo(t.name, t.tensor_type.name, ne, int(t.data_offset), int(t.n_bytes))
        except GGUFImportError:
            raise
        except Exception as e:
            raise _fail(self.path, f"corrupt GGUF metadata ({type(e).__name__}: {_line(e)})") from None
        self._map = reader.data         # np.memmap of the whole file
        del reader
        for t in self.tensors.values():
            if t.offset + t.nbytes > self.file_bytes:
                raise _fail(self.path, f"tensor {t.name} ends at byte {t.offset + t.nbytes:,}, the file has "
                                       f"{self.file_bytes:,} (truncated?)")

    @staticmethod
    def _array(f, gguf) -> list:
        sub = f.types[1] if len(f.types) > 1 else None
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data]
        return [f.parts[i][0].item() for i in f.data]

    # ------------------------------------------------------------------ data
    def rows(self, name: str) -> np.ndarray:
        """A quantized 2-D tensor's bytes as uint8 [N, row_bytes] (a view of the memory map)."""
        t = self.tensors[name]
        N = int(np.prod(t.ne[1:])) if len(t.ne) > 1 else 1
        return np.asarray(self._map[t.offset:t.offset + t.nbytes]).reshape(N, -1)

    def floats(self, name: str) -> np.ndarray:
        """A tensor as float32 in ggml's order reversed (numpy shape ne[::-1]): F32 as stored, F16 / BF16
        widened, a quantized type dequantized (``gguf.quants.dequantize``)."""
        from gguf import GGMLQuantizationType, quants

        t = self.tensors[name]
        raw = np.asarray(self._map[t.offset:t.offset + t.nbytes])
        shape = tuple(reversed(t.ne))
        if t.type_name == "F32":
            out = raw.view(np.float32).reshape(shape).copy()
        elif t.type_name == "F16":
            out = raw.view(np.float16).reshape(shape).astype(np.float32)
        else:
            rows = raw.reshape(int(np.prod(shape[:-1])) if len(shape) > 1 else 1, -1)
            out = np.asarray(quants.dequantize(rows, GGMLQuantizationType[t.type_name]), np.float32).reshape(shape)
        self.release(name)
        return out

    def release(self, name: str | None = None) -> None:
        """Drop this process's resident pages of one tensor (all when None): read-only file pages go back
        to the page cache (``MADV_DONTNEED``), views stay valid."""
        mm = getattr(self._map, "_mmap", None)
        if mm is None or getattr(mm, "closed", False) or not hasattr(mm, "madvise"):
            return
        if name is None:
            start, length = 0, len(mm)
        else:
            t = self.tensors[name]
            start = (t.offset // mmap.PAGESIZE) * mmap.PAGESIZE
            length = min(len(mm), t.offset + t.nbytes) - start
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, max(0, length))
        except (OSError, ValueError):
            pass

    # ------------------------------------------------------------------ metadata
    def get(self, key: str, default=None):
        v = self.meta.get(key)
        return default if v is None else v

    def need_int(self, key: str) -> int:
        v = self.meta.get(key)
        if isinstance(v, list):
            raise _fail(self.path, f"metadata {key} is an array of {len(v)} values (per-layer values are not "
                                   "supported by ortlean import)")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or int(v) != v or int(v) <= 0:
            raise _fail(self.path, f"metadata {key} missing or not a positive integer (got {v!r})")
        return int(v)

    def opt_int(self, key: str, default: int) -> int:
        return default if self.meta.get(key) is None else self.need_int(key)

    def opt_float(self, key: str, default: float) -> float:
        v = self.meta.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise _fail(self.path, f"metadata {key} is not a positive number (got {v!r})")
        return float(v)

    def hparams(self) -> HParams:
        """The hyper-parameters of a supported architecture; refuses another architecture and values the
        fused graph cannot hold (per-layer head counts, partial rotary, head_dim not a multiple of 16 …)."""
        arch = self.meta.get("general.architecture")
        if not isinstance(arch, str):
            raise _fail(self.path, "no general.architecture in the metadata (not a model GGUF?)")
        if arch not in ARCHS:
            raise _fail(self.path, f"architecture {arch!r} is not supported by ortlean import (it imports "
                                   f"{', '.join(ARCHS)})")
        a = arch
        n_layers = self.need_int(f"{a}.block_count")
        hidden = self.need_int(f"{a}.embedding_length")
        ffn = self.need_int(f"{a}.feed_forward_length")
        n_head = self.need_int(f"{a}.attention.head_count")
        n_kv = self.opt_int(f"{a}.attention.head_count_kv", n_head)
        if n_head % n_kv:
            raise _fail(self.path, f"{n_head} attention heads are not a multiple of {n_kv} KV heads")
        head_dim = self.opt_int(f"{a}.attention.key_length", hidden // n_head)
        vdim = self.opt_int(f"{a}.attention.value_length", head_dim)
        if vdim != head_dim:
            raise _fail(self.path, f"value heads of {vdim} and key heads of {head_dim} (GroupQueryAttention "
                                   "takes one head size)")
        if head_dim % 16:
            raise _fail(self.path, f"head_dim {head_dim} is not a multiple of 16 (ONNX Runtime's CPU "
                                   "GroupQueryAttention requires it)")
        rot = self.opt_int(f"{a}.rope.dimension_count", head_dim)
        if rot != head_dim:
            raise _fail(self.path, f"rotary over {rot} of {head_dim} head dims (partial rotary is not supported "
                                   "by ortlean import)")
        eps = self.opt_float(f"{a}.attention.layer_norm_rms_epsilon", 0.0)
        if eps == 0.0:
            raise _fail(self.path, f"metadata {a}.attention.layer_norm_rms_epsilon missing")
        rope_base = self.opt_float(f"{a}.rope.freq_base", 10000.0)
        scaling = self.meta.get(f"{a}.rope.scaling.type")
        factor = self.opt_float(f"{a}.rope.scaling.factor", 1.0)
        if scaling in (None, "none") or factor == 1.0:
            linear = 1.0
        elif scaling == "linear":
            linear = factor
        else:
            raise _fail(self.path, f"rope scaling {scaling!r} is not supported by ortlean import (none, linear)")
        context = self.need_int(f"{a}.context_length")
        tokens = self.vocab.get("tokenizer.ggml.tokens") or []
        emb = self.tensors.get("token_embd.weight")
        vocab = self.opt_int(f"{a}.vocab_size", len(tokens) or (emb.ne[1] if emb is not None and len(emb.ne) == 2 else 0))
        if vocab <= 0:
            raise _fail(self.path, "vocabulary size unknown (no tokenizer.ggml.tokens, no token_embd.weight)")
        window, global_layers, base_local, scale = 0, tuple(range(n_layers)), None, None
        if arch == "gemma3":
            window = self.opt_int(f"{a}.attention.sliding_window", 0)
            pattern = self.opt_int(f"{a}.attention.sliding_window_pattern", 6)   # llama.cpp: every 6th layer global
            global_layers = tuple(i for i in range(n_layers) if (i + 1) % pattern == 0) if window else global_layers
            base_local = 10000.0                    # llama.cpp's rope_freq_base_train_swa for Gemma 3
            if n_layers == 62:                      # Gemma 3 27B: query_pre_attn_scalar = hidden / heads
                scale = 1.0 / math.sqrt(hidden / n_head)
        return HParams(arch=arch, n_layers=n_layers, hidden=hidden, ffn=ffn, n_head=n_head, n_kv=n_kv,
                       head_dim=head_dim, eps=eps, rope_base=rope_base, rope_base_local=base_local, rope_linear=linear,
                       context=context, vocab=vocab, sliding_window=window, global_layers=global_layers,
                       attn_scale=scale, name=str(self.meta.get("general.name") or self.path.stem))


# --------------------------------------------------------------------------- the tensors an architecture holds
def expected_tensors(hp: HParams) -> tuple[dict[str, tuple], set[str]]:
    """({name: ggml shape ne} of the tensors a model of ``hp`` must hold, {names it may hold}) in
    llama.cpp's naming (``token_embd``, ``blk.N.attn_q`` …)."""
    D, F, V = hp.hidden, hp.ffn, hp.vocab
    q, kv = hp.n_head * hp.head_dim, hp.n_kv * hp.head_dim
    need = {"token_embd.weight": (D, V), "output_norm.weight": (D,)}
    may = {"output.weight": (D, V), "rope_freqs.weight": (hp.head_dim // 2,)}
    for i in range(hp.n_layers):
        b = f"blk.{i}"
        need.update({f"{b}.attn_norm.weight": (D,), f"{b}.attn_q.weight": (D, q), f"{b}.attn_k.weight": (D, kv),
                     f"{b}.attn_v.weight": (D, kv), f"{b}.attn_output.weight": (q, D), f"{b}.ffn_norm.weight": (D,),
                     f"{b}.ffn_gate.weight": (D, F), f"{b}.ffn_up.weight": (D, F), f"{b}.ffn_down.weight": (F, D)})
        biases = {f"{b}.attn_q.bias": (q,), f"{b}.attn_k.bias": (kv,), f"{b}.attn_v.bias": (kv,)}
        if hp.arch == "qwen2":
            need.update(biases)
        else:
            may.update(biases)
        may[f"{b}.attn_output.bias"] = (D,)
        if hp.arch == "gemma3":
            need.update({f"{b}.attn_q_norm.weight": (hp.head_dim,), f"{b}.attn_k_norm.weight": (hp.head_dim,),
                         f"{b}.post_attention_norm.weight": (D,), f"{b}.post_ffw_norm.weight": (D,)})
    return {**need, **{k: v for k, v in may.items() if k not in need}}, set(need)


def check_tensors(gf: GGUFFile, hp: HParams) -> None:
    """Every tensor the architecture needs is there with its shape and a type the import runs, and no
    tensor is left over (a GGUF whose names do not match is refused, naming the first mismatch)."""
    shapes, required = expected_tensors(hp)
    p = gf.path
    for name in sorted(required, key=_tensor_order):
        if name not in gf.tensors:
            raise _fail(p, f"tensor {name} missing: a {hp.arch} GGUF of {hp.n_layers} blocks holds it (tensor names "
                           "do not match llama.cpp's for this architecture)")
    for name, t in gf.tensors.items():
        if name not in shapes:
            raise _fail(p, f"tensor {name} ({t.type_name} {t.shape_text}) is not part of a {hp.arch} model as "
                           "ortlean import reads it (tensor names do not match llama.cpp's for this architecture)")
        want = shapes[name]
        if t.ne != want:
            raise _fail(p, f"tensor {name} has shape {t.shape_text}, a {hp.arch} model with these hyper-parameters "
                           f"needs [{', '.join(map(str, want))}]")
        if len(want) == 1 and not t.is_float:
            raise _fail(p, f"tensor {name} is {t.type_name}: ortlean import reads 1-D tensors as F32, F16 or BF16")
        if len(want) == 2 and t.format is None and not t.is_float:
            raise _fail(p, f"tensor {name} is {t.type_name}, a format BlockQuantMatMul does not run (it runs "
                           f"{', '.join(BQ_FORMATS)}; floats stay float)")
    if "rope_freqs.weight" in gf.tensors and hp.arch != "llama":
        raise _fail(p, "tensor rope_freqs.weight in a non-llama GGUF")


def _tensor_order(name: str):
    parts = name.split(".")
    return (int(parts[1]) if parts[0] == "blk" else -1, name)
