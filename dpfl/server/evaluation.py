"""Central evaluation of the global model: accuracy, macro recall, macro F1, loss."""

from __future__ import annotations

import copy
import math

import torch

from dpfl.models.evaluation import evaluate_model


def macro_recall_f1(y: torch.Tensor, preds: torch.Tensor) -> tuple[float, float]:
    """Macro-averaged recall and F1 over the labels in ``y`` or ``preds`` (scikit-learn's
    ``average="macro", zero_division=0``): recall_c = TP / (TP + FN), 0 for a label never
    true; F1_c = 2 TP / (2 TP + FP + FN). Computed here, not with scikit-learn, whose import
    (with pandas, ~1.5 s of CPU) every ServerApp would pay for two numbers."""
    y, preds = y.long().flatten(), preds.long().flatten()
    labels = torch.unique(torch.cat([y, preds]))
    if labels.numel() == 0:
        return 0.0, 0.0
    true = y.unsqueeze(1) == labels      # (n, labels)
    said = preds.unsqueeze(1) == labels
    tp = (true & said).sum(0).double()
    fn = (true & ~said).sum(0).double()
    fp = (~true & said).sum(0).double()
    # counts are whole: clamping a zero denominator to 1 gives 0 / 1 = 0 (zero_division=0)
    recall = tp / (tp + fn).clamp(min=1)
    f1 = 2 * tp / (2 * tp + fp + fn).clamp(min=1)
    return float(recall.mean()), float(f1.mean())


# Central evaluation's batch size on a CPU, and image inputs in channels-last layout: the
# MNIST CNN's 10,000 test images took 1.41 s in batches of 1,000 (the default), 0.85 s in
# batches of 128 and 0.35 s in batches of 128 with channels-last weights and inputs (one
# thread, this 2-core machine); the same predictions, losses equal to ~1e-8. On CUDA the
# default batch stays.
CPU_BATCH = 128


def evaluation_copy(model: torch.nn.Module,
                    x: torch.Tensor) -> tuple[torch.nn.Module, torch.Tensor]:
    """The server's own copy of ``model`` and the test inputs ``x`` for central evaluation:
    channels-last for image (4-D) inputs. A copy, so that the model a method holds keeps its
    layout (flattening its parameters must not see strides it did not ask for)."""
    copy_ = copy.deepcopy(model)
    if x.dim() != 4:
        return copy_, x
    return (copy_.to(memory_format=torch.channels_last),
            x.contiguous(memory_format=torch.channels_last))


def classification_metrics(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                           device: torch.device) -> dict[str, float]:
    """Metrics of ``model`` on the central test set."""
    loss, preds = evaluate_model(model, x, y, device,
                                 **({"batch_size": CPU_BATCH} if device.type == "cpu" else {}))
    recall, f1 = macro_recall_f1(y, preds)
    return {
        "accuracy": float((preds == y).float().mean()),
        "macro-recall": recall,
        "macro-f1": f1,
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
