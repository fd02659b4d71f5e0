"""A diagnosis result rendered: the risk table for the terminal, and the files of ``write_diagnosis``.

The result is the dict of ``diagnose`` (the application, ``pasa_diffusers/pipelines/diagnose.py``): ``model``, ``settings``,
``layers`` (``aggregate.summarize``), ``overhead`` and, for a video transformer, ``activations``
(``activations.summarize_activations``); the JSON follows ``files.py``' convention.
"""
from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path
from typing import Any

from ..files import atomic_path, write_json
from ..rules import FP16_MAX
from .plots import bias_resonance, heatmap

__all__ = ["LEGEND", "ACTIVATION_LEGEND", "ranked", "risk_table", "activation_table", "write_diagnosis"]

_COLUMNS = ("#", "layer", "kind", "level", "heads x D", "calls", "max|q.k|", "risk", "overflows", "max|S'| PASA",
            "cause")
_NUMERIC = ("#", "calls", "max|q.k|", "risk", "overflows", "max|S'| PASA")
LEGEND = (f"risk = max |q . k| / {FP16_MAX:g} (raw product over all calls); overflows = how many raw scores "
          f"|q . k| exceed {FP16_MAX:g}, summed over all calls (- for none); level = block @ spatial tokens (SVD) "
          "or video tokens (a video transformer); max|S'| = PASA's shifted scores")
"""What the table's columns hold, printed under it."""

_ACTIVATION_COLUMNS = ("block", "role", "module", "calls", "max|x|", "risk", "fp16")
_ACTIVATION_NUMERIC = ("calls", "max|x|", "risk")
ACTIVATION_LEGEND = (f"max|x| = largest absolute value of the module's output over all calls; risk = max|x| / "
                     f"{FP16_MAX:g}; above 1 an fp16 copy of it holds inf; attention output = after the output "
                     "projection; norm = before the block's modulation")
"""What the activation table's columns hold, printed under it."""


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


def _plain_table(columns: tuple[str, ...], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [list(columns)] + rows) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [list(columns)] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def _table(title: str, columns: tuple[str, ...], numeric: tuple[str, ...], rows: list[list[str]],
           hot: list[bool], footer: str, use_rich: bool | None) -> str:
    """``rows`` under ``columns`` (the ``hot`` ones in bold red with rich), then ``footer``: rich when
    ``use_rich`` (``None``: when it is installed), colours only when stdout is a terminal, else plain text."""
    if use_rich is None:
        use_rich = _rich_available()
    if not use_rich:
        return _plain_table(columns, rows) + "\n" + footer
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for name in columns:
        table.add_column(name, justify="right" if name in numeric else "left")
    for row, red in zip(rows, hot):
        table.add_row(*row, style="bold red" if red else None)
    tty = sys.stdout.isatty()
    width = shutil.get_terminal_size((200, 40)).columns if tty else 200
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=tty, color_system="auto" if tty else None)
    console.print(table)
    console.print(footer, highlight=False)
    return buf.getvalue().rstrip("\n")


def risk_table(result: dict[str, Any], *, use_rich: bool | None = None) -> str:
    """The layers ranked by risk as a terminal table (rich when importable, else plain text), with a footer.

    ``use_rich=None`` takes rich if it is installed; colours only when stdout is a terminal.
    """
    layers = ranked(result)
    rows = [_row(i, layer) for i, layer in enumerate(layers, start=1)]
    return _table("FP16 attention overflow risk", _COLUMNS, _NUMERIC, rows, [layer["overflows"] for layer in layers],
                  _footer(result), use_rich)


def _activation_row(site: dict[str, Any]) -> list[str]:
    over = "inf in fp16" if site["overflows"] else ("non-finite" if site["nonfinite_calls"] else "-")
    return [site["block"], site["role"], site["path"], str(site["calls"]), f"{site['max_abs']:.4g}",
            f"{site['risk']:.3g}", over]


def _activation_footer(result: dict[str, Any]) -> str:
    sites = result["activations"]
    hot = [site for site in sites if site["overflows"]]
    blocks = sorted({site["block"] for site in hot}, key=[site["block"] for site in sites].index)
    where = f": {', '.join(blocks)}" if blocks else ""
    return (f"{len(hot)} of {_count(len(sites), 'activation')} exceed {FP16_MAX:g}{where}\n{ACTIVATION_LEGEND}")


def activation_table(result: dict[str, Any], *, use_rich: bool | None = None) -> str:
    """Per transformer block, the largest |x| of its attention outputs, feed-forward, norms and residual stream
    (``result["activations"]``, ``activations.summarize_activations``), in the model's order, with a footer."""
    sites = result["activations"]
    rows = [_activation_row(site) for site in sites]
    return _table(f"FP16 range of the activations (largest |x| against {FP16_MAX:g})", _ACTIVATION_COLUMNS,
                  _ACTIVATION_NUMERIC, rows, [site["overflows"] for site in sites], _activation_footer(result),
                  use_rich)


def write_diagnosis(result: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``diagnosis.json`` (strict JSON: NaN as null, +-inf as "inf"/"-inf", see ``files.py``),
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
