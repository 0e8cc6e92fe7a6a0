"""Privacy events and the epsilon of a history of them.

An event is one charge with public parameters: a DP-SGD run (sigma, Poisson rate q, steps),
a Gaussian release (sigma, optional Poisson rate), or a pure-epsilon release (Laplace, the
sparse-vector technique). Epsilon always comes from the field's libraries:

- ``dpsgd`` events (sample-level): accountant ``rdp``: Opacus' RDP analysis
  (``compute_rdp`` summed over the history, ``get_privacy_spent``), exactly what
  ``opacus.accountants.RDPAccountant`` does; ``prv``: Opacus' PRV accountant; ``pld``:
  dp-accounting's ``PLDAccountant`` on ``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))``
  composed ``steps`` times (add-remove).
- client-level events: dp-accounting's ``RdpAccountant`` (``rdp``) or ``PLDAccountant``
  (``pld``); ``prv`` is refused (it is Opacus' DP-SGD accountant). Laplace releases use
  the exact Laplace RDP/PLD; a generic pure eps-DP release (sparse vector) enters RDP
  through eps-DP => (alpha, min(eps, alpha eps^2 / 2))-RDP (Bun & Steinke 2016); under
  ``pld`` a history with sparse-vector events takes the smaller of that RDP bound and
  basic composition (dp-accounting has no event for a generic pure eps-DP release).

What an event's mechanism means for its accounting (unit, parameters taken, one-step RDP
curve, dp-accounting event, whether ``epsilon`` is a pure cost or a surcharge) is said by
ONE class per mechanism, registered in :mod:`dpfl.privacy.accounting.event_types`
(:attr:`PrivacyEvent.kind`); this module composes histories and never branches on a
mechanism's name. Every non-Opacus path (RDP curves, PLD) turns an event into a
dp-accounting ``DpEvent`` through ONE function, :func:`dpfl.privacy.accounting.accountants.dp_event_of`
(:meth:`PrivacyEvent.to_dp_event`), which asks the event's type.

``pld`` is the tightest valid choice for both units. Its epsilon, like every epsilon here,
is computed from the history's canonical signature (:func:`history_signature`: distinct
event keys with their summed step counts, sorted), so equal histories in any order give
bit-identical values and share a cache. If the PLD grid would be too large, the PLD
accountant falls back to a coarser discretisation, then to RDP (both upper bounds);
:func:`history_epsilon_detail` says which was used.

RDP curves add under composition, so the epsilon of many histories is computed by building
each distinct event's curve once and combining them with one matrix product
(:func:`histories_epsilon`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from dp_accounting import dp_event

from dpfl.numbers import is_finite_number
from dpfl.privacy.accounting.accountants import (
    DPSGD_ACCOUNTANTS,
    MECHANISMS,
    PRV_CLIENT_LEVEL,
    dp_event_of,
    dpsgd_history_epsilon_detail,
    events_epsilon_detail,
)
from dpfl.privacy.accounting.event_types import (
    RELATIONS,
    EventKey,
    EventType,
    event_type,
    mechanisms,
)

__all__ = ["ACCOUNTANTS", "MECHANISMS", "PRV_CLIENT_LEVEL", "PrivacyEvent", "dp_event_of",
           "histories_epsilon", "history_epsilon", "history_epsilon_detail", "history_rdp",
           "history_signature", "history_terms", "history_unit", "orders_for", "rdp_curve",
           "rdp_to_epsilon"]

ACCOUNTANTS = DPSGD_ACCOUNTANTS  # rdp and pld for both units, prv for DP-SGD only
# A history's canonical signature: ((event key, total steps), ...), see history_signature
Signature = tuple[tuple[EventKey, int], ...]


@dataclass(frozen=True)
class PrivacyEvent:
    """One charge. ``sigma`` is noise std / sensitivity; ``rate`` a Poisson sampling rate;
    ``steps`` how many times the release is repeated; ``epsilon`` the cost of a pure event
    or the surcharge of an integer-noise one (what it means is the mechanism's, see
    :attr:`kind`).

    ``mechanism`` names a type registered in :mod:`dpfl.privacy.accounting.event_types`
    (:attr:`kind`), which knows the event's unit, RDP curve and dp-accounting event. A
    parameter the event's accounting would ignore is refused (ValueError, see
    :meth:`dpfl.privacy.accounting.event_types.EventType.check`): ``rate`` below 1 or ``sigma`` on a
    pure event, ``epsilon`` on a Gaussian one, a DP-SGD event not under add-remove, and a
    rate below 1 under replace-one."""

    round: int
    mechanism: str
    sigma: float = 0.0
    rate: float = 1.0
    steps: int = 1
    epsilon: float = 0.0
    relation: str = "add-remove"

    def __post_init__(self) -> None:
        if not all(is_finite_number(v)
                   for v in (self.sigma, self.rate, self.epsilon, self.steps, self.round)):
            raise ValueError("event parameters must be finite numbers")
        if int(self.steps) != self.steps or int(self.round) != self.round:
            raise ValueError("round and steps must be integers")
        kind = event_type(self.mechanism)
        if self.relation not in RELATIONS:
            raise ValueError(f"unknown relation {self.relation!r}")
        if kind.pure and self.epsilon <= 0:
            raise ValueError("a pure event needs epsilon > 0")
        if not kind.pure and self.sigma <= 0:
            raise ValueError("a Gaussian event needs sigma > 0")
        if not 0.0 < self.rate <= 1.0 or self.steps < 0:
            raise ValueError("rate must be in (0, 1] and steps >= 0")
        kind.check(self.key)  # nothing its accounting would ignore

    @classmethod
    def dpsgd(cls, round_: int, sigma: float, rate: float, steps: int) -> "PrivacyEvent":
        return cls(round_, "dpsgd", sigma=sigma, rate=rate, steps=steps)

    @classmethod
    def gaussian(cls, round_: int, sigma: float, rate: float = 1.0, steps: int = 1,
                 relation: str = "add-remove", mechanism: str = "gaussian") -> "PrivacyEvent":
        return cls(round_, mechanism, sigma=sigma, rate=rate, steps=steps, relation=relation)

    @classmethod
    def pure(cls, round_: int, epsilon: float, mechanism: str = "laplace",
             steps: int = 1, relation: str = "add-remove") -> "PrivacyEvent":
        """A pure epsilon-DP release; ``relation`` records the neighbouring relation its
        epsilon was derived under (its accounting uses epsilon alone)."""
        return cls(round_, mechanism, epsilon=epsilon, steps=steps, relation=relation)

    @property
    def kind(self) -> EventType:
        """The registered type of this event's mechanism."""
        return event_type(self.mechanism)

    @property
    def unit(self) -> str:
        return self.kind.unit

    @property
    def key(self) -> EventKey:
        """Everything but the round and step count: events with equal keys share a curve."""
        return (self.mechanism, float(self.sigma), float(self.rate), float(self.epsilon),
                self.relation)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_dp_event(self) -> dp_event.DpEvent:
        """ONE step of this event as a dp-accounting ``DpEvent`` (:func:`dp_event_of`)."""
        return dp_event_of(self.key)


