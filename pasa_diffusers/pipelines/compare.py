"""``pasa compare``: every attention backend's videos scored against the FP32-attention reference, over samples.

One pipeline is loaded once per process: an SVD pipeline or a video transformer's (``video.py``; which
one a model is, and so what its samples are, is decided in one place, ``conditioning``).  For each sample
(``samples.py``: a conditioning image and a seed for SVD; for a video transformer a prompt, its fixed
prompt embeddings, and a seed) the FP32 reference and every backend generate from the same conditioning
and the same initial noise (``make_latents``); each backend's processors are installed with
``pasa_diffusers.apply`` for its video only.  The FP32 reference upcasts q, k and v to float32 inside the
same model, so only attention differs between the videos.  Each backend's frames are scored with
``metrics.score_video`` against the reference's.

``evaluate`` runs a whole evaluation into an output folder: one record per (sample, backend) appended
to ``samples.jsonl`` as soon as it is scored, resume, refusal of a mixed folder, of a damaged log and of
a second run into a folder in use (``runlog.py``), sharding over torchrun ranks (``distributed.py``),
and at the end the report with statistics over the samples (``metrics.report``).  Ctrl-C raises
``RunInterrupted``, which says how many results are safe on disk.  ``run_comparison`` is the same
comparison for one sample, in memory.

A record of ``samples.jsonl``::

    {"image", "seed", "sample", "backend",                # image: an image's spec, or a prompt's (prompt:0)
     "psnr", "ssim", "lpips", "temporal_psnr", "flicker",   # the video's means (JSON: records.json_float)
     "frames", "nonfinite_frames", "first_nonfinite", "identical_frames",
     "psnr_per_frame": [...], "ssim_per_frame": [...],
     "fallbacks": {"calls", "fallback_calls", "reasons": {reason: calls},
                   "int8_blocks": {"blocks", "in_16_bits"}},   # the 8-bit backends' key blocks, those in 16 bits
     "seconds", "rank",
     "sparse": {"mask", "parameters", "density", "schedule", "order", "layers", "sparse_calls", "dense_calls"}}
                                                            # a sparse backend's records only (sparse.sparse_summary)

A video's PSNR (and temporal PSNR) is the mean over its frames with a finite value, ``inf`` when every
scored frame is identical to the reference, ``null`` when no frame could be scored (non-finite pixels).
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch

from pasa_diffusers import install, metrics
from pasa_diffusers.backends import COMPARED, DEFAULT_COMPARED, REFERENCE, SPARSE
from pasa_diffusers.kernels import block_tally
from pasa_diffusers.metrics import records
from pasa_diffusers.metrics.report import worst_key, worst_records

from . import runlog, svd, video
from .distributed import Dist
from .names import BUILTIN_MODELS, BUILTIN_VIDEO_MODELS, TINY_VIDEO_PIPELINES, TINY_VIDEO_SETTINGS
from .resonant import PLANTED_LAYERS
from .samples import Sample, image_identity, make_samples, prompt_spec
from .sparse import sparse_summary
from .svd import load_image

__all__ = ["VideoRun", "CompareConfig", "Conditioning", "MODEL_NOTES", "RunInterrupted", "SettingError", "WriteError",
           "check_backends", "conditioning", "compare_sample", "sample_record", "run_comparison", "evaluate"]

_NOISE = ("built in code to run on a CPU in seconds: its videos look like noise by design, and what counts is "
          "how far each backend's video lies from the FP32 one")
MODEL_NOTES: dict[str, str] = {
    "tiny": f"a tiny SVD with random weights, {_NOISE}",
    "tiny-resonant": "the tiny SVD with random weights and an FP16 overflow planted in "
                     f"{len(PLANTED_LAYERS)} attention layers (a large query and key bias, in phase along the head "
                     "dimension: pasa_diffusers/pipelines/resonant.py), so that naive FP16 attention overflows there: its videos look "
                     "like noise by design, and what counts is how far each backend's video lies from the FP32 one",
    "svd-xt-random": "SVD-XT at full size with seeded random weights, for time and memory at the real sizes: its "
                     "videos look like noise by design, and it plants no overflow",
    **{name: f"a tiny {family} text-to-video pipeline ({cls}: a small transformer and VAE) with random weights, "
             f"{_NOISE}" for name, (family, cls) in TINY_VIDEO_PIPELINES.items()},
}
"""What each built-in model is, for the report (which would otherwise read as a failure: noise videos)."""


def check_backends(names: Sequence[str]) -> list[str]:
    """``names`` as a list, checked: each one of ``backends.COMPARED`` (not the reference), none twice;
    else ``ValueError``."""
    names = list(names)
    if not names:
        raise ValueError(f"--backends: no backend named; choose from {', '.join(COMPARED)}")
    unknown = [n for n in names if n not in COMPARED]
    if unknown:
        raise ValueError(f"--backends: unknown backend(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(COMPARED)} ({REFERENCE} is always the reference)")
    if len(set(names)) != len(names):
        raise ValueError(f"--backends: a backend is named twice in {','.join(names)}")
    return names


class SettingError(ValueError):
    """A generation setting the model cannot take (or must be given); the message names the flag."""


_FLAGS = {"num_frames": "--frames", "height": "--height", "width": "--width", "num_inference_steps": "--steps"}


@dataclass(frozen=True)
class Conditioning:
    """What a run's samples are conditioned on, by the kind of pipeline its model is (``conditioning``).

    An SVD pipeline animates conditioning images: ``specs`` are the run's images.  A video transformer's
    pipeline generates from fixed prompt embeddings, its text encoder replaced (``video.NOTICE``): ``specs``
    are prompts ``prompt:N`` (``samples.prompt_spec``), so far the one ``video.generate`` takes, seed
    ``video.PROMPT_SEED``.
    """

    video: bool
    specs: tuple[str, ...]

    @property
    def what(self) -> str:
        """``"images"`` or ``"prompts"``: what the run's settings and identity call ``specs``."""
        return "prompts" if self.video else "images"

    @property
    def notice(self) -> str | None:
        """What the output and the report say about a video transformer's conditioning; ``None`` for SVD."""
        if not self.video:
            return None
        return (f"{video.NOTICE}: unit Gaussians of the text encoder's width and the pipeline's padded prompt "
                f"length (seed {video.PROMPT_SEED}: the prompt's, then the negative prompt's); no tokenizer or text "
                "encoder is loaded")

    def identity(self) -> dict[str, Any]:
        """This part of a run's identity: the images with the digest of each file, or the prompts."""
        if self.video:
            return {"prompts": list(self.specs)}
        return {"images": [image_identity(image) for image in self.specs]}

    def image(self, spec: str, width: int, height: int) -> PIL.Image.Image | None:
        """What the pipeline gets besides the noise: the image ``spec`` at the run's size (SVD), or ``None``."""
        return None if self.video else load_image(spec, (width, height))


