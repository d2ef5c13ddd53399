"""`ortlean rewrite --state-pack binary` on fused graphs (issue 10): PackedAttention replaces the
GroupQueryAttention of an optimum export fused by --fuse=auto and of a genai builder model, with
--weights int4; --fuse=off keeps the legacy unfused path; --attn-tune chooses budget/window from
decode-mode perplexity and min_context from a measured crossover; the rewritten model runs with
the shared-KV loop, `ortlean generate/eval` and in `ortlean bench`'s decode table at long pasts;
a sliding-window model of another family (Mistral, head dim 48) is exact at full budget."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import custom_ops  # noqa: E402
from custom_ops import runtime  # noqa: E402

from conftest import requires_native  # noqa: E402

pytestmark = requires_native


@pytest.fixture(scope="module")
def tiny():
    import tiny_hf

    return tiny_hf.models()


@pytest.fixture(scope="module")
def forms():
    import tiny_hf

    return tiny_hf.forms()


def _rewrite(src, out, *flags):
    from rewriter import cli

    rep = Path(str(out) + ".json")
    rc = cli.main(["rewrite", str(src), "-o", str(out), "-q", "--report", str(rep), *flags])
    return rc, (json.loads(rep.read_text()) if rep.exists() else None)


def _ops(path):
    import onnx

    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


def _shared_logits(path, prompt, steps, ref_io=None):
    """Prefill + single-token steps with runtime.SharedKV (one buffer per state)."""
    sess = custom_ops.session(str(path), threads=2)
    io = runtime.ModelIO.from_session(sess, str(path))
    kv = runtime.SharedKV(sess, io, max_len=prompt.shape[1] + steps.shape[1])
    out = [kv.prefill(prompt)[:, -1]]
    out += [kv.step(t[:, None])[:, -1] for t in steps.T]
    return np.stack(out, 1)


def _calib_text(path: Path, seed=0, phrases=30, n=400):
    """Word-level text for the tiny tokenizer (w0..w255) with repeated phrases, so attention matters."""
    r = np.random.default_rng(seed)
    ph = [" ".join(f"w{x}" for x in r.integers(4, 256, 12)) for _ in range(phrases)]
    path.write_text(" ".join(ph[i] for i in r.integers(0, phrases, n)))
    return path


def _check_packed(path, kvq):
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    pa = [n for n in m.graph.node if n.op_type == "PackedAttention"]
    assert pa and not any(n.op_type == "GroupQueryAttention" for n in m.graph.node)
    assert all(next(a.s.decode() for a in n.attribute if a.name == "kv_quant") == kvq for n in pa)
    names = {i.name for i in m.graph.input}
    assert "past_key_values.0.kv" in names and "past_key_values.0.key_bits" in names
    return pa


# --------------------------------------------------------------------------- the three input paths
def test_optimum_export_fused_then_packed_with_int4(tiny, tmp_path):
    """(a) optimum export: --fuse=auto fuses (GroupQueryAttention), then PackedAttention replaces
    it; with --weights int4 and fp32 rows at full budget the logits equal the fused int4 twin's
    (--fuse=auto --weights int4) to 1e-5 over a prompt and decode steps."""
    src = tiny["llama"] / "model.onnx"
    rc, rep = _rewrite(src, tmp_path / "twin.onnx", "--weights", "int4", "--quality-budget", "off", "--attn-exact", "off")
    assert rc == 0 and "GroupQueryAttention" in _ops(tmp_path / "twin.onnx")
    rc, rep = _rewrite(src, tmp_path / "pa.onnx", "--weights", "int4", "--quality-budget", "off", "--state-pack", "binary", "--attn-kv", "fp32",
                       "--attn-budget", "1", "--attn-tune", "off")
    assert rc == 0, rep
    assert rep["graph_passes"][0]["backend"] == "fuse"
    assert [r["backend"] for r in rep["graph_passes"][1:3]] == ["packed_attention"] * 2
    assert "BlockQuantMatMul" in _ops(tmp_path / "pa.onnx")     # --weights int4 on a float checkpoint
    _check_packed(tmp_path / "pa.onnx", "fp32")
    r = np.random.default_rng(0)
    prompt, steps = r.integers(0, 256, (1, 30)), r.integers(0, 256, (1, 8))
    np.testing.assert_allclose(_shared_logits(tmp_path / "pa.onnx", prompt, steps),
                               _shared_logits(tmp_path / "twin.onnx", prompt, steps), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def pa_decoder(tiny, tmp_path_factory):
    """The tiny llama rewritten with BlockQuantMatMul weights and exact PackedAttention over an fp32 cache
    (what the step scripts below time), written once for the module."""
    out = tmp_path_factory.mktemp("pa_decoder") / "pa.onnx"
    rc, rep = _rewrite(tiny["llama"] / "model.onnx", out, "--weights", "int4", "--quality-budget", "off",
                       "--state-pack", "binary", "--attn-kv", "fp32", "--attn-budget", "1", "--attn-tune", "off")
    assert rc == 0, rep
    return out


def test_step_breakdown_script(pa_decoder, tmp_path):
    """tests/bench/step_breakdown.py on a rewritten tiny decoder (BlockQuantMatMul weights, PackedAttention
    with a cache), in its own process (its phase clocks are an environment switch): a row per thread
    count with every weight node's decode call timed once a step, the parts within the step and the
    weights floor."""
    import onnx
    import subprocess
    import sys

    nodes = [n.op_type for n in onnx.load(str(pa_decoder), load_external_data=False).graph.node]
    out = tmp_path / "sb.json"
    script = Path(__file__).resolve().parent / "bench" / "step_breakdown.py"
    r = subprocess.run([sys.executable, str(script), str(pa_decoder), "--past", "16", "--steps", "6",
                        "--rounds", "2", "--threads", "1,2", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["commit"] and doc["machine"]["cores"] and [row["threads"] for row in doc["rows"]] == [1, 2]
    for row in doc["rows"]:
        assert row["bq_calls"] == nodes.count("BlockQuantMatMul") and row["past"] == 16
        assert 0 < row["tasks"] <= row["bq"] and row["pool"] >= 0 and row["call"] >= 0
        assert row["pa"] > 0 and row["pa_attend"] > 0 and row["floor"] > 0
        assert row["bq"] + row["pa"] + row["rest"] == pytest.approx(row["step_mean"], rel=0.05)
        assert 0 < row["bq"] + row["pa"] < row["step_mean"]
    assert "BlockQuantMatMul" in r.stdout and "weights floor" in r.stdout


def test_attn_inmodel_script_counts_the_attention_nodes_only(pa_decoder):
    """tests/bench/attn_inmodel.py on a rewritten tiny decoder whose weights are BlockQuantMatMul (which
    has phase clocks too): the phases are PackedAttention's, averaged over its nodes alone."""
    import onnx
    import re
    import subprocess
    import sys

    ops = [n.op_type for n in onnx.load(str(pa_decoder), load_external_data=False).graph.node]
    assert "BlockQuantMatMul" in ops
    script = Path(__file__).resolve().parent / "bench" / "attn_inmodel.py"
    r = subprocess.run([sys.executable, str(script), str(pa_decoder), "--past", "24", "--steps", "4",
                        "--repeats", "1", "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r"; (\d+) nodes = (\d+) % of the mean step", r.stdout)
    assert m and int(m.group(1)) == ops.count("PackedAttention") and 0 < int(m.group(2)) < 100, r.stdout


@pytest.mark.parametrize("chunked", [False, True])
def test_fixed_past_steps_all_attend_to_the_same_cache(pa_decoder, chunked):
    """runtime.bench.FixedPast (the step loop of step_breakdown.py and attn_inmodel.py): after its warm-up and
    timed steps the cache still holds the past alone — a step from it gives the logits of a fresh prefill of
    the same tokens and that step — whether the past was prefilled in one run or in chunks; asking for more
    steps than the ids were drawn for is refused."""
    from custom_ops.runtime.bench import FixedPast

    sess = custom_ops.session(str(pa_decoder), threads=1)
    io = runtime.ModelIO.from_session(sess, str(pa_decoder))
    fixed = FixedPast(sess, io, past=20, steps=4, warmup=3, chunked=chunked)
    assert fixed.ids.shape == (1, 27)
    calls = []
    ts = fixed.steps(4, before=lambda: calls.append(fixed.kv.length))
    assert len(ts) == 4 and all(t > 0 for t in ts) and calls == [21]   # after the warm-up's steps
    fixed.kv.length = 20
    got = fixed.kv.step(fixed.ids[:, 26:27])
    fresh = runtime.SharedKV(sess, io, max_len=21)
    fresh.prefill(fixed.ids[:, :20])
    np.testing.assert_allclose(got, fresh.step(fixed.ids[:, 26:27]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="5 steps"):
        fixed.steps(5)


def test_attn_exact_replaces_gqa_with_the_same_attention(tiny, tmp_path):
    """--attn-exact (fused graphs, no --state-pack): on → every GroupQueryAttention becomes exact
    PackedAttention (fp32 rows, budget 0), logits equal to the GQA twin's (--attn-exact off) to 1e-5
    over a prompt and decode steps in the shared-KV loop and in the plain growing-state loop; auto
    (the default) decides from the measured one-layer speed and says so in the report either way;
    with --state-pack the PackedAttention pass takes every layer and this pass finds nothing."""
    src = tiny["qwen2"] / "model.onnx"
    rc, _ = _rewrite(src, tmp_path / "twin.onnx", "--weights", "int4", "--quality-budget", "off", "--attn-exact", "off")
    assert rc == 0 and "GroupQueryAttention" in _ops(tmp_path / "twin.onnx")
    rc, rep = _rewrite(src, tmp_path / "ex.onnx", "--weights", "int4", "--quality-budget", "off", "--attn-exact", "on")
    assert rc == 0, rep
    pa = _check_packed(tmp_path / "ex.onnx", "fp32")
    assert all(next(a.f for a in n.attribute if a.name == "budget") == 0.0 for n in pa)
    recs = [g for g in rep["graph_passes"] if g["backend"] == "exact_attention"]
    assert len(recs) == len(pa) and "measured" not in recs[0]["decision"]   # on: no timing
    r = np.random.default_rng(1)
    prompt, steps = r.integers(0, 256, (1, 21)), r.integers(0, 256, (1, 7))
    np.testing.assert_allclose(_shared_logits(tmp_path / "ex.onnx", prompt, steps),
                               _shared_logits(tmp_path / "twin.onnx", prompt, steps), atol=1e-5, rtol=1e-5)
    outs = []
    for p in ("ex.onnx", "twin.onnx"):
        s = custom_ops.session(str(tmp_path / p), threads=1)
        io = runtime.ModelIO.from_session(s, str(tmp_path / p))
        res = runtime.run(s, io, runtime.feeds(io, prompt))
        logits = [res["logits"][:, -1]]
        past, plen = io.next_state(res), prompt.shape[1]
        for t in steps.T:
            res = runtime.run(s, io, runtime.feeds(io, t[:, None], past, plen))
            logits.append(res["logits"][:, -1])
            past, plen = io.next_state(res), plen + 1
        outs.append(np.stack(logits, 1))
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    # auto: the decision names the measured speed, whichever way it went
    rc, rep = _rewrite(src, tmp_path / "auto.onnx", "--weights", "int4", "--quality-budget", "off")
    assert rc == 0
    recs = [g for g in rep["graph_passes"] if g["backend"] in ("exact_attention", "dense") and "measured" in g["decision"]]
    assert recs and ("PackedAttention" in _ops(tmp_path / "auto.onnx")) == (recs[0]["backend"] == "exact_attention")
    # --state-pack: PackedAttention's own pass takes the layers; nothing left for --attn-exact
    rc, rep = _rewrite(src, tmp_path / "sp.onnx", "--weights", "int4", "--quality-budget", "off", "--state-pack", "binary", "--attn-budget", "0",
                       "--attn-tune", "off", "--attn-exact", "on")
    assert rc == 0 and not [g for g in rep["graph_passes"] if g["backend"] == "exact_attention"]
    _check_packed(tmp_path / "sp.onnx", "int8")


def test_exact_attention_timing_models_compute_the_same():
    """rewriter.kit.timing.exact_attention_speed times a one-node GroupQueryAttention against the node
    apply_gqa makes of it: the two compute the same decode step (1e-5), packed QKV and separate Q/K/V,
    rotary inside; and the measurement returns both times per past."""
    from custom_ops.reference.attn import pack_cache
    from rewriter.backends.packed_attention import exact_gqa
    from rewriter.kit import timing
    import onnx_ir as ir
    import onnxruntime as ort

    for packed in (True, False):
        attrs = dict(num_heads=4, kv_num_heads=2, do_rotary=1, rotary_interleaved=0, scale=0.2, local_window_size=-1)
        gm = timing.gqa_model(attrs, 4, 2, 16, 16, packed, 64)
        pm = timing.gqa_model(attrs, 4, 2, 16, 16, packed, 64)
        exact_gqa(pm)
        sg = ort.InferenceSession(ir.serde.serialize_model(gm).SerializeToString(), providers=["CPUExecutionProvider"])
        sp = custom_ops.session(ir.serde.serialize_model(pm).SerializeToString())
        r = np.random.default_rng(2)
        P = 13
        K, V = r.standard_normal((1, 2, P, 16), dtype=np.float32), r.standard_normal((1, 2, P, 16), dtype=np.float32)
        base = {"query": r.standard_normal((1, 1, (4 + 4) * 16 if packed else 4 * 16), dtype=np.float32),
                "seqlens_k": np.array([P], np.int32), "total_sequence_length": np.array(P + 1, np.int32)}
        if not packed:
            base |= {"key": r.standard_normal((1, 1, 32), dtype=np.float32),
                     "value": r.standard_normal((1, 1, 32), dtype=np.float32)}
        yg = sg.run(["y"], {**base, "past_key_values.0.key": K, "past_key_values.0.value": V})[0]
        names = {i.name for i in sp.get_inputs()}
        bits, rows = pack_cache(K, V, "fp32", "sign", 0.0)
        fp = {**base, "past_key_values.0.kv": rows, "past_key_values.0.key_bits": bits}
        yp = sp.run([sp.get_outputs()[0].name], {k: v for k, v in fp.items() if k in names})[0]
        np.testing.assert_allclose(yp, yg, atol=1e-5, rtol=1e-5)
    res = timing.exact_attention_speed(attrs, 4, 2, 16, 16, False, 64, exact_gqa, pasts=(32,), use_cache=False)
    v = res["pasts"]["32"]
    assert v["gqa"] > 0 and v["exact"] > 0 and res["min_speedup"] == v["speedup"]


def test_genai_builder_model_packed(forms, tmp_path):
    """(b) a genai builder model (GroupQueryAttention already, head dim declared symbolic): exact at
    full budget to 1e-5 against it; int8 rows close; `ortlean generate` runs it (plain loop)."""
    from rewriter import cli

    if "genai-int4" not in forms:
        pytest.skip("onnxruntime-genai not installed")
    src = forms["genai-int4"] / "model.onnx"
    rc, rep = _rewrite(src, tmp_path / "pa.onnx", "--state-pack", "binary", "--attn-kv", "fp32", "--attn-budget", "1",
                       "--attn-tune", "off")
    assert rc == 0 and [r["backend"] for r in rep["graph_passes"]].count("packed_attention") == 2, rep
    _check_packed(tmp_path / "pa.onnx", "fp32")
    r = np.random.default_rng(1)
    prompt, steps = r.integers(0, 256, (1, 25)), r.integers(0, 256, (1, 6))
    ref = _shared_logits(src, prompt, steps)
    np.testing.assert_allclose(_shared_logits(tmp_path / "pa.onnx", prompt, steps), ref, atol=1e-5, rtol=1e-5)
    rc, _ = _rewrite(src, tmp_path / "p8.onnx", "--state-pack", "binary", "--quality-budget", "off", "--attn-kv", "int8", "--attn-budget", "1",
                     "--attn-tune", "off")
    got8 = _shared_logits(tmp_path / "p8.onnx", prompt, steps)
    assert rc == 0 and np.abs(got8 - ref).max() < 0.02 * np.abs(ref).max()
    assert cli.main(["generate", str(tmp_path / "pa.onnx"), "--prompt", "w5 w6 w7", "--max-new-tokens", "4",
                     "--tokenizer", str(forms["genai-int4"] / "tokenizer.json")]) == 0


def test_fuse_off_keeps_the_unfused_path(tiny, tmp_path):
    """(c) --fuse=off: PackedAttention on the unfused attention core (key bits state, float K/V cache)."""
    rc, rep = _rewrite(tiny["llama"] / "model.onnx", tmp_path / "u.onnx", "--fuse=off", "--weights", "int4", "--quality-budget", "off",
                       "--state-pack", "binary")
    ops = _ops(tmp_path / "u.onnx")
    assert rc == 0 and "PackedAttention" in ops and "GroupQueryAttention" not in ops and "BlockQuantMatMul" in ops
    import onnx

    names = {i.name for i in onnx.load(str(tmp_path / "u.onnx"), load_external_data=False).graph.input}
    assert {"past_key_values.0.key", "past_key_values.0.key_bits"} <= names and "past_key_values.0.kv" not in names


def test_eps_bits_without_eps_stay_unfused(tiny, forms, tmp_path):
    """eps-mode key bits calibrate eps per head on the unfused core: --fuse=auto stands aside (one
    report line); given --state-pack-eps it fuses and PackedAttention replaces the GroupQueryAttention."""
    tok = str(forms["genai-fp32"] / "tokenizer.json")   # the same w0..w255 vocabulary as the tiny llama
    rc, rep = _rewrite(tiny["llama"] / "model.onnx", tmp_path / "e.onnx", "--state-pack", "ternary", "--quality-budget", "off",
                       "--calib-text", str(_calib_text(tmp_path / "c.txt")), "--tokenizer", tok)
    assert rc == 0 and rep["graph_passes"][0]["decision"].startswith("kept unfused: --state-pack eps-mode")
    assert "PackedAttention" in _ops(tmp_path / "e.onnx") and "GroupQueryAttention" not in _ops(tmp_path / "e.onnx")
    rc, rep = _rewrite(tiny["llama"] / "model.onnx", tmp_path / "f.onnx", "--state-pack", "ternary", "--quality-budget", "off",
                       "--state-pack-eps", "0.5")
    assert rc == 0 and rep["graph_passes"][0]["backend"] == "fuse"
    _check_packed(tmp_path / "f.onnx", "int8")


# --------------------------------------------------------------------------- --attn-tune
def test_tune_chooses_budget_window_min_context(forms, tmp_path):
    """--attn-tune (default) with --calib-text: trials of decode-mode Δppl vs the exact-attention
    model, the chosen budget/window the smallest passing ones, min_context from the measured
    crossover; the nodes carry the chosen values and the report says them."""
    import onnx

    src = forms["genai-fp32"] / "model.onnx"
    calib = _calib_text(tmp_path / "calib.txt")
    rc, rep = _rewrite(src, tmp_path / "t.onnx", "--state-pack", "binary", "--weights", "int4", "--calib-text",
                       str(calib), "--attn-tune-context", "300", "--attn-tune-score", "32", "--quality-budget", "0.05")
    assert rc == 0, rep
    rec = next(r for r in rep["graph_passes"] if "tune" in r)
    t = rec["tune"]
    trials = t["quality"]["trials"]
    assert trials[0]["budget"] == 1.0 and t["quality"]["context"] == 300
    assert all(x["delta_ppl_upper"] >= x["delta_ppl"] for x in trials)
    passing = [x for x in trials if x["delta_ppl_upper"] <= 0.05]   # the budget holds at the upper bound
    assert {"budget": t["budget"], "window": t["window"]} in [{"budget": x["budget"], "window": x["window"]}
                                                              for x in passing]
    # the fastest passing trial by the op's measured speedup at the context (exact unless one is >= MIN_SPEEDUP)
    from rewriter.backends.packed_attention import MIN_SPEEDUP

    sp = {(x["budget"], x["window"]): x["speedup"] for x in passing}
    fastest = max(sp, key=lambda k: (sp[k], k[0]))
    assert (t["budget"], t["window"]) == (fastest if sp[fastest] >= MIN_SPEEDUP or fastest[0] == 1.0 else (1.0, 256))
    for x in trials:   # every approximate trial tested its budget (more candidates than window + sinks)
        assert x["budget"] == 1.0 or np.ceil(x["budget"] * 300) > x["window"] + 4
    if 0 < t["budget"] < 1:
        x = rec["tune"]["min_context_measured"]
        sp = sorted((int(p), v) for p, v in x["speedup"].items())
        if x["crossover"] is None:
            assert sp[-1][1] <= 1
        else:   # every grid past from the crossover on is faster on the candidate path, the one below is not
            assert all(v >= 1 for p, v in sp if p >= x["crossover"])     # (speedups rounded to 3 decimals)
            below = [v for p, v in sp if p < x["crossover"]]
            assert not below or below[-1] <= 1
        assert t["min_context"] == (x["crossover"] if x["crossover"] is not None else 1 << 20)
    m = onnx.load(str(tmp_path / "t.onnx"), load_external_data=False)
    for n in (n for n in m.graph.node if n.op_type == "PackedAttention"):
        a = {x.name: x for x in n.attribute}
        assert abs(a["budget"].f - t["budget"]) < 1e-7 and a["window"].i == t["window"]
        assert a["min_context"].i == t["min_context"]
    assert f"budget {t['budget']:g}, window {t['window']}" in rec["decision"]


@pytest.mark.parametrize("kvq", ["int8", "fp32"])
def test_tuner_decode_of_spans_in_one_batch_equals_span_by_span(forms, tmp_path, kvq):
    """The tuner scores its spans in one batch (one row per span): the NLL of every scored token is
    runtime.decode_perplexity's, span by span, for a PackedAttention model and for the exact GQA twin,
    from a prefill and from the cache of an earlier call (also cut to a shorter context)."""
    from rewriter.backends.packed_attention import _decode_nll_spans

    src = forms["genai-fp32"] / "model.onnx"
    out = tmp_path / "pa.onnx"
    rc, _ = _rewrite(src, out, "--state-pack", "binary", "--quality-budget", "off", "--attn-kv", kvq,
                     "--attn-budget", "0.5", "--attn-window", "8", "--attn-min-context", "16", "--attn-tune", "off")
    assert rc == 0
    ids = np.random.default_rng(11).integers(3, 256, 3 * 101)
    C, score = 80, 20
    for path in (src, out):
        sess = custom_ops.session(str(path), threads=1)
        io = runtime.ModelIO.from_session(sess, str(path))
        spans = [ids[k * 101:(k + 1) * 101] for k in range(3)]
        nll, state = _decode_nll_spans(sess, spans, C, score, io_hint=io)
        want = runtime.decode_perplexity(sess, io, ids, context=C, score=score, windows=3)
        assert want["loop"] == "shared"
        np.testing.assert_allclose(nll, want["token_nll"], rtol=1e-4, atol=1e-4)
        again, _ = _decode_nll_spans(sess, spans, C, score, state, io_hint=io)
        np.testing.assert_allclose(again, nll, rtol=1e-5, atol=1e-5)
        short, _ = _decode_nll_spans(sess, [x[C - 40:] for x in spans], 40, score, io_hint=io)   # not the same tokens
        cut, _ = _decode_nll_spans(sess, spans, 40, score, state, io_hint=io)                    # the cache's first 40 rows
        want40 = np.concatenate([runtime.decode_perplexity(sess, io, x, context=40, score=score, windows=1)["token_nll"]
                                 for x in spans])
        np.testing.assert_allclose(cut, want40, rtol=1e-4, atol=1e-4)
        assert not np.allclose(short, cut)
        # the shorter decode ran in place over rows 40..59 of the cache and put them back
        after, _ = _decode_nll_spans(sess, spans, C, score, state, io_hint=io)
        np.testing.assert_allclose(after, nll, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="do not fit"):
            _decode_nll_spans(sess, [np.concatenate([x, x]) for x in spans], C + 1, score, state, io_hint=io)


@pytest.mark.parametrize("speeds,want", [({0.5: 1.5, 0.25: 1.4}, 0.5),     # fastest, not the smallest budget
                                         ({0.5: 1.1, 0.25: 0.9}, 1.0)])    # none MIN_SPEEDUP faster: exact
def test_tune_weighs_measured_speed(forms, tmp_path, monkeypatch, speeds, want):
    """--attn-tune among the trials within --quality-budget takes the fastest by the op's measured
    decode step at the calibration context (kit.timing.attention_crossover, here stubbed with given
    speedups), and exact int8 when no approximate budget is MIN_SPEEDUP faster."""
    from rewriter.kit import timing

    def fake(Hq, Hkv, D, Dv, attrs, **kw):
        s = speeds.get(attrs["budget"], 0.5)
        return {"pasts": {"64": {"exact": 1.0, "approx": 1.0, "speedup": 0.8 * s},
                          "1024": {"exact": 1.0, "approx": 1.0, "speedup": s}}, "crossover": 128}

    monkeypatch.setattr(timing, "attention_crossover", fake)
    src = forms["genai-fp32"] / "model.onnx"
    rc, rep = _rewrite(src, tmp_path / "t.onnx", "--state-pack", "binary", "--weights", "int4", "--calib-text",
                       str(_calib_text(tmp_path / "calib.txt")), "--attn-tune-context", "300",
                       "--attn-tune-score", "16", "--quality-budget", "10")
    assert rc == 0, rep
    t = next(r for r in rep["graph_passes"] if "tune" in r)["tune"]
    tried = {x["budget"]: x for x in t["quality"]["trials"]}
    assert {1.0, 0.5, 0.25} <= set(tried)            # all within the (wide) quality budget
    # a budget whose first (largest) window passes tries no other window
    assert len(t["quality"]["trials"]) == len(tried), t["quality"]["trials"]
    for b, sp in speeds.items():   # measured at the calibration context (300: between the grid's 64 and 1024)
        assert 0.8 * sp < tried[b]["speedup"] < sp
        assert tried[b]["speedup"] == pytest.approx(timing.speedup_at(fake(0, 0, 0, 0, {"budget": b}), 300), abs=1e-3)
    assert t["budget"] == want
    if want == 1.0:
        assert "exact kept" in t["summary"] and t["min_context"] == 256   # the flag's default min_context
        assert "quality_floor" not in t and "shorter" not in t["quality"]
    else:
        # the chosen budget checked again at 1/4, 1/2 and 3/4 of the context; within the wide budget
        # the quality floor is the shortest check, below the crossover: min_context = the crossover
        assert [c["context"] for c in t["quality"]["shorter"]] == [225, 150, 75]
        assert t["quality_floor"] == 75 and t["min_context"] == 128
        assert "quality from context 75" in t["summary"]


def test_shorter_checks_stop_at_the_first_failure():
    """The checks at shorter contexts run longest first and stop at the first over the budget (a
    shorter one cannot lower the floor); the floor is then the last passing one."""
    from rewriter.backends.packed_attention import quality_floor, shorter_checks

    seen = []

    def measure(c):
        seen.append(c)
        return (0.001, 0.004) if c > 1500 else (0.02, 0.03)

    checks = shorter_checks(4096, 0.02, measure)
    assert seen == [3072, 2048, 1024] and quality_floor(4096, checks, 0.02) == 2048
    seen.clear()
    checks = shorter_checks(4096, 0.005, lambda c: measure(c) if c != 2048 else (0.01, 0.02))
    assert [c["context"] for c in checks] == [3072, 2048] and quality_floor(4096, checks, 0.005) == 3072
    assert seen == [3072]
    assert [c["context"] for c in shorter_checks(40, 1.0, lambda c: (0.0, 0.0))] == [30, 20]   # none under 16


def test_tune_quality_floor_raises_min_context(forms, tmp_path, monkeypatch):
    """min_context is at least the quality floor - 1 (the approximate path only where the chosen
    budget's quality was shown), here a floor above the measured crossover."""
    from rewriter.backends import packed_attention as pa
    from rewriter.kit import timing

    monkeypatch.setattr(timing, "attention_crossover", lambda *a, **k: {
        "pasts": {"64": {"exact": 1.0, "approx": 1.0, "speedup": 1.2},
                  "1024": {"exact": 1.0, "approx": 1.0, "speedup": 1.5}}, "crossover": 128})
    monkeypatch.setattr(pa, "quality_floor", lambda C, checks, qb: 200)
    rc, rep = _rewrite(forms["genai-fp32"] / "model.onnx", tmp_path / "t.onnx", "--state-pack", "binary",
                       "--weights", "int4", "--calib-text", str(_calib_text(tmp_path / "calib.txt")),
                       "--attn-tune-context", "300", "--attn-tune-score", "16", "--quality-budget", "10")
    assert rc == 0, rep
    t = next(r for r in rep["graph_passes"] if "tune" in r)["tune"]
    assert 0 < t["budget"] < 1 and t["quality_floor"] == 200 and t["min_context"] == 199


def test_quality_floor():
    """The shortest context from which on every check passes (checks below the tuning context,
    lowered from the longest while they pass)."""
    from rewriter.backends.packed_attention import quality_floor

    ch = [{"context": 1024, "delta_ppl": 0.03}, {"context": 2048, "delta_ppl": 0.015}]
    assert quality_floor(4096, ch, 0.02) == 2048
    assert quality_floor(4096, ch, 0.05) == 1024
    assert quality_floor(4096, ch, 0.01) == 4096               # the longest check fails: the tuning context
    assert quality_floor(4096, [{"context": 1024, "delta_ppl": 0.0}, {"context": 2048, "delta_ppl": 0.5}],
                         0.02) == 4096                          # a pass below a failure does not count
    assert quality_floor(4096, [{"context": 1024, "delta_ppl": float("nan")}], 0.02) == 4096
    assert quality_floor(300, [], 0.02) == 300
    # the upper bound is what must pass when a check has one
    assert quality_floor(4096, [{"context": 2048, "delta_ppl": 0.015, "delta_ppl_upper": 0.025}], 0.02) == 4096


def test_paired_delta_upper_bound():
    """Δppl from paired per-token NLLs and its one-sided 95 % upper bound: equal NLLs give 0 and 0, a
    constant shift gives exp(shift) − 1 for both, noisy differences a bound above the mean that
    narrows as the sample grows."""
    from custom_ops.runtime.quality import Z_UPPER, paired_delta

    r = np.random.default_rng(0)
    ref = r.uniform(1, 5, 1000)
    assert paired_delta(ref, ref) == (0.0, 0.0)
    d, up = paired_delta(ref + 0.01, ref)
    assert d == pytest.approx(np.expm1(0.01)) and up == pytest.approx(d)
    noise = r.normal(0.01, 0.2, 4000)
    d1, u1 = paired_delta(ref + noise[:1000], ref)
    d4, u4 = paired_delta(np.tile(ref, 4) + noise, np.tile(ref, 4))
    assert u1 > d1 and u4 > d4 and u4 - d4 < u1 - d1
    se = noise[:1000].std(ddof=1) / np.sqrt(1000)
    assert u1 == pytest.approx(np.expm1(noise[:1000].mean() + Z_UPPER * se))


def test_speedup_at_interpolates_in_log_past():
    from rewriter.kit import timing

    r = {"pasts": {"100": {"speedup": 1.0}, "10000": {"speedup": 3.0}}}
    assert timing.speedup_at(r, 50) == 1.0 and timing.speedup_at(r, 20000) == 3.0
    assert timing.speedup_at(r, 1000) == pytest.approx(2.0)


def test_crossover_is_measured_and_cached(monkeypatch, tmp_path):
    """min_context comes from timing the op's two paths (cached per CPU/library in speed.json)."""
    from rewriter.kit import timing

    monkeypatch.setattr(timing, "cache_file", lambda: tmp_path / "speed.json")
    attrs = dict(kv_quant="int8", budget=0.25, window=16, sinks=4, scale=0.25, mode="sign")
    x = timing.attention_crossover(4, 2, 32, 32, attrs, pasts=(32, 256, 1024))
    assert set(x["pasts"]) == {"32", "256", "1024"} and all(v["exact"] > 0 and v["approx"] > 0
                                                             for v in x["pasts"].values())
    ok = [p for p in (32, 256, 1024) if x["pasts"][str(p)]["speedup"] > 1]
    assert (x["crossover"] is None) == (1024 not in ok)
    cached = json.loads((tmp_path / "speed.json").read_text())
    assert len(cached) == 1
    calls = []
    monkeypatch.setattr(timing, "packed_attention_model", lambda *a, **k: calls.append(a))
    assert timing.attention_crossover(4, 2, 32, 32, attrs, pasts=(32, 256, 1024)) == x and not calls


# --------------------------------------------------------------------------- eval / bench
def test_long_past_cache_from_an_fp32_row_cache(forms, tmp_path):
    """`ortlean bench`'s long pasts are built by a model with a float cache; `rewrite --weights int4`
    makes GroupQueryAttention exact PackedAttention (fp32 rows), so state_from_kv takes such a cache
    too: an int8 model's state made from it has the int8 widths and dequantizes to its K/V (was: the
    fp32 rows copied into the int8 state, a shape error)."""
    from custom_ops.reference.attn import unpack_kv
    from custom_ops.runtime import bench as rb

    src = forms["genai-fp32"] / "model.onnx"
    for name, kvq in (("f.onnx", "fp32"), ("i.onnx", "int8")):
        rc, _ = _rewrite(src, tmp_path / name, "--state-pack", "binary", "--quality-budget", "off", "--attn-kv", kvq, "--attn-budget", "1",
                         "--attn-tune", "off")
        assert rc == 0
    sf, si = (custom_ops.session(str(tmp_path / n), threads=1) for n in ("f.onnx", "i.onnx"))
    iof, ioi = runtime.ModelIO.from_session(sf), runtime.ModelIO.from_session(si)
    built = rb.chunked_state(sf, iof, np.random.default_rng(0).integers(3, 200, (1, 40)))
    st = rb.state_from_kv(ioi, built)
    for name in ioi.past_to_present:
        assert st[name].shape[-1] == ioi.state_shapes[name][-1], name
    stem = next(n for n in ioi.past_to_present if n.endswith(".kv"))[:-3]
    rows, bits = built[stem + ".kv"], built[stem + ".key_bits"]
    D = rows.shape[-1] // 2
    K, V = unpack_kv(rows, bits, D, D, "fp32")
    K8, V8 = unpack_kv(st[stem + ".kv"], st[stem + ".key_bits"], D, D, "int8")
    assert np.allclose(K8, K, atol=np.abs(K).max() / 100) and np.allclose(V8, V, atol=np.abs(V).max() / 100)


def test_eval_and_bench_defaults_follow_the_approximation(forms, tmp_path):
    """`ortlean eval`'s decode-mode context defaults to where the model approximates (its nodes'
    min_context + 1 when longer than 1024, capped by the positions, with a note when the scored steps
    cannot reach it); `ortlean bench`'s default pasts reach long contexts for such a model."""
    from rewriter import evaluate

    src = forms["genai-fp32"] / "model.onnx"
    text = _calib_text(tmp_path / "eval.txt", seed=3)
    # the tiny model takes 512 positions: the default context is capped at 512 - 16 - 1 = 495
    for mc, ctx, exact_note in ((16, None, False), (300, None, False), (300, 64, True), (1 << 20, None, True)):
        out = tmp_path / f"a{mc}.onnx"
        if not out.exists():
            rc, _ = _rewrite(src, out, "--state-pack", "binary", "--quality-budget", "off", "--attn-budget", "0.25", "--attn-window", "8",
                             "--attn-min-context", str(mc), "--attn-tune", "off")
            assert rc == 0
        res = evaluate.evaluate(str(out), str(src), str(text), threads=1, windows=4, decode_score=16,
                                decode_context=ctx)
        assert res["mode"].startswith("decode") and ("run its exact path" in res["mode"]) == exact_note, res["mode"]
        assert f"{ctx or 495}-token prefill" in res["mode"]
        assert res["tokens"] == 32 and res["delta_ppl_upper"] >= res["delta_ppl"]   # 2 windows x 16, paired bound
        assert evaluate.default_pasts(str(out)) == [128, 1024, 4096, 8192]
    assert evaluate.default_pasts(str(src)) == [128]
    # --decode-context given: decode mode for any model (int8 rows at budget 1 after a long context)
    res = evaluate.evaluate(str(src), str(src), str(text), threads=1, windows=4, decode_score=16, decode_context=64)
    assert res["mode"].startswith("decode") and "64-token prefill" in res["mode"] and res["delta_ppl"] == 0.0


def test_eval_decode_mode_and_bench_long_past_rows(forms, tmp_path, capsys):
    """`ortlean eval` scores an approximate PackedAttention model in decode mode (context capped by
    the model's positions); `runtime.bench.decode_table` builds long pasts once (chunked prefill of
    the GQA model) and gives PackedAttention rows their cache quantized from it: exact (fp32 rows,
    budget 1) from that cache equals GQA's next-step logits."""
    from custom_ops.runtime import bench as rb
    from rewriter import cli

    src = forms["genai-fp32"] / "model.onnx"
    rc, _ = _rewrite(src, tmp_path / "a.onnx", "--state-pack", "binary", "--quality-budget", "off", "--attn-budget", "0.25", "--attn-window", "8",
                     "--attn-min-context", "16", "--attn-tune", "off")
    assert rc == 0
    text = _calib_text(tmp_path / "eval.txt", seed=3)
    assert cli.main(["eval", str(tmp_path / "a.onnx"), "--ref", str(src), "--text", str(text), "--decode-score", "16",
                     "--windows", "4", "--peers", "none"]) == 0
    out = capsys.readouterr().out
    assert "decode-mode" in out and "Δppl" in out and "one-sided 95 % upper bound" in out
    rc, _ = _rewrite(src, tmp_path / "x.onnx", "--state-pack", "binary", "--attn-kv", "fp32", "--attn-budget", "1",
                     "--attn-tune", "off")
    models = {}
    for k, p in (("gqa", src), ("pa", tmp_path / "a.onnx"), ("exact", tmp_path / "x.onnx")):
        s = custom_ops.session(str(p), threads=1)
        models[k] = (s, runtime.ModelIO.from_session(s, str(p)))
    tab = rb.decode_table(models, [16, 200], prefill_len=8, steps=2, repeats=1, shared=("gqa", "pa", "exact"),
                          long_past_from="gqa", own_past=64)
    assert {"gqa", "pa", "gqa | shared KV", "pa | shared KV"} <= set(tab)
    assert all(tab[r]["decode200"] > 0 for r in tab)
    # a PastStore with a directory: the first table builds the long past and keeps it on disk, a later
    # run (a new store on the same directory) loads it; another building model's stamp misses
    said = []
    store = rb.PastStore(tmp_path / "pasts", {"model": "gqa"})
    rb.decode_table(models, [200], prefill_len=8, steps=1, repeats=1, shared=("pa",), long_past_from="gqa",
                    own_past=64, built=store, say=said.append)
    assert any("past 200: cache built by gqa" in m for m in said)
    said.clear()
    again = rb.PastStore(tmp_path / "pasts", {"model": "gqa"})
    rb.decode_table(models, [200], prefill_len=8, steps=1, repeats=1, shared=("pa",), long_past_from="gqa",
                    own_past=64, built=again, say=said.append)
    assert any("past 200: cache loaded from" in m for m in said) and not any("built by" in m for m in said)
    (key, kv), = store.mem.items()
    assert all(np.array_equal(kv[n], again.mem[key][n]) for n in kv)
    ids = np.random.default_rng(0).integers(3, 256, (1, 200))
    rb.PastStore(tmp_path / "direct", {"model": "a"}).put(ids, kv)
    got = rb.PastStore(tmp_path / "direct", {"model": "a"}).get(ids)
    assert got is not None and all(np.array_equal(got[n], kv[n]) for n in kv)
    assert rb.PastStore(tmp_path / "direct", {"model": "b"}).get(ids) is None      # another model's
    assert rb.PastStore(tmp_path / "direct", {"model": "a"}).get(ids[:, ::-1]) is None   # other ids
    full = rb.PastStore(tmp_path / "full", {"model": "gqa"}, keep_free=1 << 62)
    full.put(ids, kv)
    assert "not kept" in full.skipped[0] and not any((tmp_path / "full").iterdir())
    entry, = (tmp_path / "pasts").iterdir()   # an unreadable entry is a miss: built (and written) again
    (entry / "0.npy").write_bytes(b"junk")
    said.clear()
    rb.decode_table(models, [200], prefill_len=8, steps=1, repeats=1, shared=("pa",), long_past_from="gqa",
                    own_past=64, built=rb.PastStore(tmp_path / "pasts", {"model": "gqa"}), say=said.append)
    assert any("past 200: cache built by gqa" in m for m in said)
    ids = np.random.default_rng(5).integers(3, 256, (1, 200))
    s, io = models["gqa"]
    built = rb.chunked_state(s, io, ids, chunk=64)
    nxt = np.array([[7]])
    g = runtime.run(s, io, runtime.feeds(io, nxt, built, 200))[io.logits_name]
    s2, io2 = models["exact"]
    p = runtime.run(s2, io2, runtime.feeds(io2, nxt, rb.state_from_kv(io2, built), 200))[io2.logits_name]
    np.testing.assert_allclose(p, g, atol=1e-5, rtol=1e-5)
    # tests/bench/bench_decode_rss.py: a row's decode memory in a process of its own, its long past loaded
    # from bench's past cache (the ids a decode_table run with the same arguments draws: bench_ids) when
    # the building model's entry is there, else prefilled in the child
    import importlib.util

    from rewriter.kit import stamps

    spec = importlib.util.spec_from_file_location("bench_decode_rss", ROOT / "tests/bench/bench_decode_rss.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _, past_ids, _ = rb.bench_ids(models["pa"][1].vocab_size, [100, 200], 8, 2)
    s, io = models["gqa"]
    rb.PastStore(tmp_path / "rss", {"model": stamps.file_stamp(str(src)), "format": 1}).put(
        past_ids[200], rb.chunked_state(s, io, past_ids[200], chunk=64))
    args = ["--model", f"pa={tmp_path / 'a.onnx'}", "--decode-past", "100,200", "--threads", "1", "--steps", "2",
            "--prefill", "8", "--past-cache", str(tmp_path / "rss")]
    for frm, how in ((src, "loaded from"), (tmp_path / "x.onnx", "prefilled here")):
        js = tmp_path / "rss.json"
        assert mod.main(args + ["--cache-from", str(frm), "--json", str(js)]) == 0
        doc = json.loads(js.read_text())
        r = doc["rows"]["pa"]
        assert r["past"] == 200 and r["past_how"].startswith(how), r["past_how"]
        assert 0 < r["baseline"] <= r["rss_decode"] <= r["peak"] and r["tok_s"] > 0
        assert r["cache_bytes"] == runtime.cache_bytes_per_token(str(tmp_path / "a.onnx")) * 200
        assert doc["commit"] and doc["machine"]["cpu"] and "bench_decode_rss.py" in doc["command"]
    assert "decode memory after 200 tokens" in capsys.readouterr().out


# --------------------------------------------------------------------------- another family: sliding window
@pytest.fixture(scope="module")
def sliding():
    import tiny_hf

    d = tiny_hf.sliding()
    if d is None:
        pytest.skip("onnxruntime-genai not installed")
    return d


def test_sliding_window_family_exact_and_int8(sliding, tmp_path):
    """Mistral (sliding window 24, head dim 48, GQA 4/2) from the genai builder, rewritten by the
    CLI: fp32 rows at full budget equal GroupQueryAttention to 1e-5 over a prompt and 30 decode
    steps (well past the window); int8 rows within quantization tolerance; an approximate budget
    keeps the window (local_window) and runs."""
    import onnx

    src = sliding / "model.onnx"
    gqa = [n for n in onnx.load(str(src), load_external_data=False).graph.node if n.op_type == "GroupQueryAttention"]
    assert gqa and all(next(a.i for a in n.attribute if a.name == "local_window_size") == 24 for n in gqa)
    r = np.random.default_rng(2)
    prompt, steps = r.integers(0, 256, (1, 20)), r.integers(0, 256, (1, 30))
    ref = _shared_logits(src, prompt, steps)
    rc, _ = _rewrite(src, tmp_path / "f.onnx", "--state-pack", "binary", "--attn-kv", "fp32", "--attn-budget", "1",
                     "--attn-tune", "off")
    pa = _check_packed(tmp_path / "f.onnx", "fp32")
    assert rc == 0 and all(next(a.i for a in n.attribute if a.name == "local_window") == 24 for n in pa)
    np.testing.assert_allclose(_shared_logits(tmp_path / "f.onnx", prompt, steps), ref, atol=1e-5, rtol=1e-5)
    rc, _ = _rewrite(src, tmp_path / "q.onnx", "--state-pack", "binary", "--quality-budget", "off", "--attn-kv", "int8", "--attn-budget", "1",
                     "--attn-tune", "off")
    got8 = _shared_logits(tmp_path / "q.onnx", prompt, steps)
    assert rc == 0 and np.abs(got8 - ref).max() < 0.02 * np.abs(ref).max()
    rc, _ = _rewrite(src, tmp_path / "b.onnx", "--state-pack", "binary", "--quality-budget", "off", "--attn-kv", "int8", "--attn-budget", "0.3",
                     "--attn-window", "4", "--attn-min-context", "8", "--attn-tune", "off")
    approx = _shared_logits(tmp_path / "b.onnx", prompt, steps)
    assert rc == 0 and np.isfinite(approx).all() and np.abs(approx - ref).max() < 0.5 * np.abs(ref).max()


def test_bench_cli_packed_vs_gqa_twin(tiny, tmp_path, capsys):
    """`ortlean bench PACKED --ref GQA_TWIN --decode-past ...`: plain and shared-KV rows for both;
    a past at the model's position limit runs at limit − steps (said in a note); the ORT profile is of
    decode steps after the longest past, in the shared-KV loop, with the attention nodes' share and
    the attention-free bound of the dense step."""
    from rewriter import cli

    src = tiny["llama"] / "model.onnx"
    assert _rewrite(src, tmp_path / "twin.onnx", "--weights", "int4", "--quality-budget", "off", "--attn-exact", "on")[0] == 0
    assert _rewrite(src, tmp_path / "pa.onnx", "--weights", "int4", "--quality-budget", "off", "--state-pack", "binary", "--attn-budget", "0.5",
                    "--attn-window", "16", "--attn-min-context", "32", "--attn-tune", "off")[0] == 0
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", str(tmp_path / "pa.onnx"), "--ref", str(tmp_path / "twin.onnx"), "--decode-past", "64,512",
                   "--threads", "1", "--repeats", "1", "--steps", "2", "--nbits", "none", "--peers", "none",
                   "--no-llama", "--huge-pages", "off", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["pasts"] == [64, 510] and any("512 positions" in n for n in r["notes"])
    from rewriter import results

    assert r["git_start"] == list(results.git_commit()) and r["commit"] == r["git_start"][0]  # the code that ran
    dp = r["decode_profile"]
    assert dp["past"] == 512 - 20 and set(dp) == {"past", "t1"}  # 4 warm-up + 16 profiled steps fit
    short = dp["t1"]["short_step"]  # every row after 1 token
    assert set(short) == {"dense", "lean", "dense | shared KV", "lean | shared KV"} and min(short.values()) > 0
    for k in ("dense", "lean"):  # the twin's attention: PackedAttention's exact path (--attn-exact on)
        prof = dp["t1"][k]
        ops = {x["op_type"]: x for x in prof["rows"]}
        att = ops["PackedAttention"]
        assert prof["loop"] == "shared KV" and att["count"] == att["calls"] >= 1
        assert prof["attention_ms"] == pytest.approx(att["total_ms"])
        assert 0 < prof["attention_ms"] < prof["node_ms"] <= prof["step_ms"]
    assert not any("2 MiB pages" in n for n in r["notes"])  # --huge-pages off
    rows = r["table"]["t1"]
    assert {"dense", "lean", "dense | shared KV", "lean | shared KV"} <= set(rows)
    assert all(rows[k]["decode510"] > 0 for k in rows)
    so = capsys.readouterr().out
    assert "dec P510 t1" in so and "ORT profile, lean, decode after 492 tokens, t1 (shared KV loop" in so
    est = next(ln for ln in so.splitlines() if ln.startswith("attention-free estimate, t1 (profiler off): "
                                                              "dense | shared KV's step over the fastest step"))
    assert "lean | shared KV's measured ratio: P64 " in est and ", P510 " in est and "(measured " in est


def test_bench_interleaves_llama_cpp_at_short_pasts(tiny, tmp_path, monkeypatch):
    """`ortlean bench` with llama.cpp at pasts up to 512: llama-bench takes its turn in every round of
    the table (one run per round and test, through $ORTLEAN_ANCHORS_SCRIPT here), its rows come from
    those rounds' medians and say so, and the ratio lines use them; the table itself keeps only the
    ONNX rows."""
    import stat

    from rewriter import evaluate

    script, log = tmp_path / "llama.sh", tmp_path / "calls"
    script.write_text(f"""#!/bin/bash
echo "$*" >> {log}
case "$*" in *"-n 0"*) p=8; n=0; d=0; ns=80000000;; *) p=0; n=2; d=64; ns=40000000;; esac
echo '[{{"n_prompt": '$p', "n_gen": '$n', "n_depth": '$d', "n_threads": 1, "avg_ts": 1.0, "samples_ns": ['$ns']}}]'
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("ORTLEAN_ANCHORS_SCRIPT", str(script))
    src = tiny["llama"] / "model.onnx"
    assert _rewrite(src, tmp_path / "lean.onnx", "--weights", "int4", "--quality-budget", "off")[0] == 0
    r = evaluate.bench(str(tmp_path / "lean.onnx"), str(src), threads=(1,), prefill=8, decode_past=[64], repeats=2,
                       steps=2, nbits=(), profile=False, peers="smollm2", genai=False, huge_pages=False)
    assert len(log.read_text().splitlines()) == 2 * 3   # (warm-up + 2 rounds) x (prompt, past 64)
    assert set(r["table"]["t1"]) == {"dense", "lean", "lean | shared KV"}
    lc = r["llama_cpp"]
    assert lc["command"].startswith("llama-bench interleaved with the ONNX rows") and "-d 64 -r 1" in lc["command"]
    assert [(x["test"], round(x["tok_s"])) for x in lc["rows"]] == [("pp8", 100), ("tg2@d64", 50)]
    text = evaluate.format_bench(r)
    assert "tokens/s median ± sd" in text and "/ [llama.cpp]: P64 t1 " in text


# --------------------------------------------------------------------------- pq key codes
def test_pq_codes_fitted_on_calibration_keys(forms, tmp_path, capsys):
    """--state-pack binary with --calib-text on a fused graph packs pq codes by default (auto): every
    node carries mode pq, a [Hkv, D/4, 16, 4] codebook and the rotary pairing as pq_dims; the model
    decodes; ortlean's long-past cache (state_from_kv, the packing read from the model file) packs
    the keys as the op itself does. --attn-pack-bits sign keeps sign bits with key scales; pq without
    calibration text, or on an unfused graph, is refused."""
    import onnx

    from custom_ops.runtime import bench as rb
    from rewriter.backends.packed_attention import pq_dims

    src = forms["genai-fp32"] / "model.onnx"
    calib = _calib_text(tmp_path / "calib.txt")
    rc, rep = _rewrite(src, tmp_path / "pq.onnx", "--state-pack", "binary", "--attn-kv", "fp32", "--attn-budget",
                       "0.5", "--attn-tune", "off", "--calib-text", str(calib), "--attn-pq-keys", "512")
    assert rc == 0, rep
    assert any("pq key codes" in r["decision"] for r in rep["graph_passes"])
    m = onnx.load(str(tmp_path / "pq.onnx"), load_external_data=False)
    pa = [n for n in m.graph.node if n.op_type == "PackedAttention"]
    hkv = next(a.i for a in pa[0].attribute if a.name == "kv_num_heads")
    for n in pa:
        a = {x.name: x for x in n.attribute}
        assert a["mode"].s == b"pq" and "kscale" not in a
        D = len(a["pq_dims"].ints) if "pq_dims" in a else None
        assert D and len(a["pq_book"].floats) == hkv * D * 16
        cos = next(i for i in m.graph.initializer if i.name == n.input[7])
        r = cos.dims[1] * 2
        assert list(a["pq_dims"].ints)[:4] == [0, r // 2, 1, r // 2 + 1] == pq_dims(D, (np.zeros((1, r // 2)),) * 2
                                                                                    + (False,))[:4]
    rc, _ = _rewrite(src, tmp_path / "f.onnx", "--state-pack", "binary", "--attn-kv", "fp32", "--attn-budget", "1",
                     "--attn-tune", "off")
    assert rc == 0
    sf, sp = (custom_ops.session(str(tmp_path / n), threads=1) for n in ("f.onnx", "pq.onnx"))
    iof, iop = runtime.ModelIO.from_session(sf, tmp_path / "f.onnx"), runtime.ModelIO.from_session(sp, tmp_path / "pq.onnx")
    assert iop.key_packing and all(v["mode"] == "pq" for v in iop.key_packing.values())
    ids = np.random.default_rng(0).integers(3, 200, (1, 60))
    own = rb.chunked_state(sp, iop, ids)            # the op packs its keys
    made = rb.state_from_kv(iop, rb.chunked_state(sf, iof, ids))   # the reference packs the float cache's keys
    for name in (n for n in iop.past_to_present if n.endswith(".key_bits")):
        W0 = own[name].shape[-1] - 2
        np.testing.assert_array_equal(own[name][..., :W0], made[name][..., :W0])  # contexts < min_context: exact
    logits = _shared_logits(tmp_path / "pq.onnx", ids[:, :40], ids[:, 40:48])
    assert np.isfinite(logits).all()
    # `ortlean inspect` lists a codebook by its length, not its values (--json keeps them)
    from rewriter import cli

    cli.main(["inspect", str(tmp_path / "pq.onnx")])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "mode=pq" in x)
    assert f"pq_book=[{len(a['pq_book'].floats)} values:" in line and len(line) < 600
    rc, rep = _rewrite(src, tmp_path / "s.onnx", "--state-pack", "binary", "--quality-budget", "off", "--attn-budget", "0.5", "--attn-tune", "off",
                       "--calib-text", str(calib), "--attn-pack-bits", "sign")
    assert rc == 0
    a = {x.name: x for x in next(n for n in onnx.load(str(tmp_path / "s.onnx"), load_external_data=False).graph.node
                                 if n.op_type == "PackedAttention").attribute}
    assert a["mode"].s == b"sign" and "kscale" in a and "pq_book" not in a
    import time

    t0 = time.perf_counter()
    rc, rep = _rewrite(src, tmp_path / "x.onnx", "--state-pack", "binary", "--attn-pack-bits", "pq", "--attn-tune", "off")
    err = capsys.readouterr().err
    assert rc == 2 and rep is None and "--attn-pack-bits pq: give --calib-text FILE" in err   # before any work
    assert not (tmp_path / "x.onnx").exists() and time.perf_counter() - t0 < 20


def test_fit_pq_book_and_rotary_helpers():
    """fit_pq_book recovers well-separated centroids; GroupQueryAttention's rotary (the reference's,
    which fit_pq_book turns keys back and on with) with -sin undoes itself; the rotary pairing of
    pq_dims for half-split and interleaved layouts."""
    from custom_ops.reference.attn import rotary
    from rewriter.backends.packed_attention import fit_pq_book, pq_dims

    r = np.random.default_rng(0)
    D = 16
    true = r.standard_normal((D // 4, 16, 4)).astype(np.float32) * 10
    keys = np.concatenate([true[np.arange(D // 4), r.integers(0, 16, D // 4)].reshape(D) for _ in range(800)])
    keys = keys.reshape(800, D) + r.standard_normal((800, D)).astype(np.float32) * 0.01
    book = fit_pq_book(keys, list(range(D)), None, 2000, seed=1)
    for s in range(D // 4):
        d = ((book[s][:, None] - true[s][None]) ** 2).sum(-1)
        assert d.min(0).max() < 0.1   # every true centroid found
    ang = r.uniform(0, 6.3, (5, 4)).astype(np.float32)
    x = r.standard_normal((1, 1, 5, 12)).astype(np.float32)
    pos = np.arange(5)[None]
    for inter in (False, True):
        y = rotary(x, pos, np.cos(ang), np.sin(ang), inter)
        assert np.allclose(rotary(y, pos, np.cos(ang), -np.sin(ang), inter), x, atol=1e-5)
        assert np.allclose(y[..., 8:], x[..., 8:])                              # dims past r unrotated
    assert pq_dims(12, (np.zeros((1, 4)), None, False)) == [0, 4, 1, 5, 2, 6, 3, 7, 8, 9, 10, 11]
    assert pq_dims(8, (np.zeros((1, 4)), None, True)) == list(range(8))
    assert pq_dims(8, None) == list(range(8))


def test_og_row_runs_pasts_near_the_context_length(forms):
    """The genai generator row (`ortlean bench`'s "| og") at a past whose rounds of steps would run
    past the model's context_length (SmolLM2: past 8176 + rounds x 16 > 8192, og refused max_length):
    max_length is capped, and when a round has no room left the generator is rewound to the past's
    length, untimed (before: built again, a prefill of the whole past per round)."""
    pytest.importorskip("onnxruntime_genai")
    from custom_ops.runtime.bench import OgRow

    d = forms["genai-fp32"]
    ctx = json.loads((d / "genai_config.json").read_text())["model"]["context_length"]
    p, steps = ctx - 16, 16
    ids = np.random.default_rng(0).integers(3, 200, (1, p))
    row = OgRow(d, threads=1, past_ids={p: ids}, steps=steps, rounds=4)
    assert row.max_len == ctx
    gens = []
    for _ in range(4):
        t = row.decode(p, np.zeros((1, steps), np.int64))
        assert len(t) == steps and all(x > 0 for x in t)
        assert row.used[p] <= ctx
        gens.append(row.gens[p])
    assert all(g is gens[0] for g in gens)   # one generator, rewound (og has rewind_to)
    assert gens[0].token_count() == ctx


def test_tune_prefill_chooses_a_sparse_budget(forms, tmp_path, monkeypatch):
    """--attn-tune also chooses the sparse prefill budget: prefill-mode Δppl of the calibration spans'
    rows past --attn-prefill-min-context against exact prompt attention, the smallest passing budget
    (the largest first, stopping at the first failure); the nodes carry it; a given budget over the
    quality budget is refused (exit 3) and nothing is written; --quality-budget off writes a given one
    unmeasured."""
    import onnx

    from rewriter.backends.packed_attention import PREFILL_BUDGETS

    src = forms["genai-fp32"] / "model.onnx"
    calib = _calib_text(tmp_path / "calib.txt", n=600)
    flags = ["--state-pack", "binary", "--calib-text", str(calib), "--attn-tune-context", "300",
             "--attn-tune-score", "32", "--attn-prefill-min-context", "128", "--attn-prefill-context", "1024",
             "--attn-prefill-window", "32", "--attn-prefill-block", "16"]   # (the tiny model has 512 positions)
    rc, rep = _rewrite(src, tmp_path / "t.onnx", *flags, "--quality-budget", "0.05")
    assert rc == 0, rep
    rec = next(r for r in rep["graph_passes"] if "prefill_tune" in r)
    pf = rec["prefill_tune"]
    trials = pf["quality"]["trials"]
    assert trials and [t["prefill_budget"] for t in trials] == list(PREFILL_BUDGETS[:len(trials)])
    assert pf["quality"]["contexts"] == [128, 512] and pf["quality"]["scored"] >= 700
    passing = [t["prefill_budget"] for t in trials if t["delta_ppl_upper"] <= pf["quality"]["budget"]]
    assert pf["prefill_budget"] == (min(passing) if passing else 0.0)
    m = onnx.load(str(tmp_path / "t.onnx"), load_external_data=False)
    for n in (n for n in m.graph.node if n.op_type == "PackedAttention"):
        a = {x.name: x for x in n.attribute}
        if 0 < pf["prefill_budget"] < 1:
            assert abs(a["prefill_budget"].f - pf["prefill_budget"]) < 1e-7 and a["prefill_block"].i == 16
            assert a["prefill_window"].i == 32 and a["prefill_min_context"].i == 128
            assert a["prefill_tail"].i == 64      # the last rows of a prompt call exact (the default)
        else:
            assert "prefill_budget" not in a or a["prefill_budget"].f == 0
    # a given budget that does not hold (its rows made 22 % worse here): exit 3, nothing written
    import rewriter.backends.packed_attention as pa

    real, calls = pa._prefill_nll_spans, []

    def worse(*a, **k):
        calls.append(1)
        nll = real(*a, **k)
        return nll if len(calls) == 1 else nll + 0.2      # the first call is the exact reference

    monkeypatch.setattr(pa, "_prefill_nll_spans", worse)
    rc, rep = _rewrite(src, tmp_path / "g.onnx", *flags, "--attn-prefill-budget", "0.2", "--quality-budget", "0.05")
    assert rc == 3 and not (tmp_path / "g.onnx").exists() and len(calls) == 2, (rc, calls, rep and [r.get("prefill_tune") for r in rep["graph_passes"]])
    monkeypatch.undo()
    # unmeasured with --quality-budget off
    rc, rep = _rewrite(src, tmp_path / "o.onnx", *flags, "--attn-prefill-budget", "0.2", "--quality-budget", "off")
    assert rc == 0
    m = onnx.load(str(tmp_path / "o.onnx"), load_external_data=False)
    pas = [n for n in m.graph.node if n.op_type == "PackedAttention"]
    assert pas and all(abs({x.name: x for x in n.attribute}["prefill_budget"].f - 0.2) < 1e-7 for n in pas)
    _check_prompt_continues(tmp_path / "o.onnx", m, pas)


def _check_prompt_continues(path, m, pas):
    """Runs inside custom_ops.prompt_continues() take no exact tail: the shared-KV and growing drivers
    set it on every chunk of a prompt but the last — the same logits as setting it by hand, other
    logits than never setting it (the chunks' tails changed the prompt's state)."""
    from custom_ops import runtime
    from custom_ops.runtime.generate import Decoder

    sess = custom_ops.session(str(path), threads=2)
    io = runtime.ModelIO.from_session(sess, str(path))
    ids = np.random.default_rng(0).integers(4, 256, 400)[None, :]   # the tiny vocabulary

    def by_hand(more):
        past, plen = None, 0
        for c0 in range(0, 400, 128):
            part = ids[:, c0:c0 + 128]
            with custom_ops.prompt_continues(more(c0)):
                out = runtime.run(sess, io, runtime.feeds(io, part, past, plen))
            past, plen = io.next_state(out), plen + part.shape[1]
        return out[io.logits_name][0, -1]

    want = by_hand(lambda c0: c0 + 128 < 400)
    never = by_hand(lambda c0: False)
    assert not np.allclose(want, never, atol=1e-5)
    kv = runtime.SharedKV(sess, io, max_len=400)
    np.testing.assert_allclose(kv.prefill(ids, chunk=128)[0, -1], want, atol=1e-4, rtol=1e-4)
    for shared in (True, False):
        dec = Decoder(sess, io, max_len=401, model_path=str(path), shared=shared)
        for c0 in range(0, 400, 128):
            got = dec.feed(ids[0, c0:c0 + 128], more=c0 + 128 < 400)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    with custom_ops.prompt_continues():        # nested blocks restore the outer value
        with custom_ops.prompt_continues(False):
            assert not custom_ops.continuing()
        assert custom_ops.continuing()
    assert not custom_ops.continuing()

def test_needle_gate_steps_back_to_a_budget_that_keeps_every_needle(forms, tmp_path, monkeypatch):
    """--attn-needles (default auto): the decode budget the tuner picks is run on needle cases; one that
    loses a needle the exact model finds is replaced by the next larger passing budget that keeps them
    all (here a fake gate loses them below budget 0.5), and the report lists the checks."""
    import rewriter.backends.packed_attention as pa

    seen = []

    class FakeGate:
        def lost(self, model):
            b = next(a.value for n in model.graph if n.op_type == "PackedAttention" for k, a in n.attributes.items()
                     if k == "budget")
            seen.append(b)
            return ["passkey/300/0.5"] if b < 0.5 else []

        def record(self, setting, lost):
            return {"setting": setting, "lost": lost}

    monkeypatch.setattr(pa, "needle_gate", lambda *a, **k: (FakeGate(), None))
    # the smaller the budget, the faster (so the tuner picks the smallest passing one)
    monkeypatch.setattr(pa.timing, "attention_crossover",
                        lambda *a, **k: {"budget": next(x for x in a if isinstance(x, dict))["budget"], "crossover": 64,
                                         "pasts": {}})
    monkeypatch.setattr(pa.timing, "speedup_at", lambda x, C: 1.0 / x["budget"])
    src = forms["genai-fp32"] / "model.onnx"
    calib = _calib_text(tmp_path / "calib.txt")
    rc, rep = _rewrite(src, tmp_path / "t.onnx", "--state-pack", "binary", "--calib-text", str(calib),
                       "--attn-tune-context", "300", "--attn-tune-score", "32", "--quality-budget", "0.5",
                       "--attn-prefill-budget", "0")
    assert rc == 0, rep
    t = next(r for r in rep["graph_passes"] if "tune" in r)["tune"]
    checks = t["needles"]
    assert checks and all(c["lost"] for c in checks[:-1]) and not checks[-1]["lost"]
    assert t["budget"] >= 0.5 and min(seen) < 0.5          # a smaller budget was checked and refused
    # a text that cannot hold needles: the tuner says so and goes on without the gate
    monkeypatch.setattr(pa, "needle_gate", lambda *a, **k: (None, "needle cases not made: no sentence ends"))
    rc, rep = _rewrite(src, tmp_path / "u.onnx", "--state-pack", "binary", "--calib-text", str(calib),
                       "--attn-tune-context", "300", "--attn-tune-score", "32", "--quality-budget", "0.5",
                       "--attn-prefill-budget", "0")
    assert rc == 0
    t = next(r for r in rep["graph_passes"] if "tune" in r)["tune"]
    assert "needles" not in t or isinstance(t["needles"], str)
