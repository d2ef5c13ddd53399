"""EventGatedMatMul: activation gating of layers left dense (zero-skip, KWTA, event-driven).

Flags are the seeds' (003 KWTA, 004 event-driven, the MLP half of 001 zero-skip: the shared
--state-pack* group). The layer keeps its dense weight; the op decides per call which input
channels (rows of W) to read.

Planner (`--kwta=on` without an explicit k): per-layer TEAL-style thresholds on the score
|x_k|·‖W_k‖, calibrated offline from calibration activations (the online cost is one compare per
channel). For every layer and keep ratio p on a grid, the threshold τ(p) is the (1−p) quantile
of the layer's calibration scores and gap(p) = ‖(X⊙mask−X)W‖/‖XW‖ on held calibration rows
(builders/gating.py). A per-layer *gap target* g turns into a keep ratio per layer (the smallest
p with gap(p) ≤ g: layers that tolerate sparsity get more of it). The global quality budget
(`--quality-budget`, Δppl on held-out calibration text) is spent down-projection first: g_down
is bisected on the rewrite's end-to-end probe with a share of the budget, then g for the other
targeted layers with the rest; the planner targets `--kwta-margin` (default 0.5) of the budget on the
probe, the rest is a margin for held-out text (KWTA_MARGIN below). The chosen keep ratio and threshold are recorded per layer in the
node's attributes.

With `--weights int8|int4` (the pinned MatMulNBits backend, rewriter/backends/weights.py) the
layers gating takes are stored quantized too, so gating compounds with the weight precision:
int4 → `weight_format` int4k holding exactly the values of ORT's MatMulNBits quantization of the
layer (block 32 along K, symmetric; re-laid out by `gating_quant.from_matmul_nbits`, so the only
difference from the layer it replaces is the gate); int8 → `weight_format` int8 (symmetric, group
32 — along N in this format, along K in MatMulNBits: the values differ by rounding). Thresholds and
gaps are calibrated on the quantized Ŵ; every trial holds MatMulNBits for each layer not gated. The
budget covers the quantization too: gating spends what the quantized baseline leaves of it, as Δppl
over that baseline (`kit.quality.relative_loss`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from custom_ops.reference import gating_quant as gq

from ..builders.gating import Samples, layer_curve, pick
from ..errors import OrtleanError
from ..kit import options, surgery
from ..kit.backend import Plan, WeightBackendBase
from ..kit.candidates import GroupCandidate, group_shared_inputs
from ..kit.options import Options, flag, onoff, targets_flag
from ..kit.quality import largest_passing, relative_loss
from .. import quantize

# Per-layer gap targets the planner bisects over. A finer grid (31 steps) spent the budget more
# fully on the calibration probe (+1.79 % at a 2 % budget) but measured +2.87 % on held-out
# Persuasion with no decode gain (1.11x vs 1.10x): the 16-step grid leaves margin (+1.17 % probe,
# +1.54 % held out).
GAP_GRID = tuple(float(x) for x in np.geomspace(0.01, 0.6, 16))
# The planner targets KWTA_MARGIN·budget on the 1024-token calibration probe (--kwta-margin). Measured
# with tests/bench/bench_gating_guard.py on SmolLM2 `--kwta=on --weights int4 --quality-budget 0.02`
# planned at the full budget (Δppl over the int4 model): probe +1.52 %, the same novel's next 4096 /
# 8192 tokens +2.65 % / +2.76 %, Persuasion +3.43 % (256-token windows) / +3.56 % (512, `ortlean eval`).
# Scoring more tokens would remove the first gap (the planner picks the largest plan that passes a
# small, noisy sample) but not the second (+0.7 points between novels at 8192 tokens), and would make
# every planner trial 4x longer; a margin removes both for free. At margin 0.5 (budget 0.01): probe
# +0.43 %, Persuasion +0.48 %; int8 at the full budget: probe +1.38 %, Persuasion +1.75 %.
# Since the tied embedding reads the head's int4 blocks (--weights-embed shared, the default) the same
# margin gives probe +0.44 % but Persuasion +3.87 % (issue 11; the probe's number is exactly that of the
# written files, tests/test_gating_weights.py): paired per-token Δnll has std 0.30 nats, so a 1024-token
# probe's standard error (~1 point of Δppl) is as large as the budget; the 12 consecutive 1024-token chunks of
# the calibration novel score this model +0.44 % (the probe's chunk, the lowest) to +5.20 %, mean +3.0 %.
KWTA_MARGIN = 0.5
# --weights int8|int4 → the op's weight_format for the layers gating takes: the fastest format of
# those bits at keep 0.5-0.75 in tests/bench/bench_gating_op.py (int4k: 0.56-0.92x MatMulNBits'
# time at M = 1, int4 1.1-2.1x; int8 is the only 8-bit format).
QUANT_FORMAT = {"int4": "int4k", "int8": "int8"}
EVENT = "EventGatedMatMul: event-driven (seed 004)"


@dataclass
class GatingConfig(Options):
    # KWTA (seed 003)
    kwta: bool = flag("--kwta", False, "KWTA activation gating", type=onoff, metavar="on|off")
    kwta_k: float | None = flag("--kwta-k", None, "fraction of input channels kept (calibrated per-layer threshold); "
                                "default: the planner picks per-layer keep ratios under --quality-budget", type=float)
    kwta_k_abs: int | None = flag("--kwta-k-abs", None, "channels kept per row (exact top-K)", type=int)
    kwta_temp: float = flag("--kwta-temp", 0.0, "> 0: keep the top channels holding --kwta-k of the "
                            "softmax(score/temp) mass", type=float)
    kwta_duty: int = flag("--kwta-duty", 1, "refresh the mask every N decode steps (default 1)", type=int)
    kwta_targets: tuple[str, ...] = targets_flag("--kwta-target")
    kwta_block: int = flag("--kwta-block", 1, "channels per gating block (default 1: single channels)", type=int)
    kwta_score: str = flag("--kwta-score", "xw", "xw: |x_k|·‖W_k‖ (default) | x: |x_k|")
    kwta_renorm: bool = flag("--kwta-renorm", False, "scale by 1/p_keep", type=onoff, metavar="on|off")
    fuse: bool = flag("--gate-fuse", True, "gate projections that read the same input (q/k/v, gate/up) as one op: "
                      "one mask per token reused for all of them (seed 003: the same mask for K/V), one pass over x, "
                      "longer weight rows (default on; only when gating is the only weight backend)",
                      type=onoff, metavar="on|off")
    kwta_budget_share: float = flag("--kwta-budget-share", 0.6, "share of --quality-budget the planner spends on "
                                    "down-projections first (default 0.6)", type=float)
    kwta_margin: float = flag("--kwta-margin", KWTA_MARGIN, "share of --quality-budget the planner targets on the "
                              "calibration probe, the rest a margin for held-out text (default 0.5)", type=float)
    # event (seed 004)
    event: bool = flag("--event-driven", False, "delta updates under a budget", type=onoff, metavar="on|off",
                       group=EVENT)
    event_budget_ms: float = flag("--event-budget-ms", 0.0, "ms per token for all event layers (0 = none)", type=float,
                                  group=EVENT)   # split over the event layers
    event_quorum: float = flag("--event-quorum", 1.0, "stop once this share of the delta mass is applied", type=float,
                               group=EVENT)
    event_topk: float = flag("--event-topk", 0.4, "fraction of blocks updated per token (default 0.4)", type=float,
                             group=EVENT)
    event_theta: float = flag("--event-delta-theta", 0.01, "relative delta below which a block is skipped",
                              type=float, group=EVENT)
    event_gap_tol: float = flag("--event-gap-tol", 0.03, "quality gap that disables the mode (default 0.03)",
                                type=float, group=EVENT)
    event_gap_every: int = flag("--event-gap-every", 16, "dense check every N tokens (default 16)", type=int,
                                group=EVENT)
    event_beta: float = flag("--event-beta", 1.0, "staleness weight β·exp(−λ·age)", type=float, group=EVENT)
    event_lambda: float = flag("--event-lambda", 0.0, "staleness decay λ", type=float, group=EVENT)
    event_age_max: int = flag("--event-age-max", 32, "a block stale this long is refreshed (0 = never)", type=int,
                              group=EVENT)
    event_targets: tuple[str, ...] = targets_flag("--event-target", group=EVENT)
    event_block: int | None = flag("--event-block", None, "channels per event block (default: --kwta-block)",
                                   type=int, group=EVENT)
    # zero-skip (seed 001, MLP half): from the shared --state-pack* group (kit.options.StatePack)
    pack: str = "none"
    pack_eps: float = 0.0
    pack_rho: float = options.StatePack.rho
    pack_targets: tuple[str, ...] = ()
    # derived: what any of the three gates targets
    enabled: bool = False
    targets: tuple[str, ...] = ()
    calib_rows: int = 512
    dense_prefill: bool = False

    def validate(self) -> None:
        if self.kwta_k is not None and not (0 < self.kwta_k <= 1):
            raise OrtleanError(f"--kwta-k {self.kwta_k}: a fraction in (0, 1]")
        if self.kwta_k_abs is not None and self.kwta_k_abs < 1:
            raise OrtleanError(f"--kwta-k-abs {self.kwta_k_abs}: must be ≥ 1")
        if self.kwta_temp < 0:
            raise OrtleanError(f"--kwta-temp {self.kwta_temp}: must be ≥ 0")
        if self.kwta_duty < 1:
            raise OrtleanError(f"--kwta-duty {self.kwta_duty}: must be ≥ 1")
        if self.kwta_block < 1:
            raise OrtleanError(f"--kwta-block {self.kwta_block}: must be ≥ 1")
        if self.kwta_score not in ("xw", "x"):
            raise OrtleanError(f"--kwta-score {self.kwta_score!r}: use xw or x")
        if not (0 < self.kwta_margin <= 1):
            raise OrtleanError(f"--kwta-margin {self.kwta_margin}: a fraction in (0, 1]")
        if not (0 < self.event_topk <= 1):
            raise OrtleanError(f"--event-topk {self.event_topk}: a fraction in (0, 1]")
        if not (0 < self.event_quorum <= 1):
            raise OrtleanError(f"--event-quorum {self.event_quorum}: a fraction in (0, 1]")
        if self.event_budget_ms < 0 or self.event_theta < 0 or self.event_gap_tol < 0:
            raise OrtleanError("--event-budget-ms, --event-delta-theta and --event-gap-tol must be ≥ 0")
        if self.kwta_temp > 0 and self.kwta_k is None and self.kwta_k_abs is None and self.kwta:
            raise OrtleanError("--kwta-temp > 0 selects by softmax mass: give the mass with --kwta-k")


class GatingBackend(WeightBackendBase):
    name = "gating"
    op_type = "EventGatedMatMul"
    Config = GatingConfig
    title = "EventGatedMatMul: KWTA (seed 003)"

    def __init__(self, cfg: GatingConfig):
        super().__init__(cfg)
        self.samples: Samples | None = None          # calibration activations of the KWTA layers
        self._curves: dict[str, list[dict]] = {}     # per layer: keep ratio → threshold, gap
        self._choice: dict[str, dict] | None = None  # the planner's keep ratio per layer
        self._qw: dict[str, dict] = {}               # per layer: quantized weight (--weights int8|int4)
        self._pinned_plans: dict[str, tuple] | None = None  # per layer: its MatMulNBits plan (trials)

    @classmethod
    def config(cls, args, state_pack) -> GatingConfig:
        sp = state_pack
        cfg = options.from_args(GatingConfig, args, pack=sp.mode if sp.mlp else "none",
                                pack_eps=(sp.eps or 0.0) if sp.mlp else 0.0, pack_rho=sp.rho,
                                pack_targets=("mlp",) if sp.mlp else ())
        tg = []
        if cfg.kwta:
            tg += cfg.kwta_targets
        if cfg.event:
            tg += cfg.event_targets
        tg += cfg.pack_targets
        cfg.targets = tuple(dict.fromkeys(tg))
        cfg.enabled = bool(cfg.targets)
        cfg.validate()
        return cfg

    def group_candidates(self, todo: list, enabled: list) -> list:
        """Fuse shared-input projections (--gate-fuse) when gating is the only weight backend
        (another backend may want a member on its own)."""
        cfg = self.cfg
        if not (cfg.enabled and cfg.fuse) or any(b.name != self.name for b in enabled):
            return todo
        return group_shared_inputs(todo, cfg.targets)

    # -- calibration -------------------------------------------------------------------------
    def _planner(self) -> bool:
        cfg = self.cfg
        return cfg.kwta and cfg.kwta_k is None and cfg.kwta_k_abs is None

    def needs_calibration(self) -> bool:
        return self.cfg.enabled and self.cfg.kwta and self.cfg.kwta_k_abs is None

    def calibration_hook(self, ctx):
        if not self.needs_calibration():
            return None
        todo = [c for c in ctx.todo if c.target in self.cfg.kwta_targets]
        self.samples = Samples([c.input.name for c in todo], self.cfg.calib_rows, ctx.opts.calib_tokens)
        return self.samples

    # -- planning ----------------------------------------------------------------------------
    def plan(self, cand, W, G, ctx) -> Plan:
        cfg = self.cfg
        kw = cfg.kwta and cand.target in cfg.kwta_targets
        ev = cfg.event and cand.target in cfg.event_targets
        pk = cfg.pack != "none" and cand.target in cfg.pack_targets
        if not (kw or ev or pk):
            return Plan.dense(cand, "not targeted by the gating flags")
        attrs: dict = {"block": int(cfg.kwta_block), "dense_prefill": int(cfg.dense_prefill)}
        q = self._quantized(cand, W, ctx)
        if q is not None:
            if "error" in q:
                return Plan.dense(cand, f"no gated {q['format']} layout: {q['error']}")
            W = q["W_hat"]  # thresholds, norms and gaps of the weights the op multiplies
            attrs.update(q["attrs"])
        gap = None
        info = {}
        if pk:
            attrs.update(pack=cfg.pack, pack_eps=float(cfg.pack_eps), pack_rho=float(cfg.pack_rho))
        if kw:
            attrs.update(kwta=1, kwta_score=cfg.kwta_score, kwta_temp=float(cfg.kwta_temp),
                         kwta_duty=int(cfg.kwta_duty), kwta_renorm=int(cfg.kwta_renorm))
            if cfg.kwta_k_abs is not None:
                nb = -(-cand.K // cfg.kwta_block)
                attrs.update(kwta_select="topk", kwta_k=int(min(nb, max(1, round(cfg.kwta_k_abs / cfg.kwta_block)))))
                info["keep"] = min(1.0, cfg.kwta_k_abs / cand.K)
            elif cfg.kwta_temp > 0:
                attrs.update(kwta_select="mass", kwta_mass=float(cfg.kwta_k))
                info["keep"] = None
            else:
                curve = self._curve(cand, W)
                if self._planner():
                    choice = self._global_plan(ctx)[cand.name]
                else:
                    match = [c for c in curve if abs(c["keep"] - cfg.kwta_k) < 1e-9]
                    choice = match[0] if match else layer_curve(self._samples(cand), W, cfg.kwta_score,
                                                                grid=(cfg.kwta_k,))[0]
                if choice["keep"] >= 1.0 and not (ev or pk):
                    return Plan.dense(cand, "kept dense: planner keeps every channel of this layer under the budget", 0.0)
                attrs.update(kwta_select="threshold", kwta_threshold=float(choice["threshold"]),
                             keep_ratio=float(choice["keep"]))
                gap = choice["gap"]
                info["keep"] = choice["keep"]
        if ev:
            eb = cfg.event_block or cfg.kwta_block
            attrs["block"] = int(eb if not kw else cfg.kwta_block)
            n_ev = max(1, sum(1 for c in ctx.todo if c.target in cfg.event_targets))
            attrs.update(event=1, event_topk=float(cfg.event_topk), event_quorum=float(cfg.event_quorum),
                         event_theta=float(cfg.event_theta), event_budget_ms=float(cfg.event_budget_ms / n_ev),
                         event_gap_tol=float(cfg.event_gap_tol), event_gap_every=int(cfg.event_gap_every),
                         event_beta=float(cfg.event_beta), event_lambda=float(cfg.event_lambda),
                         event_age_max=int(cfg.event_age_max))
        what = []
        if pk:
            what.append(f"zero-skip {cfg.pack} eps {cfg.pack_eps:g} ρ {cfg.pack_rho:g}")
        if kw:
            k = info.get("keep")
            what.append(f"KWTA keep {k:.2f}" if k is not None else f"KWTA mass {cfg.kwta_k:g} temp {cfg.kwta_temp:g}")
        if ev:
            what.append(f"event topk {cfg.event_topk:g}")
        if q is not None:
            what.append(f"{q['format']} weights")
        return Plan("gating", "gated: " + ", ".join(what), gap, cand.params, payload=attrs,
                    attrs={"method": "+".join(w.split()[0] for w in what)})

    # -- quantized weights (--weights int8|int4) ---------------------------------------------
    @staticmethod
    def _precision(ctx) -> str | None:
        """The pinned --weights precision ("int8" | "int4"), None for fp32 or no context."""
        w = ctx.opts.backends.get("weights") if ctx is not None else None
        return w.weights if w is not None and getattr(w, "enabled", False) and w.weights in QUANT_FORMAT else None

    def _quantized(self, cand, W, ctx) -> dict | None:
        """The layer's weight in the op's quantized format matching --weights (None: f32):
        {format, attrs (weight_format/group/shape + the arrays as "_wq"/"_scales"), W_hat}."""
        prec = self._precision(ctx)
        if prec is None:
            return None
        if cand.name in self._qw:
            return self._qw[cand.name]
        fmt = QUANT_FORMAT[prec]
        qc = quantize.config_for(prec)
        K, N = int(cand.K), int(cand.N)
        try:
            if fmt == "int4k":  # ORT's own quantization of the layer, re-laid out: MatMulNBits' exact values
                packed, sc, zp = quantize.quantize_matrix(W, qc)
                wq, scales, group = gq.from_matmul_nbits(packed, sc, zp, K, N, qc.bits, qc.block_size)
                W_hat = gq.dequantize_k(wq, scales, group, K, N)
            else:
                if not qc.symmetric:
                    raise ValueError("the int8 gated format is symmetric")
                group = qc.block_size
                wq, scales, _ = gq.quantize(W, fmt, group)
                W_hat = gq.dequantize(wq, scales, fmt, group, N)
        except ValueError as e:
            self._qw[cand.name] = {"format": fmt, "error": str(e)}
            return self._qw[cand.name]
        attrs = {"weight_format": fmt, "weight_group": int(group), "weight_shape": [K, N],
                 "_wq": wq, "_scales": scales}
        self._qw[cand.name] = {"format": fmt, "attrs": attrs, "W_hat": W_hat}
        return self._qw[cand.name]

    def _weight(self, cand, ctx) -> np.ndarray:
        """The weights the gated op multiplies: Ŵ under --weights int8|int4, else W."""
        W = cand.weight_array()
        q = self._quantized(cand, W, ctx)
        return q["W_hat"] if q is not None and "W_hat" in q else W

    def _baseline_plans(self, ctx) -> dict[str, tuple]:
        """{layer: (cand, pinned backend, its plan)}: what every planned layer is in the quantized
        baseline (MatMulNBits), for the planner's trials. Empty without a pinned backend."""
        if self._pinned_plans is None:
            self._pinned_plans = {}
            pinned = [b for b in ctx.weight_backends if getattr(b, "pinned", False)]
            if pinned and self._precision(ctx) is not None:
                pb = pinned[0]
                for c in ctx.todo:
                    if c.target in pb.cfg.targets:
                        p = pb.plan(c, c.weight_array(), None, ctx)
                        if p.decision != "dense":
                            self._pinned_plans[c.name] = (c, pb, p)
        return self._pinned_plans

    def _samples(self, cand) -> np.ndarray:
        X = self.samples.get(cand.input.name) if self.samples is not None else None
        if X is None:
            raise OrtleanError(f"{cand.name}: KWTA thresholds need calibration activations (--calib-text FILE)")
        return X

    def _curve(self, cand, W) -> list[dict]:
        if cand.name not in self._curves:
            self._curves[cand.name] = layer_curve(self._samples(cand), W, self.cfg.kwta_score)
        return self._curves[cand.name]

    def _global_plan(self, ctx) -> dict[str, dict]:
        """Per-layer keep ratios under the end-to-end budget, down-projections first."""
        if self._choice is not None:
            return self._choice
        cfg = self.cfg
        cands = [c for c in ctx.todo if c.target in cfg.kwta_targets]
        curves = {c.name: self._curve(c, self._weight(c, ctx)) for c in cands}
        base_plans = self._baseline_plans(ctx)   # MatMulNBits for every layer not gated (--weights)
        base = ctx.quality.loss(list(base_plans.values())) if base_plans else 0.0
        # the budget covers the weights too (issue 34): gating spends what the quantized baseline leaves of it,
        # expressed over that baseline (none when the weights alone are over the budget: the guard refuses)
        total = ctx.opts.quality_budget if ctx.opts.quality_budget is not None else 0.02
        budget = cfg.kwta_margin * max(0.0, relative_loss(total, base) if base else total)
        down = [c for c in cands if c.role in ("down", "fc2")]
        rest = [c for c in cands if c not in down]
        if not down:
            down, rest = rest, []
        choice = {c.name: curves[c.name][0] for c in cands}  # keep 1.0

        def loss_with(ch) -> float:
            chosen = []
            for c in cands:
                p = ch[c.name]
                if p["keep"] >= 1.0:
                    continue
                attrs = {"block": 1, "kwta": 1, "kwta_select": "threshold", "kwta_threshold": float(p["threshold"]),
                         "kwta_score": cfg.kwta_score, "keep_ratio": float(p["keep"])}
                q = self._quantized(c, None, ctx)
                if q is not None:
                    attrs.update(q["attrs"])
                chosen.append((c, self, Plan("gating", "", p["gap"], c.params, payload=attrs)))
            gated = {c.name for c, _, _ in chosen}
            chosen += [t for name, t in base_plans.items() if name not in gated]
            return relative_loss(ctx.quality.loss(chosen), base)

        def at(group, i: int) -> dict:
            """`choice` with the group's layers at gap target GAP_GRID[i]."""
            ch = dict(choice)
            for c in group:
                ch[c.name] = pick(curves[c.name], GAP_GRID[i])
            return ch

        def search(group, share) -> int:
            """The largest gap target (index; -1: none) whose loss is ≤ share·budget."""
            i = largest_passing(lambda i: loss_with(at(group, i)) <= share * budget, -1, len(GAP_GRID) - 1)
            if i >= 0:
                choice.update({c.name: at(group, i)[c.name] for c in group})
            return i

        def step_up(group, i) -> int:
            """Spend what the coarse search left: raise the group's gap target one grid step
            at a time while the whole model stays within the budget."""
            while i + 1 < len(GAP_GRID):
                ch = at(group, i + 1)
                if all(ch[c.name] is choice[c.name] for c in group):
                    i += 1
                    continue
                if loss_with(ch) > budget:
                    break
                choice.update({c.name: ch[c.name] for c in group})
                i += 1
            return i

        i_down = search(down, cfg.kwta_budget_share if rest else 1.0)
        if rest:
            search(rest, 1.0)
            step_up(down, i_down)
        self._choice = choice
        return choice

    # -- emission ----------------------------------------------------------------------------
    def emit(self, graph: ir.Graph, cand, plan: Plan, ctx) -> None:
        if isinstance(cand, GroupCandidate):
            return self._emit_group(graph, cand, plan)
        old = cand.node
        base = surgery.safe_name(cand.name)
        if "_wq" in plan.payload:
            w = None  # quantized: the op reads Wq/scales, the f32 weight is dropped with the MatMul
        else:
            w = surgery.initializer(graph, f"{base}.gate_w", cand.weight_array()) if cand.transposed else old.inputs[1]
        new, stateful = self._gate_node(graph, cand, plan, old.inputs[0], w, base, old.name)
        surgery.replace_node(graph, old, new)
        if stateful:
            self._state_output(graph, new, base)

    def _gate_node(self, graph, cand, plan, x, w, base, name):
        attrs = {k: v for k, v in plan.payload.items() if not k.startswith("_")}
        attrs.update(layer=str(cand.layer if cand.layer is not None else cand.name), target=cand.target,
                     gap=float(plan.gap or 0.0), params_dense=int(cand.K * cand.N), params_stored=int(cand.K * cand.N))
        if isinstance(cand, GroupCandidate):
            attrs["fused"] = ",".join(m.name for m in cand.members)
        stateful = bool(attrs.get("event")) or int(attrs.get("kwta_duty", 1)) > 1
        inputs = [x, w]
        if stateful:
            sin = ir.Value(name=f"past_event.{base}", type=ir.TensorType(ir.DataType.FLOAT),
                           shape=ir.Shape(["batch_size", "past_event_len"]))
            graph.inputs.append(sin)
            inputs.append(sin)
        if "_wq" in plan.payload:  # X, (no W), state, Wq, scales
            inputs = [x, None, inputs[2] if stateful else None,
                      surgery.initializer(graph, f"{base}.gate_wq", plan.payload["_wq"]),
                      surgery.initializer(graph, f"{base}.gate_scales", plan.payload["_scales"])]
        return surgery.op_node(self.op_type, inputs, attrs, name=name, num_outputs=2 if stateful else 1), stateful

    @staticmethod
    def _state_output(graph, node, base) -> None:
        sout = node.outputs[1]
        sout.name = f"present_event.{base}"
        sout.type = ir.TensorType(ir.DataType.FLOAT)
        sout.shape = ir.Shape(["batch_size", "event_state"])
        graph.outputs.append(sout)

    def _emit_group(self, graph: ir.Graph, grp: GroupCandidate, plan: Plan) -> None:
        """One EventGatedMatMul over [W_1 | W_2 | …], then Split(axis -1) into the members' outputs."""
        order = {id(n): i for i, n in enumerate(graph)}
        members = sorted(grp.members, key=lambda m: order[id(m.node)])
        base = surgery.safe_name(members[0].name) + ".fused"
        w = None if "_wq" in plan.payload else surgery.initializer(graph, f"{base}.w", grp.weight_array())
        node, stateful = self._gate_node(graph, grp, plan, grp.input, w, base, grp.name)
        sizes = [int(m.N) for m in grp.members]
        if graph.opset_imports.get("", 13) >= 13:
            sv = surgery.initializer(graph, f"{base}.split_sizes", np.asarray(sizes, np.int64))
            split = ir.Node("", "Split", [node.outputs[0], sv], [ir.AttrInt64("axis", -1)], name=f"{grp.name}/Split",
                            num_outputs=len(sizes))
        else:
            split = ir.Node("", "Split", [node.outputs[0]], [ir.AttrInt64("axis", -1), ir.AttrInt64s("split", sizes)],
                            name=f"{grp.name}/Split", num_outputs=len(sizes))
        graph.insert_before(members[0].node, [node, split])
        for m, out_new in zip(grp.members, split.outputs):
            surgery.take_over(graph, m.node, out_new)
        node.outputs[0].name = f"{base}.y"
        node.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
        if stateful:
            self._state_output(graph, node, base)
