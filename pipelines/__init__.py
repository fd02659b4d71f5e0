"""Pipelines driven by the PASA processors: loading and generation with explicit latents."""
from .svd import BUILTIN_IMAGES, TINY_DEFAULTS, generate, load_image, load_svd, make_latents

__all__ = ["load_svd", "load_image", "make_latents", "generate", "BUILTIN_IMAGES", "TINY_DEFAULTS"]
