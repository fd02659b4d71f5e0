"""The project's result files: one JSON convention, and atomic writes.

JSON convention (one for every file the project writes): a finite float is written as is, ``+inf`` as
the string ``"inf"``, ``-inf`` as ``"-inf"`` and NaN as ``null``; so ``"inf"`` means "infinite" (for
PSNR: identical to the reference) and ``null`` means "no value", and ``json.dumps(...,
allow_nan=False)`` always succeeds.  ``from_json_float`` reads such a value back.

Atomic writes: ``write_atomic`` and ``atomic_path`` write into a temporary file beside the target
(``.NAME.tmp-PID.SUFFIX``) and ``os.replace`` it onto the target, so a reader (or a killed run)
sees either the old complete file or the new complete file, never a partial one.

Only the standard library and numpy are imported here, so the library (the diagnosis) and the
applications (``metrics.records``, the reports, ``bench/``) write through the same functions.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["json_float", "from_json_float", "json_safe", "dumps", "atomic_path", "write_synced", "write_atomic",
           "write_json"]


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
