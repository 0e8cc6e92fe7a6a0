"""``dpscaffold``: DP-SCAFFOLD (Noble, Bellet & Dieuleveut, AISTATS 2022): SCAFFOLD
(Karimireddy et al. 2020) with DP-SGD clients.

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
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from flwr.app import ArrayRecord

from dpfl.strategies.dpfedavg import DPFedAvgStrategy
from dpfl.strategies.validation import ClientUpdate, Template
from dpfl.tensors import unflatten


def scaffold_server_control(control: torch.Tensor, deltas: torch.Tensor, num_clients: int
                            ) -> torch.Tensor:
    """c + (|S| / N) mean_i Delta c_i (SCAFFOLD Alg. 1, line 17)."""
    s = deltas.shape[0]
    return control + (s / max(num_clients, s)) * deltas.mean(0)


class DPScaffoldStrategy(DPFedAvgStrategy):
    """Uniform mean of updates, server control variate maintained from Delta c_i."""

    name = "dpscaffold"

    def bind_model(self, model: torch.nn.Module) -> None:
        super().bind_model(model)
        self._control_template = OrderedDict((n, p.detach().float()) for n, p in model.named_parameters())
        self.control = torch.zeros(sum(p.numel() for p in self._control_template.values()))

    def extra_records(self, server_round: int) -> dict[str, ArrayRecord]:
        return {"control": ArrayRecord(unflatten(self.control, self._control_template))}

    def extra_reply_arrays(self) -> dict[str, Template]:
        return {"control-delta": [(n, tuple(t.shape), np.dtype("float32"))
                                  for n, t in self._control_template.items()]}

    def aggregation_weights(self, accepted: list[ClientUpdate]) -> torch.Tensor:
        return torch.ones(len(accepted))

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
