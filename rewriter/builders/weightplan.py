"""The per-layer mix of block formats for ``--weights int4`` on a float checkpoint (issue 34 item 3):
which format each weight layer is stored in so that the whole model meets ``--quality-budget`` at the
fewest bits.

Every layer gets a *ladder* of options (:func:`ladder`: the 4-bit formats, then q4_f at block 32,
5-bit, q6_K and q8_0 — the K formats only where K fills their 256-blocks), each quantized by the
rewrite's quantizer (q8_0 by the imatrix search: GPTQ buys nothing measurable at 8 bits), with its stored bits/weight (the last block's padding included) and its gap on the
calibration inputs (``kit.gaps.layer_gap`` with the layer's Gram). Options that cost more bits for no
lower gap are dropped.

The planner (:func:`plan_mix`) spends the budget the way the gating planner does — measured on the
rewrite's end-to-end probe (``ctx.quality``), the model with every other layer as planned:

1. every layer at its cheapest option: the probe's loss ``L0``;
2. per role (q, k, v, o, gate, up, down, head, …), the layers of that role raised to their best
   option: the loss drop, over the drop of those layers' squared gaps, is the role's *sensitivity*
   (``s_r``: Δloss per unit of gap²; one trial per role);
3. a layer's cost of an option is ``s_r · gap²``; on each layer's lower convex hull of (bits, cost)
   the upgrade steps, taken in the order of cost saved per bit added (whole model, params-weighted);
4. the shortest prefix of those steps whose measured loss meets ``margin · budget`` (bisection over the
   prefix length; loss falls as layers gain bits), within ``--weights-bits`` when given.

Without a budget (``--quality-budget off``) every layer takes its *default* option: the lowest-gap one
at ≤ :data:`INT4_BITS` bits/weight (what ``--weights int4`` means alone)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from . import quantizers as Q

# the bits/weight of the 4-bit class: a layer's default option is its lowest-gap one at or under this
INT4_BITS = 4.5
# the planner targets this share of --quality-budget on its probe, the rest a margin for text it did not
# see: the probe is 1024 tokens of the calibration novel, and the gating planner measured novels apart by
# up to ~0.7 points of Δppl at a 2 % budget (rewriter/backends/gating.py, KWTA_MARGIN). On SmolLM2 at
# --quality-budget 0.02 (calibrated on Sense & Sensibility) the mix's probe +1.45 % measured +1.48 % on
# held-out Persuasion (`ortlean eval`; rerun: tests/bench/bench_float_weights.py --recipes mix --budgets 0.02).
MARGIN = 0.75
# a role whose measured drop is within noise still gets this share of the mean sensitivity
_SENS_FLOOR = 0.05


@dataclass
class Option:
    fmt: str
    block: int | None           # q4_f's block
    bits: float                 # stored bits per weight of this layer in this format
    gap: float                  # kit.gaps.layer_gap on the calibration inputs (weight error without)
    blocks: Q.Blocks | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"{self.fmt}/{self.block}" if self.fmt == "q4_f" else self.fmt


@dataclass
class Layer:
    name: str
    role: str
    params: int
    options: list[Option]       # by bits, increasing; gaps decreasing
    default: int = 0            # index of the --weights int4 option

    @property
    def cheapest(self) -> int:
        return 0

    @property
    def best(self) -> int:
        return len(self.options) - 1


def ladder(K: int) -> list[tuple[str, int | None]]:
    """(format, q4_f block) options for a layer of K inputs, cheapest first. Where K fills 256-blocks
    (the padded last block costing ≤ 1 % more bits): q4_f at 256 and 128, q4_K, q4_f/32, q5_K, q6_K,
    q8_0 (ggml's K formats: 6/8-bit sub-block scales, finer than one fp16 pair per 64 at the same bits).
    Otherwise the 32-blocks: q4_f at the largest block no dearer than 64's (4.5 bits), q4_f/32 (the
    5.0-bit asymmetric block), q5_1, q8_0. A block whose padding makes it dearer than a smaller one is
    left out."""
    def bits(f, B=None):
        return Q.layer_bits(f, K, B)

    if bits("q4_K") <= 4.5 * 1.01:
        out: list[tuple[str, int | None]] = [("q4_f", B) for B in (256, 128) if bits("q4_f", B) < bits("q4_f", B // 2)]
        return out + [("q4_K", None), ("q4_f", 32), ("q5_K", None), ("q6_K", None), ("q8_0", None)]
    out = [("q4_f", B) for B in (256, 128) if bits("q4_f", B) < bits("q4_f", 64)]
    return out + [("q4_f", 64), ("q4_f", 32), ("q5_1", None), ("q8_0", None)]


def prune(options: list[Option]) -> list[Option]:
    """Sorted by bits; an option that costs at least as many bits as a cheaper one for no lower gap is
    dropped (ties in bits: the lower gap stays)."""
    out: list[Option] = []
    for o in sorted(options, key=lambda o: (o.bits, o.gap)):
        if out and o.gap >= out[-1].gap:
            continue
        out.append(o)
    return out


def default_index(layer: Layer) -> int:
    """The lowest-gap option at ≤ INT4_BITS bits/weight (the cheapest when none fits)."""
    fits = [i for i, o in enumerate(layer.options) if o.bits <= INT4_BITS + 1e-9]
    return min(fits, key=lambda i: layer.options[i].gap) if fits else 0


def model_bits(layers: list[Layer], choice: dict[str, int]) -> float:
    """Stored bits per weight over the layers, as chosen."""
    p = sum(l.params for l in layers)
    return sum(l.params * l.options[choice[l.name]].bits for l in layers) / max(p, 1)


@dataclass
class Step:
    layer: str
    to: int                     # option index after the step
    dbits: float                # model bits added (params-weighted, not per weight)
    gain: float                 # estimated loss saved


def _hull_steps(layer: Layer, start: int, s: float) -> list[Step]:
    """Upgrade steps of one layer from option `start` along the lower convex hull of (bits, s·gap²):
    each step saves the most estimated loss per bit among the options above it."""
    steps, cur = [], start
    while cur < layer.best:
        o = layer.options[cur]
        best, best_eff = None, -1.0
        for j in range(cur + 1, len(layer.options)):
            p = layer.options[j]
            db = (p.bits - o.bits) * layer.params
            gain = s * (o.gap ** 2 - p.gap ** 2)
            if db > 0 and gain / db > best_eff:
                best, best_eff = j, gain / db
        if best is None:
            break
        p = layer.options[best]
        steps.append(Step(layer.name, best, (p.bits - o.bits) * layer.params, s * (o.gap ** 2 - p.gap ** 2)))
        cur = best
    return steps


@dataclass
class MixResult:
    choice: dict[str, int]
    loss: float | None
    bits: float
    target: float
    trials: list[dict]
    sensitivity: dict[str, float]
    feasible: bool
    note: str = ""


def plan_mix(layers: list[Layer], loss: Callable[[dict[str, int]], float], budget: float, *,
             max_bits: float | None = None, margin: float = MARGIN, progress=None) -> MixResult:
    """The cheapest mix (module docstring) whose probe loss is ≤ margin · budget: ``loss(choice)`` measures
    a choice {layer name: option index} end to end. ``max_bits`` caps the model's bits/weight (the steps
    beyond it are not taken). Infeasible (every step taken, or the cap reached, still over the target):
    the last mix tried with ``feasible`` False — the caller refuses it."""
    target = margin * budget
    trials: list[dict] = []
    memo: dict[tuple, float] = {}

    def measure(choice: dict[str, int], what: str) -> float:
        key = tuple(choice[l.name] for l in layers)
        if key not in memo:
            memo[key] = float(loss(choice))
            trials.append({"what": what, "bits": round(model_bits(layers, choice), 4), "loss": memo[key]})
            if progress is not None:
                progress(trials[-1])
        return memo[key]

    start = {l.name: l.cheapest for l in layers}
    L0 = measure(start, "every layer at its cheapest option")
    if L0 <= target:
        return MixResult(start, L0, model_bits(layers, start), target, trials, {}, True)
    # sensitivities per role: raise the role's layers to their best option
    roles: dict[str, list[Layer]] = {}
    for l in layers:
        roles.setdefault(l.role, []).append(l)
    sens: dict[str, float] = {}
    for r, ls in roles.items():
        g2 = sum(l.options[0].gap ** 2 - l.options[-1].gap ** 2 for l in ls)
        if g2 <= 0:
            sens[r] = 0.0
            continue
        ch = dict(start)
        ch.update({l.name: l.best for l in ls})
        sens[r] = max(0.0, L0 - measure(ch, f"{r} layers at their best option")) / g2
    positive = [v for v in sens.values() if v > 0]
    floor = _SENS_FLOOR * (sum(positive) / len(positive)) if positive else 1.0
    sens = {r: max(v, floor) for r, v in sens.items()}
    steps = sorted((st for l in layers for st in _hull_steps(l, 0, sens[l.role])),
                   key=lambda st: -st.gain / st.dbits)
    total = sum(l.params for l in layers)

    def after(k: int) -> dict[str, int]:
        ch = dict(start)
        for st in steps[:k]:
            ch[st.layer] = max(ch[st.layer], st.to)
        return ch

    n = len(steps)
    note = ""
    if max_bits is not None:
        b, k_cap = model_bits(layers, start), 0
        for st in steps:
            if b + st.dbits / total > max_bits + 1e-9:
                break
            b += st.dbits / total
            k_cap += 1
        if k_cap < n:
            note = f"--weights-bits {max_bits:g} allows {k_cap} of the {n} upgrade steps"
        n = k_cap
    if n == 0:
        return MixResult(start, L0, model_bits(layers, start), target, trials, sens, False,
                         note or "no upgrade step: every layer already at its best option")
    Ln = measure(after(n), f"{n} upgrade steps")
    if Ln > target:
        return MixResult(after(n), Ln, model_bits(layers, after(n)), target, trials, sens, False, note)
    lo, hi = 0, n          # loss(lo) > target (lo = 0 measured), loss(hi) ≤ target
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if measure(after(mid), f"{mid} upgrade steps") <= target:
            hi = mid
        else:
            lo = mid
    ch = after(hi)
    return MixResult(ch, measure(ch, f"{hi} upgrade steps"), model_bits(layers, ch), target, trials, sens, True, note)


def describe(layers: list[Layer], choice: dict[str, int]) -> str:
    """"q4_f/64 ×150 (4.50), q4_f/32 ×40 (5.00), …; 4.62 bits/weight"."""
    by: dict[str, list] = {}
    for l in layers:
        o = l.options[choice[l.name]]
        by.setdefault(o.name, []).append(o.bits)
    parts = [f"{k} ×{len(v)}" for k, v in sorted(by.items(), key=lambda kv: -len(kv[1]))]
    return f"{', '.join(parts)}; {model_bits(layers, choice):.3f} bits/weight"


def isfinite(x) -> bool:
    return x is not None and math.isfinite(x)
