"""The exact shift (``reference.exact_shift_reference``) against exact attention, on the CPU.

The criterion of the issue: in ``"hybrid"`` (fp32 scores and state) the exact shift is as accurate as
fp32-score FlashAttention, ``err(exact hybrid) <= 2 err(FA fp32)`` in every cell of the paper's grid
with zero-mean V (``err = rel_rmse`` against the float64 golden).  Why it should hold: the removed
centre ``c_j`` is carried exactly in ``r_j = scale q . c_j`` (fp32), ``exact_centre`` keeps
``k - c_j`` exact, so the only roundings left are FA fp32's own (fp32 score sums, ``P`` in fp16) plus
``r_j``'s fp32 sum, which is of the size of the fp32 score's.  Measured (1, 2, 1, 300, 128): ratios
0.46-1.00 (below 1 on biased cells: the centred scores sum smaller fp32 terms).

``"half"`` (fp16 score tile, fp16 ``P`` and accumulator, fp32 ``m``, ``l``, ``r``).  Its scores hold
only the centred part ``q_s (k - c_j)``, so its error is FA half's error on a problem whose keys carry
no bias: (1) where FA half is finite, ``err(exact half) <= 2 err(FA half)`` (its score tile is never
larger than FA half's, its state is fp32 instead of fp16); (2) on biased cells (mean > 0) it is at most
half of PASA half's error (PASA recovers the bias through gamma times an fp16-rounded mean; here the
bias is exact); (3) everywhere ``err <= 2e-2``: the centred scores ``|q_s k_c|`` stay below ~20
(fp16 rounding 2^-11 relative gives logit errors ~1e-2 at most, output errors below it), with margin
over the largest measured 9.8e-3 (uniform(30, 20)).
"""
from __future__ import annotations

import pytest
import torch

from pasa_diffusers import numerics
from pasa_diffusers.reference import (exact_centre, exact_shift_reference, flash_reference, golden_attention,
                                      pasa_reference)

SHAPE = (1, 2, 1, 300, 128)  # 300 = 2 * 128 + 44: a ragged tail
CELLS = [(d, m, a) for d in ("uniform", "hybrid") for m in (0.0, 10.0, 30.0) for a in (0.5, 5.0, 20.0)]
HALF_ABS_BOUND = 2e-2

pytestmark = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")


def _err(out, gold):
    return numerics.rel_rmse(out, gold) if torch.isfinite(out).all() else float("nan")


@pytest.mark.parametrize("dist,mean,amplitude", CELLS, ids=[f"{d}({m:g},{a:g})" for d, m, a in CELLS])
def test_paper_grid_zero_mean_v(dist, mean, amplitude):
    q, k, v = numerics.paper_inputs(dist, mean, amplitude, SHAPE, v_mean=0.0)
    gold = golden_attention(q, k, v)
    hybrid = exact_shift_reference(q, k, v, precision="hybrid")
    half = exact_shift_reference(q, k, v, precision="half")
    assert hybrid.dtype == half.dtype == torch.float16
    assert torch.isfinite(hybrid).all() and torch.isfinite(half).all()

    err_fa32 = _err(flash_reference(q, k, v, precision="hybrid"), gold)
    err_hybrid = _err(hybrid, gold)
    assert err_hybrid <= 2.0 * err_fa32 + 1e-7, f"exact hybrid {err_hybrid:.3e} > 2 x FA fp32 {err_fa32:.3e}"

    err_half = _err(half, gold)
    assert err_half <= HALF_ABS_BOUND, f"exact half {err_half:.3e} > {HALF_ABS_BOUND}"
    err_fa_half = _err(flash_reference(q, k, v, precision="half"), gold)
    if err_fa_half == err_fa_half:  # FA half finite
        assert err_half <= 2.0 * err_fa_half + 1e-7, f"exact half {err_half:.3e} > 2 x FA half {err_fa_half:.3e}"
    if mean > 0:
        err_pasa = _err(pasa_reference(q, k, v, precision="half"), gold)
        assert err_half <= 0.5 * err_pasa, f"exact half {err_half:.3e} not below PASA half {err_pasa:.3e} / 2"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dist,mean,amplitude", [("uniform", 30.0, 0.5), ("uniform", 30.0, 20.0), ("uniform", -30.0, 20.0),
                                                 ("uniform", 10.0, 5.0), ("hybrid", 30.0, 10.0), ("uniform", 0.0, 5.0),
                                                 ("uniform", 10.0, 20.0)])
