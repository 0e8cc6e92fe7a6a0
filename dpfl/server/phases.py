"""Wall time of a round's phases, for the round record (``phase-seconds``).

A round is select -> exchange (instructions out, replies in: Flower's transport and the
clients' training) -> aggregate (validation, the strategy, charges) -> ledger (the durable
save) -> evaluate -> accounting (every client's epsilon). ``bench/scale.py`` separates
Flower's share of a round from the training compute and dpfl's own server work with it.
"""

from __future__ import annotations

import time


class PhaseClock:
    """Laps of one round: ``lap(name)`` records the seconds since the previous lap."""

    def __init__(self) -> None:
        self.start = time.time()
        self._last = time.perf_counter()
        self._first = self._last
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> float:
        now = time.perf_counter()
        seconds = round(now - self._last, 4)
        self.laps[name] = round(self.laps.get(name, 0.0) + seconds, 4)
        self._last = now
        return seconds

    def total(self) -> float:
        """Seconds since the clock started."""
        return time.perf_counter() - self._first
