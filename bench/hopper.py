"""Is each config of the Gluon Hopper kernel (kernels/hopper.py) correct, and how fast is it?

    python -m bench.hopper --out DIR
    python -m bench.hopper --configs 128,3,0,3 64,4,1,3 --shapes 50,5,9216,64 --out DIR
    python -m bench.hopper --dtype bfloat16 --shapes 2,12,32760,128 --out DIR

For an sm_90 GPU with triton 3.6 (Gluon).  Inputs are what diffusers holds: (B, N, H, D) contiguous
(fp16, or --dtype bfloat16) viewed as (B, H, N, D); all shapes of a run have one head dim (the configs'
tile: 64, or 128 above 64).  A config is BLOCK_N,num_stages,overlap,consumers.

1. Correctness of every config before any timing.  Draws: each shape (with as many of its heads as
   keep the float64 golden's scores of the checked batch entries within GOLDEN_BYTES: one head at the
   video DiTs' 32,760-45,000 keys; heads are independent programs of the same code) and a ragged
   (2, 5, 1000, D), each with q, k, v ~ N(0, 1) and biased (q, k ~ N(20, 1), v ~ N(0, 1)).  The output buffer is
   poisoned with NaN, the kernel runs through dispatch.forward(kernel="gluon", config=...) (a watchdog
   ends the run if it does not finish: a barrier deadlock hangs the GPU), and
   - every element must be finite (written, no NaN);
   - on the first and last batch entries, rel_rmse(out, golden) (float64 golden attention) must be at
     most 2x the error of the FP32-accumulating reference of the same variant
     (reference.exact_shift_reference(precision="hybrid")) + 1e-6: the project's rule;
   - over the whole output, rel_rmse(out, portable) against the portable kernel
     (dispatch.forward(kernel="portable")) must be at most 3x that reference error + 1e-6.
   A config that fails a check is WRONG and is not timed.
2. Time (the harness's timer): SDPA's cuDNN and flash backends, the peers that import (FA3 bf16 / fp8,
   SageAttention), the op's default, every kernel path of
   the default (kernels.dispatch), the key pre-pass alone (prepass.centre_keys), and each correct
   config alone (hopper.forward on pre-centred keys) and with the pre-pass.  TFLOP/s = 4 B H N N D / t.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict

import torch

from pasa_diffusers import numerics, rules
from pasa_diffusers.shift_matrix import DEFAULT_BETA
from pasa_diffusers.kernels import dispatch, hopper, prepass
from pasa_diffusers.metrics import records
from pasa_diffusers.reference import exact_shift_reference, golden_attention
from pasa_diffusers.variants import DEFAULT

from . import harness

NAME = "hopper"
EXTRA_CONFIGS = {64: [{"BLOCK_N": 128, "num_stages": 2, "overlap": False, "consumers": 3, "pingpong": False},
                     {"BLOCK_N": 128, "num_stages": 2, "overlap": True, "consumers": 3, "pingpong": False},
                     {"BLOCK_N": 64, "num_stages": 3, "overlap": True, "consumers": 3, "pingpong": False}],
                 128: [{"BLOCK_N": 128, "num_stages": 2, "overlap": False, "consumers": 2, "pingpong": False},
                       {"BLOCK_N": 64, "num_stages": 4, "overlap": True, "consumers": 2, "pingpong": False},
                       {"BLOCK_N": 64, "num_stages": 2, "overlap": True, "consumers": 3, "pingpong": False},
                       {"BLOCK_N": 64, "num_stages": 2, "overlap": False, "consumers": 3, "pingpong": False}]}
"""Configs checked and timed after the kernel's two tuned ones of the head dim's tile."""
RAGGED_N = 1000
"""Correctness only, (2, 5, 1000, D): rows past N in the last query block, a ragged key tile."""
BIAS = 20.0
K_REF, K_PORTABLE, TINY = 2.0, 3.0, 1e-6
GOLDEN_BYTES = 16 * 2**30
"""The most bytes of float64 scores the golden of one check draw may take (it holds them twice)."""
LAUNCH_TIMEOUT_S = 60.0
"""One checked launch (compilation included) longer than this is taken for a hang."""


def default_configs(head_dim: int) -> list[dict]:
    """The tuned configs of ``head_dim``'s tile first, then its :data:`EXTRA_CONFIGS`."""
    found = [hopper.tuned_config(hopper.SHORT_KEYS + 1, head_dim), hopper.tuned_config(hopper.SHORT_KEYS, head_dim)]
    return found + [c for c in EXTRA_CONFIGS[hopper.head_dim_tile(head_dim)] if c not in found]


