"""Video-transformer pipelines (Wan so far): loading (built-in, hub id, folder) and generation from explicit latents,
and the one place where an SVD pipeline and a video-transformer pipeline are told apart.

Text encoders and tokenizers are never loaded: their files cannot be fetched offline, and comparing
attention backends or diagnosing overflow needs the same conditioning in every run, not a particular
prompt.  Every generation gets fixed prompt embeddings instead (``prompt_embeddings``): two unit Gaussians
drawn on the CPU from one generator seeded with ``PROMPT_SEED`` (the prompt's, then the negative prompt's), of
the text encoder's width (the transformer's ``text_dim``) and of the length the pipeline pads a prompt to
(its ``max_sequence_length`` default: 512 for Wan).  A real prompt's embeddings have other statistics:
say ``NOTICE`` wherever a result is reported.

Like ``svd.generate``, ``generate`` starts from explicit initial noise (``make_latents``, drawn on the CPU
from the seed), decodes the final latents itself and returns frames as float32 ``(F, H, W, 3)`` in
``[0, 1]`` with non-finite values left in place, so an overflow stays visible.
"""
from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import huggingface_hub
import numpy as np
import PIL.Image
import torch
from diffusers import DiffusionPipeline, UniPCMultistepScheduler, WanPipeline

from . import svd
from .names import BUILTIN_VIDEO_MODELS, TINY_VIDEO_SETTINGS, is_hub_id
from .svd import ModelLoadError
from .video_dits import tiny_transformer, tiny_wan_vae

__all__ = ["VIDEO_PIPELINES", "NOTICE", "PROMPT_SEED", "load_video", "load_pipeline",
           "is_video_pipeline", "denoiser", "default_settings", "setting_problem", "prompt_embeddings",
           "make_latents", "generate", "generate_frames"]

VIDEO_PIPELINES: dict[str, str] = {"WanPipeline": "wan"}
"""Pipeline class name -> family (``video_dits.FAMILIES``) of the text-to-video pipelines served here."""

NOTICE = "text encoder replaced by fixed prompt embeddings"
"""What every result of a video-transformer pipeline says about its conditioning."""

PROMPT_SEED = 0

_TEXT_WIDTH = {"wan": "text_dim"}
"""Family -> the transformer config field holding the text encoder's width."""


def _tiny_wan() -> WanPipeline:
    """Wan 2.1's text-to-video pipeline at tiny sizes: ``video_dits``' tiny transformer and VAE, and Wan 2.1's
    scheduler (UniPC on flow-matching sigmas, shift 3); no tokenizer, no text encoder."""
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return WanPipeline(tokenizer=None, text_encoder=None, vae=tiny_wan_vae(), scheduler=scheduler,
                       transformer=tiny_transformer("wan"))


_BUILDERS: dict[str, Callable[[], DiffusionPipeline]] = {"tiny-wan": _tiny_wan}
"""Built-in video model name (``names.BUILTIN_VIDEO_MODELS``) -> its builder."""


def _cast(pipe: DiffusionPipeline, dtype: torch.dtype) -> DiffusionPipeline:
    """``pipe`` in ``dtype`` as ``from_pretrained(torch_dtype=dtype)`` leaves it: the modules a model keeps in
    float32 (``_keep_in_fp32_modules``) stay float32 (cast as ``torch.nn.Module``, without diffusers' warning
    about them)."""
    for component in pipe.components.values():
        if not isinstance(component, torch.nn.Module):
            continue
        torch.nn.Module.to(component, dtype)
        keep = set(getattr(component, "_keep_in_fp32_modules", None) or ())
        for name, tensor in [*component.named_parameters(), *component.named_buffers()]:
            if keep & set(name.split(".")):
                tensor.data = tensor.data.float()
    return pipe


def _class_name(model: str, local_files_only: bool) -> str | None:
    """The pipeline class a folder or hub id holds (``model_index.json``'s ``_class_name``), or ``None``
    where it cannot be read (the SVD loader then gives its own answer)."""
    path = Path(model).expanduser()
    try:
        if path.is_dir():
            index = path / "model_index.json"
        elif is_hub_id(model):
            cached = huggingface_hub.try_to_load_from_cache(model, "model_index.json")
            index = Path(cached if isinstance(cached, str) else
                         huggingface_hub.hf_hub_download(model, "model_index.json", local_files_only=local_files_only))
        else:
            return None
        return json.loads(index.read_text()).get("_class_name")
    except (OSError, ValueError):  # HFValidationError is a ValueError
        return None


