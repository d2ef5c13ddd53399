"""`ortlean demo`'s parts that do not need a real model: its plot of a results file, its rewrite cache
(same source, flags, code and library: reused; anything else or --fresh: rewritten) and its CLI.
The demo end to end on SmolLM2 is what `ortlean demo smollm2` is (minutes of rewriting and measuring)."""
from __future__ import annotations

import json
import struct

import pytest
import tiny_hf
from rewriter import cli, demo
from test_results_table import _doc, _ttft_doc


@pytest.fixture(scope="module")
def tiny():
    return tiny_hf.models()


def _png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_plot_writes_a_png_with_every_models_line(tmp_path):
    pytest.importorskip("matplotlib")
    doc = _doc()
    png = demo.plot(doc, tmp_path / "speed.png")
    assert png == tmp_path / "speed.png" and _png_size(png) == (960, 600)
    # no contexts (an encoder's results): nothing to plot
    assert demo.plot(_doc(contexts=[]), tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def test_plot_legend_carries_quality(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    labels = []
    orig = matplotlib.axes.Axes.plot

    def spy(self, *a, **kw):
        labels.append(kw.get("label"))
        return orig(self, *a, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    demo.plot(_doc(), tmp_path / "speed.png")
    # one line per model (its fastest driver): dense, llama.cpp (2 threads: not measured, no line), lean
    assert labels == ["dense (Δppl +0.00 %)", "lean (shared KV) (Δppl +1.23 %)"]


def test_plot_ttft_draws_every_models_line_per_thread_count(tmp_path, monkeypatch):
    """The demo's ttft-vs-prompt.png: one panel per thread count, one line per model that has times to
    first token (its generating driver), Δppl in the legend; nothing without them."""
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    labels = []
    orig = matplotlib.axes.Axes.plot

    def spy(self, *a, **kw):
        labels.append((kw.get("label"), list(a[0])))
        return orig(self, *a, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    png = demo.plot_ttft([_ttft_doc()], tmp_path / "ttft.png")
    assert png == tmp_path / "ttft.png" and _png_size(png)[0] > _png_size(png)[1]
    assert labels == [("dense (Δppl +0.00 %)", [4096]), ("llama.cpp (Δppl —)", [4096, 16384]),
                      ("lean (shared KV) (Δppl +1.23 %)", [4096, 16384]),      # 1 thread
                      ("lean (shared KV) (Δppl +1.23 %)", [4096, 16384])]      # 2 threads
    threads, by_t = demo.ttft_points([_ttft_doc()])
    assert threads == [1, 2] and by_t[1]["llama.cpp"]["pts"] == {4096: 56.9, 16384: 301.0}
    assert demo.plot_ttft([_doc()], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def test_rewrite_is_cached_by_stamp(tiny, tmp_path, capsys, monkeypatch):
    src = tiny["llama"] / "model.onnx"
    out = tmp_path / "r" / "model.onnx"
    flags = ["--weights", "int8", "--quality-budget", "off", "--attn-exact", "off"]
    rep = demo._rewrite(src, out, flags, False, cli.rewrite_config)
    assert rep["output"] and out.is_file() and (out.parent / "stamp.txt").is_file()
    mtime = out.stat().st_mtime_ns
    capsys.readouterr()
    rep2 = demo._rewrite(src, out, flags, False, cli.rewrite_config)                  # same stamp: reused
    assert "reusing" in capsys.readouterr().err and out.stat().st_mtime_ns == mtime
    assert rep2["output"] == rep["output"]
    demo._rewrite(src, out, flags, True, cli.rewrite_config)                           # --fresh: rewritten
    assert out.stat().st_mtime_ns != mtime
    mtime = out.stat().st_mtime_ns
    demo._rewrite(src, out, ["--weights", "int4", *flags[2:]], False, cli.rewrite_config)  # other flags
    assert out.stat().st_mtime_ns != mtime
    (out.parent / "stamp.txt").write_text("something else\n")            # a stamp that does not match
    mtime = out.stat().st_mtime_ns
    demo._rewrite(src, out, flags, False, cli.rewrite_config)
    assert out.stat().st_mtime_ns != mtime
    assert json.loads((out.parent / "report.json").read_text())["output"]
    # the stamp follows the rewriter's code, not the commit: a change of one of its files is a new stamp
    before = demo._stamp(src, flags)
    from rewriter.kit import stamps

    monkeypatch.setattr(stamps, "code_hash", lambda: "another code")
    assert demo._stamp(src, flags) != before


def test_demo_cli_flags():
    p = cli.build_parser()
    a = p.parse_args(["demo", "smollm2"])
    assert a.decode_past == [128, 4096, 8192] and a.threads == [1, 2] and a.repeats == 2 and not a.fresh
    a = p.parse_args(["demo", "smollm2", "--decode-past", "128", "--threads", "1", "--repeats", "5", "--fresh"])
    assert a.decode_past == [128] and a.threads == [1] and a.repeats == 5 and a.fresh
    with pytest.raises(SystemExit):
        p.parse_args(["demo", "no-such-model"])
    # the time to first token: 4k by default, 4k / 16k / 32k for the 1.5B model (capped by its positions
    # in the bench), --prompt to choose, none for no TTFT
    assert p.parse_args(["demo", "smollm2"]).prompt is None
    assert demo.demo_prompts("smollm2") == [4096] and demo.demo_prompts("qwen2.5-coder-1.5b") == [4096, 16384, 32768]
    assert demo.demo_prompts("smollm2", p.parse_args(["demo", "smollm2", "--prompt", "2k,512"]).prompt) == [512, 2048]
    assert demo.demo_prompts("qwen2.5-coder-1.5b", p.parse_args(["demo", "smollm2", "--prompt", "none"]).prompt) == []
    with pytest.raises(SystemExit):
        p.parse_args(["demo", "smollm2", "--prompt", "many"])
