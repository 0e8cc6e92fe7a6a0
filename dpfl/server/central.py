"""The trusted server of ``trust=central`` (``dpfl.privacy.trust``): Poisson client
sampling, the noisy clipped sum over a fixed denominator, adaptive clipping.

McMahan, Ramage, Talwar & Zhang, "Learning Differentially Private Recurrent Language
Models", ICLR 2018 (DP-FedAvg with the fixed-denominator estimator): each client joins a
round independently with probability q; the round's model delta is
(sum_i clip_C(Delta_i) + N(0, sigma^2 C^2 I)) / (q N). Adaptive C: Andrew, Thakkar, McMahan
& Ramaswamy, "Differentially Private Learning with Adaptive Clipping", NeurIPS 2021, from
the clients' within-C bits (:class:`dpfl.privacy.mechanisms.release.QuantileClipTracker`, the same
estimator FedCompDP's ``private-quantile`` uses).
"""

from __future__ import annotations

import math
import random
from typing import Any, Sequence

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

from dpfl.config import RunConfig
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.mechanisms.randomness import public_seed, secret_generator
from dpfl.privacy.mechanisms.release import QuantileClipTracker, l2_clip
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
    """Every node independently with probability ``rate`` (the round size varies). From the
    OS's entropy (``random.SystemRandom``), the uniforms are drawn in one read, not one
    system call per node (10 ms a round at 10,000 nodes): each is ``k / 2**53`` for 53
    random bits ``k``, exactly as ``SystemRandom.random`` forms it; a seeded generator
    draws one ``random()`` per node, in node order, as before."""
    nodes = list(nodes)
    if not isinstance(rng, random.SystemRandom) or not nodes:
        return sorted(n for n in nodes if rng.random() < rate)
    words = np.frombuffer(rng.randbytes(8 * len(nodes)), dtype=np.uint64) >> np.uint64(11)
    uniforms = words.astype(np.float64) * 2.0 ** -53
    return sorted(n for n, keep in zip(nodes, (uniforms < rate).tolist()) if keep)


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


