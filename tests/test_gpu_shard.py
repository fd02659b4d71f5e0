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


@pytest.mark.slow
def test_shard_reruns_the_tests_left_after_a_lost_context(tmp_path):
    (tmp_path / "conftest.py").write_text(LOSING_CONFTEST)
    (tmp_path / "test_sim.py").write_text(TESTS)
    ids = tmp_path / "ids.txt"
    ids.write_text("".join(f"test_sim.py::test_{name}\n" for name in "abcd"))
    log = tmp_path / "shard.log"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_shard.py"), str(ids), str(log),
                             "--rootdir", str(tmp_path), "-p", "no:randomly"], cwd=tmp_path, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True)
    text = log.read_text()
    last = text.strip().splitlines()[-1]
    assert result.returncode == 1, (result.stdout, result.stderr, text)
    assert last.startswith("1 failed, 3 passed in ") and last.endswith("(1 restarts after a lost CUDA context)"), text
    assert text.count("test_sim.py::test_c FAILED") == 1 and text.count("test_sim.py::test_a PASSED") == 1


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
