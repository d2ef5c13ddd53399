"""Retrieval as a quality gate (issue 58, item 5): needle-in-a-haystack cases on real prose, run
through a model's normal long-prompt path, scored against a reference model.

Sparse attention can keep perplexity while losing the one fact a user asked about. A case hides
facts (*needles*) in a long passage of a novel and asks for one of them at the end; the model's
greedy continuation either gives the answer (a *hit*) or not. The gate is the list of needles the
reference (the exact model) finds and the model loses.

    from custom_ops import runtime
    from custom_ops.runtime import needle
    tok = runtime.load_tokenizer(ref_path)
    suite = needle.NeedleSuite.build(tok, text, lengths=[2048, 4096], depths=needle.DEPTHS,
                                     kinds=needle.KINDS, cases=1, seed=0, positions=8192)
    suite.prepare(sess_ref, io_ref, model_path=ref_path)   # the reference's hits, once
    lost = suite.lost(sess, io, model_path=path)          # [CaseResult] the model loses (empty: passes)
    lost = suite.lost(trial_sess, trial_io, fail_fast=True)  # a tuner's trial: stop at the first loss
    res = suite.compare(suite.run(sess, io, model_path=path))  # the full table's data (JSON-able)
    print(needle.format_table(res))

or in one call, ``needle.lost(sess, io, sess_ref, io_ref, tok, cases)``. ``NeedleSuite.lost`` runs only
the cases the reference found (the others cannot be lost).

**Cases** (:func:`make_cases`, deterministic from the seed: each case draws from its own stream,
seeded by (seed, kind, length, depth, index), so a case does not change when other cells are asked
for too). The haystack is a run of the text's tokens (a different place of the novel per case)
ending at a sentence boundary; the facts go in at sentence boundaries, the asked one at the one
nearest ``depth`` × the haystack's tokens (0: its start, 1: just before the cue). Kinds:

* ``passkey`` — one needle: "The pass key is 48213. Remember it. The pass key is 48213."; the prompt
  ends "The pass key is";
* ``kv`` — a block of ``KV_PAIRS`` lines "The value of key falcon is 30518." at the depth, one
  asked: the prompt ends "The value of key falcon is";
* ``multi`` — ``MULTI_NEEDLES`` pass keys "The pass key for the red door is 48213. Remember it. The
  pass key for the red door is 48213.", the asked one at the depth, the others (other doors, other
  numbers) at random other boundaries at least 0.1 away; the prompt ends "The pass key for the red
  door is".

Answers are random 5-digit numbers not in the haystack, distinct within a case. The prompt is plain
text — the tokenizer's own leading special tokens (BOS, as ``generate`` encodes a prompt), one line
saying facts are hidden, a blank line, the haystack with the needles, a blank line, and the *cue*
(``Case.cue``): the words that precede the answer in its needle. No chat template and no
question in words, so base and instruct models read the same prompt: small models retrieve by
induction, copying what followed the cue before (on SmolLM2-135M a written question first, "What is
the pass key? The pass key is", gave the model the question's words to copy instead, and a needle
saying the cue twice found more than "… 48213 is the pass key."). A case of length L fills L positions:
its prompt is L − ``new_tokens`` tokens exactly, and ``new_tokens`` (8) are generated.

**Running** (:func:`run_case`): the prompt is prefilled ``prefill_chunk`` (512) tokens a run through
``generate.Decoder`` — one shared K/V buffer per state (``SharedKV``) where the graph allows, the
growing-state loop otherwise — exactly as ``runtime.generate`` / ``ortlean generate`` run a long
prompt (PackedAttention's prompt rows exact, or sparse in a model with a prefill budget, as there);
then ``new_tokens`` greedy tokens, each after a single-token decode step (where PackedAttention's
candidate selection runs). A *hit*: the first number in the decoded continuation
is the answer. Beside it the answer's teacher-forced log-probability (nats, summed over its tokens,
read from the same decode steps while the greedy tokens agree with the answer, else from a rewind to
the prompt's end): a graded signal.

**Results**: :class:`CaseResult` per case; :func:`compare` → a dict per (kind, length, depth,
needles) cell with the model's and the reference's hits and mean answer log-probabilities, summary
counts, and ``lost`` — the gate. :func:`format_table` prints it (rows length × depth, columns kinds,
cells "model hits / reference hits").
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .generate import PREFILL_CHUNK, Decoder, _eos_ids, model_eos_ids
from .io import ModelIO

__all__ = ["KINDS", "DEPTHS", "LENGTHS", "NEW_TOKENS", "KV_PAIRS", "MULTI_NEEDLES", "NeedleError", "Fact", "Case",
           "CaseResult", "Haystack", "make_cases", "run_case", "run_cases", "is_hit", "compare", "lost",
           "NeedleSuite", "format_table", "parse_kinds"]

KINDS = ("passkey", "kv", "multi")
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
LENGTHS = (2048, 4096, 8192)
NEW_TOKENS = 8          # generated per case: a 5-digit answer is 5-6 tokens in the packaged models' tokenizers
KV_PAIRS = 4            # lines of a kv block
MULTI_NEEDLES = 3       # pass keys of a multi case (one asked, the rest distractors)
MIN_HAYSTACK = 32       # tokens of prose a case must keep around its needles

INTRO = "There are important facts hidden in the text below. Remember them: you will be asked about one of them at the end."
PASSKEY = "The pass key is {n}. Remember it. The pass key is {n}."
PASSKEY_CUE = "The pass key is"
KV_LINE = "The value of key {k} is {n}."
KV_CUE = "The value of key {k} is"
MULTI = "The pass key for the {k} door is {n}. Remember it. The pass key for the {k} door is {n}."
MULTI_CUE = "The pass key for the {k} door is"
KEYS = ("falcon", "violin", "cactus", "glacier", "rocket", "walrus", "lantern", "magnet", "octopus", "quartz",
        "saddle", "tulip", "banjo", "kayak", "comet", "jaguar", "anchor", "pepper", "zebra", "igloo")
DOORS = ("red", "blue", "green", "yellow", "purple", "orange", "silver", "golden", "black", "white")

# a sentence ends at . ! or ? (closing quotes / brackets after it), then whitespace, then a capital
_BOUNDARY = re.compile(r"[.!?][\"'\u201d\u2019)\]]*(\s+)(?=[\"'\u201c\u2018(\[]*[A-Z])")
_NUMBER = re.compile(r"\d+")


class NeedleError(ValueError):
    """Bad input: ``param`` (the keyword / flag name: lengths, depths, kinds, text) and ``value`` at fault."""

    def __init__(self, param: str, value, why: str):
        self.param, self.value, self.why = param, value, why
        super().__init__(f"{param} {value}: {why}")


# --------------------------------------------------------------------------- cases
@dataclass
class Fact:
    """One needle in a case's prompt."""
    text: str           # as inserted (a leading space joins it to the prose)
    answer: str
    key: str            # kv: the key word; multi: the door; passkey: ""
    position: int       # the prompt token where it starts
    depth: float        # realized: its boundary / the haystack's tokens
    asked: bool


