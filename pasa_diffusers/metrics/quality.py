"""Frame-quality metrics of a test video against a reference video.

Frames are floating-point numpy arrays in [0, 1]: a video is ``(F, H, W, 3)``,
a single frame ``(H, W, 3)``, neither empty. A finite value outside [0, 1] is
refused with ``ValueError`` (it is a caller's mistake, e.g. 0..255 pixels:
scoring it would give meaningless numbers). SSIM needs frames of at least
``SSIM_MIN_SIZE`` x ``SSIM_MIN_SIZE`` pixels (its Gaussian window).

Every ``*_frames`` function returns one value per frame (or per frame pair for
the temporal measure). A frame holding any non-finite value (NaN/inf) in either
input is not scored: its entry is NaN. :func:`score_video` excludes such frames
from every mean and flags them.

JSON convention of :func:`score_video`: an identical frame has PSNR ``+inf``,
written as the string ``"inf"``; a frame that was not scored (non-finite
pixels) is written as ``null``; a mean over no frames is ``null``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

from .records import json_float

SSIM_SIGMA = 1.5
SSIM_MIN_SIZE = 2 * int(3.5 * SSIM_SIGMA + 0.5) + 1
"""11: the side of skimage's Gaussian SSIM window (truncated at 3.5 sigma), the smallest frame SSIM takes."""

ALEXNET_WEIGHTS_FILE = "alexnet-owt-7be5be79.pth"
LPIPS_LABEL = "LPIPS (AlexNet)"
LPIPS_RANDOM_LABEL = "LPIPS (random AlexNet backbone: test only, not a metric)"

# torchvision ``alexnet.features`` conv index -> lpips slice holding that conv.
_ALEX_SLICES = {0: 1, 3: 2, 6: 3, 8: 4, 10: 5}


class LPIPSUnavailableError(RuntimeError):
    """Raised when LPIPS is requested but the AlexNet ImageNet weights are absent."""


class LPIPSWeightsError(ValueError):
    """The LPIPS weights file is not the torchvision AlexNet ImageNet weights (not a torch checkpoint, another
    state dict, other shapes); the message names the file and says why."""


def validate_frame(frame: Any, name: str) -> np.ndarray:
    """Check that ``frame`` is a non-empty floating ``(H, W, 3)`` array with finite values in [0, 1]; return it."""
    return _validate(frame, name, rank=3, layout="(H, W, 3)")


def validate_video(video: Any, name: str) -> np.ndarray:
    """Check that ``video`` is a non-empty floating ``(F, H, W, 3)`` array with finite values in [0, 1]
    (NaN and inf are allowed: they mark overflowed frames); return it."""
    return _validate(video, name, rank=4, layout="(F, H, W, 3)")


