"""Model evaluation and device choice, shared by clients (local validation) and the
server (central test set)."""

from __future__ import annotations

import torch
from torch import nn


def device_for() -> torch.device:
    """GPU when available, never required."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@torch.no_grad()
def evaluate_model(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device,
                   batch_size: int = 1000) -> tuple[float, torch.Tensor]:
    """(mean cross-entropy loss, predicted labels) of ``model`` on (x, y)."""
    model.to(device).eval()
    losses, preds = [], []
    for i in range(0, len(y), batch_size):
        xb, yb = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
        out = model(xb)
        losses.append(nn.functional.cross_entropy(out, yb, reduction="sum").item())
        preds.append(out.argmax(1).cpu())
    return sum(losses) / max(len(y), 1), torch.cat(preds) if preds else torch.empty(0)