@dataclass
class Case:
    kind: str
    length: int         # positions the case fills: len(ids) + new_tokens
    depth: float        # asked for (the realized one: the asked fact's depth)
    needles: int        # facts in the prompt
    index: int          # the case's number in its cell
    ids: list           # the prompt's token ids
    answer: str
    answer_ids: list    # the answer's tokens as they follow the cue
    cue: str            # the prompt's last words: those before the answer in its needle
    facts: list = field(default_factory=list)
    new_tokens: int = NEW_TOKENS
    haystack: tuple = (0, 0)   # the text's tokens [start, end) the haystack was cut from

    @property
    def cell(self) -> tuple:
        return (self.kind, self.length, self.depth, self.needles)

    @property
    def name(self) -> str:
        return f"{self.kind} {self.length} depth {self.depth:g} #{self.index}"


def parse_kinds(kinds) -> tuple[str, ...]:
    """("passkey", ...) from a comma string or a sequence; NeedleError("kinds", ...) when empty or unknown."""
    raw = kinds.split(",") if isinstance(kinds, str) else list(kinds)
    got = [k.strip() for k in raw if k.strip()]
    if not got:
        raise NeedleError("kinds", repr(kinds if isinstance(kinds, str) else ",".join(raw)),
                          f"give at least one of {', '.join(KINDS)}")
    bad = [k for k in got if k not in KINDS]
    if bad:
        raise NeedleError("kinds", ",".join(got), f"{bad[0]!r} is not one of {', '.join(KINDS)}")
    return tuple(dict.fromkeys(got))


