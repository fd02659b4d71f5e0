"""The kernel router: which kernel and which key pre-pass run a call, and why not the others.

:func:`plan` decides, :func:`forward` plans and runs; ``pasa_diffusers.ops`` calls :func:`forward` with
inputs it has checked.  The kernels (each in its file, with its launch wrapper and configs):

| kernel     | file          | runs                                                                      |
| ---------- | ------------- | ------------------------------------------------------------------------- |
| ``portable`` | ``portable.py`` | every variant, any CUDA GPU and the interpreter: FlashAttention-2's loop |
| ``packed`` | ``packed.py``   | the exact shift on short one-block sequences (temporal attention): several whole sequences per program, one pass |
| ``gluon``  | ``hopper.py``   | the exact shift in hybrid on sm_90, fp16/bf16, head dims 64 and 80-128, keys of several blocks (spatial attention): FA3's warp-specialised structure |
| ``int8``   | ``int8.py``     | the exact shift in 8 bits (``precision="int8"``, and only it): INT8 ``q k^T`` after its own quantizing pre-pass; the attention on the codes by ``hopper_int8.py`` (Gluon) on sm_90, else portable (``int8.attention_kernel``) |

and the key pre-passes (``prepass.py``): ``"centre"`` (the exact shift: each block's centre removed once
per head, for the portable kernel on keys of several blocks and for the Gluon kernel) and ``"shift"``
(PASA: the shifted keys once per head, for the portable kernel where several query blocks reuse them).

A call whose pre-pass would copy more than a fifth of the output's bytes (:data:`KEY_COPY_SHARE`) runs in
ranges of batch and kv head, one after the other (:func:`key_chunks`), so that its peak memory stays within
1.25x of cuDNN's, as long as each range keeps the GPU busy for much longer than the host takes to issue it
(:data:`MIN_RANGE_FLOP`); shorter calls run in one launch and allocate the whole copy.

``kernel="auto"`` takes the first of packed, gluon, portable that can run the call.  A kernel named
explicitly runs the call or raises ``ValueError`` saying why it cannot; so does ``prepass=True`` /
``False``, which forces the pre-pass on or off.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton

from .. import rules
from ..beta import shift_constants
from ..variants import KERNEL_PRECISIONS, Variant
from . import hopper, int8, packed, portable
from .common import INTERPRET
from .prepass import centre_keys, shift_keys
from .tuning import pow2_tile

__all__ = ["KERNELS", "KEY_COPY_SHARE", "MIN_RANGE_FLOP", "Plan", "plan", "forward", "key_chunks"]

KERNELS = ("auto", "portable", "packed", "gluon", "int8")
"""What ``kernel=`` takes: ``"auto"`` or one kernel by name."""

_ORDER = ("packed", "gluon", "portable")
"""``kernel="auto"``'s preference: the specialised kernels first."""

KEY_COPY_SHARE = 0.2
"""The key pre-pass's copy of the keys takes at most this share of the output's bytes: a call whose copy
would be larger runs its (batch, kv head) ranges one after the other (:func:`key_chunks`), each range's keys
prepared and attended before the next's.  With the range's centres (1/64 of its keys in fp32, and again in
the inputs' dtype) such a call allocates at most 1.25x what cuDNN does (its output and log-sum-exp)."""

MIN_RANGE_FLOP = 5e11
"""The least attention work (``4 Nq Nk D`` per query head) of one range: about 1 ms of the H200 at cuDNN's
rate, against the 0.25-0.35 ms the host takes to issue a range (its pre-pass, five TMA descriptors and two
launches; ``scripts/ab_key_ranges.py``).  A call runs in no more ranges than its work fills at this size:
shorter ranges would leave the GPU waiting on the host (SVD's 576-token spatial attention in five ranges
took 3.9x as long as in one launch)."""

PASA_PREPASS_ROWS = 128
"""PASA shifts its keys by the pre-pass when a head has more query rows than this (several query blocks
then reuse every shifted tile) or the head dim's tile is above 128 (an fp32 key tile of 128 x 256 does
not fit the registers)."""


