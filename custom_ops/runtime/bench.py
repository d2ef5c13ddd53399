"""Timing sessions: prefill/decode latency of whole models compared in one process, interleaved."""
from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from custom_ops import prompt_continues

from .io import ModelIO, feeds, run, token_range
from .shared_kv import PREFILL_CHUNK

# benchmarking
# An idle intra-op pool keeps its workers spinning for tens of milliseconds after a Run (~30-40 ms with
# ORT 1.32 on a 2-vCPU VM, tests/bench/pool_spin.py: the process's other threads busy 1.05 of a 30 ms
# sleep after a Run, 0.31 of a 100 ms one, 0.16 of a 200 ms one). In a process with several sessions, a session timed soon after another shares
# the cores with that session's spinning workers: 2-thread rows came out bimodal (two sessions of one
# model 203 / 125 tok/s) and 2-thread GroupQueryAttention timed at 2x its 1-thread time. So a harness
# pauses SETTLE_S before it switches sessions when more than one thread runs.
SETTLE_S = 0.1


def settle(threads: int | None) -> None:
    """Wait until the other sessions' intra-op pools stop spinning (``threads`` != 1: 0 or None = the
    default pool, as wide as the machine)."""
    if threads != 1:
        time.sleep(SETTLE_S)


def session_threads(sess) -> int:
    """intra_op_num_threads of an onnxruntime session (0: ORT's default, every core)."""
    try:
        return int(sess.get_session_options().intra_op_num_threads)
    except AttributeError:
        return 0


def _stats(samples_s: list[float]) -> dict:
    a = np.asarray(samples_s, dtype=np.float64) * 1e3
    return {"median_ms": float(np.median(a)), "p10_ms": float(np.percentile(a, 10)),
            "p90_ms": float(np.percentile(a, 90)), "mean_ms": float(a.mean()), "n": int(a.size)}


def bench_sessions(sessions: Mapping[str, Any], io: ModelIO, prefill_len: int = 128,
                   decode_past: int = 128, decode_steps: int = 16, repeats: int = 7,
                   warmup: int = 2, short_len: int = 16, batch: int = 1, seed: int = 0,
                   baseline: str | None = None, vocab_size: int | None = None,
                   progress: bool = False, ios: Mapping[str, ModelIO] | None = None) -> dict:
    """Time the sessions (same model interface, e.g. dense vs rewritten) on the same inputs.

    Causal LM: prefill latency of ``prefill_len`` tokens from an empty cache, and decode step
    latency — ``decode_steps`` single-token runs starting from a cache of ``decode_past`` tokens
    that the session itself built (untimed), the cache growing as in generation.
    Encoder: latency of one ``prefill_len``-token sequence and of a ``short_len`` one.

    After ``warmup`` untimed rounds, each of ``repeats`` rounds runs every session once per
    measurement, round-robin (the order rotates every round) so drift hits all alike; each timed
    prefill follows an untimed one of the same session (other sessions' pools stop spinning). Reports
    per session the median / p10 / p90 (over rounds for prefill; over all steps for decode),
    tokens/s from the median, and ratios vs ``baseline`` (default: "dense" if present, else the
    first session): ``speedup = baseline_median / session_median``. Token ids are random
    (seeded) below ``vocab_size`` (default: the logits width; 100 when unknown, e.g. encoders)."""
    names = list(sessions)
    if not names:
        raise ValueError("no sessions")
    # per-session interface (a rewritten model may carry extra cache states, e.g. key_bits)
    ios = {n: (ios or {}).get(n, io) for n in names}
    baseline = baseline or ("dense" if "dense" in sessions else names[0])
    rng = np.random.default_rng(seed)
    lo, hi = token_range(max(int(vocab_size or io.vocab_size or 100), 2))
    long_ids = rng.integers(lo, hi, size=(batch, prefill_len), dtype=np.int64)
    short_ids = rng.integers(lo, hi, size=(batch, short_len), dtype=np.int64)
    past_ids = rng.integers(lo, hi, size=(batch, decode_past), dtype=np.int64)
    step_ids = rng.integers(lo, hi, size=(batch, decode_steps), dtype=np.int64)
    causal = io.kind == "causal-lm"

    results: dict[str, dict[str, list[float]]] = {n: defaultdict(list) for n in names}
    init_state: dict[str, tuple[dict, int]] = {}
    if causal and io.has_past and decode_steps > 0:
        for n in names:
            out = run(sessions[n], ios[n], feeds(ios[n], past_ids))
            init_state[n] = (ios[n].next_state(out), decode_past)

    def t_prefill(n, ids):
        f = feeds(ios[n], ids)
        t0 = time.perf_counter()
        sessions[n].run(None, f)
        return time.perf_counter() - t0

    def t_decode(n) -> list[float]:
        past, plen = init_state[n]
        times = []
        for s in range(decode_steps):
            f = feeds(ios[n], step_ids[:, s: s + 1], past, plen)
            t0 = time.perf_counter()
            out = run(sessions[n], ios[n], f)
            times.append(time.perf_counter() - t0)
            past, plen = ios[n].next_state(out), plen + 1
        return times

    rounds = range(warmup + repeats)
    if progress:
        from tqdm import tqdm

        rounds = tqdm(rounds, desc="bench", unit="round", leave=False)
    for r in rounds:
        k = r % len(names)
        order = names[k:] + names[:k]
        timed = r >= warmup
        for n in order:
            if timed and len(names) > 1:
                # untimed run first: the previous session's intra-op threads spin for a while after
                # its Run and, with > 1 thread on few cores, would compete with this timed one
                # (measured: SmolLM2 prefill at 2 threads 0.78-0.85x in a tight interleave where
                # the per-op ORT profile gives 0.93x); and a pause for them to stop (settle)
                settle(session_threads(sessions[n]))
                t_prefill(n, long_ids)
            dt = t_prefill(n, long_ids)
            if timed:
                results[n]["prefill"].append(dt)
        if causal:
            if init_state:
                for n in order:
                    ts = t_decode(n)
                    if timed:
                        results[n]["decode"].extend(ts)
        else:
            for n in order:
                if timed and len(names) > 1:
                    settle(session_threads(sessions[n]))
                    t_prefill(n, short_ids)  # untimed: see above
                dt = t_prefill(n, short_ids)
                if timed:
                    results[n]["short"].append(dt)

    report: dict[str, Any] = {
        "kind": io.kind, "baseline": baseline,
        "params": {"prefill_len": prefill_len, "decode_past": decode_past, "decode_steps": decode_steps,
                   "repeats": repeats, "warmup": warmup, "short_len": short_len, "batch": batch},
        "sessions": {},
    }
    for n in names:
        row: dict[str, Any] = {}
        if results[n]["prefill"]:
            st = _stats(results[n]["prefill"])
            row["prefill"] = st
            row["prefill_tok_s"] = batch * prefill_len / (st["median_ms"] / 1e3)
        if results[n]["decode"]:
            st = _stats(results[n]["decode"])
            row["decode"] = st
            row["decode_tok_s"] = batch / (st["median_ms"] / 1e3)
        if results[n]["short"]:
            row["short"] = _stats(results[n]["short"])
        report["sessions"][n] = row
    base = report["sessions"][baseline]
    report["ratios"] = {}
    for n in names:
        rr = {}
        for key in ("prefill", "decode", "short"):
            if key in base and key in report["sessions"][n]:
                rr[key] = base[key]["median_ms"] / report["sessions"][n][key]["median_ms"]
        report["ratios"][n] = rr
    return report




