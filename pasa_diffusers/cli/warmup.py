"""``pasa warmup``: compile the attention kernels for this GPU ahead of a first video, into Triton's own cache.

Triton compiles each kernel specialisation (a kernel at a dtype, head dim, tile config and argument alignment)
on its first launch, seconds each, and keeps it in its cache directory (``TRITON_CACHE_DIR``, default
``~/.triton/cache``), where every later process on the machine finds it.  The package ships no compiled
kernels: a fresh machine's first video compiles them (``bench.cold_start`` measures what that costs).  This
command makes those first launches now, with a progress bar, so that the first video compiles nothing:

- ``--model M``: one generation with the fewest denoising steps the pipeline takes (1; 2 for LTX-Video and
  Mochi), nothing written, at ``pasa generate``'s size flags and defaults (``--frames``, ``--height``,
  ``--width``, ``--image``, ``--dtype``): the same attention calls, so the same kernels (and the same autotuning
  choices, which Triton's cache keeps too), as ``pasa generate`` with those flags;
- ``--shapes B,H,N,D[,NK[,HK]] ...``: the op once per shape on inputs in diffusers' ``(B, N, H, D)`` memory
  (``layout="bnhd"``, as the processors call it) in ``--dtype``: ``NK`` keys (default ``N``) in ``HK`` key
  heads (default ``H``).

Either runs the kernels of ``--attention`` (a backend that runs ``pasa_attention``).  The other commands that
attend (:data:`ANNOUNCED`) say once, in one line on stderr, when a first call compiles (:func:`announce_compiling`).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, TextIO

from .. import env
from ..backends import BACKENDS
from .common import (IMAGE, MODEL, UsageError, add_generation_args, backend_help, check_image, check_memory,
                     check_model, device, int_range, model_help, requested_sizes)

__all__ = ["ANNOUNCED", "OUR_BACKENDS", "CompileNotice", "add_parser", "announce_compiling", "parse_shape", "run",
           "validate", "fewest_steps", "warm_model", "warm_shapes"]

OUR_BACKENDS = tuple(name for name, backend in BACKENDS.items() if backend.variant is not None)
"""The backends whose attention runs ``pasa_attention``: the ones with kernels to compile."""

ANNOUNCED = ("generate", "compare", "diagnose")
"""The commands that announce a first call's compiling (:func:`announce_compiling`)."""

PACKAGE = __name__.split(".")[0]

_SIZE = int_range(8, multiple_of=8, why="SVD needs multiples of 8")


def parse_shape(text: str) -> tuple[int, int, int, int, int, int]:
    """An argparse ``type=``: ``B,H,N,D`` or ``B,H,N,D,NK`` or ``B,H,N,D,NK,HK`` (positive integers, ``HK``
    dividing ``H``) -> ``(B, H, N, D, NK, HK)``."""
    parts = text.split(",")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (4, 5, 6) or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected B,H,N,D[,NK[,HK]] of positive integers (batch, query heads, "
                                         f"queries, head dim, keys, key heads), got {text!r}")
    b, h, n, d = values[:4]
    nk = values[4] if len(values) > 4 else n
    hk = values[5] if len(values) > 5 else h
    if h % hk:
        raise argparse.ArgumentTypeError(f"{text}: the key heads HK={hk} must divide the query heads H={h}")
    return b, h, n, d, nk, hk


def _generate_svd_defaults() -> dict[str, int]:
    """``pasa generate``'s SVD frames and size (its flags' defaults, read from its own argument set)."""
    scratch = argparse.ArgumentParser()
    add_generation_args(scratch, "", video=True)
    return scratch.get_default("svd_defaults")


def validate(args: argparse.Namespace) -> None:
    """Refuse, before torch is imported: no work named, a CPU device, the interpreter on; then a machine
    without the CUDA device (naming ``--device`` only where it was given; not given, it is ``cuda``) and an unknown
    model or image."""
    if args.model is None and not args.shapes:
        raise UsageError("give --model MODEL (a model's attention calls) or --shapes B,H,N,D ... (the op's), or both")
    given = args.device is not None
    args.device = args.device or "cuda"
    if not args.device.startswith("cuda"):
        raise UsageError(f"--device {args.device}: warmup compiles the kernels for a CUDA GPU (on the CPU they run "
                         "in Triton's interpreter or the PyTorch reference, nothing to compile); use --device cuda")
    if args.shapes and args.dtype == "fp32":
        raise UsageError("--dtype fp32: --shapes runs the kernels on fp16 or bf16 inputs (a model in fp32 has its "
                         "q, k, v cast to fp16: --model with --dtype fp32, or --shapes with --dtype fp16)")
    if env.flag("TRITON_INTERPRET"):
        raise UsageError(f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET']} is set: the kernels would run in "
                         "Triton's interpreter and nothing would compile; unset it")
    import torch

    index = int(args.device.partition(":")[2] or 0)
    if not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: no CUDA device on this machine (torch {torch.__version__}); "
                         "warmup compiles the kernels for the GPU it runs on" if given else
                         f"no CUDA device on this machine (torch {torch.__version__}); warmup compiles the kernels "
                         "for the GPU it runs on, a CUDA device (--device cuda, the default, or cuda:N)")
    if index >= torch.cuda.device_count():
        raise UsageError(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"indices 0..{torch.cuda.device_count() - 1}")
    if args.model is not None:
        check_model(args.model)
        check_image(args.image)
        check_memory(args, requested_sizes(args))


