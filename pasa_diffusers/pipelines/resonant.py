"""``tiny-resonant``: the tiny SVD with FP16 overflow planted in known attention layers (a demonstration model).

The paper traces SVD's FP16 overflow to a large bias along the sequence (every token of q, and of k,
carries the same offset) combined with "resonance": the offsets of q and k in phase (or anti-phase)
along the head dimension.  This module plants exactly that, through the projection biases of
``PLANTED_LAYERS``: ``to_q`` and ``to_k`` become ``nn.Linear(..., bias=True)`` with the same weights
and, for head ``h`` and head dim ``d`` of ``D``,

    bias_q[h, d] = b c[h, d],   c[h, d] = cos(2 pi d / D + phi_h),   phi_h = pi / D + h pi / 2,
    bias_k[h, d] = +b c[h, d] (``"in-phase"``),  -b c[h, d] (``"anti-phase"``),
                   b r[h, d]  (``"random"``: r a random direction orthogonal to c[h], |r[h]| = |c[h]|).

Every token then has ``q = x_q + b c`` and ``k = x_k +- b c`` with the unplanted projections ``x``
(of order 1 in the tiny model), so ``q . k = +-b^2 |c|^2 + O(b |x|)`` with ``|c[h]|^2 = D / 2``.  The
amplitude is chosen per layer from its head dim as ``b = sqrt(margin * 65504 / (D / 2))``, so in phase
or in anti-phase every raw score sits near ``+-margin * 65504``: FP16's ``q k^T`` overflows to +-inf
and naive fully-FP16 attention returns NaN.  PASA subtracts ``beta = 0.9375`` of each key block's mean
before its FP16 GEMM, so its shifted logits are about ``(1 - beta) scale margin 65504`` (2047 for
``D = 16``, ``scale = 1/4``, ``margin = 2``) and its recovered reference ``gamma mu`` about
``beta scale margin 65504`` (30705): both finite as long as ``scale * margin < 1``.  The ``"random"``
pattern keeps the bias but not the resonance: ``c . r = 0`` and the scores stay ``O(b |x|)``, far below
65504 — bias alone does not overflow.

The phases ``phi_h`` are half a step off the grid ``2 pi d / D`` (and ``D`` is a multiple of 4), so no
``c[h, d]`` is near zero and the signs of q's and k's token means follow the planted pattern.  Every
layer not planted keeps its weights: its scores stay those of the tiny model (below 100).

The projection biases are real parameters that the UNet's config describes: ``build_tiny_resonant``
makes the UNet a ``QKBiasUNetSpatioTemporalConditionModel``, SVD's UNet with one more config entry,
``qk_bias_layers`` (the attention modules whose ``to_q`` and ``to_k`` carry a bias).  The result is
still a ``StableVideoDiffusionPipeline``; ``save_pretrained`` writes the biases and records the UNet's
class under this module's name in ``model_index.json``, and ``from_pretrained`` (in a process that
has imported this module, as ``load_svd`` does) rebuilds the biased projections from the config and
loads them: the same model.  Without this module imported, diffusers refuses the folder and says to
import it.
"""
from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from diffusers import ModelMixin  # noqa: F401  (from_pretrained looks its loading methods up in this module)
from diffusers import StableVideoDiffusionPipeline, UNetSpatioTemporalConditionModel
from diffusers.configuration_utils import register_to_config
from diffusers.models.attention_processor import Attention

from pasa_diffusers.rules import FP16_MAX

__all__ = ["PLANTED_LAYERS", "PATTERNS", "DEFAULT_MARGIN", "QKBiasUNetSpatioTemporalConditionModel", "with_qk_biases",
           "phase_pattern", "bias_amplitude", "plant_resonance", "build_tiny_resonant"]

PLANTED_LAYERS: tuple[str, ...] = (
    "down_blocks.0.attentions.0.transformer_blocks.0.attn1",
    "mid_block.attentions.0.transformer_blocks.0.attn1",
    "up_blocks.1.attentions.1.temporal_transformer_blocks.0.attn1",
)
"""UNet attention modules planted by ``build_tiny_resonant``: two spatial self-attentions (256 tokens,
D = 16; 64 tokens, D = 32) and one temporal self-attention (frames, D = 16); all run at every step."""

PATTERNS = ("in-phase", "anti-phase", "random")
"""How the key bias relates to the query bias (see the module docstring)."""