class Haystack:
    """The text tokenized once (no special tokens) and its sentence boundaries as token indices: the
    index of the first token of a sentence (the whitespace before it included) where no token
    straddles the boundary."""

    def __init__(self, tokenizer, text: str):
        self.tok, self.text = tokenizer, text
        enc = tokenizer.encode(text, add_special_tokens=False)
        self.ids = np.asarray(enc.ids, dtype=np.int64)
        offs = enc.offsets
        starts = np.asarray([o[0] for o in offs], dtype=np.int64)
        ends = np.asarray([o[1] for o in offs], dtype=np.int64)
        self.starts, self.ends = starts, ends
        bounds = []
        for m in _BOUNDARY.finditer(text):
            p, q = m.start(1), m.end(1)     # the whitespace between the sentences
            i = int(np.searchsorted(starts, p))
            if 0 < i < len(starts) and starts[i] <= q and ends[i - 1] <= starts[i]:
                bounds.append(i)
        self.bounds = np.unique(np.asarray(bounds, dtype=np.int64))

    def __len__(self) -> int:
        return int(self.ids.size)

    def chars(self, lo: int, hi: int) -> str:
        """The text of tokens [lo, hi)."""
        return self.text[int(self.starts[lo]):int(self.ends[hi - 1])] if hi > lo else ""


def _encode(tok, s: str) -> list[int]:
    return list(tok.encode(s, add_special_tokens=False).ids)


def _special_prefix(tok) -> list[int]:
    """The special tokens the tokenizer puts before a text (BOS), as generate's prompts get them."""
    plain = _encode(tok, "a")
    full = list(tok.encode("a", add_special_tokens=True).ids)
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return full[:i]
    return []


def _answer_ids(tok, cue: str, answer: str) -> list[int]:
    """The answer's tokens as they follow the cue: encode(cue + " " + answer) past encode(cue) when
    that is a prefix of it, else encode(" " + answer)."""
    q = _encode(tok, cue)
    qa = _encode(tok, f"{cue} {answer}")
    if qa[:len(q)] == q and len(qa) > len(q):
        return qa[len(q):]
    return _encode(tok, f" {answer}")


def _numbers(rng, n: int, avoid: str) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        s = str(int(rng.integers(10000, 100000)))
        if s not in out and s not in avoid:
            out.append(s)
    return out


def _facts(kind: str, rng) -> tuple[list[tuple[str, str, str]], int, str]:
    """A kind's facts as (text template, key), the asked one's index, and the cue's template."""
    if kind == "passkey":
        return [(PASSKEY, "")], 0, PASSKEY_CUE
    if kind == "kv":
        keys = [KEYS[i] for i in rng.choice(len(KEYS), KV_PAIRS, replace=False)]
        return [(KV_LINE, k) for k in keys], int(rng.integers(KV_PAIRS)), KV_CUE
    doors = [DOORS[i] for i in rng.choice(len(DOORS), MULTI_NEEDLES, replace=False)]
    return [(MULTI, k) for k in doors], 0, MULTI_CUE


def _nearest(points: np.ndarray, target: float, taken=()) -> int:
    """The point nearest target (ties: the lower), skipping ``taken``."""
    order = np.argsort(np.abs(points - target), kind="stable")
    for j in order:
        if int(points[j]) not in taken:
            return int(points[j])
    return int(points[order[0]])


