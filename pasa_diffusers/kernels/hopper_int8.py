"""The exact shift in 8 bits for Hopper (sm_90), by hand in Gluon: the attention of ``precision="int8"`` and
``precision="fp8"`` in the warp-specialised structure of ``hopper.py``.

One Gluon kernel, :func:`int8_fwd_gluon_kernel`, its launch wrapper :func:`forward` and
:func:`unsuitable_reason`.  It reads the pre-pass's outputs (``quantize.prepare``: the codes, their scales and
corrections, the centres, V8^T with its channel scales for FP8 ``P V``, the flags of the 16-bit blocks; those
blocks read the input keys, which the consumers split into ``hi``/``lo`` themselves) and computes
``reference_int8.attention_from_codes`` as ``int8.int8_fwd_kernel`` does, up to fp32 rounding (FMA contraction,
``ex2.approx``, the tensor cores' sums; under the lazy rescale the ``p`` are rounded at another offset).  The tiles
come in the spec's order (step 4c, the pre-pass's ``order`` and ``coded``): the coded blocks' tiles first, in a
loop with no branch on a flag, then the flagged blocks' tiles in a loop of their own.  With a block mask
(``SPARSE``, ``block_sparse.BlockSparseMask``) a program visits only its query block's kept key blocks, one
``BLOCK_N = 128`` tile each, in the same order per query block (:func:`visit_order`: the kept coded blocks
ascending, then the kept flagged ones); a query block that keeps none gets zeros and ``lse = -inf``.  Per key tile
of ``BLOCK_N`` keys inside centre block ``b`` (``qk_scale = u``, the spec's ``fp32(scale) log2(e)`` in fp32, ``a_i
= q_scale_i qk_scale / DP``, ``mu_u_i = mu_i qk_scale``, per key ``ks_j``, ``sigma_j``, ``uA_j``):

    r      = qk_scale fp32(q . c_b)                       (per row: column b mod 16 of a (64, 16) wgmma over the
                                                           centres of b's group of 16 blocks, redone when the
                                                           group changes)
    I      = q_codes k_codes^T                            (INT8 wgmma, exact int32; to fp32 exactly:
                                                           |I| <= 128 127^2 < 2^24)
    d      = fp32(I) ks_j + (mu_u_i / a_i) sigma_j + (1 / a_i) uA_j
                                                          (the bias on the tensor cores: one bf16 wgmma, K = 16,
                                                           of the row factors' and the pre-pass's bias rows'
                                                           bf16 parts onto fp32(I) ks_j; uA_j = qk_scale A_j)
    z      = a_i d  = (I ks_j) a_i + (mu_u_i sigma_j + uA_j)
             or, in a flagged block, qk_scale fp32(q . hi + q . lo)       (two 16-bit wgmmas)
    m_s    = rowmax z  (a_i rowmax d),  m_blk = m_s + r,  m_new = max(m_i, m_blk)
    x      = z - (m_s - (m_blk - m_new))  (one FMA from d),  alpha = exp2(m_i - m_new)
    16 bits: p = round_g(exp2(x)),               acc = alpha acc + p v_blk
    FP8:     p = e4m3(exp2(x + P_SHIFT)),        acc = alpha acc + fp32(p V8_blk)   (a fresh accumulator per tile)
    l_i    = alpha l_i + rowsum(exp2(x) [+ P_SHIFT]) in fp32 before the rounding,  m_i = m_new

and ``out = round_g(acc (1 / l_i))`` (FP8: ``acc (1 / l_i) vs``, V's per-channel scales), optionally ``lse = ln 2
(m_i + log2 l_i [- P_SHIFT])``.  Loop invariant: ``acc / l_i == softmax(scale q K^T) V`` over the keys seen so
far up to the codes' rounding, ``m_i`` the running maximum of the true logits in log2 units.  With ``LAZY``
(config ``lazy``, 16-bit ``P V``; FlashAttention-4's lazy rescale) ``m_new`` stays ``m_i`` on a tile where no row
of the warpgroup grows by more than ``LAZY_RESCALE``, and ``acc`` is then not touched (off in :data:`CONFIGS`;
why: docs/notes/int8_kernel.md).

Partitions (``gl.warp_specialize``; one program = ``64 NUM_CONSUMERS`` query rows of one (batch, head)):

- producer (the default partition, one warpgroup): TMA copies.  Each consumer's q codes (int8) and q
  (``g``, for ``q . c_b`` and the 16-bit blocks; its buffer takes the output at the end); per key tile
  ``i`` in visiting order into stage ``i % NUM_STAGES``: for a coded tile the key codes with the 16 centre
  rows of its block's group, the tile's ``ks`` (a 1-d copy) and its bias rows (``k_ready``); for a flagged
  tile the centre rows alone, and its keys (``g``) into the one-stage wide ring (``w_ready`` /
  ``w_empty``, phase = the count of flagged tiles before it); then v (``g``, or V8^T's (DP, BLOCK_N) e4m3 box;
  ``v_ready``).
- ``NUM_CONSUMERS`` consumer warpgroups of 64 rows, FA3's overlapped loop (:func:`_key_loop`,
  :func:`_key_loop_fp8`): per tile ``i`` the INT8 wgmma of ``I_i`` is issued and waited for, then its bias
  product and tile ``i - 1``'s ``P V``, both async; tile ``i``'s softmax runs while ``P V`` is on the tensor
  cores.  Then the
  flagged tiles (:func:`_sixteen_bit_loop`), synchronous: nothing is in flight while their 16-bit wgmmas run
  (the overlapped loop holds no branch around a wgmma: docs/notes/int8_kernel.md says why).  With ``PINGPONG``
  (config ``pingpong``, FA3's ping-pong) the consumers issue each coded tile's GEMMs in turns, so that one
  warpgroup's softmax runs while another's GEMMs hold the tensor cores.  FP8 ``P`` goes
  through shared memory (one (64, BLOCK_N) e4m3 tile per consumer, written once the ``P V`` reading it is
  done), since Triton 3.6's wgmma wait takes no 8-bit register operand as a dependency.

Shared memory per program: q codes (64, DP) int8 and q (64, DP) ``g`` per consumer, and one ``P8`` tile per
consumer with FP8 (one 16-column dummy without); the rings k codes (NUM_STAGES, BLOCK_N, DP) int8, centres
(NUM_STAGES, 16, DP) ``g``, v (NUM_STAGES, BLOCK_N, DP) ``g`` or V8^T (NUM_STAGES, DP, BLOCK_N) e4m3, ks
(NUM_STAGES, BLOCK_N) fp32, the bias rows (NUM_STAGES, BLOCK_N, 16) bf16; hi (the keys as copied, split in
place), lo (BLOCK_N, DP) ``g`` with ``FALLBACK`` (16-row dummies without).  Registers per consumer (NVMMA v3, 64
rows): I (64, BLOCK_N) int32, d the same in fp32 (its accumulator), p in ``g`` (the A operand of ``P V`` from
registers) or e4m3, acc (64, DP) fp32 (and FP8's per-tile product, the same), rc (64, 16) fp32, the bias
product's A side (64, 16) bf16 and a_i (64,) fp32, built once; ks (BLOCK_N,) fp32 read from shared memory per
tile.
``DP`` = 64 (head dim 64) or 128 (80 .. 128): the pre-pass pads its codes to ``DP`` columns, and the copy
engine pads q, v and the output tile past ``D`` (zeros in, clipped out).  Keys past ``N_K`` arrive as zero
codes (and zero V8 columns) and get ``z = -inf`` (``MASK_N``); rows past ``N_Q`` are computed and dropped by
the store.

Barriers as ``hopper.py``'s (its module docstring states the protocol); ``w_ready`` / ``w_empty`` follow it
with the count of flagged tiles in place of the tile index, and ``w_split`` (count: the consumers) holds each
consumer until all have split their rows of the tile; ``turn`` (one per consumer) carries the ping-pong's
turns (``gluon_common.wait_turn``).
"""
from __future__ import annotations

import functools
from types import MappingProxyType

import torch
import triton.language as tl

from ..rules import SHIFT_BLOCK
from .call import BlockSparseMask, Call, Kernel, Plan
from .common import INTERPRET, LN2, P_SHIFT, cdiv, log2_units, mask_args
from .gluon_common import (CENTRE_ROWS, PRODUCER_WARPS, ROWS_PER_CONSUMER, SHORT_KEYS, TensorDescriptor,
                           descriptor, descriptor_layout_problem, fence_async_shared, gl, gluon_jit, kept_config,
                           kept_descriptor, kept_row, mbarrier, operand_problem, pass_turn, program_rows, registers,
                           release, ring_barriers, round_p, row_shift, sm90_problem, tma, wait_turn, warpgroup_mma,
                           warpgroup_mma_wait)
from .launch import kept_launch
from .quantize import BIAS_K
from .tuning import SMEM_LIMIT

__all__ = ["int8_fwd_gluon_kernel", "forward", "kernel_call", "unsuitable_reason", "tuned_config", "shared_bytes",
           "visit_order", "CONFIGS", "SHORT_KEYS_CONFIG", "SHORT_KEYS"]

LAZY_RESCALE = tl.constexpr(8.0)
"""The growth of a row's maximum (log2 units) past which the lazy rescale moves it: ``p <= 2^8``, far inside
fp16's and bf16's range (FlashAttention-4's threshold)."""
CONFIGS = {64: {"BLOCK_N": 128, "num_stages": 2, "consumers": 2, "lazy": False, "pingpong": True},
           128: {"BLOCK_N": 128, "num_stages": 2, "consumers": 2, "lazy": False, "pingpong": False}}
