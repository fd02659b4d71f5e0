"""The kernel router: which kernel and which pre-pass run a call, and why not the others.

:func:`plan` decides, :func:`forward` plans and runs; ``pasa_diffusers.ops`` calls :func:`forward` with
inputs it has checked.  The plan is the one place that decides which kernel runs a call and why the others
do not (its ``rejected`` reasons); a kernel file only says what it cannot take.  Each kernel file ends
with its entry (``ENTRY``, a ``call.Kernel``: its name, precisions, shifts, pre-pass, ``unsuitable(call)``
and ``launch(call, plan)``), and :data:`TABLE` lists them in ``kernel="auto"``'s preference:

| kernel            | file             | runs                                                            |
| ----------------- | ---------------- | --------------------------------------------------------------- |
| ``packed``        | ``packed.py``    | the exact shift on short one-block sequences (temporal attention): several whole sequences per program |
| ``gluon``         | ``hopper.py``    | the exact shift in hybrid on sm_90, fp16/bf16, head dims 64 and 80-128, keys of several blocks: FA3's structure |
| ``portable``      | ``portable.py``  | every 16-bit variant, any CUDA GPU and the interpreter: FlashAttention-2's loop |
| ``gluon-int8``    | ``hopper_int8.py`` | the 8-bit precisions on sm_90: the 8-bit codes in ``hopper.py``'s structure |
| ``portable-int8`` | ``int8.py``      | the 8-bit precisions on any CUDA GPU with INT8 ``tl.dot`` and the interpreter |

The 8-bit precisions (``variants.EIGHT_BIT``) share their kernels: ``precision="int8"`` runs them with ``P V`` in
16 bits (``pv_bits=16``), ``precision="fp8"`` with ``P`` and ``V`` in FP8 e4m3 (``pv_bits=8``).

and the pre-passes: ``"centre"`` (``prepass.py``; the exact shift: each block's centre removed once per
head, for the portable kernel on keys of several blocks and for the Gluon kernel), ``"shift"`` (PASA: the
shifted keys once per head, for the portable kernel where several query blocks reuse them) and
``"quantize"`` (``quantize.prepare``: q, k, v to the 8-bit codes, which both 8-bit kernels read); the router runs
the plan's pre-pass (:data:`PREPASS_RUNS`), then the entry's ``launch``.

A block-sparse mask (``block_mask``, a ``block_sparse.BlockSparseMask`` in ``call.Call.block_mask``) reaches the
kernels through the call: the portable kernels and both Gluon kernels visit only its kept key blocks; a kernel
that cannot (``packed``) says so in ``unsuitable`` ("it takes no block_mask yet"), so ``"auto"`` passes it over
and a request by name is refused.
Its blocks must be those the kernels walk (:func:`_check_mask_blocks`).

A call whose pre-pass would write more than a fifth of the output's bytes (:data:`PREPASS_SHARE`: the keys
centred or shifted), or two fifths (:data:`QUANTIZE_SHARE`: the 8-bit codes with their statistics), runs in ranges
of batch and kv head, one after the other (:func:`key_chunks`), so that its peak memory stays within 1.25x (16
bits) or 1.4x (8 bits) of cuDNN's, as long as each range keeps the GPU busy for much longer than the host takes
to issue it (:data:`MIN_RANGE_FLOP`, of the work a block mask keeps: ``BlockSparseMask.kept_share``); shorter
calls run in one launch and allocate the whole copy.

``kernel="auto"`` takes the first entry of :data:`TABLE` that runs the call's precision and shift and has no
reason against it (``unsuitable``).  A kernel named explicitly runs the call or
raises ``ValueError`` saying why it cannot; so does ``prepass=True`` / ``False``, which forces the
pre-pass on or off.  Plans are kept per call signature (:func:`plan`): a repeated call pays a dictionary
look-up, not the routing.
"""
from __future__ import annotations

import torch

from . import block_tally
from ..block_sparse import BlockSparseMask
from ..shift_matrix import shift_constants
from ..rules import MASK_QUERY_TILE, SHIFT_BLOCK
from ..variants import KERNEL_PRECISIONS, PV_BITS, Variant, eight_bit
from ..variants import pv_bits as precision_pv_bits
from . import hopper, hopper_int8, int8, packed, portable, quantize
from .call import COPYING_PREPASSES, Call, Kernel, Plan
from .common import cdiv
from .prepass import centre_keys, shift_keys
from .tuning import pow2_tile

