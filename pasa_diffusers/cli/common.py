"""Arguments, validation and errors shared by the ``pasa`` subcommands.

Nothing here imports torch or diffusers at module level: every argument is checked (argparse ``type=``
helpers, then each subcommand's ``validate``) before any heavy import, so a user mistake is answered
in a fraction of a second with one line ``pasa <command>: error: <message>`` (exit status 2).

The limits come from what the pipeline needs:

- ``--frames`` >= 2: one frame fails inside diffusers' SVD pipeline (a tensor-size mismatch,
  diffusers 0.42); a video transformer's pipeline takes ``4k + 1`` frames (Wan, HunyuanVideo: its VAE
  compresses time 4x), ``8k + 1`` (LTX-Video: 8x; CogVideoX: 4x, an odd number of latent frames), ``6k + 1``
  (Mochi: 6x), checked once the model is loaded (``generation_settings``);
- ``--height``/``--width``: multiples of 8 (``StableVideoDiffusionPipeline.check_inputs``), at
  least 8, and at least 16 for a command that scores frames (SSIM's 11 x 11 Gaussian window, sigma 1.5);
  multiples of 16 for Wan, CogVideoX, HunyuanVideo and Mochi (VAE 8x, patch 2), of 32 for LTX-Video (VAE 32x,
  patch 1);
- ``--steps`` >= 1 (LTX-Video and Mochi: >= 2); ``--seed`` in [0, 2**63 - 1] (a CPU ``torch.Generator`` seed);
  ``--fps`` a rate a GIF can play (``metrics.limits.fps_argument``);
- no upper bound of its own on ``--frames``, ``--height``, ``--width`` and ``--steps``: a run whose video or
  scheduler tables cannot fit in the memory there is (``pipelines.memory``) is refused, saying how much it
  needs and how much there is, before any folder is made or model loaded (``check_memory``).
"""
from __future__ import annotations

import argparse
import os
import re
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pasa_diffusers.backends import BACKENDS
from pasa_diffusers.pipelines.names import (ALL_BUILTIN_MODELS, BUILTIN_IMAGES, BUILTIN_MODELS, BUILTIN_VIDEO_MODELS,
                                            TINY_VIDEO_SETTINGS, is_hub_id)

__all__ = [
    "UsageError",
    "MIN_FRAMES",
    "SIZE_MULTIPLE",
    "MIN_SIZE",
    "SCORED_MIN_SIZE",
    "MAX_SEED",
    "int_range",
    "seed",
    "nonempty",
    "FOLDER",
    "MODEL",
    "IMAGE",
    "FILE",
    "device",
    "backend_help",
    "model_help",
    "add_model_args",
    "add_generation_args",
    "validate_generation_args",
    "check_device",
    "check_out_dir",
    "path_kind",
    "check_image",
    "check_model",
    "check_file",
    "load_model",
    "generation_settings",
    "conditioning_notice",
    "load_condition_image",
    "model_dtype",
    "check_key_blocks",
    "check_sparse_model",
    "requested_sizes",
    "check_memory",
]


class UsageError(Exception):
    """A user mistake: ``pasa`` prints ``pasa <command>: error: <message>`` and exits 2, no traceback.

    The message names the flag, the value given and what is accepted, on one line."""


MIN_FRAMES = 2
SIZE_MULTIPLE = 8
MIN_SIZE = 8
SCORED_MIN_SIZE = 16
"""The smallest multiple of 8 that holds SSIM's 11 x 11 window (Gaussian, sigma 1.5, truncated at 3.5 sigma)."""
MAX_SEED = 2**63 - 1

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def int_range(lo: int, hi: int | None = None, *, multiple_of: int = 1, why: str = "") -> Callable[[str], int]:
    """An argparse ``type=``: an integer in ``[lo, hi]`` (``hi=None``: no upper bound) and a multiple of
    ``multiple_of``; ``why`` (e.g. ``"SVD needs two frames"``) is appended to the error."""
    kind = f"a multiple of {multiple_of}" if multiple_of > 1 else "an integer"
    accepted = f"{kind} >= {lo}" if hi is None else f"{kind} in [{lo}, {hi}]"
    suffix = f" ({why})" if why else ""

    def parse(text: str) -> int:
        value = _int(text)
        if value < lo or (hi is not None and value > hi) or value % multiple_of:
            raise argparse.ArgumentTypeError(f"must be {accepted}{suffix}, got {text}")
        return value

    return parse


seed = int_range(0, MAX_SEED)
"""An argparse ``type=``: a seed in ``[0, 2**63 - 1]``."""


