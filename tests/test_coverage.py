"""``pasa coverage`` and ``pipelines.coverage``: the share of the dense attention mass a block mask keeps, per
self-attention layer and head of a video transformer.

Exact cases first (a full mask keeps exactly 1 of every row, an empty one exactly 0, a hand-computed row), then
the recording on the tiny video transformers built from configs (every family whose self-attention takes the
video's tokens: the recorded coverage equals a float64 softmax computed here from the very q and k the layer
attends with), the generation run, the command end to end, and its refusals after the model is loaded (those
made before are ``tests/test_errors.py``'s probes).
"""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

from pasa_diffusers.block_sparse import BlockSparseMask
from pasa_diffusers.mask_coverage import coverage, head_density, row_coverage
from pasa_diffusers.pipelines.coverage import (CoverageLayoutError, coverage_recording, coverage_run,
                                               default_block, summarize_coverage)
from pasa_diffusers.pipelines.video_dits import TEXT_TOKENS, example_inputs, tiny_transformer
from pasa_diffusers.video_masks import MaskChoice, VideoTokens, tile_order


# --- exact cases -----------------------------------------------------------------------------------------------
def test_a_full_mask_keeps_exactly_one_and_an_empty_mask_exactly_zero():
    gen = torch.Generator().manual_seed(0)
    q, k = (3.0 * torch.randn(2, 4, 70, 16, generator=gen) for _ in range(2))
    full = BlockSparseMask.full(70, 70, block_q=16, block_k=16)
    empty = BlockSparseMask.from_dense(torch.zeros(5, 5, dtype=torch.bool), 70, 70, block_q=16, block_k=16)
    per_row, rows = row_coverage(q, k, full, sample_rows=None)
    assert rows.tolist() == list(range(70))
    assert torch.equal(per_row, torch.ones_like(per_row))
    assert torch.equal(row_coverage(q, k, empty, sample_rows=30)[0], torch.zeros(2, 4, 30, dtype=torch.float64))


def test_a_hand_computed_row():
    """One query of value 1 against keys log 1, log 2, log 3, log 4 (D = 1, scale 1): weights 1, 2, 3, 4; a mask
    keeping the first block of two keeps 3/10 of the mass, the second 7/10, per head of a GQA pair."""
    q = torch.ones(1, 2, 1, 1, dtype=torch.float64)
    k = torch.log(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)).view(1, 1, 4, 1)
    first = torch.tensor([[[True, False]], [[False, True]]])  # head 0 keeps block 0, head 1 block 1
    mask = BlockSparseMask.from_dense(first, 1, 4, block_q=2, block_k=2)
    got = coverage(q, k, mask, scale=1.0)
    assert got[0, 0].item() == pytest.approx(0.3, abs=1e-15) and got[0, 1].item() == pytest.approx(0.7, abs=1e-15)
    assert head_density(mask, 1, 2).tolist() == [[0.5, 0.5]]


def test_head_density_weighs_ragged_blocks_as_the_element_mask():
    gen = torch.Generator().manual_seed(1)
    blocks = torch.rand(2, 3, 4, 3, generator=gen) < 0.5
    mask = BlockSparseMask.from_dense(blocks, 50, 37, block_q=16, block_k=16)
    elements = mask.element_mask().double().mean((-1, -2))
    assert torch.allclose(head_density(mask, 2, 3), elements, rtol=0, atol=1e-15)


@pytest.mark.parametrize("n, block", [(48, 4), (192, 16), (1024, 128), (75600, 128), (9, 1), (2, 1)])
def test_default_block(n, block):
    assert default_block(n) == block


# --- recording on the tiny transformers ------------------------------------------------------------------------
GRID = (3, 4, 4)
"""The video tokens of ``example_inputs``: 3 latent frames of 8 x 8 over patch 2 (LTX-Video: 4 x 4, patch 1)."""
JOINT = {"cogvideox": "first", "hunyuan-video": "last", "mochi": "last"}


def _tokens(family: str) -> VideoTokens:
    return VideoTokens(*GRID, text=TEXT_TOKENS if family in JOINT else 0, text_at=JOINT.get(family, "first"))


def _inputs(family: str, model: torch.nn.Module) -> dict:
    """One forward's inputs, every text token kept (a padding mask is refused: below)."""
    inputs = example_inputs(family, model, torch.Generator().manual_seed(0), batch=2)
    if "encoder_attention_mask" in inputs:
        inputs["encoder_attention_mask"] = torch.ones_like(inputs["encoder_attention_mask"])
    return inputs


MOCHI_AUTOCAST = "ignore:In CPU autocast, but the target dtype is not supported:UserWarning"
"""Mochi's rotary table is made under autocast(float32), which CPU autocast refuses (as ``video.generate`` says)."""


