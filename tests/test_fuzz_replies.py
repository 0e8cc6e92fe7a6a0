"""1,000 crafted replies into every strategy's aggregation: no crash, every bad reply
rejected with a reason, the good ones aggregated (checked by hand for DP-FedAvg).

Each strategy's replies come from a fixed seed, crc32 of its name (not ``hash``, which
Python salts per process): a failure names the seed and reproduces in any process."""

import zlib

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.error import Error

from dpfl.config import RunConfig
from dpfl.methods import METHODS, build_strategy
from dpfl.methods.fedasgp import FedASGPParams
from dpfl.methods.fedsmp import FedSMPParams
from dpfl.models import build_model
from dpfl.privacy.accounting.budget import PrivacyHistory
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.server.validation import Rejection

from flower_helpers import message

TRAINER = {"fedavg": "plain", "aadp": "update-dp", "dpfedsam": "update-dp",
           "fedcompdp": "update-dp", "fedasgp": "update-dp", "fedsmp": "update-dp"}
# what a method needs in every reply besides the generic keys, and its extra run-config
# (DP-FedASGP's paper variant: the clear loss L_i of eq. 16 and the significant fraction;
# its strict variant's replies are sparse, tests/test_fedasgp.py; Fed-SMP keeps every
# coordinate here, k = d, since good replies are dense: its sparse checks are in
# tests/test_fedsmp.py)
METHOD_METRICS = {"fedcompdp": {"adpc-unclipped": 0.6},
                  "fedasgp": {"asgp-loss": 0.7, "asgp-significant": 0.3}}
METHOD_CONFIG = {"fedcompdp": {"server_holdout": 50},
                 "fedasgp": {"params": FedASGPParams(asgp_variant="paper")},
                 "fedsmp": {"params": FedSMPParams(fedsmp_ratio=1.0)}}
BAD_KINDS = ["nan", "inf", "shape", "dtype64", "dtypeint", "missing-key", "extra-key",
             "no-arrays", "no-metrics", "n-zero", "n-negative", "n-huge", "n-fraction", "n-nan",
             "eps-negative", "eps-nan", "privacy-unequal", "privacy-mechanism",
             "privacy-sigma", "privacy-nan", "error", "norm"]


class FakeGrid:
    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


def _privacy(kind: str) -> ConfigRecord:
    rec = PrivacyHistory([PrivacyEvent.dpsgd(1, 1.0, 0.05, 10)]).to_record()
    if kind == "privacy-unequal":
        rec["sigma"] = [1.0, 2.0]
    elif kind == "privacy-mechanism":
        rec["mechanism"] = ["telepathy"]
    elif kind == "privacy-sigma":
        rec["sigma"] = [-1.0]
    elif kind == "privacy-nan":
        rec["sigma"] = [float("nan")]
    return rec


def _reply(kind, template, node, rng, extra_template=None, method_metrics=None):
    state = {k: torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 0.01)
             for k, shape, _ in template}
    n, eps = int(rng.integers(10, 1000)), 1.0
    key = list(state)[int(rng.integers(len(state)))]
    if kind == "nan":
        state[key].view(-1)[0] = float("nan")
    elif kind == "inf":
        state[key].view(-1)[-1] = float("-inf")
    elif kind == "shape":
        state[key] = torch.zeros(state[key].numel() + 1)
    elif kind == "dtype64":
        state[key] = state[key].double()
    elif kind == "dtypeint":
        state[key] = state[key].to(torch.int32)
    elif kind == "missing-key":
        del state[key]
    elif kind == "extra-key":
        state["intruder.weight"] = torch.zeros(3)
    elif kind == "norm":
        state[key] = state[key] * 0 + 1e6
    n = {"n-zero": 0, "n-negative": -5, "n-huge": 10 ** 12, "n-fraction": 2.5,
         "n-nan": float("nan")}.get(kind, n)
    eps = {"eps-negative": -1.0, "eps-nan": float("nan")}.get(kind, eps)
    if kind == "error":
        return Message(Error(code=0, reason="client crashed"), reply_to=message(RecordDict({})))
    content = {"privacy": _privacy(kind)}
    if kind != "no-metrics":
        content["metrics"] = MetricRecord({"num-examples": n, "partition-id": node % 50,
                                           "epsilon": eps, **(method_metrics or {})})
    if kind != "no-arrays":
        content["arrays"] = ArrayRecord(state)
    if extra_template is not None:
        content["control-delta"] = ArrayRecord({k: torch.zeros(shape) for k, shape, _ in extra_template})
    return message(RecordDict(content), src_node_id=node)




