"""How do this GPU's tensor cores accumulate, and what does that do to attention on biased inputs?

    python -m bench.accumulation --out DIR

Two measurements (the evidence behind the tolerance rule of tests/test_kernel_gpu.py):

1. Rounding of GEMM accumulators.  Positive fp16 operands (every partial sum grows, so the rounding
   direction shows), C = A B with inner dimension K through a Triton tl.dot (fp32 and fp16
   accumulators), cuBLAS with fp32 output (torch.mm(..., out_dtype=torch.float32)), cuBLAS fp16 and
   IEEE fp32 (fp32 copies, no tensor cores), against the exact float64 product: mean and RMS of the
   signed error in units of the result's ulp.  Round-to-nearest gives a mean near 0; truncation a
   mean near -0.5 per rounding.  FP8: positive e4m3 operands, K = 128 to 8192, the tensor cores accumulating
   in place over the whole K (FA3's ``P V``), or each 128-long chunk's product in a fresh tile added to an fp32
   accumulator (``pasa-fp8``'s promotion of each key tile's ``P8 V8``), in units of the fp32 result's ulp: what
   the in-place accumulation would cost the 8-bit kernel over a long sequence (docs/notes/int8_kernel.md).
2. Attention error (relative RMSE against the float64 golden) at the paper's mean-30 cells
   (numerics.paper_inputs, (1, 28/4, 1407, 128)), with the paper's V and with zero-mean V: the
   FlashAttention-2 reference (reference.flash_reference, IEEE fp32 GEMMs), the same algorithm with
   both GEMMs on cuBLAS's tensor cores, SDPA's flash, cuDNN and efficient backends, our kernels
   (exact hybrid and half, FA hybrid, PASA half) and the exact shift's half reference.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from pasa_diffusers import numerics
from pasa_diffusers.metrics import records
from pasa_diffusers.reference import exact_shift_reference, flash_reference, golden_attention
from pasa_diffusers.variants import Variant

from . import harness

NAME = "accumulation"
INNER_DIMS = (16, 64, 128)
CELLS = [("uniform", 30.0, 20.0), ("uniform", 30.0, 5.0), ("uniform", 30.0, 0.5), ("hybrid", 30.0, 0.5),
         ("hybrid", 30.0, 5.0), ("hybrid", 30.0, 20.0), ("uniform", 20.0, 0.5), ("uniform", 0.0, 5.0)]
"""The paper's (distribution, mean, amplitude) cells measured."""
OURS = [Variant("none", "hybrid"), Variant("exact", "hybrid"), Variant("exact", "half"), Variant("pasa", "half")]


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


FP8_INNER_DIMS = (128, 1024, 8192)
FP8_CHUNK = 128
"""The FP8 products' inner dimensions, and the chunk the promoted accumulation adds in fp32 (the 8-bit kernel's
key tile)."""


