"""Context parallelism: this package's attention backends under diffusers' Ulysses and ring attention.

diffusers (0.35 and later) splits a video transformer's sequence over the ranks of a
``ContextParallelConfig`` (``model.enable_parallelism(config=...)``: the model's ``_cp_plan`` shards the
hidden states and RoPE tables where the blocks start and gathers the output at ``proj_out``) and sets
the config on every attention processor (``processor._parallel_config``).  The processor's call to
``dispatch_attention_fn(..., parallel_config=...)`` then runs, for a backend that declares support,
``attention_dispatch._templated_context_parallel_attention`` around the backend's *forward op* (a
function ``op(ctx, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, *,
_save_ctx, _parallel_config)`` on ``(B, N, H, D)`` tensors):

- Ulysses (``ulysses_degree``): an all-to-all turns each rank's sequence shard of all heads into all
  tokens of a head shard; the op; an all-to-all back;
- ring (``ring_degree``): every rank's K and V all-gathered ("allgather" rotation); the op of the local
  queries on each rank's key chunk in turn, with its log-sum-exp ``(B, N, H)``; the partial outputs merged
  by their LSE in fp32 (``convert_to_fp32``), rounded once to the input dtype;
- both (``ring_degree * ulysses_degree`` ranks): Ulysses inside each ring group, the ring across.

:func:`attend` is what ``routing``'s dispatcher runs for a call that carries a parallel config.  It
sends the call of a routed processor through that same machinery, the processor's own attention as the
forward op (:func:`forward_op`): ``pasa_attention`` for the PASA backends (``return_lse=True`` in the
ring, its ``(B, H, N)`` LSE transposed to diffusers' ``(B, N, H)``), the processor's ``attention`` hook
for the others.  Each call is counted as the backend's own (not a fallback) and its schedule in
``counted.schedules`` (:func:`schedule_summary` adds them up):

- ``"ulysses"``, ``"ring"``, ``"ulysses+ring"``: diffusers' templated schedule with our op;
- ``"gathered"``: a call with a key-padding mask (LTX-Video's text cross-attention), or a backend that
  has no LSE (SDPA, the peers) under the ring: every rank's K, V (and mask) all-gathered over the
  context-parallel group, in the order diffusers shards them, and the processor's ``attend`` run once on
  the local queries against all keys.  Exact for every schedule: diffusers' ring hands each rank's *own*
  mask to every key chunk of the ring, and its Ulysses all-gathers the mask but keeps its head count, so
  neither computes a padding mask of the sharded text right.  It costs the ring's memory (all K and V on
  each rank, what the "allgather" ring holds too).

What falls back to diffusers' own dispatcher with the parallel config (counted ``"context parallel"``):
a causal call, dropout, a mask that is not broadcast over the queries, ``attention_kwargs`` (none of the
video transformers asks for them at inference).  The op is forward-only: a call whose inputs require
grad with grad mode on is a ``RuntimeError`` (diffusers' templated functions run the op under no-grad,
so the op's own check would not see it).

:func:`enable_parallelism` calls diffusers' ``enable_parallelism`` on a model or a pipeline's
denoisers, and makes it run on a host without an accelerator (diffusers 0.42 picks the rank's device as
``rank % torch.accelerator.device_count()``, which divides by zero there).  Launch one process per GPU
(``torchrun --nproc-per-node N``; NCCL), or several on a CPU (gloo): ``docs/PARALLEL.md``.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from .ops import pasa_attention
from .processors import CountedAttnProcessor, PASAAttnProcessor

__all__ = ["SCHEDULES", "attend", "forward_op", "backward_op", "has_lse", "enable_parallelism", "schedule_summary",
           "context_parallel_config"]

SCHEDULES = ("ulysses", "ring", "ulysses+ring", "gathered")
"""The schedules :func:`attend` runs a call in (``counted.schedules`` keys)."""


def context_parallel_config(parallel_config: Any) -> Any:
    """The ``ContextParallelConfig`` of a diffusers ``ParallelConfig`` that splits the sequence over more
    than one rank, or ``None`` (no config, tensor parallelism only, or a single rank)."""
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None or (cp.ring_degree or 1) * (cp.ulysses_degree or 1) <= 1:
        return None
    return cp


@functools.cache
def _op_returns_lse() -> bool:
    """Whether the installed ``pasa_attention`` takes ``return_lse``."""
    return "return_lse" in inspect.signature(pasa_attention).parameters


def has_lse(counted: CountedAttnProcessor) -> bool:
    """Whether ``counted``'s attention can return its log-sum-exp (what the ring merges by): the PASA
    backends, through ``pasa_attention(..., return_lse=True)``."""
    return isinstance(counted, PASAAttnProcessor) and _op_returns_lse()


def forward_op(counted: CountedAttnProcessor, ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
               scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False, *,
               _save_ctx: bool = True, _parallel_config: Any = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The forward op diffusers' templated context-parallel functions call (bound to ``counted`` with
    ``functools.partial``): ``counted``'s attention of ``(B, N, H, D)`` tensors, with the LSE ``(B, N, H)``
    fp32 for ``return_lse``.  :func:`attend` never hands it a mask, dropout or a causal call."""
    if attn_mask is not None or dropout_p or is_causal:
        raise ValueError(f"parallel.forward_op: {counted.name or 'an attention module'}: the op takes no mask, "
                         "dropout or causal call (parallel.attend routes those elsewhere)")
    if not isinstance(counted, PASAAttnProcessor):
        if return_lse:
            raise ValueError(f"parallel.forward_op: {type(counted).__name__} has no log-sum-exp "
                             "(parallel.attend gathers the keys instead)")
        return counted.attention(query, key, value, scale, None)
    options = dict(scale=scale, precision=counted.variant.precision, shift=counted.variant.shift, beta=counted.beta,
                   layout="bnhd")
    try:
        if not return_lse:
            return pasa_attention(query, key, value, **options)
        out, lse = pasa_attention(query, key, value, return_lse=True, **options)
    except ValueError as error:
        raise ValueError(f"{type(counted).__name__}(precision={counted.precision!r}) in "
                         f"{counted.name or 'an attention module'}: {error} (pass dtype= to cast q, k, v)") from error
    return out, lse.transpose(1, 2).float().contiguous()


