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

__all__ = ["WEIGHTS", "EMBED", "QuantConfig", "DEFAULTS", "quantize_weights", "matmul_nbits_proto",
           "tied_embedding", "equal_tables", "block_rows", "share_embedding", "pack_shared_input"]

WEIGHTS = ("fp32", "int8", "int4")
# the token embedding of a model whose lm_head is tied to it: "shared" reads the head's quantized
# blocks (GatherBlockQuantized: no bytes of its own, as ORT's model builder does), "fp32" keeps its table
EMBED = ("shared", "fp32")


# chosen with tests/bench/bench_weights.py (see the module docstring)
DEFAULTS = {
    "int8": QuantConfig(bits=8, block_size=32, symmetric=True, accuracy_level=4),
    "int4": QuantConfig(bits=4, block_size=32, symmetric=True, accuracy_level=4),
}


def quantize_weights(model: ir.Model, weights: str, *, block_size: int | None = None,
                     symmetric: bool | None = None, accuracy_level: int | None = None,
                     exclude: Iterable[str] = (), embed: str = "shared", pack: bool = False) -> tuple[ir.Model, dict]:
    """``weights="fp32"`` returns the model unchanged; ``"int8"``/``"int4"`` returns a new model
    whose constant-weight MatMuls (except ``exclude``) are MatMulNBits. With ``embed="shared"`` a
    token-embedding Gather whose table is the (quantized) head weight transposed reads the head's
    blocks (:func:`share_embedding`). With ``pack`` the MatMulNBits that read one input (gate and
    up) become one (:func:`pack_shared_input`). ``info`` records the configuration, which nodes were
    quantized / kept, the shared embedding (or None) and the packed groups."""
    if embed not in EMBED:
        raise ValueError(f"--weights-embed {embed!r}: one of {', '.join(EMBED)}")
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
    tied = None
    if embed == "shared":
        for n in model.graph:
            w = n.inputs[1] if n.op_type == "MatMul" and n.name not in exclude and len(n.inputs) == 2 else None
            if w is not None and w.const_value is not None and len(w.const_value.shape) == 2:
                g = tied_embedding(model.graph, w.const_value.numpy())
                if g is not None:
                    tied = (n.name, g.name)
                    break
    proto = matmul_nbits_proto(ir.serde.serialize_model(model), cfg, exclude)
    out = ir.serde.deserialize_model(proto)
    quantized = sorted(n.name.removesuffix("_Q4").removesuffix("_Q8") for n in out.graph
                       if n.op_type == "MatMulNBits")
    kept = sorted(before & {n.name for n in out.graph if n.op_type == "MatMul"})
    shared = None
    if tied is not None:
        nodes = {n.name: n for n in out.graph}
        head, gather = nodes.get(f"{tied[0]}_Q{cfg.bits}"), nodes.get(tied[1])
        if head is not None and gather is not None:
            share_embedding(out.graph, gather, head)
            shared = tied[1]
    packed = pack_shared_input(out.graph) if pack else []
    return out, {"weights": weights, **asdict(cfg), "quantized": quantized, "kept": kept,
                 "embedding_shared": shared, "packed": packed}


# --------------------------------------------------------------------------- the tied token embedding
def tied_embedding(graph: ir.Graph, W) -> ir.Node | None:
    """The token-embedding ``Gather`` (axis 0, constant float32 table) of ``graph`` whose table is
    exactly ``Wᵀ`` (``W`` [K, N]: a head weight), or None: the embedding tied to that head."""
    import numpy as np

    W = np.asarray(W)
    if W.ndim != 2 or W.dtype != np.float32:
        return None
    K, N = W.shape
    for node in graph:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        axis = node.attributes.get("axis")
        t = node.inputs[0]
        if (axis is not None and axis.as_int() != 0) or t is None or t.const_value is None:
            continue
        if tuple(t.const_value.shape) != (N, K) or t.const_value.dtype != ir.DataType.FLOAT:
            continue
        if equal_tables(t.const_value.numpy(), W.T):
            return node
    return None


