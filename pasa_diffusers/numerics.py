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

__all__ = [
    "paper_inputs",
    "resonance_inputs",
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


Variant = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _bf16(fn: Variant) -> Variant:
    return lambda q, k, v: fn(q.bfloat16(), k.bfloat16(), v.bfloat16())


VARIANTS: dict[str, Variant] = {
    "FA fp32": lambda q, k, v: reference.flash_reference(q, k, v, precision="fp32"),
    "FA half": lambda q, k, v: reference.flash_reference(q, k, v, precision="half"),
    "FA bf16": _bf16(lambda q, k, v: reference.flash_reference(q, k, v, precision="fp32")),
    "smooth-K half": lambda q, k, v: reference.smooth_k_reference(q, k, v, precision="half"),
    "PASA half": lambda q, k, v: reference.pasa_reference(q, k, v, precision="half"),
    "PASA hybrid": lambda q, k, v: reference.pasa_reference(q, k, v, precision="hybrid"),
    "exact hybrid": lambda q, k, v: reference.exact_shift_reference(q, k, v, precision="hybrid"),
    "exact half": lambda q, k, v: reference.exact_shift_reference(q, k, v, precision="half"),
}
"""The study's variants on fp16 inputs.  "FA bf16" re-rounds the inputs to bf16 (its error includes
that rounding, which is what running a model in bf16 costs); "FA fp32" is FlashAttention-2/cuDNN
(fp16 GEMMs, fp32 scores and state); "FA half" the naive fully-FP16 kernel; "exact hybrid" | "exact half" the exact shift
(``reference.exact_shift_reference``: block means of K removed exactly, the removed logit carried in fp32)."""


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
