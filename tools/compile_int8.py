"""What do the 8-bit exact shift's kernels compile to for sm_90, per config, on a machine without a GPU?

    python -m tools.compile_int8 --python PYTHON --out DIR     # PYTHON: an interpreter with triton 3.6
    python -m tools.compile_int8 --jobs 2 --out DIR            # this interpreter has triton 3.6

Every kernel of pasa_diffusers/kernels/int8.py and quantize.py (its pre-pass) is compiled for
GPUTarget("cuda", 90, 32), each (kernel, config, head dim, P V precision, dtype) in its own process
(PYTHON -m tools.compile_int8 --one CASE) so that a compiler crash is a row: the attention kernel over its autotune
pool (int8.AUTOTUNE configs), dense and with a block mask (a per-key-head BlockSparseMask of meta tensors), and
the pre-pass (the fused quantize kernel, the column statistics and their reduction, the 16-bit blocks'
flags), from meta tensors
in diffusers' (B, N, H, D) layout viewed as (B, H, N, D), through the launchers' own argument builders
(quantize.allocate, quantize.quantize_call, quantize.flags_call, int8.attention_call) and Triton's
specialisation rules (compat.specialization).

Per case: the tensor-core instructions in the PTX (wgmma.mma_async by operand types, e.g. s32.s8.s8 for
the INT8 q k^T and f32.e4m3.e4m3 or f32.f16.f16 for P V; mma.sync if Triton fell back), their SASS
count (HGMMA 16-bit, IGMMA INT8, QGMMA FP8), spills (ptxas -v spill bytes, st.local/ld.local in the
PTX, STL/LDL in the SASS), registers per thread (cuobjdump -res-usage), shared memory, threads, and for the
pre-pass the IEEE divisions (div.rn.f32) and whether an FMA swallowed the rounding trick's addition
(there must be none: the spec rounds the quotient first); for the attention kernels their key loop in the SASS
(tools.compile_sm90.key_loop).
"""
from __future__ import annotations

import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from .compile_sm90 import loop_text, meta_block_mask, run_tool, spilled

NAME = "compile_int8"
ROOT = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 900
SHAPE = (2, 8, 4096)
"""(B, H, N) of the meta inputs (H = 8 query heads reading 4 key heads: GQA)."""
KV_HEADS = 4


def cases() -> list[dict]:
    """The compile matrix: the attention kernel over its pool at head dims 64 and 128, P V in 16 and 8 bits
    (fp16 inputs; bf16 once per head dim), each also with a block mask (``sparse``: the walk over the kept key
    blocks), and every pre-pass kernel at both head dims (the quantizing one with and without the Gluon kernel's
    bias rows)."""
    from pasa_diffusers.kernels import int8

    found = []
    for d in (64, 128):
        for pv_bits in (16, 8):
            for cfg in int8.CONFIG_POOL:
                for sparse in (False, True):
                    found.append({"kernel": "attention", "d": d, "pv_bits": pv_bits, "dtype": "float16",
                                  "config": cfg, "sparse": sparse})
            for bias in (False, True):
                found.append({"kernel": "quantize", "d": d, "pv_bits": pv_bits, "dtype": "float16", "bias": bias})
        found.append({"kernel": "attention", "d": d, "pv_bits": 16, "dtype": "bfloat16",
                      "config": int8.CONFIG_POOL[0]})
        found.append({"kernel": "quantize", "d": d, "pv_bits": 16, "dtype": "bfloat16", "bias": True})
        found.append({"kernel": "flags", "d": d, "dtype": "float16"})
        for amax in (False, True):
            found.append({"kernel": "colstats", "d": d, "amax": amax, "dtype": "float16"})
            found.append({"kernel": "colstats_reduce", "d": d, "amax": amax, "dtype": "float16"})
    return found + gluon_cases()


GLUON_CONFIGS = {64: ((128, 3, 3), (128, 2, 2), (64, 3, 3), (128, 2, 3)),
                 128: ((64, 3, 2), (128, 2, 2), (64, 2, 3), (128, 3, 2))}
"""The Gluon kernel's (BLOCK_N, stages, consumers) compiled per head dim: the tuned ones and the others tried."""


def gluon_cases() -> list[dict]:
    """The Gluon attention kernel (``kernels/hopper_int8.py``): its configs at head dims 64 and 128, with and
    without the 16-bit blocks, ``P V`` in 16 bits and FP8, fp16 and bf16, and with a block mask at the config a
    mask takes (``hopper_int8.tuned_config(d, sparse=True)``), and the tuned config with the consumers in turns
    (``pingpong``)."""
    from pasa_diffusers.kernels import hopper_int8

    found = []
    for d, configs in GLUON_CONFIGS.items():
        for cfg in configs:
            for pv_bits in (16, 8):
                for fallback in (True, False):
                    found.append({"kernel": "gluon", "d": d, "dtype": "bfloat16", "config": cfg,
                                  "fallback": fallback, "pv_bits": pv_bits})
        sparse = hopper_int8.tuned_config(d, sparse=True)
        for pv_bits in (16, 8):
            for fallback in (True, False):
                found.append({"kernel": "gluon", "d": d, "dtype": "bfloat16", "fallback": fallback, "pv_bits": pv_bits,
                              "config": (sparse["BLOCK_N"], sparse["num_stages"], sparse["consumers"]),
                              "sparse": True})
        found.append({"kernel": "gluon", "d": d, "dtype": "float16", "config": configs[0], "fallback": True,
                      "pv_bits": 16})
        tuned = hopper_int8.tuned_config(d)
        for pv_bits in (16, 8):
            found.append({"kernel": "gluon", "d": d, "dtype": "bfloat16", "fallback": True, "pv_bits": pv_bits,
                          "config": (tuned["BLOCK_N"], tuned["num_stages"], tuned["consumers"]), "pingpong": True})
    return found


