"""How fast is this checkout's op against another revision's, per precision, shape and input, in one run?

    python -m bench.ab --export HEAD out/base       # here, where git is: HEAD's package, renamed pasa_base
    python -m bench.ab --base out/base --dtype bfloat16 --precisions int8,fp8 --out DIR   # on the GPU
    TRITON_INTERPRET=1 python -m bench.ab --base out/base --shapes tiny --precisions int8 --rounds 2 --out DIR

A kernel change lands with its time measured against the code it replaces, on one machine in one run (issue 43:
each step A/B'd against the step before).  ``--export REV DIR`` writes revision ``REV``'s ``pasa_diffusers`` (``git
archive``; or the package of a checkout folder ``REV`` as its files are) to ``DIR/pasa_base``, its own imports and
its op's ``torch.library`` name renamed, so that both copies import side by side; a GPU machine without git gets
``DIR`` carried to it.  The run times ``pasa_attention`` of the base copy and of this checkout on the same inputs
(diffusers' (B, N, H, D) layout viewed as (B, H, N, D), ``--dtype``), in ``--rounds`` interleaved rounds of one
call each (CUDA events around each call, the order of the two reversed every other round; ``time.perf_counter``
on a CPU) after each has compiled and run ``--warmup`` times, and reports the medians, their ratio, the rate, each
copy's relative RMSE against a float64 golden on ``--golden-rows`` query rows spread over the sequence, and
whether the two outputs are equal bit for bit.  Inputs (``--inputs``): ``normal`` (q, k, v ~ N(0, 1)) and
``wide`` (q, k ~ N(0, 1.5^2), v ~ N(0, 1): the logits spread 2.25x, where more key blocks of the 8-bit precisions
go to 16 bits).  ``--compile-jobs`` processes (4 on a GPU) first run each (copy, precision)'s calls once, in
parallel, so that Triton's cache holds every kernel before the timed process would compile them one by one.
"""
from __future__ import annotations

import argparse
import importlib
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pasa_diffusers import pasa_attention
from pasa_diffusers.numerics import rel_rmse
from pasa_diffusers.variants import KERNEL_PRECISIONS

from . import harness

NAME = "ab"
BASE_PACKAGE = "pasa_base"
INPUTS = {"normal": 1.0, "wide": 1.5}
"""Each input's standard deviation of q and k (v ~ N(0, 1))."""


# ---- the base copy -------------------------------------------------------------------------------

def export(rev: str, dest: str | Path) -> Path:
    """Write ``rev``'s package to ``dest/pasa_base`` and return that folder: ``rev`` a git revision of this
    checkout, or a folder holding a ``pasa_diffusers`` package (copied as it is).  Every ``pasa_diffusers`` in its
    sources becomes ``pasa_base`` and its op's ``torch.library`` namespace ``pasa_base``, so that it imports beside
    this checkout's package."""
    target = Path(dest) / BASE_PACKAGE
    if target.exists():
        raise FileExistsError(f"bench.ab --export: {target} exists; remove it or name another DIR")
    source = Path(rev) / "pasa_diffusers"
    with tempfile.TemporaryDirectory() as tmp:
        if source.is_dir():
            shutil.copytree(source, Path(tmp) / "pasa_diffusers", ignore=shutil.ignore_patterns("__pycache__"))
        else:
            archive = Path(tmp) / "package.tar"
            try:
                done = subprocess.run(["git", "archive", "--format=tar", "-o", str(archive), rev, "pasa_diffusers"],
                                      cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)
            except FileNotFoundError:
                raise ValueError(f"bench.ab --export: rev={rev!r} is not a folder holding pasa_diffusers/, and "
                                 "there is no git here to read a revision with") from None
            if done.returncode:
                raise ValueError(f"bench.ab --export: rev={rev!r} is neither a folder holding pasa_diffusers/ nor "
                                 f"a git revision here ({done.stderr.strip().splitlines()[-1]})")
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data")
        for path in (Path(tmp) / "pasa_diffusers").rglob("*.py"):
            text = re.sub(r"\bpasa_diffusers\b", BASE_PACKAGE, path.read_text())
            path.write_text(text.replace('"pasa::', f'"{BASE_PACKAGE}::'))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(Path(tmp) / "pasa_diffusers"), target)
    return target


