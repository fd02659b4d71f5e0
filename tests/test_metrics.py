"""Tests of pasa_diffusers.metrics.quality: PSNR/SSIM/LPIPS, temporal measures, non-finite handling, validation."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import torchvision
from skimage import data
from skimage.metrics import peak_signal_noise_ratio, structural_similarity
from skimage.transform import resize

from pasa_diffusers.metrics.quality import (
    ALEXNET_WEIGHTS_FILE,
    LPIPS_LABEL,
    LPIPS_RANDOM_LABEL,
    LPIPSScorer,
    LPIPSWeightsError,
    LPIPSUnavailableError,
    default_alexnet_weights_path,
    flicker_ratio,
    lpips_status,
    nonfinite_frames,
    psnr_frame,
    psnr_frames,
    score_video,
    ssim_frame,
    ssim_frames,
    temporal_error,
)

IMAGES = {"astronaut": data.astronaut, "coffee": data.coffee, "rocket": data.rocket}
SSIM_CONVENTION = dict(gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range=1.0, channel_axis=-1)


def make_video(name: str, frames: int = 5, height: int = 64, width: int = 96, step: int = 6) -> np.ndarray:
    """A camera pan across a bundled scikit-image photo: (frames, height, width, 3) float32 in [0, 1]."""
    big = resize(IMAGES[name](), (height, width + step * (frames - 1)), anti_aliasing=True)
    return np.stack([big[:, i * step : i * step + width] for i in range(frames)]).astype(np.float32)


def add_noise(video: np.ndarray, sigma: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(video + rng.normal(0.0, sigma, video.shape), 0.0, 1.0).astype(np.float32)


@pytest.fixture(scope="module")
def random_scorer() -> LPIPSScorer:
    torch.manual_seed(0)
    return LPIPSScorer(random_backbone=True)


@pytest.fixture
def empty_torch_home(tmp_path, monkeypatch):
    """Point the torch hub cache at an empty folder so no real AlexNet weights are found."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    return tmp_path / "torch_home"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_psnr_ssim_equal_direct_skimage_calls(name):
    ref = make_video(name)
    test = add_noise(ref, 0.05)
    psnr, ssim = psnr_frames(ref, test), ssim_frames(ref, test)
    assert psnr.shape == ssim.shape == (len(ref),)
    for i in range(len(ref)):
        assert psnr[i] == peak_signal_noise_ratio(ref[i], test[i], data_range=1.0)
        assert ssim[i] == structural_similarity(ref[i], test[i], **SSIM_CONVENTION)
        assert psnr_frame(ref[i], test[i]) == psnr[i]
        assert ssim_frame(ref[i], test[i]) == ssim[i]
    default_ssim = structural_similarity(ref[0], test[0], data_range=1.0, channel_axis=-1)
    assert abs(default_ssim - ssim[0]) > 1e-3, "the Gaussian-window convention must differ from skimage defaults"


def test_identical_frames_give_inf_psnr_unit_ssim_zero_lpips(random_scorer):
    ref = make_video("coffee")
    same = ref.copy()
    assert np.isposinf(psnr_frames(ref, same)).all()
    np.testing.assert_allclose(ssim_frames(ref, same), 1.0, atol=1e-6)
    np.testing.assert_allclose(random_scorer.frames(ref, same), 0.0, atol=1e-7)
    assert np.isposinf(temporal_error(ref, same)).all()
    assert flicker_ratio(ref, same) == 1.0
    assert random_scorer.label == LPIPS_RANDOM_LABEL and random_scorer.random_backbone

    scores = score_video(ref, same, lpips_scorer=random_scorer)
    assert scores["psnr"]["per_frame"] == ["inf"] * len(ref)
    assert scores["psnr"]["mean"] is None
    assert scores["psnr"]["identical_frames"] == len(ref)
    assert scores["temporal_psnr"]["identical_pairs"] == len(ref) - 1
    assert scores["lpips"]["label"] == LPIPS_RANDOM_LABEL
    json.dumps(scores, allow_nan=False)


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_more_noise_lowers_psnr_ssim_and_raises_lpips(name, random_scorer):
    ref = make_video(name, frames=3)
    sigmas = (0.01, 0.03, 0.1, 0.3)
    noisy = [add_noise(ref, sigma, seed=i) for i, sigma in enumerate(sigmas)]
    psnr = np.array([psnr_frames(ref, t) for t in noisy])
    ssim = np.array([ssim_frames(ref, t) for t in noisy])
    lpips = np.array([random_scorer.frames(ref, t) for t in noisy])
    assert (np.diff(psnr, axis=0) < 0).all()
    assert (np.diff(ssim, axis=0) < 0).all()
    assert (np.diff(lpips, axis=0) > 0).all()
    assert (lpips[0] > 0).all()


