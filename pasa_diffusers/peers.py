"""The attention kernels PASA is compared with, called the way users call them, on ``(B, N, H, D)`` tensors.

- ``fa3``: FlashAttention-3's forward (the ``fa3-fwd`` wheel's ``fa3_fwd_interface.flash_attn_func``;
  Hopper GPUs, bf16 and fp8 e4m3 only) on bf16 copies;
- ``fa3-fp8``: the same on float8 e4m3 copies scaled per (batch, kv head), with FA3's descales
  (``fp8_per_kv_head``);
- ``sage``: SageAttention (``sageattention.sageattn``: INT8 ``q k^T`` with smooth-K, fp16 ``P V``) on a
  copy of K (it subtracts K's mean in place);
- ``cudnn``, ``flash``, ``efficient``: SDPA restricted to one of its backends
  (``torch.nn.attention.sdpa_kernel``).

Each function returns ``(B, Nq, H, D)`` in the input dtype.  The optional packages are imported on the
first call; ``backends.missing`` says (torch-free) which one is absent.  :func:`prepare` is the one wrapper of
FA3 and SageAttention: the processors (``PEERS``) and ``bench/`` (which times the kernel alone, its input
conversion done before) call them through it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .rules import FP8_MAX

__all__ = ["PEERS", "fp8_per_kv_head", "prepare"]


def fp8_per_kv_head(t: torch.Tensor, h_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (B, N, H, D) scaled into float8 e4m3 per (batch, kv head), and the descale (B, Hk) fp32 that
    undoes it (FA3's ``*_descale``; a group of query heads shares its kv head's)."""
    b, n, h, d = t.shape
    amax = t.float().reshape(b, n, h_k, h // h_k, d).abs().amax(dim=(1, 3, 4))
    descale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    per_head = descale.repeat_interleave(h // h_k, dim=1)[:, None, :, None]
    return (t.float() / per_head).to(torch.float8_e4m3fn), descale.contiguous()


def _first(result: torch.Tensor | tuple | list) -> torch.Tensor:
    """The output of a call that returns it alone or first in a tuple (``out, lse``)."""
    return result[0] if isinstance(result, (tuple, list)) else result


def _bnhd(tensors: tuple[torch.Tensor, ...], layout: str) -> tuple[torch.Tensor, ...]:
    return tensors if layout == "bnhd" else tuple(t.transpose(1, 2) for t in tensors)


def prepare(peer: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None, *,
            layout: str = "bnhd") -> Callable[[], torch.Tensor]:
    """The call of FlashAttention-3 (``"fa3"``, ``"fa3-fp8"``) or SageAttention (``"sage"``) on these tensors,
    their conversion done here, once: the returned function runs the peer's kernel alone (what ``bench/``
    times; :data:`PEERS` calls it at once).

    ``layout``: ``"bnhd"`` (``(B, N, H, D)``) or ``"bhnd"``.  The call returns FA3's output ``(B, Nq, H, D)`` in
    its dtype (bf16, or bf16 from fp8), SageAttention's in ``layout`` and the input dtype.
    """
    if layout not in ("bnhd", "bhnd"):
        raise ValueError(f"peers.prepare: unknown layout={layout!r}; expected 'bnhd' or 'bhnd'")
    if peer in ("fa3", "fa3-fp8"):
        from fa3_fwd_interface import flash_attn_func

        q, k, v = _bnhd((query, key, value), layout)
        if peer == "fa3-fp8":
            (q8, qd), (k8, kd), (v8, vd) = (fp8_per_kv_head(t, k.shape[2]) for t in (q, k, v))
            return lambda: _first(flash_attn_func(q8, k8, v8, softmax_scale=scale, q_descale=qd, k_descale=kd,
                                                  v_descale=vd))
        qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
        return lambda: _first(flash_attn_func(qb, kb, vb, softmax_scale=scale))
    if peer == "sage":
        from sageattention import sageattn

        own_key = key.clone()  # sageattn subtracts K's mean from it in place
        tensor_layout = "NHD" if layout == "bnhd" else "HND"
        return lambda: sageattn(query, own_key, value, tensor_layout=tensor_layout, is_causal=False, sm_scale=scale)
    raise ValueError(f"peers.prepare: unknown peer={peer!r}; expected one of ('fa3', 'fa3-fp8', 'sage')")


def _prepared_peer(name: str) -> Callable[..., torch.Tensor]:
    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
        return prepare(name, query, key, value, scale)().to(query.dtype)

    return attend


def _sdpa_backend(name: str) -> Callable[..., torch.Tensor]:
    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]
        gqa = {"enable_gqa": True} if query.shape[2] != key.shape[2] else {}
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale=scale, **gqa)
        return out.transpose(1, 2)

    return attend


PEERS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float | None], torch.Tensor]] = {
    "fa3": _prepared_peer("fa3"), "fa3-fp8": _prepared_peer("fa3-fp8"), "sage": _prepared_peer("sage"),
    "cudnn": _sdpa_backend("cudnn"), "flash": _sdpa_backend("flash"), "efficient": _sdpa_backend("efficient"),
}
"""Peer name -> ``attend(query, key, value, scale)`` on ``(B, N, H, D)`` tensors."""
