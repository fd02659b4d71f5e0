"""``pasa`` command line: parse arguments, call library functions, print."""
from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _progress(desc: str):
    from tqdm.auto import tqdm

    return lambda items: tqdm(list(items), desc=desc, unit="cell", file=sys.stderr)


def _write_rows(rows: list[dict], out: Path, stem: str) -> None:
    with open(out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=2))


def cmd_numerics(args: argparse.Namespace) -> int:
    from . import numerics
    from .beta import optimal_beta

    shape = numerics.QUICK_SHAPE if args.quick else numerics.PAPER_SHAPE
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    v_mean = 0.0 if args.zero_mean_v else None
    rows = numerics.run_study(shape=shape, v_mean=v_mean, progress=_progress("numerics"))
    betas = [0.5] + [optimal_beta(start=1 - 2.0 ** -e) for e in (4, 5, 6)]
    sweep_cells = [("uniform", 0.0, 5.0), ("uniform", 10.0, 0.5), ("uniform", 30.0, 0.5), ("hybrid", 30.0, 10.0)]
    sweep = numerics.beta_sweep(betas, sweep_cells, shape=shape, v_mean=v_mean)
    stress = numerics.run_stress()
    seconds = time.perf_counter() - start

    _write_rows([r.as_dict() for r in rows], out, "numerics")
    _write_rows(sweep, out, "beta_sweep")
    _write_rows(stress, out, "stress")
    numerics.plot_error_vs_bias(rows, out / "error_vs_bias.png")
    paper_table = numerics.study_table(rows, "rel_rmse_v")
    output_table = numerics.study_table(rows, "rel_rmse")
    sweep_table = numerics.sweep_table(sweep)
    command = ("pasa numerics" + (" --quick" if args.quick else "") + (" --zero-mean-v" if args.zero_mean_v else "")
               + f" --out {args.out}")
    v_note = ", zero-mean V ~ N(0, 1)" if args.zero_mean_v else ""
    text = (f"# PASA numerics ({command}{v_note})\n\nshape (B, Hq, Hk, N, D) = {shape}, fp16 inputs, seed "
            f"{numerics.PAPER_SEED}, {seconds:.0f} s\n\n"
            f"## RMSE / RMS(V) (the paper's metric)\n\n{paper_table}\n\n"
            f"## RMSE / RMS(golden output)\n\n{output_table}\n\n"
            f"## PASA half: RMSE / RMS(golden output) against beta\n\n{sweep_table}\n\n"
            f"## Stress cases (1, 2, 1, 300, 128), V ~ N(0, 1): RMSE / RMS(golden output)\n\n"
            f"{numerics.stress_table(stress)}\n\n![error against bias](error_vs_bias.png)\n")
    (out / "numerics.md").write_text(text)
    print(text)
    print(f"wrote {out / 'numerics.md'}, numerics.csv/json, beta_sweep.csv/json, stress.csv/json, "
          "error_vs_bias.png")
    return 0


def _dtype(device: str, name: str | None):
    import torch

    if name is None:
        return torch.float16 if torch.device(device).type == "cuda" else torch.float32
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


def _finite_note(frames) -> str:
    import numpy as np

    bad = np.flatnonzero(~np.isfinite(frames).all(axis=(1, 2, 3)))
    return "all frames finite" if bad.size == 0 else f"NON-FINITE frames: {bad.size} (first index {bad[0]})"


