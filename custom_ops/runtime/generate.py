"""Greedy generation with the KV cache (every past* state fed back from its present* output)."""
from __future__ import annotations

import numpy as np

from .io import ModelIO, feeds, run

# generation
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>", "<|end_of_text|>", "<eos>")


def _eos_ids(tokenizer, eos) -> set[int]:
    if eos is None:
        return set()
    if isinstance(eos, (int, np.integer)):
        return {int(eos)}
    if isinstance(eos, str) and eos != "auto":
        i = tokenizer.token_to_id(eos)
        return {i} if i is not None else set()
    if eos == "auto":
        return {i for t in EOS_TOKENS if (i := tokenizer.token_to_id(t)) is not None}
    return {int(x) for x in eos}


def generate(sess, io: ModelIO, tokenizer, prompt, max_new_tokens: int = 32, eos="auto",
             add_special_tokens: bool = True) -> tuple[str, list[int]]:
    """Greedy decoding with the KV cache: one prefill over the prompt, then one token per run,
    feeding each run's present.* back as past.*. ``prompt`` is text or a list of ids; ``eos``
    is "auto" (the usual end tokens the tokenizer knows), an id, a token string, a list of ids,
    or None. Returns (decoded new text, new ids); generation stops after an eos token (which
    is included in the ids but not in the text)."""
    if io.kind != "causal-lm":
        raise ValueError("generate needs a causal LM")
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids
    else:
        ids = [int(x) for x in prompt]
    if not ids:
        raise ValueError("empty prompt")
    stop = _eos_ids(tokenizer, eos)
    new: list[int] = []
    out = run(sess, io, feeds(io, np.array([ids], dtype=np.int64)))
    past_len = len(ids)
    for step in range(max_new_tokens):
        nxt = int(np.argmax(out[io.logits_name][0, -1]))
        new.append(nxt)
        if nxt in stop or step == max_new_tokens - 1:
            break
        if io.has_past:
            past = io.next_state(out)
            out = run(sess, io, feeds(io, np.array([[nxt]], dtype=np.int64), past, past_len))
            past_len += 1
        else:  # no cache: rerun the whole sequence
            out = run(sess, io, feeds(io, np.array([ids + new], dtype=np.int64)))
    text_ids = [i for i in new if i not in stop]
    return tokenizer.decode(text_ids, skip_special_tokens=True), new


