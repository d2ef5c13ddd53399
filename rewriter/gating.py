"""EventGatedMatMul backend: activation gating of layers left dense (zero-skip, KWTA, event-driven).

Flags are the seeds' (003 KWTA, 004 event-driven, the MLP half of 001 zero-skip). The layer keeps
its dense weight; the op decides per call which input channels (rows of W) to read.

Planner (`--kwta=on` without an explicit k): per-layer TEAL-style thresholds on the score
|x_k|·‖W_k‖, calibrated offline from calibration activations (the online cost is one compare per
channel). For every layer and keep ratio p on a grid, the threshold τ(p) is the (1−p) quantile
of the layer's calibration scores and gap(p) = ‖(X⊙mask−X)W‖/‖XW‖ on held calibration rows. A
per-layer *gap target* g turns into a keep ratio per layer (the smallest p with gap(p) ≤ g: layers
that tolerate sparsity get more of it). The global quality budget (`--quality-budget`, Δppl on
held-out calibration text) is spent down-projection first: g_down is bisected on the end-to-end
probe with a share of the budget, then g for the other targeted layers with the rest. The chosen
keep ratio and threshold are recorded per layer in the node's attributes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from . import DOMAIN
from .backends import Plan
from .backends import onoff as _onoff
from .backends import parse_targets
from .errors import OrtleanError
from .graph import Candidate

KEEP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2)
# Per-layer gap targets the planner bisects over. A finer grid (31 steps) spent the budget more
# fully on the calibration probe (+1.79 % at a 2 % budget) but measured +2.87 % on held-out
# Persuasion with no decode gain (1.11x vs 1.10x): the 16-step grid leaves margin (+1.17 % probe,
# +1.54 % held out).
GAP_GRID = tuple(float(x) for x in np.geomspace(0.01, 0.6, 16))


@dataclass
class GatingConfig:
    enabled: bool = False
    targets: tuple[str, ...] = ()
    # KWTA (seed 003)
    kwta: bool = False
    kwta_k: float | None = None         # fraction kept (None: planner under the quality budget)
    kwta_k_abs: int | None = None       # channels kept (exact top-K per row)
    kwta_temp: float = 0.0              # > 0: softmax(score/temp) mass selection (mass = k)
    kwta_duty: int = 1
    kwta_targets: tuple[str, ...] = ("mlp",)
    kwta_block: int = 1
    kwta_score: str = "xw"
    kwta_renorm: bool = False
    kwta_budget_share: float = 0.6      # share of the quality budget spent on down-projections first
    # event (seed 004)
    event: bool = False
    event_budget_ms: float = 0.0        # per token for the whole model (split over event layers); 0 = none
    event_quorum: float = 1.0
    event_topk: float = 0.4
    event_theta: float = 0.01
    event_gap_tol: float = 0.03
    event_gap_every: int = 16
    event_beta: float = 1.0
    event_lambda: float = 0.0
    event_age_max: int = 32
    event_targets: tuple[str, ...] = ("mlp",)
    event_block: int | None = None      # default: the KWTA block
    # zero-skip (seed 001, MLP half)
    pack: str = "none"
    pack_eps: float = 0.0
    pack_rho: float = 1.0
    pack_targets: tuple[str, ...] = ()
    calib_rows: int = 512
    dense_prefill: bool = False
    fuse: bool = True                   # one op (one mask) per group of projections sharing an input

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
        if not (0 < self.event_topk <= 1):
            raise OrtleanError(f"--event-topk {self.event_topk}: a fraction in (0, 1]")
        if not (0 < self.event_quorum <= 1):
            raise OrtleanError(f"--event-quorum {self.event_quorum}: a fraction in (0, 1]")
        if self.event_budget_ms < 0 or self.event_theta < 0 or self.event_gap_tol < 0:
            raise OrtleanError("--event-budget-ms, --event-delta-theta and --event-gap-tol must be ≥ 0")
        if not (0 < self.pack_rho <= 1):
            raise OrtleanError(f"--state-pack-rho {self.pack_rho}: in (0, 1]")
        if self.kwta_temp > 0 and self.kwta_k is None and self.kwta_k_abs is None and self.kwta:
            raise OrtleanError("--kwta-temp > 0 selects by softmax mass: give the mass with --kwta-k")


# --------------------------------------------------------------------------- calibration samples
class Samples:
    """Up to `rows` calibration rows per captured value (evenly strided over the calibration run)."""

    def __init__(self, names, rows: int, total_rows_hint: int):
        self.names = set(names)
        self.rows = rows
        self.stride = max(1, total_rows_hint // rows)
        self.data: dict[str, list[np.ndarray]] = {}
        self.seen: dict[str, int] = {}

    def __call__(self, name: str, x: np.ndarray) -> None:
        if name not in self.names:
            return
        s = self.seen.get(name, 0)
        idx = np.arange((-s) % self.stride, x.shape[0], self.stride)
        self.seen[name] = s + x.shape[0]
        if idx.size:
            have = sum(a.shape[0] for a in self.data.get(name, []))
            idx = idx[: max(0, self.rows - have)]
            if idx.size:
                self.data.setdefault(name, []).append(np.ascontiguousarray(x[idx], dtype=np.float32))

    def get(self, name: str) -> np.ndarray | None:
        d = self.data.get(name)
        return np.concatenate(d, 0) if d else None


def layer_curve(X: np.ndarray, W: np.ndarray, score: str = "xw", grid=KEEP_GRID) -> list[dict]:
    """For each keep ratio p: TEAL threshold τ (quantile of the calibration scores) and the
    relative output error of gating the rows X with it."""
    norms = np.linalg.norm(W.astype(np.float64), axis=1).astype(np.float32)
    S = np.abs(X) * (norms[None, :] if score == "xw" else 1.0)
    Y = X @ W
    ny = float(np.linalg.norm(Y)) or 1.0
    flat = np.sort(S.ravel())
    out = []
    for p in grid:
        if p >= 1.0:
            out.append({"keep": 1.0, "threshold": 0.0, "gap": 0.0, "measured_keep": 1.0})
            continue
        q = int(min(len(flat) - 1, max(0, round((1 - p) * len(flat)))))
        thr = float(flat[q])
        drop = S <= thr
        D = np.where(drop, X, 0.0).astype(np.float32)
        gap = float(np.linalg.norm(D @ W)) / ny
        out.append({"keep": p, "threshold": thr, "gap": gap, "measured_keep": float(1.0 - drop.mean())})
    return out


def pick(curve: list[dict], g: float) -> dict:
    """The smallest keep ratio whose gap ≤ g (keep 1.0 when none)."""
    best = curve[0]
    for c in curve:
        if c["gap"] <= g and c["keep"] < best["keep"]:
            best = c
    return best


# --------------------------------------------------------------------------- fused groups
@dataclass
class GroupCandidate(Candidate):
    """Projections that read the same input value (q/k/v of an attention block, gate/up of a
    gated MLP), gated as one layer: W = [W_1 | W_2 | …] ([K, ΣN]), one KWTA mask per token scored
    with the rows of the concatenated weight, one row-skipping matvec, then a Split back into the
    members' outputs. Planned, guarded and reported as one unit."""
    members: list = field(default_factory=list)

    def weight_array(self) -> np.ndarray:
        return np.ascontiguousarray(np.concatenate([m.weight_array() for m in self.members], axis=1))

    def rebind(self, cands: dict) -> "GroupCandidate":
        """The same group on another load of the model (candidates by name)."""
        return make_group([cands[m.name] for m in self.members])