@pytest.mark.parametrize("name", sorted(METHODS))
def test_thousand_crafted_replies(name, server_identity):
    cfg = RunConfig(strategy=name, trainer=TRAINER.get(name, "dpsgd"), dataset="digits",
                    model="mlp", max_update_norm=1e3, **METHOD_CONFIG.get(name, {}))
    model = build_model("mlp", (1, 8, 8), 10)
    strategy = build_strategy(cfg, {i: 100 for i in range(50)}, model=model)
    arrays = ArrayRecord(model.state_dict())
    _, rec = strategy.start_round(1, arrays, FakeGrid(list(range(1, 1001))))
    template = strategy._template
    extra = strategy.extra_reply_arrays().get("control-delta")
    seed = zlib.crc32(name.encode())
    print(f"fuzz seed for {name}: {seed}")
    rng = np.random.default_rng(seed)
    kinds = ["good" if rng.random() < 0.2 else BAD_KINDS[int(rng.integers(len(BAD_KINDS)))]
             for _ in range(1000)]
    replies = [_reply(k, template, node, rng, extra, METHOD_METRICS.get(name))
               for node, k in enumerate(kinds, start=1)]
    outcome = strategy.finish_round(1, rec, replies)
    new_arrays = outcome.arrays
    good = {i for i, k in enumerate(kinds, start=1) if k == "good"}
    where = f"strategy {name}, seed {seed}"
    accepted = {u.node_id for u in rec.accepted}
    wrong = sorted((n, kinds[n - 1]) for n in accepted ^ good)
    assert accepted == good, f"{where}: misjudged (node, kind): {wrong[:10]}"
    assert len(rec.rejected) == 1000 - len(good), where
    unexplained = [r for r in rec.rejected if not (isinstance(r, Rejection) and r.reason)]
    assert not unexplained, f"{where}: rejections without a reason: {unexplained[:3]}"
    assert new_arrays is not None, f"{where}: {len(good)} good replies but no new model"
    flat = torch.cat([torch.from_numpy(a.numpy()).reshape(-1) for a in new_arrays.values()])
    assert torch.isfinite(flat).all(), where
    if name == "dpfedavg":  # by hand: global (zeros-based diff) + weighted mean of good updates
        w = torch.tensor([u.num_examples for u in rec.accepted], dtype=torch.float64)
        mean = (w / w.sum()) @ torch.stack([u.flat.double() for u in rec.accepted])
        base = torch.cat([t.reshape(-1) for t in model.state_dict().values()]).double()
        assert torch.allclose(flat.double(), base + mean, atol=1e-5), where


# -- values a reply reports never reach a weight or the model unchecked ----------------------

def _arrays(model, scale, gen):
    return ArrayRecord({k: scale * torch.randn(v.shape, generator=gen)
                        for k, v in model.state_dict().items()})


def _flat(arrays):
    return torch.cat([torch.from_numpy(a.numpy()).reshape(-1) for a in arrays.values()])


