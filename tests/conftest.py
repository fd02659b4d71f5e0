"""Shared pytest setup: the ``gpu`` marker and Triton's CPU interpreter.

- ``@pytest.mark.gpu`` tests skip when CUDA is unavailable, and also when the kernels were built for
  Triton's interpreter (they would then run on the CPU, far too slowly for GPU shapes).
- Triton decides between compiling and interpreting a ``@triton.jit`` function when it is *defined*,
  from ``TRITON_INTERPRET`` (its own ``triton.language`` helpers at ``import triton``).  On a host
  without CUDA, this file therefore imports triton and the kernels with ``TRITON_INTERPRET=1``, before
  any test module, so ``tests/test_kernel_interpret.py`` can run the real kernels on CPU tensors.  It
  then keeps triton interpreting through ``triton.knobs`` and removes the variable again, so that
  ``pasa_diffusers.ops`` keeps sending CPU tensors to the reference in every other test (it reads the
  variable per call); a test that wants the op to take the interpreted kernel sets it with
  ``monkeypatch.setenv``.  (Triton < 3.4 has no knobs: the variable then stays set.)  Setting
  ``TRITON_INTERPRET`` yourself is respected as it is.
- On an x86-64 host the suite runs the pinned CPU math (``pasa_diffusers.cpu_math.pin``, before any op: MKL's
  COMPATIBLE branch, ATen's AVX2 kernels), so the tests that check committed numbers (docs/NUMERICS.md's LSE
  table, samples/compare) see what any such machine computes, Intel's or AMD's, not what this machine's
  AVX-512 or AMX paths round to.
"""
from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from pasa_diffusers import cpu_math

cpu_math.pin()


def _build_interpreted_kernels() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    knobs = None
    try:
        import triton

        knobs = getattr(triton, "knobs", None)  # triton >= 3.4
        if knobs is not None:
            knobs.runtime.interpret = True  # triton keeps interpreting once the variable is gone
        import pasa_diffusers.kernels.dispatch  # noqa: F401
    except ImportError:  # no triton on this host: the kernel tests skip themselves
        pass
    finally:
        if knobs is not None:
            os.environ.pop("TRITON_INTERPRET", None)


if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules:
    _build_interpreted_kernels()


def kernels_interpreted() -> bool:
    """Whether ``pasa_diffusers.kernels`` runs under Triton's interpreter (False without triton)."""
    try:
        from pasa_diffusers.kernels.common import INTERPRET
    except ImportError:
        return False
    return INTERPRET


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and not kernels_interpreted():
        return
    reason = ("needs CUDA" if not torch.cuda.is_available()
              else "the kernels were built for Triton's interpreter (TRITON_INTERPRET=1)")
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gen() -> torch.Generator:
    """A CPU generator with a fresh seed per test and run (printed: replay a failure with PASA_TEST_SEED)."""
    seed = int(os.environ.get("PASA_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """One CPU thread for the whole suite: the tiny models' ops are too small for more, and with another
    process on one of the two cores OpenMP spinning made the 2-thread run about 100x slower (5 s per
    tiny UNet forward)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _pasa_debug_as_the_environment_says():
    """``cli.main`` in this process sets the third-party log switch (``quiet.show``) from its argv: put it back to
    "as the environment says" after each test, so that an in-process ``--debug`` run does not leak into the next."""
    yield
    quiet = sys.modules.get("pasa_diffusers.pipelines.quiet")
    if quiet is not None:
        quiet.show(None)


@pytest.fixture
def pipe():
    """A fresh tiny SVD pipeline (fp32, CPU)."""
    from pasa_diffusers.pipelines.svd import load_svd

    return load_svd("tiny")


LOST_CONTEXT = "CUDA context lost"
"""The stop reason's marker for ``scripts/gpu_shard.py``, which reruns the tests left in a new process."""


def _cuda_lost() -> str | None:
    """Why this process can no longer use the GPU (a kernel's illegal address poisons its CUDA context for
    every later call), or None."""
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
    except RuntimeError as error:
        return str(error).strip().splitlines()[0]
    return None


DEADLINE_VARIABLE = "PASA_SUITE_DEADLINE"
"""With it set (``scripts/gpu_suite.sh``'s ``SUITE_SECONDS``), the Unix time after which a session starts no further
test: it stops and writes its summary (the failures' tracebacks, the counts), where a time limit killing it would
leave a log without either."""
PAST_DEADLINE = "the suite's deadline passed"


def pytest_runtest_teardown(item, nextitem):
    """After a ``gpu`` test, probe the GPU: if the context is lost, stop the session here, so that the tests
    after it are not reported as failures of their own (``scripts/gpu_shard.py`` reruns them).  Past the
    deadline of :data:`DEADLINE_VARIABLE`, stop the session before the next test."""
    if "gpu" in item.keywords and torch.cuda.is_available():
        reason = _cuda_lost()
        if reason is not None:
            item.session.shouldstop = f"{LOST_CONTEXT} after {item.nodeid}: {reason}"
    deadline = os.environ.get(DEADLINE_VARIABLE)
    if deadline and nextitem is not None and not item.session.shouldstop and time.time() > float(deadline):
        item.session.shouldstop = f"{PAST_DEADLINE} ({DEADLINE_VARIABLE}) after {item.nodeid}"


def pytest_runtest_logreport(report):
    """With ``PASA_TEST_OUTCOMES`` set (``scripts/gpu_shard.py``), append ``nodeid<TAB>outcome`` per phase
    that decides a test's outcome (the call, or a setup or teardown that did not pass)."""
    path = os.environ.get("PASA_TEST_OUTCOMES")
    if path and (report.when == "call" or report.outcome != "passed"):
        with open(path, "a") as record:
            record.write(f"{report.nodeid}\t{report.outcome}\n")
