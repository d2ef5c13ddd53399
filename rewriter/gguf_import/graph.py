"""The fused decoder graph of a GGUF, written directly: the graph ``ortlean rewrite`` makes of the model's
optimum export with ``--weights gguf`` (rewriter/fuse + backends/weights), node for node — the embedding a
BlockQuantGather (Gemma 3: times √hidden), per layer SimplifiedLayerNormalization /
SkipSimplifiedLayerNormalization, the q/k/v projection (packed into one BlockQuantMatMul per run of one
format, Qwen2's biases in the op), GroupQueryAttention with rotary inside (Gemma 3: q/k RMSNorms per head in
front, the sliding window, local and global rotary caches), o, the MLP (SwiGLU: one BlockQuantMatMul with
glu = "silu"; Gemma 3: gate, the exported tanh-GELU, up), the final norm and the head (tied: the
embedding's own initializer). ``--attn-exact`` then turns GroupQueryAttention into exact PackedAttention
as the rewrite does (``backends.packed_attention.ExactAttentionPass``).

Weights are the GGUF's bytes: each BlockQuantMatMul / BlockQuantGather initializer is an ``ir.LazyTensor``
that copies its rows from the file's memory map when the model is written (one tensor at a time, the pages
given back after), so no float32 weight is ever made. Row order follows Hugging Face's, as the export does:
llama.cpp stores a llama model's attn_q / attn_k rows permuted for its rotary layout
(``convert_hf_to_gguf.py``'s ``permute``), and the import reads them back in the export's order (the
rewrite's hash matcher finds the same permutation: "rows permuted" in its report).

Numbers as the export path makes them: Gemma's norm weights (stored as 1 + w) as the export folds them,
fl(1 + fl(s − 1)); the rotary caches evaluated by ONNX Runtime from the export's own subgraph (MatMul of the
inverse frequencies with the positions, Concat, Cos / Sin), the inverse frequencies 1 / fl32(base^(2i/d))
with the power correctly rounded. PyTorch's vectorized pow (Sleef, which the export's constants come from when
the export ran on an AVX2 / AVX-512 CPU; its scalar path rounds correctly) is within 1 ulp of that and differs
where the power is within a relative ~2^-30 of a float32 rounding tie (10^3.46875, which rope bases 10^4 and
10^6 both reach: one frequency of Qwen2.5 and Gemma 3, one ulp), the one source of a difference from the export
path's logits (docs/import.md; tests/test_gguf_import.py swaps the export's caches in and gets its logits bit
for bit)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from custom_ops.reference import blockquant as bq

from ..builders import blockgraph as BG
from ..kit import surgery
from .reader import GGUFFile, GGUFImportError, HParams

MS = "com.microsoft"
OPSETS = {"": 18, MS: 1, "ai.ortlean": 1}
F32 = ir.DataType.FLOAT
I64 = ir.DataType.INT64
PAST = "past_sequence_length"
TOTAL = "past_sequence_length + sequence_length"


@dataclass
class Piece:
    """Rows of one GGUF tensor in a projection: its name, the order its rows are read in (None: as stored)
    and its bias tensor (None: no bias)."""
    tensor: str
    perm: np.ndarray | None = None
    bias: str | None = None


def unpermute(n_head: int, n_rows: int) -> np.ndarray:
    """Row order undoing llama.cpp's q/k permutation: GGUF row h·d + 2i + j holds Hugging Face row
    h·d + j·d/2 + i (``permute``: reshape (heads, 2, d/2), swap the last two axes)."""
    d = n_rows // n_head
    return np.arange(n_rows).reshape(n_head, d // 2, 2).transpose(0, 2, 1).reshape(-1)


def inv_freq(base: float, dim: int) -> np.ndarray:
    """float32 1 / base^(2i/dim), the power correctly rounded to float32 (see the module docstring)."""
    e = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float64(base) ** e.astype(np.float64)).astype(np.float32)).astype(np.float32)


def rotary_caches(freqs: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """GroupQueryAttention's cos_cache / sin_cache [rows, d/2] for inverse frequencies ``freqs`` [d/2]: the
    export's rotary subgraph (MatMul [1, d/2, 1] × [1, 1, rows], Transpose, Concat of the two halves, Cos /
    Sin, × 1.0) run by ONNX Runtime, so the values are the ones the fusion measures from the export."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    f = np.asarray(freqs, np.float32).reshape(1, -1, 1)
    h = f.shape[1]
    nodes = [helper.make_node("MatMul", ["f", "p"], ["m"]), helper.make_node("Transpose", ["m"], ["t"], perm=[0, 2, 1]),
             helper.make_node("Concat", ["t", "t"], ["e"], axis=-1),
             helper.make_node("Cos", ["e"], ["c0"]), helper.make_node("Sin", ["e"], ["s0"]),
             helper.make_node("Mul", ["c0", "one"], ["c"]), helper.make_node("Mul", ["s0", "one"], ["s"])]
    g = helper.make_graph(nodes, "rotary", [helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, 1, rows])],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, rows, 2 * h]) for n in ("c", "s")],
                          [numpy_helper.from_array(f, "f"), numpy_helper.from_array(np.array(1.0, np.float32), "one")])
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString(),
                                so, providers=["CPUExecutionProvider"])
    c, s = sess.run(None, {"p": np.arange(rows, dtype=np.float32).reshape(1, 1, rows)})
    return np.ascontiguousarray(c[0, :, :h]), np.ascontiguousarray(s[0, :, :h])


