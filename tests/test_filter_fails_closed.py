"""The Rényi filter fails closed (issue: a filter that admits everything at a small budget).

At a budget whose curve B(alpha) is <= 0 at every order of the unit's accountant no order
can hold any costly event; the filter used to read "no usable order" as "the history costs
nothing" and admitted every event at epsilon 0. The references here are the libraries'
own conversions (dp-accounting's ``compute_epsilon``, Opacus' ``get_privacy_spent``) and
the budget curve typed in by hand (Balle et al. 2020, Thm 21)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

from dpfl.cli import main
from dpfl.config import ConfigError
from dpfl.methods import parse_run_config
from dpfl.privacy.accounting.accountants import MECHANISMS
from dpfl.privacy.accounting.budget import PrivacyHistory
from dpfl.privacy.accounting.events import PrivacyEvent, history_rdp, orders_for
from dpfl.privacy.accounting.filter import RenyiFilter, holds_anything

D = 1e-5

# one costly event of every mechanism a client- or sample-level history may hold
EVENTS = {
    "dpsgd": PrivacyEvent.dpsgd(1, 4.0454, 1.0, 3),
    "gaussian": PrivacyEvent.gaussian(1, 4.0, relation="replace-one"),
    "quantile-count": PrivacyEvent.gaussian(1, 20.0, rate=0.1, mechanism="quantile-count"),
    "laplace": PrivacyEvent.pure(1, 0.05),
    "sparse-vector": PrivacyEvent.pure(1, 0.05, mechanism="sparse-vector"),
    "skellam": PrivacyEvent(1, "skellam", sigma=4.0, epsilon=1e-4, relation="replace-one"),
    "ddgauss": PrivacyEvent(1, "ddgauss", sigma=4.0, epsilon=1e-4, relation="replace-one"),
    "binomial": PrivacyEvent(1, "binomial", sigma=4.0, epsilon=1e-4, relation="replace-one"),
}


def _hand_budget(eps: float, orders: np.ndarray) -> np.ndarray:
    return eps + (math.log(D) + np.log(orders)) / (orders - 1) - np.log((orders - 1) / orders)


def _library_epsilon(event: PrivacyEvent) -> float:
    """The event's (epsilon, D) by its library's own RDP conversion."""
    rdp = history_rdp([event])
    if event.unit == "sample":
        from opacus.accountants.analysis.rdp import get_privacy_spent

        return float(get_privacy_spent(orders=list(orders_for("sample")), rdp=list(rdp),
                                       delta=D)[0])
    return float(compute_epsilon(orders_for("client"), rdp, D)[0])


def test_every_mechanism_is_listed():
    assert set(EVENTS) == set(MECHANISMS)


@pytest.mark.parametrize("name", sorted(EVENTS))
@pytest.mark.parametrize("budget", [1e-300, 1e-9, 1e-4, 3e-3, 0.02, 0.06, 0.1, 0.2, 0.5])
def test_tiny_budgets_never_admit_more_than_they_hold(name, budget):
    event = EVENTS[name]
    unit = event.unit
    filt = RenyiFilter(budget, D, unit)
    usable = _hand_budget(budget, orders_for(unit))[orders_for(unit) > 1.01] > 0
    assert holds_anything(budget, D, unit) == bool(np.any(usable))
    admitted, eps = filt.admits([event]), filt.epsilon_of([event])
    if not np.any(usable):
        # no order can hold anything: refused, at an infinite filter epsilon
        assert not admitted and eps == math.inf
        assert filt.would_exceed([], event)
        assert PrivacyHistory(adaptive=True).would_exceed(event, budget, D)[0]
    if admitted:
        # what the filter admits is within the budget by the library's own conversion
        assert _library_epsilon(event) <= budget * (1 + 1e-9)
        assert 0 < eps <= budget * (1 + 1e-9)


def test_the_reported_case_is_refused_by_the_filter():
    """AADP-FL over DP-SGD at target-epsilon 0.1: three rounds at sigma 4.0454, q = 1
    (PLD epsilon 1.68) were admitted at epsilon 0 under verdict formal."""
    rounds = [PrivacyEvent.dpsgd(r, 4.0454, 1.0, 1) for r in (1, 2, 3)]
    assert not holds_anything(0.1, D, "sample")
    history = PrivacyHistory(adaptive=True)
    assert history.would_exceed(rounds[0], 0.1, D) == (True, math.inf)
    assert not RenyiFilter(0.1, D, "sample").admits(rounds)
    # the cost-free history stays admitted at 0 (nothing to hold)
    assert RenyiFilter(0.1, D, "sample").admits([]) and \
        RenyiFilter(0.1, D, "sample").epsilon_of([]) == 0.0


def test_the_smallest_holdable_target_matches_the_hand_curve():
    """At delta 1e-5 the boundary is ~0.103 for Opacus' orders (max 63) and ~0.0035 for
    dp-accounting's (max 256 beyond 63)."""
    for unit, edge in (("sample", 0.103), ("client", 0.0035)):
        orders = orders_for(unit)
        ok = orders > 1.01
        # the smallest epsilon with max_alpha B(alpha) > 0, from the hand curve
        smallest = float(np.min(-(_hand_budget(0.0, orders[ok]))))
        assert smallest == pytest.approx(edge, rel=0.05)
        assert not holds_anything(smallest * 0.999, D, unit)
        assert holds_anything(smallest * 1.001, D, unit)


