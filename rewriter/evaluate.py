"""`ortlean eval` and `ortlean bench`: quality and speed of a rewritten model against its dense
reference, both measured in the same process."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from custom_ops import runtime
from models.cache import cache_root

from .errors import OrtleanError
from .kit import modelfile


def _session(path: str, threads: int):
    import custom_ops

    modelfile.load_model(path)  # clear messages for missing / corrupt files
    try:
        return custom_ops.session(path, threads=threads)
    except custom_ops.LibraryNotFoundError as e:
        raise OrtleanError(str(e)) from None
    except Exception as e:
        raise OrtleanError(f"{path}: onnxruntime could not create a session: {e}") from None


def evaluate(model: str, ref: str, text_path: str, threads: int = 2, window: int = 512, windows: int = 8,
             sentences: int = 256, tokenizer: str | None = None) -> dict:
    tp = Path(text_path)
    if not tp.is_file():
        raise OrtleanError(f"--text {tp}: no such file")
    text = tp.read_text(encoding="utf-8", errors="replace")
    s_ref = _session(ref, threads)
    s_lean = _session(model, threads)
    io = runtime.ModelIO.from_session(s_ref)
    io_l = runtime.ModelIO.from_session(s_lean)
    if io.kind != io_l.kind:
        raise OrtleanError(f"{model} ({io_l.kind}) and --ref {ref} ({io.kind}) are not the same kind of model")
    tok = runtime.load_tokenizer(ref, tokenizer) if tokenizer or (Path(ref).parent / "tokenizer.json").exists() else runtime.load_tokenizer(model, tokenizer)
    res = {"model": model, "ref": ref, "text": str(tp), "kind": io.kind}
    if io.kind == "causal-lm":
        all_ids = tok.encode(text, add_special_tokens=False).ids
        ids = np.asarray(all_ids[: window * windows], dtype=np.int64)
        if runtime.approximate_decode(model):  # the approximation only runs in decode: measure there
            dm = dict(context=1024, score=128, windows=max(1, windows // 4))
            d = runtime.decode_perplexity(s_ref, io, all_ids, **dm)
            l = runtime.decode_perplexity(s_lean, io_l, all_ids, **dm)
            res["mode"] = f"decode ({dm['windows']} windows: {dm['context']}-token prefill, {dm['score']} decode steps)"
        else:
            d = runtime.perplexity(s_ref, io, ids, window=window)
            l = runtime.perplexity(s_lean, io_l, ids, window=window)
        res.update({"tokens": int(d["tokens"]), "window": window, "ppl_ref": float(d["ppl"]), "ppl": float(l["ppl"]),
                    "delta_ppl": float(l["ppl"] / d["ppl"] - 1.0)})
    else:
        sents = runtime.sentences_from_text(text, sentences)
        e_d = runtime.embeddings(s_ref, io, tok, sents)
        e_l = runtime.embeddings(s_lean, io_l, tok, sents)
        cos = np.sum(e_d * e_l, axis=1) / (np.linalg.norm(e_d, axis=1) * np.linalg.norm(e_l, axis=1) + 1e-30)
        res.update({"sentences": len(sents), "cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
                    "cosine_p5": float(np.percentile(cos, 5))})
    return res


def format_eval(r: dict) -> str:
    if r["kind"] == "causal-lm":
        how = f"decode-mode, {r['mode']}" if r.get("mode") else f"{r['window']}-token windows"
        return (f"perplexity on {r['tokens']} tokens ({how}) of {Path(r['text']).name}: "
                f"dense {r['ppl_ref']:.3f}, lean {r['ppl']:.3f}, Δppl {100 * r['delta_ppl']:+.2f} %")
    return (f"sentence-embedding cosine lean vs dense over {r['sentences']} sentences of {Path(r['text']).name}: "
            f"mean {r['cosine_mean']:.5f}, p5 {r['cosine_p5']:.5f}, min {r['cosine_min']:.5f}")


def nbits_model(dense: str, bits: int) -> str:
    """ORT's own MatMulNBits quantization of the dense model (cached next to our cache)."""
    p = Path(dense).resolve()
    st = p.stat()
    key = hashlib.sha1(f"{p}|{st.st_size}|{int(st.st_mtime)}|{bits}".encode()).hexdigest()[:16]
    root = cache_root() / "nbits"
    out = root / f"{p.stem}.q{bits}.{key}.onnx"
    if not out.exists():
        root.mkdir(parents=True, exist_ok=True)
        runtime.quantize_matmul_nbits(str(p), bits, str(out))
    return str(out)


