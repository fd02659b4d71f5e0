"""Installing attention processors on a diffusers model or pipeline: ``apply``, ``restore``, counters.

``apply`` installs one fresh processor of a named backend (``BACKENDS``) on every selected attention
module, chosen by module kind (``module_kind``: spatial or temporal, self or cross, other);
``restore`` puts back the processors it replaced; ``fallback_summary`` adds up the counters of the
processors installed.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers import DiffusionPipeline

from .processors import (BF16AttnProcessor, CountedAttnProcessor, FP32AttnProcessor, NaiveHalfAttnProcessor,
                         PASAAttnProcessor, SDPAAttnProcessor)

__all__ = ["BACKENDS", "KINDS", "module_kind", "apply", "restore", "fallback_summary"]

KINDS = ("spatial-self", "spatial-cross", "temporal-self", "temporal-cross", "other")
"""Module kinds ``apply`` distinguishes, by processor key (see ``module_kind``)."""

_SAVED_ATTR = "_pasa_saved_processors"

BACKENDS: dict[str, tuple[type[CountedAttnProcessor], dict[str, Any]]] = {
    "pasa": (PASAAttnProcessor, {}),  # the processor's defaults: the exact shift, hybrid
    "pasa-half": (PASAAttnProcessor, {"precision": "half", "shift": "exact"}),
    "pasa-paper": (PASAAttnProcessor, {"precision": "half", "shift": True}),
    "pasa-paper-hybrid": (PASAAttnProcessor, {"precision": "hybrid", "shift": True}),
    "fp32": (FP32AttnProcessor, {}),
    "naive-half": (NaiveHalfAttnProcessor, {}),
    "sdpa": (SDPAAttnProcessor, {}),
    "bf16": (BF16AttnProcessor, {}),
}
"""Backend name -> (processor class, the constructor arguments the name fixes)."""


def module_kind(key: str) -> str:
    """The kind (one of ``KINDS``) of the attention module behind an ``attn_processors`` key."""
    path = key.removesuffix(".processor")
    leaf = path.rsplit(".", 1)[-1]
    if "temporal_transformer_blocks" in path:
        place = "temporal"
    elif "transformer_blocks" in path:
        place = "spatial"
    else:
        return "other"
    if leaf == "attn1":
        return f"{place}-self"
    if leaf == "attn2":
        return f"{place}-cross"
    return "other"


def _components(model_or_pipeline: Any, vae: bool) -> list[tuple[str, torch.nn.Module]]:
    """``(prefix, model)`` pairs for ``apply``: the model itself, or a pipeline's UNet (and VAE)."""
    if isinstance(model_or_pipeline, DiffusionPipeline):
        models = []
        for name in ("unet", "vae") if vae else ("unet",):
            model = getattr(model_or_pipeline, name, None)
            if model is None:
                raise ValueError(f"apply: pipeline {type(model_or_pipeline).__name__} has no {name}")
            models.append((f"{name}.", model))
    else:
        models = [("", model_or_pipeline)]
    for _, model in models:
        if not (hasattr(model, "attn_processors") and hasattr(model, "set_attn_processor")):
            raise ValueError(
                f"apply: expected a diffusers model with attention processors or a pipeline, "
                f"got {type(model).__name__}"
            )
        if not model.attn_processors:
            raise ValueError(f"apply: {type(model).__name__} has no attention modules")
    return models


def _make_processor(backend: str, options: dict[str, Any]) -> CountedAttnProcessor:
    if backend not in BACKENDS:
        raise ValueError(f"apply: unknown backend={backend!r}; expected one of {tuple(BACKENDS)}")
    cls, fixed = BACKENDS[backend]
    clashing = sorted(set(fixed) & set(options))
    if clashing:
        raise ValueError(f"apply: backend={backend!r} fixes {fixed}; remove {clashing} from the options")
    unknown = sorted(set(options) - set(inspect.signature(cls).parameters))
    if unknown:
        raise ValueError(f"apply: backend={backend!r} ({cls.__name__}) takes no options {unknown}")
    return cls(**fixed, **options)


