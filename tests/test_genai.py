"""onnxruntime-genai runs ortlean's rewritten models (issue 36, item 5): `ortlean rewrite` writes
genai_config.json beside a causal LM genai can drive — ortlean's library as custom_ops_library when the
graph has ai.ortlean ops, past_present_share_buffer for GroupQueryAttention graphs — and genai's
generator gives the logits and greedy tokens of ortlean's own loop; where genai cannot drive the graph
(PackedAttention's cache state, a gate's event state) no config is written and the report says why;
a tokenizer.json genai's tokenizer misreads (byte-level BPE with sentencepiece decoder steps) is fixed
without changing what `tokenizers` does. Slow: SmolLM2's fused int4 rewrite, og's greedy tokens against
`ortlean generate`'s."""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import custom_ops  # noqa: E402
from custom_ops import runtime  # noqa: E402
from custom_ops.runtime.generate import Decoder  # noqa: E402

from conftest import requires_native  # noqa: E402
from test_rewriter import run_cli  # noqa: E402

og = pytest.importorskip("onnxruntime_genai")
pytestmark = requires_native

TT = ("--tt", "on", "--tt-whiten", "none", "--tt-speed-check", "off", "--tt-gap", "0.5", "--quality-budget", "off")


@pytest.fixture(scope="module")
def tiny():
    import tiny_hf

    return tiny_hf.models()["llama"]


@pytest.fixture(scope="module")
def forms():
    import tiny_hf

    return tiny_hf.forms()


def _rewrite(src, out, *flags):
    code, so, se = run_cli("rewrite", src, "-o", out, "-q", "--report", str(out) + ".json", *flags)
    assert code == 0, se
    return json.loads(Path(str(out) + ".json").read_text()), so


def _og_run(model_dir, prompt, steps, threads=2):
    """og's generator, greedy: the logits it saw before each of `steps` tokens and the tokens it chose."""
    cfg = og.Config(str(model_dir))
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads,
                                                                      "inter_op_num_threads": 1}}}}))
    model = og.Model(cfg)
    p = og.GeneratorParams(model)
    p.set_search_options(max_length=len(prompt) + steps, do_sample=False)
    g = og.Generator(model, p)
    g.append_tokens(np.asarray(prompt, np.int32))
    logits, toks = [], []
    for _ in range(steps):  # until og's own stop (its eos ids; after one it would pad with pad_token_id)
        if g.is_done():
            break
        logits.append(np.asarray(g.get_logits(), np.float32).reshape(-1).copy())
        g.generate_next_token()
        toks.append(int(g.get_next_tokens()[0]))
    return np.stack(logits), toks


def _ortlean_run(path, prompt, toks, threads=2):
    """ortlean's loop (runtime.generate's Decoder) teacher-forced on og's tokens: the logits before each."""
    sess = custom_ops.session(str(path), threads=threads)
    io = runtime.ModelIO.from_session(sess, str(path))
    dec = Decoder(sess, io, max_len=len(prompt) + len(toks), model_path=path)
    out = [dec.feed(prompt)]
    out += [dec.feed([t]) for t in toks[:-1]]
    return np.stack(out), dec.loop, sess, io


def _prompt(n=17, seed=0, V=256):
    return [int(x) for x in np.random.default_rng(seed).integers(3, V, n)]


