"""diffusers attention processors that route attention through PASA, and their comparison twins.

Every processor here runs the body of diffusers' ``AttnProcessor2_0`` (the default processor of the
legacy ``Attention`` module that Stable Video Diffusion uses) and differs only in the attention call,
made through ``attend`` and the ``attention(query, key, value, scale)`` hook on ``(batch, tokens, heads,
head_dim)`` views of the projections (``routing.py`` runs the video transformers' own processors with
their attention calls sent to the same ``attend``):

- ``PASAAttnProcessor``: ``pasa_attention`` (the exact shift in hybrid precision by default);
- ``NaiveHalfAttnProcessor``: plain fully-FP16 FlashAttention, the control that overflows;
- ``FP32AttnProcessor``: SDPA on fp32 copies, the reference output everything is scored against;
- ``BF16AttnProcessor``: SDPA on bf16 copies;
- ``SDPAAttnProcessor``: SDPA in the model's dtype, as the stock processor;
- ``PeerAttnProcessor``: one of ``peers.PEERS`` (FlashAttention-3 bf16 / fp8, SageAttention, one SDPA
  backend), what a user would run instead.

Every processor takes ``dtype``: attention then works on q, k, v cast to it (e.g. fp16 in an fp32 model).

No silent fallbacks.  The PASA processors run the op on every call except the documented cases, which
they compute another way, count under their reason in ``fallbacks`` and log once: an attention mask
that is not a key-padding mask (``"attention mask"``: SDPA with the mask; the op takes none, and a
key-padding mask (``masks.py``) runs the op on each batch element's kept keys; under ``torch.compile`` every mask), a
single key (``"single key"``: the softmax is exactly 1, the output that key's value; SVD's
cross-attentions) and, for the 8-bit precisions (``"int8"``, ``"fp8"``), keys of one block (``"one key
block"``: the op's default precision, where 8 bits buy no speed); ``fallbacks.py`` decides every case.  A
call the op cannot take (a head dim outside ``[rules.MIN_HEAD_DIM, rules.MAX_HEAD_DIM]``, an input
dtype the precision does not take) raises ``ValueError`` naming the module; ``install.apply`` checks
both before installing and casts q, k, v to a dtype the backend takes.  The op is forward-only: a
call with inputs that require grad raises (wrap inference in ``torch.no_grad()``).
The counters and the warning are eager-only: inside ``torch.compile`` they are skipped (a Python
counter mutated in a compiled region is guarded on and would recompile the model at every call;
a logging call breaks the graph), so a compiled model's counters show its eager calls only.
``install.py`` puts the processors on a model (``apply``/``restore``) and adds up their counters.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention

from . import backends, fallbacks, peers, rules
from .masks import attend_kept_keys
from .ops import pasa_attention
from .variants import DEFAULT_PRECISION, DEFAULT_SHIFT, VARIANTS, eight_bit

__all__ = [
    "CountedAttnProcessor",
    "PeerAttnProcessor",
    "PASAAttnProcessor",
    "NaiveHalfAttnProcessor",
    "FP32AttnProcessor",
    "BF16AttnProcessor",
    "SDPAAttnProcessor",
]

logger = logging.getLogger("pasa_diffusers")

_WARNED: set[tuple[str, str]] = set()
"""(processor class, fallback reason) pairs already logged: each is logged once per process (one run),
however many models ``apply`` is called on."""


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in dtypes)


def _sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on ``(B, N, H, D)`` tensors; returns ``(B, Nq, H, D)``."""
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.to(query.dtype)
    hidden_states = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        attn_mask=attention_mask,
        dropout_p=0.0,
        is_causal=False,
        scale=scale,
    )
    return hidden_states.transpose(1, 2)


