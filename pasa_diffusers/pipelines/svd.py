"""Stable Video Diffusion: loading (hub id, local folder, built-in models) and generation from explicit latents.

Conditioning images are read by ``images.load_image`` (re-exported here): any mode PIL opens, as 8-bit RGB.

Every backend comparison starts from the same initial noise: ``make_latents`` draws it on the CPU from
a seed, ``generate`` hands it to the pipeline (which only scales it by ``init_noise_sigma``) together
with a CPU generator seeded alike for the noise augmentation of the conditioning image.  Frames come
back as float32 arrays in ``[0, 1]`` with non-finite values left in place, so an overflow stays
visible to the caller.
"""
from __future__ import annotations

import json
import logging
import math
from typing import Any

import huggingface_hub.constants
import numpy as np
import PIL.Image
import torch
from diffusers import (
    AutoencoderKLTemporalDecoder,
    StableVideoDiffusionPipeline,
    UNetSpatioTemporalConditionModel,
)
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

from .checkpoints import (ModelLoadError, cached_snapshot, check_local_folder, check_weights, check_weights_cover,
                          hub_unreachable, index_problem, state_dict_error)
from .images import load_image
from .quiet import quiet
from .names import BUILTIN_MODELS, BUILTIN_VIDEO_MODELS, TINY_VIDEO_PIPELINES
from .resonant import build_tiny_resonant
from .svd_xt_random import build_svd_xt_random, svd_xt_scheduler

__all__ = ["ModelLoadError", "load_svd", "load_image", "make_latents", "generate", "to_frames", "TINY_DEFAULTS"]

TINY_DEFAULTS: dict[str, int] = {"height": 32, "width": 32, "num_frames": 2, "num_inference_steps": 2}
"""Generation settings that run the tiny pipeline in about a second on two CPU cores."""


class _Fp32CastWarningFilter(logging.Filter):
    """diffusers' "There are modules in X that should be kept in float32: [...]" warning, at most once per
    message, and never with an empty list.

    ``ModelMixin.to`` (diffusers 0.42) logs it on every dtype cast, also when the model keeps no module in
    float32 (``_keep_in_fp32_modules`` is None or empty: the list it prints is ``[]`` and says nothing).
    SVD casts often: ``load_svd(dtype=...)`` casts each component, and the pipeline itself casts its fp16
    VAE to float32 and back around the image encoding (``force_upcast``).
    """

    _MARK = "that should be kept in float32: "

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self._MARK not in message:
            return True
        if message.partition(self._MARK)[2].startswith("[]") or message in self.seen:
            return False
        self.seen.add(message)
        return True


logging.getLogger("diffusers.models.modeling_utils").addFilter(_Fp32CastWarningFilter())


def _tiny_pipeline() -> StableVideoDiffusionPipeline:
    """diffusers' SVD test components, seeded like the test, in eval mode, with two changes.

    The UNet has 2 heads per attention (head dims 16 and 32, within the kernel's range), and the CLIP
    encoder reads 224 x 224 images in 14 x 14 patches: the pipeline resizes a PIL image to 224 x 224
    before CLIP, which the test's 32 x 32 encoder (fed tensors only) cannot take.  Eval mode is how
    ``from_pretrained`` leaves a model; built from configs they would be in training mode.  Its
    ``name_or_path`` is ``"tiny"``.
    """
    torch.manual_seed(0)
    unet = UNetSpatioTemporalConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=2,
        sample_size=32,
        in_channels=8,
        out_channels=4,
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
        cross_attention_dim=32,
        num_attention_heads=2,
        projection_class_embeddings_input_dim=96,
        addition_time_embed_dim=32,
    )
    scheduler = svd_xt_scheduler()
    torch.manual_seed(0)
    vae = AutoencoderKLTemporalDecoder(
        block_out_channels=[32, 64],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        latent_channels=4,
    )
    torch.manual_seed(0)
    image_encoder = CLIPVisionModelWithProjection(
        CLIPVisionConfig(
            hidden_size=32,
            projection_dim=32,
            num_hidden_layers=5,
            num_attention_heads=4,
            image_size=224,
            intermediate_size=37,
            patch_size=14,
        )
    )
    torch.manual_seed(0)
    feature_extractor = CLIPImageProcessor(crop_size=224, size=224)
    pipe = StableVideoDiffusionPipeline(
        vae=vae.eval(),
        image_encoder=image_encoder.eval(),
        unet=unet.eval(),
        scheduler=scheduler,
        feature_extractor=feature_extractor,
    )
    pipe.register_to_config(_name_or_path="tiny")
    return pipe