def _raw(**keys) -> dict:
    return {"strategy": "aadp", "num-rounds": 3, **keys}


def test_an_adaptive_run_whose_target_holds_nothing_stops_at_start(tmp_path, capsys):
    with pytest.raises(ConfigError, match="target-epsilon.*holds no sample-level event"):
        parse_run_config(_raw(**{"trainer": "dpsgd", "target-epsilon": 0.1}))
    with pytest.raises(ConfigError, match="target-epsilon.*holds no client-level event"):
        parse_run_config(_raw(**{"trainer": "update-dp", "target-epsilon": 0.003}))
    # just above the edges the run is accepted
    parse_run_config(_raw(**{"trainer": "dpsgd", "target-epsilon": 0.11}))
    parse_run_config(_raw(**{"trainer": "update-dp", "target-epsilon": 0.004}))
    # through the command line: one line, exit 2, nothing written
    assert main(["simulate", "--clients", "2", "--output-dir", str(tmp_path),
                 "strategy=aadp", "trainer=dpsgd", "num-rounds=3", "train-subset=200",
                 "target-epsilon=0.1", "aadp-epsilon=1.0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "target-epsilon" in err[0], err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("discrete", ["skellam", "ddgauss", "binomial"])
def test_a_pld_history_mixing_sparse_vector_and_integer_noise_composes(discrete):
    """Sparse-vector (pure) events beside binomial, DDGauss or Skellam ones under
    accountant=pld raised "no dp-accounting event"; neither has a PLD event, so the history
    takes the RDP bound, or basic composition of the pure part (both valid, the smaller)."""
    from dpfl.privacy.accounting.events import history_epsilon_detail

    svt = PrivacyEvent.pure(1, 0.3, mechanism="sparse-vector", steps=2)
    noise = EVENTS[discrete]
    eps, method = history_epsilon_detail([svt, noise], D, "pld")
    # by hand: RDP curves add (the sparse vector's via Bun & Steinke's min(eps, a eps^2/2));
    # dp-accounting's conversion of the sum, vs 2 x 0.3 plus the integer noise alone
    orders = orders_for("client")
    svt_curve = 2 * np.minimum(0.3, orders * 0.3 ** 2 / 2)
    rdp_route = float(compute_epsilon(orders, svt_curve + history_rdp([noise]), D)[0])
    basic = 0.6 + float(compute_epsilon(orders, history_rdp([noise]), D)[0])
    assert eps == pytest.approx(min(rdp_route, basic), rel=1e-12)
    assert method.startswith("rdp")
