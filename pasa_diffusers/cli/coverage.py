"""``pasa coverage``: how much of the dense attention mass each block-sparse mask keeps, per self-attention layer
and head of a video transformer, measured during one short generation.

Its own command rather than a ``pasa diagnose --mask`` mode: ``diagnose`` answers FP16 overflow for SVD and the
video transformers alike (its flags, its risk tables, its timed second generation), while the coverage report
takes only a video transformer, has a dozen flags of its own (the masks and their parameters, the block, the
sampled rows, the token order) and writes other files; it shares the recording (``pipelines.coverage`` records
through ``diagnose.recording``) and the generation flags.
"""
from __future__ import annotations

import argparse

from pasa_diffusers.pipelines.names import BUILTIN_MODELS, BUILTIN_VIDEO_MODELS, COVERAGE_MASKS, TINY_VIDEO_SETTINGS

from .common import (FOLDER, MIN_FRAMES, MIN_SIZE, SIZE_MULTIPLE, UsageError, add_model_args, check_device,
                     check_memory, check_model, check_out_dir, generation_settings, int_range, load_model,
                     requested_sizes, seed)
from .mask_flags import add_mask_parameters, flag_of_another_mask

__all__ = ["DEFAULT_MODEL", "DEFAULT_STEPS", "mask_names", "add_parser", "validate", "run"]

DEFAULT_MODEL = "tiny-wan"
DEFAULT_STEPS = 2
def mask_names(text: str) -> list[str]:
    """An argparse ``type=``: a comma-separated list of distinct ``COVERAGE_MASKS``."""
    names = [name.strip() for name in text.split(",")]
    for name in names:
        if name not in COVERAGE_MASKS:
            raise argparse.ArgumentTypeError(f"unknown mask {name!r}; expected a comma-separated list of "
                                             f"{', '.join(COVERAGE_MASKS)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a mask named twice in {text!r}")
    return names


def validate(args: argparse.Namespace) -> None:
    """Check before anything is loaded: the mask flags against ``--mask``, the model (an SVD built-in is no video
    transformer), the device, the memory the run needs and, last, the output folder."""
    other = flag_of_another_mask(args, args.mask)
    if other is not None:
        flag, mask = other
        raise UsageError(f"{flag}: sets the {mask} mask, which --mask {','.join(args.mask)} does not measure; add "
                         f"{mask} to --mask or leave {flag} out")
    if args.model in BUILTIN_MODELS:
        raise UsageError(f"--model {args.model}: an SVD pipeline (a UNet), not a video transformer; pasa coverage "
                         f"measures a video transformer's self-attention: {', '.join(BUILTIN_VIDEO_MODELS)}, or a "
                         "Wan, LTX-Video, CogVideoX, HunyuanVideo or Mochi hub id or folder")
    check_model(args.model)
    check_device(args.device)
    check_memory(args, requested_sizes(args))
    check_out_dir(args.out)


def _choices(args: argparse.Namespace) -> list:
    from pasa_diffusers.video_masks import MaskChoice

    given = {"window": args.window, "spatial_window": args.spatial_window, "sink_frames": args.sink_frames,
             "keep": args.keep}
    return [MaskChoice(kind, **{name: value for name, value in given.items() if value is not None})
            for kind in args.mask]


