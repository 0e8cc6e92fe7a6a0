"""``dpfedprox``: DP-FedProx (Li et al. 2020, MLSys) with DP-SGD clients.

Clients minimise f_i(w) + (mu/2)||w - w_global||^2 (``prox-mu``). Under DP-SGD only the data
term is clipped and noised; the proximal gradient mu (w - w_global) is data-independent and
is applied after each DP step (``dpfl.client.trainers.proximal_step``): post-processing,
so the guarantee is the clients' DP-SGD guarantee. Server: sample-weighted mean + SGD step.
"""

from __future__ import annotations

from dpfl.strategies.dpfedavg import DPFedAvgStrategy


class DPFedProxStrategy(DPFedAvgStrategy):
    """The server side of DP-FedProx is DP-FedAvg's; the method lives on the client."""

    name = "dpfedprox"
