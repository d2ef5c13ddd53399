"""Stamps of what a derived artifact depends on, for the caches that let a warm `ortlean demo` spend
its time measuring: the rewriter's own code (every Python file of ``rewriter`` and ``custom_ops``)
and op library, and model files by path, size and modification time (their external data too).
A cached value is reused only under the same stamp; anything else is measured again."""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

__all__ = ["code_hash", "library_hash", "file_stamp", "stamp", "JsonCache"]


@functools.lru_cache(maxsize=None)
def code_hash() -> str:
    """The rewriter's code: its Python sources (a commit that changes only tests, docs or results keeps
    every stamp). Read once per process: the code a process runs does not change under it."""
    import custom_ops

    h = hashlib.sha256()
    for pkg in (Path(__file__).resolve().parents[1], Path(custom_ops.__file__).resolve().parent):
        for f in sorted(pkg.rglob("*.py")):
            h.update(str(f.relative_to(pkg.parent)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def library_hash() -> str:
    """The op library the process loads (its bytes; read once per process, as it is loaded once)."""
    import custom_ops

    return hashlib.sha256(Path(custom_ops.library_path()).read_bytes()).hexdigest()[:16]


def file_stamp(path) -> dict:
    """A model file by resolved path, size and mtime, with the files beside it that hold its external
    data (``<name>.data`` / ``<name>_data`` / ``*.onnx.data``-style siblings)."""
    p = Path(path).resolve()
    files = [p] + sorted(q for q in p.parent.glob(p.name + "*") if q != p and q.is_file())
    return {str(q): [q.stat().st_size, q.stat().st_mtime_ns] for q in files}


def stamp(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


class JsonCache:
    """Values (JSON) under ``root`` by stamp: ``get(parts)`` / ``put(parts, value)``, written
    atomically; an unreadable entry is a miss; ``value(parts, compute, on_hit)``: the cached value, or
    ``compute()``'s (kept when not None)."""

    def __init__(self, root):
        self.root = Path(root)

    def _path(self, parts: dict) -> Path:
        return self.root / f"{stamp(parts)}.json"

    def get(self, parts: dict):
        p = self._path(parts)
        try:
            return json.loads(p.read_text())["value"]
        except (OSError, ValueError, KeyError):
            return None

    def put(self, parts: dict, value) -> None:
        p = self._path(parts)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps({"parts": parts, "value": value}, default=str))
        tmp.replace(p)

    def value(self, parts: dict, compute, on_hit=None):
        hit = self.get(parts)
        if hit is not None:
            if on_hit:
                on_hit()
            return hit
        got = compute()
        if got is not None:
            self.put(parts, got)
        return got