def apply(
    model_or_pipeline: Any,
    backend: str = "pasa",
    *,
    spatial: bool = True,
    temporal: bool = True,
    cross: bool = True,
    vae: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """Install a fresh ``backend`` processor on every selected attention module.

    Args:
        model_or_pipeline: a diffusers model (e.g. ``UNetSpatioTemporalConditionModel``,
            ``UNet2DConditionModel``, a VAE) or a pipeline, which stands for ``pipe.unet`` (and
            ``pipe.vae`` with ``vae=True``).
        backend: one of ``BACKENDS``: ``"pasa"`` (the exact shift, fp32 softmax state: the default),
            ``"pasa-half"`` (the exact shift, fp16 scores and accumulator), ``"pasa-paper"`` (the paper's
            fully-FP16 PASA), ``"pasa-paper-hybrid"`` (the paper's shift, fp32 softmax state),
            ``"naive-half"``, ``"sdpa"``, ``"bf16"``, ``"fp32"``.
        spatial: select the attentions of spatial transformer blocks (``transformer_blocks``).
        temporal: select those of temporal blocks (``temporal_transformer_blocks``).
        cross: with ``spatial``/``temporal``, also select their cross-attentions (``attn2``), not only
            their self-attentions (``attn1``).
        vae: for a pipeline, also act on ``pipe.vae``.  Attention outside transformer blocks (kind
            ``"other"``, e.g. a VAE's mid-block attention) is selected in every model acted on.
        **options: constructor arguments of the processor, e.g. ``precision="fp64"``, ``beta=0.9``,
            ``dtype=torch.float16`` (every backend takes ``dtype``).

    Modules not selected keep their processor.  The processors found before the first ``apply`` are
    remembered on each model for ``restore``.

    Returns:
        ``{"backend", "options", "installed", "counts": {kind: modules}, "processors": {kind: class
        name(s) now installed, or None where the kind has no module}}``.
    """
    models = _components(model_or_pipeline, vae)
    _make_processor(backend, options)  # a bad backend or option fails first, whatever is selected
    selected = {"spatial": spatial, "temporal": temporal}
    warned: set[str] = set()
    counts = dict.fromkeys(KINDS, 0)
    installed = 0
    classes: dict[str, set[str]] = {kind: set() for kind in KINDS}
    plans = []
    for prefix, model in models:
        processors = dict(model.attn_processors)
        for key in list(processors):
            kind = module_kind(key)
            counts[kind] += 1
            place, _, role = kind.partition("-")
            if kind == "other" or (selected[place] and (cross or role == "self")):
                processor = _make_processor(backend, options)
                processor.name = prefix + key.removesuffix(".processor")
                processor._warned = warned
                processors[key] = processor
                installed += 1
            classes[kind].add(type(processors[key]).__name__)
        plans.append((model, processors))
    if installed == 0:
        raise ValueError(
            f"apply: nothing selected (spatial={spatial}, temporal={temporal}, cross={cross}, vae={vae}); "
            f"module counts {counts}"
        )
    for model, processors in plans:
        if not hasattr(model, _SAVED_ATTR):
            setattr(model, _SAVED_ATTR, dict(model.attn_processors))
        model.set_attn_processor(processors)
    return {
        "backend": backend,
        "options": dict(options),
        "installed": installed,
        "counts": counts,
        "processors": {kind: ", ".join(sorted(names)) or None for kind, names in classes.items()},
    }


def restore(model_or_pipeline: Any) -> None:
    """Put back the very processor objects that the first ``apply`` on this model or pipeline replaced."""
    if isinstance(model_or_pipeline, DiffusionPipeline):
        models = [getattr(model_or_pipeline, name, None) for name in ("unet", "vae")]
    else:
        models = [model_or_pipeline]
    saved = [(model, getattr(model, _SAVED_ATTR)) for model in models if hasattr(model, _SAVED_ATTR)]
    if not saved:
        raise ValueError(f"restore: no processors saved on {type(model_or_pipeline).__name__}; call apply() first")
    for model, processors in saved:
        model.set_attn_processor(dict(processors))
        delattr(model, _SAVED_ATTR)


def fallback_summary(model_or_pipeline: Any) -> dict[str, Any]:
    """Counters of every ``CountedAttnProcessor`` of a model (or a pipeline's UNet and VAE), added up.

    Returns:
        ``{"processors", "calls", "fallback_calls", "fallbacks": {reason: calls},
        "modules": {reason: sorted module paths}}``; a processor shared by several modules counts once.
    """
    if isinstance(model_or_pipeline, DiffusionPipeline):
        models = [
            (f"{name}.", getattr(model_or_pipeline, name))
            for name in ("unet", "vae")
            if getattr(model_or_pipeline, name, None) is not None
        ]
    else:
        models = [("", model_or_pipeline)]
    seen: set[int] = set()
    calls = 0
    fallbacks: dict[str, int] = {}
    modules: dict[str, list[str]] = {}
    for prefix, model in models:
        for key, processor in getattr(model, "attn_processors", {}).items():
            if not isinstance(processor, CountedAttnProcessor):
                continue
            for reason in processor.fallbacks:
                modules.setdefault(reason, []).append(prefix + key.removesuffix(".processor"))
            if id(processor) in seen:
                continue
            seen.add(id(processor))
            calls += processor.calls
            for reason, count in processor.fallbacks.items():
                fallbacks[reason] = fallbacks.get(reason, 0) + count
    return {
        "processors": len(seen),
        "calls": calls,
        "fallback_calls": sum(fallbacks.values()),
        "fallbacks": fallbacks,
        "modules": {reason: sorted(paths) for reason, paths in modules.items()},
    }
