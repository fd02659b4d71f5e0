"""The video transformers' own diffusers processors, with their attention calls sent to a backend.

Wan, HunyuanVideo and LTX-Video compute attention in their own processors (QK RMSNorm, RoPE, text and
video tokens joined or apart) and call diffusers' attention dispatcher,
``dispatch_attention_fn(query, key, value, attn_mask=..., backend=self._attention_backend, ...)``, on
``(B, N, H, D)`` tensors; CogVideoX and Mochi call ``F.scaled_dot_product_attention`` on ``(B, H, N, D)``
tensors.  diffusers 0.42 keys its dispatcher's registry by the members of a closed enum
(``AttentionBackendName``), so an outside package cannot register a ``pasa`` backend there.  The
closest equivalent, here: :func:`routed` gives each routed processor a body that is the stock ``__call__``
itself (the same code object, so the model's own arithmetic runs unchanged) with those two names rebound
in its globals to this module's :func:`_dispatch_attention_fn` and a copy of ``torch.nn.functional`` whose
``scaled_dot_product_attention`` is :func:`_scaled_dot_product_attention`, both bound to the
``CountedAttnProcessor`` the instance carries (``.counted``: PASA, SDPA or a comparison twin), whose
``attend`` counts each call, casts it and runs the backend or its documented fallback (``fallbacks.py``
decides which).  The binding is
per instance, in the body's globals, not a context variable set around the call, so that
``torch.compile(fullgraph=True)`` traces a routed model in one graph (dynamo cannot trace
``ContextVar.set``).  The fallbacks (``"attention mask"``, ``"single key"``, ``"causal"``, ``"dropout"``,
``"attention kwargs"``) and what computes them: ``fallbacks.py``.

A call that carries a context-parallel config (``model.enable_parallelism``: Ulysses, ring or both) goes
to ``sharded_attention.attend``: diffusers' own Ulysses / ring schedule with the backend as its local op,
counted as the backend's call; what it cannot run that way is the ``"context parallel"`` fallback, the
model's own dispatcher with its parallel config.

Every name but ``dispatch_attention_fn`` and ``F`` resolves as in the stock module, and the subclass
keeps the stock ``__call__``'s signature (diffusers filters a processor's keyword arguments by it).
"""
from __future__ import annotations

import copy
import functools
import inspect
import types
from typing import Any

import torch
import torch.nn.functional as torch_functional

from . import fallbacks, sharded_attention
from .processors import CountedAttnProcessor

__all__ = ["RoutedAttnProcessor", "routable_reason", "routed"]

_ROUTED_NAMES = ("dispatch_attention_fn", "F")


class RoutedAttnProcessor:
    """Base of the routed processor classes :func:`routed` builds: a stock processor's state and ``__call__``,
    its attention calls sent to ``counted``.

    Attributes:
        counted: the ``CountedAttnProcessor`` that computes (and counts) every attention call.
        stock: the processor this one replaced (``install.restore`` puts it back).
        body: the stock ``__call__`` with its attention names bound to ``counted`` (:func:`_bound_body`).
    """

    counted: CountedAttnProcessor
    stock: Any
    body: types.FunctionType

    def __deepcopy__(self, memo: dict) -> RoutedAttnProcessor:
        """A copy of the state whose body is bound to the copy of ``counted`` (``copy.deepcopy`` keeps a
        function as it is, which would leave the copy's calls counted by the original)."""
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        for name, value in vars(self).items():
            if name != "body":
                setattr(twin, name, copy.deepcopy(value, memo))
        twin.body = _bound_body(type(twin.stock), twin.counted)
        return twin


def _dispatch_attention_fn(counted: CountedAttnProcessor, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                           is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                           attention_kwargs: dict[str, Any] | None = None, *, backend: Any = None,
                           parallel_config: Any = None) -> torch.Tensor:
    """``diffusers.models.attention_dispatch.dispatch_attention_fn`` as a routed body sees it (``counted`` bound):
    one attention call on ``(B, N, H, D)`` tensors, in the input dtype: a fallback (``fallbacks.call_reason``),
    the call on this rank's shards (``sharded_attention``), or ``counted.attend``."""
    if not attention_kwargs and fallbacks.context_parallel_config(parallel_config) is not None:
        return sharded_attention.attend(counted, query, key, value, attn_mask, dropout_p, is_causal, scale,
                                        enable_gqa, backend=backend, parallel_config=parallel_config)
    reason = fallbacks.call_reason(key, attn_mask, dropout_p, is_causal, attention_kwargs, parallel_config)
    if reason is None:
        return counted.attend(query, key, value, scale, attn_mask).to(query.dtype)
    counted.count_call(reason)
    if reason in ("causal", "dropout"):
        return fallbacks.by_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale)
    return fallbacks.by_dispatcher(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                   attention_kwargs, backend, parallel_config)


