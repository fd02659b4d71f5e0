"""Frame-quality metrics, video writers and report writers for comparing attention backends.

This package only scores numpy arrays: it never imports the attention op, the processors or triton.
"""

from .quality import (
    ALEXNET_WEIGHTS_FILE,
    LPIPS_LABEL,
    LPIPS_RANDOM_LABEL,
    LPIPSScorer,
    LPIPSUnavailableError,
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
