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


if __name__ == "__main__":
    _build(Path(sys.argv[1]))
