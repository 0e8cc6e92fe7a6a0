"""What the server charges for one received update (plain logic, no Flower).

A private run's server knows the plan it asked for (:mod:`dpfl.privacy.plan`). An update
that reached the server was released to it whatever happens next, so:

- a reply whose privacy record is valid and equals the plan (and whose clipping bound is
  the configured one) is charged the reported events;
- a reply with no privacy record, a malformed one, mechanism ``none``, or parameters that
  differ from the plan (sigma, rate, steps, relation, clip) is *rejected* and charged the
  costlier of the plan and what it reported (when that parses): the server's figure can
  never be talked below the planned cost, nor below what the client says it spent;
- replies that carry no update (an error, a refusal) are charged nothing.

"Costlier" compares the client's epsilon after each candidate with the run's accountant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from dpfl.numbers import is_number
from dpfl.privacy.accounting.budget import PrivacyHistory
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.plan import plan_problem

CLIP_RTOL = 1e-9


@dataclass
class Charge:
    """Events to charge to one client for one received update, and why."""

    client: str
    round: int
    events: list[PrivacyEvent]
    note: str
    problem: str | None = None      # why the reply must be rejected (None = privacy fine)
    reported_epsilon: float | None = None
    adaptive: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def reported_events(privacy: Mapping[str, Any] | None) -> tuple[list[PrivacyEvent] | None,
                                                                 str | None]:
    """(events, None) from a reply's privacy record, or (None, the reason it is unusable)."""
    if privacy is None:
        return None, "reply has no privacy record"
    if privacy.get("mechanism") == "none":
        return None, "privacy record says mechanism 'none' in a private run"
    try:
        events = PrivacyHistory.from_record(privacy).events
    except Exception as exc:  # wrong types, unequal lists, unknown mechanism, bad values
        return None, f"privacy record is malformed: {type(exc).__name__}: {exc}"
    if not events:
        return None, "privacy record has no events"
    return events, None


def costlier(history: PrivacyHistory, a: list[PrivacyEvent], b: list[PrivacyEvent],
             delta: float, accountant: str) -> list[PrivacyEvent]:
    """The candidate whose charge leaves ``history`` at the higher epsilon."""
    def after(events: list[PrivacyEvent]) -> float:
        try:
            return PrivacyHistory(history.events + events).epsilon(delta, accountant)
        except ValueError:  # e.g. a reported event of another unit: cannot be composed
            return float("-inf")
    return b if after(b) > after(a) else a


def charge_for(client: str, server_round: int, privacy: Mapping[str, Any] | None,
               plan: PrivacyEvent, planned_clip: float, history: PrivacyHistory,
               delta: float, accountant: str, reported_epsilon: float | None = None,
               reported: tuple[list[PrivacyEvent] | None, str | None] | None = None
               ) -> Charge:
    """The charge for one received update of ``client`` (see module docstring).
    ``reported``: :func:`reported_events` of ``privacy`` when the caller parsed it already
    (a reply is read once: :mod:`dpfl.server.reply`)."""
    events, problem = reported if reported is not None else reported_events(privacy)
    if events is not None:
        if len(events) != 1:
            problem = f"privacy record has {len(events)} events, the plan has 1"
        else:
            problem = plan_problem(events[0], plan)
        clip = privacy.get("clip") if privacy is not None else None
        if problem is None and (not is_number(clip)
                                or abs(float(clip) - planned_clip)
                                > CLIP_RTOL * max(planned_clip, 1e-300)):
            problem = f"clip {clip!r} differs from the plan {planned_clip:g}"
    adaptive = bool(privacy.get("adaptive", False)) if privacy is not None else history.adaptive
    if problem is None:
        assert events is not None  # reported_events gives events whenever no problem
        return Charge(client, server_round, list(events), "reported = plan",
                      reported_epsilon=reported_epsilon, adaptive=adaptive)
    charged = [plan] if events is None else costlier(history, [plan], list(events), delta,
                                                     accountant)
    which = "plan" if charged == [plan] else "reported (costlier than the plan)"
    return Charge(client, server_round, charged, f"charged the {which}: {problem}",
                  problem=f"privacy record does not match the plan: {problem}",
                  reported_epsilon=reported_epsilon, adaptive=adaptive)
