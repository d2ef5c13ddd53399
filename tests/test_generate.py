"""`runtime.generate` and `ortlean generate` (issue 36, item 6): every graph form's loop (rerun, growing
state, shared K/V buffers: GroupQueryAttention and PackedAttention) gives the previous implementation's
greedy tokens and logits with the prompt prefilled in chunks; sampling is reproducible with a seed,
differs across seeds, top-k 1 is greedy, top-k / top-p keep the tokens they should; streamed text adds
up to the decoded text through multi-byte characters; --chat renders the model's template; the CLI's
closing line gives prefill and decode tok/s; a ~4k-token --prompt-file on SmolLM2 (slow)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import custom_ops  # noqa: E402
from custom_ops import runtime  # noqa: E402
from custom_ops.runtime.generate import (Decoder, Sampler, Sampling, TextStream, chat_template,  # noqa: E402
                                         model_eos_ids, render_chat, shares_kv)

from conftest import requires_native  # noqa: E402
from test_rewriter import run_cli  # noqa: E402

CAL = ("--calib-tokens", "1024", "--calib-window", "64")
SUMMARY = re.compile(r"prompt ([\d,]+) tokens, prefill [\d.]+ s \(([\d.]+) tok/s\); decode ([\d,]+) tokens in [\d.]+ s "
                     r"\(([\d.]+) tok/s\); (\d+) new tokens, stop: (\w+)")


def _previous_greedy(sess, io, prompt_ids, max_new_tokens, stop=()):
    """The implementation `runtime.generate` replaced (verbatim but for the tokenizer): one prefill of
    the whole prompt, then one token per run with every present.* fed back as past.*, argmax."""
    ids = list(prompt_ids)
    new = []
    out = runtime.run(sess, io, runtime.feeds(io, np.array([ids], dtype=np.int64)))
    past_len = len(ids)
    for step in range(max_new_tokens):
        nxt = int(np.argmax(out[io.logits_name][0, -1]))
        new.append(nxt)
        if nxt in stop or step == max_new_tokens - 1:
            break
        if io.has_past:
            past = io.next_state(out)
            out = runtime.run(sess, io, runtime.feeds(io, np.array([[nxt]], dtype=np.int64), past, past_len))
            past_len += 1
        else:
            out = runtime.run(sess, io, runtime.feeds(io, np.array([ids + new], dtype=np.int64)))
    return new


def _previous_logits(sess, io, prompt_ids, steps):
    """Logits of the previous loop, teacher-forced: the prompt in one run, then each of `steps`."""
    out = runtime.run(sess, io, runtime.feeds(io, np.array([prompt_ids], dtype=np.int64)))
    rows, past, plen, seq = [out[io.logits_name][0, -1]], None, len(prompt_ids), list(prompt_ids)
    for t in steps:
        if io.has_past:
            past = io.next_state(out)
            out = runtime.run(sess, io, runtime.feeds(io, np.array([[t]], dtype=np.int64), past, plen))
            plen += 1
        else:
            seq.append(int(t))
            out = runtime.run(sess, io, runtime.feeds(io, np.array([seq], dtype=np.int64)))
        rows.append(out[io.logits_name][0, -1])
    return np.stack(rows)


# --------------------------------------------------------------------------- model forms
@pytest.fixture(scope="module")
def forms(tmp_path_factory, toy_model, toy_text):
    """{form: (model path, tokenizer, expected loop)} — every state form the rewriter writes."""
    import toy

    d = tmp_path_factory.mktemp("forms")
    out = {"toy": (toy_model, runtime.load_tokenizer(toy_model), "rerun")}
    p = d / "cached" / "model.onnx"
    p.parent.mkdir()
    onnx.save(toy.cached(), str(p))
    toy.write_tokenizer(p.parent / "tokenizer.json")
    out["optimum-cache"] = (p, runtime.load_tokenizer(p), "growing")
    if custom_ops.resolve_backend("auto") == "native":
        e = d / "event" / "model.onnx"
        code, _, se = run_cli("rewrite", p, "-o", e, "--kwta=on", "--kwta-k", "0.6", "--kwta-duty", "2",
                              "--event-driven=on", "--event-gap-every", "4", "--calib-text", toy_text,
                              "--quality-budget", "off", "-q", *CAL)
        assert code == 0, se
        out["event-state"] = (e, runtime.load_tokenizer(e), "growing")
        import tiny_hf

        tiny = tiny_hf.models()["llama"] / "model.onnx"
        tok = None
        fms = tiny_hf.forms()
        if "genai-int4" in fms:
            tok = runtime.load_tokenizer(fms["genai-int4"] / "tokenizer.json")
            out["genai-builder"] = (fms["genai-int4"] / "model.onnx", tok, "shared")
        out["tiny-optimum"] = (tiny, tok, "growing")
        for name, flags in (("gqa", ("--fuse", "on", "--attn-exact", "off")),
                            ("packed-exact", ("--fuse", "on", "--attn-exact", "on")),
                            ("packed-int8", ("--state-pack", "binary", "--attn-kv", "int8", "--attn-budget", "1",
                                             "--attn-tune", "off", "--quality-budget", "off"))):
            q = d / name / "model.onnx"
            code, _, se = run_cli("rewrite", tiny, "-o", q, "-q", *flags)
            assert code == 0, se
            out[name] = (q, tok, "shared")
    return out


FORMS = ("toy", "optimum-cache", "event-state", "tiny-optimum", "gqa", "packed-exact", "packed-int8", "genai-builder")


@pytest.mark.parametrize("form", FORMS)
def test_greedy_equals_previous_loop(forms, form):
    """Greedy tokens equal the previous implementation's; the logits along a teacher-forced sequence
    equal it with the prompt prefilled in chunks of 7 (GQA, PackedAttention: shared buffers)."""
    if form not in forms:
        pytest.skip(f"{form}: needs the native library / onnxruntime-genai")
    path, tok, loop = forms[form]
    sess = custom_ops.session(str(path), threads=2)
    io = runtime.ModelIO.from_session(sess, str(path))
    V = io.vocab_size or 60
    rng = np.random.default_rng(7)
    prompt = [int(x) for x in rng.integers(2, V, 23)]
    steps = [int(x) for x in rng.integers(2, V, 9)]
    ref = _previous_logits(sess, io, prompt, steps)
    dec = Decoder(sess, io, max_len=len(prompt) + len(steps) + 1, model_path=path)
    assert dec.loop == loop
    chunk = 7 if dec.chunkable else len(prompt)  # a gate's state counts runs: one prefill run (as generate does)
    assert dec.chunkable == (form not in ("toy", "event-state"))
    got = [dec.feed(prompt[c:c + chunk]) for c in range(0, len(prompt), chunk)][-1:]
    got += [dec.feed([t]) for t in steps]
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(np.stack(got), ref, atol=2e-5 * scale, rtol=0)
    for chunk in (512, 5):
        g = runtime.generate(sess, io, tok or _Ids(), prompt, 12, eos=None, model_path=path, prefill_chunk=chunk)
        assert g.ids == _previous_greedy(sess, io, prompt, 12) and g.loop == loop
        assert g.prompt_tokens == 23 and g.decode_tokens == 11 and g.stop == "max_new_tokens"


@pytest.mark.parametrize("form", ("toy", "optimum-cache", "gqa", "packed-exact", "packed-int8"))
def test_generator_session_computes_the_last_position(forms, form):
    """`ortlean generate` and `ortlean bench` run a model as a generator does: a prompt run's logits are
    its last position's (the head skips the others), equal to the model's own last row; decode steps
    give the model's own logits; the shared loop still shares; the file is not changed."""
    from rewriter.evaluate import generator_session

    if form not in forms:
        pytest.skip(f"{form}: needs the native library")
    path, _, loop = forms[form]
    before = Path(path).read_bytes()
    full = custom_ops.session(str(path), threads=1)
    gen = generator_session(str(path), 1)
    io = runtime.ModelIO.from_session(full, str(path))
    rng = np.random.default_rng(3)
    prompt = rng.integers(2, io.vocab_size or 60, 11).tolist()
    steps = rng.integers(2, io.vocab_size or 60, 4).tolist()
    a = runtime.run(full, io, runtime.feeds(io, np.array([prompt], dtype=np.int64)))[io.logits_name]
    b = runtime.run(gen, io, runtime.feeds(io, np.array([prompt], dtype=np.int64)))[io.logits_name]
    assert a.shape[1] == 11 and b.shape[1] == 1
    np.testing.assert_allclose(b[:, -1], a[:, -1], rtol=1e-5, atol=1e-5 * float(np.abs(a).max()))
    ref = _previous_logits(full, io, prompt, steps)
    dec = Decoder(gen, io, max_len=len(prompt) + len(steps) + 1, model_path=path)
    assert dec.loop == loop
    got = np.stack([dec.feed(prompt)] + [dec.feed([t]) for t in steps])
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * float(np.abs(ref).max()))
    assert Path(path).read_bytes() == before


