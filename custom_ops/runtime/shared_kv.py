"""A decode loop for GroupQueryAttention graphs (the fused form, onnxruntime-genai builder models)
with each layer's past and present K/V bound to ONE preallocated buffer through ONNX Runtime's
IOBinding: GQA's shared-buffer mode writes only the new tokens, so a step does not copy the whole
cache into a new ``present`` array (at a past of 4096 tokens that copy is about half of a SmolLM2
decode step). onnxruntime-genai's generator runs these graphs the same way
(``past_present_share_buffer``).

    from custom_ops import runtime
    from custom_ops.runtime.shared_kv import SharedKV
    io = runtime.ModelIO.from_session(sess)
    kv = SharedKV(sess, io, max_len=4096 + 64)
    logits = kv.prefill(prompt_ids)            # [B, T, V]
    logits = kv.step(next_ids)                 # [B, 1, V]; kv.length grows by one

The buffers are on 2 MiB pages where the kernel allows (``runtime.memory.huge_zeros_many``: one
mapping for all layers): a step reads every layer's cache, and PackedAttention gathers its
candidate rows at random, so with 4 KiB pages most rows cost a TLB miss (``tests/bench/attn_speed.py decode --hugepages`` measures both).

Decode-sized runs (up to BIND_MAX_TOKENS tokens) write their logits into arrays bound once per token
count, and every call returns a copy of them; their input_ids and position_ids are written into arrays
bound the same way: the step's own Python work is a few copies and the mask's binding (~55 us a
SmolLM2 step on the 480 MiB-L3 Xeon, run with caches the run's weight stream has just evicted).

The graph contract is ``runtime.io``'s (``input_ids``, ``attention_mask``, optional ``position_ids``,
``past_key_values.N.*`` → ``present.N.*`` in ``[batch, kv_heads, seq, head_dim]``); the buffers are
``[batch, kv_heads, max_len, head_dim]``. A graph that concatenates its cache (an unfused export)
cannot use the shared buffer: the first run fails and :class:`SharedKVError` says so.
"""
from __future__ import annotations

import numpy as np

from custom_ops import prompt_continues

from .io import GQA_LENGTH_INPUTS, gqa_lengths
from .memory import huge_zeros_many


__all__ = ["SharedKV", "SharedKVError", "PREFILL_CHUNK"]

# tokens per run of a long prompt's prefill (SharedKV.prefill's chunk where callers only need the last
# logits): 1,024 tokens of a 152k vocabulary are 0.6 GB of logits, against 2.5 GB at 4k and 10 GB at 16k
PREFILL_CHUNK = 1024
# runs of at most this many tokens get their other outputs (logits) bound to arrays kept per token count
BIND_MAX_TOKENS = 8


def _quiet_run_options():
    """RunOptions that log fatal errors only: an expected failure is reported by its exception alone."""
    import onnxruntime as ort

    ro = ort.RunOptions()
    ro.log_severity_level = 4
    return ro


class SharedKVError(RuntimeError):
    """The graph cannot run with one shared K/V buffer per layer (the message says why)."""


def _specs(io, max_len: int, batch: int) -> list:
    """(shape, dtype) of each state's buffer: the state's shape with ``batch`` rows and ``max_len``
    positions on its sequence axis."""
    try:
        return [(tuple(io.state_dims(past, batch, max_len)), np.dtype(io.state_types[past]))
                for past in io.past_to_present]
    except ValueError as e:
        raise SharedKVError(f"shared KV: {e}") from None