def test_lpips_batching_does_not_change_values(random_scorer):
    ref = make_video("rocket", frames=5)
    test = add_noise(ref, 0.08)
    np.testing.assert_allclose(
        random_scorer.frames(ref, test, batch_size=2), random_scorer.frames(ref, test, batch_size=8), rtol=1e-5
    )
    with pytest.raises(ValueError, match="batch_size"):
        random_scorer.frames(ref, test, batch_size=0)


def test_nonfinite_frames_are_flagged_and_excluded_from_means(random_scorer):
    ref = make_video("astronaut", frames=6)
    test = add_noise(ref, 0.05)
    test[1, 5, 7, 2] = np.nan
    test[3, 10, 20, 0] = np.inf
    assert nonfinite_frames(test).tolist() == [1, 3]
    assert nonfinite_frames(ref).size == 0

    scores = score_video(ref, test, lpips_scorer=random_scorer)
    assert scores["nonfinite"] == {"count": 2, "first_index": 1, "indices": [1, 3]}
    assert scores["reference_nonfinite"]["count"] == 0
    assert scores["scored_frames"] == 4
    good = [0, 2, 4, 5]
    for metric in ("psnr", "ssim", "lpips"):
        per_frame = scores[metric]["per_frame"]
        assert per_frame[1] is None and per_frame[3] is None
        assert all(isinstance(per_frame[i], float) for i in good)
    direct_psnr = [peak_signal_noise_ratio(ref[i], test[i], data_range=1.0) for i in good]
    direct_ssim = [structural_similarity(ref[i], test[i], **SSIM_CONVENTION) for i in good]
    assert scores["psnr"]["mean"] == pytest.approx(np.mean(direct_psnr), rel=1e-12)
    assert scores["ssim"]["mean"] == pytest.approx(np.mean(direct_ssim), rel=1e-12)
    assert scores["lpips"]["mean"] == pytest.approx(np.mean(random_scorer.frames(ref[good], test[good])), rel=1e-6)
    # Only the pair (4, 5) touches no flagged frame.
    assert scores["temporal_psnr"]["per_frame"][:4] == [None] * 4
    expected_pair = peak_signal_noise_ratio(ref[5] - ref[4], test[5] - test[4], data_range=2.0)
    assert scores["temporal_psnr"]["mean"] == pytest.approx(expected_pair, rel=1e-12)
    json.dumps(scores, allow_nan=False)


def test_all_nonfinite_means_are_none():
    ref = make_video("coffee", frames=4)
    test = ref.copy()
    test[:, 0, 0, 1] = np.nan
    scores = score_video(ref, test)
    assert scores["nonfinite"]["count"] == 4 and scores["nonfinite"]["first_index"] == 0
    assert scores["psnr"]["mean"] is None and scores["psnr"]["identical_frames"] == 0
    assert scores["ssim"]["mean"] is None and scores["temporal_psnr"]["mean"] is None
    assert scores["flicker_ratio"] is None
    json.dumps(scores, allow_nan=False)


