"""pasa_diffusers.pipelines.svd: the built-in pipelines, save/load through safetensors (tiny-resonant's planted
biases included), explicit latents, frames, images in every mode PIL opens (``pipelines.images``); and the
names the pipelines take (``pipelines.names``).

Frames are pixels in [0, 1]; tolerances below are absolute pixel differences.
"""
from __future__ import annotations

import inspect
import json
import logging
import re
import shutil
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import StableVideoDiffusionPipeline, UNetSpatioTemporalConditionModel
from diffusers.models.attention_processor import Attention

from pasa_diffusers import install as I
from pasa_diffusers import processors as P
from pasa_diffusers.pipelines.images import ImageError
from pasa_diffusers.pipelines.names import BUILTIN_IMAGES, BUILTIN_MODELS, is_hub_id
from pasa_diffusers.pipelines.resonant import (PLANTED_LAYERS, QKBiasUNetSpatioTemporalConditionModel, plant_resonance,
                                               with_qk_biases)
from pasa_diffusers.pipelines.svd import (
    ModelLoadError,
    TINY_DEFAULTS,
    to_frames,
    generate,
    load_image,
    load_svd,
    make_latents,
)

FRAMES = TINY_DEFAULTS["num_frames"]
SIZE = TINY_DEFAULTS["height"]


@pytest.fixture(scope="module")
def image():
    return load_image("builtin:coffee", SIZE)


def draw_seed(g: torch.Generator) -> int:
    return int(torch.randint(2**31, (), generator=g))


def run(pipe, image, latents=None, seed=0, **kwargs):
    return generate(pipe, image, seed=seed, latents=latents, progress=False, **{**TINY_DEFAULTS, **kwargs})


def state(pipe):
    return {
        f"{name}.{key}": value
        for name in ("unet", "vae", "image_encoder")
        for key, value in getattr(pipe, name).state_dict().items()
    }


def assert_same_weights(a, b):
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[key], sb[key]) for key in sa)


def assert_frames(frames, num_frames=FRAMES, size=SIZE):
    assert frames.shape == (num_frames, size, size, 3) and frames.dtype == np.float32
    assert np.isfinite(frames).all()
    assert frames.min() >= 0 and frames.max() <= 1
    assert frames.std() > 0.01  # a picture, not a constant


# ---------------------------------------------------------------------------------------------- loading


def test_tiny_pipeline_is_reproducible_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    first = load_svd("tiny")
    assert torch.equal(torch.rand(4), expected)
    assert_same_weights(first, load_svd("tiny"))
    assert not any(m.training for name in ("unet", "vae", "image_encoder") for m in getattr(first, name).modules())


