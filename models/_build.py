"""Child-process half of :func:`models.prepare.prepare`: the torch/transformers/optimum part.

Run as ``python -m models._build SOURCE_DIR WORK_DIR TASK``; writes the optimum export of the HF
checkpoint in SOURCE_DIR (a GGUF-packaged model's: :func:`dequantize_gguf`, run by
``models.peers.hf_checkpoint``) to ``WORK_DIR/onnx``. It runs in its own process so that torch and the fp32 model (a few GiB at
peak) are gone when it exits, and the caller never imports torch. Lines starting with
``##ortlean-step`` on stdout are progress markers read by the parent.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

STEP = "##ortlean-step"


def step(msg: str) -> None:
    print(f"{STEP} {msg}", flush=True)


def dequantize_gguf(src: Path, gguf_file: str, out: Path) -> None:
    """GGUF (any quantization transformers can read) -> fp32 safetensors HF checkpoint in ``out``.

    Builds the model from the GGUF config and loads the dequantized tensors ourselves, so that
    `accelerate` (which ``from_pretrained(gguf_file=...)`` insists on) is not needed. Memory: one
    fp32 copy of the weights. The model is built without initializing its parameters (their
    pages are never touched) and the dequantized arrays become its parameters as they are
    (``assign=True``), so a 1.5B model peaks at its 7 GB of fp32 weights, not twice that."""
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.modeling_utils import no_init_weights

    step(f"reading tokenizer and config from {gguf_file}")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf_file)
    cfg = AutoConfig.from_pretrained(src, gguf_file=gguf_file)
    eos = getattr(cfg, "eos_token_id", None)
    if isinstance(eos, int) and tok.eos_token_id != eos:
        # the GGUF's tokenizer.ggml.eos_token_id (Qwen2.5 Instruct: <|im_end|>), which transformers'
        # GGUF tokenizer conversion replaces with <|endoftext|>: the config's is the GGUF's
        tok.eos_token = tok.convert_ids_to_tokens(eos)
    cfg.dtype = torch.float32
    step("dequantizing GGUF tensors to fp32")
    with torch.device("cpu"), no_init_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(src / gguf_file), return_tensors=True, model_to_load=model)["tensors"]
    state = {}
    for k in list(tensors):
        a = tensors.pop(k)
        # unquantized GGUF tensors come back as read-only views of the file's memory map: copy those
        if a.dtype != np.float32 or not a.flags.writeable or not a.flags.c_contiguous:
            a = np.array(a, dtype=np.float32, order="C")
        state[k] = torch.from_numpy(a)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    del state
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    allowed_missing = {"lm_head.weight"} if tied else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(f"GGUF tensors do not match the model: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.eval()
    step("saving fp32 checkpoint")
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    # The GGUF tokenizer's "vocab file" is the whole GGUF: don't carry a copy around.
    (out / "tokenizer.model").unlink(missing_ok=True)
    # a SentencePiece vocabulary (Gemma): transformers makes a Unigram of its merge ranks, which splits
    # words into short pieces; llama.cpp's merge order instead (models/gguf_tokenizer.py)
    from models.gguf_tokenizer import spm_tokenizer

    spm = spm_tokenizer(src / gguf_file)
    if spm is not None:
        step("tokenizer: SentencePiece merges in llama.cpp's order")
        spm.save(str(out / "tokenizer.json"))


def export(model_dir: Path, task: str, out: Path) -> None:
    from optimum.exporters.onnx import main_export

    step(f"exporting ONNX with optimum (task {task})")
    main_export(str(model_dir), output=str(out), task=task, device="cpu",
                library_name="transformers", do_validation=False)


def main(argv: list[str]) -> int:
    """``python -m models._build SOURCE WORK TASK``: optimum export of the HF checkpoint SOURCE;
    ``python -m models._build _hf SRC_DIR GGUF_FILE OUT_DIR``: the fp32 checkpoint of a GGUF
    (models.prepare.hf_checkpoint)."""
    if len(argv) == 4 and argv[0] == "_hf":
        dequantize_gguf(Path(argv[1]), argv[2], Path(argv[3]))
        return 0
    if len(argv) != 3:
        print("usage: python -m models._build SOURCE_DIR WORK_DIR TASK", file=sys.stderr)
        return 2
    src, work, task = Path(argv[0]), Path(argv[1]), argv[2]
    t0 = time.monotonic()
    export(src, task, work / "onnx")
    step(f"export finished in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