def import_base(folder: str | Path):
    """The base copy's ``pasa_attention``, from ``folder/pasa_base`` (:func:`export`)."""
    package = Path(folder) / BASE_PACKAGE
    if not (package / "__init__.py").is_file():
        raise FileNotFoundError(f"bench.ab: --base {folder} holds no {BASE_PACKAGE}/ package; make one with "
                                f"`python -m bench.ab --export REV {folder}`")
    sys.path.insert(0, str(Path(folder).resolve()))
    module = importlib.import_module(BASE_PACKAGE)
    if Path(module.__file__).resolve().parent != package.resolve():
        raise ImportError(f"bench.ab: {BASE_PACKAGE} imports from {module.__file__}, not from {package}")
    return module.pasa_attention


# ---- one comparison ------------------------------------------------------------------------------

@dataclass
class Row:
    """One (shape, inputs, precision): each copy's median ms, ``ratio`` = this / base (< 1: this checkout is
    faster), this checkout's TFLOP/s, each copy's relative RMSE against the float64 golden rows, and whether the two
    outputs are equal bit for bit."""

    shape: str
    bhnd: str
    inputs: str
    precision: str
    base_ms: float
    this_ms: float
    ratio: float
    this_tflops: float
    base_rmse: float
    this_rmse: float
    same_bits: bool


def make_inputs(shape: harness.Shape, spread: float, dtype: torch.dtype, seed: int):
    """q, k ~ N(0, spread^2), v ~ N(0, 1) in diffusers' layout viewed as (B, H, N, D)."""
    gen = torch.Generator(device=harness.device()).manual_seed(seed)
    q, k, v = harness.make_inputs(shape, gen, dtype=torch.float32)
    return (q * spread).to(dtype), (k * spread).to(dtype), v.to(dtype)


