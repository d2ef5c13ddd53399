"""The prompt cache: a model's state after a prompt's first tokens, kept in a file, so that a later run
whose prompt starts with the same tokens loads it and prefills only the rest (issue 58). The format
and what binds a file to its model are in docs/generate.md ("Prompt cache").

    from custom_ops import runtime
    g = runtime.generate(sess, io, tok, document + "\\n\\n" + question, 64, model_path=path,
                         prompt_cache="book.cache", cache_prefix=document)
    g.cache.describe()      # "prompt cache book.cache: 32,110 tokens written, 503.5 MB in 0.80 s" / "... loaded ..."

The state is every ``past_key_values.*`` input of the model — PackedAttention's packed cache, a
GroupQueryAttention or concatenating K/V cache — and only the first ``n`` positions of each along
its sequence axis are stored (rows of later positions do not change earlier ones). Saving writes
those rows straight from the state buffers (no copy of the cache; a temporary file in the same
directory renamed over the old one); loading reads them straight into a fresh decoder's buffers
in large sequential reads, each piece checksummed as it arrives (zlib's CRC-32, ~4 GB/s, on a second
thread while the next piece is read).

Every problem with a file is one :class:`PromptCacheError` naming the file and the problem, and
the file is never modified by a failed load.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import time
import zlib
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

__all__ = ["PromptCache", "PromptCacheError", "CacheInfo", "MAGIC", "VERSION", "read_header", "open_cache",
           "save", "model_binding", "state_specs", "prefix_tokens", "is_cache_file", "TAIL_SLACK"]

MAGIC = b"\x89ORTLPC\n"          # 8 bytes: a binary file (0x89), "ORTLPC", a newline (text-mode damage shows)
VERSION = 1
_FIXED = struct.Struct("<8sIII4x")  # magic, format version, header JSON bytes, header CRC-32, reserved
ALIGN = 4096                      # every array starts on a 4 KiB boundary of the file
PIECE = 8 << 20                   # bytes per read / write (and CRC update)
SAMPLES, SAMPLE_BYTES = 32, 64 << 10   # an external data file's sampled blocks
# a prompt that agrees with all but the cache's last few tokens (at most this many, at most a quarter of
# them) still loads it, up to where they agree: a document's last tokens may be tokenized differently
# when text follows them
TAIL_SLACK = 16


class PromptCacheError(ValueError):
    """A prompt cache file that cannot be used: ``path`` and ``problem`` (one line). ``refresh_helps``:
    the file is what is wrong (damaged, another model's or prompt's), so rebuilding it is the remedy."""

    def __init__(self, path, problem: str, refresh_helps: bool = True):
        self.path, self.problem, self.refresh_helps = Path(path), problem, refresh_helps
        super().__init__(f"prompt cache {path}: {problem}")


@dataclass
class PromptCache:
    """A prompt cache file for :func:`runtime.generate`: loaded when it exists (unless ``refresh``),
    written after the prompt when it does not (or with ``refresh``: rebuilt from this prompt)."""
    path: Path
    refresh: bool = False

    def __post_init__(self):
        self.path = Path(self.path)


@dataclass
class CacheInfo:
    """What a generation did with its prompt cache."""
    path: Path
    action: str                 # "loaded" | "written"
    tokens: int                 # tokens whose state came from the file / went into it
    file_tokens: int            # tokens the file holds
    bytes: int                  # the file's size
    seconds: float              # reading and checking it / writing it

    def describe(self) -> str:
        mb = self.bytes / 1e6
        if self.action == "loaded":
            of = "" if self.tokens == self.file_tokens else f" of its {self.file_tokens:,}"
            return f"prompt cache {self.path}: {self.tokens:,} tokens{of} loaded, {mb:,.1f} MB in {self.seconds:.2f} s"
        return f"prompt cache {self.path}: {self.tokens:,} tokens written, {mb:,.1f} MB in {self.seconds:.2f} s"


# --------------------------------------------------------------------------- what a file is bound to
def _model_file(model_path) -> Path:
    p = Path(model_path)
    return p / "model.onnx" if p.is_dir() else p


def _stat(p: Path) -> dict:
    st = p.stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino, "device": st.st_dev}


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb", buffering=0) as f:
        buf = bytearray(PIECE)
        mv = memoryview(buf)
        while True:
            n = f.readinto(mv)
            if not n:
                break
            h.update(mv[:n])
    return h.hexdigest()


def _sampled_sha256(p: Path, size: int) -> str:
    """SHA-256 of SAMPLES blocks of SAMPLE_BYTES at evenly spaced offsets (the whole file when small)."""
    h = hashlib.sha256()
    with open(p, "rb", buffering=0) as f:
        if size <= SAMPLES * SAMPLE_BYTES:
            h.update(f.read())
        else:
            for off in np.linspace(0, size - SAMPLE_BYTES, SAMPLES).astype(np.int64):
                f.seek(int(off))
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def _external_files(model_file: Path) -> list[str]:
    """The external data files the model's tensors (initializers and attribute tensors, subgraphs
    included) name, relative to its directory."""
    import onnx

    proto = onnx.load(str(model_file), load_external_data=False)
    names: set[str] = set()

    def tensors(t):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            for e in t.external_data:
                if e.key == "location":
                    names.add(e.value)

    def walk(g):
        for t in g.initializer:
            tensors(t)
        for n in g.node:
            for a in n.attribute:
                if a.HasField("t"):
                    tensors(a.t)
                for t in a.tensors:
                    tensors(t)
                if a.HasField("g"):
                    walk(a.g)
                for sg in a.graphs:
                    walk(sg)

    walk(proto.graph)
    return sorted(names)


def model_binding(model_path) -> dict:
    """What a cache file records of its model: model.onnx's size, SHA-256 and identity (modification
    time, inode, device: when all are unchanged the SHA-256 is not recomputed), and each external data
    file's name, size and sampled SHA-256."""
    mf = _model_file(model_path)
    ext = []
    for name in _external_files(mf):
        q = mf.parent / name
        size = q.stat().st_size
        ext.append({"name": name, "bytes": size, "sampled_sha256": _sampled_sha256(q, size)})
    return {"path": str(mf.resolve()), "onnx": {**_stat(mf), "sha256": _sha256(mf)}, "external": ext}


