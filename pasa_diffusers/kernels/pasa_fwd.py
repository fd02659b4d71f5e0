"""Fused forward attention: PASA (pseudo-average shifting) and plain FlashAttention, FP16/BF16.

One Triton kernel, :func:`pasa_fwd_kernel`, and its launch wrapper :func:`pasa_forward`.  Switches:

- ``SHIFT``: PASA (``True``) or plain FlashAttention-2 (``False``);
- ``EXACT_SHIFT`` (with ``SHIFT=False``): the exact shift (``reference.exact_shift_reference``): keys
  centred per block by the pre-pass in ``centre_k.py``, the removed logit ``scale q . c_j`` carried in
  fp32;
- ``HALF_STATE``: the fully-half pipeline (fp16 scores, softmax state, ``P`` and ``P V`` accumulator)
  or the hybrid one (fp16/bf16 GEMM inputs, fp32 softmax state and accumulator);
- ``SHIFT_IN_LOOP``: PASA shifts each key tile inside the loop (fused), or reads keys shifted once
  per head by the pre-pass in ``shift_k.py``;
- ``ONE_BLOCK``: PASA with every key in one shift block (``N_K <= BLOCK_N``: temporal attention, short
  spatial sequences), where the offsets ``delta_1 = eps_1 = 0`` and the block mean is skipped;
- ``EXP2_F16X2``: half only, an ablation: the exponent ``(s - m) log2(e)`` formed in fp16 (as the
  fully-half reference does) and ``ex2.approx.f16x2`` by inline PTX, so ``p`` needs no conversion
  (on sm_90 it lowers to scalar ``MUFU.EX2.F16``: the same exponential rate, fewer conversions;
  never under the interpreter, which has no inline PTX).

Under ``TRITON_INTERPRET=1`` (set before ``triton`` is first imported) the kernel runs on CPU
tensors through Triton's numpy interpreter with one fixed small configuration.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..beta import gamma as recovery_gamma
from ..beta import shift_entries
from .centre_k import centre_k_kernel
from .shift_k import round_to, shift_k_kernel

__all__ = ["pasa_fwd_kernel", "pasa_forward", "PRECISIONS", "SHIFT_K_MODES", "PASA_BLOCK_N",
           "INTERPRET", "AUTOTUNE_CONFIGS_PASA", "AUTOTUNE_CONFIGS_FLASH", "INTERPRET_CONFIG"]

PRECISIONS = ("half", "hybrid")
SHIFT_K_MODES = ("auto", "fused", "prepass")
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _mma(a, b, acc, INTERPRET_BF16: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation.  ``INTERPRET_BF16`` multiplies fp32 copies of the
    operands (exact products of bf16 values: the same result up to summation order), because the
    interpreter's numpy dot cannot multiply bf16."""
    if INTERPRET_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


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
    scale, a_full, c_full, a_tail, c_tail, gamma, tail_ratio,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SHIFT: tl.constexpr, SHIFT_IN_LOOP: tl.constexpr, HALF_STATE: tl.constexpr,
    EXP2_F16X2: tl.constexpr, INTERPRET_BF16: tl.constexpr, EXACT_SHIFT: tl.constexpr = False,
    ONE_BLOCK: tl.constexpr = False,
):
    """``out = softmax(scale q k^T) v`` for one block of ``BLOCK_M`` query rows of one (batch, head).

    Plain FlashAttention (``SHIFT=False``): logits ``scale * (q k_blk^T)``.  In half the product is an
    fp16 GEMM result multiplied by ``scale`` in fp16, so ``|q.k| > 65504`` is inf and the output NaN:
    the naive control.  In hybrid it is fp32 and ``m_i`` is kept in log2 units (FlashAttention-2).

    PASA (``SHIFT=True``).  Key block ``j`` holds ``n_j`` valid keys (``BLOCK_N``; the ragged last
    block its own ``n_j``).  ``a, c`` are the stored entries of ``scale (I - beta/n_j 11^T) = a I -
    c 11^T`` in the GEMM dtype, ``gamma`` the full block's recovery factor, ``tail_ratio`` =
    ``gamma_tail / gamma`` (all from ``beta.py``, computed on the host in float64):

        k_shift = a k_blk - c colsum(k_blk)        (fp32, rounded to the GEMM dtype)
        s       = q k_shift^T                       (rounded to the GEMM dtype, then held in st)
        mu_j    = rowmean of the n_j valid columns of s,   mu_hat_j = (gamma_j / gamma) mu_j
        avg_j   = avg_{j-1} + (mu_hat_j - avg_{j-1}) / j   (avg_1 = mu_hat_1)
        delta_j = gamma (mu_hat_j - avg_j),   eps_j = gamma (avg_{j-1} - avg_j)
        m_new   = max(m_i + eps_j, rowmax(s) + delta_j)
        p       = exp(s + delta_j - m_new),   alpha = exp(m_i + eps_j - m_new)
        l_i     = alpha l_i + rowsum(p),      acc = alpha acc + p v_blk,   m_i = m_new

    and at the end ``out = acc / l_i``.  Block ``j``'s true logits are ``s + gamma mu_hat_j`` (the
    removed pseudo-average; exact when the stored entries are, e.g. head dim 64 with beta 0.9375).

    Loop invariant: ``acc / l_i == softmax(scale q K^T) V`` over the keys seen so far, with ``m_i``,
    ``l_i`` and ``acc`` kept relative to the per-row reference ``gamma * avg_j`` (zero for plain
    FlashAttention).  The reference cancels in ``acc / l_i``, so the result is exact in real
    arithmetic for any beta in (0, 1).

    Units: the state is in natural-log units, like the paper and ``reference.py``, so that ``scale``
    (a power of two for head dims 16, 64, 256) keeps ``a, c`` exact; every exponential is
    ``exp2(s * log2(e) - (m_new - delta_j) * log2(e))``: one fp32 FMA per element, as many operations
    as folding ``log2(e)`` into the shift would need, without rounding ``scale * log2(e)`` into it.

    Exact shift (``EXACT_SHIFT=True``, ``SHIFT=False``), in log2 units (``qk_scale = scale log2(e)``).
    The keys come centred by the pre-pass (``centre_k.py``): ``k_c = round_g(k_blk - c_j)``, with
    ``c_j`` the block mean in half and the exact centre in hybrid (``k_blk - c_j`` exact in ``g``), and
    ``c_ptr`` holds the centres ``c_j`` (fp32, per kv head and key block):

        r_j    = qk_scale * (q . c_j)                  (fp32 products and sum, per row)
        s      = qk_scale fp32(q k_c^T) (hybrid)  |  log2(e) fp16(q_s k_c^T), q_s = round_fp16(scale q) (half)
        m_s    = rowmax(s),  m_blk = m_s + r_j,  m_new = max(m_i, m_blk)
        p      = exp2(s - (m_s - (m_blk - m_new))),   alpha = exp2(m_i - m_new)
        l_i    = alpha l_i + rowsum(p),  acc = alpha acc + p v_blk,  m_i = m_new

    (``s`` and ``m_s`` here in log2 units; the kernel scales ``s`` in the FMA.)  ``s + r_j``
    is block ``j``'s true logit (times log2 e) in real arithmetic; invariant: ``acc / l_i ==
    softmax(scale q K^T) V`` over the keys seen so far.  ``m_i``, ``l_i``, ``r_j`` are fp32 in both
    precisions; ``acc`` and ``p`` are fp16 in half (the fp16 tile holds only centred scores; the block's
    ``p v_blk`` is summed in its own fp16 accumulators and added to ``alpha acc`` once, so ``acc``
    rounds twice per block, as in the reference, not once per k-step of 16).

    Normalizer (hybrid).  ``p`` is rounded to ``g`` for the ``P V`` GEMM and ``l_i`` sums those same
    rounded values, so that ``acc / l_i`` is a weighted mean of V whatever the exponent's rounding.
    Summing the fp32 ``p`` instead (FlashAttention-2's choice) leaves the rounding of the exponent of
    the row's largest ``p`` in the result: at raw scores of 1.5e5 (biased inputs) the compiled FMA
    ``s qk - m_new`` carries ``m_new``'s rounding (1e-3 in log2 units), ``p_max = 2^(+-1e-3)`` rounds to
    fp16 differently from its fp32 value, and every row is off by up to 2^-12 even where softmax is
    one-hot (measured 3.8x the fp32 reference's error at uniform(30, 20) on the H200; the interpreter,
    which rounds the product and the difference separately, showed none).

    Tiles (``st`` = fp16 if ``HALF_STATE`` else fp32; ``g`` = the GEMM dtype, fp16 or bf16):
        q (BLOCK_M, BLOCK_D) g;  k_blk, k_shift, v_blk (BLOCK_N, BLOCK_D) g;
        s (BLOCK_M, BLOCK_N) st (fp32 for plain FA hybrid); the exp2 argument fp32;
        p (BLOCK_M, BLOCK_N) fp16 in half, fp32 rounded to g for the P V GEMM in hybrid;
        m_i, l_i, mu_j, avg_j, delta_j, eps_j (BLOCK_M,) st;  acc (BLOCK_M, BLOCK_D) st
        (half: ``tl.dot(p, v_blk, acc, out_dtype=fp16)``, fp16 accumulators; the exact shift sums
        ``p v_blk`` in its own fp16 accumulators first).
    ``BLOCK_D`` is ``HEAD_DIM`` rounded up to a power of two >= 16; padded columns load as zero.

    The key loop runs in two stages: the full blocks without masks, then the ragged last block (if
    any) with column masks, its own shift entries and its own ``n_j``.  Grid: one program per
    (query block, batch x head) on axis 0, query blocks fastest so that programs running together
    read the same K/V (axis 0 allows 2^31 - 1 programs; axes 1 and 2 only 65535).
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
    g_ty = q.dtype

    if EXACT_SHIFT:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        avg_j = tl.zeros([BLOCK_M], tl.float32)
        if HALF_STATE:
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float16)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        gamma_st = gamma
        tail_ratio_st = tail_ratio
        scale_st = scale
    elif HALF_STATE:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float16)
        l_i = tl.zeros([BLOCK_M], tl.float16)
        avg_j = tl.zeros([BLOCK_M], tl.float16)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float16)
        gamma_st = tl.cast(gamma, tl.float16)  # float args are python floats under the interpreter
        tail_ratio_st = tl.cast(tail_ratio, tl.float16)
        scale_st = tl.cast(scale, tl.float16)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        avg_j = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        gamma_st = gamma
        tail_ratio_st = tail_ratio
        scale_st = scale
    qk_scale = scale * LOG2E
    if EXACT_SHIFT:
        q32 = q.to(tl.float32)
        if HALF_STATE:
            # pre-scaled once (natural units, as the reference: the same fp16 q_s and scores); the
            # fp16 product then stays in range
            q_s = (q32 * scale).to(tl.float16)

    n_full_keys = (N_K // BLOCK_N) * BLOCK_N
    for stage in tl.static_range(2):
        # stage 0: full key blocks, no masks; stage 1: the ragged last block (0 or 1 iteration)
        if stage == 0:
            lo = 0
            hi = n_full_keys
        else:
            lo = n_full_keys
            hi = N_K
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + offs_j
            k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]
            v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]
            n_valid = offs_n < N_K
            if stage == 1:
                if BLOCK_D == HEAD_DIM:
                    kv_mask = n_valid[:, None]
                else:
                    kv_mask = n_valid[:, None] & d_valid[None, :]
                k_blk = tl.load(k_ptrs, mask=kv_mask, other=0.0)
                v_blk = tl.load(v_ptrs, mask=kv_mask, other=0.0)
            else:
                if BLOCK_D == HEAD_DIM:
                    k_blk = tl.load(k_ptrs)
                    v_blk = tl.load(v_ptrs)
                else:
                    k_blk = tl.load(k_ptrs, mask=d_valid[None, :], other=0.0)
                    v_blk = tl.load(v_ptrs, mask=d_valid[None, :], other=0.0)

            if SHIFT:
                # ---- PASA: shifted scores, block mean, running pseudo-average, offsets ----
                if SHIFT_IN_LOOP:
                    k32 = k_blk.to(tl.float32)
                    colsum = tl.sum(k32, axis=0)  # masked rows loaded as zero
                    if stage == 1:
                        k_shift = round_to(a_tail * k32 - c_tail * colsum[None, :], g_ty, INTERPRET_BF16)
                    else:
                        k_shift = round_to(a_full * k32 - c_full * colsum[None, :], g_ty, INTERPRET_BF16)
                else:
                    k_shift = k_blk  # shifted once per head by the pre-pass
                if HALF_STATE:
                    s = tl.dot(q, tl.trans(k_shift), out_dtype=tl.float16)
                else:
                    s = _mma(q, tl.trans(k_shift), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), INTERPRET_BF16)
                    s = round_to(s, g_ty, INTERPRET_BF16).to(tl.float32)

                if ONE_BLOCK:
                    # all keys in one block: avg_1 = mu_hat_1, so delta_1 = eps_1 = 0 exactly and the
                    # block mean is not needed (the same result, bit for bit)
                    if stage == 1:
                        s = tl.where(n_valid[None, :], s, float("-inf"))
                    delta_j = tl.zeros([BLOCK_M], s.dtype)
                    eps_j = delta_j
                else:
                    if stage == 1:
                        s_sum = tl.sum(tl.where(n_valid[None, :], s.to(tl.float32), 0.0), axis=1)
                        mu_j = (s_sum / (N_K - start_n)).to(s.dtype)
                        mu_hat = mu_j * tail_ratio_st
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
                if EXP2_F16X2:
                    x = (s - (m_new - delta_j)[:, None]) * LOG2E  # fp16, as the fully-half reference
                else:
                    # exp2 argument in fp32: (s + delta_j - m_new) log2(e), one FMA per element
                    row_ref = (m_new.to(tl.float32) - delta_j.to(tl.float32)) * LOG2E
                    x = s.to(tl.float32) * LOG2E - row_ref[:, None]
            elif EXACT_SHIFT:
                # ---- exact shift: keys centred by the pre-pass; carry q . c_j in fp32 ----
                c_j = tl.load(c_base + (start_n // BLOCK_N) * stride_cj + offs_d, mask=d_valid, other=0.0)
                r_j = tl.sum(q32 * c_j[None, :], axis=1) * qk_scale
                if HALF_STATE:
                    s = tl.dot(q_s, tl.trans(k_blk), out_dtype=tl.float16).to(tl.float32)
                    if stage == 1:
                        s = tl.where(n_valid[None, :], s, float("-inf"))
                    m_s = tl.max(s, axis=1) * LOG2E
                    m_prev = m_i
                    m_blk = m_s + r_j
                    m_new = tl.maximum(m_prev, m_blk)
                    x = tl.fma(s, LOG2E, -(m_s - (m_blk - m_new))[:, None])
                else:
                    s = _mma(q, tl.trans(k_blk), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), INTERPRET_BF16)
                    if stage == 1:
                        s = tl.where(n_valid[None, :], s, float("-inf"))
                    # the row offset goes through the block's own centred maximum m_s (r_j reaches
                    # 1e4 for biased inputs, where fp32 rounds at 1e-3: r_j - m_new alone would carry
                    # that rounding into every exponent)
                    m_s = tl.max(s, axis=1) * qk_scale
                    m_prev = m_i
                    m_blk = m_s + r_j
                    m_new = tl.maximum(m_prev, m_blk)
                    x = tl.fma(s, qk_scale, -(m_s - (m_blk - m_new))[:, None])
            else:
                # ---- plain FlashAttention ----
                if HALF_STATE:
                    s = tl.dot(q, tl.trans(k_blk), out_dtype=tl.float16) * scale_st
                    if stage == 1:
                        s = tl.where(n_valid[None, :], s, float("-inf"))
                    m_prev = m_i
                    m_new = tl.maximum(m_prev, tl.max(s, axis=1).to(s.dtype))
                    if EXP2_F16X2:
                        x = (s - m_new[:, None]) * LOG2E
                    else:
                        x = s.to(tl.float32) * LOG2E - (m_new.to(tl.float32) * LOG2E)[:, None]
                else:
                    s = _mma(q, tl.trans(k_blk), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), INTERPRET_BF16)
                    if stage == 1:
                        s = tl.where(n_valid[None, :], s, float("-inf"))
                    # FlashAttention-2's form: m_i in log2 units, one FMA per element
                    m_prev = m_i
                    m_new = tl.maximum(m_prev, tl.max(s, axis=1) * qk_scale)
                    x = tl.fma(s, qk_scale, -m_new[:, None])

            # ---- online softmax merge ----
            if EXACT_SHIFT:
                alpha = tl.math.exp2(m_prev - m_new)  # fp32 state in both precisions
            elif SHIFT or HALF_STATE:
                alpha = tl.math.exp2((m_prev.to(tl.float32) - m_new.to(tl.float32)) * LOG2E)
            else:
                alpha = tl.math.exp2(m_prev - m_new)
            if EXACT_SHIFT and HALF_STATE:
                p = tl.math.exp2(x).to(tl.float16)
                l_i = alpha * l_i + tl.sum(p.to(tl.float32), axis=1)
                # the block's P V in its own fp16 accumulators, then one fp32 addition rounded once
                # at acc's magnitude (in fp32 so that Triton does not fold the addition into the dot)
                pv = tl.dot(p.to(g_ty), v_blk, out_dtype=tl.float16)
                acc = ((acc * alpha.to(tl.float16)[:, None]).to(tl.float32) + pv.to(tl.float32)).to(tl.float16)
            elif HALF_STATE:
                if EXP2_F16X2:  # x in fp16: no conversions on either side of the exponential
                    p = tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x],
                                                  dtype=tl.float16, is_pure=True, pack=2)
                else:
                    p = tl.math.exp2(x).to(tl.float16)
                alpha = alpha.to(tl.float16)
                l_i = alpha * l_i + tl.sum(p.to(tl.float32), axis=1).to(tl.float16)
                acc = acc * alpha[:, None]
                acc = tl.dot(p.to(g_ty), v_blk, acc, out_dtype=tl.float16)
            else:
                # l sums the P that multiplies V (rounded to g): see the docstring, "Normalizer"
                p = round_to(tl.math.exp2(x), g_ty, INTERPRET_BF16)
                l_i = alpha * l_i + tl.sum(p.to(tl.float32), axis=1)
                acc = acc * alpha[:, None]
                acc = _mma(p, v_blk, acc, INTERPRET_BF16)
            m_i = m_new

    out = round_to(acc.to(tl.float32) / l_i.to(tl.float32)[:, None], o_ptr.dtype.element_ty, INTERPRET_BF16)
    o_ptrs = o_base + offs_m[:, None] * stride_om + offs_d[None, :]
    if BLOCK_D == HEAD_DIM:
        tl.store(o_ptrs, out, mask=m_valid[:, None])
    else:
        tl.store(o_ptrs, out, mask=m_valid[:, None] & d_valid[None, :])


INTERPRET = not isinstance(pasa_fwd_kernel, triton.runtime.jit.JITFunction)
"""True when ``TRITON_INTERPRET=1`` was set before triton was imported: the kernel then runs on CPU."""

# ---------------------------------------------------------------------------------------------------
# Configurations.  PASA's BLOCK_N is not tuned: it is the shift block n, which changes the result
# (and the beta fixed point is solved for n = 128), so it is always PASA_BLOCK_N; the autotuner picks
# BLOCK_M, warps and stages.  Plain FlashAttention also tunes BLOCK_N.  Configs whose tiles do not fit
# the 227 KB of shared memory of an sm_90 SM are pruned before compiling (head dims above 128); the
# single-stage fallbacks serve head dim 256.
# "short" configs serve at most 32 query rows (SVD's temporal attention, N = 14 or 25).
# Tuned on the H200 (triton 3.6, fp16, head dim 64; bench/bench_attention.py, 2026-11-29), winners:
#   spatial (2F, 5, 9216) and (2F, 10, 2304): PASA and exact BLOCK_M 64 / 4 warps / 3 stages; plain FA
#     BLOCK_M 128 (half) or 64-128 (hybrid), BLOCK_N 64, 4 warps, 3 stages;
#   spatial 576 and 144 tokens: BLOCK_M 64 (BLOCK_N 64 for FA), 4 warps, 3 stages;
#   temporal (F = 14, 25 frames): FA BLOCK_M 16 / 32 with BLOCK_N 32; PASA BLOCK_M 64 (half) or 16-64
#     (hybrid), 2 stages;  the paper's (1, 28, 1407, 128): BLOCK_M 128, 8 warps, 3 stages.
# ---------------------------------------------------------------------------------------------------
PASA_BLOCK_N = 128
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90
_AUTOTUNE_KEY = ["HEAD_DIM", "NQ_BUCKET", "NK_BUCKET", "HALF_STATE", "SHIFT", "SHIFT_IN_LOOP", "EXACT_SHIFT",
                 "ONE_BLOCK", "BLOCK_N"]


def _configs(entries, with_block_n: bool) -> list[triton.Config]:
    if with_block_n:
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in entries]
    return [triton.Config({"BLOCK_M": bm}, num_warps=w, num_stages=s) for bm, w, s in entries]


# (BLOCK_M, [BLOCK_N,] num_warps, num_stages); "short": at most 32 query rows (temporal attention,
# decode rows), where 128-row tiles would be mostly padding; "fallback": head dim 256, whose tiles
# fit shared memory only single-stage.
_PASA_CONFIGS = {
    "long": _configs([(128, 8, 3), (128, 8, 2), (64, 4, 3)], False),
    "short": _configs([(32, 4, 2), (16, 4, 2), (64, 4, 2)], False),
    "fallback": _configs([(64, 4, 1), (64, 8, 1)], False),
}
_FLASH_CONFIGS = {
    "long": _configs([(128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3)], True),
    "short": _configs([(32, 32, 4, 2), (16, 32, 4, 2), (64, 64, 4, 2)], True),
    "fallback": _configs([(64, 64, 4, 2), (64, 64, 8, 2)], True),
}
AUTOTUNE_CONFIGS_PASA = [c for cs in _PASA_CONFIGS.values() for c in cs]
AUTOTUNE_CONFIGS_FLASH = [c for cs in _FLASH_CONFIGS.values() for c in cs]
INTERPRET_CONFIG = {"BLOCK_M": 64, "num_warps": 4, "num_stages": 1}
"""The interpreter's fixed configuration (plus BLOCK_N: PASA's shift block, 64 for plain FA)."""


def _smem_bytes(cfg: triton.Config, block_n: int, block_d: int) -> int:
    """Shared memory of a config as Triton 3.x lays it out on sm_90: q once, k and v per stage."""
    bn = cfg.kwargs.get("BLOCK_N", block_n)
    return 2 * block_d * (cfg.kwargs["BLOCK_M"] + 2 * bn * cfg.num_stages)


def _prune(configs, named_args, **kwargs):
    """The short- or long-query configs that fit shared memory; the single-stage fallbacks if none."""
    table = _FLASH_CONFIGS if "BLOCK_N" in configs[0].kwargs else _PASA_CONFIGS
    block_d, block_n = kwargs["BLOCK_D"], kwargs.get("BLOCK_N", 64)
    pool = table["short"] if named_args["NQ_BUCKET"] <= 32 else table["long"]
    fitting = [c for c in pool if _smem_bytes(c, block_n, block_d) <= SMEM_LIMIT]
    if fitting:
        return fitting
    return [c for c in table["fallback"] if _smem_bytes(c, block_n, block_d) <= SMEM_LIMIT] or table["fallback"][:1]


if not INTERPRET:
    _pasa_fwd_tuned = triton.autotune(AUTOTUNE_CONFIGS_PASA, key=_AUTOTUNE_KEY,
                                      prune_configs_by={"early_config_prune": _prune})(pasa_fwd_kernel)
    _flash_fwd_tuned = triton.autotune(AUTOTUNE_CONFIGS_FLASH, key=_AUTOTUNE_KEY[:-1],
                                       prune_configs_by={"early_config_prune": _prune})(pasa_fwd_kernel)


def _pow2_tile(n: int) -> int:
    """The smallest power of two >= max(n, 16): a tile extent that covers n."""
    return max(16, triton.next_power_of_2(n))


def _bucket(n: int) -> int:
    """Autotune bucket of a sequence length: a power of two in [16, 16384]."""
    return min(max(16, triton.next_power_of_2(n)), 16384)


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


def _strides3(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, precision: str) -> None:
    fn = "pasa_forward"
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be (B, H, N, D), got {name}.shape={tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{fn}: {name} must have unit stride in the head dim, got "
                             f"{name}.stride()={tuple(t.stride())} for {name}.shape={tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{fn}: {name} is on {t.device}, q on {q.device}")
    if precision not in PRECISIONS:
        raise ValueError(f"{fn}: unknown precision={precision!r}; expected one of {PRECISIONS}")
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype == out.dtype):
        raise ValueError(f"{fn}: q, k, v, out must share dtype float16 or bfloat16, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}, {out.dtype}")
    if precision == "half" and q.dtype != torch.float16:
        raise ValueError(f"{fn}: precision='half' needs float16 inputs, got {q.dtype}")
    if out.shape != q.shape:
        raise ValueError(f"{fn}: out.shape={tuple(out.shape)} must equal q.shape={tuple(q.shape)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"{fn}: k, v must be (B, Hk, Nk, D) matching q: q.shape={tuple(q.shape)}, "
                         f"k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{fn}: q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]})")
    if not 16 <= q.shape[3] <= 256:
        raise ValueError(f"{fn}: head dim {q.shape[3]} is outside 16..256 (q.shape={tuple(q.shape)})")
    if q.device.type == "cpu" and not INTERPRET:
        raise RuntimeError(f"{fn}: CPU tensors run only under Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before triton is first imported")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{fn}: unsupported device {q.device}")


def pasa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *, scale: float,
                 precision: str, shift: bool | str, beta: float, shift_k: str = "auto", block_n: int | None = None,
                 config: dict | None = None, exp2_f16x2: bool = False) -> torch.Tensor:
    """Write ``softmax(scale q k^T) v`` into ``out`` and return it.

    Args:
        q: ``(B, Hq, Nq, D)``; k, v: ``(B, Hk, Nk, D)`` with ``Hq % Hk == 0``; out: ``(B, Hq, Nq, D)``.
            Any strides with unit stride in the head dim (e.g. ``(B, N, H, D)`` tensors transposed).
        scale: softmax scale; precision: ``"half"`` or ``"hybrid"``; shift: ``True`` PASA, ``False``
            plain FA, ``"exact"`` the exact shift (key blocks of ``block_n``, centred by a pre-pass);
        beta: PASA's shift strength in (0, 1) (unused by plain FA and the exact shift).
        shift_k: PASA only: ``"fused"`` shifts key tiles inside the loop, ``"prepass"`` shifts keys
            once per head (``shift_k.py``) into a buffer, ``"auto"`` uses the pre-pass when a head has
            more than 128 query rows (several query blocks reuse every shifted tile) or the head dim
            is above 128 (an fp32 key tile of 128 x 256 does not fit the registers).
        block_n: PASA's key block n (default ``PASA_BLOCK_N`` = 128, as the reference); changes the
            result.
        config: fixed meta-parameters (``BLOCK_M``, ``num_warps``, ``num_stages``, and ``BLOCK_N`` for
            plain FA) instead of autotuning (ignored under the interpreter).
        exp2_f16x2: half only, inline-PTX ``ex2.approx.f16x2`` (ablation; not under the interpreter).
    """
    _validate(q, k, v, out, precision)
    if not (isinstance(shift, bool) or shift == "exact"):
        raise ValueError(f"pasa_forward: shift must be True, False or 'exact', got shift={shift!r}")
    exact = shift == "exact"
    if exact:
        shift = False
    if shift_k not in SHIFT_K_MODES:
        raise ValueError(f"pasa_forward: unknown shift_k={shift_k!r}; expected one of {SHIFT_K_MODES}")
    if exp2_f16x2 and exact:
        raise ValueError("pasa_forward: exp2_f16x2 is an ablation of PASA and plain FA, not of shift='exact'")
    if exp2_f16x2 and (precision != "half" or INTERPRET):
        raise ValueError("pasa_forward: exp2_f16x2 needs precision='half' on a GPU (inline PTX)")
    batch, h_q, n_q, head_dim = q.shape
    h_k, n_k = k.shape[1], k.shape[2]
    block_d = _pow2_tile(head_dim)

    consts = dict(a_full=0.0, c_full=0.0, a_tail=0.0, c_tail=0.0, gamma=0.0, tail_ratio=1.0)
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, SHIFT=bool(shift), HALF_STATE=precision == "half",
                EXP2_F16X2=bool(exp2_f16x2), SHIFT_IN_LOOP=True, EXACT_SHIFT=exact,
                INTERPRET_BF16=INTERPRET and q.dtype == torch.bfloat16)
    k_src = k
    centres = q  # read only by the exact shift
    if shift:
        block_n = PASA_BLOCK_N if block_n is None else int(block_n)
        # Up to block_n keys form one block of n_j = Nk keys whatever the tile: a smaller tile gives
        # the same result with less padding (temporal attention: Nk = 14 or 25).
        block_n = min(block_n, _pow2_tile(n_k))
        a_full, c_full, a_tail, c_tail, gam, ratio = _shift_constants(float(beta), n_k, block_n, q.dtype, float(scale))
        consts.update(a_full=a_full, c_full=c_full, a_tail=a_tail, c_tail=c_tail, gamma=gam, tail_ratio=ratio)
        meta["BLOCK_N"] = block_n
        meta["ONE_BLOCK"] = n_k <= block_n
        use_prepass = shift_k == "prepass" or (shift_k == "auto" and (n_q > 128 or block_d > 128))
        if use_prepass:
            k_src = torch.empty((batch, h_k, n_k, head_dim), dtype=k.dtype, device=k.device)
            shift_k_kernel[(batch * h_k, triton.cdiv(n_k, block_n))](
                k, k_src, *_strides3(k), *_strides3(k_src), h_k, n_k,
                a_full, c_full, a_tail, c_tail,
                HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, INTERPRET_BF16=meta["INTERPRET_BF16"],
                num_warps=4 if block_d <= 64 else 8)
            meta["SHIFT_IN_LOOP"] = False
    elif exact:
        block_n = PASA_BLOCK_N if block_n is None else int(block_n)
        block_n = min(block_n, _pow2_tile(n_k))  # one block of n_j = Nk keys when Nk <= block_n
        meta["BLOCK_N"] = block_n
        n_blocks = triton.cdiv(n_k, block_n)
        k_src = torch.empty((batch, h_k, n_k, head_dim), dtype=k.dtype, device=k.device)
        centres = torch.empty((batch, h_k, n_blocks, head_dim), dtype=torch.float32, device=k.device)
        centre_k_kernel[(batch * h_k, n_blocks)](
            k, k_src, centres, *_strides3(k), *_strides3(k_src), *_strides3(centres), h_k, n_k,
            torch.finfo(k.dtype).eps,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, EXACT_CENTRE=precision == "hybrid",
            INTERPRET_BF16=meta["INTERPRET_BF16"], num_warps=4 if block_d <= 64 else 8)
    elif block_n is not None:
        raise ValueError("pasa_forward: block_n is the shift block; it needs shift=True or 'exact'")

    args = (q, k_src, v, out, *_strides3(q), *_strides3(k_src), *_strides3(v), *_strides3(out),
            centres, *_strides3(centres),
            h_q, h_q // h_k, n_q, n_k, _bucket(n_q), _bucket(n_k), float(scale),
            consts["a_full"], consts["c_full"], consts["a_tail"], consts["c_tail"], consts["gamma"],
            consts["tail_ratio"])

    def grid(meta_):
        return (triton.cdiv(n_q, meta_["BLOCK_M"]) * batch * h_q,)

    if INTERPRET or config is not None:
        fixed = dict(INTERPRET_CONFIG if INTERPRET else config)
        if not (shift or exact):
            fixed.setdefault("BLOCK_N", 64)
        elif fixed.pop("BLOCK_N", meta["BLOCK_N"]) != meta["BLOCK_N"]:
            raise ValueError("pasa_forward: PASA's BLOCK_N is its shift block; pass block_n, not config['BLOCK_N']")
        pasa_fwd_kernel[grid](*args, **meta, **fixed)
    elif shift or exact:  # the shift block is BLOCK_N: not tuned
        _pasa_fwd_tuned[grid](*args, **meta)
    else:
        _flash_fwd_tuned[grid](*args, **meta)
    return out
