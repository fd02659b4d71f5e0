"""`pasa compare` through the real console script, where a run can go wrong: a damaged line of samples.jsonl,
two runs into one folder, Ctrl-C and its resume, inputs that cannot be used (nothing written), and a report that
says what it compared.  Each message is one line naming the file or flag; docs/ERRORS.md lists them."""
from __future__ import annotations

import contextlib
import io
import os
import re
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.console import PASA, default_sigint

from pasa_diffusers.pipelines import runlog

TINY = ["compare", "--model", "tiny", "--height", "16", "--width", "16", "--frames", "2", "--steps", "1",
        "--images", "builtin:rocket"]
REPORT = ("report.json", "report.md", "distributions.png", "psnr_per_frame.png")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def pasa(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([PASA, *args], env=ENV, capture_output=True, text=True, timeout=300)


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([PASA, *args], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=default_sigint)


def logged(out: Path) -> int:
    """Complete lines in samples.jsonl."""
    path = out / runlog.SAMPLES
    return path.read_bytes().count(b"\n") if path.is_file() else 0


def one_error_line(done: subprocess.CompletedProcess) -> str:
    """Exit 2 and exactly one line on stderr, no traceback; that line."""
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pasa compare: error: "), done.stderr
    return lines[0]


def snapshot(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def broken_model(folder: Path) -> Path:
    """A pipeline folder whose model_index.json names a component it lacks."""
    folder.mkdir()
    (folder / "model_index.json").write_text('{"_class_name": "StableVideoDiffusionPipeline", '
                                             '"unet": ["diffusers", "UNetSpatioTemporalConditionModel"]}')
    return folder


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, list[str], str]:
    """A finished run (1 image x 2 seeds x pasa, bf16: 4 results), its arguments, and what its first attempt,
    with a model that cannot be loaded, printed (run in this process, where torch is imported: fast)."""
    from pasa_diffusers.cli import main

    root = tmp_path_factory.mktemp("finished")
    out = root / "run"
    args = [*TINY, "--seeds", "0-1", "--backends", "pasa,bf16", "--out", str(out)]
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert main([*args, "--model", str(broken_model(root / "broken"))]) == 2
    assert not out.exists(), "nothing may be written before the model is loaded"
    done = pasa(args)  # the retry with a model that loads, into the same --out
    assert done.returncode == 0, done.stderr[-2000:]
    return out, args, err.getvalue()


@pytest.mark.slow
def test_a_model_that_cannot_be_loaded_writes_nothing(finished):
    out, _, first_attempt = finished
    assert first_attempt.count("\n") == 1 and first_attempt.startswith(
        f"pasa compare: error: --model {out.parent / 'broken'}: folder model='{out.parent / 'broken'}' lacks the "
        "component folder(s) ['unet']")
    assert logged(out) == 4, "the retry into the same --out was not refused as another run"


@pytest.mark.slow
def test_the_report_says_what_was_compared_on_what_model(finished):
    out, _, _ = finished
    md = (out / "report.md").read_text()
    opening = md.split("## Scores", 1)[0]
    assert "Compared: the attention backends pasa and bf16, each against FP32 attention" in opening
    assert "`tiny` is a tiny SVD with random weights" in opening and "noise by design" in opening
    assert re.search(r"- (pasa|bf16) is \d+\.\d\d dB \(95 % CI \d+\.\d\d to \d+\.\d\d\) closer to FP32 than", opening)
    assert "| CPU time s |" in md and "CPU times say nothing about GPU speed" in md


@pytest.mark.slow
def test_a_damaged_line_stops_the_run_and_keeps_the_report(finished, tmp_path, capsys):
    from pasa_diffusers.cli import main

    source, args, _ = finished
    out = tmp_path / "run"
    shutil.copytree(source, out)
    args = [*args[:-1], str(out)]
    log = out / runlog.SAMPLES
    lines = log.read_text().splitlines(keepends=True)
    before = snapshot(out)

    log.write_text("".join(lines[:-1]) + lines[-1][:40] + "\n")  # the last line cut short, saved by an editor
    line = one_error_line(pasa(args))
    assert line.startswith(f"pasa compare: error: {log}, line 4: damaged (not a JSON record: ")
    assert line.endswith("; delete that line (its result is computed again when you rerun the command) or start "
                         "over with a new --out")
    log.write_text(lines[0] + '{"image": "builtin:rocket", "seed": 0, "backend": "bf16", "psnr": 1.5}\n'
                   + "".join(lines[2:]))  # a middle line edited
    assert main(args) == 2  # in this process, to keep the suite fast (torch on one thread, as in ENV: the same run)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: {log}, line 2: damaged (a record without sample, ssim, " in err
    after = snapshot(out)
    assert {name: after[name] for name in REPORT} == {name: before[name] for name in REPORT}, \
        "the finished run's report must stay until a new one replaces it"
    assert sorted(after) == sorted(before), "no temporary file may be left"

    log.write_text(lines[0] + "".join(lines[2:]))  # the repair the message asks for
    done = pasa(args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming: 3 of 4 results already done" in done.stderr.splitlines()
    assert logged(out) == 4 and (out / "report.json").read_bytes() != before["report.json"]


@pytest.mark.slow
def test_one_run_per_folder_then_ctrl_c_says_how_to_resume(tmp_path):
    out = tmp_path / "run"
    args = [*TINY, "--seeds", "0-9", "--backends", "pasa,bf16", "--out", str(out)]
    first = start(args)
    deadline = time.monotonic() + 120
    while not logged(out) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    first.send_signal(signal.SIGSTOP)  # holds its lock, computes nothing while the second run tries
    try:
        assert first.poll() is None, "the first run ended before a second one could try"
        second = pasa(args)
    finally:
        first.send_signal(signal.SIGINT)  # delivered when it continues
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=120)
    assert one_error_line(second) == (f"pasa compare: error: --out {out}: another pasa compare is running into this "
                                      f"folder (pid and host {first.pid} {os.uname().nodename}); wait for it to end, "
                                      "or choose another --out")

    done = logged(out)
    assert first.returncode == 130 and "Traceback" not in err, err
    assert err.splitlines()[-1] == (f"pasa compare: interrupted after {done} of 20 results; rerun the same command "
                                    "to resume")
    assert 1 <= done < 20 and not (out / "report.json").exists()

    before = (out / runlog.SAMPLES).read_text()
    resumed = pasa(args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    err_lines = resumed.stderr.splitlines()
    assert err_lines[0] == f"resuming: {done} of 20 results already done"
    bars = [line for line in err_lines if line.startswith("compare:")]
    assert f" {done}/20 " in bars[0] and " 20/20 " in bars[-1], "the bar counts results from those already done"
    records = runlog.read_log(out / runlog.SAMPLES)
    assert len({runlog.record_key(r) for r in records}) == len(records) == 20
    assert (out / runlog.SAMPLES).read_text().startswith(before), "the interrupted run's records are kept as they are"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a CUDA machine may have the GPU")
def test_cuda_without_a_gpu_creates_no_folder(tmp_path):
    out = tmp_path / "run"
    line = one_error_line(pasa([*TINY, "--device", "cuda", "--out", str(out)]))
    assert line.startswith("pasa compare: error: --device cuda: CUDA is not available on this machine")
    assert not out.exists()


def _file_size_limit(limit: int):
    def set_limit() -> None:  # in the child: every file it writes stops at limit bytes (EFBIG: Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return set_limit


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_keeps_the_record_without_a_truncated_gif(tmp_path):
    """Files stop at 2000 bytes: the manifest (about 1 kB) and the record (0.5 kB) fit, the side-by-side GIF (2.6 kB)
    does not. One line, no traceback; the record is on disk (it is written before its GIF), and no GIF, whole or
    cut, is left (it is written to a temporary name, then renamed). Was: an OSError traceback, a truncated GIF."""
    out = tmp_path / "run"
    done = subprocess.run([PASA, *TINY, "--seeds", "0", "--backends", "bf16", "--worst", "1", "--out", str(out)],
                          env=ENV, capture_output=True, text=True, timeout=300, preexec_fn=_file_size_limit(2000))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (
        f"pasa compare: error: --out {out}: cannot write (File too large), with 1 of 1 result on disk: free space (or "
        "fix the folder) and rerun the same command to resume")
    assert [r["backend"] for r in runlog.read_log(out / runlog.SAMPLES)] == ["bf16"]
    assert not [p for p in out.rglob("*") if p.suffix == ".gif" or ".tmp-" in p.name]
