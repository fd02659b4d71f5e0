"""Overflow diagnosis: which attention layers of an SVD pipeline overflow in FP16, and why.

``diagnose`` installs a ``DiagnosticAttnProcessor`` on every attention module of ``pipe.unet``, runs
one real generation (``pasa_diffusers.pipelines.svd.generate``) and restores the previous processors.  Each call
records ``call_stats`` (``diagnose_stats.py``: computed in float32, chunked to at most ``max_elements``
scores at once, never the full N x N matrix) on the call's ``(B, H, N, D)`` q and k, with the
denoising step, and then computes ordinary attention (SDPA in the model's dtype), so the generation
is the one the pipeline makes without the diagnosis.

Per layer the calls are aggregated (maxima and sums over calls; per-head statistics averaged over
calls), and two rules summarise them:

- risk = max |q . k| / 65504, the raw product over all calls: a kernel that rounds ``q k^T`` to FP16
  before scaling (naive FP16 attention) overflows where risk > 1; ``overflows`` = any raw score above
  65504 (``overflow_count > 0``).
- cause: per head, with token means ``m_q``, ``m_k`` (norms ``M_q``, ``M_k``), RMS norms of the centred
  tokens ``A_q = amplitude_q sqrt(D)``, ``A_k`` and ``cos = resonance_cos``, a score splits as
  ``q . k = m_q . m_k + m_q . x_k + x_q . m_k + x_q . x_k``, whose terms have the scales

      resonance  R = M_q M_k |cos|,     bias x amplitude  X = M_q A_k + A_q M_k,     amplitude  C = A_q A_k.

  On the dominant head (largest ``(M_q + A_q)(M_k + A_k)``, the scale of ``|q| |k|``) the largest of the
  three names the cause: R -> "bias (q .., k ..) + in-phase|anti-phase resonance (cos ..)",
  X -> "bias without resonance (q .., k .., cos ..)", C -> "amplitude (q .., k ..)" (the numbers are
  ``bias_q``/``bias_k`` resp. ``amplitude_q``/``amplitude_k`` of that head).  Where q or k is a single
  token (SVD's cross-attention keys) its whole value is its mean: X is then the other side's spread
  against it and is reported as "amplitude".  The cause names the dominant term whatever the size of
  the scores: ``risk`` says whether it matters.
"""
from __future__ import annotations

import io
import json
import math
import platform
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import torch
from diffusers.models.attention_processor import Attention

from pasa_diffusers.pipelines.svd import generate

from .diagnose_stats import FP16_MAX, call_stats
from .install import module_kind
from .processors import SDPAAttnProcessor
from .reference import DEFAULT_BETA

__all__ = ["DiagnosticAttnProcessor", "StepClock", "diagnose", "aggregate_layer", "layer_cause", "short_path",
           "ranked", "risk_table", "write_diagnosis", "RISK_RULE", "CAUSE_RULE", "BLOCK_N"]

RISK_RULE = "risk = max |q . k| / 65504 (raw product over all calls); overflows = any raw |q . k| > 65504"
CAUSE_RULE = ("on the dominant head (largest (M_q + A_q)(M_k + A_k)) the largest of R = M_q M_k |cos| "
              "(bias + resonance), X = M_q A_k + A_q M_k (bias without resonance), C = A_q A_k (amplitude); "
              "M = norm of the token mean, A = RMS norm of the centred tokens")

BLOCK_N = 128
"""Key block of PASA's shift (the kernel's and the reference's default) used for ``max_abs_shifted``."""

_PER_HEAD = ("bias_q", "bias_k", "amplitude_q", "amplitude_k", "resonance_cos", "sign_agreement",
             "mean_norm_q", "mean_norm_k")


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

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn: Attention,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
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


def _head_mean(values: list[list[float | None]]) -> list[float | None]:
    """Per head, the mean over calls of the values that are not ``None`` (``None`` where all are)."""
    out = []
    for column in zip(*values):
        kept = [v for v in column if v is not None]
        out.append(sum(kept) / len(kept) if kept else None)
    return out


