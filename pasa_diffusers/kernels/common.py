"""Helpers shared by the kernels: rounding, the tensor-core product, the exact centre of a key tile
(``@triton.jit``, inlined into their callers), the launchers' grid and stride helpers and ``INTERPRET`` (host
side).

Importing this module imports ``triton``; for CPU tensors set ``TRITON_INTERPRET=1`` before that.
"""
from __future__ import annotations

import functools
import struct

import torch
import triton
import triton.language as tl

from .. import rules
from ..block_sparse import BlockSparseMask

__all__ = ["LOG2E", "LN2", "P_SHIFT", "INTERPRET", "log2_units", "round_to", "mma", "binade", "centre_tile", "cdiv", "strides3",
           "lse_arg", "kept_blocks", "mask_args"]

LOG2E = tl.constexpr(rules.LOG2E)
"""``rules.LOG2E`` as the kernels' constexpr."""
LN2 = tl.constexpr(0.6931471805599453)
"""ln 2: a log2-unit log-sum-exp times ``LN2`` is the natural-log one."""
P_SHIFT = tl.constexpr(rules.P_SHIFT)
"""``rules.P_SHIFT`` as the kernels' constexpr."""


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


@functools.lru_cache(maxsize=64)
def log2_units(scale: float) -> float:
    """``u = fp32(fp32(scale) fp32(log2 e))``: the log2-unit scale of the logits as ``reference_int8`` and a
    kernel that forms ``scale * LOG2E`` from its fp32 argument compute it (the product of two fp32 values is
    exact in a double), for a launch that passes ``u`` itself."""
    return _f32(_f32(scale) * _f32(LOG2E.value))


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """``x`` (fp32) rounded to nearest-even in ``dtype``.  ``INTERPRET_BF16`` rounds the fp32 bits by
    hand first, because the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even)."""
    if INTERPRET_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def mma(a, b, acc, INTERPRET_BF16: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation.  ``INTERPRET_BF16`` multiplies fp32 copies of the
    operands (exact products of bf16 values: the same result up to summation order), because the
    interpreter's numpy dot cannot multiply bf16."""
    if INTERPRET_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def binade(x):
    """``2^e`` with ``2^e <= |x| < 2^(e+1)`` for normal fp32 ``x``: the exponent bits alone."""
    return (x.to(tl.uint32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def centre_tile(k32, key_valid, n_j, G_ULP, g_ty: tl.constexpr, EXACT_CENTRE: tl.constexpr,
                INTERPRET_BF16: tl.constexpr, KEY_AXIS: tl.constexpr, PAD_IS_KEY: tl.constexpr):
    """The exact shift's centre ``c`` fp32 of key tiles ``k32`` fp32 holding ``g`` values, keys along
    ``KEY_AXIS``: one tile (BLOCK_N, BLOCK_D) with ``KEY_AXIS = 0``, or one transposed tile per
    sequence (SEQS, BLOCK_D, BLOCK_K) with ``KEY_AXIS = 2``; ``c`` has the key axis reduced away.  Keys past the
    ``n_j`` valid ones (``key_valid`` false, broadcast against ``k32``) are loaded as zero, or, with
    ``PAD_IS_KEY``, as copies of a valid key (then the extremes need no mask, only the mean does).

        mean = colsum(k32) / n_j
        c    = round_g(mean)                      (EXACT_CENTRE=False: "half")
        c    = exact_centre(k32)                  (EXACT_CENTRE=True: "hybrid")

    ``exact_centre`` (``reference.exact_centre``): in a channel of positive keys with smallest ``a``
    (``2^e <= a < 2^(e+1)``) and largest ``b``, ``c = round_g(clamp(mean, b / 2, a + 2^(e+1)))`` (one
    ``g`` ulp, ``G_ULP`` times its binade, lower where rounding crossed the upper end) makes every
    ``k - c`` exact in ``g``; negative channels are mirrored; a channel whose keys change sign, or
    whose interval is empty (``b / 2 > a + 2^(e+1)``: keys spread over more than a factor of about 4),
    gets ``c = 0``.  No per-key check is needed: inside the interval every difference is exact.
    """
    if PAD_IS_KEY:
        mean = tl.sum(tl.where(key_valid, k32, 0.0), axis=KEY_AXIS) / n_j
    else:
        mean = tl.sum(k32, axis=KEY_AXIS) / n_j
    if EXACT_CENTRE:
        if PAD_IS_KEY:
            lo_key = tl.min(k32, axis=KEY_AXIS)
            hi_key = tl.max(k32, axis=KEY_AXIS)
        else:
            lo_key = tl.min(tl.where(key_valid, k32, float("inf")), axis=KEY_AXIS)
            hi_key = tl.max(tl.where(key_valid, k32, float("-inf")), axis=KEY_AXIS)
        positive = lo_key > 0.0
        negative = hi_key < 0.0
        sign = tl.where(negative, -1.0, 1.0)
        nearest = tl.where(positive, lo_key, -hi_key)
        farthest = tl.where(positive, hi_key, -lo_key)
        upper = nearest + 2.0 * binade(nearest)
        c_mag = round_to(tl.minimum(tl.maximum(sign * mean, 0.5 * farthest), upper), g_ty, INTERPRET_BF16)
        c_mag = c_mag.to(tl.float32)
        c_mag = tl.where(c_mag > upper, c_mag - binade(c_mag) * G_ULP, c_mag)
        c = sign * c_mag
        c = tl.where((positive | negative) & (0.5 * farthest <= upper), c, 0.0)
    else:
        c = round_to(mean, g_ty, INTERPRET_BF16).to(tl.float32)
    return c


@triton.jit
def kept_blocks(mc_ptr, mi_ptr, off_z, off_hq, pid_m, stride_mcz, stride_mch, stride_mcq, stride_miz, stride_mih,
                stride_miq, MASK_GROUP, MASK_BLOCK_Q, BLOCK_M: tl.constexpr):
    """A block mask's row for one query tile of ``BLOCK_M`` rows (``BLOCK_M`` divides ``MASK_BLOCK_Q``, so the
    tile lies in query block ``pid_m BLOCK_M // MASK_BLOCK_Q``) of batch ``off_z`` and query head ``off_hq``
    (mask head ``off_hq // MASK_GROUP``; a shared batch has stride 0): ``(count, indices)``, how many key blocks
    it visits and the pointer to their ascending indices (``block_sparse.BlockSparseMask``'s ``kv_counts`` and
    ``kv_indices``)."""
    off_mh = off_hq // MASK_GROUP
    q_blk = (pid_m * BLOCK_M) // MASK_BLOCK_Q
    count = tl.load(mc_ptr + off_z * stride_mcz + off_mh * stride_mch + q_blk * stride_mcq)
    indices = mi_ptr + off_z * stride_miz + off_mh * stride_mih + q_blk * stride_miq
    return count, indices


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the host's grids and block counts (``triton.cdiv`` is the same number through
    Triton's constexpr-function wrapper: 3-4 us a call on the host)."""
    return -(-a // b)


def strides3(t: torch.Tensor) -> tuple[int, int, int]:
    """The strides of a (B, H, N, D) tensor's first three axes (the head dim's is 1)."""
    return t.stride(0), t.stride(1), t.stride(2)


_NO_LSE: dict[torch.device, torch.Tensor] = {}


def lse_arg(lse: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The LSE pointer a launcher passes: ``lse``, or without one an empty fp32 tensor (a null pointer that
    ``STORE_LSE=False`` never reads; no memory, cached per device).  A call without the LSE thus passes
    arguments of the same dtypes as one with it: Triton's autotuner keys its choice by them, so both run
    the same tuned config and give the same output bits."""
    if lse is not None:
        return lse
    empty = _NO_LSE.get(device)
    if empty is None:
        empty = _NO_LSE[device] = torch.empty(0, dtype=torch.float32, device=device)
    return empty


_NO_MASK: dict[torch.device, torch.Tensor] = {}


def mask_args(mask: BlockSparseMask | None, q: torch.Tensor) -> tuple:
    """The block mask's kernel arguments for queries ``q`` (B, Hq, Nq, D): ``kv_counts``, ``kv_indices``, their
    strides (0 along a shared batch or head), the query heads per mask head, ``block_q`` (what
    :func:`kept_blocks` reads); without a mask (``None``) an empty int32 tensor in place of both (read by no
    ``SPARSE=False`` kernel, cached per device: the same argument dtypes, so the same tuned config, as
    :func:`lse_arg`)."""
    if mask is None:
        empty = _NO_MASK.get(q.device)
        if empty is None:
            empty = _NO_MASK[q.device] = torch.empty(0, dtype=torch.int32, device=q.device)
        return (empty, empty, 0, 0, 0, 0, 0, 0, 0, 1, 1)
    counts, indices = mask.kv_counts, mask.kv_indices
    batch, heads = counts.shape[:2]
    shared = (batch == 1, heads == 1)
    sc = [0 if one else st for one, st in zip(shared, counts.stride()[:2])] + [counts.stride(2)]
    si = [0 if one else st for one, st in zip(shared, indices.stride()[:2])] + list(indices.stride()[2:])
    return (counts, indices, *sc, *si, q.shape[1] // heads, mask.block_q)


INTERPRET = not isinstance(round_to, triton.JITFunction)
"""True when ``TRITON_INTERPRET=1`` was set before triton was imported: every kernel then runs on CPU
tensors through Triton's numpy interpreter (one fixed small configuration each, no autotuning)."""
