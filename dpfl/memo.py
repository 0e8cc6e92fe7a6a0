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

Within one launch (``dpfl simulate``: the launcher puts a fresh secret in
``$DPFL_LAUNCH_PROOF_KEY`` of every process it starts), an answer one process checked is not
checked again by the others: the checker writes a proof beside the entry (:func:`prove`, an
HMAC-SHA256 of the kind, the key and the answer under that secret), and a process that
finds a valid proof for the very answer it read takes it (:func:`proven`). One process at a
time checks or computes an entry (:func:`checking`, a lock beside it): the others wait for
its answer and proof instead of repeating the same evaluations on the same cores. Without
the secret (a deployment, a process started by hand) every answer is checked, as before; an
entry changed after its check, or a proof of another launch, proves nothing.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import importlib.metadata
import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("flwr.dpfl.memo")

CACHE_ENV = "DPFL_CACHE_DIR"
DISABLED = ("", "off")
# the secret of one launch (hex, >= 16 bytes), set by the launcher for every process it starts
PROOF_ENV = "DPFL_LAUNCH_PROOF_KEY"
PROOF_SUFFIX = ".proof"
LOCK_SUFFIX = ".lock"


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


def _launch_secret() -> bytes | None:
    """This launch's secret (:data:`PROOF_ENV`), or None when there is none (or it is not
    at least 16 bytes of hex)."""
    try:
        secret = bytes.fromhex(os.environ.get(PROOF_ENV, ""))
    except ValueError:
        return None
    return secret if len(secret) >= 16 else None


def _proof(secret: bytes, kind: str, key: str, answer: bytes) -> bytes:
    message = b"\0".join((kind.encode(), key.encode(), answer))
    return hmac.new(secret, message, hashlib.sha256).hexdigest().encode()


def proven(kind: str, key: str, answer: bytes) -> bool:
    """Whether a process of this launch checked ``answer`` (the entry's answer, as bytes)
    for ``key`` and proved it (:func:`prove`). False without a launch secret."""
    secret = _launch_secret()
    if secret is None:
        return False
    stored = read(kind, key, PROOF_SUFFIX)
    return stored is not None and hmac.compare_digest(stored, _proof(secret, kind, key, answer))


def prove(kind: str, key: str, answer: bytes) -> None:
    """Record that this process checked ``answer`` for ``key`` (best effort; nothing
    without a launch secret)."""
    secret = _launch_secret()
    if secret is not None:
        write(kind, key, _proof(secret, kind, key, answer), PROOF_SUFFIX)


@contextmanager
def checking(kind: str, key: str) -> Iterator[None]:
    """Hold the entry's lock while checking or computing it, so that the other processes of
    a launch wait for the answer and its proof (an exclusive ``flock``, released when the
    block ends or the process dies). No lock without a launch secret or a memo, or where
    the memo's folder cannot hold one."""
    folder = memo_dir(kind)
    if _launch_secret() is None or folder is None:
        yield
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(entry_path(folder, key, LOCK_SUFFIX), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        log.debug("memo entry lock not taken in %s (%s)", folder, exc)
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:   # a file system without locks: check unlocked
            log.debug("memo entry lock not taken in %s (%s)", folder, exc)
        yield
    finally:
        os.close(fd)
