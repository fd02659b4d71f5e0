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
first call; ``backends.missing`` says (torch-free) which one is absent.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["FP8_MAX", "PEERS", "fp8_per_kv_head"]

FP8_MAX = 448.0
"""The largest float8 e4m3 value."""

def fp8_per_kv_head(t: torch.Tensor, h_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (B, N, H, D) scaled into float8 e4m3 per (batch, kv head), and the descale (B, Hk) fp32 that
    undoes it (FA3's ``*_descale``; a group of query heads shares its kv head's)."""
    b, n, h, d = t.shape
    amax = t.float().reshape(b, n, h_k, h // h_k, d).abs().amax(dim=(1, 3, 4))
    descale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    per_head = descale.repeat_interleave(h // h_k, dim=1)[:, None, :, None]
    return (t.float() / per_head).to(torch.float8_e4m3fn), descale.contiguous()


def _first(result) -> torch.Tensor:
    """The output of a call that returns it alone or first in a tuple (``out, lse``)."""
    return result[0] if isinstance(result, (tuple, list)) else result


def _fa3(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
    from fa3_fwd_interface import flash_attn_func

    q, k, v = (t.to(torch.bfloat16) for t in (query, key, value))
    return _first(flash_attn_func(q, k, v, softmax_scale=scale)).to(query.dtype)


def _fa3_fp8(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
    from fa3_fwd_interface import flash_attn_func

    (q8, qd), (k8, kd), (v8, vd) = (fp8_per_kv_head(t, key.shape[2]) for t in (query, key, value))
    out = flash_attn_func(q8, k8, v8, softmax_scale=scale, q_descale=qd, k_descale=kd, v_descale=vd)
    return _first(out).to(query.dtype)


def _sage(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> torch.Tensor:
    from sageattention import sageattn

    return sageattn(query, key.clone(), value, tensor_layout="NHD", is_causal=False, sm_scale=scale)


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
    "fa3": _fa3, "fa3-fp8": _fa3_fp8, "sage": _sage,
    "cudnn": _sdpa_backend("cudnn"), "flash": _sdpa_backend("flash"), "efficient": _sdpa_backend("efficient"),
}
"""Peer name -> ``attend(query, key, value, scale)`` on ``(B, N, H, D)`` tensors."""
