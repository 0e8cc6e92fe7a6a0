"""The trust models' server halves: what the server collects, plans and charges under each.

The client halves are :mod:`dpfl.client.release`; what each model promises and costs is
:mod:`dpfl.privacy.trust`. This module is the server's one dispatch on ``trust``: the guard,
the strategy and the run loop ask the object, never the run-config key.

- :class:`LocalTrust`: each client noises its own update; the server checks each reply
  against the method's plan and charges it to the sender.
- :class:`CentralTrust`: clients send clipped updates to a trusted server, which samples,
  noises the sum and charges every client itself (the aggregator of
  :mod:`dpfl.server.central` or :mod:`dpfl.server.correlated`); replies charge nothing.
- :class:`DistributedTrust`: clients send masked integer shares summed by SecAgg+; every
  participant's event is the sum's, planned from the run's distributed noise.
"""

from __future__ import annotations

from typing import Any

from dpfl.config import RunConfig
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.plan import ReleasePlan
from dpfl.privacy.trust import UNCLIPPED_KEY, distributed_planned_event, noise_shares
from dpfl.server.central import CentralAggregator, FlowerCentralAggregator
from dpfl.server.correlated import CorrelatedAggregator

Aggregator = CentralAggregator | FlowerCentralAggregator | CorrelatedAggregator


class LocalTrust:
    """``trust=local`` (and ``trainer=plain``, which releases without noise)."""

    # the client plans, checks its budget and spends; the server charges each reply
    clients_charge = True
    # the round is a SecAgg+ sum (the run loop collects it with the secure exchange)
    secure_sum = False
    # reply metrics the trust model adds to the public ones
    reply_keys: frozenset[str] = frozenset()

    def planned_event(self, cfg: RunConfig, plan: ReleasePlan, num_examples: int,
                      server_round: int, dim: int, num_clients: int) -> PrivacyEvent:
        """The release a client of ``num_examples`` makes in ``server_round``: the method's
        plan (its own event, or the shared one at its sigma)."""
        return plan.event_for(cfg, num_examples, server_round)

    def aggregator(self, cfg: RunConfig, num_clients: int) -> Aggregator | None:
        """The trusted server's noisy aggregator (None: the clients noise)."""
        return None

    def round_config(self, cfg: RunConfig, sampled: int) -> dict[str, Any]:
        """Public per-round keys of the trust model (besides the aggregator's)."""
        return {}


class CentralTrust(LocalTrust):
    """``trust=central``: the server is the mechanism."""

    clients_charge = False
    reply_keys = frozenset({UNCLIPPED_KEY})   # the within-C bit, covered centrally

    def aggregator(self, cfg: RunConfig, num_clients: int) -> Aggregator:
        if cfg.central_noise != "gaussian":   # tree or banded MF: no sampling assumed
            return CorrelatedAggregator(cfg, num_clients)
        if cfg.central_impl == "flower":
            return FlowerCentralAggregator(cfg, num_clients)
        return CentralAggregator(cfg, num_clients)


class DistributedTrust(LocalTrust):
    """``trust=distributed``: the sum of every participant's noise share covers each."""

    secure_sum = True

    def planned_event(self, cfg: RunConfig, plan: ReleasePlan, num_examples: int,
                      server_round: int, dim: int, num_clients: int) -> PrivacyEvent:
        return distributed_planned_event(cfg, server_round, dim, num_clients)

    def round_config(self, cfg: RunConfig, sampled: int) -> dict[str, Any]:
        # the number of shares the noise is split over: h = n_min - t
        return {"secagg-n-min": noise_shares(cfg, sampled)}


TRUST_MODELS: dict[str, LocalTrust] = {"local": LocalTrust(), "central": CentralTrust(),
                                       "distributed": DistributedTrust()}


def server_trust(cfg: RunConfig) -> LocalTrust:
    """The server half of ``cfg``'s trust model."""
    return TRUST_MODELS[cfg.trust]
