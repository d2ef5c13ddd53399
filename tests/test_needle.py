"""`ortlean eval --task needle` (issue 58, item 5): retrieval cases on prose, scored against a reference.

Case construction (exact token length, needles at the sentence boundary nearest the depth, determinism
by seed, one occurrence of a single needle's answer, distinct distractors), the hit rule and the
comparison on fake results, then end to end on an *oracle* decoder built here: a hand-made graph with
an optimum-style KV cache whose one attention head matches the last four tokens against every earlier
position's four preceding tokens and copies the token that followed — induction by construction, so
it finds every needle (a random tiny model finds none). Its twin attending only to the last WINDOW
tokens (a sparse attention that drops old keys) loses the deep needles the full one finds. The same
cases through PackedAttention's shared K/V buffers (exact cache mode) and through the growing cache
give the same tokens and log-probabilities (the rewind after a miss included). The real SmolLM2 finds pass keys at
2k tokens (heavy)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from custom_ops import runtime  # noqa: E402
from custom_ops.runtime import needle  # noqa: E402
from custom_ops.runtime.generate import Decoder  # noqa: E402
from custom_ops.runtime.needle import CaseResult  # noqa: E402

from conftest import requires_native  # noqa: E402

PROSE = ("she he it her his they we you was had not been would could should might very much more little good great "
         "time day house family father mother sister friend letter walk room morning evening thought felt said knew "
         "saw made found gave heard told long short young old happy quiet cold warm early late last first").split()
TEMPLATE = ("there are important facts hidden in the text below remember them you will be asked about one of at end "
            "the pass key is what value for door a").split()
WORDS = list(dict.fromkeys(PROSE + TEMPLATE + list(needle.KEYS) + list(needle.DOORS)))
PUNCT = [".", "?", ":", ",", ";", "!"]
DIGITS = [str(i) for i in range(10)]
WINDOW = 48


def prose(n_sentences: int = 400, seed: int = 3) -> str:
    """Sentences of 6-16 prose words, capitalized, in paragraphs of 5 (a novel's shape, our vocabulary)."""
    rng = np.random.default_rng(seed)
    paras, sents = [], []
    for i in range(n_sentences):
        w = [PROSE[j] for j in rng.integers(len(PROSE), size=int(rng.integers(6, 17)))]
        sents.append(" ".join([w[0].capitalize(), *w[1:]]) + rng.choice([".", ".", ".", "!", "?"]))
        if len(sents) == 5:
            paras.append(" ".join(sents))
            sents = []
    return "\n\n".join(paras + ([" ".join(sents)] if sents else []))


def write_tokenizer(path: Path) -> int:
    """Word level, lower-cased, digits one token each, punctuation its own token; decoding fuses the
    tokens (no spaces: "4 8 2 1 3" reads "48213"). Returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {"[UNK]": 0, "[PAD]": 1}
    for w in WORDS + PUNCT + DIGITS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.decoder = decoders.Fuse()
    tok.save(str(path))
    return len(vocab)


def oracle(path: Path, V: int, n: int = 4, window: int | None = None, positions: int | None = None) -> Path:
    """The induction oracle (module docstring) with optimum's cache I/O: layer 0's cache holds each
    token's one-hot, layer 1's key is the one-hots of the n tokens before a position and its value the
    position's own; a query (the last n tokens' one-hots) scores n where all n match, so softmax(10·s)
    takes the token after the latest full match. ``window``: only the last ``window`` keys are seen."""
    N = helper.make_node
    inits = []

    def const(name, a):
        inits.append(numpy_helper.from_array(np.asarray(a), name))
        return name

    const("E", np.eye(V, dtype=np.float32))
    const("ax1", np.array([1], np.int64))
    const("ax0", np.array([0], np.int64))
    const("ax2", np.array([2], np.int64))
    const("pads", np.array([0, 0, n, 0, 0, 0, 0, 0], np.int64))
    const("beta", np.array(10.0, np.float32))
    const("gain", np.array(20.0, np.float32))
    const("zero_f", np.array(0.0, np.float32))
    const("neg", np.array(-1e9, np.float32))
    const("zero_i", np.array(0, np.int64))
    const("one_i", np.array(1, np.int64))
    for j in range(n + 1):
        const(f"c{j}", np.array([j], np.int64))
    nodes = [N("Gather", ["E", "input_ids"], ["oh"]), N("Unsqueeze", ["oh", "ax1"], ["oh4"]),
             N("Concat", ["past_key_values.0.key", "oh4"], ["present.0.key"], axis=2),
             N("Concat", ["past_key_values.0.value", "oh4"], ["present.0.value"], axis=2),
             N("Pad", ["present.0.key", "pads"], ["padded"]),
             N("Shape", ["present.0.key"], ["T1"], start=2, end=3),
             N("Shape", ["input_ids"], ["S1"], start=1, end=2),
             N("Sub", ["T1", "S1"], ["P1"])]
    for j in range(n + 1):   # sl_j: the one-hot of x_{i-j} for every new position i
        nodes += [N("Add", ["P1", f"c{n - j}"], [f"st{j}"]), N("Add", ["T1", f"c{n - j}"], [f"en{j}"]),
                  N("Slice", ["padded", f"st{j}", f"en{j}", "ax2"], [f"sl{j}"])]
    nodes += [N("Concat", [f"sl{j}" for j in range(1, n + 1)], ["kcur"], axis=3),
              N("Concat", [f"sl{j}" for j in range(n)], ["q"], axis=3),
              N("Concat", ["past_key_values.1.key", "kcur"], ["present.1.key"], axis=2),
              N("Concat", ["past_key_values.1.value", "sl0"], ["present.1.value"], axis=2),
              N("Transpose", ["present.1.key"], ["kt"], perm=[0, 1, 3, 2]),
              N("MatMul", ["q", "kt"], ["sc"]), N("Mul", ["sc", "beta"], ["scb"]),
              # causal mask (and the window): key t is seen by row s (absolute P + s) when t <= P + s
              N("Squeeze", ["P1", "ax0"], ["P0"]), N("Squeeze", ["T1", "ax0"], ["T0"]),
              N("Range", ["P0", "T0", "one_i"], ["rows"]), N("Range", ["zero_i", "T0", "one_i"], ["cols"]),
              N("Unsqueeze", ["rows", "ax1"], ["rows2"]), N("Unsqueeze", ["cols", "ax0"], ["cols2"]),
              N("LessOrEqual", ["cols2", "rows2"], ["seen"])]
    if window is not None:
        const("win", np.array(window, np.int64))
        nodes += [N("Sub", ["rows2", "win"], ["lo"]), N("Greater", ["cols2", "lo"], ["inwin"]),
                  N("And", ["seen", "inwin"], ["seen_w"])]
    nodes += [N("Where", ["seen_w" if window is not None else "seen", "zero_f", "neg"], ["mask"]),
              N("Add", ["scb", "mask"], ["scm"]), N("Softmax", ["scm"], ["pr"], axis=-1),
              N("MatMul", ["pr", "present.1.value"], ["att"]), N("Squeeze", ["att", "ax1"], ["att3"]),
              N("Mul", ["att3", "gain"], ["logits"])]
    f = TensorProto.FLOAT
    ins = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
           helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"])]
    outs = [helper.make_tensor_value_info("logits", f, ["batch_size", "sequence_length", V])]
    for layer, (dk, dv) in enumerate(((V, V), (n * V, V))):
        for x, d in (("key", dk), ("value", dv)):
            ins.append(helper.make_tensor_value_info(f"past_key_values.{layer}.{x}", f,
                                                     ["batch_size", 1, "past_sequence_length", d]))
            outs.append(helper.make_tensor_value_info(f"present.{layer}.{x}", f,
                                                      ["batch_size", 1, "total_sequence_length", d]))
    m = helper.make_model(helper.make_graph(nodes, "needle_oracle", ins, outs, initializer=inits),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.checker.check_model(m)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(m, str(path))
    write_tokenizer(path.parent / "tokenizer.json")
    if positions:
        (path.parent / "config.json").write_text(json.dumps({"max_position_embeddings": positions}))
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tokenizers import Tokenizer

    p = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    write_tokenizer(p)
    return Tokenizer.from_file(str(p))


@pytest.fixture(scope="module")
def text() -> str:
    return prose()


@pytest.fixture(scope="module")
def hay(tok, text):
    return needle.Haystack(tok, text)


@pytest.fixture(scope="module")
def oracles(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("oracle")
    V = tok.get_vocab_size()
    full = oracle(d / "full" / "model.onnx", V, positions=1024)
    win = oracle(d / "window" / "model.onnx", V, window=WINDOW, positions=1024)
    (d / "prose.txt").write_text(prose())
    return {"full": full, "window": win, "text": d / "prose.txt"}


def session(path):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    s = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return s, runtime.ModelIO.from_session(s, path)


# --------------------------------------------------------------------------- cases
def test_sentence_boundaries(hay, text):
    assert hay.bounds.size > 300
    for b in hay.bounds[:50]:
        before = text[:hay.starts[b]].rstrip()
        assert before[-1] in ".!?", before[-20:]
        assert text[hay.starts[b]:].lstrip()[0].isupper()


@pytest.mark.parametrize("kind", needle.KINDS)
@pytest.mark.parametrize("length", [200, 333, 512])
def test_exact_length_and_depth(hay, tok, kind, length):
    for depth in (0.0, 0.1, 0.5, 0.9, 1.0):
        c = needle.make_case(hay, kind, length, depth, index=0, seed=7)
        assert len(c.ids) + c.new_tokens == length
        asked = [f for f in c.facts if f.asked]
        assert len(asked) == 1 and asked[0].answer == c.answer
        start, end = c.haystack
        H = end - start
        inner = hay.bounds[(hay.bounds > start) & (hay.bounds < end)] - start
        points = np.concatenate([[0], inner, [H]])
        at = round(asked[0].depth * H)
        assert at in points                                  # at a sentence boundary
        below, above = points[points <= depth * H].max(), points[points >= depth * H].min()
        assert at in (below, above)                          # the one just before or after the depth (±1 sentence)
        # the needle's text really is at its position, and the prompt ends with the cue
        n_ids = tok.encode(" " + asked[0].text if kind != "kv" else " " + asked[0].text, add_special_tokens=False).ids
        if kind != "kv":
            assert c.ids[asked[0].position:asked[0].position + len(n_ids)] == n_ids
        q = tok.encode("\n\n" + c.cue, add_special_tokens=False).ids
        assert c.ids[-len(q):] == q


def test_deterministic_by_seed(hay):
    a = needle.make_cases(None, hay, [256, 400], [0.2, 0.8], needle.KINDS, cases=2, seed=5)
    b = needle.make_cases(None, hay, [256, 400], [0.2, 0.8], needle.KINDS, cases=2, seed=5)
    c = needle.make_cases(None, hay, [256, 400], [0.2, 0.8], needle.KINDS, cases=2, seed=6)
    assert [x.ids for x in a] == [x.ids for x in b]
    assert [x.ids for x in a] != [x.ids for x in c]
    assert len({tuple(x.ids) for x in a}) == len(a)          # every case its own
    # a case does not depend on the other cells asked for
    one = needle.make_cases(None, hay, [400], [0.8], ["multi"], cases=2, seed=5)
    assert [x.ids for x in one] == [x.ids for x in a if x.kind == "multi" and x.length == 400 and x.depth == 0.8]


def test_answers_once_and_distractors_differ(hay, tok):
    """Each fact's needle is in the prompt once, its number nowhere else (the haystack never holds it);
    numbers and keys differ within a case; the answer's tokens decode to the answer."""
    for seed in range(6):
        for c in needle.make_cases(None, hay, [300], [0.1, 0.5, 0.9], needle.KINDS, seed=seed):
            answers = [f.answer for f in c.facts]
            assert len(set(answers)) == len(answers)                 # numbers distinct within a case
            assert len({f.key for f in c.facts}) == len(c.facts)     # keys / doors distinct
            assert c.needles == {"passkey": 1, "kv": needle.KV_PAIRS, "multi": needle.MULTI_NEEDLES}[c.kind]
            words = tok.decode(c.ids)
            for f in c.facts:
                needle_words = tok.decode(tok.encode(" " + f.text, add_special_tokens=False).ids)
                assert words.count(needle_words) == 1, (c.kind, f.text)
                assert words.replace(needle_words, " ").count(f.answer) == 0, (c.kind, f.answer)
            if c.kind == "multi":
                assert len({f.position for f in c.facts}) == len(c.facts)
                assert all(abs(f.depth - c.depth) >= 0.05 for f in c.facts if not f.asked)
            assert tok.decode(c.answer_ids) == c.answer


