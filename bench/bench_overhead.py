"""Host overhead of the public op: ``pasa_attention`` against the kernel wrapper and a CUDA-graph replay.

Small attention problems (SVD's 144-token spatial and 14/25-frame temporal attention) finish on the
GPU in tens of microseconds, so Python work per call can dominate.  For each shape this times, with
CUDA events around 200 back-to-back calls (median of 5 repeats, after warm-up): the public op, the
kernel wrapper ``pasa_forward`` called directly, and one CUDA-graph replay of the op (no host work).

    python bench/bench_overhead.py
"""
from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pasa_diffusers.kernels.pasa_fwd import pasa_forward  # noqa: E402
from pasa_diffusers.ops import pasa_attention  # noqa: E402
from pasa_diffusers.reference import DEFAULT_BETA  # noqa: E402

SHAPES = [(50, 20, 144, 64), (18432, 5, 25, 64), (4608, 10, 14, 64), (50, 10, 2304, 64)]
CALLS = 200


def per_call_us(fn) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS):
            fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1000.0 / CALLS)
    return statistics.median(times)


def main() -> int:
    print("| (B, H, N, D) | pasa_attention us | pasa_forward us | graph replay us | op - graph us |")
    print("| --- | --- | --- | --- | --- |")
    for b, h, n, d in SHAPES:
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.float16) for _ in range(3))
        out = torch.empty_like(q)
        op = lambda: pasa_attention(q, k, v, layout="bnhd")  # noqa: E731
        direct = lambda: pasa_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # noqa: E731
                                      out.transpose(1, 2), scale=1 / math.sqrt(d), precision="half",
                                      shift=True, beta=DEFAULT_BETA)
        op()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            op()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            op()
        t_op, t_direct, t_graph = per_call_us(op), per_call_us(direct), per_call_us(graph.replay)
        print(f"| {(b, h, n, d)} | {t_op:.1f} | {t_direct:.1f} | {t_graph:.1f} | {t_op - t_graph:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
