"""The server's record of every client's privacy spend.

The client is the authority on its own budget (it refuses to overspend); the server's
ledger is the record nobody can talk down. It charges every update the server received —
accepted, rejected by validation, or arriving late — with the events the client reported
when they match the plan the server computed, and at no less than the planned cost when
they do not (:mod:`dpfl.privacy.charging`). It recomputes each client's epsilon with the
same accountant, flags any mismatch with the epsilon the client reported, and never
publishes a figure below the client's own report. Persisted as ``ledger.json`` in the run
directory and in the checkpoint; on resume the server hands every client its recorded
events back so a client whose node state was lost still counts them (:func:`ledger_config`
/ :func:`prior_history`).

Releases the SERVER makes itself (the noisy clipped count of adaptive clipping, central
Gaussian noise on a sum) involve every client they cover: :meth:`Ledger.charge_server_release`
composes their events into each covered client's epsilon, kept apart from the events the
client reported (:attr:`Ledger.server`) so that a client's report is still compared with its
own events only, and marked ``"source": "server"`` in :attr:`Ledger.charges`.

A release that covers the WHOLE population every round (central DP with amplification by
Poisson client sampling: every client is charged every round, sampled or not) is stored
once per round (:meth:`Ledger.charge_population_release`, :attr:`Ledger.population_events`)
instead of once per client, so a 1,000-client ledger stays small.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Hashable, Mapping, Sequence, TypeVar

from dpfl.durable import atomic_write_text
from dpfl.errors import UserError, one_line, read_json_file
from dpfl.privacy.accounting.budget import BUDGET_RTOL, PrivacyHistory
from dpfl.privacy.accounting.events import (
    ACCOUNTANTS,
    PrivacyEvent,
    histories_epsilon,
    history_rdp,
    history_unit,
    rdp_to_epsilon,
)
from dpfl.privacy.accounting.record import decode_events, encode_events

T = TypeVar("T")

log = logging.getLogger("flwr.dpfl.ledger")
MISMATCH_RTOL = 1e-6
# the instruction keys of the ledger's record (dpfl.privacy.accounting.record's format)
LEDGER_PREFIX = "ledger-"
# A partition's key in the ledger, the run's records and every server message; a sender
# whose partition is not known is charged as ``node-<node id>`` instead.
CLIENT_PREFIX = "client-"


def client_key(partition_id: int) -> str:
    """The ledger's key of partition ``partition_id`` (``client-<id>``)."""
    return f"{CLIENT_PREFIX}{int(partition_id)}"


def is_client_key(key: str) -> bool:
    """Whether ``key`` names a partition (not a ``node-<id>`` of an unknown partition)."""
    return str(key).startswith(CLIENT_PREFIX)


LEDGER_INDENT_CLIENTS = 1000


