"""pasa_diffusers.pipelines.svd: the built-in pipelines, save/load through safetensors, explicit latents, frames,
images; and the names the pipelines take (``pipelines.names``).

Frames are pixels in [0, 1]; tolerances below are absolute pixel differences.
"""
from __future__ import annotations

import inspect
import shutil

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import UNetSpatioTemporalConditionModel
from diffusers.models.attention_processor import Attention

from pasa_diffusers import install as I
from pasa_diffusers import processors as P
from pasa_diffusers.pipelines.names import BUILTIN_IMAGES, BUILTIN_MODELS, is_hub_id
from pasa_diffusers.pipelines.svd import (
    ModelLoadError,
    TINY_DEFAULTS,
    _to_frames,
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
    with pytest.raises(ModelLoadError, match=r"^load_svd: cannot load model=.*: Error no file named "
                                             r"diffusion_pytorch_model.safetensors found in directory .*unet; save"):
        load_svd(str(folder))
    shutil.rmtree(folder / "unet")
    with pytest.raises(ModelLoadError, match=r"lacks the component folder\(s\) \['unet'\] that its model_index.json"):
        load_svd(str(folder))


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
    frames = _to_frames(decoded)
    assert frames.shape == (2, 4, 4, 3)
    assert np.isnan(frames[0, 0, 0, 0])
    assert frames[0, 0, 1, 1] == np.inf and frames[1, 3, 3, 2] == -np.inf
    assert frames[1, 2, 2, 0] == 1.0
    finite = np.isfinite(frames)
    assert finite.sum() == frames.size - 3 and frames[finite].min() >= 0 and frames[finite].max() <= 1

    class NaNAttnProcessor(P.CountedAttnProcessor):
        def attention(self, query, key, value, attn, attention_mask=None):
            return torch.full_like(query, float("nan"))

    pipe.unet.set_attn_processor(NaNAttnProcessor())
    assert np.isnan(run(pipe, image)).all()