def _from_pretrained(model: str, *, dtype: torch.dtype, variant: str | None,
                     local_files_only: bool) -> StableVideoDiffusionPipeline:
    """``StableVideoDiffusionPipeline.from_pretrained`` from safetensors, its errors as ``ModelLoadError``."""
    folder = check_local_folder(model)
    cache = huggingface_hub.constants.HF_HUB_CACHE
    if folder is not None:
        check_weights(folder, "save the pipeline again with save_pretrained()")
    else:
        snapshot = cached_snapshot(model)
        offline = "local_files_only=True" if local_files_only else (
            "HF_HUB_OFFLINE is set" if huggingface_hub.constants.HF_HUB_OFFLINE else None)
        if snapshot is None and offline:
            raise ModelLoadError(
                f"load_svd: hub id model={model!r} is not in the local Hugging Face cache ({cache}) and "
                f"{offline} forbids downloading it; download it first (huggingface-cli download {model}) "
                "or pass a folder written by save_pretrained()"
            )
        if snapshot is not None:
            check_weights(snapshot, f"download it again (huggingface-cli download {model} --force-download)")
        elif (why := hub_unreachable()) is not None:
            raise ModelLoadError(
                f"load_svd: hub id model={model!r} is not in the local Hugging Face cache ({cache}) and could not be "
                f"downloaded ({why}); check the name and the network, or pass a folder written by save_pretrained()")
    saved = folder or cached_snapshot(model)
    if saved is not None:
        _check_index(model, json.loads((saved / "model_index.json").read_text()))
    try:
        pipe = StableVideoDiffusionPipeline.from_pretrained(
            model, dtype=dtype, variant=variant, use_safetensors=True, local_files_only=local_files_only
        )
    except RuntimeError as exc:
        error = state_dict_error("load_svd", model, exc)
        if error is None:
            raise
        raise error from exc
    except OSError as exc:
        if folder is None and cached_snapshot(model) is None:
            root: BaseException = exc  # the first error of the chain: e.g. the network's
            while root.__cause__ is not None or root.__context__ is not None:
                root = root.__cause__ or root.__context__
            detail = (str(root).splitlines() or ["no detail"])[0]
            raise ModelLoadError(
                f"load_svd: hub id model={model!r} is not in the local Hugging Face cache ({cache}) and could "
                f"not be downloaded ({type(root).__name__}: {detail}); check the name and the network, or pass "
                "a folder written by save_pretrained()"
            ) from exc
        fix = ("save the pipeline again with save_pretrained()" if folder is not None
               else f"download it again (huggingface-cli download {model})")
        detail = str(exc).splitlines()[0].rstrip(".")
        raise ModelLoadError(f"load_svd: cannot load model={model!r}: {detail}; {fix}") from exc
    saved = folder or cached_snapshot(model)
    if saved is not None:
        check_weights_cover(pipe, saved)
    return pipe


def _check_index(model: str, index: Any) -> None:
    """Refuse a ``model_index.json`` that names another pipeline class than SVD's, or components SVD cannot take."""
    name = index.get("_class_name") if isinstance(index, dict) else None
    if name != StableVideoDiffusionPipeline.__name__:
        video = ", ".join(cls for _, cls in TINY_VIDEO_PIPELINES.values())
        raise ModelLoadError(f"load_svd: model={model!r}: its model_index.json names the pipeline class {name!r}; "
                             f"expected StableVideoDiffusionPipeline (load_svd), or {video} (load_pipeline)")
    problem = index_problem(index, StableVideoDiffusionPipeline)
    if problem is not None:
        raise ModelLoadError(f"load_svd: model={model!r}: {problem}")


@quiet()
def load_svd(
    model: str = "tiny",
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    variant: str | None = None,
    local_files_only: bool = False,
) -> StableVideoDiffusionPipeline:
    """Load a Stable Video Diffusion pipeline onto ``device`` in ``dtype``.

    Args:
        model: a built-in model (``names.BUILTIN_MODELS``: ``"tiny"``, a small random pipeline built in
            code, reproducible, no download; ``"tiny-resonant"``, the tiny pipeline with FP16 overflow
            planted in known layers, ``pasa_diffusers.pipelines.resonant``; ``"svd-xt-random"``, SVD-XT's
            full-size pipeline with random weights, built on ``device`` in ``dtype``,
            ``pasa_diffusers.pipelines.svd_xt_random``), a hub id ``org/name`` such as
            ``"stabilityai/stable-video-diffusion-img2vid-xt"``, or a folder written by
            ``save_pretrained``.  Weights are read from safetensors only.
        device: where the pipeline runs.
        dtype: dtype of every component (e.g. ``torch.float16`` for the fully-FP16 study).
        variant: weight file variant of a hub id or folder (e.g. ``"fp16"``); not valid with a built-in model.
        local_files_only: never contact the hub (the cache or the folder must hold the files).

    What diffusers, transformers and huggingface_hub log and warn meanwhile is held back (``quiet``).

    Raises:
        ModelLoadError: the pipeline cannot be loaded; the message says why and what to do (a name that
            is neither a folder, a hub id nor a built-in model, a path that is not a saved pipeline, a hub
            id neither cached nor downloadable, a corrupt or truncated weight file, named).
    """
    if model in BUILTIN_VIDEO_MODELS:
        raise ModelLoadError(f"--model {model}: a video transformer pipeline, not SVD; load it with "
                             "pipelines.video.load_video (or load_pipeline, which takes either)")
    if model in BUILTIN_MODELS:
        if variant is not None:
            raise ValueError(f"load_svd: variant={variant!r} applies to a hub id or a folder, not to model={model!r}")
        if model == "svd-xt-random":
            return build_svd_xt_random(device=device, dtype=dtype)
        with torch.random.fork_rng(devices=[]):
            pipe = _tiny_pipeline()
            if model == "tiny-resonant":
                pipe = build_tiny_resonant(pipe)
            pipe = pipe.to(device)
        return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)
    pipe = _from_pretrained(model, dtype=dtype, variant=variant, local_files_only=local_files_only)
    return pipe.to(device)


