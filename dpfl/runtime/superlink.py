"""``flower-superlink`` with a longer SQLite lock wait (many SuperNodes on a busy host).

    python -m dpfl.runtime.superlink --sqlite-busy-timeout 60 [flower-superlink options...]

A SuperLink started with ``--database FILE`` keeps its state in SQLite, and every Fleet
call of every SuperNode (heartbeats, pulls, pushes of messages and objects) is a
transaction on it. Flower 1.39 sets ``PRAGMA busy_timeout = 5000``: a call that waits more
than 5 s for the write lock fails (``sqlite3.OperationalError: database is locked``), and the
SuperNode, the ServerApp or the log stream of ``flwr run`` sees an error. With 20 SuperNodes
on a loaded 2-core host (results/faults/) lock holders are descheduled long enough for
that to happen in the first round.

Flower has no option for it: the pragma list is a constant
(``flwr.supercore.constant.SQLITE_PRAGMAS``) that ``flwr.supercore.sql_mixin`` imports by
value and applies to every new connection. This wrapper replaces the ``busy_timeout`` entry
there, in this process only, then runs Flower's own ``flower-superlink`` entry point with
the other arguments. Nothing else changes; an in-memory database is unaffected.
"""

from __future__ import annotations

from collections.abc import Sequence

from dpfl.runtime.flower_wrap import run_wrapped

OPTION = "--sqlite-busy-timeout"
FLOWER_DEFAULT = 5.0  # flwr.supercore.constant.SQLITE_PRAGMAS busy_timeout 5000 ms, flwr 1.39
MAX_TIMEOUT = 600.0


def apply_busy_timeout(seconds: float) -> None:
    """Make every SQLite connection this process opens wait ``seconds`` for a lock."""
    from flwr.supercore import sql_mixin

    pragmas = list(sql_mixin.SQLITE_PRAGMAS)
    names = [name for name, _ in pragmas]
    if "busy_timeout" not in names:
        raise RuntimeError("flwr.supercore.sql_mixin.SQLITE_PRAGMAS has no busy_timeout: "
                           "this flwr version sets it elsewhere")
    pragmas[names.index("busy_timeout")] = ("busy_timeout", str(int(seconds * 1000)))
    sql_mixin.SQLITE_PRAGMAS = tuple(pragmas)


def _flower_superlink():
    from flwr.superlink.cli import flower_superlink

    return flower_superlink


def main(argv: Sequence[str] | None = None) -> None:
    run_wrapped("dpfl.runtime.superlink", OPTION, FLOWER_DEFAULT, MAX_TIMEOUT, apply_busy_timeout,
                "flower-superlink", _flower_superlink, argv)


if __name__ == "__main__":
    main()
