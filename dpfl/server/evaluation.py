"""Central evaluation of the global model: accuracy, macro recall, macro F1, loss."""

from __future__ import annotations

import math

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


# The global model's loss is said to explode past this multiple of the initial model's (at
# least of 1.0): an untrained 10-class model scores ln 10 = 2.3, a learning one less; a loss
# ten times higher only comes from updates that diverged or noise that swamps them.
EXPLOSION_FACTOR = 10.0


def divergence(initial_loss: float | None, loss: float | None,
               rejection_reasons: list[str], lr: float) -> str | None:
    """One line saying the run is diverging, or None: the global model's loss is
    non-finite or over :data:`EXPLOSION_FACTOR` times the initial model's, or every update
    the server rejected this round (at least one) had non-finite values."""
    hint = (f"lower lr (now {lr:g}; plain SGD needs about 0.1, the default 2.0 suits DP-SGD's "
            "clipped and noised gradients) or, with DP noise, raise target-epsilon")
    if rejection_reasons and all("non-finite" in r for r in rejection_reasons):
        return (f"every rejected update ({len(rejection_reasons)}) has non-finite values: "
                f"local training diverged; {hint}")
    if loss is None:
        return None
    if not math.isfinite(loss):
        return f"the global model's loss is {loss}: the training diverged; {hint}"
    initial = initial_loss if initial_loss is not None and math.isfinite(initial_loss) else None
    if loss > EXPLOSION_FACTOR * max(initial or 1.0, 1.0):
        before = f"the initial model's: {initial:.4g}" if initial is not None else "no initial"
        return (f"the global model's loss exploded to {loss:.4g} ({before}): the updates "
                f"diverge or the noise swamps them; {hint}")
    return None
