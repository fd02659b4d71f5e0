"""What does the first video cost on a fresh GPU machine, without and with ``pasa warmup`` first?

    python -m bench.cold_start --out DIR       # SVD-XT (random weights) at 25 frames 576x1024, 25 steps

Each row is one fresh ``python -m pasa_diffusers`` process, timed from its start to its exit (imports, building
the model, the generation, writing the video), with ``TRITON_CACHE_DIR`` an empty folder where a row says so:
what a fresh machine pays, since the package ships no compiled kernels and Triton compiles each on its first
launch into that folder.  In order:

1. ``--baseline``'s first video (default sdpa: no Triton kernel of ours; ``none`` skips it), empty cache;
2. ``--attention``'s first video (default pasa), empty cache A: compiling and autotuning on the way;
3. the same video again, cache A: what every later process on the machine pays;
4. ``pasa warmup`` at the same model and size flags, empty cache B;
5. ``--attention``'s first video after it, cache B: what the first video costs once warmed up.

Per row: wall seconds, the kernels Triton's cache holds after it (``compat.cached_kernels``) and how many that
process added, and whether the process said that it compiled (the commands' one-line notice).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from . import harness

NAME = "cold_start"
ROOT = Path(__file__).resolve().parents[1]
"""The repository root: the processes run ``python -m pasa_diffusers`` from there."""
NOTICE = "pasa: compiling attention kernels"
"""The start of the line a command prints when its first call compiles (``cli/warmup.CompileNotice``)."""


def model_flags(args) -> list[str]:
    """The flags that fix the model and its attention calls, shared by ``generate`` and ``warmup``."""
    return ["--model", args.model, "--frames", str(args.frames), "--height", str(args.height), "--width",
            str(args.width)]


def processes(args, out: Path) -> list[tuple[str, str, list[str]]]:
    """The rows: (label, cache folder name, the ``pasa`` arguments)."""
    video = [*model_flags(args), "--steps", str(args.steps), "--device", "cuda", "--formats", args.formats]
    rows = []
    if args.baseline != "none":
        rows.append((f"{args.baseline}: first video, empty cache", "baseline",
                     ["generate", *video, "--attention", args.baseline, "--out", str(out / "baseline")]))
    first = ["generate", *video, "--attention", args.attention, "--out", str(out / "video")]
    return rows + [
        (f"{args.attention}: first video, empty cache", "a", first),
        (f"{args.attention}: the video again, warm cache", "a", first),
        (f"pasa warmup --attention {args.attention}, empty cache", "b",
         ["warmup", *model_flags(args), "--attention", args.attention]),
        (f"{args.attention}: first video after pasa warmup", "b", first),
    ]


def run_processes(args, scratch: Path) -> list[dict]:
    """Each of :func:`processes` in a fresh process; returns one dict per row."""
    from pasa_diffusers.compat import cached_kernels

    results = []
    for label, cache, argv in harness.progress(processes(args, scratch / "videos"), NAME):
        folder = scratch / f"cache-{cache}"
        folder.mkdir(exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_MANAGER", "TRITON_INTERPRET")}
        env["TRITON_CACHE_DIR"] = str(folder)
        before = cached_kernels(folder)
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "pasa_diffusers", *argv], cwd=ROOT, env=env, capture_output=True,
                             text=True)
        seconds = time.perf_counter() - start
        if run.returncode != 0:
            raise RuntimeError(f"{label}: pasa {' '.join(argv)} exited {run.returncode}:\n{run.stderr[-4000:]}")
        after = cached_kernels(folder)
        results.append({"process": label, "command": "pasa " + " ".join(argv), "cache": cache, "seconds": seconds,
                        "kernels_cached": after, "kernels_added": after - before,
                        "said_compiling": NOTICE in run.stderr})
        harness.log(f"{label}: {seconds:.2f} s, {after - before} kernel(s) compiled")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(NAME, __doc__)
    p.add_argument("--model", default="svd-xt-random", help="the model, as pasa generate takes it (default "
                   "svd-xt-random: SVD-XT's full-size pipeline with random weights, built on the GPU, no download)")
    p.add_argument("--frames", type=int, default=25, help="frames per video (default 25)")
    p.add_argument("--height", type=int, default=576, help="frame height (default 576)")
    p.add_argument("--width", type=int, default=1024, help="frame width (default 1024)")
    p.add_argument("--steps", type=int, default=25, help="denoising steps of each video (default 25)")
    p.add_argument("--attention", default="pasa", help="the backend warmed up and timed (default pasa)")
    p.add_argument("--baseline", default="sdpa", help="the backend of the first row, or none (default sdpa)")
    p.add_argument("--formats", default="png", help="what each video writes, as pasa generate --formats (default "
                   "png: the row times the kernels' compile, not an encoder; mp4 needs imageio-ffmpeg)")
    args = p.parse_args(argv)
    import torch

    from pasa_diffusers.metrics import records

    if not torch.cuda.is_available():
        print(f"bench.{NAME}: needs a CUDA GPU (it times the first video on one)", file=sys.stderr)
        return 2
    cmd, env = harness.command(NAME, argv), harness.environment()
    with tempfile.TemporaryDirectory() as scratch:
        results = run_processes(args, Path(scratch))
    by = {r["process"]: r for r in results}
    first = by[f"{args.attention}: first video, empty cache"]
    warmed = by[f"{args.attention}: first video after pasa warmup"]
    warmup = by[f"pasa warmup --attention {args.attention}, empty cache"]
    lines = [[r["process"], f"{r['seconds']:.2f}", r["kernels_added"], r["kernels_cached"],
              "yes" if r["said_compiling"] else "no"] for r in results]
    text = harness.header(f"bench.cold_start: the first video on a fresh machine, {args.model} at {args.frames} "
                          f"frames {args.width}x{args.height}, {args.steps} steps", env, cmd) + "\n"
    text += records.markdown_table(["process", "wall s", "kernels compiled", "kernels in the cache",
                                    "said it compiles"], lines, align="lrrrl") + "\n"
    text += (f"\nFirst video: {first['seconds']:.2f} s compiling, {warmed['seconds']:.2f} s after `pasa warmup` "
             f"({warmup['seconds']:.2f} s, once per machine).\n")
    if args.baseline != "none":
        base = by[f"{args.baseline}: first video, empty cache"]
        text += (f"Against {args.baseline}'s first video ({base['seconds']:.2f} s): "
                 f"{first['seconds'] / base['seconds']:.2f}x compiling, {warmed['seconds'] / base['seconds']:.2f}x "
                 "after warmup.\n")
    harness.write_report(args.out, NAME, text, {"bench": NAME, "command": cmd, "environment": env,
                                                "processes": results})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