class _Ids:
    """A stand-in tokenizer for models without one (ids only)."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def token_to_id(self, t):
        return None


def test_shares_kv_reads_the_graph(forms):
    for form, (path, _, loop) in forms.items():
        assert shares_kv(path) == (loop == "shared"), form


def test_generate_text_and_eos(forms):
    """The text is the decode of the new ids without the eos; generation stops after an eos; words
    of the toy vocabulary (a real tokenizer) stream in pieces that add up to the text."""
    path, tok, _ = forms["optimum-cache"]
    sess = custom_ops.session(str(path), threads=1)
    io = runtime.ModelIO.from_session(sess, str(path))
    prompt = "the sister of elizabeth"
    g0 = runtime.generate(sess, io, tok, prompt, 10, eos=None)
    pieces = []
    g = runtime.generate(sess, io, tok, prompt, 10, eos=None, on_text=pieces.append)
    assert g.ids == g0.ids and "".join(pieces) == g.text == tok.decode(g.ids, skip_special_tokens=True)
    stop = g0.ids[3]
    g2 = runtime.generate(sess, io, tok, prompt, 10, eos=[stop])
    assert g2.ids == g0.ids[: g0.ids.index(stop) + 1] and g2.stop == "eos"
    assert g2.text == tok.decode(g2.ids[:-1], skip_special_tokens=True)
    text, ids = g2  # unpacks as before
    assert ids == g2.ids
    # the model's positions bound the sequence: new tokens stop there, a longer prompt is refused
    n = len(tok.encode(prompt).ids)
    g3 = runtime.generate(sess, io, tok, prompt, 10, eos=None, max_length=n + 3)
    assert len(g3.ids) == 3 and g3.stop == "context" and g3.ids == g0.ids[:3]
    with pytest.raises(ValueError, match="at most 4 positions"):
        runtime.generate(sess, io, tok, prompt, 10, max_length=4)


# --------------------------------------------------------------------------- sampling
def test_sampling_reproducible_and_top_k_one_is_greedy(forms):
    path, tok, _ = forms["optimum-cache"]
    sess = custom_ops.session(str(path), threads=1)
    io = runtime.ModelIO.from_session(sess, str(path))
    prompt = "the sister of elizabeth"

    def gen(**kw):
        return runtime.generate(sess, io, tok, prompt, 24, eos=None, sampling=Sampling(**kw)).ids

    a, b = gen(temperature=5.0, seed=1), gen(temperature=5.0, seed=1)  # the toy is peaked: T 5 spreads it
    assert a == b
    others = [gen(temperature=5.0, seed=s) for s in (2, 3, 4)]
    assert all(o != a for o in others)
    greedy = runtime.generate(sess, io, tok, prompt, 24, eos=None).ids
    assert gen(temperature=5.0, top_k=1, seed=9) == greedy
    assert gen(temperature=0.7, top_k=1, top_p=0.3, seed=5) == greedy
    g = runtime.generate(sess, io, tok, prompt, 4, eos=None, sampling=Sampling(temperature=5.0))
    seed = int(re.search(r"seed (\d+)", g.sampling).group(1))  # a fresh seed is reported, and reproduces the run
    assert gen(temperature=5.0, seed=seed)[:4] == g.ids


def test_sampler_top_k_top_p_sets():
    """Draws stay in the top-k / nucleus set, at the renormalised probabilities (chi-square-like bound);
    the partial-sort path of top-p draws exactly what the full sort draws."""
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = np.log(p)
    for kw, allowed in (({"top_k": 3}, {0, 1, 2}), ({"top_p": 0.65}, {0, 1}), ({"top_p": 0.66}, {0, 1, 2}),
                        ({"top_k": 4, "top_p": 0.5}, {0, 1}), ({}, set(range(6)))):
        s = Sampler(Sampling(temperature=1.0, seed=0, **kw))
        draws = np.array([s(logits) for _ in range(4000)])
        assert set(np.unique(draws)) == allowed, kw
        q = p[sorted(allowed)] / p[sorted(allowed)].sum()
        freq = np.bincount(draws, minlength=6)[sorted(allowed)] / draws.size
        assert np.all(np.abs(freq - q) < 4 * np.sqrt(q * (1 - q) / draws.size) + 1e-9), (kw, freq, q)
    # temperature: a high one flattens the distribution
    s = Sampler(Sampling(temperature=50.0, seed=0))
    freq = np.bincount([s(logits) for _ in range(3000)], minlength=6) / 3000
    assert freq.min() > 0.12
    # a large vocabulary: top-p over the 1,024 most likely first, else the full sort — the same draws
    rng = np.random.default_rng(3)
    z = rng.standard_normal(50_000) * 3
    for top_p in (0.5, 0.999):
        s1, s2 = Sampler(Sampling(temperature=1.0, top_p=top_p, seed=4)), Sampler(Sampling(temperature=1.0, top_p=top_p, seed=4))
        s2.PARTIAL = 10**9  # never partial
        assert [s1(z) for _ in range(50)] == [s2(z) for _ in range(50)]
    with pytest.raises(ValueError, match="top_p"):
        Sampling(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=-1.0)


# --------------------------------------------------------------------------- streamed text
def _bpe_tokenizer():
    """A byte-level BPE trained on text with multi-byte characters (CJK, emoji, accents), so
    characters split over several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the sister of Elizabeth said héllo to the garçon", "日本語のテキスト 東京 大阪", "ok 😀 fine 🎉 done"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def test_text_stream_multibyte():
    tok = _bpe_tokenizer()
    for s in ("héllo 日本語 and 😀🎉 from 東京, garçon", "語😀", "plain words only"):
        ids = tok.encode(s).ids
        st = TextStream(tok)
        pieces = [st.push(i) for i in ids] + [st.flush()]
        assert "".join(pieces) == tok.decode(ids) == s
        assert not any("\ufffd" in x for x in pieces)  # an incomplete character is held back, never printed
    ids = tok.encode("😀").ids
    assert len(ids) > 1, "the emoji should span several tokens"
    st = TextStream(tok)
    assert st.push(ids[0]) == ""


