"""The portable kernel: fused forward attention for the exact shift, PASA and plain FlashAttention.

One Triton kernel, :func:`pasa_fwd_kernel`, its launch wrapper :func:`forward` and its configs.  The
kernel is FlashAttention-2's loop, written once (:func:`_attn_inner`, called for the full key blocks
and again, masked, for the ragged last one); each algorithm differs only in its logits helper
(``_logits_exact``, ``_logits_pasa``, ``_logits_flash``: the exponent of ``p``, the rescale ``alpha``
and the new row maximum) and each precision in its merge helper (``_merge``).  Switches:

- ``SHIFT``: ``"exact"`` (the exact shift, ``reference.exact_shift_reference``), ``"pasa"`` (the
  paper's PASA, ``reference.pasa_reference``) or ``"none"`` (plain FlashAttention);
- ``PRECISION``: ``"half"``, the fully-half pipeline (fp16 scores, ``P`` and ``P V`` accumulator; PASA
  and plain FA also keep the softmax state in fp16, the exact shift keeps ``l`` in fp32), or
  ``"hybrid"`` (fp16/bf16 GEMM inputs, fp32 state and accumulator);
- ``SHIFT_IN_LOOP``: the key tile is shifted (PASA) or centred (the exact shift, one key block only)
  inside the loop, or read from the pre-pass's buffer (``prepass.py``);
- ``ONE_BLOCK``: every key in one shift block (``N_K <= BLOCK_N``: temporal attention, short spatial
  sequences): PASA's offsets ``delta_1 = eps_1 = 0`` and its block mean is skipped (unless the LSE is
  stored); the exact shift centres its one key tile itself;
- ``STORE_LSE``: also store each row's log-sum-exp of the true logits (fp32, natural log) for ring
  attention's merge; off, the kernel is the same as without it (:func:`_row_lse` says per variant how
  the state relates to the true logits);
- ``SPARSE``: a block mask (``block_sparse.BlockSparseMask``): each query block visits only its kept key
  blocks, ascending (PASA counts the visited blocks); the others are neither loaded nor multiplied.

It runs every variant on every CUDA GPU Triton supports, and on CPU tensors under
``TRITON_INTERPRET=1`` (set before ``triton`` is first imported) with one fixed small configuration.
Which calls it serves is ``dispatch.py``'s choice.

Configs.  PASA's ``BLOCK_N`` is not tuned: it is the shift block (``rules.SHIFT_BLOCK``), which changes
the result (and the beta fixed point is solved for n = 128); nor is the exact shift's when it centres
its one key block inside the loop.  The autotuner picks ``BLOCK_M``, warps and stages.  Plain
FlashAttention also tunes ``BLOCK_N``, and so does the exact shift with keys centred by its pre-pass:
its tiles divide the centre block (each tile reads its block's centre), which does not change the
math, only the order of the online softmax's rescalings (a 64-key tile takes fewer registers than a
128-key one).  Configs whose tiles do not fit the shared memory of an sm_90 SM are pruned before
compiling (head dims above 128); the single-stage fallbacks serve head dim 256.  "short" configs serve
at most 32 query rows (SVD's temporal attention, N = 14 or 25), where 128-row tiles would be mostly
padding; their one- and two-warp configs keep every reduction of a 16-32 x 64 tile inside one warp.
The pools were tuned on the H200 at SVD's and the paper's shapes (docs/BENCHMARKS.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .call import NO_SHIFT, BlockSparseMask, Call, Kernel, Plan
from .common import INTERPRET, LN2, LOG2E, cdiv, centre_tile, kept_blocks, lse_arg, mask_args, mma, round_to, strides3
from .tuning import SMEM_LIMIT, autotuned, bucket, interpreter_autotunes, pow2_tile

__all__ = ["pasa_fwd_kernel", "forward", "kernel_call", "INTERPRET_CONFIG", "NO_SHIFT"]


@triton.jit
def _logits_exact(q, q32, k_blk, m_i, c_base, stride_cj, start_n, n_valid, offs_d, d_valid, N_K, qk_scale, G_ULP,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CENTRE_BLOCK: tl.constexpr, PRECISION: tl.constexpr,
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
        c_j = centre_tile(k32, n_valid[:, None], n_j, G_ULP, g_ty, PRECISION != "half", INTERPRET_BF16, 0, False)
        k_blk = round_to(k32 - c_j[None, :], g_ty, INTERPRET_BF16)
    else:
        c_j = tl.load(c_base + (start_n // CENTRE_BLOCK) * stride_cj + offs_d, mask=d_valid, other=0.0)
    r_j = tl.sum(q32 * c_j[None, :], axis=1) * qk_scale
    if PRECISION == "half":
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
def _logits_pasa(q, k_blk, m_i, avg_j, o_j, j, n_valid, N_K, start_n, a_shift, c_shift, gamma_st, tail_ratio_st,
                 gamma, tail_ratio, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                 SHIFT_IN_LOOP: tl.constexpr, ONE_BLOCK: tl.constexpr, MASKED: tl.constexpr,
                 STORE_LSE: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """PASA, in natural-log units.  Key block ``j`` (the ``j``-th block visited: 1, 2, 3, ...; under a block
    mask the kept blocks are counted, not the block index) holds ``n_j`` valid keys; ``a_shift, c_shift`` are the
    stored entries of ``scale (I - beta/n_j 11^T) = a I - c 11^T`` in the GEMM dtype (the full block's,
    or the ragged tail's in the masked call), ``gamma`` the full block's recovery factor, ``tail_ratio``
    = ``gamma_tail / gamma`` (all from ``shift_matrix.py``, computed on the host in float64):

        k_shift = a k_blk - c colsum(k_blk)        (fp32, rounded to g; or read from the pre-pass)
        s       = q k_shift^T                       (fp16 in half, fp32 in hybrid)
        mu_j    = rowmean of the n_j valid columns of s,   mu_hat_j = (gamma_j / gamma) mu_j
        avg_j   = avg_{j-1} + (mu_hat_j - avg_{j-1}) / j   (avg_1 = mu_hat_1)
        delta_j = gamma (mu_hat_j - avg_j),   eps_j = gamma (avg_{j-1} - avg_j)
        m_new   = max(m_i + eps_j, rowmax(s) + delta_j)
        x       = (s + delta_j - m_new) log2(e)    (fp32: one FMA per element)
        alpha   = exp(m_i + eps_j - m_new)
        o_j     = gamma_j mu_j - delta_j            (fp32 from the unrounded mean; STORE_LSE only)

    Block ``j``'s true logits are ``s + gamma mu_hat_j`` (the removed pseudo-average; exact when the
    stored entries are, e.g. head dim 64 with beta 0.9375).  The state stays in natural-log units, like
    the paper and ``reference.py``, so that ``scale`` (a power of two for head dims 16, 64, 256) keeps
    ``a, c`` exact.  With ``ONE_BLOCK``, ``avg_1 = mu_hat_1`` makes ``delta_1 = eps_1 = 0`` exactly and
    the block mean is not needed (the same result, bit for bit).  Hybrid keeps the shifted scores in
    fp32 (the paper rounds them to fp16 in its hybrid variant too; a shifted score above 65504, one key
    far from its block's mean, then turned the row into NaN where plain hybrid FlashAttention is
    finite: only the fully-FP16 variant needs fp16 scores).  ``o_j`` is the offset of block ``j``'s true
    logits over its softmax logits ``s + delta_j`` (``gamma avg_j`` in real arithmetic); the state
    after the last block is relative to the last ``o_j`` (``_row_lse``).  ``gamma``, ``tail_ratio``:
    the fp32 values of ``gamma_st``, ``tail_ratio_st``.
    """
    g_ty = q.dtype
    if SHIFT_IN_LOOP:
        k32 = k_blk.to(tl.float32)
        colsum = tl.sum(k32, axis=0)  # masked rows loaded as zero
        k_shift = round_to(a_shift * k32 - c_shift * colsum[None, :], g_ty, INTERPRET_BF16)
    else:
        k_shift = k_blk
    if PRECISION == "half":
        s = tl.dot(q, tl.trans(k_shift), out_dtype=tl.float16)
    else:
        s = mma(q, tl.trans(k_shift), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), INTERPRET_BF16)
    if ONE_BLOCK:
        if STORE_LSE:  # the one block's removed pseudo-average gamma_1 mu_1 is the whole offset
            if MASKED:
                mu32 = tl.sum(tl.where(n_valid[None, :], s.to(tl.float32), 0.0), axis=1) / (N_K - start_n)
                o_j = gamma * (mu32 * tail_ratio)
            else:
                o_j = gamma * (tl.sum(s.to(tl.float32), axis=1) * (1.0 / BLOCK_N))
        if MASKED:
            s = tl.where(n_valid[None, :], s, float("-inf"))
        delta_j = tl.zeros([BLOCK_M], s.dtype)
        eps_j = delta_j
    else:
        if MASKED:
            s_sum = tl.sum(tl.where(n_valid[None, :], s.to(tl.float32), 0.0), axis=1)
            mu32 = s_sum / (N_K - start_n)
            mu_hat = mu32.to(s.dtype) * tail_ratio_st
            s = tl.where(n_valid[None, :], s, float("-inf"))
        else:
            s_sum = tl.sum(s.to(tl.float32), axis=1)
            mu32 = s_sum * (1.0 / BLOCK_N)
            mu_hat = mu32.to(s.dtype)
        avg_prev = tl.where(j == 1, mu_hat, avg_j)
        avg_j = avg_prev + ((mu_hat - avg_prev) / j).to(s.dtype)
        delta_j = gamma_st * (mu_hat - avg_j)
        eps_j = gamma_st * (avg_prev - avg_j)
        if STORE_LSE:
            if MASKED:
                o_j = gamma * (mu32 * tail_ratio) - delta_j.to(tl.float32)
            else:
                o_j = gamma * mu32 - delta_j.to(tl.float32)
    m_prev = m_i + eps_j
    m_new = tl.maximum(m_prev, tl.max(s, axis=1).to(s.dtype) + delta_j)
    row_ref = (m_new.to(tl.float32) - delta_j.to(tl.float32)) * LOG2E
    x = s.to(tl.float32) * LOG2E - row_ref[:, None]
    alpha = tl.math.exp2((m_prev.to(tl.float32) - m_new.to(tl.float32)) * LOG2E)
    return x, alpha, m_new, avg_j, o_j


@triton.jit
def _logits_flash(q, k_blk, m_i, n_valid, scale_st, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  PRECISION: tl.constexpr, MASKED: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """Plain FlashAttention.  Half: ``s = fp16(q k^T) * scale`` in fp16, so ``|q.k| > 65504`` is inf and
    the output NaN (the naive control), natural-log units.  Hybrid: fp32 scores, ``m_i`` in log2 units
    and the exponent by one FMA (FlashAttention-2)."""
    if PRECISION == "half":
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
def _merge(acc, l_i, x, alpha, v_blk, SHIFT: tl.constexpr, PRECISION: tl.constexpr, INTERPRET_BF16: tl.constexpr):
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
    if PRECISION == "half":
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
def _row_lse(m_i, l_i, o_j, SHIFT: tl.constexpr, PRECISION: tl.constexpr):
    """The natural-log log-sum-exp of each row's true logits ``scale q . k`` (fp32) from the final state.

    The exact shift and plain FA in hybrid keep ``m_i`` in log2 units as the running maximum of the
    true logits (the exact shift's with ``r_j = qk_scale q . c_j`` added back in ``m_blk``):
    ``lse = (m_i + log2(l_i)) ln 2``.  Plain FA in half keeps fp16 ``m_i``, ``l_i`` in natural units
    (inf where a score overflowed): ``lse = m_i + ln(l_i)``.  PASA keeps them in natural units relative
    to the last block's offset ``o_j`` (``_logits_pasa``): ``lse = m_i + ln(l_i) + o_j``.
    """
    if SHIFT == "pasa":
        lse = m_i.to(tl.float32) + tl.log(l_i.to(tl.float32)) + o_j
    elif SHIFT == "none" and PRECISION == "half":
        lse = m_i.to(tl.float32) + tl.log(l_i.to(tl.float32))
    else:
        lse = (m_i + tl.math.log2(l_i)) * LN2
    return lse


@triton.jit
def _attn_inner(acc, l_i, m_i, avg_j, o_j, q, q32, k_base, v_base, c_base, stride_kn, stride_vn, stride_cj,
                lo, hi, visits, N_K, offs_j, offs_d, d_valid,
                scale_st, qk_scale, a_shift, c_shift, gamma_st, tail_ratio_st, gamma, tail_ratio, G_ULP,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CENTRE_BLOCK: tl.constexpr, SHIFT: tl.constexpr, SHIFT_IN_LOOP: tl.constexpr,
                PRECISION: tl.constexpr, ONE_BLOCK: tl.constexpr, MASKED: tl.constexpr,
                STORE_LSE: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """The key loop over ``[lo, hi)`` in steps of ``BLOCK_N``: load a K/V tile (masking rows past
    ``N_K`` when ``MASKED``), the algorithm's logits, the precision's merge.  ``visits``: the key blocks
    visited before ``lo`` (PASA's block count ``j`` goes on from it).  ``o_j`` (PASA with ``STORE_LSE``
    only) is the last block's offset of the true logits over the softmax logits."""
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
                                            PRECISION, SHIFT_IN_LOOP, MASKED, INTERPRET_BF16)
        elif SHIFT == "pasa":
            j = visits + (start_n - lo) // BLOCK_N + 1
            x, alpha, m_new, avg_j, o_j = _logits_pasa(q, k_blk, m_i, avg_j, o_j, j, n_valid, N_K, start_n, a_shift,
                                                       c_shift, gamma_st, tail_ratio_st, gamma, tail_ratio, BLOCK_M,
                                                       BLOCK_N, PRECISION, SHIFT_IN_LOOP, ONE_BLOCK, MASKED,
                                                       STORE_LSE, INTERPRET_BF16)
        else:
            x, alpha, m_new = _logits_flash(q, k_blk, m_i, n_valid, scale_st, qk_scale, BLOCK_M, BLOCK_N,
                                            PRECISION, MASKED, INTERPRET_BF16)
        acc, l_i = _merge(acc, l_i, x, alpha, v_blk, SHIFT, PRECISION, INTERPRET_BF16)
        m_i = m_new
    return acc, l_i, m_i, avg_j, o_j


