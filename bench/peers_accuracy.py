"""How accurate are the 8-bit backends beside the peers, per class of input, on a GPU?

    python -m bench.peers_accuracy --out DIR                 # fp16 at head dim 64, bf16 at head dim 128
    python -m bench.peers_accuracy --keys 1024 --out DIR     # shorter sequences

For each class of ``numerics.input_classes`` (seed ``--seed``) at (1, ``--heads``, ``--keys``, D), in fp16 at head
dim 64 (SVD, CogVideoX) and bf16 at head dim 128 (Wan, HunyuanVideo), the relative RMSE against
``reference.golden_attention`` (float64, V ~ N(0, 1)) of: the default (``pasa``), ``pasa-int8`` and ``pasa-fp8``
(``pasa_attention`` with ``precision="int8"`` / ``"fp8"``: the kernels ``kernel="auto"`` takes), SDPA in the
inputs' dtype, and the peers when importable: FlashAttention-3 on bf16 copies and on e4m3 copies scaled per kv head,
SageAttention 2 (INT8 q k^T with its smooth-K, FP8 P V on sm_90).  A non-finite output shows as "NaN"; a method
that fails shows its exception's name.  Needs a CUDA GPU (the peers and the Gluon kernels run there only).
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch

from pasa_diffusers import numerics, peers
from pasa_diffusers.metrics import records
from pasa_diffusers.ops import pasa_attention
from pasa_diffusers.reference import golden_attention

from . import harness

NAME = "peers_accuracy"
SETTINGS = ((torch.float16, 64), (torch.bfloat16, 128))
"""(dtype, head dim) of the two tables: SVD's and CogVideoX's fp16 at 64, the DiTs' bf16 at 128."""
METHODS = ("pasa", "pasa-int8", "pasa-fp8", "sdpa", "fa3-bf16", "fa3-fp8", "sage")


def _calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """Each method of :data:`METHODS` on (B, H, N, D) ``q, k, v``, returning (B, H, N, D)."""
    def peer(name: str) -> Callable[[], torch.Tensor]:
        return lambda: peers.prepare(name, q, k, v, layout="bhnd")().transpose(1, 2)

    return {"pasa": lambda: pasa_attention(q, k, v),
            "pasa-int8": lambda: pasa_attention(q, k, v, precision="int8"),
            "pasa-fp8": lambda: pasa_attention(q, k, v, precision="fp8"),
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
            "fa3-bf16": peer("fa3"), "fa3-fp8": peer("fa3-fp8"),
            "sage": lambda: peers.prepare("sage", q, k, v, layout="bhnd")()}


def measure(dtype: torch.dtype, d: int, heads: int, keys: int, seed: int) -> list[dict]:
    """One row per input class: each method's relative RMSE (a string: the number, "NaN" or an error's name)."""
    rows = []
    cases = numerics.input_classes((1, heads, heads, keys, d), seed=seed, dtype=dtype)
    for case, cpu in harness.progress(list(cases.items()), f"{NAME} {dtype} d{d}"):
        q, k, v = (t.cuda() for t in cpu)
        gold = golden_attention(q.double(), k.double(), v.double())
        row = {"class": case}
        for name, call in _calls(q, k, v).items():
            try:
                out = call().double()
            except Exception as e:  # noqa: BLE001 - a peer that cannot run this call is a cell, not the end
                row[name] = type(e).__name__
                continue
            row[name] = "NaN" if not torch.isfinite(out).all() else f"{numerics.rel_rmse(out, gold):.1e}"
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(NAME, __doc__)
    p.add_argument("--keys", type=int, default=4096, help="tokens per sequence (default: 4096)")
    p.add_argument("--heads", type=int, default=4, help="heads (default: 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of numerics.input_classes (default: 0)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"bench.{NAME}: needs a CUDA GPU (the peers and the Gluon kernels run there only)", file=sys.stderr)
        return 2
    if args.keys < 1 or args.heads < 1:
        p.error(f"--keys {args.keys} --heads {args.heads}: both must be positive")
    cmd, env = harness.command(NAME, argv), harness.environment()
    text = harness.header(f"bench.{NAME}: relative RMSE against float64, the 8-bit backends beside the peers", env,
                          cmd)
    payload = []
    for dtype, d in SETTINGS:
        rows = measure(dtype, d, args.heads, args.keys, args.seed)
        payload.append({"dtype": str(dtype), "head_dim": d, "rows": rows})
        text += (f"\n{str(dtype).removeprefix('torch.')}, (1, {args.heads}, {args.keys}, {d}):\n\n"
                 + records.markdown_table(["class", *METHODS], [[r["class"], *(r[m] for m in METHODS)] for r in rows])
                 + "\n")
    harness.write_report(args.out, NAME, text, {"bench": NAME, "command": cmd, "environment": env, "tables": payload})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
