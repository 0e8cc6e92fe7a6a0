"""Client-side parts of server methods: what a method adds to local training and to the
reply. Everything here uses only public or already-released values (the global model,
control variates built from DP outputs), so it is post-processing of the DP mechanism."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch
from flwr.app import ArrayRecord, Context, Message

from dpfl.client.trainers import PostStep, TrainResult, proximal_step, scaffold_step
from dpfl.config import RunConfig

SCAFFOLD_STATE = "dpfl.scaffold.client-control"


@dataclass
class MethodHooks:
    """A post-step correction for local training and extra reply records."""

    post_step: PostStep | None = None
    finish: Callable[[torch.nn.Module, TrainResult], dict[str, ArrayRecord]] = field(
        default=lambda model, result: {})


def _named_params(model: torch.nn.Module) -> "OrderedDict[str, torch.Tensor]":
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


def hooks_for(cfg: RunConfig, msg: Message, context: Context,
              model: torch.nn.Module) -> MethodHooks:
    """The method hooks of ``cfg.strategy`` for this round."""
    if cfg.strategy == "dpfedprox" and cfg.prox_mu > 0:
        global_params = [p.detach().clone() for p in model.parameters()]
        return MethodHooks(post_step=proximal_step(global_params, cfg.prox_mu))
    if cfg.strategy == "dpscaffold":
        start = _named_params(model)
        zeros = OrderedDict((n, torch.zeros_like(p)) for n, p in start.items())
        server = (OrderedDict((n, torch.as_tensor(t)) for n, t in
                              msg.content["control"].to_torch_state_dict().items())
                  if "control" in msg.content.array_records else zeros)
        client = (OrderedDict(context.state[SCAFFOLD_STATE].to_torch_state_dict())
                  if SCAFFOLD_STATE in context.state.array_records else zeros)

        def finish(trained: torch.nn.Module, result: TrainResult) -> dict[str, ArrayRecord]:
            new = scaffold_control_update(client, server, start, _named_params(trained),
                                          result.steps, cfg.lr)
            context.state[SCAFFOLD_STATE] = ArrayRecord(new)
            delta = OrderedDict((n, new[n] - client[n]) for n in new)
            return {"control-delta": ArrayRecord(delta)}

        return MethodHooks(post_step=scaffold_step(list(server.values()), list(client.values())),
                           finish=finish)
    return MethodHooks()
