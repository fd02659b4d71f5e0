"""How much host time does each call of the public op cost, where the kernel itself is short?

    python -m bench.overhead --out DIR

SVD's small attention problems (the 144- to 2304-token spatial ones and the 14- and 25-frame temporal
ones) finish on the GPU in tens of microseconds, so Python work per call can decide the time.  Per
shape, microseconds per call of: pasa_attention (validation, dispatch, allocation), dispatch.forward
into a preallocated output (the kernel's launch path alone), and one CUDA-graph replay of the op (no
host work at all).  Each is timed in runs of --calls back-to-back calls without clearing the L2 cache
(so the host's work shows whenever it exceeds the GPU's), the median over runs.  "op - graph" is what
the host adds to each call; the plan column names the kernel.
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict

import torch

from pasa_diffusers.shift_matrix import DEFAULT_BETA
from pasa_diffusers.kernels import dispatch
from pasa_diffusers.metrics import records
from pasa_diffusers.ops import pasa_attention
from pasa_diffusers.variants import DEFAULT

from . import harness

NAME = "overhead"
MAX_TOKENS = 2304
"""The longest sequences timed here (SVD's second-level spatial attention); above it the kernel dominates."""


def host_us(fn: harness.Call, calls: int = 9) -> float:
    """Microseconds of host time per call of ``fn``: the median of ``calls`` calls, each timed alone, issued while
    the GPU sleeps (nothing waits on it), after one call and a synchronize.  The median, not the mean: CUDA's
    launch queue holds about a thousand pending kernels, and a call issued while it is full waits for the GPU
    (here: for the sleep).  A 12-range 8-bit call launches 84 Triton kernels (7 per range) and torch's, so 20 of them in a row measured the
    sleep (82 ms per call, where each took 9 ms); the median is the host's time as long as the queue fills in
    the later half of the calls or never."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(3_000_000_000)
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(seconds)


def graph_replay(fn: harness.Call) -> harness.Call:
    """``fn`` captured once into a CUDA graph (after a warm-up on a side stream); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def measure(shape: harness.Shape, gen: torch.Generator, timer: harness.Timer) -> dict:
    """Microseconds per call of the op, of ``dispatch.forward`` and of the op's graph replay at ``shape``."""
    q, k, v = harness.make_inputs(shape, gen)
    bases = [t.transpose(1, 2) for t in (q, k, v)]
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(shape.d)
    calls = {"op": lambda: pasa_attention(*bases, layout="bnhd"),
             "dispatch.forward": lambda: dispatch.forward(q, k, v, out, scale=scale, variant=DEFAULT,
                                                          beta=DEFAULT_BETA)}
    for fn in calls.values():
        fn()
    calls["graph replay"] = graph_replay(calls["op"])
    row = {"shape": shape.label, "bhnd": shape.bhnd,
           "plan": dispatch.plan(q, k, v, out, variant=DEFAULT).describe()}
    row.update({name: 1e3 * timer(fn) for name, fn in calls.items()})
    return row


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(NAME, __doc__)
    p.add_argument("--frames", type=int, nargs="+", default=list(harness.FRAMES), metavar="F",
                   help="SVD's frame counts (default: 14 25)")
    p.add_argument("--calls", type=int, default=100, help="back-to-back calls per timed run (default: 100)")
    harness.add_timer_arguments(p, rep_ms=200.0)
    args = p.parse_args(argv)
    if args.calls < 1:
        p.error(f"--calls {args.calls}: must be at least 1")
    if not torch.cuda.is_available():
        print(f"bench.{NAME}: needs a CUDA GPU (host overhead under the interpreter means nothing)", file=sys.stderr)
        return 2

    cmd, env = harness.command(NAME, argv), harness.environment()
    timer = harness.Timer(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, batch=args.calls, flush_l2=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [s for s in harness.shapes("svd", args.frames) if s.nq <= MAX_TOKENS]
    with torch.no_grad():
        rows = [measure(s, gen, timer) for s in harness.progress(shapes, NAME)]
    f = harness.fmt
    text = harness.header("bench.overhead: host time per call of pasa_attention", env, cmd) + "\n" + \
        records.markdown_table(
            ["shape", "(B, H, N, D)", "op us", "dispatch.forward us", "graph replay us", "op - graph us", "plan"],
            [[r["shape"], r["bhnd"], f(r["op"], ".1f"), f(r["dispatch.forward"], ".1f"), f(r["graph replay"], ".1f"),
              f(r["op"] - r["graph replay"], ".1f"), r["plan"]] for r in rows], align="llrrrrl") + "\n"
    harness.write_report(args.out, NAME, text, {"bench": NAME, "command": cmd, "environment": env,
                                                "timer": asdict(timer), "rows": rows})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