def _binding_problem(rec: dict, model_path) -> str | None:
    """Why a file bound to ``rec`` (model_binding's dict) is not for this model; None when it is."""
    mf = _model_file(model_path)
    was = rec.get("path", "?")
    other = f"written for another model or another rewrite of it ({was}"
    try:
        now = _stat(mf)
        onnx_rec = rec["onnx"]
        if now["bytes"] != onnx_rec["bytes"]:
            return f"{other}: its model file has {onnx_rec['bytes']:,} bytes, {mf} {now['bytes']:,})"
        same_file = all(now[k] == onnx_rec[k] for k in ("mtime_ns", "inode", "device"))
        if not same_file and _sha256(mf) != onnx_rec["sha256"]:
            return f"{other}: its model file's SHA-256 differs from {mf}'s)"
        for e in rec["external"]:
            q = mf.parent / e["name"]
            if not q.is_file():
                return f"{other}: its external data file {e['name']} is not beside {mf})"
            size = q.stat().st_size
            if size != e["bytes"] or _sampled_sha256(q, size) != e["sampled_sha256"]:
                return f"{other}: its external data file {e['name']} differs from {q})"
    except (KeyError, TypeError):
        return "its header does not record the model it was written for (damaged?)"
    return None


def state_specs(io, n: int) -> list[dict]:
    """name, dtype, shape (batch 1, ``n`` positions) and sequence axis of every state of ``io``."""
    out = []
    for name in io.past_to_present:
        try:
            shape = io.state_dims(name, 1, n)
        except ValueError as e:
            raise ValueError(f"prompt cache: {e}") from None
        out.append({"name": name, "dtype": np.dtype(io.state_types[name]).str, "shape": shape,
                    "seq_axis": int(io.state_seq_axis[name])})
    return out


def _versions() -> dict:
    import importlib.metadata as md

    import onnxruntime

    try:
        ours = md.version("ortlean")
    except md.PackageNotFoundError:
        ours = "unknown"
    return {"ortlean": ours, "onnxruntime": onnxruntime.__version__}


# --------------------------------------------------------------------------- the token prefix
def prefix_tokens(encoding, boundary: int) -> int:
    """How many of an encoded text's first tokens to cache when its first ``boundary`` characters are
    the part later prompts share (a document): the tokens that end by the boundary, less the last
    one — text that follows the boundary may merge with it (a document's final newline with the
    blank line before a question). ``encoding``: a ``tokenizers`` Encoding (its ``offsets``)."""
    n, seen_text = 0, False
    for start, end in encoding.offsets:
        if end > boundary or (seen_text and start == end == 0):  # past the boundary, or a special token appended
            break
        seen_text = seen_text or end > 0
        n += 1
    return max(n - 1, 0)