def layer_cause(layer: dict[str, Any]) -> tuple[str, int | None]:
    """The cause text of an aggregated layer and its dominant head (see the module docstring)."""
    if not layer["calls"]:
        return "not called", None
    root_d = math.sqrt(layer["head_dim"])
    terms = []
    for h in range(layer["heads"]):
        m_q, m_k = layer["mean_norm_q"][h], layer["mean_norm_k"][h]
        a_q, a_k = layer["amplitude_q"][h] * root_d, layer["amplitude_k"][h] * root_d
        cos = layer["resonance_cos"][h]
        scale = (m_q + a_q) * (m_k + a_k)
        terms.append((scale, m_q * m_k * abs(cos), m_q * a_k + a_q * m_k, a_q * a_k))
    head = max(range(len(terms)), key=lambda i: terms[i][0])
    scale, res, cross, amp = terms[head]
    if scale == 0:
        return "zero q or k", head
    cos = layer["resonance_cos"][head]
    bias_q, bias_k = (_fmt_bias(layer[f"bias_{s}"][head]) for s in ("q", "k"))
    if res >= max(cross, amp):
        phase = "in-phase" if cos >= 0 else "anti-phase"
        return f"bias (q {bias_q}, k {bias_k}) + {phase} resonance (cos {cos:+.2f})", head
    single = layer["bias_q"][head] is None or layer["bias_k"][head] is None
    if cross >= amp and not single:
        return f"bias without resonance (q {bias_q}, k {bias_k}, cos {cos:+.2f})", head
    amp_q, amp_k = (_fmt_amp(layer, s, head) for s in ("q", "k"))
    return f"amplitude (q {amp_q}, k {amp_k})", head


def _fmt_bias(value: float | None) -> str:
    return "n/a (1 token)" if value is None else f"{value:.3g}"


def _fmt_amp(layer: dict[str, Any], side: str, head: int) -> str:
    return "1 token" if layer[f"bias_{side}"][head] is None else f"{layer[f'amplitude_{side}'][head]:.3g}"


def _block(path: str) -> str:
    match = re.match(r"(down_blocks\.\d+|up_blocks\.\d+|mid_block)", path)
    return match.group(1) if match else path.split(".", 1)[0]


def _transformer(path: str) -> str:
    return re.split(r"\.(?:temporal_)?transformer_blocks\.", path, maxsplit=1)[0]


def short_path(path: str) -> str:
    """``down_blocks.0.attentions.1.temporal_transformer_blocks.0.attn1`` -> ``down0.1.temporal.attn1``."""
    s = re.sub(r"\b(down|up)_blocks\.(\d+)", r"\1\2", path)
    s = s.replace("mid_block", "mid").replace(".attentions.", ".")
    s = re.sub(r"temporal_transformer_blocks\.(\d+)", lambda m: "temporal" + ("" if m[1] == "0" else m[1]), s)
    return re.sub(r"(?<!temporal_)transformer_blocks\.(\d+)", lambda m: "spatial" + ("" if m[1] == "0" else m[1]), s)


def aggregate_layer(path: str, records: list[dict[str, Any]], num_steps: int) -> dict[str, Any]:
    """One layer's entry of ``diagnose``'s result from its processor's ``records`` (see ``diagnose``).

    Maxima and ``overflow_count`` are taken over all calls, per-head statistics averaged over calls
    (skipping ``None``), ``per_step_*`` over the calls of each step.
    ``level`` is left ``None`` here (``diagnose`` fills in the spatial token count of the layer's
    transformer).
    """
    layer: dict[str, Any] = {"path": path, "short": short_path(path), "kind": module_kind(path),
                             "block": _block(path), "level": None, "calls": len(records)}
    if not records:
        layer.update(heads=None, head_dim=None, shape_q=None, shape_k=None, max_abs_qk=0.0, max_abs_score=0.0,
                     overflow_count=0, max_abs_shifted=0.0, nonfinite_calls=0, **dict.fromkeys(_PER_HEAD),
                     per_step_max_abs_qk=[None] * num_steps, per_step_overflow_count=[None] * num_steps,
                     risk=0.0, overflows=False, cause="not called", dominant_head=None)
        return layer
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
    layer["risk"] = layer["max_abs_qk"] / FP16_MAX
    layer["overflows"] = layer["overflow_count"] > 0
    layer["cause"], layer["dominant_head"] = layer_cause(layer)
    return layer


def _fill_levels(layers: list[dict[str, Any]]) -> None:
    """``level`` = token count of the spatial attention in the layer's transformer (None if there is none)."""
    tokens = {}
    for layer in layers:
        if layer["kind"].startswith("spatial") and layer["shape_q"] is not None:
            tokens[_transformer(layer["path"])] = layer["shape_q"][2]
    for layer in layers:
        layer["level"] = tokens.get(_transformer(layer["path"]))


