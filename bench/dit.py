"""What does each attention backend cost in one forward of a full-size video transformer?

    python -m bench.dit --out DIR                                          # Wan 2.1 1.3B at 480p
    python -m bench.dit --model wan2.1-1.3b --resolution 480p 720p --backends sdpa pasa fa3 --out DIR
    python -m bench.dit --model wan2.1-1.3b --backends sdpa pasa fa3 --compile --out DIR   # eager and compiled
    python -m bench.dit --model cogvideox-5b --backends sdpa pasa --compile pasa --out DIR
    python -m bench.dit --model hunyuan-video --resolution 540p --backends sdpa pasa --iters 2 --out DIR
    python -m bench.dit --model ltx-video --backends sdpa pasa fa3 --out DIR
    python -m bench.dit --model mochi-1 --resolution 480x848x19 480x848x163 --out DIR
    python -m bench.dit --model tiny-wan --out DIR                          # any machine, the CPU included
    python -m bench.dit --resolution 720p --backends sdpa pasa pasa-sparse pasa-fp8-sparse --mask tile-window --out DIR

The transformer of ``pipelines.video_dits`` (``FULL_SIZE``: Wan 2.1 1.3B / 14B, CogVideoX-5B, HunyuanVideo,
LTX-Video 0.9 (2B), Mochi 1 preview from their released configs, random weights, bf16 on the GPU; or a
``tiny-<family>`` one, fp32), one forward as the model's pipeline calls it at each ``--resolution``
(``VIDEO_SIZES``, the pipeline's default first; video tokens, text tokens on top):

    --model         --resolution   frames, height x width   video tokens (+ text)     batch
    wan2.1-1.3b     480p           81, 480 x 832            32,760 (512, cross)       2
                    720p           81, 720 x 1280           75,600 (512, cross)       2
    wan2.1-14b      480p, 720p     as wan2.1-1.3b
    cogvideox-5b    480x720x49     49, 480 x 720            17,550 + 226 joined       2
    hunyuan-video   720p           129, 720 x 1280          118,800 + 256 joined      1 (embedded guidance)
                    540p           129, 544 x 960           67,320 + 256 joined       1
    ltx-video       512x704x161    161, 512 x 704           7,392 (128, cross)        2
    mochi-1         480x848x19     19, 480 x 848            6,360 + 256 joined        2
                    480x848x163    163, 480 x 848           44,520 + 256 joined       2

Batch 2 is classifier-free guidance.  Per backend (names of ``pasa_diffusers.backends.BACKENDS``, installed
by ``install.apply``: the model's own processors, attention routed): the first forward's wall time (with
the compile in a compiled row), the forward's time (the timer's median over ``--iters`` forwards after one
warm-up and three estimating ones), the first backend's time over it (> 1: faster), the attention's share of
an eager forward (``harness.attention_share``: the time inside the attention calls, by CUDA events around
each), the peak GPU memory of the forward, whether the output is finite, its relative RMS difference to the
first backend's, and the fallback calls.  ``--compile`` adds ``torch.compile``d forwards of the named backends
(or all): each repeated block compiled with ``fullgraph=True`` (regional compilation, what diffusers'
``compile_repeated_blocks`` does and recommends for these models: one block's graph, compiled once, where the
whole Wan 2.1 1.3B as one graph had not finished compiling after 150 s on the H200, journal 60), or the whole
transformer with ``--whole-graph``.  The peers (FA3, SageAttention, SDPA's single backends) take no mask:
HunyuanVideo's joint attention and LTX-Video's cross-attention carry a text mask, so there they fall back to
SDPA (counted).

One H200, SDPA, estimated from Wan 2.1 1.3B's measured 1239 / 4950 ms at 32,760 / 75,600 tokens (a linear
term scaled by parameters and batch, a quadratic one by layers x attention width and batch; it gives
CogVideoX-5B 1.73 s against 1.58 s measured): HunyuanVideo 720p ~27 s a forward, 540p ~11 s; Mochi 19
frames ~0.9 s, 163 frames ~9 s; LTX-Video ~0.2 s.  A backend's row takes ``--iters`` + 6 forwards.

The sparse backends (``pasa-sparse``, ``pasa-fp8-sparse``) run ``--mask`` (default ``radial``) on the
self-attention's token sequence of the resolution (``video_dits.full_size_tokens``; ``tiny-wan``'s 3 x 4 x 4,
one block: dense), as a step past the dense steps, the first ``--dense-layers`` layers dense (default 1); the
row's ``mask density`` is the share of (query, key) pairs the mask keeps.  Its quality is a checkpoint's question
(random weights attend almost uniformly): ``pasa coverage`` and ``pasa compare`` on the user's model.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict

import torch

from pasa_diffusers.backends import BACKENDS, SPARSE
from pasa_diffusers.metrics import records
from pasa_diffusers.pipelines.names import COVERAGE_MASKS
from pasa_diffusers.pipelines.video_dits import (FAMILIES, FULL_SIZE, VIDEO_SIZES, example_inputs,
                                                 full_size_inputs, full_size_transformer, full_size_tokens,
                                                 tiny_transformer)
from pasa_diffusers.video_masks import VideoTokens

from . import harness

NAME = "dit"
MODELS = tuple(FULL_SIZE) + tuple(f"tiny-{family}" for family in FAMILIES)
SIZES = {name: tuple(VIDEO_SIZES[family]) for name, (_, _, family) in FULL_SIZE.items()}
"""Full-size model -> its ``--resolution`` names, the default first."""


def make_model(name: str) -> torch.nn.Module:
    """A full-size model in bf16 on the GPU, or a tiny one in fp32 on the harness's device."""
    if name.startswith("tiny-"):
        return tiny_transformer(name.removeprefix("tiny-")).to(harness.device())
    return full_size_transformer(name, device="cuda", dtype=torch.bfloat16)


