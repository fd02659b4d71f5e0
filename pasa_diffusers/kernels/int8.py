"""The exact shift in 8 bits: the portable attention kernel of ``precision="int8"`` / ``"fp8"`` on the codes.

It computes ``reference_int8.attention_from_codes`` (``reference_int8``'s module docstring states the math and
why each step) on any CUDA GPU Triton supports with INT8 ``tl.dot`` (sm_80+; FP8 ``P V`` needs sm_89+), and on
CPU tensors under ``TRITON_INTERPRET=1``, from the quantizing pre-pass's outputs (``quantize.prepare``, four
launches, which the router runs first; ``hopper_int8.py``'s Gluon kernel reads the same): this file's
:func:`int8_fwd_kernel` (:func:`attend`; the ``portable-int8`` entry of ``dispatch.TABLE``) is the fifth
launch: INT8 ``q k^T`` with int32 sums, the removed logits added in fp32 (a flagged block: ``q . (k - c_b)`` by
two 16-bit MMAs instead), online softmax in fp32, ``P V`` in the GEMM dtype or FP8 (``PV_FP8``).  With a block
mask (``SPARSE``, ``block_sparse.BlockSparseMask``) each query block visits only its kept key blocks
(:func:`_sparse_passes`); the pre-pass is the dense call's.

Head dims are padded to ``DP``, a power of two >= 32 (an INT8 MMA reduces over 32).  The kernel rounds where
the spec does but contracts products into FMAs and sums in its own order, so it matches the spec to fp32
rounding, not bit for bit.

``PV_FP8`` multiplies the e4m3 values of ``P`` and ``V`` widened to fp16 (:func:`_merge`).  The
interpreter's fp32 -> e4m3 conversion drops the carry of a rounding that crosses a power of two, so
there values are first rounded onto e4m3's grid in fp32 (``quantize._to_e4m3``).  bf16 goes through
``common.round_to`` / ``common.mma`` there as in the other kernels.  The measurements behind the configs and
the design choices below are in docs/notes/int8_kernel.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..rules import SHIFT_BLOCK
from .call import BlockSparseMask, Call, Kernel, Plan
from .common import INTERPRET, LN2, LOG2E, P_SHIFT, cdiv, kept_blocks, mask_args, mma, round_to, strides3
from .quantize import Prepared, _split, _to_e4m3
from .tuning import SMEM_LIMIT, autotuned, bucket, interpreter_autotunes

__all__ = ["int8_fwd_kernel", "attention_call", "attend", "INTERPRET_CONFIG", "CONFIG_POOL", "ENTRY"]

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


@triton.jit
def _sparse_passes(acc, l_i, m_i, q_codes, q, a_i, mu_u, kc_base, ks_base, sig_base, au_base, c_base, k_base,
                   flag_base, v_base, v8_base, vs, stride_kcn, stride_cj, stride_kn, stride_vn, stride_v8d, mc_ptr,
                   mi_ptr, off_z, off_hq, pid_m, stride_mcz, stride_mch, stride_mcq, stride_miz, stride_mih,
                   stride_miq, stride_mij, MASK_GROUP, MASK_BLOCK_Q, N_K, offs_j, offs_c, offs_d, d_valid, qk_scale,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CENTRE_BLOCK_: tl.constexpr, FALLBACK: tl.constexpr, PV_FP8: tl.constexpr,
                   INTERPRET_FP8: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """Step 4c on the kept key blocks of this program's query block (``common.kept_blocks``): per pass (the
    coded blocks, then with ``FALLBACK`` the 16-bit ones) the full tiles of each kept block of the pass's kind,
    ascending (tiles ``blk * per_block`` up to the full tiles' end; a block of the other kind: an empty range),
    then the ragged last tile (masked) if its block is kept and of the pass's kind.  Returns the state and the
    kept blocks' count."""
    count, indices = kept_blocks(mc_ptr, mi_ptr, off_z, off_hq, pid_m, stride_mcz, stride_mch, stride_mcq,
                                 stride_miz, stride_mih, stride_miq, MASK_GROUP, MASK_BLOCK_Q, BLOCK_M)
    per_block: tl.constexpr = CENTRE_BLOCK_ // BLOCK_N
    n_tiles = tl.cdiv(N_K, BLOCK_N)
    full_tiles = N_K // BLOCK_N
    last = tl.load(indices + (count - 1) * stride_mij, mask=count > 0, other=-1)
    ragged_kept = (last + 1) * per_block > full_tiles  # the last kept block holds the ragged tile
    if FALLBACK:
        last_kind = tl.load(flag_base + last, mask=count > 0, other=0).to(tl.int32)
    else:
        last_kind = 0
    for sixteen in tl.static_range(2 if FALLBACK else 1):
        for i in range(0, count):
            blk = tl.load(indices + i * stride_mij)
            lo = blk * per_block
            hi = tl.minimum(lo + per_block, full_tiles)
            if FALLBACK:
                hi = tl.where(tl.load(flag_base + blk).to(tl.int32) == sixteen, hi, lo)
            acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q_codes, q, a_i, mu_u, kc_base, ks_base, sig_base, au_base,
                                        c_base, k_base, flag_base, v_base, v8_base, vs, stride_kcn, stride_cj,
                                        stride_kn, stride_vn, stride_v8d, 0, lo, hi, N_K, offs_j, offs_c, offs_d,
                                        d_valid, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, CENTRE_BLOCK_, False,
                                        sixteen == 1, PV_FP8, INTERPRET_FP8, False, INTERPRET_BF16)
        tail = tl.where(ragged_kept & (last_kind == sixteen), full_tiles, n_tiles)
        acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q_codes, q, a_i, mu_u, kc_base, ks_base, sig_base, au_base,
                                    c_base, k_base, flag_base, v_base, v8_base, vs, stride_kcn, stride_cj,
                                    stride_kn, stride_vn, stride_v8d, 0, tail, n_tiles, N_K, offs_j, offs_c, offs_d,
                                    d_valid, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, CENTRE_BLOCK_, False,
                                    sixteen == 1, PV_FP8, INTERPRET_FP8, True, INTERPRET_BF16)
    return acc, l_i, m_i, count


