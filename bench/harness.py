"""What every benchmark shares: the shape sets, the attention methods, the timer, the rates, the header
and the writer.

Shapes (``(B, Hq/Hk, N, D)``, fp16, held as diffusers holds them: ``(B, N, H, D)`` contiguous, viewed as
``(B, H, N, D)``):

- SVD-XT at 576x1024 (latents 72x128), classifier-free guidance (batch 2), F = 14 and 25 frames:
  spatial ``(2F, 5, 9216, 64)``, ``(2F, 10, 2304, 64)``, ``(2F, 20, 576, 64)``, ``(2F, 20, 144, 64)``;
  temporal ``(18432, 5, F, 64)``, ``(4608, 10, F, 64)``;
- the video DiTs: Wan 2.1 1.3B at 480p ``(2, 12, 32760, 128)``, Wan 14B ``(1, 40, 32760, 128)``, a
  HunyuanVideo-like ``(1, 24, 45000, 128)``, CogVideoX-5B ``(2, 48, 17776, 64)``;
- the paper's ``(1, 28 q heads / 4 kv heads, 1407, 128)``;
- ``tiny``: small shapes (several key blocks, a temporal batch, grouped heads) that run under Triton's
  interpreter on a CPU in seconds.

Methods: SDPA's backends (``torch.nn.attention.sdpa_kernel``), the peers when importable
(FlashAttention-3 bf16 and fp8 from the ``fa3-fwd`` wheel, SageAttention), and our variants through
the public op ``pasa_attention`` or through ``kernels.dispatch`` with a kernel forced.

Timing (:class:`Timer`): CUDA events around each call, the L2 cache cleared before each, the median
of the calls that fill ``rep_ms`` after ``warmup_ms`` of warm-up; on a CPU ``time.perf_counter``.
Rates: TFLOP/s = 4 B Hq Nq Nk D / t; GB/s = the fp16 bytes of q, k, v read and o written once / t.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from pasa_diffusers import backends, peers
from pasa_diffusers.shift_matrix import DEFAULT_BETA
from pasa_diffusers.env import flag as env_flag
from pasa_diffusers.metrics import records
from pasa_diffusers.variants import Variant

if TYPE_CHECKING:
    from pasa_diffusers.kernels.dispatch import Plan
    from pasa_diffusers.video_masks import VideoTokens

__all__ = ["Shape", "svd_spatial", "svd_temporal", "DIT", "DIT_CALLS", "PAPER", "TINY", "SHAPE_SETS", "FRAMES", "shapes",
           "make_inputs", "Call", "Method", "Prepared", "Skip", "SDPA_BACKENDS", "sdpa_method", "peer_methods",
           "VARIANTS", "op_method", "kernel_names", "kernel_methods", "config_methods", "METHOD_GROUPS", "parse_methods",
           "select_methods", "runs_ours", "Timer", "synchronize", "free_memory", "Row", "error_text", "measure",
           "fmt", "device", "cpu_problem", "environment", "header", "write_report", "settings_study", "rows_payload", "parser",
           "add_shape_arguments", "add_timer_arguments", "add_method_arguments", "command", "progress", "log"]


# ---- shapes --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """One attention problem: batch ``b``, ``hq`` query and ``hk`` key/value heads, ``nq`` queries,
    ``nk`` keys, head dim ``d``; ``group`` is its shape set, ``name`` what it is."""

    group: str
    name: str
    b: int
    hq: int
    hk: int
    nq: int
    nk: int
    d: int

    @property
    def bhnd(self) -> str:
        """``(B, Hq/Hk, N, D)``, or ``(B, Hq/Hk, Nq/Nk, D)`` when they differ."""
        heads = f"{self.hq}" if self.hq == self.hk else f"{self.hq}/{self.hk}"
        n = f"{self.nq}" if self.nq == self.nk else f"{self.nq}/{self.nk}"
        return f"({self.b}, {heads}, {n}, {self.d})"

    @property
    def label(self) -> str:
        return f"{self.group} {self.name}"

    def flops(self) -> float:
        """Non-causal attention's ``4 B Hq Nq Nk D`` floating-point operations (both GEMMs)."""
        return 4.0 * self.b * self.hq * self.nq * self.nk * self.d

    def bytes(self, itemsize: int = 2) -> int:
        """Bytes of q, k and v read once and o written once, at ``itemsize`` bytes per element."""
        return itemsize * (2 * self.b * self.hq * self.nq * self.d + 2 * self.b * self.hk * self.nk * self.d)

    def scores(self) -> int:
        """Elements of the full score matrix ``B Hq Nq Nk`` (what SDPA's math backend materialises)."""
        return self.b * self.hq * self.nq * self.nk


def _square(group: str, name: str, b: int, hq: int, n: int, d: int, hk: int | None = None) -> Shape:
    return Shape(group, name, b, hq, hq if hk is None else hk, n, n, d)


