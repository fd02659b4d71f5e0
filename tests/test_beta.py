"""The beta fixed point and the recovery factor computed from the stored entries of M."""
import math

import pytest
import torch

from pasa_diffusers.shift_matrix import gamma, optimal_beta, shift_entries


@pytest.mark.parametrize("start, expected, expected_gamma", [
    (1 - 2 ** -4, 0.9375, 15.0),
    (1 - 2 ** -5, 0.968994, 31.25),
    (1 - 2 ** -6, 0.984497, 63.50),
])
def test_fixed_points_of_the_authors(start, expected, expected_gamma):
    beta = optimal_beta(128, torch.float16, 1.0, start=start)
    assert beta == pytest.approx(expected, abs=1e-6)
    assert gamma(beta) == pytest.approx(expected_gamma, abs=0.01)
    assert beta / (1 - beta) == pytest.approx(gamma(beta), rel=1e-7)


def test_0_9375_is_exact():
    diag, off = shift_entries(0.9375, 128, torch.float16, 1.0)
    assert diag == 1 - 0.9375 / 128 and off == -0.9375 / 128
    assert gamma(0.9375) == 15.0


def test_bf16_fixed_point_matches_fp16_at_128():
    assert optimal_beta(128, torch.bfloat16, start=1 - 2 ** -5) == pytest.approx(0.968994, abs=1e-6)


def test_gamma_uses_stored_entries_not_beta():
    """Head dim 128: the scale 1/sqrt(128) is no power of two, so the stored entries differ from
    scale*M and gamma moves away from beta/(1-beta) (the authors' script keeps 63.50)."""
    scale = 128 ** -0.5
    g = gamma(0.984497, 128, torch.float16, scale)
    assert g == pytest.approx(64.41, abs=0.01)
    assert abs(g - 0.984497 / (1 - 0.984497)) > 0.5


@pytest.mark.parametrize("beta", [0.3, 0.7, 0.9375, 0.99])
def test_gamma_without_rounding_is_beta_over_one_minus_beta(beta):
    assert gamma(beta, 100, torch.float64, 0.125) == pytest.approx(beta / (1 - beta), rel=1e-12)


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.5, 1.5, math.nan])
def test_beta_outside_unit_interval_raises(bad):
    with pytest.raises(ValueError, match="beta"):
        gamma(bad)
    with pytest.raises(ValueError, match="beta"):
        optimal_beta(start=bad)
