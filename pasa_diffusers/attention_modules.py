"""Where a diffusers model keeps its attention processors: read them and put others in their place.

One rule for ``install`` (which replaces or routes them) and the diagnosis (which records through them):
diffusers' ``attn_processors`` / ``set_attn_processor`` where the model has them (a UNet, most
transformers), else every submodule that holds a ``processor`` beside the projections ``to_q`` / ``to_k``
(``MochiTransformer3DModel`` has no ``attn_processors``).
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["attention_processors", "set_processors"]


def attention_processors(model: torch.nn.Module) -> dict[str, Any]:
    """``{"<module path>.processor": processor}`` of a model's attention modules, in module order."""
    if hasattr(model, "attn_processors"):
        return dict(model.attn_processors)
    return {f"{name}.processor": module.processor for name, module in model.named_modules()
            if callable(getattr(module, "processor", None)) and hasattr(module, "to_q") and hasattr(module, "to_k")}


def set_processors(model: torch.nn.Module, processors: dict[str, Any]) -> None:
    """Install ``processors`` (keyed as :func:`attention_processors` keys them) on ``model``."""
    if hasattr(model, "set_attn_processor"):
        model.set_attn_processor(dict(processors))
        return
    for key, processor in processors.items():
        model.get_submodule(key.removesuffix(".processor")).processor = processor