@triton.jit(do_not_specialize=["N_Q", "N_K", "MASK_GROUP", "MASK_BLOCK_Q"])
def pasa_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_oz, stride_oh, stride_om,
    c_ptr, stride_cz, stride_ch, stride_cj,
    mc_ptr, mi_ptr, stride_mcz, stride_mch, stride_mcq, stride_miz, stride_mih, stride_miq, stride_mij,
    MASK_GROUP, MASK_BLOCK_Q,
    H_Q, KV_GROUP, N_Q, N_K,
    NQ_BUCKET, NK_BUCKET,  # autotune keys only
    scale, a_full, c_full, a_tail, c_tail, gamma, tail_ratio, G_ULP,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CENTRE_BLOCK: tl.constexpr,
    SHIFT: tl.constexpr, SHIFT_IN_LOOP: tl.constexpr, PRECISION: tl.constexpr,
    ONE_BLOCK: tl.constexpr, STORE_LSE: tl.constexpr, SPARSE: tl.constexpr, MASK_BLOCK_K: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
):
    """``out = softmax(scale q k^T) v`` for one block of ``BLOCK_M`` query rows of one (batch, head), and
    with ``STORE_LSE`` ``lse = logsumexp(scale q k^T)`` per row (fp32, natural log; ``_row_lse``) into
    the contiguous (B, Hq, Nq) buffer at ``lse_ptr``.

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
        c_j (BLOCK_D,) fp32 (the exact shift's centre of the ``CENTRE_BLOCK`` keys that hold the tile);
        o_j (BLOCK_M,) fp32 (PASA's offset of the true logits, for the LSE only).
    ``BLOCK_D`` is ``HEAD_DIM`` rounded up to a power of two >= 16; padded columns load as zero.

    The key loop runs twice: the full blocks without masks, then the ragged last block (if any) with
    row masks, its own shift entries and its own ``n_j``.  With ``SPARSE`` (a block mask,
    ``block_sparse.BlockSparseMask``: ``kv_counts`` at ``mc_ptr``, ``kv_indices`` at ``mi_ptr``, key blocks
    of ``MASK_BLOCK_K`` keys, a multiple of ``BLOCK_N``, query blocks of ``MASK_BLOCK_Q`` rows, a multiple of
    ``BLOCK_M``; ``common.kept_blocks``) it walks only the kept key blocks of its query block, ascending: the
    full tiles of each without masks, then the ragged last tile if its block is kept; the other keys are
    neither loaded nor multiplied.  PASA's block count ``j`` then counts the kept blocks.  A query block that
    keeps none stores zeros and ``lse = -inf`` (``l_i`` read as 1: ``acc`` and ``m_i`` are untouched, 0 and
    ``-inf``).  Grid: one program per (query block,
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

    if PRECISION == "half" and SHIFT != "exact":
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
    o_j = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float16 if PRECISION == "half" else tl.float32)
    qk_scale = scale * LOG2E
    q32 = q.to(tl.float32)
    if SHIFT == "exact" and PRECISION == "half":
        # pre-scaled once (natural units, as the reference: the same fp16 q_s and scores); the fp16
        # product then stays in range
        q = (q32 * scale).to(tl.float16)

    n_full_keys = (N_K // BLOCK_N) * BLOCK_N
    if SPARSE:
        count, indices = kept_blocks(mc_ptr, mi_ptr, off_z, off_hq, pid_m, stride_mcz, stride_mch, stride_mcq,
                                     stride_miz, stride_mih, stride_miq, MASK_GROUP, MASK_BLOCK_Q, BLOCK_M)
        for i in range(0, count):  # the kept blocks' full tiles
            lo = tl.load(indices + i * stride_mij) * MASK_BLOCK_K
            acc, l_i, m_i, avg_j, o_j = _attn_inner(
                acc, l_i, m_i, avg_j, o_j, q, q32, k_base, v_base, c_base, stride_kn, stride_vn, stride_cj,
                lo, tl.minimum(lo + MASK_BLOCK_K, n_full_keys), i, N_K, offs_j, offs_d, d_valid,
                scale_st, qk_scale, a_full, c_full, gamma_st, tail_ratio_st, gamma, tail_ratio, G_ULP,
                HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CENTRE_BLOCK, SHIFT, SHIFT_IN_LOOP, PRECISION, ONE_BLOCK, False,
                STORE_LSE, INTERPRET_BF16)
        last = tl.load(indices + (count - 1) * stride_mij, mask=count > 0, other=-1)
        tail_lo = tl.where((last + 1) * MASK_BLOCK_K > n_full_keys, n_full_keys, N_K)  # N_K: no ragged tile kept
        tail_visits = count - 1
    else:
        acc, l_i, m_i, avg_j, o_j = _attn_inner(
            acc, l_i, m_i, avg_j, o_j, q, q32, k_base, v_base, c_base, stride_kn, stride_vn, stride_cj,
            0, n_full_keys, 0, N_K, offs_j, offs_d, d_valid,
            scale_st, qk_scale, a_full, c_full, gamma_st, tail_ratio_st, gamma, tail_ratio, G_ULP,
            HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CENTRE_BLOCK, SHIFT, SHIFT_IN_LOOP, PRECISION, ONE_BLOCK, False,
            STORE_LSE, INTERPRET_BF16)
        tail_lo = n_full_keys
        tail_visits = n_full_keys // BLOCK_N
    acc, l_i, m_i, avg_j, o_j = _attn_inner(
        acc, l_i, m_i, avg_j, o_j, q, q32, k_base, v_base, c_base, stride_kn, stride_vn, stride_cj,
        tail_lo, N_K, tail_visits, N_K, offs_j, offs_d, d_valid,
        scale_st, qk_scale, a_tail, c_tail, gamma_st, tail_ratio_st, gamma, tail_ratio, G_ULP,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CENTRE_BLOCK, SHIFT, SHIFT_IN_LOOP, PRECISION, ONE_BLOCK, True,
        STORE_LSE, INTERPRET_BF16)
    if SPARSE:  # an empty query block: acc = 0, m_i = -inf; out = 0, lse = -inf
        l_i = tl.where(count > 0, l_i, 1.0)

    inv_l = 1.0 / l_i.to(tl.float32)  # one division per row, then products
    out = round_to(acc.to(tl.float32) * inv_l[:, None], o_ptr.dtype.element_ty, INTERPRET_BF16)
    o_ptrs = o_base + offs_m[:, None] * stride_om + offs_d[None, :]
    if BLOCK_D == HEAD_DIM:
        tl.store(o_ptrs, out, mask=m_valid[:, None])
    else:
        tl.store(o_ptrs, out, mask=m_valid[:, None] & d_valid[None, :])
    if STORE_LSE:
        tl.store(lse_ptr + pid_bh.to(tl.int64) * N_Q + offs_m, _row_lse(m_i, l_i, o_j, SHIFT, PRECISION),
                 mask=m_valid)


AUTOTUNE_KEY = ["HEAD_DIM", "NQ_BUCKET", "NK_BUCKET", "PRECISION", "SHIFT", "SHIFT_IN_LOOP", "ONE_BLOCK",
                "CENTRE_BLOCK", "BLOCK_N"]
"""The kernel arguments a tuned config is chosen by (the tiled pool tunes BLOCK_N, so it drops the last one).
``STORE_LSE`` is not among them, and the LSE pointer has one dtype whether stored or not
(``common.lse_arg``): a call that stores the LSE runs the config tuned without it (one masked row store
more), with the same output bits.  Nor is ``SPARSE`` (the mask's arguments have one dtype with or without a
mask: ``common.mask_args``): a call with a block mask runs the dense call's config."""

