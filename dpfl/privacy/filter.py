"""A Rényi privacy filter for adaptive composition.

When a round's privacy parameters are chosen from earlier outputs (AADP-FL raises epsilon
when training looks converged; adaptive clipping changes C), summing the planned rounds is
not valid. A filter is: keep composing while the running RDP curve stays under the budget
curve B(alpha) for at least one order alpha, and stop before the event that would put it
over at every order (Feldman & Zrnic 2021 for one order; Lécuyer 2021, "Practical privacy
filters and odometers with Rényi DP", for the multi-order filter used here).

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

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dpfl.privacy.events import PrivacyEvent, history_rdp, history_unit, orders_for

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


@dataclass(frozen=True)
class RenyiFilter:
    """An (epsilon, delta) Rényi filter on the RDP orders of a unit's accountant."""

    epsilon: float
    delta: float
    unit: str = "sample"

    def budget_curve(self) -> np.ndarray:
        return budget_curve(self.epsilon, self.delta, orders_for(self.unit))

    def admits(self, rdp: np.ndarray) -> bool:
        """True while some order's running RDP is within that order's budget."""
        budget = self.budget_curve()
        usable = budget > 0
        return bool(np.any(rdp[usable] <= budget[usable]))

    def _epsilon_of_rdp(self, rdp: np.ndarray) -> float:
        """The epsilon the filter measures an RDP curve by: min over its orders of the RDP ->
        (epsilon, delta) conversion above. ``admits`` holds exactly when this is <= the
        filter's epsilon; it is the figure to quote when the filter refuses (the ledger's
        PLD epsilon of the same history can be lower)."""
        offset = budget_curve(0.0, self.delta, orders_for(self.unit))   # B(alpha) - epsilon
        usable = np.isfinite(offset)
        return float(np.min(rdp[usable] - offset[usable]))

    def would_exceed(self, events: Sequence[PrivacyEvent], new: PrivacyEvent) -> bool:
        """Would composing ``new`` after ``events`` leave the filter's budget?"""
        return self.decide(events, new)[0]

    def decide(self, events: Sequence[PrivacyEvent], new: PrivacyEvent) -> tuple[bool, float]:
        """(:meth:`would_exceed`, the filter's epsilon of the history with ``new``) from one
        RDP computation of that history."""
        history = list(events) + [new]
        if history_unit(history) != self.unit:
            raise ValueError(f"this filter accounts {self.unit}-level events")
        rdp = history_rdp(history)
        return not self.admits(rdp), self._epsilon_of_rdp(rdp)
