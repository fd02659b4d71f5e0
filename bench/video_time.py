"""Wall time of one generated video per attention backend, in a fresh process (first calls included).

    python bench/video_time.py --model /tmp/svd-random --backends sdpa,pasa --out bench_out

Loads the pipeline (fp16, CUDA), then per backend: installs its processors, generates one video
(576x1024, 14 frames, 4 steps by default) from the same image and seed, synchronizes, and times the
whole call — what ``pasa compare`` pays for that backend's video, the kernels' first calls
(compilation or loading from the Triton cache, autotuning or its cached winners) included.  Run it
twice on a machine: the second process shows what every later run pays.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="hub id or save_pretrained folder of an SVD pipeline")
    parser.add_argument("--backends", default="sdpa,pasa")
    parser.add_argument("--frames", type=int, default=14)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--height", type=int, default=576)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--label", default="run")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from pasa_diffusers import install
    from pasa_diffusers.pipelines.svd import generate, load_image, load_svd

    pipe = load_svd(args.model, device="cuda", dtype=torch.float16)
    image = load_image("builtin:rocket", (args.width, args.height))
    times = {}
    for backend in args.backends.split(","):
        install.apply(pipe, backend)
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate(pipe, image, num_frames=args.frames, num_inference_steps=args.steps, seed=0, height=args.height,
                 width=args.width, progress=False)
        torch.cuda.synchronize()
        times[backend] = time.perf_counter() - start
        install.restore(pipe)
    base = times.get("sdpa")
    for backend, seconds in times.items():
        ratio = f", {seconds / base:.2f}x sdpa" if base else ""
        print(f"{args.label}: {backend} video {seconds:.2f} s{ratio}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"video_time_{args.label}.json"), "w") as f:
            json.dump({"times_s": times, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
