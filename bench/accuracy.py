"""How far is each attention from the exact answer, per class of input: error against a float64 golden.

    python -m bench.accuracy --out DIR
    python -m bench.accuracy --dtype bfloat16 --out DIR              # the classes in bf16, as the DiTs run
    python -m bench.accuracy --shapes eight-bit --out DIR             # the 8-bit backends beside the peers, fast
    TRITON_INTERPRET=1 python -m bench.accuracy --shapes tiny --out DIR   # a CPU, under the interpreter

For each class of numerics.input_classes (benign, large common biases, drifting and jumping biases,
sign changes, a far key, FlashAttention-3's outliers, resonance; V ~ N(0, 1)) in --dtype at a spatial
shape, a grouped-head one with a ragged last block, a temporal one and one of head dim 128, the relative
RMSE against reference.golden_attention (float64) of: our variants (pasa_attention; exact-hybrid is the
default, exact-int8 is pasa-int8, exact-fp8 is pasa-fp8), SDPA on fp16 copies (its own backend choice), SDPA on bf16 copies, the FlashAttention-2 reference (reference.flash_reference: fp32 scores
and state, P rounded to fp16, IEEE fp32 GEMMs) and the peers when importable (FA3 bf16, FA3 fp8
scaled per kv head, SageAttention on a clone of k).
A non-finite output shows as "NaN (count)"; a method that fails shows its error.  The last columns are
the default's error over SDPA's in the inputs' dtype and the share of key blocks exact-int8 computed in
16 bits (``block_tally``: its fallback for blocks an 8-bit code cannot hold; exact-fp8 takes the same blocks,
its ``P V`` bits do not enter the criterion, so the share counts both alike).
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from pasa_diffusers import numerics
from pasa_diffusers.kernels import block_tally
from pasa_diffusers.metrics import records
from pasa_diffusers.reference import flash_reference, golden_attention
from pasa_diffusers.rules import PRECISION_DTYPES

from . import harness

NAME = "accuracy"

SHAPES = [harness.Shape("accuracy", "spatial", 2, 5, 5, 4096, 4096, 64),
          harness.Shape("accuracy", "spatial GQA", 2, 8, 4, 1000, 1000, 64),
          harness.Shape("accuracy", "temporal", 4608, 5, 5, 25, 25, 64),
          harness.Shape("accuracy", "spatial d128", 2, 4, 4, 4096, 4096, 128)]
"""A spatial problem of 32 key blocks, one with grouped heads and a ragged last block, SVD's temporal
attention at 25 frames, and the video transformers' head dim 128."""
EIGHT_BIT_SHAPES = [harness.Shape("accuracy", "spatial", 1, 4, 4, 4096, 4096, 64),
                    harness.Shape("accuracy", "spatial d128", 1, 4, 4, 4096, 4096, 128)]
"""``--shapes eight-bit``: one batch of four heads at each head-dim tile, where the 8-bit backends and the peers are
compared (docs/NUMERICS.md, "Which 8-bit backend": fp16 at 64, bf16 at 128)."""
SHAPE_SETS = {"default": SHAPES, "eight-bit": EIGHT_BIT_SHAPES, "tiny": harness.TINY}


def _sdpa(dtype: torch.dtype, name: str) -> harness.Method:
    """SDPA with its own backend choice on copies in ``dtype``."""
    def build(q, k, v):
        qc, kc, vc = (t.to(dtype) for t in (q, k, v))
        gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
        return harness.Prepared(lambda: torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, **gqa))
    return harness.Method(name, "sdpa", build)


def _flash_reference() -> harness.Method:
    """FlashAttention-2's algorithm in PyTorch: fp32 scores and state, ``P`` rounded to fp16."""
    def build(q, k, v):
        return harness.Prepared(lambda: flash_reference(q, k, v, precision="hybrid", block_m=q.shape[2]))
    return harness.Method("FA2 reference", "reference", build)


def methods(dtype: torch.dtype = torch.float16) -> tuple[list[harness.Method], dict[str, str]]:
    """Our variants that take ``dtype``, SDPA fp16 and bf16, the FA2 reference, the peers that import (and
    why the others are not run)."""
    peers, missing = harness.peer_methods()
    ours = [v for v in harness.VARIANTS if dtype in PRECISION_DTYPES[v.precision]]
    missing.update({v.name: f"precision={v.precision!r} takes {', '.join(map(str, PRECISION_DTYPES[v.precision]))} only"
                    for v in harness.VARIANTS if v not in ours})
    found = [harness.op_method(v) for v in ours]
    found += [_sdpa(torch.float16, "SDPA fp16"), _sdpa(torch.bfloat16, "SDPA bf16"), _flash_reference(), *peers]
    return found, missing


