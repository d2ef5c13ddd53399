"""TTMatMul alone vs dense ORT MatMul at the ranks a rewrite chose (or given shapes/ranks):
time ratio against the flop ratio, measured in the same process, sessions interleaved.

    python tests/bench/bench_tt_kernel.py --report /tmp/lean/report.json [--threads 1,2]
    python tests/bench/bench_tt_kernel.py --shape 576x1536 --ranks 64,128,256

Ideal: speedup ≈ flop ratio (dense K·N / factored multiply-adds per row)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rewriter.backends.tt import measure_tt  # noqa: E402
from rewriter.builders.tt import choose_modes, tt_macs  # noqa: E402


def cases_from_report(path: str):
    rep = json.loads(Path(path).read_text())
    seen = set()
    for L in rep["layers"]:
        if L["backend"] != "tt":
            continue
        K, N = L["shape"]
        ranks = L["rank"]
        d = len(ranks) - 1
        if d == 2:
            mk, mn = [K, 1], [1, N]
        else:  # modes are in the model attributes; reports list ranks only → re-derive like the builder
            mk, mn = choose_modes(K, N, d)
        key = (K, N, tuple(ranks))
        if key not in seen:
            seen.add(key)
            yield K, N, mk, mn, list(ranks)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", help="a rewrite --report JSON: bench every distinct (shape, ranks) it factored")
    ap.add_argument("--shape", help="KxN (with --ranks): low-rank cases")
    ap.add_argument("--ranks", default="64,128,256")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--M", default="1,128")
    args = ap.parse_args()
    if args.report:
        cases = list(cases_from_report(args.report))
    elif args.shape:
        K, N = map(int, args.shape.lower().split("x"))
        cases = [(K, N, [K, 1], [1, N], [1, int(r), 1]) for r in args.ranks.split(",")]
    else:
        ap.error("--report or --shape")
    Ms = [int(m) for m in args.M.split(",")]
    print(f"{'K x N':>11} {'ranks':>14} {'thr':>3} {'M':>4} {'dense us':>9} {'tt us':>9} {'speedup':>8} {'flop ratio':>10} {'of ideal':>8}")
    for K, N, mk, mn, ranks in cases:
        ideal = K * N / tt_macs(mk, mn, ranks)
        for t in (int(x) for x in args.threads.split(",")):
            res = measure_tt(K, N, mk, mn, ranks, Ms=Ms, threads=t, use_cache=False)
            for M in Ms:
                r = res[M]
                print(f"{K:>5}x{N:<5} {','.join(map(str, ranks)):>14} {t:>3} {M:>4} {1e6 * r['dense']:>9.1f} {1e6 * r['tt']:>9.1f} "
                      f"{r['speedup']:>7.2f}x {ideal:>9.2f}x {r['speedup'] / ideal:>7.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