"""The config per DP for more than :data:`SHORT_KEYS` keys: 128-key tiles, two consumers, the eager rescale
(the fastest on the H200); the consumers' GEMMs in turns at DP 64, where they gain 5-11 % at SVD's 2304 and 9216
keys and break even at CogVideoX's 17776 (H100, kernel alone), not at DP 128, where the instruction count sets the
time (the measurements: docs/notes/int8_kernel.md)."""
SHORT_KEYS_CONFIG = {"BLOCK_N": 64, "num_stages": 3, "consumers": 3, "lazy": False, "pingpong": False}
"""The config at DP 64 for at most :data:`SHORT_KEYS` keys: 64-key tiles, three consumers (docs/notes/int8_kernel.md)."""
A_FLOOR = tl.constexpr(2.0 ** -60)
"""The least row scale ``a_i`` the kernel divides by (a zero row, or a row past ``N_Q``, has ``a_i = 0``): the
logits ``a_i d`` then differ from ``a_i I ks_j + bias`` by at most ``2^-60 |I ks_j|``, and ``bias / a`` stays
finite for any ``|bias| < 2^68``."""
SPLIT_ROWS = tl.constexpr(16)
"""Rows of a flagged tile's keys one consumer splits into ``hi`` and ``lo`` at a time (:func:`_split_keys`)."""


@gluon_jit
def _tile_counts(flag_ptr, coded_ptr, N_K, BLOCK_N: gl.constexpr, SHIFT_BLOCK_N: gl.constexpr,
                 FALLBACK: gl.constexpr):
    """``(coded blocks, coded tiles, 16-bit tiles)`` of this (batch, query head) at ``BLOCK_N``-key tiles
    (``reference_int8`` step 4c; ``int8.tile_counts``): the last block may hold fewer tiles than the others."""
    n_tiles = gl.cdiv(N_K, BLOCK_N)
    if FALLBACK:
        per_block: gl.constexpr = SHIFT_BLOCK_N // BLOCK_N
        n_blocks = gl.cdiv(N_K, SHIFT_BLOCK_N)
        coded_blocks = gl.load(coded_ptr)
        last_flagged = gl.load(flag_ptr + n_blocks - 1).to(gl.int32)
        short = per_block * n_blocks - n_tiles
        return (coded_blocks, coded_blocks * per_block - short * (1 - last_flagged),
                (n_blocks - coded_blocks) * per_block - short * last_flagged)
    return n_tiles, n_tiles, 0


