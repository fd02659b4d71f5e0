"""Overflow statistics of one attention call, computed blockwise (never the full N x N scores).

For queries ``q`` (B, H, Nq, D) and keys ``k`` (B, H, Nk, D) of one call:

- ``max_abs_qk``: max |q . k| of the raw product, what a kernel computing ``q k^T`` in fp16 before
  scaling rounds (fp16 overflows above 65504); ``overflow_count`` counts those scores;
- ``max_abs_score``: max |scale q . k|, the logits;
- ``max_abs_shifted``: max |S'| after PASA's shift, ``S' = q (scale M_j k_j)^T`` per key block of
  ``block_n`` with ``M_j = I - (beta/n_j) 11^T`` (what PASA rounds to fp16);
- ``bias_q`` / ``bias_k`` per head: norm of the token mean over the RMS norm of the centred tokens
  — a bias along the sequence (0 for zero-mean tokens, large when every token carries the same offset;
  NaN for a single token);
- ``amplitude_q`` / ``amplitude_k`` per head: RMS of the centred tokens;
- ``resonance_cos`` per head: cosine of the token means of q and k (+1 in phase, -1 in anti-phase);
- ``sign_agreement`` per head: share of head dims where the token means of q and k share their sign
  (1 in phase, 0 in anti-phase, about 1/2 for unrelated means).

In-phase (or anti-phase) means with a large bias give ``q . k ~ +-|mean_q| |mean_k|`` for every pair,
the paper's "resonance" that pushes scores past fp16's range.
"""
from __future__ import annotations

import math

import torch

from ..shift_matrix import DEFAULT_BETA
from ..rules import FP16_MAX, SHIFT_BLOCK

__all__ = ["call_stats"]


def _token_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (batch, head): token mean (D,), RMS of centred tokens, and bias = |mean| / that RMS."""
    mean = x.mean(dim=2)
    centred_rms = (x - mean[:, :, None]).pow(2).mean(dim=(2, 3)).sqrt()
    if x.shape[2] == 1:  # one token: no spread to compare the mean with
        return mean, centred_rms, torch.full_like(centred_rms, float("nan"))
    bias = mean.norm(dim=-1) / (centred_rms * x.shape[-1] ** 0.5).clamp_min(1e-30)
    return mean, centred_rms, bias


def _shift_keys(k: torch.Tensor, scale: float, beta: float, block_n: int) -> torch.Tensor:
    shifted = torch.empty_like(k)
    for start in range(0, k.shape[2], block_n):
        blk = k[:, :, start:start + block_n]
        shifted[:, :, start:start + block_n] = scale * (blk - beta * blk.mean(dim=2, keepdim=True))
    return shifted


def _nan_max(a: float, b: float) -> float:
    """max that propagates NaN (Python's max silently drops it when it comes second)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _per_head(t: torch.Tensor) -> list[float]:
    return t.mean(dim=0).tolist()


@torch.no_grad()
def call_stats(q: torch.Tensor, k: torch.Tensor, scale: float, *, beta: float = DEFAULT_BETA,
               block_n: int = SHIFT_BLOCK, rows_per_chunk: int = 1024, max_elements: int = 2 ** 26) -> dict:
    """Statistics of one attention call (see the module docstring); GQA keys are repeated.

    Work is chunked over batch and query rows so that at most ``max_elements`` scores exist at once.
    Scores are computed in float32 on the inputs' device (fp16 inputs are exact in float32; products
    of fp16 values accumulate with float32 rounding, far below the 65504 threshold's resolution).
    Per-head values are averaged over the batch.
    """
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"call_stats: q and k must be (B, H, N, D), got q.shape={tuple(q.shape)}, "
                         f"k.shape={tuple(k.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"call_stats: q heads ({q.shape[1]}) must be a multiple of k heads ({k.shape[1]})")
    qf = q.float()
    kf = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    k_shift = _shift_keys(kf, scale, beta, block_n)
    b, h, nq, _ = qf.shape
    nk = kf.shape[2]
    batch_step = max(1, min(b, max_elements // max(1, h * min(nq, rows_per_chunk) * nk)))
    rows = max(1, min(nq, max_elements // max(1, batch_step * h * nk)))
    max_qk = max_shift = 0.0
    overflow = 0
    for b0 in range(0, b, batch_step):
        for r0 in range(0, nq, rows):
            q_blk = qf[b0:b0 + batch_step, :, r0:r0 + rows]
            qk = q_blk @ kf[b0:b0 + batch_step].transpose(-1, -2)
            max_qk = _nan_max(max_qk, qk.abs().max().item())
            overflow += int((qk.abs() > FP16_MAX).sum().item())
            shifted = q_blk @ k_shift[b0:b0 + batch_step].transpose(-1, -2)
            max_shift = _nan_max(max_shift, shifted.abs().max().item())
    mean_q, amp_q, bias_q = _token_stats(qf)
    mean_k, amp_k, bias_k = _token_stats(kf)
    cos = torch.nn.functional.cosine_similarity(mean_q, mean_k, dim=-1)
    agree = ((mean_q > 0) == (mean_k > 0)).float().mean(dim=-1)
    return {
        "shape_q": list(q.shape),
        "shape_k": list(k.shape),
        "scale": scale,
        "max_abs_qk": max_qk,
        "max_abs_score": max_qk * scale,
        "overflow_count": overflow,
        "max_abs_shifted": max_shift,
        "bias_q": _per_head(bias_q),
        "bias_k": _per_head(bias_k),
        "amplitude_q": _per_head(amp_q),
        "amplitude_k": _per_head(amp_k),
        "resonance_cos": _per_head(cos),
        "sign_agreement": _per_head(agree),
    }
