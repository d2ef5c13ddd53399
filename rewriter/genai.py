"""onnxruntime-genai's ``genai_config.json`` beside a rewritten causal LM, so the output directory runs
in genai's generator (``og.Model(dir)``, ``og.Generator``) with ortlean's library registered.

What genai 0.15 can drive (its ``DecoderOnly`` model, ``src/models/kv_cache.cpp``): inputs
``input_ids``, ``attention_mask``, ``position_ids`` and a KV cache named by the templates
``past_key_values.%d.key`` / ``.value`` → ``present.%d.key`` / ``.value``, both allocated by genai
with ONE shape per layer, ``[batch, num_key_value_heads, length, head_size]`` of the key input's
float type (``length`` = ``max_length`` when ``search.past_present_share_buffer``, the
GroupQueryAttention form, else the total so far, fed back from the presents). It cannot drive:

* PackedAttention's cache state (``--attn-exact`` on a fused graph, ``--state-pack``):
  ``past_key_values.N.key_bits`` and ``.kv`` are int32 rows of different widths, where genai gives
  key and value one shape (it fails with "Got invalid dimensions for input
  past_key_values.0.kv ... index 3 Got 4 Expected 32" on the tiny llama);
* EventGatedMatMul's event state ``past_event.*`` (``--event-driven``, ``--kwta-duty`` > 1) and any
  other input genai does not know (it feeds nothing there: onnxruntime fails on a missing input).

For those the rewrite writes no config and the report says why and which flags keep the form genai
runs (``--attn-exact off`` and no ``--state-pack`` keep GroupQueryAttention; stateless gating).
``docs/genai.md`` is the user's page.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import onnx

__all__ = ["GENAI_LLM_TYPES", "genai_problem", "write_config"]

# genai 0.15.2 src/models/model_type.h ModelType::IsLLM: the decoder-only types its DecoderOnly model
# takes ("decoder" is the generic one)
GENAI_LLM_TYPES = ("chatglm", "decoder", "ernie4_5", "gemma", "gemma2", "gemma3_text", "gemma4_text", "gpt2",
                   "gptoss", "granite", "hunyuandensev1", "internlm2", "lfm2", "llama", "mistral", "nemotron", "olmo",
                   "phi", "phimoe", "phi3", "phi3small", "qwen2", "qwen3", "qwen3_5_moe_text", "qwen3_5_text",
                   "smollm3")
GENAI_INPUTS = ("input_ids", "attention_mask", "position_ids")
# inputs genai's DecoderOnly state claims when present (extra_inputs.cpp: PresetExtraInputs)
GENAI_PRESET_INPUTS = ("num_logits_to_keep",)
_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_FLOAT = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
CONFIG = "genai_config.json"


def _dims(v) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in v.type.tensor_type.shape.dim]


def _why_input(name: str, problems: dict) -> None:
    if name.endswith(".key_bits") or name.endswith(".kv"):
        problems.setdefault("packed", []).append(name)
    elif name.startswith("past_event"):
        problems.setdefault("event", []).append(name)
    else:
        problems.setdefault("other", []).append(name)


def genai_problem(proto: onnx.ModelProto) -> str | None:
    """Why onnxruntime-genai's decoder cannot drive this graph (one paragraph naming the inputs and
    the flags that avoid them), or None when it can."""
    g = proto.graph
    init = {i.name for i in g.initializer}
    ins = [v for v in g.input if v.name not in init]
    outs = {o.name for o in g.output}
    names = [v.name for v in ins]
    if "input_ids" not in names:
        return "no input_ids input (genai feeds token ids)"
    if "logits" not in outs:
        return "no logits output"
    problems: dict[str, list[str]] = {}
    kv: dict[int, dict[str, onnx.ValueInfoProto]] = {}
    for v in ins:
        m = _PAST.match(v.name)
        if m:
            kv.setdefault(int(m.group(1)), {})[m.group(2)] = v
        elif v.name not in GENAI_INPUTS and v.name not in GENAI_PRESET_INPUTS:
            _why_input(v.name, problems)
    parts = []
    if problems.get("packed"):
        p = problems["packed"]
        width = {v.name: _dims(v)[-1] for v in ins}
        rows = next((n for n in p if n.endswith(".kv")), None)
        bits = next((n for n in p if n.endswith(".key_bits")), None)
        if rows:
            what = (f"PackedAttention's cache state replaces the K/V cache ({bits} rows of {width.get(bits)} int32 words, "
                    f"{rows} rows of {width.get(rows)}; {len(p)} inputs): genai allocates every layer's key and value "
                    "caches with one shape [batch, kv_heads, length, head_size] of a float type, so it cannot hold "
                    "two int32 row formats of different widths")
        else:
            what = (f"PackedAttention's packed-key state beside the K/V cache ({bits}, ...; {len(p)} inputs): genai "
                    "feeds no state but the K/V cache")
        parts.append(what + " — rewrite with --attn-exact off and without --state-pack to keep GroupQueryAttention "
                     "(or the unfused attention), which genai runs")
    if problems.get("event"):
        p = problems["event"]
        parts.append(f"EventGatedMatMul's event state ({len(p)} inputs: {', '.join(p[:2])}, ...): genai feeds only "
                     "input_ids, attention_mask, position_ids and the KV cache — rewrite without --event-driven and "
                     "with --kwta-duty 1 for stateless gating")
    if problems.get("other"):
        p = problems["other"]
        parts.append(f"inputs genai does not feed: {', '.join(p[:4])}{' ...' if len(p) > 4 else ''}")
    for layer, kvs in sorted(kv.items()):
        if set(kvs) != {"key", "value"}:
            parts.append(f"layer {layer} has only past_key_values.{layer}.{next(iter(kvs))}")
            break
        k, v = kvs["key"], kvs["value"]
        for x in (k, v):
            nm = x.name.replace("past_key_values", "present")
            if nm not in outs:
                parts.append(f"{x.name} has no {nm} output")
                break
            if x.type.tensor_type.elem_type not in _FLOAT or len(_dims(x)) != 4:
                parts.append(f"{x.name} is not a float [batch, kv_heads, length, head_size] cache")
                break
        dk, dv = _dims(k), _dims(v)
        if any(isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(dk[1::2], dv[1::2])):
            parts.append(f"layer {layer}: key {dk} and value {dv} caches differ in shape (genai gives both one shape)")
        if parts:
            break
    return "; ".join(parts) if parts else None


def _json(path: Path) -> dict:
    try:
        v = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return v if isinstance(v, dict) else {}


def _ids(v) -> list[int]:
    if isinstance(v, bool) or v is None:
        return []
    if isinstance(v, int):
        return [v]
    if isinstance(v, list):
        return [int(x) for x in v if isinstance(x, int) and not isinstance(x, bool)]
    return []


def _rotary_rows(proto: onnx.ModelProto) -> int | None:
    """Rows of the GroupQueryAttention / PackedAttention cos cache (the positions the graph can take)."""
    shapes = {}
    for t in proto.graph.initializer:
        shapes[t.name] = list(t.dims)
    for n in proto.graph.node:
        if n.op_type in ("GroupQueryAttention", "PackedAttention") and len(n.input) > 7 and n.input[7] in shapes:
            return int(shapes[n.input[7]][0])
    return None


def _shares_buffer(proto: onnx.ModelProto) -> bool:
    """Every past key/value feeds a GroupQueryAttention node as its past (inputs 3, 4): genai can bind
    past and present to one max_length buffer (its past_present_share_buffer), as the builder's graphs."""
    past = {v.name for v in proto.graph.input if _PAST.match(v.name)}
    fed = set()
    for n in proto.graph.node:
        if n.op_type == "GroupQueryAttention":
            fed.update(x for x in n.input[3:5] if x)
    return bool(past) and past <= fed


