"""``pasa generate``: one video with one attention backend."""
from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path
from typing import Any

from pasa_diffusers.metrics.limits import (MAX_GIF_FPS, MIN_GIF_FPS, VIDEO_FORMATS, fps_argument, formats_argument,
                                           file_target_problem, formats_problem, video_targets_problem)

from ..backends import BACKENDS, missing
from .common import (UsageError, add_generation_args, backend_help, check_key_blocks, check_sparse_model,
                     conditioning_notice, generation_settings, load_condition_image, load_model,
                     validate_generation_args)
from .sparse import add_sparse_args, sparse_options

__all__ = ["add_parser", "validate", "lock_out", "run"]


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""Write errors that more room cures: a full disk, a quota, a file-size limit (the targets were checked up front)."""


def _nonfinite(frames) -> tuple[int, int | None]:
    """How many frames hold a non-finite pixel, and the index of the first (``None`` if none)."""
    import numpy as np

    bad = np.flatnonzero(~np.isfinite(frames).all(axis=(1, 2, 3)))
    return int(bad.size), int(bad[0]) if bad.size else None


def _finite_note(count: int, first: int | None) -> str:
    return "all frames finite" if count == 0 else f"NON-FINITE frames: {count} (first index {first})"


def _attention_line(backend: str, summary: dict[str, Any], fallbacks: dict[str, Any]) -> str:
    """The run's attention in one line: the backend, its layers and processors, its calls and fallbacks."""
    names = list(dict.fromkeys(name for name in summary["processors"].values() if name))
    fell = fallbacks["fallback_calls"]
    reasons = ", ".join(f"{reason}: {calls}" for reason, calls in fallbacks["fallbacks"].items())
    return (f"attention: {backend} in {sum(summary['counts'].values())} layers ({', '.join(names)}, in "
            f"{summary['attention_dtype']}); {fallbacks['calls']} calls, "
            + (f"{fell} of them by a documented fallback ({reasons})" if fell else "none by a fallback"))


def validate(args: argparse.Namespace) -> None:
    """Check the backend (its package, and whether it runs on ``--device``), the model, image, output folder
    and device before anything is loaded; then lock the folder for this backend (``lock_out``)."""
    absent = missing(args.attention, args.device)
    if absent is not None:
        raise UsageError(f"--attention {args.attention}: {absent}")
    problem = formats_problem(args.formats)
    if problem is not None:
        raise UsageError(f"--formats {','.join(args.formats)}: {problem}")
    validate_generation_args(args)
    args.sparse_options = sparse_options(args, [args.attention], "--attention")
    problem = (video_targets_problem(args.out, args.attention, args.formats)  # a folder where pasa.gif goes, ...
               or file_target_problem(_summary_path(args), "the run's summary"))
    if problem is not None:
        raise UsageError(f"--out {args.out}: {problem}")
    lock_out(args)


def _summary_path(args: argparse.Namespace) -> Path:
    """Where the run's summary goes: ``OUT/BACKEND.json``, beside the video."""
    return Path(args.out).expanduser() / f"{args.attention}.json"


def _targets(args: argparse.Namespace) -> list[Path]:
    """The files (and, for png, the frame folder) this run writes into ``--out``: ``metrics.write_video``'s names and
    the summary."""
    out = Path(args.out).expanduser()
    return [*(out / (args.attention if kind == "png" else f"{args.attention}.{kind}") for kind in args.formats),
            _summary_path(args)]


def lock_out(args: argparse.Namespace) -> None:
    """Take ``OUT/.BACKEND.lock`` (``runlog.FolderLock``) into ``args.out_lock``: a second run of the same backend into
    the folder is refused at the argument checks, before torch's import (runs of other backends write other files, and
    share the folder).  ``run`` releases it, removing the file."""
    from pasa_diffusers.pipelines.runlog import FolderInUseError, FolderLock

    lock = FolderLock(Path(args.out).expanduser(), name=f".{args.attention}.lock",
                      holder=f"another pasa generate is writing the {args.attention} video into this folder",
                      remove=True)
    try:
        lock.acquire()
    except FolderInUseError as exc:
        raise UsageError(str(exc)) from exc
    args.out_lock = lock


