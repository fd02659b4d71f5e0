"""Conditioning images: any file PIL opens, read as the 8-bit RGB picture it shows.

``read_rgb`` decodes the first frame of a file, turns it upright by its EXIF orientation and converts
every mode PIL opens to 8-bit RGB:

- 16-bit grayscale (``I;16``, ``I;16B``, ...) is scaled from ``[0, 65535]`` to ``[0, 255]``
  (``round(v / 257)``), not clipped at 255 as PIL's ``convert`` does; 32-bit integer ``I`` (PIL's
  mode for 16-bit PGM/PPM files) takes the same scale when its values lie in ``[0, 65535]``;
- float ``F`` is scaled from ``[0, 1]`` when its values lie there;
- either of those, when a TIFF declares its sample range (``SMinSampleValue``/``SMaxSampleValue`` or
  ``MinSampleValue``/``MaxSampleValue``), is scaled from that range; else from the values' own
  ``[min, max]``, with a notice; a float image with NaN or infinite values, or a single value out of
  range, is refused (``ImageError``);
- CIELAB (``LAB``, TIFF's photometric 8) is converted to sRGB with TIFF 6.0's D65 white by scikit-image
  (PIL's own conversion is off by up to 89 of 255), out-of-gamut colours clipped;
- 16-bit RGB is already 8-bit RGB once PIL opens it (it keeps the high byte); palette, ``1``, ``L``,
  ``CMYK``, ``YCbCr`` and ``RGBX`` take PIL's own conversion;
- transparency (``RGBA``, ``LA``, ``PA``, a palette's or a colour's ``transparency``) is composited on a
  white background (``BACKGROUND``), with a notice naming the share of pixels that were not opaque; a
  fully opaque alpha channel is dropped without one.

Notices go to the ``pasa_diffusers`` logger (one line on stderr when logging is not configured), once per
message and process.  The module imports only PIL (numpy and scikit-image when an image needs them),
so the command line can check an ``--image`` before torch is imported.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import PIL.Image
import PIL.ImageOps

from .names import BUILTIN_IMAGES

__all__ = ["BACKGROUND", "ImageError", "read_rgb", "load_image"]

BACKGROUND = (255, 255, 255)
"""What transparent pixels are composited on: white."""

_HIGH_DEPTH = ("I", "I;16", "I;16B", "I;16L", "I;16N", "F")
"""Modes PIL's ``convert`` clips to 8 bits instead of scaling: grayscale with 16-bit, 32-bit or float values."""
_NATURAL_RANGE = {"I": (0.0, 65535.0), "F": (0.0, 1.0)}
"""The range a mode's values are read in when they lie in it and no range is declared (``I;16*``: always 16-bit)."""
_RANGE_TAGS = ((340, 341), (280, 281))
"""TIFF tags that declare the sample range: SMinSampleValue/SMaxSampleValue, MinSampleValue/MaxSampleValue
(a minimum not given is 0)."""

logger = logging.getLogger("pasa_diffusers")
_NOTICED: set[str] = set()


class ImageError(ValueError):
    """A file that cannot be read as an RGB picture; the message says why (without the file's name)."""


def _notice(message: str) -> None:
    if message not in _NOTICED:
        _NOTICED.add(message)
        logger.warning(message)


def _sample(value: Any) -> float:
    """A TIFF sample-value tag's value (one per channel: the first)."""
    return float(value[0] if isinstance(value, tuple) else value)


def _declared_range(image: PIL.Image.Image) -> tuple[float, float] | None:
    """The sample range a TIFF file declares, or ``None``."""
    tags = getattr(image, "tag_v2", None)
    for low, high in _RANGE_TAGS:
        if tags is not None and high in tags:
            lo, hi = _sample(tags.get(low, 0)), _sample(tags[high])
            if hi > lo:
                return lo, hi
    return None


def _value_range(values: Any, mode: str, declared: tuple[float, float] | None, name: str) -> tuple[float, float]:
    """The range that maps to ``[0, 255]``: declared, 16-bit, the mode's natural range, or the values' own."""
    import numpy as np

    finite = np.isfinite(values)
    if not finite.all():
        raise ImageError(f"mode {mode} image holds {values.size - int(finite.sum())} NaN or infinite value(s) of "
                         f"{values.size}; no picture to read")
    if declared is not None:
        return declared
    if mode.startswith("I;16"):
        return 0.0, 65535.0
    lo, hi = float(values.min()), float(values.max())
    natural = _NATURAL_RANGE[mode]
    if natural[0] <= lo and hi <= natural[1]:
        return natural
    if lo == hi:
        raise ImageError(f"mode {mode} image holds the single value {lo:g}, outside [{natural[0]:g}, "
                         f"{natural[1]:g}]; no range to scale it from")
    _notice(f"load_image: {name} (mode {mode}) holds values in [{lo:g}, {hi:g}], outside [{natural[0]:g}, "
            f"{natural[1]:g}], and declares no range; scaled from [{lo:g}, {hi:g}] to 8 bits")
    return lo, hi


