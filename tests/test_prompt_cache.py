"""The prompt cache (issue 58, item 3) and time to first token (item 4): generating with a cache gives
the tokens and logits of generating without it — the first run writes the file, the second loads it
and prefills only the rest — on an optimum-style concatenating cache (growing loop), the tiny Llama's
optimum export, its GroupQueryAttention rewrite and its PackedAttention (int8 rows) rewrite (shared
buffers); another model's, another rewrite's, a corrupt, a truncated, a wrong-version file and a
prompt that does not start with the cached tokens give one line naming the file and the problem
(exit 2 from the CLI) and leave the file as it was; --prompt-cache-refresh rebuilds it; a failed write
leaves no file; --document makes a second question on one document load the cache; the closing line
gives the time to first token."""
from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import onnx
import pytest

import custom_ops
import toy
from conftest import native_available
from custom_ops import runtime
from custom_ops.runtime import prompt_cache as pc
from custom_ops.runtime.io import ModelIO
from rewriter import cli

gen = importlib.import_module("custom_ops.runtime.generate")


def write_words_tokenizer(path: Path, vocab: int = 256) -> None:
    """A word-level tokenizer over w0 … w{vocab-1} (the tiny Llama has no tokenizer of its own)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    t = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(path))


@pytest.fixture(scope="module")
def forms(tmp_path_factory) -> dict[str, Path]:
    """{form: model path}, each with a tokenizer.json beside it."""
    d = tmp_path_factory.mktemp("pc-forms")
    out = {}
    p = d / "optimum-cache" / "model.onnx"
    p.parent.mkdir()
    onnx.save(toy.cached(), str(p))
    toy.write_tokenizer(p.parent / "tokenizer.json")
    out["optimum-cache"] = p
    if native_available():
        import tiny_hf

        tiny = tiny_hf.models()["llama"] / "model.onnx"
        q = d / "tiny-optimum" / "model.onnx"
        q.parent.mkdir()
        shutil.copy(tiny, q)
        out["tiny-optimum"] = q
        for name, flags in (("gqa", ("--fuse", "on", "--attn-exact", "off")),
                            ("packed-int8", ("--state-pack", "binary", "--attn-kv", "int8", "--attn-budget", "1",
                                             "--attn-tune", "off", "--quality-budget", "off"))):
            q = d / name / "model.onnx"
            assert cli.main(["rewrite", str(tiny), "-o", str(q), "-q", *flags]) == 0
            out[name] = q
        for name in ("tiny-optimum", "gqa", "packed-int8"):
            write_words_tokenizer(out[name].parent / "tokenizer.json")
    return out


LOOPS = {"optimum-cache": "growing", "tiny-optimum": "growing", "gqa": "shared", "packed-int8": "shared"}


def _form(forms, form):
    if form not in forms:
        pytest.skip(f"{form}: needs the native library")
    return forms[form]


class _Session:
    """The model's session, ModelIO and tokenizer."""

    def __init__(self, path: Path):
        self.path = path
        self.sess = custom_ops.session(str(path), threads=2)
        self.io = ModelIO.from_session(self.sess, str(path))
        self.tok = runtime.load_tokenizer(path)
        self.vocab = self.io.vocab_size or 50

    def generate(self, prompt, n=8, **kw):
        """runtime.generate, greedy, with every row of logits the sampler saw."""
        rows = []

        class Recording(gen.Sampler):
            def __call__(self, logits):
                rows.append(np.array(logits, copy=True))
                return super().__call__(logits)

        old, gen.Sampler = gen.Sampler, Recording
        try:
            g = runtime.generate(self.sess, self.io, self.tok, prompt, n, eos=None, model_path=self.path, **kw)
        finally:
            gen.Sampler = old
        return g, np.stack(rows)


def _doc_and_questions(vocab: int, n: int = 40):
    rng = np.random.default_rng(5)
    doc = rng.integers(3, min(vocab, 250), n).tolist()
    return doc, doc + [4, 5, 6], doc + [7, 8, 9, 10, 11]