def _finite_json(value: Any) -> Any:
    """Non-finite floats -> None, numpy scalars and tuples -> plain JSON types (for ``allow_nan=False``)."""
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(v) for v in value]
    if isinstance(value, (np.floating, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def _timed_generate(pipe: Any, image: Any, settings: dict[str, Any], desc: str, progress: bool,
                    on_step: Any = None) -> tuple[np.ndarray, float]:
    """Generate with a tqdm bar over the denoising steps; return the frames and the wall time."""
    from tqdm.auto import tqdm

    bar = tqdm(total=settings["num_inference_steps"], desc=desc, unit="step", file=sys.stderr, disable=not progress)

    def callback(pipeline: Any, i: int, t: Any, callback_kwargs: dict) -> dict:
        if on_step is not None:
            on_step(i, bar)
        bar.update(1)
        return callback_kwargs

    cuda = pipe.device.type == "cuda"
    try:
        if cuda:
            torch.cuda.synchronize(pipe.device)
        start = time.perf_counter()
        frames = generate(pipe, image, progress=False, callback_on_step_end=callback, **settings)
        seconds = time.perf_counter() - start
    finally:
        bar.close()
    return frames, seconds


def diagnose(pipe: Any, image: Any, *, num_frames: int, num_inference_steps: int, seed: int, height: int,
             width: int, progress: bool = True, max_elements: int = 2 ** 26, model: str | None = None,
             measure_overhead: bool = True) -> dict[str, Any]:
    """Diagnose FP16 overflow in every attention layer of ``pipe.unet`` during one generation.

    Args:
        pipe: a pipeline from ``pasa_diffusers.pipelines.svd.load_svd``; its processors are restored afterwards (also
            on error).
        image, num_frames, num_inference_steps, seed, height, width: as ``pasa_diffusers.pipelines.svd.generate``.
        progress: tqdm bars over the denoising steps (stderr).
        max_elements: most scores held at once per call (``call_stats``).
        model: the name reported (default: the pipeline's ``name_or_path``).
        measure_overhead: also time one plain generation with the previous processors (after the
            diagnosed one, which therefore carries any one-time warm-up: the ratio is an upper bound).

    Returns:
        ``{"model", "settings", "rules", "layers": [...], "overhead", "frames", "fp16_max"}``; each layer
        (in the order they first ran; never-called ones last) holds ``path``, ``short``, ``kind``,
        ``block``, ``level`` (token count of the spatial attention of its transformer), ``heads``,
        ``head_dim``, ``shape_q``, ``shape_k``, ``calls``, ``max_abs_qk``, ``max_abs_score``,
        ``overflow_count``, ``max_abs_shifted``, ``nonfinite_calls``, per head (means over calls)
        ``bias_q``, ``bias_k``, ``amplitude_q``, ``amplitude_k``, ``resonance_cos``,
        ``sign_agreement``, ``mean_norm_q``, ``mean_norm_k``, then
        ``per_step_max_abs_qk``, ``per_step_overflow_count`` (``None`` for steps without a call),
        ``risk``, ``overflows``, ``cause`` and ``dominant_head`` (rules in the module docstring).
        ``overhead`` = ``{"seconds_with", "seconds_without", "ratio"}`` (``None`` values without
        ``measure_overhead``); ``frames`` = ``{"finite", "match_plain"}``.
    """
    unet = pipe.unet
    previous = dict(unet.attn_processors)
    clock = StepClock()
    diagnostic = {key: DiagnosticAttnProcessor(key.removesuffix(".processor"), clock=clock, max_elements=max_elements)
                  for key in previous}
    settings = {"num_frames": num_frames, "num_inference_steps": num_inference_steps, "seed": seed,
                "height": height, "width": width}
    procs = list(diagnostic.values())

    def on_step(i: int, bar: Any) -> None:
        clock.step = i + 1
        peak = max((r["max_abs_qk"] for p in procs for r in p.records), default=0.0)
        hot = sum(any(r["overflow_count"] for r in p.records) for p in procs)
        bar.set_postfix_str(f"max|q.k| {peak:.3g}, {hot} layer(s) overflow")

    unet.set_attn_processor(dict(diagnostic))
    try:
        frames, seconds_with = _timed_generate(pipe, image, settings, "diagnose", progress, on_step)
    finally:
        unet.set_attn_processor(dict(previous))
    match_plain = seconds_without = None
    if measure_overhead:
        plain, seconds_without = _timed_generate(pipe, image, settings, "plain (timing)", progress)
        match_plain = bool(np.array_equal(plain, frames, equal_nan=True))
    procs.sort(key=lambda p: p.records[0]["order"] if p.records else math.inf)
    layers = [aggregate_layer(p.name, p.records, num_inference_steps) for p in procs]
    _fill_levels(layers)
    versions = {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__}
    return {
        "model": model or pipe.name_or_path or f"unnamed {type(pipe).__name__}",
        "settings": {**settings, "device": str(pipe.device), "dtype": str(unet.dtype).removeprefix("torch."),
                     "max_elements": max_elements, "beta": DEFAULT_BETA, "block_n": BLOCK_N, "versions": versions},
        "rules": {"risk": RISK_RULE, "cause": CAUSE_RULE},
        "layers": layers,
        "overhead": {"seconds_with": seconds_with, "seconds_without": seconds_without,
                     "ratio": seconds_with / seconds_without if seconds_without else None},
        "frames": {"finite": bool(np.isfinite(frames).all()), "match_plain": match_plain},
        "fp16_max": FP16_MAX,
    }


def ranked(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The layers by decreasing risk (ties in the order they ran)."""
    return sorted(result["layers"], key=lambda layer: -layer["risk"])


_COLUMNS = ("#", "layer", "kind", "level", "heads x D", "calls", "max|q.k|", "risk", "overflows", "max|S'| PASA",
            "cause")


def _row(rank: int, layer: dict[str, Any]) -> list[str]:
    level = layer["block"] + (f" @{layer['level']}" if layer["level"] else "")
    shape = f"{layer['heads']} x {layer['head_dim']}" if layer["heads"] else "-"
    over = f"{layer['overflow_count']:,}" if layer["overflows"] else "-"
    return [str(rank), layer["short"], layer["kind"], level, shape, str(layer["calls"]), f"{layer['max_abs_qk']:.4g}",
            f"{layer['risk']:.3g}", over, f"{layer['max_abs_shifted']:.4g}", layer["cause"]]


def _footer(result: dict[str, Any]) -> str:
    hot = [layer for layer in result["layers"] if layer["overflows"]]
    over = result["overhead"]
    timing = (f"overhead: {over['seconds_with']:.3g} s diagnosed vs {over['seconds_without']:.3g} s plain "
              f"(x{over['ratio']:.3g})" if over["seconds_without"] else f"diagnosed in {over['seconds_with']:.3g} s")
    s = result["settings"]
    return (f"{result['model']}: {len(hot)} of {len(result['layers'])} attention layers overflow FP16 "
            f"({s['num_frames']} frames, {s['num_inference_steps']} steps, {s['height']}x{s['width']}, "
            f"{s['device']} {s['dtype']}); {timing}\n{RISK_RULE}; level = block @ spatial tokens; "
            f"max|S'| = PASA's shifted scores")


def _plain_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [list(_COLUMNS)] + rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [list(_COLUMNS)] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def risk_table(result: dict[str, Any], *, use_rich: bool | None = None) -> str:
    """The layers ranked by risk as a terminal table (rich when importable, else plain text), with a footer.

    ``use_rich=None`` takes rich if it is installed; colours only when stdout is a terminal.
    """
    rows = [_row(i, layer) for i, layer in enumerate(ranked(result), start=1)]
    if use_rich is None:
        try:
            import rich  # noqa: F401

            use_rich = True
        except ImportError:
            use_rich = False
    if not use_rich:
        return _plain_table(rows) + "\n" + _footer(result)
    from rich.console import Console
    from rich.table import Table

    table = Table(title="FP16 attention overflow risk", title_justify="left")
    for name in _COLUMNS:
        table.add_column(name, justify="right" if name in ("#", "calls", "max|q.k|", "risk", "overflows",
                                                           "max|S'| PASA") else "left")
    for row, layer in zip(rows, ranked(result)):
        table.add_row(*row, style="bold red" if layer["overflows"] else None)
    tty = sys.stdout.isatty()
    width = shutil.get_terminal_size((200, 40)).columns if tty else 200
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=tty, color_system="auto" if tty else None)
    console.print(table)
    console.print(_footer(result), highlight=False)
    return buf.getvalue().rstrip("\n")


def _heatmap(result: dict[str, Any], path: Path) -> None:
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
    bar.set_label("max |q·k| (raw); red line: fp16 max 65504; hatched: above it")
    fig.tight_layout()
    fig.savefig(path)


def _bias_resonance(result: dict[str, Any], path: Path) -> None:
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


def write_diagnosis(result: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``diagnosis.json`` (strict JSON: non-finite numbers become null), ``heatmap.png`` and
    ``bias_resonance.png`` into ``out_dir``; return ``{"json", "heatmap", "bias_resonance"}`` paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "diagnosis.json", "heatmap": out / "heatmap.png",
             "bias_resonance": out / "bias_resonance.png"}
    paths["json"].write_text(json.dumps(_finite_json(result), indent=1, allow_nan=False))
    _heatmap(result, paths["heatmap"])
    _bias_resonance(result, paths["bias_resonance"])
    return paths
