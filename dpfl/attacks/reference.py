"""Shadow / reference models trained "like the target" (plain SGD, no DP), and the
model outputs the attacks read: softmax posteriors and per-example losses."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


def train_reference_model(make_model: Callable[[], nn.Module], x: torch.Tensor,
                          y: torch.Tensor, *, epochs: int, lr: float, batch_size: int,
                          seed: int, momentum: float = 0.0) -> nn.Module:
    """A model from ``make_model()`` trained on (x, y) with minibatch SGD on the mean
    cross-entropy, on the CPU; returned in eval mode.

    Everything random (the model's initialisation when ``make_model`` draws one, dropout,
    the per-epoch shuffling) comes from ``seed``; the global torch RNG is left as it was.
    """
    if len(x) != len(y):
        raise ValueError(f"{len(x)} inputs but {len(y)} labels")
    x, y = x.detach().cpu(), y.detach().cpu().long()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make_model().cpu()
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        model.train()
        for _ in range(epochs):
            order = torch.randperm(len(y), generator=gen)
            for i in range(0, len(y), batch_size):
                idx = order[i:i + batch_size]
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
    return model.eval()


def _logits(model: nn.Module, x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The model's outputs on x in eval mode, without gradients, as float64."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = [model(x[i:i + batch_size]).to(torch.float64)
                   for i in range(0, len(x), batch_size)]
    finally:
        model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, 0, dtype=torch.float64)


def softmax_outputs(model: nn.Module, x: torch.Tensor, batch_size: int = 1000
                    ) -> torch.Tensor:
    """Softmax posteriors (float64, shape [n, classes]) of ``model`` on ``x``."""
    # a model whose weights blew up (NaN / inf logits) tells nothing: probability 0
    return torch.nan_to_num(torch.softmax(_logits(model, x, batch_size), dim=1), nan=0.0)


def per_example_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                     batch_size: int = 1000) -> torch.Tensor:
    """Cross-entropy loss of each example (float64, shape [n])."""
    loss = F.cross_entropy(_logits(model, x, batch_size), y.long(), reduction="none")
    return torch.nan_to_num(loss, nan=math.inf)   # unknown loss: the least member-like


def true_label_probability(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                           batch_size: int = 1000) -> torch.Tensor:
    """Softmax probability of each example's label (float64, shape [n])."""
    return softmax_outputs(model, x, batch_size).gather(1, y.long().view(-1, 1)).view(-1)
