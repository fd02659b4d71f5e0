"""The built-in video-transformer pipelines (``pasa_diffusers/pipelines/video.py``: ``tiny-wan``, ``tiny-ltx-video``,
``tiny-cogvideox``, ``tiny-hunyuan-video``, ``tiny-mochi``) and the commands on them: built offline, generated
through the console script, diagnosed (attention layers and activations), saved and loaded again (a saved Wan also
without the package ``accelerate``), and a planted overflow found where it was planted and nowhere else.  Small
sizes: Wan 5 frames of 32 x 32 (2 latent frames of 4 x 4, 8 video tokens); LTX-Video 9 frames of 64 x 64 (2 latent
frames of 2 x 2, 8 tokens); CogVideoX 9 frames of 32 x 32 (3 latent frames of 4 x 4, 12 tokens); HunyuanVideo 5
frames of 32 x 32 (2 latent frames of 4 x 4, 8 tokens); Mochi 7 frames of 32 x 32 (2 latent frames of 4 x 4, 8
tokens)."""
import argparse
import json
import logging
import re
import shutil
import subprocess
import warnings

import numpy as np
import pytest

from tests.console import PASA
import torch
from diffusers import (AutoencoderKLCogVideoX, AutoencoderKLHunyuanVideo, AutoencoderKLLTXVideo, AutoencoderKLMochi,
                       AutoencoderKLWan, CogVideoXDDIMScheduler, CogVideoXPipeline, CogVideoXTransformer3DModel,
                       FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline, HunyuanVideoTransformer3DModel,
                       LTXPipeline, LTXVideoTransformer3DModel, MochiPipeline, MochiTransformer3DModel,
                       UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel)
from diffusers.utils import is_accelerate_available

from pasa_diffusers.cli import common, main
from pasa_diffusers.pipelines import svd, video
from pasa_diffusers.pipelines.diagnose import diagnose
from pasa_diffusers.pipelines.names import TINY_VIDEO_SETTINGS
from pasa_diffusers.pipelines.video_dits import tiny_cogvideox_vae