def make_case(hay: Haystack, kind: str, length: int, depth: float, index: int = 0, seed: int = 0,
              new_tokens: int = NEW_TOKENS) -> Case:
    """One case (module docstring): deterministic in (seed, kind, length, depth, index)."""
    tok = hay.tok
    rng = np.random.default_rng([int(seed), KINDS.index(kind), int(length), int(round(depth * 1e6)), int(index)])
    specs, asked, qt = _facts(kind, rng)
    prefix = _special_prefix(tok) + _encode(tok, INTRO + "\n\n")
    cue = qt.format(k=specs[asked][1])
    q_ids = _encode(tok, "\n\n" + cue)
    budget = int(length) - int(new_tokens) - len(prefix) - len(q_ids)

    def pieces(nums):
        """The inserted texts (kv: one block), their tokens and the haystack's tokens left."""
        texts = [" " + t.format(n=n, k=k) for (t, k), n in zip(specs, nums)]
        if kind == "kv":
            texts = [" " + " ".join(t.strip() for t in texts)]
        fact_ids = [_encode(tok, t) for t in texts]
        return texts, fact_ids, budget - sum(len(f) for f in fact_ids)

    # a needle's tokens depend on its numbers (a tokenizer may merge digits): draw them first, and again
    # when the haystack holds one (an answer must appear only where it was put)
    nums = _numbers(rng, len(specs), "")
    texts, fact_ids, H = pieces(nums)
    if H < MIN_HAYSTACK:
        raise NeedleError("lengths", length, f"too short: the intro, the needles, the cue and {new_tokens} new "
                          f"tokens take {length - H} tokens, leaving {max(H, 0)} of prose (at least {MIN_HAYSTACK})")
    if hay.bounds.size == 0:
        raise NeedleError("text", f"({len(hay):,} tokens)", "no sentence ends in it (needles go between sentences: "
                          "give prose)")
    slack = 16 * len(specs)      # room for other numbers' tokens
    valid = hay.bounds[hay.bounds >= H + slack]
    if valid.size == 0:
        raise NeedleError("text", f"({len(hay):,} tokens)", f"too short for length {length}: a haystack of {H:,} "
                          "tokens ending at a sentence boundary is needed")
    end = int(valid[int(rng.integers(valid.size))])
    start = end - H
    while any(n in hay.chars(start, end) for n in nums):
        nums = _numbers(rng, len(specs), hay.chars(max(end - H - slack, 0), end))
        texts, fact_ids, H = pieces(nums)
        start = end - H
    inner = hay.bounds[(hay.bounds > start) & (hay.bounds < end)] - start
    points = np.concatenate([[0], inner, [H]]).astype(np.int64)
    # where each inserted piece goes (a haystack-relative boundary): the asked one nearest the depth, a
    # multi case's distractors at random boundaries at least 0.1 away from it
    places = [_nearest(points, depth * H)]
    far = points[np.abs(points - depth * H) >= 0.1 * H]
    for _ in range(len(texts) - 1):
        cand = far if far.size else points
        places.append(_nearest(points, float(cand[int(rng.integers(cand.size))]), taken=set(places)))
    # splice: pieces sorted by place (stable: the order drawn)
    order = sorted(range(len(texts)), key=lambda i: (places[i], i))
    hay_ids = hay.ids[start:end].tolist()
    ids = list(prefix)
    cursor, pos = 0, {}
    for i in order:
        ids.extend(hay_ids[cursor:places[i]])
        cursor = places[i]
        pos[i] = len(ids)
        ids.extend(fact_ids[i])
    ids.extend(hay_ids[cursor:])
    ids.extend(q_ids)
    assert len(ids) == int(length) - int(new_tokens), (len(ids), length, new_tokens)
    facts = []
    if kind == "kv":
        for j, ((t, k), n) in enumerate(zip(specs, nums)):
            facts.append(Fact(KV_LINE.format(k=k, n=n), n, k, pos[0], places[0] / H, j == asked))
    else:
        for i, ((t, k), n) in enumerate(zip(specs, nums)):
            facts.append(Fact(texts[i].strip(), n, k, pos[i], places[i] / H, i == asked))
    answer = nums[asked]
    return Case(kind=kind, length=int(length), depth=float(depth), needles=len(specs), index=int(index), ids=ids,
                answer=answer, answer_ids=_answer_ids(tok, cue, answer), cue=cue, facts=facts,
                new_tokens=int(new_tokens), haystack=(int(start), int(end)))


