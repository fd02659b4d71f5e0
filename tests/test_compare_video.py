"""`pasa compare` on a video transformer's pipeline, through the real console script: the built-in random
`tiny-wan`, whose samples are its fixed prompt embeddings x the seeds.  The records are those of an SVD run
(one per sample and backend), the report says what the model is and that its text encoder was replaced, a rerun
resumes from what is logged, and sizes are the model's own unless given (a size it would round is an error)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.console import PASA

from pasa_diffusers.pipelines import runlog
from pasa_diffusers.pipelines.names import TINY_VIDEO_SETTINGS
from pasa_diffusers.pipelines.video import NOTICE

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
BACKENDS = ("pasa", "bf16")
ARGS = ["compare", "--model", "tiny-wan", "--backends", ",".join(BACKENDS), "--seeds", "0-1", "--frames", "5",
        "--height", "32", "--width", "32", "--steps", "2"]


def pasa(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([PASA, *args], env=ENV, capture_output=True, text=True, timeout=300)


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("seconds", "rank")} for r in records]


def main_in_process(args: list[str]) -> tuple[int, str]:
    """``pasa ARGS`` in this process (torch imported once for the cheap cases); its status and stderr."""
    from pasa_diffusers.cli import main

    with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.redirect_stdout(io.StringIO()):
        status = main(args)
    return status, err.getvalue()


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A finished run: 1 prompt x 2 seeds x (pasa, bf16), 5 frames of 32x32, 2 steps; its folder and process."""
    out = tmp_path_factory.mktemp("video") / "run"
    done = pasa([*ARGS, "--out", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done


@pytest.mark.slow
def test_a_sample_is_a_prompt_and_a_seed_with_the_records_of_an_svd_run(finished):
    out, done = finished
    records = runlog.read_log(out / runlog.SAMPLES)
    assert [runlog.record_key(r) for r in records] == [("prompt:0", s, b) for s in (0, 1) for b in BACKENDS]
    assert [r["sample"] for r in records] == ["prompt0-seed0"] * 2 + ["prompt0-seed1"] * 2
    for record in records:
        assert set(record) == set(runlog.RECORD_FIELDS)
        assert record["frames"] == len(record["psnr_per_frame"]) == len(record["ssim_per_frame"]) == 5
        assert record["nonfinite_frames"] == 0 and isinstance(record["psnr"], float) and record["psnr"] > 20
        assert record["fallbacks"]["calls"] > 0 and record["fallbacks"]["fallback_calls"] == 0
    seeds = [r for r in records if r["backend"] == "pasa"]
    assert seeds[0]["psnr_per_frame"] != seeds[1]["psnr_per_frame"], "two seeds must give two different videos"
    run = json.loads((out / runlog.MANIFEST).read_text())["run"]
    assert run["prompts"] == ["prompt:0"] and "images" not in run and run["num_frames"] == 5
    assert done.stdout.startswith(NOTICE), "the output opens with what replaced the text encoder"


@pytest.mark.slow
def test_the_report_says_what_tiny_wan_is_and_what_replaced_its_text_encoder(finished):
    out, done = finished
    report = json.loads((out / "report.json").read_text())
    assert report["model"] == "tiny-wan" and report["samples"] == 2 and report["settings"]["prompts"] == ["prompt:0"]
    assert "random weights" in report["model_note"] and "noise by design" in report["model_note"]
    assert report["conditioning"].startswith(NOTICE)
    md = (out / "report.md").read_text()
    opening = md.split("## Scores", 1)[0]
    assert "on 2 samples = 1 prompt x 2 seeds. Each sample is one video generated from one prompt" in opening
    assert "`tiny-wan` is a tiny Wan 2.1 text-to-video pipeline" in opening and f"The prompt: {NOTICE}" in opening
    assert re.search(r"- (pasa|bf16) (is \d+\.\d\d dB \(95 % CI|and (pasa|bf16) cannot be told apart)", opening)
    assert "more seeds make them firm" in opening
    assert "| CPU time s |" in md and "Paired differences" in done.stdout
    for plot in ("distributions.png", "psnr_per_frame.png"):
        assert (out / plot).stat().st_size > 0
    gifs = sorted(p.name for p in (out / runlog.VIDEOS).iterdir())
    assert gifs == sorted(Path(w["video"]).name for entries in report["worst"].values() for w in entries)
    assert gifs and all(name.startswith("prompt0-seed") for name in gifs)


@pytest.mark.slow
def test_a_rerun_resumes_from_what_is_logged(finished, tmp_path):
    source, _ = finished
    out = tmp_path / "run"
    shutil.copytree(source, out)
    log = out / runlog.SAMPLES
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(lines[:-1]))  # the last result (seed 1, bf16) is to be computed again

    done = pasa([*ARGS, "--out", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming: 3 of 4 results already done" in done.stderr.splitlines()
    after = log.read_text().splitlines(keepends=True)
    assert after[:3] == lines[:3], "the records already logged are kept as they are"
    assert without_timing(runlog.read_log(log)) == without_timing(runlog.read_log(source / runlog.SAMPLES)), \
        "one thread: the recomputed video is bit for bit the first one"
    first, again = (json.loads((d / "report.json").read_text()) for d in (source, out))
    assert again["paired"] == first["paired"] and again["per_frame"] == first["per_frame"]


@pytest.mark.slow
def test_sizes_are_the_model_s_own_unless_given_and_a_size_it_would_round_is_an_error(finished, tmp_path):
    source, _ = finished
    status, err = main_in_process([*ARGS, "--seeds", "0-2", "--out", str(source)])
    assert status == 2 and err.count("\n") == 1
    assert re.search(r"error: --out .* holds another run \(seeds \[0, 1\] there, \[0, 1, 2\] now\)", err)

    refused = tmp_path / "refused"
    status, err = main_in_process([*ARGS, "--frames", "4", "--out", str(refused)])
    assert status == 2 and err == ("pasa compare: error: --frames 4: WanPipeline takes 4k + 1 frames (its VAE "
                                   "compresses time 4x), got 4\n")
    assert not refused.exists(), "nothing may be written before the settings are known to be usable"

    own = tmp_path / "own"
    status, err = main_in_process(["compare", "--model", "tiny-wan", "--backends", "bf16", "--seeds", "0",
                                   "--steps", "1", "--out", str(own)])
    assert status == 0, err[-3000:]
    run = json.loads((own / runlog.MANIFEST).read_text())["run"]
    assert {name: run[name] for name in ("num_frames", "height", "width")} == TINY_VIDEO_SETTINGS["tiny-wan"]


def test_a_wan_folder_needs_its_sizes_given_before_anything_is_loaded(tmp_path):
    folder = tmp_path / "wan"
    folder.mkdir()
    (folder / "model_index.json").write_text('{"_class_name": "WanPipeline"}')  # nothing to load: never loaded
    out = tmp_path / "run"
    status, err = main_in_process(["compare", "--model", str(folder), "--out", str(out)])
    assert status == 2 and err.count("\n") == 1
    assert err.startswith(f"pasa compare: error: --frames: not given; pass --frames, --height and --width for --model "
                          f"{folder} (in pasa compare only the built-in video models have sizes of their own: tiny-wan")
    assert not out.exists()
