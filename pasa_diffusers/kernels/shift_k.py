"""PASA's key shift as a pre-pass: ``k_shift = fp(scale M_j) k_j`` once per (batch, kv head, key block).

The fused kernel (``pasa_fwd.py``, ``SHIFT="pasa"``, ``SHIFT_IN_LOOP=True``) recomputes the shift of every key tile for
every query block; this pre-pass computes it once into a ``(B, Hk, Nk, D)`` buffer that the main
kernel then reads as its keys (``SHIFT_IN_LOOP=False``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import round_to

__all__ = ["shift_k_kernel"]


@triton.jit(do_not_specialize=["N_K"])
def shift_k_kernel(
    k_ptr, ks_ptr,
    stride_kz, stride_kh, stride_kn,
    stride_sz, stride_sh, stride_sn,
    H_K, N_K,
    a_full, c_full, a_tail, c_tail,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET_BF16: tl.constexpr,
):
    """``k_shift = a k_blk - c colsum(k_blk)`` for one key block of one (batch, kv head).

    ``a I - c 11^T`` holds the stored entries of ``qk_scale (I - beta/n_j 11^T)`` in the GEMM dtype
    (``a_full, c_full`` for full blocks of ``BLOCK_N`` keys, ``a_tail, c_tail`` for the ragged last
    block of ``n_j = N_K mod BLOCK_N`` keys).  Tiles: ``k_blk`` (BLOCK_N, BLOCK_D) in the GEMM dtype,
    widened to fp32; ``colsum`` (BLOCK_D,) fp32 over the valid rows (masked rows load as zero);
    ``k_shift`` rounded to the GEMM dtype.  Grid: (B x Hk, key blocks).
    """
    pid_bh = tl.program_id(0)
    start_n = tl.program_id(1) * BLOCK_N
    off_z = (pid_bh // H_K).to(tl.int64)
    off_h = (pid_bh % H_K).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_n[:, None] < N_K) & (offs_d[None, :] < HEAD_DIM)

    k_ptrs = k_ptr + off_z * stride_kz + off_h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    k_blk = tl.load(k_ptrs, mask=mask, other=0.0)
    k32 = k_blk.to(tl.float32)
    colsum = tl.sum(k32, axis=0)
    is_tail = start_n + BLOCK_N > N_K
    a = tl.where(is_tail, a_tail, a_full)
    c = tl.where(is_tail, c_tail, c_full)
    k_shift = round_to(a * k32 - c * colsum[None, :], k_blk.dtype, INTERPRET_BF16)

    s_ptrs = ks_ptr + off_z * stride_sz + off_h * stride_sh + offs_n[:, None] * stride_sn + offs_d[None, :]
    tl.store(s_ptrs, k_shift, mask=mask)
