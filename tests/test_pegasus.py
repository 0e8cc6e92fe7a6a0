"""PEGASUS selection on hand-made epsilon vectors: strictly below the mean, the tie rule,
clients not seen yet; and a refusing client in a whole federation run in this process (the
server's ``run`` with dpfl's real ClientApp behind an in-process Grid)."""

import itertools
import json
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from opacus.accountants import RDPAccountant

from dpfl.config import RunConfig
from dpfl.methods import build_strategy, parse_run_config
from dpfl.methods.pegasus import pegasus_select
from dpfl.privacy.accounting.budget import PrivacyHistory
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.accounting.ledger import Ledger

from flower_helpers import message


class FakeGrid:
    """Only what selection reads: the connected node ids."""

    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


def test_strictly_below_the_mean():
    # mean = 2.5: 1.0 and 2.0 are below; 3.0 and 4.0 are not
    assert pegasus_select({11: 1.0, 12: 2.0, 13: 3.0, 14: 4.0}) == [11, 12]
    # a client exactly at the mean is not selected: mean of (1, 2, 3) is 2
    assert pegasus_select({1: 1.0, 2: 2.0, 3: 3.0}) == [1]


def test_tie_selects_everyone():
    assert pegasus_select({5: 2.0, 6: 2.0, 7: 2.0}) == [5, 6, 7]
    assert pegasus_select({}) == []


def test_clients_out_of_budget_are_left_out():
    """Node 1 cannot afford a round and stays at 0: the paper's rule alone picks it every
    round (mean 2.0); left out, nobody of {2, 3} is strictly below the mean -> tie: both."""
    eps = {1: 0.0, 2: 2.0, 3: 4.0}
    assert pegasus_select(eps) == [1]
    assert pegasus_select(eps, {1}) == [2, 3]
    # the mean stays over all clients: 2 (eps 1.0) is below (0 + 1 + 4) / 3 = 1.67
    assert pegasus_select({1: 0.0, 2: 1.0, 3: 4.0}, {1}) == [2]
    # every client refused: all are asked (they all refuse and the run stops)
    assert pegasus_select(eps, {1, 2, 3}) == [1, 2, 3]


def _ledger(eps_by_client):
    ledger = Ledger(1e-5)
    for name, steps in eps_by_client.items():
        ledger.clients[name] = PrivacyHistory([PrivacyEvent.dpsgd(1, 1.0, 0.02, steps)])
    return ledger


def test_strategy_selects_from_the_ledger_and_counts_unseen_clients_as_zero():
    ledger = _ledger({"client-0": 400, "client-1": 100, "client-2": 50})
    strategy = build_strategy(RunConfig(strategy="pegasus", min_train_nodes=2), ledger=ledger)
    strategy.nodes.node_client = {10: "client-0", 11: "client-1", 12: "client-2"}
    grid = FakeGrid([10, 11, 12, 13])  # node 13 has not reported yet: epsilon 0
    assert strategy.select_nodes(1, grid) == [10, 11, 12, 13]  # round 1: everyone
    eps = ledger.epsilons()
    mean = (eps["client-0"] + eps["client-1"] + eps["client-2"] + 0.0) / 4
    expected = sorted([n for n, c in strategy.nodes.node_client.items() if eps[c] < mean] + [13])
    assert strategy.select_nodes(2, grid) == expected
    assert 10 not in expected and 13 in expected


def _refusal(node: int, pid: int, reason: str) -> Message:
    content = {"metrics": MetricRecord({"partition-id": pid, "epsilon": 0.0, "refused": 1}),
               "status": ConfigRecord({"status": "refused", "reason": reason})}
    return message(RecordDict(content), src_node_id=node)


