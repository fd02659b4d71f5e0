"""Random-weight versions of diffusers' video transformers, built from configs, and inputs to run them.

Tiny ones, one per family the package serves: Wan 2.1 / 2.2 (``WanTransformer3DModel``), HunyuanVideo,
LTX-Video, CogVideoX and Mochi.  Each keeps what its attention does (QK RMSNorm, RoPE, joined or
separate text tokens, text padding masks, cross-attention) at sizes that run on two CPU cores in well
under a second, with head dims the PASA op takes (16 and 32).  Seeded: the same family gives the same
weights.  Full-size ones (``FULL_SIZE``: the released configs of Wan 2.1 1.3B and 14B, CogVideoX-5B,
HunyuanVideo, LTX-Video 0.9 and Mochi 1 preview), built directly on the device, with the inputs their
pipelines give them at their video sizes (``VIDEO_SIZES``), for time and memory at the real sizes (random
weights say nothing of quality).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from diffusers import (AutoencoderKLCogVideoX, AutoencoderKLHunyuanVideo, AutoencoderKLLTXVideo, AutoencoderKLMochi,
                       AutoencoderKLWan, CogVideoXTransformer3DModel, HunyuanVideoTransformer3DModel,
                       LTXVideoTransformer3DModel, MochiTransformer3DModel, WanTransformer3DModel)

from pasa_diffusers.video_masks import VideoTokens

__all__ = ["FAMILIES", "FULL_SIZE", "LATENTS", "JOINT_FAMILIES", "JOINT_TEXT_AT", "VIDEO_SIZES", "tiny_transformer", "tiny_wan_vae", "tiny_ltx_video_vae",
           "tiny_cogvideox_vae", "tiny_hunyuan_video_vae", "tiny_mochi_vae", "full_size_transformer", "example_inputs",
           "full_size_inputs", "video_tokens", "full_size_tokens"]

TEXT_TOKENS = 7
"""Text tokens of the example prompts (the last two are padding where the family takes a mask)."""


def _wan() -> torch.nn.Module:
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                 out_channels=4, text_dim=24, freq_dim=32, ffn_dim=48, num_layers=2,
                                 rope_max_seq_len=32)


def _hunyuan() -> torch.nn.Module:
    return HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=32,
                                          num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2,
                                          patch_size_t=1, text_embed_dim=24, pooled_projection_dim=12,
                                          rope_axes_dim=(8, 12, 12))


def _ltx() -> torch.nn.Module:
    return LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16,
                                      cross_attention_dim=32, num_layers=2, caption_channels=24)


def _cogvideox() -> torch.nn.Module:
    return CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                                       time_embed_dim=16, text_embed_dim=24, num_layers=2, sample_width=8,
                                       sample_height=8, sample_frames=9, patch_size=2, temporal_compression_ratio=4,
                                       max_text_seq_length=TEXT_TOKENS)


def _mochi() -> torch.nn.Module:
    return MochiTransformer3DModel(patch_size=2, num_attention_heads=2, attention_head_dim=16, num_layers=2,
                                   pooled_projection_dim=16, in_channels=4, text_embed_dim=24, time_embed_dim=16,
                                   max_sequence_length=TEXT_TOKENS)


FAMILIES: dict[str, Callable[[], torch.nn.Module]] = {
    "wan": _wan, "hunyuan-video": _hunyuan, "ltx-video": _ltx, "cogvideox": _cogvideox, "mochi": _mochi,
}
"""Family name -> builder of its tiny transformer."""


def tiny_transformer(family: str, *, seed: int = 0) -> torch.nn.Module:
    """The tiny random transformer of ``family`` (one of ``FAMILIES``), fp32, eval mode, seeded."""
    if family not in FAMILIES:
        raise ValueError(f"tiny_transformer: unknown family={family!r}; expected one of {tuple(FAMILIES)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return FAMILIES[family]().eval()


def _text_mask(batch: int) -> torch.Tensor:
    mask = torch.ones(batch, TEXT_TOKENS, dtype=torch.long)
    mask[:, -2:] = 0
    return mask


def example_inputs(family: str, model: torch.nn.Module, gen: torch.Generator, batch: int = 2) -> dict[str, Any]:
    """Keyword arguments of one forward of ``model`` (``tiny_transformer(family)``): 3 latent frames of 8 x 8
    (CogVideoX: its sample size), a text prompt of ``TEXT_TOKENS`` tokens (masked where the family takes a
    mask), timestep 500, in the model's dtype."""
    dtype = next(model.parameters()).dtype
    cfg = model.config

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    timestep = torch.full((batch,), 500, dtype=torch.long)
    if family == "wan":
        return {"hidden_states": randn(batch, cfg.in_channels, 3, 8, 8), "timestep": timestep,
                "encoder_hidden_states": randn(batch, TEXT_TOKENS, cfg.text_dim), "return_dict": False}
    if family == "hunyuan-video":
        return {"hidden_states": randn(batch, cfg.in_channels, 3, 8, 8), "timestep": timestep,
                "encoder_hidden_states": randn(batch, TEXT_TOKENS, cfg.text_embed_dim),
                "encoder_attention_mask": _text_mask(batch), "pooled_projections": randn(batch, cfg.pooled_projection_dim),
                "guidance": torch.full((batch,), 6000.0, dtype=dtype), "return_dict": False}
    if family == "ltx-video":
        frames, height, width = 3, 4, 4
        return {"hidden_states": randn(batch, frames * height * width, cfg.in_channels),
                "encoder_hidden_states": randn(batch, TEXT_TOKENS, cfg.caption_channels), "timestep": timestep,
                "encoder_attention_mask": _text_mask(batch), "num_frames": frames, "height": height, "width": width,
                "return_dict": False}
    if family == "cogvideox":
        frames = (cfg.sample_frames - 1) // cfg.temporal_compression_ratio + 1
        return {"hidden_states": randn(batch, frames, cfg.in_channels, cfg.sample_height, cfg.sample_width),
                "encoder_hidden_states": randn(batch, TEXT_TOKENS, cfg.text_embed_dim), "timestep": timestep,
                "return_dict": False}
    return {"hidden_states": randn(batch, cfg.in_channels, 3, 8, 8),
            "encoder_hidden_states": randn(batch, TEXT_TOKENS, cfg.text_embed_dim), "timestep": timestep,
            "encoder_attention_mask": _text_mask(batch), "return_dict": False}


