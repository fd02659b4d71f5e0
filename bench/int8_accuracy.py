"""Which design of the 8-bit exact shift meets 1e-2: relative RMSE against the float64 golden, per input class (CPU).

    python -m bench.int8_accuracy --out DIR                      # the design tables of docs/notes/int8_spec.md (~15 min)
    python -m bench.int8_accuracy --settings fp16-64 --out DIR   # one setting

The PyTorch spec (reference_int8.int8_reference) and the designs it was chosen from, each quantizing
where the spec does but with one decision changed, on every class of numerics.input_classes plus two
(:func:`input_classes`: a bias drifting 0 -> 60 along the tokens of q and k, and four outlier channels),
at (1, 2, 4096, D) keys with 1024 queries (every fourth of the class's 4096 rows), V ~ N(0, 1).
Settings: fp16 head dim 64, fp16 head dim 128, bf16 head dim 128.  Columns (:data:`DESIGNS`, cumulative
from the issue's first sketch to the spec):

- ``16-bit``: the default (reference.exact_shift_reference, FP32-accumulating) for scale;
- ``A``: the default's exact centre, K per 128-key block, Q per token, no smoothing, no rotation;
- ``B``: A with K per token; ``B q64``: B with Q per 64-row block; ``B k64``: A with K per 64 keys;
- ``C``: B with Q smoothed (``qbar``, ``mu``, corrections exact in fp32);
- ``D``: C with the rounded block mean as centre; ``E``: D with the Hadamard rotation = the spec;
- ``E fp8``: the spec with P V in FP8 e4m3; and the spec's first-order error model
  (reference_int8.error_model) beside it (``model``, ``model fp8``);
- ``E + fallback``: the spec with its 16-bit key blocks (``reference_int8`` step 4b, LampAttention's idea:
  the default ``int8_reference``): blocks whose predicted RMS logit error exceeds
  ``rules.INT8_FALLBACK_TAU`` = 2e-2 in 16 bits, and the share of such blocks; the other columns
  have every block from the codes.

Runs on the CPU (pure PyTorch; no kernel), in float64 for the golden and the model.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from pasa_diffusers import numerics
from pasa_diffusers import reference_int8 as r8
from pasa_diffusers.metrics import records
from pasa_diffusers.reference import exact_centre, exact_shift_reference, gemm_dtype, golden_attention
from pasa_diffusers.rules import SHIFT_BLOCK

from . import harness

NAME = "int8_accuracy"

SETTINGS = {"fp16-64": (torch.float16, 64), "fp16-128": (torch.float16, 128), "bf16-128": (torch.bfloat16, 128)}
KEYS, QUERIES, HEADS = 4096, 1024, 2

DESIGNS = {
    "A": dict(centre="exact", k_scale="block128", q_scale="token", smooth=False, rotate=False),
    "B": dict(centre="exact", k_scale="token", q_scale="token", smooth=False, rotate=False),
    "B q64": dict(centre="exact", k_scale="token", q_scale="block64", smooth=False, rotate=False),
    "B k64": dict(centre="exact", k_scale="block64", q_scale="token", smooth=False, rotate=False),
    "C": dict(centre="exact", k_scale="token", q_scale="token", smooth=True, rotate=False),
    "D": dict(centre="mean", k_scale="token", q_scale="token", smooth=True, rotate=False),
    "E": dict(centre="mean", k_scale="token", q_scale="token", smooth=True, rotate=True),
}
"""The designs compared, by the decision each changes (``E`` is reference_int8's spec)."""


def input_classes(shape: tuple[int, int, int, int, int], *, seed: int = 0, dtype: torch.dtype = torch.float16
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``numerics.input_classes`` plus two, (B, H, N, D) on the CPU in ``dtype``, V ~ N(0, 1):

    - ``"drift(0->60)"``: q, k ~ N(0, 1) plus a bias growing 0 -> 60 along the tokens, on every channel;
    - ``"outlier channels"``: q, k ~ N(0, 1) except four channels (the same for q and k, per draw) holding
      N(+-20, 4^2), the sign per (batch, head) and channel: the "massive activation" channels of
      transformers, large in both operands of the same products."""
    b, hq, hk, n, d = shape
    cases = numerics.input_classes(shape, seed=seed, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed + 1)
    f64 = torch.float64

    def normal(heads):
        return torch.randn((b, heads, n, d), generator=gen, dtype=f64)

    ramp = 60.0 * torch.arange(n, dtype=f64)[:, None] / n
    cases["drift(0->60)"] = (normal(hq) + ramp, normal(hk) + ramp, normal(hk))
    channels = torch.randperm(d, generator=gen)[:4]

    def outliers(heads):
        x = normal(heads)
        sign = torch.where(torch.rand((b, heads, 1, 4), generator=gen) < 0.5, -1.0, 1.0).to(f64)
        x[..., channels] = sign * 20.0 + 4.0 * torch.randn((b, heads, n, 4), generator=gen, dtype=f64)
        return x

    cases["outlier channels"] = (outliers(hq), outliers(hk), normal(hk))
    return {name: tuple(t.to(dtype) for t in qkv) for name, qkv in cases.items()}


def _codes_by_block(y: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 codes with one scale per ``block`` consecutive rows (over their channels), per row repeated."""
    n = y.shape[-2]
    codes, scales = torch.empty(y.shape, dtype=torch.int8), torch.empty(y.shape[:-1])
    for start in range(0, n, block):
        blk = y[..., start:start + block, :]
        c, s = r8.quantize_rows(blk.flatten(-2))
        codes[..., start:start + block, :] = c.unflatten(-1, blk.shape[-2:])
        scales[..., start:start + block] = s[..., None]
    return codes, scales


def _rows(y: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    return r8.quantize_rows(y) if how == "token" else _codes_by_block(y, int(how.removeprefix("block")))


def design_attention(q, k, v, *, centre: str, k_scale: str, q_scale: str, smooth: bool, rotate: bool,
                     pv_bits: int = 16) -> torch.Tensor:
    """The spec with its decisions exchanged (:data:`DESIGNS`); the spec's own (``E``) gives
    ``r8.int8_reference(..., fallback=False)``'s output bit for bit.  Without rotation the codes round ``q~`` and ``kc``
    themselves (``K``'s scale times ``Dp`` undoes the spec's ``1 / Dp``); without smoothing ``qbar = 0`` and
    ``mu = 0``, and key channel 0 of the rotated keys is kept."""
    g = gemm_dtype(q.dtype)
    d = q.shape[-1]
    dp = r8.rotation_size(d)
    scale = d ** -0.5
    f32 = torch.float32
    q32, k32 = q.to(g).to(f32), k.to(g).to(f32)
    qbar = r8.query_mean(q) if smooth else torch.zeros_like(q32[:, :, :1])
    y = r8._pad(q32 - qbar, dp)
    y = r8.fwht(y) if rotate else y
    if smooth:
        mu = (y[..., 0] / dp) if rotate else y.sum(-1) / dp
        if rotate:
            y[..., 0] = 0.0
        else:
            y = y - mu[..., None]
    else:
        mu = torch.zeros(y.shape[:-1])
    q_codes, q_sc = _rows(y, q_scale)
    qq = r8.QuantizedQueries(q_codes, q_sc, mu, qbar)

    kc, centres = torch.empty_like(k32), []
    for start in range(0, k.shape[2], SHIFT_BLOCK):
        blk = k32[:, :, start:start + SHIFT_BLOCK]
        if centre == "exact":
            c = exact_centre(blk, g)
        else:
            c = r8._round_g(blk.double().sum(-2, keepdim=True) / blk.shape[-2], g)
        kc[:, :, start:start + SHIFT_BLOCK] = blk - c
        centres.append(c)
    w = r8._pad(kc, dp)
    w = r8.fwht(w) if rotate else w
    sigma = (w[..., 0].clone() if rotate else w.sum(-1)) if smooth else torch.zeros(w.shape[:-1])
    if smooth and rotate:
        w[..., 0] = 0.0
    k_codes, k_sc = _rows(w, k_scale)
    if not rotate:
        k_sc = k_sc * dp
    group = q.shape[1] // k.shape[1]
    a = (kc.repeat_interleave(group, dim=1).double() @ qbar.double().transpose(-1, -2))[..., 0].to(f32)
    kq = r8.QuantizedKeys(k_codes, k_sc, sigma, a, torch.cat(centres, dim=-2))
    return r8.attention_from_codes(q, qq, kq, r8.quantize_values(v, pv_bits), scale, out_dtype=q.dtype)


def measure(dtype: torch.dtype, d: int, seed: int) -> list[dict]:
    """One row per class: each design's relative RMSE (None where not finite) and the model's prediction."""
    rows = []
    for case, (q, k, v) in input_classes((1, HEADS, HEADS, KEYS, d), seed=seed, dtype=dtype).items():
        q = q[:, :, ::KEYS // QUERIES]
        gold = golden_attention(q, k, v)

        def err(out):
            return None if numerics.nonfinite_count(out) else numerics.rel_rmse(out, gold)

        row = {"case": case, "16-bit": err(exact_shift_reference(q, k, v))}
        for name, decisions in DESIGNS.items():
            row[name] = err(design_attention(q, k, v, **decisions))
        row["E fp8"] = err(r8.int8_reference(q, k, v, pv_bits=8, fallback=False))
        row["E + fallback"] = err(r8.int8_reference(q, k, v))
        qq = r8.quantize_queries(q)
        row["fallback blocks"] = r8.fallback_blocks(qq, r8.quantize_keys(k, qq.qbar), d ** -0.5).double().mean().item()
        row["model"] = r8.error_model(q, k, v, fallback=False).rel_rmse
        row["model fp8"] = r8.error_model(q, k, v, pv_bits=8, fallback=False).rel_rmse
        rows.append(row)
        harness.log(f"{NAME}: {case}: spec {row['E']:.2e}, model {row['model']:.2e}")
    return rows


COLUMNS = ["16-bit", *DESIGNS, "E fp8", "model", "model fp8", "E + fallback"]


def table(rows: Sequence[dict]) -> str:
    def cell(x):
        return "non-finite" if x is None else f"{x:.2e}"

    lines = [[r["case"], *(cell(r[c]) for c in COLUMNS), f"{100 * r['fallback blocks']:.0f} %"] for r in rows]
    return records.markdown_table(["class", *COLUMNS, "blocks in 16 bits"], lines)


def main(argv: Sequence[str] | None = None) -> int:
    def section(name, dtype, d, rows):
        return (f"\n\n## {name}: (1, {HEADS}, {QUERIES} queries, {KEYS} keys, {d}), "
                f"{str(dtype).removeprefix('torch.')}\n\n{table(rows)}\n")

    return harness.settings_study(NAME, __doc__, "bench.int8_accuracy: the 8-bit exact shift's designs, relative "
                                  "RMSE against the float64 golden", SETTINGS, measure, section, argv)

if __name__ == "__main__":
    raise SystemExit(main())