def test_a_budget_refusal_takes_the_node_out_of_later_selections(server_identity):
    """Through the strategy: a node that refused at its budget in round 2 is not selected
    in round 3; one that refused for another reason (a plan mismatch) still is."""
    strategy = build_strategy(RunConfig(strategy="pegasus", min_train_nodes=2),
                              ledger=_ledger({"client-1": 100, "client-2": 100}))
    strategy.nodes.node_client = {11: "client-1", 12: "client-2"}
    grid = FakeGrid([10, 11, 12])   # node 10 (client-0) never trained: eps 0, below the mean
    arrays = ArrayRecord({"weight": torch.zeros(1, 2)})
    _, record = strategy.start_round(2, arrays, grid)
    assert sorted(record.sampled) == [10]
    outcome = strategy.finish_round(2, record, [_refusal(10, 0, "budget: epsilon would reach "
                                                         "9.1 > target-epsilon 4")])
    assert [r.kind for r in outcome.record.rejected] == ["refused"]
    assert strategy.out_of_budget == {10}
    assert strategy.select_nodes(3, grid) == [11, 12]   # tie among those that can train
    strategy.finish_round(3, strategy.start_round(3, arrays, grid)[1],
                          [_refusal(11, 1, "plan: the server's plan differs")])
    assert strategy.out_of_budget == {10}


class InProcessGrid(Grid):
    """Flower's Grid answered in this process by dpfl's real ClientApp: every node has its
    own Context (partition, run-config, persistent state), as a SuperNode would."""

    def __init__(self, run_config, num_nodes):
        from dpfl.apps.client import app

        self.client_app = app
        self.contexts = {100 + i: Context(run_id=1, node_id=100 + i,
                                          node_config={"partition-id": i,
                                                       "num-partitions": num_nodes},
                                          state=RecordDict(), run_config=dict(run_config))
                         for i in range(num_nodes)}
        self._ids = itertools.count(1)
        self._replies: dict[str, Message] = {}
        self._run = None

    def set_run(self, run):
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content=content, message_type=message_type, dst_node_id=dst_node_id,
                       group_id=group_id, ttl=ttl)

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            mid = f"m{next(self._ids)}"
            msg.metadata.__dict__["_message_id"] = mid  # as Flower's grids do on push
            self._replies[mid] = self.client_app(msg, self.contexts[msg.metadata.dst_node_id])
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids):
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))




@pytest.fixture
def one_thread(monkeypatch):
    """The in-process clients train on one torch thread (DPFL_NUM_THREADS); restored after."""
    import torch

    threads = torch.get_num_threads()
    monkeypatch.setenv("DPFL_NUM_THREADS", "1")
    yield
    torch.set_num_threads(threads)


def _federation(tmp_path: Path, name: str, **overrides) -> Path:
    """A 2-client PEGASUS federation on digits through the server's ``run``."""
    from dpfl.apps.server import run

    run_config = {"strategy": "pegasus", "trainer": "dpsgd", "dataset": "digits",
                  "model": "mlp", "batch-size": 32, "lr": 0.5, "noise-multiplier": 1.0,
                  "accountant": "rdp", "output-dir": str(tmp_path), "run-name": name,
                  **overrides}
    summary = run(InProcessGrid(run_config, 2), parse_run_config(run_config))
    return Path(summary["run-dir"])


def _opacus_epsilon(events, delta) -> float:
    """Epsilon of DP-SGD events straight from Opacus (independent of dpfl's ledger)."""
    acc = RDPAccountant()
    acc.history = [(e["sigma"], e["rate"], e["steps"]) for e in events]
    return acc.get_epsilon(delta)