FULL_SIZE: dict[str, tuple[type, dict[str, Any], str]] = {
    "wan2.1-1.3b": (WanTransformer3DModel, dict(num_attention_heads=12, ffn_dim=8960, num_layers=30), "wan"),
    "wan2.1-14b": (WanTransformer3DModel, {}, "wan"),  # the class defaults are the 14B model's
    "cogvideox-5b": (CogVideoXTransformer3DModel, dict(num_attention_heads=48, num_layers=42, time_embed_dim=512,
                                                       max_text_seq_length=226, use_rotary_positional_embeddings=True),
                     "cogvideox"),
    # hunyuanvideo-community/HunyuanVideo, transformer/config.json: diffusers' class defaults (20 double-stream and
    # 40 single-stream blocks, 24 heads x 128, 2 text-refiner blocks, text 4096 wide (LLaVA-LLaMA-3), pooled CLIP
    # 768, guidance embedding, patch 1 x 2 x 2, RoPE axes (16, 56, 56) with theta 256)
    "hunyuan-video": (HunyuanVideoTransformer3DModel, {}, "hunyuan-video"),
    # Lightricks/LTX-Video, the 2B transformer of 0.9.0-0.9.5 (transformer/config.json): diffusers' class defaults
    # (28 layers, 32 heads x 64, cross-attention to T5 captions 4096 -> 2048 wide, 128 latent channels, patch 1,
    # QK RMSNorm across heads); that 0.9.1-0.9.5 keep 0.9.0's transformer config is from memory (they changed the
    # VAE and the scheduler); 0.9.7's 13B (48 layers, 32 x 128) is another config
    "ltx-video": (LTXVideoTransformer3DModel, {}, "ltx-video"),
    # genmo/mochi-1-preview, transformer/config.json: diffusers' class defaults (48 layers, 24 heads x 128, the
    # text stream 1536 wide, T5 text 4096, 12 latent channels, patch 2, 256 text tokens)
    "mochi-1": (MochiTransformer3DModel, {}, "mochi"),
}
"""Name -> (class, the config's differences from the class defaults, family).

Parameters (counted on the meta device, diffusers 0.42.1; the published figure in brackets, rounded): Wan 2.1
1.3B 1,418,996,800 ("1.3B"), Wan 2.1 14B 14,288,491,584 ("14B"), CogVideoX-5B 5,570,283,072 ("5B"),
HunyuanVideo 12,821,012,544 ("13B"; 12.8B is what its 25.6 GB bf16 checkpoint holds, a size from memory),
LTX-Video 1,923,385,472 ("2B"), Mochi 1 preview 10,027,677,744 ("10B").  The same configs with the hub's
weights make the released models; with random weights they say nothing of quality.
"""

