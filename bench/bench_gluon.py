"""The Gluon Hopper kernel (``kernels/attn_fwd_gluon.py``): correctness of every config first, then time.

    PYTHONPATH=$PWD python bench/bench_gluon.py --out $OUT
    PYTHONPATH=$PWD python bench/bench_gluon.py --configs 128,3,0 64,4,1 --shapes 50,5,9216,64

For the GPU machine (an H200; Python 3.12, torch 2.11, triton 3.6).  Inputs are what diffusers holds:
(B, N, H, D) contiguous fp16 tensors viewed as (B, H, N, D).  Head dim 64 only (the kernel's one).

1. Correctness, per config, before any timing.  Draws: each shape and a ragged (2, 5, 1000, 64), each as
   q, k, v ~ N(0, 1) and biased (q, k ~ N(20, 1), v ~ N(0, 1)).  The output buffer is poisoned with NaN,
   the kernel runs (a watchdog ends the run if it does not finish: a barrier deadlock hangs the GPU), and
   - every element must be finite (written, no NaN);
   - on the first and last batch entries, ``err = rel_rmse(out, golden)`` (float64 golden attention)
     must be <= 2 x the error of the FP32-accumulating reference of the same variant
     (``reference.exact_shift_reference(precision="hybrid")``) + 1e-6: the project's rule;
   - over the whole output, ``rel_rmse(out, portable)`` against the portable kernel
     (``pasa_forward(..., kernel="portable")``, the same variant) must be <= 3 x that reference error
     + 1e-6 (the rows the golden subset does not see).
   A config that fails any check is WRONG and is not timed.
2. Timing: ``triton.testing.do_bench`` medians of SDPA's cuDNN and flash backends, the op's default
   (``pasa_attention(q, k, v)``: on sm_90 the pre-pass and the Gluon kernel's table config), the
   portable kernel, the Triton TMA kernel with its pre-pass (``attn_fwd_tma.exact_attention_tma``, default config), the key
   pre-pass alone, and each correct Gluon config alone (its launch converts the centres to fp16: included)
   and with the pre-pass (``exact_attention_gluon``).  TFLOP/s = 4 B H N N D / t.

Writes ``bench_gluon.log`` (as it goes), ``bench_gluon.md`` and ``bench_gluon.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import threading
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402

from pasa_diffusers import numerics  # noqa: E402
from hopper_bench_common import (Log, report_head, row_line, sdpa_with,  # noqa: E402  (bench/, beside it)
                                 time_baselines, timed_row, write_report)
from pasa_diffusers.kernels import attn_fwd_gluon as glu  # noqa: E402
from pasa_diffusers.kernels import attn_fwd_tma as tma  # noqa: E402
from pasa_diffusers.ops import pasa_attention  # noqa: E402
from pasa_diffusers.kernels.pasa_fwd import pasa_forward  # noqa: E402
from pasa_diffusers.reference import DEFAULT_BETA, exact_shift_reference, golden_attention  # noqa: E402

# (BLOCK_N, num_stages, overlap), three consumer warpgroups (192 query rows): from the pool of
# bench/gluon_compile_check.py; the tuned configs (attn_fwd_gluon.tuned_config) first.
CONFIGS = [(128, 3, False), (64, 4, True), (128, 2, False), (128, 2, True), (64, 3, True)]
SHAPES = [(50, 5, 9216, 64), (50, 10, 2304, 64), (50, 20, 576, 64)]  # SVD-XT 25 frames, CFG batch 2
RAGGED = (2, 5, 1000, 64)  # correctness only: rows past N in the last query block, a ragged key tile
BIAS = 20.0
K_REF = 2.0
K_PORTABLE = 3.0
TINY = 1e-6
LAUNCH_TIMEOUT_S = 60.0  # one checked launch (compile included) longer than this is taken for a hang
TIME_BUDGET_S = 200.0  # no new config past this (the whole run must stay under 4 minutes)


def cfg_name(c) -> str:
    block_n, stages, overlap = c
    return f"192x{block_n} s{stages}{' overlap' if overlap else ''}"


def cfg_dict(c) -> dict:
    block_n, stages, overlap = c
    return {"BLOCK_N": block_n, "num_stages": stages, "overlap": bool(overlap)}


def parse_config(text: str):
    block_n, stages, overlap = (int(x) for x in text.split(","))
    return (block_n, stages, bool(overlap))


def bnhd_view(b, h, n, d, gen, *, mean=0.0):
    """(B, N, H, D) contiguous fp16 ~ N(mean, 1), viewed as (B, H, N, D)."""
    x = torch.randn(b, n, h, d, generator=gen, device="cuda") + mean
    return x.to(torch.float16).transpose(1, 2)


def portable(q, k, v):
    """The exact shift in hybrid through the portable kernel (pre-pass incl.); returns (B, H, N, D)."""
    out = torch.empty_like(q)
    return pasa_forward(q, k, v, out, scale=1.0 / math.sqrt(q.shape[-1]), precision="hybrid", shift="exact",
                        beta=DEFAULT_BETA, kernel="portable")


class Draw:
    """One input draw with its pre-pass, references and their errors (computed once, shared by configs)."""

    def __init__(self, shape, gen, biased):
        b, h, n, d = shape
        self.shape, self.biased = shape, biased
        mean = BIAS if biased else 0.0
        self.q, self.k = bnhd_view(b, h, n, d, gen, mean=mean), bnhd_view(b, h, n, d, gen, mean=mean)
        self.v = bnhd_view(b, h, n, d, gen)
        self.k_c, self.centres = tma.centre_keys(self.k)
        self.idx = [0] if b == 1 else [0, b - 1]
        qs, ks, vs = (t[self.idx] for t in (self.q, self.k, self.v))
        self.gold = golden_attention(qs, ks, vs)
        ref = exact_shift_reference(qs, ks, vs, precision="hybrid", block_m=n)
        self.err_ref = numerics.rel_rmse(ref, self.gold)
        self.port = portable(self.q, self.k, self.v)
        self.err_port = numerics.rel_rmse(self.port[self.idx], self.gold)

    @property
    def label(self) -> str:
        return f"{self.shape} {'N(20, 1)' if self.biased else 'N(0, 1)'}"

    def check(self, cfg: dict) -> dict:
        b, h, n, d = self.shape
        out = torch.full((b, n, h, d), float("nan"), dtype=torch.float16, device="cuda").transpose(1, 2)
        glu.exact_forward_gluon(self.q, self.k_c, self.v, self.centres, out, scale=1.0 / math.sqrt(d), config=cfg)
        _synchronize_or_exit(f"{cfg} on {self.label}")
        nonfinite = numerics.nonfinite_count(out)
        err = numerics.rel_rmse(out[self.idx], self.gold) if nonfinite == 0 else float("nan")
        diff = numerics.rel_rmse(out, self.port) if nonfinite == 0 else float("nan")
        ok = nonfinite == 0 and err <= K_REF * self.err_ref + TINY and diff <= K_PORTABLE * self.err_ref + TINY
        return {"case": self.label, "ok": bool(ok), "nonfinite": nonfinite, "err": err, "err_ref": self.err_ref,
                "err_portable": self.err_port, "diff_portable": diff}


LOG = None
"""The run's :class:`Log` (the watchdog writes its last line there)."""


