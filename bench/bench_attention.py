"""Forward attention timings on one GPU: SDPA's backends beside our FlashAttention and PASA kernels.

    python bench/bench_attention.py --out bench_out              # every shape
    python bench/bench_attention.py --quick --shapes spatial     # fewer shapes

Inputs are what diffusers holds: (B, N, H, D) contiguous fp16 tensors viewed as (B, H, N, D) by a
transpose; every method gets those same views.  Each method is timed with
``triton.testing.do_bench`` (median over 100 ms after 25 ms of warm-up; it clears the L2 cache
before every call, so small shapes are not timed out of L2) after one untimed call (autotuning).
Reported: ms, TFLOP/s = 4 B H Nq Nk D / t, GB/s = bytes of q, k, v and o read or written once / t,
and the time of the best SDPA backend over the method's (``vs best SDPA`` > 1: faster than it).
A backend that errors (or is unavailable) is reported with its error instead of a time.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402

from pasa_diffusers.kernels import attn_fwd_gluon, packed_fwd, pasa_fwd  # noqa: E402
from pasa_diffusers.ops import pasa_attention  # noqa: E402
from pasa_diffusers.reference import DEFAULT_BETA  # noqa: E402
from pasa_diffusers.rules import SHIFT_BLOCK  # noqa: E402


@dataclass(frozen=True)
class Shape:
    group: str
    name: str
    b: int
    hq: int
    hk: int
    n: int
    d: int


def svd_shapes(frames: int) -> list[Shape]:
    """SVD-XT at 576x1024 (latents 72x128), CFG batch 2: spatial (2F, H, HW, 64), temporal (2HW, H, F, 64)."""
    b = 2 * frames
    spatial = [Shape("spatial", f"F{frames} N{n}", b, h, h, n, 64)
               for n, h in [(9216, 5), (2304, 10), (576, 20), (144, 20)]]
    temporal = [Shape("temporal", f"F{frames} HW{hw // 2}", hw, h, h, frames, 64)
                for hw, h in [(18432, 5), (4608, 10)]]
    return spatial + temporal


PAPER = Shape("paper", "Qwen2-7B 1407", 1, 28, 4, 1407, 128)


def select_shapes(which: str, quick: bool) -> list[Shape]:
    shapes: list[Shape] = []
    for frames in ((25,) if quick else (14, 25)):
        for s in svd_shapes(frames):
            if quick and s.name.endswith(("N2304", "N144", "HW2304")):
                continue
            if which in ("all", s.group):
                shapes.append(s)
    if which in ("all", "paper"):
        shapes.append(PAPER)
    return shapes


def make_inputs(s: Shape, gen: torch.Generator, dtype=torch.float16):
    """(B, N, H, D) contiguous tensors viewed as (B, H, N, D)."""
    def draw(h, n):
        return torch.randn(s.b, n, h, s.d, generator=gen, device="cuda", dtype=dtype).transpose(1, 2)
    return draw(s.hq, s.n), draw(s.hk, s.n), draw(s.hk, s.n)


@dataclass
class Row:
    shape: str
    group: str
    bhnd: str
    method: str
    ms: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    vs_best_sdpa: float | None = None
    config: str = ""
    error: str = ""
    extra: dict = field(default_factory=dict)


def methods(s: Shape):
    """(name, callable(q, k, v) -> out, kind) for every method; kind 'sdpa', 'ours', 'peer'."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = {"enable_gqa": True} if s.hq != s.hk else {}

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, **gqa)
        return run

    out = [("sdpa-flash", sdpa(SDPBackend.FLASH_ATTENTION), "sdpa"),
           ("sdpa-cudnn", sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa"),
           ("sdpa-efficient", sdpa(SDPBackend.EFFICIENT_ATTENTION), "sdpa")]

    def op(precision, shift):
        def run(q, k, v):
            # the op takes (B, N, H, D) tensors from diffusers: pass the contiguous bases
            return pasa_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), precision=precision,
                                  shift=shift, layout="bnhd")
        return run

    out += [("ours fa-half", op("half", False), "ours"), ("ours fa-hybrid", op("hybrid", False), "ours"),
            ("ours pasa-half", op("half", True), "ours"), ("ours pasa-hybrid", op("hybrid", True), "ours"),
            ("ours exact-half", op("half", "exact"), "ours"), ("ours exact-hybrid", op("hybrid", "exact"), "ours")]

    def wrapper(precision, shift, shift_k, kernel="auto"):
        def run(q, k, v):
            out = torch.empty_like(q)  # keeps q's (B, N, H, D) memory layout, as the op's output
            return pasa_fwd.pasa_forward(q, k, v, out, scale=1.0 / math.sqrt(q.shape[-1]), precision=precision,
                                         shift=shift, beta=DEFAULT_BETA, shift_k=shift_k, kernel=kernel)
        return run

    for precision in ("half", "hybrid"):
        for mode in ("fused", "prepass"):
            out.append((f"ours pasa-{precision} [{mode}]", wrapper(precision, True, mode), "ablation"))
    if s.n <= 128:  # one key block: the exact shift centres in the loop ("auto") or by its pre-pass
        for precision in ("half", "hybrid"):
            out.append((f"ours exact-{precision} [prepass]", wrapper(precision, "exact", "prepass"), "ablation"))
    else:  # several key blocks: the default runs the Gluon kernel on sm_90 (fp16, d = 64), else the portable one
        out.append(("ours exact-hybrid [portable]", wrapper("hybrid", "exact", "auto", "portable"), "ablation"))

    try:
        from sageattention import sageattn

        if s.hq == s.hk:
            out.append(("sageattn", lambda q, k, v: sageattn(q, k, v, tensor_layout="HND", is_causal=False), "peer"))
    except Exception:  # optional peer: not installed
        pass
    return out