INTERPRET_CONFIG = {"BLOCK_M": 64, "num_warps": 4, "num_stages": 1}
"""The interpreter's fixed configuration (plus BLOCK_N: the shift block, or 64 for plain FA), which a
``config`` given to :func:`forward` overrides."""

SMALL_TILE = 64
"""The largest key-tile extent (keys and head dim) a config of fewer than 4 warps may take."""


def _configs(entries, with_block_n: bool) -> list[triton.Config]:
    if with_block_n:
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in entries]
    return [triton.Config({"BLOCK_M": bm}, num_warps=w, num_stages=s) for bm, w, s in entries]


# (BLOCK_M, [BLOCK_N,] num_warps, num_stages) per pool: "long" query sequences, "short" ones (at most
# 32 rows), "fallback" for head dim 256, whose tiles fit shared memory only single-stage.  The single-stage
# long configs are for keys of one block (cross-attention to a short text: one key tile per program), where
# the buffers of a deeper pipeline would only limit how many programs share an SM.
_SHIFT_CONFIGS = {
    "long": _configs([(128, 8, 3), (128, 8, 2), (64, 4, 3), (128, 8, 1), (64, 4, 1)], False),
    "short": _configs([(32, 1, 2), (16, 1, 2), (32, 2, 2), (64, 4, 2)], False),
    "fallback": _configs([(64, 4, 1), (64, 8, 1)], False),
}
_TILED_CONFIGS = {
    "long": _configs([(128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3)], True),
    "short": _configs([(32, 32, 1, 2), (16, 32, 1, 2), (32, 32, 2, 2), (64, 64, 4, 2)], True),
    "fallback": _configs([(64, 64, 4, 2), (64, 64, 8, 2)], True),
}