def test_nonfinite_reference_frames_are_excluded_and_reported():
    ref = make_video("rocket", frames=4)
    test = add_noise(ref, 0.02)
    ref[2, 3, 3, 0] = np.nan
    scores = score_video(ref, test)
    assert scores["reference_nonfinite"]["indices"] == [2]
    assert scores["nonfinite"]["count"] == 0
    assert scores["psnr"]["per_frame"][2] is None
    assert scores["scored_frames"] == 3


def test_temporal_error_ignores_static_offset_but_sees_flicker():
    ref = 0.85 * make_video("astronaut", frames=6).astype(np.float64)  # room for the offsets below 1
    offset = ref + 0.03
    assert psnr_frames(ref, offset).max() < 31.0
    assert temporal_error(ref, offset).min() > 100.0
    assert flicker_ratio(ref, offset) == pytest.approx(1.0, abs=1e-9)

    flicker = ref + 0.1 * (np.arange(len(ref)) % 2)[:, None, None, None]
    # Every difference is off by +-0.1: PSNR = 20 log10(2 / 0.1), far below the static-offset case.
    np.testing.assert_allclose(temporal_error(ref, flicker), 20 * np.log10(2 / 0.1), rtol=1e-9)
    assert flicker_ratio(ref, flicker) > 1.1

    frozen = np.repeat(ref[:1], len(ref), axis=0)
    assert flicker_ratio(ref, frozen) == 0.0


def test_temporal_error_matches_its_definition():
    ref = make_video("coffee", frames=4).astype(np.float64)
    test = add_noise(ref, 0.04).astype(np.float64)
    values = temporal_error(ref, test)
    assert values.shape == (3,)
    for t in range(3):
        mse = np.mean(((test[t + 1] - test[t]) - (ref[t + 1] - ref[t])) ** 2)
        assert values[t] == pytest.approx(10 * np.log10(4.0 / mse), rel=1e-9)


def test_flicker_ratio_with_static_reference():
    still = np.repeat(make_video("rocket", frames=1), 3, axis=0)
    assert flicker_ratio(still, still.copy()) == 1.0
    assert flicker_ratio(still, add_noise(still, 0.05)) == float("inf")
    scores = score_video(still, add_noise(still, 0.05))
    assert scores["flicker_ratio"] == "inf"
    json.dumps(scores, allow_nan=False)


def test_lpips_status_reports_missing_default_weights_and_refuses_a_missing_path(tmp_path, empty_torch_home):
    default = default_alexnet_weights_path()
    assert default == empty_torch_home / "hub" / "checkpoints" / ALEXNET_WEIGHTS_FILE
    ok, reason = lpips_status()
    assert not ok
    assert reason.startswith("LPIPS unavailable: no AlexNet ImageNet weights at")
    assert str(default) in reason and "--lpips-weights PATH" in reason

    missing = tmp_path / "nowhere" / ALEXNET_WEIGHTS_FILE
    with pytest.raises(FileNotFoundError, match=f"LPIPS weights_path {missing} is not a file"):
        lpips_status(missing)
    with pytest.raises(FileNotFoundError, match="is not a file"):
        lpips_status(tmp_path)  # a folder

    default.parent.mkdir(parents=True)
    default.write_bytes(b"placeholder")
    assert lpips_status()[0]


def test_scorer_without_weights_raises(tmp_path, empty_torch_home):
    with pytest.raises(LPIPSUnavailableError, match="LPIPS unavailable"):
        LPIPSScorer()
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing.pth")):
        LPIPSScorer(tmp_path / "missing.pth")


def test_score_video_without_scorer_records_reason(empty_torch_home):
    ref = make_video("coffee", frames=3)
    scores = score_video(ref, add_noise(ref, 0.02))
    assert scores["lpips"] is None
    assert scores["lpips_unavailable"].startswith("LPIPS unavailable: no AlexNet ImageNet weights")
    custom = score_video(ref, add_noise(ref, 0.02), lpips_reason="LPIPS unavailable: disabled")
    assert custom["lpips_unavailable"] == "LPIPS unavailable: disabled"


