"""The exact shift in hybrid precision for Hopper (sm_90), by hand in Gluon: FA3's warp-specialised structure.

One Gluon kernel, :func:`exact_fwd_gluon_kernel`, its launch wrapper :func:`forward`, its configs and
:func:`unsuitable_reason` (what its entry's :func:`unsuitable` asks before the router chooses it), and its
``ENTRY`` in ``dispatch.TABLE``.  The variant is
``shift="exact"``, ``precision="hybrid"`` with the portable kernel's arithmetic, from the key pre-pass's
outputs (``prepass.centre_keys``): the centred keys ``k_c`` and the centres ``c_j``, one per 128 keys.  Per key tile of ``BLOCK_N`` keys inside block ``j`` (``qk_scale = scale log2(e)``):

    r_j    = qk_scale (q . c_j)                 (fp32, per row: column j mod 16 of a (64, 16) wgmma)
    s      = fp32(q k_c^T)                      (wgmma, fp32 accumulation; -inf past N_K)
    m_s    = qk_scale rowmax(s),  m_blk = m_s + r_j,  m_new = max(m_i, m_blk)
    p      = round_g(exp2(fma(s, qk_scale, -(m_s - (m_blk - m_new)))))   (g: the inputs' fp16 or bf16)
    alpha  = exp2(m_i - m_new)
    l_i    = alpha l_i + rowsum(p),  acc = alpha acc + p v_blk,  m_i = m_new

and ``out = round_g(acc (1 / l_i))``, optionally ``lse = ln 2 (m_i + log2 l_i)`` (fp32).  Loop invariant:
``acc / l_i == softmax(scale q K^T) V`` over the keys seen so far, ``m_i`` the running maximum of the
true logits in log2 units (``r_j`` added back), ``l_i`` the sum of the rounded ``p`` that ``P V`` used.

Partitions (``gl.warp_specialize``; one program = ``BLOCK_M = 64 NUM_CONSUMERS`` query rows of one
(batch, head), grid axis 0 = query blocks fastest, then batch x head):

- producer (the default partition, one warpgroup, few registers): the TMA copies.  First each consumer's
  q tile, then per key tile ``i`` into stage ``i % NUM_STAGES`` of the rings: k_c and the centre tile
  (one barrier), then v (its own barrier, so that ``S = q k_c^T`` starts before v lands);
- ``NUM_CONSUMERS`` (config ``consumers``) consumer warpgroups, worker partitions of 4 warps with most of
  the registers: 3 at the 64 head-dim tile, 2 at the 128 tile (240 registers each for a (64, 128)
  accumulator; why these counts: docs/notes/hopper.md), each with
  its own 64 query rows: both GEMMs (``warpgroup_mma``, async, then ``warpgroup_mma_wait``), the softmax
  in registers and the output (registers -> shared memory -> TMA store).  They share the K/V ring and
  never wait on each other.  ``OVERLAP`` (config ``overlap``) adds FA3's intra-warpgroup pipelining:
  tile ``i``'s ``S`` is issued before tile ``i - 1``'s ``P V``, and the softmax of tile ``i`` runs while
  that ``P V`` is on the tensor cores (:func:`_key_loop_overlapped`).

Head dim ``D``: the tiles are ``HEAD_DIM`` = 64 wide for D = 64 and 128 wide for D = 80 .. 128; the copy
engine reads the columns past ``D`` as zeros (they add nothing to ``q . k`` and give zero columns of
``acc``) and clips them on the store, so 96 and 112 need no padded copy.

Shared memory (in ``g`` unless said; NVMMA-swizzled, TMA destinations, wgmma operands): q, one (64, D) tile
per consumer (reused for its output tile at the end); the rings k_c (NUM_STAGES, BLOCK_N, D),
c (NUM_STAGES, 16, D) (centre rows ``j .. j + 15``, zeros past the last block), v (NUM_STAGES, BLOCK_N, D);
mbarriers (int64).  Registers per consumer (NVMMA layout v3, 64 rows): s (64, BLOCK_N) fp32, p the same
in ``g`` (the A operand of ``P V``, read from registers: FA3's choice), acc (64, D) fp32, rc (64, 16)
fp32 (``q . c`` of 16 centre blocks, computed on the first tile of every 16th block and carried), m_i, l_i,
r_j, alpha (64,) fp32.  Rows past ``N_Q`` and keys past ``N_K`` arrive from TMA as zeros; the keys get
``s = -inf`` (``MASK_N``), the rows are computed and dropped by the TMA store.

Barrier protocol (an mbarrier's phase ``k`` completes at its ``k``-th count of arrivals; waiting on parity
``k & 1``; a fresh barrier counts as having completed "phase -1", so a wait on parity 1 passes):

- ``q_ready[w]`` (count 1): producer ``expect`` (arrive + q bytes) and the q copy; consumer ``w`` waits
  parity 0 once.
- ``k_ready[s]`` / ``v_ready[s]`` (count 1): producer ``expect`` + copies for tile ``i`` (stage
  ``s = i % NUM_STAGES``); every consumer waits parity ``(i // NUM_STAGES) & 1``.
- ``k_empty[s]`` / ``v_empty[s]`` (count NUM_CONSUMERS): each consumer arrives once per tile after the
  wgmma reading that buffer has completed (``warpgroup_mma_wait``); the producer waits parity
  ``((i // NUM_STAGES) & 1) ^ 1`` before refilling, so its first pass over the ring does not wait.

Host descriptors are 4-d (B, H, N, D) boxes ``[1, 1, rows, D]`` (TMA bounds every dim, so any 16-byte-aligned
strides serve: diffusers' (B, N, H, D) views too); the shared tiles are 4-d and ``reshape``d to 2-d for the wgmma.  What Gluon 3.6 imposes on the source (partitions written out per consumer count, ``maxnreg``)
and the measurements behind the configs: docs/notes/hopper.md.
"""
from __future__ import annotations

