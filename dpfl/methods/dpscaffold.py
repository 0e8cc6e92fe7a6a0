"""``dpscaffold``: DP-SCAFFOLD (Noble, Bellet & Dieuleveut, "Differentially Private Federated
Learning on Heterogeneous Data", AISTATS 2022): SCAFFOLD (Karimireddy, Kale, Mohri, Reddi,
Stich & Suresh, "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML
2020) with DP-SGD clients.

Client i keeps a control variate c_i (in its node state), the server keeps c and sends it
with the global model. Each local DP-SGD step is corrected by -lr (c - c_i) (data-
independent); after K steps the client sets c_i+ = c_i - c + (x - y_i)/(K lr) (option II)
and replies with the update y_i - x and Delta c_i = c_i+ - c_i. The server sets
x <- x + eta_g mean_i(y_i - x) and c <- c + (|S|/N) mean_i Delta c_i.

DP treatment, as in DP-SCAFFOLD: c_i+ is computed from x, c, c_i and y_i only, and y_i is
the output of DP-SGD, so the control variates are post-processing of the DP outputs and
cost no extra privacy; the guarantee is the clients' DP-SGD guarantee (sample-level).
This is why ``dpscaffold`` requires ``trainer=dpsgd``: with update-level DP, y_i would be
the raw local model and c_i+ would leak it.

Robustness (CHOICE; SCAFFOLD trusts Delta c_i): Delta c_i enters c, which every client
then adds to each local step and which widens the server's update norm bound
(2 B + lr T ||c||), so one huge Delta c_i would blow up the next round's model. Since the
corrections cancel in option II, c_i+ = -(the K DP steps' displacement) / (K lr), whose
norm is at most B_p / (K_p lr), DP-SGD's per-step bound (the guard's bound B_p on a
partition's update over its K_p planned steps); c_i is such a value of an earlier round.
A reply whose ||Delta c_i|| exceeds 2 max_p B_p / (K_p lr) (exceeded by an honest one
with negligible probability, as B_p is) is rejected with its reason.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn

from dpfl.client.hooks import MethodHooks
from dpfl.client.trainers import PostStep, TrainResult
from dpfl.config import RunConfig
from dpfl.method import ClientHalf, Method
from dpfl.privacy.plan import PlanFn, dpsgd_norm_bound, shared_plan
from dpfl.server.strategy import DPFLStrategy, StrategyInputs
from dpfl.server.validation import ClientUpdate, Template
from dpfl.tensors import unflatten

CLIENT_CONTROL_STATE = "dpfl.scaffold.client-control"   # c_i in the node's context.state


def _named_params(model: nn.Module) -> "OrderedDict[str, torch.Tensor]":
    return OrderedDict((n, p.detach().clone()) for n, p in model.named_parameters())


def scaffold_control_update(client_control: "OrderedDict[str, torch.Tensor]",
                            server_control: "OrderedDict[str, torch.Tensor]",
                            start: "OrderedDict[str, torch.Tensor]",
                            end: "OrderedDict[str, torch.Tensor]", steps: int, lr: float
                            ) -> "OrderedDict[str, torch.Tensor]":
    """SCAFFOLD option II (Karimireddy et al. 2020, eq. 4):
    c_i+ = c_i - c + (x - y_i) / (K lr)."""
    k = max(steps, 1)
    return OrderedDict((n, client_control[n] - server_control[n] + (start[n] - end[n]) / (k * lr))
                       for n in client_control)


def scaffold_step(server_control: list[torch.Tensor], client_control: list[torch.Tensor]
                  ) -> PostStep:
    """SCAFFOLD (Karimireddy et al. 2020, Alg. 1 line 10): y <- y - lr (g - c_i + c);
    after the (DP) step on g, this adds the correction -lr (c - c_i)."""
    @torch.no_grad()
    def step(model: nn.Module, lr: float) -> None:
        for p, c, ci in zip(model.parameters(), server_control, client_control):
            p.sub_(lr * (c - ci))
    return step


class ScaffoldClient(ClientHalf):
    """Corrects each local step by -lr (c - c_i); replies with Delta c_i."""

    def hooks(self, cfg, msg, context, model) -> MethodHooks:
        start = _named_params(model)
        zeros = OrderedDict((n, torch.zeros_like(p)) for n, p in start.items())
        server = (OrderedDict((n, torch.as_tensor(t)) for n, t in
                              msg.content["control"].to_torch_state_dict().items())
                  if "control" in msg.content.array_records else zeros)
        client = (OrderedDict(context.state[CLIENT_CONTROL_STATE].to_torch_state_dict())
                  if CLIENT_CONTROL_STATE in context.state.array_records else zeros)

        def finish(trained: nn.Module, result: TrainResult) -> dict[str, ArrayRecord]:
            new = scaffold_control_update(client, server, start, _named_params(trained),
                                          result.steps, cfg.lr)
            context.state[CLIENT_CONTROL_STATE] = ArrayRecord(new)
            delta = OrderedDict((n, new[n] - client[n]) for n in new)
            return {"control-delta": ArrayRecord(delta)}

        return MethodHooks(post_step=scaffold_step(list(server.values()), list(client.values())),
                           finish=finish)


def scaffold_server_control(control: torch.Tensor, deltas: torch.Tensor, num_clients: int
                            ) -> torch.Tensor:
    """c + (|S| / N) mean_i Delta c_i (SCAFFOLD Alg. 1, line 17)."""
    s = deltas.shape[0]
    return control + (s / max(num_clients, s)) * deltas.mean(0)


class DPScaffoldStrategy(DPFLStrategy):
    """Uniform mean of updates, server control variate maintained from Delta c_i."""

    def __init__(self, cfg: RunConfig, adaptive: bool = False,
                 plan: PlanFn = shared_plan, inputs: StrategyInputs | None = None) -> None:
        super().__init__(cfg, adaptive, plan, inputs)
        # the server control variate c, shaped as the model's parameters (none without one)
        model = inputs.model if inputs is not None else None
        self._control_template = OrderedDict(
            (n, p.detach().float()) for n, p in model.named_parameters()
        ) if model is not None else OrderedDict()
        self.control = torch.zeros(sum(p.numel() for p in self._control_template.values()))

    def extra_records(self, server_round: int) -> dict[str, ArrayRecord]:
        return {"control": ArrayRecord(unflatten(self.control, self._control_template))}

    def extra_reply_arrays(self) -> dict[str, Template]:
        return {"control-delta": [(n, tuple(t.shape), np.dtype("float32"))
                                  for n, t in self._control_template.items()]}

    def update_norm_bound(self, dim: int, server_round: int) -> float | None:
        """DP-SGD's bound plus the drift of the corrections -lr (c - c_i): over T steps at
        most lr T (||c|| + ||c_i||), where c_i (option II) is the mean of the client's last
        DP steps, so lr T ||c_i|| is within DP-SGD's bound B again: 2 B + lr T ||c||."""
        if self.cfg.trainer != "dpsgd" or not self.partition_sizes:
            return None
        steps = max(int(self.planned_event(p, server_round).steps)
                    for p in self.partition_sizes)
        return (2.0 * self.guard.dpsgd_bound(dim, server_round)
                + self.cfg.lr * steps * float(self.control.norm()))

    def aggregation_weights(self, accepted: list[ClientUpdate]) -> torch.Tensor:
        """Uniform mean (SCAFFOLD's server step)."""
        return torch.ones(len(accepted))

    _delta_bound: tuple[int, float | None] | None = None   # (round, bound), once a round

    def control_delta_bound(self, server_round: int) -> float | None:
        """The largest ||Delta c_i|| an honest client sends (module docstring):
        2 max_p B_p / (K_p lr), B_p DP-SGD's bound on partition p's update over its K_p
        planned steps; None before the partition sizes are bound."""
        if not self.partition_sizes:
            return None
        dim = int(self.control.numel())
        per_step = []
        for pid, n in self.partition_sizes.items():
            event = self.planned_event(pid, server_round)
            steps = max(int(event.steps), 1)
            per_step.append(dpsgd_norm_bound(self.cfg, n, event.sigma, steps, dim)
                            / (self.cfg.lr * steps))
        return 2.0 * max(per_step) * (1.0 + 1e-6)

    def reply_problem(self, update: ClientUpdate) -> str | None:
        """Delta c_i within :meth:`control_delta_bound` (it moves c, and c every client's
        steps and the next round's norm bound)."""
        delta = update.extras.get("control-delta")
        server_round = self.round.server_round
        if self._delta_bound is None or self._delta_bound[0] != server_round:
            self._delta_bound = (server_round, self.control_delta_bound(server_round))
        bound = self._delta_bound[1]
        if delta is None or bound is None:
            return None
        norm = float(torch.linalg.vector_norm(delta))
        if norm > bound:
            return (f"control-delta norm {norm:.4g} exceeds {bound:.4g}, twice DP-SGD's "
                    "per-step bound (an honest Delta c_i is a difference of two mean DP "
                    "steps)")
        return None

    # what the last aggregation did to c, reported by round_metrics
    last_control_step = 0.0
    last_delta_norm = 0.0
    last_participation = 0.0

    def after_aggregation(self, accepted: list[ClientUpdate]) -> None:
        self.last_control_step = self.last_delta_norm = self.last_participation = 0.0
        if accepted:
            deltas = torch.stack([u.extras["control-delta"] for u in accepted])
            previous = self.control
            self.control = scaffold_server_control(self.control, deltas, self.num_nodes)
            self.last_control_step = float((self.control - previous).norm())
            self.last_delta_norm = float(deltas.mean(0).norm())
            self.last_participation = len(accepted) / max(self.num_nodes, len(accepted))

    def round_metrics(self, record) -> dict[str, float]:
        """The server control variate after the round: ``scaffold-control-norm`` = ||c||,
        ``scaffold-control-step-norm`` = ||c_new - c_old||, ``scaffold-delta-norm`` =
        ||mean_i Delta c_i|| and ``scaffold-participation`` = |S| / N (so step = |S|/N x
        delta norm)."""
        return {**super().round_metrics(record),
                "scaffold-control-norm": float(self.control.norm()),
                "scaffold-control-step-norm": self.last_control_step,
                "scaffold-delta-norm": self.last_delta_norm,
                "scaffold-participation": self.last_participation}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "control": self.control.clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "control" in state:
            self.control = state["control"]


METHOD = Method(
    name="dpscaffold",
    citation="Noble, Bellet & Dieuleveut, Differentially Private Federated Learning on "
             "Heterogeneous Data, AISTATS 2022",
    strategy=DPScaffoldStrategy,
    client=ScaffoldClient(),
    trainers=("dpsgd",),
    trainer_reason="its control variates are post-processing of DP-SGD outputs only",
)
