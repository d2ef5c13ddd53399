"""custom_ops.runtime.floor: the weights floor `ortlean bench` prints beside a decode step (the library's
ortlean_stream_floor_ns reads every byte it is given; weight_reads lists a step's product weights)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from custom_ops.runtime import floor


def _xor(arrays) -> int:
    x = 0
    for a in arrays:
        x ^= int(np.bitwise_xor.reduce(a.view(np.uint64)))
    return x


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("streams,pf", [(1, 0), (8, 1024), (3, 64)])
@pytest.mark.parametrize("sync", [False, True])
def test_every_byte_is_read(threads, streams, pf, sync):
    """Sizes of 1 line, 7 lines, lines not a multiple of threads x streams and a 1 MiB buffer: the XOR of
    every word read is the buffers' own (a share or a stream left out, or read twice, changes it)."""
    arrays = floor.aligned_buffers([64, 7 * 64, 1001 * 64 + 5, (1 << 20) + 3 * 64])
    assert [a.nbytes for a in arrays] == [64, 448, 64128, (1 << 20) + 192]   # rounded up to whole lines
    assert all(a.ctypes.data % 64 == 0 for a in arrays) and all(a.any() for a in arrays)
    ns, chk = floor.stream_ns(arrays, threads, streams, pf, sync)
    assert ns > 0 and chk == _xor(arrays)
    # one line changed in the last share of the big buffer: the checksum follows it
    arrays[3][-64:] ^= 0x5A
    assert floor.stream_ns(arrays, threads, streams, pf, sync)[1] == _xor(arrays)


def test_the_callers_cpu_mask_comes_back():
    """The pass pins its threads one CPU each (the caller's thread too, for the pass only): the calling
    thread's mask is the same after it, whatever the thread count."""
    import os

    arrays = floor.aligned_buffers([64 * 999])
    before = os.sched_getaffinity(0)
    for threads in (1, 2, len(before) + 1):   # more threads than CPUs: none pinned
        for sync in (False, True):
            assert floor.stream_ns(arrays, threads, 8, 1024, sync)[1] == _xor(arrays)
            assert os.sched_getaffinity(0) == before


def test_bad_arguments_are_refused_not_read():
    a = floor.aligned_buffers([256])[0]
    with pytest.raises(ValueError, match="refused"):
        floor.stream_ns([a[64:128 + 1]], 1)   # not a whole number of lines
    with pytest.raises(ValueError, match="refused"):
        floor.stream_ns([a[1:65]], 1)         # not 64-byte aligned
    with pytest.raises(ValueError, match="refused"):
        floor.stream_ns([a], 0)
    with pytest.raises(ValueError, match="refused"):
        floor.stream_ns([a], 1, streams=0)


def test_weight_reads_lists_the_products_in_graph_order(tmp_path):
    """A product's constant inputs (weight and bias) count, once per node: a tied matrix read by two
    nodes twice; a lookup of the same matrix (Gather), a product of two activations and an
    elementwise op on a constant do not. External data is sized from the file."""
    W = numpy_helper.from_array(np.ones((32, 48), np.float32), "W")          # 6,144 bytes
    b = numpy_helper.from_array(np.ones((48,), np.float32), "b")             # 192
    V = numpy_helper.from_array(np.ones((48, 32), np.float32), "V")          # 6,144, stored outside
    g = numpy_helper.from_array(np.ones((32,), np.float32), "g")
    nodes = [helper.make_node("Gather", ["W", "ids"], ["e"], name="embed"),
             helper.make_node("Mul", ["e", "g"], ["e2"], name="scale"),
             helper.make_node("Gemm", ["e2", "W", "b"], ["h"], name="up"),
             helper.make_node("MatMul", ["h", "V"], ["o"], name="down"),
             helper.make_node("MatMul", ["o", "o2"], ["p"], name="act_product"),
             helper.make_node("MatMul", ["p", "W"], ["y"], name="head")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1]),
                                           helper.make_tensor_value_info("o2", TensorProto.FLOAT, [32, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=[W, b, V, g])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.external_data_helper.convert_model_to_external_data(m, all_tensors_to_one_file=True, location="w.bin",
                                                             size_threshold=6000)
    onnx.save(m, str(tmp_path / "m.onnx"))
    assert floor.weight_reads(tmp_path / "m.onnx") == [("up", 6144 + 192), ("down", 6144), ("head", 6144)]


def test_floor_row_times_each_step_in_the_pattern_its_first_call_chose():
    arrays = floor.aligned_buffers([4096, 64 * 1000])
    for sync in (False, True):
        row = floor.FloorRow(arrays, 2, sync)
        assert row.prefill(None) is None and row.bytes == 4096 + 64000 and row.config is None
        t = row.decode(128, np.zeros((1, 3), np.int64))   # the warm-up call times every pattern
        assert row.config in floor.CONFIGS and len(t) == 3 and all(0 < x < 1 for x in t)
        calls = []
        real = floor.stream_ns
        floor.stream_ns = lambda *a, **k: calls.append(a[2:4]) or real(*a, **k)
        try:
            t = row.decode(256, np.zeros((1, 4), np.int64))
        finally:
            floor.stream_ns = real
        assert len(t) == 4 and all(0 < x < 1 for x in t) and calls == [row.config] * 4
