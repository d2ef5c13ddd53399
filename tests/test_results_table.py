"""Results as data: `ortlean bench --json` writes the results schema (rows with Δppl beside tok/s,
commit, machine, date), `tests/bench/results_table.py` renders it into README/docs between markers,
and the committed README matches the committed result files (`--check`)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import native_available

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "bench" / "results_table.py"


def _doc(**over) -> dict:
    from rewriter import results

    d = results.provenance()
    d.update({"date": "2026-11-27T10:00:00Z","command": "ortlean bench lean.onnx --ref dense.onnx --json r.json", "model_name": "toy",
              "contexts": [128, 4096], "threads": [1, 2], "prefill_tokens": 128,
              "quality": {"text": "persuasion.txt", "mode": "512-token windows", "tokens": 4096, "ppl_ref": 10.0},
              "rows": [
                  {"name": "dense", "model": "dense", "driver": "plain loop", "side": "reference", "what": "ref",
                   "delta_ppl": 0.0, "tok_s": {"1": {"128": 100.0, "4096": 50.0}, "2": {"128": 150.0, "4096": 80.0}},
                   "prefill_tok_s": {"1": 1000.0, "2": 1900.0}},
                  {"name": "lean", "model": "lean", "driver": "plain loop", "side": "ours", "what": "ortlean: X x2",
                   "delta_ppl": 0.0123, "delta_ppl_upper": 0.02,
                   "tok_s": {"1": {"128": 120.0, "4096": 90.0}, "2": {"128": 170.0, "4096": 130.0}},
                   "prefill_tok_s": {"1": 1100.0, "2": 2000.0}},
                  {"name": "lean (shared KV)", "model": "lean", "driver": "shared KV", "side": "ours",
                   "what": "ortlean: X x2", "delta_ppl": 0.0123, "delta_ppl_upper": 0.02,
                   "tok_s": {"1": {"128": 125.0, "4096": 140.0}, "2": {"128": 175.0, "4096": 210.5}},
                   "prefill_tok_s": {"1": 1100.0, "2": 2000.0}},
                  {"name": "llama.cpp", "model": "llama.cpp", "driver": "llama-bench", "side": "peer",
                   "what": "llama.cpp on the GGUF", "delta_ppl": None, "quality_note": "not measured here",
                   "tok_s": {"1": {"128": 60.0, "4096": 30.0}}, "prefill_tok_s": {"1": 500.0}},
              ]})
    d.update(over)
    return d


def test_render_picks_each_models_fastest_driver_and_states_provenance():
    from rewriter import results

    doc = _doc()
    md = results.render(doc)
    lines = md.splitlines()
    assert lines[0].startswith("|  | what it is | Δppl | decode tok/s, 1 thread: after 128 / 4,096 |")
    body = [ln for ln in lines if ln.startswith("| ") and "---" not in ln][1:]
    assert [ln.split(" | ")[0] for ln in body] == ["| dense", "| llama.cpp", "| **lean (shared KV)**"]
    lean = body[2]
    assert "+1.23 % (≤ +2.00 %)" in lean and "125 / 140" in lean and "175 / 210" in lean
    assert "0 (reference)" in body[0]
    assert "–¹" in body[1] and "60.0 / 30.0 | – / –" in body[1] and "¹ not measured here" in md
    assert f"at commit {doc['commit'][:10]}" in md and doc["machine"]["cpu"] in md and doc["date"][:10] in md
    assert "onnxruntime " + doc["onnxruntime"] in md and "`ortlean bench lean.onnx" in md
    with pytest.raises(ValueError, match="schema"):
        results.render({**doc, "schema": "other/1"})


def test_render_cache_bytes_column_and_peak_rss_only_when_measured():
    """Files with each row's cache bytes per token get a column relative to the reference's fp32 cache,
    and the caption gives the process's and llama-bench's peak RSS; files without them render as before."""
    from rewriter import results

    assert "cache bytes" not in results.render(_doc()) and "Peak RSS" not in results.render(_doc())
    doc = _doc()
    for r in doc["rows"]:
        r["cache_bytes_per_token"] = {"dense": 57344, "lean": 15680, "llama.cpp": 28672}[r["model"]]
    doc["rows"][-1]["peak_rss_mb"] = 3072
    doc["peak_rss_mb"] = 9216
    md = results.render(doc)
    assert md.splitlines()[0].endswith("| cache bytes / token (x fp32) |")
    body = {ln.split(" | ")[0]: ln for ln in md.splitlines() if ln.startswith("| ") and "---" not in ln}
    assert body["| dense"].endswith("| 57,344 (1.00x) |") and body["| **lean (shared KV)**"].endswith("| 15,680 (0.27x) |")
    assert body["| llama.cpp"].endswith("| 28,672 (0.50x) |")
    assert "Peak RSS 9.0 GiB for every ONNX row together" in md and "llama-bench's own process 3.0 GiB" in md


def test_update_rewrites_between_markers_and_check_sees_stale_tables(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "res").mkdir()
    readme = tmp_path / "README.md"
    marker = "<!-- results-table src=res/a.json -->\n"
    readme.write_text(f"# x\nbefore\n{marker}old text\n<!-- /results-table -->\nafter\n")
    (tmp_path / "docs" / "page.md").write_text(f"{marker.replace('a.json', 'missing.json')}\n<!-- /results-table -->\n")

    def run(*a):
        return subprocess.run([sys.executable, str(SCRIPT), "--root", str(tmp_path), *a], capture_output=True, text=True)

    # no file yet: the section says which command fills it, never figures
    r = run("--check")
    assert r.returncode == 1 and "README.md: the table from res/a.json" in r.stderr
    assert run().returncode == 0
    text = readme.read_text()
    assert "No results committed yet" in text and "res/a.json" in text and text.endswith("after\n")
    assert "No results committed yet" in (tmp_path / "docs" / "page.md").read_text()
    assert run("--check").returncode == 0
    # a results file appears: the table is stale until rewritten, then it says what the file says
    (tmp_path / "res" / "a.json").write_text(json.dumps(_doc()))
    assert run("--check").returncode == 1
    assert run().returncode == 0 and run("--check").returncode == 0
    text = readme.read_text()
    assert "**lean (shared KV)**" in text and text.startswith("# x\nbefore\n" + marker + "|  | what it is")
    assert text.count("<!-- /results-table -->") == 1 and "old text" not in text
    # the file changes (a new run): --check fails
    d = _doc()
    d["rows"][2]["delta_ppl"] = 0.5
    (tmp_path / "res" / "a.json").write_text(json.dumps(d))
    assert run("--check").returncode == 1


def test_committed_readme_matches_committed_results():
    r = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "<!-- results-table src=" in (ROOT / "README.md").read_text()


@pytest.mark.skipif(not native_available(), reason="needs the native library")
def test_bench_json_is_the_results_schema_with_profile_traces(toy_model, toy_text, tmp_path):
    """`ortlean bench --also --label --quality-text --profile --json` on the toy model: the schema's
    provenance, one row per (model, driver) with Δppl beside tok/s, ORT's trace per row and thread
    count (valid chrome-trace JSON with node events), and a table that renders from the file."""
    from rewriter import cli, results

    for out, target in (("a", "all"), ("b", "mlp")):
        assert cli.main(["rewrite", str(toy_model), "-o", str(tmp_path / out / "model.onnx"), "--tt=on",
                         f"--tt-target={target}", "--tt-gap=0.05", "--tt-speed-check=off", "--calib-text",
                         str(toy_text), "--calib-tokens", "1024", "--calib-window", "64", "-q",
                         "--quality-budget=off"]) == 0
    out = tmp_path / "r.json"
    traces = tmp_path / "traces"
    rc = cli.main(["bench", str(tmp_path / "a" / "model.onnx"), "--ref", str(toy_model), "--also",
                   f"mlp={tmp_path / 'b' / 'model.onnx'}", "--label", "all", "--threads", "1,2", "--prefill", "16",
                   "--decode-past", "8", "--repeats", "1", "--nbits", "none", "--huge-pages", "off",
                   "--quality-text", str(toy_text), "--quality-cache", str(tmp_path / "qc"), "--profile", str(traces),
                   "--json", str(out)])
    assert rc == 0
    assert len(list((tmp_path / "qc").glob("*.json"))) == 3     # the reference's and both rows' scores kept
    d = json.loads(out.read_text())
    assert d["schema"] == results.SCHEMA and d["contexts"] == [8] and d["threads"] == [1, 2]
    assert d["command"].startswith("ortlean bench ") and "--also" in d["command"]
    assert d["machine"]["cores"] >= 1 and d["machine"]["isa"] and d["date"].endswith("Z")
    assert d["onnxruntime"] and (d["commit"] is None or len(d["commit"]) == 40)
    assert "table" in d and "notes" in d  # the bench's own keys stay
    rows = {r["name"]: r for r in d["rows"]}
    assert set(rows) == {"dense", "all", "mlp"}
    assert rows["dense"]["side"] == "reference" and rows["all"]["side"] == rows["mlp"]["side"] == "ours"
    assert rows["all"]["what"].startswith("ortlean: TTMatMul x")
    assert d["quality"]["tokens"] > 0 and "windows" in d["quality"]["mode"]
    assert rows["dense"]["cache_bytes_per_token"] is None    # the toy LM has no cache
    assert d["peak_rss_mb"] > 0
    for r in rows.values():
        assert isinstance(r["delta_ppl"], float) and set(r["tok_s"]) == {"1", "2"}
        assert all(r["tok_s"][t]["8"] > 0 and r["prefill_tok_s"][t] > 0 for t in ("1", "2"))
    assert rows["dense"]["delta_ppl"] == 0.0 and abs(rows["all"]["delta_ppl"]) < 0.5
    files = sorted(p.name for p in traces.iterdir())
    assert files == ["dense.t1.json", "dense.t2.json", "lean.t1.json", "lean.t2.json", "mlp.t1.json", "mlp.t2.json"]
    assert d["profile_traces"]["mlp"]["2"] == str(traces / "mlp.t2.json")
    for f in files:
        events = json.loads((traces / f).read_text())
        assert any(e.get("cat") == "Session" and e.get("name") == "model_run" for e in events)
        ops = {e["args"].get("op_name") for e in events if e.get("cat") == "Node"}
        assert ("TTMatMul" in ops) == (not f.startswith("dense"))
    md = results.render(d)
    assert "**all**" in md and "**mlp**" in md and "TTMatMul" in md
    # --rows best: each model once under its fastest driver; the dense model is the quality reference only
    rc = cli.main(["bench", str(tmp_path / "a" / "model.onnx"), "--ref", str(toy_model), "--rows", "best",
                   "--threads", "1", "--prefill", "16", "--decode-past", "8", "--repeats", "1", "--nbits", "none",
                   "--huge-pages", "off", "--quality-text", str(toy_text), "--no-profile", "--json", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    rows = {r["name"]: r for r in d["rows"]}
    assert set(rows) == {"dense", "lean"} and set(d["table"]["t1"]) == {"lean"}
    assert rows["dense"]["driver"] == "not timed" and rows["dense"]["tok_s"] == {} and rows["dense"]["delta_ppl"] == 0.0
    assert rows["lean"]["tok_s"]["1"]["8"] > 0 and isinstance(rows["lean"]["delta_ppl"], float)
    assert any("fastest driver only" in n for n in d["notes"])
    md = results.render(d)
    assert "| dense | " in md and "| – |" in md.split("| dense | ")[1].split("\n")[0] + " |"


def test_cache_bytes_per_token_of_fp32_and_packed_caches(tmp_path):
    """fp32 K/V: layers x (key, value) x kv_heads x head_dim x 4 bytes; PackedAttention's state: its
    key-code and row words (int8 rows: about a quarter of fp32)."""
    import tiny_hf
    from custom_ops.runtime.weights import cache_bytes_per_token

    from rewriter import cli

    src = tiny_hf.models()["qwen2"] / "model.onnx"
    cfg = json.loads((src.parent / "config.json").read_text())
    kv, hd = cfg["num_key_value_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
    fp32 = cfg["num_hidden_layers"] * 2 * kv * hd * 4
    assert cache_bytes_per_token(src) == fp32
    out = tmp_path / "p" / "model.onnx"
    assert cli.main(["rewrite", str(src), "-o", str(out), "--weights", "int8", "--state-pack", "binary",
                     "--quality-budget=off", "-q"]) == 0
    packed = cache_bytes_per_token(out)
    assert packed is not None and 0.25 * fp32 < packed < 0.5 * fp32, (packed, fp32)


def test_bench_flags_refuse_bad_labels(toy_model, tmp_path, capsys):
    from rewriter import cli

    base = ["bench", str(toy_model), "--ref", str(toy_model), "--repeats", "1", "--nbits", "none"]
    assert cli.main(base + ["--also", "nolabel"]) == 2
    assert "LABEL=MODEL" in capsys.readouterr().err
    assert cli.main(base + ["--also", f"dense={toy_model}"]) == 2
    assert "names one of the bench's own rows" in capsys.readouterr().err
    assert cli.main(base + ["--also", f"x={tmp_path / 'none.onnx'}"]) == 2
    assert "none.onnx" in capsys.readouterr().err
    assert cli.main(base + ["--json", str(tmp_path / "no" / "dir" / "r.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.skipif(not native_available(), reason="needs the native library")
def test_bench_profile_traces_of_a_decoder(tmp_path, capfd):
    """A decoder with a KV cache: --profile writes one trace per row and thread count of decode steps
    after the longest past (the unfused export concatenates its cache: plain loop, and no ONNX Runtime
    error text from a shared-KV probe); the JSON's rows carry every past."""
    import tiny_hf
    from rewriter import cli

    m = tiny_hf.models()["llama"] / "model.onnx"
    traces, out = tmp_path / "prof", tmp_path / "r.json"
    rc = cli.main(["bench", str(m), "--ref", str(m), "--threads", "1", "--prefill", "8", "--decode-past", "16,40",
                   "--repeats", "1", "--steps", "2", "--nbits", "4", "--peers", "none", "--no-llama",
                   "--huge-pages", "off", "--profile", str(traces), "--json", str(out)])
    err = capfd.readouterr().err
    assert rc == 0 and "[E:onnxruntime" not in err, err[-2000:]
    assert sorted(p.name for p in traces.iterdir()) == ["MatMulNBits-int4.t1.json", "dense.t1.json", "lean.t1.json"]
    for p in traces.iterdir():
        events = json.loads(p.read_text())
        runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
        assert len(runs) >= 20  # the cache's prefill, 4 warm-up and 16 profiled decode steps
        assert any(e.get("cat") == "Node" and e["name"].endswith("_kernel_time") for e in events)
    d = json.loads(out.read_text())
    assert d["decode_profile"]["t1"]["lean"]["loop"] == "plain" and "traces" not in d["decode_profile"]
    assert d["profile_traces"]["MatMulNBits int4"]["1"].endswith("MatMulNBits-int4.t1.json")
    assert d["contexts"] == [16, 40] and all(set(r["tok_s"]["1"]) == {"16", "40"} for r in d["rows"])
    assert {r["name"] for r in d["rows"]} == {"dense", "lean", "MatMulNBits int4"}


