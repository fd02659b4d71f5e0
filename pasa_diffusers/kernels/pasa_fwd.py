"""Fused forward attention: the exact shift, PASA (pseudo-average shifting) and plain FlashAttention.

One Triton kernel, :func:`pasa_fwd_kernel`, and its launch wrapper :func:`pasa_forward`.  The kernel
is FlashAttention-2's loop, written once (:func:`_attn_inner`, called for the full key blocks and
again, masked, for the ragged last one); each algorithm differs only in its logits helper
(``_logits_exact``, ``_logits_pasa``, ``_logits_flash``: the exponent of ``p``, the rescale ``alpha``
and the new row maximum) and each precision in its merge helper (``_merge``).  Switches:

- ``SHIFT``: ``"exact"`` (the exact shift, ``reference.exact_shift_reference``), ``"pasa"`` (the
  paper's PASA, ``reference.pasa_reference``) or ``"none"`` (plain FlashAttention);
- ``HALF_STATE``: the fully-half pipeline (fp16 scores, ``P`` and ``P V`` accumulator; PASA and plain
  FA also keep the softmax state in fp16) or the hybrid one (fp16/bf16 GEMM inputs, fp32 state and
  accumulator);
- ``SHIFT_IN_LOOP``: the key tile is shifted (PASA) or centred (the exact shift, one key block only)
  inside the loop, or read from the pre-pass's buffer (``shift_k.py``, ``centre_k.py``);
- ``ONE_BLOCK``: every key in one shift block (``N_K <= BLOCK_N``: temporal attention, short spatial
  sequences): PASA's offsets ``delta_1 = eps_1 = 0`` and its block mean is skipped; the exact shift
  centres its one key tile itself.  ``pasa_forward`` sends the exact shift's short one-block sequences
  (at most ``packed_fwd.PACKED_MAX_TOKENS`` queries and keys) to ``packed_fwd.py`` instead, which
  takes several whole sequences per program in one pass.

On an sm_90 GPU with Triton's Gluon 3.6, ``pasa_forward`` runs the exact shift in hybrid (the default
variant) on fp16, head dim 64 and several key blocks (spatial attention) through
``attn_fwd_gluon.py`` instead (FA3's warp-specialised kernel, from the same pre-pass); ``kernel``
picks explicitly.

Under ``TRITON_INTERPRET=1`` (set before ``triton`` is first imported) the kernel runs on CPU
tensors through Triton's numpy interpreter with one fixed small configuration.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import rules
from ..beta import gamma as recovery_gamma
from ..beta import shift_entries
from . import attn_fwd_gluon
from .centre_k import centre_k_kernel
from .common import LOG2E, centre_tile, mma, round_to, strides3
from .configs import INTERPRET_CONFIG, autotuned, bucket, pow2_tile
from .packed_fwd import PACKED_MAX_TOKENS, packed_forward, packs
from .shift_k import shift_k_kernel

__all__ = ["pasa_fwd_kernel", "pasa_forward", "SHIFT_K_MODES", "KERNELS", "INTERPRET"]

SHIFT_K_MODES = ("auto", "fused", "prepass", "packed")
KERNELS = ("auto", "portable", "gluon")


@triton.jit
def _logits_exact(q, q32, k_blk, m_i, c_base, stride_cj, start_n, n_valid, offs_d, d_valid, N_K, qk_scale, G_ULP,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CENTRE_BLOCK: tl.constexpr, HALF_STATE: tl.constexpr,
                  SHIFT_IN_LOOP: tl.constexpr, MASKED: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """The exact shift, in log2 units (``qk_scale = scale log2(e)``).  Keys centred per block of
    ``CENTRE_BLOCK`` keys: ``k_c = round_g(k - c_j)`` (by the pre-pass, or here when ``SHIFT_IN_LOOP``:
    then the tile is the block), ``c_j`` the block mean in half and the exact centre in hybrid
    (``k - c_j`` exact in ``g``); a tile of ``BLOCK_N`` keys lies in one block (``BLOCK_N`` divides
    ``CENTRE_BLOCK``) and reads that block's ``c_j``:

        r_j    = qk_scale * (q . c_j)                  (fp32 products and sum, per row)
        s      = fp32(q k_c^T) (hybrid)  |  fp16(q_s k_c^T), q_s = round_fp16(scale q) (half)
        m_s    = unit rowmax(s),  m_blk = m_s + r_j,  m_new = max(m_i, m_blk)
        x      = unit s - (m_s - (m_blk - m_new))      (one FMA; unit = qk_scale, or log2(e) in half)
        alpha  = exp2(m_i - m_new)

    ``unit s + r_j`` is block ``j``'s true logit (times log2 e) in real arithmetic.  The row offset goes
    through the block's own centred maximum ``m_s``: ``r_j`` reaches 1e4 for biased inputs, where fp32
    rounds at 1e-3, and ``r_j - m_new`` alone would carry that rounding into every exponent.
    """
    g_ty = k_blk.dtype
    if SHIFT_IN_LOOP:
        k32 = k_blk.to(tl.float32)
        n_j = tl.minimum(N_K - start_n, BLOCK_N)
        c_j = centre_tile(k32, n_valid[:, None], n_j, G_ULP, g_ty, not HALF_STATE, INTERPRET_BF16, 0, False)
        k_blk = round_to(k32 - c_j[None, :], g_ty, INTERPRET_BF16)
    else:
        c_j = tl.load(c_base + (start_n // CENTRE_BLOCK) * stride_cj + offs_d, mask=d_valid, other=0.0)
    r_j = tl.sum(q32 * c_j[None, :], axis=1) * qk_scale
    if HALF_STATE:
        s = tl.dot(q, tl.trans(k_blk), out_dtype=tl.float16).to(tl.float32)
        unit = LOG2E  # q is pre-scaled
    else:
        s = mma(q, tl.trans(k_blk), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), INTERPRET_BF16)
        unit = qk_scale
    if MASKED:
        s = tl.where(n_valid[None, :], s, float("-inf"))
    m_s = tl.max(s, axis=1) * unit
    m_blk = m_s + r_j
    m_new = tl.maximum(m_i, m_blk)
    x = tl.fma(s, unit, -(m_s - (m_blk - m_new))[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return x, alpha, m_new


@triton.jit
def _logits_pasa(q, k_blk, m_i, avg_j, start_n, n_valid, N_K, a_shift, c_shift, gamma_st, tail_ratio_st,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF_STATE: tl.constexpr,
                 SHIFT_IN_LOOP: tl.constexpr, ONE_BLOCK: tl.constexpr, MASKED: tl.constexpr,
                 INTERPRET_BF16: tl.constexpr):
    """PASA, in natural-log units.  Key block ``j`` holds ``n_j`` valid keys; ``a_shift, c_shift`` are the
    stored entries of ``scale (I - beta/n_j 11^T) = a I - c 11^T`` in the GEMM dtype (the full block's,
    or the ragged tail's in the masked call), ``gamma`` the full block's recovery factor, ``tail_ratio``
    = ``gamma_tail / gamma`` (all from ``beta.py``, computed on the host in float64):

        k_shift = a k_blk - c colsum(k_blk)        (fp32, rounded to g; or read from the pre-pass)
        s       = q k_shift^T                       (fp16 in half, fp32 in hybrid)
        mu_j    = rowmean of the n_j valid columns of s,   mu_hat_j = (gamma_j / gamma) mu_j
        avg_j   = avg_{j-1} + (mu_hat_j - avg_{j-1}) / j   (avg_1 = mu_hat_1)
        delta_j = gamma (mu_hat_j - avg_j),   eps_j = gamma (avg_{j-1} - avg_j)
        m_new   = max(m_i + eps_j, rowmax(s) + delta_j)
        x       = (s + delta_j - m_new) log2(e)    (fp32: one FMA per element)
        alpha   = exp(m_i + eps_j - m_new)

    Block ``j``'s true logits are ``s + gamma mu_hat_j`` (the removed pseudo-average; exact when the
    stored entries are, e.g. head dim 64 with beta 0.9375).  The state stays in natural-log units, like
    the paper and ``reference.py``, so that ``scale`` (a power of two for head dims 16, 64, 256) keeps
    ``a, c`` exact.  With ``ONE_BLOCK``, ``avg_1 = mu_hat_1`` makes ``delta_1 = eps_1 = 0`` exactly and
    the block mean is not needed (the same result, bit for bit).  Hybrid keeps the shifted scores in
    fp32 (the paper rounds them to fp16 in its hybrid variant too; a shifted score above 65504, one key
    far from its block's mean, then turned the row into NaN where plain hybrid FlashAttention is
    finite: only the fully-FP16 variant needs fp16 scores).
    """
    g_ty = q.dtype
    if SHIFT_IN_LOOP:
        k32 = k_blk.to(tl.float32)
        colsum = tl.sum(k32, axis=0)  # masked rows loaded as zero
        k_shift = round_to(a_shift * k32 - c_shift * colsum[None, :], g_ty, INTERPRET_BF16)
    else:
        k_shift = k_blk
    if HALF_STATE:
        s = tl.dot(q, tl.trans(k_shift), out_dtype=tl.float16)
    else:
        s = mma(q, tl.trans(k_shift), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), INTERPRET_BF16)
    if ONE_BLOCK:
        if MASKED:
            s = tl.where(n_valid[None, :], s, float("-inf"))
        delta_j = tl.zeros([BLOCK_M], s.dtype)
        eps_j = delta_j
    else:
        if MASKED:
            s_sum = tl.sum(tl.where(n_valid[None, :], s.to(tl.float32), 0.0), axis=1)
            mu_hat = (s_sum / (N_K - start_n)).to(s.dtype) * tail_ratio_st
            s = tl.where(n_valid[None, :], s, float("-inf"))
        else:
            s_sum = tl.sum(s.to(tl.float32), axis=1)
            mu_hat = (s_sum * (1.0 / BLOCK_N)).to(s.dtype)
        j = start_n // BLOCK_N + 1
        avg_prev = tl.where(j == 1, mu_hat, avg_j)
        avg_j = avg_prev + ((mu_hat - avg_prev) / j).to(s.dtype)
        delta_j = gamma_st * (mu_hat - avg_j)
        eps_j = gamma_st * (avg_prev - avg_j)
    m_prev = m_i + eps_j
    m_new = tl.maximum(m_prev, tl.max(s, axis=1).to(s.dtype) + delta_j)
    row_ref = (m_new.to(tl.float32) - delta_j.to(tl.float32)) * LOG2E
    x = s.to(tl.float32) * LOG2E - row_ref[:, None]
    alpha = tl.math.exp2((m_prev.to(tl.float32) - m_new.to(tl.float32)) * LOG2E)
    return x, alpha, m_new, avg_j


@triton.jit
def _logits_flash(q, k_blk, m_i, n_valid, scale_st, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HALF_STATE: tl.constexpr, MASKED: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """Plain FlashAttention.  Half: ``s = fp16(q k^T) * scale`` in fp16, so ``|q.k| > 65504`` is inf and
    the output NaN (the naive control), natural-log units.  Hybrid: fp32 scores, ``m_i`` in log2 units
    and the exponent by one FMA (FlashAttention-2)."""
    if HALF_STATE:
        s = tl.dot(q, tl.trans(k_blk), out_dtype=tl.float16) * scale_st
        if MASKED:
            s = tl.where(n_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1).to(s.dtype))
        x = s.to(tl.float32) * LOG2E - (m_new.to(tl.float32) * LOG2E)[:, None]
        alpha = tl.math.exp2((m_i.to(tl.float32) - m_new.to(tl.float32)) * LOG2E)
    else:
        s = mma(q, tl.trans(k_blk), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), INTERPRET_BF16)
        if MASKED:
            s = tl.where(n_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        x = tl.fma(s, qk_scale, -m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
    return x, alpha, m_new


@triton.jit
def _merge(acc, l_i, x, alpha, v_blk, SHIFT: tl.constexpr, HALF_STATE: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """``p = exp2(x)``, ``l_i = alpha l_i + rowsum(p)``, ``acc = alpha acc + p v_blk``.

    Hybrid: ``p`` is rounded to ``g`` for the ``P V`` GEMM and ``l_i`` sums those same rounded values,
    so that ``acc / l_i`` is a weighted mean of V whatever the exponent's rounding.  (Summing the fp32
    ``p`` instead, FlashAttention-2's choice, leaves the rounding of the exponent of the row's largest
    ``p`` in the result: at raw scores of 1.5e5 the compiled FMA carries ``m_new``'s rounding, 1e-3 in
    log2 units, ``p_max = 2^(+-1e-3)`` rounds to fp16 differently from its fp32 value, and every row is
    off by up to 2^-12; measured 3.8x the fp32 reference's error at uniform(30, 20) on the H200.)
    Half: ``p`` and ``acc`` fp16.  PASA and plain FA keep ``l_i`` in fp16 and accumulate ``P V`` onto
    ``alpha acc`` in the GEMM's fp16 accumulators; the exact shift keeps ``l_i`` in fp32 and sums the
    block's ``P V`` in its own fp16 accumulators, added to ``alpha acc`` once (in fp32, so that Triton
    does not fold the addition into the dot): ``acc`` rounds twice per block, not once per k-step of 16.
    """
    g_ty = v_blk.dtype
    if HALF_STATE:
        p = tl.math.exp2(x).to(tl.float16)
        if SHIFT == "exact":
            l_i = alpha * l_i + tl.sum(p.to(tl.float32), axis=1)
            pv = tl.dot(p.to(g_ty), v_blk, out_dtype=tl.float16)
            acc = ((acc * alpha.to(tl.float16)[:, None]).to(tl.float32) + pv.to(tl.float32)).to(tl.float16)
        else:
            alpha = alpha.to(tl.float16)
            l_i = alpha * l_i + tl.sum(p.to(tl.float32), axis=1).to(tl.float16)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(g_ty), v_blk, acc, out_dtype=tl.float16)
    else:
        p = round_to(tl.math.exp2(x), g_ty, INTERPRET_BF16)
        l_i = alpha * l_i + tl.sum(p.to(tl.float32), axis=1)
        acc = acc * alpha[:, None]
        acc = mma(p, v_blk, acc, INTERPRET_BF16)
    return acc, l_i


@triton.jit
def _attn_inner(acc, l_i, m_i, avg_j, q, q32, k_base, v_base, c_base, stride_kn, stride_vn, stride_cj,
                lo, hi, N_K, offs_j, offs_d, d_valid,
                scale_st, qk_scale, a_shift, c_shift, gamma_st, tail_ratio_st, G_ULP,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CENTRE_BLOCK: tl.constexpr, SHIFT: tl.constexpr, SHIFT_IN_LOOP: tl.constexpr,
                HALF_STATE: tl.constexpr, ONE_BLOCK: tl.constexpr, MASKED: tl.constexpr,
                INTERPRET_BF16: tl.constexpr):
    """The key loop over ``[lo, hi)`` in steps of ``BLOCK_N``: load a K/V tile (masking rows past
    ``N_K`` when ``MASKED``), the algorithm's logits, the precision's merge."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_j
        n_valid = offs_n < N_K
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]
        if MASKED:
            if BLOCK_D == HEAD_DIM:
                kv_mask = n_valid[:, None]
            else:
                kv_mask = n_valid[:, None] & d_valid[None, :]
            k_blk = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v_blk = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        elif BLOCK_D == HEAD_DIM:
            k_blk = tl.load(k_ptrs)
            v_blk = tl.load(v_ptrs)
        else:
            k_blk = tl.load(k_ptrs, mask=d_valid[None, :], other=0.0)
            v_blk = tl.load(v_ptrs, mask=d_valid[None, :], other=0.0)

        if SHIFT == "exact":
            x, alpha, m_new = _logits_exact(q, q32, k_blk, m_i, c_base, stride_cj, start_n, n_valid, offs_d,
                                            d_valid, N_K, qk_scale, G_ULP, BLOCK_M, BLOCK_N, CENTRE_BLOCK,
                                            HALF_STATE, SHIFT_IN_LOOP, MASKED, INTERPRET_BF16)
        elif SHIFT == "pasa":
            x, alpha, m_new, avg_j = _logits_pasa(q, k_blk, m_i, avg_j, start_n, n_valid, N_K, a_shift, c_shift,
                                                  gamma_st, tail_ratio_st, BLOCK_M, BLOCK_N, HALF_STATE,
                                                  SHIFT_IN_LOOP, ONE_BLOCK, MASKED, INTERPRET_BF16)
        else:
            x, alpha, m_new = _logits_flash(q, k_blk, m_i, n_valid, scale_st, qk_scale, BLOCK_M, BLOCK_N,
                                            HALF_STATE, MASKED, INTERPRET_BF16)
        acc, l_i = _merge(acc, l_i, x, alpha, v_blk, SHIFT, HALF_STATE, INTERPRET_BF16)
        m_i = m_new
    return acc, l_i, m_i, avg_j


