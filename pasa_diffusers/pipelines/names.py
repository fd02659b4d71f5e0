"""What the pipelines take by name, stated once and torch-free: built-in models, hub ids, built-in images.

``load_svd`` (``svd.py``), ``load_video`` (``video.py``) and the command line (``pasa_diffusers.cli.common``,
which checks its arguments before torch is imported) all read these, so a name is accepted by a loader
exactly when the command line accepts it.
"""
from __future__ import annotations

__all__ = ["BUILTIN_MODELS", "BUILTIN_VIDEO_MODELS", "TINY_VIDEO_PIPELINES", "TINY_VIDEO_SETTINGS",
           "ALL_BUILTIN_MODELS", "BUILTIN_IMAGES", "is_hub_id", "COVERAGE_MASKS"]

BUILTIN_MODELS: dict[str, str] = {
    "tiny": "an embedded random SVD built from configs: runs on a CPU in seconds",
    "tiny-resonant": "the tiny SVD with FP16 overflow planted in three layers",
    "svd-xt-random": "SVD-XT's full-size pipeline (2.25 B parameters) with seeded random weights, built from "
                     "diffusers' default configs on the device",
}
"""SVD pipelines built in code (no download, no file), by name, with what each is (``svd.load_svd``)."""

TINY_VIDEO_PIPELINES: dict[str, tuple[str, str]] = {"tiny-wan": ("Wan 2.1", "WanPipeline"), "tiny-ltx-video": ("LTX-Video", "LTXPipeline"),
                   "tiny-cogvideox": ("CogVideoX", "CogVideoXPipeline"),
                   "tiny-hunyuan-video": ("HunyuanVideo", "HunyuanVideoPipeline"), "tiny-mochi": ("Mochi", "MochiPipeline")}
"""Built-in video model name -> (the model it is a tiny random version of, its diffusers pipeline class)."""
BUILTIN_VIDEO_MODELS: dict[str, str] = {
    name: f"an embedded {family} text-to-video pipeline ({cls}: tiny transformer and VAE) with random weights, built "
          "from configs: runs on a CPU in seconds" for name, (family, cls) in TINY_VIDEO_PIPELINES.items()
}
"""Video-transformer pipelines built in code, by name, with what each is (``video.load_video``)."""

TINY_VIDEO_SETTINGS: dict[str, dict[str, int]] = {
    "tiny-wan": {"num_frames": 9, "height": 64, "width": 64},
    "tiny-ltx-video": {"num_frames": 17, "height": 128, "width": 128},
    "tiny-cogvideox": {"num_frames": 9, "height": 64, "width": 64},
    "tiny-hunyuan-video": {"num_frames": 9, "height": 64, "width": 64},
    "tiny-mochi": {"num_frames": 13, "height": 64, "width": 64},
}
"""Built-in video model -> frames and size of its generations: each 3 latent frames and 48 video tokens in all, as
``video_dits.example_inputs`` (Wan, CogVideoX and HunyuanVideo: latents of 8 x 8, VAE 8x in space and 4x in time,
patch 2; LTX-Video: latents of 4 x 4, VAE 32x in space and 8x in time, patch 1; Mochi: latents of 8 x 8, VAE 8x
in space and 6x in time, patch 2)."""

ALL_BUILTIN_MODELS: dict[str, str] = {**BUILTIN_MODELS, **BUILTIN_VIDEO_MODELS}
"""Every model built in code: what ``--model`` takes besides a hub id or a folder."""

BUILTIN_IMAGES = ("astronaut", "coffee", "rocket")
"""Names accepted as ``builtin:<name>`` by ``load_image`` (images bundled with scikit-image)."""


def is_hub_id(model: str) -> bool:
    """Whether ``model`` reads as a Hugging Face hub id ``org/name``: two non-empty parts around one slash,
    and not a path (starting with ``.``, ``/`` or ``~``).  Whether it exists is the hub's answer."""
    org, slash, name = model.partition("/")
    return bool(slash and org and name) and "/" not in name and not model.startswith((".", "~"))

COVERAGE_MASKS: dict[str, str] = {
    "tile-window": "static: the key blocks within a (frames, rows, columns) window of the query block's tokens",
    "radial": "static: Radial Attention's energy decay, the spatial window halving as the temporal distance doubles",
    "pooled": "dynamic: per query block the key blocks of largest pooled q.k score, up to a share of the mass",
}
"""The block-sparse masks (``video_masks.MASK_KINDS``, built by ``video_masks.MaskChoice``) that ``pasa coverage``
measures and the sparse backends run, with what each keeps."""
