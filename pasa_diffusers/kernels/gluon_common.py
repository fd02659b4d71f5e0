"""What both Gluon Hopper kernels (``hopper.py``, ``hopper_int8.py``) share: Gluon's names, the warpgroup
geometry and register split, the TMA descriptors and the checks of a call they run, and the jitted pieces of
their softmax and rings (``@gluon_jit``, inlined into their callers).

Gluon is Triton's experimental tile language; this module imports its Hopper names once.  A triton without
them (older, or newer with another API) still imports: the names are ``None``, :func:`unavailable_reason`
says why, and the kernels are never launched (the router asks :func:`sm90_problem` first).
"""
from __future__ import annotations

import functools

import torch
import triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    GLUON_IMPORT_ERROR = None
    gluon_jit = gluon.jit
except ImportError as exc:  # an older or newer triton without these names: importing still works
    GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None

    def gluon_jit(fn):
        return fn

__all__ = ["gl", "gluon_jit", "fence_async_shared", "mbarrier", "tma", "warpgroup_mma", "warpgroup_mma_wait",
           "TensorDescriptor", "GLUON_IMPORT_ERROR", "GLUON_VERSION", "HEAD_DIMS", "ROWS_PER_CONSUMER", "CENTRE_ROWS",
           "PRODUCER_WARPS", "REGISTERS_PER_SM", "PRODUCER_REGS", "SHORT_KEYS", "unavailable_reason", "sm90_problem",
           "operand_problem", "descriptor_layout_problem", "head_dim_tile", "registers", "descriptor", "kept_descriptor",
           "kept_config", "row_shift", "round_p", "widen_p", "release", "wait_turn", "pass_turn", "ring_barriers",
           "program_rows", "kept_row", "tile_start"]

GLUON_VERSION = "3.6"
"""The Triton release whose Gluon API the kernels are written for (``warp_specialize``'s signature changed in 3.6)."""
HEAD_DIMS = (64, 80, 96, 112, 128)
"""The head dims the Gluon kernels take: the 64 tile, and the 128 tile for the others (the copy engine reads
the columns past D as zeros and clips them on the store)."""
ROWS_PER_CONSUMER = 64
"""Query rows per consumer warpgroup (the M of one wgmma)."""
CENTRE_ROWS = 16
"""Centre rows per copy: the N of the (64, 16) wgmma that forms ``q . c_j`` for 16 consecutive centre blocks."""
PRODUCER_WARPS = 4
"""The producer is the default partition: the kernel's ``num_warps``, one warpgroup."""
REGISTERS_PER_SM = 65536
PRODUCER_REGS = 24
"""Registers per thread of the producer warpgroup (TMA copies only)."""
SHORT_KEYS = 1024
"""The most keys the Gluon kernels' short-keys configs (64-key tiles) serve, in 16 and 8 bits alike."""
_GL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.int8: "int8",
              torch.float8_e4m3fn: "float8e4nv"}
_OPERAND_DTYPES = (torch.float16, torch.bfloat16)


def unavailable_reason() -> str | None:
    """Why this triton cannot run the Gluon kernels (no Gluon, or a release other than 3.6), or ``None``."""
    if GLUON_IMPORT_ERROR is not None:
        return f"triton {triton.__version__} has no usable Gluon ({GLUON_IMPORT_ERROR})"
    if not triton.__version__.startswith(GLUON_VERSION + "."):
        return f"written for Gluon in triton {GLUON_VERSION}.x, found triton {triton.__version__}"
    return None


def sm90_problem(device: torch.device) -> str | None:
    """Why a Gluon kernel cannot run on ``device`` (this triton, not CUDA, not sm_90), or ``None``."""
    reason = unavailable_reason()
    if reason is not None:
        return reason
    if device.type != "cuda":
        return f"it runs on CUDA GPUs, got {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"it needs sm_90 (Hopper), got sm_{major}{minor}"
    return None


