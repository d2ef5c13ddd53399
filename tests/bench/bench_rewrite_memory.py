"""Peak memory and wall time of ``ortlean rewrite`` on one model (issue 35 item 3), against the bound
peak RSS <= 2 x the output model's bytes + 2 GiB.

    python tests/bench/bench_rewrite_memory.py MODEL.onnx [REWRITE FLAGS ...] [--out DIR] [--json PATH]
    python tests/bench/bench_rewrite_memory.py $(ortlean models path qwen2.5-coder-1.5b) \\
        --weights int4 --calib-text $(ortlean corpus --calib)

The rewrite runs in a child process (``python -m rewriter.cli rewrite MODEL -o DIR/model.onnx FLAGS
--report DIR/report.json``); its peak RSS comes from the kernel (``os.wait4``'s ru_maxrss: the
child's own high-water mark, memory-mapped file pages included), its RSS is also sampled every
0.2 s (anonymous and file-backed parts, for the timeline in the JSON), the wall time is the
child's; its output goes to DIR/rewrite.log as it runs. The output's bytes are every file the rewrite wrote for the model (``model.onnx`` and its
external data). Printed: peak, wall, output bytes, the bound and whether it held, and the
rewrite's own stage table (seconds and peak RSS at the end of each stage). Run it on an otherwise
idle machine for figures to report; ``--json`` keeps them with commit, machine and date.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def proc_status(pid) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile and VmHWM of process ``pid`` (or "self"), bytes; {} when /proc cannot say."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for ln in fh:
                k, _, v = ln.partition(":")
                if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                    out[k] = int(v.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def run(model: str, flags: list[str], out_dir: Path, interval: float = 0.2) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "model.onnx"
    report = out_dir / "report.json"
    cmd = [sys.executable, "-m", "rewriter.cli", "rewrite", model, "-o", str(out), *flags, "--report", str(report)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    t0 = time.monotonic()
    log = open(out_dir / "rewrite.log", "wb")     # the rewrite's own output, as it goes
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT)
    samples: list[tuple[float, int, int]] = []
    done = threading.Event()

    def sample():
        while not done.wait(interval):
            s = proc_status(proc.pid)
            if s:
                samples.append((round(time.monotonic() - t0, 2), s.get("RssAnon", 0), s.get("RssFile", 0)))

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    _, status, usage = os.wait4(proc.pid, 0)
    log.close()
    text = (out_dir / "rewrite.log").read_text(errors="replace")
    wall = time.monotonic() - t0
    done.set()
    th.join()
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        tail = "\n".join(text.strip().splitlines()[-15:])
        raise SystemExit(f"the rewrite failed (exit {rc}):\n{tail}")
    written = json.loads(report.read_text()).get("written", []) if report.is_file() else []
    files = [Path(p) for p in written if Path(p).suffix in (".onnx", ".data") or Path(p).name.endswith((".onnx_data", ".onnx.data"))]
    out_bytes = sum(p.stat().st_size for p in files if p.is_file())
    peak = usage.ru_maxrss * 1024
    bound = 2 * out_bytes + 2 * GIB
    rep = json.loads(report.read_text()) if report.is_file() else {}
    return {"command": " ".join(["ortlean", "rewrite", model, "-o", str(out), *flags]),
            "peak_rss_bytes": peak, "wall_s": round(wall, 1), "output_bytes": out_bytes,
            "output_files": [str(p) for p in files], "bound_bytes": bound, "within_bound": peak <= bound,
            "peak_anon_sampled": max((a for _, a, _ in samples), default=0),
            "peak_file_sampled": max((f for _, _, f in samples), default=0),
            "stages": rep.get("resources", {}).get("stages", []),
            "timeline": samples[:: max(1, len(samples) // 400)],
            "last_lines": text.strip().splitlines()[-3:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--out", help="output directory (default: a temporary one, removed after)")
    ap.add_argument("--json", help="write the figures here (with commit, machine and date)")
    a, flags = ap.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-rewrite-mem-") as tmp:
        res = run(a.model, flags, Path(a.out) if a.out else Path(tmp))
    print(res["command"])
    for s in res["stages"]:
        print(f"  {s['stage']:<18} {s['seconds']:8.1f} s   peak so far {s['peak_rss_mb'] / 1024:6.2f} GiB   "
              f"RSS after {s['rss_mb'] / 1024:6.2f} GiB")
    print(f"peak RSS {res['peak_rss_bytes'] / GIB:.2f} GiB (sampled: anonymous {res['peak_anon_sampled'] / GIB:.2f}, "
          f"file-backed {res['peak_file_sampled'] / GIB:.2f}), wall {res['wall_s']:.1f} s, output "
          f"{res['output_bytes'] / GIB:.2f} GiB; bound 2 x output + 2 GiB = {res['bound_bytes'] / GIB:.2f} GiB: "
          + ("within" if res["within_bound"] else "OVER"))
    if a.json:
        sys.path.insert(0, str(ROOT))
        from rewriter import results

        results.write_json(a.json, {**results.provenance(), "bench": "rewrite_memory", **res})
    return 0 if res["within_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())