def time_sessions(sessions: dict, feeds: dict | None, min_time: float = 0.15, max_reps: int = 400, warmup: int = 3,
                  feeds_of: Mapping[str, dict] | None = None) -> dict[str, float]:
    """Median seconds per run for each session, runs interleaved so drift hits all alike. Every
    session runs ``feeds``, or ``feeds_of[name]`` when given (sessions with different inputs)."""
    fd = {k: (feeds_of[k] if feeds_of is not None else feeds) for k in sessions}
    for k, s in sessions.items():
        for _ in range(warmup):
            s.run(None, fd[k])
    times = {k: [] for k in sessions}
    t_start = time.perf_counter()
    reps = 0
    while reps < max_reps and (reps < 5 or time.perf_counter() - t_start < min_time * len(sessions)):
        for k, s in sessions.items():
            t0 = time.perf_counter()
            s.run(None, fd[k])
            times[k].append(time.perf_counter() - t0)
        reps += 1
    return {k: float(np.median(v)) for k, v in times.items()}


def time_cpu(sessions: dict, feeds: dict, reps: int = 25, warmup: int = 3) -> dict[str, float]:
    """Median process CPU seconds per run, sessions interleaved (single-threaded sessions: the CPU
    time of this process is the kernel's; a run preempted on a busy machine does not inflate it)."""
    for s in sessions.values():
        for _ in range(warmup):
            s.run(None, feeds)
    times = {k: [] for k in sessions}
    for _ in range(reps):
        for k, s in sessions.items():
            c0 = time.process_time()
            s.run(None, feeds)
            times[k].append(time.process_time() - c0)
    return {k: float(np.median(v)) for k, v in times.items()}