def operand_problem(q: torch.Tensor) -> str | None:
    """Why a Gluon kernel cannot take queries of ``q``'s dtype and head dim, or ``None``."""
    if q.dtype not in _OPERAND_DTYPES:
        return f"it takes float16 and bfloat16, got {q.dtype}"
    if q.shape[-1] not in HEAD_DIMS:
        return f"it takes head dims {HEAD_DIMS}, got {q.shape[-1]}"
    return None


def descriptor_layout_problem(tensors) -> str | None:
    """What a TMA descriptor needs of each ``(name, tensor)``: a 16-byte-aligned base and B, H, N strides
    that are multiples of 16 bytes (the (batch, head) strides enter the base address, so they count too).
    The first unmet need, naming the tensor, or ``None``."""
    for name, t in tensors:
        size = t.element_size()
        bad = [i for i in range(3) if (t.stride(i) * size) % 16 != 0 and t.shape[i] > 1]
        if t.data_ptr() % 16 != 0 or bad:
            return (f"{name} does not suit a TMA descriptor: its base address and its B, H, N strides "
                    f"must be multiples of 16 bytes, got data_ptr % 16 = {t.data_ptr() % 16}, "
                    f"{name}.stride()={tuple(t.stride())} ({t.dtype}, head dim {t.shape[-1]}: contiguous "
                    f"(B, H, N, D) or (B, N, H, D) tensors qualify when D * {size} is a multiple of 16)")
    return None


def head_dim_tile(head_dim: int) -> int:
    """The head-dim tile of a head dim of :data:`HEAD_DIMS`: 64, or 128 above it."""
    return 64 if head_dim <= 64 else 128