def _check_grid(lengths, depths, positions) -> None:
    if not lengths:
        raise NeedleError("lengths", "''", "give at least one length")
    for L in lengths:
        if int(L) != L or L < 1:
            raise NeedleError("lengths", L, "a length is a positive number of tokens")
        if positions is not None and L > positions:
            raise NeedleError("lengths", L, f"above the {positions:,} positions the model takes")
    if not depths:
        raise NeedleError("depths", "''", "give at least one depth")
    for d in depths:
        if not (isinstance(d, (int, float)) and math.isfinite(d) and 0.0 <= d <= 1.0):
            raise NeedleError("depths", d, "a depth is a fraction of the haystack, 0..1")


def make_cases(tokenizer, text, lengths=LENGTHS, depths=DEPTHS, kinds=KINDS, cases: int = 1, seed: int = 0,
               new_tokens: int = NEW_TOKENS, positions: int | None = None) -> list[Case]:
    """Every (kind, length, depth) cell's ``cases`` cases, in that order (``text``: a str or a
    :class:`Haystack`). ``positions``: the model's positions (a longer length is refused). Bad values
    raise :class:`NeedleError`."""
    kinds = parse_kinds(kinds)
    lengths, depths = [int(x) for x in lengths], [float(x) for x in depths]
    _check_grid(lengths, depths, positions)
    if int(cases) < 1:
        raise NeedleError("cases", cases, "at least 1 case per cell")
    if int(seed) < 0:
        raise NeedleError("seed", seed, "a seed is an integer >= 0")
    hay = text if isinstance(text, Haystack) else Haystack(tokenizer, text)
    if len(hay) < max(lengths):
        raise NeedleError("text", f"({len(hay):,} tokens)", f"too short for length {max(lengths):,}")
    return [make_case(hay, k, L, d, i, seed, new_tokens) for k in kinds for L in lengths for d in depths
            for i in range(int(cases))]


# --------------------------------------------------------------------------- running
@dataclass
class CaseResult:
    kind: str
    length: int
    depth: float
    needles: int
    index: int
    answer: str
    hit: bool
    text: str           # the greedy continuation, decoded
    logprob: float      # the answer's teacher-forced log-probability (nats, summed over its tokens)
    tokens: list = field(default_factory=list)

    @property
    def cell(self) -> tuple:
        return (self.kind, self.length, self.depth, self.needles)

    @property
    def name(self) -> str:
        return f"{self.kind} {self.length} depth {self.depth:g} #{self.index}"


def is_hit(text: str, answer: str) -> bool:
    """The hit rule: the first number in the continuation is the answer."""
    m = _NUMBER.search(text)
    return m is not None and m.group(0) == answer


def _logprob(logits, token: int) -> float:
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = x.max()
    return float(x[token] - m - math.log(np.exp(x - m).sum()))


class _Mark:
    """A Decoder's state after the prompt, to rewind to (the decode steps after it are redone)."""

    def __init__(self, dec: Decoder):
        self.length, self.past, self.seq = dec.length, dec.past, len(dec.seq)

    def rewind(self, dec: Decoder) -> None:
        dec.length = self.length
        if dec.kv is not None:      # shared buffers: the rows from length on are written again
            dec.kv.length = self.length
        dec.past = self.past        # growing state: the prompt's presents (a step's Concat made new arrays)
        del dec.seq[self.seq:]      # rerun


def _reset(dec: Decoder) -> None:
    dec.length, dec.past = 0, None
    del dec.seq[:]
    if dec.kv is not None:
        dec.kv.length = 0


