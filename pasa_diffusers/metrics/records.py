"""Records shared by every report the project writes: JSON encoding, markdown tables, versions, atomic files.

Only the standard library and numpy are imported here (torch and diffusers only inside ``versions``),
so any writer can use it.

The JSON convention and the atomic writes are the library's (``pasa_diffusers.files``, which the
diagnosis writes through too); they are named here as well, for the reports.
"""
from __future__ import annotations

import platform
from collections.abc import Sequence
from typing import Any

import numpy as np

from pasa_diffusers.files import (atomic_path, dumps, from_json_float, json_float, json_safe, write_atomic, write_json,
                                  write_synced)

__all__ = ["json_float", "from_json_float", "json_safe", "dumps", "markdown_table", "versions", "write_synced",
           "write_atomic", "atomic_path", "write_json", "count"]


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], *, align: str | None = None) -> str:
    """A GitHub markdown table; ``|`` inside cells is escaped.

    Args:
        columns: the header cells.
        rows: one sequence of cells per row (converted with ``str``), each as long as ``columns``.
        align: one letter per column, ``l`` (left) or ``r`` (right); default: the first column left,
            the others right (labels, then numbers).
    """
    align = align or "l" + "r" * (len(columns) - 1)
    if len(align) != len(columns) or set(align) - {"l", "r"}:
        raise ValueError(f"markdown_table: align={align!r} must be one 'l' or 'r' per column ({len(columns)})")
    for i, row in enumerate(rows):
        if len(row) != len(columns):
            raise ValueError(f"markdown_table: row {i} has {len(row)} cells, expected {len(columns)}")

    def line(cells: Sequence[Any]) -> str:
        return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"

    rule = "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"
    return "\n".join([line(columns), rule, *(line(row) for row in rows)])


def versions() -> dict[str, str]:
    """Versions of the software a result depends on (python, torch, diffusers, numpy, triton) and the GPU."""
    import diffusers
    import torch

    found = {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
             "numpy": np.__version__}
    try:
        import triton

        found["triton"] = triton.__version__
    except ImportError:
        found["triton"] = "not installed"
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name()
    return found


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, in the plural unless ``n`` is 1: ``count(1, "sample")`` is ``"1 sample"``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