# --------------------------------------------------------------------------- layout
def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _crc_hex(c: int) -> str:
    return f"{c & 0xFFFFFFFF:08x}"


def _blocks(arr: np.ndarray, seq_axis: int):
    """The contiguous pieces of ``arr`` (a state's first n positions, possibly a view of a larger
    buffer) in C order: one per index of the axes before the sequence axis."""
    lead = arr.shape[:seq_axis]
    for idx in np.ndindex(*lead) if lead else [()]:
        yield arr[idx]


def _header_bytes(meta: dict) -> tuple[bytes, int]:
    """(the fixed header with a zero CRC + the JSON, the data start)."""
    js = json.dumps(meta, separators=(",", ":"), sort_keys=False).encode()
    return _FIXED.pack(MAGIC, VERSION, len(js), 0) + js, _align(_FIXED.size + len(js))


def _header_crc(head: bytes, data_start: int) -> int:
    """CRC-32 of the fixed header (its CRC field zero), the JSON and the zero padding up to the data."""
    return zlib.crc32(bytes(data_start - len(head)), zlib.crc32(head))


# --------------------------------------------------------------------------- save
def save(path, model_path, io, tokens, states: dict[str, np.ndarray], binding: dict | None = None) -> CacheInfo:
    """Write a cache of ``tokens`` (the prompt's first n ids) and ``states`` (every state's first n
    positions: views of the decoder's buffers, not copied) to ``path``, atomically: a temporary file
    in the same directory, renamed over ``path`` once complete (removed on any failure)."""
    t0 = time.perf_counter()
    path = Path(path)
    toks = np.asarray(tokens, dtype="<i4")
    n = int(toks.size)
    specs = state_specs(io, n)
    for s in specs:
        a = states[s["name"]]
        if list(a.shape) != s["shape"] or a.dtype.str != s["dtype"]:
            raise ValueError(f"prompt cache: state {s['name']} is {a.shape} {a.dtype}, {s['shape']} {s['dtype']} expected")
    binding = binding if binding is not None else model_binding(model_path)
    meta = {"format": "ortlean prompt cache", "version": VERSION, "written_by": _versions(),
            "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "model": binding,
            "tokens": {"count": n, "dtype": "<i4", "offset": 0, "bytes": int(toks.nbytes), "crc32": _crc_hex(0)},
            "states": [{**s, "offset": 0, "bytes": int(np.prod(s["shape"], dtype=np.int64)) * np.dtype(s["dtype"]).itemsize,
                        "crc32": _crc_hex(0)} for s in specs],
            "file_bytes": 0}
    # the offsets are in the JSON, whose length moves the data start: iterate until the start is stable
    # (it moves in 4 KiB steps only; the CRCs, written last, are fixed-width)
    start = 0
    for _ in range(8):
        pos = start
        for sec in [meta["tokens"], *meta["states"]]:
            sec["offset"] = pos
            pos += _align(sec["bytes"])
        meta["file_bytes"] = pos
        _, need = _header_bytes(meta)
        if need == start:
            break
        start = need
    else:
        raise RuntimeError("prompt cache: the header's layout does not settle")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        with open(tmp, "wb", buffering=0) as f:
            f.seek(start)
            sections = [(meta["tokens"], [toks])]
            sections += [(sec, _blocks(states[sec["name"]], sec["seq_axis"])) for sec in meta["states"]]
            for sec, blocks in sections:
                assert f.tell() == sec["offset"]
                crc = 0
                for b in blocks:
                    if not b.flags.c_contiguous:
                        b = np.ascontiguousarray(b)
                    mv = memoryview(b.reshape(-1)).cast("B")
                    for i in range(0, len(mv), PIECE):
                        piece = mv[i:i + PIECE]
                        _write_all(f, piece)
                        crc = zlib.crc32(piece, crc)
                pad = _align(sec["bytes"]) - sec["bytes"]
                if pad:
                    z = bytes(pad)
                    _write_all(f, z)
                    crc = zlib.crc32(z, crc)
                sec["crc32"] = _crc_hex(crc)
            head, data_start = _header_bytes(meta)
            if data_start != start:   # cannot happen: the CRCs are fixed-width
                raise RuntimeError("prompt cache: header length changed while writing")
            head = _FIXED.pack(MAGIC, VERSION, len(head) - _FIXED.size, _header_crc(head, start)) + head[_FIXED.size:]
            f.seek(0)
            _write_all(f, head + bytes(start - len(head)))
            size = f.seek(0, os.SEEK_END)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise PromptCacheError(path, f"cannot be written ({e.strerror or e}); nothing was written",
                                   refresh_helps=False) from None
        raise
    return CacheInfo(path, "written", n, n, size, time.perf_counter() - t0)


