"""A train reply is bound to the round of the instruction it answers.

Flower binds a reply to its instruction (the SuperLink stores a reply only for an existing,
unanswered instruction addressed to the sender; the server pulls replies by instruction
id). The server also refuses a reply whose content answers another round: an old reply's
content pushed again as the answer to a later instruction (``server-round`` of the old
round), even when its update bytes differ from the old ones (so the replay digest does not
catch it). Such a reply is still charged, at the plan of the round it was sent in.
"""

import dp_accounting
import pytest
import torch
from dp_accounting.rdp import rdp_privacy_accountant
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from dpfl.config import RunConfig
from dpfl.methods import build_strategy
from dpfl.privacy.accounting.budget import PrivacyHistory
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.accounting.ledger import Ledger
from dpfl.server.reply import parse_reply
from dpfl.server.strategy import RoundRecord
from dpfl.server.validation import array_template, validate_train_reply

from flower_helpers import message

GLOBAL = ArrayRecord({"w": torch.zeros(2, 2), "b": torch.zeros(3)})
D = 1e-5


def _strategy():
    cfg = RunConfig(dataset="digits", model="mlp", accountant="rdp", trainer="update-dp",
                    noise_multiplier=2.0, node_partitions="10:0,11:1")
    ledger = Ledger(cfg.delta, cfg.accountant)
    strategy = build_strategy(cfg, {0: 100, 1: 100}, ledger=ledger)
    strategy._global, strategy._template = GLOBAL, array_template(GLOBAL)
    return strategy, ledger


def _reply(pid, node, rnd, answers, value):
    """A reply of ``node`` that says it answers round ``answers`` (sent in round ``rnd``)."""
    event = PrivacyEvent.gaussian(rnd, 2.0, relation="replace-one")
    privacy = PrivacyHistory([event]).to_record()
    privacy["clip"] = 1.0
    metrics = {"num-examples": 1, "partition-id": pid, "epsilon": 1.0}
    if answers is not None:
        metrics["server-round"] = answers
    content = RecordDict({
        "arrays": ArrayRecord({"w": torch.full((2, 2), value), "b": torch.zeros(3)}),
        "metrics": MetricRecord(metrics), "privacy": privacy})
    return message(content, src_node_id=node)


def _gaussian_ref(sigma, k):
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(sigma / 2.0), k)
    return acc.get_epsilon(D)


def test_validation_refuses_a_reply_naming_another_round():
    template = array_template(GLOBAL)
    ok = validate_train_reply(parse_reply(_reply(0, 10, 2, 2, 0.1)), template, server_round=2)
    assert not hasattr(ok, "reason"), ok
    for answers in (1, 3, 2.5, [2]):
        bad = validate_train_reply(parse_reply(_reply(0, 10, 2, answers, 0.1)), template,
                                   server_round=2)
        assert bad.kind == "invalid" and f"answers round {answers!r}" in bad.reason, bad
        assert "instruction it replies to is of round 2" in bad.reason
    # no round given (e.g. a caller outside a round), or none claimed: left to other checks
    unstated = parse_reply(_reply(0, 10, 2, None, 0.1))
    assert not hasattr(validate_train_reply(parse_reply(_reply(0, 10, 2, 1, 0.1)), template),
                       "reason")
    assert not hasattr(validate_train_reply(unstated, template, server_round=2), "reason")


def test_old_round_content_in_a_later_round_is_refused_and_charged_the_plan():
    strategy, ledger = _strategy()
    first = strategy.finish_round(1, RoundRecord(1), [_reply(0, 10, 1, 1, 0.1),
                                                      _reply(1, 11, 1, 1, 0.2)]).record
    assert len(first.accepted) == 2
    # round 2: node 10 sends round 1's reply again, its update nudged (new bytes)
    second = strategy.finish_round(2, RoundRecord(2), [_reply(0, 10, 2, 1, 0.1 + 1e-6),
                                                       _reply(1, 11, 2, 2, 0.3)]).record
    assert [u.node_id for u in second.accepted] == [11]
    [rejected] = second.rejected
    assert rejected.node_id == 10 and "answers round 1" in rejected.reason
    # charged all the same, at the plan of round 2 (two Gaussian releases in all)
    assert [e.round for e in ledger.clients["client-0"].events] == [1, 2]
    assert ledger.recomputed("client-0") == pytest.approx(_gaussian_ref(2.0, 2), rel=1e-9)
    assert ledger.recomputed("client-1") == pytest.approx(_gaussian_ref(2.0, 2), rel=1e-9)


def test_an_exact_replay_is_refused_by_the_digest_even_relabelled():
    strategy, ledger = _strategy()
    strategy.finish_round(1, RoundRecord(1), [_reply(0, 10, 1, 1, 0.1)])
    record = strategy.finish_round(2, RoundRecord(2), [_reply(0, 10, 2, 2, 0.1)]).record
    assert not record.accepted and "a replay" in record.rejected[0].reason
    assert ledger.recomputed("client-0") == pytest.approx(_gaussian_ref(2.0, 2), rel=1e-9)
