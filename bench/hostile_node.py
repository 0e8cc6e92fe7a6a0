"""One authenticated but hostile node against the server's privacy record, in process:
four digits clients (DP-SGD, MLP) reply through dpfl's real ClientApp, and their replies
are then tampered with as a hostile node would.

  round 1: node 103 (partition 2) claims partition 3 before the honest node 104 does;
           node 101 scales its update by 1e6; node 102 claims 1e9 examples.
  round 2: node 104 replays its round-1 update with its round-2 privacy record;
           node 103 claims partition 3 again.

Run it against any checkout (PYTHONPATH=<checkout>) to compare versions:
  .venv/bin/python bench/hostile_node.py            # no operator map
  .venv/bin/python bench/hostile_node.py --map      # node-partitions set
"""

import sys
from pathlib import Path

import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dpfl.apps.client import train  # noqa: E402
from dpfl.data import splits_for  # noqa: E402
from dpfl.methods import build_strategy, parse_run_config  # noqa: E402
from dpfl.models import build_model  # noqa: E402
from dpfl.privacy.accounting.ledger import Ledger  # noqa: E402

from flower_helpers import context, message  # noqa: E402

TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
NODES = {101: 0, 102: 1, 103: 2, 104: 3}
CONFIG = {"dataset": "digits", "model": "mlp", "batch-size": 64, "lr": 0.5,
          "target-epsilon": 4.0, "num-rounds": 2, "strategy": "dpfedavg"}
if "--map" in sys.argv:
    CONFIG["node-partitions"] = ",".join(f"{n}:{p}" for n, p in NODES.items())


class Grid:
    def get_node_ids(self):
        return list(NODES)


cfg = parse_run_config(CONFIG)
ledger = Ledger(cfg.delta, cfg.accountant)
strategy = build_strategy(cfg, {i: len(s.train) for i, s in enumerate(splits_for(cfg, 4))},
                          ledger=ledger)
contexts = {n: context(CONFIG, p, 4) for n, p in NODES.items()}


def honest(rnd, arrays):
    messages, record = strategy.start_round(rnd, arrays, Grid())
    replies = {}
    for m in messages:
        node = int(m.metadata.dst_node_id)
        replies[node] = train(message(m.content, 0, node), contexts[node]).content
    return record, replies


def reply(node, content, scale=None, metrics=None, arrays=None):
    sent = content["arrays"]
    if scale:
        sent = ArrayRecord({k: v * scale for k, v in sent.to_torch_state_dict().items()})
    m = dict(content["metrics"])
    m.update(metrics or {})
    return message(RecordDict({"arrays": arrays or sent, "metrics": MetricRecord(m),
                               "privacy": content["privacy"]}), src_node_id=node)


def show(label, outcome):
    print(f"{label} accepted (node, partition, weight):",
          sorted((u.node_id, u.partition_id, u.num_examples) for u in outcome.record.accepted))
    for r in outcome.record.rejected:
        print(f"{label} rejected node {r.node_id}: {r.reason[:90]}")


torch.manual_seed(0)
arrays = ArrayRecord(build_model("mlp", (1, 8, 8), 10).state_dict())
record, first = honest(1, arrays)
out = strategy.finish_round(1, record, [
    reply(103, first[103], metrics={"partition-id": 3}), reply(101, first[101], scale=1e6),
    reply(102, first[102], metrics={"num-examples": 10 ** 9}), reply(104, first[104])])
show("round 1", out)
record, second = honest(2, out.arrays)
out = strategy.finish_round(2, record, [reply(104, second[104], arrays=first[104]["arrays"]),
                                        reply(103, second[103], metrics={"partition-id": 3})])
show("round 2", out)
print("charges per ledger key:", {c: len(h.events) for c, h in ledger.clients.items()})
print("epsilon per ledger key:", {c: round(e, 4) for c, e in ledger.epsilons().items()},
      "(budget 4.0)")
