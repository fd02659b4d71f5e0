"""The input rules of the attention op, stated once: names, ranges and the checks that enforce them.

The public op (``ops.py``), the references (``reference.py``) and the processors' installation
(``install.py``) check their inputs here, so that every rule has one wording and one place; the kernels
behind the op take what it has checked.  Every check raises ``ValueError`` whose message starts with the
calling function's name and names the argument and the value it got.  This module imports only torch
and ``variants``.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .variants import (DEFAULT_PRECISION, DEFAULT_SHIFT, KERNEL_PRECISIONS, PRECISIONS, SHIFT_MODES, combination_problem,
                       shift_mode)

__all__ = [
    "PRECISIONS",
    "KERNEL_PRECISIONS",
    "SHIFT_MODES",
    "LAYOUTS",
    "SUPPORTED_DTYPES",
    "PRECISION_DTYPES",
    "MIN_HEAD_DIM",
    "MAX_HEAD_DIM",
    "SHIFT_BLOCK",
    "INT8_FALLBACK_TAU",
    "P_SHIFT",
    "FP16_MAX",
    "QMAX",
    "FP8_MAX",
    "LOG2E",
    "DEFAULT_PRECISION",
    "DEFAULT_SHIFT",
    "shift_mode",
    "check_options",
    "check_qkv",
    "check_kernel_tensors",
    "unsupported_reason",
    "gemm_dtype",
]

LAYOUTS = ("bhnd", "bnhd")
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
PRECISION_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "hybrid": SUPPORTED_DTYPES,
    "half": (torch.float16,),
    "int8": SUPPORTED_DTYPES,
    "fp8": SUPPORTED_DTYPES,
    "fp64": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
}
"""Input dtypes each precision takes."""

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
SHIFT_BLOCK = 128
"""Keys per shift block (PASA's ``n``, the exact shift's centring block): part of the result, not a tile size."""
MASK_QUERY_TILE = 128
"""A block mask's query block (``block_sparse.BlockSparseMask.block_q``) is a multiple of this, the largest query
tile (``BLOCK_M``) of any kernel's configs: every query tile then lies in one query block and reads its row of the
mask.  (Its key block is ``SHIFT_BLOCK``: the kernels' key tiles divide it.)"""
INT8_FALLBACK_TAU = 2e-2
"""The 8-bit precisions (``"int8"``, ``"fp8"``): the predicted RMS logit error (natural units) above which a key
block is computed in 16 bits (``reference_int8`` step 4b; the spec and the kernels read it here): part of the
result."""
P_SHIFT = 8.0
"""FP8 ``P V`` (``precision="fp8"``): ``P8 = e4m3(exp2(x + P_SHIFT))`` with ``x <= 0`` lies in [0, 256], inside e4m3's
range (FlashAttention-3's shift); the spec and the kernels read it here."""

FP16_MAX = 65504.0
"""The largest finite fp16 value: a score above it overflows to inf in fp16."""
QMAX = 127.0
"""The largest INT8 code the 8-bit precisions use (symmetric codes in [-127, 127]); the spec and the kernels read
it here."""
FP8_MAX = 448.0
"""The largest finite FP8 e4m3 value: the 8-bit spec's and the kernels' FP8 ``V`` and the peers' FP8 inputs are
scaled into it."""
LOG2E = 1.4426950408889634
"""log2(e): ``scale LOG2E`` turns logits into the log2 units of ``exp2``; the spec and the kernels read it here."""

def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor core reads for inputs of ``dtype`` (the rounding model's "GEMM dtype" ``g``): bf16
    stays bf16, everything else is fp16."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float16


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_options(fn: str, *, precision: str, shift: bool | str, beta: float | None = None,
                  scale: float | None = None, layout: str | None = None, return_lse: bool = False) -> None:
    """Check the op's options: ``precision``, ``shift``, ``beta`` in (0, 1) and only with ``shift="pasa"`` (the
    one shift that reads it: the exact shift and plain FlashAttention would ignore it), ``scale`` positive
    finite (not a bool), ``layout``, ``return_lse`` a bool.  ``None`` for ``beta``/``scale`` means the default;
    ``layout=None`` skips it."""
    if not (isinstance(precision, str) and precision in PRECISIONS):
        raise ValueError(f"{fn}: unknown precision={precision!r}; expected one of {PRECISIONS}")
    mode = shift_mode(shift, fn)
    problem = combination_problem(mode, precision)
    if problem:
        raise ValueError(f"{fn}: {problem}")
    if beta is not None and not (_is_real(beta) and 0.0 < float(beta) < 1.0):
        raise ValueError(f"{fn}: beta must be a number in (0, 1), got beta={beta!r}")
    if beta is not None and mode != "pasa":
        raise ValueError(f"{fn}: beta={beta!r} is the strength of PASA's shift, which shift={mode!r} does not "
                         "read; pass shift='pasa' with it, or leave beta out")
    if scale is not None and not (_is_real(scale) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{fn}: scale must be a positive finite number, got scale={scale!r}")
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"{fn}: unknown layout={layout!r}; expected one of {LAYOUTS}")
    if not isinstance(return_lse, bool):
        raise ValueError(f"{fn}: return_lse must be a bool, got return_lse={return_lse!r}")


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_qkv(fn: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, precision: str = "fp64") -> None:
    """Check ``(B, H, N, D)`` views: tensors, rank 4, at least one head, one channel and (unless the output
    is empty: ``B = 0`` or ``Nq = 0``, as SDPA allows) one key, batch and head dims agree, GQA grouping,
    one device, one dtype, the dtype ``precision`` takes and a head dim in
    ``[MIN_HEAD_DIM, MAX_HEAD_DIM]`` (the last two only for the kernel's precisions)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must have rank 4 (B, H, N, D), got {name}.shape={_shape(t)}")
        if t.shape[1] == 0 or t.shape[3] == 0:
            raise ValueError(f"{fn}: {name} has no heads or a head dim of 0 ({name}.shape={_shape(t)}); H and D "
                             "must be >= 1")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"{fn}: batch sizes differ: q.shape={_shape(q)}, k.shape={_shape(k)}, v.shape={_shape(v)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"{fn}: k and v must agree in (B, H, N): k.shape={_shape(k)}, v.shape={_shape(v)}")
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise ValueError(f"{fn}: head dims of q, k, v differ: q.shape={_shape(q)}, k.shape={_shape(k)}, "
                         f"v.shape={_shape(v)}")
    if k.shape[2] == 0 and q.shape[0] * q.shape[2] > 0:
        raise ValueError(f"{fn}: k and v hold no keys (k.shape={_shape(k)}): softmax over no keys is undefined")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{fn}: q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]}) for GQA")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"{fn}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{fn}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in PRECISION_DTYPES[precision]:
        hint = "; use precision='hybrid' for bfloat16" if precision == "half" and q.dtype == torch.bfloat16 else ""
        raise ValueError(f"{fn}: dtype {q.dtype} is not supported for precision={precision!r}; expected one of "
                         f"{PRECISION_DTYPES[precision]}{hint}")
    head_dim = q.shape[-1]
    if precision != "fp64" and not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        where, limit = (("above the supported maximum", MAX_HEAD_DIM) if head_dim > MAX_HEAD_DIM
                        else ("below the supported minimum", MIN_HEAD_DIM))
        raise ValueError(f"{fn}: head dim {head_dim} is {where} {limit} (q.shape={_shape(q)})")


def check_kernel_tensors(fn: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None,
                         *, interpret: bool) -> None:
    """What the Triton kernel needs beyond ``check_qkv``: CUDA tensors (or CPU ones under
    ``TRITON_INTERPRET=1``), unit stride in the head dim, and an ``out`` of ``q``'s shape and dtype."""
    named = [("q", q), ("k", k), ("v", v)] + ([("out", out)] if out is not None else [])
    for name, t in named:
        if t.device.type not in ("cuda", "cpu"):
            raise ValueError(f"{fn}: {name} is on {t.device}; the op runs on CUDA tensors (the Triton kernels) and "
                             "CPU tensors (the exact reference, or the kernels under TRITON_INTERPRET=1)")
        if t.device.type == "cpu" and not interpret:
            raise ValueError(f"{fn}: {name} is on the CPU; the kernels run on CUDA tensors (CPU tensors only under "
                             "TRITON_INTERPRET=1, set before triton is first imported)")
        if t.stride(-1) != 1:
            raise ValueError(f"{fn}: {name} must have unit stride in the head dim, got {name}.stride()="
                             f"{tuple(t.stride())} for {name}.shape={_shape(t)}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(f"{fn}: out must match q in shape, dtype and device, got out.shape={_shape(out)} "
                         f"{out.dtype} {out.device} for q.shape={_shape(q)} {q.dtype} {q.device}")


def unsupported_reason(head_dim: int, dtype: torch.dtype, precision: str) -> str | None:
    """Why the op cannot take queries of this head dim and dtype in ``precision``, or ``None`` (for the
    processors and their installation, which decide per module whether the op can serve it)."""
    if precision != "fp64" and not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        return f"head dim {head_dim}"
    if dtype not in PRECISION_DTYPES[precision]:
        return f"dtype {str(dtype).removeprefix('torch.')}"
    return None