def run_case(dec: Decoder, tokenizer, case: Case, stop: set | frozenset = frozenset(),
             prefill_chunk: int = PREFILL_CHUNK) -> CaseResult:
    """One case on a :class:`Decoder` (reset first; its ``max_len`` ≥ the case's length): the prompt
    prefilled in chunks, ``new_tokens`` greedy tokens (stopping at a ``stop`` id), the answer's
    log-probability."""
    _reset(dec)
    ids = case.ids
    chunk = prefill_chunk if dec.chunkable else len(ids)
    for c0 in range(0, len(ids), chunk):
        logits = dec.feed(ids[c0:c0 + chunk], more=c0 + chunk < len(ids))
    mark = _Mark(dec)
    ans = list(case.answer_ids)
    lps: list[float] = [_logprob(logits, ans[0])]
    new: list[int] = []
    for step in range(case.new_tokens):
        nxt = int(np.argmax(logits))
        new.append(nxt)
        if nxt in stop or step == case.new_tokens - 1:
            break
        logits = dec.feed([nxt])
        j = len(new)
        if j < len(ans) and new == ans[:j]:     # still the answer's path: its next token's log-probability
            lps.append(_logprob(logits, ans[j]))
    if len(lps) < len(ans):                     # greedy left the answer: teacher-force it from the prompt's end
        mark.rewind(dec)
        lps = lps[:1]
        for j in range(1, len(ans)):
            lps.append(_logprob(dec.feed([ans[j - 1]]), ans[j]))
    text = tokenizer.decode([t for t in new if t not in stop], skip_special_tokens=True)
    return CaseResult(kind=case.kind, length=case.length, depth=case.depth, needles=case.needles, index=case.index,
                      answer=case.answer, hit=is_hit(text, case.answer), text=text, logprob=float(sum(lps)), tokens=new)


def run_cases(sess, io: ModelIO, tokenizer, cases: Sequence[Case], model_path=None, shared: bool | None = None,
              eos="model", prefill_chunk: int = PREFILL_CHUNK, progress: bool | Callable = False,
              stop_when: Callable[[Case, CaseResult], bool] | None = None) -> list[CaseResult]:
    """Every case through one :class:`Decoder` of the session (``model_path``: the file, which lets the
    loop see the graph; ``shared`` forces the shared K/V buffers on or off). ``eos``: "model" (the
    model's own end ids, :func:`generate.model_eos_ids`), or what ``generate`` takes. ``stop_when``:
    stop after a case for which it returns True (the results so far are returned)."""
    if io.kind != "causal-lm" or not io.logits_name:
        raise ValueError("needle retrieval needs a causal LM with a logits output")
    if not cases:
        return []
    if eos == "model":
        eos = model_eos_ids(model_path, tokenizer) if model_path is not None else "auto"
    stop = frozenset(_eos_ids(tokenizer, eos))
    max_len = max(len(c.ids) + c.new_tokens for c in cases)
    dec = Decoder(sess, io, max_len=max_len, model_path=model_path, shared=shared)
    it = cases
    bar = None
    if progress is True:
        from tqdm import tqdm

        it = bar = tqdm(cases, desc="needle", unit="case", leave=False)
    out = []
    for c in it:
        r = run_case(dec, tokenizer, c, stop, prefill_chunk)
        out.append(r)
        if callable(progress):
            progress(c, r)
        if stop_when is not None and stop_when(c, r):
            break
    if bar is not None:
        bar.close()
    return out


# --------------------------------------------------------------------------- comparing
def _key(r) -> tuple:
    return (r.kind, r.length, r.depth, r.needles, r.index)


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.mean(xs)) if xs else None


