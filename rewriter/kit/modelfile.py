"""Model files: loading with clear errors, atomic saving next to the output, the tokenizer/config
sidecars, the checker, and the I/O signature of a loaded model."""
from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from ..errors import OrtleanError

# external data is used when the initializers exceed this (protobuf's hard limit is 2 GiB)
# (512 MiB, not protobuf's limit: a single-file model is serialized whole in memory — the proto,
# then its bytes — twice the model's size on top of the rewrite's own; with external data each
# tensor is written as it comes)
EXTERNAL_DATA_THRESHOLD = int(os.environ.get("ORTLEAN_EXTERNAL_DATA_THRESHOLD", 512 << 20))
# with external data, tensors up to this size stay inline in the model file
INLINE_TENSOR_BYTES = 1024


def load_model(path: str | os.PathLike) -> ir.Model:
    """Load an ONNX model (external data is memory-mapped, not read) with clear errors."""
    p = Path(path)
    if not p.exists():
        raise OrtleanError(f"{p}: no such file")
    if p.is_dir():
        raise OrtleanError(f"{p}: is a directory, expected an .onnx file")
    try:
        proto = onnx.load(str(p), load_external_data=False)
    except Exception as e:  # DecodeError, OSError …
        raise OrtleanError(f"{p}: not a readable ONNX model ({type(e).__name__}: {e})") from None
    if not proto.HasField("graph") or len(proto.graph.node) == 0 or len(proto.opset_import) == 0:
        raise OrtleanError(f"{p}: not an ONNX model (no graph, nodes or opset imports)")
    for what, t in _proto_tensors(proto.graph):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = dict((e.key, e.value) for e in t.external_data)
            loc = info.get("location", "")
            f = p.parent / loc
            if not f.is_file():
                raise OrtleanError(f"{p}: external data file {loc!r} of {what} is missing")
            try:
                end = int(info.get("offset", 0)) + int(info["length"]) if "length" in info else None
            except ValueError:
                raise OrtleanError(f"{p}: {what}: bad external data offset/length {info}") from None
            if end is not None and end > f.stat().st_size:
                raise OrtleanError(f"{p}: external data file {loc!r} ends at byte {f.stat().st_size}, {what} "
                                   f"needs bytes up to {end} (truncated?)")
    try:
        model = ir.serde.deserialize_model(proto)
        ir.external_data.set_base_dir(model.graph, p.parent)   # initializers and attribute tensors
    except Exception as e:
        raise OrtleanError(f"{p}: corrupt ONNX model ({type(e).__name__}: {e})") from None
    # onnx-ir refuses, when it first reads a tensor, external data outside the model's directory
    # (a path or a symlink leading out) or hard-linked: ask it now, while the error can name the file
    for what, owner, t in external_tensors(model):
        if hasattr(t, "_check_path_containment"):
            try:
                t._check_path_containment()
            except ValueError as e:
                raise OrtleanError(f"{p}: external data of {what} refused: {e}") from None
    return model


def _proto_tensors(graph: onnx.GraphProto):
    """(description, TensorProto) of every tensor a graph proto holds: initializers and node
    attribute tensors (a Constant's ``value``, ``TENSORS`` attributes), subgraphs included."""
    for t in graph.initializer:
        yield f"initializer {t.name!r}", t
    for n in graph.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                yield f"attribute {a.name!r} of node {n.name!r} ({n.op_type})", a.t
            elif a.type == onnx.AttributeProto.TENSORS:
                for t in a.tensors:
                    yield f"attribute {a.name!r} of node {n.name!r} ({n.op_type})", t
            elif a.type == onnx.AttributeProto.GRAPH:
                yield from _proto_tensors(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _proto_tensors(g)


def _proto_nodes(graph: onnx.GraphProto):
    """(graph, node) of every node of a graph proto, subgraphs included."""
    for n in graph.node:
        yield graph, n
        for a in n.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else
                      a.graphs if a.type == onnx.AttributeProto.GRAPHS else []):
                yield from _proto_nodes(g)


def external_tensors(model: ir.Model):
    """(description, owner, tensor) of every tensor of ``model`` whose data is in an external data
    file, subgraphs included: ``owner`` is the initializer's ``ir.Value``, or ``(node, attribute
    name, index)`` for a node attribute tensor (a Constant's ``value``: optimum writes large
    constants to external data too; ``index`` into a TENSORS attribute, else None)."""
    for g in model.graphs():
        for v in g.initializers.values():
            if isinstance(v.const_value, ir.ExternalTensor):
                yield f"initializer {v.name!r}", v, v.const_value
        for n in g:
            for a in n.attributes.values():
                if a.is_ref():
                    continue
                what = f"attribute {a.name!r} of node {n.name!r} ({n.op_type})"
                if a.type == ir.AttributeType.TENSOR and isinstance(a.value, ir.ExternalTensor):
                    yield what, (n, a.name, None), a.value
                elif a.type == ir.AttributeType.TENSORS and a.value is not None:
                    for i, t in enumerate(a.value):
                        if isinstance(t, ir.ExternalTensor):
                            yield what, (n, a.name, i), t