# --------------------------------------------------------------------------- chat template, eos ids
TEMPLATE = ("{% for m in messages %}{{ bos_token }}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


def test_chat_template_found_and_rendered(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "the"}))
    t, src = chat_template(tmp_path / "model.onnx")
    assert t == TEMPLATE and src.name == "tokenizer_config.json"
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "日本 ok"}]
    assert render_chat(t, msgs, True, bos_token="<s>") == "<s>[system] be brief\n<s>[user] 日本 ok\n[assistant]"
    assert render_chat(t, msgs[1:], False, bos_token="") == "[user] 日本 ok\n"
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] | upper }}")  # the .jinja file wins
    assert chat_template(tmp_path)[1].name == "chat_template.jinja"
    with pytest.raises(ValueError, match="no system"):
        render_chat("{{ raise_exception('no system') }}", msgs)
    assert chat_template(tmp_path / "empty" / "model.onnx") is None


def test_model_eos_ids(tmp_path):
    m = tmp_path / "model.onnx"
    assert model_eos_ids(m) == "auto"
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert model_eos_ids(m) == [2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert model_eos_ids(m) == [2, 7]


# --------------------------------------------------------------------------- the CLI
def test_cli_streams_and_reports_speed(forms, tmp_path):
    path, tok, _ = forms["optimum-cache"]
    code, so, se = run_cli("generate", path, "--prompt", "the sister of elizabeth", "--max-new-tokens", "9",
                           "--threads", "1")
    assert code == 0, se
    sess = custom_ops.session(str(path), threads=1)
    io = runtime.ModelIO.from_session(sess, str(path))
    g = runtime.generate(sess, io, tok, "the sister of elizabeth", 9, eos=model_eos_ids(path, tok))
    assert so == g.text + "\n"
    m = SUMMARY.search(se)
    assert m, se
    assert int(m.group(1)) == len(tok.encode("the sister of elizabeth").ids)
    assert float(m.group(2)) > 0 and float(m.group(4)) > 0 and int(m.group(5)) == len(g.ids)
    # --prompt-file, and '-' for standard input
    f = tmp_path / "prompt.txt"
    f.write_text("the sister of elizabeth")
    code, so2, se2 = run_cli("generate", path, "--prompt-file", f, "--max-new-tokens", "9")
    assert code == 0 and so2 == so, se2
    import subprocess
    import os

    r = subprocess.run([sys.executable, "-m", "rewriter.cli", "generate", str(path), "--prompt-file", "-",
                        "--max-new-tokens", "9"], input="the sister of elizabeth", capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and r.stdout == so, r.stderr
    # sampling with a seed is reproducible from the command line
    args = ("generate", path, "--prompt", "the sister", "--max-new-tokens", "12", "--temperature", "1.2",
            "--top-k", "20", "--top-p", "0.95", "--seed", "11")
    c1, s1, e1 = run_cli(*args)
    c2, s2, _ = run_cli(*args)
    assert c1 == c2 == 0 and s1 == s2, e1
    assert "sampling temperature 1.2, top-k 20, top-p 0.95, seed 11" in e1


def test_cli_json_records_runs(forms, tmp_path):
    """--json FILE: the closing line's figures, text, command and provenance; a second run is added beside the
    first; a file the option did not write is refused (exit 2, one line) and left as it was."""
    path = forms["optimum-cache"][0]
    f = tmp_path / "runs.json"
    code, so, se = run_cli("generate", path, "--prompt", "the sister of elizabeth", "--max-new-tokens", "6", "--json", f)
    assert code == 0, se
    doc = json.loads(f.read_text())
    assert doc["kind"] == "ortlean-generate/1" and len(doc["runs"]) == 1
    r = doc["runs"][0]
    m = SUMMARY.search(se)
    assert r["prompt_tokens"] == int(m.group(1)) and r["new_tokens"] == int(m.group(5)) and r["text"] + "\n" == so
    assert r["ttft_s"] > 0 and r["cached_tokens"] == 0 and "prompt_cache" not in r
    assert r["command"].startswith("ortlean generate ") and r["summary"] in se
    assert {"commit", "date", "machine"} <= set(r)
    code, _, se = run_cli("generate", path, "--prompt", "the sister", "--max-new-tokens", "3", "--json", f)
    assert code == 0, se
    runs = json.loads(f.read_text())["runs"]
    assert len(runs) == 2 and runs[0] == r and runs[1]["prompt_tokens"] < r["prompt_tokens"]
    for bad in ('{"a": 1}', "not json"):
        other = tmp_path / "other.json"
        other.write_text(bad)
        code, so, se = run_cli("generate", path, "--prompt", "the", "--max-new-tokens", "2", "--json", other)
        assert code == 2 and "--json" in se and "not overwritten" in se and se.count("\n") == 1 and not so, se
        assert other.read_text() == bad


def test_cli_chat(forms, tmp_path):
    """--chat renders the template beside the model (tokenizer_config.json here) and generates after it;
    the prompt token count in the closing line is the rendered prompt's; --system goes first."""
    import shutil

    path, tok, _ = forms["optimum-cache"]
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(path, d / "model.onnx")
    shutil.copy(path.parent / "tokenizer.json", d / "tokenizer.json")
    code, _, se = run_cli("generate", d / "model.onnx", "--chat", "--prompt", "the sister")
    assert code == 2 and "no chat template" in se
    tpl = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}she{% endif %}"
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": tpl}))
    code, so, se = run_cli("generate", d / "model.onnx", "--chat", "--system", "mr darcy", "--prompt", "the sister",
                           "--max-new-tokens", "5")
    assert code == 0, se
    rendered = "system mr darcy user the sister she"
    assert render_chat(tpl, [{"role": "system", "content": "mr darcy"}, {"role": "user", "content": "the sister"}]) == rendered
    n = len(tok.encode(rendered, add_special_tokens=False).ids)
    assert int(SUMMARY.search(se).group(1)) == n
    sess = custom_ops.session(str(d / "model.onnx"), threads=2)
    io = runtime.ModelIO.from_session(sess)
    g = runtime.generate(sess, io, tok, rendered, 5, eos="auto", add_special_tokens=False)
    assert so == g.text + "\n"


@pytest.mark.parametrize("args,needle", [
    (["--prompt", "the", "--top-k", "5"], "--temperature > 0"),
    (["--prompt", "the", "--seed", "1"], "--temperature > 0"),
    (["--prompt", "the", "--system", "x"], "--system needs --chat"),
    (["--prompt", "the", "--temperature", "-1"], "--temperature"),
    (["--prompt", "the", "--top-p", "0"], "--top-p"),
    (["--prompt", "the", "--top-p", "1.5"], "--top-p"),
    (["--prompt-file", "{tmp}/missing.txt"], "missing.txt"),
    (["--prompt", "the", "--prompt-file", "{tmp}/x.txt"], "not allowed with"),
    (["--prompt-file", "{tmp}/blank.txt"], "empty prompt"),
])
def test_cli_bad_flags(forms, tmp_path, args, needle, capsys):
    from rewriter import cli

    path = forms["optimum-cache"][0]
    (tmp_path / "blank.txt").write_text("  \n")
    code = cli.main(["generate", str(path), *[a.replace("{tmp}", str(tmp_path)) for a in args]])
    so, se = capsys.readouterr()
    assert code == 2 and needle in se and se.count("\n") == 1 and not so, se


def test_cli_prompt_longer_than_the_context(forms, tmp_path):
    import shutil

    path = forms["optimum-cache"][0]
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(path, d / "model.onnx")
    shutil.copy(path.parent / "tokenizer.json", d / "tokenizer.json")
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": 6}))
    code, _, se = run_cli("generate", d / "model.onnx", "--prompt", "the sister of elizabeth and jane bennet")
    assert code == 2 and "at most 6 positions" in se, se
    code, so, se = run_cli("generate", d / "model.onnx", "--prompt", "the sister", "--max-new-tokens", "50")
    assert code == 0 and "4 new tokens, stop: context" in se, se


# --------------------------------------------------------------------------- a long prompt on a real model
@pytest.mark.slow
@pytest.mark.heavy  # ~3.3 min on 2 cores: a rewrite, then a 4k-token prompt prefilled and sampled
@requires_native
def test_smollm2_chat_sampling_4k_prompt_file(tmp_path):
    """SmolLM2 rewritten with the default recipe (fused graph, the GGUF's own blocks; GroupQueryAttention
    made exact PackedAttention where it measures faster): --chat with sampling and a ~4k-token --prompt-file,
    prefilled in chunks of 512 through the shared K/V buffers; the closing line gives prompt and
    decode tok/s, and no onnxruntime error text is printed."""
    from models import corpus, prepare

    d = prepare.prepare("smollm2")
    out = tmp_path / "lean" / "model.onnx"
    code, _, se = run_cli("rewrite", d / "model.onnx", "-o", out, "--quality-budget", "off", "-q")
    assert code == 0, se
    tok = runtime.load_tokenizer(out)
    words = corpus.text(corpus.EVAL_NOVEL).split()
    n = 2900
    while len(tok.encode(" ".join(words[:n]), add_special_tokens=False).ids) < 4000:
        n += 100
    f = tmp_path / "long.txt"
    f.write_text("Summarise this chapter in two sentences.\n\n" + " ".join(words[:n]))
    code, so, se = run_cli("generate", out, "--chat", "--prompt-file", f, "--max-new-tokens", "32",
                           "--temperature", "0.7", "--top-p", "0.9", "--seed", "1")
    assert code == 0, se
    m = SUMMARY.search(se)
    assert m and int(m.group(1).replace(",", "")) >= 4000, se
    assert float(m.group(2)) > 0 and float(m.group(4)) > 0 and so.strip()
    assert "shared loop" in se and "[E:onnxruntime" not in se
    print(se.strip().splitlines()[-1])
