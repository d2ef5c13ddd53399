"""Calibration: the calibration text (read and tokenized once per rewrite, shared by every user:
Gram collection, the quality probe, PackedAttention's key statistics) and the Gram matrices XᵀX
of the candidate MatMuls' inputs, accumulated (float64) while the ORIGINAL model runs in ONNX
Runtime over the text — enough to measure any factorisation's output error on the calibration set
exactly, in O(K²) memory whatever the amount of text (the activations themselves are never kept)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

from custom_ops import runtime

from ..errors import OrtleanError

# `hook(value name, activations [rows, K])`: a backend that needs more than Grams (e.g. activation
# quantiles) sees every calibration activation of every captured value
CalibrationHook = Callable[[str, np.ndarray], None]


class CalibText:
    """--calib-text with the model's tokenizer: read, checked and tokenized once."""

    def __init__(self, model_path: str | os.PathLike, text_path: str | os.PathLike, tokenizer: str | None = None):
        tp = Path(text_path)
        if not tp.is_file():
            raise OrtleanError(f"--calib-text {tp}: no such file")
        text = tp.read_text(encoding="utf-8", errors="replace")
        if len(text.strip()) == 0:
            raise OrtleanError(f"--calib-text {tp}: file is empty")
        try:
            self.tok = runtime.load_tokenizer(model_path, tokenizer)
        except Exception as e:
            raise OrtleanError(str(e)) from None
        self.path = tp
        self.text = text

    @cached_property
    def ids(self) -> list[int]:
        """Token ids of the whole text, no special tokens (running text for causal LMs)."""
        return self.tok.encode(self.text, add_special_tokens=False).ids


@dataclass
class Gram:
    G: np.ndarray          # [K, K] float64, Σ xᵀx over calibration rows
    rows: int
    absmax: float

    @property
    def K(self) -> int:
        return self.G.shape[0]


def _with_extra_outputs(source: str | bytes, names: list[str]) -> bytes:
    """The model's proto (external data not loaded) exposing `names` as extra outputs."""
    proto = onnx.load_from_string(source) if isinstance(source, bytes) else onnx.load(source, load_external_data=False)
    existing = {o.name for o in proto.graph.output}
    for n in names:
        if n not in existing:
            proto.graph.output.append(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None))
    return proto.SerializeToString()


def collect_grams(source, io, value_names: list[str], calib: CalibText, max_tokens: int, window: int,
                  threads: int | None = None, progress: bool = True,
                  hook: CalibrationHook | None = None) -> dict[str, Gram]:
    """Gram XᵀX of every value in `value_names` over the calibration windows of the model
    `source` (a path: external data stays where it is; serialized bytes; or a
    ``kit.stream.Streamed`` runner of a large model: every window through one segment at a time,
    the activations folded into the Grams as each segment computes them)."""
    from .progress import Progress
    from .stream import Streamed

    windows = calibration_windows(io, calib, max_tokens, window)
    if not windows:
        raise OrtleanError(f"--calib-text {calib.path}: produced no tokens")
    names = list(dict.fromkeys(value_names))
    grams: dict[str, Gram] = {}

    def add(n: str, x) -> None:
        x = np.asarray(x, dtype=np.float32)
        x = x.reshape(-1, x.shape[-1])
        if hook is not None:
            hook(n, x)
        g = x.T @ x  # float32 per window (≤ a few hundred rows), accumulated in float64
        if n in grams:
            grams[n].G += g
            grams[n].rows += x.shape[0]
            grams[n].absmax = max(grams[n].absmax, float(np.abs(x).max(initial=0.0)))
        else:
            grams[n] = Gram(G=g.astype(np.float64), rows=x.shape[0], absmax=float(np.abs(x).max(initial=0.0)))

    feeds = [runtime.feeds(io, np.asarray(ids, dtype=np.int64)[None, :]) for ids in windows]
    if isinstance(source, Streamed):
        # folded in window order per value, as the loop below does (the same sums)
        ready: dict[str, dict[int, np.ndarray]] = {n: {} for n in names}
        nxt = dict.fromkeys(names, 0)

        def consume(w, n, x):
            ready[n][w] = x
            while nxt[n] in ready[n]:
                add(n, ready[n].pop(nxt[n]))
                nxt[n] += 1
        source.run_many(names, feeds, consume, progress="calibrate" if progress else None)
        return grams
    sess = _calibration_session(source, names, threads)
    bar = Progress("calibrate", total=sum(len(w) for w in windows), unit="tok", enabled=progress)
    for ids, f in zip(windows, feeds):
        for n, x in zip(names, sess.run(names, f)):
            add(n, x)
        bar.update(len(ids))
    bar.close()
    return grams


def _calibration_session(source: str | bytes, names: list[str], threads: int | None):
    import onnxruntime as ort

    import custom_ops

    cm = _with_extra_outputs(source, names)
    so = ort.SessionOptions()
    if not isinstance(source, bytes):  # external data (if any) stays where it is: ORT reads it from the model's directory
        so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                    str(Path(source).resolve().parent))
    if threads:
        so.intra_op_num_threads = threads
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep tensors as named
    # a model already holding ortlean ops needs them registered (native, or the references)
    return custom_ops.session(cm, so=so, backend="auto")


def calibration_windows(io, calib: CalibText, max_tokens: int, window: int) -> list[list[int]]:
    """Token windows: causal LMs get consecutive windows of the running text (each a fresh
    prefill, the tokenizer's prefix first — as a prompt starts: Gemma's hidden states without its
    <bos> are not the ones it runs on), encoders get sentences encoded with their special tokens."""
    if io.kind == "causal-lm":
        ids = calib.ids[:max_tokens]
        pre = [int(x) for x in runtime.text_prefix(calib.tok)]
        return [pre + ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) >= 2]
    # encoders embed sentences/passages: calibrate on sentences of the text, encoded with their
    # special tokens, as they will be used (long chunks give [CLS]/[SEP] too little weight and
    # the gap measured on them under-estimates the error on real inputs ~2x on MiniLM)
    out, used = [], 0
    for sent in runtime.sentences_from_text(calib.text, max(1, max_tokens // 8)):
        ids = calib.tok.encode(sent).ids[:window]
        out.append(ids)
        used += len(ids)
        if used >= max_tokens:
            break
    return out