def test_exact_centre_makes_k_minus_c_exact(dist, mean, amplitude, dtype):
    """``k - c`` is exact in g for every key of every block; channels of one sign spread over less than
    a factor of ~4 (every mean-30 cell, even uniform(30, 20): keys in [10, 50]) are all centred; channels
    that change sign are left alone; the centred keys are smaller than the keys."""
    _, k, _ = numerics.paper_inputs(dist, mean, amplitude, (1, 2, 2, 512, 128), dtype=dtype)
    for start in range(0, k.shape[2], 128):
        k32 = k[:, :, start:start + 128].float()
        c = exact_centre(k32, dtype)
        assert c.dtype == torch.float32 and torch.equal(c.to(dtype).float(), c)
        diff = k32 - c
        assert torch.equal(diff.to(dtype).float(), diff)
        one_sign = (k32.amin(dim=-2, keepdim=True) > 0) | (k32.amax(dim=-2, keepdim=True) < 0)
        assert (c[~one_sign] == 0).all()
        if abs(mean) == 30.0 and dist == "uniform":
            assert (c != 0).all()
            assert diff.abs().amax() <= 0.6 * k32.abs().amax()
    # the plain mean is not exact in general (why the centre is chosen): not where keys change sign
    k32 = k[:, :, :128].float()
    kbar = k32.mean(dim=-2, keepdim=True).to(dtype).float()
    if mean == 0.0:
        assert not torch.equal((k32 - kbar).to(dtype).float(), k32 - kbar)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_exact_centre_is_exact_on_adversarial_blocks(dtype):
    """No per-key check backs the centre: every ``k - c`` must be exact by the interval alone.  Channels
    of one sign whose keys span 0 to 2.3 binades (both sides of the interval's edge), at magnitudes from
    fp16's subnormals to 4e4, one key pinned at a binade boundary."""
    gen = torch.Generator().manual_seed(3)
    size = (64, 128, 128)  # (blocks, keys, channels)
    magnitude = 10.0 ** (torch.rand((64, 1, 128), generator=gen) * 10.5 - 6)
    spread = 2.0 ** (torch.rand((64, 128, 128), generator=gen) * 2.3 * torch.rand((64, 1, 128), generator=gen))
    sign = torch.where(torch.rand((64, 1, 128), generator=gen) < 0.5, -1.0, 1.0)
    k32 = (sign * magnitude * spread).to(dtype).float()
    k32[:, 0] = sign[:, 0] * 2.0 ** torch.floor(torch.log2(magnitude[:, 0]))  # a key at a binade boundary
    c = exact_centre(k32, dtype)
    diff = k32 - c
    assert torch.equal(diff.to(dtype).float(), diff)
    centred = (c != 0).float().mean().item()
    assert 0.3 < centred < 1.0, f"{centred:.2f} of the channels centred: the case must hit both sides of the edge"
    assert k32.shape == size


@pytest.mark.parametrize("name", ["uniform(30,0.5) zero-mean V", "drift(0->40)", "resonance in", "resonance anti",
                                  "hybrid(30,10) outliers", "bf16 uniform(30,0.5)"])
def test_stress_cases(name):
    q, k, v = numerics.stress_cases()[name]
    gold = golden_attention(q, k, v)
    err_fa32 = _err(flash_reference(q, k, v, precision="hybrid"), gold)
    hybrid = exact_shift_reference(q, k, v, precision="hybrid")
    assert hybrid.dtype == q.dtype
    assert _err(hybrid, gold) <= 2.0 * err_fa32 + 1e-7
    if q.dtype == torch.float16:
        half = exact_shift_reference(q, k, v, precision="half")
        assert _err(half, gold) <= HALF_ABS_BOUND


def test_exact_in_real_arithmetic_block_size_free(gen):
    """Any block_n gives the same attention up to rounding; one key is one block (c = k itself)."""
    q = (torch.randn(1, 2, 40, 64, generator=gen) + 5).half()
    k = (torch.randn(1, 1, 150, 64, generator=gen) + 5).half()
    v = torch.randn(1, 1, 150, 64, generator=gen).half()
    gold = golden_attention(q, k, v)
    errs = [numerics.rel_rmse(exact_shift_reference(q, k, v, precision="hybrid", block_n=n), gold)
            for n in (1, 17, 128, 150)]
    assert max(errs) <= 2.0 * numerics.rel_rmse(flash_reference(q, k, v, precision="hybrid"), gold)


def test_rejects_bad_arguments(gen):
    q = torch.randn(1, 2, 8, 32, generator=gen).half()
    with pytest.raises(ValueError, match="unknown precision"):
        exact_shift_reference(q, q, q, precision="fp64")
    with pytest.raises(ValueError, match="precision='half' needs fp16"):
        exact_shift_reference(q.bfloat16(), q.bfloat16(), q.bfloat16(), precision="half")
    with pytest.raises(ValueError, match="block_n must be a positive int"):
        exact_shift_reference(q, q, q, block_n=0)


def test_op_dispatch_and_validation(gen):
    from pasa_diffusers.ops import pasa_attention

    q = (torch.randn(1, 2, 50, 64, generator=gen) + 3).half()
    for precision in ("half", "hybrid"):
        out = pasa_attention(q, q, q, precision=precision, shift="exact")
        assert torch.equal(out, exact_shift_reference(q, q, q, precision=precision))
    assert torch.equal(pasa_attention(q, q, q, precision="fp64", shift="exact"), golden_attention(q, q, q))
    with pytest.raises(ValueError, match="unknown shift='exakt'"):
        pasa_attention(q, q, q, shift="exakt")
