"""The PLD accountant for both units, its fallbacks and PLD calibration, against
dp-accounting's PLDAccountant / RdpAccountant and Opacus' PRV/RDP accountants called
directly here, and the closed form of a composed Gaussian.

Tolerances are a small factor above the agreement measured with dp-accounting 0.6.0 and
Opacus 1.6.0, each with the reason the math allows it."""

import logging
import math
import time

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.utils import get_noise_multiplier
from scipy.special import log_ndtr

from dpfl.privacy.accounting import accountants as A
from dpfl.privacy.accounting.accountants import (
    calibrate_dpsgd_noise,
    calibrate_noise,
    dpsgd_history_epsilon_detail,
    events_epsilon_detail,
    gaussian_epsilon,
    gaussian_epsilon_detail,
)
from dpfl.privacy.accounting.budget import PrivacyHistory
from dpfl.privacy.accounting.events import (
    PrivacyEvent,
    histories_epsilon,
    history_epsilon,
    history_epsilon_detail,
)
from dpfl.privacy.accounting.ledger import Ledger

D = 1e-5
# the demo: MNIST 60k over 4 clients, 10 % validation holdout -> 13,500 training samples,
# batch 256 -> 53 Poisson steps per epoch (q = 1/53), 1 local epoch, 5 rounds
DEMO_Q, DEMO_STEPS_PER_ROUND, DEMO_ROUNDS = 1 / 53, 53, 5


def _poisson_gaussian(q, sigma):
    return dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))


def _pld(pairs, interval=1e-4):
    acc = PLDAccountant(value_discretization_interval=interval)
    for event, count in pairs:
        acc.compose(event, count)
    return acc.get_epsilon(D)


def _composed_gaussian_exact(sigma: float, k: int, delta: float) -> float:
    """Exact epsilon of k Gaussian releases of multiplier sigma (sensitivity 1): their
    composition is one Gaussian of multiplier sigma / sqrt(k), mu = sqrt(k) / sigma, and
    (Balle & Wang 2018) delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu),
    evaluated in log space so that eps ~ 1e5 does not overflow."""
    mu = math.sqrt(k) / sigma

    def log_delta(eps):
        a = log_ndtr(mu / 2 - eps / mu)
        b = eps + log_ndtr(-mu / 2 - eps / mu)
        return a + np.log1p(-np.exp(b - a))

    lo, hi = 0.0, mu * mu + 20 * mu + 20
    for _ in range(300):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if log_delta(mid) > math.log(delta) else (lo, mid)
    return hi


@pytest.fixture
def fresh_cache():
    A._pld_compute.cache_clear()
    A._warned.clear()
    yield
    A._pld_compute.cache_clear()
    A._warned.clear()


def test_sample_level_pld_is_dp_accountings_pld_of_poisson_gaussian_steps():
    # rounds in any order; equal keys are one event composed with the summed count
    events = [PrivacyEvent.dpsgd(1, 1.5, 0.02, 100), PrivacyEvent.dpsgd(2, 1.2, 0.05, 50),
              PrivacyEvent.dpsgd(3, 1.5, 0.02, 100)]
    ref = _pld([(_poisson_gaussian(0.02, 1.5), 200), (_poisson_gaussian(0.05, 1.2), 50)])
    eps, method = history_epsilon_detail(events, D, "pld")
    # same events composed in the same (sorted) order: bit-identical
    assert (eps, method) == (ref, "pld(interval=1e-4)")
    # the opposite composition order moves the FFT result by 3.5e-11 (measured)
    other = _pld([(_poisson_gaussian(0.05, 1.2), 50), (_poisson_gaussian(0.02, 1.5), 200)])
    assert eps == pytest.approx(other, rel=2e-10)
    assert history_epsilon(list(reversed(events)), D, "pld") == eps  # order-free
    # and the Opacus-format entry point agrees
    assert dpsgd_history_epsilon_detail([(1.5, 0.02, 200), (1.2, 0.05, 50)], D, "pld") == (
        eps, method)


