"""PEGASUS selection on hand-made epsilon vectors: strictly below the mean, the tie rule,
clients not seen yet, and a refusing client."""

from dpfl.config import RunConfig
from dpfl.privacy.budget import PrivacyHistory
from dpfl.privacy.events import PrivacyEvent
from dpfl.privacy.ledger import Ledger
from dpfl.strategies import build_strategy
from dpfl.strategies.pegasus import pegasus_select


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


def _ledger(eps_by_client):
    ledger = Ledger(1e-5)
    for name, steps in eps_by_client.items():
        ledger.clients[name] = PrivacyHistory([PrivacyEvent.dpsgd(1, 1.0, 0.02, steps)])
    return ledger


def test_strategy_selects_from_the_ledger_and_counts_unseen_clients_as_zero():
    strategy = build_strategy(RunConfig(strategy="pegasus", min_train_nodes=2))
    ledger = _ledger({"client-0": 400, "client-1": 100, "client-2": 50})
    strategy.bind_ledger(ledger)
    strategy.node_client = {10: "client-0", 11: "client-1", 12: "client-2"}
    grid = FakeGrid([10, 11, 12, 13])  # node 13 has not reported yet: epsilon 0
    assert strategy.select_nodes(1, grid) == [10, 11, 12, 13]  # round 1: everyone
    eps = ledger.epsilons()
    mean = (eps["client-0"] + eps["client-1"] + eps["client-2"] + 0.0) / 4
    expected = sorted([n for n, c in strategy.node_client.items() if eps[c] < mean] + [13])
    assert strategy.select_nodes(2, grid) == expected
    assert 10 not in expected and 13 in expected


def test_refused_clients_spend_nothing_and_the_rule_uses_the_ledger():
    # a refusal is not recorded in the ledger, so the refusing client's epsilon stays as it
    # was and it is judged by the same rule next round
    strategy = build_strategy(RunConfig(strategy="pegasus", min_train_nodes=2))
    ledger = _ledger({"client-0": 100, "client-1": 100})
    strategy.bind_ledger(ledger)
    strategy.node_client = {1: "client-0", 2: "client-1"}
    before = ledger.epsilons()
    # (client-1 refused in round 2: nothing is charged)
    assert ledger.epsilons() == before
    assert strategy.select_nodes(3, FakeGrid([1, 2])) == [1, 2]  # tie -> all
