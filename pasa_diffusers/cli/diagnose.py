"""``pasa diagnose``: which attention layers of a checkpoint overflow in FP16, and why."""
from __future__ import annotations

import argparse

from .common import add_generation_args, model_dtype

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    from pasa_diffusers.pipelines.svd import load_image, load_svd

    from ..diagnose import diagnose, risk_table, write_diagnosis

    pipe = load_svd(args.model, device=args.device, dtype=model_dtype(args.device, args.dtype),
                    local_files_only=args.local_files_only)
    image = load_image(args.image, (args.width, args.height))
    result = diagnose(pipe, image, num_frames=args.frames, num_inference_steps=args.steps, seed=args.seed,
                      height=args.height, width=args.width, progress=True, model=args.model)
    print(risk_table(result))
    for kind, path in write_diagnosis(result, args.out).items():
        print(f"wrote {kind}: {path}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diagnose", help="which attention layers overflow in FP16, and why")
    add_generation_args(p, "out/diagnose", frames=2, steps=2)
    p.set_defaults(func=run)
