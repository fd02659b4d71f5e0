"""The public attention op: validation, dispatch and its ``torch.library`` registration.

``pasa_attention`` reads like ``torch.nn.functional.scaled_dot_product_attention``.  It checks its
inputs once (``rules``; what a call signature fixes, its options and the tensors' shapes, strides, dtypes and
devices, once per signature), converts ``shift`` to its name once (``variants.shift_mode``), and then:

- CUDA tensors go to ``kernels.dispatch.forward``, which picks the kernel (``dispatch.plan`` says which
  and why);
- CPU tensors run the kernels themselves when ``TRITON_INTERPRET=1`` is set (Triton's numpy
  interpreter: slow, for tests), and otherwise the exact PyTorch reference of the same variant
  (``reference.attention``), which rounds to the same dtypes at the same points as the kernels (it
  evaluates the exponentials as ``exp`` in fp32 where the kernels take ``exp2`` of an FMA, so the two
  agree to within rounding, not bit for bit);
- ``precision="fp64"`` runs the reference with no rounding at all, on any device (for
  ``shift="exact"`` the float64 golden attention: the exact shift is exact in real arithmetic).

``return_lse=True`` also returns each query row's log-sum-exp of the true logits (what ring attention
merges partial outputs by), from the same call: the kernels store it from their softmax state, the
references return it beside their output.

The op is registered as ``pasa::attention`` (the output) and ``pasa::attention_lse`` (the output and
the LSE), each with a fake (meta) implementation, so ``torch.compile`` and ``torch.export`` trace
either without graph breaks, and a call without ``return_lse`` traces the op it always did; eager
calls (and CUDA graph capture) run the implementation directly.
"""
from __future__ import annotations

import math

import torch

from . import env, reference, rules
from .block_sparse import BlockSparseMask
from .shift_matrix import DEFAULT_BETA
from .variants import DEFAULT_PRECISION, DEFAULT_SHIFT, VARIANTS

__all__ = ["pasa_attention"]


def _interpreting() -> bool:
    """Whether CPU tensors run the kernels (Triton's interpreter), read per call (``env.flag``: Triton's words)."""
    return env.flag("TRITON_INTERPRET")


CHECKED_CACHE_SIZE = 4096
"""The most call signatures whose checks are kept (the set is emptied when full)."""
_CHECKED: set[tuple] = set()


def _signature(q, k, v, scale, precision, shift, beta, layout, return_lse, interpreting: bool) -> tuple | None:
    """What the op's checks of a call read but ``requires_grad`` and the block mask: the options with their types
    (``True == 1`` in a key), and q, k, v's shapes, strides, dtypes and devices; ``None`` where an input is not
    exactly a ``torch.Tensor`` or an option is unhashable, and while ``torch.compile`` traces (symbolic shapes; a
    traced call's checks run once anyway): such calls are checked in full every time."""
    if not (type(q) is type(k) is type(v) is torch.Tensor) or torch.compiler.is_compiling():
        return None
    key = (type(scale), scale, type(precision), precision, type(shift), shift, type(beta), beta, type(layout),
           layout, type(return_lse), return_lse, interpreting, q.shape, k.shape, v.shape, q.stride(), k.stride(),
           v.stride(), q.dtype, k.dtype, v.dtype, q.device, k.device, v.device)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, precision: str,
              shift: bool | str, beta: float | None, layout: str, return_lse: bool,
              block_mask: BlockSparseMask | None, interpreting: bool) -> None:
    """The op's checks (``interpreting``: ``TRITON_INTERPRET``, read once per call).  Those of the options and the
    tensors' shapes, strides, dtypes and devices run once per call signature (:func:`_signature`); the gradient and
    the block mask every call."""
    fn = "pasa_attention"
    signature = _signature(q, k, v, scale, precision, shift, beta, layout, return_lse, interpreting)
    if signature is None or signature not in _CHECKED:
        _check_signature(fn, q, k, v, scale, precision, shift, beta, layout, return_lse, interpreting)
        if signature is not None:
            if len(_CHECKED) >= CHECKED_CACHE_SIZE:
                _CHECKED.clear()
            _CHECKED.add(signature)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise RuntimeError(f"{fn}: the op has no backward (forward-only, for inference); q, k or v requires grad. "
                           "Call it under torch.no_grad() / torch.inference_mode(), or detach the inputs")
    if block_mask is not None:
        if layout == "bnhd":
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        _check_block_mask(fn, block_mask, q, k)


