"""Helpers the GPU benchmarks of the Hopper kernels share: timing, TFLOP/s and a log that survives a kill."""
from __future__ import annotations

import os

import torch
from triton.testing import do_bench


def tflops(shape, ms: float) -> float:
    """Non-causal attention's 4 B H N^2 D floating-point operations over ``ms`` milliseconds, in TFLOP/s."""
    b, h, n, d = shape
    return 4.0 * b * h * n * n * d / (ms * 1e-3) / 1e12


def median_ms(fn, warmup: int, rep: int) -> float:
    """``do_bench`` median of ``fn`` (L2 cleared before every call) after one untimed call (compile, tune)."""
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


class Log:
    """print, flushed, and appended to ``<out_dir>/<name>`` as it goes (survives a timeout or a hang)."""

    def __init__(self, out_dir: str | None, name: str):
        self.path = None
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            self.path = os.path.join(out_dir, name)
            open(self.path, "w").close()

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(text + "\n")