@pytest.mark.parametrize("kw,param", [
    (dict(lengths=[64]), "lengths"), (dict(lengths=[2048], positions=1024), "lengths"),
    (dict(lengths=[5000]), "text"), (dict(depths=[1.5]), "depths"), (dict(depths=[-0.1]), "depths"),
    (dict(depths=[float("nan")]), "depths"), (dict(kinds=""), "kinds"), (dict(kinds="passkey,nope"), "kinds"),
    (dict(kinds=[]), "kinds"), (dict(cases=0), "cases"), (dict(seed=-1), "seed")])
def test_bad_values(hay, kw, param):
    args = dict(lengths=[256], depths=[0.5], kinds="passkey", cases=1)
    args.update(kw)
    with pytest.raises(needle.NeedleError) as e:
        needle.make_cases(None, hay, **args)
    assert e.value.param == param


# --------------------------------------------------------------------------- scoring
def test_hit_rule():
    assert needle.is_hit(" 48213.", "48213")
    assert needle.is_hit("48213", "48213")
    assert needle.is_hit(": 48213, I think", "48213")
    assert needle.is_hit(" is 48213", "48213")
    assert not needle.is_hit(" 482130", "48213")
    assert not needle.is_hit(" 4821", "48213")
    assert not needle.is_hit(" 12345 or 48213", "48213")
    assert not needle.is_hit(" the pass key", "48213")


