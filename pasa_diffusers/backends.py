"""The attention backends, named once: name -> processor, op variant, what the name fixes.

Every place that takes a backend name reads this registry: ``install.apply`` (the processor to build),
the command line (``--attention``, ``--backends``, checked before torch is imported), the comparison
pipeline, the reports and ``bench/``.  A backend that runs ``pasa_attention`` has a ``variant``
(``variants.Variant``); the comparison twins (SDPA in fp32, bf16 or the model's dtype) have none.
This module imports nothing heavy: the processor class is named, and resolved by ``install``.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

from .variants import DEFAULT, Variant

__all__ = ["Backend", "BACKENDS", "SELF_KIND", "SPARSE", "REFERENCE", "COMPARED", "DEFAULT_COMPARED", "get", "missing"]


SELF_KIND = "video-self"
"""The module kind (``install.module_kind``) of a video transformer's self-attention: what the sparse backends mask."""


@dataclass(frozen=True)
class Backend:
    """One attention backend: ``processor`` is a class name of ``pasa_diffusers.processors`` (or of
    ``sparse_processor``), built with ``options`` (the constructor arguments the name fixes; ``"pasa"`` fixes
    none, so ``apply``'s options may change its defaults); ``variant`` is the op's as the name runs it, or ``None``; ``requires`` the
    optional ``(module, package)`` a peer imports; ``cuda_only``: the backend has no CPU implementation
    (torch's SDPA cuDNN and memory-efficient kernels, FlashAttention-3, SageAttention); ``needs_kind``: the module
    kind (``install.module_kind``) the backend exists for, which ``install.apply`` must find among the modules it
    selects (the sparse backends: a video transformer's self-attention)."""

    name: str
    processor: str
    summary: str
    variant: Variant | None = None
    options: dict[str, Any] = field(default_factory=dict)
    requires: tuple[str, str] | None = None
    cuda_only: bool = False
    needs_kind: str | None = None


def _pasa(name: str, summary: str, variant: Variant) -> Backend:
    """A ``PASAAttnProcessor`` backend that fixes ``variant``: its options are the variant's shift and precision."""
    return Backend(name, "PASAAttnProcessor", summary, variant,
                   {"precision": variant.precision, "shift": variant.shift})


def _sparse(name: str, summary: str, variant: Variant) -> Backend:
    """A ``SparsePASAAttnProcessor`` backend that fixes ``variant``, for a video transformer's self-attention."""
    return Backend(name, "SparsePASAAttnProcessor", summary, variant,
                   {"precision": variant.precision, "shift": variant.shift}, needs_kind=SELF_KIND)


_ALL = (
    Backend("pasa", "PASAAttnProcessor", "the exact shift, fp32 softmax state (the default)", DEFAULT),
    _pasa("pasa-half", "the exact shift, fp16 scores and accumulator", Variant("exact", "half")),
    _pasa("pasa-int8", "the exact shift in 8 bits: INT8 q k^T on centred, rotated codes, 16-bit P V; one key block "
          "in 16 bits", Variant("exact", "int8")),
    _pasa("pasa-fp8", "the exact shift in 8 bits with FP8 e4m3 P V: INT8 q k^T on centred, rotated codes, FP8 P and "
          "V; one key block in 16 bits", Variant("exact", "fp8")),
    _sparse("pasa-sparse", "the default with a block-sparse mask on a video transformer's self-attention (radial by "
            "default; dense for the first steps and layers)", DEFAULT),
    _sparse("pasa-fp8-sparse", "pasa-fp8 with a block-sparse mask on a video transformer's self-attention",
            Variant("exact", "fp8")),
    _pasa("pasa-paper", "the paper's fully-FP16 PASA", Variant("pasa", "half")),
    _pasa("pasa-paper-hybrid", "the paper's shift, fp32 softmax state", Variant("pasa", "hybrid")),
    Backend("naive-half", "NaiveHalfAttnProcessor", "plain fully-FP16 FlashAttention: the control that overflows",
            Variant("none", "half")),
    Backend("sdpa", "SDPAAttnProcessor", "SDPA in the model's dtype, as diffusers' AttnProcessor2_0"),
    Backend("bf16", "BF16AttnProcessor", "SDPA on bf16 copies of q, k, v"),
    Backend("fp32", "FP32AttnProcessor", "SDPA on fp32 copies of q, k, v: the reference of the comparisons"),
    Backend("fa3", "PeerAttnProcessor", "FlashAttention-3 on bf16 copies (the fa3-fwd wheel; Hopper GPUs)",
            options={"peer": "fa3"}, requires=("fa3_fwd_interface", "fa3-fwd"), cuda_only=True),
    Backend("fa3-fp8", "PeerAttnProcessor", "FlashAttention-3 on float8 e4m3 copies, scaled per (batch, kv head)",
            options={"peer": "fa3-fp8"}, requires=("fa3_fwd_interface", "fa3-fwd"), cuda_only=True),
    Backend("sage", "PeerAttnProcessor", "SageAttention: INT8 q k^T with smooth-K, fp16 P V (CUDA)",
            options={"peer": "sage"}, requires=("sageattention", "sageattention"), cuda_only=True),
    Backend("cudnn", "PeerAttnProcessor", "SDPA's cuDNN backend only (CUDA)", options={"peer": "cudnn"},
            cuda_only=True),
    Backend("flash", "PeerAttnProcessor", "SDPA's flash backend only", options={"peer": "flash"}),
    Backend("efficient", "PeerAttnProcessor", "SDPA's memory-efficient backend only (CUDA)",
            options={"peer": "efficient"}, cuda_only=True),
)

BACKENDS: dict[str, Backend] = {b.name: b for b in _ALL}
"""Every backend by name, in the order help texts list them."""

SPARSE = tuple(name for name, entry in BACKENDS.items() if entry.needs_kind == SELF_KIND)
"""The backends that run a block-sparse mask (``pasa-sparse``, ``pasa-fp8-sparse``)."""

REFERENCE = "fp32"
"""The backend every comparison scores against."""

COMPARED = tuple(name for name in BACKENDS if name != REFERENCE)
"""The backends ``pasa compare`` can score (all but the reference)."""

DEFAULT_COMPARED = ("pasa", "pasa-paper", "naive-half", "bf16")
"""What ``pasa compare`` scores unless told otherwise."""


def get(name: str, fn: str) -> Backend:
    """The backend called ``name``; ``ValueError`` prefixed by ``fn`` naming the known ones otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"{fn}: unknown backend={name!r}; expected one of {tuple(BACKENDS)}")
    return BACKENDS[name]


def missing(name: str, device: str | None = None) -> str | None:
    """Why backend ``name`` cannot run here, in one line, or ``None``: its optional package is not installed
    (named, with the pip command), or ``device`` (``"cpu"``, ``"cuda:1"``; ``None``: not checked) is not a CUDA
    device and the backend runs on CUDA only.  Looks the module up without importing it."""
    entry = get(name, "missing")
    if entry.requires is not None:
        module, package = entry.requires
        if importlib.util.find_spec(module) is None:
            return f"backend {name!r} needs the {package} package (module {module}), which is not installed: " \
                   f"pip install {package}"
    if entry.cuda_only and device is not None and not device.startswith("cuda"):
        return f"backend {name!r} runs on CUDA devices only, not on {device}: pass --device cuda, or choose a " \
               f"backend with a CPU implementation"
    return None