class SharedKV:
    """``arrays``: buffers to use instead of new ones (``SharedKV.alloc``'s, or batch-row slices of
    them), already holding ``length`` tokens: a cache computed by one SharedKV is decoded by another
    without a copy (runs write only the rows from ``length`` on)."""

    def __init__(self, sess, io, max_len: int, batch: int = 1, *, arrays: dict | None = None, length: int = 0):
        import onnxruntime as ort

        if not io.past_to_present:
            raise SharedKVError("shared KV: the model has no past_key_values inputs")
        self.sess, self.io, self.max_len, self.batch = sess, io, int(max_len), int(batch)
        self.binding = sess.io_binding()
        self.buffers: dict[str, ort.OrtValue] = {}
        self.arrays: dict[str, np.ndarray] = {}  # the buffers' memory (an OrtValue from numpy does not own it)
        specs = _specs(io, self.max_len, self.batch)
        if arrays is None:
            # every layer's buffers from one mapping on 2 MiB pages (each is often under 2 MiB)
            arrays = dict(zip(io.past_to_present, huge_zeros_many(specs)))
        else:
            for past, (shape, dt) in zip(io.past_to_present, specs):
                a = arrays.get(past)
                if a is None or a.shape != shape or a.dtype != dt or not a.flags.c_contiguous:
                    got = "missing" if a is None else f"{a.shape} {a.dtype}{'' if a.flags.c_contiguous else ' strided'}"
                    raise SharedKVError(f"shared KV: buffer for {past} is {got}, {shape} {dt} C-contiguous needed")
        if not 0 <= int(length) <= self.max_len:
            raise SharedKVError(f"shared KV: length {length} outside 0..{self.max_len}")
        for past, present in io.past_to_present.items():
            arr = arrays[past]
            buf = ort.OrtValue.ortvalue_from_numpy(arr)
            self.arrays[past], self.buffers[past] = arr, buf
            self.binding.bind_ortvalue_input(past, buf)
            self.binding.bind_ortvalue_output(present, buf)
        self._others = [o for o in io.outputs if o not in io.present_to_past]
        # the feeds' fixed facts, looked up once (a decode step's Python work is part of its time)
        names = set(io.inputs)
        self._ids_type = io.input_types.get("input_ids", np.int64)
        self._mask_type = io.input_types["attention_mask"] if io.has_attention_mask else None
        self._pos_type = io.input_types["position_ids"] if io.has_position_ids else None
        self._gqa = [(n, io.input_types[n]) for n in GQA_LENGTH_INPUTS if n in names]
        self._ones = np.ones((self.batch, self.max_len), self._mask_type) if self._mask_type is not None else None
        # the other outputs (logits) of runs of t <= BIND_MAX_TOKENS tokens bound to arrays of ours, their
        # shapes learned from a run that let ORT allocate them: get_outputs() would wrap every layer's present
        # as well (SmolLM2's 60: 45-90 us a decode step; the step's Python work fell from ~180 to ~80 us).
        # None for a t whose shapes did not hold (ORT allocates each run).
        self._out_bufs: dict[int, dict[str, np.ndarray] | None] = {}
        self._bound_t: int | None = None
        # input_ids and position_ids of such runs: arrays bound once per t, written in place each run
        # (ORT reads a bound numpy array's memory at every run); the step's Python runs with cold caches
        # after a run that streamed the weights, so each binding saved counts
        self._in_bufs: dict[int, dict[str, np.ndarray]] = {}
        self._bound_in_t: int | None = None
        self.length = int(length)
        self._ran = False      # the first run is the probe

    @staticmethod
    def alloc(io, max_len: int, batch: int = 1) -> dict[str, np.ndarray]:
        """Zeroed buffers (one mapping on 2 MiB pages) for ``SharedKV(..., arrays=)``."""
        return dict(zip(io.past_to_present, huge_zeros_many(_specs(io, max_len, batch))))

    def _feeds(self, ids: np.ndarray, total: int) -> dict[str, np.ndarray]:
        """The inputs to bind for a run of ``ids`` ending at ``total`` tokens. Decode-sized runs write
        input_ids and position_ids into arrays bound once per token count (not returned: they stay bound)."""
        b, t = ids.shape
        feeds = {}
        if t <= BIND_MAX_TOKENS:
            bufs = self._in_bufs.get(t)
            if bufs is None:
                bufs = self._in_bufs[t] = {"input_ids": np.empty((b, t), self._ids_type)}
                if self._pos_type is not None:
                    bufs["position_ids"] = np.empty((b, t), self._pos_type)
            bufs["input_ids"][...] = ids
            if self._pos_type is not None:
                bufs["position_ids"][...] = np.arange(self.length, total, dtype=self._pos_type)
            if self._bound_in_t != t:
                feeds.update(bufs)
                self._bound_in_t = t
        else:
            feeds["input_ids"] = ids.astype(self._ids_type, copy=False)
            if self._pos_type is not None:
                feeds["position_ids"] = np.broadcast_to(np.arange(self.length, total, dtype=self._pos_type), (b, t)).copy()
            self._bound_in_t = None
        if self._ones is not None:
            feeds["attention_mask"] = self._ones[:, :total] if b == 1 else np.ascontiguousarray(self._ones[:, :total])
        for name, dt in self._gqa:
            feeds[name] = gqa_lengths(name, b, total, dt)
        return feeds

    def _bind_outputs(self, t: int) -> None:
        """The other outputs for runs of t tokens: our arrays when their shapes are known, else ORT's."""
        bufs = self._out_bufs.get(t)
        if bufs and self._bound_t == t:
            return
        for o in self._others:
            if bufs:
                a = bufs[o]
                self.binding.bind_output(o, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
            else:
                self.binding.bind_output(o)  # ORT allocates (the shape is learned after the run)
        self._bound_t = t if bufs else None

    def _run(self, ids: np.ndarray, more: bool = False) -> dict[str, np.ndarray]:
        """``more``: a later run continues this prompt (``custom_ops.prompt_continues``)."""
        ids = np.asarray(ids)
        if ids.ndim == 1:
            ids = ids[None, :]
        b, t = ids.shape
        if b != self.batch:
            raise SharedKVError(f"shared KV: batch {b}, buffers were made for {self.batch}")
        if self.length + t > self.max_len:
            raise SharedKVError(f"shared KV: {self.length} + {t} tokens exceed max_len {self.max_len}")
        total = self.length + t
        for k, v in self._feeds(ids, total).items():
            self.binding.bind_cpu_input(k, v)
        self._bind_outputs(t)
        try:
            # the first run probes whether the graph can write its present K/V in place; a graph that
            # cannot (a Concat cache) fails it as expected, so ORT must not print that failure
            with prompt_continues(more):
                self.sess.run_with_iobinding(self.binding, None if self._ran else _quiet_run_options())
        except Exception as e:
            if not self._ran:
                raise SharedKVError("shared KV: the graph cannot write its present K/V into the past buffer "
                                    f"(not a GroupQueryAttention graph?): {e}") from None
            if self._bound_t != t:
                raise
            # an output's shape changed for the same t: ORT allocates for this t from now on (the
            # rerun writes the same cache rows again)
            self._out_bufs[t], self._bound_t = None, None
            self._bind_outputs(t)
            with prompt_continues(more):
                self.sess.run_with_iobinding(self.binding)
        self.length, self._ran = total, True
        if self._bound_t == t:
            return {o: a.copy() for o, a in self._out_bufs[t].items()}
        outs = self.binding.get_outputs()  # the presents first (binding order), then the others
        n = len(self.io.past_to_present)
        got = {o: outs[n + i].numpy() for i, o in enumerate(self._others)}
        if t <= BIND_MAX_TOKENS and t not in self._out_bufs:   # decode-sized runs (a prompt's logits can be GBs)
            self._out_bufs[t] = {o: np.empty_like(a) for o, a in got.items()}
        return got

    def prefill(self, ids, chunk: int | None = None, more: bool = False) -> np.ndarray:
        """Run the prompt from an empty cache (resets the length); returns the logits. ``chunk``: at most
        that many tokens per run (each later chunk attends to the cached ones), and only the last
        chunk's logits are returned — a long prompt's full logits are T x vocab floats (16k tokens of
        a 152k vocabulary: 10 GB), its attention scratch grows with T as well. Every run but the last
        says the prompt continues (``more``: the last one too)."""
        self.length = 0
        ids = np.asarray(ids)
        if ids.ndim == 1:
            ids = ids[None, :]
        if not chunk or ids.shape[1] <= chunk:
            return self._run(ids, more)[self.io.logits_name]
        n = ids.shape[1]
        for c0 in range(0, n, int(chunk)):
            out = self._run(ids[:, c0:c0 + int(chunk)], more or c0 + int(chunk) < n)
        return out[self.io.logits_name]

    def step(self, ids, more: bool = False) -> np.ndarray:
        """Append tokens (usually one per row) after the cached ones; returns their logits. ``more``: a
        later run continues this prompt."""
        return self._run(ids, more)[self.io.logits_name]

    def rows(self, n: int) -> dict[str, np.ndarray]:
        """Views of every buffer's first ``n`` positions (no copy): the rows a prompt of ``n`` tokens
        wrote, to save them; or where a saved cache is read in, after which ``length`` is set to ``n``."""
        if not 0 <= int(n) <= self.max_len:
            raise SharedKVError(f"shared KV: {n} rows outside 0..{self.max_len}")
        return {name: arr[self.io.seq_index(name, arr.ndim, 0, int(n))] for name, arr in self.arrays.items()}

    def fill(self, length: int, past: dict[str, np.ndarray]) -> None:
        """Load a cache computed elsewhere (``past_key_values.*`` arrays of ``length`` tokens)."""
        for name, arr in self.arrays.items():
            arr[self.io.seq_index(name, arr.ndim, 0, length)] = past[name]
        self.length = int(length)
