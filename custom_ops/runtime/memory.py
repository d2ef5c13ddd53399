"""Host buffers for decode-time state on 2 MiB pages (transparent huge pages).

A decode step reads every layer's KV cache once: at a past of 4,096 tokens SmolLM2's int8 cache is
~50 MB, at 8,192 ~100 MB, far beyond the L2 TLB's reach with 4 KiB pages (a page walk every 4 KiB,
and for PackedAttention's candidate rows, gathered at random, a walk for most rows). On Linux with
``/sys/kernel/mm/transparent_hugepage/enabled`` = ``always`` or ``madvise`` an anonymous mapping
advised ``MADV_HUGEPAGE`` *before* it is touched is faulted in 2 MiB pages. Elsewhere (or when the
kernel has no huge page free) the buffer is an ordinary zeroed array: the result never depends on
it, only the speed.

    arr = huge_zeros((1, 3, 8192, 34), np.int32)   # zeroed, 2 MiB-aligned, advised MADV_HUGEPAGE
"""
from __future__ import annotations

import mmap

import numpy as np

__all__ = ["huge_zeros", "thp_mode"]

_HUGE = 2 << 20


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``; ``?`` if unknown)."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "?"
    for w in text.split():
        if w.startswith("[") and w.endswith("]"):
            return w[1:-1]
    return "?"


def huge_zeros(shape, dtype, min_bytes: int = _HUGE) -> np.ndarray:
    """A zeroed C-contiguous array whose memory is a private anonymous mapping aligned to 2 MiB and
    advised MADV_HUGEPAGE (arrays under ``min_bytes``, or where madvise is unavailable: np.zeros).
    The mapping lives as long as the array (numpy keeps the buffer's owner alive)."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if n < min_bytes or not hasattr(mmap, "MADV_HUGEPAGE") or thp_mode() not in ("always", "madvise"):
        return np.zeros(shape, dtype=dt)
    size = (n + _HUGE - 1) // _HUGE * _HUGE + _HUGE  # room to align the start
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(m, dtype=np.uint8)  # holds m
    off = (-raw.ctypes.data) % _HUGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, off, size - off)
    except OSError:  # advisory only: an ordinary mapping (still zeroed)
        pass
    return raw[off:off + n].view(dt).reshape(shape)
