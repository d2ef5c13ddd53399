"""Weights as stored: bytes of a model's initializers, and ONNX Runtime's own MatMulNBits
quantization (the int8/int4 baseline a user would pick instead of ortlean)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

@dataclass(frozen=True)
class QuantConfig:
    """One MatMulNBits setting: bits per weight, block length along K, symmetric or with zero
    points, and ``accuracy_level`` (4 = int8 activations in MLAS)."""
    bits: int
    block_size: int
    symmetric: bool
    accuracy_level: int


def matmul_nbits_proto(proto, cfg: QuantConfig, nodes_to_exclude: Iterable[str] = ()):
    """ORT's ``MatMulNBitsQuantizer`` (QOperator format) on a ModelProto; returns the new ModelProto."""
    import logging

    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    if cfg.bits not in (2, 4, 8):
        raise ValueError(f"MatMulNBits supports 2, 4 or 8 bits, not {cfg.bits}")
    q = MatMulNBitsQuantizer(proto, bits=cfg.bits, block_size=cfg.block_size, is_symmetric=cfg.symmetric,
                             accuracy_level=cfg.accuracy_level, nodes_to_exclude=list(nodes_to_exclude))
    qlog = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = qlog.level
    qlog.setLevel(logging.WARNING)  # it logs one INFO line per node
    try:
        q.process()
    finally:
        qlog.setLevel(level)
    return q.model.model


# sizes and the MatMulNBits baseline
def _tensor_nbytes(t, base_dir: Path) -> int:
    import onnx

    if t.data_location == onnx.TensorProto.EXTERNAL:
        info = {e.key: e.value for e in t.external_data}
        if "length" in info:
            return int(info["length"])
        p = base_dir / info["location"]
        return max(p.stat().st_size - int(info.get("offset", 0)), 0) if p.is_file() else 0
    if t.raw_data:
        return len(t.raw_data)
    if t.data_type == onnx.TensorProto.STRING:
        return sum(len(s) for s in t.string_data)
    numel = int(np.prod(t.dims)) if len(t.dims) else 1
    bits = {onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4}
    if t.data_type in bits:
        return (numel * bits[t.data_type] + 7) // 8
    fp4 = getattr(onnx.TensorProto, "FLOAT4E2M1", None)
    if fp4 is not None and t.data_type == fp4:
        return (numel * 4 + 7) // 8
    return numel * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize


def cache_bytes_per_token(model_path) -> int | None:
    """Bytes the model's cache states (``past_key_values.N.*``, every layer) hold per cached token:
    each state's element size times its declared dimensions other than batch and sequence
    (fp32 K/V: layers x 2 x kv_heads x head_dim x 4; PackedAttention: its key-code and K/V row words).
    None for a model without a cache or with a symbolic non-sequence dimension."""
    from .io import ModelIO

    io = ModelIO.from_model(str(model_path))
    if not io.state_shapes:
        return None
    total = 0
    for n, shape in io.state_shapes.items():
        per = np.dtype(io.state_types[n]).itemsize
        for i, d in enumerate(shape):
            if i == 0 or i == io.state_seq_axis[n]:
                continue
            if not isinstance(d, int) or d <= 0:
                return None
            per *= d
        total += per
    return int(total)


def weight_bytes(model_path) -> int:
    """Bytes of all initializers (main graph and subgraphs), external data included, as stored."""
    import onnx

    model_path = Path(model_path)
    m = onnx.load(str(model_path), load_external_data=False)
    base = model_path.parent
    total = 0

    def walk(g):
        nonlocal total
        for t in g.initializer:
            total += _tensor_nbytes(t, base)
        for st in g.sparse_initializer:
            total += _tensor_nbytes(st.values, base) + _tensor_nbytes(st.indices, base)
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for sg in a.graphs:
                        walk(sg)

    walk(m.graph)
    return total


def quantize_matmul_nbits(dense_model_path, bits: int, out_path, block_size: int = 32,
                          symmetric: bool = False, accuracy_level: int | None = 4,
                          nodes_to_exclude: Iterable[str] = ()) -> Path:
    """ORT's own weight-only quantization (``MatMulNBitsQuantizer``, QOperator format): every
    MatMul with a constant B becomes ``com.microsoft.MatMulNBits`` with ``bits`` (4 or 8; 2 in
    recent ORT) bit blocks of ``block_size`` along K, asymmetric (ORT's default) unless
    ``symmetric``. ``accuracy_level=4`` lets the CPU kernel compute in int8 (what ORT's model
    builder uses for CPU). The lm_head is quantized too unless listed in ``nodes_to_exclude``. Writes ``out_path`` (weights inline, or external
    data ``<out>.data`` when over 2 GB) and returns it. Caching is the caller's business."""
    import onnx

    qm = matmul_nbits_proto(onnx.load(str(dense_model_path)),
                            QuantConfig(bits, block_size, symmetric, accuracy_level), nodes_to_exclude)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    big = qm.ByteSize() > 1_900_000_000
    if big:
        data_name = out_path.name + ".data"
        onnx.save_model(qm, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data_name)
    else:
        onnx.save_model(qm, str(tmp))
    os.replace(tmp, out_path)
    return out_path
