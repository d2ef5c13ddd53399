"""``--weights int4`` on a float checkpoint (issue 34 item 3): the weights backend's calibrated 4-bit path.

Each weight layer is quantized into ``BlockQuantMatMul`` blocks (``rewriter.builders.quantizers``) by
``--weights-quantizer`` (default ``auto``: GPTQ on the calibration Gram when there is one, else the
weighted k-quant search), in every format of its ladder (``rewriter.builders.weightplan.ladder``); the
format each layer is stored in is then planned for the whole model (``weightplan.plan_mix``) on the
rewrite's quality probe, so that the model meets ``--quality-budget`` at the fewest bits — or, with
``--quality-budget off``, every layer takes its 4-bit default (the lowest-gap option at ≤ 4.5
bits/weight). ``--weights-bits`` caps the mix's bits/weight. ``--weights-quantizer nbits`` keeps ONNX
Runtime's MatMulNBits (symmetric round-to-nearest, block 32: the int4 of earlier releases).

MatMulNBits is not used for the formats it could hold exactly (q4_0 = its symmetric int4 at block 32,
q8_0 = its int8): BlockQuantMatMul ran them faster on this machine class (M = 1, one thread, 8 layers
cycled: q4_0 1.2-1.3x MatMulNBits int4, q8_0 1.15-1.4x MatMulNBits int8 at SmolLM2's 576x1536 and
1536x576; development timings on a shared machine — ``tests/bench/bench_float_weights.py`` measures the
whole model). The tied token embedding reads the head's blocks through ``BlockQuantGather``.

This module is the weights backend's builder (``rewriter/backends/weights.py`` calls it)."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx_ir as ir

from custom_ops.reference import blockquant as bq

from . import blockgraph as BG
from . import quantizers as Q
from . import weightplan as WP
from ..errors import OrtleanError
from ..kit import gaps, progress, surgery
from ..kit.backend import Plan
from ..kit.candidates import Candidate
from .. import quantize

QUANTIZERS = ("auto", "gptq", "kquant", "hqq", "rtn", "nbits")
# GPTQ sweeps the options up to this many bits/weight (every format but q8_0, whose absmax grid per 32 is fine
# enough: GPTQ buys nothing measurable there); on SmolLM2's head GPTQ gives q4_f/32 a lower gap (0.022) than
# the imatrix search gives q5_1 (0.019 → pruned against GPTQ's q4_f/32 at 6 bits: the 6-bit options need it too)
GPTQ_MAX_BITS = 7.0
# threads quantizing one layer's formats at once (a large layer: one format at a time, its rows on them)
_WORKERS = max(1, min(4, os.cpu_count() or 1))
# a layer with more weights than this (a large vocabulary's head: Gemma 3's 640 x 262,144) is quantized one
# format at a time, GPTQ's rows in chunks of _CHUNK_ROWS on the threads: formats side by side would each hold
# a float32 copy of it (and the dequantized options for the gaps, another each)
_LARGE = 1 << 24
_CHUNK_ROWS = 4096
# worker processes quantizing the layers ahead of the pipeline (FloatWeights.prefetch): one per core
_PROCESSES = int(os.environ.get("ORTLEAN_PLAN_PROCESSES", os.cpu_count() or 1))
# which formats a quantizer writes (kquant and gptq: all of the ladder; hqq / rtn: q4_f; q8_0 is absmax for all)
_WRITES = {"hqq": ("q4_f",), "rtn": ("q4_f",)}


class FloatWeights:
    """The per-rewrite state of the float path: every planned layer's options, the GPTQ factors per
    input, the mix."""

    def __init__(self, quantizer: str, max_bits: float | None, embed: str):
        if quantizer not in QUANTIZERS:
            raise OrtleanError(f"--weights-quantizer {quantizer!r}: one of {', '.join(QUANTIZERS)}")
        if max_bits is not None and not (4.0 < max_bits <= 8.5):
            raise OrtleanError(f"--weights-bits {max_bits:g}: between 4.125 (the cheapest 4-bit block) and 8.5 (q8_0)")
        self.quantizer = quantizer
        self.max_bits = max_bits
        self.embed = embed
        self.layers: dict[str, WP.Layer] = {}
        self.cands: dict[str, Candidate] = {}
        self.tied: dict[str, str | None] = {}          # head layer -> its tied embedding Gather's name
        self._factor: dict[str, np.ndarray] = {}      # input value name -> GPTQ's inverse-Hessian factor
        self._pending: dict = {}                      # layer key -> a worker's future (prefetch)
        self._procs = None
        self._prefetched = False
        self._queue: list = []                        # (candidate, Gram) of the layers not yet submitted
        self._memo = None                             # (input name, factor) of the layers being submitted
        self.mix: WP.MixResult | None = None
        self.planned: list[str] = []                  # the layers planned with the defaults (finish sets these)

    # ---------------------------------------------------------------- per layer
    def which(self, G) -> str:
        """The quantizer a layer uses: ``auto`` = gptq with a Gram, kquant without."""
        if self.quantizer == "auto":
            return "gptq" if G is not None else "kquant"
        if self.quantizer == "gptq" and G is None:
            raise OrtleanError("--weights-quantizer gptq needs calibration inputs: give --calib-text FILE")
        return self.quantizer

    def options(self, cand: Candidate, W: np.ndarray, G) -> WP.Layer:
        """The layer's ladder, each option quantized (the formats on a small thread pool: numpy works
        outside the GIL; a layer the prefetch sent to a worker process: its result) and its gap measured
        (cached per layer)."""
        key = f"{cand.name}|{G is not None}"
        if key in self.layers:
            return self.layers[key]
        fut = self._pending.pop(key, None)
        self._queue = [(c, g) for c, g in self._queue if c.name != cand.name]
        if fut is not None:
            progress.status(f"{cand.name}: waiting for its worker")
            layer = fut.result()
            self._top_up()
        else:
            qz = self.which(G)
            layer = _ladder(cand.name, cand.role or cand.target, cand.params, cand.K, qz, W, G,
                            self._factor_of(cand, G) if qz == "gptq" else None)
        self.layers[key] = layer
        self.cands[cand.name] = cand
        if not self._pending and not self._queue and self._procs is not None:
            self._procs.shutdown()
            self._procs = None
        return layer

    def _factor_of(self, cand: Candidate, G) -> np.ndarray:
        """GPTQ's inverse-Hessian factor of the layer's input (one per input, every format and layer)."""
        f = self._factor.get(cand.input.name)
        need = -(-cand.K // 256) * 256
        if f is None or f.shape[0] < need:
            f = self._factor[cand.input.name] = Q.hessian_factor(G, pad_to=need)
        return f

    def prefetch(self, todo: list, grams: dict, first: Candidate) -> None:
        """Quantize the ladders of the layers still to plan (``todo``: the pipeline's candidates, Grams by input)
        in worker processes, a few layers ahead of the pipeline (each layer's options are computed exactly as
        in this process, its factor computed here; a layer is waited for when the pipeline reaches it). Not
        the large layers (computed here, on threads) nor groups. Nothing without a second core
        (ORTLEAN_PLAN_PROCESSES=1 turns it off)."""
        if self._prefetched or _PROCESSES < 2 or not grams:
            return
        self._prefetched = True
        queue = []
        for c in todo:
            if c is first or isinstance(getattr(c, "members", None), list) or c.K * c.N > _LARGE:
                continue
            g = grams.get(c.input.name)
            if g is None or g.G is None or f"{c.name}|True" in self.layers:
                continue
            queue.append((c, g.G))
        if len(queue) < 2:
            return
        self._queue = queue
        self._procs = _process_pool(_PROCESSES)
        self._top_up()

    def _top_up(self) -> None:
        """Keep 2 layers per worker submitted (their weights, Gram and factor held only until then)."""
        memo = self._memo
        while self._queue and len(self._pending) < 2 * _PROCESSES:
            c, G = self._queue.pop(0)
            qz = self.which(G)
            f = None
            if qz == "gptq":     # one factor per input (the layers reading it are consecutive), not all of them
                need = -(-c.K // 256) * 256
                if memo is None or memo[0] != c.input.name or memo[1].shape[0] < need:
                    memo = (c.input.name, Q.hessian_factor(G, pad_to=need))
                f = memo[1]
            self._pending[f"{c.name}|True"] = self._procs.submit(
                _ladder_job, (c.name, c.role or c.target, c.params, c.K, qz, c.weight_array(), G, f))
        self._memo = memo if self._queue else None

    def plan(self, backend, cand: Candidate, W: np.ndarray, G, ctx) -> Plan:
        """The layer's default (4-bit) plan; the mix (``finish``) may replace it."""
        if ctx is not None and getattr(ctx, "grams", None) and [b.name for b in ctx.weight_backends] == [backend.name]:
            # the only weight backend: every candidate of its targets is ours, quantize them ahead
            self.prefetch([c for c in ctx.todo if c.target in backend.cfg.targets], ctx.grams, cand)
        layer = self.options(cand, W, G)
        if cand.target == "head" and cand.name not in self.tied:
            g = quantize.tied_embedding(ctx.model.graph, W) if (self.embed == "shared" and ctx is not None
                                                                and ctx.model is not None) else None
            self.tied[cand.name] = g.name if g is not None else None
        return self.plan_for(backend, cand, layer, layer.default, G is not None, "4-bit default")

    def plan_for(self, backend, cand: Candidate, layer: WP.Layer, i: int, calibrated: bool, why: str) -> Plan:
        o = layer.options[i]
        b = o.blocks
        fmt = o.name
        how = (f"BlockQuantMatMul {fmt} ({b.source}), {o.bits:.3f} bits/weight ({why}; ladder "
               + ", ".join(f"{p.name} {p.bits:.2f}b gap {p.gap:.4f}" for p in layer.options) + ")"
               + ("" if calibrated else "; gap = weight error (no calibration)"))
        act_bits = backend.cfg.act_bits_for(exact=False)
        layout, refused = backend.cfg.layout_for(b.fmt, b.block if b.fmt == "q4_f" else None, act_bits)
        mins = ", then mins" if b.fmt in bq.WITH_MIN else ""
        how += (f"; layout split (each row's bytes reordered: integers, then scales{mins}; they give the blocks "
                "back byte for byte)" if layout == "split" else "; layout blocks"
                + (f" ({refused.removeprefix('layout ')})" if refused else ""))
        tied = self.tied.get(cand.name)
        if tied:
            how += f"; the tied token embedding ({tied}) reads these blocks through BlockQuantGather"
        attrs = {"format": fmt, "bits_per_weight": round(o.bits, 4), "bytes": b.nbytes, "source": b.source,
                 "layout": layout, "act_bits": act_bits}
        if refused:
            attrs["layout_refused"] = refused
        return Plan(f"int4 (BlockQuantMatMul)", how, o.gap, cand.params, payload=("float", b, tied), attrs=attrs)

    # ---------------------------------------------------------------- the whole model
    def finish(self, backend, planned: list[tuple[Candidate, Plan]], ctx) -> dict[str, Plan]:
        """The mix under --quality-budget (``weightplan.plan_mix`` on ``ctx.quality``) for the layers this
        path planned: {layer name: its plan}. No budget (or no calibration text): the defaults stay."""
        mine = [(c, p) for c, p in planned if isinstance(p.payload, tuple) and isinstance(p.payload[0], str) and p.payload[0] == "float"]
        self.planned = [c.name for c, _ in mine]
        budget = ctx.opts.quality_budget if ctx is not None else None
        if not mine or budget is None or not ctx.opts.calib_text:
            self._release({n: self._layer_of(self.cands[n]).default for n in self.planned})
            return {}
        layers = [self._layer_of(c) for c, _ in mine]
        cands = {c.name: c for c, _ in mine}
        cal = {c.name: "|True" in k for c, _ in mine for k in self.layers if k.startswith(c.name + "|")}
        others = []     # the other backends' plans are not in these trials (the guard measures them together)

        def plans(choice):
            return [(cands[l.name], backend, self.plan_for(backend, cands[l.name], l, choice[l.name], cal[l.name], "mix"))
                    for l in layers] + others

        def loss(choice):
            return ctx.quality.loss(plans(choice))

        # a line per 15 s in a log (a trial of a large-vocabulary model takes tens of seconds), tqdm on a terminal
        with progress.Progress("weights mix", unit="trial", enabled=ctx.opts.progress) as bar:
            def step(t):
                bar.update(1, f"last: {t['what']}: {t['bits']:.3f} b/w {t['loss']:+.4f}")

            self.mix = WP.plan_mix(layers, loss, budget, max_bits=self.max_bits, progress=step)
        m = self.mix
        why = (f"mix: {'meets' if m.feasible else 'misses'} {m.target:+.4f} on the probe "
               f"({WP.MARGIN:g} × --quality-budget) at {m.bits:.3f} bits/weight")
        self._release(m.choice)
        return {l.name: self.plan_for(backend, cands[l.name], l, m.choice[l.name], cal[l.name], why) for l in layers}

    def _release(self, choice: dict[str, int]) -> None:
        """Drop the bytes of every option not chosen (the report keeps their bits and gaps): ~3x the chosen
        model's bytes, not needed once the mix is decided (the guard, emission and saving run without them)."""
        for name, i in choice.items():
            for k, o in enumerate(self._layer_of(self.cands[name]).options):
                if k != i:
                    o.blocks = None

    def _layer_of(self, c: Candidate) -> WP.Layer:
        return self.layers.get(f"{c.name}|True") or self.layers[f"{c.name}|False"]

    def notes(self) -> list[str]:
        """The summary's line: the formats and the model's bits/weight over the layers this path wrote."""
        if self.mix is not None:
            m = self.mix
            layers = [self._layer_of(self.cands[n]) for n in m.choice]
            line = (f"weights (float checkpoint, {self.quantizer} quantizer): {WP.describe(layers, m.choice)} (model); "
                    f"probe Δ {m.loss:+.4f} vs target {m.target:+.4f} after {len(m.trials)} trials")
            trials = "; ".join(f"{t['what']}: {t['bits']:.3f} b/w {t['loss']:+.4f}" for t in m.trials)
            sens = ", ".join(f"{r} {v:.3g}" for r, v in sorted(m.sensitivity.items(), key=lambda kv: -kv[1]))
            return [line + (f"; {m.note}" if m.note else ""),
                    f"weights mix trials (probe loss at bits/weight): {trials}"
                    + (f"; sensitivity per role (loss per gap²): {sens}" if sens else "")]
        if not self.planned:
            return []
        layers = [self._layer_of(self.cands[n]) for n in self.planned]
        return [f"weights (float checkpoint, {self.quantizer} quantizer): "
                f"{WP.describe(layers, {l.name: l.default for l in layers})} (model), the 4-bit defaults"]


def _ladder(name: str, role: str, params: int, K: int, qz: str, W: np.ndarray, G, f) -> WP.Layer:
    """One layer's ladder (``WP.ladder``), each format quantized by ``qz`` (GPTQ with the factor ``f``)
    and its gap measured: the formats side by side on threads, or, for a layer over _LARGE, one format at
    a time with GPTQ's rows in chunks on the threads (the same bytes either way)."""
    large = W.size > _LARGE
    # a large layer: each format makes its own [N, K] copy (GPTQ sweeps one anyway), none is kept beside them
    Wt = W.T if large else np.ascontiguousarray(W.T)
    imp = Q.importance(G)
    todo = [(fmt, B) for fmt, B in WP.ladder(K) if not (qz in _WRITES and fmt not in _WRITES[qz] and fmt != "q8_0")]
    with ThreadPoolExecutor(max_workers=_WORKERS) as pool:
        def one(fmt, B):
            if large:
                progress.status(f"{name}: {qz if fmt != 'q8_0' else 'kquant'} {fmt}"
                                + (f"/{B}" if fmt == "q4_f" else "") + f" ({todo.index((fmt, B)) + 1}/{len(todo)})")
            if fmt == "q8_0":    # at 8 bits the grid is fine enough: absmax per 32 (GPTQ buys nothing measurable)
                return Q.kquant(Wt, fmt)
            if qz == "gptq" and Q.layer_bits(fmt, K, B) <= GPTQ_MAX_BITS:
                if large:        # the rows in chunks on the threads (the same result: quantizers.gptq)
                    return Q.gptq(Wt, G, fmt, B, factor=f, chunk_rows=_CHUNK_ROWS, pool=pool)
                return Q.gptq(Wt, G, fmt, B, factor=f)
            if qz == "rtn":
                return Q.rtn(Wt, fmt, B)
            if qz == "hqq":
                return Q.hqq(Wt, B)
            return Q.kquant(Wt, fmt, B, imp)

        blocks = [one(*fb) for fb in todo] if large else list(pool.map(lambda fb: one(*fb), todo))
    if large:
        progress.status(f"{name}: gaps of {len(blocks)} options")
    # the options' weights a block of columns at a time (never each dequantized whole: 640 MB per option
    # of a 262k-token head); the same values, so the same gaps
    gs = gaps.layer_gaps(W, [_Dequantized(b) for b in blocks], G)
    opts = [WP.Option(b.fmt, b.block, b.bits_per_weight, g, b) for b, g in zip(blocks, gs)]
    layer = WP.Layer(name, role, params, WP.prune(opts))
    layer.default = WP.default_index(layer)
    return layer


def _ladder_job(args) -> WP.Layer:
    """:func:`_ladder` in a worker process (its formats one after the other: the other workers have the cores)."""
    global _WORKERS
    _WORKERS = 1
    return _ladder(*args)


def _process_pool(n: int):
    """``n`` worker processes for :meth:`FloatWeights.prefetch`: started fresh (spawn: nothing of this
    process's memory or threads is inherited), numpy's BLAS at one thread each (the workers are the
    parallelism; its products give the same bits at any thread count — tests/test_float_weights.py —,
    its Cholesky does not, which is why the factors are computed here)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(max_workers=n, mp_context=mp.get_context("spawn"), initializer=_worker_init)


def _worker_init() -> None:
    try:                                   # one BLAS thread per worker: the workers are the parallelism
        import ctypes
        for path in {ln.split()[-1] for ln in open("/proc/self/maps") if "openblas" in ln.lower() and ".so" in ln}:
            lib = ctypes.CDLL(path)
            for sym in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads"):
                if hasattr(lib, sym):
                    getattr(lib, sym)(1)
    except Exception:
        pass


class _Dequantized:
    """Ŵ [K, N] of a :class:`quantizers.Blocks` as ``kit.gaps.layer_gap(s)`` reads it, ``[:, j0:j1]`` at a
    time: outputs j0:j1's rows dequantized (the op's reference), transposed."""

    def __init__(self, b: Q.Blocks):
        self.b = b
        self.shape = (b.K, b.N)

    def __getitem__(self, idx):
        rows, cols = idx
        if rows != slice(None) or not isinstance(cols, slice) or cols.step not in (None, 1):
            raise IndexError("a dequantized view gives [:, j0:j1]")
        b = self.b
        return bq.dequantize(b.W[cols], b.fmt, b.K, b.block).T


# ------------------------------------------------------------------ emission
def emit(graph: ir.Graph, cand: Candidate, plan: Plan, act_bits: int = 8, layout_choice: str = "blocks",
         prefill_act_bits: int = 0) -> None:
    """Replace the MatMul by BlockQuantMatMul over the plan's blocks (a constant bias Add after it folded
    into the op's bias; ``act_bits``: the op's activation integers; ``prefill_act_bits``: those of its calls
    with M > 1 rows, 0 = act_bits (the attribute left out); ``layout_choice``: --weights-layout, W's
    row layout where the format takes it), and the tied embedding's Gather by BlockQuantGather over the
    same initializer (and layout)."""

    _, b, tied = plan.payload
    base = surgery.safe_name(cand.name)
    tag = b.fmt if b.fmt != "q4_f" else f"q4_f{b.block}"
    bs = b.block if b.fmt == "q4_f" else None
    layout = plan.attrs.get("layout") or BG.row_layout(layout_choice, b.fmt, bs, act_bits)[0]   # the plan's (report)
    w = surgery.initializer(graph, f"{base}.weight_{tag}", BG.layout_bytes(b.W, layout, b.fmt, cand.K, bs))
    add = BG.bias_add(cand.node, cand.N)
    bias = (surgery.initializer(graph, f"{base}.bias", add[1].const_value.numpy().reshape(-1).astype(np.float32))
            if add is not None else None)
    attrs = _attrs(b, cand.K, cand.N, cand.label, cand.target, plan.gap)
    attrs["act_bits"] = int(act_bits)
    if prefill_act_bits:
        attrs["prefill_act_bits"] = int(prefill_act_bits)
    if layout != "blocks":
        attrs["layout"] = layout
    node = surgery.op_node("BlockQuantMatMul", [cand.input, w, bias], attrs, name=f"{cand.name}_BQ")
    graph.insert_before(cand.node, node)
    BG.take_over(graph, cand.node, add, node.outputs[0])
    gather = next((n for n in graph if n.name == tied), None) if tied else None
    if gather is not None:
        BG.gather_blocks(graph, gather, w, b.fmt, int(cand.K), int(cand.N), "head", b.source, cand.label, bs, layout)


def _attrs(b: Q.Blocks, K: int, N: int, layer: str, target: str, gap) -> dict:
    a = {"format": b.fmt, "K": int(K), "N": int(N), "layer": str(layer), "target": target, "source": b.source,
         "bits_per_weight": float(b.bits_per_weight), "params_dense": int(K) * int(N), "params_stored": int(K) * int(N),
         "gap": float(gap) if gap is not None else float("nan")}
    if b.fmt == "q4_f":
        a["block_size"] = int(b.block)
    return a
