"""The built-in video-transformer pipelines (``pipelines/video.py``: ``tiny-wan``) and the commands on them:
built offline, generated through the console script, diagnosed (attention layers and activations), and a
planted overflow found where it was planted and nowhere else.  Small sizes: 5 frames of 32 x 32 (2 latent
frames of 4 x 4, 8 video tokens)."""
import argparse
import importlib.util
import json
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

from pasa_diffusers.cli import common, main
from pasa_diffusers.pipelines import video
from pasa_diffusers.pipelines.diagnose import diagnose
from pasa_diffusers.pipelines.names import TINY_VIDEO_SETTINGS
from pasa_diffusers.pipelines.svd import ModelLoadError

SMALL = {"num_frames": 5, "num_inference_steps": 2, "seed": 0, "height": 32, "width": 32}
FLAGS = ["--frames", "5", "--steps", "2", "--height", "32", "--width", "32"]
ROLES = {"attention output", "ffn hidden", "ffn output", "norm", "block output"}


@pytest.fixture(scope="module")
def wan() -> WanPipeline:
    return video.load_video("tiny-wan")


def test_tiny_wan_builds_offline_seeded_without_text_encoder(wan):
    assert type(wan.transformer) is WanTransformer3DModel and type(wan.vae) is AutoencoderKLWan
    assert wan.tokenizer is None and wan.text_encoder is None and wan.name_or_path == "tiny-wan"
    assert type(wan.scheduler) is UniPCMultistepScheduler and wan.scheduler.config.prediction_type == "flow_prediction"
    assert (wan.vae_scale_factor_temporal, wan.vae_scale_factor_spatial) == (4, 8)
    again = video.load_video("tiny-wan")
    for mine, theirs in zip(wan.transformer.state_dict().values(), again.transformer.state_dict().values()):
        assert torch.equal(mine, theirs)


def test_load_pipeline_tells_svd_from_video():
    assert type(video.load_pipeline("tiny-wan")).__name__ == "WanPipeline"
    assert type(video.load_pipeline("tiny")).__name__ == "StableVideoDiffusionPipeline"


def test_a_saved_tiny_wan_folder_loads_as_a_wan_pipeline(wan, tmp_path):
    wan.save_pretrained(tmp_path, safe_serialization=True)
    assert json.loads((tmp_path / "model_index.json").read_text())["_class_name"] == "WanPipeline"
    if importlib.util.find_spec("accelerate") is None:  # diffusers loads fp32-kept modules only through accelerate
        with pytest.raises(ModelLoadError, match=r"^load_video: cannot load model=.*needs the package accelerate"):
            video.load_pipeline(str(tmp_path))
        return
    loaded = video.load_pipeline(str(tmp_path))
    assert type(loaded) is WanPipeline and loaded.text_encoder is None
    for mine, theirs in zip(wan.transformer.state_dict().values(), loaded.transformer.state_dict().values()):
        assert torch.equal(mine, theirs)


def test_generate_returns_seeded_frames_in_range(wan):
    frames = video.generate(wan, progress=False, **SMALL)
    assert frames.shape == (5, 32, 32, 3) and frames.dtype == np.float32
    assert np.isfinite(frames).all() and frames.min() >= 0 and frames.max() <= 1 and frames.std() > 0
    assert np.array_equal(frames, video.generate(wan, progress=False, **SMALL))
    assert not np.array_equal(frames, video.generate(wan, progress=False, **{**SMALL, "seed": 1}))


@pytest.mark.parametrize("setting, value, why", [
    ("num_frames", 4, "WanPipeline takes 4k + 1 frames (its VAE compresses time 4x), got 4"),
    ("height", 40, "WanPipeline takes multiples of 16 (VAE 8x, patch 2), got 40"),
])
def test_a_setting_the_pipeline_would_round_is_refused(wan, setting, value, why):
    with pytest.raises(ValueError, match=rf"^generate: {setting}: {re.escape(why)}$"):
        video.generate(wan, progress=False, **{**SMALL, setting: value})


def _parse(argv: list[str]) -> argparse.Namespace:
    from pasa_diffusers.cli import build_parser

    return build_parser().parse_args(argv)


def test_unset_sizes_take_the_models_defaults(wan):
    args = _parse(["generate", "--model", "tiny-wan", "--steps", "3"])
    assert video.default_settings(wan) == TINY_VIDEO_SETTINGS
    assert common.generation_settings(args, wan) == {**TINY_VIDEO_SETTINGS, "num_inference_steps": 3, "seed": 0}
    svd = video.load_pipeline("tiny")
    assert common.generation_settings(_parse(["diagnose"]), svd) == {
        "num_frames": 2, "height": 64, "width": 64, "num_inference_steps": 2, "seed": 0}
    with pytest.raises(common.UsageError, match=r"^--width 72: WanPipeline takes multiples of 16"):
        common.generation_settings(_parse(["generate", "--model", "tiny-wan", "--width", "72"]), wan)


