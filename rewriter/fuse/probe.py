"""What an export's small integer / table subgraphs compute, measured instead of pattern-matched.

An optimum decoder export computes its attention masks (causal, padding, sliding window) and its
rotary cos/sin tables from the graph inputs with a few dozen shape and arithmetic nodes whose form
changes with every transformers release and model family. Instead of recognising those forms, the
fusion evaluates them: :class:`GraphProbe` cuts the fan-in of a value out of the export, replaces
every ``Shape`` of a tensor it does not want to compute (the embeddings, a layer's keys) by the
constant that shape inference (ONNX Runtime's symbolic shape inference) gives for chosen batch /
sequence / past lengths, and runs that small graph in ONNX Runtime. No weight is read: the weights are typed
inputs of the proto the probe holds.

    probe = GraphProbe(proto, weight_names)
    m = probe.evaluate(["/model/layers.0/self_attn/Where_2_output_0"], batch=1, seq=2, past=4094)

:func:`mask_window` and :func:`rotary_table` turn those measurements into GroupQueryAttention's
terms (``local_window_size``; ``cos_cache``/``sin_cache``) and check that the export's mask and
positions are the ones GroupQueryAttention computes itself; each raises :class:`ProbeError` naming
what differs.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["ProbeError", "GraphProbe", "mask_window", "rotary_table"]

_MAX_NODES = 4000          # a mask or rotary fan-in is < 200 nodes; more means it reaches the model's body
_MASKED = -1e30            # an additive mask entry at or below this removes the key (float32 finfo.min, -inf)


class ProbeError(ValueError):
    """The subgraph cannot be evaluated, or does not compute what GroupQueryAttention does."""


class GraphProbe:
    """Evaluates values of a decoder export (weightless ``onnx.ModelProto``: its big weights are
    graph inputs, ``weight_names``) for concrete ``batch``, ``seq`` (new tokens) and ``past``
    (cached tokens) lengths. The input dims are set from the optimum export's dim names
    (``batch_size``, ``sequence_length``, ``past_sequence_length``, ``past_sequence_length +
    sequence_length``); a Shape of any other tensor becomes the constant shape inference gives."""

    DIMS = ("batch_size", "sequence_length", "past_sequence_length", "past_sequence_length + sequence_length",
            "total_sequence_length")

    def __init__(self, proto: onnx.ModelProto, weight_names=()):
        self.proto = proto
        self.weights = set(weight_names)
        g = proto.graph
        self._producer = {o: n for n in g.node for o in n.output if o}
        self._order = {id(n): i for i, n in enumerate(g.node)}
        self._inputs = {i.name: i for i in g.input}
        self._inits = {t.name: t for t in g.initializer}
        self._shapes: dict[tuple, dict[str, list]] = {}

    # ----------------------------------------------------------------- shapes for given lengths
    def _dim(self, d, batch, seq, past, where):
        if d.HasField("dim_value"):
            return d.dim_value
        v = {"batch_size": batch, "sequence_length": seq, "past_sequence_length": past,
             "past_sequence_length + sequence_length": past + seq, "total_sequence_length": past + seq}.get(d.dim_param)
        if v is None:
            raise ProbeError(f"input {where}: dimension {d.dim_param!r} is not one of the optimum export's "
                             f"({', '.join(self.DIMS)})")
        return v

    def input_shape(self, name: str, batch: int, seq: int, past: int) -> list[int]:
        vi = self._inputs[name]
        return [self._dim(d, batch, seq, past, name) for d in vi.type.tensor_type.shape.dim]

    def shapes(self, batch: int, seq: int, past: int) -> dict[str, list]:
        """Every value's shape (ints; None where unknown) when the inputs have these lengths."""
        key = (batch, seq, past)
        if key not in self._shapes:
            m = onnx.ModelProto()
            m.CopyFrom(self.proto)
            del m.graph.value_info[:]
            for o in m.graph.output:
                o.type.tensor_type.ClearField("shape")
            for vi in m.graph.input:
                if vi.name in self.weights:
                    continue
                dims = vi.type.tensor_type.shape.dim
                vals = [self._dim(d, batch, seq, past, vi.name) for d in dims]
                for d, v in zip(dims, vals):
                    d.Clear()
                    d.dim_value = v
            inferred = _infer(m)
            out = {}
            for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
                t = vi.type.tensor_type
                if t.HasField("shape"):
                    out[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
            for t in self.proto.graph.initializer:
                out[t.name] = list(t.dims)
            self._shapes[key] = out
        return self._shapes[key]

    # ----------------------------------------------------------------- the subgraph
    def _subgraph(self, targets: list[str], shapes: dict[str, list]):
        nodes, consts, inputs, inits = {}, [], set(), set()
        stack = list(targets)
        seen = set()
        while stack:
            name = stack.pop()
            if name in seen or not name:
                continue
            seen.add(name)
            if name in self.weights:
                raise ProbeError(f"{targets[0]}: depends on the weight {name!r} (not a mask / position computation)")
            if name in self._inits:
                inits.add(name)
                continue
            if name in self._inputs:
                inputs.add(name)
                continue
            n = self._producer.get(name)
            if n is None:
                raise ProbeError(f"{name}: no producer and not an input")
            if id(n) in nodes:
                continue
            if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
                raise ProbeError(f"{n.name}: a control-flow node ({n.op_type}) in the fan-in of {targets[0]}")
            if n.op_type == "Shape" and n.domain in ("", "ai.onnx"):
                shp = shapes.get(n.input[0])
                if shp is not None and all(isinstance(d, int) for d in shp):
                    a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
                    arr = np.array(shp[a.get("start", 0): a.get("end", len(shp))] if "end" in a
                                   else shp[a.get("start", 0):], np.int64)
                    consts.append(helper.make_node("Constant", [], [n.output[0]], name=f"{n.name}/probe",
                                                   value=numpy_helper.from_array(arr)))
                    nodes[id(n)] = None
                    continue
            nodes[id(n)] = n
            if len(nodes) > _MAX_NODES:
                raise ProbeError(f"{targets[0]}: more than {_MAX_NODES} nodes in its fan-in")
            stack.extend(n.input)
        body = sorted((n for n in nodes.values() if n is not None), key=lambda n: self._order[id(n)])
        return consts + body, inputs, inits

    def evaluate(self, targets: list[str], *, batch: int, seq: int, past: int,
                 feeds: dict[str, np.ndarray] | None = None) -> list[np.ndarray]:
        """The values ``targets`` for inputs of these lengths; ``feeds`` gives input values (the
        default: ``attention_mask`` all ones, ``position_ids`` past … past + seq - 1, zeros)."""
        import onnxruntime as ort

        shapes = self.shapes(batch, seq, past)
        nodes, inputs, inits = self._subgraph(list(targets), shapes)
        g_in, f = [], {}
        for name in sorted(inputs):
            vi = self._inputs[name]
            shp = self.input_shape(name, batch, seq, past)
            dt = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
            if feeds and name in feeds:
                val = np.asarray(feeds[name], dt)
            elif name == "attention_mask":
                val = np.ones(shp, dt)
            elif name == "position_ids":
                val = np.broadcast_to(np.arange(past, past + seq, dtype=dt), shp).copy()
            else:
                val = np.zeros(shp, dt)
            if list(val.shape) != shp:
                raise ProbeError(f"probe feed {name}: shape {list(val.shape)}, expected {shp}")
            f[name] = val
            g_in.append(helper.make_tensor_value_info(name, vi.type.tensor_type.elem_type, shp))
        outs = [onnx.ValueInfoProto(name=t) for t in targets]
        graph = helper.make_graph(nodes, "probe", g_in, outs, [self._inits[n] for n in sorted(inits)])
        m = helper.make_model(graph, opset_imports=list(self.proto.opset_import), ir_version=self.proto.ir_version)
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.log_severity_level = 3
        try:
            sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
            return sess.run(list(targets), f)
        except Exception as e:   # noqa: BLE001 - ORT's errors are plain RuntimeErrors / Fail
            raise ProbeError(f"evaluating {targets[0]}: {str(e).splitlines()[0]}") from None


def _symbolic_shape_inference():
    """ONNX Runtime's ``onnxruntime/tools/symbolic_shape_infer.py``, loaded from its file: the
    ``onnxruntime.tools`` package imports torch when it is installed (5 s, and the rewrite never
    needs it)."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "_ortlean_symbolic_shape_infer"
    if name not in sys.modules:
        path = Path(importlib.util.find_spec("onnxruntime").origin).parent / "tools" / "symbolic_shape_infer.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules[name] = mod
    return sys.modules[name].SymbolicShapeInference


def _infer(m: onnx.ModelProto) -> onnx.ModelProto:
    """Shapes of every value of ``m`` (concrete input dims): ONNX Runtime's symbolic shape
    inference, which propagates the shape arithmetic (a Slice whose end is computed, a broadcast
    of a length-1 dim) that ONNX's own inference with data propagation leaves unknown; ONNX's
    when ORT's fails on the graph."""
    import logging

    SymbolicShapeInference = _symbolic_shape_inference()
    lg = logging.getLogger("_ortlean_symbolic_shape_infer")
    level = lg.level
    lg.setLevel(logging.CRITICAL)
    try:
        out = SymbolicShapeInference.infer_shapes(m, auto_merge=True)
        if out is not None:
            return out
    except Exception:   # noqa: BLE001 - falls back to ONNX's inference below
        pass
    finally:
        lg.setLevel(level)
    try:
        return onnx.shape_inference.infer_shapes(m, data_prop=True)
    except Exception as e:   # noqa: BLE001 - onnx raises several types; the message names the node
        raise ProbeError(f"shape inference failed: {str(e).splitlines()[0]}") from None


# --------------------------------------------------------------------------- masks
def _allowed(mask: np.ndarray, what: str) -> np.ndarray:
    """Boolean [B, S, T] of an additive mask [B|1, 1, S, T]: True where a key is kept (0), False
    where removed (≤ -1e30, or half the dtype's lowest); anything else is a learnt bias, not a mask."""
    m = np.asarray(mask)
    if m.ndim != 4 or m.shape[1] != 1:
        raise ProbeError(f"{what}: mask shape {list(m.shape)} is not [batch, 1, query, key]")
    keep, drop = m == 0, m <= max(_MASKED, float(np.finfo(m.dtype).min) / 2)   # float16: finfo.min is -65504
    if not np.all(keep | drop):
        bad = m[~(keep | drop)].ravel()[0]
        raise ProbeError(f"{what}: the additive mask holds {bad:g}, neither 0 nor a removal (a bias, not a mask)")
    return keep[:, 0]


def _expected(attention_mask: np.ndarray, seq: int, past: int, window: int) -> np.ndarray:
    """GroupQueryAttention's mask: key j of row b is seen from query i (position past + i) when
    j ≤ past + i, attention_mask[b, j] = 1 and, with a window w > 0, past + i - j < w."""
    T = past + seq
    q = past + np.arange(seq)[:, None]
    k = np.arange(T)[None, :]
    ok = k <= q
    if window > 0:
        ok &= (q - k) < window
    return ok[None] & (np.asarray(attention_mask)[:, None, :] == 1)


def mask_window(probe: GraphProbe, name: str, max_positions: int) -> int:
    """The sliding window of the additive attention mask ``name`` (-1: none up to
    ``max_positions``), after checking that the mask is GroupQueryAttention's: causal, the
    attention_mask's zeros removed (right padding), and the window — on a decode step at the last
    position, on a padded prefill after a past, and on a prefill across the window's edge."""
    T = int(max_positions)
    # two new tokens, not one: ONNX shape inference cannot broadcast a length-1 dim against an
    # unknown one, so a one-token step leaves the keys' length unknown
    (m,) = probe.evaluate([name], batch=1, seq=2, past=T - 2)
    keep = _allowed(m, name)[0, -1]
    if keep.shape[0] != T:
        raise ProbeError(f"{name}: a step over {T} keys gives a mask over {keep.shape[0]}")
    n = int(keep.sum())
    if n == 0 or not keep[T - n:].all():
        raise ProbeError(f"{name}: the last position does not see a contiguous run of the last keys")
    window = -1 if n == T else n
    S = 6 if T >= 9 else max(2, T - 3)      # within the positions probed (6 new after 3: the other
    checks = [(2, S, min(3, T - S), True)]  # probes' lengths, one shape inference each)
    if window > 0 and T - window - 1 >= 2:  # across the window's edge
        checks.append((1, min(4, T - window - 1), window + 1, False))
    for B, S, P, pad in checks:
        am = np.ones((B, P + S), np.int64)
        if pad:
            am[1, -2:] = 0     # row 1 right-padded: its last two tokens are padding
        (m,) = probe.evaluate([name], batch=B, seq=S, past=P, feeds={"attention_mask": am})
        got = np.broadcast_to(_allowed(m, name), (B, S, P + S))
        want = _expected(am, S, P, window)
        valid = am[:, P:] == 1                       # padded queries' rows are never read
        if not np.array_equal(got[valid], want[valid]):
            b, i = np.argwhere(valid & np.any(got != want, axis=-1))[0]
            raise ProbeError(f"{name}: at batch {B}, {S} new tokens after {P}, query {i} of row {b} sees keys "
                             f"{np.flatnonzero(got[b, i]).tolist()}, GroupQueryAttention (causal"
                             f"{f', window {window}' if window > 0 else ''}, padding) "
                             f"{np.flatnonzero(want[b, i]).tolist()}")
    return window


# --------------------------------------------------------------------------- rotary tables
def rotary_table(probe: GraphProbe, cos: str, sin: str, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """GroupQueryAttention's ``cos_cache``/``sin_cache`` [rows, r/2] from the export's rotary
    tables ``cos``/``sin`` ([batch, seq, r], rotate-half layout: the two halves equal), evaluated
    for positions 0 … rows-1. Checked: a row depends on its position alone (decode steps and a
    prefill after a past read the same rows; a rope whose frequencies switch with the sequence
    length, like LongRoPE's, does not) — GroupQueryAttention takes the position of every token as
    past + its index."""
    c, s = probe.evaluate([cos, sin], batch=1, seq=rows, past=0)
    c, s = (np.asarray(x, np.float32) for x in (c, s))
    if c.ndim == 3:
        c, s = c[0], s[0]
    if c.ndim != 2 or c.shape != s.shape or c.shape[0] != rows or c.shape[1] % 2:
        raise ProbeError(f"{cos}: rotary table shape {list(c.shape)} is not [positions, rotary_dim]")
    h = c.shape[1] // 2
    for t, nm in ((c, cos), (s, sin)):
        if not np.array_equal(t[:, :h], t[:, h:]):
            raise ProbeError(f"{nm}: the rotary table's halves differ (not the rotate-half layout)")
    for B, S, P in ((1, 3, 2), (2, 6, 3), (1, 2, rows - 2)):     # the lengths the mask and head probes use
        if P + S > rows:
            continue
        cc, ss = probe.evaluate([cos, sin], batch=B, seq=S, past=P)
        cc, ss = (np.broadcast_to(np.asarray(x, np.float32).reshape(-1, S, x.shape[-1]), (B, S, x.shape[-1]))
                  for x in (cc, ss))
        if not (np.array_equal(cc[0], cc[-1]) and np.array_equal(ss[0], ss[-1])):
            raise ProbeError(f"{cos}: the rotary rows differ between the rows of a batch")
        cc, ss = cc[0], ss[0]
        tol = 1e-6 * max(1.0, float(np.abs(c).max()))
        if not (np.allclose(cc, c[P:P + S], rtol=1e-5, atol=tol) and np.allclose(ss, s[P:P + S], rtol=1e-5, atol=tol)):
            raise ProbeError(f"{cos}: the rotary rows of positions {P}..{P + S - 1} differ when {S} tokens follow "
                             f"{P} (a rope that depends on the sequence length, e.g. LongRoPE switching factors; "
                             "GroupQueryAttention has one table)")
    return np.ascontiguousarray(c[:, :h]), np.ascontiguousarray(s[:, :h])

