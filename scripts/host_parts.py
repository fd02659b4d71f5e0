"""Where the host's time goes in one call of the default, part by part, on a GPU.

    PYTHONPATH=$PWD python scripts/host_parts.py

Each part (the op through ``layout="bnhd"``, ``dispatch.forward``, the plan, the pre-pass, the Gluon kernel's
descriptors and launch, binding its arguments or through the kept compiled kernel, and torch's own small steps for
scale) is issued 200 times while the GPU sleeps (``torch.cuda._sleep``), so nothing waits on the GPU and the wall
time per call is the host's alone.  Two
shapes: SVD's 576-token spatial attention (fp16, head dim 64) and one sample of Mochi's joint attention
(bf16, head dim 128).  The host's time shows wherever the GPU waits for it: short calls, and every call
right after the model itself waits for the GPU.
"""
from __future__ import annotations

import math
import sys

import torch

from bench.overhead import host_us
from pasa_diffusers.shift_matrix import DEFAULT_BETA
from pasa_diffusers.kernels import dispatch, gluon_common, hopper
from pasa_diffusers.kernels.launch import kept_launch
from pasa_diffusers.kernels.prepass import centre_keys
from pasa_diffusers.ops import pasa_attention
from pasa_diffusers.variants import DEFAULT

SHAPES = (((50, 20, 576, 64), torch.float16), ((1, 24, 6616, 128), torch.bfloat16))


def main() -> int:
    if not torch.cuda.is_available():
        print(f"scripts/host_parts.py: needs a CUDA GPU (it times the host's parts of a call while the GPU sleeps); "
              f"none on this machine (torch {torch.__version__})", file=sys.stderr)
        return 2
    for shape, dtype in SHAPES:
        b, h, n, d = shape
        base = [torch.randn(b, n, h, d, device="cuda", dtype=dtype) for _ in range(3)]
        q, k, v = (t.transpose(1, 2) for t in base)
        out = torch.empty_like(q)
        scale = 1 / math.sqrt(d)
        plan = dispatch.plan(q, k, v, out, variant=DEFAULT)
        k_c, centres = centre_keys(k, block_n=plan.block_n, exact=True, centres_dtype=dtype)  # as dispatch asks
        grid, args, meta = hopper.kernel_call(q, k_c, v, centres, out, scale=scale)
        parts = {
            "op (bnhd)": lambda: pasa_attention(*base, layout="bnhd"),
            "dispatch.forward": lambda: dispatch.forward(q, k, v, out, scale=scale, variant=DEFAULT, beta=DEFAULT_BETA),
            "dispatch.plan": lambda: dispatch.plan(q, k, v, out, variant=DEFAULT),
            "centre_keys": lambda: centre_keys(k, block_n=plan.block_n, exact=True, centres_dtype=dtype),
            "kernel_call": lambda: hopper.kernel_call(q, k_c, v, centres, out, scale=scale),
            "descriptor x1": lambda: gluon_common.descriptor(q, 64, 64 if d == 64 else 128),
            "gluon launch (binding)": lambda: hopper.exact_fwd_gluon_kernel[grid](*args, **meta),
            "gluon launch (kept)": lambda: kept_launch(hopper.exact_fwd_gluon_kernel, grid, args, meta),
            "torch.empty_like": lambda: torch.empty_like(q),
            "slice q[0:1]": lambda: q[0:1],
        }
        print(shape, dtype, plan.describe()[:60])
        for name, fn in parts.items():
            print(f"  {name:20s} {host_us(fn, calls=200):8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
