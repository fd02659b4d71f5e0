"""The exact shift in 8 bits (``precision="int8"``): the PyTorch spec the int8 kernels are tested against.

``q k^T`` runs as an INT8 GEMM with an exact int32 sum, everything an 8-bit code cannot hold is removed
first and carried exactly in fp32, and ``P V`` runs in 16 bits (or, on request, FP8 e4m3).  The design
and its measurements are in ``docs/NUMERICS.md`` ("The exact shift in 8 bits").  Every rounding point
is one visible call here, at the place the kernels (``kernels/int8.py``) round.

Notation: ``g`` the GEMM dtype (fp16, or bf16 for bf16 inputs); ``D`` the head dim, ``Dp`` its
power-of-two tile (>= 32, padded with zeros: :func:`rotation_size`); ``H`` the ``Dp x Dp``
Sylvester-Hadamard matrix (entries +-1, ``H H^T = Dp I``), applied by :func:`fwht`; ``u = scale log2(e)``
(the kernels' log2 units).  Per (batch, head):

1. **Queries, smoothed** (:func:`query_mean`, :func:`quantize_queries`): ``qbar = round_g(round_fp32(mean
   over all tokens of q))`` (fp64 sums: exact for fp16 values, so any summation order gives the same bits);
   ``y_i = fwht(q_i - qbar)`` (fp32); ``mu_i = y_i0 / Dp`` (the row's mean over the Dp channels) and
   ``y_i0 := 0``, so that ``y_i = H q~_i`` with ``q~_i = q_i - qbar - mu_i 1``.
2. **Keys, centred and rotated** (:func:`quantize_keys`): per block ``b`` of ``SHIFT_BLOCK = 128`` keys
   ``c_b = round_g(round_fp32(block mean))`` (fp64 sums), ``kc_j = k_j - c_b`` (fp32); ``w_j = fwht(kc_j)``,
   ``sigma_j = w_j0`` (``= sum_d kc_jd``) and ``w_j0 := 0``; ``A_hj = fp32(qbar_h . kc_j)`` (fp32
   products, summed in fp64) for every query head ``h`` reading key head ``j``'s.
3. **INT8 codes** (:func:`quantize_rows`), per token on both sides: ``amax = max |y_i|``, scale
   ``s = amax / 127`` (fp32), codes ``rne(y_i / s)`` in [-127, 127] (0 where ``amax = 0``).
4. **Scores** (:func:`attention_from_codes`), for query ``i`` and key ``j`` of block ``b``:

       q_i . k_j = q_i . c_b + qbar . kc_j + mu_i sigma_j + (H q~_i) . (H kc_j) / Dp         (exact)
       z_ij = (I_ij s_kj) (s_qi u / Dp) + (mu_i u) sigma_j + u A_j,   I_ij = sum_d Q_id K_jd (int32)
       r_ib = u fp32(q_i . c_b)                                     (fp32 products and sum, per row)

   so that ``z_ij + r_ib`` is ``u q_i . k_j`` up to the codes' rounding alone.  ``r_ib`` reaches 1e4 for
   biased inputs, so the online softmax goes through the tile's own maximum ``m_s = rowmax z``, as the
   default's kernel does: ``m_blk = m_s + r``, ``m_new = max(m_i, m_blk)``, ``x = z - (m_s - (m_blk -
   m_new))``, ``alpha = exp2(m_i - m_new)``; ``m``, ``l`` and the accumulator fp32.
4b. **Blocks in 16 bits** (:func:`fallback_blocks`, LampAttention's idea): a key block ``b`` whose predicted
   RMS logit error from the codes' rounding, ``(scale / Dp) sqrt((SQ2 W2_b + SK2_b Y2) / 12)``, exceeds
   ``INT8_FALLBACK_TAU`` (natural units) takes ``z_ij = u fp32(q_i . hi_j + q_i . lo_j)`` instead, for that
   (batch, query head): ``kc_j = k_j - c_b`` (fp32) split into ``hi = round_g(kc)`` and ``lo = round_g(kc -
   hi)`` (``k - c_b`` is not a ``g`` value: at +-40, fp16's rounding of it alone is 1.6e-2), two 16-bit
   GEMMs with fp32 products and sum, as ``r``.  ``SQ2``, ``Y2``: the query head's means over
   its tokens of ``s_qi^2`` and ``|y_i|^2``; ``W2_b``, ``SK2_b``: the block's means of ``|w_j|^2`` and
   ``s_kj^2`` (:func:`error_model`'s ``delta`` averaged over the block and the queries); sums in fp64, the
   queries' per ``SHIFT_BLOCK`` rows and then in block order.  The comparison is ``SQ2 W2 + SK2 Y2 > 12 t^2``
   with ``t = (tau Dp) / scale`` in fp64 from the fp32 values of ``tau`` and ``scale``.
4c. **Tile order** (:func:`block_order`): with 16-bit blocks, each (batch, query head) visits the key tiles of
   its coded blocks first, in ascending order, then those of its 16-bit blocks, ascending, on the same running
   state (exact in real arithmetic; it sets the offsets at which ``p`` is rounded).  The kernels' key loop then
   holds only 8-bit tiles, and the 16-bit ones run in a loop of their own after it.
5. **P V**: ``pv_bits=16`` (the default): ``p = round_g(exp2(x))``, ``acc = alpha acc + p V`` (fp32), and
   ``l`` sums the fp32 ``exp2(x)`` before their rounding (as FlashAttention-3 and SageAttention do: the sum
   of the rounded ``p`` costs the kernels a widening per score, and the two differ by the rounding noise
   averaged over the keys, far below the codes' error).  ``pv_bits=8``: ``P8 = e4m3(exp2(x +
   P_SHIFT))`` (``<= 256``: e4m3's range, FlashAttention-3's shift of 8), V in e4m3 per channel
   (:func:`quantize_values`: ``vs_d = amax_t |v_td| / 448`` over the head's keys, ``V8 = e4m3(v *
   (448 / amax))``), ``l`` sums ``exp2(x + P_SHIFT)`` unrounded, ``acc = alpha acc + (P8 V8) vs`` with ``P8 V8``
   summed in fp32 per key tile (on Hopper the FP8 products keep about 22 bits inside a tile; the tile's sum moves to the
   fp32 accumulator every tile).  ``out = acc (1 / l)``, rounded to the input dtype.

Why each step (measured, docs/NUMERICS.md): the INT8 error of a score is the codes' rounding, ``step |other
operand|``, so everything large is taken out of both operands first and carried in fp32: the block
centre (K's bias), ``qbar`` (a bias every query shares, per channel), ``mu_i`` (a bias common to a
query's channels: a drift along the tokens), and the Hadamard rotation spreads an outlier channel over all
channels so that one channel does not set every channel's step.  The centre is the rounded block mean,
not the default's exact centre: ``k - c`` is quantized anyway, so it need not be exact in ``g``, and the
mean leaves the smallest codes (the exact centre's clamp leaves an offset in some channels).
Per-token scales beat per-block ones (per 128 or 64 keys, per 64 queries) where the codes' error
dominates (benign: 8.7e-3 against 1.1e-2).  The 16-bit blocks are the classes whose centred blocks keep
a large common part (two biases in one block, keys flipping sign: 3e-2 - 0.13 in 8 bits), which the
criterion takes and no other class of the bench but uniform(80,5).  FP8 ``P V`` costs 2.3-4.2e-2 relative RMSE on every class
(e4m3's 3 mantissa bits on both ``P`` and ``V``), above the 1e-2 bound, hence 16 bits by default.

The bound is a function of the input, not a flat 1e-2 (docs/NUMERICS.md, "The bound as a function of the input"):
for V with independent zero-mean rows the relative RMSE against the exact output is at most ``sqrt(C^2 eta^2 + 4
e16^2)`` with ``pv_bits=16`` and ``sqrt(C^2 (eta^2 + 2 E4M3_REL_RMS^2) + 4 e16^2)`` with ``pv_bits=8``, ``C = 1.15``,
where ``eta`` is the largest step-4b statistic ``(scale / Dp) sqrt((SQ2 W2_b + SK2_b Y2) / 12)`` among the blocks
left in 8 bits (so ``eta <= INT8_FALLBACK_TAU``) and ``e16`` the 16-bit default's error on the input.  ``eta`` grows
as ``s_q s_k`` (8.5e-3 and 9.2e-3 times it for q, k ~ N(0, s^2) at head dims 64 and 128): 8-bit ``P V`` aside, the
error passes 1e-2 from ``s_q s_k`` of about 1.1-1.2 up to the criterion's switch (2.2-2.35; measured up to 1.7e-2),
and the bound allows 2.3e-2 on any input (4.75e-2 with FP8 ``P V``, measured at most 4.14e-2).

Query rows are independent, so ``block_m`` only bounds memory; the key tile ``block_n`` (dividing
``SHIFT_BLOCK``) sets the online softmax's rescaling order.  :func:`error_model` predicts the first-order
error of the codes' rounding (the tests' bound).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import rules
from .block_sparse import BlockSparseMask
from .kernels import block_tally
from .rules import FP8_MAX, INT8_FALLBACK_TAU, LOG2E, P_SHIFT, QMAX, SHIFT_BLOCK, gemm_dtype
from .variants import PV_BITS

__all__ = [
    "P_SHIFT",
    "rotation_size",
    "log2_units",
    "fwht",
    "quantize_rows",
    "query_mean",
    "QuantizedQueries",
    "QuantizedKeys",
    "QuantizedValues",
    "fallback_noise",
    "fallback_threshold",
    "fallback_blocks",
    "block_order",
    "quantize_queries",
    "quantize_keys",
    "quantize_values",
    "attention_from_codes",
    "int8_reference",
    "ErrorModel",
    "error_model",
    "logit_error",
    "coded_logit_error",
    "stated_bound",
]

_F32 = torch.float32
_F64 = torch.float64
_E4M3 = torch.float8_e4m3fn


def rotation_size(head_dim: int) -> int:
    """``Dp``: the smallest power of two >= max(head_dim, 32) (the kernels' ``BLOCK_D``; 32 is the reduction
    depth of one INT8 MMA, below which the GPU has no INT8 dot)."""
    return max(32, 1 << (int(head_dim) - 1).bit_length())


def _pad(x: torch.Tensor, dp: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, dp - x.shape[-1])) if x.shape[-1] < dp else x


def fwht(x: torch.Tensor) -> torch.Tensor:
    """``x H^T`` over the last axis (a power of two): the Walsh-Hadamard transform in natural order,
    ``y_k = sum_d (-1)^popcount(k & d) x_d``, unnormalised, by butterflies in fp32.

    Stage ``h = 1, 2, 4, ..., Dp/2`` pairs channel ``d`` (bit ``h`` clear) with ``d + h`` into ``(a + b,
    a - b)``: additions only, so the kernels' identical stages give identical bits."""
    dp = x.shape[-1]
    if dp & (dp - 1):
        raise ValueError(f"fwht: the last axis must be a power of two, got {dp}")
    x = x.to(_F32)
    h = 1
    while h < dp:
        y = x.reshape(*x.shape[:-1], dp // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(*x.shape[:-1], dp)
        h *= 2
    return x


def _ieee_inverse(top: float, amax: torch.Tensor) -> torch.Tensor:
    """``top / amax`` by one IEEE division (0 where ``amax = 0``).  (``scalar / tensor`` in PyTorch multiplies
    by a reciprocal: two roundings, which differ from the kernels' ``div_rn`` in a quarter of the values.)"""
    live = amax > 0
    return torch.where(live, torch.full_like(amax, top) / torch.where(live, amax, 1.0), 0.0)


def quantize_rows(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 codes of fp32 rows ``y`` (..., Dp): ``(codes int8, scale fp32 (...,))`` with
    ``scale = amax / 127`` and ``codes = rne(y / scale)`` (IEEE divisions, one rounding each; ``amax = 0``
    gives codes 0 and scale 0), so ``y ~= codes * scale``; ``|y / scale| <= 127 (1 + 2^-24)`` rounds into
    [-127, 127]."""
    scale = y.abs().amax(dim=-1) / QMAX
    live = (scale > 0)[..., None]
    codes = torch.round(torch.where(live, y / torch.where(live, scale[..., None], 1.0), 0.0))
    return codes.to(torch.int8), scale


def _round_g(x64: torch.Tensor, g: torch.dtype) -> torch.Tensor:
    """fp64 values rounded to fp32, then to ``g`` (two roundings, held in fp32: what the kernels do, and
    what any two implementations can do alike; the double rounding moves no value by more than one ``g``
    ulp, and the means it rounds need no better)."""
    return x64.to(_F32).to(g).to(_F32)


def query_mean(q: torch.Tensor) -> torch.Tensor:
    """``qbar`` (B, Hq, 1, D) fp32: each (batch, head)'s mean query over all its tokens, summed in fp64
    (exact for fp16 values), rounded to fp32 and then to ``g``."""
    g = gemm_dtype(q.dtype)
    return _round_g(q.to(g).to(_F64).sum(dim=-2, keepdim=True) / q.shape[-2], g)


class QuantizedQueries(NamedTuple):
    """What the queries' pre-pass writes: ``codes`` (B, Hq, Nq, Dp) int8 of ``H q~``; ``scale`` and ``mu``
    (B, Hq, Nq) fp32; ``qbar`` (B, Hq, 1, D) fp32 (``g`` values); ``stats`` (B, Hq, 2) fp64: the head's
    means of ``s_qi^2`` and ``|y_i|^2`` (step 4b; None where codes are built without it, as
    ``bench.int8_accuracy``'s designs)."""

    codes: torch.Tensor
    scale: torch.Tensor
    mu: torch.Tensor
    qbar: torch.Tensor
    stats: torch.Tensor | None = None


class QuantizedKeys(NamedTuple):
    """What the keys' pre-pass writes: ``codes`` (B, Hk, Nk, Dp) int8 of ``H kc``; ``scale`` and ``sigma``
    (B, Hk, Nk) fp32; ``a`` (B, Hq, Nk) fp32 (``qbar_h . kc_j`` per query head); ``centres`` (B, Hk,
    blocks, D) fp32 (``g`` values); ``stats`` (B, Hk, blocks, 2) fp64: each block's means of ``s_kj^2``
    and ``|w_j|^2`` (step 4b; None as for the queries)."""

    codes: torch.Tensor
    scale: torch.Tensor
    sigma: torch.Tensor
    a: torch.Tensor
    centres: torch.Tensor
    stats: torch.Tensor | None = None


class QuantizedValues(NamedTuple):
    """V for ``P V``: in 16 bits ``values`` is V in ``g`` and ``scale`` is None; in 8 bits ``values`` is
    (B, Hk, Nk, D) e4m3 and ``scale`` (B, Hk, D) fp32 (``vs``)."""

    values: torch.Tensor
    scale: torch.Tensor | None


def _block_sums(x: torch.Tensor) -> torch.Tensor:
    """Sums of fp64 ``x`` (..., N, S) over each ``SHIFT_BLOCK`` tokens: (..., blocks, S)."""
    pad = -x.shape[-2] % SHIFT_BLOCK
    return torch.nn.functional.pad(x, (0, 0, 0, pad)).unflatten(-2, (-1, SHIFT_BLOCK)).sum(-2)


def _row_stats(scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``(s^2, |row|^2)`` per token in fp64 (..., N, 2): squares of fp32 values are exact in fp64."""
    return torch.stack([scale.to(_F64).pow(2), rows.to(_F64).pow(2).sum(-1)], dim=-1)


def quantize_queries(q: torch.Tensor, qbar: torch.Tensor | None = None) -> QuantizedQueries:
    """Step 1 and 3 of the module docstring for q (B, Hq, Nq, D); ``qbar`` defaults to :func:`query_mean`."""
    g = gemm_dtype(q.dtype)
    qbar = query_mean(q) if qbar is None else qbar
    dp = rotation_size(q.shape[-1])
    y = fwht(_pad(q.to(g).to(_F32) - qbar, dp))
    mu = y[..., 0] / dp
    y[..., 0] = 0.0
    codes, scale = quantize_rows(y)
    parts = _block_sums(_row_stats(scale, y))  # (B, Hq, blocks, 2), then summed in block order
    total = torch.zeros_like(parts[:, :, 0])
    for blk in range(parts.shape[2]):
        total = total + parts[:, :, blk]
    return QuantizedQueries(codes, scale, mu, qbar, total / q.shape[-2])


def quantize_keys(k: torch.Tensor, qbar: torch.Tensor) -> QuantizedKeys:
    """Step 2 and 3 of the module docstring for k (B, Hk, Nk, D), with the queries' ``qbar`` (B, Hq, 1, D)."""
    g = gemm_dtype(k.dtype)
    batch, h_k, n_k, d = k.shape
    dp = rotation_size(d)
    k32 = k.to(g).to(_F32)
    kc = torch.empty_like(k32)
    centres = []
    for start in range(0, n_k, SHIFT_BLOCK):
        blk = k32[:, :, start:start + SHIFT_BLOCK]
        c = _round_g(blk.to(_F64).sum(dim=-2, keepdim=True) / blk.shape[-2], g)
        kc[:, :, start:start + SHIFT_BLOCK] = blk - c
        centres.append(c)
    w = fwht(_pad(kc, dp))
    sigma = w[..., 0].clone()
    w[..., 0] = 0.0
    codes, scale = quantize_rows(w)
    group = qbar.shape[1] // h_k
    a = (kc.repeat_interleave(group, dim=1) * qbar).to(_F64).sum(-1).to(_F32)
    counts = torch.tensor([min(SHIFT_BLOCK, n_k - s) for s in range(0, n_k, SHIFT_BLOCK)], dtype=_F64)
    stats = _block_sums(_row_stats(scale, w)) / counts[:, None]
    return QuantizedKeys(codes, scale, sigma, a, torch.cat(centres, dim=-2), stats)


def fallback_threshold(scale: float, dp: int, tau: float = INT8_FALLBACK_TAU) -> float:
    """``12 t^2`` with ``t = (tau Dp) / scale`` in fp64 from the fp32 values of ``tau`` and ``scale`` (as the
    kernel, which receives them in fp32): the right-hand side of step 4b's comparison."""
    t = float(torch.tensor(tau, dtype=_F32)) * dp / float(torch.tensor(scale, dtype=_F32))
    return 12.0 * t * t


def fallback_noise(qq: QuantizedQueries, kq: QuantizedKeys) -> torch.Tensor:
    """The left-hand side of step 4b's comparison, ``SQ2 W2_b + SK2_b Y2`` (B, Hq, blocks) fp64."""
    group = qq.stats.shape[1] // kq.stats.shape[1]
    keys = kq.stats.repeat_interleave(group, dim=1)
    return qq.stats[:, :, None, 0] * keys[..., 1] + keys[..., 0] * qq.stats[:, :, None, 1]


def fallback_blocks(qq: QuantizedQueries, kq: QuantizedKeys, scale: float, tau: float = INT8_FALLBACK_TAU
                    ) -> torch.Tensor:
    """Step 4b: which key blocks each (batch, query head) computes in 16 bits, (B, Hq, blocks) bool."""
    return fallback_noise(qq, kq) > fallback_threshold(scale, kq.codes.shape[-1], tau)


def block_order(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The order in which the kernels visit the key blocks (step 4c): per (batch, query head) the blocks from the
    codes ascending, then the 16-bit ones ascending.  ``flags`` (B, Hq, blocks) (:func:`fallback_blocks`);
    returns ``order`` (B, Hq, blocks) int32 (block indices) and ``coded`` (B, Hq) int32 (how many of them come
    from the codes)."""
    flagged = flags.bool()
    order = torch.sort(flagged.to(torch.uint8), dim=-1, stable=True).indices.to(torch.int32)
    return order, (~flagged).sum(-1, dtype=torch.int32)


def quantize_values(v: torch.Tensor, pv_bits: int = 16) -> QuantizedValues:
    """V as ``P V`` reads it: in ``g`` (16 bits), or e4m3 per channel with ``vs = amax / 448`` (8 bits)."""
    g = gemm_dtype(v.dtype)
    if pv_bits == 16:
        return QuantizedValues(v.to(g), None)
    v32 = v.to(g).to(_F32)
    amax = v32.abs().amax(dim=-2)  # (B, Hk, D)
    inv = _ieee_inverse(FP8_MAX, amax)
    return QuantizedValues((v32 * inv[:, :, None, :]).to(_E4M3), amax / FP8_MAX)


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=_F32)


def log2_units(scale: float) -> torch.Tensor:
    """``u = fp32(scale) fp32(log2 e)`` in fp32: the logits' scale in the kernels' log2 units (the pre-pass
    stores the keys' bias term as ``u A``)."""
    return _f32(scale) * _f32(LOG2E)


def attention_from_codes(q: torch.Tensor, qq: QuantizedQueries, kq: QuantizedKeys, vq: QuantizedValues,
                         scale: float, *, out_dtype: torch.dtype, block_m: int = 128, block_n: int = SHIFT_BLOCK,
                         fallback: torch.Tensor | None = None, k: torch.Tensor | None = None,
                         return_lse: bool = False, block_mask: BlockSparseMask | None = None
                         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Steps 4 and 5 of the module docstring: the attention kernel's part, from the pre-pass's outputs and
    the queries ``q`` (for ``r = u q . c_b``).  ``fallback`` (B, Hq, blocks) bool (:func:`fallback_blocks`)
    marks the key blocks computed in 16 bits from the keys ``k`` (step 4b); None: none.  Output (B, Hq, Nq,
    D) in ``out_dtype``; with ``return_lse`` also each row's natural-log log-sum-exp ``(m + log2(l) (-
    P_SHIFT in 8 bits)) ln 2`` (B, Hq, Nq) fp32, from the final state as the kernel stores it.

    ``block_mask`` (:class:`~pasa_diffusers.block_sparse.BlockSparseMask`, ``block_k`` a multiple of the key tile
    ``block_n``: a kept block's tiles are visited, as the kernels walk them; the query blocks then are its
    ``block_q`` rows): step 4c restricted to the kept blocks, i.e. per (batch, head, query block) the kept coded
    tiles ascending, then the kept 16-bit tiles ascending; a query block that keeps none gives zeros and ``lse =
    -inf``.  None (or every block kept): bit for bit the dense loop."""
    g = gemm_dtype(q.dtype)
    batch, h_q, n_q, d = q.shape
    h_k, n_k = kq.codes.shape[1], kq.codes.shape[2]
    dp = kq.codes.shape[-1]
    group = h_q // h_k
    fp8 = vq.scale is not None
    u = log2_units(scale)
    a_row = qq.scale * (u / dp)  # (B, Hq, Nq)
    mu_u = qq.mu * u
    au = kq.a * u  # (B, Hq, Nk)

    def kv(t):
        return t.repeat_interleave(group, dim=1)

    k_codes, k_scale, sigma = kv(kq.codes).to(_F32), kv(kq.scale), kv(kq.sigma)
    centres, values = kv(kq.centres), kv(vq.values).to(_F32)
    v_scale = kv(vq.scale)[:, :, None, :] if fp8 else None
    q32 = q.to(g).to(_F32)
    if fallback is not None:
        if k is None:
            raise ValueError("attention_from_codes: fallback blocks need the keys k")
        k32 = kv(k.to(g).to(_F32))
    kept = None
    if block_mask is not None:
        block_mask.check_call(q, kq.codes, "attention_from_codes")
        if block_mask.block_k % block_n:
            raise ValueError(f"attention_from_codes: block_mask.block_k={block_mask.block_k} is not a multiple of the "
                             f"key tile block_n={block_n}")
        kept, block_m = block_mask.kept_blocks(batch, h_q), block_mask.block_q
    out = torch.empty(batch, h_q, n_q, d, dtype=out_dtype)
    lse = torch.empty(batch, h_q, n_q)
    for r0 in range(0, n_q, block_m):
        rows = slice(r0, min(r0 + block_m, n_q))
        q_codes = qq.codes[:, :, rows].to(_F32)
        a_i, mu_i = a_row[:, :, rows, None], mu_u[:, :, rows, None]
        m_i = torch.full((batch, h_q, q_codes.shape[2], 1), -math.inf)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros(batch, h_q, q_codes.shape[2], d)
        for sixteen in ((False,) if fallback is None else (False, True)):  # step 4c: coded tiles, then 16-bit
            for start in range(0, n_k, block_n):
                taken = None
                if fallback is not None:  # this pass takes the (batch, head)s whose block is of its kind
                    taken = (fallback[:, :, start // SHIFT_BLOCK] == sixteen)[:, :, None, None]
                if kept is not None:  # ... and that keep the block
                    visit = kept[:, :, r0 // block_m, start // block_mask.block_k, None, None]
                    taken = visit if taken is None else taken & visit
                if taken is not None and not taken.any():
                    continue
                keys = slice(start, min(start + block_n, n_k))
                c_b = centres[:, :, start // SHIFT_BLOCK, None, :]
                r = (q32[:, :, rows] * c_b).sum(-1, keepdim=True) * u
                if sixteen:
                    kc = k32[:, :, keys] - c_b
                    hi = kc.to(g).to(_F32)
                    lo = (kc - hi).to(g).to(_F32)
                    z = (q32[:, :, rows].to(_F64) @ (hi.to(_F64) + lo.to(_F64)).transpose(-1, -2)).to(_F32) * u
                else:
                    i_sum = q_codes @ k_codes[:, :, keys].transpose(-1, -2)  # exact: |I| < 2^24 for Dp <= 1024
                    z = ((i_sum * k_scale[:, :, None, keys]) * a_i
                         + (mu_i * sigma[:, :, None, keys] + au[:, :, None, keys]))
                m_s = z.amax(-1, keepdim=True)
                m_blk = m_s + r
                m_new = torch.maximum(m_i, m_blk)
                x = z - (m_s - (m_blk - m_new))
                alpha = torch.exp2(m_i - m_new)
                if fp8:
                    p32 = torch.exp2(x + P_SHIFT)
                    pv = (p32.to(_E4M3).to(_F32) @ values[:, :, keys]) * v_scale
                else:
                    p32 = torch.exp2(x)
                    pv = p32.to(g).to(_F32) @ values[:, :, keys]
                l_new = alpha * l_i + p32.sum(-1, keepdim=True)
                acc_new = alpha * acc + pv
                if taken is not None:
                    m_new, l_new, acc_new = (torch.where(taken, new, old) for new, old in
                                             ((m_new, m_i), (l_new, l_i), (acc_new, acc)))
                m_i, l_i, acc = m_new, l_new, acc_new
        out[:, :, rows] = (acc * (1.0 / l_i)).to(out_dtype)
        lse[:, :, rows] = ((m_i + torch.log2(l_i) - (P_SHIFT if fp8 else 0.0)) * math.log(2.0))[..., 0]
        if kept is not None:  # an empty row: zeros, lse -inf
            empty = ~kept[:, :, r0 // block_m].any(-1)[:, :, None, None]
            out[:, :, rows] = torch.where(empty, torch.zeros((), dtype=out_dtype), out[:, :, rows])
            lse[:, :, rows] = torch.where(empty[..., 0], -math.inf, lse[:, :, rows])
    return (out, lse) if return_lse else out


def _check(fn: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, pv_bits: int,
           block_m: int, block_n: int) -> float:
    rules.check_qkv(fn, q, k, v, "fp64")  # any float dtype, any head dim: the unrounded precision's rule
    if q.dtype not in rules.SUPPORTED_DTYPES:
        raise ValueError(f"{fn}: dtype {q.dtype} is not supported; expected one of {rules.SUPPORTED_DTYPES}")
    if pv_bits not in PV_BITS:
        raise ValueError(f"{fn}: unknown pv_bits={pv_bits!r}; expected one of {PV_BITS}")
    if not (isinstance(block_m, int) and block_m >= 1):
        raise ValueError(f"{fn}: block_m must be a positive int, got block_m={block_m!r}")
    if not (isinstance(block_n, int) and block_n >= 1 and SHIFT_BLOCK % block_n == 0):
        raise ValueError(f"{fn}: block_n must divide the centre block {SHIFT_BLOCK}, got block_n={block_n!r}")
    rules.check_options(fn, precision="fp64", shift="exact", scale=scale)
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def int8_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
                   pv_bits: int = 16, fallback: bool = True, tally: bool = False, block_m: int = 128,
                   block_n: int = SHIFT_BLOCK, return_lse: bool = False, block_mask: BlockSparseMask | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The exact shift in 8 bits (the module docstring), for (B, H, N, D) fp16 or bf16 tensors with
    ``Hq`` a multiple of ``Hk``, any ``Nq``, ``Nk >= 1``.  ``pv_bits``: ``P V`` in the GEMM dtype (16)
    or in FP8 e4m3 (8).  ``fallback``: key blocks the codes cannot hold in 16 bits (step 4b; the default);
    False: every block from the codes.  ``tally``: count them in ``block_tally`` (the op's CPU path does;
    the spec used as a spec leaves the counters alone).  ``block_n`` (the key tile) divides
    ``SHIFT_BLOCK``.  Output in ``q.dtype``; ``return_lse`` also returns the rows' log-sum-exp (B, Hq,
    Nq) fp32 (:func:`attention_from_codes`).  ``block_mask``: the kept key blocks (:func:`attention_from_codes`;
    the codes, centres and 16-bit flags are those of the dense call: a mask changes which tiles are visited, not
    how one is coded)."""
    scale = _check("int8_reference", q, k, v, scale, pv_bits, block_m, block_n)
    qq = quantize_queries(q)
    kq = quantize_keys(k, qq.qbar)
    vq = quantize_values(v, pv_bits)
    flags = None
    if fallback:
        flags = fallback_blocks(qq, kq, scale)
        if tally:
            block_tally.count(flags)
    return attention_from_codes(q, qq, kq, vq, scale, out_dtype=q.dtype, block_m=block_m, block_n=block_n,
                                fallback=flags, k=k, return_lse=return_lse, block_mask=block_mask)


E4M3_REL_RMS = math.sqrt(0.5 / 3.0) * 2.0 ** -4
"""RMS relative rounding error of e4m3 (3 mantissa bits, uniform significands): ``2^-4 sqrt(E[1/(1+f)^2] / 3)``
with ``E[1/(1+f)^2] = 1/2`` over ``f`` in [0, 1)."""


class ErrorModel(NamedTuple):
    """:func:`error_model`'s prediction: ``rel_rmse`` (the expected relative RMSE of the codes' rounding) and
    ``rows`` (the effective number of query rows it comes from, ``(sum_i E_i)^2 / sum_i E_i^2`` over the rows'
    expected squared errors ``E_i``: a few rows with near-ties can carry all of it, and then the realised
    error scatters around the expectation by about ``sqrt(2 / rows)`` relative)."""

    rel_rmse: float
    rows: float


def error_model(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
                pv_bits: int = 16, fallback: bool = True) -> ErrorModel:
    """The first-order prediction of :func:`int8_reference`'s relative RMSE against the exact output, from
    its codes' rounding alone (and e4m3's, with ``pv_bits=8``); with ``fallback`` the key blocks computed in
    16 bits (step 4b) contribute no codes' error.

    Rounding to nearest leaves errors ``e`` uniform in ``+-step / 2`` (variance ``step^2 / 12``), independent
    per element.  With golden weights ``p_ij`` and output ``o_i``, a logit error ``delta_ij`` moves the
    output by ``sum_j p_ij delta_ij (v_j - o_i)``; ``delta_ij = scale (e_qi . w_j + y_i . e_kj) / Dp``
    (``y``, ``w`` the rotated queries and keys, ``e`` their codes' errors):

        E_i = E|do_i|^2 = (scale / Dp)^2 [ s_qi^2 / 12 ||sum_j p_ij w_j (v_j - o_i)^T||_F^2
                                           + |y_i|^2 sum_j p_ij^2 s_kj^2 / 12 |v_j - o_i|^2 ]

    plus, in 8 bits, ``eps^2 sum_j p_ij^2 |v_j - o_i|^2`` (``P``'s rounding) and ``eps^2 sum_j p_ij^2 |v_j|^2``
    (V's), ``eps = E4M3_REL_RMS``.  ``rel_rmse = sqrt(mean_i E_i / mean_i |o_i|^2)``.  Second-order terms
    (near-ties of the largest weights) and the 16-bit roundings (``P`` in ``g``, the output) are not in it.
    Memory: float64 weights (B, Hq, Nq, Nk) and (B, Hq, Nq, Dp, D): small shapes only."""
    scale = _check("error_model", q, k, v, scale, pv_bits, 1, SHIFT_BLOCK)
    g = gemm_dtype(q.dtype)
    qq = quantize_queries(q)
    kq = quantize_keys(k, qq.qbar)
    group = q.shape[1] // k.shape[1]
    dp = qq.codes.shape[-1]
    q64 = q.to(g).to(_F64)
    k64 = k.to(g).to(_F64).repeat_interleave(group, dim=1)
    v64 = v.to(g).to(_F64).repeat_interleave(group, dim=1)
    p = torch.softmax(scale * (q64 @ k64.transpose(-1, -2)), dim=-1)
    o = p @ v64
    # the rotated operands the codes round: y (queries), w (keys), as quantize_queries/_keys form them
    y = fwht(_pad(q.to(g).to(_F32) - qq.qbar, dp)).to(_F64)
    y[..., 0] = 0.0
    kc = k.to(g).to(_F32) - kq.centres.repeat_interleave(SHIFT_BLOCK, dim=-2)[:, :, :k.shape[2]]
    w = fwht(_pad(kc, dp)).to(_F64).repeat_interleave(group, dim=1)
    w[..., 0] = 0.0
    s_q = qq.scale.to(_F64)
    s_k2 = kq.scale.to(_F64).repeat_interleave(group, dim=1).pow(2)
    if fallback:  # a 16-bit block's keys: no codes, no codes' error
        coded = ~fallback_blocks(qq, kq, scale).repeat_interleave(SHIFT_BLOCK, dim=-1)[..., :k.shape[2]]
        w, s_k2 = w * coded[..., None], s_k2 * coded
    s_k2 = s_k2[:, :, None, :]  # (B, H, 1, Nk)
    # ||sum_j p_ij w_j (v_j - o_i)^T||_F^2 = ||P_i W^T V - (P_i W)^T o_i||^2 per row
    wv = (w[..., :, None] * v64[..., None, :]).flatten(-2)  # (B, H, Nk, Dp D)
    m = (p @ wv).unflatten(-1, (dp, v64.shape[-1])) - (p @ w)[..., :, None] * o[..., None, :]
    dv2 = ((v64 * v64).sum(-1)[:, :, None, :] - 2.0 * o @ v64.transpose(-1, -2)
           + (o * o).sum(-1, keepdim=True)).clamp_(min=0.0)  # |v_j - o_i|^2, (B, H, Nq, Nk)
    p2 = p * p
    var = (scale / dp) ** 2 * (s_q.pow(2) / 12.0 * m.pow(2).sum((-1, -2))
                              + y.pow(2).sum(-1) * (p2 * s_k2 / 12.0 * dv2).sum(-1))
    if pv_bits == 8:
        var = var + E4M3_REL_RMS ** 2 * ((p2 * dv2).sum(-1) + (p2 @ (v64 * v64).sum(-1, keepdim=True))[..., 0])
    peak = var.max().item()
    unit = var / peak if peak > 0 else var  # (sum E)^2 / sum E^2 without underflow
    rows = unit.sum().item() ** 2 / unit.pow(2).sum().item() if peak > 0 else float(var.numel())
    return ErrorModel(math.sqrt(max(var.mean().item(), 0.0) / max(o.pow(2).sum(-1).mean().item(), 1e-300)), rows)


BOUND_CODES_FACTOR = 1.15
""":func:`stated_bound`'s factor on the codes' (and e4m3's) predicted error: to first order the relative error is
at most ``eta`` (``sqrt(2) eps`` for e4m3's), times ``sqrt(rho)`` with ``rho <= 1 + sum_j p_ij^2``; the factor
covers what that leaves out (measured, docs/NUMERICS.md: up to 1.03 on the codes' error, from the weights'
correlation with the rows' norms; up to 1.08 on e4m3's, whose significands are not uniform)."""
BOUND_16_FACTOR = 2.0
""":func:`stated_bound`'s factor on the 16-bit default's error (the 16-bit roundings: FlashAttention's rule, as
``tests/test_int8.py`` holds them)."""
FP8_REL_RMS = math.sqrt(2.0) * E4M3_REL_RMS
"""e4m3's rounding of ``P`` and of V, each ``E4M3_REL_RMS`` relative, at most this together for V with
independent zero-mean rows (3.6e-2)."""


def logit_error(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``eta`` (B, Hq, blocks) fp64: the predicted RMS logit error (natural units) of each (batch, query head, key
    block) from the codes' rounding, ``(scale / Dp) sqrt((SQ2 W2_b + SK2_b Y2) / 12)`` (step 4b: the statistic
    the criterion compares with ``tau``)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qq = quantize_queries(q)
    kq = quantize_keys(k, qq.qbar)
    return scale / kq.codes.shape[-1] * (fallback_noise(qq, kq) / 12.0).sqrt()


def coded_logit_error(q: torch.Tensor, k: torch.Tensor, tau: float = INT8_FALLBACK_TAU) -> tuple[float, float]:
    """``(eta, share)``: the largest :func:`logit_error` among the blocks the criterion at ``tau`` leaves in 8 bits
    (0 where it leaves none), and the share of blocks it computes in 16 bits.  (``eta > tau`` flags a block up
    to the fp32 rounding of ``tau`` and the scale: :func:`fallback_blocks` decides.)"""
    qq = quantize_queries(q)
    flags = fallback_blocks(qq, quantize_keys(k, qq.qbar), q.shape[-1] ** -0.5, tau)
    coded = logit_error(q, k)[~flags]
    return (coded.max().item() if coded.numel() else 0.0), flags.double().mean().item()


def stated_bound(eta: float, e16: float, pv_bits: int, rows: int | None = None) -> float:
    """The bound this module's docstring states for its relative RMSE against the exact output, V with
    independent zero-mean rows (docs/NUMERICS.md, "The bound as a function of the input"):

        pv_bits 16:  sqrt(C^2 eta^2 s + K16^2 e16^2)
        pv_bits 8:   sqrt(C^2 (eta^2 + 2 eps^2) s + K16^2 e16^2),   eps = E4M3_REL_RMS

    ``eta`` from :func:`coded_logit_error` (<= tau), ``e16`` the 16-bit default's error on the same input,
    ``C`` = :data:`BOUND_CODES_FACTOR`, ``K16`` = :data:`BOUND_16_FACTOR`; ``s = 1 + 3 sqrt(2 / rows)`` the
    scatter of a realised error over ``rows`` query rows (three standard deviations of a chi-square of one degree
    per row), 1 with ``rows`` None (the expectation)."""
    codes = eta * eta + (FP8_REL_RMS * FP8_REL_RMS if pv_bits == 8 else 0.0)
    scatter = 1.0 if rows is None else 1.0 + 3.0 * math.sqrt(2.0 / rows)
    return math.sqrt(BOUND_CODES_FACTOR * BOUND_CODES_FACTOR * codes * scatter
                     + BOUND_16_FACTOR * BOUND_16_FACTOR * e16 * e16)
