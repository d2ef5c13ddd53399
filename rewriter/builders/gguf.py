"""A GGUF file as the source of a model's weights: which block rows of which GGUF tensors a weight
initializer is, bit for bit (``--weights gguf``, ``backends/weights.py``).

    src = GGUFSource("SmolLM2-135M-Instruct.Q4_1.gguf")
    m = src.match(WT)                 # WT [N, K] float32: a MatMul's weight transposed (rows = outputs)
    if m.complete:
        parts = src.assemble(WT, m)   # [Part(format, start, stop, W uint8 [n, row_bytes], ...)], verified

How: every row of every dequantized 2-D GGUF tensor (``gguf.quants.dequantize``, one tensor — and
for large ones one chunk of rows — at a time) is hashed (BLAKE2b of its float32 bytes); only the
hashes are kept, as hash → (tensor, row). A weight's rows are hashed the same way and looked up.
That finds a tensor stored transposed, rows in another order (llama.cpp's q/k permutation: any row
permutation is found), several tensors concatenated (a packed q/k/v or gate/up projection) and any
mix of those, without trying permutations. Rows that occur more than once (all-zero rows, tied
tables) are ties: a tied row takes, in order of preference, a tensor of an op-supported format, a
tensor the weight's unique rows come from, a row not used yet, the row where the weight's other
rows of that tensor put it. Whatever the hashes say, :meth:`GGUFSource.assemble` copies the chosen
block rows and dequantizes them again with the op's numpy reference
(``custom_ops.reference.blockquant``), and compares the float32 bit patterns with the weight's: a
part is returned only when they are equal (``np.array_equal`` on the uint32 views, so -0.0 ≠ 0.0
and a NaN equals only itself). That check is what "bit-exact" in the report rests on.

The file is read with the ``gguf`` package (ggml's own reader, memory-mapped); nothing here parses
GGUF."""
from __future__ import annotations

import hashlib
import mmap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import OrtleanError

# ggml type -> BlockQuantMatMul's `format` (the formats the op runs)
_FORMAT_NAMES = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q8_0": "q8_0",
                 "Q4_K": "q4_K", "Q5_K": "q5_K", "Q6_K": "q6_K"}
_FLOAT_NAMES = ("F32", "F16", "BF16")
# what `--weights gguf,<fallback>` may quantize a weight the GGUF does not hold to with gguf.quants.quantize
QUANTIZABLE = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
_CHUNK_BYTES = 64 << 20          # dequantize a large tensor this many float32 bytes at a time
_DIGEST = 16


def ggml_type(fmt: str):
    """The gguf ``GGMLQuantizationType`` of a BlockQuantMatMul format ("q4_1" -> Q4_1)."""
    from gguf import GGMLQuantizationType

    names = {v: k for k, v in _FORMAT_NAMES.items()}
    return GGMLQuantizationType[names[fmt]]


def format_of(qtype) -> str | None:
    """BlockQuantMatMul's format of a ggml type, None when the op does not run it."""
    return _FORMAT_NAMES.get(qtype.name)


