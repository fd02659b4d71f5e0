"""The Gluon Hopper kernel (``kernels/hopper.py``) on a machine that cannot run it.

Its numbers come from the GPU (``bench.hopper``: every config checked against the golden attention
before it is timed) and its sm_90 compilation from ``tools.compile_sm90``; here: the module imports
whatever the Triton release, the router says why it cannot take a call, and bad configs are refused by
name before anything is built.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pasa_diffusers.block_sparse import BlockSparseMask  # noqa: E402
from pasa_diffusers.kernels import gluon_common, hopper  # noqa: E402
from pasa_diffusers.kernels.tuning import SMEM_LIMIT  # noqa: E402
from tests.launches import LaunchRecorder, launch_signature  # noqa: E402


def _inputs():
    q = torch.randn(1, 2, 64, 64).half()
    return q, q.clone(), q.clone(), torch.zeros(1, 2, 1, 64), torch.empty_like(q)


def test_unsuitable_reason_names_what_is_missing():
    q, _, v, _, out = _inputs()
    reason = hopper.unsuitable_reason(q, v, out, precision="hybrid", block_n=128)
    unavailable = gluon_common.unavailable_reason()
    assert reason == (unavailable if unavailable is not None else "it runs on CUDA GPUs, got cpu")


@pytest.mark.parametrize("config,match", [
    ({"BLOCK_M": 128}, r"unknown config keys \['BLOCK_M'\]"),
    ({"num_consumers": 2}, r"unknown config keys \['num_consumers'\]"),
    ({"BLOCK_N": 256}, "BLOCK_N=256 must be 64 or 128"),
    ({"num_stages": 0}, "num_stages=0 must be 1..4"),
    ({"overlap": 1}, "overlap=1 must be a bool"),
    ({"consumers": 4}, "consumers=4 must be 2 or 3"),
])
def test_bad_configs_are_refused_by_name(config, match):
    with pytest.raises(ValueError, match=match):
        hopper.kernel_call(*_inputs(), scale=0.125, config=config)


def test_configs_past_shared_memory_are_refused_by_name():
    q = torch.randn(1, 2, 64, 128).bfloat16()
    with pytest.raises(ValueError, match=r"needs \d+ bytes of shared memory at head dim 128 \(tile 128\)"):
        hopper.kernel_call(q, q, q, torch.zeros(1, 2, 1, 128), torch.empty_like(q), scale=0.125,
                           config={"BLOCK_N": 128, "num_stages": 3, "consumers": 3})


@pytest.mark.parametrize("head_dim,tile", [(64, 64), (80, 128), (96, 128), (112, 128), (128, 128)])
def test_head_dims_map_to_their_tile_and_tuned_config(head_dim, tile):
    assert hopper.head_dim_tile(head_dim) == tile
    for n_k in (576, 32760):
        cfg = hopper.tuned_config(n_k, head_dim)
        assert cfg["consumers"] == (3 if tile == 64 else 2)
        assert hopper.shared_bytes(cfg, tile, 2) <= SMEM_LIMIT


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_a_block_mask_runs_one_key_tile_per_block_and_one_query_block_per_program(head_dim):
    """With a mask the config is the sparse one at any number of keys (128-key tiles, two consumers: 128 rows),
    and a config that breaks either is refused by name."""
    tile = hopper.head_dim_tile(head_dim)
    for n_k in (576, 32760):
        cfg = hopper.tuned_config(n_k, head_dim, sparse=True)
        assert (cfg["BLOCK_N"], cfg["consumers"]) == (128, 2)
        assert hopper.shared_bytes(cfg, tile, 2) <= SMEM_LIMIT
    q = torch.randn(1, 2, 200, head_dim).half()
    mask = BlockSparseMask.full(200, 200, heads=2)
    for config in ({"BLOCK_N": 64}, {"consumers": 3, "num_stages": 2}):
        with pytest.raises(ValueError, match=r"with a block_mask the config needs BLOCK_N=128 and consumers=2"):
            hopper.kernel_call(q, q, q, torch.zeros(1, 2, 2, head_dim), torch.empty_like(q), scale=0.125,
                               config=config, block_mask=mask)


@pytest.mark.skipif(gluon_common.GLUON_IMPORT_ERROR is not None, reason="this triton has no Gluon")
def test_descriptors_are_checked_once_per_signature_and_keep_no_tensor():
    """A TMA descriptor is built and checked by Triton on its signature's first call and kept without its
    tensor; later calls get the same fields with their own tensor as the base; a change of alignment is a new
    signature, checked again (Triton's own check refuses a misaligned base)."""
    import gc
    import weakref

    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    gluon_common._DESCRIPTORS.clear()
    first = torch.randn(2, 3, 40, 64).half()
    made = gluon_common.descriptor(first, 64, 64)
    assert made.base is first and len(gluon_common._DESCRIPTORS) == 1
    alive = weakref.ref(first)
    del made, first
    gc.collect()
    assert alive() is None  # the kept descriptor holds no tensor
    layout = gluon_common._shared_layout((1, 1, 64, 64), "float16")
    for _ in range(2):
        t = torch.randn(2, 3, 40, 64).half()
        made = gluon_common.descriptor(t, 64, 64)
        assert made == TensorDescriptor(t, [2, 3, 40, 64], list(t.stride()), [1, 1, 64, 64], layout)
        assert made.base is t
    assert len(gluon_common._DESCRIPTORS) == 1
    view = torch.randn(2, 40, 3, 64).half().transpose(1, 2)
    assert gluon_common.descriptor(view, 64, 64).strides == list(view.stride())
    misaligned = torch.empty(2 * 3 * 40 * 64 + 1, dtype=torch.float16)[1:].view(2, 3, 40, 64)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        gluon_common.descriptor(misaligned, 64, 64)
    assert len(gluon_common._DESCRIPTORS) == 2


def test_the_host_wrapper_reaches_its_launch(monkeypatch):
    """``hopper.forward`` on meta tensors, the kernel replaced by a recorder: one launch, of what ``kernel_call``
    builds (the only way a CPU runs the wrapper's own lines: a Gluon kernel never runs here)."""
    recorder = LaunchRecorder()
    monkeypatch.setattr(hopper, "exact_fwd_gluon_kernel", recorder)
    q, k_c, v = (torch.empty(2, 4, 600, 64, dtype=torch.float16, device="meta") for _ in range(3))
    centres = torch.empty(2, 4, 5, 64, dtype=torch.float16, device="meta")
    out = torch.empty_like(q)
    assert hopper.forward(q, k_c, v, centres, out, scale=0.125) is out
    assert len(recorder.launches) == 1
    assert launch_signature(*recorder.launches[0]) == launch_signature(
        *hopper.kernel_call(q, k_c, v, centres, out, scale=0.125))
