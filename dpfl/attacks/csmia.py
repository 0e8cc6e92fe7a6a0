"""CS-MIA: membership inference from a record's prediction-confidence series across the
global models of successive rounds (Gu, Bai & Xu, "CS-MIA: Membership inference attack
based on prediction confidence series in federated learning", Journal of Information
Security and Applications 67, 103201, 2022; as DP-FedASGP's paper describes it: Zhang, Mao,
He, Huang & Wu, "Balancing Privacy and Accuracy Using Significant Gradient Protection in
Federated Learning", IEEE Transactions on Computers, 2024, Sec. V-A "Attack models").

DP-FedASGP's description: the adversary divides its data into D_train and D_test and puts
D_train into the federation; it computes the confidence series of the models on D_train
(members) and D_test (non-members), trains an attack model on these labelled series, and
for a target record feeds the target's confidence series to the attack model.

Readings (CHOICE where the description is silent):

- The "confidence" of a record under a model is the softmax probability of its true label
  (CHOICE: the description says "prediction confidence"; the true label's probability is
  what rises for members as training fits them).
- The series is one confidence per recorded round, r = 1 .. T, in round order (every round
  kept by ``record-global-models``).
- The labelled series come from the same federation's global models: the adversary is a
  participant (D_train = its own client's records, which it knows are in the federation)
  and D_test are records of its own that no client held (CHOICE: this is "incorporate
  D_train into FL" literally; a separate shadow federation would cost a whole second run).
- The attack model is a one-hidden-layer MLP (64 units) on the standardised series, as the
  ML-Leaks attack here (CHOICE: the description names no architecture); score = its member
  probability; threshold 0.5.
"""

from __future__ import annotations

import warnings
from typing import Iterable

import numpy as np
import torch
from torch import nn

from dpfl.attacks.metrics import AttackResult
from dpfl.attacks.reference import true_label_probability

Records = tuple[torch.Tensor, torch.Tensor]
_CSMIA = 5   # random stream of the attack model's initialisation (beside mia.py's 1..4)


def confidence_series(models: Iterable[nn.Module], x: torch.Tensor, y: torch.Tensor
                      ) -> torch.Tensor:
    """[n, T] float64: column r is the softmax probability of each record's label under
    the r-th model (models are consumed one at a time: a run's rounds need not all be in
    memory)."""
    columns = [true_label_probability(model, x, y) for model in models]
    if not columns:
        raise ValueError("CS-MIA needs at least one model (no recorded global model)")
    return torch.stack(columns, dim=1)


def csmia_scores(train_series: torch.Tensor, train_labels: torch.Tensor,
                 target_series: torch.Tensor, *, seed: int) -> torch.Tensor:
    """The attack model's member probability of each target series (float64).

    ``train_series`` [m, T] with ``train_labels`` [m] (True = member) train an MLP (64
    hidden units, inputs standardised, seeded); ``target_series`` [n, T] is scored."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    train = torch.as_tensor(train_series, dtype=torch.float64)
    target = torch.as_tensor(target_series, dtype=torch.float64)
    labels = torch.as_tensor(train_labels).to(torch.bool).numpy().astype(int)
    if train.ndim != 2 or target.ndim != 2 or train.shape[1] != target.shape[1]:
        raise ValueError(f"series of different lengths: {tuple(train.shape)} to train, "
                         f"{tuple(target.shape)} to score")
    if len(labels) != len(train) or labels.min() == labels.max():
        raise ValueError("the attack model needs labelled members and non-members")
    clf = make_pipeline(StandardScaler(), MLPClassifier(
        hidden_layer_sizes=(64,), max_iter=1000,
        random_state=int(np.random.default_rng([_CSMIA, seed]).integers(2**31 - 1))))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(train.numpy(), labels)
    member_col = list(clf.classes_).index(1)
    return torch.from_numpy(clf.predict_proba(target.numpy())[:, member_col])


def csmia_attack(models: Iterable[nn.Module], members: Records, nonmembers: Records,
                 known_members: Records, known_nonmembers: Records, *,
                 seed: int) -> AttackResult:
    """CS-MIA on the target's ``members`` vs ``nonmembers`` (equal numbers), the attack
    model trained on the adversary's ``known_members`` (its records in the federation) and
    ``known_nonmembers`` (its records outside it), all scored under the same ``models``
    (the global model of each round, in round order)."""
    (x_in, y_in), (x_out, y_out) = members, nonmembers
    if len(y_in) != len(y_out) or len(y_in) == 0:
        raise ValueError(f"{len(y_in)} members but {len(y_out)} non-members: the attacks "
                         "need equal numbers")
    x = torch.cat([x_in, x_out, known_members[0], known_nonmembers[0]])
    y = torch.cat([y_in, y_out, known_members[1], known_nonmembers[1]]).long()
    series = confidence_series(models, x, y)     # one pass over the models for all records
    n, k_in = 2 * len(y_in), len(known_members[1])
    train_labels = torch.cat([torch.ones(k_in, dtype=torch.bool),
                              torch.zeros(len(known_nonmembers[1]), dtype=torch.bool)])
    scores = csmia_scores(series[n:], train_labels, series[:n], seed=seed)
    labels = torch.cat([torch.ones(len(y_in), dtype=torch.bool),
                        torch.zeros(len(y_out), dtype=torch.bool)])
    return AttackResult("cs-mia", scores, labels, 0.5)