# --------------------------------------------------------------------------- equal to a run without the cache
@pytest.mark.parametrize("form", list(LOOPS))
def test_cache_gives_the_tokens_and_logits_of_no_cache(forms, form, tmp_path):
    """First run writes (its tokens and logits are the plain run's), the second loads the document's
    rows and prefills only its question: the same tokens and logits as a run without the cache —
    bit for bit when the prefill chunks line up with the cached tokens (8 | 40), and also when they do
    not (7) on these decoders; the file is read only."""
    m = _Session(_form(forms, form))
    doc, p1, p2 = _doc_and_questions(m.vocab)
    for chunk in (8, 7):
        c = tmp_path / f"doc-{chunk}.cache"
        ref1, r1 = m.generate(p1, prefill_chunk=chunk)
        g1, l1 = m.generate(p1, prefill_chunk=chunk, prompt_cache=c, cache_prefix=len(doc))
        assert g1.ids == ref1.ids and np.array_equal(l1, r1)
        assert g1.loop == LOOPS[form] and g1.cached_tokens == 0
        assert g1.cache.action == "written" and g1.cache.tokens == len(doc) and c.is_file()
        assert g1.cache.bytes == c.stat().st_size
        before = c.read_bytes()
        ref2, r2 = m.generate(p2, prefill_chunk=chunk)
        g2, l2 = m.generate(p2, prefill_chunk=chunk, prompt_cache=c, cache_prefix=len(doc))
        assert g2.ids == ref2.ids
        assert g2.cache.action == "loaded" and g2.cached_tokens == len(doc) and g2.prefilled_tokens == 5
        assert g2.loop == LOOPS[form]
        if chunk == 8:
            np.testing.assert_array_equal(l2, r2)
        else:
            np.testing.assert_allclose(l2, r2, rtol=0, atol=1e-6 * float(np.abs(r2).max()))
        assert c.read_bytes() == before
        # a prompt that is a beginning of the cached tokens loads what it shares (all but its last token)
        g3, l3 = m.generate(doc[:25], prefill_chunk=chunk, prompt_cache=c)
        ref3, r3 = m.generate(doc[:25], prefill_chunk=chunk)
        assert g3.cached_tokens == 24 and g3.ids == ref3.ids
        np.testing.assert_allclose(l3, r3, rtol=0, atol=1e-6 * float(np.abs(r3).max()))
        assert c.read_bytes() == before


def test_restored_rows_follow_a_fallback_to_the_growing_loop(forms, tmp_path):
    """A concatenating graph forced onto shared buffers fails its first run; with rows restored from a
    cache the decoder moves them into the growing loop's past and goes on: the same tokens."""
    m = _Session(forms["optimum-cache"])
    doc, p1, p2 = _doc_and_questions(m.vocab)
    c = tmp_path / "doc.cache"
    m.generate(p1, prompt_cache=c, cache_prefix=len(doc))
    g, logits = m.generate(p2, prompt_cache=c, shared=True)
    ref, r = m.generate(p2)
    assert g.loop == "growing" and g.cached_tokens == len(doc) and g.ids == ref.ids
    np.testing.assert_array_equal(logits, r)


def test_file_layout(forms, tmp_path, monkeypatch):
    """The documented format: magic, version, header JSON with its CRC, 4 KiB-aligned arrays holding the
    token ids and each state's first n positions in C order; file_bytes is the size."""
    m = _Session(forms["optimum-cache"])
    doc, p1, _ = _doc_and_questions(m.vocab)
    c = tmp_path / "doc.cache"
    dec_rows = {}
    real_save = pc.save

    def spy(path, model_path, io, tokens, states, binding=None):
        dec_rows.update({k: np.array(v) for k, v in states.items()})
        return real_save(path, model_path, io, tokens, states, binding=binding)

    monkeypatch.setattr(pc, "save", spy)
    m.generate(p1, prompt_cache=c, cache_prefix=len(doc))
    assert dec_rows
    raw = c.read_bytes()
    magic, version, jlen, crc = struct.unpack_from("<8sIII", raw)
    assert magic == b"\x89ORTLPC\n" and version == 1 and raw[20:24] == bytes(4)
    meta = json.loads(raw[24:24 + jlen])
    assert meta == {k: v for k, v in pc.read_header(c).items() if not k.startswith("_")}
    assert meta["format"] == "ortlean prompt cache" and meta["file_bytes"] == len(raw)
    assert meta["model"]["onnx"]["bytes"] == forms["optimum-cache"].stat().st_size
    t = meta["tokens"]
    assert t["count"] == len(doc) and t["offset"] % 4096 == 0
    assert np.frombuffer(raw, "<i4", len(doc), t["offset"]).tolist() == doc
    assert [s["name"] for s in meta["states"]] == list(m.io.past_to_present)
    for s in meta["states"]:
        assert s["offset"] % 4096 == 0 and s["shape"][s["seq_axis"]] == len(doc)
        a = np.frombuffer(raw, s["dtype"], int(np.prod(s["shape"])), s["offset"]).reshape(s["shape"])
        np.testing.assert_array_equal(a, dec_rows[s["name"]])
    import zlib
    assert zlib.crc32(raw[:16] + bytes(4) + raw[20:meta["tokens"]["offset"]]) == crc


