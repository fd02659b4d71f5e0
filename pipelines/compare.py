"""``pasa compare``: every attention backend's video scored against the FP32-attention reference.

One pipeline is loaded once; for each backend its processors are installed with
``pasa_diffusers.apply``, the same image is animated from the same initial noise, and the frames are
scored against the reference's with ``metrics.score_video``.  The FP32 reference upcasts q, k and v
to float32 inside the same model, so only attention differs between runs.
"""
from __future__ import annotations

import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pasa_diffusers import metrics
from pasa_diffusers import install

from .svd import generate, load_image, load_svd, make_latents

__all__ = ["COMPARE_BACKENDS", "DEFAULT_BACKENDS", "backend_options", "parse_backends", "run_comparison",
           "write_comparison"]

COMPARE_BACKENDS = tuple(b for b in install.BACKENDS if b != "fp32")
DEFAULT_BACKENDS = ("pasa", "naive-half", "sdpa", "bf16")


def parse_backends(text: str) -> list[str]:
    """``"pasa,naive-half"`` -> ``["pasa", "naive-half"]``; unknown or repeated names raise ``ValueError``."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--backends: no backend named in {text!r}; choose from {', '.join(COMPARE_BACKENDS)}")
    unknown = [n for n in names if n not in COMPARE_BACKENDS]
    if unknown:
        raise ValueError(f"--backends: unknown backend(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(COMPARE_BACKENDS)} (fp32 is always the reference)")
    if len(set(names)) != len(names):
        raise ValueError(f"--backends: a backend is named twice in {text!r}")
    return names


def backend_options(backend: str, model_dtype: torch.dtype) -> dict:
    """Processor options for ``backend`` in a model of ``model_dtype``.

    In a float32 model (the CPU default) the low-precision backends cast q, k and v to float16
    themselves, so attention is what runs in FP16; the FP32 reference, SDPA and BF16 need nothing.
    """
    if model_dtype == torch.float32 and backend.startswith("pasa") or backend == "naive-half":
        return {"dtype": torch.float16}
    return {}


def _versions() -> dict[str, str]:
    import diffusers

    found = {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
             "numpy": np.__version__}
    try:
        import triton

        found["triton"] = triton.__version__
    except ImportError:
        found["triton"] = "not installed"
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name()
    return found


def _run(pipe: Any, backend: str, image: Any, latents: torch.Tensor, settings: dict, options: dict) -> tuple:
    summary = install.apply(pipe, backend, **options)
    start = time.perf_counter()
    frames = generate(pipe, image, latents=latents, progress=False, **settings)
    seconds = time.perf_counter() - start
    fallbacks = install.fallback_summary(pipe)
    install.restore(pipe)
    options = {key: str(value).removeprefix("torch.") for key, value in summary["options"].items()}
    return frames, seconds, {"installed": {**summary, "options": options}, "fallbacks": fallbacks}


def run_comparison(*, model: str = "tiny", backends: list[str] | tuple[str, ...] = DEFAULT_BACKENDS,
                   image: str = "builtin:rocket", num_frames: int = 4, num_inference_steps: int = 4,
                   seed: int = 0, height: int = 64, width: int = 64, device: str = "cpu",
                   dtype: torch.dtype | None = None, lpips_weights: str | None = None,
                   local_files_only: bool = False, progress: bool = True, command: str = "") -> tuple[dict, dict]:
    """Generate the reference and every backend; return ``(report, videos)``.

    ``dtype`` defaults to float16 on CUDA (how SVD is run) and float32 on the CPU, where float16
    convolutions are impractically slow; there the processors cast q, k and v to their own precision,
    so attention still runs in FP16/BF16.  ``videos`` maps ``"fp32"`` and each backend to its frames.
    """
    names = parse_backends(",".join(backends))
    if dtype is None:
        dtype = torch.float16 if torch.device(device).type == "cuda" else torch.float32
    pipe = load_svd(model, device=device, dtype=dtype, local_files_only=local_files_only)
    cond = load_image(image, (width, height))
    latents = make_latents(pipe, num_frames=num_frames, height=height, width=width, seed=seed)
    settings = {"num_frames": num_frames, "num_inference_steps": num_inference_steps, "seed": seed,
                "height": height, "width": width}

    available, reason = metrics.lpips_status(lpips_weights)
    scorer = metrics.LPIPSScorer(lpips_weights, device="cpu") if available else None

    from tqdm.auto import tqdm

    runs = ["fp32"] + names
    videos: dict[str, np.ndarray] = {}
    results: dict[str, dict] = {}
    bar = tqdm(runs, desc="compare", unit="video", file=sys.stderr, disable=not progress)
    for name in bar:
        bar.set_postfix_str(name)
        frames, seconds, procs = _run(pipe, name, cond, latents, settings, backend_options(name, dtype))
        videos[name] = frames
        if name == "fp32":
            reference_entry = {"seconds": seconds, "processors": procs}
            continue
        scores = metrics.score_video(videos["fp32"], frames, lpips_scorer=scorer, lpips_reason=reason)
        results[name] = {"scores": scores, "seconds": seconds, "processors": procs}
    report = {
        "command": command,
        "versions": _versions(),
        "model": model,
        "reference": "fp32",
        "settings": {**settings, "image": image, "device": device, "dtype": str(dtype).removeprefix("torch."),
                     "attention_cast": {n: str(backend_options(n, dtype).get("dtype", "none")).removeprefix("torch.")
                                       for n in names}},
        "reference_run": reference_entry,
        "backends": results,
    }
    return report, videos


def write_comparison(report: dict, videos: dict[str, np.ndarray], out_dir: str | Path, *, fps: int = 7) -> dict:
    """Write the report (json, md, plots), each video (mp4, gif, png frames) and side-by-side gifs."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = dict(metrics.write_report(report, out))
    for name, frames in videos.items():
        written[f"video:{name}"] = metrics.write_video(frames, out / "videos", name, fps=fps,
                                                       formats=("mp4", "gif"))
    for name, frames in videos.items():
        if name != "fp32":
            path = metrics.write_gif(metrics.side_by_side(videos["fp32"], frames), out / f"side_by_side_{name}.gif",
                                     fps=fps)
            written[f"side_by_side:{name}"] = path
    return written
