"""A small Llama-shaped causal LM built by hand (named like optimum exports), with a word-level
tokenizer.json next to it: exercises classification, calibration and rewriting without a real
model. Weights have a decaying spectrum so low-rank factors can meet a gap."""
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
