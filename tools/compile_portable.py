"""What does the portable 16-bit kernel compile to for sm_90, per variant and config, on a machine without a GPU?

    python -m tools.compile_portable --python PYTHON --out DIR     # PYTHON: an interpreter with triton 3.6
    python -m tools.compile_portable --jobs 2 --out DIR            # this interpreter has triton 3.6

kernels/portable.py's pasa_fwd_kernel is compiled for GPUTarget("cuda", 90, 32), each case in its own process
(PYTHON -m tools.compile_portable --one CASE) so that a compiler crash is a row: every key path of every variant
(the exact shift on centred keys and centring its one block in the loop, PASA on shifted keys and shifting in the
loop, plain FlashAttention; hybrid and half) at head dim 64 with its pool's first config that fits sm_90's shared
memory, dense and with a block mask (a per-key-head BlockSparseMask of meta tensors: the walk over the kept key
blocks); the block-masked kernel with the LSE stored; head dim 128 and bf16; and every config of the default's
and PASA's pools with a mask.  Inputs are meta tensors in diffusers' (B, N, H, D) layout viewed as (B, H, N, D),
the arguments built by portable.kernel_call and specialised by Triton's rules (compat.specialization).

Per case: the wgmma instructions in the PTX by operand types (HGMMA in the SASS; mma.sync if Triton fell back),
spills (ptxas -v spill bytes, st.local/ld.local in the PTX, STL/LDL in the SASS), registers per thread, shared
memory, threads, and the key loop in the SASS (tools.compile_sm90.key_loop).
"""
from __future__ import annotations

from collections.abc import Sequence

from .compile_int8 import compile_launched, probe
from .compile_sm90 import loop_text, run_tool, spilled

NAME = "compile_portable"
SHAPE = (2, 8, 4096)
"""(B, H, N) of the meta inputs (H = 8 query heads reading 4 key heads: GQA)."""
KV_HEADS = 4
PATHS = {
    "exact-hybrid, centred keys": ("exact", "hybrid", True, False),
    "exact-hybrid, one block centred in the loop": ("exact", "hybrid", False, True),
    "exact-half, centred keys": ("exact", "half", True, False),
    "pasa-hybrid, shifted keys": ("pasa", "hybrid", True, False),
    "pasa-hybrid, shifted in the loop": ("pasa", "hybrid", False, False),
    "pasa-half, shifted keys": ("pasa", "half", True, False),
    "pasa-half, shifted in the loop": ("pasa", "half", False, False),
    "none-hybrid": ("none", "hybrid", False, False),
    "none-half": ("none", "half", False, False),
}
"""The kernel's key paths: (shift, precision, keys prepared by the pre-pass, all keys in one block)."""


def _pool(path: str, d: int) -> list[tuple]:
    """The long-query pool's configs of ``path`` that fit sm_90 at head dim ``d``, as (BLOCK_M, BLOCK_N, warps,
    stages)."""
    from pasa_diffusers.kernels import portable
    from pasa_diffusers.kernels.tuning import pow2_tile

    shift, _, prepared, _ = PATHS[path]
    tiled = shift == "none" or (shift == "exact" and prepared)
    table = portable._TILED_CONFIGS if tiled else portable._SHIFT_CONFIGS
    found = []
    for cfg in table["long"]:
        block_n = cfg.kwargs.get("BLOCK_N", 128)
        if portable._fits(cfg, block_n, pow2_tile(d)):
            found.append((cfg.kwargs["BLOCK_M"], block_n, cfg.num_warps, cfg.num_stages))
    return found


def cases() -> list[dict]:
    """The compile matrix (module docstring)."""
    found = []
    for path in PATHS:
        for sparse in (False, True):
            found.append({"path": path, "d": 64, "dtype": "float16", "config": _pool(path, 64)[0], "sparse": sparse,
                          "lse": False})
    for path in ("exact-hybrid, centred keys", "pasa-hybrid, shifted keys"):
        found.append({"path": path, "d": 64, "dtype": "float16", "config": _pool(path, 64)[0], "sparse": True,
                      "lse": True})
        for sparse in (False, True):
            found.append({"path": path, "d": 128, "dtype": "bfloat16", "config": _pool(path, 128)[0],
                          "sparse": sparse, "lse": False})
        for cfg in _pool(path, 64)[1:]:
            found.append({"path": path, "d": 64, "dtype": "float16", "config": cfg, "sparse": True, "lse": False})
    return found


# ---- the child's side: one compile, no GPU --------------------------------------------------------

