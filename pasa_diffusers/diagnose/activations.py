"""FP16 outside the attention scores: the largest |x| of each transformer block's activations, per step.

A value above 65504 (``rules.FP16_MAX``) becomes inf when its tensor is held in fp16, wherever it is:
the attention scores (``stats.py``), and also the tensors around attention.  ``activation_sites(model,
blocks)`` names, in every transformer block of the block lists ``blocks`` (e.g. a Wan transformer's
``blocks``), the modules whose outputs are checked:

- ``"attention output"``: each attention module's output (after its output projection);
- ``"ffn hidden"``: a feed-forward's hidden activation (``net[0]``: the up projection and its GELU);
- ``"ffn output"``: the feed-forward's output;
- ``"norm"``: each norm's output (before any modulation the block applies to it);
- ``"block output"``: the block's output, the residual stream.

``recording_activations(model, sites)`` hooks them (forward hooks, removed on exit, also on error) and
keeps per call the largest |x| over every tensor of the output, in float32, NaN and inf kept, with the
step of a ``collect.StepClock``; ``summarize_activations`` turns that into one entry per site.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..rules import FP16_MAX
from .collect import StepClock

__all__ = ["ROLES", "ActivationSite", "activation_sites", "ActivationRecorder", "recording_activations",
           "summarize_activations"]

ROLES = ("attention output", "ffn hidden", "ffn output", "norm", "block output")


@dataclass(frozen=True)
class ActivationSite:
    """One module whose output is checked: its path, its block's path and its role (one of ``ROLES``)."""

    path: str
    block: str
    role: str


def _is_attention(module: torch.nn.Module) -> bool:
    return callable(getattr(module, "processor", None)) and hasattr(module, "to_q")


def _is_feed_forward(module: torch.nn.Module) -> bool:
    return isinstance(getattr(module, "net", None), torch.nn.ModuleList) and len(module.net) > 0


def _is_norm(name: str, module: torch.nn.Module) -> bool:
    return name.startswith("norm") and not isinstance(module, torch.nn.Identity)


def _block_sites(block_path: str, block: torch.nn.Module) -> list[ActivationSite]:
    """The sites of one block, in the order its children are declared, the block output last."""
    sites = []
    for name, child in block.named_children():
        path = f"{block_path}.{name}"
        if _is_attention(child):
            sites.append(ActivationSite(path, block_path, "attention output"))
        elif _is_feed_forward(child):
            sites.append(ActivationSite(f"{path}.net.0", block_path, "ffn hidden"))
            sites.append(ActivationSite(path, block_path, "ffn output"))
        elif _is_norm(name, child):
            sites.append(ActivationSite(path, block_path, "norm"))
    return sites + [ActivationSite(block_path, block_path, "block output")]


def activation_sites(model: torch.nn.Module, blocks: Sequence[str]) -> list[ActivationSite]:
    """Every site of every block of ``model``'s top-level block lists named in ``blocks`` (see the module
    docstring); a list the model lacks is skipped."""
    sites = []
    for list_name in blocks:
        for index, block in enumerate(getattr(model, list_name, None) or ()):
            sites += _block_sites(f"{list_name}.{index}", block)
    return sites


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []


@dataclass
class ActivationRecorder:
    """The recorded calls of one site: per call ``{"max_abs", "finite", "step"}`` (a forward hook)."""

    site: ActivationSite
    clock: StepClock
    records: list[dict[str, Any]] = field(default_factory=list)

    @torch.no_grad()
    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        tensors = [t for t in _tensors(output) if t.is_floating_point() and t.numel()]
        if not tensors:
            return
        peaks = torch.stack([t.detach().abs().amax().float() for t in tensors])
        finite = all(bool(torch.isfinite(t).all()) for t in tensors)
        peak = peaks.max().item() if not peaks.isnan().any() else float("nan")
        self.records.append({"max_abs": peak, "finite": finite, "step": self.clock.step})


@contextmanager
def recording_activations(model: torch.nn.Module, sites: Sequence[ActivationSite], *,
                          clock: StepClock | None = None) -> Iterator[list[ActivationRecorder]]:
    """Record the output peaks of every site of ``model`` while the ``with`` block runs (forward hooks,
    removed on exit); yields the recorders in the order of ``sites``."""
    clock = clock or StepClock()
    recorders = [ActivationRecorder(site, clock) for site in sites]
    handles = [model.get_submodule(r.site.path).register_forward_hook(r) for r in recorders]
    try:
        yield recorders
    finally:
        for handle in handles:
            handle.remove()


def _nan_max(values: list[float]) -> float:
    return float("nan") if any(v != v for v in values) else max(values, default=0.0)


def summarize_activations(recorders: Sequence[ActivationRecorder], num_steps: int) -> list[dict[str, Any]]:
    """One entry per site, in the recorders' order: ``path``, ``block``, ``role``, ``calls``, ``max_abs`` (NaN
    if any call held NaN), ``risk`` = ``max_abs / FP16_MAX``, ``overflows`` (``max_abs > FP16_MAX``: an fp16
    copy holds inf), ``nonfinite_calls`` and ``per_step_max_abs`` (``None`` for a step without a call)."""
    entries = []
    for recorder in recorders:
        records = recorder.records
        peak = _nan_max([r["max_abs"] for r in records])
        steps = max([num_steps, *(1 + r["step"] for r in records)])
        per_step: list[float | None] = [None] * steps
        for r in records:
            s = r["step"]
            per_step[s] = r["max_abs"] if per_step[s] is None else _nan_max([per_step[s], r["max_abs"]])
        entries.append({"path": recorder.site.path, "block": recorder.site.block, "role": recorder.site.role,
                        "calls": len(records), "max_abs": peak, "risk": peak / FP16_MAX, "overflows": peak > FP16_MAX,
                        "nonfinite_calls": sum(not r["finite"] for r in records), "per_step_max_abs": per_step})
    return entries
