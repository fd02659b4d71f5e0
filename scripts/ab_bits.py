"""Bit-for-bit A/B of two copies of the package on one GPU: every variant and kernel path, same inputs.

A refactor of the kernels' host side must not move a single output bit.  This script runs a fixed set
of calls (every variant, every kernel path the router can take, fixed and autotuned configs, fp16 and
bf16, both layouts) with the package found first on ``sys.path`` and saves the outputs; a second run
with another copy saves its own; ``--compare`` lists the calls whose outputs differ.  It also times
the host overhead per call of the op at shapes whose GPU time is negligible.

    PYTHONPATH=$PWD/out/old python scripts/ab_bits.py --save out/old.pt   # out/old: git worktree add out/old HEAD~1
    PYTHONPATH=$PWD         python scripts/ab_bits.py --save out/new.pt
    python scripts/ab_bits.py --compare out/old.pt out/new.pt

The kernel paths are named the same in both runs; how a path is asked for depends on the copy's API:
``kernels.dispatch.forward(kernel=, prepass=)`` where it exists, else the older
``kernels.pasa_fwd.pasa_forward(kernel=, shift_k=)``.  The 8-bit paths (``precision="int8"``: the portable and
the Gluon kernel, ``P V`` in 16 and 8 bits, with and without the 16-bit blocks) are asked of
``dispatch.forward(kernel="portable-int8" | "gluon-int8", pv_bits=, fallback=)`` where the router names them
(``dispatch.INT8_KERNELS``), else of ``kernels.int8.forward(kernel="portable" | "gluon", pv_bits=, fallback=)``;
each on plain inputs and on keys whose bias jumps inside every 128-key block (every block then in 16 bits).
"""
from __future__ import annotations

import argparse
import importlib
import math
import statistics
import sys
import time

import torch

try:
    from pasa_diffusers.shift_matrix import DEFAULT_BETA
except ImportError:  # an old copy, from before beta.py became shift_matrix.py
    from pasa_diffusers.beta import DEFAULT_BETA

SHAPES = {  # (B, Hq, Hk, Nq, Nk, D)
    "spatial-ragged": (2, 4, 4, 700, 700, 64),
    "gqa-d80": (1, 4, 2, 300, 777, 80),
    "temporal-25": (512, 5, 5, 25, 25, 64),
}
VARIANTS = [("exact", "hybrid"), ("exact", "half"), ("pasa", "half"), ("pasa", "hybrid"), ("none", "half"),
            ("none", "hybrid"), ("exact", "int8")]
ALIAS = {"exact": "exact", "pasa": True, "none": False}
PATHS = {  # name: (new API options, old API options)
    "auto": ({}, {}),
    "portable": ({"kernel": "portable"}, {"kernel": "portable"}),
    "portable-prepass": ({"kernel": "portable", "prepass": True}, {"kernel": "portable", "shift_k": "prepass"}),
    "portable-in-loop": ({"kernel": "portable", "prepass": False}, {"kernel": "portable", "shift_k": "fused"}),
    "packed": ({"kernel": "packed"}, {"shift_k": "packed"}),
    "gluon": ({"kernel": "gluon"}, {"kernel": "gluon"}),
}
INT8_PATHS = {  # name: (new API options of dispatch.forward, old API options of kernels.int8.forward)
    "portable-int8": ({"kernel": "portable-int8"}, {"kernel": "portable"}),
    "portable-int8-pv8": ({"kernel": "portable-int8", "pv_bits": 8}, {"kernel": "portable", "pv_bits": 8}),
    "portable-int8-codes-only": ({"kernel": "portable-int8", "fallback": False},
                                 {"kernel": "portable", "fallback": False}),
    "gluon-int8": ({"kernel": "gluon-int8"}, {"kernel": "gluon"}),
    "gluon-int8-codes-only": ({"kernel": "gluon-int8", "fallback": False}, {"kernel": "gluon", "fallback": False}),
}
FIXED = {"portable": {"BLOCK_M": 64, "num_warps": 4, "num_stages": 2}, "packed": {"SEQS": 1, "num_warps": 1},
         "portable-int8": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}}


