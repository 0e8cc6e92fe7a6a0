"""One codec for the privacy record (issue 50): the four wire formats (a reply's ``privacy``
record and the node state, ``ledger-*``, ``server-event-*``, ``plan-*``) round-trip through
dpfl.privacy.accounting.record, and a malformed one is a ValueError, never a guess."""

from __future__ import annotations

import pytest

from dpfl.privacy.accounting.budget import PrivacyHistory
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.accounting.ledger import (
    Ledger,
    ledger_config,
    prior_history,
    server_events_config,
    server_events_from,
)
from dpfl.privacy.accounting.record import EVENT_FIELDS, decode_events, encode_events
from dpfl.privacy.plan import plan_from_record, plan_to_record

EVENTS = [PrivacyEvent.dpsgd(1, 0.9, 0.02, 50),
          PrivacyEvent.gaussian(2, 1.3, relation="replace-one"),
          PrivacyEvent.dpsgd(3, 1.1, 0.05, 20)]


def test_events_round_trip_with_and_without_a_prefix():
    for prefix in ("", "ledger-", "server-event-"):
        record = encode_events(EVENTS, prefix)
        assert sorted(record) == sorted(f"{prefix}{f}" for f in EVENT_FIELDS)
        assert decode_events(record, prefix) == EVENTS
        assert decode_events(record, prefix, rows=[2, 0]) == [EVENTS[2], EVENTS[0]]
    history = PrivacyHistory(EVENTS, adaptive=True)
    assert PrivacyHistory.from_record(history.to_record()) == history


@pytest.mark.parametrize("damage,match", [
    (lambda r: r.pop("sigma"), "'sigma' is missing"),
    (lambda r: r["rate"].pop(), "different lengths"),
    (lambda r: r["round"].append(4), "different lengths"),
])
def test_a_malformed_record_is_a_value_error(damage, match):
    record = encode_events(EVENTS)
    damage(record)
    with pytest.raises(ValueError, match=match):
        decode_events(record)


def test_the_ledger_record_carries_each_partitions_events_and_is_checked():
    ledger = Ledger(1e-5)
    ledger.clients["client-0"] = PrivacyHistory(EVENTS[:2])
    ledger.clients["client-3"] = PrivacyHistory(EVENTS[2:])
    ledger.clients["node-77"] = PrivacyHistory(EVENTS)   # a node id, not a partition
    config = ledger_config(ledger)
    assert config["ledger-client"] == [0, 0, 3]
    assert prior_history(config, 0).events == EVENTS[:2]
    assert prior_history(config, 3).events == EVENTS[2:]
    assert prior_history(config, 5).events == []
    assert prior_history({}, 0) is None
    assert ledger_config(Ledger(1e-5)) == {}
    config["ledger-client"].append(0)                    # a row without events
    with pytest.raises(ValueError, match="different lengths"):
        prior_history(config, 0)


def test_server_events_and_the_plan_round_trip():
    ledger = Ledger(1e-5)
    ledger.server["client-1"] = EVENTS[1:]
    config = server_events_config(ledger, "client-1")
    assert server_events_from(config) == EVENTS[1:]
    assert server_events_config(ledger, "client-2") == {} and server_events_from({}) == []
    del config["server-event-epsilon"]
    with pytest.raises(ValueError, match="missing"):
        server_events_from(config)
    plan = plan_to_record(EVENTS[0])
    assert "plan-round" not in plan and plan_from_record(plan, 1) == EVENTS[0]
    assert plan_from_record({}, 1) is None
    del plan["plan-steps"]
    with pytest.raises(ValueError, match="plan-steps"):
        plan_from_record(plan, 1)
