"""Runtime face of ortlean: find and register the custom-op library, read its metrics.

    import custom_ops
    sess = custom_ops.session("model.lean.onnx", threads=2)
    sess.run(None, feeds)
    custom_ops.metrics()   # {node_name: {"tt.rank": 64.0, ...}}
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
import threading
from pathlib import Path

DOMAIN = "ai.ortlean"
LIB_NAME = "libortlean_ops.so"

__all__ = [
    "DOMAIN", "LibraryNotFoundError", "library_path", "load_library", "session_options",
    "session", "metrics", "reset_metrics", "isa", "op_isas", "isa_label", "op_schema", "prompt_continues",
]


class LibraryNotFoundError(RuntimeError):
    pass


def _candidates() -> list[Path]:
    out: list[Path] = []
    here = Path(__file__).resolve().parent
    out.append(here / LIB_NAME)
    # scikit-build-core editable installs put compiled files in site-packages/custom_ops
    # while the Python sources stay in the checkout: ask the installed distribution.
    try:
        from importlib.metadata import distribution

        dist = distribution("ortlean")
        for f in dist.files or []:
            if f.name == LIB_NAME:
                out.append(Path(dist.locate_file(f)).resolve())
    except Exception:  # not installed as a distribution: only the paths above
        pass
    for p in sys.path:
        out.append(Path(p) / "custom_ops" / LIB_NAME)
    return out


def library_path() -> str:
    """Absolute path of the built custom-op library (ORTLEAN_LIBRARY overrides: when set, it must name
    the file, or this raises: a silent fallback to another build would mislabel an A/B run)."""
    env = os.environ.get("ORTLEAN_LIBRARY")
    if env:
        if not Path(env).is_file():
            raise LibraryNotFoundError(f"ORTLEAN_LIBRARY={env}: no such file (unset it to use the installed library)")
        return str(Path(env))
    tried = []
    for c in _candidates():
        if c.is_file():
            return str(c)
        tried.append(str(c))
    raise LibraryNotFoundError(
        f"ortlean custom-op library {LIB_NAME} not found (tried: {', '.join(dict.fromkeys(tried))}). "
        "Build it with `pip install -e .` in the ortlean checkout, or point ORTLEAN_LIBRARY at it; "
        "without a compiler use custom_ops.session(model, backend='reference')."
    )


_LIB: ctypes.CDLL | None = None


def _preload_blas() -> None:
    # The library links libscipy_openblas.so (DT_NEEDED, rpath into site-packages); loading it
    # here first makes the dynamic linker find it whatever the install layout.
    try:
        import scipy_openblas32

        lib = Path(scipy_openblas32.get_lib_dir()) / f"lib{scipy_openblas32.get_library()}.so"
        if lib.is_file():
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except Exception:
        pass


def load_library() -> ctypes.CDLL:
    """dlopen the library in this process (same handle ORT gets), for the metrics C API."""
    global _LIB
    if _LIB is None:
        _preload_blas()
        lib = ctypes.CDLL(library_path(), mode=ctypes.RTLD_GLOBAL)
        lib.ortlean_metrics_json.restype = ctypes.c_size_t
        lib.ortlean_metrics_json.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        lib.ortlean_metrics_reset.restype = None
        lib.ortlean_metrics_reset.argtypes = []
        lib.ortlean_isa.restype = ctypes.c_char_p
        lib.ortlean_isa.argtypes = []
        if hasattr(lib, "ortlean_prompt_continues"):   # a library older than the flag has none
            lib.ortlean_prompt_continues.restype = ctypes.c_int
            lib.ortlean_prompt_continues.argtypes = [ctypes.c_int]
        _LIB = lib
    return _LIB


def session_options(threads: int | None = None, *, backend: str = "native", so=None, **config):
    """onnxruntime.SessionOptions with the ortlean ops registered.

    backend="native" registers the C++ library; backend="reference" registers the numpy
    references as onnxruntime-extensions Python ops (slow; no compiler needed).
    backend="auto" is native when the library is found, else reference.
    Extra keyword arguments become session config entries (`ortlean.<key>`)."""
    import onnxruntime as ort

    backend = resolve_backend(backend)

    so = so or ort.SessionOptions()
    if threads is not None:
        so.intra_op_num_threads = int(threads)
        so.inter_op_num_threads = 1
    for k, v in config.items():
        so.add_session_config_entry(f"ortlean.{k}", str(v))
    if backend == "native":
        load_library()
        so.register_custom_ops_library(library_path())
    elif backend == "reference":
        from .reference import ext

        ext.register()
        so.register_custom_ops_library(ext.library_path())
    else:
        raise ValueError(f"unknown backend {backend!r}: use 'native' or 'reference'")
    return so


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        try:
            library_path()
            return "native"
        except LibraryNotFoundError:
            return "reference"
    return backend


def session(model, threads: int | None = None, *, backend: str = "native", providers=None, so=None, **config):
    """onnxruntime.InferenceSession on `model` (path or bytes) with the ortlean ops registered."""
    import onnxruntime as ort

    backend = resolve_backend(backend)
    so = session_options(threads, backend=backend, so=so, **config)
    if isinstance(model, Path):
        model = str(model)
    if backend == "reference":
        from .reference import ext

        model, data_dir = ext.prepare(model)
        if data_dir:
            so.add_session_config_entry("session.model_external_initializers_file_folder_path", data_dir)
    return ort.InferenceSession(model, sess_options=so, providers=providers or ["CPUExecutionProvider"])


_THREAD = threading.local()   # the reference backend's copy of the flag (its ops run on the calling thread)


def continuing() -> bool:
    """Whether this thread's runs are in :func:`prompt_continues` (the reference op reads it)."""
    return bool(getattr(_THREAD, "continues", False))


