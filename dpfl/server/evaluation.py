"""Central evaluation of the global model: accuracy, macro recall, macro F1, loss."""

from __future__ import annotations

import torch
from sklearn.metrics import f1_score, recall_score

from dpfl.models.evaluation import evaluate_model


def classification_metrics(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                           device: torch.device) -> dict[str, float]:
    """Metrics of ``model`` on the central test set."""
    loss, preds = evaluate_model(model, x, y, device)
    y_np, p_np = y.numpy(), preds.numpy()
    return {
        "accuracy": float((preds == y).float().mean()),
        "macro-recall": float(recall_score(y_np, p_np, average="macro", zero_division=0)),
        "macro-f1": float(f1_score(y_np, p_np, average="macro", zero_division=0)),
        "loss": float(loss),
    }
