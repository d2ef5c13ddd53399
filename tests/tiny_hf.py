"""Tiny random-weight decoders exported by optimum (`text-generation-with-past`), for the fusion
and quantization tests: the real export path, seconds instead of minutes.

    python tests/tiny_hf.py OUT_DIR            # writes OUT_DIR/<family>/model.onnx for FAMILIES

Families: ``llama`` (GQA 4/2 heads, head_dim 16, tied embeddings, like SmolLM2) and ``qwen2``
(GQA 4/2 heads, head_dim 32, q/k/v biases, untied head). :func:`models` builds them once per
versions of torch / transformers / optimum-onnx (under the ortlean cache, in a child process so the
test process never imports torch) and returns the directories.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

RECIPE = 1
FAMILIES = {
    "llama": dict(cls="LlamaConfig", model="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0),
    "qwen2": dict(cls="Qwen2Config", model="Qwen2ForCausalLM", vocab_size=256, hidden_size=128,
                  intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, tie_word_embeddings=False),
}


def models() -> dict[str, Path]:
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    from models.cache import artifact_key, atomic_dir, cache_root, versions

    key = artifact_key("tiny-decoders", {"recipe": RECIPE, "families": FAMILIES,
                                          "tools": versions(("torch", "transformers", "optimum-onnx", "onnx"))})
    target = cache_root() / "test-models" / key
    if not all((target / f / "model.onnx").is_file() for f in FAMILIES):
        with atomic_dir(target) as tmp:
            if tmp is not None:
                res = subprocess.run([sys.executable, __file__, str(tmp)], capture_output=True, text=True,
                                     env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
                if res.returncode != 0:
                    raise RuntimeError(f"building the tiny decoders failed:\n{res.stderr[-3000:]}")
    return {f: target / f for f in FAMILIES}


def _build(out: Path) -> None:
    import torch
    import transformers
    from optimum.exporters.onnx import main_export

    for fam, spec in FAMILIES.items():
        spec = dict(spec)
        cfg = getattr(transformers, spec.pop("cls"))(**{k: v for k, v in spec.items() if k != "model"})
        torch.manual_seed(0)
        model = getattr(transformers, spec["model"])(cfg).eval()
        with torch.no_grad():  # random init gives ~unit norms; spread them so the norms matter
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                elif name.endswith(".bias"):
                    p.normal_(0.0, 0.1)
        hf = out / fam / "hf"
        model.save_pretrained(hf)
        main_export(str(hf), output=str(out / fam), task="text-generation-with-past", device="cpu",
                    library_name="transformers", do_validation=False)



# --------------------------------------------------------------------------- other input forms (issue 9, item 1)
FORMS_RECIPE = 1
FORMS = ("dynamo", "genai-fp32", "genai-int4", "bert", "bert-ort-fused")
BERT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128, type_vocab_size=2)


def forms() -> dict[str, Path]:
    """Tiny random-weight models of the other input forms, built once (child process) and cached:

    * ``dynamo``: the ``llama`` family through ``torch.onnx.export(..., dynamo=True)`` (no KV cache:
      input_ids → logits; the dynamo exporter's node names and shapes);
    * ``genai-fp32`` / ``genai-int4``: the ``llama`` family through onnxruntime-genai's model builder
      (``python -m onnxruntime_genai.models.builder -m HF -i HF -o OUT -p fp32|int4 -e cpu``;
      GroupQueryAttention with shared-buffer KV, SkipSimplifiedLayerNormalization, MatMulNBits);
      absent when onnxruntime-genai is not installed;
    * ``bert``: a tiny BERT encoder exported by optimum (feature-extraction);
    * ``bert-ort-fused``: that BERT through ``onnxruntime.transformers.optimizer`` (com.microsoft
      Attention, SkipLayerNormalization, EmbedLayerNormalization, BiasGelu).
    Returns {form: directory holding model.onnx} for the forms that were built."""
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    from models.cache import artifact_key, atomic_dir, cache_root, versions

    base = models()
    key = artifact_key("tiny-forms", {"recipe": FORMS_RECIPE, "llama": FAMILIES["llama"], "bert": BERT,
                                       "tools": versions(("torch", "transformers", "optimum-onnx", "onnx",
                                                          "onnxruntime", "onnxruntime-genai"))})
    target = cache_root() / "test-models" / key
    if not (target / "done.txt").is_file():
        with atomic_dir(target) as tmp:
            if tmp is not None:
                res = subprocess.run([sys.executable, __file__, "--forms", str(base["llama"] / "hf"), str(tmp)],
                                     capture_output=True, text=True,
                                     env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
                if res.returncode != 0:
                    raise RuntimeError(f"building the tiny input forms failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
                (tmp / "done.txt").write_text("ok\n")
    return {f: target / f for f in FORMS if (target / f / "model.onnx").is_file()}


def _tiny_tokenizer(vocab: int):
    """A word-level tokenizer over `vocab` ids (the builders save a tokenizer beside the model)."""
    from tokenizers import Tokenizer, models as tm, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    t = Tokenizer(tm.WordLevel(words, unk_token="w0"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="w0", bos_token="w1", eos_token="w2",
                                   pad_token="w0", cls_token="w1", sep_token="w2", mask_token="w3")


def _build_forms(hf: Path, out: Path) -> None:
    import importlib.util
    import shutil

    import torch
    import transformers

    # dynamo export of the tiny llama (input_ids -> logits)
    tok = _tiny_tokenizer(FAMILIES["llama"]["vocab_size"])
    hf_tok = out / "llama-hf"
    shutil.copytree(hf, hf_tok)
    tok.save_pretrained(hf_tok)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_tok).eval()
    model.config.use_cache = False

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids):
            return self.m(input_ids=input_ids, use_cache=False).logits

    (out / "dynamo").mkdir()
    ids = torch.randint(3, 250, (1, 8))
    seq = torch.export.Dim("sequence_length", min=2, max=256)
    torch.onnx.export(Logits(model), (ids,), str(out / "dynamo" / "model.onnx"), dynamo=True,
                      input_names=["input_ids"], output_names=["logits"],
                      dynamic_shapes={"input_ids": {1: seq}}, external_data=False)
    tok.save_pretrained(out / "dynamo")

    # onnxruntime-genai builder models of the same checkpoint
    if importlib.util.find_spec("onnxruntime_genai") is not None:
        for p in ("fp32", "int4"):
            d = out / f"genai-{p}"
            res = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(hf_tok), "-i",
                                  str(hf_tok), "-o", str(d), "-p", p, "-e", "cpu", "-c", str(out / "genai-cache")],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"genai builder {p}: {res.stdout[-1500:]}\n{res.stderr[-1500:]}")
        shutil.rmtree(out / "genai-cache", ignore_errors=True)

    # a tiny BERT: optimum export, then ORT's transformer optimizer
    from optimum.exporters.onnx import main_export
    from onnxruntime.transformers import optimizer

    cfg = transformers.BertConfig(**BERT)
    torch.manual_seed(0)
    bert = transformers.BertModel(cfg).eval()
    bhf = out / "bert-hf"
    bert.save_pretrained(bhf)
    _tiny_tokenizer(BERT["vocab_size"]).save_pretrained(bhf)
    main_export(str(bhf), output=str(out / "bert"), task="feature-extraction", device="cpu",
                library_name="transformers", do_validation=False)
    (out / "bert-ort-fused").mkdir()
    om = optimizer.optimize_model(str(out / "bert" / "model.onnx"), model_type="bert",
                                  num_heads=BERT["num_attention_heads"], hidden_size=BERT["hidden_size"],
                                  opt_level=0, use_gpu=False)
    om.save_model_to_file(str(out / "bert-ort-fused" / "model.onnx"))
    for f in (out / "bert").glob("tok*"):
        shutil.copy(f, out / "bert-ort-fused" / f.name)
    shutil.copy(out / "bert" / "special_tokens_map.json", out / "bert-ort-fused")


# --------------------------------------------------------------------------- a sliding-window family (issue 10)
SLIDING_RECIPE = 1
SLIDING = dict(cls="MistralConfig", model="MistralForCausalLM", vocab_size=256, hidden_size=128, head_dim=48,
               intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, sliding_window=24, tie_word_embeddings=False, rope_theta=10000.0)


def sliding() -> Path | None:
    """A tiny random-weight Mistral (another family than Llama/SmolLM2: sliding-window attention,
    window 24, head dim 48, GQA 4/2) through onnxruntime-genai's builder (fp32, CPU):
    GroupQueryAttention with ``local_window_size`` 24. Built once (child process) and cached; None
    when onnxruntime-genai is not installed."""
    import importlib.util

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    from models.cache import artifact_key, atomic_dir, cache_root, versions

    if importlib.util.find_spec("onnxruntime_genai") is None:
        return None
    key = artifact_key("tiny-sliding", {"recipe": SLIDING_RECIPE, "spec": SLIDING,
                                         "tools": versions(("torch", "transformers", "onnx", "onnxruntime",
                                                            "onnxruntime-genai"))})
    target = cache_root() / "test-models" / key
    if not (target / "genai-fp32" / "model.onnx").is_file():
        with atomic_dir(target) as tmp:
            if tmp is not None:
                res = subprocess.run([sys.executable, __file__, "--sliding", str(tmp)], capture_output=True, text=True,
                                     env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
                if res.returncode != 0:
                    raise RuntimeError(f"building the tiny sliding-window model failed:\n{res.stdout[-2000:]}\n"
                                       f"{res.stderr[-3000:]}")
    return target / "genai-fp32"


def _build_sliding(out: Path) -> None:
    import torch
    import transformers

    spec = dict(SLIDING)
    cfg = getattr(transformers, spec.pop("cls"))(**{k: v for k, v in spec.items() if k != "model"})
    torch.manual_seed(0)
    model = getattr(transformers, spec["model"])(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    hf = out / "hf"
    model.save_pretrained(hf)
    _tiny_tokenizer(SLIDING["vocab_size"]).save_pretrained(hf)
    res = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(hf), "-i", str(hf),
                          "-o", str(out / "genai-fp32"), "-p", "fp32", "-e", "cpu", "-c", str(out / "genai-cache")],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"genai builder: {res.stdout[-1500:]}\n{res.stderr[-1500:]}")
    import shutil

    shutil.rmtree(out / "genai-cache", ignore_errors=True)


# --------------------------------------------------------------------------- other decoder families (issue 35)
FAMILY_RECIPE = 1
_FAM = dict(vocab_size=256, hidden_size=128, head_dim=32, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
MORE_FAMILIES = {
    # sliding window 8 on every layer (optimum's SDPA export writes it into the additive mask)
    "mistral": dict(_FAM, cls="MistralConfig", model="MistralForCausalLM", sliding_window=8,
                    tie_word_embeddings=False),
    # qkv_proj and gate_up_proj packed in the checkpoint, whole-head rotary
    "phi3": dict(_FAM, cls="Phi3Config", model="Phi3ForCausalLM", tie_word_embeddings=False),
    # Phi-4-mini's form: rotary on half of each head, LongRoPE factors (optimum traces the short
    # ones: the export never switches to the long factors), tied embeddings
    "phi3-partial-longrope": dict(_FAM, cls="Phi3Config", model="Phi3ForCausalLM", tie_word_embeddings=True,
                                  partial_rotary_factor=0.5, original_max_position_embeddings=64,
                                  rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                                "long_factor": [2.0 + 0.5 * i for i in range(8)]}),
    # sliding (layer 0) and global (layer 1) layers, soft-capped scores and logits, query_pre_attn_scalar,
    # (1 + w) norms, pre/post feed-forward norms; exported with eager attention (Gemma 2's own:
    # transformers' SDPA path drops the soft-cap, which optimum's default export then lacks)
    "gemma2": dict(_FAM, cls="Gemma2Config", model="Gemma2ForCausalLM", sliding_window=8, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0, query_pre_attn_scalar=24, attn_implementation="eager"),
    # q/k RMSNorms on [B, S, H, D] before the head transpose (Gemma 3's come after it)
    "qwen3": dict(_FAM, cls="Qwen3Config", model="Qwen3ForCausalLM", tie_word_embeddings=False),
    # q/k RMSNorms, sliding + global layers with their own rope bases (and linear scaling on the
    # global one), no position_ids input
    "gemma3": dict(_FAM, cls="Gemma3TextConfig", model="Gemma3ForCausalLM", sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"], rope_theta=1e6, rope_local_base_freq=100.0,
                   rope_scaling={"rope_type": "linear", "factor": 8.0}),
}


def more_models() -> dict[str, Path]:
    """Tiny random-weight exports (optimum, ``text-generation-with-past``) of the other decoder
    families the fusion takes (:data:`MORE_FAMILIES`), each with a word-level tokenizer over its
    256 ids beside it; built once (child process) and cached like :func:`models`."""
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    from models.cache import artifact_key, atomic_dir, cache_root, versions

    key = artifact_key("tiny-families", {"recipe": FAMILY_RECIPE, "families": MORE_FAMILIES,
                                          "tools": versions(("torch", "transformers", "optimum-onnx", "onnx"))})
    target = cache_root() / "test-models" / key
    if not all((target / f / "model.onnx").is_file() for f in MORE_FAMILIES):
        with atomic_dir(target) as tmp:
            if tmp is not None:
                res = subprocess.run([sys.executable, __file__, "--families", str(tmp)], capture_output=True, text=True,
                                     env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
                if res.returncode != 0:
                    raise RuntimeError(f"building the tiny decoder families failed:\n{res.stderr[-3000:]}")
    return {f: target / f for f in MORE_FAMILIES}


def _build_families(out: Path) -> None:
    import shutil

    import torch
    import transformers
    from optimum.exporters.onnx import main_export, onnx_export_from_model

    for fam, spec in MORE_FAMILIES.items():
        spec = dict(spec)
        cls, arch, attn = spec.pop("cls"), spec.pop("model"), spec.pop("attn_implementation", None)
        cfg = getattr(transformers, cls)(**spec)
        torch.manual_seed(0)
        model = getattr(transformers, arch)(cfg).eval()
        with torch.no_grad():  # random init gives ~unit norms; spread them so the norms matter
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5) if "gemma" not in fam else p.uniform_(-0.5, 0.5)   # Gemma: (1 + w)
        hf = out / fam / "hf"
        model.save_pretrained(hf)
        _tiny_tokenizer(spec["vocab_size"]).save_pretrained(hf)
        if attn is None:
            main_export(str(hf), output=str(out / fam), task="text-generation-with-past", device="cpu",
                        library_name="transformers", do_validation=False)
        else:   # main_export loads with the default (SDPA) attention
            m = getattr(transformers, arch).from_pretrained(hf, attn_implementation=attn).eval()
            onnx_export_from_model(m, str(out / fam), task="text-generation-with-past", do_validation=False)
            for f in hf.iterdir():
                if f.name.startswith(("tokenizer", "special_tokens")) and not (out / fam / f.name).exists():
                    shutil.copy(f, out / fam / f.name)


if __name__ == "__main__":
    if sys.argv[1] == "--families":
        _build_families(Path(sys.argv[2]))
    elif sys.argv[1] == "--forms":
        _build_forms(Path(sys.argv[2]), Path(sys.argv[3]))
    elif sys.argv[1] == "--sliding":
        _build_sliding(Path(sys.argv[2]))
    else:
        _build(Path(sys.argv[1]))