def load_video(model: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               local_files_only: bool = False) -> DiffusionPipeline:
    """Load a video-transformer pipeline (``VIDEO_PIPELINES``) without its tokenizer and text encoder.

    Args:
        model: a built-in model (``names.BUILTIN_VIDEO_MODELS``: ``"tiny-wan"``, built in code, seeded, no
            download), a hub id ``org/name`` (e.g. ``"Wan-AI/Wan2.1-T2V-1.3B-Diffusers"``) or a folder written
            by ``save_pretrained``; weights are read from safetensors only.
        device, dtype: where and in which dtype the pipeline runs (modules a model keeps in float32 stay so).
        local_files_only: never contact the hub.

    Raises:
        ModelLoadError: the pipeline cannot be loaded (the message says why and what to do).
    """
    if model in _BUILDERS:
        with torch.random.fork_rng(devices=[]):
            pipe = _BUILDERS[model]()
        pipe.register_to_config(_name_or_path=model)
        pipe = pipe.to(device)
        return pipe if dtype == torch.float32 else _cast(pipe, dtype)
    try:
        pipe = DiffusionPipeline.from_pretrained(model, dtype=dtype, use_safetensors=True,
                                                 local_files_only=local_files_only, tokenizer=None, text_encoder=None)
    except (OSError, ValueError) as exc:
        detail = (str(exc).splitlines() or ["no detail"])[0].rstrip(".")
        hint = ("; loading a model that keeps modules in float32 needs the package accelerate (pip install "
                "accelerate)" if "low_cpu_mem_usage" in detail else "")
        raise ModelLoadError(f"load_video: cannot load model={model!r}: {detail}{hint}") from exc
    return pipe.to(device)


def load_pipeline(model: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                  local_files_only: bool = False) -> DiffusionPipeline:
    """An SVD pipeline (``svd.load_svd``) or a video-transformer pipeline (``load_video``), by what ``model``
    is: a built-in video model's name, or a folder or hub id whose ``model_index.json`` names one of
    ``VIDEO_PIPELINES``, loads with ``load_video``; everything else with ``load_svd``, unchanged."""
    if model in BUILTIN_VIDEO_MODELS or _class_name(model, local_files_only) in VIDEO_PIPELINES:
        return load_video(model, device=device, dtype=dtype, local_files_only=local_files_only)
    return svd.load_svd(model, device=device, dtype=dtype, local_files_only=local_files_only)


def is_video_pipeline(pipe: Any) -> bool:
    """Whether ``pipe`` is one of ``VIDEO_PIPELINES`` (else it is taken for SVD)."""
    return type(pipe).__name__ in VIDEO_PIPELINES


def denoiser(pipe: DiffusionPipeline) -> torch.nn.Module:
    """The model whose attention a run diagnoses: a video pipeline's transformer, SVD's UNet."""
    return pipe.transformer if is_video_pipeline(pipe) else pipe.unet


def _call_default(pipe: DiffusionPipeline, name: str) -> Any:
    return inspect.signature(type(pipe).__call__).parameters[name].default


def default_settings(pipe: DiffusionPipeline) -> dict[str, int]:
    """``num_frames``, ``height`` and ``width`` of a video pipeline: ``names.TINY_VIDEO_SETTINGS`` for a built-in
    one, else the pipeline's own call defaults (Wan: 81 frames of 480 x 832)."""
    if pipe.name_or_path in BUILTIN_VIDEO_MODELS:
        return dict(TINY_VIDEO_SETTINGS)
    return {name: _call_default(pipe, name) for name in ("num_frames", "height", "width")}


def setting_problem(pipe: DiffusionPipeline, *, num_frames: int, height: int, width: int) -> tuple[str, str] | None:
    """``(argument, why)`` for the first of ``num_frames``, ``height``, ``width`` that the video pipeline would
    silently round (Wan: ``num_frames = 4k + 1``, its VAE compressing time 4x; sizes multiples of the VAE's
    spatial factor times the patch size, 16), or ``None``."""
    temporal, spatial = pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial
    multiple = spatial * pipe.transformer.config.patch_size[1]
    if (num_frames - 1) % temporal:
        return "num_frames", (f"{type(pipe).__name__} takes {temporal}k + 1 frames (its VAE compresses time "
                              f"{temporal}x), got {num_frames}")
    for name, value in (("height", height), ("width", width)):
        if value % multiple:
            return name, (f"{type(pipe).__name__} takes multiples of {multiple} (VAE {spatial}x, patch "
                          f"{multiple // spatial}), got {value}")
    return None