def check_scales(gf: GGUFFile, name: str, W: np.ndarray, fmt: str, row0: int = 0) -> None:
    """The fp16 scale fields of every block of rows ``W`` (rows ``row0``… of tensor ``name``) are finite (the
    op refuses a NaN / inf scale at session creation; a GGUF holding one is corrupt): raises naming the
    tensor, row and block."""
    ts = bq.TYPE_SIZE[fmt]
    blocks = W.reshape(W.shape[0], -1, ts)
    for off in bq.SCALE_FIELDS[fmt]:
        h = np.ascontiguousarray(blocks[:, :, off:off + 2]).view("<f2")[..., 0]
        bad = ~np.isfinite(h)
        if bad.any():
            r, b = (int(x[0]) for x in np.nonzero(bad))
            raise GGUFImportError(f"{gf.path}: tensor {name} row {row0 + r} block {b}: non-finite fp16 scale "
                                  f"({h[r, b]}) — a corrupt GGUF")


class _Graph:
    """Nodes, initializers and I/O of the graph being built (named as the rewrite names them)."""

    def __init__(self):
        self.nodes: list[ir.Node] = []
        self.inits: dict[str, ir.Value] = {}
        self.inputs: list[ir.Value] = []
        self.outputs: list[ir.Value] = []

    def node(self, op: str, inputs, name: str, attrs: dict | None = None, domain: str = "", outs=1,
             out_names: list[str] | None = None) -> list[ir.Value]:
        node = ir.Node(domain, op, list(inputs), attributes=[ir.convenience.convert_attribute(k, v)
                                                             for k, v in (attrs or {}).items()],
                       name=name, num_outputs=outs)
        return self._add(node, out_names)

    def add(self, node: ir.Node, out_names: list[str] | None = None) -> list[ir.Value]:
        return self._add(node, out_names)

    def _add(self, node, out_names):
        names = list(out_names or [])
        for k, v in enumerate(node.outputs):
            n = names[k] if k < len(names) else None
            v.name = n if n is not None else f"{node.name}_output_{k}"     # "": an absent optional output
        self.nodes.append(node)
        return list(node.outputs)

    def init(self, name: str, tensor) -> ir.Value:
        if name in self.inits:
            return self.inits[name]
        if isinstance(tensor, np.ndarray):
            tensor = ir.tensor(np.ascontiguousarray(tensor), name=name)
        v = ir.Value(name=name, const_value=tensor, type=ir.TensorType(tensor.dtype), shape=ir.Shape(tensor.shape))
        self.inits[name] = v
        return v

    def const(self, name: str, array) -> ir.Value:
        return self.node("Constant", [], name, {"value": ir.tensor(np.asarray(array), name=name)},
                         out_names=[f"{name}_output_0"])[0]

    def io(self, name: str, dtype, shape, output: bool = False, value: ir.Value | None = None) -> ir.Value:
        v = value if value is not None else ir.Value(name=name)
        v.name, v.type, v.shape = name, ir.TensorType(dtype), ir.Shape(shape)
        (self.outputs if output else self.inputs).append(v)
        return v


