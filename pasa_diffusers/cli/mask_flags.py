"""The block-sparse masks' parameter flags, shared by ``pasa coverage`` and the sparse backends' flags
(``cli/sparse.py``): their argparse types, their definitions, and which mask each sets.  Torch-free."""
from __future__ import annotations

import argparse
import math
from collections.abc import Iterable

from .common import int_range

__all__ = ["MASK_FLAGS", "window", "share", "add_mask_parameters", "flag_of_another_mask"]

MASK_FLAGS: dict[str, tuple[str, ...]] = {"tile-window": ("--window",), "radial": ("--spatial-window", "--sink-frames"),
                                          "pooled": ("--keep",)}
"""Mask -> the flags that set its parameters (refused when that mask is not run)."""


def window(text: str) -> tuple[int, int, int]:
    """An argparse ``type=``: ``F,H,W``, three integers >= 0 (frames, rows, columns of video tokens)."""
    parts = text.split(",")
    try:
        values = tuple(int(part) for part in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected F,H,W: three integers >= 0 (frames, rows, columns of video "
                                         f"tokens), got {text!r}")
    return values


def share(text: str) -> float:
    """An argparse ``type=``: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text}")
    return value


def add_mask_parameters(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--window``, ``--spatial-window``, ``--sink-frames`` and ``--keep``, each ``None`` unless given (the mask's
    own default)."""
    p.add_argument("--window", type=window, default=None,
                   help="tile-window: F,H,W, the frames, rows and columns of video tokens a query block reaches "
                        "(default 1,3,3)")
    p.add_argument("--spatial-window", type=int_range(1), default=None,
                   help="radial: the spatial window in the same frame, halved each time the temporal distance doubles "
                        "(default: the larger side of the token grid)")
    p.add_argument("--sink-frames", type=int_range(0), default=None,
                   help="radial: the first frames every query keeps (the attention sink; default 1)")
    p.add_argument("--keep", type=share, default=None,
                   help="pooled: the share of the estimated attention mass the kept key blocks reach, in (0, 1] "
                        "(default 0.9)")


def flag_of_another_mask(args: argparse.Namespace, masks: Iterable[str]) -> tuple[str, str] | None:
    """``(flag, its mask)`` of the first mask parameter given for a mask not among ``masks``, or ``None``."""
    masks = set(masks)
    for mask, flags in MASK_FLAGS.items():
        for flag in flags:
            if getattr(args, flag.removeprefix("--").replace("-", "_")) is not None and mask not in masks:
                return flag, mask
    return None