def test_demo_history_rdp_prv_pld():
    # sigma calibrated by Opacus' RDP to eps 4 (Opacus called directly), then the same
    # 5-round history under the three accountants
    steps = DEMO_STEPS_PER_ROUND * DEMO_ROUNDS
    sigma = get_noise_multiplier(target_epsilon=4.0, target_delta=D, sample_rate=DEMO_Q,
                                 steps=steps, accountant="rdp", epsilon_tolerance=0.01)
    events = [PrivacyEvent.dpsgd(r, sigma, DEMO_Q, DEMO_STEPS_PER_ROUND)
              for r in range(1, DEMO_ROUNDS + 1)]
    rdp = RDPAccountant()
    rdp.history = [(sigma, DEMO_Q, DEMO_STEPS_PER_ROUND)] * DEMO_ROUNDS
    prv = PRVAccountant()
    prv.history = [(sigma, DEMO_Q, DEMO_STEPS_PER_ROUND)] * DEMO_ROUNDS
    eps_rdp, eps_prv = rdp.get_epsilon(D), prv.get_epsilon(D)
    t0 = time.perf_counter()
    eps_pld, method = history_epsilon_detail(events, D, "pld")
    first = time.perf_counter() - t0
    assert method == "pld(interval=1e-4)"
    assert eps_pld == _pld([(_poisson_gaussian(DEMO_Q, sigma), steps)])  # bit-identical
    # the audit's figures: RDP 3.99, PRV 3.36, PLD 3.35
    assert eps_rdp == pytest.approx(3.99, abs=0.01)
    assert eps_prv == pytest.approx(3.36, abs=0.01)
    assert eps_pld == pytest.approx(3.35, abs=0.01)
    # Opacus' PRV returns the upper end of an estimate with eps_error 0.01: the true
    # epsilon is within 2 x 0.01 below it; the pessimistic PLD is >= the true epsilon and
    # (1e-4 grid) within ~1e-4 of it (measured: 0.0103 below PRV)
    assert eps_prv - 0.02 <= eps_pld <= eps_prv
    # "prv" is Opacus' PRV on the canonical history [(sigma, q, 265)] instead of 5 x 53
    # steps: its discretisation differs slightly (measured 2.5e-10)
    assert history_epsilon(events, D, "prv") == pytest.approx(eps_prv, rel=1e-9)
    # cached by signature: the second query (rounds reordered) is a dictionary lookup
    t0 = time.perf_counter()
    assert history_epsilon(list(reversed(events)), D, "pld") == eps_pld
    assert time.perf_counter() - t0 < 0.05 < first


def test_prv_refuses_client_level_histories():
    with pytest.raises(ValueError, match="accountant 'prv' is Opacus' DP-SGD accountant; "
                                         "use 'pld' or 'rdp' for client-level events"):
        history_epsilon([PrivacyEvent.gaussian(1, 1.0)], D, "prv")
    with pytest.raises(ValueError, match="accountant must be one of"):
        history_epsilon([PrivacyEvent.gaussian(1, 1.0)], D, "gdp")


def test_calibrate_dpsgd_noise_pld_is_the_smallest_sigma_meeting_the_target():
    steps = DEMO_STEPS_PER_ROUND * DEMO_ROUNDS
    sigma = calibrate_dpsgd_noise(4.0, D, DEMO_Q, steps, "pld")
    # reference: dp-accounting's PLDAccountant called here; bisection to rel_tol 1e-3
    assert _pld([(_poisson_gaussian(DEMO_Q, sigma), steps)]) <= 4.0
    assert _pld([(_poisson_gaussian(DEMO_Q, sigma * (1 - 1e-3)), steps)]) > 4.0
    rdp_sigma = get_noise_multiplier(target_epsilon=4.0, target_delta=D, sample_rate=DEMO_Q,
                                     steps=steps, accountant="rdp", epsilon_tolerance=0.01)
    assert sigma < 0.95 * rdp_sigma  # PLD needs ~6 % less noise here (0.756 vs 0.807)
    # a client that plans 5 rounds at this sigma never trips its own budget check
    history = PrivacyHistory([PrivacyEvent.dpsgd(r, sigma, DEMO_Q, DEMO_STEPS_PER_ROUND)
                              for r in range(1, DEMO_ROUNDS)])
    refuse, eps = history.would_exceed(
        PrivacyEvent.dpsgd(DEMO_ROUNDS, sigma, DEMO_Q, DEMO_STEPS_PER_ROUND), 4.0, D, "pld")
    assert not refuse and eps <= 4.0


def test_calibrate_noise_pld_client_level():
    # reference: dp-accounting's PLDAccountant called here; bisection to rel_tol 1e-4
    sigma = calibrate_noise(4.0, D, 50, accountant="pld")
    assert _pld([(dp_event.GaussianDpEvent(sigma), 50)]) <= 4.0
    assert _pld([(dp_event.GaussianDpEvent(sigma * (1 - 1e-4)), 50)]) > 4.0
    # the true epsilon (closed form) meets the target too, and RDP needs more noise
    assert _composed_gaussian_exact(sigma, 50, D) <= 4.0
    assert sigma < calibrate_noise(4.0, D, 50)


