"""Compiling a Triton or Gluon kernel for sm_90 on a CPU machine, and reading what came out.

Shared by ``hopper_compile_check.py`` and ``gluon_compile_check.py`` (run with ``.venv36/bin/python``:
triton 3.6, the GPU machine's version).  Nothing here needs a GPU.
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


def specialization(fn, args, meta) -> tuple[dict, dict, dict]:
    """Triton's specialisation of ``args`` for the jitted ``fn``: ``(signature, constexprs, attrs)``, as a
    launch would make it (ints equal to 1 become constexprs, pointers and ints divisible by 16 say so)."""
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


def meta_inputs(shape, shift_block: int):
    """``(q, k_c, v, out, centres)`` on the meta device for ``shape = (B, H, Nq, Nk, D)``, fp16: q, v and
    out as diffusers holds them ((B, N, H, D) contiguous viewed as (B, H, N, D)), the pre-pass's
    contiguous ``k_c`` and its fp32 centres, one per ``shift_block`` keys: what a launcher's
    ``kernel_call`` takes to build the argument list without a GPU."""
    import torch

    b, h, n_q, n_k, d = shape

    def bnhd(n):
        return torch.empty(b, n, h, d, dtype=torch.float16, device="meta").transpose(1, 2)

    centres = torch.empty(b, h, -(-n_k // shift_block), d, dtype=torch.float32, device="meta")
    return bnhd(n_q), torch.empty(b, h, n_k, d, dtype=torch.float16, device="meta"), bnhd(n_k), bnhd(n_q), centres


def nvidia_tool(name: str) -> str:
    """The path of one of the CUDA tools Triton ships beside ptxas (``cuobjdump``, ``nvdisasm``)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return os.path.join(os.path.dirname(get_ptxas(90).path), name)


def ptxas_report(ptx: str) -> dict:
    """``ptxas -v`` on the PTX: spill bytes (the cubin Triton keeps does not carry them) and warnings."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([nvidia_tool("ptxas"), "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    log = res.stdout + res.stderr
    spill_st = re.findall(r"(\d+) bytes spill stores", log)
    spill_ld = re.findall(r"(\d+) bytes spill loads", log)
    return {"spill_st": int(spill_st[0]) if spill_st else None, "spill_ld": int(spill_ld[0]) if spill_ld else None,
            "ptxas_warnings": [ln.strip() for ln in log.splitlines() if "warning" in ln.lower()][:3]}


def cubin_report(cubin: bytes) -> dict:
    """``cuobjdump -res-usage`` (registers, stack, local memory) and ``-sass`` instruction counts (wgmma,
    TMA loads and stores, exponentials, local loads and stores) on the cubin Triton compiled."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run([nvidia_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([nvidia_tool("cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    regs = re.findall(r"REG:(\d+)", usage)
    stack = re.findall(r"STACK:(\d+)", usage)
    local = re.findall(r"LOCAL:(\d+)", usage)
    return {"regs": int(regs[0]) if regs else None, "stack": int(stack[0]) if stack else None,
            "local": int(local[0]) if local else None,
            "hgmma": len(re.findall(r"\bHGMMA\b", sass)), "utmaldg": len(re.findall(r"UTMALDG", sass)),
            "utmastg": len(re.findall(r"UTMASTG", sass)), "mufu_ex2": len(re.findall(r"MUFU\.EX2", sass)),
            "sass_local": len(re.findall(r"\b(?:STL|LDL)\b", sass))}


def kernel_report(kern) -> dict:
    """What a compiled kernel shows: warp specialisation (``ttg.warp_specialize`` in the TTGIR) and its
    ``setmaxnreg`` values, wgmma and TMA instructions and local loads/stores in the PTX, shared memory,
    threads as launched, plus :func:`ptxas_report` and :func:`cubin_report`."""
    ttgir, ptx = kern.asm["ttgir"], kern.asm["ptx"]
    report = dict(
        ws="ttg.warp_specialize" in ttgir,
        setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
        wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        tma=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        ptx_local=len(re.findall(r"\b(?:st|ld)\.local", ptx)),
        smem=kern.metadata.shared,
        scratch=getattr(kern.metadata, "global_scratch_size", None),
        threads=32 * kern.metadata.num_warps,
    )
    report.update(ptxas_report(ptx))
    report.update(cubin_report(kern.asm["cubin"]))
    return report


