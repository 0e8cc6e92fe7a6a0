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

    def after_aggregation(self, accepted: list[ClientUpdate]) -> None:
        if accepted:
            deltas = torch.stack([u.extras["control-delta"] for u in accepted])
            self.control = scaffold_server_control(self.control, deltas, self.num_nodes)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "control": self.control.clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "control" in state:
            self.control = state["control"]
