"""Video-transformer pipelines (Wan, LTX-Video, CogVideoX, HunyuanVideo, Mochi): loading (built-in, hub id, folder)
and generation from explicit latents, and the one place where an SVD pipeline and a video-transformer pipeline
are told apart.

Text encoders and tokenizers are never loaded: their files cannot be fetched offline, and comparing
attention backends or diagnosing overflow needs the same conditioning in every run, not a particular
prompt.  Every generation gets fixed prompt embeddings instead (``prompt_embeddings``): two unit Gaussians
drawn on the CPU from one generator seeded with ``PROMPT_SEED`` (the prompt's, then the negative prompt's), of
the text encoder's width (``_TEXT_WIDTH``: Wan's ``text_dim``, LTX-Video's ``caption_channels``, CogVideoX's,
HunyuanVideo's and Mochi's ``text_embed_dim``) and of the length the pipeline pads a prompt to (its
``max_sequence_length`` default: 512 for Wan, 128 for LTX-Video, 256 for HunyuanVideo and Mochi; CogVideoX adds
positional embeddings to a fixed number of text tokens, its transformer's ``max_text_seq_length``: 226 in the
released models).  HunyuanVideo also takes pooled embeddings (its CLIP text encoder's): two more unit Gaussians
of its transformer's ``pooled_projection_dim`` (768 released), drawn next from the same generator
(``pooled_prompt_embeddings``).  LTX-Video, HunyuanVideo and Mochi also take the prompts' attention masks: every
token kept (``prompt_attention_masks``).  A real prompt's embeddings have other statistics: say ``NOTICE``
wherever a result is reported.

Like ``svd.generate``, ``generate`` starts from explicit initial noise (``make_latents``, drawn on the CPU
from the seed, in the layout each pipeline takes: Wan, LTX-Video, HunyuanVideo and Mochi ``(B, C, F, H, W)``,
LTX-Video's then packed into tokens, CogVideoX ``(B, F, C, H, W)``), decodes the final latents itself as its
pipeline does and returns frames as float32 ``(F, H, W, 3)`` in ``[0, 1]`` with non-finite values left in place,
so an overflow stays visible.
"""
from __future__ import annotations

import inspect
import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import diffusers
import huggingface_hub
import numpy as np
import PIL.Image
import torch
from diffusers import (CogVideoXDDIMScheduler, CogVideoXPipeline, DiffusionPipeline, FlowMatchEulerDiscreteScheduler,
                       HunyuanVideoPipeline, LTXPipeline, MochiPipeline, ModelMixin, UniPCMultistepScheduler,
                       WanPipeline)
from diffusers.utils import is_accelerate_available

from pasa_diffusers.video_masks import VideoTokens

from . import svd
from .checkpoints import (ModelLoadError, cached_snapshot, check_local_folder, check_weights, check_weights_cover,
                          hub_unreachable, index_problem, state_dict_error)
from .names import BUILTIN_VIDEO_MODELS, TINY_VIDEO_SETTINGS, is_hub_id
from .quiet import quiet
from .sparse import sparse_bound
from .video_dits import (JOINT_FAMILIES, JOINT_TEXT_AT, tiny_cogvideox_vae, tiny_hunyuan_video_vae,
                         tiny_ltx_video_vae, tiny_mochi_vae, tiny_transformer, tiny_wan_vae)

__all__ = ["VIDEO_PIPELINES", "NOTICE", "PROMPT_SEED", "SETTINGS_KEY", "load_video", "load_pipeline",
           "is_video_pipeline", "is_video_model", "denoiser", "most_keys", "JOINT_FAMILIES", "JOINT_TEXT_AT",
           "token_grid", "self_attention_text", "self_attention_tokens", "default_settings", "setting_problem", "prompt_embeddings",
           "pooled_prompt_embeddings", "prompt_attention_masks", "make_latents", "generate", "generate_frames"]

VIDEO_PIPELINES: dict[str, str] = {"WanPipeline": "wan", "LTXPipeline": "ltx-video", "CogVideoXPipeline": "cogvideox",
                                   "HunyuanVideoPipeline": "hunyuan-video", "MochiPipeline": "mochi"}
"""Pipeline class name -> family (``video_dits.FAMILIES``) of the text-to-video pipelines served here."""

NOTICE = "text encoder replaced by fixed prompt embeddings"
"""What every result of a video-transformer pipeline says about its conditioning."""

PROMPT_SEED = 0

SETTINGS_KEY = "_pasa_default_settings"
"""The pipeline config entry (``model_index.json``) holding the frames and size a built-in model's commands default
to (``names.TINY_VIDEO_SETTINGS``): ``save_pretrained`` writes it and ``load_video`` reads it back, so a saved
tiny model keeps its small defaults."""

_TEXT_WIDTH = {"wan": "text_dim", "ltx-video": "caption_channels", "cogvideox": "text_embed_dim",
               "hunyuan-video": "text_embed_dim", "mochi": "text_embed_dim"}