@triton.jit(do_not_specialize=["N_Q", "N_K", "MASK_GROUP", "MASK_BLOCK_Q"])
def int8_fwd_kernel(
    q_ptr, qc_ptr, qs_ptr, mu_ptr, kc_ptr, ks_ptr, sig_ptr, a_ptr, c_ptr, k_ptr, flag_ptr, order_ptr, coded_ptr, v_ptr,
    v8_ptr, vs_ptr, o_ptr, lse_ptr,
    mc_ptr, mi_ptr, stride_mcz, stride_mch, stride_mcq, stride_miz, stride_mih, stride_miq, stride_mij,
    MASK_GROUP, MASK_BLOCK_Q,
    stride_qz, stride_qh, stride_qm, stride_qcz, stride_qch, stride_qcm, stride_qsz, stride_qsh,
    stride_kcz, stride_kch, stride_kcn, stride_ksz, stride_ksh, stride_az, stride_ah,
    stride_cz, stride_ch, stride_cj, stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn, stride_v8z, stride_v8h, stride_v8d,
    stride_oz, stride_oh, stride_om,
    H_Q, KV_GROUP, N_Q, N_K, NQ_BUCKET, NK_BUCKET, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CENTRE_BLOCK_: tl.constexpr, FALLBACK: tl.constexpr, PV_FP8: tl.constexpr, INTERPRET_FP8: tl.constexpr,
    STORE_LSE: tl.constexpr, SPARSE: tl.constexpr, INTERPRET_BF16: tl.constexpr,
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
    flagged blocks' tiles in 16 bits; no tile of either loop branches on a flag.  With ``SPARSE`` (a block mask,
    ``block_sparse.BlockSparseMask``: ``kv_counts`` at ``mc_ptr``, ``kv_indices`` at ``mi_ptr``, key blocks of
    ``CENTRE_BLOCK_`` keys, query blocks of ``MASK_BLOCK_Q`` rows, a multiple of ``BLOCK_M``;
    ``common.kept_blocks``) each pass walks the kept blocks of its query block instead, ascending: the tiles of
    those of its kind (a block of the other kind gives an empty range, no branch), the ragged last tile last if
    its block is kept: step 4c restricted to the kept blocks (``reference_int8.attention_from_codes``); the
    other keys are neither loaded nor multiplied.  A query block that keeps none stores zeros and ``lse = -inf``
    (``l_i`` read as 1).  With
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
    if SPARSE:
        acc, l_i, m_i, count = _sparse_passes(
            acc, l_i, m_i, q_codes, q, a_i, mu_u, kc_base, ks_base, sig_base, au_base, c_base, k_base, flag_base,
            v_base, v8_base, vs, stride_kcn, stride_cj, stride_kn, stride_vn, stride_v8d, mc_ptr, mi_ptr, off_z, off_hq,
            pid_m, stride_mcz, stride_mch, stride_mcq, stride_miz, stride_mih, stride_miq, stride_mij, MASK_GROUP,
            MASK_BLOCK_Q, N_K, offs_j, offs_c, offs_d, d_valid, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
            CENTRE_BLOCK_, FALLBACK, PV_FP8, INTERPRET_FP8, INTERPRET_BF16)
        l_i = tl.where(count > 0, l_i, 1.0)  # an empty query block: acc = 0, m_i = -inf
    else:
        coded_blocks, n_coded, n_16, coded_full, full_16 = tile_counts(flag_base, coded_ptr + pid_bh, N_K, BLOCK_N,
                                                                       CENTRE_BLOCK_, FALLBACK)
        for sixteen in tl.static_range(2 if FALLBACK else 1):  # step 4c: the coded tiles, then the 16-bit ones
            first = coded_blocks * sixteen
            n_pass = n_16 if sixteen else n_coded
            full = full_16 if sixteen else coded_full
            acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q_codes, q, a_i, mu_u, kc_base, ks_base, sig_base, au_base,
                                        c_base, k_base, order_base, v_base, v8_base, vs, stride_kcn, stride_cj,
                                        stride_kn, stride_vn, stride_v8d, first, 0, full, N_K, offs_j, offs_c, offs_d,
                                        d_valid, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, CENTRE_BLOCK_, FALLBACK,
                                        sixteen == 1, PV_FP8, INTERPRET_FP8, False, INTERPRET_BF16)
            acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q_codes, q, a_i, mu_u, kc_base, ks_base, sig_base, au_base,
                                        c_base, k_base, order_base, v_base, v8_base, vs, stride_kcn, stride_cj,
                                        stride_kn, stride_vn, stride_v8d, first, full, n_pass, N_K, offs_j, offs_c,
                                        offs_d, d_valid, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, CENTRE_BLOCK_,
                                        FALLBACK, sixteen == 1, PV_FP8, INTERPRET_FP8, True, INTERPRET_BF16)

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



