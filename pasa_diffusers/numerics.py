"""Input generators and error metrics of the numerical study, and the study itself.

The paper's random benchmarks draw q, k and v from one distribution:

- ``"uniform"``: U[mean - Am, mean + Am];
- ``"hybrid"`` (FlashAttention-3's outlier model): N(mean, 1) + Bernoulli(0.001) * N(0, Am).

and score ``RMSE / RMS(V)``.  Because V then carries the same large mean, that metric hides errors
in the attention weights, so the study also reports ``RMSE / RMS(golden output)`` and can draw V
zero-mean (``v_mean=0``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, asdict
from typing import Callable, Iterable

import torch

from . import reference
from .beta import shift_entries
from .rules import FP16_MAX, SHIFT_BLOCK
from .variants import Variant

__all__ = [
    "paper_inputs",
    "resonance_inputs",
    "input_classes",
    "INPUT_CLASSES",
    "max_score",
    "pasa_half_overflow_margin",
    "exact_half_overflow_margin",
    "FP16_MAX",
    "rmse",
    "rel_rmse",
    "rel_rmse_v",
    "max_abs_error",
    "nonfinite_count",
    "VARIANTS",
    "stress_cases",
    "PAPER_MEANS",
    "PAPER_AMPLITUDES",
    "PAPER_SHAPE",
    "QUICK_SHAPE",
    "StudyRow",
    "run_study",
    "beta_sweep",
    "study_table",
    "sweep_table",
    "run_stress",
    "stress_table",
    "plot_error_vs_bias",
]

PAPER_MEANS = (0.0, 10.0, 20.0, 30.0)
PAPER_AMPLITUDES = (0.5, 5.0, 10.0, 20.0)
PAPER_SHAPE = (1, 28, 4, 1407, 128)
"""(B, Hq, Hk, N, D): Qwen2-7B's attention geometry, 1407 = 10 * 128 + 127 exercises the ragged tail."""
QUICK_SHAPE = (1, 4, 1, 391, 128)
"""The ``--quick`` shape: the paper's head dim and a ragged tail (391 = 3 * 128 + 7), 4 query heads."""
PAPER_SEED = 2024724


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def _check_shape(shape: tuple[int, ...]) -> tuple[int, int, int, int, int]:
    if len(shape) != 5 or any(int(s) < 1 for s in shape):
        raise ValueError(f"shape must be (B, Hq, Hk, N, D) of positive ints, got shape={shape!r}")
    b, hq, hk, n, d = (int(s) for s in shape)
    if hq % hk:
        raise ValueError(f"shape: Hq={hq} must be a multiple of Hk={hk}")
    return b, hq, hk, n, d