def make_latents(
    pipe: StableVideoDiffusionPipeline,
    *,
    num_frames: int,
    height: int,
    width: int,
    seed: int,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The initial noise of one video, ``(1, F, C, height / s, width / s)`` with ``s = pipe.vae_scale_factor``.

    ``C = unet.config.in_channels // 2`` (the other half of the UNet input is the image latents).  The
    noise is a unit Gaussian drawn in float32 on the CPU from ``torch.Generator().manual_seed(seed)``,
    so it is the same on every device, then moved to ``device`` and cast to ``dtype`` (default: the
    UNet's).  It is *not* scaled: ``StableVideoDiffusionPipeline.prepare_latents`` multiplies given
    latents by ``scheduler.init_noise_sigma`` itself (and moves them, but does not cast them, hence
    the dtype here must be the pipeline's).
    """
    factor = pipe.vae_scale_factor
    multiple = math.lcm(8, factor)  # the pipeline's check_inputs asks for multiples of 8
    if height % multiple or width % multiple:
        raise ValueError(f"make_latents: height={height} and width={width} must be multiples of {multiple}")
    shape = (1, num_frames, pipe.unet.config.in_channels // 2, height // factor, width // factor)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    latents = torch.randn(shape, generator=generator, dtype=torch.float32)
    return latents.to(device=device or pipe.device, dtype=dtype or pipe.unet.dtype)


def to_frames(video: torch.Tensor) -> np.ndarray:
    """``(1, 3, F, H, W)`` decoder output in ``[-1, 1]`` -> ``(F, H, W, 3)`` float32 in ``[0, 1]``.

    The same map as the pipeline's ``output_type="np"`` (``(x / 2 + 0.5).clamp(0, 1)``) for finite
    values; non-finite values are kept as they are (the pipeline's clamp would turn +-inf into 1 or 0).
    """
    frames = video[0].permute(1, 2, 3, 0).float() * 0.5 + 0.5
    frames = torch.where(torch.isfinite(frames), frames.clamp(0, 1), frames)
    return frames.cpu().numpy()


def generate(
    pipe: StableVideoDiffusionPipeline,
    image: PIL.Image.Image,
    *,
    num_frames: int,
    num_inference_steps: int,
    seed: int,
    height: int,
    width: int,
    latents: torch.Tensor | None = None,
    min_guidance_scale: float = 1.0,
    max_guidance_scale: float = 3.0,
    decode_chunk_size: int | None = None,
    progress: bool = True,
    **kwargs: Any,
) -> np.ndarray:
    """Generate one video and return its frames, ``(num_frames, height, width, 3)`` float32 in ``[0, 1]``.

    Args:
        pipe: a pipeline from ``load_svd`` (with whatever attention processors are installed).
        image: the conditioning image (resized by the pipeline to ``height`` x ``width``).
        num_frames, num_inference_steps, height, width: as in ``StableVideoDiffusionPipeline.__call__``.
        seed: seeds the initial noise (when ``latents`` is None) and the noise augmentation.
        latents: explicit initial noise from ``make_latents`` (in the pipeline's dtype); pass the
            same tensor to compare attention backends from identical starting points.
        min_guidance_scale, max_guidance_scale: the per-frame guidance ramp (CFG is on when max > 1).
        decode_chunk_size: frames per VAE decode call (default: all frames at once).
        progress: show the pipeline's progress bar over the denoising steps.
        **kwargs: passed to the pipeline (e.g. ``fps``, ``motion_bucket_id``, ``noise_aug_strength``).

    NaN and +-inf produced anywhere in the pipeline survive into the returned frames: the latents are
    decoded with the pipeline's own ``decode_latents`` and mapped to ``[0, 1]`` without clamping
    non-finite values.
    """
    if latents is None:
        latents = make_latents(pipe, num_frames=num_frames, height=height, width=width, seed=seed)
    decode_chunk_size = decode_chunk_size or num_frames
    previous_config = getattr(pipe, "_progress_bar_config", {})
    pipe.set_progress_bar_config(**{**previous_config, "disable": not progress})
    try:
        final_latents = pipe(
            image,
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            min_guidance_scale=min_guidance_scale,
            max_guidance_scale=max_guidance_scale,
            decode_chunk_size=decode_chunk_size,
            generator=torch.Generator(device="cpu").manual_seed(seed),
            latents=latents,
            output_type="latent",
            **kwargs,
        ).frames
    finally:
        pipe.set_progress_bar_config(**previous_config)
    with torch.no_grad():
        video = pipe.decode_latents(final_latents, num_frames, decode_chunk_size)
    return to_frames(video)