def _r(kind, depth, hit, index=0, lp=-1.0):
    return CaseResult(kind, 1024, depth, 1, index, "11111", hit, " 11111" if hit else " no", lp)


def test_compare_counts_lost_and_gained():
    ref = [_r("passkey", 0.1, True), _r("passkey", 0.5, True), _r("passkey", 0.9, False), _r("kv", 0.1, True)]
    mod = [_r("passkey", 0.1, True), _r("passkey", 0.5, False), _r("passkey", 0.9, True), _r("kv", 0.1, False)]
    res = needle.compare(mod, ref)
    assert res["summary"] == {"cases": 4, "hits": 2, "ref_hits": 3, "lost": 2, "gained": 1}
    assert [(r["kind"], r["depth"]) for r in res["lost"]] == [("passkey", 0.5), ("kv", 0.1)]
    cell = next(c for c in res["cells"] if c["kind"] == "passkey" and c["depth"] == 0.5)
    assert (cell["cases"], cell["hits"], cell["ref_hits"], cell["lost"]) == (1, 0, 1, 1)
    table = needle.format_table(res)
    assert "lost: passkey 1,024 depth 0.5" in table and "lost: kv 1,024 depth 0.1" in table
    assert "1/1" in table and "0/1" in table
    same = needle.compare(ref, ref)
    assert same["summary"]["lost"] == 0 and same["lost"] == []
    alone = needle.compare(mod)
    assert alone["summary"] == {"cases": 4, "hits": 2}
    assert "model 2/4 hits" in needle.format_table(alone)


