"""Calibrated noise multipliers kept in dpfl's memo on disk (:mod:`dpfl.memo`).

Calibrating sigma to a target epsilon with the PLD accountant is a bisection of a dozen or
more PLD evaluations: seconds of CPU. Every process of a federation repeats it — the
launcher's check, the ServerApp's plan, every simulated client, and under Flower's
subprocess isolation a fresh ClientApp process on every node in every round — and so does
every run of the same configuration. The memo keeps each answer once per machine.

A hit is never trusted for privacy: :func:`dpfl.privacy.accounting._calibrate_pld` checks
eps(sigma) <= target with the accounting function itself before it returns a kept sigma,
and calibrates afresh if the check fails. A damaged, foreign or edited entry can therefore
at worst cost utility (a sigma larger than the smallest one), never privacy. The key
(built by the caller) holds the question and the versions of the code that answers it.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Callable

from dpfl import memo

log = logging.getLogger("flwr.dpfl.accounting")

KIND = "calibration"
SUFFIX = ".json"


def lookup(key: str) -> float | None:
    """The sigma kept for ``key`` (None: no memo, no entry, or an unreadable one)."""
    data = memo.read(KIND, key, SUFFIX)
    if data is None:
        return None
    try:
        entry = json.loads(data)
        if entry["key"] != key:
            return None
        sigma = float.fromhex(entry["sigma"])
    except (ValueError, KeyError, TypeError) as exc:
        log.debug("calibration memo entry unreadable (%s): calibrating afresh", exc)
        return None
    return sigma if sigma > 0 and math.isfinite(sigma) else None


def store(key: str, sigma: float) -> None:
    """Keep ``sigma`` for ``key``."""
    memo.write(KIND, key, json.dumps({"key": key, "sigma": float(sigma).hex()}).encode(),
               SUFFIX)


def memoised(key: str, epsilon: Callable[[float], float], target: float,
             search: Callable[[], float]) -> float:
    """The sigma kept for ``key`` if ``epsilon`` confirms it meets ``target``; else
    ``search()``'s answer, kept for ``key`` (a kept sigma above the target is logged and
    calibrated afresh)."""
    cached = lookup(key)
    if cached is not None:
        if epsilon(cached) <= target:
            return cached
        log.warning("calibration memo gave sigma %.6g above the target epsilon %.6g: "
                    "calibrating afresh", cached, target)
    sigma = search()
    store(key, sigma)
    return sigma