def _smem_bytes(cfg: triton.Config, block_n: int, block_d: int) -> int:
    """Shared memory of a config as Triton 3.x lays it out on sm_90: q once, k and v per stage."""
    bn = cfg.kwargs.get("BLOCK_N", block_n)
    return 2 * block_d * (cfg.kwargs["BLOCK_M"] + 2 * bn * cfg.num_stages)


def _fits(cfg: triton.Config, block_n: int, block_d: int) -> bool:
    """Whether a config's tiles fit shared memory, and, with fewer than 4 warps, a 64 x 64 key tile
    (a one-warp program with a 128 x 128 tile spills and takes ptxas minutes to compile)."""
    bn = cfg.kwargs.get("BLOCK_N", block_n)
    small_tile = bn <= SMALL_TILE and block_d <= SMALL_TILE
    return _smem_bytes(cfg, block_n, block_d) <= SMEM_LIMIT and (cfg.num_warps >= 4 or small_tile)


def _with_block_n(cfg: triton.Config, block_n: int) -> triton.Config:
    """``cfg`` with its key tile set to ``block_n``."""
    return triton.Config({**cfg.kwargs, "BLOCK_N": block_n}, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _prune(configs, named_args, **kwargs):
    """The short- or long-query configs that fit (``_fits``); the single-stage fallbacks if none.  The
    exact shift's tiles divide its centre block (``CENTRE_BLOCK``); tiles of the whole block if none do."""
    tiled = "BLOCK_N" in configs[0].kwargs
    table = _TILED_CONFIGS if tiled else _SHIFT_CONFIGS
    block_d, block_n = kwargs["BLOCK_D"], kwargs.get("BLOCK_N", 64)
    pool = table["short"] if named_args["NQ_BUCKET"] <= 32 else table["long"]
    if tiled and kwargs["SHIFT"] == "exact":
        centre = kwargs["CENTRE_BLOCK"]
        pool = [c for c in pool if centre % c.kwargs["BLOCK_N"] == 0] or [_with_block_n(c, centre) for c in pool]
    fitting = [c for c in pool if _fits(c, block_n, block_d)]
    if fitting:
        return fitting
    fallback = table["fallback"]
    if tiled and kwargs["SHIFT"] == "exact":
        fallback = [_with_block_n(c, min(c.kwargs["BLOCK_N"], kwargs["CENTRE_BLOCK"])) for c in fallback]
    return [c for c in fallback if _smem_bytes(c, block_n, block_d) <= SMEM_LIMIT] or fallback[:1]


def _pool(table: dict[str, list[triton.Config]]) -> list[triton.Config]:
    return [c for cs in table.values() for c in cs]


# the pool of the variants whose tile is their shift block (PASA, the exact shift centring in the loop),
# and the tiled pool, which also tunes BLOCK_N (plain FA, the exact shift with pre-centred keys); names in
# the shipped tables (tuning.py)
_shift_fwd_tuned = autotuned(pasa_fwd_kernel, _pool(_SHIFT_CONFIGS), AUTOTUNE_KEY, _prune, name="portable.shift")
_tiled_fwd_tuned = autotuned(pasa_fwd_kernel, _pool(_TILED_CONFIGS), AUTOTUNE_KEY[:-1], _prune, name="portable.tiled")


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *, scale: float, shift: str,
            precision: str, block_n: int, one_block: bool, keys_prepared: bool, centres: torch.Tensor | None = None,
            shift_constants: tuple[float, ...] = NO_SHIFT, config: dict | None = None,
            lse: torch.Tensor | None = None, block_mask: BlockSparseMask | None = None) -> torch.Tensor:
    """Write ``softmax(scale q k^T) v`` into ``out`` (and each row's log-sum-exp into ``lse``) and return ``out``.

    Resolved arguments (``dispatch.forward`` checks and plans the call):
        q: ``(B, Hq, Nq, D)``; k, v: ``(B, Hk, Nk, D)`` with ``Hq % Hk == 0``; out: ``(B, Hq, Nq, D)``;
            any strides with unit stride in the head dim.  ``k`` holds the raw keys, or, with
            ``keys_prepared``, the pre-pass's shifted (PASA) or centred (the exact shift) keys.
        scale: softmax scale; shift: ``"exact"``, ``"pasa"`` or ``"none"``; precision: ``"hybrid"``
            or ``"half"``.
        block_n: the shift block, already at most the keys' tile (unused by plain FA); one_block: all
            keys in one shift block.
        centres: the exact shift's pre-pass centres (B, Hk, key blocks, D) fp32, with ``keys_prepared``.
        shift_constants: PASA's ``shift_matrix.shift_constants`` ``(a_full, c_full, a_tail, c_tail, gamma,
            tail_ratio)``.
        config: fixed meta-parameters (``BLOCK_M``, ``num_warps``, ``num_stages``, and ``BLOCK_N`` for
            plain FA and for the exact shift with pre-centred keys, where it divides ``block_n``)
            instead of autotuning (under the interpreter: over ``INTERPRET_CONFIG``, whose
            ``num_warps`` and ``num_stages`` it ignores).
        lse: ``None``, or a contiguous fp32 ``(B, Hq, Nq)`` buffer for the natural-log log-sum-exp of each
            row's true logits ``scale q . k`` (``STORE_LSE``).
        block_mask: ``None``, or a ``block_sparse.BlockSparseMask`` fitting the call, ``block_k`` the shift
            block (``block_n``; ``rules.SHIFT_BLOCK`` for plain FA, whose tiles divide it) and ``block_q`` a
            multiple of every ``BLOCK_M``: only the kept key blocks are visited (``SPARSE``).  It runs the
            config tuned for the dense call (``SPARSE`` is not in the tuning key), so an all-kept mask gives the
            dense call's bits.
    """
    fn = "portable.forward"
    batch, h_q, n_q = q.shape[:3]
    args, meta, tiled = kernel_call(q, k, v, out, scale=scale, shift=shift, precision=precision, block_n=block_n,
                                    one_block=one_block, keys_prepared=keys_prepared, centres=centres,
                                    shift_constants=shift_constants, lse=lse, block_mask=block_mask)

    def grid(meta_):
        return (cdiv(n_q, meta_["BLOCK_M"]) * batch * h_q,)

    if config is not None or (INTERPRET and not interpreter_autotunes()):
        fixed = {**INTERPRET_CONFIG, **(config or {})} if INTERPRET else dict(config)
        if shift == "none":
            fixed.setdefault("BLOCK_N", 64)
        elif tiled:
            tile = fixed.setdefault("BLOCK_N", block_n)
            if not (isinstance(tile, int) and tile >= 16 and block_n % tile == 0):
                raise ValueError(f"{fn}: config['BLOCK_N']={tile!r} must be a power of two >= 16 that divides the "
                                 f"exact shift's centre block block_n={block_n}")
        elif fixed.pop("BLOCK_N", block_n) != block_n:
            raise ValueError(f"{fn}: this variant's BLOCK_N is its shift block; pass block_n, not config['BLOCK_N']")
        if block_mask is not None:
            _check_mask_tiles(fn, block_mask, fixed.get("BLOCK_M"), fixed.get("BLOCK_N", block_n))
        pasa_fwd_kernel[grid](*args, **meta, **fixed)
    elif tiled:
        _tiled_fwd_tuned[grid](*args, **meta)
    else:  # the shift block is BLOCK_N: not tuned
        _shift_fwd_tuned[grid](*args, **meta)
    return out


