"""``svd-xt-random``: SVD-XT's full-size pipeline, built from diffusers' default configs, with random weights.

The components have the shapes of ``stabilityai/stable-video-diffusion-img2vid-xt`` (2.25 B parameters:
UNet 1.52 B, VAE 98 M, CLIP image encoder 632 M) and seeded random weights, so the commands, the
benchmarks and the GPU tests run at SVD-XT's real sizes without a download.  The weights are not
trained: the videos are not pictures, and attention's inputs do not carry the bias of the trained
checkpoint (``tiny-resonant`` plants that), so this model measures time and memory, not overflow.

Every component is built directly on ``device`` in ``dtype`` (torch's default device and dtype while it
is built), so a CUDA build never initialises 9 GB of float32 weights on the CPU.  The weights are drawn
by that device's generator from ``seed`` and the global generators are left as they were: the same
seed gives the same weights on one kind of device in one dtype, not across them.  To reuse one set of
weights, save it (``pasa save-model --model svd-xt-random DIR``, safetensors) and load the folder.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from diffusers import (
    AutoencoderKLTemporalDecoder,
    EulerDiscreteScheduler,
    StableVideoDiffusionPipeline,
    UNetSpatioTemporalConditionModel,
)
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

__all__ = ["build_svd_xt_random", "svd_xt_scheduler"]


@contextmanager
def _factory_defaults(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """New tensors default to ``device`` and ``dtype`` inside the block; the previous defaults come back after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(previous)


def _image_encoder() -> CLIPVisionModelWithProjection:
    """SVD-XT's CLIP ViT-H/14 image encoder."""
    return CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=1280,
        intermediate_size=5120,
        num_attention_heads=16,
        num_hidden_layers=32,
        patch_size=14,
        image_size=224,
        projection_dim=1024,
        hidden_act="gelu",
    ))


def svd_xt_scheduler() -> EulerDiscreteScheduler:
    """SVD-XT's scheduler config (the released ``scheduler_config.json``), shared by the built-in models."""
    return EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        interpolation_type="linear",
        num_train_timesteps=1000,
        prediction_type="v_prediction",
        sigma_max=700.0,
        sigma_min=0.002,
        steps_offset=1,
        timestep_spacing="leading",
        timestep_type="continuous",
        use_karras_sigmas=True,
    )


def build_svd_xt_random(*, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                        seed: int = 0) -> StableVideoDiffusionPipeline:
    """SVD-XT's pipeline with random weights drawn from ``seed``, on ``device`` in ``dtype``, in eval mode.

    The UNet is ``UNetSpatioTemporalConditionModel()`` (diffusers' default config is SVD-XT's), the VAE
    SVD-XT's temporal-decoder autoencoder, the image encoder SVD-XT's CLIP vision tower; the scheduler and
    the feature extractor are SVD-XT's.  ``device="meta"`` builds the shapes without any weight (tests).
    Its ``name_or_path`` is ``"svd-xt-random"``.
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"build_svd_xt_random: dtype must be a floating torch.dtype, got dtype={dtype!r}")
    device = torch.device(device)
    cuda_generators = list(range(torch.cuda.device_count())) if device.type == "cuda" else []  # manual_seed seeds all
    with torch.random.fork_rng(devices=cuda_generators), _factory_defaults(device, dtype):
        torch.manual_seed(seed)
        unet = UNetSpatioTemporalConditionModel()
        vae = AutoencoderKLTemporalDecoder(
            block_out_channels=(128, 256, 512, 512),
            layers_per_block=2,
            down_block_types=("DownEncoderBlock2D",) * 4,
            latent_channels=4,
            sample_size=768,
        )
        image_encoder = _image_encoder()
    # a few one-element parameters (the temporal mixers' mix_factor) come from torch.Tensor(), which takes
    # the default dtype but not the default device: moving them is all this .to() does
    models = [model.to(device).eval() for model in (unet, vae, image_encoder)]
    pipe = StableVideoDiffusionPipeline(
        unet=models[0],
        vae=models[1],
        image_encoder=models[2],
        scheduler=svd_xt_scheduler(),
        feature_extractor=CLIPImageProcessor(crop_size=224, size=224),
    )
    pipe.register_to_config(_name_or_path="svd-xt-random")
    return pipe
