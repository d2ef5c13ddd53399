"""The backend contract: what a backend is to `ortlean rewrite`, and what it gets.

A *weight backend* replaces one weight MatMul (or a group planned as one unit) by its op. The
registry (``rewriter.backends.WEIGHT_BACKENDS``) lists backend classes; per rewrite the pipeline
makes one instance per enabled backend, ``Backend(config)``, and calls, in this order:

    Backend.add_flags(parser)                  # its flags on `ortlean rewrite` (class level)
    Backend.config(args, state_pack) -> cfg    # cfg.enabled, cfg.targets (class level, once)
    b.group_candidates(todo, enabled) -> todo  # hook: plan several MatMuls as one unit (default: as is)
    b.needs_calibration() -> bool              # wants the Gram XᵀX of its layers' inputs (default: yes)
    b.calibration_hook(ctx) -> hook | None     # hook: sees every calibration activation (default: none)
    b.plan(cand, W, G, ctx) -> Plan            # decision for one layer ("dense" says why)
    b.finish_plans(planned, ctx) -> {name: Plan}  # hook: revise its plans with every layer planned (default: none)
    b.emit(graph, cand, plan, ctx)             # replace cand.node by its op
    b.notes(summary) -> list[str]              # hook: lines for the report's end (default: none)

Weight backends are tried in registry order per layer; the first whose plan is not "dense" takes
it (the weight backend is exclusive per MatMul). `emit` also runs on in-memory trial models
(clones of the loaded model) for the end-to-end quality check, so it must only touch the graph it
is given. A *graph pass* rewrites structure rather than one MatMul; ``stage`` says when it runs:
"pre" (after loading, before candidates are searched: e.g. fusions into ONNX Runtime's fast
ops) or "post" (after the weight backends emitted: e.g. PackedAttention).
"""
from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
import onnx_ir as ir

from . import options
from . import modelfile, stream
from .calib import CalibText, CalibrationHook
from .candidates import Candidate
from .options import RewriteConfig, StatePack
from .quality import Quality


@dataclass
class Plan:
    decision: str                   # the backend name, or "dense"
    reason: str                     # why (kept dense: gap too high / no speed gain / …; or what was built)
    gap: float | None               # relative output error on calibration inputs
    params_after: int               # parameters stored for this layer after the decision
    payload: Any = None             # what emit() needs (factors, deltas, thresholds …)
    speed: dict = field(default_factory=dict)
    attrs: dict = field(default_factory=dict)   # extra report fields (rank, method, fanout …)

    @classmethod
    def dense(cls, cand: Candidate, reason: str, gap: float | None = None, **kw) -> "Plan":
        return cls("dense", reason, gap, cand.params, **kw)

    def speedup_at(self, M: int) -> float:
        """The rewrite-time speedup measured at M rows (0 when not measured)."""
        return self.speed.get(f"M{M}", {}).get("speedup", 0.0)


@dataclass
class LayerPlan:
    """A backend planner's result for one layer, before it becomes a Plan: what it built (None
    when nothing met the bars), its decision ("dense" or the backend's name) and why."""
    built: Any
    decision: str
    reason: str
    gap: float | None
    params_after: int
    speed: dict = field(default_factory=dict)
    tried: list = field(default_factory=list)


class Context:
    """What the pipeline knows during one rewrite that backends may use."""

    def __init__(self, opts: RewriteConfig, model: ir.Model, io):
        self.opts = opts                    # the rewrite's options (budget, calibration tokens …)
        self.model = model                  # the loaded model: read-only until emission
        self.io = io                        # custom_ops.runtime.ModelIO of the model
        self.todo: list[Candidate] = []     # the units being planned (after grouping)
        self.weight_backends: list = []     # the enabled weight backends, in registry order
        self.modified = False               # a "pre" graph pass changed the model: run it from memory
        self.quality = Quality(self)        # the end-to-end probe and trial models (built on first use)
        self.weights_loss = 0.0             # what the weight backends' plans cost against the source (the guard's
                                            # measurement): the post passes spend what is left of --quality-budget
        self.reference: ir.Model | None = None  # the model before any plan is emitted (the pipeline's clone)
        self._calib: CalibText | None = None
        self._source = None

    @property
    def model_path(self) -> Path:
        return Path(self.opts.model)

    @property
    def threads(self) -> int:
        return self.opts.threads

    @property
    def speed_M(self) -> int:
        """The M whose timing decides: 1 (decode) for causal LMs, 128 for encoders."""
        return 1 if self.io.kind == "causal-lm" else 128

    @property
    def calib(self) -> CalibText:
        """--calib-text, tokenized once for every user."""
        if self._calib is None:
            self._calib = CalibText(self.model_path, self.opts.calib_text, self.opts.tokenizer)
        return self._calib

    def source(self):
        """The dense reference to run in ONNX Runtime (``kit.stream.session`` takes each form; so
        does ``kit.calib.collect_grams``): the model as it was after the "pre" graph passes, before
        any plan was emitted (``reference``, kept by the pipeline) — its file when no pass changed
        it, else serialized; a model whose weights exceed ``kit.stream.STREAM_BYTES`` as a
        segment-by-segment runner (``kit.stream.Streamed``: never its weights whole in memory)."""
        if self._source is None:
            ref = self.reference if self.reference is not None else self.model
            if stream.weight_bytes(ref) > stream.STREAM_BYTES:
                # every core (the calibration and reference runs: the same outputs at any thread count)
                self._source = stream.Streamed(ref, threads=stream.probe_threads(self.threads))
            elif not self.modified:
                self._source = str(self.model_path)
            else:
                self._source = modelfile.serialized(ref)
        return self._source