__all__ = ["TABLE", "KERNELS", "INT8_KERNELS", "PREPASS_SHARE", "QUANTIZE_SHARE", "MIN_RANGE_FLOP",
           "FP8_MIN_CAPABILITY", "Plan", "plan", "forward", "key_chunks", "forget_plans", "fp8_problem",
           "kernel_names"]

TABLE: tuple[Kernel, ...] = (packed.ENTRY, hopper.ENTRY, portable.ENTRY, hopper_int8.ENTRY, int8.ENTRY)
"""Every kernel, one entry per kernel file, in ``kernel="auto"``'s preference: the specialised kernels first."""

_BY_NAME: dict[str, Kernel] = {entry.name: entry for entry in TABLE}


def kernel_names(precision: str | None = None) -> tuple[str, ...]:
    """The names of :data:`TABLE`'s kernels (those that run ``precision``, given one), in preference order."""
    return tuple(entry.name for entry in TABLE if precision is None or precision in entry.precisions)


KERNELS = ("auto",) + kernel_names()
"""What ``kernel=`` takes: ``"auto"`` or one kernel by name."""

INT8_KERNELS = tuple(entry.name for entry in TABLE if all(eight_bit(p) for p in entry.precisions))
"""The kernels of the 8-bit precisions (``"int8"``, ``"fp8"``), in ``kernel="auto"``'s preference."""

FP8_MIN_CAPABILITY = (8, 9)
"""The least CUDA compute capability with FP8 e4m3 tensor cores (Ada, Hopper and later): ``P V`` in 8 bits
(``precision="fp8"``, or ``pv_bits=8``) needs it."""

PREPASS_SHARE = 0.2
"""The pre-pass's writes take at most this share of the output's bytes: a call whose pre-pass would write more
runs its (batch, kv head) ranges one after the other (:func:`key_chunks`), each range prepared and attended
before the next's.  The centring and shifting pre-passes write a copy of the keys and their centres (1/64 of
the keys, in fp32 for the portable kernel or in the inputs' dtype for the Gluon one), so such a call allocates at
most 1.25x what cuDNN does (its output and log-sum-exp)."""

QUANTIZE_SHARE = 0.4
""":data:`PREPASS_SHARE` of the 8-bit pre-pass, which writes the codes of q and k and their statistics
(``quantize.written_bytes``: 1.1-1.2x the output with ``P V`` in 16 bits, 1.6-1.7x with V8 for FP8): such a call
allocates at most 1.4x what cuDNN does, issue 43's bound 1.5x.  Each range costs time (its pre-pass's launches
and the tail of its kernel: 0.15-0.26 ms on an H100, docs/notes/int8_kernel.md), so the share is the bound's,
not the copying pre-passes' fifth."""

MIN_RANGE_FLOP = 5e11
"""The least attention work (``4 Nq Nk D`` per query head) of one range: about 1 ms of the H200 at cuDNN's
rate, against the 0.25-0.35 ms the host takes to issue a range (its pre-pass, five TMA descriptors and two
launches; ``scripts/ab_key_ranges.py``).  A call runs in no more ranges than its work fills at this size:
shorter ranges would leave the GPU waiting on the host (SVD's 576-token spatial attention in five ranges
took 3.9x as long as in one launch)."""

PLAN_CACHE_SIZE = 4096
"""The most call signatures whose plans are kept (the cache is emptied when full)."""


def _variant_reason(entry: Kernel, precision: str, shift: str) -> str | None:
    """Why ``entry`` does not run this variant at all (its declared precisions and shifts), or ``None``."""
    if precision not in entry.precisions:
        if eight_bit(precision) != any(eight_bit(p) for p in entry.precisions):
            return f"it runs the {'16-bit' if eight_bit(precision) else '8-bit'} precisions, not precision={precision!r}"
        return f"it has the {' / '.join(entry.precisions)} precision only, got precision={precision!r}"
    if shift not in entry.shifts:
        return f"it runs the {' / '.join(entry.shifts)} shift only"
    return None