def registers(consumers: int) -> tuple[int, int]:
    """``(maxnreg, consumer registers)`` for ``consumers`` consumer warpgroups: the launch's per-thread cap
    so that all warpgroups fit in one SM's register file, and the consumers' share after the producer's
    :data:`PRODUCER_REGS`."""
    threads = 128 * (1 + consumers)
    maxnreg = min(255, REGISTERS_PER_SM // threads) // 8 * 8
    consumer = (maxnreg * threads - 128 * PRODUCER_REGS) // (128 * consumers) // 8 * 8
    return maxnreg, min(consumer, 240)


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple[int, ...], dtype_name: str):
    """The NVMMA-swizzled shared layout of a TMA box ``block`` of ``dtype_name`` (a pure function of its
    arguments, built once per box)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, dtype_name))


DESCRIPTOR_CACHE_SIZE = 4096
"""The most descriptor signatures kept (the cache is emptied when full)."""
_DESCRIPTORS: dict[tuple, TensorDescriptor] = {}


def descriptor(t: torch.Tensor, rows: int, tile: int) -> TensorDescriptor:
    """A 4-d (B, H, N, D) TMA descriptor of ``t`` with boxes (1, 1, rows, tile), NVMMA-swizzled for the wgmma
    (columns past D, where ``tile > D``, read as zeros and are not stored); :func:`kept_descriptor`."""
    block = (1, 1, rows, tile)
    return kept_descriptor(t, block, _shared_layout(block, _GL_DTYPES[t.dtype]))


def kept_descriptor(t: torch.Tensor, block: tuple[int, ...], layout) -> TensorDescriptor:
    """A TMA descriptor of all of ``t`` with boxes ``block`` in the shared ``layout``.

    Built and checked by Triton once per signature (shape, strides, dtype, box, layout, and the base's 16-byte
    alignment: everything the checks of ``TensorDescriptor.__post_init__`` read), then kept without its tensor;
    a later call of the signature gets a copy with ``base = t`` (the same fields as a new one, without the
    checks: about 1 us instead of 4-8).  The kept one holds no tensor, so nothing stale is reachable: the
    address, shape and strides the launch encodes are always the current tensor's (Triton 3.6's descriptor is
    a dataclass whose ``__post_init__`` only checks; the launch reads ``base.data_ptr()``, ``shape``,
    ``strides`` and the box)."""
    shape, strides = t.shape, t.stride()
    key = (shape, strides, t.dtype, block, id(layout), t.data_ptr() & 15)  # the layout by identity (its hash is slow)
    kept = _DESCRIPTORS.get(key)
    if kept is not None and kept.layout is layout:
        return _clone(kept, t)
    made = TensorDescriptor(t, list(shape), list(strides), list(block), layout)
    if len(_DESCRIPTORS) >= DESCRIPTOR_CACHE_SIZE:
        _DESCRIPTORS.clear()
    _DESCRIPTORS[key] = _clone(made, None)
    return made


def kept_config(cache: dict, config: dict | None, signature: tuple, build) -> dict:
    """A kernel's checked config: ``build()`` once per (``config``'s items, ``signature``), kept in ``cache`` (the
    kernel file's own), so every call of a signature gets the same dict (read, never changed, by the launch).  An
    unhashable ``config`` value is checked by ``build()`` each time, not kept."""
    try:
        key = (None if config is None else tuple(sorted(config.items())), *signature)
        found = cache.get(key)
    except TypeError:
        return build()
    if found is None:
        found = cache[key] = build()
    return found


def _clone(desc: TensorDescriptor, base: torch.Tensor | None) -> TensorDescriptor:
    """``desc`` with ``base`` in place of its tensor: its fields copied, ``__init__`` not run (so neither are
    its checks)."""
    clone = object.__new__(type(desc))
    clone.__dict__.update(desc.__dict__)
    clone.base = base
    return clone


@gluon_jit
def row_shift(rc, col, qk_scale, row_layout: gl.constexpr):
    """``r_j = qk_scale (q . c_j)`` (64,) fp32 in ``row_layout`` from ``rc = q c^T`` (64, 16) fp32, whose
    column ``col`` is ``q . c_j`` (exact fp16 products; the tensor cores' fp32 sum over the head dim)."""
    cols = gl.arange(0, rc.shape[1], layout=gl.SliceLayout(0, rc.type.layout))
    r = gl.sum(gl.where((cols == col)[None, :], rc, 0.0), axis=1) * qk_scale
    return gl.convert_layout(r, row_layout)


@gluon_jit
def round_p(p, p_dtype: gl.constexpr):
    """``p`` (fp32) rounded to nearest in ``p_dtype``.  bf16 goes through ``cvt.rn.bf16x2.f32``, two values
    per instruction: Triton 3.6 lowers this conversion mostly to one ``F2F.BF16.F32`` per value on sm_90
    (a quarter-rate pipe that the softmax's ``exp2`` also needs), where fp16 gets the packed form."""
    if p_dtype == gl.bfloat16:
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.bfloat16,
                                         is_pure=True, pack=2)
    return p.to(p_dtype)


@gluon_jit
def widen_p(p):
    """``p`` (fp16 or bf16) as fp32, exactly, for ``l``'s sum.  A bf16 pair is widened straight from its
    packed register (``shl`` and ``and``: two instructions per pair), where Triton 3.6 unpacks each value
    first (two ``PRMT`` per pair more, on the softmax's path)."""
    if p.dtype == gl.bfloat16:
        return gl.inline_asm_elementwise("shl.b32 $0, $2, 16;\n\tand.b32 $1, $2, 0xffff0000;", "=r,=r,r", [p],
                                         dtype=gl.float32, is_pure=True, pack=2)
    return p.to(gl.float32)


@gluon_jit
def release(empty, i):
    """This consumer is done with stage ``i % NUM_STAGES`` of a ring: one arrival on its ``empty`` barrier."""
    mbarrier.arrive(empty.index(i % empty.shape[0]))


@gluon_jit
def wait_turn(turn, i, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Under ``PINGPONG`` (FA3's ping-pong between the consumer warpgroups), wait until consumer ``WG`` may issue
    tile ``i``'s GEMMs: consumer ``WG - 1`` has issued its tile ``i`` (consumer 0: the last consumer its tile
    ``i - 1``; tile 0 passes).  ``turn``: one count-1 mbarrier per consumer, each completing one phase per
    tile; every consumer of the program takes the same number of turns."""
    if PINGPONG:
        if WG == 0:
            mbarrier.wait(turn.index(0), (i & 1) ^ 1)
        else:
            mbarrier.wait(turn.index(WG), i & 1)


@gluon_jit
def pass_turn(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Under ``PINGPONG``, hand the turn to the next consumer (one arrival on its ``turn`` barrier)."""
    if PINGPONG:
        mbarrier.arrive(turn.index((WG + 1) % turn.shape[0]))


@gluon_jit
def ring_barriers(NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
    """The Hopper kernels' mbarriers, allocated and initialised: ``(q_ready, k_ready, k_empty, v_ready, v_empty,
    turn)``.  Per consumer ``q_ready`` (its q tiles landed; count 1: the producer's expect) and ``turn`` (the
    ping-pong's turns, :func:`wait_turn`); per ring stage ``k_ready`` / ``v_ready`` (count 1: the producer's
    expect) and ``k_empty`` / ``v_empty`` (count ``NUM_CONSUMERS``: every consumer's :func:`release`)."""
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(q_ready.index(w), count=1)
        mbarrier.init(turn.index(w), count=1)
    for st in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(st), count=1)
        mbarrier.init(k_empty.index(st), count=NUM_CONSUMERS)
        mbarrier.init(v_ready.index(st), count=1)
        mbarrier.init(v_empty.index(st), count=NUM_CONSUMERS)
    return q_ready, k_ready, k_empty, v_ready, v_empty, turn


@gluon_jit
def program_rows(H_Q, KV_GROUP, N_Q, ROWS: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
    """The Hopper kernels' program grid, ``(cdiv(N_Q, ROWS NUM_CONSUMERS) B H_Q,)`` with the query blocks of one
    (batch, head) adjacent: this program's ``(pid_bh, off_z, off_hq, off_hk, start_m)``, its flat (batch, query
    head), the batch, the query head and its kv head (``KV_GROUP`` query heads per kv head), and its first row."""
    pid = gl.program_id(0)
    num_m_blocks = gl.cdiv(N_Q, ROWS * NUM_CONSUMERS)
    pid_m = pid % num_m_blocks
    pid_bh = pid // num_m_blocks
    off_z = pid_bh // H_Q
    off_hq = pid_bh % H_Q
    return pid_bh, off_z, off_hq, off_hq // KV_GROUP, pid_m * (ROWS * NUM_CONSUMERS)


@gluon_jit
def kept_row(mc_ptr, mi_ptr, off_z, off_hq, start_m, stride_mcz, stride_mch, stride_mcq, stride_miz, stride_mih,
             stride_miq, MASK_GROUP, MASK_BLOCK_Q):
    """A block mask's row for the program's query rows ``start_m ..`` (all in one query block: the program's rows
    divide ``MASK_BLOCK_Q``) of batch ``off_z`` and query head ``off_hq`` (mask head ``off_hq // MASK_GROUP``; a
    shared batch or head has stride 0): ``(count, indices)``, how many key blocks it visits and the pointer to
    their ascending indices (``block_sparse.BlockSparseMask``; ``common.kept_blocks`` for the Triton kernels)."""
    off_mh = off_hq // MASK_GROUP
    q_blk = start_m // MASK_BLOCK_Q
    count = gl.load(mc_ptr + off_z * stride_mcz + off_mh * stride_mch + q_blk * stride_mcq)
    return count, mi_ptr + off_z * stride_miz + off_mh * stride_mih + q_blk * stride_miq


@gluon_jit
def tile_start(indices, stride_mij, i, BLOCK_N: gl.constexpr, SPARSE: gl.constexpr):
    """The first key of the ``i``-th key tile a program visits: tile ``i`` of the keys, or with ``SPARSE`` (key
    tiles of one mask block each) the ``i``-th kept block ``indices[i]``."""
    if SPARSE:
        return gl.load(indices + i * stride_mij) * BLOCK_N
    return i * BLOCK_N
