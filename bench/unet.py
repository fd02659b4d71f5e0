"""What does each attention backend cost in one denoising step of the full-size SVD UNet?

    python -m bench.unet --out DIR
    python -m bench.unet --frames 14 25 --backends sdpa pasa pasa-paper --compile sdpa pasa --out DIR

The UNet of load_svd("svd-xt-random") (diffusers' default UNetSpatioTemporalConditionModel config =
SVD-XT's: block channels 320/640/1280/1280, heads 5/10/20/20, head dim 64; random weights), fp16 on
the GPU, 72x128 latents (576x1024 video), classifier-free guidance (batch 2), F frames.  Per backend
(names of pasa_diffusers.backends.BACKENDS, installed by install.apply): the first step's wall time
(with the compile in a compiled row), the step time (the timer's
median over --iters steps after three warm-up steps), the first backend's time over it (> 1: faster),
the attention's share of an eager step (harness.attention_share: the time inside the attention calls, by
CUDA events around each), whether the output is finite, its relative RMS difference to the first backend's output, and how many
attention calls the processors sent to a fallback.  --compile adds torch.compile'd steps
(fullgraph=True: a graph break is an error) of every backend, or of the named ones (compiling the
full UNet takes minutes per backend).
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict

import torch

from pasa_diffusers.backends import BACKENDS
from pasa_diffusers.metrics import records

from . import harness

NAME = "unet"
LATENT_HEIGHT, LATENT_WIDTH = 72, 128


def make_unet() -> torch.nn.Module:
    """SVD-XT's UNet with random weights, fp16, on the GPU, in eval mode."""
    from pasa_diffusers.pipelines.svd import load_svd

    return load_svd("svd-xt-random", device="cuda", dtype=torch.float16).unet.eval()


def make_inputs(frames: int, batch: int = 2) -> dict:
    """One step's inputs: latents (and the conditioning image's latents) of ``frames`` frames, a
    timestep, the image embedding, the added time ids."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    shape = (batch, frames, 8, LATENT_HEIGHT, LATENT_WIDTH)
    return {"sample": torch.randn(shape, device="cuda", dtype=torch.float16, generator=gen),
            "timestep": torch.tensor(0.7, device="cuda"),
            "encoder_hidden_states": torch.randn(batch, 1, 1024, device="cuda", dtype=torch.float16, generator=gen),
            "added_time_ids": torch.tensor([[6.0, 127.0, 0.02]] * batch, device="cuda", dtype=torch.float16)}


def step_rows(unet: torch.nn.Module, frames: int, args, timer: harness.Timer) -> list[dict]:
    """Every backend (and compiled mode) at ``frames`` frames; the first backend is the baseline."""
    inputs = make_inputs(frames)
    rows = harness.model_runs(unet, args.backends, args.compile,
                              lambda model: model(**inputs, return_dict=False)[0], timer)
    return [{"frames": frames, **row} for row in rows]


def table(rows: Sequence[dict], first: str) -> str:
    """The report's table: one line per (frames, backend, mode) row of :func:`step_rows`."""
    return records.markdown_table(
        ["frames", "backend", "mode", "first call s", "step ms", f"vs {first}", "attention share", "finite",
         f"rel. RMS diff to {first}", "fallback calls"],
        [[r["frames"], r["backend"], r["mode"], f"{r['first_call_s']:.1f}", f"{r['ms']:.1f}", f"{r['vs_first']:.3f}",
          harness.share_text(r["attention_share"]), r["finite"], f"{r['rel_rms_diff']:.2e}", r["fallback_calls"]]
         for r in rows],
        align="rllrrrrlrr")


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(NAME, __doc__)
    p.add_argument("--frames", type=int, nargs="+", default=list(harness.FRAMES), metavar="F",
                   help="frame counts (default: 14 25)")
    p.add_argument("--backends", nargs="+", default=["sdpa", "pasa", "pasa-paper"], choices=list(BACKENDS),
                   metavar="BACKEND", help=f"attention backends, the first is the baseline; of {', '.join(BACKENDS)} "
                   "(default: sdpa pasa pasa-paper)")
    p.add_argument("--compile", nargs="*", default=None, metavar="BACKEND",
                   help="also time torch.compile'd steps: of every backend, or of the named ones")
    p.add_argument("--iters", type=int, default=10, help="timed steps per backend (default: 10)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.compile or ()) - set(args.backends))
    if unknown:
        p.error(f"--compile {' '.join(unknown)}: not among --backends {' '.join(args.backends)}")
    if not torch.cuda.is_available():
        print(f"bench.{NAME}: needs a CUDA GPU (the full-size UNet)", file=sys.stderr)
        return 2

    cmd, env = harness.command(NAME, argv), harness.environment()
    timer = harness.Timer(warmup_ms=0.0, rep_ms=0.0, min_runs=args.iters, flush_l2=False)
    unet = make_unet()
    rows = [r for frames in harness.progress(args.frames, NAME) for r in step_rows(unet, frames, args, timer)]
    text = harness.header("bench.unet: one step of the full-size SVD UNet per attention backend", env, cmd) + "\n" + \
        table(rows, args.backends[0]) + "\n"
    harness.write_report(args.out, NAME, text, {"bench": NAME, "command": cmd, "environment": env,
                                                "timer": asdict(timer), "rows": rows})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
