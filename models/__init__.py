"""Model preparation for ortlean: packaged weights -> optimum ONNX exports, and the text corpus.

    from models import prepare, corpus
    d = prepare("smollm2")            # cached dir with model.onnx, tokenizer.json, ortlean.json
    corpus.text(corpus.EVAL_NOVEL)    # held-out text for perplexity

Nothing here imports torch; the export runs in a child process (models/_build.py).
"""
from __future__ import annotations

from . import cache, corpus, prepare  # `prepare` is the module, callable as the function
from .cache import cache_root
from .corpus import CALIB_NOVEL, EVAL_NOVEL, ensure_corpus, novels, text
from .prepare import MODELS, PrepareError, graph_facts, model_dir

__all__ = [
    "cache", "corpus", "cache_root", "prepare", "model_dir", "graph_facts", "MODELS", "PrepareError",
    "CALIB_NOVEL", "EVAL_NOVEL", "ensure_corpus", "novels", "text",
]