def parse_config(text: str) -> dict:
    """``BLOCK_N,num_stages,overlap,consumers[,pingpong]`` (overlap, pingpong 0 or 1) -> a config dict."""
    try:
        block_n, stages, overlap, consumers, *rest = (int(x) for x in text.split(","))
        pingpong = bool(rest[0]) if rest else False
        if len(rest) > 1:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"--configs {text!r}: expected BLOCK_N,num_stages,overlap,consumers"
                                         "[,pingpong], e.g. 128,3,0,3")
    return {"BLOCK_N": block_n, "num_stages": stages, "overlap": bool(overlap), "consumers": consumers,
            "pingpong": pingpong}


def parse_shape(text: str) -> harness.Shape:
    """``B,H,N,D`` -> a square :class:`harness.Shape`."""
    try:
        b, h, n, d = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes {text!r}: expected B,H,N,D, e.g. 50,5,9216,64")
    return harness.Shape("hopper", f"N{n}", b, h, h, n, n, d)


def config_name(cfg: dict) -> str:
    """``BLOCK_N 128, 3 stages[, overlap], 3 consumers``."""
    overlap = ", overlap" if cfg["overlap"] else ""
    pingpong = ", ping-pong" if cfg.get("pingpong") else ""
    return f"BLOCK_N {cfg['BLOCK_N']}, {cfg['num_stages']} stages{overlap}, {cfg['consumers']} consumers{pingpong}"


def synchronize_or_exit(what: str, log_path: str) -> None:
    """``torch.cuda.synchronize()``, or end the process (the reason appended to ``log_path``) when it has
    not returned in :data:`LAUNCH_TIMEOUT_S`."""
    def hang():
        message = f"HANG: {what} did not finish in {LAUNCH_TIMEOUT_S:.0f} s; ending the run"
        harness.log(message)
        with open(log_path, "a") as f:
            f.write(message + "\n")
        os._exit(3)

    timer = threading.Timer(LAUNCH_TIMEOUT_S, hang)
    timer.start()
    try:
        torch.cuda.synchronize()
    finally:
        timer.cancel()


def _forward(q, k, v, out, kernel: str, config: dict | None = None) -> torch.Tensor:
    return dispatch.forward(q, k, v, out, scale=q.shape[-1] ** -0.5, variant=DEFAULT, beta=DEFAULT_BETA,
                            kernel=kernel, config=config)


