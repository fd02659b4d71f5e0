"""Which config does each autotuned kernel pick on this GPU: the tuned table to ship for it.

    python -m tools.tune_table --out DIR                                  # SVD fp16 + the video DiTs bf16, our variants
    python -m tools.tune_table --methods exact-hybrid,kernels:exact-hybrid --out DIR
    TRITON_INTERPRET=1 python -m tools.tune_table --shapes tiny --methods exact-hybrid --out DIR   # a CPU

Runs each method once per shape with the shipped tables off (PASA_TUNED=0) and Triton's autotuning disk
cache unread, so every key the autotuned kernels (portable.shift, portable.tiled, packed; the Gluon
kernel has fixed configs) meet is benchmarked here; then writes what each autotuner picked into
DIR/<gpu>.json (<gpu>: torch.cuda.get_device_name normalised, e.g. nvidia-h200): per kernel and tuning
key (the key arguments and the tensor arguments' dtypes) the config's kwargs, num_warps and num_stages,
its time and every benchmarked config's, and the shapes that met the key; with the GPU, the triton
version and this command.  Commit it as pasa_diffusers/kernels/tuned/<gpu>.json: a first launch of a key
in the table then runs its config without benchmarking (pasa_diffusers/kernels/tuning.py); or try it
first with PASA_TUNED=DIR/<gpu>.json.  A key whose prune leaves one config needs no entry.

--shapes video (the default) is SVD-XT's spatial and temporal shapes at --frames in float16 and the video
DiTs' in bfloat16 (as diffusers runs them); the other sets of bench.harness take --dtype.  --methods
takes our methods only (default ours: every variant through the op; kernels:<variant> adds every kernel
path the dispatcher accepts, e.g. the portable kernel where the Gluon kernel is the default).  Under
Triton's interpreter (a CPU) only --shapes tiny runs, autotuned by the wall clock: a test of the
write -> load -> use loop, not a table to ship.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from bench import harness

PACKAGE = "tools"
NAME = "tune_table"
DEFAULT_METHODS = "ours"
VIDEO = "video"
"""The default shape set: SVD's at ``--frames`` in float16, the DiTs' in bfloat16."""


def shape_set(which: str, frames: Sequence[int], dtype: torch.dtype) -> list[tuple[harness.Shape, torch.dtype]]:
    """The (shape, input dtype) pairs of ``--shapes``."""
    if which == VIDEO:
        return ([(s, torch.float16) for s in harness.shapes("svd", frames)]
                + [(s, torch.bfloat16) for s in harness.shapes("dit")])
    return [(s, dtype) for s in harness.shapes(which, frames)]


@contextlib.contextmanager
def retuning() -> Iterator[dict]:
    """Inside: no tuned table (``PASA_TUNED=0``), no autotuner choice remembered, none read from or
    written to Triton's disk cache (every key benchmarked here), and under the interpreter the launchers
    autotune.  Restored after (the choices made inside are kept for :func:`tuning.table_payload`)."""
    from pasa_diffusers.kernels import dispatch, tuning  # noqa: F401  (dispatch: every kernel file, its autotuners)
    from pasa_diffusers.kernels.common import INTERPRET

    tuners = tuning.autotuners()
    saved_env, saved_cache = os.environ.get(tuning.ENV), {n: t.disk_cache for n, t in tuners.items()}
    os.environ[tuning.ENV] = "0"
    tuning.forget()
    for t in tuners.values():
        t.disk_cache = False
    try:
        with tuning.interpreter_autotuning() if INTERPRET else contextlib.nullcontext():
            yield tuners
    finally:
        for n, t in tuners.items():
            t.disk_cache = saved_cache[n]
        if saved_env is None:
            os.environ.pop(tuning.ENV, None)
        else:
            os.environ[tuning.ENV] = saved_env


def tune(pairs: Sequence[tuple[harness.Shape, torch.dtype]], names: Sequence[str], seed: int
         ) -> tuple[dict[tuple[str, tuple], list[str]], list[dict]]:
    """Every method once per (shape, dtype), inside :func:`retuning`'s setting; returns which calls met
    each (autotuner, key) and the calls that failed (shape, method, error)."""
    from pasa_diffusers.kernels import tuning

    methods, kernel_variants, _ = harness.select_methods(names)
    met: dict[tuple[str, tuple], list[str]] = {}
    errors: list[dict] = []
    tuners = tuning.autotuners()
    gen = torch.Generator(device=harness.device()).manual_seed(seed)
    for shape, dtype in harness.progress(pairs, NAME):
        q, k, v = harness.make_inputs(shape, gen, dtype=dtype)
        found = list(methods) + [m for variant in kernel_variants for m in harness.kernel_methods(variant, q, k, v)]
        for m in found:
            label = f"{shape.label} {shape.bhnd} {str(dtype).removeprefix('torch.')} {m.name}"
            for t in tuners.values():
                t.last_key = None
            try:
                m.build(q, k, v).call()
                harness.synchronize()
            except harness.Skip as e:
                errors.append({"call": label, "error": f"skipped: {e}"})
                continue
            except Exception as e:  # noqa: BLE001 - a variant that cannot take these inputs is a row
                errors.append({"call": label, "error": harness.error_text(e)})
                continue
            for name, t in tuners.items():
                if t.last_key is not None:
                    met.setdefault((name, t.last_key), []).append(label)
        del q, k, v
        harness.free_memory()
    return met, errors


def _short(dtype: str) -> str:
    return dtype.removeprefix("torch.").replace("float", "f")


def report_rows(payload: dict) -> list[list[str]]:
    """One line per table entry: kernel, key, dtypes, config, ms, the runner-up's time over it, where met."""
    lines = []
    for e in payload["entries"]:
        cfg = e["config"]
        config = " ".join([*(f"{k}={v}" for k, v in cfg["kwargs"].items()), f"w{cfg['num_warps']}",
                           f"s{cfg['num_stages']}"])
        others = sorted(t for c, t in e["timings_ms"].items() if t is not None and t != e["ms"])
        runner_up = f"{others[0] / e['ms']:.3f}x" if others and e["ms"] else "-"
        more = f" (+{len(e['shapes']) - 1})" if len(e["shapes"]) > 1 else ""
        shapes = e["shapes"][0] + more if e["shapes"] else "-"
        lines.append([e["kernel"], " ".join(f"{k}={v}" for k, v in e["key"].items()),
                      "/".join(_short(d) for d in e["dtypes"]), config, harness.fmt(e["ms"], ".4g"), runner_up,
                      shapes])
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(NAME, __doc__, PACKAGE)
    harness.add_shape_arguments(p, default=VIDEO, choices=(VIDEO, *harness.SHAPE_SETS))
    harness.add_method_arguments(p, DEFAULT_METHODS)
    p.add_argument("--dtype", choices=list(harness.INPUT_DTYPES), default="float16",
                   help=f"the inputs' dtype for a --shapes set other than {VIDEO} (default: float16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    args = p.parse_args(argv)
    theirs = [n for n in args.methods if not harness.runs_ours([n])]
    if theirs:
        print(f"tools.{NAME}: --methods takes our methods only (ours, kernels:<variant>), got {theirs}",
              file=sys.stderr)
        return 2
    problem = harness.cpu_problem(NAME, PACKAGE)
    if problem is None and not torch.cuda.is_available() and args.shapes != "tiny":
        problem = f"tools.{NAME}: on a CPU (Triton's interpreter) only --shapes tiny runs, got --shapes {args.shapes}"
    if problem:
        print(problem, file=sys.stderr)
        return 2

    from pasa_diffusers.kernels import tuning
    from pasa_diffusers.metrics import records

    cmd, env = harness.command(NAME, argv, PACKAGE), harness.environment()
    gpu = tuning.device_gpu(torch.device(harness.device()))
    pairs = shape_set(args.shapes, args.frames, harness.INPUT_DTYPES[args.dtype])
    with retuning() as tuners:
        met, errors = tune(pairs, args.methods, args.seed)
        source = {"command": cmd, "date": env["date"],
                  **{k: env[k] for k in ("torch", "cuda", "capability", "device") if k in env}}
        payload = tuning.table_payload(gpu, source, met)
        single = [{"kernel": name, "key": t.split_key(key)[0], "dtypes": t.split_key(key)[1]}
                  for name, t in tuners.items() for key, how in t.sources.items() if how == "one config"]
    table_path = records.write_json(Path(args.out) / f"{tuning.table_name(gpu)}.json", payload)
    harness.log(f"wrote {table_path}: {len(payload['entries'])} entries")

    text = harness.header(f"tools.{NAME}: the autotuned kernels' picks on {gpu}", env, cmd)
    use = ("a test of the loop under Triton's interpreter, not a table to ship" if gpu == tuning.INTERPRETER_TABLE
           else f"commit it as `pasa_diffusers/kernels/tuned/{table_path.name}`, or try it first with "
                f"`PASA_TUNED={table_path}`")
    text += (f"\nThe table: `{table_path}` ({len(payload['entries'])} entries; {use}).  ms: the picked config's "
             "benchmark; runner-up: the next config's time over it.\n\n")
    text += records.markdown_table(["kernel", "key", "dtypes", "config", "ms", "runner-up", "met at"],
                                   report_rows(payload), align="llllrrl") + "\n"
    if single:
        text += "\nKeys whose prune leaves one config (no entry needed):\n\n" + records.markdown_table(
            ["kernel", "key", "dtypes"], [[s["kernel"], " ".join(f"{k}={v}" for k, v in s["key"].items()),
                                           "/".join(_short(d) for d in s["dtypes"])] for s in single],
            align="lll") + "\n"
    if errors:
        text += "\nCalls that did not run:\n\n" + records.markdown_table(
            ["call", "error"], [[e["call"], e["error"]] for e in errors], align="ll") + "\n"
    harness.write_report(args.out, NAME, text, {"tool": NAME, "command": cmd, "environment": env,
                                                "table_path": str(table_path), "table": payload,
                                                "one_config": single, "errors": errors})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
