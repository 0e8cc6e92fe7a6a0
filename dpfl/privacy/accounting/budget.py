"""A client's own privacy history and budget: the client is the authority on its spend.

The history lives in the node's ``context.state`` (a Flower ``ConfigRecord``), so the
epsilon a client reports is cumulative over every round it took part in, in simulation and
in deployment alike. Before training, :meth:`PrivacyHistory.would_exceed` asks the
accountant whether the next round would cross the budget; if so the client refuses.

Non-adaptive histories (parameters fixed before the run) compare the composed epsilon with
the budget. Adaptive histories (parameters chosen from earlier outputs) are checked by a
:class:`~dpfl.privacy.accounting.filter.RenyiFilter` with the budget as its (epsilon, delta).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from flwr.app import ConfigRecord, RecordDict

from dpfl.privacy.accounting.events import PrivacyEvent, history_epsilon, history_unit
from dpfl.privacy.accounting.filter import RenyiFilter
from dpfl.privacy.accounting.record import decode_events, encode_events

STATE_KEY = "dpfl.privacy"
# Relative slack when comparing with the budget: calibration meets the target only to the
# accountant's own tolerance, and float noise must not turn a planned round into a refusal.
BUDGET_RTOL = 1e-6
# the first word of a client's refusal reason when the round would pass its budget (a
# refusal that will recur: the server may stop asking that client)
BUDGET_REFUSAL = "budget"


@dataclass
class PrivacyHistory:
    """Ordered privacy events of one client."""

    events: list[PrivacyEvent] = field(default_factory=list)
    adaptive: bool = False

    def epsilon(self, delta: float, accountant: str = "rdp",
                extra: PrivacyEvent | None = None) -> float:
        """Composed epsilon (for an adaptive history: the running RDP value, which is only
        informative; the guarantee is the filter's budget)."""
        events = self.events + ([extra] if extra is not None else [])
        return history_epsilon(events, delta, accountant)

    def would_exceed(self, event: PrivacyEvent, budget: float, delta: float,
                     accountant: str = "rdp") -> tuple[bool, float]:
        """(refuse?, epsilon after the event). Adaptive histories are decided by the Rényi
        filter, and the epsilon returned is then the filter's (its RDP conversion), not
        ``accountant``'s: the figure the refusal was decided on."""
        if self.adaptive:
            unit = history_unit(self.events + [event])
            return RenyiFilter(budget, delta, unit).decide(self.events, event)
        eps_after = self.epsilon(delta, accountant, extra=event)
        return eps_after > budget * (1.0 + BUDGET_RTOL), eps_after

    def charge(self, event: PrivacyEvent) -> None:
        self.events.append(event)

    @property
    def rounds(self) -> list[int]:
        return sorted({e.round for e in self.events})

    @property
    def unit(self) -> str:
        return history_unit(self.events)

    def merge(self, other: "PrivacyHistory") -> bool:
        """Adopt events of ``other`` for rounds this history lacks (conservative: a charge
        is never dropped). Returns True when something was added."""
        have = set(self.rounds)
        extra = [e for e in other.events if e.round not in have]
        self.events = sorted(self.events + extra, key=lambda e: e.round)
        return bool(extra)

    # -- persistence in context.state / messages -----------------------------------------
    def to_record(self) -> ConfigRecord:
        return ConfigRecord({**encode_events(self.events), "adaptive": self.adaptive})

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "PrivacyHistory":
        events = decode_events(record)
        return cls(events, bool(record.get("adaptive", False)))

    @classmethod
    def load(cls, state: RecordDict, adaptive: bool = False) -> "PrivacyHistory":
        """The history kept in a ``context.state`` RecordDict (empty if none yet)."""
        if STATE_KEY in state:
            return cls.from_record(state[STATE_KEY])
        return cls(adaptive=adaptive)

    def save(self, state: RecordDict) -> None:
        state[STATE_KEY] = self.to_record()