# ---------------------------------------------------------------------------------------
# RDP curves


def _opacus_orders() -> np.ndarray:
    from opacus.accountants import RDPAccountant

    return np.asarray(RDPAccountant.DEFAULT_ALPHAS, dtype=float)


def _dp_accounting_orders() -> np.ndarray:
    from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS

    return np.asarray(DEFAULT_RDP_ORDERS, dtype=float)


def orders_for(unit: str) -> np.ndarray:
    """The RDP orders of a unit's accountant (Opacus for samples, dp-accounting else)."""
    return _opacus_orders() if unit == "sample" else _dp_accounting_orders()


@lru_cache(maxsize=4096)
def rdp_curve(key: EventKey) -> np.ndarray:
    """RDP of ONE step of the event with this key, at :func:`orders_for` its unit: its
    registered type's curve (:meth:`dpfl.privacy.accounting.event_types.EventType.curve`)."""
    kind = event_type(key[0])
    kind.check(key)
    return kind.curve(orders_for(kind.unit), key)


def rdp_to_epsilon(unit: str, rdp: np.ndarray, delta: float) -> float:
    """(epsilon, delta) from an RDP curve with the unit's library conversion."""
    if not np.any(rdp > 0):
        return 0.0
    if unit == "sample":
        from opacus.accountants.analysis.rdp import get_privacy_spent

        eps, _ = get_privacy_spent(orders=list(_opacus_orders()), rdp=list(rdp), delta=delta)
        return float(eps)
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    eps, _ = compute_epsilon(_dp_accounting_orders(), rdp, delta)
    return float(eps)