from types import MappingProxyType

import torch

from ..rules import LOG2E, SHIFT_BLOCK
from .call import BlockSparseMask, Call, Kernel, Plan
from .common import INTERPRET, LN2, cdiv, lse_arg, mask_args
from .gluon_common import (CENTRE_ROWS, PRODUCER_WARPS, ROWS_PER_CONSUMER, SHORT_KEYS, descriptor,
                           descriptor_layout_problem, fence_async_shared, gl, gluon_jit, head_dim_tile, kept_config,
                           kept_row, mbarrier, operand_problem, pass_turn, program_rows, registers, release,
                           ring_barriers, round_p, row_shift, sm90_problem, tile_start, tma, unavailable_reason,
                           wait_turn, warpgroup_mma, warpgroup_mma_wait, widen_p)
from .launch import kept_launch
from .tuning import SMEM_LIMIT

__all__ = ["exact_fwd_gluon_kernel", "forward", "kernel_call", "unsuitable_reason", "tuned_config", "DEFAULT_CONFIG",
           "SHORT_KEYS_CONFIG", "WIDE_CONFIG", "WIDE_SHORT_KEYS_CONFIG", "SPARSE_CONFIG", "SHORT_KEYS", "HEAD_DIM",
           "shared_bytes", "unavailable_reason"]

HEAD_DIM = 64
"""The head dim the config defaults are stated for."""


