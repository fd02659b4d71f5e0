"""The Hopper exact-shift kernel (``kernels/attn_fwd_tma.py``): correctness first, then time, per config.

    PYTHONPATH=$PWD python bench/bench_hopper.py                      # SVD-XT shapes, every config
    PYTHONPATH=$PWD python bench/bench_hopper.py --configs 128,128,8,2,0,0 128,128,4,2,1,1
    PYTHONPATH=$PWD python bench/bench_hopper.py --shapes 50,5,9216,64 --no-ragged

For the GPU machine (an H200; Python 3.12, torch 2.11, triton 3.6; no diffusers needed).  Inputs are what
diffusers holds: (B, N, H, D) contiguous fp16 tensors viewed as (B, H, N, D).

1. Correctness, per config, before any timing: on fresh random inputs (q, k, v ~ N(0, 1), and a biased
   draw q, k ~ uniform(10, 50), v ~ N(0, 1)) the output buffer is poisoned with NaN, the kernel runs, and
   - every element must be finite (written, no NaN);
   - on a subset of (batch, head) slices, ``err = rel_rmse(out, golden)`` (float64 golden attention)
     must be <= 2 x the error of the FP32-accumulating reference of the same variant
     (``reference.exact_shift_reference(precision="hybrid")``) + 1e-6: the GPU suite's rule;
   - over the whole output, ``rel_rmse(out, portable)`` against the portable kernel
     (``pasa_attention(q, k, v)``, whose default is this variant) must be <= 3 x that reference error
     + 1e-6 (two estimates, each within its bound).
   Small cases with a ragged Nq and Nk, GQA and head dims 40 and 128 run too.  A config that fails any
   check is WRONG and is not timed.
2. Timing: ``triton.testing.do_bench`` medians (warm-up, L2 cleared each call) of SDPA's cuDNN, flash
   and efficient backends, the portable kernel (pre-pass included), the key pre-pass alone, and each
   correct config (kernel alone; "+ pre-pass" = kernel + pre-pass medians).  TFLOP/s = 4 B H Nq Nk D / t.

Writes ``bench_hopper.json`` and ``bench_hopper.md`` under ``$OUT`` (or ``--out``) when set.  The short
table (per shape: best config with its pre-pass, vs cuDNN) is printed last.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402

from pasa_diffusers import numerics  # noqa: E402
from hopper_bench_common import (Log, report_head, row_line, sdpa_with, tflops,  # noqa: E402  (bench/)
                                 time_baselines, timed_row, write_report)
from pasa_diffusers.kernels import attn_fwd_tma as tma  # noqa: E402
from pasa_diffusers.ops import pasa_attention  # noqa: E402
from pasa_diffusers.reference import exact_shift_reference, golden_attention  # noqa: E402

# (BLOCK_M, BLOCK_N, num_warps, num_stages, warp_specialize, r_on_tc): the configs that compiled without
# spills for sm_90 in bench/hopper_compile_check.py (triton 3.6); warp-specialised ones last (they may
# produce wrong output: each is checked before it is timed).
CONFIGS = [
    (128, 128, 8, 2, False, False), (128, 128, 8, 3, False, False), (64, 128, 4, 2, False, False),
    (64, 128, 4, 3, False, False), (128, 64, 8, 3, False, False), (128, 64, 4, 3, False, False),
    (128, 128, 8, 2, False, True), (128, 128, 4, 3, False, True), (64, 128, 4, 3, False, True),
    (128, 128, 4, 2, True, True), (128, 128, 4, 3, True, True), (64, 128, 4, 2, True, True),
    (128, 64, 4, 2, True, True), (128, 64, 4, 3, True, True),
]
SHAPES = [(50, 5, 9216, 64), (50, 10, 2304, 64), (50, 20, 576, 64)]  # SVD-XT 25 frames, CFG batch 2
# (B, Hq, Hk, Nq, Nk, D): correctness only
SMALL_CASES = [(2, 5, 5, 1000, 1000, 64), (1, 6, 2, 1000, 777, 64), (1, 4, 4, 300, 200, 40),
               (1, 4, 2, 333, 700, 128)]
K_HYBRID = 2.0
K_PORTABLE = 3.0
TINY = 1e-6
HEAD_DIM_CONFIGS = 2  # head dims other than 64 are checked with the first this-many configs and every WS one
TIME_BUDGET_S = 200.0  # no new config past this (the whole run must stay under 4 minutes)
DEVICE = "cuda"


def cfg_name(c) -> str:
    bm, bn, w, s, ws, rtc = c
    return f"{bm}x{bn} w{w} s{s}{' WS' if ws else ''}{' r-tc' if rtc else ''}"


def cfg_dict(c) -> dict:
    bm, bn, w, s, ws, rtc = c
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s, "warp_specialize": bool(ws),
            "r_on_tc": bool(rtc)}


def parse_config(text: str):
    bm, bn, w, s, ws, rtc = (int(x) for x in text.split(","))
    return (bm, bn, w, s, bool(ws), bool(rtc))


def bnhd_view(b, h, n, d, gen, *, biased=False):
    """(B, N, H, D) contiguous fp16 viewed as (B, H, N, D); biased: uniform(10, 50) (a sequence bias)."""
    if biased:
        x = torch.rand(b, n, h, d, generator=gen, device=DEVICE) * 40.0 + 10.0
    else:
        x = torch.randn(b, n, h, d, generator=gen, device=DEVICE)
    return x.to(torch.float16).transpose(1, 2)


def make_inputs(case, gen, biased):
    b, hq, hk, nq, nk, d = case
    q = bnhd_view(b, hq, nq, d, gen, biased=biased)
    k = bnhd_view(b, hk, nk, d, gen, biased=biased)
    v = bnhd_view(b, hk, nk, d, gen)
    return q, k, v


def run_tma(q, k_c, v, centres, cfg, *, poison=True):
    """Our kernel into a NaN-poisoned (B, N, H, D) buffer viewed as (B, H, N, D)."""
    b, h, n, d = q.shape
    out = torch.full((b, n, h, d), float("nan"), dtype=q.dtype, device=q.device).transpose(1, 2)
    return tma.exact_forward_tma(q, k_c, v, centres, out, scale=1.0 / math.sqrt(d), config=cfg)


def portable(q, k, v):
    """The portable kernel through the op, as a diffusers processor calls it; returns (B, H, N, D)."""
    return pasa_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout="bnhd").transpose(1, 2)


def subset(case):
    """(batch indices) checked against the float64 golden: the first and the last batch entry."""
    b = case[0]
    return [0] if b == 1 else [0, b - 1]


class Case:
    """One input draw with its pre-pass, references and their errors (computed once, shared by configs)."""

    def __init__(self, case, gen, biased):
        self.case, self.biased = case, biased
        self.q, self.k, self.v = make_inputs(case, gen, biased)
        self.k_c, self.centres = tma.centre_keys(self.k)
        idx = subset(case)
        qs, ks, vs = (t[idx] for t in (self.q, self.k, self.v))
        self.idx = idx
        self.gold = golden_attention(qs, ks, vs)
        ref = exact_shift_reference(qs, ks, vs, precision="hybrid", block_m=max(qs.shape[2], 1))
        self.err_ref = numerics.rel_rmse(ref, self.gold)
        self.port = portable(self.q, self.k, self.v)
        self.err_port = numerics.rel_rmse(self.port[idx], self.gold)

    @property
    def label(self):
        b, hq, hk, nq, nk, d = self.case
        gqa = f" Hk={hk}" if hk != hq else ""
        return f"({b},{hq},{nq},{d}){gqa}{' Nk=' + str(nk) if nk != nq else ''} {'biased' if self.biased else 'randn'}"

    def check(self, cfg) -> dict:
        out = run_tma(self.q, self.k_c, self.v, self.centres, cfg)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        nonfinite = numerics.nonfinite_count(out)
        err = numerics.rel_rmse(out[self.idx], self.gold) if nonfinite == 0 else float("nan")
        diff = numerics.rel_rmse(out, self.port) if nonfinite == 0 else float("nan")
        ok = (nonfinite == 0 and err <= K_HYBRID * self.err_ref + TINY and diff <= K_PORTABLE * self.err_ref + TINY)
        return {"case": self.label, "ok": bool(ok), "nonfinite": nonfinite, "err": err, "err_ref": self.err_ref,
                "err_portable": self.err_port, "diff_portable": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=None, help="B,H,N,D ... (default: the SVD-XT shapes)")
    ap.add_argument("--configs", nargs="*", default=None, help="BM,BN,warps,stages,ws,r_on_tc ... (ws/r_on_tc 0|1)")
    ap.add_argument("--no-ragged", action="store_true", help="skip the small ragged / GQA / head-dim cases")
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="correctness checks only, on the CPU under TRITON_INTERPRET=1 (tiny shapes: tests "
                         "this script)")
    args = ap.parse_args()
    t_start = time.time()
    global DEVICE
    if args.cpu_dry_run:
        if not tma.INTERPRET:
            raise SystemExit("--cpu-dry-run needs TRITON_INTERPRET=1 set before the run")
        DEVICE = "cpu"
    log = Log(args.out, "bench_hopper.log")

    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    configs = [parse_config(c) for c in args.configs] if args.configs else CONFIGS
    dev = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (Triton interpreter)"
    log(f"{dev}; torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}; "
        f"cuDNN {torch.backends.cudnn.version()}")
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed)

    # ---- references (once; shared by every config) ----------------------------------------------
    cases = [(b, h, h, n, n, d) for b, h, n, d in shapes]
    if not args.no_ragged:
        cases += SMALL_CASES
    draws = []
    for c in cases:
        for biased in (False, True):
            draws.append(Case(c, gen, biased))
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    log(f"references ready ({time.time() - t_start:.0f} s); portable kernel's error vs golden (reference's):")
    for d in draws:
        log(f"    {d.label}: {d.err_port:.2e} ({d.err_ref:.2e})")

    # ---- baselines: SDPA's backends, the portable kernel, the pre-pass ---------------------------
    results, timing_inputs = [], {}
    if DEVICE == "cuda":
        from torch.nn.attention import SDPBackend

        methods = (("sdpa-cudnn", sdpa_with(SDPBackend.CUDNN_ATTENTION)),
                   ("sdpa-flash", sdpa_with(SDPBackend.FLASH_ATTENTION)),
                   ("sdpa-efficient", sdpa_with(SDPBackend.EFFICIENT_ATTENTION)),
                   ("portable exact-hybrid (op, pre-pass incl.)", portable),
                   ("pre-pass (centre_k) alone", lambda q, k, v: tma.centre_keys(k)))
        results, timing_inputs = time_baselines(shapes, lambda shape: tuple(bnhd_view(*shape, gen) for _ in range(3)),
                                                methods, args.warmup, args.rep, log)

    # ---- per config: check, then time (one config at a time: a hang loses only what follows) ----
    checks, status = {}, {}
    for i, c in enumerate(configs):
        name = cfg_name(c)
        if time.time() - t_start > TIME_BUDGET_S:
            status[name] = "not run: time budget"
            log(f"{name}: {status[name]}")
            continue
        rows = []
        try:
            for d in draws:
                if d.case[-1] != 64 and i >= HEAD_DIM_CONFIGS and not c[4]:
                    continue  # other head dims: a few configs only (compile time)
                rows.append(d.check(cfg_dict(c)))
            status[name] = "ok" if all(r["ok"] for r in rows) else "WRONG"
        except Exception as e:  # noqa: BLE001 - a config that fails to compile or launch is a result
            msg = (str(e).strip().splitlines() or [""])[0]
            status[name] = f"FAILED: {type(e).__name__}: {msg[:120]}"
            if "CUDA" in str(e) or "illegal" in str(e).lower():
                log(traceback.format_exc())
                log("a CUDA error poisons the context: stopping here")
                checks[name] = rows
                break
        checks[name] = rows
        worst = max((r["err"] / r["err_ref"] for r in rows if r["nonfinite"] == 0), default=float("nan"))
        log(f"check {name:<24} {status[name]} ({len(rows)} draws; worst err / reference err {worst:.2f})" + "".join(
            f"\n    {r['case']}: nonfinite {r['nonfinite']}, err {r['err']:.2e} (ref {r['err_ref']:.2e}), "
            f"vs portable {r['diff_portable']:.2e}" for r in rows if not r["ok"]))
        if status[name] != "ok" or DEVICE != "cuda":
            continue
        cfg = cfg_dict(c)
        for shape, (q, k, v, k_c, centres, out) in timing_inputs.items():
            results.append(timed_row(shape, f"tma {name}", lambda: tma.exact_forward_tma(
                q, k_c, v, centres, out, scale=shape[-1] ** -0.5, config=cfg), args.warmup, args.rep, {"config": cfg}))
            log(row_line(results[-1]))

    if DEVICE != "cuda":
        log("dry run: no timing on the CPU")
        return
    _report(log, args, dev, shapes, configs, status, checks, results, t_start)


def _report(log, args, dev, shapes, configs, status, checks, results, t_start) -> None:
    lines = report_head("bench_hopper", dev, status)
    lines += ["| shape | method | ms | TFLOP/s | vs cuDNN | + pre-pass ms | + pre-pass vs cuDNN |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    short = ["| shape | cuDNN ms (TF/s) | portable vs cuDNN | best TMA config | kernel vs cuDNN | "
             "+ pre-pass vs cuDNN |", "| --- | --- | --- | --- | --- | --- |"]
    for shape in shapes:
        rows = [r for r in results if r["shape"] == shape]
        by = {r["method"]: r for r in rows}
        cudnn = by.get("sdpa-cudnn", {}).get("ms")
        pre = by.get("pre-pass (centre_k) alone", {}).get("ms")
        for r in rows:
            if "ms" not in r:
                lines.append(f"| {shape} | {r['method']} | {r['error']} | | | | |")
                continue
            ratio = f"{cudnn / r['ms']:.3f}x" if cudnn else ""
            plus, plus_ratio = "", ""
            if r["method"].startswith("tma") and pre:
                plus = f"{r['ms'] + pre:.3f}"
                plus_ratio = f"{cudnn / (r['ms'] + pre):.3f}x" if cudnn else ""
            lines.append(f"| {shape} | {r['method']} | {r['ms']:.3f} | {r['tflops']:.0f} | {ratio} | {plus} "
                         f"| {plus_ratio} |")
        timed = [r for r in rows if r["method"].startswith("tma") and "ms" in r]
        port = by.get("portable exact-hybrid (op, pre-pass incl.)", {}).get("ms")
        if timed and cudnn:
            best = min(timed, key=lambda r: r["ms"])
            short.append(f"| {shape} | {cudnn:.3f} ({tflops(shape, cudnn):.0f}) | "
                         f"{(cudnn / port) if port else float('nan'):.3f}x | {best['method'][4:]} | "
                         f"{cudnn / best['ms']:.3f}x ({best['tflops']:.0f} TF/s) | "
                         f"{cudnn / (best['ms'] + (pre or 0.0)):.3f}x |")
        else:
            short.append(f"| {shape} | {cudnn} | | no correct config timed | | |")
    text = "\n".join(lines)
    print("\n" + text)
    write_report(args.out, "bench_hopper", text + "\n\n## Short\n\n" + "\n".join(short), dev,
                 [cfg_name(c) for c in configs], status, checks, results)
    log(f"\n## Short (total {time.time() - t_start:.0f} s)\n\n" + "\n".join(short))


if __name__ == "__main__":
    main()