def block_geometry(fmt: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a format."""
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[ggml_type(fmt)]


def bits_per_weight(fmt: str) -> float:
    qk, size = block_geometry(fmt)
    return 8.0 * size / qk


def dequantize(fmt: str, W: np.ndarray, K: int) -> np.ndarray:
    """Ŵ [N, K] float32 of BlockQuantMatMul bytes ``W`` [N, row_bytes]: the op's numpy reference."""
    from custom_ops.reference import blockquant

    return blockquant.dequantize(np.ascontiguousarray(W), fmt, K)


def quantize(fmt: str, WT: np.ndarray) -> np.ndarray:
    """``WT`` [N, K] float32 → BlockQuantMatMul bytes [N, row_bytes] of ``fmt`` with the ``gguf``
    package's own quantizer (``gguf.quants.quantize``, llama.cpp's reference rounding); K is padded
    with zeros to whole blocks (the op ignores the padding)."""
    from gguf import quants

    qk, _ = block_geometry(fmt)
    N, K = WT.shape
    pad = -K % qk
    x = np.ascontiguousarray(WT, dtype=np.float32)
    if pad:
        x = np.concatenate([x, np.zeros((N, pad), np.float32)], axis=1)
    return np.ascontiguousarray(quants.quantize(x, ggml_type(fmt)), dtype=np.uint8)


def _chunk_rows(K: int) -> int:
    """Rows of K float32 values in one chunk of :data:`_CHUNK_BYTES`."""
    return max(1, _CHUNK_BYTES // (4 * max(int(K), 1)))


def _digests(a: np.ndarray) -> list[bytes]:
    """One hash per row of a 2-D array (of its bytes as stored)."""
    a = np.ascontiguousarray(a)
    rows = a.view(np.uint8).reshape(a.shape[0], -1)
    return [hashlib.blake2b(r, digest_size=_DIGEST).digest() for r in rows]


@dataclass
class Tensor:
    """One 2-D GGUF tensor: ``N`` rows (ggml ne[1]) of ``K`` values (ne[0]) — a weight [K, N] as
    ONNX MatMul's B is its transpose."""
    index: int
    name: str
    qtype: object                   # gguf.GGMLQuantizationType
    K: int
    N: int
    data: np.ndarray = field(repr=False)   # the file's bytes [N, row_bytes] uint8 (memory-mapped)

    @property
    def format(self) -> str | None:
        return format_of(self.qtype)

    @property
    def type_name(self) -> str:
        return self.qtype.name

    @property
    def is_float(self) -> bool:
        return self.qtype.name in _FLOAT_NAMES

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def dequantized(self, lo: int, hi: int) -> np.ndarray:
        """Rows [lo, hi) as float32 [hi - lo, K] (``gguf.quants.dequantize``)."""
        from gguf import quants

        d = quants.dequantize(np.ascontiguousarray(self.data[lo:hi]), self.qtype)
        return np.ascontiguousarray(d, dtype=np.float32).reshape(hi - lo, self.K)


@dataclass
class RowMatch:
    """Where each row of a weight (``WT`` [N, K], rows = outputs) lives in the GGUF: tensor index
    (into ``GGUFSource.tensors``, −1 when no tensor holds it) and row."""
    tensor: np.ndarray              # int32 [N]
    row: np.ndarray                 # int64 [N]
    ties: int = 0                   # rows that had more than one place to come from

    @property
    def found(self) -> int:
        return int((self.tensor >= 0).sum())

    @property
    def complete(self) -> bool:
        return bool(len(self.tensor)) and self.found == len(self.tensor)


@dataclass
class Part:
    """Consecutive outputs [start, stop) of a weight held in one format: the BlockQuantMatMul
    bytes ``W`` [stop − start, row_bytes] copied from the GGUF, verified bit-exact."""
    format: str
    start: int
    stop: int
    K: int
    W: np.ndarray = field(repr=False)
    tensors: list[str]              # the GGUF tensors its rows come from, in order of first use
    layout: str                     # "as stored" | "rows permuted" (and/or "rows i..j of M")

    @property
    def N(self) -> int:
        return self.stop - self.start

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.W.shape[1] / self.K


class GGUFSource:
    """The 2-D tensors of one GGUF file and the row index over them (built on first use).

    Memory (issue 35 item 3): the file stays memory-mapped and only the tensors' views of it are
    kept (the reader's metadata — a 151k-token vocabulary is ~0.5 GB of small numpy arrays — is
    dropped once the tensors are found); the pages read while indexing or assembling go back to
    the page cache after (:meth:`release_pages`); weights are hashed and verified a chunk of rows
    at a time (``WT`` may be a transposed view of a memory-mapped weight: never copied whole)."""

    def __init__(self, path):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise OrtleanError(f"--gguf {self.path}: no such file")
        try:
            reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as e:      # the reader raises ValueError / struct errors on a bad file
            raise OrtleanError(f"--gguf {self.path}: not a GGUF file the gguf package can read "
                               f"({type(e).__name__}: {e})") from None
        self.file_bytes = self.path.stat().st_size
        self.tensors: list[Tensor] = []
        self.skipped: list[str] = []        # 2-D tensors gguf cannot dequantize
        for t in reader.tensors:
            shape = [int(x) for x in t.shape]           # ggml order: ne[0] = K (contiguous), ne[1] = N
            if len(shape) != 2:
                continue
            data = np.asarray(t.data)
            data = data.view(np.uint8).reshape(shape[1], -1)
            self.tensors.append(Tensor(len(self.tensors), t.name, t.tensor_type, shape[0], shape[1], data))
        self.by_name = {t.name: t for t in self.tensors}
        self._map = reader.data      # the file's np.memmap (the tensors' data are views of it); the reader's
        del reader                   # metadata are not needed here
        self._first: dict[bytes, int] | None = None     # hash -> packed (tensor << 32 | row)
        self._more: dict[bytes, list[int]] = {}          # hash -> the other places of a repeated row

    # ------------------------------------------------------------------ the row index
    def _index(self) -> dict[bytes, int]:
        if self._first is not None:
            return self._first
        first: dict[bytes, int] = {}
        more = self._more
        for t in self.tensors:
            step = _chunk_rows(t.K)
            for lo in range(0, t.N, step):
                hi = min(t.N, lo + step)
                try:
                    rows = t.dequantized(lo, hi)
                except (NotImplementedError, ValueError) as e:
                    self.skipped.append(f"{t.name} ({t.type_name}: {e})")
                    break
                for i, d in enumerate(_digests(rows)):
                    code = (t.index << 32) | (lo + i)
                    if d in first:
                        more.setdefault(d, []).append(code)
                    else:
                        first[d] = code
        self._first = first
        self.release_pages()
        return first

    def release_pages(self) -> int:
        """Drop this process's resident pages of the GGUF's memory map (``MADV_DONTNEED``: read-only
        file pages go back to the page cache; every view stays valid, a later read faults them in
        again). Returns the bytes of the map, 0 when it could not be released."""
        mm = getattr(self._map, "_mmap", None)      # np.memmap's mmap.mmap
        if mm is None or getattr(mm, "closed", False) or not hasattr(mm, "madvise"):
            return 0
        try:
            mm.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):
            return 0
        return len(mm)

    # ------------------------------------------------------------------ matching
    def match(self, WT: np.ndarray) -> RowMatch:
        """The GGUF place of every row of ``WT`` [N, K] (float32, rows = outputs)."""
        first = self._index()
        WT = np.asarray(WT, dtype=np.float32)       # a view stays a view: hashed a chunk of rows at a time
        N = WT.shape[0]
        tensor = np.full(N, -1, np.int32)
        row = np.full(N, -1, np.int64)
        step = _chunk_rows(WT.shape[1])
        digests = [d for lo in range(0, N, step) for d in _digests(WT[lo:lo + step])]
        tied: list[tuple[int, list[int]]] = []
        for n, d in enumerate(digests):
            code = first.get(d)
            if code is None:
                continue
            others = self._more.get(d)
            if others:
                tied.append((n, [code, *others]))
            else:
                tensor[n], row[n] = code >> 32, code & 0xFFFFFFFF
        if tied:
            self._resolve_ties(tensor, row, tied)
        return RowMatch(tensor, row, len(tied))

    def _resolve_ties(self, tensor: np.ndarray, row: np.ndarray, tied: list) -> None:
        """Give each row with several candidate places one of them (see the module docstring):
        every choice holds the same values, so any is exact; the preference keeps the source of a
        weight readable (one tensor's rows, a permutation rather than a row used twice)."""
        unique = tensor >= 0
        votes = Counter(tensor[unique].tolist())
        offset: dict[int, float] = {}
        for t in votes:
            sel = unique & (tensor == t)
            offset[t] = float(np.median(np.nonzero(sel)[0] - row[sel]))
        used = set(zip(tensor[unique].tolist(), row[unique].tolist()))
        for n, codes in tied:
            def key(code: int):
                t, r = code >> 32, code & 0xFFFFFFFF
                return (self.tensors[t].format is None, t not in votes, (t, r) in used,
                        abs(n - r - offset.get(t, 0.0)), t, r)

            best = min(codes, key=key)
            t, r = best >> 32, best & 0xFFFFFFFF
            tensor[n], row[n] = t, r
            used.add((t, r))

    def describe_miss(self, m: RowMatch, K: int) -> str:
        """Why ``m`` is not a complete match, for the refusal message."""
        N = len(m.tensor)
        sameK = [t for t in self.tensors if t.K == K]
        if m.found == 0:
            if not sameK:
                ks = sorted({t.K for t in self.tensors})
                return (f"no 2-D tensor of {self.path.name} has rows of K={K} values (its row lengths: "
                        f"{', '.join(map(str, ks[:8]))}{' …' if len(ks) > 8 else ''})")
            return (f"none of its {N} rows equals a dequantized row of the {len(sameK)} tensors of {self.path.name} "
                    f"with K={K} (tried: any row order, transposition, concatenation)")
        srcs = ", ".join(self.tensors[t].name for t in dict.fromkeys(m.tensor[m.tensor >= 0].tolist()))
        miss = int(np.argmin(m.tensor >= 0))
        return (f"{m.found} of {N} rows equal rows of {srcs} but row {miss} (output {miss}) equals no row of "
                f"{self.path.name}")

    # ------------------------------------------------------------------ assembly
    def assemble(self, WT: np.ndarray, m: RowMatch) -> list[Part]:
        """The BlockQuantMatMul bytes of a complete match, one :class:`Part` per run of outputs
        whose source tensors share a format; each part verified bit-exact against ``WT`` (raises
        ``OrtleanError`` naming the tensors when a part is not: a hash collision or a reader fault,
        never silently)."""
        if not m.complete:
            raise ValueError("assemble: the match is not complete")
        WT = np.asarray(WT, dtype=np.float32)       # a view stays a view: verified a chunk of rows at a time
        N, K = WT.shape
        fmts = [self.tensors[t].format for t in m.tensor.tolist()]
        parts = []
        start = 0
        try:
            for n in range(1, N + 1):
                if n < N and fmts[n] == fmts[start]:
                    continue
                parts.append(self._part(WT, m, start, n, fmts[start], K))
                start = n
        finally:
            self.release_pages()        # the rows copied: their pages back to the page cache
        return parts

    def _part(self, WT, m: RowMatch, start: int, stop: int, fmt: str | None, K: int) -> Part:
        ts, rs = m.tensor[start:stop], m.row[start:stop]
        order = list(dict.fromkeys(ts.tolist()))
        names = [self.tensors[t].name for t in order]
        if fmt is None:
            t = self.tensors[order[0]]
            raise OrtleanError(f"rows {start}..{stop - 1} equal rows of {'+'.join(names)}, held as {t.type_name}, "
                               f"a format BlockQuantMatMul does not run")
        W = np.empty((stop - start, self.tensors[order[0]].data.shape[1]), np.uint8)
        notes = []
        for t in order:
            sel = ts == t
            src = self.tensors[t]
            W[sel] = src.data[rs[sel]]
            r = rs[sel]
            if len(r) != src.N or not np.array_equal(np.sort(r), np.arange(src.N)):
                notes.append(f"{len(r)} rows of {src.name}'s {src.N}")
            elif not np.array_equal(r, np.arange(src.N)):
                notes.append(f"{src.name} rows permuted")
        step = _chunk_rows(K)      # never the whole weight dequantized at once (a 151k-row head is 0.9 GB)
        for lo in range(0, stop - start, step):
            hi = min(stop - start, lo + step)
            deq = dequantize(fmt, W[lo:hi], K)
            ref = np.ascontiguousarray(WT[start + lo:start + hi])
            if deq.shape != (hi - lo, K) or not np.array_equal(deq.view(np.uint32), ref.view(np.uint32)):
                raise OrtleanError(f"GGUF rows of {'+'.join(names)} ({self.path.name}) matched by hash do not "
                                   f"dequantize bit-exactly to the weight's rows {start}..{stop - 1}")
        return Part(fmt, start, stop, K, W, names, "; ".join(notes) or "as stored")


def parts_source(parts: list[Part]) -> str:
    """The ``source`` attribute of BlockQuantMatMul nodes: "gguf:<tensor>,<tensor>,…"."""
    names = list(dict.fromkeys(n for p in parts for n in p.tensors))
    return "gguf:" + ",".join(names)
