"""The shipped row-skipping matvec alone (no ORT), weights from DRAM: how close the kernel
gets to the ideal time ratio (= keep) before any op or runtime overhead.

    python tests/bench/bench_gather_dram.py [--isa avx512|avx2] [--reps 300]

Compiles tests/bench/gather_dram.cc against cpp/src/kernels/gating_impl.inc with the system C++
compiler (-O3, the ISA's flags, as cpp/CMakeLists.txt builds it) and runs it for K×N in 576×1536,
1536×576, 768×3072 and keep ∈ {0.75, 0.5, 0.25}: eff = keep × dense / gated (1.0 = ideal). The op
benchmark (bench_gating_op.py) measures the same thing inside ONNX Runtime."""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLAGS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma"],
         "avx2": ["-mavx2", "-mfma"]}
SHAPES = [(576, 1536), (1536, 576), (768, 3072)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--isa", default="avx512", choices=list(FLAGS))
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--keeps", default="0.75,0.5,0.25")
    a = ap.parse_args()
    cxx = shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise SystemExit("no C++ compiler found")
    with tempfile.TemporaryDirectory() as d:
        exe = Path(d) / "gather_dram"
        # the defines ortlean_isa_kernels() in cpp/CMakeLists.txt gives each per-ISA copy
        defs = [f"-DORTLEAN_ISA_{a.isa.upper()}=1", f"-DORTLEAN_ISA_NS=g_{a.isa}", f'-DORTLEAN_ISA_NAME="{a.isa}"',
                f"-DORTLEAN_ISA_TABLE(name)=name##_{a.isa}"]
        subprocess.run([cxx, "-O3", "-fno-math-errno", "-std=c++17", *FLAGS[a.isa], *defs,
                        f"-I{ROOT / 'cpp' / 'src'}", str(ROOT / "tests" / "bench" / "gather_dram.cc"), "-o", str(exe)],
                       check=True)
        print(f"{'K x N':>11} {'keep':>5} {'dense us':>9} {'gated us':>9} {'eff':>5}")
        for K, N in SHAPES:
            copies = max(4, -(-(96 << 20) // (K * N * 4)))
            for keep in (float(k) for k in a.keeps.split(",")):
                out = subprocess.run([str(exe), str(K), str(N), str(keep), str(copies), str(a.reps)], check=True,
                                     capture_output=True, text=True).stdout
                r = json.loads(out)
                print(f"{K:>5}x{N:<5} {r['keep']:>5.2f} {r['dense_us']:>9.1f} {r['gated_us']:>9.1f} {r['eff']:>5.2f}")


if __name__ == "__main__":
    main()
