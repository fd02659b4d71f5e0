"""Kept launches (``kernels/launch.py``): the key holds what Triton specializes on, and a launch through a kept
compiled kernel gives the bits of one that binds its arguments (on a GPU)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pasa_diffusers.kernels import launch  # noqa: E402
from pasa_diffusers.kernels.prepass import centre_keys  # noqa: E402
from pasa_diffusers.ops import pasa_attention  # noqa: E402


def test_the_arguments_key_holds_dtypes_alignments_ints_and_the_types_of_the_rest():
    flat = torch.empty(64, dtype=torch.float16)
    key = launch.arguments_key((flat, flat[1:], flat[8:], flat.float(), 1, 16, 17, 2**31, True, 0.5, None))
    assert key == ((torch.float16, 0), (torch.float16, 2), (torch.float16, 0), (torch.float32, 0), 1, 16, 17, 2**31,
                   (bool, True), float, type(None))


def test_the_arguments_key_holds_what_a_descriptor_specializes_on_and_not_its_address():
    """A TMA descriptor's dtype, box and shared layout enter the key (Triton specializes on them); its base address,
    shape and strides do not (they are encoded at each launch)."""
    gluon_common = pytest.importorskip("pasa_diffusers.kernels.gluon_common")
    if gluon_common.GLUON_IMPORT_ERROR is not None:
        pytest.skip(f"no Gluon: {gluon_common.GLUON_IMPORT_ERROR}")
    t = torch.empty(2, 3, 256, 64, dtype=torch.float16)

    def key(x, rows, tile):
        return launch.arguments_key((gluon_common.descriptor(x, rows, tile),))

    assert key(t, 64, 64) == key(torch.empty_like(t), 64, 64) == key(t[:, :, :128], 64, 64)
    assert key(t, 64, 64) != key(t.bfloat16(), 64, 64)
    assert key(t, 64, 64) != key(t, 128, 64)
    assert len({key(t, 64, 64), key(t, 128, 64)}) == 2  # hashable: the key indexes the kept kernels


def test_launch_values_are_every_parameter_in_signature_order():
    """What a kept launch hands the launcher: the positional arguments, then each constexpr from ``meta`` or its
    default (``meta``'s launch options are not parameters)."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    from pasa_diffusers import compat

    def kernel(a, b, N, X: tl.constexpr, Y: tl.constexpr = 3, Z: tl.constexpr = 5):
        pass

    assert compat.launch_values(JITFunction(kernel), ("a", "b", 7), dict(X=1, Z=9, num_warps=4)) == (
        "a", "b", 7, 1, 3, 9)


def _misaligned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous random tensor whose base is 2 bytes past a 16-byte boundary."""
    numel = torch.Size(shape).numel()
    return torch.randn(numel + 1, device="cuda", dtype=torch.float32).to(dtype)[1:].view(shape)


def _kept_and_bound(run):
    """``run()`` three times: binding (no key kept), then through the key the first launch kept, and again
    binding after the keys are forgotten; the outputs and how many keys the first two calls added."""
    launch.forget_launches()
    first = run()
    kept_keys = len(launch._KEPT)
    second = run()
    assert len(launch._KEPT) == kept_keys, "a repeated launch kept a new key: the key holds something per call"
    launch.forget_launches()
    return first, second, run(), kept_keys


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "misaligned"])
def test_a_kept_centre_pre_pass_launch_gives_the_bound_launchs_bits(aligned):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    shape = (2, 3, 1000, 64)
    k = torch.randn(shape, device="cuda", dtype=torch.float16) if aligned else _misaligned(shape, torch.float16)
    assert (k.data_ptr() % 16 == 0) == aligned
    first, second, bound, kept_keys = _kept_and_bound(lambda: centre_keys(k, block_n=128, exact=True))
    assert kept_keys == 1
    for kept, fresh in ((first, bound), (second, bound)):
        assert all(_same_bits(x, y) for x, y in zip(kept, fresh))


@pytest.mark.gpu
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out+lse"])
@pytest.mark.parametrize("precision", ["hybrid", "int8", "fp8"])
def test_kept_launches_of_the_gluon_paths_give_the_bound_launches_bits(precision, return_lse):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels need sm_90")
    q, k, v = (torch.randn(2, 600, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    k += 40.0 * torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.bfloat16)  # a bias the shift removes

    def run():
        result = pasa_attention(q, k, v, layout="bnhd", precision=precision, return_lse=return_lse)
        return result if return_lse else (result,)

    first, second, bound, kept_keys = _kept_and_bound(run)
    # the default: the centre pre-pass and the Gluon kernel; 8-bit: the quantizing pre-pass's launches too
    assert kept_keys == 2 if precision == "hybrid" else kept_keys >= 4
    for kept, fresh in ((first, bound), (second, bound)):
        assert all(_same_bits(x, y) for x, y in zip(kept, fresh))
    q.copy_(torch.randn_like(q))  # new values through the kept launches: the bits of binding ones
    kept_new = run()
    launch.forget_launches()
    assert all(_same_bits(x, y) for x, y in zip(kept_new, run()))
