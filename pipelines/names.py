"""What the pipelines take by name, stated once and torch-free: built-in models, hub ids, built-in images.

``load_svd`` (``svd.py``) and the command line (``pasa_diffusers.cli.common``, which checks its
arguments before torch is imported) both read these, so a name is accepted by one exactly when it is
accepted by the other.
"""
from __future__ import annotations

__all__ = ["BUILTIN_MODELS", "BUILTIN_IMAGES", "is_hub_id"]

BUILTIN_MODELS: dict[str, str] = {
    "tiny": "an embedded random SVD built from configs: runs on a CPU in seconds",
    "tiny-resonant": "the tiny SVD with FP16 overflow planted in three layers",
    "svd-xt-random": "SVD-XT's full-size pipeline (2.25 B parameters) with seeded random weights, built from "
                     "diffusers' default configs on the device",
}
"""Models built in code (no download, no file), by name, with what each is."""

BUILTIN_IMAGES = ("astronaut", "coffee", "rocket")
"""Names accepted as ``builtin:<name>`` by ``load_image`` (images bundled with scikit-image)."""


def is_hub_id(model: str) -> bool:
    """Whether ``model`` reads as a Hugging Face hub id ``org/name``: two non-empty parts around one slash,
    and not a path (starting with ``.``, ``/`` or ``~``).  Whether it exists is the hub's answer."""
    org, slash, name = model.partition("/")
    return bool(slash and org and name) and "/" not in name and not model.startswith((".", "~"))
