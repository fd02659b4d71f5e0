"""Mask coverage of a video transformer during one generation: per self-attention layer and head, the share of the
dense attention mass that each block-sparse mask keeps (issue 46, item 4).

The quality proxy a user checks on their own checkpoint before trusting a mask: ``coverage_run`` generates one
(short) video and, in every self-attention call of the transformer (module kind ``video-self``: Wan's and
LTX-Video's ``attn1``, the joint ``attn`` of CogVideoX, HunyuanVideo and Mochi; cross-attention and HunyuanVideo's
text refiner keep their processors), measures ``mask_coverage.row_coverage`` of each mask (``MaskChoice``: the
static tile window and Radial Attention's mask of ``video_masks``, or the dynamic pooled top-k mask built from the
call's own q and k) on sampled query rows against the dense float64 softmax.  The recording is the diagnosis's
(``pasa_diffusers.diagnose.recording`` with ``pipelines.diagnose.recorders_on``): a ``CoverageAttnProcessor``
hands each call's q and k to its layer's ``CoverageRecorder`` and computes the stock attention, so the video is
the one the pipeline makes without it.  The masks see the sequence the model attends over (``VideoTokens``: the
latent grid over the patch, ``video.token_grid``, and the text tokens a joint attention adds,
``video.self_attention_text``), reordered into compact 3D tiles first (``video_masks.tile_order``) unless
``order="model"``; coverage does not depend on the order, the masks do.

``summarize_coverage`` gives one row per (mask, layer, head): ``density`` (the share of (query, key) pairs kept,
``mask_coverage.head_density``), and ``mean``, ``median`` and ``min`` of the kept share over every sampled row of
every call; ``write_coverage`` writes ``coverage.json``, ``coverage.md`` and one heat map per mask, and
``summary_lines`` the lines a user reads first (each mask's worst layers and heads).
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from pasa_diffusers.block_sparse import DEFAULT_BLOCK
from pasa_diffusers.diagnose import StepClock, recording
from pasa_diffusers.install import attention_processors, module_kind
from pasa_diffusers.mask_coverage import head_density, plot_coverage, row_coverage
from pasa_diffusers.metrics.records import versions
from pasa_diffusers.backends import SELF_KIND
from pasa_diffusers.sparse_processor import ORDERS
from pasa_diffusers.video_masks import MaskBuilder, MaskChoice, TokenOrder, VideoTokens, tile_order

from .diagnose import DiagnosticAttnProcessor, _timed_generate, recorders_on
from .video import NOTICE, denoiser, is_video_pipeline, self_attention_tokens

__all__ = ["SELF_KIND", "DEFAULT_ROWS", "ORDERS", "MIN_BLOCKS", "CoverageLayoutError",
           "CoverageRecorder", "CoverageAttnProcessor", "default_block", "coverage_recording",
           "summarize_coverage", "coverage_run", "coverage_markdown", "summary_lines", "write_coverage"]

DEFAULT_ROWS = 256
"""Query rows sampled per call by default (every row of a call that has fewer)."""
MIN_BLOCKS = 8
"""The fewest blocks the default block size cuts a sequence into (``default_block``)."""

class CoverageLayoutError(ValueError):
    """A measured call is not the self-attention of the video's token sequence (another length or a key mask)."""


