"""Frame-quality metrics, video writers and report writers for comparing attention backends.

This package only scores numpy arrays: it never imports the attention op, the processors or triton.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .quality import (
        ALEXNET_WEIGHTS_FILE,
        LPIPS_LABEL,
        LPIPS_RANDOM_LABEL,
        LPIPSScorer,
        LPIPSUnavailableError,
        LPIPSWeightsError,
        default_alexnet_weights_path,
        flicker_ratio,
        lpips_status,
        nonfinite_frames,
        psnr_frame,
        psnr_frames,
        score_video,
        ssim_frame,
        ssim_frames,
        temporal_error,
        validate_frame,
        validate_video,
    )
    from .records import json_float, json_safe
    from .report import build_report, format_markdown, format_table, table_rows, write_report
    from .video import pad_even, side_by_side, to_uint8, write_gif, write_mp4, write_png_frames, write_video

__all__ = [
    "ALEXNET_WEIGHTS_FILE",
    "LPIPS_LABEL",
    "LPIPS_RANDOM_LABEL",
    "LPIPSScorer",
    "LPIPSUnavailableError",
    "LPIPSWeightsError",
    "default_alexnet_weights_path",
    "build_report",
    "flicker_ratio",
    "format_markdown",
    "format_table",
    "json_float",
    "json_safe",
    "lpips_status",
    "nonfinite_frames",
    "pad_even",
    "psnr_frame",
    "psnr_frames",
    "score_video",
    "side_by_side",
    "ssim_frame",
    "ssim_frames",
    "table_rows",
    "temporal_error",
    "to_uint8",
    "validate_frame",
    "validate_video",
    "write_gif",
    "write_mp4",
    "write_png_frames",
    "write_report",
    "write_video",
]

_SUBMODULES = ("limits", "quality", "records", "report", "stats", "video")
_HOMES = {name: home for home, names in {
    "quality": ("ALEXNET_WEIGHTS_FILE", "LPIPS_LABEL", "LPIPS_RANDOM_LABEL", "LPIPSScorer", "LPIPSUnavailableError",
                "LPIPSWeightsError", "default_alexnet_weights_path", "flicker_ratio", "lpips_status",
                "nonfinite_frames",
                "psnr_frame", "psnr_frames", "score_video", "ssim_frame", "ssim_frames", "temporal_error",
                "validate_frame", "validate_video"),
    "records": ("json_float", "json_safe"),
    "report": ("build_report", "format_markdown", "format_table", "table_rows", "write_report"),
    "video": ("pad_even", "side_by_side", "to_uint8", "write_gif", "write_mp4", "write_png_frames", "write_video"),
}.items() for name in names}
"""Public name -> the submodule it lives in: imported on first use (PEP 562), so that ``metrics.limits`` (what the
command line checks before torch is imported) is read without importing torch, numpy or imageio."""


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name not in _HOMES:
        raise AttributeError(f"module 'pasa_diffusers.metrics' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