def test_custom_ops_gqa_graph_runs_in_genai(tiny, tmp_path):
    """TTMatMul (ai.ortlean) + GroupQueryAttention: genai registers our library from the config and its
    generator's logits equal ortlean's shared-buffer loop's; greedy tokens equal runtime.generate's."""
    out = tmp_path / "lean" / "model.onnx"
    rep, so = _rewrite(tiny / "model.onnx", out, *TT, "--attn-exact", "off")
    cfg = json.loads((out.parent / "genai_config.json").read_text())
    dec = cfg["model"]["decoder"]
    assert dec["session_options"]["custom_ops_library"] == str(Path(custom_ops.library_path()).resolve())
    assert dec["filename"] == "model.onnx" and dec["num_key_value_heads"] == 2 and dec["head_size"] == 16
    assert dec["num_hidden_layers"] == 2 and dec["inputs"]["position_ids"] == "position_ids"
    assert cfg["model"]["type"] == "llama" and cfg["model"]["context_length"] == 512
    assert cfg["model"]["eos_token_id"] == 2 and cfg["model"]["vocab_size"] == 256
    assert cfg["search"]["past_present_share_buffer"] is True and cfg["search"]["max_length"] == 512
    assert str(out.parent / "genai_config.json") in rep["written"] and "custom_ops_library" in rep["genai"]["note"]
    assert "onnxruntime-genai: genai_config.json for model.onnx with custom_ops_library" in so
    prompt = _prompt()
    ref, toks = _og_run(out.parent, prompt, 12)
    got, loop, sess, io = _ortlean_run(out, prompt, toks)
    assert loop == "shared"
    np.testing.assert_allclose(got, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)
    g = runtime.generate(sess, io, _Ids(), prompt, 12, eos=None, model_path=out)
    assert g.ids == toks
    # without the library in the config genai cannot load the graph (the config is what makes it run)
    bare = tmp_path / "bare"
    shutil.copytree(out.parent, bare)
    cfg["model"]["decoder"]["session_options"].pop("custom_ops_library")
    (bare / "genai_config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="TTMatMul"):
        og.Model(str(bare))


class _Ids:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def token_to_id(self, t):
        return None


def test_plain_onnx_graph_concatenating_cache(tiny, tmp_path):
    """An unfused optimum export with MatMulNBits weights (no ai.ortlean op, concatenating cache):
    no custom_ops_library, past_present_share_buffer false; og's logits equal ortlean's growing loop's."""
    out = tmp_path / "q8" / "lean.onnx"
    rep, _ = _rewrite(tiny / "model.onnx", out, "--weights", "int8", "--fuse", "off", "--quality-budget", "off")
    cfg = json.loads((out.parent / "genai_config.json").read_text())
    assert "custom_ops_library" not in cfg["model"]["decoder"]["session_options"]
    assert cfg["model"]["decoder"]["filename"] == "lean.onnx" and cfg["search"]["past_present_share_buffer"] is False
    prompt = _prompt(seed=1)
    ref, toks = _og_run(out.parent, prompt, 10)
    got, loop, _, _ = _ortlean_run(out, prompt, toks)
    assert loop == "growing"
    np.testing.assert_allclose(got, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)


def test_genai_builder_source_keeps_its_config(forms, tmp_path):
    """A genai builder model rewritten (TTMatMul, GroupQueryAttention kept): the config starts from the
    source's (its search options, type, token ids) with our filename and library."""
    if "genai-fp32" not in forms:
        pytest.skip("onnxruntime-genai builder models not built")
    src = forms["genai-fp32"]
    out = tmp_path / "g" / "tt.onnx"
    _rewrite(src / "model.onnx", out, *TT, "--attn-exact", "off")
    base = json.loads((src / "genai_config.json").read_text())
    cfg = json.loads((out.parent / "genai_config.json").read_text())
    assert cfg["model"]["decoder"]["filename"] == "tt.onnx" and "custom_ops_library" in cfg["model"]["decoder"]["session_options"]
    for k in ("type", "bos_token_id", "eos_token_id", "pad_token_id", "context_length", "vocab_size"):
        assert cfg["model"][k] == base["model"][k], k
    assert cfg["search"]["past_present_share_buffer"] == base["search"]["past_present_share_buffer"] is True
    # the tokenizer files are copied (og's tokenizer cannot read this tiny word-level one, nor the builder's
    # own copy of it: test_tokenizer_fixed_for_genai and the SmolLM2 test check og's tokenizer on BPE ones)
    assert (out.parent / "tokenizer.json").is_file() and (out.parent / "tokenizer_config.json").is_file()
    prompt = _prompt(seed=2)
    ref, toks = _og_run(out.parent, prompt, 8)
    got, loop, _, _ = _ortlean_run(out, prompt, toks)
    assert loop == "shared"
    np.testing.assert_allclose(got, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)


def test_packed_attention_and_event_state_get_no_config(tiny, forms, tmp_path, toy_text):
    """PackedAttention's cache state and a gate's event state: no genai_config.json, and the report says
    why and which flags keep a form genai runs; a source genai_config.json copied beside the output
    (naming it, for the source's graph) is removed."""
    out = tmp_path / "pa" / "model.onnx"
    rep, so = _rewrite(tiny / "model.onnx", out, "--fuse", "on", "--attn-exact", "on")
    assert not (out.parent / "genai_config.json").exists()
    note = rep["genai"]["skipped"]
    assert "PackedAttention's cache state" in note and "past_key_values.0.kv rows of 32;" in note
    assert "--attn-exact off" in note and "onnxruntime-genai: no genai_config.json" in so
    # the unfused path: PackedAttention's key bits beside the float K/V cache (an extra state)
    un = tmp_path / "un" / "model.onnx"
    rep1, _ = _rewrite(tiny / "model.onnx", un, "--fuse", "off", "--state-pack", "binary", "--quality-budget", "off")
    assert "packed-key state beside the K/V cache (past_key_values.0.key_bits" in rep1["genai"]["skipped"], rep1["genai"]
    assert not (un.parent / "genai_config.json").exists()
    if "genai-int4" in forms:
        out2 = tmp_path / "pa2" / "model.onnx"
        rep2, _ = _rewrite(forms["genai-int4"] / "model.onnx", out2, "--attn-exact", "on")
        assert not (out2.parent / "genai_config.json").exists() and "removed genai_config.json" in rep2["genai"]["skipped"]
        sess = custom_ops.session(str(out2), threads=1)  # ortlean's runtime needs no config for this graph
        io = runtime.ModelIO.from_session(sess, str(out2))
        assert runtime.generate(sess, io, _Ids(), _prompt(), 3, eos=None, model_path=out2).loop == "shared"
    # EventGatedMatMul's state on a decoder with a KV cache (the toy with optimum's cache I/O)
    import onnx
    import toy

    src = tmp_path / "cached" / "model.onnx"
    src.parent.mkdir()
    onnx.save(toy.cached(), str(src))
    toy.write_tokenizer(src.parent / "tokenizer.json")
    (src.parent / "config.json").write_text(json.dumps({"max_position_embeddings": 256, "model_type": "llama"}))
    ev = tmp_path / "ev" / "model.onnx"
    rep3, _ = _rewrite(src, ev, "--kwta=on", "--kwta-k", "0.6", "--kwta-duty", "2", "--event-driven=on",
                       "--calib-text", toy_text, "--quality-budget", "off", "--calib-tokens", "1024",
                       "--calib-window", "64")
    assert not (ev.parent / "genai_config.json").exists()
    assert "EventGatedMatMul's event state" in rep3["genai"]["skipped"], rep3["genai"]
    # the same toy without state: a config (with our library: the gate is an ai.ortlean op)
    st = tmp_path / "st" / "model.onnx"
    rep4, _ = _rewrite(src, st, "--kwta=on", "--kwta-k", "0.6", "--calib-text", toy_text, "--quality-budget", "off",
                       "--calib-tokens", "1024", "--calib-window", "64")
    assert "custom_ops_library" in rep4["genai"]["note"], rep4["genai"]
    prompt = _prompt(V=50)
    ref, toks = _og_run(st.parent, prompt, 6)
    got, loop, _, _ = _ortlean_run(st, prompt, toks)
    np.testing.assert_allclose(got, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)


def test_output_beside_the_source_writes_no_config(tiny, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny, src, ignore=shutil.ignore_patterns("hf"))
    rep, so = _rewrite(src / "model.onnx", src / "model.lean.onnx", *TT, "--attn-exact", "off")
    assert not (src / "genai_config.json").exists()
    assert "shares the source model's directory" in rep["genai"]["skipped"] and "-o DIR/model.onnx" in so


def _hybrid_tokenizer(path: Path):
    """A byte-level BPE saved the way transformers writes a GGUF "gpt2" tokenizer (SmolLM2's):
    byte_fallback on and sentencepiece steps (ByteFallback, Fuse, Replace "▁") before ByteLevel in the
    decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the sister of Elizabeth said héllo", "日本語のテキスト 東京", "ok 😀 fine 🎉 done"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t = json.loads(tok.to_str())
    t["model"]["byte_fallback"] = True
    t["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]}
    path.write_text(json.dumps(t, ensure_ascii=False), encoding="utf-8")


def test_tokenizer_fixed_for_genai(tiny, tmp_path):
    """genai's tokenizer maps the hybrid tokenizer's words to -1; the rewrite's copy drops the no-op
    sentencepiece steps: `tokenizers` encodes and decodes as before, genai's tokenizer now agrees."""
    from tokenizers import Tokenizer

    from rewriter.genai import _tokenizer_for_genai

    src = tmp_path / "src"
    shutil.copytree(tiny, src, ignore=shutil.ignore_patterns("hf"))
    _hybrid_tokenizer(src / "tokenizer.json")
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizerFast"}))
    before = Tokenizer.from_file(str(src / "tokenizer.json"))
    texts = ["the sister of Elizabeth", "héllo 日本語 😀 🎉", "  two  spaces\n\nnew"]
    # the unfixed file in a genai directory: genai's tokenizer misreads it
    bad = tmp_path / "bad"
    out = tmp_path / "lean" / "model.onnx"
    rep, so = _rewrite(src / "model.onnx", out, *TT, "--attn-exact", "off")
    assert "tokenizer.json: decoder reduced to its ByteLevel step" in rep["genai"]["note"]
    shutil.copytree(out.parent, bad)
    shutil.copy(src / "tokenizer.json", bad / "tokenizer.json")
    assert -1 in [int(x) for x in og.Tokenizer(og.Model(str(bad))).encode(texts[0])]
    after = Tokenizer.from_file(str(out.parent / "tokenizer.json"))
    tok = og.Tokenizer(og.Model(str(out.parent)))
    for s in texts:
        ids = before.encode(s).ids
        assert after.encode(s).ids == ids and after.decode(ids) == before.decode(ids) == s
        assert [int(x) for x in tok.encode(s)] == ids
        assert tok.decode(np.asarray(ids, np.int32)) == s
    assert after.decode_batch([[i] for i in range(after.get_vocab_size())]) == \
        before.decode_batch([[i] for i in range(before.get_vocab_size())])
    # a tokenizer whose vocabulary has sentencepiece tokens is left alone
    t = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    t["model"]["vocab"]["\u2581the"] = len(t["model"]["vocab"])
    p = tmp_path / "spm.json"
    p.write_text(json.dumps(t, ensure_ascii=False), encoding="utf-8")
    assert _tokenizer_for_genai(p) is None


# --------------------------------------------------------------------------- SmolLM2 (slow)
@pytest.mark.slow
@pytest.mark.heavy  # ~3.5 min on 2 cores: 3 prompts x 96 tokens, ortlean's loop and og's generator
def test_smollm2_int4_in_genai_matches_ortlean_generate(tmp_path):
    """SmolLM2 rewritten with the fused int4 recipe genai can drive (--weights int4 --attn-exact off:
    MatMulNBits + GroupQueryAttention): og's generator, greedy from the same prompt ids, gives the tokens
    of `ortlean generate` (runtime.generate, shared K/V buffers) — up to 96 of them, for plain and chat
    prompt, to the eos; the CLI prints their text; og's tokenizer encodes as ortlean's (after the tokenizer
    fix; og adds no BOS where this GGUF-derived tokenizer.json's post-processor adds <|im_start|>)."""
    from models import prepare

    d = prepare.prepare("smollm2")
    out = tmp_path / "smollm2-int4" / "model.onnx"
    code, so, se = run_cli("rewrite", d / "model.onnx", "-o", out, "--weights", "int4", "--weights-quantizer", "nbits",
                           "--attn-exact", "off", "--quality-budget", "off", "-q")
    assert code == 0, se
    assert "onnxruntime-genai: genai_config.json for model.onnx" in so, so
    cfg = json.loads((out.parent / "genai_config.json").read_text())
    assert cfg["search"]["past_present_share_buffer"] is True and cfg["model"]["eos_token_id"] == 2
    assert (out.parent / "chat_template.jinja").is_file()
    tok = runtime.load_tokenizer(out)
    sess = custom_ops.session(str(out), threads=2)
    io = runtime.ModelIO.from_session(sess, str(out))
    from custom_ops.runtime.generate import chat_template, model_eos_ids, render_chat, special_tokens

    chat = render_chat(chat_template(out)[0], [{"role": "user", "content": "What is the capital of France?"}],
                       True, **special_tokens(out))
    eos = model_eos_ids(out, tok)
    assert eos == [2]
    for text, special in (("The capital of France is", True), (chat, False),
                          ("Once upon a time, in a small village by the sea,", True)):
        ids = tok.encode(text, add_special_tokens=special).ids
        g = runtime.generate(sess, io, tok, ids, 96, eos=eos, model_path=out)
        _, og_toks = _og_run(out.parent, ids, 96)
        same = next((i for i, (a, b) in enumerate(zip(g.ids, og_toks)) if a != b), min(len(g.ids), len(og_toks)))
        print(f"{text[:30]!r}: {len(g.ids)} tokens ({g.stop}), {same} equal to og's {len(og_toks)}")
        assert g.loop == "shared" and g.ids == og_toks, f"first {same} tokens equal: {g.ids} vs {og_toks}"
        assert len(g.ids) >= 16
    code, so, se = run_cli("generate", out, "--prompt", "The capital of France is", "--max-new-tokens", "96")
    assert code == 0, se
    _, og_toks = _og_run(out.parent, tok.encode("The capital of France is").ids, 96)
    assert so == tok.decode([t for t in og_toks if t not in eos], skip_special_tokens=True) + "\n"
    otok = og.Tokenizer(og.Model(str(out.parent)))
    # (og's pre-tokenizer splits runs of whitespace after a newline otherwise: "a\n\nb" is ĊĊ for og, Ċ Ċ for
    # tokenizers and GPT-2's regex — docs/genai.md)
    for s in ("The capital of France is", "héllo 日本語 😀", "It is a truth universally acknowledged, that a single man"):
        assert [int(x) for x in otok.encode(s)] == tok.encode(s, add_special_tokens=False).ids