# --------------------------------------------------------------------------- rows of a comparison table
# Three ways a row is driven; each has prefill(ids) -> seconds and decode(past, step_ids) -> [seconds].
class LoopRow:
    """This package's loop on a plain session: feeds with past_key_values.*, the presents (new
    arrays, the cache copied) fed back — what a user's InferenceSession loop does."""

    def __init__(self, sess, io: ModelIO, states: dict):
        self.sess, self.io, self.states = sess, io, states

    def prefill(self, ids) -> float:
        f = feeds(self.io, ids)
        self.sess.run(None, f)  # untimed first: another session's spinning pool must not steal the cores
        t0 = time.perf_counter()
        self.sess.run(None, f)
        return time.perf_counter() - t0

    def decode(self, p: int, step_ids) -> list[float]:
        past, plen, out_t = self.states[p], p, []
        for s in range(step_ids.shape[1]):
            f = feeds(self.io, step_ids[:, s: s + 1], past, plen)
            t0 = time.perf_counter()
            out = run(self.sess, self.io, f)
            out_t.append(time.perf_counter() - t0)
            past, plen = self.io.next_state(out), plen + 1
        return out_t


class SharedRow:
    """``shared_kv.SharedKV`` on the same session: past and present bound to one buffer per layer
    (GroupQueryAttention graphs only)."""

    def __init__(self, sess, io: ModelIO, states: dict, steps: int, prefill_len: int):
        from .shared_kv import SharedKV

        self.kv = {p: SharedKV(sess, io, max_len=p + steps) for p in states}
        for p, st in states.items():
            self.kv[p].fill(p, st)
        self.kv_prefill = SharedKV(sess, io, max_len=prefill_len)

    def prefill(self, ids) -> float:
        self.kv_prefill.prefill(ids)  # untimed first (see LoopRow.prefill)
        t0 = time.perf_counter()
        self.kv_prefill.prefill(ids)
        return time.perf_counter() - t0

    def decode(self, p: int, step_ids) -> list[float]:
        kv = self.kv[p]
        kv.length = p  # rows beyond the length are masked by seqlens_k; the cache itself is unchanged
        out_t = []
        for s in range(step_ids.shape[1]):
            t0 = time.perf_counter()
            kv.step(step_ids[:, s: s + 1])
            out_t.append(time.perf_counter() - t0)
        return out_t


class OgRow:
    """onnxruntime_genai's own generator on a genai builder model directory (append_tokens /
    generate_next_token, greedy, its shared KV buffers)."""

    def __init__(self, model_dir, threads: int, past_ids: dict, steps: int, rounds: int):
        import onnxruntime_genai as og

        self.og = og
        cfg = og.Config(str(model_dir))
        cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
        self.model = og.Model(cfg)
        self.past_ids, self.steps, self.rounds = past_ids, steps, rounds
        self.gens: dict[int, object] = {}
        self.used: dict[int, int] = {}    # tokens in each past's generator
        gc = Path(model_dir) / "genai_config.json"
        ctx = json.loads(gc.read_text()).get("model", {}).get("context_length") if gc.is_file() else None
        self.max_len = int(ctx) if ctx else None  # og refuses a max_length beyond the model's context_length

    def _gen(self, max_length: int):
        p = self.og.GeneratorParams(self.model)
        p.set_search_options(max_length=max_length, do_sample=False)
        return self.og.Generator(self.model, p)

    @staticmethod
    def append(g, ids, chunk: int = PREFILL_CHUNK) -> None:
        """``ids`` appended to generator ``g`` ``chunk`` tokens at a time (og's logits of a whole 32k
        past: 20 GB at Qwen's vocabulary)."""
        ids = np.asarray(ids).reshape(-1).astype(np.int32)
        for c0 in range(0, ids.size, int(chunk)):
            g.append_tokens(ids[c0:c0 + int(chunk)])

    def prefill(self, ids) -> float:
        ids = np.asarray(ids).reshape(-1).astype(np.int32)
        self._gen(ids.size + 4).append_tokens(ids)
        g = self._gen(ids.size + 4)
        t0 = time.perf_counter()
        g.append_tokens(ids)
        return time.perf_counter() - t0

    def decode(self, p: int, step_ids) -> list[float]:
        # one generator per past length, built once (untimed) and continued: its past grows by
        # `steps` tokens per round, and is rewound to the past's length when the model's context is full
        n = step_ids.shape[1]
        cap = p + self.steps * (self.rounds + 2) + 2
        cap = min(cap, self.max_len) if self.max_len else cap
        past = np.asarray(self.past_ids[p]).reshape(-1).astype(np.int32)
        if p in self.gens and self.used[p] + n > cap and hasattr(self.gens[p], "rewind_to"):
            # no room left for this round's steps (a past near the context length): back to the past's
            # length (og >= 0.6 rewinds its shared-buffer cache by its length alone), untimed
            # (to one token short of it: og keeps the pending next token and appends it on the first step)
            self.gens[p].rewind_to(past.size - 1)
            self.used[p] = past.size
        if p not in self.gens or self.used[p] + n > cap:
            # new, or no room left and no rewind: built again (a prefill of the whole past), untimed
            g = self._gen(cap)
            self.append(g, past)
            self.gens[p], self.used[p] = g, past.size
        self.used[p] += n
        g, out = self.gens[p], []
        for _ in range(n):
            t0 = time.perf_counter()
            g.generate_next_token()
            out.append(time.perf_counter() - t0)
        return out


