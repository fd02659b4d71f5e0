"""Overflow diagnosis: call_stats against brute force, the resonance index, tiny-resonant, reports, compare.

Runs on the CPU with the tiny pipelines (32 x 32, 2 frames, 2 steps).  Brute force is the full N x N
product in float64; call_stats works in float32, so maxima agree to ``F32_RTOL`` and an overflow count
may differ only by scores within ``BAND`` of 65504.  Random inputs are fresh draws from the ``gen``
fixture (its seed is printed; replay with ``PASA_TEST_SEED``).
"""
from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest
import torch

from pasa_diffusers import install as I
from pasa_diffusers import processors as P
from pasa_diffusers.shift_matrix import DEFAULT_BETA
from pasa_diffusers.diagnose import (LayerRecorder, call_stats, ranked, recording, risk_table, short_path,
                                     write_diagnosis)
from pasa_diffusers.pipelines.compare import run_comparison
from pasa_diffusers.pipelines.diagnose import DiagnosticAttnProcessor, diagnose
from pasa_diffusers.pipelines.resonant import (PLANTED_LAYERS, bias_amplitude, build_tiny_resonant, phase_pattern)
from pasa_diffusers.pipelines.svd import generate, load_image, load_svd
from pasa_diffusers.rules import FP16_MAX, SHIFT_BLOCK


SETTINGS = {"num_frames": 2, "num_inference_steps": 2, "seed": 0, "height": 32, "width": 32}
F32_RTOL = 1e-5
"""float32 against float64 on products of D <= 64 terms: a few float32 ulps (2**-24 = 6e-8) per term."""
BAND = 1.0
"""Absolute float32 rounding allowed on a score near 65504 (ulp of float32 there: 0.0039, times D)."""
BETA = DEFAULT_BETA


def _biased(gen: torch.Generator, shape: tuple[int, ...], mean: torch.Tensor, amp: float) -> torch.Tensor:
    return mean + amp * torch.randn(shape, generator=gen)


def _brute(q: torch.Tensor, k: torch.Tensor, scale: float, block_n: int) -> dict:
    """Full N x N products in float64 and per-(batch, head) token statistics, head by head."""
    q64 = q.double()
    k64 = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q64 @ k64.transpose(-1, -2)
    blocks = [k64[:, :, j:j + block_n] for j in range(0, k64.shape[2], block_n)]
    shifted = torch.cat([q64 @ (scale * (kb - BETA * kb.mean(2, keepdim=True))).transpose(-1, -2) for kb in blocks], -1)
    out = {name: torch.zeros(q.shape[:2], dtype=torch.float64) for name in
           ("bias_q", "bias_k", "amplitude_q", "amplitude_k", "resonance_cos", "sign_agreement")}
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            means = {}
            for side, x in (("q", q64[b, h]), ("k", k64[b, h])):
                mean = x.mean(0)
                rms = ((x - mean) ** 2).mean().sqrt()
                out[f"amplitude_{side}"][b, h] = rms
                out[f"bias_{side}"][b, h] = mean.norm() / (rms * math.sqrt(x.shape[1]))
                means[side] = mean
            out["resonance_cos"][b, h] = means["q"] @ means["k"] / (means["q"].norm() * means["k"].norm())
            out["sign_agreement"][b, h] = ((means["q"] > 0) == (means["k"] > 0)).double().mean()
    return {"s": s, "shifted": shifted, **{name: v.mean(0) for name, v in out.items()}}


