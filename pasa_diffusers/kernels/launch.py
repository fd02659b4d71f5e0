"""Kernel launches that skip Triton's argument binding on repeats: the compiled kernel kept per launch key.

``fn[grid](*args, **meta)`` costs the host 15-35 us in Triton 3.6 before the driver's launch itself: the
generated binder specializes every argument (a tensor's dtype and 16-byte alignment, an int's ``== 1``, ``% 16``
and 32/64-bit width, a TMA descriptor's dtype, box and shared layout), and the cache key is built from the result
(docs/notes/host_overhead.md).  :func:`kept_launch` keys a launch by what those rules read (:func:`arguments_key`)
and the launch's constexprs: the key's first launch goes through ``fn[grid]``, which compiles or finds the kernel
and returns it, and later launches of the key call that compiled kernel's launcher directly, with the same
positional arguments in the kernel's signature order (the constexprs' values included, as Triton's own launch
passes them) and Triton's launch hooks.

Under ``TRITON_INTERPRET=1`` (no compiled kernel) every launch goes through ``fn[grid]``.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import triton

from ..compat import current_cuda_device, launch_compiled, launch_values

__all__ = ["kept_launch", "arguments_key", "forget_launches", "LAUNCH_CACHE_SIZE"]

LAUNCH_CACHE_SIZE = 4096
"""The most launch keys kept (the cache is emptied when full)."""

_KEPT: dict[tuple, tuple] = {}


_DESCRIPTOR_TYPES: dict[type, bool] = {}
"""Per argument type, whether it is a TMA descriptor (it has a ``block_shape``): looked up once per type."""


def _argument_key(a) -> Hashable:
    """What Triton specializes on in one argument (:func:`arguments_key`)."""
    kind = type(a)
    if kind is int:
        return a
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() & 15
    if kind is bool:
        return bool, a
    descriptor = _DESCRIPTOR_TYPES.get(kind)
    if descriptor is None:
        descriptor = _DESCRIPTOR_TYPES[kind] = hasattr(a, "block_shape")
    if descriptor:
        return kind, a.base.dtype, tuple(a.block_shape), a.layout, getattr(a, "padding", None)
    return kind


def arguments_key(args: Sequence) -> tuple:
    """What Triton specializes on in ``args``: each tensor's dtype and base alignment (``data_ptr() % 16``), each
    int itself (its ``== 1``, ``% 16`` and width follow from it), each TMA descriptor's type, dtype, box, shared
    layout and padding (its base address, shape and strides are encoded at launch, not specialized), each bool,
    and the type of anything else (a float is fp32, never specialized)."""
    return tuple(_argument_key(a) for a in args)


def kept_launch(fn, grid: Sequence[int], args: Sequence, meta: dict) -> None:
    """``fn[grid](*args, **meta)``, the compiled kernel kept per launch key ``(fn, the current device,
    arguments_key(args), meta's items)`` and reused on a repeat.  The kept launch goes through ``compat``
    (Triton's private launch path)."""
    if not isinstance(fn, triton.JITFunction):  # the interpreter's function: nothing compiled to keep
        fn[grid](*args, **meta)
        return
    device = current_cuda_device()
    key = (fn, device, arguments_key(args), *meta.items())
    kept = _KEPT.get(key)
    if kept is None:
        compiled = fn[grid](*args, **meta)
        if len(_KEPT) >= LAUNCH_CACHE_SIZE:
            _KEPT.clear()
        _KEPT[key] = compiled, launch_values(fn, args, meta)[len(args):]  # the constexprs and defaults
        return
    compiled, tail = kept
    launch_compiled(compiled, grid, (*args, *tail), device)


def forget_launches() -> None:
    """Drop every kept compiled kernel (the next launch of each key binds again)."""
    _KEPT.clear()
