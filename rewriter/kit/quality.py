"""The end-to-end quality check shared by every planner and the guard of one rewrite: one probe on
held-out calibration text (its dense reference computed once) and trial models built in memory
(a clone of the loaded model with a subset of the layer plans emitted; candidates are carried
over to the clone, not searched again)."""
from __future__ import annotations

from typing import Callable

import numpy as np
import onnx_ir as ir

from custom_ops import runtime
from custom_ops.schema import DOMAIN

from . import stream
from .calib import CalibText


def session(model, threads: int):
    """An onnxruntime session on `model` (a path, bytes, or a loaded model: run without a copy of
    its weights, segment by segment when they exceed kit.stream.STREAM_BYTES) with the ortlean ops
    registered (native library, else the numpy references)."""
    return stream.session(model, threads)


WINDOW = 512     # the probe's windows: `ortlean eval`'s (256-token windows read Gemma 3's loss wrong)


class QualityProbe:
    """Whole-model loss of a candidate rewrite vs the dense model on held-out calibration text
    (the part after the calibration tokens; never the evaluation text): for causal LMs the one-sided
    95 % upper bound of Δppl (``runtime.paired_delta`` of the per-token NLLs against the dense model's
    on the same tokens; windows of WINDOW tokens, each starting with the tokenizer's prefix, as a
    prompt does), so that what passes the budget here holds on text the rewrite never saw; 1 − mean
    sentence-embedding cosine for encoders. ``last`` is the latest measurement's (mean, bound)."""

    def __init__(self, dense, io, calib: CalibText, calib_tokens: int, quality_tokens: int, threads: int):
        self.io = io
        self.threads = stream.probe_threads(threads)   # all cores: the same numbers, sooner
        self.tok = calib.tok
        self.last: tuple[float, float] | None = None
        sess = session(dense, self.threads)
        if io.kind == "causal-lm":
            ids = calib.ids
            held = ids[calib_tokens: calib_tokens + quality_tokens]
            if len(held) < 64:  # short text: score its tail, overlapping calibration
                held = ids[-quality_tokens:]
            self.ids = np.asarray(held, dtype=np.int64)
            self.window = min(WINDOW, len(self.ids))
            self.prefix = runtime.text_prefix(self.tok)
            r = stream.perplexity(sess, io, self.ids, self.window, self.prefix)
            self.ref, self.ref_tokens = r["nll"], r["token_nll"]
        else:
            sents = runtime.sentences_from_text(calib.text, 4 * max(8, quality_tokens // 16))
            self.sents = sents[1::4][: max(8, quality_tokens // 16)]  # not the calibration sentences' order
            self.ref = runtime.embeddings(sess, io, self.tok, self.sents)

    @property
    def metric(self) -> str:
        return "delta_ppl" if self.io.kind == "causal-lm" else "1-cosine"

    @property
    def unit(self) -> str:
        return "tokens" if self.io.kind == "causal-lm" else "sentences"

    @property
    def size(self) -> int:
        return int(self.ids.size) if self.io.kind == "causal-lm" else len(self.sents)

    def loss(self, model) -> float:
        """The bound (causal LMs; ``last`` holds the mean beside it) or 1 − mean cosine (encoders)."""
        sess = session(model, self.threads)
        if self.io.kind == "causal-lm":
            io = runtime.ModelIO.from_session(sess).fill_from(self.io)  # a rewrite may add states (event caches)
            r = stream.perplexity(sess, io, self.ids, self.window, self.prefix)
            d, up = runtime.paired_delta(r["token_nll"], self.ref_tokens)
            self.last = (float(d), float(up))
            return float(up)
        e = runtime.embeddings(sess, self.io, self.tok, self.sents)
        cos = np.sum(e * self.ref, axis=1) / (np.linalg.norm(e, axis=1) * np.linalg.norm(self.ref, axis=1) + 1e-30)
        self.last = (float(1.0 - cos.mean()),) * 2
        return float(1.0 - cos.mean())


def trial_model(model: ir.Model, chosen, ctx) -> ir.Model:
    """`model` (not modified) with the plans `chosen` [(candidate, backend, plan)] emitted: a clone
    sharing the model's tensors and the plans' arrays (run it with :func:`session`: nothing is
    copied)."""
    m = model.clone()
    nodes = {id(a): b for a, b in zip(model.graph, m.graph)}
    for c, b, plan in chosen:
        b.emit(m.graph, c.rebind(nodes, m.graph), plan, ctx)
    m.opset_imports.setdefault(DOMAIN, 1)
    return m


class Quality:
    """Loss of the loaded model with a subset of plans emitted, on the rewrite's one probe."""

    def __init__(self, ctx):
        self.ctx = ctx
        self._probe: QualityProbe | None = None

    @property
    def probe(self) -> QualityProbe:
        if self._probe is None:
            c = self.ctx
            self._probe = QualityProbe(c.source(), c.io, c.calib, c.opts.calib_tokens, c.opts.quality_tokens,
                                       c.threads)
        return self._probe

    def loss(self, chosen) -> float:
        """0 for no plan; else the probe's loss of the trial model."""
        if not chosen:
            return 0.0
        return self.probe.loss(trial_model(self.ctx.model, chosen, self.ctx))


def relative_loss(loss: float, base: float) -> float:
    """A probe loss measured against the dense model, re-expressed against a baseline whose loss is
    `base`: for Δppl, (1 + loss) / (1 + base) − 1 = exp(nll − nll_base) − 1 (the baseline's
    perplexity is the reference); base 0 returns `loss`."""
    return (1.0 + loss) / (1.0 + base) - 1.0 if base else loss


def remaining_budget(budget: float, spent: float) -> float:
    """What is left of the end-to-end `budget` once changes costing `spent` (against the source) are
    in: the loss a further change may add over that model, so that both together stay within
    `budget` (losses compound: (1 + spent)(1 + r) = 1 + budget); never below 0."""
    return max(0.0, relative_loss(budget, spent))


class BudgetRefused(Exception):
    """A measured change does not fit --quality-budget and nothing will be written (exit 3). `quality`:
    what was measured (the report's figures)."""

    def __init__(self, message: str, quality: dict | None = None):
        super().__init__(message)
        self.quality = quality or {}


def largest_passing(ok: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest x in [lo, hi] with ok(x), by bisection, for ok true up to some point and false
    after it; ok(lo) is taken as true without being asked (lo may be a sentinel)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
