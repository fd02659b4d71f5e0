"""Overflow diagnosis of one generation (SVD or a video transformer): which attention layers overflow in FP16,
and why.

``diagnose`` records every attention call of the pipeline's denoiser (``video.denoiser``: SVD's UNet, a
video pipeline's transformer) during one real generation (``pasa_diffusers.diagnose.recording`` with a
``DiagnosticAttnProcessor`` per layer around ``video.generate_frames``, the pipeline's step callback
advancing the step clock), summarises the layers (``pasa_diffusers.diagnose.summarize``, with the module
kinds of ``install.module_kind``: risk and cause as in ``pasa_diffusers/diagnose/verdict.py``) and times a
plain generation for the overhead.  In a video transformer the model keeps its own processors (QK norms,
RoPE): each one's attention call is routed to its layer's ``DiagnosticAttnProcessor``
(``install.replacement``), as ``install.apply`` routes it to a backend, and forward hooks record the largest
|x| of every block's attention outputs, feed-forward, norms and residual stream
(``pasa_diffusers.diagnose.recording_activations``).  The diagnostic processors compute the stock
attention, so the video is the one the pipeline makes without them.  Render the result with
``pasa_diffusers.diagnose.risk_table``, ``activation_table`` and ``write_diagnosis``.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pasa_diffusers.shift_matrix import DEFAULT_BETA
from pasa_diffusers.diagnose import (CAUSE_RULE, RISK_RULE, LayerRecorder, StepClock, activation_sites, recording,
                                     recording_activations, summarize, summarize_activations)
from pasa_diffusers.install import VIDEO_BLOCKS, attention_processors, module_kind, replacement
from pasa_diffusers.metrics.records import versions
from pasa_diffusers.processors import SDPAAttnProcessor
from pasa_diffusers.rules import FP16_MAX, SHIFT_BLOCK

from .video import NOTICE, denoiser, generate_frames, is_video_pipeline

__all__ = ["DiagnosticAttnProcessor", "recorders_on", "diagnose"]


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


def recorders_on(model: Any, processor: type[DiagnosticAttnProcessor] = DiagnosticAttnProcessor
                 ) -> Callable[[LayerRecorder], Any]:
    """A processor factory for ``recording``: each layer's ``processor`` (a ``DiagnosticAttnProcessor``)
    installed as ``install.apply`` installs a backend (``install.replacement``): in place of SVD's
    ``AttnProcessor2_0``, and behind a video transformer's own processor (QK norms, RoPE), its attention call
    routed to it."""
    stock = attention_processors(model)

    def make(recorder: LayerRecorder) -> Any:
        return replacement(stock[f"{recorder.name}.processor"], processor(recorder))

    return make


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
        frames = generate_frames(pipe, image, progress=False, callback_on_step_end=callback, **settings)
        seconds = time.perf_counter() - start
    finally:
        bar.close()
    return frames, seconds


def diagnose(pipe: Any, image: Any, *, num_frames: int, num_inference_steps: int, seed: int, height: int,
             width: int, progress: bool = True, max_elements: int = 2 ** 26, model: str | None = None,
             measure_overhead: bool = True) -> dict[str, Any]:
    """Diagnose FP16 overflow in every attention layer of the pipeline's denoiser during one generation.

    Args:
        pipe: a pipeline from ``pasa_diffusers.pipelines.video.load_pipeline`` (SVD or a video transformer); its
            processors are restored afterwards (also on error).
        image, num_frames, num_inference_steps, seed, height, width: as ``video.generate_frames`` (``image``
            is unused by a text-to-video pipeline).
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
        ``risk``, ``overflows``, ``cause`` and ``dominant_head`` (``pasa_diffusers/diagnose/verdict.py``).
        ``settings`` holds the generation settings, ``device``, ``dtype``, ``max_elements``, ``beta``,
        ``block_n`` and ``versions`` (``metrics.records.versions``).
        ``overhead`` = ``{"seconds_with", "seconds_without", "ratio"}`` (``None`` values without
        ``measure_overhead``); ``frames`` = ``{"finite", "match_plain"}``.  A video transformer's result
        also holds ``activations`` (``pasa_diffusers.diagnose.summarize_activations``: per block and role the
        largest |x|, its risk against 65504, ``overflows``) and ``conditioning`` (``video.NOTICE``).
    """
    net = denoiser(pipe)
    video = is_video_pipeline(pipe)
    clock = StepClock()
    settings = {"num_frames": num_frames, "num_inference_steps": num_inference_steps, "seed": seed,
                "height": height, "width": width}
    factory = recorders_on(net)
    sites = activation_sites(net, VIDEO_BLOCKS) if video else []
    with (recording(net, factory, clock=clock, max_elements=max_elements) as recorders,
          recording_activations(net, sites, clock=clock) as activations):

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
    result = {
        "model": model or pipe.name_or_path or f"unnamed {type(pipe).__name__}",
        "settings": {**settings, "device": str(pipe.device), "dtype": str(net.dtype).removeprefix("torch."),
                     "max_elements": max_elements, "beta": DEFAULT_BETA, "block_n": SHIFT_BLOCK,
                     "versions": versions()},
        "rules": {"risk": RISK_RULE, "cause": CAUSE_RULE},
        "layers": summarize(recorders, num_inference_steps, kind=module_kind),
        "overhead": {"seconds_with": seconds_with, "seconds_without": seconds_without,
                     "ratio": seconds_with / seconds_without if seconds_without else None},
        "frames": {"finite": bool(np.isfinite(frames).all()), "match_plain": match_plain},
        "fp16_max": FP16_MAX,
    }
    if video:
        result.update(activations=summarize_activations(activations, num_inference_steps), conditioning=NOTICE)
    return result
