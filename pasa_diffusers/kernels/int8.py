"""The exact shift in 8 bits: the pre-pass and attention kernels of ``precision="int8"``, portable Triton.

They compute ``reference_int8.int8_reference`` (its module docstring states the math and why each step)
on any CUDA GPU Triton supports with INT8 ``tl.dot`` (sm_80+; FP8 ``P V`` needs sm_89+), and on CPU
tensors under ``TRITON_INTERPRET=1``.  Five launches per call: four of the pre-pass (:func:`prepare`), whose
outputs both 8-bit attention kernels read, and this file's attention kernel (:func:`attend`; the
``portable-int8`` kernel of ``dispatch.plan``, which chooses between it and ``hopper_int8.py``'s):

1. :func:`colstats_kernel`: per block of ``BLOCK_R`` rows, the column sums of q (fp64) and, for FP8
   ``P V``, the column maxima of ``|v|``;
2. :func:`colstats_reduce_kernel`: those partials reduced in a fixed order: ``qbar =
   round_g(round_fp32(sum / Nq))`` per (batch, query head), and V's per-channel ``vs = amax / 448``,
   ``448 / amax``;
3. :func:`quantize_kernel`, the fused pre-pass: one program per block of 128 queries (smoothing,
   rotation, INT8 codes) or 128 keys (centre, rotation, codes, the exact corrections ``sigma``, ``A``;
   V to e4m3 for FP8 ``P V``);
4. :func:`fallback_flags_kernel`: the query statistics reduced, and per (batch, query head) which key
   blocks go to 16 bits (``reference_int8`` step 4b), counted into the caller's counter (left out with
   ``fallback=False``);
5. :func:`int8_fwd_kernel`, the attention: INT8 ``q k^T`` with int32 sums, the removed logits added in
   fp32 (a flagged block: ``q . (k - c_b)`` by two 16-bit MMAs instead), online softmax in fp32, ``P V``
   in the GEMM dtype or FP8 (``PV_FP8``).

Head dims are padded to ``DP``, a power of two >= 32 (an INT8 MMA reduces over 32).  Every rounding of
the pre-pass is the spec's, bit for bit: column sums in fp64 (exact for fp16 values, so their order does
not matter), the Hadamard transform by the same butterflies (additions only), IEEE divisions
(``div_rn``), codes as rounded quotients (a product would be contracted into the rounding's addition by
the GPU compiler alone), round-to-nearest-even by the 1.5 * 2^23 trick (exact for ``|x| < 2^22``).  The
attention kernel rounds where the spec does but contracts products into FMAs and sums in its own order,
so it matches the spec to fp32 rounding, not bit for bit.

``PV_FP8`` multiplies the e4m3 values of ``P`` and ``V`` widened to fp16 (:func:`_merge`).  The
interpreter's fp32 -> e4m3 conversion drops the carry of a rounding that crosses a power of two, so
there values are first rounded onto e4m3's grid in fp32 (:func:`_to_e4m3`).  bf16 goes through
``common.round_to`` / ``common.mma`` there as in the other kernels.  The measurements behind the configs and
the design choices below are in docs/notes/int8_kernel.md.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..rules import INT8_FALLBACK_TAU, SHIFT_BLOCK
from .common import INTERPRET, LN2, LOG2E, P_SHIFT, binade, cdiv, log2_units, mma, round_to, strides3
from .tuning import SMEM_LIMIT, autotuned, bucket, interpreter_autotunes, pow2_tile

__all__ = ["colstats_kernel", "colstats_reduce_kernel", "quantize_kernel", "fallback_flags_kernel", "int8_fwd_kernel",
           "Prepared", "Scratch", "allocate", "quantize_call", "flags_call", "prepare", "attention_call", "attend",
           "INTERPRET_CONFIG", "CONFIG_POOL", "PV_BITS"]

PV_BITS = (16, 8)
"""What ``P V`` takes: the inputs' dtype (16) or FP8 e4m3 (8)."""
QMAX = tl.constexpr(127.0)
FP8_MAX = tl.constexpr(448.0)
RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23


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
                   split_ptr, task, u,
                   stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
                   stride_cz, stride_ch, stride_cn, stride_sz, stride_sh, stride_az, stride_ah,
                   stride_oz, stride_oh, stride_oj, stride_v8z, stride_v8h, stride_v8d, split_half,
                   H_K, KV_GROUP, N_K, n_blocks,
                   HEAD_DIM: tl.constexpr, DP: tl.constexpr, LOG2_DP: tl.constexpr, BLOCK_R: tl.constexpr,
                   PV_FP8: tl.constexpr, SPLIT: tl.constexpr, INTERPRET_BF16: tl.constexpr,
                   INTERPRET_FP8: tl.constexpr):
    """One block ``b`` of ``BLOCK_R`` (= the centre block) keys: ``c_b = round_g(round_fp32(colsum_fp64 /
    n_b))``, ``kc = k - c_b`` (fp32, 0 past ``N_K`` and ``HEAD_DIM``), ``w = fwht(kc)``, ``sigma = w[:, 0]``,
    ``w[:, 0] = 0``, :func:`_codes`; ``u A_h`` with ``A_h = fp32(sum_d fp64(fp32(qbar_h kc)))`` and ``u`` the fp32
    ``common.log2_units(scale)`` (as the portable attention kernel forms it from its argument) for each of the ``KV_GROUP`` query heads reading this key
    head (the bias term both attention kernels add as is); the block's means of ``s_k^2`` and ``|w|^2`` (fp64, the
    fallback's statistics, (B, Hk, blocks, 2)); with ``PV_FP8`` the block's V as ``e4m3(v (448 / amax))``,
    stored transposed (B, Hk, DP, Nk) for the ``P V`` dot; with ``SPLIT`` the 16-bit blocks' keys ``hi =
    round_g(kc)``, ``lo = round_g(kc - hi)`` (``g``; (2, B, Hk, Nk, DP) contiguous, ``split_half`` elements
    apart) for the Gluon kernel, which reads its operands from memory (the portable one splits in place)."""
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
    # A before the transform: kc need not outlive it (unless SPLIT), ~70 fewer registers at DP 128
    h_q0 = pid_bh * KV_GROUP  # (batch, first query head of the group) flattened: batch * H_Q + head
    for g in range(0, KV_GROUP):
        qbar = tl.load(qbar_ptr + (h_q0 + g).to(tl.int64) * DP + offs_c)
        a = tl.sum((kc * qbar[None, :]).to(tl.float64), axis=1).to(tl.float32)
        tl.store(au_ptr + off_z * stride_az + (off_h * KV_GROUP + g) * stride_ah + offs_r, a * u,
                 mask=r_valid)
    w = _fwht(kc, BLOCK_R, DP, LOG2_DP)
    if SPLIT:
        hi, lo = _split(kc, k_blk.dtype, INTERPRET_BF16)
        split = split_ptr + (pid_bh.to(tl.int64) * N_K + offs_r[:, None]) * DP + offs_c[None, :]
        tl.store(split, hi, mask=r_valid[:, None])
        tl.store(split + split_half, lo, mask=r_valid[:, None])
    sigma, w = _column0(w, offs_c)
    codes, scale = _codes(w)
    tl.store(kc_ptr + off_z * stride_cz + off_h * stride_ch + offs_r[:, None] * stride_cn + offs_c[None, :], codes,
             mask=r_valid[:, None])
    row = off_z * stride_sz + off_h * stride_sh + offs_r
    tl.store(ks_ptr + row, scale, mask=r_valid)
    tl.store(sig_ptr + row, sigma, mask=r_valid)
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
                    split_ptr, u,
                    stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
                    stride_qcz, stride_qch, stride_qcm, stride_qsz, stride_qsh,
                    stride_kcz, stride_kch, stride_kcn, stride_ksz, stride_ksh, stride_az, stride_ah,
                    stride_oz, stride_oh, stride_oj, stride_v8z, stride_v8h, stride_v8d, split_half,
                    H_Q, H_K, N_Q, N_K, q_blocks, k_blocks, q_tasks,
                    HEAD_DIM: tl.constexpr, DP: tl.constexpr, LOG2_DP: tl.constexpr, BLOCK_R: tl.constexpr,
                    PV_FP8: tl.constexpr, SPLIT: tl.constexpr, INTERPRET_BF16: tl.constexpr,
                    INTERPRET_FP8: tl.constexpr):
    """The fused pre-pass: programs ``[0, q_tasks)`` quantize one block of ``BLOCK_R`` queries each
    (:func:`_quantize_queries`), the rest one block of keys (and V) each (:func:`_quantize_keys`).  Grid:
    (B Hq ceil(Nq / BLOCK_R) + B Hk ceil(Nk / BLOCK_R),)."""
    pid = tl.program_id(0)
    if pid < q_tasks:
        _quantize_queries(q_ptr, qbar_ptr, qc_ptr, qs_ptr, mu_ptr, qstat_ptr, pid,
                          stride_qz, stride_qh, stride_qm, stride_qcz, stride_qch, stride_qcm, stride_qsz, stride_qsh,
                          H_Q, N_Q, q_blocks, HEAD_DIM, DP, LOG2_DP, BLOCK_R)
    else:
        _quantize_keys(k_ptr, v_ptr, qbar_ptr, v_inv_ptr, kc_ptr, ks_ptr, sig_ptr, au_ptr, c_ptr, v8_ptr, kstat_ptr,
                       split_ptr, pid - q_tasks, u,
                       stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
                       stride_kcz, stride_kch, stride_kcn, stride_ksz, stride_ksh, stride_az, stride_ah,
                       stride_oz, stride_oh, stride_oj, stride_v8z, stride_v8h, stride_v8d, split_half,
                       H_K, H_Q // H_K, N_K, k_blocks, HEAD_DIM, DP, LOG2_DP, BLOCK_R, PV_FP8, SPLIT,
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


# ---- 5: the attention kernel ----------------------------------------------------------------------------

@triton.jit
def _coded_logits(q_codes, a_i, mu_u, kc_base, ks_base, sig_base, au_base, stride_kcn, offs_n, n_valid, offs_c,
                  MASKED: tl.constexpr):
    """``z = (I ks_j) a_i + (mu_u_i sigma_j + uA_j)`` with ``I = Q K^T`` (int8 x int8 -> exact int32); ``uA_j =
    qk_scale A_j`` from the pre-pass."""
    if MASKED:
        k_codes = tl.load(kc_base + offs_n[:, None] * stride_kcn + offs_c[None, :], mask=n_valid[:, None], other=0)
        ks = tl.load(ks_base + offs_n, mask=n_valid, other=0.0)
        sig = tl.load(sig_base + offs_n, mask=n_valid, other=0.0)
        ua_j = tl.load(au_base + offs_n, mask=n_valid, other=0.0)
    else:
        k_codes = tl.load(kc_base + offs_n[:, None] * stride_kcn + offs_c[None, :])
        ks = tl.load(ks_base + offs_n)
        sig = tl.load(sig_base + offs_n)
        ua_j = tl.load(au_base + offs_n)
    i_sum = tl.dot(q_codes, tl.trans(k_codes))  # int32
    return (i_sum.to(tl.float32) * ks[None, :]) * a_i[:, None] + (mu_u[:, None] * sig[None, :] + ua_j[None, :])


@triton.jit
def _logits_16(q, k_base, stride_kn, c_b, offs_n, n_valid, offs_d, d_valid, qk_scale, MASKED: tl.constexpr,
               INTERPRET_BF16: tl.constexpr):
    """A 16-bit block's ``z = qk_scale fp32(q . hi + q . lo)``: ``kc = k - c_b`` (fp32) split into ``hi =
    round_g(kc)`` and ``lo = round_g(kc - hi)``, two ``g`` MMAs into one fp32 accumulator."""
    k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]
    if MASKED:
        k_blk = tl.load(k_ptrs, mask=n_valid[:, None] & d_valid[None, :], other=0.0)
    else:
        k_blk = tl.load(k_ptrs, mask=d_valid[None, :], other=0.0)
    hi, lo = _split(k_blk.to(tl.float32) - c_b[None, :], q.dtype, INTERPRET_BF16)
    s = mma(q, tl.trans(hi), tl.zeros([q.shape[0], offs_n.shape[0]], tl.float32), INTERPRET_BF16)
    return mma(q, tl.trans(lo), s, INTERPRET_BF16) * qk_scale


