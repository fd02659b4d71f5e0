"""Compile the Gluon Hopper kernel (``kernels/attn_fwd_gluon.py``) for sm_90 on a CPU, per config.

    .venv36/bin/python bench/gluon_compile_check.py            # every config, (50, 5, 9216, 64) and a ragged Nk
    .venv36/bin/python bench/gluon_compile_check.py --json out/gluon_compile.json

Needs triton==3.6.0 (the GPU machine's version) and torch (CPU); no GPU.  Each config is compiled in its
own process (a compiler crash is a row, not the end of the run) exactly as the wrapper would launch it:
``attn_fwd_gluon.kernel_call`` builds the descriptors and the argument list from meta tensors
(diffusers' (B, N, H, D) layout viewed as (B, H, N, D)), Triton's own specialisation rules make the
signature (descriptor types, which ints are divisible by 16), and ``GluonASTSource`` (Gluon's source
class: the kernel is already TTGIR-level, so it enters the pipeline at ``ttgir``) goes through
``triton.compile`` for ``GPUTarget("cuda", 90, 32)``.

Per config it reports, from the IR and the machine code:
- ``ws``: ``ttg.warp_specialize`` in the TTGIR, its partitions (warps each) and the ``setmaxnreg`` values in the PTX;
- ``wgmma``: ``wgmma.mma_async`` in the PTX (``HGMMA`` in the SASS);
- ``tma``: ``cp.async.bulk.tensor`` in the PTX (``UTMALDG`` / ``UTMASTG`` in the SASS);
- ``mbar``: ``mbarrier.*`` instructions in the PTX (init / expect_tx / arrive / try_wait);
- ``spill``: ptxas's spill stores/loads (bytes), ``st.local`` / ``ld.local`` in the PTX, ``STL`` / ``LDL`` in
  the SASS; ``regs``: registers per thread and stack from ``cuobjdump -res-usage``;
- ``smem``: shared memory bytes (Triton's metadata); ``threads``: 32 x all warps, producer included.
"""
from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import sm90_tools  # noqa: E402  (bench/, beside this script)

# (BLOCK_N, num_stages, overlap); three consumer warpgroups
CONFIGS = [(block_n, stages, overlap) for overlap in (False, True) for block_n, stages in
           ((128, 2), (128, 3), (64, 2), (64, 3), (64, 4))]
# (B, H, Nq, Nk, D): SVD-XT's largest spatial attention; a ragged one (MASK_N, rows past Nq)
SHAPES = [(50, 5, 9216, 9216, 64), (2, 5, 1000, 1000, 64)]


def _partitions(ttgir: str) -> list[int]:
    """Warps of each worker partition of the ``ttg.warp_specialize`` op (``partitionN(...) num_warps(W)``)."""
    region = ttgir[ttgir.find("ttg.warp_specialize"):]
    return [int(w) for w in re.findall(r"^\s*partition\d+\(.*\)\s*num_warps\((\d+)\)", region, flags=re.M)]


def _mbarrier_counts(ptx: str) -> dict:
    """PTX mbarrier instructions by kind (``arrive.expect_tx``: the producer's arrive with a byte count)."""
    ops = re.findall(r"mbarrier\.(init|arrive\.expect_tx|arrive|try_wait|inval)", ptx)
    return {op: ops.count(op) for op in sorted(set(ops))}


def compile_one(case: dict) -> dict:
    """Compile one (config, shape) for sm_90; return what the IR and the machine code show."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from pasa_diffusers.kernels import attn_fwd_gluon as G

    block_n, stages, overlap = case["config"]
    q, k_c, v, out, centres = sm90_tools.meta_inputs(case["shape"], G.SHIFT_BLOCK)
    cfg = {"BLOCK_N": block_n, "num_stages": stages, "overlap": overlap}
    row, kern, meta = sm90_tools.compile_case(
        case, G.exact_fwd_gluon_kernel, GluonASTSource,
        lambda: G.kernel_call(q, k_c, v, centres, out, scale=q.shape[-1] ** -0.5, config=cfg), ("num_warps", "maxnreg"))
    if kern is not None:
        row.update(maxnreg=meta["maxnreg"], consumer_regs=meta["CONSUMER_REGS"],
                   partitions=_partitions(kern.asm["ttgir"]),
                   mbar=_mbarrier_counts(kern.asm["ptx"]))
    return row


def _fmt(row: dict) -> str:
    block_n, stages, overlap = row["config"]
    n_k = row["shape"][3]

    def cells(spill):
        ws = (f"yes, workers {row['partitions']} warps, setmaxnreg {'/'.join(map(str, row['setmaxnreg']))}"
              if row["ws"] else "no")
        mbar = ", ".join(f"{k} {v}" for k, v in row["mbar"].items())
        return (f"{ws} | {row['wgmma']} ({row['hgmma']}) | {row['tma']} ({row['utmaldg']} ld, {row['utmastg']} st) | "
                f"{mbar} | {spill}, local PTX/SASS {row['ptx_local']}/{row['sass_local']}, stack {row['stack']} | "
                f"{row['regs']} (maxnreg {row['maxnreg']}) | {row['threads']} | {row['smem']} | {row['mufu_ex2']} | "
                f"{row['seconds']}")

    return sm90_tools.table_row(row, f"192x{block_n:<3} s{stages} {'overlap' if overlap else 'serial'}",
                                f"Nk={n_k:<5}", cells)


def main() -> None:
    sm90_tools.check_main(
        os.path.abspath(__file__), __doc__.splitlines()[0], compile_one,
        lambda args: [{"config": c, "shape": s} for s in SHAPES for c in CONFIGS],
        "| 192 rows x BLOCK_N, stages, loop | shape | warp-specialised | wgmma PTX (HGMMA SASS) | "
        "TMA PTX (SASS) | mbarrier PTX ops | spills st/ld | regs/thread | threads | smem B | MUFU.EX2 | "
        "compile s |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        _fmt, title=", Gluon", jobs=2)


if __name__ == "__main__":
    main()
