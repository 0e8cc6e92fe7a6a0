"""The ServerApp's macro recall and macro F1 (dpfl.server.evaluation.macro_recall_f1, plain
torch) equal scikit-learn's ``average="macro", zero_division=0`` — the independent
reference — on random predictions, on labels present only in the predictions or only in
the truth, and on a case worked by hand."""

import pytest
import torch
from sklearn.metrics import f1_score, recall_score

from dpfl.server.evaluation import macro_recall_f1


def _sklearn(y: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    return (recall_score(y.numpy(), p.numpy(), average="macro", zero_division=0),
            f1_score(y.numpy(), p.numpy(), average="macro", zero_division=0))


def test_by_hand():
    # labels {0, 1, 2}; 0: TP 1, FN 1; 1: TP 1; 2: FP 1 (predicted, never true)
    y = torch.tensor([0, 0, 1])
    p = torch.tensor([0, 2, 1])
    recall, f1 = macro_recall_f1(y, p)
    assert recall == pytest.approx((1 / 2 + 1 + 0) / 3)
    assert f1 == pytest.approx((2 / 3 + 1 + 0) / 3)


@pytest.mark.parametrize("seed", range(12))
def test_equals_scikit_learn(seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 300, (1,), generator=gen))
    classes = int(torch.randint(1, 12, (1,), generator=gen))
    y = torch.randint(0, classes, (n,), generator=gen)
    # some predictions right, some wrong, some outside the true labels
    p = torch.where(torch.rand(n, generator=gen) < 0.5, y,
                    torch.randint(0, classes + 2, (n,), generator=gen))
    ours = macro_recall_f1(y, p)
    assert ours == pytest.approx(_sklearn(y, p), abs=1e-12)


def test_perfect_and_disjoint():
    y = torch.tensor([3, 1, 4, 1, 5])
    assert macro_recall_f1(y, y.clone()) == (1.0, 1.0)
    assert macro_recall_f1(y, y + 10) == pytest.approx(_sklearn(y, y + 10)) == (0.0, 0.0)
