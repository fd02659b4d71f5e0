"""Write frames as mp4 / gif / PNG and build side-by-side comparison videos.

Frames are floating numpy arrays in [0, 1], ``(F, H, W, 3)`` (or ``(H, W, 3)``
for :func:`to_uint8`), validated like the metrics' (non-empty, finite values in
[0, 1]) before anything is written. Non-finite pixels are painted magenta so
that an overflowing backend is visible in every written file.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import imageio.v2 as iio2
import imageio.v3 as iio
import numpy as np
from matplotlib import colormaps

from .limits import VIDEO_FORMATS, fps_problem, frame_folder_problem, video_targets_problem
from .quality import validate_video
from .records import atomic_path, write_atomic

MAGENTA = np.array([1.0, 0.0, 1.0])
SEPARATOR_PX = 2


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """Clip float frames to [0, 1] and round to uint8; pixels with any non-finite channel become magenta."""
    if not isinstance(frames, np.ndarray) or frames.ndim not in (3, 4) or frames.shape[-1] != 3:
        raise ValueError(f"frames must be a (H, W, 3) or (F, H, W, 3) array, got {getattr(frames, 'shape', frames)!r}")
    if not np.issubdtype(frames.dtype, np.floating):
        raise ValueError(f"frames must have a floating dtype with values in [0, 1], got {frames.dtype}")
    bad = ~np.isfinite(frames).all(axis=-1)
    clean = np.where(bad[..., None], MAGENTA, np.nan_to_num(frames, nan=0.0, posinf=1.0, neginf=0.0))
    return np.rint(np.clip(clean, 0.0, 1.0) * 255.0).astype(np.uint8)


def write_png_frames(frames: np.ndarray, out_dir: str | Path, prefix: str = "frame") -> list[Path]:
    """Write each frame as ``<out_dir>/<prefix>_0000.png``, ...; return the paths.

    ``out_dir`` holds one video: its frames are written into a new folder beside it, which then takes its
    place whole, so frames of an earlier, longer video never stay behind the new ones.  An ``out_dir`` that
    holds anything but ``<prefix>_NNNN.png`` frames (another file, a folder) is refused (``ValueError``)
    before anything is written.
    """
    pixels = to_uint8(validate_video(frames, "frames"))
    out_dir = Path(out_dir)
    check_frame_folder(out_dir, prefix)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        for i, frame in enumerate(pixels):
            iio.imwrite(tmp / f"{prefix}_{i:04d}.png", frame)
        if out_dir.is_dir():
            out_dir.rename(old)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return [out_dir / f"{prefix}_{i:04d}.png" for i in range(len(pixels))]


def check_frame_folder(out_dir: str | Path, prefix: str = "frame") -> None:
    """Refuse (``ValueError``) an ``out_dir`` that exists as something other than a folder of ``<prefix>_NNNN.png``
    frames: ``write_png_frames`` would replace it whole (``limits.frame_folder_problem``)."""
    problem = frame_folder_problem(out_dir, prefix)
    if problem is not None:
        raise ValueError(problem)


def write_gif(frames: np.ndarray, path: str | Path, fps: float = 7) -> Path:
    """Write an endlessly looping GIF (Pillow plugin) at ``fps`` frames per second (at least ``limits.MIN_GIF_FPS``):
    encoded in memory, written to a temporary name beside ``path``, then renamed onto it."""
    pixels = to_uint8(validate_video(frames, "frames"))
    _check_fps(fps)
    path = Path(path)
    data = iio.imwrite("<bytes>", pixels, plugin="pillow", extension=".gif", duration=1000.0 / fps, loop=0)
    return write_atomic(path, data)  # a failed write (a full disk) leaves no truncated GIF, and an earlier one whole


def pad_even(pixels: np.ndarray) -> np.ndarray:
    """Pad ``(F, H, W, C)`` frames at the bottom/right by edge replication so H and W are even."""
    pad_h, pad_w = pixels.shape[1] % 2, pixels.shape[2] % 2
    if not (pad_h or pad_w):
        return pixels
    return np.pad(pixels, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")


def write_mp4(frames: np.ndarray, path: str | Path, fps: float = 7) -> Path:
    """Write an H.264 (libx264, yuv420p) mp4 via imageio-ffmpeg; odd sizes are padded to even.  Written to a temporary
    name beside ``path`` (same suffix), then renamed onto it."""
    pixels = pad_even(to_uint8(validate_video(frames, "frames")))
    _check_fps(fps)
    try:
        import imageio_ffmpeg  # noqa: F401  (the ffmpeg binary behind imageio's FFMPEG plugin)
    except ImportError as exc:
        raise RuntimeError("writing mp4 needs the imageio-ffmpeg package: pip install imageio-ffmpeg") from exc
    path = Path(path)
    with atomic_path(path) as tmp:  # as write_gif: never a truncated file
        _write_h264(pixels, tmp, fps)
    return path


def _write_h264(pixels: np.ndarray, path: Path, fps: float) -> None:
    writer = iio2.get_writer(
        path,
        format="FFMPEG",
        mode="I",
        fps=fps,
        codec="libx264",
        pixelformat="yuv420p",
        quality=8,
        macro_block_size=1,
    )
    with writer:
        for frame in pixels:
            writer.append_data(frame)


def write_video(
    frames: np.ndarray,
    out_dir: str | Path,
    name: str,
    fps: float = 7,
    formats: Sequence[str] = VIDEO_FORMATS,
) -> dict[str, Path]:
    """Write ``frames`` in each of ``formats``: ``<name>.mp4``, ``<name>.gif``, PNGs in ``<name>/``.

    The frames, ``fps``, ``formats`` and every target (``limits.video_targets_problem``: no folder where a file goes,
    a frame folder of frames alone) are checked before anything is written, and every path returned exists. Each
    file replaces an earlier one of the same name whole, and the frame folder is replaced whole: the folder holds one
    video, never frames of two. Returns ``{format: path}``; for ``"png"`` the path is the folder of frames.
    """
    unknown = sorted(set(formats) - set(VIDEO_FORMATS))
    if unknown:
        raise ValueError(f"formats must be among {VIDEO_FORMATS}, got unknown {unknown}")
    if not formats:
        raise ValueError(f"formats is empty; choose from {VIDEO_FORMATS}")
    validate_video(frames, "frames")
    _check_fps(fps)
    out_dir = Path(out_dir)
    problem = video_targets_problem(out_dir, name, formats)  # every target, before the first file is written
    if problem is not None:
        raise ValueError(problem)
    written: dict[str, Path] = {}
    if "mp4" in formats:
        written["mp4"] = write_mp4(frames, out_dir / f"{name}.mp4", fps=fps)
    if "gif" in formats:
        written["gif"] = write_gif(frames, out_dir / f"{name}.gif", fps=fps)
    if "png" in formats:
        write_png_frames(frames, out_dir / name)
        written["png"] = out_dir / name
    missing = [str(path) for path in written.values() if not path.exists()]
    if missing:
        raise RuntimeError(f"write_video: {missing} were not written")
    return written


def side_by_side(ref: np.ndarray, test: np.ndarray, *, gain: float = 10.0) -> np.ndarray:
    """Per frame ``[reference | backend | difference heatmap]`` with thin white separators.

    The heatmap is the absolute difference averaged over channels, times
    ``gain``, clipped to [0, 1] and mapped through matplotlib's ``inferno``.
    Non-finite backend pixels are magenta in the backend panel and in the
    heatmap. Returns finite float frames ``(F, H, 3 * W + 4, 3)`` in [0, 1].
    """
    ref, test = validate_video(ref, "ref"), validate_video(test, "test")
    if ref.shape != test.shape:
        raise ValueError(f"ref and test must have the same shape, got ref {ref.shape} and test {test.shape}")
    if not gain > 0:
        raise ValueError(f"gain must be > 0, got {gain}")
    bad = ~np.isfinite(test).all(axis=-1, keepdims=True)
    ref_panel = np.clip(np.nan_to_num(ref, nan=0.0, posinf=1.0, neginf=0.0), 0.0, 1.0)
    test_panel = np.where(bad, MAGENTA, np.clip(np.nan_to_num(test, nan=0.0), 0.0, 1.0))
    with np.errstate(invalid="ignore"):
        diff = np.clip(np.abs(test - ref).mean(axis=-1) * gain, 0.0, 1.0)
    heat = colormaps["inferno"](np.nan_to_num(diff, nan=0.0))[..., :3]
    heat = np.where(bad, MAGENTA, heat)
    sep = np.ones((*ref.shape[:2], SEPARATOR_PX, 3))
    return np.concatenate([ref_panel, sep, test_panel, sep, heat], axis=2)


def _check_fps(fps: float) -> None:
    problem = fps_problem(fps)
    if problem is not None:
        raise ValueError(f"fps {problem}")