def _synchronize_or_exit(what: str) -> None:
    """``torch.cuda.synchronize()``, or end the process (logged) when it has not returned in time."""
    def hang():
        LOG(f"HANG: {what} did not finish in {LAUNCH_TIMEOUT_S:.0f} s; ending the run (results so far are in the log)")
        os._exit(3)

    timer = threading.Timer(LAUNCH_TIMEOUT_S, hang)
    timer.start()
    try:
        torch.cuda.synchronize()
    finally:
        timer.cancel()


def _baselines(shapes, gen, args, log) -> tuple[list, dict]:
    """SDPA cuDNN / flash, the op's default, the portable kernel, the TMA kernel with its pre-pass, the
    pre-pass alone."""
    from torch.nn.attention import SDPBackend

    methods = (("sdpa-cudnn", sdpa_with(SDPBackend.CUDNN_ATTENTION)),
               ("sdpa-flash", sdpa_with(SDPBackend.FLASH_ATTENTION)),
               ("default pasa_attention (pre-pass incl.)", pasa_attention),
               ("portable kernel (pre-pass incl.)", portable),
               ("tma exact_attention_tma (pre-pass incl.)", tma.exact_attention_tma),
               ("pre-pass (centre_keys) alone", lambda q, k, v: tma.centre_keys(k)))
    return time_baselines(shapes, lambda shape: tuple(bnhd_view(*shape, gen) for _ in range(3)), methods,
                          args.warmup, args.rep, log)


