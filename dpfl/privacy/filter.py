"""A Rényi privacy filter for adaptive composition.

When a round's privacy parameters are chosen from earlier outputs (AADP-FL raises epsilon
when training looks converged; adaptive clipping changes C), summing the planned rounds is
not valid. A filter is: keep composing while the running RDP curve stays under the budget
curve B(alpha) = epsilon - log(1/delta) / (alpha - 1) for at least one order alpha, and stop
before the event that would put it over at every order. The whole interaction is then
(epsilon, delta)-DP (Feldman & Zrnic 2021 for one order; Lécuyer 2021, "Practical privacy
filters and odometers with Rényi DP", for the multi-order filter used here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dpfl.privacy.events import PrivacyEvent, history_rdp, history_unit, orders_for


@dataclass(frozen=True)
class RenyiFilter:
    """An (epsilon, delta) Rényi filter on the RDP orders of a unit's accountant."""

    epsilon: float
    delta: float
    unit: str = "sample"

    def budget_curve(self) -> np.ndarray:
        orders = orders_for(self.unit)
        return self.epsilon - math.log(1.0 / self.delta) / (orders - 1.0)

    def admits(self, rdp: np.ndarray) -> bool:
        """True while some order's running RDP is within that order's budget."""
        budget = self.budget_curve()
        usable = budget > 0
        return bool(np.any(rdp[usable] <= budget[usable]))

    def would_exceed(self, events: Sequence[PrivacyEvent], new: PrivacyEvent) -> bool:
        """Would composing ``new`` after ``events`` leave the filter's budget?"""
        history = list(events) + [new]
        if history_unit(history) != self.unit:
            raise ValueError(f"this filter accounts {self.unit}-level events")
        return not self.admits(history_rdp(history))