def nonempty(expected: str) -> Callable[[str], str]:
    """An argparse ``type=`` for a path or a name: any text but the empty string, which a path would read as the
    current folder (``--out ''`` wrote there, ``--model ''`` loaded it); ``expected`` says what the flag takes."""

    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError(f"expected {expected}, got an empty string")
        return text

    return parse


FOLDER = nonempty("a folder")
MODEL = nonempty("a built-in model, a hub id 'org/name' or a saved folder")
IMAGE = nonempty("an image file or builtin:NAME")
FILE = nonempty("a file")


def device(text: str) -> str:
    """An argparse ``type=``: ``cpu``, ``cuda`` or ``cuda:N`` (whether CUDA is there is ``check_device``'s job)."""
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def backend_help(names: tuple[str, ...]) -> str:
    """``names`` with the registry's summary of each (``backends.BACKENDS``), for a ``--help`` text."""
    return "; ".join(f"{name}: {BACKENDS[name].summary}" for name in names)


def model_help(default: str | None) -> str:
    """The ``--help`` text of ``--model``: the built-in models with what each is, a hub id, a folder."""
    builtin = "; ".join(f"'{name}': {what}" for name, what in ALL_BUILTIN_MODELS.items())
    return (f"{builtin}; or a hub id 'org/name' (from the local cache or the hub) or a save_pretrained folder"
            + (f" (default {default})" if default else ""))


def add_model_args(p: argparse.ArgumentParser, default: str | None = "tiny") -> None:
    """``--model`` (``default=None``: required), ``--device``, ``--dtype`` and ``--local-files-only``:
    what loading a pipeline takes (``load_model``)."""
    p.add_argument("--model", type=MODEL, default=default, required=default is None, help=model_help(default))
    p.add_argument("--device", type=device, default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default=None,
                   help="model dtype (default fp16 on CUDA, fp32 on CPU, where the PASA backends cast q, k, v to fp16)")
    p.add_argument("--local-files-only", action="store_true", help="never contact the Hugging Face hub")


def add_generation_args(p: argparse.ArgumentParser, out: str, frames: int = 4, steps: int = 4, size: int = 64,
                        *, min_size: int = MIN_SIZE, video: bool = False) -> None:
    """The flags of a command that generates videos (``add_model_args`` among them), each validated by its
    ``type=``.

    ``min_size``: the smallest ``--height``/``--width`` (``SCORED_MIN_SIZE`` for a command that scores
    frames with SSIM).  ``video``: the command also takes video-transformer pipelines, whose own frames and
    size are the defaults of ``--frames``, ``--height`` and ``--width`` there (``generation_settings``;
    ``frames`` and ``size`` stay SVD's).  ``validate_generation_args`` checks what ``type=`` cannot (device,
    paths)."""
    size_type = int_range(min_size, multiple_of=SIZE_MULTIPLE,
                          why="SVD needs multiples of 8" + (", SSIM an 11x11 window" if min_size > MIN_SIZE else ""))

    def own(name: str) -> str:
        tiny = ", ".join(f"{model} {settings[name]}" for model, settings in TINY_VIDEO_SETTINGS.items())
        return (f"; a video transformer's pipeline: its own, {tiny}, a loaded one its pipeline's default"
                if video else "")

    add_model_args(p)
    p.add_argument("--image", type=IMAGE, default="builtin:rocket",
                   help=f"conditioning image: a file (any mode PIL opens; transparency is composited on white) "
                        f"or builtin:{'|'.join(BUILTIN_IMAGES)} (default builtin:rocket)"
                        + ("; unused by a text-to-video pipeline" if video else ""))
    p.add_argument("--frames", type=int_range(MIN_FRAMES, why="SVD needs two frames"), default=None if video else frames,
                   help=f"frames per video, >= {MIN_FRAMES} (default {frames}" + own("num_frames") + ")")
    p.add_argument("--steps", type=int_range(1), default=steps, help=f"denoising steps, >= 1 (default {steps})")
    p.add_argument("--height", type=size_type, default=None if video else size,
                   help=f"frame height in pixels: a multiple of 8, >= {min_size} (default {size}" + own("height") + ")")
    p.add_argument("--width", type=size_type, default=None if video else size,
                   help=f"frame width in pixels: a multiple of 8, >= {min_size} (default {size}" + own("width") + ")")
    if video:
        p.set_defaults(svd_defaults={"num_frames": frames, "height": size, "width": size})
    p.add_argument("--seed", type=seed, default=0, help="seed of the initial noise, in [0, 2**63-1] (default 0)")
    p.add_argument("--out", type=FOLDER, default=out, help=f"output folder (created; default {out})")