def svd_spatial(frames: int) -> list[Shape]:
    """SVD-XT's spatial self-attention at 576x1024 (72x128 latents), CFG batch 2, ``frames`` frames."""
    return [_square("svd-spatial", f"F{frames} N{n}", 2 * frames, h, n, 64)
            for n, h in ((9216, 5), (2304, 10), (576, 20), (144, 20))]


def svd_temporal(frames: int) -> list[Shape]:
    """SVD-XT's temporal self-attention: one sequence of ``frames`` tokens per latent pixel and CFG copy."""
    return [_square("svd-temporal", f"F{frames} HW{b // 2}", b, h, frames, 64) for b, h in ((18432, 5), (4608, 10))]


DIT = [_square("dit", "Wan 2.1 1.3B 480p", 2, 12, 32760, 128),
       _square("dit", "Wan 14B", 1, 40, 32760, 128),
       _square("dit", "HunyuanVideo-like", 1, 24, 45000, 128),
       _square("dit", "CogVideoX-5B", 2, 48, 17776, 64)]
"""The video DiTs' self-attention (one latent video each)."""

DIT_CALLS = [_square("dit-calls", "LTX-Video self", 2, 32, 7392, 64),
             Shape("dit-calls", "LTX-Video cross", 2, 32, 32, 7392, 128, 64),
             _square("dit-calls", "Mochi 1 joint, one sample", 1, 24, 6616, 128),
             Shape("dit-calls", "Wan 2.1 1.3B 480p cross", 2, 12, 12, 32760, 512, 128)]
"""The video DiTs' other attention calls: the short-sequence models' self- and joint attention (LTX-Video,
Mochi 1 at 19 frames: its processor attends one sample at a time) and the cross-attention to the text
(LTX-Video's 128 tokens, one key block; Wan's 512)."""

PAPER = _square("paper", "Qwen2-7B 1407", 1, 28, 1407, 128, hk=4)
"""The paper's random benchmark: 28 query heads sharing 4 key/value heads."""

TINY = [_square("tiny", "spatial", 2, 2, 200, 64),
        _square("tiny", "temporal", 16, 2, 14, 64),
        _square("tiny", "gqa", 1, 4, 96, 32, hk=2)]
"""Small problems for a CPU under Triton's interpreter: two key blocks, packed short sequences,
grouped heads."""

SHAPE_SETS = ("svd", "svd-spatial", "svd-temporal", "dit", "dit-calls", "paper", "tiny", "all")
"""What ``--shapes`` takes; ``all`` is every set but ``tiny``."""

FRAMES = (14, 25)


def shapes(which: str, frames: Sequence[int] = FRAMES) -> list[Shape]:
    """The shapes of the set ``which`` (one of ``SHAPE_SETS``); SVD's at each of ``frames``."""
    if which not in SHAPE_SETS:
        raise ValueError(f"shapes: unknown set which={which!r}; expected one of {SHAPE_SETS}")
    if which == "tiny":
        return list(TINY)
    found: list[Shape] = []
    if which in ("svd", "svd-spatial", "all"):
        found += [s for f in frames for s in svd_spatial(f)]
    if which in ("svd", "svd-temporal", "all"):
        found += [s for f in frames for s in svd_temporal(f)]
    if which in ("dit", "all"):
        found += DIT
    if which in ("dit-calls", "all"):
        found += DIT_CALLS
    if which in ("paper", "all"):
        found.append(PAPER)
    return found


def make_inputs(shape: Shape, gen: torch.Generator, *, dtype: torch.dtype = torch.float16
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh ``q, k, v`` ~ N(0, 1) on ``gen``'s device: ``(B, N, H, D)`` contiguous, viewed as ``(B, H, N, D)``."""
    def draw(heads: int, n: int) -> torch.Tensor:
        x = torch.randn(shape.b, n, heads, shape.d, generator=gen, device=gen.device, dtype=dtype)
        return x.transpose(1, 2)

    return draw(shape.hq, shape.nq), draw(shape.hk, shape.nk), draw(shape.hk, shape.nk)


# ---- methods -------------------------------------------------------------------------------------

Call = Callable[[], torch.Tensor]


class Skip(Exception):
    """A method that does not apply to these inputs (a row with the reason, not a failure)."""


@dataclass
class Prepared:
    """A method set up on one shape's inputs: the timed ``call`` (returns ``(B, H, N, D)``), a short
    ``note`` for the table (our kernels: which one ran) and ``details`` for the JSON (the plan's line)."""

    call: Call
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Method:
    """One way to compute attention: ``build(q, k, v)`` does the untimed set-up on ``(B, H, N, D)``
    views (dtype conversions, a clone, the dispatcher's plan) and returns it as a :class:`Prepared`;
    ``kind`` is ``"sdpa"``, ``"peer"`` or ``"ours"``."""

    name: str
    kind: str
    build: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Prepared]


SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")

MATH_MAX_SCORES = 2 ** 31
"""SDPA's math backend materialises the ``B Hq Nq Nk`` scores: above this many it is skipped."""


