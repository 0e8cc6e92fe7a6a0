"""Accounting against independent references: Opacus and dp-accounting built directly,
closed forms (analytic Gaussian mechanism, Laplace), monotonicity, calibration round trip."""

import math

import dp_accounting
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant
from opacus.accountants import PRVAccountant, RDPAccountant
from scipy.stats import norm

from dpfl.privacy.accounting import (
    calibrate_dpsgd_noise,
    calibrate_noise,
    dpsgd_epsilon,
    dpsgd_history_epsilon,
    gaussian_epsilon,
    laplace_epsilon,
)


def _analytic_gaussian_epsilon(sigma: float, delta: float) -> float:
    """Exact epsilon of one Gaussian release, sensitivity 1, std sigma (Balle & Wang 2018):
    delta(eps) = Phi(1/(2 sigma) - eps sigma) - e^eps Phi(-1/(2 sigma) - eps sigma)."""
    def d(eps):
        return norm.cdf(0.5 / sigma - eps * sigma) - math.exp(eps) * norm.cdf(-0.5 / sigma - eps * sigma)
    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if d(mid) > delta else (lo, mid)
    return hi


def test_dpsgd_epsilon_matches_opacus_rdp_and_prv():
    acc = RDPAccountant()
    acc.history = [(1.1, 0.01, 500)]
    assert dpsgd_epsilon(0.01, 1.1, 500, 1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    prv = PRVAccountant()
    prv.history = [(1.1, 0.01, 500)]
    assert dpsgd_epsilon(0.01, 1.1, 500, 1e-5, accountant="prv") == pytest.approx(
        prv.get_epsilon(1e-5), rel=1e-6)


def test_dpsgd_history_composes_like_one_entry():
    split = dpsgd_history_epsilon([(1.0, 0.02, 100), (1.0, 0.02, 150)], 1e-5)
    assert split == pytest.approx(dpsgd_epsilon(0.02, 1.0, 250, 1e-5), rel=1e-12)


def test_gaussian_epsilon_matches_dp_accounting():
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(1.2)), 40)
    assert gaussian_epsilon(1.2, 40, 1e-5, 0.1, "poisson") == pytest.approx(acc.get_epsilon(1e-5))
    acc = rdp_privacy_accountant.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(dp_event.SampledWithoutReplacementDpEvent(100, 10, dp_event.GaussianDpEvent(0.6)), 30)
    assert gaussian_epsilon(1.2, 30, 1e-5, 0.1, "fixed", relation="replace-one",
                            population_size=100) == pytest.approx(acc.get_epsilon(1e-5))


def test_one_gaussian_release_pld_matches_analytic_gaussian():
    for sigma in (0.8, 2.0, 5.0):
        exact = _analytic_gaussian_epsilon(sigma, 1e-5)
        assert gaussian_epsilon(sigma, 1, 1e-5, accountant="pld") == pytest.approx(exact, rel=2e-2)
        assert gaussian_epsilon(sigma, 1, 1e-5, accountant="rdp") >= exact  # RDP is an upper bound


def test_replace_one_doubles_sensitivity():
    assert gaussian_epsilon(2.0, 5, 1e-5, relation="replace-one") == pytest.approx(
        gaussian_epsilon(1.0, 5, 1e-5))


def test_monotonicity():
    eps = [gaussian_epsilon(1.0, r, 1e-5) for r in (1, 2, 5, 10)]
    assert eps == sorted(eps) and eps[0] < eps[-1]
    eps = [gaussian_epsilon(s, 10, 1e-5) for s in (4.0, 2.0, 1.0, 0.5)]
    assert eps == sorted(eps)
    eps = [dpsgd_epsilon(0.01, 1.0, n, 1e-5) for n in (10, 100, 1000)]
    assert eps == sorted(eps)


def test_laplace_composition():
    assert laplace_epsilon([0.1, 0.2, 0.3]) == pytest.approx(0.6)
    # 100 releases of eps 0.1, delta' = 1e-5: advanced composition by hand
    k, e, d = 100, 0.1, 1e-5
    hand = math.sqrt(2 * k * math.log(1 / d)) * e + k * e * (math.exp(e) - 1) / (math.exp(e) + 1)
    assert laplace_epsilon([e] * k, delta_prime=d) == pytest.approx(min(hand, k * e))
    assert laplace_epsilon([e] * k, delta_prime=d) < 10.0


def test_calibrate_noise_round_trip():
    for target in (1.0, 4.0):
        sigma = calibrate_noise(target, 1e-5, 20)
        assert gaussian_epsilon(sigma, 20, 1e-5) <= target
        assert gaussian_epsilon(0.99 * sigma, 20, 1e-5) > target


def test_calibrate_dpsgd_noise_meets_target():
    sigma = calibrate_dpsgd_noise(4.0, 1e-5, 1 / 106, 530)
    assert dpsgd_epsilon(1 / 106, sigma, 530, 1e-5) <= 4.0
    assert dpsgd_epsilon(1 / 106, 0.99 * sigma, 530, 1e-5) > 4.0 - 0.02


def test_bad_arguments():
    with pytest.raises(ValueError):
        gaussian_epsilon(1.0, 3, 1.5)
    with pytest.raises(ValueError, match="replace-one"):
        gaussian_epsilon(1.0, 3, 1e-5, 0.1, "fixed", population_size=10)
    with pytest.raises(ValueError, match="add-remove"):
        gaussian_epsilon(1.0, 3, 1e-5, 0.1, "poisson", relation="replace-one")
