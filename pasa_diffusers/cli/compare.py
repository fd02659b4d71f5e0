"""``pasa compare``: every backend's videos scored against the FP32-attention ones, over images and seeds.

The samples are every (image, seed) of ``--images`` x ``--seeds`` for an SVD model, and every (prompt, seed)
of a video transformer's pipeline (``--model tiny-wan``, a Wan hub id or folder): its fixed prompt embeddings,
its text encoder replaced (said on the first line of the output and in the report), x ``--seeds``; its
``--frames``, ``--height`` and ``--width`` default to the built-in model's own.  Each finished (sample, backend) is
appended to ``OUT/samples.jsonl`` at once, the same command resumes a killed or interrupted run (Ctrl-C
exits 130 saying how many results are done), a second run into a folder in use is refused, and the
report (``report.md``, ``report.json``, plots, the worst samples' side-by-side GIFs) is written at the end.
Under ``torchrun --standalone --nproc-per-node N --no-python pasa compare ...`` the samples are shared
out over the N processes (one per GPU with ``--device cuda``); rank 0 writes the report.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

from pasa_diffusers import cpu_math
from pasa_diffusers.backends import COMPARED, DEFAULT_COMPARED, REFERENCE, missing
from pasa_diffusers.metrics.limits import MAX_GIF_FPS, MIN_GIF_FPS, fps_argument
from pasa_diffusers.pipelines.names import BUILTIN_IMAGES, TINY_VIDEO_SETTINGS

from .common import (FILE, MAX_SEED, MODEL, SCORED_MIN_SIZE, UsageError, add_generation_args, backend_help,
                     check_device, check_file, check_image, check_key_blocks, check_memory, check_model,
                     check_sparse_model, int_range, load_model, model_dtype, model_help, path_kind)
from .sparse import add_sparse_args, sparse_options

__all__ = ["add_parser", "validate", "check_out", "check_not_in_use", "run", "seed_list", "image_list", "backend_list"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
"""Files of a folder given to ``--images`` that are taken as images (case-insensitive)."""
MAX_SEEDS = 100_000
INTERRUPTED = 130
"""The exit status after Ctrl-C (128 + SIGINT), as a shell reports a command killed by it."""


class _Unset(int):
    """The value of ``--frames``, ``--height`` or ``--width`` when the flag is not given: SVD's default, which a
    video transformer's pipeline replaces by the model's own (``compare.CompareConfig``: None)."""


def _items(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"an empty entry in {text!r}")
    return items


def _no_repeats(values: list, what: str) -> list:
    seen: set = set()
    repeated = [v for v in values if v in seen or seen.add(v)]
    if repeated:
        raise argparse.ArgumentTypeError(f"{what} {repeated[0]} is named more than once")
    return values


def seed_list(text: str) -> list[int]:
    """An argparse ``type=``: ``0,1,2``, a range ``0-7`` (both ends included) or both (``0-3,10``)."""
    seeds: list[int] = []
    for item in _items(text):
        lo, dash, hi = item.partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seeds like 0,1,2 or 0-7, got {item!r}") from None
        if not 0 <= first <= last <= MAX_SEED:
            raise argparse.ArgumentTypeError(f"{item!r}: seeds must lie in [0, 2**63-1], ranges go up (0-7)")
        if len(seeds) + last - first + 1 > MAX_SEEDS:
            raise argparse.ArgumentTypeError(f"more than {MAX_SEEDS} seeds in {text!r}")
        seeds.extend(range(first, last + 1))
    return _no_repeats(seeds, "seed")


def _folder_images(folder: Path, item: str) -> list[str]:
    files = sorted(str(p.resolve()) for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise argparse.ArgumentTypeError(f"folder {item!r} holds no image ({', '.join(IMAGE_SUFFIXES)})")
    return files


def image_list(text: str) -> list[str]:
    """An argparse ``type=``: ``SPEC[,SPEC...]``, each an image file, a folder of images (sorted by name, not
    recursive), ``builtin:NAME`` or ``builtin:all``; files become absolute paths.  Readability is
    checked by ``validate``."""
    images: list[str] = []
    for item in _items(text):
        if item == "builtin:all":
            images += [f"builtin:{name}" for name in BUILTIN_IMAGES]
        elif item.startswith("builtin:"):
            if item.removeprefix("builtin:") not in BUILTIN_IMAGES:
                raise argparse.ArgumentTypeError(f"unknown {item}; expected builtin:all or one of "
                                                 f"{', '.join('builtin:' + n for n in BUILTIN_IMAGES)}")
            images.append(item)
        else:
            path = Path(item).expanduser()
            if path.is_dir():
                images += _folder_images(path, item)
            elif path.is_file():
                images.append(str(path.resolve()))
            else:
                raise argparse.ArgumentTypeError(f"{item!r}: no such file or folder (or builtin:NAME)")
    return _no_repeats(images, "image")


def backend_list(text: str) -> list[str]:
    """An argparse ``type=``: comma-separated backends of ``backends.COMPARED``, each once (the reference,
    ``backends.REFERENCE``, is not one)."""
    names = _items(text)
    unknown = [n for n in names if n not in COMPARED]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {', '.join(unknown)}; choose from "
                                         f"{', '.join(COMPARED)} ({REFERENCE} is always the reference)")
    absent = [reason for name in names if (reason := missing(name))]
    if absent:
        raise argparse.ArgumentTypeError("; ".join(absent))
    return _no_repeats(names, "backend")


def check_out(path: str) -> None:
    """Refuse an ``--out`` that is (or lies under) a file, or where nothing can be written, creating nothing:
    ``compare.evaluate`` makes the folder only once the model and the images are known to be usable."""
    out = Path(path).expanduser()
    base = next(p for p in (out, *out.parents) if p.exists())  # the last parent, "/" or ".", exists
    if not base.is_dir():
        raise UsageError(f"--out {path}: {base} is {path_kind(base)}, not a folder")
    try:
        with tempfile.TemporaryDirectory(dir=base):
            pass
    except OSError as exc:
        raise UsageError(f"--out {path}: cannot write there ({exc.strerror or exc})") from exc


def check_not_in_use(path: str) -> None:
    """Refuse an ``--out`` that another ``pasa compare`` is running into (``runlog.FolderLock``), before the
    heavy imports: a run in progress always holds ``OUT/.lock``, so a folder without one is left alone (nothing
    is created).  Under torchrun only rank 0 asks (it takes the lock for its ranks later, and another rank may
    start after it has)."""
    from pasa_diffusers.pipelines.runlog import LOCK, FolderInUseError, FolderLock

    if int(os.environ.get("RANK", "0")) != 0 or not (Path(path).expanduser() / LOCK).is_file():
        return
    try:
        with FolderLock(Path(path).expanduser()) as lock:
            lock.acquire()
    except FolderInUseError as exc:
        raise UsageError(str(exc)) from exc


def validate(args: argparse.Namespace) -> None:
    """What ``type=`` cannot check, before any heavy import and before anything is written: model, images,
    LPIPS weights, device, torchrun, backends that cannot run on the device, whether a video of this size fits
    in memory (``check_memory``; a loaded video pipeline's own size, not known yet, is at least SVD's default),
    output folder (checked, not created; refused while another run holds it). Then, on the CPU, it pins torch's
    CPU math (``cpu_math``) before the first torch op, so that a run gives the same bits on every x86-64
    machine."""
    check_model(args.model)
    for image in args.images:
        if not image.startswith("builtin:"):
            check_image(image, "--images")
    if args.lpips_weights is not None:
        check_file(args.lpips_weights, "--lpips-weights")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and ":" in args.device:
        raise UsageError(f"--device {args.device}: under torchrun each rank runs on cuda:LOCAL_RANK; "
                         "pass --device cuda")
    absent = [reason for name in args.backends if (reason := missing(name, args.device))]
    if absent:
        raise UsageError(f"--backends {','.join(args.backends)}: {'; '.join(absent)}")
    check_device(args.device)
    check_memory(args, {name: TINY_VIDEO_SETTINGS[args.model][name]
                        if isinstance(value, _Unset) and args.model in TINY_VIDEO_SETTINGS else int(value)
                        for name, value in (("num_frames", args.frames), ("height", args.height),
                                            ("width", args.width))}, compare=True)
    args.sparse_options = sparse_options(args, args.backends, "--backends")
    check_out(args.out)
    check_not_in_use(args.out)
    if args.device == "cpu":
        cpu_math.pin()


def run(args: argparse.Namespace) -> int:
    from pasa_diffusers import install, metrics
    from pasa_diffusers.pipelines import compare, distributed, runlog

    command = "pasa " + shlex.join(sys.argv[1:])
    cond = compare.conditioning(args.model, args.images, local_files_only=args.local_files_only)
    sizes = {name: None if cond.video and isinstance(value, _Unset) else int(value)
             for name, value in (("num_frames", args.frames), ("height", args.height), ("width", args.width))}
    with distributed.session(args.device) as dist:
        if cond.notice and dist.is_main:
            print(cond.notice, flush=True)
        config = compare.CompareConfig(
            model=args.model, images=tuple(args.images), seeds=tuple(args.seeds), backends=tuple(args.backends),
            num_inference_steps=args.steps, **sizes,
            dtype=model_dtype(dist.device, args.dtype) if args.dtype else None, lpips_weights=args.lpips_weights,
            local_files_only=args.local_files_only, fps=args.fps, worst=args.worst, sparse=args.sparse_options)

        def load(device: str, dtype: object) -> object:
            from pasa_diffusers.pipelines.video import default_settings, is_video_pipeline

            pipe = load_model(argparse.Namespace(**{**vars(args), "device": device}), video=True)
            own = default_settings(pipe) if is_video_pipeline(pipe) else {}
            check_key_blocks(pipe, {name: own[name] if value is None else value for name, value in sizes.items()},
                             args.backends, "--backends")
            check_sparse_model(pipe, args.backends, "--backends")
            return pipe

        try:
            report = compare.evaluate(config, args.out, dist=dist, load_pipeline=load, command=command)
        except (runlog.MixedRunError, runlog.DamagedLogError, runlog.FolderInUseError, compare.SettingError,
                compare.WriteError) as exc:
            raise UsageError(str(exc)) from exc
        except install.AllCallsFellBackError as exc:
            raise UsageError(f"--backends: {exc}; choose another backend") from exc
        except compare.RunInterrupted as exc:
            print(f"pasa compare: {exc}", file=sys.stderr)
            return INTERRUPTED
    if report is not None:
        print(metrics.format_table(report))
        print(f"wrote {args.out}/report.md, report.json, samples.jsonl, plots and the worst samples' videos")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", conflict_handler="resolve",
                       help="score each attention backend's videos against the FP32-attention ones, over images "
                            "(or a video transformer's fixed prompt) and seeds, with bootstrap intervals",
                       description="Score each attention backend's videos against the FP32-attention reference "
                                   "over every (image, seed), or for a video-transformer pipeline such as tiny-wan "
                                   "every (prompt, seed), its prompt being fixed prompt embeddings (its --frames, "
                                   "--height and --width default to the model's own). Resumable: the same command "
                                   "continues a killed run. Under torchrun the samples are shared out over the "
                                   "processes.")
    add_generation_args(p, "out/compare", size=48, min_size=SCORED_MIN_SIZE)
    p.set_defaults(frames=_Unset(4), height=_Unset(48), width=_Unset(48))
    # --images/--seeds take the place of the generation flags --image/--seed (still accepted as aliases)
    p.add_argument("--images", "--image", type=image_list, default="builtin:all", metavar="SPEC[,SPEC...]",
                   help="conditioning images: files, folders of images, builtin:NAME "
                        f"({', '.join(BUILTIN_IMAGES)}) or builtin:all (default builtin:all); unused by a "
                        "video transformer's pipeline (tiny-wan), whose samples are its fixed prompt x --seeds")
    p.add_argument("--seeds", "--seed", type=seed_list, default="0-1", metavar="LIST",
                   help="seeds of the initial noise: 0,1,2 or a range 0-7 (default 0-1)")
    p.add_argument("--model", type=MODEL, default="tiny-resonant", help=model_help("tiny-resonant"))
    p.add_argument("--backends", type=backend_list, default=",".join(DEFAULT_COMPARED),
                   help=f"comma-separated (default {','.join(DEFAULT_COMPARED)}), from: {backend_help(COMPARED)}; "
                        f"{REFERENCE} is the reference")
    p.add_argument("--lpips-weights", type=FILE, default=None,
                   help="torchvision AlexNet ImageNet weights (alexnet-owt-7be5be79.pth); default: torch hub cache")
    p.add_argument("--fps", type=fps_argument, default=7.0, help="frame rate of the side-by-side GIFs, in "
                   f"[{MIN_GIF_FPS:.6g}, {MAX_GIF_FPS:g}] (a GIF frame lasts 0.01 to 655.35 s; default 7)")
    p.add_argument("--worst", type=int_range(0), default=2,
                   help="worst samples listed per backend, with their side-by-side GIFs (default 2)")
    add_sparse_args(p)
    p.set_defaults(func=run)