def validate_generation_args(args: argparse.Namespace) -> None:
    """Check the flags of ``add_generation_args`` that ``type=`` cannot: the model, the image, the device
    (torch is imported only for a CUDA device), whether the run fits in memory (``check_memory``) and, last,
    the output folder (created here)."""
    check_model(args.model)
    check_image(args.image)
    check_device(args.device)
    check_memory(args, requested_sizes(args))
    check_out_dir(args.out)


_SMALLEST = {"num_frames": MIN_FRAMES, "height": MIN_SIZE, "width": MIN_SIZE}


def requested_sizes(args: argparse.Namespace) -> dict[str, int]:
    """``num_frames``, ``height`` and ``width`` of the run as far as the flags say before the model is loaded: a
    flag given, else the built-in model's own (``TINY_VIDEO_SETTINGS``) or the command's SVD default, else (a
    loaded video pipeline's own default, not known yet) the smallest value accepted: a lower bound."""
    sizes = {}
    for name, flag in _FLAGS.items():
        value = getattr(args, flag.removeprefix("--"), None)
        if value is None and args.model in TINY_VIDEO_SETTINGS:
            value = TINY_VIDEO_SETTINGS[args.model][name]
        elif value is None and args.model in BUILTIN_MODELS:
            value = getattr(args, "svd_defaults", _SMALLEST)[name]
        sizes[name] = _SMALLEST[name] if value is None else int(value)
    return sizes


def check_memory(args: argparse.Namespace, sizes: dict[str, int], *, compare: bool = False) -> None:
    """Refuse a run that cannot fit in the memory of ``--device`` (``pipelines.memory``): its video of ``sizes``
    (``num_frames``, ``height``, ``width``) and the scheduler's tables for ``--steps`` need more than there is.
    Call it before any folder is made or model loaded (``--device cuda`` imports torch for the GPU's memory)."""
    from pasa_diffusers.pipelines import memory

    cuda = args.device.startswith("cuda")
    dtype_bytes = {"fp16": 2, "bf16": 2, "fp32": 4, None: 2 if cuda else 4}[args.dtype]
    per_pixel, why = memory.bytes_per_frame_pixel(args.model, dtype_bytes=dtype_bytes, compare=compare)
    frames, height, width = sizes["num_frames"], sizes["height"], sizes["width"]
    video = frames * height * width * per_pixel
    steps = getattr(args, "steps", 1)
    tables = memory.steps_bytes(steps)
    there, where = memory.memory_there_is(args.device)
    if video + tables <= there:
        return
    more = f"more than the {memory.size_text(there)} of {where}"
    if tables > video:
        raise UsageError(f"--steps {steps}: the scheduler's tables for this many steps need at least "
                         f"{memory.size_text(tables)} of memory ({memory.SCHEDULER_BYTES_PER_STEP} bytes a step), "
                         f"{more}")
    raise UsageError(f"--frames {frames} --height {height} --width {width}: a video this size needs at least "
                     f"{memory.size_text(video + tables)} of memory ({memory.size_text(per_pixel)} a frame pixel: "
                     f"{why}), {more}; choose fewer frames or a smaller size")