class PastStore:
    """The long pasts' caches of a bench run, by the token ids they were built from: in memory for the
    run (every thread count's table reuses them) and, with ``root``, on disk under
    ``root/<stamp>/`` — one ``.npy`` per state and a ``meta.json`` — stamped by ``parts`` (the building
    model's file stamp) and the ids, so a later run with the same model and ids loads the cache instead
    of prefilling 32k tokens again (13 min for Qwen2.5-1.5B on two cores). Values do not change a
    step's cost; the stamp only keeps caches of other models and token sequences apart. An entry is
    written to a temporary directory and renamed; an unreadable one is a miss; nothing is written when
    the disk would keep less than ``keep_free`` bytes free (``skipped`` says so)."""

    def __init__(self, root=None, parts: Mapping | None = None, keep_free: int = 2 << 30):
        self.root = Path(root) if root else None
        self.parts = dict(parts or {})
        self.keep_free = keep_free
        self.mem: dict = {}
        self.skipped: list[str] = []

    @staticmethod
    def _key(ids) -> tuple:
        ids = np.asarray(ids)
        return ids.shape, hash(ids.tobytes())

    def in_memory(self, ids) -> bool:
        return self._key(ids) in self.mem

    def _dir(self, ids) -> Path:
        import hashlib

        ids = np.ascontiguousarray(np.asarray(ids, dtype=np.int64))
        h = hashlib.sha256(json.dumps(self.parts, sort_keys=True, default=str).encode())
        h.update(str(ids.shape).encode() + ids.tobytes())
        return self.root / h.hexdigest()[:24]

    def get(self, ids) -> dict | None:
        key = self._key(ids)
        if key in self.mem:
            return self.mem[key]
        if self.root is None:
            return None
        d = self._dir(ids)
        try:
            meta = json.loads((d / "meta.json").read_text())
            kv = {name: np.load(d / f"{i}.npy") for i, name in enumerate(meta["states"])}
        except (OSError, ValueError, KeyError):
            return None
        self.mem[key] = kv
        return kv

    def put(self, ids, kv: Mapping[str, np.ndarray]) -> None:
        import shutil
        import tempfile

        self.mem[self._key(ids)] = kv
        if self.root is None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        need = sum(a.nbytes for a in kv.values())
        if shutil.disk_usage(self.root).free - need < self.keep_free:
            self.skipped.append(f"past {np.asarray(ids).shape[-1]}: not kept in {self.root} ({need >> 20} MiB "
                                f"would leave less than {self.keep_free >> 30} GiB free)")
            return
        d = self._dir(ids)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))
        try:
            names = list(kv)
            for i, name in enumerate(names):
                np.save(tmp / f"{i}.npy", np.ascontiguousarray(kv[name]))
            (tmp / "meta.json").write_text(json.dumps({"states": names, "parts": self.parts,
                                                       "tokens": int(np.asarray(ids).shape[-1])}, default=str))
            if d.exists():
                shutil.rmtree(d)
            tmp.rename(d)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def chunked_state(sess, io: ModelIO, ids, chunk: int = 512) -> dict[str, np.ndarray]:
    """The cache after ``ids`` [1, T], prefilled ``chunk`` tokens at a time (the growing-state loop:
    bounded attention scratch at long pasts)."""
    ids = np.asarray(ids)
    past, plen = None, 0
    for c0 in range(0, ids.shape[1], chunk):
        part = ids[:, c0:c0 + chunk]
        with prompt_continues(c0 + chunk < ids.shape[1]):   # the prompt's last rows: the exact tail
            past = io.next_state(run(sess, io, feeds(io, part, past, plen)))
        plen += part.shape[1]
    return past