class CoverageRecorder:
    """The coverage of every call of one self-attention layer, per mask.

    Each ``record(query, key, scale)`` (``(B, N, H, D)`` as diffusers' processors hold them) checks that the call
    attends the ``tokens`` sequence to itself, puts q and k in the masks' ``order``, and keeps per mask the
    kept share of each sampled row ``(B, H, rows)`` and the mask's ``head_density`` ``(B, H)`` (float64, on the
    CPU); the rows are drawn afresh for each call (seed ``seed`` + the call's index)."""

    def __init__(self, name: str, clock: StepClock, *, tokens: VideoTokens, masks: Mapping[str, MaskBuilder],
                 order: TokenOrder | None, sample_rows: int, seed: int = 0) -> None:
        self.name = name
        self.clock = clock
        self.tokens = tokens
        self.masks = dict(masks)
        self.order = order
        self.sample_rows = sample_rows
        self.seed = seed
        self.rows: dict[str, list[torch.Tensor]] = {name: [] for name in self.masks}
        self.density: dict[str, list[torch.Tensor]] = {name: [] for name in self.masks}
        self.calls = 0

    @torch.no_grad()
    def record(self, query: torch.Tensor, key: torch.Tensor, scale: float | None) -> None:
        n = self.tokens.n_tokens
        if query.shape[1] != n or key.shape[1] != n:
            t = self.tokens
            raise CoverageLayoutError(
                f"{self.name} attends {query.shape[1]} queries to {key.shape[1]} keys, not the self-attention of "
                f"the video's {t.frames}x{t.height}x{t.width} tokens and {t.text} text tokens ({n} to {n})")
        q, k = query.transpose(1, 2), key.transpose(1, 2)
        if self.order is not None:
            q, k = self.order.apply(q), self.order.apply(k)
        for mask_name, build in self.masks.items():
            mask = build(q, k)
            per_row, _ = row_coverage(q, k, mask, sample_rows=self.sample_rows, scale=scale,
                                      seed=self.seed + self.calls)
            self.rows[mask_name].append(per_row.cpu())
            self.density[mask_name].append(head_density(mask, q.shape[0], q.shape[1]).cpu())
        self.calls += 1
        self.clock.calls += 1


def _keeps_every_key(mask: torch.Tensor) -> bool:
    if mask.dtype == torch.bool:
        return bool(mask.all())
    return bool((mask == 0).all())


class CoverageAttnProcessor(DiagnosticAttnProcessor):
    """The diagnosis's processor (stock SDPA after handing q and k to its recorder) for a coverage recorder: a
    call with an attention mask that drops keys is refused (``CoverageLayoutError``), since the dense mass
    the coverage is measured against would then not be the call's."""

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                  attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is not None and not _keeps_every_key(attention_mask):
            raise CoverageLayoutError(f"{self.name} passes an attention mask that drops keys; coverage measures "
                                      "calls that attend every token")
        return super().attention(query, key, value, scale, attention_mask)


def default_block(n_tokens: int) -> int:
    """The masks' block for a sequence of ``n_tokens``: ``DEFAULT_BLOCK`` (128, the kernels' key block) where that
    makes at least ``MIN_BLOCKS`` blocks (every real video), else the largest power of two that does (a tiny
    model's 48 tokens: blocks of 4), 1 at least."""
    block = DEFAULT_BLOCK
    while block > 1 and n_tokens < MIN_BLOCKS * block:
        block //= 2
    return block


@contextmanager
def coverage_recording(model: torch.nn.Module, tokens: VideoTokens, masks: Mapping[str, MaskBuilder], *,
                       sample_rows: int, order: TokenOrder | None = None, seed: int = 0,
                       clock: StepClock | None = None) -> Iterator[list[CoverageRecorder]]:
    """Measure ``masks`` on every self-attention call (``SELF_KIND``) of ``model`` while the ``with`` block runs:
    yields the ``CoverageRecorder`` of each such layer, in module order; the other attention modules keep their
    processors, and every processor is restored on exit (``diagnose.recording``).  ``ValueError`` for a model
    without self-attention modules of a video transformer."""
    stock = attention_processors(model)
    selected = [key.removesuffix(".processor") for key in stock if module_kind(key) == SELF_KIND]
    if not selected:
        raise ValueError(f"coverage_recording: {type(model).__name__} has no self-attention module of a video "
                         f"transformer's blocks (module kind {SELF_KIND!r})")
    wrap = recorders_on(model, CoverageAttnProcessor)

    def processor(recorder: CoverageRecorder) -> Any:
        return wrap(recorder) if recorder.name in selected else stock[f"{recorder.name}.processor"]

    def recorder(name: str, clock: StepClock) -> CoverageRecorder:
        return CoverageRecorder(name, clock, tokens=tokens, masks=masks, order=order, sample_rows=sample_rows,
                                seed=seed)

    with recording(model, processor, clock=clock, recorder=recorder) as recorders:
        yield [r for r in recorders if r.name in selected]


