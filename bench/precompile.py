"""Compile the default's kernels on this GPU into a bundle to ship: a fresh machine's first video then compiles nothing.

    python -m bench.precompile --out DIR                    # SVD-XT fp16 + the video DiTs bf16, and one SVD-XT video
    python -m bench.precompile --model none --out DIR       # the attention shapes only

In a fresh process with an empty Triton cache (TRITON_CACHE_DIR a new temporary folder) and the shipped
kernels off (PASA_PRECOMPILED=0), runs pasa_attention with its defaults once per shape of SVD-XT's
shape set at 14 and 25 frames (fp16) and of the video transformers' (bf16), on diffusers' (B, N, H, D)
memory, then --model (default svd-xt-random: the full-size random-weight SVD-XT pipeline, built on the
GPU) through the pasa backend for one 576x1024 step at each of 14 and 25 frames (its cross-attention and
every other shape the UNet calls); then writes what Triton compiled, the metadata JSON and binary of
each kernel and the launchers it built with the host's C compiler, to DIR/<arch>/ with manifest.json
(kernels/precompiled.py).  Commit that folder as
pasa_diffusers/kernels/compiled/<arch>/ (sm_90: it serves every GPU of the architecture);
bench.cold_start's last process and bench.video measure what it saves.  The bundle matches only the Triton build it was made with (its key covers Triton's files and
libtriton: the same wheel, so the same Python version); other builds compile as before.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from . import harness

NAME = "precompile"
ROOT = Path(__file__).resolve().parents[1]


def child(model: str) -> dict:
    """In the fresh process: the op at every shape, then the pipeline; returns the shapes run."""
    import torch

    from pasa_diffusers import pasa_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    ran = []
    for shapes, dtype in ((harness.shapes("svd"), torch.float16), (harness.shapes("dit"), torch.bfloat16)):
        for shape in shapes:
            q, k, v = (t.transpose(1, 2) for t in harness.make_inputs(shape, gen, dtype=dtype))
            pasa_attention(q, k, v, layout="bnhd")
            ran.append(f"{shape.label} {shape.bhnd} {str(dtype).removeprefix('torch.')}")
            del q, k, v
    if model != "none":
        from pasa_diffusers import install
        from pasa_diffusers.pipelines.svd import generate, load_image, load_svd

        pipe = load_svd(model, device="cuda", dtype=torch.float16)
        install.apply(pipe, "pasa")
        image = load_image("builtin:rocket", (1024, 576))
        for frames in (14, 25):
            generate(pipe, image, num_frames=frames, num_inference_steps=1, seed=0, height=576, width=1024,
                     progress=False)
            ran.append(f"{model}: one {frames}-frame 576x1024 step")
    torch.cuda.synchronize()
    return {"ran": ran}


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(NAME, __doc__)
    p.add_argument("--model", default="svd-xt-random",
                   help="svd-xt-random, a hub id, a save_pretrained folder, or none (default: svd-xt-random)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model)))
        return 0
    import torch

    from pasa_diffusers.kernels import precompiled
    from pasa_diffusers.metrics import records

    if not torch.cuda.is_available():
        print(f"bench.{NAME}: needs a CUDA GPU (it compiles for the GPU it runs on)", file=sys.stderr)
        return 2
    cmd, env = harness.command(NAME, argv), harness.environment()
    gpu = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory() as cache:
        child_env = {**os.environ, "TRITON_CACHE_DIR": cache, precompiled.ENV: "0"}
        child_env.pop("TRITON_CACHE_MANAGER", None)
        run = subprocess.run([sys.executable, "-m", f"bench.{NAME}", "--child", "--model", args.model], cwd=ROOT,
                             env=child_env, capture_output=True, text=True)
        if run.returncode != 0:
            print(run.stderr[-4000:], file=sys.stderr)
            return 1
        ran = json.loads(run.stdout.strip().splitlines()[-1])["ran"]
        arch = precompiled.arch_name(torch.cuda.get_device_capability())
        out = Path(args.out) / arch
        manifest = precompiled.write_bundle(Path(cache), out, arch=arch, gpu=gpu, provenance={
            "python": env["python"], "torch": env["torch"], "cuda": env["cuda"], "command": cmd, "date": env["date"],
            "ran": ran})
    rows = []
    for key, names in manifest["entries"].items():
        metadata = [n for n in names if n.endswith(".json")]
        name = json.loads((out / key / metadata[0]).read_text())["name"] if metadata else f"launcher {names[0]}"
        size = sum((out / key / n).stat().st_size for n in names)
        rows.append([name, key[:12], f"{size / 1024:.0f}"])
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    text = harness.header(f"bench.precompile: the default's kernels compiled on {gpu}", env, cmd) + \
        f"\nThe bundle: `{out}` ({len(rows)} entries, {total / 2**20:.2f} MiB; commit it as " \
        f"`pasa_diffusers/kernels/compiled/{out.name}/`), made while running:\n\n" + \
        "".join(f"- {r}\n" for r in ran) + "\n" + records.markdown_table(["kernel", "key", "KiB"], sorted(rows)) + "\n"
    harness.write_report(args.out, NAME, text, {"bench": NAME, "command": cmd, "environment": env,
                                                "bundle": str(out), "manifest": manifest})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
