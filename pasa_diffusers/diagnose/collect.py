"""Recording: the statistics of every attention call of a layer, and their installation on a model.

A ``LayerRecorder`` keeps the ``call_stats`` of each call handed to it (``record(query, key, scale)``).
The processor that hands it the calls is the caller's: ``recording(model, processor)`` builds one
recorder per attention module of a diffusers model (its ``attn_processors`` / ``set_attn_processor``: a UNet, a
transformer; or, for a model without them such as ``MochiTransformer3DModel``, every submodule holding a
``processor`` and the projections ``to_q``/``to_k``), installs ``processor(recorder)`` on that module, and
puts the previous processor objects back on exit, also on error.  The application's processor
(``pasa_diffusers.pipelines.diagnose.DiagnosticAttnProcessor``) records, then computes the stock
attention, so the model's outputs are the ones it makes without the diagnosis.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..attention_modules import attention_processors, set_processors
from ..shift_matrix import DEFAULT_BETA
from ..rules import SHIFT_BLOCK
from .stats import call_stats

__all__ = ["StepClock", "LayerRecorder", "recording"]


@dataclass
class StepClock:
    """The denoising step that attention calls are attributed to (advanced by the pipeline callback),
    and the number of attention calls so far (which orders the layers as they run)."""

    step: int = 0
    calls: int = 0


def _mean_norm(x: torch.Tensor, heads: int) -> list[float]:
    """Per head: norm of the token mean of a ``(B, N, H, D)`` tensor, averaged over the batch (float32),
    repeated to ``heads`` query heads (GQA keys serve ``heads / H`` query heads each)."""
    norms = x.mean(dim=1, dtype=torch.float32).norm(dim=-1).mean(dim=0)
    return norms.repeat_interleave(heads // x.shape[2]).tolist()


class LayerRecorder:
    r"""
    The recorded attention calls of one layer.

    Each ``record`` appends to ``records`` the dict of ``call_stats(q, k, scale)`` on ``(B, H, N, D)``
    transposed views (no copies), plus ``step`` and ``order`` (from ``clock``), ``finite_inputs`` and
    the per-head ``mean_norm_q``/``mean_norm_k`` (norm of the token mean).  Over a single token the
    bias (mean over centred spread) is undefined: ``bias_q``/``bias_k`` are then ``None``.  The
    statistics ignore an attention mask (SVD passes none).

    Args:
        name: module path (for reports).
        clock: where the current denoising step is read (default: a clock stuck at step 0).
        max_elements, beta, block_n: passed to ``call_stats``.
    """

    def __init__(self, name: str, *, clock: StepClock | None = None, max_elements: int = 2 ** 26,
                 beta: float = DEFAULT_BETA, block_n: int = SHIFT_BLOCK) -> None:
        self.name = name
        self.clock = clock or StepClock()
        self.max_elements = max_elements
        self.beta = beta
        self.block_n = block_n
        self.records: list[dict[str, Any]] = []

    def record(self, query: torch.Tensor, key: torch.Tensor, scale: float | None) -> None:
        """Record one call from its ``(B, N, H, D)`` query and key (as diffusers' processors hold them);
        ``scale=None`` is SDPA's default, ``1/sqrt(D)`` (what the video transformers' processors pass)."""
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        stats = call_stats(query.transpose(1, 2), key.transpose(1, 2), scale, beta=self.beta,
                           block_n=self.block_n, max_elements=self.max_elements)
        heads = query.shape[2]
        for side, x in (("q", query), ("k", key)):
            stats[f"mean_norm_{side}"] = _mean_norm(x, heads)
            if x.shape[1] == 1:
                stats[f"bias_{side}"] = [None] * heads
        stats["finite_inputs"] = bool(torch.isfinite(query).all() and torch.isfinite(key).all())
        stats["step"] = self.clock.step
        stats["order"] = self.clock.calls
        self.clock.calls += 1
        self.records.append(stats)


@contextmanager
def recording(model: Any, processor: Callable[[Any], Any], *, clock: StepClock | None = None,
              max_elements: int = 2 ** 26,
              recorder: Callable[[str, StepClock], Any] | None = None) -> Iterator[list[Any]]:
    """Record every attention call of ``model`` while the ``with`` block runs.

    Builds one recorder per attention module (``attention_modules.attention_processors``: named by the module
    path, sharing ``clock``): a ``LayerRecorder``, or ``recorder(name, clock)`` where the caller records something
    else (``pipelines.coverage``: a mask's coverage), any object with ``name`` and ``record(query, key, scale)``;
    installs ``processor(recorder)`` on its module (a diffusers attention processor that calls
    ``recorder.record`` on every call), yields the recorders in the model's module order, and restores the
    previous processor objects on exit (also when the block raises).
    """
    previous = attention_processors(model)
    clock = clock or StepClock()
    if recorder is None:
        def recorder(name: str, clock: StepClock) -> LayerRecorder:
            return LayerRecorder(name, clock=clock, max_elements=max_elements)
    recorders = {key: recorder(key.removesuffix(".processor"), clock) for key in previous}
    set_processors(model, {key: processor(recorder) for key, recorder in recorders.items()})
    try:
        yield list(recorders.values())
    finally:
        set_processors(model, previous)
