"""One writer per run folder: an OS lock (``fcntl.flock``) held for as long as a process
works on the run.

Two locks live in a run folder: ``.lock``, held by the ServerApp that writes the privacy
record (in simulation and in deployment alike), and ``.launch.lock``, held by a
``dpfl simulate`` launcher for its whole life (its SuperLink's ``FLWR_HOME`` is inside the
folder). A second holder is refused in one line naming the first one's PID.

The writer also locks the run folder ITSELF (``flock`` on the directory): removing or
replacing ``.lock`` under a live run does not let a second writer in, as the directory's
lock stays with the folder (a move keeps it; a copy is another folder, see
:mod:`dpfl.server.runidentity`).

A lock of a killed process is released by the kernel when its last descriptor closes,
so a stale lock cannot block a resume: the next holder takes it and logs the dead PID it
replaces. (``flock`` is advisory and local: a run folder on a network file system shared
by two hosts is not protected; keep run folders on the ServerApp host's own disk.)
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from dpfl.errors import UserError

log = logging.getLogger("flwr.dpfl.runlock")
WRITER_LOCK = ".lock"
LAUNCHER_LOCK = ".launch.lock"
LOCK_FILES = frozenset({WRITER_LOCK, LAUNCHER_LOCK})


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder(text: str) -> tuple[int | None, str]:
    """(pid, role) written by the holder; (None, "") when unreadable."""
    parts = text.split(maxsplit=1)
    if not parts or not parts[0].isdigit():
        return None, ""
    return int(parts[0]), parts[1].strip() if len(parts) > 1 else ""


class RunLock:
    """An exclusive, non-blocking lock on ``folder/name``; :meth:`release` or process exit
    frees it."""

    def __init__(self, folder: Path, name: str = WRITER_LOCK, role: str = "dpfl") -> None:
        self.path = Path(folder) / name
        self.role = role
        self._fd: int | None = None
        self._dir_fd: int | None = None

    def acquire(self, record: bool = True) -> "RunLock":
        """Take the lock, or raise :class:`UserError` naming the PID that holds it;
        ``record``: write our PID and role into the lock file for the next comer."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        dir_fd = self._lock_folder() if self.path.name == WRITER_LOCK else None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, role = _holder(os.pread(fd, 256, 0).decode("utf-8", "replace"))
            os.close(fd)
            if dir_fd is not None:
                os.close(dir_fd)
            raise UserError(self._in_use(pid, role)) from None
        self._fd, self._dir_fd = fd, dir_fd
        if not record:
            return self
        previous, _ = _holder(os.pread(fd, 256, 0).decode("utf-8", "replace"))
        if previous is not None and previous != os.getpid() and not _pid_alive(previous):
            log.info("%s: taking over the lock of process %d (no longer running)",
                     self.path.parent, previous)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {self.role}\n".encode(), 0)
        return self

    def _in_use(self, pid: int | None, role: str) -> str:
        who = (f"process {pid}" if pid else "another process") + (f" ({role})" if role else "")
        return (f"run directory {self.path.parent} is in use by {who}: wait for it to finish "
                "or stop it (one writer per run folder)")

    def _lock_folder(self) -> int:
        """The folder's own lock (a descriptor of the directory, flocked)."""
        dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(dir_fd)
            pid, role = (_holder(self.path.read_text("utf-8", "replace")[:256])
                         if self.path.exists() else (None, ""))
            raise UserError(self._in_use(pid, role if pid else
                                         f"its {WRITER_LOCK} was removed or replaced")) from None
        return dir_fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        if self._dir_fd is not None:
            fcntl.flock(self._dir_fd, fcntl.LOCK_UN)
            os.close(self._dir_fd)
            self._dir_fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def check_unlocked(folder: Path, name: str = WRITER_LOCK) -> None:
    """Raise :class:`UserError` when some process holds ``folder/name`` now (a probe:
    takes the lock and releases it at once; nothing when the folder does not exist)."""
    if (Path(folder) / name).exists():
        RunLock(folder, name, "probe").acquire(record=False).release()