def _plain_round(extra_metrics, caplog):
    """One round of plain FedAvg (no DP: every reply metric is accepted) over 4 nodes
    of partitions 0-3 (100 examples each); node i's metrics get extra_metrics[i]."""
    strategy = build_strategy(RunConfig(strategy="fedavg", trainer="plain", dataset="digits",
                                        model="mlp"), {pid: 100 for pid in range(4)})
    model = build_model("mlp", (1, 8, 8), 10)
    _, rec = strategy.start_round(1, ArrayRecord(model.state_dict()), FakeGrid([1, 2, 3, 4]))
    gen = torch.Generator().manual_seed(0)
    replies = [message(RecordDict({
        "arrays": _arrays(model, 0.01, gen),
        "metrics": MetricRecord({"num-examples": 100, "partition-id": node - 1,
                                 **extra_metrics.get(node, {})})}), src_node_id=node)
        for node in (1, 2, 3, 4)]
    caplog.set_level("WARNING", logger="flwr.dpfl.strategy")
    return strategy, rec, strategy.finish_round(1, rec, replies)


def test_a_claimed_size_of_an_unknown_partition_is_rejected(server_identity, caplog):
    """Without DP nothing charges (and so pins) a partition id: a reply claiming a partition
    the run does not have would be weighted by its own num-examples (10^9 against 100):
    rejected with its reason, and the others' mean is the new model."""
    _, rec, outcome = _plain_round({1: {"partition-id": 999, "num-examples": 10 ** 9}}, caplog)
    [rejected] = rec.rejected
    assert rejected.node_id == 1 and "999" in rejected.reason and "not public" in rejected.reason
    assert any("dropped" in r.getMessage() and "999" in r.getMessage() for r in caplog.records)
    assert [u.partition_id for u in rec.accepted] == [1, 2, 3]
    assert all(u.num_examples == 100 for u in rec.accepted)


@pytest.mark.parametrize("loss", [1e308, float("inf"), float("nan"), -3.0, [1.0, 2.0]])
def test_a_hostile_train_loss_stays_out_of_the_rounds_mean(server_identity, caplog, loss):
    """train-loss only feeds the round's metric: a value that is not a number in
    [0, MAX_REPORTED_LOSS] is left out of the mean (a list crashed the round; 1e308 made
    the metric inf); the reply and the model are unaffected."""
    _, rec, outcome = _plain_round({1: {"train-loss": loss}, 2: {"train-loss": 0.5},
                                    3: {"train-loss": 0.7}}, caplog)
    assert len(rec.accepted) == 4
    assert dict(outcome.metrics)["train-loss"] == pytest.approx(0.6)
    assert torch.isfinite(_flat(outcome.arrays)).all()


def test_non_finite_weights_leave_the_model_unchanged(server_identity, caplog, monkeypatch):
    """The last net: whatever a method's weights come to, a NaN never reaches the model."""
    from dpfl.server.strategy import DPFLStrategy

    monkeypatch.setattr(DPFLStrategy, "aggregation_weights",
                        lambda self, accepted: torch.tensor([float("nan")] * len(accepted)))
    _, rec, outcome = _plain_round({}, caplog)
    assert outcome.arrays is None and len(rec.accepted) == 4
    assert any("model is unchanged" in r.getMessage() for r in caplog.records)


def test_a_central_clip_bit_that_is_not_a_number_in_0_1_is_rejected(server_identity, caplog):
    """trust=central: the within-C bit feeds the adaptive clip's count; a list crashed the
    round (float(list)), any value outside [0, 1] is not a bit: rejected with its reason."""
    cfg = RunConfig(trainer="update-dp", trust="central", noise_multiplier=1.0,
                    fraction_train=1.0, dataset="digits", model="mlp", num_rounds=2)
    strategy = build_strategy(cfg, {pid: 100 for pid in range(4)})
    _, rec = strategy.start_round(1, ArrayRecord({"weight": torch.zeros(1, 3)}),
                                  FakeGrid([1, 2, 3, 4]))
    bits = {1: [1.0], 2: 7.0, 3: float("nan"), 4: 1.0}
    replies = [message(RecordDict({
        "arrays": ArrayRecord({"weight": torch.full((1, 3), 0.01 * node)}),
        "metrics": MetricRecord({"num-examples": 1, "partition-id": node - 1,
                                 "server-round": 1, "clip-unclipped": bits[node]})}),
        src_node_id=node) for node in sorted(rec.sampled)]
    outcome = strategy.finish_round(1, rec, replies)
    assert sorted(r.node_id for r in rec.rejected) == [1, 2, 3]
    assert all("clip-unclipped" in r.reason for r in rec.rejected)
    assert [u.node_id for u in rec.accepted] == [4]
    assert torch.isfinite(_flat(outcome.arrays)).all()


