"""One attention call on a rank's sequence shard: this package's backends under diffusers' Ulysses and ring attention.

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

:func:`attend` is what ``routing``'s dispatcher runs for a call that carries a context-parallel config.  It
sends the call of a routed processor through that same machinery, the processor's own attention as the
forward op (:func:`forward_op`): ``pasa_attention`` for the PASA backends (``return_lse=True`` in the
ring, its ``(B, H, N)`` LSE transposed to diffusers' ``(B, N, H)``), the processor's ``attention`` hook
for the others.  Each call is counted as the backend's own (not a fallback) and its schedule in
``counted.schedules`` (``parallel.schedule_summary`` adds them up):

- ``"ulysses"``, ``"ring"``, ``"ulysses+ring"``: diffusers' templated schedule with our op;
- ``"gathered"``: a call with a key-padding mask (LTX-Video's text cross-attention), or a backend that
  has no LSE (SDPA, the peers) under the ring: every rank's K, V (and mask) all-gathered over the
  context-parallel group, in the order diffusers shards them, and the processor's ``attend`` run once on
  the local queries against all keys.  Exact for every schedule: diffusers' ring hands each rank's *own*
  mask to every key chunk of the ring, and its Ulysses all-gathers the mask but keeps its head count, so
  neither computes a padding mask of the sharded text right.  It costs the ring's memory (all K and V on
  each rank, what the "allgather" ring holds too).

What falls back to diffusers' own dispatcher with the parallel config (counted ``"context parallel"``,
decided by ``fallbacks.call_reason``): a causal call, dropout, a mask that is not broadcast over the
queries, ``attention_kwargs`` (none of the video transformers asks for them at inference).  The op is
forward-only: a call whose inputs require grad with grad mode on is a ``RuntimeError`` (diffusers' templated
functions run the op under no-grad, so the op's own check would not see it).

``parallel.py`` sets a model up (``parallel.enable_parallelism``) and adds up the schedules
(``parallel.schedule_summary``); the private diffusers functions this module runs are called through
``compat.py``.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from . import compat, fallbacks
from .ops import pasa_attention
from .processors import CountedAttnProcessor, PASAAttnProcessor

__all__ = ["SCHEDULES", "attend", "forward_op", "backward_op", "has_lse"]

SCHEDULES = ("ulysses", "ring", "ulysses+ring", "gathered")
"""The schedules :func:`attend` runs a call in (``counted.schedules`` keys)."""


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
        raise ValueError(f"sharded_attention.forward_op: {counted.name or 'an attention module'}: the op takes no mask, "
                         "dropout or causal call (sharded_attention.attend routes those elsewhere)")
    if not isinstance(counted, PASAAttnProcessor):
        if return_lse:
            raise ValueError(f"sharded_attention.forward_op: {type(counted).__name__} has no log-sum-exp "
                             "(sharded_attention.attend gathers the keys instead)")
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
    diffusers' ``_cp_plan`` hooks split the sequence (``compat.unshard``)."""
    flag = x.dtype == torch.bool  # gathered as bytes: not every backend's collectives take bool
    x = x.to(torch.uint8) if flag else x.contiguous()
    x = compat.unshard(x, dim, cp)
    return x.bool() if flag else x


def attend(counted: CountedAttnProcessor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
           *, backend: Any, parallel_config: Any) -> torch.Tensor:
    """One attention call of a routed processor under context parallelism (``parallel_config`` splits the
    sequence: ``fallbacks.context_parallel_config``), on this rank's ``(B, N, H, D)`` shards; returns this
    rank's ``(B, Nq, H, D)`` output in ``query``'s dtype."""
    cp = fallbacks.context_parallel_config(parallel_config)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise RuntimeError(f"{type(counted).__name__} in {counted.name or 'an attention module'}: context-parallel "
                           "attention is forward-only (inference); q, k or v requires grad. Run the model under "
                           "torch.no_grad() / torch.inference_mode()")
    reason = fallbacks.call_reason(key, attn_mask, dropout_p, is_causal, None, parallel_config)
    if reason is not None:
        counted.count_call(reason)
        return fallbacks.by_dispatcher(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, None,
                                       backend, parallel_config)
    dtype = counted.dtype or query.dtype
    q, k, v = (t.to(dtype) for t in (query, key, value))
    if attn_mask is not None or (cp.ring_degree > 1 and not has_lse(counted)):
        _record(counted, "gathered")  # counted.attend counts the call (and any fallback its mask calls for)
        k, v = _gather(k, 1, cp), _gather(v, 1, cp)
        if attn_mask is not None:
            attn_mask = _gather(attn_mask.expand(key.shape[0], -1, -1, -1), 3, cp)
        return counted.attend(q, k, v, scale, attn_mask).to(query.dtype)
    _record(counted, _schedule(cp))
    counted.count_call()
    out = compat.templated_context_parallel_attention(q, k, v, scale, enable_gqa,
                                                      forward_op=functools.partial(forward_op, counted),
                                                      backward_op=backward_op, parallel_config=parallel_config)
    return out.to(query.dtype)
