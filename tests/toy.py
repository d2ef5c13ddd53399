"""A small Llama-shaped causal LM built by hand (named like optimum exports), with a word-level
tokenizer.json next to it: exercises classification, calibration and rewriting without a real
model. Weights have a decaying spectrum so low-rank factors can meet a gap. `build` has no KV
cache; `cached` is the same decoder with optimum's cache I/O and attention core (what
PackedAttention matches)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

WORDS = ("the a of and to in was her she he it that had not be with for as his you on at "
         "but by is my all mr so have which were could would said there they elizabeth darcy "
         "jane bennet mrs sister very much more one when what been no this will from").split()


def _lowrank(rng, K, N, decay=0.08):
    U = np.linalg.qr(rng.standard_normal((K, K)))[0]
    V = np.linalg.qr(rng.standard_normal((N, N)))[0]
    r = min(K, N)
    s = np.exp(-decay * np.arange(r))
    return ((U[:, :r] * s) @ V[:, :r].T).astype(np.float32)


def build(path: Path, D: int = 48, F: int = 96, L: int = 2, V: int | None = None, seed: int = 0,
          tokenizer: bool = True) -> Path:
    rng = np.random.default_rng(seed)
    V = V or (len(WORDS) + 2)
    inits, nodes = [], []

    def W(name, K, N):
        inits.append(numpy_helper.from_array(_lowrank(rng, K, N), name))
        return name

    E = (rng.standard_normal((V, D)) * 0.5).astype(np.float32)
    inits.append(numpy_helper.from_array(E, "model.embed_tokens.weight"))
    inits.append(numpy_helper.from_array(np.array(1.0 / np.sqrt(D), np.float32), "scale"))
    nodes.append(helper.make_node("Gather", ["model.embed_tokens.weight", "input_ids"], ["h0"], name="/model/embed_tokens/Gather"))
    h = "h0"
    for l in range(L):
        p = f"/model/layers.{l}"
        for nm in ("q", "k", "v"):
            nodes.append(helper.make_node("MatMul", [h, W(f"onnx::MatMul_{l}{nm}", D, D)], [f"{p}/{nm}"], name=f"{p}/self_attn/{nm}_proj/MatMul"))
        nodes.append(helper.make_node("Transpose", [f"{p}/k"], [f"{p}/kt"], perm=[0, 2, 1], name=f"{p}/self_attn/Transpose"))
        nodes.append(helper.make_node("MatMul", [f"{p}/q", f"{p}/kt"], [f"{p}/s"], name=f"{p}/self_attn/MatMul"))
        nodes.append(helper.make_node("Mul", [f"{p}/s", "scale"], [f"{p}/ss"], name=f"{p}/self_attn/Mul"))
        nodes.append(helper.make_node("Softmax", [f"{p}/ss"], [f"{p}/pr"], axis=-1, name=f"{p}/self_attn/Softmax"))
        nodes.append(helper.make_node("MatMul", [f"{p}/pr", f"{p}/v"], [f"{p}/a"], name=f"{p}/self_attn/MatMul_1"))
        nodes.append(helper.make_node("MatMul", [f"{p}/a", W(f"onnx::MatMul_{l}o", D, D)], [f"{p}/o"], name=f"{p}/self_attn/o_proj/MatMul"))
        nodes.append(helper.make_node("Add", [h, f"{p}/o"], [f"{p}/h1"], name=f"{p}/Add"))
        h1 = f"{p}/h1"
        nodes.append(helper.make_node("MatMul", [h1, W(f"onnx::MatMul_{l}g", D, F)], [f"{p}/g"], name=f"{p}/mlp/gate_proj/MatMul"))
        nodes.append(helper.make_node("Sigmoid", [f"{p}/g"], [f"{p}/sg"], name=f"{p}/mlp/act_fn/Sigmoid"))
        nodes.append(helper.make_node("Mul", [f"{p}/g", f"{p}/sg"], [f"{p}/act"], name=f"{p}/mlp/act_fn/Mul"))
        nodes.append(helper.make_node("MatMul", [h1, W(f"onnx::MatMul_{l}u", D, F)], [f"{p}/u"], name=f"{p}/mlp/up_proj/MatMul"))
        nodes.append(helper.make_node("Mul", [f"{p}/act", f"{p}/u"], [f"{p}/m"], name=f"{p}/mlp/Mul"))
        nodes.append(helper.make_node("MatMul", [f"{p}/m", W(f"onnx::MatMul_{l}d", F, D)], [f"{p}/dn"], name=f"{p}/mlp/down_proj/MatMul"))
        nodes.append(helper.make_node("Add", [h1, f"{p}/dn"], [f"{p}/h2"], name=f"{p}/Add_1"))
        h = f"{p}/h2"
    nodes.append(helper.make_node("Transpose", ["model.embed_tokens.weight"], ["lm_w"], perm=[1, 0], name="/lm_head/Transpose"))
    nodes.append(helper.make_node("MatMul", [h, "lm_w"], ["logits"], name="/lm_head/MatMul"))
    g = helper.make_graph(
        nodes, "toy",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", V])],
        initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.checker.check_model(m)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(m, str(path))
    if tokenizer:
        write_tokenizer(path.parent / "tokenizer.json")
    return path


def cached(D: int = 48, F: int = 96, L: int = 2, Hq: int = 4, Hkv: int = 2, seed: int = 0) -> onnx.ModelProto:
    """The toy decoder with optimum's KV-cache I/O (`attention_mask`, `past_key_values.N.key|value`
    → `present.N.key|value`, [batch, kv_heads, seq, head_dim]) and attention core: Concat with the
    cache, GQA repeat (Unsqueeze → Expand → Reshape), Q·s, Kᵀ·s, + additive causal/padding mask,
    Softmax, IsNaN → 0, ·V. Not saved: callers choose the file layout."""
    rng = np.random.default_rng(seed)
    V, hd, rep = len(WORDS) + 2, D // Hq, Hq // Hkv
    inits, nodes = [], []
    N = helper.make_node

    def const(name, a):
        inits.append(numpy_helper.from_array(np.asarray(a), name))
        return name

    def W(name, K, N_):
        return const(name, _lowrank(rng, K, N_))

    const("model.embed_tokens.weight", (rng.standard_normal((V, D)) * 0.5).astype(np.float32))
    const("s", np.array(hd ** -0.25, np.float32))
    const("zero", np.array([0.0], np.float32))
    const("one", np.array(1.0, np.float32))
    const("big", np.array(1e9, np.float32))
    const("ax12", np.array([1, 2], np.int64))
    const("ax2", np.array([2], np.int64))
    const("eshape", np.array([1, 1, rep, 1, 1], np.int64))
    const("rq", np.array([0, 0, Hq, hd], np.int64))
    const("rkv", np.array([0, 0, Hkv, hd], np.int64))
    const("rrep", np.array([0, Hq, -1, hd], np.int64))
    const("rout", np.array([0, 0, D], np.int64))
    # additive mask [batch, 1, S, T]: causal (key j ≤ past + i) + padding (attention_mask 0)
    nodes += [N("Shape", ["input_ids"], ["S"], start=1, end=2, name="/mask/Shape"),
              N("Shape", ["attention_mask"], ["T"], start=1, end=2, name="/mask/Shape_1"),
              N("Concat", ["S", "T"], ["ST"], axis=0, name="/mask/Concat"),
              N("ConstantOfShape", ["ST"], ["ones"], value=numpy_helper.from_array(np.array([1.0], np.float32)),
                name="/mask/ConstantOfShape"),
              N("Sub", ["T", "S"], ["Pk"], name="/mask/Sub"),
              N("Squeeze", ["Pk"], ["P"], name="/mask/Squeeze"),
              N("Trilu", ["ones", "P"], ["tri"], upper=0, name="/mask/Trilu"),
              N("Sub", ["tri", "one"], ["tri1"], name="/mask/Sub_1"),
              N("Mul", ["tri1", "big"], ["causal"], name="/mask/Mul"),
              N("Cast", ["attention_mask"], ["amf"], to=TensorProto.FLOAT, name="/mask/Cast"),
              N("Sub", ["amf", "one"], ["am1"], name="/mask/Sub_2"),
              N("Mul", ["am1", "big"], ["pad"], name="/mask/Mul_1"),
              N("Unsqueeze", ["pad", "ax12"], ["pad4"], name="/mask/Unsqueeze"),
              N("Add", ["causal", "pad4"], ["mask"], name="/mask/Add"),
              N("Gather", ["model.embed_tokens.weight", "input_ids"], ["h0"], name="/model/embed_tokens/Gather")]
    ins = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
           helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"])]
    outs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", V])]
    h = "h0"
    for l in range(L):
        p, a = f"/model/layers.{l}", f"/model/layers.{l}/self_attn"
        for x in ("key", "value"):
            ins.append(helper.make_tensor_value_info(f"past_key_values.{l}.{x}", TensorProto.FLOAT,
                                                     ["batch_size", Hkv, "past_sequence_length", hd]))
            outs.append(helper.make_tensor_value_info(f"present.{l}.{x}", TensorProto.FLOAT,
                                                      ["batch_size", Hkv, "total_sequence_length", hd]))
        for nm, width, shp in (("q", Hq * hd, "rq"), ("k", Hkv * hd, "rkv"), ("v", Hkv * hd, "rkv")):
            nodes += [N("MatMul", [h, W(f"onnx::MatMul_{l}{nm}", D, width)], [f"{p}/{nm}"], name=f"{a}/{nm}_proj/MatMul"),
                      N("Reshape", [f"{p}/{nm}", shp], [f"{p}/{nm}4"], name=f"{a}/Reshape_{nm}"),
                      N("Transpose", [f"{p}/{nm}4"], [f"{p}/{nm}h"], perm=[0, 2, 1, 3], name=f"{a}/Transpose_{nm}")]
        for x, src in (("key", "k"), ("value", "v")):
            nodes += [N("Concat", [f"past_key_values.{l}.{x}", f"{p}/{src}h"], [f"present.{l}.{x}"], axis=-2,
                        name=f"{a}/Concat_{x}"),
                      N("Unsqueeze", [f"present.{l}.{x}", "ax2"], [f"{p}/{x}_u"], name=f"{a}/Unsqueeze_{x}"),
                      N("Expand", [f"{p}/{x}_u", "eshape"], [f"{p}/{x}_e"], name=f"{a}/Expand_{x}"),
                      N("Reshape", [f"{p}/{x}_e", "rrep"], [f"{p}/{x}_r"], name=f"{a}/Reshape_{x}_rep")]
        nodes += [N("Mul", [f"{p}/qh", "s"], [f"{p}/qs"], name=f"{a}/Mul"),
                  N("Transpose", [f"{p}/key_r"], [f"{p}/kt"], perm=[0, 1, 3, 2], name=f"{a}/Transpose"),
                  N("Mul", [f"{p}/kt", "s"], [f"{p}/kts"], name=f"{a}/Mul_1"),
                  N("MatMul", [f"{p}/qs", f"{p}/kts"], [f"{p}/sc"], name=f"{a}/MatMul"),
                  N("Add", [f"{p}/sc", "mask"], [f"{p}/scm"], name=f"{a}/Add"),
                  N("Softmax", [f"{p}/scm"], [f"{p}/pr"], axis=-1, name=f"{a}/Softmax"),
                  N("IsNaN", [f"{p}/pr"], [f"{p}/nan"], name=f"{a}/IsNaN"),
                  N("Where", [f"{p}/nan", "zero", f"{p}/pr"], [f"{p}/pr0"], name=f"{a}/Where"),
                  N("MatMul", [f"{p}/pr0", f"{p}/value_r"], [f"{p}/att"], name=f"{a}/MatMul_1"),
                  N("Transpose", [f"{p}/att"], [f"{p}/att_t"], perm=[0, 2, 1, 3], name=f"{a}/Transpose_1"),
                  N("Reshape", [f"{p}/att_t", "rout"], [f"{p}/att_r"], name=f"{a}/Reshape"),
                  N("MatMul", [f"{p}/att_r", W(f"onnx::MatMul_{l}o", D, D)], [f"{p}/o"], name=f"{a}/o_proj/MatMul"),
                  N("Add", [h, f"{p}/o"], [f"{p}/h1"], name=f"{p}/Add")]
        h1 = f"{p}/h1"
        nodes += [N("MatMul", [h1, W(f"onnx::MatMul_{l}g", D, F)], [f"{p}/g"], name=f"{p}/mlp/gate_proj/MatMul"),
                  N("Sigmoid", [f"{p}/g"], [f"{p}/sg"], name=f"{p}/mlp/act_fn/Sigmoid"),
                  N("Mul", [f"{p}/g", f"{p}/sg"], [f"{p}/act"], name=f"{p}/mlp/act_fn/Mul"),
                  N("MatMul", [h1, W(f"onnx::MatMul_{l}u", D, F)], [f"{p}/u"], name=f"{p}/mlp/up_proj/MatMul"),
                  N("Mul", [f"{p}/act", f"{p}/u"], [f"{p}/m"], name=f"{p}/mlp/Mul"),
                  N("MatMul", [f"{p}/m", W(f"onnx::MatMul_{l}d", F, D)], [f"{p}/dn"], name=f"{p}/mlp/down_proj/MatMul"),
                  N("Add", [h1, f"{p}/dn"], [f"{p}/h2"], name=f"{p}/Add_1")]
        h = f"{p}/h2"
    nodes += [N("Transpose", ["model.embed_tokens.weight"], ["lm_w"], perm=[1, 0], name="/lm_head/Transpose"),
              N("MatMul", [h, "lm_w"], ["logits"], name="/lm_head/MatMul")]
    m = helper.make_model(helper.make_graph(nodes, "toy_cached", ins, outs, initializer=inits),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.checker.check_model(m)
    return m


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[PAD]": 1}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def text(n_words: int = 3000, seed: int = 1) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, n_words))
