"""Records shared by every report the project writes: JSON encoding, markdown tables, versions, atomic files.

Only the standard library and numpy are imported here (torch and diffusers only inside ``versions``),
so any writer can use it.

JSON convention (one for every file the project writes): a finite float is written as is, ``+inf`` as
the string ``"inf"``, ``-inf`` as ``"-inf"`` and NaN as ``null``; so ``"inf"`` means "infinite" (for
PSNR: identical to the reference) and ``null`` means "no value", and ``json.dumps(...,
allow_nan=False)`` always succeeds.  ``from_json_float`` reads such a value back.

Atomic writes: ``write_atomic`` and ``atomic_path`` write into a temporary file beside the target
(``.NAME.tmp-PID.SUFFIX``) and ``os.replace`` it onto the target, so a reader (or a killed run)
sees either the old complete file or the new complete file, never a partial one.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["json_float", "from_json_float", "json_safe", "dumps", "markdown_table", "versions", "write_synced",
           "write_atomic", "atomic_path", "write_json", "count"]


def json_float(value: float) -> float | str | None:
    """A float as a JSON-safe value: finite as is, ``inf`` as ``"inf"``, ``-inf`` as ``"-inf"``, NaN as None."""
    value = float(value)
    if math.isnan(value):
        return None
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def from_json_float(value: float | int | str | None) -> float:
    """The inverse of ``json_float``: ``"inf"`` -> inf, ``"-inf"`` -> -inf, ``None`` -> NaN, a number -> float."""
    if value is None:
        return math.nan
    if isinstance(value, str):
        if value not in ("inf", "-inf"):
            raise ValueError(f"from_json_float: expected a number, 'inf', '-inf' or null, got {value!r}")
        return math.inf if value == "inf" else -math.inf
    return float(value)


def json_safe(obj: Any) -> Any:
    """``obj`` with numpy values, paths, torch dtypes and non-finite floats turned into JSON-safe values.

    Dict keys become strings; tuples and arrays become lists; ``torch.float16`` becomes ``"float16"``.
    """
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
    if type(obj).__module__ == "torch" and type(obj).__name__ == "dtype":
        return str(obj).removeprefix("torch.")
    return obj


def dumps(obj: Any, *, indent: int | None = 2) -> str:
    """``json.dumps`` of ``json_safe(obj)`` with ``allow_nan=False`` (one line when ``indent`` is None)."""
    separators = (",", ":") if indent is None else None
    return json.dumps(json_safe(obj), allow_nan=False, indent=indent, separators=separators)


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


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (same suffix) to write to; on success it replaces ``path``.

    For writers that take a file name (matplotlib's ``savefig``, imageio): ``with atomic_path(p) as tmp:
    fig.savefig(tmp)``.  If the block raises, the temporary file is removed and ``path`` is untouched.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.stem}.tmp-{os.getpid()}{target.suffix}")
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def write_synced(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8, or bytes) to ``path``, flushed and fsynced (not atomic); return the path."""
    target = Path(path)
    with open(target, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    return target


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically, flushed and fsynced; return the path."""
    target = Path(path)
    with atomic_path(target) as tmp:
        write_synced(tmp, data)
    return target


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as indented JSON (the convention above) to ``path`` atomically; return the path."""
    return write_atomic(path, dumps(obj) + "\n")


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, in the plural unless ``n`` is 1: ``count(1, "sample")`` is ``"1 sample"``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
