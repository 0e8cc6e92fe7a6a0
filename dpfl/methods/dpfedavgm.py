"""``dpfedavgm``: DP-FedAvg with server momentum (McMahan, Ramage, Talwar & Zhang, "Learning
Differentially Private Recurrent Language Models", ICLR 2018, the DP-FedAvg variant whose
server optimizer is SGD with momentum).

The server keeps a velocity v (zero at the start) and, with the mean update u_bar of the
round's accepted clients (trained - received, so + descends), steps

    v <- beta v + u_bar,        w <- w + eta v

(heavy-ball momentum, beta = ``server-momentum``, eta = ``server-lr``). beta = 0 is
DP-FedAvg exactly. The step only post-processes the clients' DP outputs: the guarantee is
the clients' (DP-SGD or client-level update DP, from the DP guard).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dpfl.config import TRUSTS as ALL_TRUSTS
from dpfl.config import RunConfig, need
from dpfl.method import Method, MethodParams
from dpfl.privacy.plan import PlanFn, shared_plan
from dpfl.server.strategy import DPFLStrategy, StrategyInputs


@dataclass(frozen=True)
class MomentumParams(MethodParams):
    server_momentum: float = 0.9     # beta of the server's heavy-ball momentum

    HELP = {"server-momentum": "heavy-ball momentum β of the server step (0 = DP-FedAvg)"}

    def validate(self) -> None:
        need(0.0 <= self.server_momentum < 1.0, "server-momentum", "must be in [0, 1)",
             self.server_momentum)


def momentum_step(w: torch.Tensor, velocity: torch.Tensor | None, update: torch.Tensor,
                  beta: float, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(w + lr v, v) with v = beta velocity + update (velocity None = zero)."""
    v = update.clone() if velocity is None else beta * velocity + update
    return w + lr * v, v


class DPFedAvgMStrategy(DPFLStrategy):
    """DP-FedAvg's aggregation with a momentum server step."""

    def __init__(self, cfg: RunConfig, adaptive: bool = False,
                 plan: PlanFn = shared_plan, inputs: StrategyInputs | None = None) -> None:
        super().__init__(cfg, adaptive, plan, inputs)
        self.velocity: torch.Tensor | None = None

    def server_step(self, global_flat: torch.Tensor, aggregated: torch.Tensor) -> torch.Tensor:
        new, self.velocity = momentum_step(global_flat, self.velocity, aggregated,
                                           self.cfg.params.server_momentum, self.cfg.server_lr)
        return new

    def round_metrics(self, record) -> dict[str, float]:
        """Besides the counts: ``server-velocity-norm`` = ||v|| after the step."""
        out = super().round_metrics(record)
        if self.velocity is not None:
            out["server-velocity-norm"] = float(self.velocity.norm())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "velocity": self.velocity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.velocity = state.get("velocity")


METHOD = Method(
    name="dpfedavgm",
    citation="McMahan, Ramage, Talwar & Zhang, Learning Differentially Private Recurrent "
             "Language Models, ICLR 2018 (DP-FedAvg with server momentum)",
    strategy=DPFedAvgMStrategy,
    params=MomentumParams,
    presets="dpfedavgm",
    trusts=ALL_TRUSTS,
)