def _check_mask_tiles(fn: str, block_mask: BlockSparseMask, block_m: object, block_n: object) -> None:
    """A fixed config's tiles must lie inside the mask's blocks: ``BLOCK_M`` divides ``block_q``, ``BLOCK_N``
    divides ``block_k`` (the autotuned pools' tiles always do: at most ``rules.MASK_QUERY_TILE`` and the shift
    block)."""
    if not (isinstance(block_m, int) and block_mask.block_q % block_m == 0):
        raise ValueError(f"{fn}: config['BLOCK_M']={block_m!r} must divide block_mask.block_q={block_mask.block_q}")
    if not (isinstance(block_n, int) and block_mask.block_k % block_n == 0):
        raise ValueError(f"{fn}: config['BLOCK_N']={block_n!r} must divide block_mask.block_k={block_mask.block_k}")


def kernel_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *, scale: float, shift: str,
                precision: str, block_n: int, one_block: bool, keys_prepared: bool,
                centres: torch.Tensor | None = None, shift_constants: tuple[float, ...] = NO_SHIFT,
                lse: torch.Tensor | None = None,
                block_mask: BlockSparseMask | None = None) -> tuple[tuple, dict, bool]:
    """``(args, meta, tiled)`` of :func:`pasa_fwd_kernel` for :func:`forward`'s arguments, without the tile
    config (``BLOCK_N`` in ``meta`` where it is the shift block; ``tiled``: the config tunes it)."""
    batch, h_q, n_q, head_dim = q.shape
    h_k, n_k = k.shape[1], k.shape[2]
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=pow2_tile(head_dim), SHIFT=shift, PRECISION=precision,
                SHIFT_IN_LOOP=not keys_prepared, ONE_BLOCK=shift != "none" and one_block,
                CENTRE_BLOCK=block_n if shift == "exact" else 0, STORE_LSE=lse is not None,
                SPARSE=block_mask is not None, MASK_BLOCK_K=0 if block_mask is None else block_mask.block_k,
                INTERPRET_BF16=INTERPRET and q.dtype == torch.bfloat16)
    # Plain FA and the exact shift with pre-centred keys tune their tile of keys (the exact shift's
    # divides its centre block); PASA's tile is its shift block, and so is the in-loop centring's.
    tiled = shift == "none" or (shift == "exact" and keys_prepared)
    if not tiled:
        meta["BLOCK_N"] = block_n
    if centres is None:
        centres = q  # read only by the exact shift's pre-pass path
    args = (q, k, v, out, lse_arg(lse, q.device), *strides3(q), *strides3(k), *strides3(v), *strides3(out),
            centres, *strides3(centres), *mask_args(block_mask, q),
            h_q, h_q // h_k, n_q, n_k, bucket(n_q), bucket(n_k), float(scale), *shift_constants,
            torch.finfo(q.dtype).eps)
    return args, meta, tiled


