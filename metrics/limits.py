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

__all__ = ["MIN_GIF_FPS", "MAX_GIF_FPS", "VIDEO_FORMATS", "fps_problem", "fps_argument", "formats_argument",
           "formats_problem"]

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