@triton.jit
def _logits(q_codes, q, a_i, mu_u, m_i, kc_base, ks_base, sig_base, au_base, c_base, k_base, stride_kcn,
            stride_cj, stride_kn, start_n, offs_j, offs_c, offs_d, d_valid, N_K, qk_scale,
            BLOCK_N: tl.constexpr, CENTRE_BLOCK_: tl.constexpr, SIXTEEN: tl.constexpr, MASKED: tl.constexpr,
            INTERPRET_BF16: tl.constexpr):
    """Block ``b``'s logits in log2 units (``reference_int8`` steps 4 and 4b):

        z     = from the codes (:func:`_coded_logits`), or in 16 bits in a flagged block (``SIXTEEN``,
                :func:`_logits_16`)
        r     = qk_scale fp32(q . c_b)                   (per row; exact products of g values summed in fp32,
                                                          by a (BLOCK_D x 16) MMA with c_b in column 0)
        m_s   = rowmax z,  m_blk = m_s + r,  m_new = max(m_i, m_blk)
        x     = z - (m_s - (m_blk - m_new)),  alpha = exp2(m_i - m_new)

    ``z + r`` is ``qk_scale q . k`` up to the codes' rounding (or fp32's, in 16 bits); the offset goes through
    the tile's own maximum ``m_s`` so that ``r``'s fp32 rounding (``r`` reaches 1e4 for biased inputs: 1e-3)
    does not enter every exponent."""
    offs_n = start_n + offs_j
    n_valid = offs_n < N_K
    c_b = tl.load(c_base + (start_n // CENTRE_BLOCK_) * stride_cj + offs_d, mask=d_valid, other=0.0)
    c_mat = tl.where(tl.arange(0, 16)[None, :] == 0, c_b[:, None], 0.0).to(q.dtype)  # c_b in column 0
    r = tl.sum(mma(q, c_mat, tl.zeros([q.shape[0], 16], tl.float32), INTERPRET_BF16), axis=1) * qk_scale
    if SIXTEEN:
        z = _logits_16(q, k_base, stride_kn, c_b, offs_n, n_valid, offs_d, d_valid, qk_scale, MASKED, INTERPRET_BF16)
    else:
        z = _coded_logits(q_codes, a_i, mu_u, kc_base, ks_base, sig_base, au_base, stride_kcn, offs_n, n_valid, offs_c,
                          MASKED)
    if MASKED:
        z = tl.where(n_valid[None, :], z, float("-inf"))
    m_s = tl.max(z, axis=1)
    m_blk = m_s + r
    m_new = tl.maximum(m_i, m_blk)
    x = z - (m_s - (m_blk - m_new))[:, None]
    alpha = tl.math.exp2(m_i - m_new)
    return x, alpha, m_new, offs_n, n_valid


@triton.jit
def _merge(acc, l_i, x, alpha, v_base, v8_base, vs, stride_vn, stride_v8d, offs_n, n_valid, offs_d, d_valid,
           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PV_FP8: tl.constexpr, INTERPRET_FP8: tl.constexpr,
           MASKED: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """``P V`` (``reference_int8`` step 5).  16 bits: ``p = round_g(exp2(x))``, ``l_i = alpha l_i +
    rowsum(exp2(x))`` (the fp32 values before their rounding), ``acc = alpha acc + p V`` (fp32).  FP8: ``P8 =
    e4m3(exp2(x + 8))``, ``l_i`` sums ``exp2(x + 8)`` unrounded, ``acc = alpha acc + (P8 V8) vs`` with the
    tile's ``P8 V8`` in its own fp32 accumulator, V8 read transposed (DP, BLOCK_N).  ``P8 V8`` multiplies the
    e4m3 values widened to fp16 (exact: every e4m3 value is an fp16 one; exact products, fp32 sums): the FP8
    design's numbers at the 16-bit MMA's rate (why not the FP8 MMA itself: docs/notes/int8_kernel.md)."""
    if PV_FP8:
        if MASKED:
            v8t = tl.load(v8_base + offs_d[:, None] * stride_v8d + offs_n[None, :], mask=n_valid[None, :], other=0.0)
        else:
            v8t = tl.load(v8_base + offs_d[:, None] * stride_v8d + offs_n[None, :])
        p32 = tl.math.exp2(x + P_SHIFT)
        p8 = _to_e4m3(p32, INTERPRET_FP8)
        l_i = alpha * l_i + tl.sum(p32, axis=1)
        pv = tl.dot(p8.to(tl.float16), tl.trans(v8t.to(tl.float16)))
        acc = acc * alpha[:, None] + pv * vs[None, :]
    else:
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]
        if MASKED:
            if BLOCK_D == HEAD_DIM:
                v_blk = tl.load(v_ptrs, mask=n_valid[:, None], other=0.0)
            else:
                v_blk = tl.load(v_ptrs, mask=n_valid[:, None] & d_valid[None, :], other=0.0)
        elif BLOCK_D == HEAD_DIM:
            v_blk = tl.load(v_ptrs)
        else:
            v_blk = tl.load(v_ptrs, mask=d_valid[None, :], other=0.0)
        p32 = tl.math.exp2(x)
        p = round_to(p32, v_blk.dtype, INTERPRET_BF16)
        l_i = alpha * l_i + tl.sum(p32, axis=1)
        acc = mma(p, v_blk, acc * alpha[:, None], INTERPRET_BF16)
    return acc, l_i


@triton.jit
def _tile_start(order_base, first, j, BLOCK_N: tl.constexpr, CENTRE_BLOCK_: tl.constexpr, FALLBACK: tl.constexpr):
    """The first key of the ``j``-th tile of a pass: in the block ``order[first + j // (CENTRE_BLOCK_ / BLOCK_N)]``
    with ``FALLBACK`` (``reference_int8.block_order``), else the ``j``-th tile of the keys."""
    if FALLBACK:
        per_block: tl.constexpr = CENTRE_BLOCK_ // BLOCK_N
        blk = tl.load(order_base + first + j // per_block)
        return blk * CENTRE_BLOCK_ + (j % per_block) * BLOCK_N
    return j * BLOCK_N


@triton.jit
def _attn_inner(acc, l_i, m_i, q_codes, q, a_i, mu_u, kc_base, ks_base, sig_base, au_base, c_base, k_base, order_base,
                v_base, v8_base, vs, stride_kcn, stride_cj, stride_kn, stride_vn, stride_v8d, first, lo, hi, N_K,
                offs_j, offs_c, offs_d, d_valid, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_N: tl.constexpr, CENTRE_BLOCK_: tl.constexpr, FALLBACK: tl.constexpr, SIXTEEN: tl.constexpr,
                PV_FP8: tl.constexpr, INTERPRET_FP8: tl.constexpr, MASKED: tl.constexpr,
                INTERPRET_BF16: tl.constexpr):
    """Tiles ``lo .. hi - 1`` of one pass (:func:`_tile_start`): :func:`_logits`, then :func:`_merge`."""
    for j in range(lo, hi):
        start_n = _tile_start(order_base, first, j, BLOCK_N, CENTRE_BLOCK_, FALLBACK)
        x, alpha, m_new, offs_n, n_valid = _logits(
            q_codes, q, a_i, mu_u, m_i, kc_base, ks_base, sig_base, au_base, c_base, k_base, stride_kcn,
            stride_cj, stride_kn, start_n, offs_j, offs_c, offs_d, d_valid, N_K, qk_scale, BLOCK_N, CENTRE_BLOCK_,
            SIXTEEN, MASKED, INTERPRET_BF16)
        acc, l_i = _merge(acc, l_i, x, alpha, v_base, v8_base, vs, stride_vn, stride_v8d, offs_n, n_valid, offs_d,
                          d_valid, HEAD_DIM, BLOCK_D, PV_FP8, INTERPRET_FP8, MASKED, INTERPRET_BF16)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def tile_counts(flag_base, coded_ptr, N_K, BLOCK_N: tl.constexpr, CENTRE_BLOCK_: tl.constexpr,
                FALLBACK: tl.constexpr):
    """``(coded blocks, coded tiles, 16-bit tiles, full coded tiles, full 16-bit tiles)`` of one (batch, query
    head) at ``BLOCK_N``-key tiles: the passes of step 4c.  The last block may hold fewer tiles (``short``), and
    a ragged last tile (``N_K % BLOCK_N``) is the last of its pass, so each pass is its full tiles, then at
    most one masked one."""
    n_tiles = tl.cdiv(N_K, BLOCK_N)
    ragged = (N_K % BLOCK_N != 0).to(tl.int32)
    if FALLBACK:
        n_blocks = tl.cdiv(N_K, CENTRE_BLOCK_)
        per_block: tl.constexpr = CENTRE_BLOCK_ // BLOCK_N
        coded_blocks = tl.load(coded_ptr)
        last_flagged = tl.load(flag_base + n_blocks - 1).to(tl.int32)
        short = per_block * n_blocks - n_tiles
        coded = coded_blocks * per_block - short * (1 - last_flagged)
        sixteen = (n_blocks - coded_blocks) * per_block - short * last_flagged
        return coded_blocks, coded, sixteen, coded - ragged * (1 - last_flagged), sixteen - ragged * last_flagged
    return n_tiles, n_tiles, 0, n_tiles - ragged, 0


@triton.jit(do_not_specialize=["N_Q", "N_K"])
def int8_fwd_kernel(
    q_ptr, qc_ptr, qs_ptr, mu_ptr, kc_ptr, ks_ptr, sig_ptr, a_ptr, c_ptr, k_ptr, flag_ptr, order_ptr, coded_ptr, v_ptr,
    v8_ptr, vs_ptr, o_ptr, lse_ptr,
    stride_qz, stride_qh, stride_qm, stride_qcz, stride_qch, stride_qcm, stride_qsz, stride_qsh,
    stride_kcz, stride_kch, stride_kcn, stride_ksz, stride_ksh, stride_az, stride_ah,
    stride_cz, stride_ch, stride_cj, stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn, stride_v8z, stride_v8h, stride_v8d,
    stride_oz, stride_oh, stride_om,
    H_Q, KV_GROUP, N_Q, N_K, NQ_BUCKET, NK_BUCKET, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CENTRE_BLOCK_: tl.constexpr, FALLBACK: tl.constexpr, PV_FP8: tl.constexpr, INTERPRET_FP8: tl.constexpr,
    STORE_LSE: tl.constexpr, INTERPRET_BF16: tl.constexpr,
):
    """``out = softmax(scale q k^T) v`` for one block of ``BLOCK_M`` query rows of one (batch, head), from
    the pre-pass's codes (``reference_int8.attention_from_codes``).

    Loop invariant: ``acc / l_i == softmax(scale q K^T) V`` over the keys seen so far up to the codes'
    rounding, with ``m_i`` the running maximum of the true logits in log2 units; ``out = acc (1 / l_i)``.

    Tiles (``g`` = fp16 or bf16, the inputs' dtype; ``BLOCK_D`` = ``DP`` = ``HEAD_DIM`` rounded up to a power
    of two >= 32):
        q_codes (BLOCK_M, BLOCK_D) int8, q (BLOCK_M, BLOCK_D) g (for ``q . c_b``),
        a_i = qs qk_scale / BLOCK_D, mu_u = mu qk_scale (BLOCK_M,) fp32;
        k_codes (BLOCK_N, BLOCK_D) int8; ks, sigma, A (BLOCK_N,) fp32; c_b (BLOCK_D,) fp32 (the centre of
        the ``CENTRE_BLOCK_`` keys holding the tile: ``BLOCK_N`` divides it);
        I (BLOCK_M, BLOCK_N) int32; z, x fp32; p (BLOCK_M, BLOCK_N) g (16 bits) or e4m3 (``PV_FP8``);
        in a flagged block (``FALLBACK``) the key tile (BLOCK_N, BLOCK_D) g and its ``hi``, ``lo`` in g
        (:func:`_logits_16`) in place of the codes;
        v_blk (BLOCK_N, BLOCK_D) g, or V8^T (BLOCK_D, BLOCK_N) e4m3 with vs (BLOCK_D,) fp32;
        m_i, l_i (BLOCK_M,) fp32; acc (BLOCK_M, BLOCK_D) fp32.
    Without ``FALLBACK`` the key loop runs over the full tiles unmasked, then the ragged last one masked.  With
    it, in the spec's order (step 4c): that pair of loops over the coded blocks' tiles, ``order`` (B, Hq, blocks)
    int32 naming the blocks and ``coded`` (B, Hq) int32 their count (:func:`tile_counts`), then again over the
    flagged blocks' tiles in 16 bits; no tile of either loop branches on a flag.  With
    ``STORE_LSE`` each row's natural-log log-sum-exp ``(m_i + log2(l_i) - P_SHIFT if FP8) ln 2`` goes to
    ``lse`` (B, Hq, Nq) fp32.  Grid: one program per (query block, batch x head) on axis 0, query blocks
    fastest.
    """
    pid = tl.program_id(0)
    num_m_blocks = tl.cdiv(N_Q, BLOCK_M)
    pid_m = pid % num_m_blocks
    pid_bh = pid // num_m_blocks
    off_z = (pid_bh // H_Q).to(tl.int64)
    off_hq = (pid_bh % H_Q).to(tl.int64)
    off_hk = off_hq // KV_GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_D)
    offs_d = offs_c
    m_valid = offs_m < N_Q
    d_valid = offs_d < HEAD_DIM

    q_codes = tl.load(qc_ptr + off_z * stride_qcz + off_hq * stride_qch + offs_m[:, None] * stride_qcm
                      + offs_c[None, :], mask=m_valid[:, None], other=0)
    q = tl.load(q_ptr + off_z * stride_qz + off_hq * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    row = off_z * stride_qsz + off_hq * stride_qsh + offs_m
    qk_scale = scale * LOG2E
    a_i = tl.load(qs_ptr + row, mask=m_valid, other=0.0) * (qk_scale / BLOCK_D)
    mu_u = tl.load(mu_ptr + row, mask=m_valid, other=0.0) * qk_scale

    kc_base = kc_ptr + off_z * stride_kcz + off_hk * stride_kch
    ks_base = ks_ptr + off_z * stride_ksz + off_hk * stride_ksh
    sig_base = sig_ptr + off_z * stride_ksz + off_hk * stride_ksh
    au_base = a_ptr + off_z * stride_az + off_hq * stride_ah
    c_base = c_ptr + off_z * stride_cz + off_hk * stride_ch
    k_base = k_ptr + off_z * stride_kz + off_hk * stride_kh
    flag_base = flag_ptr + pid_bh.to(tl.int64) * tl.cdiv(N_K, CENTRE_BLOCK_)
    order_base = order_ptr + pid_bh.to(tl.int64) * tl.cdiv(N_K, CENTRE_BLOCK_)
    v_base = v_ptr + off_z * stride_vz + off_hk * stride_vh
    v8_base = v8_ptr + off_z * stride_v8z + off_hk * stride_v8h
    if PV_FP8:
        vs = tl.load(vs_ptr + (off_z * (H_Q // KV_GROUP) + off_hk) * BLOCK_D + offs_d)
    else:
        vs = tl.zeros([BLOCK_D], tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    coded_blocks, n_coded, n_16, coded_full, full_16 = tile_counts(flag_base, coded_ptr + pid_bh, N_K, BLOCK_N,
                                                                   CENTRE_BLOCK_, FALLBACK)
    for sixteen in tl.static_range(2 if FALLBACK else 1):  # step 4c: the coded tiles, then the 16-bit ones
        first = coded_blocks * sixteen
        n_pass = n_16 if sixteen else n_coded
        full = full_16 if sixteen else coded_full
        acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q_codes, q, a_i, mu_u, kc_base, ks_base, sig_base, au_base, c_base,
                                    k_base, order_base, v_base, v8_base, vs, stride_kcn, stride_cj, stride_kn,
                                    stride_vn, stride_v8d, first, 0, full, N_K, offs_j, offs_c, offs_d, d_valid,
                                    qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, CENTRE_BLOCK_, FALLBACK, sixteen == 1,
                                    PV_FP8, INTERPRET_FP8, False, INTERPRET_BF16)
        acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q_codes, q, a_i, mu_u, kc_base, ks_base, sig_base, au_base, c_base,
                                    k_base, order_base, v_base, v8_base, vs, stride_kcn, stride_cj, stride_kn,
                                    stride_vn, stride_v8d, first, full, n_pass, N_K, offs_j, offs_c, offs_d, d_valid,
                                    qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, CENTRE_BLOCK_, FALLBACK, sixteen == 1,
                                    PV_FP8, INTERPRET_FP8, True, INTERPRET_BF16)

    inv_l = 1.0 / l_i
    out = round_to(acc * inv_l[:, None], o_ptr.dtype.element_ty, INTERPRET_BF16)
    o_ptrs = o_ptr + off_z * stride_oz + off_hq * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    if BLOCK_D == HEAD_DIM:
        tl.store(o_ptrs, out, mask=m_valid[:, None])
    else:
        tl.store(o_ptrs, out, mask=m_valid[:, None] & d_valid[None, :])
    if STORE_LSE:
        lse = m_i + tl.math.log2(l_i)
        if PV_FP8:
            lse = lse - P_SHIFT
        tl.store(lse_ptr + pid_bh.to(tl.int64) * N_Q + offs_m, lse * LN2, mask=m_valid)


# ---- configs and launchers --------------------------------------------------------------------------------

INTERPRET_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}
"""The interpreter's fixed configuration (a ``config`` given to :func:`attend` overrides it)."""

CONFIG_POOL = ((128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 128, 4, 2))
"""The attention kernel's autotune pool, (BLOCK_M, BLOCK_N, num_warps, num_stages): configs that compile for
sm_90 with INT8 wgmma for ``q k^T`` and 16-bit wgmma for ``P V`` (``tools.compile_int8``; their spills, and
why (128, 128, 8, 2) is there beside (128, 128, 8, 3): docs/notes/int8_kernel.md)."""
_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in CONFIG_POOL]
AUTOTUNE_KEY = ["HEAD_DIM", "NQ_BUCKET", "NK_BUCKET", "PV_FP8", "FALLBACK"]
"""The tuning key: ``FALLBACK`` in it, since the 16-bit branch takes shared memory of its own (at head dim
128 the config tuned without it, (128, 128), needs 267 KB with it: over the H200's 227 KB)."""


def _smem_bytes(cfg: triton.Config, block_d: int, pv_fp8: bool) -> int:
    """Shared memory of a config: the q codes once, k codes and V (2 or 1 bytes) per stage."""
    bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
    return block_d * (bm + bn * (2 if pv_fp8 else 3) * cfg.num_stages)


def _prune(configs, named_args, **kwargs):
    fitting = [c for c in configs if _smem_bytes(c, kwargs["BLOCK_D"], kwargs["PV_FP8"]) <= SMEM_LIMIT]
    return fitting or [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=1)]


_fwd_tuned = autotuned(int8_fwd_kernel, _CONFIGS, AUTOTUNE_KEY, _prune, name="int8.attention")
"""The attention kernel under the autotuner (``tuning.TableAutotuner``: shipped tables first; its name there)."""


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
    the coded blocks ascending, then the flagged ones; None with ``flags``); ``k_split`` (2, B, Hk, Nk, DP) in the inputs' dtype: each key's ``hi`` and ``lo`` of
    ``k - c_b`` for the Gluon kernel's 16-bit blocks (None unless ``prepare(..., split=True)``)."""

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
    k_split: torch.Tensor | None = None


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


def allocate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, pv_bits: int = 16, fallback: bool = True,
             split: bool = False) -> tuple[Prepared, Scratch]:
    """Empty pre-pass outputs and statistics for these inputs, on their device (``meta`` too)."""
    batch, h_q, n_q, d = q.shape
    h_k, n_k = k.shape[1], k.shape[2]
    dp = max(32, pow2_tile(d))  # reference_int8.rotation_size: an INT8 MMA reduces over 32
    dev, f32 = q.device, torch.float32
    q_blocks, k_blocks = cdiv(n_q, SHIFT_BLOCK), cdiv(n_k, SHIFT_BLOCK)
    fp8 = pv_bits == 8

    def empty(*shape, dtype=f32):
        return torch.empty(shape, dtype=dtype, device=dev)

    def per_key(heads):  # rows padded to 16 bytes: the Gluon kernel copies tiles of them by TMA
        return empty(batch, heads, -(-n_k // 4) * 4)[..., :n_k]

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
        k_split=empty(2, batch, h_k, n_k, dp, dtype=k.dtype) if split else None)
    scratch = Scratch(empty(batch * h_q, q_blocks, dp, dtype=torch.float64),
                      empty(batch * h_q, q_blocks, 2, dtype=torch.float64),
                      empty(batch * h_k, k_blocks, dp) if fp8 else None, empty(batch, h_k, dp) if fp8 else None)
    return prep, scratch


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
    split = prep.k_split is not None
    q_tasks = batch * h_q * q_blocks
    args = (q, k, v, prep.qbar, v_inv, prep.q_codes, prep.q_scale, prep.mu, scratch.q_stat_part, prep.k_codes,
            prep.k_scale, prep.sigma, prep.au, prep.centres, v8, prep.k_stats,
            prep.k_split if split else k, log2_units(scale),
            *strides3(q), *strides3(k), *strides3(v), *strides3(prep.q_codes), *prep.q_scale.stride()[:2],
            *strides3(prep.k_codes), *prep.k_scale.stride()[:2], *prep.au.stride()[:2], *strides3(prep.centres),
            *strides3(v8), prep.k_split[0].numel() if split else 0, h_q, h_k, n_q, n_k, q_blocks, k_blocks, q_tasks)
    meta = dict(HEAD_DIM=d, DP=dp, LOG2_DP=dp.bit_length() - 1, BLOCK_R=SHIFT_BLOCK, PV_FP8=fp8, SPLIT=split,
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
            fallback: bool = True, split: bool = False, tally: torch.Tensor | None = None) -> Prepared:
    """The pre-pass (launches 1-4 of the module docstring) for (B, H, N, D) q, k, v with unit stride in D;
    ``fallback``: which key blocks go to 16 bits at this ``scale`` (launch 4), their count added to ``tally``
    (an int64 ``[blocks, blocks in 16 bits]`` tensor on q's device: the caller's, ``dispatch.forward`` passes
    ``block_tally``'s; ``None``: a counter of this call alone); ``split``: also every key's ``hi`` and ``lo``
    (``Prepared.k_split``, for the Gluon kernel)."""
    batch, h_q, n_q, d = q.shape
    h_k, n_k = k.shape[1], k.shape[2]
    prep, scratch = allocate(q, k, v, pv_bits=pv_bits, fallback=fallback, split=split)
    dp = prep.k_codes.shape[-1]
    bf16 = q.dtype == torch.bfloat16
    warps = _prepass_warps(dp)
    q_blocks, k_blocks = scratch.q_part.shape[1], prep.centres.shape[2]
    colstats_kernel[(batch * h_q, q_blocks)](q, scratch.q_part, *strides3(q), h_q, n_q, q_blocks, HEAD_DIM=d, DP=dp,
                                             BLOCK_R=SHIFT_BLOCK, AMAX=False, num_warps=warps)
    colstats_reduce_kernel[(batch * h_q,)](scratch.q_part, prep.qbar, prep.qbar, n_q, q_blocks, DP=dp, AMAX=False,
                                           G_BF16=bf16, INTERPRET_BF16=INTERPRET and bf16)
    if prep.v_scale is not None:
        colstats_kernel[(batch * h_k, k_blocks)](v, scratch.v_part, *strides3(v), h_k, n_k, k_blocks, HEAD_DIM=d,
                                                 DP=dp, BLOCK_R=SHIFT_BLOCK, AMAX=True, num_warps=warps)
        colstats_reduce_kernel[(batch * h_k,)](scratch.v_part, prep.v_scale, scratch.v_inv, n_k, k_blocks, DP=dp,
                                               AMAX=True, G_BF16=bf16, INTERPRET_BF16=INTERPRET and bf16)
    grid, args, meta = quantize_call(q, k, v, prep, scratch, scale=scale)
    quantize_kernel[grid](*args, **meta)
    if fallback:
        if tally is None:
            tally = torch.zeros(2, dtype=torch.int64, device=q.device)
        grid, args, meta = flags_call(prep, scratch, scale=scale, tally=tally)
        fallback_flags_kernel[grid](*args, **meta)
    return prep


def attention_call(q: torch.Tensor, prep: Prepared, out: torch.Tensor, *, scale: float,
                   lse: torch.Tensor | None = None) -> tuple[tuple, dict]:
    """``(args, meta)`` of :func:`int8_fwd_kernel` (launch 5) on ``prep``, without the tile config."""
    batch, h_q, n_q, d = q.shape
    h_k, n_k = prep.k_codes.shape[1], prep.k_codes.shape[2]
    fp8 = prep.v_scale is not None
    v, v8 = (q, prep.v) if fp8 else (prep.v, prep.q_codes)  # the unread one is any tensor
    vs = prep.v_scale if fp8 else prep.q_scale
    lse_buf = prep.q_scale if lse is None else lse
    flags = (prep.k_codes,) * 3 if prep.flags is None else (prep.flags, prep.order, prep.coded)  # unread without
    args = (q, prep.q_codes, prep.q_scale, prep.mu, prep.k_codes, prep.k_scale, prep.sigma, prep.au, prep.centres,
            prep.k, *flags, v, v8, vs, out, lse_buf,
            *strides3(q), *strides3(prep.q_codes), *prep.q_scale.stride()[:2],
            *strides3(prep.k_codes), *prep.k_scale.stride()[:2], *prep.au.stride()[:2], *strides3(prep.centres),
            *strides3(prep.k), *strides3(v), *strides3(v8), *strides3(out),
            h_q, h_q // h_k, n_q, n_k, bucket(n_q), bucket(n_k), float(scale))
    meta = dict(HEAD_DIM=d, BLOCK_D=prep.k_codes.shape[-1], CENTRE_BLOCK_=SHIFT_BLOCK, FALLBACK=prep.flags is not None,
                PV_FP8=fp8, INTERPRET_FP8=INTERPRET, STORE_LSE=lse is not None,
                INTERPRET_BF16=INTERPRET and q.dtype == torch.bfloat16)
    return args, meta


def attend(q: torch.Tensor, prep: Prepared, out: torch.Tensor, *, scale: float, config: dict | None = None,
           lse: torch.Tensor | None = None) -> torch.Tensor:
    """The attention kernel (launch 5) on :func:`prepare`'s outputs; writes ``out`` (B, Hq, Nq, D) (any
    strides, unit stride in D) and, given ``lse`` (a contiguous fp32 (B, Hq, Nq) tensor), each row's
    log-sum-exp.  ``config``: ``BLOCK_M``, ``BLOCK_N`` (a power of two >= 32 dividing 128), ``num_warps``,
    ``num_stages`` instead of autotuning (under the interpreter: over ``INTERPRET_CONFIG``, unless inside
    ``tuning.interpreter_autotuning``)."""
    batch, h_q, n_q = q.shape[:3]
    args, meta = attention_call(q, prep, out, scale=scale, lse=lse)

    def grid(meta_):
        return (cdiv(n_q, meta_["BLOCK_M"]) * batch * h_q,)

    if config is not None or (INTERPRET and not interpreter_autotunes()):
        fixed = {**INTERPRET_CONFIG, **(config or {})} if INTERPRET else dict(config)
        tile = fixed.get("BLOCK_N")
        if not (isinstance(tile, int) and 32 <= tile <= SHIFT_BLOCK and SHIFT_BLOCK % tile == 0):
            raise ValueError(f"int8.attend: config['BLOCK_N']={tile!r} must be a power of two >= 32 (an 8-bit MMA's "
                             f"depth) dividing the centre block {SHIFT_BLOCK}")
        int8_fwd_kernel[grid](*args, **meta, **fixed)
    else:
        _fwd_tuned[grid](*args, **meta)
    return out
