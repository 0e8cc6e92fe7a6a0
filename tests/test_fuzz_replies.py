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
from dpfl.privacy.budget import PrivacyHistory
from dpfl.privacy.events import PrivacyEvent
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
    strategy = build_strategy(cfg)
    model = build_model("mlp", (1, 8, 8), 10)
    strategy.bind_model(model)
    if hasattr(strategy, "bind_partition_sizes"):
        strategy.bind_partition_sizes({i: 100 for i in range(50)})
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