@triton.jit(do_not_specialize=["N_Q", "N_K"])
def pasa_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_oz, stride_oh, stride_om,
    c_ptr, stride_cz, stride_ch, stride_cj,
    H_Q, KV_GROUP, N_Q, N_K,
    NQ_BUCKET, NK_BUCKET,  # autotune keys only
    scale, a_full, c_full, a_tail, c_tail, gamma, tail_ratio, G_ULP,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CENTRE_BLOCK: tl.constexpr,
    SHIFT: tl.constexpr, SHIFT_IN_LOOP: tl.constexpr, HALF_STATE: tl.constexpr,
    ONE_BLOCK: tl.constexpr, INTERPRET_BF16: tl.constexpr,
):
    """``out = softmax(scale q k^T) v`` for one block of ``BLOCK_M`` query rows of one (batch, head).

    Loop invariant: ``acc / l_i == softmax(scale q K^T) V`` over the keys seen so far, with ``m_i``,
    ``l_i`` and ``acc`` kept relative to a per-row reference: the running maximum of the true logits
    (the exact shift, plain FA) or ``gamma * avg_j`` plus the maximum of the shifted ones (PASA).  The
    reference cancels in ``acc / l_i``; at the end ``out = acc * (1 / l_i)`` (one division per row).
    The logits helpers state each algorithm's math, ``_merge`` each precision's.

    Tiles (``st`` = fp16 for PASA and plain FA in half, fp32 otherwise; ``g`` = the GEMM dtype, fp16
    or bf16):
        q (BLOCK_M, BLOCK_D) g (the exact shift in half: ``q_s = round_fp16(scale q)``), and its fp32
        copy ``q32`` for the exact shift's ``q . c_j``;  k_blk, v_blk (BLOCK_N, BLOCK_D) g;
        s (BLOCK_M, BLOCK_N): fp16 in half, fp32 in hybrid; the exp2 argument x fp32;  p (BLOCK_M, BLOCK_N) fp16 in half, fp32 rounded to g in hybrid;
        m_i, l_i, avg_j (BLOCK_M,) st;  acc (BLOCK_M, BLOCK_D) fp16 in half, fp32 in hybrid;
        c_j (BLOCK_D,) fp32 (the exact shift's centre of the ``CENTRE_BLOCK`` keys that hold the tile).
    ``BLOCK_D`` is ``HEAD_DIM`` rounded up to a power of two >= 16; padded columns load as zero.

    The key loop runs twice: the full blocks without masks, then the ragged last block (if any) with
    row masks, its own shift entries and its own ``n_j``.  Grid: one program per (query block,
    batch x head) on axis 0, query blocks fastest so that programs running together read the same K/V
    (axis 0 allows 2^31 - 1 programs; axes 1 and 2 only 65535).
    """
    pid = tl.program_id(0)
    num_m_blocks = tl.cdiv(N_Q, BLOCK_M)
    pid_m = pid % num_m_blocks
    pid_bh = pid // num_m_blocks
    off_z = (pid_bh // H_Q).to(tl.int64)
    off_hq = (pid_bh % H_Q).to(tl.int64)
    off_hk = off_hq // KV_GROUP

    q_base = q_ptr + off_z * stride_qz + off_hq * stride_qh
    k_base = k_ptr + off_z * stride_kz + off_hk * stride_kh
    v_base = v_ptr + off_z * stride_vz + off_hk * stride_vh
    o_base = o_ptr + off_z * stride_oz + off_hq * stride_oh
    c_base = c_ptr + off_z * stride_cz + off_hk * stride_ch

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < N_Q
    d_valid = offs_d < HEAD_DIM

    q_ptrs = q_base + offs_m[:, None] * stride_qm + offs_d[None, :]
    if BLOCK_D == HEAD_DIM:
        q = tl.load(q_ptrs, mask=m_valid[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=m_valid[:, None] & d_valid[None, :], other=0.0)

    if HALF_STATE and SHIFT != "exact":
        st = tl.float16
        # float arguments are python floats under the interpreter: cast explicitly
        gamma_st = tl.cast(gamma, tl.float16)
        tail_ratio_st = tl.cast(tail_ratio, tl.float16)
        scale_st = tl.cast(scale, tl.float16)
    else:
        st = tl.float32
        gamma_st = gamma
        tail_ratio_st = tail_ratio
        scale_st = scale
    m_i = tl.full([BLOCK_M], float("-inf"), st)
    l_i = tl.zeros([BLOCK_M], st)
    avg_j = tl.zeros([BLOCK_M], st)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float16 if HALF_STATE else tl.float32)
    qk_scale = scale * LOG2E
    q32 = q.to(tl.float32)
    if SHIFT == "exact" and HALF_STATE:
        # pre-scaled once (natural units, as the reference: the same fp16 q_s and scores); the fp16
        # product then stays in range
        q = (q32 * scale).to(tl.float16)

    n_full_keys = (N_K // BLOCK_N) * BLOCK_N
    acc, l_i, m_i, avg_j = _attn_inner(
        acc, l_i, m_i, avg_j, q, q32, k_base, v_base, c_base, stride_kn, stride_vn, stride_cj,
        0, n_full_keys, N_K, offs_j, offs_d, d_valid,
        scale_st, qk_scale, a_full, c_full, gamma_st, tail_ratio_st, G_ULP,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CENTRE_BLOCK, SHIFT, SHIFT_IN_LOOP, HALF_STATE, ONE_BLOCK, False,
        INTERPRET_BF16)
    acc, l_i, m_i, avg_j = _attn_inner(
        acc, l_i, m_i, avg_j, q, q32, k_base, v_base, c_base, stride_kn, stride_vn, stride_cj,
        n_full_keys, N_K, N_K, offs_j, offs_d, d_valid,
        scale_st, qk_scale, a_tail, c_tail, gamma_st, tail_ratio_st, G_ULP,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CENTRE_BLOCK, SHIFT, SHIFT_IN_LOOP, HALF_STATE, ONE_BLOCK, True,
        INTERPRET_BF16)

    inv_l = 1.0 / l_i.to(tl.float32)  # one division per row, then products
    out = round_to(acc.to(tl.float32) * inv_l[:, None], o_ptr.dtype.element_ty, INTERPRET_BF16)
    o_ptrs = o_base + offs_m[:, None] * stride_om + offs_d[None, :]
    if BLOCK_D == HEAD_DIM:
        tl.store(o_ptrs, out, mask=m_valid[:, None])
    else:
        tl.store(o_ptrs, out, mask=m_valid[:, None] & d_valid[None, :])


INTERPRET = not isinstance(pasa_fwd_kernel, triton.runtime.jit.JITFunction)
"""True when ``TRITON_INTERPRET=1`` was set before triton was imported: the kernel then runs on CPU."""

if not INTERPRET:
    _shift_fwd_tuned = autotuned(pasa_fwd_kernel, tune_block_n=False)
    _tiled_fwd_tuned = autotuned(pasa_fwd_kernel, tune_block_n=True)


@functools.lru_cache(maxsize=256)
def _shift_constants(beta: float, n_keys: int, block_n: int, dtype: torch.dtype,
                     scale: float) -> tuple[float, float, float, float, float, float]:
    """``(a_full, c_full, a_tail, c_tail, gamma, tail_ratio)`` in float64 from the stored entries.

    ``gamma`` is the full block's (the tail's when ``n_keys < block_n``: then the only block is the
    tail); ``tail_ratio = gamma_tail / gamma``.
    """
    n_first = min(block_n, n_keys)
    diag, off = shift_entries(beta, n_first, dtype, scale)
    a_full, c_full = diag - off, -off
    gam = recovery_gamma(beta, n_first, dtype, scale)
    n_tail = n_keys % block_n
    if n_tail == 0 or n_keys < block_n:
        return a_full, c_full, a_full, c_full, gam, 1.0
    diag, off = shift_entries(beta, n_tail, dtype, scale)
    return a_full, c_full, diag - off, -off, gam, recovery_gamma(beta, n_tail, dtype, scale) / gam


def _gluon_reason(kernel: str, config: dict | None, q: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  precision: str, block_n: int, prepass: bool) -> str | None:
    """Why the exact shift's call does not go to ``attn_fwd_gluon.py`` under ``kernel``, or ``None``."""
    if kernel == "portable":
        return "kernel='portable'"
    if kernel == "auto" and config is not None:
        return "a config tunes the portable kernel"
    if not prepass:
        return "all keys form one block, centred inside the portable kernel (no pre-pass)"
    if INTERPRET:
        return "Triton's interpreter runs no Gluon"
    return attn_fwd_gluon.unsuitable_reason(q, v, out, precision=precision, block_n=block_n)


def pasa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *, scale: float,
                 precision: str, shift: bool | str, beta: float, shift_k: str = "auto", block_n: int | None = None,
                 config: dict | None = None, kernel: str = "auto") -> torch.Tensor:
    """Write ``softmax(scale q k^T) v`` into ``out`` and return it.

    Args:
        q: ``(B, Hq, Nq, D)``; k, v: ``(B, Hk, Nk, D)`` with ``Hq % Hk == 0``; out: ``(B, Hq, Nq, D)``.
            Any strides with unit stride in the head dim (e.g. ``(B, N, H, D)`` tensors transposed).
        scale: softmax scale; precision: ``"hybrid"`` or ``"half"``; shift: ``"exact"`` the exact
            shift, ``True`` PASA, ``False`` plain FA (key blocks of ``block_n`` for the first two);
        beta: PASA's shift strength in (0, 1) (unused by plain FA and the exact shift).
        shift_k: how keys are shifted (PASA) or centred (the exact shift): ``"fused"`` inside the loop,
            ``"prepass"`` once per head by ``shift_k.py`` / ``centre_k.py`` into a buffer, ``"packed"``
            (the exact shift only) by ``packed_fwd.py``, which takes several whole sequences of at
            most ``PACKED_MAX_TOKENS`` queries and keys per program in one pass; ``"auto"``: PASA
            uses the pre-pass when a head has more than 128 query rows (several query blocks reuse
            every shifted tile) or the head dim is above 128 (an fp32 key tile of 128 x 256 does not
            fit the registers); the exact shift packs short one-block sequences (temporal
            attention), centres in the loop when all keys form one block otherwise (the only case
            ``"fused"`` allows it), and by the pre-pass otherwise.
        block_n: the shift block n (default ``rules.SHIFT_BLOCK`` = 128, as the reference); changes
            the result.
        config: fixed meta-parameters (``BLOCK_M``, ``num_warps``, ``num_stages``, and ``BLOCK_N`` for
            plain FA and for the exact shift with pre-centred keys, where it divides ``block_n``;
            ``SEQS`` and ``num_warps`` for the packed kernel) instead of autotuning (under the
            interpreter: over its fixed configuration, whose ``num_warps`` and ``num_stages`` it ignores);
            with ``kernel="gluon"``, the Gluon kernel's (``attn_fwd_gluon.exact_forward_gluon``).
        kernel: ``"portable"`` this file's kernels; ``"gluon"`` the exact shift's pre-centred path
            through ``attn_fwd_gluon.py`` (``ValueError`` with the reason where it cannot run);
            ``"auto"``: Gluon wherever it can run that path (``attn_fwd_gluon.unsuitable_reason``)
            unless ``config`` is given (a config tunes the portable kernel), portable otherwise.
    """
    fn = "pasa_forward"
    rules.check_options(fn, precision=precision, shift=shift, beta=beta, scale=scale)
    if precision not in rules.KERNEL_PRECISIONS:
        raise ValueError(f"{fn}: precision={precision!r} has no kernel; expected one of {rules.KERNEL_PRECISIONS}")
    if shift_k not in SHIFT_K_MODES:
        raise ValueError(f"{fn}: unknown shift_k={shift_k!r}; expected one of {SHIFT_K_MODES}")
    if kernel not in KERNELS:
        raise ValueError(f"{fn}: unknown kernel={kernel!r}; expected one of {KERNELS}")
    rules.check_qkv(fn, q, k, v, precision)
    rules.check_kernel_tensors(fn, q, k, v, out, interpret=INTERPRET)
    mode = rules.shift_mode(shift)
    if shift_k == "packed" and mode != "exact":
        raise ValueError(f"{fn}: shift_k='packed' is the exact shift's; got shift={shift!r}")
    if kernel == "gluon" and mode != "exact":
        raise ValueError(f"{fn}: kernel='gluon' is the exact shift's; got shift={shift!r}")
    if mode == "none" and block_n is not None:
        raise ValueError(f"{fn}: block_n is the shift block; it needs shift=True or 'exact', got shift={shift!r}")

    batch, h_q, n_q, head_dim = q.shape
    h_k, n_k = k.shape[1], k.shape[2]
    block_d = pow2_tile(head_dim)
    interpret_bf16 = INTERPRET and q.dtype == torch.bfloat16
    consts = dict(a_full=0.0, c_full=0.0, a_tail=0.0, c_tail=0.0, gamma=0.0, tail_ratio=1.0)
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, SHIFT=mode, HALF_STATE=precision == "half", SHIFT_IN_LOOP=True,
                ONE_BLOCK=False, CENTRE_BLOCK=0, INTERPRET_BF16=interpret_bf16)
    k_src = k
    centres = q  # read only by the exact shift's pre-pass path
    prepass_warps = 4 if block_d <= 64 else 8
    if mode != "none":
        block_n = rules.SHIFT_BLOCK if block_n is None else int(block_n)
        # Up to block_n keys form one block of n_j = Nk keys whatever the tile: a smaller tile gives
        # the same result with less padding (temporal attention: Nk = 14 or 25).
        block_n = min(block_n, pow2_tile(n_k))
        meta["BLOCK_N"] = block_n
        meta["ONE_BLOCK"] = n_k <= block_n
    if mode == "pasa":
        a_full, c_full, a_tail, c_tail, gam, ratio = _shift_constants(float(beta), n_k, block_n, q.dtype, float(scale))
        consts.update(a_full=a_full, c_full=c_full, a_tail=a_tail, c_tail=c_tail, gamma=gam, tail_ratio=ratio)
        if shift_k == "prepass" or (shift_k == "auto" and (n_q > 128 or block_d > 128)):
            k_src = torch.empty((batch, h_k, n_k, head_dim), dtype=k.dtype, device=k.device)
            shift_k_kernel[(batch * h_k, triton.cdiv(n_k, block_n))](
                k, k_src, *strides3(k), *strides3(k_src), h_k, n_k, a_full, c_full, a_tail, c_tail,
                HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, INTERPRET_BF16=interpret_bf16,
                num_warps=prepass_warps)
            meta["SHIFT_IN_LOOP"] = False
    elif mode == "exact":
        one_tile = meta["ONE_BLOCK"] and packs(n_q, n_k)
        if shift_k == "packed" and not one_tile:
            raise ValueError(f"{fn}: shift_k='packed' takes sequences of at most {PACKED_MAX_TOKENS} queries and "
                             f"keys in one key block; got {n_q} queries and {n_k} keys (block_n={block_n})")
        prepass = shift_k == "prepass" or not meta["ONE_BLOCK"]
        gluon_reason = _gluon_reason(kernel, config, q, v, out, precision, block_n, prepass)
        if kernel == "gluon" and gluon_reason is not None:
            raise ValueError(f"{fn}: kernel='gluon' cannot run this call: {gluon_reason}")
        if shift_k == "packed" or (shift_k == "auto" and one_tile):
            return packed_forward(q, k, v, out, scale=scale, precision=precision, config=config)
        if shift_k == "fused" and not meta["ONE_BLOCK"]:
            raise ValueError(f"{fn}: shift_k='fused' centres keys inside the loop only when all {n_k} keys form one "
                             f"block of at most {block_n}; use 'prepass' or 'auto'")
        if prepass:
            n_blocks = triton.cdiv(n_k, block_n)
            k_src = torch.empty((batch, h_k, n_k, head_dim), dtype=k.dtype, device=k.device)
            centres = torch.empty((batch, h_k, n_blocks, head_dim), dtype=torch.float32, device=k.device)
            centre_k_kernel[(batch * h_k, n_blocks)](
                k, k_src, centres, *strides3(k), *strides3(k_src), *strides3(centres), h_k, n_k,
                torch.finfo(k.dtype).eps, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
                EXACT_CENTRE=precision == "hybrid", INTERPRET_BF16=interpret_bf16, num_warps=prepass_warps)
            meta["SHIFT_IN_LOOP"] = False
            if gluon_reason is None:
                return attn_fwd_gluon.launch(q, k_src, v, centres, out, scale=scale, config=config)
        meta["CENTRE_BLOCK"] = block_n

    # Plain FA and the exact shift with pre-centred keys tune their tile of keys (the exact shift's
    # divides its centre block); PASA's tile is its shift block, and so is the in-loop centring's.
    tiled = mode == "none" or (mode == "exact" and not meta["SHIFT_IN_LOOP"])
    if tiled and mode == "exact":
        del meta["BLOCK_N"]
    args = (q, k_src, v, out, *strides3(q), *strides3(k_src), *strides3(v), *strides3(out),
            centres, *strides3(centres),
            h_q, h_q // h_k, n_q, n_k, bucket(n_q), bucket(n_k), float(scale),
            consts["a_full"], consts["c_full"], consts["a_tail"], consts["c_tail"], consts["gamma"],
            consts["tail_ratio"], torch.finfo(q.dtype).eps)

    def grid(meta_):
        return (triton.cdiv(n_q, meta_["BLOCK_M"]) * batch * h_q,)

    if INTERPRET or config is not None:
        fixed = {**INTERPRET_CONFIG, **(config or {})} if INTERPRET else dict(config)
        if mode == "none":
            fixed.setdefault("BLOCK_N", 64)
        elif tiled:
            tile = fixed.setdefault("BLOCK_N", block_n)
            if not (isinstance(tile, int) and tile >= 16 and block_n % tile == 0):
                raise ValueError(f"{fn}: config['BLOCK_N']={tile!r} must be a power of two >= 16 that divides the "
                                 f"exact shift's centre block block_n={block_n}")
        elif fixed.pop("BLOCK_N", meta["BLOCK_N"]) != meta["BLOCK_N"]:
            raise ValueError(f"{fn}: this variant's BLOCK_N is its shift block; pass block_n, not config['BLOCK_N']")
        pasa_fwd_kernel[grid](*args, **meta, **fixed)
    elif tiled:
        _tiled_fwd_tuned[grid](*args, **meta)
    else:  # the shift block is BLOCK_N: not tuned
        _shift_fwd_tuned[grid](*args, **meta)
    return out
