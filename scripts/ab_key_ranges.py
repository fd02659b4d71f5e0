"""A/B of the key ranges: the default run in ranges of (batch, kv head) against one whole launch.

``kernels.dispatch`` runs a call whose key pre-pass would copy more than ``PREPASS_SHARE`` of the output
in ranges, one after the other (its peak memory within 1.25x of cuDNN's), where its work fills ranges of
``MIN_RANGE_FLOP``.  This script times, at the
issue's DiT (bf16) and SVD (fp16) shapes, cuDNN, the default as it runs, and the default in one launch
(``PREPASS_SHARE`` lifted for the call), each with its peak memory of one call, and checks that both runs
of the default give the same bits.  For the two runs of the default it also times one CUDA-graph replay of
the call (GPU time alone) and the host's time to issue one call while the GPU is busy: where the host's
time exceeds the graph's, the call is bound by the host, not the GPU.

    python scripts/ab_key_ranges.py --out DIR     # DIR/key_ranges.md and key_ranges.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import torch

from bench import harness
from bench.overhead import graph_replay, host_us
from pasa_diffusers.kernels import dispatch
from pasa_diffusers.variants import Variant

SVD_SHAPES = [s for s in harness.svd_spatial(25) if s.nk >= 576]


def whole_launch() -> harness.Method:
    """The default with every call in one launch (``PREPASS_SHARE`` lifted around the call)."""
    ranged = harness.op_method(Variant("exact", "hybrid"))

    def build(q, k, v):
        prepared = ranged.build(q, k, v)

        def call():
            share = dispatch.PREPASS_SHARE
            dispatch.PREPASS_SHARE = 1e9
            try:
                return prepared.call()
            finally:
                dispatch.PREPASS_SHARE = share
        return harness.Prepared(call, prepared.note + ", one launch", prepared.details)

    return harness.Method("exact-hybrid one launch", "ours", build)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for key_ranges.md and key_ranges.json")
    p.add_argument("--rounds", type=int, default=5, help="timing rounds over the methods (default: 5)")
    harness.add_timer_arguments(p)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"scripts/ab_key_ranges.py: needs a CUDA GPU (it times the default's launches against cuDNN); none on "
              f"this machine (torch {torch.__version__})", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    timer = harness.Timer(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    methods = [harness.sdpa_method("cudnn"), harness.op_method(Variant("exact", "hybrid")), whole_launch()]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, same = [], {}
    for dtype, shapes in ((torch.bfloat16, harness.DIT), (torch.float16, SVD_SHAPES)):
        for shape in shapes:
            q, k, v = harness.make_inputs(shape, gen, dtype=dtype)
            calls = [m.build(q, k, v).call for m in methods[1:]]
            outs = [call() for call in calls]
            same[shape.label] = bool(torch.equal(outs[0], outs[1]))
            ranges = len(dispatch.key_chunks(k, q))
            profile = {m.name: (timer(graph_replay(call)), host_us(call)) for m, call in zip(methods[1:], calls)}
            for row in harness.measure(shape, methods, q, k, v, timer=timer, rounds=args.rounds):
                row.extra["ranges"] = ranges if row.kind == "ours" and "one launch" not in row.note else 1
                row.extra["graph_ms"], row.extra["host_us"] = profile.get(row.method, (None, None))
                rows.append(row)
            del q, k, v, outs, calls
            harness.free_memory()
    lines = ["| shape | (B, H, N, D) | dtype | ranges | method | ms | vs cuDNN | graph ms | host us | peak MiB "
             "| peak vs cuDNN |",
             "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for shape_label in dict.fromkeys(r.shape for r in rows):
        group = [r for r in rows if r.shape == shape_label]
        cudnn = group[0]
        for r in group:
            dtype = "bf16" if r.group == "dit" else "fp16"
            ms = f"{r.ms:.3f}" if r.ms else r.error
            ratio = f"{cudnn.ms / r.ms:.3f}" if r.ms and cudnn.ms else ""
            peak = f"{r.peak_mib:.0f}" if r.peak_mib is not None else ""
            peak_ratio = f"{r.peak_mib / cudnn.peak_mib:.2f}" if r.peak_mib and cudnn.peak_mib else ""
            graph = f"{r.extra['graph_ms']:.3f}" if r.extra.get("graph_ms") else ""
            host = f"{r.extra['host_us']:.0f}" if r.extra.get("host_us") else ""
            lines.append(f"| {r.shape} | {r.bhnd} | {dtype} | {r.extra.get('ranges', 1)} | {r.method} | {ms} | "
                         f"{ratio} | {graph} | {host} | {peak} | {peak_ratio} |")
    lines.append("")
    lines.append("Same bits, ranges and one launch: " + ", ".join(f"{k}: {v}" for k, v in same.items()))
    report = "\n".join(lines)
    with open(os.path.join(args.out, "key_ranges.md"), "w") as f:
        f.write(report + "\n")
    with open(os.path.join(args.out, "key_ranges.json"), "w") as f:
        json.dump({"rows": [r.__dict__ for r in rows], "same_bits": same}, f, indent=1, default=str)
    print(report)
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