def compile_case(case: dict, kernel, source_cls, kernel_call, option_names) -> tuple[dict, object, dict]:
    """Compile one launch for sm_90 without a GPU: ``kernel_call()`` gives ``(grid, args, meta)`` as the
    launcher would launch it, ``option_names`` are the meta entries that are compile options
    (``num_warps``, ...), ``source_cls`` is ``ASTSource`` or Gluon's.  Returns ``(row, kern, meta)``:
    the case with ``ok``, ``seconds`` and :func:`kernel_report` (or the error), the compiled kernel or
    ``None``, and the meta-parameters with the options still in them."""
    import triton
    from triton.backends.compiler import GPUTarget

    row, t0 = dict(case), time.time()
    try:
        _, args, meta = kernel_call()
        constexpr_meta = {k: v for k, v in meta.items() if k not in option_names}
        signature, constexprs, attrs = specialization(kernel, args, constexpr_meta)
        src = source_cls(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={k: meta[k] for k in option_names})
    except Exception as e:  # noqa: BLE001 - a compiler failure is a result here
        row.update(ok=False, error=compile_error(e), seconds=round(time.time() - t0, 1))
        return row, None, {}
    row.update(ok=True, seconds=round(time.time() - t0, 1), **kernel_report(kern))
    return row, kern, meta


def compile_error(e: Exception) -> str:
    """A compiler exception as one table cell: its type and the last three non-empty lines."""
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return (type(e).__name__ + ": " + " / ".join(lines[-3:]))[:400]


def table_row(row: dict, cfg: str, shape: str, cells) -> str:
    """One markdown row of a compile check: ``| cfg | shape | FAILED ... |`` for a case that did not compile,
    otherwise ``| cfg | shape | cells(spill) |`` with ``spill`` the ptxas spill stores/loads ("?" if unknown)."""
    if not row["ok"]:
        return f"| {cfg} | {shape} | FAILED ({row['seconds']} s): {row['error']} |"
    spill = f"{row['spill_st']}/{row['spill_ld']} B" if row["spill_st"] is not None else "?"
    return f"| {cfg} | {shape} | {cells(spill)} |"


def run_isolated(script: str, case: dict) -> dict:
    """``script --one <case as JSON>`` in a child process (it prints ``ROW <json>``), so that a crashing
    compiler is a row, not the end of the run; tuples in the row come back as tuples."""
    t0 = time.time()
    res = subprocess.run([sys.executable, script, "--one", json.dumps(case)], capture_output=True, text=True,
                         timeout=900)
    for line in res.stdout.splitlines():
        if line.startswith("ROW "):
            row = json.loads(line[4:])
            row["config"], row["shape"] = tuple(row["config"]), tuple(row["shape"])
            return row
    tail = " / ".join((res.stderr.strip().splitlines() or ["no output"])[-3:])
    return dict(case, ok=False, error=f"process died (rc {res.returncode}): {tail}"[:400],
                seconds=round(time.time() - t0, 1))


def print_one(case_json: str, compile_one) -> None:
    """The child's side of :func:`run_isolated`: compile one case and print its row."""
    case = json.loads(case_json)
    case = {"config": tuple(case["config"]), "shape": tuple(case["shape"])}
    print("ROW " + json.dumps(compile_one(case), default=str))


def run_cases(script: str, cases: list[dict], fmt, *, jobs: int, json_path: str | None) -> list[dict]:
    """Every case through :func:`run_isolated` (``jobs`` at a time), each row printed with ``fmt`` as it
    comes, the rows written to ``json_path`` if given, and a summary line: compiled, warp-specialised,
    with spills (ptxas spill stores or local memory in the PTX or SASS)."""
    from concurrent.futures import ThreadPoolExecutor

    rows = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for row in pool.map(lambda case: run_isolated(script, case), cases):
            rows.append(row)
            print(fmt(row), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    spilled = sum(1 for r in rows if r.get("spill_st") or r.get("ptx_local") or r.get("sass_local"))
    print(f"\n{sum(r['ok'] for r in rows)} of {len(rows)} compiled; warp-specialised: "
          f"{sum(1 for r in rows if r.get('ws'))}; with spills: {spilled}")
    return rows


def check_main(script: str, description: str, compile_one, make_cases, header: str, fmt, *, title: str = "",
               jobs: int = 1, add_arguments=None) -> None:
    """The command line of both compile checks: ``--jobs``, ``--json``, the script's own arguments
    (``add_arguments(parser)``) and the internal ``--one`` (a child process compiling one case); then the
    triton version, ``header`` and one row per case of ``make_cases(args)`` through :func:`run_cases`."""
    ap = argparse.ArgumentParser(description=description)
    if add_arguments is not None:
        add_arguments(ap)
    ap.add_argument("--jobs", type=int, default=jobs, help=f"compiles in parallel (default {jobs})")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print_one(args.one, compile_one)
        return

    import triton

    print(f"triton {triton.__version__}, target cuda sm_90 (warp size 32){title}", flush=True)
    print(header, flush=True)
    run_cases(script, make_cases(args), fmt, jobs=args.jobs, json_path=args.json)
