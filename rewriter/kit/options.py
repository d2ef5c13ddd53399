"""Command-line options, declared once.

A backend's (or the rewrite's) options are a dataclass whose fields are also flags: ``flag(...)``
gives the field its default, the flag's name, help and argparse type in one place;
``add_flags(parser, Config, title)`` puts them on a parser and ``from_args(Config, args)`` builds
the config from the parsed arguments (``parse`` converts a value after argparse, with errors that
name the flag). Flags that several backends read (seed 001's ``--state-pack*``) are one group,
``StatePack``, parsed once per rewrite.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import OrtleanError

TARGETS = ("mlp", "attn", "head")


# --------------------------------------------------------------------------- value types
def onoff(v: str) -> bool:
    """argparse type for the seeds' on|off flags."""
    v = v.lower()
    if v in ("on", "1", "true", "yes"):
        return True
    if v in ("off", "0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on|off, got {v!r}")


def budget(v: str) -> float | None:
    """argparse type for --quality-budget: a number, or off | none (no end-to-end check)."""
    if v.strip().lower() in ("off", "none"):
        return None
    try:
        return float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'off', got {v!r}") from None


def thread_counts(v: str) -> list[int]:
    """argparse type for --threads: a comma list of thread counts (≥ 1)."""
    try:
        out = [int(x) for x in v.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of thread counts, got {v!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"thread counts must be ≥ 1, got {v!r}")
    return out


def one_thread_count(counts: list[int], flag: str) -> int:
    """--threads of a command that runs one configuration (rewrite, eval, generate)."""
    if len(counts) != 1:
        raise OrtleanError(f"{flag} {','.join(map(str, counts))}: this command takes one thread count")
    return counts[0]


def parse_targets(spec: str, flag: str) -> tuple[str, ...]:
    """mlp | attn | both | head | all, or a comma list, for the flag `flag` (named in errors)."""
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


# --------------------------------------------------------------------------- flags as config fields
@dataclass(frozen=True)
class Flag:
    name: str                                   # "--tt-gap"
    help: str
    cli_default: Any                            # what argparse holds before `parse`
    type: Callable | None = None                # argparse type
    metavar: str | None = None
    choices: tuple | None = None
    action: str | None = None                   # "append" | "store_true"
    parse: Callable[[Any, str], Any] | None = None   # (argparse value, flag name) -> field value
    group: str | None = None                    # argument group (default: the config's title)

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


def flag(name: str, default, help: str, *, type=None, metavar=None, choices=None, action=None, parse=None,
         group=None):
    """A config field that is also a flag: `default` is the command line's default (converted by
    `parse` for the field when given)."""
    meta = {"flag": Flag(name, help, default, type, metavar, tuple(choices) if choices else None, action, parse, group)}
    value = parse(default, name) if parse else default
    if isinstance(value, list):
        return field(default_factory=lambda: list(value), metadata=meta)
    return field(default=value, metadata=meta)


def flags_of(cls) -> list[tuple[str, Flag]]:
    """(field name, Flag) of every flag field of the dataclass `cls`, in declaration order."""
    return [(f.name, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def add_flags(parser: argparse.ArgumentParser, cls, title: str | None = None,
              only: tuple[str, ...] | None = None) -> None:
    """The flag fields of `cls` (or those named in `only`) on `parser`, in argument groups
    (`title`, or a field's own group; no title: the parser's own options)."""
    groups: dict[str | None, Any] = {None: parser}
    for name, fl in flags_of(cls):
        if only is not None and name not in only:
            continue
        t = fl.group or title
        if t not in groups:
            groups[t] = parser.add_argument_group(t)
        kw: dict[str, Any] = {"default": fl.cli_default, "help": fl.help, "dest": fl.dest}
        if fl.action:
            kw["action"] = fl.action
        else:
            kw.update({k: v for k, v in (("type", fl.type), ("metavar", fl.metavar), ("choices", fl.choices))
                       if v is not None})
        if fl.action == "append":
            kw["metavar"] = fl.metavar
        groups[t].add_argument(fl.name, **kw)


def from_args(cls, args: argparse.Namespace, **fields):
    """`cls` from parsed arguments: every flag field from its flag, the others from `fields`."""
    vals = {}
    for name, fl in flags_of(cls):
        v = getattr(args, fl.dest)
        vals[name] = fl.parse(v, fl.name) if fl.parse else v
    return cls(**vals, **fields)


def targets_flag(name: str, default: str = "mlp", group: str | None = None):
    """A --*-target flag: mlp | attn | both | head | all, or a comma list; the field holds a tuple."""
    return flag(name, default, f"mlp | attn | both | head | all, or a comma list (default {default})",
                parse=parse_targets, group=group)


class Options:
    """Base of the config dataclasses: `validate()` raises OrtleanError naming the flag and the
    value at fault (no constraint by default)."""

    def validate(self) -> None:
        return None


# --------------------------------------------------------------------------- shared: state packing
@dataclass(frozen=True)
class StatePack:
    """Seed 001's state packing, parsed once per rewrite for the two backends that apply it:
    PackedAttention packs the KV cache (target kv | both), EventGatedMatMul's zero-skip packs
    MLP activations (target mlp | both)."""
    TITLE = "state packing (seed 001, shared)"

    mode: str = flag("--state-pack", "none", "bit-pack states: binary | ternary | none (default none)",
                     choices=("binary", "ternary", "none"))
    eps: float | None = flag("--state-pack-eps", None,
                             "|x| ≤ eps counts as zero (default: per backend, calibrated or 1e-4)", type=float)
    popcnt: str = flag("--state-pack-popcnt", "auto", "popcount path (default auto: VPOPCNTDQ when the CPU has it)",
                       choices=("auto", "vpopcntdq", "avx2", "scalar"))
    target: str = flag("--state-pack-target", "kv", "kv | mlp | both: what --state-pack applies to (default kv)")
    rho: float = flag("--state-pack-rho", 0.15, "zero-skip: density above which a row runs dense (seed 001 ρ, "
                      "default 0.15)", type=float)

    @classmethod
    def add_flags(cls, parser) -> None:
        add_flags(parser, cls, cls.TITLE)

    @classmethod
    def from_args(cls, args) -> "StatePack":
        sp = from_args(cls, args)
        if sp.target not in ("kv", "mlp", "both"):
            raise OrtleanError(f"--state-pack-target {sp.target!r}: use kv, mlp or both")
        if sp.eps is not None and sp.eps < 0:
            raise OrtleanError(f"--state-pack-eps {sp.eps}: must be ≥ 0")
        if not (0 < sp.rho <= 1):
            raise OrtleanError(f"--state-pack-rho {sp.rho}: in (0, 1]")
        return sp

    @property
    def kv(self) -> bool:
        """--state-pack applies to the KV cache (PackedAttention)."""
        return self.mode != "none" and self.target in ("kv", "both")

    @property
    def mlp(self) -> bool:
        """--state-pack applies to MLP activations (EventGatedMatMul zero-skip)."""
        return self.mode != "none" and self.target in ("mlp", "both")


# --------------------------------------------------------------------------- the rewrite's own options
@dataclass
class RewriteConfig(Options):
    """Options of one rewrite (`ortlean rewrite` flags that belong to no backend)."""

    model: str
    output: str
    backends: dict = field(default_factory=dict)      # backend name → its config
    include: list[str] = flag("--include", [], "only node names matching (repeatable)", action="append",
                              metavar="GLOB")
    exclude: list[str] = flag("--exclude", [], "skip node names matching (repeatable)", action="append",
                              metavar="GLOB")
    calib_text: str | None = flag("--calib-text", None,
                                  "calibration text file (tokenized with the model's tokenizer.json)")
    calib_tokens: int = flag("--calib-tokens", 4096, "calibration tokens (default 4096)", type=int)
    calib_window: int = flag("--calib-window", 256, "tokens per calibration run (default 256)", type=int)
    tokenizer: str | None = flag("--tokenizer", None, "tokenizer.json (default: next to the model)")
    report: str | None = flag("--report", None, "write the per-layer report as JSON here")
    threads: int = flag("--threads", [1], "threads for the rewrite-time speed check (default 1)",
                        type=thread_counts, parse=one_thread_count)
    quality_budget: float | None = flag(
        "--quality-budget", 0.02, "end-to-end loss allowed vs dense on held-out calibration text: Δppl for causal LMs, "
        "1 − mean embedding cosine for encoders (default 0.02; 'off' disables the check)", type=budget)
    quality_tokens: int = flag("--quality-tokens", 1024, "held-out tokens for the end-to-end check (default 1024)",
                               type=int)
    progress: bool = True

    def validate(self) -> None:
        if self.calib_tokens < 1 or self.calib_window < 2:
            raise OrtleanError(f"--calib-tokens {self.calib_tokens} / --calib-window {self.calib_window}: must be positive")
        if self.quality_budget is not None and not (self.quality_budget > 0):
            raise OrtleanError(f"--quality-budget {self.quality_budget}: must be > 0 (or 'off')")
