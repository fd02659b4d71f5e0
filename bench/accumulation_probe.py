"""How the GPU's tensor cores accumulate, and what that does to attention on biased inputs.

Two measurements on one GPU (the evidence behind the tolerance rule of ``tests/test_kernel_gpu.py``):

1. Rounding of GEMM accumulators.  Positive fp16 operands (every partial sum grows, so the rounding
   direction shows), ``C = A B`` with inner dimension ``K`` from a Triton ``tl.dot`` (fp32 and fp16
   accumulators), cuBLAS with fp32 output (``torch.mm(..., out_dtype=torch.float32)``) and cuBLAS fp16,
   against the exact float64 product: mean and RMS of the signed error in units of the result's ulp.
   Round-to-nearest gives a mean near 0; truncation gives a mean near -0.5 per rounding.
2. Attention error (relative RMSE against the float64 golden) at the paper's mean-30 cells, with the
   paper's V and with zero-mean V: ``flash_reference("fp32")`` (IEEE fp32 sums), the same algorithm
   with its two GEMMs on the tensor cores (cuBLAS, fp32 out), SDPA's flash, cuDNN and efficient
   backends, and our kernels (plain FA hybrid, exact shift hybrid and half, PASA half).

Run: ``python bench/accumulation_probe.py [--out DIR]`` (writes ``accumulation_probe.md``).
"""
from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from pasa_diffusers import numerics
from pasa_diffusers.ops import pasa_attention
from pasa_diffusers.reference import exact_shift_reference, flash_reference, golden_attention


@triton.jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, K: tl.constexpr, OUT_F16: tl.constexpr):
    """One 64 x 64 tile ``C = A B`` with inner dimension ``K`` (row-major, contiguous)."""
    rows = tl.arange(0, 64)
    inner = tl.arange(0, K)
    a = tl.load(a_ptr + rows[:, None] * K + inner[None, :])
    b = tl.load(b_ptr + inner[:, None] * 64 + rows[None, :])
    if OUT_F16:
        c = tl.dot(a, b, out_dtype=tl.float16)
    else:
        c = tl.dot(a, b)
    tl.store(c_ptr + rows[:, None] * 64 + rows[None, :], c)


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ulp of each value of ``x`` in ``dtype`` (normal range)."""
    exponent = torch.frexp(x.double()).exponent - 1
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent) * torch.finfo(dtype).eps


def rounding_table(trials: int = 20) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    lines = ["| GEMM | K | accumulator | mean error (ulp) | RMS error (ulp) |", "| --- | --- | --- | --- | --- |"]
    for k in (16, 64, 128):
        stats: dict[str, list[torch.Tensor]] = {}
        for _ in range(trials):
            a = (torch.rand(64, k, generator=gen) * 4 + 0.01).half().cuda()
            b = (torch.rand(k, 64, generator=gen) * 4 + 0.01).half().cuda()
            exact = a.double() @ b.double()
            runs = {}
            for out_f16, name in ((False, "Triton tl.dot, fp32"), (True, "Triton tl.dot, fp16")):
                c = torch.empty(64, 64, dtype=torch.float16 if out_f16 else torch.float32, device="cuda")
                _gemm_kernel[(1,)](a, b, c, K=k, OUT_F16=out_f16, num_warps=4)
                runs[name] = c
            runs["cuBLAS, fp32 out"] = torch.mm(a, b, out_dtype=torch.float32)
            runs["cuBLAS, fp16 out"] = torch.mm(a, b)
            runs["IEEE fp32 (FFMA)"] = a.float() @ b.float()
            for name, c in runs.items():
                dtype = c.dtype
                stats.setdefault(name, []).append(((c.double() - exact) / _ulp(exact, dtype)).flatten().cpu())
        for name, errs in stats.items():
            e = torch.cat(errs)
            acc = "fp16" if "fp16" in name else "fp32"
            lines.append(f"| {name} | {k} | {acc} | {e.mean():+.3f} | {e.pow(2).mean().sqrt():.3f} |")
    return lines


def _flash_tensor_cores(q, k, v, scale):
    """``flash_reference("fp32")``'s algorithm (one key block) with its GEMMs on cuBLAS's tensor cores."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    b, h, n, d = q.shape
    s = torch.bmm(q.reshape(b * h, n, d), k.reshape(b * h, -1, d).transpose(1, 2), out_dtype=torch.float32)
    p = torch.softmax(s * scale, dim=-1)
    l_sum = p.sum(-1, keepdim=True)
    o = torch.bmm(p.half(), v.reshape(b * h, -1, d), out_dtype=torch.float32) / l_sum
    return o.reshape(b, h, n, d).half()


def _sdpa(q, k, v, backend):
    group = q.shape[1] // k.shape[1]
    with sdpa_kernel(backend):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))


CELLS = [("uniform", 30.0, 20.0), ("uniform", 30.0, 5.0), ("uniform", 30.0, 0.5), ("hybrid", 30.0, 0.5),
         ("hybrid", 30.0, 5.0), ("hybrid", 30.0, 20.0), ("uniform", 20.0, 0.5), ("uniform", 0.0, 5.0)]


def attention_table() -> list[str]:
    names = ["FA fp32 (IEEE)", "FA, cuBLAS tensor cores", "SDPA flash", "SDPA cuDNN", "SDPA efficient",
             "ours FA hybrid", "ours exact hybrid", "ours exact half", "exact half ref", "ours PASA half"]
    lines = ["| cell | V | " + " | ".join(names) + " |", "| --- | --- |" + " --- |" * len(names)]
    for dist, mean, amp in CELLS:
        for v_mean in (None, 0.0):
            q, k, v = (t.cuda() for t in numerics.paper_inputs(dist, mean, amp, shape=numerics.PAPER_SHAPE,
                                                                v_mean=v_mean))
            gold = golden_attention(q, k, v)
            scale = q.shape[-1] ** -0.5
            outs = [flash_reference(q, k, v, precision="fp32", block_m=q.shape[2]), _flash_tensor_cores(q, k, v, scale)]
            for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
                try:
                    outs.append(_sdpa(q, k, v, backend))
                except RuntimeError:
                    outs.append(None)
            outs += [pasa_attention(q, k, v, precision="hybrid", shift=False),
                     pasa_attention(q, k, v, precision="hybrid", shift="exact"),
                     pasa_attention(q, k, v, precision="half", shift="exact"),
                     exact_shift_reference(q, k, v, precision="half", block_m=q.shape[2]),
                     pasa_attention(q, k, v, precision="half", shift=True)]
            errs = ["n/a" if o is None else f"{numerics.rel_rmse(o, gold):.3e}" for o in outs]
            label = "paper" if v_mean is None else "N(0,1)"
            lines.append(f"| {dist}({mean:g},{amp:g}) | {label} | " + " | ".join(errs) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="folder for accumulation_probe.md")
    args = parser.parse_args()
    text = "\n".join([f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}",
                      "", *rounding_table(), "", *attention_table()])
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "accumulation_probe.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