def _check_signature(fn: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                     precision: str, shift: bool | str, beta: float | None, layout: str, return_lse: bool,
                     interpreting: bool) -> None:
    """The checks of :func:`_signature`'s facts: the options (``rules.check_options``), rank 4, and the (B, H, N, D)
    views (``rules.check_qkv``, ``rules.check_kernel_tensors``)."""
    rules.check_options(fn, precision=precision, shift=shift, beta=beta, scale=scale, layout=layout,
                        return_lse=return_lse)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() != 4:
            raise ValueError(f"{fn}: {name} must have rank 4 ({layout.upper()}), got {name}.shape={tuple(t.shape)}")
    if layout == "bnhd":
        q, k, v = (t.transpose(1, 2) if isinstance(t, torch.Tensor) else t for t in (q, k, v))
    rules.check_qkv(fn, q, k, v, precision)
    if precision != "fp64" and (q.device.type != "cpu" or interpreting):
        rules.check_kernel_tensors(fn, q, k, v, interpret=interpreting)


def _check_block_mask(fn: str, block_mask: BlockSparseMask, q: torch.Tensor, k: torch.Tensor) -> None:
    """``block_mask`` against ``q``, ``k`` (B, H, N, D): its type, lengths, device, batch and heads
    (``BlockSparseMask.check_call``), and the blocks the kernels walk (key blocks of ``rules.SHIFT_BLOCK``,
    query blocks a multiple of ``rules.MASK_QUERY_TILE``); one-line ``ValueError``s naming it."""
    if not isinstance(block_mask, BlockSparseMask):
        raise ValueError(f"{fn}: block_mask must be a BlockSparseMask or None, got {type(block_mask).__name__}")
    block_mask.check_call(q, k, fn)
    if block_mask.block_k != rules.SHIFT_BLOCK:
        raise ValueError(f"{fn}: block_mask.block_k={block_mask.block_k} must be {rules.SHIFT_BLOCK}, the kernels' "
                         "key block (the shift block)")
    if block_mask.block_q % rules.MASK_QUERY_TILE:
        raise ValueError(f"{fn}: block_mask.block_q={block_mask.block_q} must be a multiple of "
                         f"{rules.MASK_QUERY_TILE}, the kernels' largest query tile")


def _use_kernel(device: torch.device, precision: str, interpreting: bool) -> bool:
    if precision == "fp64":
        return False
    return device.type == "cuda" or interpreting