def test_very_long_history_falls_back_to_rdp_and_stays_an_upper_bound(fresh_cache, caplog):
    # 100,000 Gaussian releases at sigma 0.3: the 1e-4 PLD grid would need ~84 GiB
    # (dp-accounting raised MemoryError); every grid is too large, so RDP is used
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="flwr.dpfl.accounting"):
        eps, method = gaussian_epsilon_detail(0.3, 100_000, D, accountant="pld")
    assert time.perf_counter() - t0 < 5.0
    assert method == "rdp (pld fallback)"
    assert any("fell back to rdp" in r.getMessage() for r in caplog.records)
    # reference 1: dp-accounting's RdpAccountant called here (the same fallback value)
    acc = RdpAccountant()
    acc.compose(dp_event.GaussianDpEvent(0.3), 100_000)
    assert eps == acc.get_epsilon(D)
    # reference 2: the exact epsilon (560,050.1): the fallback is an upper bound, 9 % above
    exact = _composed_gaussian_exact(0.3, 100_000, D)
    assert exact <= eps <= 1.1 * exact
    assert gaussian_epsilon(0.3, 100_000, D, accountant="pld") == eps  # the float API


def test_coarser_grid_fallback_is_still_an_upper_bound(fresh_cache, caplog, monkeypatch):
    # 10 releases at sigma 1: the 1e-4 grid is computable, so it is the reference; forbid
    # it (as if it were too large) and the accountant must use the 1e-3 grid
    fine = _pld([(dp_event.GaussianDpEvent(1.0), 10)])
    exact = _composed_gaussian_exact(1.0, 10, D)
    real_once = A._pld_once

    def no_fine_grid(items, relation, delta, interval):
        if interval < 1e-3:
            raise MemoryError("pretend the 1e-4 grid does not fit")
        return real_once(items, relation, delta, interval)

    monkeypatch.setattr(A, "_pld_once", no_fine_grid)
    with caplog.at_level(logging.WARNING, logger="flwr.dpfl.accounting"):
        eps, method = gaussian_epsilon_detail(1.0, 10, D, accountant="pld")
    assert method == "pld(interval=1e-3)"
    assert any("MemoryError" in r.getMessage() for r in caplog.records)
    assert eps == _pld([(dp_event.GaussianDpEvent(1.0), 10)], interval=1e-3)  # dp-accounting
    # valid: above the exact value and above the fine-grid PLD (measured: 2.8e-7 above
    # exact, fine grid 1.4e-9 above exact)
    assert exact <= fine <= eps <= exact + 1e-3


def test_sample_level_fallback_to_rdp_when_no_grid_fits(fresh_cache, monkeypatch, caplog):
    monkeypatch.setattr(A, "PLD_MAX_POINTS", 0)
    events = [PrivacyEvent.dpsgd(r, 1.0, 0.02, 100) for r in (1, 2, 3)]
    with caplog.at_level(logging.WARNING, logger="flwr.dpfl.accounting"):
        eps, method = history_epsilon_detail(events, D, "pld")
    assert method == "rdp (pld fallback)"
    assert any("grid points" in r.getMessage() for r in caplog.records)
    acc = RdpAccountant()  # dp-accounting's RDP of the same Poisson-subsampled steps
    acc.compose(_poisson_gaussian(0.02, 1.0), 300)
    assert eps == acc.get_epsilon(D)
    monkeypatch.undo()
    A._pld_compute.cache_clear()
    assert eps >= history_epsilon(events, D, "pld")  # RDP is looser than the PLD


def test_size_estimate_covers_the_grids_dp_accounting_builds():
    # the estimate must not be below the grid dp-accounting actually builds (else the
    # cap would not protect memory): compare with the composed PLD's real support
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    for sigma, q, n in ((0.8, 1 / 53, 265), (0.5, 0.01, 1000), (2.0, 0.1, 100),
                        (1.0, 0.001, 20000)):
        interval = 1e-3
        pld = pld_lib.from_gaussian_mechanism(sigma, value_discretization_interval=interval,
                                              sampling_prob=q).self_compose(n)
        size = max(pld._pmf_remove.size, pld._pmf_add.size)
        items = A._canonical([(_poisson_gaussian(q, sigma), n)])
        tail = A._rdp_epsilon(items, A.NeighborRel.ADD_OR_REMOVE_ONE, 1e-15,
                              A._PLD_SIZE_ORDERS)
        assert A._pld_points(tail, interval) >= size


