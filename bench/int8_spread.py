"""The 8-bit spec's error as a function of the input: q and k of a larger spread, the bound it states (CPU).

    python -m bench.int8_spread --out DIR                        # docs/NUMERICS.md, docs/notes/int8_spec.md (~8 min)
    python -m bench.int8_spread --settings fp16-64 --out DIR     # one setting

The PyTorch spec (``reference_int8.int8_reference``: ``pasa-int8`` with ``pv_bits=16``, ``pasa-fp8`` with
``pv_bits=8``) against the float64 golden (relative RMSE), at (1, 2, 1024, D), V ~ N(0, 1), on

- q, k ~ N(0, s^2) for s in :data:`SPREADS`; the keys alone ~ N(0, s^2) (q ~ N(0, 1)) for s in
  :data:`KEY_SPREADS`; "keys off q's span": q ~ N(0, 1) on the first half of the channels and 0 on the
  others, k ~ N(0, 1) on the first half and N(0, s^2) on the others (the logits stay those of N(0, 1/2),
  the attention diffuse, while the keys' codes coarsen with s);
- every class of ``bench.int8_accuracy.input_classes``.

Table 1, per input at the spec's own criterion (``rules.INT8_FALLBACK_TAU``): the share of key blocks computed in
16 bits; ``eta``, the largest predicted RMS logit error among the (batch, head, block)s left in 8 bits
(``reference_int8.logit_error``: the criterion's own statistic, so ``eta <= tau``; 0 where every block is in 16 bits);
the 16-bit default's error ``e16`` (``exact_shift_reference``); per ``pv_bits`` the spec's error, the first-order
prediction (``reference_int8.error_model``) and the stated bound (``reference_int8.stated_bound``).

Table 2, per criterion threshold ``tau`` of :data:`TAUS` (the spec's ``fallback_blocks(..., tau)``; the kernels
use ``rules.INT8_FALLBACK_TAU`` only): the share of blocks in 16 bits (the speed cost: they run in a slower
loop) on N(0, 1) (a pre-pass alone on (2, 8, 4096, D)) and on the inputs of table 1, and the largest error over
table 1's inputs and the "threshold inputs": each family (q, k ~ N(0, s^2); the keys alone; the keys off q's
span at s = 3) scaled so that its largest block's ``eta`` is 0.98 ``tau``, the largest spread that ``tau``
leaves in 8 bits (``eta`` grows as ``s_q s_k``: the codes' steps scale with their operands).

Runs on the CPU (pure PyTorch; no kernel), in float64 for the golden and the model.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pasa_diffusers import numerics
from pasa_diffusers import reference_int8 as r8
from pasa_diffusers.metrics import records
from pasa_diffusers.reference import exact_shift_reference, golden_attention
from pasa_diffusers.rules import INT8_FALLBACK_TAU
from pasa_diffusers.variants import PV_BITS

from . import harness
from .int8_accuracy import input_classes

NAME = "int8_spread"

SETTINGS = {"fp16-64": (torch.float16, 64), "fp16-128": (torch.float16, 128), "bf16-64": (torch.bfloat16, 64),
            "bf16-128": (torch.bfloat16, 128)}
TOKENS, HEADS = 1024, 2
SPREADS = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0)
KEY_SPREADS = (1.5, 2.0, 3.0, 4.0)
OFF_SPAN_SPREADS = (2.0, 3.0, 4.0)
TAUS = (2e-2, 1.5e-2, 1.2e-2, 1e-2, 9.5e-3, 9e-3)
"""Criterion thresholds compared (the first is ``rules.INT8_FALLBACK_TAU``)."""
THRESHOLD_SHARE = 0.98
"""The threshold inputs' largest block ``eta`` as a share of ``tau``."""

