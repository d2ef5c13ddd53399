"""The quality budget covers every change a rewrite makes (issue 34 item 4): weights and attention are
measured against the source model on held-out calibration text; what does not fit is not written
(exit 3, nothing on disk), what cannot be measured is refused (exit 2) unless --quality-budget off."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conftest import requires_native  # noqa: E402
from test_packed_gqa_cli import _calib_text, _rewrite  # noqa: E402

pytestmark = requires_native


@pytest.fixture(scope="module")
def tiny():
    import tiny_hf

    return tiny_hf.models()


@pytest.fixture(scope="module")
def forms():
    import tiny_hf

    return tiny_hf.forms()


def test_weights_over_the_budget_are_not_written(forms, tmp_path, capsys):
    """int4 weights (MatMulNBits RTN) whose measured loss exceeds the budget: exit 3, no file, the message names the cost
    and the budget that lifts it; with that budget the same rewrite writes the model and reports
    the weights' share against the source."""
    src = forms["genai-fp32"] / "model.onnx"
    calib = str(_calib_text(tmp_path / "calib.txt"))
    out = tmp_path / "q.onnx"
    rc, rep = _rewrite(src, out, "--weights", "int4", "--weights-quantizer", "nbits", "--attn-exact", "off",
                       "--calib-text", calib, "--quality-budget", "1e-6")
    assert rc == 3 and not out.exists() and rep["output"] is None
    q = rep["quality"]
    assert q["refused"] and q["weights_alone"] > 1e-6 and q["weights_by"] == ["int4 (MatMulNBits)"]
    assert "weights alone (int4 (MatMulNBits)) cost delta_ppl" in rep["refused"]
    lift = rep["refused"].rsplit("--quality-budget ", 1)[1].rstrip(")")
    assert float(lift) >= q["weights_alone"]
    rc, rep = _rewrite(src, out, "--weights", "int4", "--weights-quantizer", "nbits", "--attn-exact", "off",
                       "--calib-text", calib, "--quality-budget", lift)
    assert rc == 0 and out.exists()
    assert rep["quality"]["loss"] == rep["quality"]["weights_alone"] <= float(lift)


def test_lossy_rewrite_without_calibration_is_refused(forms, tiny, tmp_path, capsys):
    """No --calib-text and a budget: nothing measures the change, so it is refused (exit 2) naming what
    to give — weights and approximate attention alike; --quality-budget off writes it unmeasured."""
    src = forms["genai-fp32"] / "model.onnx"
    for flags in (["--weights", "int8", "--attn-exact", "off"], ["--state-pack", "binary", "--attn-pack-bits", "sign"],
                  ["--state-pack", "binary", "--attn-budget", "0.5", "--fuse=off"]):
        s = tiny["llama"] / "model.onnx" if "--fuse=off" in flags else src
        out = tmp_path / "x.onnx"
        rc, _ = _rewrite(s, out, *flags)
        err = capsys.readouterr().err
        assert rc == 2 and not out.exists() and "--calib-text" in err and "--quality-budget off" in err, (flags, err)
        rc, _ = _rewrite(s, out, *flags, "--quality-budget", "off")
        assert rc == 0 and out.exists(), flags
        out.unlink()


def test_given_attention_setting_is_measured_and_refused(forms, tmp_path):
    """Budget and window given on the command line are no longer written untested: measured in decode
    mode against exact attention; over the budget → exit 3 with the measured Δppl, nothing written."""
    src = forms["genai-fp32"] / "model.onnx"
    calib = str(_calib_text(tmp_path / "calib.txt"))
    out = tmp_path / "a.onnx"
    flags = ["--state-pack", "binary", "--attn-pack-bits", "sign", "--attn-kv", "int4", "--attn-budget", "0.0625",
             "--attn-window", "8", "--attn-min-candidates", "4", "--calib-text", calib, "--attn-tune-context", "300",
             "--attn-tune-score", "32"]
    rc, rep = _rewrite(src, out, *flags, "--quality-budget", "1e-6")
    assert rc == 3 and not out.exists()
    assert "PackedAttention: --attn-budget 0.0625 --attn-window 8" in rep["refused"]
    rec = rep["graph_passes"][-1]
    assert rec["decision"] == rep["refused"]
    trials = rec["quality"]["tune"]["quality"]["trials"]
    assert len(trials) == 1 and trials[0]["delta_ppl_upper"] > 1e-6
    assert rep["resources"]["stages"][-1]["stage"] == "packed_attention"   # the refusing pass's time is reported
    rc, rep = _rewrite(src, out, *flags, "--quality-budget", "100")
    assert rc == 0 and out.exists()
    t = next(r for r in rep["graph_passes"] if "tune" in r)["tune"]
    assert (t["budget"], t["window"]) == (0.0625, 8) and len(t["quality"]["trials"]) == 1


def test_unfused_attention_is_measured(tiny, forms, tmp_path):
    """The unfused path has no tuner: its setting is measured in decode mode, kept within the budget
    (the report carries the check) and refused over it."""
    src = tiny["llama"] / "model.onnx"
    calib = str(_calib_text(tmp_path / "calib.txt"))
    out = tmp_path / "u.onnx"
    flags = ["--fuse=off", "--state-pack", "binary", "--attn-budget", "0.25", "--attn-window", "4",
             "--attn-min-context", "8", "--attn-min-candidates", "4", "--calib-text", calib,
             "--tokenizer", str(forms["genai-fp32"] / "tokenizer.json"),
             "--attn-tune-context", "100", "--attn-tune-score", "32"]
    rc, rep = _rewrite(src, out, *flags, "--quality-budget", "1e-6")
    assert rc == 3 and not out.exists() and "unfused graph: no tuner" in rep["refused"]
    rc, rep = _rewrite(src, out, *flags, "--quality-budget", "100")
    assert rc == 0 and out.exists()
    q = next(r for r in rep["graph_passes"] if "quality_check" in r)["quality_check"]
    assert q["context"] == 100 and q["scored"] >= 32 and q["delta_ppl_upper"] >= q["delta_ppl"]
