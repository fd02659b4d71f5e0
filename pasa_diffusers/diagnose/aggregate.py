"""Per layer: the recorded calls of one processor summarised into one entry, named and placed.

Maxima and ``overflow_count`` are taken over all calls, per-head statistics averaged over calls
(skipping ``None``), ``per_step_*`` over the calls of each step; ``verdict.judge`` then adds the risk and
the cause.  ``summarize`` does this for every recorder of a run, in the order the layers first ran.  A
layer's ``kind`` (spatial or temporal, self or cross) is the caller's rule, passed in: the application
passes ``pasa_diffusers.install.module_kind``, the classification ``apply`` selects modules by.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from .collect import LayerRecorder
from .verdict import judge

__all__ = ["aggregate_layer", "summarize", "short_path"]

_PER_HEAD = ("bias_q", "bias_k", "amplitude_q", "amplitude_k", "resonance_cos", "sign_agreement",
             "mean_norm_q", "mean_norm_k")


def _head_mean(values: list[list[float | None]]) -> list[float | None]:
    """Per head, the mean over calls of the values that are not ``None`` (``None`` where all are)."""
    out = []
    for column in zip(*values):
        kept = [v for v in column if v is not None]
        out.append(sum(kept) / len(kept) if kept else None)
    return out


def _block(path: str) -> str:
    """A UNet's down/up block or mid block; a video transformer's block (``blocks.3``, ``transformer_blocks.0``)."""
    match = re.match(r"(down_blocks\.\d+|up_blocks\.\d+|mid_block|(?:single_)?(?:transformer_)?blocks\.\d+)", path)
    return match.group(1) if match else path.split(".", 1)[0]


def _transformer(path: str) -> str:
    return re.split(r"\.(?:temporal_)?transformer_blocks\.", path, maxsplit=1)[0]


def short_path(path: str) -> str:
    """``down_blocks.0.attentions.1.temporal_transformer_blocks.0.attn1`` -> ``down0.1.temporal.attn1`` (a
    UNet's transformer blocks), ``transformer_blocks.3.attn1`` -> ``block3.attn1`` and
    ``single_transformer_blocks.3.attn`` -> ``single3.attn`` (a video transformer's top-level blocks)."""
    top = re.match(r"(single_transformer_blocks|transformer_blocks|blocks)\.(\d+)", path)
    if top:
        return ("single" if top[1].startswith("single") else "block") + top[2] + path[top.end():]
    s = re.sub(r"\b(down|up)_blocks\.(\d+)", r"\1\2", path)
    s = s.replace("mid_block", "mid").replace(".attentions.", ".")
    s = re.sub(r"temporal_transformer_blocks\.(\d+)", lambda m: "temporal" + ("" if m[1] == "0" else m[1]), s)
    return re.sub(r"(?<!temporal_)transformer_blocks\.(\d+)", lambda m: "spatial" + ("" if m[1] == "0" else m[1]), s)


def aggregate_layer(path: str, records: list[dict[str, Any]], num_steps: int, *, kind: str) -> dict[str, Any]:
    """One layer's entry of a diagnosis from its recorder's ``records`` (see the module docstring).

    ``kind`` is the layer's module kind (e.g. ``"spatial-self"``); ``level`` is left ``None`` here
    (``summarize`` fills in the spatial token count of the layer's transformer).
    """
    layer: dict[str, Any] = {"path": path, "short": short_path(path), "kind": kind,
                             "block": _block(path), "level": None, "calls": len(records)}
    if not records:
        layer.update(heads=None, head_dim=None, shape_q=None, shape_k=None, max_abs_qk=0.0, max_abs_score=0.0,
                     overflow_count=0, max_abs_shifted=0.0, nonfinite_calls=0, **dict.fromkeys(_PER_HEAD),
                     per_step_max_abs_qk=[None] * num_steps, per_step_overflow_count=[None] * num_steps)
        return judge(layer)
    first = records[0]
    layer.update(heads=first["shape_q"][1], head_dim=first["shape_q"][3], shape_q=first["shape_q"],
                 shape_k=first["shape_k"])
    layer["max_abs_qk"] = max(r["max_abs_qk"] for r in records)
    layer["max_abs_score"] = max(r["max_abs_score"] for r in records)
    layer["overflow_count"] = sum(r["overflow_count"] for r in records)
    layer["max_abs_shifted"] = max(r["max_abs_shifted"] for r in records)
    layer["nonfinite_calls"] = sum(not r["finite_inputs"] for r in records)
    for name in _PER_HEAD:
        layer[name] = _head_mean([r[name] for r in records])
    steps = max(num_steps, 1 + max(r["step"] for r in records))
    per_max: list[float | None] = [None] * steps
    per_count: list[int | None] = [None] * steps
    for r in records:
        s = r["step"]
        per_max[s] = max(per_max[s] or 0.0, r["max_abs_qk"])
        per_count[s] = (per_count[s] or 0) + r["overflow_count"]
    layer["per_step_max_abs_qk"] = per_max
    layer["per_step_overflow_count"] = per_count
    return judge(layer)


def _level_key(layer: dict[str, Any]) -> str:
    """What shares a level: a UNet layer's transformer, a video transformer layer's block."""
    return layer["block"] if layer["kind"].startswith("video") else _transformer(layer["path"])


def _fill_levels(layers: list[dict[str, Any]]) -> None:
    """``level`` = token count of the spatial attention in the layer's transformer, or of the video
    self-attention in the layer's block (None if there is none)."""
    tokens = {}
    for layer in layers:
        if layer["kind"].startswith(("spatial", "video-self")) and layer["shape_q"] is not None:
            tokens[_level_key(layer)] = layer["shape_q"][2]
    for layer in layers:
        layer["level"] = tokens.get(_level_key(layer))


def summarize(recorders: list[LayerRecorder], num_steps: int, *, kind: Callable[[str], str]) -> list[dict[str, Any]]:
    """The layers of a run from its recorders (``collect.recording``): one ``aggregate_layer`` entry each,
    in the order they first ran (never-called ones last), with ``level``; ``kind(path)`` names a layer's
    module kind (``"spatial-..."`` for the spatial attentions that set the levels)."""
    ordered = sorted(recorders, key=lambda r: r.records[0]["order"] if r.records else math.inf)
    layers = [aggregate_layer(r.name, r.records, num_steps, kind=kind(r.name)) for r in ordered]
    _fill_levels(layers)
    return layers