@dataclass(frozen=True)
class Plan:
    """How one call runs.

    Attributes:
        kernel: ``"portable"``, ``"packed"`` or ``"gluon"``.
        prepass: ``"centre"``, ``"shift"``, ``"quantize"`` (the int8 kernel's: q, k, v to its codes) or ``None``
            (keys read as they are, shifted or centred inside the kernel).
        block_n: the shift block the kernels see (at most the keys' tile: up to ``block_n`` keys form one
            block of ``n_j = Nk`` keys whatever the tile); 0 for plain FlashAttention.
        one_block: all keys in one shift block.
        rejected: each kernel not chosen -> why, in words.
    """

    kernel: str
    prepass: str | None
    block_n: int
    one_block: bool
    rejected: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """One line: the kernel, its pre-pass and why not the others."""
        keys = f" + {self.prepass} pre-pass" if self.prepass else ""
        others = "; ".join(f"not {name}: {why}" for name, why in self.rejected.items())
        return f"{self.kernel}{keys}" + (f" ({others})" if others else "")


def _exact_reasons(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, precision: str,
                   block_n: int, one_block: bool, kernel: str, use_prepass: bool | None,
                   config: dict | None) -> tuple[dict[str, str | None], bool]:
    """Why each kernel cannot run an exact-shift call (``None`` where it can), and whether the portable
    kernel would read pre-centred keys."""
    n_q, n_k = q.shape[2], k.shape[2]
    centred_first = not one_block if use_prepass is None else use_prepass
    reasons: dict[str, str | None] = {}
    if not (one_block and packed.packs(n_q, n_k)):
        reasons["packed"] = (f"it takes sequences of at most {packed.MAX_TOKENS} queries and keys in one key block; "
                             f"got {n_q} queries and {n_k} keys (block_n={block_n})")
    elif use_prepass:
        reasons["packed"] = "prepass=True: it centres each sequence's keys itself"
    else:
        reasons["packed"] = None
    if not centred_first:
        reasons["gluon"] = "all keys form one block, centred inside the kernel (no pre-pass)"
    elif kernel == "auto" and config is not None:
        reasons["gluon"] = "a config tunes the portable kernel"
    elif INTERPRET:
        reasons["gluon"] = "Triton's interpreter runs no Gluon"
    else:
        reasons["gluon"] = hopper.unsuitable_reason(q, v, out, precision=precision, block_n=block_n)
    if use_prepass is False and not one_block:
        reasons["portable"] = (f"prepass=False: it centres keys inside the loop only when all {n_k} keys form one "
                               f"block of at most {block_n}")
    else:
        reasons["portable"] = None
    return reasons, centred_first


def _int8_plan(fn: str, q: torch.Tensor, k: torch.Tensor, precision: str, block_n: int | None, kernel: str,
               prepass: bool | None) -> Plan:
    """The plan of a call to the int8 kernel: ``precision="int8"`` runs it, and nothing else does."""
    if precision != "int8":
        raise ValueError(f"{fn}: kernel='int8' runs precision='int8' only, got precision={precision!r}")
    if kernel not in ("auto", "int8"):
        raise ValueError(f"{fn}: kernel={kernel!r} has no 8-bit path; precision='int8' runs kernel='int8'")
    if block_n is not None and int(block_n) != rules.SHIFT_BLOCK:
        raise ValueError(f"{fn}: precision='int8' centres blocks of {rules.SHIFT_BLOCK} keys, got block_n={block_n}")
    if prepass is False:
        raise ValueError(f"{fn}: prepass=False: the int8 kernel reads only its pre-pass's codes")
    why = "precision='int8' runs the int8 kernel"
    return Plan("int8", "quantize", rules.SHIFT_BLOCK, k.shape[2] <= rules.SHIFT_BLOCK,
                {name: why for name in _ORDER})


def plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *, variant: Variant,
         block_n: int | None = None, kernel: str = "auto", prepass: bool | None = None,
         config: dict | None = None) -> Plan:
    """The plan of ``forward`` for these arguments (see :func:`forward`); ``ValueError`` naming the argument
    for a kernel, pre-pass or ``block_n`` that cannot serve the call."""
    fn = "dispatch.plan"
    if kernel not in KERNELS:
        raise ValueError(f"{fn}: unknown kernel={kernel!r}; expected one of {KERNELS}")
    if prepass not in (None, True, False):
        raise ValueError(f"{fn}: prepass must be None (auto), True or False, got prepass={prepass!r}")
    shift, precision = variant.shift, variant.precision
    if precision not in KERNEL_PRECISIONS:
        raise ValueError(f"{fn}: precision={precision!r} has no kernel; expected one of {KERNEL_PRECISIONS}")
    if precision == "int8" or kernel == "int8":
        return _int8_plan(fn, q, k, precision, block_n, kernel, prepass)
    if shift != "exact" and kernel in ("packed", "gluon"):
        raise ValueError(f"{fn}: kernel={kernel!r} is the exact shift's; got shift={shift!r}")
    if shift == "none":
        if block_n is not None:
            raise ValueError(f"{fn}: block_n is the shift block; it needs shift='exact' or 'pasa', got shift='none'")
        if prepass:
            raise ValueError(f"{fn}: prepass=True: plain FlashAttention (shift='none') has no key pre-pass")
        exact_only = "it runs the exact shift only"
        return Plan("portable", None, 0, False, {"packed": exact_only, "gluon": exact_only})
    n_k = k.shape[2]
    block_n = min(rules.SHIFT_BLOCK if block_n is None else int(block_n), pow2_tile(n_k))
    one_block = n_k <= block_n
    if shift == "pasa":
        if prepass is None:
            prepass = q.shape[2] > PASA_PREPASS_ROWS or pow2_tile(q.shape[-1]) > 128
        exact_only = "it runs the exact shift only"
        return Plan("portable", "shift" if prepass else None, block_n, one_block,
                    {"packed": exact_only, "gluon": exact_only})
    reasons, centred_first = _exact_reasons(q, k, v, out, precision, block_n, one_block, kernel, prepass, config)
    if kernel == "auto":
        runnable = [name for name in _ORDER if reasons[name] is None]
        if not runnable:
            raise ValueError(f"{fn}: no kernel can run this call: " +
                             "; ".join(f"{name}: {reasons[name]}" for name in _ORDER))
        chosen = runnable[0]
    elif reasons[kernel] is not None:
        raise ValueError(f"{fn}: kernel={kernel!r} cannot run this call: {reasons[kernel]}")
    else:
        chosen = kernel
    rejected = {name: reasons[name] or (f"the {chosen} kernel comes first" if kernel == "auto"
                                        else f"kernel={kernel!r} was asked for")
                for name in _ORDER if name != chosen}
    uses_prepass = chosen == "gluon" or (chosen == "portable" and centred_first)
    return Plan(chosen, "centre" if uses_prepass else None, block_n, one_block, rejected)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *, scale: float,
            variant: Variant, beta: float, block_n: int | None = None, kernel: str = "auto",
            prepass: bool | None = None, config: dict | None = None, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Write ``softmax(scale q k^T) v`` of ``variant`` into ``out`` (and, given ``lse``, each row's
    log-sum-exp into it) and return ``out``.

    Args (checked by the caller, ``ops.pasa_attention``; here they are taken as they come):
        q: ``(B, Hq, Nq, D)``; k, v: ``(B, Hk, Nk, D)`` with ``Hq % Hk == 0``; out: ``(B, Hq, Nq, D)``,
            ``q``'s dtype; CUDA tensors (CPU ones under ``TRITON_INTERPRET=1``), any strides with unit
            stride in the head dim.
        scale: softmax scale; variant: a kernel precision (``"hybrid"``, ``"half"``) and any shift.
        beta: PASA's shift strength in (0, 1) (unused by the other shifts).
        block_n: the shift block (default ``rules.SHIFT_BLOCK`` = 128, as the reference); changes the result.
        kernel: ``"auto"``, ``"portable"``, ``"packed"`` or ``"gluon"`` (module docstring).
        prepass: ``None`` (auto: the exact shift centres keys of several blocks by the pre-pass, PASA
            shifts them by the pre-pass above ``PASA_PREPASS_ROWS`` query rows), ``True`` or ``False``.
        config: fixed meta-parameters of the chosen kernel instead of autotuning (``portable.forward``,
            ``packed.forward``, ``hopper.forward``); with ``kernel="auto"`` it keeps the call off the Gluon
            kernel.
        lse: ``None`` (the default: nothing more is computed or stored), or a contiguous float32
            ``(B, Hq, Nq)`` tensor on ``q``'s device that receives ``logsumexp(scale q k^T)`` per query row
            (natural log, of the true logits whatever the variant: ``reference.py``'s module docstring);
            every kernel stores it from its own softmax state.  Checked here (a wrong buffer would be
            written out of bounds).
    """
    chosen = plan(q, k, v, out, variant=variant, block_n=block_n, kernel=kernel, prepass=prepass, config=config)
    if lse is not None:
        _check_lse(q, lse)
    shift, precision = variant.shift, variant.precision
    if chosen.kernel == "int8":
        return int8.forward(q, k, v, out, scale=scale, config=config, lse=lse)
    if chosen.kernel == "packed":
        return packed.forward(q, k, v, out, scale=scale, precision=precision, config=config, lse=lse)
    constants = portable.NO_SHIFT
    if shift == "pasa":
        constants = shift_constants(float(beta), k.shape[2], chosen.block_n, q.dtype, float(scale))
    group = q.shape[1] // k.shape[1]
    whole = [((0, k.shape[0]), (0, k.shape[1]))]
    for (b0, b1), (h0, h1) in key_chunks(k, out) if chosen.prepass else whole:
        hq = slice(h0 * group, h1 * group)
        _attend(q[b0:b1, hq], k[b0:b1, h0:h1], v[b0:b1, h0:h1], out[b0:b1, hq],
                None if lse is None else lse[b0:b1, hq], chosen, scale=scale, shift=shift, precision=precision,
                constants=constants, config=config)
    return out


def key_chunks(k: torch.Tensor, out: torch.Tensor) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The ``((b0, b1), (h0, h1))`` ranges of batch and kv head that a call with a key pre-pass runs one
    after the other: the fewest that keep the pre-pass's copy of one range's keys within
    :data:`KEY_COPY_SHARE` of ``out``'s bytes, but no more than the call's work fills at
    :data:`MIN_RANGE_FLOP` each (one range of whole batches, or one of heads within a batch element, at
    least one head; ranges of one kind have equal sizes but the last, and ranges of heads are counted per
    batch element, which can add a range to each)."""
    batch, h_k = k.shape[:2]
    heads = batch * h_k
    fit = max(1, int(KEY_COPY_SHARE * out.numel() * out.element_size() * heads // (k.numel() * k.element_size())))
    work = 4.0 * out.shape[2] * k.shape[2] * k.shape[3] * out.shape[1] * batch
    ranges = max(1, min(triton.cdiv(heads, fit), int(work // MIN_RANGE_FLOP)))
    if ranges == 1:
        return [((0, batch), (0, h_k))]
    most = triton.cdiv(heads, ranges)
    if most >= h_k:
        step = _even_step(batch, most // h_k)
        return [((b, min(b + step, batch)), (0, h_k)) for b in range(0, batch, step)]
    step = _even_step(h_k, most)
    return [((b, b + 1), (h, min(h + step, h_k))) for b in range(batch) for h in range(0, h_k, step)]


def _even_step(total: int, most: int) -> int:
    """The size of each of the fewest near-equal ranges of at most ``most`` that cover ``total``."""
    ranges = triton.cdiv(total, most)
    return triton.cdiv(total, ranges)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
            chosen: Plan, *, scale: float, shift: str, precision: str, constants: tuple, config: dict | None) -> None:
    """``chosen``'s pre-pass (if any) and its kernel on one range of batch and heads."""
    keys, centres = k, None
    if chosen.prepass == "centre":
        keys, centres = centre_keys(k, block_n=chosen.block_n, exact=precision == "hybrid")
    elif chosen.prepass == "shift":
        keys = shift_keys(k, block_n=chosen.block_n, a_full=constants[0], c_full=constants[1], a_tail=constants[2],
                          c_tail=constants[3])
    if chosen.kernel == "gluon":
        hopper.forward(q, keys, v, centres, out, scale=scale, config=config, lse=lse)
    else:
        portable.forward(q, keys, v, out, scale=scale, shift=shift, precision=precision, block_n=chosen.block_n,
                         one_block=chosen.one_block, keys_prepared=chosen.prepass is not None, centres=centres,
                         shift_constants=constants, config=config, lse=lse)


def _check_lse(q: torch.Tensor, lse: torch.Tensor) -> None:
    """``lse`` must be the contiguous float32 ``(B, Hq, Nq)`` buffer the kernels store into."""
    shape = tuple(q.shape[:3])
    if not (isinstance(lse, torch.Tensor) and tuple(lse.shape) == shape and lse.dtype == torch.float32
            and lse.device == q.device and lse.is_contiguous()):
        got = (f"lse.shape={tuple(lse.shape)} {lse.dtype} {lse.device}, contiguous={lse.is_contiguous()}"
               if isinstance(lse, torch.Tensor) else type(lse).__name__)
        raise ValueError(f"dispatch.forward: lse must be a contiguous float32 tensor of shape (B, Hq, Nq)={shape} "
                         f"on {q.device}, got {got}")
