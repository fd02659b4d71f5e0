"""The kernel router: which kernel and which pre-pass run a call, and why not the others.

:func:`plan` decides, :func:`forward` plans and runs; ``pasa_diffusers.ops`` calls :func:`forward` with
inputs it has checked.  The plan is the one place that decides which kernel runs a call and why the others
do not (its ``rejected`` reasons); a kernel file only says what it cannot take (``unsuitable_reason``).
The kernels (each in its file, with its launch wrapper and configs):

| kernel            | file             | runs                                                            |
| ----------------- | ---------------- | --------------------------------------------------------------- |
| ``portable``      | ``portable.py``  | every 16-bit variant, any CUDA GPU and the interpreter: FlashAttention-2's loop |
| ``packed``        | ``packed.py``    | the exact shift on short one-block sequences (temporal attention): several whole sequences per program |
| ``gluon``         | ``hopper.py``    | the exact shift in hybrid on sm_90, fp16/bf16, head dims 64 and 80-128, keys of several blocks: FA3's structure |
| ``gluon-int8``    | ``hopper_int8.py`` | the 8-bit precisions on sm_90: the 8-bit codes in ``hopper.py``'s structure |
| ``portable-int8`` | ``int8.py``      | the 8-bit precisions on any CUDA GPU with INT8 ``tl.dot`` and the interpreter |

The 8-bit precisions (``variants.EIGHT_BIT``) share their kernels: ``precision="int8"`` runs them with ``P V`` in
16 bits (``pv_bits=16``), ``precision="fp8"`` with ``P`` and ``V`` in FP8 e4m3 (``pv_bits=8``).

and the pre-passes: ``"centre"`` (``prepass.py``; the exact shift: each block's centre removed once per
head, for the portable kernel on keys of several blocks and for the Gluon kernel), ``"shift"`` (PASA: the
shifted keys once per head, for the portable kernel where several query blocks reuse them) and
``"quantize"`` (``int8.prepare``: q, k, v to the 8-bit codes, which both 8-bit kernels read).

A call whose key pre-pass would copy more than a fifth of the output's bytes (:data:`KEY_COPY_SHARE`) runs
in ranges of batch and kv head, one after the other (:func:`key_chunks`), so that its peak memory stays
within 1.25x of cuDNN's, as long as each range keeps the GPU busy for much longer than the host takes to
issue it (:data:`MIN_RANGE_FLOP`); shorter calls run in one launch and allocate the whole copy.

``kernel="auto"`` takes the first of packed, gluon, portable (the 16-bit precisions) or of gluon-int8,
portable-int8 (the 8-bit precisions) that can run the call.  A kernel named explicitly runs the call or
raises ``ValueError`` saying why it cannot; so does ``prepass=True`` / ``False``, which forces the
pre-pass on or off.  Plans are kept per call signature (:func:`plan`): a repeated call pays a dictionary
look-up, not the routing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import block_tally
from ..shift_matrix import shift_constants
from ..rules import SHIFT_BLOCK
from ..variants import KERNEL_PRECISIONS, Variant, eight_bit
from ..variants import pv_bits as precision_pv_bits
from . import hopper, hopper_int8, int8, packed, portable
from .common import INTERPRET, cdiv
from .prepass import centre_keys, shift_keys
from .tuning import pow2_tile

__all__ = ["KERNELS", "INT8_KERNELS", "KEY_COPY_SHARE", "MIN_RANGE_FLOP", "INT8_GLUON_MIN_KEYS", "FP8_MIN_CAPABILITY",
           "Plan", "plan", "forward", "key_chunks", "forget_plans", "fp8_problem"]

KERNELS = ("auto", "portable", "packed", "gluon", "gluon-int8", "portable-int8")
"""What ``kernel=`` takes: ``"auto"`` or one kernel by name."""

_ORDER = ("packed", "gluon", "portable")
"""``kernel="auto"``'s preference for the 16-bit precisions: the specialised kernels first."""

INT8_KERNELS = ("gluon-int8", "portable-int8")
"""The kernels of the 8-bit precisions (``"int8"``, ``"fp8"``), in ``kernel="auto"``'s preference."""

FP8_MIN_CAPABILITY = (8, 9)
"""The least CUDA compute capability with FP8 e4m3 tensor cores (Ada, Hopper and later): ``P V`` in 8 bits
(``precision="fp8"``, or ``pv_bits=8``) needs it."""

