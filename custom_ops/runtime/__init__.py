"""Driving optimum-exported ONNX models in onnxruntime, dense or rewritten with ortlean's ops.

The caller builds the session (``custom_ops.session(path, threads=N)`` for rewritten models, a
plain ``onnxruntime.InferenceSession`` for dense ones); these modules only look at its declared
inputs and outputs:

- ``io``: ``ModelIO`` (inputs, outputs, past→present states), ``feeds``, ``run``, the tokenizer;
- ``quality``: ``perplexity``, sentence ``embeddings``, ``sentences_from_text``;
- ``generate``: text generation with the KV cache (greedy or sampled, streamed; every graph form's loop);
- ``bench``: whole-model prefill/decode timing (``bench_sessions``) and interleaved op timing;
- ``profile``: ONNX Runtime's per-node profile, summarised (``decode_profile``: of decode steps after a past);
- ``weights``: stored weight bytes, ORT's own MatMulNBits quantization (the int8/int4 baseline);
- ``shared_kv``: the decode loop for GroupQueryAttention graphs with one K/V buffer per layer (IOBinding);
- ``needle``: retrieval cases (pass keys, key-value lines) in long prose, run as ``generate`` runs a prompt,
  scored against a reference (``ortlean eval --task needle``; ``NeedleSuite`` for the tuner);
- ``prompt_cache``: a prompt's state in a file, loaded by a later prompt that starts with the same tokens.

    from custom_ops import runtime
    io = runtime.ModelIO.from_session(sess)
    tok = runtime.load_tokenizer(model_path)
    runtime.perplexity(sess, io, runtime.tokenize(tok, text), window=512)   # {"ppl", "nll", "tokens", ...}
    runtime.generate(sess, io, tok, "Once upon a time", 32)
    runtime.bench_sessions({"dense": s0, "lean": s1}, io)
"""
from .bench import bench_sessions, time_cpu, time_sessions
from .generate import EOS_TOKENS, Generation, Sampling, TextStream, generate, model_eos_ids
from .io import ModelIO, feeds, load_tokenizer, run, text_prefix, tokenize
from .profile import ATTENTION_OPS, ProfileSummary, decode_profile, profile_summary
from .shared_kv import PREFILL_CHUNK, SharedKV, SharedKVError
from .prompt_cache import CacheInfo, PromptCache, PromptCacheError
from .quality import (approximate_decode, approximate_from, decode_perplexity, embeddings, paired_delta, perplexity,
                      sentences_from_text)
from .weights import cache_bytes_per_token, quantize_matmul_nbits, weight_bytes

__all__ = [
    "ModelIO", "load_tokenizer", "tokenize", "text_prefix", "feeds", "run", "perplexity", "decode_perplexity", "paired_delta", "approximate_decode", "approximate_from", "embeddings",
    "sentences_from_text", "generate", "bench_sessions", "time_sessions", "time_cpu", "profile_summary", "decode_profile", "ATTENTION_OPS",
    "ProfileSummary", "SharedKV", "SharedKVError", "PREFILL_CHUNK", "weight_bytes", "cache_bytes_per_token", "quantize_matmul_nbits", "EOS_TOKENS",
    "Generation", "Sampling", "TextStream", "model_eos_ids", "PromptCache", "PromptCacheError", "CacheInfo",
]
