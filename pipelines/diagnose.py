"""Overflow diagnosis of one SVD generation: which attention layers overflow in FP16, and why.

``diagnose`` records every attention call of ``pipe.unet`` during one real generation
(``pasa_diffusers.diagnose.recording`` with a ``DiagnosticAttnProcessor`` per layer around
``svd.generate``, the pipeline's step callback advancing the step clock), summarises the layers
(``pasa_diffusers.diagnose.summarize``, with the module kinds of ``install.module_kind``: risk and cause
as in ``pasa_diffusers/diagnose/rules.py``) and times a plain generation for the overhead.  The
diagnostic processors compute the stock attention, so the video is the one the pipeline makes without
them.  Render the result with ``pasa_diffusers.diagnose.risk_table`` and ``write_diagnosis``.
"""
from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
import torch

from pasa_diffusers.beta import DEFAULT_BETA
from pasa_diffusers.diagnose import CAUSE_RULE, RISK_RULE, LayerRecorder, StepClock, recording, summarize
from pasa_diffusers.install import module_kind
from pasa_diffusers.metrics.records import versions
from pasa_diffusers.processors import SDPAAttnProcessor
from pasa_diffusers.rules import FP16_MAX, SHIFT_BLOCK

from .svd import generate

__all__ = ["DiagnosticAttnProcessor", "diagnose"]


class DiagnosticAttnProcessor(SDPAAttnProcessor):
    """SDPA in the model's dtype (the stock processor's attention) that first hands the call's q and k
    to its ``recorder`` (``pasa_diffusers.diagnose.LayerRecorder``)."""

    def __init__(self, recorder: LayerRecorder, dtype: torch.dtype | None = None) -> None:
        super().__init__(dtype)
        self.name = recorder.name
        self.recorder = recorder

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                  attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.recorder.record(query, key, scale)
        return super().attention(query, key, value, scale, attention_mask)


def _timed_generate(pipe: Any, image: Any, settings: dict[str, Any], desc: str, progress: bool,
                    on_step: Any = None) -> tuple[np.ndarray, float]:
    """Generate with a tqdm bar over the denoising steps; return the frames and the wall time."""
    from tqdm.auto import tqdm

    bar = tqdm(total=settings["num_inference_steps"], desc=desc, unit="step", file=sys.stderr, disable=not progress)

    def callback(pipeline: Any, i: int, t: Any, callback_kwargs: dict) -> dict:
        if on_step is not None:
            on_step(i, bar)
        bar.update(1)
        return callback_kwargs

    cuda = pipe.device.type == "cuda"
    try:
        if cuda:
            torch.cuda.synchronize(pipe.device)
        start = time.perf_counter()
        frames = generate(pipe, image, progress=False, callback_on_step_end=callback, **settings)
        seconds = time.perf_counter() - start
    finally:
        bar.close()
    return frames, seconds


def diagnose(pipe: Any, image: Any, *, num_frames: int, num_inference_steps: int, seed: int, height: int,
             width: int, progress: bool = True, max_elements: int = 2 ** 26, model: str | None = None,
             measure_overhead: bool = True) -> dict[str, Any]:
    """Diagnose FP16 overflow in every attention layer of ``pipe.unet`` during one generation.

    Args:
        pipe: a pipeline from ``pasa_diffusers.pipelines.svd.load_svd``; its processors are restored afterwards (also
            on error).
        image, num_frames, num_inference_steps, seed, height, width: as ``pasa_diffusers.pipelines.svd.generate``.
        progress: tqdm bars over the denoising steps (stderr).
        max_elements: most scores held at once per call (``call_stats``).
        model: the name reported (default: the pipeline's ``name_or_path``).
        measure_overhead: also time one plain generation with the previous processors (after the
            diagnosed one, which therefore carries any one-time warm-up: the ratio is an upper bound).

    Returns:
        ``{"model", "settings", "rules", "layers": [...], "overhead", "frames", "fp16_max"}``; each layer
        (in the order they first ran; never-called ones last) holds ``path``, ``short``, ``kind``,
        ``block``, ``level`` (token count of the spatial attention of its transformer), ``heads``,
        ``head_dim``, ``shape_q``, ``shape_k``, ``calls``, ``max_abs_qk``, ``max_abs_score``,
        ``overflow_count``, ``max_abs_shifted``, ``nonfinite_calls``, per head (means over calls)
        ``bias_q``, ``bias_k``, ``amplitude_q``, ``amplitude_k``, ``resonance_cos``,
        ``sign_agreement``, ``mean_norm_q``, ``mean_norm_k``, then
        ``per_step_max_abs_qk``, ``per_step_overflow_count`` (``None`` for steps without a call),
        ``risk``, ``overflows``, ``cause`` and ``dominant_head`` (``pasa_diffusers/diagnose/rules.py``).
        ``settings`` holds the generation settings, ``device``, ``dtype``, ``max_elements``, ``beta``,
        ``block_n`` and ``versions`` (``metrics.records.versions``).
        ``overhead`` = ``{"seconds_with", "seconds_without", "ratio"}`` (``None`` values without
        ``measure_overhead``); ``frames`` = ``{"finite", "match_plain"}``.
    """
    unet = pipe.unet
    clock = StepClock()
    settings = {"num_frames": num_frames, "num_inference_steps": num_inference_steps, "seed": seed,
                "height": height, "width": width}
    with recording(unet, DiagnosticAttnProcessor, clock=clock, max_elements=max_elements) as recorders:

        def on_step(i: int, bar: Any) -> None:
            clock.step = i + 1
            peak = max((r["max_abs_qk"] for layer in recorders for r in layer.records), default=0.0)
            hot = sum(any(r["overflow_count"] for r in layer.records) for layer in recorders)
            bar.set_postfix_str(f"max|q.k| {peak:.3g}, overflowing layers {hot}")

        frames, seconds_with = _timed_generate(pipe, image, settings, "diagnose", progress, on_step)
    match_plain = seconds_without = None
    if measure_overhead:
        plain, seconds_without = _timed_generate(pipe, image, settings, "plain (timing)", progress)
        match_plain = bool(np.array_equal(plain, frames, equal_nan=True))
    return {
        "model": model or pipe.name_or_path or f"unnamed {type(pipe).__name__}",
        "settings": {**settings, "device": str(pipe.device), "dtype": str(unet.dtype).removeprefix("torch."),
                     "max_elements": max_elements, "beta": DEFAULT_BETA, "block_n": SHIFT_BLOCK,
                     "versions": versions()},
        "rules": {"risk": RISK_RULE, "cause": CAUSE_RULE},
        "layers": summarize(recorders, num_inference_steps, kind=module_kind),
        "overhead": {"seconds_with": seconds_with, "seconds_without": seconds_without,
                     "ratio": seconds_with / seconds_without if seconds_without else None},
        "frames": {"finite": bool(np.isfinite(frames).all()), "match_plain": match_plain},
        "fp16_max": FP16_MAX,
    }