def prompt_embeddings(pipe: DiffusionPipeline) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed ``(prompt_embeds, negative_prompt_embeds)`` of a video pipeline, each ``(1, L, width)`` (see
    the module docstring), on the pipeline's device in its transformer's dtype."""
    transformer = pipe.transformer
    width = getattr(transformer.config, _TEXT_WIDTH[VIDEO_PIPELINES[type(pipe).__name__]])
    length = _call_default(pipe, "max_sequence_length")
    generator = torch.Generator(device="cpu").manual_seed(PROMPT_SEED)
    positive, negative = torch.randn(2, 1, length, width, generator=generator)
    return tuple(x.to(device=pipe.device, dtype=transformer.dtype) for x in (positive, negative))


def make_latents(pipe: DiffusionPipeline, *, num_frames: int, height: int, width: int, seed: int) -> torch.Tensor:
    """The initial noise of one video, ``(1, C, (num_frames - 1) / t + 1, height / s, width / s)`` (``t``, ``s``:
    the VAE's temporal and spatial factors), a unit Gaussian drawn in float32 on the CPU from ``seed``: the
    same on every device.  Wan's pipeline takes it as it is (float32 latents, no noise scaling)."""
    shape = (1, pipe.transformer.config.in_channels, (num_frames - 1) // pipe.vae_scale_factor_temporal + 1,
             height // pipe.vae_scale_factor_spatial, width // pipe.vae_scale_factor_spatial)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(pipe.device)


@torch.no_grad()
def _decode(pipe: DiffusionPipeline, latents: torch.Tensor) -> torch.Tensor:
    """Wan's final latents -> ``(1, 3, F, H, W)`` in ``[-1, 1]``: un-normalised as the pipeline does, then the
    VAE, without the pipeline's post-processing (its clamp turns +-inf into 1 or 0)."""
    vae = pipe.vae
    config = vae.config
    latents = latents.to(vae.dtype)
    mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents)
    std = torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents)
    return vae.decode(latents * std + mean, return_dict=False)[0]


def generate(pipe: DiffusionPipeline, *, num_frames: int, num_inference_steps: int, seed: int, height: int,
             width: int, latents: torch.Tensor | None = None, guidance_scale: float | None = None,
             progress: bool = True, **kwargs: Any) -> np.ndarray:
    """Generate one video from the fixed prompt embeddings; return its frames, ``(num_frames, height, width, 3)``
    float32 in ``[0, 1]`` (non-finite values kept).

    Args:
        pipe: a pipeline from ``load_video`` (with whatever attention processors are installed).
        num_frames, num_inference_steps, height, width: as in the pipeline's ``__call__``; a value it would
            round is a ``ValueError`` (``setting_problem``).
        seed: seeds the initial noise (when ``latents`` is None) and the pipeline's generator.
        latents: explicit initial noise from ``make_latents``.
        guidance_scale: classifier-free guidance (default: the pipeline's, Wan 5.0).
        progress: show the pipeline's progress bar over the denoising steps.
        **kwargs: passed to the pipeline (e.g. ``callback_on_step_end``).
    """
    problem = setting_problem(pipe, num_frames=num_frames, height=height, width=width)
    if problem is not None:
        raise ValueError(f"generate: {problem[0]}: {problem[1]}")
    if latents is None:
        latents = make_latents(pipe, num_frames=num_frames, height=height, width=width, seed=seed)
    positive, negative = prompt_embeddings(pipe)
    previous_config = getattr(pipe, "_progress_bar_config", {})
    pipe.set_progress_bar_config(**{**previous_config, "disable": not progress})
    try:
        final_latents = pipe(
            prompt_embeds=positive, negative_prompt_embeds=negative, height=height, width=width, num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=_call_default(pipe, "guidance_scale") if guidance_scale is None else guidance_scale,
            generator=torch.Generator(device="cpu").manual_seed(seed), latents=latents, output_type="latent",
            **kwargs,
        ).frames
    finally:
        pipe.set_progress_bar_config(**previous_config)
    return svd.to_frames(_decode(pipe, final_latents))


def generate_frames(pipe: DiffusionPipeline, image: PIL.Image.Image | None, *, num_frames: int,
                    num_inference_steps: int, seed: int, height: int, width: int, progress: bool = True,
                    **kwargs: Any) -> np.ndarray:
    """One video from either kind of pipeline: ``generate`` (text to video, ``image`` unused) for a video
    transformer, ``svd.generate`` (animating ``image``) for SVD."""
    settings = {"num_frames": num_frames, "num_inference_steps": num_inference_steps, "seed": seed,
                "height": height, "width": width, "progress": progress, **kwargs}
    if is_video_pipeline(pipe):
        return generate(pipe, **settings)
    return svd.generate(pipe, image, **settings)
