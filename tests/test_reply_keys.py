"""Client-released metrics are never free: every registered method, under each trainer it
supports, is run for one round through the server's real instructions and dpfl's real
ClientApp; every metric its replies carry must be public, plan-derived, or a value its
method releases (``DPFLStrategy.reply_metric_keys``), and a value released in the clear
must turn the verdict to ``none``. A reply carrying anything else is rejected (and still
charged)."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from dpfl.apps.client import train
from dpfl.data import splits_for
from dpfl.methods import METHODS, build_strategy, guarantee, method_for, parse_run_config
from dpfl.privacy.accounting.ledger import Ledger
from dpfl.server.validation import PUBLIC_REPLY_METRICS

from flower_helpers import context, message

BASE = {"dataset": "digits", "model": "mlp", "batch-size": 64, "lr": 0.1, "num-rounds": 2,
        "target-epsilon": 8.0}
# a method's own settings so that it runs on digits with an MLP; then the variants that
# change what its clients send (the default first)
SETUP = {"fedcompdp": {"llcm-ratio": 0.0, "server-holdout": 20},
         "fedasgp": {"server-holdout": 20}}
VARIANTS = {
    "fedcompdp": [{}, {"adpc": "raw-norm"}, {"adpc": "noisy-norm", "cra-score": "client-f1"},
                  {"adpc": "off", "cra-score": "client-f1", "client-f1-noise": 2.0}],
    # over DP-SGD the clear and client-f1 readings are refused (tests/test_fedcompdp_dpsgd.py)
    ("fedcompdp", "dpsgd"): [{}, {"adpc": "off", "cra": False, "sparsify": "none"}],
    "fedasgp": [{}, {"asgp-variant": "paper"}],
    ("fedasgp", "dpsgd"): [{}],   # asgp-variant is update-dp's (refused under dpsgd)
    "dpfedavg": [{}, {"report-train-loss": True}],
}
# a method that runs only over SecAgg+ (cpSGD) sends no reply in the clear: its masked
# replies are checked by the SecAgg+ federation (tests/e2e/test_trust_federation.py)
CASES = [(name, trainer, variant) for name, m in METHODS.items() for trainer in m.trainers
         if trainer != "plain" and "local" in m.trusts
         for variant in VARIANTS.get((name, trainer), VARIANTS.get(name, [{}]))]
NODES = (11, 12)


class _Grid:
    def get_node_ids(self):
        return list(NODES)


def _round(name: str, trainer: str, variant: dict):
    run_config = {**BASE, "strategy": name, "trainer": trainer, **SETUP.get(name, {}),
                  **variant}
    cfg = parse_run_config(run_config)
    sizes = {i: len(s.train) for i, s in enumerate(splits_for(cfg, len(NODES)))}
    torch.manual_seed(0)
    model = method_for(cfg).build_model(cfg, (1, 8, 8), 10)
    strategy = build_strategy(cfg, sizes, model=model,
                              ledger=Ledger(cfg.delta, cfg.accountant, budget=cfg.target_epsilon))
    messages, record = strategy.start_round(1, ArrayRecord(model.state_dict()), _Grid())
    replies = []
    for pid, m in enumerate(messages):
        node = int(m.metadata.dst_node_id)
        reply = train(message(m.content, 0, node), context(run_config, pid, len(NODES)))
        replies.append(message(reply.content, src_node_id=node))
    return cfg, strategy, record, replies


@pytest.mark.parametrize("name,trainer,variant", CASES,
                         ids=[f"{n}-{t}-{'-'.join(f'{k}={v}' for k, v in v.items()) or 'default'}"
                              for n, t, v in CASES])
def test_every_reply_metric_is_public_or_released(name, trainer, variant, server_identity):
    cfg, strategy, record, replies = _round(name, trainer, variant)
    allowed = strategy.reply_metric_keys()
    sent = set()
    for reply in replies:
        assert "metrics" in reply.content.metric_records
        sent |= set(reply.content["metrics"].keys())
    assert sent <= allowed, sorted(sent - allowed)
    released = sent - PUBLIC_REPLY_METRICS
    verdict = guarantee(cfg).verdict
    clear = {"update-norm", "asgp-loss", "asgp-significant", "train-loss"}
    if released & clear or ("val-f1" in released and not cfg.params.client_f1_noise):
        assert verdict.startswith("none"), (released, verdict)
    else:
        assert verdict == "formal", (released, verdict)
    if "adpc-unclipped" in released:   # the bit travels noised, never as a clear 0/1
        bits = [float(r.content["metrics"]["adpc-unclipped"]) for r in replies]
        assert all(b not in (0.0, 1.0) for b in bits), bits
    outcome = strategy.finish_round(1, record, replies)
    assert not [r.reason for r in outcome.record.rejected if "in the clear" in r.reason]
    assert len(outcome.record.accepted) == len(NODES)


@pytest.mark.parametrize("extra", ["train-loss", "val-f1", "update-norm", "anything"])
def test_a_value_the_method_does_not_release_is_rejected_and_charged(extra, server_identity):
    cfg, strategy, record, replies = _round("dpfedavg", "update-dp", {})
    tampered = replies[0].content
    metrics = {**dict(tampered["metrics"]), extra: 0.42}
    replies[0] = message(RecordDict({"arrays": tampered["arrays"],
                                     "metrics": MetricRecord(metrics),
                                     "privacy": tampered["privacy"]}),
                         src_node_id=replies[0].metadata.src_node_id)
    outcome = strategy.finish_round(1, record, replies)
    reasons = [r.reason for r in outcome.record.rejected]
    assert len(reasons) == 1 and f"['{extra}']" in reasons[0] and "in the clear" in reasons[0]
    assert len(outcome.record.accepted) == 1
    assert {c.client for c in outcome.record.charges} == {"client-0", "client-1"}