def history_unit(events: Sequence[PrivacyEvent]) -> str:
    units = {e.unit for e in events}
    if len(units) > 1:
        raise ValueError("a history mixes sample-level and client-level events")
    return units.pop() if units else "sample"


def history_terms(events: Sequence[PrivacyEvent]) -> tuple[str, str]:
    """(relation, sampling) as the history's events were accounted: the neighbouring
    relation(s) of its events ("+"-joined when they differ) and "poisson" when some event
    is Poisson-subsampled (rate < 1), else "none" ("-" for an empty history). What a
    report prints beside the epsilon, read from the charges, never from the config."""
    charged = [e for e in events if e.steps > 0]
    if not charged:
        return "-", "-"
    relation = "+".join(sorted({e.relation for e in charged}))
    return relation, "poisson" if any(e.rate < 1.0 for e in charged) else "none"


def history_rdp(events: Sequence[PrivacyEvent]) -> np.ndarray:
    """The RDP curve of a history (curves add under composition)."""
    unit = history_unit(events)
    total = np.zeros(len(orders_for(unit)))
    for e in events:
        if e.steps:
            total = total + e.steps * rdp_curve(e.key)
    return total


def _pure_bound(unit: str, events: Sequence[PrivacyEvent], eps_rdp: float,
                delta: float) -> float:
    """For histories with pure-epsilon events also use basic composition on them:
    eps <= eps(Gaussian part, delta) + sum of pure eps. Both bounds hold; take the smaller
    (the RDP route adds log(1/delta)/(alpha - 1) and can lose to the plain sum)."""
    pure = [e for e in events if e.kind.pure]
    if not pure:
        return eps_rdp
    rest = [e for e in events if not e.kind.pure and e.steps > 0]
    eps_rest = rdp_to_epsilon(unit, history_rdp(rest), delta) if rest else 0.0
    return min(eps_rdp, eps_rest + sum(e.epsilon * e.steps for e in pure))


def history_signature(events: Iterable[PrivacyEvent]) -> Signature:
    """Canonical signature of a (non-adaptive) history: ((event key, total steps), ...)
    sorted, zero-step events dropped. Composition is order-free, so this is all the
    accountant needs; equal signatures have equal epsilons."""
    steps: dict[EventKey, int] = {}
    for e in events:
        if e.steps > 0:
            steps[e.key] = steps.get(e.key, 0) + int(e.steps)
    return tuple(sorted(steps.items()))


def _events_of(signature: Signature) -> list[PrivacyEvent]:
    return [PrivacyEvent(0, m, sigma=s, rate=r, steps=n, epsilon=eps, relation=rel)
            for (m, s, r, eps, rel), n in signature]


@lru_cache(maxsize=8192)
def _signature_epsilon(signature: Signature, delta: float,
                       accountant: str) -> tuple[float, str]:
    events = _events_of(signature)
    unit = history_unit(events)
    if accountant == "rdp":
        eps = rdp_to_epsilon(unit, history_rdp(events), delta)
        return _pure_bound(unit, events, eps, delta), "rdp"
    if unit == "sample":
        return dpsgd_history_epsilon_detail([(e.sigma, e.rate, e.steps) for e in events],
                                            delta, accountant)
    if accountant == "prv":
        raise ValueError(PRV_CLIENT_LEVEL)
    no_event = {e.mechanism for e in events if e.kind.dp_event(e.key) is None}
    if not no_event:
        return events_epsilon_detail([(e.to_dp_event(), e.steps) for e in events], delta,
                                     "pld")
    rdp_only = _names({m for m in no_event if not event_type(m).pure})
    if rdp_only:  # no pld event: the RDP bound (with _pure_bound's basic composition of
        # any pure events, sparse vector included)
        return (_pure_bound(unit, events, rdp_to_epsilon(unit, history_rdp(events), delta),
                            delta), f"rdp ({rdp_only} events have no pld event)")
    return _pure_pld(unit, events, no_event, delta)


def _names(mechanisms_: set[str]) -> str:
    """Mechanism names, "/"-joined in registration order (method descriptions)."""
    return "/".join(m for m in mechanisms() if m in mechanisms_)


