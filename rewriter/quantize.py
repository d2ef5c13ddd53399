"""``--weights fp32|int8|int4``: weight MatMuls that no ortlean backend takes become ONNX Runtime's
``com.microsoft.MatMulNBits``, quantized by ORT's own ``MatMulNBitsQuantizer`` (round-to-nearest
per block along K).

    from rewriter.quantize import quantize_weights
    qmodel, info = quantize_weights(model, "int4")                 # ir.Model in, new ir.Model out
    qmodel, info = quantize_weights(model, "int8", exclude=["/model/layers.0/mlp/down_proj/MatMul"])

Every MatMul whose B is a constant initializer is quantized (the lm_head included) unless its node
name is in ``exclude`` (the layers an ortlean backend took). The defaults (:data:`DEFAULTS`) were
chosen by measurement on this machine class (2 cores, AVX2) with
``python tests/bench/bench_weights.py`` (SmolLM2-135M, fused graph: decode tok/s at past 128 and
prefill 128 tokens, 1 and 2 threads, and Δppl on the held-out novel for every block size,
symmetric/asymmetric and accuracy level); the closing note of issue 9 has the table.
``accuracy_level=4`` lets MLAS compute with int8 activations (what ORT's model builder uses on CPU).
"""
from __future__ import annotations

from dataclasses import asdict, replace
from typing import Iterable

import onnx_ir as ir

from custom_ops.runtime.weights import QuantConfig, matmul_nbits_proto

__all__ = ["WEIGHTS", "QuantConfig", "DEFAULTS", "quantize_weights", "matmul_nbits_proto"]

WEIGHTS = ("fp32", "int8", "int4")


# chosen with tests/bench/bench_weights.py (see the module docstring)
DEFAULTS = {
    "int8": QuantConfig(bits=8, block_size=32, symmetric=True, accuracy_level=4),
    "int4": QuantConfig(bits=4, block_size=32, symmetric=True, accuracy_level=4),
}


def quantize_weights(model: ir.Model, weights: str, *, block_size: int | None = None,
                     symmetric: bool | None = None, accuracy_level: int | None = None,
                     exclude: Iterable[str] = ()) -> tuple[ir.Model, dict]:
    """``weights="fp32"`` returns the model unchanged; ``"int8"``/``"int4"`` returns a new model
    whose constant-weight MatMuls (except ``exclude``) are MatMulNBits. ``info`` records the
    configuration and which nodes were quantized / kept."""
    if weights not in WEIGHTS:
        raise ValueError(f"--weights {weights!r}: one of {', '.join(WEIGHTS)}")
    exclude = set(exclude)
    if weights == "fp32":
        return model, {"weights": "fp32", "quantized": [], "kept": sorted(exclude)}
    cfg = DEFAULTS[weights]
    cfg = replace(cfg, **{k: v for k, v in (("block_size", block_size), ("symmetric", symmetric),
                                             ("accuracy_level", accuracy_level)) if v is not None})
    names = {n.name for n in model.graph}
    unknown = sorted(exclude - names)
    if unknown:
        raise ValueError(f"quantize: nodes to exclude not in the model: {unknown[:3]}")
    before = {n.name for n in model.graph if n.op_type == "MatMul"}
    proto = matmul_nbits_proto(ir.serde.serialize_model(model), cfg, exclude)
    out = ir.serde.deserialize_model(proto)
    quantized = sorted(n.name.removesuffix("_Q4").removesuffix("_Q8") for n in out.graph
                       if n.op_type == "MatMulNBits")
    kept = sorted(before & {n.name for n in out.graph if n.op_type == "MatMul"})
    return out, {"weights": weights, **asdict(cfg), "quantized": quantized, "kept": kept}


# --------------------------------------------------------------------------- one layer (the --weights backend)
def config_for(weights: str) -> QuantConfig:
    """The measured default configuration of ``weights`` ("int8" | "int4")."""
    if weights not in DEFAULTS:
        raise ValueError(f"--weights {weights!r}: one of {', '.join(WEIGHTS)}")
    return DEFAULTS[weights]


def quantize_matrix(W, cfg: QuantConfig):
    """ORT's block quantization of one weight ``W`` [K, N] (``DefaultWeightOnlyQuantizer.qbits_block_quant``,
    the code ``MatMulNBitsQuantizer`` runs per node): ``(packed [N, k_blocks, blob] uint8, scales
    [N, k_blocks] float32, zero_points [N, ceil(k_blocks * bits / 8)] uint8 or None when symmetric)``."""
    import numpy as np
    from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                 DefaultWeightOnlyQuantizer)

    q = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
        block_size=cfg.block_size, is_symmetric=cfg.symmetric, accuracy_level=cfg.accuracy_level, bits=cfg.bits))
    packed, scales, zp = q.qbits_block_quant(np.ascontiguousarray(W, dtype=np.float32))
    return packed, scales, (None if cfg.symmetric else zp)


def dequantize_matrix(packed, scales, zero_points, K: int, cfg: QuantConfig):
    """Ŵ [K, N] float32 that MatMulNBits computes with (for the gap of a quantized layer)."""
    import numpy as np

    N, kb, _ = packed.shape
    bits = cfg.bits
    if bits == 8:
        q = packed.reshape(N, kb, -1).astype(np.int32)
    elif bits == 4:
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(N, kb, -1).astype(np.int32)
    else:
        raise ValueError(f"dequantize: {bits} bits not supported")
    q = q[:, :, : cfg.block_size]
    mid = 1 << (bits - 1)
    if zero_points is None:
        zp = np.full((N, kb), mid, np.int32)
    elif bits == 8:
        zp = zero_points.reshape(N, -1)[:, :kb].astype(np.int32)
    else:
        zp = np.stack([zero_points & 0x0F, zero_points >> 4], axis=-1).reshape(N, -1)[:, :kb].astype(np.int32)
    w = (q - zp[:, :, None]).astype(np.float32) * scales.reshape(N, kb)[:, :, None]
    return np.ascontiguousarray(w.reshape(N, kb * cfg.block_size)[:, :K].T)
