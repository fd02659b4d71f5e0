"""What the router hands a kernel: one call object, its plan, and the entry each kernel file ends with.

``dispatch`` builds one :class:`Call` per op call (the tensors, the checked variant, the options, and what the
pre-pass wrote), plans it once per call signature (:class:`Plan`), and runs the chosen kernel's
:class:`Kernel` entry: ``entry.launch(call, plan)`` per range of batch and heads.  A kernel file ends with its
``ENTRY``; ``dispatch.TABLE`` lists the entries in ``kernel="auto"``'s order of preference.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch

from ..block_sparse import BlockSparseMask
from ..variants import Variant

__all__ = ["Call", "Plan", "Kernel", "PREPASSES", "COPYING_PREPASSES", "NO_SHIFT", "BlockSparseMask"]

PREPASSES = ("centre", "shift", "quantize")
"""The pre-passes a kernel may ask for: ``"centre"`` (the exact shift: each block's centre removed once per head,
``prepass.centre_keys``), ``"shift"`` (PASA: the shifted keys once per head, ``prepass.shift_keys``) and
``"quantize"`` (q, k, v to the 8-bit codes, ``quantize.prepare``)."""

COPYING_PREPASSES = ("centre", "shift", "quantize")
"""The pre-passes that write a copy of the inputs (the keys centred or shifted; the 8-bit codes of q, k and v with
their statistics): their calls may run in ranges (``dispatch.key_chunks``)."""

NO_SHIFT = (0.0, 0.0, 0.0, 0.0, 0.0, 1.0)
"""The shift constants of a call that is not PASA's (read by no kernel)."""


@dataclass(slots=True)
class Call:
    """One call as the router and the kernels see it (mutable: the router and the pre-pass fill in the rest).

    Asked (checked by ``ops``): ``q`` ``(B, Hq, Nq, D)``, ``k``, ``v`` ``(B, Hk, Nk, D)``, ``out``; ``variant``,
    ``scale``, ``beta``, ``block_n`` (``None``: the default), ``kernel`` (``"auto"`` or a name), ``prepass``
    (``None`` / ``True`` / ``False``), ``config``, ``lse``, ``pv_bits``, ``fallback``, ``block_mask`` (a
    ``block_sparse.BlockSparseMask`` whose missing key blocks the kernel skips, checked against the call by the
    op, or ``None``: every block).

    Resolved by the router while it plans (what ``unsuitable`` reads): ``shift_block`` (the shift block the
    kernels see, 0 for plain FlashAttention), ``one_block`` (all keys in one block), ``bits`` (``P V``'s bits).

    Written by the pre-pass (what ``launch`` reads): ``keys`` (``k``, or the centred / shifted copy),
    ``centres`` (the centre pre-pass's block centres), ``constants`` (PASA's shift constants), ``prep`` (the
    quantizing pre-pass's ``quantize.Prepared``).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    variant: Variant
    scale: float = 1.0
    beta: float = 0.0
    block_n: int | None = None
    kernel: str = "auto"
    prepass: bool | None = None
    config: dict | None = None
    lse: torch.Tensor | None = None
    pv_bits: int | None = None
    fallback: bool = True
    block_mask: BlockSparseMask | None = None
    shift_block: int = 0
    one_block: bool = False
    bits: int = 16
    keys: torch.Tensor | None = None
    centres: torch.Tensor | None = None
    constants: tuple = NO_SHIFT
    prep: object = None

    def part(self, batches: tuple[int, int], heads: tuple[int, int]) -> Call:
        """This call on batch elements ``[b0, b1)`` and kv heads ``[h0, h1)`` (their query heads): views (the
        mask's too: its rows of those query or key heads), and nothing the pre-pass wrote."""
        (b0, b1), (h0, h1) = batches, heads
        group = self.q.shape[1] // self.k.shape[1]
        hq = slice(h0 * group, h1 * group)
        k = self.k[b0:b1, h0:h1]
        mask = self.block_mask
        if mask is not None:
            per_query_head = mask.kv_counts.shape[1] == self.q.shape[1]
            mask = mask.select((b0, b1), (hq.start, hq.stop) if per_query_head else (h0, h1))
        return replace(self, q=self.q[b0:b1, hq], k=k, v=self.v[b0:b1, h0:h1], out=self.out[b0:b1, hq],
                       lse=None if self.lse is None else self.lse[b0:b1, hq], block_mask=mask, keys=k, centres=None,
                       prep=None)


@dataclass(frozen=True)
class Plan:
    """How one call runs.

    Attributes:
        kernel: the name of the kernel that runs it (an entry of ``dispatch.TABLE``).
        prepass: one of :data:`PREPASSES` or ``None`` (keys read as they are, shifted or centred inside the kernel).
        block_n: the shift block the kernels see (at most the keys' tile: up to ``block_n`` keys form one
            block of ``n_j = Nk`` keys whatever the tile); 0 for plain FlashAttention.
        one_block: all keys in one shift block.
        rejected: each kernel not chosen -> why, in words.
        pv_bits: the bits of ``P`` and ``V`` in the ``P V`` GEMM: 16 (the inputs' dtype), or 8 (FP8 e4m3;
            the 8-bit kernels only: ``precision="fp8"``, or ``"int8"`` with ``pv_bits=8``).
    """

    kernel: str
    prepass: str | None
    block_n: int
    one_block: bool
    rejected: dict[str, str] = field(default_factory=dict)
    pv_bits: int = 16

    def describe(self) -> str:
        """One line: the kernel, its pre-pass (and ``P V`` in FP8 where it is) and why not the others."""
        keys = f" + {self.prepass} pre-pass" if self.prepass else ""
        fp8 = ", P V in FP8" if self.pv_bits == 8 else ""
        others = "; ".join(f"not {name}: {why}" for name, why in self.rejected.items())
        return f"{self.kernel}{keys}{fp8}" + (f" ({others})" if others else "")


@dataclass(frozen=True)
class Kernel:
    """One kernel, as its file declares it (``ENTRY``) for the router.

    Attributes:
        name: the kernel's name (``kernel=``), unique in the table.
        precisions, shifts: the variants it runs; the router rejects any other without asking it.
        launch: ``launch(call, plan)`` runs it on ``call`` (after the plan's pre-pass filled in ``call``).
        unsuitable: ``unsuitable(call) -> reason | None``: why it cannot run a call of its variants, in words
            (``call.kernel == "auto"`` may add reasons of preference: another kernel is faster there).
        prepass: the pre-pass it needs, one of :data:`PREPASSES` or ``None``, or a function of the call that
            says which.
        prepass_options: what the pre-pass writes for it: ``centres_in_keys_dtype`` (the centres in the keys'
            dtype, not fp32), ``bias`` (the 8-bit pre-pass's bias rows, ``quantize.Prepared.bias``).
    """

    name: str
    precisions: tuple[str, ...]
    shifts: tuple[str, ...]
    launch: Callable[[Call, Plan], object]
    unsuitable: Callable[[Call], str | None]
    prepass: str | None | Callable[[Call], str | None] = None
    prepass_options: Mapping[str, bool] = field(default_factory=lambda: MappingProxyType({}))

    def prepass_of(self, call: Call) -> str | None:
        """The pre-pass this kernel runs ``call`` with."""
        return self.prepass(call) if callable(self.prepass) else self.prepass