def test_tiny_unet_head_dims_are_kernel_sized(pipe):
    head_dims = {m.to_q.out_features // m.heads for m in pipe.unet.modules() if isinstance(m, Attention)}
    assert head_dims == {16, 32}


def test_tiny_dtype_and_variant(pipe):
    half = load_svd("tiny", dtype=torch.float16)
    assert {p.dtype for p in half.unet.parameters()} == {torch.float16}
    assert {p.dtype for p in half.image_encoder.parameters()} == {torch.float16}
    assert {p.dtype for p in pipe.vae.parameters()} == {torch.float32}
    with pytest.raises(ValueError, match="variant='fp16'"):
        load_svd("tiny", variant="fp16")


def test_saved_pipeline_loads_back_offline_and_generates(pipe, image, tmp_path):
    pipe.save_pretrained(tmp_path, safe_serialization=True)
    weights = [p.name for p in tmp_path.rglob("*") if p.suffix in (".safetensors", ".bin", ".pt", ".pth")]
    assert weights and all(name.endswith(".safetensors") for name in weights)

    loaded = load_svd(str(tmp_path), local_files_only=True)
    assert_same_weights(pipe, loaded)
    frames = run(loaded, image)
    assert_frames(frames)
    # Bitwise-equal weights, yet the loaded CLIP weights sit at unaligned addresses in the safetensors
    # buffer and the CPU GEMMs take another path: embeddings differ by 2.4e-7, frames by 2e-5.
    assert np.abs(frames - run(pipe, image)).max() <= 1e-4


def test_tiny_resonant_saved_and_loaded_is_the_same_model(tmp_path):
    """The planted biases are parameters the UNet's config lists: from_pretrained rebuilds and loads them."""
    pipe = load_svd("tiny-resonant")
    pipe.save_pretrained(tmp_path, safe_serialization=True)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["unet"] == ["pasa_diffusers.pipelines.resonant", "QKBiasUNetSpatioTemporalConditionModel"]
    planted = sorted(key for key in state(pipe)
                     if key.startswith("unet.") and key.endswith(("to_q.bias", "to_k.bias")))
    assert planted == sorted(f"unet.{path}.{name}.bias" for path in PLANTED_LAYERS for name in ("to_q", "to_k"))
    loads = (StableVideoDiffusionPipeline.from_pretrained(tmp_path), load_svd(str(tmp_path), local_files_only=True))
    for loaded in loads:
        assert type(loaded.unet) is QKBiasUNetSpatioTemporalConditionModel and not loaded.unet.training
        assert list(loaded.unet.config.qk_bias_layers) == list(PLANTED_LAYERS)
        assert_same_weights(pipe, loaded)
        # b max|c|, with b = sqrt(2 * 65504 / (D / 2)) >= 90 for D <= 32
        assert min(state(loaded)[key].abs().max() for key in planted) > 80


@pytest.mark.slow
def test_a_planted_folder_without_its_module_is_refused_not_dropped(tmp_path):
    """Plain diffusers in a fresh process, without pasa_diffusers imported: an error naming the module to
    import (diffusers 0.42's custom-component rule), never the UNet without its biases."""
    load_svd("tiny-resonant").save_pretrained(tmp_path)
    code = ("from diffusers import StableVideoDiffusionPipeline; "
            f"StableVideoDiffusionPipeline.from_pretrained({str(tmp_path)!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "import pasa_diffusers.pipelines.resonant before calling `from_pretrained`" in done.stderr


def test_with_qk_biases_keeps_the_weights_and_plant_resonance_needs_them(pipe):
    layer = PLANTED_LAYERS[1]
    biased = with_qk_biases(pipe.unet, (layer,))
    before, after = pipe.unet.state_dict(), biased.state_dict()
    assert set(after) - set(before) == {f"{layer}.to_q.bias", f"{layer}.to_k.bias"}
    assert all(after[key] is before[key] or torch.equal(after[key], before[key]) for key in before)
    assert not after[f"{layer}.to_q.bias"].any() and not biased.training
    assert {t.device.type for t in after.values()} == {"cpu"}
    with pytest.raises(ValueError, match=r"^plant_resonance: attn.to_q and attn.to_k must have a bias"):
        plant_resonance(dict(pipe.unet.named_modules())[PLANTED_LAYERS[0]])
    with pytest.raises(ValueError, match=r"qk_bias_layers names 'mid_block', which is not an Attention module"):
        with_qk_biases(pipe.unet, ("mid_block",))


class _Messages(logging.Handler):
    """The messages a logger passes on (after its filters)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_dtype_casts_warn_about_float32_modules_only_when_there_are_some(image):
    """diffusers' ModelMixin.to logs "should be kept in float32: []" on every cast (load_svd's, and the
    pipeline's own fp16 VAE upcast and back); an empty list says nothing and is not shown, a real one once."""
    logger = logging.getLogger("diffusers.models.modeling_utils")
    seen = _Messages()
    logger.addHandler(seen)
    try:
        half = load_svd("tiny", dtype=torch.float16)
        run(half, image, num_inference_steps=1)
        assert not [m for m in seen.messages if "kept in float32" in m]
        message = "There are modules in X that should be kept in float32: ['norm']. Casting directly ..."
        logger.warning(message)
        logger.warning(message)
        assert seen.messages.count(message) == 1
    finally:
        logger.removeHandler(seen)


def _parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_svd_xt_random_has_svd_xt_shapes_on_the_device_and_dtype_asked():
    """Built on the meta device: the shapes and configs of SVD-XT, no weight materialised."""
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    pipe = load_svd("svd-xt-random", device="meta", dtype=torch.float16)
    assert torch.equal(torch.rand(4), expected), "the global generator must be left as it was"
    assert pipe.name_or_path == "svd-xt-random" and torch.get_default_dtype() == torch.float32
    counts = {name: _parameters(getattr(pipe, name)) for name in ("unet", "vae", "image_encoder")}
    assert counts == {"unet": 1_524_623_082, "vae": 97_742_847, "image_encoder": 632_076_800}
    assert sum(counts.values()) == 2_254_442_729  # "2.25 B parameters"
    for name in ("unet", "vae", "image_encoder"):
        model = getattr(pipe, name)
        assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.float16)}, name
        assert not model.training, name
    unet = dict(pipe.unet.config)
    defaults = {name: parameter.default for name, parameter in
                inspect.signature(UNetSpatioTemporalConditionModel.__init__).parameters.items() if name != "self"}
    assert {name: unet[name] for name in defaults} == defaults  # diffusers' default config, which is SVD-XT's
    assert unet["block_out_channels"] == (320, 640, 1280, 1280) and unet["num_attention_heads"] == (5, 10, 20, 20)
    assert unet["cross_attention_dim"] == 1024 and unet["num_frames"] == 25 and unet["in_channels"] == 8
    vae = pipe.vae.config
    assert (tuple(vae.block_out_channels), vae.layers_per_block, vae.latent_channels, vae.sample_size) == \
        ((128, 256, 512, 512), 2, 4, 768)
    assert tuple(vae.down_block_types) == ("DownEncoderBlock2D",) * 4 and pipe.vae_scale_factor == 8
    clip = pipe.image_encoder.config
    assert (clip.hidden_size, clip.intermediate_size, clip.num_attention_heads, clip.num_hidden_layers,
            clip.patch_size, clip.image_size, clip.projection_dim, clip.hidden_act) == \
        (1280, 5120, 16, 32, 14, 224, 1024, "gelu")
    assert pipe.unet.config.cross_attention_dim == clip.projection_dim
    scheduler = pipe.scheduler.config
    assert (scheduler.prediction_type, scheduler.sigma_max, scheduler.sigma_min, scheduler.use_karras_sigmas,
            scheduler.timestep_type) == ("v_prediction", 700.0, 0.002, True, "continuous")
    assert pipe.feature_extractor.crop_size == {"height": 224, "width": 224}
    with pytest.raises(ValueError, match="variant='fp16'"):
        load_svd("svd-xt-random", device="meta", variant="fp16")
    with pytest.raises(ValueError, match=r"^build_svd_xt_random: dtype must be a floating torch.dtype, got "
                                         r"dtype=torch.int8$"):
        load_svd("svd-xt-random", device="meta", dtype=torch.int8)
    assert torch.get_default_dtype() == torch.float32