def compare(model: Sequence[CaseResult], reference: Sequence[CaseResult] | None = None) -> dict:
    """The model's results against the reference's (the same cases; None: the model alone), as a
    JSON-able dict: ``cells`` (per kind, length, depth, needles: cases, hits, ref_hits, lost, mean
    answer log-probabilities), ``cases`` (every case of both), ``summary`` (cases, hits, ref_hits,
    lost, gained) and ``lost`` (the cases the reference hits and the model misses: the gate)."""
    ref = {_key(r): r for r in (reference or [])}
    cells: dict[tuple, dict] = {}
    rows, lost_rows = [], []
    for r in model:
        f = ref.get(_key(r))
        c = cells.setdefault(r.cell, {"kind": r.kind, "length": r.length, "depth": r.depth, "needles": r.needles,
                                      "cases": 0, "hits": 0, "ref_hits": 0 if reference is not None else None,
                                      "lost": 0, "_lp": [], "_rlp": []})
        c["cases"] += 1
        c["hits"] += int(r.hit)
        c["_lp"].append(r.logprob)
        row = {"kind": r.kind, "length": r.length, "depth": r.depth, "needles": r.needles, "index": r.index,
               "answer": r.answer, "hit": r.hit, "text": r.text, "logprob": r.logprob}
        if f is not None:
            c["ref_hits"] += int(f.hit)
            c["_rlp"].append(f.logprob)
            row.update(ref_hit=f.hit, ref_text=f.text, ref_logprob=f.logprob)
            if f.hit and not r.hit:
                c["lost"] += 1
                lost_rows.append(row)
        rows.append(row)
    out_cells = []
    for c in cells.values():
        lp, rlp = c.pop("_lp"), c.pop("_rlp")
        c["logprob"] = _mean(lp)
        c["ref_logprob"] = _mean(rlp) if reference is not None else None
        out_cells.append(c)
    summary = {"cases": len(rows), "hits": sum(r["hit"] for r in rows)}
    if reference is not None:
        summary.update(ref_hits=sum(bool(r.get("ref_hit")) for r in rows), lost=len(lost_rows),
                       gained=sum(1 for r in rows if r["hit"] and r.get("ref_hit") is False))
    return {"task": "needle", "cells": out_cells, "cases": rows, "summary": summary, "lost": lost_rows}


def lost(sess, io, sess_ref, io_ref, tokenizer, cases: Sequence[Case], model_path=None, ref_path=None,
         fail_fast: bool = False) -> list[CaseResult]:
    """The cases the reference finds and the model loses (the model runs only the reference's hits)."""
    suite = NeedleSuite(tokenizer, list(cases))
    suite.prepare(sess_ref, io_ref, model_path=ref_path)
    return suite.lost(sess, io, model_path=model_path, fail_fast=fail_fast)


class NeedleSuite:
    """Cases made once, the reference's results kept: a tuner checks trial sessions against them.

        suite = NeedleSuite.build(tok, text, lengths=[4096], positions=cap)
        suite.prepare(sess_ref, io_ref, model_path=ref)       # once
        if suite.lost(trial, io_trial, fail_fast=True): ...    # the trial loses a needle: refuse it
    """

    def __init__(self, tokenizer, cases: list[Case], **run_options):
        self.tok, self.cases, self.run_options = tokenizer, list(cases), dict(run_options)
        self.reference: list[CaseResult] | None = None

    @classmethod
    def build(cls, tokenizer, text, lengths=LENGTHS, depths=DEPTHS, kinds=KINDS, cases: int = 1, seed: int = 0,
              new_tokens: int = NEW_TOKENS, positions: int | None = None, **run_options) -> "NeedleSuite":
        return cls(tokenizer, make_cases(tokenizer, text, lengths, depths, kinds, cases, seed, new_tokens, positions),
                   **run_options)

    def run(self, sess, io, model_path=None, cases: Sequence[Case] | None = None, **kw) -> list[CaseResult]:
        opts = {**self.run_options, **kw}
        return run_cases(sess, io, self.tok, self.cases if cases is None else cases, model_path=model_path, **opts)

    def prepare(self, sess_ref, io_ref, model_path=None, **kw) -> list[CaseResult]:
        """The reference's results on every case (kept)."""
        self.reference = self.run(sess_ref, io_ref, model_path=model_path, **kw)
        return self.reference

    @property
    def found(self) -> list[Case]:
        """The cases the reference finds."""
        if self.reference is None:
            raise RuntimeError("NeedleSuite: prepare() the reference first")
        hit = {_key(r) for r in self.reference if r.hit}
        return [c for c in self.cases if (c.kind, c.length, c.depth, c.needles, c.index) in hit]

    def lost(self, sess, io, model_path=None, fail_fast: bool = False, **kw) -> list[CaseResult]:
        """The model's results on the cases the reference finds that it misses (empty: it passes).
        ``fail_fast``: stop at the first loss (a tuner's refusal needs only one)."""
        stop_when = (lambda c, r: not r.hit) if fail_fast else None
        res = self.run(sess, io, model_path=model_path, cases=self.found, stop_when=stop_when, **kw)
        return [r for r in res if not r.hit]

    def compare(self, model: Sequence[CaseResult]) -> dict:
        return compare(model, self.reference)