def check_shape(shape: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """``shape`` with its heads cut to what :data:`GOLDEN_BYTES` allows for the golden of its checked batch
    entries (the first and the last)."""
    b, h, n, d = shape
    per_head = min(b, 2) * n * n * 8
    return b, max(1, min(h, GOLDEN_BYTES // per_head)), n, d


class Draw:
    """One input draw with its references and their errors (computed once, shared by every config)."""

    def __init__(self, shape: tuple[int, int, int, int], gen: torch.Generator, biased: bool, dtype: torch.dtype):
        b, h, n, d = shape
        self.label = f"{shape} {'N(20, 1)' if biased else 'N(0, 1)'}"
        mean = BIAS if biased else 0.0

        def draw(m: float) -> torch.Tensor:
            return (torch.randn(b, n, h, d, generator=gen, device="cuda") + m).to(dtype).transpose(1, 2)

        self.q, self.k, self.v = draw(mean), draw(mean), draw(0.0)
        self.idx = [0] if b == 1 else [0, b - 1]
        qs, ks, vs = (t[self.idx] for t in (self.q, self.k, self.v))
        self.gold = golden_attention(qs, ks, vs)
        self.err_ref = numerics.rel_rmse(exact_shift_reference(qs, ks, vs, precision="hybrid", block_m=n), self.gold)
        self.portable = _forward(self.q, self.k, self.v, torch.empty_like(self.q), "portable")
        self.err_portable = numerics.rel_rmse(self.portable[self.idx], self.gold)

    def check(self, cfg: dict, log_path: str) -> dict:
        """The three checks of the module docstring for ``cfg`` on this draw."""
        b, h, n, d = self.q.shape
        out = torch.full((b, n, h, d), float("nan"), dtype=self.q.dtype, device="cuda").transpose(1, 2)
        _forward(self.q, self.k, self.v, out, "gluon", cfg)
        synchronize_or_exit(f"{config_name(cfg)} on {self.label}", log_path)
        nonfinite = numerics.nonfinite_count(out)
        err = numerics.rel_rmse(out[self.idx], self.gold) if nonfinite == 0 else math.nan
        diff = numerics.rel_rmse(out, self.portable) if nonfinite == 0 else math.nan
        ok = nonfinite == 0 and err <= K_REF * self.err_ref + TINY and diff <= K_PORTABLE * self.err_ref + TINY
        return {"case": self.label, "ok": bool(ok), "nonfinite": nonfinite, "err": err, "err_ref": self.err_ref,
                "err_portable": self.err_portable, "diff_portable": diff}


def check_config(cfg: dict, draws: Sequence[Draw], log_path: str) -> tuple[str, list[dict]]:
    """``("ok" | "WRONG" | "FAILED: ...", one check per draw)``."""
    rows = []
    try:
        rows = [d.check(cfg, log_path) for d in draws]
    except Exception as e:  # noqa: BLE001 - a config that fails to compile or launch is a result
        return f"FAILED: {harness.error_text(e)}", rows
    return ("ok" if all(r["ok"] for r in rows) else "WRONG"), rows


def _kernel_alone(cfg: dict) -> harness.Method:
    """The Gluon kernel with ``cfg`` on keys centred once in the set-up (the pre-pass not timed)."""
    def build(q, k, v):
        k_c, centres = prepass.centre_keys(k, block_n=rules.SHIFT_BLOCK, exact=True)
        out = torch.empty_like(q)
        return harness.Prepared(lambda: hopper.forward(q, k_c, v, centres, out, scale=q.shape[-1] ** -0.5,
                                                       config=cfg))
    return harness.Method(f"gluon {config_name(cfg)} alone", "ours", build)


def _prepass_alone() -> harness.Method:
    def build(q, k, v):
        return harness.Prepared(lambda: prepass.centre_keys(k, block_n=rules.SHIFT_BLOCK, exact=True)[0])
    return harness.Method("centre pre-pass alone", "ours", build)


def timing_methods(q, k, v, correct: Sequence[dict]) -> list[harness.Method]:
    """SDPA cuDNN and flash, the peers that import (FA3 bf16 and fp8, SageAttention), the op's default,
    every kernel path of the default, the pre-pass, and each correct config alone and with the pre-pass."""
    found = [harness.sdpa_method("cudnn"), harness.sdpa_method("flash"), *harness.peer_methods()[0],
             harness.op_method(DEFAULT),
             *harness.kernel_methods(DEFAULT, q, k, v), _prepass_alone()]
    for cfg in correct:
        found += [_kernel_alone(cfg), *harness.config_methods(DEFAULT, q, k, v, [("gluon", cfg)])]
    return found


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(NAME, __doc__)
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=harness.svd_spatial(25)[:3], metavar="B,H,N,D",
                   help="timed shapes (default: SVD-XT's spatial 9216, 2304 and 576 tokens at 25 frames)")
    p.add_argument("--configs", type=parse_config, nargs="+", default=None, metavar="BLOCK_N,STAGES,OVERLAP,CONSUMERS",
                   help="configs to check and time (default: the head dim's tuned two, then EXTRA_CONFIGS)")
    harness.add_dtype_argument(p)
    p.add_argument("--budget-s", type=float, default=400.0,
                   help="no config is checked past this many seconds of the run (default: 400)")
    harness.add_timer_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"bench.{NAME}: needs an sm_90 GPU", file=sys.stderr)
        return 2
    reason = hopper.unavailable_reason()
    if reason is not None:
        print(f"bench.{NAME}: the Gluon kernel cannot run here: {reason}", file=sys.stderr)
        return 2

    t_start = time.time()
    cmd, env = harness.command(NAME, argv), harness.environment()
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, f"{NAME}.log")
    dims = {hopper.head_dim_tile(s.d) for s in args.shapes}
    if len(dims) != 1:
        p.error(f"--shapes: all shapes need one head-dim tile (64, or 128 above 64), got head dims "
                f"{sorted({s.d for s in args.shapes})}")
    head_dim = args.shapes[0].d
    dtype = harness.INPUT_DTYPES[args.dtype]
    configs = args.configs or default_configs(head_dim)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    shapes = [check_shape((s.b, s.hq, s.nq, s.d)) for s in args.shapes]
    ragged = (2, 5, RAGGED_N, head_dim)
    draws = [Draw(shape, gen, biased, dtype) for shape in [*shapes, ragged] for biased in (False, True)]
    status, checks = {}, {}
    for cfg in harness.progress(configs, f"{NAME} checks"):
        name = config_name(cfg)
        if time.time() - t_start > args.budget_s:
            status[name] = "not run: time budget"
            continue
        status[name], checks[name] = check_config(cfg, draws, log_path)
        harness.log(f"{name}: {status[name]}")
        if "CUDA" in status[name] or "illegal" in status[name].lower():
            harness.log("a CUDA error poisons the context: stopping the checks here")
            break
    correct = [cfg for cfg in configs if status.get(config_name(cfg)) == "ok"]
    del draws
    harness.free_memory()

    timer = harness.Timer(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    rows: list[harness.Row] = []
    for shape in harness.progress(args.shapes, f"{NAME} timing"):
        q, k, v = harness.make_inputs(shape, gen, dtype=dtype)
        rows += harness.measure(shape, timing_methods(q, k, v, correct), q, k, v, timer=timer)
        del q, k, v
        harness.free_memory()

    def worst(name: str) -> str:
        ratios = [r["err"] / r["err_ref"] for r in checks.get(name, []) if r["nonfinite"] == 0 and r["err_ref"]]
        return f"{max(ratios):.2f}" if ratios else "-"

    f = harness.fmt
    text = harness.header("bench.hopper: the Gluon kernel's configs, correctness then time", env, cmd)
    text += "\n## Correctness (every draw)\n\n" + records.markdown_table(
        ["config", "status", "worst err / reference err"], [[n, s, worst(n)] for n, s in status.items()], align="llr")
    text += "\n\n## Time\n\n" + records.markdown_table(
        ["shape", "(B, H, N, D)", "method", "ms", "TFLOP/s", "vs best SDPA", "kernel / note"],
        [[r.shape, r.bhnd, r.method, f(r.ms, ".3f"), f(r.tflops), f(r.vs_best_sdpa, ".2f"), r.status()]
         for r in rows], align="lllrrrl") + f"\n\ntotal {time.time() - t_start:.0f} s\n"
    harness.write_report(args.out, NAME, text, {
        "bench": NAME, "command": cmd, "environment": env, "timer": asdict(timer), "configs": configs,
        "status": status, "checks": checks, "rows": harness.rows_payload(rows)})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
