"""`pasa compare` over images and seeds on the tiny model: resume after a kill, refusal of a mixed folder, a
backend that always fell back, a 2-process gloo torchrun equal to one process, and the committed sample."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.console import PASA
import torch

from pasa_diffusers import metrics, processors
from pasa_diffusers.cli import build_parser, main
from pasa_diffusers.metrics.records import dumps
from pasa_diffusers.pipelines import compare, runlog
from pasa_diffusers.pipelines.samples import make_samples

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--model", "tiny", "--height", "16", "--width", "16", "--frames", "2", "--steps", "1",
         "--images", "builtin:rocket,builtin:coffee", "--backends", "pasa,bf16"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SAMPLE_DIR = ROOT / "samples" / "compare"


def pasa_script() -> str:
    """The `pasa` console script of this interpreter's environment."""
    found = PASA
    assert Path(found).is_file(), "the pasa console script is not installed (pip install -e .)"
    return found


def log_lines(out: Path) -> list[dict]:
    return runlog.read_log(out / runlog.SAMPLES)


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("seconds", "rank")} for r in records]


def assert_worst_videos(out: Path, per_backend: int) -> None:
    """The report lists per_backend worst samples per backend, each with its GIF, and no other GIF is left."""
    report = json.loads((out / "report.json").read_text())
    listed = [w["video"] for entries in report["worst"].values() for w in entries]
    assert all(listed) and len(listed) == per_backend * len(report["worst"])
    assert sorted(p.name for p in (out / runlog.VIDEOS).iterdir()) == sorted(Path(v).name for v in listed)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """A complete single-process run: 2 images x 2 seeds x (pasa, bf16)."""
    out = tmp_path_factory.mktemp("one") / "run"
    assert main(["compare", *SMALL, "--seeds", "0-1", "--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_a_run_logs_every_record_and_writes_the_report(one_process):
    records = log_lines(one_process)
    images = ("builtin:rocket", "builtin:coffee")
    assert [runlog.record_key(r) for r in records] == [(i, s, b) for i in images for s in (0, 1) for b in ("pasa", "bf16")]
    report = json.loads((one_process / "report.json").read_text())
    assert report["aggregate"]["pasa"]["psnr"]["n"] == 4 and len(report["aggregate"]["pasa"]["psnr"]["ci95"]) == 2
    assert report["health"]["pasa"]["fallbacks"]["share"] > 0 and "pasa \u2212 bf16" in \
        (one_process / "report.md").read_text()
    assert_worst_videos(one_process, 2)
    assert not (one_process / runlog.SHARDS).exists()


KILLED_AFTER_A_RECORD = """
import os, signal, sys
from pasa_diffusers.cli import main
from pasa_diffusers.pipelines import runlog

KILL_AT = int(sys.argv[1])
append, appended = runlog.LogWriter.append, []


def append_then_die(self, record):
    append(self, record)  # the record is in samples.jsonl, flushed and fsynced ...
    appended.append(record)
    if len(appended) == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)  # ... and the run dies before anything else: its GIF is never written


runlog.LogWriter.append = append_then_die
sys.exit(main(sys.argv[2:]))
"""
"""A ``pasa compare`` killed (SIGKILL) right after its ``KILL_AT``-th record lands in ``samples.jsonl``: a defined
point, not a moment guessed after a sleep."""


@pytest.mark.slow
def test_resume_after_a_kill_loses_nothing_duplicates_nothing_and_rebuilds_the_gif(tmp_path):
    """Killed right after a record lands, before its side-by-side GIF is written; the resume lists that sample among
    the worst with its GIF, the one an uninterrupted run makes (was: an empty video in the report, no GIF)."""
    out = tmp_path / "run"
    argv = ["compare", *SMALL, "--seeds", "0-1", "--worst", "4", "--out", str(out)]  # every sample is listed
    killed = subprocess.run([sys.executable, "-c", KILLED_AFTER_A_RECORD, "3", *argv], env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    before = log_lines(out)
    assert len(before) == 3 and not (out / "report.json").exists()
    third = before[-1]
    assert not (out / compare._video_name(third)).exists(), "the kill came after the third record's GIF"
    with open(out / runlog.SAMPLES, "a") as f:
        f.write('{"image": "builtin:coffee", "seed": 1, "backe')  # as if killed while writing a line

    assert main(argv) == 0
    after = log_lines(out)
    keys = [runlog.record_key(r) for r in after]
    assert len(keys) == len(set(keys)) == 8
    assert all(r in after for r in before), "a record of the killed run was lost or recomputed"
    assert json.loads((out / "report.json").read_text())["samples"] == 4
    assert_worst_videos(out, 4)
    assert f"({compare._video_name(third)})" in (out / "report.md").read_text()

    # the rebuilt GIF is the one the uninterrupted run writes: the same sample generated again
    _, videos = compare.run_comparison(model="tiny", backends=[third["backend"]], image=third["image"],
                                       seed=third["seed"], num_frames=2, num_inference_steps=1, height=16, width=16,
                                       progress=False)
    expected = metrics.write_gif(metrics.side_by_side(videos["fp32"], videos[third["backend"]]), tmp_path / "x.gif")
    assert (out / compare._video_name(third)).read_bytes() == expected.read_bytes()


def test_a_finished_run_resumes_without_generating(one_process, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(one_process, out)
    before = (out / runlog.SAMPLES).read_bytes()

    def no_model(device, dtype):
        raise AssertionError("nothing is left to generate: the pipeline must not be loaded")

    config = compare.CompareConfig(model="tiny", images=("builtin:rocket", "builtin:coffee"), seeds=(0, 1),
                                   backends=("pasa", "bf16"), num_frames=2, num_inference_steps=1, height=16, width=16)
    report = compare.evaluate(config, out, load_pipeline=no_model, progress=False)
    assert (out / runlog.SAMPLES).read_bytes() == before
    first = json.loads((one_process / "report.json").read_text())
    assert json.loads(dumps(report)) == first | {"command": ""}


def test_a_finished_run_whose_worst_gif_is_gone_loads_the_model_and_rebuilds_it(one_process, tmp_path):
    """Every record done, one listed GIF missing: the resume loads the pipeline only to make that GIF again, byte for
    byte the one the run wrote, and generates no record."""
    out = tmp_path / "copy"
    shutil.copytree(one_process, out)
    before = (out / runlog.SAMPLES).read_bytes()
    listed = json.loads((out / "report.json").read_text())["worst"]["bf16"][0]["video"]
    original = (out / listed).read_bytes()
    (out / listed).unlink()
    loads = []

    def tiny(device, dtype):
        loads.append(device)
        return compare.svd.load_svd("tiny", device=device, dtype=dtype)

    config = compare.CompareConfig(model="tiny", images=("builtin:rocket", "builtin:coffee"), seeds=(0, 1),
                                   backends=("pasa", "bf16"), num_frames=2, num_inference_steps=1, height=16, width=16)
    report = compare.evaluate(config, out, load_pipeline=tiny, progress=False)
    assert loads == ["cpu"] and (out / runlog.SAMPLES).read_bytes() == before
    assert report["worst"]["bf16"][0]["video"] == listed and (out / listed).read_bytes() == original
    assert_worst_videos(out, 2)


def test_a_different_run_into_the_same_folder_is_refused(one_process, capsys):
    before = (one_process / runlog.SAMPLES).read_bytes()
    assert main(["compare", *SMALL, "--seeds", "0-2", "--out", str(one_process)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"pasa compare: error: --out .* holds another run \(seeds \[0, 1\] there, \[0, 1, 2\] now\)", err)
    assert (one_process / runlog.SAMPLES).read_bytes() == before and (one_process / "report.json").exists()


def test_a_backend_whose_calls_all_fell_back_is_an_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(processors.BF16AttnProcessor, "fallback_reason", lambda self, q, k, mask: "dtype")
    assert main(["compare", *SMALL, "--seeds", "0", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"error: --backends: backend bf16: all \d+ attention calls fell back \(dtype", err)
    assert [r["backend"] for r in log_lines(tmp_path / "run")] == ["pasa"], "no bf16 row may be written"


@pytest.mark.slow
def test_two_gloo_processes_equal_one(one_process, tmp_path):
    out = tmp_path / "two"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
               pasa_script(), "compare", *SMALL, "--seeds", "0-1", "--out", str(out)]
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    merged = log_lines(out)
    assert {r["rank"] for r in merged} == {0, 1}, "both ranks must have generated samples"
    assert without_timing(merged) == without_timing(log_lines(one_process))
    two, one = (json.loads((d / "report.json").read_text()) for d in (out, one_process))
    for key in ("aggregate", "paired", "per_frame"):
        drop = (lambda d: {b: {m: v for m, v in per.items() if m != "seconds"} for b, per in d.items()}) \
            if key == "aggregate" else (lambda d: d)
        assert drop(two[key]) == drop(one[key])
    assert two["settings"]["processes"] == 2 and not (out / runlog.SHARDS).exists()
    assert two["worst"] == one["worst"]
    assert_worst_videos(out, 2)
    assert "Scores against the fp32 reference" in done.stdout and done.stdout.count("Paired differences") == 1


def test_a_torchrun_run_resumes_in_one_process_on_one_thread_as_the_docs_say(one_process, tmp_path, capsys):
    """docs/METRICS.md: a torchrun run (one CPU thread per process) resumes with one process; the thread count sets
    the last bits of every video, so that process runs one thread too (OMP_NUM_THREADS=1), and with two the
    refusal names that recipe (was: "cpu_threads 1 there, 2 now" and advice to delete the folder)."""
    out = tmp_path / "torchrun"
    shutil.copytree(one_process, out)
    assert json.loads((out / runlog.MANIFEST).read_text())["run"]["cpu_threads"] == 1  # as each torchrun process
    before = (out / runlog.SAMPLES).read_bytes()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["compare", *SMALL, "--seeds", "0-1", "--out", str(out)]) == 2
    finally:
        torch.set_num_threads(threads)
    assert re.fullmatch(r"pasa compare: error: --out .* holds another run \(cpu_threads 1 there, 2 now\); a resume "
                        r"needs the same settings; torch's CPU thread count sets the last bits of every video: resume "
                        r"it with OMP_NUM_THREADS=1 before the same command \(each torchrun process runs one thread\); "
                        r"or choose another --out, or delete the folder to start over\n", capsys.readouterr().err)
    assert threads == 1  # conftest: the suite runs one thread, as OMP_NUM_THREADS=1 sets it
    assert main(["compare", *SMALL, "--seeds", "0-1", "--out", str(out)]) == 0
    assert "resuming: 8 of 8 results already done" in capsys.readouterr().err
    assert (out / runlog.SAMPLES).read_bytes() == before


def _table(markdown: str) -> tuple[list[str], list[list[str]]]:
    """A markdown table's header cells and its rows' cells (the rule line left out)."""
    header, _, *rows = ([cell.strip() for cell in line.strip().strip("|").split("|")]
                        for line in markdown.strip().splitlines())
    return header, rows


def test_the_committed_sample_is_the_default_run_and_the_readme_shows_its_table():
    report = json.loads((SAMPLE_DIR / "report.json").read_text())
    defaults = build_parser().parse_args(["compare"])
    settings = report["settings"]
    assert report["model"] == defaults.model and settings["seeds"] == defaults.seeds
    assert settings["images"] == defaults.images and settings["backends"] == defaults.backends
    assert (settings["num_frames"], settings["num_inference_steps"], settings["height"], settings["width"]) == \
        (defaults.frames, defaults.steps, defaults.height, defaults.width)
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## `pasa compare`", 1)[1].split("\n## ", 1)[0]
    tables = [_table(t) for t in re.findall(r"(?:^\|.*\|\n)+", section, flags=re.M)]
    assert len(tables) == 1, "the README's pasa compare section shows one table of the sample"
    (header, rows), = tables
    report_header, report_rows = _table(re.search(r"(?:^\| backend \| PSNR dB .*\|\n)(?:^\|.*\|\n)+",
                                                  (SAMPLE_DIR / "report.md").read_text(), flags=re.M).group(0))
    columns = [max((i for i, name in enumerate(report_header) if shown.startswith(name)),
                   key=lambda i: len(report_header[i])) for shown in header]  # "PSNR dB vs FP32 [...]": "PSNR dB"
    assert [row[0] for row in rows] == [row[0] for row in report_rows] == settings["backends"]
    for row, report_row in zip(rows, report_rows):
        assert row == [report_row[i] for i in columns], f"README row differs from {SAMPLE_DIR / 'report.md'}"
    size = sum(p.stat().st_size for p in SAMPLE_DIR.rglob("*") if p.is_file())
    assert size < 500_000, f"samples/compare holds {size} bytes: keep it small"


def test_the_committed_sample_report_is_built_from_its_records_and_the_docs_quote_it():
    """report.json and report.md are what the code makes of samples.jsonl, and the sentences README.md and
    docs/METRICS.md quote from the report are in it (was: the README's numbers of an earlier run)."""
    report = json.loads((SAMPLE_DIR / "report.json").read_text())
    logged = runlog.read_log(SAMPLE_DIR / runlog.SAMPLES)
    meta = {key: report[key] for key in ("command", "versions", "model", "model_note", "settings", "lpips")}
    built = metrics.build_report(
        logged, backends=report["settings"]["backends"], meta=meta, worst=compare.CompareConfig.worst,
        video=lambda r: compare._video_name(r) if (SAMPLE_DIR / compare._video_name(r)).is_file() else "")
    assert json.loads(dumps(built)) == report
    assert metrics.format_markdown(report, ["distributions.png", "psnr_per_frame.png"]) == \
        (SAMPLE_DIR / "report.md").read_text()
    assert_worst_videos(SAMPLE_DIR, compare.CompareConfig.worst)
    assert report["settings"]["cpu_threads"] == 1, "made on one thread (OMP_NUM_THREADS=1): bit for bit reproducible"
    gain = report["paired"]["pasa - bf16"]["psnr"]
    readme = (ROOT / "README.md").read_text()
    assert f"the default is {gain['mean']:.1f} dB closer to FP32 than BF16 attention" in readme
    assert "`OMP_NUM_THREADS=1 pasa compare --out samples/compare`" in readme and \
        report["command"] == "pasa compare --out samples/compare"
    metrics_doc = (ROOT / "docs/METRICS.md").read_text()
    sentence = re.search(r"`(pasa is [\d.]+ dB \(95 % CI .*? over 6 samples\.)`", metrics_doc)
    assert sentence and f"- {sentence.group(1)}\n" in (SAMPLE_DIR / "report.md").read_text()


@pytest.mark.slow
def test_a_committed_sample_is_what_the_code_generates_now():
    """The first sample of samples/compare (astronaut, seed 0; every backend, 5 videos: about 8 s), generated again
    on one thread as the sample was, gives its records bit for bit. The whole run (6 samples) takes a minute; the
    other samples' records feed the report the test above checks. A change that moves the numbers fails here:
    regenerate the sample with the README's command, in the same commit."""
    report = json.loads((SAMPLE_DIR / "report.json").read_text())
    settings = report["settings"]
    assert torch.get_num_threads() == settings["cpu_threads"] == 1
    committed = {runlog.record_key(r): r for r in runlog.read_log(SAMPLE_DIR / runlog.SAMPLES)}
    sample = make_samples(settings["images"], settings["seeds"])[0]
    pipe = compare.svd.load_svd(report["model"], device="cpu", dtype=torch.float32)
    sizes = {name: settings[name] for name in ("num_frames", "num_inference_steps", "height", "width")}
    runs = compare.compare_sample(pipe, compare.load_image(sample.image, (settings["width"], settings["height"])),
                                  seed=sample.seed, backends=settings["backends"], **sizes)
    reference = next(runs)
    for run in runs:
        scores = metrics.score_video(reference.frames, run.frames, lpips_scorer=None, lpips_reason=report["lpips"])
        record = json.loads(dumps(compare.sample_record(sample, run, scores)))
        assert without_timing([record]) == without_timing([committed[runlog.record_key(record)]]), \
            f"{sample.label} {run.backend}: samples/compare is not what the code makes now"


def test_gif_previews_shrink_wide_frames_by_block_means():
    frames = np.random.default_rng(0).random((2, 576, 1030, 3), dtype=np.float32)
    frames[1, 4, 5, 2] = np.nan
    small = compare._preview(frames)
    assert small.shape == (2, 192, 343, 3), "factor ceil(1030 / 512) = 3, the 1 px left over cropped"
    np.testing.assert_allclose(small[0, 10, 20], frames[0, 30:33, 60:63].mean(axis=(0, 1)), rtol=1e-6)
    assert np.isnan(small[1, 1, 1, 2]) and np.isnan(small).sum() == 1
    assert compare._preview(frames[:, :, :512]).shape == (2, 576, 512, 3)