def _tuned_config(name: str, packed: bool, gluon_keys: int | None) -> str:
    """The autotuner's choice for one of our methods (``packed``: the exact shift's default goes to the
    packed kernel at this shape; ``gluon_keys``: its hybrid goes to the Gluon kernel with that many
    keys, whose config is a measured table); the exact shift with pre-centred keys tunes its tile like plain FA."""
    if not name.startswith("ours") or pasa_fwd.INTERPRET:
        return ""
    if gluon_keys is not None and name == "ours exact-hybrid":
        return f"gluon {attn_fwd_gluon.tuned_config(gluon_keys)}"
    if packed and "exact" in name and "[" not in name:
        tuner = packed_fwd._packed_fwd_tuned
    elif "fa-" in name or "exact" in name:
        tuner = pasa_fwd._tiled_fwd_tuned
    else:
        tuner = pasa_fwd._shift_fwd_tuned
    cfg = getattr(tuner, "best_config", None)
    return "" if cfg is None else str(cfg)


def bench_shape(s: Shape, gen: torch.Generator, warmup: int, rep: int) -> list[Row]:
    q, k, v = make_inputs(s, gen)
    flops = 4.0 * s.b * s.hq * s.n * s.n * s.d
    nbytes = 2 * (2 * s.b * s.hq * s.n * s.d + 2 * s.b * s.hk * s.n * s.d)
    rows = []
    gluon = s.n > SHIFT_BLOCK and attn_fwd_gluon.unsuitable_reason(q, v, q, precision="hybrid",
                                                                    block_n=SHIFT_BLOCK) is None
    for name, fn, kind in methods(s):
        row = Row(f"{s.group} {s.name}", s.group, f"({s.b}, {s.hq}/{s.hk}, {s.n}, {s.d})", name)
        try:
            out = fn(q, k, v)
            torch.cuda.synchronize()
            row.extra["finite"] = bool(torch.isfinite(out).all().item())
            ms = triton.testing.do_bench(lambda: fn(q, k, v), warmup=warmup, rep=rep, return_mode="median")
            row.ms, row.tflops, row.gbps = ms, flops / ms * 1e-9, nbytes / ms * 1e-6
            row.config = _tuned_config(name, packed_fwd.packs(s.n, s.n), s.n if gluon else None)
        except Exception as e:  # a backend that cannot run this shape: report it
            row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        row.extra["kind"] = kind
        rows.append(row)
    best = min((r.ms for r in rows if r.extra["kind"] == "sdpa" and r.ms), default=None)
    for r in rows:
        if best and r.ms:
            r.vs_best_sdpa = best / r.ms
    del q, k, v
    torch.cuda.empty_cache()
    return rows


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    try:
        cudnn = torch.backends.cudnn.version()
    except Exception:
        cudnn = None
    return {"gpu": props.name, "sm": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda, "cudnn": cudnn,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def markdown(rows: list[Row], env: dict, command: str) -> str:
    head = (f"GPU {env['gpu']} (sm_{env['sm'].replace('.', '')}), torch {env['torch']}, triton {env['triton']}, "
            f"CUDA {env['cuda']}, cuDNN {env['cudnn']}; `{command}`\n\n")
    lines = ["| shape | (B, Hq/Hk, N, D) | method | ms | TFLOP/s | GB/s | vs best SDPA | config / error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    for r in rows:
        note = r.error or r.config + ("" if r.extra.get("finite", True) else " (non-finite output)")
        lines.append(f"| {r.shape} | {r.bhnd} | {r.method} | {num(r.ms, '.3f')} | {num(r.tflops, '.0f')} | "
                     f"{num(r.gbps, '.0f')} | {num(r.vs_best_sdpa, '.2f')} | {note} |")
    return head + "\n".join(lines) + "\n"


SUMMARY_COLUMNS = [("sdpa-flash", "SDPA flash"), ("sdpa-cudnn", "SDPA cuDNN"), ("sdpa-efficient", "SDPA eff."),
                   ("ours fa-half", "FA half"), ("ours fa-hybrid", "FA hybrid"), ("ours pasa-half", "PASA half"),
                   ("ours pasa-hybrid", "PASA hybrid"), ("ours exact-half", "exact half"),
                   ("ours exact-hybrid", "exact hybrid (default)"),
                   ("ours exact-hybrid [prepass]", "exact hybrid, pre-pass"),
                   ("ours pasa-half [fused]", "PASA half, fused shift"),
                   ("ours pasa-half [prepass]", "PASA half, pre-pass"), ("sageattn", "SageAttn")]


def summary(rows: list[dict]) -> str:
    """One line per shape, one column per method: ms, TFLOP/s (spatial) or GB/s (temporal), ratio."""
    cells: dict[str, dict[str, dict]] = {}
    for r in rows:
        cells.setdefault(r["shape"], {"bhnd": r["bhnd"]})[r["method"]] = r
    lines = ["| shape | (B, Hq/Hk, N, D) | " + " | ".join(title for _, title in SUMMARY_COLUMNS) + " |",
             "| --- | --- |" + " --- |" * len(SUMMARY_COLUMNS)]
    for shape, by_method in cells.items():
        out = []
        for method, _ in SUMMARY_COLUMNS:
            r = by_method.get(method)
            if r is None or r["ms"] is None:
                out.append("-")
                continue
            rate = f"{r['gbps']:.0f} GB/s" if shape.startswith("temporal") else f"{r['tflops']:.0f} TF/s"
            out.append(f"{r['ms']:.3g} ms<br>{rate}<br>**{r['vs_best_sdpa']:.2f}x**")
        lines.append(f"| {shape} | {by_method['bhnd']} | " + " | ".join(out) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=["spatial", "temporal", "paper", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="25 frames only and fewer shapes")
    parser.add_argument("--out", default=None, help="directory for bench_attention.md and bench_attention.json")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warm-up in ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time in ms")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--summarize", metavar="JSON", default=None,
                        help="print the one-line-per-shape table of a saved bench_attention.json and exit")
    args = parser.parse_args(argv)
    if args.summarize:
        with open(args.summarize) as f:
            print(summary(json.load(f)["rows"]), end="")
        return 0
    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    command = "python bench/bench_attention.py " + " ".join(argv if argv is not None else sys.argv[1:])
    env = environment()
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    rows: list[Row] = []
    for s in select_shapes(args.shapes, args.quick):
        t0 = time.time()
        rows += bench_shape(s, gen, args.warmup, args.rep)
        print(f"# {s.group} {s.name}: {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
    text = markdown(rows, env, command.strip())
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_attention.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, "bench_attention.json"), "w") as f:
            json.dump({"environment": env, "command": command, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
