"""TTMatMul (seed 000): per-layer rank autotune under the gap tolerance on activation-aware
factors (builders/tt.py), a speed check against dense, and the TTMatMul node."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..builders import tt as ttmath
from ..errors import OrtleanError
from ..kit import surgery, timing
from ..kit.backend import LayerPlan, Plan, WeightBackendBase
from ..kit.options import Options, flag, onoff, targets_flag


@dataclass
class TTConfig(Options):
    enabled: bool = flag("--tt", False, "factor weight MatMuls into TT/low-rank cores", type=onoff, metavar="on|off")
    rank: int | None = flag("--tt-rank", None, "cap on the TT bond rank (default: autotune up to break-even)", type=int)
    maxvol_k: int = flag("--tt-maxvol-k", 8, "alternating maxvol sweeps in TT-cross (default 8)", type=int)
    gap: float = flag("--tt-gap", 0.02, "max relative output error ‖XW−XŴ‖/‖XW‖ on calibration inputs per layer "
                      "(default 0.02)", type=float)
    targets: tuple[str, ...] = targets_flag("--tt-target")
    method: str = flag("--tt-method", "svd", "svd (TT-SVD) | cross (TT-cross with maxvol)")
    d: str = flag("--tt-d", "auto", "number of TT cores: 2 (low rank) | 3 | 4 | auto (tries 2 and 3)")
    whiten: str = flag("--tt-whiten", "full", "activation awareness: full (Cholesky of XᵀX) | diag | none")
    speed_check: bool = flag("--tt-speed-check", True, "keep a layer dense unless its kernel is measurably faster "
                             "here (default on)", type=onoff, metavar="on|off")
    min_speedup: float = flag("--tt-min-speedup", 1.10, "speedup a factored layer must show (default 1.10)",
                              type=float)   # seed 000: accept when CPU speedup ≥ 10–15 %

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


class TTPlan(LayerPlan):
    @property
    def factor(self) -> ttmath.TTFactor | None:
        return self.built


def _rank_grid(limit: int) -> list[int]:
    grid = []
    r = 1
    while r <= limit:
        grid.append(r)
        r = r + 1 if r < 8 else (r + 4 if r < 32 else (r + 8 if r < 128 else r + 16))
    if grid and grid[-1] != limit:
        grid.append(limit)
    return grid


def plan_layer(W: np.ndarray, G: np.ndarray | None, cfg: TTConfig, speed_M: int, threads: int = 1) -> TTPlan:
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
        plan.speed, sp = timing.speed_check(
            lambda: measure_tt(K, N, f.modes_k, f.modes_n, f.ranks, Ms=(1, 128), threads=threads,
                               x_scale=f.x_scale is not None), speed_M, "--tt-speed-check")
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


# --------------------------------------------------------------------------- the op's node
def node_attrs(f: ttmath.TTFactor, params_dense: int, layer: str, target: str, speedup: float) -> dict:
    return dict(modes_k=f.modes_k, modes_n=f.modes_n, ranks=f.ranks, method=f.method, gap=f.gap,
                params_dense=params_dense, params_stored=f.params, speedup=speedup, layer=layer, target=target)


def _inputs(cores: list, x_scale) -> list:
    """[G1, G2, G3, G4, x_scale] with the unused slots None."""
    return [*cores, *[None] * (4 - len(cores)), x_scale]


def measure_tt(K: int, N: int, modes_k, modes_n, ranks, Ms=(1, 128), threads: int = 1, x_scale: bool = False,
               use_cache: bool = True) -> dict[int, dict[str, float]]:
    """{M: {"dense": s, "tt": s, "speedup": dense/tt}} for random cores of these modes and ranks,
    measured in one process, interleaved (kit.timing)."""
    def model() -> bytes:
        rng = np.random.default_rng(0)
        cores = [(rng.standard_normal((ranks[i], modes_k[i], modes_n[i], ranks[i + 1])) * 0.05).astype(np.float32)
                 for i in range(len(modes_k))]
        f = ttmath.TTFactor(cores, list(modes_k), list(modes_n), list(ranks), None, 0.0, "svd")
        xs = np.ones(K, np.float32) if x_scale else None
        return timing.op_model("TTMatMul", K, N, _inputs(cores, xs), node_attrs(f, K * N, "bench", "mlp", 0.0))

    return timing.measure_vs_dense("tt", ["tt", K, N, list(modes_k), list(modes_n), list(ranks), bool(x_scale)],
                                   model, K, N, Ms, threads, use_cache=use_cache)


# --------------------------------------------------------------------------- the backend
class TTBackend(WeightBackendBase):
    name = "tt"
    op_type = "TTMatMul"
    Config = TTConfig
    title = "TTMatMul (seed 000)"

    def needs_calibration(self) -> bool:
        return self.cfg.enabled and self.cfg.whiten != "none"

    def plan(self, cand, W, G, ctx) -> Plan:
        p = plan_layer(W, G, self.cfg, ctx.speed_M, ctx.threads)
        if p.decision != "tt":
            return Plan.dense(cand, f"kept dense: {p.reason}", p.gap, speed=p.speed)
        f = p.factor
        return Plan("tt", f"factored: d={len(f.modes_k)} rank {max(f.ranks)}, {p.reason}", f.gap, f.params, payload=f,
                    speed=p.speed, attrs={"rank": f.ranks, "method": f.method})

    def emit(self, graph, cand, plan: Plan, ctx) -> None:
        """Replace cand.node by a TTMatMul node (same name, same output value)."""
        f: ttmath.TTFactor = plan.payload
        base = surgery.safe_name(cand.name)
        cores = [surgery.initializer(graph, f"{base}.tt_core{i}", c.astype(np.float32)) for i, c in enumerate(f.cores)]
        xs = None if f.x_scale is None else surgery.initializer(graph, f"{base}.tt_x_scale", f.x_scale.astype(np.float32))
        attrs = node_attrs(f, cand.K * cand.N, cand.label, cand.target, plan.speedup_at(ctx.speed_M))
        new = surgery.op_node(self.op_type, [cand.node.inputs[0], *_inputs(cores, xs)], attrs, name=cand.node.name)
        surgery.replace_node(graph, cand.node, new)
