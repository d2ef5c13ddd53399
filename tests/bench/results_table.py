"""Rewrite the results tables in README.md and docs/*.md from the committed result files.

    python tests/bench/results_table.py            # rewrite every table from its file
    python tests/bench/results_table.py --check    # exit 1 when a table differs from its file

A table sits between ``<!-- results-table src=tests/bench/results/<file>.json -->`` and
``<!-- /results-table -->``; its file is what ``ortlean bench ... --json <file>`` wrote (the schema:
``rewriter/results.py``, docs/benchmarking.md). A file that does not exist yet gives a line saying
so instead of a table: no figure in a table is typed in by hand.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rewriter import results  # noqa: E402


def documents(root: Path = ROOT) -> list[Path]:
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.is_file()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when a table is stale")
    ap.add_argument("--root", default=str(ROOT), help="repository root (default: this checkout)")
    a = ap.parse_args(argv)
    root = Path(a.root)
    stale = []
    for doc in documents(root):
        text = doc.read_text()
        new, changed = results.update(text, root)
        for src in changed:
            stale.append(f"{doc.relative_to(root)}: the table from {src}")
        if changed and not a.check:
            doc.write_text(new)
    if a.check:
        for s in stale:
            print(f"stale: {s} (run python tests/bench/results_table.py)", file=sys.stderr)
        return 1 if stale else 0
    for s in stale:
        print(f"rewrote {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
