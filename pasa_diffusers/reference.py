"""Exact PyTorch versions of every attention variant: the spec the kernels are tested against.

All functions take ``(B, H, N, D)`` tensors, allow ``Nq != Nk`` and any ``N >= 1``, and grouped
query attention (``Hq`` a multiple of ``Hk``: query head ``h`` reads key/value head ``h // (Hq/Hk)``).

Rounding model.  A "GEMM dtype" ``g`` holds what a tensor core reads: bf16 for bf16 inputs, fp16
otherwise.  A GEMM multiplies ``g`` operands exactly and accumulates in fp32 (as tensor cores do),
then rounds its result to the stage's dtype.  Every elementwise step of a variant is computed in
fp32 and rounded to the dtype of the state it produces, so a ``"half"`` pipeline rounds to fp16
after every operation, exactly as a kernel holding fp16 registers would (and overflows to inf above
65504 as such a kernel does).  The softmax weights ``p`` are rounded once to the dtype ``P V`` reads,
and ``l`` sums those same rounded weights, as the kernels do.  Query rows are independent, so ``block_m`` only bounds memory; the
key blocking (``block_n``) is what changes the result.

Log-sum-exp.  ``return_lse=True`` also returns ``lse`` (B, Hq, Nq), the natural-log log-sum-exp per
query row of the true logits ``scale q . k`` (what ring attention merges partial outputs by:
``out = sum_i exp(lse_i - lse) out_i``).  It comes from the running state where the kernels form it,
``lse = m + log(l)`` in fp32 (float64 in ``"fp64"``), plus the part of the true logits the variant's
state does not hold: nothing for plain FlashAttention and the exact shift (their ``m`` tracks the true
logits, the exact shift's with ``r_j`` added back), and for PASA the last block's offset between true
and recovered logits (:func:`pasa_reference`).  Its error is the variant's error in ``m`` and ``l``:
the rounded ``p`` that ``l`` sums, the score rounding and, for PASA, the recovery's.
"""
from __future__ import annotations

import math

import torch

from . import rules
from .block_sparse import BlockSparseMask
from .shift_matrix import DEFAULT_BETA, shift_entries
from .shift_matrix import gamma as recovery_gamma
from .reference_int8 import int8_reference
from .rules import gemm_dtype
from .variants import Variant, eight_bit, pv_bits

__all__ = [
    "attention",
    "golden_attention",
    "flash_reference",
    "pasa_reference",
    "smooth_k_reference",
    "exact_shift_reference",
    "exact_centre",
    "gemm_dtype",
    "DEFAULT_BETA",
]


_FLASH_PRECISIONS = ("hybrid", "half")
_PASA_PRECISIONS = ("half", "hybrid", "fp64")
_EXACT_PRECISIONS = ("hybrid", "half")


def validate_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fn: str) -> None:
    """Check ranks, shapes, GQA grouping, device and dtype of ``(B, H, N, D)`` inputs (``rules.check_qkv``
    for the unrounded precision: any float dtype, any head dim)."""
    rules.check_qkv(fn, q, k, v, "fp64")


def _check_block(name: str, value: int, fn: str) -> None:
    if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"{fn}: {name} must be a positive int, got {name}={value!r}")


def _check_precision(precision: str, allowed: tuple[str, ...], fn: str) -> None:
    if precision not in allowed:
        raise ValueError(f"{fn}: unknown precision={precision!r}; expected one of {allowed}")


def _default_scale(q: torch.Tensor, scale: float | None, fn: str) -> float:
    rules.check_options(fn, precision="fp64", shift="none", scale=scale)
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _check_call(fn: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, precision: str,
                allowed: tuple[str, ...], block_m: int, block_n: int) -> float:
    """The arguments every blocked reference checks; returns the softmax scale (default ``1/sqrt(D)``)."""
    validate_qkv(q, k, v, fn)
    _check_precision(precision, allowed, fn)
    _check_block("block_m", block_m, fn)
    _check_block("block_n", block_n, fn)
    if precision == "half" and gemm_dtype(q.dtype) != torch.float16:
        wider = next(p for p in allowed if p != "half")
        raise ValueError(f"{fn}: precision='half' needs fp16 GEMMs; q.dtype={q.dtype} (use precision={wider!r})")
    return _default_scale(q, scale, fn)


