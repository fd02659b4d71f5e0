"""The GPU scripts of ``scripts/`` on a machine without a GPU: one line saying so, exit status 2, nothing written.

They are run as ``scripts/README.md`` runs them (``PYTHONPATH=$PWD python scripts/<name>.py``), with
``CUDA_VISIBLE_DEVICES=""`` so that a GPU machine sees none either.  (Each was a torch CUDA traceback: the
driver's or "Found no NVIDIA driver", from its first tensor on ``cuda``.)
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE_SETTINGS = ("WHEELS", "TRITON_INTERPRET", "TESTS", "SHARDS", "SHARD_RANGE", "SUITE_SECONDS", "AT_ONCE")
"""What ``gpu_suite.sh`` (or pytest under it) reads from the environment: a test sets its own, none leaks in."""


def _suite_env(**settings: str) -> dict[str, str]:
    return {**{key: value for key, value in os.environ.items() if key not in SUITE_SETTINGS}, **settings}


@pytest.mark.parametrize("script, args, message", [
    ("ab_key_ranges.py", ["--out", "{out}"], "scripts/ab_key_ranges.py: needs a CUDA GPU (it times the default's "
                                             "launches against cuDNN); none on this machine (torch "),
    ("ab_bits.py", ["--save", "{out}/new.pt"], "scripts/ab_bits.py --save: needs a CUDA GPU (it runs every kernel "
                                               "path); none on this machine (torch "),
    ("host_parts.py", [], "scripts/host_parts.py: needs a CUDA GPU (it times the host's parts of a call while the GPU "
                          "sleeps); none on this machine (torch "),
], ids=["ab_key_ranges", "ab_bits", "host_parts"])
@pytest.mark.slow
def test_a_gpu_script_without_a_gpu_is_one_line(script, args, message, tmp_path):
    out = tmp_path / "out"
    env = {**{key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"},
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *(a.format(out=out) for a in args)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr[-3000:]
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(message), done.stderr[-3000:]
    assert not out.exists()


def _suite(tmp_path: Path, *pytest_args: str, path: str | None = None, **extra: str) -> subprocess.CompletedProcess:
    """``bash scripts/gpu_suite.sh`` from the checkout in one shard, this interpreter's folder first on PATH (as
    ``python`` after ``pip install -e .``), ``WHEELS`` unset; ``extra`` sets more variables (or other ``SHARDS``)."""
    env = _suite_env(**{"PATH": path or f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", "SHARDS": "1",
                        "OUT": str(tmp_path / "suite"), **extra})
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_suite.sh"), *pytest_args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("total_mib,shards", [("81559", 7), ("", 4)], ids=["h100", "no-gpu"])
def test_the_gpu_suite_takes_a_shard_per_ten_gib(tmp_path, total_mib, shards):
    """Without ``SHARDS``, one shard per 10 GiB of the GPU's memory (an ``nvidia-smi`` on PATH that prints an
    H100's total), at most one per CPU (``nproc``); 4 where ``nvidia-smi`` prints nothing."""
    if any((ROOT / ".whl").glob("*.whl")):
        pytest.skip("this checkout carries wheels in .whl/: the suite would install them")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(f"#!/bin/sh\necho {total_mib}\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = _suite_env(PATH=f"{fake}:{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
                     OUT=str(tmp_path / "suite"), TESTS="tests/test_lse.py")
    env.pop("OMP_NUM_THREADS", None)  # nproc reads it
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_suite.sh"), "-k", "test_gpu_ring_merge_of_the_default"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    expected = min(shards, len(os.sched_getaffinity(0))) if total_mib else shards
    assert done.stdout.splitlines()[0] == f"2 tests in {expected} shards"


@pytest.mark.slow
def test_the_gpu_suite_needs_no_wheel_folder(tmp_path):
    """docs/DEVELOPING.md: after ``pip install -e .``, ``bash scripts/gpu_suite.sh`` (it stopped asking for a
    ``.whl/`` folder the page never mentions).  Here the selected GPU tests skip (no CUDA); on a GPU they run.
    The only run here that collects all of tests/ (the others name one file in ``TESTS``)."""
    if any((ROOT / ".whl").glob("*.whl")):
        pytest.skip("this checkout carries wheels in .whl/: the suite would install them")
    done = _suite(tmp_path, "-k", "test_gpu_ring_merge_of_the_default")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == "2 tests in 1 shards"
    assert done.stdout.splitlines()[1].startswith("shard 0: ") and " in " in done.stdout.splitlines()[1]


def test_the_gpu_suite_says_what_it_lacks_in_one_line(tmp_path):
    """A ``WHEELS`` named that holds no wheels, or a package that does not import: one line, exit 2, no pytest."""
    done = _suite(tmp_path, WHEELS=str(tmp_path))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"{ROOT / 'scripts' / 'gpu_suite.sh'}: WHEELS={tmp_path} holds no wheels (*.whl); leave "
                           "WHEELS unset to use what is installed\n")
    bin_dir = tmp_path / "bin"  # a python whose import of the package fails, as before pip install -e .
    bin_dir.mkdir()
    (bin_dir / "python").write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'diffusers'\" >&2\nexit 1\n")
    (bin_dir / "python").chmod(0o755)
    if any((ROOT / ".whl").glob("*.whl")):
        pytest.skip("this checkout carries wheels in .whl/: the suite would install them")
    done = _suite(tmp_path, path=f"{bin_dir}:/usr/bin:/bin")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"{ROOT / 'scripts' / 'gpu_suite.sh'}: the package or what it needs does not import "
                           "(ModuleNotFoundError: No module named 'diffusers'): pip install -e . first "
                           "(docs/DEVELOPING.md), or put the wheels it lacks in .whl/ (scripts/README.md)\n")