def central_randomness(cfg: RunConfig) -> tuple[random.Random, torch.Generator]:
    """The trusted server's sampling rng and noise generator: public seeds in
    ``reproducible`` mode (bit-identical reruns, verdict none), else the OS's entropy."""
    if cfg.reproducible:
        return (random.Random(public_seed(cfg.seed, -1, 0)),
                torch.Generator().manual_seed(public_seed(cfg.seed, -2, 0)))
    return random.SystemRandom(), secret_generator()


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
        self.rng, self.noise = central_randomness(cfg)

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
    ``DifferentialPrivacyServerSideFixedClipping`` around ``FedAvg`` (server-side clipping,
    fixed-size sampling of k = q N clients, noise std sigma C / k on the mean), for a
    side-by-side with dpfl's central mechanism. Flower reports no epsilon; dpfl charges
    what the wrapper does: per round a Gaussian on the mean under replace-one (fixed-size
    samples are analysed under replace-one; no amplification is claimed, so every client's
    charge is an upper bound).

    Flower's wrapper adds N(0, (sigma C / k)^2) to the MEAN of the replies it is handed and
    does not require k of them: with m < k the sum carries noise sigma C m / k, an
    effective multiplier sigma m / k. dpfl therefore always hands it k replies, the
    accepted updates plus k - m padding replies (a node that dropped out, failed or was
    rejected contributes nothing): the mean is the fixed-denominator sum / k and the
    multiplier is sigma whatever m is. (Flower's clip divides by the update's norm, so a
    padding reply is a PUBLIC constant update p of norm C / 2, whose share (k - m) p / k
    is subtracted from the wrapper's output: post-processing.) Flower's ADAPTIVE wrapper is
    refused by the config (it noises a round with the clip it has just moved by that
    round's noisy count)."""

    def __init__(self, cfg: RunConfig, num_clients: int) -> None:
        if cfg.adaptive_clip:
            raise ValueError("central-impl=flower runs Flower's fixed-clipping wrapper only")
        self.cfg = cfg
        self.num_clients = num_clients
        self.k = max(1, int(num_clients * cfg.fraction_train))
        self.sigma = central_noise_multiplier(cfg, num_clients) \
            if cfg.noise_multiplier <= 0 else cfg.noise_multiplier
        self.wrapper = DifferentialPrivacyServerSideFixedClipping(
            FedAvg(), self.sigma, cfg.clip_norm, self.k)
        self.count_std = None
        self.rng: random.Random = (random.Random(public_seed(cfg.seed, -1, 0))
                                   if cfg.reproducible else random.SystemRandom())
        self.global_arrays: ArrayRecord | None = None
        self.effective: dict[int, float] = {}      # round -> effective noise multiplier
        self.handed: dict[int, int] = {}           # round -> replies handed to the wrapper

    @property
    def clip(self) -> float:
        return float(self.wrapper.clipping_norm)

    def sample(self, nodes: Sequence[int]) -> list[int]:
        return sorted(self.rng.sample(list(nodes), min(self.k, len(nodes))))

    def round_config(self) -> dict[str, Any]:
        return {CLIP_KEY: 0.0}   # clients send raw updates: Flower clips on the server

    def aggregate(self, updates: torch.Tensor, within: Sequence[float],
                  server_round: int = 0) -> torch.Tensor:
        """Flower's wrapper on k replies carrying global + update (the accepted ones, then
        zero updates up to k); back to a mean update."""
        if self.global_arrays is None:
            raise RuntimeError("bind the round's global arrays first")
        if updates.shape[0] > self.k:
            raise ValueError(f"{updates.shape[0]} updates for a round of k = {self.k}")
        keys = list(self.global_arrays.keys())
        base = [self.global_arrays[k].numpy() for k in keys]
        flat_base = np.concatenate([b.reshape(-1) for b in base]).astype(np.float64)
        # an all-zero update contributes nothing and Flower's clip would divide by its
        # norm: it is sent as padding too
        rows = [row for row in updates.double().numpy() if np.any(row != 0.0)]
        padding = self.k - len(rows)
        pad = np.full(updates.shape[1], 0.5 * self.clip / math.sqrt(updates.shape[1]))
        rows += [pad] * padding
        replies = []
        for row in rows:
            arrays, offset = {}, 0
            for k, b in zip(keys, base):
                arrays[k] = Array(np.asarray(b + row[offset:offset + b.size].reshape(b.shape),
                                             dtype=b.dtype))
                offset += b.size
            msg = Message(RecordDict({"arrays": ArrayRecord(arrays),
                                      "metrics": MetricRecord({"num-examples": 1})}),
                          dst_node_id=0, message_type=MessageType.TRAIN)
            replies.append(msg)
        self.wrapper.current_arrays = self.global_arrays   # what configure_train would set
        aggregated, _ = self.wrapper.aggregate_train(server_round, replies)
        # the wrapper's noise on the sum of the handed replies is sigma C len / k
        self.handed[server_round] = len(replies)
        self.effective[server_round] = float(self.wrapper.noise_multiplier) * \
            self.k / len(replies)
        if aggregated is None:
            raise RuntimeError("Flower's wrapper released nothing for a full round")
        flat = np.concatenate([aggregated[k].numpy().reshape(-1) for k in keys])
        mean = flat.astype(np.float64) - flat_base - padding * pad / self.k
        return torch.from_numpy(mean).to(updates.dtype)

    def events(self, server_round: int) -> list[PrivacyEvent]:
        """The round's charge: a Gaussian at the multiplier the wrapper applied (the
        planned sigma before the round), replace-one, no sampling."""
        sigma = self.effective.get(server_round, float(self.wrapper.noise_multiplier))
        return [PrivacyEvent.gaussian(server_round, sigma, relation=FLOWER_RELATION)]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
