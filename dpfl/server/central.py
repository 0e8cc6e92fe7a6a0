"""The trusted server of ``trust=central`` (``dpfl.privacy.trust``): Poisson client
sampling, the noisy clipped sum over a fixed denominator, adaptive clipping.

McMahan, Ramage, Talwar & Zhang, "Learning Differentially Private Recurrent Language
Models", ICLR 2018 (DP-FedAvg with the fixed-denominator estimator): each client joins a
round independently with probability q; the round's model delta is
(sum_i clip_C(Delta_i) + N(0, sigma^2 C^2 I)) / (q N). Adaptive C: Andrew, Thakkar, McMahan
& Ramaswamy, "Differentially Private Learning with Adaptive Clipping", NeurIPS 2021, from
the clients' within-C bits (:class:`dpfl.privacy.mechanisms.QuantileClipTracker`, the same
estimator FedCompDP's ``private-quantile`` uses).
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
)

from dpfl.config import RunConfig
from dpfl.privacy.events import PrivacyEvent
from dpfl.privacy.mechanisms import QuantileClipTracker, l2_clip
from dpfl.privacy.randomness import public_seed, secret_generator
from dpfl.privacy.trust import (
    CENTRAL_RELATION,
    FLOWER_RELATION,
    central_events,
    central_noise_multiplier,
    count_stddev,
    expected_clients,
)

CLIP_KEY = "central-clip"     # the round's C in every instruction


def poisson_sample(nodes: Sequence[int], rate: float, rng: random.Random) -> list[int]:
    """Every node independently with probability ``rate`` (the round size varies)."""
    return sorted(n for n in nodes if rng.random() < rate)


def noisy_clipped_mean(updates: torch.Tensor, clip: float, sigma: float, denominator: float,
                       generator: torch.Generator) -> torch.Tensor:
    """(sum_i clip_C(u_i) + N(0, sigma^2 C^2 I)) / denominator for an M x d matrix (M may
    be 0: the noise alone). The server clips again: its sensitivity never rests on the
    clients' own clipping."""
    dim = updates.shape[1]
    total = torch.zeros(dim, dtype=torch.float64)
    for row in updates:
        total += l2_clip(row.double(), clip)
    total += sigma * clip * torch.randn(dim, generator=generator, dtype=torch.float64)
    return (total / denominator).to(updates.dtype)


class CentralAggregator:
    """The central mechanism's state: sigma, C (adaptive or fixed), its randomness."""

    def __init__(self, cfg: RunConfig, num_clients: int) -> None:
        self.cfg = cfg
        self.num_clients = num_clients
        self.rate = cfg.fraction_train
        self.denominator = expected_clients(cfg, num_clients)
        self.sigma = central_noise_multiplier(cfg, num_clients)
        self.count_std = count_stddev(cfg, num_clients) if cfg.adaptive_clip else None
        self.tracker = (QuantileClipTracker(cfg.clip_norm, cfg.clip_target_quantile,
                                            cfg.clip_lr, self.count_std, CENTRAL_RELATION)
                        if cfg.adaptive_clip else None)
        if cfg.reproducible:  # public seeds: bit-identical reruns, verdict none
            self.rng: random.Random = random.Random(public_seed(cfg.seed, -1, 0))
            self.noise = torch.Generator().manual_seed(public_seed(cfg.seed, -2, 0))
        else:
            self.rng = random.SystemRandom()
            self.noise = secret_generator()

    @property
    def clip(self) -> float:
        return self.tracker.clip if self.tracker is not None else self.cfg.clip_norm

    def sample(self, nodes: Sequence[int]) -> list[int]:
        return poisson_sample(nodes, self.rate, self.rng)

    def round_config(self) -> dict[str, Any]:
        return {CLIP_KEY: self.clip}

    def aggregate(self, updates: torch.Tensor, within: Sequence[float]) -> torch.Tensor:
        """The round's noisy mean; then (adaptive) the noisy count moves C."""
        mean = noisy_clipped_mean(updates, self.clip, self.sigma, self.denominator, self.noise)
        if self.tracker is not None:
            self.tracker.release_bits(torch.tensor(list(within), dtype=torch.float64) > 0.5,
                                      self.noise, 0, self.denominator)
        return mean

    def events(self, server_round: int) -> list[PrivacyEvent]:
        """What the round costs every client (:func:`dpfl.privacy.trust.central_events`)."""
        return central_events(server_round, self.sigma, self.rate, self.count_std)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"central-clip": self.clip}
        if self.tracker is not None:
            state["central-clip-history"] = list(self.tracker.history)
        if isinstance(self.rng, random.Random) and not isinstance(self.rng, random.SystemRandom):
            state["central-rng"] = self.rng.getstate()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.tracker is not None and "central-clip" in state:
            self.tracker.clip = float(state["central-clip"])
            self.tracker.history = list(state.get("central-clip-history", []))
        if "central-rng" in state and not isinstance(self.rng, random.SystemRandom):
            self.rng.setstate(state["central-rng"])


