"""One schema per ortlean op (domain ``ai.ortlean``, opset 1): inputs, outputs and attributes with
their types, the kernel's default when a node omits one, and which values are valid.

Everything that spells an op's interface derives from here: the rewriter's emitters and timing
models (typed node attributes), the numpy references' defaults and their onnxruntime-extensions
tables (``reference/ext.py``). The C++ kernels hold the same defaults in their constructors; the
library exports them (``custom_ops.op_schema()``) and a test checks that they agree with
``OpSchema.defaults()`` here. The constructors also enforce ``valid``: a value outside it fails
session creation with a message naming the node.

    from custom_ops import schema
    s = schema.get("EventGatedMatMul")
    s.defaults()                      # {"block": 1, "pack": "none", ...}
    s.resolve({"kwta": 1})            # defaults with the node's values on top
    s.problems({"block": 0})          # ["block = 0: must be >= 1"]
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable

DOMAIN = "ai.ortlean"
OPSET = 1
ATTR_TYPES = ("int", "float", "string", "ints", "floats")
TENSOR_TYPES = ("float32", "int32", "int64", "uint8")


@dataclass(frozen=True)
class Valid:
    """The values an attribute accepts: one of `choices`, or numbers within [lo, hi] (bounds
    open when `lo_open` / `hi_open`; NaN and ±inf never pass a bound); lists are checked per
    element and, with `length`, by their number of entries."""
    choices: tuple | None = None
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    finite: bool = False
    length: tuple[int, int] | None = None

    def describe(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(str(c) for c in self.choices)
        parts = []
        if self.lo is not None and self.hi is not None:
            parts.append(f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}")
        elif self.lo is not None:
            parts.append(f"{'>' if self.lo_open else '>='} {self.lo:g}")
        elif self.hi is not None:
            parts.append(f"{'<' if self.hi_open else '<='} {self.hi:g}")
        if self.finite:
            parts.append("finite")
        if self.length is not None:
            a, b = self.length
            parts.append(f"{a} entries" if a == b else f"{a}..{b} entries")
        return ", ".join(parts)

    def accepts(self, v) -> bool:
        if isinstance(v, (list, tuple)):
            if self.length is not None and not self.length[0] <= len(v) <= self.length[1]:
                return False
            return all(self._one(x) for x in v)
        return self._one(v)

    def _one(self, x) -> bool:
        if self.choices is not None:
            return x in self.choices
        x = float(x)
        if self.finite and not math.isfinite(x):
            return False
        if self.lo is not None and not (x > self.lo if self.lo_open else x >= self.lo):
            return False
        return self.hi is None or (x < self.hi if self.hi_open else x <= self.hi)


@dataclass(frozen=True)
class Attr:
    name: str
    type: str                       # one of ATTR_TYPES
    default: Any = None             # the kernel's value when the node omits it (None: none)
    required: bool = False          # the kernel refuses a node without it
    valid: Valid | None = None      # None: any value of the type
    meta: bool = False              # report metadata (layer, gap, params …), not part of the computation
    doc: str = ""

    def __post_init__(self):
        if self.type not in ATTR_TYPES:
            raise ValueError(f"attribute {self.name}: type {self.type!r} not in {ATTR_TYPES}")


@dataclass(frozen=True)
class Port:
    name: str
    type: str = "float32"           # element type, one of TENSOR_TYPES
    optional: bool = False


@dataclass(frozen=True)
class Rule:
    """A constraint between attributes: `holds(values)` on the resolved attribute values."""
    text: str
    holds: Callable[[dict], bool]


@dataclass(frozen=True)
class OpSchema:
    op_type: str
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    attrs: tuple[Attr, ...]
    reference: str                  # "module:function" of the numpy reference, fn(*inputs, **attributes)
    rules: tuple[Rule, ...] = ()

    def attr(self, name: str) -> Attr:
        for a in self.attrs:
            if a.name == name:
                return a
        raise KeyError(f"{self.op_type} has no attribute {name!r} (has: {', '.join(a.name for a in self.attrs)})")

    def defaults(self) -> dict[str, Any]:
        """{attribute: the kernel's default} for the attributes that have one."""
        return {a.name: a.default for a in self.attrs if a.default is not None}

    def resolve(self, values: dict) -> dict:
        """The defaults with `values` on top (names the op does not have are dropped)."""
        names = {a.name for a in self.attrs}
        return {**self.defaults(), **{k: v for k, v in values.items() if k in names}}

    def problems(self, values: dict) -> list[str]:
        """What is wrong with a node's attribute values: unknown or missing names, values outside
        `valid`, broken rules ([] when the kernel would accept them)."""
        out = []
        names = {a.name for a in self.attrs}
        out += [f"unknown attribute {k!r}" for k in values if k not in names]
        for a in self.attrs:
            if a.name not in values:
                if a.required:
                    out.append(f"missing attribute {a.name!r}")
                continue
            v = values[a.name]
            if a.valid is not None and not a.valid.accepts(v):
                out.append(f"{a.name} = {v!r}: must be {a.valid.describe()}")
        if not out:
            full = self.resolve(values)
            out += [r.text for r in self.rules if not r.holds(full)]
        return out

    def reference_fn(self) -> Callable:
        mod, fn = self.reference.split(":")
        return getattr(importlib.import_module(mod), fn)


TARGET = Valid(choices=("mlp", "attn", "head"))
NONNEG = Valid(lo=0)
UNIT_OPEN_LO = Valid(lo=0, lo_open=True, hi=1)            # (0, 1]
UNIT = Valid(lo=0, hi=1)                                  # [0, 1]
FLAG = "0: off, any other value: on"


def _meta(*names_types) -> tuple[Attr, ...]:
    return tuple(Attr(n, t, meta=True) for n, t in names_types)


_COMMON_META = (("params_dense", "int"), ("params_stored", "int"), ("layer", "string"))
NOT_MEASURED = Attr("gap", "float", default=math.nan, meta=True, doc="relative output error; NaN: not measured")

SCHEMAS: tuple[OpSchema, ...] = (
    OpSchema(
        "TTMatMul",
        inputs=(Port("X"), Port("G1"), Port("G2"), Port("G3", optional=True), Port("G4", optional=True),
                Port("x_scale", optional=True)),
        outputs=(Port("Y"),),
        attrs=(
            Attr("modes_k", "ints", required=True, valid=Valid(lo=1, length=(2, 4)), doc="k_i, prod = K"),
            Attr("modes_n", "ints", required=True, valid=Valid(lo=1, length=(2, 4)), doc="n_i, prod = N"),
            Attr("ranks", "ints", required=True, valid=Valid(lo=1, length=(3, 5)), doc="r_0..r_d, r_0 = r_d = 1"),
            Attr("method", "string", valid=Valid(choices=("svd", "cross")), meta=True),
            Attr("speedup", "float", default=0.0, meta=True, doc="measured at rewrite time, 0: not measured"),
            Attr("target", "string", valid=TARGET, meta=True),
            NOT_MEASURED,
            *_meta(*_COMMON_META),
        ),
        reference="custom_ops.reference.tt:op",
        rules=(Rule("len(modes_n) must equal len(modes_k)", lambda a: len(a["modes_n"]) == len(a["modes_k"])),
               Rule("ranks must have len(modes_k) + 1 entries, the first and the last 1",
                    lambda a: len(a["ranks"]) == len(a["modes_k"]) + 1 and a["ranks"][0] == 1 and a["ranks"][-1] == 1)),
    ),
    OpSchema(
        "ProcSparseMatMul",
        inputs=(Port("X"), Port("row_ptr", "int32"), Port("block_idx", "int32"), Port("deltas"),
                Port("block_mask", optional=True)),
        outputs=(Port("Y"),),
        attrs=(
            Attr("shape", "ints", required=True, valid=Valid(lo=1, hi=2**31 - 1, length=(2, 2)), doc="[K, N]"),
            Attr("block", "int", required=True, valid=Valid(choices=(32, 64))),
            Attr("seed", "int", required=True, doc="hash seed, used as uint64"),
            Attr("base_scale", "float", required=True, valid=Valid(finite=True)),
            Attr("fanout", "int", default=0, valid=NONNEG, doc="per-row block cap used, 0: none"),
            Attr("watermark", "int", default=0, valid=NONNEG, doc="per-row cap on stored delta values, 0: none"),
            Attr("shed_eps", "float", default=0.0, valid=NONNEG),
            Attr("trims", "int", default=0, valid=NONNEG, meta=True, doc="blocks removed by shedding"),
            Attr("bytes_stored", "int", meta=True),
            Attr("speedup", "float", default=0.0, meta=True),
            Attr("target", "string", valid=TARGET, meta=True),
            NOT_MEASURED,
            *_meta(*_COMMON_META),
        ),
        reference="custom_ops.reference.procsparse:proc_sparse_matmul",
    ),
    OpSchema(
        "EventGatedMatMul",
        inputs=(Port("X"), Port("W", optional=True), Port("state", optional=True),
                Port("Wq", "uint8", optional=True), Port("scales", optional=True),
                Port("zero_points", "uint8", optional=True)),
        outputs=(Port("Y"), Port("state_out", optional=True)),
        attrs=(
            Attr("block", "int", default=1, valid=Valid(lo=1)),
            Attr("weight_format", "string", default="f32", valid=Valid(choices=("f32", "int8", "int4", "int4k")),
                 doc="f32: W; int8 | int4 | int4k: Wq, scales, [zero_points] (custom_ops/reference/gating_quant.py;"
                     " int4k: scales along K, int8 activations at M = 1)"),
            Attr("weight_group", "int", default=32, valid=Valid(choices=(16, 32, 64, 128, 256, 512, 1024)),
                 doc="outputs per scale within a row (int8 | int4); input rows per scale (int4k: 16 | 32)"),
            Attr("weight_shape", "ints", valid=Valid(lo=1, hi=2**31 - 1, length=(2, 2)),
                 doc="[K, N]; required with a quantized format"),
            Attr("pack", "string", default="none", valid=Valid(choices=("none", "binary", "ternary"))),
            Attr("pack_eps", "float", default=0.0, valid=NONNEG),
            Attr("pack_rho", "float", default=1.0, valid=UNIT_OPEN_LO),
            Attr("kwta", "int", default=0, doc=FLAG),
            Attr("kwta_select", "string", default="threshold", valid=Valid(choices=("threshold", "topk", "mass"))),
            Attr("kwta_score", "string", default="xw", valid=Valid(choices=("xw", "x"))),
            Attr("kwta_threshold", "float", default=0.0, valid=NONNEG),
            Attr("kwta_k", "int", default=0, doc="blocks kept (topk): 1..number of blocks"),
            Attr("kwta_mass", "float", default=1.0, valid=UNIT_OPEN_LO),
            Attr("kwta_temp", "float", default=0.0, valid=NONNEG),
            Attr("kwta_duty", "int", default=1, valid=Valid(lo=1)),
            Attr("kwta_renorm", "int", default=0, doc=FLAG),
            Attr("event", "int", default=0, doc=FLAG),
            Attr("event_topk", "float", default=1.0, valid=UNIT_OPEN_LO),
            Attr("event_quorum", "float", default=1.0, valid=UNIT_OPEN_LO),
            Attr("event_theta", "float", default=0.0, valid=NONNEG),
            Attr("event_budget_ms", "float", default=0.0, valid=NONNEG, doc="0: no budget"),
            Attr("event_gap_tol", "float", default=0.03, valid=NONNEG),
            Attr("event_gap_every", "int", default=16, valid=NONNEG, doc="0: never"),
            Attr("event_beta", "float", default=1.0, valid=Valid(lo=0, lo_open=True)),
            Attr("event_lambda", "float", default=0.0, valid=NONNEG),
            Attr("event_age_max", "int", default=0, valid=NONNEG, doc="0: unbounded"),
            Attr("dense_prefill", "int", default=0, doc=FLAG),
            Attr("keep_ratio", "float", meta=True),
            Attr("fused", "string", meta=True, doc="members of a fused group, comma separated"),
            Attr("target", "string", valid=TARGET, meta=True),
            Attr("gap", "float", meta=True),
            *_meta(*_COMMON_META),
        ),
        reference="custom_ops.reference.gating:op",
        rules=(Rule("kwta_select 'mass' needs kwta_temp > 0",
                    lambda a: not (a["kwta"] and a["kwta_select"] == "mass") or a["kwta_temp"] > 0),
               Rule("kwta_select 'topk' needs kwta_k >= 1",
                    lambda a: not (a["kwta"] and a["kwta_select"] == "topk") or a["kwta_k"] >= 1),
               Rule("weight_format int8 | int4 needs weight_shape [K, N]",
                    lambda a: a["weight_format"] == "f32" or len(a.get("weight_shape") or ()) == 2),
               Rule("weight_format int4k needs weight_group 16 | 32",
                    lambda a: a["weight_format"] != "int4k" or a["weight_group"] in (16, 32))),
    ),
    OpSchema(
        "PackedAttention",
        inputs=(Port("Q"), Port("K", optional=True), Port("V", optional=True), Port("mask", optional=True),
                Port("past_bits", "int32", optional=True), Port("past_kv", "int32", optional=True),
                Port("seqlens_k", "int32", optional=True), Port("cos_cache", optional=True),
                Port("sin_cache", optional=True), Port("prompt_continues", "int32", optional=True)),
        outputs=(Port("Y"), Port("present_bits", "int32", optional=True), Port("present_kv", "int32", optional=True)),
        attrs=(
            Attr("scale", "float", default=1.0, valid=Valid(finite=True)),
            Attr("mode", "string", default="sign", valid=Valid(choices=("sign", "ternary", "binary", "pq"))),
            Attr("eps", "float", default=0.0, valid=Valid(lo=0, finite=True)),
            Attr("budget", "float", default=0.0, valid=UNIT, doc="0 or 1: exact"),
            Attr("min_candidates", "int", default=64, valid=NONNEG),
            Attr("sinks", "int", default=4, valid=NONNEG),
            Attr("window", "int", default=64, valid=NONNEG),
            Attr("min_context", "int", default=256, valid=NONNEG),
            Attr("rho", "float", default=0.15, valid=UNIT),
            Attr("qbits", "int", default=8, valid=Valid(lo=2, hi=16)),
            Attr("mix", "float", default=0.0, valid=UNIT),
            Attr("popcnt", "string", default="auto", valid=Valid(choices=("auto", "vpopcntdq", "avx2", "scalar"))),
            Attr("k_layout", "string", default="bhtd", valid=Valid(choices=("bhtd", "bhdt"))),
            Attr("approx_prefill", "int", default=0, doc=FLAG),
            Attr("select", "string", default="popcount", valid=Valid(choices=("popcount", "exact"))),
            Attr("eps_heads", "floats", default=(), valid=Valid(lo=0, finite=True), doc="one per KV head; empty: eps for all"),
            Attr("kscale", "floats", default=(), valid=Valid(lo=0, finite=True), doc="KV heads x head dim; empty: none"),
            Attr("pq_book", "floats", default=(), valid=Valid(finite=True),
                 doc="mode pq: KV heads x head dim x 16 ([Hkv][D/4][16][4] centroids)"),
            Attr("pq_dims", "ints", default=(), valid=NONNEG, doc="mode pq: subspace s = dims [4s, 4s + 4) of this permutation; empty: identity"),
            Attr("kv_quant", "string", default="none", valid=Valid(choices=("none", "fp32", "int8", "int4")),
                 doc="none: K/V are the whole context; fp32/int8/int4: K/V are the new tokens, the cache is past_kv"),
            Attr("local_window", "int", default=-1, valid=Valid(lo=-1), doc="kv_quant: the last w keys [pos - w + 1, pos]; -1/0: all"),
            Attr("softcap", "float", default=0.0, valid=Valid(lo=0, finite=True), doc="kv_quant: softcap * tanh(l / softcap)"),
            Attr("num_heads", "int", default=0, valid=NONNEG,
                 doc="kv_quant, > 0: GroupQueryAttention's layout (Q/K/V/Y [B, S, H*D], packed QKV, rotary)"),
            Attr("kv_num_heads", "int", default=0, valid=NONNEG, doc="with num_heads"),
            Attr("rotary_interleaved", "int", default=0, doc=FLAG),
            Attr("ksmooth", "floats", default=(), valid=Valid(lo=0, finite=True),
                 doc="num_heads > 0: key smoothing, KV heads x head dim (> 0, equal within each rotary pair): "
                     "q * s, k / s before rotary (the cache holds K / s); empty: none"),
            Attr("prefill_budget", "float", default=0.0, valid=Valid(lo=0, hi=1, finite=True),
                 doc="kv_quant, prompt rows: keys per tile of prompt rows as a fraction of its context (sink, "
                     "local and best-bounded middle blocks); 0 or 1: exact"),
            Attr("prefill_block", "int", default=64, valid=Valid(lo=8, hi=4096),
                 doc="sparse prefill: rows per query tile and keys per key block"),
            Attr("prefill_window", "int", default=1024, valid=NONNEG,
                 doc="sparse prefill: keys before a tile's first row always attended"),
            Attr("prefill_min_context", "int", default=4096, valid=NONNEG,
                 doc="sparse prefill: a tile whose last row's context is at most this is exact"),
            Attr("prefill_tail", "int", default=0, valid=NONNEG,
                 doc="sparse prefill: the last this many prompt rows of each sequence in a call are exact "
                     "(the rows a reply is read from), unless input prompt_continues is nonzero (a later call "
                     "holds the prompt's end)"),
            Attr("cand_block", "int", default=1, valid=Valid(lo=1, hi=4096),
                 doc="kv_quant: candidates in blocks of this many consecutive keys (block score: its best key's); 1: key by key"),
            Attr("layer", "string", meta=True),
        ),
        rules=(Rule("num_heads and kv_num_heads go together", lambda a: (a["num_heads"] > 0) == (a["kv_num_heads"] > 0)),
               Rule("num_heads needs kv_quant fp32 | int8 | int4", lambda a: not a["num_heads"] or a["kv_quant"] != "none"),
               Rule("mode pq needs kv_quant fp32 | int8 | int4", lambda a: a["mode"] != "pq" or a["kv_quant"] != "none"),
               Rule("mode pq needs pq_book", lambda a: a["mode"] != "pq" or len(a.get("pq_book") or ()) > 0),
               Rule("pq_book / pq_dims need mode pq",
                    lambda a: a["mode"] == "pq" or not (a.get("pq_book") or a.get("pq_dims"))),
               Rule("kscale does not apply to mode pq", lambda a: a["mode"] != "pq" or not a.get("kscale")),
               Rule("pq_dims must be a permutation of 0 .. len - 1",
                    lambda a: sorted(a.get("pq_dims") or ()) == list(range(len(a.get("pq_dims") or ())))),
               Rule("prefill_budget in (0, 1) needs kv_quant fp32 | int8 | int4",
                    lambda a: not (0 < a["prefill_budget"] < 1) or a["kv_quant"] != "none"),
               Rule("cand_block > 1 needs kv_quant fp32 | int8 | int4",
                    lambda a: a["cand_block"] == 1 or a["kv_quant"] != "none"),
               Rule("ksmooth needs num_heads > 0", lambda a: not a.get("ksmooth") or a["num_heads"] > 0),
               Rule("ksmooth values must be > 0", lambda a: all(x > 0 for x in (a.get("ksmooth") or ()))),
               Rule("num_heads must be a multiple of kv_num_heads",
                    lambda a: not a["kv_num_heads"] or a["num_heads"] % a["kv_num_heads"] == 0)),
        reference="custom_ops.reference.attn:op",
    ),
)

# BlockQuantMatMul / BlockQuantGather (custom_ops/reference/blockquant.py, docs/block-quant.md)
BQ_FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_K", "q5_K", "q6_K", "q4_f")
BQ_BLOCK = {"q4_0": 32, "q4_1": 32, "q5_0": 32, "q5_1": 32, "q8_0": 32, "q4_K": 256, "q5_K": 256, "q6_K": 256}
_BQ_ATTRS = (
    Attr("format", "string", required=True, valid=Valid(choices=BQ_FORMATS),
         doc="ggml's block format of W (q4_f: 4-bit, fp16 scale and offset per block of block_size)"),
    Attr("K", "int", required=True, valid=Valid(lo=1, hi=2**31 - 1), doc="inputs (X's last dim)"),
    Attr("N", "int", required=True, valid=Valid(lo=1, hi=2**31 - 1), doc="outputs (W's rows)"),
    Attr("block_size", "int", valid=Valid(choices=(16, 32, 64, 128, 256)),
         doc="q4_f: weights per block (absent: 32); other formats: absent or their own block (32; K formats 256)"),
    Attr("layout", "string", default="blocks", valid=Valid(choices=("blocks", "split")),
         doc="W's row layout: blocks (ggml's, byte for byte) or split (the same bytes per row: every block's "
             "integers, then the fp16 scale array, then the min array, then q5's qh halves; q4_0, q4_1, q5_0, q5_1, "
             "q8_0, q4_f/32)"),
    Attr("source", "string", meta=True, doc="where the blocks come from, e.g. gguf:blk.0.attn_q.weight or hqq"),
    Attr("bits_per_weight", "float", meta=True, valid=Valid(lo=0, lo_open=True, finite=True)),
    Attr("target", "string", valid=TARGET, meta=True),
    NOT_MEASURED,
    *_meta(*_COMMON_META),
)
_BQ_RULES = (Rule("block_size is for q4_f; another format takes only its own block (q4_K, q5_K, q6_K: 256, the others: 32)",
                  lambda a: a["format"] == "q4_f" or a.get("block_size") in (None, BQ_BLOCK.get(a["format"]))),
             Rule("layout split takes formats q4_0, q4_1, q5_0, q5_1, q8_0 and q4_f with block 32",
                  lambda a: a.get("layout", "blocks") != "split" or
                  a["format"] in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0") or (a["format"] == "q4_f" and a.get("block_size") in (None, 32))))
_BQ_ACT = Attr("act_bits", "int", default=8, valid=Valid(choices=(8, 16)),
               doc="activation integers per block of 32: 8 (int8, ggml's q8_0) or 16 (int16: the rounding ~256x finer)")
_BQ_PREFILL_ACT = Attr("prefill_act_bits", "int", default=0, valid=Valid(choices=(0, 8, 16)),
                       doc="act_bits of a call with M > 1 rows (a prompt's prefill): 0 (default: act_bits), 8 or 16; "
                           "M = 1 (decode) keeps act_bits. 8 under act_bits 16 halves the prefill's integer products "
                           "(int16 activations cost two vpdpbusd each)")
_BQ_GLU = Attr("glu", "string", default="none", valid=Valid(choices=("none", "silu")),
               doc="none, or silu: W holds a SwiGLU gate's N/2 rows then the up projection's N/2, and Y "
                   "[..., N/2] = silu(gate) * up of the product (one op for an MLP's gate, up and activation)")
SCHEMAS += (
    OpSchema("BlockQuantMatMul", inputs=(Port("X"), Port("W", "uint8"), Port("bias", optional=True)),
             outputs=(Port("Y"),), attrs=(*_BQ_ATTRS[:5], _BQ_ACT, _BQ_PREFILL_ACT, _BQ_GLU, *_BQ_ATTRS[5:]),
             reference="custom_ops.reference.blockquant:op",
             rules=(*_BQ_RULES, Rule("glu silu needs an even N (the gate's rows, then as many of the up projection's)",
                                     lambda a: a.get("glu", "none") != "silu" or int(a["N"]) % 2 == 0))),
    OpSchema("BlockQuantGather", inputs=(Port("W", "uint8"), Port("indices", "int64")),
             outputs=(Port("Y"),), attrs=_BQ_ATTRS, reference="custom_ops.reference.blockquant:gather",
             rules=_BQ_RULES),
)

_BY_TYPE = {s.op_type: s for s in SCHEMAS}


def get(op_type: str) -> OpSchema:
    try:
        return _BY_TYPE[op_type]
    except KeyError:
        raise KeyError(f"no ortlean op {op_type!r} (ops: {', '.join(_BY_TYPE)})") from None


def op_types() -> list[str]:
    return list(_BY_TYPE)


def defaults_json() -> dict[str, dict[str, Any]]:
    """{op_type: {attribute: default}} as the library's `ortlean_op_schema_json()` writes it
    (`custom_ops.op_schema()`): NaN is None, lists are lists."""
    def js(v):
        return None if isinstance(v, float) and math.isnan(v) else (list(v) if isinstance(v, tuple) else v)

    return {s.op_type: {k: js(v) for k, v in s.defaults().items()} for s in SCHEMAS}