class Builder:
    """Builds the fused graph of ``gf`` (hyper-parameters ``hp``) as an ``ir.Model``. ``layout``: W's row
    layout choice (``--weights-layout``), ``act_bits``: BlockQuantMatMul's activations, ``glu``: the
    SwiGLU MLP as one op."""

    def __init__(self, gf: GGUFFile, hp: HParams, *, layout: str = "auto", act_bits: int = 16, glu: bool = True):
        self.gf, self.hp, self.layout, self.act_bits, self.glu = gf, hp, layout, int(act_bits), glu
        self.g = _Graph()
        self.formats: dict[str, int] = {}         # format -> BlockQuantMatMul/Gather nodes
        self.layouts = {"split": 0, "blocks": 0}
        self.float_weights: list[str] = []        # GGUF tensors kept as float32 (the file holds them as floats)

    # ------------------------------------------------------------------ weights
    def _layout(self, fmt: str) -> str:
        return BG.row_layout(self.layout, fmt, None, self.act_bits)[0]

    def _blocks(self, init_name: str, pieces: list[Piece], fmt: str, K: int, layout: str) -> ir.Value:
        """The BlockQuantMatMul initializer [N, row_bytes] of ``pieces`` (one format), read when written."""
        gf = self.gf
        N = sum(int(np.prod(gf.tensors[p.tensor].ne[1:])) for p in pieces)
        row_bytes = bq.row_bytes(fmt, K)

        def make():
            arrs = []
            for p in pieces:
                r = gf.rows(p.tensor)
                arrs.append(r[p.perm] if p.perm is not None else np.array(r))
                gf.release(p.tensor)
            W = arrs[0] if len(arrs) == 1 else np.concatenate(arrs)
            del arrs
            if layout == "split":
                W = BG.layout_bytes(W, "split", fmt, K)
            return ir.tensor(np.ascontiguousarray(W), name=init_name)

        return self.g.init(init_name, ir.LazyTensor(make, dtype=ir.DataType.UINT8, shape=ir.Shape([N, row_bytes]),
                                                    name=init_name))

    def _float_weight(self, init_name: str, pieces: list[Piece], transpose: bool) -> ir.Value:
        """A float32 initializer of float GGUF tensors (F32 / F16 / BF16, as the rewrite keeps them): [K, N]
        (MatMul's B) with ``transpose``, else the rows [N, K] (an embedding table)."""
        gf = self.gf
        K = int(gf.tensors[pieces[0].tensor].ne[0])
        N = sum(int(np.prod(gf.tensors[p.tensor].ne[1:])) for p in pieces)
        self.float_weights += [p.tensor for p in pieces]

        def make():
            arrs = []
            for p in pieces:
                a = gf.floats(p.tensor).reshape(-1, K)
                arrs.append(a[p.perm] if p.perm is not None else a)
            W = np.concatenate(arrs) if len(arrs) > 1 else arrs[0]
            return ir.tensor(np.ascontiguousarray(W.T if transpose else W), name=init_name)

        shape = [K, N] if transpose else [N, K]
        return self.g.init(init_name, ir.LazyTensor(make, dtype=F32, shape=ir.Shape(shape), name=init_name))

    def _vector(self, name: str, gguf_names: list[str], perm: list | None = None, gemma_norm: bool = False) -> ir.Value:
        """A float32 1-D initializer from F32 GGUF vectors (concatenated; Gemma's norms as the export folds them)."""
        parts = []
        for i, n in enumerate(gguf_names):
            a = self.gf.floats(n).reshape(-1)
            if perm is not None and perm[i] is not None:
                a = a[perm[i]]
            parts.append(a)
        a = np.concatenate(parts).astype(np.float32) if len(parts) > 1 else parts[0].astype(np.float32)
        if gemma_norm:      # stored as 1 + w; the export computes 1 + (s − 1) in float32 and folds it
            one = np.float32(1.0)
            a = (one + (a - one).astype(np.float32)).astype(np.float32)
        return self.g.init(name, a)

    def _count(self, fmt: str, layout: str, n: int = 1) -> None:
        self.formats[fmt] = self.formats.get(fmt, 0) + n
        self.layouts[layout] = self.layouts.get(layout, 0) + n

    # ------------------------------------------------------------------ projections
    def projection(self, x: ir.Value, name: str, pieces: list[Piece], target: str, layer: str,
                   out_name: str | None = None) -> ir.Value:
        """``x`` times the rows of ``pieces`` (+ their biases): one BlockQuantMatMul per run of pieces of one
        format (a float run: MatMul + Add), a Concat when there are several — as the rewrite emits a GGUF
        weight (``backends/weights.py``). ``name``: the export's MatMul name."""
        gf = self.gf
        K = int(gf.tensors[pieces[0].tensor].ne[0])
        runs: list[list[Piece]] = []
        for p in pieces:
            f = gf.tensors[p.tensor].format
            if runs and gf.tensors[runs[-1][0].tensor].format == f:
                runs[-1].append(p)
            else:
                runs.append([p])
        has_bias = any(p.bias for p in pieces)
        base = surgery.safe_name(name)
        source = "gguf:" + ",".join(p.tensor for p in pieces)
        multi = len(runs) > 1
        outs = []
        for i, run in enumerate(runs):
            sfx = f"_{i}" if multi else ""
            fmt = gf.tensors[run[0].tensor].format
            N = sum(int(np.prod(gf.tensors[p.tensor].ne[1:])) for p in run)
            bias = None
            if has_bias:
                vec = []
                for p in run:
                    n_p = int(np.prod(gf.tensors[p.tensor].ne[1:]))
                    if p.bias:
                        b = gf.floats(p.bias).reshape(-1)
                        vec.append(b[p.perm] if p.perm is not None else b)
                    else:
                        vec.append(np.zeros(n_p, np.float32))
                bias = self.g.init(f"{base}.bias{sfx}", np.concatenate(vec).astype(np.float32))
            last = (not multi) and out_name is not None
            if fmt is None:
                w = self._float_weight(f"{base}.weight{sfx}", run, transpose=True)
                y = self.g.node("MatMul", [x, w], f"{name}{sfx}",
                                out_names=[None if bias is not None or not last else out_name])[0]
                if bias is not None:
                    y = self.g.node("Add", [y, bias], f"{name}{sfx}/Add", out_names=[out_name if last else None])[0]
                outs.append(y)
                continue
            layout = self._layout(fmt)
            w = self._blocks(f"{base}.weight_{fmt}{sfx}", run, fmt, K, layout)
            attrs = {"format": fmt, "K": K, "N": N, "act_bits": self.act_bits, "layer": layer, "target": target,
                     "source": source, "bits_per_weight": 8.0 * bq.row_bytes(fmt, K) / K, "params_dense": K * N,
                     "params_stored": K * N, "gap": 0.0}
            if layout != "blocks":
                attrs["layout"] = layout
            node = surgery.op_node("BlockQuantMatMul", [x, w, bias], attrs, name=f"{name}_BQ{sfx}")
            outs.append(self.g.add(node, [out_name if last else None])[0])
            self._count(fmt, layout)
        if multi:
            return self.g.node("Concat", outs, f"{name}_BQ/Concat", {"axis": -1}, out_names=[out_name])[0]
        return outs[0]

    def swiglu(self, x: ir.Value, i: int, out_name: str) -> ir.Value:
        """silu(x·gate) · (x·up): one BlockQuantMatMul with glu = "silu" when gate and up are one format and
        layout (``--weights-glu on``), else the export's Sigmoid / Mul / Mul after two projections."""
        gf = self.gf
        b, pre = f"blk.{i}", f"/model/layers.{i}/mlp"
        gate, up = gf.tensors[f"{b}.ffn_gate.weight"], gf.tensors[f"{b}.ffn_up.weight"]
        fmt = gate.format
        if self.glu and fmt is not None and fmt == up.format:
            K, F = int(gate.ne[0]), int(gate.ne[1])
            layout = self._layout(fmt)
            name = f"{pre}/gate_up_proj/MatMul_BQ"
            w = self._blocks(f"{surgery.safe_name(name)}.weight_blocks", [Piece(gate.name), Piece(up.name)], fmt, K, layout)
            attrs = {"format": fmt, "K": K, "act_bits": self.act_bits, "layer": str(i), "target": "mlp",
                     "bits_per_weight": 8.0 * bq.row_bytes(fmt, K) / K, "gap": 0.0, "N": 2 * F, "glu": "silu",
                     "source": f"gguf:{gate.name},{up.name}", "params_dense": 2 * K * F, "params_stored": 2 * K * F}
            if layout != "blocks":
                attrs["layout"] = layout
            self._count(fmt, layout)
            return self.g.add(surgery.op_node("BlockQuantMatMul", [x, w], attrs, name=name), [out_name])[0]
        g = self.projection(x, f"{pre}/gate_proj/MatMul", [Piece(gate.name)], "mlp", str(i),
                            f"{pre}/gate_proj/MatMul_output_0")
        u = self.projection(x, f"{pre}/up_proj/MatMul", [Piece(up.name)], "mlp", str(i), f"{pre}/up_proj/MatMul_output_0")
        s = self.g.node("Sigmoid", [g], f"{pre}/act_fn/Sigmoid", out_names=[f"{pre}/act_fn/Sigmoid_output_0"])[0]
        a = self.g.node("Mul", [g, s], f"{pre}/act_fn/Mul", out_names=[f"{pre}/act_fn/Mul_output_0"])[0]
        return self.g.node("Mul", [a, u], f"{pre}/Mul", out_names=[out_name])[0]

    def gelu_mlp(self, x: ir.Value, i: int, out_name: str) -> ir.Value:
        """Gemma's MLP: gelu_tanh(x·gate) · (x·up), the GELU as the export writes it (0.5·g·(1 + tanh(√(2/π)·
        (g + 0.044715·g³))))."""
        b, pre = f"blk.{i}", f"/model/layers.{i}/mlp"
        g = self.projection(x, f"{pre}/gate_proj/MatMul", [Piece(f"{b}.ffn_gate.weight")], "mlp", str(i),
                            f"{pre}/gate_proj/MatMul_output_0")
        a = f"{pre}/act_fn"
        c = [self.g.const(f"{a}/Constant{sfx}", np.array(v, np.float32)) for sfx, v in
             (("", 0.044715), ("_1", math.sqrt(2.0 / math.pi)), ("_2", 1.0), ("_3", 0.5))]
        n = self.g.node
        m0 = n("Mul", [g, g], f"{a}/Mul", out_names=[f"{a}/Mul_output_0"])[0]
        m1 = n("Mul", [g, m0], f"{a}/Mul_1", out_names=[f"{a}/Mul_1_output_0"])[0]
        m2 = n("Mul", [c[0], m1], f"{a}/Mul_2", out_names=[f"{a}/Mul_2_output_0"])[0]
        s0 = n("Add", [g, m2], f"{a}/Add", out_names=[f"{a}/Add_output_0"])[0]
        m3 = n("Mul", [c[1], s0], f"{a}/Mul_3", out_names=[f"{a}/Mul_3_output_0"])[0]
        t = n("Tanh", [m3], f"{a}/Tanh", out_names=[f"{a}/Tanh_output_0"])[0]
        s1 = n("Add", [c[2], t], f"{a}/Add_1", out_names=[f"{a}/Add_1_output_0"])[0]
        m4 = n("Mul", [g, s1], f"{a}/Mul_4", out_names=[f"{a}/Mul_4_output_0"])[0]
        act = n("Mul", [c[3], m4], f"{a}/Mul_5", out_names=[f"{a}/Mul_5_output_0"])[0]
        u = self.projection(x, f"{pre}/up_proj/MatMul", [Piece(f"{b}.ffn_up.weight")], "mlp", str(i),
                            f"{pre}/up_proj/MatMul_output_0")
        return n("Mul", [act, u], f"{pre}/Mul", out_names=[out_name])[0]

    # ------------------------------------------------------------------ norms
    def sln(self, x: ir.Value, w: ir.Value, name: str, out_name: str) -> ir.Value:
        return self.g.node("SimplifiedLayerNormalization", [x, w], name,
                           {"epsilon": float(self.hp.eps), "axis": -1, "stash_type": 1}, out_names=[out_name])[0]

    def skip_sln(self, x: ir.Value, skip: ir.Value, w: ir.Value, name: str, out_name: str,
                 sum_name: str | None) -> tuple[ir.Value, ir.Value | None]:
        outs = 4 if sum_name else 1
        vals = self.g.node("SkipSimplifiedLayerNormalization", [x, skip, w], name, {"epsilon": float(self.hp.eps)},
                           domain=MS, outs=outs, out_names=[out_name, "", "", sum_name] if sum_name else [out_name])
        return vals[0], (vals[3] if sum_name else None)

    def head_norm(self, x: ir.Value, w: ir.Value, heads: int, name: str) -> ir.Value:
        """Gemma 3's per-head q/k RMSNorm in front of GQA: Reshape [0, 0, heads, d] → SLN → Reshape [0, 0, heads·d]."""
        d = self.hp.head_dim
        s1 = self.g.const(f"{name}/shape_in", np.array([0, 0, heads, d], np.int64))
        r = self.g.node("Reshape", [x, s1], f"{name}/Reshape", out_names=[f"{name}/Reshape_output_0"])[0]
        y = self.g.node("SimplifiedLayerNormalization", [r, w], f"{name}/per_head",
                        {"epsilon": float(self.hp.eps), "axis": -1, "stash_type": 1},
                        out_names=[f"{name}/per_head_output_0"])[0]
        s2 = self.g.const(f"{name}/shape_out", np.array([0, 0, heads * d], np.int64))
        return self.g.node("Reshape", [y, s2], f"{name}/Reshape_1", out_names=[f"{name}/Reshape_1_output_0"])[0]

    # ------------------------------------------------------------------ the model
    def build(self) -> ir.Model:
        gf, hp, g = self.gf, self.hp, self.g
        gemma = hp.arch == "gemma3"
        ids = g.io("input_ids", I64, ["batch_size", "sequence_length"])
        mask = g.io("attention_mask", I64, ["batch_size", TOTAL])
        if not gemma:
            g.io("position_ids", I64, ["batch_size", "sequence_length"])
        past = [(g.io(f"past_key_values.{i}.key", F32, ["batch_size", hp.n_kv, PAST, hp.head_dim]),
                 g.io(f"past_key_values.{i}.value", F32, ["batch_size", hp.n_kv, PAST, hp.head_dim]))
                for i in range(hp.n_layers)]

        # embedding (tied head: the embedding's blocks are the head's initializer, in the head's layout)
        emb = gf.tensors["token_embd.weight"]
        tied = "output.weight" not in gf.tensors
        V, D = int(emb.ne[1]), int(emb.ne[0])
        head_w = None
        x_name = "/model/embed_tokens/Gather_output_0"
        if emb.format is not None:
            if tied:
                layout = self._layout(emb.format)
                w = head_w = self._blocks(f"lm_head.MatMul.weight_{emb.format}", [Piece(emb.name)], emb.format, D, layout)
                layer = "head"
            else:
                layout = "blocks"
                w = self._blocks(f"model.embed_tokens.Gather.weight_{emb.format}", [Piece(emb.name)], emb.format, D,
                                 layout)
                layer = "embed"
            attrs = {"format": emb.format, "K": D, "N": V, "layer": layer, "target": "head", "source": f"gguf:{emb.name}",
                     "bits_per_weight": 8.0 * bq.row_bytes(emb.format, D) / D, "params_dense": D * V,
                     "params_stored": D * V}
            if layout != "blocks":
                attrs["layout"] = layout
            x = g.add(surgery.op_node("BlockQuantGather", [w, ids], attrs, name="/model/embed_tokens/Gather_BQ"),
                      [x_name])[0]
            self._count(emb.format, layout)
        else:
            table = self._float_weight("model.embed_tokens.weight", [Piece(emb.name)], transpose=False)
            x = g.node("Gather", [table, ids], "/model/embed_tokens/Gather", {"axis": 0}, out_names=[x_name])[0]
        if gemma:
            c = g.const("/model/embed_tokens/Constant", np.array(math.sqrt(hp.hidden), np.float32))
            x = g.node("Mul", [x, c], "/model/embed_tokens/Mul", out_names=["/model/embed_tokens/Mul_output_0"])[0]

        # GroupQueryAttention's seqlens_k = sum(mask) − 1 and total_sequence_length = mask.shape[1] (int32)
        one = g.node("Constant", [], "node_Constant_0", {"value": ir.tensor(np.array([1], np.int64))})[0]
        rsum = g.node("ReduceSum", [mask, one], "node_ReduceSum_1", {"keepdims": 0})[0]
        c1 = g.node("Constant", [], "node_Constant_2", {"value_int": 1})[0]
        seqlens = g.node("Cast", [g.node("Sub", [rsum, c1], "node_Sub_3")[0]], "node_Cast_4",
                         {"to": int(ir.DataType.INT32)})[0]
        shp = g.node("Shape", [mask], "node_Shape_5")[0]
        total = g.node("Cast", [g.node("Gather", [shp, c1], "node_Gather_7", {"axis": 0})[0]], "node_Cast_8",
                       {"to": int(ir.DataType.INT32)})[0]

        caches = self._caches(gemma)
        resid = x
        h = self.sln(x, self._norm("model.layers.0.input_layernorm.weight", "blk.0.attn_norm.weight", gemma),
                     "RMSNorm_0", "/model/layers.0/input_layernorm/Mul_1_output_0")
        for i in range(hp.n_layers):
            b, L = f"blk.{i}", f"/model/layers.{i}"
            sa = f"{L}/self_attn"
            if gemma:
                q = self.projection(h, f"{sa}/q_proj/MatMul", [Piece(f"{b}.attn_q.weight", bias=self._bias(f"{b}.attn_q.bias"))],
                                    "attn", str(i), f"{sa}/q_proj/MatMul_output_0")
                k = self.projection(h, f"{sa}/k_proj/MatMul", [Piece(f"{b}.attn_k.weight", bias=self._bias(f"{b}.attn_k.bias"))],
                                    "attn", str(i), f"{sa}/k_proj/MatMul_output_0")
                v = self.projection(h, f"{sa}/v_proj/MatMul", [Piece(f"{b}.attn_v.weight", bias=self._bias(f"{b}.attn_v.bias"))],
                                    "attn", str(i), f"{sa}/v_proj/MatMul_output_0")
                q = self.head_norm(q, self._vector(f"model.layers.{i}.self_attn.q_norm.weight", [f"{b}.attn_q_norm.weight"],
                                                   gemma_norm=True), hp.n_head, f"{sa}/q_norm")
                k = self.head_norm(k, self._vector(f"model.layers.{i}.self_attn.k_norm.weight", [f"{b}.attn_k_norm.weight"],
                                                   gemma_norm=True), hp.n_kv, f"{sa}/k_norm")
                qkv = [q, k, v]
            else:
                pq = unpermute(hp.n_head, hp.n_head * hp.head_dim) if hp.arch == "llama" else None
                pk = unpermute(hp.n_kv, hp.n_kv * hp.head_dim) if hp.arch == "llama" else None
                pieces = [Piece(f"{b}.attn_q.weight", pq, self._bias(f"{b}.attn_q.bias")),
                          Piece(f"{b}.attn_k.weight", pk, self._bias(f"{b}.attn_k.bias")),
                          Piece(f"{b}.attn_v.weight", None, self._bias(f"{b}.attn_v.bias"))]
                qkv = [self.projection(h, f"{sa}/qkv_proj/MatMul", pieces, "attn", str(i)), None, None]
            local = hp.sliding_window > 0 and i not in hp.global_layers
            cos, sin = caches["local" if local else "global"]
            attrs = {"num_heads": hp.n_head, "kv_num_heads": hp.n_kv, "do_rotary": 1, "rotary_interleaved": 0}
            if hp.attn_scale is not None:
                attrs["scale"] = float(hp.attn_scale)
            if local:
                attrs["local_window_size"] = int(hp.sliding_window)
            pk_in, pv_in = past[i]
            att = g.node("GroupQueryAttention", [*qkv, pk_in, pv_in, seqlens, total, cos, sin], f"{sa}/GroupQueryAttention",
                         attrs, domain=MS, outs=3, out_names=[f"{sa}/GroupQueryAttention_output_0"])
            g.io(f"present.{i}.key", F32, ["batch_size", hp.n_kv, TOTAL, hp.head_dim], output=True, value=att[1])
            g.io(f"present.{i}.value", F32, ["batch_size", hp.n_kv, TOTAL, hp.head_dim], output=True, value=att[2])
            o = self.projection(att[0], f"{sa}/o_proj/MatMul",
                                [Piece(f"{b}.attn_output.weight", bias=self._bias(f"{b}.attn_output.bias"))],
                                "attn", str(i), f"{sa}/o_proj/MatMul_output_0")
            last = i == hp.n_layers - 1
            nxt_w = (self._norm("model.norm.weight", "output_norm.weight", gemma) if last else
                     self._norm(f"model.layers.{i + 1}.input_layernorm.weight", f"blk.{i + 1}.attn_norm.weight", gemma))
            nxt_name = "/model/norm/Mul_1_output_0" if last else f"/model/layers.{i + 1}/input_layernorm/Mul_1_output_0"
            if gemma:
                o = self.sln(o, self._norm(f"model.layers.{i}.post_attention_layernorm.weight",
                                           f"{b}.post_attention_norm.weight", True),
                             f"{L}/post_attention_layernorm", f"{L}/post_attention_layernorm/Mul_1_output_0")
                m, resid = self.skip_sln(resid, o, self._norm(f"model.layers.{i}.pre_feedforward_layernorm.weight",
                                                              f"{b}.ffn_norm.weight", True),
                                         f"{L}/pre_feedforward_layernorm", f"{L}/pre_feedforward_layernorm/Mul_1_output_0",
                                         f"{L}/Add_output_0")
                d = self.projection(self.gelu_mlp(m, i, f"{L}/mlp/Mul_output_0"), f"{L}/mlp/down_proj/MatMul",
                                    [Piece(f"{b}.ffn_down.weight")], "mlp", str(i), f"{L}/mlp/down_proj/MatMul_output_0")
                d = self.sln(d, self._norm(f"model.layers.{i}.post_feedforward_layernorm.weight",
                                           f"{b}.post_ffw_norm.weight", True),
                             f"{L}/post_feedforward_layernorm", f"{L}/post_feedforward_layernorm/Mul_1_output_0")
            else:
                m, resid = self.skip_sln(resid, o, self._norm(f"model.layers.{i}.post_attention_layernorm.weight",
                                                              f"{b}.ffn_norm.weight", False),
                                         f"{L}/post_attention_layernorm", f"{L}/post_attention_layernorm/Mul_1_output_0",
                                         f"{L}/Add_output_0")
                d = self.projection(self.swiglu(m, i, f"{L}/mlp/Mul_output_0"), f"{L}/mlp/down_proj/MatMul",
                                    [Piece(f"{b}.ffn_down.weight")], "mlp", str(i), f"{L}/mlp/down_proj/MatMul_output_0")
            h, resid = self.skip_sln(resid, d, nxt_w, f"{L}/Add_1" if not last else "/model/norm", nxt_name,
                                     None if last else f"{L}/Add_1_output_0")

        # the head
        if head_w is not None:
            attrs = {"format": emb.format, "K": D, "N": V, "act_bits": self.act_bits, "layer": "head", "target": "head",
                     "source": f"gguf:{emb.name}", "bits_per_weight": 8.0 * bq.row_bytes(emb.format, D) / D,
                     "params_dense": D * V, "params_stored": D * V, "gap": 0.0}
            lay = self._layout(emb.format)
            if lay != "blocks":
                attrs["layout"] = lay
            logits = g.add(surgery.op_node("BlockQuantMatMul", [h, head_w], attrs, name="/lm_head/MatMul_BQ"),
                           ["logits"])[0]
            self._count(emb.format, lay)
        else:
            src = "token_embd.weight" if tied else "output.weight"
            logits = self.projection(h, "/lm_head/MatMul", [Piece(src)], "head", "head", "logits")
        g.outputs.insert(0, logits)
        logits.type, logits.shape = ir.TensorType(F32), ir.Shape(["batch_size", "sequence_length", V])

        graph = ir.Graph(g.inputs, g.outputs, nodes=g.nodes, initializers=list(g.inits.values()),
                         opset_imports=dict(OPSETS), name="main_graph")
        from .. import __version__

        return ir.Model(graph, ir_version=8, producer_name="ortlean import", producer_version=__version__)

    def _bias(self, name: str) -> str | None:
        return name if name in self.gf.tensors else None

    def _norm(self, name: str, gguf_name: str, gemma: bool) -> ir.Value:
        return self._vector(name, [gguf_name], gemma_norm=gemma)

    def _caches(self, gemma: bool) -> dict:
        """{"global"|"local": (cos, sin) initializers}: one pair unless Gemma 3's sliding layers differ."""
        hp, gf = self.hp, self.gf
        rows = hp.context
        f = inv_freq(hp.rope_base, hp.head_dim)
        if "rope_freqs.weight" in gf.tensors:     # llama 3.x: per-frequency divisors (llama.cpp divides theta)
            f = (f / gf.floats("rope_freqs.weight").reshape(-1).astype(np.float32)).astype(np.float32)
        if hp.rope_linear != 1.0:
            f = (f / np.float32(hp.rope_linear)).astype(np.float32)
        c, s = rotary_caches(f, rows)
        if not (gemma and hp.sliding_window > 0 and len(hp.global_layers) < hp.n_layers):
            pair = (self.g.init("cos_cache", c), self.g.init("sin_cache", s))
            return {"global": pair, "local": pair}
        cl, sl = rotary_caches(inv_freq(hp.rope_base_local, hp.head_dim), rows)
        out = {"local": (self.g.init("cos_cache_local", cl), self.g.init("sin_cache_local", sl))}
        if hp.global_layers:
            out["global"] = (self.g.init("cos_cache_global", c), self.g.init("sin_cache_global", s))
        else:
            out["global"] = out["local"]
        return out