def test_every_built_in_model_loads_under_its_name():
    for name in BUILTIN_MODELS:
        assert load_svd(name, device="meta" if name == "svd-xt-random" else "cpu").name_or_path == name


@pytest.mark.parametrize("model, hub", [
    ("stabilityai/stable-video-diffusion-img2vid-xt", True), ("org/name", True), ("org/name.v2", True),
    ("tny", False), ("tiny", False), ("org/", False), ("/name", False), ("org/name/sub", False),
    ("./org/name", False), ("~/org", False), ("", False),
])
def test_is_hub_id(model, hub):
    assert is_hub_id(model) is hub


def test_bad_model_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="model_index.json"):
        load_svd(str(tmp_path))
    with pytest.raises(ModelLoadError, match="no such folder"):
        load_svd(str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match="no such folder"):
        load_svd("./not/a/saved/pipeline")
    with pytest.raises(ModelLoadError, match="no such folder model='tny', and not a hub id 'org/name' nor a "
                                             "built-in model"):
        load_svd("tny")  # a typo of a built-in name is not sent to the hub
    (tmp_path / "weights.safetensors").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="weights.safetensors"):
        load_svd(str(tmp_path / "weights.safetensors"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved") / "tiny"
    load_svd("tiny").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("damage, detail", [("truncated", "incomplete metadata, file not fully covered"),
                                            ("garbage", "header too large")])
def test_a_damaged_weight_file_is_named(saved, tmp_path, damage, detail):
    folder = tmp_path / "tiny"
    shutil.copytree(saved, folder)
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100] if damage == "truncated" else b"garbage" * 100)
    with pytest.raises(ModelLoadError, match=rf"^load_svd: weight file {weights} is corrupt or truncated \(Error "
                                             rf"while deserializing header: {detail}\); save the pipeline again"):
        load_svd(str(folder), local_files_only=True)


def test_a_missing_component_or_weight_file_is_named(saved, tmp_path):
    folder = tmp_path / "tiny"
    shutil.copytree(saved, folder)
    (folder / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=rf"^load_svd: component folder {folder / 'unet'} holds no .safetensors "
                                             r"weights \(its config.json says it is a model\); save"):
        load_svd(str(folder))
    shutil.rmtree(folder / "unet")
    with pytest.raises(ModelLoadError, match=r"lacks the component folder\(s\) \['unet'\] that its model_index.json"):
        load_svd(str(folder))


def test_a_config_its_weights_do_not_cover_is_refused(saved, tmp_path):
    """A transformer layer more in unet/config.json than its weights hold would run randomly initialised (diffusers
    only logs "newly initialized", and the run went on): refused, naming the component folder and the tensors."""
    folder = tmp_path / "tiny"
    shutil.copytree(saved, folder)
    config = folder / "unet" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "transformer_layers_per_block": 2}))
    with pytest.raises(ModelLoadError, match=rf"^load_svd: component folder {folder / 'unet'}: config.json and weights "
                                             r"disagree: 276 tensor\(s\) its config.json makes are missing from the "
                                             r"weights \(down_blocks.0.attentions.0.temporal_transformer_blocks.1.attn1"
                                             r".to_k.weight, .*, ... \(276 in all\)\) and would run randomly "
                                             r"initialised; save the pipeline again"):
        load_svd(str(folder))