def backward_op(ctx: Any, grad_out: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """The backward op of the templated functions: there is none (``attend`` refuses inputs that require grad)."""
    raise RuntimeError("pasa_diffusers: context-parallel attention is forward-only (inference); "
                       "run the model under torch.no_grad() / torch.inference_mode()")


def _schedule(cp: Any) -> str:
    if cp.ring_degree > 1 and cp.ulysses_degree > 1:
        return "ulysses+ring"
    return "ring" if cp.ring_degree > 1 else "ulysses"


def _record(counted: CountedAttnProcessor, schedule: str) -> None:
    """Count one call's schedule in ``counted.schedules`` (eager only, like the processors' counters)."""
    if not torch.compiler.is_compiling():
        schedules = counted.__dict__.setdefault("schedules", {})
        schedules[schedule] = schedules.get(schedule, 0) + 1


def _gather(x: torch.Tensor, dim: int, cp: Any) -> torch.Tensor:
    """``x``'s shards of every rank of the context-parallel group, joined along ``dim`` in the order
    diffusers' ``_cp_plan`` hooks split the sequence (the flattened ring x Ulysses mesh; unequal shards
    in the "anything" modes)."""
    from diffusers.hooks.context_parallel import EquipartitionSharder, PartitionAnythingSharder

    mesh = cp._flattened_mesh
    flag = x.dtype == torch.bool  # gathered as bytes: not every backend's collectives take bool
    x = x.to(torch.uint8) if flag else x.contiguous()
    if cp.ulysses_anything or cp.ring_anything:
        x = PartitionAnythingSharder.unshard_anything(x, dim, mesh)
    else:
        x = EquipartitionSharder.unshard(x, dim, mesh)
    return x.bool() if flag else x


def _padding_mask(attn_mask: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether ``attn_mask`` is sharded with the keys and the same for every query (``(B or 1, H or 1, 1,
    Nk_local)``): what :func:`attend` gathers with the keys.  Decided from shapes only, so every rank
    takes the same path (the values may differ between ranks' shards)."""
    return (attn_mask.dim() == 4 and attn_mask.shape[2] == 1 and attn_mask.shape[-1] == key.shape[1]
            and attn_mask.shape[0] in (1, key.shape[0]))


def attend(counted: CountedAttnProcessor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
           *, backend: Any, parallel_config: Any) -> torch.Tensor:
    """One attention call of a routed processor under context parallelism, on this rank's ``(B, N, H, D)``
    shards; returns this rank's ``(B, Nq, H, D)`` output in ``query``'s dtype.  Without a context-parallel
    config (or on one rank) it is the processor's plain ``attend``."""
    cp = context_parallel_config(parallel_config)
    if cp is None:
        return counted.attend(query, key, value, scale, attn_mask).to(query.dtype)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise RuntimeError(f"{type(counted).__name__} in {counted.name or 'an attention module'}: context-parallel "
                           "attention is forward-only (inference); q, k or v requires grad. Run the model under "
                           "torch.no_grad() / torch.inference_mode()")
    if is_causal or dropout_p > 0.0 or (attn_mask is not None and not _padding_mask(attn_mask, key)):
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        counted.count_call("context parallel")
        return dispatch_attention_fn(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                     scale=scale, enable_gqa=enable_gqa, backend=backend,
                                     parallel_config=parallel_config)
    dtype = counted.dtype or query.dtype
    q, k, v = (t.to(dtype) for t in (query, key, value))
    if attn_mask is not None or (cp.ring_degree > 1 and not has_lse(counted)):
        _record(counted, "gathered")  # counted.attend counts the call (and any fallback its mask calls for)
        k, v = _gather(k, 1, cp), _gather(v, 1, cp)
        if attn_mask is not None:
            attn_mask = _gather(attn_mask.expand(key.shape[0], -1, -1, -1), 3, cp)
        return counted.attend(q, k, v, scale, attn_mask).to(query.dtype)
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    _record(counted, _schedule(cp))
    counted.count_call()
    out = _templated_context_parallel_attention(q, k, v, None, 0.0, False, scale, enable_gqa, False,
                                                forward_op=functools.partial(forward_op, counted),
                                                backward_op=backward_op, _parallel_config=parallel_config)
    return out.to(query.dtype)


@contextlib.contextmanager
def _device_count_at_least_one() -> Iterator[None]:
    """``torch.accelerator.device_count()`` reads 1 on a host without an accelerator (diffusers 0.42's
    ``_resolve_parallel_config`` takes ``rank % device_count()`` for the rank's device: ``cpu:0`` then)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or accelerator.device_count() > 0:
        yield
        return
    count = accelerator.device_count
    accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        accelerator.device_count = count


def enable_parallelism(model_or_pipeline: Any, config: Any, *, cp_plan: dict[str, Any] | None = None) -> list[Any]:
    """diffusers' ``model.enable_parallelism(config=config, cp_plan=cp_plan)`` on a model, or on each of a
    pipeline's denoisers (``install.DENOISERS``), also on a host without an accelerator (gloo on CPUs).

    ``config`` is a ``diffusers.ContextParallelConfig`` (or a ``ParallelConfig``); ``torch.distributed``
    must be initialised.  Call it before or after ``install.apply``: either order puts the config on the
    processors that run (``apply`` and ``restore`` carry it over).  Returns the models it acted on.

    Raises:
        ValueError: a model with no ``_cp_plan`` and no ``cp_plan`` (in diffusers 0.42.1 HunyuanVideo,
            CogVideoX and Mochi have none), naming the model.
    """
    from diffusers import DiffusionPipeline

    from .install import DENOISERS

    if isinstance(model_or_pipeline, DiffusionPipeline):
        models = [getattr(model_or_pipeline, name) for name in DENOISERS
                  if getattr(model_or_pipeline, name, None) is not None]
    else:
        models = [model_or_pipeline]
    for model in models:
        if cp_plan is None and getattr(model, "_cp_plan", None) is None:
            raise ValueError(f"enable_parallelism: {type(model).__name__} has no context-parallel plan (_cp_plan) "
                             "in this diffusers; pass cp_plan= (docs/PARALLEL.md lists the models that have one)")
    with _device_count_at_least_one():
        for model in models:
            model.enable_parallelism(config=config, cp_plan=cp_plan)
    return models


def schedule_summary(model_or_pipeline: Any) -> dict[str, int]:
    """``{schedule: calls}`` (:data:`SCHEDULES`) of the context-parallel calls the processors ``install.apply``
    put on a model (or a pipeline's denoisers) ran themselves, in eager mode; a processor shared by several
    modules counts once."""
    from diffusers import DiffusionPipeline

    from .install import DENOISERS, attention_processors, counted_processor

    if isinstance(model_or_pipeline, DiffusionPipeline):
        models = [getattr(model_or_pipeline, name) for name in DENOISERS
                  if getattr(model_or_pipeline, name, None) is not None]
    else:
        models = [model_or_pipeline]
    seen: set[int] = set()
    total: dict[str, int] = {}
    for model in models:
        for installed in attention_processors(model).values():
            counted = counted_processor(installed)
            if counted is None or id(counted) in seen:
                continue
            seen.add(id(counted))
            for schedule, calls in getattr(counted, "schedules", {}).items():
                total[schedule] = total.get(schedule, 0) + calls
    return total
