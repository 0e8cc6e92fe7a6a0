"""The one-run privacy audit of Steinke, Nasr & Jagielski, "Privacy Auditing with One (1)
Training Run" (2023): the epsilon lower bound, its validity on mechanisms of known epsilon,
and the secret canary randomness.

References are independent of the code under test: scipy's binomial tail solved with
Brent's method, a literal loop over the theorem's delta term, a closed form for the
all-correct case, exact randomised-response probabilities, and dp-accounting's PLD
accountant for the Gaussian mechanism."""

from __future__ import annotations

import math
from itertools import pairwise

import dp_accounting
import numpy as np
import pytest
import scipy.optimize
import scipy.special
import scipy.stats
import torch
from dp_accounting.pld import PLDAccountant

from dpfl.privacy.audit.canaries import canary_bits, canary_direction, canary_score
from dpfl.privacy.audit.one_run import (
    AuditResult,
    audit_gaussian_mechanism,
    audit_scores,
    default_guess_counts,
    epsilon_lower_bound,
    gaussian_epsilon,
    guesses_from_scores,
    p_value,
)

DELTA = 1e-5


# --- the bound --------------------------------------------------------------------------

def _binomial_reference(r: int, v: int, confidence: float) -> float:
    """delta = 0: the epsilon where P[Binomial(r, e^eps / (1 + e^eps)) >= v] = 1 - conf."""
    def excess(e: float) -> float:
        return scipy.stats.binom.sf(v - 1, r, scipy.special.expit(e)) - (1 - confidence)

    return scipy.optimize.brentq(excess, 0.0, 50.0, xtol=1e-12)


def _theorem_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """The theorem's tail bound, term by term (a plain loop, no vectorisation)."""
    q = math.exp(eps) / (1 + math.exp(eps))
    tail = sum(math.comb(r, j) * q ** j * (1 - q) ** (r - j) for j in range(v, r + 1))
    alpha = 0.0
    for i in range(1, v + 1):
        mass = sum(math.comb(r, j) * q ** j * (1 - q) ** (r - j) for j in range(v - i, v))
        alpha = max(alpha, mass / i)
    return min(1.0, tail + 2 * m * delta * alpha)


@pytest.mark.parametrize("r, v", [(10, 0), (10, 5), (100, 50), (101, 50), (1000, 400)])
def test_bound_is_zero_without_evidence(r, v):
    assert epsilon_lower_bound(1000, r, v, DELTA) == 0.0
    assert epsilon_lower_bound(1000, r, v, 0.0) == 0.0


def test_bound_is_zero_without_guesses():
    assert epsilon_lower_bound(1000, 0, 0, DELTA) == 0.0
    assert epsilon_lower_bound(0, 0, 0, 0.0) == 0.0


@pytest.mark.parametrize("r, v, confidence", [(20, 18, 0.95), (100, 70, 0.95),
                                              (1000, 600, 0.95), (1000, 990, 0.99),
                                              (5000, 4000, 0.9), (200, 200, 0.95)])
def test_delta_zero_matches_binomial_tail(r, v, confidence):
    eps = epsilon_lower_bound(10_000, r, v, 0.0, confidence)
    assert eps > 0
    assert eps == pytest.approx(_binomial_reference(r, v, confidence), abs=1e-6)
    def tail(e: float) -> float:
        return scipy.stats.binom.sf(v - 1, r, scipy.special.expit(e))

    assert tail(eps) == pytest.approx(1 - confidence, rel=1e-4)
    assert tail(eps) < 1 - confidence <= tail(eps + 1e-6)  # rejected at eps, not beyond


def test_all_correct_closed_form():
    """r = v, delta = 0: q^r = 1 - confidence, so eps = logit((1 - confidence)^(1/r))."""
    for r in (10, 100, 1000):
        q = 0.05 ** (1 / r)
        assert epsilon_lower_bound(r, r, r, 0.0) == pytest.approx(math.log(q / (1 - q)),
                                                                  abs=1e-6)