def test_integer_weights_where_the_model_holds_floats_are_refused(saved, tmp_path):
    """A UNet's weights stored as int32 were cast to float without a word and the run went on (noise, exit 0):
    refused, naming the component folder, the dtype and the tensors."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "tiny"
    shutil.copytree(saved, folder)
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    save_file({key: tensor.to(torch.int32) for key, tensor in state.items()}, weights)
    with pytest.raises(ModelLoadError, match=rf"^load_svd: component folder {folder / 'unet'}: {len(state)} "
                                             r"tensor\(s\) in the weights are integers \(int32\) where the model holds "
                                             r"floating-point values \(add_embedding.linear_1.bias, .*, ... "
                                             rf"\({len(state)} in all\)\): not this model's weights; save the "
                                             r"pipeline again with save_pretrained\(\)$"):
        load_svd(str(folder))


@pytest.mark.parametrize("name", ["FooPipeline", "WanPipeline"])
def test_a_model_index_naming_another_pipeline_is_refused(saved, tmp_path, name):
    """An unknown pipeline class, or a video transformer's (SVD's components under WanPipeline): one error."""
    from pasa_diffusers.pipelines.video import load_pipeline

    folder = tmp_path / "tiny"
    shutil.copytree(saved, folder)
    index = folder / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "_class_name": name}))
    message = {"FooPipeline": r"^load_svd: model=.*: its model_index.json names the pipeline class 'FooPipeline'; "
                              r"expected StableVideoDiffusionPipeline \(load_svd\), or WanPipeline, LTXPipeline",
               "WanPipeline": r"^load_video: model=.*: its component 'vae' is AutoencoderKLTemporalDecoder \(diffusers\),"
                              r" but WanPipeline takes AutoencoderKLWan there: model_index.json names another "
                              r"family's pipeline"}[name]
    with pytest.raises(ModelLoadError, match=message):
        load_pipeline(str(folder))


def test_an_unreachable_hub_is_one_error_at_once_without_retries(tmp_path, monkeypatch):
    """No network: one line after one failed connection (was: five logged retries per request, 33-80 s)."""
    import time

    import huggingface_hub
    import huggingface_hub.constants

    from pasa_diffusers.pipelines import checkpoints, video

    for name in checkpoints._PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused
    monkeypatch.setattr(checkpoints, "_unreachable", {})

    def no_download(*args, **kwargs):
        raise AssertionError("a request was sent to an unreachable hub")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_download)
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match=r"^load_svd: hub id model='org/not-cached' is not in the local Hugging "
                                             r"Face cache .* and could not be downloaded \(ConnectionRefusedError: "
                                             r".*\); check the name and the network, or pass a folder"):
        video.load_pipeline("org/not-cached")
    assert time.perf_counter() - start < 5


def test_generate_into_a_folder_of_a_longer_video_leaves_only_the_new_frames(tmp_path, capsys):
    """pasa generate of 4 frames, then of 2 into the same --out: the frame folder holds the 2 new frames only (was:
    frames 0-1 new beside 2-3 old, exit 0); a frame folder holding another file is refused in one line."""
    from pasa_diffusers.cli import main

    flags = ["generate", "--model", "tiny", "--attention", "sdpa", "--steps", "1", "--height", "16", "--width", "16",
             "--out", str(tmp_path)]
    assert main([*flags, "--frames", "4"]) == 0
    assert main([*flags, "--frames", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "sdpa").iterdir()) == ["frame_0000.png", "frame_0001.png"]
    (tmp_path / "sdpa" / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main([*flags, "--frames", "2"]) == 2
    assert capsys.readouterr().err == (f"pasa generate: error: --out {tmp_path}: the frame folder {tmp_path / 'sdpa'} "
                                       "holds 'notes.txt', which is not a frame_NNNN.png frame; a new video replaces "
                                       "that folder whole only when it holds frames alone: remove it or choose "
                                       "another --out\n")


def test_a_hub_id_neither_cached_nor_downloadable(tmp_path, monkeypatch):
    """Offline: what happened and what to do, never 'pass local_files_only=False'."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError, match=r"is not in the local Hugging Face cache .* and local_files_only=True "
                                             r"forbids downloading it; download it first") as info:
        load_svd("org/not-cached", local_files_only=True)
    assert "local_files_only=False" not in str(info.value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match=r"and HF_HUB_OFFLINE is set forbids downloading it"):
        load_svd("org/not-cached")


# ---------------------------------------------------------------------------------------------- images


@pytest.mark.parametrize("name", BUILTIN_IMAGES)
def test_builtin_images(name):
    image = load_image(f"builtin:{name}", (48, 32))
    assert image.mode == "RGB" and image.size == (48, 32)
    pixels = np.asarray(image, dtype=np.float32)
    assert pixels.std() > 10


def test_image_file_round_trip(tmp_path):
    pixels = np.random.default_rng().integers(0, 256, size=(24, 40, 3), dtype=np.uint8)
    path = tmp_path / "image.png"
    PIL.Image.fromarray(pixels).save(path)
    np.testing.assert_array_equal(np.asarray(load_image(path)), pixels)
    assert load_image(str(path), 16).size == (16, 16)


def test_bad_image_specs(tmp_path):
    with pytest.raises(ValueError, match="builtin:moon"):
        load_image("builtin:moon")
    missing = tmp_path / "missing.png"
    with pytest.raises(FileNotFoundError, match="missing.png"):
        load_image(missing)


# ---------------------------------------------------------------------------------------------- images: every mode
# Each case writes a real file, checks the mode PIL opens it in, and compares the RGB pixels load_image
# conditions on with the picture the file holds.

GRAD_W, GRAD_H = 64, 6


def _gradient(lo: float, hi: float, dtype) -> np.ndarray:
    """``(GRAD_H, GRAD_W)`` values from ``lo`` to ``hi`` along the width."""
    return np.linspace(lo, hi, GRAD_W)[None].repeat(GRAD_H, 0).astype(dtype)


def _scaled(values: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """``values`` mapped from ``[lo, hi]`` to 8 bits, as gray RGB."""
    gray = np.rint((values.astype(np.float64) - lo) * (255 / (hi - lo)))
    return np.repeat(gray[..., None], 3, axis=-1)


def _png16_rgb(path, rgb: np.ndarray) -> None:
    """A 16-bit RGB PNG, written by hand: PIL opens such files but cannot write them."""
    import struct
    import zlib

    height, width, _ = rgb.shape
    rows = b"".join(b"\x00" + row.astype(">u2").tobytes() for row in rgb)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
                     + chunk(b"IEND", b""))


