"""The `pasa` command line end to end on the tiny models (small sizes: a few seconds each), and the shared
argument helpers of ``pasa_diffusers.cli.common``.  The error probes through the console script are in
``test_errors.py``; ``pasa compare`` has its own tests."""
import argparse
import json
import re

import pytest

from pasa_diffusers.cli import common, main

SMALL = ["--frames", "2", "--steps", "2", "--height", "32", "--width", "32"]


def test_generate_writes_video_and_reports_nonfinite(tmp_path, capsys):
    assert main(["generate", *SMALL, "--model", "tiny-resonant", "--attention", "naive-half",
                 "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "NON-FINITE frames: 2" in printed and '"single key"' in printed
    assert '"attention_dtype": "float16"' in printed  # an fp32 model: naive-half runs on fp16 casts, and says so
    assert (tmp_path / "naive-half.gif").is_file() and (tmp_path / "naive-half.mp4").is_file()


def test_generate_in_bf16_runs_pasa_in_bf16_not_by_fallback(tmp_path, capsys):
    """The issue's probe: in a bf16 model every "pasa" call used to fall back to SDPA in bf16."""
    assert main(["generate", *SMALL, "--dtype", "bf16", "--attention", "pasa", "--out", str(tmp_path)]) == 0
    printed = json.loads(capsys.readouterr().out.split("\nall frames finite")[0])
    assert printed["attention_dtype"] == "bfloat16"
    assert printed["fallbacks"] == {"single key": printed["calls"] // 2}  # the cross-attentions only


def test_diagnose_names_the_planted_layers(tmp_path):
    assert main(["diagnose", *SMALL, "--model", "tiny-resonant", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "diagnosis.json").read_text())
    assert result["model"] == "tiny-resonant"
    assert sum(layer["overflows"] for layer in result["layers"]) == 3


def test_a_usage_error_is_one_line_and_status_2(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["generate", "--out", str(tmp_path / "afile")]) == 2
    out, err = capsys.readouterr()
    afile = tmp_path / "afile"
    assert out == "" and err == f"pasa generate: error: --out {afile}: {afile} is a file, not a folder\n"


def test_names_mirror_the_library():
    """common keeps these names so the CLI checks them without importing torch."""
    from pasa_diffusers.install import BACKENDS
    from pasa_diffusers.pipelines.svd import BUILTIN_IMAGES

    assert set(common.BACKEND_NAMES) == set(BACKENDS)
    assert common.BUILTIN_IMAGES == BUILTIN_IMAGES


def test_ssim_min_size_is_the_metric_window_rounded_up_to_8():
    from pasa_diffusers.metrics.quality import SSIM_MIN_SIZE

    assert common.SCORED_MIN_SIZE == -(-SSIM_MIN_SIZE // common.SIZE_MULTIPLE) * common.SIZE_MULTIPLE == 16


@pytest.mark.parametrize("text, value", [("16", 16), ("64", 64)])
def test_int_range_accepts(text, value):
    assert common.int_range(16, 64, multiple_of=8)(text) == value


@pytest.mark.parametrize("text, message", [
    ("8", "must be a multiple of 8 in [16, 64] (why), got 8"),
    ("72", "must be a multiple of 8 in [16, 64] (why), got 72"),
    ("20", "must be a multiple of 8 in [16, 64] (why), got 20"),
    ("1.5", "expected an integer, got '1.5'"),
])
def test_int_range_refuses(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{re.escape(message)}$"):
        common.int_range(16, 64, multiple_of=8, why="why")(text)


@pytest.mark.parametrize("text", ["0", "-1", "inf", "nan", "x"])
def test_positive_float_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError, match="number > 0"):
        common.positive_float(text)


def test_check_out_dir_creates_the_folder(tmp_path):
    out = common.check_out_dir(tmp_path / "a" / "b")
    assert out.is_dir() and list(out.iterdir()) == []  # the probe file is gone
