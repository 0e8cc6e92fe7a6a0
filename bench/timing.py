"""Shared timing helper for the benchmarks (run as `python bench/<name>.py`)."""

from __future__ import annotations

import time
from typing import Callable


def best_time(fn: Callable[[], object], repeats: int = 5) -> float:
    """Best wall time in seconds of ``repeats`` calls, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def best_times(arms: dict[str, Callable[[], object]], repeats: int = 7) -> dict[str, float]:
    """Best wall time in seconds of each arm over ``repeats`` rounds that call every arm
    once in turn (after one warm-up call each): on a shared machine, load that comes and
    goes hits every arm alike, so ratios between arms are stable where separate best-of-N
    runs are not."""
    for fn in arms.values():
        fn()
    best = {name: float("inf") for name in arms}
    for _ in range(repeats):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best
