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
    """(mean cross-entropy loss, predicted labels) of ``model`` on (x, y), without autograd
    (``torch.inference_mode``: no graph is kept for the backward pass evaluation never
    takes)."""
    model.to(device).eval()
    losses, preds = [], []
    with torch.inference_mode():
        for i in range(0, len(y), batch_size):
            xb, yb = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
            out = model(xb)
            losses.append(nn.functional.cross_entropy(out, yb, reduction="sum").item())
            preds.append(out.argmax(1).cpu())
    return sum(losses) / max(len(y), 1), torch.cat(preds) if preds else torch.empty(0)


def macro_f1(preds: torch.Tensor, labels: torch.Tensor, num_classes: int) -> float:
    """Macro-averaged F1 over the classes present in ``labels`` or ``preds`` (a class
    neither predicted nor present is skipped; F1 = 0 when its precision and recall are 0),
    as scikit-learn's ``f1_score(average="macro", zero_division=0)`` on those labels."""
    preds, labels = preds.long().cpu(), labels.long().cpu()
    idx = labels * num_classes + preds
    confusion = torch.bincount(idx, minlength=num_classes * num_classes).view(
        num_classes, num_classes).double()
    tp = confusion.diagonal()
    support, predicted = confusion.sum(1), confusion.sum(0)
    present = (support + predicted) > 0
    if not bool(present.any()):
        return 0.0
    denom = support + predicted
    f1 = torch.where(denom > 0, 2 * tp / denom.clamp(min=1), torch.zeros_like(tp))
    return float(f1[present].mean())
