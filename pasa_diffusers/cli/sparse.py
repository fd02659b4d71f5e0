"""The sparse backends' flags (``pasa generate``): the mask, its parameters, the schedule and the token order.

Torch-free: the flags are checked with the other arguments, before torch is imported.  A flag is refused when no
sparse backend runs (it would change nothing), and a mask parameter when it sets another mask than ``--mask``.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from pasa_diffusers.backends import SPARSE
from pasa_diffusers.pipelines.names import COVERAGE_MASKS

from .common import UsageError, int_range
from .mask_flags import add_mask_parameters, flag_of_another_mask

__all__ = ["DEFAULT_MASK", "add_sparse_args", "sparse_options"]

DEFAULT_MASK = "radial"

_OPTIONS = {"--mask": "mask", "--window": "window", "--spatial-window": "spatial_window",
            "--sink-frames": "sink_frames", "--keep": "keep", "--dense-steps": "dense_steps",
            "--dense-layers": "dense_layers", "--mask-order": "order"}
"""Flag -> the ``SparsePASAAttnProcessor`` argument it sets."""


def add_sparse_args(p: argparse.ArgumentParser) -> None:
    """The sparse backends' flags, in their own group (each defaults to ``None``: the processor's default)."""
    group = p.add_argument_group(f"sparse backends ({', '.join(SPARSE)})")
    group.add_argument("--mask", choices=tuple(COVERAGE_MASKS), default=None,
                       help=f"the block-sparse mask of the self-attention (default {DEFAULT_MASK}): "
                            + "; ".join(f"{name}: {what}" for name, what in COVERAGE_MASKS.items()))
    add_mask_parameters(group)
    group.add_argument("--dense-steps", type=int_range(0), default=None,
                       help="the first denoising steps that run dense (default 12)")
    group.add_argument("--dense-layers", type=int_range(0), default=None,
                       help="the first self-attention layers that run dense at every step (default 1)")
    group.add_argument("--mask-order", choices=("tile", "model"), default=None,
                       help="the token order the mask's 128-token blocks are cut from: tile (compact 3D tiles; "
                            "default) or model (frame, row, column)")


def sparse_options(args: argparse.Namespace, backends: Sequence[str], flag: str) -> dict[str, Any]:
    """The sparse processor's arguments the flags set (``install.apply`` options); ``UsageError`` for a flag given
    while none of ``backends`` (named by ``flag``) is sparse, or a mask parameter of another mask than ``--mask``."""
    given = {option: getattr(args, option.removeprefix("--").replace("-", "_")) for option in _OPTIONS}
    given = {option: value for option, value in given.items() if value is not None}
    if given and not set(backends) & set(SPARSE):
        raise UsageError(f"{', '.join(given)}: set(s) the mask of a sparse backend ({', '.join(SPARSE)}), "
                         f"and {flag} {','.join(backends)} runs none; leave it out or choose a sparse backend")
    mask = given.get("--mask", DEFAULT_MASK)
    other = flag_of_another_mask(args, [mask])
    if other is not None:
        flag, kind = other
        raise UsageError(f"{flag}: sets the {kind} mask, and the mask is {mask}; pass --mask {kind} or leave {flag} "
                         "out")
    return {_OPTIONS[option]: value for option, value in given.items()}
