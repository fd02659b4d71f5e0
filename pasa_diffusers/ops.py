"""The public attention op: validation, dispatch and its ``torch.library`` registration.

``pasa_attention`` reads like ``torch.nn.functional.scaled_dot_product_attention``.  It checks its
inputs once (``rules``), converts ``shift`` to its name once (``variants.shift_mode``), and then:

- CUDA tensors go to ``kernels.dispatch.forward``, which picks the kernel (``dispatch.plan`` says which
  and why);
- CPU tensors run the kernels themselves when ``TRITON_INTERPRET=1`` is set (Triton's numpy
  interpreter: slow, for tests), and otherwise the exact PyTorch reference of the same variant
  (``reference.attention``), which rounds to the same dtypes at the same points as the kernels (it
  evaluates the exponentials as ``exp`` in fp32 where the kernels take ``exp2`` of an FMA, so the two
  agree to within rounding, not bit for bit);
- ``precision="fp64"`` runs the reference with no rounding at all, on any device (for
  ``shift="exact"`` the float64 golden attention: the exact shift is exact in real arithmetic).

The op is registered as ``pasa::attention`` with a fake (meta) implementation, so ``torch.compile``
and ``torch.export`` trace it without graph breaks; eager calls (and CUDA graph capture) run its
implementation directly.
"""
from __future__ import annotations

import math
import os

import torch

from . import reference, rules
from .beta import DEFAULT_BETA
from .variants import Variant

__all__ = ["pasa_attention"]


def _interpreting() -> bool:
    """Whether CPU tensors run the kernels (Triton's interpreter), read per call."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, precision: str,
              shift: bool | str, beta: float | None, layout: str) -> None:
    fn = "pasa_attention"
    rules.check_options(fn, precision=precision, shift=shift, beta=beta, scale=scale, layout=layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() != 4:
            raise ValueError(f"{fn}: {name} must have rank 4 ({layout.upper()}), got {name}.shape={tuple(t.shape)}")
    if layout == "bnhd":
        q, k, v = (t.transpose(1, 2) if isinstance(t, torch.Tensor) else t for t in (q, k, v))
    rules.check_qkv(fn, q, k, v, precision)
    if precision != "fp64" and (q.device.type != "cpu" or _interpreting()):
        rules.check_kernel_tensors(fn, q, k, v, interpret=_interpreting())
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError(f"{fn}: the op has no backward (forward-only, for inference); q, k or v requires grad. "
                           "Call it under torch.no_grad() / torch.inference_mode(), or detach the inputs")


def _use_kernel(device: torch.device, precision: str) -> bool:
    if precision == "fp64":
        return False
    return device.type == "cuda" or _interpreting()


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, precision: str, shift: str,
               beta: float, layout: str) -> torch.Tensor:
    """The op on checked arguments (``shift`` a name of ``variants.SHIFT_MODES``); the output has ``q``'s
    layout, contiguous."""
    variant = Variant(shift, precision)
    out = torch.empty(q.shape, dtype=torch.float64 if precision == "fp64" else q.dtype, device=q.device)
    if out.numel() == 0:  # no batch or no queries: nothing to compute, as SDPA
        return out
    if layout == "bnhd":
        q, k, v, out_bhnd = (t.transpose(1, 2) for t in (q, k, v, out))
    else:
        out_bhnd = out
    if _use_kernel(q.device, precision):
        from .kernels import dispatch

        dispatch.forward(q, k, v, out_bhnd, scale=scale, variant=variant, beta=beta)
    else:
        out_bhnd.copy_(reference.attention(q, k, v, scale, variant, beta))
    return out


_attention_op = torch.library.custom_op("pasa::attention", _attention, mutates_args=())
"""``_attention`` registered as ``pasa::attention``: what ``torch.compile`` and ``torch.export`` trace."""


@_attention_op.register_fake
def _attention_fake(q, k, v, scale, precision, shift, beta, layout):
    out_dtype = torch.float64 if precision == "fp64" else q.dtype
    return q.new_empty(q.shape, dtype=out_dtype)


def pasa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
                   precision: str = rules.DEFAULT_PRECISION, shift: bool | str = rules.DEFAULT_SHIFT,
                   beta: float | None = None,
                   layout: str = "bhnd") -> torch.Tensor:
    """Softmax attention ``softmax(scale q k^T) v`` that cannot overflow in FP16.

    Args:
        q: queries, ``(B, Hq, Nq, D)`` for ``layout="bhnd"`` or ``(B, Nq, Hq, D)`` for ``"bnhd"``
            (strided views are taken as they are, without copies).
        k, v: keys and values, ``(B, Hk, Nk, D)`` (or ``(B, Nk, Hk, D)``); ``Hq`` a multiple of ``Hk``.
        scale: softmax scale, default ``1/sqrt(D)``.
        precision: ``"hybrid"`` (default) — fp16/bf16 GEMMs, fp32 softmax state and accumulator;
            ``"half"`` — fp16 scores, ``P`` and accumulator (fp16 inputs);
            ``"fp64"`` — the exact reference, no rounding (for tests; returns float64).
        shift: ``"exact"`` (default) for the exact shift: each 128-key block's mean of K removed
            exactly and the removed logit ``scale q . c_j`` carried in fp32
            (``reference.exact_shift_reference``): as accurate as FP32-score FlashAttention in
            ``"hybrid"``, overflow-free in ``"half"``; ``"pasa"`` (or ``True``) for the paper's PASA
            (pseudo-average shift with global recovering); ``"none"`` (or ``False``) for plain
            FlashAttention (in ``"half"`` the naive control, which overflows above 65504).
        beta: PASA's shift strength in (0, 1), default ``DEFAULT_BETA`` (0.9375).
        layout: ``"bhnd"`` or ``"bnhd"``; the output has the layout of ``q``, contiguous.

    Returns:
        The attention output in ``q.dtype`` (float64 for ``precision="fp64"``), head dim 16 to 256.

    Kernels (CUDA): ``kernels.dispatch.plan`` picks them: the Gluon kernel in FA3's structure for the
    default on sm_90 (fp16, head dim 64, keys of several blocks), the packed kernel for short one-block
    sequences (temporal attention), the portable FlashAttention-2 loop for everything else.  All give
    the variant's result within its bound (``tests/test_kernel_gpu.py``).

    Raises:
        ValueError: an argument out of ``rules``' ranges (named in the message).
        RuntimeError: an input requires grad while grad mode is on: the op is forward-only.
    """
    _validate(q, k, v, scale, precision, shift, beta, layout)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    beta = DEFAULT_BETA if beta is None else float(beta)
    mode = rules.shift_mode(shift)
    if torch.compiler.is_compiling():
        return _attention_op(q, k, v, scale, precision, mode, beta, layout)
    # eager: the implementation itself, without the dispatcher's round trip (torch's custom-op wrapper
    # also imports torch._dynamo on its first call: 2-3 s of cold start)
    return _attention(q, k, v, scale, precision, mode, beta, layout)
