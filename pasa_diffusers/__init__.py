"""pasa-diffusers: overflow-free FP16 attention (PASA) for video diffusion.

The public API is imported on first use (PEP 562), so that ``import pasa_diffusers`` and the ``pasa``
command line start without importing torch or diffusers.  Subpackages: ``.pipelines``
(SVD loading, generation, comparison) and ``.metrics`` (frame quality and reports).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

_HOMES = {"pasa_attention": ".ops", "apply": ".install", "restore": ".install", "fallback_summary": ".install"}

if TYPE_CHECKING:
    from .install import apply, fallback_summary, restore
    from .ops import pasa_attention
    from .processors import (BF16AttnProcessor, FP32AttnProcessor, NaiveHalfAttnProcessor, PASAAttnProcessor,
                             SDPAAttnProcessor)


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'pasa_diffusers' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES.get(name, ".processors"), __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