def _expand_kv(t: torch.Tensor, hq: int) -> torch.Tensor:
    return t.repeat_interleave(hq // t.shape[1], dim=1)


def _gemm(a: torch.Tensor, b: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    """``a @ b`` with exact products, wide accumulation, one rounding to ``out``."""
    wide = torch.float64 if out == torch.float64 else torch.float32
    return (a.to(wide) @ b.to(wide)).to(out)


def _rowsum(x: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    wide = torch.float64 if out == torch.float64 else torch.float32
    return x.to(wide).sum(-1, keepdim=True).to(out)


def _lse_rows(m_i: torch.Tensor, l_i: torch.Tensor, wide: torch.dtype = torch.float32,
              offset: torch.Tensor | None = None) -> torch.Tensor:
    """``m + log(l) (+ offset)`` of a row chunk's final state (..., rows, 1), in ``wide``: (..., rows)."""
    lse = m_i.to(wide) + torch.log(l_i.to(wide))
    if offset is not None:
        lse = lse + offset
    return lse.squeeze(-1)


def _lse_buffer(q: torch.Tensor, wide: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(q.shape[:3], dtype=wide, device=q.device)


def _kept(block_mask: BlockSparseMask | None, q: torch.Tensor, k: torch.Tensor, fn: str,
          block_n: int) -> torch.Tensor | None:
    """The mask's kept blocks (B, Hq, nq, nk) bool after checking it fits the call; None without a mask."""
    if block_mask is None:
        return None
    if not isinstance(block_mask, BlockSparseMask):
        raise ValueError(f"{fn}: block_mask must be a BlockSparseMask or None, got {type(block_mask).__name__}")
    block_mask.check_call(q, k, fn, block_n=block_n)
    return block_mask.kept_blocks(q.shape[0], q.shape[1])


def _taken(kept: torch.Tensor | None, qi: int, kj: int) -> torch.Tensor | None:
    """(B, Hq, 1, 1) bool: which (batch, head)s visit key block ``kj`` from query block ``qi``; None: all."""
    return None if kept is None else kept[:, :, qi, kj, None, None]


def _keep(taken: torch.Tensor | None, new: tuple, old: tuple) -> tuple:
    """The state after a key block: ``new`` where the block was visited, ``old`` (untouched) elsewhere."""
    if taken is None:
        return new
    return tuple(torch.where(taken, n, o) for n, o in zip(new, old))


def _empty(kept: torch.Tensor | None, qi: int) -> torch.Tensor | None:
    """(B, Hq, 1, 1) bool: the (batch, head)s whose query block ``qi`` visits no key block; None: no mask."""
    return None if kept is None else ~kept[:, :, qi].any(-1)[:, :, None, None]


def _zero_empty(out: torch.Tensor, lse: torch.Tensor | None, empty: torch.Tensor | None) -> tuple:
    """An empty row's defined result: output zeros, log-sum-exp ``-inf`` (``out`` (..., rows, D), ``lse``
    (..., rows))."""
    if empty is None:
        return out, lse
    out = torch.where(empty, torch.zeros_like(out), out)
    if lse is not None:
        lse = torch.where(empty[..., 0], torch.full_like(lse, -math.inf), lse)
    return out, lse


def golden_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
                     return_lse: bool = False, block_mask: BlockSparseMask | None = None
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention ``softmax(scale q k^T) v`` in float64 (returns float64); with
    ``return_lse`` also ``logsumexp(scale q k^T)`` per row, (B, Hq, Nq) float64.  ``block_mask``
    (:class:`~pasa_diffusers.block_sparse.BlockSparseMask`): the skipped keys' logits are ``-inf``; a row that
    keeps no key gives zeros and ``lse = -inf``."""
    validate_qkv(q, k, v, "golden_attention")
    scale = _default_scale(q, scale, "golden_attention")
    q64, k64, v64 = q.double(), _expand_kv(k.double(), q.shape[1]), _expand_kv(v.double(), q.shape[1])
    logits = scale * (q64 @ k64.transpose(-1, -2))
    if block_mask is None:
        out = torch.softmax(logits, dim=-1) @ v64
        return (out, torch.logsumexp(logits, dim=-1)) if return_lse else out
    block_mask.check_call(q, k, "golden_attention")
    keep = block_mask.element_mask()
    if keep.shape[1] not in (1, q.shape[1]):
        keep = keep.repeat_interleave(q.shape[1] // keep.shape[1], dim=1)
    logits = logits.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.softmax(logits, dim=-1).nan_to_num(nan=0.0) @ v64
    return (out, lse) if return_lse else out


def _row_chunks(n: int, block_m: int):
    for start in range(0, n, block_m):
        yield slice(start, min(start + block_m, n))


def _key_blocks(n: int, block_n: int):
    for start in range(0, n, block_n):
        yield start, min(start + block_n, n)


def flash_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
                    block_m: int = 128, block_n: int = rules.SHIFT_BLOCK, precision: str = "hybrid",
                    return_lse: bool = False, block_mask: BlockSparseMask | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax FlashAttention over key blocks of ``block_n``.

    ``"hybrid"``: scores ``fp32(q k^T) * scale``, softmax state and accumulator in fp32, ``P`` rounded to
    the GEMM dtype for ``P V`` (as FlashAttention-2 and cuDNN do) and ``l`` summing those rounded
    values (as the kernel does: see ``kernels/portable.py``, ``_merge``).
    ``"half"``: raw scores ``fp16(q k^T)`` (inf above 65504), then every stage in fp16: the naive
    fully-FP16 kernel, which returns NaN once a score overflows.
    Output in ``q.dtype``.  ``return_lse``: also ``lse = m + log(l)`` (B, Hq, Nq) fp32 from the final
    state (``m`` the running maximum of the logits, fp16 in ``"half"``: inf where a score overflowed).
    ``block_mask`` (:class:`~pasa_diffusers.block_sparse.BlockSparseMask`, its ``block_k`` equal to ``block_n``;
    the query blocks then are its ``block_q`` rows): each (batch, head, query block) visits only its kept key
    blocks, in ascending order, on one running state; a query block that visits none gives zeros and
    ``lse = -inf``.  None (or every block kept): the dense loop, bit for bit.
    """
    fn = "flash_reference"
    scale = _check_call(fn, q, k, v, scale, precision, _FLASH_PRECISIONS, block_m, block_n)
    kept = _kept(block_mask, q, k, fn, block_n)
    block_m = block_m if kept is None else block_mask.block_q
    g = gemm_dtype(q.dtype)
    st = torch.float32 if precision == "hybrid" else torch.float16
    qg = q.to(g)
    kg, vg = _expand_kv(k.to(g), q.shape[1]), _expand_kv(v.to(g), q.shape[1])
    out = torch.empty(q.shape[:3] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    lse = _lse_buffer(q) if return_lse else None
    for qi, rows in enumerate(_row_chunks(q.shape[2], block_m)):
        q_blk = qg[:, :, rows]
        m_i = torch.full(q_blk.shape[:3] + (1,), -math.inf, dtype=st, device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros(q_blk.shape[:3] + (v.shape[-1],), dtype=st, device=q.device)
        for kj, (start, stop) in enumerate(_key_blocks(k.shape[2], block_n)):
            taken = _taken(kept, qi, kj)
            if taken is not None and not taken.any():
                continue
            s = _gemm(q_blk, kg[:, :, start:stop].transpose(-1, -2), st) * torch.tensor(scale, dtype=st)
            m_new = torch.maximum(m_i, s.amax(-1, keepdim=True))
            p = torch.exp(s - m_new).to(g)
            alpha = torch.exp(m_i - m_new)
            m_i, l_i, acc = _keep(taken, (m_new, alpha * l_i + _rowsum(p, st),
                                          alpha * acc + _gemm(p, vg[:, :, start:stop], st)), (m_i, l_i, acc))
        out[:, :, rows], lse_blk = _zero_empty((acc.float() / l_i.float()).to(q.dtype),
                                               _lse_rows(m_i, l_i) if return_lse else None, _empty(kept, qi))
        if return_lse:
            lse[:, :, rows] = lse_blk
    return (out, lse) if return_lse else out


def pasa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
                   beta: float | None = None, block_m: int = 128, block_n: int = rules.SHIFT_BLOCK,
                   precision: str = "half", return_lse: bool = False, block_mask: BlockSparseMask | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """PASA (Online Pseudo-Average Shifting Attention), step by step as the paper's algorithm.

    Per key block ``j`` of ``n_j`` keys (the last, ragged block uses only its ``n_j`` valid keys and its
    own ``M``; the authors' script repeats rows instead):

    1. ``k_shift = fp(scale M_j) k_j`` with ``M_j = I - (beta/n_j) 11^T``, i.e. ``a k_j - c colsum(k_j)``
       from the stored entries (``shift_matrix.shift_entries``), rounded to the GEMM dtype;
    2. ``s = q k_shift^T`` (rounded to the state's dtype: fp16 in half, fp32 in hybrid),
       ``mu_j = rowmean(s)``; the removed
       pseudo-average is ``gamma_j mu_j`` with ``gamma_j`` computed from the stored entries
       (``shift_matrix.gamma``); the tail's mean is rescaled, ``mu_hat_j = (gamma_j / gamma) mu_j``, so all
       blocks share the full block's ``gamma``;
    3. running pseudo-average ``avg_j = avg_{j-1} + (mu_hat_j - avg_{j-1}) / j``;
    4. global recovering: ``delta_j = gamma (mu_hat_j - avg_j)`` puts the block on the reference
       ``gamma avg_j``, ``eps_j = gamma (avg_{j-1} - avg_j)`` moves the old state there;
    5. FlashAttention's merge on the logits ``s + delta_j`` with the old ``m`` shifted by ``eps_j``
       (``p`` rounded to the GEMM dtype once; ``l`` sums it and ``P V`` multiplies it, as the kernel);
    6. ``out = acc / l``.

    The reference cancels in ``acc / l``: the result is ``softmax(scale q k^T) v`` exactly in real
    arithmetic for any beta in (0, 1).  Precisions: ``"half"`` (entries, scores and every state in
    fp16), ``"hybrid"`` (entries and shifted keys in the GEMM dtype, fp32 scores, state and
    accumulator; the paper rounds the scores to fp16 here too, which overflows where one key lies
    far from its block's mean), ``"fp64"`` (no rounding
    anywhere; returns float64).  ``beta=None`` uses ``DEFAULT_BETA``.

    ``return_lse``: also the log-sum-exp of the true logits, (B, Hq, Nq) fp32 (float64 in ``"fp64"``).
    Block ``j``'s true logits are ``s + gamma_j mu_j`` (the removed pseudo-average, ``mu_j`` the exact
    row mean of ``s``), its softmax logits ``s + delta_j``: they differ by the per-row offset
    ``o_j = gamma_j mu_j - delta_j`` (``gamma avg_j`` in real arithmetic), and ``eps_j = o_{j-1} - o_j``
    moves the state from one block's offset to the next.  After the last block ``J`` the state holds
    the logits relative to ``o_J``, so ``lse = m + log(l) + o_J``, with ``o_J`` formed in fp32 from the
    unrounded mean (``mu_J`` before its rounding to the state's dtype; ``delta_J`` as the merge used
    it): exact for block ``J``'s own logits, and the earlier blocks carry the recovery's rounding
    exactly as the output does.

    ``block_mask`` (:class:`~pasa_diffusers.block_sparse.BlockSparseMask`, its ``block_k`` equal to ``block_n``;
    the query blocks then are its ``block_q`` rows): each (batch, head, query block) visits only its kept key
    blocks, in ascending order, on one running state; a query block that visits none gives zeros and
    ``lse = -inf``.  None (or every block kept): the dense loop, bit for bit.
    Under a mask ``j`` counts the *visited* blocks of the (batch, head, query block): step 3's average runs over
    the kept blocks only (the kernels' shift count is the visit count, not ``start // block_n + 1``).
    """
    fn = "pasa_reference"
    scale = _check_call(fn, q, k, v, scale, precision, _PASA_PRECISIONS, block_m, block_n)
    kept = _kept(block_mask, q, k, fn, block_n)
    block_m = block_m if kept is None else block_mask.block_q
    beta = DEFAULT_BETA if beta is None else beta
    rules.check_options(fn, precision=precision, shift="pasa", beta=beta)
    if precision == "fp64":
        g = st = torch.float64
    else:
        g = gemm_dtype(q.dtype)
        st = torch.float16 if precision == "half" else torch.float32
    wide = torch.float64 if g == torch.float64 else torch.float32
    n_full = min(block_n, k.shape[2])
    gam_full = recovery_gamma(beta, n_full, g, scale)
    gam = torch.tensor(gam_full, dtype=st)

    qg = q.to(g)
    kg, vg = _expand_kv(k.to(g), q.shape[1]), _expand_kv(v.to(g), q.shape[1])
    out_dtype = torch.float64 if precision == "fp64" else q.dtype
    out = torch.empty(q.shape[:3] + (v.shape[-1],), dtype=out_dtype, device=q.device)
    lse = _lse_buffer(q, wide) if return_lse else None
    for qi, rows in enumerate(_row_chunks(q.shape[2], block_m)):
        q_blk = qg[:, :, rows]
        m_i = torch.full(q_blk.shape[:3] + (1,), -math.inf, dtype=st, device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros(q_blk.shape[:3] + (v.shape[-1],), dtype=st, device=q.device)
        avg_j = offset = None
        if kept is not None:  # per (batch, head): the pseudo-average, the lse offset and the visit count
            avg_j, offset = torch.zeros_like(m_i), torch.zeros_like(m_i, dtype=wide)
            visits = torch.zeros(q_blk.shape[:2] + (1, 1), dtype=torch.int64, device=q.device)
        for j, (start, stop) in enumerate(_key_blocks(k.shape[2], block_n), start=1):
            taken = _taken(kept, qi, j - 1)
            if taken is not None and not taken.any():
                continue
            n_j = stop - start
            diag, off = shift_entries(beta, n_j, g, scale)
            a, c = diag - off, -off
            k_blk = kg[:, :, start:stop].to(wide)
            k_shift = (a * k_blk - c * k_blk.sum(-2, keepdim=True)).to(g)
            s = _gemm(q_blk, k_shift.transpose(-1, -2), st)
            mu_wide = _rowsum(s, wide) / n_j
            mu_j = mu_wide.to(st)
            tail_ratio = recovery_gamma(beta, n_j, g, scale) / gam_full
            mu_hat = mu_j * torch.tensor(tail_ratio, dtype=st)
            if taken is None:
                if avg_j is None:
                    avg_prev = avg_new = mu_hat
                else:
                    avg_prev, avg_new = avg_j, avg_j + (mu_hat - avg_j) / torch.tensor(j, dtype=st)
            else:  # j = the visits so far, this one included
                visits = visits + taken
                first = visits == 1
                avg_prev = torch.where(first, mu_hat, avg_j)
                avg_new = torch.where(first, mu_hat, avg_j + (mu_hat - avg_j) / visits.to(st))
            delta = gam * (mu_hat - avg_new)
            eps = gam * (avg_prev - avg_new)
            offset_new = offset
            if return_lse:  # o_j = gamma_j mu_j - delta_j, the last block's kept
                removed = torch.tensor(gam_full, dtype=wide) * (mu_wide * torch.tensor(tail_ratio, dtype=wide))
                offset_new = removed - delta.to(wide)
            logits = s + delta
            m_prev = m_i + eps
            m_new = torch.maximum(m_prev, logits.amax(-1, keepdim=True))
            p = torch.exp(logits - m_new).to(g)
            alpha = torch.exp(m_prev - m_new)
            l_new = alpha * l_i + _rowsum(p, st)
            acc_new = alpha * acc + _gemm(p, vg[:, :, start:stop], st)
            if return_lse:
                m_i, l_i, acc, avg_j, offset = _keep(taken, (m_new, l_new, acc_new, avg_new, offset_new),
                                                     (m_i, l_i, acc, avg_j, offset))
            else:
                m_i, l_i, acc, avg_j = _keep(taken, (m_new, l_new, acc_new, avg_new), (m_i, l_i, acc, avg_j))
        out[:, :, rows], lse_blk = _zero_empty((acc.to(wide) / l_i.to(wide)).to(out_dtype),
                                               _lse_rows(m_i, l_i, wide, offset) if return_lse else None,
                                               _empty(kept, qi))
        if return_lse:
            lse[:, :, rows] = lse_blk
    return (out, lse) if return_lse else out


def smooth_k_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
                       block_m: int = 128, block_n: int = rules.SHIFT_BLOCK, precision: str = "half",
                       block_mask: BlockSparseMask | None = None) -> torch.Tensor:
    """SageAttention's smooth-K, then :func:`flash_reference`.

    ``k - mean_tokens(k)`` (per batch, head and channel; computed in fp32 and rounded back to the
    input's GEMM dtype) changes every score of a row by the same ``q . k_mean``, so softmax is unchanged
    in exact arithmetic while the sequence bias of K is gone (also within any set of kept key blocks:
    ``block_mask`` goes to :func:`flash_reference`; the mean is over all keys).
    """
    validate_qkv(q, k, v, "smooth_k_reference")
    k_wide = k.to(torch.float64 if k.dtype == torch.float64 else torch.float32)
    k_smooth = (k_wide - k_wide.mean(dim=-2, keepdim=True)).to(k.dtype)
    return flash_reference(q, k_smooth, v, scale, block_m=block_m, block_n=block_n, precision=precision,
                           block_mask=block_mask)


def _binade(x: torch.Tensor) -> torch.Tensor:
    """``2^e`` with ``2^e <= |x| < 2^(e+1)`` (fp32 ``x``)."""
    return torch.ldexp(torch.ones_like(x), torch.frexp(x).exponent - 1)


def exact_centre(k_blk: torch.Tensor, g: torch.dtype) -> torch.Tensor:
    """Per channel, the centre closest to the block mean that every key of the block minus it is exact in ``g``.

    ``k_blk`` (..., n, D) holds ``g`` values (in fp32 or wider); returns (..., 1, D) fp32 ``g`` values.
    In a channel whose keys are all positive, with smallest ``a`` (``2^e <= a < 2^(e+1)``) and largest
    ``b``, every ``g`` value ``c`` in ``[b / 2, a + 2^(e+1)]`` makes ``k - c`` exact for every key ``k``
    (``docs/NUMERICS.md``, "Exact centre": a key above ``c`` is below ``2c``, so ``k - c < c`` lies on
    ``c``'s grid; a key below ``c`` is at most ``2^(e+1)`` away from it, on its own grid); negative
    channels are the mirror image.  The centre is the block mean clamped into that interval and rounded
    to ``g`` (one ulp down where rounding crossed the upper end; ``b / 2`` is itself a ``g`` value).
    Where the interval is empty (``b / 2 > a + 2^(e+1)``: keys spread over more than a factor of about
    4) the channel is left uncentred (``c = 0``), as are channels whose keys change sign (their mean is
    no larger than their spread).  Inside the interval no key needs checking (the tests check that
    ``k - c`` is exact on random and adversarial blocks).
    """
    k32 = k_blk.float()
    lo_key, hi_key = k32.amin(dim=-2, keepdim=True), k32.amax(dim=-2, keepdim=True)
    positive, negative = lo_key > 0, hi_key < 0
    sign = torch.where(negative, -1.0, 1.0)
    nearest = torch.where(positive, lo_key, -hi_key)  # smallest magnitude
    farthest = torch.where(positive, hi_key, -lo_key)
    upper = nearest + 2 * _binade(nearest)
    c_mag = torch.minimum(torch.maximum(sign * k32.mean(dim=-2, keepdim=True), farthest / 2), upper).to(g)
    c_mag = c_mag.float()
    below = c_mag - _binade(c_mag) * torch.finfo(g).eps  # c_mag minus its ulp in g: a g value
    c = sign * torch.where(c_mag > upper, below, c_mag)
    return torch.where((positive | negative) & (farthest / 2 <= upper), c, torch.zeros_like(c))


def exact_shift_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
                          block_m: int = 128, block_n: int = rules.SHIFT_BLOCK, precision: str = "hybrid",
                          return_lse: bool = False, block_mask: BlockSparseMask | None = None
                          ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The exact shift: each key block's mean is removed exactly and its logit carried in fp32.

    Per key block ``j`` of ``n_j`` valid keys (the ragged last block uses its ``n_j``):

    1. ``kbar_j`` = per-channel mean of the block's keys, in fp32, rounded to the GEMM dtype ``g``;
    2. the centre ``c_j`` actually removed: in ``"hybrid"`` :func:`exact_centre` (per channel, ``kbar_j``
       moved into the interval where ``k - c`` is exact in ``g`` for every key of the block; ``0`` in
       channels whose keys change sign: no rounding at all).  In ``"half"`` ``c_j = kbar_j`` always (the
       fp16 score tile needs the bias gone; ``k - c`` then rounds at 2^-11 relative of the centred value);
    3. ``k_c = round_g(k_j - c_j)`` (fp32 difference, one rounding);
    4. ``r_j = scale (q . c_j)`` per query row in fp32 (exact products of ``g`` values, fp32 sum): the
       removed part of the logits, carried exactly instead of being recovered through PASA's gamma;
    5. scores of the centred keys: ``"hybrid"`` ``s = scale fp32(q k_c^T)``; ``"half"``
       ``s = fp16(q_s k_c^T)`` with ``q_s = round_fp16(scale q)`` (the fp16 tile holds only the
       centred part, so it cannot overflow for any bias of K);
    6. logits ``s + r_j`` in fp32 and FlashAttention's online softmax: ``m``, ``l`` in fp32,
       ``p = exp(logits - m_new)`` in fp32, rounded to ``g`` in ``"hybrid"`` and to fp16 in ``"half"``
       (``l`` sums the rounded ``p`` that multiplies V, as the kernel), ``acc`` in fp32 (``"hybrid"``) or fp16 (``"half"``: ``alpha acc`` rounded to fp16,
       then ``P V`` accumulated onto it in fp32 and rounded once to fp16), ``out = acc / l``.

    ``s + r_j = scale q k_j^T`` in real arithmetic, so the result is exact softmax attention; the
    rounding enters only at ``kbar_j`` (harmless: any ``c_j`` is exact in ``r_j``), ``k_c`` (none in
    hybrid), the score GEMM (fp32 in hybrid, fp16 in half), ``r_j``'s fp32 sum, ``p`` and the
    accumulator.  Output in ``q.dtype``.

    ``return_lse``: also ``lse = m + log(l)`` (B, Hq, Nq) fp32.  ``m`` is the running maximum of the
    logits ``s + r_j``, i.e. of the true logits with the removed ``r_j`` already added back, so no
    offset remains (its rounding: ``r_j``'s fp32 sum, ``s``'s, and ``p`` rounded before ``l`` sums it).

    ``block_mask`` (:class:`~pasa_diffusers.block_sparse.BlockSparseMask`, its ``block_k`` equal to ``block_n``;
    the query blocks then are its ``block_q`` rows): each (batch, head, query block) visits only its kept key
    blocks, in ascending order, on one running state; a query block that visits none gives zeros and
    ``lse = -inf``.  None (or every block kept): the dense loop, bit for bit.
    """
    fn = "exact_shift_reference"
    scale = _check_call(fn, q, k, v, scale, precision, _EXACT_PRECISIONS, block_m, block_n)
    kept = _kept(block_mask, q, k, fn, block_n)
    block_m = block_m if kept is None else block_mask.block_q
    g = gemm_dtype(q.dtype)
    half = precision == "half"
    f32 = torch.float32
    qg = q.to(g)
    q_s = (qg.to(f32) * scale).to(torch.float16) if half else None
    kg, vg = _expand_kv(k.to(g), q.shape[1]), _expand_kv(v.to(g), q.shape[1])
    out = torch.empty(q.shape[:3] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    lse = _lse_buffer(q) if return_lse else None
    for qi, rows in enumerate(_row_chunks(q.shape[2], block_m)):
        q_blk = qg[:, :, rows]
        m_i = torch.full(q_blk.shape[:3] + (1,), -math.inf, dtype=f32, device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros(q_blk.shape[:3] + (v.shape[-1],), dtype=torch.float16 if half else f32, device=q.device)
        for kj, (start, stop) in enumerate(_key_blocks(k.shape[2], block_n)):
            taken = _taken(kept, qi, kj)
            if taken is not None and not taken.any():
                continue
            k32 = kg[:, :, start:stop].to(f32)
            kbar = k32.mean(dim=-2, keepdim=True).to(g).to(f32)
            c = kbar if half else exact_centre(k32, g)
            k_c = (k32 - c).to(g)
            r = scale * (q_blk.to(f32) @ c.transpose(-1, -2))  # (.., rows, 1), fp32
            if half:
                s = _gemm(q_s[:, :, rows], k_c.transpose(-1, -2), torch.float16).to(f32)
            else:
                s = _gemm(q_blk, k_c.transpose(-1, -2), f32) * scale
            logits = s + r
            m_new = torch.maximum(m_i, logits.amax(-1, keepdim=True))
            p = torch.exp(logits - m_new)
            alpha = torch.exp(m_i - m_new)
            if half:
                p = p.to(torch.float16)
                l_new = alpha * l_i + _rowsum(p, f32)
                acc_new = (acc.to(f32) * alpha.to(torch.float16).to(f32)).to(torch.float16)
                acc_new = (acc_new.to(f32) + p.to(f32) @ vg[:, :, start:stop].to(f32)).to(torch.float16)
            else:
                p = p.to(g)
                l_new = alpha * l_i + _rowsum(p, f32)
                acc_new = alpha * acc + _gemm(p, vg[:, :, start:stop], f32)
            m_i, l_i, acc = _keep(taken, (m_new, l_new, acc_new), (m_i, l_i, acc))
        out[:, :, rows], lse_blk = _zero_empty((acc.to(f32) / l_i).to(q.dtype),
                                               _lse_rows(m_i, l_i) if return_lse else None, _empty(kept, qi))
        if return_lse:
            lse[:, :, rows] = lse_blk
    return (out, lse) if return_lse else out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, variant: Variant,
              beta: float | None, *, return_lse: bool = False, block_mask: BlockSparseMask | None = None
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The reference of ``variant``: what the op computes for CPU tensors (``fp64``: the unrounded math,
    float64 out; the exact shift in ``fp64`` is the golden attention, exact in real arithmetic).
    ``scale=None``: ``1/sqrt(D)``; ``beta=None``: ``DEFAULT_BETA`` (read by PASA only).  ``return_lse``:
    ``(out, lse)``, ``lse`` (B, Hq, Nq) the log-sum-exp of the true logits per row, fp32 (float64 in
    ``fp64``).  ``block_mask``: the block-sparse mask every variant honours (:func:`flash_reference`)."""
    bm = {"return_lse": return_lse, "block_mask": block_mask}
    if variant.precision == "fp64":
        if variant.shift == "pasa":
            return pasa_reference(q, k, v, scale, beta=beta, precision="fp64", **bm)
        return golden_attention(q, k, v, scale, **bm)
    if eight_bit(variant.precision):
        return int8_reference(q, k, v, scale, pv_bits=pv_bits(variant.precision), tally=True, **bm)
    if variant.shift == "exact":
        return exact_shift_reference(q, k, v, scale, precision=variant.precision, **bm)
    if variant.shift == "pasa":
        return pasa_reference(q, k, v, scale, beta=beta, precision=variant.precision, **bm)
    return flash_reference(q, k, v, scale, precision=variant.precision, **bm)