def test_events_epsilon_detail_and_rdp_method():
    acc = RdpAccountant()
    acc.compose(dp_event.GaussianDpEvent(2.0), 7)
    assert events_epsilon_detail([(dp_event.GaussianDpEvent(2.0), 7)], D) == (
        acc.get_epsilon(D), "rdp")
    assert events_epsilon_detail([], D, "pld") == (0.0, "pld")
    with pytest.raises(ValueError, match="accountant must be one of"):
        events_epsilon_detail([(dp_event.GaussianDpEvent(2.0), 7)], D, "prv")


def test_ledger_with_pld_accounts_sample_level_histories():
    ledger = Ledger(D, "pld")
    for r in (1, 2):
        event = PrivacyEvent.dpsgd(r, 1.0, 0.02, 40)
        reported = _pld([(_poisson_gaussian(0.02, 1.0), 40 * r)])  # dp-accounting directly
        eps = ledger.record("client-0", r, [event], reported)
        assert eps == reported
    assert ledger.mismatches == []
    assert ledger.epsilons() == {"client-0": reported}
    assert histories_epsilon({"client-0": ledger.clients["client-0"].events}, D, "pld") == {
        "client-0": reported}


def test_gaussians_of_different_sigmas_compose_exactly_into_one():
    # client-level history with a different sigma each round (AADP's per-round epsilons):
    # exactly one Gaussian of multiplier (sum 1/sigma_i^2)^(-1/2), so one PLD
    sigmas = [2.0, 3.5, 5.0, 8.0, 13.0]
    events = [PrivacyEvent.gaussian(r, s) for r, s in enumerate(sigmas, start=1)]
    eps, method = history_epsilon_detail(events, D, "pld")
    assert method == "pld(interval=1e-4)"
    # reference 1, closed form: mu^2 = sum 1/sigma_i^2, i.e. one release at 1/mu
    mu = math.sqrt(sum(s ** -2 for s in sigmas))
    exact = _composed_gaussian_exact(1 / mu, 1, D)
    assert exact - 1e-12 <= eps <= exact + 5e-8  # pessimistic grid: measured 8.3e-9 above
    # reference 2, dp-accounting composing the five PLDs one by one (five discretisations,
    # so a little looser: measured 3.3e-8 above exact, 2.5e-8 above the merged value)
    separate = _pld([(dp_event.GaussianDpEvent(s), 1) for s in sigmas])
    assert exact - 1e-12 <= separate and abs(separate - eps) <= 1e-7


@pytest.mark.parametrize("relation", [A.NeighborRel.ADD_OR_REMOVE_ONE, A.NeighborRel.REPLACE_ONE])
def test_kept_sampled_gaussian_grids_give_dp_accountings_numbers_exactly(relation):
    """A central run composes the same Poisson-sampled Gaussian once more every round;
    dpfl keeps its PLD grid instead of rebuilding it. The epsilon must be PLDAccountant's
    to the last bit (same constructions, same order), before and after the grid is kept,
    and for a history the kept route does not handle (Laplace: the accountant's own)."""
    sampled = dp_event.PoissonSampledDpEvent(0.2, dp_event.GaussianDpEvent(1.1))
    histories = [
        [(sampled, 40), (dp_event.GaussianDpEvent(6.0), 40)],
        [(sampled, 41), (dp_event.PoissonSampledDpEvent(0.05, dp_event.GaussianDpEvent(1.6)), 9)],
    ]
    if relation == A.NeighborRel.ADD_OR_REMOVE_ONE:
        histories.append([(sampled, 5), (dp_event.LaplaceDpEvent(2.0), 3)])
    A._sampled_gaussian_pld.cache_clear()
    for items in histories:
        acc = PLDAccountant(neighboring_relation=relation, value_discretization_interval=1e-3)
        for event, count in A._merge_gaussians(items):
            acc.compose(event, count)
        expected = acc.get_epsilon(1e-5)
        assert A._pld_once(items, relation, 1e-5, 1e-3) == expected
        assert A._pld_once(items, relation, 1e-5, 1e-3) == expected
    assert A._sampled_gaussian_pld.cache_info().hits >= 2