def conditioning(model: str, images: Sequence[str], *, local_files_only: bool = False) -> Conditioning:
    """The one place ``pasa compare`` tells an SVD model from a video transformer's, before loading it: by the
    built-in name, or by the pipeline class in its ``model_index.json`` (the rule of ``video.load_pipeline``).

    A run on SVD has the samples ``images`` x seeds; one on a video transformer its fixed prompt x seeds
    (``images`` unused).
    """
    if model not in BUILTIN_MODELS and video.is_video_model(model, local_files_only):
        return Conditioning(True, (prompt_spec(video.PROMPT_SEED),))
    return Conditioning(False, tuple(images))


def _load_model(model: str, cond: Conditioning, device: str, dtype: torch.dtype, local_files_only: bool) -> Any:
    load = video.load_video if cond.video else svd.load_svd
    return load(model, device=device, dtype=dtype, local_files_only=local_files_only)


def _check_pipeline(pipe: Any, cond: Conditioning, settings: dict[str, int]) -> None:
    """Refuse sizes a video pipeline would round (``SettingError`` naming the flag); ``pipe`` must be the kind
    ``cond`` says."""
    if video.is_video_pipeline(pipe) != cond.video:
        raise RuntimeError(f"compare: the model loaded as {type(pipe).__name__}, not the kind its name says "
                           f"({'a video transformer' if cond.video else 'SVD'})")
    problem = video.setting_problem(pipe, **settings) if cond.video else None
    if problem is not None:
        name, why = problem
        raise SettingError(f"{_FLAGS[name]} {settings[name]}: {why}")


@dataclass
class VideoRun:
    """One backend's video of one sample: its frames, the seconds it took, its processors' summary."""

    backend: str
    frames: np.ndarray
    seconds: float
    processors: dict[str, Any] = field(default_factory=dict)


