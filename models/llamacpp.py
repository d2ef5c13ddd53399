"""llama.cpp's tools (``llama-bench``, ``llama-cli``, ``llama-quantize``, ``llama-server`` …) for the
peer rows of ``ortlean bench``, from a clone of this repository alone.

llama.cpp is the CPU engine users compare ONNX Runtime with. Debian builds it with every ggml CPU
backend variant (``llama.cpp-tools``); its binaries want a newer glibc than a stable Debian has, so the
first use fetches Debian unstable's ``llama.cpp-tools`` and the libraries it needs (glibc included)
with ``apt-get download`` — a private sources list, state and cache under the ortlean cache, the
system's apt state untouched — unpacks them with ``dpkg-deb -x`` into
``<cache>/llama.cpp/<version>/root`` and runs each tool through the fetched dynamic loader, with the
ggml CPU backend that matches this CPU's flags. A benchmark aid, not a dependency of ortlean.

    from models import llamacpp
    tools = llamacpp.tools()                      # fetched once, then found in the cache
    tools.run("llama-bench", ["-m", "model.gguf", "-t", "1,2", "-o", "json"])

    python -m models.llamacpp llama-bench -m model.gguf -p 128 -n 32     # any tool, any arguments
    python -m models.llamacpp --where                                     # what is used, from where

Where it cannot work — no Debian mirror in the machine's apt sources (``/etc/apt/sources.list``,
``/etc/apt/sources.list.d/``), no network — :class:`LlamaCppError` says so in one line.
``$ORTLEAN_ANCHORS_SCRIPT`` (a script run as ``script TOOL ARGS…``) replaces all of this with a
llama.cpp of your own.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .cache import atomic_dir, cache_root, file_lock

__all__ = ["LlamaCppError", "Tools", "tools", "debian_mirror", "pick_backend", "cpu_flags", "override_script",
           "PACKAGES", "SUITE", "VARIANTS", "nll_tool", "f32_gguf", "token_nll", "delta_ppl"]

SUITE = "sid"
PACKAGES = ("llama.cpp-tools", "libllama0", "libggml0", "libc6", "libgcc-s1", "libgomp1", "libstdc++6", "libssl3t64")
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
ARCH_LIBS = "usr/lib/x86_64-linux-gnu"

# ggml's CPU backend variants (ggml/src/CMakeLists.txt, GGML_CPU_ALL_VARIANTS) and the /proc/cpuinfo
# flags each needs; the best one the CPU can run is the one with the most of them
_FEATURE_FLAGS = {"SSE42": "sse4_2", "AVX": "avx", "F16C": "f16c", "FMA": "fma", "AVX2": "avx2", "BMI2": "bmi2",
                  "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni",
                  "AVX512_BF16": "avx512_bf16", "AMX_TILE": "amx_tile", "AMX_INT8": "amx_int8",
                  "AVX_VNNI": "avx_vnni"}
VARIANTS = {
    "x64": (),
    "sse42": ("SSE42",),
    "sandybridge": ("SSE42", "AVX"),
    "ivybridge": ("SSE42", "AVX", "F16C"),
    "piledriver": ("SSE42", "AVX", "F16C", "FMA"),
    "haswell": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2"),
    "skylakex": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512"),
    "cannonlake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI"),
    "cascadelake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VNNI"),
    "icelake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI"),
    "cooperlake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VNNI", "AVX512_BF16"),
    "zen4": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"),
    "alderlake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX_VNNI"),
    "sapphirerapids": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI",
                       "AVX512_BF16", "AMX_TILE", "AMX_INT8"),
}


class LlamaCppError(RuntimeError):
    """llama.cpp's tools cannot be had here; the message (one line) says why."""


# --------------------------------------------------------------------------------------------- decisions
def override_script() -> Path | None:
    """``$ORTLEAN_ANCHORS_SCRIPT`` (run as ``script TOOL ARGS…``), when set; an error when it names no file."""
    env = os.environ.get("ORTLEAN_ANCHORS_SCRIPT")
    if not env:
        return None
    p = Path(env).expanduser()
    if not p.is_file():
        raise LlamaCppError(f"ORTLEAN_ANCHORS_SCRIPT={env}: no such file")
    return p


def _source_files() -> list[Path]:
    d = Path("/etc/apt/sources.list.d")
    return [Path("/etc/apt/sources.list"), *sorted(d.glob("*.sources")), *sorted(d.glob("*.list"))] if d.is_dir() \
        else [Path("/etc/apt/sources.list")]