class FixedPast:
    """Decode steps each after the same cached past, in the shared-KV loop (``shared_kv.SharedKV``, the
    driver of ``ortlean bench``'s rows and ``ortlean generate``): ``past`` random tokens (seeded; below the
    vocabulary, the special tokens of a big one skipped) cached by the session itself — one prefill run,
    or ``chunked``: :func:`chunked_state`'s 512-token chunks (bounded scratch at long pasts) — then the
    process's memory moved to 2 MiB pages. :meth:`steps` rewinds the length to ``past`` before each step,
    so every step attends to the same cache (the rows written after it are masked). The scripts that
    time a step's parts (``tests/bench/step_breakdown.py``, ``attn_inmodel.py``) run it."""

    def __init__(self, sess, io: ModelIO, past: int, steps: int, warmup: int = 8, chunked: bool = False,
                 seed: int = 0):
        from .memory import huge_pages_for_process
        from .shared_kv import SharedKV

        self.past, self.warmup = int(past), int(warmup)
        lo, hi = token_range(io.vocab_size)
        self.ids = np.random.default_rng(seed).integers(lo, hi, (1, self.past + self.warmup + int(steps)))
        self.kv = SharedKV(sess, io, max_len=self.past + 1)
        if chunked:
            self.kv.fill(self.past, chunked_state(sess, io, self.ids[:, :self.past]))
        else:
            self.kv.prefill(self.ids[:, :self.past])
        huge_pages_for_process()

    def steps(self, n: int, before=None) -> list[float]:
        """``warmup`` untimed steps, ``before()`` (e.g. resetting the kernels' metrics), then ``n`` timed
        single-token steps (at most the ``steps`` the ids were drawn for); seconds each."""
        p, w = self.past, self.warmup
        if n > self.ids.shape[1] - p - w:
            raise ValueError(f"{n} steps: the ids were drawn for {self.ids.shape[1] - p - w}")
        for s in range(w):
            self.kv.length = p
            self.kv.step(self.ids[:, p + s: p + s + 1])
        if before is not None:
            before()
        out = []
        for s in range(n):
            self.kv.length = p
            t0 = time.perf_counter()
            self.kv.step(self.ids[:, p + w + s: p + w + s + 1])
            out.append(time.perf_counter() - t0)
        return out


def _float_kv(built: Mapping[str, np.ndarray], stem: str):
    """(K, V) float32 of layer ``stem`` in ``built``: its ``.key`` / ``.value``, or the rows of a
    PackedAttention fp32 cache (``.kv`` rows of D + Dv float words, D = Dv, with their ``.key_bits``
    rows: what `ortlean rewrite --weights int4` writes, its GroupQueryAttention made exact
    PackedAttention by --attn-exact); (None, None) when neither is there."""
    from ..reference.attn import cache_bits_words, unpack_kv

    K, V = built.get(f"{stem}.key"), built.get(f"{stem}.value")
    if K is not None and V is not None:
        return K, V
    rows, bits = built.get(f"{stem}.kv"), built.get(f"{stem}.key_bits")
    if rows is None or bits is None or rows.shape[-1] % 2:
        return None, None
    D = rows.shape[-1] // 2
    if bits.shape[-1] not in (cache_bits_words(D, "sign"), cache_bits_words(D, "ternary")):
        return None, None
    return unpack_kv(rows, bits, D, D, "fp32")


def state_from_kv(io: ModelIO, built: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``io``'s cache from ``built`` (a ``past_key_values.N.key`` / ``.value`` float cache, or a
    PackedAttention fp32-row cache): the same arrays where the formats agree, or for PackedAttention's
    cache state (``past_key_values.N.kv`` / ``.key_bits``) the K/V rows quantized and the keys packed
    as the op stores new rows: the K/V format from the state's row width, the key packing from the
    node (``io.key_packing``, when ``io`` came from the model file; else sign / ternary by width)),
    keys divided by the node's ``ksmooth`` when it has one."""
    from ..reference.attn import cache_bits_words, kv_row_words, pack_cache, pq_params

    out, packed = {}, {}  # packed: stem -> (bits, rows), one pack_cache per layer for its two states
    def same_format(name: str) -> bool:  # a PackedAttention state: its layer's .kv rows of the same width
        stem, _, kind = name.rpartition(".")
        if kind in ("kv", "key_bits") and io.key_packing.get(stem, {}).get("mode", "sign") == "pq":
            return False  # another model's key bits are never this codebook's codes
        probe = f"{stem}.kv" if kind in ("kv", "key_bits") else name
        want = io.state_shapes.get(probe, [None])[-1]
        return probe in built and (not isinstance(want, int) or built[probe].shape[-1] == want)

    for name in io.past_to_present:
        if name in built and same_format(name):
            out[name] = built[name]
            continue
        stem, _, kind = name.rpartition(".")
        K, V = _float_kv(built, stem)
        if K is None or V is None or kind not in ("kv", "key_bits"):
            raise KeyError(f"{name}: no {stem}.key / .value in the cache to build it from")
        if stem in packed:
            out[name] = packed[stem][1 if kind == "kv" else 0]
            continue
        D, Dv = K.shape[-1], V.shape[-1]
        rw, bw = io.state_shapes.get(f"{stem}.kv", [None])[-1], io.state_shapes.get(f"{stem}.key_bits", [None])[-1]
        q = next((q for q in ("int8", "int4", "fp32") if kv_row_words(D, Dv, q) == rw), None)
        if q is None:
            raise KeyError(f"{stem}.kv: row width {rw} is no K/V format of head dims {D}/{Dv}")
        spec = io.key_packing.get(stem)
        if spec and spec.get("ksmooth"):  # key smoothing: the op stores K / s (s commutes with the rotation)
            K = (K * (np.float32(1) / np.asarray(spec["ksmooth"], np.float32).reshape(K.shape[1], 1, D))
                 ).astype(np.float32)
        if spec:  # the node's own packing (from_session(model_path)): pq codebooks, eps
            mode, eps = spec["mode"], spec["eps"]
            pq = pq_params(spec["pq_book"], spec["pq_dims"], K.shape[1], D) if mode == "pq" else None
            packed[stem] = pack_cache(K, V, q, mode, eps, spec["eps_heads"] or None, pq)
        else:
            mode = next((m for m in ("sign", "ternary") if cache_bits_words(D, m) == bw), None)
            if mode is None:
                raise KeyError(f"{stem}.key_bits: row width {bw} is no key-bits format of head dim {D}")
            packed[stem] = pack_cache(K, V, q, mode, 0.0 if mode == "sign" else 1e-4)
        out[name] = packed[stem][1 if kind == "kv" else 0]
    return out


