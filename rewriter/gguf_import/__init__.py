"""``ortlean import MODEL.gguf -o DIR/model.onnx``: a GGUF (llama, qwen2 or gemma3 architecture) straight
to the lossless fused graph — GroupQueryAttention (or exact PackedAttention, ``--attn-exact``), its
BlockQuantMatMul / BlockQuantGather holding the file's own blocks — with the tokenizer, chat template and
config files beside it; no torch, no transformers, no float32 export. The graph is the one ``ortlean
rewrite`` writes of the model's optimum export (docs/import.md: what is equal and where it differs).

    from rewriter.gguf_import import import_gguf, format_summary
    summary = import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smol/model.onnx")
    print(format_summary(summary))

Steps: read and check the GGUF (:mod:`.reader`: metadata, tensor names / shapes / types, every block's
fp16 scales) and build the tokenizer (:mod:`.tokenizer`) — every bad input is refused here, before anything
is written; build the graph (:mod:`.graph`; the weights are lazy tensors over the file's memory map);
``--attn-exact``; write the model atomically (``kit.modelfile.save_model_atomic``: one tensor at a time, the
GGUF's pages released after each, external data above 512 MiB), then the files beside it and
``ortlean.json`` (where it came from)."""
from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ..errors import OrtleanError
from .reader import ARCHS, GGUFFile, GGUFImportError, check_tensors

__all__ = ["import_gguf", "format_summary", "ARCHS", "GGUFImportError", "ATTN_EXACT", "LAYOUTS", "ACT_BITS"]

ATTN_EXACT = ("auto", "on", "off")
LAYOUTS = ("auto", "blocks", "split")
ACT_BITS = ("auto", "8", "16")


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"[ortlean] {msg}", file=sys.stderr, flush=True)


def _peak_rss_mb() -> float:
    """Peak resident set size of this process (or of a child, the larger), MiB. The process's own peak is its
    memory's high-water mark (``VmHWM``): ``getrusage``'s ``ru_maxrss`` carries over the peak of the process an
    ``ortlean`` started by a large one (a test run, a notebook) was forked from, across the exec."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        with open("/proc/self/status") as f:
            own = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 1024.0


def check_scales(gf: GGUFFile) -> None:
    """Every block of every tensor BlockQuantMatMul will run has finite fp16 scales (a corrupt GGUF is
    refused before anything is written; the op would refuse it only when a session is created), and every
    1-D tensor (norm weights, biases) is finite."""
    import numpy as np

    from . import graph

    for name, t in gf.tensors.items():
        if len(t.ne) == 1 and t.is_float:
            bad = np.flatnonzero(~np.isfinite(gf.floats(name)))
            if bad.size:
                raise GGUFImportError(f"{gf.path}: tensor {name} element {int(bad[0])} is not finite "
                                      f"({bad.size} of {t.ne[0]}) — a corrupt GGUF")
            continue
        if t.format is None or len(t.ne) != 2:
            continue
        rows = gf.rows(name)
        step = max(1, (64 << 20) // max(1, rows.shape[1]))
        for lo in range(0, rows.shape[0], step):
            graph.check_scales(gf, name, rows[lo:lo + step], t.format, lo)
        gf.release(name)


class _Ctx:
    """What a graph pass reads from the rewrite's context when it runs on an imported graph."""

    def __init__(self, out: Path):
        self.model_path = out


def _output(path) -> Path:
    out = Path(path)
    if out.is_dir():
        raise OrtleanError(f"-o {out}: is a directory (give the model's file, e.g. {out / 'model.onnx'})")
    if out.suffix != ".onnx":
        raise OrtleanError(f"-o {out}: the output is an ONNX model file (DIR/model.onnx)")
    p = out.parent
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        raise OrtleanError(f"-o {out}: {p} is not a directory")
    if not os.access(p, os.W_OK):
        raise OrtleanError(f"-o {out}: {p} is not writable")
    return out


