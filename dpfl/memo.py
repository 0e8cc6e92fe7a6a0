"""dpfl's memo on disk: answers that are expensive to compute, deterministic given their
key, and shared by every process of a machine (calibrated noise multipliers, partitions).

Where: ``$DPFL_CACHE_DIR`` (``off`` or empty: no memo), else ``$XDG_CACHE_HOME/dpfl``, else
``~/.cache/dpfl``; each kind in its own folder, each entry a file named by the SHA-256 of
its key. The callers put the key inside the entry too and compare it on reading, and check
every answer against what it claims to be before they use it (a calibrated sigma against
its accountant, a partition against the dataset and its partitioner's parameters): a
damaged or edited entry is logged (one WARNING naming the file and the key), discarded and
recomputed, never a wrong answer taken on trust. Writing is best effort (atomic rename; a
read-only or full disk only loses the memo).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger("flwr.dpfl.memo")

CACHE_ENV = "DPFL_CACHE_DIR"
DISABLED = ("", "off")


def memo_dir(kind: str) -> Path | None:
    """The folder of one kind of entry, or None when ``$DPFL_CACHE_DIR`` turns the memo off."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return None if configured.strip().lower() in DISABLED else Path(configured) / kind
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dpfl" / kind


def code_version(distribution: str, *sources: Path) -> str:
    """What an answer depends on besides its question, for its key: an installed
    distribution's version and a digest of the dpfl source files that compute it."""
    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.read_bytes())
    return (f"{distribution} {importlib.metadata.version(distribution)}; "
            f"dpfl {'+'.join(s.name for s in sources)} {digest.hexdigest()[:16]}")


def entry_path(folder: Path, key: str, suffix: str) -> Path:
    return folder / f"{hashlib.sha256(key.encode()).hexdigest()}{suffix}"


def entry_file(kind: str, key: str, suffix: str = ".bin") -> Path | None:
    """Where the entry of ``key`` is (or would be) kept; None when the memo is off."""
    folder = memo_dir(kind)
    return None if folder is None else entry_path(folder, key, suffix)


def discard(kind: str, key: str, suffix: str = ".bin") -> None:
    """Remove the entry of ``key`` (one that failed its check); best effort."""
    path = entry_file(kind, key, suffix)
    if path is None:
        return
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.debug("memo entry %s not removed (%s)", path, exc)


def read(kind: str, key: str, suffix: str = ".bin") -> bytes | None:
    """The stored bytes of ``key`` (None: no memo, no entry, or unreadable)."""
    folder = memo_dir(kind)
    if folder is None:
        return None
    try:
        return entry_path(folder, key, suffix).read_bytes()
    except OSError:
        return None


def write(kind: str, key: str, data: bytes, suffix: str = ".bin") -> None:
    """Store ``data`` for ``key`` atomically; silently skipped where it cannot be written."""
    folder = memo_dir(kind)
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=suffix)
    except OSError as exc:
        log.debug("memo not written to %s (%s)", folder, exc)
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, entry_path(folder, key, suffix))
    except OSError as exc:
        log.debug("memo not written to %s (%s)", folder, exc)
        Path(tmp).unlink(missing_ok=True)
