"""Every private API of diffusers and Triton this package calls, in one place, with the versions it was read from.

The rest of the package calls these functions, never the private names themselves; when a new diffusers or
Triton release moves one of them, this file is the one to change (and pyproject.toml's pins with it).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


# ---------------------------------------------------------------------------------------------------- diffusers

DIFFUSERS_VERSION = "0.42.1"
"""The diffusers release the functions below were read from (``diffusers/models/attention_dispatch.py``,
``diffusers/hooks/context_parallel.py``, ``diffusers/models/modeling_utils.py``); CI tests it."""


def templated_context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                         scale: float | None, enable_gqa: bool, *, forward_op: Callable[..., Any],
                                         backward_op: Callable[..., Any], parallel_config: Any) -> torch.Tensor:
    """``attention_dispatch._templated_context_parallel_attention``: diffusers' Ulysses / ring schedule of
    ``(B, N, H, D)`` shards around ``forward_op``, with no mask, no dropout, not causal, no LSE returned."""
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    return _templated_context_parallel_attention(query, key, value, None, 0.0, False, scale, enable_gqa, False,
                                                 forward_op=forward_op, backward_op=backward_op,
                                                 _parallel_config=parallel_config)


def unshard(x: torch.Tensor, dim: int, cp: Any) -> torch.Tensor:
    """``x``'s shards of every rank of a ``ContextParallelConfig``'s group joined along ``dim``, in the order
    diffusers' ``_cp_plan`` hooks split the sequence: the flattened ring x Ulysses mesh (``cp._flattened_mesh``),
    unequal shards in the "anything" modes (``hooks.context_parallel``'s sharders)."""
    from diffusers.hooks.context_parallel import EquipartitionSharder, PartitionAnythingSharder

    mesh = cp._flattened_mesh
    if cp.ulysses_anything or cp.ring_anything:
        return PartitionAnythingSharder.unshard_anything(x, dim, mesh)
    return EquipartitionSharder.unshard(x, dim, mesh)


def cp_plan(model: torch.nn.Module) -> Any:
    """A diffusers model's context-parallel plan (``model._cp_plan``), or ``None`` where it has none."""
    return getattr(model, "_cp_plan", None)


def carry_parallel_config(installed: Any, new: Any) -> Any:
    """``new``, given the diffusers parallel config ``installed`` runs with (``model.enable_parallelism`` sets
    ``_parallel_config`` on the processors present when it runs): without it a processor installed or put
    back later would attend to its rank's shard of the sequence only."""
    config = getattr(installed, "_parallel_config", None)
    if config is not None and hasattr(new, "_parallel_config"):
        new._parallel_config = config
    return new


@contextlib.contextmanager
def device_count_at_least_one() -> Iterator[None]:
    """``torch.accelerator.device_count()`` reads 1 on a host without an accelerator: diffusers'
    ``enable_parallelism`` (``_resolve_parallel_config``) takes ``rank % device_count()`` for the rank's
    device, which divides by zero there (``cpu:0`` then)."""
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
