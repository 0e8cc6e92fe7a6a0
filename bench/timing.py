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
