"""The cheap head (--cheap-head=lowrank, rewriter/backends/head.py) on SmolLM2-135M: greedy agreement
with the exact head on teacher-forced held-out positions, and whole-model decode speed.

    python tests/bench/bench_cheap_head.py [--models fp32,int4] [--threads 1,2] [--positions 2048]
                                           [--rank 128] [--candidates 768] [--bits 4] [--repeats 7]
                                           [--json tests/bench/results/cheap_head.json]
    python tests/bench/bench_cheap_head.py --exact MODEL --cheap MODEL [--positions 2048] --json FILE

Models: ``fp32`` = the optimum export (``ortlean models path smollm2``), ``int4`` = the fused graph
quantized with rewriter.quantize.quantize_weights' int4 DEFAULTS (tests/bench/fastgraph_models.py,
cached). Each is rewritten with ``ortlean rewrite --cheap-head=lowrank`` calibrated on Sense &
Sensibility (``ortlean corpus --calib``, 4096 tokens).

- Agreement: Persuasion (``ortlean corpus --eval``) in windows of 256 tokens; per window the exact
  model's prefill logits give the exact greedy token at every position, and the rewritten model runs
  the window as decode steps through its KV cache (teacher forced: the next input is the text's
  token), so every position after the first of a window is a decode step of the cheap head. Agreement
  = share of those positions whose argmax equals the exact one.
- ``--exact`` / ``--cheap``: the agreement alone, of two given models (e.g. Gemma 3's GGUF-born model
  rewritten without and with ``--cheap-head``; their speed beside the peers: ``ortlean bench``).
- Speed: runtime.bench_sessions (exact vs cheap interleaved in one process, medians): decode step at
  past 128 and prefill of 128 tokens, per thread count.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _rewrite(src: Path, out: Path, calib: Path, a) -> dict:
    """The pass's own steps (rewriter.backends.head) without the pipeline: `ortlean rewrite`'s final
    onnx.checker refuses the fused graph's ORT contrib ops in the default domain
    (SimplifiedLayerNormalization), whatever pass runs on it."""
    import numpy as np
    import onnx_ir as ir

    from custom_ops import runtime
    from rewriter.backends.head import HeadConfig, emit
    from rewriter.builders.head import candidate_recall, find_head, lowrank_head
    from rewriter.kit import calib as kcalib

    rep = out.with_suffix(".report.json")
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        cfg = HeadConfig(mode="lowrank", rank=a.rank, candidates=a.candidates, bits=a.bits)
        model = ir.load(src)
        head, why = find_head(model)
        if head is None:
            raise SystemExit(f"{src}: no head ({why})")
        io = runtime.ModelIO.from_session(__import__("fastgraph_models").ort_session(src, 2))
        text = kcalib.CalibText(src, calib)
        X = []
        G = kcalib.collect_grams(str(src), io, [head.x.name], text, 4096, 256, progress=False,
                                 hook=lambda n, x: X.append(np.array(x, np.float32)))[head.x.name].G
        f = lowrank_head(head.W, G, cfg.rank, cfg.bits)
        recall = candidate_recall(np.concatenate(X), head.W, f.A, f.B, min(cfg.candidates, head.V))
        how = emit(model, head, f.A, f.blob, f.scales, f.rank, cfg)
        ir.save(model, out)
        rep.write_text(json.dumps({"gap": f.gap, "rank": f.rank, "calib_recall": recall,
                                   "decision": f"rank {f.rank} int{cfg.bits}, {cfg.candidates} candidates, gap "
                                               f"{f.gap:.4f}, calibration recall {recall:.4f}; {how}"}))
    return json.loads(rep.read_text())


def fp32_head_model(src: Path, out: Path) -> Path:
    """``src`` with its MatMulNBits head at accuracy_level 0 (float32 activations, the arithmetic of
    the cheap head's exact candidate logits): the exact head without int8 activation rounding."""
    import onnx_ir as ir

    from rewriter.builders.head import find_head

    if not out.is_file():
        model = ir.load(src)
        head, why = find_head(model)
        if head is None or head.node.op_type != "MatMulNBits":
            raise SystemExit(f"{src}: no MatMulNBits head ({why})")
        head.node.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", 0)
        out.parent.mkdir(parents=True, exist_ok=True)
        ir.save(model, out)
    return out


def agreement(exact, cheap, tok_ids, positions: int, window: int = 256, exact32=None) -> dict:
    """Greedy agreement on teacher-forced decode steps. Both models run the same steps through their
    KV caches; at each position the cheap head's argmax is compared with the exact model's argmax at
    the same decode step ("agreement", what the issue asks) and with the exact model's prefill
    logits of the whole window ("vs_prefill"); "exact_decode_vs_prefill" is the exact model against
    its own prefill, the floor of that comparison (a quantized model's M = 1 and M > 1 paths round
    differently). Positions where the cheap head disagrees with the exact decode are kept with the
    exact top-2 logit margin (is it a near tie?). With ``exact32`` (the exact model with its head at
    float32 activations, :func:`fp32_head_model`): "agree_fp32_head" compares the cheap head with it,
    "exact_vs_fp32_head" the exact head with it."""
    import numpy as np

    from custom_ops import runtime

    io_e, io_c = runtime.ModelIO.from_session(exact), runtime.ModelIO.from_session(cheap)
    n = {"agree": 0, "vs_prefill": 0, "exact_vs_prefill": 0}
    if exact32 is not None:
        n.update(agree_fp32_head=0, exact_vs_fp32_head=0)
    total, margins = 0, []
    for s in range(0, len(tok_ids) - window, window):
        ids = np.asarray(tok_ids[s:s + window], np.int64)[None]
        ref = runtime.run(exact, io_e, runtime.feeds(io_e, ids))["logits"][0].argmax(-1)
        past_c = io_c.next_state(runtime.run(cheap, io_c, runtime.feeds(io_c, ids[:, :1])))
        past_e = io_e.next_state(runtime.run(exact, io_e, runtime.feeds(io_e, ids[:, :1])))
        for t in range(1, window):
            oc = runtime.run(cheap, io_c, runtime.feeds(io_c, ids[:, t:t + 1], past=past_c, past_len=t))
            oe = runtime.run(exact, io_e, runtime.feeds(io_e, ids[:, t:t + 1], past=past_e, past_len=t))
            past_c = io_c.next_state(oc)
            le = oe["logits"][0, -1]
            c, e = int(oc["logits"][0, -1].argmax()), int(le.argmax())
            if exact32 is not None:   # the same decode state (the body is identical), head in float32
                f = int(runtime.run(exact32, io_e, runtime.feeds(io_e, ids[:, t:t + 1], past=past_e,
                                                                    past_len=t))["logits"][0, -1].argmax())
                n["agree_fp32_head"] += c == f
                n["exact_vs_fp32_head"] += e == f
            n["agree"] += c == e
            n["vs_prefill"] += c == ref[t]
            n["exact_vs_prefill"] += e == ref[t]
            if c != e:
                top2 = np.sort(le)[-2:]
                margins.append(float(top2[1] - top2[0]))
            past_e = io_e.next_state(oe)
            total += 1
            if total >= positions:
                break
        if total >= positions:
            break
    t = max(total, 1)
    shares = {k: n[k] / t for k in ("agree_fp32_head", "exact_vs_fp32_head") if k in n}
    return {"positions": total, **{k: int(v) for k, v in n.items()}, "agreement": n["agree"] / t,
            "agreement_vs_prefill": n["vs_prefill"] / t, "exact_decode_vs_prefill": n["exact_vs_prefill"] / t,
            **shares,
            "disagree_margin_median": float(np.median(margins)) if margins else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="fp32,int4")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--positions", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=128)
    ap.add_argument("--candidates", type=int, default=768)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--exact", help="with --cheap: greedy agreement only, of these two models as they are (e.g. a "
                                    "GGUF-born model rewritten without and with --cheap-head; their speed: ortlean bench)")
    ap.add_argument("--cheap", help="see --exact")
    ap.add_argument("--json", default=str(ROOT / "tests/bench/results/cheap_head.json"))
    a = ap.parse_args()

    import custom_ops
    from custom_ops import runtime
    from fastgraph_models import fused_model, ort_session, quantized_model
    from models import corpus, prepare
    from models.cache import cache_root
    from rewriter.quantize import DEFAULTS

    novels = corpus.novels()
    calib, held = novels[corpus.CALIB_NOVEL], novels[corpus.EVAL_NOVEL]
    if a.exact or a.cheap:
        if not (a.exact and a.cheap):
            raise SystemExit("--exact and --cheap go together")
        tok = runtime.load_tokenizer(Path(a.exact))
        ids = tok.encode(held.read_text(encoding="utf-8"), add_special_tokens=False).ids
        r = agreement(custom_ops.session(a.exact, threads=2), custom_ops.session(a.cheap, threads=2), ids, a.positions)
        print(f"greedy agreement {r}", flush=True)
        from rewriter.results import provenance

        out = {"provenance": {k: v for k, v in provenance().items() if k != "schema"}, "isa": custom_ops.isa(),
               "exact": a.exact, "cheap": a.cheap, "text": corpus.EVAL_NOVEL, "agreement": r,
               "command": "python tests/bench/bench_cheap_head.py " + " ".join(sys.argv[1:])}
        Path(a.json).write_text(json.dumps(out, indent=1, default=float))
        print(f"wrote {a.json}")
        return
    srcs = {}
    for m in a.models.split(","):
        if m == "fp32":
            srcs[m] = prepare.prepare("smollm2") / "model.onnx"
        elif m == "int4":
            c = DEFAULTS["int4"]
            srcs[m] = quantized_model(fused_model("smollm2"), c.bits, c.block_size, c.symmetric, c.accuracy_level)
        else:
            raise SystemExit(f"--models: unknown {m!r} (fp32, int4)")
    import hashlib   # the rewritten models are cached per pass code too
    code = hashlib.sha256(b"".join((ROOT / f).read_bytes() for f in (
        "rewriter/backends/head.py", "rewriter/builders/head.py", "rewriter/quantize.py"))).hexdigest()[:8]
    tag = f"r{a.rank}-c{a.candidates}-b{a.bits}-{code}"
    res = {"isa": custom_ops.isa(), "cpu": platform.processor() or platform.machine(), "args": vars(a), "models": {}}
    for m, src in srcs.items():
        out = cache_root() / "cheap_head" / f"{src.parent.name}-{tag}" / "model.onnx"
        t0 = time.monotonic()
        row = _rewrite(src, out, calib, a)
        (out.parent / "tokenizer.json").write_bytes((src.parent / "tokenizer.json").read_bytes())
        r = {"source": str(src), "rewritten": str(out), "pass": row, "rewrite_s": round(time.monotonic() - t0, 1)}
        print(f"[{m}] {row['decision']}", flush=True)
        if not a.skip_agreement:
            tok = runtime.load_tokenizer(src)
            ids = tok.encode(held.read_text(encoding="utf-8"), add_special_tokens=False).ids
            e32 = None
            if m != "fp32":
                e32 = ort_session(fp32_head_model(src, out.parent.parent / f"{src.parent.name}-fp32head" / "model.onnx"), 2)
            r["agreement"] = agreement(ort_session(src, 2), ort_session(out, 2), ids, a.positions, exact32=e32)
            print(f"[{m}] greedy agreement {r['agreement']}", flush=True)
        r["speed"] = {}
        for th in [int(t) for t in a.threads.split(",")]:
            sess = {"exact": ort_session(src, th), "cheap": ort_session(out, th)}
            io = runtime.ModelIO.from_session(sess["exact"])
            rep = runtime.bench_sessions(sess, io, prefill_len=128, decode_past=128, decode_steps=16,
                                         repeats=a.repeats, baseline="exact",
                                         ios={"cheap": runtime.ModelIO.from_session(sess["cheap"])})
            s = rep["sessions"]
            r["speed"][str(th)] = {"decode_tok_s": {k: s[k]["decode_tok_s"] for k in s},
                                   "decode_gain": rep["ratios"]["cheap"]["decode"],
                                   "prefill_ratio": rep["ratios"]["cheap"]["prefill"], "raw": rep}
            print(f"[{m}] isa {custom_ops.isa()} threads {th}: decode tok/s exact {s['exact']['decode_tok_s']:.1f} "
                  f"cheap {s['cheap']['decode_tok_s']:.1f} (x{rep['ratios']['cheap']['decode']:.3f}), prefill "
                  f"x{rep['ratios']['cheap']['prefill']:.3f}", flush=True)
        res["models"][m] = r
    from rewriter.results import provenance  # commit, date, machine: a results file says where it ran

    prov = {k: v for k, v in provenance().items() if k != "schema"}
    p = Path(a.json)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"provenance": prov, **res}, indent=1, default=float))
    print(f"wrote {p}")


if __name__ == "__main__":
    main()
