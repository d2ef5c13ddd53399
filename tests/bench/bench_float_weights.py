"""``--weights int4`` on a float checkpoint (issue 34 item 3): every quantizer recipe on SmolLM2-135M
treated as a float checkpoint (its optimum export, no GGUF), against ONNX Runtime's round-to-nearest
MatMulNBits int4 and onnxruntime-genai's best-quality int4 model (builder ``--extra_options
algo_config=k_quant_mixed``).

    python tests/bench/bench_float_weights.py [--threads 1,2] [--past 128] [--repeats 15]
        [--recipes nbits,rtn,hqq,kquant,gptq,mix] [--budgets 0.02,0.1] [--work DIR] [--json FILE]
    python tests/bench/bench_float_weights.py --quick     # a check that it runs end to end, not a result

Rows (each an ``ortlean rewrite`` of the optimum export, default fusion, ``--attn-exact off`` so that every
row keeps ONNX Runtime's GroupQueryAttention — as genai's models do — and differs from the others in its
weights only; calibrated on ``ortlean corpus --calib``; the rewrite's own command is in the JSON):

- ``MatMulNBits RTN int4``: ``--weights int4 --weights-quantizer nbits --quality-budget off`` (the
  reference row: speeds are relative to it);
- ``<quantizer> 4-bit``: ``--weights int4 --weights-quantizer Q --quality-budget off`` for Q in rtn,
  hqq, kquant, gptq: every layer at its 4-bit default (the lowest-gap option at ≤ 4.5 bits/weight);
- ``mix @ B``: ``--weights int4 --quality-budget B`` (quantizer auto): the planner's mix for budget B;
- ``genai int4-k_quant_mixed`` (and the bench's own ``genai fp32`` / ``genai int4`` peer rows), in our
  plain loop and in genai's own generator (``| og``).

Per row: stored bits per weight of the weight MatMuls (head included; a tied embedding reading the
head's blocks adds none), the model's bytes (initializers, external data included), Δppl on held-out
Persuasion (``ortlean eval``'s measurement: 8 windows of 512 tokens, against the fp32 export) and
decode tok/s after a past of ``--past`` tokens at each thread count (``ortlean bench``'s interleaved
decode table, medians) with its ratio to the RTN row. The JSON carries commit, machine and date
(rewriter.results.provenance); it is written where --json says (nothing is written otherwise).
Run it alone on the machine: the timings are only as quiet as the machine is.

A rewritten model is reused from ``--work`` only when its flags and the code that writes a model (the last
commit that changed rewriter/, custom_ops/, models/ or cpp/, none of them modified) are the ones it was
written with. ``--quick`` (rows nbits, rtn and the mix at 0.1; 1,024 calibration tokens;
1 thread, 3 repeats; its own work directory) checks the script, its JSON says ``"quick": true``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def weight_bits(path: Path) -> dict:
    """Stored bits per weight over the weight MatMuls of a model (MatMulNBits: blocks, scales, zero
    points; BlockQuantMatMul: its blocks; a float MatMul: 32), the head included; formats counted."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(path), load_external_data=False)
    base = path.parent
    init = {t.name: t for t in m.graph.initializer}

    def nbytes(name):
        from custom_ops.runtime.weights import _tensor_nbytes

        return _tensor_nbytes(init[name], base) if name in init else 0

    bits = params = 0
    formats: dict[str, int] = {}
    for n in m.graph.node:
        a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
        if n.op_type == "MatMulNBits":
            k = f"MatMulNBits int{a['bits']}"
            bits += 8 * sum(nbytes(x) for x in n.input[1:4] if x)
            params += a["K"] * a["N"]
        elif n.op_type == "BlockQuantMatMul":
            f = a["format"].decode() if isinstance(a["format"], bytes) else a["format"]
            k = f + (f"/{a['block_size']}" if f == "q4_f" else "")
            bits += 8 * nbytes(n.input[1])
            params += a["K"] * a["N"]
        elif n.op_type == "MatMul" and n.input[1] in init and len(init[n.input[1]].dims) == 2:
            k = "fp32"
            t = init[n.input[1]]
            bits += 32 * t.dims[0] * t.dims[1]
            params += t.dims[0] * t.dims[1]
        else:
            continue
        formats[k] = formats.get(k, 0) + 1
    _ = numpy_helper
    return {"bits_per_weight": bits / max(params, 1), "params": params, "formats": formats}