def _composited(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """``rgb`` over a white background with ``alpha`` in [0, 255]."""
    a = alpha.astype(np.float64)[..., None] / 255
    return rgb.astype(np.float64) * a + 255 * (1 - a)


def _random_rgb(rng, shape=(GRAD_H, GRAD_W)) -> np.ndarray:
    return rng.integers(0, 256, size=(*shape, 3), dtype=np.uint8)


def _case_i16(tmp_path, rng):
    values = _gradient(0, 65535, np.uint16)
    path = tmp_path / "gray16.png"
    PIL.Image.fromarray(values).save(path)
    return path, "I;16", _scaled(values, 0, 65535), None


def _case_i16b(tmp_path, rng):
    values = _gradient(0, 65535, np.uint16)
    path = tmp_path / "gray16b.tif"
    PIL.Image.frombytes("I;16B", (GRAD_W, GRAD_H), values.astype(">u2").tobytes()).save(path)
    return path, "I;16B", _scaled(values, 0, 65535), None


def _case_12_bit(tmp_path, rng):
    import PIL.TiffImagePlugin

    values = _gradient(0, 4095, np.uint16)
    tags = PIL.TiffImagePlugin.ImageFileDirectory_v2()
    tags[281] = 4095  # MaxSampleValue: 12-bit data in 16-bit samples
    path = tmp_path / "gray12.tif"
    PIL.Image.fromarray(values).save(path, tiffinfo=tags)
    return path, "I;16", _scaled(values, 0, 4095), None


def _case_i32_16bit_values(tmp_path, rng):
    values = _gradient(0, 65535, np.int32)
    path = tmp_path / "gray32.tif"
    PIL.Image.fromarray(values).save(path)
    return path, "I", _scaled(values, 0, 65535), None


def _case_pgm16(tmp_path, rng):
    values = _gradient(0, 65535, np.int32)
    path = tmp_path / "gray16.pgm"
    PIL.Image.fromarray(values).save(path)
    return path, "I", _scaled(values, 0, 65535), None


def _case_i32_wide(tmp_path, rng):
    values = _gradient(-50_000, 150_000, np.int32)
    path = tmp_path / "wide32.tif"
    PIL.Image.fromarray(values).save(path)
    return path, "I", _scaled(values, -50_000, 150_000), "holds values in [-50000, 150000], outside [0, 65535]"


def _case_float_unit(tmp_path, rng):
    values = _gradient(0.0, 1.0, np.float32)
    path = tmp_path / "unit.tif"
    PIL.Image.fromarray(values).save(path)
    return path, "F", _scaled(values, 0, 1), None


def _case_float_wide(tmp_path, rng):
    values = _gradient(-3.0, 5.0, np.float32)
    path = tmp_path / "wide.tif"
    PIL.Image.fromarray(values).save(path)
    return path, "F", _scaled(values, -3, 5), "holds values in [-3, 5], outside [0, 1], and declares no range"


def _case_float_declared(tmp_path, rng):
    import PIL.TiffImagePlugin

    values = _gradient(-1.0, 3.0, np.float32)
    tags = PIL.TiffImagePlugin.ImageFileDirectory_v2()
    tags[340], tags[341] = -2.0, 6.0  # SMinSampleValue, SMaxSampleValue
    path = tmp_path / "declared.tif"
    PIL.Image.fromarray(values).save(path, tiffinfo=tags)
    return path, "F", _scaled(values, -2, 6), None


def _case_rgb16(tmp_path, rng):
    rgb = rng.integers(0, 65536, size=(GRAD_H, GRAD_W, 3)).astype(np.uint16)
    path = tmp_path / "rgb16.png"
    _png16_rgb(path, rgb)
    return path, "RGB", rgb / 257, None  # PIL keeps the high byte: within 1 of the rounded value


def _case_one_bit(tmp_path, rng):
    bits = rng.integers(0, 2, size=(GRAD_H, GRAD_W)).astype(bool)
    path = tmp_path / "bits.png"
    PIL.Image.fromarray(bits).save(path)
    return path, "1", np.repeat(bits[..., None] * 255.0, 3, axis=-1), None


def _case_gray(tmp_path, rng):
    gray = rng.integers(0, 256, size=(GRAD_H, GRAD_W)).astype(np.uint8)
    path = tmp_path / "gray.png"
    PIL.Image.fromarray(gray).save(path)
    return path, "L", np.repeat(gray[..., None], 3, axis=-1), None


def _palette(rng) -> tuple[PIL.Image.Image, np.ndarray]:
    """A 4-colour palette image and its RGB pixels."""
    colours = _random_rgb(rng, (4,))
    index = rng.integers(0, 4, size=(GRAD_H, GRAD_W)).astype(np.uint8)
    image = PIL.Image.fromarray(index, mode="L").convert("P")
    image.putpalette(colours.flatten().tolist())
    return image, colours[index]


def _case_palette(tmp_path, rng):
    image, rgb = _palette(rng)
    path = tmp_path / "palette.png"
    image.save(path)
    return path, "P", rgb, None


def _case_palette_transparency(tmp_path, rng):
    image, rgb = _palette(rng)
    index = np.asarray(image)
    path = tmp_path / "palette_trns.png"
    image.save(path, transparency=bytes([0, 128, 255, 255]))  # entry 0 transparent, entry 1 half
    alpha = np.array([0, 128, 255, 255])[index]
    return path, "P", _composited(rgb, alpha), "composited on a white background"


def _case_palette_alpha(tmp_path, rng):
    image, rgb = _palette(rng)
    alpha = rng.integers(0, 256, size=(GRAD_H, GRAD_W)).astype(np.uint8)
    pa = image.convert("PA")
    pa.putalpha(PIL.Image.fromarray(alpha))
    path = tmp_path / "palette_alpha.tif"
    pa.save(path)
    return path, "PA", _composited(rgb, alpha), "composited on a white background"


def _case_gray_alpha(tmp_path, rng):
    gray = rng.integers(0, 256, size=(GRAD_H, GRAD_W)).astype(np.uint8)
    alpha = rng.integers(0, 256, size=(GRAD_H, GRAD_W)).astype(np.uint8)
    path = tmp_path / "gray_alpha.png"
    PIL.Image.fromarray(np.stack([gray, alpha], axis=-1)).save(path)
    return path, "LA", _composited(np.repeat(gray[..., None], 3, axis=-1), alpha), "composited on a white"


def _case_rgba(tmp_path, rng):
    rgb = _random_rgb(rng)
    alpha = rng.integers(0, 256, size=(GRAD_H, GRAD_W)).astype(np.uint8)
    path = tmp_path / "rgba.png"
    PIL.Image.fromarray(np.concatenate([rgb, alpha[..., None]], axis=-1)).save(path)
    return path, "RGBA", _composited(rgb, alpha), "composited on a white background"


def _case_rgba_opaque(tmp_path, rng):
    rgb = _random_rgb(rng)
    path = tmp_path / "opaque.png"
    PIL.Image.fromarray(rgb).convert("RGBA").save(path)
    return path, "RGBA", rgb, None


_CMYK_COLOURS = {(0, 0, 0, 0): (255, 255, 255), (255, 0, 0, 0): (0, 255, 255), (0, 255, 0, 0): (255, 0, 255),
                 (0, 0, 255, 0): (255, 255, 0), (0, 255, 255, 0): (255, 0, 0), (0, 0, 0, 255): (0, 0, 0),
                 (0, 0, 0, 128): (127, 127, 127)}


def _case_cmyk(tmp_path, rng):
    cmyk, rgb = (np.array(list(side), dtype=np.uint8)[None] for side in zip(*_CMYK_COLOURS.items()))
    path = tmp_path / "cmyk.tif"
    PIL.Image.fromarray(cmyk, mode="CMYK").save(path)
    return path, "CMYK", rgb, None


def _case_ycbcr(tmp_path, rng):
    rgb = _random_rgb(rng)
    path = tmp_path / "ycbcr.tif"
    PIL.Image.fromarray(rgb).convert("YCbCr").save(path)
    return path, "YCbCr", rgb, None


SRGB_FROM_XYZ = np.array([[3.2404542, -1.5371385, -0.4985314], [-0.9692660, 1.8760108, 0.0415560],
                          [0.0556434, -0.2040259, 1.0572252]])
"""Linear sRGB from CIE XYZ (IEC 61966-2-1's primaries, D65)."""
D65 = np.array([0.95047, 1.0, 1.08883])
"""The D65 white's XYZ (TIFF 6.0's CIELAB white)."""


def _srgb_of_lab(lab: np.ndarray) -> np.ndarray:
    """8-bit sRGB of CIELAB colours (D65) by the CIE formulas, written here apart from the reader's scikit-image."""
    fy = (lab[..., 0] + 16) / 116
    f = np.stack([fy + lab[..., 1] / 500, fy, fy - lab[..., 2] / 200], axis=-1)
    xyz = np.where(f > 6 / 29, f ** 3, 3 * (6 / 29) ** 2 * (f - 4 / 29)) * D65
    linear = np.clip(xyz @ SRGB_FROM_XYZ.T, 0, 1)
    srgb = np.where(linear <= 0.0031308, 12.92 * linear, 1.055 * linear ** (1 / 2.4) - 0.055)
    return np.rint(srgb * 255)


def _case_lab(tmp_path, rng):
    """sRGB colours as 8-bit CIELAB (D65, TIFF's encoding: L* scaled to 255, a* and b* signed bytes): the picture
    it holds is the stored (quantised) colours, converted back here by the CIE formulas."""
    import skimage.color

    rgb = rng.integers(32, 224, size=(GRAD_H, GRAD_W, 3)).astype(np.uint8)
    lab = skimage.color.rgb2lab(rgb / 255, illuminant="D65")
    encoded = np.stack([np.rint(lab[..., 0] * 2.55).astype(np.uint8),
                        *(np.rint(lab[..., i]).astype(np.int8).view(np.uint8) for i in (1, 2))], axis=-1)
    path = tmp_path / "lab.tif"
    PIL.Image.frombytes("LAB", (GRAD_W, GRAD_H), encoded.tobytes()).save(path)
    stored = np.stack([encoded[..., 0] * (100 / 255), encoded[..., 1].view(np.int8), encoded[..., 2].view(np.int8)],
                      axis=-1).astype(np.float64)
    return path, "LAB", _srgb_of_lab(stored), None


IMAGE_CASES = {
    "I;16 png (16-bit gray)": (_case_i16, 0), "I;16B tiff": (_case_i16b, 0), "I;16 tiff, 12-bit": (_case_12_bit, 0),
    "I tiff, 16-bit values": (_case_i32_16bit_values, 0), "I pgm, 16-bit": (_case_pgm16, 0),
    "I tiff, wider range": (_case_i32_wide, 0), "F tiff in [0, 1]": (_case_float_unit, 0),
    "F tiff, wider range": (_case_float_wide, 0), "F tiff, declared range": (_case_float_declared, 0),
    "16-bit RGB png": (_case_rgb16, 1), "1-bit png": (_case_one_bit, 0), "L png": (_case_gray, 0),
    "P png": (_case_palette, 0), "P png, tRNS": (_case_palette_transparency, 0.5),
    "PA tiff": (_case_palette_alpha, 0.5), "LA png": (_case_gray_alpha, 0.5), "RGBA png": (_case_rgba, 0.5),
    "RGBA png, opaque": (_case_rgba_opaque, 0),
    "CMYK tiff": (_case_cmyk, 0), "YCbCr tiff": (_case_ycbcr, 3), "LAB tiff": (_case_lab, 1),
}
"""Case name -> (writer, largest |pixel - exact value| allowed).  Scaling rounds exactly (0: the same
rounded values); compositing rounds once (0.5); PIL reads 16-bit RGB by its high byte (below 1);
YCbCr rounds twice per channel through PIL's conversions (measured at most 3); CIELAB is compared with the
sRGB of the colours it stores, by another implementation of the same formulas (1: a value within float
rounding of a half level may round either way; PIL's own LAB conversion is off by up to 53).  (It was
compared with the colours before their 8-bit quantisation, at a tolerance of 8 set from measurements, which
a seed exceeded once.)"""


@pytest.mark.parametrize("case", IMAGE_CASES)
def test_every_image_mode_is_read_as_the_picture_it_holds(case, tmp_path, gen, caplog):
    write, atol = IMAGE_CASES[case]
    rng = np.random.default_rng(draw_seed(gen))
    path, mode, expected, notice = write(tmp_path, rng)
    with PIL.Image.open(path) as opened:
        assert opened.mode == mode
    with caplog.at_level("WARNING", logger="pasa_diffusers"):
        image = load_image(path)
    pixels = np.asarray(image).astype(np.float64)
    assert image.mode == "RGB" and pixels.shape == expected.shape
    assert np.abs(pixels - expected).max() <= atol
    notices = [record.getMessage() for record in caplog.records if record.name == "pasa_diffusers"]
    if notice is None:
        assert notices == []
    else:
        assert len(notices) == 1 and notices[0].startswith(f"load_image: {path} (mode {mode})") and notice in notices[0]


def test_a_16_bit_gradient_keeps_its_gradient(tmp_path):
    """The bug this guards against: PIL's convert clips 16-bit gray at 255, a near-white picture."""
    path = tmp_path / "gray16.png"
    PIL.Image.fromarray(_gradient(0, 65535, np.uint16)).save(path)
    with PIL.Image.open(path) as opened:
        assert (np.asarray(opened.convert("RGB")) == 255).mean() > 0.95  # what PIL alone gives
    row = np.asarray(load_image(path))[0, :, 0].astype(int)
    assert row[0] == 0 and row[-1] == 255 and (np.diff(row) > 0).all()  # 0 .. 255, strictly rising
    assert (np.asarray(load_image(path, (16, 8)))[..., 0] == 255).mean() < 0.2


def test_a_16_bit_transparent_value_is_composited(tmp_path, caplog):
    values = _gradient(0, 65535, np.uint16)
    path = tmp_path / "gray16_trns.png"
    PIL.Image.fromarray(values).save(path, transparency=0)
    with caplog.at_level("WARNING", logger="pasa_diffusers"):
        pixels = np.asarray(load_image(path)).astype(np.float64)
    expected = _scaled(values, 0, 65535)
    expected[values == 0] = 255
    assert np.array_equal(pixels, expected)
    assert f"{GRAD_H} of {GRAD_W * GRAD_H} pixels not opaque" in caplog.text


@pytest.mark.parametrize("values, message", [
    (np.where(np.arange(GRAD_W) == 3, np.nan, 0.5)[None].repeat(GRAD_H, 0),
     "mode F image holds 6 NaN or infinite value(s) of 384; no picture to read"),
    (np.full((GRAD_H, GRAD_W), np.inf), "mode F image holds 384 NaN or infinite value(s) of 384"),
    (np.full((GRAD_H, GRAD_W), 7.0), "mode F image holds the single value 7, outside [0, 1]; no range to scale it"),
])
def test_a_float_image_without_a_picture_is_refused(values, message, tmp_path):
    path = tmp_path / "bad.tif"
    PIL.Image.fromarray(values.astype(np.float32)).save(path)
    with pytest.raises(ImageError, match=rf"^load_image: spec='{re.escape(str(path))}': {re.escape(message)}"):
        load_image(str(path))


def test_exif_orientation_is_applied(tmp_path):
    rgb = _random_rgb(np.random.default_rng(0))
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    path = tmp_path / "rotated.png"
    PIL.Image.fromarray(rgb).save(path, exif=exif)
    np.testing.assert_array_equal(np.asarray(load_image(path)), np.rot90(rgb, k=-1))


def test_a_truncated_image_is_an_image_error(tmp_path):
    path = tmp_path / "cut.png"
    PIL.Image.fromarray(_random_rgb(np.random.default_rng(0))).save(path)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ImageError, match=r"not a readable image \((OSError|SyntaxError|EOFError)"):
        load_image(path)


