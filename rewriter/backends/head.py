"""The cheap head (issue 11 item 4; seeds 000 + 001): ``--cheap-head=lowrank`` rewrites the head
``logits = h · W`` so that a decode step (sequence length 1) computes approximate logits with a
whitened low-rank factor, picks the top ``--head-candidates`` of them, and computes exact logits
for those candidates only; prefill (sequence length > 1, and so ``ortlean eval``'s perplexity)
keeps the exact head. Standard ONNX / com.microsoft ops only:

    If(Shape(h)[1] == 1)
      then: MatMul(h, A) → MatMulNBits(·, B int4|int8) → TopK(C) → Gather(Wᵀ rows)        (fp32 head)
                                                             or GatherBlockQuantized(head blocks) (MatMulNBits head)
            → MatMul(rows, h) → ScatterElements into −inf (or into the approximate logits)
      else: the original head node

Non-candidates hold −inf by default (``--head-fill neginf``: greedy / top-k / top-p sample from
exact logits of the candidates), or their approximate value (``--head-fill approx``). The exact
candidate rows are the tied embedding table (no new bytes) or the transposed weight (stored
instead of W, the exact path reads it through a Transpose), or for a MatMulNBits head its own
int4/int8 blocks (the model's precision). Normative meaning: ``custom_ops/reference/head.py``.
A model without a recognisable head (graph output ``logits`` from a MatMul / MatMulNBits with
constant weights) is left as is, with the reason in the report.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from custom_ops import schema
from custom_ops.reference.head import FILLS, unpack_zero_points

from ..builders.head import NBITS_BLOCK, HeadMatch, candidate_recall, find_head, lowrank_head
from ..errors import OrtleanError
from .. import quantize
from ..kit import calib, surgery
from ..kit.backend import GraphPassBase
from ..kit.options import Options, flag

MS = "com.microsoft"


@dataclass
class HeadConfig(Options):
    mode: str = flag("--cheap-head", "off", "decode steps compute approximate logits with a whitened low-rank "
                     "factor of the head, exact logits for the top candidates only (default off)",
                     choices=("off", "lowrank"))
    rank: int = flag("--head-rank", 128, "rank of the approximate head (default 128)", type=int)
    candidates: int = flag("--head-candidates", 768, "candidates per decode step that get exact logits "
                           "(default 768: SmolLM2 int4 greedy agreement 99.7 %% with the exact head on 2,048 "
                           "held-out decode steps, tests/bench/bench_cheap_head.py)", type=int)
    bits: int = flag("--head-bits", 4, "MatMulNBits precision of the approximate head's big factor: 4 or 8 "
                     "(default 4)", type=int, choices=(4, 8))
    fill: str = flag("--head-fill", "neginf", "logits of non-candidates: neginf (default) or their approximate "
                     "value", choices=FILLS)
    accuracy: int = flag("--head-accuracy", 4, "MatMulNBits accuracy_level of the approximate head (default 4: "
                         "int8 activations; 0 = fp32, what the numpy reference computes)", type=int,
                         choices=(0, 1, 2, 3, 4))

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    targets: tuple = ()

    def validate(self) -> None:
        if self.rank < 1:
            raise OrtleanError(f"--head-rank {self.rank}: must be ≥ 1")
        if self.candidates < 1:
            raise OrtleanError(f"--head-candidates {self.candidates}: must be ≥ 1")


def _int8_activations(b: surgery.NodeBuilder, g: ir.Graph, base: str, x: ir.Value, D: int, block: int, opset: int) -> ir.Value:
    """``x`` [B, D] rounded as MatMulNBits accuracy_level 4 rounds its input (custom_ops.reference.head
    .int8_activations): per block of ``block``, scale = max|x| / 127, round half to even, × scale."""
    nb = -(-D // block)
    f32 = lambda name, v: surgery.initializer(g, f"{base}.{name}", np.asarray(v, np.float32))  # noqa: E731
    if nb * block != D:
        x = b("Pad", [x, surgery.int64s(g, f"{base}.act_pad", [0, 0, 0, nb * block - D])], "ActPad")
    xb = b("Reshape", [x, surgery.int64s(g, f"{base}.act_blocks", [0, nb, block])], "ActBlocks")          # [B, nb, block]
    ab = b("Abs", [xb], "ActAbs")
    amax = (b("ReduceMax", [ab, surgery.int64s(g, f"{base}.act_axis", [2])], "ActMax", dict(keepdims=1)) if opset >= 18
            else b("ReduceMax", [ab], "ActMax", dict(keepdims=1, axes=[2])))                    # [B, nb, 1]
    scale = b("Div", [amax, f32("act_127", 127.0)], "ActScale")
    zero = f32("act_zero", 0.0)
    pos = b("Greater", [scale, zero], "ActNonZero")
    inv = b("Where", [pos, b("Div", [f32("act_one", 1.0), b("Where", [pos, scale, f32("act_one_b", 1.0)], "ActSafe")],
                             "ActInvSafe"), zero], "ActInv")
    q = b("Mul", [b("Round", [b("Mul", [xb, inv], "ActScaled")], "ActRound"), scale], "ActDequant")
    x = b("Reshape", [q, surgery.int64s(g, f"{base}.act_rows", [0, nb * block])], "ActRows")
    if nb * block != D:
        x = b("Slice", [x, surgery.int64s(g, f"{base}.act_zero_i", [0]), surgery.int64s(g, f"{base}.act_D", [D]),
                        surgery.int64s(g, f"{base}.act_last", [1])], "ActSlice")
    return x


def emit(model: ir.Model, head: HeadMatch, A: np.ndarray, blob: np.ndarray, scales: np.ndarray, rank: int,
         cfg: HeadConfig) -> str:
    """Rewrite the head of `model` (see the module docstring); returns how the exact rows are read."""
    g = model.graph
    base = surgery.safe_name(head.node.name) + ".cheap"
    prefix = f"/ortlean/cheap_head"
    V, D = head.V, head.D
    C = min(cfg.candidates, V)
    a_v = surgery.initializer(g, f"{base}.A", A)
    b_v = surgery.initializer(g, f"{base}.B_q{cfg.bits}", blob)
    s_v = surgery.initializer(g, f"{base}.B_scales", scales)
    k_v = surgery.int64s(g, f"{base}.candidates", [C])
    ax1, ax2 = surgery.int64s(g, f"{base}.axis1", [1]), surgery.int64s(g, f"{base}.axis2", [2])
    b = surgery.NodeBuilder(prefix)
    x = head.x

    # rows of Wᵀ for the candidates: an existing initializer, or one stored for it
    how = ""
    if head.kind == "matmul":
        rows = head.rows
        if rows is None:      # untied [D, V] weight: store Wᵀ instead, the exact path reads Transpose(Wᵀ)
            w_old = head.node.inputs[1]
            rows = surgery.initializer(g, f"{base}.rows", head.rows_array)
            t = ir.Node("", "Transpose", [rows], [ir.AttrInt64s("perm", [1, 0])], name=f"{prefix}/WeightTranspose")
            t.outputs[0].name = f"{base}.W"
            g.insert_before(head.node, t)
            head.node.replace_input_with(1, t.outputs[0])
            surgery.drop_if_unused(g, w_old)
            how = f"exact rows: {rows.name} (the head weight, stored transposed)"
        else:
            how = f"exact rows: {rows.name} (fp32{', tied embedding' if not head.node.inputs[1] is rows else ''})"
    elif head.kind == "nbits":
        nb = head.nbits

    # the decode branch
    xs = b("Squeeze", [x, ax1], "Squeeze")                                             # [B, D]
    z = b("MatMul", [xs, a_v], "LowRank_A")                                            # [B, r]
    approx = b("MatMulNBits", [z, b_v, s_v], "LowRank_B", dict(K=rank, N=V, bits=cfg.bits, block_size=NBITS_BLOCK,
                                                                 accuracy_level=cfg.accuracy), domain=MS)
    _, idx = b("TopK", [approx, k_v], "TopK", dict(axis=-1, largest=1, sorted=1), n_out=2)   # [B, C]
    if head.kind == "matmul":
        r = b("Gather", [rows, idx], "GatherRows")                                     # [B, C, D]
    elif head.kind == "blockquant":
        a = head.blocks["attrs"]
        r = b("BlockQuantGather", [head.blocks["W"], idx], "GatherRows", a, domain=schema.DOMAIN)   # [B, C, D]
        how = (f"exact rows: the head's own {a['format']} blocks (BlockQuantGather), their products in fp32 "
               "(the head's own product rounds its input to integers)")
    else:
        nbk, bits, block = int(nb["blob"].const_value.shape[1]), nb["bits"], nb["block"]
        zp = None if nb["zero_points"] is None else unpack_zero_points(nb["zp"], V, nbk, bits)
        r = quantize.block_rows(b, g, nb["blob"], nb["scales"], zp, idx, D, bits, block, base)   # [B, C, D]
        how = f"exact rows: the head's own int{bits} blocks (GatherBlockQuantized)"
    xe = xs
    acc = head.node.attributes.get("accuracy_level")
    if head.kind == "nbits" and acc is not None and acc.as_int() == 4:
        # the head computes with int8 activations (MLAS): round h the same way so that the candidates
        # get that head's logits (reference.head.int8_activations)
        xe = _int8_activations(b, g, base, xs, D, int(nb["block"]), model.opset_imports.get("", 13))
        how += "; candidates in the head's int8-activation arithmetic (accuracy_level 4)"
    ex = b("MatMul", [r, b("Unsqueeze", [xe, ax2], "Unsqueeze")], "ExactCandidates")   # [B, C, 1]
    ex = b("Squeeze", [ex, ax2], "SqueezeExact")                                       # [B, C]
    if cfg.fill == "approx":
        fill = approx
    else:
        fill = b("ConstantOfShape", [b("Shape", [approx], "Shape")], "Fill",
                 dict(value=ir.tensor(np.array([-np.inf], np.float32))))
    out = b("ScatterElements", [fill, idx, ex], "Scatter", dict(axis=1))             # [B, V]
    y_then = b("Unsqueeze", [out, ax1], "Logits")                                      # [B, 1, V]
    then_g = ir.Graph([], [y_then], nodes=b.nodes, name="cheap_head_decode")

    # the prefill branch: the original head node, moved into the subgraph
    y = head.y
    node = head.node
    g.remove(node, safe=False)
    y_else = ir.Value(name=f"{prefix}/exact_logits", type=y.type, shape=y.shape)
    exact = ir.Node(node.domain, node.op_type, list(node.inputs), attributes=list(node.attributes.values()),
                    name=node.name, outputs=[y_else])
    else_g = ir.Graph([], [y_else], nodes=[exact], name="exact_head")
    # drop the old node's inputs' uses
    for i in range(len(node.inputs)):
        node.replace_input_with(i, None)

    c = surgery.NodeBuilder(prefix)
    one = surgery.int64s(g, f"{base}.one", 1)
    seq = c("Gather", [c("Shape", [x], "InputShape"), one], "SeqLen", dict(axis=0))
    cond = c("Equal", [seq, one], "IsDecode")
    iff = ir.Node("", "If", [cond], attributes=[ir.AttrGraph("then_branch", then_g), ir.AttrGraph("else_branch", else_g)],
                  name=f"{prefix}/If", num_outputs=1)
    c.nodes.append(iff)
    out_v = iff.outputs[0]
    out_v.type, out_v.shape = y.type, y.shape
    idx_out = [i for i, o in enumerate(g.outputs) if o is y][0]
    y.name = y.name + "_replaced"
    out_v.name = "logits"
    g.outputs[idx_out] = out_v
    g.extend(c.nodes)
    model.opset_imports.setdefault(MS, 1)
    return how


class CheapHeadPass(GraphPassBase):
    name = "cheap_head"
    stage = "post"
    Config = HeadConfig
    title = "cheap head (issue 11 item 4: approximate logits + exact candidates on decode steps)"

    def run(self, model, ctx) -> list[dict]:
        cfg = self.cfg
        head, why = find_head(model)
        if head is None:
            return [{"layer": "lm_head", "backend": "dense", "decision": f"kept exact: no recognisable head ({why})"}]
        row = {"layer": head.node.name, "target": "head", "node": "/ortlean/cheap_head/If"}
        if ctx.io is not None and not ctx.io.kind == "causal-lm":
            return [{**row, "backend": "dense", "decision": f"kept exact: a {ctx.io.kind} model has no decode steps"}]
        if not ctx.opts.calib_text:
            raise OrtleanError("--cheap-head=lowrank needs --calib-text FILE (the head's factor is whitened by the "
                               "calibration Gram of its input)")
        X: list[np.ndarray] = []
        grams = calib.collect_grams(ctx.source(), ctx.io, [head.x.name], ctx.calib, ctx.opts.calib_tokens,
                                    ctx.opts.calib_window, progress=ctx.opts.progress,
                                    hook=lambda n, x: X.append(np.array(x, np.float32)))
        if head.x.name not in grams:
            return [{**row, "backend": "dense", "decision": f"kept exact: head input {head.x.name!r} not found "
                                                             "in the calibration model"}]
        f = lowrank_head(head.W, grams[head.x.name].G, cfg.rank, cfg.bits)
        C = min(cfg.candidates, head.V)
        recall = candidate_recall(np.concatenate(X), head.W, f.A, f.B, C)
        how = emit(model, head, f.A, f.blob, f.scales, f.rank, cfg)
        bytes_head = (head.D * head.V * 4 if head.kind == "matmul" else _nbits_bytes(head) if head.kind == "nbits"
                      else int(head.blocks["W"].const_value.nbytes))
        bytes_cheap = f.A.nbytes + f.blob.nbytes + f.scales.nbytes
        return [{**row, "backend": self.name, "gap": f.gap, "rank": f.rank, "candidates": C,
                 "calib_recall": recall, "bytes_head": bytes_head, "bytes_approx": bytes_cheap,
                 "decision": f"cheap head: rank {f.rank} int{cfg.bits} factor ({bytes_cheap / 2**20:.1f} MiB vs "
                             f"{bytes_head / 2**20:.1f} MiB head), {C} candidates, non-candidates {cfg.fill}; gap "
                             f"{f.gap:.4f}, calibration greedy recall {recall:.4f}; {how}; prefill exact"}]


def _nbits_bytes(head: HeadMatch) -> int:
    nb = head.nbits
    return int(sum(v.const_value.nbytes for v in (nb["blob"], nb["scales"], nb["zero_points"]) if v is not None))