def _library() -> str:
    import custom_ops

    return str(Path(custom_ops.library_path()).resolve())


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=4) + "\n")
    os.replace(tmp, path)


def build_config(proto: onnx.ModelProto, out: Path, src_dir: Path) -> tuple[dict | None, str]:
    """(genai_config dict for the model file ``out``, "") or (None, why not). Values come from the
    graph (KV shapes, layers, vocab, rotary rows, share-buffer form, ai.ortlean nodes) and from the
    source's ``genai_config.json`` (a genai builder model: kept as the base), ``config.json`` and
    ``generation_config.json`` (the HF files beside an optimum export)."""
    from custom_ops.schema import DOMAIN

    base = _json(src_dir / CONFIG)
    hf = _json(src_dir / "config.json")
    gen = _json(src_dir / "generation_config.json")
    bmodel = base.get("model", {}) if isinstance(base.get("model"), dict) else {}
    bdec = bmodel.get("decoder", {}) if isinstance(bmodel.get("decoder"), dict) else {}

    g = proto.graph
    kv_shape = None
    layers = set()
    for v in g.input:
        m = _PAST.match(v.name)
        if m:
            layers.add(int(m.group(1)))
            kv_shape = kv_shape or _dims(v)
    if not layers:
        return None, "the graph has no past_key_values.N.key / .value cache"
    logits = next((_dims(o) for o in g.output if o.name == "logits"), [])

    def first(*vals):
        return next((int(x) for x in vals if isinstance(x, int) and not isinstance(x, bool) and x > 0), None)

    kv_heads = first(kv_shape[1] if kv_shape else None, bdec.get("num_key_value_heads"), hf.get("num_key_value_heads"))
    heads = first(bdec.get("num_attention_heads"), hf.get("num_attention_heads"),
                  *[a.i for n in g.node if n.op_type == "GroupQueryAttention" for a in n.attribute if a.name == "num_heads"])
    hidden = first(bdec.get("hidden_size"), hf.get("hidden_size"))
    head_size = first(kv_shape[3] if kv_shape else None, bdec.get("head_size"), hf.get("head_dim"),
                      hidden // heads if hidden and heads else None)
    vocab = first(logits[-1] if logits else None, bmodel.get("vocab_size"), hf.get("vocab_size"))
    rows = _rotary_rows(proto)
    ctx_cands = [x for x in (first(bmodel.get("context_length")), first(hf.get("max_position_embeddings")), rows) if x]
    context = min(ctx_cands) if ctx_cands else None
    missing = [n for n, x in (("num_key_value_heads", kv_heads), ("head_size", head_size), ("context_length", context))
               if not x]
    if missing:
        return None, (f"{', '.join(missing)} unknown: neither the graph's KV cache shapes nor a config.json / "
                      f"genai_config.json beside the source model ({src_dir}) give them")

    mtype = bmodel.get("type") if isinstance(bmodel.get("type"), str) else None
    if not mtype:
        mt = hf.get("model_type")
        mtype = mt if mt in GENAI_LLM_TYPES else "decoder"
    eos = _ids(bmodel.get("eos_token_id")) or _ids(gen.get("eos_token_id")) or _ids(hf.get("eos_token_id"))
    bos = first(bmodel.get("bos_token_id"), gen.get("bos_token_id"), hf.get("bos_token_id"))
    pad = next((x for x in (bmodel.get("pad_token_id"), gen.get("pad_token_id"), hf.get("pad_token_id"))
                if isinstance(x, int) and not isinstance(x, bool)), eos[0] if eos else None)

    names = {v.name for v in g.input}
    inputs = {n: n for n in GENAI_INPUTS if n in names}
    inputs.update(past_key_names="past_key_values.%d.key", past_value_names="past_key_values.%d.value")
    outputs = {"logits": "logits", "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"}
    so = dict(bdec.get("session_options", {})) if isinstance(bdec.get("session_options"), dict) else {}
    so.setdefault("log_id", "onnxruntime-genai")
    so.setdefault("provider_options", [])
    so.pop("custom_ops_library", None)
    if any(n.domain == DOMAIN for n in g.node):
        import custom_ops

        try:
            so["custom_ops_library"] = _library()
        except custom_ops.LibraryNotFoundError as e:
            return None, f"the graph has ai.ortlean ops and ortlean's library is not found for custom_ops_library ({e})"
    decoder = {**bdec, "session_options": so, "filename": out.name, "head_size": head_size,
               "num_hidden_layers": len(layers), "num_key_value_heads": kv_heads, "inputs": inputs, "outputs": outputs}
    for k, v in (("num_attention_heads", heads), ("hidden_size", hidden)):
        if v:
            decoder[k] = v
    model = {**bmodel, "type": mtype, "context_length": context, "decoder": decoder}
    for k, v in (("bos_token_id", bos), ("pad_token_id", pad), ("vocab_size", vocab)):
        if v is not None:
            model[k] = v
    if eos:
        model["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    search = dict(base.get("search", {})) if isinstance(base.get("search"), dict) else {}
    defaults = {"diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
                "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1, "num_return_sequences": 1,
                "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0}
    for k, v in defaults.items():  # generation_config.json's values where it has them (as the builder does)
        gv = gen.get(k)
        ok = isinstance(gv, (int, float)) and isinstance(gv, bool) == isinstance(v, bool)
        search.setdefault(k, gv if ok else v)
    search["max_length"] = context if not first(search.get("max_length")) else min(int(search["max_length"]), context)
    search["past_present_share_buffer"] = _shares_buffer(proto)
    return {"model": model, "search": search}, ""


def _tokenizer_for_genai(path: Path) -> str | None:
    """onnxruntime-genai's tokenizer (onnxruntime-extensions) reads a byte-level BPE tokenizer.json whose
    model says ``byte_fallback`` and whose decoder has sentencepiece steps (ByteFallback, Fuse, a "▁"
    Replace) as a sentencepiece one and maps its words to id -1 — the tokenizer.json transformers writes
    for a GGUF "gpt2" tokenizer (SmolLM2's) has both. When those steps are no-ops for this vocabulary
    (no "<0xNN>" byte tokens: byte fallback then ends in the unknown token as without it; no "▁" in any
    token; Fuse before ByteLevel joins what ByteLevel joins anyway) they are dropped, and the file is
    rewritten only if ``tokenizers`` then decodes every token id exactly as before. Returns what was
    done, or None."""
    from tokenizers import Tokenizer

    try:
        raw = path.read_text(encoding="utf-8")
        t = json.loads(raw)
    except (OSError, ValueError):
        return None
    m, dec, pre = t.get("model") or {}, t.get("decoder") or {}, t.get("pre_tokenizer") or {}
    steps = dec.get("decoders") if dec.get("type") == "Sequence" else None
    if m.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not isinstance(steps, list):
        return None
    level = [s for s in steps if s.get("type") == "ByteLevel"]
    spm = [s for s in steps if s.get("type") != "ByteLevel"]
    if len(level) != 1 or steps[-1] is not level[0] or not spm:
        return None
    if any(s.get("type") not in ("ByteFallback", "Fuse", "Replace") for s in spm):
        return None
    if any(s.get("type") == "Replace" and (s.get("pattern") or {}).get("String") != "\u2581" for s in spm):
        return None
    tokens = list(m.get("vocab") or {}) + [a.get("content", "") for a in t.get("added_tokens") or []]
    if any("\u2581" in x or re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", x) for x in tokens):
        return None
    t["decoder"] = level[0]
    m["byte_fallback"] = False
    new = json.dumps(t, ensure_ascii=False)
    try:
        before, after = Tokenizer.from_str(raw), Tokenizer.from_str(new)
    except Exception:
        return None
    ids = [[i] for i in range(before.get_vocab_size(with_added_tokens=True))]
    if before.decode_batch(ids, skip_special_tokens=False) != after.decode_batch(ids, skip_special_tokens=False):
        return None
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(new, encoding="utf-8")
    os.replace(tmp, path)
    return ("tokenizer.json: decoder reduced to its ByteLevel step and byte_fallback off (no-ops for this byte-level "
            "vocabulary; onnxruntime-genai's tokenizer took them for sentencepiece)")


def write_config(out: Path, inp: Path, copied: list[Path] | None = None) -> dict:
    """genai_config.json beside the saved model ``out`` (the rewrite of ``inp``) when the graph is one
    genai drives. Returns {"written": [paths], "note": ...} or {"skipped": why}. Never writes into the
    input model's directory (it may hold the source's own genai_config.json, and a genai model
    directory holds one model: rewrite with -o DIR/model.onnx). When genai cannot drive the graph, a
    genai_config.json that names ``out`` (copied from a genai builder source, or an earlier rewrite)
    is removed unless the runtime needs it for symbolic KV dimensions. ``copied``: the sidecars this
    rewrite copied (a tokenizer.json among them may be adjusted for genai's tokenizer)."""
    out, inp = Path(out), Path(inp)
    if out.resolve().parent == inp.resolve().parent:
        return {"skipped": f"not written: the output shares the source model's directory ({out.parent}), and a genai "
                           "model directory holds one model — rewrite with -o DIR/model.onnx for a genai directory"}
    proto = onnx.load(str(out), load_external_data=False)
    cfg_path = out.parent / CONFIG
    why = genai_problem(proto)
    if why:
        note = f"no {CONFIG} (genai cannot run this graph): {why}"
        dec = (_json(cfg_path).get("model") or {})
        dec = dec.get("decoder") if isinstance(dec, dict) else None
        named = dec.get("filename") if isinstance(dec, dict) else None
        if named == out.name:
            from custom_ops.runtime import ModelIO

            io = ModelIO.from_model(proto)
            symbolic = any(not isinstance(d, int) for n, s in io.state_shapes.items() if _PAST.match(n)
                           for i, d in enumerate(s) if i in (1, 3))
            if symbolic:
                note += f"; {cfg_path.name} (the source's) kept: it gives ortlean's runtime the KV head count and size"
            else:
                cfg_path.unlink()
                note += f"; removed {cfg_path.name}, which named {out.name} (written for the source's graph)"
        return {"skipped": note}
    cfg, why = build_config(proto, out, inp.parent)
    if cfg is None:
        return {"skipped": f"no {CONFIG}: {why}"}
    _write_json_atomic(cfg_path, cfg)
    written, notes = [cfg_path], []
    lib = cfg["model"]["decoder"]["session_options"].get("custom_ops_library")
    notes.append(f"{cfg_path.name} for {out.name}"
                 + (f" with custom_ops_library {lib}" if lib else " (no ai.ortlean ops: plain onnxruntime)")
                 + f", past_present_share_buffer {str(cfg['search']['past_present_share_buffer']).lower()}")
    tok = out.parent / "tokenizer.json"
    if copied and any(Path(c).resolve() == tok.resolve() for c in copied):
        fix = _tokenizer_for_genai(tok)
        if fix:
            notes.append(fix)
    return {"written": [str(p) for p in written], "note": "; ".join(notes)}
