"""Cold start of the attention op: the first calls at SVD's shapes in a fresh process.

    python bench/cold_start.py --out bench_out

Runs the SVD-XT shape set (576x1024 latents, F = 14 and 25, CFG batch 2: spatial 9216, 2304, 576 and
144 tokens, temporal 14 and 25 frames) through ``pasa_attention`` with its defaults, one call per
shape, in three fresh processes sharing one Triton cache directory: (1) with the directory empty
(compile + autotune), (2) and (3) with what the first left there (what every later process on this
machine pays: the compiled kernels and the autotuner's winners are read from disk).  Reported per
process: the import of the op, the import of triton and the kernels (which the first call would
otherwise pay), the wall time of the first call at each shape (synchronized), their total, and how
many times the autotuner benchmarked configs (``TRITON_PRINT_AUTOTUNING``; 0 when its disk cache hit).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SHAPES = [  # (B, H, N, D), fp16, (B, N, H, D) memory as diffusers holds it
    (28, 5, 9216, 64), (28, 10, 2304, 64), (28, 20, 576, 64), (28, 20, 144, 64),
    (18432, 5, 14, 64), (4608, 10, 14, 64), (18432, 5, 25, 64), (4608, 10, 25, 64),
]


def child() -> None:
    """Time the first call at each shape; print one JSON line."""
    start = time.perf_counter()
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pasa_diffusers import pasa_attention

    imported = time.perf_counter() - start
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    import pasa_diffusers.kernels.pasa_fwd  # noqa: F401  (triton and the kernels: paid by the first call)

    kernels_imported = time.perf_counter() - start
    times = {}
    for b, h, n, d in SHAPES:
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.float16) for _ in range(3))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pasa_attention(q, k, v, layout="bnhd")
        torch.cuda.synchronize()
        times[f"({b}, {h}, {n}, {d})"] = time.perf_counter() - t0
    print(json.dumps({"import_s": imported, "kernel_import_s": kernels_imported, "first_call_s": times,
                      "total_s": sum(times.values())}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child()
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "TRITON_PRINT_AUTOTUNING": "1"}
        for label in ("empty cache", "warm cache", "warm cache, again"):
            run = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                                 check=True)
            results[label] = json.loads(run.stdout.strip().splitlines()[-1])
            results[label]["autotuning_runs"] = run.stdout.count("Triton autotuning for function")
    lines = ["| process | import torch + op s | import kernels s | first calls, total s | slowest first call | "
             "autotuning runs |", "| --- | --- | --- | --- | --- | --- |"]
    for label, r in results.items():
        shape, worst = max(r["first_call_s"].items(), key=lambda kv: kv[1])
        lines.append(f"| {label} | {r['import_s']:.2f} | {r['kernel_import_s']:.2f} | {r['total_s']:.3f} | "
                     f"{worst:.3f} s at {shape} | {r['autotuning_runs']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cold_start.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(args.out, "cold_start.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
