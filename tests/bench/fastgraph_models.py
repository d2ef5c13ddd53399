"""Cached fast-form models for the benchmarks: the fused graph of a prepared optimum export
(rewriter.fuse) and its MatMulNBits quantizations (rewriter.quantize), under
``~/.cache/ortlean/fastgraph/<key>/``. Keys cover the source export, the fusion/quantization code
(hash of its files) and the onnxruntime / onnxscript / onnx-ir / onnx versions."""
from __future__ import annotations

import functools
import hashlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from models.cache import artifact_key, atomic_dir, cache_root, versions  # noqa: E402

TOOLS = ("onnxruntime", "onnxscript", "onnx-ir", "onnx")


def _code_hash(*rel: str) -> str:
    h = hashlib.sha256()
    for r in rel:
        for p in sorted((ROOT / r).rglob("*.py")) if (ROOT / r).is_dir() else [ROOT / r]:
            h.update(p.read_bytes())
    return h.hexdigest()[:12]


def _build(target: Path, make) -> Path:
    out = target / "model.onnx"
    if out.is_file():
        return out
    with atomic_dir(target) as tmp:
        if tmp is not None:
            make(tmp / "model.onnx")
    return out


def fused_model(name: str = "smollm2", progress: bool = True) -> Path:
    from models import prepare

    src = prepare.prepare(name) / "model.onnx"
    from rewriter.kit.modelfile import max_positions

    rows = max_positions(src)     # as `ortlean rewrite` does: the rotary caches keep the config's positions
    key = artifact_key(f"{name}-fused", {"src": src.parent.name, "code": _code_hash("rewriter/fuse"),
                                         "rotary_rows": rows, "tools": versions(TOOLS)})

    def make(out: Path):
        import shutil

        import onnx_ir as ir

        from rewriter.fuse import fuse_decoder

        t0 = time.monotonic()
        model, report = fuse_decoder(ir.load(src), max_positions=rows)
        ir.save(model, out)
        shutil.copy(src.parent / "tokenizer.json", out.parent / "tokenizer.json")
        (out.parent / "fuse.txt").write_text(report.summary() + "\n")
        if progress:
            print(f"[bench] {report.summary()} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)

    return _build(cache_root() / "fastgraph" / key, make)


def quantized_model(fp32: Path, bits: int, block_size: int, symmetric: bool, accuracy_level: int) -> Path:
    key = artifact_key(f"{fp32.parent.name}-q{bits}", {"code": _code_hash("rewriter/quantize.py"),
                                                      "cfg": [bits, block_size, symmetric, accuracy_level],
                                                      "tools": versions(TOOLS)})

    def make(out: Path):
        import shutil

        import onnx_ir as ir

        from rewriter.quantize import quantize_weights

        q, _ = quantize_weights(ir.load(fp32), f"int{bits}", block_size=block_size, symmetric=symmetric,
                                accuracy_level=accuracy_level)   # the tied embedding shared, as --weights does
        ir.save(q, out)
        shutil.copy(fp32.parent / "tokenizer.json", out.parent / "tokenizer.json")

    return _build(cache_root() / "fastgraph" / key, make)


def exact_attention_model(gqa: Path) -> Path:
    """``gqa`` with every GroupQueryAttention replaced by ortlean's PackedAttention in its exact fp32
    cache mode, by the CLI (`ortlean rewrite GQA --attn-exact on`; what `ortlean rewrite --weights int4`
    writes when --attn-exact auto measures the op faster): the same attention (exact to 1e-5), ortlean's
    kernel instead of ORT's. Keyed by the rewriter's code and the op schema besides the input model."""
    key = artifact_key(f"{gqa.parent.name}-pa-exact", {"code": _code_hash("rewriter", "custom_ops/schema.py"),
                                                       "tools": versions(TOOLS)})

    def make(out: Path):
        from rewriter import cli

        rc = cli.main(["rewrite", str(gqa), "-o", str(out), "-q", *EXACT_ATTENTION_FLAGS])
        if rc != 0:
            raise SystemExit(f"{gqa}: rewrite {EXACT_ATTENTION_FLAGS} failed ({rc})")

    return _build(cache_root() / "fastgraph" / key, make)


EXACT_ATTENTION_FLAGS = ["--attn-exact", "on"]


@functools.lru_cache(maxsize=None)
def _uses_ortlean(path: str) -> bool:
    """The model imports the ai.ortlean domain (read once per file: the bench opens each model at
    every thread count and for the perplexity rows)."""
    import onnx

    return any(o.domain == "ai.ortlean" for o in onnx.load(path, load_external_data=False).opset_import)


def ort_session(path, threads: int):
    """A CPU InferenceSession with ``threads`` intra-op threads; the ortlean ops registered only when
    the model uses them (the ORT rows run on plain onnxruntime)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if _uses_ortlean(str(path)):
        import custom_ops

        so = custom_ops.session_options(threads, so=so)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
