"""Host buffers for decode-time state on 2 MiB pages (transparent huge pages).

A decode step reads every layer's KV cache once: at a past of 4,096 tokens SmolLM2's int8 cache is
~50 MB, at 8,192 ~100 MB, far beyond the L2 TLB's reach with 4 KiB pages (a page walk every 4 KiB,
and for PackedAttention's candidate rows, gathered at random, a walk for most rows). On Linux with
``/sys/kernel/mm/transparent_hugepage/enabled`` = ``always`` or ``madvise`` an anonymous mapping
advised ``MADV_HUGEPAGE`` *before* it is touched is faulted in 2 MiB pages. Elsewhere (or when the
kernel has no huge page free) the buffer is an ordinary zeroed array: the result never depends on
it, only the speed.

    k, v = huge_zeros_many([((1, 3, 4096, 64), np.float32)] * 2)   # one mapping, 4 KiB-aligned arrays

A model's per-layer caches are often under 2 MiB each (SmolLM2 int8 at 4,096 tokens: 1.7 MB), so
``huge_zeros_many`` carves them all from one mapping instead of giving each its own 2 MiB pages.
"""
from __future__ import annotations

import mmap

import numpy as np

__all__ = ["huge_zeros_many", "thp_mode"]

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


def _mapping(n: int):
    """A zeroed uint8 array of n bytes on a private anonymous mapping, 2 MiB-aligned, advised
    MADV_HUGEPAGE (None where madvise or THP is unavailable)."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or thp_mode() not in ("always", "madvise"):
        return None
    size = (n + _HUGE - 1) // _HUGE * _HUGE + _HUGE  # room to align the start
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(m, dtype=np.uint8)  # holds m
    off = (-raw.ctypes.data) % _HUGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, off, size - off)
    except OSError:  # advisory only: an ordinary mapping (still zeroed)
        pass
    return raw[off:off + n]


def huge_zeros_many(specs, align: int = 4096) -> list[np.ndarray]:
    """Zeroed C-contiguous arrays for ``specs`` = [(shape, dtype), ...], carved from one mapping on
    2 MiB pages (each array's start aligned to ``align`` bytes); separate np.zeros arrays where huge
    pages are unavailable. The mapping lives as long as any of the arrays."""
    specs = [(tuple(int(d) for d in shape), np.dtype(dt)) for shape, dt in specs]
    sizes = [int(np.prod(shape, dtype=np.int64)) * dt.itemsize for shape, dt in specs]
    offs, pos = [], 0
    for n in sizes:
        offs.append(pos)
        pos += (n + align - 1) // align * align
    raw = _mapping(pos) if pos >= _HUGE else None
    if raw is None:
        return [np.zeros(shape, dtype=dt) for shape, dt in specs]
    return [raw[o:o + n].view(dt).reshape(shape) for (shape, dt), o, n in zip(specs, offs, sizes)]