def spread_inputs(shape: tuple[int, int, int, int], s_q: float, s_k: float, *, seed: int, dtype: torch.dtype,
                  off_span: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` of ``shape`` (B, H, N, D) in ``dtype``: q ~ N(0, s_q^2), k ~ N(0, s_k^2), v ~ N(0, 1); with
    ``off_span`` q ~ N(0, 1) and k ~ N(0, 1) on the first half of the channels, q = 0 and k ~ N(0, s_k^2) on the
    others (``s_q`` then scales both q and k)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3))
    if off_span:
        half = shape[-1] // 2
        q[..., half:] = 0.0
        k[..., half:] *= s_k
        q, k = q * s_q, k * s_q
    else:
        q, k = q * s_q, k * s_k
    return q.to(dtype), k.to(dtype), v.to(dtype)


def spec(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, pv_bits: int, tau: float,
         flags: torch.Tensor | None = None) -> torch.Tensor:
    """``int8_reference(q, k, v, pv_bits=pv_bits)`` with the criterion's threshold ``tau`` (the same output where
    ``tau`` is ``rules.INT8_FALLBACK_TAU``), or with the given ``flags`` (:func:`flags_at`)."""
    scale = q.shape[-1] ** -0.5
    qq = r8.quantize_queries(q)
    kq = r8.quantize_keys(k, qq.qbar)
    flags = r8.fallback_blocks(qq, kq, scale, tau) if flags is None else flags
    return r8.attention_from_codes(q, qq, kq, r8.quantize_values(v, pv_bits), scale, out_dtype=q.dtype,
                                   fallback=flags, k=k)


def flags_at(q: torch.Tensor, k: torch.Tensor, tau: float) -> torch.Tensor:
    """The criterion's flags at ``tau`` (B, Hq, blocks) bool (``reference_int8.fallback_blocks``)."""
    qq = r8.quantize_queries(q)
    return r8.fallback_blocks(qq, r8.quantize_keys(k, qq.qbar), q.shape[-1] ** -0.5, tau)


def cases(dtype: torch.dtype, d: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Table 1's inputs, by name."""
    shape = (1, HEADS, TOKENS, d)
    found = {}
    for i, s in enumerate(SPREADS):
        found[f"q, k ~ N(0, {s:g}^2)"] = spread_inputs(shape, s, s, seed=seed + i, dtype=dtype)
    for i, s in enumerate(KEY_SPREADS):
        found[f"keys ~ N(0, {s:g}^2)"] = spread_inputs(shape, 1.0, s, seed=seed + 100 + i, dtype=dtype)
    for i, s in enumerate(OFF_SPAN_SPREADS):
        found[f"keys off q's span, {s:g}"] = spread_inputs(shape, 1.0, s, seed=seed + 200 + i, dtype=dtype,
                                                          off_span=True)
    found.update(input_classes((1, HEADS, HEADS, TOKENS, d), seed=seed, dtype=dtype))
    return found


def threshold_inputs(dtype: torch.dtype, d: int, seed: int, tau: float
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each family scaled so that its largest block's ``eta`` is :data:`THRESHOLD_SHARE` ``tau`` (``eta`` scales
    as the product of q's and k's factors)."""
    shape = (1, HEADS, TOKENS, d)
    target = THRESHOLD_SHARE * tau
    found = {}
    for name, s_k, off, keys_only in (("q, k ~ N(0, s^2)", 1.0, False, False), ("keys ~ N(0, s^2)", 1.0, False, True),
                                      ("keys off q's span, 3", 3.0, True, False)):
        q, k, v = spread_inputs(shape, 1.0, s_k, seed=seed + 300, dtype=torch.float64, off_span=off)
        f = target / r8.logit_error(q.to(dtype), k.to(dtype)).max().item()
        for _ in range(3):  # the inputs' rounding to dtype moves eta a little
            qs, ks = (q, k * f) if keys_only else (q * math.sqrt(f), k * math.sqrt(f))
            eta = r8.logit_error(qs.to(dtype), ks.to(dtype)).max().item()
            f *= target / eta
        found[f"{name} at {THRESHOLD_SHARE:g} x {tau:g}"] = (qs.to(dtype), ks.to(dtype), v.to(dtype))
    return found


def _err(out: torch.Tensor, gold: torch.Tensor) -> float | None:
    return None if numerics.nonfinite_count(out) else numerics.rel_rmse(out, gold)


def measure(dtype: torch.dtype, d: int, seed: int) -> dict:
    """Table 1's rows and table 2's, for one setting."""
    rows, outputs = [], {}  # outputs: (case, pv_bits, flags) -> error, the spec's output depends on nothing else
    inputs = cases(dtype, d, seed)
    golds = {}

    def error(case, q, k, v, pv_bits, tau):
        flags = flags_at(q, k, tau)
        key = (case, pv_bits, flags.numpy().tobytes())
        if key not in outputs:
            outputs[key] = _err(spec(q, k, v, pv_bits=pv_bits, tau=tau, flags=flags), golds[case])
        return outputs[key], flags.double().mean().item()

    for case, (q, k, v) in inputs.items():
        golds[case] = golden_attention(q, k, v)
        e16 = _err(exact_shift_reference(q, k, v), golds[case])
        eta, share = r8.coded_logit_error(q, k)
        row = {"case": case, "16-bit blocks": share, "eta": eta, "eta all": r8.logit_error(q, k).max().item(),
               "e16": e16}
        for pv_bits in PV_BITS:
            row[f"err {pv_bits}"] = error(case, q, k, v, pv_bits, INT8_FALLBACK_TAU)[0]
            row[f"model {pv_bits}"] = r8.error_model(q, k, v, pv_bits=pv_bits).rel_rmse
            row[f"bound {pv_bits}"] = r8.stated_bound(eta, e16, pv_bits)
        rows.append(row)
        harness.log(f"{NAME}: {case}: eta {eta:.2e}, int8 {row['err 16']:.2e} (bound {row['bound 16']:.2e}), "
                    f"fp8 {row['err 8']:.2e} (bound {row['bound 8']:.2e})")

    big = spread_inputs((2, 8, 4096, d), 1.0, 1.0, seed=seed + 400, dtype=dtype)
    criteria = []
    for tau in TAUS:
        crit = {"tau": tau, "N(0, 1) share": r8.coded_logit_error(big[0], big[1], tau)[1], "shares": {},
                "worst 16": (0.0, ""), "worst 8": (0.0, "")}
        extra = threshold_inputs(dtype, d, seed, tau)
        for case, (q, k, v) in {**inputs, **extra}.items():
            if case not in golds:
                golds[case] = golden_attention(q, k, v)
            for pv_bits in PV_BITS:
                err, share = error(case, q, k, v, pv_bits, tau)
                if err is not None and err > crit[f"worst {pv_bits}"][0]:
                    crit[f"worst {pv_bits}"] = (err, case)
            crit["shares"][case] = share
        criteria.append(crit)
        harness.log(f"{NAME}: tau {tau:g}: N(0, 1) {100 * crit['N(0, 1) share']:.0f} % in 16 bits, worst "
                    f"{crit['worst 16'][0]:.2e} ({crit['worst 16'][1]}), fp8 {crit['worst 8'][0]:.2e}")
    return {"rows": rows, "criteria": criteria}


def _cell(x: float | None) -> str:
    return "non-finite" if x is None else ("0" if x == 0 else f"{x:.2e}")


def table(rows: Sequence[dict]) -> str:
    """Table 1 as markdown."""
    lines = [[r["case"], f"{100 * r['16-bit blocks']:.0f} %", _cell(r["eta"]), _cell(r["e16"]),
              _cell(r["err 16"]), _cell(r["model 16"]), _cell(r["bound 16"]),
              _cell(r["err 8"]), _cell(r["model 8"]), _cell(r["bound 8"])] for r in rows]
    return records.markdown_table(["input", "blocks in 16 bits", "eta (8-bit blocks)", "16-bit default",
                                   "pasa-int8", "model", "bound", "pasa-fp8", "model", "bound"], lines)


def criteria_table(criteria: Sequence[dict]) -> str:
    """Table 2 as markdown: the shares at a few of table 1's inputs, the classes flagged, the worst errors."""
    shown = ["q, k ~ N(0, 1.25^2)", "q, k ~ N(0, 1.5^2)", "q, k ~ N(0, 2^2)", "keys ~ N(0, 2^2)",
             "keys off q's span, 3"]
    classes = list(input_classes((1, 1, 1, 16, 16)))
    lines = []
    for c in criteria:
        flagged = [name for name in classes if c["shares"][name] > 0]
        lines.append([f"{c['tau']:g}", f"{100 * c['N(0, 1) share']:.1f} %",
                      *(f"{100 * c['shares'][name]:.0f} %" for name in shown), ", ".join(flagged) or "none",
                      f"{c['worst 16'][0]:.2e} ({c['worst 16'][1]})", f"{c['worst 8'][0]:.2e} ({c['worst 8'][1]})"])
    return records.markdown_table(["tau", "N(0, 1)", *shown, "classes with blocks in 16 bits", "worst pasa-int8",
                                   "worst pasa-fp8"], lines)


def main(argv: Sequence[str] | None = None) -> int:
    def section(name, dtype, d, result):
        return (f"\n\n## {name}: (1, {HEADS}, {TOKENS}, {d}), {str(dtype).removeprefix('torch.')}\n\n"
                f"{table(result['rows'])}\n\n### The criterion's threshold\n\n{criteria_table(result['criteria'])}\n")

    return harness.settings_study(NAME, __doc__, "bench.int8_spread: the 8-bit spec's error against the bound it "
                                  "states, relative RMSE against the float64 golden", SETTINGS, measure, section, argv)

if __name__ == "__main__":
    raise SystemExit(main())