@pytest.fixture
def alexnet_state() -> dict[str, torch.Tensor]:
    """A torchvision-format AlexNet state dict with random values.

    The large fully connected layers are dropped to keep the files small; one
    classifier key stays to show that keys beyond the conv trunk are ignored.
    """
    torch.manual_seed(1)
    state = torchvision.models.alexnet(weights=None).state_dict()
    return {key: value for key, value in state.items() if key.startswith("features.") or key == "classifier.6.bias"}


def test_scorer_loads_torchvision_alexnet_weights_without_download(tmp_path, alexnet_state, monkeypatch):
    def no_download(*args, **kwargs):
        raise AssertionError("LPIPSScorer tried to download weights")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_download)
    path = tmp_path / ALEXNET_WEIGHTS_FILE
    torch.save(alexnet_state, path)
    scorer = LPIPSScorer(path)
    assert scorer.label == LPIPS_LABEL and not scorer.random_backbone
    trunk = scorer._model.net.state_dict()
    for conv, piece in {0: 1, 3: 2, 6: 3, 8: 4, 10: 5}.items():
        for kind in ("weight", "bias"):
            assert torch.equal(trunk[f"slice{piece}.{conv}.{kind}"], alexnet_state[f"features.{conv}.{kind}"])
    ref = make_video("astronaut", frames=3)
    assert (scorer.frames(ref, add_noise(ref, 0.1)) > 0).all()


def test_scorer_rejects_wrong_state_dicts(tmp_path, alexnet_state):
    wrong_keys = {key.replace("features.", "backbone."): value for key, value in alexnet_state.items()}
    torch.save(wrong_keys, tmp_path / "keys.pth")
    with pytest.raises(ValueError, match="missing keys.*features.0.weight"):
        LPIPSScorer(tmp_path / "keys.pth")

    partial = {key: value for key, value in alexnet_state.items() if key != "features.8.bias"}
    torch.save(partial, tmp_path / "partial.pth")
    with pytest.raises(ValueError, match="features.8.bias"):
        LPIPSScorer(tmp_path / "partial.pth")

    wrong_shape = dict(alexnet_state)
    wrong_shape["features.6.weight"] = torch.zeros(2, 2, 3, 3)
    torch.save(wrong_shape, tmp_path / "shape.pth")
    with pytest.raises(ValueError, match="slice3.6.weight has shape"):
        LPIPSScorer(tmp_path / "shape.pth")

    torch.save(torch.ones(3), tmp_path / "tensor.pth")
    with pytest.raises(LPIPSWeightsError, match="expected a torchvision AlexNet state dict"):
        LPIPSScorer(tmp_path / "tensor.pth")

    (tmp_path / "notes.txt").write_text("not weights\n")
    with pytest.raises(LPIPSWeightsError, match=rf"^{tmp_path / 'notes.txt'}: not a torch checkpoint \(.*\); pass the "
                                                r"torchvision AlexNet ImageNet weights \(alexnet-owt-7be5be79.pth\)$"):
        LPIPSScorer(tmp_path / "notes.txt")


@pytest.mark.parametrize("content, why", [(b"not weights\n", r"not a torch checkpoint \(.*\); pass the torchvision"),
                                          (None, r"not a torchvision AlexNet state dict; missing keys")])
