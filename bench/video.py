"""What does one generated video cost per attention backend, first calls included?

    python -m bench.video --out DIR                                   # svd-xt-random, 576x1024
    python -m bench.video --model FOLDER --backends sdpa pasa --label second --out DIR

Loads the pipeline (--model: "svd-xt-random", SVD-XT's full-size pipeline with random weights built
on the GPU, or a hub id or save_pretrained folder; fp16, CUDA), then per backend (names of
pasa_diffusers.backends.BACKENDS): installs its processors, generates one video (576x1024, 14 frames,
4 steps by default) from the same image and seed, synchronizes, and times the whole call: what
`pasa compare` pays for that backend's video, the kernels' first calls (compilation or loading from
Triton's cache, autotuning) included.  Run it twice on a machine (--label first, then --label
second): the second process shows what every later run pays.  Columns: seconds per video and the
first backend's time over it (> 1: faster).
"""
from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import torch

from pasa_diffusers import install
from pasa_diffusers.backends import BACKENDS
from pasa_diffusers.metrics import records

from . import harness

NAME = "video"


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(NAME, __doc__)
    p.add_argument("--model", default="svd-xt-random", help="svd-xt-random, a hub id or a save_pretrained folder")
    p.add_argument("--backends", nargs="+", default=["sdpa", "pasa"], choices=list(BACKENDS), metavar="BACKEND",
                   help=f"of {', '.join(BACKENDS)}; the first is the baseline (default: sdpa pasa)")
    p.add_argument("--frames", type=int, default=14, help="frames per video (default: 14)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps (default: 4)")
    p.add_argument("--height", type=int, default=576, help="video height (default: 576)")
    p.add_argument("--width", type=int, default=1024, help="video width (default: 1024)")
    p.add_argument("--label", default=None,
                   help="names the run (first, second, ...): the files are video-<label>.md/.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"bench.{NAME}: needs a CUDA GPU (the full-size pipeline)", file=sys.stderr)
        return 2

    from pasa_diffusers.pipelines.svd import generate, load_image, load_svd

    cmd, env = harness.command(NAME, argv), harness.environment()
    pipe = load_svd(args.model, device="cuda", dtype=torch.float16)
    image = load_image("builtin:rocket", (args.width, args.height))
    seconds = {}
    for backend in harness.progress(args.backends, NAME):
        install.apply(pipe, backend)
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate(pipe, image, num_frames=args.frames, num_inference_steps=args.steps, seed=0, height=args.height,
                 width=args.width, progress=False)
        torch.cuda.synchronize()
        seconds[backend] = time.perf_counter() - start
        install.restore(pipe)
    first = seconds[args.backends[0]]
    name = NAME if args.label is None else f"{NAME}-{args.label}"
    text = harness.header(f"bench.video: one {args.frames}-frame {args.height}x{args.width} video, "
                          f"{args.steps} steps, per backend ({args.label or 'one run'})", env, cmd) + "\n" + \
        records.markdown_table(["backend", "s per video", f"vs {args.backends[0]}"],
                               [[b, f"{s:.2f}", f"{first / s:.2f}"] for b, s in seconds.items()]) + "\n"
    harness.write_report(args.out, name, text, {"bench": NAME, "command": cmd, "environment": env,
                                                "settings": vars(args), "seconds": seconds})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
