"""``pasa save-model``: write a pipeline to a folder (safetensors) that ``--model DIR`` then loads.

Its use is ``svd-xt-random``: SVD-XT's full-size pipeline with random weights, built on the device in
the dtype given, is saved once and then loaded by every command with the same weights
(``pasa save-model --model svd-xt-random --device cuda --dtype fp16 DIR``).  Any ``--model`` saves (a
hub id, another folder, ``tiny``, ``tiny-resonant``: its planted projection biases are parameters its
UNet's config lists, ``pipelines/resonant.py``, so ``--model DIR`` loads the same model).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from .common import UsageError, add_model_args, check_device, check_model, check_out_dir, load_model

__all__ = ["add_parser", "validate", "run"]


def validate(args: argparse.Namespace) -> None:
    """Check the model, the device and, last, the folder: new or empty, and writable (created here)."""
    check_model(args.model)
    check_device(args.device)
    folder = Path(args.folder).expanduser()
    if folder.is_dir() and any(folder.iterdir()):
        raise UsageError(f"DIR {os.fspath(args.folder)}: the folder is not empty; pass a new or empty folder")
    check_out_dir(args.folder, "DIR")


def run(args: argparse.Namespace) -> int:
    pipe = load_model(args)
    pipe.save_pretrained(args.folder, safe_serialization=True)
    parameters = sum(p.numel() for model in (pipe.unet, pipe.vae, pipe.image_encoder) for p in model.parameters())
    print(f"saved {args.model} ({parameters / 1e9:.3g} B parameters, {str(pipe.unet.dtype).removeprefix('torch.')}) "
          f"to {args.folder}; load it with --model {args.folder}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("save-model", help="save a pipeline (e.g. svd-xt-random) to a folder that --model DIR loads",
                       description="Build or load --model on --device in --dtype and write it with save_pretrained "
                                   "(safetensors) into DIR, a new or empty folder; every command then loads it "
                                   "with --model DIR.")
    add_model_args(p, default=None)
    p.add_argument("folder", metavar="DIR", help="the folder to write (created; must be new or empty)")
    p.set_defaults(func=run)
