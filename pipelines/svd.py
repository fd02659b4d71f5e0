"""Stable Video Diffusion: loading (hub id, local folder, built-in models) and generation from explicit latents.

Conditioning images are read by ``images.load_image`` (re-exported here): any mode PIL opens, as 8-bit RGB.

Every backend comparison starts from the same initial noise: ``make_latents`` draws it on the CPU from
a seed, ``generate`` hands it to the pipeline (which only scales it by ``init_noise_sigma``) together
with a CPU generator seeded alike for the noise augmentation of the conditioning image.  Frames come
back as float32 arrays in ``[0, 1]`` with non-finite values left in place, so an overflow stays
visible to the caller.
"""
from __future__ import annotations

import importlib
import inspect
import json
import logging
import math
import os
import re
import socket
import types
import typing
import urllib.parse
from pathlib import Path
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
from safetensors import SafetensorError, safe_open
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

from .images import load_image
from .quiet import quiet
from .names import BUILTIN_MODELS, BUILTIN_VIDEO_MODELS, TINY_VIDEO_PIPELINES, is_hub_id
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


class ModelLoadError(OSError):
    """A pipeline that cannot be loaded, with what happened and what to do (``load_svd``)."""


def _check_local_folder(model: str, who: str = "load_svd", left_out: tuple[str, ...] = ()) -> Path | None:
    """The folder ``model`` names, checked to hold a saved pipeline; ``None`` for a hub id.

    Every component folder its ``model_index.json`` lists must be there (those named ``left_out``: the
    video pipelines' tokenizers and text encoders, never loaded, need not), and a model component's folder (one
    holding a ``config.json``) must hold its safetensors weights; the error names the component's folder.
    ``who``: the loader that says so."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{who}: model={model!r} is a file; expected a pipeline folder or a hub id")
        index = path / "model_index.json"
        if not index.is_file():
            raise ModelLoadError(f"{who}: folder model={model!r} has no model_index.json; expected a folder written "
                                 "by a pipeline's save_pretrained()")
        try:
            components = json.loads(index.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{who}: {index} is not valid JSON ({exc}); save the pipeline again") from exc
        if not isinstance(components, dict):
            raise ModelLoadError(f"{who}: {index} holds no JSON object; save the pipeline again")
        listed = [name for name, entry in components.items() if not name.startswith(("_", *left_out))
                  and isinstance(entry, list) and entry and entry[0] is not None]
        missing = sorted(name for name in listed if not (path / name).is_dir())
        if missing:
            raise ModelLoadError(f"{who}: folder model={model!r} lacks the component folder(s) {missing} that its "
                                 "model_index.json lists; save the pipeline again with save_pretrained()")
        unweighted = sorted(str(path / name) for name in listed
                            if (path / name / "config.json").is_file() and not any((path / name).glob("*.safetensors")))
        if unweighted:
            raise ModelLoadError(f"{who}: component folder {unweighted[0]} holds no .safetensors weights (its "
                                 "config.json says it is a model); save the pipeline again with save_pretrained()")
        return path
    if not is_hub_id(model):
        raise ModelLoadError(f"{who}: no such folder model={model!r}, and not a hub id 'org/name' nor a built-in "
                             f"model ({', '.join(BUILTIN_MODELS)})")
    return None


def _check_weights(folder: Path, fix: str, who: str = "load_svd") -> None:
    """Open the header of every safetensors file under ``folder``: a corrupt or truncated one is named."""
    for file in sorted(folder.rglob("*.safetensors")):
        try:
            with safe_open(file, framework="pt"):
                pass
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{who}: weight file {file} is corrupt or truncated ({exc}); {fix}") from exc


def _library_class(library: str, name: str) -> type | None:
    """The class ``name`` of the module ``library`` (a ``model_index.json`` entry), or ``None``."""
    try:
        found = getattr(importlib.import_module(library), name, None)
    except ImportError:
        return None
    return found if isinstance(found, type) else None


def _module_classes(annotation: Any) -> tuple[type, ...]:
    """The ``torch.nn.Module`` classes a pipeline's ``__init__`` annotation names (a class, its name as a string
    in diffusers or transformers, or a union of them); ``()`` for anything else (schedulers, processors)."""
    if isinstance(annotation, str):
        annotation = next((found for library in ("diffusers", "transformers")
                           if (found := _library_class(library, annotation)) is not None), None)
    members = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return tuple(m for m in members if isinstance(m, type) and issubclass(m, torch.nn.Module))


def index_problem(index: dict[str, Any], pipeline: type, left_out: tuple[str, ...] = ()) -> str | None:
    """Why the components a ``model_index.json`` lists cannot make ``pipeline`` (a model component of another
    class than the one ``pipeline`` takes there, as when the index names another family's pipeline; a required
    component missing), or ``None``.  Components named ``left_out`` are not checked (never loaded)."""
    for name, param in inspect.signature(pipeline.__init__).parameters.items():
        if name == "self" or name.startswith(left_out) or param.kind is not param.POSITIONAL_OR_KEYWORD:
            continue
        entry = index.get(name)
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] is not None):
            if param.default is inspect.Parameter.empty:
                return f"its model_index.json lists no component {name!r}, which {pipeline.__name__} takes"
            continue
        expected = _module_classes(param.annotation)
        if not expected:
            continue
        found = _library_class(*map(str, entry))
        if found is None or not issubclass(found, expected):
            return (f"its component {name!r} is {entry[1]} ({entry[0]}), but {pipeline.__name__} takes "
                    f"{' or '.join(c.__name__ for c in expected)} there: model_index.json names another family's "
                    "pipeline, or holds another model's components")
    return None


def _weight_keys(folder: Path) -> set[str]:
    """The tensor names stored in the safetensors files of one component folder (headers only)."""
    keys: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(file, framework="pt") as handle:
            keys.update(handle.keys())
    return keys


def _key_list(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (f", ... ({len(keys)} in all)" if len(keys) > 3 else "")


def check_weights_cover(pipe: Any, root: Path, who: str = "load_svd") -> None:
    """Refuse (``ModelLoadError``) a loaded pipeline where a model component's weights in ``root/<component>``
    do not hold exactly its state dict: a tensor its ``config.json`` makes but the weights lack would run
    randomly initialised (diffusers only logs "newly initialized"), one the weights hold but the model lacks
    is silently dropped.  Tensors a model class declares ignorable (``_keys_to_ignore_on_load_missing`` /
    ``_unexpected``) and tied copies of a stored tensor are not counted."""
    for name, module in pipe.components.items():
        folder = root / name
        if not isinstance(module, torch.nn.Module) or not folder.is_dir():
            continue
        stored = _weight_keys(folder)
        if not stored:
            continue
        state = module.state_dict()
        present = {ptr for key, tensor in state.items() if key in stored and (ptr := tensor.data_ptr())}  # not meta

        def ignored(key: str, kind: str) -> bool:
            patterns = getattr(module, f"_keys_to_ignore_on_load_{kind}", None) or ()
            return any(re.search(pattern, key) for pattern in patterns)

        missing = sorted(key for key, tensor in state.items() if key not in stored and not ignored(key, "missing")
                         and tensor.data_ptr() not in present)
        unexpected = sorted(key for key in stored if key not in state and not ignored(key, "unexpected"))
        if missing or unexpected:
            what = "; ".join(part for part in (
                missing and f"{len(missing)} tensor(s) its config.json makes are missing from the weights "
                            f"({_key_list(missing)}) and would run randomly initialised",
                unexpected and f"{len(unexpected)} tensor(s) in the weights are not in the model its config.json "
                               f"makes ({_key_list(unexpected)})") if part)
            raise ModelLoadError(f"{who}: component folder {folder}: config.json and weights disagree: {what}; save "
                                 "the pipeline again with save_pretrained(), or restore the config.json it was "
                                 "saved with")


def state_dict_mismatch(exc: RuntimeError) -> str | None:
    """The first two lines of diffusers' ``Error(s) in loading state_dict for X: size mismatch ...`` (a
    component's config.json makes tensors of other shapes than its weights hold), or ``None``."""
    lines = str(exc).splitlines()
    if not lines or not lines[0].startswith("Error(s) in loading state_dict"):
        return None
    return " ".join(line.strip().rstrip(".") for line in lines[:2])


