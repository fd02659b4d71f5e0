"""The inputs of the numerical study: the paper's random benchmarks, the input classes a real checkpoint can
produce, and the extended study's stress cases.

The paper's random benchmarks draw q, k and v from one distribution:

- ``"uniform"``: U[mean - Am, mean + Am];
- ``"hybrid"`` (FlashAttention-3's outlier model): N(mean, 1) + Bernoulli(0.001) * N(0, Am).
"""
from __future__ import annotations

import math

import torch

from ..rules import SHIFT_BLOCK

__all__ = ["PAPER_MEANS", "PAPER_AMPLITUDES", "PAPER_SHAPE", "QUICK_SHAPE", "PAPER_SEED", "paper_inputs",
           "resonance_inputs", "INPUT_CLASSES", "input_classes", "stress_cases"]


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
