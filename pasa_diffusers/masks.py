"""Key-padding masks: telling one apart from other attention masks, and attending to the keys it keeps.

A key-padding mask only removes keys, the same ones for every head and query of a batch element
(HunyuanVideo's joint attention, LTX-Video's text cross-attention): boolean, or additive with entries 0
and ``<= REMOVED_BIAS`` or ``-inf``, in SDPA's ``(B, H or 1, 1, Nk)`` layout.  A processor whose op takes
no mask (PASA, the peers) runs it on each batch element's kept keys (:func:`attend_kept_keys`): exactly
what the mask computes.  Reading a mask's values waits for the GPU, so what a mask keeps is read once per
mask tensor and version (:func:`kept_keys`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["REMOVED_BIAS", "KeptKeys", "key_padding", "kept_keys", "attend_kept_keys", "mask_reason"]

REMOVED_BIAS = -1.0e4
"""An additive mask entry at or below this removes its key: ``exp(s - 10000)`` underflows to 0 in fp32
against any row maximum above -9000, so the key's weight is exactly 0 (LTX-Video's text mask is
``(1 - mask) * -10000``)."""


def key_padding(attention_mask: torch.Tensor, batch: int, n_keys: int) -> torch.Tensor | None:
    """The kept keys ``(B, Nk)`` bool of a key-padding mask (module docstring); ``None`` for any other mask,
    or where a row keeps no key."""
    found = _key_padding_counts(attention_mask, batch, n_keys)
    return None if found is None else found[0]


def _key_padding_counts(attention_mask: torch.Tensor, batch: int, n_keys: int) -> tuple[torch.Tensor, list[int]] | None:
    """:func:`key_padding`'s kept keys and how many each batch element keeps, read from the GPU in one
    transfer (the checks and the counts together: the one wait for the GPU)."""
    if attention_mask.dim() != 4 or attention_mask.shape[0] != batch or attention_mask.shape[-1] != n_keys:
        return None
    if attention_mask.shape[2] != 1:
        return None
    checks = []
    if attention_mask.dtype == torch.bool:
        keep = attention_mask
    else:
        keep = attention_mask == 0
        checks.append((keep | (attention_mask <= REMOVED_BIAS)).all())
    keep = keep[:, :, 0, :]
    checks.append((keep == keep[:, :1]).all())
    keep = keep[:, 0]
    answer = torch.cat([torch.stack(checks).long(), keep.sum(dim=-1)]).tolist()
    passed, counts = answer[:len(checks)], answer[len(checks):]
    if not all(passed) or min(counts) == 0:
        return None
    return keep, counts


class KeptKeys(NamedTuple):
    """What a key-padding mask keeps, read once: ``all_kept`` (every key of every batch element), and per
    batch element the positions of its kept keys in order (a long tensor on the mask's device; none where
    every key is kept)."""

    all_kept: bool
    positions: list[torch.Tensor]


_KEPT: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""mask tensor (by identity, held weakly: an entry goes with its mask) -> (its version / batch / keys,
:func:`kept_keys`' answer)."""


def kept_keys(attention_mask: torch.Tensor, batch: int, n_keys: int) -> KeptKeys | None:
    """:func:`key_padding`'s answer for ``attention_mask`` as :class:`KeptKeys` (``None``: not a key-padding
    mask), computed once per mask tensor and version: reading a mask's values waits for the GPU, and a call
    asks twice (``mask_reason``, then ``attend_kept_keys``); HunyuanVideo passes one mask tensor to all its
    blocks, so its forward waits once (LTX-Video builds a new mask in every layer: one wait per layer).  An
    inference tensor, which has no version counter, is read at every ask."""
    if attention_mask.is_inference():
        return _read_kept_keys(attention_mask, batch, n_keys)
    signature = (attention_mask._version, batch, n_keys)
    entry = _KEPT.get(attention_mask)
    if entry is not None and entry[0] == signature:
        return entry[1]
    kept = _read_kept_keys(attention_mask, batch, n_keys)
    _KEPT[attention_mask] = (signature, kept)
    return kept


def _read_kept_keys(attention_mask: torch.Tensor, batch: int, n_keys: int) -> KeptKeys | None:
    """:class:`KeptKeys` of a key-padding mask (``None`` for another mask), with one wait for the GPU: the
    kept positions are the first ``count`` of a stable sort that puts kept keys first."""
    found = _key_padding_counts(attention_mask, batch, n_keys)
    if found is None:
        return None
    keep, counts = found
    if min(counts) == n_keys:
        return KeptKeys(True, [])
    order = torch.argsort((~keep).to(torch.uint8), dim=-1, stable=True)
    return KeptKeys(False, [order[b, :count] for b, count in enumerate(counts)])


def attend_kept_keys(op: Callable[..., torch.Tensor], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scale: float | None, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``op(query, key, value, scale)`` on ``(B, N, H, D)`` tensors under no mask or a key-padding mask
    (``key_padding`` accepts it): each batch element attends to its kept keys, exactly what the mask
    computes, in one call where every key is kept."""
    kept = None if attention_mask is None else kept_keys(attention_mask, key.shape[0], key.shape[1])
    if kept is None or kept.all_kept:
        return op(query, key, value, scale)
    return torch.cat([op(query[b:b + 1], key[b:b + 1].index_select(1, positions),
                         value[b:b + 1].index_select(1, positions), scale)
                      for b, positions in enumerate(kept.positions)])


def mask_reason(key: torch.Tensor, attention_mask: torch.Tensor | None) -> str | None:
    """``"attention mask"`` for a mask ``attend_kept_keys`` cannot take (any but a key-padding one), else ``None``.
    Under ``torch.compile`` every mask is one: telling a key-padding mask apart reads its values, which a
    compiled graph cannot branch on."""
    if attention_mask is None:
        return None
    if torch.compiler.is_compiling() or kept_keys(attention_mask, key.shape[0], key.shape[1]) is None:
        return "attention mask"
    return None
