"""Installing attention processors on a diffusers model or pipeline: ``apply``, ``restore``, counters.

``apply`` installs one fresh processor of a named backend (``backends.BACKENDS``) on every selected attention
module, chosen by module kind (``module_kind``: spatial or temporal, self or cross, other);
``restore`` puts back the processors it replaced; ``fallback_summary`` adds up the counters of the
processors installed.

``apply`` checks everything it can before installing anything: the backend name, its options
(``rules.check_options``), and, for the PASA backends, the head dim of every selected module.  The
PASA backends need low-precision inputs (``rules.PRECISION_DTYPES``: ``"pasa"`` and
``"pasa-paper-hybrid"`` take fp16 and bf16, the ``"half"`` ones and ``"naive-half"`` fp16 only): in a
model of another dtype (e.g. fp32, what ``load_svd("tiny")`` returns) ``apply`` casts q, k and v to
fp16 inside the processors unless ``dtype=`` says otherwise, and its summary reports the dtype
attention runs in (``"attention_dtype"``).  It never installs a processor that would fall back on
every call.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers import DiffusionPipeline

from . import backends, processors, rules
from .processors import CountedAttnProcessor, PASAAttnProcessor

__all__ = ["KINDS", "cast_dtype", "AllCallsFellBackError", "module_kind", "apply", "restore", "fallback_summary"]

KINDS = ("spatial-self", "spatial-cross", "temporal-self", "temporal-cross", "other")
"""Module kinds ``apply`` distinguishes, by processor key (see ``module_kind``)."""

_SAVED_ATTR = "_pasa_saved_processors"

class AllCallsFellBackError(RuntimeError):
    """Every attention call of a backend was computed by a fallback: its output is not the backend's."""


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


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else next(model.parameters()).dtype


def _processor_class(entry: backends.Backend) -> type[CountedAttnProcessor]:
    return getattr(processors, entry.processor)


def _processor_arguments(backend: str, options: dict[str, Any], model_dtype: torch.dtype) -> dict[str, Any]:
    """The constructor arguments of ``backend``'s processor in a model of ``model_dtype``, checked.

    For a PASA processor: its options pass ``rules.check_options``, an explicit ``dtype`` must be one
    its precision takes, and without one q, k, v are cast to fp16 when the model's dtype is not taken."""
    entry = backends.get(backend, "apply")
    cls, fixed = _processor_class(entry), entry.options
    clashing = sorted(set(fixed) & set(options))
    if clashing:
        raise ValueError(f"apply: backend={backend!r} fixes {fixed}; remove {clashing} from the options")
    parameters = inspect.signature(cls).parameters
    unknown = sorted(set(options) - set(parameters))
    if unknown:
        raise ValueError(f"apply: backend={backend!r} ({cls.__name__}) takes no options {unknown}")
    arguments = {**fixed, **options}
    if not issubclass(cls, PASAAttnProcessor):
        return arguments
    defaults = {name: p.default for name, p in inspect.signature(PASAAttnProcessor).parameters.items()
                if name != "dtype"}
    settings = {**defaults, **getattr(cls, "FIXED", {}), **{k: v for k, v in arguments.items() if k in defaults}}
    rules.check_options(f"apply(backend={backend!r})", **settings)
    taken = rules.PRECISION_DTYPES[settings["precision"]]
    dtype = arguments.get("dtype")
    if dtype is not None and dtype not in taken:
        raise ValueError(f"apply: backend={backend!r} (precision={settings['precision']!r}) takes "
                         f"{', '.join(map(_dtype_name, taken))} attention inputs, got dtype={dtype!r}")
    if dtype is None and model_dtype not in taken:
        arguments["dtype"] = torch.float16
    return arguments


def cast_dtype(backend: str, model_dtype: torch.dtype, **options: Any) -> torch.dtype | None:
    """The dtype ``apply(model, backend, **options)`` casts q, k and v to in a model of ``model_dtype``
    (``None``: attention runs in the model's dtype)."""
    return _processor_arguments(backend, options, model_dtype).get("dtype")