RESOLUTIONS = {"480p": (480, 832), "720p": (720, 1280)}
"""Wan's video sizes (height, width); 81 frames."""


class Latent(NamedTuple):
    """How a family's pipeline turns a video into transformer tokens, and what it feeds the transformer."""

    time: int          # the VAE's temporal compression: f frames -> (f - 1) // time + 1 latent frames
    space: int         # the VAE's spatial compression
    patch_t: int       # the transformer's patch in latent frames
    patch: int         # the transformer's patch in latent pixels (each side)
    text_tokens: int   # the pipeline's padded prompt length
    batch: int         # transformer batch per denoising step: 2 with classifier-free guidance, 1 with embedded


LATENTS: dict[str, Latent] = {
    "wan": Latent(4, 8, 1, 2, 512, 2),
    "cogvideox": Latent(4, 8, 1, 2, 226, 2),         # CogVideoX 1.0: no temporal patch
    "hunyuan-video": Latent(4, 8, 1, 2, 256, 1),     # embedded guidance 6.0, true CFG off by default
    "ltx-video": Latent(8, 32, 1, 1, 128, 2),
    "mochi": Latent(6, 8, 1, 2, 256, 2),
}
"""Family -> its ``Latent`` (from diffusers' pipelines: their VAE ratios and ``__call__`` defaults)."""

JOINT_FAMILIES = ("cogvideox", "hunyuan-video", "mochi")
"""Video families whose transformer attends over the video and text tokens together (one joint attention); Wan
and LTX-Video attend over the video (self) and the text (cross) apart."""


JOINT_TEXT_AT: dict[str, str] = {"cogvideox": "first", "hunyuan-video": "last", "mochi": "last"}
"""Family -> where its joint attention puts the text tokens: before the video tokens (CogVideoX joins
``[text, video]``) or after them (HunyuanVideo's dual- and single-stream blocks and Mochi join ``[video, text]``)."""