def bench_ids(vocab: int, pasts, prefill_len: int, steps: int, seed: int = 0):
    """The token ids of a :func:`decode_table` run: (prefill [1, prefill_len], {past: [1, past]},
    steps [1, steps]), random in [100, vocab) for big vocabularies (past the special tokens). The
    same arguments give the same ids — and so the same long pasts' caches in a :class:`PastStore`."""
    rng = np.random.default_rng(seed)
    lo, hi = token_range(vocab)
    prefill_ids = rng.integers(lo, hi, (1, prefill_len))
    past_ids = {p: rng.integers(lo, hi, (1, p)) for p in pasts}
    return prefill_ids, past_ids, rng.integers(lo, hi, (1, steps))


def decode_table(models: Mapping[str, tuple], pasts, prefill_len: int = 128, steps: int = 16, repeats: int = 5,
                 shared: tuple = (), og: Mapping[str, Any] | None = None, threads: int = 1,
                 long_past_from: str | None = None, seed: int = 0, vocab: int | None = None,
                 say=None, own_past: int = 512, huge_pages: bool = True,
                 loop: Iterable[str] | None = None, built: "PastStore | None" = None,
                 extra: Mapping[str, Any] | None = None) -> dict[str, dict]:
    """Prefill and decode timing of several causal LMs in one process, interleaved.

    ``models``: {name: (session, ModelIO)}; rows are every model driven by :class:`LoopRow` (or only
    the names in ``loop``: a model in ``models`` for the long pasts alone is not timed), plus
    "<name> | shared KV" (:class:`SharedRow`) for the names in ``shared`` and "<name> | og"
    (:class:`OgRow`) for ``og`` = {name: genai model directory}, plus ``extra`` = {row: driver}, any
    object with the rows' ``prefill(ids)`` (seconds, or None: no sample) and ``decode(past, step_ids)``
    (a list of step seconds, maybe empty), e.g. :class:`models.peers.LlamaBenchRow` (a process outside
    this one, timed in the same rounds). One warm-up round, then ``repeats``
    rounds, each running every row once (order rotated): a ``prefill_len``-token prefill (after an
    untimed one) and ``steps`` single-token decode steps after a past of each length in ``pasts``.
    Pasts ≤ ``own_past`` are each model's own cache; longer ones are built once by ``long_past_from`` (default
    the first model; a float ``.key`` / ``.value`` cache, prefilled in 512-token chunks) and given to
    every row (:func:`state_from_kv`: PackedAttention's quantized rows and key bits made from it as the
    op stores them; values do not change the cost); ``built``: a :class:`PastStore` that keeps those
    caches by their token ids across calls (another thread count's table reuses them instead of
    prefilling again; with a directory, later runs too). ``huge_pages``: after the warm-up round (every
    row's buffers allocated), the process's resident memory, every row's weights alike, on 2 MiB pages
    (:func:`memory.huge_pages_for_process`). Returns
    {row: {"prefill": ms, "decode<P>": ms}} (medians over rounds / over all steps)."""
    hi = int(vocab or min((io.vocab_size or 100) for _, io in models.values()))
    prefill_ids, past_ids, step_ids = bench_ids(hi, pasts, prefill_len, steps, seed)
    names = list(models)
    src = long_past_from or names[0]
    timed = set(models if loop is None else loop)
    need = timed | set(shared)   # the models whose caches a driver here reads (og builds its own)
    states: dict[str, dict[int, dict]] = {n: {} for n in names}
    for p in pasts:
        if p <= own_past:
            for n, (s, io) in models.items():
                if n in need:
                    states[n][p] = io.next_state(run(s, io, feeds(io, past_ids[p])))
        else:
            t0 = time.perf_counter()
            from_disk = built is not None and built.root is not None and not built.in_memory(past_ids[p])
            kv = None if built is None else built.get(past_ids[p])
            if kv is None:
                s, io = models[src]
                kv = chunked_state(s, io, past_ids[p])
                if built is not None:
                    built.put(past_ids[p], kv)
                if say:
                    say(f"past {p}: cache built by {src} in {time.perf_counter() - t0:.1f} s")
            elif say and from_disk:
                say(f"past {p}: cache loaded from {built.root} in {time.perf_counter() - t0:.1f} s")
            for n, (_, io_n) in models.items():
                if n in need:
                    states[n][p] = state_from_kv(io_n, kv)
    drivers: dict[str, Any] = {n: LoopRow(s, io, states[n]) for n, (s, io) in models.items() if n in timed}
    for n in shared:
        s, io = models[n]
        drivers[f"{n} | shared KV"] = SharedRow(s, io, states[n], steps, prefill_len)
    for n, d in (og or {}).items():
        drivers[f"{n} | og"] = OgRow(d, threads, past_ids, steps, 1 + repeats)
    drivers.update(extra or {})
    times = {r: {"prefill": [], **{f"decode{p}": [] for p in pasts}} for r in drivers}
    rows = list(drivers)
    t_round = time.perf_counter()
    for rnd in range(1 + repeats):
        k = rnd % len(rows)
        for r in rows[k:] + rows[:k]:
            if len(rows) > 1:
                settle(threads)  # the previous row's pool stops spinning
            pt = drivers[r].prefill(prefill_ids)
            dts = {p: drivers[r].decode(p, step_ids) for p in pasts}
            if rnd > 0:  # round 0 warms up
                if pt is not None:
                    times[r]["prefill"].append(pt)
                for p in pasts:
                    times[r][f"decode{p}"].extend(dts[p])
        if say:
            say(f"threads {threads}: round {rnd}/{repeats} ({time.perf_counter() - t_round:.0f} s)")
        t_round = time.perf_counter()
        if rnd == 0 and huge_pages:
            from .memory import huge_pages_for_process

            n = huge_pages_for_process()
            if say:
                say(f"{n >> 20} MiB of the process's memory moved to 2 MiB pages")
    return {r: {key: float(np.median(v)) * 1e3 for key, v in tt.items() if v} for r, tt in times.items()}


