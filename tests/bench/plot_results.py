"""Decode tokens/s against the context, one line per row, from a committed results file (what
``ortlean bench --json`` or ``ortlean demo`` wrote): the same plot the demo draws.

    python tests/bench/plot_results.py tests/bench/results/qwen2.5-coder-1.5b.json \
        tests/bench/results/qwen2.5-coder-1.5b-speed-vs-context.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rewriter import demo  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a results file (schema ortlean-results/1)")
    ap.add_argument("png", help="where the plot goes")
    a = ap.parse_args(argv)
    doc = json.loads(Path(a.results).read_text())
    out = demo.plot(doc, Path(a.png))
    if out is None:
        print("no plot: matplotlib is not installed, or the file has no decode contexts", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