VIDEO_SIZES: dict[str, dict[str, tuple[int, int, int]]] = {
    "wan": {name: (81, height, width) for name, (height, width) in RESOLUTIONS.items()},
    "cogvideox": {"480x720x49": (49, 480, 720)},
    "hunyuan-video": {"720p": (129, 720, 1280), "540p": (129, 544, 960)},
    "ltx-video": {"512x704x161": (161, 512, 704)},
    "mochi": {"480x848x19": (19, 480, 848), "480x848x163": (163, 480, 848)},
}
"""Family -> size name -> (frames, height, width); the first is the pipeline's default.  Video tokens
(``video_tokens``; the text tokens of ``LATENTS`` come on top, joined to the video's in CogVideoX, HunyuanVideo
and Mochi, cross-attended in Wan and LTX-Video):

- Wan 2.1 (``WanPipeline``: 81 frames of 480 x 832; 8x / 4x VAE, patch 2 x 2): 480p 21 x 30 x 52 = 32,760;
  720p 21 x 45 x 80 = 75,600.
- CogVideoX-5B (its transformer's sample size, 49 frames of 480 x 720; 8x / 4x, patch 2): 13 x 30 x 45 = 17,550
  + 226 text.
- HunyuanVideo (``HunyuanVideoPipeline``: 129 frames of 720 x 1280; 8x / 4x, patch 2 x 2): 720p 33 x 45 x 80 =
  118,800 + 256 text; 540p (544 x 960, the other size its README lists; from memory) 33 x 34 x 60 = 67,320 + 256.
- LTX-Video (``LTXPipeline``: 161 frames of 512 x 704 at 25 fps; 32x / 8x VAE, patch 1): 21 x 16 x 22 = 7,392,
  cross-attending 128 text tokens.
- Mochi 1 (``MochiPipeline``: 19 frames of 480 x 848; 8x / 6x, patch 2): 4 x 30 x 53 = 6,360 + 256 text; at the
  163 frames (5.4 s at 30 fps) of genmo's own examples (from memory) 28 x 30 x 53 = 44,520 + 256.
"""


def _size(name: str, resolution: str | None, frames: int | None) -> tuple[Latent, int, int, int]:
    family = FULL_SIZE[name][2]
    sizes = VIDEO_SIZES[family]
    resolution = next(iter(sizes)) if resolution is None else resolution
    if resolution not in sizes:
        raise ValueError(f"{name}: unknown resolution={resolution!r}; expected one of {tuple(sizes)}")
    latent = LATENTS[family]
    default_frames, height, width = sizes[resolution]
    frames = default_frames if frames is None else frames
    if (frames - 1) % latent.time:
        raise ValueError(f"{name}: frames={frames} is not {latent.time}k + 1 (its VAE's temporal compression)")
    return latent, frames, height, width


def video_tokens(name: str, resolution: str | None = None, *, frames: int | None = None) -> int:
    """The video tokens of one forward of the ``FULL_SIZE`` model ``name`` at ``resolution`` (a name of its family's
    ``VIDEO_SIZES``; ``None``: the first) and ``frames`` (``None``: the size's)."""
    return full_size_tokens(name, resolution, frames=frames).n_video