DEFAULT_MARGIN = 2.0
"""Planted raw scores sit near ``DEFAULT_MARGIN * 65504``."""


def _with_parameter(parameter: inspect.Parameter) -> inspect.Signature:
    """``UNetSpatioTemporalConditionModel.__init__``'s signature with ``parameter`` added last.

    diffusers reads a model's config keys from its ``__init__`` signature (``register_to_config`` records
    them, ``from_config`` passes them back): the subclass declares the parent's parameters and its own
    through ``__signature__`` instead of copying the parent's thirteen parameters and their defaults."""
    parent = inspect.signature(UNetSpatioTemporalConditionModel.__init__)
    return parent.replace(parameters=[*parent.parameters.values(), parameter])


class QKBiasUNetSpatioTemporalConditionModel(UNetSpatioTemporalConditionModel):
    """SVD's UNet whose attention modules ``qk_bias_layers`` (paths under the UNet) have biased ``to_q``
    and ``to_k``: the biases are parameters, saved and loaded with the others, and the config lists where
    they are.  Every other argument is ``UNetSpatioTemporalConditionModel``'s."""

    def __init__(self, *args: Any, qk_bias_layers: tuple[str, ...] | list[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        modules = dict(self.named_modules())
        for path in qk_bias_layers:
            attn = modules.get(path)
            if not isinstance(attn, Attention):
                raise ValueError(f"QKBiasUNetSpatioTemporalConditionModel: qk_bias_layers names {path!r}, "
                                 "which is not an Attention module of the UNet")
            attn.to_q = _with_zero_bias(attn.to_q)
            attn.to_k = _with_zero_bias(attn.to_k)

    __init__.__signature__ = _with_parameter(inspect.Parameter(
        "qk_bias_layers", inspect.Parameter.KEYWORD_ONLY, default=(), annotation="tuple[str, ...] | list[str]"))
    __init__ = register_to_config(__init__)


def _with_zero_bias(linear: torch.nn.Linear) -> torch.nn.Linear:
    """``linear`` itself when it has a bias, else a ``Linear`` holding the same weight tensor and a zero bias."""
    if linear.bias is not None:
        return linear
    weight = linear.weight
    out = torch.nn.Linear(linear.in_features, linear.out_features, bias=True, device=weight.device, dtype=weight.dtype)
    out.weight = weight
    with torch.no_grad():
        out.bias.zero_()
    return out


def with_qk_biases(unet: UNetSpatioTemporalConditionModel,
                   layers: tuple[str, ...]) -> QKBiasUNetSpatioTemporalConditionModel:
    """``unet`` as a ``QKBiasUNetSpatioTemporalConditionModel`` whose ``layers`` have biased ``to_q``/``to_k``
    (zero where ``unet`` had none; any it lists already stay biased): the same weights, the same
    tensors, its mode (eval or train) kept."""
    listed = tuple(getattr(unet.config, "qk_bias_layers", ()))
    config = {key: value for key, value in unet.config.items() if not key.startswith("_")}
    with torch.device("meta"):
        biased = QKBiasUNetSpatioTemporalConditionModel.from_config(
            {**config, "qk_bias_layers": [*listed, *(path for path in layers if path not in listed)]})
    state = unet.state_dict()
    for key, parameter in biased.state_dict().items():
        if key not in state:  # a new bias, next to its weight
            weight = state[key.removesuffix("bias") + "weight"]
            state[key] = torch.zeros(parameter.shape, dtype=weight.dtype, device=weight.device)
    biased.load_state_dict(state, strict=True, assign=True)
    return biased.train(unet.training)


def phase_pattern(heads: int, head_dim: int) -> torch.Tensor:
    """``c[h, d] = cos(2 pi d / D + pi / D + h pi / 2)``, shape ``(heads, head_dim)``, ``|c[h]|^2 = D / 2``."""
    if head_dim % 4:
        raise ValueError(f"phase_pattern: head_dim must be a multiple of 4, got head_dim={head_dim}")
    d = torch.arange(head_dim, dtype=torch.float64)
    phi = math.pi / head_dim + torch.arange(heads, dtype=torch.float64)[:, None] * (math.pi / 2)
    return torch.cos(2 * math.pi * d / head_dim + phi)


def bias_amplitude(head_dim: int, margin: float = DEFAULT_MARGIN) -> float:
    """``b`` such that ``b^2 |c|^2 = b^2 D / 2 = margin * 65504``."""
    if not margin > 0:
        raise ValueError(f"bias_amplitude: margin must be positive, got margin={margin!r}")
    return math.sqrt(margin * FP16_MAX / (head_dim / 2))


def _random_orthogonal(c: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Per row of ``c``: a Gaussian direction with the row's component removed, scaled to the row's norm."""
    r = torch.randn(c.shape, generator=generator, dtype=torch.float64)
    r = r - (r * c).sum(-1, keepdim=True) / (c * c).sum(-1, keepdim=True) * c
    return r * (c.norm(dim=-1, keepdim=True) / r.norm(dim=-1, keepdim=True))


def _add_bias(linear: torch.nn.Linear, bias: torch.Tensor) -> None:
    """Add ``bias`` to ``linear.bias`` in place (the sum taken in float64)."""
    with torch.no_grad():
        linear.bias.copy_((linear.bias.double() + bias.to(torch.float64)).to(linear.bias.dtype))


def plant_resonance(attn: Attention, *, pattern: str = "in-phase", margin: float = DEFAULT_MARGIN,
                    generator: torch.Generator | None = None) -> None:
    """Add the bias ``b c`` to ``attn.to_q``'s bias and the ``pattern``'s key bias to ``attn.to_k``'s (in place).

    Both projections must have a bias (``with_qk_biases`` gives a UNet's attention modules one, listed in
    its config so that ``save_pretrained`` keeps it).  ``generator`` draws the ``"random"`` direction
    (default: torch's global generator).
    """
    if pattern not in PATTERNS:
        raise ValueError(f"plant_resonance: unknown pattern={pattern!r}; expected one of {PATTERNS}")
    if attn.to_q.bias is None or attn.to_k.bias is None:
        raise ValueError("plant_resonance: attn.to_q and attn.to_k must have a bias to plant into; make the UNet "
                         "with_qk_biases(unet, layers) first, so that its config lists them and save_pretrained "
                         "keeps what is planted")
    heads = attn.heads
    head_dim = attn.to_q.out_features // heads
    if attn.to_k.out_features != heads * head_dim:
        raise ValueError(f"plant_resonance: to_k has {attn.to_k.out_features} outputs, expected "
                         f"heads * head_dim = {heads * head_dim} (grouped keys are not supported)")
    c = phase_pattern(heads, head_dim)
    b = bias_amplitude(head_dim, margin)
    if pattern == "in-phase":
        ck = c
    elif pattern == "anti-phase":
        ck = -c
    else:
        ck = _random_orthogonal(c, generator)
    _add_bias(attn.to_q, b * c.flatten())
    _add_bias(attn.to_k, b * ck.flatten())


def build_tiny_resonant(pipe: StableVideoDiffusionPipeline, *, layers: tuple[str, ...] = PLANTED_LAYERS,
                        pattern: str = "in-phase", margin: float = DEFAULT_MARGIN,
                        generator: torch.Generator | None = None) -> StableVideoDiffusionPipeline:
    """The tiny pipeline with resonance planted in ``layers`` (paths of ``pipe.unet`` attention modules).

    Args:
        pipe: the pipeline to plant into, in place (e.g. ``load_svd("tiny")``); its UNet becomes a
            ``QKBiasUNetSpatioTemporalConditionModel`` (``with_qk_biases``) with the same weights.
        layers: module paths, e.g. ``PLANTED_LAYERS``.
        pattern: ``"in-phase"``, ``"anti-phase"`` or ``"random"`` (see the module docstring).
        margin: planted raw scores sit near ``margin * 65504``; PASA half stays finite for
            ``margin < 1 / scale = sqrt(D)``.
        generator: draws the ``"random"`` direction.

    Returns the pipeline, its config's ``_name_or_path`` set to ``"tiny-resonant"``.
    """
    modules = dict(pipe.unet.named_modules())
    for path in layers:
        if not isinstance(modules.get(path), Attention):
            raise ValueError(f"build_tiny_resonant: {path!r} is not an Attention module of the UNet")
    pipe.unet = with_qk_biases(pipe.unet, layers)
    modules = dict(pipe.unet.named_modules())
    for path in layers:
        plant_resonance(modules[path], pattern=pattern, margin=margin, generator=generator)
    pipe.register_to_config(_name_or_path="tiny-resonant")
    return pipe