def _launch(case: dict):
    """``(kernel, args, meta, options)`` of one case, built by ``portable.kernel_call``."""
    import torch

    from pasa_diffusers.block_sparse import BlockSparseMask
    from pasa_diffusers.kernels import portable
    from pasa_diffusers.rules import SHIFT_BLOCK
    from pasa_diffusers.shift_matrix import DEFAULT_BETA, shift_constants

    dtype = getattr(torch, case["dtype"])
    b, h, n = SHAPE
    d = case["d"]
    shift, precision, prepared, one_block = PATHS[case["path"]]
    n_k = SHIFT_BLOCK if one_block else n

    def bnhd(heads, length):
        return torch.empty(b, length, heads, d, dtype=dtype, device="meta").transpose(1, 2)

    q, k, v, out = bnhd(h, n), bnhd(KV_HEADS, n_k), bnhd(KV_HEADS, n_k), bnhd(h, n)
    blocks = -(-n_k // SHIFT_BLOCK)
    centres = (torch.empty(b, KV_HEADS, blocks, d, device="meta") if shift == "exact" and prepared else None)
    constants = (shift_constants(DEFAULT_BETA, n_k, SHIFT_BLOCK, dtype, d ** -0.5) if shift == "pasa"
                 else portable.NO_SHIFT)
    lse = torch.empty(b, h, n, device="meta") if case["lse"] else None
    mask = None
    if case["sparse"]:
        q_blocks = -(-n // SHIFT_BLOCK)
        mask = BlockSparseMask.from_checked(
            torch.empty(b, KV_HEADS, q_blocks, dtype=torch.int32, device="meta"),
            torch.empty(b, KV_HEADS, q_blocks, blocks, dtype=torch.int32, device="meta"), n, n_k, SHIFT_BLOCK,
            SHIFT_BLOCK)
    args, meta, tiled = portable.kernel_call(q, k, v, out, scale=d ** -0.5, shift=shift, precision=precision,
                                             block_n=SHIFT_BLOCK, one_block=one_block, keys_prepared=prepared,
                                             centres=centres, shift_constants=constants, lse=lse, block_mask=mask)
    block_m, block_n, warps, stages = case["config"]
    meta["BLOCK_M"] = block_m
    if tiled:
        meta["BLOCK_N"] = block_n
    return portable.pasa_fwd_kernel, args, meta, {"num_warps": warps, "num_stages": stages}


def compile_one(case: dict) -> dict:
    return compile_launched(case, _launch)


# ---- the parent's side ----------------------------------------------------------------------------

COLUMNS = ["path", "D", "dtype", "config (BLOCK_M, BLOCK_N, warps, stages)", "block mask", "LSE",
           "wgmma PTX by type (HGMMA)", "mma.sync", "spills st/ld, local PTX/SASS", "regs/thread", "threads",
           "smem B", "key loop: SASS instructions, top ops", "compile s"]


def table_row(row: dict) -> list:
    head = [row["path"], row["d"], row["dtype"], ", ".join(str(x) for x in row["config"]),
            "yes" if row["sparse"] else "no", "yes" if row["lse"] else "no"]
    if not row["ok"]:
        return head + [f"FAILED: {row['error']}"] + [""] * 6 + [row["seconds"]]
    wg = ", ".join(f"{k} {v}" for k, v in row["wgmma"].items()) or "none"
    spill = f"{row['spill_st']}/{row['spill_ld']} B" if row["spill_st"] is not None else "?"
    return head + [f"{wg} ({row['hgmma']})", row["mma_sync"], f"{spill}, {row['ptx_local']}/{row['sass_local']}",
                   row["regs"], row["threads"], row["smem"], loop_text(row), row["seconds"]]


def main(argv: Sequence[str] | None = None) -> int:
    from pasa_diffusers.metrics import records

    def report(rows):
        masked = [r for r in rows if r["sparse"]]
        return (f"\nmeta inputs (B, H/Hk, N) = ({SHAPE[0]}, {SHAPE[1]}/{KV_HEADS}, {SHAPE[2]}), (B, N, H, D) memory\n\n"
                + records.markdown_table(COLUMNS, [table_row(r) for r in rows])
                + f"\n\n{sum(r['ok'] for r in rows)} of {len(rows)} compiled ({sum(r['ok'] for r in masked)} of "
                f"{len(masked)} with a block mask); with spills: {spilled(rows)}\n")

    return run_tool(NAME, __doc__, argv, what="the portable kernel", compile_one=compile_one, probe=probe,
                    cases=lambda args: cases(), report=report)


if __name__ == "__main__":
    raise SystemExit(main())
