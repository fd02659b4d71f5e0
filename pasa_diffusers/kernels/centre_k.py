"""The exact shift's pre-pass: centre each key block once, ``k_c = k_blk - c_j``, and keep ``c_j``.

The attention kernel (``pasa_fwd.py``, ``EXACT_SHIFT=True``) then reads the centred keys as its keys
and adds ``scale q . c_j`` (fp32, per query row and key block) back to the logits.  Same centres as
``reference.exact_shift_reference``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .shift_k import round_to

__all__ = ["centre_k_kernel"]


@triton.jit
def _binade(x):
    """``2^e`` with ``2^e <= |x| < 2^(e+1)`` for normal fp32 ``x``: the exponent bits alone."""
    return (x.to(tl.uint32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["N_K"])
def centre_k_kernel(
    k_ptr, kc_ptr, c_ptr,
    stride_kz, stride_kh, stride_kn,
    stride_xz, stride_xh, stride_xn,
    stride_cz, stride_ch, stride_cj,
    H_K, N_K, G_ULP,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    EXACT_CENTRE: tl.constexpr, INTERPRET_BF16: tl.constexpr,
):
    """``c_j`` and ``k_c = round_g(k_blk - c_j)`` for key block ``j`` of one (batch, kv head).

    Tiles: ``k_blk`` (BLOCK_N, BLOCK_D) in the GEMM dtype ``g``, widened to fp32 (rows past ``N_K``
    load as zero and are excluded from every reduction); per channel (BLOCK_D,) fp32:

        mean    = colsum(k_blk) / n_j
        c_j     = round_g(mean)                                   (EXACT_CENTRE=False: "half")
        c_j     = exact_centre(k_blk)                             (EXACT_CENTRE=True: "hybrid")

    ``exact_centre`` (``reference.exact_centre``): in a channel of positive keys with smallest ``a``
    (``2^e <= a < 2^(e+1)``) and largest ``b``, ``c = round_g(clamp(mean, b / 2, a + 2^(e+1)))`` (one
    ``g`` ulp, ``G_ULP`` times its binade, lower where rounding crossed the upper end) makes every
    ``k - c`` exact in ``g``; negative channels are mirrored; a channel whose keys change sign, or
    where the check ``round_g(k - c) == k - c`` fails for any key, gets ``c = 0``.
    Writes ``k_c`` (``g``) into the (B, Hk, Nk, D) buffer and ``c_j`` (fp32, ``g`` values) into the
    (B, Hk, key blocks, D) buffer.  Grid: (B x Hk, key blocks).
    """
    pid_bh = tl.program_id(0)
    blk = tl.program_id(1)
    start_n = blk * BLOCK_N
    off_z = (pid_bh // H_K).to(tl.int64)
    off_h = (pid_bh % H_K).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_valid = offs_n < N_K
    d_valid = offs_d < HEAD_DIM
    mask = n_valid[:, None] & d_valid[None, :]

    k_ptrs = k_ptr + off_z * stride_kz + off_h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    k_blk = tl.load(k_ptrs, mask=mask, other=0.0)
    g_ty = k_blk.dtype
    k32 = k_blk.to(tl.float32)
    n_j = tl.minimum(N_K - start_n, BLOCK_N)
    mean = tl.sum(k32, axis=0) / n_j
    if EXACT_CENTRE:
        lo_key = tl.min(tl.where(n_valid[:, None], k32, float("inf")), axis=0)
        hi_key = tl.max(tl.where(n_valid[:, None], k32, float("-inf")), axis=0)
        positive = lo_key > 0.0
        negative = hi_key < 0.0
        sign = tl.where(negative, -1.0, 1.0)
        nearest = tl.where(positive, lo_key, -hi_key)
        farthest = tl.where(positive, hi_key, -lo_key)
        upper = nearest + 2.0 * _binade(nearest)
        c_mag = round_to(tl.minimum(tl.maximum(sign * mean, 0.5 * farthest), upper), g_ty, INTERPRET_BF16)
        c_mag = c_mag.to(tl.float32)
        c_mag = tl.where(c_mag > upper, c_mag - _binade(c_mag) * G_ULP, c_mag)
        c = sign * c_mag
        diff = k32 - c[None, :]
        exact = (round_to(diff, g_ty, INTERPRET_BF16).to(tl.float32) == diff) | (offs_n[:, None] >= N_K)
        all_exact = tl.min(exact.to(tl.int32), axis=0) > 0
        c = tl.where((positive | negative) & all_exact, c, 0.0)
    else:
        c = round_to(mean, g_ty, INTERPRET_BF16).to(tl.float32)
    k_c = round_to(k32 - c[None, :], g_ty, INTERPRET_BF16)

    kc_ptrs = kc_ptr + off_z * stride_xz + off_h * stride_xh + offs_n[:, None] * stride_xn + offs_d[None, :]
    tl.store(kc_ptrs, k_c, mask=mask)
    c_ptrs = c_ptr + off_z * stride_cz + off_h * stride_ch + blk * stride_cj + offs_d
    tl.store(c_ptrs, c, mask=d_valid)