def run(args: argparse.Namespace) -> int:
    """Generate under the lock ``validate`` took, saying first which earlier files of the backend the run replaces."""
    with args.out_lock:
        earlier = [path.name + ("/" if path.is_dir() else "") for path in _targets(args)
                   if path.exists() or path.is_symlink()]
        if earlier:
            print(f"pasa generate: replacing the earlier {args.attention} video in {args.out} ({', '.join(earlier)})",
                  file=sys.stderr, flush=True)
        return _generate(args)


def _generate(args: argparse.Namespace) -> int:
    from pasa_diffusers import metrics
    from pasa_diffusers.pipelines.sparse import sparse_line, sparse_summary
    from pasa_diffusers.pipelines.video import generate_frames, is_video_pipeline

    from .. import install

    pipe = load_model(args, video=True)
    settings = generation_settings(args, pipe)
    check_key_blocks(pipe, settings, [args.attention], "--attention")
    check_sparse_model(pipe, [args.attention], "--attention")
    try:
        summary = install.apply(pipe, args.attention, **args.sparse_options)
    except ValueError as exc:  # the backend cannot run this model's attention (e.g. its head dims)
        raise UsageError(f"--attention {args.attention}: {exc}") from exc
    image = None if is_video_pipeline(pipe) else load_condition_image(args, settings)
    notice = conditioning_notice(pipe)
    if notice:
        print(notice)
    frames = generate_frames(pipe, image, **settings)
    try:
        fallbacks = install.fallback_summary(pipe, strict=True)
    except install.AllCallsFellBackError as exc:
        raise UsageError(f"--attention {args.attention}: {exc}") from exc
    sparse = sparse_summary(pipe)
    try:
        written = metrics.write_video(frames, args.out, args.attention, fps=args.fps, formats=args.formats)
        nonfinite, first = _nonfinite(frames)
        written["summary"] = metrics.records.write_json(_summary_path(args), {
            "backend": args.attention, "model": args.model, "device": args.device, "settings": settings,
            "installed": summary["counts"], "processors": summary["processors"],
            "attention_dtype": summary["attention_dtype"], "calls": fallbacks["calls"],
            "fallbacks": fallbacks["fallbacks"], "sparse": sparse, "nonfinite_frames": nonfinite,
            "first_nonfinite": first,
            "files": {kind: str(path) for kind, path in written.items()}})
    except OSError as exc:  # a full disk, a folder made read-only meanwhile: no partial file is left (write_video)
        advice = ("free space or choose another --out" if exc.errno in _NO_SPACE
                  else "make the folder writable or choose another --out")
        raise UsageError(f"--out {args.out}: cannot write the video ({exc.strerror or exc}); the frames were made "
                         f"but not saved: {advice}, and run again") from exc
    print(_attention_line(args.attention, summary, fallbacks))
    if sparse is not None:
        print(sparse_line(sparse))
    print(_finite_note(nonfinite, first))
    for kind, path in written.items():
        print(f"wrote {kind}: {path}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="one video (SVD or a video transformer) using one attention backend",
                       description="Animate --image with the SVD pipeline --model (or, for a video-transformer "
                                   "pipeline such as tiny-wan, tiny-ltx-video, tiny-cogvideox, tiny-hunyuan-video or "
                                   "tiny-mochi, generate from fixed prompt embeddings), its attention "
                                   "computed by --attention, from the initial noise of --seed; write the video as "
                                   "mp4, gif and PNG frames (--formats) into --out; print the attention in one line "
                                   "(its processors, calls and fallbacks), whether every frame is finite and the "
                                   "files written; the summary in full goes to --out/BACKEND.json.")
    add_generation_args(p, "out/generate", video=True)
    p.add_argument("--attention", choices=tuple(BACKENDS), default="pasa", metavar="BACKEND",
                   help=f"the attention backend (default pasa): {backend_help(tuple(BACKENDS))}")
    p.add_argument("--fps", type=fps_argument, default=7.0, help="frames per second of the mp4 and gif, in "
                   f"[{MIN_GIF_FPS:.6g}, {MAX_GIF_FPS:g}] (a GIF frame lasts 0.01 to 655.35 s; default 7)")
    p.add_argument("--formats", type=formats_argument, default=",".join(VIDEO_FORMATS), metavar="LIST",
                   help=f"what to write, a comma-separated subset of {','.join(VIDEO_FORMATS)} (default "
                        f"{','.join(VIDEO_FORMATS)}; mp4 needs the imageio-ffmpeg package)")
    add_sparse_args(p)
    p.set_defaults(func=run)