def sdpa_method(backend: str) -> Method:
    """``F.scaled_dot_product_attention`` restricted to one backend (``sdpa-<backend>``)."""
    if backend not in SDPA_BACKENDS:
        raise ValueError(f"sdpa_method: unknown backend={backend!r}; expected one of {SDPA_BACKENDS}")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdp = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]

    def build(q, k, v):
        scores = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
        if backend == "math" and scores > MATH_MAX_SCORES:
            raise Skip(f"{scores:.2e} scores materialised (limit {MATH_MAX_SCORES:.2e})")
        gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}

        def call():
            with sdpa_kernel(sdp):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, **gqa)
        return Prepared(call)

    return Method(f"sdpa-{backend}", "sdpa", build)


def _fa3_method(fp8: bool) -> Method:
    """FlashAttention-3 (``peers.prepare``: ``fa3_fwd_interface.flash_attn_func`` on (B, N, H, D) views) on
    bf16 copies, or on float8 e4m3 copies scaled per kv head with their descales; the conversion is set-up,
    not timed."""
    def build(q, k, v):
        run = peers.prepare("fa3-fp8" if fp8 else "fa3", q, k, v, layout="bhnd")

        def call():
            return run().transpose(1, 2)
        return Prepared(call, "e4m3, descale per (B, Hk)") if fp8 else Prepared(call)

    return Method("fa3-fp8" if fp8 else "fa3-bf16", "peer", build)


def _sage_method() -> Method:
    """SageAttention (``peers.prepare``: INT8 q k^T with smooth-K, fp16 P V).  It subtracts K's mean from
    ``k`` in place, so it gets its own clone (made once in the set-up)."""
    def build(q, k, v):
        if q.shape[1] != k.shape[1]:
            raise Skip("sageattn takes equal query and key/value head counts")
        return Prepared(peers.prepare("sage", q, k, v, layout="bhnd"))

    return Method("sageattn", "peer", build)


_PEER_MODULES = {name: backends.BACKENDS[peer].requires[0]
                 for name, peer in (("fa3-bf16", "fa3"), ("fa3-fp8", "fa3-fp8"), ("sageattn", "sage"))}
"""Each peer method -> the module it imports: its backend's (``backends.BACKENDS[...].requires``)."""


@functools.cache
def _import_problem(module: str) -> str | None:
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001 - an optional peer that does not import is reported, not fatal
        return error_text(e)
    return None


def peer_methods() -> tuple[list[Method], dict[str, str]]:
    """The peers that import (FA3 bf16 and fp8, SageAttention) and, for the others, why not."""
    found = {"fa3-bf16": _fa3_method(False), "fa3-fp8": _fa3_method(True), "sageattn": _sage_method()}
    missing = {name: problem for name, module in _PEER_MODULES.items() if (problem := _import_problem(module))}
    return [m for name, m in found.items() if name not in missing], missing


VARIANTS = (Variant("exact", "hybrid"), Variant("exact", "half"), Variant("exact", "int8"), Variant("exact", "fp8"),
            *(Variant(shift, precision) for shift in ("pasa", "none") for precision in ("hybrid", "half")))
"""Our variants, the default (``exact-hybrid``) first; ``exact-int8`` is ``pasa-int8``, ``exact-fp8`` is
``pasa-fp8``."""

_SHIFT_ARGUMENT = {"exact": "exact", "pasa": True, "none": False}
"""``pasa_attention``'s ``shift`` for each ``Variant.shift``."""


def _planned(call: Call, plan: Plan) -> Prepared:
    """``call`` noted with the kernel and pre-pass of its ``dispatch.Plan`` (the whole plan in the details)."""
    note = plan.kernel + (f" + {plan.prepass} pre-pass" if plan.prepass else "")
    return Prepared(call, note, {"plan": plan.describe()})


def op_method(variant: Variant) -> Method:
    """``pasa_attention`` with ``variant``'s options, on the (B, N, H, D) memory (``layout="bnhd"``), as a
    diffusers processor calls it; the note is the dispatcher's plan for the call."""
    def build(q, k, v):
        from pasa_diffusers.kernels import dispatch
        from pasa_diffusers.ops import pasa_attention

        plan = dispatch.plan(q, k, v, torch.empty_like(q), variant=variant)
        qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
        shift = _SHIFT_ARGUMENT[variant.shift]

        def call():
            return pasa_attention(qb, kb, vb, precision=variant.precision, shift=shift, layout="bnhd").transpose(1, 2)
        return _planned(call, plan)

    return Method(variant.name, "ours", build)


def kernel_names() -> tuple[str, ...]:
    """Our kernels by name, in the router's order of preference (``dispatch.TABLE``: one entry per kernel file)."""
    from pasa_diffusers.kernels import dispatch

    return dispatch.kernel_names()


def _plan_name(variant: Variant, plan: Plan) -> str:
    prepass = f"{plan.prepass} pre-pass" if plan.prepass else "no pre-pass"
    return f"{variant.name} [{plan.kernel}, {prepass}]"


def _config_text(config: dict) -> str:
    return " ".join(f"{key}={value}" for key, value in config.items())


