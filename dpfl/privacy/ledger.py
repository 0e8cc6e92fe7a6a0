"""The server's mirror of every client's privacy spend.

The client is the authority on its own budget (it refuses to overspend). The server keeps
a mirror: it recomputes each client's epsilon from the public parameters the client sent
(mechanism, sigma, sampling rate, steps) with the same accountant, and flags any mismatch
with the epsilon the client reported. Persisted as ``ledger.json`` in the run directory.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpfl.privacy.budget import PrivacyEntry, PrivacyHistory

log = logging.getLogger("flwr.dpfl.ledger")
MISMATCH_RTOL = 1e-3


@dataclass
class Ledger:
    """Per-client privacy histories (keyed ``client-<partition-id>``)."""

    delta: float
    accountant: str = "rdp"
    clients: dict[str, PrivacyHistory] = field(default_factory=dict)
    reported: dict[str, float] = field(default_factory=dict)
    mismatches: list[dict[str, Any]] = field(default_factory=list)

    def record(self, client: str, server_round: int, privacy: dict[str, Any],
               reported_epsilon: float) -> float:
        """Add one accepted round's charge; return the recomputed epsilon."""
        mechanism = str(privacy.get("mechanism", "none"))
        if mechanism == "none":
            return float("inf")
        relation = str(privacy.get("relation", "add-remove"))
        history = self.clients.setdefault(client, PrivacyHistory(mechanism, relation))
        history.charge(PrivacyEntry(server_round, float(privacy["noise-multiplier"]),
                                    float(privacy["sample-rate"]), int(privacy["steps"])))
        eps = history.epsilon(self.delta, self.accountant)
        self.reported[client] = float(reported_epsilon)
        if abs(eps - reported_epsilon) > MISMATCH_RTOL * max(1.0, eps):
            entry = {"client": client, "round": server_round, "reported": reported_epsilon,
                     "recomputed": eps}
            self.mismatches.append(entry)
            log.warning("ledger mismatch: %s", entry)
        return eps

    def epsilon(self, client: str) -> float:
        history = self.clients.get(client)
        return history.epsilon(self.delta, self.accountant) if history else 0.0

    def epsilons(self) -> dict[str, float]:
        return {c: self.epsilon(c) for c in sorted(self.clients, key=_client_order)}

    def rounds(self, client: str) -> list[int]:
        history = self.clients.get(client)
        return history.rounds if history else []

    def to_json(self) -> dict[str, Any]:
        return {
            "delta": self.delta, "accountant": self.accountant,
            "clients": {c: {"mechanism": h.mechanism, "relation": h.relation,
                            "epsilon": h.epsilon(self.delta, self.accountant),
                            "reported-epsilon": self.reported.get(c),
                            "events": [e.__dict__ for e in h.entries]}
                        for c, h in sorted(self.clients.items(), key=lambda kv: _client_order(kv[0]))},
            "mismatches": self.mismatches,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Ledger":
        ledger = cls(float(data["delta"]), str(data["accountant"]))
        for c, d in data.get("clients", {}).items():
            ledger.clients[c] = PrivacyHistory(d["mechanism"], d["relation"],
                                               [PrivacyEntry(**e) for e in d["events"]])
            if d.get("reported-epsilon") is not None:
                ledger.reported[c] = float(d["reported-epsilon"])
        ledger.mismatches = list(data.get("mismatches", []))
        return ledger

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "Ledger":
        return cls.from_json(json.loads(path.read_text()))


def _client_order(name: str) -> tuple[int, str]:
    tail = name.rsplit("-", 1)[-1]
    return (int(tail), name) if tail.isdigit() else (1 << 30, name)
