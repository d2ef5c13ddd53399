"""The `ortlean` command line."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import traceback
from pathlib import Path

from .errors import OrtleanError
from .kit import options
from .kit.options import RewriteConfig, StatePack, thread_counts

from models.prepare import MODELS as _MODELS  # stdlib-only module: names of the packaged models

PACKAGED = list(_MODELS)

EXIT_INTERNAL_ERROR = 1   # a bug in ortlean: traceback + a request to report it
EXIT_USER_ERROR = 2       # bad input (file, flag, value, name): one line on stderr, nothing written
EXIT_NOTHING_WRITTEN = 3


BENCH_THREADS = [1, 2]     # bench / demo: thread counts compared
RUN_THREADS = [2]          # eval / generate


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (the flag and the value at fault), exit 2."""

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _count(least: int):
    """argparse type: an integer ≥ `least`."""
    def parse(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {v!r}") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"must be ≥ {least}, got {v!r}")
        return n
    parse.__name__ = "count"
    return parse


def _nbits(v: str) -> list[int]:
    """argparse type for bench --nbits: a comma list of 2 | 4 | 8, or none."""
    if v.strip().lower() in ("none", ""):
        return []
    try:
        bits = [int(b) for b in v.split(",") if b.strip()]
    except ValueError:
        bits = []
    if not bits or any(b not in (2, 4, 8) for b in bits):
        raise argparse.ArgumentTypeError(f"expected a comma list of 2, 4, 8 or 'none', got {v!r}")
    return bits


def _lengths(what: str, none: bool = False):
    """argparse type: a comma list of token counts (≥ 1; "4k" = 4096), or with ``none`` the word none (an
    empty list); ``what`` names the values in the error."""
    def parse(v: str) -> list[int]:
        if none and v.strip().lower() == "none":
            return []
        out = []
        try:
            for x in (x.strip().lower() for x in v.split(",")):
                if x:
                    out.append(int(x[:-1]) * 1024 if x.endswith("k") else int(x))
        except ValueError:
            out = []
        if not out or min(out) < 1:
            raise argparse.ArgumentTypeError(f"expected a comma list of {what} in tokens (≥ 1, e.g. 4096,16k)"
                                             + (" or 'none'" if none else "") + f", got {v!r}")
        return out
    parse.__name__ = "lengths"
    return parse


def _labelled(v: str) -> tuple[str, str]:
    """argparse type for bench --also: LABEL=MODEL."""
    label, sep, path = v.partition("=")
    if not sep or not label.strip() or not path.strip() or "|" in label:
        raise argparse.ArgumentTypeError(f"expected LABEL=MODEL (a row name without '|', then the model file), got {v!r}")
    return label.strip(), path.strip()


def _add_backend_flags(p: argparse.ArgumentParser) -> None:
    from . import backends

    StatePack.add_flags(p)
    for b in backends.all_backends():
        b.add_flags(p)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="ortlean", description="ONNX graph rewriter + ONNX Runtime custom CPU ops")
    ap.add_argument("--version", action="store_true", help="print versions and exit")
    ap.add_argument("--library-path", action="store_true",
                    help="print the path of the custom-op library (for onnxruntime_perf_test -R, "
                    "SessionOptions.register_custom_ops_library) and exit")
    sub = ap.add_subparsers(dest="cmd")

    p = sub.add_parser("rewrite", help="rewrite weight MatMuls into ortlean custom ops")
    p.add_argument("model")
    p.add_argument("-o", "--output", help="output model (default: MODEL with .lean.onnx)")
    options.add_flags(p, RewriteConfig)
    p.add_argument("-q", "--quiet", action="store_true")
    _add_backend_flags(p)

    p = sub.add_parser("import", help="a GGUF (llama, qwen2, gemma3) straight to the fused ONNX graph holding its own "
                       "blocks (BlockQuantMatMul), with its tokenizer, chat template and config files beside it: no "
                       "torch, transformers or float32 export (docs/import.md)")
    p.add_argument("gguf", help="the GGUF file")
    p.add_argument("-o", "--output", required=True, help="the model file to write, DIR/model.onnx (the tokenizer and "
                   "config files go to DIR)")
    p.add_argument("--attn-exact", choices=["auto", "on", "off"], default="auto",
                   help="GroupQueryAttention → PackedAttention's exact fp32 cache mode, as `ortlean rewrite` does: auto "
                   "(default: when it measures faster on this CPU) | on | off (keep GroupQueryAttention, which "
                   "onnxruntime-genai runs)")
    p.add_argument("--weights-layout", choices=["auto", "blocks", "split"], default="auto",
                   help="BlockQuantMatMul's row layout, as in `ortlean rewrite` (default auto: split where the format "
                   "takes it)")
    p.add_argument("--weights-act-bits", choices=["auto", "8", "16"], default="auto",
                   help="BlockQuantMatMul's activation integers (default auto: 16 on the GGUF's exact blocks)")
    p.add_argument("--weights-glu", choices=["on", "off"], default="on",
                   help="a SwiGLU MLP's gate and up projections as one BlockQuantMatMul (glu silu; default on)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")

    p = sub.add_parser("inspect", help="ops, layers and ortlean attributes of a model")
    p.add_argument("model")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("eval", help="quality vs a dense reference: Δperplexity (causal LM) or embedding cosine "
                       "(encoder); --task needle: retrieval of facts hidden in long prose")
    p.add_argument("model")
    p.add_argument("--ref", required=True, help="the dense model")
    p.add_argument("--text", required=True, help="held-out text file (--task needle: the haystack's prose)")
    p.add_argument("--task", choices=["ppl", "needle"], default="ppl",
                   help="ppl: Δperplexity / embedding cosine (default); needle: needle-in-a-haystack retrieval, hits "
                   "per length and depth for the model and --ref, and the needles --ref finds that the model loses "
                   "(docs/retrieval.md)")
    p.add_argument("--lengths", type=_lengths("case lengths"), default=None, metavar="N[,N...]",
                   help="--task needle: positions each case fills, prompt + new tokens (default 2048,4096,8192, those "
                   "the models take; e.g. 4k,16k,32k)")
    p.add_argument("--depths", default=None, metavar="D[,D...]",
                   help="--task needle: where the asked needle goes, fractions of the haystack 0..1 (default "
                   "0.1,0.3,0.5,0.7,0.9)")
    p.add_argument("--needle-kinds", default=None, metavar="KIND[,KIND...]",
                   help="--task needle: passkey (one pass key), kv (a block of key-value lines, one asked), multi "
                   "(several pass keys, one asked) (default all three)")
    p.add_argument("--cases", type=_count(1), default=None, help="--task needle: cases per cell (default 1)")
    p.add_argument("--seed", type=int, default=None, help="--task needle: the cases' seed (default 0)")
    p.add_argument("-q", "--quiet", action="store_true", help="--task needle: no progress lines on stderr")
    p.add_argument("--needle-cache", default=None, metavar="DIR",
                   help="--task needle: keep each model's case results in DIR by a stamp of its files, the cases, "
                   "the thread count, ortlean's code and library, and reuse them under the same stamp (the "
                   "reference of several models runs once)")
    p.add_argument("--window", type=_count(2), default=512)
    p.add_argument("--windows", type=_count(1), default=8, help="number of windows (causal LM) (default 8)")
    p.add_argument("--sentences", type=_count(1), default=256, help="sentences (encoder) (default 256)")
    p.add_argument("--decode-context", type=_count(1), default=None,
                   help="decode-mode (a model that approximates in decode, e.g. PackedAttention with a budget; "
                   "given, any model — e.g. int8 K/V rows at budget 1 after a long context): prefill tokens before "
                   "the scored decode steps (default 1024, or the shortest context at which the model "
                   "approximates when that is longer — its min_context + 1; capped by the model's positions)")
    p.add_argument("--decode-score", type=_count(1), default=256,
                   help="decode-mode: teacher-forced decode steps scored per window (default 256; 4 windows: "
                   "1,024 tokens, the --attn-tune sample; the output adds the Δppl's one-sided 95 %% upper bound)")
    p.add_argument("--threads", type=thread_counts, default=RUN_THREADS)
    p.add_argument("--tokenizer")
    p.add_argument("--peers", default="auto", help="also the genai builder's fp32/int4 models of the same checkpoint: "
                   "auto (when --ref is a packaged model's export, default) | none | a packaged model name")
    p.add_argument("--json", help="write results as JSON here")

    p = sub.add_parser("bench", help="prefill/decode speed vs the dense model in the same run")
    p.add_argument("model")
    p.add_argument("--ref", required=True, help="the dense model")
    p.add_argument("--threads", type=thread_counts, default=BENCH_THREADS, help="comma list (default 1,2)")
    p.add_argument("--prefill", type=_count(1), default=128, help="prefill tokens (default 128)")
    p.add_argument("--decode-past", type=_lengths("past lengths", none=True), default=None,
                   help="past length(s) for decode steps, comma list (default 128; 128,1024,4096,8192 for a model "
                   "that approximates in decode, e.g. PackedAttention with a budget; capped by the positions); none: "
                   "no decode table (with --prompt: the time to first token alone)")
    p.add_argument("--repeats", type=_count(1), default=15)
    p.add_argument("--prompt", type=_lengths("prompt lengths"), default=None, metavar="N[,N...]",
                   help="causal LMs: also the time to first token (TTFT) of an N-token prompt (the start of the "
                   "held-out novel) for every row at every thread count — ours as `ortlean generate` runs it, genai's "
                   "models in their generator, llama.cpp with `llama-bench -p N -n 0`; e.g. 4096,16384,32760 (an N "
                   "beyond the models' positions is an error)")
    p.add_argument("--prompt-repeats", type=_count(1), default=None, metavar="R",
                   help="--prompt: timed runs per length after one untimed round (default min(--repeats, 3) below "
                   "8,192 tokens, 1 from 8,192 on)")
    p.add_argument("--prompt-chunk", type=_count(1), default=None, metavar="TOKENS",
                   help="--prompt: prompt tokens per run (default 512, `ortlean generate`'s --prefill-chunk; genai's "
                   "generator gets the same chunks; llama-bench its own 512-token ubatches)")
    p.add_argument("--prompt-text", default=None, metavar="FILE",
                   help="--prompt: the prompt's text (default: the held-out novel, `ortlean corpus --eval`), "
                   "tokenized by --tokenizer (default: beside --ref)")
    p.add_argument("--steps", type=_count(1), default=16, help="decode steps per past length and round (default 16)")
    p.add_argument("--peers", default="auto", help="rows for the genai builder's fp32/int4 models and llama.cpp: auto "
                   "(when --ref is a packaged model's export, default) | none | a packaged model name")
    p.add_argument("--no-llama", action="store_true", help="skip the llama.cpp rows")
    p.add_argument("--no-genai", action="store_true", help="skip the onnxruntime-genai rows")
    p.add_argument("--past-cache", default=None, metavar="DIR|off",
                   help="causal LMs: keep the caches of pasts above 512 tokens in DIR (default: "
                   "<ortlean cache>/pasts), by the building model's file stamp and the token ids, and load them "
                   "in later runs instead of prefilling again; off: build them in memory for this run only")
    p.add_argument("--rows", choices=["all", "best"], default="all",
                   help="decoders: all = every model under every driver it runs with (plain loop, shared K/V "
                   "buffers, onnxruntime-genai's generator; default); best = each model once, under its fastest "
                   "driver (the dense model then is the quality reference only, genai's fp32 model is left out)")
    p.add_argument("--nbits", type=_nbits, default=[8, 4],
                   help="MatMulNBits comparison rows, comma list of bits (2, 4, 8), or 'none'")
    p.add_argument("--no-profile", action="store_true", help="skip the ORT per-node profile (causal LMs: of decode "
                   "steps after the longest past, dense and lean, at every thread count)")
    p.add_argument("--huge-pages", choices=["on", "off"], default="on",
                   help="decoders: after the warm-up round, every row's memory (weights and caches alike) on 2 MiB "
                   "pages (Linux transparent huge pages, MADV_COLLAPSE; default on)")
    p.add_argument("--also", action="append", type=_labelled, default=[], metavar="LABEL=MODEL",
                   help="another rewritten model measured as a row of the same run (repeatable), e.g. "
                   "--also fast=fast/model.onnx")
    p.add_argument("--label", default=None, help="the row name of MODEL in --json's rows (default: lean)")
    p.add_argument("--quality-text", default=None, metavar="FILE",
                   help="causal LMs: also Δppl of every row against --ref on this held-out text, measured as "
                   "`ortlean eval` does (decode-mode when a row approximates in decode)")
    p.add_argument("--quality-cache", default=None, metavar="DIR",
                   help="--quality-text: keep every row's scores in DIR by a stamp of its files, the text and mode, "
                   "ortlean's code and library, and reuse them under the same stamp (as `ortlean demo` does)")
    p.add_argument("--tokenizer", help="tokenizer.json for --quality-text and --prompt (default: beside --ref)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="write ONNX Runtime's profiler trace (chrome trace JSON) of every row at every thread count "
                   "into DIR as <row>.t<threads>.json (decoders: decode steps after the longest past)")
    p.add_argument("--json", help="write results as JSON here (the results schema: docs/benchmarking.md)")

    p = sub.add_parser("perf", help="latency percentiles of one model's runs with ortlean's library registered "
                       "(what onnxruntime_perf_test does)")
    p.add_argument("model")
    p.add_argument("--inputs", metavar="FILE.npz", help="the inputs (an .npz of input name -> array); default: made "
                   "from the model's declared inputs (random token ids, masks of ones, the model's own cache)")
    p.add_argument("--iterations", "-r", type=_count(1), default=100, help="timed runs (default 100)")
    p.add_argument("--warmup", type=_count(0), default=5, help="untimed runs first (default 5)")
    p.add_argument("--threads", "-x", type=_count(1), default=1, help="intra-op threads (default 1)")
    p.add_argument("--past", type=_count(0), default=0,
                   help="causal LMs: cached tokens before the run (the model's own prefill of random tokens; default 0)")
    p.add_argument("--seq", type=_count(1), default=None,
                   help="new tokens per run (default 1 with --past, else 128)")
    p.add_argument("--batch", type=_count(1), default=1)
    p.add_argument("--prompt", type=_count(1), default=None, metavar="N",
                   help="causal LMs: a run is an N-token prompt of random ids read from an empty cache, as `ortlean "
                   "generate` reads it (--chunk-token runs, the head on the last position): the time to first token")
    p.add_argument("--chunk", type=_count(1), default=None, metavar="TOKENS",
                   help="--prompt: prompt tokens per run (default generate's --prefill-chunk, 512)")
    p.add_argument("--profile", action="store_true",
                   help="also ONNX Runtime's per-node profile of the same runs (a second session with the profiler "
                   "on, after the timed runs): time and share per op type, the attention nodes' share")
    p.add_argument("--json", action="store_true", help="print the result as JSON")

    p = sub.add_parser("generate", help="generate text with the KV cache, streamed (greedy by default; --chat, "
                       "sampling, long prompts from a file); a closing line on stderr gives prefill and decode tok/s")
    p.add_argument("model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this UTF-8 text file ('-': standard input)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template "
                   "(chat_template.jinja or tokenizer_config.json's chat_template beside the model), with the "
                   "assistant's turn opened")
    p.add_argument("--system", help="with --chat: a system message before the prompt")
    p.add_argument("--max-new-tokens", type=_count(1), default=256, help="stop after this many new tokens (default 256; "
                   "generation also stops at the model's end-of-sequence tokens and at its context length)")
    p.add_argument("--temperature", type=_nonneg_float, default=0.0,
                   help="0 (default): greedy; > 0: sample from softmax(logits / temperature)")
    p.add_argument("--top-k", type=_count(0), default=0, help="sampling: only the k most likely tokens (default 0: all)")
    p.add_argument("--top-p", type=_unit_float, default=1.0,
                   help="sampling: the fewest most likely tokens whose probability reaches p (default 1: all)")
    p.add_argument("--seed", type=_count(0), default=None, help="sampling: random seed (default: a fresh one, printed "
                   "in the closing line so the run can be repeated)")
    p.add_argument("--prefill-chunk", type=_count(1), default=512,
                   help="prompt tokens per prefill run (default 512: bounded attention scratch for long prompts)")
    p.add_argument("--threads", type=thread_counts, default=RUN_THREADS)
    p.add_argument("--tokenizer")
    p.add_argument("--document", help="a UTF-8 text file the prompt is about ('-': standard input): it goes "
                   "first (with --chat, first in the user's message), then a blank line and --prompt / --prompt-file; "
                   "with --prompt-cache the cache holds the document, so another question about it loads the cache")
    p.add_argument("--prompt-cache", metavar="FILE", help="keep the prompt's state in FILE: written after the first "
                   "token when FILE does not exist; when it does, a prompt that starts with its tokens loads it and "
                   "prefills only the rest (another model's, another prompt's or a damaged file is refused; format: "
                   "docs/generate.md)")
    p.add_argument("--prompt-cache-refresh", action="store_true",
                   help="rebuild --prompt-cache FILE from this prompt even when it exists")
    p.add_argument("--json", metavar="FILE", help="also record the run (the closing line's figures, the text, the "
                   "command, commit, machine and date) in FILE: a new file, or one this option wrote before, to "
                   "which the run is added (runs of one session of questions side by side); any other file is "
                   "refused")

    p = sub.add_parser("models", help="prepare the packaged real models as ONNX (cached)")
    msub = p.add_subparsers(dest="mcmd")
    pp = msub.add_parser("prepare")
    pp.add_argument("name", choices=PACKAGED)
    pp.add_argument("--force", action="store_true")
    pp = msub.add_parser("path")
    pp.add_argument("name", choices=PACKAGED)

    p = sub.add_parser("corpus", help="fetch Jane Austen's novels (Debian r-cran-janeaustenr), print their paths")
    p.add_argument("--calib", action="store_true", help="print only the calibration novel's path")
    p.add_argument("--eval", action="store_true", help="print only the evaluation novel's path")

    p = sub.add_parser("demo", help="prepare a real model, rewrite it with the best recipes (GGUF-packaged decoders: "
                       "lossless GGUF weights, and those with tuned long-context PackedAttention; encoders: int8) and "
                       "measure quality and speed against onnxruntime-genai and llama.cpp in one run; any backend "
                       "flag replaces the recipes")
    p.add_argument("name", choices=PACKAGED)
    p.add_argument("--out", default=None, help="working directory (default: <cache>/demo/<name>)")
    p.add_argument("--threads", type=thread_counts, default=BENCH_THREADS, help="comma list for the bench (default 1,2)")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--decode-past", type=thread_counts, default=[128, 4096, 8192],
                   help="past lengths of the decode table (causal LMs), comma list (default 128,4096,8192; capped "
                   "by the model's positions)")
    p.add_argument("--prompt", type=_lengths("prompt lengths", none=True), default=None, metavar="N[,N...]|none",
                   help="prompt lengths of the time-to-first-token columns (causal LMs; default 4096, and "
                   "4096,16384,32768 for qwen2.5-coder-1.5b; capped by the models' positions as the decode pasts "
                   "are; none: no TTFT)")
    p.add_argument("--repeats", type=_count(1), default=2, help="timed rounds per row after an untimed one "
                   "(default 2: rows interleave in every round; medians over rounds and steps)")
    p.add_argument("--steps", type=_count(1), default=8, help="decode steps per past length and round (default 8)")
    p.add_argument("--rows", choices=["all", "best"], default="best",
                   help="best = each model timed once, under its fastest driver (default: ours and GQA peers with "
                   "shared K/V buffers, genai's int4 model in its own generator, llama.cpp in llama-bench; the "
                   "dense model is the quality reference); all = every driver, as `ortlean bench` times them")
    p.add_argument("--fresh", action="store_true", help="rewrite again even when the work directory holds the "
                   "same recipe's rewrite of the same source by the same ortlean")
    options.add_flags(p, RewriteConfig, only=("quality_budget",))
    _add_backend_flags(p)
    return ap


