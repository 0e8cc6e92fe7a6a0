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


def _lazy(module: str, cls: str) -> Callable[["RunConfig"], "DPFLStrategy"]:
    def build(cfg: "RunConfig") -> "DPFLStrategy":
        import importlib

        return getattr(importlib.import_module(f"dpfl.strategies.{module}"), cls)(cfg)
    return build


STRATEGIES: dict[str, Callable[["RunConfig"], "DPFLStrategy"]] = {
    "fedavg": _fedavg,
    "dpfedavg": _dpfedavg,
    "gcfl": _lazy("gcfl", "GCFLStrategy"),
    "dpfedprox": _lazy("dpfedprox", "DPFedProxStrategy"),
    "dpscaffold": _lazy("dpscaffold", "DPScaffoldStrategy"),
    "dpfedexp": _lazy("dpfedexp", "DPFedExPStrategy"),
    "pegasus": _lazy("pegasus", "PegasusStrategy"),
    "aadp": _lazy("aadp", "AADPStrategy"),
}


def build_strategy(cfg: "RunConfig") -> "DPFLStrategy":
    """Instantiate the strategy named by ``cfg.strategy``."""
    return STRATEGIES[cfg.strategy](cfg)
