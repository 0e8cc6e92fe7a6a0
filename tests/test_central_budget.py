"""trust=central's budget check (dpfl.server.central_budget): the plan's answer is kept and
reused only for histories it covers; every answer equals the full composition's."""

from __future__ import annotations

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

from dpfl.privacy.accounting.events import PrivacyEvent, history_epsilon, history_signature
from dpfl.server.central_budget import CentralBudget, signature_covers

DELTA = 1e-5
SIGMA, Q, ROUNDS = 0.8, 0.1, 20


def round_events(rnd: int) -> list[PrivacyEvent]:
    return [PrivacyEvent.gaussian(rnd, SIGMA, Q)]


def dp_accounting_epsilon(rounds: int) -> float:
    """The independent reference: dp-accounting's PLD accountant, Poisson-sampled Gaussian."""
    acc = pld_privacy_accountant.PLDAccountant()
    acc.compose(dp_event.PoissonSampledDpEvent(Q, dp_event.GaussianDpEvent(SIGMA)), rounds)
    return acc.get_epsilon(DELTA)


class Counting(CentralBudget):
    calls = 0

    def epsilon(self, events):  # type: ignore[no-untyped-def]
        Counting.calls += 1
        return super().epsilon(events)


def test_signature_covers_counts_each_event():
    plan = history_signature([PrivacyEvent.gaussian(r, 1.0, 0.1) for r in range(5)])
    assert signature_covers(plan, history_signature(
        [PrivacyEvent.gaussian(r, 1.0, 0.1) for r in range(5)]))
    assert not signature_covers(plan, history_signature(
        [PrivacyEvent.gaussian(r, 1.0, 0.1) for r in range(6)]))
    assert not signature_covers(plan, history_signature([PrivacyEvent.gaussian(0, 1.1, 0.1)]))
    assert signature_covers(plan, ())


def test_a_fitting_plan_answers_every_planned_round_with_one_composition():
    full = dp_accounting_epsilon(ROUNDS)
    budget = Counting(round_events, ROUNDS, full * 1.001, DELTA, "pld")
    Counting.calls = 0
    spent: list[PrivacyEvent] = []
    for rnd in range(1, ROUNDS + 1):
        assert not budget.spent_by(spent, rnd)
        spent += round_events(rnd)
    assert Counting.calls == 1       # the plan, composed once
    # one round past the plan is not covered: composed in full, and over the target
    assert budget.spent_by(spent, ROUNDS + 1)
    assert Counting.calls == 2


@pytest.mark.parametrize("stop_after", [1, 7])
def test_a_plan_over_the_budget_stops_where_the_full_composition_says(stop_after):
    # a target between the epsilons of stop_after and stop_after + 1 rounds
    target = (dp_accounting_epsilon(stop_after) + dp_accounting_epsilon(stop_after + 1)) / 2
    budget = CentralBudget(round_events, ROUNDS, target, DELTA, "pld")
    spent: list[PrivacyEvent] = []
    answers = []
    for rnd in range(1, ROUNDS + 1):
        answers.append(budget.spent_by(spent, rnd))
        naive = history_epsilon(spent + round_events(rnd), DELTA, "pld") > target * (1 + 1e-6)
        assert answers[-1] == naive
        spent += round_events(rnd)
    assert answers.index(True) == stop_after   # round stop_after + 1 is refused


def test_a_release_off_the_plan_is_composed_in_full():
    budget = Counting(round_events, ROUNDS, 100.0, DELTA, "pld")
    Counting.calls = 0
    assert not budget.spent_by([], 1)
    # a round released at a lower sigma than planned: not covered by the plan
    spent = [PrivacyEvent.gaussian(1, SIGMA / 2, Q)]
    eps = budget.round_epsilon(spent, 2)
    assert eps == pytest.approx(history_epsilon(spent + round_events(2), DELTA, "pld"))
    assert Counting.calls == 2


def test_the_prefetched_composition_is_what_the_ledger_then_reads():
    from dpfl.privacy.accounting import events as events_module

    budget = CentralBudget(round_events, ROUNDS, 100.0, DELTA, "pld")
    spent = [e for r in range(1, 4) for e in round_events(r)]
    budget.prefetch(spent, 4)
    budget.settle()
    before = events_module._signature_epsilon.cache_info()
    eps = history_epsilon(spent + round_events(4), DELTA, "pld")
    after = events_module._signature_epsilon.cache_info()
    assert (after.hits, after.misses) == (before.hits + 1, before.misses)
    assert eps == pytest.approx(dp_accounting_epsilon(4), rel=1e-9)
    budget.settle()   # nothing pending: returns at once


def test_the_next_rounds_composition_starts_when_a_rounds_replies_are_in():
    """prefetch_next (a round's replies in, its release not yet charged): the history after
    the next round, as planned, is composed in the background; settle(r) waits for round
    r's alone; nothing is started past the last round, nor twice for one round."""
    from dpfl.privacy.accounting import events as events_module

    budget = CentralBudget(round_events, ROUNDS, 100.0, DELTA, "pld")
    spent = [e for r in range(1, 3) for e in round_events(r)]   # rounds 1-2 charged
    budget.prefetch_next(spent, 3)    # round 3's replies are in: round 4 composes
    budget.prefetch(spent + round_events(3), 4)   # already started: not again
    assert list(budget._pending) == [4]
    budget.settle(3)                  # nothing for round 3: round 4's runs on
    assert list(budget._pending) == [4]
    budget.settle(4)
    assert not budget._pending
    before = events_module._signature_epsilon.cache_info()
    eps = history_epsilon(spent + round_events(3) + round_events(4), DELTA, "pld")
    after = events_module._signature_epsilon.cache_info()
    assert (after.hits, after.misses) == (before.hits + 1, before.misses)
    assert eps == pytest.approx(dp_accounting_epsilon(4), rel=1e-9)
    last = [e for r in range(1, ROUNDS) for e in round_events(r)]
    budget.prefetch_next(last, ROUNDS)   # no round after the last
    assert not budget._pending