def _dispatched(variant: Variant, name: str, kernel: str, prepass: bool | None, config: dict | None) -> Method:
    """``dispatch.forward`` of ``variant`` with ``kernel``, ``prepass`` and ``config`` into a preallocated output."""
    def build(q, k, v):
        from pasa_diffusers.kernels import dispatch

        out = torch.empty_like(q)
        scale = 1.0 / math.sqrt(q.shape[-1])
        plan = dispatch.plan(q, k, v, out, variant=variant, kernel=kernel, prepass=prepass, config=config)

        def call():
            return dispatch.forward(q, k, v, out, scale=scale, variant=variant, beta=DEFAULT_BETA, kernel=kernel,
                                    prepass=prepass, config=config)
        return _planned(call, plan)

    return Method(name, "ours", build)


def kernel_methods(variant: Variant, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[Method]:
    """Every distinct way ``kernels.dispatch`` accepts to run ``variant`` on these inputs: each kernel
    with the key pre-pass left to the plan, forced on and forced off, named ``<variant> [<kernel>,
    <pre-pass>]``."""
    from pasa_diffusers.kernels import dispatch

    out = torch.empty_like(q)
    found: dict[str, Method] = {}
    for kernel in dispatch.kernel_names():
        for prepass in (None, True, False):
            try:
                plan = dispatch.plan(q, k, v, out, variant=variant, kernel=kernel, prepass=prepass)
            except ValueError:  # a kernel or pre-pass this call cannot take
                continue
            name = _plan_name(variant, plan)
            if name not in found:
                found[name] = _dispatched(variant, name, kernel, prepass, None)
    return list(found.values())


def config_methods(variant: Variant, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   configs: Sequence[tuple[str, dict]]) -> list[Method]:
    """``variant`` on each ``(kernel, config)``, the config's meta-parameters fixed instead of autotuned,
    named ``<variant> [<kernel>, KEY=VALUE ...]``; one whose kernel cannot take these inputs is skipped
    with the dispatcher's reason."""
    from pasa_diffusers.kernels import dispatch

    out = torch.empty_like(q)
    found = []
    for kernel, config in configs:
        name = f"{variant.name} [{kernel}, {_config_text(config)}]"
        try:
            dispatch.plan(q, k, v, out, variant=variant, kernel=kernel, config=config)
        except ValueError as e:
            found.append(_skipped(name, str(e)))
            continue
        found.append(_dispatched(variant, name, kernel, None, config))
    return found


def _skipped(name: str, reason: str) -> Method:
    """A method that is a row with ``reason`` at every shape."""
    def build(q, k, v):
        raise Skip(reason)
    return Method(name, "ours", build)


METHOD_GROUPS = {
    "sdpa": [f"sdpa-{b}" for b in SDPA_BACKENDS],
    "peers": list(_PEER_MODULES),
    "ours": [v.name for v in VARIANTS],
    "kernels": [f"kernels:{v.name}" for v in VARIANTS],
}
"""What ``--methods`` takes besides single names: ``sdpa`` (SDPA's backends), ``peers`` (FA3 bf16 and
fp8, SageAttention), ``ours`` (our variants through the op), ``kernels`` (for each variant every
kernel path, ``kernels:<variant>`` for one)."""


def parse_methods(spec: str) -> list[str]:
    """The method names of a ``--methods`` value (groups expanded, order kept, duplicates dropped);
    ``argparse.ArgumentTypeError`` naming an unknown one."""
    known = [name for names in METHOD_GROUPS.values() for name in names]
    names: list[str] = []
    for item in (s.strip() for s in spec.split(",")):
        for name in METHOD_GROUPS.get(item, [item]):
            if name not in known:
                raise argparse.ArgumentTypeError(
                    f"unknown method {name!r}; expected a group {tuple(METHOD_GROUPS)} or one of {tuple(known)}")
            if name not in names:
                names.append(name)
    return names


def select_methods(names: Sequence[str]) -> tuple[list[Method], list[Variant], dict[str, str]]:
    """For ``names`` (of :func:`parse_methods`): the methods that do not depend on the shape, the
    variants whose kernel paths :func:`kernel_methods` adds per shape, and the requested peers that do
    not import (name -> why)."""
    peers, missing = peer_methods()
    by_name = {m.name: m for m in peers}
    by_name.update({f"sdpa-{b}": sdpa_method(b) for b in SDPA_BACKENDS})
    by_name.update({v.name: op_method(v) for v in VARIANTS})
    variants = {f"kernels:{v.name}": v for v in VARIANTS}
    return ([by_name[n] for n in names if n in by_name], [variants[n] for n in names if n in variants],
            {n: reason for n, reason in missing.items() if n in names})


def runs_ours(names: Sequence[str]) -> bool:
    """Whether ``names`` include one of our kernels (which need a GPU or Triton's interpreter)."""
    return any(n in METHOD_GROUPS["ours"] or n.startswith("kernels:") for n in names)


# ---- timing --------------------------------------------------------------------------------------

L2_FLUSH_BYTES = 256 * 2 ** 20
"""Bytes written before each timed call to clear the L2 cache (H200: 60 MB), as ``triton.testing.do_bench``."""


@functools.cache
def _flush_buffer() -> torch.Tensor:
    return torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")


@dataclass(frozen=True)
class Timer:
    """The one timer: milliseconds per call of ``fn``, the median over runs.

    On CUDA: CUDA events around each run, the L2 cache cleared before it (``flush_l2``); the runs that
    fill ``rep_ms`` (at least ``min_runs``, at most ``max_runs``) after the calls that fill
    ``warmup_ms``, both counted from a first estimate.  A run is ``batch`` back-to-back calls (its time
    divided by ``batch``): with ``batch > 1`` and no flush, the host's work per call shows whenever it
    exceeds the GPU's.  On a CPU the same with ``time.perf_counter``, where the estimating run is the first
    timed one when no warm-up run is due (an interpreted kernel's run takes seconds).  Call ``fn`` once before
    timing it (compilation and autotuning are not timed).
    """

    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    batch: int = 1
    flush_l2: bool = True
    min_runs: int = 5
    max_runs: int = 1000

    def _counts(self, estimate_ms: float, min_runs: int) -> tuple[int, int]:
        per_run = max(estimate_ms, 1e-6)
        warm = int(min(self.max_runs, self.warmup_ms / per_run))
        runs = int(min(self.max_runs, max(min_runs, self.rep_ms / per_run)))
        return warm, runs

    def __call__(self, fn: Call) -> float:
        if torch.cuda.is_available():
            return self._cuda(fn)
        return self._cpu(fn)

    def _run(self, fn: Call) -> None:
        for _ in range(self.batch):
            fn()

    def _cuda(self, fn: Call) -> float:
        flush = _flush_buffer() if self.flush_l2 else None
        event = functools.partial(torch.cuda.Event, enable_timing=True)
        start, stop = event(), event()
        torch.cuda.synchronize()
        start.record()
        for _ in range(3):
            if flush is not None:
                flush.zero_()
            self._run(fn)
        stop.record()
        torch.cuda.synchronize()
        warm, runs = self._counts(start.elapsed_time(stop) / 3, self.min_runs)
        for _ in range(warm):
            self._run(fn)
        starts, stops = [event() for _ in range(runs)], [event() for _ in range(runs)]
        for first, last in zip(starts, stops):
            if flush is not None:
                flush.zero_()
            first.record()
            self._run(fn)
            last.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) / self.batch for a, b in zip(starts, stops))

    def _cpu(self, fn: Call) -> float:
        t0 = time.perf_counter()
        self._run(fn)
        estimate = (time.perf_counter() - t0) * 1e3
        warm, runs = self._counts(estimate, 1)
        for _ in range(warm):
            self._run(fn)
        times = [] if warm else [estimate / self.batch]
        for _ in range(runs - len(times)):
            t0 = time.perf_counter()
            self._run(fn)
            times.append((time.perf_counter() - t0) * 1e3 / self.batch)
        return statistics.median(times)


