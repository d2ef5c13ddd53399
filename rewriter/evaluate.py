"""`ortlean eval` and `ortlean bench`: quality and speed of a rewritten model against its dense
reference, both measured in the same process."""
from __future__ import annotations

import hashlib
import json
import resource
import time
from pathlib import Path

import numpy as np

from custom_ops import runtime
from models.cache import cache_root

from .errors import OrtleanError
from .kit import modelfile, stream
from .kit import stamps
from .kit.progress import Progress


def _session(path: str, threads: int, last_logits: bool = False, so=None):
    """A session on the model file, with clear errors (missing, corrupt, no library). ``last_logits``:
    on :func:`stream.last_position_logits`'s view of it where the head is found (:func:`generator_session`).
    ``so``: onnxruntime.SessionOptions to build it with (the ops are registered in them)."""
    import custom_ops

    m = modelfile.load_model(path)  # clear messages for missing / corrupt files
    view = stream.last_position_logits(m) if last_logits else None
    try:
        if view is not None:
            return stream.session(view, threads, so=so, stream=False)
        return custom_ops.session(path, threads=threads, so=so)
    except custom_ops.LibraryNotFoundError as e:
        raise OrtleanError(str(e)) from None
    except Exception as e:
        raise OrtleanError(f"{path}: onnxruntime could not create a session: {e}") from None


def generator_session(path: str, threads: int, so=None):
    """A session on the model as a generator runs it: the head reads the last position only
    (:func:`stream.last_position_logits`, a view; the file is not changed), so a prompt run does not pay
    the head's product for positions whose logits nobody reads — llama.cpp computes the last one only
    as well. Decode steps compute exactly what the model computes. The model's own session where the
    head is not found as a product."""
    return _session(path, threads, last_logits=True, so=so)


def _tokenizer(model: str, tokenizer: str | None):
    """The tokenizer (--tokenizer, else tokenizer.json next to the model), with clear errors."""
    try:
        return runtime.load_tokenizer(model, tokenizer)
    except FileNotFoundError as e:
        raise OrtleanError(str(e)) from None
    except Exception as e:  # tokenizers' own parse errors
        where = f"--tokenizer {tokenizer}" if tokenizer else f"{Path(model).parent / 'tokenizer.json'}"
        raise OrtleanError(f"{where}: not a readable tokenizer.json ({type(e).__name__}: {e})") from None


def peer_name(ref: str, peers: str = "auto") -> str | None:
    """The packaged model whose peers (genai builder models, llama.cpp) a bench/eval compares:
    ``peers`` ("none", a name, or "auto": the packaged causal LM whose prepared export ``ref`` is)."""
    if peers == "none":
        return None
    from models.prepare import MODELS

    if peers != "auto":
        if peers not in MODELS:
            raise OrtleanError(f"--peers {peers!r}: one of auto, none, {', '.join(MODELS)}")
        return peers
    parent = Path(ref).resolve().parent.name
    return next((n for n, sp in MODELS.items() if parent.startswith(f"{n}-") and sp.kind == "causal-lm" and sp.gguf),
                None)


def peer_models(ref: str, peers: str, notes: list, precisions=None) -> dict[str, str]:
    """{"genai fp32": path, "genai int4": path} (or only ``precisions``) of the onnxruntime-genai
    builder built from the same checkpoint as ``ref`` (cached); {} with a note when onnxruntime-genai
    is absent or the build fails."""
    name = peer_name(ref, peers)
    if name is None:
        return {}
    from models import peers as pm

    why = pm.genai_available()
    if why:
        notes.append(f"genai rows skipped: {why}")
        return {}
    out = {}
    for prec in precisions or pm.GENAI_PRECISIONS:
        try:
            out[f"genai {prec}"] = str(pm.genai_model(name, prec) / "model.onnx")
        except Exception as e:  # a comparison row we cannot make is a note, not fatal
            notes.append(f"genai {prec} row skipped: {str(e).splitlines()[0]}")
    return out


def max_positions(path: str) -> int | None:
    """Positions a decoder can take: the rows of its rotary cos cache (GroupQueryAttention /
    RotaryEmbedding input), None when the graph has none (an unfused export's rotary is computed)."""
    import onnx

    m = onnx.load(path, load_external_data=False)
    inits = {t.name: t for t in m.graph.initializer}
    for n in m.graph.node:
        i = {"GroupQueryAttention": 7, "RotaryEmbedding": 2, "PackedAttention": 7}.get(n.op_type)
        if i is not None and len(n.input) > i and n.input[i] in inits:
            return int(inits[n.input[i]].dims[0])
    return None


def fit_pasts(pasts, steps: int, models) -> tuple[list[int], str | None]:
    """Decode pasts the models can take: a past beyond the smallest position limit of ``models``
    (paths; :func:`max_positions`) minus ``steps`` runs at that limit minus ``steps`` (SmolLM2's
    8192 leaves room for the decode steps after it). Returns the pasts and a note (None when all fit)."""
    cap = min([m for m in (max_positions(str(v)) for v in models) if m] or [1 << 30])
    pasts = list(pasts)
    if not pasts or max(pasts) + steps <= cap:
        return pasts, None
    return sorted({min(p, cap - steps) for p in pasts}), (
        f"decode pasts {','.join(map(str, pasts))}: the models take {cap} positions, so pasts beyond "
        f"{cap - steps} ran at {cap - steps} ({steps} decode steps after them)")


LONG_PASTS = (128, 1024, 4096, 8192)
# llama.cpp's row in the decode table (pasts up to this: its runs take turns with ours; beyond: after)
LLAMA_ROW = "llama.cpp | llama-bench"
# the weights floor's two forms ({row: a barrier after each node}), timed in the rounds, then moved out
# of the table into res["weights_floor"]
FLOOR_ROWS = {"weights floor | one pass": False, "weights floor | barrier per node": True}
LLAMA_INTERLEAVE_MAX_PAST = 512
# time to first token (--prompt): the reference rows — the fp32 export and ORT's MatMulNBits of it (an
# unfused graph whose cache is concatenated anew every chunk) and genai's fp32 model — are timed at
# prompts up to this length only: what they explain (the source's cost) is in the shorter prompts, and
# at 16k / 32k an fp32 prompt would take longer than the rows a user chooses between
REF_PROMPT_MAX = 4096
# llama-bench runs each prompt once untimed before its timed run, in the same process; from this length
# on that warm-up (minutes of a second prefill) is skipped (--no-warmup): the process's first-use costs
# are then a negligible part of a prompt that long
LLAMA_NO_WARMUP_FROM = 8192


def _reference_like(row: str) -> bool:
    """The rows :data:`REF_PROMPT_MAX` bounds: the dense export, its MatMulNBits rows, genai's fp32 model."""
    return row == "dense" or row.startswith("MatMulNBits ") or row == "genai fp32"


def fit_prompts(prompts, models, room: int | None = None) -> tuple[list[int], str | None]:
    """Prompt lengths (--prompt) the models can take: an N-token prompt and its first new token need N + 1
    positions (:func:`max_positions`, the smallest over ``models``). ``room`` None: a length beyond that
    is an error naming --prompt; an int: such lengths run at the limit minus ``room`` (the demo passes
    its decode steps, so that Qwen's 32k prompt is its 32,760-token past), with a note."""
    prompts = sorted({int(n) for n in prompts})
    caps = {str(m): max_positions(str(m)) for m in models}
    known = {m: c for m, c in caps.items() if c}
    if not prompts or not known:
        return prompts, None
    where, cap = min(known.items(), key=lambda kv: kv[1])
    if prompts[-1] + 1 <= cap:
        return prompts, None
    if room is None:
        bad = ",".join(str(n) for n in prompts if n + 1 > cap)
        raise OrtleanError(f"--prompt {bad}: {where} takes {cap} positions, so a prompt and its first new token "
                           f"fit in at most {cap - 1} prompt tokens")
    lim = cap - max(1, int(room))
    out = sorted({min(n, lim) for n in prompts})
    return out, (f"--prompt {','.join(map(str, prompts))}: the models take {cap} positions, so prompts beyond {lim} "
                 f"ran at {lim}")


