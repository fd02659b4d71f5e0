"""Accuracy per input class on one GPU: the default, SDPA, FP32-score attention and the paper's variants.

    python bench/accuracy_classes.py --out bench_out

For each class of ``numerics.input_classes`` (V ~ N(0, 1)) at a spatial shape and a temporal one,
the relative RMSE against the float64 golden output of: our kernel's variants (``pasa_attention``:
the default = the exact shift in hybrid; the exact shift in half; the paper's PASA in hybrid and in
half; plain FlashAttention in hybrid and the naive fp16 control), PyTorch SDPA on the fp16 inputs
(its default backend choice: cuDNN or flash, fp32 scores and state), SDPA on bf16 copies, and
FP32-score FlashAttention (``reference.flash_reference("fp32")``).  Non-finite outputs print as
``NaN (n)`` with their count.  The last column is the default's error over SDPA fp16's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pasa_diffusers import numerics  # noqa: E402
from pasa_diffusers.ops import pasa_attention  # noqa: E402
from pasa_diffusers.reference import flash_reference, golden_attention  # noqa: E402

SHAPES = {"spatial (2, 5/5, 4096, 64)": (2, 5, 5, 4096, 64), "spatial GQA (2, 8/4, 1000, 64)": (2, 8, 4, 1000, 64),
          "temporal (4608, 5/5, 25, 64)": (4608, 5, 5, 25, 64)}
OURS = {"default": {}, "exact half": {"precision": "half"}, "paper hybrid": {"shift": True},
        "paper half": {"precision": "half", "shift": True}, "FA hybrid": {"shift": False},
        "naive half": {"precision": "half", "shift": False}}


def _sdpa(q, k, v, dtype):
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), enable_gqa=gqa)


def measure(shape: tuple[int, ...], seed: int) -> list[dict]:
    rows = []
    for case, cpu in numerics.input_classes(shape, seed=seed).items():
        q, k, v = (t.cuda() for t in cpu)
        gold = golden_attention(q, k, v)
        outs = {name: pasa_attention(q, k, v, **options) for name, options in OURS.items()}
        outs["SDPA fp16"] = _sdpa(q, k, v, torch.float16)
        outs["SDPA bf16"] = _sdpa(q, k, v, torch.bfloat16)
        outs["FP32-score FA"] = flash_reference(q, k, v, precision="fp32", block_m=q.shape[2])
        row = {"case": case}
        for name, out in outs.items():
            bad = numerics.nonfinite_count(out)
            row[name] = {"rel_rmse": None if bad else numerics.rel_rmse(out, gold), "nonfinite": bad}
        rows.append(row)
        del q, k, v, gold, outs
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    names = [n for n in rows[0] if n != "case"]
    lines = ["| class | " + " | ".join(names) + " | default / SDPA fp16 |", "| --- |" + " --- |" * (len(names) + 1)]
    for row in rows:
        cells = [f"NaN ({row[n]['nonfinite']})" if row[n]["nonfinite"] else f"{row[n]['rel_rmse']:.2e}" for n in names]
        d, s = row["default"]["rel_rmse"], row["SDPA fp16"]["rel_rmse"]
        ratio = f"{d / s:.2f}" if d is not None and s else "-"
        lines.append(f"| {row['case']} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("accuracy_classes: needs a CUDA GPU", file=sys.stderr)
        return 2
    results, text = {}, ""
    with torch.no_grad():
        for title, shape in SHAPES.items():
            results[title] = measure(shape, args.seed)
            text += f"### {title}, fp16, relative RMSE against the float64 golden output\n\n{table(results[title])}\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "accuracy_classes.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, "accuracy_classes.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
