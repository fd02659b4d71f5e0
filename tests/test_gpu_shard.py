"""scripts/gpu_shard.py and the conftest hooks behind it: a test that loses the CUDA context is one failure, and
the tests after it rerun in a new process (simulated here: no GPU on CI)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]

LOSING_CONFTEST = '''
import os
from tests.conftest import LOST_CONTEXT, pytest_runtest_logreport  # noqa: F401  (the hook under test)

def pytest_runtest_teardown(item, nextitem):
    flag = os.path.join(os.path.dirname(__file__), "lost_once")
    if item.name == "test_b" and not os.path.exists(flag):
        open(flag, "w").close()
        item.session.shouldstop = f"{LOST_CONTEXT} after {item.nodeid}: an illegal memory access was encountered"
'''

TESTS = '''
def test_a(): pass
def test_b(): pass
def test_c(): assert False
def test_d(): pass
'''


def _simulated_shard(tmp_path: Path, conftest_text: str, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    """``scripts/gpu_shard.py`` over :data:`TESTS` (ids ``test_a`` .. ``test_d``) in ``tmp_path`` with
    ``conftest_text`` as its conftest and ``env`` added: the finished process and the shard's log."""
    (tmp_path / "conftest.py").write_text(conftest_text)
    (tmp_path / "test_sim.py").write_text(TESTS)
    ids = tmp_path / "ids.txt"
    ids.write_text("".join(f"test_sim.py::test_{name}\n" for name in "abcd"))
    log = tmp_path / "shard.log"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_shard.py"), str(ids), str(log),
                             "--rootdir", str(tmp_path), "-p", "no:randomly"], cwd=tmp_path, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **env}, capture_output=True)
    return result, log.read_text()


@pytest.mark.slow
def test_shard_reruns_the_tests_left_after_a_lost_context(tmp_path):
    result, text = _simulated_shard(tmp_path, LOSING_CONFTEST)
    last = text.strip().splitlines()[-1]
    assert result.returncode == 1, (result.stdout, result.stderr, text)
    assert last.startswith("1 failed, 3 passed in ") and last.endswith("(1 restarts after a lost CUDA context)"), text
    assert text.count("test_sim.py::test_c FAILED") == 1 and text.count("test_sim.py::test_a PASSED") == 1
    assert text.count("slowest 15 durations") == 2  # one list per run: where a shard's time went


def test_teardown_stops_the_session_when_the_probe_fails(monkeypatch):
    monkeypatch.setattr(conftest.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(conftest, "_cuda_lost", lambda: "CUDA error: an illegal memory access was encountered")
    session = SimpleNamespace(shouldstop=False)
    item = SimpleNamespace(keywords={"gpu": True}, session=session, nodeid="tests/x.py::test_kernel")
    conftest.pytest_runtest_teardown(item, None)
    assert session.shouldstop.startswith(f"{conftest.LOST_CONTEXT} after tests/x.py::test_kernel: CUDA error")
    cpu_item = SimpleNamespace(keywords={}, session=SimpleNamespace(shouldstop=False), nodeid="tests/x.py::test_cpu")
    conftest.pytest_runtest_teardown(cpu_item, None)
    assert cpu_item.session.shouldstop is False


@pytest.mark.parametrize("args", [[], ["--help"]])
def test_shard_usage(args, capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_shard
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert gpu_shard.main(args) == (0 if args else 2)
    assert "python scripts/gpu_shard.py IDS_FILE LOG" in capsys.readouterr().out


SHARD_LOG = '''test_sim.py::test_a PASSED
FAILED test_sim.py::test_{memory} - torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 6.33 GiB.
{other}
{counts} in 3s (0 restarts after a lost CUDA context)
'''


@pytest.mark.slow
@pytest.mark.parametrize("memory, other, counts, status", [
    ("b", "", "1 failed, 1 passed", 0),
    ("c", "", "1 failed, 1 passed", 1),
    ("b", "FAILED test_sim.py::test_d - AssertionError: assert 0.3 <= 0.01", "2 failed", 1),
    ("b", "", "2 failed, 1 passed", 1),
], ids=["memory-alone", "memory-fails-again", "another-failure", "a-failure-without-its-line"])
def test_memory_retry_reruns_only_what_ran_out_of_memory(tmp_path, memory, other, counts, status):
    """``scripts/gpu_memory_retry.py``: the tests that ran out of memory beside the other shards rerun alone (the
    suite passes if they pass and nothing else failed); an assertion's failure stands and is not rerun, and a shard
    counting more failures than its summary lines name fails the suite."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_runtest_logreport  # noqa: F401\n")
    (tmp_path / "test_sim.py").write_text(TESTS)
    out = tmp_path / "suite"
    out.mkdir()
    (out / "gpu_suite_0.log").write_text(SHARD_LOG.format(memory=memory, other=other, counts=counts))
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_memory_retry.py"), str(out),
                             "--rootdir", str(tmp_path), "-p", "no:randomly"], cwd=tmp_path, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True)
    assert result.returncode == status, (result.stdout, result.stderr)
    rerun = (out / "gpu_suite_memory.log").read_text()
    assert f"test_sim.py::test_{memory} " in rerun and "test_sim.py::test_d" not in rerun
    outcome = "1 passed" if memory == "b" else "1 failed"
    assert result.stdout == (f"out of GPU memory beside the other shards, 1 rerun alone: {outcome} in "
                             f"{rerun.strip().splitlines()[-1].split(' in ', 1)[1]}\n")


@pytest.mark.slow
def test_a_shard_past_the_suites_deadline_stops_with_its_summary(tmp_path):
    """``PASA_SUITE_DEADLINE`` (``gpu_suite.sh``'s ``SUITE_SECONDS``) in the past: the shard stops after its
    first test with pytest's summary written (a failure's traceback would be in it), the rest counted as not run,
    and no restart (it is not a lost context)."""
    result, text = _simulated_shard(tmp_path, "from tests.conftest import pytest_runtest_logreport, "
                                    "pytest_runtest_teardown  # noqa: F401\n", **{conftest.DEADLINE_VARIABLE: "0"})
    assert result.returncode == 1, (result.stdout, result.stderr, text)
    assert f"{conftest.PAST_DEADLINE} ({conftest.DEADLINE_VARIABLE}) after test_sim.py::test_a" in text
    assert text.strip().splitlines()[-1].startswith("1 passed, 3 not run in ")
    assert "(0 restarts after a lost CUDA context)" in text and "slowest 15 durations" in text


@pytest.mark.slow
def test_memory_retry_does_not_rerun_when_a_shard_was_cut_short(tmp_path):
    out = tmp_path / "suite"
    out.mkdir()
    (out / "gpu_suite_0.log").write_text(SHARD_LOG.format(memory="b", other="", counts="1 failed, 1 passed, 2 not run"))
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_memory_retry.py"), str(out)], cwd=tmp_path,
                            text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True)
    assert result.returncode == 1 and not (out / "gpu_suite_memory.log").exists()
    assert result.stdout == "out of GPU memory beside the other shards: 1, not rerun (shards were cut short)\n"