def test_refused_clients_spend_nothing_and_the_rule_uses_the_ledger(tmp_path, server_identity,
                                                                    one_thread):
    """A budget that admits one round but not two: in round 2 the selected clients refuse.
    The refusal goes through the strategy's aggregate_train and the server's ledger
    bookkeeping like any reply: it must be charged nothing (the ledger keeps exactly the
    events of the accepted rounds, its epsilon equals Opacus' over them), the refusal must
    be warranted (one more round would pass the budget), and later selections still follow
    the rule on the recorded (unchanged) epsilons."""
    delta = 1e-5
    # 1. one round with an ample budget, to learn each client's per-round DP-SGD event
    probe = json.loads((_federation(tmp_path, "probe", **{"num-rounds": 1,
                                                          "target-epsilon": 1e3})
                        / "ledger.json").read_text())
    first = {c: info["events"][0] for c, info in probe["clients"].items()}
    assert sorted(first) == ["client-0", "client-1"]
    one = max(_opacus_epsilon([e], delta) for e in first.values())
    two = min(_opacus_epsilon([e, {**e, "round": 2}], delta) for e in first.values())
    assert one < two, (one, two)
    budget = (one + two) / 2  # every client can train once, none twice

    # 2. the federation under that budget
    run_dir = _federation(tmp_path, "refuse", **{"num-rounds": 3, "target-epsilon": budget})
    rounds = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    ledger = json.loads((run_dir / "ledger.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert ledger["mismatches"] == []
    assert {c["status"] for c in rounds[0]["clients"].values()} == {"accepted"}
    refusals = [(r["round"], c, info) for r in rounds for c, info in r["clients"].items()
                if info["status"] == "refused"]
    assert refusals, f"no client refused at budget {budget}: {rounds}"
    assert {r for r, _, _ in refusals} >= {2}
    # selection from round 2 on: strictly below the mean of the recorded epsilons (a client
    # with nothing recorded counts as 0; tie: all)
    for prev, cur in zip(rounds, rounds[1:]):
        eps = {c: prev["epsilon"].get(c, 0.0) for c in first}
        mean = sum(eps.values()) / len(eps)
        assert set(cur["clients"]) == ({c for c, e in eps.items() if e < mean} or set(eps))
    for client, info in ledger["clients"].items():
        accepted = [r["round"] for r in rounds
                    if r["clients"].get(client, {}).get("status") == "accepted"]
        # charged exactly for the rounds it trained in, never for a refused one
        assert [e["round"] for e in info["events"]] == accepted, client
        independent = _opacus_epsilon(info["events"], delta)
        assert info["epsilon"] == pytest.approx(independent, rel=1e-9)
        assert summary["clients"][client]["epsilon"] == pytest.approx(independent, rel=1e-9)
        assert independent <= budget
    for rnd, client, info in refusals:
        assert info["reason"].startswith("budget"), info
        events = ledger["clients"].get(client, {"events": []})["events"]
        assert all(e["round"] != rnd for e in events)
        before = [e for e in events if e["round"] < rnd]
        spent = _opacus_epsilon(before, delta) if before else 0.0
        after = next(r for r in rounds if r["round"] == rnd)
        # the round's recorded epsilon, and what the client reported, did not move
        assert after["epsilon"].get(client, 0.0) == pytest.approx(spent, rel=1e-9)
        assert info["epsilon"] == pytest.approx(spent, rel=1e-9)
        # warranted: the planned round (same public parameters) would pass the budget
        planned = {**first[client], "round": rnd}
        assert _opacus_epsilon(before + [planned], delta) > budget


def test_a_resumed_pegasus_run_selects_with_the_clients_its_nodes_replied_as():
    """Issue 50: the node -> client map PEGASUS selects through is checkpointed with the
    pins (NodeRegistry); before, a resume forgot it and counted every node's epsilon as 0."""
    ledger = _ledger({"client-0": 400, "client-1": 100, "client-2": 50})
    before = build_strategy(RunConfig(strategy="pegasus", min_train_nodes=2),
                            {0: 100, 1: 100, 2: 100}, ledger=ledger)
    for node, pid in ((10, 0), (11, 1), (12, 2)):
        before.nodes.note_reply(node, pid)
    before.nodes.note_reply(13, 7)   # not a partition of this run: not remembered
    state = before.state_dict()
    after = build_strategy(RunConfig(strategy="pegasus", min_train_nodes=2),
                           {0: 100, 1: 100, 2: 100}, ledger=ledger)
    after.load_state_dict(state)
    assert after.nodes.node_client == {10: "client-0", 11: "client-1", 12: "client-2"}
    grid = FakeGrid([10, 11, 12, 13])
    assert after.select_nodes(2, grid) == before.select_nodes(2, grid) != [10, 11, 12, 13]
    # an older checkpoint (pins only) still loads
    old = build_strategy(RunConfig(strategy="pegasus", min_train_nodes=2))
    old.load_state_dict({"node-partition": {10: 0}})
    assert old.nodes.pinned(10) == 0 and old.nodes.node_client == {}
