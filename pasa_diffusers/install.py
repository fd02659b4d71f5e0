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
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

from .attention_modules import attention_processors, set_processors
from . import backends, compat, processors, rules, sparse_processor
from .processors import CountedAttnProcessor, PASAAttnProcessor
from .routing import RoutedAttnProcessor, routable_reason, routed

__all__ = ["KINDS", "DENOISERS", "VIDEO_BLOCKS", "cast_dtype", "AllCallsFellBackError", "module_kind", "apply",
           "restore", "fallback_summary", "counted_processor", "attention_processors", "replacement", "denoisers"]

KINDS = ("spatial-self", "spatial-cross", "temporal-self", "temporal-cross", "video-self", "video-cross", "other")
"""Module kinds ``apply`` distinguishes, by processor key (see ``module_kind``)."""

DENOISERS = ("unet", "transformer", "transformer_2")
"""The pipeline components ``apply`` acts on: SVD's UNet, a video transformer (Wan 2.2 has two)."""

VIDEO_BLOCKS = ("blocks", "transformer_blocks", "single_transformer_blocks")
"""The top-level block lists of diffusers' video transformers (Wan; LTX-Video, CogVideoX, Mochi;
HunyuanVideo's single-stream blocks): their attentions span all video tokens (kind ``video-*``)."""

_STOCK_BODIES = (AttnProcessor2_0, AttnProcessor)
"""Stock processors whose body ``CountedAttnProcessor`` reproduces: replaced outright (SVD); any other
stock processor keeps its own body, its attention calls routed (``routing.py``)."""

_SAVED_ATTR = "_pasa_saved_processors"

class AllCallsFellBackError(RuntimeError):
    """Every attention call of a backend was computed by a fallback: its output is not the backend's."""


def module_kind(key: str) -> str:
    """The kind (one of ``KINDS``) of the attention module behind an ``attn_processors`` key: a UNet's
    spatial or temporal transformer blocks, a video transformer's top-level blocks (``VIDEO_BLOCKS``),
    self (``attn1``, or a joint ``attn``) or cross (``attn2``), else ``"other"``."""
    path = key.removesuffix(".processor")
    leaf = path.rsplit(".", 1)[-1]
    if path.split(".", 1)[0] in VIDEO_BLOCKS:
        return {"attn": "video-self", "attn1": "video-self", "attn2": "video-cross"}.get(leaf, "other")
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


def _pipeline_models(pipe: DiffusionPipeline, vae: bool) -> list[tuple[str, torch.nn.Module]]:
    """``(prefix, model)`` of a pipeline's denoisers (``DENOISERS`` present) and, with ``vae``, its VAE."""
    names = [name for name in DENOISERS if getattr(pipe, name, None) is not None] + (["vae"] if vae else [])
    return [(f"{name}.", getattr(pipe, name, None)) for name in names]


def denoisers(model_or_pipeline: Any) -> list[torch.nn.Module]:
    """A pipeline's denoisers (those of ``DENOISERS`` it has), or the model itself."""
    if isinstance(model_or_pipeline, DiffusionPipeline):
        return [getattr(model_or_pipeline, name) for name in DENOISERS
                if getattr(model_or_pipeline, name, None) is not None]
    return [model_or_pipeline]


def _components(model_or_pipeline: Any, vae: bool) -> list[tuple[str, torch.nn.Module]]:
    """``(prefix, model)`` pairs for ``apply``: the model itself, or a pipeline's denoisers (and VAE)."""
    if isinstance(model_or_pipeline, DiffusionPipeline):
        models = _pipeline_models(model_or_pipeline, vae)
        if not any(prefix.removesuffix(".") in DENOISERS for prefix, _ in models):
            raise ValueError(f"apply: pipeline {type(model_or_pipeline).__name__} has none of {', '.join(DENOISERS)}")
        for prefix, model in models:
            if model is None:
                raise ValueError(f"apply: pipeline {type(model_or_pipeline).__name__} has no {prefix.removesuffix('.')}")
    else:
        models = [("", model_or_pipeline)]
    _check_models("apply", models)
    return models


