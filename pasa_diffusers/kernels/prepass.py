"""The key pre-passes: each key block shifted or centred once per (batch, kv head), before the attention
kernel reads the result as its keys.

- :func:`centre_k_kernel` (the exact shift): ``c_j`` and ``k_c = round_g(k_blk - c_j)`` per block of
  ``block_n`` keys; the attention kernel then adds ``scale q . c_j`` (fp32, per query row and key block)
  back to the logits.  Same centres as ``reference.exact_shift_reference``.  Where all keys of a head form
  one block the attention kernels centre their key tile themselves with the same ``common.centre_tile``.
- :func:`shift_k_kernel` (PASA): ``k_shift = fp(scale M_j) k_j``, which the portable kernel would
  otherwise recompute for every query block.

Launchers: :func:`centre_keys`, :func:`shift_keys` (resolved arguments: the caller has checked them).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .common import INTERPRET, cdiv, centre_tile, round_to, strides3
from .launch import kept_launch
from .tuning import pow2_tile

__all__ = ["centre_k_kernel", "shift_k_kernel", "centre_keys", "shift_keys"]


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
    Writes ``k_c`` (``g``) into the (B, Hk, Nk, D) buffer and ``c_j`` (``g`` values) into the (B, Hk, key
    blocks, D) buffer, fp32 or ``g`` (the store converts exactly).  Grid: (B x Hk, key blocks).
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


def _warps(block_d: int) -> int:
    return 4 if block_d <= 64 else 8


@functools.lru_cache(maxsize=None)
def _tile(head_dim: int) -> tuple[int, int]:
    """``(BLOCK_D, warps)`` of a head dim, worked out once per head dim (``pow2_tile`` costs microseconds a
    call on the host)."""
    block_d = pow2_tile(head_dim)
    return block_d, _warps(block_d)


@functools.lru_cache(maxsize=None)
def _ulp(dtype: torch.dtype) -> float:
    """``torch.finfo(dtype).eps``, looked up once per dtype."""
    return torch.finfo(dtype).eps


def centre_keys(k: torch.Tensor, *, block_n: int, exact: bool,
                centres_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_c, centres)`` of ``k`` (B, Hk, Nk, D), any strides with unit stride in D, for key blocks of
    ``block_n``: ``k_c`` contiguous (B, Hk, Nk, D) in ``k.dtype``, ``centres`` (B, Hk, ceil(Nk / block_n), D)
    in ``centres_dtype`` (fp32, what the portable kernel reads, or ``k.dtype``, what the Gluon kernel's copy
    engine reads: the centres are values of ``k.dtype``, so either holds them exactly): the exact centres
    (``exact``, the hybrid precision) or the rounded block means (half)."""
    batch, h_k, n_k, head_dim = k.shape
    block_d, warps = _tile(head_dim)
    n_blocks = cdiv(n_k, block_n)
    k_c = torch.empty((batch, h_k, n_k, head_dim), dtype=k.dtype, device=k.device)
    centres = torch.empty((batch, h_k, n_blocks, head_dim), dtype=centres_dtype, device=k.device)
    kept_launch(centre_k_kernel, (batch * h_k, n_blocks),
                (k, k_c, centres, *strides3(k), *strides3(k_c), *strides3(centres), h_k, n_k, _ulp(k.dtype)),
                dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, EXACT_CENTRE=exact,
                     INTERPRET_BF16=INTERPRET and k.dtype == torch.bfloat16, num_warps=warps))
    return k_c, centres


def shift_keys(k: torch.Tensor, *, block_n: int, a_full: float, c_full: float, a_tail: float,
               c_tail: float) -> torch.Tensor:
    """PASA's shifted keys of ``k`` (B, Hk, Nk, D), any strides with unit stride in D, for key blocks of
    ``block_n``: contiguous (B, Hk, Nk, D) in ``k.dtype``; ``a_*``, ``c_*`` as :func:`shift_k_kernel`."""
    batch, h_k, n_k, head_dim = k.shape
    block_d, warps = _tile(head_dim)
    k_shift = torch.empty((batch, h_k, n_k, head_dim), dtype=k.dtype, device=k.device)
    shift_k_kernel[(batch * h_k, cdiv(n_k, block_n))](
        k, k_shift, *strides3(k), *strides3(k_shift), h_k, n_k, a_full, c_full, a_tail, c_tail,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, INTERPRET_BF16=INTERPRET and k.dtype == torch.bfloat16,
        num_warps=warps)
    return k_shift