def prompt_ids(ref: str, model: str, tokenizer: str | None, text_path: str | None, longest: int,
               vocab: int | None) -> tuple[np.ndarray, str]:
    """The ids of the --prompt runs: the first ``longest`` tokens of ``text_path`` (default the held-out
    novel, ``ortlean corpus --eval``) by the model's tokenizer (--tokenizer, else beside ``ref``, else beside
    ``model``), no special tokens; and where they came from. Clear errors for a missing file, a text too
    short, ids beyond the models' vocabulary."""
    tok = _tokenizer(ref if tokenizer or (Path(ref).parent / "tokenizer.json").exists() else model, tokenizer)
    if text_path:
        tp = Path(text_path)
        if not tp.is_file():
            raise OrtleanError(f"--prompt-text {tp}: no such file")
        text, source, flag = tp.read_text(encoding="utf-8", errors="replace"), tp.name, f"--prompt-text {tp}"
    else:
        from models import corpus

        text, source, flag = corpus.text(corpus.EVAL_NOVEL), corpus.EVAL_NOVEL, None
    ids = runtime.tokenize(tok, text)[: int(longest)]
    if ids.size < int(longest):
        raise OrtleanError(f"--prompt {longest}: {source} has only {ids.size} tokens"
                           + ("" if flag else " (--prompt-text: a longer text)"))
    if vocab and ids.size and int(ids.max()) >= int(vocab):
        raise OrtleanError(f"--prompt: the tokenizer gives ids up to {int(ids.max())}, beyond the models' vocabulary "
                           f"of {vocab} (--tokenizer: the model's own)")
    return ids, source


class LlamaPromptRow:
    """llama.cpp's time to first token as a row of :func:`runtime.bench.prompt_table`: per run one
    ``llama-bench -m GGUF -t T -p N -n 0 -r 1`` (:class:`models.peers.LlamaBenchRow`), timed by llama-bench
    itself (its sample: the prompt's decode calls, not the process start or the model's load), on tokens
    llama-bench makes (a prompt's cost does not depend on its tokens). It takes its turn in the rounds like
    the ONNX rows; it skips the untimed warm-up round (every llama-bench process warms itself: a whole run
    of the prompt before the timed one, left out from :data:`LLAMA_NO_WARMUP_FROM` tokens)."""

    def __init__(self, name: str, threads: int):
        from models import peers as pm

        self.row = pm.LlamaBenchRow(name, threads)
        self.threads = int(threads)

    def warm(self, ids) -> None:
        return None

    def ttft(self, ids) -> float | None:
        n = int(np.asarray(ids).size)
        self.row.timeout = 600.0 + 0.25 * n    # a 32k prompt on one core is tens of minutes
        args = ["-p", str(n), "-n", "0"] + (["--no-warmup"] if n >= LLAMA_NO_WARMUP_FROM else [])
        return self.row._run(f"pp{n}", args)

    def info(self) -> dict:
        r = self.row
        return {"threads": self.threads, "build": r.build, "model_type": r.model_type, "how": r.how,
                "peak_rss_mb": round(r.peak_kb / 1024) if r.peak_kb else None,
                "commands": list(dict.fromkeys(r.commands.values())), "failed": r.failed}


def default_pasts(model: str) -> list[int]:
    """`ortlean bench`'s decode pasts when none are given: 128, and for a model that approximates in
    decode (PackedAttention with a budget) also 1024, 4096 and 8192 — where the approximation runs
    (fit_pasts caps them to the model's positions)."""
    try:
        approx = runtime.approximate_decode(model)
    except Exception:  # an unreadable model is reported by bench itself, with the file named
        approx = False
    return list(LONG_PASTS) if approx else [128]


def _text_and_models(text_path: str, model: str, ref: str) -> str:
    """--text's contents, once both models have loaded (each bad file named before any work)."""
    tp = Path(text_path)
    if not tp.is_file():
        raise OrtleanError(f"--text {tp}: no such file")
    text = tp.read_text(encoding="utf-8", errors="replace")
    modelfile.load_model(model)
    modelfile.load_model(ref)
    return text


