"""Server side: reply validation (bad replies dropped with a reason, the round goes on) and
FedAvg aggregation against a hand computation."""

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.error import Error

from dpfl.config import RunConfig
from dpfl.methods import build_strategy
from dpfl.server.aggregation import weighted_mean
from dpfl.server.reply import parse_reply
from dpfl.server.validation import array_template, validate_train_reply

from flower_helpers import message

GLOBAL = ArrayRecord({"w": torch.zeros(2, 2), "b": torch.zeros(3)})
TEMPLATE = array_template(GLOBAL)


def _reply(arrays, n=10, node=7, pid=3, **extra):
    content = {"metrics": MetricRecord({"num-examples": n, "partition-id": pid, "epsilon": 1.0}),
               **extra}
    if arrays is not None:
        content["arrays"] = ArrayRecord(arrays)
    return message(RecordDict(content), src_node_id=node)


def _ok():
    return {"w": torch.ones(2, 2), "b": torch.full((3,), 2.0)}


def test_valid_reply_is_flattened_in_key_order():
    u = validate_train_reply(parse_reply(_reply(_ok())), TEMPLATE)
    assert u.partition_id == 3 and u.num_examples == 10
    assert u.flat.tolist() == [1, 1, 1, 1, 2, 2, 2]


@pytest.mark.parametrize("arrays,n,fragment", [
    ({"w": torch.ones(2, 3), "b": torch.zeros(3)}, 10, "shape"),
    ({"w": torch.ones(2, 2)}, 10, "keys differ"),
    ({"w": torch.ones(2, 2), "b": torch.zeros(3), "x": torch.zeros(1)}, 10, "keys differ"),
    ({"w": torch.ones(2, 2, dtype=torch.float64), "b": torch.zeros(3)}, 10, "dtype"),
    ({"w": torch.tensor([[1.0, float("nan")], [0, 0]]), "b": torch.zeros(3)}, 10, "non-finite"),
    ({"w": torch.tensor([[1.0, float("inf")], [0, 0]]), "b": torch.zeros(3)}, 10, "non-finite"),
    (None, 10, "no 'arrays'"),
    ({"w": torch.ones(2, 2), "b": torch.zeros(3)}, 0, "num-examples"),
    ({"w": torch.ones(2, 2), "b": torch.zeros(3)}, 2.5, "num-examples"),
])
def test_malformed_replies_are_rejected_with_reason(arrays, n, fragment):
    r = validate_train_reply(parse_reply(_reply(arrays, n=n)), TEMPLATE)
    assert r.kind == "invalid" and fragment in r.reason


def test_norm_bound_and_refusal_and_error():
    r = validate_train_reply(parse_reply(_reply(_ok())), TEMPLATE, norm_bound=1.0)
    assert r.kind == "invalid" and "norm" in r.reason
    ok = validate_train_reply(parse_reply(_reply(_ok())), TEMPLATE, norm_bound=4.0)
    assert not hasattr(ok, "kind")
    refused = message(RecordDict({"metrics": MetricRecord({"partition-id": 1, "epsilon": 3.9}),
                                  "status": ConfigRecord({"status": "refused", "reason": "budget"})}))
    assert validate_train_reply(parse_reply(refused), TEMPLATE).kind == "refused"
    err_msg = Message(Error(code=0, reason="boom"), reply_to=message(RecordDict({})))
    assert validate_train_reply(parse_reply(err_msg), TEMPLATE).kind == "error"


def test_weighted_mean_by_hand():
    u = torch.tensor([[1.0, 0.0], [0.0, 4.0]])
    assert weighted_mean(u, torch.tensor([1.0, 3.0])).tolist() == [0.25, 3.0]


def test_round_goes_on_without_the_bad_reply():
    cfg = RunConfig(dataset="digits", model="mlp", server_lr=1.0)
    strategy = build_strategy(cfg)
    strategy._global, strategy._template = GLOBAL, TEMPLATE
    from dpfl.server.strategy import RoundRecord

    record = RoundRecord(1)
    good_a = _reply(_ok(), n=10, node=1, pid=0)
    good_b = _reply({"w": torch.full((2, 2), 3.0), "b": torch.zeros(3)}, n=30, node=2, pid=1)
    bad = _reply({"w": torch.tensor([[float("nan"), 0], [0, 0]]), "b": torch.zeros(3)}, node=3, pid=2)
    outcome = strategy.finish_round(1, record, [good_a, bad, good_b])
    arrays, metrics = outcome.arrays, outcome.metrics
    assert metrics["accepted"] == 2 and metrics["rejected"] == 1
    state = arrays.to_torch_state_dict()
    # (10 * 1 + 30 * 3) / 40 = 2.5 ; (10 * 2 + 30 * 0) / 40 = 0.5
    assert torch.allclose(state["w"], torch.full((2, 2), 2.5))
    assert torch.allclose(state["b"], torch.full((3,), 0.5))
    assert outcome.record.client_metrics()["client-2"]["status"] == "invalid"


def test_update_dp_uses_equal_weights_and_a_norm_bound():
    cfg = RunConfig(trainer="update-dp", noise_multiplier=1.0, clip_norm=1.0)
    strategy = build_strategy(cfg)
    assert strategy.guard.norm_bound(100, 1) == pytest.approx(1 + 1 * (10 + 10))


