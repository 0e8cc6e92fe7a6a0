"""dpfl's loggers: children of Flower's ``flwr`` logger, printed once.

Flower prints ``flwr.*`` records with its own console handler, and the ``flwr`` logger
propagates to the root logger. Opacus calls ``logging.basicConfig`` when it is imported
(``opacus.utils.module_utils``), which gives the root logger a stderr handler with a date
prefix: from then on every Flower and dpfl line was printed twice (``flwr run --stream``
forwards both streams of the ServerApp process). :func:`get_logger` gives the root logger a
handler first, so ``basicConfig`` leaves it alone; that handler skips ``flwr.*`` records
(Flower's handler printed them) and prints other libraries' warnings to stderr, as Python's
last-resort handler would have.
"""

from __future__ import annotations

import logging
import sys

FLOWER = "flwr"


class NotFlower(logging.Filter):
    """Passes records of every logger outside Flower's ``flwr`` tree."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != FLOWER and not record.name.startswith(FLOWER + ".")


class StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (as Python's
    last-resort handler does), so a later redirection of stderr is followed."""

    def __init__(self, level: int = logging.NOTSET) -> None:
        logging.Handler.__init__(self, level)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr


def guard_root() -> None:
    """Give an unconfigured root logger a stderr handler (WARNING and up) that skips
    ``flwr.*`` records; a root logger someone already configured is left alone."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = StderrHandler(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(NotFlower())
    root.addHandler(handler)


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` for a ``flwr.dpfl.*`` name, after :func:`guard_root`."""
    if not name.startswith(FLOWER + ".dpfl"):
        raise ValueError(f"dpfl loggers live under 'flwr.dpfl', got {name!r}")
    guard_root()
    return logging.getLogger(name)