def _scaffold(server_round=1, sizes_of=None):
    """A DP-SCAFFOLD strategy over an mlp; ``sizes_of(cfg)``: its partition sizes."""
    cfg = RunConfig(strategy="dpscaffold", trainer="dpsgd", dataset="digits", model="mlp",
                    noise_multiplier=1.0, num_rounds=2, batch_size=32, lr=0.1)
    model = build_model("mlp", (1, 8, 8), 10)
    strategy = build_strategy(cfg, sizes_of(cfg) if sizes_of else None, model=model)
    return cfg, strategy, model


def test_a_huge_scaffold_control_delta_is_rejected(server_identity, caplog):
    """DP-SCAFFOLD's Delta c_i moves c, which every client adds to each step and which
    widens the next round's norm bound: one finite but huge Delta c_i (1e30) is rejected
    with its reason instead of becoming c."""
    cfg, strategy, model = _scaffold(sizes_of=lambda cfg: {0: 700, 1: 700})
    bound = strategy.control_delta_bound(1)
    assert 0 < bound < 1e4
    _, rec = strategy.start_round(1, ArrayRecord(model.state_dict()), FakeGrid([1, 2]))
    template = strategy.extra_reply_arrays()["control-delta"]
    gen = torch.Generator().manual_seed(0)
    replies = []
    for node, scale in ((1, 1e30), (2, 0.01)):
        delta = ArrayRecord({k: torch.full(shape, scale) for k, shape, _ in template})
        replies.append(message(RecordDict({
            "arrays": _arrays(model, 0.001, gen), "control-delta": delta,
            "metrics": MetricRecord({"num-examples": 700, "partition-id": node - 1,
                                     "server-round": 1})}), src_node_id=node))
    caplog.set_level("WARNING", logger="flwr.dpfl.strategy")
    strategy.finish_round(1, rec, replies)
    [rejected] = rec.rejected
    assert rejected.node_id == 1 and "control-delta norm" in rejected.reason
    assert float(strategy.control.norm()) < bound


def test_honest_scaffold_control_deltas_are_within_the_bound(server_identity):
    """Two rounds of two real DP-SCAFFOLD clients (the ClientApp's DP-SGD and option II,
    c_i kept in the node state): every Delta c_i is accepted."""
    from dpfl.apps.client import train
    from dpfl.data import client_data

    from flower_helpers import context

    cfg, strategy, model = _scaffold(sizes_of=lambda cfg: {
        pid: len(client_data(cfg, pid, 2).y_train) for pid in (0, 1)})
    raw = {"strategy": "dpscaffold", "trainer": "dpsgd", "dataset": "digits", "model": "mlp",
           "noise-multiplier": 1.0, "num-rounds": 2, "batch-size": 32, "lr": 0.1}
    contexts = {node: context(raw, node - 1, 2) for node in (1, 2)}
    arrays = ArrayRecord(model.state_dict())
    for server_round in (1, 2):
        msgs, rec = strategy.start_round(server_round, arrays, FakeGrid([1, 2]))
        replies = [message(train(m, contexts[m.metadata.dst_node_id]).content,
                           src_node_id=m.metadata.dst_node_id) for m in msgs]
        outcome = strategy.finish_round(server_round, rec, replies)
        assert not rec.rejected, [r.reason for r in rec.rejected]
        arrays = outcome.arrays
    assert 0 < float(strategy.control.norm()) < strategy.control_delta_bound(2)