# --------------------------------------------------------------------------- end to end
def test_oracle_finds_every_needle_and_window_loses_the_deep_ones(oracles, tok, hay):
    cases = needle.make_cases(tok, hay, [320], [0.0, 0.5, 1.0], needle.KINDS, seed=1)
    s_full, io_full = session(oracles["full"])
    s_win, io_win = session(oracles["window"])
    ref = needle.run_cases(s_full, io_full, tok, cases, model_path=oracles["full"])
    assert all(r.hit for r in ref), [(r.name, r.text) for r in ref if not r.hit]
    assert all(r.logprob > -1.0 for r in ref)       # (a context two numbers share splits the odds)
    same = needle.compare(needle.run_cases(s_full, io_full, tok, cases, model_path=oracles["full"]), ref)
    assert same["summary"]["lost"] == 0 and same["summary"]["hits"] == len(cases)
    res = needle.compare(needle.run_cases(s_win, io_win, tok, cases, model_path=oracles["window"]), ref)
    lost = {(r["kind"], r["depth"]) for r in res["lost"]}
    # every needle deeper than the window is lost; the last one (depth 1, just before the cue) is kept
    # (a multi case's distractors elsewhere do not matter: the asked one is at the depth)
    assert {(k, 0.0) for k in needle.KINDS} <= lost and {(k, 0.5) for k in needle.KINDS} <= lost
    assert not any(d == 1.0 for _, d in lost)
    # the answer's log-probability is a graded signal: far lower where the needle is lost
    lp = {(r["kind"], r["depth"]): r["logprob"] for r in res["cases"]}
    assert lp[("passkey", 0.0)] < -5 and lp[("passkey", 1.0)] > -0.01


