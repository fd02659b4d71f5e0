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

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (num_consumers, BLOCK_N, num_stages, overlap)
_POOL = [(2, 128, 2), (2, 128, 3), (3, 128, 2), (1, 128, 2), (2, 64, 3), (3, 64, 3)]
CONFIGS = [c + (overlap, ) for overlap in (False, True) for c in _POOL]
# (B, H, Nq, Nk, D): SVD-XT's largest spatial attention; a ragged one (MASK_N, rows past Nq)
SHAPES = [(50, 5, 9216, 9216, 64), (2, 5, 1000, 1000, 64)]


def _signature(fn, args, meta):
    """Triton's specialisation of ``args`` for ``fn``: (signature, constexprs, attrs)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    signature, constexprs, attrs = {}, {}, {}
    values = iter(args)
    for p in fn.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[p.name] = meta[p.name]
            continue
        value = next(values)
        ty, spec = native_specialize_impl(BaseBackend, value, False, not p.do_not_specialize,
                                          not p.do_not_specialize_on_alignment)
        if ty == "constexpr":
            signature[p.name] = "constexpr"
            constexprs[p.name] = value
        else:
            signature[p.name] = ty
            if spec == "D":
                attrs[(p.num,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def _nvidia_tool(name: str) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    return os.path.join(os.path.dirname(get_ptxas(90).path), name)


def _ptxas_report(ptx: str) -> dict:
    """ptxas -v on the PTX: spill bytes (the cubin Triton keeps does not carry them)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([_nvidia_tool("ptxas"), "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    log = res.stdout + res.stderr
    spill_st = re.findall(r"(\d+) bytes spill stores", log)
    spill_ld = re.findall(r"(\d+) bytes spill loads", log)
    return {"spill_st": int(spill_st[0]) if spill_st else None, "spill_ld": int(spill_ld[0]) if spill_ld else None,
            "ptxas_warnings": [ln.strip() for ln in log.splitlines() if "warning" in ln.lower()][:3]}


def _cubin_report(cubin: bytes) -> dict:
    """``cuobjdump -res-usage`` (registers, stack, shared) and ``-sass`` counts on Triton's cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = subprocess.run([_nvidia_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True)
        sass = subprocess.run([_nvidia_tool("cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    usage = res.stdout
    regs = re.findall(r"REG:(\d+)", usage)
    stack = re.findall(r"STACK:(\d+)", usage)
    local = re.findall(r"LOCAL:(\d+)", usage)
    return {"regs": int(regs[0]) if regs else None, "stack": int(stack[0]) if stack else None,
            "local": int(local[0]) if local else None,
            "hgmma": len(re.findall(r"\bHGMMA\b", sass)), "utmaldg": len(re.findall(r"UTMALDG", sass)),
            "utmastg": len(re.findall(r"UTMASTG", sass)), "mufu_ex2": len(re.findall(r"MUFU\.EX2", sass)),
            "sass_local": len(re.findall(r"\b(?:STL|LDL)\b", sass))}


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
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from pasa_diffusers.kernels import attn_fwd_gluon as G

    b, h, n_q, n_k, d = case["shape"]
    consumers, block_n, stages, overlap = case["config"]
    dt = torch.float16

    def bnhd(n):  # diffusers' (B, N, H, D) contiguous, viewed as (B, H, N, D)
        return torch.empty(b, n, h, d, dtype=dt, device="meta").transpose(1, 2)

    q, k_c, v, out = bnhd(n_q), torch.empty(b, h, n_k, d, dtype=dt, device="meta"), bnhd(n_k), bnhd(n_q)
    centres = torch.empty(b, h, triton.cdiv(n_k, G.SHIFT_BLOCK), d, dtype=torch.float32, device="meta")
    cfg = {"num_consumers": consumers, "BLOCK_N": block_n, "num_stages": stages, "overlap": overlap}
    row = dict(case)
    t0 = time.time()
    try:
        _, args, meta = G.kernel_call(q, k_c, v, centres, out, scale=d ** -0.5, config=cfg)
        options = {"num_warps": meta.pop("num_warps"), "maxnreg": meta.pop("maxnreg")}
        signature, constexprs, attrs = _signature(G.exact_fwd_gluon_kernel, args, meta)
        src = GluonASTSource(fn=G.exact_fwd_gluon_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except Exception as e:  # noqa: BLE001 - a compiler failure is a result here
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        row.update(ok=False, error=(type(e).__name__ + ": " + " / ".join(lines[-3:]))[:400],
                   seconds=round(time.time() - t0, 1))
        return row
    ttgir, ptx = kern.asm["ttgir"], kern.asm["ptx"]
    row.update(
        ok=True, seconds=round(time.time() - t0, 1),
        maxnreg=options["maxnreg"], consumer_regs=meta["CONSUMER_REGS"],
        ws="ttg.warp_specialize" in ttgir, partitions=_partitions(ttgir),
        setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
        wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        tma=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        mbar=_mbarrier_counts(ptx),
        ptx_local=len(re.findall(r"\b(?:st|ld)\.local", ptx)),
        smem=kern.metadata.shared,
        threads=32 * kern.metadata.num_warps,
    )
    row.update(_ptxas_report(ptx))
    row.update(_cubin_report(kern.asm["cubin"]))
    return row


def _run_isolated(case: dict) -> dict:
    """``compile_one`` in a child process, so that a crashing compiler is a row, not the end of the run."""
    t0 = time.time()
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", json.dumps(case)],
                         capture_output=True, text=True, timeout=900)
    for line in res.stdout.splitlines():
        if line.startswith("ROW "):
            row = json.loads(line[4:])
            row["config"], row["shape"] = tuple(row["config"]), tuple(row["shape"])
            return row
    tail = " / ".join((res.stderr.strip().splitlines() or ["no output"])[-3:])
    return dict(case, ok=False, error=f"process died (rc {res.returncode}): {tail}"[:400],
                seconds=round(time.time() - t0, 1))


def _fmt(row: dict) -> str:
    consumers, block_n, stages, overlap = row["config"]
    b, h, n_q, n_k, d = row["shape"]
    cfg = f"{64 * consumers:>3} ({consumers} WG) {block_n:>3} s{stages} {'overlap' if overlap else 'serial'}"
    shape = f"Nk={n_k:<5}"
    if not row["ok"]:
        return f"| {cfg} | {shape} | FAILED ({row['seconds']} s): {row['error']} |"
    spill = f"{row['spill_st']}/{row['spill_ld']} B" if row["spill_st"] is not None else "?"
    ws = (f"yes, workers {row['partitions']} warps, setmaxnreg {'/'.join(map(str, row['setmaxnreg']))}"
          if row["ws"] else "no")
    mbar = ", ".join(f"{k} {v}" for k, v in row["mbar"].items())
    return (f"| {cfg} | {shape} | {ws} | {row['wgmma']} ({row['hgmma']}) | {row['tma']} ({row['utmaldg']} ld, "
            f"{row['utmastg']} st) | {mbar} | {spill}, local PTX/SASS {row['ptx_local']}/{row['sass_local']}, "
            f"stack {row['stack']} | {row['regs']} (maxnreg {row['maxnreg']}) | {row['threads']} | {row['smem']} | "
            f"{row['mufu_ex2']} | {row['seconds']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2, help="compiles in parallel")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: compile one JSON case, print its row
    args = ap.parse_args()
    if args.one:
        case = json.loads(args.one)
        case = {"config": tuple(case["config"]), "shape": tuple(case["shape"])}
        print("ROW " + json.dumps(compile_one(case), default=str))
        return

    import triton

    print(f"triton {triton.__version__}, target cuda sm_90 (warp size 32), Gluon", flush=True)
    cases = [{"config": c, "shape": s} for s in SHAPES for c in CONFIGS]
    print("| BLOCK_M (consumers) BLOCK_N stages loop | shape | warp-specialised | wgmma PTX (HGMMA SASS) | "
          "TMA PTX (SASS) | mbarrier PTX ops | spills st/ld | regs/thread | threads | smem B | MUFU.EX2 | "
          "compile s |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    rows = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for row in pool.map(_run_isolated, cases):
            rows.append(row)
            print(_fmt(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    ok = sum(r["ok"] for r in rows)
    print(f"\n{ok} of {len(rows)} compiled; warp-specialised: {sum(1 for r in rows if r.get('ws'))}; with spills: "
          f"{sum(1 for r in rows if r.get('spill_st') or r.get('ptx_local') or r.get('sass_local'))}")


if __name__ == "__main__":
    main()