def summarize_coverage(recorders: Sequence[CoverageRecorder]) -> list[dict[str, Any]]:
    """One row per (mask, layer, head), masks in their order, then layers in module order: ``mask``, ``layer``,
    ``head``, ``calls``, ``rows`` (sampled rows over every call and batch element), ``density`` (mean over calls
    and batch), ``mean``, ``median`` and ``min`` of the kept share of those rows.  A layer never called has no
    rows."""
    table = []
    for mask in (recorders[0].masks if recorders else {}):
        for recorder in recorders:
            if not recorder.calls:
                continue
            per_row = torch.cat([r.transpose(0, 1).flatten(1) for r in recorder.rows[mask]], dim=1)  # (H, rows)
            density = torch.cat([d.transpose(0, 1) for d in recorder.density[mask]], dim=1).mean(1)
            for head in range(per_row.shape[0]):
                values = per_row[head]
                table.append({"mask": mask, "layer": recorder.name, "head": head, "calls": recorder.calls,
                              "rows": values.numel(), "density": float(density[head]), "mean": float(values.mean()),
                              "median": float(torch.quantile(values, 0.5)), "min": float(values.min())})
    return table


def coverage_run(pipe: Any, masks: Sequence[MaskChoice], *, num_frames: int, num_inference_steps: int, seed: int,
                 height: int, width: int, block: int | None = None, sample_rows: int | None = None,
                 order: str = "tile", progress: bool = True, model: str | None = None) -> dict[str, Any]:
    """Measure each of ``masks`` on every self-attention call of one generation of a video pipeline.

    Args:
        pipe: a video-transformer pipeline (``video.load_video``); its processors are restored afterwards.
        masks: the masks, one of each kind at most.
        num_frames, num_inference_steps, seed, height, width: the generation (``video.generate``).
        block: the masks' query and key block, fewer tokens than the sequence (``None``: ``default_block``).
        sample_rows: query rows sampled per call, at most the sequence's tokens (``None``: ``DEFAULT_ROWS``, or
            every row where the sequence has fewer).
        order: one of ``ORDERS``.
        progress: a tqdm bar over the denoising steps (stderr).
        model: the name reported (default: the pipeline's ``name_or_path``).

    Raises:
        ValueError: a pipeline that is not a video transformer's, repeated mask kinds, an unknown ``order``,
            ``block`` or ``sample_rows`` out of range (naming the argument); ``CoverageLayoutError`` from a call
            that is not the self-attention of the video's tokens, or a self-attention layer with no call measured.

    Returns:
        ``{"model", "settings", "tokens", "masks": [{"name", "label", "parameters"}], "table":
        summarize_coverage(...), "layers", "heads", "conditioning"}``.
    """
    if not is_video_pipeline(pipe):
        raise ValueError(f"coverage_run: {type(pipe).__name__} is not a video-transformer pipeline")
    kinds = [m.kind for m in masks]
    if not kinds or len(set(kinds)) != len(kinds):
        raise ValueError(f"coverage_run: masks must be one or more of distinct kinds, got {kinds}")
    if order not in ORDERS:
        raise ValueError(f"coverage_run: order must be one of {ORDERS}, got order={order!r}")
    tokens = self_attention_tokens(pipe, num_frames=num_frames, height=height, width=width)
    n = tokens.n_tokens
    block = default_block(n) if block is None else block
    if not (isinstance(block, int) and 1 <= block < n):
        raise ValueError(f"coverage_run: block must be an int in [1, {n - 1}] (a block of all {n} tokens is kept by "
                         f"every mask), got block={block!r}")
    rows = min(DEFAULT_ROWS, n) if sample_rows is None else sample_rows
    if not (isinstance(rows, int) and 1 <= rows <= n):
        raise ValueError(f"coverage_run: sample_rows must be an int in [1, {n}] (the queries of a self-attention "
                         f"call), got sample_rows={sample_rows!r}")
    masks = [m.resolved(tokens) for m in masks]  # the defaults of this grid, as the report names them
    net = denoiser(pipe)
    token_order = tile_order(tokens, block=block) if order == "tile" else None
    builders = {m.kind: m.builder(tokens, token_order, block, pipe.device) for m in masks}
    settings = {"num_frames": num_frames, "num_inference_steps": num_inference_steps, "seed": seed, "height": height,
                "width": width}
    clock = StepClock()
    with coverage_recording(net, tokens, builders, sample_rows=rows, order=token_order, seed=seed,
                            clock=clock) as recorders:

        def on_step(i: int, bar: Any) -> None:
            clock.step = i + 1
            bar.set_postfix_str(f"{clock.calls} self-attention calls measured")

        _timed_generate(pipe, None, settings, "coverage", progress, on_step)
    silent = [r.name for r in recorders if not r.calls]
    if silent:
        raise CoverageLayoutError(f"{', '.join(silent)} made no attention call the coverage could measure (a causal, "
                                  "dropout or keyword-argument call goes to a fallback, not to the recorder)")
    table = summarize_coverage(recorders)
    return {
        "model": model or pipe.name_or_path or f"unnamed {type(pipe).__name__}",
        "settings": {**settings, "device": str(pipe.device), "dtype": str(net.dtype).removeprefix("torch."),
                     "block": block, "sample_rows": rows, "order": order, "versions": versions()},
        "tokens": {"frames": tokens.frames, "height": tokens.height, "width": tokens.width, "text": tokens.text,
                   "text_at": tokens.text_at, "total": n},
        "masks": [{"name": m.kind, "label": m.label, "parameters": m.parameters()} for m in masks],
        "table": table,
        "layers": [r.name for r in recorders],
        "heads": 1 + max((row["head"] for row in table), default=-1),
        "conditioning": NOTICE,
    }