# ---------------------------------------------------------------------------------------------- latents and generation


def test_make_latents(pipe, gen):
    seed = draw_seed(gen)
    latents = make_latents(pipe, num_frames=3, height=32, width=48, seed=seed)
    factor = pipe.vae_scale_factor
    assert latents.shape == (1, 3, pipe.unet.config.in_channels // 2, 32 // factor, 48 // factor)
    assert latents.dtype == torch.float32 and latents.device.type == "cpu"
    assert torch.equal(latents, make_latents(pipe, num_frames=3, height=32, width=48, seed=seed))
    assert not torch.equal(latents, make_latents(pipe, num_frames=3, height=32, width=48, seed=seed + 1))
    # unit noise: the pipeline scales it by init_noise_sigma (14.6 here) itself
    assert 0.8 < latents.std().item() < 1.2 and pipe.scheduler.init_noise_sigma > 2
    half = make_latents(pipe, num_frames=3, height=32, width=48, seed=seed, dtype=torch.float16)
    assert half.dtype == torch.float16 and torch.equal(half, latents.half())
    with pytest.raises(ValueError, match="height=30"):
        make_latents(pipe, num_frames=3, height=30, width=48, seed=seed)


def test_generate_is_deterministic_and_seeded(pipe, image, gen):
    seed = draw_seed(gen)
    latents = make_latents(pipe, num_frames=FRAMES, height=SIZE, width=SIZE, seed=seed)
    frames = run(pipe, image, latents, seed)
    assert_frames(frames)
    np.testing.assert_array_equal(frames, run(pipe, image, latents, seed))
    np.testing.assert_array_equal(frames, run(pipe, image, seed=seed))  # latents=None draws make_latents(seed)
    assert np.abs(run(pipe, image, seed=seed + 1) - frames).max() > 0.05
    assert np.abs(run(pipe, image, latents, seed + 1) - frames).max() > 1e-3  # noise augmentation is seeded too


def test_generate_matches_pipeline_np_output(pipe, image, gen):
    seed = draw_seed(gen)
    latents = make_latents(pipe, num_frames=3, height=SIZE, width=SIZE, seed=seed)
    frames = run(pipe, image, latents, seed, num_frames=3, decode_chunk_size=2)
    assert_frames(frames, num_frames=3)
    expected = pipe(
        image,
        height=SIZE,
        width=SIZE,
        num_frames=3,
        num_inference_steps=TINY_DEFAULTS["num_inference_steps"],
        max_guidance_scale=3.0,
        decode_chunk_size=2,
        generator=torch.Generator().manual_seed(seed),
        latents=latents,
        output_type="np",
    ).frames[0]
    np.testing.assert_array_equal(frames, expected)


@pytest.mark.parametrize(
    "backend, options, tol",
    [
        ("sdpa", {}, 0.0),  # the same fp32 SDPA call
        ("pasa", {"precision": "fp64"}, 1e-4),  # fp32 rounding, amplified by sigma ~ 14.6; measured 1.6e-5
        ("bf16", {}, 1e-2),  # bf16 attention; measured 8.5e-4
    ],
)
def test_backends_from_the_same_latents_are_close(pipe, image, backend, options, tol, gen):
    seed = draw_seed(gen)
    latents = make_latents(pipe, num_frames=FRAMES, height=SIZE, width=SIZE, seed=seed)
    I.apply(pipe, "fp32", vae=True)
    reference = run(pipe, image, latents, seed)
    I.restore(pipe)
    I.apply(pipe, backend, vae=True, **options)
    frames = run(pipe, image, latents, seed)
    assert_frames(frames)
    diff = np.abs(frames - reference).max()
    assert diff <= tol
    if backend == "bf16":
        assert diff > 0
    summary = I.fallback_summary(pipe)
    assert summary["processors"] == 26  # 24 UNet + 2 VAE attentions
    assert summary["calls"] > 0
    if backend == "pasa":
        # 2 steps x 12 cross-attentions; the VAE encoder attention (D=64) runs PASA
        assert summary["fallbacks"] == {"single key": 24}


def test_non_finite_values_survive_into_frames(pipe, image, gen):
    decoded = torch.rand(1, 3, 2, 4, 4, generator=gen) * 2 - 1
    decoded[0, 0, 0, 0, 0] = float("nan")
    decoded[0, 1, 0, 0, 1] = float("inf")
    decoded[0, 2, 1, 3, 3] = -float("inf")
    decoded[0, 0, 1, 2, 2] = 7.0
    frames = to_frames(decoded)
    assert frames.shape == (2, 4, 4, 3)
    assert np.isnan(frames[0, 0, 0, 0])
    assert frames[0, 0, 1, 1] == np.inf and frames[1, 3, 3, 2] == -np.inf
    assert frames[1, 2, 2, 0] == 1.0
    finite = np.isfinite(frames)
    assert finite.sum() == frames.size - 3 and frames[finite].min() >= 0 and frames[finite].max() <= 1

    class NaNAttnProcessor(P.CountedAttnProcessor):
        def attention(self, query, key, value, scale, attention_mask=None):
            return torch.full_like(query, float("nan"))

    pipe.unet.set_attn_processor(NaNAttnProcessor())
    assert np.isnan(run(pipe, image)).all()