def debian_mirror(files=None) -> str | None:
    """The first Debian archive mirror (not a security or updates-only mirror) named in apt's sources —
    deb822 ``.sources`` stanzas (``URIs:`` with a Debian suite) or one-line ``deb [opts] URI suite …``
    entries — or None when there is none."""
    for f in _source_files() if files is None else [Path(x) for x in files]:
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        if f.suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                fields = {}
                for line in stanza.splitlines():
                    if line.strip().startswith("#") or ":" not in line:
                        continue
                    k, _, v = line.partition(":")
                    fields[k.strip().lower()] = v.strip()
                if "deb" not in fields.get("types", "deb").split() or fields.get("enabled", "yes").lower() == "no":
                    continue
                for uri in fields.get("uris", "").split():
                    if _debian_archive(uri, fields.get("suites", "")):
                        return uri.rstrip("/")
        else:
            for line in text.splitlines():
                m = re.match(r"^\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", line)
                if m and _debian_archive(m.group(1), m.group(2)):
                    return m.group(1).rstrip("/")
    return None


def _debian_archive(uri: str, suites: str) -> bool:
    if not uri.startswith(("http://", "https://")) or "security" in uri or "debian" not in uri:
        return False
    return not suites or any("security" not in s for s in suites.split())


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def pick_backend(available, flags) -> str | None:
    """The ggml CPU backend variant to load: among ``available`` (variant names, e.g. from the
    ``libggml-cpu-<variant>.so`` files), the one needing the most CPU features that ``flags`` (a
    /proc/cpuinfo flag set) all has; None when none of them runs here."""
    flags = set(flags)
    fits = [v for v in available if v in VARIANTS and all(_FEATURE_FLAGS[f] in flags for f in VARIANTS[v])]
    return max(fits, key=lambda v: (len(VARIANTS[v]), -list(VARIANTS).index(v)), default=None)


# --------------------------------------------------------------------------------------------- the tools
@dataclass
class Tools:
    """An unpacked llama.cpp-tools tree and how to run its binaries."""

    root: Path
    version: str
    loader: Path
    lib_dirs: list[Path]
    backend: Path | None

    @classmethod
    def from_root(cls, root: Path, version: str, flags=None) -> "Tools":
        root = Path(root)
        loader = next((p for p in (root / "usr/lib64/ld-linux-x86-64.so.2", root / ARCH_LIBS / "ld-linux-x86-64.so.2",
                                   root / "lib64/ld-linux-x86-64.so.2") if p.exists()), None)
        if loader is None:
            raise LlamaCppError(f"{root}: no ld-linux-x86-64.so.2 in the unpacked packages (libc6 missing?)")
        libs = root / ARCH_LIBS
        dirs = [libs] + sorted({p.parent for p in libs.rglob("lib*.so*")
                                if p.parent != libs and "backends" not in p.parent.name})
        variants = {p.name[len("libggml-cpu-"):-len(".so")]: p for p in libs.rglob("libggml-cpu-*.so")}
        best = pick_backend(variants, cpu_flags() if flags is None else flags)
        if variants and best is None:
            raise LlamaCppError(f"no ggml CPU backend in {root} runs on this CPU (have {', '.join(sorted(variants))})")
        return cls(root=root, version=version, loader=loader, lib_dirs=dirs, backend=variants.get(best))

    def binary(self, tool: str) -> Path:
        p = self.root / "usr/bin" / tool
        if not p.is_file():
            have = sorted(x.name for x in (self.root / "usr/bin").glob("llama-*"))
            raise LlamaCppError(f"{tool}: not in llama.cpp-tools {self.version} (it has {', '.join(have)})")
        return p

    def command(self, tool: str, args=()) -> list[str]:
        return [str(self.loader), "--library-path", os.pathsep.join(map(str, self.lib_dirs)), str(self.binary(tool)),
                *map(str, args)]

    def env(self) -> dict:
        env = dict(os.environ)
        if self.backend is not None:
            env["GGML_BACKEND_PATH"] = str(self.backend)
        return env

    def run(self, tool: str, args=(), **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(tool, args), env=self.env(), **kw)


def _base() -> Path:
    return cache_root() / "llama.cpp"


def _installed(base: Path) -> list[tuple[float, str, Path]]:
    out = []
    for m in base.glob("*/ortlean_llamacpp.json"):
        try:
            meta = json.loads(m.read_text())
            out.append((m.stat().st_mtime, meta["version"], m.parent))
        except (OSError, ValueError, KeyError):
            continue
    return sorted(out)


