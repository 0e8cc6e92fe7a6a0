"""The server's ledger charges every update it receives, at no less than the plan: a reply
without a valid privacy record, with mechanism 'none', or with parameters that differ from
the plan is rejected and charged the plan; rejected-for-norm and late updates are charged;
refusals and errors are not. References: dp-accounting built directly in the test."""

import random
import zlib

import dp_accounting
import pytest
import torch
from dp_accounting.rdp import rdp_privacy_accountant
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.error import Error
from opacus.accountants import RDPAccountant

from dpfl.config import RunConfig
from dpfl.methods import build_strategy
from dpfl.privacy.accounting.budget import PrivacyHistory
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.accounting.ledger import Ledger
from dpfl.server.strategy import RoundRecord
from dpfl.server.validation import array_template

from flower_helpers import message

GLOBAL = ArrayRecord({"w": torch.zeros(2, 2), "b": torch.zeros(3)})
D = 1e-5
SIZES = {0: 100, 1: 100, 2: 100}


def _strategy(**cfg):
    cfg = RunConfig(**{"dataset": "digits", "model": "mlp", "accountant": "rdp", **cfg})
    ledger = Ledger(cfg.delta, cfg.accountant)
    strategy = build_strategy(cfg, SIZES, ledger=ledger)
    strategy._global, strategy._template = GLOBAL, array_template(GLOBAL)
    return strategy, ledger


def _reply(pid, node, privacy=None, arrays=True, eps=1.0, refused=False):
    content = {"metrics": MetricRecord({"num-examples": 1, "partition-id": pid, "epsilon": eps})}
    if arrays:
        content["arrays"] = ArrayRecord({"w": torch.full((2, 2), 0.1), "b": torch.zeros(3)})
    if privacy is not None:
        content["privacy"] = privacy
    if refused:
        content["status"] = ConfigRecord({"status": "refused", "reason": "budget"})
    return message(RecordDict(content), src_node_id=node)


def _privacy(event, clip=1.0, **override):
    rec = PrivacyHistory([event]).to_record()
    rec["clip"] = clip
    for k, v in override.items():
        rec[k] = v
    return rec


def _gaussian_ref(sigma, k):
    """k replace-one Gaussian releases of noise multiplier sigma (sensitivity 2C)."""
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(sigma / 2.0), k)
    return acc.get_epsilon(D)


def _round(strategy, rnd, replies):
    return strategy.finish_round(rnd, RoundRecord(rnd), replies).record


def test_every_received_update_is_charged_and_misreports_are_rejected_at_the_plan():
    strategy, ledger = _strategy(trainer="update-dp", noise_multiplier=2.0)
    plan = PrivacyEvent.gaussian(1, 2.0, relation="replace-one")
    off_plan = PrivacyEvent.gaussian(1, 20.0, relation="replace-one")   # claims 10x the noise
    huge = {"w": torch.full((2, 2), 1e6), "b": torch.zeros(3)}
    replies = [
        _reply(0, 10, _privacy(plan)),                                   # honest
        _reply(1, 11, None),                                             # no privacy record
        _reply(2, 12, ConfigRecord({"mechanism": "none"})),              # says 'none'
    ]
    record = _round(strategy, 1, replies)
    assert [u.partition_id for u in record.accepted] == [0]
    reasons = {r.partition_id: r.reason for r in record.rejected}
    assert "no privacy record" in reasons[1] and "'none'" in reasons[2]
    one = _gaussian_ref(2.0, 1)
    assert ledger.epsilons() == pytest.approx({"client-0": one, "client-1": one,
                                               "client-2": one}, rel=1e-9)
    # round 2: an off-plan sigma is rejected and charged the (costlier) plan; an update
    # over the norm bound is rejected but still charged; a refusal and an error are not
    bad_norm = message(RecordDict({
        "metrics": MetricRecord({"num-examples": 1, "partition-id": 1, "epsilon": 1.0}),
        "arrays": ArrayRecord(huge),
        "privacy": _privacy(PrivacyEvent.gaussian(2, 2.0, relation="replace-one"))}),
        src_node_id=11)
    error = Message(Error(code=0, reason="boom"), reply_to=message(RecordDict({})))
    record = _round(strategy, 2, [
        _reply(0, 10, _privacy(PrivacyEvent.gaussian(2, 20.0, relation="replace-one"))),
        bad_norm, _reply(2, 12, arrays=False, refused=True), error])
    assert not record.accepted
    assert {r.partition_id: r.kind for r in record.rejected if r.partition_id is not None} == {
        0: "invalid", 1: "invalid", 2: "refused"}
    assert "sigma" in next(r.reason for r in record.rejected if r.partition_id == 0)
    two = _gaussian_ref(2.0, 2)
    assert ledger.recomputed("client-0") == pytest.approx(two, rel=1e-9)
    assert ledger.recomputed("client-1") == pytest.approx(two, rel=1e-9)
    assert ledger.recomputed("client-2") == pytest.approx(one, rel=1e-9)
    assert off_plan.sigma > plan.sigma  # (the claim would have lowered the charge)
    notes = [c.note for c in record.charges]
    assert any("charged the plan" in n for n in notes)


