"""The 8-bit precisions' pre-pass: q, k, v to the codes both 8-bit attention kernels read (``int8.py``'s
``portable-int8`` and ``hopper_int8.py``'s ``gluon-int8``), portable Triton.

It computes ``reference_int8``'s quantizers (its module docstring states the math and why each step) in four
launches (:func:`prepare`):

1. :func:`colstats_kernel`: per block of ``BLOCK_R`` rows, the column sums of q (fp64) and, for FP8
   ``P V``, the column maxima of ``|v|``;
2. :func:`colstats_reduce_kernel`: those partials reduced in a fixed order: ``qbar =
   round_g(round_fp32(sum / Nq))`` per (batch, query head), and V's per-channel ``vs = amax / 448``,
   ``448 / amax``;
3. :func:`quantize_kernel`, the fused pre-pass: one program per block of 128 queries (smoothing,
   rotation, INT8 codes) or 128 keys (centre, rotation, codes, the exact corrections ``sigma``, ``A``;
   V to e4m3 for FP8 ``P V``; for the Gluon kernel their bias rows, :func:`_bias_rows`);
4. :func:`fallback_flags_kernel`: the query statistics reduced, and per (batch, query head) which key
   blocks go to 16 bits (``reference_int8`` step 4b), counted into the caller's counter (left out with
   ``fallback=False``).

Head dims are padded to ``DP``, a power of two >= 32 (an INT8 MMA reduces over 32).  Every rounding is the
spec's, bit for bit: column sums in fp64 (exact for fp16 values, so their order does not matter), the
Hadamard transform by the same butterflies (additions only), IEEE divisions (``div_rn``), codes as rounded
quotients (a product would be contracted into the rounding's addition by the GPU compiler alone),
round-to-nearest-even by the 1.5 * 2^23 trick (exact for ``|x| < 2^22``).  The interpreter's fp32 -> e4m3
conversion drops the carry of a rounding that crosses a power of two, so there values are first rounded onto
e4m3's grid in fp32 (:func:`_to_e4m3`, which the portable attention kernel shares, as :func:`_split`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import rules
from ..rules import INT8_FALLBACK_TAU, SHIFT_BLOCK
from .common import INTERPRET, binade, cdiv, log2_units, round_to, strides3
from .launch import kept_launch
from .tuning import pow2_tile

__all__ = ["colstats_kernel", "colstats_reduce_kernel", "quantize_kernel", "fallback_flags_kernel", "Prepared",
           "Scratch", "allocate", "written_bytes", "quantize_call", "flags_call", "prepare"]

QMAX = tl.constexpr(rules.QMAX)
"""``rules.QMAX`` (the largest INT8 code) as the kernels' constexpr."""
FP8_MAX = tl.constexpr(rules.FP8_MAX)
"""``rules.FP8_MAX`` (e4m3's largest finite value) as the kernels' constexpr."""
RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23
BIAS_K = tl.constexpr(16)
"""Columns of a bias row (``Prepared.bias``): the K of one bf16 wgmma."""


# ---- helpers ----------------------------------------------------------------------------------------

@triton.jit
def _rne(x):
    """``x`` rounded to the nearest integer, ties to even (fp32, ``|x| < 2^22``): adding 1.5 * 2^23 puts
    the integer grid on fp32's last bit, and the addition rounds to nearest even."""
    return (x + RNE_MAGIC) - RNE_MAGIC