def _check_head_dim(processor: CountedAttnProcessor, module: torch.nn.Module, model_dtype: torch.dtype) -> None:
    """Refuse a PASA processor on a module whose head dim the op does not take (it would fail every call)."""
    if not isinstance(processor, PASAAttnProcessor):
        return
    head_dim = module.to_k.out_features // module.heads
    reason = rules.unsupported_reason(head_dim, processor.attention_dtype(model_dtype), processor.precision)
    if reason is not None:
        raise ValueError(
            f"apply: backend={processor.backend!r} cannot run {processor.name} ({reason}; the PASA op takes "
            f"head dims {rules.MIN_HEAD_DIM}..{rules.MAX_HEAD_DIM}); leave it out (spatial/temporal/cross/vae) "
            "or choose a non-PASA backend"
        )


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
        backend: one of ``backends.BACKENDS``: ``"pasa"`` (the exact shift, fp32 softmax state: the default),
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
            ``dtype=torch.float16`` (every backend takes ``dtype``: the dtype q, k, v are cast to).

    Modules not selected keep their processor.  The processors found before the first ``apply`` are
    remembered on each model for ``restore``.

    Raises:
        ValueError: an unknown backend or option, an option out of range (``rules.check_options``), a
            ``dtype`` the backend's precision does not take, a selected module whose head dim the PASA
            op does not take, or nothing selected; nothing is installed then.

    Returns:
        ``{"backend", "options", "installed", "counts": {kind: modules}, "processors": {kind: class
        name(s) now installed, or None where the kind has no module}, "model_dtype", "attention_dtype"}``;
        the dtypes are names (``"float32"``), comma-separated if the models acted on differ.
    """
    models = _components(model_or_pipeline, vae)
    _processor_arguments(backend, options, torch.float32)  # a bad backend or option fails first
    selected = {"spatial": spatial, "temporal": temporal}
    counts = dict.fromkeys(KINDS, 0)
    installed = 0
    classes: dict[str, set[str]] = {kind: set() for kind in KINDS}
    model_dtypes: set[str] = set()
    attention_dtypes: set[str] = set()
    plans = []
    for prefix, model in models:
        dtype = _model_dtype(model)
        cls, arguments = _processor_class(backends.BACKENDS[backend]), _processor_arguments(backend, options, dtype)
        processors = dict(model.attn_processors)
        for key in list(processors):
            kind = module_kind(key)
            counts[kind] += 1
            place, _, role = kind.partition("-")
            if kind == "other" or (selected[place] and (cross or role == "self")):
                processor = cls(**arguments)
                processor.name = prefix + key.removesuffix(".processor")
                processor.backend = backend
                _check_head_dim(processor, model.get_submodule(key.removesuffix(".processor")), dtype)
                model_dtypes.add(_dtype_name(dtype))
                attention_dtypes.add(_dtype_name(processor.attention_dtype(dtype)))
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
        "model_dtype": ", ".join(sorted(model_dtypes)),
        "attention_dtype": ", ".join(sorted(attention_dtypes)),
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


def fallback_summary(model_or_pipeline: Any, *, strict: bool = False) -> dict[str, Any]:
    """Counters of every ``CountedAttnProcessor`` of a model (or a pipeline's UNet and VAE), added up.

    Args:
        strict: raise ``AllCallsFellBackError`` when the processors served calls and every one of them
            was a fallback (the output is then not the backend's: not a result to report).

    Returns:
        ``{"backends": sorted names the processors were installed as, "processors", "calls": calls the
        processors received (the calls the backend targets), "fallback_calls", "fallbacks": {reason:
        calls}, "targeted_calls": calls the backend ran itself (calls - fallback_calls),
        "fallback_share": fallback_calls / calls (None without calls), "modules": {reason: sorted module
        paths}}``; a processor shared by several modules counts once.
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
    backends: set[str] = set()
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
            backends.add(processor.backend or type(processor).__name__)
            calls += processor.calls
            for reason, count in processor.fallbacks.items():
                fallbacks[reason] = fallbacks.get(reason, 0) + count
    fallback_calls = sum(fallbacks.values())
    if strict and calls and fallback_calls == calls:
        raise AllCallsFellBackError(
            f"backend {', '.join(sorted(backends))}: all {calls} attention calls fell back "
            f"({', '.join(f'{reason}: {count}' for reason, count in sorted(fallbacks.items()))}); "
            "none ran the backend itself, so its output is not the backend's"
        )
    return {
        "backends": sorted(backends),
        "processors": len(seen),
        "calls": calls,
        "fallback_calls": fallback_calls,
        "fallbacks": fallbacks,
        "targeted_calls": calls - fallback_calls,
        "fallback_share": fallback_calls / calls if calls else None,
        "modules": {reason: sorted(paths) for reason, paths in modules.items()},
    }
