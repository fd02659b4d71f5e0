"""Which attention calls a backend does not run itself, decided in one place, with the reason each is counted under.

An installed processor (``processors.CountedAttnProcessor``) counts every call it serves and, per reason, the
calls a fallback computed (``processor.fallbacks``; ``install.fallback_summary`` adds them up).  Every
reason is decided here; what computes it:

- :func:`call_reason`, from what a routed call carries (``routing``'s ``dispatch_attention_fn`` and
  ``F.scaled_dot_product_attention``, ``sharded_attention.attend`` under a context-parallel config):

  - ``"attention kwargs"``: the model's own dispatcher with them (:func:`by_dispatcher`);
  - ``"context parallel"``: the model's own dispatcher with its parallel config: ``attention_kwargs`` under
    a parallel config, or under a context-parallel one a causal call, dropout, or a mask that is not
    sharded with the keys (:func:`sharded_padding_mask`);
  - ``"causal"``, ``"dropout"``: SDPA with them (:func:`by_sdpa`; no video transformer asks for either at
    inference);

- :func:`processor_reason`, from the call a processor's ``attend`` receives and the cases the processor
  takes (``processor.fallback_cases``), computed by its ``fallback`` method:

  - ``"attention mask"``: SDPA with the mask: a mask other than a key-padding one (``masks.py``), or any
    mask under ``torch.compile``;
  - ``"single key"``: the key's value (the softmax over one key is exactly 1);
  - ``"one key block"``: an 8-bit precision (``"int8"``, ``"fp8"``) on keys of at most one shift block, run
    in the op's default precision (8-bit codes buy no speed there, only their error).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as torch_functional

from .masks import mask_reason
from .rules import SHIFT_BLOCK

__all__ = ["REASONS", "PROCESSOR_REASONS", "one_key_block", "context_parallel_config", "sharded_padding_mask",
           "call_reason", "processor_reason", "by_dispatcher", "by_sdpa"]

REASONS: dict[str, str] = {
    "attention kwargs": "the model's own dispatcher with them",
    "context parallel": "the model's own dispatcher with its parallel config",
    "causal": "SDPA with is_causal",
    "dropout": "SDPA with the dropout",
    "attention mask": "SDPA with the mask",
    "single key": "the key's value",
    "one key block": "the op's default precision",
}
"""Every fallback reason -> what computes a call counted under it."""

PROCESSOR_REASONS = ("attention mask", "single key", "one key block")
"""The reasons :func:`processor_reason` decides; a processor's ``fallback_cases`` names those it takes."""


def one_key_block(n_keys: int) -> bool:
    """Whether ``n_keys`` keys form at most one shift block (``rules.SHIFT_BLOCK``): a call the 8-bit precisions
    compute in the op's default precision (``"one key block"``), and a run ``pasa generate``/``compare`` refuses
    an 8-bit backend for when every call is one (``cli.common.check_key_blocks``)."""
    return n_keys <= SHIFT_BLOCK


def context_parallel_config(parallel_config: Any) -> Any:
    """The ``ContextParallelConfig`` of a diffusers ``ParallelConfig`` that splits the sequence over more
    than one rank, or ``None`` (no config, tensor parallelism only, or a single rank)."""
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None or (cp.ring_degree or 1) * (cp.ulysses_degree or 1) <= 1:
        return None
    return cp


def sharded_padding_mask(attn_mask: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether ``attn_mask`` is sharded with the ``(B, N, H, D)`` keys and the same for every query (``(B or
    1, H or 1, 1, Nk_local)``): what ``sharded_attention.attend`` gathers with the keys.  Decided from shapes
    only, so every rank takes the same path (the values may differ between ranks' shards)."""
    return (attn_mask.dim() == 4 and attn_mask.shape[2] == 1 and attn_mask.shape[-1] == key.shape[1]
            and attn_mask.shape[0] in (1, key.shape[0]))


def call_reason(key: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool,
                attention_kwargs: dict[str, Any] | None, parallel_config: Any) -> str | None:
    """The reason a routed call on ``(B, N, H, D)`` keys falls back for what it carries (module docstring), or
    ``None``: the processor's ``attend`` takes it (directly, or under context parallelism through
    ``sharded_attention``)."""
    if attention_kwargs:
        return "context parallel" if parallel_config is not None else "attention kwargs"
    if context_parallel_config(parallel_config) is not None:
        if is_causal or dropout_p > 0.0 or (attn_mask is not None and not sharded_padding_mask(attn_mask, key)):
            return "context parallel"
        return None
    if is_causal:
        return "causal"
    if dropout_p > 0.0:
        return "dropout"
    return None


def processor_reason(cases: tuple[str, ...], key: torch.Tensor, attention_mask: torch.Tensor | None) -> str | None:
    """The reason (one of ``cases``, a processor's ``fallback_cases``) a call of ``(B, N, H, D)`` keys is
    computed by the processor's fallback, or ``None``.  The mask comes first: the single-key shortcut ignores
    a mask."""
    if attention_mask is not None:
        if "attention mask" in cases and mask_reason(key, attention_mask) is not None:
            return "attention mask"
    elif "single key" in cases and key.shape[1] == 1:
        return "single key"
    if "one key block" in cases and one_key_block(key.shape[1]):
        return "one key block"
    return None


def by_dispatcher(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                  dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
                  attention_kwargs: dict[str, Any] | None, backend: Any, parallel_config: Any) -> torch.Tensor:
    """A call computed by diffusers' own dispatcher, as the model would have run it."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    return dispatch_attention_fn(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                 scale=scale, enable_gqa=enable_gqa, attention_kwargs=attention_kwargs,
                                 backend=backend, parallel_config=parallel_config)


def by_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
            dropout_p: float, is_causal: bool, scale: float | None) -> torch.Tensor:
    """A causal or dropout call of ``(B, N, H, D)`` tensors computed by SDPA, in the input dtype."""
    out = torch_functional.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attn_mask,
        dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=query.shape[2] != key.shape[2])
    return out.transpose(1, 2)