def make_group(members: list) -> GroupCandidate:
    m0 = members[0]
    roles = "+".join(m.role for m in members)
    return GroupCandidate(node=m0.node, name="+".join(m.name for m in members), weight=m0.weight,
                          transposed=False, K=m0.K, N=int(sum(m.N for m in members)), target=m0.target, role=roles,
                          layer=m0.layer, how=m0.how, input=m0.input, members=list(members))


def group_shared_inputs(todo: list, targets) -> list:
    """Candidates of `targets` that read the same value become one GroupCandidate (in graph
    order); everything else passes through."""
    def eligible(c) -> bool:
        return c.target in targets and c.target != "head" and c.input is not None

    by_input: dict[int, list] = {}
    for c in todo:
        if eligible(c):
            by_input.setdefault(id(c.input), []).append(c)
    out, seen = [], set()
    for c in todo:
        grp = by_input.get(id(c.input)) if eligible(c) else None
        if grp and len(grp) > 1:
            if id(c.input) not in seen:
                seen.add(id(c.input))
                out.append(make_group(grp))
            continue
        out.append(c)
    return out


# --------------------------------------------------------------------------- the backend
class GatingBackend:
    name = "gating"
    op_type = "EventGatedMatMul"

    def add_flags(self, p) -> None:
        k = p.add_argument_group("EventGatedMatMul: KWTA (seed 003)")
        k.add_argument("--kwta", type=_onoff, default=False, metavar="on|off", help="KWTA activation gating")
        k.add_argument("--kwta-k", type=float, default=None,
                       help="fraction of input channels kept (calibrated per-layer threshold); default: the "
                            "planner picks per-layer keep ratios under --quality-budget")
        k.add_argument("--kwta-k-abs", type=int, default=None, help="channels kept per row (exact top-K)")
        k.add_argument("--kwta-temp", type=float, default=0.0,
                       help="> 0: keep the top channels holding --kwta-k of the softmax(score/temp) mass")
        k.add_argument("--kwta-duty", type=int, default=1, help="refresh the mask every N decode steps (default 1)")
        k.add_argument("--kwta-target", default="mlp", help="mlp | attn | both | head | all | comma list (default mlp)")
        k.add_argument("--kwta-block", type=int, default=1, help="channels per gating block (default 1: single channels)")
        k.add_argument("--kwta-score", default="xw", help="xw: |x_k|·‖W_k‖ (default) | x: |x_k|")
        k.add_argument("--kwta-renorm", type=_onoff, default=False, metavar="on|off", help="scale by 1/p_keep")
        k.add_argument("--gate-fuse", type=_onoff, default=True, metavar="on|off",
                       help="gate projections that read the same input (q/k/v, gate/up) as one op: one mask per "
                            "token reused for all of them (seed 003: the same mask for K/V), one pass over x, "
                            "longer weight rows (default on; only when gating is the only weight backend)")
        k.add_argument("--kwta-budget-share", type=float, default=0.6,
                       help="share of --quality-budget the planner spends on down-projections first (default 0.6)")
        e = p.add_argument_group("EventGatedMatMul: event-driven (seed 004)")
        e.add_argument("--event-driven", type=_onoff, default=False, metavar="on|off", help="delta updates under a budget")
        e.add_argument("--event-budget-ms", type=float, default=0.0, help="ms per token for all event layers (0 = none)")
        e.add_argument("--event-quorum", type=float, default=1.0, help="stop once this share of the delta mass is applied")
        e.add_argument("--event-topk", type=float, default=0.4, help="fraction of blocks updated per token (default 0.4)")
        e.add_argument("--event-delta-theta", type=float, default=0.01, help="relative delta below which a block is skipped")
        e.add_argument("--event-gap-tol", type=float, default=0.03, help="quality gap that disables the mode (default 0.03)")
        e.add_argument("--event-gap-every", type=int, default=16, help="dense check every N tokens (default 16)")
        e.add_argument("--event-beta", type=float, default=1.0, help="staleness weight β·exp(−λ·age)")
        e.add_argument("--event-lambda", type=float, default=0.0, help="staleness decay λ")
        e.add_argument("--event-age-max", type=int, default=32, help="a block stale this long is refreshed (0 = never)")
        e.add_argument("--event-target", default="mlp", help="mlp | attn | both | head | all | comma list (default mlp)")
        e.add_argument("--event-block", type=int, default=None, help="channels per event block (default: --kwta-block)")
        z = p.add_argument_group("EventGatedMatMul: zero-skip (seed 001, MLP half; --state-pack*)")
        z.add_argument("--state-pack-rho", type=float, default=0.15,
                       help="density above which a row runs dense (seed 001 ρ, default 0.15)")

    def config(self, args) -> GatingConfig:
        pack = getattr(args, "state_pack", "none") or "none"
        ptarget = getattr(args, "state_pack_target", "kv") or "kv"
        pack_on = pack != "none" and ptarget in ("mlp", "both")
        cfg = GatingConfig(
            kwta=bool(getattr(args, "kwta", False)), kwta_k=getattr(args, "kwta_k", None),
            kwta_k_abs=getattr(args, "kwta_k_abs", None), kwta_temp=getattr(args, "kwta_temp", 0.0),
            kwta_duty=getattr(args, "kwta_duty", 1), kwta_targets=parse_targets(getattr(args, "kwta_target", "mlp"), "--kwta-target"),
            kwta_block=getattr(args, "kwta_block", 1), kwta_score=getattr(args, "kwta_score", "xw"),
            kwta_renorm=bool(getattr(args, "kwta_renorm", False)),
            kwta_budget_share=getattr(args, "kwta_budget_share", 0.6),
            event=bool(getattr(args, "event_driven", False)), event_budget_ms=getattr(args, "event_budget_ms", 0.0),
            event_quorum=getattr(args, "event_quorum", 1.0), event_topk=getattr(args, "event_topk", 0.4),
            event_theta=getattr(args, "event_delta_theta", 0.01), event_gap_tol=getattr(args, "event_gap_tol", 0.03),
            event_gap_every=getattr(args, "event_gap_every", 16), event_beta=getattr(args, "event_beta", 1.0),
            event_lambda=getattr(args, "event_lambda", 0.0), event_age_max=getattr(args, "event_age_max", 32),
            event_targets=parse_targets(getattr(args, "event_target", "mlp"), "--event-target"),
            event_block=getattr(args, "event_block", None),
            pack=pack if pack_on else "none",
            pack_eps=(getattr(args, "state_pack_eps", None) or 0.0) if pack_on else 0.0,
            pack_rho=getattr(args, "state_pack_rho", 0.15), pack_targets=("mlp",) if pack_on else (),
            fuse=bool(getattr(args, "gate_fuse", True)),
        )
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

    def group_candidates(self, todo: list, cfg: GatingConfig, enabled_backends: list) -> list:
        """Fuse shared-input projections (--gate-fuse) when gating is the only weight backend
        (another backend may want a member on its own)."""
        if not (cfg.enabled and cfg.fuse) or any(b.name != self.name for b in enabled_backends):
            return todo
        return group_shared_inputs(todo, cfg.targets)

    # -- calibration -------------------------------------------------------------------------
    def _planner(self, cfg: GatingConfig) -> bool:
        return cfg.kwta and cfg.kwta_k is None and cfg.kwta_k_abs is None

    def needs_calibration(self, cfg: GatingConfig) -> bool:
        return cfg.enabled and cfg.kwta and cfg.kwta_k_abs is None

    def calibration_hook(self, cfg: GatingConfig, ctx):
        if not self.needs_calibration(cfg):
            return None
        todo = [c for c in ctx.extra.get("todo", []) if c.target in cfg.kwta_targets]
        rcfg = ctx.extra.get("rewrite_cfg")
        total = getattr(rcfg, "calib_tokens", 4096)
        s = Samples([c.input.name for c in todo], cfg.calib_rows, total)
        ctx.extra["gating_samples"] = s
        return s

    # -- planning ----------------------------------------------------------------------------
    def plan(self, cand, W, G, cfg: GatingConfig, ctx) -> Plan:
        kw = cfg.kwta and cand.target in cfg.kwta_targets
        ev = cfg.event and cand.target in cfg.event_targets
        pk = cfg.pack != "none" and cand.target in cfg.pack_targets
        if not (kw or ev or pk):
            return Plan("dense", "not targeted by the gating flags", None, cand.params)
        attrs: dict = {"block": int(cfg.kwta_block), "dense_prefill": int(cfg.dense_prefill)}
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
                curve = self._curve(cand, W, cfg, ctx)
                if self._planner(cfg):
                    choice = self._global_plan(cfg, ctx)[cand.name]
                else:
                    match = [c for c in curve if abs(c["keep"] - cfg.kwta_k) < 1e-9]
                    choice = match[0] if match else self._curve_at(cand, W, cfg, ctx, cfg.kwta_k)
                if choice["keep"] >= 1.0 and not (ev or pk):
                    return Plan("dense", "kept dense: planner keeps every channel of this layer under the budget",
                                0.0, cand.params)
                attrs.update(kwta_select="threshold", kwta_threshold=float(choice["threshold"]),
                             keep_ratio=float(choice["keep"]))
                gap = choice["gap"]
                info["keep"] = choice["keep"]
        if ev:
            eb = cfg.event_block or cfg.kwta_block
            attrs["block"] = int(eb if not kw else cfg.kwta_block)
            n_ev = max(1, sum(1 for c in ctx.extra.get("todo", []) if c.target in cfg.event_targets))
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
        return Plan("gating", "gated: " + ", ".join(what), gap, cand.params, payload=attrs,
                    attrs={"method": "+".join(w.split()[0] for w in what)})

    def _samples(self, cand, ctx) -> np.ndarray:
        s = ctx.extra.get("gating_samples")
        X = s.get(cand.input.name) if s is not None else None
        if X is None:
            raise OrtleanError(f"{cand.name}: KWTA thresholds need calibration activations (--calib-text FILE)")
        return X

    def _curve(self, cand, W, cfg, ctx) -> list[dict]:
        cache = ctx.extra.setdefault("gating_curves", {})
        if cand.name not in cache:
            cache[cand.name] = layer_curve(self._samples(cand, ctx), W, cfg.kwta_score)
        return cache[cand.name]

    def _curve_at(self, cand, W, cfg, ctx, p) -> dict:
        return layer_curve(self._samples(cand, ctx), W, cfg.kwta_score, grid=(p,))[0]

    def _global_plan(self, cfg: GatingConfig, ctx) -> dict[str, dict]:
        """Per-layer keep ratios under the end-to-end budget, down-projections first."""
        if "gating_global" in ctx.extra:
            return ctx.extra["gating_global"]
        from . import pipeline

        rcfg = ctx.extra["rewrite_cfg"]
        cands = [c for c in ctx.extra["todo"] if c.target in cfg.kwta_targets]
        curves = {c.name: self._curve(c, c.weight_array(), cfg, ctx) for c in cands}
        budget = rcfg.quality_budget if rcfg.quality_budget is not None else 0.02
        from pathlib import Path

        inp = Path(rcfg.model)
        probe = pipeline.QualityProbe(inp, ctx.io, rcfg)
        down = [c for c in cands if c.role in ("down", "fc2")]
        rest = [c for c in cands if c not in down]
        if not down:
            down, rest = rest, []
        choice = {c.name: curves[c.name][0] for c in cands}  # keep 1.0
        trials = []

        def loss_with(ch) -> float:
            chosen = []
            for c in cands:
                p = ch[c.name]
                if p["keep"] >= 1.0:
                    continue
                attrs = {"block": 1, "kwta": 1, "kwta_select": "threshold", "kwta_threshold": float(p["threshold"]),
                         "kwta_score": cfg.kwta_score, "keep_ratio": float(p["keep"])}
                chosen.append((c, self, Plan("gating", "", p["gap"], c.params, payload=attrs)))
            if not chosen:
                return 0.0
            v = probe.loss(pipeline._trial_model(inp, chosen, ctx))
            trials.append({"layers": len(chosen), "loss": v})
            return v

        def search(group, share) -> int:
            lo, hi = -1, len(GAP_GRID) - 1  # largest g index whose loss ≤ share·budget
            best = None
            while lo < hi:
                mid = (lo + hi + 1) // 2
                ch = dict(choice)
                for c in group:
                    ch[c.name] = pick(curves[c.name], GAP_GRID[mid])
                v = loss_with(ch)
                if v <= share * budget:
                    lo, best = mid, ch
                else:
                    hi = mid - 1
            if best is not None:
                choice.update({c.name: best[c.name] for c in group})
            return lo

        def step_up(group, at) -> int:
            """Spend what the coarse search left: raise the group's gap target one grid step
            at a time while the whole model stays within the budget."""
            while at + 1 < len(GAP_GRID):
                ch = dict(choice)
                for c in group:
                    ch[c.name] = pick(curves[c.name], GAP_GRID[at + 1])
                if all(ch[c.name] is choice[c.name] for c in group):
                    at += 1
                    continue
                if loss_with(ch) > budget:
                    break
                choice.update({c.name: ch[c.name] for c in group})
                at += 1
            return at

        at_down = search(down, cfg.kwta_budget_share if rest else 1.0)
        if rest:
            search(rest, 1.0)
            step_up(down, at_down)
        ctx.extra["gating_global"] = choice
        ctx.extra["gating_trials"] = trials
        return choice

    # -- emission ----------------------------------------------------------------------------
    def emit(self, graph: ir.Graph, cand, plan: Plan, ctx) -> None:
        from .tt import _safe, replace_node

        if isinstance(cand, GroupCandidate):
            return self._emit_group(graph, cand, plan)
        old = cand.node
        base = _safe(cand.name)
        if cand.transposed:
            w = ir.Value(name=f"{base}.gate_w", const_value=ir.tensor(cand.weight_array(), name=f"{base}.gate_w"))
            graph.register_initializer(w)
        else:
            w = old.inputs[1]
        new, stateful = self._gate_node(graph, cand, plan, old.inputs[0], w, base, old.name)
        replace_node(graph, old, new)
        if stateful:
            self._state_output(graph, new, base)

    @staticmethod
    def _gate_node(graph, cand, plan, x, w, base, name):
        attrs_d = dict(plan.payload)
        attrs_d.update(layer=str(cand.layer if cand.layer is not None else cand.name), target=cand.target,
                       gap=float(plan.gap or 0.0), params_dense=int(cand.K * cand.N), params_stored=int(cand.K * cand.N))
        if isinstance(cand, GroupCandidate):
            attrs_d["fused"] = ",".join(m.name for m in cand.members)
        attrs = []
        for k, v in attrs_d.items():
            if isinstance(v, str):
                attrs.append(ir.AttrString(k, v))
            elif isinstance(v, (bool, int, np.integer)):
                attrs.append(ir.AttrInt64(k, int(v)))
            else:
                attrs.append(ir.AttrFloat32(k, float(v)))
        stateful = bool(attrs_d.get("event")) or int(attrs_d.get("kwta_duty", 1)) > 1
        inputs = [x, w]
        if stateful:
            sin = ir.Value(name=f"past_event.{base}", type=ir.TensorType(ir.DataType.FLOAT),
                           shape=ir.Shape(["batch_size", "past_event_len"]))
            graph.inputs.append(sin)
            inputs.append(sin)
        return ir.Node(DOMAIN, "EventGatedMatMul", inputs, attrs, name=name, num_outputs=2 if stateful else 1), stateful

    @staticmethod
    def _state_output(graph, node, base) -> None:
        sout = node.outputs[1]
        sout.name = f"present_event.{base}"
        sout.type = ir.TensorType(ir.DataType.FLOAT)
        sout.shape = ir.Shape(["batch_size", "event_state"])
        graph.outputs.append(sout)

    def _emit_group(self, graph: ir.Graph, grp: GroupCandidate, plan: Plan) -> None:
        """One EventGatedMatMul over [W_1 | W_2 | …], then Split(axis -1) into the members' outputs."""
        from .tt import _drop_if_unused, _safe

        order = {id(n): i for i, n in enumerate(graph)}
        members = sorted(grp.members, key=lambda m: order[id(m.node)])
        base = _safe(members[0].name) + ".fused"
        wname = f"{base}.w"
        w = ir.Value(name=wname, const_value=ir.tensor(grp.weight_array(), name=wname))
        graph.register_initializer(w)
        node, stateful = self._gate_node(graph, grp, plan, grp.input, w, base, grp.name)
        sizes = [int(m.N) for m in grp.members]
        opset = graph.opset_imports.get("", 13)
        if opset >= 13:
            sname = f"{base}.split_sizes"
            sv = ir.Value(name=sname, const_value=ir.tensor(np.asarray(sizes, np.int64), name=sname))
            graph.register_initializer(sv)
            split = ir.Node("", "Split", [node.outputs[0], sv], [ir.AttrInt64("axis", -1)], name=f"{grp.name}/Split",
                            num_outputs=len(sizes))
        else:
            split = ir.Node("", "Split", [node.outputs[0]], [ir.AttrInt64("axis", -1), ir.AttrInt64s("split", sizes)],
                            name=f"{grp.name}/Split", num_outputs=len(sizes))
        graph.insert_before(members[0].node, [node, split])
        for m, out_new in zip(grp.members, split.outputs):
            old = m.node
            out_old = old.outputs[0]
            name = out_old.name
            out_new.type, out_new.shape = out_old.type, out_old.shape
            out_old.replace_all_uses_with(out_new, replace_graph_outputs=True)
            weight_in = old.inputs[1]
            graph.remove(old, safe=True)
            out_new.name = name
            _drop_if_unused(graph, weight_in)
        node.outputs[0].name = f"{base}.y"
        node.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
        if stateful:
            self._state_output(graph, node, base)


BACKEND = GatingBackend()
