"""The shifting matrix of PASA, its stored entries, the recovery factor gamma and the beta fixed point.

PASA shifts each KV block of ``n`` keys by (almost) its mean with ``M = I - (beta/n) 11^T``, folded
with the softmax scale ``alpha`` into the keys: ``K~ = fp(alpha M) K``.  What a kernel multiplies
by are the *stored* entries of ``alpha M`` in the working precision::

    diag = fp(alpha (1 - beta/n)),    off = fp(-alpha beta / n)
    alpha M~ = a I - c 11^T           with  a = diag - off,  c = -off.

For a row of scores ``s = q K^T`` with row mean ``s_bar`` the shifted scores are
``S' = a s - c n s_bar`` and their row mean is ``mu = (a - c n) s_bar``.  The true logits are::

    alpha s = (alpha / a) S' + alpha c n / (a (a - c n)) mu
            ~ S' + gamma mu,   gamma = (alpha - a) / a + alpha c n / (a (a - c n))

where the last step replaces ``(alpha/a - 1) S'`` by its row mean (exact when ``a == alpha``, i.e.
whenever the entries are exactly representable).  Without rounding ``a = alpha``,
``c = alpha beta / n`` and ``gamma = beta / (1 - beta)``.

The authors' ``optimal_para.py`` picks beta so that ``beta / (1 - beta)`` equals this gamma: the
fixed point ``beta <- f / (1 + f)`` with ``f = gamma(beta)``.  Their script computes gamma from
``beta / (1 - beta)`` even when ``alpha`` is not a power of two (head dim 128), which leaves a
systematic offset; here gamma is always computed from the stored entries.
"""
from __future__ import annotations

import functools
import math

import torch

from .rules import SHIFT_BLOCK

__all__ = ["shift_entries", "gamma", "shift_constants", "optimal_beta", "DEFAULT_BETA", "FP64"]

FP64 = torch.float64
_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _round(x: float, dtype: torch.dtype) -> float:
    return torch.tensor(x, dtype=torch.float64).to(dtype).double().item()


def _check(beta: float, block_n: int, dtype: torch.dtype, scale: float) -> None:
    if not (isinstance(beta, (int, float)) and 0.0 < float(beta) < 1.0):
        raise ValueError(f"beta must lie in (0, 1), got beta={beta!r}")
    if not (isinstance(block_n, int) and block_n >= 1):
        raise ValueError(f"block_n must be a positive int, got block_n={block_n!r}")
    if dtype not in _SUPPORTED:
        raise ValueError(f"dtype must be one of {_SUPPORTED}, got dtype={dtype}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite float, got scale={scale!r}")


def shift_entries(beta: float, block_n: int = SHIFT_BLOCK, dtype: torch.dtype = torch.float16,
                  scale: float = 1.0) -> tuple[float, float]:
    """The stored ``(diag, off)`` entries of ``scale * (I - beta/n 11^T)`` rounded to ``dtype``."""
    _check(beta, block_n, dtype, scale)
    diag = _round(scale * (1.0 - beta / block_n), dtype)
    off = _round(-scale * beta / block_n, dtype)
    return diag, off


def gamma(beta: float, block_n: int = SHIFT_BLOCK, dtype: torch.dtype = torch.float16,
          scale: float = 1.0) -> float:
    """Recovery factor: the removed pseudo-average is ``gamma * mu`` (see the module docstring).

    Computed in float64 from the entries stored in ``dtype``; equals ``beta / (1 - beta)`` when they
    are exact.
    """
    diag, off = shift_entries(beta, block_n, dtype, scale)
    a, c, n = diag - off, -off, block_n
    if a - c * n == 0.0:
        raise ValueError(f"beta={beta!r} makes the stored shift matrix singular for block_n={block_n}, "
                         f"dtype={dtype}, scale={scale}")
    return (scale - a) / a + scale * c * n / (a * (a - c * n))


@functools.lru_cache(maxsize=256)
def shift_constants(beta: float, n_keys: int, block_n: int, dtype: torch.dtype,
                    scale: float) -> tuple[float, float, float, float, float, float]:
    """What a PASA kernel over ``n_keys`` keys in blocks of ``block_n`` multiplies by, in float64 from the
    stored entries: ``(a_full, c_full, a_tail, c_tail, gamma, tail_ratio)``.

    ``a I - c 11^T`` is ``fp(scale M)`` of a full block (``a_full, c_full``) and of the ragged last block of
    ``n_keys mod block_n`` keys (``a_tail, c_tail``; the full block's when there is none); ``gamma`` is the
    full block's recovery factor (the tail's when ``n_keys < block_n``: then the only block is the tail);
    ``tail_ratio = gamma_tail / gamma``.
    """
    n_first = min(block_n, n_keys)
    diag, off = shift_entries(beta, n_first, dtype, scale)
    a_full, c_full = diag - off, -off
    gam = gamma(beta, n_first, dtype, scale)
    n_tail = n_keys % block_n
    if n_tail == 0 or n_keys < block_n:
        return a_full, c_full, a_full, c_full, gam, 1.0
    diag, off = shift_entries(beta, n_tail, dtype, scale)
    return a_full, c_full, diag - off, -off, gam, gamma(beta, n_tail, dtype, scale) / gam


def optimal_beta(block_n: int = SHIFT_BLOCK, dtype: torch.dtype = torch.float16, scale: float = 1.0, *,
                 start: float = 1.0 - 2.0 ** -6, tol: float = 1e-8, max_iter: int = 100) -> float:
    """Solve the rounding fixed point ``beta / (1 - beta) = gamma(beta)`` by ``beta <- f / (1 + f)``.

    The authors start from ``1 - 2^-4``, ``1 - 2^-5`` and ``1 - 2^-6``; for ``block_n=128``,
    ``scale=1`` and fp16 these converge to 0.9375 (exact: every entry representable, gamma 15),
    about 0.968994 (gamma 31.25) and about 0.984497 (gamma 63.5).
    """
    _check(start, block_n, dtype, scale)
    beta = float(start)
    for _ in range(max_iter):
        f = gamma(beta, block_n, dtype, scale)
        new = f / (1.0 + f)
        if not 0.0 < new < 1.0:
            raise ValueError(f"the fixed point left (0, 1) from start={start!r} (block_n={block_n}, "
                             f"dtype={dtype}, scale={scale})")
        if abs(new - beta) < tol:
            return new
        beta = new
    raise ValueError(f"the beta fixed point did not converge in {max_iter} iterations from start={start!r}")


DEFAULT_BETA = optimal_beta(SHIFT_BLOCK, torch.float16, 1.0, start=1.0 - 2.0 ** -4)
"""0.9375: the fp16 fixed point for 128-key blocks (every entry of M exactly representable)."""
