"""models.gguf_tokenizer: a GGUF's SentencePiece vocabulary tokenizes as llama.cpp's SPM tokenizer does
(a Python transcription of llm_tokenizer_spm here is the reference), on a small vocabulary written
with gguf's own writer: merges by the merged entry's score, leftmost first on ties, byte fallback for
unknown characters, user-defined tokens matched whole, bos added, decode inverting encode. The scores are
distinct, as SentencePiece's merge ranks are (two entries of one score would be ordered by id, not by
position: a BPE's merge ranks are global)."""
from __future__ import annotations

import heapq

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from models.gguf_tokenizer import BYTE, CONTROL, NORMAL, USER_DEFINED, spm_tokenizer  # noqa: E402


def _vocab(rng):
    toks = [("<unk>", CONTROL, -1000.0), ("<s>", CONTROL, -1000.0), ("</s>", CONTROL, -1000.0)]
    toks += [(f"<0x{b:02X}>", BYTE, 0.0) for b in range(256)]
    chars = list("▁abcdefgh")
    toks += [(c, NORMAL, -float(1000 + i)) for i, c in enumerate(chars)]
    seen = {t for t, _, _ in toks}
    ranks = iter(rng.permutation(np.arange(1, 5000)))   # distinct scores, as SentencePiece's merge ranks are
    words = set()
    while len(words) < 120:   # merged entries, every one reachable from two entries already there
        n = int(rng.integers(2, 6))
        w = "".join(rng.choice(chars[1:], n))
        if rng.random() < 0.5:
            w = "▁" + w
        words.add(w)
    for w in sorted(words, key=len):
        for k in range(len(w) - 1, 0, -1):
            for piece in (w[:k], w[k:]):
                if piece not in seen:
                    toks.append((piece, NORMAL, -float(next(ranks))))
                    seen.add(piece)
        if w not in seen:
            toks.append((w, NORMAL, -float(next(ranks))))
            seen.add(w)
    toks.append(("\n\n", USER_DEFINED, 0.0))
    return toks


def _write(path, toks, add_space_prefix):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([t for t, _, _ in toks])
    w.add_token_scores([s for _, _, s in toks])
    w.add_token_types([ty for _, ty, _ in toks])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(add_space_prefix)
    w.add_tensor("dummy", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _spm_reference(text, toks, add_space_prefix):
    """llama.cpp's llm_tokenizer_spm (+ its partition on user-defined tokens, + bos)."""
    ids = {t: i for i, (t, _, _) in enumerate(toks)}
    score = {t: s for t, _, s in toks}
    out = [1]
    user = [t for t, ty, _ in toks if ty == USER_DEFINED]
    parts, rest = [], text
    while rest:
        hits = [(rest.find(u), -len(u), u) for u in user if rest.find(u) >= 0]
        if not hits:
            parts.append(rest)
            break
        pos, _, u = min(hits)
        if pos:
            parts.append(rest[:pos])
        parts.append((u,))
        rest = rest[pos + len(u):]
    first = True
    for p in parts:
        if isinstance(p, tuple):
            out.append(ids[p[0]])
            first = True          # llama.cpp: a space prefix after every token fragment (is_prev_special)
            continue
        s = p.replace(" ", "▁")
        if add_space_prefix and first:
            s = "▁" + s
        first = False
        sym = list(s)
        alive = [True] * len(sym)
        nxt = list(range(1, len(sym) + 1))
        prv = list(range(-1, len(sym) - 1))
        heap = []

        def push(left, right):
            if left < 0 or right >= len(sym):
                return
            t = sym[left] + sym[right]
            if t in ids:
                heapq.heappush(heap, (-score[t], left, sym[left], sym[right]))

        for i in range(len(sym) - 1):
            push(i, i + 1)
        while heap:
            _, left, a, b = heapq.heappop(heap)
            right = nxt[left] if left < len(sym) else len(sym)
            if not alive[left] or right >= len(sym) or sym[left] != a or sym[right] != b:
                continue
            sym[left] = a + b
            alive[right] = False
            nxt[left] = nxt[right]
            if nxt[right] < len(sym):
                prv[nxt[right]] = left
            push(prv[left], left)
            push(left, nxt[left])
        for i, t in enumerate(sym):
            if not alive[i]:
                continue
            if t in ids:
                out.append(ids[t])
            else:
                out.extend(ids[f"<0x{b:02X}>"] for b in t.encode())
    return out


@pytest.mark.parametrize("add_space_prefix", [False, True])
def test_spm_tokenizer_splits_as_llama_cpp(tmp_path, add_space_prefix):
    rng = np.random.default_rng(3)
    toks = _vocab(rng)
    path = tmp_path / "v.gguf"
    _write(path, toks, add_space_prefix)
    tok = spm_tokenizer(path)
    alphabet = list("abcdefgh") + [" "] * 3 + ["é", "🤗", "z"]
    for trial in range(300):
        n = int(rng.integers(1, 40))
        text = "".join(rng.choice(alphabet, n))
        if trial % 7 == 0:
            text = text[: n // 2] + "\n\n" + text[n // 2:]
        want = _spm_reference(text, toks, add_space_prefix)
        got = tok.encode(text).ids
        assert got == want, (text, got, want)
        if not add_space_prefix:   # (with it, the space put after every user-defined token stays, as in llama.cpp)
            assert tok.decode(got) == text


def test_spm_tokenizer_leaves_bpe_vocabularies_alone(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "b.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab"])
    w.add_token_merges(["a b"])
    w.add_tensor("dummy", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert spm_tokenizer(tmp_path / "b.gguf") is None
