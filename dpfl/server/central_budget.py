"""trust=central: the server keeps every client's budget. Before each round it asks whether
that round's release would take the clients (all charged alike) past ``target-epsilon``.

Asked naively, every round composes the whole history again before it starts: one PLD
self-composition, ~0.13 s of the server's time while every worker waits (measured here at
1,000 clients, q = 0.1). The answer for the whole plan is computed once instead: the
history spent so far plus every remaining round's release as planned. When the plan fits
the budget, a round whose history (spent plus its own release) is a sub-composition of the
plan fits too — composition never lowers epsilon (a sub-composition is a post-processing of
the whole) — and it is answered without the accountant. A history the plan does not cover
(e.g. a release at another sigma than planned), or a plan that does not fit, is composed in
full as before.

The ledger still writes every client's epsilon after each round's charges, which is that
same composition, computed in a background thread before the ledger asks (the accountant's
caches then hold it; :meth:`CentralBudget.settle` waits for it first, so it is never
computed twice at once). The next round's is started when a round's replies are in
(:meth:`CentralBudget.prefetch_next`): it then runs while the server aggregates, saves and
evaluates, with a core the clients leave idle, not while they train (0.12 s of CPU a round
here, that took a core from the clients).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

from dpfl.privacy.accounting.budget import BUDGET_RTOL, PrivacyHistory
from dpfl.privacy.accounting.events import PrivacyEvent, Signature, history_signature

RoundEvents = Callable[[int], list[PrivacyEvent]]

log = logging.getLogger("flwr.dpfl.accounting")

# one thread composes the next ledger's epsilon while a round trains
_PREFETCH = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpfl-epsilon")


def signature_covers(plan: Signature, signature: Signature) -> bool:
    """True when every event of ``signature`` occurs in ``plan`` at least as often: the
    history is a sub-composition of the plan, so its epsilon is at most the plan's."""
    counts = dict(plan)
    return all(counts.get(key, 0) >= steps for key, steps in signature)


class CentralBudget:
    """The budget check of trust=central, with the plan's answer kept (module docstring)."""

    def __init__(self, round_events: RoundEvents, num_rounds: int, target: float,
                 delta: float, accountant: str) -> None:
        self.round_events = round_events
        self.num_rounds = num_rounds
        self.target = target
        self.delta = delta
        self.accountant = accountant
        self.plan: Signature | None = None   # the planned run's signature; None: not asked yet
        self.plan_fits = False
        self._pending: dict[int, Future[float]] = {}   # round -> its epsilon, composing

    def epsilon(self, events: Sequence[PrivacyEvent]) -> float:
        return PrivacyHistory(list(events)).epsilon(self.delta, self.accountant)

    def over(self, eps: float) -> bool:
        return eps > self.target * (1.0 + BUDGET_RTOL)

    def _plan(self, spent: Sequence[PrivacyEvent], rnd: int) -> None:
        planned = list(spent) + [e for r in range(rnd, self.num_rounds + 1)
                                 for e in self.round_events(r)]
        self.plan = history_signature(planned)
        self.plan_fits = not self.over(self.epsilon(planned))

    def round_epsilon(self, spent: Sequence[PrivacyEvent], rnd: int) -> float | None:
        """Epsilon after round ``rnd``'s release on top of ``spent``; None when the fitting
        plan covers it (then it is within the budget)."""
        if self.plan is None:
            self._plan(spent, rnd)
        after = list(spent) + self.round_events(rnd)
        if self.plan_fits and signature_covers(self.plan or (), history_signature(after)):
            return None
        return self.epsilon(after)

    def spent_by(self, spent: Sequence[PrivacyEvent], rnd: int) -> bool:
        """True when round ``rnd``'s release would take a client whose history is ``spent``
        past the budget."""
        eps = self.round_epsilon(spent, rnd)
        return eps is not None and self.over(eps)

    def prefetch(self, spent: Sequence[PrivacyEvent], rnd: int) -> None:
        """Start composing the history after round ``rnd``'s release (what the ledger will
        ask once the round is charged) in the background, unless it already is."""
        if rnd not in self._pending:
            self._pending[rnd] = _PREFETCH.submit(self.epsilon,
                                                  list(spent) + self.round_events(rnd))

    def prefetch_next(self, spent: Sequence[PrivacyEvent], rnd: int) -> None:
        """Once round ``rnd``'s replies are in (``spent``: the history before its release):
        start composing the history after round ``rnd + 1``, as planned, if there is one."""
        if rnd < self.num_rounds:
            self.prefetch(list(spent) + self.round_events(rnd), rnd + 1)

    def settle(self, rnd: int | None = None) -> None:
        """Wait for the composition prefetched for round ``rnd`` (None: every one). A
        failure is only logged here: the ledger's own call computes again and raises it
        where it matters."""
        rounds = list(self._pending) if rnd is None else [rnd]
        for r in rounds:
            pending = self._pending.pop(r, None)
            if pending is None:
                continue
            try:
                pending.result()
            except Exception as exc:  # noqa: BLE001 - the ledger's own call decides
                log.debug("epsilon prefetch failed: %s", exc)

