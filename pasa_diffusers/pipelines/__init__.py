"""Pipelines driven by the PASA processors: loading and generation with explicit latents, comparison,
diagnosis runs, the built-in models.

The names below are imported on first use (PEP 562), so that ``pasa_diffusers.pipelines.names`` (what
the pipelines take by name) can be read by the command line without importing torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["load_svd", "load_image", "make_latents", "generate", "BUILTIN_MODELS", "BUILTIN_IMAGES", "TINY_DEFAULTS"]

_HOMES = {"BUILTIN_MODELS": ".names", "BUILTIN_IMAGES": ".names"}

if TYPE_CHECKING:
    from .names import BUILTIN_IMAGES, BUILTIN_MODELS
    from .svd import TINY_DEFAULTS, generate, load_image, load_svd, make_latents


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'pasa_diffusers.pipelines' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES.get(name, ".svd"), __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
