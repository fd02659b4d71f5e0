"""cpu_math.pin: MKL's vendor-independent branch and ATen's AVX2 kernels, or a clear refusal once torch has chosen
another path."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from pasa_diffusers import cpu_math

x86_64 = pytest.mark.skipif(not cpu_math.portable_host(), reason="the pinned paths are x86-64's")


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


PINNED_GEMM_SHA256 = "8f31cf94f801e9434006fea25a82b2b7a0c1caed8b47c376f8d546cb22b625b7"
"""The bits of one fp32 MKL GEMM under the pin on one thread (written on an AMD EPYC, 2026-12-07): MKL's AVX2 branch
gave other bits on AMD processors than on Intel ones, its COMPATIBLE branch gives these on both."""


@x86_64
def test_a_pinned_gemm_gives_the_committed_bits():
    """The pin's promise at its root: an MKL GEMM of logits in the thousands, the summation order behind the LSE
    table and samples/compare, gives the bits committed from another vendor's machine."""
    done = _python("from pasa_diffusers import cpu_math\ncpu_math.pin()\nimport hashlib, torch\n"
                   "g = torch.Generator().manual_seed(0)\n"
                   "a, b = torch.randn(333, 256, generator=g) * 30, torch.randn(256, 517, generator=g) * 30\n"
                   "print(hashlib.sha256((a @ b).numpy().tobytes()).hexdigest())", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == PINNED_GEMM_SHA256, "this machine's pinned MKL GEMM rounds otherwise"


@pytest.mark.slow
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