class CompileNotice:
    """A compile listener (``compat.add_compile_listener``) that writes one line to ``stream`` at the first
    kernel of this package that Triton compiles (not one it loads from its cache), then nothing more."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self.said = False

    def __call__(self, module: str, kernel: str, cache_hit: bool) -> None:
        if self.said or cache_hit or not module.startswith(f"{PACKAGE}."):
            return
        self.said = True
        from tqdm import tqdm

        from .. import compat

        where = compat.cache_dir()
        kept = f"Triton keeps them in {where}" if where is not None else "Triton's cache manager keeps them"
        tqdm.write(f"pasa: compiling attention kernels for this GPU (first use of {kernel} at this shape; seconds "
                   f"each, once: {kept}; `pasa warmup` compiles them ahead)", file=self.stream or sys.stderr)


def announce_compiling() -> CompileNotice:
    """From now on in this process, say once when Triton compiles a kernel of this package (:class:`CompileNotice`)."""
    from .. import compat

    notice = CompileNotice()
    compat.add_compile_listener(notice)
    return notice


class _Tally:
    """Counts this package's kernels Triton compiled and loaded from its cache, shown on a progress bar."""

    def __init__(self) -> None:
        self.compiled = 0
        self.cached = 0
        self.bar: Any = None

    def __call__(self, module: str, kernel: str, cache_hit: bool) -> None:
        if not module.startswith(f"{PACKAGE}."):
            return
        if cache_hit:
            self.cached += 1
        else:
            self.compiled += 1
        if self.bar is not None:
            self.bar.set_postfix(compiled=self.compiled, cached=self.cached, refresh=True)


def warm_shapes(shapes: list[tuple[int, ...]], attention: str, dtype: str | None, device: str, bar: Any) -> None:
    """``pasa_attention`` as ``attention`` runs it, once per ``(B, H, N, D, NK, HK)`` of ``shapes``, on random inputs
    in diffusers' ``(B, N, H, D)`` memory (``layout="bnhd"``) in ``dtype`` (``"fp16"`` or ``"bf16"``; ``None``:
    fp16) on ``device``; ``bar`` advances per shape.  A shape the op refuses is a ``UsageError`` naming it."""
    import torch

    from ..ops import pasa_attention

    variant = BACKENDS[attention].variant
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    gen = torch.Generator(device=device).manual_seed(0)
    for b, h, n, d, nk, hk in shapes:
        text = f"{b},{h},{n},{d}" + (f",{nk},{hk}" if (nk, hk) != (n, h) else "")
        bar.set_description(f"warmup {text}")
        q = torch.randn(b, n, h, d, generator=gen, device=device, dtype=torch_dtype)
        k, v = (torch.randn(b, nk, hk, d, generator=gen, device=device, dtype=torch_dtype) for _ in range(2))
        try:
            pasa_attention(q, k, v, precision=variant.precision, shift=variant.shift, layout="bnhd")
        except ValueError as exc:
            raise UsageError(f"--shapes {text}: {exc}") from exc
        if q.is_cuda:
            torch.cuda.synchronize(q.device)
        del q, k, v
        bar.update(1)


def fewest_steps(args: argparse.Namespace, pipe: Any) -> dict[str, int]:
    """``generation_settings`` at the fewest denoising steps ``pipe`` takes (1; 2 for LTX-Video and Mochi)."""
    from .common import generation_settings

    for steps in (1, 2):
        args.steps = steps
        try:
            return generation_settings(args, pipe)
        except UsageError as exc:
            if not str(exc).startswith("--steps"):
                raise
    return generation_settings(args, pipe)