def test_understated_dpsgd_steps_with_matching_epsilon_is_charged_the_plan():
    """DP-SGD: 100 samples, batch 10 -> q = 0.1, 10 steps per round. A client that says
    5 steps and reports the epsilon of 5 steps is rejected and charged 10."""
    strategy, ledger = _strategy(trainer="dpsgd", noise_multiplier=1.0, batch_size=10)
    lie = PrivacyEvent.dpsgd(1, 1.0, 0.1, 5)
    acc = RDPAccountant()
    acc.history = [(1.0, 0.1, 5)]
    record = _round(strategy, 1, [_reply(0, 10, _privacy(lie), eps=acc.get_epsilon(D))])
    assert not record.accepted and "steps" in record.rejected[0].reason
    truth = RDPAccountant()
    truth.history = [(1.0, 0.1, 10)]
    assert ledger.recomputed("client-0") == pytest.approx(truth.get_epsilon(D), rel=1e-9)
    assert ledger.epsilon("client-0") >= truth.get_epsilon(D) * (1 - 1e-9)
    assert ledger.mismatches and ledger.mismatches[0]["client"] == "client-0"


def test_client_report_above_the_recomputed_epsilon_is_flagged_and_kept():
    strategy, ledger = _strategy(trainer="update-dp", noise_multiplier=2.0)
    plan = PrivacyEvent.gaussian(1, 2.0, relation="replace-one")
    _round(strategy, 1, [_reply(0, 10, _privacy(plan), eps=50.0)])
    assert ledger.recomputed("client-0") == pytest.approx(_gaussian_ref(2.0, 1), rel=1e-9)
    assert ledger.epsilon("client-0") == 50.0 == ledger.epsilons()["client-0"]
    assert ledger.mismatches_in(1)[0]["reported"] == 50.0


def test_late_reply_is_charged_when_it_arrives_and_never_aggregated():
    strategy, ledger = _strategy(trainer="update-dp", noise_multiplier=2.0)
    _round(strategy, 2, [])
    late = _reply(1, 11, _privacy(PrivacyEvent.gaussian(1, 2.0, relation="replace-one")))
    charge = strategy.charge_late_reply(late, 1)
    assert charge is not None and "late reply to round 1" in charge.note
    assert ledger.recomputed("client-1") == pytest.approx(_gaussian_ref(2.0, 1), rel=1e-9)
    assert ledger.clients["client-1"].events[0].round == 1