def _cached_snapshot(model: str) -> Path | None:
    """The local Hugging Face cache's snapshot folder of hub id ``model``, or ``None`` when not cached."""
    found = huggingface_hub.try_to_load_from_cache(model, "model_index.json")
    return Path(found).parent if isinstance(found, str) else None


_HUB_PROBE_SECONDS = 5.0
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
_unreachable: dict[str, str | None] = {}


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub's endpoint cannot be reached from here (``"gaierror: [Errno -2] Name or service not
    known"``: a TCP connection to it, ``_HUB_PROBE_SECONDS`` at most, once per process), or ``None``.

    Asked before a hub id that is not in the cache is downloaded: huggingface_hub retries every request five times,
    1 + 2 + 4 + 8 + 8 s apart, logging each retry, so an offline machine answered after 33-80 s of retries.  Behind a
    proxy (``HTTPS_PROXY`` and the like) the probe is skipped (``None``): the proxy may reach what this host cannot."""
    endpoint = huggingface_hub.constants.ENDPOINT
    if endpoint not in _unreachable:
        url = urllib.parse.urlsplit(endpoint)
        why = None
        if not any(os.environ.get(name) for name in _PROXY_VARIABLES) and url.hostname:
            try:
                socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                         timeout=_HUB_PROBE_SECONDS).close()
            except OSError as exc:
                why = f"{type(exc).__name__}: {exc}"
        _unreachable[endpoint] = why
    return _unreachable[endpoint]


def _from_pretrained(model: str, *, dtype: torch.dtype, variant: str | None,
                     local_files_only: bool) -> StableVideoDiffusionPipeline:
    """``StableVideoDiffusionPipeline.from_pretrained`` from safetensors, its errors as ``ModelLoadError``."""
    folder = _check_local_folder(model)
    cache = huggingface_hub.constants.HF_HUB_CACHE
    if folder is not None:
        _check_weights(folder, "save the pipeline again with save_pretrained()")
    else:
        snapshot = _cached_snapshot(model)
        offline = "local_files_only=True" if local_files_only else (
            "HF_HUB_OFFLINE is set" if huggingface_hub.constants.HF_HUB_OFFLINE else None)
        if snapshot is None and offline:
            raise ModelLoadError(
                f"load_svd: hub id model={model!r} is not in the local Hugging Face cache ({cache}) and "
                f"{offline} forbids downloading it; download it first (huggingface-cli download {model}) "
                "or pass a folder written by save_pretrained()"
            )
        if snapshot is not None:
            _check_weights(snapshot, f"download it again (huggingface-cli download {model} --force-download)")
        elif (why := hub_unreachable()) is not None:
            raise ModelLoadError(
                f"load_svd: hub id model={model!r} is not in the local Hugging Face cache ({cache}) and could not be "
                f"downloaded ({why}); check the name and the network, or pass a folder written by save_pretrained()")
    saved = folder or _cached_snapshot(model)
    if saved is not None:
        _check_index(model, json.loads((saved / "model_index.json").read_text()))
    try:
        pipe = StableVideoDiffusionPipeline.from_pretrained(
            model, dtype=dtype, variant=variant, use_safetensors=True, local_files_only=local_files_only
        )
    except RuntimeError as exc:
        mismatch = state_dict_mismatch(exc)
        if mismatch is None:
            raise
        raise ModelLoadError(f"load_svd: model={model!r}: a component's config.json and weights disagree "
                             f"({mismatch}); save the pipeline again with save_pretrained()") from exc
    except OSError as exc:
        if folder is None and _cached_snapshot(model) is None:
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
    saved = folder or _cached_snapshot(model)
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