def _apt_options(state: Path) -> list[str]:
    opts = ["-o", f"Dir::Etc::SourceList={state / 'sources.list'}", "-o", "Dir::Etc::SourceParts=/dev/null",
            "-o", f"Dir::State::Lists={state / 'lists'}", "-o", f"Dir::Cache={state / 'cache'}",
            "-o", "Dir::Etc::Preferences=/dev/null", "-o", "Dir::Etc::PreferencesParts=/dev/null"]
    if os.geteuid() == 0:  # apt drops to its _apt user for downloads, which cannot write a private dir under ~root
        opts += ["-o", "APT::Sandbox::User=root"]
    return opts


def _apt(args: list[str], state: Path, what: str, cwd: Path | None = None, timeout: float = 900) -> str:
    try:
        r = subprocess.run(args[:1] + _apt_options(state) + args[1:], capture_output=True, text=True, cwd=cwd,
                           timeout=timeout)
    except FileNotFoundError:
        raise LlamaCppError(f"{args[0]} not found: fetching Debian's llama.cpp-tools needs apt") from None
    except subprocess.TimeoutExpired:
        raise LlamaCppError(f"{what}: no answer in {timeout:.0f} s") from None
    if r.returncode != 0:
        last = next((ln for ln in reversed((r.stderr or r.stdout).strip().splitlines()) if ln.strip()), "?")
        raise LlamaCppError(f"{what} failed (exit {r.returncode}): {last.strip()}")
    return r.stdout