@pytest.mark.parametrize("b, hq, hk, nq, nk, d, block_n, max_elements", [
    (2, 2, 2, 33, 47, 16, 16, 2 ** 26),      # ragged last key block, one chunk
    (3, 4, 2, 40, 37, 32, 16, 100),          # GQA; fewer elements than one query row: one row per chunk
    (2, 3, 1, 65, 130, 16, SHIFT_BLOCK, 3 * 130 * 7),  # MQA; 7-row chunks (65 = 9 * 7 + 2); a 2-key last block
    (5, 2, 2, 8, 8, 16, SHIFT_BLOCK, 2 * 8 * 8 * 2),   # chunks of 2 batches (5 = 2 + 2 + 1)
])
def test_call_stats_matches_brute_force(gen, b, hq, hk, nq, nk, d, block_n, max_elements):
    base = torch.randn(hk, 1, d, generator=gen)
    base = base / base.norm(dim=-1, keepdim=True) * math.sqrt(FP16_MAX)  # |mean q . mean k| = 65504
    q = _biased(gen, (b, hq, nq, d), base.repeat_interleave(hq // hk, dim=0), 20.0)
    k = _biased(gen, (b, hk, nk, d), base, 20.0)
    scale = d ** -0.5
    got = call_stats(q, k, scale, beta=BETA, block_n=block_n, max_elements=max_elements)
    ref = _brute(q, k, scale, block_n)
    max_qk = ref["s"].abs().max().item()
    assert got["max_abs_qk"] == pytest.approx(max_qk, rel=F32_RTOL)
    assert got["max_abs_score"] == pytest.approx(max_qk * scale, rel=F32_RTOL)
    assert got["max_abs_shifted"] == pytest.approx(ref["shifted"].abs().max().item(), abs=F32_RTOL * max_qk * scale)
    above, near = (ref["s"].abs() > FP16_MAX + BAND).sum().item(), (ref["s"].abs() > FP16_MAX - BAND).sum().item()
    assert 0 < above <= got["overflow_count"] <= near < ref["s"].numel()
    for name in ("bias_q", "bias_k", "amplitude_q", "amplitude_k", "resonance_cos"):
        torch.testing.assert_close(torch.tensor(got[name], dtype=torch.float64), ref[name], rtol=1e-4, atol=1e-6)
    # a float32 mean of booleans: one flipped sign moves it by at least 1 / (B D)
    assert got["sign_agreement"] == pytest.approx(ref["sign_agreement"].tolist(), abs=1e-6)


@pytest.mark.parametrize("pattern", ["in-phase", "anti-phase", "random"])
def test_resonance_index_separates_constructions(gen, pattern):
    b, h, n, d = 2, 8, 96, 64
    mean_q = torch.randn(h, 1, d, generator=gen)
    mean_q = 200 * mean_q / mean_q.norm(dim=-1, keepdim=True)
    mean_k = {"in-phase": mean_q, "anti-phase": -mean_q,
              "random": 200 * torch.nn.functional.normalize(torch.randn(h, 1, d, generator=gen), dim=-1)}[pattern]
    stats = call_stats(_biased(gen, (b, h, n, d), mean_q, 1.0), _biased(gen, (b, h, n, d), mean_k, 1.0), d ** -0.5)
    cos, agree = np.array(stats["resonance_cos"]), np.array(stats["sign_agreement"])
    assert min(stats["bias_q"] + stats["bias_k"]) > 10  # |mean| 200 over a centred norm of sqrt(64)
    if pattern == "in-phase":
        assert cos.min() > 0.9 and agree.min() > 0.9
    elif pattern == "anti-phase":
        assert cos.max() < -0.9 and agree.max() < 0.1
    else:  # independent directions in 64 dims: cos ~ N(0, 1/64), agreement ~ 0.5 +- 0.06 per head
        assert np.abs(cos).max() < 0.6 and np.abs(cos).mean() < 0.3
        assert abs(agree.mean() - 0.5) < 0.15


def test_phase_pattern_and_amplitude():
    c = phase_pattern(3, 16)
    torch.testing.assert_close(c.pow(2).sum(-1), torch.full((3,), 8.0, dtype=torch.float64))
    assert c.abs().min() > 0.15  # half a grid step off every zero of the cosine
    assert bias_amplitude(16, 2.0) ** 2 * 8 == pytest.approx(2 * FP16_MAX)
    with pytest.raises(ValueError, match="multiple of 4"):
        phase_pattern(2, 18)


def test_load_tiny_resonant_plants_only_listed_layers():
    pipe = load_svd("tiny-resonant")
    plain = load_svd("tiny")
    assert pipe.name_or_path == "tiny-resonant"
    modules, plain_modules = dict(pipe.unet.named_modules()), dict(plain.unet.named_modules())
    for key in pipe.unet.attn_processors:
        path = key.removesuffix(".processor")
        attn, ref = modules[path], plain_modules[path]
        assert (attn.to_q.bias is not None) == (path in PLANTED_LAYERS)
        assert (attn.to_k.bias is not None) == (path in PLANTED_LAYERS)
        torch.testing.assert_close(attn.to_q.weight, ref.to_q.weight, rtol=0, atol=0)
    with pytest.raises(ValueError, match="variant"):
        load_svd("tiny-resonant", variant="fp16")


@pytest.fixture(scope="module")
def resonant_run():
    """One diagnosis of tiny-resonant, the processors installed before it, and the pipeline."""
    pipe = load_svd("tiny-resonant")
    I.apply(pipe, "sdpa")
    before = dict(pipe.unet.attn_processors)
    image = load_image("builtin:rocket", (SETTINGS["width"], SETTINGS["height"]))
    result = diagnose(pipe, image, progress=False, max_elements=2 ** 12, **SETTINGS)  # many chunks per call
    return result, before, pipe, image


def test_diagnosis_flags_exactly_the_planted_layers(resonant_run):
    result, _, pipe, _ = resonant_run
    layers = {layer["path"]: layer for layer in result["layers"]}
    assert set(layers) == {key.removesuffix(".processor") for key in pipe.unet.attn_processors}
    assert {p for p, layer in layers.items() if layer["overflows"]} == set(PLANTED_LAYERS)
    assert {layer["path"] for layer in ranked(result)[:len(PLANTED_LAYERS)]} == set(PLANTED_LAYERS)
    for path, layer in layers.items():
        assert layer["calls"] == SETTINGS["num_inference_steps"]  # CFG batches both halves into one call
        assert layer["risk"] == pytest.approx(layer["max_abs_qk"] / FP16_MAX)
        assert None not in layer["per_step_max_abs_qk"]
        if path in PLANTED_LAYERS:
            assert layer["overflow_count"] > 0 and layer["risk"] > 1.5
            assert layer["max_abs_shifted"] < FP16_MAX / 16  # PASA's shift removes 15/16 of the bias
            assert "in-phase resonance" in layer["cause"]
            assert min(layer["resonance_cos"]) > 0.9 and min(layer["sign_agreement"]) > 0.9
        else:
            assert layer["overflow_count"] == 0 and layer["risk"] < 0.01
    assert layers[PLANTED_LAYERS[0]]["level"] == 256 and layers[PLANTED_LAYERS[1]]["level"] == 64
    assert layers[PLANTED_LAYERS[2]]["level"] == 256 and layers[PLANTED_LAYERS[2]]["kind"] == "temporal-self"


def test_diagnosis_keeps_generation_and_restores(resonant_run):
    result, before, pipe, _ = resonant_run
    after = pipe.unet.attn_processors
    assert all(after[key] is proc for key, proc in before.items())
    assert result["frames"] == {"finite": True, "match_plain": True}
    assert result["settings"]["max_elements"] == 2 ** 12
    over = result["overhead"]
    assert over["seconds_with"] > 0 and over["seconds_without"] > 0
    assert over["ratio"] == pytest.approx(over["seconds_with"] / over["seconds_without"])


class _Capture(P.SDPAAttnProcessor):
    """The stock attention, keeping float64 copies of every call's (B, H, N, D) q and k."""

    def __init__(self) -> None:
        super().__init__()
        self.calls_qk: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attention(self, query, key, value, scale, attention_mask=None):
        self.calls_qk.append((query.transpose(1, 2).double(), key.transpose(1, 2).double()))
        return super().attention(query, key, value, scale, attention_mask)


def test_diagnosis_matches_brute_force_per_step(resonant_run):
    result, before, pipe, image = resonant_run
    capture = {key: _Capture() for key in before}
    pipe.unet.set_attn_processor(dict(capture))
    try:
        generate(pipe, image, progress=False, **SETTINGS)
    finally:
        pipe.unet.set_attn_processor(dict(before))
    layers = {layer["path"]: layer for layer in result["layers"]}
    for key, proc in capture.items():
        layer = layers[key.removesuffix(".processor")]
        total_above = total_near = 0
        for step, (q, k) in enumerate(proc.calls_qk):  # one call per step
            s = (q @ k.transpose(-1, -2)).abs()
            assert layer["per_step_max_abs_qk"][step] == pytest.approx(s.max().item(), rel=F32_RTOL)
            total_above += (s > FP16_MAX + BAND).sum().item()
            total_near += (s > FP16_MAX - BAND).sum().item()
        assert total_above <= layer["overflow_count"] <= total_near


@pytest.mark.parametrize("pattern", ["anti-phase", "random"])
def test_planted_patterns_resonance_index(gen, pattern):
    pipe = build_tiny_resonant(load_svd("tiny"), pattern=pattern, generator=gen)
    image = load_image("builtin:rocket", (SETTINGS["width"], SETTINGS["height"]))
    result = diagnose(pipe, image, progress=False, measure_overhead=False, **SETTINGS)
    assert result["overhead"]["seconds_without"] is None
    for layer in result["layers"]:
        if layer["path"] not in PLANTED_LAYERS:
            assert not layer["overflows"]
            continue
        cos, agree = np.array(layer["resonance_cos"]), np.array(layer["sign_agreement"])
        assert min(layer["bias_q"] + layer["bias_k"]) > 10
        if pattern == "anti-phase":
            assert layer["overflows"] and "anti-phase resonance" in layer["cause"]
            assert cos.max() < -0.9 and agree.max() < 0.1
        else:  # the key bias is orthogonal to the query bias: large bias, no resonance, no overflow
            assert not layer["overflows"] and "without resonance" in layer["cause"]
            assert np.abs(cos).max() < 0.2 and 0.1 < agree.mean() < 0.9


def test_diagnose_restores_processors_on_error():
    pipe = load_svd("tiny")
    I.apply(pipe, "fp32")
    before = dict(pipe.unet.attn_processors)
    image = load_image("builtin:rocket", (32, 32))
    with pytest.raises(ValueError, match="multiples of"):
        diagnose(pipe, image, progress=False, **{**SETTINGS, "height": 30})
    after = pipe.unet.attn_processors
    assert all(after[key] is proc for key, proc in before.items())
    assert not any(isinstance(p, DiagnosticAttnProcessor) for p in after.values())


class _Raising(P.SDPAAttnProcessor):
    """A processor built around a recorder that fails on its first call."""

    def __init__(self, recorder: LayerRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def attention(self, query, key, value, scale, attention_mask=None):
        self.recorder.record(query, key, scale)
        raise RuntimeError("planted failure")


def test_recording_installs_the_callers_processor_per_layer_and_restores():
    pipe = load_svd("tiny")
    before = dict(pipe.unet.attn_processors)
    with recording(pipe.unet, _Raising) as recorders:
        installed = pipe.unet.attn_processors
        assert [r.name for r in recorders] == [key.removesuffix(".processor") for key in before]
        assert [installed[key].recorder for key in before] == recorders
        assert len({id(r.clock) for r in recorders}) == 1
        with pytest.raises(RuntimeError, match="planted failure"):
            generate(pipe, load_image("builtin:rocket", (32, 32)), progress=False, **SETTINGS)
    after = pipe.unet.attn_processors
    assert all(after[key] is proc for key, proc in before.items())
    called = [r for r in recorders if r.records]
    assert len(called) == 1 and called[0].records[0]["order"] == 0 and called[0].records[0]["step"] == 0


def test_reports(resonant_run, tmp_path):
    result, _, _, _ = resonant_run
    paths = write_diagnosis(result, tmp_path / "diag")

    def strict(name):
        raise ValueError(f"non-standard JSON constant {name}")

    loaded = json.loads(paths["json"].read_text(), parse_constant=strict)
    assert [layer["path"] for layer in loaded["layers"]] == [layer["path"] for layer in result["layers"]]
    assert loaded["fp16_max"] == FP16_MAX and loaded["layers"][0]["overflows"] == result["layers"][0]["overflows"]
    for key in ("heatmap", "bias_resonance"):
        data = paths[key].read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(data) < 400_000
    broken = {**result, "layers": [{**result["layers"][0], "max_abs_qk": float("nan"),
                                    "max_abs_score": -float("inf"), "max_abs_shifted": float("inf")}]
              + result["layers"][1:]}
    loaded = json.loads(write_diagnosis(broken, tmp_path / "nan")["json"].read_text(), parse_constant=strict)
    assert loaded["layers"][0]["max_abs_qk"] is None
    assert (loaded["layers"][0]["max_abs_score"], loaded["layers"][0]["max_abs_shifted"]) == ("-inf", "inf")
    top = ranked(result)[0]
    for use_rich in (False, True) if importlib.util.find_spec("rich") else (False,):
        table = risk_table(result, use_rich=use_rich)
        rows = [line for line in table.splitlines() if any(layer["short"] in line for layer in result["layers"])]
        assert len(rows) >= len(result["layers"])
        assert top["short"] in rows[0] and "in-phase resonance" in rows[0]
        assert "3 of 24 attention layers overflow" in table


def test_the_legend_says_the_overflows_column_holds_counts(resonant_run):
    from pasa_diffusers.diagnose.render import LEGEND

    result, _, _, _ = resonant_run
    table = risk_table(result, use_rich=False)
    assert LEGEND in table and "overflows = how many raw scores |q . k| exceed 65504, summed over all calls" in LEGEND
    hot = next(layer for layer in ranked(result) if layer["overflows"])
    row = next(line for line in table.splitlines() if f" {hot['short']} " in line)
    assert f"{hot['overflow_count']:,}" in row.split()  # the column holds the count, not a yes/no


@pytest.mark.parametrize("hot, steps, frames, text", [
    (1, 1, 2, "1 of 24 attention layers overflows FP16 (2 frames, 1 step, "),
    (3, 2, 2, "3 of 24 attention layers overflow FP16 (2 frames, 2 steps, "),
    (0, 3, 2, "0 of 24 attention layers overflow FP16 (2 frames, 3 steps, "),
])
def test_the_footer_counts_in_words(resonant_run, hot, steps, frames, text):
    result, _, _, _ = resonant_run
    layers = [{**layer, "overflows": i < hot} for i, layer in enumerate(result["layers"])]
    settings = {**result["settings"], "num_inference_steps": steps, "num_frames": frames}
    table = risk_table({**result, "layers": layers, "settings": settings}, use_rich=False)
    assert text in table


def test_short_path():
    assert short_path("down_blocks.0.attentions.1.temporal_transformer_blocks.0.attn1") == "down0.1.temporal.attn1"
    assert short_path("mid_block.attentions.0.transformer_blocks.0.attn2") == "mid.0.spatial.attn2"
    assert short_path("up_blocks.3.attentions.2.transformer_blocks.1.attn1") == "up3.2.spatial1.attn1"


def test_compare_tiny_resonant_naive_half_overflows_pasa_does_not():
    report, videos = run_comparison(model="tiny-resonant", backends=["pasa", "naive-half"], progress=False,
                                    **{k: v for k, v in SETTINGS.items() if k != "seed"})
    assert report["backends"]["naive-half"]["scores"]["nonfinite"]["count"] > 0
    assert report["backends"]["pasa"]["scores"]["nonfinite"]["count"] == 0
    assert np.isfinite(videos["pasa"]).all() and np.isfinite(videos["fp32"]).all()