def equal_tables(a, b) -> bool:
    """``np.array_equal`` of two large tables (an embedding and a head's transposed weight, memory-
    mapped views): the first row first (untied tables differ there: the rest is never read), then
    the rest a block of rows at a time (no table-sized temporary)."""
    import numpy as np

    if a.shape != b.shape:
        return False
    if a.ndim == 0 or a.shape[0] <= 1:
        return bool(np.array_equal(a, b))
    if not np.array_equal(a[:1], b[:1]):
        return False
    step = max(1, (64 << 20) // max(1, a[0].nbytes))
    return all(np.array_equal(a[lo:lo + step], b[lo:lo + step]) for lo in range(1, a.shape[0], step))


def block_rows(b, graph: ir.Graph, blob: ir.Value, scales: ir.Value, zero_points, idx: ir.Value, D: int,
               bits: int, block: int, prefix: str) -> ir.Value:
    """Rows ``idx`` of a MatMulNBits weight (its blocks ``blob`` [N, nb, blob_size] uint8, ``scales``
    [N, nb], unpacked ``zero_points`` [N, nb] uint8 or None for the default 2^(bits−1)) as float32
    ``[*idx.shape, D]`` (= rows of Wᵀ): com.microsoft ``GatherBlockQuantized`` over the blocks as they
    are (no new weight bytes; the scales are reshaped at run time). The nodes go to the
    ``kit.surgery.NodeBuilder`` ``b`` (the caller places them); constants, named under ``prefix``,
    are registered in ``graph``. Returns the output value."""
    import numpy as np

    from .kit import surgery

    N, nb = int(blob.const_value.shape[0]), int(blob.const_value.shape[1])
    s3 = b("Reshape", [scales, surgery.int64s(graph, f"{prefix}.scales_shape", [N, nb, 1])], "Scales")
    ins = [blob, idx, s3]
    if zero_points is not None:
        ins.append(surgery.initializer(graph, f"{prefix}.zero_points",
                                       np.asarray(zero_points, np.uint8).reshape(N, nb, 1)))
    q = b("GatherBlockQuantized", ins, "GatherBlockQuantized",
          dict(gather_axis=0, quantize_axis=2, block_size=block, bits=bits), domain="com.microsoft")  # [..., nb, block]
    rows_shape = [0] * len(idx.shape or [0, 0]) + [nb * block]
    r = b("Reshape", [q, surgery.int64s(graph, f"{prefix}.rows_shape", rows_shape)], "Rows")
    if nb * block != D:
        r = b("Slice", [r, surgery.int64s(graph, f"{prefix}.zero", [0]), surgery.int64s(graph, f"{prefix}.D", [D]),
                        surgery.int64s(graph, f"{prefix}.last", [-1])], "RowsSlice")
    return r


def share_embedding(graph: ir.Graph, gather: ir.Node, head: ir.Node) -> None:
    """Make the token-embedding ``gather`` read the MatMulNBits ``head``'s blocks (the head's weight
    is the embedding table transposed, :func:`tied_embedding`): GatherBlockQuantized nodes take its
    place and its float32 table is dropped when nothing else uses it."""
    from custom_ops.reference.head import unpack_zero_points

    from .kit import surgery

    bits = head.attributes["bits"].as_int()
    block = head.attributes["block_size"].as_int()
    blob, scales = head.inputs[1], head.inputs[2]
    zp_v = head.inputs[3] if len(head.inputs) > 3 else None
    N, nb = int(blob.const_value.shape[0]), int(blob.const_value.shape[1])
    zp = None if zp_v is None else unpack_zero_points(zp_v.const_value.numpy(), N, nb, bits)
    table = gather.inputs[0]
    D = int(table.const_value.shape[1])
    prefix = surgery.safe_name(gather.name) + ".shared"
    b = surgery.NodeBuilder(prefix)
    out = block_rows(b, graph, blob, scales, zp, gather.inputs[1], D, bits, block, prefix)
    for n in b.nodes:
        graph.insert_before(gather, n)
    surgery.take_over(graph, gather, out)
    surgery.drop_if_unused(graph, table)


# --------------------------------------------------------------------------- shared-input projections
_PACK_ATTRS = ("K", "bits", "block_size", "accuracy_level")


def _packable(node: ir.Node) -> bool:
    """A MatMulNBits with constant blocks and scales (and zero points), no g_idx / bias, 2-D scales."""
    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft" or not node.inputs or node.inputs[0] is None:
        return False
    ins = list(node.inputs)
    if len(ins) > 4 and any(v is not None for v in ins[4:]):
        return False
    if any(v is None or v.const_value is None for v in ins[1:3]) or (len(ins) > 3 and ins[3] is not None
                                                                   and ins[3].const_value is None):
        return False
    return len(node.outputs) == 1 and not node.outputs[0].is_graph_output()


def _pack_key(node: ir.Node) -> tuple:
    a = node.attributes
    return (tuple(a[k].as_int() if k in a else None for k in _PACK_ATTRS),
            len(node.inputs) > 3 and node.inputs[3] is not None,
            node.inputs[2].const_value.dtype, len(node.inputs[2].const_value.shape))


def _packed_name(names: list[str]) -> str:
    """"/model/layers.0/mlp/gate_proj/MatMul_Q4" + ".../up_proj/MatMul_Q4" -> ".../gate_up_proj/MatMul_Q4"."""
    import re

    parts = [re.search(r"([^/]*)_proj/", n) for n in names]
    if all(parts) and len({n[:m.start()] + n[m.end():] for n, m in zip(names, parts)}) == 1:
        m = parts[0]
        joined = "_".join(p.group(1) for p in parts)
        return f"{names[0][:m.start()]}{joined}_proj/{names[0][m.end():]}"
    return f"{names[0]}_packed"


def pack_shared_input(graph: ir.Graph) -> list[str]:
    """MatMulNBits nodes that read the same input with the same K, bits, block size, accuracy level
    and zero-point form (a Llama MLP's gate and up projections) → one MatMulNBits over their blocks
    concatenated along N and a ``Split`` giving each its old output: one weight stream and one
    kernel launch (one int8 quantization of the activations) instead of several. The same numbers:
    every output column keeps its own blocks, scales and zero points along K, and the activations'
    blocks along K are the same. Returns the packed nodes' names.

    Off by default (``quantize_weights(pack=False)``, ``--weights-pack off``): on SmolLM2-135M int4
    (2 cores, AVX2, ORT 1.32) decode and prefill measured the same as unpacked within the noise
    (±3 %, load 2-5; a 30-layer MLP chain at M=1 and M=128 too): the saved launch and activation
    quantization are ~µs per layer, and the Split adds a copy."""
    import numpy as np

    from .kit import surgery

    groups: dict[tuple, list[ir.Node]] = {}
    for node in graph:
        if _packable(node):
            groups.setdefault((id(node.inputs[0]), _pack_key(node)), []).append(node)
    opset = graph.opset_imports.get("", 0)
    done = []
    for nodes in groups.values():
        if len(nodes) < 2:
            continue
        first = nodes[0]
        Ns = [int(n.attributes["N"].as_int()) for n in nodes]
        name = _packed_name([n.name for n in nodes])
        base = surgery.safe_name(name)

        def cat(i: int, what: str) -> ir.Value:
            return surgery.initializer(graph, f"{base}.{what}",
                                       np.concatenate([n.inputs[i].const_value.numpy() for n in nodes], axis=0))

        ins = [first.inputs[0], cat(1, "weight_packed"), cat(2, "weight_scales")]
        if len(first.inputs) > 3 and first.inputs[3] is not None:
            ins.append(cat(3, "weight_zero_points"))
        attrs = [a for a in first.attributes.values() if a.name != "N"] + [ir.AttrInt64("N", sum(Ns))]
        mm = ir.Node("com.microsoft", "MatMulNBits", ins, attrs, name=name)
        mm.outputs[0].name = f"{name}_output_0"
        if opset >= 13:
            split = ir.Node("", "Split", [mm.outputs[0], surgery.int64s(graph, f"{base}.split", Ns)],
                            [ir.AttrInt64("axis", -1)], name=f"{name}/Split", num_outputs=len(nodes))
        else:
            split = ir.Node("", "Split", [mm.outputs[0]], [ir.AttrInt64("axis", -1), ir.AttrInt64s("split", Ns)],
                            name=f"{name}/Split", num_outputs=len(nodes))
        graph.insert_before(first, [mm, split])
        for n, out in zip(nodes, split.outputs):
            old = n.outputs[0]
            name_, old.name = old.name, None
            out.name, out.type, out.shape = name_, old.type, old.shape
            old.replace_all_uses_with(out)
            weights = [v for v in n.inputs[1:] if v is not None]
            graph.remove(n, safe=True)
            for v in weights:
                surgery.drop_if_unused(graph, v)
        done.append(name)
    return done


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
    """Ŵ [K, N] float32 that MatMulNBits computes with."""
    return Dequantized(packed, scales, zero_points, K, cfg).columns(0, packed.shape[0])


def dequantized(packed, scales, zero_points, K: int, cfg: QuantConfig) -> "Dequantized":
    """Ŵ as :func:`dequantize_matrix` gives it, as a view that dequantizes only the columns asked
    for (``What[:, j0:j1]``; ``np.asarray(What)`` for all of them): ``kit.gaps.layer_gap`` measures a
    block of columns at a time, so a quantized lm_head's float copy (1536 x 151936: 0.9 GB, and
    its intermediates several times that) is never made whole."""
    return Dequantized(packed, scales, zero_points, K, cfg)


class Dequantized:
    """Ŵ of one MatMulNBits weight, dequantized on demand by output columns (see dequantized)."""

    def __init__(self, packed, scales, zero_points, K: int, cfg: QuantConfig):
        if cfg.bits not in (4, 8):
            raise ValueError(f"dequantize: {cfg.bits} bits not supported")
        self.packed, self.scales, self.zero_points, self.K, self.cfg = packed, scales, zero_points, int(K), cfg
        self.shape = (int(K), int(packed.shape[0]))
        self.dtype = __import__("numpy").dtype("float32")
        self.ndim = 2

    def columns(self, j0: int, j1: int):
        """Ŵ[:, j0:j1] float32."""
        import numpy as np

        packed = self.packed[j0:j1]
        n, kb, _ = packed.shape
        bits, bs = self.cfg.bits, self.cfg.block_size
        if bits == 8:
            q = packed.reshape(n, kb, -1)[:, :, :bs].astype(np.float32)
        else:
            q = np.empty((n, kb, packed.shape[2] * 2), np.float32)
            q[:, :, 0::2] = packed & 0x0F
            q[:, :, 1::2] = packed >> 4
            q = q[:, :, :bs]
        mid = 1 << (bits - 1)
        zp = self.zero_points
        if zp is None:
            z = np.float32(mid)
        elif bits == 8:
            z = zp[j0:j1].reshape(n, -1)[:, :kb].astype(np.float32)[:, :, None]
        else:
            zz = zp[j0:j1]
            z = np.stack([zz & 0x0F, zz >> 4], axis=-1).reshape(n, -1)[:, :kb].astype(np.float32)[:, :, None]
        q -= z
        q *= self.scales[j0:j1].reshape(n, kb)[:, :, None]
        return np.ascontiguousarray(q.reshape(n, kb * bs)[:, : self.K].T)

    def __getitem__(self, idx):
        if isinstance(idx, tuple) and len(idx) == 2 and idx[0] == slice(None) and isinstance(idx[1], slice):
            j0, j1, step = idx[1].indices(self.shape[1])
            if step == 1:
                return self.columns(j0, j1)
        return self.__array__()[idx]

    def __array__(self, dtype=None, copy=None):
        a = self.columns(0, self.shape[1])
        return a if dtype is None else a.astype(dtype)