"""Kernel launches that skip Triton's argument binding on repeats: the compiled kernel kept per launch key.

``fn[grid](*args, **meta)`` costs the host 15-35 us in Triton 3.6 before the driver's launch itself: the
generated binder specializes every argument (a tensor's dtype and 16-byte alignment, an int's ``== 1``, ``% 16``
and 32/64-bit width, a TMA descriptor's dtype, box and shared layout), and the cache key is built from the result
(docs/notes/host_overhead.md).  A caller that already holds a key fixing all of that (its shapes, strides,
dtypes, config and the alignments of its raw pointers) passes it to :func:`kept_launch`: the key's first launch goes
through ``fn[grid]``, which compiles or finds the kernel and returns it, and later launches of the key call that
compiled kernel's launcher directly, with the same positional arguments in the kernel's signature order (the
constexprs' values included, as Triton's own launch passes them) and Triton's launch hooks.

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


def arguments_key(args: Sequence) -> tuple:
    """What Triton specializes on in ``args``, but for TMA descriptors: each int itself (its ``== 1``, ``% 16`` and
    width follow from it), each tensor's dtype and base alignment (``data_ptr() % 16``), and the type of anything
    else (a float is fp32, never specialized; a descriptor's dtype, box and layout are the caller's to add)."""
    return tuple((a.dtype, a.data_ptr() & 15) if isinstance(a, torch.Tensor) else a if isinstance(a, int) else type(a)
                 for a in args)


def kept_launch(fn, grid: Sequence[int], args: Sequence, meta: dict, keep: Hashable | None) -> None:
    """``fn[grid](*args, **meta)``; with ``keep``, the compiled kernel is kept and reused.

    The launch key is ``(fn, the current device, keep, arguments_key(args), meta's values)``: ``keep`` holds what
    else fixes Triton's specialization, the dtype of each TMA descriptor in ``args`` (their boxes and layouts must
    follow from ``meta``), or ``()`` where ``args`` hold none.  ``keep=None`` binds every launch.  The kept
    launch goes through ``compat`` (Triton's private launch path).
    """
    if keep is None or not isinstance(fn, triton.JITFunction):
        fn[grid](*args, **meta)
        return
    device = current_cuda_device()
    key = (fn, device, keep, arguments_key(args), *meta.values())
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