def _generate(pipe: Any, backend: str, image: PIL.Image.Image | None, latents: torch.Tensor,
              settings: dict[str, int], seed: int, sparse: dict[str, Any]) -> VideoRun:
    summary = install.apply(pipe, backend, **(sparse if backend in SPARSE else {}))
    try:
        block_tally.reset()
        start = time.perf_counter()
        frames = video.generate_frames(pipe, image, latents=latents, seed=seed, progress=False, **settings)
        seconds = time.perf_counter() - start
        fallbacks = install.fallback_summary(pipe, strict=True)
        blocks = block_tally.counts()
        masked = sparse_summary(pipe)
    finally:
        install.restore(pipe)
    int8_blocks = {"blocks": blocks["blocks"], "in_16_bits": blocks["in_16_bits"]}
    return VideoRun(backend, frames, seconds, records.json_safe({"installed": summary, "fallbacks": fallbacks,
                                                                 "int8_blocks": int8_blocks, "sparse": masked}))


def compare_sample(pipe: Any, image: PIL.Image.Image | None, *, seed: int, backends: Sequence[str], num_frames: int,
                   num_inference_steps: int, height: int, width: int,
                   sparse: dict[str, Any] | None = None) -> Iterator[VideoRun]:
    """The reference's video (``backends.REFERENCE``), then each backend's, of one sample (generated lazily,
    in that order).

    ``image`` is the PIL image an SVD pipeline animates, ``None`` for a video transformer's pipeline (its
    fixed prompt embeddings condition every video); every video starts from the same initial noise, the
    pipeline's ``make_latents(pipe, seed=seed, ...)``.  A backend whose targeted attention calls all fell back
    raises ``install.AllCallsFellBackError``.  ``sparse``: the options of the sparse backends' processors (the
    mask, its parameters, the schedule: ``SparsePASAAttnProcessor``'s arguments; the other backends take none).
    """
    settings = {"num_frames": num_frames, "num_inference_steps": num_inference_steps, "height": height,
                "width": width}
    make_latents = video.make_latents if video.is_video_pipeline(pipe) else svd.make_latents
    latents = make_latents(pipe, num_frames=num_frames, height=height, width=width, seed=seed)
    for backend in (REFERENCE, *backends):
        yield _generate(pipe, backend, image, latents, settings, seed, dict(sparse or {}))


def _video_mean(per_frame: list[Any]) -> float:
    """Mean of the finite per-frame values; ``inf`` if every scored value is ``inf``; NaN if none is scored."""
    values = np.array([records.from_json_float(v) for v in per_frame])
    scored = values[~np.isnan(values)]
    finite = scored[np.isfinite(scored)]
    return float(finite.mean()) if finite.size else math.inf if scored.size else math.nan


def sample_record(sample: Sample, run: VideoRun, scores: dict[str, Any], *, rank: int = 0) -> dict[str, Any]:
    """The ``samples.jsonl`` record (module docstring) of ``run``'s video of ``sample``, scored as ``scores``."""
    fallbacks = run.processors["fallbacks"]
    lpips = scores.get("lpips")
    return records.json_safe({
        "image": sample.image, "seed": sample.seed, "sample": sample.label, "backend": run.backend,
        "psnr": _video_mean(scores["psnr"]["per_frame"]),
        "ssim": scores["ssim"]["mean"],
        "lpips": lpips["mean"] if lpips else None,
        "temporal_psnr": _video_mean(scores["temporal_psnr"]["per_frame"]),
        "flicker": scores["flicker_ratio"],
        "frames": scores["frames"],
        "nonfinite_frames": scores["nonfinite"]["count"],
        "first_nonfinite": scores["nonfinite"]["first_index"],
        "identical_frames": scores["psnr"]["identical_frames"],
        "psnr_per_frame": scores["psnr"]["per_frame"],
        "ssim_per_frame": scores["ssim"]["per_frame"],
        "fallbacks": {"calls": fallbacks["calls"], "fallback_calls": fallbacks["fallback_calls"],
                      "reasons": fallbacks["fallbacks"], "int8_blocks": run.processors["int8_blocks"]},
        "seconds": run.seconds,
        "rank": rank,
        **({"sparse": run.processors["sparse"]} if run.processors["sparse"] else {}),
    })


def _default_dtype(device: str) -> torch.dtype:
    return torch.float16 if torch.device(device).type == "cuda" else torch.float32


def _lpips(weights: str | None, device: str) -> tuple[metrics.LPIPSScorer | None, str]:
    """The LPIPS scorer and its label, or ``None`` and why; weights that are not AlexNet's are a ``SettingError``
    naming ``--lpips-weights``."""
    available, reason = metrics.lpips_status(weights)
    if not available:
        return None, reason
    try:
        scorer = metrics.LPIPSScorer(weights, device=device)
    except metrics.LPIPSWeightsError as exc:
        raise SettingError(f"--lpips-weights {weights}: {str(exc).removeprefix(f'{weights}: ')}") from exc
    return scorer, scorer.label


