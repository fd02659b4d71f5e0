"""The Gluon int8 kernel (``kernels/hopper_int8.py``) on a machine that cannot run it.

Its numbers come from the GPU (``tests/test_int8.py``'s gpu tests against the spec, ``bench.int8_fallback``)
and its sm_90 compilation from ``tools.compile_int8``; here: the router's plan says why the 8-bit path attends
with the portable kernel, ``kernel="gluon-int8"`` is refused with that reason, bad configs and pre-pass outputs
are refused by name before anything is built, and the tuned configs fit the shared memory.
"""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")

from pasa_diffusers.block_sparse import BlockSparseMask  # noqa: E402
from pasa_diffusers.kernels import dispatch, gluon_common, hopper_int8, quantize  # noqa: E402
from pasa_diffusers.kernels.common import INTERPRET  # noqa: E402
from pasa_diffusers.kernels.tuning import SMEM_LIMIT  # noqa: E402
from pasa_diffusers.variants import PV_BITS, Variant  # noqa: E402
from tests.launches import LaunchRecorder, launch_signature  # noqa: E402

INT8 = Variant("exact", "int8")


def _inputs(d=64, n=200, dtype=torch.float16):
    q = torch.randn(1, 2, n, d).to(dtype)
    return q, q.clone(), q.clone()


def test_unsuitable_reason_names_what_is_missing():
    q, _, v = _inputs()
    unavailable = gluon_common.unavailable_reason()
    expected = unavailable if unavailable is not None else "it runs on CUDA GPUs, got cpu"
    assert hopper_int8.unsuitable_reason(q, v, v, q, pv_bits=16) == expected
    found = dispatch.plan(q, q, v, q, variant=INT8)
    why = "Triton's interpreter runs no Gluon" if INTERPRET else expected
    assert found.kernel == "portable-int8" and found.rejected["gluon-int8"] == why
    with pytest.raises(ValueError, match=r"kernel='gluon-int8' cannot run this call: " + re.escape(why)):
        dispatch.plan(q, q, v, q, variant=INT8, kernel="gluon-int8")
    with pytest.raises(ValueError, match=r"unknown kernel='fast'; expected one of \('auto', 'packed'"):
        dispatch.plan(q, q, v, q, variant=INT8, kernel="fast")


@pytest.mark.parametrize("config,match", [
    ({"BLOCK_M": 128}, r"unknown config keys \['BLOCK_M'\]"),
    ({"BLOCK_N": 32}, "BLOCK_N=32 must be 64 or 128"),
    ({"num_stages": 5}, "num_stages=5 must be 1..4"),
    ({"consumers": 1}, "consumers=1 must be 2 or 3"),
    ({"lazy": 1}, r"lazy=1 must be True or False"),
    ({"pingpong": "yes"}, r"pingpong='yes' must be True or False"),
    ({"BLOCK_N": 128, "num_stages": 3, "consumers": 3}, r"needs \d+ bytes of shared memory at DP 128"),
])
def test_bad_configs_are_refused_by_name(config, match):
    q, k, v = _inputs(d=128)
    prep, _ = quantize.allocate(q, k, v, bias=True)
    with pytest.raises(ValueError, match=match):
        hopper_int8.kernel_call(q, prep, torch.empty_like(q), scale=0.125, config=config)


@pytest.mark.parametrize("fallback", [True, False])
def test_flagged_tiles_read_the_input_keys(fallback):
    """With the 16-bit blocks on, the launch copies the input keys in key tiles (the consumers split them into
    ``hi`` and ``lo``; the pre-pass writes no split); without, a 16-row dummy of the centres stands in."""
    q, k, v = _inputs(d=128)
    prep, _ = quantize.allocate(q, k, v, fallback=fallback, bias=True)
    _, args, meta = hopper_int8.kernel_call(q, prep, torch.empty_like(q), scale=0.125)
    keys = args[5]
    if fallback:
        assert keys.base is k and list(keys.block_shape) == [1, 1, meta["BLOCK_N"], 128]
    else:
        assert keys.base is not k and list(keys.block_shape) == [1, 1, 16, 128]


@pytest.mark.parametrize("n_k", [200, 203, 4096])
def test_per_key_vectors_are_padded_rows_for_tma(n_k):
    """The pre-pass's per-key vectors are views of rows padded to 16 bytes: what the 1-d TMA copies need."""
    q, k, v = _inputs(n=n_k)
    prep, _ = quantize.allocate(q, k, v, bias=True)
    for t in (prep.k_scale, prep.sigma, prep.au):
        assert t.shape[-1] == n_k and t.stride(1) % 4 == 0 and t.stride(1) >= n_k and t.stride(2) == 1
    assert prep.bias.shape == (1, 2, n_k, 16) and prep.bias.dtype == torch.bfloat16
    assert prep.bias.stride() == (2 * prep.au.stride(1) * 16, prep.au.stride(1) * 16, 16, 1)
    with pytest.raises(ValueError, match="per-key vectors must be rows padded to 16 bytes"):
        hopper_int8._row_descriptor(torch.empty(1, 2, 203), 64)


def test_a_pre_pass_without_bias_rows_is_refused():
    """The kernel adds its logits' bias from the pre-pass's bias rows: outputs without them (``quantize.prepare``
    without ``bias=True``, as the portable kernel reads them) are refused by name before anything is built."""
    q, k, v = _inputs(d=128)
    prep, _ = quantize.allocate(q, k, v)
    assert prep.bias is None
    with pytest.raises(ValueError, match=r"prep has no bias rows \(prep.bias is None\)"):
        hopper_int8.kernel_call(q, prep, torch.empty_like(q), scale=0.125)


