"""llama.cpp's tools from a clone of the repository alone (models/llamacpp.py): which Debian mirror,
which ggml CPU backend, how a tool is run, one line when it cannot be had; and (slow) the real fetch
and a llama-bench run on the packaged GGUF."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from models import llamacpp, peers


def test_debian_mirror_from_deb822_and_one_line_sources(tmp_path):
    d822 = tmp_path / "debian.sources"
    d822.write_text("Types: deb\nURIs: http://deb.debian.org/debian-security\nSuites: bookworm-security\n"
                    "Components: main\n\n"
                    "Types: deb\nURIs: http://mirror.example/debian/\nSuites: bookworm bookworm-updates\n"
                    "Components: main\nEnabled: no\n\n"
                    "Types: deb-src deb\n# a comment: with a colon\nURIs: cdrom:/media http://ftp.example.org/debian/\n"
                    "Suites: bookworm\nComponents: main\n")
    assert llamacpp.debian_mirror([d822]) == "http://ftp.example.org/debian"
    one = tmp_path / "sources.list"
    one.write_text("# deb http://commented.example/debian sid main\n"
                   "deb http://security.debian.org/debian-security bookworm-security main\n"
                   "deb [arch=amd64 signed-by=/usr/share/keyrings/x.gpg] https://deb.example.net/debian bookworm main\n")
    assert llamacpp.debian_mirror([one]) == "https://deb.example.net/debian"
    assert llamacpp.debian_mirror([tmp_path / "missing.list", one]) == "https://deb.example.net/debian"
    only_sec = tmp_path / "sec.list"
    only_sec.write_text("deb http://security.debian.org/debian-security bookworm-security main\n"
                        "deb http://archive.ubuntu.com/ubuntu jammy main\n")
    assert llamacpp.debian_mirror([only_sec]) is None
    assert llamacpp.debian_mirror([]) is None


def test_pick_backend_takes_the_richest_variant_the_cpu_runs():
    allv = list(llamacpp.VARIANTS)
    base = {"sse4_2", "avx", "f16c", "fma", "avx2", "bmi2"}
    avx512 = base | {"avx512f", "avx512bw", "avx512vl"}
    assert llamacpp.pick_backend(allv, base) == "haswell"
    assert llamacpp.pick_backend(allv, base | {"avx_vnni"}) == "alderlake"
    assert llamacpp.pick_backend(allv, avx512) == "skylakex"
    assert llamacpp.pick_backend(allv, avx512 | {"avx512_vnni"}) == "cascadelake"
    assert llamacpp.pick_backend(allv, avx512 | {"avx512_vnni", "avx512vbmi"}) == "icelake"
    assert llamacpp.pick_backend(allv, avx512 | {"avx512_vnni", "avx512vbmi", "avx512_bf16", "avx_vnni"}) == "zen4"
    assert llamacpp.pick_backend(allv, avx512 | {"avx512_vnni", "avx512vbmi", "avx512_bf16", "amx_tile",
                                                 "amx_int8"}) == "sapphirerapids"
    assert llamacpp.pick_backend(allv, set()) == "x64"
    # only what is there: a Debian build without zen4 falls back to icelake
    assert llamacpp.pick_backend(["x64", "haswell", "icelake", "unknown"],
                                 avx512 | {"avx512_vnni", "avx512vbmi", "avx512_bf16"}) == "icelake"
    assert llamacpp.pick_backend(["skylakex"], base) is None


def _fake_root(root: Path, variants=("x64", "haswell", "skylakex")) -> Path:
    libs = root / llamacpp.ARCH_LIBS
    (root / "usr/lib64").mkdir(parents=True)
    (root / "usr/lib64/ld-linux-x86-64.so.2").write_text("")
    (libs / "llama").mkdir(parents=True)
    (libs / "llama/libllama.so.0").write_text("")
    (libs / "libggml.so.0").write_text("")
    (libs / "ggml/backends0").mkdir(parents=True)
    for v in variants:
        (libs / f"ggml/backends0/libggml-cpu-{v}.so").write_text("")
    (root / "usr/bin").mkdir(parents=True)
    for t in ("llama-bench", "llama-cli"):
        (root / "usr/bin" / t).write_text("")
    return root


def test_tools_run_through_the_fetched_loader_with_the_chosen_backend(tmp_path):
    root = _fake_root(tmp_path / "root")
    t = llamacpp.Tools.from_root(root, "1:0.0-1", flags={"sse4_2", "avx", "f16c", "fma", "avx2", "bmi2"})
    assert t.backend.name == "libggml-cpu-haswell.so"
    cmd = t.command("llama-bench", ["-m", "x.gguf", "-t", 2])
    assert cmd[0] == str(root / "usr/lib64/ld-linux-x86-64.so.2") and cmd[1] == "--library-path"
    dirs = cmd[2].split(os.pathsep)
    assert dirs[0] == str(root / llamacpp.ARCH_LIBS) and str(root / llamacpp.ARCH_LIBS / "llama") in dirs
    assert not any("backends" in d for d in dirs)
    assert cmd[3:] == [str(root / "usr/bin/llama-bench"), "-m", "x.gguf", "-t", "2"]
    assert t.env()["GGML_BACKEND_PATH"] == str(t.backend)
    with pytest.raises(llamacpp.LlamaCppError, match="llama-perplexity: not in llama.cpp-tools 1:0.0-1 .*llama-bench"):
        t.command("llama-perplexity")
    with pytest.raises(llamacpp.LlamaCppError, match="no ggml CPU backend .* runs on this CPU"):
        llamacpp.Tools.from_root(_fake_root(tmp_path / "r2", ("skylakex",)), "v", flags={"avx2"})
    (root / "usr/lib64/ld-linux-x86-64.so.2").unlink()
    with pytest.raises(llamacpp.LlamaCppError, match="no ld-linux"):
        llamacpp.Tools.from_root(root, "v", flags=set())


def test_no_mirror_skips_the_rows_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTLEAN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ORTLEAN_ANCHORS_SCRIPT", raising=False)
    monkeypatch.setattr(llamacpp, "debian_mirror", lambda files=None: None)
    with pytest.raises(llamacpp.LlamaCppError, match="no Debian mirror in this machine's apt sources"):
        llamacpp.tools()
    rows, note, stopped = peers.llama_bench("smollm2", threads=(1,), prompt=8, gen=2, repetitions=1)
    assert rows == [] and "\n" not in note
    assert note.startswith("llama.cpp rows skipped: no Debian mirror in this machine's apt sources")
    assert "ORTLEAN_ANCHORS_SCRIPT" in note


def test_an_installed_version_is_used_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTLEAN_CACHE", str(tmp_path))
    monkeypatch.setattr(llamacpp, "fetch", lambda progress=True: pytest.fail("fetched although a version is unpacked"))
    d = tmp_path / "llama.cpp" / "1_0.1-1"
    _fake_root(d / "root")
    (d / "ortlean_llamacpp.json").write_text(json.dumps({"version": "1:0.1-1"}))
    t = llamacpp.tools()
    assert t.version == "1:0.1-1" and t.root == d / "root"


def test_override_script_runs_instead(tmp_path, monkeypatch):
    """$ORTLEAN_ANCHORS_SCRIPT: `script llama-bench ARGS` runs, its JSON becomes the rows."""
    script = tmp_path / "llama.sh"
    out = [{"n_prompt": 8, "n_gen": 0, "n_depth": 0, "n_threads": 1, "avg_ts": 100.0, "stddev_ts": 1.0},
           {"n_prompt": 0, "n_gen": 2, "n_depth": 64, "n_threads": 1, "avg_ts": 50.0, "stddev_ts": 0.5}]
    script.write_text(f"#!/bin/bash\n[ \"$1\" = llama-bench ] || exit 9\necho '{json.dumps(out)}'\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("ORTLEAN_ANCHORS_SCRIPT", str(script))
    rows, note, stopped = peers.llama_bench("smollm2", threads=(1,), prompt=8, gen=2, repetitions=1)
    assert [r["test"] for r in rows] == ["pp8", "tg2@d64"] and rows[1]["tok_s"] == 50.0 and rows[1]["depth"] == 64
    assert note.startswith("llama-bench -m SmolLM2") and "(llama.sh)" in note
    # with depths: the prompt at depth 0 and the depths decoding only — two runs (the script answers both)
    rows, note, stopped = peers.llama_bench("smollm2", threads=(1,), prompt=8, gen=2, depths=(64,), repetitions=1)
    assert len(rows) == 4 and "-p 8 -n 0 -r 1 -o json; llama-bench" in note and "-p 0 -n 2 -r 1 -o json -d 64" in note
    assert stopped is None
    monkeypatch.setenv("ORTLEAN_ANCHORS_SCRIPT", str(tmp_path / "nope.sh"))
    rows, note, stopped = peers.llama_bench("smollm2", threads=(1,), prompt=8, gen=2)
    assert rows == [] and "nope.sh: no such file" in note


def test_each_depth_runs_alone_and_a_failed_depth_keeps_the_rows_before_it(tmp_path, monkeypatch):
    """One llama-bench run per depth: a depth that fails (or times out) is named in the note, the rows
    of the runs before it are kept and later depths are not started."""
    script, log = tmp_path / "llama.sh", tmp_path / "calls"
    script.write_text(f"""#!/bin/bash
