"""Benchmark results as data: the schema ``ortlean bench --json`` writes, and the markdown table the
README (and docs/) show from committed result files.

A results file (``tests/bench/results/<what it measures>.json``) is the JSON ``ortlean bench --json``
writes: the bench's own keys (``table``, ``notes``, ``decode_profile`` …) plus the keys below, which
are all a reader of the file needs::

    {"schema": "ortlean-results/1",
     "command": "ortlean bench ...",            # the command line that wrote the file
     "commit": "4ec8951…", "commit_dirty": false, # the ortlean checkout it ran from (null: not a git checkout)
     "date": "2026-11-27T10:00:00Z",             # UTC, when the file was written
     "machine": {"cpu": "AMD EPYC 9R14", "cores": 2, "isa": "AVX-512 VNNI",
                 "flags": ["avx2", "fma", "avx512f", ...], "kernels": "avx512", "load_average": [...]},
     "onnxruntime": "1.32.0", "ortlean": "0.1.0",
     "model_name": "smollm2",                    # the packaged model (peers' source), or the model file's stem
     "contexts": [128, 4096, 8176],              # decode pasts (tokens in the cache before each step)
     "threads": [1, 2], "prefill_tokens": 128,
     "quality": {"text": "persuasion.txt", "mode": "...", "tokens": 1024, "ppl_ref": 12.3} | null,
     "rows": [{"name": "long-context",          # the table's row label
               "model": "lean",                 # the bench's variant (rows of one model share it)
               "driver": "shared KV",           # plain loop | shared KV | onnxruntime-genai generator | llama-bench | not timed
               "side": "ours",                  # ours | peer | reference (the dense model: the source weights)
               "what": "ortlean: MatMulNBits int4 x211, PackedAttention pq budget 0.25 x30",
               "path": "...", "weight_bytes": 123,
               "delta_ppl": 0.006, "delta_ppl_upper": 0.011, "ppl": 12.4,   # null when not measured
               "quality_note": null,
               "tok_s": {"1": {"128": 190.2, "4096": 157.6}, "2": {...}},  # decode tokens/s per thread count, per past
               "prefill_tok_s": {"1": 2400.0, "2": 4100.0},
               "cache_bytes_per_token": 15680,   # the model's cache states per cached token (llama.cpp: its f16 K/V)
               "ttft": {"2": {"4096": {"seconds": 38.4, "tok_s": 106.7, "repeats": 2,    # with --prompt: time to
                                       "seconds_all": [38.4, 38.38]}}},                  # first token per thread
                                                                                         # count, per prompt length
               "peak_rss_mb": null}, ...],       # llama.cpp's row: llama-bench's own process
     "prompt_lengths": [4096, 16384],            # with --prompt (else absent): the TTFT prompts' lengths,
     "prompt_text": "Persuasion (the held-out novel)", "prompt_chunk": 512,   # their text and chunk,
     "prompt_repeats": {"4096": 2, "16384": 1},  # timed runs per length (the row's "repeats": its samples)
     "peak_rss_mb": 9216}                        # the bench process after the timed rows (every ONNX row in it)

``render(doc)`` turns a file into the markdown table; ``update(text, root)`` rewrites every table
between ``<!-- results-table src=PATH -->`` and ``<!-- /results-table -->`` in a markdown text from the
file PATH names (relative to the repository root). ``python tests/bench/results_table.py`` applies it
to README.md and docs/*.md (``--check``: exit 1 when a table is not what its file says).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import subprocess
from pathlib import Path

SCHEMA = "ortlean-results/1"
ROOT = Path(__file__).resolve().parent.parent

__all__ = ["SCHEMA", "provenance", "machine", "git_commit", "from_bench", "describe_model", "render", "update",
           "pick_rows", "write_json", "MARKER_RE"]


# --------------------------------------------------------------------------------------------- provenance
def git_commit(root: Path = ROOT, paths: tuple[str, ...] = ()) -> tuple[str | None, bool]:
    """(HEAD's full hash, whether tracked files differ from it) of the checkout holding this package;
    (None, False) when it is not a git checkout (an installed wheel). With ``paths`` (relative to the
    checkout): the last commit that changed any of them, and whether any of them differs from it."""
    try:
        rev = ["log", "-1", "--format=%H", "--", *paths] if paths else ["rev-parse", "HEAD"]
        head = subprocess.run(["git", "-C", str(root), *rev], capture_output=True, text=True, timeout=10)
        if head.returncode != 0 or not head.stdout.strip():
            return None, False
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", *paths],
                               capture_output=True, text=True, timeout=30)
        return head.stdout.strip(), bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, False


def _isa_label(flags: set[str]) -> str:
    """The widest vector ISA the CPU reports, as users name it."""
    if "avx512f" in flags:
        extra = [n for f, n in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16"), ("amx_tile", "AMX")) if f in flags]
        return "AVX-512" + (f" {' '.join(extra)}" if extra else "")
    if "avx2" in flags:
        return "AVX2" + (" AVX-VNNI" if "avx_vnni" in flags else "")
    return "x86-64 (no AVX2)" if flags else "unknown"


def machine() -> dict:
    """CPU model (with its family and model numbers: a VM's model name can be the vendor's alone),
    logical cores, ISA label and the CPU flags that matter to the kernels, the ISA ortlean's kernels
    run at here, and the load average when measured."""
    import platform

    flags: set[str] = set()
    cpu = platform.processor() or platform.machine() or "?"
    fam: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            k = k.strip()
            if k == "flags" and not flags:
                flags = set(v.split())
            elif k == "model name":
                cpu = v.strip()
            elif k in ("cpu family", "model") and k not in fam:
                fam[k] = v.strip()
    except OSError:
        pass
    if fam:
        cpu += f" (family {fam.get('cpu family', '?')} model {fam.get('model', '?')})"
    keep = [f for f in ("avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                        "avx512_vpopcntdq", "avx512_bf16", "amx_tile") if f in flags]
    try:
        import custom_ops

        kernels = custom_ops.isa_label()
    except Exception as e:  # no library: say so instead of a label
        kernels = f"unavailable ({str(e).splitlines()[0][:80]})"
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"cpu": cpu, "cores": os.cpu_count(), "isa": _isa_label(flags), "flags": keep, "kernels": kernels,
            "load_average": load}


def provenance(start: tuple | list | None = None) -> dict:
    """The keys every results file carries: commit, date, machine, onnxruntime and ortlean versions.
    ``start``: git_commit() as it was when the run began. The code that ran is the start's, so commit
    and commit_dirty say the start; when the checkout moved during the run, commit_at_end and
    commit_at_end_dirty say where it ended (a long bench outlives the edits made beside it)."""
    import onnxruntime as ort

    from . import __version__

    commit, dirty = git_commit()
    out = {"schema": SCHEMA, "commit": commit, "commit_dirty": dirty,
           "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "machine": machine(), "onnxruntime": ort.__version__, "ortlean": __version__}
    if start is not None and (start[0], bool(start[1])) != (commit, dirty):
        out.update(commit=start[0], commit_dirty=bool(start[1]), commit_at_end=commit, commit_at_end_dirty=dirty)
    return out


def write_json(path, obj) -> None:
    """``obj`` as indented JSON at ``path``, atomically (a temporary file beside it, then a rename)."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, p)


# --------------------------------------------------------------------------------------------- rows
def describe_model(path: str) -> str:
    """What a rewritten model is, from its graph: ortlean's ops and ORT's quantized / fused ops, with
    the settings that decide speed and quality (e.g. ``MatMulNBits int4 x211, PackedAttention pq
    budget 0.25 x30``)."""
    import onnx
    from onnx import helper

    from custom_ops.schema import DOMAIN

    from .kit.stream import CHEAP_HEAD_IF

    m = onnx.load(str(path), load_external_data=False)
    counts: dict[str, int] = {}
    first: dict[str, dict] = {}
    for n in m.graph.node:
        key = None
        a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        if n.op_type == "MatMulNBits":
            key = f"MatMulNBits int{a.get('bits', 4)}"
        elif n.domain == DOMAIN:
            key = n.op_type
            if n.op_type == "PackedAttention":
                mode = a.get("mode", b"sign")
                mode = mode.decode() if isinstance(mode, bytes) else mode
                b = float(a.get("budget", 0.0))
                kv = a.get("kv_quant", b"none")
                kv = kv.decode() if isinstance(kv, bytes) else kv
                key = (f"PackedAttention exact ({kv} K/V)" if not 0 < b < 1 else
                       f"PackedAttention {mode} budget {b:g} ({kv} K/V)")
                pb = float(a.get("prefill_budget", 0.0))
                if 0 < pb < 1:   # sparse prompts: what they read, from where, and the exact tail
                    key += (f", prompts sparse {pb:g} from {int(a.get('prefill_min_context', 4096)):,} tokens"
                            f" (window {int(a.get('prefill_window', 1024)):,}, tail {int(a.get('prefill_tail', 0))})")
            elif n.op_type in ("BlockQuantMatMul", "BlockQuantGather"):
                fmt = a.get("format", a.get("quant_type", b""))
                fmt = fmt.decode() if isinstance(fmt, bytes) else str(fmt)
                lay = a.get("layout", b"blocks")
                lay = lay.decode() if isinstance(lay, bytes) else str(lay)
                key = f"{n.op_type} {fmt}".strip() + (f" {lay}" if lay != "blocks" else "")
        elif n.op_type in ("GroupQueryAttention", "GatherBlockQuantized"):
            key = n.op_type
        elif n.op_type == "If" and n.name == CHEAP_HEAD_IF:   # --cheap-head: its factor and candidates
            then = next((x.g for x in n.attribute if x.name == "then_branch"), None)
            nodes = list(then.node) if then is not None else []
            lr = next((x for x in nodes if x.op_type == "MatMulNBits"), None)
            la = {x.name: helper.get_attribute_value(x) for x in lr.attribute} if lr is not None else {}
            ks = {t.name: t for t in m.graph.initializer}
            tk = next((x for x in nodes if x.op_type == "TopK"), None)
            cand = ks.get(tk.input[1]) if tk is not None else None
            c = int(onnx.numpy_helper.to_array(cand).reshape(-1)[0]) if cand is not None else None
            key = (f"cheap head rank {la.get('K', '?')} int{la.get('bits', '?')}"
                   + (f", {c:,} exact candidates per decode step" if c else ""))
        if key:
            counts[key] = counts.get(key, 0) + 1
            first.setdefault(key, a)
    if not counts:
        return "fp32 MatMul weights, no ortlean ops"
    return ", ".join(f"{k} x{v}" for k, v in counts.items())


_DRIVERS = {"": "plain loop", "shared KV": "shared KV", "og": "onnxruntime-genai generator"}


def _what(model: str, path: str | None, side: str) -> str:
    if model == "dense":
        try:
            return "the reference (--ref) every Δppl is measured against: " + describe_model(path)
        except Exception:  # moved since the bench
            return "the reference (--ref) every Δppl is measured against"
    if model.startswith("MatMulNBits int"):
        return f"ONNX Runtime's own {model} quantizer applied to the dense model"
    if model.startswith("genai "):
        return f"onnxruntime-genai model builder, {model.split()[1]}, from the same checkpoint"
    if side == "ours" and path:
        try:
            return "ortlean: " + describe_model(path)
        except Exception as e:  # a file that moved since the bench: say so rather than fail the JSON
            return f"ortlean rewrite ({type(e).__name__} reading {Path(path).name})"
    return model


def from_bench(res: dict, command: str | None = None, labels: dict[str, str] | None = None) -> dict:
    """The schema's keys for an ``ortlean bench`` result (causal LM table or encoder runs): provenance,
    contexts and one row per (model, driver), with Δppl from ``res["quality"]`` where it was measured."""
    labels = dict(labels or {})
    ours = set(res.get("ours") or ["lean"])
    variants = res.get("variants") or {"dense": res.get("ref"), "lean": res.get("model")}
    quality = res.get("quality") or {}
    qrows = quality.get("rows") or {}
    rows = []

    def side_of(model):
        return "reference" if model == "dense" else "ours" if model in ours else "peer"

    def base_row(model, driver):
        q = qrows.get(model) or {}
        side = side_of(model)
        name = labels.get(model, model)
        return {"name": name if driver in ("plain loop", "llama-bench", "not timed") else f"{name} ({driver})",
                "model": model, "driver": driver, "side": side, "what": _what(model, variants.get(model), side),
                "path": variants.get(model), "weight_bytes": (res.get("weight_bytes") or {}).get(model),
                "delta_ppl": 0.0 if model == "dense" and quality else q.get("delta_ppl"),
                "delta_ppl_upper": q.get("delta_ppl_upper"), "ppl": q.get("ppl"),
                "quality_note": q.get("note"), "tok_s": {}, "prefill_tok_s": {},
                "cache_bytes_per_token": (res.get("cache_bytes_per_token") or {}).get(model)}

    if "table" in res:  # causal LM: decode_table rows per thread count
        prefill = res["prefill"]
        by_key: dict[str, dict] = {}
        for t, table in res["table"].items():
            tn = t[1:]
            for key, cells in table.items():
                model, _, drv = key.partition(" | ")
                row = by_key.get(key) or by_key.setdefault(key, base_row(model, _DRIVERS.get(drv, drv)))
                row["tok_s"][tn] = {str(p): round(1e3 / cells[f"decode{p}"], 2)
                                    for p in res["pasts"] if cells.get(f"decode{p}")}
                if cells.get("prefill"):
                    row["prefill_tok_s"][tn] = round(prefill * 1e3 / cells["prefill"], 1)
        prompt = res.get("prompt") or {}
        llama_ttft: dict[str, dict] = {}
        for t, table in (prompt.get("table") or {}).items():   # --prompt: the time to first token
            for key, per in table.items():
                cells = {n: _ttft_cell(int(n), v) for n, v in per.items() if v}
                if key == "llama.cpp | llama-bench":   # evaluate.LLAMA_ROW
                    if cells:
                        llama_ttft[t[1:]] = cells
                    continue
                model, _, drv = key.partition(" | ")
                row = by_key.get(key) or by_key.setdefault(key, base_row(model, _DRIVERS.get(drv, drv)))
                if cells:
                    row.setdefault("ttft", {})[t[1:]] = cells
        rows += by_key.values()
        lc = res.get("llama_cpp") or {}
        lrows = lc.get("rows") or []
        linfo = [x for x in (prompt.get("llama_cpp") or {}).values() if x]
        if lrows or llama_ttft or linfo or (qrows.get("llama.cpp") or {}).get("delta_ppl") is not None:
            # (Δppl without speed kept)
            row = base_row("llama.cpp", "llama-bench")
            build = next((x.get("build") for x in lrows + linfo if x.get("build")), "")
            mtype = next((x.get("model_type") for x in lrows + linfo if x.get("model_type")), "")
            peaks = [x for x in [lc.get("peak_rss_mb"), *(i.get("peak_rss_mb") for i in linfo)] if x]
            row.update(side="peer", path=None, weight_bytes=None, cache_bytes_per_token=lc.get("cache_bytes_per_token"),
                       peak_rss_mb=max(peaks) if peaks else None,
                       what=f"llama.cpp ({build.strip()}) on the package's GGUF ({mtype})".replace(" ()", ""),
                       quality_note=(qrows.get("llama.cpp") or {}).get("note") or lc.get("quality_note")
                       or "not measured here (llama.cpp's own runtime)")
            if not lrows and not llama_ttft:
                row["speed_note"] = lc.get("command") or "llama.cpp rows skipped"
            if llama_ttft:
                row["ttft"] = llama_ttft
                row["ttft_commands"] = list(dict.fromkeys(c for i in linfo for c in i.get("commands") or []))
            stops = [i["failed"] for i in linfo if i.get("failed")]
            if stops:
                row["ttft_note"] = "; ".join(stops)
            for x in lrows:
                tn = str(x["threads"])
                if x["test"].startswith("tg"):
                    row["tok_s"].setdefault(tn, {})[str(x.get("depth", 0))] = round(x["tok_s"], 2)
                elif x["test"].startswith("pp") and (tn not in row["prefill_tok_s"] or not x.get("depth")):
                    row["prefill_tok_s"][tn] = round(x["tok_s"], 1)
            # llama-bench's depths are the same pasts as the table's
            rows.append(row)
        timed = {r["model"] for r in rows}
        for model in variants:   # a model measured for quality only (the dense reference under rows=best)
            if model not in timed and (model in qrows or (model == "dense" and quality)):
                rows.append(base_row(model, "not timed"))
        contexts, threads = list(res["pasts"]), list(res["threads"])
    else:  # encoder: prefill (a batch of prefill tokens) per thread count
        by_model: dict[str, dict] = {}
        for run in res.get("runs", []):
            for model, v in run["results"]["sessions"].items():
                row = by_model.get(model) or by_model.setdefault(model, base_row(model, "plain loop"))
                ms = v.get("prefill", {}).get("median_ms")
                if ms:
                    row["prefill_tok_s"][str(run["threads"])] = round(res["prefill"] * 1e3 / ms, 1)
        rows += by_model.values()
        contexts, threads = [], [run["threads"] for run in res.get("runs", [])]
    rows.sort(key=lambda r: SIDE_ORDER[r["side"]])
    out = provenance(res.get("git_start"))
    out.update({"command": command, "model_name": res.get("model_name") or Path(str(res.get("ref", "model"))).stem,
                "contexts": contexts, "threads": threads, "prefill_tokens": res.get("prefill"),
                "quality": ({k: v for k, v in quality.items() if k != "rows"} if quality else None),
                "peak_rss_mb": res.get("peak_rss_mb"), "rows": rows})
    prompt = res.get("prompt") or {}
    if prompt.get("lengths"):
        out.update({"prompt_lengths": list(prompt["lengths"]), "prompt_text": prompt.get("text"),
                    "prompt_chunk": prompt.get("chunk"), "prompt_repeats": dict(prompt.get("repeats") or {})})
    return out


def _ttft_cell(n: int, seconds: list[float]) -> dict:
    """A row's time to first token at one prompt length and thread count: the median of its timed runs."""
    import statistics

    med = float(statistics.median(seconds))
    return {"seconds": round(med, 6), "tok_s": round(n / med, 1), "repeats": len(seconds),
            "seconds_all": [round(float(x), 6) for x in seconds]}


# --------------------------------------------------------------------------------------------- markdown
MARKER_RE = re.compile(r"(<!-- results-table src=(?P<src>\S+) -->\n)(?P<body>.*?)(<!-- /results-table -->)", re.S)


def _fmt_tok(x) -> str:
    return "–" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _fmt_s(x) -> str:
    """Seconds in a table cell: three significant figures or so."""
    return "–" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def _fmt_delta(row) -> str:
    d = row.get("delta_ppl")
    if row["side"] == "reference" and d is not None:
        return "0 (reference)"
    if d is None:
        return "–"
    s = f"{100 * d:+.2f} %"
    if row.get("delta_ppl_upper") is not None:
        s += f" (≤ {100 * row['delta_ppl_upper']:+.2f} %)"
    return s


# the order of a table's rows by side: the reference, the peers, then ours
SIDE_ORDER = {"reference": 0, "peer": 1, "ours": 2}


def pick_rows(doc: dict) -> list[dict]:
    """One row per model for the table: the driver with the most tokens/s at the longest context and
    the most threads (every model gets its own best driver: plain loop, shared KV or genai's generator)."""
    ctx = str(max(doc["contexts"])) if doc.get("contexts") else None
    tmax = str(max(doc["threads"])) if doc.get("threads") else None

    def score(r):
        if ctx is None:   # no decode contexts: the prefill, else the time to first token at the longest prompt
            per = (r.get("ttft") or {}).get(tmax) or {}
            longest = per.get(max(per, key=int)) if per else None
            return (r.get("prefill_tok_s") or {}).get(tmax) or (longest or {}).get("tok_s") or 0.0
        return ((r.get("tok_s") or {}).get(tmax) or {}).get(ctx) or 0.0

    best: dict[str, dict] = {}
    for r in doc["rows"]:
        if r["model"] not in best or score(r) > score(best[r["model"]]):
            best[r["model"]] = r
    return sorted((r for r in doc["rows"] if best.get(r["model"]) is r), key=lambda r: SIDE_ORDER.get(r["side"], 1))


def render(doc: dict, src: str = "") -> str:
    """The markdown table of a results file: one row per model (its fastest driver), Δppl beside
    decode tokens/s after each context at each thread count, and a line saying where and how it ran."""
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{src or 'results'}: schema {doc.get('schema')!r}, expected {SCHEMA!r}")
    if doc.get("task") == "needle":
        return render_needle(doc)
    ctxs, threads = doc.get("contexts") or [], [str(t) for t in doc.get("threads") or []]
    picked = pick_rows(doc)
    # the time to first token (--prompt): a column group per thread count, each model's TTFT row (the
    # driver it generates with) whichever row the decode columns picked
    prompts = [int(n) for n in doc.get("prompt_lengths") or []]
    ttft_of: dict[str, dict] = {}
    for r in doc["rows"]:
        if r.get("ttft") and (r["model"] not in ttft_of or r in picked):
            ttft_of[r["model"]] = r["ttft"]
    with_ttft = bool(prompts and ttft_of)
    with_prefill = any(r.get("prefill_tok_s") for r in picked) or not with_ttft
    head = ["", "what it is", "Δppl"]
    if ctxs:
        head += [f"decode tok/s, {t} thread{'s' if t != '1' else ''}: after {' / '.join(f'{c:,}' for c in ctxs)}"
                 for t in threads]
    if with_prefill:
        head += [f"prefill tok/s ({doc.get('prefill_tokens')} tokens), {' / '.join(threads)} "
                 f"thread{'s' if threads != ['1'] else ''}"]
    if with_ttft:
        head += [f"TTFT s, {t} thread{'s' if t != '1' else ''}: {' / '.join(f'{n:,}' for n in prompts)}"
                 for t in threads]
    # the cache a token costs, against the reference's (fp32 K/V): in files that have it
    fp32 = next((r.get("cache_bytes_per_token") for r in picked if r["side"] == "reference"), None)
    with_cache = any(r.get("cache_bytes_per_token") for r in picked)
    if with_cache:
        head += ["cache bytes / token" + (" (x fp32)" if fp32 else "")]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["--:"] * (len(head) - 2)) + "|"]
    notes = []
    for r in picked:
        name = f"**{r['name']}**" if r["side"] == "ours" else r["name"]
        if r["driver"] not in ("plain loop", "llama-bench", "not timed") and f"({r['driver']})" not in name:
            name += f" ({r['driver']})"
        delta = _fmt_delta(r)
        if r.get("delta_ppl") is None and r.get("quality_note"):
            notes.append(r["quality_note"])
            delta += "¹" if len(notes) == 1 else f"{len(notes)}"
        cells = [name, r["what"], delta]
        for t in threads if ctxs else []:
            per = (r.get("tok_s") or {}).get(t) or {}
            cells.append(" / ".join(_fmt_tok(per.get(str(c))) for c in ctxs))
        if with_prefill:
            cells.append(" / ".join(_fmt_tok((r.get("prefill_tok_s") or {}).get(t)) for t in threads))
        for t in threads if with_ttft else []:
            per = (ttft_of.get(r["model"]) or {}).get(t) or {}
            cells.append(" / ".join(_fmt_s((per.get(str(n)) or {}).get("seconds")) for n in prompts))
        if with_cache:
            cb = r.get("cache_bytes_per_token")
            cells.append("–" if not cb else f"{cb:,}" + (f" ({cb / fp32:.2f}x)" if fp32 else ""))
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    m = doc.get("machine") or {}
    q = doc.get("quality")
    commit = (doc.get("commit") or "unknown")[:10] + (" (modified)" if doc.get("commit_dirty") else "")
    cap = (f"Measured {doc.get('date', '?')[:10]} at commit {commit} on {m.get('cpu', '?')}, "
           f"{m.get('cores', '?')} logical cores, {m.get('isa', '?')} (ortlean kernels: {m.get('kernels', '?')}), "
           f"onnxruntime {doc.get('onnxruntime', '?')}. ")
    if q:
        cap += (f"Δppl: perplexity on {q.get('tokens', 0):,} tokens of {q.get('text', '?')} ({q.get('mode', '?')}) "
                "against the reference row; ≤: its one-sided 95 % upper bound. ")
    else:
        cap += "Δppl not measured in this run (`--quality-text`). "
    if ctxs or not with_ttft:
        cap += ("Decode: tokens/s of single-token steps after the given number of cached tokens; rows interleaved "
                "in one process; each row with its fastest driver.")
    if with_ttft:
        reps = doc.get("prompt_repeats") or {}
        runs = ", ".join(f"{int(n):,}: {k}" for n, k in reps.items())
        cap += ((" " if ctxs else "") + f"TTFT: seconds from an empty cache to the first new token's logits after a "
                f"prompt of the given number of tokens (the first tokens of {doc.get('prompt_text') or 'a text'}; llama.cpp: "
                "`llama-bench -p N -n 0` on its own tokens), each row as it generates (ours: `ortlean generate`'s chunked prefill; genai: "
                "its generator), rows interleaved in one process"
                + (f"; medians of the timed runs per length ({runs})" if runs else "") + ".")
    if doc.get("peak_rss_mb"):
        llama_rss = next((r.get("peak_rss_mb") for r in picked if r.get("driver") == "llama-bench"), None)
        cap += (f" Peak RSS {doc['peak_rss_mb'] / 1024:.1f} GiB for every ONNX row together (one process, each "
                "row's weights and caches at every context)"
                + (f"; llama-bench's own process {llama_rss / 1024:.1f} GiB" if llama_rss else "") + ".")
    lines += ["", cap]
    if doc.get("command"):
        lines += ["", f"`{doc['command']}`"]
    for i, n in enumerate(notes, 1):
        lines += ["", f"{i}. {n}" if len(notes) > 1 else f"¹ {n}"]
    return "\n".join(lines) + "\n"