def make_inputs(name: str, model: torch.nn.Module, resolution: str) -> dict:
    """The forward's inputs: a tiny model's example ones, a full-size one's at ``resolution`` (``VIDEO_SIZES``)."""
    if name.startswith("tiny-"):
        family = name.removeprefix("tiny-")
        inputs = example_inputs(family, model, torch.Generator().manual_seed(1))
        return {k: v.to(harness.device()) if torch.is_tensor(v) else v for k, v in inputs.items()}
    return full_size_inputs(name, model, resolution)


def repeated_blocks(model: torch.nn.Module) -> list[str]:
    """The block classes regional compilation compiles: the model's ``_repeated_blocks`` (diffusers' list for
    ``compile_repeated_blocks``) or, where diffusers leaves it empty (CogVideoX, Mochi), the classes of its
    ``transformer_blocks``."""
    named = list(getattr(model, "_repeated_blocks", None) or ())
    blocks = getattr(model, "transformer_blocks", None) or ()
    found = named or sorted({type(block).__name__ for block in blocks})
    if not found:
        raise ValueError(f"bench.dit: {type(model).__name__} names no repeated blocks (_repeated_blocks) and has no "
                         "transformer_blocks: use --whole-graph")
    return found


TINY_TOKENS = {"tiny-wan": VideoTokens(3, 4, 4)}
"""The tiny models whose self-attention sequence the sparse backends know (``example_inputs``' 3 x 8 x 8 latents
over Wan's 2 x 2 patch)."""


def tokens_of(name: str, resolution: str) -> VideoTokens | None:
    """The self-attention sequence of one forward (``None``: a tiny model other than ``TINY_TOKENS``')."""
    return TINY_TOKENS.get(name) if name.startswith("tiny-") else full_size_tokens(name, resolution)


def forward_rows(model: torch.nn.Module, name: str, resolution: str, args, timer: harness.Timer) -> list[dict]:
    """Every backend (and compiled mode) at one resolution; the first backend is the baseline."""
    inputs = make_inputs(name, model, resolution)
    regions = None if args.whole_graph or args.compile is None else repeated_blocks(model)
    sparse = {"mask": args.mask, "dense_steps": 0, "dense_layers": args.dense_layers}
    options = {backend: sparse for backend in args.backends if backend in SPARSE}
    tokens = tokens_of(name, resolution)
    rows = harness.model_runs(model, args.backends, args.compile, lambda runner: runner(**inputs)[0], timer,
                              regions=regions, options=options, tokens=tokens)
    video = None if name.startswith("tiny-") else tokens.n_video
    return [{"model": name, "resolution": resolution, "video_tokens": video, **row} for row in rows]