class BackendConfig(Protocol):
    enabled: bool
    targets: tuple[str, ...]

    def validate(self) -> None: ...


class WeightBackend(Protocol):
    name: ClassVar[str]             # "tt": the report's backend column
    op_type: ClassVar[str]          # "TTMatMul"

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None: ...
    @classmethod
    def config(cls, args: argparse.Namespace, state_pack: StatePack) -> BackendConfig: ...
    def __init__(self, cfg: BackendConfig) -> None: ...
    def group_candidates(self, todo: list[Candidate], enabled: list["WeightBackend"]) -> list[Candidate]: ...
    def needs_calibration(self) -> bool: ...
    def calibration_hook(self, ctx: Context) -> CalibrationHook | None: ...
    def plan(self, cand: Candidate, W: np.ndarray, G: np.ndarray | None, ctx: Context) -> Plan: ...
    def emit(self, graph: ir.Graph, cand: Candidate, plan: Plan, ctx: Context) -> None: ...


class GraphPass(Protocol):
    name: ClassVar[str]
    stage: ClassVar[str]            # "pre" | "post"

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None: ...
    @classmethod
    def config(cls, args: argparse.Namespace, state_pack: StatePack) -> BackendConfig: ...
    def __init__(self, cfg: BackendConfig) -> None: ...
    def run(self, model: ir.Model, ctx: Context) -> list[dict]: ...


class _Configured:
    """Flags and config from the `Config` dataclass's flag fields (kit.options.flag)."""
    Config: ClassVar[type]
    title: ClassVar[str]            # the flags' group on `ortlean rewrite --help`

    def __init__(self, cfg):
        self.cfg = cfg

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        options.add_flags(parser, cls.Config, cls.title)

    @classmethod
    def config(cls, args: argparse.Namespace, state_pack: StatePack):
        cfg = options.from_args(cls.Config, args)
        cfg.validate()
        return cfg

    def notes(self, summary: dict) -> list[str]:
        """Hook: lines for the end of the report, given the rewrite's summary (default: none)."""
        return []


class WeightBackendBase(_Configured, ABC):
    """Defaults for the optional hooks; subclasses set name, op_type, Config, title and write
    plan() and emit()."""

    def group_candidates(self, todo: list[Candidate], enabled: list[WeightBackend]) -> list[Candidate]:
        return todo

    def needs_calibration(self) -> bool:
        """A weight backend measures its gaps on the Gram of the calibration inputs; one that
        does not need them says so."""
        return True

    def calibration_hook(self, ctx: Context) -> CalibrationHook | None:
        return None

    def finish_plans(self, planned: list[tuple[Candidate, Plan]], ctx: Context) -> dict[str, Plan]:
        """Hook: once every layer is planned, replacement plans {layer name: Plan} for some of this
        backend's layers ``planned`` [(candidate, plan)] — a planner that decides for the whole model at
        once (the --weights mix) measures its trials here (default: none)."""
        return {}

    @abstractmethod
    def plan(self, cand: Candidate, W: np.ndarray, G: np.ndarray | None, ctx: Context) -> Plan: ...

    @abstractmethod
    def emit(self, graph: ir.Graph, cand: Candidate, plan: Plan, ctx: Context) -> None: ...


class GraphPassBase(_Configured, ABC):
    stage: ClassVar[str] = "post"

    @abstractmethod
    def run(self, model: ir.Model, ctx: Context) -> list[dict]: ...
