"""pasa-diffusers: overflow-free FP16 attention (PASA) for video diffusion."""
from .ops import pasa_attention

__all__ = ["pasa_attention"]
