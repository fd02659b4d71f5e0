"""The exact shift's pre-pass: centre each key block once, ``k_c = k_blk - c_j``, and keep ``c_j``.

The attention kernel (``pasa_fwd.py``, ``SHIFT="exact"``) then reads the centred keys as its keys and
adds ``scale q . c_j`` (fp32, per query row and key block) back to the logits.  Same centres as
``reference.exact_shift_reference``.  Where all keys of a head form one block (temporal attention) the
attention kernel centres its one key tile itself, with the same ``common.centre_tile``, and this
pre-pass is not run.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import centre_tile, round_to

__all__ = ["centre_k_kernel"]


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
    load as zero and are excluded from every reduction); ``c_j`` (BLOCK_D,) fp32 from
    ``common.centre_tile``: the rounded block mean (``EXACT_CENTRE=False``: "half") or the exact centre
    (``EXACT_CENTRE=True``: "hybrid"), with which every ``k - c_j`` is exact in ``g``.
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
    c = centre_tile(k32, n_valid[:, None], n_j, G_ULP, g_ty, EXACT_CENTRE, INTERPRET_BF16, 0, False)
    k_c = round_to(k32 - c[None, :], g_ty, INTERPRET_BF16)

    kc_ptrs = kc_ptr + off_z * stride_xz + off_h * stride_xh + offs_n[:, None] * stride_xn + offs_d[None, :]
    tl.store(kc_ptrs, k_c, mask=mask)
    c_ptrs = c_ptr + off_z * stride_cz + off_h * stride_ch + blk * stride_cj + offs_d
    tl.store(c_ptrs, c, mask=d_valid)