def _pure_pld(unit: str, events: Sequence[PrivacyEvent], no_event: set[str],
              delta: float) -> tuple[float, str]:
    """``pld`` for a history with generic pure eps-DP events without a dp-accounting event
    (``no_event``, e.g. ``sparse-vector``: no dp-accounting event has their worst-case
    privacy loss): the smaller of two valid upper bounds, the RDP route (with
    :func:`_pure_bound`) and basic composition of those pure events with the PLD epsilon of
    the rest; the method names which one was used."""
    rdp = _pure_bound(unit, events, rdp_to_epsilon(unit, history_rdp(events), delta), delta)
    pure = math.fsum(e.epsilon * e.steps for e in events if e.mechanism in no_event)
    rest = [(e.to_dp_event(), e.steps) for e in events
            if e.mechanism not in no_event and e.steps > 0]
    basic = pure + (events_epsilon_detail(rest, delta, "pld")[0] if rest else 0.0)
    if basic < rdp:
        return basic, f"pld + basic composition of {_names(no_event)} events"
    return rdp, f"rdp or basic composition ({_names(no_event)} events have no pld event)"


def history_epsilon_detail(events: Sequence[PrivacyEvent], delta: float,
                           accountant: str = "rdp") -> tuple[float, str]:
    """(epsilon, method) of a (non-adaptive) history with the named accountant.

    ``accountant``: ``rdp`` (both units), ``prv`` (sample-level only: Opacus' PRV),
    ``pld`` (both units: dp-accounting's PLD accountant). ``method`` is ``"rdp"``,
    ``"prv"``, ``"pld(interval=1e-4)"`` (the default discretisation), a coarser
    ``"pld(interval=1e-3)"``/``"pld(interval=1e-2)"`` or ``"rdp (pld fallback)"`` when
    the PLD grid would not fit (a warning is logged on ``flwr.dpfl.accounting``).
    Cached by :func:`history_signature`.
    """
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    if accountant == "prv" and history_unit(events) == "client":
        raise ValueError(PRV_CLIENT_LEVEL)  # even when nothing is charged yet
    signature = history_signature(events)
    if not signature:
        return 0.0, accountant
    return _signature_epsilon(signature, float(delta), accountant)


def history_epsilon(events: Sequence[PrivacyEvent], delta: float,
                    accountant: str = "rdp") -> float:
    """Epsilon of a (non-adaptive) history with the named accountant
    (see :func:`history_epsilon_detail`)."""
    return history_epsilon_detail(events, delta, accountant)[0]


def histories_epsilon(histories: Mapping[str, Sequence[PrivacyEvent]], delta: float,
                      accountant: str = "rdp") -> dict[str, float]:
    """Epsilon of many histories at once. RDP: each distinct event's curve is built once;
    per-client step counts (clients x distinct events) times the curves (distinct events
    x orders) give every client's RDP curve in one matrix product. Other accountants:
    :func:`history_epsilon` per history (equal histories share its cache)."""
    if accountant != "rdp":
        return {name: history_epsilon(h, delta, accountant) for name, h in histories.items()}
    out: dict[str, float] = {}
    for unit in ("sample", "client"):
        names = [n for n, h in histories.items() if h and history_unit(h) == unit]
        if not names:
            continue
        keys: dict[EventKey, int] = {}
        rows, cols, vals = [], [], []
        for i, name in enumerate(names):
            for e in histories[name]:
                j = keys.setdefault(e.key, len(keys))
                rows.append(i)
                cols.append(j)
                vals.append(e.steps)
        counts = np.zeros((len(names), len(keys)))
        np.add.at(counts, (rows, cols), vals)
        curves = np.stack([rdp_curve(k) for k in keys])
        rdp = counts @ curves
        # identical RDP rows convert once
        cache: dict[bytes, float] = {}
        for name, row in zip(names, rdp):
            b = row.tobytes()
            if b not in cache:
                cache[b] = rdp_to_epsilon(unit, row, delta)
            out[name] = cache[b]
            if any(e.kind.pure for e in histories[name]):
                out[name] = _pure_bound(unit, histories[name], out[name], delta)
    for name, h in histories.items():
        out.setdefault(name, 0.0)
    return out