# --------------------------------------------------------------------------- bad files
def _good_cache(m: _Session, c: Path):
    doc, p1, p2 = _doc_and_questions(m.vocab)
    g, _ = m.generate(p1, prompt_cache=c, cache_prefix=len(doc))
    assert g.cache.action == "written"
    return doc, p2


def _damage(c: Path, how: str, other: Path | None = None) -> str:
    """Damage the cache file; the words the error must say."""
    raw = bytearray(c.read_bytes())
    meta = pc.read_header(c)
    if how == "array byte":
        s = meta["states"][-1]
        raw[s["offset"] + s["bytes"] // 2] ^= 0x10
        c.write_bytes(raw)
        return f"corrupt (state {s['name']}: its checksum does not match)"
    if how == "token byte":
        raw[meta["tokens"]["offset"]] ^= 0x01
        c.write_bytes(raw)
        return "corrupt (its token ids: its checksum does not match)"
    if how == "padding byte":
        s = meta["states"][0]
        raw[s["offset"] + s["bytes"] + 1] = 7
        c.write_bytes(raw)
        return "checksum does not match"
    if how == "header byte":
        i = raw.index(b'"count"')
        raw[i + 2] ^= 0x20
        c.write_bytes(raw)
        return "corrupt (its header's checksum does not match)"
    if how == "truncated":
        c.write_bytes(raw[: len(raw) - 5000])
        return f"truncated ({len(raw) - 5000:,} of its {len(raw):,} bytes)"
    if how == "truncated header":
        c.write_bytes(raw[:30])
        return "truncated (30 bytes, its header alone takes"
    if how == "empty":
        c.write_bytes(b"")
        return "truncated (0 bytes: not even its header)"
    if how == "extra bytes":
        c.write_bytes(raw + b"\0" * 10)
        return f"corrupt ({len(raw) + 10:,} bytes, its header says {len(raw):,})"
    if how == "wrong version":
        struct.pack_into("<I", raw, 8, 2)
        c.write_bytes(raw)
        return "format version 2; this ortlean reads version 1"
    if how == "not a cache":
        c.write_text("Chapter 1\nIt is a truth universally acknowledged ...\n")
        return "not an ortlean prompt cache"
    raise AssertionError(how)


DAMAGE = ("array byte", "token byte", "padding byte", "header byte", "truncated", "truncated header", "empty",
          "extra bytes", "wrong version", "not a cache")


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_file_refused_and_left_as_it_was(forms, tmp_path, how, capsys):
    """Python API: PromptCacheError naming the file and the problem; the CLI: exit 2, one line, the
    same words and the refresh hint; the file's bytes unchanged by both. --prompt-cache-refresh then
    rebuilds it, and the next run loads it."""
    path = forms["optimum-cache"]
    m = _Session(path)
    c = tmp_path / "doc.cache"
    doc, p2 = _good_cache(m, c)
    words = _damage(c, how)
    before = c.read_bytes()
    with pytest.raises(pc.PromptCacheError) as e:
        m.generate(p2, prompt_cache=c, cache_prefix=len(doc))
    assert str(c) in str(e.value) and words in str(e.value), str(e.value)
    assert c.read_bytes() == before
    # the CLI: words, not ids (the toy tokenizer's)
    text = m.tok.decode(doc, skip_special_tokens=True)
    docf = tmp_path / "doc.txt"
    docf.write_text(text)
    argv = ["generate", str(path), "--document", str(docf), "--prompt", "the sister", "--max-new-tokens", "3",
            "--prompt-cache", str(c)]
    capsys.readouterr()
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and not out, err
    assert f"--prompt-cache {c}: " in err and words in err and "--prompt-cache-refresh rebuilds it" in err, err
    assert c.read_bytes() == before
    if how == "not a cache":   # never overwritten, even when asked to rebuild
        rc = cli.main(argv + ["--prompt-cache-refresh"])
        err = capsys.readouterr().err
        assert rc == 2 and "is not an ortlean prompt cache: not overwritten" in err and c.read_bytes() == before
        return
    assert cli.main(argv + ["--prompt-cache-refresh"]) == 0
    assert "tokens written" in capsys.readouterr().err
    assert cli.main(argv) == 0
    assert re.search(r"prompt \d+ tokens: \d+ from the prompt cache", capsys.readouterr().err)


def test_another_prompt_refused(forms, tmp_path):
    """A prompt that does not start with the cached tokens (another document) is refused, naming the
    token where they part; a difference within the cache's last tokens (a document's end tokenized
    differently) loads the rows up to it."""
    m = _Session(forms["optimum-cache"])
    c = tmp_path / "doc.cache"
    doc, _ = _good_cache(m, c)
    before = c.read_bytes()
    other = list(doc)
    other[10] = 2 if other[10] != 2 else 3
    with pytest.raises(pc.PromptCacheError, match=r"written for another prompt: this one does not start with its 40 "
                                                   r"tokens \(they differ from token 10\)"):
        m.generate(other + [4, 5], prompt_cache=c)
    assert c.read_bytes() == before
    near = list(doc)
    near[37] = 2 if near[37] != 2 else 3
    g, logits = m.generate(near + [4, 5], prompt_cache=c)
    ref, r = m.generate(near + [4, 5])
    assert g.cached_tokens == 37 and g.ids == ref.ids and np.array_equal(logits, r)


def test_another_model_refused(forms, tmp_path):
    """Another model (the same shapes, other weights), another rewrite of the same model, a changed
    external data file: refused. A copy of the same model elsewhere, or the same file touched, loads."""
    path = forms["optimum-cache"]
    m = _Session(path)
    c = tmp_path / "doc.cache"
    doc, p2 = _good_cache(m, c)
    before = c.read_bytes()
    # same graph and shapes, other weights
    o = tmp_path / "other" / "model.onnx"
    o.parent.mkdir()
    onnx.save(toy.cached(seed=1), str(o))
    toy.write_tokenizer(o.parent / "tokenizer.json")
    with pytest.raises(pc.PromptCacheError, match="written for another model or another rewrite of it .*SHA-256"):
        _Session(o).generate(p2, prompt_cache=c)
    # other shapes (one more layer): the model file's size differs first
    o2 = tmp_path / "other2" / "model.onnx"
    o2.parent.mkdir()
    onnx.save(toy.cached(L=3), str(o2))
    toy.write_tokenizer(o2.parent / "tokenizer.json")
    with pytest.raises(pc.PromptCacheError, match="written for another model"):
        _Session(o2).generate(p2, prompt_cache=c)
    assert c.read_bytes() == before
    # a byte-for-byte copy elsewhere, and the file touched: its SHA-256 is the same
    cp = tmp_path / "copy" / "model.onnx"
    cp.parent.mkdir()
    shutil.copy(path, cp)
    toy.write_tokenizer(cp.parent / "tokenizer.json")
    os.utime(cp, ns=(1, 1))
    g, _ = _Session(cp).generate(p2, prompt_cache=c)
    assert g.cached_tokens == len(doc)
    # external data: bound by name, size and sampled blocks
    e = tmp_path / "ext" / "model.onnx"
    e.parent.mkdir()
    onnx.save(toy.cached(), str(e), save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    toy.write_tokenizer(e.parent / "tokenizer.json")
    ce = tmp_path / "ext.cache"
    _good_cache(_Session(e), ce)
    assert [x["name"] for x in pc.read_header(ce)["model"]["external"]] == ["model.onnx.data"]
    g, _ = _Session(e).generate(p2, prompt_cache=ce)
    assert g.cached_tokens == len(doc)
    data = bytearray((e.parent / "model.onnx.data").read_bytes())
    data[len(data) // 3] ^= 0x01
    (e.parent / "model.onnx.data").write_bytes(data)
    with pytest.raises(pc.PromptCacheError, match="external data file model.onnx.data differs"):
        _Session(e).generate(p2, prompt_cache=ce)


def test_another_rewrite_refused(forms, tmp_path):
    """A GroupQueryAttention rewrite's cache is refused by the PackedAttention rewrite of the same model."""
    gqa, packed = _Session(_form(forms, "gqa")), _Session(_form(forms, "packed-int8"))
    c = tmp_path / "doc.cache"
    doc, p2 = _good_cache(gqa, c)
    before = c.read_bytes()
    with pytest.raises(pc.PromptCacheError, match="written for another model or another rewrite of it"):
        packed.generate(p2, prompt_cache=c)
    assert c.read_bytes() == before


def test_another_ortlean_refused(forms, tmp_path, monkeypatch):
    m = _Session(forms["optimum-cache"])
    c = tmp_path / "doc.cache"
    doc, p2 = _good_cache(m, c)
    monkeypatch.setattr(pc, "_versions", lambda: {"ortlean": "9.9.9", "onnxruntime": "x"})
    with pytest.raises(pc.PromptCacheError, match=r"written by ortlean \S+, this is ortlean 9\.9\.9"):
        m.generate(p2, prompt_cache=c)


def test_models_without_a_kv_cache_refused(toy_model, tmp_path):
    """No state (the whole sequence runs again per token) or a gate's state (counts runs): refused,
    nothing written."""
    m = _Session(toy_model)
    c = tmp_path / "x.cache"
    with pytest.raises(pc.PromptCacheError, match="the model has no state to cache") as e:
        m.generate([3, 4, 5], prompt_cache=c)
    assert not e.value.refresh_helps and not c.exists() and not list(tmp_path.iterdir())
    ins = [("input_ids", ["b", "s"], np.int64), ("past_key_values.0.key", ["b", 2, "past_sequence_length", 4], np.float32),
           ("past_event.0", ["b", 8], np.float32)]
    outs = [("logits", ["b", "s", 10], np.float32), ("present.0.key", ["b", 2, "total_sequence_length", 4], np.float32),
            ("present_event.0", ["b", 8], np.float32)]
    dec = gen.Decoder(None, ModelIO.from_signature(ins, outs), max_len=4, shared=False)
    assert "past_event.0 is not a KV cache" in dec.cache_problem()


# --------------------------------------------------------------------------- atomic writes, refresh
@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_failed_write_leaves_no_file(forms, tmp_path, monkeypatch, exc):
    """A write that fails half-way (disk full, Ctrl-C) leaves neither the file nor a temporary one; an
    old cache being rebuilt stays as it was."""
    m = _Session(forms["optimum-cache"])
    doc, p1, _ = _doc_and_questions(m.vocab)
    calls = {"n": 0}
    real = pc._write_all

    def failing(f, mv):
        calls["n"] += 1
        if calls["n"] == 3:
            raise exc
        real(f, mv)

    monkeypatch.setattr(pc, "_write_all", failing)
    c = tmp_path / "doc.cache"
    with pytest.raises(pc.PromptCacheError if isinstance(exc, OSError) else KeyboardInterrupt) as e:
        m.generate(p1, prompt_cache=c, cache_prefix=len(doc))
    if isinstance(exc, OSError):
        assert "cannot be written (No space left on device); nothing was written" in str(e.value)
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(pc, "_write_all", real)
    m.generate(p1, prompt_cache=c, cache_prefix=10)
    before = c.read_bytes()
    calls["n"] = 0
    monkeypatch.setattr(pc, "_write_all", failing)
    with pytest.raises((pc.PromptCacheError, KeyboardInterrupt)):
        m.generate(p1, prompt_cache=pc.PromptCache(c, refresh=True), cache_prefix=len(doc))
    assert c.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["doc.cache"]


def test_refresh_rebuilds_for_another_document(forms, tmp_path):
    m = _Session(forms["optimum-cache"])
    c = tmp_path / "doc.cache"
    doc, _ = _good_cache(m, c)
    other = [(t + 1) % 50 + 2 for t in doc]
    with pytest.raises(pc.PromptCacheError, match="written for another prompt"):
        m.generate(other + [4], prompt_cache=c)
    g, _ = m.generate(other + [4], prompt_cache=pc.PromptCache(c, refresh=True))
    assert g.cache.action == "written" and g.cached_tokens == 0
    g, _ = m.generate(other + [5, 6], prompt_cache=c)
    assert g.cache.action == "loaded" and g.cached_tokens == len(other)


# --------------------------------------------------------------------------- the shared part of a text prompt
def _bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["It is a truth universally acknowledged, that a single man in possession of a good fortune.\n\n",
            "Who is Mr Darcy?\nWhere is Pemberley?  \n\n\n"] * 30
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.mark.parametrize("doc", ["It is a truth universally acknowledged, that a single man",
                                 "a good fortune.", "Where is Pemberley?  ", "a single man\n", "fortune.\n\n\n"])
def test_prefix_tokens_are_shared_by_any_question(doc):
    """The tokens cached for a document are a beginning of the tokens of the document followed by any
    question (the CLI's --document composition), whatever the document's last characters."""
    tok = _bpe()
    d = doc.rstrip()
    counts = set()
    for q in ("Who is Mr Darcy?", " where", "\n1.", "?!"):
        text = f"{d}\n\n{q}"
        enc = tok.encode(text)
        n = pc.prefix_tokens(enc, len(d))
        counts.add(n)
        alone = tok.encode(d).ids
        assert enc.ids[:n] == alone[:n] and n >= len(alone) - 2, (doc, q, n)
    assert len(counts) == 1


# --------------------------------------------------------------------------- the command line
@pytest.mark.parametrize("form", ["optimum-cache", "packed-int8"])
def test_cli_second_question_on_a_document(forms, form, tmp_path, capsys):
    """--document + --prompt: the first question writes the cache, the second loads it and prefills only
    its own tokens (and the template's end with --chat); the text equals a run without the cache; the
    closing line gives the time to first token."""
    path = _form(forms, form)
    words = ("the sister of elizabeth said that mr darcy was" if form == "optimum-cache"
             else " ".join(f"w{i}" for i in np.random.default_rng(2).integers(3, 250, 60)))
    doc = tmp_path / "doc.txt"
    doc.write_text(words + "\n")
    c = tmp_path / "doc.cache"
    d = tmp_path / "m"
    shutil.copytree(path.parent, d)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template":
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}she{% endif %}"}))
    m = d / "model.onnx"
    for chat in ([], ["--chat"]):
        c.unlink(missing_ok=True)
        outs = []
        for q, cache in (("the sister", True), ("mr darcy", True), ("mr darcy", False)):
            if form != "optimum-cache":
                q = "w5 w6" if q == "the sister" else "w7 w8 w9"
            argv = ["generate", str(m), "--document", str(doc), "--prompt", q, "--max-new-tokens", "5", *chat]
            rc = cli.main(argv + (["--prompt-cache", str(c)] if cache else []))
            out, err = capsys.readouterr()
            assert rc == 0, err
            line = err.strip().splitlines()[-1]
            assert re.search(r"time to first token [\d.]+ s; prompt [\d,]+ tokens", line), line
            outs.append((out, line))
        assert "tokens written" in outs[0][1] and f"prompt cache {c}" in outs[0][1]
        n = len(words.split()) - (0 if chat else 1)   # the doc's words (and the template's "user"), less the last
        assert re.search(rf"prompt [\d,]+ tokens: {n} from the prompt cache, \d+ prefilled", outs[1][1]), outs[1][1]
        assert "tokens loaded" in outs[1][1] and "prompt cache" not in outs[2][1]
        assert outs[1][0] == outs[2][0]


def test_cli_closing_line_without_a_cache(forms, capsys):
    rc = cli.main(["generate", str(forms["optimum-cache"]), "--prompt", "the sister", "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert rc == 0 and re.search(r"\[ortlean generate\] time to first token [\d.]+ s; prompt 2 tokens, prefill "
                                 r"[\d.]+ s \([\d.]+ tok/s\); decode 3 tokens", err), err