INT8_GLUON_MIN_KEYS = 256
"""``kernel="auto"`` attends on the 8-bit codes with the portable kernel below this many keys, where it is
the faster one on the H200 (``bench.int8_fallback``; docs/notes/int8_kernel.md has the numbers)."""

KEY_COPY_SHARE = 0.2
"""The key pre-pass's copy of the keys takes at most this share of the output's bytes: a call whose copy
would be larger runs its (batch, kv head) ranges one after the other (:func:`key_chunks`), each range's keys
prepared and attended before the next's.  With the range's centres (1/64 of its keys, in fp32 for the portable
kernel or in the inputs' dtype for the Gluon one) such a call allocates at most 1.25x what cuDNN does (its
output and log-sum-exp)."""

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

PLAN_CACHE_SIZE = 4096
"""The most call signatures whose plans are kept (the cache is emptied when full)."""

@dataclass(frozen=True)
class Plan:
    """How one call runs.

    Attributes:
        kernel: one of :data:`KERNELS` but ``"auto"``.
        prepass: ``"centre"``, ``"shift"``, ``"quantize"`` (the 8-bit kernels': q, k, v to their codes) or
            ``None`` (keys read as they are, shifted or centred inside the kernel).
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


def _int8_reasons(q: torch.Tensor, v: torch.Tensor, out: torch.Tensor, kernel: str, config: dict | None,
                  pv_bits: int) -> dict[str, str | None]:
    """Why each 8-bit kernel cannot run a call (``None`` where it can); ``kernel="auto"`` also leaves the Gluon
    one for a given config (a config names one kernel's tiles) and for fewer than :data:`INT8_GLUON_MIN_KEYS`
    keys."""
    if INTERPRET:
        gluon = "Triton's interpreter runs no Gluon"
    else:
        gluon = hopper_int8.unsuitable_reason(q, v, out, pv_bits=pv_bits)
    if gluon is None and kernel == "auto":
        if config is not None:
            gluon = "a config tunes the portable-int8 kernel"
        elif v.shape[2] < INT8_GLUON_MIN_KEYS:
            gluon = (f"below {INT8_GLUON_MIN_KEYS} keys the portable-int8 kernel is the faster one, got "
                     f"{v.shape[2]} keys")
    return {"gluon-int8": gluon, "portable-int8": None}


def _choose(fn: str, reasons: dict[str, str | None], order: tuple[str, ...], kernel: str) -> tuple[str, dict]:
    """The kernel that runs (``kernel``, or under ``"auto"`` the first of ``order`` without a reason) and each
    other kernel of ``order`` -> why not; ``ValueError`` when none (or the one asked for) can run the call."""
    if kernel == "auto":
        runnable = [name for name in order if reasons[name] is None]
        if not runnable:
            raise ValueError(f"{fn}: no kernel can run this call: " +
                             "; ".join(f"{name}: {reasons[name]}" for name in order))
        chosen = runnable[0]
    elif reasons[kernel] is not None:
        raise ValueError(f"{fn}: kernel={kernel!r} cannot run this call: {reasons[kernel]}")
    else:
        chosen = kernel
    rejected = {name: reasons[name] or (f"the {chosen} kernel comes first" if kernel == "auto"
                                        else f"kernel={kernel!r} was asked for")
                for name in order if name != chosen}
    return chosen, rejected


def _eight_bit_pv_bits(fn: str, precision: str, pv_bits: int | None) -> int:
    """The ``pv_bits`` an 8-bit call runs: its precision's (16 for ``"int8"``, 8 for ``"fp8"``) when ``None``;
    ``"int8"`` also takes 8 (``P V`` in FP8 on its codes: the tests' and scripts' direct use); ``"fp8"`` takes
    nothing but 8."""
    own = precision_pv_bits(precision)
    if pv_bits is None:
        return own
    if pv_bits not in int8.PV_BITS:
        raise ValueError(f"{fn}: unknown pv_bits={pv_bits!r}; expected one of {int8.PV_BITS}")
    if precision == "fp8" and pv_bits != own:
        raise ValueError(f"{fn}: precision='fp8' computes P V in FP8 e4m3 (pv_bits=8), got pv_bits={pv_bits!r}; "
                         "for P V in 16 bits use precision='int8'")
    return pv_bits


def fp8_problem(device: torch.device) -> str | None:
    """Why ``P V`` in FP8 cannot run on ``device``, or ``None``: a CUDA GPU below :data:`FP8_MIN_CAPABILITY` has
    no FP8 tensor cores (the interpreter on the CPU emulates them)."""
    if device.type != "cuda":
        return None
    capability = tuple(torch.cuda.get_device_capability(device))
    if capability >= FP8_MIN_CAPABILITY:
        return None
    need = "sm_{}{}".format(*FP8_MIN_CAPABILITY)
    return (f"P V in FP8 e4m3 needs FP8 tensor cores ({need} or later); {torch.cuda.get_device_name(device)} is "
            f"sm_{capability[0]}{capability[1]}")


def _int8_plan(fn: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, precision: str,
               block_n: int | None, kernel: str, prepass: bool | None, config: dict | None,
               pv_bits: int | None) -> Plan:
    """The plan of an 8-bit call (``precision="int8"`` or ``"fp8"``): one of :data:`INT8_KERNELS` after the
    quantizing pre-pass, ``P V`` in the bits :func:`_eight_bit_pv_bits` says."""
    if kernel in _ORDER:
        raise ValueError(f"{fn}: kernel={kernel!r} has no 8-bit path; precision={precision!r} runs one of "
                         f"{INT8_KERNELS}")
    bits = _eight_bit_pv_bits(fn, precision, pv_bits)
    if bits == 8 and (problem := fp8_problem(q.device)):
        asked, instead = (("precision='int8', pv_bits=8", "pv_bits=16") if precision == "int8"
                          else ("precision='fp8'", "precision='int8' (P V in 16 bits)"))
        raise ValueError(f"{fn}: {asked}: {problem}; use {instead}")
    if block_n is not None and int(block_n) != SHIFT_BLOCK:
        raise ValueError(f"{fn}: precision={precision!r} centres blocks of {SHIFT_BLOCK} keys, got block_n={block_n}")
    if prepass is False:
        raise ValueError(f"{fn}: prepass=False: the 8-bit kernels read only their pre-pass's codes")
    chosen, rejected = _choose(fn, _int8_reasons(q, v, out, kernel, config, bits), INT8_KERNELS, kernel)
    sixteen_bits = f"it runs the 16-bit precisions, not precision={precision!r}"
    return Plan(chosen, "quantize", SHIFT_BLOCK, k.shape[2] <= SHIFT_BLOCK,
                {**rejected, **{name: sixteen_bits for name in _ORDER}}, bits)


def _plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, variant: Variant,
          block_n: int | None, kernel: str, prepass: bool | None, config: dict | None, pv_bits: int | None,
          fallback: bool) -> Plan:
    """:func:`plan` without the cache."""
    fn = "dispatch.plan"
    if kernel not in KERNELS:
        raise ValueError(f"{fn}: unknown kernel={kernel!r}; expected one of {KERNELS}")
    if prepass not in (None, True, False):
        raise ValueError(f"{fn}: prepass must be None (auto), True or False, got prepass={prepass!r}")
    shift, precision = variant.shift, variant.precision
    if precision not in KERNEL_PRECISIONS:
        raise ValueError(f"{fn}: precision={precision!r} has no kernel; expected one of {KERNEL_PRECISIONS}")
    if eight_bit(precision):
        return _int8_plan(fn, q, k, v, out, precision, block_n, kernel, prepass, config, pv_bits)
    if kernel in INT8_KERNELS:
        raise ValueError(f"{fn}: kernel={kernel!r} runs the 8-bit precisions ('int8', 'fp8') only, got "
                         f"precision={precision!r}")
    if pv_bits not in (None, 16) or fallback is not True:
        raise ValueError(f"{fn}: pv_bits and fallback are the 8-bit kernels' options (precision='int8' or 'fp8'), "
                         f"got pv_bits={pv_bits!r}, fallback={fallback!r} with precision={precision!r}")
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
    block_n = min(SHIFT_BLOCK if block_n is None else int(block_n), pow2_tile(n_k))
    one_block = n_k <= block_n
    if shift == "pasa":
        if prepass is None:
            prepass = q.shape[2] > PASA_PREPASS_ROWS or pow2_tile(q.shape[-1]) > 128
        exact_only = "it runs the exact shift only"
        return Plan("portable", "shift" if prepass else None, block_n, one_block,
                    {"packed": exact_only, "gluon": exact_only})
    reasons, centred_first = _exact_reasons(q, k, v, out, precision, block_n, one_block, kernel, prepass, config)
    chosen, rejected = _choose(fn, reasons, _ORDER, kernel)
    uses_prepass = chosen == "gluon" or (chosen == "portable" and centred_first)
    return Plan(chosen, "centre" if uses_prepass else None, block_n, one_block, rejected)


_PLANS: dict[tuple, Plan] = {}


def _signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, options: tuple) -> tuple:
    """What a plan depends on: the shapes, strides, dtype and device of the tensors, the 16-byte alignment of
    those a TMA descriptor addresses (q, v, out), and the call's options.  (Under the op's checks k and v
    share (B, H, N), out has q's shape and every tensor q's dtype and device.)"""
    return (q.shape, q.stride(), k.shape, k.stride(), v.stride(), out.stride(), q.dtype, q.device,
            q.data_ptr() & 15, v.data_ptr() & 15, out.data_ptr() & 15, options)


def plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *, variant: Variant,
         block_n: int | None = None, kernel: str = "auto", prepass: bool | None = None,
         config: dict | None = None, pv_bits: int | None = None, fallback: bool = True) -> Plan:
    """The plan of ``forward`` for these arguments (see :func:`forward`); ``ValueError`` naming the argument
    for a kernel, pre-pass, ``block_n`` or 8-bit option that cannot serve the call.

    Plans are kept per call signature (:func:`_signature`: everything the routing reads), so a repeated call
    returns the same ``Plan`` object without routing again; :func:`forget_plans` empties the cache (a test
    that changes what a kernel can take, or the GPU, between calls)."""
    try:
        config_key = None if config is None else tuple(sorted(config.items()))
        key = _signature(q, k, v, out, (variant, block_n, kernel, prepass, config_key, pv_bits, fallback))
        found = _PLANS.get(key)
    except TypeError:  # an unhashable option value: planned, not kept
        return _plan(q, k, v, out, variant, block_n, kernel, prepass, config, pv_bits, fallback)
    if found is None:
        found = _plan(q, k, v, out, variant, block_n, kernel, prepass, config, pv_bits, fallback)
        if len(_PLANS) >= PLAN_CACHE_SIZE:
            _PLANS.clear()
        _PLANS[key] = found
    return found


def forget_plans() -> None:
    """Empty the plan cache (and the kept key ranges): the next call of each signature is routed again."""
    _PLANS.clear()
    _RANGES.clear()


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *, scale: float,
            variant: Variant, beta: float, block_n: int | None = None, kernel: str = "auto",
            prepass: bool | None = None, config: dict | None = None, lse: torch.Tensor | None = None,
            pv_bits: int | None = None, fallback: bool = True) -> torch.Tensor:
    """Write ``softmax(scale q k^T) v`` of ``variant`` into ``out`` (and, given ``lse``, each row's
    log-sum-exp into it) and return ``out``.

    Args (checked by the caller, ``ops.pasa_attention``; here they are taken as they come):
        q: ``(B, Hq, Nq, D)``; k, v: ``(B, Hk, Nk, D)`` with ``Hq % Hk == 0``; out: ``(B, Hq, Nq, D)``,
            ``q``'s dtype; CUDA tensors (CPU ones under ``TRITON_INTERPRET=1``), any strides with unit
            stride in the head dim.
        scale: softmax scale; variant: a kernel precision (``"hybrid"``, ``"half"``, ``"int8"``, ``"fp8"``) and
            a shift (``"int8"``, ``"fp8"``: the exact shift only).
        beta: PASA's shift strength in (0, 1) (unused by the other shifts).
        block_n: the shift block (default ``rules.SHIFT_BLOCK`` = 128, as the reference); changes the result.
        kernel: ``"auto"`` or one of :data:`KERNELS` (module docstring).
        prepass: ``None`` (auto: the exact shift centres keys of several blocks by the pre-pass, PASA
            shifts them by the pre-pass above ``PASA_PREPASS_ROWS`` query rows), ``True`` or ``False``.
        config: fixed meta-parameters of the chosen kernel instead of autotuning (``portable.forward``,
            ``packed.forward``, ``hopper.forward``, ``int8.attend``, ``hopper_int8.forward``); with
            ``kernel="auto"`` it keeps the call off the Gluon kernels.
        lse: ``None`` (the default: nothing more is computed or stored), or a contiguous float32
            ``(B, Hq, Nq)`` tensor on ``q``'s device that receives ``logsumexp(scale q k^T)`` per query row
            (natural log, of the true logits whatever the variant: ``reference.py``'s module docstring);
            every kernel stores it from its own softmax state.  Checked here (a wrong buffer would be
            written out of bounds).
        pv_bits, fallback: the 8-bit precisions only.  ``pv_bits``: ``None`` (the default) for the precision's
            own (16 for ``"int8"``: ``P V`` in the inputs' dtype; 8 for ``"fp8"``: FP8 e4m3, sm_89+), or 16 / 8
            explicitly (``"int8"`` takes either, ``"fp8"`` only 8: ``ValueError`` naming both otherwise).
            ``fallback``: the key blocks whose codes cannot hold their range computed in 16 bits and counted
            in ``block_tally`` (``True``, the default) or every block from the codes.
    """
    chosen = plan(q, k, v, out, variant=variant, block_n=block_n, kernel=kernel, prepass=prepass, config=config,
                  pv_bits=pv_bits, fallback=fallback)
    if lse is not None:
        _check_lse(q, lse)
    if chosen.prepass == "quantize":
        if out.numel() == 0:
            return out
        gluon = chosen.kernel == "gluon-int8"
        prep = int8.prepare(q, k, v, scale=scale, pv_bits=chosen.pv_bits, fallback=fallback, split=gluon and fallback,
                            tally=block_tally.counter(q.device) if fallback else None)
        if gluon:
            return hopper_int8.forward(q, prep, out, scale=scale, config=config, lse=lse)
        return int8.attend(q, prep, out, scale=scale, config=config, lse=lse)
    shift, precision = variant.shift, variant.precision
    if chosen.kernel == "packed":
        return packed.forward(q, k, v, out, scale=scale, precision=precision, config=config, lse=lse)
    constants = portable.NO_SHIFT
    if shift == "pasa":
        constants = shift_constants(float(beta), k.shape[2], chosen.block_n, q.dtype, float(scale))
    ranges = _key_ranges(k, out) if chosen.prepass else ()
    if len(ranges) <= 1:  # one launch over the whole call: the tensors as they are, no views
        _attend(q, k, v, out, lse, chosen, scale=scale, shift=shift, precision=precision, constants=constants,
                config=config)
        return out
    group = q.shape[1] // k.shape[1]
    for (b0, b1), (h0, h1) in ranges:
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
    ranges = max(1, min(cdiv(heads, fit), int(work // MIN_RANGE_FLOP)))
    if ranges == 1:
        return [((0, batch), (0, h_k))]
    most = cdiv(heads, ranges)
    if most >= h_k:
        step = _even_step(batch, most // h_k)
        return [((b, min(b + step, batch)), (0, h_k)) for b in range(0, batch, step)]
    step = _even_step(h_k, most)
    return [((b, b + 1), (h, min(h + step, h_k))) for b in range(batch) for h in range(0, h_k, step)]


_RANGES: dict[tuple, list] = {}


def _key_ranges(k: torch.Tensor, out: torch.Tensor) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """:func:`key_chunks`, kept per what it reads (the shapes and dtypes of ``k`` and ``out``, and the two
    module constants it is ruled by, which a test or a script may change)."""
    key = (k.shape, k.dtype, out.shape, out.dtype, KEY_COPY_SHARE, MIN_RANGE_FLOP)
    found = _RANGES.get(key)
    if found is None:
        if len(_RANGES) >= PLAN_CACHE_SIZE:
            _RANGES.clear()
        found = _RANGES[key] = key_chunks(k, out)
    return found


def _even_step(total: int, most: int) -> int:
    """The size of each of the fewest near-equal ranges of at most ``most`` that cover ``total``."""
    ranges = cdiv(total, most)
    return cdiv(total, ranges)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
            chosen: Plan, *, scale: float, shift: str, precision: str, constants: tuple, config: dict | None) -> None:
    """``chosen``'s pre-pass (if any) and its kernel on one range of batch and heads."""
    keys, centres = k, None
    if chosen.prepass == "centre":
        keys, centres = centre_keys(k, block_n=chosen.block_n, exact=precision == "hybrid",
                                    centres_dtype=k.dtype if chosen.kernel == "gluon" else torch.float32)
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
