"""The samples of an evaluation: every (conditioning, seed) pair, named for files and reports.

The conditioning of an SVD sample is an image: a ``builtin:NAME`` spec or the path of an image file (the
command line expands folders and ``builtin:all`` into these, ``pasa_diffusers.cli.compare``).  That of a
video transformer's sample is a prompt, ``prompt:N`` (``prompt_spec``): the fixed prompt embeddings drawn
from seed ``N`` (``video.prompt_embeddings``, whose seed is ``video.PROMPT_SEED``), since no text encoder is
loaded.  Samples are ordered conditioning by conditioning, then seed by seed; that order is the order of
``samples.jsonl`` and of every report.
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PROMPT_PREFIX", "Sample", "prompt_spec", "make_samples", "image_identity"]

PROMPT_PREFIX = "prompt:"
"""How a prompt's spec starts: ``prompt:N``, the fixed prompt embeddings of seed ``N``."""


@dataclass(frozen=True)
class Sample:
    """One video to generate with every backend: ``image`` (an image's spec, or a prompt's: ``prompt:N``)
    conditioning it, from the noise of ``seed``.

    ``name`` is a short label of the conditioning, unique within the run and safe in a file name.
    """

    image: str
    seed: int
    name: str

    @property
    def key(self) -> tuple[str, int]:
        """``(image, seed)``: what identifies the sample in ``samples.jsonl``."""
        return self.image, self.seed

    @property
    def label(self) -> str:
        """``NAME-seedSEED``, e.g. ``rocket-seed0`` or ``prompt0-seed1`` (file names, report rows)."""
        return f"{self.name}-seed{self.seed}"


def prompt_spec(seed: int) -> str:
    """The spec of the fixed prompt embeddings of ``seed``: ``prompt:SEED``."""
    return f"{PROMPT_PREFIX}{seed}"


def _short_name(image: str) -> str:
    if image.startswith(PROMPT_PREFIX):
        return "prompt" + image.removeprefix(PROMPT_PREFIX)
    stem = image.removeprefix("builtin:") if image.startswith("builtin:") else Path(image).stem
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._") or "image"


def make_samples(images: Sequence[str], seeds: Sequence[int]) -> list[Sample]:
    """Every ``(image, seed)`` pair, image-major (``images``: image or prompt specs); repeated images or seeds
    raise ``ValueError``.

    Images with the same short name (``a/x.png`` and ``b/x.png``) are told apart as ``x``, ``x-2``, ...
    """
    for what, items in (("image", images), ("seed", seeds)):
        repeated = sorted({str(item) for item in items if list(items).count(item) > 1})
        if repeated:
            raise ValueError(f"make_samples: {what}(s) named more than once: {', '.join(repeated)}")
    if not images or not seeds:
        raise ValueError(f"make_samples: need at least one image and one seed, got {len(images)} and {len(seeds)}")
    names: dict[str, str] = {}
    taken: set[str] = set()
    for image in images:
        base = name = _short_name(image)
        count = 1
        while name in taken:
            count += 1
            name = f"{base}-{count}"
        taken.add(name)
        names[image] = name
    return [Sample(image, int(seed), names[image]) for image in images for seed in seeds]


def image_identity(image: str) -> dict[str, str | None]:
    """``{"image": spec, "sha256": digest of the file's bytes}`` (``None`` for a builtin image).

    Part of a run's identity: an image file edited between two runs into the same folder is a different
    run, not a resume.
    """
    if image.startswith("builtin:"):
        return {"image": image, "sha256": None}
    return {"image": image, "sha256": hashlib.sha256(Path(image).read_bytes()).hexdigest()}