def test_every_method_gets_the_guards_norm_bound_under_update_dp():
    """DP is not inherited: gcfl (and every other update-DP-capable method) with
    trainer=update-dp gets the same Gaussian norm bound and equal weights as dpfedavg."""
    from dpfl.methods import METHODS, run_config

    for name, method in METHODS.items():
        if "update-dp" not in method.trainers or method.adaptive:
            continue
        if "local" not in method.trusts:  # cpSGD: its own quantised noise over SecAgg+ only
            continue
        # FedCompDP's private-quantile raises the update noise (its own test checks that)
        extra = {"server_holdout": 10, "adpc": "off"} if name == "fedcompdp" else {}
        cfg = run_config(strategy=name, trainer="update-dp", noise_multiplier=1.0,
                         clip_norm=1.0, **extra)
        strategy = build_strategy(cfg)
        assert strategy.guard.weights(torch.tensor([3.0, 1.0])).tolist() == [1.0, 1.0], name
        if strategy.update_norm_bound(100, 1) is not None:
            # its own (non-Gaussian) noise and bound, e.g. DP-FedASGP's Laplace: own tests
            continue
        assert strategy.guard.norm_bound(100, 1) == pytest.approx(1 + 1 * (10 + 10)), name


def test_a_server_release_is_charged_through_the_guard_to_the_clients_it_covers():
    """One noisy count (Gaussian, sigma 20, replace-one) covering clients 0 and 2 in each of
    two rounds, beside each client's own update release: epsilon composed by hand with
    dp-accounting; client 1 is charged only its own."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    from dpfl.methods import run_config
    from dpfl.privacy.accounting.events import PrivacyEvent
    from dpfl.privacy.accounting.ledger import Ledger

    cfg = run_config(trainer="update-dp", noise_multiplier=2.0, accountant="rdp")
    ledger = Ledger(cfg.delta, "rdp")
    strategy = build_strategy(cfg, ledger=ledger)
    count = PrivacyEvent.gaussian(0, 20.0, relation="replace-one", mechanism="quantile-count")
    for rnd in (1, 2):
        for pid in (0, 1, 2):
            ledger.record(f"client-{pid}", rnd, [PrivacyEvent.gaussian(rnd, 2.0,
                                                                       relation="replace-one")])
        strategy.guard.charge_server_release(rnd, [count], [0, 2], "clipped count")
    acc = RdpAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(1.0), 2)     # sigma 2, sensitivity 2C
    own = acc.get_epsilon(cfg.delta)
    acc.compose(dp_accounting.GaussianDpEvent(10.0), 2)    # the count, sigma 20 / 2
    both = acc.get_epsilon(cfg.delta)
    eps = ledger.epsilons()
    assert eps["client-1"] == pytest.approx(own, rel=1e-9)
    assert eps["client-0"] == pytest.approx(both, rel=1e-9) == eps["client-2"]
    assert both > own


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_flowers_fraction_evaluate_warning_does_not_fire(caplog, fraction):
    """Flower's FedAvg warns "fraction_evaluate is set to 0.0" when built with 0.0 (dpfl's
    default: evaluation is central): dpfl's strategy is built so it does not fire, and ends
    with the values Flower would have set (no federated evaluation at 0.0)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy = build_strategy(RunConfig(fraction_evaluate=fraction))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert strategy.fraction_evaluate == fraction
    assert strategy.min_evaluate_nodes == (0 if fraction == 0.0 else 1)
    if fraction == 0.0:   # Flower's own check: no evaluation is configured
        assert list(strategy.configure_evaluate(1, GLOBAL, ConfigRecord(), None)) == []


@pytest.mark.parametrize("arrays,n", [
    (_ok(), 10),
    ({"w": torch.ones(2, 3), "b": torch.zeros(3)}, 10),                          # shape
    ({"w": torch.tensor([[1.0, float("nan")], [0, 0]]), "b": torch.zeros(3)}, 10),  # non-finite
    (None, 10),
    (_ok(), 0),                                                                  # num-examples
])
def test_an_update_decoded_on_arrival_validates_as_one_decoded_later(arrays, n):
    from dpfl.server import validation

    msg = _reply(arrays, n=n)
    arrivals = validation.ArrivalDecoder()
    arrivals.arrived(msg, TEMPLATE)
    decoded_later = validate_train_reply(parse_reply(msg), TEMPLATE)
    on_arrival = validate_train_reply(parse_reply(msg), TEMPLATE, arrivals=arrivals)
    assert type(on_arrival) is type(decoded_later)
    if hasattr(decoded_later, "reason"):
        assert on_arrival.reason == decoded_later.reason
    else:
        assert torch.equal(on_arrival.flat, decoded_later.flat)
        assert on_arrival.norm == decoded_later.norm


def test_an_arrival_entry_serves_only_its_own_record(monkeypatch):
    from dpfl.server import validation

    first, second = _reply(_ok()), _reply({"w": torch.zeros(2, 2), "b": torch.ones(3)})
    arrivals = validation.ArrivalDecoder()
    arrivals.arrived(first, TEMPLATE)
    calls = []
    original = validation._flat_checked
    monkeypatch.setattr(validation, "_flat_checked",
                        lambda *a: calls.append(a) or original(*a))
    got = validate_train_reply(parse_reply(second), TEMPLATE, arrivals=arrivals)
    assert got.flat.tolist() == [0, 0, 0, 0, 1, 1, 1] and len(calls) == 1   # decoded afresh
    assert validate_train_reply(parse_reply(first), TEMPLATE,
                                arrivals=arrivals).flat.tolist() == [1, 1, 1, 1, 2, 2, 2]
    assert len(calls) == 1                                 # from the arrival's decoding
    arrivals.arrived(first, TEMPLATE)
    arrivals.clear()
    validate_train_reply(parse_reply(first), TEMPLATE, arrivals=arrivals)
    assert len(calls) == 3       # the re-arrival decoded once; cleared, so validation again