def _density(sparse: dict | None) -> str:
    if sparse is None:
        return "-"
    return "per call" if sparse["density"] is None else f"{sparse['density']:.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(NAME, __doc__)
    p.add_argument("--model", default="wan2.1-1.3b", choices=MODELS, help="the transformer (default: wan2.1-1.3b)")
    p.add_argument("--resolution", nargs="+", default=None, metavar="SIZE",
                   choices=sorted({size for sizes in SIZES.values() for size in sizes}),
                   help="video sizes of a full-size model, its pipeline's default first (default: that one): "
                        + "; ".join(f"{name} {' '.join(sizes)}" for name, sizes in SIZES.items())
                        + " (the table above); the tiny models take none (their example inputs)")
    p.add_argument("--backends", nargs="+", default=["sdpa", "pasa"], choices=list(BACKENDS), metavar="BACKEND",
                   help=f"attention backends, the first is the baseline; of {', '.join(BACKENDS)} (default: sdpa pasa)")
    p.add_argument("--compile", nargs="*", default=None, metavar="BACKEND",
                   help="also time torch.compile'd forwards: of every backend, or of the named ones; each "
                        "transformer block compiled (regional compilation, as diffusers' compile_repeated_blocks)")
    p.add_argument("--whole-graph", action="store_true",
                   help="with --compile: compile the whole transformer as one graph instead of its blocks")
    p.add_argument("--iters", type=int, default=5, help="timed forwards per backend (default: 5)")
    p.add_argument("--mask", choices=tuple(COVERAGE_MASKS), default="radial",
                   help="the sparse backends' mask (default radial)")
    p.add_argument("--dense-layers", type=int, default=1,
                   help="the sparse backends' first self-attention layers run dense (default 1)")
    args = p.parse_args(argv)
    if args.whole_graph and args.compile is None:
        p.error("--whole-graph: says how --compile compiles; give --compile too")
    unknown = sorted(set(args.compile or ()) - set(args.backends))
    if unknown:
        p.error(f"--compile {' '.join(unknown)}: not among --backends {' '.join(args.backends)}")
    sparse = [b for b in args.backends if b in SPARSE]
    if sparse and args.model.startswith("tiny-") and args.model not in TINY_TOKENS:
        p.error(f"--backends {' '.join(sparse)}: the sparse backends need the self-attention's token grid, which "
                f"bench.dit knows for the full-size models and {', '.join(TINY_TOKENS)}, not {args.model}")
    sizes = SIZES.get(args.model, ())
    other = [size for size in args.resolution or () if size not in sizes]
    if other:
        p.error(f"--resolution {' '.join(other)}: not a size of {args.model} "
                f"({'its sizes: ' + ' '.join(sizes) if sizes else 'a tiny model runs its example inputs'})")
    resolutions = args.resolution or (list(sizes[:1]) if sizes else ["own"])
    if not args.model.startswith("tiny-") and not torch.cuda.is_available():
        print(f"bench.{NAME}: --model {args.model} needs a CUDA GPU (the full-size transformer); "
              "--model tiny-<family> runs anywhere", file=sys.stderr)
        return 2
    problem = harness.cpu_problem(NAME) if not torch.cuda.is_available() and any(
        BACKENDS[b].variant is not None for b in args.backends) else None
    if problem:
        print(problem, file=sys.stderr)
        return 2

    cmd, env = harness.command(NAME, argv), harness.environment()
    timer = harness.Timer(warmup_ms=0.0, rep_ms=0.0, min_runs=args.iters, flush_l2=False)
    model = make_model(args.model)
    rows = [r for resolution in harness.progress(resolutions, NAME)
            for r in forward_rows(model, args.model, resolution, args, timer)]
    first = args.backends[0]
    text = harness.header(f"bench.dit: one forward of {args.model} per attention backend", env, cmd) + "\n" + \
        records.markdown_table(
            ["resolution", "video tokens", "backend", "mode", "first call s", "forward ms", f"vs {first}",
             "attention share", "peak MiB", "finite", f"rel. RMS diff to {first}", "fallback calls", "mask density"],
            [[r["resolution"], "-" if r["video_tokens"] is None else f"{r['video_tokens']:,}", r["backend"],
              r["mode"], f"{r['first_call_s']:.1f}", f"{r['ms']:.1f}", f"{r['vs_first']:.3f}",
              harness.share_text(r["attention_share"]), "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}",
              r["finite"], f"{r['rel_rms_diff']:.2e}", r["fallback_calls"], _density(r["sparse"])] for r in rows],
            align="lrllrrrrrlrrr") + "\n"
    harness.write_report(args.out, NAME, text, {"bench": NAME, "command": cmd, "environment": env,
                                                "timer": asdict(timer), "rows": rows})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
