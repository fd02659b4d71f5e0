"""How fast is each attention backend on this GPU at SVD's and the video DiTs' shapes: one table.

    python -m bench.attention --out DIR                          # every shape set but tiny
    python -m bench.attention --shapes svd --frames 25 --out DIR  # SVD-XT at 25 frames only
    python -m bench.attention --methods sdpa,exact-hybrid,kernels:exact-hybrid --out DIR
    python -m bench.attention --shapes dit --dtype bfloat16 --out DIR   # the video transformers, as they run
    TRITON_INTERPRET=1 python -m bench.attention --shapes tiny --out DIR   # a CPU, under the interpreter

Every method gets the same inputs, fp16 or --dtype bfloat16: (B, N, H, D) contiguous tensors viewed as (B, H, N, D), as
diffusers holds them.  --methods takes names and groups, comma-separated (default sdpa,peers,ours):

  sdpa      sdpa-flash, sdpa-cudnn, sdpa-efficient, sdpa-math: F.scaled_dot_product_attention under
            sdpa_kernel(<backend>); math is skipped above 2^31 scores (it materialises them)
  peers     fa3-bf16, fa3-fp8 (FlashAttention-3, fa3-fwd wheel; fp8 e4m3 scaled per kv head, the
            conversion untimed), sageattn (SageAttention on its own clone of k), when importable
  ours      exact-hybrid (the op's default), exact-half, exact-int8 (pasa-int8), pasa-hybrid, pasa-half,
            none-hybrid, none-half: pasa_attention(..., layout="bnhd") with that variant's precision and shift
  kernels   for each of our variants, every kernel and key pre-pass kernels.dispatch accepts at the
            shape, through dispatch.forward (kernels:<variant> for one variant)

Columns: ms (the timer's median), TFLOP/s = 4 B Hq Nq Nk D / t, GB/s = fp16 bytes of q, k, v read and
o written once / t, vs best SDPA = the fastest SDPA backend's time / this time (> 1: faster), peak MiB = the
GPU memory one call allocates (its output and workspace: the centred copy of K for the default), and the
kernel the dispatcher's plan chose for our rows, or the error.  The first table has one line per
shape: each method's ms and its ratio.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict

import torch

from pasa_diffusers.metrics import records

from . import harness

NAME = "attention"
DEFAULT_METHODS = "sdpa,peers,ours"


def pivot(rows: Sequence[harness.Row]) -> str:
    """One line per shape, one column per method: ``ms (ratio to the best SDPA)``."""
    methods = list(dict.fromkeys(r.method for r in rows))
    cells = {(r.shape, r.method): r for r in rows}
    lines = []
    for shape, bhnd in dict.fromkeys((r.shape, r.bhnd) for r in rows):
        line = [shape, bhnd]
        for m in methods:
            r = cells.get((shape, m))
            line.append("-" if r is None or r.ms is None else f"{r.ms:.3g} ({harness.fmt(r.vs_best_sdpa, '.2f')}x)")
        lines.append(line)
    return records.markdown_table(["shape", "(B, Hq/Hk, N, D)", *methods], lines)


def table(rows: Sequence[harness.Row]) -> str:
    """Every row: ms, TFLOP/s, GB/s, ratio, kernel or error."""
    f = harness.fmt
    return records.markdown_table(
        ["shape", "(B, Hq/Hk, N, D)", "method", "ms", "TFLOP/s", "GB/s", "vs best SDPA", "peak MiB", "kernel / note"],
        [[r.shape, r.bhnd, r.method, f(r.ms, ".3f"), f(r.tflops), f(r.gbps), f(r.vs_best_sdpa, ".2f"),
          f(r.peak_mib, ".0f"), r.status()] for r in rows], align="lllrrrrrl")


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(NAME, __doc__)
    harness.add_shape_arguments(p, default="all")
    harness.add_method_arguments(p, DEFAULT_METHODS)
    harness.add_dtype_argument(p)
    harness.add_timer_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    args = p.parse_args(argv)
    problem = harness.cpu_problem(NAME) if harness.runs_ours(args.methods) else None
    if problem:
        print(problem, file=sys.stderr)
        return 2

    cmd, env = harness.command(NAME, argv), harness.environment()
    methods, kernel_variants, missing = harness.select_methods(args.methods)
    for name, reason in missing.items():
        harness.log(f"{name} not run: {reason}")
    timer = harness.Timer(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    gen = torch.Generator(device=harness.device()).manual_seed(args.seed)
    shapes = harness.shapes(args.shapes, args.frames)
    rows: list[harness.Row] = []
    for shape in harness.progress(shapes, NAME):
        q, k, v = harness.make_inputs(shape, gen, dtype=harness.INPUT_DTYPES[args.dtype])
        per_shape = [m for variant in kernel_variants for m in harness.kernel_methods(variant, q, k, v)]
        rows += harness.measure(shape, methods + per_shape, q, k, v, timer=timer)
        del q, k, v
        harness.free_memory()

    not_run = "".join(f"- {name} not run: {reason}\n" for name, reason in missing.items())
    text = (harness.header("bench.attention: forward attention time per method", env, cmd) + "\n"
            + pivot(rows) + "\n\n" + (not_run + "\n" if not_run else "") + table(rows) + "\n")
    harness.write_report(args.out, NAME, text, {
        "bench": NAME, "command": cmd, "environment": env, "timer": asdict(timer),
        "shapes": [asdict(s) for s in shapes], "not_run": missing, "rows": harness.rows_payload(rows)})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
