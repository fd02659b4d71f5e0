"""``pasa diagnose``: which attention layers of a checkpoint overflow in FP16, and why."""
from __future__ import annotations

import argparse

from .common import add_generation_args, load_condition_image, load_model, validate_generation_args

__all__ = ["add_parser", "validate", "run"]


def validate(args: argparse.Namespace) -> None:
    """Check the model, image, output folder and device before anything is loaded."""
    validate_generation_args(args)


def run(args: argparse.Namespace) -> int:
    from pasa_diffusers.diagnose import risk_table, write_diagnosis
    from pasa_diffusers.pipelines.diagnose import diagnose

    pipe = load_model(args)
    image = load_condition_image(args)
    result = diagnose(pipe, image, num_frames=args.frames, num_inference_steps=args.steps, seed=args.seed,
                      height=args.height, width=args.width, progress=True, model=args.model)
    print(risk_table(result))
    for kind, path in write_diagnosis(result, args.out).items():
        print(f"wrote {kind}: {path}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diagnose", help="which attention layers overflow in FP16, and why",
                       description="Run one generation of --model with every attention layer of the UNet recorded "
                                   "and print the layers ranked by FP16 overflow risk (largest raw q.k, how many "
                                   "scores exceed 65504, PASA's shifted scores, the cause: bias, resonance or "
                                   "amplitude); write diagnosis.json, heatmap.png and bias_resonance.png into --out.")
    add_generation_args(p, "out/diagnose", frames=2, steps=2)
    p.set_defaults(func=run)