def _check_models(fn: str, models: list[tuple[str, Any]]) -> None:
    """Refuse, naming ``fn``, a model that is no ``torch.nn.Module`` or one without attention modules."""
    for _, model in models:
        if not isinstance(model, torch.nn.Module):
            raise ValueError(
                f"{fn}: expected a diffusers model with attention processors or a pipeline, "
                f"got {type(model).__name__}"
            )
        if not attention_processors(model):
            raise ValueError(f"{fn}: {type(model).__name__} has no attention modules")


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else next(model.parameters()).dtype


def _processor_class(entry: backends.Backend) -> type[CountedAttnProcessor]:
    home = sparse_processor if entry.processor in sparse_processor.__all__ else processors
    return getattr(home, entry.processor)


def _checked_arguments(backend: str, options: dict[str, Any]) -> tuple[dict[str, Any], tuple[torch.dtype, ...] | None]:
    """The constructor arguments of ``backend``'s processor, checked once, up front, and the input dtypes its
    precision takes (``None`` for a processor that is not PASA's).

    For a PASA processor: its options pass ``rules.check_options`` and an explicit ``dtype`` must be one
    its precision takes."""
    entry = backends.get(backend, "apply")
    absent = backends.missing(backend)
    if absent is not None:
        raise ValueError(f"apply: {absent}")
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
        return arguments, None
    defaults = {name: p.default for name, p in inspect.signature(PASAAttnProcessor).parameters.items()
                if name != "dtype"}
    settings = {**defaults, **getattr(cls, "FIXED", {}), **{k: v for k, v in arguments.items() if k in defaults}}
    rules.check_options(f"apply(backend={backend!r})", **settings)
    taken = rules.PRECISION_DTYPES[settings["precision"]]
    dtype = arguments.get("dtype")
    if dtype is not None and dtype not in taken:
        raise ValueError(f"apply: backend={backend!r} (precision={settings['precision']!r}) takes "
                         f"{', '.join(map(_dtype_name, taken))} attention inputs, got dtype={dtype!r}")
    return arguments, taken


def _model_arguments(checked: tuple[dict[str, Any], tuple[torch.dtype, ...] | None],
                     model_dtype: torch.dtype) -> dict[str, Any]:
    """The checked arguments (``_checked_arguments``) in a model of ``model_dtype``: without a ``dtype``, a
    PASA processor's q, k, v are cast to fp16 when its precision does not take the model's dtype."""
    arguments, taken = checked
    if taken is None or arguments.get("dtype") is not None or model_dtype in taken:
        return arguments
    return {**arguments, "dtype": torch.float16}


def cast_dtype(backend: str, model_dtype: torch.dtype, **options: Any) -> torch.dtype | None:
    """The dtype ``apply(model, backend, **options)`` casts q, k and v to in a model of ``model_dtype``
    (``None``: attention runs in the model's dtype)."""
    return _model_arguments(_checked_arguments(backend, options), model_dtype).get("dtype")


def _head_dim(module: torch.nn.Module) -> int | None:
    """The head dim of an attention module (diffusers' ``Attention`` and the video transformers' own), or
    ``None`` where it does not say."""
    heads, to_q = getattr(module, "heads", None), getattr(module, "to_q", None)
    if not isinstance(heads, int) or not hasattr(to_q, "out_features"):
        return None
    return to_q.out_features // heads


def _check_head_dim(processor: CountedAttnProcessor, module: torch.nn.Module, model_dtype: torch.dtype) -> None:
    """Refuse a PASA processor on a module whose head dim the op does not take (it would fail every call)."""
    head_dim = _head_dim(module)
    if not isinstance(processor, PASAAttnProcessor) or head_dim is None:
        return
    reason = rules.unsupported_reason(head_dim, processor.attention_dtype(model_dtype), processor.precision)
    if reason is not None:
        raise ValueError(
            f"apply: backend={processor.backend!r} cannot run {processor.name} ({reason}; the PASA op takes "
            f"head dims {rules.MIN_HEAD_DIM}..{rules.MAX_HEAD_DIM}); leave it out (spatial/temporal/video/cross/vae) "
            "or choose a non-PASA backend"
        )