def bench(model: str, ref: str, threads=(1, 2), prefill: int = 128, decode_past: int = 128, repeats: int = 15,
          nbits=(8, 4), profile: bool = True) -> dict:
    variants = {"dense": ref, "lean": model}
    for b in nbits:
        try:
            variants[f"MatMulNBits int{b}"] = nbits_model(ref, b)
        except Exception as e:  # a comparison row we cannot make is reported, not fatal
            variants[f"MatMulNBits int{b}"] = None
            print(f"note: MatMulNBits int{b} row skipped: {e}")
    res = {"model": model, "ref": ref, "prefill": prefill, "decode_past": decode_past, "runs": []}
    res["weight_bytes"] = {k: (runtime.weight_bytes(v) if v else None) for k, v in variants.items()}
    for t in threads:
        sessions = {k: _session(v, t) for k, v in variants.items() if v}
        io = runtime.ModelIO.from_session(sessions["dense"])
        ios = {k: runtime.ModelIO.from_session(s) for k, s in sessions.items()}
        r = runtime.bench_sessions(sessions, io, prefill_len=prefill, decode_past=decode_past, repeats=repeats, ios=ios)
        res["runs"].append({"threads": t, "kind": io.kind, "results": r})
    if profile:
        t = max(threads)
        res["profile"] = {}
        for k in ("dense", "lean"):
            prof = runtime.profile_summary(variants[k], lambda p, so=None: _profiled_session(p, so, t), feeds=None, runs=5)
            res["profile"][k] = {"rows": list(prof), "top_nodes": prof.top_nodes}
    return res


def _profiled_session(path: str, so, threads: int):
    import custom_ops

    return custom_ops.session(path, threads=threads, so=so)


def format_bench(r: dict) -> str:
    lines = []
    wb = r["weight_bytes"]
    for run in r["runs"]:
        rep = run["results"]
        sess, ratios = rep["sessions"], rep["ratios"]
        causal = run["kind"] == "causal-lm"
        lines.append(f"threads={run['threads']}")
        hdr = f"  {'variant':<20} {'prefill ms':>11} {'vs dense':>9}"
        hdr += f" {'decode tok/s':>13} {'vs dense':>9}" if causal else f" {'short ms':>9} {'vs dense':>9}"
        lines.append(hdr + f" {'weights MiB':>12}")
        for k, v in sess.items():
            row = f"  {k:<20} {v['prefill']['median_ms']:>11.2f} {ratios[k].get('prefill', float('nan')):>8.2f}x"
            if causal and "decode" in v:
                row += f" {v['decode_tok_s']:>13.1f} {ratios[k].get('decode', float('nan')):>8.2f}x"
            elif "short" in v:
                row += f" {v['short']['median_ms']:>9.2f} {ratios[k].get('short', float('nan')):>8.2f}x"
            row += f" {(wb.get(k) or 0) / 2**20:>12.1f}"
            lines.append(row)
    lines.append(f"(prefill {r['prefill']} tokens; decode steps after a past of {r['decode_past']}; medians, "
                 "sessions interleaved in one process; 'vs dense' = dense time / variant time, > 1 is faster)")
    for k, prof in (r.get("profile") or {}).items():
        rows = prof["rows"]
        lines.append(f"ORT profile, {k}: " + ", ".join(f"{row['op_type']} {row['pct']:.0f}%" for row in rows[:6]))
    return "\n".join(lines)