echo "$*" >> {log}
case "$*" in *"-d 128"*) echo 'out of memory' >&2; exit 3;; esac
d=0; n=0; p=8
case "$*" in *"-d 64"*) d=64; n=2; p=0;; esac
echo '[{{"n_prompt": '$p', "n_gen": '$n', "n_depth": '$d', "n_threads": 1, "avg_ts": 9.0}}]'
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("ORTLEAN_ANCHORS_SCRIPT", str(script))
    rows, note, stopped = peers.llama_bench("smollm2", threads=(1,), prompt=8, gen=2, depths=(64, 128, 256), repetitions=1)
    assert [r["test"] for r in rows] == ["pp8", "tg2@d64"]
    assert "-d 128 stopped: exited 3: out of memory (later runs not started)" in note
    assert stopped is not None and stopped.startswith("llama-bench") and stopped in note
    assert len(log.read_text().splitlines()) == 3   # prompt, depth 64, depth 128; 256 never started
    rows, note, stopped = peers.llama_bench("smollm2", threads=(1,), prompt=8, gen=2, depths=(128,), repetitions=1)
    assert [r["test"] for r in rows] == ["pp8"] and "stopped: exited 3" in note and "exited 3" in stopped


@pytest.mark.slow
def test_fetch_and_run_llama_bench_on_the_packaged_gguf(monkeypatch):
    """The real thing: Debian's llama.cpp-tools fetched (or found in the cache) and llama-bench run on
    SmolLM2's GGUF through the fetched loader and the CPU's ggml backend."""
    monkeypatch.delenv("ORTLEAN_ANCHORS_SCRIPT", raising=False)
    if llamacpp.debian_mirror() is None:
        pytest.skip("no Debian mirror in this machine's apt sources")
    t = llamacpp.tools()
    assert t.loader.exists() and (t.backend is None or t.backend.is_file())
    rows, note, stopped = peers.llama_bench("smollm2", threads=(1,), prompt=8, gen=2, depths=(16,), repetitions=1)
    assert [r["test"] for r in rows] == ["pp8", "tg2@d16"], note
    assert all(r["tok_s"] > 0 and r["threads"] == 1 for r in rows) and "Q4_1" in rows[0]["model_type"]
    assert f"llama.cpp-tools {t.version}" in note


