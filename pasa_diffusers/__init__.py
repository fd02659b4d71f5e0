"""pasa-diffusers: overflow-free FP16 attention (PASA) for video diffusion."""
from .ops import pasa_attention
from .processors import (BF16AttnProcessor, FP32AttnProcessor, NaiveHalfAttnProcessor, PASAAttnProcessor,
                         SDPAAttnProcessor, apply, fallback_summary, restore)

__all__ = [
    "pasa_attention",
    "apply",
    "restore",
    "fallback_summary",
    "PASAAttnProcessor",
    "FP32AttnProcessor",
    "NaiveHalfAttnProcessor",
    "BF16AttnProcessor",
    "SDPAAttnProcessor",
]
