"""The Gluon Hopper kernel (``kernels/hopper.py``) on a machine that cannot run it.

Its numbers come from the GPU (``bench.hopper``: every config checked against the golden attention
before it is timed) and its sm_90 compilation from ``bench.compile_sm90``; here: the module imports
whatever the Triton release, the router says why it cannot take a call, and bad configs are refused by
name before anything is built.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pasa_diffusers.kernels import hopper  # noqa: E402


def _inputs():
    q = torch.randn(1, 2, 64, 64).half()
    return q, q.clone(), q.clone(), torch.zeros(1, 2, 1, 64), torch.empty_like(q)


def test_unsuitable_reason_names_what_is_missing():
    q, _, v, _, out = _inputs()
    reason = hopper.unsuitable_reason(q, v, out, precision="hybrid", block_n=128)
    unavailable = hopper.unavailable_reason()
    assert reason == (unavailable if unavailable is not None else "it runs on CUDA GPUs, got cpu")


@pytest.mark.parametrize("config,match", [
    ({"BLOCK_M": 128}, r"unknown config keys \['BLOCK_M'\]"),
    ({"num_consumers": 2}, r"unknown config keys \['num_consumers'\]"),
    ({"BLOCK_N": 256}, "BLOCK_N=256 must be 64 or 128"),
    ({"num_stages": 0}, "num_stages=0 must be 1..4"),
    ({"overlap": 1}, "overlap=1 must be a bool"),
])
def test_bad_configs_are_refused_by_name(config, match):
    with pytest.raises(ValueError, match=match):
        hopper.kernel_call(*_inputs(), scale=0.125, config=config)