# ---- the child's side: one compile, no GPU --------------------------------------------------------

def _launch(case: dict):
    """``(jitted kernel, args, meta, options)`` of one case, built by the launchers' own helpers."""
    import torch

    from pasa_diffusers.kernels import int8, quantize

    dtype = getattr(torch, case["dtype"])
    b, h, n = SHAPE
    d = case["d"]

    def bnhd(heads):
        return torch.empty(b, n, heads, d, dtype=dtype, device="meta").transpose(1, 2)

    q, k, v = bnhd(h), bnhd(KV_HEADS), bnhd(KV_HEADS)
    if case["kernel"] == "gluon":
        from pasa_diffusers.kernels import hopper_int8

        prep, _ = quantize.allocate(q, k, v, pv_bits=case["pv_bits"], fallback=case["fallback"], bias=True)
        block_n, stages, consumers = case["config"]
        _, args, meta = hopper_int8.kernel_call(q, prep, bnhd(h), scale=d ** -0.5, config={
            "BLOCK_N": block_n, "num_stages": stages, "consumers": consumers, "pingpong": case.get("pingpong", False)},
            block_mask=_key_head_mask(n, b) if case.get("sparse") else None)
        options = {name: meta.pop(name) for name in ("num_warps", "maxnreg")}
        return hopper_int8.int8_fwd_gluon_kernel, args, meta, options
    prep, scratch = quantize.allocate(q, k, v, pv_bits=case.get("pv_bits", 8 if case.get("amax") else 16),
                                      bias=case.get("bias", False))
    dp = prep.k_codes.shape[-1]
    if case["kernel"] == "attention":
        out = bnhd(h)
        args, meta = int8.attention_call(q, prep, out, scale=d ** -0.5,
                                         block_mask=_key_head_mask(n, b) if case.get("sparse") else None)
        block_m, block_n, warps, stages = case["config"]
        meta.update(BLOCK_M=block_m, BLOCK_N=block_n)
        return int8.int8_fwd_kernel, args, meta, {"num_warps": warps, "num_stages": stages}
    if case["kernel"] == "quantize":
        _, args, meta = quantize.quantize_call(q, k, v, prep, scratch, scale=d ** -0.5)
        return quantize.quantize_kernel, args, meta, {"num_warps": meta.pop("num_warps")}
    if case["kernel"] == "flags":
        tally = torch.empty(2, dtype=torch.int64, device="meta")
        _, args, meta = quantize.flags_call(prep, scratch, scale=d ** -0.5, tally=tally)
        return quantize.fallback_flags_kernel, args, meta, {"num_warps": 4}
    amax = case["amax"]
    x, heads = (v, KV_HEADS) if amax else (q, h)
    part = scratch.v_part if amax else scratch.q_part
    if case["kernel"] == "colstats":
        from pasa_diffusers.rules import SHIFT_BLOCK

        args = (x, part, *x.stride()[:3], heads, n, part.shape[1])
        meta = dict(HEAD_DIM=d, DP=dp, BLOCK_R=SHIFT_BLOCK, AMAX=amax)
        return quantize.colstats_kernel, args, meta, {"num_warps": 4 if dp <= 64 else 8}
    out = prep.v_scale if amax else prep.qbar
    args = (part, out, scratch.v_inv if amax else out, n, part.shape[1])
    meta = dict(DP=dp, AMAX=amax, G_BF16=dtype == torch.bfloat16, INTERPRET_BF16=False)
    return quantize.colstats_reduce_kernel, args, meta, {"num_warps": 4}


def _key_head_mask(n: int, batch: int):
    """A block mask of meta tensors for ``n`` queries and keys, per batch element and key head."""
    return meta_block_mask(n, n, batch, KV_HEADS)


def mma_report(ptx: str) -> dict:
    """Tensor-core instructions of the PTX by operand types, and the rounding-trick checks."""
    kinds = Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.(\w+\.\w+\.\w+)", ptx))
    magic = [ln.split()[0] for ln in ptx.splitlines() if "0f4B400000" in ln or "0fCB400000" in ln]
    return {"wgmma": dict(kinds), "mma_sync": len(re.findall(r"\bmma\.sync", ptx)),
            "div_rn": len(re.findall(r"div\.rn\.f32", ptx)),
            "div_approx": len(re.findall(r"div\.(?:full|approx)\.f32", ptx)),
            "rne_adds": magic.count("add.f32"), "rne_fused": len(magic) - magic.count("add.f32")}


