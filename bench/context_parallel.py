"""One forward of a full-size video transformer on 1 and N GPUs under diffusers' context parallelism, PASA and SDPA.

    python -m bench.context_parallel --out DIR                                           # 1 GPU: the 1-GPU rows only
    torchrun --standalone --nproc-per-node 2 -m bench.context_parallel --out DIR         # 1 and 2 GPUs: Ulysses, ring
    torchrun --standalone --nproc-per-node 4 -m bench.context_parallel --modes ulysses ring ulysses+ring --out DIR
    torchrun --standalone --nproc-per-node 2 -m bench.context_parallel --model tiny-wan --out DIR   # a CPU (gloo)

The transformer of ``pipelines.video_dits`` (default ``wan2.1-14b``: Wan 2.1 14B from its released config,
random weights, bf16 on the GPU, at 720p and 81 frames: 75,600 video tokens; ``--batch 1``, one of the two
forwards a guided step makes; or a ``tiny-<family>`` one, fp32, anywhere).  Every rank first runs the
1-GPU rows on its own GPU (the same work; rank 0 reports), then, per ``--modes`` entry, a fresh model
with ``parallel.enable_parallelism(model, ContextParallelConfig(...))``: ``ulysses`` (Ulysses degree =
the world size), ``ring`` (ring degree = the world size), ``ulysses+ring`` (ring degree 2, Ulysses the
rest).  Backends (``--backends``): ``pasa`` (``install.apply(model, "pasa")``: diffusers' schedule with
``pasa_attention`` as its local op) and ``sdpa`` (no ``apply``: the model's own processors on diffusers'
attention backend ``--sdpa-backend``, default ``_native_cudnn`` on CUDA, which has the LSE the ring needs,
and ``native`` on a CPU, which has none: its ring rows are skipped there, saying so, ``NO_LSE``).  Columns:
GPUs, mode, backend, forward ms (the timer's median over ``--iters`` forwards after one untimed one; the
slowest rank's), peak memory of each GPU over the forward (GiB, weights included), the relative RMS
difference of the output to the same backend on 1 GPU and to SDPA on 1 GPU, finite, and, summed over the
row's forwards, the fallback calls and the schedules of the context-parallel calls
(``parallel.schedule_summary``), or the error.  On CPUs the table counts processes, not GPUs ("1 process"
rows), and has no peak-memory column.  Launch with NCCL on GPUs (``pipelines.distributed.session`` picks
it), gloo on CPUs; ``docs/PARALLEL.md``.
"""
from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch

from pasa_diffusers import install, parallel
from pasa_diffusers.metrics import records
from pasa_diffusers.pipelines.distributed import Dist, session
from pasa_diffusers.pipelines.video_dits import (FULL_SIZE, RESOLUTIONS, example_inputs, full_size_inputs,
                                                 full_size_transformer, tiny_transformer)

from . import harness

NAME = "context_parallel"
MODELS = tuple(name for name, (_, _, family) in FULL_SIZE.items() if family == "wan") + tuple(
    f"tiny-{family}" for family in ("wan", "ltx-video"))
MODES = ("ulysses", "ring", "ulysses+ring")
BACKENDS = ("sdpa", "pasa")