def replacement(stock: Any, counted: CountedAttnProcessor) -> Any:
    """What replaces ``stock``: ``counted`` itself where it reproduces the stock body (``_STOCK_BODIES``, or
    a processor of this package, which runs that body), else the stock processor routed to it (a routed
    processor's own stock, when ``stock`` is one); ``ValueError`` naming the module where neither can be done."""
    if isinstance(stock, RoutedAttnProcessor):
        stock = stock.stock
    if type(stock) in _STOCK_BODIES or isinstance(stock, CountedAttnProcessor):
        return counted
    reason = routable_reason(stock)
    if reason is not None:
        raise ValueError(f"apply: cannot route {counted.name} ({reason}); leave it out or choose another backend")
    return routed(stock, counted)


def counted_processor(processor: Any) -> CountedAttnProcessor | None:
    """The ``CountedAttnProcessor`` that computes an installed processor's attention (itself, or the one a
    routed processor sends its calls to), or ``None`` for a processor ``apply`` did not install."""
    if isinstance(processor, RoutedAttnProcessor):
        return processor.counted
    return processor if isinstance(processor, CountedAttnProcessor) else None


def _label(processor: Any) -> str:
    """How the summary names an installed processor: its class, or the backend's via the stock body routed."""
    if isinstance(processor, RoutedAttnProcessor):
        return f"{type(processor.counted).__name__} via {type(processor.stock).__name__}"
    return type(processor).__name__


