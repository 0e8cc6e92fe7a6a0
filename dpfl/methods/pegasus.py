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

Selection happens in ``configure_train`` from the server ledger's values only, which are
functions of public noise parameters and of earlier selections, not of data: it does not
weaken the clients' DP-SGD guarantee (verdict ``formal``).
"""

from __future__ import annotations

from typing import Mapping

from flwr.serverapp import Grid

from dpfl.method import Method
from dpfl.server.strategy import DPFLStrategy


def pegasus_select(epsilons: Mapping[int, float]) -> list[int]:
    """Nodes whose epsilon is strictly below the mean of all; all of them on a tie."""
    if not epsilons:
        return []
    mean = sum(epsilons.values()) / len(epsilons)
    below = sorted(n for n, e in epsilons.items() if e < mean)
    return below if below else sorted(epsilons)


class PegasusStrategy(DPFLStrategy):
    """DP-FedAvg aggregation with PEGASUS selection."""

    def select_nodes(self, server_round: int, grid: Grid) -> list[int]:
        nodes = self.wait_for_nodes(grid, self.min_available_nodes)
        if server_round == 1 or self.ledger is None:
            return nodes
        eps = {n: self.ledger.epsilon(self.node_client[n]) if n in self.node_client else 0.0
               for n in nodes}
        return pegasus_select(eps)


METHOD = Method(
    name="pegasus",
    citation="Alves, da Costa, Gonzalez, de Souza & Villas, Seleção de Clientes Adaptativa "
             "baseada em Privacidade Diferencial para Aprendizado Federado, SBRC",
    strategy=PegasusStrategy,
    presets="pegasus",
)
