"""The memory a run needs against the memory there is (``pipelines/memory.py``, ``cli.common.check_memory``).

The refusal must never turn away a run that fits: the estimate is a lower bound.  Checked here where it can fail:
the growth of a real run's peak memory between two sizes is at least the estimate's growth (the tiny SVD, the
model of the issue's probes, in subprocesses so that each peak is its own).  The refusals themselves, through the
command line: ``tests/test_errors.py``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import pytest

from pasa_diffusers.cli import build_parser
from pasa_diffusers.cli.common import UsageError, check_memory, requested_sizes
from pasa_diffusers.pipelines import memory


def test_size_text():
    assert memory.size_text(512) == "512 B"
    assert memory.size_text(1152) == "1.12 KiB"
    assert memory.size_text(24 * 2**30) == "24 GiB"
    assert memory.size_text(3 * 2**50) == "3 PiB" and memory.size_text(2**60) == "1.02e+03 PiB"


def test_bytes_per_frame_pixel():
    assert memory.bytes_per_frame_pixel("tiny") == (1152, "half what tiny was measured to take")
    assert memory.bytes_per_frame_pixel("tiny", dtype_bytes=2)[0] == 576
    assert memory.bytes_per_frame_pixel("tiny-resonant", compare=True) == (
        1728, "half what tiny-resonant was measured to take in pasa compare")
    assert memory.bytes_per_frame_pixel("tiny-wan", compare=True) == (288, "half what tiny-wan was measured to take")
    assert memory.bytes_per_frame_pixel("org/name") == (24, "the decoded frames in float32, twice")
    assert memory.bytes_per_frame_pixel("tiny-ltx-video", dtype_bytes=2)[0] == 28  # 56 B in float32


def test_host_memory_reads_ram_and_swap_and_a_larger_cgroup_limit(monkeypatch):
    monkeypatch.setattr(memory, "_meminfo", lambda: {"MemTotal": 8 * 2**30, "SwapTotal": 2**30})
    monkeypatch.setattr(memory, "_read_int", lambda path: None)
    assert memory.host_memory() == (9 * 2**30, "this machine's RAM and swap")
    monkeypatch.setattr(memory, "_read_int", lambda path: 2**63 - 4096)  # cgroup v1's "no limit"
    assert memory.host_memory()[0] == 9 * 2**30
    monkeypatch.setattr(memory, "_read_int", lambda path: 256 * 2**30)  # memory that grows on demand (the VM)
    assert memory.host_memory() == (256 * 2**30, "this process's cgroup memory limit")
    assert memory.memory_there_is("cpu") == memory.host_memory()


def _args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def test_requested_sizes_before_the_model_is_loaded():
    assert requested_sizes(_args(["generate"])) == {"num_frames": 4, "height": 64, "width": 64}  # SVD's defaults
    assert requested_sizes(_args(["generate", "--model", "tiny-ltx-video"])) == {"num_frames": 17, "height": 128,
                                                                                  "width": 128}
    assert requested_sizes(_args(["diagnose", "--frames", "9"])) == {"num_frames": 9, "height": 64, "width": 64}
    # a loaded model's own size is not known yet: the smallest accepted, a lower bound
    assert requested_sizes(_args(["generate", "--model", "org/name", "--width", "640"])) == {
        "num_frames": 2, "height": 8, "width": 640}


def test_check_memory_refuses_only_what_exceeds_the_memory(monkeypatch):
    sizes = {"num_frames": 1000, "height": 64, "width": 64}  # 4.1 M frame pixels x 1152 B = 4.4 GiB
    args = _args(["generate", "--frames", "1000"])
    monkeypatch.setattr(memory, "host_memory", lambda: (5 * 2**30, "this machine's RAM and swap"))
    check_memory(args, sizes)
    monkeypatch.setattr(memory, "host_memory", lambda: (4 * 2**30, "this machine's RAM and swap"))
    with pytest.raises(UsageError, match=r"^--frames 1000 --height 64 --width 64: a video this size needs at least "
                                         r"4.39 GiB of memory \(1.12 KiB a frame pixel: half what tiny was measured "
                                         r"to take\), more than the 4 GiB of this machine's RAM and swap; choose "
                                         r"fewer frames or a smaller size$"):
        check_memory(args, sizes)
    check_memory(_args(["generate", "--frames", "1000", "--dtype", "fp16"]), sizes)  # half as much in 16 bits


def _peak_mib(frames: int) -> float:
    """Peak resident memory of ``pasa generate --model tiny`` at ``frames`` frames of 64 x 64, one step, MiB.

    The child's own high-water mark (``VmHWM``, which starts afresh with the new program), not ``ru_maxrss``: that
    survives ``exec`` and so starts at the parent's size, the whole test session's (1314 MiB on CI, both peaks)."""
    code = ("import re, sys; from pasa_diffusers.cli import main; "
            f"status = main(['generate', '--model', 'tiny', '--steps', '1', '--frames', '{frames}', '--formats', "
            "'gif', '--out', sys.argv[1]]); "
            "print(status, int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())[1]) / 1024)")
    env = {**{key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([sys.executable, "-c", code, out], capture_output=True, text=True, timeout=600, env=env)
    status, peak = done.stdout.splitlines()[-1].split()
    assert status == "0", done.stderr[-2000:]
    return float(peak)


@pytest.mark.slow
def test_the_estimate_is_below_what_a_run_takes():
    """The peak of a tiny-SVD run grows by more than the estimate between 4 and 32 frames of 64 x 64 (measured
    2.3 KiB a frame pixel against the estimate's 1.12 KiB, 2026-12-04): the refusal is a lower bound, not a guess
    above."""
    per_pixel, _ = memory.bytes_per_frame_pixel("tiny")
    small, large = _peak_mib(4), _peak_mib(32)
    assert (large - small) * 2**20 >= per_pixel * (32 - 4) * 64 * 64, f"peaks {small:.0f} and {large:.0f} MiB"