def warm_model(args: argparse.Namespace, bar: Any) -> str:
    """One generation of ``--model`` through ``--attention`` at the fewest steps (:func:`fewest_steps`), nothing
    written; ``bar`` advances after loading and after the generation.  Returns what ran, in words."""
    import torch

    from pasa_diffusers.pipelines.video import generate_frames, is_video_pipeline

    from .. import install
    from .common import load_condition_image, load_model

    bar.set_description(f"warmup {args.model}: loading")
    pipe = load_model(args, video=True)
    settings = fewest_steps(args, pipe)
    try:
        install.apply(pipe, args.attention)
    except ValueError as exc:
        raise UsageError(f"--attention {args.attention}: {exc}") from exc
    bar.update(1)
    image = None if is_video_pipeline(pipe) else load_condition_image(args, settings)
    bar.set_description(f"warmup {args.model}: {settings['num_inference_steps']} step(s)")
    generate_frames(pipe, image, **{**settings, "progress": False})
    if torch.device(args.device).type == "cuda":
        torch.cuda.synchronize(args.device)
    bar.update(1)
    return (f"{args.model} at {settings['num_frames']} frames {settings['width']}x{settings['height']} "
            f"({settings['num_inference_steps']} step(s))")


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from .. import compat

    tally = _Tally()
    remove = compat.add_compile_listener(tally)
    start = time.perf_counter()
    ran = []
    try:
        with tqdm(total=len(args.shapes) + (2 if args.model is not None else 0), desc="warmup", unit="step",
                  file=sys.stderr, dynamic_ncols=True) as bar:
            tally.bar = bar
            bar.set_postfix(compiled=0, cached=0)
            if args.shapes:
                warm_shapes(args.shapes, args.attention, args.dtype, args.device, bar)
                ran.append(f"{len(args.shapes)} shape(s) in {args.dtype or 'fp16'}")
            if args.model is not None:
                ran.append(warm_model(args, bar))
    finally:
        remove()
    where = compat.cache_dir()
    kept = f"Triton's cache {where}" if where is not None else "the cache of TRITON_CACHE_MANAGER"
    print(f"pasa warmup: {args.attention} on {torch.cuda.get_device_name(args.device)}: {tally.compiled} kernel(s) "
          f"compiled, {tally.cached} already in {kept}, in {time.perf_counter() - start:.1f} s, for "
          f"{' and '.join(ran)}; later processes load them from there")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("warmup", help="compile the attention kernels for this GPU ahead of a first video",
                       description="Compile the kernels --attention runs, for this GPU, into Triton's own cache "
                                   "(TRITON_CACHE_DIR, default ~/.triton/cache), where every later process finds "
                                   "them: --model runs one generation of the fewest steps the pipeline takes "
                                   "(nothing written) at pasa generate's size flags and defaults, so the same "
                                   "kernels as pasa generate with those flags; --shapes runs the op once per "
                                   "shape. A progress bar counts the kernels compiled and those already cached.")
    p.add_argument("--model", type=MODEL, default=None, help=model_help(None))
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=[], metavar="B,H,N,D[,NK[,HK]]",
                   help="attention shapes to compile for: batch, query heads, queries, head dim, and optionally keys "
                        "(default N) and key heads (default H); inputs in diffusers' (B, N, H, D) memory")
    p.add_argument("--attention", choices=OUR_BACKENDS, default="pasa", metavar="BACKEND",
                   help=f"the backend whose kernels to compile (default pasa): {backend_help(OUR_BACKENDS)}")
    p.add_argument("--device", type=device, default=None, help="cuda or cuda:N (default cuda)")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default=None,
                   help="--model: the model's dtype (default fp16); --shapes: the inputs' (fp16 or bf16, default fp16)")
    defaults = _generate_svd_defaults()
    p.add_argument("--frames", type=int_range(2, why="SVD needs two frames"), default=None,
                   help=f"--model: frames per video (default: pasa generate's, {defaults['num_frames']} for SVD, a "
                        "video transformer's own)")
    p.add_argument("--height", type=_SIZE, default=None, help="--model: frame height in pixels (default: pasa "
                   f"generate's, {defaults['height']} for SVD, a video transformer's own)")
    p.add_argument("--width", type=_SIZE, default=None, help="--model: frame width in pixels (default: pasa "
                   f"generate's, {defaults['width']} for SVD, a video transformer's own)")
    p.add_argument("--image", type=IMAGE, default="builtin:rocket",
                   help="--model: an SVD pipeline's conditioning image, as "
                   "pasa generate takes it (default builtin:rocket; its size is what matters)")
    p.add_argument("--local-files-only", action="store_true", help="never contact the Hugging Face hub")
    p.set_defaults(func=run, svd_defaults=defaults, seed=0, steps=1)