def fix_malloc_threshold(nbytes: int = 32 << 20) -> str:
    """Every session's weights placed alike: glibc's *dynamic* mmap threshold puts the big buffers
    (the prepacked MatMulNBits weights) of the first large session of a process in fresh mmap'd chunks
    and those of later ones on the heap once a freed chunk raised the threshold — measured: the first
    of three identical sessions 5-8 % slower in CPU time (SmolLM2 int4 and a 30-layer MatMulNBits MLP
    chain, taskset, 1 thread; none with MALLOC_MMAP_THRESHOLD_=32 MiB or a large session built first),
    so in one process the build order, not the graph, decided a few per cent between rows.
    mallopt(M_MMAP_THRESHOLD) fixes the threshold (buffers below it from the heap, for every session).
    Returns a note for the output ("" when glibc is not there)."""
    import ctypes

    try:
        ok = ctypes.CDLL("libc.so.6").mallopt(-3, int(nbytes))   # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return ""
    return f"glibc mmap threshold fixed at {nbytes >> 20} MiB (mallopt)" if ok else ""


# --------------------------------------------------------------------------- time to first token
# A prompt of this many tokens or more gets one timed run per thread count by default (each is minutes
# for a 1.5B model on two cores); shorter ones min(--repeats, PROMPT_SHORT_REPEATS)
PROMPT_LONG_FROM = 8192
PROMPT_SHORT_REPEATS = 3


def prompt_repeats(n: int, repeats: int, override: int | None = None) -> int:
    """Timed rounds of an ``n``-token prompt: ``override`` when given, else min(``repeats``,
    :data:`PROMPT_SHORT_REPEATS`) below :data:`PROMPT_LONG_FROM` tokens and 1 from there on."""
    if override is not None:
        return max(1, int(override))
    return 1 if n >= PROMPT_LONG_FROM else max(1, min(int(repeats), PROMPT_SHORT_REPEATS))