@triton.jit
def _fp8_gemm_kernel(a_ptr, b_ptr, c_ptr, one, K: tl.constexpr, CHUNK: tl.constexpr, PROMOTE: tl.constexpr):
    """One 64 x 64 tile ``C = A B`` of e4m3 operands (row-major, contiguous) over ``K`` in chunks of ``CHUNK``: the
    tensor cores accumulate in place, or with ``PROMOTE`` each chunk's product goes to a fresh fp32 tile that is
    added to the accumulator as ``acc + one * t`` (``one`` = 1.0 at run time: an addition of the product itself
    would be folded into it)."""
    rows = tl.arange(0, 64)
    inner = tl.arange(0, CHUNK)
    acc = tl.zeros((64, 64), dtype=tl.float32)
    for start in range(0, K, CHUNK):
        a = tl.load(a_ptr + rows[:, None] * K + start + inner[None, :])
        b = tl.load(b_ptr + (start + inner)[:, None] * 64 + rows[None, :])
        if PROMOTE:
            acc = acc + one * tl.dot(a, b)
        else:
            acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rows[:, None] * 64 + rows[None, :], acc)


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ulp of each value of ``x`` in ``dtype`` (normal range)."""
    exponent = torch.frexp(x.double()).exponent - 1
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent) * torch.finfo(dtype).eps


def _products(a: torch.Tensor, b: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """``A B`` through each GEMM measured."""
    runs = {}
    for out_f16, name in ((False, "Triton tl.dot, fp32"), (True, "Triton tl.dot, fp16")):
        c = torch.empty(64, 64, dtype=torch.float16 if out_f16 else torch.float32, device="cuda")
        _gemm_kernel[(1,)](a, b, c, K=k, OUT_F16=out_f16, num_warps=4)
        runs[name] = c
    runs["cuBLAS, fp32 out"] = torch.mm(a, b, out_dtype=torch.float32)
    runs["cuBLAS, fp16 out"] = torch.mm(a, b)
    runs["IEEE fp32 (FFMA)"] = a.float() @ b.float()
    return runs


def rounding_rows(trials: int = 20) -> list[dict]:
    """Per GEMM and inner dimension: the mean and RMS signed error in ulps over ``trials`` draws."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for k in INNER_DIMS:
        errors: dict[str, list[torch.Tensor]] = {}
        for _ in range(trials):
            a = (torch.rand(64, k, generator=gen) * 4 + 0.01).half().cuda()
            b = (torch.rand(k, 64, generator=gen) * 4 + 0.01).half().cuda()
            exact = a.double() @ b.double()
            for name, c in _products(a, b, k).items():
                errors.setdefault(name, []).append(((c.double() - exact) / _ulp(exact, c.dtype)).flatten().cpu())
        for name, errs in errors.items():
            e = torch.cat(errs)
            rows.append({"gemm": name, "k": k, "accumulator": "fp16" if "fp16" in name else "fp32",
                         "mean_ulp": e.mean().item(), "rms_ulp": e.pow(2).mean().sqrt().item()})
    return rows


def fp8_rows(trials: int = 20) -> list[dict]:
    """Per FP8 accumulation (in place, promoted per :data:`FP8_CHUNK`) and inner dimension: the mean and RMS signed
    error of the fp32 result in ulps over ``trials`` draws of positive e4m3 operands."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for k in FP8_INNER_DIMS:
        errors: dict[str, list[torch.Tensor]] = {}
        for _ in range(trials):
            a = (torch.rand(64, k, generator=gen) * 4 + 0.01).to(torch.float8_e4m3fn).cuda()
            b = (torch.rand(k, 64, generator=gen) * 4 + 0.01).to(torch.float8_e4m3fn).cuda()
            exact = a.double() @ b.double()
            for promote, name in ((False, "in place"), (True, f"promoted per {FP8_CHUNK}")):
                c = torch.empty(64, 64, dtype=torch.float32, device="cuda")
                _fp8_gemm_kernel[(1,)](a, b, c, 1.0, K=k, CHUNK=FP8_CHUNK, PROMOTE=promote, num_warps=4)
                errors.setdefault(name, []).append(((c.double() - exact) / _ulp(exact, c.dtype)).flatten().cpu())
        for name, errs in errors.items():
            e = torch.cat(errs)
            rows.append({"gemm": f"Triton tl.dot, e4m3, fp32 {name}", "k": k, "k_steps": k // 32,
                         "mean_ulp": e.mean().item(), "rms_ulp": e.pow(2).mean().sqrt().item()})
    return rows


def _flash_tensor_cores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The FlashAttention-2 reference's algorithm (one key block) with both GEMMs on cuBLAS's tensor cores."""
    b, h, n, d = q.shape
    s = torch.bmm(q.reshape(b * h, n, d), k.reshape(b * h, -1, d).transpose(1, 2), out_dtype=torch.float32)
    p = torch.softmax(s * d ** -0.5, dim=-1)
    o = torch.bmm(p.half(), v.reshape(b * h, -1, d), out_dtype=torch.float32) / p.sum(-1, keepdim=True)
    return o.reshape(b, h, n, d).half()