def import_gguf(path, output, *, attn_exact: str = "auto", layout: str = "auto", act_bits: str = "auto",
                glu: str = "on", progress: bool = True) -> dict:
    """Write the fused ONNX model of the GGUF at ``path`` to ``output`` (DIR/model.onnx) with its sidecar
    files; returns the summary (written files, the graph's make-up, attention decision, time, peak RSS).
    Raises ``OrtleanError`` (:class:`GGUFImportError`) on bad input with nothing written."""
    from ..backends.packed_attention import ExactAttentionPass, ExactAttnConfig
    from ..kit import modelfile
    from . import graph as G
    from . import tokenizer as T

    t0 = time.monotonic()
    stages: dict[str, float] = {}
    held: list[str] = []        # progress lines held back until every check passed: bad input prints one line

    def mark(stage: str, t: list = [t0], hold: bool = False) -> None:
        now = time.monotonic()
        stages[stage] = round(now - t[0], 1)
        t[0] = now
        held.append(f"import: {stage} {stages[stage]:.1f} s (peak RSS {_peak_rss_mb() / 1024:.2f} GiB)")
        if not hold:
            for line in held:
                _say(progress, line)
            held.clear()

    if attn_exact not in ATTN_EXACT:
        raise OrtleanError(f"--attn-exact {attn_exact}: one of {', '.join(ATTN_EXACT)}")
    if layout not in LAYOUTS:
        raise OrtleanError(f"--weights-layout {layout}: one of {', '.join(LAYOUTS)}")
    if str(act_bits) not in ACT_BITS:
        raise OrtleanError(f"--weights-act-bits {act_bits}: one of {', '.join(ACT_BITS)}")
    if glu not in ("on", "off"):
        raise OrtleanError(f"--weights-glu {glu}: on or off")
    out = _output(output)
    src = Path(path)
    if src.exists() and out.exists() and out.resolve() == src.resolve():
        raise OrtleanError(f"-o {out}: would overwrite the GGUF")

    # ---- read and check everything first: a bad input writes nothing
    gf = GGUFFile(src)
    hp = gf.hparams()
    check_tensors(gf, hp)
    check_scales(gf)
    mark("read and check the GGUF", hold=True)
    tok, vocab, tok_note = T.build_tokenizer(gf)
    n_tok = len(vocab["tokens"])
    if n_tok > hp.vocab:
        raise GGUFImportError(f"{src}: {n_tok} tokens in the vocabulary, {hp.vocab} rows in token_embd.weight")
    tied = "output.weight" not in gf.tensors
    files = T.sidecars(gf, hp, vocab, tied)
    mark("tokenizer", hold=True)

    bits = 16 if str(act_bits) == "auto" else int(act_bits)   # auto: the GGUF's exact blocks take int16 activations
    b = G.Builder(gf, hp, layout=layout, act_bits=bits, glu=glu == "on")
    model = b.build()
    if layout == "split" and not b.layouts.get("split"):
        raise OrtleanError(f"--weights-layout split: no layer of {src.name} is in a format that takes it "
                           f"(formats: {', '.join(sorted(b.formats))}; split takes q4_0, q4_1, q5_0, q5_1, q8_0)")
    mark("graph")
    attn_note = "GroupQueryAttention (--attn-exact off)"
    if attn_exact != "off":
        recs = ExactAttentionPass(ExactAttnConfig(mode=attn_exact)).run(model, _Ctx(out))
        done = [r for r in recs if r.get("backend") == "exact_attention"]
        if done:
            attn_note = f"{len(done)} exact PackedAttention (fp32 K/V rows) for GroupQueryAttention{done[0]['decision'].split('GroupQueryAttention', 1)[1]}"
        else:
            attn_note = "; ".join(dict.fromkeys(r["decision"] for r in recs)) or "GroupQueryAttention"
        mark("attention")
    model.graph.sort()

    # ---- write: the model atomically, then the files beside it
    written = modelfile.save_model_atomic(model, out, check=lambda p: modelfile.check(p, out))
    gf.release()
    mark("write the model")
    stage = Path(tempfile.mkdtemp(prefix=".ortlean-import-", dir=out.parent))
    try:
        staged = T.write_files(stage, files, tok)
        side = []
        for p in staged:
            dst = out.parent / p.name
            if p.name in ("config.json", "generation_config.json"):
                shutil.copy2(p, dst)       # genai's config reads them beside the "source" (the staging dir)
            else:
                os.replace(p, dst)
            side.append(dst)
        meta = _provenance(gf, hp, b, out, stages, attn_note, tok_note)
        (out.parent / "ortlean.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
        side.append(out.parent / "ortlean.json")
        from .. import genai

        genai_cfg = genai.write_config(out, stage / out.name, side)
        side += [Path(p) for p in genai_cfg.get("written", [])]
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    written += side
    mark("tokenizer and config files")
    model_bytes = sum(p.stat().st_size for p in written if p.suffix in (".onnx", ".data") and p.is_file())
    seconds = round(time.monotonic() - t0, 1)
    meta["seconds"] = seconds
    meta["peak_rss_mb"] = round(_peak_rss_mb(), 1)
    (out.parent / "ortlean.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    return {
        "gguf": str(src), "output": str(out), "written": [str(p) for p in written], "arch": hp.arch,
        "name": hp.name, "layers": hp.n_layers, "tied": tied, "formats": dict(b.formats), "layouts": dict(b.layouts),
        "float_weights": list(b.float_weights), "act_bits": bits, "attention": attn_note, "tokenizer": tok_note,
        "vocab_model": vocab["model"], "vocab_pre": vocab["pre"], "add_bos": vocab["add_bos"],
        "chat_template": "chat_template.jinja" in files, "genai": genai_cfg,
        "model_bytes": model_bytes, "gguf_bytes": gf.file_bytes, "seconds": seconds, "stages": stages,
        "peak_rss_mb": round(_peak_rss_mb(), 1),
    }


def _provenance(gf: GGUFFile, hp, b, out: Path, stages: dict, attn_note: str, tok_note: str) -> dict:
    """``ortlean.json`` beside the imported model: what it was made from and by what."""
    import importlib.metadata as md

    from models.prepare import MODELS

    from .. import __version__

    def ver(d):
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            return None

    packaged = next((n for n, s in MODELS.items() if s.gguf == gf.path.name), None)
    meta = {
        "kind": "causal-lm",
        "description": f"{hp.name} ({hp.arch}), imported from its GGUF by `ortlean import`",
        "source": {"gguf": str(gf.path.resolve()), "file": gf.path.name, "bytes": gf.file_bytes,
                   "architecture": hp.arch, "file_type": gf.meta.get("general.file_type"),
                   "tensors": len(gf.tensors)},
        "import": {"formats": dict(b.formats), "layouts": dict(b.layouts), "act_bits": b.act_bits,
                   "float_weights": list(b.float_weights), "attention": attn_note, "tokenizer_note": tok_note,
                   "stages_seconds": dict(stages)},
        "tools": {"ortlean": __version__, **{d: ver(d) for d in ("gguf", "onnx", "onnx-ir", "onnxruntime", "tokenizers")}},
        "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if packaged:
        meta["packaged_gguf_of"] = packaged
    return meta


def format_summary(s: dict) -> str:
    """The import's summary as the CLI prints it."""
    fmts = ", ".join(f"{f} ×{n}" for f, n in sorted(s["formats"].items()))
    lines = [
        f"imported {Path(s['gguf']).name}: {s['name']} ({s['arch']}, {s['layers']} layers, "
        f"{'tied' if s['tied'] else 'untied'} head)",
        f"weights: the GGUF's own blocks, byte for byte — BlockQuantMatMul / BlockQuantGather {fmts}; "
        f"layout split {s['layouts'].get('split', 0)}, blocks {s['layouts'].get('blocks', 0)}; act_bits {s['act_bits']}"
        + (f"; kept float32 (held as floats in the GGUF): {', '.join(s['float_weights'])}" if s["float_weights"] else ""),
        f"attention: {s['attention']}",
        f"tokenizer: {s['vocab_model']} vocabulary (pre {s['vocab_pre']}), "
        f"{'a' if s['add_bos'] else 'no'} beginning-of-sequence token added"
        + ("; chat template" if s["chat_template"] else "; no chat template in the GGUF")
        + (f"; {s['tokenizer']}" if s["tokenizer"] else ""),
        f"the model's files {s['model_bytes'] / 1e6:.1f} MB vs the GGUF's {s['gguf_bytes'] / 1e6:.1f} MB "
        f"({s['model_bytes'] / max(1, s['gguf_bytes']):.2f}x)",
        "wrote " + ", ".join(s["written"]),
    ]
    g = s.get("genai") or {}
    if g.get("note") or g.get("skipped"):
        lines.append(f"onnxruntime-genai: {g.get('note') or g.get('skipped')}")
    lines.append(f"import: peak RSS {s['peak_rss_mb'] / 1024:.2f} GiB, wall {s['seconds']:.1f} s ("
                 + ", ".join(f"{k} {v:.1f} s" for k, v in s["stages"].items()) + ")")
    return "\n".join(lines)