def test_table_quality_cache_reuses_only_under_the_same_stamp(toy_model, toy_text, tmp_path):
    """The demo's quality cache: a second run with the same files, text and code reuses every row's
    scores (same figures, no scoring), a changed model file is scored again, and another text is a
    new stamp."""
    import os
    import shutil

    from rewriter import evaluate

    other = tmp_path / "other" / "model.onnx"
    other.parent.mkdir()
    shutil.copy(toy_model, other)
    cache, said = tmp_path / "qcache", []
    kw = dict(threads=1, window=64, windows=2, say=said.append, cache_dir=str(cache))
    a = evaluate.table_quality({"lean": str(other)}, str(toy_model), str(toy_text), **kw)
    assert not any("reused" in m for m in said) and len(list(cache.glob("*.json"))) == 2
    said.clear()
    b = evaluate.table_quality({"lean": str(other)}, str(toy_model), str(toy_text), **kw)
    assert a == b and sum("reused" in m for m in said) == 2, said
    said.clear()
    st = other.stat()
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))    # the row's file changed: scored again
    c = evaluate.table_quality({"lean": str(other)}, str(toy_model), str(toy_text), **kw)
    assert [m for m in said if "reused" in m] == ["quality: the reference: reused (same files, text, mode, code and library)"]
    assert c["rows"]["lean"]["ppl"] == pytest.approx(a["rows"]["lean"]["ppl"], rel=1e-6)
    text2 = tmp_path / "t2.txt"
    text2.write_text(toy_text.read_text()[::-1])
    said.clear()
    evaluate.table_quality({"lean": str(other)}, str(toy_model), str(text2), **kw)
    assert not any("reused" in m for m in said)


