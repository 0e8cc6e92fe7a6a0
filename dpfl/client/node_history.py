"""A SuperNode's own durable copy of its privacy history (node-config ``privacy-dir``).

A client's privacy history lives in Flower's per-run node state (``context.state``), and
the server gives it back on a resume (``ledger-*`` keys of the instruction). One release
escapes both: a reply the client sent just before its SuperLink restarted. It reached the
SuperLink's database under the old run, the resumed run (a new Flower run) never reads it,
so the server never charges it, and the client's new node state never saw it. At most one
round per client per restart, but a release all the same.

With ``--node-config '... privacy-dir="/var/lib/dpfl/privacy"'`` on the SuperNode, or
``DPFL_PRIVACY_DIR`` in its environment (node settings: a run cannot move or switch them
off; the node config wins), the client also appends every event it
charges to ``<privacy-dir>/<run>-partition-<i>.json`` — durably, *before* the reply
carrying the release leaves (:func:`dpfl.durable.atomic_write`) — and before every round
adds the file's events to its history that the history lacks (a multiset union: an event
counted twice for a round run twice is two releases, and stays two). ``<run>`` is the
run-config's ``run-name`` (a resume keeps it; without one, Flower's run id: such a run
cannot be resumed). The client then budgets and reports that fuller history, and the
server's ledger takes the reported epsilon as a floor (``Ledger.reported``), flagging the
mismatch with its own recomputation.

A damaged or unreadable file is never read as "nothing spent": the client refuses the
round, naming the file (its operator must repair or remove it deliberately). The file is
never shortened: it only ever grows by the union.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dpfl.durable import atomic_write
from dpfl.privacy.accounting.budget import PrivacyHistory
from dpfl.privacy.accounting.events import PrivacyEvent

NODE_CONFIG_KEY = "privacy-dir"
ENV_VAR = "DPFL_PRIVACY_DIR"  # the same setting in the SuperNode's environment
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


class NodeHistoryError(RuntimeError):
    """The node's history file cannot be read or written (the round is refused)."""


def history_path(node_config: Mapping[str, Any], run_name: str, run_id: int,
                 partition_id: int) -> Path | None:
    """The node's history file for this run and partition; None without ``privacy-dir``."""
    folder = str(node_config.get(NODE_CONFIG_KEY, "") or os.environ.get(ENV_VAR, ""))
    if not folder:
        return None
    run = _SAFE.sub("_", run_name) if run_name else f"flower-run-{run_id}"
    return Path(folder) / f"{run}-partition-{partition_id}.json"


def load_events(path: Path) -> list[PrivacyEvent]:
    """The events in ``path`` (none if it does not exist yet); NodeHistoryError if it is
    unreadable or damaged."""
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
        return [PrivacyEvent(**e) for e in data["events"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise NodeHistoryError(f"node privacy history {path} is unreadable or damaged "
                               f"({type(exc).__name__}: {exc}); repair or move it") from exc


def missing_events(history: PrivacyHistory, events: list[PrivacyEvent]) -> list[PrivacyEvent]:
    """The events of ``events`` that ``history`` lacks, counted as a multiset."""
    have = Counter(history.events)
    extra = []
    for event in events:
        if have[event] > 0:
            have[event] -= 1
        else:
            extra.append(event)
    return extra


def adopt(history: PrivacyHistory, path: Path) -> int:
    """Add to ``history`` the events of the node's file it lacks; how many were added."""
    extra = missing_events(history, load_events(path))
    if extra:
        history.events = sorted(history.events + extra, key=lambda e: e.round)
    return len(extra)


def record(history: PrivacyHistory, path: Path) -> None:
    """Write ``history`` to the node's file, durably, keeping any event only the file has
    (the file never shrinks)."""
    events = history.events + missing_events(history, load_events(path))
    body = json.dumps({"events": [asdict(e) for e in sorted(events, key=lambda e: e.round)]},
                      indent=1).encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(body))
    except OSError as exc:
        raise NodeHistoryError(f"cannot write node privacy history {path} ({exc})") from exc