@dataclass
class Ledger:
    """Per-client privacy histories (keyed ``client-<partition-id>``): the events each
    client reported (:attr:`clients`) and the server's own releases covering it
    (:attr:`server`); a client's epsilon composes both."""

    delta: float
    accountant: str = "rdp"
    clients: dict[str, PrivacyHistory] = field(default_factory=dict)
    reported: dict[str, float] = field(default_factory=dict)
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    charges: list[dict[str, Any]] = field(default_factory=list)
    server: dict[str, list[PrivacyEvent]] = field(default_factory=dict)
    # releases charged to every client of :attr:`population`, stored once
    population: list[str] = field(default_factory=list)
    population_events: list[PrivacyEvent] = field(default_factory=list)
    # every client's epsilon budget (target-epsilon of a private run; None: no budget)
    budget: float | None = None

    def history(self, client: str) -> PrivacyHistory:
        """Everything charged to ``client``: its own events, then the server's releases
        covering it (adaptive if its own history is)."""
        own = self.clients.get(client, PrivacyHistory())
        extra = self.server.get(client, [])
        if self.population_events and client in self._population_set():
            extra = extra + self.population_events
        return PrivacyHistory(own.events + extra, own.adaptive) if extra else own

    def _population_set(self) -> set[str]:
        if getattr(self, "_pop_cache", None) is None or len(self._pop_cache) != len(
                self.population):
            self._pop_cache: set[str] = set(self.population)
        return self._pop_cache

    def record(self, client: str, server_round: int, events: Sequence[PrivacyEvent],
               reported_epsilon: float | None = None, note: str = "",
               adaptive: bool = False, claimed: int | None = None) -> float:
        """Charge ``events`` to ``client`` (every update the server received, accepted or
        not); return the client's epsilon figure. ``note`` says why this charge (kept in
        :attr:`charges`). A reported epsilon that differs from the one recomputed from the
        client's own events is flagged in :attr:`mismatches`; the figure (own events and
        the server's releases covering the client) is never below the client's report.
        ``claimed``: the partition a sender the server could not identify (``node-<id>``)
        said it holds; its charges count towards that partition's budget check too
        (:meth:`claimed_figures`)."""
        history = self.clients.setdefault(client, PrivacyHistory(adaptive=adaptive))
        history_unit(history.events + list(events) + self.server.get(client, []))
        for e in events:
            history.charge(e)
        entry = {"client": client, "round": server_round, "note": note,
                 "source": "client", "events": [e.to_dict() for e in events]}
        if claimed is not None:
            entry["claimed-partition"] = int(claimed)
        self.charges.append(entry)
        own = history.epsilon(self.delta, self.accountant)
        if reported_epsilon is not None and math.isfinite(reported_epsilon):
            self.reported[client] = max(float(reported_epsilon), self.reported.get(client, 0.0))
            if abs(own - reported_epsilon) > MISMATCH_RTOL * max(1.0, own):
                entry = {"client": client, "round": server_round,
                         "reported": float(reported_epsilon), "recomputed": own}
                self.mismatches.append(entry)
                log.warning("ledger mismatch: %s", entry)
        eps = self.recomputed(client) if client in self.server else own
        return max(eps, self.reported.get(client, 0.0))

    def charge_server_release(self, server_round: int, events: Sequence[PrivacyEvent],
                              clients: Sequence[str], note: str = "",
                              adaptive: bool = False) -> None:
        """Charge a release the server made itself to every client it ``covers``.

        One noisy count (Andrew et al. 2021's clipped count) or one central Gaussian noise
        on a sum involves every participating client: the same ``events`` are composed
        into each covered client's epsilon. Their unit must match each client's history
        (ValueError "mixes sample-level and client-level", before anything is charged).
        ``adaptive``: the release steers later rounds (e.g. the clip), so the covered
        histories need adaptive composition (the Rényi filter)."""
        events, covered = list(events), list(dict.fromkeys(clients))
        for client in covered:
            history_unit(self.history(client).events + events)
        for client in covered:
            own = self.clients.setdefault(client, PrivacyHistory(adaptive=adaptive))
            own.adaptive = own.adaptive or adaptive
            self.server.setdefault(client, []).extend(events)
            self.charges.append({"client": client, "round": server_round, "note": note,
                                 "source": "server", "events": [e.to_dict() for e in events]})

    def charge_population_release(self, server_round: int, events: Sequence[PrivacyEvent],
                                  clients: Sequence[str], note: str = "",
                                  adaptive: bool = False) -> None:
        """Charge a server release to every client of the population ``clients`` (the same
        set every time: ValueError otherwise, before anything is charged), stored once.
        Central DP with Poisson client sampling charges the whole population every round:
        that is what amplification by sampling means."""
        events, covered = list(events), list(dict.fromkeys(clients))
        if self.population and covered != self.population:
            raise ValueError("a population release must cover the same clients every round "
                             f"({len(covered)} given, {len(self.population)} recorded)")
        for client in covered[:1]:
            history_unit(self.history(client).events + events)
        self.population = covered
        # only clients without a history get one (every round after the first: none; a
        # loop creating 10,000 histories a round held the server's thread ~5 ms, and far
        # longer while another thread wanted the interpreter)
        for client in [c for c in covered if c not in self.clients]:
            self.clients[client] = PrivacyHistory(adaptive=adaptive)
        if adaptive:
            for client in covered:
                self.clients[client].adaptive = True
        self.population_events.extend(events)
        self.charges.append({"client": "population", "round": server_round, "note": note,
                             "source": "population", "clients": len(covered),
                             "events": [e.to_dict() for e in events]})

    def recomputed(self, client: str) -> float:
        """Epsilon recomputed from the charged events alone (the client's and the server's)."""
        if client not in self.clients and client not in self.server:
            return 0.0
        return self.history(client).epsilon(self.delta, self.accountant)

    def epsilon(self, client: str) -> float:
        """The client's figure: the recomputed epsilon, or the client's own report when
        that is higher (a mismatch, flagged)."""
        return max(self.recomputed(client), self.reported.get(client, 0.0))

    def recomputed_all(self) -> dict[str, float]:
        """Every client's recomputed epsilon, in client order (RDP: one vectorised pass)."""
        names = sorted(self.clients, key=client_order)
        # clients charged only by population releases share one history: compute it once
        shared = [n for n in names if self.population_events and not self.clients[n].events
                  and not self.server.get(n) and n in self._population_set()]
        out: dict[str, float] = {}
        if shared:
            eps = self.history(shared[0]).epsilon(self.delta, self.accountant)
            out = dict.fromkeys(shared, eps)
        rest = [n for n in names if n not in out]
        if self.accountant == "rdp":
            by_name = histories_epsilon({n: self.history(n).events for n in rest}, self.delta)
            out.update({n: by_name[n] for n in rest})
        else:
            out.update({n: self.recomputed(n) for n in rest})
        return {n: out[n] for n in names}

    def epsilons(self) -> dict[str, float]:
        """Every client's figure: recomputed, or the client's own report when higher."""
        return {n: max(e, self.reported.get(n, 0.0)) for n, e in self.recomputed_all().items()}

    def over_budget(self, figures: Mapping[str, float] | None = None) -> dict[str, float]:
        """Clients whose epsilon figure exceeds :attr:`budget` (beyond the budget check's
        tolerance), with that figure; empty without a budget. No honest run has one: a
        client refuses a round it cannot afford, so an entry means a misbehaving node, a
        forged identity or a bug — ``dpfl privacy-report`` exits non-zero on it. A
        partition whose own charges plus those of unidentified senders claiming it
        (:meth:`claimed_figures`) exceed the budget is in it too."""
        if self.budget is None:
            return {}
        figures = dict(self.epsilons() if figures is None else figures)
        for client, eps in self.claimed_figures().items():
            figures[client] = max(eps, figures.get(client, 0.0))
        return {c: e for c, e in figures.items() if e > self.budget * (1.0 + BUDGET_RTOL)}

    def claimed_figures(self) -> dict[str, float]:
        """For each partition that unidentified senders (``node-<id>`` keys) claimed to
        hold: the epsilon of its own history plus every such claimed charge. A resume with
        a wrong ``node-partitions`` map (its node charged as ``node-<id>``) and then
        without one split a partition's releases over two keys, each below the budget
        while the partition was over it; this is the partition's figure over both."""
        claimed: dict[str, list[PrivacyEvent]] = {}
        for c in self.charges:
            if c.get("source", "client") == "client" and "claimed-partition" in c \
                    and not is_client_key(c["client"]):
                claimed.setdefault(client_key(c["claimed-partition"]), []).extend(
                    PrivacyEvent(**e) for e in c["events"])
        return {client: PrivacyHistory(self.history(client).events + events).epsilon(
                    self.delta, self.accountant)
                for client, events in claimed.items()}

    def server_charges(self) -> list[dict[str, Any]]:
        """The server's own releases in :attr:`charges` (one entry per covered client)."""
        return [c for c in self.charges if c.get("source") == "server"]

    def mismatches_in(self, server_round: int) -> list[dict[str, Any]]:
        return [m for m in self.mismatches if m["round"] == server_round]

    def would_exceed(self, client: str, event: PrivacyEvent, budget: float) -> bool:
        """Would charging ``event`` to ``client`` pass ``budget``? (for selection)"""
        return self.history(client).would_exceed(event, budget, self.delta, self.accountant)[0]

    def rounds(self, client: str) -> list[int]:
        """Rounds in which something was charged to ``client`` (its own or the server's)."""
        return self.history(client).rounds

    def epsilon_by_round(self, client: str) -> list[tuple[int, float]]:
        """Cumulative epsilon after each round charged to the client (RDP prefix sums)."""
        history = self.history(client)
        if not history.events:
            return []
        out = []
        for r in history.rounds:
            prefix = [e for e in history.events if e.round <= r]
            if self.accountant == "rdp":
                out.append((r, rdp_to_epsilon(history.unit, history_rdp(prefix), self.delta)))
            else:
                out.append((r, PrivacyHistory(prefix).epsilon(self.delta, self.accountant)))
        return out

    def _client_json(self, client: str, eps: float, recomputed: float,
                     over: bool) -> dict[str, Any]:
        """``client``'s entry of ``ledger.json``'s ``clients``."""
        own = self.clients[client]
        history = self.history(client)
        return {"unit": history.unit, "adaptive": own.adaptive, "epsilon": eps,
                "recomputed-epsilon": recomputed, "over-budget": over,
                "reported-epsilon": self.reported.get(client), "rounds": history.rounds,
                "events": [e.to_dict() for e in own.events],
                "server-events": [e.to_dict() for e in self.server.get(client, [])]}

    def population_only(self, client: str) -> bool:
        """Whether everything charged to ``client`` is the population's releases (its
        entry is then the same as every other such client's)."""
        own = self.clients[client]
        return (not own.events and client not in self.server and client not in self.reported
                and bool(self.population_events) and client in self._population_set())

    def shared_entries(self, keys: Mapping[str, Hashable],
                       build: Callable[[str], T]) -> dict[str, T]:
        """``build(client)`` for every client of ``keys``, in its order. The clients charged
        by population releases alone (every client of a central run with Poisson sampling)
        whose ``keys`` and adaptivity are equal share one entry, built once: their histories
        are the same. At 10,000 clients, building each entry walked the shared history
        10,000 times (``ledger.json``: ~0.1 s of the server's serial time a round)."""
        shared: dict[tuple[bool, Hashable], T] = {}
        out: dict[str, T] = {}
        for client, key in keys.items():
            if not self.population_only(client):
                out[client] = build(client)
                continue
            both = (self.clients[client].adaptive, key)
            if both not in shared:
                shared[both] = build(client)
            out[client] = shared[both]
        return out

    def to_json(self) -> dict[str, Any]:
        recomputed = self.recomputed_all()
        eps = {c: max(e, self.reported.get(c, 0.0)) for c, e in recomputed.items()}
        over = self.over_budget(eps)
        clients = self.shared_entries(
            {c: (eps[c], recomputed[c], c in over) for c in eps},
            lambda c: self._client_json(c, eps[c], recomputed[c], c in over))
        return {
            "delta": self.delta, "accountant": self.accountant, "budget": self.budget,
            "over-budget": sorted(over, key=client_order),
            "clients": clients,
            "population": {"clients": self.population,
                           "events": [e.to_dict() for e in self.population_events]},
            "mismatches": self.mismatches,
            "charges": self.charges,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Ledger":
        ledger = cls(float(data["delta"]), str(data["accountant"]))
        if data.get("budget") is not None:
            ledger.budget = float(data["budget"])
        for c, d in data.get("clients", {}).items():
            ledger.clients[c] = PrivacyHistory([PrivacyEvent(**e) for e in d["events"]],
                                               bool(d.get("adaptive", False)))
            if d.get("server-events"):
                ledger.server[c] = [PrivacyEvent(**e) for e in d["server-events"]]
            if d.get("reported-epsilon") is not None:
                ledger.reported[c] = float(d["reported-epsilon"])
        population = data.get("population") or {}
        ledger.population = [str(c) for c in population.get("clients", [])]
        ledger.population_events = [PrivacyEvent(**e) for e in population.get("events", [])]
        ledger.mismatches = list(data.get("mismatches", []))
        ledger.charges = list(data.get("charges", []))
        return ledger

    def continue_from(self, recorded: "Ledger") -> None:
        """Take over ``recorded``'s privacy history, in place (a resume: the run's one
        ledger, which the server's guard was built with, continues the history on disk);
        the budget stays this run's."""
        for f in fields(self):
            if f.name != "budget":
                setattr(self, f.name, getattr(recorded, f.name))
        vars(self).pop("_pop_cache", None)   # the population set of the old history

    def save(self, path: Path) -> str:
        """Write ``ledger.json`` atomically and durably (the privacy history must survive
        a kill at any instant: old version or new, never a torn file); returns the text
        written."""
        data = self.to_json()
        # indented for a person up to LEDGER_INDENT_CLIENTS clients; beyond, compact (Python's
        # indenting encoder took ~0.2 s a round at 10,000 clients, the C encoder a fraction)
        indent = 1 if len(data["clients"]) <= LEDGER_INDENT_CLIENTS else None
        text = json.dumps(data, indent=indent)
        atomic_write_text(path, text)
        return text

    @classmethod
    def load(cls, path: Path) -> "Ledger":
        """Read ``ledger.json``; a missing, empty, damaged or non-ledger file is a
        :class:`UserError` naming it (never an empty history)."""
        return cls.read(path)[0]

    @classmethod
    def read(cls, path: Path) -> tuple["Ledger", dict[str, Any]]:
        """(the ledger, ``ledger.json``'s raw data), or a :class:`UserError` naming the file
        when it is missing, empty, damaged or not a valid privacy ledger (every field,
        charge, mismatch and event checked; delta in (0, 1); a known accountant)."""
        data = read_json_file(path, "privacy ledger")
        if not isinstance(data, dict):
            raise UserError(f"{path}: not a privacy ledger (a JSON {type(data).__name__}, "
                            "not an object)")
        missing = [k for k in ("delta", "accountant", "clients") if k not in data]
        if missing:
            raise UserError(f"{path}: not a privacy ledger (no {', '.join(map(repr, missing))})")
        try:
            if not isinstance(data["clients"], dict) or not all(
                    isinstance(d, dict) and isinstance(d.get("events"), list)
                    for d in data["clients"].values()):
                raise ValueError("'clients' must map each client to its 'events' list")
            for key, fields in (("charges", ("client", "round", "note", "events")),
                                ("mismatches", ("client", "round", "reported", "recomputed"))):
                entries = data.get(key, [])
                if not isinstance(entries, list) or not all(
                        isinstance(e, dict) and all(f in e for f in fields) for e in entries):
                    raise ValueError(f"each of {key!r} needs {', '.join(fields)}")
            ledger = cls.from_json(data)
            for c in ledger.charges:
                for e in c["events"]:
                    PrivacyEvent(**e)  # validates it
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UserError(f"{path}: not a valid privacy ledger ({one_line(exc)})") from exc
        if not 0.0 < ledger.delta < 1.0:
            raise UserError(f"{path}: not a valid privacy ledger (delta {ledger.delta} not in "
                            "(0, 1))")
        if ledger.accountant not in ACCOUNTANTS:
            raise UserError(f"{path}: not a valid privacy ledger (accountant "
                            f"{ledger.accountant!r} not one of {', '.join(ACCOUNTANTS)})")
        return ledger, data

    @property
    def last_round(self) -> int:
        """The latest round anything was charged for (0 when nothing was)."""
        return max((int(c["round"]) for c in self.charges), default=0)

    def restore(self, charges: Sequence[Mapping[str, Any]], origin: str,
                population: Sequence[str] = (), adaptive: bool = False) -> list[str]:
        """Add every charge of ``charges`` (entries of another record of this run: the
        checkpoint's ledger copy, or ``rounds.jsonl``'s) that this ledger lacks, counted as
        a multiset (the same charge twice is two releases); return the clients that got
        charges back. A ledger is never behind the run's own records: the largest history
        per client wins. ``population``: the clients a population release covers when
        this ledger has none recorded yet."""
        have = Counter(charge_key(c) for c in self.charges)
        touched: list[str] = []
        for c in charges:
            key = charge_key(c)
            if have[key] > 0:
                have[key] -= 1
                continue
            events = [PrivacyEvent(**e) for e in c["events"]]
            source = c.get("source", "client")
            client = str(c["client"])
            if source == "population":
                if not self.population:
                    self.population = list(population)
                for name in self.population:
                    self.clients.setdefault(name, PrivacyHistory(adaptive=adaptive))
                self.population_events.extend(events)
            else:
                history = self.clients.setdefault(client, PrivacyHistory(adaptive=adaptive))
                history_unit(self.history(client).events + events)
                if source == "server":
                    self.server.setdefault(client, []).extend(events)
                else:
                    for e in events:
                        history.charge(e)
            self.charges.append({**c, "restored-from": origin})
            touched.append(client)
        return touched


def charge_key(charge: Mapping[str, Any]) -> str:
    """What identifies one charge across a run's records (not where it was restored from)."""
    return json.dumps({"client": charge["client"], "round": int(charge["round"]),
                       "source": charge.get("source", "client"), "events": charge["events"]},
                      sort_keys=True)


def client_order(name: str) -> tuple[int, str]:
    tail = name.rsplit("-", 1)[-1]
    return (int(tail), name) if tail.isdigit() else (1 << 30, name)


def ledger_config(ledger: Ledger, client: str | None = None) -> dict[str, list[Any]]:
    """Every client's recorded events (or only ``client``'s) as flat ConfigRecord lists
    (``ledger-*`` keys; empty when there are none)."""
    pids: list[int] = []
    events: list[PrivacyEvent] = []
    for key in (ledger.clients if client is None else [client]):
        # only partitions' histories (a node-<id> key is a sender whose partition is not
        # known: its number is a node id, not a partition id)
        if not is_client_key(key) or key not in ledger.clients:
            continue
        pid = client_order(key)[0]
        for e in ledger.clients[key].events:
            pids.append(pid)
            events.append(e)
    if not pids:
        return {}
    return {"ledger-client": pids, **encode_events(events, LEDGER_PREFIX)}


def prior_history(config: Mapping[str, Any], partition_id: int) -> PrivacyHistory | None:
    """The events the server recorded for ``partition_id`` (None if it sent none); a
    malformed record (a missing column, lists of different lengths) is a ValueError."""
    if "ledger-client" not in config:
        return None
    owners = list(config["ledger-client"])
    if len(owners) != len(config.get(f"{LEDGER_PREFIX}round", [])):
        raise ValueError("privacy record 'ledger-*': lists have different lengths")
    idx = [i for i, pid in enumerate(owners) if int(pid) == partition_id]
    return PrivacyHistory(decode_events(config, LEDGER_PREFIX, rows=idx))


SERVER_EVENTS_PREFIX = "server-event-"


def server_events_config(ledger: Ledger, client: str) -> dict[str, list[Any]]:
    """The server's own releases charged to ``client`` so far, as flat ConfigRecord lists
    (``server-event-*`` keys; empty when there are none). Sent with every instruction so
    the client's budget check counts what the server spent on its behalf."""
    events = ledger.server.get(client, [])
    return encode_events(events, SERVER_EVENTS_PREFIX) if events else {}


def server_events_from(config: Mapping[str, Any]) -> list[PrivacyEvent]:
    """The events :func:`server_events_config` put into an instruction (none if absent);
    a malformed record is a ValueError (the client then refuses to guess)."""
    if f"{SERVER_EVENTS_PREFIX}round" not in config:
        return []
    return decode_events(config, SERVER_EVENTS_PREFIX)
