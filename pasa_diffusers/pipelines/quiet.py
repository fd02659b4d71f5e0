"""Third-party noise kept out of the user's terminal: what diffusers, transformers and huggingface_hub log and warn
while a pipeline loads, unless asked for (``show``; the command line's ``--debug`` or ``PASA_DEBUG``).

Each load of a saved folder logged diffusers' advice to ``pip install accelerate`` (once per model component, so
twice for a video pipeline), a float16 pipeline moved to the CPU that it "will fail" (it runs: the PASA processors
cast q, k and v, and torch runs float16 on the CPU, slowly), an offline hub id five retries of each request.  What
these messages guard against is checked here instead, as one-line errors: weights that do not cover their config
(``checkpoints.check_weights_cover``, where diffusers logs "newly initialized"), an unreachable hub (``checkpoints.hub_unreachable``).
Errors (level ``ERROR`` and up) always pass.  The progress bars diffusers and transformers draw while loading ("Loading
pipeline components...", "Loading weights": a fraction of a second for a saved folder) are held back too: a load that
fails ends in one error line, not in bars and then the line.  (The hub's download bars, and the denoising bar, stay.)

Only the standard library is imported here: the command line calls ``show`` before torch is imported.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import warnings
from collections.abc import Iterator

from pasa_diffusers import env

__all__ = ["LIBRARIES", "BARS", "show", "shown", "quiet"]

LIBRARIES = ("diffusers", "transformers", "huggingface_hub")
"""The libraries whose logs (their root loggers) and warnings (raised from their modules) ``quiet`` holds back."""

BARS = ("diffusers", "transformers")
"""The libraries whose loading progress bars ``quiet`` holds back (``<library>.utils.logging.disable_progress_bar``)."""

_shown: bool | None = None


def show(on: bool | None) -> None:
    """Let the third-party logs and warnings through (``on``), or hold them back inside ``quiet``; ``None``: as the
    environment flag ``PASA_DEBUG`` says (the default)."""
    global _shown
    _shown = on


def shown() -> bool:
    """Whether ``quiet`` lets everything through: ``show``'s setting, else the environment flag ``PASA_DEBUG``."""
    return env.flag("PASA_DEBUG") if _shown is None else _shown


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Within the block, ``LIBRARIES`` log errors only and their warnings are dropped (unless ``shown()``)."""
    if shown():
        yield
        return
    loggers = [logging.getLogger(name) for name in LIBRARIES]
    levels = [logger.level for logger in loggers]
    bars = [importlib.import_module(f"{name}.utils.logging") for name in BARS]
    enabled = [bar.is_progress_bar_enabled() for bar in bars]
    with warnings.catch_warnings():
        for name in LIBRARIES:
            warnings.filterwarnings("ignore", module=rf"{name}(\.|$)")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        for bar in bars:
            bar.disable_progress_bar()
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)
            for bar, on in zip(bars, enabled):
                if on:
                    bar.enable_progress_bar()
