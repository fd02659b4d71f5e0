"""Binding the sparse backends to a generation: the token grid and the denoising step (issue 46).

A sparse backend's processors (``sparse_processor.SparsePASAAttnProcessor``) need what a model's attention call
does not carry: the self-attention's token sequence (``VideoTokens``: the latent grid over the patch, and the text
tokens a joint attention adds; ``video.self_attention_tokens``) and the denoising step (for the schedule).
:func:`sparse_bound` binds every such processor of a pipeline's denoisers for the ``with`` block, numbering the
layers in module order, and moves them to the next step after each call of the pipeline's ``scheduler.step`` (one
per denoising step in every diffusers video pipeline; the classifier-free guidance passes of a step come before
it).  Outside the models, so that a compiled transformer traces no step counting.  A model bound alone (no
scheduler) stays at step 0.  ``video.generate`` binds for each video; a user calling the pipeline directly wraps
the call::

    with sparse_bound(pipe, self_attention_tokens(pipe, num_frames=81, height=480, width=832)):
        pipe(...)
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pasa_diffusers.install import attention_processors, counted_processor, denoisers
from pasa_diffusers.backends import SELF_KIND
from pasa_diffusers.sparse_processor import SparsePASAAttnProcessor
from pasa_diffusers.video_masks import VideoTokens

__all__ = ["sparse_processors", "sparse_bound", "sparse_summary", "sparse_line"]


def sparse_processors(model: torch.nn.Module) -> list[SparsePASAAttnProcessor]:
    """The sparse processors installed on ``model``'s self-attention modules (kind ``SELF_KIND``), in module order."""
    found = (counted_processor(p) for p in attention_processors(model).values())
    return [p for p in found if isinstance(p, SparsePASAAttnProcessor) and p.kind == SELF_KIND]


def _counting_steps(scheduler: Any, processors: list[SparsePASAAttnProcessor]) -> Callable[..., Any]:
    """``scheduler.step`` that moves ``processors`` to the next denoising step after each call."""
    stock, done = scheduler.step, [0]

    def step(*args: Any, **kwargs: Any) -> Any:
        out = stock(*args, **kwargs)
        done[0] += 1
        for processor in processors:
            processor.at_step(done[0])
        return out

    return step


@contextmanager
def sparse_bound(model_or_pipeline: Any, tokens: VideoTokens) -> Iterator[list[SparsePASAAttnProcessor]]:
    """Bind the sparse processors of a pipeline's denoisers (or of one model) to the self-attention of ``tokens``
    while the ``with`` block runs; yields them (none: nothing to bind, the block runs as it is).  Static masks
    are built here, once, on each model's device; a pipeline's ``scheduler.step`` counts the steps from 0."""
    bound = []
    scheduler = getattr(model_or_pipeline, "scheduler", None)
    try:
        for model in denoisers(model_or_pipeline):
            for layer, processor in enumerate(sparse_processors(model)):
                processor.bind(tokens, layer=layer, device=model.device)
                bound.append(processor)
        if bound and scheduler is not None:
            scheduler.step = _counting_steps(scheduler, bound)
        yield bound
    finally:
        if bound and scheduler is not None:
            vars(scheduler).pop("step", None)
        for processor in bound:
            processor.unbind()


def sparse_summary(model_or_pipeline: Any) -> dict[str, Any] | None:
    """What the sparse processors of a pipeline's denoisers did (``None``: it has none): the ``mask`` (its label and
    parameters), its ``density`` (a static mask's share of (query, key) pairs; ``None`` for the pooled mask), the
    ``schedule``, the ``order``, the ``layers``, and their calls: ``sparse_calls`` and ``dense_calls`` per reason
    (``"schedule"``, ``"key padding"``)."""
    found = [p for model in denoisers(model_or_pipeline) for p in sparse_processors(model)]
    if not found:
        return None
    dense = sum((Counter(p.dense_calls) for p in found), Counter())
    first = found[0]
    return {"mask": first.choice.label, "parameters": first.choice.parameters(), "density": first.density,
            "schedule": {"dense_steps": first.schedule.dense_steps, "dense_layers": first.schedule.dense_layers},
            "order": first.order, "layers": len(found), "sparse_calls": sum(p.sparse_calls for p in found),
            "dense_calls": dict(dense)}


def sparse_line(summary: dict[str, Any]) -> str:
    """``sparse_summary`` in one line."""
    dense = sum(summary["dense_calls"].values())
    reasons = ", ".join(f"{reason}: {calls}" for reason, calls in summary["dense_calls"].items())
    s = summary["schedule"]
    kept = "" if summary["density"] is None else f" (density {summary['density']:.3f})"
    return (f"sparse: {summary['mask']}{kept} in {summary['order']} order on {summary['layers']} self-attention "
            "layers; "
            f"{summary['sparse_calls']} of {summary['sparse_calls'] + dense} calls sparse"
            + (f", {dense} dense ({reasons})" if dense else "")
            + f" (dense for the first {s['dense_steps']} steps and {s['dense_layers']} layers)")
