"""The C helpers of tests/bench/attn_speed.py (tests/bench/attn_stream.c) read what they claim: the
streaming bound's loop, the gather of candidate rows and the latency chase (their results are the
xor of the bytes read, or the cycle's end, so a loop that skipped bytes would be seen)."""
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "bench"))

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    import attn_speed

    return attn_speed._stream_lib(tmp_path_factory.mktemp("stream"))  # every helper's ctypes signature set


def _xor(words: np.ndarray) -> int:
    return int(np.bitwise_xor.reduce(words.reshape(-1))) if words.size else 0


@pytest.mark.parametrize("ahead", [0, 1, 8, 64])
@pytest.mark.parametrize("row_bytes,n", [(128, 1), (128, 37), (96, 50), (32, 5)])
def test_gather_rows_reads_every_listed_row(lib, ahead, row_bytes, n):
    rng = np.random.default_rng(row_bytes + n)
    buf = rng.integers(0, 2**63, size=4096, dtype=np.uint64)  # 32 KiB
    nrows = buf.nbytes // row_bytes
    rows = np.sort(rng.choice(nrows, n, replace=False)).astype(np.uint64)
    offs = np.ascontiguousarray(rows * np.uint64(row_bytes))
    w = row_bytes // 8
    want = _xor(np.concatenate([buf[int(r) * w:(int(r) + 1) * w] for r in rows]))
    assert lib.gather_rows(buf.ctypes.data, offs.ctypes.data, n, row_bytes, ahead) == want
    # a row listed twice cancels out: the loop reads each listed row once, whole
    twice = np.ascontiguousarray(np.repeat(offs, 2))
    assert lib.gather_rows(buf.ctypes.data, twice.ctypes.data, 2 * n, row_bytes, ahead) == 0


def test_stream_read_and_chase(lib):
    import ctypes

    rng = np.random.default_rng(3)
    buf = rng.integers(0, 2**63, size=1000, dtype=np.uint64)
    ptrs = (ctypes.c_void_p * 1)(buf.ctypes.data)
    assert lib.stream_read(ptrs, 1, 3, 997) == _xor(buf[3:])
    for threads in (1, 2, 3):   # both threaded readers read every word of their range once
        assert lib.stream_read_mt(ptrs, 1, 1000, threads) > 0
        assert lib.stream_read4_mt(ptrs, 1, 1000, threads, 256) > 0
    bufs = [rng.integers(0, 2**63, size=1000, dtype=np.uint64) for _ in range(5)]
    ptrs5 = (ctypes.c_void_p * 5)(*[b.ctypes.data for b in bufs])
    for threads in (1, 2, 3):   # the per-buffer barrier lets every thread through every buffer (no hang)
        for pf in (0, 256):
            assert lib.stream_sync_mt(ptrs5, 5, 1000, threads, pf) > 0
    assert lib.stream_read4(ptrs, 1, 0, 1000, 256) == _xor(buf)
    assert lib.stream_read4(ptrs, 1, 8, 992, 4096) == _xor(buf[8:])
    lines = 64
    perm = rng.permutation(lines).astype(np.uint64)
    cyc = np.zeros(lines * 8, dtype=np.uint64)
    cyc.reshape(lines, 8)[perm, 0] = np.roll(perm, -1) * np.uint64(8)
    start = int(perm[0]) * 8
    assert lib.chase(cyc.ctypes.data, start, 5) == int(perm[5]) * 8
    assert lib.chase(cyc.ctypes.data, start, lines) == start  # one full cycle


def test_gather_rows_driver(lib):
    """attn_speed.py memory's gather rows: fresh regions per pass, a too-small buffer refused, and
    vs_stream = the row's time over streaming its bytes at the given rate."""
    import attn_speed

    buf = np.zeros((2 * 2 * 6) * 64 * 128 // 8, dtype=np.uint64)  # exactly the regions 2 passes x 6 distances need
    g = attn_speed._gather_rows(lib, buf, 1, 10.0, region_rows=64, per_region=8, row_bytes=128, regions=2)
    assert g["rows"] == 16 and set(g["ahead"]) == {"0", "8", "16", "32", "64", "128"}
    for r in g["ahead"].values():
        assert r["ns_per_row"] > 0 and r["vs_stream"] == pytest.approx(r["ns_per_row"] / 12.8, rel=0.02, abs=0.01)
    with pytest.raises(SystemExit, match="too small"):
        attn_speed._gather_rows(lib, buf[: buf.size // 2], 1, 10.0, region_rows=64, per_region=8, row_bytes=128,
                                regions=2)
