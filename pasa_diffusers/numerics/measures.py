"""The error measures of the numerical study, and how close a variant's fp16 scores come to overflow.

Because V carries the paper's large mean, ``rel_rmse_v`` (``RMSE / RMS(V)``, the paper's metric) hides errors
in the attention weights, so the study also reports ``rel_rmse`` (``RMSE / RMS(golden output)``).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..shift_matrix import shift_entries
from ..rules import FP16_MAX, SHIFT_BLOCK

__all__ = ["FP16_MAX", "max_score", "pasa_half_overflow_margin", "exact_half_overflow_margin", "rmse", "rel_rmse",
           "rel_rmse_v", "max_abs_error", "nonfinite_count"]


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
    per key block as the kernel and ``reference.pasa_reference`` form it (stored entries from ``shift_matrix.py``).

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