@contextlib.contextmanager
def prompt_continues(more: bool = True):
    """Runs of this thread inside the block are chunks of a prompt that a later run continues: their
    last rows are not where a reply is read, so PackedAttention's sparse prefill gives them no exact
    tail (``prefill_tail``: only the prompt's own last rows pay it — at 16k tokens in 512-token runs the
    chunks' tails were about as many keys as the sparse rows). ``more`` False: a plain block. ORT runs a
    session's nodes on the thread that called ``run`` (sequential execution), where the flag lives;
    nested blocks restore the outer value. The drivers (``runtime.SharedKV.prefill``, ``generate``,
    ``ortlean bench --prompt``, ``eval --task needle``) set it on every chunk but the last.

        with custom_ops.prompt_continues():
            sess.run(None, first_chunk)
        sess.run(None, last_chunk)         # its last rows: the exact tail
    """
    old_py = continuing()
    if old_py == bool(more):   # already so on this thread (every decode step): nothing to set
        yield
        return
    try:
        fn = load_library().ortlean_prompt_continues
    except (LibraryNotFoundError, OSError, AttributeError):
        fn = None
    old = fn(1 if more else 0) if fn is not None else None
    _THREAD.continues = bool(more)
    try:
        yield
    finally:
        _THREAD.continues = old_py
        if fn is not None:
            fn(old)


def metrics() -> dict[str, dict[str, float]]:
    """Runtime metrics of every ortlean node run in this process, keyed by node name."""
    lib = load_library()
    need = lib.ortlean_metrics_json(None, 0)
    buf = ctypes.create_string_buffer(need + 1)
    lib.ortlean_metrics_json(buf, need + 1)
    return json.loads(buf.value.decode() or "{}")


def reset_metrics() -> None:
    load_library().ortlean_metrics_reset()


def isa() -> str:
    """The kernel ISA path chosen at load time: scalar | avx2 | avx512."""
    return load_library().ortlean_isa().decode()


def op_isas() -> dict[str, str]:
    """{op type: the ISA level its kernels run at on this CPU}: isa(), lowered for an op whose copy at
    that level needs a CPU feature the CPU lacks (PackedAttention's AVX-512 copy needs AVX512_VPOPCNTDQ
    and AVX512_VNNI, its AVX2 copy POPCNT). A node's popcnt attribute may lower it further (its
    pack.popcnt metric). Empty for a library older than this call."""
    from custom_ops import schema

    fn = getattr(load_library(), "ortlean_op_isa", None)
    if fn is None:
        return {}
    fn.restype = ctypes.c_char_p
    fn.argtypes = [ctypes.c_char_p]
    out = {}
    for t in schema.op_types():
        v = fn(t.encode())
        if v is None:
            raise RuntimeError(f"{library_path()}: op type {t} has no ISA (a library without it?)")
        out[t] = v.decode()
    return out


def isa_label() -> str:
    """isa() for figures' labels, with the op types that run lower named, e.g. "avx512
    (PackedAttention avx2)": a figure's ISA is its kernels'."""
    base = isa()
    lower = {t: v for t, v in op_isas().items() if v != base}
    return base + (f" ({', '.join(f'{t} {v}' for t, v in lower.items())})" if lower else "")


def op_schema() -> dict[str, dict]:
    """The attribute defaults the native kernels use: {op_type: {attr: default}} (attributes
    without a default are omitted; a float default of NaN, "not measured", is None)."""
    fn = load_library().ortlean_op_schema_json  # bound here: a library older than this call still loads
    fn.restype = ctypes.c_char_p
    fn.argtypes = []
    return json.loads(fn().decode())
