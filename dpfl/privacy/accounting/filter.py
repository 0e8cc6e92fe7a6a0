"""A Rényi privacy filter for adaptive composition.

When a round's privacy parameters are chosen from earlier outputs (AADP-FL raises epsilon
when training looks converged; adaptive clipping changes C), summing the planned rounds is
not valid. A filter is: keep composing while the running RDP at ONE order alpha*, fixed
before any adaptive choice, stays under the budget B(alpha*), and stop before the event
that would put it over (Feldman & Zrnic, "Individual Privacy Accounting via a Rényi
Filter", NeurIPS 2021, Thm 3.1: the adaptively composed interaction is then
(alpha*, B(alpha*))-RDP, which converts to (epsilon, delta)).

Why one order. An earlier version admitted a history while ANY order was within budget.
That is a valid conversion for a fixed history, but under adaptivity it is sound only when
every event's RDP is linear in the order (plain Gaussians): the standard multi-order
argument (Lécuyer 2021, "Practical privacy filters and odometers with Rényi DP") gives
(epsilon, |orders| delta) otherwise — subsampled Gaussians (DP-SGD), pure-epsilon events
and Skellam are not linear (``tests/test_privacy_core.py`` shows a mixed history the old
rule admitted at an order the new one refuses).

alpha* is chosen from public values only: the order at which repeating the history's FIRST
event (planned before any output exists) would take the most repetitions to reach the
budget, argmax B(alpha) / RDP_first(alpha). For a history of one repeated release this is
the order the libraries' minimum over orders picks at the budget's edge, so the filter
costs next to nothing there; for a history whose later events change shape, the budget
is held at alpha* regardless.

The budget curve is the RDP -> (epsilon, delta) conversion solved for the RDP value. We use
the conversion of Balle, Barthe, Gaboardi, Hsu & Sato 2020 ("Hypothesis testing
interpretations and Rényi differential privacy", AISTATS, Thm 21) / Canonne, Kamath &
Steinke 2020 (Prop. 12): an (alpha, rho)-RDP mechanism is (epsilon, delta)-DP with

    epsilon = rho + log((alpha - 1) / alpha) - (log delta + log alpha) / (alpha - 1),

exactly the formula of dp-accounting's ``rdp_privacy_accountant.compute_epsilon``
(``r + log1p(-1/a) - log(delta * a) / (a - 1)``, orders a > 1.01) and of Opacus'
``analysis.rdp.get_privacy_spent``. Hence

    B(alpha) = epsilon + (log delta + log alpha) / (alpha - 1) - log((alpha - 1) / alpha).

It is larger than Mironov's (2017) B(alpha) = epsilon - log(1/delta) / (alpha - 1) at
every order, so a filter at epsilon admits any history whose (non-adaptive) RDP epsilon
from those libraries is <= epsilon, e.g. one release calibrated to epsilon (Mironov's
curve refused it). Why the conversion may be swapped: the filter's guarantee is an RDP
bound on the adaptively composed interaction at the order(s) that stay within B (the
running RDP there never exceeds B); turning an RDP bound into (epsilon, delta) is a
statement about that bound alone, so any valid RDP -> DP conversion applies, and the
tighter one of Balle et al. is the one both libraries use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dpfl.privacy.accounting.events import PrivacyEvent, history_rdp, history_unit, orders_for

# dp-accounting's compute_epsilon only applies the conversion above for orders > 1.01
# (it is numerically unstable as alpha -> 1); the filter uses the same orders.
MIN_ORDER = 1.01


def budget_curve(epsilon: float, delta: float, orders: np.ndarray) -> np.ndarray:
    """B(alpha): the largest RDP at order alpha that still converts to (epsilon, delta)
    (Balle et al. 2020, Thm 21), -inf for orders <= 1.01."""
    orders = np.asarray(orders, dtype=float)
    out = np.full(orders.shape, -np.inf)
    a = orders[orders > MIN_ORDER]
    out[orders > MIN_ORDER] = epsilon - np.log1p(-1.0 / a) + np.log(delta * a) / (a - 1.0)
    return out


def holds_anything(epsilon: float, delta: float, unit: str) -> bool:
    """Can a filter at (epsilon, delta) admit ANY event of this unit? Only when its budget
    curve is positive at some order of the unit's accountant (else every costly event is
    refused: at delta 1e-5 a target below ~0.10 for DP-SGD, whose Opacus orders stop at
    63, and below ~0.0035 for client-level events)."""
    return bool(np.any(budget_curve(epsilon, delta, orders_for(unit)) > 0))


def filter_order(anchor: np.ndarray, budget: np.ndarray) -> int | None:
    """Index of alpha* = argmax B(alpha) / RDP_anchor(alpha) over the orders where the
    budget is positive (None when the anchor costs nothing at every such order)."""
    usable = (budget > 0) & (anchor > 0)
    if not np.any(usable):
        return None
    ratio = np.where(usable, budget / np.where(usable, anchor, 1.0), -np.inf)
    return int(np.argmax(ratio))


@dataclass(frozen=True)
class RenyiFilter:
    """An (epsilon, delta) Rényi filter at one order fixed in advance (see module)."""

    epsilon: float
    delta: float
    unit: str = "sample"

    def budget_curve(self) -> np.ndarray:
        return budget_curve(self.epsilon, self.delta, orders_for(self.unit))

    def order(self, events: Sequence[PrivacyEvent]) -> float | None:
        """alpha* of a history: fixed by its first event that costs anything (None: the
        history costs nothing, or no order can hold its first event: the filter refuses
        it, see :meth:`admits`)."""
        index = self._anchor(events)[1]
        return None if index is None else float(orders_for(self.unit)[index])

    def _anchor(self, events: Sequence[PrivacyEvent]) -> tuple[bool, int | None]:
        """(does the history cost anything, the index of alpha*). A history that costs
        something but whose first costly event has no order with B(alpha) > 0 (the budget
        is too small for any RDP order of the unit's accountant) has no alpha*: (True,
        None), which the filter must REFUSE, never read as "costs nothing"."""
        budget = self.budget_curve()
        for e in events:
            anchor = history_rdp([e])
            if np.any(anchor > 0):
                return True, filter_order(anchor, budget)
        return False, None

    def admits(self, events: Sequence[PrivacyEvent]) -> bool:
        """True while the history's running RDP at its order alpha* is within B(alpha*)
        (fails closed: a costly history without a usable order is refused)."""
        return self._measure(events)[0]

    def epsilon_of(self, events: Sequence[PrivacyEvent]) -> float:
        """The epsilon the filter measures a history by: the RDP -> (epsilon, delta)
        conversion at alpha* (the figure to quote when the filter refuses; the ledger's
        PLD epsilon of the same history can be lower). 0 for a history that costs nothing,
        inf for one the filter cannot hold at any order."""
        return self._measure(events)[1]

    def _measure(self, events: Sequence[PrivacyEvent]) -> tuple[bool, float]:
        events = list(events)
        if not events:
            return True, 0.0
        if history_unit(events) != self.unit:
            raise ValueError(f"this filter accounts {self.unit}-level events")
        costly, index = self._anchor(events)
        if not costly:
            return True, 0.0
        if index is None:               # no usable order: fail closed
            return False, math.inf
        rdp = float(history_rdp(events)[index])
        budget = float(self.budget_curve()[index])
        offset = budget - self.epsilon      # B(alpha*) - epsilon: the conversion's offset
        return rdp <= budget, rdp - offset

    def would_exceed(self, events: Sequence[PrivacyEvent], new: PrivacyEvent) -> bool:
        """Would composing ``new`` after ``events`` leave the filter's budget?"""
        return self.decide(events, new)[0]

    def decide(self, events: Sequence[PrivacyEvent], new: PrivacyEvent) -> tuple[bool, float]:
        """(:meth:`would_exceed`, the filter's epsilon of the history with ``new``)."""
        admitted, eps = self._measure(list(events) + [new])
        return not admitted, eps
