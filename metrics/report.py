"""Quality report writing: ``report.json``, ``report.md``, PNG plots and a terminal table.

Report dict layout::

    {
        "command": str,                 # command line that produced the run
        "versions": {name: version},    # torch, diffusers, ... as strings
        "model": str,                   # model id or path
        "reference": "fp32",            # what every backend is compared against
        "settings": {...},              # free-form run settings (frames, steps, seed, ...)
        "backends": {
            name: {
                "scores": <pasa_diffusers.metrics.quality.score_video dict>,
                "seconds": float,       # optional: wall time of the backend's run
                "processors": {...},    # optional: summary of the attention processors used
            },
        },
    }

The writers need only ``backends[name]["scores"]`` (plus optional ``seconds``
and ``processors``) and, when present, ``command``, ``versions``, ``model``,
``reference`` and ``settings``. Before writing JSON every float is made
JSON-safe: ``inf`` becomes ``"inf"``, NaN becomes ``null``.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .quality import LPIPS_LABEL, json_float

COLUMNS = (
    "backend",
    "PSNR dB (mean)",
    "SSIM",
    "LPIPS",
    "temporal PSNR",
    "flicker",
    "non-finite frames",
    "time s",
)
NA = "n/a"
RANDOM_LPIPS_MARK = "†"


def json_safe(obj: Any) -> Any:
    """Recursively convert numpy values, paths and non-finite floats into JSON-safe values."""
    if isinstance(obj, dict):
        return {str(key): json_safe(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(value) for value in obj]
    if isinstance(obj, np.ndarray):
        return json_safe(obj.tolist())
    if isinstance(obj, np.generic):
        return json_safe(obj.item())
    if isinstance(obj, float):
        return json_float(obj)
    if isinstance(obj, Path):
        return str(obj)
    return obj


def _backends(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    backends = report.get("backends")
    if not isinstance(backends, dict):
        raise ValueError("report must have a 'backends' dict of {name: {'scores': ...}}")
    for name, entry in backends.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("scores"), dict):
            raise ValueError(f"report['backends'][{name!r}] must be a dict with a 'scores' dict")
    return backends


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return NA
    if value == "inf":
        return "inf"
    return format(float(value), spec)


def _with_inf(mean: Any, identical: int) -> str:
    """A PSNR-like mean, with the count of identical (``inf``) frames appended."""
    if mean is None:
        return f"inf (all {identical})" if identical else NA
    return f"{float(mean):.2f}" + (f" (+{identical} inf)" if identical else "")


def _row(name: str, entry: dict[str, Any]) -> list[str]:
    scores = entry["scores"]
    psnr, ssim, temporal = scores["psnr"], scores["ssim"], scores["temporal_psnr"]
    lpips = scores.get("lpips")
    lpips_cell = NA
    if lpips is not None:
        lpips_cell = _fmt(lpips["mean"], ".4f") + ("" if lpips.get("label") == LPIPS_LABEL else f" {RANDOM_LPIPS_MARK}")
    nonfinite = scores["nonfinite"]
    nonfinite_cell = str(nonfinite["count"])
    if nonfinite["count"]:
        nonfinite_cell += f" (first {nonfinite['first_index']})"
    seconds = entry.get("seconds")
    return [
        name,
        _with_inf(psnr["mean"], psnr.get("identical_frames", 0)),
        _fmt(ssim["mean"], ".4f"),
        lpips_cell,
        _with_inf(temporal["mean"], temporal.get("identical_pairs", 0)),
        _fmt(scores.get("flicker_ratio"), ".3f"),
        nonfinite_cell,
        NA if seconds is None else f"{float(seconds):.1f}",
    ]


def table_rows(report: dict[str, Any]) -> list[list[str]]:
    """One row of formatted cells per backend, in the order of :data:`COLUMNS`."""
    return [_row(name, entry) for name, entry in _backends(report).items()]


def format_table(report: dict[str, Any]) -> str:
    """The per-backend summary as an aligned plain-text table (drawn with ``rich`` when importable)."""
    rows = table_rows(report)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return _plain_table(rows)
    table = Table(title=f"Quality vs {report.get('reference', 'reference')}")
    for i, column in enumerate(COLUMNS):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(table)
    return console.file.getvalue().rstrip("\n")


def _plain_table(rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(COLUMNS, *rows)]

    def line(cells: list[str] | tuple[str, ...]) -> str:
        return "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width) for i, (cell, width) in enumerate(zip(cells, widths))
        ).rstrip()

    return "\n".join([line(COLUMNS), "  ".join("-" * width for width in widths), *(line(row) for row in rows)])


def _lpips_notes(backends: dict[str, dict[str, Any]]) -> list[str]:
    """Footnotes on LPIPS: non-standard labels, and why LPIPS is missing where it is."""
    scores = {name: entry["scores"] for name, entry in backends.items()}
    labels = {s["lpips"]["label"] for s in scores.values() if s.get("lpips")}
    notes = [f"{RANDOM_LPIPS_MARK} {label}" for label in sorted(labels - {LPIPS_LABEL})]
    missing = {
        name: s.get("lpips_unavailable", "LPIPS unavailable: no reason recorded")
        for name, s in scores.items()
        if not s.get("lpips")
    }
    if missing and len(missing) == len(scores):
        notes += sorted(set(missing.values()))
    else:
        notes += [f"{name}: {reason}" for name, reason in missing.items()]
    return notes


def format_markdown(report: dict[str, Any], plots: list[str] | tuple[str, ...] = ()) -> str:
    """The markdown report: title, command, versions, summary table, notes and plot links."""
    backends = _backends(report)
    reference = report.get("reference", "reference")
    lines = [f"# Quality report: {report.get('model', 'unknown model')}", ""]
    lines += ["## Command", "", "```", str(report.get("command", "")), "```", ""]
    lines += ["## Versions", ""]
    lines += [f"- {name}: {version}" for name, version in report.get("versions", {}).items()] or ["- (none recorded)"]
    lines += ["", f"## Scores against the {reference} reference", ""]
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|")
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in table_rows(report)]
    lines += ["", *(f"{note}  " for note in _lpips_notes(backends))]
    lines += [
        "",
        "PSNR: mean over frames with finite PSNR; `+k inf` counts frames identical to the reference "
        '(PSNR = inf, stored as `"inf"` in report.json). Temporal PSNR compares frame differences '
        "(data range 2); flicker is mean |frame change| of the backend over that of the reference. "
        "Frames with non-finite pixels are excluded from every mean and counted under non-finite frames.",
    ]
    if report.get("settings"):
        lines += ["", "## Settings", "", "```json", json.dumps(json_safe(report["settings"]), indent=2), "```"]
    processors = {name: e["processors"] for name, e in backends.items() if e.get("processors")}
    if processors:
        lines += ["", "## Attention processors", ""]
        lines += [f"- {name}: `{json.dumps(json_safe(summary))}`" for name, summary in processors.items()]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def _values(per_frame: list[Any]) -> np.ndarray:
    """Per-frame JSON values as floats: ``"inf"`` -> inf, ``null`` -> NaN."""
    return np.array([math.inf if v == "inf" else math.nan if v is None else float(v) for v in per_frame])


def _series(backends: dict[str, dict[str, Any]], metric: str) -> dict[str, np.ndarray]:
    series = {}
    for name, entry in backends.items():
        block = entry["scores"].get(metric)
        if block:
            series[name] = _values(block["per_frame"])
    return series


def _plot(series: dict[str, np.ndarray], path: Path, *, title: str, ylabel: str) -> Path:
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, values in series.items():
        ax.plot(np.arange(len(values)), values, marker="o", markersize=3, label=name)
    ax.set_xlabel("frame index")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def _psnr_plot(backends: dict[str, dict[str, Any]], path: Path, reference: str) -> Path:
    series = _series(backends, "psnr")
    finite = np.concatenate([v[np.isfinite(v)] for v in series.values()] + [np.empty(0)])
    title = f"PSNR vs {reference} reference"
    if any(np.isposinf(v).any() for v in series.values()):
        cap = float(math.ceil(finite.max() + 5.0)) if finite.size else 100.0
        series = {name: np.where(np.isposinf(v), cap, v) for name, v in series.items()}
        title += f"\n(identical frames, PSNR = inf, plotted at {cap:g} dB)"
    return _plot(series, path, title=title + _gap_note(backends), ylabel="PSNR (dB)")


def _gap_note(backends: dict[str, dict[str, Any]]) -> str:
    if any(e["scores"]["nonfinite"]["count"] for e in backends.values()):
        return "\n(gaps: frames with non-finite pixels)"
    return ""


def write_report(report: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``report.json``, ``psnr.png``, ``ssim.png``, ``lpips.png`` (if any LPIPS) and ``report.md``.

    Returns ``{"json", "markdown", "psnr", "ssim"[, "lpips"]}`` -> path.
    """
    backends = _backends(report)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reference = report.get("reference", "reference")
    written = {"json": out_dir / "report.json"}
    written["json"].write_text(json.dumps(json_safe(report), allow_nan=False, indent=2) + "\n")
    written["psnr"] = _psnr_plot(backends, out_dir / "psnr.png", reference)
    written["ssim"] = _plot(
        _series(backends, "ssim"),
        out_dir / "ssim.png",
        title=f"SSIM vs {reference} reference" + _gap_note(backends),
        ylabel="SSIM",
    )
    lpips = {name: v for name, v in _series(backends, "lpips").items() if np.isfinite(v).any()}
    if lpips:
        labels = sorted({backends[name]["scores"]["lpips"]["label"] for name in lpips})
        written["lpips"] = _plot(
            lpips,
            out_dir / "lpips.png",
            title=f"{', '.join(labels)} vs {reference} reference" + _gap_note(backends),
            ylabel="LPIPS (lower is closer)",
        )
    plots = [path.name for key, path in written.items() if key != "json"]
    written["markdown"] = out_dir / "report.md"
    written["markdown"].write_text(format_markdown(report, plots))
    return written
