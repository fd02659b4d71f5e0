"""Temporal attention (many 14-25-token sequences): the packed exact-shift kernel's configs beside the
loop kernel, PASA half, plain FA hybrid, SDPA's backends and a device copy.

    python bench/temporal_packed.py --out bench_out

For each SVD-XT temporal shape (2HW, H, F, 64) at 576x1024: every config of the packed kernel's pool
(``SEQS`` sequences per program, warps), the autotuned choice, and the peers, each timed with
``triton.testing.do_bench`` (median, L2 cleared before every call) on the (B, N, H, D) memory
diffusers holds.  GB/s counts q, k, v read and o written once; ``% copy`` divides it by the
bandwidth of ``torch.Tensor.copy_`` on the same bytes (read + write).  Errors: relative RMSE against
the float64 golden on the first 256 sequences.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402

from pasa_diffusers import numerics  # noqa: E402
from pasa_diffusers.kernels import configs, pasa_fwd  # noqa: E402
from pasa_diffusers.reference import DEFAULT_BETA, golden_attention  # noqa: E402

SHAPES = [(18432, 5, 14, 64), (4608, 10, 14, 64), (18432, 5, 25, 64), (4608, 10, 25, 64)]


def _time(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _methods(q, k, v, out):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    scale = 1.0 / math.sqrt(q.shape[-1])

    def ours(precision, shift, **options):
        return lambda: pasa_fwd.pasa_forward(q, k, v, out, scale=scale, precision=precision, shift=shift,
                                             beta=DEFAULT_BETA, **options)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)
        return run

    rows = [("sdpa-cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)), ("sdpa-flash", sdpa(SDPBackend.FLASH_ATTENTION)),
            ("sdpa-efficient", sdpa(SDPBackend.EFFICIENT_ATTENTION)),
            ("fa-hybrid", ours("hybrid", False)), ("pasa-half", ours("half", True)),
            ("exact-hybrid [fused loop]", ours("hybrid", "exact", shift_k="fused")),
            ("exact-half [fused loop]", ours("half", "exact", shift_k="fused")),
            ("exact-half [packed, tuned]", ours("half", "exact", shift_k="packed")),
            ("exact-hybrid [packed, tuned]", ours("hybrid", "exact", shift_k="packed"))]
    for cfg in configs._PACKED_CONFIGS:
        seqs, in_g, warps = cfg.kwargs["SEQS"], cfg.kwargs["CENTRE_IN_G"], cfg.num_warps
        rows.append((f"exact-hybrid [packed {seqs} seq / {warps} w{', centred in g' if in_g else ''}]",
                     ours("hybrid", "exact", shift_k="packed", config={"SEQS": seqs, "CENTRE_IN_G": in_g,
                                                                       "num_warps": warps, "num_stages": 1})))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    lines = []
    for b, h, n, d in SHAPES:
        q, k, v = (torch.randn(b, n, h, d, device="cuda", generator=gen, dtype=torch.float16).transpose(1, 2)
                   for _ in range(3))
        out = torch.empty_like(q)
        nbytes = 4 * q.numel() * q.element_size()
        src, dst = (torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda") for _ in range(2))
        copy_gbps = nbytes / _time(lambda: dst.copy_(src)) / 1e6
        gold = golden_attention(q[:256], k[:256], v[:256])
        lines += [f"## ({b}, {h}, {n}, {d}) fp16; copy {copy_gbps:.0f} GB/s", "",
                  "| method | ms | GB/s | % copy | vs best SDPA | rel. RMSE |", "| --- | --- | --- | --- | --- | --- |"]
        timed = []
        for name, fn in _methods(q, k, v, out):
            try:
                ms = _time(fn)
                result = fn()
                err = numerics.rel_rmse(result[:256], gold)
            except Exception as e:  # a config that does not compile or launch is reported, not fatal
                timed.append((name, None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"))
                continue
            timed.append((name, ms, err))
        best_sdpa = min(ms for name, ms, _ in timed if name.startswith("sdpa") and ms is not None)
        for name, ms, err in timed:
            if ms is None:
                lines.append(f"| {name} | {err} | | | | |")
                continue
            gbps = nbytes / ms / 1e6
            lines.append(f"| {name} | {ms:.3f} | {gbps:.0f} | {100 * gbps / copy_gbps:.0f} % | "
                         f"{best_sdpa / ms:.2f}x | {err:.2e} |")
            results.append(dict(shape=[b, h, n, d], method=name, ms=ms, gbps=gbps, copy_gbps=copy_gbps,
                                vs_best_sdpa=best_sdpa / ms, rel_rmse=err))
        lines.append("")
        print("\n".join(lines[-len(timed) - 5:]), flush=True)
    with open(os.path.join(args.out, "temporal_packed.md"), "w") as f:
        f.write(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}\n\n")
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "temporal_packed.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
