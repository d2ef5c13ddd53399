"""The tokenizer and the Hugging Face-style files beside an imported model, from the GGUF's own metadata:
``tokenizer.json`` (a ``tokenizers`` model splitting text as llama.cpp does), ``tokenizer_config.json``,
``special_tokens_map.json``, ``chat_template.jinja`` (``tokenizer.chat_template``), ``config.json`` and
``generation_config.json`` — what ``ortlean generate / eval / bench`` read beside a model.

Vocabularies:

* ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE: SmolLM2, Qwen2, Llama 3): a BPE over
  ``tokenizer.ggml.tokens`` and ``tokenizer.ggml.merges``, byte-level, pre-split by the regex of the GGUF's
  ``tokenizer.ggml.pre`` as llama.cpp splits (``smollm``: single digits, then GPT-2's; ``qwen2`` (NFC first,
  as Qwen2's own tokenizer); ``llama-bpe`` / ``llama3``; anything else: GPT-2's, with a note);
* ``"llama"`` (SentencePiece: Gemma, Llama 2, Mistral): :func:`models.gguf_tokenizer.spm_from_vocab`, the BPE
  llama.cpp's SPM tokenizer is.

Control tokens (``token_type`` 3) are special, user-defined ones (4) are added tokens; a beginning / end of
sequence token is added to every encoding only where ``tokenizer.ggml.add_bos_token`` /
``add_eos_token`` say so (llama.cpp's rule)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from models.gguf_tokenizer import template_processor

from .reader import GGUFFile, GGUFImportError, HParams

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre values read as GPT-2's split
GPT2_PRES = ("gpt-2", "gpt2", "default")


def vocab_dict(gf: GGUFFile) -> dict:
    """The vocabulary in the form of :func:`models.gguf_tokenizer.gguf_vocab` (tokens, scores, types,
    bos/eos/unk/pad ids, add_bos/add_eos/add_space_prefix)."""
    toks = gf.vocab.get("tokenizer.ggml.tokens")
    if not toks:
        raise GGUFImportError(f"{gf.path}: no tokenizer.ggml.tokens (a GGUF without its vocabulary)")
    scores = gf.vocab.get("tokenizer.ggml.scores")
    types = gf.vocab.get("tokenizer.ggml.token_type")
    if (scores is not None and len(scores) != len(toks)) or (types is not None and len(types) != len(toks)):
        raise GGUFImportError(f"{gf.path}: tokenizer.ggml.scores / token_type do not have one value per token "
                              f"({len(toks)} tokens)")

    def tid(key):
        v = gf.meta.get(key)
        return int(v) if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < len(toks) else None

    return {
        "model": gf.meta.get("tokenizer.ggml.model"), "pre": gf.meta.get("tokenizer.ggml.pre"),
        "tokens": toks, "scores": [float(s) for s in scores] if scores is not None else [0.0] * len(toks),
        "types": [int(t) for t in types] if types is not None else [NORMAL] * len(toks),
        "bos": tid("tokenizer.ggml.bos_token_id"), "eos": tid("tokenizer.ggml.eos_token_id"),
        "unk": tid("tokenizer.ggml.unknown_token_id"), "pad": tid("tokenizer.ggml.padding_token_id"),
        "eot": tid("tokenizer.ggml.eot_token_id"), "eom": tid("tokenizer.ggml.eom_token_id"),
        "add_bos": bool(gf.meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos": bool(gf.meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_space_prefix": bool(gf.meta.get("tokenizer.ggml.add_space_prefix", True)),
    }


def bpe_tokenizer(gf: GGUFFile, v: dict):
    """(``tokenizers.Tokenizer``, note) of a byte-level BPE vocabulary (``tokenizer.ggml.model`` gpt2)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    merges_raw = gf.vocab.get("tokenizer.ggml.merges")
    if not merges_raw:
        raise GGUFImportError(f"{gf.path}: a BPE vocabulary (tokenizer.ggml.model gpt2) without tokenizer.ggml.merges")
    tokens, types = v["tokens"], v["types"]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = []
    for m in merges_raw:
        a, sep, b = m.partition(" ")
        if not sep or a not in vocab or b not in vocab:
            raise GGUFImportError(f"{gf.path}: merge {m!r} of tokenizer.ggml.merges is not two tokens of the vocabulary")
        merges.append((a, b))
    pre = v["pre"] or "default"
    note = ""
    ignore_merges = pre in ("llama-bpe", "llama3")
    try:
        tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False,
                            ignore_merges=ignore_merges))
    except Exception as e:
        raise GGUFImportError(f"{gf.path}: its BPE vocabulary does not build ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]})") from None
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False), byte_level])
    elif pre in ("llama-bpe", "llama3"):
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False), byte_level])
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    else:
        if pre not in GPT2_PRES:
            note = f"tokenizer.ggml.pre {pre!r} unknown to ortlean import: text is pre-split with GPT-2's regex"
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    _add_vocab_tokens(tok, tokens, types, vocab, AddedToken)
    post = template_processor(v, tokens)
    tok.post_processor = post if post is not None else processors.ByteLevel(trim_offsets=False)
    return tok, note