def _choose(fn: str, reasons: dict[str, str | None], kernel: str, precision: str) -> tuple[str, dict]:
    """The kernel that runs (``kernel``, or under ``"auto"`` the first of :data:`TABLE` without a reason) and
    every other kernel -> why not; ``ValueError`` when none (or the one asked for) can run the call."""
    if kernel == "auto":
        runnable = [name for name, why in reasons.items() if why is None]
        if not runnable:
            raise ValueError(f"{fn}: no kernel can run this call: " +
                             "; ".join(f"{name}: {reasons[name]}" for name in kernel_names(precision)))
        chosen = runnable[0]
    elif reasons[kernel] is not None:
        raise ValueError(f"{fn}: kernel={kernel!r} cannot run this call: {reasons[kernel]}")
    else:
        chosen = kernel
    rejected = {name: why or (f"the {chosen} kernel comes first" if kernel == "auto"
                              else f"kernel={kernel!r} was asked for")
                for name, why in reasons.items() if name != chosen}
    return chosen, rejected


def _eight_bit_pv_bits(fn: str, precision: str, pv_bits: int | None) -> int:
    """The ``pv_bits`` an 8-bit call runs: its precision's (16 for ``"int8"``, 8 for ``"fp8"``) when ``None``;
    ``"int8"`` also takes 8 (``P V`` in FP8 on its codes: the tests' and scripts' direct use); ``"fp8"`` takes
    nothing but 8."""
    own = precision_pv_bits(precision)
    if pv_bits is None:
        return own
    if pv_bits not in PV_BITS:
        raise ValueError(f"{fn}: unknown pv_bits={pv_bits!r}; expected one of {PV_BITS}")
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


def _resolve_eight_bit(fn: str, call: Call) -> None:
    """An 8-bit call's own checks (``pv_bits``, FP8 on this GPU, ``block_n``, ``prepass``), and its resolved
    facts into ``call``: blocks of ``SHIFT_BLOCK`` keys, ``P V`` in :func:`_eight_bit_pv_bits`'s bits."""
    precision, block_n = call.variant.precision, call.block_n
    bits = _eight_bit_pv_bits(fn, precision, call.pv_bits)
    if bits == 8 and (problem := fp8_problem(call.q.device)):
        asked, instead = (("precision='int8', pv_bits=8", "pv_bits=16") if precision == "int8"
                          else ("precision='fp8'", "precision='int8' (P V in 16 bits)"))
        raise ValueError(f"{fn}: {asked}: {problem}; use {instead}")
    if block_n is not None and int(block_n) != SHIFT_BLOCK:
        raise ValueError(f"{fn}: precision={precision!r} centres blocks of {SHIFT_BLOCK} keys, got block_n={block_n}")
    if call.prepass is False:
        raise ValueError(f"{fn}: prepass=False: the 8-bit kernels read only their pre-pass's codes")
    call.shift_block, call.one_block, call.bits = SHIFT_BLOCK, call.k.shape[2] <= SHIFT_BLOCK, bits


def _resolve_sixteen_bit(fn: str, call: Call) -> None:
    """A 16-bit call's own checks (no 8-bit options; plain FlashAttention has no shift block nor pre-pass),
    and its resolved facts into ``call``: the shift block at most the keys' tile."""
    shift, precision, block_n = call.variant.shift, call.variant.precision, call.block_n
    if call.pv_bits not in (None, 16) or call.fallback is not True:
        raise ValueError(f"{fn}: pv_bits and fallback are the 8-bit kernels' options (precision='int8' or 'fp8'), "
                         f"got pv_bits={call.pv_bits!r}, fallback={call.fallback!r} with precision={precision!r}")
    if shift == "none":
        if block_n is not None:
            raise ValueError(f"{fn}: block_n is the shift block; it needs shift='exact' or 'pasa', got shift='none'")
        if call.prepass:
            raise ValueError(f"{fn}: prepass=True: plain FlashAttention (shift='none') has no key pre-pass")
        call.shift_block, call.one_block, call.bits = 0, False, 16
        return
    n_k = call.k.shape[2]
    call.shift_block = min(SHIFT_BLOCK if block_n is None else int(block_n), pow2_tile(n_k))
    call.one_block, call.bits = n_k <= call.shift_block, 16


