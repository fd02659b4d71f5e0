"""`pasa compare` on the tiny SVD on CUDA through the real Triton kernel (no mp4: writes the report only).

    python bench/gpu_compare_tiny.py --out $OUT/compare_cuda
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pasa_diffusers import metrics  # noqa: E402
from pasa_diffusers.pipelines.compare import run_comparison  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--backends", default="pasa,pasa-hybrid,naive-half,sdpa,bf16")
    parser.add_argument("--out", default="out/compare_cuda")
    args = parser.parse_args()
    report, _ = run_comparison(model=args.model, backends=args.backends.split(","), device="cuda", progress=False,
                               command="python bench/gpu_compare_tiny.py " + " ".join(sys.argv[1:]))
    metrics.write_report(report, args.out)
    print(metrics.format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