@pytest.mark.parametrize("head_dim", gluon_common.HEAD_DIMS)
@pytest.mark.parametrize("fallback", [True, False])
@pytest.mark.parametrize("pv_bits", PV_BITS)
@pytest.mark.parametrize("n_k", [hopper_int8.SHORT_KEYS, hopper_int8.SHORT_KEYS + 1])
@pytest.mark.parametrize("sparse", [False, True])
def test_tuned_configs_fit_the_shared_memory(head_dim, fallback, pv_bits, n_k, sparse):
    """The tuned configs fit; a block mask's call always takes :data:`hopper_int8.CONFIGS` (128-key tiles, two
    consumers: the mask's blocks)."""
    dp = 64 if head_dim <= 64 else 128
    cfg = hopper_int8.tuned_config(head_dim, n_k, sparse)
    short = dp == 64 and n_k <= hopper_int8.SHORT_KEYS and not sparse
    assert cfg == (hopper_int8.SHORT_KEYS_CONFIG if short else hopper_int8.CONFIGS[dp])
    assert hopper_int8.shared_bytes(cfg, dp, 2, fallback, pv_bits) <= SMEM_LIMIT


@pytest.fixture
def fresh_plans():
    """The plan cache emptied before and after (a test that changes what a kernel can take)."""
    dispatch.forget_plans()
    yield
    dispatch.forget_plans()


def test_auto_takes_the_gluon_kernel_from_its_minimum_keys(monkeypatch, fresh_plans):
    """Where the Gluon kernel could run, ``kernel="auto"`` takes it from ``hopper_int8.AUTO_MIN_KEYS`` keys, and the
    portable one for fewer keys or a given config (the rule alone; the GPU test runs both kernels)."""
    monkeypatch.setattr(hopper_int8, "INTERPRET", False)
    monkeypatch.setattr(hopper_int8, "unsuitable_reason", lambda *args, **kwargs: None)
    q, _, v = _inputs(n=hopper_int8.AUTO_MIN_KEYS)

    def chosen(values, **options):
        return dispatch.plan(q, values, values, q, variant=INT8, **options)

    assert chosen(v).kernel == "gluon-int8"
    fewer = chosen(v[:, :, 1:])
    assert fewer.kernel == "portable-int8"
    assert fewer.rejected["gluon-int8"] == (f"below {hopper_int8.AUTO_MIN_KEYS} keys the portable-int8 kernel is "
                                            f"the faster one, got {hopper_int8.AUTO_MIN_KEYS - 1} keys")
    assert chosen(v, config={"BLOCK_N": 64}).kernel == "portable-int8"
    assert chosen(v[:, :, 1:], kernel="gluon-int8").kernel == "gluon-int8"
    mask = BlockSparseMask.full(q.shape[2], v.shape[2])
    assert chosen(v, block_mask=mask).kernel == "gluon-int8"
    fewer_masked = chosen(v[:, :, 1:], block_mask=BlockSparseMask.full(q.shape[2], v.shape[2] - 1))
    assert fewer_masked.kernel == "portable-int8" and "keys" in fewer_masked.rejected["gluon-int8"]


@pytest.mark.parametrize("n_k", [200, 208, 4097])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp8_launch_reads_v8_transposed_in_tma_boxes(n_k, head_dim):
    """``P V`` in FP8: the launch copies V8^T (B, Hk, DP, Nk) in (DP, BLOCK_N) boxes from rows padded to 16 keys
    (TMA strides), passes V's channel scales and runs the eager rescale; in 16 bits the tuned config's rescale."""
    q, k, v = _inputs(d=head_dim, n=n_k)
    dp = 64 if head_dim <= 64 else 128
    prep, _ = quantize.allocate(q, k, v, pv_bits=8, bias=True)
    assert prep.v.shape[-2:] == (dp, n_k) and prep.v.stride(2) % 16 == 0 and prep.v.stride(2) >= n_k
    _, args, meta = hopper_int8.kernel_call(q, prep, torch.empty_like(q), scale=head_dim ** -0.5)
    block_n = hopper_int8.tuned_config(head_dim, n_k)["BLOCK_N"]
    assert meta["PV_FP8"] and not meta["LAZY"] and meta["BLOCK_N"] == block_n
    assert list(args[3].block_shape) == [1, 1, dp, block_n] and args[3].base is prep.v
    assert any(arg is prep.v_scale for arg in args)
    prep16, _ = quantize.allocate(q, k, v, bias=True)
    _, args16, meta16 = hopper_int8.kernel_call(q, prep16, torch.empty_like(q), scale=head_dim ** -0.5,
                                                config={"lazy": True})
    assert not meta16["PV_FP8"] and meta16["LAZY"] and list(args16[3].block_shape) == [1, 1, block_n, dp]


def test_the_host_wrapper_reaches_its_launch(monkeypatch):
    """``hopper_int8.forward`` on the pre-pass's outputs as meta tensors, the kernel replaced by a recorder
    (``tests.launches.LaunchRecorder``): one launch, of what ``kernel_call`` builds."""
    recorder = LaunchRecorder()
    monkeypatch.setattr(hopper_int8, "int8_fwd_gluon_kernel", recorder)
    q, k, v = (torch.empty(2, 4, 600, 64, dtype=torch.bfloat16, device="meta") for _ in range(3))
    for pv_bits in PV_BITS:
        prep, _ = quantize.allocate(q, k, v, pv_bits=pv_bits, fallback=True, bias=True)
        out = torch.empty_like(q)
        assert hopper_int8.forward(q, prep, out, scale=0.125) is out
        assert launch_signature(*recorder.launches[-1]) == launch_signature(
            *hopper_int8.kernel_call(q, prep, out, scale=0.125))
    assert len(recorder.launches) == len(PV_BITS)