class FlowerCentralAggregator:
    """``central-impl=flower``: the same round through Flower 1.39's own wrapper,
    ``DifferentialPrivacyServerSide{Adaptive,Fixed}Clipping`` around ``FedAvg`` (server-side
    clipping, fixed-size sampling of k = q N clients, noise std sigma C / k on the mean),
    for a side-by-side with dpfl's central mechanism. Flower reports no epsilon; dpfl
    charges what the wrapper actually did: per round a Gaussian on the mean under
    replace-one (fixed-size samples are analysed under replace-one; no amplification is
    claimed, so every client's charge is an upper bound) at the EFFECTIVE multiplier —
    the wrapper clips with C_t but draws the noise with the C_{t+1} it has just computed,
    so sigma_eff = sigma_Delta C_{t+1} / C_t — plus its noisy count of clipped updates
    (std sigma_b, sensitivity 1)."""

    def __init__(self, cfg: RunConfig, num_clients: int) -> None:
        self.cfg = cfg
        self.num_clients = num_clients
        self.k = max(1, int(num_clients * cfg.fraction_train))
        self.sigma = central_noise_multiplier(cfg.replace(adaptive_clip=False), num_clients) \
            if cfg.noise_multiplier <= 0 else cfg.noise_multiplier
        std = count_stddev(cfg, num_clients) if cfg.adaptive_clip else None
        if cfg.adaptive_clip:
            self.wrapper = DifferentialPrivacyServerSideAdaptiveClipping(
                FedAvg(), self.sigma, self.k, cfg.clip_norm, cfg.clip_target_quantile,
                cfg.clip_lr, std)
            self.count_std = float(self.wrapper.clipped_count_stddev)
        else:
            self.wrapper = DifferentialPrivacyServerSideFixedClipping(
                FedAvg(), self.sigma, cfg.clip_norm, self.k)
            self.count_std = None
        self.rng: random.Random = (random.Random(public_seed(cfg.seed, -1, 0))
                                   if cfg.reproducible else random.SystemRandom())
        self.global_arrays: ArrayRecord | None = None
        self.effective: dict[int, float] = {}      # round -> effective noise multiplier
        self.clips: list[float] = []

    @property
    def clip(self) -> float:
        return float(self.wrapper.clipping_norm)

    def sample(self, nodes: Sequence[int]) -> list[int]:
        return sorted(self.rng.sample(list(nodes), min(self.k, len(nodes))))

    def round_config(self) -> dict[str, Any]:
        return {CLIP_KEY: 0.0}   # clients send raw updates: Flower clips on the server

    def aggregate(self, updates: torch.Tensor, within: Sequence[float],
                  server_round: int = 0) -> torch.Tensor:
        """Flower's wrapper on replies carrying global + update; back to a mean update."""
        if self.global_arrays is None:
            raise RuntimeError("bind the round's global arrays first")
        keys = list(self.global_arrays.keys())
        base = [self.global_arrays[k].numpy() for k in keys]
        flat_base = np.concatenate([b.reshape(-1) for b in base]).astype(np.float64)
        replies = []
        for row in updates.double().numpy():
            arrays, offset = {}, 0
            for k, b in zip(keys, base):
                arrays[k] = Array(np.asarray(b + row[offset:offset + b.size].reshape(b.shape),
                                             dtype=b.dtype))
                offset += b.size
            msg = Message(RecordDict({"arrays": ArrayRecord(arrays),
                                      "metrics": MetricRecord({"num-examples": 1})}),
                          dst_node_id=0, message_type=MessageType.TRAIN)
            replies.append(msg)
        before = self.clip
        self.wrapper.current_arrays = self.global_arrays   # what configure_train would set
        aggregated, _ = self.wrapper.aggregate_train(server_round, replies) if replies else \
            (None, None)
        self.clips.append(before)
        self.effective[server_round] = float(self.wrapper.noise_multiplier) * self.clip / before
        if aggregated is None:
            return torch.zeros(updates.shape[1], dtype=updates.dtype)
        flat = np.concatenate([aggregated[k].numpy().reshape(-1) for k in keys])
        return torch.from_numpy(flat.astype(np.float64) - flat_base).to(updates.dtype)

    def events(self, server_round: int) -> list[PrivacyEvent]:
        sigma = self.effective.get(server_round, float(self.wrapper.noise_multiplier))
        events = [PrivacyEvent.gaussian(server_round, sigma, relation=FLOWER_RELATION)]
        if self.count_std is not None:
            events.append(PrivacyEvent.gaussian(server_round, 2.0 * self.count_std,
                                                relation=FLOWER_RELATION,
                                                mechanism="quantile-count"))
        return events

    def state_dict(self) -> dict[str, Any]:
        return {"central-clip": self.clip, "central-clip-history": list(self.clips)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "central-clip" in state:
            self.wrapper.clipping_norm = float(state["central-clip"])
            self.clips = list(state.get("central-clip-history", []))
