"""``pegasus``: PEGASUS, privacy-budget-based adaptive client selection (Alves, da Costa,
Gonzalez, de Souza & Villas, "Seleção de Clientes Adaptativa baseada em Privacidade
Diferencial para Aprendizado Federado", SBRC).

Clients train with DP-SGD and report their cumulative epsilon after each round. Round 1
selects every client. From round 2 on, the server takes the mean epsilon over all clients
(a client that has not trained yet has spent 0) and selects the clients whose epsilon is
**strictly below** that mean. Tie rule: when no client is strictly below the mean (all
epsilons equal), every client is selected, so the federation never stalls. A selected client
that would pass its budget refuses (and spends nothing); the round goes on with the others,
and the run stops once every client refuses.

CHOICE (the paper is silent): a client that refused at its budget is not selected again. Its
per-round cost is fixed by public parameters and its history only grows, so it would refuse
every later round; the paper's rule alone would select it forever when its epsilon stays
below the mean (a client too small to afford even one round stays at 0), and a round that
selects only such clients trains nobody. The mean is still taken over all clients, as in
the paper. When every client has refused, all are selected once more, so every node is
asked, every node refuses, and the run stops. The set lives in memory: after a resume a
client is asked (and refuses) once again.

Selection happens in ``configure_train`` from the server ledger's values only, which are
functions of public noise parameters and of earlier selections, not of data: it does not
weaken the clients' DP-SGD guarantee (verdict ``formal``).
"""

from __future__ import annotations

from typing import AbstractSet, Iterable, Mapping

from flwr.app import Message
from flwr.serverapp import Grid

from dpfl.config import RunConfig
from dpfl.method import Method
from dpfl.privacy.accounting.budget import BUDGET_REFUSAL
from dpfl.privacy.plan import PlanFn, shared_plan
from dpfl.server.strategy import DPFLStrategy, RoundOutcome, RoundRecord, StrategyInputs


def pegasus_select(epsilons: Mapping[int, float],
                   out_of_budget: AbstractSet[int] = frozenset()) -> list[int]:
    """Nodes whose epsilon is strictly below the mean of all, leaving out those that
    refused at their budget; all that can still train on a tie; all when none can."""
    if not epsilons:
        return []
    mean = sum(epsilons.values()) / len(epsilons)
    can_train = {n: e for n, e in epsilons.items() if n not in out_of_budget}
    if not can_train:
        return sorted(epsilons)
    below = sorted(n for n, e in can_train.items() if e < mean)
    return below if below else sorted(can_train)


class PegasusStrategy(DPFLStrategy):
    """DP-FedAvg aggregation with PEGASUS selection."""

    def __init__(self, cfg: RunConfig, adaptive: bool = False,
                 plan: PlanFn = shared_plan, inputs: StrategyInputs | None = None) -> None:
        super().__init__(cfg, adaptive, plan, inputs)
        self.out_of_budget: set[int] = set()   # nodes that refused at their budget

    def select_nodes(self, server_round: int, grid: Grid) -> list[int]:
        nodes = self.available_nodes(grid)
        if server_round == 1 or self.ledger is None:
            return nodes
        eps = {n: self.ledger.epsilon(client) if (client := self.nodes.client_of(n)) else 0.0
               for n in nodes}
        return pegasus_select(eps, self.out_of_budget)

    def finish_round(self, server_round: int, record: RoundRecord,
                     replies: Iterable[Message]) -> RoundOutcome:
        outcome = super().finish_round(server_round, record, replies)
        self.out_of_budget |= budget_refusals(outcome.record)
        return outcome


def budget_refusals(record: RoundRecord) -> set[int]:
    """Nodes that refused this round because the round would pass their budget."""
    return {r.node_id for r in record.rejected
            if r.kind == "refused" and r.reason.startswith(BUDGET_REFUSAL)}


METHOD = Method(
    name="pegasus",
    citation="Alves, da Costa, Gonzalez, de Souza & Villas, Seleção de Clientes Adaptativa "
             "baseada em Privacidade Diferencial para Aprendizado Federado, SBRC",
    strategy=PegasusStrategy,
    presets="pegasus",
)
