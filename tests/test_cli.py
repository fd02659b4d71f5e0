"""The `pasa` command line end to end on the tiny models (small sizes: a few seconds each)."""
import json

import pytest

from pasa_diffusers.cli import main

SMALL = ["--frames", "2", "--steps", "2", "--height", "32", "--width", "32"]


def test_compare_rejects_unknown_backend(tmp_path):
    with pytest.raises(ValueError, match="unknown backend.*flash"):
        main(["compare", "--backends", "pasa,flash", "--out", str(tmp_path)])


def test_compare_writes_the_report(tmp_path, capsys):
    assert main(["compare", *SMALL, "--backends", "pasa,naive-half", "--model", "tiny-resonant",
                 "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["backends"]) == {"pasa", "naive-half"}
    assert report["backends"]["naive-half"]["scores"]["nonfinite"]["count"] == 2
    assert report["backends"]["pasa"]["scores"]["nonfinite"]["count"] == 0
    assert (tmp_path / "report.md").is_file() and (tmp_path / "psnr.png").is_file()
    assert "naive-half" in capsys.readouterr().out


def test_generate_writes_video_and_reports_nonfinite(tmp_path, capsys):
    assert main(["generate", *SMALL, "--model", "tiny-resonant", "--attention", "naive-half",
                 "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "NON-FINITE frames: 2" in printed and '"single key"' in printed
    assert (tmp_path / "naive-half.gif").is_file() and (tmp_path / "naive-half.mp4").is_file()


def test_diagnose_names_the_planted_layers(tmp_path):
    assert main(["diagnose", *SMALL, "--model", "tiny-resonant", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "diagnosis.json").read_text())
    assert result["model"] == "tiny-resonant"
    assert sum(layer["overflows"] for layer in result["layers"]) == 3
