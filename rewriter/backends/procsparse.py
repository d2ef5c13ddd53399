"""ProcSparseMatMul (seed 002): flags, the per-layer planner (smallest stored support meeting
--proc-gap within the byte budget, then a speed check against dense) and the node. The stored
layer itself is built in builders/procsparse.py."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from custom_ops import runtime

from ..builders.procsparse import ProcLayer, block_scores, build_layer, expand, layer_gap, select_blocks
from ..errors import OrtleanError
from ..kit import surgery, timing
from ..kit.backend import LayerPlan, Plan, WeightBackendBase
from ..kit.gaps import channel_gap, energy
from ..kit.options import Options, flag, onoff, targets_flag


@dataclass
class ProcConfig(Options):
    enabled: bool = flag("--proc-sparse", False, "hash base + top-K block deltas per output row (block-sparse)",
                         type=onoff, metavar="on|off")
    fanout: str = flag("--proc-fanout", "64", "max blocks per output row: a count, a fraction of the row's blocks "
                       "(0.5) or 'all' (default 64)")
    base_scale: str = flag("--proc-base-scale", "0.05", "scale of the hash base: a number (0 ablates it) or 'fit' "
                           "(least squares) (default 0.05)")
    watermark: int = flag("--proc-watermark", 4096, "hard cap on stored delta values per row; lowest-score blocks "
                          "trimmed (default 4096, 0: none)", type=int)
    shed_eps: float = flag("--proc-shed-eps", 1e-3, "soft shedding: a block whose deltas are all below this in "
                           "magnitude is trimmed (default 1e-3)", type=float)
    block: int = flag("--proc-block", 32, "block size: 32 | 64 (default 32)", type=int)   # the block partition shared with gating
    targets: tuple[str, ...] = targets_flag("--proc-target")
    gap: float = flag("--proc-gap", 0.02, "max relative output error ‖XW−XŴ‖/‖XW‖ on calibration inputs per layer "
                      "(default 0.02)", type=float)
    max_bytes: float = flag("--proc-max-bytes", 0.5, "stored bytes must be ≤ this fraction of dense (default 0.5, the "
                            "seed's target)", type=float)
    refit: bool = flag("--proc-refit", True, "least-squares refit of the kept weights on calibration data (default on)",
                       type=onoff, metavar="on|off")
    channel_gap: bool = flag("--proc-channel-gap", True, "--proc-gap also bounds the relative error averaged over "
                             "output channels (default on; the plain output error hides layers with massive "
                             "activations)", type=onoff, metavar="on|off")
    seed: int = flag("--proc-seed", 0x5EED, "hash seed (default 24301)", type=int)
    speed_check: bool = flag("--proc-speed-check", True, "keep a layer dense unless its kernel is measurably faster "
                             "here (default on)", type=onoff, metavar="on|off")
    min_speedup: float = flag("--proc-min-speedup", 1.10, "speedup a converted layer must show (default 1.10)",
                              type=float)   # seed 002: speedup CPU ≥ 10 %
    refit_iters: int = 25
    refit_ridge: float = 0.05

    def validate(self) -> None:
        if self.block not in (32, 64):
            raise OrtleanError(f"--proc-block {self.block}: use 32 or 64")
        if not (self.gap >= 0):
            raise OrtleanError(f"--proc-gap {self.gap}: must be ≥ 0")
        if self.watermark < 0:
            raise OrtleanError(f"--proc-watermark {self.watermark}: must be ≥ 0 (0: no cap)")
        if self.watermark and self.watermark < self.block:
            raise OrtleanError(f"--proc-watermark {self.watermark}: smaller than one block ({self.block} values)")
        if not (self.shed_eps >= 0):
            raise OrtleanError(f"--proc-shed-eps {self.shed_eps}: must be ≥ 0")
        if not (0 < self.max_bytes <= 1.0):
            raise OrtleanError(f"--proc-max-bytes {self.max_bytes}: must be in (0, 1]")
        if self.refit_iters < 0:
            raise OrtleanError(f"ProcConfig.refit_iters {self.refit_iters}: must be ≥ 0 (an API setting, no flag)")
        self.fanout_cap(1024)
        self.scale_value()
        if self.min_speedup <= 0:
            raise OrtleanError(f"--proc-min-speedup {self.min_speedup}: must be > 0")

    def fanout_cap(self, nb: int) -> int:
        """Max blocks per row for a layer with nb input blocks (fanout and watermark combined)."""
        f = str(self.fanout).strip().lower()
        try:
            if f in ("all", "auto"):
                cap = nb
            elif "." in f or "e" in f:
                x = float(f)
                if not (0 < x <= 1):
                    raise ValueError
                cap = max(1, int(math.ceil(x * nb)))
            else:
                cap = int(f)
                if cap < 1:
                    raise ValueError
        except ValueError:
            raise OrtleanError(f"--proc-fanout {self.fanout!r}: a block count ≥ 1, a fraction in (0, 1] or 'all'") from None
        if self.watermark:
            cap = min(cap, self.watermark // self.block)
        return max(1, min(cap, nb))

    def scale_value(self) -> float | None:
        s = str(self.base_scale).strip().lower()
        if s == "fit":
            return None
        try:
            v = float(s)
        except ValueError:
            raise OrtleanError(f"--proc-base-scale {self.base_scale!r}: a number or 'fit'") from None
        if not math.isfinite(v):
            raise OrtleanError(f"--proc-base-scale {self.base_scale!r}: must be finite")
        return v


class ProcPlan(LayerPlan):
    @property
    def layer(self) -> ProcLayer | None:
        return self.built


def plan_layer(W: np.ndarray, G: np.ndarray | None, cfg: ProcConfig, speed_M: int, threads: int = 1) -> ProcPlan:
    K, N = W.shape
    B = cfg.block
    nb = (K + B - 1) // B
    cap = cfg.fanout_cap(nb)
    dense_bytes = 4 * K * N
    # largest T within the byte budget and the per-row cap
    T_budget = int((cfg.max_bytes * dense_bytes / 4 - (N + 1)) // (B + 1))
    T_max = min(T_budget, cap * N)
    tried: list = []
    if T_max < 1:
        return ProcPlan(None, "dense", f"no block fits the byte budget ({cfg.max_bytes:.0%} of dense)", None, K * N, tried=tried)
    S = block_scores(W, G, B)
    Wd = W.astype(np.float64)
    den = energy(Wd, G)

    def quick_gap(T: int) -> float:     # no refit, no base: the masked weights
        keep = select_blocks(S, T, cap)
        Mk = expand(keep, K, B)
        g = math.sqrt(max(energy(Wd * ~Mk, G), 0.0) / max(den, 1e-30))
        return max(g, channel_gap(Wd, Wd * Mk, G)) if cfg.channel_gap else g

    def full(T: int) -> ProcLayer:
        lay = build_layer(W, G, select_blocks(S, T, cap), cfg, cap, S)
        lay.gap = layer_gap(W, G, lay)
        lay.gap_channels = channel_gap(W, lay.dense(), G)
        tried.append({"blocks": int(lay.nnzb), "of": int(nb * N), "gap": lay.gap, "gap_channels": lay.gap_channels,
                      "bytes": lay.bytes})
        return lay

    def ok(lay: ProcLayer) -> bool:
        return lay.gap <= cfg.gap and (not cfg.channel_gap or lay.gap_channels <= cfg.gap)

    best = full(T_max)
    if not ok(best):
        frac = best.bytes / dense_bytes
        why = (f"gap too high: {best.gap:.4f} (per-channel {best.gap_channels:.4f}) > {cfg.gap} with {best.nnzb}/{nb * N} blocks "
               f"(effective fanout {best.nnzb / N:.1f}/{nb}, {frac:.0%} of dense bytes, cap: "
               f"{'byte budget ' + format(cfg.max_bytes, '.0%') if T_budget <= cap * N else f'fanout {cap}'})")
        return ProcPlan(None, "dense", why, best.gap, K * N, tried=tried)
    # smallest T meeting the gap: bracket with the cheap unrefitted gap (an upper bound of the
    # refitted one), then bisection on the full build
    lo, hi = 0, T_max
    if cfg.refit and G is not None:
        # the unrefitted masked gap at T is ≥ the refitted one: T where it meets tol is an upper bound
        a, b = 1, T_max
        while a < b:
            mid = (a + b) // 2
            if quick_gap(mid) <= cfg.gap:
                b = mid
            else:
                a = mid + 1
        if a < T_max and quick_gap(a) <= cfg.gap:
            lay = full(a)
            if ok(lay):         # (shedding can push it over: then keep the T_max build)
                best, hi = lay, a
    for _ in range(6):                   # bisection on the full build (a few steps: each is a refit)
        if hi - lo <= max(1, hi // 50):
            break
        mid = (lo + hi) // 2
        lay = full(mid)
        if ok(lay):
            best, hi = lay, mid
        else:
            lo = mid
    plan = ProcPlan(best, "procsparse", "", best.gap, best.params, tried=tried)
    if cfg.speed_check:
        plan.speed, sp = timing.speed_check(lambda: measure_proc(best, Ms=(1, 128), threads=threads), speed_M,
                                            "--proc-speed-check")
        if sp < cfg.min_speedup:
            plan.decision = "dense"
            plan.reason = (f"no speed gain: x{sp:.2f} vs dense at M={speed_M} (< {cfg.min_speedup}) with gap "
                           f"{best.gap:.4f}, {best.nnzb}/{nb * N} blocks, {best.bytes / dense_bytes:.0%} of dense bytes")
            plan.params_after = K * N
            return plan
        plan.reason = f"x{sp:.2f} vs dense at M={speed_M}"
    else:
        plan.reason = "speed not checked"
    return plan


# --------------------------------------------------------------------------- the op's node
def node_attrs(layer: ProcLayer, label: str, target: str, speedup: float) -> dict:
    return dict(shape=[layer.K, layer.N], block=layer.block, seed=layer.seed, base_scale=layer.base_scale,
                fanout=layer.fanout, watermark=layer.watermark, shed_eps=layer.shed_eps, trims=layer.trims,
                gap=layer.gap if math.isfinite(layer.gap) else 0.0, params_dense=layer.K * layer.N,
                params_stored=layer.params, bytes_stored=layer.bytes, speedup=speedup, layer=label, target=target)


def _consts(layer: ProcLayer) -> list[np.ndarray]:
    return [layer.row_ptr.astype(np.int32), layer.block_idx.astype(np.int32), layer.deltas.astype(np.float32)]


def proc_model(layer: ProcLayer) -> bytes:
    """The layer's op alone (x [M, K] → y [M, N]): the timing model."""
    return timing.op_model("ProcSparseMatMul", layer.K, layer.N, _consts(layer), node_attrs(layer, "bench", "mlp", 0.0))


