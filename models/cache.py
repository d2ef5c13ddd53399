"""Cache directory for built artifacts (exported models, the text corpus).

Root: ``$ORTLEAN_CACHE`` or ``~/.cache/ortlean``. Each artifact lives in a directory whose name
carries a key made from the versions of everything that determines its bytes (weight package,
torch, transformers, optimum-onnx, onnx, our own recipe version), so a rerun is a directory
lookup and a version change builds a new artifact next to the old one.

Builds are atomic: :func:`atomic_dir` builds into a temporary sibling directory and renames it
into place only when the build finished, under a lock so two processes don't build the same
artifact at once. A crashed build leaves at most a ``.tmp-*`` sibling, which the next build of the
same artifact removes.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

__all__ = ["cache_root", "pkg_version", "versions", "artifact_key", "atomic_dir", "file_lock"]


def cache_root() -> Path:
    """The cache root (``$ORTLEAN_CACHE`` or ``~/.cache/ortlean``); created on demand."""
    env = os.environ.get("ORTLEAN_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "ortlean"
    root.mkdir(parents=True, exist_ok=True)
    return root


def pkg_version(dist: str) -> str | None:
    """Installed version of a distribution (PyPI name), or None when it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions(dists: list[str] | tuple[str, ...]) -> dict[str, str | None]:
    return {d: pkg_version(d) for d in dists}


def artifact_key(name: str, parts: dict) -> str:
    """``name-<12 hex>`` from a JSON-able dict of everything the artifact depends on."""
    blob = json.dumps({"name": name, **parts}, sort_keys=True, default=str).encode()
    return f"{name}-{hashlib.sha256(blob).hexdigest()[:12]}"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock on ``path`` (created if needed) for the duration of the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale(target: Path) -> None:
    """Remove temporary build dirs of ``target`` left by processes that no longer run."""
    prefix = f".{target.name}.tmp-"
    for p in target.parent.glob(prefix + "*"):
        try:
            pid = int(p.name[len(prefix):].split("-")[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(target: Path, force: bool = False) -> Iterator[Path | None]:
    """Build ``target`` atomically.

    Yields None when ``target`` already exists (and not ``force``): nothing to do. Otherwise
    yields a fresh temporary directory next to ``target``; when the block exits normally the
    directory is renamed to ``target`` (replacing an old one when ``force``); when it raises, the
    temporary directory is removed. Holds a lock on ``<target>.lock`` throughout, so a second
    process asking for the same artifact waits and then finds it built.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{target.name}.lock"):
        if target.is_dir() and not force:
            yield None
            return
        _clean_stale(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the artifact is a normal dir
        try:
            yield tmp
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.tmp-{os.getpid()}-old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(target, old)
        os.rename(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
