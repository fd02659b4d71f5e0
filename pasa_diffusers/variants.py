"""The variants of the attention op, spelled one way: a shift mode times a precision.

A variant is what the op computes, not how (which kernel runs it is ``kernels.dispatch``'s choice):

| shift     | what it removes from the keys before the score GEMM                                    |
| --------- | -------------------------------------------------------------------------------------- |
| ``exact`` | each 128-key block's centre ``c_j``, chosen so that ``k - c_j`` is exact; the removed   |
|           | logit ``scale q . c_j`` is carried in fp32 (the default)                                |
| ``pasa``  | the paper's pseudo-average, ``M = I - (beta/n) 11^T`` folded into K, with global        |
|           | recovering                                                                              |
| ``none``  | nothing: plain FlashAttention (in ``half`` the naive control, which overflows)          |

| precision | GEMM inputs | scores, ``P``, accumulator | softmax state ``m, l``                          |
| --------- | ----------- | -------------------------- | ----------------------------------------------- |
| ``hybrid``| fp16/bf16   | fp32 (``P`` rounded to g)  | fp32                                            |
| ``half``  | fp16        | fp16                       | fp16 (``pasa``, ``none``); the exact shift keeps ``l`` in fp32 |
| ``int8``  | INT8 codes  | int32 sums times fp32 scales, fp32 ``P V`` of ``P`` in g | fp32: the exact shift only, |
|           | (q k^T)     | (``reference_int8``)       | keys centred and rotated, codes per token        |
| ``fp8``   | INT8 codes  | as ``int8``; ``P V`` of FP8 e4m3 ``P`` and ``V`` | fp32: the exact shift only, as ``int8`` |
|           | (q k^T), e4m3 (P V) | (``reference_int8``, ``pv_bits=8``) |                                  |
| ``fp64``  | float64     | float64                    | float64: the exact reference, no rounding (tests) |

``int8`` and ``fp8`` are the 8-bit precisions (:data:`EIGHT_BIT`): the same codes for ``q k^T``, ``P V`` in
16 bits or in 8 (:func:`pv_bits`).  FP8 ``P V`` costs about 2.5e-2 relative RMSE per operand (the spec's bound
for ``fp8``: <= 4.5e-2); ``fp8`` exists for speed.

``shift`` also takes ``True`` (``"pasa"``) and ``False`` (``"none"``), converted once by
:func:`shift_mode` at the public edges (the op, the processors); everything behind them holds the
names above.  This module imports nothing heavy, so the command line can check names without torch.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SHIFT_MODES", "SHIFT_ALIASES", "PRECISIONS", "KERNEL_PRECISIONS", "EIGHT_BIT", "DEFAULT_SHIFT",
           "DEFAULT_PRECISION", "Variant", "DEFAULT", "VARIANTS", "shift_mode", "combination_problem", "eight_bit",
           "PV_BITS", "pv_bits"]

SHIFT_MODES = ("exact", "pasa", "none")
SHIFT_ALIASES = {True: "pasa", False: "none"}
"""The booleans ``shift`` also takes (the paper's on/off switch)."""

PRECISIONS = ("hybrid", "half", "int8", "fp8", "fp64")
KERNEL_PRECISIONS = ("hybrid", "half", "int8", "fp8")
"""The precisions the Triton kernels run (``fp64`` is the reference's alone)."""

EIGHT_BIT = ("int8", "fp8")
"""The 8-bit precisions: INT8 codes for ``q k^T`` on centred, rotated keys, the exact shift only; ``P V`` in
16 bits (``int8``) or in FP8 e4m3 (``fp8``)."""

PV_BITS = (16, 8)
"""The bits of ``P`` and ``V`` in the 8-bit precisions' ``P V`` GEMM, in the order of :data:`EIGHT_BIT`: the inputs'
dtype (16, ``int8``) or FP8 e4m3 (8, ``fp8``)."""
_PV_BITS = dict(zip(EIGHT_BIT, PV_BITS))

DEFAULT_SHIFT = "exact"
DEFAULT_PRECISION = "hybrid"
"""The op's default variant, named here once: the exact shift in hybrid precision (``DEFAULT``).  The op, the
processors and the ``"pasa"`` backend default to it."""

_SHIFT_LABELS = {"exact": "exact", "pasa": "PASA", "none": "FA"}


def shift_mode(shift: bool | str, fn: str = "shift_mode") -> str:
    """The name (one of ``SHIFT_MODES``) of a ``shift`` argument; ``ValueError`` prefixed by ``fn`` otherwise."""
    if isinstance(shift, bool):
        return SHIFT_ALIASES[shift]
    if isinstance(shift, str) and shift in SHIFT_MODES:
        return shift
    raise ValueError(f"{fn}: unknown shift={shift!r}; expected one of {SHIFT_MODES} (or True for 'pasa', "
                     "False for 'none')")


def eight_bit(precision: str) -> bool:
    """Whether ``precision`` is one of the 8-bit precisions (:data:`EIGHT_BIT`)."""
    return precision in EIGHT_BIT


def pv_bits(precision: str) -> int:
    """The bits of ``P`` and ``V`` in an 8-bit precision's ``P V`` GEMM: 16 for ``int8`` (the inputs' dtype), 8
    for ``fp8`` (FP8 e4m3); ``ValueError`` for any other precision."""
    if precision not in _PV_BITS:
        raise ValueError(f"pv_bits: precision={precision!r} is not an 8-bit precision; expected one of {EIGHT_BIT}")
    return _PV_BITS[precision]


def combination_problem(shift: str, precision: str) -> str | None:
    """Why ``shift`` (a name of ``SHIFT_MODES``) and ``precision`` make no variant, or ``None``: the 8-bit
    precisions (``int8``, ``fp8``) are the exact shift's alone."""
    if eight_bit(precision) and shift != "exact":
        return (f"precision={precision!r} runs the exact shift only, got shift={shift!r} (precision={precision!r} "
                "is the exact shift's 8-bit form: its codes need each key block centred as the default does)")
    return None


@dataclass(frozen=True)
class Variant:
    """One cell of the grid ``SHIFT_MODES x PRECISIONS``: what the op computes.

    ``name`` (``"exact-hybrid"``) is the machine spelling used in tables and JSON; ``label``
    (``"exact hybrid"``, ``"PASA half"``, ``"FA half"``) the one in plots and reports.
    """

    shift: str = DEFAULT_SHIFT
    precision: str = DEFAULT_PRECISION

    def __post_init__(self) -> None:
        if self.shift not in SHIFT_MODES:
            raise ValueError(f"Variant: unknown shift={self.shift!r}; expected one of {SHIFT_MODES}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Variant: unknown precision={self.precision!r}; expected one of {PRECISIONS}")
        problem = combination_problem(self.shift, self.precision)
        if problem:
            raise ValueError(f"Variant: {problem}")

    @property
    def name(self) -> str:
        return f"{self.shift}-{self.precision}"

    @property
    def label(self) -> str:
        return f"{_SHIFT_LABELS[self.shift]} {self.precision}"

    @property
    def half(self) -> bool:
        """Whether scores, ``P`` and the accumulator are fp16 (the fully-half pipeline)."""
        return self.precision == "half"

    @classmethod
    def of(cls, shift: bool | str, precision: str, fn: str = "Variant.of") -> Variant:
        """The variant of a user's ``shift`` (aliases included) and ``precision``."""
        if precision not in PRECISIONS:
            raise ValueError(f"{fn}: unknown precision={precision!r}; expected one of {PRECISIONS}")
        return cls(shift_mode(shift, fn), precision)


DEFAULT = Variant()
"""The op's default: the exact shift in hybrid precision."""

VARIANTS: dict[tuple[str, str], Variant] = {(shift, precision): Variant(shift, precision) for shift in SHIFT_MODES
                                            for precision in PRECISIONS if combination_problem(shift, precision) is None}
"""Every variant by ``(shift, precision)``, each checked once, here: the op looks its call's variant up after
checking its arguments at its entry, rather than building (and checking) one per call."""