def test_suite_api(oracles, tok, hay):
    suite = needle.NeedleSuite.build(tok, hay, lengths=[256], depths=[0.1, 1.0], kinds="passkey,kv", positions=1024)
    s_full, io_full = session(oracles["full"])
    s_win, io_win = session(oracles["window"])
    suite.prepare(s_full, io_full, model_path=oracles["full"])
    assert len(suite.found) == 4
    assert suite.lost(s_full, io_full, model_path=oracles["full"]) == []
    lost = suite.lost(s_win, io_win, model_path=oracles["window"])
    assert {(r.kind, r.depth) for r in lost} == {("passkey", 0.1), ("kv", 0.1)}
    first = suite.lost(s_win, io_win, model_path=oracles["window"], fail_fast=True)
    assert len(first) == 1 and (first[0].kind, first[0].depth) == ("passkey", 0.1)
    assert needle.lost(s_win, io_win, s_full, io_full, tok, suite.cases) == lost


def test_rewind_after_a_miss_matches_a_fresh_run(oracles, tok, hay):
    """A miss teacher-forces the answer after rewinding to the prompt's end: the same log-probability
    as a decoder that feeds the answer straight after the prompt."""
    s, io = session(oracles["window"])
    c = needle.make_case(hay, "passkey", 256, 0.1, seed=2)
    dec = Decoder(s, io, max_len=256, model_path=oracles["window"])
    r = needle.run_case(dec, tok, c)
    assert not r.hit
    dec2 = Decoder(s, io, max_len=256, model_path=oracles["window"])
    logits = dec2.feed(c.ids)
    want = 0.0
    for j, t in enumerate(c.answer_ids):
        z = logits.astype(np.float64)
        want += z[t] - z.max() - np.log(np.exp(z - z.max()).sum())
        if j + 1 < len(c.answer_ids):
            logits = dec2.feed([t])
    assert r.logprob == pytest.approx(want, abs=1e-4)


@requires_native
def test_shared_buffers_and_growing_cache_agree(tmp_path, tok, hay):
    """The tiny optimum llama (growing cache) and its fusion with PackedAttention's exact fp32 cache
    (shared K/V buffers, the long-context recipe's op): the same greedy tokens and answer
    log-probabilities (random weights: every case a miss, so the rewind runs on the shared buffers)."""
    import custom_ops
    import tiny_hf
    from test_rewriter import run_cli

    src = tiny_hf.models()["llama"] / "model.onnx"
    fused = tmp_path / "packed" / "model.onnx"
    code, _, err = run_cli("rewrite", src, "-o", fused, "-q", "--fuse", "on", "--attn-exact", "on")
    assert code == 0, err
    assert "PackedAttention" in {n.op_type for n in onnx.load(str(fused), load_external_data=False).graph.node}
    cases = needle.make_cases(tok, hay, [300], [0.2, 0.8], "passkey,multi", seed=3)
    out = {}
    for name, p in (("growing", src), ("shared", fused)):
        s = custom_ops.session(str(p), threads=1)
        io = runtime.ModelIO.from_session(s, p)
        dec = Decoder(s, io, max_len=300, model_path=p)
        assert dec.loop == name
        out[name] = needle.run_cases(s, io, tok, cases, model_path=p, prefill_chunk=128)
    for a, b in zip(out["growing"], out["shared"]):
        assert a.tokens == b.tokens
        assert a.logprob == pytest.approx(b.logprob, abs=2e-3)


# --------------------------------------------------------------------------- the CLI
def test_cli_table_and_json(oracles, tmp_path, capsys):
    from rewriter import cli

    out = tmp_path / "needle.json"
    argv = ["eval", oracles["window"], "--ref", oracles["full"], "--text", oracles["text"], "--task", "needle",
            "--lengths", "200,320", "--depths", "0,0.5,1", "--needle-kinds", "passkey,multi", "--cases", "1",
            "--json", out]
    capsys.readouterr()
    assert cli.main([str(a) for a in argv]) == 0
    printed = capsys.readouterr().out
    assert "passkey (1 needle)" in printed and "multi (3 needles)" in printed
    assert "lost: passkey 320 depth 0 #0" in printed
    doc = json.loads(out.read_text())
    assert doc["task"] == "needle" and doc["schema"] == "ortlean-results/1"
    assert {"commit", "date", "machine", "command"} <= set(doc)
    assert doc["lengths"] == [200, 320] and doc["depths"] == [0.0, 0.5, 1.0] and doc["kinds"] == ["passkey", "multi"]
    assert len(doc["cells"]) == 2 * 3 * 2 and doc["summary"]["lost"] == len(doc["lost"]) > 0
    assert all(c["ref_hits"] == c["cases"] == 1 for c in doc["cells"])
    # the same model as model and reference: nothing lost (run once)
    capsys.readouterr()
    assert cli.main([str(a) for a in ["eval", oracles["full"], "--ref", oracles["full"], "--text", oracles["text"],
                                      "--task", "needle", "--lengths", "200", "--depths", "0,0.5,1"]]) == 0
    assert "lost: 0 needles" in capsys.readouterr().out


