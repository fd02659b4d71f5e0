"""What does each attention backend cost in one forward of a full-size video transformer?

    python -m bench.dit --out DIR                                          # Wan 2.1 1.3B at 480p
    python -m bench.dit --model wan2.1-1.3b --resolution 480p 720p --backends sdpa pasa fa3 --out DIR
    python -m bench.dit --model cogvideox-5b --backends sdpa pasa --compile pasa --out DIR
    python -m bench.dit --model tiny-wan --out DIR                          # any machine, the CPU included

The transformer of ``pipelines.video_dits`` (``FULL_SIZE``: Wan 2.1 1.3B / 14B, CogVideoX-5B from
their released configs, random weights, bf16 on the GPU; or a ``tiny-<family>`` one, fp32), one
forward with classifier-free guidance (batch 2), Wan at 81 frames.  Per backend (names of
``pasa_diffusers.backends.BACKENDS``, installed by ``install.apply``: the model's own processors,
attention routed): the forward's time (the timer's median over ``--iters`` forwards after one
warm-up), the first backend's time over it (> 1: faster), the peak GPU memory of the forward, whether
the output is finite, its relative RMS difference to the first backend's, and the fallback calls.
``--compile`` adds ``torch.compile``d forwards of the named backends (or all).
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict

import torch

from pasa_diffusers.backends import BACKENDS
from pasa_diffusers.metrics import records
from pasa_diffusers.pipelines.video_dits import (FAMILIES, FULL_SIZE, RESOLUTIONS, example_inputs,
                                                 full_size_inputs, full_size_transformer, tiny_transformer)

from . import harness

NAME = "dit"
MODELS = tuple(FULL_SIZE) + tuple(f"tiny-{family}" for family in FAMILIES)


def make_model(name: str) -> torch.nn.Module:
    """A full-size model in bf16 on the GPU, or a tiny one in fp32 on the harness's device."""
    if name.startswith("tiny-"):
        return tiny_transformer(name.removeprefix("tiny-")).to(harness.device())
    return full_size_transformer(name, device="cuda", dtype=torch.bfloat16)


def make_inputs(name: str, model: torch.nn.Module, resolution: str) -> dict:
    if name.startswith("tiny-"):
        family = name.removeprefix("tiny-")
        inputs = example_inputs(family, model, torch.Generator().manual_seed(1))
        return {k: v.to(harness.device()) if torch.is_tensor(v) else v for k, v in inputs.items()}
    return full_size_inputs(name, model, resolution)


def forward_rows(model: torch.nn.Module, name: str, resolution: str, args, timer: harness.Timer) -> list[dict]:
    """Every backend (and compiled mode) at one resolution; the first backend is the baseline."""
    inputs = make_inputs(name, model, resolution)
    rows = harness.model_runs(model, args.backends, args.compile, lambda runner: runner(**inputs)[0], timer)
    return [{"model": name, "resolution": resolution, **row} for row in rows]


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(NAME, __doc__)
    p.add_argument("--model", default="wan2.1-1.3b", choices=MODELS, help="the transformer (default: wan2.1-1.3b)")
    p.add_argument("--resolution", nargs="+", default=["480p"], choices=list(RESOLUTIONS),
                   help="Wan's video sizes at 81 frames (default: 480p; CogVideoX and the tiny models: their own)")
    p.add_argument("--backends", nargs="+", default=["sdpa", "pasa"], choices=list(BACKENDS), metavar="BACKEND",
                   help=f"attention backends, the first is the baseline; of {', '.join(BACKENDS)} (default: sdpa pasa)")
    p.add_argument("--compile", nargs="*", default=None, metavar="BACKEND",
                   help="also time torch.compile'd forwards: of every backend, or of the named ones")
    p.add_argument("--iters", type=int, default=5, help="timed forwards per backend (default: 5)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.compile or ()) - set(args.backends))
    if unknown:
        p.error(f"--compile {' '.join(unknown)}: not among --backends {' '.join(args.backends)}")
    if not args.model.startswith("tiny-") and not torch.cuda.is_available():
        print(f"bench.{NAME}: --model {args.model} needs a CUDA GPU (the full-size transformer); "
              "--model tiny-<family> runs anywhere", file=sys.stderr)
        return 2
    problem = harness.cpu_problem(NAME) if not torch.cuda.is_available() and any(
        BACKENDS[b].variant is not None for b in args.backends) else None
    if problem:
        print(problem, file=sys.stderr)
        return 2

    cmd, env = harness.command(NAME, argv), harness.environment()
    timer = harness.Timer(warmup_ms=0.0, rep_ms=0.0, min_runs=args.iters, flush_l2=False)
    model = make_model(args.model)
    resolutions = args.resolution if FULL_SIZE.get(args.model, (None, None, ""))[2] == "wan" else ["own"]
    rows = [r for resolution in harness.progress(resolutions, NAME)
            for r in forward_rows(model, args.model, resolution, args, timer)]
    first = args.backends[0]
    text = harness.header(f"bench.dit: one forward of {args.model} per attention backend", env, cmd) + "\n" + \
        records.markdown_table(
            ["resolution", "backend", "mode", "forward ms", f"vs {first}", "peak MiB", "finite",
             f"rel. RMS diff to {first}", "fallback calls"],
            [[r["resolution"], r["backend"], r["mode"], f"{r['ms']:.1f}", f"{r['vs_first']:.3f}",
              "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}", r["finite"], f"{r['rel_rms_diff']:.2e}",
              r["fallback_calls"]] for r in rows], align="lllrrrlrr") + "\n"
    harness.write_report(args.out, NAME, text, {"bench": NAME, "command": cmd, "environment": env,
                                                "timer": asdict(timer), "rows": rows})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
