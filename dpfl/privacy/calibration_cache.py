"""A memo of calibrated noise multipliers on disk, shared by every process of a machine.

Calibrating sigma to a target epsilon with the PLD accountant is a bisection of a dozen or
more PLD evaluations: seconds of CPU. Every process of a federation repeats it — the
ServerApp's plan, every simulated client, and under Flower's subprocess isolation a fresh
ClientApp process on every node in every round — and so does every run of the same
configuration. This memo keeps each answer once per machine.

A hit is never trusted for privacy: :func:`dpfl.privacy.accounting._calibrate_pld` checks
eps(sigma) <= target with the accounting function itself before it returns a cached sigma,
and calibrates afresh if the check fails. A damaged, foreign or tampered entry can
therefore at worst cost utility (a sigma larger than the smallest one), never privacy.

Where: ``$DPFL_CACHE_DIR`` (``off`` or empty: no memo), else ``$XDG_CACHE_HOME/dpfl``,
else ``~/.cache/dpfl``; entries live in ``calibration/<sha256>.json``. The key holds the
question (its composition as dp-accounting events at two probe sigmas, delta, target,
tolerance) and the answering code's version (dp-accounting's, and a digest of dpfl's
accounting module), so an upgrade or a change of the code misses instead of reusing an
answer it would not give. Writing is
best effort (atomic rename; a read-only or full disk only loses the memo).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger("flwr.dpfl.accounting")

CACHE_ENV = "DPFL_CACHE_DIR"
DISABLED = ("", "off")
SUBDIR = "calibration"


def cache_dir() -> Path | None:
    """The memo's folder, or None when ``$DPFL_CACHE_DIR`` turns it off."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return None if configured.strip().lower() in DISABLED else Path(configured) / SUBDIR
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dpfl" / SUBDIR


def _path(folder: Path, key: str) -> Path:
    return folder / f"{hashlib.sha256(key.encode()).hexdigest()}.json"


def lookup(key: str) -> float | None:
    """The sigma stored for ``key`` (None: no memo, no entry, or an unreadable one)."""
    folder = cache_dir()
    if folder is None:
        return None
    path = _path(folder, key)
    try:
        entry = json.loads(path.read_text())
        if entry["key"] != key:
            return None
        sigma = float.fromhex(entry["sigma"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.debug("calibration memo %s unreadable (%s): calibrating afresh", path, exc)
        return None
    return sigma if sigma > 0 and sigma == sigma and sigma != float("inf") else None


def store(key: str, sigma: float) -> None:
    """Keep ``sigma`` for ``key`` (atomically; silently skipped if the folder is not
    writable)."""
    folder = cache_dir()
    if folder is None:
        return
    entry = json.dumps({"key": key, "sigma": float(sigma).hex()})
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    except OSError as exc:
        log.debug("calibration memo not written to %s (%s)", folder, exc)
        return
    try:
        with os.fdopen(fd, "w") as f:
            f.write(entry)
        os.replace(tmp, _path(folder, key))
    except OSError as exc:
        log.debug("calibration memo not written to %s (%s)", folder, exc)
        Path(tmp).unlink(missing_ok=True)
