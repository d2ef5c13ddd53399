"""A GGUF's SentencePiece vocabulary (``tokenizer.ggml.model == "llama"``: Gemma, Llama 2, Mistral …) as
a Hugging Face ``tokenizers`` BPE that splits text the way llama.cpp does.

transformers' GGUF conversion turns such a vocabulary into a Unigram model over the stored scores.
Those scores are SentencePiece-BPE merge ranks (Gemma 3: −rank, every control token −1000), not log
probabilities: a Unigram search over them prefers many short pieces to one rare long one, so Gemma 3
270M read "capital" as "▁c ap it al" and scored a perplexity of ~600 on Austen. llama.cpp's
tokenizer (``llm_tokenizer_spm``) instead starts from characters and repeatedly merges the adjacent pair
whose concatenation is a vocabulary entry of the highest score (the leftmost on ties), falling back
to the ``<0xNN>`` byte tokens for what is left unknown. A BPE whose merge list holds every split (a, b)
of every entry t with a and b in the vocabulary, ranked by t's score, makes the same choices; the
control and user-defined tokens are matched whole first, as llama.cpp partitions the text on them.
(Two entries of the same score are ordered by id here and by position in llama.cpp; SentencePiece's
scores are distinct merge ranks, and on Gemma 3 270M's GGUF this equals llama.cpp's tokenizer on
Austen, `tests/test_gguf_tokenizer.py`'s heavy test.)

    tok = spm_tokenizer("model.gguf")     # a tokenizers.Tokenizer, or None for a BPE (gpt2) vocabulary
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["spm_tokenizer", "spm_from_vocab", "gguf_vocab"]

# llama.cpp's token types (gguf TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def gguf_vocab(path) -> dict:
    """{model, tokens, scores, types, bos, eos, unk, pad, add_bos, add_eos, add_space_prefix} of a GGUF's
    tokenizer metadata (``gguf.GGUFReader``, the file memory-mapped)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    f = r.fields

    def scalar(key, default=None):
        x = f.get(key)
        if x is None or not x.data:
            return default
        v = x.parts[x.data[0]]
        return v.tobytes().decode() if x.types and x.types[0].name == "STRING" else v[0].item()

    def array(key):
        x = f.get(key)
        return None if x is None else [x.parts[i] for i in x.data]

    toks = array("tokenizer.ggml.tokens")
    if toks is None:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens")
    scores = array("tokenizer.ggml.scores")
    types = array("tokenizer.ggml.token_type")
    return {
        "model": scalar("tokenizer.ggml.model"),
        "tokens": [bytes(t).decode("utf-8", "replace") for t in toks],
        "scores": [float(s[0]) for s in scores] if scores is not None else [0.0] * len(toks),
        "types": [int(t[0]) for t in types] if types is not None else [NORMAL] * len(toks),
        "bos": scalar("tokenizer.ggml.bos_token_id"), "eos": scalar("tokenizer.ggml.eos_token_id"),
        "unk": scalar("tokenizer.ggml.unknown_token_id"), "pad": scalar("tokenizer.ggml.padding_token_id"),
        "add_bos": bool(scalar("tokenizer.ggml.add_bos_token", True)),
        "add_eos": bool(scalar("tokenizer.ggml.add_eos_token", False)),
        "add_space_prefix": bool(scalar("tokenizer.ggml.add_space_prefix", True)),
    }


def _merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split (a, b) of every entry with both halves in the vocabulary, best score of the
    merged entry first (then its id, then the split point: a deterministic order)."""
    ranked = []
    for i, t in enumerate(tokens):
        if len(t) < 2 or vocab.get(t) != i:
            continue
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in vocab and b in vocab:
                ranked.append((-scores[i], i, k, a, b))
    ranked.sort()
    return [(a, b) for _, _, _, a, b in ranked]


def spm_tokenizer(path):
    """The llama.cpp-equivalent ``tokenizers.Tokenizer`` of the GGUF at ``path`` when its vocabulary is
    SentencePiece (``tokenizer.ggml.model == "llama"``), else None."""
    v = gguf_vocab(Path(path))
    if v["model"] != "llama":
        return None
    return spm_from_vocab(v)


def spm_from_vocab(v: dict):
    """:func:`spm_tokenizer` of a vocabulary already read (``gguf_vocab``'s dict: tokens, scores, types,
    bos, eos, unk, add_bos, add_eos, add_space_prefix), e.g. by ``ortlean import``'s reader."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    tokens, types = v["tokens"], v["types"]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    unk = tokens[v["unk"]] if v["unk"] is not None and 0 <= v["unk"] < len(tokens) else None
    tok = Tokenizer(BPE(vocab=vocab, merges=_merges(tokens, v["scores"], vocab), unk_token=unk,
                        fuse_unk=True, byte_fallback=any(t == BYTE for t in types), ignore_merges=False))
    norm = [normalizers.Replace(" ", "▁")]
    if v["add_space_prefix"]:
        norm.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if v["add_space_prefix"]:
        dec.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(dec)
    # llama.cpp splits the text on these first (longest first): user-defined tokens always, control
    # tokens as special tokens
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
                    if ty == USER_DEFINED and vocab.get(t) is not None])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
                            if ty in (CONTROL, UNKNOWN)])
    post = template_processor(v, tokens)
    if post is not None:
        tok.post_processor = post
    return tok


def template_processor(v: dict, tokens: list[str]):
    """The post-processor adding the GGUF's BOS / EOS as its ``tokenizer.ggml.add_bos_token`` /
    ``add_eos_token`` say (``v``: add_bos, bos, add_eos, eos), or None when it adds neither."""
    from tokenizers import processors

    single, special = "$A", []
    if v["add_bos"] and v["bos"] is not None:
        single = f"{tokens[v['bos']]} $A"
        special.append((tokens[v["bos"]], v["bos"]))
    if v["add_eos"] and v["eos"] is not None:
        single += f" {tokens[v['eos']]}"
        special.append((tokens[v["eos"]], v["eos"]))
    if not special:
        return None
    return processors.TemplateProcessing(single=single, pair=single + " " + single.replace("$A", "$B"),
                                         special_tokens=list(dict.fromkeys(special)))
