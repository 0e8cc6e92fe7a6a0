"""Cohort nodes (dpfl.cohort, dpfl.server.cohort, dpfl.apps.cohort_host): one simulated
node trains several clients per Message, and nothing per client changes.

The wire format round-trips and stores what every client shares once; the ServerApp's
CohortGrid shows one node per client, keeps each client on one host, never gives a busy
host a second bundle, and turns a host's failure into each of its clients' errors. The
main check: for every registered method, under every trust model a cohort can run, a
federation of cohort nodes and one of one node per client, same seed, reproducible mode,
give bit-identical ledgers and models (tests/inprocess.py: the real ServerApp run loop and
ClientApp over Flower's in-memory LinkState, without Ray).
"""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID

from dpfl.cohort import (
    COHORT_RECORD,
    bundle_instructions,
    bundle_replies,
    bundle_type,
    client_state,
    store_client_state,
    unbundle_instructions,
    unbundle_replies,
)
from dpfl.config import ConfigError
from dpfl.methods import METHODS
from dpfl.server.cohort import CohortGrid, client_node, client_of


@pytest.fixture(autouse=True)
def flower_identity(monkeypatch):
    """The ServerApp process's identity: its messages leave from the SuperLink's node."""
    from flwr.supercore.task_identity import TaskIdentity
    for name, value in (("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


# -- the wire format -------------------------------------------------------------------------


def test_instruction_bundle_stores_shared_records_once_and_round_trips():
    arrays = ArrayRecord({"w": torch.arange(4.0)})
    contents = {pid: RecordDict({"arrays": arrays, "config": ConfigRecord({"pid": pid})})
                for pid in (3, 7, 11)}
    bundle = bundle_instructions(contents, "train", 12)
    assert sorted(bundle.keys()) == sorted(["arrays", "3/config", "7/config", "11/config",
                                            COHORT_RECORD])
    inner, n, back = unbundle_instructions(bundle)
    assert (inner, n, list(back)) == ("train", 12, [3, 7, 11])
    for pid, content in back.items():
        assert content["arrays"] is arrays
        assert content["config"]["pid"] == pid


def test_records_equal_but_not_the_same_object_are_per_client():
    contents = {pid: RecordDict({"config": ConfigRecord({"a": 1})}) for pid in (0, 1)}
    bundle = bundle_instructions(contents, "evaluate", 2)
    assert "config" not in bundle and "0/config" in bundle and "1/config" in bundle


def test_reply_bundle_keeps_each_clients_records_and_errors():
    replies = {0: RecordDict({"metrics": MetricRecord({"x": 1.0})}), 5: "boom",
               9: RecordDict()}
    back = unbundle_replies(bundle_replies(replies))
    assert back[5] == "boom"
    assert dict(back[0]["metrics"]) == {"x": 1.0}
    assert isinstance(back[9], RecordDict) and not list(back[9].keys())


def test_a_clients_node_state_is_its_own_slice_of_the_hosts():
    host = RecordDict({"1/history": ConfigRecord({"e": 1}), "12/history": ConfigRecord(
        {"e": 12}), "other": ConfigRecord({"x": 0})})
    own = client_state(host, 1)
    assert list(own.keys()) == ["history"] and own["history"]["e"] == 1
    own["history"] = ConfigRecord({"e": 2})
    own["control"] = ArrayRecord({"c": torch.zeros(1)})
    store_client_state(host, 1, own)
    assert host["1/history"]["e"] == 2 and "1/control" in host
    assert host["12/history"]["e"] == 12 and "other" in host   # others untouched
    store_client_state(host, 1, RecordDict())
    assert not any(k.startswith("1/") for k in host.keys())


def test_bundle_types():
    assert bundle_type("train") == "train.cohort"
    assert bundle_type("query.warm") == "query.cohort"
    with pytest.raises(ValueError, match="cohort"):
        unbundle_instructions(RecordDict())


# -- the ServerApp's grid ---------------------------------------------------------------------

class _HostGrid:
    """Hosts that answer only when told to (what a bundle held, in order)."""

    def __init__(self, hosts):
        self.hosts = hosts
        self.pushed: list[Message] = []
        self.answers: dict[str, Message] = {}

    def get_node_ids(self):
        return list(self.hosts)

    def push_messages(self, messages):
        ids = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = f"b{len(self.pushed)}"
            m.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
            self.pushed.append(m)
            ids.append(m.metadata.message_id)
        return ids

    def answer(self, bundle: Message, fail: dict[int, str] | None = None) -> None:
        _, _, contents = unbundle_instructions(bundle.content)
        replies = {pid: (fail or {}).get(pid) or RecordDict(
            {"metrics": MetricRecord({"partition-id": pid})}) for pid in contents}
        self.answers[bundle.metadata.message_id] = Message(bundle_replies(replies),
                                                          reply_to=bundle)

    def pull_messages(self, ids):
        return [self.answers.pop(i) for i in list(ids) if i in self.answers]


def _train(node: int) -> Message:
    return Message(RecordDict({"config": ConfigRecord({"n": node})}), node, "train")


def test_cohort_grid_shows_one_node_per_client_on_fixed_hosts():
    inner = _HostGrid([20, 10])
    grid = CohortGrid(inner, 5)
    nodes = list(grid.get_node_ids())
    assert nodes == [client_node(p) for p in range(5)]
    assert [client_of(n) for n in nodes] == [0, 1, 2, 3, 4]
    assert [grid.host_of(p) for p in range(5)] == [10, 20, 10, 20, 10]   # pid mod K
    ids = grid.push_messages([_train(client_node(p)) for p in (0, 1, 2)])
    assert len(ids) == 3 and len(inner.pushed) == 2        # one bundle per host
    inner.hosts = [10, 20, 30]                            # a late host changes nothing
    assert grid.host_of(4) == 10


def test_replies_come_back_per_client_with_the_ids_the_push_returned():
    inner = _HostGrid([10, 20])
    grid = CohortGrid(inner, 4)
    msgs = [_train(client_node(p)) for p in range(4)]
    ids = list(grid.push_messages(msgs))
    inner.answer(inner.pushed[0], fail={2: "ValueError: bad"})
    got = {m.metadata.reply_to_message_id: m for m in grid.pull_messages(ids)}
    assert set(got) == {ids[0], ids[2]}                   # host 10 holds clients 0 and 2
    assert got[ids[0]].metadata.src_node_id == client_node(0)
    assert dict(got[ids[0]].content["metrics"]) == {"partition-id": 0}
    assert got[ids[2]].has_error() and "bad" in got[ids[2]].error.reason
    inner.answer(inner.pushed[1])
    assert {m.metadata.reply_to_message_id for m in grid.pull_messages(ids)} == {
        ids[1], ids[3]}


def test_a_busy_host_gets_its_next_bundle_only_after_its_reply():
    """Two bundles of one host at once would race on its node state (a charge lost)."""
    inner = _HostGrid([10])
    grid = CohortGrid(inner, 2)
    first = list(grid.push_messages([_train(client_node(0))]))
    second = list(grid.push_messages([_train(client_node(1))]))
    assert len(inner.pushed) == 1                         # queued behind the first
    assert grid.pull_messages(second) == []
    inner.answer(inner.pushed[0])
    assert len(grid.pull_messages(first)) == 1 and len(inner.pushed) == 2
    inner.answer(inner.pushed[1])
    assert len(grid.pull_messages(second)) == 1


def test_a_hosts_error_is_every_one_of_its_clients_error():
    inner = _HostGrid([10])
    grid = CohortGrid(inner, 3)
    ids = list(grid.push_messages([_train(client_node(p)) for p in range(3)]))
    from flwr.app import Error
    bundle = inner.pushed[0]
    inner.answers[bundle.metadata.message_id] = Message(Error(0, "node gone"),
                                                        reply_to=bundle)
    replies = list(grid.pull_messages(ids))
    assert len(replies) == 3 and all(r.has_error() for r in replies)
    assert {r.metadata.src_node_id for r in replies} == {client_node(p) for p in range(3)}


# -- the same federation either way ----------------------------------------------------------

BASE = {"dataset": "digits", "model": "mlp", "num-rounds": 2, "fraction-train": 0.5,
        "min-train-nodes": 2, "batch-size": 32, "reproducible": True, "target-epsilon": 8.0,
        "lr": 0.5}
EXTRA = {"fedcompdp": {"server-holdout": 100, "llcm-ratio": 0.0},
         "fedasgp": {"server-holdout": 100}}
CLIENTS, HOSTS = 5, 2


def _cases():
    for name, method in METHODS.items():
        for trainer in method.trainers:
            for trust in method.trusts:
                if trust == "distributed":
                    continue   # SecAgg+ is per node: refused (test below)
                if trust == "central" and (name, trainer) != ("dpfedavg", "update-dp"):
                    continue   # one central run: the trust model, not the method, differs
                yield pytest.param(name, trainer, trust, id=f"{name}-{trainer}-{trust}")




def _model(run_dir):
    from dpfl.tensorfile import load_tensors
    return load_tensors(run_dir / "checkpoint.pt")["model"]


def _digests(run_dir):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from regression import digests
    return digests(run_dir)


@pytest.mark.parametrize("name,trainer,trust", list(_cases()))
def test_cohort_nodes_give_the_same_ledger_and_model(tmp_path, name, trainer, trust):
    from inprocess import run_federation

    keys = {**BASE, **EXTRA.get(name, {}), "strategy": name, "trainer": trainer,
            "trust": trust}
    if trust == "central":
        keys.update({"noise-multiplier": 1.0, "clip-norm": 0.1})
    one, handled_one = run_federation(keys, CLIENTS, tmp_path, "one")
    # the batched training on (on a CPU the automatic setting trains one by one)
    cohort, handled_cohort = run_federation({**keys, "cohort-clients": CLIENTS,
                                             "cohort-batch": 8}, HOSTS, tmp_path, "cohort")
    ledger = json.loads((cohort / "ledger.json").read_text())
    if name != "fedavg":
        assert ledger["charges"], "a private run charged nothing"
    # the same privacy record exactly; the same model to float rounding (a cohort host
    # trains its plain and update-dp clients in one batched call, whose kernels sum in
    # another order; DP-SGD and step hooks train one by one, bit-identical)
    assert _digests(one)["ledger-digest"] == _digests(cohort)["ledger-digest"]
    ones, cohorts = _model(one), _model(cohort)
    assert ones.keys() == cohorts.keys()
    for key in ones:
        assert torch.allclose(ones[key], cohorts[key], rtol=1e-4, atol=1e-6), key
    # each round: one bundle per host instead of one message per sampled client
    assert handled_cohort < handled_one


def test_a_cohort_refuses_secagg_and_deployments():
    from dpfl.apps.server import cohort_grid
    from dpfl.methods import run_config

    class Deployment:   # a gRPC grid: no in-memory state
        def get_node_ids(self):
            return [1, 2]

    cfg = run_config(cohort_clients=4, trainer="update-dp")
    with pytest.raises(ConfigError, match="cohort-clients.*simulations"):
        cohort_grid(Deployment(), cfg)
    from dpfl.server.node_index import simulation_state
    _, grids, _ = simulation_state(2, run_ids=(1,))
    secure = run_config(cohort_clients=4, trainer="update-dp", trust="distributed")
    with pytest.raises(ConfigError, match="SecAgg"):
        cohort_grid(grids[1], secure)
    assert isinstance(cohort_grid(grids[1], cfg), CohortGrid)


def test_the_launcher_picks_cohort_nodes_when_clients_outnumber_the_actors(monkeypatch):
    from dpfl.errors import UserError
    from dpfl.methods import run_config
    from dpfl.runtime.preflight import NodeLayout, node_layout

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    auto = run_config(trainer="update-dp")
    assert node_layout(auto, 1000, 1.0, None) == NodeLayout(8, 1000)   # 2 actors x 4
    assert node_layout(auto, 1000, 1.0, 3) == NodeLayout(12, 1000)     # --parallel-clients
    assert node_layout(auto, 8, 1.0, None) == NodeLayout(8, 0)         # few: one each
    assert node_layout(auto, 9, 1.0, None) == NodeLayout(8, 9)
    assert node_layout(auto, 1000, 1.0, None, cluster=True) == NodeLayout(1000, 0)
    assert node_layout(run_config(trainer="update-dp", cohort_nodes=0), 1000, 1.0,
                       None) == NodeLayout(1000, 0)
    assert node_layout(run_config(trainer="update-dp", cohort_nodes=10), 1000, 1.0,
                       None) == NodeLayout(10, 1000)
    secure = run_config(trainer="update-dp", trust="distributed")
    assert node_layout(secure, 1000, 1.0, None) == NodeLayout(1000, 0)
    with pytest.raises(UserError, match="cohort-nodes.*SecAgg"):
        node_layout(run_config(trainer="update-dp", trust="distributed", cohort_nodes=4),
                    1000, 1.0, None)
