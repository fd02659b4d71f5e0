"""CPU math that gives the same bits on every x86-64 machine with AVX2, Intel's and AMD's: ``pin()``.

On the CPU, torch's results depend on the machine as well as on the thread count. MKL picks its GEMM code
path by instruction set and vendor, ATen vectorises its reductions 8 or 16 floats wide (AVX2 or AVX-512), and
oneDNN picks its convolution kernels and their blocking by instruction set and cache size. Each choice changes
the summation order, so the last bits move, and a few denoising steps amplify them: on an AVX-512 machine with
AMX, the exact-hybrid uniform(30,0.5) cell of docs/NUMERICS.md's LSE table read 4.99e-4 where the machine
that wrote the table printed 2.4e-4, and the records of samples/compare moved (between that machine and the
pinned math, by up to 1.06 dB of a sample's PSNR).

``pin()`` asks MKL for its ``COMPATIBLE`` branch (conditional numerical reproducibility, ``MKL_CBWR``: SSE2
without the approximate reciprocals, the one branch MKL runs alike on Intel and other vendors' processors),
ATen for its AVX2 kernels (``ATEN_CPU_CAPABILITY``: plain code, the same on any AVX2 machine), and turns
oneDNN off, so convolutions run as im2col and an MKL GEMM. It must run before torch's first CPU op: each
library reads its setting once. ``pasa compare`` pins on the CPU and the test suite pins for its whole session,
so a committed number is what any such machine computes. MKL's ``AVX2`` branch would hold its bits on Intel
processors only (on others MKL runs its automatic branch: docs/NUMERICS.md's LSE section has the cell that
moved); ``COMPATIBLE`` costs a one-sample ``pasa compare`` about 1.3x its time (50.9 s against 37.9 s).
"""
from __future__ import annotations

import os
import platform

__all__ = ["PORTABLE_ENV", "PORTABLE_CAPABILITY", "NotPinnedError", "portable_host", "pin"]

PORTABLE_ENV = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2"}
"""The environment that selects MKL's vendor-independent branch and ATen's AVX2 kernels."""
PORTABLE_CAPABILITY = "AVX2"
"""What ``torch.backends.cpu.get_cpu_capability()`` says once ATen runs its AVX2 kernels."""


def portable_host() -> bool:
    """Whether this machine is x86-64, where these code paths exist (``platform.machine()``)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class NotPinnedError(RuntimeError):
    """The CPU math could not be pinned: the machine lacks AVX2, or torch ran a CPU op before ``pin()``."""


def pin() -> bool:
    """Select MKL's ``COMPATIBLE`` branch and ATen's AVX2 kernels and turn oneDNN off, for this process; whether it
    did.

    On a machine that is not x86-64 nothing changes and the answer is False: these paths do not exist there.
    Raises ``NotPinnedError`` when ATen already runs another path (torch ran a CPU op first, or the machine has
    no AVX2). A value the caller set in the environment for these variables is replaced."""
    if not portable_host():
        return False
    os.environ.update(PORTABLE_ENV)
    import torch

    torch.backends.mkldnn.enabled = False
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != PORTABLE_CAPABILITY:
        raise NotPinnedError(f"torch runs its {capability} CPU kernels, not {PORTABLE_CAPABILITY}: pin the CPU math "
                             "before torch's first CPU op, on a machine with AVX2")
    return True
