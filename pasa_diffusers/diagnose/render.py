"""A diagnosis result rendered: the risk table for the terminal, and the files of ``write_diagnosis``.

The result is the dict of ``diagnose`` (the application, ``pipelines/diagnose.py``): ``model``, ``settings``,
``layers`` (``aggregate.summarize``), ``overhead``; the JSON follows ``metrics.records``' convention.
"""
from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path
from typing import Any

from pasa_diffusers.metrics.records import atomic_path, write_json

from ..rules import FP16_MAX
from .plots import bias_resonance, heatmap

__all__ = ["LEGEND", "ranked", "risk_table", "write_diagnosis"]

_COLUMNS = ("#", "layer", "kind", "level", "heads x D", "calls", "max|q.k|", "risk", "overflows", "max|S'| PASA",
            "cause")
_NUMERIC = ("#", "calls", "max|q.k|", "risk", "overflows", "max|S'| PASA")
LEGEND = (f"risk = max |q . k| / {FP16_MAX:g} (raw product over all calls); overflows = how many raw scores "
          f"|q . k| exceed {FP16_MAX:g}, summed over all calls (- for none); level = block @ spatial tokens; "
          "max|S'| = PASA's shifted scores")
"""What the table's columns hold, printed under it."""


def ranked(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The layers by decreasing risk (ties in the order they ran)."""
    return sorted(result["layers"], key=lambda layer: -layer["risk"])


def _row(rank: int, layer: dict[str, Any]) -> list[str]:
    level = layer["block"] + (f" @{layer['level']}" if layer["level"] else "")
    shape = f"{layer['heads']} x {layer['head_dim']}" if layer["heads"] else "-"
    over = f"{layer['overflow_count']:,}" if layer["overflows"] else "-"
    return [str(rank), layer["short"], layer["kind"], level, shape, str(layer["calls"]), f"{layer['max_abs_qk']:.4g}",
            f"{layer['risk']:.3g}", over, f"{layer['max_abs_shifted']:.4g}", layer["cause"]]


def _count(n: int, noun: str) -> str:
    """``"1 step"``, ``"2 steps"``."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _footer(result: dict[str, Any]) -> str:
    hot = sum(1 for layer in result["layers"] if layer["overflows"])
    over = result["overhead"]
    timing = (f"overhead: {over['seconds_with']:.3g} s diagnosed vs {over['seconds_without']:.3g} s plain "
              f"(x{over['ratio']:.3g})" if over["seconds_without"] else f"diagnosed in {over['seconds_with']:.3g} s")
    s = result["settings"]
    verb = "overflows" if hot == 1 else "overflow"
    return (f"{result['model']}: {hot} of {_count(len(result['layers']), 'attention layer')} {verb} FP16 "
            f"({_count(s['num_frames'], 'frame')}, {_count(s['num_inference_steps'], 'step')}, "
            f"{s['height']}x{s['width']}, {s['device']} {s['dtype']}); {timing}\n{LEGEND}")


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
        table.add_column(name, justify="right" if name in _NUMERIC else "left")
    for row, layer in zip(rows, ranked(result)):
        table.add_row(*row, style="bold red" if layer["overflows"] else None)
    tty = sys.stdout.isatty()
    width = shutil.get_terminal_size((200, 40)).columns if tty else 200
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=tty, color_system="auto" if tty else None)
    console.print(table)
    console.print(_footer(result), highlight=False)
    return buf.getvalue().rstrip("\n")


def write_diagnosis(result: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``diagnosis.json`` (strict JSON: NaN as null, +-inf as "inf"/"-inf", see ``metrics.records``),
    ``heatmap.png`` and ``bias_resonance.png`` into ``out_dir``, each atomically; return
    ``{"json", "heatmap", "bias_resonance"}`` paths."""
    out = Path(out_dir)
    paths = {"json": out / "diagnosis.json", "heatmap": out / "heatmap.png",
             "bias_resonance": out / "bias_resonance.png"}
    write_json(paths["json"], result)
    for key, draw in (("heatmap", heatmap), ("bias_resonance", bias_resonance)):
        with atomic_path(paths[key]) as tmp:
            draw(result, tmp)
    return paths
