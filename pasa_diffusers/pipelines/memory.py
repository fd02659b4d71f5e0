"""The memory a generation needs against the memory there is, checked before any folder is made or model loaded.

A video of ``F`` frames of ``H x W`` is decoded whole: every pipeline materialises its decoded frames, and an SVD
pipeline's VAE decodes every frame at once at full resolution (``svd.generate``: ``decode_chunk_size`` is the
frame count), so its peak memory grows with ``F H W``.  :func:`bytes_per_frame_pixel` is a lower bound of that growth:
``F H W`` times a number of bytes per frame pixel,

- for each built-in model, half the growth of the peak resident memory of its generations measured on the CPU
  in float32 between two sizes (``BYTES_PER_FRAME_PIXEL``; ``svd-xt-random``, not measured, is ``tiny``'s
  scaled by its VAE's width, 128 channels against 32), times the model dtype's size over float32's;
- for any other model (a hub id, a folder), 24 bytes: the decoded frames in float32, twice (the decoder's
  output and the ``[0, 1]`` frames made from it), which every pipeline holds at once.

Each denoising step also holds entries of the scheduler's tables (``SCHEDULER_BYTES_PER_STEP``: diffusers'
schedulers build ``np.arange(steps)`` in int64 and at least one float64 array of the same length from it).

:func:`memory_there_is` is the most memory the run can have: on the CPU the RAM and swap the kernel reports
(``MemTotal`` + ``SwapTotal``), or a cgroup's limit where it is larger (a machine whose memory grows on demand
reports too little at first); on CUDA the GPU's total memory.  A run that needs more cannot fit, whatever
else runs beside it; one that needs less may still run out of memory while others hold it.

Measured (2-core CPU, torch 2.14.1, diffusers 0.42.1, 2026-12-04; peak ``ru_maxrss`` of ``pasa generate
--model M --steps 1`` (LTX-Video and Mochi 2) at its default frames and two widths, or ``pasa compare --steps 1
--seeds 0 --images builtin:rocket --backends pasa`` at 4 frames of 48 x 48 and 48 x 512): tiny 2.3 KiB a
frame pixel (also between 4, 16 and 32 frames of 64 x 64), compare on tiny-resonant 3.4 KiB, tiny-wan 0.57 KiB,
tiny-ltx-video 0.11 KiB, tiny-cogvideox 1.2 KiB, tiny-hunyuan-video 1.1 KiB, tiny-mochi 1.0 KiB.
This module imports neither torch nor diffusers at import time (the command line checks its arguments first).
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["BYTES_PER_FRAME_PIXEL", "COMPARE_BYTES_PER_FRAME_PIXEL", "FRAMES_BYTES_PER_FRAME_PIXEL",
           "SCHEDULER_BYTES_PER_STEP", "bytes_per_frame_pixel", "steps_bytes", "host_memory", "memory_there_is",
           "size_text"]

BYTES_PER_FRAME_PIXEL: dict[str, int] = {
    "tiny": 1152, "tiny-resonant": 1152, "svd-xt-random": 4608,
    "tiny-wan": 288, "tiny-ltx-video": 56, "tiny-cogvideox": 608, "tiny-hunyuan-video": 552, "tiny-mochi": 512,
}
"""Built-in model -> bytes per frame pixel of a generation in float32 (half the measured growth; module docstring)."""
COMPARE_BYTES_PER_FRAME_PIXEL: dict[str, int] = {"tiny": 1728, "tiny-resonant": 1728, "svd-xt-random": 6912}
"""The same for ``pasa compare`` on an SVD model, which holds the reference's frames and a backend's at once."""
FRAMES_BYTES_PER_FRAME_PIXEL = 2 * 3 * 4
"""Any model: its decoded frames in float32, twice (the decoder's output and the frames made from it)."""
SCHEDULER_BYTES_PER_STEP = 16
"""Per denoising step: the scheduler's int64 ``arange`` and one float64 array of the same length."""

_UNLIMITED = 2**60
"""A cgroup limit at or above this means none (cgroup v1 writes 2^63 rounded down to a page)."""


def bytes_per_frame_pixel(model: str, *, dtype_bytes: int = 4, compare: bool = False) -> tuple[int, str]:
    """A lower bound of the bytes a generation of ``model`` holds per frame pixel at its peak, beyond what the
    model itself takes (module docstring), and where the number comes from, in words; ``dtype_bytes``: the size
    of the model's dtype (2 for fp16 and bf16), ``compare``: the run is ``pasa compare``'s."""
    in_compare = compare and model in COMPARE_BYTES_PER_FRAME_PIXEL
    table = COMPARE_BYTES_PER_FRAME_PIXEL if in_compare else BYTES_PER_FRAME_PIXEL
    if model not in table:
        return FRAMES_BYTES_PER_FRAME_PIXEL, "the decoded frames in float32, twice"
    per_pixel = max(table[model] * dtype_bytes // 4, FRAMES_BYTES_PER_FRAME_PIXEL)
    where = " in pasa compare" if in_compare else ""
    what = (f"tiny's{where}, scaled to svd-xt-random's 4x wider VAE" if model == "svd-xt-random"
            else f"half what {model} was measured to take{where}")
    return per_pixel, what + (" in float32, halved for 16 bits" if dtype_bytes < 4 else "")


def steps_bytes(steps: int) -> int:
    """A lower bound of the memory the scheduler's tables take for ``steps`` denoising steps."""
    return steps * SCHEDULER_BYTES_PER_STEP


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().split()[0]
    except (OSError, IndexError):
        return None
    return int(text) if text.isdigit() else None


def _meminfo() -> dict[str, int]:
    """``/proc/meminfo``'s fields in bytes (empty where there is none)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    fields = {}
    for line in lines:
        name, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            fields[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return fields


def host_memory() -> tuple[int, str]:
    """The most memory a process here can have, in bytes, and what it is, in words."""
    info = _meminfo()
    if "MemTotal" in info:
        total, what = info["MemTotal"] + info.get("SwapTotal", 0), "this machine's RAM and swap"
    else:
        total, what = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this machine's RAM"
    limits = [_read_int(Path("/sys/fs/cgroup/memory.max")),
              _read_int(Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))]
    limit = max((n for n in limits if n is not None and n < _UNLIMITED), default=None)
    if limit is not None and limit > total:
        return limit, "this process's cgroup memory limit"
    return total, what


def memory_there_is(device: str) -> tuple[int, str]:
    """The most memory a run on ``device`` (``cpu``, ``cuda``, ``cuda:N``) can have, in bytes, and what it is, in
    words (``"this machine's RAM and swap"``, ``"cuda:0 (NVIDIA H200)"``)."""
    if not device.startswith("cuda"):
        return host_memory()
    import torch

    index = int(device.partition(":")[2] or 0)
    props = torch.cuda.get_device_properties(index)
    return props.total_memory, f"{device} ({props.name})"


def size_text(n: int | float) -> str:
    """``n`` bytes in binary units with three significant digits (``23.5 GiB``, ``3.55 PiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")
