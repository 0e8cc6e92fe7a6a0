"""``dpfedexp``: DP-FedExP, FedExP's extrapolated server step (Jhunjhunwala, Wang & Joshi,
"FedExP: Speeding Up Federated Averaging via Extrapolation", ICLR 2023) on DP clients'
updates.

With client pseudo-gradients Delta_i (here the updates u_i = trained - received, so
Delta_i = -u_i) and their mean Delta_bar over the M participating clients, the server step
size is

    eta_g = max(1, sum_i ||Delta_i||^2 / (2 M (||Delta_bar||^2 + epsilon)))    (FedExP eq. 9)

and w <- w - eta_g Delta_bar = w + eta_g u_bar. Uniform 1/M averaging as in the paper;
``fedexp-epsilon`` is its small constant. DP noise inflates sum ||Delta_i||^2 relative to
||Delta_bar||^2, which raises eta_g: that is the method as published. Server-side
post-processing only: the guarantee is the clients'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpfl.config import need
from dpfl.method import Method, MethodParams
from dpfl.server.aggregation import server_sgd_step
from dpfl.server.strategy import DPFLStrategy
from dpfl.server.validation import ClientUpdate


@dataclass(frozen=True)
class FedExPParams(MethodParams):
    fedexp_epsilon: float = 1e-3      # FedExP's small constant in eq. 9

    HELP = {"fedexp-epsilon": "FedExP's small constant ε in the step-size denominator (eq. 9)"}

    def validate(self) -> None:
        need(self.fedexp_epsilon > 0, "fedexp-epsilon", "must be > 0", self.fedexp_epsilon)


def fedexp_statistics(updates: torch.Tensor) -> tuple[float, float, int]:
    """(sum_i ||Delta_i||^2, ||Delta_bar||^2, M) of an M x d matrix of client updates."""
    m = updates.shape[0]
    mean = updates.mean(0)
    total = float((updates.to(torch.float64) ** 2).sum())
    return total, float((mean.to(torch.float64) ** 2).sum()), m


def fedexp_step_from(statistics: tuple[float, float, int], epsilon: float) -> float:
    """FedExP's eta_g = max(1, sum_i ||Delta_i||^2 / (2 M (||Delta_bar||^2 + eps)))."""
    total, mean_sq, m = statistics
    return max(1.0, total / (2.0 * m * (mean_sq + epsilon)))


def fedexp_step_size(updates: torch.Tensor, epsilon: float) -> float:
    """FedExP's eta_g for an M x d matrix of client updates (sign-invariant)."""
    return fedexp_step_from(fedexp_statistics(updates), epsilon)


class DPFedExPStrategy(DPFLStrategy):
    """Uniform mean of the updates, extrapolated by FedExP's eta_g."""

    last_step_size = 1.0
    last_statistics: tuple[float, float, int] = (0.0, 0.0, 0)

    def aggregation_weights(self, accepted: list[ClientUpdate]) -> torch.Tensor:
        return torch.ones(len(accepted))

    def aggregate_updates(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        self.last_statistics = fedexp_statistics(updates)
        self.last_step_size = fedexp_step_from(self.last_statistics, self.cfg.params.fedexp_epsilon)
        return super().aggregate_updates(updates, weights)

    def server_step(self, global_flat: torch.Tensor, aggregated: torch.Tensor) -> torch.Tensor:
        return server_sgd_step(global_flat, aggregated, self.last_step_size * self.cfg.server_lr)

    def round_metrics(self, record) -> dict[str, float]:
        """The step size and the quantities it was computed from (eq. 9), so that the
        record can be checked: ``fedexp-sum-sq-norm`` = sum_i ||Delta_i||^2,
        ``fedexp-mean-sq-norm`` = ||Delta_bar||^2, ``fedexp-clients`` = M."""
        total, mean_sq, m = self.last_statistics
        return {**super().round_metrics(record), "server-step-size": self.last_step_size,
                "fedexp-sum-sq-norm": total, "fedexp-mean-sq-norm": mean_sq,
                "fedexp-clients": m}


METHOD = Method(
    name="dpfedexp",
    citation="Jhunjhunwala, Wang & Joshi, FedExP: Speeding Up Federated Averaging via "
             "Extrapolation, ICLR 2023",
    strategy=DPFedExPStrategy,
    params=FedExPParams,
)