def test_cli_needle_cache_reuses_each_models_results(oracles, tmp_path, capsys):
    """--needle-cache DIR: a model's case results are kept by a stamp of its files and the cases and
    reused under it (the same table and JSON cells); other cases or a changed file run again."""
    from rewriter import cli

    cache = tmp_path / "nc"
    base = ["eval", oracles["window"], "--ref", oracles["full"], "--text", oracles["text"], "--task", "needle",
            "--lengths", "200", "--depths", "0,1", "--needle-kinds", "passkey", "--needle-cache", cache]
    docs = []
    for i in range(2):
        capsys.readouterr()
        assert cli.main([str(a) for a in base + ["--json", tmp_path / f"n{i}.json"]]) == 0
        err = capsys.readouterr().err
        assert err.count("results reused") == (0 if i == 0 else 2), err
        docs.append(json.loads((tmp_path / f"n{i}.json").read_text()))
    assert docs[0]["cells"] == docs[1]["cells"] and docs[0]["cases"] == docs[1]["cases"]
    assert len(list(cache.glob("*.json"))) == 2
    # other cases (another seed): both models run again
    assert cli.main([str(a) for a in base + ["--seed", "3"]]) == 0
    assert "results reused" not in capsys.readouterr().err
    # with --task ppl the flag is refused, naming it
    rc = cli.main([str(a) for a in ["eval", oracles["window"], "--ref", oracles["full"], "--text", oracles["text"],
                                    "--needle-cache", cache]])
    assert rc == 2 and "--needle-cache" in capsys.readouterr().err


def test_cli_progress_lines_in_a_log(oracles, capsys, monkeypatch):
    """stderr not a terminal: each model's cases give plain progress lines (at least every
    ORTLEAN_PROGRESS_SECONDS, 15 s by default) naming the model and the case it is on; --quiet: none."""
    from rewriter import cli

    monkeypatch.setenv("ORTLEAN_PROGRESS_SECONDS", "0.01")
    base = ["eval", oracles["window"], "--ref", oracles["full"], "--text", oracles["text"], "--task", "needle",
            "--lengths", "200,320", "--depths", "0,1", "--needle-kinds", "passkey"]
    capsys.readouterr()
    assert cli.main([str(a) for a in base]) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[ortlean] needle, ")]
    assert lines, "no progress line"
    assert {Path(oracles["window"]).name, Path(oracles["full"]).name} <= {x.split(":")[0].split("/")[-1] for x in lines}
    assert any(" cases, " in x and "passkey" in x and "depth" in x for x in lines), lines
    assert cli.main([str(a) for a in base + ["--quiet"]]) == 0
    assert "[ortlean] needle" not in capsys.readouterr().err


@pytest.mark.parametrize("flags,names", [
    (["--lengths", "2048"], ["--lengths", "2048", "1,024 positions"]),
    (["--lengths", "100000"], ["--lengths", "100000"]),
    (["--depths", "0.5,2"], ["--depths", "2"]),
    (["--needle-kinds", "passkey,haystack"], ["--needle-kinds", "haystack"]),
    (["--lengths", "40"], ["--lengths", "40", "too short"]),
])
def test_cli_bad_values(oracles, capsys, flags, names):
    from rewriter import cli

    capsys.readouterr()
    rc = cli.main([str(a) for a in ["eval", oracles["window"], "--ref", oracles["full"], "--text", oracles["text"],
                                    "--task", "needle", *flags]])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert all(n in err[0] for n in names), err


# --------------------------------------------------------------------------- the real model
@pytest.mark.slow
@pytest.mark.heavy  # ~35 s on 2 cores: five 2k-token prompts of SmolLM2-135M
def test_smollm2_finds_pass_keys_at_2k():
    from models import corpus, prepare
    from rewriter.evaluate import generator_session

    path = prepare.prepare("smollm2") / "model.onnx"
    tok = runtime.load_tokenizer(path)
    cases = needle.make_cases(tok, corpus.text(corpus.EVAL_NOVEL), [2048], needle.DEPTHS, "passkey", seed=0,
                              positions=8192)
    sess = generator_session(str(path), 2)
    res = needle.run_cases(sess, runtime.ModelIO.from_session(sess, path), tok, cases, model_path=path)
    assert sum(r.hit for r in res) >= 4, [(r.name, r.text) for r in res]
