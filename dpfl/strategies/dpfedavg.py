"""``dpfedavg``: DP-FedAvg in its two forms, chosen by the run-config ``trainer``.

- ``trainer=dpsgd`` (sample-level): clients run Opacus DP-SGD (Abadi et al. 2016); the server
  averages the updates weighted by sample counts. Averaging is post-processing.
- ``trainer=update-dp`` (client-level): each client clips its whole update to C and adds
  N(0, sigma^2 C^2) (the Gaussian mechanism of McMahan et al. 2018, applied client-side;
  accounted under replace-one, see ``dpfl.privacy.plan``);
  the server averages with equal weights (dataset sizes stay private) and rejects updates
  whose norm exceeds C + sigma C (sqrt(d) + 10), which an honest noisy update passes except
  with probability < exp(-50).
"""

from __future__ import annotations

import torch

from dpfl.privacy.plan import gaussian_norm_bound, noise_multiplier_for
from dpfl.strategies.base import DPFLStrategy
from dpfl.strategies.validation import ClientUpdate


class DPFedAvgStrategy(DPFLStrategy):
    """DP-FedAvg (see module docstring)."""

    name = "dpfedavg"

    def update_norm_bound(self, dim: int) -> float | None:
        if self.cfg.trainer == "update-dp":
            sigma = self._sigma_for_bound()
            bound = gaussian_norm_bound(self.cfg.clip_norm, sigma, dim)
            user = super().update_norm_bound(dim)
            return min(bound, user) if user else bound
        return super().update_norm_bound(dim)

    def _sigma_for_bound(self) -> float:
        return noise_multiplier_for(self.cfg, 1)

    def aggregation_weights(self, accepted: list[ClientUpdate]) -> torch.Tensor:
        if self.cfg.trainer == "update-dp":
            return torch.ones(len(accepted))
        return super().aggregation_weights(accepted)