def _user_errors() -> tuple[type[Exception], ...]:
    """The exceptions that mean bad input (their message names what is wrong), not a bug."""
    from models.corpus import CorpusError
    from models.prepare import PrepareError

    import custom_ops

    return OrtleanError, PrepareError, CorpusError, custom_ops.LibraryNotFoundError


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:   # usage error (one line, see _Parser) or --help
        return e.code if isinstance(e.code, int) else EXIT_USER_ERROR
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line, recorded in bench --json
    if args.version:
        return _version()
    if args.library_path:
        return _library_path()
    if not args.cmd:
        ap.print_help()
        return EXIT_USER_ERROR
    user_errors = _user_errors()
    try:
        return {
            "rewrite": cmd_rewrite, "inspect": cmd_inspect, "eval": cmd_eval, "bench": cmd_bench,
            "generate": cmd_generate, "models": cmd_models, "corpus": cmd_corpus, "demo": cmd_demo,
            "perf": cmd_perf, "import": cmd_import,
        }[args.cmd](args)
    except user_errors as e:
        print(f"ortlean {args.cmd}: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception:  # a bug: the traceback, then what to do with it
        traceback.print_exc()
        print(f"ortlean {args.cmd}: internal error (a bug in ortlean, not in your input): please report it as an "
              "issue with the output of `ortlean --version`, the command line and the traceback above", file=sys.stderr)
        return EXIT_INTERNAL_ERROR


def _version() -> int:
    import onnxruntime as ort

    from . import __version__

    print(f"ortlean {__version__}, onnxruntime {ort.__version__}")
    try:
        import custom_ops

        print(f"library {custom_ops.library_path()} (isa {custom_ops.isa_label()})")
    except Exception as e:
        print(f"library: {e}")
    return 0


def _library_path() -> int:
    import custom_ops

    try:
        print(custom_ops.library_path())
    except custom_ops.LibraryNotFoundError as e:
        print(f"ortlean --library-path: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


# --------------------------------------------------------------------------- rewrite
def _backend_configs(args) -> dict:
    """Every registered backend's config from the parsed flags (the shared --state-pack* group parsed once)."""
    from . import backends

    state_pack = StatePack.from_args(args)
    return {b.name: b.config(args, state_pack) for b in backends.all_backends()}


def cmd_rewrite(args) -> int:
    from . import pipeline

    cfg = options.from_args(RewriteConfig, args, model=args.model,
                            output=args.output or pipeline.default_output(args.model),
                            backends=_backend_configs(args), progress=not args.quiet)
    summary = pipeline.run(cfg)
    print(pipeline.format_report(summary))
    return 0 if summary["output"] else EXIT_NOTHING_WRITTEN


# --------------------------------------------------------------------------- import
def cmd_import(args) -> int:
    from .gguf_import import format_summary, import_gguf

    summary = import_gguf(args.gguf, args.output, attn_exact=args.attn_exact, layout=args.weights_layout,
                          act_bits=args.weights_act_bits, glu=args.weights_glu, progress=not args.quiet)
    print(format_summary(summary))
    return 0


# --------------------------------------------------------------------------- inspect
def cmd_inspect(args) -> int:
    from collections import Counter

    from .kit import candidates as g, modelfile

    model = modelfile.load_model(args.model)
    ops = Counter(f"{n.domain + '::' if n.domain else ''}{n.op_type}" for n in model.graph)
    custom = []
    for n in g.ortlean_nodes(model):
        attrs = {}
        for k, a in n.attributes.items():
            v = a.value
            if isinstance(v, (list, tuple)) or hasattr(v, "__iter__") and not isinstance(v, str):
                v = list(v)
            attrs[k] = v
        custom.append({"name": n.name, "op": n.op_type, "attributes": attrs})
    cands = g.find_candidates(model)
    unsupported = g.find_unsupported(model)
    info = {
        "model": args.model,
        "ir_version": model.ir_version,
        "opsets": dict(model.opset_imports),
        "ops": dict(ops.most_common()),
        "weight_bytes": modelfile.initializer_bytes(model),
        "ortlean_nodes": custom,
        "dense_candidates": [{"name": c.name, "target": c.target, "role": c.role, "block": c.layer, "shape": [c.K, c.N],
                              "transposed_weight": c.transposed, "classified_by": c.how} for c in cands],
        "unsupported": [{"name": u.name, "op": u.node.op_type, "why": u.why} for u in unsupported],
        "attention_cores": sum(1 for n in model.graph if g._is_attn_core(n)),
    }
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    print(f"{args.model}: ir_version {info['ir_version']}, opsets {info['opsets']}, weights {info['weight_bytes'] / 2**20:.1f} MiB")
    print("ops: " + ", ".join(f"{k}×{v}" for k, v in info["ops"].items()))
    if custom:
        print(f"\n{len(custom)} ortlean nodes:")
        width = max(len(c["op"]) for c in custom)
        for c in custom:
            a = c["attributes"]
            extra = ", ".join(f"{k}={_short(v)}" for k, v in a.items() if k not in ("layer", "target"))
            print(f"  {c['op']:<{width}} {c['name']}  [{a.get('target', '?')}]  {extra}")
    print(f"\n{len(cands)} dense weight MatMuls:")
    for c in info["dense_candidates"]:
        print(f"  {c['name']}  {c['target']}/{c['role']}  block {c['block']}  {c['shape'][0]}x{c['shape'][1]}"
              f"{'  (B = Transpose(W))' if c['transposed_weight'] else ''}  [{c['classified_by']}]")
    if unsupported:
        print(f"\n{len(unsupported)} weight layers no backend takes (kept: unsupported):")
        for u in info["unsupported"]:
            print(f"  {u['name']}  {u['op']}: {u['why']}")
    if info["attention_cores"]:
        print(f"\n{info['attention_cores']} fused attention cores")
    return 0


def _short(v, n: int = 6):
    """A list attribute for the text listing: itself when short, else its length and first values
    (PackedAttention's pq_book has KV heads x head dim x 16 of them; --json keeps them all)."""
    if isinstance(v, list) and len(v) > n:
        return f"[{len(v)} values: {', '.join(f'{x:.4g}' if isinstance(x, float) else str(x) for x in v[:3])}, …]"
    return v


# --------------------------------------------------------------------------- eval / bench / generate
def cmd_eval(args) -> int:
    from . import evaluate

    needle_flags = {"--lengths": args.lengths, "--depths": args.depths, "--needle-kinds": args.needle_kinds,
                    "--cases": args.cases, "--seed": args.seed, "--needle-cache": args.needle_cache}
    if args.task == "needle":
        return _eval_needle(args)
    given = [f for f, v in needle_flags.items() if v is not None]
    if given:
        raise OrtleanError(f"{given[0]} applies to --task needle (this is --task {args.task})")
    from . import results

    start = results.git_commit()
    res = evaluate.evaluate(args.model, args.ref, args.text, threads=options.one_thread_count(args.threads, "--threads"),
                            window=args.window,
                            windows=args.windows, sentences=args.sentences, tokenizer=args.tokenizer, peers=args.peers,
                            decode_context=args.decode_context, decode_score=args.decode_score)
    print(evaluate.format_eval(res))
    if args.json:  # a results file: its provenance (commit, date, machine) and command inside, written atomically
        results.write_json(args.json, {**res, **results.provenance(start), "command": _command_line(args)})
    return 0


def _eval_needle(args) -> int:
    """`ortlean eval --task needle`: the table, and with --json the result with its provenance."""
    from custom_ops.runtime import needle

    from . import evaluate, results

    depths = None
    if args.depths is not None:
        try:
            depths = [float(x) for x in args.depths.split(",") if x.strip()]
        except ValueError:
            raise OrtleanError(f"--depths {args.depths}: expected a comma list of fractions 0..1") from None
        if not depths:
            raise OrtleanError(f"--depths {args.depths!r}: give at least one depth (fractions 0..1)")
    start = results.git_commit()
    res = evaluate.needle(args.model, args.ref, args.text, threads=options.one_thread_count(args.threads, "--threads"),
                          tokenizer=args.tokenizer, lengths=args.lengths, depths=depths, kinds=args.needle_kinds,
                          cases=1 if args.cases is None else args.cases,
                          seed=0 if args.seed is None else args.seed, progress=not args.quiet,
                          cache_dir=args.needle_cache, say=lambda m: print(m, file=sys.stderr))
    print(needle.format_table(res))
    if args.json:
        results.write_json(args.json, {**res, **results.provenance(start), "command": _command_line(args)})
    return 0


def cmd_bench(args) -> int:
    from . import evaluate

    from . import results

    decode_past = args.decode_past if args.decode_past is not None else evaluate.default_pasts(args.model)
    also = dict(args.also)
    if len(also) != len(args.also):
        raise OrtleanError("--also: each LABEL may be given once")
    if args.label is not None and (not args.label.strip() or "|" in args.label or args.label in also):
        raise OrtleanError(f"--label {args.label!r}: a row name without '|', not one of the --also labels")
    if args.json:
        _writable(args.json, "--json")
    if args.quality_cache and not args.quality_text:
        raise OrtleanError("--quality-cache keeps --quality-text's scores: give --quality-text too")
    if not args.prompt:
        for flag in ("prompt_repeats", "prompt_chunk", "prompt_text"):
            if getattr(args, flag) is not None:
                raise OrtleanError(f"--{flag.replace('_', '-')} sets the time to first token's runs: give --prompt too")
    res = evaluate.bench(args.model, args.ref, threads=args.threads, prefill=args.prefill, decode_past=decode_past,
                         repeats=args.repeats, nbits=args.nbits, profile=not args.no_profile, peers=args.peers,
                         llama=not args.no_llama, steps=args.steps, huge_pages=args.huge_pages == "on", also=also,
                         quality_text=args.quality_text, trace_dir=args.profile, tokenizer=args.tokenizer,
                         rows=args.rows, quality_cache=args.quality_cache, genai=not args.no_genai,
                         past_cache=evaluate.past_cache_dir(args.past_cache), prompts=args.prompt or (),
                         prompt_repeats=args.prompt_repeats, prompt_chunk=args.prompt_chunk,
                         prompt_text=args.prompt_text)
    print(evaluate.format_bench(res))
    if args.profile:
        n = sum(len(v) for v in (res.get("profile_traces") or {}).values())
        print(f"ORT profiler traces: {n} files in {args.profile} (<row>.t<threads>.json; chrome://tracing, Perfetto)")
    if args.json:
        res.update(results.from_bench(res, command=_command_line(args), labels={"lean": args.label or "lean"}))
        results.write_json(args.json, res)
    return 0


def _command_line(args) -> str:
    """The command as typed, home directory shortened to ~ (recorded in result files)."""
    import shlex

    home = str(Path.home())
    return "ortlean " + " ".join(shlex.quote(a).replace(home, "~") for a in getattr(args, "argv", []))


def _writable(path: str, flag: str) -> None:
    """Fail before any work when an output file's directory does not exist (one line naming it)."""
    d = Path(path).expanduser().resolve().parent
    if not d.is_dir():
        raise OrtleanError(f"{flag} {path}: directory {d} does not exist")


def _output_file(path: str, flag: str) -> Path:
    """An output file's flag checked before any work: its directory exists and it is not a directory."""
    _writable(path, flag)
    f = Path(path).expanduser()
    if f.is_dir():
        raise OrtleanError(f"{flag} {path}: is a directory (give a file name)")
    return f


def cmd_perf(args) -> int:
    from custom_ops.runtime import perf

    from . import results
    from .evaluate import _session, generator_session

    if args.chunk is not None and args.prompt is None:
        raise OrtleanError("--chunk needs --prompt N (the prompt it splits)")
    # opens the model with clear errors (missing, corrupt, no library); a prompt as generate reads it
    factory = generator_session if args.prompt is not None else _session
    start = results.git_commit()
    try:
        r = perf.perf(args.model, inputs=args.inputs, iterations=args.iterations, warmup=args.warmup,
                      threads=args.threads, seq=args.seq, past=args.past, batch=args.batch,
                      session_factory=factory, prompt=args.prompt, chunk=args.chunk, profile=args.profile)
    except perf.PerfError as e:
        raise OrtleanError(str(e)) from None
    if args.json:  # a results file: commit, date and machine inside
        r = {**r, **results.provenance(start), "command": _command_line(args)}
    print(json.dumps(r, indent=1) if args.json else perf.format_perf(r))
    return 0


def _nonneg_float(v: str) -> float:
    """argparse type: a finite float ≥ 0."""
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {v!r}") from None
    if not (x >= 0 and x != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number ≥ 0, got {v!r}")
    return x


def _unit_float(v: str) -> float:
    """argparse type: a float in (0, 1]."""
    x = _nonneg_float(v)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {v!r}")
    return x


def cmd_generate(args) -> int:
    from custom_ops import runtime
    from custom_ops.runtime.generate import (chat_template, model_eos_ids, model_positions, render_chat,
                                             special_tokens)

    from .evaluate import _tokenizer, generator_session

    if args.system is not None and not args.chat:
        raise OrtleanError("--system needs --chat (a system message goes in the chat template)")
    if args.temperature == 0 and (args.top_k or args.top_p < 1 or args.seed is not None):
        raise OrtleanError("--top-k, --top-p and --seed apply to sampling: pass --temperature > 0 (greedy by default)")
    if args.prompt_cache_refresh and args.prompt_cache is None:
        raise OrtleanError("--prompt-cache-refresh needs --prompt-cache FILE (the file to rebuild)")
    if args.document == "-" and args.prompt_file == "-":
        raise OrtleanError("--document - and --prompt-file -: only one of them can read standard input")
    runs = _generate_runs(args)

    def read_text(flag: str, name: str) -> str:
        try:
            return sys.stdin.read() if name == "-" else Path(name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise OrtleanError(f"{flag} {name}: cannot read it as UTF-8 text ({e})") from None

    if args.prompt_file is not None:
        prompt = read_text("--prompt-file", args.prompt_file)
        what = f"--prompt-file {args.prompt_file}"
    else:
        prompt, what = args.prompt, "--prompt"
    if not prompt.strip():
        raise OrtleanError(f"{what}: empty prompt")
    document = None
    if args.document is not None:
        document = read_text("--document", args.document).rstrip()
        if not document:
            raise OrtleanError(f"--document {args.document}: empty document")
        what = f"--document {args.document} and {what}"
    cache = _prompt_cache_file(args) if args.prompt_cache is not None else None
    threads = options.one_thread_count(args.threads, "--threads")
    sess = generator_session(args.model, threads)   # the prompt's last position's logits only
    io = runtime.ModelIO.from_session(sess, args.model)
    if io.kind != "causal-lm" or not io.logits_name:
        raise OrtleanError(f"{args.model}: not a causal LM (no logits output)")
    tok = _tokenizer(args.model, args.tokenizer)
    user = prompt if document is None else f"{document}\n\n{prompt}"
    shared = document if document is not None else prompt   # what later prompts share: a cache holds it
    add_special = True
    if args.chat:
        found = chat_template(args.model, args.tokenizer)
        if found is None:
            where = sorted({str(Path(q).parent if not Path(q).is_dir() else Path(q)) for q in (args.model, args.tokenizer) if q})
            raise OrtleanError(f"--chat: no chat template (chat_template.jinja, or chat_template in tokenizer_config.json) "
                               f"in {' or '.join(where)}")
        template, src = found
        messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + \
            [{"role": "user", "content": user}]
        try:
            text = render_chat(template, messages, add_generation_prompt=True,
                               **special_tokens(args.model, args.tokenizer))
        except ValueError as e:
            raise OrtleanError(f"--chat: {src}: {e}") from None
        add_special = False  # the template writes the special tokens itself (as transformers' apply_chat_template)
        at = text.rfind(user)  # the shared part ends where the document (or the whole prompt) ends in the template
        at = text.rfind(shared) if at < 0 else at
        cache_prefix = text[:at + len(shared)] if at >= 0 else text
    else:
        text, cache_prefix = user, shared
    sampling = runtime.Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    max_len = model_positions(args.model)

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        g = runtime.generate(sess, io, tok, text, args.max_new_tokens, eos=model_eos_ids(args.model, tok),
                             add_special_tokens=add_special, sampling=sampling, on_text=show,
                             prefill_chunk=args.prefill_chunk, max_length=max_len, model_path=args.model,
                             prompt_cache=None if cache is None else runtime.PromptCache(cache, args.prompt_cache_refresh),
                             cache_prefix=cache_prefix)
    except runtime.PromptCacheError as e:   # the file is as it was (a write goes to a temporary file first)
        hint = e.refresh_helps and not args.prompt_cache_refresh
        raise OrtleanError(f"--prompt-cache {args.prompt_cache}: {e.problem}"
                           + ("; --prompt-cache-refresh rebuilds it" if hint else "")) from None
    except ValueError as e:  # the prompt does not fit the model's positions
        raise OrtleanError(f"{what}: {e}") from None
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"[ortlean generate] {g.summary()}, {threads} thread{'s' if threads != 1 else ''}", file=sys.stderr)
    if args.json:
        _generate_json(args, g, threads, runs)
    return 0


GENERATE_JSON = "ortlean-generate/1"


def _generate_runs(args) -> list:
    """The runs already in --json FILE (checked before any work): [] for a new file; a file this option did
    not write is refused, never overwritten."""
    if not args.json:
        return []
    f = _output_file(args.json, "--json")
    if not f.exists():
        return []
    try:
        doc = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise OrtleanError(f"--json {args.json}: exists and is not a JSON file ortlean generate wrote ({e}): not "
                           "overwritten") from None
    if not isinstance(doc, dict) or doc.get("kind") != GENERATE_JSON or not isinstance(doc.get("runs"), list):
        raise OrtleanError(f"--json {args.json}: exists and is not a file of ortlean generate runs: not overwritten "
                           "(give another file name)")
    return doc["runs"]


def _generate_json(args, g, threads: int, runs: list) -> None:
    """Adds this run to --json FILE (written atomically)."""
    from . import results

    run = {"model": args.model, "threads": threads, "ttft_s": round(g.ttft_seconds, 4),
           "prompt_tokens": g.prompt_tokens, "cached_tokens": g.cached_tokens, "prefilled_tokens": g.prefilled_tokens,
           "prefill_s": round(g.prefill_seconds, 4), "decode_tokens": g.decode_tokens,
           "decode_s": round(g.decode_seconds, 4), "new_tokens": len(g.ids), "stop": g.stop, "sampling": g.sampling,
           "loop": g.loop, "text": g.text, "summary": g.summary(),
           "command": "ortlean " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
    if g.cache is not None:
        c = g.cache
        run["prompt_cache"] = {"file": str(c.path), "action": c.action, "tokens": c.tokens,
                               "file_tokens": c.file_tokens, "bytes": c.bytes, "seconds": round(c.seconds, 4)}
    run.update(results.provenance())
    results.write_json(Path(args.json).expanduser(), {"kind": GENERATE_JSON, "runs": [*runs, run]})


def _prompt_cache_file(args) -> Path:
    """--prompt-cache FILE checked before any work: its directory exists and it is not a directory. A file
    is written only where none exists or, with --prompt-cache-refresh, over a prompt cache (or an empty
    file): never over another file (the model, the document, ...)."""
    from custom_ops.runtime.prompt_cache import is_cache_file

    f = _output_file(args.prompt_cache, "--prompt-cache")
    flag = f"--prompt-cache {args.prompt_cache}"
    if args.prompt_cache_refresh and f.exists() and not is_cache_file(f):
        raise OrtleanError(f"{flag}: exists and is not an ortlean prompt cache: not overwritten (give another "
                           "file name, or delete it)")
    return f


# --------------------------------------------------------------------------- models / corpus / demo
def cmd_models(args) -> int:
    from models import prepare

    if args.mcmd == "prepare":
        d = prepare.prepare(args.name, force=args.force)
        print(d / "model.onnx")
        return 0
    if args.mcmd == "path":
        d = prepare.prepare(args.name)
        print(d / "model.onnx")
        return 0
    raise OrtleanError(f"usage: ortlean models prepare|path {'|'.join(PACKAGED)}")


def cmd_corpus(args) -> int:
    from models import corpus

    novels = corpus.novels()
    if args.calib:
        print(novels[corpus.CALIB_NOVEL])
    elif args.eval:
        print(novels[corpus.EVAL_NOVEL])
    else:
        for title, path in novels.items():
            tag = " (calibration)" if title == corpus.CALIB_NOVEL else " (evaluation)" if title == corpus.EVAL_NOVEL else ""
            print(f"{title}{tag}: {path}")
    return 0


def cmd_demo(args) -> int:
    from . import demo

    configs = _backend_configs(args)
    asked = [n for n, c in configs.items() if c.enabled and getattr(c, "explicit", True)
             and n not in ("fuse", "weights")]   # --fuse/--weights auto ask nothing
    if getattr(configs.get("weights"), "explicit", False):
        asked.append("weights")
    custom = None
    if asked:
        def custom(model, output, calib, report):
            return RewriteConfig(model=model, output=output, backends=configs, calib_text=calib, report=report,
                                 quality_budget=args.quality_budget, progress=True)
    return demo.run(args, rewrite_config, custom)


def rewrite_config(argv: list[str]) -> RewriteConfig:
    """The RewriteConfig of `ortlean rewrite ARGV` (progress on: a stage line per stage on stderr)."""
    a = build_parser().parse_args(["rewrite", *argv])
    return options.from_args(RewriteConfig, a, model=a.model, output=a.output, backends=_backend_configs(a),
                             progress=True)


if __name__ == "__main__":
    sys.exit(main())