def evaluate(model: str, ref: str, text_path: str, threads: int = 2, window: int = 512, windows: int = 8,
             sentences: int = 256, tokenizer: str | None = None, peers: str = "none", decode_context: int | None = None,
             decode_score: int = 256) -> dict:
    text, tp = _text_and_models(text_path, model, ref), Path(text_path)
    s_ref = _session(ref, threads)
    s_lean = _session(model, threads)
    io = runtime.ModelIO.from_session(s_ref, ref)
    io_l = runtime.ModelIO.from_session(s_lean, model)
    if io.kind != io_l.kind:
        raise OrtleanError(f"{model} ({io_l.kind}) and --ref {ref} ({io.kind}) are not the same kind of model")
    tok = _tokenizer(ref if tokenizer or (Path(ref).parent / "tokenizer.json").exists() else model, tokenizer)
    res = {"model": model, "ref": ref, "text": str(tp), "kind": io.kind}
    if io.kind == "causal-lm":
        all_ids = tok.encode(text, add_special_tokens=False).ids
        ids = np.asarray(all_ids[: window * windows], dtype=np.int64)
        if ids.size < 2:
            raise OrtleanError(f"--text {tp}: {ids.size} tokens, perplexity needs at least 2")
        pre = runtime.text_prefix(tok)      # every window starts as a prompt does (Gemma: <bos>)
        res["prefix"] = [int(x) for x in pre]
        approx_from = runtime.approximate_from(model)
        if approx_from is not None or decode_context is not None:
            # the approximation only runs in decode: measure there (and wherever --decode-context asks:
            # e.g. int8 K/V rows at budget 1 after a long context)
            cap = min([p for p in (max_positions(model), max_positions(ref)) if p] or [1 << 30])
            # by default at a context where the candidate path runs (min_context + 1 of the model's nodes)
            want = decode_context if decode_context is not None else max(1024, approx_from)
            ctx_len = min(want, cap - decode_score - 1 - pre.size)
            if ctx_len < 1:
                raise OrtleanError(f"--decode-context {want} + --decode-score {decode_score}: the model takes "
                                   f"{cap} positions")
            dm = dict(context=ctx_len, score=decode_score, windows=max(1, windows // 2))  # 4 x 256 by default
            res["mode"] = (f"decode-mode ({dm['windows']} windows: {dm['context']}-token prefill, {dm['score']} decode "
                           "steps)")
            if approx_from is not None and ctx_len + decode_score < approx_from:
                res["mode"] += (f"; the model approximates from context {approx_from} on: these steps run its exact "
                                "path")

            def score(s, io_):
                return runtime.decode_perplexity(s, io_, all_ids, prefix=pre, **dm)
        else:
            def score(s, io_):
                return runtime.perplexity(s, io_, ids, window=window, prefix=pre)
        d = score(s_ref, io)
        l = score(s_lean, io_l)
        res.update({"tokens": int(d["tokens"]), "window": window, "ppl_ref": float(d["ppl"]), "ppl": float(l["ppl"]),
                    "delta_ppl": float(l["ppl"] / d["ppl"] - 1.0)})
        if "token_nll" in d and len(d["token_nll"]) == len(l["token_nll"]):  # the same tokens, paired
            res["delta_ppl_upper"] = runtime.paired_delta(l["token_nll"], d["token_nll"])[1]
        rows, notes = {}, []
        for name, path in peer_models(ref, peers, notes).items():  # the peers a user compares, same text
            s = _session(path, threads)
            p = score(s, runtime.ModelIO.from_session(s, path))
            rows[name] = {"path": path, "ppl": float(p["ppl"]), "delta_ppl": float(p["ppl"] / d["ppl"] - 1.0)}
            if d.get("token_nll") is not None and len(d["token_nll"]) == len(p["token_nll"]):
                rows[name]["delta_ppl_upper"] = runtime.paired_delta(p["token_nll"], d["token_nll"])[1]
            del s
        lq = llama_quality(ref, peers, ids, window, threads, notes, prefix=pre)
        if lq is not None:
            rows["llama.cpp"] = lq
        res.update({"peers": rows, "notes": notes})
    else:
        sents = runtime.sentences_from_text(text, sentences)
        if not sents:
            raise OrtleanError(f"--text {tp}: no sentences in it")
        e_d = runtime.embeddings(s_ref, io, tok, sents)
        e_l = runtime.embeddings(s_lean, io_l, tok, sents)
        cos = np.sum(e_d * e_l, axis=1) / (np.linalg.norm(e_d, axis=1) * np.linalg.norm(e_l, axis=1) + 1e-30)
        res.update({"sentences": len(sents), "cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
                    "cosine_p5": float(np.percentile(cos, 5))})
    return res


def format_eval(r: dict) -> str:
    if r["kind"] == "causal-lm":
        how = r.get("mode") or f"{r['window']}-token windows"
        out = (f"perplexity on {r['tokens']} tokens ({how}) of {Path(r['text']).name}: "
               f"dense {r['ppl_ref']:.3f}, lean {r['ppl']:.3f}, Δppl {100 * r['delta_ppl']:+.2f} %")
        if "delta_ppl_upper" in r:
            out += f" (one-sided 95 % upper bound {100 * r['delta_ppl_upper']:+.2f} %, paired per-token NLLs)"
        for k, v in (r.get("peers") or {}).items():
            up = f" (bound {100 * v['delta_ppl_upper']:+.2f} %)" if "delta_ppl_upper" in v else ""
            vs = v.get("note") or "same text, vs the same dense model"
            out += f"\n  {k:<12} ppl {v['ppl']:.3f}, Δppl {100 * v['delta_ppl']:+.2f} %{up} ({vs})"
        for n in r.get("notes") or []:
            out += f"\nnote: {n}"
        return out
    return (f"sentence-embedding cosine lean vs dense over {r['sentences']} sentences of {Path(r['text']).name}: "
            f"mean {r['cosine_mean']:.5f}, p5 {r['cosine_p5']:.5f}, min {r['cosine_min']:.5f}")


NEEDLE_FLAGS = {"lengths": "--lengths", "depths": "--depths", "kinds": "--needle-kinds", "cases": "--cases",
                "seed": "--seed"}


def needle(model: str, ref: str, text_path: str, threads: int = 2, tokenizer: str | None = None, lengths=None,
           depths=None, kinds=None, cases: int = 1, seed: int = 0, progress: bool = True,
           cache_dir: str | None = None, say=None) -> dict:
    """`ortlean eval --task needle` (custom_ops.runtime.needle): the same cases through the reference and
    the model, each run as `ortlean generate` runs a long prompt; every bad value is an OrtleanError
    naming its flag, raised before either model runs. ``lengths`` None: those of needle.LENGTHS the
    models take (their positions: config.json's, and a fused graph's rotary cache). ``cache_dir``: each
    model's case results kept there by a stamp of its files, the cases (their token ids and answers),
    the thread count, ortlean's code and library, and reused under the same stamp — the reference of
    several models is read once (``say`` hears when a model's results are reused). ``progress``: each
    model's cases as a bar on a terminal, else a line at least every 15 s on stderr (rewriter.kit.progress)."""
    import dataclasses
    import os

    from custom_ops.runtime import needle as nd
    from custom_ops.runtime.generate import model_positions

    text, tp = _text_and_models(text_path, model, ref), Path(text_path)
    caps = [p for m in (model, ref) for p in (max_positions(m), model_positions(m)) if p]
    cap = min(caps) if caps else None
    if lengths is None:
        lengths = [n for n in nd.LENGTHS if cap is None or n <= cap] or [cap]
    tok = _tokenizer(ref if tokenizer or (Path(ref).parent / "tokenizer.json").exists() else model, tokenizer)
    try:
        cases_ = nd.make_cases(tok, text, lengths, nd.DEPTHS if depths is None else depths,
                               nd.KINDS if kinds is None else kinds, cases, seed, positions=cap)
    except nd.NeedleError as e:
        flag = f"--text {tp}" if e.param == "text" else NEEDLE_FLAGS.get(e.param, e.param)
        raise OrtleanError(f"{flag} {e.value}: {e.why}") from None
    runs = {}
    same = os.path.realpath(model) == os.path.realpath(ref)
    cache = stamps.JsonCache(cache_dir) if cache_dir else None
    if cache is not None:
        key = hashlib.sha256(json.dumps([[c.kind, c.length, c.depth, c.needles, c.index, list(map(int, c.ids)),
                                          c.answer, c.new_tokens] for c in cases_]).encode()).hexdigest()[:20]
        common = {"task": "needle", "cases": key, "threads": threads, "code": stamps.code_hash(),
                  "library": stamps.library_hash()}

    def run(path: str) -> list:
        sess = generator_session(path, threads)
        io = runtime.ModelIO.from_session(sess, path)
        if io.kind != "causal-lm" or not io.logits_name:
            raise OrtleanError(f"--task needle: {path} is not a causal LM (no logits output)")
        # a bar on a terminal, else a line at least every 15 s in a log (a 32k case takes minutes)
        with Progress(f"needle, {Path(path).parent.name}/{Path(path).name}", total=len(cases_), unit="case",
                      enabled=progress) as bar:
            def step(c, r):
                bar.update(1, f"last: {c.kind} {c.length:,} depth {c.depth:g}: {'hit' if r.hit else 'miss'}")
                if c is not cases_[-1]:
                    nxt = cases_[bar.n]
                    bar.status(f"{nxt.kind} {nxt.length:,} depth {nxt.depth:g}")

            bar.status(f"{cases_[0].kind} {cases_[0].length:,} depth {cases_[0].depth:g}")
            out = nd.run_cases(sess, io, tok, cases_, model_path=path, progress=step)
        del sess
        return out

    for name, path in (("ref", ref), ("model", model)):
        if name == "model" and same:
            runs["model"] = runs["ref"]
            break
        if cache is None:
            runs[name] = run(path)
            continue
        got = cache.value({**common, "model": stamps.file_stamp(path)},
                          lambda p=path: [dataclasses.asdict(r) for r in run(p)],
                          on_hit=(lambda p=path: say(f"needle: {p}: results reused (same files, cases, threads, "
                                                     "code and library)")) if say else None)
        runs[name] = [nd.CaseResult(**r) for r in got]
    res = nd.compare(runs["model"], runs["ref"])
    res.update({"model": model, "ref": ref, "text": str(tp), "text_name": tp.name, "lengths": [int(x) for x in lengths],
                "depths": list(dict.fromkeys(c.depth for c in cases_)), "kinds": list(dict.fromkeys(c.kind for c in cases_)),
                "cases_per_cell": int(cases), "seed": int(seed), "new_tokens": nd.NEW_TOKENS, "positions": cap})
    return res


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


def _has_gqa(path: str) -> bool:
    """A graph whose cache can be one shared buffer per state (runtime.shared_kv): GroupQueryAttention,
    or PackedAttention in its cache mode (seqlens_k input)."""
    import onnx

    return any(n.op_type == "GroupQueryAttention" or (n.op_type == "PackedAttention" and len(n.input) > 6 and n.input[6])
               for n in onnx.load(path, load_external_data=False).graph.node)


def _float_cache(path: str) -> bool:
    """The model's cache holds K/V in float32 (what long-past caches are built from): past_key_values.N.key
    / .value, or PackedAttention's fp32 rows with sign / ternary key bits (runtime.bench._float_kv)."""
    import onnx

    m = onnx.load(path, load_external_data=False)
    names = {i.name for i in m.graph.input}
    if "past_key_values.0.key" in names and "past_key_values.0.value" in names:
        return True
    pa = [n for n in m.graph.node if n.op_type == "PackedAttention"]
    if not pa or "past_key_values.0.kv" not in names:
        return False
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in pa]
    return all(a.get("kv_quant") == b"fp32" and a.get("mode", b"sign") in (b"sign", b"ternary") for a in attrs)


def past_cache_dir(arg: str | None = None) -> str | None:
    """Where bench keeps its long pasts' caches: ``arg`` (a directory), None for "off" (in memory for
    the run only), or by default ``<ortlean cache>/pasts``."""
    if arg == "off":
        return None
    return str(cache_root() / "pasts") if arg is None else arg


def bench(model: str, ref: str, threads=(1, 2), prefill: int = 128, decode_past=128, repeats: int = 15,
          nbits=(8, 4), profile: bool = True, peers: str = "auto", llama: bool = True, steps: int = 16,
          huge_pages: bool = True, also: dict[str, str] | None = None, quality_text: str | None = None,
          trace_dir: str | None = None, tokenizer: str | None = None, rows: str = "all",
          quality_cache: str | None = None, genai: bool = True, past_cache: str | None = None,
          genai_extra: dict[str, str] | None = None, prompts=(), prompt_repeats: int | None = None,
          prompt_chunk: int | None = None, prompt_text: str | None = None, prompt_room: int | None = None) -> dict:
    """Speed of ``model`` against its dense ``ref`` in one process. Causal LMs: the comparison table
    (``runtime.bench.decode_table``) — dense, lean, ORT's MatMulNBits of the dense model, the genai
    builder's fp32/int4 models of the same checkpoint (plain loop, shared-KV loop, og generator) —
    at every ``decode_past`` length and thread count, plus llama.cpp's llama-bench on the package's
    GGUF; encoders: ``runtime.bench_sessions``. ``huge_pages``: the causal-LM rows' memory (weights
    and caches of every row, the og generators' too) on 2 MiB pages after the warm-up round.
    ``also``: {label: path} more models measured as rows of the same run (ours, like ``model``);
    ``quality_text``: Δppl of every ONNX row against ``ref`` on that text (:func:`table_quality`,
    causal LMs); ``trace_dir``: ORT's profiler trace (chrome trace JSON) of every ONNX row at every
    thread count written there (``<row>.t<threads>.json``). ``rows`` (causal LMs): "all" times every
    model with every driver it can run under; "best" times each model once, the way it is run at its
    fastest — ours and a GroupQueryAttention peer with shared K/V buffers, genai's int4 model in its own
    generator, llama.cpp in llama-bench — and leaves out the rows that only explain (the dense model
    is the quality reference, not timed; genai's fp32 model; other drivers). ``quality_cache``: a
    directory where each row's quality scores are kept and reused under the same stamp
    (:func:`table_quality`). ``genai``: False leaves the onnxruntime-genai rows out; ``genai_extra``:
    more genai-built models ({"genai <label>": model.onnx}) timed and scored as those rows are. ``past_cache``: a
    directory where the caches of pasts above 512 tokens are kept and reused
    (:class:`runtime.bench.PastStore`; None: built in memory for this run). ``decode_past`` empty: no
    decode table (nor its prefill column, weights floor or decode profile), for a run of ``prompts`` alone.
    ``prompts`` (causal LMs): the time to first token of prompts of these lengths for every row at every
    thread count (:func:`_prompt_phase`: ``prompt_repeats`` timed runs each, default
    :func:`runtime.bench.prompt_repeats`; ``prompt_chunk`` tokens a run, default ``ortlean generate``'s;
    the text ``prompt_text``, default the held-out novel); a length beyond the models' positions is an
    error, or with ``prompt_room`` runs at the positions minus that (:func:`fit_prompts`)."""
    if rows not in ("all", "best"):
        raise OrtleanError(f"rows={rows!r}: 'all' or 'best'")
    from .results import git_commit

    start = git_commit()  # the code that runs: a results file names it, not where the checkout ends up
    also = dict(also or {})
    modelfile.load_model(model)  # both models named before any work
    modelfile.load_model(ref)
    for label, path in also.items():
        if label in ("dense", "lean") or label.startswith(("genai ", "MatMulNBits ")):
            raise OrtleanError(f"--also {label}={path}: the label {label!r} names one of the bench's own rows")
        modelfile.load_model(path)
    pasts = [int(decode_past)] if isinstance(decode_past, int) else [int(p) for p in decode_past]
    prompts = sorted({int(n) for n in prompts or ()})
    if runtime.ModelIO.from_model(ref).kind == "causal-lm":
        if not pasts and not prompts:
            raise OrtleanError("--decode-past none: nothing to time (give --prompt N for the time to first token)")
        if prompts and prompt_room is None:   # our models' positions, before any peer is built or session made
            fit_prompts(prompts, [ref, model, *also.values()])
        res = _bench_causal(model, ref, threads, prefill, pasts, repeats, nbits, profile, peers, llama, steps,
                            huge_pages, also=also, quality_text=quality_text, trace_dir=trace_dir,
                            tokenizer=tokenizer, best=rows == "best", quality_cache=quality_cache, genai=genai,
                            past_cache=past_cache, genai_extra=genai_extra, prompts=prompts,
                            prompt_repeats=prompt_repeats, prompt_chunk=prompt_chunk, prompt_text=prompt_text,
                            prompt_room=prompt_room)
        res["git_start"] = list(start)
        return res
    if prompts:
        raise OrtleanError("--prompt: the time to first token is measured for causal LMs")
    if quality_text:
        raise OrtleanError("--quality-text: Δppl is measured for causal LMs; an encoder's quality is "
                           "`ortlean eval`'s embedding cosine")
    decode_past = pasts[0] if pasts else 128   # an encoder has no decode steps: the value is not used
    variants = {"dense": ref, "lean": model, **also}
    for b in nbits:
        try:
            variants[f"MatMulNBits int{b}"] = nbits_model(ref, b)
        except Exception as e:  # a comparison row we cannot make is reported, not fatal
            variants[f"MatMulNBits int{b}"] = None
            print(f"note: MatMulNBits int{b} row skipped: {e}")
    res = {"model": model, "ref": ref, "prefill": prefill, "decode_past": decode_past, "runs": [],
           "variants": {k: v for k, v in variants.items() if v}, "ours": ["lean", *also], "git_start": list(start)}
    res["weight_bytes"] = {k: (runtime.weight_bytes(v) if v else None) for k, v in variants.items()}
    for t in threads:
        sessions = {k: _session(v, t) for k, v in variants.items() if v}
        io = runtime.ModelIO.from_session(sessions["dense"], variants["dense"])
        ios = {k: runtime.ModelIO.from_session(s, variants[k]) for k, s in sessions.items()}
        r = runtime.bench_sessions(sessions, io, prefill_len=prefill, decode_past=decode_past, repeats=repeats, ios=ios)
        res["runs"].append({"threads": t, "kind": io.kind, "results": r})
    if profile or trace_dir:
        res["profile"] = _profiles(variants, max(threads))
    if trace_dir:
        res["profile_traces"] = _encoder_traces(variants, threads, trace_dir)
    return res


def _profiles(variants: dict, threads: int) -> dict:
    """ORT's per-node profile of the dense and the rewritten model, summarised."""
    out = {}
    for k in ("dense", "lean"):
        prof = runtime.profile_summary(variants[k], lambda p, so=None: _profiled_session(p, so, threads), feeds=None,
                                       runs=5)
        out[k] = {"rows": list(prof), "top_nodes": prof.top_nodes}
    return out


def trace_name(row: str, threads: int) -> str:
    """File name of a row's ORT profiler trace: the row's name made file-safe, then the thread count
    (``genai int4`` at 2 threads: ``genai-int4.t2.json``)."""
    import re

    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', row).strip('-') or 'row'}.t{int(threads)}.json"


def _encoder_traces(variants: dict, threads, trace_dir: str) -> dict:
    """ORT's profiler trace of a 16-token run (5 measured after 1 warm-up) of every row at every
    thread count, kept in ``trace_dir``."""
    d = Path(trace_dir)
    d.mkdir(parents=True, exist_ok=True)
    out: dict[str, dict] = {}
    for t in threads:
        for k, v in variants.items():
            if not v:
                continue
            path = d / trace_name(k, t)
            runtime.profile_summary(v, lambda p, so=None, t=t: _profiled_session(p, so, t), feeds=None, runs=5,
                                    keep_trace=str(path))
            out.setdefault(k, {})[str(t)] = str(path)
    return out


def _bench_causal(model, ref, threads, prefill, pasts, repeats, nbits, profile, peers, llama, steps,
                  huge_pages=True, also=None, quality_text=None, trace_dir=None, tokenizer=None,
                  best=False, quality_cache=None, genai=True, past_cache=None, genai_extra=None, prompts=(),
                  prompt_repeats=None, prompt_chunk=None, prompt_text=None, prompt_room=None) -> dict:
    import sys

    from custom_ops.runtime import bench as rb

    notes: list[str] = []
    malloc_note = rb.fix_malloc_threshold()  # the rows' sessions place their weights alike, not by build order
    if malloc_note:
        notes.append(malloc_note)
    if huge_pages:
        notes.append("every row's memory (weights, caches, og generators) moved to 2 MiB pages after the warm-up "
                     "round where the kernel's transparent huge pages allow (runtime.memory.huge_pages_for_process; "
                     "--huge-pages off: left on 4 KiB pages)")
    also = dict(also or {})
    variants = {"dense": ref, "lean": model, **also}
    for b in nbits:
        try:
            variants[f"MatMulNBits int{b}"] = nbits_model(ref, b)
        except Exception as e:  # a comparison row we cannot make is reported, not fatal
            notes.append(f"MatMulNBits int{b} row skipped: {e}")
    # rows=best: the peer users ship is genai's int4 model; its fp32 one only shows the builder's graph
    # (not even built: for a 1.5B model that is a 7 GB export)
    genai = {**peer_models(ref, peers, notes, precisions=("int4",) if best else None), **(genai_extra or {})} if genai else {}
    variants.update(genai)
    pasts, note = fit_pasts(pasts, steps, variants.values())
    if note:
        notes.append(f"--{note}")
    prompts, note = fit_prompts(prompts, variants.values(), room=prompt_room)   # the peers' positions too
    if note:
        notes.append(note)
    shared = [k for k, v in variants.items() if _has_gqa(v)]
    # long pasts: built once (chunked prefill, then kept for every thread count) by a fused model with a
    # float cache when there is one — ours, then a GQA peer (values do not change the cost); the unfused
    # dense export's prefill at 8k is several times slower
    src = next((k for k in ("lean", *also, *shared) if k in shared and _float_cache(variants[k])), "dense")
    built = rb.PastStore(past_cache, {"model": stamps.file_stamp(variants[src]), "format": 1})
    og_ok = bool(genai) and __import__("importlib").util.find_spec("onnxruntime_genai") is not None
    loop = None
    if best:  # each model under its fastest driver only; the dense model is the quality reference
        loop = [k for k in variants if k != "dense" and k not in shared and not (k in genai and og_ok)]
        shared = [k for k in shared if not (k in genai and og_ok)]
        notes.append("rows: each model timed under its fastest driver only (the dense model: quality reference, "
                     "not timed; `ortlean bench` times every driver)")
    res = {"model": model, "ref": ref, "kind": "causal-lm", "prefill": prefill if pasts else None, "pasts": pasts,
           "steps": steps, "repeats": repeats, "threads": list(threads), "isa": _isa_line(), "notes": notes,
           "variants": variants, "weight_bytes": {k: runtime.weight_bytes(v) for k, v in variants.items()},
           "cache_bytes_per_token": {k: runtime.cache_bytes_per_token(v) for k, v in variants.items()},
           "table": {}, "ours": ["lean", *also], "model_name": peer_name(ref, peers) or Path(ref).parent.name}

    def say(msg):
        print(f"[bench] {msg}", file=sys.stderr, flush=True)

    # llama.cpp at short pasts takes its turn in the table's rounds (one llama-bench run per round and
    # test), so its figures come from the same minutes as ours; at long pasts each of its runs would
    # prefill the whole past again, so it runs after the table (below)
    llama_name = peer_name(ref, peers) if llama else None
    interleaved = bool(llama_name) and bool(pasts) and max(pasts) <= LLAMA_INTERLEAVE_MAX_PAST
    llama_runs: list = []
    prompt = _prompt_setup(res, variants, ref, model, prompts, prompt_repeats, prompt_chunk, prompt_text, tokenizer,
                           repeats, best, llama, llama_name) if prompts else None
    # the memory floor of lean's decode step: its weight bytes read once, in the same rounds as the rows
    from custom_ops.runtime import floor as fl

    floor_reads = fl.weight_reads(model) if pasts else []
    floor = {"model": "lean", "nodes": len(floor_reads), "bytes": sum(b for _, b in floor_reads),
             "configs": [list(c) for c in fl.CONFIGS], "table": {}} if floor_reads else None  # patterns: the ones chosen
    # both forms read these; the process's peak RSS before them, as the table's peak is reported without them
    rss_before_floor = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    floor_arrays = fl.aligned_buffers([b for _, b in floor_reads]) if floor else None
    for t in threads:
        models = {}
        for k, v in variants.items():
            if best and k == "dense" and (src != "dense" or not pasts):   # neither timed nor building caches
                continue
            s = generator_session(v, t)   # prompts: the last position's logits, as every generator reads them
            models[k] = (s, runtime.ModelIO.from_session(s, v))
        extra = {}
        if floor:
            extra.update({row: fl.FloorRow(floor_arrays, t, sync) for row, sync in FLOOR_ROWS.items()})
        if interleaved:
            from models import peers as pm

            try:
                extra[LLAMA_ROW] = pm.LlamaBenchRow(llama_name, t)
            except pm.PeerError:   # no GGUF: llama_bench below says so, once
                interleaved = False
        if pasts:
            res["table"][f"t{t}"] = rb.decode_table(
                models, pasts, prefill_len=prefill, steps=steps, repeats=repeats, shared=tuple(shared),
                og={k: str(Path(v).parent) for k, v in genai.items()} if og_ok else None, threads=t,
                long_past_from=src, say=say, huge_pages=huge_pages, loop=loop, built=built, extra=extra)
        if prompt:   # the time to first token, after the decode table, with the same sessions
            _prompt_phase(prompt, models, variants, genai if og_ok else {}, t, llama_name, say, huge_pages)
        if floor:
            floor["table"][f"t{t}"] = {row: res["table"][f"t{t}"].pop(row, {}) for row in FLOOR_ROWS}
            floor.setdefault("patterns", {})[f"t{t}"] = {row: list(extra[row].config or ()) for row in FLOOR_ROWS}
        if LLAMA_ROW in extra:
            llama_runs.append((extra[LLAMA_ROW], res["table"][f"t{t}"].pop(LLAMA_ROW, {})))
        del models, extra
    if floor:
        res["weights_floor"] = floor
    if built.root is not None and any(p > 512 for p in pasts):
        notes.append(f"long pasts' caches kept in / loaded from {built.root} (by the building model's file stamp "
                     "and the token ids; --past-cache off: built in memory for this run only)")
    notes.extend(built.skipped)
    del built
    if llama and llama_runs:
        from models import peers as pm

        rows = [x for drv, cells in llama_runs for x in pm.rows_from_table(drv, cells, prefill, pasts, steps)]
        cmds = list(dict.fromkeys(c for drv, _ in llama_runs for c in drv.commands.values()))
        failed = [drv.failed for drv, _ in llama_runs if drv.failed]
        note = ("llama-bench interleaved with the ONNX rows, one run per round and test (medians over the "
                f"rounds): {'; '.join(cmds)} ({llama_runs[0][0].how})" + "".join(f"; stopped: {f}" for f in failed))
        peaks = [r["peak_rss_mb"] for r in rows if r.get("peak_rss_mb")]
        res["llama_cpp"] = {"rows": rows, "command": note, "peak_rss_mb": max(peaks) if peaks else None}
        if not rows:
            res["llama_cpp"]["command"] = "llama.cpp rows skipped: " + ("; ".join(failed) or "no samples")
        if failed or not rows:
            notes.append(res["llama_cpp"]["command"] if not rows else f"llama.cpp: {'; '.join(failed)}")
    elif llama and pasts:
        name = llama_name
        if name is None:
            notes.append("llama.cpp rows skipped: no packaged GGUF for this model (--peers)")
        else:
            from models import peers as pm

            # llama-bench prefills each depth again for every repetition (8k tokens: about a minute on
            # one thread): as many repetitions as the table's rounds, at most 3 — one beyond 8k (a 32k
            # depth is several minutes of prefill per repetition; each reports the mean of 32 steps)
            reps = max(1, min(3 if max(pasts) <= 8192 else 1, int(repeats)))
            say(f"llama.cpp: llama-bench, {reps} repetitions")
            t0 = time.perf_counter()
            rows, note, stopped = pm.llama_bench(name, threads=tuple(threads), prompt=prefill, gen=32,
                                                 depths=tuple(pasts), repetitions=reps)
            say(f"llama.cpp: llama-bench took {time.perf_counter() - t0:.0f} s")
            peaks = [r["peak_rss_mb"] for r in rows if r.get("peak_rss_mb")]   # llama-bench's own VmHWM
            res["llama_cpp"] = {"rows": rows, "command": note, "peak_rss_mb": max(peaks) if peaks else None}
            if not rows or stopped:
                notes.append(note)
    dense_cache = res["cache_bytes_per_token"].get("dense")
    if res.get("llama_cpp") and dense_cache and \
            runtime.ModelIO.from_model(ref).state_types.get("past_key_values.0.key") == np.float32:
        # llama-bench's default cache type is f16 (-ctk / -ctv): half of the fp32 export's K/V
        res["llama_cpp"]["cache_bytes_per_token"] = dense_cache // 2
    # the process's peak RSS after the timed rows (every ONNX row's weights and caches in this one
    # process; the quality rows after it load their models again)
    # (the weights floor's buffers, resident through the whole table, are not an ONNX row's memory)
    floor_mb = sum(a.nbytes for a in floor_arrays) / 2**20 if floor else 0.0
    res["peak_rss_mb"] = round(max(rss_before_floor, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - floor_mb))
    del floor_arrays
    if quality_text:
        say(f"quality: Δppl of every row on {Path(quality_text).name}")
        res["quality"] = table_quality(variants, ref, quality_text, max(threads), tokenizer=tokenizer, say=say,
                                       llama_peers=peers if llama else None, cache_dir=quality_cache)
    decodes = all(runtime.ModelIO.from_model(variants[k]).past_to_present for k in ("dense", "lean"))
    if (profile or trace_dir) and not pasts:
        notes.append("no decode pasts (--decode-past none): no decode profile")
    elif (profile or trace_dir) and decodes:
        res["decode_profile"] = _decode_profiles(variants, threads, max(pasts), huge_pages, say, trace_dir=trace_dir)
        if trace_dir:
            res["profile_traces"] = res["decode_profile"].pop("traces")
    elif profile or trace_dir:  # no KV cache to decode with: the profile of a 16-token run
        res["profile"] = _profiles(variants, max(threads))
        if trace_dir:
            res["profile_traces"] = _encoder_traces(variants, threads, trace_dir)
    return res


def _prompt_setup(res: dict, variants: dict, ref: str, model: str, prompts: list[int], prompt_repeats, prompt_chunk,
                  prompt_text, tokenizer, repeats: int, best: bool, llama: bool, llama_name) -> dict:
    """What the --prompt phase of every thread count shares: the prompt's ids, the rows, and
    ``res["prompt"]`` (what the JSON keeps: lengths, runs per length, chunk, text, per thread count
    {row: {length: [seconds]}}, llama-bench's build and commands)."""
    from custom_ops.runtime import bench as rb
    from custom_ops.runtime.generate import PREFILL_CHUNK as GENERATE_CHUNK

    vocab = min([v for v in (runtime.ModelIO.from_model(p).vocab_size for p in variants.values()) if v] or [0]) or None
    ids, source = prompt_ids(ref, model, tokenizer, prompt_text, prompts[-1], vocab)
    chunk = int(prompt_chunk or GENERATE_CHUNK)
    rows = [k for k in variants if not (best and k == "dense")]
    doc = {"lengths": list(prompts), "repeats": {str(n): rb.prompt_repeats(n, repeats, prompt_repeats) for n in prompts},
           "chunk": chunk, "text": source, "warmup_tokens": min(prompts[0], 2 * chunk), "table": {}, "limits": {},
           "llama_cpp": {}}
    res["prompt"] = doc
    notes = res["notes"]
    held = "" if prompt_text else " (the held-out novel)"
    notes.append(f"time to first token (--prompt): the first N tokens of {source}{held}, from an empty cache to the first new "
                 f"token's logits, each row as it generates — ours and ONNX peers through `ortlean generate`'s decoder "
                 f"({chunk}-token chunks, shared K/V buffers where the graph allows), genai's models in its own generator "
                 f"(the same chunks), llama.cpp in `llama-bench -p N -n 0 -r 1` (its own tokens; its untimed warm-up "
                 f"run left out from {LLAMA_NO_WARMUP_FROM} tokens); per thread count one untimed round of a "
                 f"{doc['warmup_tokens']}-token prompt, then per length "
                 + ", ".join(f"{n}: {r}" for n, r in doc["repeats"].items())
                 + " timed round(s), rows rotated; medians")
    if prompts[-1] > REF_PROMPT_MAX and any(_reference_like(k) for k in rows):
        notes.append(f"time to first token: the reference rows ({', '.join(k for k in rows if _reference_like(k))}) "
                     f"timed at prompts up to {REF_PROMPT_MAX} tokens only")
    if llama and not llama_name:
        notes.append("llama.cpp's time to first token skipped: no packaged GGUF for this model (--peers)")
    return {"ids": ids, "rows": rows, "doc": doc, "chunk": chunk, "notes": notes}


def _prompt_phase(state: dict, models: dict, variants: dict, og_models: dict, threads: int, llama_name, say,
                  huge_pages: bool) -> None:
    """The time to first token of every row at ``threads`` (``runtime.bench.prompt_table``) into
    ``state["doc"]["table"]["t<threads>"]``: our models and ONNX peers on the table's sessions
    (``runtime.bench.PromptRow``: the row "<model> | shared KV" or the plain "<model>", as the decode table
    names them), genai's models in ``og_models`` in its generator ("<model> | og"), llama.cpp
    (:data:`LLAMA_ROW`) in llama-bench."""
    from custom_ops.runtime import bench as rb

    doc, chunk = state["doc"], state["chunk"]
    drivers, limits = {}, {}
    for k in state["rows"]:
        if k in og_models:
            name, d = f"{k} | og", rb.OgPromptRow(str(Path(variants[k]).parent), threads, chunk)
        elif k in models:
            s, io = models[k]
            d = rb.PromptRow(s, io, model_path=variants[k], chunk=chunk)
            name = f"{k} | shared KV" if d.shared else k
        else:
            continue
        drivers[name] = d
        if _reference_like(k):
            limits[name] = REF_PROMPT_MAX
    llama_row = None
    if llama_name:
        from models import peers as pm

        try:
            llama_row = drivers[LLAMA_ROW] = LlamaPromptRow(llama_name, threads)
        except pm.PeerError as e:
            if not any(n.startswith("llama.cpp's time to first token") for n in state["notes"]):
                state["notes"].append(f"llama.cpp's time to first token skipped: {e}")
    say(f"threads {threads}: time to first token of {', '.join(map(str, doc['lengths']))}-token prompts: "
        + ", ".join(drivers))
    doc["table"][f"t{threads}"] = rb.prompt_table(
        drivers, state["ids"], doc["lengths"], {int(n): r for n, r in doc["repeats"].items()}, threads=threads,
        warmup_tokens=doc["warmup_tokens"], limits=limits, say=say, huge_pages=huge_pages)
    doc["limits"].update(limits)
    if llama_row is not None:
        doc["llama_cpp"][f"t{threads}"] = llama_row.info()
    del drivers


def llama_quality(ref: str, peers: str, ids, window: int, threads: int, notes: list, prefix=None) -> dict | None:
    """llama.cpp's Δppl on ``ids`` (``window``-token windows) for the packaged model ``ref`` is an export
    of: its GGUF against the same weights dequantized to F32, both scored by llama.cpp itself
    (models.llamacpp.delta_ppl); None with a note when there is no GGUF or llama.cpp cannot run."""
    name = peer_name(ref, peers)
    if name is None:
        return None
    from models import llamacpp
    from models.prepare import gguf_path

    try:
        g = gguf_path(name)
        if g is None:
            return None
        r = llamacpp.delta_ppl(g, ids, window=window, threads=threads, prefix=prefix)
    except Exception as e:  # a comparison row we cannot measure is a note, not fatal
        notes.append(f"llama.cpp Δppl not measured: {str(e).splitlines()[0][:200]}")
        return None
    r["note"] = (f"llama.cpp's own Δppl: its GGUF vs the same weights in F32, {r['tokens']} tokens in {window}-token "
                 "windows (prefill mode)")
    return r


def table_quality(variants: dict, ref: str, text_path: str, threads: int = 2, tokenizer: str | None = None,
                  window: int = 512, windows: int = 8, decode_score: int = 256, say=None,
                  llama_peers: str | None = None, cache_dir: str | None = None) -> dict:
    """Δppl of every model in ``variants`` ({row: path}) against ``ref`` on ``text_path``, all in one
    mode, as ``ortlean eval`` measures one model: teacher-forced ``windows`` x ``window``-token windows,
    or — when any model approximates in decode (PackedAttention with a budget) — decode-mode
    perplexity at a context where that approximation runs (4 windows of ``decode_score`` decode
    steps), with each row's one-sided 95 % upper bound from the paired per-token NLLs. Returns
    {"text", "mode", "tokens", "ppl_ref", "rows": {row: {"ppl", "delta_ppl"[, "delta_ppl_upper"]} or
    {"note"} when a row could not be scored}}. ``cache_dir``: each model's scores kept there by a stamp
    of its files, the text, the mode, the thread count and ortlean's code and library
    (:mod:`rewriter.kit.stamps`), and reused under the same stamp (the demo's warm runs)."""
    tp = Path(text_path)
    if not tp.is_file():
        raise OrtleanError(f"--quality-text {tp}: no such file")
    text = tp.read_text(encoding="utf-8", errors="replace")
    tok = _tokenizer(ref if tokenizer or (Path(ref).parent / "tokenizer.json").exists() else next(iter(variants.values())),
                     tokenizer)
    all_ids = tok.encode(text, add_special_tokens=False).ids
    pre = runtime.text_prefix(tok)      # every window starts as a prompt does (Gemma: <bos>)
    starts = [a for a in (runtime.approximate_from(v) for v in variants.values()) if a is not None]
    if starts:
        cap = min([p for p in (max_positions(str(v)) for v in [ref, *variants.values()]) if p] or [1 << 30])
        ctx_len = min(max(1024, max(starts)), cap - decode_score - 1 - pre.size)
        dm = dict(context=ctx_len, score=decode_score, windows=max(1, windows // 2))
        mode = f"decode-mode: {dm['windows']} windows of a {ctx_len}-token prefill and {decode_score} decode steps"

        def score(s, io_):
            return runtime.decode_perplexity(s, io_, all_ids, prefix=pre, **dm)
    else:
        ids = np.asarray(all_ids[: window * windows], dtype=np.int64)
        if ids.size < 2:
            raise OrtleanError(f"--quality-text {tp}: {ids.size} tokens, perplexity needs at least 2")
        mode = f"{window}-token windows"

        def score(s, io_):
            return runtime.perplexity(s, io_, ids, window=window, prefix=pre)
    if pre.size:
        mode += f", each after the tokenizer's {pre.size}-token prefix"
    from .kit import stamps

    cache = stamps.JsonCache(cache_dir) if cache_dir else None
    common = None
    if cache is not None:
        common = {"text": hashlib.sha256(text.encode()).hexdigest()[:16], "mode": mode, "threads": threads,
                  "window": window, "windows": windows, "score": decode_score, "code": stamps.code_hash(),
                  "library": stamps.library_hash()}

    def cached(parts: dict, compute, reused: str):
        if cache is None:
            return compute()
        return cache.value(parts, compute, on_hit=(lambda: say(reused)) if say else None)

    def scored(name: str, path: str) -> dict:
        def compute() -> dict:
            t0 = time.perf_counter()
            s = _session(path, threads)
            p = score(s, runtime.ModelIO.from_session(s, path))
            del s
            if say:
                say(f"quality: {name}: {time.perf_counter() - t0:.0f} s")
            return {"ppl": float(p["ppl"]), "tokens": int(p["tokens"]),
                    "token_nll": [float(x) for x in p.get("token_nll", [])]}

        return cached({**(common or {}), "model": stamps.file_stamp(path)}, compute,
                      f"quality: {name}: reused (same files, text, mode, code and library)")

    if say:
        say("quality: the reference")
    d = scored("the reference", ref)
    out = {"text": tp.name, "mode": mode, "tokens": int(d["tokens"]), "ppl_ref": float(d["ppl"]), "rows": {}}
    for name, path in variants.items():
        if name == "dense" or not path:
            continue
        if say:
            say(f"quality: {name}")
        try:
            p = scored(name, path)
        except Exception as e:  # a row whose quality cannot be measured says why; the others go on
            out["rows"][name] = {"note": f"Δppl not measured: {str(e).splitlines()[0][:160]}"}
            continue
        row = {"ppl": float(p["ppl"]), "delta_ppl": float(p["ppl"] / d["ppl"] - 1.0)}
        if d.get("token_nll") is not None and len(d["token_nll"]) and len(d["token_nll"]) == len(p["token_nll"]):
            row["delta_ppl_upper"] = runtime.paired_delta(p["token_nll"], d["token_nll"])[1]
        out["rows"][name] = row
    if llama_peers is not None:   # llama.cpp's row, measured by llama.cpp on the same text
        if say:
            say("quality: llama.cpp (its GGUF vs F32)")
        notes: list = []
        lids = all_ids[: window * windows]
        parts = {"llama.cpp": peer_name(ref, llama_peers), "ids": hashlib.sha256(np.asarray(lids, np.int64).tobytes())
                 .hexdigest()[:16], "window": window, "threads": threads, "code": (common or {}).get("code"),
                 "prefix": [int(x) for x in pre]}
        lq = cached(parts, lambda: llama_quality(ref, llama_peers, lids, window, threads, notes, prefix=pre),
                    "quality: llama.cpp: reused (same GGUF, tokens and window)")
        out["rows"]["llama.cpp"] = ({k: lq[k] for k in ("ppl", "delta_ppl", "delta_ppl_upper", "note")} if lq
                                    else {"note": notes[0] if notes else "no GGUF for this model"})
    return out


def _decode_profiles(variants: dict, threads, past: int, huge_pages: bool, say=print, trace_dir=None) -> dict:
    """ORT's per-node profile of decode steps after ``past`` tokens, dense and lean, at every thread
    count (runtime.decode_profile: the model's own cache, the shared-KV loop where the graph allows;
    4 warm-up and 16 measured steps, the past lowered to fit them in the models' positions); and, profiler
    off, both models' decode step after 1 token (runtime.bench.decode_table), the attention-free estimate's
    reference. ``trace_dir``: every row profiled (not only dense and lean), each trace kept there
    (:func:`trace_name`), their paths under the result's ``traces``."""
    from custom_ops.runtime import bench as rb

    warmup, steps = 4, 16
    rows = [k for k, v in variants.items() if v] if trace_dir else ["dense", "lean"]
    if trace_dir:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
    cap = min([m for m in (max_positions(str(variants[k])) for k in ("dense", "lean")) if m] or [1 << 30])
    past = max(1, min(int(past), cap - warmup - steps))
    say(f"ORT profile of decode steps after {past} tokens; every model's step after 1 token")
    out = {"past": past}
    traces: dict[str, dict] = {}
    for t in threads:
        row = out[f"t{t}"] = {}
        for k in rows:
            keep = None
            if trace_dir:
                keep = str(Path(trace_dir) / trace_name(k, t))
                traces.setdefault(k, {})[str(t)] = keep
            prof = runtime.decode_profile(variants[k], lambda p, so=None: _profiled_session(p, so, t), past=past,
                                          steps=steps, warmup=warmup, huge_pages=huge_pages, keep_trace=keep)
            row[k] = {"rows": list(prof), "top_nodes": prof.top_nodes, "step_ms": prof.step_ms,
                      "node_ms": prof.total_ms, "attention_ms": prof.attention_ms, "loop": prof.loop}
        # dense and lean after 1 token, profiler off: the rest of the step, attention all but free
        sess = {k: _session(variants[k], t) for k in ("dense", "lean")}
        shared = tuple(k for k in sess if _has_gqa(variants[k]))
        tab = rb.decode_table({k: (s, runtime.ModelIO.from_session(s, variants[k])) for k, s in sess.items()}, [1],
                              prefill_len=8, steps=steps, repeats=3, shared=shared, threads=t, huge_pages=huge_pages)
        row["short_step"] = {k: v["decode1"] for k, v in tab.items()}
        del sess
    if trace_dir:
        out["traces"] = traces
    return out


def _format_decode_profile(dp: dict, r: dict) -> list[str]:
    """The decode profile's lines: per thread count and model, the step and its slowest op types
    (profiler on: it adds to every node's time); then about the most any attention kernel can gain at
    each past, profiler off: the table's dense step there over the fastest step (dense or lean) after 1
    token, where attention costs next to nothing, beside the lean model's measured ratio."""
    lines = []
    past = max(r["pasts"])
    for t, row in dp.items():
        if not t.startswith("t"):
            continue
        for k in ("dense", "lean"):
            prof = row[k]
            ops = ", ".join(f"{x['op_type']} {x['total_ms']:.2f} ms ({x['pct']:.0f}%)" for x in prof["rows"][:5])
            lines.append(f"ORT profile, {k}, decode after {dp['past']} tokens, {t} ({prof['loop']} loop, profiler on): "
                         f"{prof['step_ms']:.2f} ms/step; {ops}")
        tab, short = r["table"].get(t, {}), row.get("short_step") or {}
        kd = "dense | shared KV" if "dense | shared KV" in tab and "dense | shared KV" in short else "dense"
        kl = kd.replace("dense", "lean", 1)
        x1 = min(short.values(), default=0.0)
        parts = []
        for p in r["pasts"]:
            step, lean = tab.get(kd, {}).get(f"decode{p}"), tab.get(kl, {}).get(f"decode{p}")
            if step and x1 > 0:
                parts.append(f"P{p} {step / x1:.2f}x" + (f" (measured {step / lean:.2f}x)" if lean else ""))
        if parts:
            fast = min(short, key=short.get)
            lines.append(f"attention-free estimate, {t} (profiler off): {kd}'s step over the fastest step after 1 token "
                         f"({fast}, {x1:.2f} ms), about what an attention that cost nothing would reach, and {kl}'s "
                         "measured ratio: " + ", ".join(parts))
    return lines


def _isa_line() -> str:
    import os
    import platform

    import onnxruntime as ort

    flags, cpu = set(), platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
    except OSError:
        pass
    keep = [f for f in ("avx2", "fma", "avx_vnni", "avx512f", "avx512_vnni", "amx_tile") if f in flags]
    try:
        import custom_ops

        kernels = f"ortlean kernels {custom_ops.isa_label()}, "
    except Exception as e:  # no library: the reference backend's rows say so themselves
        kernels = f"ortlean kernels: {e}, "
    return (f"CPU {cpu}, {os.cpu_count()} logical cores, ISA {' '.join(keep)}, {kernels}onnxruntime {ort.__version__}, "
            f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def format_table(r: dict) -> str:
    """The causal-LM comparison table: tokens/s per row at every past length and thread count."""
    pasts, threads, prefill = r["pasts"], r["threads"], r["prefill"]
    cols = [(f"dec P{p} t{t}", f"decode{p}", t) for p in pasts for t in threads] + \
           [(f"prefill t{t}", "prefill", t) for t in threads]
    rows = list(next(iter(r["table"].values()), {}))
    w = max([len(x) for x in rows] + [20])
    # no decode pasts (--decode-past none): the time to first token alone
    lines = [f"{'row':<{w}} {'MiB':>6} " + " ".join(f"{c:>12}" for c, _, _ in cols)] if pasts else []
    for row in rows:
        mib = r["weight_bytes"].get(row.partition(" | ")[0], 0) / 2**20
        vals = []
        for _, key, t in cols:
            ms = r["table"].get(f"t{t}", {}).get(row, {}).get(key)
            tok = None if not ms else (1e3 / ms if key != "prefill" else prefill * 1e3 / ms)
            vals.append(f"{tok:12.1f}" if tok else f"{'-':>12}")
        lines.append(f"{row:<{w}} {mib:6.1f} " + " ".join(vals))
    lc = r.get("llama_cpp")
    if lc and lc["rows"]:
        avg = "median" if any(x.get("interleaved") for x in lc["rows"]) else "mean"
        lines.append(f"llama.cpp ({lc['command']}), its own runtime, tokens/s {avg} ± sd:")
        for x in lc["rows"]:
            lines.append(f"  {x['test']:>12} t{x['threads']}: {x['tok_s']:8.1f} ± {x['tok_s_std']:.1f}")
    lines += _speed_ratios(r)
    lines += _floor_lines(r)
    if pasts:
        lines.append(f"(tokens/s; decode: single-token steps after a past of P, {r['steps']} steps × {r['repeats']} "
                     f"rounds, medians; prefill: {prefill} tokens; rows interleaved in one process. Drivers: (none) = "
                     "plain InferenceSession loop, 'shared KV' = custom_ops.runtime.shared_kv, 'og' = onnxruntime_genai)")
    lines += _ttft_lines(r)
    lines.append(r["isa"])
    for n in r["notes"]:
        lines.append(f"note: {n}")
    for k, prof in (r.get("profile") or {}).items():
        lines.append(f"ORT profile, {k}: " + ", ".join(f"{row['op_type']} {row['pct']:.0f}%" for row in prof["rows"][:6]))
    if r.get("decode_profile"):
        lines += _format_decode_profile(r["decode_profile"], r)
    return "\n".join(lines)


def ttft_medians(r: dict) -> dict[str, dict[tuple[int, int], float]]:
    """{row: {(prompt length, threads): median seconds}} of a bench result's time-to-first-token runs."""
    import statistics

    out: dict[str, dict[tuple[int, int], float]] = {}
    for t, tab in ((r.get("prompt") or {}).get("table") or {}).items():
        for row, per in tab.items():
            for n, v in per.items():
                if v:
                    out.setdefault(row, {})[(int(n), int(t[1:]))] = float(statistics.median(v))
    return out


def _ttft_lines(r: dict) -> list[str]:
    """The time-to-first-token table (row x prompt length x threads: seconds and tokens/s, medians) and each
    of our rows' ratio against llama.cpp and genai's int4 model in the same run (their seconds / ours:
    > 1, ours answers sooner)."""
    P = r.get("prompt")
    if not P:
        return []
    med = ttft_medians(r)
    cols = [(n, t) for n in P["lengths"] for t in r["threads"]]
    rows = [k for k in med] + [k for t in r["threads"] for k in (P["table"].get(f"t{t}") or {}) if k not in med]
    rows = list(dict.fromkeys(rows))
    w = max([len(x) for x in rows] + [20])
    lines = [f"time to first token after an N-token prompt (N tN: N tokens, N threads), medians of "
             f"{', '.join(f'{n}: {k}' for n, k in P['repeats'].items())} timed run(s) per length:",
             f"{'row':<{w}} " + " ".join(f"{f'{n} t{t}':>24}" for n, t in cols)]
    for row in rows:
        cells = []
        for n, t in cols:
            s = med.get(row, {}).get((n, t))
            took = f"{s:.2f} s" if s and s >= 1 else f"{s * 1e3:.1f} ms" if s else ""
            cells.append(f"{f'{took} ({n / s:.0f} tok/s)':>24}" if s else f"{'-':>24}")
        lines.append(f"{row:<{w}} " + " ".join(cells))

    def model_rows(model: str) -> list[str]:
        return [k for k in med if k == model or k.startswith(model + " | ")]

    peers = [(LLAMA_ROW, "llama.cpp")] + [(k, k) for k in model_rows("genai int4")[:1]]
    for ours in r.get("ours") or ["lean"]:
        for a in model_rows(ours):
            for b, label in peers:
                if b not in med:
                    continue
                keys = [c for c in cols if c in med[a] and c in med[b]]
                if keys:
                    lines.append(f"ttft [{a}] vs [{label}] (its seconds / ours, > 1: ours answers sooner): " + ", ".join(
                        f"{n} t{t} {med[b][(n, t)] / med[a][(n, t)]:.2f}x" for n, t in keys))
    for t, info in sorted((P.get("llama_cpp") or {}).items()):
        if info.get("failed"):
            lines.append(f"llama.cpp, {t}: stopped: {info['failed']}")
    return lines


def _speed_ratios(r: dict) -> list[str]:
    """"speed [ours] / [peer]" lines: each of our models under its fastest driver against genai's int4
    model under its fastest (its own generator when measured) and llama.cpp, per past and thread count
    (tokens/s ratios, > 1: ours is faster)."""
    T, pasts, threads = r["table"], r["pasts"], r["threads"]
    ms: dict[str, dict[str, float]] = {}  # row -> "P<p> t<t>" / "prefill t<t>" -> ms

    for t in threads:
        for row, cells in T.get(f"t{t}", {}).items():
            for p in pasts:
                if cells.get(f"decode{p}"):
                    ms.setdefault(row, {})[f"P{p} t{t}"] = cells[f"decode{p}"]
            if cells.get("prefill"):
                ms.setdefault(row, {})[f"prefill t{t}"] = cells["prefill"]
    for x in (r.get("llama_cpp") or {}).get("rows") or []:
        if x.get("tok_s"):
            key = (f"P{x.get('depth', 0)} t{x['threads']}" if x["test"].startswith("tg")
                   else f"prefill t{x['threads']}" if not x.get("depth") else None)
            if key:
                ms.setdefault("llama.cpp", {})[key] = (r["prefill"] if key.startswith("prefill") else 1) * 1e3 / x["tok_s"]

    def fastest(model: str) -> str | None:
        rows = [k for k in ms if k == model or k.startswith(model + " | ")]
        if not rows:
            return None
        common = set.intersection(*(set(ms[k]) for k in rows))
        return min(rows, key=lambda k: sum(ms[k][c] for c in common))

    out = []
    for ours in r.get("ours") or ["lean"]:
        a = fastest(ours)
        for peer in ("genai int4", "llama.cpp"):
            b = fastest(peer)
            if not a or not b:
                continue
            keys = [k for k in ms[a] if k in ms[b]]
            if keys:
                out.append(f"speed [{a}] / [{b}]: " + ", ".join(f"{k} {ms[b][k] / ms[a][k]:.2f}x" for k in keys))
    return out


def _floor_lines(r: dict) -> list[str]:
    """The weights floor (custom_ops.runtime.floor) at each thread count and past, and where our fastest
    row of the floor's model stands against it (its step time / the floor's, 1 = at the memory limit)."""
    fl = r.get("weights_floor")
    if not fl:
        return []
    T = r["table"]
    out = [f"weights floor of [{fl['model']}]: its {fl['nodes']} weight nodes' {fl['bytes'] / 2**20:.1f} MiB read once "
           "a step, nothing computed (custom_ops.runtime.floor; one pass / a barrier after each node, as a "
           "runtime running a node at a time), tok/s:"]
    rows = [k for k in T.get(f"t{r['threads'][0]}", {}) if k == fl["model"] or k.startswith(fl["model"] + " | ")]
    for t in r["threads"]:
        cells = fl["table"].get(f"t{t}", {})
        for p in r["pasts"]:
            key = f"decode{p}"
            one, bar = (cells.get(row, {}).get(key) for row in FLOOR_ROWS)
            if not (one and bar):
                continue
            ours = {row: T[f"t{t}"][row][key] for row in rows if T.get(f"t{t}", {}).get(row, {}).get(key)}
            best = min(ours, key=ours.get) if ours else None
            line = f"  P{p} t{t}: one pass {1e3 / one:.0f}, a barrier per node {1e3 / bar:.0f}"
            if best:
                line += f"; [{best}] {1e3 / ours[best]:.0f} = {bar / ours[best]:.2f}x the barrier floor"
            out.append(line)
    return out


def _profiled_session(path: str, so, threads: int):
    import custom_ops

    return custom_ops.session(path, threads=threads, so=so)


def format_bench(r: dict) -> str:
    if "table" in r:
        return format_table(r)
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