SMALL = {"num_frames": 5, "num_inference_steps": 2, "seed": 0, "height": 32, "width": 32}
FLAGS = ["--frames", "5", "--steps", "2", "--height", "32", "--width", "32"]
ROLES = {"attention output", "ffn hidden", "ffn output", "norm", "block output"}
NEW = {  # the built-ins besides tiny-wan: classes, (temporal, spatial) VAE factors, text tokens, small settings
    "tiny-ltx-video": (
        (LTXPipeline, LTXVideoTransformer3DModel, AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler),
        (8, 32), 128, {"num_frames": 9, "height": 64, "width": 64}),
    "tiny-cogvideox": (
        (CogVideoXPipeline, CogVideoXTransformer3DModel, AutoencoderKLCogVideoX, CogVideoXDDIMScheduler),
        (4, 8), 7, {"num_frames": 9, "height": 32, "width": 32}),
    "tiny-hunyuan-video": (
        (HunyuanVideoPipeline, HunyuanVideoTransformer3DModel, AutoencoderKLHunyuanVideo,
         FlowMatchEulerDiscreteScheduler), (4, 8), 256, {"num_frames": 5, "height": 32, "width": 32}),
    "tiny-mochi": (
        (MochiPipeline, MochiTransformer3DModel, AutoencoderKLMochi, FlowMatchEulerDiscreteScheduler),
        (6, 8), 256, {"num_frames": 7, "height": 32, "width": 32}),
}
MASKED = {"tiny-ltx-video", "tiny-hunyuan-video", "tiny-mochi"}
"""The built-ins whose pipelines take the prompts' attention masks."""
TEXT_COMPONENTS = {"tiny-hunyuan-video": ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")}
"""Tokenizers and text encoders left out, where a pipeline has more than Wan's two."""


@pytest.fixture(scope="module")
def wan() -> WanPipeline:
    return video.load_video("tiny-wan")


@pytest.fixture(scope="module")
def pipes() -> dict:
    return {name: video.load_video(name) for name in NEW}


def _small(name: str, **changes) -> dict:
    return {**NEW[name][3], "num_inference_steps": 2, "seed": 0, **changes}


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
    if not is_accelerate_available():  # what load_video works around: diffusers 0.42 alone refuses Wan's transformer
        with pytest.raises(ValueError, match=r"^`low_cpu_mem_usage` cannot be False when `keep_in_fp32_modules`"):
            WanTransformer3DModel.from_pretrained(tmp_path, subfolder="transformer")
    loaded = video.load_pipeline(str(tmp_path))
    assert type(loaded) is WanPipeline and type(loaded.transformer) is WanTransformer3DModel
    assert loaded.text_encoder is None and loaded.tokenizer is None and loaded.transformer_2 is None
    mine, theirs = wan.transformer.state_dict(), loaded.transformer.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.fixture(scope="module")
def saved_wan(wan, tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved") / "wan"
    wan.save_pretrained(folder, safe_serialization=True)
    return folder


def _edit(folder, file: str, **changes) -> None:
    path = folder / file
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("damage, message", [
    ("fewer layers", r"component folder {folder}/transformer: config.json and weights disagree: 27 tensor\(s\) in the "
                     r"weights are not in the model its config.json makes \(blocks.1.attn1.norm_k.weight, .*\(27 in "
                     r"all\)\); save the pipeline again with save_pretrained\(\), or restore the config.json"),
    ("wider ffn", r"model='{folder}': a component's config.json and weights disagree \(Error\(s\) in loading state_dict "
                  r"for WanTransformer3DModel: size mismatch for blocks.0.ffn.net.0.proj.weight: .*\); save"),
    ("LTXPipeline", r"model='{folder}': its component 'vae' is AutoencoderKLWan \(diffusers\), but LTXPipeline takes "
                    r"AutoencoderKLLTXVideo there: model_index.json names another family's pipeline"),
    ("no vae", r"folder model='{folder}' lacks the component folder\(s\) \['vae'\] that its model_index.json lists"),
    ("no transformer weights", r"component folder {folder}/transformer holds no .safetensors weights \(its "
                               r"config.json says it is a model\); save the pipeline again"),
])
def test_a_saved_wan_that_cannot_be_its_model_is_refused_naming_the_component(saved_wan, tmp_path, damage, message):
    folder = tmp_path / "wan"
    shutil.copytree(saved_wan, folder)
    if damage == "fewer layers":
        _edit(folder, "transformer/config.json", num_layers=1)
    elif damage == "wider ffn":
        _edit(folder, "transformer/config.json", ffn_dim=96)
    elif damage == "LTXPipeline":
        _edit(folder, "model_index.json", _class_name="LTXPipeline")
    elif damage == "no vae":
        shutil.rmtree(folder / "vae")
    else:
        for weights in (folder / "transformer").glob("*.safetensors"):
            weights.unlink()
    with pytest.raises(svd.ModelLoadError, match="^load_video: " + message.format(folder=re.escape(str(folder)))):
        video.load_pipeline(str(folder))


def test_loading_a_saved_folder_keeps_third_party_logs_out_unless_asked(saved_wan):
    """diffusers advised `pip install accelerate` on every load of a saved folder, and said a float16 pipeline on
    the CPU "will fail" (it runs); both held back by pipelines.quiet, shown with --debug (quiet.show)."""
    from pasa_diffusers.pipelines import quiet

    class Collect(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    collect = Collect()
    root = logging.getLogger("diffusers")  # its own handler writes to the stderr it found at import
    root.addHandler(collect)
    try:
        video.load_pipeline(str(saved_wan), dtype=torch.float16)
        held_back = list(collect.messages)
        quiet.show(True)
        video.load_pipeline(str(saved_wan), dtype=torch.float16)
    finally:
        quiet.show(None)
        root.removeHandler(collect)
    assert held_back == []
    shown = " ".join(collect.messages)
    assert "will fail" in shown and (is_accelerate_available() or "pip install accelerate" in shown)


def test_a_saved_tiny_wan_loads_in_half_precision_keeping_its_float32_modules(tmp_path):
    """As ``from_pretrained(torch_dtype=float16)`` with accelerate: every tensor float16 but those of the modules
    ``WanTransformer3DModel._keep_in_fp32_modules`` names (time embedder, norms, scale-shift tables, RoPE)."""
    video.load_video("tiny-wan").save_pretrained(tmp_path, safe_serialization=True)
    loaded = video.load_pipeline(str(tmp_path), dtype=torch.float16)
    built = video.load_video("tiny-wan", dtype=torch.float16)
    keep = set(WanTransformer3DModel._keep_in_fp32_modules)
    for module in ("transformer", "vae"):
        mine, theirs = getattr(built, module).state_dict(), getattr(loaded, module).state_dict()
        assert mine.keys() == theirs.keys()
        assert all(theirs[k].dtype == mine[k].dtype and torch.equal(mine[k], theirs[k]) for k in mine)
    dtypes = {name: tensor.dtype for name, tensor in loaded.transformer.state_dict().items()}
    assert {dtype for name, dtype in dtypes.items() if keep & set(name.split("."))} == {torch.float32}
    assert {dtype for name, dtype in dtypes.items() if not keep & set(name.split("."))} == {torch.float16}


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


@pytest.mark.parametrize("flags, message", [
    (["--frames", "133"], "--frames 133: WanPipeline's rotary table holds 32 positions per axis (its transformer's "
                          "rope_max_seq_len), and 133 makes 34: at most 125, got 133"),
    (["--height", "528"], "--height 528: WanPipeline's rotary table holds 32 positions per axis (its transformer's "
                          "rope_max_seq_len), and 528 makes 33: at most 512, got 528"),
])
def test_a_wan_video_longer_than_its_rotary_table_is_refused_before_any_work(wan, flags, message):
    """Was: the documented checks passed, then the rotary table's reshape failed mid-run (a RuntimeError)."""
    with pytest.raises(common.UsageError, match=rf"^{re.escape(message)}$"):
        common.generation_settings(_parse(["generate", "--model", "tiny-wan", *flags]), wan)
    largest = {"num_frames": 125, "height": 512, "width": 16}
    assert video.setting_problem(wan, **largest) is None
    frames = video.generate(wan, **{**SMALL, "num_frames": 125, "height": 16, "width": 16, "num_inference_steps": 1},
                            progress=False)
    assert frames.shape == (125, 16, 16, 3)  # the largest accepted runs


def _parse(argv: list[str]) -> argparse.Namespace:
    from pasa_diffusers.cli import build_parser

    return build_parser().parse_args(argv)


def test_unset_sizes_take_the_models_defaults(wan):
    args = _parse(["generate", "--model", "tiny-wan", "--steps", "3"])
    assert video.default_settings(wan) == TINY_VIDEO_SETTINGS["tiny-wan"]
    assert common.generation_settings(args, wan) == {**TINY_VIDEO_SETTINGS["tiny-wan"], "num_inference_steps": 3,
                                                     "seed": 0}
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


@pytest.mark.slow
def test_generate_through_the_console_script(tmp_path):
    done = subprocess.run([PASA, "generate", "--model", "tiny-wan", "--attention", "pasa", *FLAGS,
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("text encoder replaced by fixed prompt embeddings: unit Gaussians of 512 tokens x 24")
    written = (("mp4", "pasa.mp4"), ("gif", "pasa.gif"), ("png", "pasa"), ("summary", "pasa.json"))
    assert lines[1:] == ["attention: pasa in 4 layers (PASAAttnProcessor via WanAttnProcessor, in float16); 16 calls, "
                         "none by a fallback", "all frames finite",
                         *(f"wrote {kind}: {tmp_path / name}" for kind, name in written)]
    report = json.loads((tmp_path / "pasa.json").read_text())
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


@pytest.mark.parametrize("name", NEW)
def test_the_other_builtins_build_offline_seeded_without_text_encoder(pipes, name):
    (pipeline, transformer, vae, scheduler), factors, tokens, _ = NEW[name]
    pipe = pipes[name]
    assert (type(pipe), type(pipe.transformer), type(pipe.vae), type(pipe.scheduler)) == \
        (pipeline, transformer, vae, scheduler)
    assert all(getattr(pipe, part) is None for part in TEXT_COMPONENTS.get(name, ("tokenizer", "text_encoder")))
    assert pipe.name_or_path == name
    assert video.is_video_pipeline(pipe) and video.denoiser(pipe) is pipe.transformer
    assert video._compression(pipe) == factors
    positive, negative = video.prompt_embeddings(pipe)
    assert positive.shape == negative.shape == (1, tokens, 24) and not torch.equal(positive, negative)
    masks = video.prompt_attention_masks(pipe)
    if name in MASKED:  # the pipeline takes the prompts' attention masks: every token kept
        assert all(mask.dtype == torch.bool and mask.shape == (1, tokens) and mask.all() for mask in masks)
    else:
        assert masks is None
    pooled = video.pooled_prompt_embeddings(pipe)
    if name == "tiny-hunyuan-video":  # and CLIP's pooled embeddings, drawn next from the same generator
        assert pooled[0].shape == pooled[1].shape == (1, pipe.transformer.config.pooled_projection_dim)
        draws = torch.randn(2 * tokens * 24 + 2 * 12, generator=torch.Generator().manual_seed(video.PROMPT_SEED))
        assert torch.equal(torch.cat([pooled[0], pooled[1]], dim=1).flatten(), draws[2 * tokens * 24:])
    else:
        assert pooled is None
    again = video.load_video(name)
    for module in ("transformer", "vae"):
        mine, theirs = getattr(pipe, module).state_dict(), getattr(again, module).state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.parametrize("name", NEW)
def test_the_other_builtins_generate_seeded_frames_in_range(pipes, name):
    pipe = pipes[name]
    assert video.default_settings(pipe) == TINY_VIDEO_SETTINGS[name]
    for settings in (_small(name), {**TINY_VIDEO_SETTINGS[name], "num_inference_steps": 2, "seed": 0}):
        frames = video.generate(pipe, progress=False, **settings)
        assert frames.shape == (settings["num_frames"], settings["height"], settings["width"], 3)
        assert frames.dtype == np.float32 and np.isfinite(frames).all()
        assert frames.min() >= 0 and frames.max() <= 1 and frames.std() > 0
    frames = video.generate(pipe, progress=False, **_small(name))
    assert np.array_equal(frames, video.generate(pipe, progress=False, **_small(name)))
    assert not np.array_equal(frames, video.generate(pipe, progress=False, **_small(name, seed=1)))


def test_mochi_runs_without_torchs_cpu_autocast_warning(pipes):
    """Mochi's rotary table is made under autocast(float32), which torch's CPU autocast refuses with a UserWarning on
    every run; dropped there (video.generate), and nowhere else."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        video.generate(pipes["tiny-mochi"], progress=False, **_small("tiny-mochi"))
        with torch.autocast("cpu", torch.float32):
            pass
    assert [str(w.message).splitlines()[0] for w in caught] == [
        "In CPU autocast, but the target dtype is not supported. Disabling autocast."]  # outside: still warned


def test_the_initial_noise_is_laid_out_as_each_pipeline_takes_it(pipes):
    ltx, cogvideox = pipes["tiny-ltx-video"], pipes["tiny-cogvideox"]
    draw = torch.randn((1, 8, 2, 2, 2), generator=torch.Generator().manual_seed(3))  # (B, C, F, H, W)
    packed = video.make_latents(ltx, **NEW["tiny-ltx-video"][3], seed=3)
    assert packed.shape == (1, 8, 8) and torch.equal(packed, LTXPipeline._pack_latents(draw))  # (B, tokens, C)
    assert torch.equal(LTXPipeline._unpack_latents(packed, 2, 2, 2), draw)
    noise = video.make_latents(cogvideox, **NEW["tiny-cogvideox"][3], seed=3)
    assert noise.shape == (1, 3, 4, 4, 4) and noise.dtype == torch.float32  # (B, F, C, H, W)
    assert torch.equal(noise, torch.randn((1, 3, 4, 4, 4), generator=torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("name, setting, value, why", [
    ("tiny-ltx-video", "num_frames", 13, "LTXPipeline takes 8k + 1 frames (its VAE compresses time 8x), got 13"),
    ("tiny-ltx-video", "height", 48, "LTXPipeline takes multiples of 32 (VAE 32x, patch 1), got 48"),
    ("tiny-ltx-video", "num_inference_steps", 1, "LTXPipeline takes at least 2 steps (its scheduler stretches the "
                                                 "sigmas to end at shift_terminal 0.1, which one step cannot), got 1"),
    ("tiny-cogvideox", "num_frames", 5, "CogVideoXPipeline takes 8k + 1 frames (its VAE compresses time 4x and "
                                        "decodes an odd number of latent frames only), got 5"),
    ("tiny-cogvideox", "width", 40, "CogVideoXPipeline takes multiples of 16 (VAE 8x, patch 2), got 40"),
    ("tiny-hunyuan-video", "num_frames", 7, "HunyuanVideoPipeline takes 4k + 1 frames (its VAE compresses time 4x), "
                                            "got 7"),
    ("tiny-hunyuan-video", "height", 40, "HunyuanVideoPipeline takes multiples of 16 (VAE 8x, patch 2), got 40"),
    ("tiny-mochi", "num_frames", 9, "MochiPipeline takes 6k + 1 frames (its VAE compresses time 6x), got 9"),
    ("tiny-mochi", "width", 24, "MochiPipeline takes multiples of 16 (VAE 8x, patch 2), got 24"),
    ("tiny-mochi", "num_inference_steps", 1, "MochiPipeline takes at least 2 steps (its linear-quadratic sigma "
                                             "schedule divides by its linear steps, half the steps rounded down), "
                                             "got 1"),
])
def test_a_setting_the_other_pipelines_would_get_wrong_is_refused(pipes, name, setting, value, why):
    with pytest.raises(ValueError, match=rf"^generate: {setting}: {re.escape(why)}$"):
        video.generate(pipes[name], progress=False, **_small(name, **{setting: value}))


@pytest.mark.parametrize("name, flags, message", [
    ("tiny-ltx-video", ["--steps", "1"], "--steps 1: LTXPipeline takes at least 2 steps"),
    ("tiny-ltx-video", ["--frames", "13"], "--frames 13: LTXPipeline takes 8k + 1 frames"),
    ("tiny-cogvideox", ["--frames", "5"], "--frames 5: CogVideoXPipeline takes 8k + 1 frames"),
    ("tiny-hunyuan-video", ["--width", "72"], "--width 72: HunyuanVideoPipeline takes multiples of 16"),
    ("tiny-mochi", ["--steps", "1"], "--steps 1: MochiPipeline takes at least 2 steps"),
    ("tiny-mochi", ["--frames", "9"], "--frames 9: MochiPipeline takes 6k + 1 frames"),
])
def test_the_command_line_names_the_flag_the_other_pipelines_refuse(pipes, name, flags, message):
    with pytest.raises(common.UsageError, match=rf"^{re.escape(message)}"):
        common.generation_settings(_parse(["diagnose", "--model", name, *flags]), pipes[name])
    assert common.generation_settings(_parse(["diagnose", "--model", name]), pipes[name]) == {
        **TINY_VIDEO_SETTINGS[name], "num_inference_steps": 2, "seed": 0}


def test_why_those_settings_are_refused(pipes):
    """CogVideoX's VAE decodes 2 latent frames (5 frames' worth) to 8 frames; LTX-Video's scheduler gives NaN
    sigmas for one step; Mochi's sigma schedule divides by zero for one step."""
    with torch.no_grad():
        decoded = tiny_cogvideox_vae().decode(torch.randn(1, 4, 2, 4, 4), return_dict=False)[0]
    assert decoded.shape[2] == 8
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipes["tiny-ltx-video"].scheduler.config)
    with np.errstate(invalid="ignore"):  # 0 / 0
        scheduler.set_timesteps(sigmas=[1.0], mu=0.6)
    assert scheduler.sigmas[:1].isnan().all()
    scheduler.set_timesteps(sigmas=[1.0, 0.5], mu=0.6)
    assert scheduler.sigmas.isfinite().all()
    from diffusers.pipelines.mochi.pipeline_mochi import linear_quadratic_schedule

    with pytest.raises(ZeroDivisionError):
        linear_quadratic_schedule(1, 0.025)
    assert len(linear_quadratic_schedule(2, 0.025)) == 2


@pytest.mark.slow
def test_generate_ltx_video_through_the_console_script(tmp_path):
    done = subprocess.run([PASA, "generate", "--model", "tiny-ltx-video", "--frames", "9", "--steps",
                           "2", "--height", "64", "--width", "64", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("text encoder replaced by fixed prompt embeddings: unit Gaussians of 128 tokens x 24")
    assert "their attention masks keep every token" in lines[0]
    assert len(lines) == 7 and lines[2] == "all frames finite"
    report = json.loads((tmp_path / "pasa.json").read_text())
    assert report["processors"]["video-self"] == report["processors"]["video-cross"] == \
        "PASAAttnProcessor via LTXVideoAttnProcessor"
    assert report["installed"]["video-self"] == report["installed"]["video-cross"] == 2
    assert report["calls"] == 4 * 2 and report["fallbacks"] == {}  # 4 layers x 2 steps (cond + uncond in one call)
    assert len(list((tmp_path / "pasa").glob("*.png"))) == 9


@pytest.mark.parametrize("name, notice, processor, installed, calls, fallbacks", [
    # guidance-distilled: one call per layer and step; the text refiner's query x key mask is the counted fallback
    pytest.param("tiny-hunyuan-video", "256 tokens x 24 (seed 0: the prompt's, then the negative prompt's, then pooled "
                                       "ones of width 12); their attention masks keep every token",
                 "HunyuanVideoAttnProcessor2_0", {"video-self": 2, "other": 1}, 3 * 2, {"attention mask": 2},
                 id="tiny-hunyuan-video"),
    # cond + uncond in one forward, whose processor attends each sample over its own prompt tokens: a call each
    pytest.param("tiny-mochi", "256 tokens x 24 (seed 0: the prompt's, then the negative prompt's); their attention "
                               "masks keep every token", "MochiAttnProcessor2_0", {"video-self": 2}, 2 * 2 * 2, {},
                 id="tiny-mochi"),
])
@pytest.mark.slow
def test_generate_hunyuan_video_and_mochi_through_the_console_script(name, notice, processor, installed, calls,
                                                                     fallbacks, tmp_path):
    settings = NEW[name][3]
    done = subprocess.run([PASA, "generate", "--model", name, "--frames", str(settings["num_frames"]),
                           "--steps", "2", "--height", str(settings["height"]), "--width", str(settings["width"]),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"{video.NOTICE}: unit Gaussians of {notice}; no tokenizer or text encoder is loaded"
    assert lines[1].startswith("attention: pasa in ") and lines[2] == "all frames finite"
    report = json.loads((tmp_path / "pasa.json").read_text())
    assert {kind for kind, count in report["installed"].items() if count} == set(installed)
    assert all(report["installed"][kind] == count for kind, count in installed.items())
    assert all(report["processors"][kind] == ("PASAAttnProcessor" if kind == "other" else
                                              f"PASAAttnProcessor via {processor}") for kind in installed)
    assert report["calls"] == calls and report["fallbacks"] == fallbacks
    assert report["attention_dtype"] == "float16"
    assert len(list((tmp_path / "pasa").glob("*.png"))) == settings["num_frames"]


_SINGLE = {"attention output", "norm", "block output"}
"""The roles recorded in HunyuanVideo's single-stream block, whose MLP (``proj_mlp``, run beside the attention
and joined in ``proj_out``) is not one of the diagnosis's feed-forward sites."""


@pytest.mark.parametrize("name, paths, kinds, calls, blocks", [
    ("tiny-ltx-video", [f"transformer_blocks.{b}.attn{i}" for b in (0, 1) for i in (1, 2)],
     {"video-self", "video-cross"}, 2, {"transformer_blocks.0": ROLES, "transformer_blocks.1": ROLES}),
    ("tiny-cogvideox", [f"transformer_blocks.{b}.attn1" for b in (0, 1)],  # text tokens joined: no cross-attention
     {"video-self"}, 2, {"transformer_blocks.0": ROLES, "transformer_blocks.1": ROLES}),
    ("tiny-hunyuan-video",  # text tokens joined; the text refiner's self-attention over the prompt: kind other
     ["context_embedder.token_refiner.refiner_blocks.0.attn", "single_transformer_blocks.0.attn",
      "transformer_blocks.0.attn"], {"video-self", "other"}, 2,
     {"transformer_blocks.0": ROLES, "single_transformer_blocks.0": _SINGLE}),
    ("tiny-mochi", [f"transformer_blocks.{b}.attn1" for b in (0, 1)],  # one call per sample: its prompts' own tokens
     {"video-self"}, 4, {"transformer_blocks.0": ROLES, "transformer_blocks.1": ROLES}),
])
def test_diagnose_finds_every_attention_layer_of_the_other_builtins(name, paths, kinds, calls, blocks, tmp_path,
                                                                    capsys):
    flags = [f"--{flag}={NEW[name][3][key]}" for flag, key in (("frames", "num_frames"), ("height", "height"),
                                                                 ("width", "width"))]
    assert main(["diagnose", "--model", name, *flags, "--steps", "2", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "diagnosis.json").read_text())
    assert sorted(layer["path"] for layer in result["layers"]) == paths
    # 2 steps; cond + uncond in one call (HunyuanVideo: guidance-distilled, one sample; Mochi: a call per sample)
    assert all(layer["calls"] == calls for layer in result["layers"])
    assert {layer["kind"] for layer in result["layers"]} == kinds
    assert {site["block"] for site in result["activations"]} == set(blocks)
    for block, roles in blocks.items():
        assert {site["role"] for site in result["activations"] if site["block"] == block} == roles
    assert f"0 of {len(paths)} attention layers overflow" in printed and result["conditioning"] == video.NOTICE
    assert result["frames"] == {"finite": True, "match_plain": True}


def _save(name: str, folder, capsys) -> str:
    assert main(["save-model", "--model", name, str(folder)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"saved {name} (") and f"load it with --model {folder}" in printed
    assert {p.suffix for p in folder.rglob("*.safetensors")} == {".safetensors"}
    assert not [p for p in folder.rglob("*") if p.suffix in (".bin", ".pt", ".pth")]
    index = json.loads((folder / "model_index.json").read_text())
    for part in TEXT_COMPONENTS.get(name, ("tokenizer", "text_encoder")):
        assert index[part] == [None, None]
    assert index[video.SETTINGS_KEY] == TINY_VIDEO_SETTINGS[name]
    return printed


def test_save_model_of_tiny_wan_and_its_reload(wan, tmp_path, capsys):
    folder = tmp_path / "wan"
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = logging.getLogger("diffusers.pipelines.pipeline_utils")
    logger.addHandler(handler)
    try:
        printed = _save("tiny-wan", folder, capsys)
    finally:
        logger.removeHandler(handler)
    assert not [message for message in logged if "cannot be saved" in message]  # tokenizer, text encoder: null
    count = sum(p.numel() for module in (wan.transformer, wan.vae) for p in module.parameters())
    assert printed.startswith(f"saved tiny-wan ({count / 1e3:.3g} k parameters, float32)")  # every component counted
    assert "text encoder replaced by fixed prompt embeddings" in printed
    assert main(["generate", "--model", str(folder), "--steps", "2", "--out", str(tmp_path / "video")]) == 0
    assert "all frames finite" in capsys.readouterr().out  # with or without the package accelerate
    assert len(list((tmp_path / "video" / "pasa").glob("*.png"))) == TINY_VIDEO_SETTINGS["tiny-wan"]["num_frames"]
    loaded = video.load_pipeline(str(folder))
    assert video.default_settings(loaded) == TINY_VIDEO_SETTINGS["tiny-wan"]
    np.testing.assert_allclose(video.generate(loaded, progress=False, **SMALL),  # as below: unaligned buffers
                               video.generate(wan, progress=False, **SMALL), rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW)
def test_save_model_of_the_other_builtins_loads_the_same_pipeline(pipes, name, tmp_path, capsys):
    folder = tmp_path / name
    _save(name, folder, capsys)
    loaded = video.load_pipeline(str(folder))
    assert type(loaded) is type(pipes[name])
    assert all(getattr(loaded, part) is None for part in TEXT_COMPONENTS.get(name, ("tokenizer", "text_encoder")))
    assert video.default_settings(loaded) == TINY_VIDEO_SETTINGS[name]  # its small defaults, not the pipeline's
    for module in ("transformer", "vae"):
        mine, theirs = getattr(pipes[name], module).state_dict(), getattr(loaded, module).state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    # the same weights, but read from safetensors into buffers not 64-byte aligned, on which the CPU convolutions
    # sum in another order: frames within 1e-5, not bit for bit
    np.testing.assert_allclose(video.generate(loaded, progress=False, **_small(name)),
                               video.generate(pipes[name], progress=False, **_small(name)), rtol=0, atol=1e-5)
    assert main(["diagnose", "--model", str(folder), "--steps", "2", "--out", str(tmp_path / "diagnosis")]) == 0
    assert f"{folder}: 0 of " in capsys.readouterr().out
