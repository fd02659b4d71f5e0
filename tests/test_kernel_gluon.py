"""The Gluon Hopper kernel (``kernels/attn_fwd_gluon.py``, issue 16) on a machine that cannot run it.

Its numbers come from the GPU (``bench/bench_gluon.py``: every config checked against the golden
attention before it is timed) and its sm_90 compilation from ``bench/gluon_compile_check.py``; here:
the module imports whatever the Triton release, a launch without Gluon 3.6 says so, and bad configs
are refused by name before anything is built.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pasa_diffusers.kernels import attn_fwd_gluon as glu  # noqa: E402


def _inputs():
    q = torch.randn(1, 2, 64, 64).half()
    return q, q.clone(), q.clone(), torch.zeros(1, 2, 1, 64), torch.empty_like(q)


@pytest.mark.skipif(glu.gluon_unavailable_reason() is None, reason="this triton has Gluon 3.6: launching needs sm_90")
def test_launch_without_gluon_36_says_why():
    with pytest.raises(RuntimeError, match=r"exact_forward_gluon: .*triton .*use attn_fwd_tma.exact_forward_tma"):
        glu.exact_forward_gluon(*_inputs(), scale=0.125)


@pytest.mark.parametrize("config,match", [
    ({"BLOCK_M": 128}, r"unknown config keys \['BLOCK_M'\]"),
    ({"num_consumers": 2}, r"unknown config keys \['num_consumers'\]"),
    ({"BLOCK_N": 256}, "BLOCK_N=256 must be 64 or 128"),
    ({"num_stages": 0}, "num_stages=0 must be 1..4"),
    ({"overlap": 1}, "overlap=1 must be a bool"),
])
def test_bad_configs_are_refused_by_name(config, match):
    with pytest.raises(ValueError, match=match):
        glu.kernel_call(*_inputs(), scale=0.125, config=config)
