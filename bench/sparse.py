"""How fast is block-sparse PASA against FlexAttention at the same block mask (issue 46)?

    python -m bench.sparse --out DIR                                    # (1, 12, 32760, 128) bf16, every mask
    python -m bench.sparse --densities 0.25,0.1,0.05 --masks random --out DIR
    TRITON_INTERPRET=1 python -m bench.sparse --shapes tiny --out DIR   # a CPU, under the interpreter

One shape (``--shapes dit``: Wan 2.1 1.3B at 480p, one classifier-free-guidance pass, (1, 12, 32760, 128), its
latent grid 21 x 30 x 52 tokens; ``tiny``: (1, 2, 512, 32) for a CPU), one mask per row group, 128 x 128 blocks
shared by every head:

  random    per query block its own block and others drawn at random, round(density x blocks) in all, for each
            of --densities (default 0.25, 0.10, 0.05: the issue's)
  radial    Radial Attention's mask on the grid in tile order (video_masks.radial_mask; dit only), its density
            what it keeps
  dense     every block (the methods' dense time: the ratio "vs own dense")

Methods at each mask (--methods, comma-separated, default all):

  pasa      pasa_attention(..., block_mask=) in the default variant (exact shift, hybrid): the kernel the
            dispatcher's plan names, the missing blocks neither loaded nor multiplied
  pasa-fp8  the same in precision="fp8" (the 8-bit kernel the plan names)
  portable-fp8 precision="fp8" on the portable 8-bit kernel by name (dispatch.forward(kernel="portable-int8")),
            which kernel="auto" takes below hopper_int8.AUTO_MIN_KEYS keys or off sm_90
  flex      torch's FlexAttention with the same mask (BlockSparseMask.to_flex), compiled on CUDA (eager on a CPU)
  sdpa      the fastest of SDPA's flash and cuDNN backends, dense: what the mask has to beat
  pooled    building the dynamic mask (video_masks.pooled_mask, keep 0.9 of the estimated mass) from q and k:
            the cost a dynamic mask adds to each call

Columns: density (the share of (query, key) pairs kept, on the block grid), ms (the timer's median), effective
TFLOP/s (4 B Hq Nq Nk D density / t), vs own dense (the method's dense ms / ms: 1 / density is ideal), vs flex
(FlexAttention's ms at the same mask / ms; > 1: faster), and the kernel or the error.  On CUDA, for our methods,
graph ms (one CUDA-graph replay of the call: the GPU's time alone) and host us (the host's time to issue one
call while the GPU sleeps): where host us exceeds graph ms, the call waits on the host, not the GPU.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict, replace

import torch

from pasa_diffusers.block_sparse import BlockSparseMask
from pasa_diffusers.mask_coverage import head_density

from . import harness
from .overhead import graph_replay, host_us

NAME = "sparse"
SHAPES = {"dit": harness.Shape("sparse", "Wan 2.1 1.3B 480p, one pass", 1, 12, 12, 32760, 32760, 128),
          "tiny": harness.Shape("sparse", "tiny", 1, 2, 2, 512, 512, 32)}
GRIDS = {"dit": (21, 30, 52)}
"""The latent grid (frames, rows, columns of tokens) behind a shape, for the radial mask."""
MASKS = ("random", "radial", "dense")
METHODS = ("pasa", "pasa-fp8", "portable-fp8", "flex", "sdpa", "pooled")
DEFAULT_DENSITIES = (0.25, 0.10, 0.05)


def random_mask(shape: harness.Shape, density: float, gen: torch.Generator) -> BlockSparseMask:
    """Per query block its diagonal block and random others, ``round(density x blocks)`` kept in all (at least 1)."""
    n_q, n_k = -(-shape.nq // 128), -(-shape.nk // 128)
    keep = max(1, round(density * n_k))
    scores = torch.rand(n_q, n_k, generator=gen)
    scores[torch.arange(n_q), torch.arange(n_q) % n_k] = 2.0  # the diagonal first
    chosen = scores.topk(keep, dim=-1).indices
    blocks = torch.zeros(n_q, n_k, dtype=torch.bool).scatter_(-1, chosen, True)
    return BlockSparseMask.from_dense(blocks, shape.nq, shape.nk)


def masks(shape_key: str, kinds: Sequence[str], densities: Sequence[float],
          gen: torch.Generator) -> list[tuple[str, BlockSparseMask]]:
    """The masks of the run, labelled: ``dense`` first (the ratios' base), then ``random`` per density, ``radial``."""
    shape = SHAPES[shape_key]
    found = [("dense", BlockSparseMask.full(shape.nq, shape.nk))]
    if "random" in kinds:
        found += [(f"random {d:g}", random_mask(shape, d, gen)) for d in densities]
    if "radial" in kinds and shape_key in GRIDS:
        from pasa_diffusers.video_masks import VideoTokens, radial_mask, tile_order

        tokens = VideoTokens(*GRIDS[shape_key])
        found.append(("radial", radial_mask(tokens, order=tile_order(tokens))))
    return found


def _op(precision: str, mask: BlockSparseMask) -> harness.Method:
    def build(q, k, v):
        from pasa_diffusers.kernels import dispatch
        from pasa_diffusers.ops import pasa_attention
        from pasa_diffusers.variants import Variant

        on_device = mask.to(q.device)
        plan = dispatch.plan(q, k, v, torch.empty_like(q), variant=Variant("exact", precision),
                             block_mask=None if on_device.keeps_all else on_device)

        def call():
            return pasa_attention(q, k, v, precision=precision, block_mask=on_device)
        return harness.Prepared(call, plan.kernel, {"plan": plan.describe()})

    return harness.Method("pasa" if precision == "hybrid" else f"pasa-{precision}", "ours", build)


def _portable_fp8(mask: BlockSparseMask) -> harness.Method:
    """``precision="fp8"`` on the portable 8-bit kernel by name, the mask as the op would pass it."""
    def build(q, k, v):
        from pasa_diffusers.kernels import dispatch
        from pasa_diffusers.shift_matrix import DEFAULT_BETA
        from pasa_diffusers.variants import Variant

        on_device = mask.to(q.device)
        kept = None if on_device.keeps_all else on_device
        out, variant, scale = torch.empty_like(q), Variant("exact", "fp8"), q.shape[-1] ** -0.5

        def call():
            return dispatch.forward(q, k, v, out, scale=scale, variant=variant, beta=DEFAULT_BETA,
                                    kernel="portable-int8", block_mask=kept)
        return harness.Prepared(call, "portable-int8")

    return harness.Method("portable-fp8", "ours", build)


def _flex(mask: BlockSparseMask) -> harness.Method:
    def build(q, k, v):
        from torch.nn.attention.flex_attention import flex_attention

        run = torch.compile(flex_attention) if q.is_cuda else flex_attention
        block_mask = mask.to(q.device).to_flex()
        gqa = q.shape[1] != k.shape[1]

        def call():
            return run(q, k, v, block_mask=block_mask, enable_gqa=gqa)
        return harness.Prepared(call, "compiled" if q.is_cuda else "eager")

    return harness.Method("flex", "peer", build)


def _sdpa_best() -> list[harness.Method]:
    return [harness.sdpa_method("flash")] + ([harness.sdpa_method("cudnn")] if torch.cuda.is_available() else [])


def _pooled() -> harness.Method:
    def build(q, k, v):
        from pasa_diffusers.video_masks import pooled_mask

        def call():
            return pooled_mask(q, k, mass=0.9).kv_counts
        return harness.Prepared(call, "mask build only")

    return harness.Method("pooled", "mask", build)


def methods_at(label: str, mask: BlockSparseMask, chosen: Sequence[str]) -> list[harness.Method]:
    """The methods run at one mask: the dense SDPA and the pooled mask's build only at ``dense``."""
    found = []
    if "pasa" in chosen:
        found.append(_op("hybrid", mask))
    if "pasa-fp8" in chosen:
        found.append(_op("fp8", mask))
    if "portable-fp8" in chosen:
        found.append(_portable_fp8(mask))
    if "flex" in chosen:
        found.append(_flex(mask))
    if label == "dense" and "sdpa" in chosen:
        found += _sdpa_best()
    if label == "dense" and "pooled" in chosen:
        found.append(_pooled())
    return found


def _densities(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0.0 < d <= 1.0 for d in values):
        raise SystemExit(f"bench.sparse: error: --densities {text!r}: expected numbers in (0, 1], comma-separated")
    return values


def split_time(method: harness.Method, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               timer: harness.Timer) -> dict:
    """``graph_ms`` (one CUDA-graph replay of ``method``'s call, timed) and ``host_us`` (the host's time to issue
    it while the GPU sleeps): where the call's time goes.  ``None`` both off CUDA; a call that cannot be captured
    keeps its host time and names why in ``graph_error``."""
    if not q.is_cuda:
        return {"graph_ms": None, "host_us": None}
    call = method.build(q, k, v).call
    found = {"host_us": host_us(call)}
    try:
        found["graph_ms"] = timer(graph_replay(call))
    except RuntimeError as exc:
        found["graph_ms"], found["graph_error"] = None, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return found


def table(rows: list[dict]) -> str:
    lines = ["| mask | density | method | ms | eff. TFLOP/s | vs own dense | vs flex | graph ms | host us "
             "| kernel / note |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['mask']} | {harness.fmt(r['density'], '.3f')} | {r['method']} "
                     f"| {harness.fmt(r['ms'], '.3f')} | {harness.fmt(r['effective_tflops'])} "
                     f"| {harness.fmt(r['vs_own_dense'], '.2f')} | {harness.fmt(r['vs_flex'], '.2f')} "
                     f"| {harness.fmt(r.get('graph_ms'), '.3f')} | {harness.fmt(r.get('host_us'), '.0f')} "
                     f"| {r['error'] or r.get('graph_error') or r['note']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(NAME, __doc__)
    p.add_argument("--shapes", choices=list(SHAPES), default="dit", help="dit (default) or tiny (a CPU)")
    p.add_argument("--masks", type=harness.name_list(MASKS), default=",".join(MASKS),
                   help=f"comma-separated of {', '.join(MASKS)} (default all)")
    p.add_argument("--densities", default=",".join(f"{d:g}" for d in DEFAULT_DENSITIES),
                   help="the random masks' densities, comma-separated, in (0, 1] (default 0.25,0.1,0.05)")
    p.add_argument("--methods", type=harness.name_list(METHODS), default=",".join(METHODS),
                   help=f"comma-separated of {', '.join(METHODS)} (default all)")
    harness.add_dtype_argument(p)
    harness.add_timer_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs and the random masks (default: 0)")
    args = p.parse_args(argv)
    kinds, chosen = args.masks, args.methods
    densities = _densities(args.densities)
    problem = harness.cpu_problem(NAME) if {"pasa", "pasa-fp8", "portable-fp8"} & set(chosen) else None
    if problem:
        print(problem, file=sys.stderr)
        return 2

    cmd, env = harness.command(NAME, argv), harness.environment()
    timer = harness.Timer(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    shape = SHAPES[args.shapes]
    gen = torch.Generator(device=harness.device()).manual_seed(args.seed)
    q, k, v = harness.make_inputs(shape, gen, dtype=harness.INPUT_DTYPES[args.dtype])
    rows: list[dict] = []
    dense_ms: dict[str, float] = {}
    for label, mask in harness.progress(masks(args.shapes, kinds, densities, torch.Generator().manual_seed(args.seed)),
                                        NAME):
        density = float(head_density(mask, 1, 1).mean())
        at_mask = methods_at(label, mask, chosen)
        measured = harness.measure(replace(shape, name=f"{shape.name}, {label}"), at_mask, q, k, v, timer=timer)
        ran = {r.method for r in measured if r.ms}
        split = {m.name: split_time(m, q, k, v, timer) for m in at_mask if m.kind == "ours" and m.name in ran}
        flex_ms = next((r.ms for r in measured if r.method == "flex"), None)
        for r in measured:
            if label == "dense" and r.ms:
                dense_ms[r.method] = r.ms
            attends = r.kind != "mask"
            counted = density if r.kind in ("ours", "peer") else 1.0
            rows.append({**asdict(r), **split.get(r.method, {}), "mask": label, "density": density,
                         "effective_tflops": r.tflops * counted if r.tflops and attends else None,
                         "vs_own_dense": dense_ms[r.method] / r.ms if r.ms and attends and r.method in dense_ms
                         else None,
                         "vs_flex": flex_ms / r.ms if r.ms and flex_ms and r.kind == "ours" else None})
        harness.free_memory()

    text = (harness.header(f"bench.sparse: block-sparse attention at {shape.bhnd} {args.dtype}", env, cmd) + "\n"
            + table(rows) + "\n")
    harness.write_report(args.out, NAME, text, {"bench": NAME, "command": cmd, "environment": env,
                                                "timer": asdict(timer), "shape": asdict(shape), "rows": rows})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