def _write_all(f, mv) -> None:
    mv = memoryview(mv)
    while len(mv):
        k = f.write(mv)
        mv = mv[k:]


# --------------------------------------------------------------------------- load
def is_cache_file(path) -> bool:
    """Whether ``path`` starts like a prompt cache (or is empty / a truncated beginning of one): the files
    a rebuild may replace. Any other file is never overwritten."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError:
        return False
    return MAGIC.startswith(head)


def read_header(path) -> dict:
    """The header of a cache file, checked: magic, format version, CRC, size; PromptCacheError otherwise."""
    path = Path(path)
    with _open(path) as f:
        return _read_header(f, path)


def _open(path: Path):
    if path.is_dir():
        raise PromptCacheError(path, "is a directory", refresh_helps=False)
    try:
        return open(path, "rb", buffering=0)
    except OSError as e:
        raise PromptCacheError(path, f"cannot be read ({e.strerror or e})", refresh_helps=False) from None


def _read_header(f, path: Path) -> dict:
    size = os.fstat(f.fileno()).st_size
    fixed = f.read(_FIXED.size)
    if len(fixed) < len(MAGIC) or fixed[:len(MAGIC)] != MAGIC:
        if MAGIC.startswith(fixed[:len(MAGIC)]):
            raise PromptCacheError(path, f"truncated ({size:,} bytes: not even its header)")
        raise PromptCacheError(path, "not an ortlean prompt cache (its first bytes are not the format's magic)")
    if len(fixed) < _FIXED.size:
        raise PromptCacheError(path, f"truncated ({size:,} bytes: not even its header)")
    _, version, jlen, crc = _FIXED.unpack(fixed)
    if version != VERSION:
        raise PromptCacheError(path, f"format version {version}; this ortlean reads version {VERSION}")
    data_start = _align(_FIXED.size + jlen)
    if size < data_start:
        raise PromptCacheError(path, f"truncated ({size:,} bytes, its header alone takes {data_start:,})")
    rest = f.read(data_start - _FIXED.size)
    head = _FIXED.pack(MAGIC, version, jlen, 0) + rest[:jlen]
    if _header_crc(head, data_start) != crc or any(rest[jlen:]):
        raise PromptCacheError(path, "corrupt (its header's checksum does not match)")
    try:
        meta = json.loads(rest[:jlen])
        want = int(meta["file_bytes"])
        secs = [meta["tokens"], *meta["states"]]
        ok = all(int(s["offset"]) >= data_start for s in secs)
    except (ValueError, KeyError, TypeError):
        raise PromptCacheError(path, "corrupt (its header is not the format's)") from None
    if not ok:
        raise PromptCacheError(path, "corrupt (an array's offset lies in its header)")
    if size < want:
        raise PromptCacheError(path, f"truncated ({size:,} of its {want:,} bytes)")
    if size > want:
        raise PromptCacheError(path, f"corrupt ({size:,} bytes, its header says {want:,})")
    meta["_data_start"] = data_start
    return meta


class _Crc:
    """A running CRC-32 over pieces added in order, each computed on a worker thread (one at a time) so
    the caller reads the next piece meanwhile. A piece must not change until the next ``add`` / ``wait``."""

    def __init__(self, pool):
        self.pool, self.fut, self.value = pool, None, 0

    def add(self, piece) -> None:
        self.fut = self.pool.submit(zlib.crc32, piece, self.wait())

    def wait(self) -> int:
        if self.fut is not None:
            self.value, self.fut = self.fut.result(), None
        return self.value


class _Opened:
    """A cache file whose header, size and model binding were checked: read its tokens, then its states."""

    def __init__(self, path: Path, model_path, io):
        self.path = path
        self._threads = None
        self.f = _open(path)
        try:
            self.meta = m = _read_header(self.f, path)
            self.bytes = int(m["file_bytes"])
            ours = _versions()["ortlean"]
            theirs = (m.get("written_by") or {}).get("ortlean")
            if theirs != ours:
                raise PromptCacheError(path, f"written by ortlean {theirs}, this is ortlean {ours} (a cache's state "
                                             "layout is bound to the ortlean that wrote it)")
            problem = _binding_problem(m.get("model") or {}, model_path)
            if problem:
                raise PromptCacheError(path, problem)
            n = int(m["tokens"]["count"])
            self.n = n
            want = state_specs(io, n)
            got = [{k: s.get(k) for k in ("name", "dtype", "shape", "seq_axis")} for s in m["states"]]
            if got != want:
                raise PromptCacheError(path, "written for another model (its states differ from this model's: "
                                             f"{_first_difference(got, want)})")
        except BaseException:
            self.f.close()
            raise

    def close(self):
        self.f.close()
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _section(self, sec: dict, dest_blocks, rows_in_file: int, rows: int, row_bytes: int, what: str) -> None:
        """Read one array: each file block of ``rows_in_file`` positions (``row_bytes`` each), its first
        ``rows`` into the next destination block, the rest skipped (still checksummed), then the padding."""
        self.f.seek(int(sec["offset"]))
        crc = _Crc(self._pool())
        for dst in dest_blocks:
            tgt = dst if dst.flags.c_contiguous else np.empty_like(dst, order="C")
            if tgt.size:
                self._read_into(memoryview(tgt.reshape(-1)).cast("B"), crc, what)
            if tgt is not dst:
                crc.wait()
                dst[...] = tgt
            skip = (rows_in_file - rows) * row_bytes
            while skip:   # rows past those asked: read (into new buffers) only to check them
                k = min(skip, PIECE)
                self._read_into(memoryview(bytearray(k)), crc, what)
                skip -= k
        pad = _align(int(sec["bytes"])) - int(sec["bytes"])
        if pad:
            self._read_into(memoryview(bytearray(pad)), crc, what)
        if _crc_hex(crc.wait()) != sec.get("crc32"):
            raise PromptCacheError(self.path, f"corrupt ({what}: its checksum does not match)")

    def _pool(self):
        if self._threads is None:
            from concurrent.futures import ThreadPoolExecutor

            self._threads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt-cache-crc")
        return self._threads

    def _read_into(self, mv: memoryview, crc: "_Crc", what: str) -> None:
        """Fill ``mv`` from the file, piece by piece; each piece's CRC is computed on the worker thread
        while the next piece is read (both release the GIL)."""
        for i in range(0, len(mv), PIECE):
            piece = mv[i:i + PIECE]
            got = 0
            while got < len(piece):
                try:
                    k = self.f.readinto(piece[got:])
                except OSError as e:
                    raise PromptCacheError(self.path, f"cannot be read ({e.strerror or e})", refresh_helps=False) from None
                if not k:
                    raise PromptCacheError(self.path, f"truncated (it ends inside {what})")
                got += k
            crc.add(piece)

    def tokens(self) -> list[int]:
        sec = self.meta["tokens"]
        if int(sec["bytes"]) != 4 * self.n or sec.get("dtype") != "<i4":
            raise PromptCacheError(self.path, "corrupt (its token array is not n int32 ids)")
        toks = np.empty(self.n, dtype="<i4")
        self._section(sec, [toks], self.n, self.n, 4, "its token ids")
        return toks.tolist()

    def read_states(self, dest: dict[str, np.ndarray], rows: int) -> None:
        """Every state's first ``rows`` positions into ``dest`` (arrays or views of ``rows`` positions)."""
        for sec in self.meta["states"]:
            ax = int(sec["seq_axis"])
            d = dest[sec["name"]]
            if d.shape[ax] != rows:
                raise ValueError(f"prompt cache: {sec['name']} destination has {d.shape[ax]} positions, {rows} asked")
            if int(sec["bytes"]) != int(np.prod(sec["shape"], dtype=np.int64)) * np.dtype(sec["dtype"]).itemsize:
                raise PromptCacheError(self.path, f"corrupt (state {sec['name']}'s byte count)")
            row_bytes = int(np.prod(sec["shape"][ax + 1:], dtype=np.int64)) * np.dtype(sec["dtype"]).itemsize
            self._section(sec, _blocks(d, ax), self.n, rows, row_bytes, f"state {sec['name']}")


def _first_difference(got: list[dict], want: list[dict]) -> str:
    if [g["name"] for g in got] != [w["name"] for w in want]:
        return f"{len(got)} states, this model has {len(want)}" if len(got) != len(want) else "other state names"
    for g, w in zip(got, want):
        if g != w:
            return f"{g['name']} is {g['dtype']} {g['shape']}, here {w['dtype']} {w['shape']}"
    return "?"


def open_cache(path, model_path, io) -> _Opened:
    """Open a cache file for this model (``io``: its states): header, size, version and binding
    checked; :class:`PromptCacheError` otherwise. Read ``.tokens()`` first, then ``.read_states(dest,
    rows)``; a context manager."""
    return _Opened(Path(path), model_path, io)
