"""TTMatMul backend builder: per-layer rank autotune under the gap tolerance, activation-aware
factorisation, speed check, and emission of the TTMatMul node."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from . import DOMAIN, ttmath
from .backends import Plan, onoff as _onoff
from .backends import parse_targets as _parse_targets
from .errors import OrtleanError



@dataclass
class TTConfig:
    enabled: bool = False
    rank: int | None = None          # cap on the bond rank (--tt-rank); None = autotune up to break-even
    maxvol_k: int = 8                # alternating maxvol sweeps in TT-cross (--tt-maxvol-k)
    gap: float = 0.02                # relative output error tolerance on calibration inputs (--tt-gap)
    targets: tuple[str, ...] = ("mlp",)
    method: str = "svd"              # svd | cross
    d: str = "auto"                  # 2 | 3 | 4 | auto (2 and 3)
    whiten: str = "full"             # full | diag | none (activation awareness; full needs calibration)
    speed_check: bool = True
    min_speedup: float = 1.10        # seed 000: accept when CPU speedup ≥ 10–15 %
    speed_M: int | None = None       # M that decides (None: 1 for causal LMs, 128 for encoders)
    threads: int = 1

    def validate(self) -> None:
        if self.rank is not None and self.rank < 1:
            raise OrtleanError(f"--tt-rank {self.rank}: must be ≥ 1")
        if not (self.gap >= 0):
            raise OrtleanError(f"--tt-gap {self.gap}: must be ≥ 0")
        if self.maxvol_k < 1:
            raise OrtleanError(f"--tt-maxvol-k {self.maxvol_k}: must be ≥ 1")
        if self.method not in ("svd", "cross"):
            raise OrtleanError(f"--tt-method {self.method!r}: use svd or cross")
        if self.d not in ("2", "3", "4", "auto"):
            raise OrtleanError(f"--tt-d {self.d!r}: use 2, 3, 4 or auto")
        if self.whiten not in ("full", "diag", "none"):
            raise OrtleanError(f"--tt-whiten {self.whiten!r}: use full, diag or none")
        if self.min_speedup <= 0:
            raise OrtleanError(f"--tt-min-speedup {self.min_speedup}: must be > 0")


@dataclass
class TTPlan:
    factor: ttmath.TTFactor | None
    decision: str                    # "tt" | "dense"
    reason: str
    gap: float | None
    params_after: int
    speed: dict = field(default_factory=dict)
    tried: list = field(default_factory=list)


def _rank_grid(limit: int) -> list[int]:
    grid = []
    r = 1
    while r <= limit:
        grid.append(r)
        r = r + 1 if r < 8 else (r + 4 if r < 32 else (r + 8 if r < 128 else r + 16))
    if grid and grid[-1] != limit:
        grid.append(limit)
    return grid


def plan_layer(W: np.ndarray, G: np.ndarray | None, cfg: TTConfig, speed_M: int) -> TTPlan:
    K, N = W.shape
    dense_params = K * N
    Gw = G if cfg.whiten != "none" else None
    tried = []
    options: list[ttmath.TTFactor] = []
    ds = [2, 3] if cfg.d == "auto" else [int(cfg.d)]
    for d in ds:
        modes = ttmath.choose_modes(K, N, d)
        if modes is None:
            tried.append({"d": d, "result": f"K={K} or N={N} has no {d}-way factorisation"})
            continue
        mk, mn = modes
        f = _search_rank(W, Gw, cfg, mk, mn, dense_params, tried)
        if f is not None:
            options.append(f)
    if not options:
        best = min((t for t in tried if "gap" in t), key=lambda t: t["gap"], default=None)
        why = "gap too high"
        if best is not None:
            why += f" (best {best['gap']:.3f} at d={best['d']} rank {best['rank']} within the param budget; tol {cfg.gap})"
        elif tried:
            why = tried[-1]["result"]
        return TTPlan(None, "dense", why, best["gap"] if best else None, dense_params, tried=tried)
    f = min(options, key=lambda o: o.params)
    plan = TTPlan(f, "tt", "", f.gap, f.params, tried=tried)
    if cfg.speed_check:
        from . import speed

        try:
            res = speed.measure_tt(K, N, f.modes_k, f.modes_n, f.ranks, Ms=(1, 128), threads=cfg.threads,
                                   x_scale=f.x_scale is not None)
        except Exception as e:  # the library must be there to prove a speed gain
            raise OrtleanError(f"speed check needs the ortlean library ({e}); pass --tt-speed-check=off to skip it") from None
        plan.speed = {f"M{M}": v for M, v in res.items()}
        sp = res[speed_M]["speedup"]
        if sp < cfg.min_speedup:
            plan.decision = "dense"
            plan.reason = f"no speed gain: x{sp:.2f} vs dense at M={speed_M} (< {cfg.min_speedup})"
            plan.params_after = dense_params
            return plan
        plan.reason = f"x{sp:.2f} vs dense at M={speed_M}"
    else:
        plan.reason = "speed not checked"
    return plan


def _search_rank(W, G, cfg: TTConfig, mk, mn, dense_params: int, tried: list) -> ttmath.TTFactor | None:
    """Smallest rank (on a grid) with gap ≤ tol and fewer parameters than dense."""
    K, N = W.shape
    d = len(mk)
    # largest rank that still stores fewer parameters than the dense matrix and — when speed
    # matters — costs fewer multiply-adds than dense by the required margin (a layer whose flop
    # count cannot beat dense is not worth factoring or timing)
    flop_cap = dense_params / cfg.min_speedup if cfg.speed_check else float("inf")

    def fits(r: int) -> bool:
        ranks = ttmath.tt_ranks_for_cap(mk, mn, r)
        params = sum(ranks[i] * mk[i] * mn[i] * ranks[i + 1] for i in range(d))
        return params < dense_params and ttmath.tt_macs(mk, mn, ranks) < flop_cap

    limit = 0
    hi = min(K, N)
    while limit < hi and fits(limit + 1):
        limit += 1
    if cfg.rank is not None:
        limit = min(limit, cfg.rank)
    if limit < 1:
        tried.append({"d": d, "result": "no rank stores fewer parameters / multiply-adds than dense"})
        return None
    grid = _rank_grid(limit)
    if d == 2:
        spec = ttmath.lowrank_svd(W, G, cfg.whiten if G is not None else "none")
        curve = spec.gap_curve()
        build = lambda r: ttmath.lowrank_factor(spec, W, G, r, cfg.method, cfg.maxvol_k)
        # the whitened spectrum gives the Frobenius gap exactly, a lower bound of the layer gap:
        # no rank below the first that meets it can pass
        start = next((i for i, r in enumerate(grid) if curve[min(r, len(curve) - 1)] <= cfg.gap), None)
        if start is None:
            f = build(grid[-1])
            tried.append({"d": d, "rank": grid[-1], "gap": f.gap, "params": f.params})
            return None
        grid = grid[start:]
    else:
        build = lambda r: ttmath.tt_factor(W, G, mk, mn, r, cfg.method, cfg.maxvol_k, diag_scale=G is not None)
    # the gap falls with the rank (up to cross noise): bisection on the grid
    f_hi = build(grid[-1])
    tried.append({"d": d, "rank": grid[-1], "gap": f_hi.gap, "params": f_hi.params, "modes": [mk, mn]})
    if f_hi.gap > cfg.gap:
        return None
    lo, hi, best = 0, len(grid) - 1, f_hi
    while lo < hi:
        mid = (lo + hi) // 2
        f = build(grid[mid])
        tried.append({"d": d, "rank": grid[mid], "gap": f.gap, "params": f.params, "modes": [mk, mn]})
        if f.gap <= cfg.gap:
            best, hi = f, mid
        else:
            lo = mid + 1
    return best


# --------------------------------------------------------------------------- emission
def emit(graph: ir.Graph, cand, f: ttmath.TTFactor, info: dict) -> ir.Node:
    """Replace cand.node by a TTMatMul node (same name, same output value)."""
    old = cand.node
    base = _safe(cand.name)
    inputs: list[ir.Value | None] = [old.inputs[0]]
    for i, c in enumerate(f.cores):
        v = ir.Value(name=f"{base}.tt_core{i}", const_value=ir.tensor(np.ascontiguousarray(c, dtype=np.float32), name=f"{base}.tt_core{i}"))
        graph.register_initializer(v)
        inputs.append(v)
    while len(inputs) < 5:
        inputs.append(None)
    if f.x_scale is not None:
        v = ir.Value(name=f"{base}.tt_x_scale", const_value=ir.tensor(f.x_scale.astype(np.float32), name=f"{base}.tt_x_scale"))
        graph.register_initializer(v)
        inputs.append(v)
    while inputs and inputs[-1] is None:
        inputs.pop()
    attrs = [
        ir.AttrInt64s("modes_k", [int(x) for x in f.modes_k]),
        ir.AttrInt64s("modes_n", [int(x) for x in f.modes_n]),
        ir.AttrInt64s("ranks", [int(x) for x in f.ranks]),
        ir.AttrString("method", f.method),
        ir.AttrFloat32("gap", float(f.gap)),
        ir.AttrInt64("params_dense", int(cand.K * cand.N)),
        ir.AttrInt64("params_stored", int(f.params)),
        ir.AttrFloat32("speedup", float(info.get("speedup", 0.0))),
        ir.AttrString("layer", str(info.get("layer", cand.name))),
        ir.AttrString("target", cand.target),
    ]
    new = ir.Node(DOMAIN, "TTMatMul", inputs, attrs, name=old.name, num_outputs=1)
    replace_node(graph, old, new)
    return new


def replace_node(graph: ir.Graph, old: ir.Node, new: ir.Node) -> None:
    """Put `new` where `old` was, moving old's single output name/uses/graph-output slot to it,
    and drop the weight (and its Transpose) when nothing else uses them."""
    out_old, out_new = old.outputs[0], new.outputs[0]
    name = out_old.name
    out_new.type = out_old.type
    out_new.shape = out_old.shape
    graph.insert_before(old, new)
    out_old.replace_all_uses_with(out_new, replace_graph_outputs=True)
    weight_in = old.inputs[1]
    graph.remove(old, safe=True)
    out_new.name = name
    _drop_if_unused(graph, weight_in)


def _drop_if_unused(graph: ir.Graph, v: ir.Value | None) -> None:
    if v is None or v.uses() or v.is_graph_output():
        return
    prod = v.producer()
    if prod is not None:
        src = prod.inputs[0]
        graph.remove(prod, safe=True)
        _drop_if_unused(graph, src)
    elif v.is_initializer() and v.name in graph.initializers and not v.is_graph_input():
        del graph.initializers[v.name]


def _safe(name: str) -> str:
    return name.strip("/").replace("/", ".") or "node"


# --------------------------------------------------------------------------- registry face
class TTBackend:
    name = "tt"
    op_type = "TTMatMul"

    def add_flags(self, p) -> None:
        t = p.add_argument_group("TTMatMul (seed 000)")
        t.add_argument("--tt", type=_onoff, default=False, metavar="on|off", help="factor weight MatMuls into TT/low-rank cores")
        t.add_argument("--tt-rank", type=int, default=None, help="cap on the TT bond rank (default: autotune up to break-even)")
        t.add_argument("--tt-maxvol-k", type=int, default=8, help="alternating maxvol sweeps in TT-cross (default 8)")
        t.add_argument("--tt-gap", type=float, default=0.02,
                       help="max relative output error ‖XW−XŴ‖/‖XW‖ on calibration inputs per layer (default 0.02)")
        t.add_argument("--tt-target", default="mlp", help="mlp | attn | both | head | all, or a comma list (default mlp)")
        t.add_argument("--tt-method", default="svd", help="svd (TT-SVD) | cross (TT-cross with maxvol)")
        t.add_argument("--tt-d", default="auto", help="number of TT cores: 2 (low rank) | 3 | 4 | auto (tries 2 and 3)")
        t.add_argument("--tt-whiten", default="full", help="activation awareness: full (Cholesky of XᵀX) | diag | none")
        t.add_argument("--tt-speed-check", type=_onoff, default=True, metavar="on|off",
                       help="keep a layer dense unless its kernel is measurably faster here (default on)")
        t.add_argument("--tt-min-speedup", type=float, default=1.10, help="speedup a factored layer must show (default 1.10)")

    def config(self, args) -> TTConfig:
        cfg = TTConfig(enabled=args.tt, rank=args.tt_rank, maxvol_k=args.tt_maxvol_k, gap=args.tt_gap,
                       targets=_parse_targets(args.tt_target, "--tt-target"), method=args.tt_method, d=str(args.tt_d),
                       whiten=args.tt_whiten, speed_check=args.tt_speed_check, min_speedup=args.tt_min_speedup,
                       threads=int(getattr(args, "threads", 1) or 1) if isinstance(getattr(args, "threads", 1), int) else 1)
        cfg.validate()
        return cfg

    def needs_calibration(self, cfg: TTConfig) -> bool:
        return cfg.enabled and cfg.whiten != "none"

    def plan(self, cand, W, G, cfg: TTConfig, ctx) -> Plan:
        p = plan_layer(W, G, cfg, ctx.speed_M)
        if p.decision != "tt":
            return Plan("dense", f"kept dense: {p.reason}", p.gap, cand.params, speed=p.speed)
        f = p.factor
        return Plan("tt", f"factored: d={len(f.modes_k)} rank {max(f.ranks)}, {p.reason}", f.gap, f.params, payload=f,
                    speed=p.speed, attrs={"rank": f.ranks, "method": f.method})

    def emit(self, graph, cand, plan: Plan, ctx) -> None:
        sp = plan.speed.get(f"M{ctx.speed_M}", {}).get("speedup", 0.0)
        label = f"{cand.layer}" if cand.layer is not None else cand.target
        emit(graph, cand, plan.payload, {"speedup": sp, "layer": label})


BACKEND = TTBackend()
