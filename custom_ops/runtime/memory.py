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

The weights are the other stream: a SmolLM2 int4 decode step reads ~90 MB of them, which ONNX Runtime
keeps in malloc'd memory on 4 KiB pages (glibc advises nothing unless started with
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``). ``huge_pages_for_process()``, called once the sessions
exist, moves the process's resident anonymous memory (the heap, malloc's mapped chunks: initializers
and prepacked weights, whoever allocated them) onto 2 MiB pages with ``MADV_COLLAPSE`` (Linux 6.1+):
SmolLM2 int4 decode measured 6-8 % faster after 128 tokens (1 thread; tests/bench/results/huge-pages-ab.log,
``tests/bench/bench_longctx.py --huge-weights off|on``).
"""
from __future__ import annotations

import mmap

import numpy as np

__all__ = ["huge_zeros_many", "huge_pages_for_process", "thp_mode"]

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


_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25


def _anon_mappings():
    """(start, end, resident bytes, bytes on huge pages) of the process's private writable anonymous
    mappings (the heap included), from /proc/self/smaps."""
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                if cur:
                    out.append(cur)
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                path = head[5] if len(head) > 5 else ""
                cur = [lo, hi, 0, 0] if head[1].startswith("rw") and head[1][3] == "p" and path in ("", "[heap]") \
                    else None
            elif cur and head and head[0] in ("Rss:", "AnonHugePages:"):
                cur[2 if head[0] == "Rss:" else 3] = int(head[1]) * 1024
    if cur:
        out.append(cur)
    return out


def huge_pages_for_process(min_resident: float = 0.75, ranges: list | None = None) -> int:
    """Puts the process's resident anonymous memory on 2 MiB pages: every private writable anonymous
    mapping (and the heap) at least ``min_resident`` resident, with at least 2 MiB not yet on huge
    pages beyond what its unaligned ends could hold, gets MADV_HUGEPAGE (later faults in it take huge
    pages) and MADV_COLLAPSE on its 2 MiB-aligned part (Linux 6.1+: the resident 4 KiB pages copied
    into huge ones now; sparse mappings such as thread stacks are left alone, collapsing them would
    populate them; a mapping already collapsed is not taken again for the 4 KiB pages of its ends).
    Returns the bytes collapsed: 0 where transparent huge pages are off or unsupported; ``ranges``, when
    given, gets each collapsed [start, end). Advisory: results never depend on it."""
    if thp_mode() not in ("always", "madvise"):
        return 0
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        maps = _anon_mappings()
    except (OSError, AttributeError):
        return 0
    done = 0
    for lo, hi, rss, huge in maps:
        a, b = (lo + _HUGE - 1) // _HUGE * _HUGE, hi // _HUGE * _HUGE
        if b - a < _HUGE or rss < min_resident * (hi - lo) or rss - huge - (a - lo) - (hi - b) < _HUGE:
            continue
        libc.madvise(a, b - a, _MADV_HUGEPAGE)
        if libc.madvise(a, b - a, _MADV_COLLAPSE) == 0:
            done += b - a
            if ranges is not None:
                ranges.append((a, b))
    return done