def run(args: argparse.Namespace) -> int:
    from pasa_diffusers.pipelines.coverage import CoverageLayoutError, coverage_run, summary_lines, write_coverage
    from pasa_diffusers.pipelines.video import is_video_pipeline, self_attention_tokens

    pipe = load_model(args, video=True)
    if not is_video_pipeline(pipe):
        raise UsageError(f"--model {args.model}: a {type(pipe).__name__}, not a video transformer's pipeline; pasa "
                         "coverage measures Wan, LTX-Video, CogVideoX, HunyuanVideo and Mochi")
    settings = generation_settings(args, pipe)
    sizes = {name: settings[name] for name in ("num_frames", "height", "width")}
    tokens = self_attention_tokens(pipe, **sizes)
    text = f" + {tokens.text} text tokens" if tokens.text else ""
    sequence = f"{tokens.frames}x{tokens.height}x{tokens.width} video tokens{text}"
    if args.rows is not None and args.rows > tokens.n_tokens:
        raise UsageError(f"--rows {args.rows}: more than the {tokens.n_tokens} queries of a self-attention call of "
                         f"this video ({sequence}); at most {tokens.n_tokens}")
    if args.block is not None and args.block >= tokens.n_tokens:
        raise UsageError(f"--block {args.block}: the {tokens.n_tokens} tokens of a self-attention call of this video "
                         f"({sequence}) make one block, which every mask keeps; choose a --block below "
                         f"{tokens.n_tokens}")
    try:
        result = coverage_run(pipe, _choices(args), **settings, block=args.block, sample_rows=args.rows,
                              order=args.order, progress=True, model=args.model)
    except CoverageLayoutError as exc:
        raise UsageError(f"--model {args.model}: {exc}") from exc
    print("\n".join(summary_lines(result)))
    for kind, path in write_coverage(result, args.out).items():
        print(f"wrote {kind}: {path}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coverage", help="how much of the dense attention mass block-sparse masks keep, per layer and "
                                        "head of a video transformer",
                       description="Run one short generation of --model (a video transformer) and measure, in every "
                                   "self-attention call, the share of the dense attention mass (float64 softmax over "
                                   "every key, on --rows sampled query rows) that each --mask keeps; print each "
                                   "mask's density, mean coverage and worst layers and heads, and write "
                                   "coverage.json, coverage.md and coverage_<mask>.png (layers x heads) into --out.")
    add_model_args(p, DEFAULT_MODEL)
    own = ", ".join(f"{model} {s['num_frames']}" for model, s in TINY_VIDEO_SETTINGS.items())
    p.add_argument("--frames", type=int_range(MIN_FRAMES), default=None,
                   help=f"frames of the video (default: the model's own, {own}; a loaded one its pipeline's)")
    p.add_argument("--steps", type=int_range(1), default=DEFAULT_STEPS,
                   help=f"denoising steps, >= 1 (default {DEFAULT_STEPS}; LTX-Video and Mochi: >= 2)")
    size = int_range(MIN_SIZE, multiple_of=SIZE_MULTIPLE)
    p.add_argument("--height", type=size, default=None,
                   help="frame height in pixels (default: the model's own; the tiny models 64, tiny-ltx-video 128)")
    p.add_argument("--width", type=size, default=None,
                   help="frame width in pixels (default: the model's own; the tiny models 64, tiny-ltx-video 128)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the initial noise and the sampled rows (default 0)")
    every = ",".join(COVERAGE_MASKS)
    p.add_argument("--mask", type=mask_names, default=every,
                   help=f"the masks measured, comma-separated (default {every}): "
                        + "; ".join(f"{name}: {what}" for name, what in COVERAGE_MASKS.items()))
    add_mask_parameters(p)
    p.add_argument("--block", type=int_range(1), default=None,
                   help="query and key block of the masks, in tokens, fewer than a call's (default 128, the kernels' "
                        "key block, where a call has 8 blocks of it; a shorter sequence, such as a tiny model's, the "
                        "largest power of two that makes 8 blocks)")
    p.add_argument("--rows", type=int_range(1), default=None,
                   help="query rows sampled per call, at most the call's queries (default 256, or every row of a "
                        "shorter sequence)")
    p.add_argument("--order", choices=["tile", "model"], default="tile",
                   help="the token order the masks' blocks are cut from: tile (compact 3D tiles, the order a sparse "
                        "run attends in; default) or model (frame, row, column)")
    p.add_argument("--out", type=FOLDER, default="out/coverage", help="output folder (created; default out/coverage)")
    p.set_defaults(func=run)
