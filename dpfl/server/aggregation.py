"""Server math as plain functions on tensors (one row per client)."""

from __future__ import annotations

import torch


def weighted_mean(updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_i w_i u_i / sum_i w_i for an M x d matrix of updates (FedAvg, McMahan et al. 2017)."""
    if updates.ndim != 2 or weights.shape != (updates.shape[0],):
        raise ValueError("updates must be M x d and weights length M")
    w = weights.to(updates.dtype)
    total = float(w.sum())
    if total <= 0:
        raise ValueError("weights must sum to a positive value")
    return (w / total) @ updates


def server_sgd_step(global_flat: torch.Tensor, aggregated_update: torch.Tensor,
                    server_lr: float) -> torch.Tensor:
    """w <- w + eta * Delta (the update is trained - received, so + descends)."""
    return global_flat + server_lr * aggregated_update