def _add_vocab_tokens(tok, tokens, types, vocab, AddedToken) -> None:
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
                    if ty == USER_DEFINED and t in vocab])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
                            if ty == CONTROL and t in vocab])


def build_tokenizer(gf: GGUFFile):
    """(``tokenizers.Tokenizer``, vocabulary dict, note) of the GGUF's vocabulary."""
    from models.gguf_tokenizer import spm_from_vocab

    v = vocab_dict(gf)
    model = v["model"]
    if model == "gpt2":
        tok, note = bpe_tokenizer(gf, v)
    elif model == "llama":
        try:
            tok, note = spm_from_vocab(v), ""
        except Exception as e:
            raise GGUFImportError(f"{gf.path}: its SentencePiece vocabulary does not build ({type(e).__name__}: "
                                  f"{' '.join(str(e).split())[:200]})") from None
    else:
        raise GGUFImportError(f"{gf.path}: tokenizer.ggml.model {model!r} is not supported by ortlean import "
                              "(gpt2: byte-level BPE, llama: SentencePiece)")
    return tok, v, note


# --------------------------------------------------------------------------- the files beside the model
HF_TYPES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
            "gemma3": ("gemma3_text", "Gemma3ForCausalLM")}


def _tok(v: dict, key: str) -> str | None:
    i = v.get(key)
    return v["tokens"][i] if i is not None else None


def eos_ids(v: dict) -> list[int]:
    """The ids generation stops at: the GGUF's eos, then its end-of-turn / end-of-message tokens."""
    return list(dict.fromkeys(i for i in (v["eos"], v["eot"], v["eom"]) if i is not None))


def sidecars(gf: GGUFFile, hp: HParams, v: dict, tied: bool) -> dict[str, str]:
    """{file name: text} of the JSON / template files beside the model."""
    model_type, cls = HF_TYPES[hp.arch]
    eos = eos_ids(v)
    cfg = {
        "architectures": [cls], "model_type": model_type, "_name_or_path": hp.name,
        "hidden_size": hp.hidden, "intermediate_size": hp.ffn, "num_hidden_layers": hp.n_layers,
        "num_attention_heads": hp.n_head, "num_key_value_heads": hp.n_kv, "head_dim": hp.head_dim,
        "rms_norm_eps": hp.eps, "rope_theta": hp.rope_base, "max_position_embeddings": hp.context,
        "vocab_size": hp.vocab, "tie_word_embeddings": tied,
        "rope_scaling": {"rope_type": "linear", "factor": hp.rope_linear} if hp.rope_linear != 1.0 else None,
        "bos_token_id": v["bos"], "eos_token_id": eos[0] if len(eos) == 1 else (eos or None), "pad_token_id": v["pad"],
        "torch_dtype": "float32",
    }
    if hp.arch == "llama":
        cfg["hidden_act"] = "silu"
    elif hp.arch == "qwen2":
        cfg.update(hidden_act="silu", use_sliding_window=False, sliding_window=None)
    else:
        cfg.update(hidden_activation="gelu_pytorch_tanh", rope_local_base_freq=hp.rope_base_local,
                   sliding_window=hp.sliding_window or None,
                   query_pre_attn_scalar=(1.0 / hp.attn_scale ** 2) if hp.attn_scale else hp.head_dim,
                   layer_types=["full_attention" if i in hp.global_layers else "sliding_attention"
                                for i in range(hp.n_layers)])
    gen = {"bos_token_id": v["bos"], "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
           "pad_token_id": v["pad"]}
    special = {k: _tok(v, i) for k, i in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unk"),
                                          ("pad_token", "pad"))}
    special = {k: s for k, s in special.items() if s is not None}
    tcfg = {"add_bos_token": v["add_bos"], "add_eos_token": v["add_eos"], "clean_up_tokenization_spaces": False,
            "model_max_length": hp.context, "tokenizer_class": "PreTrainedTokenizerFast", **special}
    out = {"config.json": _dump(cfg), "generation_config.json": _dump(gen), "tokenizer_config.json": _dump(tcfg),
           "special_tokens_map.json": _dump(special)}
    tmpl = gf.meta.get("tokenizer.chat_template")
    if isinstance(tmpl, str) and tmpl.strip():
        out["chat_template.jinja"] = tmpl
    return out


def _dump(obj) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def write_files(out_dir: Path, files: dict[str, str], tokenizer) -> list[Path]:
    """Write the sidecars (each to a temporary name, then renamed) and tokenizer.json; returns the paths."""
    written = []
    tmp = out_dir / f".tokenizer.json.tmp{os.getpid()}"
    tokenizer.save(str(tmp))
    os.replace(tmp, out_dir / "tokenizer.json")
    written.append(out_dir / "tokenizer.json")
    for name, text in files.items():
        p = out_dir / name
        t = out_dir / f".{name}.tmp{os.getpid()}"
        t.write_text(text, encoding="utf-8")
        os.replace(t, p)
        written.append(p)
    return written