def run_comparison(*, model: str = "tiny", backends: Sequence[str] = DEFAULT_COMPARED,
                   image: str = "builtin:rocket", num_frames: int = 4, num_inference_steps: int = 4,
                   seed: int = 0, height: int = 64, width: int = 64, device: str = "cpu",
                   dtype: torch.dtype | None = None, lpips_weights: str | None = None,
                   local_files_only: bool = False, progress: bool = True
                   ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """One sample in memory: ``({"backends": {name: {"scores", "seconds", "processors"}}, ...}, videos)``.

    ``image`` conditions an SVD model; a video transformer's (``conditioning``) generates from its fixed prompt
    embeddings instead, at ``num_frames``, ``height`` and ``width`` it takes (tiny-wan: e.g. 5 frames of 32x32).
    ``dtype`` defaults to float16 on CUDA (how SVD is run) and float32 on the CPU, where float16
    convolutions are impractically slow; there the processors cast q, k and v to their own precision,
    so attention still runs in FP16/BF16.  ``videos`` maps the reference (``"fp32"``) and each backend to
    its frames.
    ``progress`` shows a tqdm bar over the videos on stderr.
    """
    from tqdm.auto import tqdm

    names = check_backends(backends)
    cond = conditioning(model, (image,), local_files_only=local_files_only)
    pipe = _load_model(model, cond, device, dtype or _default_dtype(device), local_files_only)
    _check_pipeline(pipe, cond, {"num_frames": num_frames, "height": height, "width": width,
                                 "num_inference_steps": num_inference_steps})
    scorer, lpips_note = _lpips(lpips_weights, "cpu")
    runs = compare_sample(pipe, cond.image(cond.specs[0], width, height), seed=seed, backends=names,
                          num_frames=num_frames, num_inference_steps=num_inference_steps, height=height, width=width)
    bar = iter(tqdm(runs, total=1 + len(names), desc="compare", unit="video", file=sys.stderr, disable=not progress))
    reference = next(bar)
    videos = {REFERENCE: reference.frames}
    results = {}
    for run in bar:
        videos[run.backend] = run.frames
        scores = metrics.score_video(reference.frames, run.frames, lpips_scorer=scorer, lpips_reason=lpips_note)
        results[run.backend] = {"scores": scores, "seconds": run.seconds, "processors": run.processors}
    report = {"model": model, "reference": REFERENCE, "versions": records.versions(),
              "settings": {"image": cond.specs[0], "seed": seed, "num_frames": num_frames,
                           "num_inference_steps": num_inference_steps, "height": height, "width": width,
                           "device": device, "dtype": video.denoiser(pipe).dtype},
              **({"conditioning": cond.notice} if cond.notice else {}),
              "reference_run": {"seconds": reference.seconds, "processors": reference.processors},
              "backends": results}
    return records.json_safe(report), videos


@dataclass(frozen=True)
class CompareConfig:
    """What an evaluation computes: the model, the samples, the backends and the generation settings.

    ``images`` are ``builtin:NAME`` specs or image files, the conditioning of an SVD model's samples (a video
    transformer's samples are its fixed prompt x ``seeds``: ``conditioning``).  ``num_frames``, ``height``,
    ``width`` None: the model's own, which only a built-in video model has here (``names.TINY_VIDEO_SETTINGS``).
    ``dtype`` None is float16 on CUDA, float32 on the CPU.  ``fps`` is the frame rate of the side-by-side
    GIFs; ``worst`` how many worst samples per backend the report lists (with their GIFs).  ``sparse``: the
    sparse backends' options (``compare_sample``).
    """

    model: str = "tiny-resonant"
    images: tuple[str, ...] = ("builtin:astronaut", "builtin:coffee", "builtin:rocket")
    seeds: tuple[int, ...] = (0, 1)
    backends: tuple[str, ...] = DEFAULT_COMPARED
    num_frames: int | None = 4
    num_inference_steps: int = 4
    height: int | None = 64
    width: int | None = 64
    dtype: torch.dtype | None = None
    lpips_weights: str | None = None
    local_files_only: bool = False
    fps: float = 7.0
    worst: int = 2
    sparse: dict[str, Any] = field(default_factory=dict)


def _with_sizes(config: CompareConfig, cond: Conditioning) -> CompareConfig:
    """``config`` with its sizes left unset (None) taken from the model: a built-in video model's own
    (``names.TINY_VIDEO_SETTINGS``); any other model needs them set (``SettingError``)."""
    unset = [name for name in _FLAGS if getattr(config, name) is None]
    if not unset:
        return config
    if cond.video and config.model in BUILTIN_VIDEO_MODELS:
        return replace(config, **{name: TINY_VIDEO_SETTINGS[config.model][name] for name in unset})
    raise SettingError(f"{_FLAGS[unset[0]]}: not given; pass --frames, --height and --width for --model {config.model} "
                       f"(in pasa compare only the built-in video models have sizes of their own: "
                       f"{', '.join(BUILTIN_VIDEO_MODELS)})")


def _video_name(record: dict[str, Any]) -> str:
    return f"{runlog.VIDEOS}/{record['sample']}_{record['backend']}.gif"


def _run_identity(config: CompareConfig, cond: Conditioning, device: str, dtype: torch.dtype,
                  lpips_note: str) -> dict[str, Any]:
    """What must match for a folder's records to be resumed: everything that changes a number or a video.

    On the CPU that includes torch's thread count: the order of its reductions, hence the last bits of
    every video (and about 0.1 dB of a low-precision backend's PSNR), depend on it.
    """
    identity = {
        "model": config.model, "backends": list(config.backends),
        **cond.identity(), "seeds": list(config.seeds),
        "num_frames": config.num_frames, "num_inference_steps": config.num_inference_steps,
        "height": config.height, "width": config.width, "device": torch.device(device).type, "dtype": dtype,
        "attention_cast": {b: install.cast_dtype(b, dtype) or "none" for b in config.backends},
        "fps": config.fps, "lpips": lpips_note, "versions": records.versions(),
    }
    if set(config.backends) & set(SPARSE):
        identity["sparse"] = dict(config.sparse)
    if torch.device(device).type == "cpu":
        identity["cpu_threads"] = torch.get_num_threads()
    return records.json_safe(identity)


def _pending(samples: list[Sample], backends: Sequence[str], done: set[runlog.Key]) -> list[tuple[Sample, list[str]]]:
    todo = [(s, [b for b in backends if (s.image, s.seed, b) not in done]) for s in samples]
    return [(s, names) for s, names in todo if names]


PREVIEW_WIDTH = 512
"""The side-by-side GIFs show frames at most this wide (an integer downscale): a preview, the scores use all pixels."""


def _preview(frames: np.ndarray) -> np.ndarray:
    """``frames`` shrunk by the smallest integer factor ``f`` that makes them at most ``PREVIEW_WIDTH`` wide
    (mean of ``f x f`` blocks, so a non-finite pixel stays visible)."""
    f = math.ceil(frames.shape[2] / PREVIEW_WIDTH)
    if f == 1:
        return frames
    n, h, w, c = frames.shape
    h, w = h // f * f, w // f * f
    return frames[:, :h, :w].reshape(n, h // f, f, w // f, f, c).mean(axis=(2, 4))


def _write_side_by_side(out: Path, record: dict[str, Any], reference: np.ndarray, frames: np.ndarray,
                        fps: float) -> Path:
    """Write ``record``'s side-by-side GIF (``_video_name``) of its ``reference`` and backend ``frames``."""
    return metrics.write_gif(metrics.side_by_side(_preview(reference), _preview(frames)), out / _video_name(record),
                             fps=fps)


class _WorstVideos:
    """The side-by-side GIFs of the ``count`` worst records per backend that this process computed.

    The report lists the worst ``count`` records overall (``metrics.report.worst_key``, ties in sample
    order); each of them is among the worst ``count`` of the process (and attempt) that computed it, so
    its GIF is on disk, while a GIF is written only for a record that enters this process's list.
    """

    def __init__(self, out: Path, count: int, fps: float) -> None:
        self.out, self.count, self.fps = out, count, fps
        self.kept: dict[str, list[tuple[tuple, Path]]] = {}

    def offer(self, record: dict[str, Any], position: int, reference: np.ndarray, frames: np.ndarray) -> list[Path]:
        """Write ``record``'s GIF if it is among the worst so far; return the GIFs it pushed out of the list."""
        key = worst_key(record)
        if self.count == 0 or key is None:
            return []
        kept = self.kept.setdefault(record["backend"], [])
        rank_key = (*key, position)
        if len(kept) == self.count and rank_key >= kept[-1][0]:
            return []
        path = _write_side_by_side(self.out, record, reference, frames, self.fps)
        kept.append((rank_key, path))
        kept.sort(key=lambda entry: entry[0])
        pushed = [p for _, p in kept[self.count:]]
        del kept[self.count:]
        return pushed


def _run_shard(pipe: Any, config: CompareConfig, cond: Conditioning, work: list[tuple[Sample, list[str]]],
               positions: dict[Any, int], out: Path, dist: Dist, scorer: metrics.LPIPSScorer | None, lpips_note: str,
               progress: bool, initial: int) -> None:
    """Generate, score and log this rank's samples; each record is on disk before the next video starts.

    The bar counts results (records) from ``initial``, those already done."""
    from tqdm.auto import tqdm

    worst = _WorstVideos(out, config.worst, config.fps)
    total = initial + sum(len(names) for _, names in work)
    desc = "compare" if dist.world_size == 1 else f"compare rank {dist.rank}/{dist.world_size}"
    with runlog.LogWriter(runlog.log_path(out, dist.rank, dist.world_size)) as log, \
            tqdm(total=total, initial=initial, desc=desc, unit="result", file=sys.stderr, disable=not progress,
                 position=dist.rank) as bar:
        for sample, names in work:
            bar.set_postfix_str(f"{sample.label} {REFERENCE}")
            runs = compare_sample(pipe, cond.image(sample.image, config.width, config.height), seed=sample.seed,
                                  backends=names, num_frames=config.num_frames,
                                  num_inference_steps=config.num_inference_steps, height=config.height,
                                  width=config.width, sparse=config.sparse)
            reference = next(runs)
            for run in runs:
                scores = metrics.score_video(reference.frames, run.frames, lpips_scorer=scorer,
                                             lpips_reason=lpips_note)
                record = sample_record(sample, run, scores, rank=dist.rank)
                log.append(record)  # first: a GIF that cannot be written never loses the result
                pushed = worst.offer(record, positions[sample.key], reference.frames, run.frames)
                for path in pushed:
                    path.unlink(missing_ok=True)
                bar.update()
                bar.set_postfix_str(f"{sample.label} {run.backend}")


def _missing_videos(out: Path, config: CompareConfig, logged: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records the report lists among the worst whose side-by-side GIF is not on disk: a run killed after a
    record landed in the log and before its GIF was written (the record is never computed again)."""
    listed = [r for name in config.backends
              for r in worst_records([r for r in logged if r["backend"] == name], config.worst)]
    return [r for r in listed if not (out / _video_name(r)).is_file()]


def _rebuild_videos(pipe: Any, config: CompareConfig, cond: Conditioning, samples: list[Sample],
                    missing: list[dict[str, Any]], out: Path, progress: bool) -> None:
    """Generate again the reference and the backend's video of each record of ``missing`` (its sample's noise and
    conditioning, as the run did: the same frames) and write its side-by-side GIF."""
    if progress:
        print(f"rebuilding {records.count(len(missing), 'side-by-side video')} of results already done (the run "
              "that logged them ended before writing them)", file=sys.stderr)
    for sample in samples:
        names = [r["backend"] for r in missing if (r["image"], r["seed"]) == (sample.image, sample.seed)]
        if not names:
            continue
        runs = compare_sample(pipe, cond.image(sample.image, config.width, config.height), seed=sample.seed,
                              backends=names, num_frames=config.num_frames,
                              num_inference_steps=config.num_inference_steps, height=config.height, width=config.width,
                              sparse=config.sparse)
        reference = next(runs)
        for run in runs:
            record = next(r for r in missing if runlog.record_key(r) == (sample.image, sample.seed, run.backend))
            _write_side_by_side(out, record, reference.frames, run.frames, config.fps)


def _finish(out: Path, config: CompareConfig, cond: Conditioning, samples: list[Sample], order: list[runlog.Key],
            meta: dict[str, Any], pipeline: Callable[[], Any], progress: bool) -> dict[str, Any]:
    """Rank 0, once every rank is done: merge the logs, rebuild the worst samples' GIFs a killed run did not write
    (``pipeline()`` gives the pipeline, loading it if this process has not), build and write the report, then keep
    only the worst GIFs."""
    logged = runlog.merge_logs(out, order)
    if len(logged) != len(order):
        missing = [key for key in order if key not in {runlog.record_key(r) for r in logged}]
        raise RuntimeError(f"evaluate: {len(missing)} record(s) missing after every rank finished, e.g. {missing[0]}")
    unwritten = _missing_videos(out, config, logged)
    if unwritten:
        _rebuild_videos(pipeline(), config, cond, samples, unwritten, out, progress)
    report = metrics.build_report(logged, backends=config.backends, meta=meta, worst=config.worst,
                                  video=lambda r: _video_name(r) if (out / _video_name(r)).is_file() else "")
    metrics.write_report(report, logged, out)
    keep = {out / w["video"] for entries in report["worst"].values() for w in entries if w["video"]}
    for gif in (out / runlog.VIDEOS).glob("*.gif"):
        if gif not in keep:
            gif.unlink()
    return report


class WriteError(RuntimeError):
    """A file of the run folder could not be written (a full disk, a quota, a folder made read-only): every record
    already in the folder stays, and the same command resumes once the cause is fixed."""


@contextlib.contextmanager
def _writing(out: Path, order: list[runlog.Key]) -> Iterator[None]:
    """Turn an ``OSError`` of the block (which writes into ``out``) into a one-line ``WriteError``."""
    try:
        yield
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        raise WriteError(f"--out {out}: cannot write{where} ({exc.strerror or exc}), with {_count_done(out, order)} "
                         f"of {records.count(len(order), 'result')} on disk: free space (or fix the folder) and rerun "
                         "the same command to resume") from exc


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during ``evaluate``: ``done`` of the run's ``total`` results are on disk, and the same call resumes."""

    def __init__(self, out: Path, done: int, total: int) -> None:
        super().__init__(f"interrupted after {done} of {records.count(total, 'result')}; rerun the same command to "
                         "resume")
        self.out, self.done, self.total = out, done, total


def _keys(samples: list[Sample], backends: Sequence[str]) -> list[runlog.Key]:
    """Every record of the run, in report order: sample by sample, backend by backend."""
    return [(s.image, s.seed, b) for s in samples for b in backends]


def _count_done(out: Path, order: list[runlog.Key]) -> int:
    return len(runlog.done_records(out, set(order))) if out.is_dir() else 0


def _lock(lock: runlog.FolderLock, dist: Dist, *, create: bool) -> None:
    """Rank 0 takes the folder's lock (if the folder exists, or creating it when ``create``); every rank calls
    this, and every rank raises rank 0's ``FolderInUseError``: the ranks of one run share the folder."""
    refusal = None
    if dist.is_main and (create or lock.out.is_dir()):
        try:
            lock.acquire()
        except runlog.FolderInUseError as exc:
            refusal = str(exc)
    refusal = dist.share(refusal)
    if refusal:
        raise runlog.FolderInUseError(refusal)


def _check_images(config: CompareConfig, cond: Conditioning) -> None:
    """Open every image at the run's size, so that an unusable one fails before the folder is written."""
    for spec in cond.specs:
        cond.image(spec, config.width, config.height)


def _load(config: CompareConfig, cond: Conditioning, dist: Dist, dtype: torch.dtype,
          load_pipeline: Callable[[str, torch.dtype], Any] | None) -> Any:
    """The pipeline, checked against the run's kind and sizes (``SettingError``) before anything is written."""
    if load_pipeline is None:
        pipe = _load_model(config.model, cond, dist.device, dtype, config.local_files_only)
    else:
        pipe = load_pipeline(dist.device, dtype)
    _check_pipeline(pipe, cond, {name: getattr(config, name) for name in _FLAGS})
    return pipe


def _meta(config: CompareConfig, cond: Conditioning, run: dict[str, Any], dist: Dist, dtype: torch.dtype,
          lpips_note: str, command: str) -> dict[str, Any]:
    """What the report says about the run besides its records."""
    settings = {cond.what: list(cond.specs), "seeds": list(config.seeds), "backends": list(config.backends),
                "num_frames": config.num_frames, "num_inference_steps": config.num_inference_steps,
                "height": config.height, "width": config.width, "device": torch.device(dist.device).type,
                "dtype": dtype, "attention_cast": run["attention_cast"], "processes": dist.world_size,
                **({"cpu_threads": run["cpu_threads"]} if "cpu_threads" in run else {})}
    return {"command": command, "versions": run["versions"], "model": config.model,
            "model_note": MODEL_NOTES.get(config.model), **({"conditioning": cond.notice} if cond.notice else {}),
            "lpips": lpips_note, "settings": records.json_safe(settings)}


def evaluate(config: CompareConfig, out: str | Path, *, dist: Dist | None = None,
             load_pipeline: Callable[[str, torch.dtype], Any] | None = None, progress: bool = True,
             command: str = "") -> dict[str, Any] | None:
    """Run (or resume) the evaluation ``config`` into the folder ``out``; return the report on rank 0.

    Nothing is written before the inputs are known to be usable: the folder is checked (read only), the
    images opened and the pipeline loaded first; only then is ``out`` created, locked and its manifest
    written.  A folder that already exists is locked at once, so a second run into it stops before
    loading anything.

    Args:
        config: the model, samples, backends and settings.
        out: the run folder (``runlog``): a new or empty folder starts a run, a folder holding the same
            run resumes it, a folder holding anything else raises ``runlog.MixedRunError``, a damaged log
            line ``runlog.DamagedLogError``, a folder another run holds ``runlog.FolderInUseError``.
        dist: this process's rank and device (``distributed.session``); default: one process on the CPU.
            Each rank generates its share of the samples still to do; rank 0 holds the folder's lock and
            writes the report when every rank is done and returns it, the other ranks return None.
        load_pipeline: ``(device, dtype) -> pipeline`` (default: ``svd.load_svd`` or ``video.load_video``, by
            what ``conditioning`` finds the model is); called only when there is something left to generate, or a
            worst sample's GIF to rebuild (a run killed after logging its record, before writing its GIF).
        progress: a tqdm bar per rank on stderr, and (rank 0) a line saying how much a resume finds done.
        command: the command line, recorded in the manifest and the report.

    Raises:
        RunInterrupted: on Ctrl-C (a ``KeyboardInterrupt``), saying how many results are on disk.
        SettingError: sizes a video transformer's pipeline would round, or that it needs given; LPIPS weights that
            are not AlexNet's.
        WriteError: a file of ``out`` could not be written (a full disk): the records on disk stay, each written
            before its GIF, and the same call resumes.
    """
    dist = dist or Dist()
    out = Path(out)
    check_backends(config.backends)
    cond = conditioning(config.model, config.images, local_files_only=config.local_files_only)
    config = _with_sizes(config, cond)
    samples = make_samples(cond.specs, config.seeds)
    try:
        with runlog.FolderLock(out) as lock:
            return _evaluate(config, cond, samples, out, dist, lock, load_pipeline, progress, command)
    except KeyboardInterrupt:
        order = _keys(samples, config.backends)
        raise RunInterrupted(out, _count_done(out, order), len(order)) from None


def _evaluate(config: CompareConfig, cond: Conditioning, samples: list[Sample], out: Path, dist: Dist,
              lock: runlog.FolderLock, load_pipeline: Callable[[str, torch.dtype], Any] | None, progress: bool,
              command: str) -> dict[str, Any] | None:
    """``evaluate`` inside its lock's lifetime."""
    dtype = config.dtype or _default_dtype(dist.device)
    order = _keys(samples, config.backends)
    scorer, lpips_note = _lpips(config.lpips_weights, dist.device)
    run = _run_identity(config, cond, dist.device, dtype, lpips_note)
    runlog.check_folder(out, run)  # every rank, reading only: another run's folder is refused by all
    _lock(lock, dist, create=False)  # a folder in use is refused here, before anything is loaded
    done = runlog.done_records(out, set(order))
    work = dist.shard(_pending(samples, config.backends, set(done)))
    if progress and dist.is_main and done:
        print(f"resuming: {len(done)} of {records.count(len(order), 'result')} already done", file=sys.stderr)
    _check_images(config, cond)
    pipe = _load(config, cond, dist, dtype, load_pipeline) if work else None
    _lock(lock, dist, create=True)
    if dist.is_main:
        with _writing(out, order):
            runlog.prepare_folder(out, run, command)
    dist.barrier()  # the folder is written, and every rank has read what is done, before anyone appends
    runlog.check_manifest(out, run)  # every rank's run is rank 0's (same versions, GPU, threads)
    if work:
        positions = {sample.key: i for i, sample in enumerate(samples)}
        with _writing(out, order):
            _run_shard(pipe, config, cond, work, positions, out, dist, scorer, lpips_note, progress,
                       initial=len(done) if dist.world_size == 1 else 0)
    dist.barrier()
    if not dist.is_main:
        return None
    with _writing(out, order):
        return _finish(out, config, cond, samples, order, _meta(config, cond, run, dist, dtype, lpips_note, command),
                       lambda: pipe if pipe is not None else _load(config, cond, dist, dtype, load_pipeline), progress)