@pytest.mark.filterwarnings(MOCHI_AUTOCAST)
@pytest.mark.parametrize("family", ["wan", "ltx-video", "cogvideox", "hunyuan-video", "mochi"])
def test_recorded_coverage_is_the_dense_softmax_of_the_layers_q_and_k(family):
    model = tiny_transformer(family)
    tokens = _tokens(family)
    order = tile_order(tokens, block=8)
    n = tokens.n_tokens
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    diagonal = BlockSparseMask.from_dense(torch.eye(math.ceil(n / 8), dtype=torch.bool), n, n, block_q=8, block_k=8)

    def capture(q: torch.Tensor, k: torch.Tensor) -> BlockSparseMask:
        seen.append((q.clone(), k.clone()))
        return diagonal

    empty = BlockSparseMask.from_dense(torch.zeros_like(diagonal.dense_blocks()), n, n, block_q=8, block_k=8)
    masks = {"full": lambda q, k: BlockSparseMask.full(n, n, block_q=8, block_k=8), "empty": lambda q, k: empty,
             "diagonal": capture}
    with torch.no_grad(), coverage_recording(model, tokens, masks, sample_rows=n, order=order) as recorders:
        model(**_inputs(family, model))
    calls = [(recorder, i) for recorder in recorders for i in range(recorder.calls)]  # Mochi: one per batch element
    assert recorders and all(r.calls for r in recorders) and len(seen) == len(calls)
    for (recorder, i), (q, k) in zip(calls, seen):
        shape = (q.shape[0], q.shape[1], n)
        assert torch.equal(recorder.rows["full"][i], torch.ones(shape, dtype=torch.float64))
        assert torch.equal(recorder.rows["empty"][i], torch.zeros(shape, dtype=torch.float64))
        p = torch.softmax(q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        expected = (p * diagonal.element_mask()[0, 0]).sum(-1)
        assert torch.allclose(recorder.rows["diagonal"][i], expected, rtol=0, atol=1e-12)
    table = summarize_coverage(recorders)
    assert len(table) == 3 * len(recorders) * seen[0][0].shape[1]
    assert all(r["mean"] == r["min"] == 1.0 and r["density"] == 1.0 for r in table if r["mask"] == "full")
    assert all(r["mean"] == 0.0 and r["density"] == 0.0 for r in table if r["mask"] == "empty")


@pytest.mark.parametrize("family, message", [
    ("hunyuan-video", "passes an attention mask that drops keys"),
    ("mochi", f"attends {48 + TEXT_TOKENS - 2} queries to {48 + TEXT_TOKENS - 2} keys, not the self-attention of "
              f"the video's 3x4x4 tokens and {TEXT_TOKENS} text tokens ({48 + TEXT_TOKENS} to {48 + TEXT_TOKENS})"),
], ids=["key-mask", "length"])
@pytest.mark.filterwarnings(MOCHI_AUTOCAST)
def test_a_call_that_is_not_the_videos_self_attention_is_refused(family, message):
    """Padded prompts: HunyuanVideo masks the padding keys, Mochi drops them from the sequence; either way the
    call's dense mass is not the one of the grid's tokens.  The processors are restored after the error."""
    model = tiny_transformer(family)
    before = dict(model.attn_processors) if hasattr(model, "attn_processors") else None
    inputs = example_inputs(family, model, torch.Generator().manual_seed(0), batch=2)
    n = _tokens(family).n_tokens
    masks = {"full": lambda q, k: BlockSparseMask.full(n, n, block_q=8, block_k=8)}
    with pytest.raises(CoverageLayoutError, match=re.escape(message)):
        with torch.no_grad(), coverage_recording(model, _tokens(family), masks, sample_rows=8):
            model(**inputs)
    if before is not None:
        assert dict(model.attn_processors) == before


def test_a_model_without_video_self_attention_is_refused():
    from pasa_diffusers.pipelines.svd import load_svd

    unet = load_svd("tiny").unet
    with pytest.raises(ValueError, match="coverage_recording: UNetSpatioTemporalConditionModel has no self-attention "
                                         "module of a video transformer's blocks"):
        with coverage_recording(unet, VideoTokens(1, 2, 2), {}, sample_rows=1):
            pass


# --- one generation --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_wan():
    from pasa_diffusers.pipelines.video import load_video

    return load_video("tiny-wan")


SMALL = {"num_frames": 5, "num_inference_steps": 1, "seed": 0, "height": 64, "width": 64}
"""2 latent frames of 4 x 4 tokens: 32 tokens, blocks of 4 by default."""


def test_a_window_that_reaches_everything_keeps_everything(tiny_wan):
    before = dict(tiny_wan.transformer.attn_processors)
    result = coverage_run(tiny_wan, [MaskChoice("tile-window", window=(9, 9, 9))], progress=False, **SMALL)
    assert result["tokens"]["total"] == 32 and result["settings"]["block"] == 4
    assert result["layers"] == ["blocks.0.attn1", "blocks.1.attn1"] and result["heads"] == 2
    assert [(r["mean"], r["median"], r["min"], r["density"]) for r in result["table"]] == [(1.0, 1.0, 1.0, 1.0)] * 4
    assert all(r["calls"] == 2 and r["rows"] == 2 * 32 for r in result["table"])  # the guided and unguided calls
    assert dict(tiny_wan.transformer.attn_processors) == before


def test_every_mask_on_a_generation(tiny_wan):
    masks = [MaskChoice("tile-window", window=(0, 1, 1)), MaskChoice("radial", spatial_window=2),
             MaskChoice("pooled", keep=0.5)]
    result = coverage_run(tiny_wan, masks, sample_rows=10, order="model", progress=False, **SMALL)
    assert [m["name"] for m in result["masks"]] == ["tile-window", "radial", "pooled"]
    assert len(result["table"]) == 3 * 2 * 2
    for r in result["table"]:
        assert 0.0 < r["density"] < 1.0 and 0.0 <= r["min"] <= r["median"] <= 1.0 and r["min"] <= r["mean"] <= 1.0
        assert r["rows"] == 2 * 10


@pytest.mark.parametrize("kwargs, message", [
    ({"block": 32}, "coverage_run: block must be an int in [1, 31]"),
    ({"sample_rows": 33}, "coverage_run: sample_rows must be an int in [1, 32]"),
    ({"order": "zigzag"}, "coverage_run: order must be one of ('tile', 'model')"),
    ({"masks": [MaskChoice("radial"), MaskChoice("radial")]}, "coverage_run: masks must be one or more of distinct"),
])
def test_coverage_run_refuses_naming_the_argument(tiny_wan, kwargs, message):
    masks = kwargs.pop("masks", [MaskChoice("radial")])
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        coverage_run(tiny_wan, masks, progress=False, **SMALL, **kwargs)


def test_mask_choice_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="MaskChoice: unknown kind='window'; expected one of tile-window, radial, "
                                         "pooled"):
        MaskChoice("window")