def measure_proc(layer: ProcLayer, Ms=(1, 128), threads: int = 1, use_cache: bool = True) -> dict[int, dict[str, float]]:
    """{M: {"dense": s, "proc": s, "speedup": dense/proc}}, interleaved in one process; cached per
    CPU, library build and sparsity structure. Single-threaded runs are timed on process CPU
    time (robust to preemption on a shared machine)."""
    h = hashlib.sha1(layer.row_ptr.tobytes() + layer.block_idx.tobytes()).hexdigest()
    key = ["proc-cpu1" if threads == 1 else "proc", layer.K, layer.N, layer.block, h, layer.base_scale != 0.0]
    return timing.measure_vs_dense("proc", key, lambda: proc_model(layer), layer.K, layer.N, Ms, threads,
                                   timer=runtime.time_cpu if threads == 1 else None, use_cache=use_cache)


# --------------------------------------------------------------------------- the backend
class ProcBackend(WeightBackendBase):
    name = "procsparse"
    op_type = "ProcSparseMatMul"
    Config = ProcConfig
    title = "ProcSparseMatMul (seed 002)"

    def plan(self, cand, W, G, ctx) -> Plan:
        p = plan_layer(W, G, self.cfg, ctx.speed_M, ctx.threads)
        if p.decision != "procsparse":
            return Plan.dense(cand, f"kept dense: {p.reason}", p.gap, speed=p.speed, attrs={"tried": p.tried})
        lay = p.layer
        nb = (lay.K + lay.block - 1) // lay.block
        what = (f"proc-sparse: {lay.nnzb}/{nb * lay.N} blocks (effective fanout {lay.nnzb / lay.N:.1f}/{nb}), "
                f"{lay.bytes / (4 * lay.K * lay.N):.0%} of dense bytes, base_scale {lay.base_scale:.3g}, trims {lay.trims}")
        return Plan("procsparse", f"{what}, {p.reason}", lay.gap, lay.params, payload=lay, speed=p.speed,
                    attrs={"fanout": lay.fanout, "effective_fanout": lay.nnzb / lay.N, "blocks": lay.nnzb,
                           "gap_channels": lay.gap_channels,
                           "bytes_stored": lay.bytes, "base_scale": lay.base_scale, "trims": lay.trims,
                           "tried": p.tried})

    def emit(self, graph, cand, plan: Plan, ctx) -> None:
        """Replace cand.node by a ProcSparseMatMul node (same name, same output value)."""
        lay: ProcLayer = plan.payload
        base = surgery.safe_name(cand.name)
        consts = [surgery.initializer(graph, f"{base}.{nm}", arr)
                  for nm, arr in zip(("proc_row_ptr", "proc_block_idx", "proc_deltas"), _consts(lay))]
        attrs = node_attrs(lay, cand.label, cand.target, plan.speedup_at(ctx.speed_M))
        new = surgery.op_node(self.op_type, [cand.node.inputs[0], *consts], attrs, name=cand.node.name)
        surgery.replace_node(graph, cand.node, new)