def _draw(dist: str, mean: float, amplitude: float, size: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if dist == "uniform":
        return mean + amplitude * (2.0 * torch.rand(size, generator=gen, dtype=torch.float64) - 1.0)
    if dist == "hybrid":
        base = mean + torch.randn(size, generator=gen, dtype=torch.float64)
        outlier = torch.rand(size, generator=gen, dtype=torch.float64) < 0.001
        return base + outlier * amplitude * torch.randn(size, generator=gen, dtype=torch.float64)
    raise ValueError(f"unknown dist={dist!r}; expected 'uniform' or 'hybrid'")


def paper_inputs(dist: str = "uniform", mean: float = 30.0, amplitude: float = 0.5,
                 shape: tuple[int, ...] = PAPER_SHAPE, seed: int = PAPER_SEED,
                 dtype: torch.dtype = torch.float16, *, v_mean: float | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) of the paper's random benchmarks, ``(B, H, N, D)`` on the CPU in ``dtype``.

    ``v_mean=None`` draws V like q and k (the paper); a number draws V ~ N(v_mean, 1) instead.
    """
    if amplitude < 0:
        raise ValueError(f"amplitude must be >= 0, got amplitude={amplitude!r}")
    b, hq, hk, n, d = _check_shape(shape)
    gen = _generator(seed)
    q = _draw(dist, mean, amplitude, (b, hq, n, d), gen)
    k = _draw(dist, mean, amplitude, (b, hk, n, d), gen)
    if v_mean is None:
        v = _draw(dist, mean, amplitude, (b, hk, n, d), gen)
    else:
        v = v_mean + torch.randn((b, hk, n, d), generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def resonance_inputs(shape: tuple[int, ...] = (1, 4, 4, 512, 64), *, phase: str = "in", bias: float = 20.0,
                     amplitude: float = 1.0, drift: float = 0.0, seed: int = 0,
                     dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k whose token means are aligned along the head dimension, the paper's "resonance".

    Each head gets a mean pattern ``w[d] = bias * cos(2 pi f d / D + phi)`` (random frequency and
    phase per head); q's tokens are ``w + noise`` and k's are ``sign * w + noise`` with ``sign = +1``
    (``phase="in"``: every ``q.k`` ~ ``+|w|^2``), ``-1`` (``"anti"``: ~ ``-|w|^2``) or an independent
    pattern (``"random"``: no alignment).  ``drift`` adds a bias growing linearly along the sequence,
    ``drift * t / N`` on every channel of q and k (what a global smooth-K cannot remove).  The noise is
    N(0, amplitude).  V ~ N(0, 1).
    """
    if phase not in ("in", "anti", "random"):
        raise ValueError(f"unknown phase={phase!r}; expected 'in', 'anti' or 'random'")
    b, hq, hk, n, d = _check_shape(shape)
    gen = _generator(seed)
    dims = torch.arange(d, dtype=torch.float64)

    def pattern(heads: int) -> torch.Tensor:
        freq = torch.randint(1, max(2, d // 4), (heads, 1), generator=gen).double()
        phi = 2 * math.pi * torch.rand((heads, 1), generator=gen, dtype=torch.float64)
        return bias * torch.cos(2 * math.pi * freq * dims / d + phi)

    w_q = pattern(hq)
    group = hq // hk
    w_k = w_q[::group] if phase != "random" else pattern(hk)
    if phase == "anti":
        w_k = -w_k
    ramp = drift * torch.arange(n, dtype=torch.float64)[:, None] / n
    q = w_q[None, :, None, :] + ramp + amplitude * torch.randn((b, hq, n, d), generator=gen, dtype=torch.float64)
    k = w_k[None, :, None, :] + ramp + amplitude * torch.randn((b, hk, n, d), generator=gen, dtype=torch.float64)
    v = torch.randn((b, hk, n, d), generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


INPUT_CLASSES = ("benign", "uniform(30,0.5)", "uniform(80,5)", "drift(0->40)", "jump aligned", "jump misaligned",
                 "sign change in block", "far key", "FA3 outliers", "resonance in")
"""Input classes a real checkpoint can produce (``input_classes``), each with V ~ N(0, 1)."""


def input_classes(shape: tuple[int, ...], *, seed: int = 0, dtype: torch.dtype = torch.float16,
                  block_n: int = SHIFT_BLOCK) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Named ``(q, k, v)`` cases, ``(B, H, N, D)`` on the CPU in ``dtype``, V ~ N(0, 1) (zero mean: errors
    in the attention weights are not hidden by V's mean).  ``block_n`` is the shift block the jumps
    refer to.

    - ``"benign"``: q, k ~ N(0, 1);
    - ``"uniform(30,0.5)"``, ``"uniform(80,5)"``: a large common bias (the paper's overflow cells);
    - ``"drift(0->40)"``: q, k biased 20 plus a bias drifting 0 -> 40 along the sequence;
    - ``"jump aligned"``: q ~ N(2, 1); k ~ N(0, 1) plus a per-channel bias of +-(20..40) that jumps at
      every key-block boundary (each block has its own mean);
    - ``"jump misaligned"``: the same jumps half a block later (every block holds two biases);
    - ``"sign change in block"``: keys of magnitude 20-40 whose sign flips from token to token in
      every channel (no centre makes a channel small), q ~ N(2, 1);
    - ``"far key"``: q ~ N(1, 1), k ~ N(0, 1) with one key at 30000 in every channel (its scaled
      scores far above 65504);
    - ``"FA3 outliers"``: FlashAttention-3's model, N(30, 1) with 0.1 % outliers of N(0, 10^2) added;
    - ``"resonance in"``: q, k means aligned along the head dimension (``resonance_inputs``, bias 50).
    """
    b, hq, hk, n, d = _check_shape(shape)
    gen = _generator(seed)
    f64 = torch.float64

    def normal(heads: int, mean: float = 0.0) -> torch.Tensor:
        return mean + torch.randn((b, heads, n, d), generator=gen, dtype=f64)

    def jumps(offset: int) -> torch.Tensor:
        n_blocks = (n + offset) // block_n + 1
        size = (b, hk, n_blocks, d)
        sign = torch.where(torch.rand(size, generator=gen, dtype=f64) < 0.5, -1.0, 1.0)
        bias = sign * (20.0 + 20.0 * torch.rand(size, generator=gen, dtype=f64))
        block = (torch.arange(n) + offset) // block_n
        return bias[:, :, block, :]

    v = normal(hk)
    cases = {
        "benign": (normal(hq), normal(hk)),
        "uniform(30,0.5)": paper_inputs("uniform", 30.0, 0.5, shape, seed, f64, v_mean=0.0)[:2],
        "uniform(80,5)": paper_inputs("uniform", 80.0, 5.0, shape, seed, f64, v_mean=0.0)[:2],
        "drift(0->40)": resonance_inputs(shape, phase="random", bias=20.0, drift=40.0, seed=seed, dtype=f64)[:2],
        "jump aligned": (normal(hq, 2.0), normal(hk) + jumps(0)),
        "jump misaligned": (normal(hq, 2.0), normal(hk) + jumps(block_n // 2)),
        "sign change in block": (normal(hq, 2.0), torch.where(torch.rand((b, hk, n, d), generator=gen) < 0.5, -1.0, 1.0)
                                 * (20.0 + 20.0 * torch.rand((b, hk, n, d), generator=gen, dtype=f64))),
        "far key": (normal(hq, 1.0), normal(hk).index_fill_(2, torch.tensor([n // 3]), 30000.0)),
        "FA3 outliers": paper_inputs("hybrid", 30.0, 10.0, shape, seed, f64, v_mean=0.0)[:2],
        "resonance in": resonance_inputs(shape, phase="in", bias=50.0, seed=seed, dtype=f64)[:2],
    }
    return {name: (q.to(dtype), k.to(dtype), v.to(dtype)) for name, (q, k) in cases.items()}


def max_score(q: torch.Tensor, k: torch.Tensor) -> float:
    """``max |q . k|`` over all query and key rows (raw, unscaled), in float64: above 65504 naive
    fully-FP16 attention overflows."""
    group = q.shape[1] // k.shape[1]
    k64 = k.double().repeat_interleave(group, dim=1)
    return float((q.double() @ k64.transpose(-1, -2)).abs().max())


def _blockwise_max_score(q: torch.Tensor, k: torch.Tensor, block_n: int,
                         keys_of: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """``max |q . keys_of(k_j)|`` over key blocks ``k_j`` of ``block_n`` keys, in float64."""
    return max(max_score(q, keys_of(k[:, :, start:start + block_n])) for start in range(0, k.shape[2], block_n))


def pasa_half_overflow_margin(q: torch.Tensor, k: torch.Tensor, *, beta: float, scale: float | None = None,
                              block_n: int = SHIFT_BLOCK) -> float:
    """``max |q . k_shift| / 65504`` for the paper's fully-FP16 PASA, with ``k_shift = fp16(scale M_j) k_j``
    per key block as the kernel and ``reference.pasa_reference`` form it (stored entries from ``beta.py``).

    Above 1 the fp16 score tile overflows and PASA half returns non-finite rows: its documented
    condition.  The shift removes the block's (pseudo-)mean key, so this is large where one key lies far
    from its block's mean (``"far key"``), not where all keys share a bias.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale

    def shifted(k_blk: torch.Tensor) -> torch.Tensor:
        diag, off = shift_entries(beta, k_blk.shape[2], torch.float16, scale)
        k64 = k_blk.double()
        return ((diag - off) * k64 + off * k64.sum(-2, keepdim=True)).to(torch.float16)

    return _blockwise_max_score(q, k, block_n, shifted) / FP16_MAX


def exact_half_overflow_margin(q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None,
                               block_n: int = SHIFT_BLOCK) -> float:
    """``max |q_s . k_c| / 65504`` for the exact shift in half: ``q_s = fp16(scale q)``, ``k_c = fp16(k -
    fp16(block mean))`` as the kernel and ``reference.exact_shift_reference`` form them.  Above 1 its
    fp16 score tile overflows (one key far from its block's mean), as PASA half's does."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale

    def centred(k_blk: torch.Tensor) -> torch.Tensor:
        k32 = k_blk.float()
        return (k32 - k32.mean(-2, keepdim=True).half().float()).half()

    return _blockwise_max_score((q.float() * scale).half(), k, block_n, centred) / FP16_MAX


def rmse(out: torch.Tensor, gold: torch.Tensor) -> float:
    """Root mean square error, in float64."""
    return (out.double() - gold.double()).pow(2).mean().sqrt().item()


def rel_rmse(out: torch.Tensor, gold: torch.Tensor) -> float:
    """RMSE / RMS(golden output): the error relative to what attention returns."""
    return rmse(out, gold) / gold.double().pow(2).mean().sqrt().item()


def rel_rmse_v(out: torch.Tensor, gold: torch.Tensor, v: torch.Tensor) -> float:
    """RMSE / RMS(V): the paper's metric (flattering when V has a large mean)."""
    return rmse(out, gold) / v.double().pow(2).mean().sqrt().item()


def max_abs_error(out: torch.Tensor, gold: torch.Tensor) -> float:
    return (out.double() - gold.double()).abs().max().item()


def nonfinite_count(out: torch.Tensor) -> int:
    return int((~torch.isfinite(out)).sum().item())


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


def stress_cases(shape: tuple[int, ...] = (1, 2, 1, 300, 128), seed: int = PAPER_SEED
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Named extra (q, k, v) cases of the extended study, beyond the paper's grid, all with V ~ N(0, 1).

    - ``"uniform(30,0.5) zero-mean V"``: the paper's overflow cell with V zero-mean (errors in the
      attention weights are no longer hidden by V's mean);
    - ``"drift(0->40)"``: q, k biased 20 plus a bias drifting 0 -> 40 along the sequence (each key
      block has its own mean: what a global smooth-K cannot remove);
    - ``"resonance in"`` / ``"resonance anti"``: token means aligned along the head dim, in phase
      (``q.k ~ +|w|^2``, overflows fp16) and in anti-phase (``~ -|w|^2``);
    - ``"hybrid(30,10) outliers"``: FlashAttention-3's outlier model, zero-mean V;
    - ``"bf16 uniform(30,0.5)"``: the overflow cell in bf16 (hybrid variants only).
    """
    b, hq, hk, n, d = _check_shape(shape)
    res_shape = (b, hq, hk, n, min(d, 64))
    return {
        "uniform(30,0.5) zero-mean V": paper_inputs("uniform", 30.0, 0.5, shape, seed, v_mean=0.0),
        "drift(0->40)": resonance_inputs(shape, phase="random", bias=20.0, drift=40.0, seed=seed),
        "resonance in": resonance_inputs(res_shape, phase="in", bias=50.0, seed=seed),
        "resonance anti": resonance_inputs(res_shape, phase="anti", bias=50.0, seed=seed),
        "hybrid(30,10) outliers": paper_inputs("hybrid", 30.0, 10.0, shape, seed, v_mean=0.0),
        "bf16 uniform(30,0.5)": paper_inputs("uniform", 30.0, 0.5, shape, seed, torch.bfloat16, v_mean=0.0),
    }


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
               seed: int = PAPER_SEED) -> list[dict]:
    """Relative RMSE of PASA against the golden for each beta on each (dist, mean, amplitude) cell."""
    rows = []
    for dist, mean, amp in cells:
        q, k, v = paper_inputs(dist, mean, amp, shape, seed, torch.float16, v_mean=v_mean)
        gold = reference.golden_attention(q, k, v)
        for beta in betas:
            out = reference.pasa_reference(q, k, v, beta=beta, precision=precision)
            bad = nonfinite_count(out)
            rows.append({"dist": dist, "mean": mean, "amplitude": amp, "beta": beta, "precision": precision,
                         "rel_rmse_v": _finite_or_nan(rel_rmse_v(out, gold, v), bad),
                         "rel_rmse": _finite_or_nan(rel_rmse(out, gold), bad), "nonfinite": bad})
    return rows


def _fmt(x: float, nonfinite: int) -> str:
    return "NaN/inf" if nonfinite else f"{x:.2e}"


def study_table(rows: list[StudyRow], metric: str = "rel_rmse_v") -> str:
    """A markdown table: one line per input cell, one column per variant, plus max |q k^T|."""
    if metric not in ("rel_rmse_v", "rel_rmse", "max_abs"):
        raise ValueError(f"unknown metric={metric!r}")
    variants = list(dict.fromkeys(r.variant for r in rows))
    cells = list(dict.fromkeys((r.dist, r.mean, r.amplitude) for r in rows))
    by_key = {(r.dist, r.mean, r.amplitude, r.variant): r for r in rows}
    head = "| dist | mean | Am | max abs(qk) | " + " | ".join(variants) + " |"
    lines = [head, "|" + " --- |" * (4 + len(variants))]
    for dist, mean, amp in cells:
        first = by_key[(dist, mean, amp, variants[0])]
        vals = [_fmt(getattr(by_key[(dist, mean, amp, v)], metric), by_key[(dist, mean, amp, v)].nonfinite)
                for v in variants]
        lines.append(f"| {dist} | {mean:g} | {amp:g} | {first.max_abs_score:.3g} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def sweep_table(rows: list[dict]) -> str:
    """A markdown table of :func:`beta_sweep`: one line per cell, one column per beta (relative RMSE)."""
    betas = list(dict.fromkeys(r["beta"] for r in rows))
    cells = list(dict.fromkeys((r["dist"], r["mean"], r["amplitude"]) for r in rows))
    by_key = {(r["dist"], r["mean"], r["amplitude"], r["beta"]): r for r in rows}
    lines = ["| dist | mean | Am | " + " | ".join(f"beta={b:.6g}" for b in betas) + " |",
             "|" + " --- |" * (3 + len(betas))]
    for cell in cells:
        vals = [_fmt(by_key[cell + (b,)]["rel_rmse"], by_key[cell + (b,)]["nonfinite"]) for b in betas]
        lines.append(f"| {cell[0]} | {cell[1]:g} | {cell[2]:g} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def run_stress(variants: Iterable[str] | None = None, *, shape: tuple[int, ...] = (1, 2, 1, 300, 128),
               seed: int = PAPER_SEED) -> list[dict]:
    """Every variant on every :func:`stress_cases` case: relative RMSE against the golden (NaN if the
    output is non-finite; ``None`` where the variant does not take the inputs' dtype, e.g. fp16-only
    pipelines on bf16 inputs)."""
    names = list(VARIANTS) if variants is None else list(variants)
    rows = []
    for case, (q, k, v) in stress_cases(shape, seed).items():
        gold = reference.golden_attention(q, k, v)
        for name in names:
            if q.dtype == torch.bfloat16 and name in ("FA half", "smooth-K half", "PASA half", "exact half"):
                rows.append({"case": case, "variant": name, "rel_rmse": None, "nonfinite": 0})
                continue
            out = VARIANTS[name](q, k, v)
            bad = nonfinite_count(out)
            rows.append({"case": case, "variant": name, "rel_rmse": _finite_or_nan(rel_rmse(out, gold), bad),
                         "nonfinite": bad})
    return rows


def stress_table(rows: list[dict]) -> str:
    """A markdown table of :func:`run_stress`: one line per case, one column per variant."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    by_key = {(r["case"], r["variant"]): r for r in rows}
    lines = ["| case | " + " | ".join(variants) + " |", "|" + " --- |" * (1 + len(variants))]
    for case in dict.fromkeys(r["case"] for r in rows):
        cells = []
        for name in variants:
            r = by_key[(case, name)]
            cells.append("n/a" if r["rel_rmse"] is None else _fmt(r["rel_rmse"], r["nonfinite"]))
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_error_vs_bias(rows: list[StudyRow], path, *, dist: str = "uniform") -> None:
    """Relative RMSE against the input mean, one panel per amplitude, one line per variant (log scale;
    non-finite outputs are drawn as crosses at the top of the panel)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    amps = sorted({r.amplitude for r in rows if r.dist == dist})
    fig = Figure(figsize=(4.2 * len(amps), 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(amps), sharey=True, squeeze=False)[0]
    variants = list(dict.fromkeys(r.variant for r in rows))
    top = max(r.rel_rmse for r in rows if r.dist == dist and r.nonfinite == 0) * 3
    for ax, amp in zip(axes, amps):
        for i, name in enumerate(variants):
            cell = sorted((r for r in rows if r.dist == dist and r.amplitude == amp and r.variant == name),
                          key=lambda r: r.mean)
            finite = [(r.mean, r.rel_rmse) for r in cell if r.nonfinite == 0]
            if finite:
                ax.plot(*zip(*finite), marker="o", label=name, color=f"C{i}")
            broken = [r.mean for r in cell if r.nonfinite]
            if broken:
                ax.plot(broken, [top] * len(broken), "x", color=f"C{i}", markersize=9)
        ax.set_yscale("log")
        ax.set_title(f"{dist}, Am {amp:g}")
        ax.set_xlabel("mean of q and k")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("RMSE / RMS(golden)")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.suptitle("error against bias (x at the top: non-finite output)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