# --- the command -----------------------------------------------------------------------------------------------
def test_the_command_writes_the_report(tmp_path, capsys):
    from pasa_diffusers.cli import main

    out = tmp_path / "coverage"
    assert main(["coverage", "--frames", "5", "--steps", "1", "--rows", "16", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("tiny-wan: mask coverage of 2 self-attention layers x 2 heads (5 frames, 1 steps, 64x64: "
                        "2x4x4 video tokens; 16 of 32 query rows sampled per call, blocks of 4, tile order; cpu "
                        "float32)")
    assert [line.split(":")[0] for line in lines if not line.startswith(" ")][1:] == [
        "tile-window (window 1,3,3)", "radial (spatial window 4, 1 sink frame(s))",
        "pooled (keep 0.9 of the estimated mass)", "wrote json", "wrote markdown", "wrote plot tile-window",
        "wrote plot radial", "wrote plot pooled"]
    assert sum(line.startswith("  worst: blocks.") for line in lines) == 9
    result = json.loads((out / "coverage.json").read_text())
    assert len(result["table"]) == 12 and result["settings"]["sample_rows"] == 16
    markdown = (out / "coverage.md").read_text()
    assert markdown.count("\n| ") == 2 + 12
    for mask in ("tile-window", "radial", "pooled"):
        assert (out / f"coverage_{mask}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--rows", "33"], "--rows 33: more than the 32 queries of a self-attention call of this video (2x4x4 video "
                       "tokens); at most 32"),
    (["--block", "32"], "--block 32: the 32 tokens of a self-attention call of this video (2x4x4 video tokens) make "
                        "one block, which every mask keeps; choose a --block below 32"),
    (["--model", "tiny-cogvideox", "--frames", "9", "--rows", "100"],
     "--rows 100: more than the 55 queries of a self-attention call of this video (3x4x4 video tokens + 7 text "
     "tokens); at most 55"),
    (["--frames", "4"], "--frames 4: WanPipeline takes 4k + 1 frames (its VAE compresses time 4x), got 4"),
], ids=["rows", "block", "rows-joint", "frames"])
def test_refusals_once_the_model_is_loaded(argv, message, tmp_path, capsys):
    from pasa_diffusers.cli import main

    argv = ["--frames", "5", *argv] if "--frames" not in argv else argv
    assert main(["coverage", *argv, "--out", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"pasa coverage: error: {message}\n"