def _context(result: dict[str, Any]) -> str:
    s, t = result["settings"], result["tokens"]
    text = f" + {t['text']} text tokens ({t['text_at']})" if t["text"] else ""
    return (f"{s['num_frames']} frames, {s['num_inference_steps']} steps, {s['height']}x{s['width']}: "
            f"{t['frames']}x{t['height']}x{t['width']} video tokens{text}; {s['sample_rows']} of {t['total']} query "
            f"rows sampled per call, blocks of {s['block']}, {s['order']} order; {s['device']} {s['dtype']}")


def summary_lines(result: dict[str, Any], worst: int = 3) -> list[str]:
    """What a user reads first: the run in one line, then per mask its mean density and coverage and its
    ``worst`` layers and heads by mean coverage (with their worst row)."""
    rows = result["table"]
    lines = [f"{result['model']}: mask coverage of {len(result['layers'])} self-attention layers x "
             f"{result['heads']} heads ({_context(result)})"]
    for mask in result["masks"]:
        mine = [r for r in rows if r["mask"] == mask["name"]]
        if not mine:
            continue
        mean = sum(r["mean"] for r in mine) / len(mine)
        density = sum(r["density"] for r in mine) / len(mine)
        lowest = min(r["min"] for r in mine)
        lines.append(f"{mask['label']}: density {density:.3f}, coverage mean {mean:.4f} (lowest row {lowest:.4f})")
        for r in sorted(mine, key=lambda r: r["mean"])[:worst]:
            lines.append(f"  worst: {r['layer']} head {r['head']}: mean {r['mean']:.4f}, min {r['min']:.4f}, "
                         f"density {r['density']:.3f}")
    return lines


def coverage_markdown(result: dict[str, Any]) -> str:
    """The report as markdown: the run, then one table row per (mask, layer, head)."""
    lines = [f"# Mask coverage: {result['model']}", "", _context(result) + ".", "",
             "coverage = the share of the dense attention mass (float64 softmax over every key) that falls on the "
             "mask's kept keys, per sampled query row; density = the share of (query, key) pairs kept.", "",
             "| mask | layer | head | density | mean | median | min | calls | rows |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["table"]:
        lines.append(f"| {r['mask']} | {r['layer']} | {r['head']} | {r['density']:.4f} | {r['mean']:.4f} | "
                     f"{r['median']:.4f} | {r['min']:.4f} | {r['calls']} | {r['rows']} |")
    return "\n".join(lines) + "\n"


def write_coverage(result: dict[str, Any], out: str | Path) -> dict[str, Path]:
    """Write ``coverage.json``, ``coverage.md`` and ``coverage_<mask>.png`` (the mean coverage, layers x heads)
    into ``out`` (created); return ``{"json", "markdown", "plot <mask>": path}``."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    written = {"json": folder / "coverage.json", "markdown": folder / "coverage.md"}
    written["json"].write_text(json.dumps(result, indent=2) + "\n")
    written["markdown"].write_text(coverage_markdown(result))
    for mask in result["masks"]:
        table = [{"layer": r["layer"], "head": r["head"], "coverage": r["mean"]}
                 for r in result["table"] if r["mask"] == mask["name"]]
        if table:
            written[f"plot {mask['name']}"] = plot_coverage(table, folder / f"coverage_{mask['name']}.png",
                                                            title=f"{mask['name']}: mean coverage per head")
    return written
