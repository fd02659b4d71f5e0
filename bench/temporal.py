"""How close does temporal attention (many sequences of 14-25 tokens) come to the copy bandwidth?

    python -m bench.temporal --out DIR
    python -m bench.temporal --rounds 7 --methods sdpa,exact-hybrid,pasa-half --out DIR
    python -m bench.temporal --config 'packed:{"SEQS": 4, "num_warps": 1, "num_stages": 1}' --out DIR
    TRITON_INTERPRET=1 python -m bench.temporal --shapes tiny --rounds 1 --out DIR

SVD-XT's temporal shapes (2HW, H, F, 64) at 576x1024 (one sequence of F frames per latent pixel and
CFG copy), F = 14 and 25, are small and many: their time is memory traffic, so the number to read is
GB/s (fp16 bytes of q, k, v read and o written once / t) and its share of what torch's copy_ moves
through the same bytes (read + write) on the same device ("% copy").

Methods (--methods; default sdpa,ours,kernels:exact-hybrid): SDPA's backends, our variants through the
op, every kernel path of the default (kernels:<variant>), and with --config KERNEL:JSON (repeatable)
the default on that kernel with those meta-parameters fixed instead of autotuned.  --rounds N times
every method once per round, interleaved, so that slow drift of the GPU affects all alike: ms is the
median over rounds, with its range.  rel. RMSE: against the float64 golden on the first 256 sequences.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

import torch

from pasa_diffusers import numerics
from pasa_diffusers.metrics import records
from pasa_diffusers.reference import golden_attention
from pasa_diffusers.variants import DEFAULT

from . import harness

NAME = "temporal"
DEFAULT_METHODS = "sdpa,ours,kernels:exact-hybrid"
GOLDEN_SEQUENCES = 256


def parse_config(text: str) -> tuple[str, dict]:
    """``KERNEL:JSON`` -> ``(kernel, config)``; ``argparse.ArgumentTypeError`` naming what is wrong."""
    kernel, sep, body = text.partition(":")
    if not sep or kernel not in harness.kernel_names():
        raise argparse.ArgumentTypeError(
            f"--config {text!r}: expected KERNEL:JSON with KERNEL one of {harness.kernel_names()}")
    try:
        config = json.loads(body)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--config {text!r}: the config is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"--config {text!r}: the config must be a JSON object")
    return kernel, config


def copy_gbps(shape: harness.Shape, timer: harness.Timer) -> float:
    """GB/s of ``copy_`` over the bytes of one attention call (read + write, as counted for attention)."""
    half = shape.bytes() // 2
    src, dst = (torch.empty(half, dtype=torch.uint8, device=harness.device()) for _ in range(2))
    dst.copy_(src)
    return shape.bytes() / timer(lambda: dst.copy_(src)) * 1e-6


def table(rows: Sequence[harness.Row], copy: float) -> str:
    """One method per line: ms [range], GB/s, % copy, ratio to the best SDPA, error, kernel."""
    f = harness.fmt
    lines = []
    for r in rows:
        spread = f" [{r.ms_min:.3f}-{r.ms_max:.3f}]" if r.ms is not None and r.ms_max != r.ms_min else ""
        pct = f"{100 * r.gbps / copy:.0f} %" if r.gbps else "-"
        lines.append([r.method, f(r.ms, ".3f") + spread, f(r.gbps), pct, f(r.vs_best_sdpa, ".2f"),
                      f(r.extra.get("rel_rmse"), ".2e"), r.status()])
    return records.markdown_table(["method", "ms [range]", "GB/s", "% copy", "vs best SDPA", "rel. RMSE",
                                   "kernel / note"], lines, align="lrrrrrl")


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(NAME, __doc__)
    harness.add_shape_arguments(p, default="svd-temporal", choices=("svd-temporal", "tiny"))
    harness.add_method_arguments(p, DEFAULT_METHODS)
    p.add_argument("--config", type=parse_config, action="append", default=[], metavar="KERNEL:JSON",
                   help="also run the default on KERNEL with these meta-parameters fixed (repeatable)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default: 5)")
    harness.add_timer_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: must be at least 1")
    problem = harness.cpu_problem(NAME) if harness.runs_ours(args.methods) or args.config else None
    if problem:
        print(problem, file=sys.stderr)
        return 2

    cmd, env = harness.command(NAME, argv), harness.environment()
    methods, kernel_variants, missing = harness.select_methods(args.methods)
    timer = harness.Timer(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    gen = torch.Generator(device=harness.device()).manual_seed(args.seed)
    shapes = [s for s in harness.shapes(args.shapes, args.frames) if args.shapes != "tiny" or s.name == "temporal"]
    text = harness.header("bench.temporal: temporal attention against the copy bandwidth", env, cmd)
    results = []
    for shape in harness.progress(shapes, NAME):
        q, k, v = harness.make_inputs(shape, gen)
        seqs = slice(0, GOLDEN_SEQUENCES)
        gold = golden_attention(q[seqs], k[seqs], v[seqs])
        per_shape = [m for variant in kernel_variants for m in harness.kernel_methods(variant, q, k, v)]
        per_shape += harness.config_methods(DEFAULT, q, k, v, args.config)
        rows = harness.measure(shape, methods + per_shape, q, k, v, timer=timer, rounds=args.rounds,
                               check=lambda out: {"rel_rmse": numerics.rel_rmse(out[seqs], gold)})
        copy = copy_gbps(shape, timer)
        text += f"\n## {shape.label} {shape.bhnd} fp16; copy_ {harness.fmt(copy)} GB/s\n\n{table(rows, copy)}\n"
        results.append({"shape": asdict(shape), "copy_gbps": copy, "rows": harness.rows_payload(rows)})
        del q, k, v, gold
        harness.free_memory()
    harness.write_report(args.out, NAME, text, {"bench": NAME, "command": cmd, "environment": env,
                                                "timer": asdict(timer), "rounds": args.rounds, "not_run": missing,
                                                "results": results})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