def _where(doc: dict) -> str:
    m = doc.get("machine") or {}
    load = m.get("load_average")
    return (f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('isa', '?')} (kernels {m.get('kernels', '?')})"
            + (f", load {load[0]:.1f} at the start" if load else "")
            + f"; commit {str(doc.get('commit') or '?')[:10]}{' + local changes' if doc.get('commit_dirty') else ''}"
            f", {doc.get('date', '?')}, onnxruntime {doc.get('onnxruntime', '?')}")


def render_needle(doc: dict) -> str:
    """The table of an ``ortlean eval --task needle --json`` file: per kind and length, the model's hits
    / the reference's at each depth, then the needles the reference found and the model lost."""
    depths, cells = doc.get("depths") or [], doc.get("cells") or []
    at = {(c["kind"], c["length"], c["depth"]): c for c in cells}
    head = ["kind", "length"] + [f"depth {d:g}" for d in depths] + ["hits / ref", "lost"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "--:|" * (len(depths) + 2)]
    for kind in doc.get("kinds") or []:
        for n in doc.get("lengths") or []:
            row = [at.get((kind, n, d)) for d in depths]
            got = [c for c in row if c]
            if not got:
                continue
            hits, ref, lost = (sum(c[k] for c in got) for k in ("hits", "ref_hits", "lost"))
            lines.append("| " + " | ".join([kind, f"{n:,}"] + [f"{c['hits']}/{c['ref_hits']}" if c else "–"
                                                                  for c in row]
                                            + [f"{hits}/{ref}", f"**{lost}**" if lost else "0"]) + " |")
    s = doc.get("summary") or {}
    model, ref = Path(str(doc.get("model", "?"))), Path(str(doc.get("ref", "?")))
    cap = (f"Cells: the model's hits / the reference's ({doc.get('cases_per_cell', 1)} case a cell); "
           f"{s.get('cases', '?')} cases, hits {s.get('hits', '?')} (reference {s.get('ref_hits', '?')}), "
           f"**lost {s.get('lost', '?')}** (needles the reference found and the model did not), gained "
           f"{s.get('gained', '?')}. Model {model.parent.name}/{model.name}, reference {ref.parent.name}/{ref.name}, "
           f"haystack {doc.get('text_name', '?')}. {_where(doc)}.")
    lines += ["", cap]
    if doc.get("command"):
        lines += ["", f"`{doc['command']}`"]
    return "\n".join(lines) + "\n"


def _placeholder(src: str) -> str:
    return (f"*No results committed yet: the command above writes `{src}`; "
            "`python tests/bench/results_table.py` then fills this table.*\n")


def update(text: str, root: Path = ROOT) -> tuple[str, list[str]]:
    """``text`` with every results table rewritten from its source file; and the sources whose table
    changed. A missing source file gives a line saying which command fills it (never old figures)."""
    changed = []

    def sub(m):
        src = m.group("src")
        p = root / src
        body = render(json.loads(p.read_text()), src) if p.is_file() else _placeholder(src)
        if body != m.group("body"):
            changed.append(src)
        return m.group(1) + body + m.group(4)

    return MARKER_RE.sub(sub, text), changed