def _plan(call: Call) -> Plan:
    """:func:`plan` without the cache: the call's own checks, then :data:`TABLE` walked in order, each kernel
    asked whether it runs the variant (its ``precisions`` and ``shifts``) and the call (``unsuitable``)."""
    fn = "dispatch.plan"
    kernel = call.kernel
    if kernel not in KERNELS:
        raise ValueError(f"{fn}: unknown kernel={kernel!r}; expected one of {KERNELS}")
    if call.prepass not in (None, True, False):
        raise ValueError(f"{fn}: prepass must be None (auto), True or False, got prepass={call.prepass!r}")
    shift, precision = call.variant.shift, call.variant.precision
    if precision not in KERNEL_PRECISIONS:
        raise ValueError(f"{fn}: precision={precision!r} has no kernel; expected one of {KERNEL_PRECISIONS}")
    asked = None if kernel == "auto" else _BY_NAME[kernel]
    if asked is not None and precision not in asked.precisions:
        if eight_bit(precision) and not any(eight_bit(p) for p in asked.precisions):
            raise ValueError(f"{fn}: kernel={kernel!r} has no 8-bit path; precision={precision!r} runs one of "
                             f"{kernel_names(precision)}")
        runs = ("the 8-bit precisions ('int8', 'fp8')" if all(eight_bit(p) for p in asked.precisions)
                else f"the {' / '.join(asked.precisions)} precision")
        raise ValueError(f"{fn}: kernel={kernel!r} runs {runs} only, got precision={precision!r}")
    if eight_bit(precision):
        _resolve_eight_bit(fn, call)
    else:
        _resolve_sixteen_bit(fn, call)
    if asked is not None and shift not in asked.shifts:
        raise ValueError(f"{fn}: kernel={kernel!r} is the {' / '.join(asked.shifts)} shift's; got shift={shift!r}")
    if call.block_mask is not None:
        _check_mask_blocks(fn, call)
    reasons = {entry.name: _variant_reason(entry, precision, shift) or entry.unsuitable(call) for entry in TABLE}
    chosen, rejected = _choose(fn, reasons, kernel, precision)
    return Plan(chosen, _BY_NAME[chosen].prepass_of(call), call.shift_block, call.one_block, rejected, call.bits)


def _check_mask_blocks(fn: str, call: Call) -> None:
    """A block mask's blocks must be those the kernels walk: ``block_k`` the call's shift block as asked
    (``block_n``, default ``SHIFT_BLOCK``; the 8-bit kernels' centre block; plain FlashAttention's key tiles
    divide ``SHIFT_BLOCK``), and ``block_q`` a multiple of ``rules.MASK_QUERY_TILE``."""
    mask = call.block_mask
    key_block = SHIFT_BLOCK if call.block_n is None else int(call.block_n)
    if mask.block_k != key_block:
        raise ValueError(f"{fn}: block_mask.block_k={mask.block_k} must be the kernels' key block {key_block} "
                         f"(the shift block, block_n)")
    if mask.block_q % MASK_QUERY_TILE:
        raise ValueError(f"{fn}: block_mask.block_q={mask.block_q} must be a multiple of {MASK_QUERY_TILE} "
                         f"(the kernels' largest query tile)")


_PLANS: dict[tuple, Plan] = {}


def _signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, options: tuple) -> tuple:
    """What a plan depends on: the shapes, strides, dtype and device of the tensors, the 16-byte alignment of
    those a TMA descriptor addresses (q, v, out), and the call's options.  (Under the op's checks k and v
    share (B, H, N), out has q's shape and every tensor q's dtype and device.)"""
    return (q.shape, q.stride(), k.shape, k.stride(), v.stride(), out.stride(), q.dtype, q.device,
            q.data_ptr() & 15, v.data_ptr() & 15, out.data_ptr() & 15, options)


def plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *, variant: Variant,
         block_n: int | None = None, kernel: str = "auto", prepass: bool | None = None,
         config: dict | None = None, pv_bits: int | None = None, fallback: bool = True,
         block_mask: BlockSparseMask | None = None) -> Plan:
    """The plan of ``forward`` for these arguments (see :func:`forward`); ``ValueError`` naming the argument
    for a kernel, pre-pass, ``block_n``, 8-bit option or block mask that cannot serve the call.

    Plans are kept per call signature (:func:`_signature`: everything the routing reads), so a repeated call
    returns the same ``Plan`` object without routing again; :func:`forget_plans` empties the cache (a test
    that changes what a kernel can take, or the GPU, between calls)."""
    return _planned(Call(q, k, v, out, variant, block_n=block_n, kernel=kernel, prepass=prepass, config=config,
                         pv_bits=pv_bits, fallback=fallback, block_mask=block_mask))


def _planned(call: Call) -> Plan:
    """:func:`plan` of ``call``: from the cache, or routed and kept."""
    try:
        config = call.config
        config_key = None if config is None else tuple(sorted(config.items()))
        mask = call.block_mask
        mask_key = None if mask is None else (mask.block_q, mask.block_k)
        key = _signature(call.q, call.k, call.v, call.out, (call.variant, call.block_n, call.kernel, call.prepass,
                                                            config_key, call.pv_bits, call.fallback, mask_key))
        found = _PLANS.get(key)
    except TypeError:  # an unhashable option value: planned, not kept
        return _plan(call)
    if found is None:
        found = _plan(call)
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
            pv_bits: int | None = None, fallback: bool = True,
            block_mask: BlockSparseMask | None = None) -> torch.Tensor:
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
            shifts them by the pre-pass above ``portable.PASA_PREPASS_ROWS`` query rows), ``True`` or ``False``.
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
        block_mask: ``None`` (every key block), or a ``block_sparse.BlockSparseMask`` that fits the call
            (``check_call``, done by the op) with ``block_k`` the shift block and ``block_q`` a multiple of
            ``rules.MASK_QUERY_TILE``: the kernel visits only each query block's kept key blocks (the kernels that
            cannot say so in their ``unsuitable`` reason); a query block that keeps none gives zeros and, with
            ``lse``, ``-inf``.
    """
    call = Call(q, k, v, out, variant, scale, beta, block_n, kernel, prepass, config, lse, pv_bits, fallback,
                block_mask, keys=k)
    chosen = _planned(call)
    if lse is not None:
        _check_lse(q, lse)
    entry = _BY_NAME[chosen.kernel]
    if variant.shift == "pasa":
        call.constants = shift_constants(float(beta), k.shape[2], chosen.block_n, q.dtype, float(scale))
    ranges = _key_ranges(call, chosen) if chosen.prepass in COPYING_PREPASSES else ()
    if len(ranges) <= 1:  # one launch over the whole call: the tensors as they are, no views
        _run(entry, call, chosen)
        return out
    for batches, heads in ranges:
        _run(entry, call.part(batches, heads), chosen)
    return out


def key_chunks(k: torch.Tensor, out: torch.Tensor, written: int | None = None, kept: float = 1.0,
               share: float | None = None) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The ``((b0, b1), (h0, h1))`` ranges of batch and kv head that a call with a pre-pass writing ``written``
    bytes (default: a copy of ``k``) runs one after the other: the fewest that keep one range's share of those
    bytes within ``share`` (default :data:`PREPASS_SHARE`) of ``out``'s bytes, but no more than the call's work
    (``kept`` of the dense work: a block mask's share of the blocks) fills at :data:`MIN_RANGE_FLOP` each (one
    range of whole batches, or one of heads within a batch element, at least one head; ranges of one kind have
    equal sizes but the last, and ranges of heads are counted per batch element, which can add a range to each)."""
    batch, h_k = k.shape[:2]
    heads = batch * h_k
    written = k.numel() * k.element_size() if written is None else written
    share = PREPASS_SHARE if share is None else share
    fit = max(1, int(share * out.numel() * out.element_size() * heads // max(written, 1)))
    work = 4.0 * out.shape[2] * k.shape[2] * k.shape[3] * out.shape[1] * batch * kept
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


def _key_ranges(call: Call, plan: Plan) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """:func:`key_chunks` of ``call`` under ``plan``'s pre-pass (the 8-bit one's bytes from
    ``quantize.written_bytes``) and of the share of blocks its block mask keeps where the mask knows it
    (``BlockSparseMask.kept_share``; not known: every block), kept per what it reads (the shapes and dtypes, the
    pre-pass, ``P V``'s bits and the fallback, that share, and the module constants it is ruled by, which a test
    or a script may change)."""
    q, k, out = call.q, call.k, call.out
    mask = call.block_mask
    kept = 1.0 if mask is None or mask.kept_share is None else mask.kept_share
    bias = _BY_NAME[plan.kernel].prepass_options.get("bias", False)
    key = (q.shape, k.shape, k.dtype, out.shape, out.dtype, plan.prepass, plan.pv_bits, call.fallback, bias, kept,
           PREPASS_SHARE, QUANTIZE_SHARE, MIN_RANGE_FLOP)
    found = _RANGES.get(key)
    if found is None:
        if len(_RANGES) >= PLAN_CACHE_SIZE:
            _RANGES.clear()
        written, share = None, PREPASS_SHARE
        if plan.prepass == "quantize":
            written = quantize.written_bytes(q, k, call.v, pv_bits=plan.pv_bits, fallback=call.fallback, bias=bias)
            share = QUANTIZE_SHARE
        found = _RANGES[key] = key_chunks(k, out, written, kept, share)
    return found


def _even_step(total: int, most: int) -> int:
    """The size of each of the fewest near-equal ranges of at most ``most`` that cover ``total``."""
    ranges = cdiv(total, most)
    return cdiv(total, ranges)


def _centre(call: Call, plan: Plan, entry: Kernel) -> bool:
    """The centre pre-pass: ``call.keys`` centred per block, ``call.centres`` (fp32, or the keys' dtype where
    the entry asks: ``centres_in_keys_dtype``)."""
    in_keys_dtype = entry.prepass_options.get("centres_in_keys_dtype", False)
    call.keys, call.centres = centre_keys(call.k, block_n=plan.block_n, exact=call.variant.precision == "hybrid",
                                          centres_dtype=call.k.dtype if in_keys_dtype else torch.float32)
    return True


def _shift(call: Call, plan: Plan, entry: Kernel) -> bool:
    """PASA's pre-pass: ``call.keys`` shifted by the call's constants."""
    a_full, c_full, a_tail, c_tail = call.constants[:4]
    call.keys = shift_keys(call.k, block_n=plan.block_n, a_full=a_full, c_full=c_full, a_tail=a_tail, c_tail=c_tail)
    return True


def _quantize(call: Call, plan: Plan, entry: Kernel) -> bool:
    """The 8-bit pre-pass: ``call.prep`` (``quantize.prepare``; the bias rows where the entry asks: ``bias``);
    ``False`` (nothing to launch) for an empty output."""
    if call.out.numel() == 0:
        return False
    fallback = call.fallback
    call.prep = quantize.prepare(call.q, call.k, call.v, scale=call.scale, pv_bits=plan.pv_bits, fallback=fallback,
                                 bias=entry.prepass_options.get("bias", False),
                                 tally=block_tally.counter(call.q.device) if fallback else None)
    return True


PREPASS_RUNS = {"centre": _centre, "shift": _shift, "quantize": _quantize}
"""Each pre-pass of ``call.PREPASSES`` -> its run on a call: it fills in the call and says whether to launch."""


def _run(entry: Kernel, call: Call, chosen: Plan) -> None:
    """``chosen``'s pre-pass (if any) and ``entry``'s launch on one call (or one range of it)."""
    if chosen.prepass is None or PREPASS_RUNS[chosen.prepass](call, chosen, entry):
        entry.launch(call, chosen)


def _check_lse(q: torch.Tensor, lse: torch.Tensor) -> None:
    """``lse`` must be the contiguous float32 ``(B, Hq, Nq)`` buffer the kernels store into."""
    shape = tuple(q.shape[:3])
    if not (isinstance(lse, torch.Tensor) and tuple(lse.shape) == shape and lse.dtype == torch.float32
            and lse.device == q.device and lse.is_contiguous()):
        got = (f"lse.shape={tuple(lse.shape)} {lse.dtype} {lse.device}, contiguous={lse.is_contiguous()}"
               if isinstance(lse, torch.Tensor) else type(lse).__name__)
        raise ValueError(f"dispatch.forward: lse must be a contiguous float32 tensor of shape (B, Hq, Nq)={shape} "
                         f"on {q.device}, got {got}")