@triton.jit
def _fwht(x, ROWS: tl.constexpr, DP: tl.constexpr, LOG2_DP: tl.constexpr):
    """``x H^T`` for a (ROWS, DP) fp32 tile: the Walsh-Hadamard transform of each row, unnormalised, by
    ``reference_int8.fwht``'s butterflies (stage ``h = 1, 2, ..., DP/2`` maps channels ``d``, ``d + h``
    with bit ``h`` of ``d`` clear to ``(a + b, a - b)``).  Each channel takes its partner ``p`` (the pair's
    int32 bit patterns summed, wrapping, minus its own: exactly the partner's bits) and becomes ``p + x``
    (``a + b``) or ``p + (-1) x`` (``a - b``): the product by -1 is exact, and so the FMA the compiler may
    contract it into rounds the same sum once.  One exchange per element in the tile's own layout (a
    shuffle where bit ``h`` lies across lanes, nothing where it lies in a thread), where ``split``/``join``
    move the tile through other layouts; on sm_90 the SASS is ``tl.flip``'s instruction for instruction, and
    the interpreter runs the sum faster than ``tl.flip``'s xor reduction (docs/notes/int8_kernel.md)."""
    for s in tl.static_range(LOG2_DP):
        y = tl.reshape(x, (ROWS, DP // (2 << s), 2, 1 << s))
        sign = tl.where(tl.arange(0, 2) == 1, -1.0, 1.0)[None, None, :, None]
        bits = y.to(tl.int32, bitcast=True)
        partner = (tl.sum(bits, axis=2, keep_dims=True) - bits).to(tl.float32, bitcast=True)
        x = tl.reshape(partner + sign * y, (ROWS, DP))
    return x


@triton.jit
def _bf16_parts(x, INTERPRET_BF16: tl.constexpr):
    """``x`` (fp32) as three bf16 parts, ``x = x1 + x2 + x3`` to within fp32's last bit: each part the
    nearest bf16 of what the ones before leave (the differences are exact in fp32)."""
    x1 = round_to(x, tl.bfloat16, INTERPRET_BF16).to(tl.float32)
    x2 = round_to(x - x1, tl.bfloat16, INTERPRET_BF16).to(tl.float32)
    x3 = round_to((x - x1) - x2, tl.bfloat16, INTERPRET_BF16).to(tl.float32)
    return x1, x2, x3


@triton.jit
def _bias_rows(sigma, au, BLOCK_R: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """The (BLOCK_R, :data:`BIAS_K`) bf16 bias rows of the Gluon kernel (``Prepared.bias``): with ``sigma =
    s1 + s2 + s3`` and ``uA = u1 + u2 + u3`` in bf16 parts, the columns ``(s1, s2, s3, s1, s2, s1, u1, u2, u3,
    u1, u2, u1, 0, 0, 0, 0)``, the B side of one bf16 product whose A side pairs the row factors' parts with them
    so that the six largest cross products of each term are summed (those left out are below fp32's last bit)."""
    s1, s2, s3 = _bf16_parts(sigma, INTERPRET_BF16)
    u1, u2, u3 = _bf16_parts(au, INTERPRET_BF16)
    col = tl.arange(0, BIAS_K)[None, :]
    rows = tl.where((col == 0) | (col == 3) | (col == 5), s1[:, None], 0.0)
    rows = tl.where((col == 1) | (col == 4), s2[:, None], rows)
    rows = tl.where(col == 2, s3[:, None], rows)
    rows = tl.where((col == 6) | (col == 9) | (col == 11), u1[:, None], rows)
    rows = tl.where((col == 7) | (col == 10), u2[:, None], rows)
    rows = tl.where(col == 8, u3[:, None], rows)
    return rows.to(tl.bfloat16)


@triton.jit
def _codes(y):
    """INT8 codes of fp32 rows ``y`` (ROWS, DP): ``(codes int8, scale fp32 (ROWS,))`` with ``scale =
    amax / 127`` and ``codes = rne(y / scale)`` (0 and 0 for an all-zero row), as
    ``reference_int8.quantize_rows``.  A quotient, not ``y * (127 / amax)``: the compiler would contract
    that product into the rounding's addition (one FMA, no product rounding), which the interpreter and
    PyTorch do not do; a correctly rounded division rounds alike everywhere."""
    amax = tl.max(tl.abs(y), axis=1)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
    live = (scale > 0.0)[:, None]
    codes = _rne(tl.where(live, tl.math.div_rn(y, tl.where(live, scale[:, None], 1.0)), 0.0)).to(tl.int8)
    return codes, scale


@triton.jit
def _to_e4m3(x, INTERPRET_FP8: tl.constexpr):
    """fp32 ``x`` (``|x| <= 448``) rounded to nearest even in e4m3.  ``INTERPRET_FP8`` rounds onto e4m3's grid
    in fp32 first (ulp ``2^(e-3)``, ``2^-9`` below the smallest normal ``2^-6``), because the interpreter's
    conversion drops the carry when rounding up crosses a power of two (31.8 -> 16, not 32); the GPU's
    ``cvt.rn.satfinite`` rounds correctly."""
    if INTERPRET_FP8:
        ulp = tl.maximum(binade(x), 0.015625) * 0.125
        x = _rne(x / ulp) * ulp
    return x.to(tl.float8e4nv)


@triton.jit
def _split(kc, g: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """A 16-bit block's keys ``kc = k - c_b`` (fp32) as ``hi = round_g(kc)``, ``lo = round_g(kc - hi)`` (``g``: the
    inputs' fp16 or bf16; ``hi + lo`` holds ``kc`` to ``g``'s precision squared)."""
    hi = round_to(kc, g, INTERPRET_BF16)
    return hi, round_to(kc - hi.to(tl.float32), g, INTERPRET_BF16)


@triton.jit
def _column0(y, offs_c):
    """``(y[:, 0], y with column 0 set to 0)``: the row sums the transform put in channel 0."""
    first = offs_c[None, :] == 0
    return tl.sum(tl.where(first, y, 0.0), axis=1), tl.where(first, 0.0, y)


# ---- 1, 2: column statistics --------------------------------------------------------------------------

@triton.jit(do_not_specialize=["N"])
def colstats_kernel(x_ptr, part_ptr, stride_xz, stride_xh, stride_xn, H, N, n_blocks,
                    HEAD_DIM: tl.constexpr, DP: tl.constexpr, BLOCK_R: tl.constexpr, AMAX: tl.constexpr):
    """Per block of ``BLOCK_R`` rows of one (batch, head) of x (B, H, N, D): the column sums in fp64
    (``AMAX=False``; exact for fp16 values) or the column maxima of ``|x|`` in fp32 (``AMAX=True``), into
    the (B H, blocks, DP) buffer (padded columns 0).  Grid: (B x H, blocks)."""
    pid_bh = tl.program_id(0)
    blk = tl.program_id(1)
    offs_r = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, DP)
    mask = (offs_r[:, None] < N) & (offs_c[None, :] < HEAD_DIM)
    base = x_ptr + (pid_bh // H).to(tl.int64) * stride_xz + (pid_bh % H).to(tl.int64) * stride_xh
    x = tl.load(base + offs_r[:, None] * stride_xn + offs_c[None, :], mask=mask, other=0.0)
    if AMAX:
        part = tl.max(tl.abs(x.to(tl.float32)), axis=0)
    else:
        part = tl.sum(x.to(tl.float64), axis=0)
    tl.store(part_ptr + (pid_bh.to(tl.int64) * n_blocks + blk) * DP + offs_c, part)


@triton.jit(do_not_specialize=["N"])
def colstats_reduce_kernel(part_ptr, out_ptr, inv_ptr, N, n_blocks, DP: tl.constexpr, AMAX: tl.constexpr,
                           G_BF16: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """The partials of one (batch, head), in block order.  Sums: ``qbar = round_g(round_fp32(sum / N))``
    (fp64 division, then the spec's two roundings) into ``out``.  Maxima: ``vs = amax / 448`` into
    ``out`` and ``448 / amax`` (0 where ``amax = 0``) into ``inv``.  ``g`` is bf16 with ``G_BF16``, else
    fp16.  Grid: (B x H,)."""
    pid_bh = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, DP)
    base = part_ptr + pid_bh * n_blocks * DP + offs_c
    if AMAX:
        acc = tl.zeros([DP], tl.float32)
        for blk in range(0, n_blocks):
            acc = tl.maximum(acc, tl.load(base + blk * DP))
        live = acc > 0.0
        fp8_max = tl.full([DP], FP8_MAX, tl.float32)
        tl.store(out_ptr + pid_bh * DP + offs_c, tl.math.div_rn(acc, fp8_max))
        tl.store(inv_ptr + pid_bh * DP + offs_c, tl.where(live, tl.math.div_rn(fp8_max, tl.where(live, acc, 1.0)), 0.0))
    else:
        acc = tl.zeros([DP], tl.float64)
        for blk in range(0, n_blocks):
            acc += tl.load(base + blk * DP)
        mean = (acc / N).to(tl.float32)
        if G_BF16:
            qbar = round_to(mean, tl.bfloat16, INTERPRET_BF16).to(tl.float32)
        else:
            qbar = mean.to(tl.float16).to(tl.float32)
        tl.store(out_ptr + pid_bh * DP + offs_c, qbar)


# ---- 3: the fused pre-pass ------------------------------------------------------------------------------

@triton.jit
def _row_stats(scale, y):
    """``(sum s^2, sum |y|^2)`` of a block's rows in fp64 (squares of fp32 values are exact there)."""
    s64 = scale.to(tl.float64)
    y64 = y.to(tl.float64)
    return tl.sum(s64 * s64, axis=0), tl.sum(tl.sum(y64 * y64, axis=1), axis=0)


@triton.jit
def _quantize_queries(q_ptr, qbar_ptr, qc_ptr, qs_ptr, mu_ptr, qstat_ptr, task,
                      stride_qz, stride_qh, stride_qm, stride_cz, stride_ch, stride_cm, stride_sz, stride_sh,
                      H_Q, N_Q, n_blocks,
                      HEAD_DIM: tl.constexpr, DP: tl.constexpr, LOG2_DP: tl.constexpr, BLOCK_R: tl.constexpr):
    """One block of ``BLOCK_R`` queries: ``y = fwht(q - qbar)`` (fp32), ``mu = y[:, 0] / DP``, ``y[:, 0] = 0``,
    then :func:`_codes`, and the block's ``(sum s_q^2, sum |y|^2)`` (fp64) for the fallback's statistics.
    Tiles: q (BLOCK_R, DP) g widened to fp32 (rows past ``N_Q`` and columns past ``HEAD_DIM`` load as 0
    and stay 0 before the transform, so they add 0 to the sums); ``qbar`` (DP,) fp32."""
    pid_bh = task // n_blocks
    offs_r = (task % n_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, DP)
    off_z = (pid_bh // H_Q).to(tl.int64)
    off_h = (pid_bh % H_Q).to(tl.int64)
    r_valid = offs_r < N_Q
    mask = r_valid[:, None] & (offs_c[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + off_z * stride_qz + off_h * stride_qh + offs_r[:, None] * stride_qm + offs_c[None, :],
                mask=mask, other=0.0).to(tl.float32)
    qbar = tl.load(qbar_ptr + pid_bh.to(tl.int64) * DP + offs_c)
    y = _fwht(tl.where(mask, q - qbar[None, :], 0.0), BLOCK_R, DP, LOG2_DP)
    mu, y = _column0(y, offs_c)
    codes, scale = _codes(y)
    tl.store(qc_ptr + off_z * stride_cz + off_h * stride_ch + offs_r[:, None] * stride_cm + offs_c[None, :], codes,
             mask=r_valid[:, None])
    row = off_z * stride_sz + off_h * stride_sh + offs_r
    tl.store(qs_ptr + row, scale, mask=r_valid)
    tl.store(mu_ptr + row, mu * (1.0 / DP), mask=r_valid)
    s2, y2 = _row_stats(scale, y)
    tl.store(qstat_ptr + task.to(tl.int64) * 2, s2)
    tl.store(qstat_ptr + task.to(tl.int64) * 2 + 1, y2)


@triton.jit
def _quantize_keys(k_ptr, v_ptr, qbar_ptr, v_inv_ptr, kc_ptr, ks_ptr, sig_ptr, au_ptr, c_ptr, v8_ptr, kstat_ptr,
                   bias_ptr, task, u,
                   stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
                   stride_cz, stride_ch, stride_cn, stride_sz, stride_sh, stride_az, stride_ah,
                   stride_oz, stride_oh, stride_oj, stride_v8z, stride_v8h, stride_v8d, stride_bz, stride_bh,
                   H_K, KV_GROUP, N_K, n_blocks,
                   HEAD_DIM: tl.constexpr, DP: tl.constexpr, LOG2_DP: tl.constexpr, BLOCK_R: tl.constexpr,
                   PV_FP8: tl.constexpr, BIAS: tl.constexpr, INTERPRET_BF16: tl.constexpr,
                   INTERPRET_FP8: tl.constexpr):
    """One block ``b`` of ``BLOCK_R`` (= the centre block) keys: ``c_b = round_g(round_fp32(colsum_fp64 /
    n_b))``, ``kc = k - c_b`` (fp32, 0 past ``N_K`` and ``HEAD_DIM``), ``w = fwht(kc)``, ``sigma = w[:, 0]``,
    ``w[:, 0] = 0``, :func:`_codes`; ``u A_h`` with ``A_h = fp32(sum_d fp64(fp32(qbar_h kc)))`` and ``u`` the fp32
    ``common.log2_units(scale)`` (as the portable attention kernel forms it from its argument) for each of the
    ``KV_GROUP`` query heads reading this key head (the bias term both attention kernels add); the block's means
    of ``s_k^2`` and ``|w|^2`` (fp64, the fallback's statistics, (B, Hk, blocks, 2)); with ``PV_FP8`` the block's
    V as ``e4m3(v (448 / amax))``, stored transposed (B, Hk, DP, Nk) for the ``P V`` dot; with ``BIAS`` each query
    head's bias rows of ``sigma`` and ``uA`` (:func:`_bias_rows`; ``uA`` read back after a barrier).  (A flagged
    block's keys are split into ``hi`` and ``lo`` by the attention kernels themselves.)"""
    pid_bh = task // n_blocks
    blk = task % n_blocks
    start = blk * BLOCK_R
    offs_r = start + tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, DP)
    off_z = (pid_bh // H_K).to(tl.int64)
    off_h = (pid_bh % H_K).to(tl.int64)
    r_valid = offs_r < N_K
    c_valid = offs_c < HEAD_DIM
    mask = r_valid[:, None] & c_valid[None, :]
    k_blk = tl.load(k_ptr + off_z * stride_kz + off_h * stride_kh + offs_r[:, None] * stride_kn + offs_c[None, :],
                    mask=mask, other=0.0)
    k32 = k_blk.to(tl.float32)
    n_b = tl.minimum(N_K - start, BLOCK_R)
    mean = (tl.sum(k32.to(tl.float64), axis=0) / n_b).to(tl.float32)
    c = round_to(mean, k_blk.dtype, INTERPRET_BF16).to(tl.float32)
    kc = tl.where(mask, k32 - c[None, :], 0.0)
    # A before the transform: kc need not outlive it, ~70 fewer registers at DP 128
    h_q0 = pid_bh * KV_GROUP  # (batch, first query head of the group) flattened: batch * H_Q + head
    for g in range(0, KV_GROUP):
        qbar = tl.load(qbar_ptr + (h_q0 + g).to(tl.int64) * DP + offs_c)
        a = tl.sum((kc * qbar[None, :]).to(tl.float64), axis=1).to(tl.float32)
        tl.store(au_ptr + off_z * stride_az + (off_h * KV_GROUP + g) * stride_ah + offs_r, a * u,
                 mask=r_valid)
    w = _fwht(kc, BLOCK_R, DP, LOG2_DP)
    sigma, w = _column0(w, offs_c)
    codes, scale = _codes(w)
    tl.store(kc_ptr + off_z * stride_cz + off_h * stride_ch + offs_r[:, None] * stride_cn + offs_c[None, :], codes,
             mask=r_valid[:, None])
    row = off_z * stride_sz + off_h * stride_sh + offs_r
    tl.store(ks_ptr + row, scale, mask=r_valid)
    tl.store(sig_ptr + row, sigma, mask=r_valid)
    if BIAS:
        tl.debug_barrier()  # the uA rows above, stored by other threads, are read back
        for g in range(0, KV_GROUP):
            h_q = off_h * KV_GROUP + g
            au = tl.load(au_ptr + off_z * stride_az + h_q * stride_ah + offs_r, mask=r_valid, other=0.0)
            tl.store(bias_ptr + off_z * stride_bz + h_q * stride_bh + offs_r[:, None] * BIAS_K
                     + tl.arange(0, BIAS_K)[None, :], _bias_rows(sigma, au, BLOCK_R, INTERPRET_BF16),
                     mask=r_valid[:, None])
    tl.store(c_ptr + off_z * stride_oz + off_h * stride_oh + blk * stride_oj + offs_c, c)
    s2, w2 = _row_stats(scale, w)
    tl.store(kstat_ptr + task.to(tl.int64) * 2, s2 / n_b)
    tl.store(kstat_ptr + task.to(tl.int64) * 2 + 1, w2 / n_b)
    if PV_FP8:
        v = tl.load(v_ptr + off_z * stride_vz + off_h * stride_vh + offs_r[:, None] * stride_vn + offs_c[None, :],
                    mask=mask, other=0.0).to(tl.float32)
        inv = tl.load(v_inv_ptr + pid_bh.to(tl.int64) * DP + offs_c)
        v8 = _to_e4m3(v * inv[None, :], INTERPRET_FP8)
        tl.store(v8_ptr + off_z * stride_v8z + off_h * stride_v8h + offs_c[None, :] * stride_v8d + offs_r[:, None],
                 v8, mask=r_valid[:, None])


@triton.jit(do_not_specialize=["N_Q", "N_K"])
def quantize_kernel(q_ptr, k_ptr, v_ptr, qbar_ptr, v_inv_ptr,
                    qc_ptr, qs_ptr, mu_ptr, qstat_ptr, kc_ptr, ks_ptr, sig_ptr, au_ptr, c_ptr, v8_ptr, kstat_ptr,
                    bias_ptr, u,
                    stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
                    stride_qcz, stride_qch, stride_qcm, stride_qsz, stride_qsh,
                    stride_kcz, stride_kch, stride_kcn, stride_ksz, stride_ksh, stride_az, stride_ah,
                    stride_oz, stride_oh, stride_oj, stride_v8z, stride_v8h, stride_v8d, stride_bz, stride_bh,
                    H_Q, H_K, N_Q, N_K, q_blocks, k_blocks, q_tasks,
                    HEAD_DIM: tl.constexpr, DP: tl.constexpr, LOG2_DP: tl.constexpr, BLOCK_R: tl.constexpr,
                    PV_FP8: tl.constexpr, BIAS: tl.constexpr, INTERPRET_BF16: tl.constexpr,
                    INTERPRET_FP8: tl.constexpr):
    """The fused pre-pass: programs ``[0, q_tasks)`` quantize one block of ``BLOCK_R`` queries each
    (:func:`_quantize_queries`), the rest one block of keys (and V, and with ``BIAS`` the bias rows) each
    (:func:`_quantize_keys`).  Grid: (B Hq ceil(Nq / BLOCK_R) + B Hk ceil(Nk / BLOCK_R),)."""
    pid = tl.program_id(0)
    if pid < q_tasks:
        _quantize_queries(q_ptr, qbar_ptr, qc_ptr, qs_ptr, mu_ptr, qstat_ptr, pid,
                          stride_qz, stride_qh, stride_qm, stride_qcz, stride_qch, stride_qcm, stride_qsz, stride_qsh,
                          H_Q, N_Q, q_blocks, HEAD_DIM, DP, LOG2_DP, BLOCK_R)
    else:
        _quantize_keys(k_ptr, v_ptr, qbar_ptr, v_inv_ptr, kc_ptr, ks_ptr, sig_ptr, au_ptr, c_ptr, v8_ptr, kstat_ptr,
                       bias_ptr, pid - q_tasks, u,
                       stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
                       stride_kcz, stride_kch, stride_kcn, stride_ksz, stride_ksh, stride_az, stride_ah,
                       stride_oz, stride_oh, stride_oj, stride_v8z, stride_v8h, stride_v8d, stride_bz, stride_bh,
                       H_K, H_Q // H_K, N_K, k_blocks, HEAD_DIM, DP, LOG2_DP, BLOCK_R, PV_FP8, BIAS,
                       INTERPRET_BF16, INTERPRET_FP8)


# ---- 4: the 16-bit blocks -------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["N_Q", "q_blocks", "k_blocks"])
def fallback_flags_kernel(qpart_ptr, qstat_ptr, kstat_ptr, flag_ptr, order_ptr, coded_ptr, tally_ptr, H_Q, KV_GROUP,
                          N_Q, q_blocks, k_blocks, scale, TAU: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr):
    """Which key blocks one (batch, query head) computes in 16 bits (``reference_int8`` step 4b), and the order
    in which the attention kernels visit its blocks (step 4c, ``reference_int8.block_order``).

    ``SQ2, Y2`` = the query blocks' partial sums (fp64) added in block order, over ``N_Q`` (stored to
    ``qstat`` (B, Hq, 2)); per key block ``b`` of its key head (``kstat`` (B, Hk, blocks, 2): ``SK2_b``,
    ``W2_b``): ``flag_b = SQ2 W2_b + SK2_b Y2 > 12 t^2``, ``t = (tau DP) / scale`` in fp64 from the fp32
    values of ``TAU`` and ``scale``, stored as int8 into ``flag`` (B, Hq, blocks); the blocks and the flagged
    ones are added atomically to ``tally`` (int64 ``[blocks, in 16 bits]``, the caller's).  Then a second
    pass places each block: ``order`` (B, Hq, blocks) int32 holds the coded blocks ascending, then the
    flagged ones ascending (a block's place is the count of its kind before it, by ``tl.cumsum``), and
    ``coded`` (B, Hq) int32 how many are coded.  Grid: (B x Hq,)."""
    pid_bh = tl.program_id(0).to(tl.int64)
    sq2 = tl.zeros([], tl.float64)
    y2 = tl.zeros([], tl.float64)
    for blk in range(0, q_blocks):
        sq2 += tl.load(qpart_ptr + (pid_bh * q_blocks + blk) * 2)
        y2 += tl.load(qpart_ptr + (pid_bh * q_blocks + blk) * 2 + 1)
    sq2 = sq2 / N_Q
    y2 = y2 / N_Q
    tl.store(qstat_ptr + pid_bh * 2, sq2)
    tl.store(qstat_ptr + pid_bh * 2 + 1, y2)
    t = tl.full([], TAU, tl.float32).to(tl.float64) * DP / (scale + tl.zeros([], tl.float32)).to(tl.float64)
    threshold = 12.0 * t * t
    kv_bh = (pid_bh // H_Q) * (H_Q // KV_GROUP) + (pid_bh % H_Q) // KV_GROUP
    flagged = tl.zeros([], tl.int32)
    for start in range(0, k_blocks, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < k_blocks
        sk2 = tl.load(kstat_ptr + (kv_bh * k_blocks + offs) * 2, mask=valid, other=0.0)
        w2 = tl.load(kstat_ptr + (kv_bh * k_blocks + offs) * 2 + 1, mask=valid, other=0.0)
        flag = ((sq2 * w2 + sk2 * y2) > threshold) & valid
        tl.store(flag_ptr + pid_bh * k_blocks + offs, flag.to(tl.int8), mask=valid)
        flagged += tl.sum(flag.to(tl.int32), axis=0)
    coded = k_blocks - flagged
    tl.store(coded_ptr + pid_bh, coded)
    tl.atomic_add(tally_ptr, k_blocks + tl.zeros([], tl.int64))
    tl.atomic_add(tally_ptr + 1, flagged.to(tl.int64))
    coded_before = tl.zeros([], tl.int32)
    flagged_before = tl.zeros([], tl.int32)
    for start in range(0, k_blocks, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < k_blocks
        flag = tl.load(flag_ptr + pid_bh * k_blocks + offs, mask=valid, other=0).to(tl.int32)
        is_coded = (1 - flag) * valid.to(tl.int32)
        place = tl.where(flag != 0, coded + flagged_before + tl.cumsum(flag, axis=0) - 1,
                         coded_before + tl.cumsum(is_coded, axis=0) - 1)
        tl.store(order_ptr + pid_bh * k_blocks + place, offs, mask=valid)
        coded_before += tl.sum(is_coded, axis=0)
        flagged_before += tl.sum(flag, axis=0)


class Prepared(NamedTuple):
    """The pre-pass's outputs (:func:`prepare`), as ``reference_int8``'s quantizers write them.

    ``q_codes`` (B, Hq, Nq, DP) int8, ``q_scale``, ``mu`` (B, Hq, Nq) fp32, ``qbar`` (B, Hq, DP) fp32;
    ``k_codes`` (B, Hk, Nk, DP) int8, ``k_scale``, ``sigma`` (B, Hk, Nk) fp32, ``au`` (B, Hq, Nk) fp32 (``u A``, the bias
    term in log2 units of ``reference_int8``; views
    of rows padded to a multiple of 4 keys),
    ``centres`` (B, Hk, blocks, DP) fp32; ``v`` the values ``P V`` reads: the input V (16 bits) or V8^T
    (B, Hk, DP, Nk) e4m3 (a view of rows padded to 16 keys: the Gluon kernel copies its tiles by TMA), with
    ``v_scale`` (B, Hk, DP) fp32 (None in 16 bits).  The 16-bit blocks: ``k``
    the input keys (a flagged block reads them), ``q_stats`` (B, Hq, 2) and ``k_stats`` (B, Hk, blocks, 2)
    fp64 (``reference_int8``'s ``stats``), ``flags`` (B, Hq, blocks) int8 (1: in 16 bits; None: every block
    from the codes) with ``order`` (B, Hq, blocks) int32 and ``coded`` (B, Hq) int32 (``reference_int8.block_order``:
    the coded blocks ascending, then the flagged ones; None with ``flags``).  ``bias`` (B, Hq, Nk, 16) bf16 (rows
    padded as ``au``'s), written where asked (``bias=True``; else None): per key the bf16 parts of ``sigma`` and
    ``uA`` that the Gluon kernel adds to its logits in one tensor-core product (``quantize._bias_rows``)."""

    q_codes: torch.Tensor
    q_scale: torch.Tensor
    mu: torch.Tensor
    qbar: torch.Tensor
    k_codes: torch.Tensor
    k_scale: torch.Tensor
    sigma: torch.Tensor
    au: torch.Tensor
    centres: torch.Tensor
    v: torch.Tensor
    v_scale: torch.Tensor | None
    k: torch.Tensor
    q_stats: torch.Tensor
    k_stats: torch.Tensor
    flags: torch.Tensor | None
    order: torch.Tensor | None
    coded: torch.Tensor | None
    bias: torch.Tensor | None


def _prepass_warps(dp: int) -> int:
    """Warps of the pre-pass programs: 8 up to DP = 128, 16 above (the fewest without spills at DP 128, and
    faster than 16 there: docs/notes/int8_kernel.md)."""
    return 8 if dp <= 128 else 16


class Scratch(NamedTuple):
    """The statistics between the pre-pass's launches: ``q_part`` (B Hq, query blocks, DP) fp64 column sums;
    ``q_stat_part`` (B Hq, query blocks, 2) fp64 per block ``(sum s_q^2, sum |y|^2)``; with FP8 ``P V``
    ``v_part`` (B Hk, key blocks, DP) fp32 column maxima and ``v_inv`` (B, Hk, DP) fp32 ``448 / amax``
    (None in 16 bits)."""

    q_part: torch.Tensor
    q_stat_part: torch.Tensor
    v_part: torch.Tensor | None
    v_inv: torch.Tensor | None


def allocate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, pv_bits: int = 16,
             fallback: bool = True, bias: bool = False) -> tuple[Prepared, Scratch]:
    """Empty pre-pass outputs and statistics for these inputs, on their device (``meta`` too); ``bias``: the
    Gluon kernel's bias rows too."""
    batch, h_q, n_q, d = q.shape
    h_k, n_k = k.shape[1], k.shape[2]
    dp = max(32, pow2_tile(d))  # reference_int8.rotation_size: an INT8 MMA reduces over 32
    dev, f32 = q.device, torch.float32
    q_blocks, k_blocks = cdiv(n_q, SHIFT_BLOCK), cdiv(n_k, SHIFT_BLOCK)
    fp8 = pv_bits == 8

    def empty(*shape, dtype=f32):
        return torch.empty(shape, dtype=dtype, device=dev)

    n_row = -(-n_k // 4) * 4  # rows padded to 16 bytes: the Gluon kernel copies tiles of them by TMA

    def per_key(heads):
        return empty(batch, heads, n_row)[..., :n_k]

    prep = Prepared(
        q_codes=empty(batch, h_q, n_q, dp, dtype=torch.int8), q_scale=empty(batch, h_q, n_q), mu=empty(batch, h_q, n_q),
        qbar=empty(batch, h_q, dp), k_codes=empty(batch, h_k, n_k, dp, dtype=torch.int8),
        k_scale=per_key(h_k), sigma=per_key(h_k), au=per_key(h_q),
        centres=empty(batch, h_k, k_blocks, dp),
        v=empty(batch, h_k, dp, -(-n_k // 16) * 16, dtype=torch.float8_e4m3fn)[..., :n_k] if fp8 else v,
        v_scale=empty(batch, h_k, dp) if fp8 else None, k=k, q_stats=empty(batch, h_q, 2, dtype=torch.float64),
        k_stats=empty(batch, h_k, k_blocks, 2, dtype=torch.float64),
        flags=empty(batch, h_q, k_blocks, dtype=torch.int8) if fallback else None,
        order=empty(batch, h_q, k_blocks, dtype=torch.int32) if fallback else None,
        coded=empty(batch, h_q, dtype=torch.int32) if fallback else None,
        bias=empty(batch, h_q, n_row, BIAS_K.value, dtype=torch.bfloat16)[:, :, :n_k] if bias else None)
    scratch = Scratch(empty(batch * h_q, q_blocks, dp, dtype=torch.float64),
                      empty(batch * h_q, q_blocks, 2, dtype=torch.float64),
                      empty(batch * h_k, k_blocks, dp) if fp8 else None, empty(batch, h_k, dp) if fp8 else None)
    return prep, scratch


def written_bytes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, pv_bits: int = 16,
                  fallback: bool = True, bias: bool = False) -> int:
    """The bytes :func:`prepare` allocates for these inputs (the storage of :func:`allocate`'s tensors, the inputs it
    passes through not counted), read from an allocation on the ``meta`` device."""
    meta = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in (q, k, v)]
    prep, scratch = allocate(*meta, pv_bits=pv_bits, fallback=fallback, bias=bias)
    written = (t for t in (*prep, *scratch) if t is not None and all(t is not given for given in meta))
    return sum(t.untyped_storage().nbytes() for t in written)


def quantize_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prep: Prepared, scratch: Scratch, *,
                  scale: float) -> tuple[tuple[int], tuple, dict]:
    """``(grid, args, meta)`` of :func:`quantize_kernel` (launch 3) writing ``prep``."""
    batch, h_q, n_q, d = q.shape
    h_k, n_k = k.shape[1], k.shape[2]
    dp = prep.k_codes.shape[-1]
    fp8 = prep.v_scale is not None
    q_blocks, k_blocks = cdiv(n_q, SHIFT_BLOCK), cdiv(n_k, SHIFT_BLOCK)
    v8 = prep.v if fp8 else prep.k_codes  # unread in 16 bits
    v_inv = scratch.v_inv if fp8 else prep.qbar
    bias = prep.bias if prep.bias is not None else prep.au  # unread without
    q_tasks = batch * h_q * q_blocks
    args = (q, k, v, prep.qbar, v_inv, prep.q_codes, prep.q_scale, prep.mu, scratch.q_stat_part, prep.k_codes,
            prep.k_scale, prep.sigma, prep.au, prep.centres, v8, prep.k_stats, bias,
            log2_units(scale),
            *strides3(q), *strides3(k), *strides3(v), *strides3(prep.q_codes), *prep.q_scale.stride()[:2],
            *strides3(prep.k_codes), *prep.k_scale.stride()[:2], *prep.au.stride()[:2], *strides3(prep.centres),
            *strides3(v8), *bias.stride()[:2], h_q, h_k, n_q, n_k, q_blocks, k_blocks, q_tasks)
    meta = dict(HEAD_DIM=d, DP=dp, LOG2_DP=dp.bit_length() - 1, BLOCK_R=SHIFT_BLOCK, PV_FP8=fp8,
                BIAS=prep.bias is not None,
                INTERPRET_BF16=INTERPRET and q.dtype == torch.bfloat16, INTERPRET_FP8=INTERPRET,
                num_warps=_prepass_warps(dp))
    return (q_tasks + batch * h_k * k_blocks,), args, meta


def flags_call(prep: Prepared, scratch: Scratch, *, scale: float, tally: torch.Tensor) -> tuple[tuple[int], tuple, dict]:
    """``(grid, args, meta)`` of :func:`fallback_flags_kernel` (launch 4) writing ``prep.flags``, ``prep.order``,
    ``prep.coded`` and ``prep.q_stats``, counting into ``tally``."""
    batch, h_q = prep.q_scale.shape[:2]
    k_blocks = prep.k_stats.shape[2]
    args = (scratch.q_stat_part, prep.q_stats, prep.k_stats, prep.flags, prep.order, prep.coded, tally, h_q, h_q // prep.k_codes.shape[1],
            prep.q_scale.shape[2], scratch.q_stat_part.shape[1], k_blocks, float(scale))
    meta = dict(TAU=INT8_FALLBACK_TAU, DP=prep.k_codes.shape[-1], BLOCK=min(1024, triton.next_power_of_2(k_blocks)))
    return (batch * h_q,), args, meta


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, pv_bits: int = 16,
            fallback: bool = True, bias: bool = False, tally: torch.Tensor | None = None) -> Prepared:
    """The pre-pass (launches 1-4 of the module docstring) for (B, H, N, D) q, k, v with unit stride in D;
    ``fallback``: which key blocks go to 16 bits at this ``scale`` (launch 4), their count added to ``tally``
    (an int64 ``[blocks, blocks in 16 bits]`` tensor on q's device: the caller's, ``dispatch.forward`` passes
    ``block_tally``'s; ``None``: a counter of this call alone); ``bias``: the Gluon kernel's bias rows
    (``Prepared.bias``) too."""
    batch, h_q, n_q, d = q.shape
    h_k, n_k = k.shape[1], k.shape[2]
    prep, scratch = allocate(q, k, v, pv_bits=pv_bits, fallback=fallback, bias=bias)
    dp = prep.k_codes.shape[-1]
    bf16 = q.dtype == torch.bfloat16
    warps = _prepass_warps(dp)
    q_blocks, k_blocks = scratch.q_part.shape[1], prep.centres.shape[2]
    kept_launch(colstats_kernel, (batch * h_q, q_blocks), (q, scratch.q_part, *strides3(q), h_q, n_q, q_blocks),
                dict(HEAD_DIM=d, DP=dp, BLOCK_R=SHIFT_BLOCK, AMAX=False, num_warps=warps))
    kept_launch(colstats_reduce_kernel, (batch * h_q,), (scratch.q_part, prep.qbar, prep.qbar, n_q, q_blocks),
                dict(DP=dp, AMAX=False, G_BF16=bf16, INTERPRET_BF16=INTERPRET and bf16))
    if prep.v_scale is not None:
        kept_launch(colstats_kernel, (batch * h_k, k_blocks), (v, scratch.v_part, *strides3(v), h_k, n_k, k_blocks),
                    dict(HEAD_DIM=d, DP=dp, BLOCK_R=SHIFT_BLOCK, AMAX=True, num_warps=warps))
        kept_launch(colstats_reduce_kernel, (batch * h_k,),
                    (scratch.v_part, prep.v_scale, scratch.v_inv, n_k, k_blocks),
                    dict(DP=dp, AMAX=True, G_BF16=bf16, INTERPRET_BF16=INTERPRET and bf16))
    kept_launch(quantize_kernel, *quantize_call(q, k, v, prep, scratch, scale=scale))
    if fallback:
        if tally is None:
            tally = torch.zeros(2, dtype=torch.int64, device=q.device)
        kept_launch(fallback_flags_kernel, *flags_call(prep, scratch, scale=scale, tally=tally))
    return prep