def full_size_tokens(name: str, resolution: str | None = None, *, frames: int | None = None) -> VideoTokens:
    """The self-attention sequence of one forward of the ``FULL_SIZE`` model ``name`` (``full_size_inputs``): the
    video tokens' grid (latent frames over the temporal patch, rows and columns over the patch) and the text
    tokens a joint attention adds (``JOINT_TEXT_AT``)."""
    if name not in FULL_SIZE:
        raise ValueError(f"full_size_tokens: unknown name={name!r}; expected one of {tuple(FULL_SIZE)}")
    latent, frames, height, width = _size(name, resolution, frames)
    latent_frames = (frames - 1) // latent.time + 1
    side = latent.space * latent.patch
    family = FULL_SIZE[name][2]
    text, where = (latent.text_tokens, JOINT_TEXT_AT[family]) if family in JOINT_FAMILIES else (0, "first")
    return VideoTokens(latent_frames // latent.patch_t, height // side, width // side, text=text, text_at=where)


def full_size_transformer(name: str, *, device: str | torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """The full-size transformer ``name`` (one of ``FULL_SIZE``) with seeded random weights, built on ``device``
    (in fp32, then cast to ``dtype``), eval mode.  ``device="meta"`` builds it without memory (no weights)."""
    if name not in FULL_SIZE:
        raise ValueError(f"full_size_transformer: unknown name={name!r}; expected one of {tuple(FULL_SIZE)}")
    cls, config, _ = FULL_SIZE[name]
    with torch.random.fork_rng(devices=[torch.device(device)] if torch.device(device).type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = cls(**config)
    # as from_pretrained(torch_dtype=...): the modules the model keeps in fp32 stay fp32
    torch.nn.Module.to(model, dtype)
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for tensor_name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if keep & set(tensor_name.split(".")):
            tensor.data = tensor.data.float()
    return model.eval()


def full_size_inputs(name: str, model: torch.nn.Module, resolution: str | None = None, *, batch: int | None = None,
                     frames: int | None = None) -> dict[str, Any]:
    """One forward's inputs of the ``FULL_SIZE`` model ``name`` as its pipeline calls it, at ``resolution`` (a name
    of the family's ``VIDEO_SIZES``; ``None``: the pipeline's default size) and ``frames`` (``None``: the size's),
    on the model's device and dtype: ``batch`` the pipeline's (``None``: ``LATENTS``: 2, classifier-free guidance,
    or HunyuanVideo's 1), the text its padded prompt length (every token kept where the family takes a mask;
    HunyuanVideo with pooled embeddings and guidance 6.0, LTX-Video with its RoPE scale at 25 fps), timestep 500.
    On the meta device the tensors hold no values."""
    latent, frames, height, width = _size(name, resolution, frames)
    family = FULL_SIZE[name][2]
    batch = latent.batch if batch is None else batch
    # the dtype of the weights most of the model holds (some modules stay fp32)
    param = max(model.parameters(), key=lambda p: p.numel())
    device = param.device
    gen = None if device.type == "meta" else torch.Generator(device=device).manual_seed(1)
    cfg = model.config

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(param.dtype)

    frames_lat = (frames - 1) // latent.time + 1
    height_lat, width_lat = height // latent.space, width // latent.space
    video = (batch, cfg.in_channels, frames_lat, height_lat, width_lat)
    timestep = torch.full((batch,), 500, dtype=torch.long, device=device)
    kept = torch.ones(batch, latent.text_tokens, dtype=torch.long, device=device)
    if family == "wan":
        return {"hidden_states": randn(*video), "timestep": timestep,
                "encoder_hidden_states": randn(batch, latent.text_tokens, cfg.text_dim), "return_dict": False}
    if family == "cogvideox":
        return {"hidden_states": randn(batch, frames_lat, cfg.in_channels, height_lat, width_lat),
                "encoder_hidden_states": randn(batch, latent.text_tokens, cfg.text_embed_dim),
                "timestep": timestep, "return_dict": False}
    if family == "hunyuan-video":
        return {"hidden_states": randn(*video), "timestep": timestep,
                "encoder_hidden_states": randn(batch, latent.text_tokens, cfg.text_embed_dim),
                "encoder_attention_mask": kept, "pooled_projections": randn(batch, cfg.pooled_projection_dim),
                "guidance": torch.full((batch,), 6000.0, dtype=param.dtype, device=device), "return_dict": False}
    if family == "ltx-video":  # packed latents (B, f h w, C), as LTXPipeline._pack_latents with patch 1
        return {"hidden_states": randn(batch, frames_lat * height_lat * width_lat, cfg.in_channels),
                "encoder_hidden_states": randn(batch, latent.text_tokens, cfg.caption_channels),
                "timestep": timestep, "encoder_attention_mask": kept, "num_frames": frames_lat, "height": height_lat,
                "width": width_lat,
                "rope_interpolation_scale": (latent.time / 25, latent.space, latent.space), "return_dict": False}
    return {"hidden_states": randn(*video),
            "encoder_hidden_states": randn(batch, latent.text_tokens, cfg.text_embed_dim), "timestep": timestep,
            "encoder_attention_mask": kept, "return_dict": False}


def tiny_wan_vae(*, seed: int = 0) -> torch.nn.Module:
    """A tiny random ``AutoencoderKLWan`` for ``tiny_transformer("wan")`` (4 latent channels), fp32, eval mode,
    seeded: Wan's compression (8x in space, 4x in time: three downsamplings, the last two also temporal, causal
    3D convolutions) at 8 base channels, one residual block per level, latents neither shifted nor scaled."""
    channels = 4  # the in_channels of _wan()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(base_dim=8, z_dim=channels, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True], latents_mean=[0.0] * channels,
                               latents_std=[1.0] * channels)
    return vae.eval()


def tiny_ltx_video_vae(*, seed: int = 0) -> torch.nn.Module:
    """A tiny random ``AutoencoderKLLTXVideo`` for ``tiny_transformer("ltx-video")`` (8 latent channels), fp32, eval
    mode, seeded: LTX-Video's compression (32x in space: a 4 x 4 patchify then three downsamplings; 8x in time:
    the same three also temporal) at 8 channels per level, one residual block per level, and its decoder
    conditioned on the decode timestep as LTX-Video 0.9.1's is; latents neither shifted nor scaled."""
    channels = 8  # the in_channels of _ltx()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLLTXVideo(latent_channels=channels, block_out_channels=(8, 8, 8, 8),
                                    decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                                    decoder_layers_per_block=(1, 1, 1, 1, 1), timestep_conditioning=True)
    return vae.eval()


def tiny_cogvideox_vae(*, seed: int = 0) -> torch.nn.Module:
    """A tiny random ``AutoencoderKLCogVideoX`` for ``tiny_transformer("cogvideox")`` (4 latent channels), fp32, eval
    mode, seeded: CogVideoX's compression (8x in space: three downsamplings; 4x in time: 2k + 1 latent frames
    decode to 8k + 1 frames) at 8 channels per level in 2 norm groups, one
    residual block per level, latents not scaled (scaling factor 1)."""
    channels = 4  # the in_channels of _cogvideox()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLCogVideoX(block_out_channels=(8, 8, 8, 8), latent_channels=channels, layers_per_block=1,
                                     norm_num_groups=2, sample_height=64, sample_width=64, scaling_factor=1.0)
    return vae.eval()