def attention_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor | str]:
    """Every attention measured on one draw (an error text where a backend cannot run it)."""
    k_all, v_all = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    outs: dict[str, torch.Tensor | str] = {
        "FA2 reference (IEEE fp32)": flash_reference(q, k, v, precision="hybrid", block_m=q.shape[2]),
        "FA2, cuBLAS tensor cores": _flash_tensor_cores(q, k_all, v_all)}
    runs = [(harness.sdpa_method(b), (q, k_all, v_all)) for b in ("flash", "cudnn", "efficient")]
    runs += [(harness.op_method(variant), (q, k, v)) for variant in OURS]
    for m, inputs in runs:
        try:
            outs[m.name] = m.build(*inputs).call()
        except Exception as e:  # noqa: BLE001 - a backend that cannot run this shape is a result
            outs[m.name] = harness.error_text(e)
    outs["exact-half reference"] = exact_shift_reference(q, k, v, precision="half", block_m=q.shape[2])
    return outs


def attention_rows() -> list[dict]:
    """Per paper cell and V: each attention's relative RMSE against the float64 golden."""
    rows = []
    for dist, mean, amp in harness.progress(CELLS, NAME):
        for v_mean in (None, 0.0):
            q, k, v = (t.cuda() for t in numerics.paper_inputs(dist, mean, amp, shape=numerics.PAPER_SHAPE,
                                                                v_mean=v_mean))
            gold = golden_attention(q, k, v)
            errors = {name: out if isinstance(out, str) else numerics.rel_rmse(out, gold)
                      for name, out in attention_outputs(q, k, v).items()}
            rows.append({"cell": f"{dist}({mean:g},{amp:g})", "v": "paper" if v_mean is None else "N(0,1)",
                         "rel_rmse": errors})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(NAME, __doc__)
    p.add_argument("--trials", type=int, default=20, help="random GEMM draws per inner dimension (default: 20)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"bench.{NAME}: needs a CUDA GPU (it measures its tensor cores)", file=sys.stderr)
        return 2

    cmd, env = harness.command(NAME, argv), harness.environment()
    with torch.no_grad():
        rounding, fp8, attention = rounding_rows(args.trials), fp8_rows(args.trials), attention_rows()
    names = list(attention[0]["rel_rmse"])
    text = harness.header("bench.accumulation: GEMM accumulator rounding and attention error", env, cmd)
    text += "\n## GEMM rounding against the exact product\n\n" + records.markdown_table(
        ["GEMM", "K", "accumulator", "mean error (ulp)", "RMS error (ulp)"],
        [[r["gemm"], r["k"], r["accumulator"], f"{r['mean_ulp']:+.3f}", f"{r['rms_ulp']:.3f}"] for r in rounding],
        align="lrlrr")
    text += "\n\n## FP8 products: the tensor cores in place, or promoted to fp32 per chunk\n\n"
    text += records.markdown_table(
        ["GEMM", "K", "k-steps of 32", "mean error (ulp)", "RMS error (ulp)"],
        [[r["gemm"], r["k"], r["k_steps"], f"{r['mean_ulp']:+.3f}", f"{r['rms_ulp']:.3f}"] for r in fp8],
        align="lrrrr")
    text += "\n\n## Attention: relative RMSE against the float64 golden\n\n" + records.markdown_table(
        ["cell", "V", *names],
        [[r["cell"], r["v"], *(e if isinstance(e, str) else f"{e:.3e}" for e in r["rel_rmse"].values())]
         for r in attention]) + "\n"
    harness.write_report(args.out, NAME, text, {"bench": NAME, "command": cmd, "environment": env,
                                                "rounding": rounding, "fp8": fp8, "attention": attention})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
