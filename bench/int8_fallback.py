"""How fast is the 8-bit path per attention kernel, and what do its 16-bit blocks cost, none or all flagged?

    python -m bench.int8_fallback --dtype bfloat16 --out DIR       # the video transformers' shapes, bf16
    python -m bench.int8_fallback --shapes svd-spatial --dtype float16 --out DIR
    TRITON_INTERPRET=1 python -m bench.int8_fallback --shapes tiny --out DIR   # a CPU, under the interpreter

The 8-bit path (``kernels.dispatch.forward`` of ``precision="int8"``: its pre-pass, then the attention on the codes
by the Gluon Hopper kernel, ``hopper_int8.py``, or the portable one: ``--kernels``) with ``fallback=False`` (every
key block from the codes) and ``fallback=True`` (the default: blocks an 8-bit code cannot hold in 16 bits,
``reference_int8`` step 4b); the Gluon kernel also under each config of ``--gluon-configs``
(BLOCK_N,stages,consumers), with ``--prepass`` the pre-pass alone, with ``--kernel-alone`` the Gluon kernel alone
on one pre-pass's outputs (its tuned config and each of ``--gluon-configs``), with ``--one-launch`` each kernel's
path in one launch (the router's ranges, which hold the pre-pass's memory down, lifted).  Beside them, in the same
run: SDPA's cuDNN, flash and efficient backends and the peers that import (FA3 bf16 and fp8, SageAttention).  Two
inputs generated on the device: ``benign`` (q, k, v ~ N(0, 1): no block flagged) and ``two biases per block`` (q ~
N(2, 1), k ~ N(0, 1) plus a per-channel bias of +-(20..40) that jumps every 128 keys half a block off the centre
blocks, ``numerics.input_classes``' "jump misaligned": every block flagged).  Columns: ms (the median of CUDA-event
runs after warm-up, L2 flushed), the ratio to SDPA's fastest backend and to the same kernel's ``fallback=False``
time on the same input, and the share of blocks computed in 16 bits (``block_tally``, from the first call).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence

import torch

from pasa_diffusers.kernels import block_tally
from pasa_diffusers.shift_matrix import DEFAULT_BETA
from pasa_diffusers.kernels import dispatch, hopper_int8, int8, quantize, tuning
from pasa_diffusers.variants import PV_BITS, Variant
from pasa_diffusers.metrics import records

from . import harness

NAME = "int8_fallback"
INPUTS = ("benign", "two biases per block")
KERNELS = {"auto": "auto", "gluon": "gluon-int8", "portable": "portable-int8"}
"""``--kernels``' names -> the router's (``dispatch.KERNELS``)."""


def make_inputs(shape: harness.Shape, kind: str, gen: torch.Generator, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kind`` of :data:`INPUTS` at ``shape`` on ``gen``'s device, (B, N, H, D) memory viewed as (B, H, N, D)."""
    q, k, v = harness.make_inputs(shape, gen, dtype=dtype)
    if kind == "benign":
        return q, k, v
    blocks = shape.nk // 128 + 2
    size = (shape.b, shape.hk, blocks, shape.d)
    sign = torch.where(torch.rand(size, generator=gen, device=gen.device) < 0.5, -1.0, 1.0)
    bias = sign * (20.0 + 20.0 * torch.rand(size, generator=gen, device=gen.device))
    block = (torch.arange(shape.nk, device=gen.device) + 64) // 128
    return (q + 2.0).to(dtype), (k.float() + bias[:, :, block, :]).to(dtype), v


ONE_LAUNCH_SHARE = 1e9
"""A ``QUANTIZE_SHARE`` the 8-bit pre-pass never reaches."""


@contextlib.contextmanager
def _one_launch():
    """The router's ranges of 8-bit calls lifted (``dispatch.QUANTIZE_SHARE``): every call in one launch, whatever
    its pre-pass writes."""
    share, dispatch.QUANTIZE_SHARE = dispatch.QUANTIZE_SHARE, ONE_LAUNCH_SHARE
    try:
        yield
    finally:
        dispatch.QUANTIZE_SHARE = share


def _int8_method(fallback: bool, kernel: str, config: dict | None = None, pv_bits: int = 16,
                 one_launch: bool = False) -> harness.Method:
    """The 8-bit path through the router; ``one_launch``: with its ranges lifted (:func:`_one_launch`)."""
    ranges = _one_launch if one_launch else contextlib.nullcontext

    def build(q, k, v):
        out, scale = torch.empty_like(q), q.shape[-1] ** -0.5
        block_tally.reset()

        def call():
            with ranges():
                return dispatch.forward(q, k, v, out, scale=scale, variant=Variant("exact", "int8"),
                                        beta=DEFAULT_BETA, fallback=fallback, kernel=KERNELS[kernel], config=config,
                                        pv_bits=pv_bits)
        call()
        share = block_tally.counts()["share"] if fallback else 0.0
        ran = "" if config is None else f"; ran {_ran_label(config, q, k)}"
        return harness.Prepared(call, f"{100 * share:.0f} % of blocks in 16 bits{ran}", {"share_16_bit": share})
    tiles = "" if config is None else " " + _config_label(config)
    whole = ", one launch" if one_launch else ""
    return harness.Method(f"int8 {kernel}{tiles}{_pv_label(pv_bits)}, fallback {'on' if fallback else 'off'}{whole}",
                          "ours", build)


