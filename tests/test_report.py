"""Tests of pasa_diffusers.metrics.report: report.json / report.md / PNG plots and the terminal table."""

from __future__ import annotations

import json
import sys

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from skimage import data
from skimage.transform import resize

from pasa_diffusers.metrics.quality import LPIPS_RANDOM_LABEL, LPIPSScorer, score_video
from pasa_diffusers.metrics.report import COLUMNS, format_table, json_safe, table_rows, write_report

MD_HEADER = "| backend | PSNR dB (mean) | SSIM | LPIPS | temporal PSNR | flicker | non-finite frames | time s |"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NO_WEIGHTS = "LPIPS unavailable: no AlexNet ImageNet weights at /nowhere/alexnet-owt-7be5be79.pth"


def make_video(frames: int = 5, height: int = 64, width: int = 96, step: int = 6) -> np.ndarray:
    """A camera pan across scikit-image's astronaut photo: (frames, height, width, 3) float32 in [0, 1]."""
    big = resize(data.astronaut(), (height, width + step * (frames - 1)), anti_aliasing=True)
    return np.stack([big[:, i * step : i * step + width] for i in range(frames)]).astype(np.float32)


@pytest.fixture(scope="module")
def random_scorer() -> LPIPSScorer:
    torch.manual_seed(0)
    return LPIPSScorer(random_backbone=True)


def build_report(lpips_scorer: LPIPSScorer | None) -> dict:
    ref = make_video()
    rng = np.random.default_rng(3)
    noisy = np.clip(ref + rng.normal(0, 0.03, ref.shape), 0, 1).astype(np.float32)
    broken = noisy.copy()
    broken[2, 4, 4, 0] = np.nan
    broken[4] = np.inf
    partly_identical = ref.copy()
    partly_identical[3] = noisy[3]

    def scores(test):
        return score_video(ref, test, lpips_scorer=lpips_scorer, lpips_reason=NO_WEIGHTS)

    return {
        "command": "pasa bench --frames 5",
        "versions": {"torch": torch.__version__, "numpy": np.__version__},
        "model": "stabilityai/stable-video-diffusion-img2vid-xt",
        "reference": "fp32",
        "settings": {"frames": 5, "seed": 0, "guidance": np.float32(3.0)},
        "backends": {
            "fp16-pasa": {"scores": scores(noisy), "seconds": 12.5, "processors": {"PASA": 32}},
            "fp16-naive": {"scores": scores(broken), "seconds": np.float64(9.25)},
            "fp32-again": {"scores": scores(partly_identical)},
        },
    }


def test_report_files_without_lpips(tmp_path):
    report = build_report(None)
    written = write_report(report, tmp_path / "run")
    assert set(written) == {"json", "markdown", "psnr", "ssim"}
    assert not (tmp_path / "run" / "lpips.png").exists()

    text = written["json"].read_text()
    assert "NaN" not in text and "Infinity" not in text
    loaded = json.loads(text)
    assert {"command", "versions", "model", "reference", "settings", "backends"} <= set(loaded)
    assert set(loaded["backends"]) == {"fp16-pasa", "fp16-naive", "fp32-again"}
    naive = loaded["backends"]["fp16-naive"]["scores"]
    assert len(naive["psnr"]["per_frame"]) == 5 and len(naive["temporal_psnr"]["per_frame"]) == 4
    assert naive["psnr"]["per_frame"][2] is None and naive["nonfinite"]["first_index"] == 2
    assert loaded["backends"]["fp32-again"]["scores"]["psnr"]["per_frame"].count("inf") == 4
    assert loaded["settings"]["guidance"] == 3.0

    md = written["markdown"].read_text()
    assert MD_HEADER in md
    assert "# Quality report: stabilityai/stable-video-diffusion-img2vid-xt" in md
    assert "pasa bench --frames 5" in md and f"- torch: {torch.__version__}" in md
    assert NO_WEIGHTS in md
    assert "| fp16-naive |" in md and "2 (first 2)" in md
    assert "![psnr](psnr.png)" in md and "lpips.png" not in md

    for name in ("psnr", "ssim"):
        assert written[name].read_bytes()[:8] == PNG_SIGNATURE
        image = iio.imread(written[name])
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
        assert image.std() > 0


def test_report_with_lpips_plots_and_labels_random_backbone(tmp_path, random_scorer):
    written = write_report(build_report(random_scorer), tmp_path)
    assert written["lpips"] == tmp_path / "lpips.png"
    assert iio.imread(written["lpips"]).std() > 0
    md = written["markdown"].read_text()
    assert f"† {LPIPS_RANDOM_LABEL}" in md
    assert "LPIPS unavailable" not in md
    loaded = json.loads(written["json"].read_text())
    lpips = loaded["backends"]["fp16-pasa"]["scores"]["lpips"]
    assert lpips["label"] == LPIPS_RANDOM_LABEL and len(lpips["per_frame"]) == 5 and lpips["mean"] > 0


def test_table_cells():
    rows = {row[0]: row for row in table_rows(build_report(None))}
    pasa, naive, again = rows["fp16-pasa"], rows["fp16-naive"], rows["fp32-again"]
    assert all(len(row) == len(COLUMNS) for row in rows.values())
    assert pasa[3] == "n/a" and pasa[6] == "0" and pasa[7] == "12.5"
    assert float(pasa[1]) > 25.0 and 0.0 < float(pasa[2]) < 1.0
    assert naive[6] == "2 (first 2)" and naive[7] == "9.2"
    assert again[1].endswith("(+4 inf)") and again[4].endswith("(+2 inf)") and again[7] == "n/a"


def test_all_identical_psnr_cell():
    ref = make_video(frames=3)
    report = {"backends": {"same": {"scores": score_video(ref, ref.copy(), lpips_reason=NO_WEIGHTS)}}}
    assert table_rows(report)[0][1] == "inf (all 3)"


def test_format_table_with_rich_and_plain(monkeypatch):
    report = build_report(None)
    rich_text = format_table(report)
    for text in [*COLUMNS, "fp16-pasa", "fp16-naive", "2 (first 2)"]:
        assert text in rich_text
    assert "┃" in rich_text

    for module in ("rich", "rich.console", "rich.table"):
        monkeypatch.setitem(sys.modules, module, None)
    plain = format_table(report)
    assert "┃" not in plain
    lines = plain.splitlines()
    assert len(lines) == 2 + len(report["backends"])
    assert lines[0].split("  ")[0].strip() == "backend" and "non-finite frames" in lines[0]
    assert len({len(line) for line in lines}) == 1, "columns must be aligned"
    assert lines[3].startswith("fp16-naive")


def test_json_safe_converts_numpy_and_nonfinite_floats(tmp_path):
    converted = json_safe({"a": np.float32(np.inf), "b": [float("nan"), -np.inf], "c": np.arange(2), tmp_path: 1})
    assert converted == {"a": "inf", "b": [None, "-inf"], "c": [0, 1], str(tmp_path): 1}
    json.dumps(converted, allow_nan=False)


def test_write_report_rejects_missing_backends_or_scores(tmp_path):
    with pytest.raises(ValueError, match="backends"):
        write_report({"command": "x"}, tmp_path)
    with pytest.raises(ValueError, match="'fp16'"):
        write_report({"backends": {"fp16": {"seconds": 1.0}}}, tmp_path)
