"""What does the Gluon Hopper kernel compile to for sm_90, per config, on a machine without a GPU?

    python -m tools.compile_sm90 --python PYTHON --out DIR     # PYTHON: an interpreter with triton 3.6
    python -m tools.compile_sm90 --jobs 2 --out DIR            # this interpreter has triton 3.6
    python -m tools.compile_sm90 --sparse --out DIR            # with a block mask, at the masked config

Needs, in the interpreter --python names (default: this one), triton 3.6 (the GPU machine's version, whose
Gluon API kernels/hopper.py is written for) and torch; no GPU.  Each (config, shape) is compiled in its
own process (PYTHON -m tools.compile_sm90 --one CASE, from the repository root), so that a compiler
crash is a row, not the end of the run, exactly as the launch would compile it: hopper.kernel_call
builds the descriptors and the argument list from meta tensors (diffusers' (B, N, H, D) layout viewed
as (B, H, N, D)), Triton's own specialisation rules make the signature, and Gluon's source class goes
through triton.compile for GPUTarget("cuda", 90, 32).

Per case, from the IR and the machine code: warp specialisation (ttg.warp_specialize in the TTGIR, its
worker partitions and the setmaxnreg values in the PTX); wgmma.mma_async in the PTX (HGMMA in the SASS);
TMA copies (cp.async.bulk.tensor; UTMALDG / UTMASTG); mbarrier instructions by kind; spills (ptxas's
spill stores/loads, st.local / ld.local in the PTX, STL / LDL in the SASS); registers per thread and
stack (cuobjdump -res-usage); threads (32 x all warps, producer included); shared memory bytes; MUFU.EX2
count; the consumer's key loop in the SASS (its instruction count and most frequent opcodes: key_loop, where
a select per score on every tile showed up, journal 62); compile seconds.
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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pasa_diffusers.compat import compile_for_cuda, cuda_tool, specialization

PACKAGE = "tools"
NAME = "compile_sm90"
ROOT = Path(__file__).resolve().parents[1]
"""The repository root: the children run ``PYTHON -m tools.compile_sm90`` from there."""

CONFIGS = [(block_n, stages, overlap, 3) for overlap in (False, True)
           for block_n, stages in ((128, 2), (128, 3), (64, 2), (64, 3), (64, 4))]
"""(BLOCK_N, num_stages, overlap, consumers) at the 64 head-dim tile."""
WIDE_CONFIGS = [(128, 2, False, 2), (128, 2, True, 2), (64, 3, False, 2), (64, 3, True, 2), (64, 4, True, 2),
                (64, 2, False, 3), (64, 2, True, 3)]
"""(BLOCK_N, num_stages, overlap, consumers) at the 128 tile (head dims above 64): what fits its shared memory."""
SHAPES = [((50, 5, 9216, 9216, 64), "float16", CONFIGS), ((2, 5, 1000, 1000, 64), "bfloat16", CONFIGS),
          ((2, 12, 32760, 32760, 128), "bfloat16", WIDE_CONFIGS), ((1, 4, 1000, 777, 96), "float16", WIDE_CONFIGS)]
"""(B, H, Nq, Nk, D), dtype, configs: SVD-XT's largest spatial attention; a ragged one (masked keys, rows past
Nq) in bf16; Wan 2.1 1.3B at 480p; a ragged head dim 96 (the 128 tile, columns past D padded by TMA)."""
CHILD_TIMEOUT_S = 900


# ---- the child's side: one compile, no GPU --------------------------------------------------------

def meta_inputs(shape: Sequence[int], shift_block: int, dtype: str = "float16"):
    """``(q, k_c, v, out, centres)`` on the meta device for ``shape = (B, H, Nq, Nk, D)`` in ``dtype``: q, v
    and out as diffusers holds them, the pre-pass's contiguous ``k_c`` and its fp32 centres, one per
    ``shift_block`` keys."""
    import torch

    b, h, n_q, n_k, d = shape
    dt = getattr(torch, dtype)

    def bnhd(n):
        return torch.empty(b, n, h, d, dtype=dt, device="meta").transpose(1, 2)

    centres = torch.empty(b, h, -(-n_k // shift_block), d, dtype=torch.float32, device="meta")
    return bnhd(n_q), torch.empty(b, h, n_k, d, dtype=dt, device="meta"), bnhd(n_k), bnhd(n_q), centres


def meta_block_mask(n_q: int, n_k: int, batch: int, heads: int):
    """A block mask of meta tensors over ``n_q`` queries and ``n_k`` keys, per batch element and head (as
    ``BlockSparseMask.from_dense`` lays it out: contiguous int32 counts and indices)."""
    import torch

    from pasa_diffusers.block_sparse import BlockSparseMask
    from pasa_diffusers.rules import SHIFT_BLOCK

    q_blocks, k_blocks = -(-n_q // SHIFT_BLOCK), -(-n_k // SHIFT_BLOCK)
    counts = torch.empty(batch, heads, q_blocks, dtype=torch.int32, device="meta")
    indices = torch.empty(batch, heads, q_blocks, k_blocks, dtype=torch.int32, device="meta")
    return BlockSparseMask.from_checked(counts, indices, n_q, n_k, SHIFT_BLOCK, SHIFT_BLOCK)


def _first_int(pattern: str, text: str) -> int | None:
    found = re.findall(pattern, text)
    return int(found[0]) if found else None


def ptxas_report(ptx: str) -> dict:
    """``ptxas -v`` on the PTX: spill bytes (the cubin Triton keeps does not carry them)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([cuda_tool("ptxas"), "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    log = res.stdout + res.stderr
    return {"spill_st": _first_int(r"(\d+) bytes spill stores", log),
            "spill_ld": _first_int(r"(\d+) bytes spill loads", log)}


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.+?)\s*;")
_PV_MMA = re.compile(r"[HQI]GMMA\S*\s+R\d+,\s*R\d+|QGMMA")
"""The ``P V`` of an attention loop: a warpgroup MMA whose A operand is registers (``p`` stays there), or an FP8
one (``hopper_int8``'s ``P8`` goes through shared memory)."""


def key_loop(sass: str, top: int = 8) -> dict:
    """The attention's key loop in ``cuobjdump -sass`` text: the smallest loop (a backward branch's range) that
    holds a ``P V`` MMA (:data:`_PV_MMA`) and an ``MUFU.EX2`` (the softmax), and of those the ones with an INT8
    MMA (``IGMMA``) where there are such (the 8-bit kernels' coded loop, not their 16-bit blocks' loop), as
    ``{"loop_sass": its instruction count, "loop_ops": its ``top`` opcodes with their counts}``; ``None`` values
    where there is none.  Code under a branch inside the loop (a last tile's mask) counts as if every tile ran
    it: compare histograms between versions, not the count with the instructions a tile runs."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in map(_SASS_LINE.search, sass.splitlines()) if m]
    loops = []
    for addr, text in ins:
        branch = re.search(r"\bBRA\s+(?:`\(.*?\)\s*)?0x([0-9a-f]+)", text)
        if not branch or int(branch.group(1), 16) >= addr:
            continue
        body = [t for a, t in ins if int(branch.group(1), 16) <= a <= addr]
        if any(_PV_MMA.search(t) for t in body) and any("MUFU.EX2" in t for t in body):
            loops.append(body)
    coded = [body for body in loops if any(re.search(r"\bIGMMA\b", t) for t in body)]
    best = min(coded or loops, key=len, default=None)
    if best is None:
        return {"loop_sass": None, "loop_ops": None}
    ops: dict[str, int] = {}
    for text in best:
        op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
        ops[op] = ops.get(op, 0) + 1
    ranked = sorted(ops.items(), key=lambda kv: -kv[1])[:top]
    return {"loop_sass": len(best), "loop_ops": ", ".join(f"{op} {n}" for op, n in ranked)}


def cubin_report(cubin: bytes) -> dict:
    """``cuobjdump -res-usage`` (registers, stack) and ``-sass`` instruction counts of the cubin (warpgroup
    MMAs by kind: HGMMA 16-bit, IGMMA INT8, QGMMA FP8)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run([cuda_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([cuda_tool("cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    return {"regs": _first_int(r"REG:(\d+)", usage), "stack": _first_int(r"STACK:(\d+)", usage),
            "hgmma": len(re.findall(r"\bHGMMA\b", sass)), "igmma": len(re.findall(r"\bIGMMA\b", sass)),
            "qgmma": len(re.findall(r"\bQGMMA\b", sass)), "utmaldg": len(re.findall(r"UTMALDG", sass)),
            "utmastg": len(re.findall(r"UTMASTG", sass)), "mufu_ex2": len(re.findall(r"MUFU\.EX2", sass)),
            "sass_local": len(re.findall(r"\b(?:STL|LDL)\b", sass)), **key_loop(sass)}


def kernel_report(kern) -> dict:
    """What a compiled kernel shows in its TTGIR, PTX and cubin (the module docstring's list)."""
    ttgir, ptx = kern.asm["ttgir"], kern.asm["ptx"]
    region = ttgir[ttgir.find("ttg.warp_specialize"):]
    mbar = re.findall(r"mbarrier\.(init|arrive\.expect_tx|arrive|try_wait|inval)", ptx)
    report = {
        "ws": "ttg.warp_specialize" in ttgir,
        "partitions": [int(w) for w in re.findall(r"^\s*partition\d+\(.*\)\s*num_warps\((\d+)\)", region, flags=re.M)],
        "setmaxnreg": sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "tma": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        "mbar": {op: mbar.count(op) for op in sorted(set(mbar))},
        "ptx_local": len(re.findall(r"\b(?:st|ld)\.local", ptx)),
        "smem": kern.metadata.shared,
        "threads": 32 * kern.metadata.num_warps,
    }
    return {**report, **ptxas_report(ptx), **cubin_report(kern.asm["cubin"])}


def compile_one(case: dict) -> dict:
    """Compile one ``{"config": (BLOCK_N, num_stages, overlap, consumers), "shape": (B, H, Nq, Nk, D),
    "dtype": name}`` for sm_90; with ``"sparse": True`` (and ``"config": None``) with a block mask at the
    config the launch picks for one, which the row's ``config`` then names."""
    from pasa_diffusers.kernels import hopper

    row, t0 = dict(case), time.time()
    config = None
    if case["config"] is not None:
        block_n, stages, overlap, consumers, *pingpong = case["config"]
        config = {"BLOCK_N": block_n, "num_stages": stages, "overlap": bool(overlap), "consumers": consumers,
                  "pingpong": bool(pingpong and pingpong[0])}
    try:
        q, k_c, v, out, centres = meta_inputs(case["shape"], hopper.SHIFT_BLOCK, case["dtype"])
        b, h, n_q, n_k, _ = case["shape"]
        mask = meta_block_mask(n_q, n_k, b, h) if case.get("sparse") else None
        _, args, meta = hopper.kernel_call(q, k_c, v, centres, out, scale=q.shape[-1] ** -0.5, config=config,
                                           block_mask=mask)
        row["config"] = (meta["BLOCK_N"], meta["NUM_STAGES"], meta["OVERLAP"], meta["NUM_CONSUMERS"])
        options = {name: meta.pop(name) for name in ("num_warps", "maxnreg")}
        signature, constexprs, attrs = specialization(hopper.exact_fwd_gluon_kernel, args, meta)
        kern = compile_for_cuda(hopper.exact_fwd_gluon_kernel, signature, constexprs, attrs, options, gluon=True)
        row.update(ok=True, maxnreg=options["maxnreg"], consumer_regs=meta.get("CONSUMER_REGS"), **kernel_report(kern))
    except Exception as e:  # noqa: BLE001 - a compiler failure is a result here
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        row.update(ok=False, error=(type(e).__name__ + ": " + " / ".join(lines[-3:]))[:400])
    row["seconds"] = round(time.time() - t0, 1)
    return row


def probe() -> dict:
    """This interpreter's triton version and why the Gluon kernel cannot compile here (or None)."""
    import triton

    from pasa_diffusers.kernels import hopper

    return {"triton": triton.__version__, "python": sys.executable, "unavailable": hopper.unavailable_reason()}


# ---- the parent's side: one child per case --------------------------------------------------------

def _parse_config(text: str) -> tuple[int, int, bool, int]:
    """``BLOCK_N,num_stages,overlap,consumers`` (overlap 0 or 1) -> a config tuple."""
    try:
        block_n, stages, overlap, consumers = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--configs {text!r}: expected BLOCK_N,num_stages,overlap,consumers, "
                                         "e.g. 128,3,0,3")
    return block_n, stages, bool(overlap), consumers


def run_child(python: str, *args: str, module: str = f"tools.{NAME}") -> tuple[dict | None, str]:
    """``python -m <module> *args`` from the repository root (this file's by default; ``tools.compile_int8``
    shares it): its ``ROW`` JSON line (or None) and the last lines of its stderr."""
    try:
        res = subprocess.run([python, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=CHILD_TIMEOUT_S)
    except OSError as e:
        return None, f"cannot start it ({type(e).__name__}: {e.strerror or e})"
    tail = " / ".join((res.stderr.strip().splitlines() or [f"no output (rc {res.returncode})"])[-3:])
    for line in res.stdout.splitlines():
        if line.startswith("ROW "):
            return json.loads(line[4:]), tail
    return None, f"process died (rc {res.returncode}): {tail}"[:400]


def compile_isolated(python: str, case: dict, module: str = f"tools.{NAME}") -> dict:
    """The module's ``compile_one`` of ``case`` in a child process: a compiler that crashes is a failed row."""
    t0 = time.time()
    row, tail = run_child(python, "--one", json.dumps(case), module=module)
    return row if row is not None else dict(case, ok=False, error=tail, seconds=round(time.time() - t0, 1))


def table_row(row: dict) -> list:
    """One markdown row of a compiled (or failed) case."""
    block_n, stages, overlap, consumers = row["config"]
    head = [f"BLOCK_N {block_n}, {stages} stages, {'overlap' if overlap else 'serial'}, {consumers} consumers",
            f"Nk={row['shape'][3]}, D={row['shape'][4]}, {row['dtype']}{', block mask' if row.get('sparse') else ''}"]
    if not row["ok"]:
        return head + [f"FAILED: {row['error']}"] + [""] * 9 + [row["seconds"]]
    ws = (f"yes, workers {row['partitions']} warps, setmaxnreg {'/'.join(map(str, row['setmaxnreg']))}"
          if row["ws"] else "no")
    spill = f"{row['spill_st']}/{row['spill_ld']} B" if row["spill_st"] is not None else "?"
    return head + [ws, f"{row['wgmma']} ({row['hgmma']})", f"{row['tma']} ({row['utmaldg']} ld, {row['utmastg']} st)",
                   ", ".join(f"{k} {v}" for k, v in row["mbar"].items()),
                   f"{spill}, local PTX/SASS {row['ptx_local']}/{row['sass_local']}, stack {row['stack']}",
                   f"{row['regs']} (maxnreg {row['maxnreg']})", row["threads"], row["smem"], row["mufu_ex2"],
                   loop_text(row), row["seconds"]]


def loop_text(row: dict) -> str:
    """The key loop's cell: its SASS instruction count and top opcodes (:func:`key_loop`), or ``-``."""
    return f"{row['loop_sass']}: {row['loop_ops']}" if row.get("loop_sass") else "-"


COLUMNS = ["config", "shape", "warp-specialised", "wgmma PTX (HGMMA SASS)", "TMA PTX (SASS)",
           "mbarrier PTX ops", "spills st/ld", "regs/thread", "threads", "smem B", "MUFU.EX2",
           "key loop: SASS instructions, top ops", "compile s"]


def answer_child(argv: list[str], compile_one, probe) -> bool:
    """A child's one job, printed as a ``ROW`` JSON line (no harness: triton and torch only): ``--one CASE``
    (``compile_one`` of the JSON case) or ``--probe``; ``False`` where ``argv`` is the parent's."""
    if argv[:1] == ["--one"]:
        print("ROW " + json.dumps(compile_one(json.loads(argv[1])), default=str))
        return True
    if argv[:1] == ["--probe"]:
        print("ROW " + json.dumps(probe()))
        return True
    return False


def _jobs(text: str) -> int:
    jobs = int(text)
    if jobs < 1:
        raise argparse.ArgumentTypeError(f"{jobs}: must be at least 1")
    return jobs


def add_compiler_arguments(p) -> None:
    """``--python`` (the interpreter with triton 3.6 that compiles) and ``--jobs`` (>= 1)."""
    p.add_argument("--python", default=sys.executable,
                   help="the interpreter with triton 3.6 that compiles (default: this one)")
    p.add_argument("--jobs", type=_jobs, default=2, help="compiles in parallel (default: 2)")


def compile_all(python: str, cases: list[dict], jobs: int, module: str = f"tools.{NAME}") -> list[dict]:
    """:func:`compile_isolated` of every case, ``jobs`` at a time, with a progress bar named after ``module``."""
    from bench import harness

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(harness.progress(pool.map(lambda case: compile_isolated(python, case, module), cases),
                                     module.removeprefix("tools."), total=len(cases)))


def spilled(rows: list[dict]) -> int:
    """How many compiled rows spill (ptxas spill bytes or local memory in the PTX or SASS)."""
    return sum(1 for r in rows if r.get("spill_st") or r.get("ptx_local") or r.get("sass_local"))


def run_tool(name: str, doc: str, argv: Sequence[str] | None, *, what: str, compile_one, probe, cases, report,
             add_arguments=None, problem=None) -> int:
    """One compile tool's ``main``: answer a child's ``--one`` / ``--probe`` (``compile_one``, ``probe``), or parse
    ``argv`` (``--python``, ``--jobs``, ``--out`` and ``add_arguments(parser)``'s), probe the compiler
    (``problem(found)``: why it cannot compile ``what``, or None), compile ``cases(args)`` each in its own process,
    and write ``report(rows)`` under a header naming ``what`` into ``--out``.  Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if answer_child(argv, compile_one, probe):
        return 0
    from bench import harness

    p = harness.parser(name, doc, PACKAGE)
    add_compiler_arguments(p)
    if add_arguments is not None:
        add_arguments(p)
    args = p.parse_args(argv)
    found, tail = run_child(args.python, "--probe", module=f"tools.{name}")
    why = tail if found is None else (problem(found) if problem is not None else None)
    if why:
        print(f"tools.{name}: --python {args.python} cannot compile {what}: {why}", file=sys.stderr)
        return 2
    cmd, env = harness.command(name, argv, PACKAGE), harness.environment()
    env["compiler"] = found
    rows = compile_all(args.python, cases(args), args.jobs, f"tools.{name}")
    text = harness.header(f"tools.{name}: {what} for sm_90 (triton {found['triton']})", env, cmd) + report(rows)
    harness.write_report(args.out, name, text, {"tool": name, "command": cmd, "environment": env, "rows": rows})
    print(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from pasa_diffusers.metrics import records

    def add_arguments(p):
        p.add_argument("--configs", type=_parse_config, nargs="+", metavar="BLOCK_N,STAGES,OVERLAP,CONSUMERS",
                       help="the configs to compile at every shape (default: CONFIGS at head dim 64, WIDE_CONFIGS "
                            "above it)")
        p.add_argument("--sparse", action="store_true",
                       help="compile with a block mask instead, at the config the launch picks for one")

    def cases(args):
        if args.sparse:
            return [{"config": None, "shape": s, "dtype": dtype, "sparse": True} for s, dtype, _ in SHAPES]
        return [{"config": c, "shape": s, "dtype": dtype}
                for s, dtype, configs in SHAPES for c in args.configs or configs]

    def report(rows):
        table = records.markdown_table(COLUMNS, [table_row(r) for r in rows], align="ll" + "l" * 5 + "rrrr" + "lr")
        return ("\n" + table
                + f"\n\n{sum(r['ok'] for r in rows)} of {len(rows)} compiled; warp-specialised: "
                f"{sum(1 for r in rows if r.get('ws'))}; with spills: {spilled(rows)}\n")

    return run_tool(NAME, __doc__, argv, what="the Gluon kernel", compile_one=compile_one, probe=probe, cases=cases,
                    report=report, add_arguments=add_arguments, problem=lambda found: found["unavailable"])


if __name__ == "__main__":
    raise SystemExit(main())