class CountedAttnProcessor:
    r"""
    Base of the processors here: ``AttnProcessor2_0``'s body around an ``attention`` hook, with counters.

    Subclasses implement ``attention(query, key, value, scale, attention_mask)`` on ``(batch, tokens,
    heads, head_dim)`` tensors and name in ``fallback_cases`` the documented cases they hand to a fallback
    (``fallbacks.PROCESSOR_REASONS``, decided by ``fallbacks.processor_reason``); such a call is computed
    exactly instead (V itself for a single key, SDPA otherwise) and counted.

    Args:
        dtype: the dtype attention works on: query, key and value are cast to it before the attention
            call (or its fallback) and the result back to the model's dtype.  ``None`` (default) keeps
            the model's dtype; ``torch.float16`` lets an fp32 model feed the half variants fp16 tensors.

    Attributes:
        calls: attention calls served (fallbacks included), in eager mode.
        fallbacks: number of fallback calls per reason, in eager mode.
        name: module path, set by ``apply``; used in the fallback warning and in errors.
        backend: the ``backends.BACKENDS`` name it was installed as, set by ``apply`` (``None`` otherwise).
        kind: the module kind it serves (``install.module_kind``: ``"video-self"``, ``"spatial-cross"``, ...),
            set by ``apply`` (``None`` otherwise).
        fallback_cases: the reasons of ``fallbacks.PROCESSOR_REASONS`` this processor computes by its
            ``fallback`` (none: SDPA takes every call, masks included).
    """

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"{type(self).__name__}: dtype must be a floating torch.dtype or None, got {dtype!r}")
        self.dtype = dtype
        self.calls = 0
        self.fallbacks: dict[str, int] = {}
        self.name: str | None = None
        self.backend: str | None = None
        self.kind: str | None = None
        self.fallback_cases: tuple[str, ...] = ()

    def attention_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype attention runs in for a model of ``model_dtype``."""
        return self.dtype or model_dtype

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)

        input_ndim = hidden_states.ndim

        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)

        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )

        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            # (batch, heads, source_length, target_length), as scaled_dot_product_attention expects
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        query = attn.to_q(hidden_states)

        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)

        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads

        # (batch, seq_len, heads, head_dim) views of the projections: no transposes, no copies
        query = query.view(batch_size, -1, attn.heads, head_dim)
        key = key.view(batch_size, -1, attn.heads, head_dim)
        value = value.view(batch_size, -1, attn.heads, head_dim)

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        # the output = (batch, seq_len, heads, head_dim)
        hidden_states = self.attend(query, key, value, attn.scale, attention_mask)

        hidden_states = hidden_states.reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)

        # linear proj
        hidden_states = attn.to_out[0](hidden_states)
        # dropout
        hidden_states = attn.to_out[1](hidden_states)

        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)

        if attn.residual_connection:
            hidden_states = hidden_states + residual

        hidden_states = hidden_states / attn.rescale_output_factor

        return hidden_states

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float | None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``(B, N, H, D)`` tensors with softmax scale ``scale`` (``None``: ``1/sqrt(D)``);
        returns ``(B, Nq, H, D)``."""
        raise NotImplementedError

    def fallback_reason(
        self, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> str | None:
        """The documented case this call is (e.g. ``"single key"``), computed by the fallback, or ``None``:
        ``fallbacks.processor_reason`` of the cases this processor takes (``fallback_cases``)."""
        return fallbacks.processor_reason(self.fallback_cases, key, attention_mask)

    def count_call(self, fallback: str | None = None) -> None:
        """Count one call (eager mode only), under its fallback reason if it has one; each reason is logged
        once per process."""
        if torch.compiler.is_compiling():
            return
        self.calls += 1
        if fallback is None:
            return
        self.fallbacks[fallback] = self.fallbacks.get(fallback, 0) + 1
        if (type(self).__name__, fallback) not in _WARNED:
            _WARNED.add((type(self).__name__, fallback))
            logger.warning("%s: %s in %s; computing it by its documented fallback (counted in .fallbacks, logged "
                           "once per process)", type(self).__name__, fallback, self.name or "an attention module")

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float | None,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The one entry of every attention call (this file's body and ``routing``'s): count the call (eager
        mode), cast to ``dtype``, then run ``attention`` or the fallback its reason calls for; ``(B, N, H, D)``
        tensors in and out."""
        if self.dtype is not None:
            query, key, value = query.to(self.dtype), key.to(self.dtype), value.to(self.dtype)
        reason = self.fallback_reason(query, key, attention_mask)
        self.count_call(reason)
        if reason is None:
            return self.attention(query, key, value, scale, attention_mask)
        return self.fallback(reason, query, key, value, scale, attention_mask)

    def fallback(
        self,
        reason: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float | None,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The documented computation of a call ``fallback_reason`` named ``reason``: V itself for a single
        key, SDPA (with the mask) otherwise."""
        if reason == "single key":
            # softmax over one key is exactly 1: every query row gets that key's value
            return value.expand(-1, query.shape[1], -1, -1)
        return _sdpa(query, key, value, scale, attention_mask)


class PASAAttnProcessor(CountedAttnProcessor):
    r"""
    Attention through ``pasa_diffusers.ops.pasa_attention`` (the op's default: the exact shift in hybrid).

    Args:
        precision: ``"hybrid"`` (fp16/bf16 GEMMs, fp32 softmax state), ``"half"`` (fp16 scores and
            accumulator), ``"int8"`` (INT8 ``q k^T`` on centred codes, 16-bit ``P V``), ``"fp8"`` (the same
            codes, ``P V`` in FP8 e4m3) or ``"fp64"`` (the exact reference math; slow, for tests).
        shift: ``"exact"`` for the exact shift (K's block mean removed exactly, the removed ``q . kbar``
            carried in fp32), ``"pasa"`` (or ``True``) for the paper's PASA, ``"none"`` (or ``False``) for
            plain FlashAttention in the same precision.
        beta: PASA's shift strength in (0, 1), with ``shift="pasa"`` only (refused with another shift);
            ``None`` uses the op's default.
        dtype: the dtype attention works on (see ``CountedAttnProcessor``).

    Falls back (counted, logged once per reason and process) for an attention mask other than a key-padding
    mask (``"attention mask"``; key-padding masks, ``masks.key_padding``, run the op on each batch element's kept
    keys), a single key (``"single key"``) and, with ``precision="int8"`` or ``"fp8"``, keys that form one block
    of at most ``rules.SHIFT_BLOCK`` (``"one key block"``: temporal attention, cross-attention to a short text),
    which run the op's default, the exact shift in hybrid precision: at one block a call is bound by memory,
    not by the tensor cores, so 8-bit codes buy no speed there, only their error (docs/NUMERICS.md, "Where
    8 bits pay").  ``install.apply`` checks every module's head dim and dtype
    against the op's rules before installing; a call the op cannot take raises the op's ``ValueError``
    with the module's name.

    Attributes:
        variant: the op's ``variants.Variant`` this processor runs.
    """

    def __init__(
        self,
        precision: str = DEFAULT_PRECISION,
        shift: bool | str = DEFAULT_SHIFT,
        beta: float | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(dtype)
        fn = type(self).__name__
        rules.check_options(fn, precision=precision, shift=shift, beta=beta)
        if dtype is not None and dtype not in rules.PRECISION_DTYPES[precision]:
            raise ValueError(f"{fn}: precision={precision!r} takes {_names(rules.PRECISION_DTYPES[precision])} "
                             f"inputs, got dtype={dtype}")
        self.variant = VARIANTS[rules.shift_mode(shift), precision]  # checked above: a lookup, not a new check
        self.beta = beta
        self.fallback_cases = ("attention mask", "single key") + (("one key block",) if eight_bit(precision) else ())

    @property
    def precision(self) -> str:
        return self.variant.precision

    @property
    def shift(self) -> str:
        return self.variant.shift

    def fallback(
        self,
        reason: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float | None,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        if reason == "one key block":
            return self.attention(query, key, value, scale, attention_mask, precision=DEFAULT_PRECISION)
        return super().fallback(reason, query, key, value, scale, attention_mask)

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float | None,
        attention_mask: torch.Tensor | None = None,
        precision: str | None = None,
    ) -> torch.Tensor:
        """``pasa_attention`` in ``precision`` (default: this processor's; the one-key-block fallback passes the
        op's default) on each batch element's kept keys; the op's ``ValueError`` names this processor and module."""
        precision = precision or self.precision

        def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: float | None) -> torch.Tensor:
            return pasa_attention(q, k, v, scale=s, precision=precision, shift=self.shift, beta=self.beta,
                                  layout="bnhd")

        try:  # no mask or a key-padding one: fallback_reason let no other through
            return attend_kept_keys(op, query, key, value, scale, attention_mask)
        except ValueError as error:
            raise ValueError(f"{type(self).__name__}(precision={precision!r}) in "
                             f"{self.name or 'an attention module'}: {error} (pass dtype= to cast q, k, v)") from error


class NaiveHalfAttnProcessor(PASAAttnProcessor):
    r"""
    The control: fully-FP16 FlashAttention without PASA's shift (inf/NaN once a raw score passes 65504).
    """

    FIXED = {"precision": backends.BACKENDS["naive-half"].variant.precision,
             "shift": backends.BACKENDS["naive-half"].variant.shift}
    """The ``PASAAttnProcessor`` settings this control fixes: the ``naive-half`` backend's variant."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__(**self.FIXED, dtype=dtype)


class _CastSDPAProcessor(CountedAttnProcessor):
    """SDPA on copies of query, key and value in ``cast_to``, cast back to the input dtype."""

    cast_to: torch.dtype

    def attention_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.cast_to

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float | None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cast = self.cast_to
        hidden_states = _sdpa(query.to(cast), key.to(cast), value.to(cast), scale, attention_mask)
        return hidden_states.to(query.dtype)


class FP32AttnProcessor(_CastSDPAProcessor):
    r"""
    SDPA on fp32 copies of query, key and value, cast back: the reference output of the comparisons.
    """

    cast_to = torch.float32


class BF16AttnProcessor(_CastSDPAProcessor):
    r"""
    SDPA on bf16 copies of query, key and value, cast back.
    """

    cast_to = torch.bfloat16


class SDPAAttnProcessor(CountedAttnProcessor):
    r"""
    SDPA in the model's dtype (or ``dtype``), as ``AttnProcessor2_0``, counted like the other processors.
    """

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float | None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return _sdpa(query, key, value, scale, attention_mask)


class PeerAttnProcessor(CountedAttnProcessor):
    r"""
    Attention by a peer kernel (``peers.PEERS``: ``"fa3"``, ``"fa3-fp8"``, ``"sage"``, ``"cudnn"``,
    ``"flash"``, ``"efficient"``), counted like the other processors.  The peers take no mask: a
    key-padding mask (HunyuanVideo's joint attention, LTX-Video's text cross-attention) runs the peer on
    each batch element's kept keys, as the PASA processor does; any other mask falls back to SDPA
    (``"attention mask"``, counted and logged once).
    """

    def __init__(self, peer: str, dtype: torch.dtype | None = None) -> None:
        super().__init__(dtype)
        if peer not in peers.PEERS:
            raise ValueError(f"{type(self).__name__}: unknown peer={peer!r}; expected one of {tuple(peers.PEERS)}")
        self.peer = peer
        self.fallback_cases = ("attention mask",)

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float | None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if backends.BACKENDS[self.peer].cuda_only and query.device.type != "cuda":
            raise ValueError(f"{type(self).__name__}: backend {self.peer!r} runs on CUDA tensors only, and this "
                             f"attention's query is on {query.device}: move the model to a CUDA device, or choose a "
                             "backend with a CPU implementation")
        return attend_kept_keys(peers.PEERS[self.peer], query, key, value, scale, attention_mask)