def _diffusers_layout(t: torch.Tensor, device: str) -> torch.Tensor:
    """A (B, H, N, D) tensor held as diffusers holds it: (B, N, H, D) memory, viewed as (B, H, N, D)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2).to(device)


def error_cell(out: torch.Tensor | None, gold: torch.Tensor) -> dict:
    """``{"rel_rmse", "nonfinite"}`` of one output (no error value when any element is not finite)."""
    bad = numerics.nonfinite_count(out)
    return {"rel_rmse": None if bad else numerics.rel_rmse(out, gold), "nonfinite": bad}


def measure(shape: harness.Shape, found: Sequence[harness.Method], seed: int, dev: str,
            dtype: torch.dtype = torch.float16) -> list[dict]:
    """One row per input class at ``shape`` in ``dtype``: each method's :func:`error_cell` or error."""
    rows = []
    classes = numerics.input_classes((shape.b, shape.hq, shape.hk, shape.nq, shape.d), seed=seed, dtype=dtype)
    for case, cpu in classes.items():
        q, k, v = (_diffusers_layout(t, dev) for t in cpu)
        gold = golden_attention(q, k, v)
        row: dict = {"case": case}
        block_tally.reset()
        for m in found:
            try:
                row[m.name] = error_cell(m.build(q, k, v).call(), gold)
            except Exception as e:  # noqa: BLE001 - a method that cannot run this shape is a result
                row[m.name] = {"error": harness.error_text(e)}
        row["int8 blocks in 16 bits"] = block_tally.counts()["share"]
        rows.append(row)
        del q, k, v, gold
        harness.free_memory()
    return rows


def _cell(c: dict) -> str:
    if "error" in c:
        return c["error"]
    return f"NaN ({c['nonfinite']})" if c["nonfinite"] else f"{c['rel_rmse']:.2e}"


def table(rows: Sequence[dict], names: Sequence[str], baseline: str = "SDPA fp16") -> str:
    """Classes down, methods across, and the default's error over ``baseline``'s (SDPA in the inputs' dtype)."""
    lines = []
    for row in rows:
        d, s = row["exact-hybrid"].get("rel_rmse"), row[baseline].get("rel_rmse")
        ratio = f"{d / s:.2f}" if d is not None and s else "-"
        share = row.get("int8 blocks in 16 bits")
        lines.append([row["case"], *(_cell(row[n]) for n in names), ratio,
                      "-" if share is None else f"{100 * share:.0f} %"])
    return records.markdown_table(["class", *names, f"default / {baseline}", "int8 blocks in 16 bits"], lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(NAME, __doc__)
    p.add_argument("--shapes", choices=list(SHAPE_SETS), default="default",
                   help="the four shapes above, the two of the 8-bit comparison, or the tiny set for a CPU "
                        "(default: default)")
    p.add_argument("--seed", type=int, default=0, help="seed of numerics.input_classes (default: 0)")
    harness.add_dtype_argument(p)
    args = p.parse_args(argv)
    problem = harness.cpu_problem(NAME)
    if problem:
        print(problem, file=sys.stderr)
        return 2

    cmd, env = harness.command(NAME, argv), harness.environment()
    dtype = harness.INPUT_DTYPES[args.dtype]
    found, missing = methods(dtype)
    baseline = "SDPA bf16" if dtype == torch.bfloat16 else "SDPA fp16"
    names = [m.name for m in found]
    shapes = SHAPE_SETS[args.shapes]
    results, text = {}, harness.header("bench.accuracy: relative RMSE against the float64 golden output", env, cmd)
    text += "".join(f"\n- {name} not run: {reason}" for name, reason in missing.items())
    with torch.no_grad():
        for shape in harness.progress(shapes, NAME):
            results[shape.label] = measure(shape, found, args.seed, harness.device(), dtype)
            text += f"\n\n## {shape.label} {shape.bhnd}, {args.dtype}\n\n{table(results[shape.label], names, baseline)}\n"
    harness.write_report(args.out, NAME, text, {"bench": NAME, "command": cmd, "environment": env,
                                                "not_run": missing, "results": results})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