def apply(
    model_or_pipeline: Any,
    backend: str = "pasa",
    *,
    spatial: bool = True,
    temporal: bool = True,
    video: bool = True,
    cross: bool = True,
    vae: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """Install a fresh ``backend`` processor on every selected attention module.

    Args:
        model_or_pipeline: a diffusers model (e.g. ``UNetSpatioTemporalConditionModel``,
            ``WanTransformer3DModel``, ``HunyuanVideoTransformer3DModel``, ``LTXVideoTransformer3DModel``,
            ``CogVideoXTransformer3DModel``, ``MochiTransformer3DModel``, a VAE) or a pipeline, which stands
            for its denoisers (``pipe.unet``, or ``pipe.transformer`` and ``pipe.transformer_2``) and
            ``pipe.vae`` with ``vae=True``.  Where a model's processor is diffusers' ``AttnProcessor2_0``
            (SVD) it is replaced by the backend's; elsewhere the model's own processor keeps its body and
            its attention calls go to the backend (``routing.py``).
        backend: one of ``backends.BACKENDS``: ``"pasa"`` (the exact shift, fp32 softmax state: the default),
            ``"pasa-half"`` (the exact shift, fp16 scores and accumulator), ``"pasa-paper"`` (the paper's
            fully-FP16 PASA), ``"pasa-paper-hybrid"`` (the paper's shift, fp32 softmax state),
            ``"naive-half"``, ``"sdpa"``, ``"bf16"``, ``"fp32"``.
        spatial: select the attentions of spatial transformer blocks (``transformer_blocks``).
        temporal: select those of temporal blocks (``temporal_transformer_blocks``).
        video: select the attentions of a video transformer's blocks (``VIDEO_BLOCKS``: all video
            tokens, with the text tokens where the model joins them).
        cross: with ``spatial``/``temporal``/``video``, also select their cross-attentions (``attn2``),
            not only their self-attentions (``attn1``, or a joint ``attn``).
        vae: for a pipeline, also act on ``pipe.vae``.  Attention outside transformer blocks (kind
            ``"other"``, e.g. a VAE's mid-block attention) is selected in every model acted on.
        **options: constructor arguments of the processor, e.g. ``precision="fp64"``, ``beta=0.9`` (PASA's
            shift only: the ``pasa-paper`` backends),
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
    checked = _checked_arguments(backend, options)  # a bad backend or option fails first, checked once
    selected = {"spatial": spatial, "temporal": temporal, "video": video}
    counts = dict.fromkeys(KINDS, 0)
    installed = 0
    installed_kinds: set[str] = set()
    classes: dict[str, set[str]] = {kind: set() for kind in KINDS}
    model_dtypes: set[str] = set()
    attention_dtypes: set[str] = set()
    plans = []
    for prefix, model in models:
        dtype = _model_dtype(model)
        cls, arguments = _processor_class(backends.BACKENDS[backend]), _model_arguments(checked, dtype)
        stock = getattr(model, _SAVED_ATTR, None) or attention_processors(model)
        processors = attention_processors(model)
        for key in list(processors):
            kind = module_kind(key)
            counts[kind] += 1
            place, _, role = kind.partition("-")
            if kind == "other" or (selected[place] and (cross or role == "self")):
                counted = cls(**arguments)
                counted.name = prefix + key.removesuffix(".processor")
                counted.backend = backend
                counted.kind = kind
                _check_head_dim(counted, model.get_submodule(key.removesuffix(".processor")), dtype)
                model_dtypes.add(_dtype_name(dtype))
                attention_dtypes.add(_dtype_name(counted.attention_dtype(dtype)))
                processors[key] = compat.carry_parallel_config(processors[key], replacement(stock[key], counted))
                installed += 1
                installed_kinds.add(kind)
            classes[kind].add(_label(processors[key]))
        plans.append((model, processors))
    if installed == 0:
        raise ValueError(
            f"apply: nothing selected (spatial={spatial}, temporal={temporal}, video={video}, cross={cross}, "
            f"vae={vae}); "
            f"module counts {counts}"
        )
    needs = backends.BACKENDS[backend].needs_kind
    if needs is not None and needs not in installed_kinds:
        raise ValueError(f"apply: backend={backend!r} runs on a video transformer's self-attention (module kind "
                         f"{needs!r}), and the modules selected have none; module counts {counts}")
    for model, processors in plans:
        if not hasattr(model, _SAVED_ATTR):
            setattr(model, _SAVED_ATTR, attention_processors(model))
        set_processors(model, processors)
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
        models = [model for _, model in _pipeline_models(model_or_pipeline, vae=True)]
    else:
        models = [model_or_pipeline]
    saved = [(model, getattr(model, _SAVED_ATTR)) for model in models if hasattr(model, _SAVED_ATTR)]
    if not saved:
        raise ValueError(f"restore: no processors saved on {type(model_or_pipeline).__name__}; call apply() first")
    for model, processors in saved:
        installed = attention_processors(model)
        set_processors(model, {key: compat.carry_parallel_config(installed.get(key), stock)
                                for key, stock in processors.items()})
        delattr(model, _SAVED_ATTR)


def fallback_summary(model_or_pipeline: Any, *, strict: bool = False) -> dict[str, Any]:
    """Counters of every ``CountedAttnProcessor`` of a model (or a pipeline's denoisers and VAE), added up,
    routed processors' included (``counted_processor``).

    Args:
        strict: raise ``AllCallsFellBackError`` when the processors served calls and every one of them
            was a fallback (the output is then not the backend's: not a result to report).

    Raises:
        ValueError: ``model_or_pipeline`` is neither a pipeline nor a ``torch.nn.Module`` with attention
            modules (as ``apply`` refuses it).
        AllCallsFellBackError: with ``strict``, as above.

    Returns:
        ``{"backends": sorted names the processors were installed as, "processors", "calls": calls the
        processors received (the calls the backend targets), "fallback_calls", "fallbacks": {reason:
        calls}, "targeted_calls": calls the backend ran itself (calls - fallback_calls),
        "fallback_share": fallback_calls / calls (None without calls), "modules": {reason: sorted module
        paths}}``; a processor shared by several modules counts once.
    """
    if isinstance(model_or_pipeline, DiffusionPipeline):
        models = [(prefix, model) for prefix, model in _pipeline_models(model_or_pipeline, vae=True) if model is not None]
    else:
        models = [("", model_or_pipeline)]
        _check_models("fallback_summary", models)
    seen: set[int] = set()
    backends: set[str] = set()
    calls = 0
    fallbacks: dict[str, int] = {}
    modules: dict[str, list[str]] = {}
    for prefix, model in models:
        for key, installed in attention_processors(model).items():
            processor = counted_processor(installed)
            if processor is None:
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
            f"backend {', '.join(sorted(backends))}: {'the one attention call' if calls == 1 else f'all {calls} attention calls'} fell back "
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
