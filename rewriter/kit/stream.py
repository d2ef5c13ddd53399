"""Running a loaded model in ONNX Runtime without copying its weights, and a large model layer by
layer (issue 35 item 3: a rewrite of a 7 GB model within 2x its output's bytes + 2 GB).

* :func:`runnable`: the model as ONNX Runtime runs it from memory — the serialized graph, with
  the tensors still in the input's external data referenced there (ORT maps them from the input's
  directory: ``session.model_external_initializers_file_folder_path``) and the large tensors the
  rewrite made in memory handed over in place (``SessionOptions.add_initializer``: ORT reads the
  numpy array itself, no copy; the proto holds a placeholder reference into the input's data
  file — or an empty sparse file when there is none —, which ORT checks exists but never
  reads). A serialized proto would hold every byte of both, and ORT a second copy.
* :class:`Streamed`: a session-like runner of a model whose weights exceed :data:`STREAM_BYTES`:
  the graph is cut, in topological order, into segments of about :data:`SEGMENT_BYTES` of
  weights (a decoder layer or two); each segment is an ONNX Runtime session of its own, built
  when the run reaches it and released after it, so at most one segment's weights are resident.
  ``run_many`` pushes every window through a segment before the next one is built (each segment
  session once); ``run`` is one window. The values crossing a cut (the residual stream, the
  mask / position tensors every layer reads) are kept per window until their last reader ran.
* :func:`session`: an ONNX Runtime session (or a :class:`Streamed` runner) for a path, bytes, a
  loaded model or a runner, whichever the caller has.
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import onnx
import onnx_ir as ir

from . import modelfile

# a model whose weights exceed this runs segment by segment (Streamed) when the rewrite measures it
STREAM_BYTES = int(os.environ.get("ORTLEAN_STREAM_BYTES", 1 << 30))
# weights per segment of a Streamed run (a decoder layer of a 1.5B model is ~190 MB in fp32)
SEGMENT_BYTES = int(os.environ.get("ORTLEAN_SEGMENT_BYTES", 256 << 20))
# a segment with a tensor larger than this runs with ORT's prepacking off (packing holds it twice)
PREPACK_MAX_BYTES = int(os.environ.get("ORTLEAN_PREPACK_MAX_BYTES", 256 << 20))
# in-memory tensors at least this large are handed to ORT in place instead of serialized
SHARE_BYTES = 1 << 20

_FOLDER_KEY = "session.model_external_initializers_file_folder_path"


def probe_threads(threads: int | None = None) -> int:
    """ONNX Runtime threads for the rewrite's own measurements of a model (the quality probe's trials):
    every core of this machine (``ORTLEAN_PROBE_THREADS`` overrides; never fewer than ``threads``).
    What a trial measures does not depend on it — ORT and the ortlean kernels split rows and columns over
    their threads, not sums: the probe's per-token NLLs of Gemma 3 270M with int4 BlockQuantMatMul
    weights are the same bit for bit at 1 and 2 threads — only how long the trial takes."""
    try:
        n = int(os.environ.get("ORTLEAN_PROBE_THREADS", 0))
    except ValueError:
        n = 0
    return max(1, int(threads or 1), n or (os.cpu_count() or 1))


def weight_bytes(model: ir.Model) -> int:
    """Bytes of the model's initializers (main graph), in memory or in external data."""
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def release_heap() -> None:
    """Give the C heap's free memory back to the system (glibc ``malloc_trim``): the sessions the
    rewrite builds and drops one after another (a segment's, a trial's) free their buffers, but
    glibc keeps freed blocks under its mmap threshold (up to 32 MiB each) in the process, and the
    next session's come on top of them (measured: ~1.4 GB kept after a 1.5B model's streamed
    reference run)."""
    import ctypes
    import ctypes.util

    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def trace_memory(what: str) -> None:
    """With ORTLEAN_TRACE_MEMORY set: `what` and this process's RSS on stderr (where memory goes)."""
    if not os.environ.get("ORTLEAN_TRACE_MEMORY"):
        return
    import sys

    try:
        with open("/proc/self/status") as fh:
            st = {k: int(v.split()[0]) >> 10 for k, _, v in (ln.partition(":") for ln in fh)
                  if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}
    except (OSError, ValueError):
        st = {}
    print(f"[ortlean memory] {what}: RSS {st.get('VmRSS', '?')} MiB (anonymous {st.get('RssAnon', '?')}, "
          f"file {st.get('RssFile', '?')}; peak {st.get('VmHWM', '?')})", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- runnable: no copy of the weights
@dataclass
class Runnable:
    """A loaded model as ONNX Runtime runs it from memory: ``proto`` (tensors in external data
    referenced, not read), the directory ORT resolves them against, and the arrays it reads in
    place (initializer name → array). Keep it alive as long as a session built from it."""
    proto: onnx.ModelProto
    folder: str | None
    shared: dict[str, np.ndarray] = field(default_factory=dict)
    _bytes: bytes | None = None
    _placeholder_dir: object = None    # the TemporaryDirectory of a placeholder file (see runnable)

    def serialized(self) -> bytes:
        if self._bytes is None:
            self._bytes = self.proto.SerializeToString()
        return self._bytes

    def options(self, so, names: Iterable[str] | None = None) -> list:
        """Add the folder and the in-place initializers (of ``names``, default all) to the session
        options ``so``; returns the OrtValues, which must outlive the session."""
        import onnxruntime as ort

        if self.folder:
            so.add_session_config_entry(_FOLDER_KEY, self.folder)
        keep = []
        for n in (self.shared if names is None else [n for n in names if n in self.shared]):
            ov = ort.OrtValue.ortvalue_from_numpy(self.shared[n])
            so.add_initializer(n, ov)
            keep.append(ov)
        return keep


def _external_files(model: ir.Model) -> tuple[str | None, str | None, int]:
    """(the directory every external initializer's data file is in — None when none or several —,
    the location of the largest of those files, its size)."""
    dirs, best, size = set(), None, -1
    for _, owner, t in modelfile.external_tensors(model):
        if not isinstance(owner, ir.Value) or not t.base_dir:
            continue
        dirs.add(str(Path(t.base_dir).resolve()))
        f = Path(t.base_dir) / t.location
        try:
            n = f.stat().st_size
        except OSError:
            continue
        if n > size:
            best, size = str(t.location), n
    if len(dirs) != 1:
        return None, None, 0
    return dirs.pop(), best, size


def _numpy_in_place(t) -> np.ndarray | None:
    """The tensor's data as a C-contiguous numpy array without a copy, or None."""
    try:
        a = t.numpy()
    except Exception:
        return None
    if not isinstance(a, np.ndarray) or not a.flags.c_contiguous or a.dtype.kind not in "fiub" \
            or a.dtype.itemsize not in (1, 2, 4, 8) or a.dtype.byteorder == ">":
        return None
    return a


def _foldable_inputs(graph: ir.Graph) -> set[str]:
    """Names of the initializers that a node ORT may constant-fold reads: a node of an ONNX or
    contrib domain whose every input is an initializer. ORT folds such a node while it optimizes
    the graph, reading the initializer's data from the model — the placeholder, not the array
    :meth:`Runnable.options` adds (``add_initializer`` is applied after the optimizers ran): a tied
    embedding's Reshape of a head's MatMulNBits scales folded to zeros made Gemma 3's trial model
    +25,000 % worse than the model written to disk. Such tensors are serialized, never shared."""
    inits = graph.initializers
    names: set[str] = set()
    for node in graph:
        if node.domain not in ("", "ai.onnx", "com.microsoft") or not node.inputs:
            continue
        ins = [x for x in node.inputs if x is not None]
        if ins and all(x.name in inits and inits[x.name] is x for x in ins):
            names.update(x.name for x in ins)
    return names


def runnable(model: ir.Model) -> Runnable:
    """``model`` (not changed) as ONNX Runtime runs it without a copy of its weights (see the
    module docstring). Attribute tensors in external data and external initializers outside one
    directory go inline. The in-memory tensors' placeholders point into the input's data file, or,
    when the model has no one directory of external data, into an empty sparse file of a temporary
    directory that lives as long as the Runnable."""
    folder, placeholder, room = _external_files(model)
    tmp = None
    if folder is None:
        # no one directory of external data to point the placeholders at (a model made in memory:
        # a trial model whose every weight the rewrite replaced — its tensors in external data, if
        # any, go inline below): an empty sparse file as long as the largest tensor to share
        big = max((v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None
                   and not isinstance(v.const_value, ir.ExternalTensor) and v.const_value.nbytes >= SHARE_BYTES),
                  default=0)
        if big:
            import tempfile

            tmp = tempfile.TemporaryDirectory(prefix="ortlean-placeholder-")
            folder, placeholder, room = str(Path(tmp.name).resolve()), "placeholder.bin", big
            with open(os.path.join(folder, placeholder), "wb") as fh:
                fh.truncate(big)
    shared: dict[str, np.ndarray] = {}
    swapped: list[tuple[ir.Value, object]] = []
    folded = _foldable_inputs(model.graph)
    for v in model.graph.initializers.values():
        t = v.const_value
        if t is None:
            continue
        if isinstance(t, ir.ExternalTensor):
            if folder is None or str(Path(t.base_dir).resolve()) != folder:
                swapped.append((v, t))
                v.const_value = modelfile._lazy_bytes(t)
            continue
        if placeholder is None or t.nbytes < SHARE_BYTES or t.nbytes > room or v.name in folded:
            continue
        a = _numpy_in_place(t)
        if a is None:
            continue
        shared[v.name] = a
        swapped.append((v, t))
        # ORT checks the reference (the input's own data file, at least this long) and never reads
        # it: add_initializer gives it the array
        v.const_value = ir.ExternalTensor(placeholder, 0, t.nbytes, t.dtype, shape=t.shape, name=v.name,
                                          base_dir=folder)
    try:
        with modelfile.replaced_tensors(model, modelfile._lazy_bytes, lambda owner, t: not isinstance(owner, ir.Value)):
            proto = ir.serde.serialize_model(model)
    finally:
        for v, t in swapped:
            v.const_value = t
    return Runnable(proto, folder, shared, _placeholder_dir=tmp)


# --------------------------------------------------------------------------- decode view
_HEAD_OPS = {("", "MatMul"), ("", "Gemm"), ("com.microsoft", "MatMulNBits"), ("ai.ortlean", "BlockQuantMatMul")}


def last_position_logits(model: ir.Model, logits: str = "logits") -> ir.Model | None:
    """A clone of ``model`` (tensors shared) whose ``logits`` output holds the last position only:
    the final hidden states go through ``Slice(axis 1, -1:)`` before the head. Decode steps (one new
    token) compute exactly what they computed; a prefill no longer makes — and pays the head's
    product for — a [T, vocabulary] array nobody reads (a 4,096-token prefill of a 151,936-token
    vocabulary: 2.5 GB of logits). The cheap head's If (``--cheap-head``) reads the last position in
    its test and both branches (:func:`_cheap_head_last`). None when the head is not found as a product
    (or several products and a Concat) whose activation input feeds nothing else."""
    m = model.clone()
    out = next((v for v in m.graph.outputs if v.name == logits), None)
    if out is None or out.producer() is None:
        return None
    p = out.producer()
    if p.op_type == "If" and p.name == CHEAP_HEAD_IF:
        return _cheap_head_last(m, p)
    heads = [p] if (p.domain, p.op_type) in _HEAD_OPS else \
        [x.producer() for x in p.inputs if x is not None and x.producer() is not None] if p.op_type == "Concat" else []
    if not heads or any(h is None or (h.domain, h.op_type) not in _HEAD_OPS for h in heads):
        return None
    x = heads[0].inputs[0]
    if x is None or any(h.inputs[0] is not x for h in heads) or x.is_graph_output() or \
            any(u.node not in heads for u in x.uses()):
        return None
    if p.op_type == "Concat" and p.attributes.get_int("axis", -1) not in (-1, 2):
        return None
    _last_position(m, x, heads[0])
    return m


def _last_position(m: ir.Model, x: ir.Value, before: ir.Node) -> None:
    """``Slice(x, axis 1, -1:)`` inserted before ``before``; every use of ``x`` (in subgraphs too) reads it."""
    ints = lambda name, vals: ir.Value(name=name, const_value=ir.tensor(np.array(vals, np.int64), name=name))
    starts, ends, axes = ints("ortlean_last_start", [-1]), ints("ortlean_last_end", [1 << 62]), ints("ortlean_last_axis", [1])
    for c in (starts, ends, axes):
        m.graph.initializers[c.name] = c
    sl = ir.Node("", "Slice", [x, starts, ends, axes], name="ortlean_last_position", num_outputs=1)
    sl.outputs[0].name = f"{x.name}_last"
    m.graph.insert_before(before, sl)
    for u in list(x.uses()):
        if u.node is not sl:
            u.node.replace_input_with(u.idx, sl.outputs[0])


CHEAP_HEAD_IF = "/ortlean/cheap_head/If"   # backends/head.py: the cheap head's If (decode: one position)


def _cheap_head_last(m: ir.Model, iff: ir.Node) -> ir.Model | None:
    """last_position_logits of a graph with the cheap head (``--cheap-head``): its input h goes to the If's
    sequence-length test and into both branches; the last position of h replaces it in all of them, so a
    prompt's last row takes the decode branch (the approximate logits and exact candidates of every
    decode step) and no branch computes the other rows' logits."""
    shape = next((n for n in m.graph if n.op_type == "Shape" and n.name == "/ortlean/cheap_head/InputShape"), None)
    if shape is None:
        return None
    x = shape.inputs[0]
    inside = {n for a in iff.attributes.values() if a.type == ir.AttributeType.GRAPH for n in a.value.all_nodes()}
    if x is None or x.is_graph_output() or any(u.node is not shape and u.node not in inside for u in x.uses()):
        return None
    _last_position(m, x, shape)
    return m


# --------------------------------------------------------------------------- sessions
def _options(threads: int | None, so=None, prepack: bool = True):
    import onnxruntime as ort

    so = so or ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = int(threads)
        so.inter_op_num_threads = 1
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    return so


def session(model, threads: int | None = None, *, so=None, backend: str = "auto", stream: bool | None = None,
            last_logits: bool = False):
    """An ONNX Runtime session on ``model`` — a path, serialized bytes, a loaded ``ir.Model`` (run
    without a copy of its weights: :func:`runnable`), a :class:`Runnable` or a :class:`Streamed`
    runner (returned as it is) — with the ortlean ops registered. A loaded model whose weights
    exceed :data:`STREAM_BYTES` becomes a :class:`Streamed` runner unless ``stream=False``.
    ``last_logits``: a loaded model's logits of the last position only (:func:`last_position_logits`,
    for decode loops that read no prefill logits; the model as it is where the head is not found)."""
    import custom_ops

    if isinstance(model, Streamed):
        return model
    if isinstance(model, Path):
        model = str(model)
    if isinstance(model, ir.Model) and last_logits:
        model = last_position_logits(model) or model
    if isinstance(model, ir.Model):
        if stream or (stream is None and weight_bytes(model) > STREAM_BYTES):
            return Streamed(model, threads=threads, backend=backend)
        model = runnable(model)
    if isinstance(model, Runnable):
        so = _options(threads, so)
        keep = model.options(so)
        sess = custom_ops.session(model.serialized(), so=so, backend=backend)
        sess._ortlean_keep = (model, keep)   # the arrays ORT reads live as long as the session
        trace_memory(f"session of a loaded model ({len(model.shared)} arrays in place)")
        return sess
    return custom_ops.session(model, so=_options(threads, so), backend=backend)


class _Arg:
    """What ``InferenceSession.get_inputs()`` / ``get_outputs()`` give: name, shape, type."""

    def __init__(self, vi: onnx.ValueInfoProto):
        self.name = vi.name
        tt = vi.type.tensor_type
        self.type = f"tensor({onnx.helper.tensor_dtype_to_string(tt.elem_type).split('.')[-1].lower()})" \
            if tt.elem_type else "tensor(float)"
        self.type = self.type.replace("tensor(float32)", "tensor(float)")
        self.shape = ([d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
                      if tt.HasField("shape") else None)


_NP_TO_ONNX = {np.dtype(k): v for k, v in ((np.float32, onnx.TensorProto.FLOAT), (np.float16, onnx.TensorProto.FLOAT16),
                                           (np.float64, onnx.TensorProto.DOUBLE), (np.int64, onnx.TensorProto.INT64),
                                           (np.int32, onnx.TensorProto.INT32), (np.int8, onnx.TensorProto.INT8),
                                           (np.uint8, onnx.TensorProto.UINT8), (np.bool_, onnx.TensorProto.BOOL))}


@dataclass
class _Segment:
    nodes: list            # NodeProto, in order
    inits: list[str]       # the initializers its nodes read
    inputs: list[str]      # values it reads that an earlier segment or the feeds hold
    produced: set[str]     # values its nodes write
    weight: int            # bytes of its initializers


class Streamed:
    """A session-like runner of a model too large to hold whole (see the module docstring):
    ``get_inputs()``, ``get_outputs()``, ``run(names, feeds)`` as ``InferenceSession`` has them,
    and ``run_many(names, feeds_list, consume)`` for many windows. The model is snapshotted when
    the runner is made (a later change to it does not reach the runner)."""

    def __init__(self, model: ir.Model, threads: int | None = None, *, segment_bytes: int | None = None,
                 backend: str = "auto"):
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for n in model.graph
               for a in n.attributes.values()):
            self._whole = model.clone()     # control flow: the values its subgraphs read are not cut
        else:
            self._whole = None
        model = model.clone()
        model.graph.sort()
        self.runnable = runnable(model)
        self.threads = threads
        self.backend = backend
        self.sizes = {v.name: (v.const_value.nbytes if v.const_value is not None else 0)
                      for v in model.graph.initializers.values()}
        g = self.runnable.proto.graph
        self._inits = {t.name: t for t in g.initializer}
        self._inputs = [vi for vi in g.input if vi.name not in self._inits]
        self._outputs = list(g.output)
        self.segments = self._plan(list(g.node), segment_bytes or SEGMENT_BYTES)
        self.sessions_built = 0

    # -- the session interface ---------------------------------------------------------------
    def get_inputs(self):
        return [_Arg(vi) for vi in self._inputs]

    def get_outputs(self):
        return [_Arg(vi) for vi in self._outputs]

    def run(self, output_names, feeds: dict, run_options=None) -> list:
        names = [o.name for o in self._outputs] if output_names is None else list(output_names)
        got: dict[str, np.ndarray] = {}
        self.run_many(names, [feeds], lambda w, n, a: got.__setitem__(n, _own(a)))   # kept past its segment
        return [got[n] for n in names]

    # -- planning ----------------------------------------------------------------------------
    def _plan(self, nodes: list, budget: int) -> list[_Segment]:
        segs, cur, inits, weight = [], [], [], 0

        def node_inits(n):
            return [x for x in dict.fromkeys(n.input) if x in self._inits]

        for n in nodes:
            new = [x for x in node_inits(n) if x not in inits]
            add = sum(self.sizes.get(x, 0) for x in new)
            if cur and weight + add > budget:
                segs.append((cur, inits, weight))
                cur, inits, weight = [], [], 0
                new = node_inits(n)
                add = sum(self.sizes.get(x, 0) for x in new)
            cur.append(n)
            inits += new
            weight += add
        if cur:
            segs.append((cur, inits, weight))
        out = []
        for seg_nodes, seg_inits, w in segs:
            produced = {o for n in seg_nodes for o in n.output if o}
            reads = [x for n in seg_nodes for x in n.input if x and x not in produced and x not in self._inits]
            out.append(_Segment(seg_nodes, seg_inits, list(dict.fromkeys(reads)), produced, w))
        return out

    def _segment_model(self, seg: _Segment, outputs: list[str], types: dict[str, int]) -> onnx.ModelProto:
        graph_in = {vi.name: vi for vi in self._inputs}
        inputs = [graph_in[x] if x in graph_in else
                  onnx.helper.make_tensor_value_info(x, types.get(x, onnx.TensorProto.FLOAT), None)
                  for x in seg.inputs]
        g = onnx.helper.make_graph(seg.nodes, "segment", inputs, [onnx.ValueInfoProto(name=o) for o in outputs],
                                   [self._inits[x] for x in seg.inits])
        whole = self.runnable.proto
        m = onnx.ModelProto(ir_version=whole.ir_version, producer_name=whole.producer_name,
                            producer_version=whole.producer_version)
        m.opset_import.extend(whole.opset_import)
        m.functions.extend(whole.functions)
        m.graph.CopyFrom(g)
        return m

    # -- running -----------------------------------------------------------------------------
    def run_many(self, output_names, feeds_list: list[dict],
                 consume: Callable[[int, str, np.ndarray], None], progress: str | None = None) -> None:
        """Every window of ``feeds_list`` through the model, segment by segment; each value of
        ``output_names`` goes to ``consume(window index, name, array)`` as soon as it is computed
        (a graph input asked for: at the start), never kept. ``consume`` should not keep the array
        past the segment, or keep a copy (:func:`_own`): the session's memory stays alive with it.
        ``progress``: a bar of that name over the segments."""
        import custom_ops
        from tqdm.auto import tqdm

        if self._whole is not None:   # not cut: one session
            sess = session(self._whole, self.threads, backend=self.backend, stream=False)
            names = list(output_names)
            for w, f in enumerate(feeds_list):
                for n, a in zip(names, sess.run(names, f)):
                    consume(w, n, a)
            return
        if not feeds_list:
            return
        want = set(output_names)
        graph_inputs = {vi.name for vi in self._inputs}
        for w, f in enumerate(feeds_list):
            for n in want & graph_inputs:
                consume(w, n, f[n])
        # the last segment reading each value: kept until then
        last: dict[str, int] = {}
        for i, seg in enumerate(self.segments):
            for x in seg.inputs:
                last[x] = i
        store: list[dict[str, np.ndarray]] = [dict() for _ in feeds_list]
        bar = tqdm(total=len(self.segments), desc=progress or "", unit="segment", disable=True if progress is None else None, leave=False)
        for i, seg in enumerate(self.segments):
            bar.update(1)
            outs = [o for n in seg.nodes for o in n.output if o and (o in want or last.get(o, -1) > i)]
            outs = list(dict.fromkeys(outs))
            if not outs:
                continue
            types = {x: _NP_TO_ONNX.get(store[0][x].dtype, onnx.TensorProto.FLOAT) for x in seg.inputs if x in store[0]}
            proto = self._segment_model(seg, outs, types)
            # a tensor over PREPACK_MAX_BYTES (a 151,936-token head: 0.9 GB) is not prepacked:
            # ORT would hold it twice while it packs it
            big = max((self.sizes.get(x, 0) for x in seg.inits), default=0)
            so = _options(self.threads, prepack=big <= PREPACK_MAX_BYTES)
            keep = self.runnable.options(so, seg.inits)
            sess = custom_ops.session(proto.SerializeToString(), so=so, backend=self.backend)
            self.sessions_built += 1
            trace_memory(f"segment {i + 1}/{len(self.segments)}: {len(seg.nodes)} nodes, {seg.weight / 2**20:.0f} MiB of "
                   f"weights, {len(feeds_list)} windows; session built")
            for w, f in enumerate(feeds_list):
                feed = {x: (f[x] if x in graph_inputs else store[w][x]) for x in seg.inputs}
                for n, a in zip(outs, sess.run(outs, feed)):
                    if n in want:
                        consume(w, n, a)
                    if last.get(n, -1) > i:
                        store[w][n] = _own(a)
                for x in [x for x in store[w] if last.get(x, -1) <= i]:
                    del store[w][x]
            del sess, keep, proto
            gc.collect()
            release_heap()
        bar.close()


def _own(a: np.ndarray) -> np.ndarray:
    """``a`` as an array owning its memory: an output of an ONNX Runtime session is a view of the
    session's memory arena and keeps the whole arena alive as long as it lives (kept past its
    segment: ~75 MB per segment of a 1.5B model at 512 tokens, for a value of a few kB)."""
    return a if a.flags.owndata else a.copy()


def perplexity(sess, io, ids, window: int, prefix=None) -> dict:
    """``custom_ops.runtime.perplexity(sess, io, ids, window=window, prefix=prefix)`` — the same windows,
    the same scoring — where ``sess`` may be a :class:`Streamed` runner: then every window goes through
    each segment at once (each segment's session built once) and each window's logits are scored as
    they come and dropped."""
    import math

    from custom_ops import runtime
    from custom_ops.runtime.quality import _target_logprobs

    if not isinstance(sess, Streamed):
        return runtime.perplexity(sess, io, ids, window=window, prefix=prefix)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    pre = np.asarray(prefix if prefix is not None else (), np.int64).reshape(-1)
    p = pre.size
    n = ids.size
    spans = []
    for begin in range(0, max(n - 1, 0), window):
        end = min(begin + window, n)
        if end - begin < 2:
            break
        spans.append((begin, end))
        if end >= n:
            break
    feeds = [runtime.feeds(io, np.concatenate([pre, ids[b:e]])[None, :]) for b, e in spans]
    scored = {"to": 1, "nll": 0.0, "count": 0}
    parts: dict[int, tuple] = {}

    def consume(w, name, logits):
        begin, end = spans[w]
        first = max(begin + 1, 1 if w == 0 else spans[w - 1][1])   # stride == window: what runtime.perplexity scores
        if first < end:
            tgt = ids[first:end]
            lp = _target_logprobs(logits[0][p + first - begin - 1: p + end - begin - 1], tgt)
            parts[w] = (-float(lp.sum()), int(tgt.size), -lp)

    sess.run_many([io.logits_name], feeds, consume)
    for w in sorted(parts):        # summed in window order, as runtime.perplexity does
        scored["nll"] += parts[w][0]
        scored["count"] += parts[w][1]
    if scored["count"] == 0:
        raise ValueError("perplexity: fewer than 2 tokens to score")
    nll = scored["nll"] / scored["count"]
    return {"ppl": math.exp(nll), "nll": nll, "tokens": scored["count"], "windows": len(spans),
            "window": window, "stride": window, "prefix": [int(x) for x in pre],
            "token_nll": np.concatenate([parts[w][2] for w in sorted(parts)])}