def attention_share(model: torch.nn.Module, run: Callable[[], Any]) -> float | None:
    """The share of one eager ``run()``'s time that ``model``'s attention calls take: every installed
    processor's ``attend`` (the one entry of each call, fallbacks included, whatever the backend) between
    CUDA events recorded around it, over the events around the whole run (``time.perf_counter`` on a CPU).
    On the GPU a call's span runs from the GPU reaching its first launch to its last kernel's end: the
    attention kernels, and any wait for the host inside the call.  ``None`` where no processor is installed."""
    from pasa_diffusers import install
    from pasa_diffusers.attention_modules import attention_processors

    found = (install.counted_processor(p) for p in attention_processors(model).values())
    processors = list({id(p): p for p in found if p is not None}.values())
    if not processors:
        return None
    on_gpu = torch.cuda.is_available()

    def mark() -> Any:
        if not on_gpu:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(begin: Any, end: Any) -> float:
        return begin.elapsed_time(end) if on_gpu else (end - begin) * 1e3

    spans: list[tuple[Any, Any]] = []

    def timed(attend: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def attend_timed(*args: Any, **kwargs: Any) -> torch.Tensor:
            begin = mark()
            out = attend(*args, **kwargs)
            spans.append((begin, mark()))
            return out
        return attend_timed

    for processor in processors:
        processor.attend = timed(processor.attend)
    try:
        with torch.no_grad():
            synchronize()
            begin = mark()
            run()
            end = mark()
            synchronize()
    finally:
        for processor in processors:
            del processor.attend
    return sum(elapsed_ms(a, b) for a, b in spans) / elapsed_ms(begin, end)


def share_text(share: float | None) -> str:
    """A table cell of :func:`attention_share`: ``"58 %"``, or ``"-"`` (compiled, or nothing installed)."""
    return "-" if share is None else f"{100 * share:.0f} %"


def compile_regions(model: torch.nn.Module, classes: Sequence[str], **options: Any) -> Callable[[], None]:
    """Regional compilation: every submodule of ``model`` whose class is named in ``classes`` (the outermost
    ones) replaced in its parent by ``torch.compile(submodule, fullgraph=True, **options)``, which shares its
    parameters; returns the function that puts the originals back.  diffusers' ``compile_repeated_blocks``
    compiles the same blocks in place, which a bench could not undo between its rows."""
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []

    def walk(parent: torch.nn.Module) -> None:
        for name, child in list(parent.named_children()):
            if type(child).__name__ in classes:
                setattr(parent, name, torch.compile(child, fullgraph=True, **options))
                swapped.append((parent, name, child))
            else:
                walk(child)

    walk(model)
    if not swapped:
        raise ValueError(f"compile_regions: {type(model).__name__} has no submodule of the classes {sorted(classes)}")

    def undo() -> None:
        for parent, name, child in swapped:
            setattr(parent, name, child)
    return undo


def model_runs(model: torch.nn.Module, backends: Sequence[str], compiled: Sequence[str] | None,
               call: Callable[[torch.nn.Module], torch.Tensor], timer: Timer,
               regions: Sequence[str] | None = None, options: dict[str, dict[str, Any]] | None = None,
               tokens: VideoTokens | None = None) -> list[dict[str, Any]]:
    """A whole model per attention backend: each of ``backends`` installed on ``model`` (``install.apply``),
    ``call(model)`` timed eager and, for the backends in ``compiled`` (all when it is empty; none when it
    is ``None``), ``torch.compile``d (``fullgraph=True``): the whole model, or with ``regions`` each block of
    those classes (:func:`compile_regions`, mode ``"compile, regional"``); the model restored after each.  Per run: the
    backend, the mode, the first call's wall time (s: with the compile in the compiled mode), ms, the first
    run's time over this one's, whether the output is finite, its relative RMS difference to the first
    run's output, the peak GPU memory of one call above what was allocated before it (MiB, ``None`` on a
    CPU), the attention's share of an eager call (:func:`attention_share`, one more call; ``None`` compiled)
    and the fallback calls.  ``options``: ``install.apply``'s options per backend; a sparse backend's processors
    are bound to the self-attention sequence ``tokens`` while it runs (``pipelines.sparse.sparse_bound``; every
    call one denoising step, past the dense ones when its options say ``dense_steps=0``), and its row holds
    ``sparse_summary``."""
    from pasa_diffusers import install
    from pasa_diffusers.backends import SPARSE
    from pasa_diffusers.pipelines.sparse import sparse_bound, sparse_summary

    rows: list[dict[str, Any]] = []
    baseline: tuple[float, torch.Tensor] | None = None
    for backend in backends:
        install.apply(model, backend, **(options or {}).get(backend, {}))
        sparse = backend in SPARSE
        if sparse and tokens is None:
            raise ValueError(f"model_runs: backend {backend!r} needs the self-attention's tokens (tokens=)")
        modes = ["eager"]
        if compiled is not None and (not compiled or backend in compiled):
            modes.append("compile, regional" if regions else "compile")
        for mode in modes:
            undo = compile_regions(model, regions) if mode == "compile, regional" else None
            runner = torch.compile(model, fullgraph=True) if mode == "compile" else model
            def run(runner: torch.nn.Module = runner) -> torch.Tensor:
                return call(runner)
            with torch.no_grad(), sparse_bound(model, tokens) if sparse else contextlib.nullcontext():
                start = time.perf_counter()
                out = run().float()
                synchronize()
                first_s = time.perf_counter() - start
                ms = timer(run)
                peak = peak_mib(run)
                share = attention_share(model, run) if mode == "eager" else None
            if undo is not None:
                undo()
            baseline = baseline or (ms, out)
            diff = (out - baseline[1]).pow(2).mean().sqrt() / baseline[1].pow(2).mean().sqrt()
            summary = install.fallback_summary(model)
            rows.append({"backend": backend, "mode": mode, "first_call_s": first_s, "ms": ms,
                         "vs_first": baseline[0] / ms, "finite": bool(torch.isfinite(out).all()),
                         "rel_rms_diff": diff.item(), "peak_mib": peak, "attention_share": share,
                         "fallback_calls": summary["fallback_calls"], "fallbacks": summary["fallbacks"],
                         "sparse": sparse_summary(model)})
            log(f"{backend} {mode}: {ms:.1f} ms (first call {first_s:.1f} s)")
        install.restore(model)
        torch._dynamo.reset()
    return rows


def peak_mib(fn: Callable[[], Any]) -> float | None:
    """The peak GPU memory of one call of ``fn`` above what was allocated before it, in MiB (``None`` on a CPU)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 20


def synchronize() -> None:
    """Wait for the GPU (nothing on a CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory() -> None:
    """Return the GPU memory of the tensors just dropped to the driver (between shapes)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- rows ----------------------------------------------------------------------------------------

@dataclass
class Row:
    """One method at one shape: its time (the median over rounds, with their range), rates, the ratio
    to the best SDPA backend at that shape (> 1: faster), the peak GPU memory of one call above what was
    allocated before it (MiB: its output and workspace; ``None`` on a CPU), whether its output was finite,
    or the error."""

    shape: str
    group: str
    bhnd: str
    method: str
    kind: str
    note: str = ""
    ms: float | None = None
    ms_min: float | None = None
    ms_max: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    vs_best_sdpa: float | None = None
    peak_mib: float | None = None
    finite: bool | None = None
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def status(self) -> str:
        """The note column: the error, else the note and a warning for non-finite output."""
        if self.error:
            return self.error
        return self.note + ("" if self.finite is not False else " (non-finite output)")


def error_text(e: BaseException) -> str:
    """An exception as one table cell: its type and the first line of its message."""
    first = (str(e).strip().splitlines() or [""])[0][:160]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def measure(shape: Shape, methods: Iterable[Method], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
            timer: Timer, rounds: int = 1, check: Callable[[torch.Tensor], dict] | None = None) -> list[Row]:
    """Each method's :class:`Row` at ``shape`` on ``q, k, v``.

    Every method is set up and called once first (compilation, autotuning; its output checked for
    finiteness and by ``check``, whose dict goes to ``Row.extra``) and once more for its peak memory
    (:func:`peak_mib`); then ``rounds`` rounds each time
    every method once with ``timer``, so slow drift of the device affects all alike.  A method that
    raises is a row with its error, not the end of the run.
    """
    if rounds < 1:
        raise ValueError(f"measure: rounds={rounds} must be at least 1")
    rows: list[Row] = []
    ready: list[tuple[Row, Call]] = []
    for m in methods:
        row = Row(shape.label, shape.group, shape.bhnd, m.name, m.kind)
        rows.append(row)
        try:
            prepared = m.build(q, k, v)
            call, row.note = prepared.call, prepared.note
            row.extra.update(prepared.details)
            out = call()
            synchronize()
            row.finite = bool(torch.isfinite(out).all().item())
            row.peak_mib = peak_mib(call)
            if check is not None:
                row.extra.update(check(out))
            ready.append((row, call))
        except Skip as e:
            row.error = f"skipped: {e}"
        except Exception as e:  # noqa: BLE001 - a backend that cannot run this shape is a result
            row.error = error_text(e)
    times: dict[int, list[float]] = {id(row): [] for row, _ in ready}
    for _ in range(rounds):
        for row, call in ready:
            if row.error:
                continue
            try:
                times[id(row)].append(timer(call))
            except Exception as e:  # noqa: BLE001
                row.error = error_text(e)
    for row, _ in ready:
        if row.error or not times[id(row)]:
            continue
        row.ms = statistics.median(times[id(row)])
        row.ms_min, row.ms_max = min(times[id(row)]), max(times[id(row)])
        row.tflops = shape.flops() / row.ms * 1e-9
        row.gbps = shape.bytes() / row.ms * 1e-6
    best = min((r.ms for r in rows if r.kind == "sdpa" and r.ms), default=None)
    for r in rows:
        if best and r.ms:
            r.vs_best_sdpa = best / r.ms
    return rows


def fmt(x: float | None, spec: str = "rate") -> str:
    """``format(x, spec)``, or ``-`` for no value; ``spec="rate"``: whole numbers from 100 up, three
    significant digits below (a CPU's rates are small)."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if spec == "rate":
        return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"
    return format(x, spec)


# ---- environment, header, files ------------------------------------------------------------------

def device() -> str:
    """``"cuda"`` when a GPU is there, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_problem(bench: str, package: str = "bench") -> str | None:
    """Why our kernels cannot run on this CPU (they need Triton's interpreter: ``TRITON_INTERPRET=1`` set
    before the kernels were imported, and at each call so that the op takes the kernel rather than the
    PyTorch reference), or ``None`` (also on a GPU)."""
    if torch.cuda.is_available():
        return None
    from pasa_diffusers.kernels.common import INTERPRET

    if INTERPRET and env_flag("TRITON_INTERPRET"):
        return None
    return (f"{package}.{bench}: no CUDA GPU, and our kernels run on a CPU only under Triton's interpreter: "
            "set TRITON_INTERPRET=1 (and pick small shapes: --shapes tiny)")


def environment() -> dict[str, Any]:
    """``records.versions()`` (python, torch, diffusers, numpy, triton, the GPU's name) with the GPU's
    compute capability, SM count, CUDA and cuDNN versions, or the CPU and whether Triton interprets."""
    env: dict[str, Any] = dict(records.versions())
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"sm_{props.major}{props.minor}", sms=props.multi_processor_count,
                   cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    else:
        env["device"] = "cpu" + (" (Triton interpreter)" if env_flag("TRITON_INTERPRET") else "")
    env["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return env


def header(title: str, env: dict[str, Any], cmd: str) -> str:
    """The first lines of a report: its title, the device and versions, the command that made it."""
    if "gpu" in env:
        where = (f"{env['gpu']} ({env.get('capability', '?')}, {env.get('sms', '?')} SMs), CUDA {env.get('cuda')}, "
                 f"cuDNN {env.get('cudnn')}")
    else:
        where = env.get("device", "cpu")
    soft = ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "triton", "diffusers", "numpy") if k in env)
    return f"# {title}\n\n{where}; {soft}; {env['date']}\n\n`{cmd}`\n"


def write_report(out: str | os.PathLike, name: str, markdown: str, payload: dict[str, Any]) -> tuple[Path, Path]:
    """``<out>/<name>.md`` (``markdown``) and ``<out>/<name>.json`` (``payload``, the project's JSON
    convention: NaN as null), each written atomically; returns their paths."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    md = records.write_atomic(folder / f"{name}.md", markdown if markdown.endswith("\n") else markdown + "\n")
    return md, records.write_json(folder / f"{name}.json", payload)


def rows_payload(rows: Iterable[Row]) -> list[dict[str, Any]]:
    """Rows as JSON-ready dicts."""
    return [asdict(r) for r in rows]


# ---- command line --------------------------------------------------------------------------------

DEFAULT_OUT = "out/bench"


def parser(name: str, doc: str, package: str = "bench") -> argparse.ArgumentParser:
    """The parser of ``python -m <package>.<name>`` (``bench``, or ``tools`` for the build tools): the
    module's docstring as its help, ``--out``."""
    first, _, rest = doc.strip().partition("\n")
    p = argparse.ArgumentParser(prog=f"python -m {package}.{name}", description=first, epilog=rest.strip() or None,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"folder for {name}.md and {name}.json (default: {DEFAULT_OUT})")
    return p


def add_shape_arguments(p: argparse.ArgumentParser, default: str, choices: Sequence[str] = SHAPE_SETS) -> None:
    """``--shapes`` (a set of :func:`shapes`) and ``--frames`` (SVD's frame counts)."""
    p.add_argument("--shapes", choices=choices, default=default, help=f"shape set (default: {default})")
    p.add_argument("--frames", type=int, nargs="+", default=list(FRAMES), metavar="F",
                   help="SVD's frame counts (default: 14 25)")


INPUT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def name_list(known: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse ``type``: a comma-separated list of names of ``known`` (argparse names the flag when it refuses
    one)."""
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        if not names or any(name not in known for name in names):
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of {tuple(known)}")
        return names
    return parse


def add_dtype_argument(p: argparse.ArgumentParser) -> None:
    """``--dtype``: the inputs' dtype (``float16``, SVD's; ``bfloat16``, the video transformers')."""
    p.add_argument("--dtype", choices=list(INPUT_DTYPES), default="float16",
                   help="the inputs' dtype; every method gets them in it (FA3 bf16 converts fp16 ones untimed) "
                        "(default: float16)")


def add_timer_arguments(p: argparse.ArgumentParser, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> None:
    """``--warmup-ms`` and ``--rep-ms`` of the :class:`Timer`."""
    p.add_argument("--warmup-ms", type=float, default=warmup_ms, help=f"warm-up per method (default: {warmup_ms})")
    p.add_argument("--rep-ms", type=float, default=rep_ms,
                   help=f"timed calls per method fill this many ms (default: {rep_ms})")


def add_method_arguments(p: argparse.ArgumentParser, default: str) -> None:
    """``--methods``: names and groups of :data:`METHOD_GROUPS`, comma-separated."""
    p.add_argument("--methods", type=parse_methods, default=parse_methods(default),
                   help=f"comma-separated method names and groups {tuple(METHOD_GROUPS)} (default: {default})")


def settings_study(name: str, doc: str, title: str, settings: dict[str, tuple[torch.dtype, int]],
                   measure: Callable[[torch.dtype, int, int], Any],
                   section: Callable[[str, torch.dtype, int, Any], str], argv: Sequence[str] | None) -> int:
    """The ``main`` of a CPU study run once per (dtype, head dim) setting (``--settings``, ``--seed``): per setting
    ``measure(dtype, d, seed)`` and its markdown ``section(name, dtype, d, result)``, then the report (the total
    time last) as :func:`write_report` writes it, printed too."""
    p = parser(name, doc)
    p.add_argument("--settings", nargs="+", choices=list(settings), default=list(settings),
                   help="dtype and head dim settings (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default: 0)")
    args = p.parse_args(argv)
    cmd, env = command(name, argv), environment()
    text = header(title, env, cmd)
    results = {}
    t0 = time.time()
    with torch.no_grad():
        for setting in args.settings:
            dtype, d = settings[setting]
            results[setting] = measure(dtype, d, args.seed)
            text += section(setting, dtype, d, results[setting])
    text += f"\n{time.time() - t0:.0f} s\n"
    write_report(args.out, name, text, {"bench": name, "command": cmd, "environment": env, "results": results})
    print(text)
    return 0


def command(name: str, argv: Sequence[str] | None, package: str = "bench") -> str:
    """The command line that ran, as it would be typed."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join([f"python -m {package}.{name}", *args])


def progress(items: Iterable, desc: str, total: int | None = None) -> tqdm:
    """``items`` with a progress bar on stderr."""
    return tqdm(items, desc=desc, total=total, file=sys.stderr, dynamic_ncols=True)


def log(message: str) -> None:
    """One line on stderr, above any progress bar."""
    tqdm.write(message, file=sys.stderr)
