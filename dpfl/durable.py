"""Durable writes: a file is either its old content or its new content, and on disk.

Used for everything a crash must not shorten — the privacy ledger first. Each write goes
to a temporary file beside the target, is flushed and ``fsync``-ed, renamed over the
target (atomic on POSIX) and the directory entry is ``fsync``-ed too, so a kill or power
loss at any instant leaves the previous complete version or the new one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Callable


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> Path:
    """Replace ``path`` by what ``write(f)`` writes into a binary file object, atomically
    and durably (temp file + fsync + rename + directory fsync)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    """:func:`atomic_write` of a UTF-8 text."""
    return atomic_write(path, lambda f: f.write(text.encode()))


def append_line(path: Path, line: str) -> None:
    """Append one line (a newline is added) and fsync; a kill can leave at most a partial
    LAST line, which readers drop (:func:`read_lines`)."""
    with open(path, "a") as f:
        f.write(line.rstrip("\n") + "\n")
        f.flush()
        os.fsync(f.fileno())


def split_lines(text: str) -> tuple[list[str], str | None]:
    """An append-only file's text as its complete lines (blank ones kept, so that line
    numbers hold) and the partial last line a kill left (None when the text ends with a
    newline)."""
    if not text:
        return [], None
    lines = text.split("\n")
    tail = lines.pop()  # "" when the text ends with "\n"
    return lines, (tail if tail.strip() else None)


def read_lines(path: Path) -> tuple[list[str], str | None]:
    """The complete, non-blank lines of an append-only file and the partial last line a
    kill left (None when the file ends with a newline): :func:`split_lines`."""
    lines, tail = split_lines(path.read_text(encoding="utf-8") if path.exists() else "")
    return [l for l in lines if l.strip()], tail
