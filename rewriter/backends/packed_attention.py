"""PackedAttention (seed 001, KV-cache half): every matched attention core (builders/attention.py)
becomes one ``ai.ortlean::PackedAttention`` node, and every ``com.microsoft::GroupQueryAttention``
(the fused fast graph: ``rewriter.fuse`` or the onnxruntime-genai builder) becomes one in its
cache mode (:func:`apply_gqa`: quantized K/V rows + key bits as graph state, GQA's seqlens_k, so
one shared past/present buffer per layer works as it does for GQA).

For decoders whose key is the cache (``present.N.key = Concat(past_key_values.N.key, k)``) the
packed key bits become cache state: a graph input ``past_key_values.N.key_bits`` (int32
[batch, kv_heads, past_sequence_length, W]) and output ``present.N.key_bits``, paired by
``custom_ops.runtime.ModelIO`` like the other ``past*``→``present*`` states, so packing costs
O(new tokens) per step. Attention that does not match is left as is and reported with the reason.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from custom_ops import runtime
from custom_ops.reference.attn import cache_bits_words, kv_row_words, n_words, rotary as gqa_rotary
from custom_ops.schema import DOMAIN

from ..builders.attention import find_attention
from ..errors import OrtleanError
from ..kit import modelfile, options, stream, surgery, timing
from ..kit.backend import GraphPassBase
from ..kit import progress
from ..kit.options import Options, flag
from ..kit.progress import Progress
from ..kit.quality import BudgetRefused, remaining_budget

OP_TYPE = "PackedAttention"


@dataclass
class AttnConfig(Options):
    pack_bits: str = flag("--attn-pack-bits", "auto", "what --state-pack=binary packs per key: sign bits (binary "
                          "hashing), |k| > eps (the seed's bitmap), or pq: product-quantization codes of the same "
                          "width (a nibble per 4 dims, 16 centroids per subspace, k-means on --calib-text keys rotated "
                          "over the model's RoPE positions; fused graphs). auto (default): pq on fused graphs with "
                          "--calib-text (measured: SmolLM2 decode-mode Δppl at budget 0.25 +0.45 %% against +1.34 %% "
                          "for sign bits with key scales), else sign", choices=("auto", "sign", "eps", "pq"))
    pq_keys: int = flag("--attn-pq-keys", 4096, "--attn-pack-bits pq: calibration keys per layer and KV head the "
                        "centroids are fitted on (the --calib-text keys, each rotated to random positions; default "
                        "4096)", type=int)
    budget: float = flag("--attn-budget", None, "candidate keys per decode step as a fraction of the context, sinks "
                         "and window included (default: chosen by --attn-tune on fused graphs, else 0.5; 0 or 1 = "
                         "exact)", type=float, parse=lambda v, _: 0.5 if v is None else v)
    min_candidates: int = flag("--attn-min-candidates", 64, "at least this many candidates (default 64)", type=int)
    sinks: int = flag("--attn-sinks", 4, "first tokens always attended (default 4)", type=int)
    window: int = flag("--attn-window", None, "most recent tokens always attended (default: chosen by --attn-tune "
                       "on fused graphs, else 256)", type=int, parse=lambda v, _: 256 if v is None else v)
    min_context: int = flag("--attn-min-context", None, "exact attention up to this context length (default: on fused "
                            "graphs the measured crossover of the op's candidate and exact paths on this CPU, "
                            "--attn-tune; else 256)", type=int, parse=lambda v, _: 256 if v is None else v)
    rho: float = flag("--attn-rho", 0.15, "eps modes: exact attention when the key-bit density is above this "
                      "(default 0.15)", type=float)
    qbits: int = flag("--attn-qbits", 8, "query bits for the popcount score (default 8)", type=int)
    approx_prefill: int = flag("--attn-approx-prefill", False, "prompt rows (M > 1) also use candidates, each as its "
                               "decode step would (to measure decode-time quality with perplexity; default off: "
                               "prefill is exact)", action="store_true", parse=lambda v, _: int(bool(v)))
    target_density: float = flag("--attn-target-density", 0.10, "ternary / eps-binary without --state-pack-eps: eps "
                                 "per KV head from the calibration text's keys so that this fraction of components "
                                 "is set (default 0.10)", type=float)
    kscale: str = flag("--attn-kscale", "auto", "fold the per-channel mean |k| (from --calib-text keys) into the query "
                       "of the popcount score (default auto: when --calib-text is given)", choices=("auto", "off"))
    select: str = flag("--attn-select", "popcount", "how candidates are chosen: popcount score (default) or exact "
                       "scores (oracle: measures what the budget alone costs, no speed benefit)",
                       choices=("popcount", "exact"))
    kv_quant: str = flag("--attn-kv", "int8", "fused graphs (GroupQueryAttention): the K/V cache rows PackedAttention "
                         "keeps — int8 (default, 0.29x the fp32 bytes with the key bits), int4 (0.16x), fp32 (exact)",
                         choices=("int8", "int4", "fp32"))
    ksmooth: str = flag("--attn-ksmooth", "auto", "fused graphs, int8 / int4 K/V rows: key smoothing — per KV head "
                        "and rotary pair a scale s from the --calib-text keys (their largest pair norms, s = that "
                        "norm / its geometric mean), the op multiplies each query by s and stores K / s, every logit "
                        "unchanged, so the per-row scale is no longer spent on a few outlier channels (Qwen2's keys; "
                        "measured on Qwen2.5-Coder-1.5B: tests/bench/kv_quant_study.py). auto (default): with "
                        "--calib-text | off", choices=("auto", "off"))
    tune: str = flag("--attn-tune", "auto", "fused graphs (GroupQueryAttention): choose what is not given on the "
                     "command line — --attn-budget and --attn-window from decode-mode perplexity on --calib-text "
                     "(teacher-forced decode through the cache vs the same model with exact attention) under "
                     "--quality-budget, --attn-min-context from the op's measured exact/candidate crossover on this "
                     "CPU (cached) — auto (default) | off", choices=("auto", "off"))
    tune_context: int = flag("--attn-tune-context", 4096, "--attn-tune: prefill length before the scored decode steps "
                             "(default 4096, where the candidate path pays; capped by the model's positions and the "
                             "calibration text). A budget is a fraction of the context, so shorter contexts are the "
                             "harder case: the chosen budget is checked again at 1/4, 1/2 and 3/4 of it, and min_context "
                             "raised to the shortest checked context from which on every check passes", type=int)
    tune_windows: int = flag("--attn-tune-windows", 4, "--attn-tune: spans of the calibration text per trial, each a "
                             "prefill and the scored steps (default 4: with --attn-tune-score 256, 1,024 tokens, as "
                             "`ortlean eval`; 256 tokens measured the K/V format alone at +0.9 %% on SmolLM2 where "
                             "1,024 gave +0.25 %%, and failed a budget that passes)", type=int)
    tune_score: int = flag("--attn-tune-score", 256, "--attn-tune: teacher-forced decode steps scored per span "
                           "(default 256)", type=int)
    cand_block: int = flag("--attn-cand-block", 1, "fused graphs: choose candidates in blocks of this many consecutive "
                           "keys (a block scored by its best key), so that the rows read run in order — DRAM streams "
                           "them instead of one miss per row (default 1: key by key)", type=int)
    prefill_budget: float = flag("--attn-prefill-budget", None, "fused graphs, int8 / int4 K/V rows: sparse prefill — "
                                 "a tile of prompt rows attends to the sink block, --attn-prefill-window keys before it "
                                 "and this share of the key blocks between them, those to which a bound on its logits "
                                 "gives the most attention mass (docs/packed-attention.md). Default: chosen by --attn-tune "
                                 "from prefill-mode perplexity of long calibration spans (--attn-prefill-context) "
                                 "against exact prompt attention, else 0; 0 or 1 = exact prompts", type=float)
    prefill_window: int = flag("--attn-prefill-window", 1024, "sparse prefill: keys before a tile of prompt rows it "
                               "always attends to (default 1024)", type=int)
    prefill_block: int = flag("--attn-prefill-block", 64, "sparse prefill: prompt rows per tile and keys per block "
                              "(default 64)", type=int)
    prefill_tail: int = flag("--attn-prefill-tail", 64, "sparse prefill: the last this many rows of a prompt "
                             "attend to every key — the rows a reply is read from, where the question is; in "
                             "every run of it unless the driver says a later run continues it "
                             "(custom_ops.prompt_continues) "
                             "(default 64; without them the first answer token lost 3 of 5 pass keys at 8k "
                             "on Qwen2.5-Coder-1.5B, docs/retrieval.md)", type=int)
    prefill_min_context: int = flag("--attn-prefill-min-context", 4096, "sparse prefill: prompt rows whose context "
                                    "is at most this attend to every key (default 4096; the tuner scores the rows "
                                    "from here on)", type=int)
    prefill_context: int = flag("--attn-prefill-context", 16384, "--attn-tune: the prompt length whose rows past "
                                "--attn-prefill-min-context the sparse prefill is scored on (default 16384, capped by "
                                "the model's positions and the calibration text)", type=int)
    needles: str = flag("--attn-needles", "auto", "--attn-tune: retrieval as a gate — the tuned decode and prefill "
                        "budgets are also run on needle-in-a-haystack cases hidden in the calibration text (5 depths "
                        "at the tuning context; custom_ops.runtime.needle), and a setting that loses a needle the "
                        "exact-attention model finds is not shipped (the next larger budget is checked instead). "
                        "auto (default) | off", choices=("auto", "off"))
    needle_kinds: str = flag("--attn-needle-kinds", "passkey,kv", "--attn-needles: the case kinds (passkey, kv, "
                             "multi; default passkey,kv)")
    mix: float = flag("--attn-mix", 0.0, "seed behaviour: mix this fraction of the approximate score into the exact "
                      "logits (default 0)", type=float)
    # from the shared --state-pack* group (kit.options.StatePack) and --attn-pack-bits
    enabled: bool = False
    mode: str = "sign"                 # sign | ternary | binary
    eps: float = 0.0
    eps_given: bool = False
    popcnt: str = "auto"
    calib_tokens: int = 512
    targets: tuple = ("kv",)
    given: tuple = ()                  # of budget / window / min_context: given on the command line (not tuned)

    @property
    def needs_unfused(self) -> bool:
        """eps-mode key bits with eps calibrated per head: only the unfused core (apply) does that."""
        return self.mode in ("ternary", "binary") and not self.eps_given

    def prefill_attrs(self, budget: float) -> dict:
        """The nodes' sparse-prefill attributes at ``budget``: all of them within (0, 1), else exact
        prompts (prefill_budget 0) — one set for the writers and the prefill tuner."""
        if not 0 < budget < 1:
            return {"prefill_budget": 0.0}
        return {"prefill_budget": float(budget), "prefill_block": int(self.prefill_block),
                "prefill_window": int(self.prefill_window), "prefill_min_context": int(self.prefill_min_context),
                "prefill_tail": int(self.prefill_tail)}

    def validate(self) -> None:
        if not 0 < self.target_density < 1:
            raise OrtleanError(f"--attn-target-density {self.target_density}: must be in (0, 1)")
        if not 0 <= self.budget <= 1:
            raise OrtleanError(f"--attn-budget {self.budget}: must be in [0, 1]")
        if not 2 <= self.qbits <= 16:
            raise OrtleanError(f"--attn-qbits {self.qbits}: must be in 2..16")
        if not 0 <= self.mix <= 1 or not 0 <= self.rho <= 1:
            raise OrtleanError("--attn-mix and --attn-rho must be in [0, 1]")
        if self.tune_context < 16 or self.tune_score < 1 or self.tune_windows < 1:
            raise OrtleanError(f"--attn-tune-context {self.tune_context} / --attn-tune-score {self.tune_score}: "
                               "need ≥ 16 and ≥ 1")
        if min(self.min_candidates, self.sinks, self.window, self.min_context) < 0:
            raise OrtleanError("--attn-min-candidates/--attn-sinks/--attn-window/--attn-min-context must be ≥ 0")
        if not 1 <= self.cand_block <= 4096:
            raise OrtleanError(f"--attn-cand-block {self.cand_block}: must be in 1..4096")
        if self.prefill_budget is not None and not 0 <= self.prefill_budget <= 1:
            raise OrtleanError(f"--attn-prefill-budget {self.prefill_budget}: must be in [0, 1]")
        if not 8 <= self.prefill_block <= 4096:
            raise OrtleanError(f"--attn-prefill-block {self.prefill_block}: must be in 8..4096")
        if min(self.prefill_window, self.prefill_min_context, self.prefill_tail) < 0:
            raise OrtleanError("--attn-prefill-window / --attn-prefill-min-context / --attn-prefill-tail must be ≥ 0")
        if self.prefill_context < 256:
            raise OrtleanError(f"--attn-prefill-context {self.prefill_context}: must be ≥ 256")
        if not 256 <= self.pq_keys <= 1 << 20:
            raise OrtleanError(f"--attn-pq-keys {self.pq_keys}: must be in 256..1048576")


def _sym(dim):
    return dim if isinstance(dim, int) else str(dim)


def calibrate_eps(source, calib, cfg: AttnConfig, io_hint=None, max_pos: int | None = None
                  ) -> dict[str, dict[int, list[float]]]:
    """Per layer (cache index) and KV head: eps such that a fraction cfg.target_density of the key
    components has |k| > eps, and the per-channel mean |k| (kscale), on the first
    cfg.calib_tokens tokens of the calibration text (at most the model's ``max_pos`` positions;
    the dense model's present.N.key outputs)."""
    pre = runtime.text_prefix(calib.tok)       # as a prompt starts (Gemma: <bos>)
    ids = np.concatenate([pre, np.asarray(calib.ids[: min(cfg.calib_tokens, max_pos or cfg.calib_tokens) - pre.size],
                                          np.int64)])
    sess = stream.session(source, threads=2)   # a large model: segment by segment (kit.stream)
    io = runtime.ModelIO.from_session(sess)
    if io_hint is not None:   # symbolic KV dims (genai builder) from the rewrite's resolved I/O
        io.fill_from(io_hint)
    # the keys only: a streamed model then never runs its head (a 151,936-token head and its logits
    # are 1.2 GB at 1.5B), one session runs no more than it must
    names = [o.name for o in sess.get_outputs() if re.match(r"^present\.\d+\.key$", o.name)]
    out = dict(zip(names, sess.run(names, runtime.feeds(io, ids[None, :]))))
    eps, kscale, keys = {}, {}, {}
    for name, val in out.items():
        m = re.match(r"^present\.(\d+)\.key$", name)
        if m and (cfg.mode == "pq" or cfg.ksmooth == "auto"):
            keys[int(m.group(1))] = np.asarray(val[0], np.float32)   # [H, T, D]
        if m:
            a = np.abs(val[0])                                   # [H, T, D]
            eps[int(m.group(1))] = [float(np.quantile(a[h], 1.0 - cfg.target_density)) for h in range(a.shape[0])]
            kscale[int(m.group(1))] = key_scale(a)
    return {"eps": eps, "kscale": kscale, "keys": keys}


def key_scale(abs_keys: np.ndarray) -> list[float]:
    """The sign-bit score's per-channel key scale (kscale): mean |k_d| per head over the calibration
    tokens [H, T, D], relative to the head's mean."""
    ks = abs_keys.mean(axis=1)                                   # [H, D]
    return [float(x) for x in (ks / np.maximum(ks.mean(-1, keepdims=True), 1e-30)).ravel()]


# --------------------------------------------------------------------------- pq key codes
def rotary_of(model: ir.Model, layer: int | None = None):
    """(cos [P, r/2], sin [P, r/2], interleaved) of the first GroupQueryAttention with do_rotary and
    constant caches — of layer ``layer`` (its past_key_values.N.key) when given: Gemma 3's sliding
    and global layers rotate with different tables — else None."""
    for g in model.graph:
        if g.op_type != "GroupQueryAttention" or not g.attributes.get_int("do_rotary", 0) or len(g.inputs) < 9:
            continue
        if layer is not None and (g.inputs[3] is None or g.inputs[3].name != f"past_key_values.{layer}.key"):
            continue
        cos, sin = (None if v is None else v.const_value for v in g.inputs[7:9])
        if cos is not None and sin is not None:
            return (np.asarray(cos.numpy(), np.float32), np.asarray(sin.numpy(), np.float32),
                    bool(g.attributes.get_int("rotary_interleaved", 0)))
    return None


def pq_dims(D: int, rotary) -> list[int]:
    """The subspaces' dims: rotary pairs kept together ((i, i + r/2), or (2i, 2i + 1) interleaved),
    consecutive pairs grouped, the unrotated dims after them."""
    if rotary is None:
        return list(range(D))
    r = 2 * rotary[0].shape[1]
    pairs = [(2 * i, 2 * i + 1) for i in range(r // 2)] if rotary[2] else [(i, i + r // 2) for i in range(r // 2)]
    return [d for p in pairs for d in p] + list(range(r, D))


def fit_pq_book(keys: np.ndarray, dims: list[int], rotary, n: int, seed: int) -> np.ndarray:
    """Centroids [D/4, 16, 4] of one layer's KV head from its calibration keys [T, D] (post-RoPE, at
    positions 0 .. T-1): with rotary, n keys drawn from them, each rotated back from its position and
    on to a random one in the rotary cache's range (the keys a long context holds: low-frequency pairs
    turn slowly, so the calibration positions alone do not cover them); k-means (scipy kmeans2, ++
    seeding) per subspace."""
    import warnings

    from scipy.cluster.vq import kmeans2

    rng = np.random.default_rng(seed)
    T, D = keys.shape
    pick = rng.integers(0, T, n)
    x = keys[pick].astype(np.float32)
    if rotary is not None:
        cos, sin, inter = rotary
        if T > cos.shape[0]:
            raise OrtleanError(f"calibration keys at {T} positions, rotary cache holds {cos.shape[0]}")
        # GroupQueryAttention's rotary (the op's reference): back by -angle at each key's position, on
        # by +angle at a random one
        x = gqa_rotary(x[None, None], pick[None], cos, -sin, inter)[0, 0]
        to = rng.integers(0, cos.shape[0], n)
        x = gqa_rotary(x[None, None], to[None], cos, sin, inter)[0, 0]
    book = np.zeros((D // 4, 16, 4), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # an empty cluster keeps its seed (kmeans2 warns)
        for s in range(D // 4):
            c, _ = kmeans2(x[:, dims[4 * s:4 * s + 4]].astype(np.float64), 16, minit="++", iter=20,
                           seed=int(rng.integers(1 << 31)))
            book[s] = c
    return book


def rotary_pairs(D: int, rotary) -> np.ndarray:
    """[D] group id of each dim: a rotary pair's two dims ((i, i + r/2), or (2i, 2i + 1) interleaved)
    share one, the unrotated dims have their own."""
    gid = np.arange(D)
    if rotary is not None:
        half = rotary[0].shape[1]
        i1 = np.arange(half) * 2 if rotary[2] else np.arange(half)
        gid[i1 + 1 if rotary[2] else i1 + half] = i1
    return gid


def smooth_scales(k: np.ndarray, rotary, q: np.ndarray | None = None, alpha: float = 1.0) -> np.ndarray:
    """Key smoothing (SmoothQuant's migration, QServe's SmoothAttention): per KV head and channel a
    scale s [Hkv, D] so that K / s has flat channels for the per-row int8 cache while Q · s keeps
    every logit: (Q·s)·(K/s) = Q·K. From calibration keys k [Hkv, T, D] (and queries q [Hq, T, D]
    when alpha < 1), before or after rotary: per rotary pair the largest pair norm max_t |(x_i, x_j)|
    (what the rotation leaves invariant; unrotated dims: max |x_d|), s = maxK^alpha /
    maxQ^(1 - alpha) — alpha 1 (default): every pair of K / s has the same largest norm, the
    queries are not needed (the op's query levels are int16, ample for Q · s) — equal on both
    dims of a pair, so that s commutes with the rotation the op applies; normalised to geometric
    mean 1 per head; a channel without signal gets 1."""
    Hkv, D = k.shape[0], k.shape[-1]
    gid = rotary_pairs(D, rotary)

    def pair_max(x):                     # [H, T, D] -> [H, D]: max over tokens of each dim's pair norm
        sq = np.asarray(x, np.float64) ** 2
        pn = np.zeros(sq.shape[:2] + (D,))
        for d in range(D):
            pn[:, :, gid[d]] += sq[:, :, d]
        return np.sqrt(pn.max(axis=1))[:, gid]

    mk = pair_max(k)
    if alpha != 1.0:
        if q is None or q.shape[0] % Hkv or q.shape[-1] != D:
            raise ValueError(f"smooth_scales alpha {alpha}: needs queries [Hq, T, {D}] with Hq a multiple of {Hkv}")
        mq = pair_max(q).reshape(Hkv, q.shape[0] // Hkv, D).max(axis=1)
    else:
        mq = np.ones_like(mk)
    ok = (mk > 0) & (mq > 0) & np.isfinite(mk) & np.isfinite(mq)
    logs = np.where(ok, alpha * np.log(np.where(ok, mk, 1.0)) - (1.0 - alpha) * np.log(np.where(ok, mq, 1.0)), 0.0)
    logs -= logs.sum(-1, keepdims=True) / np.maximum(ok.sum(-1, keepdims=True), 1)
    return np.where(ok, np.exp(logs), 1.0).astype(np.float32)


def smooth_vector(s: np.ndarray, Hq: int) -> np.ndarray:
    """The Mul on GroupQueryAttention's packed QKV rows [(Hq + 2 Hkv) · D] that applies key
    smoothing s [Hkv, D]: s on each query head of its KV head, 1 / s on the keys, 1 on the values."""
    Hkv, D = s.shape
    return np.concatenate([np.repeat(s, Hq // Hkv, axis=0).ravel(), (1.0 / s).ravel(),
                           np.ones(Hkv * D)]).astype(np.float32)


def apply(model: ir.Model, cfg: AttnConfig, *, include=None, eps_heads: dict | None = None,
          kscale: dict | None = None) -> list[dict]:
    """Rewrite every matched attention core; returns one report dict per Softmax."""
    matches, skipped = find_attention(model)
    graph = model.graph
    inputs = {i.name: i for i in graph.inputs}
    records = []
    for m in matches:
        if include is not None and not include(m):
            records.append({"layer": m.layer, "backend": "dense", "decision": "kept dense: excluded"})
            continue
        bits_in = None
        W = None
        note = list(m.notes)
        if m.cache is not None:
            pk = inputs.get(f"past_key_values.{m.cache}.key")
            shp = pk.shape if pk is not None else None
            if shp is not None and len(shp) == 4 and isinstance(shp[1], int) and isinstance(shp[3], int):
                hkv, D = shp[1], shp[3]
                W = n_words(D, cfg.mode)
                past_len = shp[2] if not isinstance(shp[2], int) else "past_sequence_length"
                bits_in = ir.Value(name=f"past_key_values.{m.cache}.key_bits",
                                   shape=ir.Shape([_sym(shp[0]), hkv, _sym(past_len), W]), type=ir.TensorType(ir.DataType.INT32))
                graph.inputs.append(bits_in)
            else:
                note.append("cache key shape unknown: bits recomputed per call")
        attrs = dict(scale=float(m.scale), mode=cfg.mode, eps=float(cfg.eps), budget=float(cfg.budget),
                     min_candidates=int(cfg.min_candidates), sinks=int(cfg.sinks), window=int(cfg.window),
                     min_context=int(cfg.min_context), rho=float(cfg.rho), qbits=int(cfg.qbits), mix=float(cfg.mix),
                     popcnt=cfg.popcnt, k_layout=m.k_layout, layer=m.layer, approx_prefill=int(cfg.approx_prefill))
        pb = cfg.prefill_budget or 0.0
        if 0 < pb < 1:
            attrs.update(cfg.prefill_attrs(pb))
        if cfg.select != "popcount":
            attrs["select"] = cfg.select
        if kscale and m.cache in kscale:
            attrs["kscale"] = kscale[m.cache]
            note.append("per-channel key scale (calibrated)")
        if eps_heads and m.cache in eps_heads and cfg.mode != "sign":
            attrs["eps_heads"] = [float(e) for e in eps_heads[m.cache]]
            note.append(f"eps per head {', '.join(f'{e:.3g}' for e in eps_heads[m.cache])} "
                        f"(target density {cfg.target_density})")
        n_out = 2 if bits_in is not None else 1
        node = surgery.op_node(OP_TYPE, [m.q, m.k, m.v, m.mask, bits_in], attrs,
                               name=f"/ortlean/{m.layer}/PackedAttention", num_outputs=n_out)
        y_old = m.final.outputs[0]
        name = y_old.name
        y_old.name = name + "_dense"
        node.outputs[0].name = name
        node.outputs[0].shape = y_old.shape
        node.outputs[0].type = y_old.type
        graph.insert_after(m.final, node)
        y_old.replace_all_uses_with(node.outputs[0], replace_graph_outputs=True)
        if bits_in is not None:
            bo = node.outputs[1]
            ko = next(o for o in graph.outputs if o.name == f"present.{m.cache}.key")
            bo.name = f"present.{m.cache}.key_bits"
            bo.shape = ir.Shape([_sym(ko.shape[0]) if ko.shape else "batch_size", ko.shape[1] if ko.shape else None,
                                 _sym(ko.shape[2]) if ko.shape else "total_sequence_length", W])
            bo.type = ir.TensorType(ir.DataType.INT32)
            graph.outputs.append(bo)
        records.append({"layer": m.layer, "backend": "packed_attention", "node": node.name, "scale": m.scale,
                        "k_layout": m.k_layout, "cache": m.cache is not None and bits_in is not None,
                        "decision": f"PackedAttention ({cfg.mode}, budget {cfg.budget})" +
                                    (f"; {'; '.join(note)}" if note else "")})
    for s in skipped:
        records.append({"layer": s["layer"], "backend": "dense", "node": s["node"],
                        "decision": f"kept dense: attention not matched ({s['reason']})"})
    if matches:
        surgery.remove_dead(graph)
        model.opset_imports.setdefault(DOMAIN, 1)
    return records



# --------------------------------------------------------------------------- GroupQueryAttention
_GQA_ATTRS = {"num_heads", "kv_num_heads", "scale", "do_rotary", "rotary_interleaved", "local_window_size", "softcap"}
_PAST_KEY = re.compile(r"^past_key_values\.(\d+)\.key$")


def _gqa_problem(node: ir.Node, graph: ir.Graph) -> str | None:
    extra = sorted(set(node.attributes) - _GQA_ATTRS)
    if extra:
        return f"attributes {extra} not supported"
    if len(node.inputs) < 7 or any(i is not None for i in node.inputs[9:]):
        return "attention_bias / extra inputs not supported"
    if node.attributes.get_float("softcap", 0.0) < 0:
        return "negative softcap"
    pk, pv = node.inputs[3], node.inputs[4]
    if pk is None or pv is None or not _PAST_KEY.match(pk.name or "") or pk not in graph.inputs:
        return "past_key is not a past_key_values.N.key graph input"
    shp = pk.shape
    if shp is None or len(shp) != 4 or _head_dims(node) is None:
        return f"past key shape {shp} and the Q/K/V widths give no static head_dim"
    if pk.dtype != ir.DataType.FLOAT:
        return f"KV cache type {pk.dtype}, not float32"
    if len(pk.uses()) != 1 or len(pv.uses()) != 1:
        return "past K/V read by other nodes"
    if node.attributes.get_int("do_rotary", 0) and (len(node.inputs) < 9 or node.inputs[7] is None):
        return "do_rotary without cos/sin caches"
    return None


def _qkv_dims(Hq: int, Hkv: int, q, k, v) -> tuple[int | None, int | None]:
    """(D, Dv) from the widths of GroupQueryAttention-layout Q/K/V ([B, S, H·D]; k None: q is the
    packed [B, S, (Hq + 2 Hkv)·D]); None where a width is not static."""
    def last(x):
        return x.shape[-1] if x is not None and x.shape is not None and isinstance(x.shape[-1], int) else None

    w = last(q)
    if not (Hq and Hkv and w):
        return None, None
    if k is None:
        D = w // (Hq + 2 * Hkv) if w % (Hq + 2 * Hkv) == 0 else None
        return D, D
    wv = last(v)
    return (w // Hq if w % Hq == 0 else None), (wv // Hkv if wv and wv % Hkv == 0 else None)


def _head_dims(node: ir.Node) -> tuple[int, int] | None:
    """(head_dim of K, of V) of a GroupQueryAttention node: the past K/V shapes, else the widths of
    its (packed or separate) Q/K/V inputs (the genai builder declares kv_cache_dim symbolic)."""
    a = node.attributes
    Hq, Hkv = a.get_int("num_heads", 0), a.get_int("kv_num_heads", 0)
    pk, pv = node.inputs[3], node.inputs[4]
    D = pk.shape[3] if pk is not None and pk.shape is not None and len(pk.shape) == 4 else None
    Dv = pv.shape[3] if pv is not None and pv.shape is not None and len(pv.shape) == 4 else None
    D, Dv = (D if isinstance(D, int) else None), (Dv if isinstance(Dv, int) else None)
    wD, wDv = _qkv_dims(Hq, Hkv, node.inputs[0], node.inputs[1], node.inputs[2])
    D = D if D is not None else wD
    Dv = Dv if Dv is not None else (wDv if wDv is not None else D)
    if D is None or Dv is None or Hkv <= 0 or not isinstance(pk.shape[1] if pk.shape is not None else None, int):
        return None
    return int(D), int(Dv)


def apply_gqa(model: ir.Model, cfg: AttnConfig, *, include=None, kscale: dict | None = None,
              pq: dict | None = None, ksmooth: dict | None = None) -> list[dict]:
    """Every GroupQueryAttention → one PackedAttention (kv_quant = cfg.kv_quant) on GQA's own inputs
    (num_heads / kv_num_heads: its [B, S, H·D] layout, packed QKV, rotary from its cos/sin caches;
    no nodes around it). GQA's semantics: causal, query positions from seqlens_k (pos0 = max(0,
    seqlens_k + 1 − S)), local_window_size, softcap, scale (0 → 1/sqrt(head_dim)); the cache becomes
    graph state past_key_values.N.kv / .key_bits → present.N.kv / .key_bits (int32 rows,
    custom_ops/reference/attn.py) instead of .key/.value. ``ksmooth``: {layer N: s [Hkv, D]} key
    smoothing (smooth_scales), the node's ksmooth attribute."""
    graph = model.graph
    records = []
    for g in [n for n in graph if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"]:
        layer = _layer_of(g)
        why = _gqa_problem(g, graph)
        if why:
            records.append({"layer": layer, "backend": "dense", "node": g.name,
                            "decision": f"kept GroupQueryAttention: {why}"})
            continue
        if include is not None and not include(g):
            records.append({"layer": layer, "backend": "dense", "node": g.name, "decision": "kept dense: excluded"})
            continue
        a = g.attributes
        Hq, Hkv = a.get_int("num_heads"), a.get_int("kv_num_heads")
        pk, pv = g.inputs[3], g.inputs[4]
        N = int(_PAST_KEY.match(pk.name).group(1))
        B_dim = pk.shape[0]
        D, Dv = _head_dims(g)
        scale = a.get_float("scale", 0.0) or 1.0 / math.sqrt(D)
        seqlens = g.inputs[5]
        rot = a.get_int("do_rotary", 0)
        cos, sin = (g.inputs[7], g.inputs[8]) if rot else (None, None)
        q, k, v = g.inputs[0], g.inputs[1], g.inputs[2]
        W, R = cache_bits_words(D, cfg.mode), kv_row_words(D, Dv, cfg.kv_quant)
        bits_in = ir.Value(name=f"past_key_values.{N}.key_bits", type=ir.TensorType(ir.DataType.INT32),
                           shape=ir.Shape([_sym(B_dim), Hkv, "past_sequence_length", W]))
        kv_in = ir.Value(name=f"past_key_values.{N}.kv", type=ir.TensorType(ir.DataType.INT32),
                         shape=ir.Shape([_sym(B_dim), Hkv, "past_sequence_length", R]))
        graph.inputs.extend([bits_in, kv_in])
        attrs = dict(scale=float(scale), mode=cfg.mode, eps=float(cfg.eps), budget=float(cfg.budget),
                     min_candidates=int(cfg.min_candidates), sinks=int(cfg.sinks), window=int(cfg.window),
                     min_context=int(cfg.min_context), rho=float(cfg.rho), qbits=int(cfg.qbits),
                     popcnt=cfg.popcnt, layer=f"layers.{N}", approx_prefill=int(cfg.approx_prefill),
                     kv_quant=cfg.kv_quant, local_window=int(a.get_int("local_window_size", -1)),
                     softcap=float(a.get_float("softcap", 0.0)), num_heads=int(Hq), kv_num_heads=int(Hkv),
                     rotary_interleaved=int(a.get_int("rotary_interleaved", 0)) if rot else 0)
        pb = cfg.prefill_budget or 0.0
        if 0 < pb < 1:
            attrs.update(cfg.prefill_attrs(pb))
        if cfg.select != "popcount":
            attrs["select"] = cfg.select
        if cfg.cand_block != 1:
            attrs["cand_block"] = int(cfg.cand_block)
        if cfg.mode == "pq":
            if not pq or N not in pq:
                raise OrtleanError(f"{g.name}: --attn-pack-bits pq has no codebook for layer {N} "
                                   "(no present.{N}.key in the calibration run)")
            book, dims = pq[N]
            if book.shape != (Hkv, D // 4, 16, 4):
                raise OrtleanError(f"{g.name}: pq codebook {book.shape} does not fit {Hkv} KV heads of dim {D}")
            attrs["pq_book"] = [float(x) for x in book.ravel()]
            if list(dims) != list(range(D)):
                attrs["pq_dims"] = [int(x) for x in dims]
        elif kscale and N in kscale:
            attrs["kscale"] = kscale[N]
        smooth_note = ""
        if ksmooth and N in ksmooth:
            s = np.asarray(ksmooth[N], np.float32)
            if s.shape != (Hkv, D):
                raise OrtleanError(f"{g.name}: key smoothing {s.shape} does not fit {Hkv} KV heads of dim {D}")
            attrs["ksmooth"] = [float(x) for x in s.ravel()]
            smooth_note = f", keys smoothed (s {s.min():.3g} .. {s.max():.3g})"
        ins = [q, k, v, None, bits_in, kv_in, seqlens, cos, sin]
        while ins[-1] is None:
            ins.pop()
        pa = surgery.op_node(OP_TYPE, ins, attrs,
                             name=f"/ortlean/layers.{N}/PackedAttention", num_outputs=3)
        graph.insert_before(g, pa)
        y_old = g.outputs[0]
        pa.outputs[0].shape, pa.outputs[0].type = y_old.shape, y_old.type
        y_old.replace_all_uses_with(pa.outputs[0], replace_graph_outputs=True)
        for o, nm, width in ((pa.outputs[1], f"present.{N}.key_bits", W), (pa.outputs[2], f"present.{N}.kv", R)):
            o.name = nm
            o.type = ir.TensorType(ir.DataType.INT32)
            o.shape = ir.Shape([_sym(B_dim), Hkv, "total_sequence_length", width])
            graph.outputs.append(o)
        for o in g.outputs[1:]:
            if o is not None and o.is_graph_output():
                graph.outputs.remove(o)
        graph.remove(g, safe=False)
        for i in (pk, pv):
            graph.inputs.remove(i)
        keys = "pq key codes (k-means centroids)" if cfg.mode == "pq" else f"{cfg.mode} key bits"
        records.append({"layer": f"layers.{N}", "backend": "packed_attention", "node": pa.name, "cache": True,
                        "decision": f"PackedAttention replaces GroupQueryAttention ({cfg.kv_quant} K/V rows{smooth_note}, "
                                    f"{keys}, budget {cfg.budget})"})
    if any(r["backend"] == "packed_attention" for r in records):
        surgery.remove_dead(graph)
        model.opset_imports.setdefault(DOMAIN, 1)
    return records


# --------------------------------------------------------------------------- --attn-tune (fused graphs)
def _max_positions(model: ir.Model, ctx) -> int | None:
    """Positions the model can take: its GroupQueryAttention rotary cache rows, else config.json."""
    for n in model.graph:
        if n.op_type == "GroupQueryAttention" and len(n.inputs) > 7 and n.inputs[7] is not None:
            shp = n.inputs[7].shape
            if shp is not None and isinstance(shp[0], int):
                return int(shp[0])
    return modelfile.max_positions(ctx.model_path)


def _set_attrs(model: ir.Model, values: dict) -> None:
    for n in model.graph:
        if n.op_type == OP_TYPE and n.domain == DOMAIN:
            for a in surgery.op_attrs(OP_TYPE, values):
                n.attributes[a.name] = a


def _decode_nll_spans(sess, spans: list, context: int, score: int, state: dict | None = None, io_hint=None):
    """Teacher-forced decode through the cache (one shared K/V buffer per state, as
    runtime.decode_perplexity) of equally long spans at once, one batch row per span: the cache of each
    span's first `context` tokens (a prefill, or `state` from an earlier call on the same spans —
    causal: the same cache), then `score` single-token steps, each scoring the next token. One batch
    row per span: every decode step reads the weights once for all spans (the tuner's trials are this
    loop). Each span's prefill runs alone (batch 1: its attention scratch stays one span's), written
    into its batch row of the state arrays, which the decode then runs in place (no copy of the
    cache: the steps write rows ``context`` … ``context + score - 1``, which are saved before and put
    back after, so a later call at any context up to the prefill's reads the prefill's cache).
    Returns (the NLL of every scored token [len(spans) * score], span by span; the state: the
    stacked prefill cache, ``context + score`` positions long where it was made here)."""
    n = len(spans)
    ids = np.stack([np.asarray(x)[: context + score + 1] for x in spans])
    if ids.shape[1] < context + score + 1:
        raise ValueError(f"spans of {ids.shape[1]} tokens, context {context} + {score} scored + 1 needed")
    io = runtime.ModelIO.from_session(sess)
    if io_hint is not None:
        io.fill_from(io_hint)

    if state is None:
        state = runtime.SharedKV.alloc(io, context + score, batch=n)
        for i, x in enumerate(ids):
            one = runtime.SharedKV(sess, io, max_len=context + score, arrays={k: v[i:i + 1] for k, v in state.items()})
            one.prefill(x[None, :context], chunk=runtime.PREFILL_CHUNK)
            del one
    length = io.state_len(state)
    if context + score > length:
        raise ValueError(f"state of {length} positions: context {context} + {score} scored do not fit")
    written = {k: io.seq_index(k, a.ndim, context, context + score) for k, a in state.items()}
    kept = {k: a[written[k]].copy() for k, a in state.items()}
    kv = runtime.SharedKV(sess, io, max_len=length, batch=n, arrays=state, length=context)
    nll = np.zeros((n, score))
    at = np.arange(n)
    try:
        for i in range(score):
            lg = kv.step(ids[:, context + i: context + i + 1])[:, -1].astype(np.float64)   # [n, V]
            m = lg.max(axis=1)
            nll[:, i] = m + np.log(np.exp(lg - m[:, None]).sum(axis=1)) - lg[at, ids[:, context + i + 1]]
    finally:
        del kv
        for k, a in state.items():
            a[written[k]] = kept[k]
    return nll.reshape(-1), state


def quality_floor(context: int, checks: list[dict], budget: float) -> int:
    """The shortest context from which on the chosen setting is within the quality budget: ``context``
    (where it was chosen, so passing) lowered through ``checks`` ({"context", "delta_ppl"[,
    "delta_ppl_upper": the bound that must pass when given]} at shorter contexts) from the longest down
    while they pass (a budget is a fraction of the context: quality
    improves with the context, so the first failing check ends it)."""
    floor = int(context)
    for ch in sorted(checks, key=lambda x: -x["context"]):
        if ch["context"] >= floor:
            continue
        if not ch.get("delta_ppl_upper", ch["delta_ppl"]) <= budget:
            break
        floor = int(ch["context"])
    return floor


def shorter_checks(context: int, budget: float, measure) -> list[dict]:
    """The chosen setting's checks at 3/4, 1/2 and 1/4 of ``context`` (none under 16 tokens), longest
    first, by ``measure(c) -> (Δppl, its one-sided 95 % bound)``; they stop at the first whose bound is
    over ``budget``: a shorter one cannot lower the quality floor any more (:func:`quality_floor`), so
    it is not measured (each check is two decode loops: 100 s at Qwen2.5-1.5B's 4k context)."""
    checks = []
    for c in (3 * context // 4, context // 2, context // 4):
        if c < 16:
            continue
        d, up = measure(c)
        checks.append({"context": int(c), "delta_ppl": round(d, 5), "delta_ppl_upper": round(up, 5)})
        if not up <= budget:
            break
    return checks


BUDGETS = (1.0, 0.5, 0.25, 0.1875, 0.125, 0.0625)  # 0.1875: pq codes pass there on SmolLM2 where sign bits did not
WINDOWS = (256, 128, 64)  # 128: at budget 0.25 on SmolLM2 as good as 256 or better (decode-mode Δppl)
# an approximate budget is chosen over exact int8 only when the op's candidate path is at least this
# much faster at the calibration context (interleaved medians of one node vary by a few %)
MIN_SPEEDUP = 1.05


def tune_gqa(model: ir.Model, ref: "ir.Model | bytes", cfg: AttnConfig, ctx, max_pos: int | None) -> dict:
    """--attn-tune on the PackedAttention nodes apply_gqa wrote: among the budgets and windows whose
    decode-mode Δppl on the calibration text against ``ref`` (the same model with exact attention)
    is within --quality-budget (per budget, the windows from the largest down until one passes), the fastest by the op's measured decode step at the calibration
    context (kit.timing.attention_crossover at the layer shape; exact, budget 1, unless a candidate
    is at least MIN_SPEEDUP faster); then min_context = the measured exact/candidate crossover of
    the chosen budget. Sets the nodes' attributes; returns what was chosen and measured (the
    report's "tune")."""
    import custom_ops

    pa = next(n for n in model.graph if n.op_type == OP_TYPE and n.domain == DOMAIN)
    node_attrs = {k: a.value for k, a in pa.attributes.items()
                  if k in ("scale", "mode", "eps", "min_candidates", "sinks", "qbits", "popcnt", "kv_quant",
                           "select", "local_window", "softcap", "cand_block")}

    def crossover(b, w):
        return timing.attention_crossover(*_layer_shape(pa), {**node_attrs, "budget": float(b), "window": int(w)},
                                          threads=ctx.threads)

    out: dict = {"given": list(cfg.given)}
    chosen = {"budget": cfg.budget, "window": cfg.window}
    why = None
    exact = cfg.kv_quant == "fp32" and "budget" in cfg.given and not 0 < cfg.budget < 1
    if exact:                             # GroupQueryAttention's attention to 1e-5: nothing to measure
        why = f"exact attention (--attn-kv fp32, --attn-budget {cfg.budget:g})"
    elif ctx.opts.quality_budget is None:   # the user opted out of every measurement
        why = ("given on the command line" if {"budget", "window"} <= set(cfg.given)
               else "--quality-budget off: defaults")
    elif not ctx.opts.calib_text:
        raise OrtleanError(f"PackedAttention approximates attention (--attn-kv {cfg.kv_quant} rows, candidate keys): "
                           f"holding --quality-budget {ctx.opts.quality_budget} needs a measurement — give "
                           "--calib-text FILE (or --quality-budget off to write it unmeasured)")
    ids = None
    if why is None:
        ids = np.asarray(ctx.calib.ids, np.int64)
        score = cfg.tune_score
        C = min(cfg.tune_context, (max_pos or 1 << 30) - score - 1, ids.size - score - 1)
        if C < 16:
            raise OrtleanError(f"--calib-text: too short to measure PackedAttention in decode mode ({ids.size} tokens, "
                               f"{max_pos} positions; --attn-tune-score {score}): give a longer text, or "
                               "--quality-budget off to write it unmeasured")
    if why is not None:
        out["quality"] = why
    else:
        span = C + score + 1   # spans spread over the text (none at its start: title pages)
        n_sp = max(1, min(cfg.tune_windows, ids.size // span))
        pre = runtime.text_prefix(ctx.calib.tok)   # each span starts as a prompt does (Gemma: <bos>)
        spans = [np.concatenate([pre, ids[o: o + span - pre.size]]) for o in
                 (min(ids.size - span, max(0, (k + 1) * ids.size // (n_sp + 1) - span // 2)) for k in range(n_sp))]
        # what the weights left of the budget (the budget covers every change, issue 34)
        qb = remaining_budget(float(ctx.opts.quality_budget), ctx.weights_loss)
        threads = max(2, ctx.threads)
        bar = Progress("attention tuner", unit="trial", enabled=ctx.opts.progress)   # a line every 15 s in a log
        progress.status("attention tuner: the exact reference")
        s_ref = stream.session(ref, threads, stream=False, last_logits=True)   # decode loops read no prefill logits
        nll_ref, ref_state = _decode_nll_spans(s_ref, spans, C, score, io_hint=ctx.io)
        search = cfg.tune == "auto"      # --attn-tune off: only the flags' values, measured
        budgets = BUDGETS if search and "budget" not in cfg.given else (cfg.budget,)
        windows = WINDOWS if search and "window" not in cfg.given else (cfg.window,)
        trials, state, best, passed = [], None, None, []
        for b in budgets:
            passing = []
            # a trial whose candidates at context C are no more than the window and sinks does not test
            # the budget (it would pass at C and fail at longer contexts): not tried
            ws = windows[:1] if not 0 < b < 1 else windows if len(budgets) == 1 else \
                [w for w in windows if max(cfg.min_candidates, math.ceil(b * C)) > w + cfg.sinks]
            if not ws:
                out.setdefault("untested", []).append(b)
                continue
            for w in ws:
                progress.status(f"attention tuner: budget {b:g}, window {w}")
                _set_attrs(model, {"budget": float(b), "window": int(w), "min_context": 0})
                sess = stream.session(model, threads, stream=False, last_logits=True)   # the model's arrays, not a copy
                nll, state = _decode_nll_spans(sess, spans, C, score, state)
                d, up = runtime.paired_delta(nll, nll_ref)
                trials.append({"budget": b, "window": w, "delta_ppl": round(d, 5), "delta_ppl_upper": round(up, 5)})
                bar.update(1, f"b{b:g}/w{w}: {100 * d:+.2f} % (≤ {100 * up:+.2f})")
                del sess
                if up <= qb:
                    # the first passing window (largest first) is this budget's: the window is part of the
                    # candidates, so a smaller one reads no fewer rows (measured alike: 1.13 / 1.11 / 1.10x
                    # exact for 256 / 128 / 64 at budget 0.5 on SmolLM2), it only risks quality
                    passing.append((d, w))
                    break
            if not passing:
                break
            passed += [(b, w) for _, w in passing]
        if passed:
            # the fastest passing trial at the calibration context, by the op's measured step time
            speed = {(b, w): (1.0 if not 0 < b < 1 else timing.speedup_at(crossover(b, w), C)) for b, w in passed}
            for t in trials:
                if (t["budget"], t["window"]) in speed:
                    t["speedup"] = round(speed[(t["budget"], t["window"])], 3)
            fast = max(speed, key=lambda k: (speed[k], k[0]))   # ties: the larger budget
            if 0 < fast[0] < 1 and speed[fast] < MIN_SPEEDUP and len(budgets) > 1:
                fast = next(((b, w) for b, w in passed if b == 1.0), (1.0, cfg.window))
                out["speed_note"] = (f"no passing budget is {MIN_SPEEDUP}x faster than exact at context {C} "
                                     f"(best {max(speed.values()):.3f}x): exact kept")
            best = fast
        out["quality"] = {"metric": "decode-mode Δppl vs the same model with exact attention", "budget": qb,
                          "context": int(C), "scored": int(score) * len(spans), "spans": len(spans), "trials": trials}
        if best is None:   # nothing fits what the weights left of the budget: nothing is written (exit 3)
            t0 = trials[0] if trials else None
            what = (f"--attn-kv {cfg.kv_quant} rows alone (budget 1)" if t0 and t0["budget"] == 1.0 else
                    f"--attn-budget {cfg.budget} --attn-window {cfg.window}" if "budget" in cfg.given else
                    "no budget could be tested at this context")
            got = f" give decode-mode Δppl {t0['delta_ppl']:+.4f} (one-sided 95 % bound {t0['delta_ppl_upper']:+.4f})" \
                if t0 else ""
            raise BudgetRefused(f"PackedAttention: {what}{got} against exact attention on the calibration text, over "
                                f"what the weights leave of --quality-budget {ctx.opts.quality_budget} ({qb:+.4f}): "
                                "nothing written (--attn-kv fp32, or lift --quality-budget)", {"tune": out})
        if cfg.needles == "auto" and 0 < best[0] < 1:
            # retrieval as a gate: the chosen setting, else the next larger passing budget, must find every
            # needle the exact model finds at the calibration context
            gate, why = needle_gate(ref, ctx, cfg, C + score, threads, max_pos)
            checks = []
            for b, w in sorted({bw for bw in passed if 0 < bw[0] < 1 and bw[0] >= best[0]} if gate else (),
                               key=lambda bw: (bw[0], -bw[1])):
                _set_attrs(model, {"budget": float(b), "window": int(w), "min_context": 0})
                lost = gate.lost(model)
                checks.append(gate.record(f"budget {b:g}, window {w}", lost))
                if not lost:
                    best = (b, w)
                    break
            else:
                if gate is not None:
                    best = (1.0, cfg.window)
            out["needles"] = checks if gate is not None else why
            if checks and checks[-1]["lost"]:
                out["needle_note"] = "every budget lost a needle the exact model finds: exact attention kept"
        chosen = {"budget": best[0], "window": best[1]}
        if 0 < best[0] < 1:
            # the approximate path runs from min_context on: the chosen setting at 1/4, 1/2 and 3/4 of
            # the context (the same spans, their prefills' first rows), min_context at least the
            # shortest context from which on every check passes
            _set_attrs(model, {"budget": float(best[0]), "window": int(best[1]), "min_context": 0})
            sess = stream.session(model, threads, stream=False, last_logits=True)
            checks = shorter_checks(C, qb, lambda c: runtime.paired_delta(
                _decode_nll_spans(sess, spans, c, score, state)[0],
                _decode_nll_spans(s_ref, spans, c, score, ref_state, io_hint=ctx.io)[0]))
            del sess
            out["quality"]["shorter"] = checks
            out["quality_floor"] = quality_floor(C, checks, qb)
        del s_ref, ref_state
        bar.close()
    attrs = {"budget": float(chosen["budget"]), "window": int(chosen["window"])}
    if "min_context" in cfg.given or cfg.tune != "auto":
        attrs["min_context"] = int(cfg.min_context)
    else:
        if 0 < attrs["budget"] < 1:
            x = crossover(attrs["budget"], attrs["window"])
            c = x["crossover"]
            attrs["min_context"] = int(c) if c is not None else 1 << 20
            if "quality_floor" in out:  # exact below the context where the quality was shown (nctx <= min_context)
                attrs["min_context"] = max(attrs["min_context"], out["quality_floor"] - 1)
            out["min_context_measured"] = {
                "crossover": c, "threads": ctx.threads,
                "speedup": {p: round(v["speedup"], 3) for p, v in x["pasts"].items()},
                "measured": "one decode step of the op alone at the layer shape, candidate vs exact path, "
                            "interleaved medians (rewriter.kit.timing.attention_crossover)"}
        else:
            attrs["min_context"] = int(cfg.min_context)
    _set_attrs(model, attrs)
    out.update(attrs)
    mc = attrs["min_context"]
    out["summary"] = (f"budget {attrs['budget']:g}, window {attrs['window']}, "
                      f"min_context {mc if mc < 1 << 20 else 'never (candidates not faster up to 4096)'}")
    q = out.get("quality")
    sp = next((t["speedup"] for t in (q["trials"] if isinstance(q, dict) else []) if "speedup" in t
               and (t["budget"], t["window"]) == (attrs["budget"], attrs["window"])), None)
    if sp is not None and 0 < attrs["budget"] < 1:
        out["summary"] += f" (op {sp:.2f}x exact at context {out['quality']['context']})"
    if "quality_floor" in out and 0 < attrs["budget"] < 1:
        sh = ", ".join(f"{c['delta_ppl']:+.4f} at {c['context']}" for c in out["quality"].get("shorter", []))
        out["summary"] += f"; quality from context {out['quality_floor']} (Δppl {sh})" if sh else ""
    if "speed_note" in out:
        out["summary"] += f"; {out['speed_note']}"
    return out


PREFILL_BUDGETS = (0.5, 0.25, 0.125, 0.0625)
PREFILL_CHUNK = 512    # what `ortlean generate` and SharedKV.prefill run a long prompt in


def _prefill_nll_spans(sess, spans: list, score_from: int, io_hint=None, chunk: int = PREFILL_CHUNK) -> np.ndarray:
    """Prefill-mode NLL of each span's tokens predicted from positions >= score_from: the span fed in
    chunks of ``chunk`` tokens through one shared K/V buffer (the prompt path of `ortlean generate`),
    every chunk's logits scored (teacher forcing over the prompt); concatenated over the spans."""
    io = runtime.ModelIO.from_session(sess).fill_from(io_hint) if io_hint is not None else \
        runtime.ModelIO.from_session(sess)
    kv = runtime.SharedKV(sess, io, max(len(sp) for sp in spans))
    out = []
    for sp in spans:
        kv.length = 0
        n = len(sp) - 1
        for c0 in range(0, n, chunk):
            ids = np.asarray(sp[c0:min(n, c0 + chunk)], np.int64)
            lg = kv.step(ids[None, :])[0].astype(np.float32)           # [len, vocab]
            keep = np.arange(c0, c0 + ids.size) >= score_from
            if not keep.any():
                continue
            lg = lg[keep]
            tgt = np.asarray(sp[c0 + 1:c0 + 1 + ids.size], np.int64)[keep]
            mx = lg.max(1)
            lse = mx + np.log(np.exp(lg - mx[:, None]).sum(1))
            out.append(lse - lg[np.arange(tgt.size), tgt])
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def tune_prefill(model: ir.Model, cfg: AttnConfig, ctx, max_pos: int | None, spent: float) -> dict:
    """Sparse prefill's budget (--attn-tune, fused graphs, int8 / int4 rows): the smallest of
    PREFILL_BUDGETS whose prefill-mode Δppl — the calibration text's tokens at positions from
    --attn-prefill-min-context to --attn-prefill-context, the prompt fed in 512-token chunks as
    `ortlean generate` does — against the same model with exact prompt attention has a one-sided 95 %
    bound within what the weights and the decode approximation (``spent``) left of --quality-budget;
    budgets are tried from the largest, stopping at the first that fails (a smaller one attends to a
    subset of its keys' blocks' rivals). A given --attn-prefill-budget is measured the same way and
    refused (exit 3) over the budget. Sets the nodes' prefill attributes; returns the report's entry."""
    out: dict = {}
    given = cfg.prefill_budget is not None
    floor = int(cfg.prefill_min_context)
    ids = np.asarray(ctx.calib.ids, np.int64) if ctx.opts.calib_text else np.zeros(0, np.int64)
    L = min(int(cfg.prefill_context), int(max_pos or 1 << 30), ids.size - 1)

    def set_budget(b):
        _set_attrs(model, cfg.prefill_attrs(b))

    def testable(b) -> bool:
        # the last tile of a span keeps middle blocks, and fewer than all of them (else it tests nothing)
        Bk = int(cfg.prefill_block)
        nb, jl = L // Bk + 1, max(0, (L // Bk) * Bk - int(cfg.prefill_window)) // Bk
        ns = 1 if cfg.sinks > 0 else 0
        keep = -(-math.ceil(b * L) // Bk) - ns - (nb - jl)
        return 0 < keep < jl - ns

    if cfg.kv_quant == "fp32" and not given:
        set_budget(0.0)
        return {"prefill_budget": 0.0, "summary": "exact prompts (--attn-kv fp32: the exact recipe)"}
    if ctx.opts.quality_budget is None or (cfg.tune != "auto" and not given):
        b = cfg.prefill_budget or 0.0
        set_budget(b)
        return {"prefill_budget": float(b), "summary": (f"prefill budget {b:g} unmeasured (--quality-budget off)"
                                                        if 0 < b < 1 else "exact prompts")}
    if L - floor < 4 * int(cfg.prefill_block):
        if given and 0 < cfg.prefill_budget < 1:
            raise OrtleanError(f"--attn-prefill-budget {cfg.prefill_budget}: measuring it needs calibration spans longer "
                               f"than --attn-prefill-min-context {floor} by 4 blocks; the text and positions allow "
                               f"{L} (give a longer --calib-text, or --quality-budget off to write it unmeasured)")
        set_budget(0.0)
        return {"prefill_budget": 0.0, "summary": f"exact prompts (sparse prefill not measurable: {L}-token spans, "
                                                  f"min context {floor})"}
    qb = remaining_budget(float(ctx.opts.quality_budget), spent)
    n_sp = max(1, min(2, ids.size // (L + 1)))
    pre = runtime.text_prefix(ctx.calib.tok)   # each span starts as a prompt does (Gemma: <bos>)
    spans = [np.concatenate([pre, ids[o: o + L + 1 - pre.size]]) for o in
             (min(ids.size - L - 1, max(0, (k + 1) * ids.size // (n_sp + 1) - (L + 1) // 2)) for k in range(n_sp))]
    threads = max(2, ctx.threads)
    bar = Progress("prefill tuner", unit="trial", enabled=ctx.opts.progress)   # a line every 15 s in a log
    progress.status(f"prefill tuner: the exact reference, {len(spans)} spans of {L} tokens")
    set_budget(0.0)
    sess = stream.session(model, threads, stream=False)
    nll_ref = _prefill_nll_spans(sess, spans, floor, ctx.io)
    del sess
    budgets = (cfg.prefill_budget,) if given else PREFILL_BUDGETS
    trials, best = [], 0.0
    for b in budgets:
        if not 0 < b < 1:
            best = 0.0
            break
        if not given and not testable(b):
            out.setdefault("untested", []).append(b)
            continue
        progress.status(f"prefill tuner: budget {b:g}")
        set_budget(b)
        sess = stream.session(model, threads, stream=False)
        nll = _prefill_nll_spans(sess, spans, floor, ctx.io)
        bar.update(1)
        del sess
        d, up = runtime.paired_delta(nll, nll_ref)
        trials.append({"prefill_budget": b, "delta_ppl": round(d, 5), "delta_ppl_upper": round(up, 5)})
        if up > qb:
            if given:
                set_budget(0.0)
                raise BudgetRefused(f"PackedAttention: --attn-prefill-budget {b} gives prefill-mode Δppl {d:+.4f} "
                                    f"(one-sided 95 % bound {up:+.4f}) against exact prompt attention on the "
                                    f"calibration text at contexts {floor}..{L}, over what the rest leaves of "
                                    f"--quality-budget {ctx.opts.quality_budget} ({qb:+.4f}): nothing written "
                                    "(a larger --attn-prefill-budget, or lift --quality-budget)",
                                    {"prefill_tune": {"trials": trials}})
            break
        best = b
    if cfg.needles == "auto" and 0 < best < 1 and not given:
        # retrieval as a gate: the chosen prefill budget, else the next larger passing one, must find every
        # needle the same model with exact prompts finds at the span length
        set_budget(0.0)
        exact = model.clone()            # its tensors shared: the same model with exact prompts
        gate, why = needle_gate(exact, ctx, cfg, L, threads, max_pos)
        del exact
        checks = []
        for b in sorted(t["prefill_budget"] for t in trials
                        if gate and t["delta_ppl_upper"] <= qb and t["prefill_budget"] >= best):
            set_budget(b)
            lost = gate.lost(model)
            checks.append(gate.record(f"prefill budget {b:g}", lost))
            if not lost:
                best = b
                break
        else:
            if gate is not None:
                best = 0.0
        out["needles"] = checks if gate is not None else why
    bar.close()
    set_budget(best)
    out.update({"prefill_budget": float(best), "quality": {
        "metric": "prefill-mode Δppl vs the same model with exact prompt attention", "budget": qb,
        "contexts": [floor, int(L)], "scored": int(nll_ref.size), "spans": len(spans), "trials": trials}})
    if 0 < best < 1:
        out.update(cfg.prefill_attrs(best))
        t = next(t for t in trials if t["prefill_budget"] == best)
        out["summary"] = (f"sparse prefill budget {best:g} from context {floor} (prefill-mode Δppl "
                          f"{100 * t['delta_ppl']:+.2f} %, bound {100 * t['delta_ppl_upper']:+.2f} %, at {floor}..{L})")
    else:
        failed = [t for t in trials if t["delta_ppl_upper"] > qb]
        why = (f"; budget {failed[0]['prefill_budget']:g}: prefill-mode Δppl {100 * failed[0]['delta_ppl']:+.2f} %, "
               f"bound {100 * failed[0]['delta_ppl_upper']:+.2f} % over the {100 * qb:+.2f} % left, at {floor}..{L}"
               if failed else "; every passing budget lost a needle" if trials else "")
        out["summary"] = ("exact prompts (no sparse prefill budget passed" + why + ")") if trials else "exact prompts"
    return out


def needle_gate(ref, ctx, cfg: AttnConfig, length: int, threads: int, max_pos: int | None):
    """A :class:`NeedleGate`, or (None, why) when the calibration text cannot hold needle cases (no
    sentence ends in it, too short): the tuner then records why and goes on without the gate."""
    from custom_ops.runtime import needle

    try:
        return NeedleGate(ref, ctx, cfg, length, threads, max_pos), None
    except needle.NeedleError as e:
        return None, f"needle cases not made from the calibration text: {e}"


class NeedleGate:
    """Retrieval as a gate (--attn-needles): needle cases at one prompt length (5 depths, the kinds of
    --attn-needle-kinds) hidden in the calibration text, the exact reference's hits found once; a trial
    model passes when it finds every needle the reference finds (custom_ops.runtime.needle, which runs
    a case as `ortlean generate` runs a prompt: chunked prefill, then greedy decode steps)."""

    def __init__(self, ref, ctx, cfg: AttnConfig, length: int, threads: int, max_pos: int | None):
        from custom_ops.runtime import needle

        self.length, self.threads, self.io_hint = int(length), threads, ctx.io
        self.suite = needle.NeedleSuite.build(ctx.calib.tok, ctx.calib.text, lengths=[int(length)],
                                              depths=needle.DEPTHS, kinds=needle.parse_kinds(cfg.needle_kinds),
                                              cases=1, seed=0, positions=max_pos)
        progress.status(f"needle gate: the reference on {len(self.suite.cases)} cases at {length} tokens")
        s = stream.session(ref, threads, stream=False, last_logits=True)
        self.suite.prepare(s, self._io(s))
        del s
        self.found = len(self.suite.found)
        self.total = len(self.suite.cases)

    def _io(self, s):
        return runtime.ModelIO.from_session(s).fill_from(self.io_hint)

    def lost(self, model) -> list[str]:
        """The names of the cases ``model`` loses (it stops at the first: empty = it passes)."""
        progress.status(f"needle gate: {len(self.suite.found)} cases at {self.length} tokens")
        s = stream.session(model, self.threads, stream=False, last_logits=True)
        lost = self.suite.lost(s, self._io(s), fail_fast=True)
        del s
        return [r.name for r in lost]

    def record(self, setting: str, lost: list[str]) -> dict:
        return {"setting": setting, "length": self.length, "found_by_reference": self.found, "cases": self.total,
                "lost": lost}


def _chosen_delta(tune: dict) -> float:
    """The decode-mode Δppl the tuner measured for the setting it chose (0 when exact or unmeasured)."""
    q = tune.get("quality")
    if not isinstance(q, dict) or not 0 < tune.get("budget", 1.0) < 1:
        return 0.0
    return next((t["delta_ppl"] for t in q.get("trials", []) if (t["budget"], t["window"]) ==
                 (tune["budget"], tune["window"])), 0.0)


def _layer_shape(pa: ir.Node) -> tuple[int, int, int, int]:
    """(Hq, Hkv, D, Dv) of an apply_gqa PackedAttention node (its heads and its input widths)."""
    Hq, Hkv = pa.attributes.get_int("num_heads"), pa.attributes.get_int("kv_num_heads")
    D, Dv = _qkv_dims(Hq, Hkv, pa.inputs[0], pa.inputs[1], pa.inputs[2])
    if D is None or Dv is None:   # symbolic widths (genai builder): D = Dv from the cache row width
        R, kvq = pa.inputs[5].shape[-1], pa.attributes.get_string("kv_quant")
        D = Dv = next((d for d in range(8 if kvq != "fp32" else 1, 4097, 8 if kvq != "fp32" else 1)
                       if kv_row_words(d, d, kvq) == R), None)
        if D is None:
            raise ValueError(f"{pa.name}: no head dim gives the cache row width {R} ({kvq})")
    return Hq, Hkv, D, Dv


def _layer_of(node: ir.Node) -> str:
    m = re.search(r"layers?\.(\d+)", node.name or "")
    return f"layers.{m.group(1)}" if m else (node.name or "?")


class PackedAttentionPass(GraphPassBase):
    name = "packed_attention"
    stage = "post"
    Config = AttnConfig
    title = ("PackedAttention (seed 001 KV half; enabled by --state-pack=binary|ternary with "
             "--state-pack-target kv|both)")

    @classmethod
    def config(cls, args, state_pack) -> AttnConfig:
        sp = state_pack
        mode = "ternary" if sp.mode == "ternary" else \
            {"sign": "sign", "pq": "pq", "auto": "sign"}.get(args.attn_pack_bits, "binary")
        cfg = options.from_args(AttnConfig, args, enabled=sp.kv, mode=mode, popcnt=sp.popcnt, eps_given=sp.eps is not None,
                                eps=float(sp.eps if sp.eps is not None else (0.0 if mode == "sign" else 1e-4)))
        cfg.given = tuple(n for n in ("budget", "window", "min_context") if getattr(args, f"attn_{n}", None) is not None)
        cfg.validate()
        if cfg.enabled and mode == "pq" and not getattr(args, "calib_text", None):  # said before any work
            raise OrtleanError("--attn-pack-bits pq: give --calib-text FILE (the centroids are fitted on its keys)")
        return cfg

    def run(self, model, ctx) -> list[dict]:
        cfg = self.cfg
        cal = {}
        fused = any(n.op_type == "GroupQueryAttention" for n in model.graph)
        if cfg.pack_bits == "auto" and cfg.mode == "sign" and fused and ctx.opts.calib_text:
            cfg.mode = "pq"
        need_eps = cfg.mode in ("ternary", "binary") and not cfg.eps_given
        if cfg.mode == "pq" and not ctx.opts.calib_text:
            raise OrtleanError("--attn-pack-bits pq: give --calib-text FILE (the centroids are fitted on its keys)")
        if cfg.mode == "pq" and not fused:
            raise OrtleanError("--attn-pack-bits pq needs a fused graph (GroupQueryAttention: ortlean's --fuse or the "
                               "onnxruntime-genai builder); this model has none")
        if need_eps and not ctx.opts.calib_text:
            raise OrtleanError(f"--state-pack {'ternary' if cfg.mode == 'ternary' else 'binary --attn-pack-bits eps'}: "
                               "give --state-pack-eps E, or --calib-text FILE to choose eps per head for "
                               "--attn-target-density")
        if ctx.opts.calib_text and (need_eps or cfg.kscale == "auto" or cfg.ksmooth == "auto" or cfg.mode == "pq") \
                and ctx.io is not None and ctx.io.has_past:
            cal = calibrate_eps(ctx.source(), ctx.calib, cfg, io_hint=ctx.io, max_pos=_max_positions(model, ctx))
        if fused:
            if need_eps:
                raise OrtleanError("fused graph (GroupQueryAttention): eps-mode key bits need --state-pack-eps E "
                                   "(per-head calibration reads the optimum graph's present keys)")
            smooth = None
            if cfg.ksmooth == "auto" and cfg.kv_quant in ("int8", "int4") and cfg.mode in ("sign", "pq") \
                    and cal.get("keys"):   # (eps modes: a given --state-pack-eps is in the keys' own units)
                # the op stores K / s: the pq codebooks and the sign-bit key scale are fitted on those keys
                smooth = {N: smooth_scales(kk, rotary_of(model, N)) for N, kk in cal["keys"].items()}
                cal["keys"] = {N: (kk / smooth[N][:, None, :]).astype(np.float32) for N, kk in cal["keys"].items()}
                cal["kscale"] = {N: key_scale(np.abs(kk)) for N, kk in cal["keys"].items()}
            ks = cal.get("kscale") if cfg.kscale == "auto" and cfg.mode != "pq" else None
            pq = None
            if cfg.mode == "pq":
                if not cal.get("keys"):
                    raise OrtleanError("--attn-pack-bits pq: the calibration run gave no present.N.key outputs")
                pq = {}
                for N, kk in sorted(cal["keys"].items()):
                    rot = rotary_of(model, N)
                    dims = pq_dims(kk.shape[-1], rot)
                    pq[N] = (np.stack([fit_pq_book(kk[h], dims, rot, cfg.pq_keys, seed=N * 64 + h)
                                       for h in range(kk.shape[0])]), dims)
            max_pos = _max_positions(model, ctx)
            measure = ctx.opts.quality_budget is not None   # every setting is measured against the budget
            ref = model.clone() if measure and ctx.opts.calib_text else None  # the exact-attention twin
            recs = apply_gqa(model, cfg, kscale=ks, pq=pq, ksmooth=smooth)
            if (cfg.tune == "auto" or measure) and any(r["backend"] == "packed_attention" for r in recs):
                tune = tune_gqa(model, ref, cfg, ctx, max_pos)
                spent = ctx.weights_loss + max(0.0, _chosen_delta(tune))
                pf = tune_prefill(model, cfg, ctx, max_pos, spent)
                for r in recs:
                    if r["backend"] == "packed_attention":
                        r["decision"] = re.sub(r"budget [0-9.e-]+\)", f"{tune['summary']}; {pf['summary']})",
                                               r["decision"])
                first = next(r for r in recs if r["backend"] == "packed_attention")
                first["tune"] = tune
                first["prefill_tune"] = pf
            if ks:
                for r in recs:
                    if r["backend"] == "packed_attention":
                        r["decision"] += "; per-channel key scale (calibrated)"
            return recs
        approx = 0 < cfg.budget < 1 and ctx.opts.quality_budget is not None
        ref = model.clone() if approx and ctx.opts.calib_text else None   # exact attention
        recs = apply(model, cfg, eps_heads=cal.get("eps") if need_eps else None,
                     kscale=cal.get("kscale") if cfg.kscale == "auto" else None)
        if cfg.kscale == "auto" and not cal and any(r.get("cache") for r in recs):
            for r in recs:
                if r.get("cache"):
                    r["decision"] += "; no --calib-text: per-channel key scale off (measured: worse candidates)"
        done = [r for r in recs if r.get("backend") == "packed_attention"]
        if approx and done:   # this path has no tuner: its setting is measured, then kept or refused
            q = measure_decode(ref, model, cfg, ctx, _max_positions(model, ctx))
            done[0]["quality_check"] = q
            for r in done:
                r["decision"] += (f"; decode-mode Δppl {100 * q['delta_ppl']:+.2f} % (bound "
                                  f"{100 * q['delta_ppl_upper']:+.2f} %) vs exact attention, within the budget")
        return recs


def measure_decode(ref: "ir.Model | bytes | None", model: ir.Model, cfg: AttnConfig, ctx, max_pos: int | None) -> dict:
    """Decode-mode Δppl of `model` (PackedAttention written, its settings fixed) against `ref` (the
    same model with exact attention) on --attn-tune-windows spans of the calibration text, each a
    prefill of up to --attn-tune-context tokens and --attn-tune-score scored decode steps; raises
    BudgetRefused when the one-sided 95 % bound is over what the weights left of --quality-budget,
    and OrtleanError when it cannot measure (no --calib-text, text too short)."""
    import custom_ops

    if ref is None or not ctx.opts.calib_text:
        raise OrtleanError(f"PackedAttention approximates attention (budget {cfg.budget}): holding --quality-budget "
                           f"{ctx.opts.quality_budget} needs a measurement — give --calib-text FILE (or "
                           "--quality-budget off to write it unmeasured)")
    ids = np.asarray(ctx.calib.ids, np.int64)
    score = cfg.tune_score
    pre = runtime.text_prefix(ctx.calib.tok)
    C = min(cfg.tune_context, (max_pos or 1 << 30) - score - 1 - pre.size, ids.size - score - 1)
    if C < 16:
        raise OrtleanError(f"--calib-text: too short to measure PackedAttention in decode mode ({ids.size} tokens, "
                           f"{max_pos} positions): give a longer text, or --quality-budget off")
    n_sp = max(1, min(cfg.tune_windows, ids.size // (C + score + 1)))
    threads = max(2, ctx.threads)

    def nll_of(model_or_bytes) -> np.ndarray:   # the growing-state loop where the graph has no shared KV
        sess = stream.session(model_or_bytes, threads, stream=False, last_logits=True)
        io = runtime.ModelIO.from_session(sess).fill_from(ctx.io)
        return np.asarray(runtime.decode_perplexity(sess, io, ids, context=C, score=score, windows=n_sp,
                                                    prefix=pre)["token_nll"])

    nll_ref = nll_of(ref)
    nll = nll_of(model)
    d, up = runtime.paired_delta(nll, nll_ref)
    qb = remaining_budget(float(ctx.opts.quality_budget), ctx.weights_loss)
    out = {"metric": "decode-mode Δppl vs the same model with exact attention", "budget": qb, "context": int(C),
           "scored": int(nll.size), "spans": n_sp, "delta_ppl": round(d, 5),
           "delta_ppl_upper": round(up, 5)}
    if up > qb:
        raise BudgetRefused(f"PackedAttention (budget {cfg.budget}, window {cfg.window}, unfused graph: no tuner): "
                            f"decode-mode Δppl {d:+.4f} (one-sided 95 % bound {up:+.4f}) against exact attention on "
                            f"the calibration text, over what the weights leave of --quality-budget "
                            f"{ctx.opts.quality_budget} ({qb:+.4f}): nothing written (a smaller approximation: "
                            "--attn-budget closer to 1, or lift --quality-budget)", {"check": out})
    return out


# --------------------------------------------------------------------------- --attn-exact (fused graphs)
EXACT_MODES = ("auto", "on", "off")


def exact_gqa(model: ir.Model) -> list[dict]:
    """Every GroupQueryAttention apply_gqa takes → PackedAttention with fp32 K/V rows at budget 0:
    GQA's attention to 1e-5 on ortlean's kernel."""
    return apply_gqa(model, AttnConfig(enabled=True, kv_quant="fp32", budget=0.0))


@dataclass
class ExactAttnConfig(Options):
    mode: str = flag("--attn-exact", "auto", "fused graphs without --state-pack: replace every GroupQueryAttention "
                     "by PackedAttention's exact fp32 cache mode — the same attention (to 1e-5), ortlean's kernel "
                     "instead of ONNX Runtime's; the cache state becomes past_key_values.N.kv / .key_bits. auto "
                     "(default): when one decode step of the layer's shape measures faster than GroupQueryAttention "
                     "on this CPU at pasts 128 and 4096, 1 and 2 threads (rewriter.kit.timing.exact_attention_speed, "
                     "cached) | on | off (keep GroupQueryAttention)", choices=EXACT_MODES)
    enabled: bool = True
    targets: tuple = ()

    @property
    def explicit(self) -> bool:
        """The user asked for it (--attn-exact=on); auto alone is no request."""
        return self.mode == "on"


class ExactAttentionPass(GraphPassBase):
    """--attn-exact: the GroupQueryAttention nodes that PackedAttentionPass (--state-pack) left — all of
    them without --state-pack — become exact PackedAttention (kv_quant fp32, budget 0) when it pays."""
    name = "exact_attention"
    stage = "post"
    Config = ExactAttnConfig
    title = "exact attention on ortlean's kernel (fused graphs: GroupQueryAttention → PackedAttention fp32, exact)"

    @classmethod
    def config(cls, args, state_pack) -> ExactAttnConfig:
        cfg = options.from_args(ExactAttnConfig, args)
        cfg.enabled = cfg.mode != "off"
        return cfg

    def run(self, model, ctx) -> list[dict]:
        gqa = [n for n in model.graph if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"]
        if not gqa:
            return []
        ok = [n for n in gqa if _gqa_problem(n, model.graph) is None]
        note = ""
        if self.cfg.mode == "auto" and ok:
            import os

            g = ok[0]
            a = {k: (v.as_float() if v.type == ir.AttributeType.FLOAT else v.as_int()) for k, v in g.attributes.items()}
            Hq, Hkv = a["num_heads"], a["kv_num_heads"]
            D, Dv = _head_dims(g)
            max_pos = _max_positions(model, ctx) or 4096
            threads = sorted({1, min(2, os.cpu_count() or 1)})
            try:
                runs = {t: timing.exact_attention_speed(a, Hq, Hkv, D, Dv, g.inputs[1] is None, max_pos, exact_gqa,
                                                        threads=t) for t in threads}
            except Exception as e:  # no library / a runtime that cannot run the one-node models
                return [{"layer": "attention", "backend": "dense",
                         "decision": f"kept GroupQueryAttention: --attn-exact auto could not time the op ({e})"}]
            speeds = ", ".join(f"past {p} t{t} {v['speedup']:.2f}x" for t, r in runs.items() for p, v in r["pasts"].items())
            worst = min(r["min_speedup"] for r in runs.values())
            if worst < 1.0:
                return [{"layer": "attention", "backend": "dense",
                         "decision": f"kept GroupQueryAttention: exact PackedAttention measured slower on this CPU "
                                     f"(GQA time / op time: {speeds})"}]
            note = f"; measured GQA time / op time: {speeds}"
        recs = exact_gqa(model)
        for r in recs:
            if r["backend"] == "packed_attention":
                r["backend"] = "exact_attention"
                r["decision"] = "exact PackedAttention (fp32 K/V rows) replaces GroupQueryAttention" + note
        return recs
