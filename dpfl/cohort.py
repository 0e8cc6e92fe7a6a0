"""Cohort messages: one simulated SuperNode trains several clients per Message.

In a simulation with many clients, a Flower Message per client costs a Ray round trip, a
model rebuilt and a partition read each time (issue 47: 70-77 % of a 1,000-client round).
With ``cohort-clients`` = N, the ServerApp's :class:`dpfl.server.cohort.CohortGrid` shows
the strategy one node per client, as before, and bundles each round's instructions into
one Message per host node (client ``pid`` lives on host ``pid mod K``, for the whole run);
the host (:mod:`dpfl.apps.cohort_host`) runs the ordinary per-client handler for each of
its clients in turn, each with its own node state, and replies once with every client's
reply. Everything per client stays per client: its secret noise, its privacy history in
its own slice of the host's state, its reply, its check and its charge on the server.

This module is the wire format both halves share, on Flower records only:

- an instruction bundle holds the records every client's instruction shares (the same
  object: the global arrays, a method's extra records) once, each client's own records
  (its ConfigRecord) under ``<pid>/<key>``, and a ConfigRecord :data:`COHORT_RECORD` with
  the inner message type, the clients in order and the federation's size;
- a reply bundle holds each client's reply records under ``<pid>/<key>`` and, for a
  client whose handler failed, its error reason in the :data:`COHORT_RECORD` record;
- a client's node state is the host's state records under ``<pid>/<key>``
  (:func:`client_state`, :func:`store_client_state`).
"""

from __future__ import annotations

from collections.abc import Mapping

from flwr.app import ConfigRecord, RecordDict

COHORT_RECORD = "dpfl.cohort"   # the bundle's own ConfigRecord
COHORT_ACTION = "cohort"        # a bundle's message type is "<category>.cohort"
SEPARATOR = "/"
TYPE_KEY, CLIENTS_KEY, SIZE_KEY, SHARED_KEY = "type", "clients", "num-clients", "shared"
ERROR_PREFIX = "error-"


def scoped(pid: int, key: str) -> str:
    """The key of client ``pid``'s record ``key`` in a bundle or a host's state."""
    return f"{int(pid)}{SEPARATOR}{key}"


def _split(key: str) -> tuple[int, str] | None:
    head, sep, rest = key.partition(SEPARATOR)
    if not sep or not head.isdigit():
        return None
    return int(head), rest


def bundle_type(inner_type: str) -> str:
    """The message type of a bundle of ``inner_type`` instructions (``train`` ->
    ``train.cohort``, ``query.warm`` -> ``query.cohort``)."""
    return f"{inner_type.split('.', 1)[0]}.{COHORT_ACTION}"


def bundle_instructions(contents: Mapping[int, RecordDict], inner_type: str,
                        num_clients: int) -> RecordDict:
    """One RecordDict for the instructions ``contents`` (client id -> its instruction's
    records) of one message type: records that are the same object in every instruction
    are stored once, the others per client."""
    pids = list(contents)
    first = contents[pids[0]]
    shared = [key for key, record in first.items()
              if all(key in c and c[key] is record for c in contents.values())]
    out = RecordDict({key: first[key] for key in shared})
    for pid, content in contents.items():
        for key, record in content.items():
            if key not in shared:
                out[scoped(pid, key)] = record
    out[COHORT_RECORD] = ConfigRecord({TYPE_KEY: inner_type, CLIENTS_KEY: pids,
                                       SIZE_KEY: int(num_clients), SHARED_KEY: shared})
    return out


def bundle_clients(content: RecordDict) -> int:
    """How many clients' instructions ``content`` bundles (0: not a bundle, or unreadable)."""
    try:
        meta = content.config_records.get(COHORT_RECORD)
        return len(meta[CLIENTS_KEY]) if meta is not None else 0
    except (KeyError, TypeError):
        return 0


def unbundle_instructions(content: RecordDict) -> tuple[str, int, dict[int, RecordDict]]:
    """(inner message type, the federation's number of clients, client id -> its
    instruction's records) of an instruction bundle; ValueError when it is not one."""
    if COHORT_RECORD not in content.config_records:
        raise ValueError(f"a cohort message without its '{COHORT_RECORD}' record")
    meta = content[COHORT_RECORD]
    pids = [int(p) for p in meta[CLIENTS_KEY]]
    shared = [str(k) for k in meta[SHARED_KEY]]
    out = {pid: RecordDict({key: content[key] for key in shared}) for pid in pids}
    for key, record in content.items():
        parts = _split(key)
        if parts is not None and parts[0] in out:
            out[parts[0]][parts[1]] = record
    return str(meta[TYPE_KEY]), int(meta[SIZE_KEY]), out


def bundle_replies(replies: Mapping[int, RecordDict | str]) -> RecordDict:
    """One RecordDict for the clients' replies (client id -> its reply's records, or the
    reason its handler failed)."""
    out = RecordDict()
    meta: dict[str, object] = {CLIENTS_KEY: list(replies)}
    for pid, reply in replies.items():
        if isinstance(reply, str):
            meta[f"{ERROR_PREFIX}{int(pid)}"] = reply
            continue
        for key, record in reply.items():
            out[scoped(pid, key)] = record
    out[COHORT_RECORD] = ConfigRecord(meta)  # type: ignore[arg-type]
    return out


def unbundle_replies(content: RecordDict) -> dict[int, RecordDict | str]:
    """Client id -> its reply's records (or its error reason) of a reply bundle; a client
    the bundle does not list is absent. ValueError when it is not a reply bundle."""
    if COHORT_RECORD not in content.config_records:
        raise ValueError(f"a cohort reply without its '{COHORT_RECORD}' record")
    meta = content[COHORT_RECORD]
    out: dict[int, RecordDict | str] = {}
    for pid in (int(p) for p in meta[CLIENTS_KEY]):
        error = meta.get(f"{ERROR_PREFIX}{pid}")
        out[pid] = str(error) if error is not None else RecordDict()
    for key, record in content.items():
        parts = _split(key)
        if parts is not None and isinstance(out.get(parts[0]), RecordDict):
            out[parts[0]][parts[1]] = record  # type: ignore[index]
    return out


def client_state(state: RecordDict, pid: int) -> RecordDict:
    """Client ``pid``'s node state: the host's state records under ``<pid>/``."""
    prefix = scoped(pid, "")
    return RecordDict({key[len(prefix):]: record for key, record in state.items()
                       if key.startswith(prefix)})


def store_client_state(state: RecordDict, pid: int, own: RecordDict) -> None:
    """Write client ``pid``'s node state ``own`` back into the host's ``state`` (records it
    no longer holds are removed)."""
    prefix = scoped(pid, "")
    for key in [k for k in state if k.startswith(prefix)]:
        del state[key]
    for key, record in own.items():
        state[scoped(pid, key)] = record