def _kernel_alone_method(config: dict | None, pv_bits: int) -> harness.Method:
    """The Gluon kernel alone under ``config`` (``None``: the tuned one) on one pre-pass's outputs, built before the
    timing: no pre-pass and no ranges in the time, so that a config's effect on the kernel is not diluted."""
    def build(q, k, v):
        out, scale = torch.empty_like(q), q.shape[-1] ** -0.5
        prep = quantize.prepare(q, k, v, scale=scale, pv_bits=pv_bits, bias=True)
        return harness.Prepared(lambda: hopper_int8.forward(q, prep, out, scale=scale, config=config),
                                f"ran {_ran_label(config or {}, q, k)}", {})
    tiles = "tuned" if config is None else _config_label(config)
    return harness.Method(f"int8 gluon kernel alone, {tiles}{_pv_label(pv_bits)}", "ours", build)


def _pv_label(pv_bits: int) -> str:
    """A row name's ``P V`` precision: nothing for 16 bits, ``, FP8 P V`` for 8."""
    return "" if pv_bits == 16 else ", FP8 P V"


def _prepass_method() -> harness.Method:
    """The pre-pass alone (``quantize.prepare`` with the fallback's flags and the Gluon kernel's bias rows), so
    that a row's attention time is the kernel's minus this."""
    def build(q, k, v):
        scale = q.shape[-1] ** -0.5
        return harness.Prepared(lambda: quantize.prepare(q, k, v, scale=scale, bias=True).q_scale, "", {})
    return harness.Method("int8 pre-pass alone", "ours", build)


GLUON_WORDS = {"lazy": {"lazy": True}, "eager": {"lazy": False}, "pingpong": {"pingpong": True},
               "nopingpong": {"pingpong": False}}
"""The words a ``--gluon-configs`` entry may end with, and the config keys each sets."""


def _gluon_config(text: str) -> dict:
    fields = text.split(",")
    try:
        block_n, stages, consumers = (int(x) for x in fields[:3])
        words = [GLUON_WORDS[word] for word in fields[3:]]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"--gluon-configs {text!r}: expected BLOCK_N,STAGES,CONSUMERS followed by "
                                         f"any of {', '.join(GLUON_WORDS)}, e.g. 64,4,2 or 128,2,2,eager,pingpong")
    config = {"BLOCK_N": block_n, "num_stages": stages, "consumers": consumers}
    for keys in words:
        config.update(keys)
    return config


def _config_label(config: dict) -> str:
    """``128,2,2 eager pingpong``: the tile sizes, then the rescale and the turns (or ``nopingpong``) where the
    config names them; what it leaves out is the tuned config's (``hopper_int8.tuned_config``)."""
    label = f"{config['BLOCK_N']},{config['num_stages']},{config['consumers']}"
    if "lazy" in config:
        label += " lazy" if config["lazy"] else " eager"
    if "pingpong" in config:
        label += " pingpong" if config["pingpong"] else " nopingpong"
    return label


def _ran_label(config: dict, q: torch.Tensor, k: torch.Tensor) -> str:
    """The config the Gluon kernel runs for ``config`` at these inputs: its keys over the tuned config of the head
    dim and key count (``hopper_int8.tuned_config``), so that a row says every word, the tuned ones included."""
    return _config_label({**hopper_int8.tuned_config(q.shape[-1], k.shape[2]), **config})


def _pv_bits(text: str) -> list[int]:
    try:
        found = [int(x) for x in text.split(",") if x]
    except ValueError:
        found = []
    if not found or any(bits not in PV_BITS for bits in found):
        raise argparse.ArgumentTypeError(f"--pv-bits {text!r}: expected a comma-separated list of {PV_BITS}")
    return found


def table(rows: Sequence[dict]) -> str:
    f = harness.fmt
    return records.markdown_table(
        ["shape", "(B, Hq/Hk, N, D)", "input", "method", "ms", "vs SDPA's best", "vs fallback off", "note"],
        [[r["shape"], r["bhnd"], r["input"], r["method"], f(r["ms"], ".3f"), f(r["vs_best_sdpa"], ".2f"),
          f(r["vs_off"], ".2f"), r["note"]] for r in rows], align="llllrrrl")


