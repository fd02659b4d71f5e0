"""``pasa diagnose``: which attention layers of a checkpoint overflow in FP16, and why."""
from __future__ import annotations

import argparse

from .common import (add_generation_args, conditioning_notice, generation_settings, load_condition_image, load_model,
                     validate_generation_args)

__all__ = ["add_parser", "validate", "run"]


def validate(args: argparse.Namespace) -> None:
    """Check the model, image, output folder and device before anything is loaded."""
    validate_generation_args(args)


def run(args: argparse.Namespace) -> int:
    from pasa_diffusers.diagnose import activation_table, risk_table, write_diagnosis
    from pasa_diffusers.pipelines.diagnose import diagnose
    from pasa_diffusers.pipelines.video import is_video_pipeline

    pipe = load_model(args, video=True)
    settings = generation_settings(args, pipe)
    image = None if is_video_pipeline(pipe) else load_condition_image(args, settings)
    notice = conditioning_notice(pipe)
    if notice:
        print(notice)
    result = diagnose(pipe, image, **settings, progress=True, model=args.model)
    print(risk_table(result))
    if "activations" in result:
        print(activation_table(result))
    for kind, path in write_diagnosis(result, args.out).items():
        print(f"wrote {kind}: {path}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diagnose", help="which attention layers overflow in FP16, and why",
                       description="Run one generation of --model with every attention layer of the UNet (or of "
                                   "a video pipeline's transformer) recorded and print the layers ranked by FP16 "
                                   "overflow risk (largest raw q.k, how many scores exceed 65504, PASA's shifted "
                                   "scores, the cause: bias, resonance or amplitude), and for a video transformer "
                                   "the largest value of every block's attention output, feed-forward, norms and "
                                   "residual stream against 65504; write diagnosis.json, heatmap.png and "
                                   "bias_resonance.png into --out.")
    add_generation_args(p, "out/diagnose", frames=2, steps=2, video=True)
    p.set_defaults(func=run)
