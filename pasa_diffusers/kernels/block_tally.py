"""How many key blocks the 8-bit path computed in 16 bits (``precision="int8"`` or ``"fp8"``), per device.

The 8-bit exact shift takes a key block whose codes cannot hold its range from 16-bit operands instead
(``reference_int8``, step 4b).  Each call of the op adds, per (batch, query head), its blocks and its
16-bit ones to a counter on the inputs' device: on the CPU the spec by a tensor addition
(``int8_reference(..., tally=True)``, as the op calls it), on a GPU the kernels by atomic additions inside
their launch (no host synchronisation); :func:`counts` reads them (a synchronisation) and :func:`reset`
zeroes them.

    block_tally.reset()
    out = pasa_attention(q, k, v, precision="int8")
    print(block_tally.counts())   # {"blocks": ..., "in_16_bits": ..., "share": ...}
"""
from __future__ import annotations

import torch

__all__ = ["counter", "count", "counts", "reset"]

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counter(device: torch.device | str) -> torch.Tensor:
    """The counter of ``device``: an int64 tensor ``[blocks, blocks in 16 bits]`` the kernels add to."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(2, dtype=torch.int64, device=device)
    return _COUNTERS[device]


def count(flags: torch.Tensor) -> None:
    """Add a call's ``flags`` (bool, one per (batch, query head, key block): True = in 16 bits)."""
    tensor = counter(flags.device)
    tensor[0] += flags.numel()
    tensor[1] += flags.sum()


def counts() -> dict[str, int | float | None]:
    """Blocks of every device since the last :func:`reset`: ``blocks``, ``in_16_bits`` and their ratio
    ``share`` (None before any call)."""
    blocks = in_16_bits = 0
    for tensor in _COUNTERS.values():
        total, fallen = tensor.tolist()
        blocks, in_16_bits = blocks + total, in_16_bits + fallen
    return {"blocks": blocks, "in_16_bits": in_16_bits, "share": in_16_bits / blocks if blocks else None}


def reset() -> None:
    """Zero every device's counter."""
    for tensor in _COUNTERS.values():
        tensor.zero_()
