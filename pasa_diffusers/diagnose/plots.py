"""The diagnosis' two figures, drawn from a diagnosis result (matplotlib, Agg; no pyplot state).

- ``heatmap``: layer x step max |q . k| on a log colour scale, 65504 marked;
- ``bias_resonance``: per layer, the bias of q and k and the resonance cos.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..rules import FP16_MAX

__all__ = ["heatmap", "bias_resonance"]


def heatmap(result: dict[str, Any], path: Path) -> None:
    """Layer x step image of max |q . k| on a log colour scale; 65504 marked on the colour bar and
    overflowing cells hatched and outlined in red."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    layers = result["layers"]
    steps = max(len(layer["per_step_max_abs_qk"]) for layer in layers)
    data = np.full((len(layers), steps), np.nan)
    for i, layer in enumerate(layers):
        for j, v in enumerate(layer["per_step_max_abs_qk"]):
            data[i, j] = np.nan if v is None else v
    positive = data[np.isfinite(data) & (data > 0)]
    vmin = float(positive.min()) if positive.size else 1e-3
    vmax = max(float(positive.max()) if positive.size else 1.0, FP16_MAX) * 2
    fig = Figure(figsize=(4.5 + 0.45 * steps, 1.4 + 0.24 * len(layers)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(np.ma.masked_invalid(np.where(data > 0, data, np.nan)), aspect="auto", cmap="viridis",
                      norm=LogNorm(vmin=vmin, vmax=vmax), interpolation="nearest")
    for i, j in zip(*np.nonzero(np.nan_to_num(data) > FP16_MAX)):
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///", edgecolor="red", linewidth=1.5))
    ax.set_xticks(range(steps), [str(s) for s in range(steps)])
    ax.set_yticks(range(len(layers)), [layer["short"] for layer in layers], fontsize=7)
    for label, layer in zip(ax.get_yticklabels(), layers):
        if layer["overflows"]:
            label.set_color("red")
    ax.set_xlabel("denoising step")
    ax.set_title(f"{result['model']}: max |q·k| per layer and step", fontsize=9)
    bar = fig.colorbar(image, ax=ax)
    bar.ax.axhline(FP16_MAX, color="red", linewidth=2)
    bar.set_label(f"max |q·k| (raw); red line: fp16 max {FP16_MAX:g}; hatched: above it")
    fig.tight_layout()
    fig.savefig(path)


def bias_resonance(result: dict[str, Any], path: Path) -> None:
    """Per layer: bias of q and k (log scale) and resonance cos; bars = dominant head, dots = every head."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    layers = [layer for layer in result["layers"] if layer["calls"]]
    x = np.arange(len(layers))
    fig = Figure(figsize=(max(6.0, 0.3 * len(layers) + 2), 6.5), dpi=100)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    for offset, side, color in ((-0.2, "q", "tab:blue"), (0.2, "k", "tab:orange")):
        dominant = [_nan(layer[f"bias_{side}"][layer["dominant_head"]]) for layer in layers]
        top.bar(x + offset, dominant, width=0.4, color=color, label=f"bias {side} (dominant head)")
        for i, layer in enumerate(layers):
            heads = [_nan(v) for v in layer[f"bias_{side}"]]
            top.plot([i + offset] * len(heads), heads, ".", color="black", markersize=3)
    top.set_yscale("log")
    top.set_ylabel("|token mean| / centred RMS norm")
    top.legend(fontsize=7)
    top.set_title(f"{result['model']}: bias along the sequence and q/k resonance (dots: every head)", fontsize=9)
    cos = [layer["resonance_cos"][layer["dominant_head"]] for layer in layers]
    bottom.bar(x, cos, width=0.6, color=["tab:red" if c >= 0 else "tab:purple" for c in cos])
    for i, layer in enumerate(layers):
        bottom.plot([i] * layer["heads"], layer["resonance_cos"], ".", color="black", markersize=3)
    bottom.axhline(0, color="black", linewidth=0.5)
    bottom.set_ylim(-1.05, 1.05)
    bottom.set_ylabel("resonance cos(mean q, mean k)")
    bottom.set_xticks(x, [layer["short"] for layer in layers], rotation=90, fontsize=7)
    for label, layer in zip(bottom.get_xticklabels(), layers):
        if layer["overflows"]:
            label.set_color("red")
    fig.tight_layout()
    fig.savefig(path)


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value