def _scaled_dot_product_attention(counted: CountedAttnProcessor, query: torch.Tensor, key: torch.Tensor,
                                  value: torch.Tensor, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                  is_causal: bool = False, scale: float | None = None,
                                  enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (``(B, H, N, D)`` tensors) as a routed body sees it (``counted`` bound)."""
    out = _dispatch_attention_fn(counted, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                 attn_mask, dropout_p, is_causal, scale)
    return out.transpose(1, 2)


def _functional(counted: CountedAttnProcessor) -> types.ModuleType:
    """A copy of ``torch.nn.functional`` whose ``scaled_dot_product_attention`` is routed to ``counted``."""
    module = types.ModuleType(torch_functional.__name__)
    module.__dict__.update(vars(torch_functional))
    module.scaled_dot_product_attention = functools.partial(_scaled_dot_product_attention, counted)
    return module


def routable_reason(processor: Any) -> str | None:
    """Why the attention calls of ``processor`` (a diffusers processor instance) cannot be routed, or ``None``:
    its ``__call__`` must be a Python function that calls ``dispatch_attention_fn`` or ``F`` by global name."""
    call = getattr(type(processor), "__call__", None)
    code = getattr(call, "__code__", None)
    if code is None:
        return f"{type(processor).__name__}.__call__ is not a Python function"
    names = set(code.co_names)
    for inner in code.co_consts:
        if isinstance(inner, types.CodeType):
            names |= set(inner.co_names)
    if not names & set(_ROUTED_NAMES):
        return (f"{type(processor).__name__} calls neither diffusers' dispatch_attention_fn nor "
                "F.scaled_dot_product_attention")
    return None


def _bound_body(stock_class: type, counted: CountedAttnProcessor) -> types.FunctionType:
    """``stock_class.__call__`` (its code, defaults and closure) with ``dispatch_attention_fn`` and ``F`` in its
    globals bound to ``counted``.

    The globals are a copy of the stock module's without its ``__name__``: dynamo (torch 2.11) takes globals
    that name a module for that module's own and guards the stock module's ``dispatch_attention_fn``, which
    fails; unnamed, they are guarded as the dict they are."""
    stock_call = stock_class.__call__
    scope = {**stock_call.__globals__, "dispatch_attention_fn": functools.partial(_dispatch_attention_fn, counted),
             "F": _functional(counted)}
    del scope["__name__"]
    body = types.FunctionType(stock_call.__code__, scope, stock_call.__name__, stock_call.__defaults__,
                              stock_call.__closure__)
    body.__kwdefaults__ = stock_call.__kwdefaults__
    return body


@functools.cache
def _routed_class(stock_class: type) -> type:
    """The routed subclass of ``stock_class``: its ``__call__`` runs the instance's bound stock body."""
    stock_call = stock_class.__call__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.body(self, *args, **kwargs)

    __call__.__signature__ = inspect.signature(stock_call)
    __call__.__doc__ = f"``{stock_class.__name__}.__call__`` with its attention calls sent to ``self.counted``."
    return type(f"Routed{stock_class.__name__}", (RoutedAttnProcessor, stock_class), {"__call__": __call__})


def routed(stock: Any, counted: CountedAttnProcessor) -> RoutedAttnProcessor:
    """A processor that runs ``stock``'s own ``__call__`` on ``stock``'s state, its attention through ``counted``.

    Raises ``ValueError`` (``routable_reason``) for a processor whose attention calls cannot be found.
    """
    reason = routable_reason(stock)
    if reason is not None:
        raise ValueError(f"routed: {reason}")
    cls = _routed_class(type(stock))
    processor = cls.__new__(cls)
    processor.__dict__.update(vars(stock))
    processor.counted = counted
    processor.stock = stock
    processor.body = _bound_body(type(stock), counted)
    return processor
