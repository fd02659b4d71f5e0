"""Compile the Hopper exact-shift kernel (``kernels/attn_fwd_tma.py``) for sm_90 on a CPU, per config.

    .venv36/bin/python bench/hopper_compile_check.py            # every config, (50, 5, 9216, 64) and a ragged Nk
    .venv36/bin/python bench/hopper_compile_check.py --quick    # the main grid only, Nk = 9216

Needs triton==3.6.0 (the GPU machine's version) and torch (CPU) in the environment; no GPU.  Each config
is compiled in its own process (a compiler crash is reported, not fatal) exactly as the wrapper would
launch it: the argument list comes from ``attn_fwd_tma.kernel_call`` on meta tensors of the shape
(diffusers' (B, N, H, D) layout viewed as (B, H, N, D)), and Triton's own specialisation rules turn it
into the signature (which ints are constexpr 1, which are divisible by 16).

Per config it reports, from the IR and the machine code:
- ``ws``: warp-specialised (``ttg.warp_specialize`` in the TTGIR) and the ``setmaxnreg`` values in the PTX;
- ``wgmma``: ``wgmma.mma_async`` instructions in the PTX (``HGMMA`` in the SASS);
- ``tma``: ``cp.async.bulk.tensor`` instructions in the PTX;
- ``spill``: ptxas's spill stores/loads (bytes) and ``st.local`` / ``ld.local`` in the PTX;
- ``regs``: registers per thread (ptxas), ``threads``: warps x 32 as launched (producer included);
- ``smem``: shared memory bytes (Triton's metadata);
- ``mufu``: ``MUFU.EX2`` in the SASS (exponentials per instruction issue: a sanity count).
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import sm90_tools  # noqa: E402  (bench/, beside this script)

# (BLOCK_M, BLOCK_N, num_warps, num_stages, warp_specialize, r_on_tc).  Warp specialisation needs r_on_tc
# (the wrapper refuses the other combination: Triton 3.6's pass aborts on it).
_GRID = [(bm, w, s) for bm in (128, 64) for s in (2, 3) for w in (4, 8)]
MAIN_GRID = ([(bm, 128, w, s, False, False) for bm, w, s in _GRID]
             + [(bm, 128, w, s, True, True) for bm, w, s in _GRID]
             + [(128, 128, 8, 2, False, True), (128, 128, 8, 3, False, True), (128, 128, 4, 3, False, True),
                (64, 128, 4, 3, False, True)])
EXTRA = [(128, 64, 4, 3, False, False), (128, 64, 8, 3, False, False), (128, 64, 4, 2, True, True),
         (128, 64, 4, 3, True, True)]
# (B, H, Nq, Nk, D): SVD-XT's largest spatial attention; the same with a ragged Nk (MASK_N)
SHAPE = (50, 5, 9216, 9216, 64)
RAGGED = (50, 20, 576, 576, 64)
HEAD_DIMS = (16, 32, 40, 80, 128)


def compile_one(case: dict) -> dict:
    """Compile one (config, shape) for sm_90; return what the IR and the machine code show."""
    from triton.compiler import ASTSource

    from pasa_diffusers.kernels import attn_fwd_tma as K

    bm, bn, warps, stages, ws, r_tc = case["config"]
    q, k_c, v, out, centres = sm90_tools.meta_inputs(case["shape"], K.SHIFT_BLOCK)
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "warp_specialize": ws,
           "r_on_tc": r_tc}
    row, _, _ = sm90_tools.compile_case(
        case, K.exact_fwd_tma_kernel, ASTSource,
        lambda: K.kernel_call(q, k_c, v, centres, out, scale=q.shape[-1] ** -0.5, config=cfg),
        ("num_warps", "num_stages"))
    return row


def _cases(quick: bool) -> list[dict]:
    cases = [{"config": c, "shape": SHAPE} for c in MAIN_GRID]
    if quick:
        return cases
    cases += [{"config": c, "shape": RAGGED} for c in MAIN_GRID]
    cases += [{"config": c, "shape": SHAPE} for c in EXTRA]
    for d in HEAD_DIMS:
        for c in [(128, 128, 8, 2, False, False), (128, 128, 4, 2, True, True)]:
            cases.append({"config": c, "shape": (2, 4, 1000, 1000, d)})
    return cases


def _fmt(row: dict) -> str:
    bm, bn, warps, stages, ws, r_tc = row["config"]
    n_k, d = row["shape"][3], row["shape"][4]

    def cells(spill):
        ws_txt = ("yes " + "/".join(map(str, row["setmaxnreg"]))) if row["ws"] else "no"
        return (f"{ws_txt} | {row['wgmma']} ({row['hgmma']}) | {row['tma']} | "
                f"{spill}, local {row['ptx_local']}/{row['sass_local']} | {row['regs']} | {row['threads']} | "
                f"{row['smem']} | {row['mufu_ex2']} | {row['seconds']}")

    cfg = f"{bm:>3} {bn:>3} {warps} {stages} {'WS' if ws else '--'} {'tc ' if r_tc else 'fma'}"
    return sm90_tools.table_row(row, cfg, f"Nk={n_k:<5} d={d:<3}", cells)


def main() -> None:
    def add_arguments(ap):
        ap.add_argument("--quick", action="store_true", help="the main grid on (50, 5, 9216, 64) only")

    sm90_tools.check_main(
        os.path.abspath(__file__), __doc__.splitlines()[0], compile_one, lambda args: _cases(args.quick),
        "| BM  BN  w s ws r_j | shape | warp-specialised (setmaxnreg) | wgmma PTX (HGMMA SASS) | TMA copies | "
        "spills st/ld, local PTX/SASS | regs | threads | smem B | MUFU.EX2 | compile s |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        _fmt, add_arguments=add_arguments)


if __name__ == "__main__":
    main()
