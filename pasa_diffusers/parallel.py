"""Context parallelism, per model: diffusers' Ulysses and ring attention set up on a model or pipeline, with
this package's attention backends, and the schedules its calls ran in.

diffusers (0.35 and later) splits a video transformer's sequence over the ranks of a
``ContextParallelConfig`` (``model.enable_parallelism(config=...)``: the model's ``_cp_plan`` shards the
hidden states and RoPE tables where the blocks start and gathers the output at ``proj_out``) and sets
the config on every attention processor.  Each attention call of a processor ``install.apply`` put there
then runs on the rank's shards in ``sharded_attention.attend`` (Ulysses, ring, both, or gathered; what
falls back and why: ``fallbacks.py``).

:func:`enable_parallelism` calls diffusers' ``enable_parallelism`` on a model or a pipeline's
denoisers, and makes it run on a host without an accelerator (``compat.device_count_at_least_one``).
Launch one process per GPU (``torchrun --nproc-per-node N``; NCCL), or several on a CPU (gloo):
``docs/PARALLEL.md``.  :func:`schedule_summary` adds up the schedules the calls ran in.
"""
from __future__ import annotations

from typing import Any

from . import compat
from .install import attention_processors, counted_processor, denoisers

__all__ = ["enable_parallelism", "schedule_summary"]


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
    models = denoisers(model_or_pipeline)
    for model in models:
        if cp_plan is None and compat.cp_plan(model) is None:
            raise ValueError(f"enable_parallelism: {type(model).__name__} has no context-parallel plan (_cp_plan) "
                             "in this diffusers; pass cp_plan= (docs/PARALLEL.md lists the models that have one)")
    with compat.device_count_at_least_one():
        for model in models:
            model.enable_parallelism(config=config, cp_plan=cp_plan)
    return models


def schedule_summary(model_or_pipeline: Any) -> dict[str, int]:
    """``{schedule: calls}`` (``sharded_attention.SCHEDULES``) of the context-parallel calls the processors ``install.apply``
    put on a model (or a pipeline's denoisers) ran themselves, in eager mode; a processor shared by several
    modules counts once."""
    seen: set[int] = set()
    total: dict[str, int] = {}
    for model in denoisers(model_or_pipeline):
        for installed in attention_processors(model).values():
            counted = counted_processor(installed)
            if counted is None or id(counted) in seen:
                continue
            seen.add(id(counted))
            for schedule, calls in getattr(counted, "schedules", {}).items():
                total[schedule] = total.get(schedule, 0) + calls
    return total