def degrees(mode: str, world_size: int) -> dict[str, int]:
    """The ``ContextParallelConfig`` arguments of ``mode`` on ``world_size`` ranks."""
    if mode == "ulysses":
        return {"ulysses_degree": world_size}
    if mode == "ring":
        return {"ring_degree": world_size}
    if world_size % 2 or world_size < 4:
        raise ValueError(f"--modes ulysses+ring: needs an even world size of at least 4, got {world_size}")
    return {"ring_degree": 2, "ulysses_degree": world_size // 2}


def make_model(name: str, device: str) -> torch.nn.Module:
    """A full-size model in bf16 on ``device`` (seeded: the same weights on every rank), or a tiny one in fp32."""
    if name.startswith("tiny-"):
        return tiny_transformer(name.removeprefix("tiny-")).to(device)
    return full_size_transformer(name, device=device, dtype=torch.bfloat16)


def make_inputs(name: str, model: torch.nn.Module, resolution: str, frames: int, batch: int,
                device: str) -> dict[str, Any]:
    """One forward's inputs, the same on every rank (the model's plan shards them)."""
    if name.startswith("tiny-"):
        family = name.removeprefix("tiny-")
        inputs = example_inputs(family, model, torch.Generator().manual_seed(1), batch=batch)
        if family == "ltx-video":  # its plan shards the text: 8 tokens, all kept
            text = inputs["encoder_hidden_states"]
            inputs["encoder_hidden_states"] = torch.cat([text, text[:, :8 - text.shape[1]]], dim=1)
            inputs["encoder_attention_mask"] = torch.ones(batch, 8, dtype=torch.long)
        return {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    return full_size_inputs(name, model, resolution, batch=batch, frames=frames)


def _peak_gib(fn: Callable[[], Any]) -> float | None:
    """The peak GPU memory allocated during one call of ``fn``, weights included, GiB (``None`` on a CPU)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2 ** 30


def _rel_rms(out: torch.Tensor, ref: torch.Tensor | None) -> float | None:
    if ref is None:
        return None
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def run_backend(model: torch.nn.Module, backend: str, sdpa_backend: str, inputs: dict[str, Any],
                timer: harness.Timer) -> dict[str, Any]:
    """One backend on ``model`` (parallel or not): ms, peak GiB, the output (float, on the CPU), counters."""
    if backend == "pasa":
        install.apply(model, "pasa")
    else:
        model.set_attention_backend(sdpa_backend)

    def run() -> torch.Tensor:
        return model(**inputs)[0]

    try:
        with torch.no_grad():
            out = run().float().cpu()
            ms = timer(run)
            peak = _peak_gib(run)
        summary = install.fallback_summary(model) if backend == "pasa" else None
        schedules = parallel.schedule_summary(model) if backend == "pasa" else {}
        return {"ms": ms, "peak_gib": peak, "out": out, "finite": bool(torch.isfinite(out).all()),
                "fallback_calls": None if summary is None else summary["fallback_calls"],
                "fallbacks": {} if summary is None else summary["fallbacks"], "schedules": schedules, "error": ""}
    except Exception as error:  # noqa: BLE001 - a backend that cannot run is a row, not the end of the run
        return {"ms": None, "peak_gib": None, "out": None, "finite": None, "fallback_calls": None, "fallbacks": {},
                "schedules": {}, "error": harness.error_text(error)}
    finally:
        if backend == "pasa":
            install.restore(model)
        harness.free_memory()


def _gathered(dist: Dist, value: Any) -> list[Any]:
    """``value`` of every rank (``[value]`` for one process)."""
    if dist.world_size == 1:
        return [value]
    import torch.distributed

    values = [None] * dist.world_size
    torch.distributed.all_gather_object(values, value)
    return values


def unit(device: str) -> str:
    """What one rank runs on: ``"GPU"`` for CUDA, ``"process"`` on the CPU (gloo)."""
    return "GPU" if device.startswith("cuda") else "process"


def single_mode(device: str) -> str:
    """The label of the rows without parallelism (each rank on its own): ``"1 GPU"`` or ``"1 process"``."""
    return f"1 {unit(device)}"


NO_LSE = {"native": "diffusers' native backend has no log-sum-exp"}
"""Diffusers attention backends that cannot run the ring (which merges chunks by their LSE), and why.  Their ring
rows are refused before the run: the ring all-gathers the keys first and its first chunk then fails, leaving that
collective unwaited (torch warned at exit of an unwaited collective on every rank)."""


def ring_problem(mode: str, backend: str, sdpa_backend: str) -> str | None:
    """Why ``backend`` cannot run in ``mode``, or ``None``: an SDPA backend without an LSE in a ring mode."""
    if backend == "pasa" or "ring" not in mode or sdpa_backend not in NO_LSE:
        return None
    return (f"skipped: {NO_LSE[sdpa_backend]}, which the ring merges chunks by (--sdpa-backend {sdpa_backend}; "
            "on CUDA _native_cudnn has one)")


def mode_rows(dist: Dist, mode: str, args, timer: harness.Timer, single: dict[str, torch.Tensor | None]) -> list[dict]:
    """The rows of one parallel mode (``single_mode``: no parallelism, each rank on its own), every backend."""
    from diffusers import ContextParallelConfig

    model = make_model(args.model, dist.device)
    inputs = make_inputs(args.model, model, args.resolution, args.frames, args.batch, dist.device)
    ranks_used = 1
    if mode != single_mode(dist.device):
        ranks_used = dist.world_size
        model.set_attention_backend(args.sdpa_backend)  # what enable_parallelism checks for context parallelism
        parallel.enable_parallelism(model, ContextParallelConfig(**degrees(mode, dist.world_size)))
    rows = []
    for backend in args.backends:
        problem = ring_problem(mode, backend, args.sdpa_backend)
        result = run_backend(model, backend, args.sdpa_backend, inputs, timer) if problem is None else {
            "ms": None, "peak_gib": None, "out": None, "finite": None, "fallback_calls": None, "fallbacks": {},
            "schedules": {}, "error": problem}
        ranks = _gathered(dist, {k: result[k] for k in ("ms", "peak_gib", "error")})
        out = result.pop("out")
        if mode == single_mode(dist.device):
            single[backend] = out
        ms = [r["ms"] for r in ranks]
        rows.append({"ranks": ranks_used, "mode": mode, "backend": backend if backend == "pasa" else f"sdpa ({args.sdpa_backend})",
                     **result, "ms": None if None in ms else max(ms), "peak_gib_per_rank": [r["peak_gib"] for r in ranks],
                     "errors": sorted({r["error"] for r in ranks if r["error"]}),
                     "rel_rms_vs_one_same": None if out is None else _rel_rms(out, single.get(backend)),
                     "rel_rms_vs_one_sdpa": None if out is None else _rel_rms(out, single.get("sdpa"))})
        label = "" if rows[-1]["ms"] is None else f"{rows[-1]['ms']:.1f} ms"
        if dist.is_main:
            harness.log(f"{mode} {backend}: {label or rows[-1]['errors']}")
    del model, inputs
    gc.collect()
    harness.free_memory()
    return rows


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def report(rows: list[dict], title: str, env: dict, cmd: str, device: str = "cuda") -> str:
    """The markdown report: on CUDA a row per (GPUs, mode, backend) with each GPU's peak memory; on the CPU the
    same per processes, without the peak (a CPU has no GPU memory to measure)."""
    one, gpu = single_mode(device), device.startswith("cuda")
    columns = [f"{unit(device)}{'s' if gpu else 'es'}", "mode", "backend", "forward ms"]
    columns += ["peak GiB per GPU"] if gpu else []
    columns += [f"rel. RMS vs same, {one}", f"rel. RMS vs SDPA, {one}", "finite", "fallback calls", "schedules / error"]
    table = []
    for r in rows:
        cells = [r["ranks"], r["mode"], r["backend"], _fmt(r["ms"], ".1f")]
        cells += [" / ".join(_fmt(g, ".2f") for g in r["peak_gib_per_rank"])] if gpu else []
        cells += [_fmt(r["rel_rms_vs_one_same"], ".2e"), _fmt(r["rel_rms_vs_one_sdpa"], ".2e"),
                  "-" if r["finite"] is None else r["finite"], "-" if r["fallback_calls"] is None else r["fallback_calls"],
                  "; ".join(r["errors"]) or ", ".join(f"{k} {v}" for k, v in sorted(r["schedules"].items())) or "-"]
        table.append(cells)
    align = "rllr" + ("r" if gpu else "") + "rrlrl"
    return harness.header(title, env, cmd) + "\n" + records.markdown_table(columns, table, align=align) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(NAME, __doc__)
    p.add_argument("--model", default="wan2.1-14b", choices=MODELS, help="the transformer (default: wan2.1-14b)")
    p.add_argument("--resolution", default="720p", choices=list(RESOLUTIONS), help="Wan's video size (default: 720p)")
    p.add_argument("--frames", type=int, default=81, help="video frames, 4k + 1 (default: 81)")
    p.add_argument("--batch", type=int, default=1, help="batch of the forward (default: 1)")
    p.add_argument("--modes", nargs="+", default=["ulysses", "ring"], choices=MODES,
                   help="context-parallel modes under torchrun (default: ulysses ring)")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS,
                   help="attention backends (default: sdpa pasa)")
    p.add_argument("--sdpa-backend", default=None, metavar="NAME",
                   help="diffusers' attention backend of the sdpa rows (default: _native_cudnn on CUDA, native on a CPU)")
    p.add_argument("--iters", type=int, default=1, help="timed forwards per row (default: 1)")
    args = p.parse_args(argv)
    if not args.model.startswith("tiny-") and not torch.cuda.is_available():
        print(f"bench.{NAME}: --model {args.model} needs CUDA GPUs (the full-size transformer); "
              "--model tiny-wan runs anywhere", file=sys.stderr)
        return 2
    if (args.frames - 1) % 4:
        p.error(f"--frames {args.frames}: Wan takes 4k + 1 frames")
    args.sdpa_backend = args.sdpa_backend or ("_native_cudnn" if torch.cuda.is_available() else "native")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)

    cmd, env = harness.command(NAME, argv), harness.environment()
    timer = harness.Timer(warmup_ms=0.0, rep_ms=0.0, min_runs=args.iters, flush_l2=False)
    with session(device) as dist:
        if dist.world_size > 1:
            for mode in args.modes:
                degrees(mode, dist.world_size)  # a bad mode fails before any work
        single: dict[str, torch.Tensor | None] = {}
        rows = mode_rows(dist, single_mode(device), args, timer, single)
        if dist.world_size > 1:
            for mode in args.modes:
                rows += mode_rows(dist, mode, args, timer, single)
        elif dist.is_main:
            harness.log(f"bench.{NAME}: one process: the 1-GPU rows only (launch with torchrun for the parallel ones)")
    if not dist.is_main:
        return 0
    shape = (f"{args.resolution}, {args.frames} frames" if not args.model.startswith("tiny-")
             else "its own size and frames")  # a tiny model's inputs are its example's, whatever --frames says
    text = report(rows, f"bench.context_parallel: one forward of {args.model} ({shape}, batch {args.batch}) on 1 and "
                        f"{dist.world_size} {'GPUs' if device == 'cuda' else 'processes'}", env, cmd, device)
    harness.write_report(args.out, NAME, text, {"bench": NAME, "command": cmd, "environment": env,
                                                "timer": asdict(timer), "world_size": dist.world_size, "rows": rows})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