def _inputs(shape, dtype, seed, jumps=False):
    """(B, N, H, D) q, k, v; ``jumps``: the keys' per-channel bias jumps by +-(20..40) half a block off every
    128-key block (no 8-bit code holds such a block: the 8-bit paths compute it in 16 bits)."""
    b, hq, hk, nq, nk, d = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, nq, hq, d, device="cuda", generator=gen) + 3.0
    k = torch.randn(b, nk, hk, d, device="cuda", generator=gen) + 3.0
    v = torch.randn(b, nk, hk, d, device="cuda", generator=gen)
    if jumps:
        blocks = nk // 128 + 2
        sign = torch.where(torch.rand(b, blocks, hk, d, device="cuda", generator=gen) < 0.5, -1.0, 1.0)
        bias = sign * (20.0 + 20.0 * torch.rand(b, blocks, hk, d, device="cuda", generator=gen))
        k = k + bias[:, (torch.arange(nk, device="cuda") + 64) // 128]
    return tuple(t.to(dtype) for t in (q, k, v))


def _runner():
    """``run(q, k, v, shift, precision, path, config)`` on (B, H, N, D) views for this copy's API."""
    try:
        dispatch = importlib.import_module("pasa_diffusers.kernels.dispatch")
        from pasa_diffusers.variants import Variant

        routes_int8 = hasattr(dispatch, "INT8_KERNELS")

        def run(q, k, v, shift, precision, path, config):
            out = torch.full_like(q, float("nan"))
            scale = 1.0 / math.sqrt(q.shape[-1])
            if path in INT8_PATHS and not routes_int8:
                int8 = importlib.import_module("pasa_diffusers.kernels.int8")
                return int8.forward(q, k, v, out, scale=scale, config=config, **INT8_PATHS[path][1])
            options = INT8_PATHS[path][0] if path in INT8_PATHS else PATHS[path][0]
            return dispatch.forward(q, k, v, out, scale=scale, variant=Variant(shift, precision), beta=DEFAULT_BETA,
                                    config=config, **options)
    except ImportError:
        from pasa_diffusers.kernels.pasa_fwd import pasa_forward

        def run(q, k, v, shift, precision, path, config):
            out = torch.full_like(q, float("nan"))
            return pasa_forward(q, k, v, out, scale=1.0 / math.sqrt(q.shape[-1]), precision=precision,
                                shift=ALIAS[shift], beta=DEFAULT_BETA, config=config, **PATHS[path][1])
    return run


def _cases():
    """(name, shape, dtype, shift, precision, path, config, jumps): the calls both runs make, each kernel path
    with a fixed config (autotuning may pick differently in two processes; the op cases below autotune)."""
    for shape_name, shape in SHAPES.items():
        short = shape[3] <= 64 and shape[4] <= 64
        for shift, precision in VARIANTS:
            if precision == "int8":
                yield from _int8_cases(shape_name, shape)
                continue
            for dtype in (torch.float16, torch.bfloat16) if precision == "hybrid" else (torch.float16,):
                paths = ["auto"]
                if shift == "exact":
                    paths += ["portable", "portable-prepass"] + (["packed", "portable-in-loop"] if short else [])
                    if precision == "hybrid" and dtype == torch.float16 and shape[-1] == 64 and not short:
                        paths.append("gluon")
                elif shift == "pasa":
                    paths += ["portable-prepass", "portable-in-loop"]
                for path in paths:
                    uses_packed = path == "packed" or (path == "auto" and short and shift == "exact")
                    config = None if path == "gluon" else FIXED["packed" if uses_packed else "portable"]
                    name = f"{shape_name}/{shift}-{precision}/{str(dtype)[6:]}/{path}"
                    yield name, shape, dtype, shift, precision, path, config, False


def _int8_cases(shape_name, shape):
    """The 8-bit paths: ``auto`` (with the portable kernel's fixed config it takes the portable kernel), each
    kernel of :data:`INT8_PATHS` (the Gluon one with its tuned config), fp16 and bf16, plain keys and keys
    whose blocks all go to 16 bits."""
    for dtype in (torch.float16, torch.bfloat16):
        for jumps in (False, True):
            for path in ("auto", *INT8_PATHS):
                config = None if path.startswith("gluon") else FIXED["portable-int8"]
                name = f"{shape_name}/exact-int8/{str(dtype)[6:]}/{'jumps/' if jumps else ''}{path}"
                yield name, shape, dtype, "exact", "int8", path, config, jumps


def _op_cases():
    """The public op on diffusers' (B, N, H, D) tensors, every variant, default kernels."""
    for shape_name in ("spatial-ragged", "temporal-25"):
        for shift, precision in VARIANTS:
            yield f"op/{shape_name}/{shift}-{precision}", SHAPES[shape_name], shift, precision


def _host_overhead(op) -> dict[str, float]:
    """Median host microseconds per call at shapes whose GPU time is tiny (launch-bound loops)."""
    result = {}
    for name, shape, shift in [("exact-hybrid (1,1,256,64)", (1, 1, 1, 256, 256, 64), "exact"),
                               ("exact-hybrid temporal (64,1,25,64)", (64, 1, 1, 25, 25, 64), "exact"),
                               ("pasa-half (1,1,256,64)", (1, 1, 1, 256, 256, 64), "pasa")]:
        q, k, v = _inputs(shape, torch.float16, 0)
        precision = "half" if shift == "pasa" else "hybrid"
        for _ in range(20):
            op(q, k, v, precision=precision, shift=ALIAS[shift], layout="bnhd")
        torch.cuda.synchronize()
        rounds = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(500):
                op(q, k, v, precision=precision, shift=ALIAS[shift], layout="bnhd")
            torch.cuda.synchronize()
            rounds.append((time.perf_counter() - start) / 500 * 1e6)
        result[name] = statistics.median(rounds)
    return result


def save(path: str) -> None:
    import pasa_diffusers
    from pasa_diffusers.ops import pasa_attention

    run = _runner()
    outputs, errors = {}, {}
    for i, (name, shape, dtype, shift, precision, kpath, config, jumps) in enumerate(_cases()):
        q, k, v = (t.transpose(1, 2) for t in _inputs(shape, dtype, i % 7, jumps))
        try:
            outputs[name] = run(q, k, v, shift, precision, kpath, config).cpu()
        except Exception as exc:  # a path one copy cannot take: recorded, compared as such
            errors[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        print(f"{i} {name}: {'error' if name in errors else 'ok'}", file=sys.stderr, flush=True)
    for i, (name, shape, shift, precision) in enumerate(_op_cases()):
        q, k, v = _inputs(shape, torch.float16, 100 + i)
        outputs[name] = pasa_attention(q, k, v, precision=precision, shift=ALIAS[shift], layout="bnhd").cpu()
    overhead = _host_overhead(pasa_attention)
    torch.save({"package": pasa_diffusers.__file__, "outputs": outputs, "errors": errors, "overhead": overhead}, path)
    print(f"{pasa_diffusers.__file__}: {len(outputs)} outputs, {len(errors)} errors; host us/call {overhead}")


def compare(a: str, b: str) -> int:
    old, new = torch.load(a), torch.load(b)
    names = sorted(set(old["outputs"]) | set(new["outputs"]) | set(old["errors"]) | set(new["errors"]))
    differing = []
    for name in names:
        x, y = old["outputs"].get(name), new["outputs"].get(name)
        if x is None or y is None:
            if (x is None) != (y is None):
                differing.append(f"{name}: {old['errors'].get(name, 'ok')} | {new['errors'].get(name, 'ok')}")
            continue
        if not (torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())):
            differing.append(f"{name}: max |diff| {(x.float() - y.float()).abs().nan_to_num().max().item():.3e}")
    identical = len(names) - len(differing)
    print(f"{identical} of {len(names)} calls identical ({a} vs {b})")
    for line in differing:
        print("  DIFFERS", line)
    for tag, run in (("A", old), ("B", new)):
        print(f"host us/call {tag}: " + ", ".join(f"{k} {v:.1f}" for k, v in run["overhead"].items()))
    return 1 if differing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--save", metavar="FILE", help="run every call with the package on sys.path, save outputs")
    group.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two saved runs bit for bit")
    args = parser.parse_args(argv)
    if args.save and not torch.cuda.is_available():
        print(f"scripts/ab_bits.py --save: needs a CUDA GPU (it runs every kernel path); none on this machine "
              f"(torch {torch.__version__}); --compare runs anywhere", file=sys.stderr)
        return 2
    if args.save:
        save(args.save)
        return 0
    return compare(*args.compare)


if __name__ == "__main__":
    sys.exit(main())
