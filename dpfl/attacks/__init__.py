"""Membership-inference attacks on trained models (loss threshold, ML-Leaks, offline RMIA,
gradient norm; CS-MIA on the global models of successive rounds) and their evaluation (AUC, TPR at low FPR, log-log ROC plots)."""

from dpfl.attacks.csmia import confidence_series, csmia_attack, csmia_scores
from dpfl.attacks.metrics import (
    AttackResult,
    auc_score,
    best_threshold,
    plot_roc,
    roc_curve,
)
from dpfl.attacks.mia import (
    gradient_norm_attack,
    loss_threshold_attack,
    mlleaks_attack,
    rmia_attack,
    rmia_scores,
    run_attacks,
)
from dpfl.attacks.reference import (
    per_example_loss,
    softmax_outputs,
    train_reference_model,
)

__all__ = [
    "AttackResult", "auc_score", "best_threshold", "confidence_series", "csmia_attack",
    "csmia_scores", "gradient_norm_attack",
    "loss_threshold_attack", "mlleaks_attack", "per_example_loss", "plot_roc",
    "rmia_attack", "rmia_scores", "roc_curve", "run_attacks", "softmax_outputs",
    "train_reference_model",
]
