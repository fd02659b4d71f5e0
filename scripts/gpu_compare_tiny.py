"""`pasa compare` on a tiny SVD on CUDA, through the real Triton kernels: every backend, a few samples.

    PYTHONPATH=$PWD python scripts/gpu_compare_tiny.py --out $OUT/compare_cuda            # tiny-resonant, seeds 0-1
    PYTHONPATH=$PWD python scripts/gpu_compare_tiny.py --model tiny --seeds 0-3 --out $OUT/compare_cuda_tiny

The comparison's code path on a GPU without a full-size model: the output folder is a `pasa compare`
run folder (report.md, report.json, samples.jsonl, plots); an existing one with other settings is
refused, the same settings resume it.  It writes the report only (no mp4: a GPU machine may lack ffmpeg).
"""
from __future__ import annotations

import argparse
import sys

from pasa_diffusers import metrics
from pasa_diffusers.backends import COMPARED
from pasa_diffusers.cli.compare import image_list, seed_list
from pasa_diffusers.pipelines.compare import CompareConfig, evaluate
from pasa_diffusers.pipelines.distributed import Dist


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-resonant", choices=["tiny", "tiny-resonant"])
    parser.add_argument("--backends", default=",".join(COMPARED), help="comma-separated (default: all)")
    parser.add_argument("--images", type=image_list, default="builtin:all")
    parser.add_argument("--seeds", type=seed_list, default="0-1")
    parser.add_argument("--out", default="out/compare_cuda")
    args = parser.parse_args()
    config = CompareConfig(model=args.model, images=tuple(args.images), seeds=tuple(args.seeds),
                           backends=tuple(args.backends.split(",")), worst=1)
    report = evaluate(config, args.out, dist=Dist(device="cuda"), progress=False,
                      command="python scripts/gpu_compare_tiny.py " + " ".join(sys.argv[1:]))
    print(metrics.format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
