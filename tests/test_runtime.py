"""custom_ops.runtime on tiny hand-built ONNX models (no real model needed, fast).

The toy causal LM is named like an optimum export (input_ids, attention_mask, position_ids,
past_key_values.N.key/value -> logits, present.N.key/value) and its logits depend on the token,
its position and a running sum over the whole KV history, so cached generation only matches a
full recomputation when position_ids and present->past are fed right."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from custom_ops import runtime

V, D, H, HD, L, MAXPOS = 13, 8, 2, 4, 2, 64
WORDS = ["<unk>", "<eos>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "away", "home"]


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "E": rng.standard_normal((V, D)).astype(np.float32),
        "P": (0.3 * rng.standard_normal((MAXPOS, D))).astype(np.float32),
        "W": rng.standard_normal((D, V)).astype(np.float32),
        "U": (0.2 * rng.standard_normal((D, V))).astype(np.float32),
    }


def build_causal(path: Path, seed=0, tokenizer=True) -> Path:
    w = _weights(seed)
    inits = [numpy_helper.from_array(v, k) for k, v in w.items()]
    inits += [
        numpy_helper.from_array(np.array([0, 0, H, HD], np.int64), "kv_shape"),
        numpy_helper.from_array(np.array([0, 0, D], np.int64), "flat_shape"),
        numpy_helper.from_array(np.array(2, np.int64), "axis2"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
        numpy_helper.from_array(np.array([2**62], np.int64), "big"),
        numpy_helper.from_array(np.array([2], np.int64), "ax2"),
    ]
    nodes = [
        helper.make_node("Gather", ["E", "input_ids"], ["tok"], name="/model/embed_tokens/Gather"),
        helper.make_node("Gather", ["P", "position_ids"], ["pos"]),
        helper.make_node("Add", ["tok", "pos"], ["x"]),
        helper.make_node("Reshape", ["x", "kv_shape"], ["x4"]),              # [B,T,H,HD]
        helper.make_node("Transpose", ["x4"], ["new_kv"], perm=[0, 2, 1, 3]),  # [B,H,T,HD]
        helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
        helper.make_node("Slice", ["ids_shape", "one", "ax2"], ["T"]),       # [T]
        helper.make_node("Neg", ["T"], ["negT"]),
    ]
    acc = None
    for l in range(L):
        for kv in ("key", "value"):
            nodes.append(helper.make_node("Concat", [f"past_key_values.{l}.{kv}", "new_kv"],
                                          [f"present.{l}.{kv}"], axis=2))
        nodes.append(helper.make_node("CumSum", [f"present.{l}.key", "axis2"], [f"cum{l}"]))
        if acc is None:
            acc = f"cum{l}"
        else:
            nodes.append(helper.make_node("Add", [acc, f"cum{l}"], [f"acc{l}"]))
            acc = f"acc{l}"
    nodes += [
        helper.make_node("Slice", [acc, "negT", "big", "ax2"], ["cum_last"]),  # [B,H,T,HD]
        helper.make_node("Transpose", ["cum_last"], ["cum_t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["cum_t", "flat_shape"], ["cum_flat"]),
        helper.make_node("MatMul", ["x", "W"], ["l0"], name="/lm_head/MatMul"),
        helper.make_node("MatMul", ["cum_flat", "U"], ["l1"]),
        helper.make_node("Add", ["l0", "l1"], ["logits"]),
    ]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                      ["batch_size", "past_sequence_length + sequence_length"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", V])]
    for l in range(L):
        for kv in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{l}.{kv}", TensorProto.FLOAT,
                                                        ["batch_size", H, "past_sequence_length", HD]))
            outputs.append(helper.make_tensor_value_info(f"present.{l}.{kv}", TensorProto.FLOAT,
                                                         ["batch_size", H, "past_sequence_length + 1", HD]))
    # keep attention_mask consumed (ORT is fine either way; real exports use it)
    nodes.append(helper.make_node("Shape", ["attention_mask"], ["am_shape"]))
    outputs.append(helper.make_tensor_value_info("am_shape", TensorProto.INT64, [2]))
    g = helper.make_graph(nodes, "toy_causal", inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(m)
    onnx.save(m, str(path))
    if tokenizer:
        _save_tokenizer(path.parent / "tokenizer.json")
    return path


def causal_ref_logits(ids: np.ndarray, seed=0) -> np.ndarray:
    """numpy forward of the toy causal LM on one sequence from an empty cache: [T, V]."""
    w = _weights(seed)
    t = ids.size
    x = w["E"][ids] + w["P"][np.arange(t)]
    cum = L * np.cumsum(x, axis=0)  # both layers hold the same keys
    return (x @ w["W"] + cum @ w["U"]).astype(np.float64)


def build_encoder(path: Path, seed=1) -> Path:
    rng = np.random.default_rng(seed)
    E = rng.standard_normal((V, D)).astype(np.float32)
    T = rng.standard_normal((2, D)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["E", "input_ids"], ["a"]),
        helper.make_node("Gather", ["T", "token_type_ids"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["last_hidden_state"]),
        helper.make_node("Shape", ["attention_mask"], ["am_shape"]),
    ]
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch_size", "sequence_length"])
              for n in ("input_ids", "attention_mask", "token_type_ids")]
    outputs = [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch_size", "sequence_length", D]),
               helper.make_tensor_value_info("am_shape", TensorProto.INT64, [2])]
    g = helper.make_graph(nodes, "toy_encoder", inputs, outputs,
                          [numpy_helper.from_array(E, "E"), numpy_helper.from_array(T, "T")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(m)
    onnx.save(m, str(path))
    _save_tokenizer(path.parent / "tokenizer.json", bert=True)
    return path, E, T


def _save_tokenizer(path: Path, bert=False):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w_: i for i, w_ in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bert:  # "[CLS] x [SEP]"-like wrapping with ids 2 ("the") .. keeps the test vocabulary small
        tok.post_processor = processors.TemplateProcessing(single="the $A <eos>", special_tokens=[("the", 2), ("<eos>", 1)])
    tok.save(str(path))


def _sess(path):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    p = build_causal(tmp_path_factory.mktemp("causal") / "model.onnx")
    return p, _sess(p)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    p, E, T = build_encoder(tmp_path_factory.mktemp("enc") / "model.onnx")
    return p, _sess(p), E, T


# ---------------------------------------------------------------------------------------------
def test_modelio_causal(causal):
    p, sess = causal
    for io in (runtime.ModelIO.from_model(p), runtime.ModelIO.from_model(onnx.load(str(p))),
               runtime.ModelIO.from_session(sess)):
        assert io.kind == "causal-lm"
        assert io.num_layers == L and io.kv_heads == H and io.head_dim == HD and io.vocab_size == V
        assert io.has_position_ids and io.has_attention_mask and not io.has_token_type_ids
        assert io.past_to_present == {f"past_key_values.{l}.{kv}": f"present.{l}.{kv}"
                                      for l in range(L) for kv in ("key", "value")}
        assert io.past_inputs[0] == "past_key_values.0.key"
        assert io.logits_name == "logits"


def test_modelio_pairs_by_index_and_custom_state():
    io = runtime.ModelIO.from_signature(
        [("input_ids", ["b", "s"], np.int64),
         ("past_key_values.1.value", ["b", 3, "past_sequence_length", 8], np.float32),
         ("past_key_values.1.key", ["b", 3, "past_sequence_length", 8], np.float32),
         ("past_packed.0", ["b", 3, "past_sequence_length", 2], np.uint8)],
        [("logits", ["b", "s", 100], np.float32),
         ("present.1.key", ["b", 3, "t", 8], np.float32),
         ("present.1.value", ["b", 3, "t", 8], np.float32),
         ("present_packed.0", ["b", 3, "t", 2], np.uint8)])
    assert io.past_to_present["past_key_values.1.key"] == "present.1.key"
    assert io.past_to_present["past_key_values.1.value"] == "present.1.value"
    assert io.past_to_present["past_packed.0"] == "present_packed.0"
    st = io.empty_state(2)
    assert st["past_packed.0"].shape == (2, 3, 0, 2) and st["past_packed.0"].dtype == np.uint8


def test_modelio_encoder(encoder):
    p, sess, *_ = encoder
    for io in (runtime.ModelIO.from_model(p), runtime.ModelIO.from_session(sess)):
        assert io.kind == "encoder"
        assert io.has_token_type_ids and not io.has_past and io.hidden_name == "last_hidden_state"
        assert io.hidden_size == D


def test_feeds(causal, encoder):
    io = runtime.ModelIO.from_session(causal[1])
    f = runtime.feeds(io, np.array([3, 4, 5]))
    assert f["input_ids"].shape == (1, 3) and f["input_ids"].dtype == np.int64
    assert f["attention_mask"].shape == (1, 3)
    assert f["position_ids"].tolist() == [[0, 1, 2]]
    assert f["past_key_values.0.key"].shape == (1, H, 0, HD) and f["past_key_values.0.key"].dtype == np.float32
    assert set(f) == set(io.inputs)
    past = {n: np.zeros((1, H, 5, HD), np.float32) for n in io.past_inputs}
    f = runtime.feeds(io, np.array([[7]]), past)           # past_len read from the states
    assert f["position_ids"].tolist() == [[5]] and f["attention_mask"].shape == (1, 6)
    f = runtime.feeds(io, np.array([[7, 8]]), past, past_len=5)
    assert f["position_ids"].tolist() == [[5, 6]]
    eio = runtime.ModelIO.from_session(encoder[1])
    f = runtime.feeds(eio, np.array([[2, 3], [4, 5]]))
    assert f["token_type_ids"].tolist() == [[0, 0], [0, 0]] and f["attention_mask"].shape == (2, 2)
    bad = runtime.ModelIO.from_signature([("input_ids", ["b", "s"], np.int64), ("mystery", [1], np.float32)],
                                [("logits", ["b", "s", 4], np.float32)])
    with pytest.raises(ValueError, match="mystery"):
        runtime.feeds(bad, np.array([1, 2]))


def test_forward_matches_reference(causal):
    p, sess = causal
    io = runtime.ModelIO.from_session(sess)
    ids = np.array([2, 3, 4, 5, 6, 7, 8])
    got = runtime.run(sess, io, runtime.feeds(io, ids))["logits"][0]
    np.testing.assert_allclose(got, causal_ref_logits(ids), rtol=1e-4, atol=1e-4)


def _ref_ppl(ids, window, stride):
    nll, n, scored_to = 0.0, 0, 1
    for begin in range(0, len(ids) - 1, stride):
        end = min(begin + window, len(ids))
        lg = causal_ref_logits(ids[begin:end])
        lp = lg - lg.max(1, keepdims=True)
        lp = lp - np.log(np.exp(lp).sum(1, keepdims=True))
        for pos in range(max(scored_to, begin + 1), end):
            nll -= lp[pos - begin - 1, ids[pos]]
            n += 1
        scored_to = max(scored_to, end)
        if end >= len(ids):
            break
    return math.exp(nll / n), nll / n, n


@pytest.mark.parametrize("window,stride", [(8, None), (10, 4), (64, None), (7, 7)])
def test_perplexity_matches_numpy(causal, window, stride):
    p, sess = causal
    io = runtime.ModelIO.from_session(sess)
    ids = np.random.default_rng(3).integers(0, V, size=37)
    r = runtime.perplexity(sess, io, ids, window=window, stride=stride)
    ppl, nll, n = _ref_ppl(ids, window, stride or window)
    assert r["tokens"] == n
    assert r["nll"] == pytest.approx(nll, rel=1e-5)
    assert r["ppl"] == pytest.approx(ppl, rel=1e-5)
    if stride is None or stride == window:
        assert n == len(ids) - math.ceil(len(ids) / window)  # first token of each window unscored
    else:
        assert n == len(ids) - 1                             # overlap: every token after the first


def test_perplexity_max_windows(causal):
    p, sess = causal
    io = runtime.ModelIO.from_session(sess)
    ids = np.arange(40) % V
    r = runtime.perplexity(sess, io, ids, window=8, max_windows=2)
    assert r["windows"] == 2 and r["tokens"] == 14


def test_generate_carries_past(causal):
    p, sess = causal
    io = runtime.ModelIO.from_session(sess)
    tok = runtime.load_tokenizer(p)
    prompt = "the cat sat"
    text, ids = runtime.generate(sess, io, tok, prompt, max_new_tokens=10, eos=None)
    # full recomputation without a cache, greedy
    seq = tok.encode(prompt).ids
    ref = []
    for _ in range(10):
        nxt = int(np.argmax(causal_ref_logits(np.array(seq + ref))[-1]))
        ref.append(nxt)
    assert ids == ref
    assert text == tok.decode(ref, skip_special_tokens=True)
    # eos stops generation and is not part of the text
    stop = ref[3]
    text2, ids2 = runtime.generate(sess, io, tok, prompt, max_new_tokens=10, eos=stop)
    assert ids2 == ref[: ref.index(stop) + 1]


def test_load_tokenizer_errors(tmp_path, causal):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        runtime.load_tokenizer(tmp_path / "model.onnx")
    tok = runtime.load_tokenizer(tmp_path / "model.onnx", causal[0].parent / "tokenizer.json")
    assert tok.token_to_id("cat") == 3
    assert runtime.load_tokenizer(None, tok) is tok
    assert runtime.load_tokenizer(causal[0].parent).token_to_id("dog") == 8


def test_embeddings_mean_pool(encoder):
    p, sess, E, T = encoder
    io = runtime.ModelIO.from_session(sess)
    tok = runtime.load_tokenizer(p)
    sents = ["the cat sat on the mat", "a dog ran", "cat"]
    e = runtime.embeddings(sess, io, tok, sents, batch=2)
    assert e.shape == (3, D) and e.dtype == np.float32
    for s, row in zip(sents, e):
        ids = tok.encode(s).ids
        ref = E[ids].mean(0) + T[0]
        ref /= np.linalg.norm(ref)
        np.testing.assert_allclose(row, ref, rtol=1e-5, atol=1e-6)
    e2 = runtime.embeddings(sess, io, tok, sents, max_len=3, normalize=False)
    ids = tok.encode(sents[0]).ids
    np.testing.assert_allclose(e2[0], E[[ids[0], ids[1], ids[-1]]].mean(0) + T[0], rtol=1e-5, atol=1e-6)


def test_sentences_from_text():
    text = ("It was a truth universally acknowledged, that a single man\nin possession of a good "
            "fortune must be in want of a wife. Short one. \"However little known the feelings or "
            "views of such a man may be on his first entering a neighbourhood,\" she said.\n\n"
            "Chapter 2\n\nMr. Bennet was among the earliest of those who waited on Mr. Bingley today.")
    s = runtime.sentences_from_text(text, 10, min_words=6)
    assert len(s) == 3
    assert s[0].startswith("It was a truth") and "\n" not in s[0] and "single man in possession" in s[0]
    assert all(len(x.split()) >= 6 for x in s)
    assert runtime.sentences_from_text(text, 2, min_words=6) == [s[0], s[2]]


def test_bench_sessions(causal, encoder):
    p, sess = causal
    io = runtime.ModelIO.from_session(sess)
    r = runtime.bench_sessions({"dense": sess, "other": _sess(p)}, io, prefill_len=8, decode_past=4,
                              decode_steps=3, repeats=3, warmup=1)
    assert r["baseline"] == "dense" and r["kind"] == "causal-lm"
    for n in ("dense", "other"):
        row = r["sessions"][n]
        assert row["prefill"]["n"] == 3 and row["decode"]["n"] == 9
        assert row["prefill"]["p10_ms"] <= row["prefill"]["median_ms"] <= row["prefill"]["p90_ms"]
        assert row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0
    assert r["ratios"]["dense"] == {"prefill": 1.0, "decode": 1.0}
    assert set(r["ratios"]["other"]) == {"prefill", "decode"}
    ep, esess, *_ = encoder
    eio = runtime.ModelIO.from_session(esess)
    r = runtime.bench_sessions({"a": esess}, eio, prefill_len=8, short_len=2, repeats=2, warmup=0,
                            vocab_size=V)
    assert set(r["sessions"]["a"]) >= {"prefill", "short"} and "decode" not in r["sessions"]["a"]


def test_profile_summary(causal):
    p, sess = causal
    io = runtime.ModelIO.from_session(sess)
    f = runtime.feeds(io, np.arange(10) % V)
    rows = runtime.profile_summary(p, feeds=f, runs=3)
    ops = {r["op_type"]: r for r in rows}
    assert {"MatMul", "Gather", "Concat", "CumSum"} <= set(ops)
    assert ops["MatMul"]["count"] == 2 and ops["MatMul"]["calls"] == 2
    assert ops["Concat"]["count"] == 2 * L
    assert sum(r["pct"] for r in rows) == pytest.approx(100.0, abs=1e-6)
    assert all(r["total_ms"] >= 0 for r in rows) and rows.runs == 3
    assert [r["total_ms"] for r in rows] == sorted((r["total_ms"] for r in rows), reverse=True)
    assert rows.top_nodes and {"name", "op_type", "total_ms", "pct"} <= set(rows.top_nodes[0])
    # a factory in custom_ops.session style: (model, so=...)
    seen = {}

    def factory(model, so=None):
        seen["so"] = so
        return ort.InferenceSession(model, sess_options=so, providers=["CPUExecutionProvider"])

    rows2 = runtime.profile_summary(str(p), factory, lambda s: f, runs=1, warmup=0)
    assert seen["so"].enable_profiling and rows2.runs == 1


def test_decode_profile_plain_loop(causal, encoder):
    """decode_profile on a graph that concatenates its cache: the plain loop (shared KV refused at the
    first step), only the last `steps` runs measured (one call of each node per run), no attention node."""
    p, _ = causal
    rows = runtime.decode_profile(str(p), past=12, steps=3, warmup=2, huge_pages=False)
    ops = {r["op_type"]: r for r in rows}
    assert rows.loop == "plain" and rows.past == 12 and rows.runs == 3
    assert ops["MatMul"]["calls"] == ops["MatMul"]["count"] == 2 and ops["Concat"]["calls"] == 2 * L
    assert rows.attention_ms == 0 and 0 < rows.total_ms <= rows.step_ms
    assert sum(r["pct"] for r in rows) == pytest.approx(100.0, abs=1e-6)
    with pytest.raises(ValueError, match="causal LM"):
        runtime.decode_profile(str(encoder[0]), past=4)


def test_weight_bytes(causal, tmp_path):
    p, _ = causal
    m = onnx.load(str(p))
    expect = sum(numpy_helper.to_array(t).nbytes for t in m.graph.initializer)
    assert runtime.weight_bytes(p) == expect
    ext = tmp_path / "ext.onnx"
    onnx.save_model(m, str(ext), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="ext.onnx.data", size_threshold=0)
    assert (tmp_path / "ext.onnx.data").is_file()
    assert runtime.weight_bytes(ext) == expect
    assert runtime.ModelIO.from_model(ext).kind == "causal-lm"


def _matmul_model(path: Path, K=64, N=48):
    rng = np.random.default_rng(0)
    Wt = rng.standard_normal((K, N)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="/mlp/up_proj/MatMul")], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", N])],
        [numpy_helper.from_array(Wt, "W")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), str(path))
    return Wt


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_matmul_nbits(tmp_path, bits):
    src = tmp_path / "mm.onnx"
    Wt = _matmul_model(src)
    out = runtime.quantize_matmul_nbits(src, bits, tmp_path / f"mm.int{bits}.onnx", block_size=32)
    m = onnx.load(str(out))
    assert [n.op_type for n in m.graph.node] == ["MatMulNBits"]
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    y = _sess(out).run(None, {"x": x})[0]
    ref = x @ Wt
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert rel < (0.2 if bits == 4 else 0.03)
    assert runtime.weight_bytes(out) < runtime.weight_bytes(src) * (0.3 if bits == 4 else 0.45)


def test_huge_zeros_buffers():
    """runtime.memory.huge_zeros_many with one array: zeroed, C-contiguous, the shape and dtype asked
    for, 2 MiB-aligned when large (the mapping outlives the function that made it), ordinary np.zeros
    when small; an OrtValue over it reads and writes the same memory (SharedKV binds past and present
    to it)."""
    import gc

    from custom_ops.runtime.memory import huge_zeros_many, thp_mode

    [small] = huge_zeros_many([((3, 5), np.float16)])
    assert small.shape == (3, 5) and small.dtype == np.float16 and not small.any()
    [big] = huge_zeros_many([((1, 3, 8193, 34), np.int32)])
    gc.collect()
    assert big.shape == (1, 3, 8193, 34) and big.dtype == np.int32 and big.flags.c_contiguous
    assert not big.any()
    if thp_mode() in ("always", "madvise"):
        assert big.ctypes.data % (2 << 20) == 0
    big[0, 2, -1, -1] = 7
    ov = ort.OrtValue.ortvalue_from_numpy(big)
    assert ov.numpy()[0, 2, -1, -1] == 7 and int(ov.numpy().sum()) == 7
    assert thp_mode() in ("always", "madvise", "never", "?")


def test_huge_pages_for_process_collapses_resident_memory_only():
    """runtime.memory.huge_pages_for_process: a resident 10 MiB anonymous buffer on 4 KiB pages ends on
    2 MiB pages with its contents unchanged; a mapping with one page touched is left alone (not
    populated); a second call does not take the collapsed buffer again (the rest of the process, e.g.
    the test run's heap, may have grown or have failed to collapse the first time: not compared)."""
    import ctypes
    import mmap

    from custom_ops.runtime import memory

    mib = 1 << 20
    # one mapping cut into separate areas by read-only guards (adjacent anonymous mappings of the same
    # protection would merge into one): guard | dense 10 MiB | guard | sparse 16 MiB | guard
    region = mmap.mmap(-1, 32 * mib, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(region, dtype=np.uint8)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for off in (0, 12 * mib, 30 * mib):
        assert libc.mprotect(raw.ctypes.data + off, 2 * mib, mmap.PROT_READ) == 0
    d = raw[2 * mib:12 * mib].view(np.uint32)
    d[:] = (np.arange(d.size, dtype=np.uint64) * 2654435761 % (1 << 32)).astype(np.uint32)
    want = d.copy()
    sp = raw[14 * mib:30 * mib]
    sp[5 * mib] = 1

    def info(buf):
        a = buf.ctypes.data
        return next((rss, huge) for lo, hi, rss, huge in memory._anon_mappings() if lo <= a < hi)

    first = []
    n = memory.huge_pages_for_process(ranges=first)
    assert n >= 0 and n == sum(b - a for a, b in first)
    np.testing.assert_array_equal(d, want)
    assert info(sp)[0] < 4 * mib  # one page touched: not populated by a collapse
    if memory.thp_mode() in ("always", "madvise") and n > 0:
        assert info(d)[1] >= 8 * mib  # the 2 MiB pages inside the 10 MiB
        a = d.ctypes.data + 4 * mib  # inside the aligned part (MADV_HUGEPAGE splits it from the ends)
        assert any(lo <= a < hi for lo, hi in first)
        again = []
        memory.huge_pages_for_process(ranges=again)
        assert not any(lo <= a < hi for lo, hi in again)
    del d, sp, want, raw
    region.close()


def test_huge_pages_for_process_skips_a_mapping_whose_4k_pages_are_its_ends():
    """A mapping already on 2 MiB pages except its unaligned ends (more than 2 MiB of 4 KiB pages there,
    which no collapse can move) is not taken again by huge_pages_for_process."""
    import ctypes
    import mmap

    from custom_ops.runtime import memory

    if memory.thp_mode() not in ("always", "madvise"):
        pytest.skip("transparent huge pages off")
    mib, half = 1 << 20, 1 << 19
    region = mmap.mmap(-1, 24 * mib, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(region, dtype=np.uint8)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mprotect.argtypes = libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    base = raw.ctypes.data
    o = (base + 4 * mib - 1) // (2 * mib) * (2 * mib) - base  # 2 MiB-aligned, 2 .. 4 MiB into the region
    # guard | 1.5 MiB | 10 aligned MiB | 1.5 MiB | guard, the whole area MADV_HUGEPAGE before it is
    # touched (one VMA: its 2 MiB faults take huge pages, its ends 4 KiB ones)
    lo, hi = o - 3 * half, o + 23 * half
    for off in (lo - half, hi):
        assert libc.mprotect(base + off, half, mmap.PROT_READ) == 0
    assert libc.madvise(base + lo, hi - lo, memory._MADV_HUGEPAGE) == 0
    raw[lo:hi] = 3
    m = next(x for x in memory._anon_mappings() if x[0] <= base + o < x[1])
    if m[0] != base + lo or m[1] != base + hi or m[3] < 10 * mib:
        pytest.skip("the kernel did not fault the area's aligned part in huge pages")
    assert m[2] - m[3] >= 2 * mib  # its 4 KiB pages: the two 1.5 MiB ends
    taken = []
    memory.huge_pages_for_process(ranges=taken)
    assert not any(a <= base + o < b for a, b in taken)
    assert int(raw[lo:hi].sum()) == 3 * (hi - lo)
    del raw
    region.close()


def test_huge_zeros_many_carves_one_mapping():
    """huge_zeros_many: arrays of the shapes and dtypes asked for, zeroed, 4 KiB-aligned and not
    overlapping (writing one leaves the others zero), from one 2 MiB-aligned mapping when THP is on;
    SharedKV-style OrtValues over them see the writes."""
    from custom_ops.runtime.memory import huge_zeros_many, thp_mode

    specs = [((1, 3, 4200, 34), np.int32), ((1, 3, 4200, 3), np.int32), ((2, 5), np.float32), ((0, 4), np.int8)] * 2
    arrs = huge_zeros_many(specs)
    assert [(a.shape, a.dtype) for a in arrs] == [(tuple(s), np.dtype(d)) for s, d in specs]
    for i, a in enumerate(arrs):
        assert a.flags.c_contiguous and not a.any()
        if a.size:
            a.reshape(-1)[-1] = i + 1
    assert [int(a.sum()) for a in arrs] == [i + 1 if a.size else 0 for i, a in enumerate(arrs)]
    if thp_mode() in ("always", "madvise"):
        assert arrs[0].ctypes.data % (2 << 20) == 0 and all(a.ctypes.data % 4096 == 0 for a in arrs if a.size)
    ov = ort.OrtValue.ortvalue_from_numpy(arrs[4])
    arrs[4][0, 0, 0, 0] = 9
    assert ov.numpy()[0, 0, 0, 0] == 9