# --------------------------------------------------------------------------- the table
def format_table(res: dict) -> str:
    """Rows length × depth, columns kinds, cells "model hits / reference hits" (of the cell's cases),
    totals per kind, the mean answer log-probabilities, then the lost needles."""
    cells = res["cells"]
    has_ref = res["summary"].get("ref_hits") is not None
    kinds = list(dict.fromkeys(c["kind"] for c in cells))
    needles = {c["kind"]: c["needles"] for c in cells}
    grid = {(c["kind"], c["length"], c["depth"]): c for c in cells}
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})

    def cell(c) -> str:
        if c is None:
            return "-"
        return f"{c['hits']}/{c['ref_hits']}" if has_ref else f"{c['hits']}"

    per = sorted({c["cases"] for c in cells})
    head = [f"{k} ({needles[k]} needle{'s' if needles[k] != 1 else ''})" for k in kinds]
    rows = [["length", "depth", *head]]
    for L in lengths:
        for d in depths:
            rows.append([f"{L:,}", f"{d:g}", *(cell(grid.get((k, L, d))) for k in kinds)])
    tot = []
    for k in kinds:
        cs = [c for c in cells if c["kind"] == k]
        h, n = sum(c["hits"] for c in cs), sum(c["cases"] for c in cs)
        tot.append(f"{h}/{sum(c['ref_hits'] for c in cs)}" if has_ref else f"{h}")
        tot[-1] += f" of {n}"
    rows.append(["all", "", *tot])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    s = res["summary"]
    what = "model hits / reference hits" if has_ref else "model hits"
    lines.append(f"needle retrieval ({what}; {', '.join(map(str, per))} case{'s' if per != [1] else ''} per cell, "
                 f"greedy, {res.get('new_tokens', NEW_TOKENS)} new tokens; hit = the first number generated is the answer)"
                 + (f" on {res['text_name']}" if res.get("text_name") else ""))
    for r in rows:
        lines.append("  " + "  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(r, widths))))
    lp = []
    for k in kinds:
        cs = [c for c in cells if c["kind"] == k]
        m = _mean([c["logprob"] for c in cs for _ in range(c["cases"])])
        part = f"{k} model {m:.2f}" if m is not None else f"{k} model -"
        if has_ref:
            rm = _mean([c["ref_logprob"] for c in cs for _ in range(c["cases"])])
            part += f", reference {rm:.2f}" if rm is not None else ", reference -"
        lp.append(part)
    lines.append("answer log-probability (teacher-forced, nats, mean): " + "; ".join(lp))
    if has_ref:
        lines.append(f"model {s['hits']}/{s['cases']} hits, reference {s['ref_hits']}/{s['cases']}; "
                     f"lost: {s['lost']} needle{'s' if s['lost'] != 1 else ''} the reference finds"
                     + (f"; gained: {s['gained']}" if s.get("gained") else ""))
        for r in res["lost"]:
            lines.append(f"  lost: {r['kind']} {r['length']:,} depth {r['depth']:g} #{r['index']}: answer {r['answer']}, "
                         f"model {r['text']!r}, reference {r['ref_text']!r}")
    else:
        lines.append(f"model {s['hits']}/{s['cases']} hits")
    return "\n".join(lines)

