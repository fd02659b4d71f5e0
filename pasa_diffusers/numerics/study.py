"""The numerical study: every variant's reference on the study's inputs, scored against the golden output."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import torch

from .. import reference
from ..variants import Variant
from .inputs import PAPER_AMPLITUDES, PAPER_MEANS, PAPER_SEED, PAPER_SHAPE, paper_inputs, stress_cases
from .measures import max_abs_error, nonfinite_count, rel_rmse, rel_rmse_v

__all__ = ["AttentionFn", "VARIANTS", "StudyRow", "run_study", "beta_sweep", "run_stress"]


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _reference_of(variant: Variant) -> AttentionFn:
    return lambda q, k, v: reference.attention(q, k, v, None, variant, None)


def _bf16(fn: AttentionFn) -> AttentionFn:
    return lambda q, k, v: fn(q.bfloat16(), k.bfloat16(), v.bfloat16())


_FA_HYBRID = Variant("none", "hybrid")
VARIANTS: dict[str, AttentionFn] = {
    _FA_HYBRID.label: _reference_of(_FA_HYBRID),
    "FA half": _reference_of(Variant("none", "half")),
    "FA bf16": _bf16(_reference_of(_FA_HYBRID)),
    "smooth-K half": lambda q, k, v: reference.smooth_k_reference(q, k, v, precision="half"),
    **{v.label: _reference_of(v) for v in (Variant("pasa", "half"), Variant("pasa", "hybrid"),
                                            Variant("exact", "hybrid"), Variant("exact", "half"))},
}
"""The study's variants on fp16 inputs, by ``Variant.label``.  "FA bf16" re-rounds the inputs to bf16 (its
error includes that rounding, which is what running a model in bf16 costs); "FA hybrid" is
FlashAttention-2/cuDNN (fp16 GEMMs, fp32 scores and state); "FA half" the naive fully-FP16 kernel;
"exact hybrid" | "exact half" the exact shift (``reference.exact_shift_reference``: block means of K
removed exactly, the removed logit carried in fp32)."""


@dataclass
class StudyRow:
    """One (input cell, variant) of the study."""

    dist: str
    mean: float
    amplitude: float
    v_mean: float | None
    variant: str
    rel_rmse_v: float
    rel_rmse: float
    max_abs: float
    nonfinite: int
    max_abs_score: float

    def as_dict(self) -> dict:
        return asdict(self)


def _finite_or_nan(x: float, nonfinite: int) -> float:
    return float("nan") if nonfinite else x


def run_study(*, shape: tuple[int, ...] = PAPER_SHAPE, dists: Iterable[str] = ("uniform", "hybrid"),
              means: Iterable[float] = PAPER_MEANS, amplitudes: Iterable[float] = PAPER_AMPLITUDES,
              variants: Iterable[str] | None = None, v_mean: float | None = None, seed: int = PAPER_SEED,
              progress: Callable[[Iterable], Iterable] = iter) -> list[StudyRow]:
    """Every variant on every (dist, mean, amplitude) cell, scored against the float64 golden.

    Errors of a variant with non-finite outputs are NaN (its ``nonfinite`` count says how many);
    ``max_abs_score`` is max |q k^T| of the cell's fp16 inputs (unscaled), what overflows fp16.
    """
    names = list(VARIANTS) if variants is None else list(variants)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; expected some of {list(VARIANTS)}")
    cells = [(d, m, a) for d in dists for m in means for a in amplitudes]
    rows: list[StudyRow] = []
    for dist, mean, amp in progress(cells):
        q, k, v = paper_inputs(dist, mean, amp, shape, seed, torch.float16, v_mean=v_mean)
        gold = reference.golden_attention(q, k, v)
        k_full = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        max_score = (q.double() @ k_full.transpose(-1, -2)).abs().max().item()
        for name in names:
            out = VARIANTS[name](q, k, v)
            bad = nonfinite_count(out)
            rows.append(StudyRow(dist, mean, amp, v_mean, name,
                                 _finite_or_nan(rel_rmse_v(out, gold, v), bad),
                                 _finite_or_nan(rel_rmse(out, gold), bad),
                                 _finite_or_nan(max_abs_error(out, gold), bad), bad, max_score))
    return rows


def beta_sweep(betas: Iterable[float], cells: Iterable[tuple[str, float, float]], *,
               shape: tuple[int, ...] = PAPER_SHAPE, precision: str = "half", v_mean: float | None = None,
               seed: int = PAPER_SEED, progress: Callable[[Iterable], Iterable] = iter) -> list[dict]:
    """Relative RMSE of PASA against the golden for each beta on each (dist, mean, amplitude) cell;
    ``progress`` wraps the (cell, beta) runs, one PASA reference each (``run_study``'s, per cell)."""
    runs = [(cell, beta) for cell in cells for beta in betas]
    rows = []
    inputs: tuple = ()
    for (dist, mean, amp), beta in progress(runs):
        if inputs[:1] != ((dist, mean, amp),):
            q, k, v = paper_inputs(dist, mean, amp, shape, seed, torch.float16, v_mean=v_mean)
            inputs = ((dist, mean, amp), q, k, v, reference.golden_attention(q, k, v))
        _, q, k, v, gold = inputs
        out = reference.pasa_reference(q, k, v, beta=beta, precision=precision)
        bad = nonfinite_count(out)
        rows.append({"dist": dist, "mean": mean, "amplitude": amp, "beta": beta, "precision": precision,
                     "rel_rmse_v": _finite_or_nan(rel_rmse_v(out, gold, v), bad),
                     "rel_rmse": _finite_or_nan(rel_rmse(out, gold), bad), "nonfinite": bad})
    return rows


def run_stress(variants: Iterable[str] | None = None, *, shape: tuple[int, ...] = (1, 2, 1, 300, 128),
               seed: int = PAPER_SEED, progress: Callable[[Iterable], Iterable] = iter) -> list[dict]:
    """Every variant on every :func:`stress_cases` case: relative RMSE against the golden (NaN if the
    output is non-finite; ``None`` where the variant does not take the inputs' dtype, e.g. fp16-only
    pipelines on bf16 inputs); ``progress`` wraps the (case, variant) runs."""
    names = list(VARIANTS) if variants is None else list(variants)
    cases = stress_cases(shape, seed)
    golds: dict[str, torch.Tensor] = {}
    rows = []
    for case, name in progress([(case, name) for case in cases for name in names]):
        q, k, v = cases[case]
        if q.dtype == torch.bfloat16 and name in ("FA half", "smooth-K half", "PASA half", "exact half"):
            rows.append({"case": case, "variant": name, "rel_rmse": None, "nonfinite": 0})
            continue
        if case not in golds:
            golds[case] = reference.golden_attention(q, k, v)
        out = VARIANTS[name](q, k, v)
        bad = nonfinite_count(out)
        rows.append({"case": case, "variant": name, "rel_rmse": _finite_or_nan(rel_rmse(out, golds[case]), bad),
                     "nonfinite": bad})
    return rows