def tiny_hunyuan_video_vae(*, seed: int = 0) -> torch.nn.Module:
    """A tiny random ``AutoencoderKLHunyuanVideo`` for ``tiny_transformer("hunyuan-video")`` (4 latent channels), fp32,
    eval mode, seeded: HunyuanVideo's compression (8x in space: three downsamplings; 4x in time: the last two also
    temporal, causal 3D convolutions, so f latent frames decode to 4(f - 1) + 1 frames) and its mid-block
    attention, at 8 channels per level in 2 norm groups, one residual block per level, latents not scaled
    (scaling factor 1; the released VAE's is 0.476986)."""
    channels = 4  # the in_channels of _hunyuan()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLHunyuanVideo(latent_channels=channels, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                                        norm_num_groups=2, scaling_factor=1.0)
    return vae.eval()


def tiny_mochi_vae(*, seed: int = 0) -> torch.nn.Module:
    """A tiny random ``AutoencoderKLMochi`` for ``tiny_transformer("mochi")`` (4 latent channels), fp32, eval mode,
    seeded: Mochi's compression, which ``MochiPipeline`` assumes (8x in space, 6x in time: expansions 1, 2, 3;
    f latent frames decode to 6(f - 1) + 1 frames), at 32 channels per level (its group norms have 32 groups),
    one residual block per level, latents neither shifted nor scaled."""
    channels = 4  # the in_channels of _mochi()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLMochi(latent_channels=channels, encoder_block_out_channels=(32, 32, 32, 32),
                                 decoder_block_out_channels=(32, 32, 32, 32), layers_per_block=(1, 1, 1, 1, 1),
                                 latents_mean=(0.0,) * channels, latents_std=(1.0,) * channels, scaling_factor=1.0)
    return vae.eval()