def _validate(arr: Any, name: str, *, rank: int, layout: str) -> np.ndarray:
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{name} must be a numpy array {layout}, got {type(arr).__name__}")
    if arr.ndim != rank:
        raise ValueError(f"{name} must have rank {rank} {layout}, got shape {arr.shape}")
    if arr.shape[-1] != 3:
        raise ValueError(f"{name} must have 3 channels in the last axis {layout}, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"{name} must have a floating dtype with values in [0, 1], got {arr.dtype}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty {layout}: got shape {arr.shape}")
    finite = arr[np.isfinite(arr)]
    if finite.size and (finite.min() < 0.0 or finite.max() > 1.0):
        hint = " (0..255 pixels? divide by 255)" if 2.0 < finite.max() <= 255.0 else ""
        raise ValueError(f"{name} must hold values in [0, 1], found values in [{finite.min():.6g}, "
                         f"{finite.max():.6g}]{hint}")
    return arr


def _validate_pair(ref: Any, test: Any, *, video: bool) -> tuple[np.ndarray, np.ndarray]:
    check = validate_video if video else validate_frame
    ref, test = check(ref, "ref"), check(test, "test")
    if ref.shape != test.shape:
        raise ValueError(f"ref and test must have the same shape, got ref {ref.shape} and test {test.shape}")
    return ref, test


def _check_ssim_size(frames: np.ndarray) -> None:
    height, width = frames.shape[-3:-1]
    if min(height, width) < SSIM_MIN_SIZE:
        raise ValueError(f"SSIM needs frames of at least {SSIM_MIN_SIZE}x{SSIM_MIN_SIZE} pixels (its Gaussian "
                         f"window, sigma {SSIM_SIGMA}), got {height}x{width}")


def nonfinite_frames(video: np.ndarray) -> np.ndarray:
    """Indices of the frames of ``video`` that hold any NaN or infinite value."""
    video = validate_video(video, "video")
    return np.flatnonzero(~np.isfinite(video).reshape(len(video), -1).all(axis=1))


def _finite_mask(ref: np.ndarray, test: np.ndarray) -> np.ndarray:
    """Per-frame mask: True where both frames are entirely finite."""
    both = np.isfinite(ref) & np.isfinite(test)
    return both.reshape(len(ref), -1).all(axis=1)


def psnr_frame(ref: np.ndarray, test: np.ndarray) -> float:
    """PSNR in dB of one ``(H, W, 3)`` frame, data range 1; identical frames give ``inf``."""
    ref, test = _validate_pair(ref, test, video=False)
    return _psnr(ref, test, data_range=1.0)


def _psnr(ref: np.ndarray, test: np.ndarray, *, data_range: float) -> float:
    with np.errstate(divide="ignore"):
        return float(peak_signal_noise_ratio(ref, test, data_range=data_range))


def ssim_frame(ref: np.ndarray, test: np.ndarray) -> float:
    """SSIM of one ``(H, W, 3)`` frame (Gaussian window, sigma 1.5, population covariance)."""
    ref, test = _validate_pair(ref, test, video=False)
    _check_ssim_size(ref)
    return _ssim(ref, test)


def _ssim(ref: np.ndarray, test: np.ndarray) -> float:
    return float(
        structural_similarity(
            ref,
            test,
            gaussian_weights=True,
            sigma=SSIM_SIGMA,
            use_sample_covariance=False,
            data_range=1.0,
            channel_axis=-1,
        )
    )


def psnr_frames(ref: np.ndarray, test: np.ndarray) -> np.ndarray:
    """Per-frame PSNR (dB, data range 1) of two ``(F, H, W, 3)`` videos; NaN where not scored."""
    ref, test = _validate_pair(ref, test, video=True)
    mask = _finite_mask(ref, test)
    return np.array([_psnr(r, t, data_range=1.0) if ok else np.nan for r, t, ok in zip(ref, test, mask)])


def ssim_frames(ref: np.ndarray, test: np.ndarray) -> np.ndarray:
    """Per-frame SSIM of two ``(F, H, W, 3)`` videos; NaN where not scored."""
    ref, test = _validate_pair(ref, test, video=True)
    _check_ssim_size(ref)
    mask = _finite_mask(ref, test)
    return np.array([_ssim(r, t) if ok else np.nan for r, t, ok in zip(ref, test, mask)])


def temporal_error(ref: np.ndarray, test: np.ndarray) -> np.ndarray:
    """PSNR (dB) of the test video's frame differences against the reference's.

    Entry ``t`` compares ``test[t+1] - test[t]`` with ``ref[t+1] - ref[t]`` with
    data range 2 (differences lie in [-1, 1]). A constant per-frame offset of
    the test video cancels out, so this isolates motion and flicker fidelity.
    Returns ``F - 1`` values; NaN for pairs touching an unscored frame, ``inf``
    for pairs whose differences match exactly.
    """
    ref, test = _validate_pair(ref, test, video=True)
    mask = _finite_mask(ref, test)
    out = np.full(max(len(ref) - 1, 0), np.nan)
    for t in range(len(out)):
        if mask[t] and mask[t + 1]:
            out[t] = _psnr(ref[t + 1] - ref[t], test[t + 1] - test[t], data_range=2.0)
    return out


def flicker_ratio(ref: np.ndarray, test: np.ndarray) -> float:
    """Mean absolute frame-to-frame change of ``test`` divided by that of ``ref``.

    1.0 means the test video changes as much as the reference between frames;
    above 1 it flickers more, below 1 it is frozen/smoothed. Only pairs of
    finite frames count. A static reference gives 1.0 for a static test and
    ``inf`` otherwise; no usable pair gives NaN.
    """
    ref, test = _validate_pair(ref, test, video=True)
    mask = _finite_mask(ref, test)
    pairs = np.flatnonzero(mask[:-1] & mask[1:])
    if pairs.size == 0:
        return float("nan")
    test_change = float(np.mean(np.abs(test[pairs + 1] - test[pairs], dtype=np.float64)))
    ref_change = float(np.mean(np.abs(ref[pairs + 1] - ref[pairs], dtype=np.float64)))
    if ref_change == 0.0:
        return 1.0 if test_change == 0.0 else float("inf")
    return test_change / ref_change


def default_alexnet_weights_path() -> Path:
    """Where torchvision caches the AlexNet ImageNet weights (honours ``$TORCH_HOME``)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / ALEXNET_WEIGHTS_FILE


def lpips_status(weights_path: str | Path | None = None) -> tuple[bool, str]:
    """Whether real AlexNet ImageNet weights are available for LPIPS, and a sentence why (not).

    Only the default location (``weights_path=None``: the torch hub cache) may lack them; an explicit
    ``weights_path`` that is not a file raises ``FileNotFoundError``."""
    if weights_path is not None and not Path(weights_path).is_file():
        raise FileNotFoundError(f"LPIPS weights_path {os.fspath(weights_path)} is not a file; pass the torchvision "
                                f"AlexNet ImageNet weights ({ALEXNET_WEIGHTS_FILE}) or no path (torch hub cache)")
    path = Path(weights_path) if weights_path is not None else default_alexnet_weights_path()
    if path.is_file():
        return True, f"LPIPS available: AlexNet ImageNet weights at {path}"
    return False, (
        f"LPIPS unavailable: no AlexNet ImageNet weights at {path}; "
        f"put {ALEXNET_WEIGHTS_FILE} there or pass --lpips-weights PATH"
    )


def _alexnet_features(state: Any, source: str) -> dict[str, torch.Tensor]:
    """Map a torchvision AlexNet state dict onto the key names of ``lpips``' AlexNet trunk."""
    if not isinstance(state, dict):
        raise LPIPSWeightsError(f"{source}: expected a torchvision AlexNet state dict, got {type(state).__name__}")
    mapping = {
        f"features.{conv}.{kind}": f"slice{piece}.{conv}.{kind}"
        for conv, piece in _ALEX_SLICES.items()
        for kind in ("weight", "bias")
    }
    missing = sorted(key for key in mapping if key not in state)
    if missing:
        raise LPIPSWeightsError(f"{source}: not a torchvision AlexNet state dict; missing keys {missing}")
    return {target: state[key] for key, target in mapping.items()}


def _build_lpips(weights_path: Path | None) -> torch.nn.Module:
    """The ``lpips`` AlexNet model with ImageNet trunk weights from ``weights_path`` (random if None)."""
    import lpips

    features = None
    if weights_path is not None:
        try:
            state = torch.load(weights_path, map_location="cpu", weights_only=True)
        except Exception as exc:  # bytes that are no checkpoint raise many types (torch advises weights_only=False)
            raise LPIPSWeightsError(f"{weights_path}: not a torch checkpoint (torch.load: {type(exc).__name__}); pass "
                                    f"the torchvision AlexNet ImageNet weights ({ALEXNET_WEIGHTS_FILE})") from exc
        features = _alexnet_features(state, str(weights_path))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(pretrained|weight enum).*", category=UserWarning)
        model = lpips.LPIPS(net="alex", pretrained=True, pnet_rand=True, verbose=False)
    if features is not None:
        expected = model.net.state_dict()
        for key, value in features.items():
            if tuple(value.shape) != tuple(expected[key].shape):
                raise LPIPSWeightsError(
                    f"{weights_path}: {key} has shape {tuple(value.shape)}, "
                    f"expected {tuple(expected[key].shape)}"
                )
        model.net.load_state_dict(features, strict=True)
    return model.eval()


class LPIPSScorer:
    """LPIPS (AlexNet, v0.1 linear heads) on [0, 1] frames, without ever downloading weights.

    The AlexNet ImageNet weights are read from ``weights_path`` (``FileNotFoundError``
    if it is not a file) or from the torch hub cache (:func:`default_alexnet_weights_path`).
    If those are absent this raises :class:`LPIPSUnavailableError` unless ``random_backbone=True``, which
    keeps a randomly initialised trunk: for tests only, and labelled as such in
    :attr:`label`.
    """

    def __init__(
        self,
        weights_path: str | Path | None = None,
        *,
        random_backbone: bool = False,
        device: str | torch.device = "cpu",
    ) -> None:
        self.device = torch.device(device)
        if random_backbone:
            self.weights_path = None
            self.label = LPIPS_RANDOM_LABEL
        else:
            available, reason = lpips_status(weights_path)
            if not available:
                raise LPIPSUnavailableError(reason)
            self.weights_path = Path(weights_path) if weights_path is not None else default_alexnet_weights_path()
            self.label = LPIPS_LABEL
        self._model = _build_lpips(self.weights_path).to(self.device)

    @property
    def random_backbone(self) -> bool:
        """True when the AlexNet trunk is random (test-only scorer)."""
        return self.weights_path is None

    def frames(self, ref: np.ndarray, test: np.ndarray, *, batch_size: int = 8) -> np.ndarray:
        """Per-frame LPIPS distance of two ``(F, H, W, 3)`` videos; NaN where not scored."""
        ref, test = _validate_pair(ref, test, video=True)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        out = np.full(len(ref), np.nan)
        scored = np.flatnonzero(_finite_mask(ref, test))
        with torch.inference_mode():
            for start in range(0, scored.size, batch_size):
                idx = scored[start : start + batch_size]
                dist = self._model(self._tensor(ref[idx]), self._tensor(test[idx]), normalize=True)
                out[idx] = dist.flatten().double().cpu().numpy()
        return out

    def _tensor(self, frames: np.ndarray) -> torch.Tensor:
        nchw = np.ascontiguousarray(frames.transpose(0, 3, 1, 2), dtype=np.float32)
        return torch.from_numpy(nchw).to(self.device)


def _finite_mean(values: np.ndarray) -> float | None:
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else None


def _nonfinite_summary(indices: np.ndarray) -> dict[str, Any]:
    return {
        "count": int(indices.size),
        "first_index": int(indices[0]) if indices.size else None,
        "indices": [int(i) for i in indices],
    }


def score_video(
    ref: np.ndarray,
    test: np.ndarray,
    *,
    lpips_scorer: LPIPSScorer | None = None,
    lpips_reason: str | None = None,
) -> dict[str, Any]:
    """Score ``test`` against ``ref`` (both ``(F, H, W, 3)``); the result is JSON-safe.

    Layout::

        {"frames": F, "scored_frames": n,
         "psnr": {"per_frame": [...], "mean": m, "identical_frames": k},
         "ssim": {"per_frame": [...], "mean": m},
         "lpips": {"per_frame": [...], "mean": m, "label": str} or None,
         "lpips_unavailable": str            # only when "lpips" is None
         "temporal_psnr": {"per_frame": [... F-1 ...], "mean": m, "identical_pairs": k},
         "flicker_ratio": r,
         "nonfinite": {"count": n, "first_index": i or None, "indices": [...]},
         "reference_nonfinite": {"count": ..., "first_index": ..., "indices": [...]}}

    Both videos are validated (non-empty, finite values in [0, 1], at least
    ``SSIM_MIN_SIZE`` pixels a side) before anything is scored. Frames with
    non-finite pixels (in test or reference) are ``null`` in the
    per-frame lists and excluded from all means. The PSNR mean covers finite
    PSNR values only; identical frames (``"inf"``) are counted separately. A
    mean over no frames is ``null``. ``lpips_reason`` overrides the sentence
    stored under ``"lpips_unavailable"`` when no scorer is given.
    """
    ref, test = _validate_pair(ref, test, video=True)
    _check_ssim_size(ref)
    psnr = psnr_frames(ref, test)
    ssim = ssim_frames(ref, test)
    temporal = temporal_error(ref, test)
    scores: dict[str, Any] = {
        "frames": int(len(ref)),
        "scored_frames": int(_finite_mask(ref, test).sum()),
        "psnr": {
            "per_frame": [json_float(v) for v in psnr],
            "mean": _finite_mean(psnr),
            "identical_frames": int(np.isposinf(psnr).sum()),
        },
        "ssim": {"per_frame": [json_float(v) for v in ssim], "mean": _finite_mean(ssim)},
        "temporal_psnr": {
            "per_frame": [json_float(v) for v in temporal],
            "mean": _finite_mean(temporal),
            "identical_pairs": int(np.isposinf(temporal).sum()),
        },
        "flicker_ratio": json_float(flicker_ratio(ref, test)),
        "nonfinite": _nonfinite_summary(nonfinite_frames(test)),
        "reference_nonfinite": _nonfinite_summary(nonfinite_frames(ref)),
    }
    if lpips_scorer is not None:
        lp = lpips_scorer.frames(ref, test)
        scores["lpips"] = {
            "per_frame": [json_float(v) for v in lp],
            "mean": _finite_mean(lp),
            "label": lpips_scorer.label,
        }
    else:
        scores["lpips"] = None
        scores["lpips_unavailable"] = lpips_reason or _no_scorer_reason()
    return scores


def _no_scorer_reason() -> str:
    available, reason = lpips_status()
    return "LPIPS unavailable: no LPIPS scorer was passed to score_video" if available else reason
