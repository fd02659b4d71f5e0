"""What do the first attention calls cost in a fresh process, with an empty and with a warm Triton cache?

    python -m bench.cold_start --out DIR

SVD-XT's shape set (576x1024, F = 14 and 25, CFG batch 2: spatial 9216, 2304, 576 and 144 tokens,
temporal 14 and 25 frames) through pasa_attention with its defaults, one call per shape, in four fresh
processes (python -m bench.cold_start --child): the first three share one Triton cache directory, the
first with it empty and the shipped compiled kernels off (PASA_PRECOMPILED=0: compilation and
autotuning), the second and third with what the first left there (what every later process on the
machine pays: compiled kernels and the autotuner's winners read from disk); the fourth starts from
another empty cache with the shipped kernels on (what a fresh machine of a GPU with a bundle pays).  Per
process: the time to import torch and the op, to import the kernels (triton, which the first call
would otherwise pay), the first calls' total and the slowest one (each synchronized), how many keys
the autotuners met that Triton's disk cache did not hold (TRITON_PRINT_AUTOTUNING's "Triton autotuning
for function" lines: printed for a key taken from the shipped tuned table too) and how many configs
they timed ("Autotuning kernel" lines: none for a table's key).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

NAME = "cold_start"
ROOT = Path(__file__).resolve().parents[1]
"""The repository root: the children run ``python -m bench.cold_start`` from there."""
PROCESSES = {"empty cache, no bundle": ("a", "0"), "warm cache": ("a", "0"), "warm cache, again": ("a", "0"),
             "empty cache, the shipped bundle": ("b", "1")}
"""Each fresh process: (the cache folder it shares, ``PASA_PRECOMPILED``): the first three compile into one
cache and reuse it; the last starts from another empty one that the shipped compiled kernels seed
(``kernels/precompiled.py``)."""


def child() -> dict:
    """In a fresh process: import times, then the first call at each SVD shape (wall seconds, synchronized)."""
    start = time.perf_counter()
    import torch

    from pasa_diffusers import pasa_attention

    imported = time.perf_counter() - start
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    import pasa_diffusers.kernels.dispatch  # noqa: F401  (triton and the kernels: the first call's otherwise)

    kernels_imported = time.perf_counter() - start
    from . import harness

    gen = torch.Generator(device="cuda").manual_seed(0)
    first_calls = {}
    for shape in harness.shapes("svd"):
        q, k, v = (t.transpose(1, 2) for t in harness.make_inputs(shape, gen))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pasa_attention(q, k, v, layout="bnhd")
        torch.cuda.synchronize()
        first_calls[f"{shape.label} {shape.bhnd}"] = time.perf_counter() - t0
    from pasa_diffusers.kernels import precompiled

    return {"import_s": imported, "kernel_import_s": kernels_imported, "first_call_s": first_calls,
            "total_s": sum(first_calls.values()), "seeded": precompiled.seed_cache(torch.device("cuda"))}


def run_processes() -> dict[str, dict]:
    """:func:`child` in each of :data:`PROCESSES`, in fresh Triton cache directories."""
    from . import harness

    results = {}
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        for label, (cache, seeding) in harness.progress(list(PROCESSES.items()), NAME):
            env = {**os.environ, "TRITON_CACHE_DIR": {"a": a, "b": b}[cache], "TRITON_PRINT_AUTOTUNING": "1",
                   "PASA_PRECOMPILED": seeding}
            run = subprocess.run([sys.executable, "-m", "bench.cold_start", "--child"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, check=True)
            results[label] = json.loads(run.stdout.strip().splitlines()[-1])
            results[label]["autotuning_runs"] = run.stdout.count("Triton autotuning for function")
            results[label]["configs_timed"] = run.stdout.count("Autotuning kernel ")
    return results


def _seeded_text(seeded: dict) -> str:
    """What ``precompiled.seed_cache`` did: entries copied into the cache (of the bundle's), or why none."""
    if "skipped" in seeded:
        return f"none ({seeded['skipped']})"
    return f"{seeded['installed']} copied ({seeded['installed'] + seeded['present']} in the bundle)"


def main(argv: Sequence[str] | None = None) -> int:
    from . import harness

    p = harness.parser(NAME, __doc__)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child()))
        return 0
    import torch

    from pasa_diffusers.metrics import records

    if not torch.cuda.is_available():
        print(f"bench.{NAME}: needs a CUDA GPU", file=sys.stderr)
        return 2
    cmd, env = harness.command(NAME, argv), harness.environment()
    results = run_processes()
    lines = []
    for label, r in results.items():
        shape, worst = max(r["first_call_s"].items(), key=lambda kv: kv[1])
        lines.append([label, f"{r['import_s']:.2f}", f"{r['kernel_import_s']:.2f}", f"{r['total_s']:.3f}",
                      f"{worst:.3f} s at {shape}", r["autotuning_runs"], r["configs_timed"],
                      _seeded_text(r["seeded"])])
    text = harness.header("bench.cold_start: the first calls at SVD's shapes in fresh processes", env, cmd) + "\n" + \
        records.markdown_table(["process", "import torch + op s", "import kernels s", "first calls, total s",
                                "slowest first call", "keys tuned", "configs timed", "shipped kernels"], lines) + "\n"
    harness.write_report(args.out, NAME, text, {"bench": NAME, "command": cmd, "environment": env,
                                                "processes": results})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