"""Family -> the transformer config field holding the text encoder's width."""

_POOLED_WIDTH = {"hunyuan-video": "pooled_projection_dim"}
"""Family -> the transformer config field holding the width of the pooled prompt embeddings its pipeline takes."""

_MASKED = ("ltx-video", "hunyuan-video", "mochi")
"""The families whose pipelines take the prompts' attention masks with their embeddings."""


class _NoneComponentFilter(logging.Filter):
    """Drops diffusers' ``self.text_encoder=None of type <class 'NoneType'> cannot be saved.`` (``save_pretrained``,
    diffusers 0.42): the components left out on purpose (tokenizer, text encoder) are written as ``null`` in
    ``model_index.json`` and loaded back as ``None``; nothing is lost."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().endswith(f"=None of type {type(None)} cannot be saved.")


logging.getLogger("diffusers.pipelines.pipeline_utils").addFilter(_NoneComponentFilter())


def _tiny_wan() -> WanPipeline:
    """Wan 2.1's text-to-video pipeline at tiny sizes: ``video_dits``' tiny transformer and VAE, and Wan 2.1's
    scheduler (UniPC on flow-matching sigmas, shift 3); no tokenizer, no text encoder."""
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return WanPipeline(tokenizer=None, text_encoder=None, vae=tiny_wan_vae(), scheduler=scheduler,
                       transformer=tiny_transformer("wan"))


def _tiny_ltx_video() -> LTXPipeline:
    """LTX-Video's text-to-video pipeline at tiny sizes: ``video_dits``' tiny transformer and VAE (its decoder
    conditioned on the decode timestep), and LTX-Video's scheduler (flow-matching Euler, its shift growing with
    the video's token count, sigmas stretched to end at 0.1); no tokenizer, no text encoder."""
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)
    return LTXPipeline(scheduler=scheduler, vae=tiny_ltx_video_vae(), text_encoder=None, tokenizer=None,
                       transformer=tiny_transformer("ltx-video"))


def _tiny_cogvideox() -> CogVideoXPipeline:
    """CogVideoX's text-to-video pipeline at tiny sizes: ``video_dits``' tiny transformer (7 text tokens) and VAE,
    and CogVideoX-2B's scheduler (DDIM with v-prediction, zero terminal SNR, trailing timesteps); no tokenizer, no
    text encoder."""
    scheduler = CogVideoXDDIMScheduler(clip_sample=False, prediction_type="v_prediction", rescale_betas_zero_snr=True,
                                       timestep_spacing="trailing")
    return CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=tiny_cogvideox_vae(),
                             transformer=tiny_transformer("cogvideox"), scheduler=scheduler)


def _tiny_hunyuan_video() -> HunyuanVideoPipeline:
    """HunyuanVideo's text-to-video pipeline at tiny sizes: ``video_dits``' tiny transformer (guidance embedded, one
    text-refiner, one dual-stream and one single-stream block) and VAE, and HunyuanVideo's scheduler (flow-matching
    Euler, shift 7); no tokenizers, no text encoders (neither the Llama one nor CLIP)."""
    return HunyuanVideoPipeline(text_encoder=None, tokenizer=None, transformer=tiny_transformer("hunyuan-video"),
                                vae=tiny_hunyuan_video_vae(), scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
                                text_encoder_2=None, tokenizer_2=None)


def _tiny_mochi() -> MochiPipeline:
    """Mochi 1's text-to-video pipeline at tiny sizes: ``video_dits``' tiny transformer and VAE, and Mochi's scheduler
    (flow-matching Euler with inverted sigmas: Mochi's transformer reads timestep 0 as pure noise); no tokenizer,
    no text encoder."""
    return MochiPipeline(scheduler=FlowMatchEulerDiscreteScheduler(invert_sigmas=True), vae=tiny_mochi_vae(),
                         text_encoder=None, tokenizer=None, transformer=tiny_transformer("mochi"))


_BUILDERS: dict[str, Callable[[], DiffusionPipeline]] = {
    "tiny-wan": _tiny_wan, "tiny-ltx-video": _tiny_ltx_video, "tiny-cogvideox": _tiny_cogvideox,
    "tiny-hunyuan-video": _tiny_hunyuan_video, "tiny-mochi": _tiny_mochi,
}
"""Built-in video model name (``names.BUILTIN_VIDEO_MODELS``) -> its builder."""