def _lse_shape(q: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """``(B, Hq, Nq)`` of ``q`` in ``layout``."""
    return (q.shape[0], q.shape[2], q.shape[1]) if layout == "bnhd" else tuple(q.shape[:3])


def _wide(precision: str) -> torch.dtype:
    """The LSE's dtype: float64 for ``"fp64"``, float32 otherwise."""
    return torch.float64 if precision == "fp64" else torch.float32


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, precision: str, shift: str, beta: float,
         layout: str, return_lse: bool, block_mask: BlockSparseMask | None, interpreting: bool
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The op on checked arguments (``shift`` a name of ``variants.SHIFT_MODES``): the output in ``q``'s
    layout, contiguous, and with ``return_lse`` the (B, Hq, Nq) LSE (else ``None``); ``interpreting``: the caller's
    reading of ``TRITON_INTERPRET`` (:func:`_interpreting`)."""
    variant = VARIANTS[shift, precision]  # checked at the op's entry (_validate): a lookup, not a new check
    out = torch.empty(q.shape, dtype=torch.float64 if precision == "fp64" else q.dtype, device=q.device)
    lse = torch.empty(_lse_shape(q, layout), dtype=_wide(precision), device=q.device) if return_lse else None
    if out.numel() == 0:  # no batch or no queries: nothing to compute, as SDPA
        return out, lse
    if layout == "bnhd":
        q, k, v, out_bhnd = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2)
    else:
        out_bhnd = out
    if _use_kernel(q.device, precision, interpreting):
        from .kernels import dispatch

        dispatch.forward(q, k, v, out_bhnd, scale=scale, variant=variant, beta=beta, lse=lse, block_mask=block_mask)
    elif return_lse:
        result, result_lse = reference.attention(q, k, v, scale, variant, beta, return_lse=True,
                                                 block_mask=block_mask)
        out_bhnd.copy_(result)
        lse.copy_(result_lse)
    else:
        out_bhnd.copy_(reference.attention(q, k, v, scale, variant, beta, block_mask=block_mask))
    return out, lse


def _mask_fields(block_mask: BlockSparseMask | None) -> tuple:
    """``block_mask`` as the registered ops take it: ``(kv_counts, kv_indices, block_q, block_k)``; no mask:
    nothing (the ops' defaults)."""
    if block_mask is None:
        return ()
    return block_mask.kv_counts, block_mask.kv_indices, block_mask.block_q, block_mask.block_k


def _mask_of(q: torch.Tensor, k: torch.Tensor, layout: str, kv_counts: torch.Tensor | None,
             kv_indices: torch.Tensor | None, block_q: int, block_k: int) -> BlockSparseMask | None:
    """The mask of :func:`_mask_fields`, rebuilt for ``q``, ``k`` in ``layout`` (checked at the op's entry:
    not validated again, so no host sync)."""
    if kv_counts is None:
        return None
    axis = 1 if layout == "bnhd" else 2
    return BlockSparseMask.from_checked(kv_counts, kv_indices, q.shape[axis], k.shape[axis], block_q, block_k)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, precision: str, shift: str,
               beta: float, layout: str, kv_counts: torch.Tensor | None = None,
               kv_indices: torch.Tensor | None = None, block_q: int = 0, block_k: int = 0) -> torch.Tensor:
    """The op's output on checked arguments (``_run`` without the LSE; the block mask as its fields)."""
    mask = _mask_of(q, k, layout, kv_counts, kv_indices, block_q, block_k)
    return _run(q, k, v, scale, precision, shift, beta, layout, False, mask, _interpreting())[0]


def _attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, precision: str, shift: str,
                   beta: float, layout: str, kv_counts: torch.Tensor | None = None,
                   kv_indices: torch.Tensor | None = None, block_q: int = 0,
                   block_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's output and LSE on checked arguments (``_run`` with the LSE; the block mask as its fields)."""
    mask = _mask_of(q, k, layout, kv_counts, kv_indices, block_q, block_k)
    return _run(q, k, v, scale, precision, shift, beta, layout, True, mask, _interpreting())


_attention_op = torch.library.custom_op("pasa::attention", _attention, mutates_args=())
"""``_attention`` registered as ``pasa::attention``: what ``torch.compile`` and ``torch.export`` trace."""

_attention_lse_op = torch.library.custom_op("pasa::attention_lse", _attention_lse, mutates_args=())
"""``_attention_lse`` registered as ``pasa::attention_lse``: the traced op of ``return_lse=True``."""


@_attention_op.register_fake
def _attention_fake(q, k, v, scale, precision, shift, beta, layout, kv_counts=None, kv_indices=None, block_q=0,
                    block_k=0):
    out_dtype = torch.float64 if precision == "fp64" else q.dtype
    return q.new_empty(q.shape, dtype=out_dtype)


@_attention_lse_op.register_fake
def _attention_lse_fake(q, k, v, scale, precision, shift, beta, layout, kv_counts=None, kv_indices=None, block_q=0,
                        block_k=0):
    return _attention_fake(q, k, v, scale, precision, shift, beta, layout), q.new_empty(_lse_shape(q, layout),
                                                                                     dtype=_wide(precision))


def pasa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
                   precision: str = DEFAULT_PRECISION, shift: bool | str = DEFAULT_SHIFT,
                   beta: float | None = None, layout: str = "bhnd", return_lse: bool = False,
                   block_mask: BlockSparseMask | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention ``softmax(scale q k^T) v`` that cannot overflow in FP16.

    Args:
        q: queries, ``(B, Hq, Nq, D)`` for ``layout="bhnd"`` or ``(B, Nq, Hq, D)`` for ``"bnhd"``
            (strided views are taken as they are, without copies).
        k, v: keys and values, ``(B, Hk, Nk, D)`` (or ``(B, Nk, Hk, D)``); ``Hq`` a multiple of ``Hk``.
        scale: softmax scale, default ``1/sqrt(D)``.
        precision: ``"hybrid"`` (default) — fp16/bf16 GEMMs, fp32 softmax state and accumulator;
            ``"half"`` — fp16 scores, ``P`` and accumulator (fp16 inputs);
            ``"int8"`` — the exact shift in 8 bits: INT8 ``q k^T`` on centred, rotated codes, ``P V`` in
            16 bits (``reference_int8``; the exact shift only);
            ``"fp8"`` — as ``"int8"`` with ``P`` and ``V`` in FP8 e4m3 (``int8_reference(..., pv_bits=8)``):
            FP8 ``P V`` costs about 2.5e-2 relative RMSE per operand (the spec's bound: <= 4.5e-2);
            ``"fp64"`` — the exact reference, no rounding (for tests; returns float64).
        shift: ``"exact"`` (default) for the exact shift: each 128-key block's mean of K removed
            exactly and the removed logit ``scale q . c_j`` carried in fp32
            (``reference.exact_shift_reference``): as accurate as FP32-score FlashAttention in
            ``"hybrid"``, overflow-free in ``"half"``; ``"pasa"`` (or ``True``) for the paper's PASA
            (pseudo-average shift with global recovering); ``"none"`` (or ``False``) for plain
            FlashAttention (in ``"half"`` the naive control, which overflows above 65504).
        beta: PASA's shift strength in (0, 1), default ``DEFAULT_BETA`` (0.9375); read by ``shift="pasa"``
            only, so a ``beta`` with another shift is refused (``ValueError`` naming both).
        layout: ``"bhnd"`` or ``"bnhd"``; the output has the layout of ``q``, contiguous.
        return_lse: also return ``lse = logsumexp(scale q k^T, dim=-1)``, the natural-log log-sum-exp of
            each query row's true logits, as diffusers' ring attention merges partial outputs:
            ``out = sum_i exp(lse_i - lse) out_i`` with ``lse = logsumexp_i(lse_i)``.  The shifts do not
            change it: the exact shift's removed ``scale q . c_j`` and PASA's removed pseudo-average are
            in it (docs/NUMERICS.md, "The log-sum-exp"); its error is the variant's, as the output's.
        block_mask: ``None`` (every key), or a ``block_sparse.BlockSparseMask`` for ``(B, Hq, Nq)`` queries and
            ``Nk`` keys (its batch 1 or ``B``, its heads 1, ``Hk`` or ``Hq``; on ``q``'s device; key blocks of
            ``rules.SHIFT_BLOCK`` = 128 keys, query blocks a multiple of ``rules.MASK_QUERY_TILE`` = 128 rows):
            each query block attends only to its kept key blocks, as ``softmax`` over those keys alone (the
            references' ``block_mask``: PASA's pseudo-average runs over the visited blocks).  A query block that
            keeps no key block gets zeros, and ``lse = -inf``.  The portable kernels (``"portable"``,
            ``"portable-int8"``) and the Gluon kernels (``"gluon"``, ``"gluon-int8"``) skip the missing blocks
            (neither loaded nor multiplied); ``"packed"`` takes no mask, so a short-keys call with one runs the
            portable kernel, and ``"auto"`` runs a masked 8-bit call as an unmasked one: on ``"gluon-int8"``
            from ``hopper_int8.AUTO_MIN_KEYS`` keys on sm_90 (docs/SPARSE.md).  A mask that keeps every block
            (``keeps_all``) runs as ``None``: the same kernels, the same bits.

    Returns:
        The attention output in ``q.dtype`` (float64 for ``precision="fp64"``), head dim 16 to 256; with
        ``return_lse``, ``(out, lse)``: ``lse`` float32 (float64 for ``"fp64"``) of shape ``(B, Hq, Nq)``
        whatever ``layout``, contiguous (empty for empty inputs; ``inf`` or NaN on rows whose output
        overflowed, as the naive half control's).

    Kernels (CUDA): ``kernels.dispatch.plan`` picks them: the Gluon kernel in FA3's structure for the
    default on sm_90 (fp16 or bf16, head dims 64 and 80-128, keys of several blocks), the packed kernel for short one-block
    sequences (temporal attention), the portable FlashAttention-2 loop for everything else; the 8-bit
    precisions (``"int8"``, ``"fp8"``) run the 8-bit kernels on the quantizing pre-pass's codes.  All give
    the variant's result within its bound (``tests/test_kernel_gpu.py``, ``tests/test_int8.py``).

    Raises:
        ValueError: an argument out of ``rules``' ranges (named in the message), ``beta`` with a
            shift other than ``"pasa"``, or a ``block_mask`` that does not fit the call.
        RuntimeError: an input requires grad while grad mode is on: the op is forward-only.
    """
    interpreting = _interpreting()
    _validate(q, k, v, scale, precision, shift, beta, layout, return_lse, block_mask, interpreting)
    if block_mask is not None and block_mask.keeps_all:  # the dense call: its kernels, its bits
        block_mask = None
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    beta = DEFAULT_BETA if beta is None else float(beta)
    mode = rules.shift_mode(shift)
    if torch.compiler.is_compiling():
        op = _attention_lse_op if return_lse else _attention_op
        return op(q, k, v, scale, precision, mode, beta, layout, *_mask_fields(block_mask))
    # eager: the implementation itself, without the dispatcher's round trip (torch's custom-op wrapper
    # also imports torch._dynamo on its first call: 2-3 s of cold start)
    out, lse = _run(q, k, v, scale, precision, mode, beta, layout, return_lse, block_mask, interpreting)
    return (out, lse) if return_lse else out