def golden_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, out)``: ``rows`` query rows spread over the sequence and their float64 attention, batch by batch."""
    index = torch.linspace(0, q.shape[2] - 1, min(rows, q.shape[2]), device=q.device).round().long()
    group = q.shape[1] // k.shape[1]
    out = []
    for b in range(q.shape[0]):
        qb = q[b, :, index].double()
        kb, vb = (t[b].double().repeat_interleave(group, dim=0) for t in (k, v))
        out.append(torch.softmax(qb @ kb.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1) @ vb)
    return index, torch.stack(out)


def _clock() -> tuple[Callable[[], object], Callable[[object, object], float]]:
    """``(mark, elapsed_ms)``: CUDA events on a GPU, ``time.perf_counter`` on a CPU."""
    if torch.cuda.is_available():
        def mark():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return mark, lambda a, b: a.elapsed_time(b)
    return time.perf_counter, lambda a, b: (b - a) * 1e3


def interleaved_ms(calls: dict[str, Callable[[], torch.Tensor]], rounds: int, warmup: int) -> dict[str, float]:
    """The median ms of each call over ``rounds`` rounds of one call each, the order reversed every other round."""
    mark, elapsed = _clock()
    for _ in range(warmup):
        for call in calls.values():
            call()
    spans: dict[str, list] = {name: [] for name in calls}
    for r in range(rounds):
        for name in (list(calls) if r % 2 == 0 else list(reversed(calls))):
            start = mark()
            calls[name]()
            spans[name].append((start, mark()))
    harness.synchronize()
    return {name: statistics.median(elapsed(a, b) for a, b in pairs) for name, pairs in spans.items()}


def compare(shape: harness.Shape, inputs: str, precisions: Sequence[str], base, dtype: torch.dtype, seed: int,
            rounds: int, warmup: int, golden: int) -> list[Row]:
    """The rows of one shape and input: each precision's base and this checkout's op on the same tensors."""
    q, k, v = make_inputs(shape, INPUTS[inputs], dtype, seed)
    index, gold = golden_rows(q, k, v, golden)
    rows = []
    for precision in precisions:
        calls = {"base": lambda: base(q, k, v, precision=precision),
                 "this": lambda: pasa_attention(q, k, v, precision=precision)}
        outs = {name: call() for name, call in calls.items()}
        ms = interleaved_ms(calls, rounds, warmup)
        rows.append(Row(shape.label, shape.bhnd, inputs, precision, ms["base"], ms["this"], ms["this"] / ms["base"],
                        shape.flops() / ms["this"] * 1e-9, rel_rmse(outs["base"][:, :, index], gold),
                        rel_rmse(outs["this"][:, :, index], gold), torch.equal(outs["base"], outs["this"])))
    return rows


# ---- the report ----------------------------------------------------------------------------------

def table(rows: Sequence[Row]) -> str:
    head = ("| shape | (B, H, N, D) | inputs | precision | base ms | this ms | this / base | TFLOP/s | "
            "rel. RMSE base / this | same bits |\n| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |\n")
    return head + "".join(
        f"| {r.shape} | {r.bhnd} | {r.inputs} | {r.precision} | {r.base_ms:.3f} | {r.this_ms:.3f} | "
        f"**{r.ratio:.3f}** | {r.this_tflops:.0f} | {r.base_rmse:.2e} / {r.this_rmse:.2e} | "
        f"{'yes' if r.same_bits else 'no'} |\n" for r in rows)


def _compile_first(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """``args.compile_jobs`` processes, each running the calls of some (copy, precision) once (``--warm-only``)."""
    jobs = [(copy, precision) for copy in ("base", "this") for precision in args.precisions]
    running = []
    for i in range(args.compile_jobs):
        mine = ",".join(f"{c}:{p}" for c, p in jobs[i::args.compile_jobs])
        if mine:
            running.append(subprocess.Popen([sys.executable, "-m", "bench.ab", *argv, "--warm-only", mine],
                                            cwd=Path(__file__).resolve().parents[1]))
    failed = [p.args[-1] for p in running if p.wait()]
    if failed:
        raise RuntimeError(f"bench.ab: the compiling processes of {failed} failed (their errors above)")


def _warm_only(args: argparse.Namespace, base) -> None:
    attend = {"base": base, "this": pasa_attention}
    for shape in harness.shapes(args.shapes, args.frames):
        for inputs in args.inputs:
            q, k, v = make_inputs(shape, INPUTS[inputs], harness.INPUT_DTYPES[args.dtype], args.seed)
            for item in args.warm_only.split(","):
                copy, precision = item.split(":")
                attend[copy](q, k, v, precision=precision)
            del q, k, v
            harness.free_memory()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = harness.parser(NAME, __doc__)
    p.add_argument("--export", nargs=2, metavar=("REV", "DIR"),
                   help="write REV's package (a git revision, or a checkout folder) to DIR/pasa_base and stop")
    p.add_argument("--base", metavar="DIR", help="the folder --export wrote: the copy to time against")
    harness.add_shape_arguments(p, default="dit")
    harness.add_dtype_argument(p)
    p.add_argument("--precisions", type=harness.name_list(KERNEL_PRECISIONS), default="int8,fp8",
                   help=f"the op's precisions, comma-separated, of {KERNEL_PRECISIONS} (default: int8,fp8)")
    p.add_argument("--inputs", type=harness.name_list(tuple(INPUTS)), default="normal,wide",
                   help=f"the inputs, comma-separated, of {tuple(INPUTS)} (default: both)")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds of one call per copy (default: 15)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per copy after the first (default: 3)")
    p.add_argument("--golden-rows", type=int, default=256, help="query rows of the float64 golden (default: 256)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default: 0)")
    p.add_argument("--compile-jobs", type=int, default=None,
                   help="processes that run every call once first, filling Triton's cache (0: none; default: 4 on "
                        "a GPU, 0 on a CPU)")
    p.add_argument("--warm-only", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.export:
        try:
            print(export(*args.export))
        except (FileExistsError, ValueError) as e:
            print(e, file=sys.stderr)
            return 2
        return 0
    if not args.base:
        p.error("one of --base DIR (a run) or --export REV DIR is required")
    if args.compile_jobs is None:
        args.compile_jobs = 4 if torch.cuda.is_available() else 0
    if args.rounds < 1 or args.warmup < 0 or args.golden_rows < 1 or args.compile_jobs < 0:
        p.error("--rounds and --golden-rows take at least 1, --warmup and --compile-jobs at least 0")
    problem = harness.cpu_problem(NAME)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    try:
        base = import_base(args.base)
    except (FileNotFoundError, ImportError) as e:
        print(e, file=sys.stderr)
        return 2
    if args.warm_only:
        _warm_only(args, base)
        return 0
    cmd, env = harness.command(NAME, argv), harness.environment()
    if args.compile_jobs:
        _compile_first(args, argv)
    work = [(shape, inputs) for shape in harness.shapes(args.shapes, args.frames) for inputs in args.inputs]
    rows: list[Row] = []
    for shape, inputs in harness.progress(work, NAME):
        rows += compare(shape, inputs, args.precisions, base, harness.INPUT_DTYPES[args.dtype], args.seed,
                        args.rounds, args.warmup, args.golden_rows)
        harness.free_memory()
    base_file = sys.modules[BASE_PACKAGE].__file__
    text = (harness.header("This checkout against another revision", env, cmd)
            + f"\nbase: `{base_file}`; this: `{sys.modules['pasa_diffusers'].__file__}`\n\n" + table(rows))
    harness.write_report(args.out, NAME, text, {"bench": NAME, "command": cmd, "environment": env, "base": base_file,
                                                "rows": harness.rows_payload(rows)})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