# what a rewritten model depends on besides its flags (the benchmark scripts and docs do not count)
WRITER_PATHS = ("rewriter", "custom_ops", "models", "cpp", "CMakeLists.txt", "pyproject.toml")


def rewrite(dense: Path, out: Path, flags: list[str]) -> dict:
    """``ortlean rewrite dense -o out FLAGS`` in this process. An existing output is reused (with its
    report) only when it was written with the same flags by the same code: the last commit that changed
    the code that writes a model (WRITER_PATHS), none of it modified (its ``.bench.json``). Returns the
    report."""
    from rewriter import cli, results

    rep = out.with_suffix(".report.json")
    stamp = out.with_suffix(".bench.json")
    commit, dirty = results.git_commit(paths=WRITER_PATHS)
    key = {"flags": flags, "commit": commit}
    if commit and not dirty and out.is_file() and rep.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == key:
        print(f"[bench] reusing {out.name} (same flags, commit {commit[:12]})", file=sys.stderr, flush=True)
        return json.loads(rep.read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    t0 = time.monotonic()
    rc = cli.main(["rewrite", str(dense), "-o", str(out), "--report", str(rep), "-q", *flags])
    if rc != 0:
        raise SystemExit(f"ortlean rewrite {' '.join(flags)} exited {rc}")
    print(f"[bench] rewrote {out.name} in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    results.write_json(stamp, key)
    return json.loads(rep.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default=None, help="thread counts (default 1,2; --quick 1)")
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=None, help="default 15; --quick 3")
    ap.add_argument("--recipes", default=None, help="of nbits,rtn,hqq,kquant,gptq,mix (default all; --quick nbits,rtn,mix)")
    ap.add_argument("--budgets", default=None, help="the mix's --quality-budget values (default 0.02,0.1; --quick 0.1)")
    ap.add_argument("--calib-tokens", type=int, default=None, help="the rewrites' --calib-tokens (default the "
                    "rewrite's 4096; --quick 1024)")
    ap.add_argument("--quick", action="store_true", help="a reduced run that checks the script end to end (not a result)")
    ap.add_argument("--work", default=None, help="directory of the rewritten models (default: the ortlean cache)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    quick = dict(threads="1", repeats=3, recipes="nbits,rtn,mix", budgets="0.1", calib_tokens=1024)
    full = dict(threads="1,2", repeats=15, recipes="nbits,rtn,hqq,kquant,gptq,mix", budgets="0.02,0.1", calib_tokens=None)
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)

    from models import corpus, peers, prepare
    from models.cache import cache_root
    from rewriter import evaluate, results

    threads = [int(t) for t in a.threads.split(",")]
    recipes = a.recipes.split(",")
    dense = prepare.prepare("smollm2") / "model.onnx"
    novels = corpus.novels()
    calib, held = novels[corpus.CALIB_NOVEL], novels[corpus.EVAL_NOVEL]
    work = Path(a.work) if a.work else cache_root() / ("bench-float-weights" + ("-quick" if a.quick else ""))
    rows: dict[str, dict] = {}
    pinned = ["--attn-exact", "off"]     # GroupQueryAttention in every row: the rows differ in their weights only
    base = ["--weights", "int4", "--calib-text", str(calib), *pinned]
    if a.calib_tokens:
        base += ["--calib-tokens", str(a.calib_tokens)]
    if "nbits" in recipes:
        rows["MatMulNBits RTN int4"] = {"flags": ["--weights", "int4", "--weights-quantizer", "nbits",
                                                  "--quality-budget", "off", *pinned]}
    for q in ("rtn", "hqq", "kquant", "gptq"):
        if q in recipes:
            rows[f"{q} 4-bit"] = {"flags": base + ["--weights-quantizer", q, "--quality-budget", "off"]}
    if "mix" in recipes:
        for b in a.budgets.split(","):
            rows[f"mix @ {float(b):g}"] = {"flags": base + ["--quality-budget", b]}
    for label, r in rows.items():
        out = work / (label.replace(" ", "_").replace("@", "at") + ".onnx")
        rep = rewrite(dense, out, r["flags"])
        r.update(path=str(out), command="ortlean rewrite MODEL -o OUT " + " ".join(r["flags"]).replace(str(calib), "CALIB"),
                 notes=rep.get("notes"), quality_probe=rep.get("quality"), **weight_bits(out))
    kqm = "genai int4-k_quant_mixed"
    try:
        kqm_path = peers.genai_model("smollm2", "int4-k_quant_mixed") / "model.onnx"
    except Exception as e:  # a peer row we cannot build is reported, not fatal
        kqm_path = None
        print(f"note: {kqm} row skipped: {str(e).splitlines()[0]}", file=sys.stderr)

    # the k_quant_mixed model runs as a genai row: our plain loop and genai's own generator
    labels = list(rows)
    ref_label = "MatMulNBits RTN int4" if "MatMulNBits RTN int4" in rows else labels[0]
    also = {k: v["path"] for k, v in rows.items() if k != ref_label}
    res = evaluate.bench(rows[ref_label]["path"], str(dense), threads=threads, prefill=128, decode_past=[a.past],
                         repeats=a.repeats, nbits=(), profile=False, peers="auto", llama=False, also=also,
                         quality_text=str(held), genai_extra={kqm: str(kqm_path)} if kqm_path else None)
    name_of = {"lean": ref_label, **{k: k for k in also}}
    for k, p in res["variants"].items():
        if k not in name_of.values() and k != "lean":
            name_of[k] = k
            rows.setdefault(k, {"path": p, **(weight_bits(Path(p)) if k != "dense" else {})})
    table = {}
    for row, label in name_of.items():
        r = rows[label]
        r["bytes"] = res["weight_bytes"].get(row)
        q = (res.get("quality") or {}).get("rows", {}).get(row, {})
        r["delta_ppl"] = q.get("delta_ppl")
        for t in threads:
            tab = res["table"][f"t{t}"]
            for drv, suffix in ((row, ""), (f"{row} | og", " | og")):
                if drv in tab and f"decode{a.past}" in tab[drv]:
                    ms = tab[drv][f"decode{a.past}"]
                    ref_ms = tab["lean"][f"decode{a.past}"]
                    r.setdefault("decode", {})[f"t{t}{suffix}"] = {"ms": ms, "tok_s": 1000.0 / ms,
                                                                   "vs_rtn": ref_ms / ms}
        table[label] = r
    out = {**results.provenance(res.get("git_start")), "bench": "bench_float_weights", "model": "smollm2 (optimum export, float)",
           "quick": a.quick, "calib_tokens": a.calib_tokens or 4096,
           "past": a.past, "threads": threads, "repeats": a.repeats, "quality": {k: v for k, v in (res.get("quality") or {}).items()
                                                                                  if k != "rows"},
           "reference_row": ref_label, "rows": table, "notes": res.get("notes")}
    print(f"\nSmolLM2-135M as a float checkpoint; Δppl on {out['quality'].get('tokens')} tokens of "
          f"{corpus.EVAL_NOVEL} vs the fp32 export; decode after a past of {a.past}, medians; vs RTN = speed "
          f"relative to '{ref_label}'")
    hdr = f"{'row':<34} {'bits/w':>7} {'MB':>7} {'Δppl %':>8}" + "".join(f" {'t' + str(t) + ' tok/s':>11} {'vs RTN':>7}" for t in threads)
    print(hdr)
    for label, r in table.items():
        d = r.get("decode", {})
        line = (f"{label:<34} {r.get('bits_per_weight', float('nan')):>7.3f} {(r.get('bytes') or 0) / 1e6:>7.1f} "
                f"{100 * r['delta_ppl'] if r.get('delta_ppl') is not None else float('nan'):>8.2f}")
        for t in threads:
            x = d.get(f"t{t}") or {}
            line += f" {x.get('tok_s', float('nan')):>11.1f} {x.get('vs_rtn', float('nan')):>6.2f}x"
        print(line)
        for t in threads:
            x = d.get(f"t{t} | og")
            if x:
                print(f"{'  | og (genai generator) t' + str(t):<34} {'':>7} {'':>7} {'':>8} {x['tok_s']:>11.1f} "
                      f"{x['vs_rtn']:>6.2f}x")
    if a.json:
        results.write_json(a.json, out)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
