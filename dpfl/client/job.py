"""One client's round as plain values: what the server's instruction and the node give it.

A :class:`ClientJob` is what a trainer trains and a trust model releases: the run-config,
the instruction's config, the client (partition), its data, the received model and the
method's client half with its hooks. The ClientApp builds one per instruction; nothing in
a job names Flower's transport, so a node that trains several clients builds one per client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from dpfl.client.hooks import MethodHooks
from dpfl.config import RunConfig
from dpfl.data import ClientData
from dpfl.privacy.mechanisms.randomness import public_seed
from dpfl.privacy.plan import PlanFn, PlanInputs, ReleasePlan, shared_plan
from dpfl.tensors import flatten, state_difference, unflatten

# The private mean training loss of the round, always among the ``local`` values the client
# passes to a method's ``release_update`` (released only if the method releases it).
TRAIN_LOSS = "train-loss"


@dataclass
class ClientJob:
    """Client ``pid``'s round ``server_round``: ``model`` holds the received weights (copied
    to ``received`` when the job is made, before any hook sees the model) and is trained in
    place. ``half`` is the method's :class:`~dpfl.method.ClientHalf`, ``hooks`` its hooks
    for this round (set once the job exists); ``post_process`` its DP-SGD output transform
    (None: the method has none); ``plan_fn`` the method's release plan
    (:attr:`dpfl.method.Method.plan`, the function the server's guard plans with)."""

    cfg: RunConfig
    config: Mapping[str, Any]
    server_round: int
    pid: int
    nparts: int
    data: ClientData
    model: torch.nn.Module
    device: torch.device
    half: Any
    post_process: Callable[[torch.Tensor], torch.Tensor] | None = None
    hooks: MethodHooks = field(default_factory=MethodHooks)
    plan_fn: PlanFn = shared_plan
    received: dict[str, torch.Tensor] = field(init=False)
    _plan: ReleasePlan | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.received = {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @property
    def num_examples(self) -> int:
        """The client's training-set size (public, as in Opacus; canaries excluded)."""
        return len(self.data.y_train)

    @property
    def plan(self) -> ReleasePlan:
        """The method's plan of this client's release this round, from the public values the
        server plans it from (computed once)."""
        if self._plan is None:
            inputs = PlanInputs(self.server_round, self.config, self.pid, self.num_examples,
                                sum(int(p.numel()) for p in self.model.parameters()))
            self._plan = self.plan_fn(self.cfg, inputs)
        return self._plan

    @property
    def dim(self) -> int:
        return sum(int(v.numel()) for v in self.received.values())

    @property
    def shuffle_seed(self) -> int:
        """Local shuffling of training without per-sample DP: a public seed (not part of any
        mechanism)."""
        return public_seed(self.cfg.seed, self.pid, self.server_round)

    def base_metrics(self) -> dict[str, Any]:
        return {"partition-id": self.pid, "server-round": self.server_round,
                "delta": self.cfg.delta}

    def update(self) -> dict[str, torch.Tensor]:
        """trained - received, per tensor."""
        return state_difference(self.model.state_dict(), self.received)

    def flat_update(self) -> torch.Tensor:
        return flatten(self.update())

    def as_state(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """A flat update in the model's tensors."""
        return unflatten(flat, self.received)
