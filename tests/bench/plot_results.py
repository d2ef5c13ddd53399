"""Decode tokens/s against the context, one line per row, from committed results files (what
``ortlean bench --json`` or ``ortlean demo`` wrote); and, when the files have them (``ortlean bench
--prompt``), the time to first token against the prompt's length in a PNG of its own.

    python tests/bench/plot_results.py tests/bench/results/smollm2.json \
        tests/bench/results/smollm2-speed-vs-context.png
    python tests/bench/plot_results.py RUN1.json RUN2.json ... PNG [--ttft TTFT.png]

The time-to-first-token plot (``demo.plot_ttft``: log-log, one panel per thread count, one line per model,
a later file's cell replacing an earlier one's) goes to ``--ttft``, by default PNG with
``speed-vs-context`` replaced by ``ttft-vs-prompt`` (else ``-ttft`` added to its name); when no file has a
decode context, to PNG itself.

One file: the demo's own plot (the largest thread count). Several files of one model (runs that cover
different contexts or thread counts, each with the peers in the same run): one panel per thread count,
one line per model (its fastest driver in each file), a context measured by several files taken from the
last file given, and every file's commit and date in the caption. Each point is a median of its own run;
ratios between rows are only meaningful within a run, which the files themselves give.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rewriter import demo, results  # noqa: E402


def merge(docs: list[dict]) -> tuple[list[int], dict[int, dict[str, dict]]]:
    """{threads: {model: {"row": a row (its name and side), "dppl": the first Δppl a file gives for the
    model, "pts": {context: tok/s}}}} over the files, a later
    file's cell replacing an earlier one's; and the thread counts."""
    out: dict[int, dict[str, dict]] = {}
    dppl: dict[str, float] = {}
    for d in docs:
        if not d.get("contexts"):
            continue
        for r in results.pick_rows(d):
            for t, per in (r.get("tok_s") or {}).items():
                e = out.setdefault(int(t), {}).setdefault(r["model"], {"row": r, "pts": {}})
                e["pts"].update({int(c): v for c, v in per.items() if v})
            if r.get("delta_ppl") is not None:
                dppl.setdefault(r["model"], r["delta_ppl"])
    for per_t in out.values():   # a model's Δppl is the model's, whichever file measured it
        for name, e in per_t.items():
            e["dppl"] = dppl.get(name)
    return sorted(out), out


def plot_runs(docs: list[dict], path: Path) -> Path | None:
    """One panel per thread count over several results files of one model. None without matplotlib or
    without a decode context in any file."""
    threads, by_t = merge(docs)
    if not threads:
        return None
    return demo.plot_panels(docs, threads, by_t, path, "tokens in the cache before the decode step",
                            lambda t: f"decode tokens/s, {t} thread{'s' if t != 1 else ''}", minor_labels=True)


def ttft_path(png: Path) -> Path:
    """Where the time-to-first-token plot goes beside the decode plot ``png``."""
    if "speed-vs-context" in png.name:
        return png.with_name(png.name.replace("speed-vs-context", "ttft-vs-prompt"))
    return png.with_name(f"{png.stem}-ttft{png.suffix or '.png'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="results files (schema ortlean-results/1), then the PNG")
    ap.add_argument("--ttft", default=None, metavar="PNG", help="the time-to-first-token plot (default: beside PNG)")
    a = ap.parse_args(argv)
    if len(a.results) < 2:
        ap.error("give one or more results files and then the PNG")
    *files, png = a.results
    docs = []
    for f in files:
        doc = json.loads(Path(f).read_text())
        if doc.get("schema") != results.SCHEMA:
            print(f"{f}: schema {doc.get('schema')!r}, expected {results.SCHEMA!r}", file=sys.stderr)
            return 2
        docs.append(doc)
    decode = any(d.get("contexts") for d in docs)
    out = (demo.plot(docs[0], Path(png)) if len(docs) == 1 else plot_runs(docs, Path(png))) if decode else None
    ttft = None
    if any(r.get("ttft") for d in docs for r in d.get("rows") or []):
        ttft = demo.plot_ttft(docs, Path(a.ttft) if a.ttft else ttft_path(Path(png)) if out is not None else Path(png))
    if out is None and ttft is None:
        print("no plot: matplotlib is not installed, or no file has decode contexts or times to first token",
              file=sys.stderr)
        return 1
    for x in (out, ttft):
        if x is not None:
            print(x)
    return 0


if __name__ == "__main__":
    sys.exit(main())
