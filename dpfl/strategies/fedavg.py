"""``fedavg``: the non-private reference (McMahan et al. 2017) with plain-SGD clients."""

from __future__ import annotations

from dpfl.strategies.base import DPFLStrategy


class FedAvgStrategy(DPFLStrategy):
    """Sample-count-weighted mean of the clients' updates, server SGD step. No DP."""

    name = "fedavg"