def _three_shards(tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    """The suite over one gpu test's parametrisations of ``tests/test_int8.py`` in 3 shards (``extra``: more
    settings), which must exit 0; skipped where the checkout carries wheels (the suite would install them)."""
    if any((ROOT / ".whl").glob("*.whl")):
        pytest.skip("this checkout carries wheels in .whl/: the suite would install them")
    done = _suite(tmp_path, "-k", "test_gpu_gluon_kernel_matches_the_spec", SHARDS="3", TESTS="tests/test_int8.py",
                  **extra)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.slow
def test_the_gpu_suite_starts_each_shard_at_its_own_offset(tmp_path):
    """The shards split the ids round-robin, and shard i starts i/SHARDS of the way into its list, so that the
    shards do not run the same test's parametrisations at the same time: together they hold every id once."""
    done = _three_shards(tmp_path)
    ids = (tmp_path / "suite" / "test_ids.txt").read_text().splitlines()
    assert len(ids) >= 6
    for i in range(3):
        dealt = ids[(i - 1) % 3::3]  # the ids on lines i, i + 3, .. counted from 1
        start = len(dealt) * i // 3
        assert (tmp_path / "suite" / f"shard_{i}.txt").read_text().splitlines() == dealt[start:] + dealt[:start]


@pytest.mark.slow
def test_the_gpu_suite_runs_a_range_of_its_shards(tmp_path):
    """``SHARD_RANGE=FIRST-LAST`` runs those shards of the same split alone (a suite in two calls: the two halves
    hold every id once)."""
    done = _three_shards(tmp_path, SHARD_RANGE="1-2")
    assert done.stdout.splitlines()[0].endswith(" tests in 3 shards, running shards 1-2")
    suite = tmp_path / "suite"
    assert [path.name for path in sorted(suite.glob("shard_*.txt"))] == ["shard_1.txt", "shard_2.txt"]
    assert [line.split(":")[0] for line in done.stdout.splitlines()[1:3]] == ["shard 1", "shard 2"]


@pytest.mark.slow
def test_the_gpu_suite_runs_its_shards_a_few_at_once(tmp_path):
    """``AT_ONCE=1`` runs the split one shard at a time: every shard runs and says its summary, and each starts
    (its id list written) after the one before has ended (its log's last write)."""
    done = _three_shards(tmp_path, AT_ONCE="1")
    assert done.stdout.splitlines()[0].endswith(" tests in 3 shards, at most 1 at once")
    assert [line.split(":")[0] for line in done.stdout.splitlines()[1:4]] == ["shard 0", "shard 1", "shard 2"]
    suite = tmp_path / "suite"
    for i in (1, 2):
        assert (suite / f"shard_{i}.txt").stat().st_mtime_ns >= (suite / f"gpu_suite_{i - 1}.log").stat().st_mtime_ns


@pytest.mark.parametrize("extra,message", [
    ({"SHARDS": "3", "SHARD_RANGE": "2-3"}, "SHARD_RANGE=2-3 must be FIRST-LAST with 0 <= FIRST <= LAST < SHARDS=3"),
    ({"TESTS": "tests/test_int8.py tests/nope.py"},
     "TESTS names tests/nope.py, which is not a file or folder here (run from the repository root)"),
    ({"AT_ONCE": "0"}, "AT_ONCE=0 must be a whole number of shards, at least 1"),
], ids=["shard-range", "tests", "at-once"])
def test_the_gpu_suite_refuses_bad_settings_in_one_line_before_any_import(tmp_path, extra, message):
    """A shard range outside the shards, or a test path that is not there: one line naming the setting, exit 2,
    before the wheels or the package are looked at (a python that fails on start is never run)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text("#!/bin/sh\necho ran >&2\nexit 1\n")
    (bin_dir / "python").chmod(0o755)
    done = _suite(tmp_path, path=f"{bin_dir}:/usr/bin:/bin", **extra)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == [f"{ROOT / 'scripts' / 'gpu_suite.sh'}: {message}"]
