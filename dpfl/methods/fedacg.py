"""``fedacg``: FedACG (Kim, Kim & Han, "Communication-Efficient Federated Learning with
Accelerated Client Gradient", CVPR 2024) with DP clients.

Algorithm (the paper's Algorithm 1; checked against the authors' public code,
github.com/geehokim/FedACG, ``servers/base.py`` ``ServerM`` with ``FedACG: True`` and
``clients/base_client.py``):

- the server keeps the momentum m (m_0 = 0) and broadcasts the lookahead model
  x~_t = x_{t-1} + λ m_{t-1} instead of x_{t-1};
- client i starts at y = x~_t and minimises f_i(y) + (β/2)‖y − x~_t‖² (its local steps pull
  towards the lookahead model), and sends Δ_i = y_K − x~_t;
- the server averages, m_t = λ m_{t-1} + mean_i Δ_i, and x_t = x_{t-1} + η m_t (η =
  ``server-lr``; the paper's η = 1, where x_t = x~_t + mean_i Δ_i, which is the authors'
  code: the new global model is the mean of the local models).

Readings (CHOICE where ours):

- λ = ``acg-lambda`` (default 0.85, the authors' ``momentum: 0.85``).
- β = ``acg-beta`` in (β/2)‖y − x~_t‖², whose gradient is β (y − x~_t). CHOICE: default
  0.002, the authors' ``prox_loss weight: 1e-3`` on the un-halved ‖y − x~_t‖² (gradient
  2·10⁻³ (y − x~_t)).
- The mean is weighted by the public partition sizes under plain training and equal under
  client-level DP (the shared guard's rule); the paper averages uniformly over the sampled
  clients.

DP (why it composes): the lookahead x~_t is computed by the server from earlier rounds'
released (DP) aggregates: post-processing, public to the clients. Under ``trainer=update-dp``
the whole local update Δ_i (regulariser included) is clipped and noised: the usual
client-level Gaussian release. Under ``trainer=dpsgd`` only the data term's per-sample
gradients are clipped and noised; the regulariser's gradient β (y − x~_t) depends on y and
the public x~_t, not on any record, and is applied after each DP step (as DP-FedProx does):
post-processing. The server's momentum only post-processes the releases. The guarantee is
the clients' DP guarantee, under every trust model (the server uses only the mean).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from dpfl.client.hooks import MethodHooks
from dpfl.config import TRUSTS as ALL_TRUSTS
from dpfl.config import RunConfig, need
from dpfl.method import ClientHalf, Method, MethodParams
from dpfl.methods.dpfedprox import proximal_step
from dpfl.privacy.plan import PlanFn, shared_plan
from dpfl.server.strategy import DPFLStrategy, RoundRecord, StrategyInputs
from dpfl.tensors import flatten, unflatten


@dataclass(frozen=True)
class ACGParams(MethodParams):
    acg_lambda: float = 0.85     # λ: momentum decay and lookahead coefficient
    acg_beta: float = 0.002      # β of the local regulariser (β/2)‖y − x~_t‖²

    HELP = {"acg-lambda": "FedACG's λ: server momentum m ← λm + mean Δ, and clients start "
                          "at the lookahead x + λm (0 = FedAvg with the regulariser)",
            "acg-beta": "FedACG's β of the local regulariser (β/2)‖y − (x + λm)‖² "
                        "(0 = none; 0.002 = the authors' code's weight 1e-3 on ‖·‖²)"}

    def validate(self) -> None:
        need(0.0 <= self.acg_lambda < 1.0, "acg-lambda", "must be in [0, 1)",
             self.acg_lambda)
        need(self.acg_beta >= 0.0, "acg-beta", "must be >= 0", self.acg_beta)


def lookahead(x: torch.Tensor, momentum: torch.Tensor | None, lam: float) -> torch.Tensor:
    """x~ = x + λ m (m None = 0): the model FedACG broadcasts."""
    return x.clone() if momentum is None else x + lam * momentum


def acg_server_step(x: torch.Tensor, momentum: torch.Tensor | None, mean_update: torch.Tensor,
                    lam: float, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, m_t): m_t = λ m_{t-1} + mean Δ, x_t = x_{t-1} + η m_t (m None = 0)."""
    m = mean_update.clone() if momentum is None else lam * momentum + mean_update
    return x + lr * m, m


class FedACGStrategy(DPFLStrategy):
    """Sends the lookahead model; the server step is FedACG's momentum update."""

    def __init__(self, cfg: RunConfig, adaptive: bool = False,
                 plan: PlanFn = shared_plan, inputs: StrategyInputs | None = None) -> None:
        super().__init__(cfg, adaptive, plan, inputs)
        self.momentum: torch.Tensor | None = None
        self._base: torch.Tensor | None = None     # x_{t-1} of the open round

    def start_round(self, server_round: int, arrays: ArrayRecord, grid: Grid,
                    extra_config=None) -> tuple[list[Message], RoundRecord]:
        """Broadcast x~_t = x_{t-1} + λ m_{t-1}; updates come back relative to it."""
        state = arrays.to_torch_state_dict()
        self._base = flatten(state)
        ahead = lookahead(self._base, self.momentum, self.cfg.params.acg_lambda)
        return super().start_round(server_round, ArrayRecord(unflatten(ahead, state)), grid,
                                   extra_config)

    def server_step(self, global_flat: torch.Tensor, aggregated: torch.Tensor) -> torch.Tensor:
        # global_flat is the lookahead the clients received; the step starts at x_{t-1}
        base = global_flat if self._base is None else self._base
        new, self.momentum = acg_server_step(base, self.momentum, aggregated,
                                             self.cfg.params.acg_lambda, self.cfg.server_lr)
        return new

    def round_metrics(self, record) -> dict[str, float]:
        """Besides the counts: ``acg-momentum-norm`` = ‖m‖ after the step."""
        out = super().round_metrics(record)
        if self.momentum is not None:
            out["acg-momentum-norm"] = float(self.momentum.norm())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "acg-momentum": self.momentum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.momentum = state.get("acg-momentum")


class ACGClient(ClientHalf):
    """The regulariser (β/2)‖y − x~_t‖² around the received (lookahead) model, applied after
    every local step (data-independent)."""

    def hooks(self, cfg, msg, context, model) -> MethodHooks:
        if cfg.params.acg_beta <= 0:
            return MethodHooks()
        received: Iterable[torch.Tensor] = [p.detach().clone() for p in model.parameters()]
        return MethodHooks(post_step=proximal_step(list(received), cfg.params.acg_beta))


METHOD = Method(
    name="fedacg",
    citation="Kim, Kim & Han, Communication-Efficient Federated Learning with Accelerated "
             "Client Gradient, CVPR 2024 (FedACG)",
    strategy=FedACGStrategy,
    client=ACGClient(),
    params=ACGParams,
    trusts=ALL_TRUSTS,
)
