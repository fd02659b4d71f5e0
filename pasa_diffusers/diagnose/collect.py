"""Recording: a processor that records ``call_stats`` on every attention call, and its installation.

``recording(model)`` installs a ``DiagnosticAttnProcessor`` on every attention module of a diffusers
model (anything with ``attn_processors`` / ``set_attn_processor``: a UNet, a transformer) and puts
the previous processor objects back on exit, also on error.  Each processor computes the stock
attention (SDPA in the model's dtype) after recording, so the model's outputs are the ones it makes
without the diagnosis.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.models.attention_processor import Attention

from ..processors import SDPAAttnProcessor
from ..reference import DEFAULT_BETA
from .stats import call_stats

__all__ = ["BLOCK_N", "StepClock", "DiagnosticAttnProcessor", "recording"]

BLOCK_N = 128
"""Key block of PASA's shift (the kernel's and the reference's default) used for ``max_abs_shifted``."""


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


class DiagnosticAttnProcessor(SDPAAttnProcessor):
    r"""
    SDPA in the model's dtype (the stock processor's attention) that first records the call's statistics.

    Each call appends to ``records`` the dict of ``call_stats(q, k, attn.scale)`` on ``(B, H, N, D)``
    transposed views (no copies), plus ``step`` and ``order`` (from ``clock``), ``finite_inputs`` and
    the per-head ``mean_norm_q``/``mean_norm_k`` (norm of the token mean).  Over a single token the
    bias (mean over centred spread) is undefined: ``bias_q``/``bias_k`` are then ``None``.  The
    statistics ignore an attention mask (SVD passes none); the attention itself applies it.

    Args:
        name: module path (for reports).
        clock: where the current denoising step is read (default: a clock stuck at step 0).
        max_elements, beta, block_n: passed to ``call_stats``.
        dtype: as ``CountedAttnProcessor`` (default ``None``: the model's dtype).
    """

    def __init__(self, name: str | None = None, *, clock: StepClock | None = None, max_elements: int = 2 ** 26,
                 beta: float = DEFAULT_BETA, block_n: int = BLOCK_N, dtype: torch.dtype | None = None) -> None:
        super().__init__(dtype)
        self.name = name
        self.clock = clock or StepClock()
        self.max_elements = max_elements
        self.beta = beta
        self.block_n = block_n
        self.records: list[dict[str, Any]] = []

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn: Attention,
                  attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        stats = call_stats(query.transpose(1, 2), key.transpose(1, 2), attn.scale, beta=self.beta,
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
        return super().attention(query, key, value, attn, attention_mask)


@contextmanager
def recording(model: Any, *, clock: StepClock | None = None,
              max_elements: int = 2 ** 26) -> Iterator[list[DiagnosticAttnProcessor]]:
    """Record every attention call of ``model`` while the ``with`` block runs.

    Installs one ``DiagnosticAttnProcessor`` per ``model.attn_processors`` key (named by the module
    path, sharing ``clock``), yields them in the model's module order, and restores the previous
    processor objects on exit (also when the block raises).
    """
    previous = dict(model.attn_processors)
    clock = clock or StepClock()
    diagnostic = {key: DiagnosticAttnProcessor(key.removesuffix(".processor"), clock=clock, max_elements=max_elements)
                  for key in previous}
    model.set_attn_processor(dict(diagnostic))
    try:
        yield list(diagnostic.values())
    finally:
        model.set_attn_processor(dict(previous))
