"""A client's own privacy history and budget: the client is the authority on its spend.

The history lives in the node's ``context.state`` (a Flower ``ConfigRecord``), so the
epsilon a client reports is cumulative over every round it took part in, in simulation and
in deployment alike. Before training, :meth:`PrivacyHistory.would_exceed` asks the
accountant whether the next round would cross the budget; if so the client refuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flwr.app import ConfigRecord

from dpfl.privacy.accounting import dpsgd_history_epsilon, events_epsilon, gaussian_event

STATE_KEY = "dpfl.privacy"
MECHANISMS = ("dpsgd", "gaussian-update")
# Relative slack when comparing with the budget: calibration meets the target only to the
# accountant's own tolerance, and float noise must not turn a planned round into a refusal.
BUDGET_RTOL = 1e-6


@dataclass
class PrivacyEntry:
    """One round's charge: ``steps`` releases with noise ``sigma`` at sampling rate ``rate``."""

    round: int
    sigma: float
    rate: float
    steps: int


@dataclass
class PrivacyHistory:
    """Ordered privacy charges of one client under one mechanism.

    ``dpsgd``: sample-level, add-remove, Poisson sampling; epsilon from Opacus' accountant
    (``accountant`` = rdp | prv). ``gaussian-update``: client-level, the whole clipped update
    released with Gaussian noise once per round it takes part in (no sampling amplification
    is claimed); epsilon from dp-accounting (rdp | pld; ``prv`` maps to pld).
    """

    mechanism: str
    relation: str = "add-remove"
    entries: list[PrivacyEntry] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mechanism not in MECHANISMS:
            raise ValueError(f"mechanism must be one of {MECHANISMS}, got {self.mechanism!r}")

    # -- accounting -----------------------------------------------------------------
    def epsilon(self, delta: float, accountant: str = "rdp",
                extra: PrivacyEntry | None = None) -> float:
        entries = self.entries + ([extra] if extra is not None else [])
        if self.mechanism == "dpsgd":
            return dpsgd_history_epsilon([(e.sigma, e.rate, e.steps) for e in entries],
                                         delta, accountant)
        events = [(gaussian_event(e.sigma, relation=self.relation), e.steps) for e in entries]
        return events_epsilon(events, delta, "rdp" if accountant == "rdp" else "pld")

    def would_exceed(self, entry: PrivacyEntry, budget: float, delta: float,
                     accountant: str = "rdp") -> tuple[bool, float]:
        """(refuse?, epsilon after the entry). Refuse when it would pass the budget."""
        eps_after = self.epsilon(delta, accountant, extra=entry)
        return eps_after > budget * (1.0 + BUDGET_RTOL), eps_after

    def charge(self, entry: PrivacyEntry) -> None:
        self.entries.append(entry)

    @property
    def rounds(self) -> list[int]:
        return [e.round for e in self.entries]

    # -- persistence in context.state -------------------------------------------------
    def to_record(self) -> ConfigRecord:
        return ConfigRecord({
            "mechanism": self.mechanism,
            "relation": self.relation,
            "round": [int(e.round) for e in self.entries],
            "sigma": [float(e.sigma) for e in self.entries],
            "rate": [float(e.rate) for e in self.entries],
            "steps": [int(e.steps) for e in self.entries],
        })

    @classmethod
    def from_record(cls, record: ConfigRecord) -> "PrivacyHistory":
        n = len(record.get("round", []))
        entries = [PrivacyEntry(int(record["round"][i]), float(record["sigma"][i]),
                                float(record["rate"][i]), int(record["steps"][i]))
                   for i in range(n)]
        return cls(str(record["mechanism"]), str(record["relation"]), entries)

    @classmethod
    def load(cls, state, mechanism: str, relation: str = "add-remove") -> "PrivacyHistory":
        """The history kept in a ``context.state`` RecordDict (empty if none yet)."""
        if STATE_KEY in state:
            history = cls.from_record(state[STATE_KEY])
            if history.mechanism != mechanism or history.relation != relation:
                raise ValueError(f"node state holds a {history.mechanism}/{history.relation} "
                                 f"history; this run uses {mechanism}/{relation}")
            return history
        return cls(mechanism, relation)

    def save(self, state) -> None:
        state[STATE_KEY] = self.to_record()