@gluon_jit
def _producer(descs, q_bufs, q_ready, ring, bars, off_z, off_hq, off_hk, start_m, kept, n_tiles,
              SHIFT_BLOCK_N: gl.constexpr, SPARSE: gl.constexpr):
    """TMA copies only: each consumer's q tile, then per key tile ``i`` (of ``n_tiles``, starting at
    ``gluon_common.tile_start``: with ``SPARSE`` the kept blocks ``kept = (indices, stride)``) into stage
    ``i % NUM_STAGES``:
    k_c and the centre rows ``j, j + 1, ...`` (``j = start_n // SHIFT_BLOCK_N``) on ``k_ready``, v on
    ``v_ready``, each after the consumers have released the stage (``k_empty`` / ``v_empty``).  The
    centre rows (2 KB) come with every tile; the consumers read them on the first tile of every 16th
    centre block only (:func:`_issue_scores`).

    ``descs = (q, k_c, v, centres)``, ``ring = (k_bufs, v_bufs, c_bufs)``, ``bars = (k_ready, k_empty,
    v_ready, v_empty)``; the tile sizes are read from the buffers' shapes.
    """
    desc_q, desc_k, desc_v, desc_c = descs
    k_bufs, v_bufs, c_bufs = ring
    k_ready, k_empty, v_ready, v_empty, turn = bars
    NUM_CONSUMERS: gl.constexpr = q_bufs.shape[0]
    NUM_STAGES: gl.constexpr = k_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    rows: gl.constexpr = q_bufs.shape[3]
    for w in gl.static_range(NUM_CONSUMERS):
        mbarrier.expect(q_ready.index(w), desc_q.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_q, [off_z, off_hq, start_m + w * rows, 0], q_ready.index(w),
                                        q_bufs.index(w))
    indices, stride_mij = kept
    kc_bytes: gl.constexpr = desc_k.block_type.nbytes + desc_c.block_type.nbytes
    for i in range(n_tiles):
        stage = i % NUM_STAGES
        phase = (i // NUM_STAGES) & 1
        start_n = tile_start(indices, stride_mij, i, BLOCK_N, SPARSE)
        mbarrier.wait(k_empty.index(stage), phase ^ 1)
        mbarrier.expect(k_ready.index(stage), kc_bytes)
        tma.async_copy_global_to_shared(desc_k, [off_z, off_hk, start_n, 0], k_ready.index(stage), k_bufs.index(stage))
        tma.async_copy_global_to_shared(desc_c, [off_z, off_hk, start_n // SHIFT_BLOCK_N, 0], k_ready.index(stage),
                                        c_bufs.index(stage))
        mbarrier.wait(v_empty.index(stage), phase ^ 1)
        mbarrier.expect(v_ready.index(stage), desc_v.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_v, [off_z, off_hk, start_n, 0], v_ready.index(stage), v_bufs.index(stage))


@gluon_jit
def _softmax_step(s, r_j, m_i, l_i, start_n, N_K, qk_scale, p_dtype: gl.constexpr, MASK_N: gl.constexpr):
    """One tile's online softmax (the module docstring's lines for ``m_s`` .. ``l_i``):
    ``(p, alpha, m_new, l_new)`` with ``p`` rounded to ``p_dtype`` (the inputs' fp16 or bf16: the A
    operand of ``P V``), ``s`` (64, BLOCK_N) fp32 unscaled, ``r_j``, ``m_i``, ``l_i`` (64,)."""
    if MASK_N:
        if start_n + s.shape[1] > N_K:  # the last tile only: a branch per tile, not a select per score
            cols = start_n + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
            s = gl.where((cols < N_K)[None, :], s, float("-inf"))
    m_s = gl.max(s, axis=1) * qk_scale
    m_blk = m_s + r_j
    m_new = gl.maximum(m_i, m_blk)
    p = round_p(gl.exp2(gl.fma(s, qk_scale, -(m_s - (m_blk - m_new))[:, None])), p_dtype)
    alpha = gl.exp2(m_i - m_new)
    l_new = alpha * l_i + gl.sum(widen_p(p), axis=1)
    return p, alpha, m_new, l_new


@gluon_jit
def _issue_scores(q, ring, k_ready, i, s_zero, rc, SHIFT_BLOCK_N: gl.constexpr, SPARSE: gl.constexpr):
    """Wait until key tile ``i``'s k_c and centre rows have landed; issue ``s = q k_c^T``
    (async wgmma, q and k_c from shared memory) and return its token with ``rc``.

    ``rc = q c^T`` (64, 16) holds ``q . c_j`` for 16 consecutive centre blocks ``j0 .. j0 + 15``, so it
    is recomputed (a synchronous wgmma on the centre rows ``j .. j + 15`` copied with the tile) only on the
    first tile of every 16th block, and carried between: 1/16 of the (64, 16) products, the same values.
    With ``SPARSE`` (one tile per block, kept blocks anywhere) it is issued on every tile, async before ``s``,
    as its own token: column 0 holds ``q . c_j``, and a scattered mask never waits on a synchronous refresh
    (:func:`_wait_scores` waits for both)."""
    k_bufs, v_bufs, c_bufs = ring
    NUM_STAGES: gl.constexpr = k_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    C_ROWS: gl.constexpr = c_bufs.shape[3]
    REFRESH: gl.constexpr = C_ROWS * SHIFT_BLOCK_N // BLOCK_N
    stage = i % NUM_STAGES
    k_blk = k_bufs.index(stage).reshape([BLOCK_N, k_bufs.shape[4]])
    c_blk = c_bufs.index(stage).reshape([C_ROWS, c_bufs.shape[4]])
    mbarrier.wait(k_ready.index(stage), (i // NUM_STAGES) & 1)
    if SPARSE:
        rc = warpgroup_mma(q, c_blk.permute((1, 0)), gl.zeros_like(rc), use_acc=False, is_async=True)
    else:
        if i % REFRESH == 0:
            rc = warpgroup_mma(q, c_blk.permute((1, 0)), gl.zeros_like(rc), use_acc=False)
    s = warpgroup_mma(q, k_blk.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return s, rc


@gluon_jit
def _wait_scores(s, rc, pending: gl.constexpr, SPARSE: gl.constexpr):
    """Wait until at most ``pending`` wgmma groups are outstanding and ``s`` (with ``SPARSE`` also ``rc``,
    issued before it by :func:`_issue_scores`) is finished: ``(s, rc)``."""
    if SPARSE:
        s, rc = warpgroup_mma_wait(pending, deps=(s, rc))
    else:
        s = warpgroup_mma_wait(pending, deps=(s, ))
    return s, rc


@gluon_jit
def _issue_pv(p, acc, alpha, ring, v_ready, i):
    """Wait until key tile ``i``'s v has landed; issue ``acc = alpha acc + p v_blk`` (async wgmma, ``p``
    (64, BLOCK_N) fp16 from registers in the A-operand layout); return its token."""
    k_bufs, v_bufs, c_bufs = ring
    NUM_STAGES: gl.constexpr = v_bufs.shape[0]
    stage = i % NUM_STAGES
    v_blk = v_bufs.index(stage).reshape([v_bufs.shape[3], v_bufs.shape[4]])
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    mbarrier.wait(v_ready.index(stage), (i // NUM_STAGES) & 1)
    return warpgroup_mma(p, v_blk, acc, is_async=True)


@gluon_jit
def _tile_softmax(s, rc, m_i, l_i, start_n, N_K, qk_scale, p_dtype: gl.constexpr, p_layout: gl.constexpr,
                  MASK_N: gl.constexpr, SHIFT_BLOCK_N: gl.constexpr, SPARSE: gl.constexpr):
    """The softmax of the tile of keys ``start_n ..`` from its finished ``s`` and ``rc`` (:func:`_issue_scores`:
    with ``SPARSE`` column 0 is the tile's block, else column ``j % 16``): ``(p in p_layout, alpha, m_i, l_i)``."""
    row_layout: gl.constexpr = gl.SliceLayout(1, s.type.layout)
    blk = start_n // SHIFT_BLOCK_N
    if SPARSE:
        col = 0
    else:
        col = blk % rc.shape[1]
    r_j = row_shift(rc, col, qk_scale, row_layout)
    p, alpha, m_i, l_i = _softmax_step(s, r_j, m_i, l_i, start_n, N_K, qk_scale, p_dtype, MASK_N)
    return gl.convert_layout(p, p_layout), alpha, m_i, l_i


@gluon_jit
def _key_loop(q, ring, bars, kept, n_tiles, m_i, l_i, acc, s_zero, rc, N_K, qk_scale, p_layout: gl.constexpr,
              MASK_N: gl.constexpr, SHIFT_BLOCK_N: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr,
              SPARSE: gl.constexpr):
    """The key loop without overlap over ``n_tiles`` tiles (``kept`` as for :func:`_producer`): per tile ``S``
    (its issue in turn with the other consumers under ``PINGPONG``), wait, softmax, ``P V``, wait.  Returns
    ``(acc, m_i, l_i)``."""
    k_ready, k_empty, v_ready, v_empty, turn = bars
    indices, stride_mij = kept
    BLOCK_N: gl.constexpr = s_zero.shape[1]
    for i in range(n_tiles):
        start_n = tile_start(indices, stride_mij, i, BLOCK_N, SPARSE)
        wait_turn(turn, i, WG, PINGPONG)
        s, rc = _issue_scores(q, ring, k_ready, i, s_zero, rc, SHIFT_BLOCK_N, SPARSE)
        pass_turn(turn, WG, PINGPONG)
        s, rc = _wait_scores(s, rc, 0, SPARSE)
        release(k_empty, i)
        p, alpha, m_i, l_i = _tile_softmax(s, rc, m_i, l_i, start_n, N_K, qk_scale, q.dtype, p_layout, MASK_N,
                                           SHIFT_BLOCK_N, SPARSE)
        acc = _issue_pv(p, acc, alpha, ring, v_ready, i)
        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
        release(v_empty, i)
    return acc, m_i, l_i


@gluon_jit
def _key_loop_overlapped(q, ring, bars, kept, n_tiles, m_i, l_i, acc, s_zero, rc, N_K, qk_scale,
                         p_layout: gl.constexpr, MASK_N: gl.constexpr, SHIFT_BLOCK_N: gl.constexpr, WG: gl.constexpr,
                         PINGPONG: gl.constexpr, SPARSE: gl.constexpr):
    """The key loop with FA3's intra-warpgroup overlap: tile ``i``'s softmax runs while the tensor cores do
    tile ``i - 1``'s ``P V``.  Order per tile ``i >= 1``: issue ``S_i``; issue ``P_{i-1} V_{i-1}``; wait
    until one wgmma group is left (``S_i`` done: groups finish in order); softmax ``i``; wait for ``P V``.
    Same arithmetic as :func:`_key_loop` (``alpha_i`` scales ``acc`` when ``P_i V_i`` is issued).
    Under ``PINGPONG`` the issue of ``S_i`` (with ``P_{i-1} V_{i-1}``) takes turns with the other consumers.
    ``n_tiles >= 1`` (``kept`` as for :func:`_producer`).  Returns ``(acc, m_i, l_i)``.
    """
    k_ready, k_empty, v_ready, v_empty, turn = bars
    indices, stride_mij = kept
    BLOCK_N: gl.constexpr = s_zero.shape[1]
    start_n = tile_start(indices, stride_mij, 0, BLOCK_N, SPARSE)
    wait_turn(turn, 0, WG, PINGPONG)
    s, rc = _issue_scores(q, ring, k_ready, 0, s_zero, rc, SHIFT_BLOCK_N, SPARSE)
    pass_turn(turn, WG, PINGPONG)
    s, rc = _wait_scores(s, rc, 0, SPARSE)
    release(k_empty, 0)
    p, alpha, m_i, l_i = _tile_softmax(s, rc, m_i, l_i, start_n, N_K, qk_scale, q.dtype, p_layout, MASK_N,
                                       SHIFT_BLOCK_N, SPARSE)
    for i in range(1, n_tiles):
        start_n = tile_start(indices, stride_mij, i, BLOCK_N, SPARSE)
        wait_turn(turn, i, WG, PINGPONG)
        s, rc = _issue_scores(q, ring, k_ready, i, s_zero, rc, SHIFT_BLOCK_N, SPARSE)
        acc = _issue_pv(p, acc, alpha, ring, v_ready, i - 1)
        pass_turn(turn, WG, PINGPONG)
        s, rc = _wait_scores(s, rc, 1, SPARSE)
        release(k_empty, i)
        p_prev = p
        p, alpha, m_i, l_i = _tile_softmax(s, rc, m_i, l_i, start_n, N_K, qk_scale, q.dtype, p_layout,
                                           MASK_N, SHIFT_BLOCK_N, SPARSE)
        acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
        release(v_empty, i - 1)
    acc = _issue_pv(p, acc, alpha, ring, v_ready, n_tiles - 1)
    acc, p = warpgroup_mma_wait(0, deps=(acc, p))
    release(v_empty, n_tiles - 1)
    return acc, m_i, l_i


@gluon_jit
def _consumer(desc_o, q_tile, q_ready, ring, bars, kept, n_tiles, off_z, off_hq, start_row, N_K, qk_scale, lse_ptr,
              N_Q, MASK_N: gl.constexpr, OVERLAP: gl.constexpr, SHIFT_BLOCK_N: gl.constexpr, STORE_LSE: gl.constexpr,
              WG: gl.constexpr, PINGPONG: gl.constexpr, SPARSE: gl.constexpr):
    """One consumer warpgroup: query rows ``start_row ..`` (its own q tile, (1, 1, 64, D), and ``q_ready``),
    over ``n_tiles`` key tiles (``kept`` as for :func:`_producer`).

    Per key tile: wait ``k_ready``; issue ``s = q k_c^T`` (async; ``rc = q c^T`` first, every 16th
    centre block), wait, release the stage's k_c / centres (``k_empty``); softmax; wait ``v_ready``;
    ``acc = alpha acc + p v`` (p from registers), wait, release v (``v_empty``); ``OVERLAP`` reorders
    this as :func:`_key_loop_overlapped`.
    Then ``out = acc / l_i`` into the q tile and a TMA store (rows past N_Q are clipped by the copy
    engine); with ``STORE_LSE`` also ``lse = ln 2 (m_i + log2 l_i)`` (fp32, natural log, of the true
    logits: ``m_i`` carries the removed ``r_j``) at ``lse_ptr + start_row ..``, rows below ``N_Q``
    (``lse_ptr`` points at this (batch, head)'s row 0).  ``ring``, ``bars`` as for :func:`_producer`.  A row
    that visits no key block (``SPARSE``, an empty mask row) keeps ``acc = 0``, ``l_i = 0``, ``m_i = -inf``:
    ``out = 0``, ``lse = -inf``.
    """
    k_bufs, v_bufs, c_bufs = ring
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    HEAD_DIM: gl.constexpr = k_bufs.shape[4]
    rows: gl.constexpr = q_tile.shape[2]
    C_ROWS: gl.constexpr = c_bufs.shape[3]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    r_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, C_ROWS, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    q = q_tile.reshape([rows, HEAD_DIM])
    m_i = gl.full([rows], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([rows], gl.float32, layout=row_layout)
    acc = gl.zeros([rows, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([rows, BLOCK_N], gl.float32, layout=s_layout)
    r_zero = gl.zeros([rows, C_ROWS], gl.float32, layout=r_layout)
    mbarrier.wait(q_ready, 0)
    if OVERLAP:
        if not SPARSE or n_tiles > 0:  # a dense call has a tile at least
            acc, m_i, l_i = _key_loop_overlapped(q, ring, bars, kept, n_tiles, m_i, l_i, acc, s_zero, r_zero, N_K,
                                                 qk_scale, p_layout, MASK_N, SHIFT_BLOCK_N, WG, PINGPONG, SPARSE)
    else:
        acc, m_i, l_i = _key_loop(q, ring, bars, kept, n_tiles, m_i, l_i, acc, s_zero, r_zero, N_K, qk_scale,
                                  p_layout, MASK_N, SHIFT_BLOCK_N, WG, PINGPONG, SPARSE)
    if STORE_LSE:
        offs_m = start_row + gl.arange(0, rows, layout=row_layout)
        gl.store(lse_ptr + offs_m, (m_i + gl.log2(l_i)) * LN2, mask=offs_m < N_Q)

    if SPARSE:
        l_i = gl.where(l_i > 0, l_i, 1.0)
    inv_l = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, o_layout))
    q.store((acc * inv_l[:, None]).to(q.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_o, [off_z, off_hq, start_row, 0], q_tile)
    tma.store_wait(0)


@gluon_jit(do_not_specialize=["N_Q", "N_K"])
def exact_fwd_gluon_kernel(
    desc_q, desc_k, desc_v, desc_c, desc_o, lse_ptr,
    H_Q, KV_GROUP, N_Q, N_K, qk_scale,
    mc_ptr, mi_ptr, stride_mcz, stride_mch, stride_mcq, stride_miz, stride_mih, stride_miq, stride_mij,
    MASK_GROUP, MASK_BLOCK_Q,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
    SHIFT_BLOCK_N: gl.constexpr, MASK_N: gl.constexpr, OVERLAP: gl.constexpr, STORE_LSE: gl.constexpr,
    PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr, SPARSE: gl.constexpr,
):
    """``out = softmax(scale q k^T) v`` for ``BLOCK_M = 64 NUM_CONSUMERS`` query rows of one (batch, head).

    The module docstring states the math (the same as ``portable.pasa_fwd_kernel``'s exact shift), the
    tiles and the barrier protocol.  Descriptors (host, 4-d (B, H, N, D), fp16 or bf16, all one dtype):
    q and out boxes (1, 1, 64, HEAD_DIM); k_c and v (1, 1, BLOCK_N, HEAD_DIM); centres (B, Hk,
    ceil(N_K / 128), D) in the inputs' dtype (exact: the centres are values of it), boxes (1, 1, 16,
    HEAD_DIM).  ``HEAD_DIM`` is the tile (64 or 128); a head dim ``D`` below it is padded by the copy
    engine, which reads the columns past ``D`` as zeros and clips them on the store.  ``lse_ptr``: the
    fp32 (B, H_Q, N_Q) log-sum-exp, written when ``STORE_LSE``.  With ``SPARSE`` the program visits only the
    key blocks its query block keeps in the block mask (``mc_ptr`` its ``kv_counts``, ``mi_ptr`` its
    ``kv_indices``, their strides, ``MASK_GROUP`` query heads per mask head, ``MASK_BLOCK_Q`` rows per query
    block: ``common.mask_args``), one key tile of ``BLOCK_N = SHIFT_BLOCK_N`` keys per kept block, its
    ``BLOCK_M = 128`` rows (two consumers) in one query block.  This function allocates the shared tiles and the
    barriers and forks into the producer and the consumers.
    """
    rows: gl.constexpr = desc_q.block_type.shape[2]
    pid_bh, off_z, off_hq, off_hk, start_m = program_rows(H_Q, KV_GROUP, N_Q, rows, NUM_CONSUMERS)
    lse_ptr += pid_bh.to(gl.int64) * N_Q
    if SPARSE:
        gl.static_assert(BLOCK_N == SHIFT_BLOCK_N, "a block mask's key tile is one centre block")
        gl.static_assert(NUM_CONSUMERS == 2, "a block mask's query block holds 128 rows: two consumers")
        n_tiles, indices = kept_row(mc_ptr, mi_ptr, off_z, off_hq, start_m, stride_mcz, stride_mch, stride_mcq,
                                    stride_miz, stride_mih, stride_miq, MASK_GROUP, MASK_BLOCK_Q)
    else:
        n_tiles = gl.cdiv(N_K, BLOCK_N)
        indices = mi_ptr
    kept = (indices, stride_mij)

    q_bufs = gl.allocate_shared_memory(desc_q.dtype, [NUM_CONSUMERS] + desc_q.block_type.shape, desc_q.layout)
    k_bufs = gl.allocate_shared_memory(desc_k.dtype, [NUM_STAGES] + desc_k.block_type.shape, desc_k.layout)
    v_bufs = gl.allocate_shared_memory(desc_v.dtype, [NUM_STAGES] + desc_v.block_type.shape, desc_v.layout)
    c_bufs = gl.allocate_shared_memory(desc_c.dtype, [NUM_STAGES] + desc_c.block_type.shape, desc_c.layout)
    q_ready, k_ready, k_empty, v_ready, v_empty, turn = ring_barriers(NUM_STAGES, NUM_CONSUMERS)

    descs = (desc_q, desc_k, desc_v, desc_c)
    ring = (k_bufs, v_bufs, c_bufs)
    bars = (k_ready, k_empty, v_ready, v_empty, turn)
    # Constexprs keep their kind only inside the literal argument tuples (a tuple bound to a name in a
    # Gluon 3.6 function turns them into int32 scalars), hence the lists written out, one per count.
    gl.static_assert(NUM_CONSUMERS == 2 or NUM_CONSUMERS == 3, "partition lists are written for 2 and 3 consumers")
    if NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_producer, (descs, q_bufs, q_ready, ring, bars, off_z, off_hq, off_hk, start_m, kept, n_tiles,
                         SHIFT_BLOCK_N, SPARSE)),
            (_consumer, (desc_o, q_bufs.index(0), q_ready.index(0), ring, bars, kept, n_tiles, off_z, off_hq,
                         start_m, N_K, qk_scale, lse_ptr, N_Q, MASK_N, OVERLAP, SHIFT_BLOCK_N, STORE_LSE, 0,
                         PINGPONG, SPARSE)),
            (_consumer, (desc_o, q_bufs.index(1), q_ready.index(1), ring, bars, kept, n_tiles, off_z, off_hq,
                         start_m + rows, N_K, qk_scale, lse_ptr, N_Q, MASK_N, OVERLAP, SHIFT_BLOCK_N, STORE_LSE, 1,
                         PINGPONG, SPARSE)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
    else:
        gl.warp_specialize([
            (_producer, (descs, q_bufs, q_ready, ring, bars, off_z, off_hq, off_hk, start_m, kept, n_tiles,
                         SHIFT_BLOCK_N, SPARSE)),
            (_consumer, (desc_o, q_bufs.index(0), q_ready.index(0), ring, bars, kept, n_tiles, off_z, off_hq,
                         start_m, N_K, qk_scale, lse_ptr, N_Q, MASK_N, OVERLAP, SHIFT_BLOCK_N, STORE_LSE, 0,
                         PINGPONG, SPARSE)),
            (_consumer, (desc_o, q_bufs.index(1), q_ready.index(1), ring, bars, kept, n_tiles, off_z, off_hq,
                         start_m + rows, N_K, qk_scale, lse_ptr, N_Q, MASK_N, OVERLAP, SHIFT_BLOCK_N, STORE_LSE, 1,
                         PINGPONG, SPARSE)),
            (_consumer, (desc_o, q_bufs.index(2), q_ready.index(2), ring, bars, kept, n_tiles, off_z, off_hq,
                         start_m + 2 * rows, N_K, qk_scale, lse_ptr, N_Q, MASK_N, OVERLAP, SHIFT_BLOCK_N, STORE_LSE, 2,
                         PINGPONG, SPARSE)),
        ], [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS])


DEFAULT_CONFIG = {"BLOCK_N": 128, "num_stages": 3, "overlap": False, "consumers": 3, "pingpong": False}
"""The config for long key sequences at head dim 64: the fastest at 2304 and 9216 keys on the H200 (``bench.hopper``)."""
SHORT_KEYS_CONFIG = {"BLOCK_N": 64, "num_stages": 4, "overlap": True, "consumers": 3, "pingpong": True}
"""The config for at most ``SHORT_KEYS`` keys at head dim 64, the fastest at 576 keys: smaller key tiles, a
deeper ring, the softmax under ``P V`` and the consumers in turns (docs/notes/hopper.md)."""
WIDE_CONFIG = {"BLOCK_N": 128, "num_stages": 2, "overlap": True, "consumers": 2, "pingpong": True}
"""The config for head dims above 64 (the 128 tile): FA3's two consumer warpgroups, so that each has the
registers (240) for a (64, 128) fp32 accumulator beside its (64, 128) scores and the previous tile's p,
FA3's overlap and ping-pong (measured: docs/notes/hopper.md)."""
WIDE_SHORT_KEYS_CONFIG = {"BLOCK_N": 64, "num_stages": 3, "overlap": True, "consumers": 2, "pingpong": False}
"""The config for at most ``SHORT_KEYS`` keys at head dims above 64."""
SPARSE_CONFIG = {"BLOCK_N": 128, "num_stages": 3, "overlap": True, "consumers": 2, "pingpong": True}
"""The config of a call with a block mask at head dim 64 (at the 128 tile: :data:`WIDE_CONFIG`): a mask's query
block of 128 rows is one program (two consumers), its key block of 128 keys one tile; the overlap and ping-pong of
the wide config."""


def shared_bytes(cfg: dict, tile: int, element_size: int) -> int:
    """Shared memory of one program under ``cfg``: the q tiles, the k_c / v / centre rings, the barriers."""
    q = cfg["consumers"] * ROWS_PER_CONSUMER * tile
    ring = cfg["num_stages"] * (2 * cfg["BLOCK_N"] + CENTRE_ROWS) * tile
    barriers = 8 * (2 * cfg["consumers"] + 4 * cfg["num_stages"])
    return (q + ring) * element_size + barriers


def unsuitable_reason(q: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *, precision: str,
                      block_n: int) -> str | None:
    """Why this kernel cannot take an exact-shift call with pre-centred keys, in words, or ``None``.

    ``q``, ``v``, ``out`` are the op's checked tensors (unit stride in D; the keys come from the
    pre-pass, contiguous); the kernel takes fp16 and bf16, the head dims of ``gluon_common.HEAD_DIMS``, the hybrid
    precision and centre blocks of ``SHIFT_BLOCK`` keys, on an sm_90 GPU with Triton's Gluon 3.6, in
    layouts a TMA descriptor can address.
    """
    reason = sm90_problem(q.device)
    if reason is not None:
        return reason
    if precision != "hybrid":
        return f"it has the hybrid precision only, got precision={precision!r}"
    reason = operand_problem(q)
    if reason is not None:
        return reason
    if block_n != SHIFT_BLOCK:
        return f"its centre blocks are {SHIFT_BLOCK} keys, got block_n={block_n}"
    return descriptor_layout_problem((("q", q), ("v", v), ("out", out)))


def tuned_config(n_k: int, head_dim: int = HEAD_DIM, sparse: bool = False) -> dict:
    """The measured config for ``n_k`` keys of ``head_dim``: the short-keys config up to ``SHORT_KEYS``
    keys, the long one above, for the head dim's tile; with a block mask (``sparse``) :data:`SPARSE_CONFIG` or,
    at the 128 tile, :data:`WIDE_CONFIG`, at any number of keys."""
    wide = head_dim_tile(head_dim) != 64
    if sparse:
        return dict(WIDE_CONFIG if wide else SPARSE_CONFIG)
    short = n_k <= SHORT_KEYS
    if not wide:
        return dict(SHORT_KEYS_CONFIG if short else DEFAULT_CONFIG)
    return dict(WIDE_SHORT_KEYS_CONFIG if short else WIDE_CONFIG)


_CONFIGS: dict[tuple, dict] = {}
"""The checked configs by (config, short keys or not, head dim, element size, sparse or not):
``gluon_common.kept_config``."""


def _config(config: dict | None, n_k: int, head_dim: int, element_size: int, sparse: bool) -> dict:
    """:func:`tuned_config` updated by ``config``; ``ValueError`` for unknown keys or values, or values a block
    mask's call cannot run (``sparse``)."""
    fn = "hopper.forward"
    base = tuned_config(n_k, head_dim, sparse)
    unknown = set(config or {}) - set(base)
    if unknown:
        raise ValueError(f"{fn}: unknown config keys {sorted(unknown)}; expected {sorted(base)}")
    cfg = {**base, **(config or {})}
    if cfg["BLOCK_N"] not in (64, 128):
        raise ValueError(f"{fn}: config BLOCK_N={cfg['BLOCK_N']} must be 64 or 128 (it divides the shift block "
                         f"{SHIFT_BLOCK})")
    if not isinstance(cfg["overlap"], bool):
        raise ValueError(f"{fn}: config overlap={cfg['overlap']!r} must be a bool")
    if not 1 <= cfg["num_stages"] <= 4:
        raise ValueError(f"{fn}: config num_stages={cfg['num_stages']} must be 1..4")
    if not isinstance(cfg["pingpong"], bool):
        raise ValueError(f"{fn}: config pingpong={cfg['pingpong']!r} must be a bool")
    if cfg["consumers"] not in (2, 3):
        raise ValueError(f"{fn}: config consumers={cfg['consumers']!r} must be 2 or 3 (consumer warpgroups)")
    if sparse and (cfg["BLOCK_N"], cfg["consumers"]) != (SHIFT_BLOCK, 2):
        raise ValueError(f"{fn}: with a block_mask the config needs BLOCK_N={SHIFT_BLOCK} and consumers=2 (one key "
                         f"tile per mask block, one program per query block), got BLOCK_N={cfg['BLOCK_N']}, "
                         f"consumers={cfg['consumers']}")
    tile = head_dim_tile(head_dim)
    needed = shared_bytes(cfg, tile, element_size)
    if needed > SMEM_LIMIT:
        raise ValueError(f"{fn}: config {cfg} needs {needed} bytes of shared memory at head dim {head_dim} "
                         f"(tile {tile}), more than sm_90's {SMEM_LIMIT}: fewer stages or consumers")
    return cfg


def kernel_call(q, k_c, v, centres, out, *, scale: float, config: dict | None = None,
                lse: torch.Tensor | None = None, block_mask: BlockSparseMask | None = None):
    """``(grid, args, meta)`` of the launch ``exact_fwd_gluon_kernel[grid](*args, **meta)``.

    Split from :func:`forward` so that ``tools.compile_sm90`` compiles exactly what :func:`forward`
    launches (from meta tensors, without a GPU).
    """
    batch, h_q, n_q, head_dim = q.shape
    h_k, n_k = k_c.shape[1], k_c.shape[2]
    element_size = q.element_size()
    sparse = block_mask is not None
    cfg = kept_config(_CONFIGS, config, (n_k <= SHORT_KEYS, head_dim, element_size, sparse),
                      lambda: _config(config, n_k, head_dim, element_size, sparse))
    tile = head_dim_tile(head_dim)
    c_g = centres if centres.dtype == q.dtype else centres.to(q.dtype)  # exact: values of the inputs' dtype
    block_m = ROWS_PER_CONSUMER * cfg["consumers"]
    maxnreg, consumer_regs = registers(cfg["consumers"])
    grid = (cdiv(n_q, block_m) * batch * h_q, )
    args = (descriptor(q, ROWS_PER_CONSUMER, tile), descriptor(k_c, cfg["BLOCK_N"], tile),
            descriptor(v, cfg["BLOCK_N"], tile), descriptor(c_g, CENTRE_ROWS, tile),
            descriptor(out, ROWS_PER_CONSUMER, tile), lse_arg(lse, q.device),
            h_q, h_q // h_k, n_q, n_k, float(scale) * LOG2E, *mask_args(block_mask, q))
    meta = dict(HEAD_DIM=tile, BLOCK_N=cfg["BLOCK_N"], NUM_STAGES=cfg["num_stages"],
                NUM_CONSUMERS=cfg["consumers"], SHIFT_BLOCK_N=SHIFT_BLOCK, MASK_N=n_k % cfg["BLOCK_N"] != 0,
                OVERLAP=bool(cfg["overlap"]), STORE_LSE=lse is not None, PINGPONG=cfg["pingpong"],
                CONSUMER_REGS=consumer_regs, SPARSE=sparse, num_warps=PRODUCER_WARPS, maxnreg=maxnreg)
    return grid, args, meta


def forward(q: torch.Tensor, k_c: torch.Tensor, v: torch.Tensor, centres: torch.Tensor, out: torch.Tensor, *,
            scale: float, config: dict | None = None, lse: torch.Tensor | None = None,
            block_mask: BlockSparseMask | None = None) -> torch.Tensor:
    """Write ``softmax(scale q k^T) v`` into ``out`` from the pre-pass's ``k_c`` and ``centres``; return it.

    Resolved arguments (``dispatch.forward`` checks the call and :func:`unsuitable_reason` returned ``None``):
        q: ``(B, Hq, Nq, D)``; k_c, v: ``(B, Hk, Nk, D)`` with ``Hq % Hk == 0``; out: ``(B, Hq, Nq, D)``;
            float16 or bfloat16 CUDA tensors (one dtype) on an sm_90 GPU, ``D`` in ``gluon_common.HEAD_DIMS``,
            unit stride in D, B/H/N strides multiples of 16 bytes on a 16-byte-aligned base (contiguous
            (B, H, N, D), or diffusers' (B, N, H, D) transposed).
        centres: ``(B, Hk, ceil(Nk / 128), D)``, the exact centres (``prepass.centre_keys``), in q's dtype (as
            ``dispatch`` asks the pre-pass for them: no cast here) or fp32 (cast here; exact either way).
        scale: softmax scale.
        config: ``BLOCK_N`` (64 / 128), ``num_stages`` (K/V ring depth), ``overlap`` (softmax of tile
            ``i`` under ``P V`` of tile ``i - 1``, FA3's intra-warpgroup pipelining), ``consumers`` (2 or
            3 consumer warpgroups of 64 query rows), ``pingpong`` (the consumers take turns to issue their
            GEMMs, so that one's softmax runs under the others' GEMMs: FA3's inter-warpgroup
            schedule); missing keys from :func:`tuned_config`.
        lse: ``None``, or a contiguous fp32 ``(B, Hq, Nq)`` tensor that receives the natural-log
            log-sum-exp of each row's true logits ``scale q . k``.
        block_mask: ``None``, or a ``block_sparse.BlockSparseMask`` fitting the call (``dispatch`` checks it),
            128-key blocks and query blocks a multiple of 128 rows: only the kept key blocks are loaded and
            multiplied (:data:`SPARSE_CONFIG`); a query block that keeps none gets zeros and ``lse = -inf``.
    """
    grid, args, meta = kernel_call(q, k_c, v, centres, out, scale=scale, config=config, lse=lse,
                                   block_mask=block_mask)
    kept_launch(exact_fwd_gluon_kernel, grid, args, meta)
    return out


def unsuitable(call: Call) -> str | None:
    """Why the Gluon kernel cannot run ``call`` (an exact-shift call in the hybrid precision), or ``None``."""
    if not (not call.one_block if call.prepass is None else call.prepass):
        return "all keys form one block, centred inside the kernel (no pre-pass)"
    if call.kernel == "auto" and call.config is not None:
        return "a config tunes the portable kernel"
    if INTERPRET:
        return "Triton's interpreter runs no Gluon"
    return unsuitable_reason(call.q, call.v, call.out, precision=call.variant.precision, block_n=call.shift_block)


def launch(call: Call, plan: Plan) -> None:
    """:func:`forward` on the centre pre-pass's keys and centres."""
    forward(call.q, call.keys, call.v, call.centres, call.out, scale=call.scale, config=call.config, lse=call.lse,
            block_mask=call.block_mask)


ENTRY = Kernel("gluon", ("hybrid",), ("exact",), launch, unsuitable, prepass="centre",
               prepass_options=MappingProxyType({"centres_in_keys_dtype": True}))
