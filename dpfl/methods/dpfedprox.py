"""``dpfedprox``: DP-FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar & Smith, "Federated
Optimization in Heterogeneous Networks", MLSys 2020) with DP clients.

Clients minimise f_i(w) + (mu/2)||w - w_global||^2 (``prox-mu``). Under DP-SGD only the data
term is clipped and noised; the proximal gradient mu (w - w_global) is data-independent and
is applied after each DP step (:func:`proximal_step`): post-processing, so the guarantee is
the clients' DP guarantee. Server: the shared base strategy (weighted mean + SGD step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dpfl.client.hooks import MethodHooks
from dpfl.client.trainers import PostStep
from dpfl.config import TRUSTS as ALL_TRUSTS
from dpfl.config import need
from dpfl.method import ClientHalf, Method, MethodParams
from dpfl.server.strategy import DPFLStrategy


@dataclass(frozen=True)
class ProxParams(MethodParams):
    prox_mu: float = 0.01      # mu of the proximal term

    HELP = {"prox-mu": "proximal weight μ of the local objective's (μ/2)‖w − w_t‖² term"}

    def validate(self) -> None:
        need(self.prox_mu >= 0, "prox-mu", "must be >= 0", self.prox_mu)


def proximal_step(global_params: list[torch.Tensor], mu: float) -> PostStep:
    """The gradient of (mu/2)||w - w_global||^2 is mu (w - w_global); applied as
    w <- w - lr mu (w - w_global) after each step (data-independent)."""
    @torch.no_grad()
    def step(model: nn.Module, lr: float) -> None:
        for p, g in zip(model.parameters(), global_params):
            p.sub_(lr * mu * (p - g))
    return step


class ProxClient(ClientHalf):
    def hooks(self, cfg, msg, context, model) -> MethodHooks:
        if cfg.params.prox_mu <= 0:
            return MethodHooks()
        global_params = [p.detach().clone() for p in model.parameters()]
        return MethodHooks(post_step=proximal_step(global_params, cfg.params.prox_mu))


METHOD = Method(
    name="dpfedprox",
    citation="Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020",
    strategy=DPFLStrategy,
    client=ProxClient(),
    params=ProxParams,
    trusts=ALL_TRUSTS,
)
