"""Errors a user can fix: every ``dpfl`` command turns them into one line and exit code 2.

A :class:`UserError` message is a single line that names the file, directory, key or
argument at fault and, where there is one, what to do instead. Anything else that escapes a
command is a bug in dpfl, reported with its traceback (exit 1).
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A bad input the user can fix (missing or damaged file, bad argument or setting)."""


def one_line(exc: BaseException) -> str:
    """An exception as ``Type: message`` on one line (for a message that wraps it)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def read_text_file(path: Path, what: str) -> str:
    """The text of ``path`` or a :class:`UserError` naming it (missing or unreadable);
    ``what`` says what the file is, e.g. "round log"."""
    if not path.exists():
        raise UserError(f"{path}: no such file ({what})")
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{path}: cannot read {what}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise UserError(damaged_text(path, what, exc)) from exc


def damaged_text(path: Path, what: str, exc: UnicodeDecodeError) -> str:
    """The one-line message for a file that is not UTF-8 text (every dpfl record is)."""
    return (f"{path}: {what} is damaged (not UTF-8 text: byte 0x{exc.object[exc.start]:02x} "
            f"at offset {exc.start})")


def writable_dir_problem(path: Path) -> str | None:
    """Why dpfl could not create or write files in the folder ``path`` (None when it can).

    The folder need not exist: then its nearest existing ancestor must be a folder in which
    the next missing one can be made. The check really creates (and removes) a temporary
    file, and the first missing folder when there is one, so read-only and pseudo file
    systems (``/proc``) and root's bypass of permission bits are all judged right; what it
    created is removed again."""
    path = Path(os.path.abspath(os.path.expanduser(path)))
    base = path
    while not base.exists() and base != base.parent:
        if base.is_symlink():
            try:
                os.stat(base)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    return f"{base} is a symbolic link loop"
            return f"{base} is a dangling symbolic link"
        base = base.parent
    if not base.is_dir():
        return f"{base} exists and is not a directory"
    made = None
    try:
        if base != path:
            made = path.relative_to(base).parts[0]
            made = base / made
            made.mkdir()
        fd, tmp = tempfile.mkstemp(prefix=".dpfl-write-check-", dir=made or base)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        where = f"cannot create a folder in {base}" if made is not None and not made.exists() \
            else f"cannot write in {made or base}"
        return f"{where}: {exc.strerror or exc}"
    finally:
        if made is not None:
            try:
                made.rmdir()
            except OSError:
                pass
    return None


def check_writable_dir(path: Path, option: str) -> None:
    """A :class:`UserError` naming ``option`` (e.g. ``--output-dir``) and ``path`` when
    dpfl could not write its files into the folder ``path``."""
    why = writable_dir_problem(path)
    if why is not None:
        raise UserError(f"{option} {path}: {why}")


def read_json_file(path: Path, what: str) -> object:
    """``json.load`` of ``path`` or a :class:`UserError` naming it (missing, unreadable,
    empty or damaged); ``what`` says what the file is, e.g. "run summary"."""
    import json

    text = read_text_file(path, what)
    if not text.strip():
        raise UserError(f"{path}: {what} is empty")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: {what} is damaged (invalid JSON at line {exc.lineno}, "
                        f"column {exc.colno})") from exc