@pytest.mark.parametrize("m, r, v, eps, delta", [(100, 40, 30, 0.7, 1e-3),
                                                 (50, 50, 45, 2.0, 1e-2),
                                                 (1000, 60, 60, 3.0, 1e-5),
                                                 (200, 30, 16, 0.1, 0.2)])
def test_p_value_matches_the_theorem_term_by_term(m, r, v, eps, delta):
    assert p_value(m, r, v, eps, delta) == pytest.approx(
        _theorem_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("m, r, v, delta", [(100, 40, 34, 1e-3), (1000, 60, 60, 1e-4),
                                             (1000, 300, 220, 1e-3)])
def test_delta_bound_is_the_crossing_of_the_theorem(m, r, v, delta):
    eps = epsilon_lower_bound(m, r, v, delta)
    assert 0 < eps < epsilon_lower_bound(m, r, v, 0.0)
    assert _theorem_p_value(m, r, v, eps, delta) < 0.05
    assert _theorem_p_value(m, r, v, eps + 1e-6, delta) >= 0.05


def test_delta_term_can_erase_the_bound():
    """2 m delta = 2: the delta term alone keeps the p-value above 5% at every epsilon."""
    assert epsilon_lower_bound(1000, 60, 60, 1e-3) == 0.0
    assert all(_theorem_p_value(1000, 60, 60, e, 1e-3) >= 0.05 for e in (0.5, 2, 4, 8))


def test_bound_is_monotone():
    """More correct guesses -> larger bound; larger delta, more canaries (the delta term
    is 2 m delta alpha) or higher confidence -> never larger."""
    for m, r in ((1000, 1000), (1000, 100), (10_000, 400)):
        bounds = [epsilon_lower_bound(m, r, v, DELTA) for v in range(r // 2, r + 1,
                                                                     max(1, r // 40))]
        assert all(b >= a for a, b in pairwise(bounds))
        assert bounds[0] == 0 and bounds[-1] > 2
        v = int(0.9 * r)
        by_delta = [epsilon_lower_bound(m, r, v, d) for d in (0, 1e-6, 1e-4, 1e-3, 1e-2)]
        assert all(b <= a + 1e-7 for a, b in pairwise(by_delta))
        assert by_delta[-1] < by_delta[0]
        by_m = [epsilon_lower_bound(mm, r, v, 1e-4) for mm in (m, 4 * m, 16 * m)]
        assert all(b <= a + 1e-7 for a, b in pairwise(by_m))
        by_conf = [epsilon_lower_bound(m, r, v, DELTA, c) for c in (0.5, 0.9, 0.95, 0.999)]
        assert all(b < a for a, b in pairwise(by_conf))


@pytest.mark.parametrize("eps_true, r", [(1.0, 200), (0.5, 500), (3.0, 100)])
def test_randomised_response_is_rejected_at_most_five_percent(eps_true, r):
    """An eps-DP randomised response on every canary: each guess right w.p.
    e^eps / (1 + e^eps), the theorem's extreme case. The exact probability that the bound
    exceeds eps_true is <= 1 - confidence, and not far below (the bound is tight here)."""
    q = scipy.special.expit(eps_true)
    exceed = sum(scipy.stats.binom.pmf(v, r, q) for v in range(r // 2, r + 1)
                 if epsilon_lower_bound(r, r, v, 0.0) > eps_true)
    assert 0.02 < exceed <= 0.05


def test_argument_checks():
    with pytest.raises(ValueError):
        epsilon_lower_bound(10, 11, 5, DELTA)
    with pytest.raises(ValueError):
        epsilon_lower_bound(10, 5, 6, DELTA)
    with pytest.raises(ValueError):
        epsilon_lower_bound(10, 5, 4, 1.5)
    with pytest.raises(ValueError):
        epsilon_lower_bound(10, 5, 4, DELTA, confidence=1.0)


# --- guesses and scores -----------------------------------------------------------------

def test_guesses_from_scores():
    scores = torch.tensor([0.3, -2.0, 5.0, 1.0, 0.0, 4.0])
    g = guesses_from_scores(scores, 2, 1)
    assert g.tolist() == [0, -1, 1, 0, 0, 1]
    assert guesses_from_scores(scores, 0, 0).abs().sum() == 0
    assert guesses_from_scores(scores, 3, 3).tolist() == [-1, -1, 1, 1, -1, 1]
    ties = guesses_from_scores(torch.zeros(4), 1, 1)  # ties: by index, deterministic
    assert ties.tolist() == [-1, 0, 0, 1]
    with pytest.raises(ValueError):
        guesses_from_scores(scores, 4, 3)


def test_default_guess_counts():
    assert default_guess_counts(1000) == ((500, 500), (250, 250), (100, 100), (50, 50),
                                          (20, 20), (10, 10))
    assert default_guess_counts(7) == ((3, 4), (1, 1))
    assert default_guess_counts(1) == ((0, 1),)


def test_audit_scores_bonferroni_and_best():
    m = 400
    bits = canary_bits(11, m)
    scores = bits.double() * 2.0 + torch.from_numpy(np.random.default_rng(3).normal(size=m))
    counts = [(200, 200), (50, 50), (10, 10)]
    result = audit_scores(scores, bits, DELTA, 0.95, counts)
    assert isinstance(result, AuditResult) and result.m == m and result.confidence == 0.95
    assert len(result.tried) == 3
    for (kp, km, r, v, eps), (a, b) in zip(result.tried, counts):
        g = guesses_from_scores(scores, kp, km)
        assert (kp, km, r) == (a, b, a + b)
        assert v == int(((g == 1) & bits).sum() + ((g == -1) & ~bits).sum())
        assert eps == epsilon_lower_bound(m, r, v, DELTA, 1 - 0.05 / 3)
    assert result.epsilon_lower == max(t[4] for t in result.tried) > 0
    best = next(t for t in result.tried if t[4] == result.epsilon_lower)
    assert (result.k_plus, result.k_minus, result.r, result.v) == best[:4]
    # one candidate: no correction
    single = audit_scores(scores, bits, DELTA, 0.95, [(50, 50)])
    assert single.epsilon_lower == epsilon_lower_bound(m, single.r, single.v, DELTA, 0.95)
    # scores that ignore the bits give (almost always) nothing
    blind = audit_scores(torch.from_numpy(np.random.default_rng(4).normal(size=m)), bits,
                         DELTA)
    assert blind.epsilon_lower < 0.5


# --- the Gaussian mechanism -------------------------------------------------------------

@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0, 4.0])
def test_gaussian_epsilon_matches_pld(sigma):
    accountant = PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.GaussianDpEvent(sigma))
    pld = accountant.get_epsilon(DELTA)
    exact = gaussian_epsilon(sigma, DELTA)
    assert exact <= pld + 1e-9  # the PLD accountant is pessimistic (an upper bound)
    assert pld == pytest.approx(exact, rel=1e-5)


def test_gaussian_epsilon_edges():
    assert gaussian_epsilon(0.0, DELTA) == math.inf
    assert gaussian_epsilon(1.0, 0.0) == math.inf
    tv = scipy.stats.norm.cdf(0.5) - scipy.stats.norm.cdf(-0.5)  # sigma = 1
    assert gaussian_epsilon(1.0, tv + 1e-9) == 0.0
    assert gaussian_epsilon(1.0, tv - 1e-3) > 0.0
    assert gaussian_epsilon(1.0, 1e-3) < gaussian_epsilon(1.0, 1e-6)


@pytest.mark.parametrize("sigma", [1.0, 2.0])
def test_gaussian_audit_stays_below_true_epsilon(sigma):
    true_eps = gaussian_epsilon(sigma, DELTA)
    bounds = [audit_gaussian_mechanism(sigma, 10_000, DELTA, seed).epsilon_lower
              for seed in range(5)]
    assert all(0 < b < true_eps for b in bounds), (bounds, true_eps)
    # in R^dim on an orthonormal frame (the vector form of the same mechanism)
    for seed in range(2):
        b = audit_gaussian_mechanism(sigma, 500, DELTA, seed, dim=800).epsilon_lower
        assert 0 <= b < true_eps


def test_gaussian_audit_large_m_is_reasonably_close():
    """sigma = 1, m = 10^5: observed bound 2.05 against eps = 4.377 (ratio 0.47): the
    (eps, delta) randomised-response tail is far from the Gaussian's at this epsilon, as
    in Steinke, Nasr & Jagielski 2023's idealised experiments."""
    true_eps = gaussian_epsilon(1.0, DELTA)
    result = audit_gaussian_mechanism(1.0, 100_000, DELTA, seed=0)
    ratio = result.epsilon_lower / true_eps
    assert 0.4 < ratio < 1.0, (result, true_eps)
    assert result.r < result.m  # abstention helps at this epsilon


@pytest.mark.parametrize("sigma", [0.0, 0.01])
def test_no_dp_gives_a_large_bound(sigma):
    """No noise at m = 1000: the bound (4.57) is close to the most any audit of 1000
    canaries can show at this confidence and delta, and exceeds the epsilon the run would
    claim with sigma = 1 (4.38): the audit catches a mechanism that forgot its noise."""
    result = audit_gaussian_mechanism(sigma, 1000, DELTA, seed=0)
    ceiling = epsilon_lower_bound(1000, 1000, 1000, DELTA, 1 - 0.05 / len(result.tried))
    assert 4.0 < result.epsilon_lower <= ceiling
    assert result.epsilon_lower > gaussian_epsilon(1.0, DELTA)
    assert result.v == result.r  # no wrong guess among the chosen ones


# --- canaries ---------------------------------------------------------------------------

def test_canary_bits_balanced_deterministic_and_seeded():
    m = 100_000
    for seed in (0, 1, 2**100 + 7):
        bits = canary_bits(seed, m)
        assert bits.dtype == torch.bool and bits.shape == (m,)
        assert scipy.stats.binomtest(int(bits.sum()), m, 0.5).pvalue > 1e-3
        assert torch.equal(bits, canary_bits(seed, m))
        assert torch.equal(bits[:100], canary_bits(seed, 100))
    a, b = canary_bits(0, 1000), canary_bits(1, 1000)
    assert 400 < int((a != b).sum()) < 600  # different seeds: independent-looking bits
    # domain separation: not the plain numpy or torch stream of the same seed
    plain = torch.from_numpy(np.random.default_rng(0).integers(0, 2, 1000).astype(bool))
    torch_plain = torch.randint(0, 2, (1000,), generator=torch.Generator().manual_seed(0))
    assert not torch.equal(a, plain) and not torch.equal(a, torch_plain.bool())
    # consecutive bits are not correlated
    x = canary_bits(5, m).double()
    assert abs(float(torch.corrcoef(torch.stack([x[:-1], x[1:]]))[0, 1])) < 0.02
    with pytest.raises(ValueError):
        canary_bits(-1, 10)


def test_canary_directions():
    dim = 10_000
    dirs = torch.stack([canary_direction(7, i, dim) for i in range(20)])
    assert dirs.dtype == torch.float32
    assert torch.allclose(dirs.double().norm(dim=1), torch.ones(20, dtype=torch.float64),
                          atol=1e-6)
    assert torch.equal(dirs[3], canary_direction(7, 3, dim))
    assert not torch.equal(dirs[3], canary_direction(8, 3, dim))
    gram = dirs.double() @ dirs.double().T - torch.eye(20, dtype=torch.float64)
    assert gram.abs().max() < 5 / math.sqrt(dim)  # nearly orthogonal
    # uniform on the sphere: (x_0 + 1) / 2 ~ Beta((d - 1) / 2, (d - 1) / 2)
    d = 5
    first = np.array([float(canary_direction(1, i, d)[0]) for i in range(2000)])
    assert scipy.stats.kstest((first + 1) / 2, scipy.stats.beta((d - 1) / 2,
                                                                (d - 1) / 2).cdf).pvalue > 1e-3


def test_canary_score():
    u = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    d = torch.tensor([0.5, -1.0, 0.25, 2.0])
    assert canary_score(u, d) == 0.5 - 2.0 + 0.75 + 8.0
    assert isinstance(canary_score(u, d), float)
    with pytest.raises(ValueError):
        canary_score(u, torch.ones(3))