def test_commands_that_take_svd_only_refuse_a_video_model():
    args = argparse.Namespace(model="tiny-wan", command="compare", device="cpu", dtype=None, local_files_only=False)
    with pytest.raises(common.UsageError, match=r"^--model tiny-wan: a video-transformer pipeline; pasa compare "
                                                r"takes SVD pipelines only so far"):
        common.load_model(args)


def test_generate_through_the_console_script(tmp_path):
    done = subprocess.run([shutil.which("pasa"), "generate", "--model", "tiny-wan", "--attention", "pasa", *FLAGS,
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("text encoder replaced by fixed prompt embeddings: unit Gaussians of 512 tokens x 24")
    report = json.loads("\n".join(lines[1:lines.index("all frames finite")]))
    assert report["processors"]["video-self"] == report["processors"]["video-cross"] == \
        "PASAAttnProcessor via WanAttnProcessor"
    assert report["installed"]["video-self"] == report["installed"]["video-cross"] == 2
    assert report["calls"] == 4 * 2 * 2 and report["fallbacks"] == {}  # 4 layers x (cond + uncond) x 2 steps
    assert report["attention_dtype"] == "float16"
    assert (tmp_path / "pasa.mp4").stat().st_size > 0 and (tmp_path / "pasa.gif").stat().st_size > 0
    assert len(list((tmp_path / "pasa").glob("*.png"))) == 5


def test_diagnose_lists_every_attention_layer_and_the_activations(tmp_path, capsys):
    assert main(["diagnose", "--model", "tiny-wan", *FLAGS, "--steps", "1", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "diagnosis.json").read_text())
    paths = [f"blocks.{b}.attn{i}" for b in (0, 1) for i in (1, 2)]
    assert sorted(layer["path"] for layer in result["layers"]) == paths
    assert all(layer["calls"] == 2 for layer in result["layers"])  # one step: cond + uncond
    assert {layer["kind"] for layer in result["layers"]} == {"video-self", "video-cross"}
    for block in ("blocks.0", "blocks.1"):
        assert {site["role"] for site in result["activations"] if site["block"] == block} == ROLES
    assert all(path in printed for path in paths) and "blocks.1.ffn.net.0" in printed
    assert "text encoder replaced by fixed prompt embeddings" in printed and result["conditioning"] == video.NOTICE
    assert "0 of 4 attention layers overflow" in printed and "0 of 16 activations exceed 65504" in printed
    assert result["frames"] == {"finite": True, "match_plain": True}


def _planted() -> WanPipeline:
    """tiny-wan with two plants: block 0's self-attention q and k scaled by 300 (in its QK RMSNorm weights: the
    projections are normalised after, so scaling ``to_q``/``to_k`` would cancel), and block 1's feed-forward
    output projection scaled by 1e6."""
    pipe = video.load_video("tiny-wan")
    attn = pipe.transformer.blocks[0].attn1
    with torch.no_grad():
        attn.norm_q.weight.mul_(300.0)
        attn.norm_k.weight.mul_(300.0)
        pipe.transformer.blocks[1].ffn.net[2].weight.mul_(1e6)
    return pipe


def test_a_planted_overflow_is_found_in_that_layer_and_no_other():
    pipe = _planted()
    result = diagnose(pipe, None, progress=False, measure_overhead=False, **{**SMALL, "num_inference_steps": 1})
    hot = [layer for layer in result["layers"] if layer["overflows"]]
    assert [layer["path"] for layer in hot] == ["blocks.0.attn1"]
    assert hot[0]["max_abs_qk"] > 65504 and hot[0]["cause"].startswith("amplitude")
    assert max(layer["max_abs_qk"] for layer in result["layers"] if not layer["overflows"]) < 1000
    over = {(site["block"], site["role"]) for site in result["activations"] if site["overflows"]}
    assert over == {("blocks.1", "ffn output"), ("blocks.1", "block output")}
    assert all(site["max_abs"] < 1000 for site in result["activations"] if site["block"] == "blocks.0")
    assert type(pipe.transformer.blocks[0].attn1.processor).__name__ == "WanAttnProcessor"  # restored


def test_load_svd_refuses_a_video_model_by_name():
    from pasa_diffusers.pipelines.svd import ModelLoadError, load_svd

    with pytest.raises(ModelLoadError, match=r"^--model tiny-wan: a video transformer pipeline, not SVD"):
        load_svd("tiny-wan")
