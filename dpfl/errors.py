"""Errors a user can fix: every ``dpfl`` command turns them into one line and exit code 2.

A :class:`UserError` message is a single line that names the file, directory, key or
argument at fault and, where there is one, what to do instead. Anything else that escapes a
command is a bug in dpfl, reported with its traceback (exit 1).
"""

from __future__ import annotations

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
        return path.read_text()
    except OSError as exc:
        raise UserError(f"{path}: cannot read {what}: {exc.strerror or exc}") from exc


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
