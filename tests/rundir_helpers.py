"""Small run directories written the way the ServerApp writes them (dpfl/apps/server.py):
a ``rounds.jsonl`` line after each round with the round's charges and every client's
epsilon figure, ``ledger.json``, and at the end ``summary.json`` and ``config.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.accounting.ledger import Ledger

GUARANTEE = {"verdict": "formal", "unit": "client", "relation": "replace-one",
             "sampling": "none", "delta": 1e-5, "accountant": "rdp", "scope": "test run"}


class RunWriter:
    """Charges a real :class:`Ledger` round by round and records what the server would."""

    def __init__(self, path: Path, ledger: Ledger) -> None:
        self.path, self.ledger = Path(path), ledger
        self.lines: list[dict[str, Any]] = []
        self._charges: list[dict[str, Any]] = []

    def charge(self, client: str, server_round: int, events: list[PrivacyEvent],
               reported: float | None = None, late: bool = False,
               logged: bool = True) -> None:
        """One received update (``logged=False``: charged but never in a round line, e.g.
        a reply that arrived after the last round)."""
        self.ledger.record(client, server_round, events, reported, "reported = plan")
        if logged:
            self._charges.append({"client": client, "round": server_round,
                                  "note": "reported = plan", "late": late,
                                  "events": [e.to_dict() for e in events]})

    def end_round(self, server_round: int) -> dict[str, Any]:
        line = {"round": server_round, "epsilon": self.ledger.epsilons(),
                "charges": self._charges,
                "ledger-mismatches": self.ledger.mismatches_in(server_round)}
        self._charges = []
        self.lines.append(line)
        return line

    def write(self, summary: bool = True, guarantee: dict[str, Any] | None = None) -> Path:
        """ledger.json, rounds.jsonl, config.json and (``summary``) summary.json."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.ledger.save(self.path / "ledger.json")
        (self.path / "rounds.jsonl").write_text("".join(json.dumps(line) + "\n"
                                                        for line in self.lines))
        (self.path / "config.json").write_text(json.dumps(
            {"delta": self.ledger.delta, "accountant": self.ledger.accountant}))
        if summary:
            (self.path / "summary.json").write_text(json.dumps(
                summary_of(self.ledger, guarantee or GUARANTEE)))
        return self.path


def summary_of(ledger: Ledger, guarantee: dict[str, Any]) -> dict[str, Any]:
    """The privacy part of summary.json as the ServerApp's ``finish`` writes it."""
    return {"guarantee": guarantee, "epsilon-budget": None,
            "clients": {c: {"epsilon": e, "recomputed-epsilon": ledger.recomputed(c),
                            "rounds": ledger.rounds(c),
                            "reported-epsilon": ledger.reported.get(c)}
                        for c, e in ledger.epsilons().items()},
            "ledger-mismatches": len(ledger.mismatches), "mismatches": ledger.mismatches}


def lines_from_ledger(ledger: Ledger) -> list[dict[str, Any]]:
    """Round lines for a ledger charged beforehand: the clients' own charges of each round
    and, per client, the epsilon figure after it (the last line: every client's figure)."""
    rounds = sorted({c["round"] for c in ledger.charges})
    lines = []
    for r in rounds:
        charges = [{"client": c["client"], "round": r, "note": c["note"], "late": False,
                    "events": c["events"]}
                   for c in ledger.charges if c["round"] == r and c["source"] == "client"]
        eps = {c: max([e for q, e in ledger.epsilon_by_round(c) if q <= r], default=0.0)
               for c in ledger.clients}
        lines.append({"round": r, "epsilon": eps, "charges": charges})
    if lines:
        lines[-1]["epsilon"] = ledger.epsilons()
    return lines
