"""Progress of a long rewrite stage, on a terminal and in a log (issue 59 item 4: a slow stage must
not look hung).

:class:`Progress` is a tqdm bar when stderr is a terminal, and otherwise (stderr a file or a pipe,
where tqdm with ``disable=None`` prints nothing) a plain line ::

    [ortlean] plan: 37/127 layers, 84 s (/model/layers.5/mlp/up_proj/MatMul: gptq q4_f/64)

at most every :data:`EVERY` seconds (``ORTLEAN_PROGRESS_SECONDS`` overrides it) — printed by a
background ticker, so that one step that takes minutes (the head of a 262k-token vocabulary) still
gives a line every 15 s; on a terminal the same ticker refreshes the bar (its clock keeps moving).
Work below a stage reports what it is doing with :func:`status` ("gptq q4_f/64 on rows 0:4096"),
which goes to the innermost open Progress, so a builder needs no handle on the pipeline's bar.

Used by the plan loop, the ``--weights`` mix and the quality guard; any later tuner does
``with Progress("attention tuner", total=n, unit="trial", enabled=ctx.opts.progress) as p: ... p.update()``.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref

# seconds between two plain progress lines in a log (the bound: at least one every 15 s)
EVERY = 15.0

_stack: list = []          # weak references to the open Progress objects, innermost last
_lock = threading.Lock()


def every() -> float:
    try:
        return max(0.01, float(os.environ.get("ORTLEAN_PROGRESS_SECONDS", EVERY)))
    except ValueError:
        return EVERY


def status(text: str) -> None:
    """What the innermost open :class:`Progress` is doing now (its next line says it); no-op without one."""
    with _lock:
        _stack[:] = [r for r in _stack if r() is not None]
        p = _stack[-1]() if _stack else None
    if p is not None:
        p.status(text)


def _tick(ref, stop: threading.Event) -> None:
    """The ticker thread: the Progress's line (or bar refresh) when due, until it is closed or gone."""
    p = ref()
    if p is None:
        return
    step = min(1.0, p.interval) if p._bar is not None else p.interval / 4
    del p
    while not stop.wait(step):
        p = ref()
        if p is None:
            with _lock:
                if ref in _stack:
                    _stack.remove(ref)
            return
        p._tick()
        del p


def _fmt_seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 600 else f"{s / 60:.1f} min"


class Progress:
    """A stage's progress (module docstring). ``total`` may be None (a count of trials); ``enabled``
    False makes it silent (``--quiet``); ``stream`` defaults to stderr; ``tty`` overrides the
    terminal test (tests)."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "step", *, enabled: bool = True,
                 stream=None, tty: bool | None = None, interval: float | None = None):
        self.desc, self.total, self.unit = desc, total, unit
        self.enabled = bool(enabled)
        self.stream = stream if stream is not None else sys.stderr
        self.interval = every() if interval is None else float(interval)
        self.n = 0
        self.text = ""
        self.t0 = time.monotonic()
        self._printed = self.t0
        self._bar = None
        self._stop = threading.Event()
        self._ticker = None
        self._closed = False
        if not self.enabled:
            return
        try:
            is_tty = self.stream.isatty() if tty is None else bool(tty)
        except (AttributeError, ValueError):
            is_tty = False
        if is_tty:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=self.stream)
        self._ref = weakref.ref(self)
        with _lock:
            _stack[:] = [r for r in _stack if r() is not None] + [self._ref]
        # the ticker holds the Progress weakly: one left open by an exception stops once it is collected
        self._ticker = threading.Thread(target=_tick, args=(self._ref, self._stop), name=f"ortlean-progress-{desc}",
                                        daemon=True)
        self._ticker.start()

    # ------------------------------------------------------------------ reporting
    def update(self, n: int = 1, text: str | None = None) -> None:
        self.n += n
        if text is not None:
            self.text = text
        if self._bar is not None:
            if text is not None:
                self._bar.set_postfix_str(text[-60:], refresh=False)
            self._bar.update(n)
        elif self.enabled and time.monotonic() - self._printed >= self.interval:
            self._line()

    def status(self, text: str) -> None:
        self.text = text
        if self._bar is not None:
            self._bar.set_postfix_str(text[-60:], refresh=False)

    def line(self) -> str:
        """The plain line as it would be printed now."""
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        return (f"[ortlean] {self.desc}: {count} {self.unit}s, {_fmt_seconds(time.monotonic() - self.t0)}"
                + (f" ({self.text})" if self.text else ""))

    def _line(self) -> None:
        self._printed = time.monotonic()
        try:
            print(self.line(), file=self.stream, flush=True)
        except (ValueError, OSError):    # the stream was closed under us: say nothing
            pass

    def _tick(self) -> None:
        if self._bar is not None:
            try:
                self._bar.refresh()
            except Exception:
                pass
        elif time.monotonic() - self._printed >= self.interval:
            self._line()

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=2.0)
        with _lock:
            if getattr(self, "_ref", None) in _stack:
                _stack.remove(self._ref)
        if self._bar is not None:
            self._bar.close()

    def __del__(self):
        self._stop.set()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
