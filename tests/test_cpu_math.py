"""cpu_math.pin: torch's AVX2 CPU math, or a clear refusal once torch has chosen another path."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from pasa_diffusers import cpu_math

x86_64 = pytest.mark.skipif(not cpu_math.portable_host(), reason="the AVX2 paths are x86-64's")


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    env = {**{name: value for name, value in os.environ.items() if name not in cpu_math.PORTABLE_ENV}, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


@x86_64
def test_the_suite_runs_the_pinned_math():
    assert torch.backends.cpu.get_cpu_capability() == cpu_math.PORTABLE_CAPABILITY
    assert not torch.backends.mkldnn.enabled
    assert {name: os.environ[name] for name in cpu_math.PORTABLE_ENV} == cpu_math.PORTABLE_ENV


@x86_64
def test_a_fresh_process_pins_before_its_first_op():
    done = _python("from pasa_diffusers import cpu_math\nimport torch\n"
                   "print(cpu_math.pin(), torch.backends.cpu.get_cpu_capability(), torch.backends.mkldnn.enabled)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "AVX2", "False"]


@x86_64
def test_pinning_after_an_op_is_refused_by_name():
    """ATen reads ATEN_CPU_CAPABILITY at its first dispatch: a later pin would change nothing, so it says so.
    (The process starts on ATen's plain path, so that the op picks another one than AVX2 on any machine.)"""
    done = _python("import torch\ntorch.ones(64).sum()\nfrom pasa_diffusers import cpu_math\ncpu_math.pin()",
                   ATEN_CPU_CAPABILITY="default")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("pasa_diffusers.cpu_math.NotPinnedError: torch runs its DEFAULT CPU kernels, not AVX2"), last
    assert "not AVX2: pin the CPU math before torch's first CPU op" in last


def test_other_machines_are_left_as_they_are(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    for name in cpu_math.PORTABLE_ENV:
        monkeypatch.delenv(name, raising=False)
    assert cpu_math.pin() is False
    assert not set(cpu_math.PORTABLE_ENV) & set(os.environ)