def compile_launched(case: dict, launch) -> dict:
    """``case``'s row: ``launch(case)`` gives ``(kernel, args, meta, options)`` on meta tensors; the kernel compiled
    for sm_90 (Gluon where ``case["kernel"]`` says so) and reported (shared memory, PTX locals, MMAs, ptxas and the
    cubin's SASS), or the compiler's error, which is a result here."""
    from pasa_diffusers.compat import compile_for_cuda, specialization

    from .compile_sm90 import cubin_report, ptxas_report

    row, t0 = dict(case), time.time()
    try:
        fn, args, meta, options = launch(case)
        signature, constexprs, attrs = specialization(fn, args, meta)
        kern = compile_for_cuda(fn, signature, constexprs, attrs, options, gluon=case.get("kernel") == "gluon")
        ptx = kern.asm["ptx"]
        row.update(ok=True, smem=kern.metadata.shared, threads=32 * kern.metadata.num_warps,
                   ptx_local=len(re.findall(r"\b(?:st|ld)\.local", ptx)), **mma_report(ptx), **ptxas_report(ptx),
                   **cubin_report(kern.asm["cubin"]))
    except Exception as e:  # noqa: BLE001 - a compiler failure is a result here
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        row.update(ok=False, error=(type(e).__name__ + ": " + " / ".join(lines[-3:]))[:400])
    row["seconds"] = round(time.time() - t0, 1)
    return row


def compile_one(case: dict) -> dict:
    return compile_launched(case, _launch)


def probe() -> dict:
    import triton

    return {"triton": triton.__version__, "python": sys.executable}


# ---- the parent's side ----------------------------------------------------------------------------

def _what(row: dict) -> str:
    if row["kernel"] == "attention":
        bm, bn, w, s = row["config"]
        mask = ", block mask" if row.get("sparse") else ""
        return f"attention BLOCK_M {bm}, BLOCK_N {bn}, {w} warps, {s} stages, P V {row['pv_bits']}-bit{mask}"
    if row["kernel"] == "gluon":
        bn, s, c = row["config"]
        mask = ", block mask" if row.get("sparse") else ""
        mask += ", ping-pong" if row.get("pingpong") else ""
        return (f"Gluon attention BLOCK_N {bn}, {s} stages, {c} consumers, "
                f"{'with' if row['fallback'] else 'without'} 16-bit blocks, P V {row['pv_bits']}-bit{mask}")
    if row["kernel"] == "quantize":
        bias = ", the Gluon kernel's bias rows" if row.get("bias") else ""
        return f"quantize (pre-pass), V {'e4m3' if row['pv_bits'] == 8 else 'as is'}{bias}"
    if row["kernel"] == "flags":
        return "flags (16-bit blocks)"
    return f"{row['kernel']} ({'amax of v' if row['amax'] else 'sums of q'})"


COLUMNS = ["kernel", "D", "dtype", "wgmma PTX by type (SASS)", "mma.sync", "spills st/ld, local PTX/SASS",
           "regs/thread", "threads", "smem B", "div.rn / approx, rne adds / fused",
           "key loop: SASS instructions, top ops", "compile s"]


def table_row(row: dict) -> list:
    head = [_what(row), row["d"], row["dtype"]]
    if not row["ok"]:
        return head + [f"FAILED: {row['error']}"] + [""] * 7 + [row["seconds"]]
    wg = ", ".join(f"{k} {v}" for k, v in row["wgmma"].items()) or "none"
    sass = ", ".join(f"{kind.upper()} {row[kind]}" for kind in ("hgmma", "igmma", "qgmma") if row[kind]) or "none"
    spill = f"{row['spill_st']}/{row['spill_ld']} B" if row["spill_st"] is not None else "?"
    return head + [f"{wg} ({sass})", row["mma_sync"], f"{spill}, {row['ptx_local']}/{row['sass_local']}",
                   row["regs"], row["threads"], row["smem"],
                   f"{row['div_rn']} / {row['div_approx']}, {row['rne_adds']} / {row['rne_fused']}", loop_text(row),
                   row["seconds"]]


def main(argv: Sequence[str] | None = None) -> int:
    from pasa_diffusers.metrics import records

    def report(rows):
        no_int8 = sum(1 for r in rows if r["kernel"] == "attention" and r.get("ok") and "s32.s8.s8" not in r["wgmma"])
        return (f"\nmeta inputs (B, H/Hk, N) = ({SHAPE[0]}, {SHAPE[1]}/{KV_HEADS}, {SHAPE[2]}), (B, N, H, D) memory\n\n"
                + records.markdown_table(COLUMNS, [table_row(r) for r in rows])
                + f"\n\n{sum(r['ok'] for r in rows)} of {len(rows)} compiled; with spills: {spilled(rows)}; attention "
                f"kernels without INT8 wgmma: {no_int8}\n")

    return run_tool(NAME, __doc__, argv, what="the 8-bit kernels", compile_one=compile_one, probe=probe,
                    cases=lambda args: cases(), report=report)


if __name__ == "__main__":
    raise SystemExit(main())
