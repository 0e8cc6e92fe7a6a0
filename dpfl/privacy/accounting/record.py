"""One codec for the privacy record on the wire: events as columns of a Flower record.

A privacy event travels in four places, all in this one format (a list per field, one
entry per event, each key with its place's prefix):

- a reply's ``privacy`` record and the node's own history in ``context.state``: no prefix
  (:class:`dpfl.privacy.accounting.budget.PrivacyHistory`);
- an instruction's ``ledger-*`` keys: the server's record of every partition's events, with
  a ``ledger-client`` column naming each row's partition (:func:`dpfl.privacy.accounting.ledger.ledger_config`);
- an instruction's ``server-event-*`` keys: the server's own releases charged to this client
  (:func:`dpfl.privacy.accounting.ledger.server_events_config`);
- an instruction's ``plan-*`` keys: one planned event, without its round (the instruction's
  round): :func:`encode_event` / :func:`decode_event` (:mod:`dpfl.privacy.plan`).

:func:`decode_events` is the one validation: every column present, all of one length, each
row a valid :class:`~dpfl.privacy.accounting.events.PrivacyEvent`; anything else is a ``ValueError``
(or the event's own ``TypeError``/``ValueError``), never a guess.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dpfl.privacy.accounting.events import PrivacyEvent

EVENT_FIELDS = ("round", "mechanism", "sigma", "rate", "steps", "epsilon", "relation")
# a planned event: its round is the instruction's
PLAN_FIELDS = EVENT_FIELDS[1:]


def encode_events(events: Sequence[PrivacyEvent], prefix: str = "") -> dict[str, list[Any]]:
    """``events`` as one list per field, keys ``<prefix><field>``."""
    return {f"{prefix}{name}": [getattr(e, name) for e in events] for name in EVENT_FIELDS}


def decode_events(record: Mapping[str, Any], prefix: str = "",
                  rows: Sequence[int] | None = None) -> list[PrivacyEvent]:
    """The events :func:`encode_events` wrote (only ``rows``, if given). ValueError when a
    column is missing or the columns differ in length."""
    columns: dict[str, list[Any]] = {}
    for name in EVENT_FIELDS:
        key = f"{prefix}{name}"
        if key not in record:
            raise ValueError(f"privacy record: '{key}' is missing")
        columns[name] = list(record[key])
    n = len(columns["round"])
    if any(len(values) != n for values in columns.values()):
        raise ValueError(f"privacy record '{prefix}*': lists have different lengths")
    return [PrivacyEvent(**{name: columns[name][i] for name in EVENT_FIELDS})
            for i in (range(n) if rows is None else rows)]


def encode_event(event: PrivacyEvent, prefix: str) -> dict[str, Any]:
    """One event without its round, keys ``<prefix><field>`` (scalars)."""
    return {f"{prefix}{name}": getattr(event, name) for name in PLAN_FIELDS}


def decode_event(record: Mapping[str, Any], prefix: str, server_round: int) -> PrivacyEvent:
    """The event :func:`encode_event` wrote, in ``server_round``."""
    missing = [f"{prefix}{name}" for name in PLAN_FIELDS if f"{prefix}{name}" not in record]
    if missing:
        raise ValueError(f"privacy record: {missing} missing")
    return PrivacyEvent(server_round, **{name: record[f"{prefix}{name}"]
                                         for name in PLAN_FIELDS})