def _cast_module(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``module`` in ``dtype`` as ``from_pretrained(torch_dtype=dtype)`` leaves it: the modules a model keeps in
    float32 (``_keep_in_fp32_modules``) stay float32 (cast as ``torch.nn.Module``, without diffusers' warning
    about them)."""
    torch.nn.Module.to(module, dtype)
    keep = set(getattr(module, "_keep_in_fp32_modules", None) or ())
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if keep & set(name.split(".")):
            tensor.data = tensor.data.float()
    return module


def _cast(pipe: DiffusionPipeline, dtype: torch.dtype) -> DiffusionPipeline:
    """``pipe`` with every model component cast by ``_cast_module``."""
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            _cast_module(component, dtype)
    return pipe


def _pipeline_class(index: dict[str, Any]) -> type[DiffusionPipeline]:
    """The pipeline class ``index`` (a ``model_index.json``) names, or ``DiffusionPipeline`` where it names none
    (``from_pretrained`` then gives its own answer).  Loading through the class itself matters: diffusers 0.42
    takes a component passed to ``DiffusionPipeline.from_pretrained`` only where it is a required argument of the
    class, which Wan's transformers are not."""
    cls = getattr(diffusers, str(index.get("_class_name")), None)
    return cls if isinstance(cls, type) and issubclass(cls, DiffusionPipeline) else DiffusionPipeline


def _left_out(cls: type[DiffusionPipeline]) -> dict[str, None]:
    """``None`` for every tokenizer and text encoder the pipeline class takes (HunyuanVideo has two of each), as
    ``from_pretrained`` keyword arguments; Wan's two where the class is unknown."""
    names = (("tokenizer", "text_encoder") if cls is DiffusionPipeline
             else inspect.signature(cls.__init__).parameters)
    return {name: None for name in names if name.startswith(("tokenizer", "text_encoder"))}


def _fp32_kept_components(model: str, index: dict[str, Any], dtype: torch.dtype,
                          local_files_only: bool) -> dict[str, torch.nn.Module]:
    """The components of ``index`` whose model class keeps modules in float32 (``_keep_in_fp32_modules``: Wan's
    transformers), loaded here when the package ``accelerate`` is missing, else none.

    Without ``accelerate`` diffusers 0.42 loads with ``low_cpu_mem_usage=False``, which it refuses for such a class
    ("`low_cpu_mem_usage` cannot be False when `keep_in_fp32_modules` is True").  Each one is therefore read here
    as a subclass without the list, in float32 (every stored dtype converts exactly), then given its own class back
    and cast by ``_cast_module``: the same tensors as ``from_pretrained(torch_dtype=dtype)`` with ``accelerate``.
    At full size that costs float32's memory while loading: install ``accelerate`` for large models."""
    if is_accelerate_available():
        return {}
    loaded = {}
    for name, entry in index.items():
        cls = getattr(diffusers, entry[1], None) if isinstance(entry, list) and isinstance(entry[-1], str) else None
        if not (isinstance(cls, type) and issubclass(cls, ModelMixin) and cls._keep_in_fp32_modules):
            continue
        plain = type(cls.__name__, (cls,), {"_keep_in_fp32_modules": None})
        with torch.random.fork_rng(devices=[]):  # its random initialisation, before the weights are read
            module = plain.from_pretrained(model, subfolder=name, dtype=torch.float32, use_safetensors=True,
                                           local_files_only=local_files_only)
        module.__class__ = cls
        loaded[name] = _cast_module(module, dtype)
    return loaded


def _model_index(model: str, local_files_only: bool) -> dict[str, Any] | None:
    """A folder's or hub id's ``model_index.json``, or ``None`` where it cannot be read (the SVD loader then gives
    its own answer)."""
    path = Path(model).expanduser()
    try:
        if path.is_dir():
            index = path / "model_index.json"
        elif is_hub_id(model):
            cached = huggingface_hub.try_to_load_from_cache(model, "model_index.json")
            if not isinstance(cached, str) and not local_files_only and hub_unreachable() is not None:
                return None  # not retried five times: the loader says why in one line
            index = Path(cached if isinstance(cached, str) else
                         huggingface_hub.hf_hub_download(model, "model_index.json", local_files_only=local_files_only))
        else:
            return None
        return json.loads(index.read_text())
    except (OSError, ValueError):  # HFValidationError is a ValueError
        return None


_NOT_LOADED = ("tokenizer", "text_encoder")
"""The components a video pipeline is loaded without (their names start so; HunyuanVideo has two of each)."""


def _check_index(model: str, index: Any) -> None:
    """Refuse a ``model_index.json`` that names no video pipeline of ``VIDEO_PIPELINES``, or components of another
    family than the pipeline it names (``checkpoints.index_problem``)."""
    name = index.get("_class_name") if isinstance(index, dict) else None
    if name not in VIDEO_PIPELINES:
        raise ModelLoadError(f"load_video: model={model!r}: its model_index.json names the pipeline class {name!r}; "
                             f"expected {', '.join(VIDEO_PIPELINES)} (load_video), or StableVideoDiffusionPipeline "
                             "(load_pipeline)")
    problem = index_problem(index, getattr(diffusers, name), left_out=_NOT_LOADED)
    if problem is not None:
        raise ModelLoadError(f"load_video: model={model!r}: {problem}")


def _class_name(model: str, local_files_only: bool) -> str | None:
    """The pipeline class a folder or hub id holds (``model_index.json``'s ``_class_name``), or ``None``."""
    index = _model_index(model, local_files_only)
    return index.get("_class_name") if isinstance(index, dict) else None


@quiet()
def load_video(model: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               local_files_only: bool = False) -> DiffusionPipeline:
    """Load a video-transformer pipeline (``VIDEO_PIPELINES``) without its tokenizer and text encoder.

    Args:
        model: a built-in model (``names.BUILTIN_VIDEO_MODELS``: ``"tiny-wan"``, ``"tiny-ltx-video"``,
            ``"tiny-cogvideox"``, ``"tiny-hunyuan-video"``, ``"tiny-mochi"``, built in code, seeded, no download), a
            hub id ``org/name`` (e.g. ``"Wan-AI/Wan2.1-T2V-1.3B-Diffusers"``, ``"Lightricks/LTX-Video"``,
            ``"THUDM/CogVideoX-2b"``, ``"hunyuanvideo-community/HunyuanVideo"``, ``"genmo/mochi-1-preview"``) or a
            folder written by ``save_pretrained``; weights are read from safetensors only.
        device, dtype: where and in which dtype the pipeline runs (modules a model keeps in float32 stay so, also
            without the package ``accelerate``: ``_fp32_kept_components``).
        local_files_only: never contact the hub.

    What diffusers, transformers and huggingface_hub log and warn meanwhile is held back (``quiet``).

    Raises:
        ModelLoadError: the pipeline cannot be loaded (the message says why and what to do).
    """
    if model in _BUILDERS:
        with torch.random.fork_rng(devices=[]):
            pipe = _BUILDERS[model]()
        pipe.register_to_config(_name_or_path=model, **{SETTINGS_KEY: dict(TINY_VIDEO_SETTINGS[model])})
        pipe = pipe.to(device)
        return pipe if dtype == torch.float32 else _cast(pipe, dtype)
    folder = check_local_folder(model, "load_video", left_out=_NOT_LOADED)
    if folder is not None:
        check_weights(folder, "save the pipeline again with save_pretrained()", "load_video")
    index = _model_index(model, local_files_only)
    if index is not None:
        _check_index(model, index)
    index = index or {}
    cls = _pipeline_class(index)
    try:
        kept = _fp32_kept_components(model, index, dtype, local_files_only)
        pipe = cls.from_pretrained(model, dtype=dtype, use_safetensors=True, local_files_only=local_files_only,
                                   **_left_out(cls), **kept)
    except RuntimeError as exc:
        error = state_dict_error("load_video", model, exc)
        if error is None:
            raise
        raise error from exc
    except (OSError, ValueError) as exc:
        detail = (str(exc).splitlines() or ["no detail"])[0].rstrip(".")
        raise ModelLoadError(f"load_video: cannot load model={model!r}: {detail}") from exc
    saved = folder or cached_snapshot(model)
    if saved is not None:
        check_weights_cover(pipe, saved, "load_video")
    saved = (_model_index(model, local_files_only=True) or {}).get(SETTINGS_KEY)
    if saved:  # a saved built-in model: its small defaults
        pipe.register_to_config(**{SETTINGS_KEY: saved})
    return pipe.to(device)


def is_video_model(model: str, local_files_only: bool = False) -> bool:
    """Whether ``model`` names a video-transformer pipeline: a built-in video model, or a folder or hub id whose
    ``model_index.json`` names one of ``VIDEO_PIPELINES`` (what ``load_pipeline`` decides by)."""
    return model in BUILTIN_VIDEO_MODELS or _class_name(model, local_files_only) in VIDEO_PIPELINES


def load_pipeline(model: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                  local_files_only: bool = False) -> DiffusionPipeline:
    """An SVD pipeline (``svd.load_svd``) or a video-transformer pipeline (``load_video``), by what ``model``
    is: a built-in video model's name, or a folder or hub id whose ``model_index.json`` names one of
    ``VIDEO_PIPELINES``, loads with ``load_video``; everything else with ``load_svd``, unchanged."""
    if is_video_model(model, local_files_only):
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


def _family(pipe: DiffusionPipeline) -> str:
    return VIDEO_PIPELINES[type(pipe).__name__]


def _compression(pipe: DiffusionPipeline) -> tuple[int, int]:
    """``(temporal, spatial)``: the factors by which the pipeline's VAE compresses time and space (Mochi's pipeline
    fixes them, 6 and 8, whatever its VAE)."""
    family = _family(pipe)
    if family == "ltx-video":
        return pipe.vae_temporal_compression_ratio, pipe.vae_spatial_compression_ratio
    if family == "mochi":
        return pipe.vae_temporal_scale_factor, pipe.vae_spatial_scale_factor
    return pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial


def _patch(pipe: DiffusionPipeline) -> tuple[int, int]:
    """``(temporal, spatial)``: the transformer's patch size over latent frames and latent pixels."""
    config = pipe.transformer.config
    if _family(pipe) == "wan":
        return config.patch_size[0], config.patch_size[1]
    return config.get("patch_size_t") or 1, config.patch_size  # Mochi has no patch_size_t


def _latent_size(pipe: DiffusionPipeline, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
    """``(frames, height, width)`` of the latents of a video, before any padding or packing."""
    temporal, spatial = _compression(pipe)
    return (num_frames - 1) // temporal + 1, height // spatial, width // spatial


def most_keys(pipe: DiffusionPipeline, *, num_frames: int, height: int, width: int) -> int | None:
    """The most keys an attention call of ``pipe``'s denoiser takes in a generation of this size, or ``None``
    where it is not known (an SVD UNet without spatial attention in its down blocks).

    SVD: the spatial self-attention at the finest level that has attention (``(H / vae / 2^level) x (W / ...)``
    tokens) or the temporal one (one key per frame); a video transformer: its video tokens (latent frames, height
    and width over the patch) and text tokens (the fixed prompt embeddings), added for a joint attention
    (CogVideoX, HunyuanVideo, Mochi), the larger of the two for self and cross attentions apart (Wan, LTX-Video)."""
    if not is_video_pipeline(pipe):
        level = next((i for i, name in enumerate(pipe.unet.config.down_block_types) if "CrossAttn" in name), None)
        if level is None:
            return None
        scale = pipe.vae_scale_factor * 2**level
        return max((height // scale) * (width // scale), num_frames)
    frames, h, w = _latent_size(pipe, num_frames, height, width)
    patch_t, patch = _patch(pipe)
    video = -(-frames // patch_t) * (h // patch) * (w // patch)
    text = prompt_embeddings(pipe)[0].shape[1]
    return video + text if _family(pipe) in JOINT_FAMILIES else max(video, text)


def token_grid(pipe: DiffusionPipeline, *, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
    """``(frames, rows, columns)`` of the video tokens of a generation of this size: the latent grid over the
    transformer's patch (latent frames padded to a multiple of the temporal patch, as ``most_keys`` counts them);
    the tokens run row-major over it (frame, then row, then column) in every family's patch embedding."""
    frames, h, w = _latent_size(pipe, num_frames, height, width)
    patch_t, patch = _patch(pipe)
    return -(-frames // patch_t), h // patch, w // patch


def self_attention_text(pipe: DiffusionPipeline) -> tuple[int, str]:
    """``(tokens, where)``: the text tokens a video pipeline's self-attention joins to the video tokens (the fixed
    prompt embeddings' length, every token kept) and where (``JOINT_TEXT_AT``: ``"first"`` or ``"last"``);
    ``(0, "first")`` where text is attended apart, by cross-attention (Wan, LTX-Video)."""
    family = _family(pipe)
    if family not in JOINT_FAMILIES:
        return 0, "first"
    return prompt_embeddings(pipe)[0].shape[1], JOINT_TEXT_AT[family]


def self_attention_tokens(pipe: DiffusionPipeline, *, num_frames: int, height: int, width: int) -> VideoTokens:
    """The token sequence of the self-attention of a video pipeline's transformer in a generation of this size."""
    frames, rows, columns = token_grid(pipe, num_frames=num_frames, height=height, width=width)
    text, where = self_attention_text(pipe)
    return VideoTokens(frames, rows, columns, text=text, text_at=where)


def default_settings(pipe: DiffusionPipeline) -> dict[str, int]:
    """``num_frames``, ``height`` and ``width`` of a video pipeline: a built-in one's (``names.TINY_VIDEO_SETTINGS``,
    which ``load_video`` puts in its config under ``SETTINGS_KEY``, kept when saved and loaded again), else the
    pipeline's own call defaults (Wan: 81 frames of 480 x 832; LTX-Video: 161 of 512 x 704; HunyuanVideo: 129 of
    720 x 1280), a size it leaves unset its ``default_height`` / ``default_width`` (Mochi: 19 frames of 480 x 848),
    or where all are unset its transformer's sample size (CogVideoX: 49 frames of 480 x 720)."""
    saved = pipe.config.get(SETTINGS_KEY)
    if saved:
        return {name: int(saved[name]) for name in ("num_frames", "height", "width")}
    settings = {name: _call_default(pipe, name) for name in ("num_frames", "height", "width")}
    settings = {name: getattr(pipe, f"default_{name}", None) if value is None else value
                for name, value in settings.items()}
    if _family(pipe) == "cogvideox":  # its call defaults are None: the transformer's sample size, as the pipeline
        config, (_, spatial) = pipe.transformer.config, _compression(pipe)
        settings = {"num_frames": config.sample_frames, "height": config.sample_height * spatial,
                    "width": config.sample_width * spatial}
    return settings


def setting_problem(pipe: DiffusionPipeline, *, num_frames: int, height: int, width: int,
                    num_inference_steps: int | None = None) -> tuple[str, str] | None:
    """``(argument, why)`` for the first of ``num_frames``, ``height``, ``width`` (and ``num_inference_steps`` where
    given) that the video pipeline would silently round or get wrong, or ``None``.  Frames: ``tk + 1`` for a VAE
    compressing time ``t``x (Wan and HunyuanVideo 4x, LTX-Video 8x, Mochi 6x); CogVideoX ``8k + 1``, its VAE (4x)
    decoding latent frames in pairs after the first, so that an even number of them decodes to the wrong number of
    frames.  Sizes: multiples of the VAE's spatial factor times the patch size (Wan, CogVideoX, HunyuanVideo and
    Mochi 8 x 2 = 16, LTX-Video 32 x 1 = 32), and for Wan no more positions along an axis than its rotary table
    holds (``_rotary_problem``: ``tiny-wan`` at most 125 frames and 512 pixels a side). Steps: at least 2 where the
    scheduler stretches its sigmas to a terminal value (LTX-Video's ``shift_terminal``: one step's stretch divides 0
    by 0, and every frame comes out NaN), and for Mochi, whose linear-quadratic sigma schedule divides by its linear
    steps, half the steps rounded down (one step: ``ZeroDivisionError``)."""
    name = type(pipe).__name__
    temporal, spatial = _compression(pipe)
    multiple = spatial * _patch(pipe)[1]
    if _family(pipe) == "cogvideox":
        if (num_frames - 1) % (2 * temporal):
            return "num_frames", (f"{name} takes {2 * temporal}k + 1 frames (its VAE compresses time {temporal}x "
                                  f"and decodes an odd number of latent frames only), got {num_frames}")
    elif (num_frames - 1) % temporal:
        return "num_frames", (f"{name} takes {temporal}k + 1 frames (its VAE compresses time {temporal}x), "
                              f"got {num_frames}")
    for setting, value in (("height", height), ("width", width)):
        if value % multiple:
            return setting, (f"{name} takes multiples of {multiple} (VAE {spatial}x, patch {multiple // spatial}), "
                             f"got {value}")
    problem = _rotary_problem(pipe, num_frames=num_frames, height=height, width=width)
    if problem is not None:
        return problem
    if num_inference_steps is None or num_inference_steps >= 2:
        return None
    terminal = pipe.scheduler.config.get("shift_terminal")
    if terminal:
        return "num_inference_steps", (f"{name} takes at least 2 steps (its scheduler stretches the sigmas to end at "
                                       f"shift_terminal {terminal}, which one step cannot), got {num_inference_steps}")
    if _family(pipe) == "mochi":
        return "num_inference_steps", (f"{name} takes at least 2 steps (its linear-quadratic sigma schedule divides by "
                                       f"its linear steps, half the steps rounded down), got {num_inference_steps}")
    return None


def _rotary_problem(pipe: DiffusionPipeline, *, num_frames: int, height: int, width: int) -> tuple[str, str] | None:
    """``(argument, why)`` where the video has more positions along an axis than a Wan transformer's rotary table
    holds (``rope_max_seq_len`` rows: 1024 in the released models, 32 in ``tiny-wan``; the table is sliced, not
    grown, and its reshape fails mid-run), else ``None``.  The other families compute their rotary embeddings for
    the video's own grid (LTX-Video, HunyuanVideo, Mochi) or have none (CogVideoX's are sinusoidal, made for the
    video's size)."""
    if _family(pipe) != "wan":
        return None
    rows = pipe.transformer.config.rope_max_seq_len
    temporal, spatial = _compression(pipe)
    patch_t, patch = _patch(pipe)
    frames, h, w = _latent_size(pipe, num_frames, height, width)
    largest = {"num_frames": (rows * patch_t - 1) * temporal + 1, "height": rows * patch * spatial,
               "width": rows * patch * spatial}
    for setting, value, positions in (("num_frames", num_frames, frames // patch_t), ("height", height, h // patch),
                                      ("width", width, w // patch)):
        if positions > rows:
            return setting, (f"{type(pipe).__name__}'s rotary table holds {rows} positions per axis (its transformer's "
                             f"rope_max_seq_len), and {value} makes {positions}: at most {largest[setting]}, got "
                             f"{value}")
    return None


def _prompt_draws(pipe: DiffusionPipeline) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fixed embeddings of a video pipeline, float32 on the CPU: ``(2, 1, L, width)`` (the prompt's, then the
    negative prompt's), then from the same generator ``(2, 1, pooled width)`` where the pipeline takes pooled
    ones (``_POOLED_WIDTH``), else ``None``."""
    config = pipe.transformer.config
    family = _family(pipe)
    width = getattr(config, _TEXT_WIDTH[family])
    length = config.max_text_seq_length if family == "cogvideox" else _call_default(pipe, "max_sequence_length")
    generator = torch.Generator(device="cpu").manual_seed(PROMPT_SEED)
    tokens = torch.randn(2, 1, length, width, generator=generator)
    pooled = None
    if family in _POOLED_WIDTH:
        pooled = torch.randn(2, 1, getattr(config, _POOLED_WIDTH[family]), generator=generator)
    return tokens, pooled


def prompt_embeddings(pipe: DiffusionPipeline) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed ``(prompt_embeds, negative_prompt_embeds)`` of a video pipeline, each ``(1, L, width)`` (see
    the module docstring), on the pipeline's device in its transformer's dtype."""
    positive, negative = _prompt_draws(pipe)[0]
    return tuple(x.to(device=pipe.device, dtype=pipe.transformer.dtype) for x in (positive, negative))


def pooled_prompt_embeddings(pipe: DiffusionPipeline) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The fixed ``(pooled_prompt_embeds, negative_pooled_prompt_embeds)`` of a pipeline that takes them
    (HunyuanVideo: its CLIP text encoder's pooled output), each ``(1, width)``, drawn after ``prompt_embeddings``
    from the same generator, on the pipeline's device in its transformer's dtype; or ``None``."""
    pooled = _prompt_draws(pipe)[1]
    if pooled is None:
        return None
    return tuple(x.to(device=pipe.device, dtype=pipe.transformer.dtype) for x in pooled)


def prompt_attention_masks(pipe: DiffusionPipeline) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``(prompt_attention_mask, negative_prompt_attention_mask)`` of a pipeline that takes them (LTX-Video,
    HunyuanVideo, Mochi), each ``(1, L)`` boolean and all true (every token of ``prompt_embeddings`` kept), or
    ``None``."""
    if _family(pipe) not in _MASKED:
        return None
    positive, _ = prompt_embeddings(pipe)
    mask = torch.ones(positive.shape[:2], dtype=torch.bool, device=pipe.device)
    return mask, mask.clone()


def make_latents(pipe: DiffusionPipeline, *, num_frames: int, height: int, width: int, seed: int) -> torch.Tensor:
    """The initial noise of one video, a unit Gaussian drawn in float32 on the CPU from ``seed`` (the same on every
    device), in the layout the pipeline takes as ``latents``: Wan ``(1, C, f, h, w)`` (``f = (num_frames - 1) / t
    + 1``, ``h = height / s``, ``w = width / s``; ``t``, ``s``: the VAE's temporal and spatial factors); LTX-Video
    the same draw packed into ``(1, f h w / p^2 p_t, C p^2 p_t)`` tokens by its pipeline's ``_pack_latents``
    (patch ``p``, ``p_t``); HunyuanVideo and Mochi as Wan; CogVideoX ``(1, f, C, h, w)``, ``f`` padded to a
    multiple of ``p_t`` as its pipeline pads (CogVideoX 1.5).  The pipelines take it as it is (Wan, LTX-Video and
    HunyuanVideo float32 latents, no noise scaling; Mochi casts it to its prompt embeddings' dtype; CogVideoX's DDIM
    ``init_noise_sigma`` is 1; ``generate`` casts it to CogVideoX's dtype)."""
    family = _family(pipe)
    frames, h, w = _latent_size(pipe, num_frames, height, width)
    channels = pipe.transformer.config.in_channels
    patch_t, patch = _patch(pipe)
    if family == "cogvideox":
        shape = (1, frames + (-frames) % patch_t, channels, h, w)
    else:
        shape = (1, channels, frames, h, w)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    latents = torch.randn(shape, generator=generator, dtype=torch.float32)
    if family == "ltx-video":
        latents = type(pipe)._pack_latents(latents, patch, patch_t)
    return latents.to(pipe.device)


@torch.no_grad()
def _decode(pipe: DiffusionPipeline, latents: torch.Tensor, *, num_frames: int, height: int,
            width: int) -> torch.Tensor:
    """The final latents -> ``(1, 3, F, H, W)`` in ``[-1, 1]``: un-normalised as the pipeline does, then the
    VAE, without the pipeline's post-processing (its clamp turns +-inf into 1 or 0).  LTX-Video's are unpacked
    first and decoded at its pipeline's default decode timestep (0, and no decode noise: its scale defaults to
    the timestep); CogVideoX's padding frames (CogVideoX 1.5) are dropped and its frame axis moved behind the
    channels; HunyuanVideo's divided by its scaling factor; Mochi's scaled by its latents' std and shifted by their
    mean (or divided by its scaling factor where those are unset)."""
    vae = pipe.vae
    config = vae.config
    family = _family(pipe)
    if family == "ltx-video":
        frames, h, w = _latent_size(pipe, num_frames, height, width)
        patch_t, patch = _patch(pipe)
        latents = type(pipe)._unpack_latents(latents, frames, h, w, patch, patch_t)
        latents = type(pipe)._denormalize_latents(latents, vae.latents_mean, vae.latents_std, config.scaling_factor)
        timestep = None
        if config.timestep_conditioning:  # the noise the pipeline mixes in is scaled by the same default: none
            timestep = torch.tensor([float(_call_default(pipe, "decode_timestep"))], device=latents.device,
                                    dtype=vae.dtype)
        return vae.decode(latents.to(vae.dtype), timestep, return_dict=False)[0]
    if family == "cogvideox":
        frames = _latent_size(pipe, num_frames, height, width)[0]
        latents = latents[:, latents.shape[1] - frames:].permute(0, 2, 1, 3, 4) / config.scaling_factor
        return vae.decode(latents.to(vae.dtype), return_dict=False)[0]
    if family == "hunyuan-video":
        return vae.decode(latents.to(vae.dtype) / config.scaling_factor, return_dict=False)[0]
    latents = latents.to(vae.dtype)
    if family == "mochi":
        if config.latents_mean is None or config.latents_std is None:
            return vae.decode(latents / config.scaling_factor, return_dict=False)[0]
        mean, std = (torch.tensor(values).view(1, -1, 1, 1, 1).to(latents)
                     for values in (config.latents_mean, config.latents_std))
        return vae.decode(latents * std / config.scaling_factor + mean, return_dict=False)[0]
    mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents)
    std = torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents)
    return vae.decode(latents * std + mean, return_dict=False)[0]


def generate(pipe: DiffusionPipeline, *, num_frames: int, num_inference_steps: int, seed: int, height: int,
             width: int, latents: torch.Tensor | None = None, guidance_scale: float | None = None,
             progress: bool = True, **kwargs: Any) -> np.ndarray:
    """Generate one video from the fixed prompt embeddings; return its frames, ``(num_frames, height, width, 3)``
    float32 in ``[0, 1]`` (non-finite values kept).

    Args:
        pipe: a pipeline from ``load_video`` (with whatever attention processors are installed; a sparse
            backend's are bound to this video's token grid for the call, ``sparse.sparse_bound``).
        num_frames, num_inference_steps, height, width: as in the pipeline's ``__call__``; a value it would
            round is a ``ValueError`` (``setting_problem``).
        seed: seeds the initial noise (when ``latents`` is None) and the pipeline's generator.
        latents: explicit initial noise from ``make_latents``.
        guidance_scale: classifier-free guidance (default: the pipeline's, Wan 5.0, LTX-Video 3.0, CogVideoX 6.0,
            Mochi 4.5); HunyuanVideo's is the guidance its distilled transformer embeds (6.0), one transformer call
            per step (true classifier-free guidance, on the negative embeddings, only with ``true_cfg_scale`` > 1).
        progress: show the pipeline's progress bar over the denoising steps.
        **kwargs: passed to the pipeline (e.g. ``callback_on_step_end``).
    """
    problem = setting_problem(pipe, num_frames=num_frames, height=height, width=width,
                              num_inference_steps=num_inference_steps)
    if problem is not None:
        raise ValueError(f"generate: {problem[0]}: {problem[1]}")
    if latents is None:
        latents = make_latents(pipe, num_frames=num_frames, height=height, width=width, seed=seed)
    if _family(pipe) == "cogvideox":  # its pipeline runs its whole loop in the dtype of the prompt embeddings
        latents = latents.to(pipe.transformer.dtype)
    positive, negative = prompt_embeddings(pipe)
    masks = prompt_attention_masks(pipe)
    if masks is not None:
        kwargs = {"prompt_attention_mask": masks[0], "negative_prompt_attention_mask": masks[1], **kwargs}
    pooled = pooled_prompt_embeddings(pipe)
    if pooled is not None:
        kwargs = {"pooled_prompt_embeds": pooled[0], "negative_pooled_prompt_embeds": pooled[1], **kwargs}
    previous_config = getattr(pipe, "_progress_bar_config", {})
    pipe.set_progress_bar_config(**{**previous_config, "disable": not progress})
    guidance = _call_default(pipe, "guidance_scale") if guidance_scale is None else guidance_scale
    try:
        with warnings.catch_warnings():
            if _family(pipe) == "mochi":  # its rotary table is made under autocast(float32), which CPU autocast refuses
                warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported",
                                        category=UserWarning,
                                        module=r"diffusers\.models\.transformers\.transformer_mochi$")
            tokens = self_attention_tokens(pipe, num_frames=num_frames, height=height, width=width)
            with sparse_bound(pipe, tokens):
                final_latents = pipe(
                    prompt_embeds=positive, negative_prompt_embeds=negative, height=height, width=width,
                    num_frames=num_frames, num_inference_steps=num_inference_steps, guidance_scale=guidance,
                    generator=torch.Generator(device="cpu").manual_seed(seed), latents=latents, output_type="latent",
                    **kwargs,
                ).frames
    finally:
        pipe.set_progress_bar_config(**previous_config)
    return svd.to_frames(_decode(pipe, final_latents, num_frames=num_frames, height=height, width=width))


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
