"""How much of the dense attention a block-sparse mask keeps: the quality proxy to check on one's own checkpoint
before trusting a mask (issue 46).

For a query row ``i`` the coverage is ``sum_{j kept} softmax(scale q_i . k)_j``: the share of the row's dense
attention mass (in float64) that falls on the kept keys (1 for a full mask, 0 for an empty row).  The output a
mask gives is the dense output of the kept keys renormalised, so a row that keeps a share ``c`` of its mass has
an error bounded by ``2 (1 - c) max |v|``; coverage near 1 is what a good mask shows.  Rows are sampled
(``sample_rows``) since a dense row costs ``Nk`` logits.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from .block_sparse import BlockSparseMask

__all__ = ["sample_rows_of", "row_coverage", "coverage", "head_density", "coverage_table", "plot_coverage"]


def sample_rows_of(n_q: int, sample_rows: int | None, seed: int = 0) -> torch.Tensor:
    """``sample_rows`` distinct query rows of ``n_q``, ascending (all of them when None or ``>= n_q``)."""
    if sample_rows is None or sample_rows >= n_q:
        return torch.arange(n_q)
    if sample_rows < 1:
        raise ValueError(f"coverage: sample_rows must be a positive int or None, got sample_rows={sample_rows!r}")
    gen = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randperm(n_q, generator=gen)[:sample_rows]).values


def row_coverage(q: torch.Tensor, k: torch.Tensor, mask: BlockSparseMask, *, sample_rows: int | None = 256,
                 scale: float | None = None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sampled row, the kept share of the dense attention mass: (B, Hq, rows) float64, and the rows
    (rows,) int64.  q (B, Hq, Nq, D), k (B, Hk, Nk, D) with GQA; dense logits in float64, one head at a time.
    The share is ``sum_kept w / sum_all w`` of the same weights ``w = exp(logit - max)``: exactly 1 for a row
    that keeps every key, exactly 0 for one that keeps none."""
    mask.check_call(q, k, "coverage")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    rows = sample_rows_of(q.shape[2], sample_rows, seed).to(q.device)
    blocks = mask.kept_blocks(q.shape[0], q.shape[1])[:, :, rows // mask.block_q]  # (B, Hq, rows, nk)
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape[0], q.shape[1], rows.numel(), dtype=torch.float64, device=q.device)
    for h in range(q.shape[1]):  # one head's (B, rows, Nk) at a time: 0.2 GB at 75 000 keys and 256 rows
        kept = blocks[:, h].repeat_interleave(mask.block_k, dim=-1)[..., :k.shape[2]]
        logits = scale * (q[:, h, rows].double() @ k[:, h // group].double().transpose(-1, -2))
        weights = torch.exp(logits - logits.amax(-1, keepdim=True))
        out[:, h] = (weights * kept).sum(-1) / weights.sum(-1)
    return out, rows


def coverage(q: torch.Tensor, k: torch.Tensor, mask: BlockSparseMask, *, sample_rows: int | None = 256,
             scale: float | None = None, seed: int = 0) -> torch.Tensor:
    """The share of the dense attention mass the mask keeps, per (batch, query head), averaged over the sampled
    rows: (B, Hq) float64 in [0, 1] (:func:`row_coverage`)."""
    return row_coverage(q, k, mask, sample_rows=sample_rows, scale=scale, seed=seed)[0].mean(-1)


def head_density(mask: BlockSparseMask, batch: int, heads: int) -> torch.Tensor:
    """The share of (query, key) pairs the mask keeps, per (batch, query head): (batch, heads) float64, ragged
    tail blocks weighted by their size; computed on the block grid (``nq x nk``), never the ``Nq x Nk`` element
    mask that ``BlockSparseMask.density`` builds (gigabytes at a 720p video's 75 000 tokens)."""
    def sizes(length: int, block: int, n: int) -> torch.Tensor:
        return torch.clamp(length - torch.arange(n, device=mask.device) * block, max=block).double()

    kept = mask.kept_blocks(batch, heads).double()
    size_q = sizes(mask.q_len, mask.block_q, mask.n_q_blocks)
    size_k = sizes(mask.kv_len, mask.block_k, mask.n_k_blocks)
    return torch.einsum("bhqk,q,k->bh", kept, size_q, size_k) / (mask.q_len * mask.kv_len)


def coverage_table(captures: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                   masks: BlockSparseMask | Mapping[str, BlockSparseMask], *, sample_rows: int | None = 256,
                   scale: float | None = None, seed: int = 0) -> list[dict]:
    """One row per (layer, head): ``captures`` maps a layer's name to its (q, k); ``masks`` is one mask for every
    layer or one per layer.  Each row: ``layer``, ``head``, ``coverage`` (mean over batch and sampled rows),
    ``worst`` (the smallest row's), ``density`` (the mask's)."""
    table = []
    for name, (q, k) in captures.items():
        mask = masks if isinstance(masks, BlockSparseMask) else masks[name]
        per_row, _ = row_coverage(q, k, mask, sample_rows=sample_rows, scale=scale, seed=seed)
        density = mask.density
        for h in range(q.shape[1]):
            table.append({"layer": name, "head": h, "coverage": float(per_row[:, h].mean()),
                          "worst": float(per_row[:, h].min()), "density": density})
    return table


def plot_coverage(table: Iterable[dict], path: str | Path, *, title: str | None = None) -> Path:
    """A heat map of :func:`coverage_table`'s coverage, layers down, heads across, written to ``path`` (PNG or
    SVG by its suffix; matplotlib's Agg canvas, no display), under ``title`` where given."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = list(table)
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    heads = 1 + max(r["head"] for r in rows)
    grid = torch.full((len(layers), heads), float("nan"), dtype=torch.float64)
    for r in rows:
        grid[layers.index(r["layer"]), r["head"]] = r["coverage"]
    label = max(len(str(layer)) for layer in layers)
    fig = Figure(figsize=(max(4.5, 2.5 + 0.07 * label + 0.4 * heads), max(2.5, 1.2 + 0.35 * len(layers))))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(grid.numpy(), vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    ax.set_xlabel("head")
    ax.set_xticks(range(heads))
    ax.set_yticks(range(len(layers)), layers)
    fig.colorbar(image, ax=ax, label="kept share of the mass")
    if title is not None:
        ax.set_title(title, fontsize="medium")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path