def cmd_generate(args: argparse.Namespace) -> int:
    import metrics
    from pipelines.compare import backend_options
    from pipelines.svd import generate, load_image, load_svd

    from . import processors

    dtype = _dtype(args.device, args.dtype)
    pipe = load_svd(args.model, device=args.device, dtype=dtype, local_files_only=args.local_files_only)
    summary = processors.apply(pipe, args.attention, **backend_options(args.attention, dtype))
    image = load_image(args.image, (args.width, args.height))
    frames = generate(pipe, image, num_frames=args.frames, num_inference_steps=args.steps, seed=args.seed,
                      height=args.height, width=args.width)
    out = Path(args.out)
    written = metrics.write_video(frames, out, args.attention, fps=args.fps)
    print(json.dumps({"installed": summary["counts"], "processors": summary["processors"],
                      "fallbacks": processors.fallback_summary(pipe)["fallbacks"]}, indent=2))
    print(_finite_note(frames))
    for kind, path in written.items():
        print(f"wrote {kind}: {path}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    import metrics
    from pipelines.compare import parse_backends, run_comparison, write_comparison

    backends = parse_backends(args.backends)
    report, videos = run_comparison(model=args.model, backends=backends, image=args.image, num_frames=args.frames,
                                    num_inference_steps=args.steps, seed=args.seed, height=args.height,
                                    width=args.width, device=args.device, dtype=_dtype(args.device, args.dtype),
                                    lpips_weights=args.lpips_weights, local_files_only=args.local_files_only,
                                    command="pasa " + " ".join(sys.argv[1:]))
    written = write_comparison(report, videos, args.out, fps=args.fps)
    print(metrics.format_table(report))
    print(f"wrote {len(written)} outputs under {args.out} (report.md, report.json, plots, videos)")
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    from pipelines.svd import load_image, load_svd

    from .diagnose import diagnose, risk_table, write_diagnosis

    pipe = load_svd(args.model, device=args.device, dtype=_dtype(args.device, args.dtype),
                    local_files_only=args.local_files_only)
    image = load_image(args.image, (args.width, args.height))
    result = diagnose(pipe, image, num_frames=args.frames, num_inference_steps=args.steps, seed=args.seed,
                      height=args.height, width=args.width, progress=True, model=args.model)
    print(risk_table(result))
    for kind, path in write_diagnosis(result, args.out).items():
        print(f"wrote {kind}: {path}")
    return 0


def _add_generation_args(p: argparse.ArgumentParser, out: str, frames: int = 4, steps: int = 4, size: int = 64) -> None:
    p.add_argument("--model", default="tiny",
                   help="'tiny' (embedded random SVD), 'tiny-resonant', a hub id or a save_pretrained folder")
    p.add_argument("--image", default="builtin:rocket",
                   help="conditioning image: a file or builtin:astronaut|coffee|rocket")
    p.add_argument("--frames", type=int, default=frames)
    p.add_argument("--steps", type=int, default=steps, help="denoising steps")
    p.add_argument("--height", type=int, default=size)
    p.add_argument("--width", type=int, default=size)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default=None,
                   help="model dtype (default fp16 on CUDA, fp32 on CPU where attention is still cast to fp16)")
    p.add_argument("--local-files-only", action="store_true", help="never contact the Hugging Face hub")
    p.add_argument("--out", default=out, help="output folder")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pasa", description="PASA: overflow-free FP16 attention for video diffusion")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("numerics", help="the paper's random-input accuracy study of every attention variant")
    p.add_argument("--quick", action="store_true",
                   help="a smaller shape (1, 4, 1, 391, 128) instead of the paper's (1, 28, 4, 1407, 128)")
    p.add_argument("--zero-mean-v", action="store_true",
                   help="draw V ~ N(0, 1) instead of like q and k (errors in the weights are not hidden by V's mean)")
    p.add_argument("--out", default="out/numerics", help="output folder (CSV, JSON, markdown)")
    p.set_defaults(func=cmd_numerics)

    p = sub.add_parser("generate", help="animate an image with SVD using one attention backend")
    _add_generation_args(p, "out/generate")
    p.add_argument("--attention", default="pasa", help="pasa, pasa-hybrid, fp32, naive-half, sdpa or bf16")
    p.add_argument("--fps", type=int, default=7)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("compare", help="score each attention backend's video against the FP32-attention one")
    _add_generation_args(p, "out/compare")
    p.add_argument("--backends", default="pasa,naive-half,sdpa,bf16", help="comma-separated backends")
    p.add_argument("--lpips-weights", default=None,
                   help="torchvision AlexNet ImageNet weights (alexnet-owt-7be5be79.pth); default: torch hub cache")
    p.add_argument("--fps", type=int, default=7)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("diagnose", help="which attention layers overflow in FP16, and why")
    _add_generation_args(p, "out/diagnose", frames=2, steps=2)
    p.set_defaults(func=cmd_diagnose)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
