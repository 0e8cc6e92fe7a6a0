"""Strategy registry: run-config ``strategy`` name -> class taking a RunConfig."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from dpfl.config import RunConfig
    from dpfl.strategies.base import DPFLStrategy


def _fedavg(cfg: "RunConfig") -> "DPFLStrategy":
    from dpfl.strategies.fedavg import FedAvgStrategy

    return FedAvgStrategy(cfg)


def _dpfedavg(cfg: "RunConfig") -> "DPFLStrategy":
    from dpfl.strategies.dpfedavg import DPFedAvgStrategy

    return DPFedAvgStrategy(cfg)


STRATEGIES: dict[str, Callable[["RunConfig"], "DPFLStrategy"]] = {
    "fedavg": _fedavg,
    "dpfedavg": _dpfedavg,
}


def build_strategy(cfg: "RunConfig") -> "DPFLStrategy":
    """Instantiate the strategy named by ``cfg.strategy``."""
    return STRATEGIES[cfg.strategy](cfg)
