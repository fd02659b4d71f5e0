"""Limits of the files the project writes, checked before any work: the standard library only, so that the command
line reads them at its argument checks, before torch is imported.

A GIF stores each frame's delay as a 16-bit count of hundredths of a second (Pillow 12 writes ``int(duration / 10)``
there, ``duration`` in milliseconds), so a frame lasts at most 655.35 s and at least 0.01 s: ``fps`` below
``MIN_GIF_FPS`` cannot be written (Pillow raises ``struct.error`` once every video is made), and above
``MAX_GIF_FPS`` the delay written is 0, which players replace by their own (browsers: 0.1 s, 10 frames per
second), not the rate asked for.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path

__all__ = ["MIN_GIF_FPS", "MAX_GIF_FPS", "VIDEO_FORMATS", "fps_problem", "fps_argument", "formats_argument",
           "formats_problem", "frame_folder_problem", "file_target_problem", "video_targets_problem"]

VIDEO_FORMATS = ("mp4", "gif", "png")
"""The files a video is written as: an H.264 mp4 (through imageio-ffmpeg), a GIF, a folder of PNG frames."""

MAX_GIF_DELAY_CS = 2**16 - 1
"""The largest frame delay a GIF holds, in hundredths of a second."""
MIN_GIF_FPS = 100 / MAX_GIF_DELAY_CS
"""The lowest frame rate a GIF can play: one frame per 655.35 s (about 0.00153 frames per second)."""
MAX_GIF_FPS = 100.0
"""The highest frame rate a GIF can play: one frame per hundredth of a second (a delay of 1)."""


def fps_problem(fps: object, shown: str | None = None) -> str | None:
    """Why ``fps`` cannot be the frame rate of the written videos (mp4 and GIF), or ``None``; ``shown``: how the
    message writes the value (default ``repr``)."""
    shown = repr(fps) if shown is None else shown
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not (math.isfinite(fps) and fps > 0):
        return f"must be a finite number > 0, got {shown}"
    if fps < MIN_GIF_FPS:
        return f"must be at least {MIN_GIF_FPS:.6g} (a GIF frame lasts at most {MAX_GIF_DELAY_CS / 100} s), got {shown}"
    if fps > MAX_GIF_FPS:
        return f"must be at most {MAX_GIF_FPS:g} (a GIF frame lasts at least 0.01 s), got {shown}"
    return None


def fps_argument(text: str) -> float:
    """An argparse ``type=`` for ``--fps``: a finite number a GIF can play (``fps_problem``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    problem = fps_problem(value, text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def formats_argument(text: str) -> tuple[str, ...]:
    """An argparse ``type=`` for ``--formats``: a comma-separated subset of ``VIDEO_FORMATS``, in that order."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(VIDEO_FORMATS))
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(VIDEO_FORMATS)}, got "
                                         f"{text!r}")
    return tuple(name for name in VIDEO_FORMATS if name in names)


def formats_problem(formats: tuple[str, ...]) -> str | None:
    """Why ``formats`` cannot be written on this machine, or ``None``: an mp4 needs the imageio-ffmpeg package
    (its ffmpeg binary), looked up without importing it."""
    if "mp4" in formats and importlib.util.find_spec("imageio_ffmpeg") is None:
        return ("writing mp4 needs the imageio-ffmpeg package (pip install imageio-ffmpeg), which is not installed; "
                "or leave mp4 out, e.g. --formats gif,png")
    return None


def frame_folder_problem(out_dir: str | os.PathLike, prefix: str = "frame") -> str | None:
    """Why the folder of PNG frames ``out_dir`` cannot be replaced whole by a new video's, or ``None``: it exists as
    something other than a folder holding ``<prefix>_NNNN.png`` frames alone."""
    out_dir = Path(out_dir)
    if not (out_dir.exists() or out_dir.is_symlink()):
        return None
    if out_dir.is_symlink() or not out_dir.is_dir():
        return f"the frame folder {out_dir} exists and is not a folder; remove it or choose another --out"
    frame = re.compile(rf"{re.escape(prefix)}_\d{{4,}}\.png")
    other = sorted(entry.name for entry in out_dir.iterdir() if not (frame.fullmatch(entry.name) and entry.is_file()))
    if other:
        return (f"the frame folder {out_dir} holds {other[0]!r}, which is not a {prefix}_NNNN.png frame; a new video "
                "replaces that folder whole only when it holds frames alone: remove it or choose another --out")
    return None


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"))


def video_targets_problem(out_dir: str | os.PathLike, name: str, formats: Sequence[str]) -> str | None:
    """Why ``metrics.write_video(frames, out_dir, name, formats=formats)`` could not put its files in place, or
    ``None``: ``<name>.mp4`` or ``<name>.gif`` is something a file cannot replace (a folder, a named pipe, ...; a file
    or a symbolic link is replaced), or the frame folder ``<name>/`` is refused (``frame_folder_problem``).  Checked
    before any video is made, so no file of the video is written before another one fails."""
    out_dir = Path(out_dir)
    for kind in formats:
        if kind == "png":
            problem = frame_folder_problem(out_dir / name)
            if problem is not None:
                return problem
            continue
        problem = file_target_problem(out_dir / f"{name}.{kind}", f"the {kind} video")
        if problem is not None:
            return problem
    return None


def file_target_problem(path: str | os.PathLike, what: str) -> str | None:
    """Why a file (``what``, in words) cannot be put at ``path`` by a rename onto it, or ``None``: ``path`` is a folder,
    a named pipe, a device or a socket (absent, a file or a symbolic link, which the rename replaces, are fine)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    kind = next((words for test, words in _KINDS if test(mode)), None)
    if kind is None:
        return None
    return f"{path} is {kind}, where {what} is to be written; remove it or choose another --out"
