"""``pasa generate``: one video with one attention backend."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import add_generation_args, model_dtype

__all__ = ["add_parser", "run"]


def _finite_note(frames) -> str:
    import numpy as np

    bad = np.flatnonzero(~np.isfinite(frames).all(axis=(1, 2, 3)))
    return "all frames finite" if bad.size == 0 else f"NON-FINITE frames: {bad.size} (first index {bad[0]})"


def run(args: argparse.Namespace) -> int:
    from pasa_diffusers import metrics
    from pasa_diffusers.pipelines.compare import backend_options
    from pasa_diffusers.pipelines.svd import generate, load_image, load_svd

    from .. import install

    dtype = model_dtype(args.device, args.dtype)
    pipe = load_svd(args.model, device=args.device, dtype=dtype, local_files_only=args.local_files_only)
    summary = install.apply(pipe, args.attention, **backend_options(args.attention, dtype))
    image = load_image(args.image, (args.width, args.height))
    frames = generate(pipe, image, num_frames=args.frames, num_inference_steps=args.steps, seed=args.seed,
                      height=args.height, width=args.width)
    out = Path(args.out)
    written = metrics.write_video(frames, out, args.attention, fps=args.fps)
    print(json.dumps({"installed": summary["counts"], "processors": summary["processors"],
                      "fallbacks": install.fallback_summary(pipe)["fallbacks"]}, indent=2))
    print(_finite_note(frames))
    for kind, path in written.items():
        print(f"wrote {kind}: {path}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="animate an image with SVD using one attention backend")
    add_generation_args(p, "out/generate")
    p.add_argument("--attention", default="pasa", help="an attention backend: pasa (default), pasa-half, pasa-paper, pasa-paper-hybrid, naive-half, sdpa, bf16, fp32")
    p.add_argument("--fps", type=int, default=7)
    p.set_defaults(func=run)