class PromptRow:
    """Time to first token as ``ortlean generate`` runs a prompt: a fresh
    :class:`runtime.generate.Decoder` (its loop from the graph: shared K/V buffers where every state is a
    GroupQueryAttention / cache-mode PackedAttention cache, else the growing cache), fed the prompt
    ``chunk`` tokens at a time (the whole prompt in one run when the model keeps a gate's state, as
    generate does), timed from the first chunk to the last chunk's logits — the first new token's.
    The decoder's buffers are allocated before the clock starts; their first touch is in the run, as in
    generate."""

    def __init__(self, sess, io: ModelIO, model_path=None, chunk: int | None = None):
        from .generate import PREFILL_CHUNK as GENERATE_CHUNK, Decoder

        self.sess, self.io, self.path = sess, io, model_path
        self.chunk = int(chunk or GENERATE_CHUNK)
        probe = Decoder(sess, io, max_len=1, model_path=model_path)
        self.loop, self.shared = probe.loop, probe.kv is not None
        del probe

    def ttft(self, ids) -> float:
        from .generate import Decoder

        ids = np.asarray(ids).reshape(-1)
        dec = Decoder(self.sess, self.io, max_len=ids.size + 1, model_path=self.path, shared=self.shared)
        chunk = self.chunk if dec.chunkable else ids.size
        t0 = time.perf_counter()
        for c0 in range(0, ids.size, chunk):   # the last chunk returns the first new token's logits
            dec.feed(ids[c0:c0 + chunk], more=c0 + chunk < ids.size)
        dt = time.perf_counter() - t0
        del dec
        return dt


class OgPromptRow:
    """Time to first token in onnxruntime_genai's own generator: a new generator (its buffers made
    before the clock starts), the prompt appended ``chunk`` tokens at a time (``OgRow.append``: og keeps
    the logits of every appended position, which at a 152k vocabulary and 32k tokens would be 20 GB),
    timed to the end of the last ``append_tokens`` — the first new token's logits."""

    def __init__(self, model_dir, threads: int, chunk: int | None = None):
        from .generate import PREFILL_CHUNK as GENERATE_CHUNK

        self.og = OgRow(model_dir, threads, {}, 0, 0)
        self.chunk = int(chunk or GENERATE_CHUNK)
        self.loop = "og"

    def ttft(self, ids) -> float:
        ids = np.asarray(ids).reshape(-1)
        cap = ids.size + 4
        g = self.og._gen(min(cap, self.og.max_len) if self.og.max_len else cap)
        t0 = time.perf_counter()
        OgRow.append(g, ids, self.chunk)
        dt = time.perf_counter() - t0
        del g
        return dt


def prompt_table(drivers: Mapping[str, Any], ids, lengths, repeats: Mapping[int, int] | int = 1,
                 threads: int = 1, warmup_tokens: int | None = None, limits: Mapping[str, int] | None = None,
                 say=None, huge_pages: bool = True) -> dict[str, dict[str, list[float]]]:
    """Time to first token of prompts of each length in ``lengths`` (the first n of ``ids``) for every
    row of ``drivers`` = {row: driver}, in one process, interleaved: a driver has ``ttft(ids)`` (seconds,
    or None: no sample, e.g. a peer process that failed) and may have ``warm(ids)`` for the warm-up round
    (default ``ttft``). One untimed warm-up round of a ``warmup_tokens``-token prompt (default the
    shortest length, at most 1,024 tokens: every row's session, first and later chunks), then per length
    (shortest first) ``repeats[n]`` timed rounds, each running every row once, order rotated from round
    to round (across lengths too), the previous row's pool let stop first (:func:`settle`). ``limits``:
    {row: the longest prompt it is timed at}. ``huge_pages``: after the warm-up round the process's
    memory on 2 MiB pages (:func:`memory.huge_pages_for_process`). Returns {row: {str(n): [seconds of
    each timed run]}} (a row with no sample at a length has no key for it)."""
    ids = np.asarray(ids).reshape(-1)
    lengths = sorted({int(n) for n in lengths})
    if not lengths or ids.size < lengths[-1]:
        raise ValueError(f"prompt_table: {ids.size} ids for prompts of {lengths}")
    limits = dict(limits or {})
    rows = list(drivers)
    out: dict[str, dict[str, list[float]]] = {r: {} for r in rows}
    w = int(warmup_tokens or min(lengths[0], 1024))
    for r in rows:
        if len(rows) > 1:
            settle(threads)
        warm = getattr(drivers[r], "warm", None) or drivers[r].ttft
        warm(ids[:w])
    if say:
        say(f"threads {threads}: time to first token: warm-up round ({w}-token prompt) done")
    if huge_pages:
        from .memory import huge_pages_for_process

        huge_pages_for_process()
    rnd = 0
    for n in lengths:
        reps = repeats if isinstance(repeats, int) else repeats.get(n, 1)
        todo = [r for r in rows if n <= limits.get(r, n)]
        for i in range(int(reps)):
            k = rnd % len(todo) if todo else 0
            for r in todo[k:] + todo[:k]:
                if len(todo) > 1:
                    settle(threads)
                dt = drivers[r].ttft(ids[:n])
                if dt is not None:
                    out[r].setdefault(str(n), []).append(float(dt))
                if say:
                    say(f"threads {threads}: {n}-token prompt, round {i + 1}/{reps}: {r} "
                        + ("no sample" if dt is None else f"{dt:.2f} s" if dt >= 1 else f"{dt * 1e3:.1f} ms"))
            rnd += 1
    return out
