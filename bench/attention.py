"""How fast is each attention backend on this GPU at SVD's and the video DiTs' shapes: one table.

    python -m bench.attention --out DIR                          # every shape set but tiny
    python -m bench.attention --shapes svd --frames 25 --out DIR  # SVD-XT at 25 frames only
    python -m bench.attention --methods sdpa,exact-hybrid,kernels:exact-hybrid --out DIR
    python -m bench.attention --shapes dit --dtype bfloat16 --out DIR   # the video transformers, as they run
    python -m bench.attention --shapes dit-calls --dtype bfloat16 --out DIR   # their other calls (text, short models)
    TRITON_INTERPRET=1 python -m bench.attention --shapes tiny --out DIR   # a CPU, under the interpreter

Every method gets the same inputs, fp16 or --dtype bfloat16: (B, N, H, D) contiguous tensors viewed as (B, H, N, D), as
diffusers holds them.  --methods takes names and groups, comma-separated (default sdpa,peers,ours):

  sdpa      sdpa-flash, sdpa-cudnn, sdpa-efficient, sdpa-math: F.scaled_dot_product_attention under
            sdpa_kernel(<backend>); math is skipped above 2^31 scores (it materialises them)
  peers     fa3-bf16, fa3-fp8 (FlashAttention-3, fa3-fwd wheel; fp8 e4m3 scaled per kv head, the
            conversion untimed), sageattn (SageAttention on its own clone of k), when importable
  ours      exact-hybrid (the op's default), exact-half, exact-int8 (pasa-int8), exact-fp8 (pasa-fp8),
            pasa-hybrid, pasa-half, none-hybrid, none-half: pasa_attention(..., layout="bnhd") with that
            variant's precision and shift
  kernels   for each of our variants, every kernel and key pre-pass kernels.dispatch accepts at the
            shape, through dispatch.forward (kernels:<variant> for one variant)

Columns: ms (the timer's median), TFLOP/s = 4 B Hq Nq Nk D / t, GB/s = fp16 bytes of q, k, v read and
o written once / t, vs best SDPA = the fastest SDPA backend's time / this time (> 1: faster), peak MiB = the
GPU memory one call allocates (its output and workspace: the centred copy of K for the default), and the
kernel the dispatcher's plan chose for our rows, or the error.  The first table has one line per
shape: each method's ms and its ratio; attention.png draws the ratios (plot).
"""
from __future__ import annotations

import os
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


def plot(rows: Sequence[dict], path: str | os.PathLike) -> None:
    """``path`` (PNG): each method's speed relative to the fastest SDPA backend, one line of dots per shape
    (log scale, 1 = SDPA's best; our methods drawn larger), from the report's JSON rows (``rows_payload``),
    so that an earlier run's ``attention.json`` can be drawn again: ``plot(json.load(f)["rows"], path)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    timed = [r for r in rows if r.get("vs_best_sdpa")]
    if not timed:
        raise ValueError("bench.attention.plot: no row has a time relative to SDPA's best")
    shapes = list(dict.fromkeys(f"{r['shape']} {r['bhnd']}" for r in timed))
    methods = list(dict.fromkeys((r["method"], r["kind"]) for r in timed))
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(shapes) + 1.8))
    for index, (method, kind) in enumerate(methods):
        points = [(r["vs_best_sdpa"], shapes.index(f"{r['shape']} {r['bhnd']}"))
                  for r in timed if r["method"] == method]
        ax.scatter(*zip(*points), marker="osD^v<>PX*h"[index % 11], s=70 if kind == "ours" else 30,
                   label=method, zorder=3 if kind == "ours" else 2, alpha=0.9)
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xscale("log")
    ratios = [r["vs_best_sdpa"] for r in timed]
    ticks = [t for t in (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
             if min(ratios) / 1.2 <= t <= max(ratios) * 1.2]
    ax.xaxis.set_major_locator(ticker.FixedLocator(ticks))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}x"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_yticks(range(len(shapes)), shapes, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speed relative to the fastest SDPA backend on the same inputs (> 1: faster)")
    ax.grid(axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    payload = harness.rows_payload(rows)
    figure = ""
    if any(r["vs_best_sdpa"] for r in payload):
        os.makedirs(args.out, exist_ok=True)
        plot(payload, os.path.join(args.out, f"{NAME}.png"))
        figure = f"![speed per method and shape]({NAME}.png)\n\n"
    text = (harness.header("bench.attention: forward attention time per method", env, cmd) + "\n"
            + pivot(rows) + "\n\n" + figure + (not_run + "\n" if not_run else "") + table(rows) + "\n")
    harness.write_report(args.out, NAME, text, {
        "bench": NAME, "command": cmd, "environment": env, "timer": asdict(timer),
        "shapes": [asdict(s) for s in shapes], "not_run": missing, "rows": payload})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
