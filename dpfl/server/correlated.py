"""The trusted server of ``trust=central`` with correlated noise across rounds
(``central-noise=tree|banded-mf``): no sampling claimed, a participation schema enforced.

Kairouz, McMahan, Song, Thakkar, Thakurta & Xu, "Practical and Private (Deep) Learning
without Sampling or Shuffling", ICML 2021 (DP-FTRL, tree aggregation), and Choquette-Choo,
McMahan, Rush & Thakurta, ICML 2023 / Choquette-Choo et al., NeurIPS 2023 (banded matrix
factorization). Each round the server

- draws a cohort of fixed size m = round(fraction-train x N) among the connected clients the
  schema (:class:`dpfl.privacy.accounting.participation.ParticipationSchema`: at most k
  participations, any two >= b rounds apart) still allows — "availability", not Poisson:
  nothing is claimed about how the cohort was drawn;
- refuses (never aggregates) an update of a client outside the schema (a node it could not
  identify before selecting it, or a second node claiming the same client);
- releases the model delta (sum_i clip_C(Delta_i) + sigma C y_t) / m, where y_t is the
  streaming noise increment of the factorization (:class:`dpfl.privacy.mechanisms.tree_aggregation.
  TreeNoise`, :class:`dpfl.privacy.mechanisms.banded_mf.BandedNoise`): the sum of the deltas up to
  round t carries the prefix noise (B z)_t, so with a linear server step (SGD) the model is
  theta_0 + lr (prefix sum of clipped sums + sigma C (B z)_t) / m — DP-FTRL;
- charges each client that took part one Gaussian event per participation (or, for a tree
  whose proportional charge is no bound, the whole run's at its first one:
  :mod:`dpfl.privacy.correlated_charging`), and nobody else.

The noise stream (generator state, the tree's pending nodes or the banded generator's last
b - 1 increments) and every client's participations are checkpointed, so a resume continues
the same stream and the same schema.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import torch

from dpfl.config import RunConfig
from dpfl.logs import get_logger
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.accounting.ledger import client_key
from dpfl.privacy.correlated_charging import TREE_ESTIMATOR, correlated_charge
from dpfl.privacy.mechanisms.banded_mf import BandedNoise
from dpfl.privacy.mechanisms.release import l2_clip
from dpfl.privacy.mechanisms.tree_aggregation import TreeNoise
from dpfl.server.central import CLIP_KEY, central_randomness
from dpfl.server.nodes import NodeRegistry

log = get_logger("flwr.dpfl.correlated")


def cohort_size(cfg: RunConfig, num_clients: int) -> int:
    """m = round(fraction-train x N), at least 1: the fixed cohort and denominator."""
    return max(1, int(round(cfg.fraction_train * num_clients)))


class CorrelatedAggregator:
    """The correlated-noise mechanism's state: sigma, C, the noise stream, the schema's
    record of who took part when (see the module docstring)."""

    def __init__(self, cfg: RunConfig, num_clients: int) -> None:
        self.cfg = cfg
        self.num_clients = num_clients
        self.charge = correlated_charge(cfg)
        self.schema = self.charge.schema
        self.sigma = self.charge.noise_std          # std of z in units of C
        self.denominator = float(cohort_size(cfg, num_clients))
        self.count_std = None
        self.tracker = None
        self.participations: dict[str, list[int]] = {}
        self.rng, self.generator = central_randomness(cfg)
        self.noise: TreeNoise | BandedNoise | None = None    # built on the first release
        self._pending_state: dict[str, Any] | None = None
        m, b, k, n = int(self.denominator), cfg.min_separation, cfg.max_participations, \
            cfg.num_rounds
        if m * min(b, n) > num_clients or m * n > num_clients * k:
            log.warning("a cohort of %d clients cannot be filled every round under the schema "
                        "(%d clients, k = %d, b = %d, %d rounds): some rounds will have fewer "
                        "(the denominator stays %d)", m, num_clients, k, b, n, m)

    @property
    def clip(self) -> float:
        return self.cfg.clip_norm

    # -- the schema --------------------------------------------------------------------
    def refusal(self, client: str, server_round: int) -> str | None:
        """Why ``client`` may not take part in ``server_round`` (None: it may)."""
        return self.schema.check(self.participations.get(client, []), server_round)

    def select(self, server_round: int, nodes: Sequence[int],
               registry: NodeRegistry) -> list[int]:
        """A cohort of m nodes drawn uniformly among the connected ones whose client the
        schema allows in this round (a node not yet identified counts as a client with no
        participation; its update is refused at aggregation if it is not one). Nodes of
        the same known client count once."""
        allowed, seen = [], set()
        for node in sorted(nodes):
            pinned = registry.pinned(node)
            client = client_key(pinned) if pinned is not None else registry.client_of(node)
            if client is not None:
                if client in seen or self.refusal(client, server_round) is not None:
                    continue
                seen.add(client)
            allowed.append(node)
        m = int(self.denominator)
        if len(allowed) < m:
            log.info("round %d: %d of the connected clients are allowed by the schema, fewer "
                     "than the cohort of %d", server_round, len(allowed), m)
        return sorted(self.rng.sample(allowed, min(m, len(allowed))))

    def admit(self, partition_ids: Sequence[int], server_round: int
              ) -> tuple[list[int], dict[int, str]]:
        """Which of a round's accepted updates (by partition, in order) enter the sum, and
        why each other one is refused (its position -> reason). Records participations."""
        taken: list[int] = []
        refused: dict[int, str] = {}
        in_round: set[str] = set()
        for i, pid in enumerate(partition_ids):
            client = client_key(pid)
            why = ("another node already took part as this client in this round"
                   if client in in_round else self.refusal(client, server_round))
            if why is not None:
                refused[i] = f"outside the participation schema: {why}"
                continue
            in_round.add(client)
            taken.append(i)
        for client in in_round:
            self.participations.setdefault(client, []).append(server_round)
        return taken, refused

    # -- the release -------------------------------------------------------------------
    def round_config(self) -> dict[str, Any]:
        return {CLIP_KEY: self.clip}

    def _stream(self, dim: int) -> TreeNoise | BandedNoise:
        if self.noise is None:
            if self.charge.mode == "tree":
                self.noise = TreeNoise((dim,), 1.0, TREE_ESTIMATOR, self.charge.restart_every,
                                       generator=self.generator, dtype=torch.float64)
            else:
                self.noise = BandedNoise(self.charge.coefficients, (dim,), 1.0,
                                         generator=self.generator, dtype=torch.float64)
            if self._pending_state is not None:
                self.noise.load_state_dict(self._pending_state)
                self._pending_state = None
        return self.noise

    def release(self, server_round: int, updates: torch.Tensor) -> torch.Tensor:
        """(sum_i clip_C(u_i) + sigma C y_t) / m for an M x d matrix (M may be 0)."""
        dim = updates.shape[1]
        stream = self._stream(dim)
        expected = server_round - self.schema.first_round
        if stream.round != expected:
            raise RuntimeError(f"round {server_round} asks for the noise of round index "
                               f"{expected}, the stream is at {stream.round} (a resume "
                               "without its checkpoint?)")
        total = torch.zeros(dim, dtype=torch.float64)
        for row in updates:
            total += l2_clip(row.double(), self.clip)
        total += self.sigma * self.clip * stream.next().increment
        return (total / self.denominator).to(updates.dtype)

    def events(self, server_round: int) -> list[PrivacyEvent]:
        """What a client's first participation, in ``server_round``, costs it."""
        return self.charge.charges(server_round, 0)

    def participation_charges(self, server_round: int, partition_ids: Sequence[int]
                              ) -> list[tuple[list[PrivacyEvent], list[int]]]:
        """The charges of the clients admitted in ``server_round`` (after :meth:`admit`),
        grouped by their events: [(events, partition ids)], empty events left out."""
        groups: dict[int, tuple[list[PrivacyEvent], list[int]]] = {}
        for pid in partition_ids:
            rounds = self.participations.get(client_key(pid), [])
            prior = sum(1 for r in rounds if r < server_round)
            events = self.charge.charges(server_round, prior)
            if events:
                groups.setdefault(prior if self.charge.first_only else 0,
                                  (events, []))[1].append(pid)
        return list(groups.values())

    # -- persistence -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"central-participations": {
            c: list(r) for c, r in self.participations.items()}}
        if self.noise is not None:
            state["central-noise-stream"] = self.noise.state_dict()
        elif self._pending_state is not None:
            state["central-noise-stream"] = self._pending_state
        else:
            state["central-noise-generator"] = self.generator.get_state()
        if isinstance(self.rng, random.Random) and not isinstance(self.rng, random.SystemRandom):
            state["central-rng"] = self.rng.getstate()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.participations = {str(c): [int(r) for r in rounds] for c, rounds in
                               state.get("central-participations", {}).items()}
        if "central-noise-stream" in state:
            self.noise = None
            self._pending_state = state["central-noise-stream"]
        elif "central-noise-generator" in state:
            self.generator.set_state(state["central-noise-generator"])
        if "central-rng" in state and not isinstance(self.rng, random.SystemRandom):
            self.rng.setstate(state["central-rng"])
