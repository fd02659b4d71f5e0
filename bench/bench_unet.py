"""One denoising step of the full-size SVD UNet with SDPA and with PASA attention processors.

The UNet is ``UNetSpatioTemporalConditionModel()`` with diffusers' default config (= SVD's: block
channels 320/640/1280/1280, heads 5/10/20/20, head dim 64), random weights, fp16, 72x128 latents
(576x1024 video), classifier-free guidance (batch 2), F frames.  For each attention backend it
reports the step time (median of CUDA-event timings after warm-up), the share of the step spent in
attention kernels (torch.profiler, kernels whose name matches an attention kernel), whether the
output is finite, and the output difference to SDPA's.  ``--compile`` adds ``torch.compile``d steps
(``fullgraph=True``: a graph break is an error) for every backend, ``--compile pasa`` for the named
ones only (compiling the full UNet takes minutes per backend).

    python bench/bench_unet.py --frames 14 25 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pasa_diffusers import install  # noqa: E402

ATTENTION_KERNELS = ("pasa_fwd", "packed_fwd", "exact_fwd", "centre_k", "shift_k", "flash", "fmha", "cudnn",
                     "attention", "sdpa", "mha")
"""Substrings of the CUDA kernel names counted as attention: ours (the loop, packed, Gluon and TMA kernels and
the key pre-passes) and SDPA's backends."""


def make_unet() -> torch.nn.Module:
    from diffusers import UNetSpatioTemporalConditionModel

    torch.manual_seed(0)
    return UNetSpatioTemporalConditionModel().to("cuda", torch.float16).eval()


def make_inputs(frames: int, batch: int = 2, height: int = 72, width: int = 128) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(1)
    return {
        "sample": torch.randn(batch, frames, 8, height, width, device="cuda", dtype=torch.float16, generator=gen),
        "timestep": torch.tensor(0.7, device="cuda"),
        "encoder_hidden_states": torch.randn(batch, 1, 1024, device="cuda", dtype=torch.float16, generator=gen),
        "added_time_ids": torch.tensor([[6.0, 127.0, 0.02]] * batch, device="cuda", dtype=torch.float16),
    }


def time_step(fn, inputs: dict, warmup: int = 3, iters: int = 10) -> tuple[float, torch.Tensor]:
    with torch.no_grad():
        for _ in range(warmup):
            out = fn(**inputs, return_dict=False)[0]
        times = []
        for _ in range(iters):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(**inputs, return_dict=False)[0]
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
    return statistics.median(times), out


def attention_share(fn, inputs: dict) -> tuple[float, float]:
    """(attention kernel ms, all kernel ms) of one step, from torch.profiler's CUDA kernel times."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(**inputs, return_dict=False)
        torch.cuda.synchronize()
    attn = total = 0.0
    for evt in prof.key_averages():
        t = evt.self_device_time_total / 1000.0
        total += t
        if any(key in evt.key.lower() for key in ATTENTION_KERNELS):
            attn += t
    return attn, total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, nargs="+", default=[14, 25])
    parser.add_argument("--backends", nargs="+", default=["sdpa", "pasa", "pasa-paper"])
    parser.add_argument("--compile", nargs="*", default=None, metavar="BACKEND",
                        help="also time torch.compile'd steps: of every backend, or of the named ones")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="out/bench_unet")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    unet = make_unet()
    rows = []
    for frames in args.frames:
        inputs = make_inputs(frames)
        baseline = None
        for backend in args.backends:
            install.apply(unet, backend)
            modes = [("eager", unet)]
            if args.compile is not None and (not args.compile or backend in args.compile):
                modes.append(("compile", torch.compile(unet, fullgraph=True)))
            for mode, fn in modes:
                ms, out = time_step(fn, inputs, iters=args.iters)
                attn_ms, kernel_ms = attention_share(fn, inputs) if mode == "eager" else (float("nan"),) * 2
                if baseline is None:
                    baseline = (ms, out.float())
                diff = (out.float() - baseline[1]).abs()
                rows.append({
                    "frames": frames, "backend": backend, "mode": mode, "step_ms": ms,
                    "ratio_to_sdpa": ms / baseline[0], "attention_ms": attn_ms, "kernels_ms": kernel_ms,
                    "attention_share": attn_ms / kernel_ms if kernel_ms == kernel_ms else float("nan"),
                    "finite": bool(torch.isfinite(out).all()),
                    "max_abs_diff_to_sdpa": diff.max().item(),
                    "rel_rms_diff_to_sdpa": (diff.pow(2).mean().sqrt() / baseline[1].pow(2).mean().sqrt()).item(),
                    "fallbacks": install.fallback_summary(unet)["fallbacks"],
                })
                print(json.dumps(rows[-1]), flush=True)
            install.restore(unet)
            torch._dynamo.reset()

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    (out_dir / "bench_unet.json").write_text(json.dumps({"env": env, "rows": rows}, indent=2))
    lines = ["| frames | backend | mode | step ms | x SDPA | attention ms (share) | finite | rel RMS diff to SDPA |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        share = "-" if r["mode"] != "eager" else f"{r['attention_ms']:.1f} ({100 * r['attention_share']:.0f}%)"
        lines.append(f"| {r['frames']} | {r['backend']} | {r['mode']} | {r['step_ms']:.1f} | {r['ratio_to_sdpa']:.3f} "
                     f"| {share} | {r['finite']} | {r['rel_rms_diff_to_sdpa']:.2e} |")
    table = "\n".join(lines)
    (out_dir / "bench_unet.md").write_text(f"{env}\n\n{table}\n")
    print(env)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