def attention_call(q: torch.Tensor, prep: Prepared, out: torch.Tensor, *, scale: float,
                   lse: torch.Tensor | None = None, block_mask: BlockSparseMask | None = None) -> tuple[tuple, dict]:
    """``(args, meta)`` of :func:`int8_fwd_kernel` (launch 5) on ``prep``, without the tile config; ``block_mask``:
    ``None`` or a ``block_sparse.BlockSparseMask`` fitting the call (``block_k`` the centre block ``SHIFT_BLOCK``,
    ``block_q`` a multiple of every ``BLOCK_M``)."""
    batch, h_q, n_q, d = q.shape
    h_k, n_k = prep.k_codes.shape[1], prep.k_codes.shape[2]
    fp8 = prep.v_scale is not None
    v, v8 = (q, prep.v) if fp8 else (prep.v, prep.q_codes)  # the unread one is any tensor
    vs = prep.v_scale if fp8 else prep.q_scale
    lse_buf = prep.q_scale if lse is None else lse
    flags = (prep.k_codes,) * 3 if prep.flags is None else (prep.flags, prep.order, prep.coded)  # unread without
    args = (q, prep.q_codes, prep.q_scale, prep.mu, prep.k_codes, prep.k_scale, prep.sigma, prep.au, prep.centres,
            prep.k, *flags, v, v8, vs, out, lse_buf, *mask_args(block_mask, q),
            *strides3(q), *strides3(prep.q_codes), *prep.q_scale.stride()[:2],
            *strides3(prep.k_codes), *prep.k_scale.stride()[:2], *prep.au.stride()[:2], *strides3(prep.centres),
            *strides3(prep.k), *strides3(v), *strides3(v8), *strides3(out),
            h_q, h_q // h_k, n_q, n_k, bucket(n_q), bucket(n_k), float(scale))
    meta = dict(HEAD_DIM=d, BLOCK_D=prep.k_codes.shape[-1], CENTRE_BLOCK_=SHIFT_BLOCK, FALLBACK=prep.flags is not None,
                PV_FP8=fp8, INTERPRET_FP8=INTERPRET, STORE_LSE=lse is not None, SPARSE=block_mask is not None,
                INTERPRET_BF16=INTERPRET and q.dtype == torch.bfloat16)
    return args, meta


def attend(q: torch.Tensor, prep: Prepared, out: torch.Tensor, *, scale: float, config: dict | None = None,
           lse: torch.Tensor | None = None, block_mask: BlockSparseMask | None = None) -> torch.Tensor:
    """The attention kernel (launch 5) on ``quantize.prepare``'s outputs; writes ``out`` (B, Hq, Nq, D) (any
    strides, unit stride in D) and, given ``lse`` (a contiguous fp32 (B, Hq, Nq) tensor), each row's
    log-sum-exp.  ``config``: ``BLOCK_M``, ``BLOCK_N`` (a power of two >= 32 dividing 128), ``num_warps``,
    ``num_stages`` instead of autotuning (under the interpreter: over ``INTERPRET_CONFIG``, unless inside
    ``tuning.interpreter_autotuning``).  ``block_mask``: only its kept key blocks are visited
    (:func:`attention_call`; the config tuned for the dense call runs: ``SPARSE`` is not in the tuning key)."""
    batch, h_q, n_q = q.shape[:3]
    args, meta = attention_call(q, prep, out, scale=scale, lse=lse, block_mask=block_mask)

    def grid(meta_):
        return (cdiv(n_q, meta_["BLOCK_M"]) * batch * h_q,)

    if config is not None or (INTERPRET and not interpreter_autotunes()):
        fixed = {**INTERPRET_CONFIG, **(config or {})} if INTERPRET else dict(config)
        tile = fixed.get("BLOCK_N")
        if not (isinstance(tile, int) and 32 <= tile <= SHIFT_BLOCK and SHIFT_BLOCK % tile == 0):
            raise ValueError(f"int8.attend: config['BLOCK_N']={tile!r} must be a power of two >= 32 (an 8-bit MMA's "
                             f"depth) dividing the centre block {SHIFT_BLOCK}")
        if block_mask is not None and not (isinstance(fixed.get("BLOCK_M"), int)
                                           and block_mask.block_q % fixed["BLOCK_M"] == 0):
            raise ValueError(f"int8.attend: config['BLOCK_M']={fixed.get('BLOCK_M')!r} must divide "
                             f"block_mask.block_q={block_mask.block_q}")
        int8_fwd_kernel[grid](*args, **meta, **fixed)
    else:
        _fwd_tuned[grid](*args, **meta)
    return out


def unsuitable(call: Call) -> str | None:
    """The portable 8-bit kernel runs every 8-bit call the router lets through."""
    return None


def launch(call: Call, plan: Plan) -> None:
    """:func:`attend` on the quantizing pre-pass's outputs (``call.prep``)."""
    attend(call.q, call.prep, call.out, scale=call.scale, config=call.config, lse=call.lse, block_mask=call.block_mask)


ENTRY = Kernel("portable-int8", ("int8", "fp8"), ("exact",), launch, unsuitable, prepass="quantize")
