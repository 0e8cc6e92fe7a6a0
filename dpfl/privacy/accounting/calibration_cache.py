"""Calibrated noise multipliers kept in dpfl's memo on disk (:mod:`dpfl.memo`).

Calibrating sigma to a target epsilon with the PLD accountant is a bisection of a dozen or
more PLD evaluations: seconds of CPU. Every process of a federation repeats it — the
launcher's check, the ServerApp's plan, every simulated client, and under Flower's
subprocess isolation a fresh ClientApp process on every node in every round — and so does
every run of the same configuration. The memo keeps each answer once per machine.

A hit is never taken on trust. An entry claims to be the answer of a calibration: the
smallest sigma, to the calibration's relative ``tolerance``, whose epsilon meets the
target. :func:`memoised` checks both halves with the calibration's own accounting function,
two evaluations instead of a search: eps(sigma) <= target (privacy) and
eps(sigma (1 - tolerance)) > target (minimality: the search's own promise, so a sigma
planted larger than the answer, e.g. ten times it, is caught and not used). An entry that
fails, is unreadable or names another key is logged (one WARNING naming the memo file and
the key), discarded and calibrated afresh. Within one launch of ``dpfl simulate`` the check is
made once: the process that checks (or calibrates) an entry holds its lock meanwhile and
proves its answer, and the launch's other processes (the ServerApp, every ClientApp worker)
wait for it and take the proven answer (:func:`dpfl.memo.proven`) instead of repeating the
same evaluations. A fresh answer is kept only if its minimality
holds too (one more evaluation after the search; an accountant that is not monotone at that
point would otherwise fail every later read). The key (built by the caller) holds the question and the versions of the code that
answers it.
"""

from __future__ import annotations

import json
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from dpfl import memo

log = logging.getLogger("flwr.dpfl.accounting")

KIND = "calibration"
SUFFIX = ".json"


def _discard(key: str, why: str) -> None:
    """One WARNING naming the entry's file and key, and the entry removed."""
    log.warning("calibration memo entry %s (key %r) fails its check: %s; discarded, "
                "calibrating afresh", memo.entry_file(KIND, key, SUFFIX), key, why)
    memo.discard(KIND, key, SUFFIX)


def lookup(key: str) -> float | None:
    """The sigma kept for ``key`` (None: no memo or no entry; an unreadable entry, one of
    another key or one whose sigma is not a positive finite number is also discarded,
    with a WARNING)."""
    data = memo.read(KIND, key, SUFFIX)
    if data is None:
        return None
    try:
        entry = json.loads(data)
        if entry["key"] != key:
            _discard(key, f"it holds the answer for another key ({str(entry['key'])[:80]!r})")
            return None
        sigma = float.fromhex(entry["sigma"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        _discard(key, f"unreadable ({type(exc).__name__}: {exc})")
        return None
    if not (sigma > 0 and math.isfinite(sigma)):
        _discard(key, f"sigma {sigma!r} is not a positive finite number")
        return None
    return sigma


def store(key: str, sigma: float) -> None:
    """Keep ``sigma`` for ``key``."""
    memo.write(KIND, key, json.dumps({"key": key, "sigma": float(sigma).hex()}).encode(),
               SUFFIX)


def problem(sigma: float, epsilon: Callable[[float], float], target: float,
            tolerance: float, meets_target: bool = False) -> str | None:
    """Why ``sigma`` is not the calibration's answer (None: it is): eps(sigma) must meet
    ``target`` (not evaluated when ``meets_target``, a search's own answer) and
    eps(sigma (1 - ``tolerance``)) must not (at most two evaluations, run side by side: a
    PLD evaluation spends its time in FFTs that release the GIL, so a memo hit costs one
    evaluation's wall time where a second core is free)."""
    below = sigma * (1.0 - tolerance)
    if meets_target:
        eps, eps_below = None, epsilon(below)
    else:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpfl-memo-check") as pool:
            pending = pool.submit(epsilon, below)
            eps = epsilon(sigma)
            eps_below = pending.result()
    if eps is not None and not eps <= target:
        return (f"sigma {sigma:.6g} gives epsilon {eps:.6g}, above the target epsilon "
                f"{target:.6g}")
    if not eps_below > target:
        return (f"sigma {sigma:.6g} is not the smallest to the calibration's tolerance "
                f"{tolerance:.3g}: sigma x (1 - tolerance) = {below:.6g} already meets the "
                f"target epsilon {target:.6g} (epsilon {eps_below:.6g})")
    return None


def memoised(key: str, epsilon: Callable[[float], float], target: float,
             search: Callable[[], float], tolerance: float) -> float:
    """The sigma kept for ``key`` if ``epsilon`` confirms it is the calibration's answer
    (:func:`problem`: meets ``target``, and sigma (1 - ``tolerance``) does not, the promise
    of ``search``); else ``search()``'s answer, kept for ``key`` when it passes the same
    check. A kept sigma that fails is logged, discarded and calibrated afresh. Within a
    launch, one process at a time checks or calibrates ``key`` and proves its answer; the
    others take the proven answer without evaluating it again (:func:`dpfl.memo.checking`,
    :func:`dpfl.memo.proven`)."""
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be in (0, 1), got {tolerance}")
    with memo.checking(KIND, key):
        cached = lookup(key)
        if cached is not None:
            if memo.proven(KIND, key, _answer(cached)):
                return cached
            why = problem(cached, epsilon, target, tolerance)
            if why is None:
                memo.prove(KIND, key, _answer(cached))
                return cached
            _discard(key, why)
        sigma = search()
        why = problem(sigma, epsilon, target, tolerance, meets_target=True)
        if why is None:
            store(key, sigma)
            memo.prove(KIND, key, _answer(sigma))
        else:
            log.info("calibration answer not kept in the memo (%s)", why)
        return sigma


def _answer(sigma: float) -> bytes:
    """A sigma as its proof binds it: the exact float, in hex."""
    return float(sigma).hex().encode()
