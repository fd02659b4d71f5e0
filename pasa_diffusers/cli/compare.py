"""``pasa compare``: every backend's video scored against the FP32-attention one."""
from __future__ import annotations

import argparse
import sys

from .common import add_generation_args, model_dtype

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    from pasa_diffusers import metrics
    from pasa_diffusers.pipelines.compare import parse_backends, run_comparison, write_comparison

    backends = parse_backends(args.backends)
    report, videos = run_comparison(model=args.model, backends=backends, image=args.image, num_frames=args.frames,
                                    num_inference_steps=args.steps, seed=args.seed, height=args.height,
                                    width=args.width, device=args.device, dtype=model_dtype(args.device, args.dtype),
                                    lpips_weights=args.lpips_weights, local_files_only=args.local_files_only,
                                    command="pasa " + " ".join(sys.argv[1:]))
    written = write_comparison(report, videos, args.out, fps=args.fps)
    print(metrics.format_table(report))
    print(f"wrote {len(written)} outputs under {args.out} (report.md, report.json, plots, videos)")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="score each attention backend's video against the FP32-attention one")
    add_generation_args(p, "out/compare")
    p.add_argument("--backends", default="pasa,naive-half,sdpa,bf16", help="comma-separated backends")
    p.add_argument("--lpips-weights", default=None,
                   help="torchvision AlexNet ImageNet weights (alexnet-owt-7be5be79.pth); default: torch hub cache")
    p.add_argument("--fps", type=int, default=7)
    p.set_defaults(func=run)