@contextlib.contextmanager
def replaced_tensors(model: ir.Model, new_tensor, select=None):
    """Within the block, every external tensor of ``model`` (``external_tensors``) for which
    ``select(owner, tensor)`` is true (all when None) is ``new_tensor(tensor)`` instead; the
    model's own tensors (and attributes) are put back after."""
    saved = []
    for _, owner, t in list(external_tensors(model)):
        if select is not None and not select(owner, t):
            continue
        if isinstance(owner, ir.Value):
            saved.append((owner, None, owner.const_value))
            owner.const_value = new_tensor(t)
        else:
            node, name, i = owner
            attr = node.attributes[name]
            value = new_tensor(t) if i is None else tuple(new_tensor(x) if j == i else x for j, x in enumerate(attr.value))
            if not any(s[0] is node and s[1] == name for s in saved):
                saved.append((node, name, attr))
            node.attributes[name] = ir.Attr(name, attr.type, value, doc_string=attr.doc_string)
    try:
        yield model
    finally:
        for owner, name, old in reversed(saved):
            if name is None:
                owner.const_value = old
            else:
                owner.attributes[name] = old


def release_pages(tensor) -> int:
    """Drop this process's resident pages of a memory-mapped external tensor (onnx-ir maps the data
    file when a tensor is first read, and every page read stays resident: reading a 7 GB model's
    weights once makes a 7 GB RSS). The data stays valid — numpy views included — a later read
    faults its pages in again from the page cache. Returns the bytes released (0 for a tensor that
    is not mapped)."""
    raw = getattr(tensor, "raw", None) if isinstance(tensor, ir.ExternalTensor) else None
    if raw is None or getattr(raw, "closed", False) or not hasattr(raw, "madvise"):
        return 0
    page = mmap.PAGESIZE
    start = (int(tensor.offset or 0) // page) * page
    end = min(len(raw), -(-(int(tensor.offset or 0) + tensor.nbytes) // page) * page)
    if end <= start:
        return 0
    try:
        raw.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (OSError, ValueError):
        return 0
    return end - start


def release_all(model: ir.Model) -> int:
    """:func:`release_pages` of every external tensor of ``model``."""
    return sum(release_pages(t) for _, _, t in external_tensors(model))


def _lazy_bytes(t: ir.ExternalTensor) -> ir.LazyTensor:
    """`t` as an in-memory tensor for serialization: its bytes are read from its memory map when
    the proto is written. The map is never released: numpy views the rewrite holds (a planner's
    weight, a new initializer sharing its data) may point into it, and closing it under them is
    `BufferError: cannot close exported pointers exist` (onnx-ir's `load_to_model` does that)."""
    return ir.LazyTensor(lambda: t, dtype=t.dtype, shape=t.shape, name=t.name, doc_string=t.doc_string)


def external_inlined(model: ir.Model, max_bytes: int | None = None):
    """Within the block, every tensor (all graphs) whose data is in an input's external data file
    serializes inline: the initializers of at most `max_bytes` (all when None) and every node
    attribute tensor (a Constant's ``value``: the saver writes only initializers to the output's
    external data). The model's tensors are restored after, so untouched tensors stay
    memory-mapped, never loaded into the model."""
    return replaced_tensors(model, _lazy_bytes, lambda owner, t: not isinstance(owner, ir.Value)
                            or max_bytes is None or t.nbytes <= max_bytes)


def serialized(model: ir.Model) -> bytes:
    """The model as a self-contained serialized proto (external data inline) for ORT to run from
    memory; `model` is not changed."""
    with external_inlined(model):
        return ir.serde.serialize_model(model).SerializeToString()


def initializer_bytes(model: ir.Model) -> int:
    total = 0
    for v in model.graph.initializers.values():
        if v.const_value is not None:
            total += v.const_value.nbytes
    return total


def save_model_atomic(model: ir.Model, out_path: str | os.PathLike, *, input_path: str | os.PathLike | None = None,
                      check=None) -> list[Path]:
    """Save next to `out_path` in a temporary directory, run `check(tmp_model_path)` on it, then
    rename into place (data file first, model last). Never writes over the input model or its
    external data; a failed check leaves nothing behind."""
    out = Path(out_path).resolve()
    if input_path is not None:
        inp = Path(input_path).resolve()
        if out == inp:
            raise OrtleanError(f"{out}: output would overwrite the input model; choose another --output")
        input_data = {Path(inp.parent, loc).resolve() for loc in _external_locations(inp)}
    else:
        input_data = set()
    out.parent.mkdir(parents=True, exist_ok=True)
    large = initializer_bytes(model) > EXTERNAL_DATA_THRESHOLD
    data_name = out.name + ".data" if large else None
    if data_name and (out.parent / data_name).resolve() in input_data:
        raise OrtleanError(f"{out.parent / data_name}: would overwrite the input's external data")
    tmpdir = Path(tempfile.mkdtemp(prefix=".ortlean-", dir=out.parent))
    written: list[Path] = []
    try:
        tmp_model = tmpdir / out.name
        # the output must not point at the input's files: tensors still memory-mapped from the
        # input's external data go inline (or, large, are copied into the output's data file)
        with external_inlined(model, None if data_name is None else INLINE_TENSOR_BYTES):
            if data_name is None:
                ir.save(model, tmp_model)
            else:
                ir.save(model, tmp_model, external_data=data_name, size_threshold_bytes=INLINE_TENSOR_BYTES)
        if check is not None:
            check(tmp_model)
        if data_name:
            os.replace(tmpdir / data_name, out.parent / data_name)
            written.append(out.parent / data_name)
        elif (out.parent / (out.name + ".data")).exists() and (out.parent / (out.name + ".data")).resolve() not in input_data:
            # a stale data file from an earlier large save would mislead: remove it
            (out.parent / (out.name + ".data")).unlink()
        os.replace(tmp_model, out)
        written.insert(0, out)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return written


def _external_locations(path: Path) -> set[str]:
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception:
        return set()
    locs = set()
    for _, t in _proto_tensors(proto.graph):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            for e in t.external_data:
                if e.key == "location":
                    locs.add(e.value)
    return locs


def default_output(model: str) -> str:
    p = Path(model)
    return str(p.with_name(p.stem + ".lean.onnx"))


SIDECARS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "config.json",
            "generation_config.json", "vocab.txt", "ortlean.json", "genai_config.json")


def copy_sidecars(inp: Path, out: Path) -> list[Path]:
    """Tokenizer/config files next to the input go next to the output too (when it is another
    directory and they are not there yet), so eval/generate work on the rewritten model alone."""
    copied = []
    if inp.resolve().parent == out.resolve().parent:
        return copied
    for name in SIDECARS:
        src, dst = inp.parent / name, out.parent / name
        if src.is_file() and not dst.exists():
            shutil.copy2(src, dst)
            copied.append(dst)
    return copied


def check(path: Path, out: Path) -> None:
    """onnx.checker on the saved file (a path handles external data and > 2 GB models). The
    custom domain has no schemas, so the checker validates the graph and the standard nodes."""
    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as e:
        if not any(f"No Op registered for {op} " in str(e) for op in ORT_ONNX_DOMAIN_OPS):
            raise OrtleanError(f"{out}: rewritten model fails onnx.checker: {e}") from None
        # ONNX Runtime registers a few contrib ops in the ONNX domain (the fused graph's and the genai
        # builder's SimplifiedLayerNormalization): check the rest with those nodes in a schema-less domain
        proto = onnx.load(str(path), load_external_data=False)
        for n in proto.graph.node:
            if n.domain in ("", "ai.onnx") and n.op_type in ORT_ONNX_DOMAIN_OPS:
                n.domain = "com.microsoft"
        if not any(o.domain == "com.microsoft" for o in proto.opset_import):
            proto.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
        # checked as a file beside `path`: the checker finds external data relative to the model's
        # directory (a proto in memory would be checked against the working directory)
        twin = Path(path).with_name(f".check-{Path(path).name}")
        try:
            onnx.save(proto, str(twin))
            onnx.checker.check_model(str(twin))
        except onnx.checker.ValidationError as e2:
            raise OrtleanError(f"{out}: rewritten model fails onnx.checker: {e2}") from None
        finally:
            twin.unlink(missing_ok=True)


# contrib ops ONNX Runtime registers in the ONNX domain (no onnx schema: onnx.checker does not know them)
ORT_ONNX_DOMAIN_OPS = ("SimplifiedLayerNormalization",)


def model_io(model: ir.Model, path=None):
    """`custom_ops.runtime.ModelIO` of a loaded model (what `ModelIO.from_model` reads from its
    file, without parsing the file again; `path` resolves a genai builder model's symbolic KV dims)."""
    from custom_ops.runtime import ModelIO

    inits = model.graph.initializers

    def sig(v: ir.Value):
        shape = [] if v.shape is None else [d.value if isinstance(d, ir.SymbolicDim) else int(d) for d in v.shape]
        return v.name, shape, (v.dtype.numpy().type if v.dtype is not None else np.float32)

    return ModelIO.from_signature([sig(v) for v in model.graph.inputs if v.name not in inits],
                                  [sig(v) for v in model.graph.outputs]).resolve_dims(path)


def max_positions(model_path: Path) -> int | None:
    """``max_position_embeddings`` of the ``config.json`` beside the model (None without one)."""
    cfg = Path(model_path).parent / "config.json"
    try:
        v = json.loads(cfg.read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return int(v) if isinstance(v, int) and v > 0 else None