@pytest.mark.slow
def test_llama_cpp_delta_ppl_on_the_packaged_gguf(monkeypatch):
    """llama.cpp's Δppl row is measured by llama.cpp itself (models/llama_nll.c against the fetched
    libllama): the GGUF and its F32 dequantization scored on the same token windows as the ONNX rows.
    Its F32 run is the source weights in another engine: per token it agrees with ONNX Runtime's fp32
    export of the same weights, which is what makes the two Δppl columns comparable."""
    import numpy as np

    from custom_ops import runtime
    from models import corpus, prepare

    monkeypatch.delenv("ORTLEAN_ANCHORS_SCRIPT", raising=False)
    if llamacpp.debian_mirror() is None:
        pytest.skip("no Debian mirror in this machine's apt sources")
    import custom_ops

    M = prepare.prepare("smollm2", progress=False) / "model.onnx"
    tok = runtime.load_tokenizer(M)
    ids = np.asarray(tok.encode(corpus.text(corpus.EVAL_NOVEL), add_special_tokens=False).ids[:256], np.int64)
    g = prepare.gguf_path("smollm2")
    nll_f32 = llamacpp.token_nll(llamacpp.f32_gguf(g), ids, window=128, threads=2)
    assert nll_f32.shape == (254,) and np.isfinite(nll_f32).all()
    sess = custom_ops.session(str(M), threads=2)
    ort = runtime.perplexity(sess, runtime.ModelIO.from_session(sess, M), ids, window=128)
    assert abs(np.exp(nll_f32.mean()) / ort["ppl"] - 1) < 2e-3, (np.exp(nll_f32.mean()), ort["ppl"])
    r = llamacpp.delta_ppl(g, ids, window=128, threads=2)
    assert r["tokens"] == 254 and abs(r["delta_ppl"]) < 0.05 and r["delta_ppl_upper"] >= r["delta_ppl"]
    with pytest.raises(llamacpp.LlamaCppError, match="outside the model's vocabulary"):
        llamacpp.token_nll(g, np.array([1, 10 ** 7]), window=128, threads=1)