@gluon_jit
def _tile_start(visits, first, j, n, BLOCK_N: gl.constexpr, SHIFT_BLOCK_N: gl.constexpr, FALLBACK: gl.constexpr,
                SPARSE: gl.constexpr):
    """The first key of tile ``j`` of a pass of ``n`` tiles (0 past it), ``visits = (order, stride, ...)``: with
    ``SPARSE`` (one tile per block) the block ``order[(first + j) stride]`` of the query block's visit list; with
    ``FALLBACK`` in block ``order[first + j // (SHIFT_BLOCK_N / BLOCK_N)]``; else the ``j``-th tile of the keys."""
    order_ptr = visits[0]
    if SPARSE:
        blk = gl.load(order_ptr + (first + j) * visits[1], mask=j < n, other=0)
        return blk * SHIFT_BLOCK_N
    if FALLBACK:
        per_block: gl.constexpr = SHIFT_BLOCK_N // BLOCK_N
        blk = gl.load(order_ptr + first + j // per_block, mask=j < n, other=0)
        return blk * SHIFT_BLOCK_N + (j % per_block) * BLOCK_N
    return j * BLOCK_N


@gluon_jit
def _producer(descs, q_bufs, q8_bufs, q_ready, ring, bars, visits, off_z, off_hq, off_hk, start_m, key_row,
              SHIFT_BLOCK_N: gl.constexpr, FALLBACK: gl.constexpr, SPARSE: gl.constexpr, PV_FP8: gl.constexpr):
    """TMA copies only (module docstring).  ``descs = (q, q codes, k codes, v, centres, keys, ks, bias rows)``,
    ``ring = (k codes, v, centres, hi, lo, ks, bias rows)``, ``bars = (k_ready, k_empty, v_ready, v_empty,
    w_ready, w_empty, w_split, turn)``; ``visits = (order, stride, coded blocks, coded tiles, 16-bit tiles)``
    (the kernel's prologue: :func:`int8_fwd_gluon_kernel`); ``key_row``: the element of key 0 of this key head
    in the flat (1-d) ``ks``.  Ring slot ``i`` counts the coded tiles, then the 16-bit ones."""
    desc_q, desc_q8, desc_k, desc_v, desc_c, desc_kw, desc_ks, desc_b = descs
    k_bufs, v_bufs, c_bufs, hi_buf, lo_buf, ks_bufs, b_bufs = ring
    k_ready, k_empty, v_ready, v_empty, w_ready, w_empty, w_split, turn = bars
    coded_blocks, n_coded, n_16 = visits[2], visits[3], visits[4]
    NUM_CONSUMERS: gl.constexpr = q_bufs.shape[0]
    NUM_STAGES: gl.constexpr = k_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    C_ROWS: gl.constexpr = c_bufs.shape[3]
    rows: gl.constexpr = q_bufs.shape[3]
    q_bytes: gl.constexpr = desc_q.block_type.nbytes + desc_q8.block_type.nbytes
    for w in gl.static_range(NUM_CONSUMERS):
        mbarrier.expect(q_ready.index(w), q_bytes)
        tma.async_copy_global_to_shared(desc_q, [off_z, off_hq, start_m + w * rows, 0], q_ready.index(w),
                                        q_bufs.index(w))
        tma.async_copy_global_to_shared(desc_q8, [off_z, off_hq, start_m + w * rows, 0], q_ready.index(w),
                                        q8_bufs.index(w))
    kc_bytes: gl.constexpr = (desc_k.block_type.nbytes + desc_c.block_type.nbytes + desc_ks.block_type.nbytes
                              + desc_b.block_type.nbytes)
    w_bytes: gl.constexpr = desc_kw.block_type.nbytes
    for i in range(n_coded):
        stage = i % NUM_STAGES
        phase = (i // NUM_STAGES) & 1
        start_n = _tile_start(visits, 0, i, n_coded, BLOCK_N, SHIFT_BLOCK_N, FALLBACK, SPARSE)
        centre_row = start_n // (SHIFT_BLOCK_N * C_ROWS) * C_ROWS
        mbarrier.wait(k_empty.index(stage), phase ^ 1)
        mbarrier.expect(k_ready.index(stage), kc_bytes)
        tma.async_copy_global_to_shared(desc_k, [off_z, off_hk, start_n, 0], k_ready.index(stage), k_bufs.index(stage))
        tma.async_copy_global_to_shared(desc_c, [off_z, off_hk, centre_row, 0], k_ready.index(stage),
                                        c_bufs.index(stage))
        tma.async_copy_global_to_shared(desc_ks, [key_row + start_n], k_ready.index(stage), ks_bufs.index(stage))
        tma.async_copy_global_to_shared(desc_b, [off_z, off_hq, start_n, 0], k_ready.index(stage), b_bufs.index(stage))
        _copy_v(desc_v, v_bufs, v_ready, v_empty, off_z, off_hk, start_n, i, PV_FP8)
    if FALLBACK:  # the 16-bit tiles: their centres in the ring, their keys in the one-stage wide ring
        for j in range(n_16):
            i = n_coded + j
            stage = i % NUM_STAGES
            start_n = _tile_start(visits, coded_blocks, j, n_16, BLOCK_N, SHIFT_BLOCK_N, FALLBACK, SPARSE)
            mbarrier.wait(k_empty.index(stage), ((i // NUM_STAGES) & 1) ^ 1)
            mbarrier.expect(k_ready.index(stage), desc_c.block_type.nbytes)
            tma.async_copy_global_to_shared(desc_c, [off_z, off_hk, start_n // (SHIFT_BLOCK_N * C_ROWS) * C_ROWS, 0],
                                            k_ready.index(stage), c_bufs.index(stage))
            mbarrier.wait(w_empty.index(0), (j & 1) ^ 1)
            mbarrier.expect(w_ready.index(0), w_bytes)
            tma.async_copy_global_to_shared(desc_kw, [off_z, off_hk, start_n, 0], w_ready.index(0), hi_buf)
            _copy_v(desc_v, v_bufs, v_ready, v_empty, off_z, off_hk, start_n, i, PV_FP8)


@gluon_jit
def _copy_v(desc_v, v_bufs, v_ready, v_empty, off_z, off_hk, start_n, i, PV_FP8: gl.constexpr):
    """Ring slot ``i``'s values once the consumers have released it: v (``g``) at row ``start_n``, or V8^T's
    (DP, BLOCK_N) box at column ``start_n``."""
    NUM_STAGES: gl.constexpr = v_bufs.shape[0]
    stage = i % NUM_STAGES
    mbarrier.wait(v_empty.index(stage), ((i // NUM_STAGES) & 1) ^ 1)
    mbarrier.expect(v_ready.index(stage), desc_v.block_type.nbytes)
    if PV_FP8:
        tma.async_copy_global_to_shared(desc_v, [off_z, off_hk, 0, start_n], v_ready.index(stage), v_bufs.index(stage))
    else:
        tma.async_copy_global_to_shared(desc_v, [off_z, off_hk, start_n, 0], v_ready.index(stage), v_bufs.index(stage))


@gluon_jit
def _issue_bias(i_sum, ks_buf, b_buf, bias_a, s_layout: gl.constexpr):
    """Once ``I`` (int32) is done: ``d = fp32(I) ks_j`` (exact conversion, ``|I| <= 128 127^2 < 2^24``), then
    ``d += bias_a . b^T`` issued (async bf16 wgmma, ``bias_a`` from registers, ``b`` the tile's (BLOCK_N,
    BIAS_K) bias rows): ``d = I ks_j + (mu_u_i / a_i) sigma_j + (1 / a_i) uA_j``, the tile's logits over
    ``a_i``.  Returns its token."""
    i_sum = warpgroup_mma_wait(0, deps=(i_sum, ))
    ks = ks_buf.load(gl.SliceLayout(0, s_layout))
    d = gl.convert_layout(i_sum.to(gl.float32), s_layout) * ks[None, :]
    return warpgroup_mma(bias_a, b_buf.reshape([b_buf.shape[2], b_buf.shape[3]]).permute((1, 0)), d, is_async=True)


@gluon_jit
def _bias_operand(a_i, mu_u, s_layout: gl.constexpr):
    """The A side of the bias product, built once per consumer: (64, BIAS_K) bf16 in the wgmma's register
    layout, the row factors ``m = mu_u / a`` and ``t = 1 / a`` in bf16 parts (``x = x1 + x2 + x3``) as the
    columns ``(m1, m1, m1, m2, m2, m3, t1, t1, t1, t2, t2, t3, 0, 0, 0, 0)``, against ``quantize._bias_rows``'
    ``(s1, s2, s3, s1, s2, s1, u1, u2, u3, u1, u2, u1, 0, ...)``: the six largest of each term's nine cross
    products (those left out are below fp32's last bit of the term)."""
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    rows: gl.constexpr = a_i.shape[0]
    row_layout: gl.constexpr = gl.SliceLayout(1, op_layout)
    inv = 1.0 / gl.convert_layout(a_i, row_layout)
    m1, m2, m3 = _bf16_parts(gl.convert_layout(mu_u, row_layout) * inv)
    t1, t2, t3 = _bf16_parts(inv)
    col = gl.arange(0, BIAS_K, layout=gl.SliceLayout(0, op_layout))[None, :]
    zero = gl.zeros([rows, BIAS_K], gl.float32, layout=op_layout)
    x = gl.where((col == 0) | (col == 1) | (col == 2), m1[:, None] + zero, zero)
    x = gl.where((col == 3) | (col == 4), m2[:, None] + zero, x)
    x = gl.where(col == 5, m3[:, None] + zero, x)
    x = gl.where((col == 6) | (col == 7) | (col == 8), t1[:, None] + zero, x)
    x = gl.where((col == 9) | (col == 10), t2[:, None] + zero, x)
    x = gl.where(col == 11, t3[:, None] + zero, x)
    return x.to(gl.bfloat16)


@gluon_jit
def _bf16_parts(x):
    """``x`` (fp32) as three bf16 parts in fp32, ``x = x1 + x2 + x3`` to fp32's last bit (the differences are
    exact)."""
    x1 = x.to(gl.bfloat16).to(gl.float32)
    x2 = (x - x1).to(gl.bfloat16).to(gl.float32)
    return x1, x2, ((x - x1) - x2).to(gl.bfloat16).to(gl.float32)


@gluon_jit
def _split_keys(hi_buf, lo_buf, c_tile, start_n, SHIFT_BLOCK_N: gl.constexpr, WG: gl.constexpr,
                NUM_CONSUMERS: gl.constexpr):
    """Consumer ``WG``'s share of a flagged tile's split (``reference_int8`` step 4b): the raw keys ``k`` (``g``,
    as copied into ``hi_buf``) become ``kc = fp32(k) - fp32(c_b)``, ``hi = round_g(kc)`` (in place) and ``lo =
    round_g(kc - hi)`` (into ``lo_buf``), the pre-pass's roundings.  ``c_b`` is row ``b mod 16`` of the centre
    tile (``b`` the tile's block; picked by a masked sum, exact).  The rows go in chunks of :data:`SPLIT_ROWS`,
    chunk ``c`` to consumer ``c mod NUM_CONSUMERS``; the stores are fenced for the tensor cores.  (Padded columns
    and keys past ``N_K`` arrive as zeros: their ``kc`` is 0, or ``-c_b`` in keys that ``MASK_N`` drops.)"""
    BLOCK_N: gl.constexpr = hi_buf.shape[0]
    C_ROWS: gl.constexpr = c_tile.shape[0]
    DP: gl.constexpr = c_tile.shape[1]
    gl.static_assert(C_ROWS == 16 and SPLIT_ROWS == 16, "the layout holds 16 rows in one warp")
    # 16 rows in one warp (2 per thread, 8 lanes): the sum over them needs no shared memory
    layout: gl.constexpr = gl.BlockedLayout([2, DP // 16], [8, 4], [1, 4], [1, 0])
    rows = gl.arange(0, C_ROWS, layout=gl.SliceLayout(1, layout))
    own = (rows == (start_n // SHIFT_BLOCK_N) % C_ROWS)[:, None]
    c_b = gl.sum(gl.where(own, c_tile.load(layout).to(gl.float32), 0.0), axis=0)
    for c in gl.static_range(BLOCK_N // SPLIT_ROWS):
        if c % NUM_CONSUMERS == WG:
            k = hi_buf.slice(c * SPLIT_ROWS, SPLIT_ROWS).load(layout)
            kc = k.to(gl.float32) - c_b[None, :]
            hi = kc.to(k.dtype)
            hi_buf.slice(c * SPLIT_ROWS, SPLIT_ROWS).store(hi)
            lo_buf.slice(c * SPLIT_ROWS, SPLIT_ROWS).store((kc - hi.to(gl.float32)).to(k.dtype))
    fence_async_shared()


@gluon_jit
def _logits_16(q, hi, lo, qk_scale, s_layout: gl.constexpr):
    """A flagged block's ``z = qk_scale fp32(q . hi + q . lo)``: two 16-bit wgmmas into one fp32 accumulator
    (synchronous: nothing else is in flight in the 16-bit loop)."""
    ROWS: gl.constexpr = q.shape[0]
    BLOCK_N: gl.constexpr = hi.shape[0]
    s = warpgroup_mma(q, hi.permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout), use_acc=False)
    return warpgroup_mma(q, lo.permute((1, 0)), s) * qk_scale


@gluon_jit
def _softmax_step(z, a, r, m_i, l_i, start_n, N_K, p_dtype: gl.constexpr, MASK_N: gl.constexpr, LAZY: gl.constexpr,
                  SCALED: gl.constexpr):
    """One tile's online softmax from its logits (log2 units, fp32) and ``r``: ``(p, alpha, m_new, l_new,
    rescale)``.  The logits are ``z``, or with ``SCALED`` ``a_i z`` (``a`` (64,) > 0: the row maximum is
    ``a_i max z``, and ``a_i z - offset`` is one FMA into ``exp2``).  ``p_dtype`` the inputs' ``g``: ``p =
    round_g(exp2(x))``; ``gl.float8e4nv``: ``p = e4m3(exp2(x + P_SHIFT))`` (<= 256); ``l`` sums the fp32 ``exp2``
    before their rounding.

    ``LAZY`` (FlashAttention-4's lazy rescale, exact): the running maximum moves, and the accumulator with it,
    only on a tile where some row of the warpgroup grows by more than ``LAZY_RESCALE`` (``rescale``, a scalar
    for the branch around ``acc``'s rescale); otherwise every row keeps its stale maximum (``alpha = 1``) and
    ``p`` may reach ``2^LAZY_RESCALE``."""
    if MASK_N:
        if start_n + z.shape[1] > N_K:  # the ragged tile only (hopper._softmax_step)
            cols = start_n + gl.arange(0, z.shape[1], layout=gl.SliceLayout(0, z.type.layout))
            z = gl.where((cols < N_K)[None, :], z, float("-inf"))
    m_s = gl.max(z, axis=1)
    if SCALED:
        m_s = m_s * a
    m_blk = m_s + r
    m_new = gl.maximum(m_i, m_blk)
    if LAZY:
        rescale = gl.max(m_new - m_i, axis=0) > LAZY_RESCALE
        m_new = gl.where(rescale, m_new, m_i)
    else:
        rescale = True
    offset = m_s - (m_blk - m_new)
    alpha = gl.exp2(m_i - m_new)
    if p_dtype == gl.float8e4nv:
        offset = offset - P_SHIFT
    if SCALED:
        p32 = gl.exp2(z * a[:, None] - offset[:, None])
    else:
        p32 = gl.exp2(z - offset[:, None])
    if p_dtype == gl.float8e4nv:
        p = p32.to(p_dtype)
    else:
        p = round_p(p32, p_dtype)
    l_new = alpha * l_i + gl.sum(p32, axis=1)
    return p, alpha, m_new, l_new, rescale


@gluon_jit
def _centre_logits(q, c_tile, rc, rc_group, start_n, qk_scale, SHIFT_BLOCK_N: gl.constexpr, row_layout: gl.constexpr):
    """``r = qk_scale fp32(q . c_b)`` for the tile at key ``start_n`` in block ``b``, with ``(rc, rc_group)``
    carried from tile to tile: ``rc = q c^T`` over the 16 centres of ``b``'s group of 16 blocks (``c_tile``,
    copied with the tile) is recomputed (a synchronous wgmma: no product is in flight where this runs) when
    the group changes.  Returns ``(r, rc, rc_group)``."""
    C_ROWS: gl.constexpr = c_tile.shape[0]
    blk = start_n // SHIFT_BLOCK_N
    if blk // C_ROWS != rc_group:
        rc = warpgroup_mma(q, c_tile.permute((1, 0)), gl.zeros_like(rc), use_acc=False)
        rc_group = blk // C_ROWS
    return row_shift(rc, blk % C_ROWS, qk_scale, row_layout), rc, rc_group


@gluon_jit
def _issue_codes(q, q8, ring, k_ready, i, start_n, i_zero, rc, rc_group, qk_scale, SHIFT_BLOCK_N: gl.constexpr,
                 row_layout: gl.constexpr):
    """Wait until ring slot ``i``'s codes and centre rows have landed; ``r`` (:func:`_centre_logits`); issue
    ``I = q_codes k_codes^T`` (async INT8 wgmma).  Returns ``(I's token, r, rc, rc_group)``."""
    k_bufs = ring[0]
    c_bufs = ring[2]
    NUM_STAGES: gl.constexpr = k_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    DP: gl.constexpr = k_bufs.shape[4]
    C_ROWS: gl.constexpr = c_bufs.shape[3]
    stage = i % NUM_STAGES
    mbarrier.wait(k_ready.index(stage), (i // NUM_STAGES) & 1)
    r, rc, rc_group = _centre_logits(q, c_bufs.index(stage).reshape([C_ROWS, DP]), rc, rc_group, start_n, qk_scale,
                                     SHIFT_BLOCK_N, row_layout)
    k8 = k_bufs.index(stage).reshape([BLOCK_N, DP])
    return warpgroup_mma(q8, k8.permute((1, 0)), i_zero, use_acc=False, is_async=True), r, rc, rc_group


@gluon_jit
def _tile_softmax(d, r, a_i, k_empty, m_i, l_i, i, start_n, N_K, p_dtype: gl.constexpr, MASK_N: gl.constexpr,
                  LAZY: gl.constexpr):
    """A coded tile (ring slot ``i``, key ``start_n``) once its bias product ``d`` is done: the release of its
    codes, its softmax on the logits ``a_i d`` (:func:`_softmax_step`).  Returns ``(p, alpha, m_i, l_i,
    rescale)``."""
    release(k_empty, i)
    return _softmax_step(d, a_i, r, m_i, l_i, start_n, N_K, p_dtype, MASK_N, LAZY, True)


@gluon_jit
def _key_loop(q, q8, ring, bars, row_vecs, visits, m_i, l_i, acc, rc, rc_group, i_zero, N_K, qk_scale,
              SHIFT_BLOCK_N: gl.constexpr, MASK_N: gl.constexpr, FALLBACK: gl.constexpr, SPARSE: gl.constexpr,
              LAZY: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """The coded tiles' loop with ``P V`` in 16 bits, FA3's overlap: per tile ``i >= 1`` issue ``I_i``; once it
    is done, its bias product ``d_i`` (:func:`_issue_bias`), then ``acc = alpha acc + P_{i-1} V_{i-1}`` (``p``
    from registers); wait until one group is left (``d_i`` done: groups finish in order); softmax tile ``i``
    while ``P V`` runs; wait for it.  No branch on a flag: the coded tiles of ``visits`` (:func:`_producer`;
    their order read a tile ahead, their count >= 1).  Under ``PINGPONG`` consumer ``WG`` issues its GEMMs in
    turns with the other consumers (``gluon_common.wait_turn``), so that one's softmax runs under another's
    GEMMs.  ``row_vecs = (a_i, the bias product's A side)``.  Returns ``(acc, m_i, l_i, rc, rc_group)``."""
    k_ready, k_empty, v_ready, v_empty, w_ready, w_empty, w_split, turn = bars
    v_bufs, ks_bufs, b_bufs = ring[1], ring[5], ring[6]
    NUM_STAGES: gl.constexpr = ks_bufs.shape[0]
    n = visits[3]
    BLOCK_N: gl.constexpr = i_zero.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    row_layout: gl.constexpr = m_i.type.layout
    a_i, bias_a = row_vecs
    start_n = _tile_start(visits, 0, 0, n, BLOCK_N, SHIFT_BLOCK_N, FALLBACK, SPARSE)
    next_n = _tile_start(visits, 0, 1, n, BLOCK_N, SHIFT_BLOCK_N, FALLBACK, SPARSE)
    wait_turn(turn, 0, WG, PINGPONG)
    i_sum, r, rc, rc_group = _issue_codes(q, q8, ring, k_ready, 0, start_n, i_zero, rc, rc_group, qk_scale,
                                          SHIFT_BLOCK_N, row_layout)
    d = _issue_bias(i_sum, ks_bufs.index(0), b_bufs.index(0), bias_a, s_layout)
    pass_turn(turn, WG, PINGPONG)
    d = warpgroup_mma_wait(0, deps=(d, ))
    p, alpha, m_i, l_i, rescale = _tile_softmax(d, r, a_i, k_empty, m_i, l_i, 0, start_n, N_K, q.dtype, MASK_N, LAZY)
    p = gl.convert_layout(p, p_layout)
    for i in range(1, n):
        start_n = next_n
        next_n = _tile_start(visits, 0, i + 1, n, BLOCK_N, SHIFT_BLOCK_N, FALLBACK, SPARSE)
        stage = i % NUM_STAGES
        wait_turn(turn, i, WG, PINGPONG)
        i_sum, r, rc, rc_group = _issue_codes(q, q8, ring, k_ready, i, start_n, i_zero, rc, rc_group, qk_scale,
                                              SHIFT_BLOCK_N, row_layout)
        d = _issue_bias(i_sum, ks_bufs.index(stage), b_bufs.index(stage), bias_a, s_layout)
        acc = _issue_pv(p, acc, alpha, rescale, v_bufs, v_ready, i - 1, LAZY)
        pass_turn(turn, WG, PINGPONG)
        d = warpgroup_mma_wait(1, deps=(d, ))
        p_prev = p
        p, alpha, m_i, l_i, rescale = _tile_softmax(d, r, a_i, k_empty, m_i, l_i, i, start_n, N_K, q.dtype, MASK_N,
                                                    LAZY)
        p = gl.convert_layout(p, p_layout)
        acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
        release(v_empty, i - 1)
    acc = _issue_pv(p, acc, alpha, rescale, v_bufs, v_ready, n - 1, LAZY)
    acc, p = warpgroup_mma_wait(0, deps=(acc, p))
    release(v_empty, n - 1)
    return acc, m_i, l_i, rc, rc_group


@gluon_jit
def _issue_pv(p, acc, alpha, rescale, v_bufs, v_ready, i, LAZY: gl.constexpr):
    """Wait until key tile ``i``'s v has landed; issue ``acc = alpha acc + p v`` (async wgmma, ``p`` from
    registers in the A-operand layout; under ``LAZY`` the rescale only where ``rescale``); return its token."""
    NUM_STAGES: gl.constexpr = v_bufs.shape[0]
    stage = i % NUM_STAGES
    v_blk = v_bufs.index(stage).reshape([v_bufs.shape[3], v_bufs.shape[4]])
    if LAZY:
        if rescale:
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    else:
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    mbarrier.wait(v_ready.index(stage), (i // NUM_STAGES) & 1)
    return warpgroup_mma(p, v_blk, acc, is_async=True)


@gluon_jit
def _issue_pv8(p_buf, t_zero, v_bufs, v_ready, i):
    """Wait until key tile ``i``'s V8^T has landed; issue ``t = P8 V8`` into a fresh fp32 accumulator (async FP8
    wgmma; ``P8`` (64, BLOCK_N) from shared memory, V8^T's (DP, BLOCK_N) tile read K-major); return its token."""
    NUM_STAGES: gl.constexpr = v_bufs.shape[0]
    stage = i % NUM_STAGES
    vt = v_bufs.index(stage).reshape([v_bufs.shape[3], v_bufs.shape[4]])
    mbarrier.wait(v_ready.index(stage), (i // NUM_STAGES) & 1)
    return warpgroup_mma(p_buf, vt.permute((1, 0)), t_zero, use_acc=False, is_async=True)


@gluon_jit
def _stage_p8(p, p_buf):
    """A tile's ``P8`` into its shared buffer (two per consumer, alternating: the ``P V`` of the tile before
    may still read the other), fenced for the tensor cores.  FP8 ``P`` goes through shared memory: Triton 3.6
    cannot keep an 8-bit register operand alive across an async wgmma (its wait takes no 8-bit dependencies)."""
    p_buf.store(p)
    fence_async_shared()


@gluon_jit
def _key_loop_fp8(q, q8, ring, bars, row_vecs, visits, p_buf, m_i, l_i, acc, rc, rc_group,
                  i_zero, N_K, qk_scale, SHIFT_BLOCK_N: gl.constexpr, MASK_N: gl.constexpr, FALLBACK: gl.constexpr,
                  SPARSE: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """The coded tiles' loop with FP8 ``P V``, overlapped as :func:`_key_loop` (``I_i``, its bias product, then
    ``P8 V8`` of tile ``i - 1``): each key tile's ``P8 V8`` goes
    to a fresh fp32 tile ``t`` (the tensor cores keep about 22 bits inside one FP8 product), promoted after the
    wait as ``acc = alpha acc + t``; ``P8`` goes through the consumer's one tile ``p_buf``, written once the
    ``P V`` that reads it is done; ``WG``, ``PINGPONG`` as there.  Returns ``(acc, m_i, l_i, rc, rc_group)``
    (``acc`` without V's channel scales)."""
    k_ready, k_empty, v_ready, v_empty, w_ready, w_empty, w_split, turn = bars
    v_bufs, ks_bufs, b_bufs = ring[1], ring[5], ring[6]
    NUM_STAGES: gl.constexpr = ks_bufs.shape[0]
    n = visits[3]
    BLOCK_N: gl.constexpr = i_zero.shape[1]
    DP: gl.constexpr = acc.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    a_i, bias_a = row_vecs
    o_layout: gl.constexpr = acc.type.layout
    row_layout: gl.constexpr = m_i.type.layout
    t_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DP, 32])
    t_zero = gl.zeros([acc.shape[0], DP], gl.float32, layout=t_layout)
    start_n = _tile_start(visits, 0, 0, n, BLOCK_N, SHIFT_BLOCK_N, FALLBACK, SPARSE)
    next_n = _tile_start(visits, 0, 1, n, BLOCK_N, SHIFT_BLOCK_N, FALLBACK, SPARSE)
    wait_turn(turn, 0, WG, PINGPONG)
    i_sum, r, rc, rc_group = _issue_codes(q, q8, ring, k_ready, 0, start_n, i_zero, rc, rc_group, qk_scale,
                                          SHIFT_BLOCK_N, row_layout)
    d = _issue_bias(i_sum, ks_bufs.index(0), b_bufs.index(0), bias_a, s_layout)
    pass_turn(turn, WG, PINGPONG)
    d = warpgroup_mma_wait(0, deps=(d, ))
    p, alpha, m_i, l_i, rescale = _tile_softmax(d, r, a_i, k_empty, m_i, l_i, 0, start_n, N_K, gl.float8e4nv, MASK_N,
                                                False)
    _stage_p8(p, p_buf)
    for i in range(1, n):
        start_n = next_n
        next_n = _tile_start(visits, 0, i + 1, n, BLOCK_N, SHIFT_BLOCK_N, FALLBACK, SPARSE)
        stage = i % NUM_STAGES
        wait_turn(turn, i, WG, PINGPONG)
        i_sum, r, rc, rc_group = _issue_codes(q, q8, ring, k_ready, i, start_n, i_zero, rc, rc_group, qk_scale,
                                              SHIFT_BLOCK_N, row_layout)
        d = _issue_bias(i_sum, ks_bufs.index(stage), b_bufs.index(stage), bias_a, s_layout)
        t = _issue_pv8(p_buf, t_zero, v_bufs, v_ready, i - 1)
        pass_turn(turn, WG, PINGPONG)
        d = warpgroup_mma_wait(1, deps=(d, ))
        alpha_prev = alpha
        p, alpha, m_i, l_i, rescale = _tile_softmax(d, r, a_i, k_empty, m_i, l_i, i, start_n, N_K, gl.float8e4nv,
                                                    MASK_N, False)
        t = warpgroup_mma_wait(0, deps=(t, ))
        _stage_p8(p, p_buf)
        acc = acc * gl.convert_layout(alpha_prev, gl.SliceLayout(1, o_layout))[:, None] + gl.convert_layout(t, o_layout)
        release(v_empty, i - 1)
    t = _issue_pv8(p_buf, t_zero, v_bufs, v_ready, n - 1)
    t = warpgroup_mma_wait(0, deps=(t, ))
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None] + gl.convert_layout(t, o_layout)
    release(v_empty, n - 1)
    return acc, m_i, l_i, rc, rc_group


@gluon_jit
def _sixteen_bit_loop(q, ring, bars, visits, p_buf, m_i, l_i, acc, rc, rc_group, N_K, qk_scale,
                      SHIFT_BLOCK_N: gl.constexpr, MASK_N: gl.constexpr, SPARSE: gl.constexpr, PV_FP8: gl.constexpr,
                      WG: gl.constexpr):
    """The flagged tiles after the coded ones (``reference_int8`` step 4c), on the same running state and
    synchronous (no product in flight, no overlap: they are the rare case).  Per tile: ``r``; once ``w_ready`` this
    consumer's share of the keys' split (:func:`_split_keys`), then, once every consumer's share is in
    (``w_split``), the 16-bit pair ``z = qk_scale fp32(q . hi + q . lo)``; its softmax and ``P V`` (``p`` from
    registers, or FP8 ``P8`` through ``p_buf``).  ``visits`` as :func:`_producer`'s; ring slots continue after the
    coded tiles'.  Returns ``(acc, m_i, l_i)``."""
    k_ready, k_empty, v_ready, v_empty, w_ready, w_empty, w_split, turn = bars
    k_bufs, v_bufs, c_bufs, hi_buf, lo_buf = ring[0], ring[1], ring[2], ring[3], ring[4]
    coded_blocks, n_coded, n = visits[2], visits[3], visits[4]
    NUM_STAGES: gl.constexpr = k_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    DP: gl.constexpr = k_bufs.shape[4]
    C_ROWS: gl.constexpr = c_bufs.shape[3]
    o_layout: gl.constexpr = acc.type.layout
    row_layout: gl.constexpr = m_i.type.layout
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    t_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DP, 32])
    alpha_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    for j in range(n):
        i = n_coded + j
        stage = i % NUM_STAGES
        start_n = _tile_start(visits, coded_blocks, j, n, BLOCK_N, SHIFT_BLOCK_N, True, SPARSE)
        mbarrier.wait(k_ready.index(stage), (i // NUM_STAGES) & 1)
        r, rc, rc_group = _centre_logits(q, c_bufs.index(stage).reshape([C_ROWS, DP]), rc, rc_group, start_n,
                                         qk_scale, SHIFT_BLOCK_N, row_layout)
        mbarrier.wait(w_ready.index(0), j & 1)
        _split_keys(hi_buf, lo_buf, c_bufs.index(stage).reshape([C_ROWS, DP]), start_n, SHIFT_BLOCK_N, WG,
                    turn.shape[0])
        mbarrier.arrive(w_split.index(0))
        mbarrier.wait(w_split.index(0), j & 1)
        z = _logits_16(q, hi_buf, lo_buf, qk_scale, s_layout)
        mbarrier.arrive(w_empty.index(0))
        release(k_empty, i)
        if PV_FP8:
            p, alpha, m_i, l_i, rescale = _softmax_step(z, m_i, r, m_i, l_i, start_n, N_K, gl.float8e4nv, MASK_N,
                                                        False, False)
            _stage_p8(p, p_buf)
            vt = v_bufs.index(stage).reshape([v_bufs.shape[3], v_bufs.shape[4]])
            mbarrier.wait(v_ready.index(stage), (i // NUM_STAGES) & 1)
            t = warpgroup_mma(p_buf, vt.permute((1, 0)), gl.zeros([acc.shape[0], DP], gl.float32, layout=t_layout),
                              use_acc=False)
            acc = acc * gl.convert_layout(alpha, alpha_layout)[:, None] + gl.convert_layout(t, o_layout)
        else:
            p, alpha, m_i, l_i, rescale = _softmax_step(z, m_i, r, m_i, l_i, start_n, N_K, q.dtype, MASK_N, False,
                                                        False)
            p = gl.convert_layout(p, p_layout)
            v_blk = v_bufs.index(stage).reshape([v_bufs.shape[3], v_bufs.shape[4]])
            acc = acc * gl.convert_layout(alpha, alpha_layout)[:, None]
            mbarrier.wait(v_ready.index(stage), (i // NUM_STAGES) & 1)
            acc = warpgroup_mma(p, v_blk, acc)
        release(v_empty, i)
    return acc, m_i, l_i


@gluon_jit
def _consumer(desc_o, q_tile, q8_tile, q_ready, ring, bars, row_ptrs, vs_ptr, visits, p_bufs,
              off_z, off_hq, start_row, N_Q, N_K, qk_scale, lse_ptr, SHIFT_BLOCK_N: gl.constexpr, MASK_N: gl.constexpr,
              FALLBACK: gl.constexpr, SPARSE: gl.constexpr, STORE_LSE: gl.constexpr, PV_FP8: gl.constexpr,
              LAZY: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """One consumer warpgroup, number ``WG`` of the program's (its turn under ``PINGPONG``): query rows
    ``start_row ..`` of this (batch, head): the coded tiles' loop (:func:`_key_loop` or, with ``PV_FP8``,
    :func:`_key_loop_fp8`), with ``FALLBACK`` then the 16-bit tiles' (:func:`_sixteen_bit_loop`), then ``out =
    acc / l_i`` (FP8: ``(acc / l_i) vs``) through the q tile and a TMA store, and with ``STORE_LSE`` the
    log-sum-exp (FP8: less ``P_SHIFT``).  ``row_ptrs = (q_scale, mu)`` at this (batch, head)'s row 0; ``vs_ptr``
    V's (DP,) channel scales; ``p_bufs.index(WG)``: this consumer's ``P8`` tile (FP8; one unread dummy
    without); ``ring``, ``bars``, ``visits`` as :func:`_producer`'s.  A row that visits no key block (``SPARSE``, an
    empty mask row) keeps ``acc = 0``, ``l_i = 0``, ``m_i = -inf``: ``out = 0``, ``lse = -inf``."""
    k_bufs = ring[0]
    c_bufs = ring[2]
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    DP: gl.constexpr = k_bufs.shape[4]
    rows: gl.constexpr = q_tile.shape[2]
    p_buf = p_bufs.index(WG if PV_FP8 else 0)
    C_ROWS: gl.constexpr = c_bufs.shape[3]
    i_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DP, 16])
    r_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, C_ROWS, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    q = q_tile.reshape([rows, DP])
    q8 = q8_tile.reshape([rows, DP])
    qs_ptr, mu_ptr = row_ptrs
    offs_m = start_row + gl.arange(0, rows, layout=row_layout)
    a_i = gl.maximum(gl.load(qs_ptr + offs_m, mask=offs_m < N_Q, other=0.0) * (qk_scale / DP), A_FLOOR)
    mu_u = gl.load(mu_ptr + offs_m, mask=offs_m < N_Q, other=0.0) * qk_scale
    row_vecs = (a_i, _bias_operand(a_i, mu_u, s_layout))
    m_i = gl.full([rows], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([rows], gl.float32, layout=row_layout)
    acc = gl.zeros([rows, DP], gl.float32, layout=o_layout)
    rc = gl.zeros([rows, C_ROWS], gl.float32, layout=r_layout)
    rc_group = -1
    i_zero = gl.zeros([rows, BLOCK_N], gl.int32, layout=i_layout)
    mbarrier.wait(q_ready, 0)
    if visits[3] > 0:
        if PV_FP8:
            acc, m_i, l_i, rc, rc_group = _key_loop_fp8(q, q8, ring, bars, row_vecs, visits, p_buf, m_i,
                                                        l_i, acc, rc, rc_group, i_zero, N_K, qk_scale, SHIFT_BLOCK_N,
                                                        MASK_N, FALLBACK, SPARSE, WG, PINGPONG)
        else:
            acc, m_i, l_i, rc, rc_group = _key_loop(q, q8, ring, bars, row_vecs, visits, m_i, l_i, acc, rc, rc_group,
                                                    i_zero, N_K, qk_scale, SHIFT_BLOCK_N, MASK_N, FALLBACK, SPARSE,
                                                    LAZY, WG, PINGPONG)
    if FALLBACK:
        acc, m_i, l_i = _sixteen_bit_loop(q, ring, bars, visits, p_buf, m_i, l_i, acc, rc, rc_group,
                                          N_K, qk_scale, SHIFT_BLOCK_N, MASK_N, SPARSE, PV_FP8, WG)
    if STORE_LSE:
        lse = m_i + gl.log2(l_i)
        if PV_FP8:
            lse = lse - P_SHIFT
        gl.store(lse_ptr + offs_m, lse * LN2, mask=offs_m < N_Q)
    if SPARSE:
        l_i = gl.where(l_i > 0, l_i, 1.0)
    if PV_FP8:
        vs = gl.load(vs_ptr + gl.arange(0, DP, layout=gl.SliceLayout(0, o_layout)))
    inv_l = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, o_layout))
    out = acc * inv_l[:, None]
    if PV_FP8:
        out = out * vs[None, :]
    q.store(out.to(q.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_o, [off_z, off_hq, start_row, 0], q_tile)
    tma.store_wait(0)


@gluon_jit(do_not_specialize=["N_Q", "N_K"])
def int8_fwd_gluon_kernel(
    desc_q, desc_q8, desc_k, desc_v, desc_c, desc_kw, desc_ks, desc_b, desc_o,
    qs_ptr, mu_ptr, vs_ptr, flag_ptr, order_ptr, coded_ptr, lse_ptr,
    H_Q, KV_GROUP, N_Q, N_K, N_ROW, qk_scale,
    mc_ptr, mi_ptr, stride_mcz, stride_mch, stride_mcq, stride_miz, stride_mih, stride_miq, stride_mij,
    MASK_GROUP, MASK_BLOCK_Q,
    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, SHIFT_BLOCK_N: gl.constexpr,
    MASK_N: gl.constexpr, FALLBACK: gl.constexpr, SPARSE: gl.constexpr, STORE_LSE: gl.constexpr,
    PV_FP8: gl.constexpr, P8_LAYOUT: gl.constexpr, LAZY: gl.constexpr, PINGPONG: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    """``out = softmax(scale q k^T) v`` from the 8-bit codes for ``64 NUM_CONSUMERS`` query rows of one
    (batch, head) (the module docstring states the math, tiles and partitions).

    Descriptors (host, 4-d (B, H, N, DP) boxes (1, 1, rows, DP)): q and out (``g``, 64 rows), q codes (int8,
    64 rows), k codes (int8, BLOCK_N rows), v (``g``, BLOCK_N rows; with ``PV_FP8`` V8^T (B, Hk, DP, Nk) e4m3,
    boxes (1, 1, DP, BLOCK_N)), centres (B, Hk, blocks, DP) in ``g`` (16 rows), the keys (``g``,
    BLOCK_N rows; read only with ``FALLBACK``), the bias rows (B, Hq, Nk, 16) bf16 (BLOCK_N rows), and ``k_scale``
    (B, Hk, Nk) fp32 as 1-d rows (boxes of BLOCK_N, row ``N_ROW``).  Pointers (contiguous fp32): ``q_scale``,
    ``mu`` (B, Hq, Nq), ``vs`` (B, Hk, DP) (read with ``PV_FP8``); ``flag``
    (B, Hq, blocks) int8, ``order`` (B, Hq, blocks) and ``coded`` (B, Hq) int32 (the visiting order, read with
    ``FALLBACK``); ``lse`` (B, Hq, Nq) fp32, written with ``STORE_LSE``.  With ``SPARSE`` the program visits the
    key blocks its query block keeps (``mc_ptr``, ``mi_ptr``, their strides, ``MASK_GROUP``, ``MASK_BLOCK_Q``:
    ``common.mask_args`` of :func:`visit_order`'s mask, whose lists hold the coded blocks first; ``coded``
    then (B, Hq, query blocks) int32), one ``BLOCK_N = SHIFT_BLOCK_N`` tile per block, its 128 rows (two
    consumers) in one query block.  The prologue reads the program's visits once: ``(order, stride, coded
    blocks, coded tiles, 16-bit tiles)``.  This function allocates the shared tiles and barriers and forks into
    the producer and the consumers.
    """
    rows: gl.constexpr = desc_q.block_type.shape[2]
    pid_bh, off_z, off_hq, off_hk, start_m = program_rows(H_Q, KV_GROUP, N_Q, rows, NUM_CONSUMERS)
    bh_q = pid_bh.to(gl.int64)
    bh_k = (off_z * (H_Q // KV_GROUP) + off_hk).to(gl.int64)
    row_ptrs = (qs_ptr + bh_q * N_Q, mu_ptr + bh_q * N_Q)
    vs_ptr += bh_k * desc_q.block_type.shape[3]
    key_row = bh_k.to(gl.int32) * N_ROW
    lse_ptr += bh_q * N_Q
    if SPARSE:
        gl.static_assert(BLOCK_N == SHIFT_BLOCK_N, "a block mask's key tile is one centre block")
        gl.static_assert(NUM_CONSUMERS == 2, "a block mask's query block holds 128 rows: two consumers")
        count, order = kept_row(mc_ptr, mi_ptr, off_z, off_hq, start_m, stride_mcz, stride_mch, stride_mcq, stride_miz,
                                stride_mih, stride_miq, MASK_GROUP, MASK_BLOCK_Q)
        if FALLBACK:
            coded_blocks = gl.load(coded_ptr + bh_q * gl.cdiv(N_Q, MASK_BLOCK_Q) + start_m // MASK_BLOCK_Q)
        else:
            coded_blocks = count
        visits = (order, stride_mij, coded_blocks, coded_blocks, count - coded_blocks)
    else:
        n_blocks = gl.cdiv(N_K, SHIFT_BLOCK_N)
        coded_blocks, n_coded, n_16 = _tile_counts(flag_ptr + bh_q * n_blocks, coded_ptr + bh_q, N_K, BLOCK_N,
                                                   SHIFT_BLOCK_N, FALLBACK)
        visits = (order_ptr + bh_q * n_blocks, 1, coded_blocks, n_coded, n_16)

    q_bufs = gl.allocate_shared_memory(desc_q.dtype, [NUM_CONSUMERS] + desc_q.block_type.shape, desc_q.layout)
    q8_bufs = gl.allocate_shared_memory(desc_q8.dtype, [NUM_CONSUMERS] + desc_q8.block_type.shape, desc_q8.layout)
    k_bufs = gl.allocate_shared_memory(desc_k.dtype, [NUM_STAGES] + desc_k.block_type.shape, desc_k.layout)
    v_bufs = gl.allocate_shared_memory(desc_v.dtype, [NUM_STAGES] + desc_v.block_type.shape, desc_v.layout)
    c_bufs = gl.allocate_shared_memory(desc_c.dtype, [NUM_STAGES] + desc_c.block_type.shape, desc_c.layout)
    wide: gl.constexpr = [desc_kw.block_type.shape[2], desc_kw.block_type.shape[3]]  # (BLOCK_N or 16, DP)
    hi_buf = gl.allocate_shared_memory(desc_kw.dtype, [1, 1, 1] + wide, desc_kw.layout)
    lo_buf = gl.allocate_shared_memory(desc_kw.dtype, [1, 1, 1] + wide, desc_kw.layout)
    ks_bufs = gl.allocate_shared_memory(desc_ks.dtype, [NUM_STAGES] + desc_ks.block_type.shape, desc_ks.layout)
    b_bufs = gl.allocate_shared_memory(desc_b.dtype, [NUM_STAGES] + desc_b.block_type.shape, desc_b.layout)
    p8_cols: gl.constexpr = BLOCK_N if PV_FP8 else 16  # one 16-column dummy without FP8
    p8_tiles: gl.constexpr = NUM_CONSUMERS if PV_FP8 else 1
    p8_bufs = gl.allocate_shared_memory(gl.float8e4nv, [p8_tiles, rows, p8_cols], P8_LAYOUT)
    q_ready, k_ready, k_empty, v_ready, v_empty, turn = ring_barriers(NUM_STAGES, NUM_CONSUMERS)
    w_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    w_split = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(w_ready.index(0), count=1)
    mbarrier.init(w_empty.index(0), count=NUM_CONSUMERS)
    mbarrier.init(w_split.index(0), count=NUM_CONSUMERS)

    descs = (desc_q, desc_q8, desc_k, desc_v, desc_c, desc_kw, desc_ks, desc_b)
    ring = (k_bufs, v_bufs, c_bufs, hi_buf.index(0).reshape(wide), lo_buf.index(0).reshape(wide), ks_bufs, b_bufs)
    bars = (k_ready, k_empty, v_ready, v_empty, w_ready, w_empty, w_split, turn)
    # The partition lists written out per consumer count (hopper.py says why: constexprs in a named tuple).
    gl.static_assert(NUM_CONSUMERS == 2 or NUM_CONSUMERS == 3, "partition lists are written for 2 and 3 consumers")
    if NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_producer, (descs, q_bufs, q8_bufs, q_ready, ring, bars, visits, off_z, off_hq, off_hk, start_m, key_row,
                         SHIFT_BLOCK_N, FALLBACK, SPARSE, PV_FP8)),
            (_consumer, (desc_o, q_bufs.index(0), q8_bufs.index(0), q_ready.index(0), ring, bars, row_ptrs, vs_ptr,
                         visits, p8_bufs, off_z, off_hq, start_m, N_Q, N_K, qk_scale, lse_ptr, SHIFT_BLOCK_N,
                         MASK_N, FALLBACK, SPARSE, STORE_LSE, PV_FP8, LAZY, 0, PINGPONG)),
            (_consumer, (desc_o, q_bufs.index(1), q8_bufs.index(1), q_ready.index(1), ring, bars, row_ptrs, vs_ptr,
                         visits, p8_bufs, off_z, off_hq, start_m + rows, N_Q, N_K, qk_scale, lse_ptr,
                         SHIFT_BLOCK_N, MASK_N, FALLBACK, SPARSE, STORE_LSE, PV_FP8, LAZY, 1, PINGPONG)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
    else:
        gl.warp_specialize([
            (_producer, (descs, q_bufs, q8_bufs, q_ready, ring, bars, visits, off_z, off_hq, off_hk, start_m, key_row,
                         SHIFT_BLOCK_N, FALLBACK, SPARSE, PV_FP8)),
            (_consumer, (desc_o, q_bufs.index(0), q8_bufs.index(0), q_ready.index(0), ring, bars, row_ptrs, vs_ptr,
                         visits, p8_bufs, off_z, off_hq, start_m, N_Q, N_K, qk_scale, lse_ptr, SHIFT_BLOCK_N,
                         MASK_N, FALLBACK, SPARSE, STORE_LSE, PV_FP8, LAZY, 0, PINGPONG)),
            (_consumer, (desc_o, q_bufs.index(1), q8_bufs.index(1), q_ready.index(1), ring, bars, row_ptrs, vs_ptr,
                         visits, p8_bufs, off_z, off_hq, start_m + rows, N_Q, N_K, qk_scale, lse_ptr,
                         SHIFT_BLOCK_N, MASK_N, FALLBACK, SPARSE, STORE_LSE, PV_FP8, LAZY, 1, PINGPONG)),
            (_consumer, (desc_o, q_bufs.index(2), q8_bufs.index(2), q_ready.index(2), ring, bars, row_ptrs, vs_ptr,
                         visits, p8_bufs, off_z, off_hq, start_m + 2 * rows, N_Q, N_K, qk_scale, lse_ptr,
                         SHIFT_BLOCK_N, MASK_N, FALLBACK, SPARSE, STORE_LSE, PV_FP8, LAZY, 2, PINGPONG)),
        ], [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS])


def tuned_config(head_dim: int, n_k: int = SHORT_KEYS + 1, sparse: bool = False) -> dict:
    """The config for ``head_dim`` and ``n_k`` keys: :data:`CONFIGS` of its DP, or :data:`SHORT_KEYS_CONFIG` at DP
    64 for at most :data:`SHORT_KEYS` keys; with a block mask (``sparse``) always :data:`CONFIGS` (its 128-key
    tile is the mask's block, its two consumers the mask's 128-row query block)."""
    if head_dim <= 64 and n_k <= SHORT_KEYS and not sparse:
        return dict(SHORT_KEYS_CONFIG)
    return dict(CONFIGS[64 if head_dim <= 64 else 128])


def shared_bytes(cfg: dict, dp: int, element_size: int, fallback: bool, pv_bits: int = 16) -> int:
    """Shared memory of one program: q (``g``) and its codes per consumer, the rings (codes, v in ``g`` or
    e4m3, centres, ``ks`` and the bias rows), the wide buffers of the 16-bit blocks, the barriers."""
    q = cfg["consumers"] * ROWS_PER_CONSUMER * dp * (element_size + 1)
    v_size = 1 if pv_bits == 8 else element_size
    ring = cfg["num_stages"] * (dp * (cfg["BLOCK_N"] * (1 + v_size) + CENTRE_ROWS * element_size)
                                + cfg["BLOCK_N"] * (4 + 2 * BIAS_K.value))
    q += ROWS_PER_CONSUMER * (cfg["consumers"] * cfg["BLOCK_N"] if pv_bits == 8 else 16)  # the P8 tiles
    wide = 2 * (cfg["BLOCK_N"] if fallback else CENTRE_ROWS) * dp * element_size
    return q + ring + wide + 8 * (2 * cfg["consumers"] + 4 * cfg["num_stages"] + 3)


def unsuitable_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *,
                      pv_bits: int) -> str | None:
    """Why this kernel cannot take an 8-bit call, in words, or ``None``: it needs an sm_90 GPU with Gluon 3.6,
    fp16 or bf16, a head dim of ``gluon_common.HEAD_DIMS``, and TMA-addressable q, k, v, out (``P V`` in 16 bits
    or FP8: the pre-pass lays V8 out for it)."""
    reason = sm90_problem(q.device)
    if reason is not None:
        return reason
    reason = operand_problem(q)
    if reason is not None:
        return reason
    return descriptor_layout_problem((("q", q), ("k", k), ("v", v), ("out", out)))


_CONFIGS: dict[tuple, dict] = {}
"""The checked configs by (config, DP, short keys, element size, fallback, pv_bits, sparse):
``gluon_common.kept_config``."""


def _config(config: dict | None, dp: int, n_k: int, element_size: int, fallback: bool, pv_bits: int,
            sparse: bool) -> dict:
    """:func:`tuned_config` updated by ``config``; ``ValueError`` for unknown keys or values, and for a config a
    block mask's call cannot run (``sparse``)."""
    fn = "hopper_int8.forward"
    base = tuned_config(dp, n_k, sparse)
    unknown = set(config or {}) - set(base)
    if unknown:
        raise ValueError(f"{fn}: unknown config keys {sorted(unknown)}; expected {sorted(base)}")
    cfg = {**base, **(config or {})}
    if cfg["BLOCK_N"] not in (64, 128):
        raise ValueError(f"{fn}: config BLOCK_N={cfg['BLOCK_N']} must be 64 or 128 (it divides the centre block "
                         f"{SHIFT_BLOCK})")
    if not 1 <= cfg["num_stages"] <= 4:
        raise ValueError(f"{fn}: config num_stages={cfg['num_stages']} must be 1..4")
    if cfg["consumers"] not in (2, 3):
        raise ValueError(f"{fn}: config consumers={cfg['consumers']!r} must be 2 or 3 (consumer warpgroups)")
    if not isinstance(cfg["lazy"], bool):
        raise ValueError(f"{fn}: config lazy={cfg['lazy']!r} must be True or False (the lazy rescale)")
    if not isinstance(cfg["pingpong"], bool):
        raise ValueError(f"{fn}: config pingpong={cfg['pingpong']!r} must be True or False (the consumers' GEMMs "
                         f"in turns)")
    if sparse and (cfg["BLOCK_N"], cfg["consumers"]) != (SHIFT_BLOCK, 2):
        raise ValueError(f"{fn}: with a block_mask the config needs BLOCK_N={SHIFT_BLOCK} and consumers=2 (one key "
                         f"tile per mask block, one program per query block), got BLOCK_N={cfg['BLOCK_N']}, "
                         f"consumers={cfg['consumers']}")
    needed = shared_bytes(cfg, dp, element_size, fallback, pv_bits)
    if needed > SMEM_LIMIT:
        raise ValueError(f"{fn}: config {cfg} needs {needed} bytes of shared memory at DP {dp}, more than sm_90's "
                         f"{SMEM_LIMIT}: fewer stages or consumers")
    return cfg


def _row_descriptor(t: torch.Tensor, block_n: int) -> TensorDescriptor:
    """A 1-d TMA descriptor over the padded rows of a per-key (B, H, Nk) fp32 view (row stride a multiple of 4
    elements), boxes of ``block_n`` elements; the elements past a row's ``Nk`` are the padding or the next
    row's, which the kernel masks."""
    batch, heads, n_k = t.shape
    if t.stride() != (heads * t.stride(1), t.stride(1), 1) or t.stride(1) % 4 or t.stride(1) < n_k:
        raise ValueError(f"hopper_int8: per-key vectors must be rows padded to 16 bytes (quantize.allocate), got "
                         f"strides {t.stride()} for shape {tuple(t.shape)}")
    flat = torch.as_strided(t, (batch * heads * t.stride(1),), (1,), t.storage_offset())
    return kept_descriptor(flat, (block_n,), _row_layout())


@functools.lru_cache(maxsize=None)
def _p8_layout(cols: int):
    """The NVMMA-swizzled shared layout of the (64, ``cols``) ``P8`` tiles (the A operand of the FP8 ``P V``),
    built once per width."""
    return gl.NVMMASharedLayout.get_default_for([ROWS_PER_CONSUMER, cols], gl.float8e4nv)


@functools.lru_cache(maxsize=None)
def _row_layout():
    """The unswizzled shared layout of the per-key fp32 rows (built once)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


def visit_order(mask: BlockSparseMask, flags: torch.Tensor) -> tuple[BlockSparseMask, torch.Tensor]:
    """The kept key blocks of ``mask`` in the order the kernel visits them when some blocks run in 16 bits
    (``reference_int8`` step 4c, per query block): per (batch, query head, query block) its kept coded blocks
    ascending, then its kept flagged blocks ascending.  ``flags`` (B, Hq, key blocks) int8 (1: in 16 bits).
    Returns ``(lists, coded)``: a mask (B, Hq, ...) whose ``kv_indices`` hold those lists (the rest of each row
    the skipped blocks, never read) with the same ``kv_counts``, and ``coded`` (B, Hq, query blocks) int32, how
    many of each list are coded.  Torch ops on the mask's device, nothing read back on the host."""
    batch, heads, n_k = flags.shape
    kept = mask.kept_blocks(batch, heads)
    blocks = torch.arange(n_k, dtype=torch.int32, device=flags.device)
    flagged = flags.to(torch.int32)[:, :, None, :]
    rank = torch.where(kept, flagged * n_k + blocks, 2 * n_k + blocks)  # coded, then flagged, then skipped
    order = torch.sort(rank, dim=-1).values.remainder_(n_k)
    counts = kept.sum(-1, dtype=torch.int32)
    coded = (kept & (flagged == 0)).sum(-1, dtype=torch.int32)
    lists = BlockSparseMask.from_checked(counts, order, mask.q_len, mask.kv_len, mask.block_q, mask.block_k)
    return lists, coded


def kernel_call(q: torch.Tensor, prep, out: torch.Tensor, *, scale: float, config: dict | None = None,
                lse: torch.Tensor | None = None,
                block_mask: BlockSparseMask | None = None) -> tuple[tuple[int], tuple, dict]:
    """``(grid, args, meta)`` of ``int8_fwd_gluon_kernel[grid](*args, **meta)`` on ``prep`` (``quantize.Prepared``;
    its keys ``prep.k`` are read in the flagged tiles), with ``block_mask`` (checked against the call by
    ``dispatch``) the
    kept blocks' walk (:func:`visit_order` where ``prep`` has flags); split from :func:`forward` so that a
    compile check builds exactly this launch from meta tensors."""
    batch, h_q, n_q, _ = q.shape
    h_k, n_k, dp = prep.k_codes.shape[1:]
    if prep.bias is None:
        raise ValueError("hopper_int8: prep has no bias rows (prep.bias is None); the kernel reads them: "
                         "quantize.prepare(..., bias=True)")
    fallback = prep.flags is not None
    pv_bits = 16 if prep.v_scale is None else 8
    element_size = q.element_size()
    sparse = block_mask is not None
    cfg = kept_config(_CONFIGS, config, (dp, n_k <= SHORT_KEYS, element_size, fallback, pv_bits, sparse),
                      lambda: _config(config, dp, n_k, element_size, fallback, pv_bits, sparse))
    block_n = cfg["BLOCK_N"]
    maxnreg, consumer_regs = registers(cfg["consumers"])
    c_g = prep.centres.to(q.dtype)  # exact: the centres are values of the inputs' dtype
    wide = (prep.k, block_n) if fallback else (c_g, CENTRE_ROWS)  # a 16-row dummy without the 16-bit tiles
    coded = prep.coded
    if sparse and fallback:
        block_mask, coded = visit_order(block_mask, prep.flags)
    tiles = (prep.flags, prep.order, coded) if fallback else (prep.k_codes,) * 3  # unread without
    grid = (cdiv(n_q, ROWS_PER_CONSUMER * cfg["consumers"]) * batch * h_q,)
    args = (descriptor(q, ROWS_PER_CONSUMER, dp), descriptor(prep.q_codes, ROWS_PER_CONSUMER, dp),
            descriptor(prep.k_codes, block_n, dp),
            descriptor(prep.v, dp, block_n) if pv_bits == 8 else descriptor(prep.v, block_n, dp),
            descriptor(c_g, CENTRE_ROWS, dp), descriptor(*wide, dp),
            _row_descriptor(prep.k_scale, block_n), descriptor(prep.bias, block_n, BIAS_K.value),
            descriptor(out, ROWS_PER_CONSUMER, dp),
            prep.q_scale, prep.mu, prep.q_scale if pv_bits == 16 else prep.v_scale, *tiles,
            prep.q_scale if lse is None else lse,
            h_q, h_q // h_k, n_q, n_k, prep.k_scale.stride(1), log2_units(scale), *mask_args(block_mask, q))
    meta = dict(BLOCK_N=block_n, NUM_STAGES=cfg["num_stages"], NUM_CONSUMERS=cfg["consumers"],
                SHIFT_BLOCK_N=SHIFT_BLOCK, MASK_N=n_k % block_n != 0, FALLBACK=fallback, SPARSE=sparse,
                STORE_LSE=lse is not None,
                PV_FP8=pv_bits == 8, P8_LAYOUT=_p8_layout(block_n if pv_bits == 8 else 16),
                LAZY=cfg["lazy"] and pv_bits == 16, PINGPONG=cfg["pingpong"],
                CONSUMER_REGS=consumer_regs, num_warps=PRODUCER_WARPS, maxnreg=maxnreg)
    return grid, args, meta


def forward(q: torch.Tensor, prep, out: torch.Tensor, *, scale: float, config: dict | None = None,
            lse: torch.Tensor | None = None, block_mask: BlockSparseMask | None = None) -> torch.Tensor:
    """Write ``softmax(scale q k^T) v`` of the 8-bit exact shift into ``out`` from ``quantize.prepare``'s outputs
    and return it; the flagged tiles' keys are split into ``hi`` and ``lo`` from ``prep.k`` in the kernel.

    q: (B, Hq, Nq, D), ``prep.k``, ``prep.v`` (B, Hk, Nk, D), out: (B, Hq, Nq, D): fp16 or bf16 on an sm_90 GPU,
    head dim in ``gluon_common.HEAD_DIMS``, TMA-addressable (:func:`unsuitable_reason` returned ``None``); config:
    ``BLOCK_N`` (64 / 128), ``num_stages``, ``consumers`` (2 / 3), ``lazy``, ``pingpong``, missing keys from
    :func:`tuned_config`;
    lse: ``None`` or a contiguous fp32 (B, Hq, Nq) tensor for the natural-log log-sum-exp.
    block_mask: ``None``, or a ``block_sparse.BlockSparseMask`` fitting the call (``dispatch`` checks it), whose
        missing key blocks are skipped (neither loaded nor multiplied; the config's ``BLOCK_N`` 128 and two
        consumers); a query block that keeps none gets zeros and ``lse = -inf``."""
    grid, args, meta = kernel_call(q, prep, out, scale=scale, config=config, lse=lse, block_mask=block_mask)
    kept_launch(int8_fwd_gluon_kernel, grid, args, meta)
    return out


AUTO_MIN_KEYS = 256
"""``kernel="auto"`` attends on the 8-bit codes with the portable kernel below this many keys, where it is
the faster one on the H200 (``bench.int8_fallback``; docs/notes/int8_kernel.md has the numbers)."""


def unsuitable(call: Call) -> str | None:
    """Why this kernel cannot run ``call`` (an 8-bit call), or ``None``; ``kernel="auto"`` also leaves it for a
    given config (a config names one kernel's tiles) and for fewer than :data:`AUTO_MIN_KEYS` keys.  A block mask
    it takes: on the H100 (2026-12-06, (1, 12, 32760, 128) fp16, ``precision="fp8"``, ``bench.sparse``) it ran in
    4.97 / 2.53 / 1.84 ms at 25 / 10 / 5 % of the blocks and 13.4 ms on Radial's mask, where the portable kernel
    took 10.8 / 4.91 / 2.92 and 31.6 ms."""
    if INTERPRET:
        return "Triton's interpreter runs no Gluon"
    reason = unsuitable_reason(call.q, call.k, call.v, call.out, pv_bits=call.bits)
    if reason is None and call.kernel == "auto":
        if call.config is not None:
            return "a config tunes the portable-int8 kernel"
        if call.v.shape[2] < AUTO_MIN_KEYS:
            return (f"below {AUTO_MIN_KEYS} keys the portable-int8 kernel is the faster one, got "
                    f"{call.v.shape[2]} keys")
    return reason


def launch(call: Call, plan: Plan) -> None:
    """:func:`forward` on the quantizing pre-pass's outputs (``call.prep``) and the call's keys."""
    forward(call.q, call.prep, call.out, scale=call.scale, config=call.config, lse=call.lse,
            block_mask=call.block_mask)


ENTRY = Kernel("gluon-int8", ("int8", "fp8"), ("exact",), launch, unsuitable, prepass="quantize",
               prepass_options=MappingProxyType({"bias": True}))