def test_compare_names_lpips_weights_it_cannot_use_in_one_line(tmp_path, capsys, content, why):
    """A text file, or another state dict, given to --lpips-weights: one line naming the flag (was a traceback),
    before the model is loaded; the run folder is not created."""
    from pasa_diffusers.cli import main

    weights = tmp_path / "weights.pth"
    if content is None:
        torch.save({"a": torch.zeros(2)}, weights)
    else:
        weights.write_bytes(content)
    out = tmp_path / "run"
    assert main(["compare", "--model", "tiny", "--images", "builtin:rocket", "--seeds", "0", "--backends", "sdpa",
                 "--frames", "2", "--steps", "1", "--height", "16", "--width", "16", "--lpips-weights", str(weights),
                 "--out", str(out)]) == 2
    assert re.fullmatch(rf"pasa compare: error: --lpips-weights {weights}: {why}.*\n", capsys.readouterr().err)
    assert not out.exists()


@pytest.mark.parametrize("func", [psnr_frames, ssim_frames, temporal_error, flicker_ratio, score_video])
def test_bad_inputs_raise_value_error_naming_the_argument(func):
    ref = make_video("rocket", frames=3)
    with pytest.raises(ValueError, match="ref and test must have the same shape"):
        func(ref, ref[:, :32])
    with pytest.raises(ValueError, match="^ref must have rank 4"):
        func(ref[0], ref[0])
    with pytest.raises(ValueError, match="^test must have 3 channels"):
        func(ref, np.concatenate([ref, ref[..., :1]], axis=-1))
    with pytest.raises(ValueError, match="^test must have a floating dtype"):
        func(ref, (ref * 255).astype(np.uint8))
    with pytest.raises(ValueError, match="^ref must be a numpy array"):
        func(ref.tolist(), ref)


def test_frame_helpers_and_nonfinite_frames_validate_inputs(random_scorer):
    frame = make_video("coffee", frames=1)[0]
    with pytest.raises(ValueError, match="^test must have rank 3"):
        psnr_frame(frame, frame[None])
    with pytest.raises(ValueError, match="^ref must have a floating dtype"):
        ssim_frame(frame.astype(np.int32), frame)
    with pytest.raises(ValueError, match="^video must have rank 4"):
        nonfinite_frames(frame)
    with pytest.raises(ValueError, match="^test must have 3 channels"):
        random_scorer.frames(frame[None], frame[None, ..., :2])


@pytest.mark.parametrize("func", [psnr_frames, ssim_frames, temporal_error, flicker_ratio, score_video])
def test_frames_outside_unit_range_are_refused_with_what_was_found(func):
    ref = make_video("rocket", frames=2)
    with pytest.raises(ValueError, match=r"^test must hold values in \[0, 1\], found values in \[7, 249\] "
                                         r"\(0\.\.255 pixels\? divide by 255\)"):
        func(ref, np.round(ref * 255).astype(np.float32))
    below = ref.copy()
    below[1, 3, 4, 0] = -0.25
    with pytest.raises(ValueError, match=r"^ref must hold values in \[0, 1\], found values in \[-0\.25, "):
        func(below, ref)
    overflowed = ref.copy()
    overflowed[0, 0, 0] = [np.nan, np.inf, -np.inf]  # non-finite values mark overflow: scored as such, not refused
    func(ref, overflowed)


@pytest.mark.parametrize("shape", [(0, 32, 32, 3), (2, 0, 32, 3), (2, 32, 0, 3)])
@pytest.mark.parametrize("func", [psnr_frames, ssim_frames, temporal_error, flicker_ratio, score_video])
def test_empty_videos_are_refused(func, shape):
    empty = np.zeros(shape, dtype=np.float32)
    with pytest.raises(ValueError, match=rf"^ref is empty \(F, H, W, 3\): got shape \({shape[0]}, "):
        func(empty, empty)


@pytest.mark.parametrize("func", [ssim_frames, score_video])
def test_ssim_refuses_frames_smaller_than_its_window_before_scoring(func):
    video = make_video("coffee", frames=2, height=8, width=64)
    with pytest.raises(ValueError, match=r"SSIM needs frames of at least 11x11 pixels .* got 8x64"):
        func(video, video)
    video = make_video("coffee", frames=2, height=11, width=11)
    assert np.all(ssim_frames(video, video) == 1.0)
