"""The backend registry: how a backend plugs into `ortlean rewrite`.

A *weight backend* (TTMatMul, ProcSparseMatMul, EventGatedMatMul …) replaces one weight MatMul.
It is a module-level object with:

    name: str                                  # "tt"
    op_type: str                               # "TTMatMul"
    add_flags(parser) -> None                  # its seed flags on `ortlean rewrite`
    config(args) -> cfg                        # cfg.enabled: bool, cfg.targets: tuple[str, ...]
    needs_calibration(cfg) -> bool             # wants the Gram XᵀX of its layers' inputs
    plan(cand, W, G, cfg, ctx) -> Plan         # decision for one layer (dense when it says so)
    emit(graph, cand, plan, ctx) -> None       # replace cand.node by its op

Weight backends are tried in registry order per layer; the first whose plan is not "dense"
takes the layer (the weight backend is exclusive per MatMul). Backends that only make sense on a
layer another backend left dense (gating) come later in the list.

A *graph pass* (PackedAttention …) rewrites structure rather than one MatMul:

    name, add_flags, config, run(model, ctx) -> list[LayerRecord-like dicts]

Adding a backend: write the module, append it to WEIGHT_BACKENDS / GRAPH_PASSES below.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Plan:
    decision: str                   # the backend name, or "dense"
    reason: str                     # why (kept dense: gap too high / no speed gain / …; or what was built)
    gap: float | None               # relative output error on calibration inputs
    params_after: int               # parameters stored for this layer after the decision
    payload: Any = None             # what emit() needs (factors, deltas, thresholds …)
    speed: dict = field(default_factory=dict)
    attrs: dict = field(default_factory=dict)   # extra report fields (rank, method, fanout …)


@dataclass
class Context:
    """What the pipeline knows that backends may use."""
    model_path: str
    io: Any                         # runtime.ModelIO
    speed_M: int                    # M whose timing decides (1 for causal LMs, 128 for encoders)
    threads: int = 1
    calib_text: str | None = None
    tokenizer: str | None = None
    extra: dict = field(default_factory=dict)


TARGETS = ("mlp", "attn", "head")


def onoff(v: str) -> bool:
    """argparse type for the seeds' on|off flags."""
    import argparse

    v = v.lower()
    if v in ("on", "1", "true", "yes"):
        return True
    if v in ("off", "0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on|off, got {v!r}")


def parse_targets(spec: str, flag: str) -> tuple[str, ...]:
    """mlp | attn | both | head | all, or a comma list, for the flag `flag` (named in errors)."""
    from .errors import OrtleanError

    out: list[str] = []
    for part in spec.split(","):
        p = part.strip()
        if p == "both":
            out += ["mlp", "attn"]
        elif p == "all":
            out += list(TARGETS)
        elif p in TARGETS:
            out.append(p)
        else:
            raise OrtleanError(f"{flag} {spec!r}: unknown target {p!r} (use mlp, attn, both, head, all or a comma list)")
    return tuple(dict.fromkeys(out))


def add_shared_flags(p) -> None:
    """Flags several backends read (seed 001's state packing: PackedAttention packs the KV cache,
    EventGatedMatMul's zero-skip packs MLP activations). Defined once here."""
    g = p.add_argument_group("state packing (seed 001, shared)")
    g.add_argument("--state-pack", default="none", choices=["binary", "ternary", "none"],
                   help="bit-pack states: binary | ternary | none (default none)")
    g.add_argument("--state-pack-eps", type=float, default=None,
                   help="|x| ≤ eps counts as zero (default: per backend, calibrated or 1e-4)")
    g.add_argument("--state-pack-popcnt", default="auto", choices=["auto", "vpopcntdq", "avx2", "scalar"],
                   help="popcount path (default auto: VPOPCNTDQ when the CPU has it)")
    g.add_argument("--state-pack-target", default="kv", help="kv | mlp | both: what --state-pack applies to (default kv)")


def weight_backends():
    from . import gating, procsparse, tt

    return [tt.BACKEND, procsparse.BACKEND, gating.BACKEND]


def graph_passes():
    from . import attn

    return [attn.PASS]


def all_backends():
    return weight_backends() + graph_passes()