def check_device(name: str, flag: str = "--device") -> None:
    """Refuse a CUDA device on a machine without one (or an index past the last GPU)."""
    if not name.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise UsageError(f"{flag} {name}: CUDA is not available on this machine (torch {torch.__version__}); "
                         "use --device cpu")
    index = int(name.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise UsageError(f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"indices 0..{torch.cuda.device_count() - 1}")


_KINDS = ((stat.S_ISREG, "a file"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"))


def path_kind(path: Path) -> str:
    """What ``path`` (which exists, or is a link) is, in words: ``"a folder"``, ``"a file"``, ``"a character
    device"``, ... or ``"a symbolic link to nothing"``."""
    if not path.exists():
        return "a symbolic link to nothing"
    mode = path.stat().st_mode
    if stat.S_ISDIR(mode):
        return "a folder"
    return next((kind for test, kind in _KINDS if test(mode)), "neither a file nor a folder")


def check_out_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Create the output folder now and check a file can be written in it: a path that is (or lies
    under) something other than a folder, a folder that cannot be created or one that cannot be written
    (``/proc/self``) is refused before any work.  Call it last in a ``validate``, so that a refused
    command leaves no folder behind for its other mistakes."""
    out = Path(path).expanduser()
    given = f"{flag} {os.fspath(path)}"
    blocker = next((p for p in (out, *out.parents) if p.exists() or p.is_symlink()), None)
    if blocker is not None and path_kind(blocker) != "a folder":
        raise UsageError(f"{given}: {blocker} is {path_kind(blocker)}, not a folder")
    if blocker != out:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"{given}: cannot create the folder under {blocker} ({exc.strerror or exc})") from exc
    try:
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise UsageError(f"{given}: {out} is not a writable folder (creating a file in it fails: "
                         f"{exc.strerror or exc})") from exc
    return out


def check_file(path: str | os.PathLike, flag: str) -> Path:
    """Refuse a path that is not an existing, readable file."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UsageError(f"{flag} {os.fspath(path)}: no such file")
    if not os.access(file, os.R_OK):
        raise UsageError(f"{flag} {os.fspath(path)}: the file is not readable")
    return file


def check_image(spec: str, flag: str = "--image") -> None:
    """Refuse an unknown ``builtin:`` name, a missing file, or a file that ``pipelines.images.read_rgb``
    cannot read as an RGB picture (not an image, truncated, NaN pixels...).  The file is read whole, as
    the run will read it, so its notices (transparency composited, a range assumed) come before any work."""
    if spec.startswith("builtin:"):
        if spec.removeprefix("builtin:") not in BUILTIN_IMAGES:
            raise UsageError(f"{flag} {spec}: unknown builtin image; expected one of "
                             f"{', '.join('builtin:' + n for n in BUILTIN_IMAGES)}")
        return
    path = check_file(spec, flag)
    from pasa_diffusers.pipelines.images import ImageError, read_rgb

    try:
        read_rgb(path)
    except ImageError as exc:
        raise UsageError(f"{flag} {spec}: {exc}") from exc


def check_model(model: str, flag: str = "--model") -> None:
    """Refuse a local path that is not a ``save_pretrained`` folder and a name that is neither a folder, a
    hub id (``names.is_hub_id``; whether it exists is checked when loading) nor a built-in model."""
    if model in ALL_BUILTIN_MODELS:
        return
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UsageError(f"{flag} {model}: a file, not a pipeline folder or a hub id 'org/name'")
        if not (path / "model_index.json").is_file():
            raise UsageError(f"{flag} {model}: the folder has no model_index.json; expected a folder written by "
                             "StableVideoDiffusionPipeline.save_pretrained()")
    elif not is_hub_id(model):
        raise UsageError(f"{flag} {model}: no such folder, and not a hub id 'org/name' nor a built-in model "
                         f"({', '.join(BUILTIN_MODELS)}) or video model ({', '.join(BUILTIN_VIDEO_MODELS)})")


def load_model(args: argparse.Namespace, *, video: bool = False) -> Any:
    """``load_svd`` with the generation flags, or with ``video`` ``video.load_pipeline`` (an SVD or a
    video-transformer pipeline, by what ``--model`` holds); a model that cannot be loaded is a
    ``UsageError`` naming ``--model``, and so is a built-in video model without ``video``."""
    from pasa_diffusers.pipelines.svd import ModelLoadError, load_svd
    from pasa_diffusers.pipelines.video import load_pipeline

    if not video and args.model in BUILTIN_VIDEO_MODELS:
        raise UsageError(f"--model {args.model}: a video-transformer pipeline; pasa {getattr(args, 'command', '')} "
                         "takes SVD pipelines only so far (pasa generate, pasa diagnose and pasa save-model take "
                         "both)")
    try:
        return (load_pipeline if video else load_svd)(args.model, device=args.device,
                                                      dtype=model_dtype(args.device, args.dtype),
                                                      local_files_only=args.local_files_only)
    except ModelLoadError as exc:
        message = str(exc).removeprefix("load_svd: ").removeprefix("load_video: ")
        raise UsageError(f"--model {args.model}: {message}") from exc


_FLAGS = {"num_frames": "--frames", "height": "--height", "width": "--width"}
_SETTING_FLAGS = {**_FLAGS, "num_inference_steps": "--steps"}


def generation_settings(args: argparse.Namespace, pipe: Any) -> dict[str, int]:
    """``num_frames``, ``num_inference_steps``, ``seed``, ``height`` and ``width`` of one generation of ``pipe``
    from the flags of ``add_generation_args(..., video=True)``: a flag not given takes the model's default
    (SVD: the command's; a video transformer: ``video.default_settings``); a value the video pipeline
    would round or get wrong is a ``UsageError`` naming the flag (``video.setting_problem``)."""
    from pasa_diffusers.pipelines.video import default_settings, is_video_pipeline, setting_problem

    video = is_video_pipeline(pipe)
    defaults = default_settings(pipe) if video else args.svd_defaults
    given = {name: getattr(args, flag.removeprefix("--")) for name, flag in _FLAGS.items()}
    sizes = {name: defaults[name] if value is None else value for name, value in given.items()}
    settings = {**sizes, "num_inference_steps": args.steps}
    problem = setting_problem(pipe, **settings) if video else None
    if problem is not None:
        name, why = problem
        raise UsageError(f"{_SETTING_FLAGS[name]} {settings[name]}: {why}")
    return {**settings, "seed": args.seed}


def conditioning_notice(pipe: Any) -> str | None:
    """The line a command prints about a video pipeline's conditioning (``video.NOTICE``), or ``None`` (SVD)."""
    from pasa_diffusers.pipelines.video import (NOTICE, PROMPT_SEED, is_video_pipeline, pooled_prompt_embeddings,
                                                prompt_attention_masks, prompt_embeddings)

    if not is_video_pipeline(pipe):
        return None
    positive, _ = prompt_embeddings(pipe)
    pooled = pooled_prompt_embeddings(pipe)
    pooled = f", then pooled ones of width {pooled[0].shape[1]}" if pooled is not None else ""
    masks = "; their attention masks keep every token" if prompt_attention_masks(pipe) is not None else ""
    return (f"{NOTICE}: unit Gaussians of {positive.shape[1]} tokens x {positive.shape[2]} (seed {PROMPT_SEED}: the "
            f"prompt's, then the negative prompt's{pooled}){masks}; no tokenizer or text encoder is loaded")


def load_condition_image(args: argparse.Namespace, settings: dict[str, int]) -> Any:
    """The ``--image`` at the generation's width x height (a PIL image): ``settings`` from
    ``generation_settings``, where a size flag not given has taken the model's default."""
    from pasa_diffusers.pipelines.svd import load_image

    return load_image(args.image, (settings["width"], settings["height"]))


def model_dtype(device: str, name: str | None) -> Any:
    """The model's torch dtype: ``--dtype`` (fp16, bf16, fp32), or fp16 on CUDA and fp32 on the CPU."""
    import torch

    if name is None:
        return torch.float16 if torch.device(device).type == "cuda" else torch.float32
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


def check_key_blocks(pipe: Any, settings: dict[str, int], backends: list[str] | tuple[str, ...], flag: str) -> None:
    """Refuse an 8-bit backend (``pasa-int8``, ``pasa-fp8``) for a run whose every attention call takes at most
    one key block (``rules.SHIFT_BLOCK`` keys): the backend computes each such call in 16 bits (its documented
    fallback, "one key block"), so none would run in 8 bits and its output would not be the backend's; checked
    once the model is loaded, before any step (``install.fallback_summary(strict=True)`` found it only after the
    whole video)."""
    from pasa_diffusers.backends import BACKENDS
    from pasa_diffusers.fallbacks import one_key_block
    from pasa_diffusers.pipelines.video import most_keys
    from pasa_diffusers.rules import SHIFT_BLOCK
    from pasa_diffusers.variants import EIGHT_BIT

    eight_bit = [name for name in backends if (variant := BACKENDS[name].variant) and variant.precision in EIGHT_BIT]
    if not eight_bit:
        return
    keys = most_keys(pipe, num_frames=settings["num_frames"], height=settings["height"], width=settings["width"])
    if keys is not None and one_key_block(keys):
        size = f"{settings['num_frames']} frames of {settings['height']}x{settings['width']}"
        raise UsageError(f"{flag} {','.join(backends)}: every attention call of {size} takes at most {keys} keys, one "
                         f"key block of {SHIFT_BLOCK}, which {', '.join(eight_bit)} computes in 16 bits (its "
                         "documented fallback): no call would run in 8 bits; generate a larger video (more than "
                         f"{SHIFT_BLOCK} tokens) or choose another backend")


def check_sparse_model(pipe: Any, backends: list[str] | tuple[str, ...], flag: str) -> None:
    """Refuse a sparse backend (``pasa-sparse``, ``pasa-fp8-sparse``: a mask over a video transformer's
    self-attention) for a pipeline that is not a video transformer's, once the model is loaded and before any
    video (``pasa compare`` would otherwise generate the reference first)."""
    from pasa_diffusers.backends import SPARSE
    from pasa_diffusers.pipelines.video import is_video_pipeline

    sparse = [name for name in backends if name in SPARSE]
    if sparse and not is_video_pipeline(pipe):
        raise UsageError(f"{flag} {','.join(backends)}: {', '.join(sparse)} mask(s) a video transformer's "
                         f"self-attention, and {type(pipe).__name__} has none (SVD's UNet); choose another backend "
                         "or a video transformer (Wan, LTX-Video, CogVideoX, HunyuanVideo, Mochi)")
