"""The public attention op: validation, dispatch and its ``torch.library`` registration.

``pasa_attention`` reads like ``torch.nn.functional.scaled_dot_product_attention``.  Dispatch:

- CUDA tensors run the fused Triton kernel (``kernels/pasa_fwd.py``);
- CPU tensors run the kernel itself when ``TRITON_INTERPRET=1`` is set (Triton's numpy
  interpreter: slow, for tests), and otherwise the exact PyTorch reference of the same variant
  (``reference.py``), which rounds at the same points as the kernel;
- ``precision="fp64"`` runs the reference with no rounding at all, on any device (for
  ``shift="exact"`` the float64 golden attention: the exact shift is exact in real arithmetic).

The op is registered as ``pasa::attention`` with a fake (meta) implementation, so ``torch.compile``
and CUDA graphs take it without graph breaks.
"""
from __future__ import annotations

import math
import os

import torch

from . import reference
from .reference import DEFAULT_BETA

__all__ = ["pasa_attention", "MIN_HEAD_DIM", "MAX_HEAD_DIM", "SUPPORTED_DTYPES", "PRECISIONS", "LAYOUTS", "SHIFTS"]

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
PRECISIONS = ("half", "hybrid", "fp64")
LAYOUTS = ("bhnd", "bnhd")
SHIFTS = (True, False, "exact")
_SHIFT_MODES = {True: "pasa", False: "none", "exact": "exact"}  # the op's schema takes a str


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, precision: str,
              shift: bool | str, beta: float | None, layout: str) -> None:
    fn = "pasa_attention"
    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: unknown layout={layout!r}; expected one of {LAYOUTS}")
    if precision not in PRECISIONS:
        raise ValueError(f"{fn}: unknown precision={precision!r}; expected one of {PRECISIONS}")
    if not (isinstance(shift, bool) or (isinstance(shift, str) and shift == "exact")):
        raise ValueError(f"{fn}: unknown shift={shift!r}; expected one of {SHIFTS}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must have rank 4 ({layout.upper()}), got {name}.shape={_shape(t)}")
        if t.device.type not in ("cuda", "cpu"):
            raise ValueError(f"{fn}: {name} is on {t.device}; only CUDA and CPU tensors are supported")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{fn}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if precision != "fp64" and q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{fn}: dtype {q.dtype} is not supported for precision={precision!r}; "
                         f"expected one of {SUPPORTED_DTYPES}")
    if precision == "half" and q.dtype != torch.float16:
        raise ValueError(f"{fn}: precision='half' is the fully-FP16 pipeline and needs float16 inputs, "
                         f"got {q.dtype}; use precision='hybrid' for bfloat16")
    head_dim = q.shape[-1]
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        where = "above the supported maximum" if head_dim > MAX_HEAD_DIM else "below the supported minimum"
        limit = MAX_HEAD_DIM if head_dim > MAX_HEAD_DIM else MIN_HEAD_DIM
        raise ValueError(f"{fn}: head dim {head_dim} is {where} {limit} (q.shape={_shape(q)})")
    if v.shape[-1] != head_dim:
        raise ValueError(f"{fn}: v's head dim must equal q's, got q.shape={_shape(q)}, v.shape={_shape(v)}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{fn}: scale must be a positive finite float, got scale={scale!r}")
    if beta is not None and not (isinstance(beta, (int, float)) and 0.0 < float(beta) < 1.0):
        raise ValueError(f"{fn}: beta must lie in (0, 1), got beta={beta!r}")
    if layout == "bnhd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    reference.validate_qkv(q, k, v, fn)
    if q.device.type == "cuda" and precision != "fp64":
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.stride(-1) != 1:
                raise ValueError(f"{fn}: {name} must have unit stride in the head dim, got "
                                 f"{name}.stride()={tuple(t.stride())}")


def _use_kernel(device: torch.device, precision: str) -> bool:
    if precision == "fp64":
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _attention_bhnd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float,
                    precision: str, shift_mode: str, beta: float) -> None:
    """Write attention of (B, H, N, D) views ``q, k, v`` into the (B, H, N, D) view ``out``."""
    if _use_kernel(q.device, precision):
        from .kernels.pasa_fwd import pasa_forward

        shift = "exact" if shift_mode == "exact" else shift_mode == "pasa"
        pasa_forward(q, k, v, out, scale=scale, precision=precision, shift=shift, beta=beta)
    elif shift_mode == "exact" and precision != "fp64":
        out.copy_(reference.exact_shift_reference(q, k, v, scale, precision=precision))
    elif shift_mode == "pasa":
        out.copy_(reference.pasa_reference(q, k, v, scale, beta=beta, precision=precision))
    elif precision == "fp64":
        out.copy_(reference.golden_attention(q, k, v, scale))
    else:
        flash_precision = "half" if precision == "half" else "fp32"
        out.copy_(reference.flash_reference(q, k, v, scale, precision=flash_precision))


@torch.library.custom_op("pasa::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, precision: str, shift: str,
                  beta: float, layout: str) -> torch.Tensor:
    out_dtype = torch.float64 if precision == "fp64" else q.dtype
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    if layout == "bnhd":
        q, k, v, out_view = (t.transpose(1, 2) for t in (q, k, v, out))
    else:
        out_view = out
    _attention_bhnd(q, k, v, out_view, scale, precision, shift, beta)
    return out


@_attention_op.register_fake
def _attention_fake(q, k, v, scale, precision, shift, beta, layout):
    out_dtype = torch.float64 if precision == "fp64" else q.dtype
    return q.new_empty(q.shape, dtype=out_dtype)


def pasa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
                   precision: str = "hybrid", shift: bool | str = "exact", beta: float | None = None,
                   layout: str = "bhnd") -> torch.Tensor:
    """Softmax attention ``softmax(scale q k^T) v`` that cannot overflow in FP16.

    Args:
        q: queries, ``(B, Hq, Nq, D)`` for ``layout="bhnd"`` or ``(B, Nq, Hq, D)`` for ``"bnhd"``
            (strided views are taken as they are, without copies).
        k, v: keys and values, ``(B, Hk, Nk, D)`` (or ``(B, Nk, Hk, D)``); ``Hq`` a multiple of ``Hk``.
        scale: softmax scale, default ``1/sqrt(D)``.
        precision: ``"half"`` — scores, softmax state and accumulator all in fp16 (fp16 inputs);
            ``"hybrid"`` — fp16/bf16 GEMMs, fp32 softmax state and accumulator;
            ``"fp64"`` — the exact reference, no rounding (for tests; returns float64).
        shift: ``True`` for PASA's pseudo-average shift with global recovering; ``False`` for plain
            FlashAttention (in ``"half"`` the naive control, which overflows above 65504); ``"exact"``
            for the exact shift: each 128-key block's mean of K removed exactly and the removed logit
            ``scale q . c_j`` carried in fp32 (``reference.exact_shift_reference``): as accurate as
            fp32-score FlashAttention in ``"hybrid"``, overflow-free in ``"half"``.
        beta: shift strength in (0, 1), default ``DEFAULT_BETA`` (0.9375).
        layout: ``"bhnd"`` or ``"bnhd"``; the output has the layout of ``q``, contiguous.

    Returns:
        The attention output in ``q.dtype`` (float64 for ``precision="fp64"``), head dim 16 to 256.
    """
    _validate(q, k, v, scale, precision, shift, beta, layout)
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    beta = DEFAULT_BETA if beta is None else float(beta)
    return _attention_op(q, k, v, scale, precision, _SHIFT_MODES[shift], beta, layout)