def _check_config(c, draws, log) -> tuple[str, list]:
    """Every draw for config ``c``: ``("ok" | "WRONG" | "FAILED: ...", rows)``."""
    rows = []
    try:
        for d in draws:
            rows.append(d.check(cfg_dict(c)))
        status = "ok" if all(r["ok"] for r in rows) else "WRONG"
    except Exception as e:  # noqa: BLE001 - a config that fails to compile or launch is a result
        msg = (str(e).strip().splitlines() or [""])[-1]
        status = f"FAILED: {type(e).__name__}: {msg[:160]}"
        log(traceback.format_exc())
    worst = max((r["err"] / r["err_ref"] for r in rows if r["nonfinite"] == 0), default=float("nan"))
    log(f"check {cfg_name(c):<20} {status} ({len(rows)} draws; worst err / reference err {worst:.2f})" + "".join(
        f"\n    {r['case']}: nonfinite {r['nonfinite']}, err {r['err']:.2e} (ref {r['err_ref']:.2e}), "
        f"vs portable {r['diff_portable']:.2e}" for r in rows if not r["ok"]))
    return status, rows


def main() -> None:
    global LOG
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=None, help="B,H,N,64 ... (default: the SVD-XT shapes)")
    ap.add_argument("--configs", nargs="*", default=None, help="BLOCK_N,num_stages,overlap ... (overlap 0|1)")
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    t_start = time.time()
    log = LOG = Log(args.out, "bench_gluon.log")

    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    configs = [parse_config(c) for c in args.configs] if args.configs else CONFIGS
    dev = torch.cuda.get_device_name()
    log(f"{dev}; torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}; "
        f"cuDNN {torch.backends.cudnn.version()}; Gluon: {glu.gluon_unavailable_reason() or 'ok'}")
    gen = torch.Generator(device="cuda").manual_seed(args.seed)

    draws = []
    for shape in shapes + [RAGGED]:
        for biased in (False, True):
            draws.append(Draw(shape, gen, biased))
            torch.cuda.empty_cache()
    log(f"references ready ({time.time() - t_start:.0f} s); portable kernel's error vs golden (reference's):")
    for d in draws:
        log(f"    {d.label}: {d.err_port:.2e} ({d.err_ref:.2e})")

    results, inputs = _baselines(shapes, gen, args, log)
    checks, status = {}, {}
    for c in configs:
        name = cfg_name(c)
        if time.time() - t_start > TIME_BUDGET_S:
            status[name] = "not run: time budget"
            log(f"{name}: {status[name]}")
            continue
        status[name], checks[name] = _check_config(c, draws, log)
        if "CUDA" in status[name] or "illegal" in status[name].lower():
            log("a CUDA error poisons the context: stopping here")
            break
        if status[name] != "ok":
            continue
        cfg = cfg_dict(c)
        for shape, (q, k, v, k_c, centres, out) in inputs.items():
            scale = shape[-1] ** -0.5
            results.append(timed_row(shape, f"gluon {name}", lambda: glu.exact_forward_gluon(
                q, k_c, v, centres, out, scale=scale, config=cfg), args.warmup, args.rep, {"config": cfg}))
            log(row_line(results[-1]))
            results.append(timed_row(shape, f"gluon {name} + pre-pass", lambda: glu.exact_attention_gluon(
                q, k, v, config=cfg), args.warmup, args.rep, {"config": cfg}))
            log(row_line(results[-1]))
    _report(log, args, dev, shapes, configs, status, checks, results, t_start)


def _report(log, args, dev, shapes, configs, status, checks, results, t_start) -> None:
    lines = report_head("bench_gluon", dev, status)
    lines += ["| shape | method | ms | TFLOP/s | vs cuDNN |", "| --- | --- | --- | --- | --- |"]
    for shape in shapes:
        rows = [r for r in results if r["shape"] == shape]
        cudnn = next((r["ms"] for r in rows if r["method"] == "sdpa-cudnn" and "ms" in r), None)
        for r in rows:
            if "ms" not in r:
                lines.append(f"| {shape} | {r['method']} | {r['error']} | | |")
                continue
            ratio = f"{cudnn / r['ms']:.3f}x" if cudnn else ""
            lines.append(f"| {shape} | {r['method']} | {r['ms']:.3f} | {r['tflops']:.0f} | {ratio} |")
    text = "\n".join(lines)
    print("\n" + text)
    write_report(args.out, "bench_gluon", text, dev, [cfg_name(c) for c in configs], status, checks, results)
    log(f"\ntotal {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