PASA_PREPASS_ROWS = 128
"""PASA shifts its keys by the pre-pass when a head has more query rows than this (several query blocks
then reuse every shifted tile) or the head dim's tile is above 128 (an fp32 key tile of 128 x 256 does
not fit the registers)."""


def prepass(call: Call) -> str | None:
    """The pre-pass this kernel runs ``call`` with: the exact shift centres keys of several blocks first
    (``prepass=None``) or as ``prepass`` says; PASA shifts them first above :data:`PASA_PREPASS_ROWS` query rows
    or a head dim's tile above 128 (or as ``prepass`` says); plain FlashAttention has none."""
    shift, asked = call.variant.shift, call.prepass
    if shift == "exact":
        return "centre" if (not call.one_block if asked is None else asked) else None
    if shift == "pasa":
        if asked is None:
            asked = call.q.shape[2] > PASA_PREPASS_ROWS or pow2_tile(call.q.shape[-1]) > 128
        return "shift" if asked else None
    return None


def unsuitable(call: Call) -> str | None:
    """Why the portable kernel cannot run ``call``, or ``None``: only the exact shift with ``prepass=False``
    on keys of several blocks."""
    if call.variant.shift == "exact" and call.prepass is False and not call.one_block:
        return (f"prepass=False: it centres keys inside the loop only when all {call.k.shape[2]} keys form one "
                f"block of at most {call.shift_block}")
    return None


def launch(call: Call, plan: Plan) -> None:
    """:func:`forward` on ``call``'s keys (raw, or the pre-pass's centred / shifted copy)."""
    forward(call.q, call.keys, call.v, call.out, scale=call.scale, shift=call.variant.shift,
            precision=call.variant.precision, block_n=plan.block_n, one_block=plan.one_block,
            keys_prepared=plan.prepass is not None, centres=call.centres, shift_constants=call.constants,
            config=call.config, lse=call.lse, block_mask=call.block_mask)


ENTRY = Kernel("portable", ("hybrid", "half"), ("exact", "pasa", "none"), launch, unsuitable, prepass=prepass)
