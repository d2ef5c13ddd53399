"""The memory floor of a decode step: a model's weight bytes read once, with nothing computed.

A single-token decode step of a causal LM reads every weight of its products once; at short pasts
that is almost all of its memory traffic (SmolLM2's 94 MB of weights against 7 MB of fp32 K/V at a
past of 128). ``ortlean bench`` times this floor in the same rounds as its rows (:class:`FloorRow`),
in two forms at each thread count:

* **one pass**: the bytes of every weight node, split between the threads, read without a pause;
* **a barrier per node**: the same reads, every thread waiting for the others after its share of each
  node's weights — what a runtime that runs one node at a time across its threads (ONNX Runtime's
  executor, ggml's graph compute) cannot avoid, since a layer's product needs the previous one's
  whole output. The difference is the cost of synchronization alone.

The reads are the library's ``ortlean_stream_floor_ns`` (its own threads, not ORT's pool), in the
faster of a sequential pass and eight prefetched streams a thread (the block-quant kernels' pattern),
chosen in the table's warm-up round; a row's step is no faster than the floor of its weight bytes, so ``row / floor`` is how far
the kernels, attention, norms and the runtime's per-node costs put the model from the memory limit.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

__all__ = ["weight_reads", "aligned_buffers", "stream_ns", "FloorRow", "PRODUCT_OPS", "CONFIGS"]

# the products whose constant inputs (weights, scales, zero points, bias) a decode step reads whole:
# ONNX's and ORT's matmuls and ortlean's ops; lookups (Gather, BlockQuantGather) read a row, attention's
# cos / sin tables a row per position
PRODUCT_OPS = frozenset({"MatMul", "Gemm", "MatMulNBits", "MatMulInteger", "MatMulIntegerToFloat", "QLinearMatMul",
                         "DynamicQuantizeMatMul", "FusedMatMul", "BlockQuantMatMul", "TTMatMul", "ProcSparseMatMul",
                         "EventGatedMatMul"})
# (streams, software prefetch distance in bytes): a sequential pass; eight streams 1 KB ahead each
CONFIGS = ((1, 0), (8, 1024))


def weight_reads(model_path) -> list[tuple[str, int]]:
    """(node name, bytes) of every PRODUCT_OPS node in graph order (main graph) that reads constant
    initializers (external data included): the bytes of its distinct initializer inputs. A tied
    initializer read by two nodes counts twice, as a step reads it twice."""
    import onnx

    from .weights import _tensor_nbytes

    model_path = Path(model_path)
    m = onnx.load(str(model_path), load_external_data=False)
    sizes = {t.name: _tensor_nbytes(t, model_path.parent) for t in m.graph.initializer}
    out = []
    for i, n in enumerate(m.graph.node):
        if n.op_type not in PRODUCT_OPS:
            continue
        b = sum(sizes[x] for x in dict.fromkeys(n.input) if x in sizes)
        if b:
            out.append((n.name or f"{n.op_type}_{i}", int(b)))
    return out


def _lib():
    import custom_ops

    lib = custom_ops.load_library()
    fn = lib.ortlean_stream_floor_ns
    fn.restype = ctypes.c_uint64
    fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]
    return fn


def aligned_buffers(sizes) -> list[np.ndarray]:
    """uint8 buffers of ``sizes`` bytes rounded up to 64, 64-byte aligned, filled with random bytes
    (written: a zeroed mapping's untouched pages would all read the one zero page)."""
    from .memory import huge_zeros_many

    sizes = [(int(s) + 63) // 64 * 64 for s in sizes]
    bufs = huge_zeros_many([((s,), np.uint8) for s in sizes])
    if any(b.ctypes.data % 64 for b in bufs):
        raw = np.zeros(sum(sizes) + 64 * (len(sizes) + 1), np.uint8)
        pos, bufs = (-raw.ctypes.data) % 64, []
        for s in sizes:
            bufs.append(raw[pos:pos + s])
            pos += (s + 63) // 64 * 64
    rng = np.random.default_rng(0)
    chunk = 64 << 20  # filled a chunk at a time: no temporary the size of a 1.5B model's weights
    for b in bufs:
        for o in range(0, b.size, chunk):
            b[o:o + chunk] = rng.integers(0, 256, min(chunk, b.size - o), dtype=np.uint8)
    return bufs


def stream_ns(arrays, threads: int, streams: int = 1, pf: int = 0, sync: bool = False) -> tuple[int, int]:
    """(nanoseconds, XOR of every 8-byte word read) of one pass over ``arrays`` (64-byte aligned, sizes
    multiples of 64) by ``threads`` threads; ValueError when the library refuses the arguments."""
    fn = _lib()
    n = len(arrays)
    ptrs = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
    nbytes = (ctypes.c_int64 * n)(*[a.nbytes for a in arrays])
    chk = ctypes.c_uint64(0)
    ns = fn(ptrs, nbytes, n, int(threads), int(streams), int(pf), int(bool(sync)), ctypes.byref(chk))
    if ns == 0:
        raise ValueError(f"ortlean_stream_floor_ns refused {n} buffers, threads {threads}, streams {streams}, pf {pf}")
    return int(ns), int(chk.value)


class FloorRow:
    """A :func:`custom_ops.runtime.bench.decode_table` driver (``extra``) timing the floor of a model's
    weight reads at ``threads`` threads: each decode "step" is one pass over ``arrays``
    (:func:`aligned_buffers` of :func:`weight_reads`' sizes, in its order), with a spin barrier after each
    node's buffer when ``sync``, in the faster of CONFIGS' read patterns — chosen by the first call's steps
    (the table's warm-up round), each of which times every pattern. No prefill sample."""

    def __init__(self, arrays, threads: int, sync: bool):
        self.arrays = list(arrays)
        self.threads, self.sync = int(threads), bool(sync)
        self.bytes = sum(a.nbytes for a in self.arrays)
        self.config: tuple[int, int] | None = None  # (streams, prefetch distance) once chosen

    def prefill(self, ids):
        return None

    def _pass(self, cfg) -> float:
        return stream_ns(self.arrays, self.threads, cfg[0], cfg[1], self.sync)[0] * 1e-9

    def decode(self, p: int, step_ids) -> list[float]:
        n = step_ids.shape[1]
        if self.config is None:
            best = {cfg: min(self._pass(cfg) for _ in range(n)) for cfg in CONFIGS}
            self.config = min(best, key=best.get)
            return [best[self.config]] * n
        return [self._pass(self.config) for _ in range(n)]