def tuned_table(entries: Sequence[dict]) -> str:
    """One line per autotuning key: the chosen config and every config's time."""
    return records.markdown_table(
        ["key", "chosen", "every config (ms)"],
        [[", ".join(f"{k}={v}" for k, v in e["key"].items()), str(e["config"]),
          "; ".join(f"{c}: {t:.3f}" for c, t in e["timings_ms"].items())] for e in entries])


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(NAME, __doc__)
    harness.add_shape_arguments(p, default="dit")
    harness.add_dtype_argument(p)
    harness.add_timer_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    p.add_argument("--kernels", type=harness.name_list(tuple(KERNELS)), default="gluon,portable",
                   help=f"the attention kernels on the codes, of {tuple(KERNELS)} (default: gluon,portable)")
    p.add_argument("--gluon-configs", type=_gluon_config, nargs="*", default=[],
                   metavar="BLOCK_N,STAGES,CONSUMERS[,lazy|eager][,pingpong|nopingpong]",
                   help="Gluon configs timed too, with the fallback on; lazy/eager: the accumulator's rescale, "
                        "pingpong|nopingpong: the consumers' GEMMs in turns or not; a word left out takes the tuned "
                        "config's (default: none)")
    p.add_argument("--prepass", action="store_true", help="also time the pre-pass alone")
    p.add_argument("--kernel-alone", action="store_true",
                   help="also time the Gluon kernel alone (no pre-pass, no ranges) in its tuned config and each of "
                        "--gluon-configs")
    p.add_argument("--one-launch", action="store_true",
                   help="also time each kernel's path with the fallback on in one launch (the pre-pass's ranges "
                        "lifted: the ranges' cost is the difference)")
    p.add_argument("--pv-bits", type=_pv_bits, default="16",
                   help=f"P V precisions, comma-separated, of {PV_BITS} (default: 16; 8 is FP8 e4m3)")
    p.add_argument("--inputs", type=harness.name_list(INPUTS), default=",".join(INPUTS),
                   help=f"the inputs, comma-separated, of {INPUTS} (default: both)")
    args = p.parse_args(argv)
    problem = harness.cpu_problem(NAME)
    if problem:
        print(problem, file=sys.stderr)
        return 2

    cmd, env = harness.command(NAME, argv), harness.environment()
    dtype = harness.INPUT_DTYPES[args.dtype]
    timer = harness.Timer(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    gen = torch.Generator(device=harness.device()).manual_seed(args.seed)
    peers, missing = harness.peer_methods()
    for name, reason in missing.items():
        harness.log(f"{name} not run: {reason}")
    pairs = [(_int8_method(False, kernel, pv_bits=bits), _int8_method(True, kernel, pv_bits=bits))
             for bits in args.pv_bits for kernel in args.kernels]
    fallback_off = {m.name: off.name for off, on in pairs for m in (off, on)}  # the ratio column's baseline
    methods = [*(harness.sdpa_method(backend) for backend in ("cudnn", "flash", "efficient")), *peers,
               *(m for pair in pairs for m in pair),
               *(_int8_method(True, "gluon", cfg, bits) for bits in args.pv_bits for cfg in args.gluon_configs),
               *([_prepass_method()] if args.prepass else []),
               *(_int8_method(True, kernel, pv_bits=bits, one_launch=True) for bits in args.pv_bits
                 for kernel in (args.kernels if args.one_launch else [])),
               *(_kernel_alone_method(cfg, bits) for bits in args.pv_bits
                 for cfg in ([None, *args.gluon_configs] if args.kernel_alone else []))]
    rows: list[dict] = []
    with torch.no_grad():
        for shape in harness.progress(harness.shapes(args.shapes, args.frames), NAME):
            for kind in args.inputs:
                q, k, v = make_inputs(shape, kind, gen, dtype)
                measured = harness.measure(shape, methods, q, k, v, timer=timer)
                for r in measured:
                    off = next((o.ms for o in measured if o.method == fallback_off.get(r.method)), None)
                    rows.append({**harness.rows_payload([r])[0], "input": kind, "note": r.status(),
                                 "vs_off": off / r.ms if off and r.ms else None})
                del q, k, v
                harness.free_memory()
    tuned = [e for e in tuning.table_payload(env.get("gpu", ""), {})["entries"] if e["kernel"] == "int8.attention"]
    text = (harness.header(f"bench.int8_fallback: the 8-bit path per kernel and its 16-bit blocks, {args.dtype}",
                                 env, cmd)
            + "\n" + table(rows) + "\n\nThe attention kernel's autotuning (every config timed, ms):\n\n"
            + tuned_table(tuned) + "\n")
    harness.write_report(args.out, NAME, text, {"bench": NAME, "command": cmd, "environment": env, "rows": rows,
                                                "tuned": tuned})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
