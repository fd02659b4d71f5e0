"""``pasa save-model``: write a pipeline to a folder (safetensors) that ``--model DIR`` then loads.

Its use is ``svd-xt-random``: SVD-XT's full-size pipeline with random weights, built on the device in
the dtype given, is saved once and then loaded by every command with the same weights
(``pasa save-model --model svd-xt-random --device cuda --dtype fp16 DIR``).  Any ``--model`` saves (a
hub id, another folder, ``tiny``, ``tiny-resonant``: its planted projection biases are parameters its
UNet's config lists, ``pasa_diffusers/pipelines/resonant.py``, so ``--model DIR`` loads the same model), a video
transformer's pipeline too (``tiny-wan``, ``tiny-ltx-video``, ``tiny-cogvideox``, ``tiny-hunyuan-video``,
``tiny-mochi``, a Wan, LTX-Video, CogVideoX, HunyuanVideo or Mochi hub id or folder): without tokenizers and text
encoders, as ``pipelines.video.load_video`` loads it, and a built-in model with its small default frames and size
(``video.SETTINGS_KEY`` in ``model_index.json``).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from .common import FOLDER, UsageError, add_model_args, check_device, check_model, check_out_dir, load_model

__all__ = ["add_parser", "validate", "run"]


def validate(args: argparse.Namespace) -> None:
    """Check the model, the device and, last, the folder: new or empty, and writable (created here)."""
    check_model(args.model)
    check_device(args.device)
    folder = Path(args.folder).expanduser()
    if folder.is_dir() and any(folder.iterdir()):
        raise UsageError(f"DIR {os.fspath(args.folder)}: the folder is not empty; pass a new or empty folder")
    check_out_dir(args.folder, "DIR")


def _count(parameters: int) -> str:
    """``2.25 B``, ``1.3 M``, ``81.2 k``: three significant digits."""
    value, unit = next(((parameters / scale, unit) for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k"))
                        if parameters >= scale), (parameters, ""))
    return f"{value:.3g} {unit}".rstrip()


def run(args: argparse.Namespace) -> int:
    import torch

    from pasa_diffusers.pipelines.video import NOTICE, denoiser, is_video_pipeline

    pipe = load_model(args, video=True)
    pipe.save_pretrained(args.folder, safe_serialization=True)
    modules = [module for module in pipe.components.values() if isinstance(module, torch.nn.Module)]
    parameters = sum(p.numel() for module in modules for p in module.parameters())
    print(f"saved {args.model} ({_count(parameters)} parameters, {str(denoiser(pipe).dtype).removeprefix('torch.')}) "
          f"to {args.folder}; load it with --model {args.folder}"
          + (f" (no tokenizer or text encoder: {NOTICE})" if is_video_pipeline(pipe) else ""))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("save-model", help="save a pipeline (e.g. svd-xt-random) to a folder that --model DIR loads",
                       description="Build or load --model (an SVD or a video transformer's pipeline) on --device in "
                                   "--dtype and write it with save_pretrained (safetensors) into DIR, a new or empty "
                                   "folder; every command then loads it with --model DIR (a video transformer's "
                                   "pipeline without tokenizer and text encoder).")
    add_model_args(p, default=None)
    p.add_argument("folder", type=FOLDER, metavar="DIR", help="the folder to write (created; must be new or empty)")
    p.set_defaults(func=run)