def test_plot_script_draws_a_committed_results_file(tmp_path):
    """tests/bench/plot_results.py: the demo's tok/s-against-context plot from a results file."""
    pytest.importorskip("matplotlib")
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("plot_results", root / "tests/bench/plot_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    png = tmp_path / "p.png"
    assert mod.main([str(root / "tests/bench/results/smollm2.json"), str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = tmp_path / "none.json"
    doc.write_text(json.dumps({"schema": "ortlean-results/1", "contexts": [], "threads": [1], "rows": []}))
    assert mod.main([str(doc), str(tmp_path / "q.png")]) == 1 and not (tmp_path / "q.png").exists()


def test_plot_script_merges_runs_by_thread_count(tmp_path):
    """Several results files of one model: one panel per thread count, a later file's cell replacing an
    earlier one's, a model's Δppl from whichever file measured it; a file of another schema is refused."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("plot_results", root / "tests/bench/plot_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    a = _doc()
    b = _doc(contexts=[4096, 16384], threads=[1], rows=[
        {"name": "lean (shared KV)", "model": "lean", "driver": "shared KV", "side": "ours", "what": "x",
         "delta_ppl": None, "tok_s": {"1": {"4096": 141.0, "16384": 99.0}}},
        {"name": "llama.cpp", "model": "llama.cpp", "driver": "llama-bench", "side": "peer", "what": "y",
         "delta_ppl": 0.004, "tok_s": {"1": {"4096": 31.0, "16384": 9.0}}}])
    threads, by_t = mod.merge([a, b])
    assert threads == [1, 2]
    assert by_t[1]["lean"]["pts"] == {128: 125.0, 4096: 141.0, 16384: 99.0}   # b's 4096 replaces a's
    assert by_t[2]["lean"]["pts"] == {128: 175.0, 4096: 210.5}
    assert by_t[1]["lean"]["dppl"] == by_t[2]["lean"]["dppl"] == 0.0123
    assert by_t[1]["llama.cpp"]["dppl"] == 0.004 and 2 not in {t for t in threads if "llama.cpp" in by_t[t]}
    assert mod.merge([_doc(contexts=[])]) == ([], {})
    fa, fb = tmp_path / "a.json", tmp_path / "b.json"
    fa.write_text(json.dumps(a))
    fb.write_text(json.dumps(b))
    if importlib.util.find_spec("matplotlib"):
        png = tmp_path / "p.png"
        assert mod.main([str(fa), str(fb), str(png)]) == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fb.write_text(json.dumps(b | {"schema": "something/2"}))
    assert mod.main([str(fa), str(fb), str(tmp_path / "q.png")]) == 2 and not (tmp_path / "q.png").exists()


def test_plot_script_draws_ttft_against_prompt_length(tmp_path):
    """tests/bench/plot_results.py on files with times to first token: the decode plot as before and the
    TTFT plot beside it (speed-vs-context -> ttft-vs-prompt, or --ttft); a file of TTFT alone: its plot
    at the PNG given."""
    pytest.importorskip("matplotlib")
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("plot_results", root / "tests/bench/plot_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    f = tmp_path / "r.json"
    f.write_text(json.dumps(_ttft_doc()))
    png = tmp_path / "m-speed-vs-context.png"
    assert mod.main([str(f), str(png)]) == 0
    for p in (png, tmp_path / "m-ttft-vs-prompt.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", p
    assert mod.ttft_path(Path("a/b.png")) == Path("a/b-ttft.png")
    assert mod.main([str(f), str(f), str(tmp_path / "two.png"), "--ttft", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "two.png").is_file() and (tmp_path / "t.png").is_file()
    alone = _ttft_doc(contexts=[])
    f.write_text(json.dumps(alone))
    assert mod.main([str(f), str(tmp_path / "only.png")]) == 0
    assert (tmp_path / "only.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "only-ttft.png").exists()


def test_llama_cpp_delta_ppl_is_kept_when_llama_bench_gave_no_speed():
    """A llama.cpp row whose llama-bench run failed still carries the Δppl llama.cpp measured, with the
    reason for the missing speed; a bench without llama.cpp at all has no such row."""
    from rewriter import results

    res = {"prefill": 128, "pasts": [128], "threads": [2], "model": "m.onnx", "ref": "d.onnx",
           "variants": {"dense": "d.onnx", "lean": "m.onnx"}, "table": {"t2": {"lean | shared KV": {
               "prefill": 100.0, "decode128": 50.0}}},
           "quality": {"text": "p.txt", "rows": {"lean": {"delta_ppl": 0.01}, "llama.cpp": {
               "delta_ppl": 0.002, "note": "llama.cpp's own Δppl"}}},
           "llama_cpp": {"rows": [], "command": "llama.cpp rows skipped: llama-bench did not finish in 9 s"}}
    rows = {r["model"]: r for r in results.from_bench(res)["rows"]}
    lc = rows["llama.cpp"]
    assert lc["delta_ppl"] == 0.002 and lc["tok_s"] == {} and "did not finish" in lc["speed_note"]
    assert "llama.cpp" in results.render(results.from_bench(res) | {"schema": results.SCHEMA})
    del res["quality"]["rows"]["llama.cpp"]
    assert "llama.cpp" not in {r["model"] for r in results.from_bench(res)["rows"]}


def _ttft(cells: dict) -> dict:
    """A row's "ttft" from {threads: {length: seconds}} (one run each)."""
    return {t: {n: {"seconds": s, "tok_s": round(int(n) / s, 1), "repeats": 1, "seconds_all": [s]}
                for n, s in per.items()} for t, per in cells.items()}


def _ttft_doc(**over) -> dict:
    """_doc() with the time to first token of 4,096- and 16,384-token prompts (ortlean bench --prompt)."""
    d = _doc(prompt_lengths=[4096, 16384], prompt_text="Persuasion", prompt_chunk=512,
             prompt_repeats={"4096": 2, "16384": 1})
    rows = {r["name"]: r for r in d["rows"]}
    rows["lean (shared KV)"]["ttft"] = _ttft({"1": {"4096": 38.4, "16384": 150.2}, "2": {"4096": 20.5, "16384": 80.0}})
    rows["llama.cpp"]["ttft"] = _ttft({"1": {"4096": 56.9, "16384": 301.0}})
    rows["dense"]["ttft"] = _ttft({"1": {"4096": 0.512}})
    d.update(over)
    return d


def test_render_ttft_columns_from_a_synthetic_results_file(tmp_path):
    """A results file with times to first token gets a column group per thread count (each model's TTFT
    row, whichever row its decode columns come from; – where not measured) and a caption saying what was
    timed; a file of TTFT alone (--decode-past none) has neither decode nor prefill columns; a file without
    them renders as before. tests/bench/results_table.py puts the same table between the markers."""
    from rewriter import results

    md = results.render(_ttft_doc())
    head = md.splitlines()[0]
    assert head.endswith("| prefill tok/s (128 tokens), 1 / 2 threads | TTFT s, 1 thread: 4,096 / 16,384 | "
                         "TTFT s, 2 threads: 4,096 / 16,384 |")
    body = {ln.split(" | ")[0]: ln for ln in md.splitlines() if ln.startswith("| ") and "---" not in ln}
    assert body["| **lean (shared KV)**"].endswith("| 38.4 / 150 | 20.5 / 80.0 |")
    assert body["| llama.cpp"].endswith("| 56.9 / 301 | – / – |")
    assert body["| dense"].endswith("| 0.512 / – | – / – |")
    assert "TTFT: seconds from an empty cache to the first new token's logits" in md and "Persuasion" in md
    assert "(4,096: 2, 16,384: 1)" in md
    # the model's TTFT row is shown even when its decode columns come from another driver
    d = _ttft_doc()
    lean_rows = [r for r in d["rows"] if r["model"] == "lean"]
    lean_rows[0]["tok_s"]["2"]["4096"] = 999.0                        # the plain loop now decodes fastest
    body = {ln.split(" | ")[0]: ln for ln in results.render(d).splitlines() if ln.startswith("| ")}
    assert "| **lean**" in body and body["| **lean**"].endswith("| 38.4 / 150 | 20.5 / 80.0 |")
    # TTFT alone: no decode, no prefill columns, the rows still one per model
    alone = _ttft_doc(contexts=[], prefill_tokens=None)
    for r in alone["rows"]:
        r["tok_s"], r["prefill_tok_s"] = {}, {}
    md = results.render(alone)
    assert md.splitlines()[0] == ("|  | what it is | Δppl | TTFT s, 1 thread: 4,096 / 16,384 | "
                                  "TTFT s, 2 threads: 4,096 / 16,384 |")
    assert "decode" not in md.split("\n\n")[0] and "Decode:" not in md
    assert [ln.split(" | ")[0] for ln in md.splitlines()[2:5]] == ["| dense", "| llama.cpp", "| **lean (shared KV)**"]
    assert "TTFT" not in results.render(_doc())                         # no TTFT measured: as before
    # the script renders the same table from the file
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "t.json").write_text(json.dumps(_ttft_doc()))
    (tmp_path / "README.md").write_text("<!-- results-table src=res/t.json -->\n<!-- /results-table -->\n")
    r = subprocess.run([sys.executable, str(SCRIPT), "--root", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert results.render(_ttft_doc()).splitlines()[0] in (tmp_path / "README.md").read_text()


def test_prompt_table_interleaves_rows_and_keeps_every_run():
    """runtime.bench.prompt_table: an untimed warm-up round (a driver's own warm() when it has one), then
    each length's rounds with every row once, order rotated from round to round; a row's limit keeps it
    out of longer prompts; a run without a sample (None) leaves no entry."""
    import numpy as np

    from custom_ops.runtime import bench as rb

    calls = []

    class Row:
        def __init__(self, name, result=0.5):
            self.name, self.result = name, result

        def ttft(self, ids):
            calls.append((self.name, int(ids.size)))
            return self.result

    class Peer(Row):
        def warm(self, ids):
            calls.append((self.name, "warm"))

    drivers = {"a": Row("a"), "b": Row("b"), "ref": Row("ref"), "peer": Peer("peer", None)}
    out = rb.prompt_table(drivers, np.arange(100), [40, 10], {10: 2, 40: 1}, threads=1, warmup_tokens=8,
                          limits={"ref": 10}, huge_pages=False)
    assert calls[:4] == [("a", 8), ("b", 8), ("ref", 8), ("peer", "warm")]
    runs = calls[4:]
    assert [n for _, n in runs] == [10] * 8 + [40] * 3                 # shortest first; ref not at 40
    assert [r for r, _ in runs[:4]] == ["a", "b", "ref", "peer"] and [r for r, _ in runs[4:8]] == ["b", "ref", "peer", "a"]
    assert [r for r, _ in runs[8:]] == ["peer", "a", "b"]                # the third round, of 3 rows: from the third
    assert out == {"a": {"10": [0.5, 0.5], "40": [0.5]}, "b": {"10": [0.5, 0.5], "40": [0.5]},
                   "ref": {"10": [0.5, 0.5]}, "peer": {}}
    assert [rb.prompt_repeats(n, 15) for n in (128, 4096, 8191, 8192, 32760)] == [3, 3, 3, 1, 1]
    assert rb.prompt_repeats(4096, 2) == 2 and rb.prompt_repeats(32760, 15, override=4) == 4
    with pytest.raises(ValueError):
        rb.prompt_table(drivers, np.arange(10), [40], 1)


@pytest.fixture(scope="module")
def fused_tiny(tmp_path_factory):
    """The tiny llama export and its rewrite (fused: PackedAttention, shared K/V buffers; 512 positions), a
    word-level tokenizer over its 256 ids and a text of its words."""
    import tiny_hf
    from tokenizers import Tokenizer, models as tm, pre_tokenizers

    from rewriter import cli

    d = tmp_path_factory.mktemp("ttft")
    src = tiny_hf.models()["llama"] / "model.onnx"
    out = d / "lean" / "model.onnx"
    assert cli.main(["rewrite", str(src), "-o", str(out), "--weights", "int8", "--quality-budget", "off", "-q"]) == 0
    tok = Tokenizer(tm.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "text.txt").write_text(" ".join(f"w{(7 * i) % 251}" for i in range(600)))
    return {"ref": src, "lean": out, "tok": d / "tokenizer.json", "text": d / "text.txt", "dir": d}


@pytest.mark.skipif(not native_available(), reason="needs the native library")
def test_bench_prompt_flags_refuse_bad_values(fused_tiny, capsys):
    """--prompt N[,N…] (4k = 4096) and --decode-past none parse; bad values exit 2 naming the flag: not a
    length, a length beyond the models' positions, a text too short, --prompt-* without --prompt, nothing
    to time."""
    from rewriter import cli, evaluate

    p = cli.build_parser()
    a = p.parse_args(["bench", "m.onnx", "--ref", "d.onnx", "--prompt", "4096,16k", "--decode-past", "none"])
    assert a.prompt == [4096, 16384] and a.decode_past == [] and a.prompt_repeats is None and a.prompt_chunk is None
    a = p.parse_args(["bench", "m.onnx", "--ref", "d.onnx"])
    assert a.prompt is None and a.decode_past is None                 # no --prompt: the bench as before
    base = ["bench", str(fused_tiny["lean"]), "--ref", str(fused_tiny["ref"]), "--threads", "1", "--repeats", "1",
            "--nbits", "none", "--peers", "none", "--no-llama", "--huge-pages", "off", "--no-profile",
            "--tokenizer", str(fused_tiny["tok"]), "--prompt-text", str(fused_tiny["text"])]
    for bad in ("x", "0", "64,-1", "1.5k", ""):
        assert cli.main(base + ["--prompt", bad]) == 2, bad
        assert "argument --prompt:" in capsys.readouterr().err
    assert cli.main(base + ["--prompt", "64", "--prompt-repeats", "0"]) == 2
    assert "--prompt-repeats" in capsys.readouterr().err
    assert cli.main(base + ["--prompt", "64,600"]) == 2                # 512 positions
    assert "--prompt 600: " in capsys.readouterr().err
    assert cli.main(base + ["--prompt", "511", "--decode-past", "none", "--prompt-repeats", "1"]) == 0  # 511 + 1 fit
    capsys.readouterr()
    short = fused_tiny["dir"] / "short.txt"
    short.write_text("w5 w6 w7")
    assert cli.main(base[:-1] + [str(short), "--prompt", "64"]) == 2
    assert re.search(r"--prompt 64: short\.txt has only 3 tokens", capsys.readouterr().err)
    assert cli.main(base[:-2] + ["--prompt-chunk", "64"]) == 2
    assert "--prompt-chunk sets the time to first token's runs: give --prompt too" in capsys.readouterr().err
    assert cli.main(base[:-2] + ["--decode-past", "none"]) == 2
    assert "--decode-past none: nothing to time" in capsys.readouterr().err
    # the demo's way: lengths beyond the positions run at the positions minus its decode steps, with a note
    assert evaluate.fit_prompts([64, 4096, 32768], [fused_tiny["lean"]], room=8) == (
        [64, 504], "--prompt 64,4096,32768: the models take 512 positions, so prompts beyond 504 ran at 504")
    assert evaluate.fit_prompts([64, 511], [fused_tiny["lean"], fused_tiny["ref"]]) == ([64, 511], None)


@pytest.mark.skipif(not native_available(), reason="needs the native library")
def test_bench_prompt_times_to_first_token_for_every_row(fused_tiny, tmp_path, capsys):
    """`ortlean bench --prompt 64,128` with the decode table: every row's time to first token (ours through
    generate's decoder with shared K/V buffers, the unfused reference in its growing loop) per length and
    thread count in --json (seconds, tok/s, repeats) and the printed table; with --decode-past none the
    time to first token alone."""
    from rewriter import cli, results

    out = tmp_path / "r.json"
    base = ["bench", str(fused_tiny["lean"]), "--ref", str(fused_tiny["ref"]), "--threads", "1", "--repeats", "1",
            "--steps", "2", "--prefill", "8", "--nbits", "none", "--peers", "none", "--no-llama", "--no-genai",
            "--huge-pages", "off", "--no-profile", "--tokenizer", str(fused_tiny["tok"]),
            "--prompt-text", str(fused_tiny["text"]), "--json", str(out)]
    assert cli.main(base + ["--decode-past", "16", "--prompt", "64,128"]) == 0
    printed = capsys.readouterr().out
    assert "dec P16 t1" in printed and "time to first token after an N-token prompt" in printed
    ttft = printed.split("time to first token after an N-token prompt")[1].splitlines()
    assert ttft[1].split() == ["row", "64", "t1", "128", "t1"]
    rows = {ln.split("  ")[0]: ln for ln in ttft[2:4]}
    assert set(rows) == {"dense", "lean | shared KV"} and all(ln.count("tok/s") == 2 for ln in rows.values())
    d = json.loads(out.read_text())
    assert d["prompt_lengths"] == [64, 128] and d["prompt_text"] == "text.txt" and d["prompt_chunk"] == 512
    assert d["prompt_repeats"] == {"64": 1, "128": 1} and d["contexts"] == [16]
    rows = {r["name"]: r for r in d["rows"]}
    assert "ttft" not in rows["lean"]                                 # the plain loop: decode only
    for name in ("lean (shared KV)", "dense"):
        cells = rows[name]["ttft"]["1"]
        assert set(cells) == {"64", "128"}
        for n, c in cells.items():
            assert c["repeats"] == 1 and len(c["seconds_all"]) == 1 and c["seconds"] > 0
            assert c["tok_s"] == pytest.approx(int(n) / c["seconds"], rel=0.01)
    md = results.render(d)
    assert "TTFT s, 1 thread: 64 / 128" in md and "decode tok/s, 1 thread: after 16" in md
    # the time to first token alone, one row per model (--rows best: the reference is not timed)
    assert cli.main(base + ["--decode-past", "none", "--prompt", "40", "--prompt-chunk", "16", "--prompt-repeats", "2",
                            "--rows", "best"]) == 0
    printed = capsys.readouterr().out
    assert "dec P" not in printed and "lean | shared KV" in printed
    d = json.loads(out.read_text())
    assert d["contexts"] == [] and d["table"] == {} and d["prompt_chunk"] == 16 and d["prompt"]["warmup_tokens"] == 32
    assert [r["name"] for r in d["rows"]] == ["lean (shared KV)"]
    assert d["rows"][0]["ttft"]["1"]["40"]["repeats"] == 2
    assert results.render(d).splitlines()[0].endswith("| Δppl | TTFT s, 1 thread: 40 | cache bytes / token |")


def test_provenance_names_the_code_that_ran_when_the_checkout_moved(monkeypatch):
    """A results file names the commit a run started at; when the checkout moved during the run (a
    commit landed, or tracked files changed), it also says where it ended; when nothing moved, only
    the one commit."""
    from rewriter import results

    now = ("b" * 40, False)
    monkeypatch.setattr(results, "git_commit", lambda *a, **k: now)
    same = results.provenance(["b" * 40, False])
    assert same["commit"] == "b" * 40 and not same["commit_dirty"] and "commit_at_end" not in same
    moved = results.provenance(["a" * 40, False])
    assert (moved["commit"], moved["commit_dirty"]) == ("a" * 40, False)
    assert (moved["commit_at_end"], moved["commit_at_end_dirty"]) == ("b" * 40, False)
    now = ("a" * 40, True)  # edited during the run, not committed
    edited = results.provenance(("a" * 40, False))
    assert not edited["commit_dirty"] and edited["commit_at_end_dirty"] and edited["commit_at_end"] == "a" * 40
    assert "commit_at_end" not in results.provenance()  # no start given: the state now, as before


def test_git_commit_of_paths_is_the_last_commit_that_changed_them(tmp_path):
    """git_commit(paths=...) names the last commit that touched those paths (a benchmark reuses a model
    written by unchanged code) and is dirty only when they are modified."""
    from rewriter import results

    def git(*a):
        return subprocess.run(["git", "-C", str(tmp_path), *a], capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("1")
    (tmp_path / "b").write_text("1")
    git("add", "-A")
    git("commit", "-qm", "one")
    first = git("rev-parse", "HEAD")
    (tmp_path / "b").write_text("2")
    git("commit", "-qam", "two")
    head = git("rev-parse", "HEAD")
    assert results.git_commit(tmp_path) == (head, False)
    assert results.git_commit(tmp_path, paths=("a",)) == (first, False)
    (tmp_path / "b").write_text("3")
    assert results.git_commit(tmp_path, paths=("a",)) == (first, False)
    assert results.git_commit(tmp_path) == (head, True)
    (tmp_path / "a" / "f").write_text("2")
    assert results.git_commit(tmp_path, paths=("a",)) == (first, True)
    assert results.git_commit(tmp_path, paths=("nothing",)) == (None, False)


def test_render_needle_results_counts_hits_and_lost_needles():
    """A needle file (``ortlean eval --task needle --json``) renders as hits / the reference's per kind,
    length and depth, the lost needles in bold, and where and how it ran."""
    from rewriter import results

    cells = [{"kind": "passkey", "length": n, "depth": d, "needles": 1, "cases": 1, "hits": h, "ref_hits": r,
              "lost": int(r > h)} for n, d, h, r in ((4096, 0.1, 1, 1), (4096, 0.5, 0, 1), (16384, 0.1, 1, 0),
                                                      (16384, 0.5, 1, 1))]
    doc = {"schema": results.SCHEMA, "task": "needle", "cells": cells, "lengths": [4096, 16384],
           "depths": [0.1, 0.5], "kinds": ["passkey"], "cases_per_cell": 1, "model": "/x/long/model.onnx",
           "ref": "/x/lossless/model.onnx", "text_name": "Persuasion.txt",
           "summary": {"cases": 4, "hits": 3, "ref_hits": 3, "lost": 1, "gained": 1},
           "machine": {"cpu": "CPU", "cores": 2, "isa": "AVX2", "kernels": "avx2"}, "commit": "abcdef1234567",
           "date": "2026-12-07", "onnxruntime": "1.32.0", "command": "ortlean eval x --task needle"}
    out = results.render(doc)
    rows = [ln for ln in out.splitlines() if ln.startswith("| passkey")]
    assert rows == ["| passkey | 4,096 | 1/1 | 0/1 | 1/2 | **1** |", "| passkey | 16,384 | 1/0 | 1/1 | 2/1 | 0 |"]
    assert "**lost 1**" in out and "long/model.onnx" in out and "abcdef1234" in out
    assert "`ortlean eval x --task needle`" in out


def test_describe_model_names_the_attention_settings(tmp_path):
    """A row's 'what' says what the graph does to attention: the decode budget, the K/V rows, and for
    sparse prompts the prompt budget, where it starts, the window and the exact tail."""
    import onnx
    from onnx import TensorProto as TP, helper

    from rewriter.results import describe_model

    def node(i, **a):
        return helper.make_node("PackedAttention", [f"q{i}"], [f"y{i}"], domain="ai.ortlean", name=f"pa{i}", **a)

    nodes = [node(0, mode="pq", budget=0.0, kv_quant="int8", prefill_budget=0.125, prefill_min_context=2048,
                  prefill_window=1024, prefill_tail=64),
             node(1, mode="pq", budget=0.5, kv_quant="int8"),
             node(2, mode="sign", budget=0.0, kv_quant="fp32")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(f"q{i}", TP.FLOAT, None) for i in range(3)],
                          [helper.make_tensor_value_info(f"y{i}", TP.FLOAT, None) for i in range(3)])
    p = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.ortlean", 1)]), p)
    assert describe_model(str(p)) == (
        "PackedAttention exact (int8 K/V), prompts sparse 0.125 from 2,048 tokens (window 1,024, tail 64) x1, "
        "PackedAttention pq budget 0.5 (int8 K/V) x1, PackedAttention exact (fp32 K/V) x1")