def _gray_to_8_bits(image: PIL.Image.Image, declared: tuple[float, float] | None, name: str) -> PIL.Image.Image:
    """A 16-bit, 32-bit or float grayscale image as ``L`` (``LA`` when a value is marked transparent)."""
    import numpy as np

    values = np.asarray(image, dtype=np.float64)
    lo, hi = _value_range(values, image.mode, declared, name)
    gray = PIL.Image.fromarray(np.rint((values - lo) * (255 / (hi - lo))).clip(0, 255).astype(np.uint8))
    transparent = image.info.get("transparency")
    if not isinstance(transparent, (int, float)):
        return gray
    alpha = PIL.Image.fromarray(np.where(values == transparent, 0, 255).astype(np.uint8))
    return PIL.Image.merge("LA", (gray, alpha))


def _lab_to_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """A ``LAB`` image as 8-bit sRGB, D65 white.  Its bytes (``tobytes``, as in TIFF) hold L* scaled to
    [0, 255] and a*, b* as signed bytes."""
    import warnings

    import numpy as np
    import skimage.color

    raw = np.asarray(image)
    lab = np.stack([raw[..., 0] * (100 / 255), raw[..., 1].view(np.int8), raw[..., 2].view(np.int8)],
                   axis=-1).astype(np.float64)
    with warnings.catch_warnings():  # out-of-gamut colours: clipped to sRGB, as every converter does
        warnings.simplefilter("ignore", UserWarning)
        rgb = skimage.color.lab2rgb(lab, illuminant="D65")
    return PIL.Image.fromarray(np.rint(rgb * 255).astype(np.uint8))


def _has_alpha(image: PIL.Image.Image) -> bool:
    return image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info


def _on_background(image: PIL.Image.Image, mode: str, name: str) -> PIL.Image.Image:
    """An image with transparency composited on ``BACKGROUND``, with a notice (naming the file's ``mode``)
    unless it is opaque."""
    rgba = image.convert("RGBA")
    opaque = rgba.getchannel("A").histogram()[255]
    pixels = rgba.width * rgba.height
    if opaque == pixels:
        return rgba.convert("RGB")
    _notice(f"load_image: {name} (mode {mode}) has {pixels - opaque} of {pixels} pixels not opaque "
            f"({1 - opaque / pixels:.1%}); composited on a white background")
    background = PIL.Image.new("RGBA", rgba.size, (*BACKGROUND, 255))
    return PIL.Image.alpha_composite(background, rgba).convert("RGB")


def _to_rgb(image: PIL.Image.Image, declared: tuple[float, float] | None, name: str) -> PIL.Image.Image:
    """``image`` in any mode as 8-bit RGB (the module docstring states how each mode is read)."""
    mode = image.mode
    if mode in _HIGH_DEPTH:
        image = _gray_to_8_bits(image, declared, name)
    elif mode == "LAB":
        image = _lab_to_rgb(image)
    return _on_background(image, mode, name) if _has_alpha(image) else image.convert("RGB")


def read_rgb(path: str | os.PathLike) -> PIL.Image.Image:
    """The image file at ``path`` as 8-bit RGB: its first frame, upright by its EXIF orientation.

    Raises:
        ImageError: PIL cannot decode the file, or its values give no picture (NaN or infinite floats,
            a single value out of range).
    """
    try:
        with PIL.Image.open(path) as opened:
            opened.load()
            declared = _declared_range(opened)
            image = PIL.ImageOps.exif_transpose(opened)
    except Exception as exc:  # PIL raises many types for a file that is not an image, or a truncated one
        raise ImageError(f"not a readable image ({type(exc).__name__}: {exc})") from exc
    return _to_rgb(image, declared, os.fspath(path))


def _builtin(name: str) -> PIL.Image.Image:
    import skimage.data

    return PIL.Image.fromarray(getattr(skimage.data, name)()).convert("RGB")


def load_image(spec: str | os.PathLike, size: int | tuple[int, int] | None = None) -> PIL.Image.Image:
    """Load an RGB conditioning image.

    Args:
        spec: an image file path (read by ``read_rgb``: any mode PIL opens), or ``builtin:<name>`` with a
            name from ``BUILTIN_IMAGES`` (scikit-image's bundled data, no download).
        size: ``(width, height)`` or one int for a square; the image is centre-cropped to that aspect
            ratio and resized (bicubic).  ``None`` keeps the original size.

    Raises:
        ValueError: an unknown builtin name; ``ImageError`` (a ``ValueError``) for a file that cannot
            be read as a picture, its name in the message.
        FileNotFoundError: no such file.
    """
    text = os.fspath(spec)
    if text.startswith("builtin:"):
        name = text.removeprefix("builtin:")
        if name not in BUILTIN_IMAGES:
            choices = ", ".join(f"builtin:{n}" for n in BUILTIN_IMAGES)
            raise ValueError(f"load_image: unknown builtin image spec={text!r}; expected one of {choices}")
        image = _builtin(name)
    else:
        path = Path(text).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"load_image: no such image file spec={text!r}")
        try:
            image = read_rgb(path)
        except ImageError as exc:
            raise ImageError(f"load_image: spec={text!r}: {exc}") from exc
    if size is not None:
        width, height = (size, size) if isinstance(size, int) else size
        image = PIL.ImageOps.fit(image, (width, height), method=PIL.Image.Resampling.BICUBIC)
    return image
