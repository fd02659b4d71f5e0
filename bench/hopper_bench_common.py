"""Helpers the GPU benchmarks of the Hopper kernels share (``bench_hopper.py``, ``bench_gluon.py``): timing rows,
TFLOP/s, a log that survives a kill, and the report's head and files."""
from __future__ import annotations

import json
import os

import torch
import triton
from triton.testing import do_bench


def tflops(shape, ms: float) -> float:
    """Non-causal attention's 4 B H N^2 D floating-point operations over ``ms`` milliseconds, in TFLOP/s."""
    b, h, n, d = shape
    return 4.0 * b * h * n * n * d / (ms * 1e-3) / 1e12


def median_ms(fn, warmup: int, rep: int) -> float:
    """``do_bench`` median of ``fn`` (L2 cleared before every call) after one untimed call (compile, tune)."""
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


class Log:
    """print, flushed, and appended to ``<out_dir>/<name>`` as it goes (survives a timeout or a hang)."""

    def __init__(self, out_dir: str | None, name: str):
        self.path = None
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            self.path = os.path.join(out_dir, name)
            open(self.path, "w").close()

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(text + "\n")


def timed_row(shape, method: str, fn, warmup: int, rep: int, extra: dict | None = None) -> dict:
    """``{shape, method, ms, tflops, **extra}`` for ``fn`` timed by :func:`median_ms`, or ``{shape, method,
    error}`` when it raises (an unavailable backend is a result, not the end of the run)."""
    try:
        ms = median_ms(fn, warmup, rep)
        return {"shape": shape, "method": method, "ms": ms, "tflops": tflops(shape, ms), **(extra or {})}
    except Exception as e:  # noqa: BLE001
        first = (str(e).splitlines() or [""])[0][:120]
        return {"shape": shape, "method": method, "error": f"{type(e).__name__}: {first}"}


def row_line(r: dict) -> str:
    """One log line of a :func:`timed_row`."""
    if "ms" in r:
        return f"time {str(r['shape']):<20} {r['method']:<44} {r['ms']:8.3f} ms {r['tflops']:6.0f} TFLOP/s"
    return f"time {str(r['shape']):<20} {r['method']:<44} {r['error']}"


def report_head(bench: str, dev: str, status: dict) -> list[str]:
    """The markdown report's first lines: its title, the correctness table (one row per config) and the
    timing section's title; the caller adds its timing table."""
    lines = [f"# {bench}: {dev}, torch {torch.__version__}, triton {triton.__version__}", "",
             "## Correctness (per config: all draws)", "", "| config | status |", "| --- | --- |"]
    lines += [f"| {name} | {st} |" for name, st in status.items()]
    return lines + ["", "## Timing (fp16, (B, N, H, D) views; do_bench medians)", ""]


def write_report(out_dir: str | None, bench: str, markdown: str, dev: str, config_names: list, status: dict,
                 checks: dict, results: list) -> None:
    """``<bench>.md`` (``markdown``) and ``<bench>.json`` (the device, versions, configs, statuses, checks and
    timing rows) under ``out_dir``; nothing without one."""
    if not out_dir:
        return
    with open(os.path.join(out_dir, f"{bench}.md"), "w") as f:
        f.write(markdown + "\n")
    with open(os.path.join(out_dir, f"{bench}.json"), "w") as f:
        json.dump({"device": dev, "torch": torch.__version__, "triton": triton.__version__, "configs": config_names,
                   "status": status, "checks": checks, "results": results}, f, indent=1, default=str)


def sdpa_with(backend):
    """``(q, k, v) -> out`` through ``F.scaled_dot_product_attention`` restricted to one ``SDPBackend``."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v)
    return run


def time_baselines(shapes, make_qkv, methods, warmup: int, rep: int, log) -> tuple[list, dict]:
    """Per shape: ``q, k, v = make_qkv(shape)`` (fp16 CUDA (B, H, N, D) views), each ``(name, fn)`` of
    ``methods`` timed on them (:func:`timed_row`, logged as it goes).  Returns the rows and, per shape,
    ``(q, k, v, k_c, centres, out)``: the inputs with the key pre-pass's outputs
    (``attn_fwd_tma.centre_keys``) and an output buffer, for the configs timed next."""
    from pasa_diffusers.kernels.attn_fwd_tma import centre_keys

    results, inputs = [], {}
    for shape in shapes:
        q, k, v = make_qkv(shape)
        inputs[shape] = (q, k, v, *centre_keys(k), torch.empty_like(q))
        for name, fn in methods:
            results.append(timed_row(shape, name, lambda fn=fn: fn(q, k, v), warmup, rep))
            log(row_line(results[-1]))
    return results, inputs