def test_run_with_peak_reports_the_tools_own_peak_rss():
    """llama-bench's peak RSS is its own VmHWM: a child that touches 200 MiB reports about that, even
    from a parent holding more (getrusage's ru_maxrss of a child would report the parent's size);
    a timeout kills the child and raises."""
    import subprocess
    import sys

    ballast = bytearray(400 << 20)   # the parent holds 400 MiB while the child runs
    ballast[::4096] = b"x" * len(ballast[::4096])
    code = "import time; b = bytearray(200 << 20); b[::4096] = b'y' * len(b[::4096]); time.sleep(0.6); print('ok')"
    r = llamacpp.run_with_peak([sys.executable, "-c", code], timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok"
    assert 200 << 10 <= r.peak_rss_kb < 380 << 10, r.peak_rss_kb
    del ballast
    with pytest.raises(subprocess.TimeoutExpired):
        llamacpp.run_with_peak([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)


def _bench_script(tmp_path: Path, fail_on: str | None = None) -> tuple[Path, Path]:
    """A fake llama-bench (via $ORTLEAN_ANCHORS_SCRIPT) that logs its arguments and answers one row:
    a prompt of P tokens in P x 10 ms, N generated tokens in N x 20 ms (a run's ``samples_ns``)."""
    script, log = tmp_path / "llama.sh", tmp_path / "calls"
    fail = f'case "$*" in *"{fail_on}"*) echo "out of memory" >&2; exit 3;; esac\n' if fail_on else ""
    script.write_text(f"""#!/bin/bash
echo "$*" >> {log}
{fail}p=$(echo "$*" | sed -E 's/.* -p ([0-9]+).*/\\1/'); n=$(echo "$*" | sed -E 's/.* -n ([0-9]+).*/\\1/')
d=0; case "$*" in *" -d "*) d=$(echo "$*" | sed -E 's/.* -d ([0-9]+).*/\\1/');; esac
t=$(echo "$*" | sed -E 's/.* -t ([0-9]+).*/\\1/')
ns=$(( p * 10000000 + n * 20000000 ))
echo '[{{"n_prompt": '$p', "n_gen": '$n', "n_depth": '$d', "n_threads": '$t', "avg_ts": 1.0, "samples_ns": ['$ns'],
  "model_type": "llama ?B Q4_1", "build_commit": "abc", "build_number": 1}}]'
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, log


def test_llama_bench_takes_its_turn_in_the_decode_table_rounds(tmp_path, monkeypatch):
    """peers.LlamaBenchRow as a decode_table row: one llama-bench run per round and test (-r 1: the
    prompt at depth 0, each past decoding only), its sample the run's own time (per step for decode),
    the warm-up round dropped like the ONNX rows'; rows_from_table gives llama_bench-style rows."""
    from custom_ops.runtime import bench as rb

    script, log = _bench_script(tmp_path)
    monkeypatch.setenv("ORTLEAN_ANCHORS_SCRIPT", str(script))
    row = peers.LlamaBenchRow("smollm2", threads=2)
    tab = rb.decode_table({}, [64, 128], prefill_len=8, steps=3, repeats=2, vocab=1000, long_past_from="none",
                          huge_pages=False, extra={"llama.cpp | llama-bench": row})
    calls = log.read_text().splitlines()
    assert len(calls) == 3 * 3   # 1 warm-up + 2 rounds, each: the prompt, past 64, past 128
    assert all(" -t 2 " in c and c.endswith("-r 1 -o json") for c in calls)
    assert " -p 8 -n 0 " in calls[0] and " -p 0 -n 3 -d 64 " in calls[1] and " -p 0 -n 3 -d 128 " in calls[2]
    cells = tab["llama.cpp | llama-bench"]
    assert cells["prefill"] == pytest.approx(80.0) and cells["decode64"] == cells["decode128"] == pytest.approx(20.0)
    rows = peers.rows_from_table(row, cells, 8, [64, 128], 3)
    assert [(r["test"], r["depth"], r["threads"]) for r in rows] == [("pp8", 0, 2), ("tg3@d64", 64, 2), ("tg3@d128", 128, 2)]
    assert rows[0]["tok_s"] == pytest.approx(100.0) and rows[1]["tok_s"] == pytest.approx(50.0)
    assert all(r["interleaved"] and r["tok_s_std"] == 0.0 and r["model_type"] == "llama ?B Q4_1" for r in rows)
    assert row.failed is None and set(row.commands) == {"pp8", "tg3@d64", "tg3@d128"}
    assert row.commands["pp8"].startswith("llama-bench -m SmolLM2") and str(tmp_path) not in row.commands["pp8"]


def test_a_failed_llama_bench_run_ends_its_row_and_keeps_the_table(tmp_path, monkeypatch):
    """The first llama-bench run that fails ends the row (named with its command and stderr): no later
    run starts, the row has no cells, and the other rows of the table are untouched."""
    from custom_ops.runtime import bench as rb

    script, log = _bench_script(tmp_path, fail_on="-d 128")
    monkeypatch.setenv("ORTLEAN_ANCHORS_SCRIPT", str(script))
    row = peers.LlamaBenchRow("smollm2", threads=1)

    class Fixed:   # another row: a fixed time per step
        def prefill(self, ids):
            return 0.5

        def decode(self, p, step_ids):
            return [0.25] * step_ids.shape[1]

    tab = rb.decode_table({}, [64, 128], prefill_len=8, steps=2, repeats=2, vocab=1000, long_past_from="none",
                          huge_pages=False, extra={"llama": row, "other": Fixed()})
    assert len(log.read_text().splitlines()) == 3   # round 0: prompt, past 64, past 128 (failed); no more
    assert row.failed.startswith("llama-bench -m SmolLM2") and "-d 128" in row.failed and "exited 3: out of memory" in row.failed
    assert tab["llama"] == {} and peers.rows_from_table(row, tab["llama"], 8, [64, 128], 2) == []
    assert tab["other"] == {"prefill": 500.0, "decode64": 250.0, "decode128": 250.0}
