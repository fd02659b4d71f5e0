"""Interleaved rounds at SVD's temporal shapes: the default (the exact shift in hybrid, packed kernel)
against PASA half, and one packed config outside the pool (4 sequences on one warp).

    PYTHONPATH=$PWD python bench/temporal_rounds.py

Seven rounds; each round times every method once (``do_bench`` median, L2 cleared before every
call), so slow drift of the GPU affects all methods alike.  Prints the median over rounds, the
range, and PASA half's time over the default's (> 1: the default is faster).
"""
import statistics

import torch
import triton

from pasa_diffusers.kernels.pasa_fwd import pasa_forward

SHAPES = [(18432, 5, 14), (4608, 10, 14), (18432, 5, 25), (4608, 10, 25)]
ROUNDS = 7


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for (b, h, n) in SHAPES:
        q, k, v = (torch.randn(b, n, h, 64, device="cuda", generator=gen, dtype=torch.float16).transpose(1, 2)
                   for _ in range(3))
        out = torch.empty_like(q)
        fns = {"default": lambda: pasa_forward(q, k, v, out, scale=0.125, precision="hybrid", shift="exact", beta=0.9),
               "packed 4 seq/1w": lambda: pasa_forward(q, k, v, out, scale=0.125, precision="hybrid", shift="exact",
                                                       beta=0.9, config={"SEQS": 4, "num_warps": 1, "num_stages": 1}),
               "pasa-half": lambda: pasa_forward(q, k, v, out, scale=0.125, precision="half", shift=True, beta=0.9)}
        for f in fns.values():
            f()
        torch.cuda.synchronize()
        t = {name: [] for name in fns}
        for _ in range(ROUNDS):
            for name, f in fns.items():
                t[name].append(triton.testing.do_bench(f, warmup=10, rep=60, return_mode="median"))
        med = {name: statistics.median(x) for name, x in t.items()}
        ranges = " | ".join(f"{nm} {m:.4f} ms [{min(t[nm]):.4f}-{max(t[nm]):.4f}]" for nm, m in med.items())
        print(f"({b},{h},{n}): " + ranges
              + f" | pasa-half/default {med['pasa-half'] / med['default']:.3f}", flush=True)


if __name__ == "__main__":
    main()