def test_a_node_cannot_switch_partition_to_spread_its_charges():
    strategy, ledger = _strategy(trainer="update-dp", noise_multiplier=2.0)
    ev = lambda r: _privacy(PrivacyEvent.gaussian(r, 2.0, relation="replace-one"))  # noqa: E731
    _round(strategy, 1, [_reply(0, 10, ev(1))])
    record = _round(strategy, 2, [_reply(1, 10, ev(2))])  # node 10 now claims partition 1
    assert not record.accepted and "differs from this node's 0" in record.rejected[0].reason
    assert ledger.recomputed("client-0") == pytest.approx(_gaussian_ref(2.0, 2), rel=1e-9)
    assert "client-1" not in ledger.clients


def _mutations(plan: PrivacyEvent):
    """Ways a reply can misreport its privacy record (seeded, reproducible)."""
    good = _privacy(plan)
    yield "honest", good
    yield "missing", None
    yield "none", ConfigRecord({"mechanism": "none"})
    yield "empty", ConfigRecord({})
    for f in (0.5, 2.0, 10.0, 1e6):
        yield f"sigma x{f}", _privacy(PrivacyEvent.gaussian(plan.round, plan.sigma * f,
                                                            relation="replace-one"))
    yield "add-remove", _privacy(PrivacyEvent.gaussian(plan.round, plan.sigma))
    yield "steps 0", _privacy(PrivacyEvent.gaussian(plan.round, plan.sigma, steps=0,
                                                    relation="replace-one"))
    yield "steps 3", _privacy(PrivacyEvent.gaussian(plan.round, plan.sigma, steps=3,
                                                    relation="replace-one"))
    yield "rate 0.01", _privacy(PrivacyEvent(plan.round, "gaussian", sigma=plan.sigma,
                                             rate=0.01, relation="add-remove"))
    yield "laplace", _privacy(PrivacyEvent.pure(plan.round, 0.01))
    yield "clip x10", _privacy(plan, clip=10.0)
    yield "clip str", _privacy(plan, clip="1.0")
    yield "two events", ConfigRecord({**dict(PrivacyHistory([plan, plan]).to_record()),
                                      "clip": 1.0})
    yield "bad types", ConfigRecord({"round": ["x"], "mechanism": [1], "sigma": ["a"],
                                     "rate": [1.0], "steps": [1], "epsilon": [0.0],
                                     "relation": ["replace-one"]})
    yield "unequal lists", ConfigRecord({**dict(good), "sigma": [1.0, 2.0]})
    yield "other round", _privacy(PrivacyEvent.gaussian(plan.round + 7, plan.sigma,
                                                        relation="replace-one"))


def test_fuzz_misreported_privacy_records_never_lower_the_ledger():
    """200 rounds of 3 clients, each reply misreporting at random: after every round each
    client's recomputed epsilon is at least the epsilon of one planned release per update
    the server received (dp-accounting directly), and its figure at least its report."""
    seed = zlib.crc32(b"charging-fuzz")
    rng = random.Random(seed)
    strategy, ledger = _strategy(trainer="update-dp", noise_multiplier=30.0,
                                 target_epsilon=1e6)
    received = {p: 0 for p in SIZES}
    for rnd in range(1, 201):
        replies = []
        for pid in SIZES:
            if rng.random() < 0.2:
                continue  # did not reply
            plan = PrivacyEvent.gaussian(rnd, 30.0, relation="replace-one")
            name, privacy = rng.choice(list(_mutations(plan)))
            eps = rng.choice([0.0, 0.5, 1e-9, ledger.recomputed(f"client-{pid}"), 1e3])
            replies.append(_reply(pid, 10 + pid, privacy, eps=eps))
            received[pid] += 1
        _round(strategy, rnd, replies)
        for pid, k in received.items():
            if k:
                truth = _gaussian_ref(30.0, k)
                client = f"client-{pid}"
                assert ledger.recomputed(client) >= truth * (1 - 1e-9), (seed, rnd, pid)
                assert ledger.epsilon(client) >= ledger.reported.get(client, 0.0)
