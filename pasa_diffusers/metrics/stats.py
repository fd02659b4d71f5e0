"""Statistics over samples: mean, standard deviation and a bootstrap 95 % interval, alone and paired.

A *sample* is one (image, seed) video; its value of a metric is one number (e.g. the PSNR averaged over
its frames).  ``summarize`` describes the values of one backend, ``paired_difference`` the per-sample
differences of two backends scored on the same samples (the question "is A better than B here, or is
it noise?").

Method (``METHOD``): the percentile bootstrap over samples.  ``RESAMPLES`` = 10000 times, ``n`` samples
are drawn with replacement from the ``n`` values (``numpy.random.default_rng(SEED).integers(0, n,
(RESAMPLES, n))``, the same draws for every statistic of the same ``n``, so a result is reproducible
and does not depend on what else was computed); the interval is the 2.5th and 97.5th percentiles
(numpy's linear interpolation) of the resampled means.  A paired difference resamples the
per-sample differences, i.e. the same samples for both backends.  ``std`` is the sample standard
deviation (``ddof=1``).

Missing values (NaN: a sample with no finite frame) are left out and ``n`` counts the rest.  With
``n < 2`` there is no spread: ``std`` and ``ci95`` are None.  An infinite value (PSNR of a video
identical to the reference) makes the mean infinite; ``std`` and ``ci95`` are then None (an interval
around an infinite mean says nothing), and the difference of two infinite values is left out as
undefined.  With few samples the percentile bootstrap is too narrow (with ``n = 3`` there are only 10
distinct resampled means): read an interval over fewer than about 10 samples as a rough guide.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["RESAMPLES", "SEED", "CONFIDENCE", "METHOD", "summarize", "bootstrap_ci", "paired_difference",
           "per_frame"]

RESAMPLES = 10_000
SEED = 0
CONFIDENCE = 0.95
METHOD = (f"percentile bootstrap over samples: {RESAMPLES} resamples with replacement "
          f"(numpy default_rng({SEED}).integers), {100 * CONFIDENCE:g}% interval = 2.5th and 97.5th percentiles "
          "(linear) of the resampled means; paired differences resample the per-sample differences; "
          "std is the sample standard deviation (ddof 1); samples without a value are left out of n")

_CHUNK = 1 << 22
"""Indices drawn at a time (``rows * n``): the draws come out the same as one ``(RESAMPLES, n)`` draw."""


def _values(values: Sequence[float] | np.ndarray) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"stats: expected a 1-d sequence of values, got shape {array.shape}")
    return array[~np.isnan(array)]


def bootstrap_ci(values: Sequence[float] | np.ndarray, *, resamples: int = RESAMPLES, seed: int = SEED,
                 confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The percentile-bootstrap interval of the mean of finite ``values`` (at least two, none missing)."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size < 2 or not np.isfinite(x).all():
        raise ValueError(f"bootstrap_ci: expected at least two finite values, got {x.tolist()}")
    if not 0 < confidence < 1:
        raise ValueError(f"bootstrap_ci: confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    rows = max(1, _CHUNK // x.size)
    means = np.concatenate([x[rng.integers(0, x.size, size=(min(rows, resamples - start), x.size))].mean(axis=1)
                            for start in range(0, resamples, rows)])
    tail = 100 * (1 - confidence) / 2
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return float(lo), float(hi)


def summarize(values: Sequence[float] | np.ndarray) -> dict[str, float | list[float] | int | None]:
    """``{"mean", "std", "ci95": [lo, hi], "n"}`` of the values that are not NaN (see the module docstring)."""
    x = _values(values)
    n = int(x.size)
    if n == 0:
        return {"mean": None, "std": None, "ci95": None, "n": 0}
    if np.isinf(x).any():
        mean = float(x.mean())  # inf, -inf, or NaN when both signs are present
        return {"mean": None if math.isnan(mean) else mean, "std": None, "ci95": None, "n": n}
    mean = float(x.mean())
    if n < 2:
        return {"mean": mean, "std": None, "ci95": None, "n": n}
    return {"mean": mean, "std": float(x.std(ddof=1)), "ci95": list(bootstrap_ci(x)), "n": n}


def paired_difference(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray
                      ) -> dict[str, float | list[float] | int | None]:
    """``summarize`` of ``a[i] - b[i]`` over the samples where both have a value (and the difference is defined)."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"paired_difference: a and b must be 1-d and aligned, got shapes {x.shape} and {y.shape}")
    with np.errstate(invalid="ignore"):
        return summarize(x - y)


def per_frame(matrix: Sequence[Sequence[float]] | np.ndarray) -> dict[str, list]:
    """``summarize`` of each frame (column) of a ``(samples, frames)`` matrix, as
    ``{"mean": [...], "ci95": [[lo, hi], ...], "n": [...]}``."""
    m = np.asarray(matrix, dtype=np.float64)
    if m.ndim != 2:
        raise ValueError(f"per_frame: expected a (samples, frames) matrix, got shape {m.shape}")
    columns = [summarize(m[:, t]) for t in range(m.shape[1])]
    return {"mean": [c["mean"] for c in columns], "ci95": [c["ci95"] for c in columns], "n": [c["n"] for c in columns]}