def fetch(progress: bool = True) -> Tools:
    """Download and unpack Debian unstable's llama.cpp-tools (and the libraries it needs) into
    ``<cache>/llama.cpp/<version>/`` (see the module docstring); returns the newest unpacked tools."""
    if shutil.which("dpkg-deb") is None or shutil.which("apt-get") is None:
        raise LlamaCppError("fetching Debian's llama.cpp-tools needs apt-get and dpkg-deb (a Debian-based system)")
    mirror = debian_mirror()
    if mirror is None:
        raise LlamaCppError("no Debian mirror in this machine's apt sources (/etc/apt/sources.list[.d]) to fetch "
                            "llama.cpp-tools from (set ORTLEAN_ANCHORS_SCRIPT to run a llama.cpp of your own)")
    if not Path(KEYRING).is_file():
        raise LlamaCppError(f"{KEYRING} missing: apt cannot check Debian's signatures (package debian-archive-keyring)")
    base = _base()
    state = base / "apt"
    with file_lock(base / ".apt.lock"):
        (state / "lists" / "partial").mkdir(parents=True, exist_ok=True)
        (state / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
        (state / "sources.list").write_text(f"deb [signed-by={KEYRING}] {mirror} {SUITE} main\n")
        if progress:
            print(f"[ortlean] llama.cpp: Debian {SUITE}'s package lists from {mirror} (private apt state in {state})",
                  file=sys.stderr, flush=True)
        _apt(["apt-get", "-qq", "update"], state, f"apt-get update ({mirror} {SUITE})")
        show = _apt(["apt-cache", "show", "--no-all-versions", *PACKAGES], state, "apt-cache show")
        versions = {}
        for stanza in re.split(r"\n\s*\n", show):
            pkg, ver = re.search(r"^Package: (\S+)", stanza, re.M), re.search(r"^Version: (\S+)", stanza, re.M)
            if pkg and ver:
                versions.setdefault(pkg.group(1), ver.group(1))
        missing = [p for p in PACKAGES if p not in versions]
        if missing:
            raise LlamaCppError(f"Debian {SUITE} at {mirror} has no {', '.join(missing)}")
        version = versions["llama.cpp-tools"]
        target = base / re.sub(r"[^A-Za-z0-9.+_-]", "_", version)
        with atomic_dir(target) as tmp:
            if tmp is not None:
                debs = tmp / "debs"
                debs.mkdir()
                if progress:
                    print(f"[ortlean] llama.cpp: downloading llama.cpp-tools {version} and {len(PACKAGES) - 1} "
                          f"libraries -> {target}", file=sys.stderr, flush=True)
                _apt(["apt-get", "-qq", "download", *PACKAGES], state, "apt-get download", cwd=debs)
                for deb in sorted(debs.glob("*.deb")):
                    r = subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp / "root")], capture_output=True, text=True)
                    if r.returncode != 0:
                        raise LlamaCppError(f"dpkg-deb -x {deb.name} failed: {r.stderr.strip()[:200]}")
                shutil.rmtree(debs)
                meta = {"version": version, "packages": {p: versions[p] for p in PACKAGES}, "mirror": mirror,
                        "suite": SUITE, "fetched": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                (tmp / "ortlean_llamacpp.json").write_text(json.dumps(meta, indent=1))
    return Tools.from_root(target / "root", version)


def tools(refresh: bool = False, progress: bool = True) -> Tools:
    """The llama.cpp tools: the newest already unpacked under the cache (no network), else
    :func:`fetch` (``refresh``: fetch anyway, for a newer Debian version)."""
    have = _installed(_base())
    if have and not refresh:
        _, version, d = have[-1]
        return Tools.from_root(d / "root", version)
    return fetch(progress=progress)


def run_tool(tool: str, args=(), timeout: float | None = None) -> tuple[subprocess.CompletedProcess, str]:
    """Run a llama.cpp tool (the override script, else :func:`tools`); returns the finished process and
    a short description of what ran (``llama.cpp-tools VERSION, ggml-cpu-VARIANT``)."""
    script = override_script()
    if script is not None:
        r = subprocess.run(["bash", str(script), tool, *map(str, args)], capture_output=True, text=True,
                           timeout=timeout)
        return r, f"{script.name}"
    t = tools()
    r = run_with_peak(t.command(tool, args), env=t.env(), timeout=timeout)
    be = t.backend.name[len("lib"):-len(".so")] if t.backend else "ggml's default CPU backend"
    return r, f"Debian llama.cpp-tools {t.version}, {be}"


def run_with_peak(cmd, env=None, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` that also keeps the process's own peak
    RSS as ``.peak_rss_kb`` (its VmHWM in /proc, sampled every 0.2 s until it exits; None where /proc
    has none). Not getrusage's ru_maxrss of the child: a child forked from a large process reports
    the parent's RSS at its exec (Linux keeps the larger high-water mark), so a 14 GB bench process
    made a 3 GB llama-bench look like 14 GB."""
    import threading

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [None]
    done = threading.Event()

    def sample():
        status = Path(f"/proc/{proc.pid}/status")
        while not done.is_set():
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        kb = int(line.split()[1])
                        peak[0] = max(peak[0] or 0, kb)
            except (OSError, ValueError, IndexError):
                pass
            done.wait(0.2)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    finally:
        done.set()
        th.join()
    r = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    r.peak_rss_kb = peak[0]
    return r


# --------------------------------------------------------------------------- quality: llama.cpp's own NLLs
DEV_PACKAGES = ("libllama-dev", "libggml-dev")   # llama.h / ggml headers, for llama_nll (models/llama_nll.c)
NLL_SOURCE = Path(__file__).with_name("llama_nll.c")


def nll_tool(t: "Tools | None" = None, progress: bool = True) -> Path:
    """``llama_nll`` (models/llama_nll.c) compiled against the fetched llama.cpp: the headers of Debian's
    libllama-dev / libggml-dev of the same version (downloaded beside the tools once), linked with the
    fetched libllama; cached per tools version and source. Needs a C compiler."""
    import hashlib

    t = t or tools(progress=progress)
    key = hashlib.sha256(NLL_SOURCE.read_bytes()).hexdigest()[:12]
    base = t.root.parent
    exe = base / f"llama_nll-{key}"
    if exe.is_file():
        return exe
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise LlamaCppError("llama.cpp's Δppl needs a C compiler (cc) to build its llama_nll tool")
    inc = base / "dev" / "usr" / "include"
    with file_lock(base.parent / ".apt.lock"):
        if not (inc / "llama.h").is_file():
            state = base.parent / "apt"
            if not (state / "lists").is_dir():
                raise LlamaCppError(f"no apt state in {state}: refetch the tools (python -m models.llamacpp --refresh)")
            dl = base / "dev-debs"
            dl.mkdir(parents=True, exist_ok=True)
            if progress:
                print(f"[ortlean] llama.cpp: headers ({', '.join(DEV_PACKAGES)}) for llama_nll", file=sys.stderr,
                      flush=True)
            _apt(["apt-get", "-qq", "download", *DEV_PACKAGES], state, "apt-get download", cwd=dl)
            for deb in sorted(dl.glob("*.deb")):
                r = subprocess.run(["dpkg-deb", "-x", str(deb), str(base / "dev")], capture_output=True, text=True)
                if r.returncode != 0:
                    raise LlamaCppError(f"dpkg-deb -x {deb.name} failed: {r.stderr.strip()[:200]}")
            shutil.rmtree(dl)
        libs = t.root / ARCH_LIBS
        tmp = exe.with_suffix(".tmp")
        r = subprocess.run([cc, "-O2", "-o", str(tmp), str(NLL_SOURCE), f"-I{inc}", f"-L{libs}", "-l:libllama.so.0",
                            "-l:libggml.so.0", "-l:libggml-base.so.0", "-lm", "-Wl,--allow-shlib-undefined"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise LlamaCppError(f"building llama_nll failed: {r.stderr.strip()[-300:]}")
        tmp.replace(exe)
    return exe


def f32_gguf(gguf: Path, progress: bool = True) -> Path:
    """The GGUF's weights dequantized to F32 by llama.cpp's own llama-quantize (the source weights as
    llama.cpp runs them: its reference for a Δppl), cached under the llama.cpp cache by file and size."""
    import hashlib

    gguf = Path(gguf).resolve()
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    out = _base() / "f32" / f"{gguf.stem}-{key}.F32.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"[ortlean] llama.cpp: {gguf.name} dequantized to F32 by llama-quantize -> {out}", file=sys.stderr,
              flush=True)
    tmp = out.with_suffix(".tmp")
    r, _ = run_tool("llama-quantize", ["--allow-requantize", str(gguf), str(tmp), "F32"])
    if r.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise LlamaCppError(f"llama-quantize {gguf.name} F32 failed: {(r.stderr or r.stdout).strip()[-200:]}")
    tmp.replace(out)
    return out


def token_nll(gguf: Path, ids, window: int = 512, threads: int = 2, progress: bool = True, prefix=None):
    """Per-token NLLs of ``ids`` under ``gguf`` computed by llama.cpp (llama_nll): consecutive windows of
    ``window`` tokens (``prefix`` — the tokenizer's beginning-of-sequence tokens — before each, context
    only), token i + 1 of a window scored by the logits at i — as runtime.perplexity scores the ONNX
    rows, so the two line up token for token. Returns a float64 array."""
    import tempfile

    import numpy as np

    if override_script() is not None:
        raise LlamaCppError("llama.cpp's Δppl is not measured with ORTLEAN_ANCHORS_SCRIPT (it runs llama_nll "
                            "against the fetched libllama)")
    t = tools(progress=progress)
    exe = nll_tool(t, progress=progress)
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "ids.bin"
        np.asarray(ids, dtype="<i4").tofile(f)
        cmd = [str(t.loader), "--library-path", os.pathsep.join(map(str, t.lib_dirs)), str(exe), str(gguf), str(f),
               str(int(window)), str(int(threads))]
        if prefix is not None and len(prefix):
            np.asarray(prefix, dtype="<i4").tofile(Path(d) / "prefix.bin")
            cmd.append(str(Path(d) / "prefix.bin"))
        r = subprocess.run(cmd, env=t.env(), capture_output=True)
    if r.returncode != 0:
        raise LlamaCppError(f"llama_nll {Path(gguf).name} failed: {r.stderr.decode(errors='replace').strip()[-300:]}")
    return np.frombuffer(r.stdout, dtype="<f8").copy()


def delta_ppl(gguf: Path, ids, window: int = 512, threads: int = 2, progress: bool = True, prefix=None) -> dict:
    """llama.cpp's Δppl on ``ids``: the GGUF as it ships against its own weights dequantized to F32
    (:func:`f32_gguf`), both scored by llama.cpp on the same windows; with the one-sided 95 % upper
    bound from the paired per-token NLLs (custom_ops.runtime.paired_delta)."""
    import numpy as np

    from custom_ops.runtime import paired_delta

    q = token_nll(gguf, ids, window, threads, progress, prefix)
    f = token_nll(f32_gguf(gguf, progress), ids, window, threads, progress, prefix)
    d, up = paired_delta(q, f)
    return {"ppl": float(np.exp(q.mean())), "ppl_f32": float(np.exp(f.mean())), "delta_ppl": d, "delta_ppl_upper": up,
            "tokens": int(q.size), "reference": "llama.cpp on the GGUF dequantized to F32 (llama-quantize F32)"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m models.llamacpp TOOL [ARGS...] | --where | --refresh\n  runs llama.cpp's TOOL "
              "(llama-bench, llama-cli, llama-quantize, ...) from Debian's llama.cpp-tools, fetched into the ortlean "
              "cache on first use")
        return 0 if argv else 2
    try:
        if argv[0] in ("--where", "--refresh"):
            script = override_script()
            if script is not None:
                print(f"ORTLEAN_ANCHORS_SCRIPT={script}")
                return 0
            t = tools(refresh=argv[0] == "--refresh")
            print(f"llama.cpp-tools {t.version}\nroot {t.root}\nloader {t.loader}\nbackend {t.backend}")
            return 0
        script = override_script()
        if script is not None:
            os.execvp("bash", ["bash", str(script), *argv])
        t = tools()
        cmd = t.command(argv[0], argv[1:])
        os.execve(cmd[0], cmd, t.env())
    except LlamaCppError as e:
        print(f"llama.cpp: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
