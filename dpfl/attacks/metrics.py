"""Membership-inference evaluation: AUC (Mann-Whitney), the empirical ROC, TPR at a low
FPR (Carlini et al., "Membership Inference Attacks From First Principles", IEEE S&P 2022,
argue this is the number that matters), accuracy, and a log-log ROC plot.

Convention everywhere: a record is predicted "member" when its score is >= the threshold.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


def _as_numpy(scores, labels) -> tuple[np.ndarray, np.ndarray]:
    s = torch.as_tensor(scores).detach().cpu().to(torch.float64).numpy().reshape(-1)
    lab = torch.as_tensor(labels).detach().cpu().to(torch.bool).numpy().reshape(-1)
    if s.shape != lab.shape:
        raise ValueError(f"{s.size} scores but {lab.size} labels")
    if np.isnan(s).any():
        raise ValueError("scores contain NaN")
    return s, lab


def auc_score(scores, labels) -> float:
    """P(score of a random member > score of a random non-member) + ½ P(tie): the
    Mann-Whitney U statistic over n_members * n_nonmembers, from average ranks."""
    s, lab = _as_numpy(scores, labels)
    n_pos, n_neg = int(lab.sum()), int((~lab).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="stable")
    sorted_s = s[order]
    # average rank (1-based) of each tie group
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
    ends = np.r_[starts[1:], s.size]
    group_rank = (starts + 1 + ends) / 2.0
    ranks = np.empty(s.size)
    ranks[order] = np.repeat(group_rank, ends - starts)
    u = ranks[lab].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def _cuts(scores, labels) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """Every distinct decision rule "member iff score >= t": the scores at the cuts
    (descending, distinct) and the true/false positives at each, with (0, 0) first."""
    s, lab = _as_numpy(scores, labels)
    order = np.argsort(-s, kind="stable")
    s, lab = s[order], lab[order]
    last_of_group = np.r_[s[1:] != s[:-1], True] if s.size else np.zeros(0, bool)
    tp = np.r_[0, np.cumsum(lab)[last_of_group]]
    fp = np.r_[0, np.cumsum(~lab)[last_of_group]]
    return s[last_of_group], tp, fp, int(lab.sum()), int((~lab).sum())


def roc_curve(scores, labels) -> tuple[np.ndarray, np.ndarray]:
    """The empirical ROC: (fpr, tpr), from (0, 0) to (1, 1), one point per distinct score."""
    _, tp, fp, n_pos, n_neg = _cuts(scores, labels)
    return fp / max(n_neg, 1), tp / max(n_pos, 1)


def best_threshold(scores, labels) -> tuple[float, float]:
    """The score threshold with the best accuracy on labelled (e.g. shadow) data and that
    accuracy. The threshold is the midpoint between the last score predicted member and the
    next lower score (+inf: no member predicted; -inf: every record predicted member)."""
    values, tp, fp, n_pos, n_neg = _cuts(scores, labels)
    if n_pos + n_neg == 0:
        raise ValueError("no scores")
    acc = (tp + (n_neg - fp)) / (n_pos + n_neg)
    k = int(np.argmax(acc))       # k distinct values predicted member
    if k == 0:
        t = float("inf")
    elif k == values.size:
        t = float("-inf")
    else:
        t = float((values[k - 1] + values[k]) / 2.0)
    return t, float(acc[k])


@dataclass
class AttackResult:
    """One attack's scores on the target's members and non-members.

    ``threshold`` is a score threshold chosen without the target's membership labels (on
    shadow data, or fixed by the attack), None when the attack has none.
    """

    name: str
    scores: torch.Tensor     # float64, higher = more likely member
    labels: torch.Tensor     # bool, True = member
    threshold: float | None = None

    def __post_init__(self) -> None:
        self.scores = torch.as_tensor(self.scores).detach().cpu().to(torch.float64).reshape(-1)
        self.labels = torch.as_tensor(self.labels).detach().cpu().to(torch.bool).reshape(-1)
        _as_numpy(self.scores, self.labels)   # shape and NaN checks

    @property
    def members(self) -> int:
        return int(self.labels.sum())

    @property
    def nonmembers(self) -> int:
        return int((~self.labels).sum())

    def auc(self) -> float:
        """Area under the ROC curve (Mann-Whitney, ties count ½); NaN without both classes."""
        return auc_score(self.scores, self.labels)

    def roc(self) -> tuple[np.ndarray, np.ndarray]:
        """(fpr, tpr) of the empirical ROC curve."""
        return roc_curve(self.scores, self.labels)

    def tpr_at_fpr(self, fpr: float) -> float:
        """The largest TPR of an empirical ROC point with FPR <= ``fpr``.

        The FPR takes values k / n_nonmembers only: with n non-members, any ``fpr`` below
        1/n means "no false positive at all" (e.g. TPR at 0.1 % FPR needs >= 1,000
        non-members to be resolved; with fewer it is the TPR at 0 false positives).
        """
        f, t = self.roc()
        return float(t[f <= fpr + 1e-12].max())

    def accuracy(self) -> float:
        """Membership accuracy at ``threshold`` (predict member iff score >= threshold).

        Without a threshold: the best accuracy over all thresholds, i.e. a threshold chosen
        with the target's own labels: an optimistic (upper) estimate of the attack."""
        s, lab = _as_numpy(self.scores, self.labels)
        if self.threshold is not None:
            return float(np.mean((s >= self.threshold) == lab))
        return best_threshold(s, lab)[1]

    def summary(self) -> dict:
        """JSON-ready numbers: name, auc, accuracy, tpr@0.1%fpr, tpr@1%fpr, members,
        non-members."""
        return {"name": self.name, "auc": self.auc(), "accuracy": self.accuracy(),
                "tpr@0.1%fpr": self.tpr_at_fpr(0.001), "tpr@1%fpr": self.tpr_at_fpr(0.01),
                "members": self.members, "non-members": self.nonmembers}


def plot_roc(results: list[AttackResult], path: Path, title: str) -> Path:
    """ROC curves of ``results`` on log-log axes with the chance line; AUC in the legend.
    Written as a PNG at ``path`` (Agg canvas, no pyplot state); returns ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    n_neg = max([r.nonmembers for r in results] + [1])
    lo = min(1e-3, 0.5 / n_neg)
    fig = Figure(figsize=(5.5, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([lo, 1], [lo, 1], ls="--", color="grey", lw=1, label="chance")
    for r in results:
        f, t = r.roc()
        # log axes cannot show 0: FPR 0 is drawn at the left edge
        ax.plot(np.maximum(f, lo), np.maximum(t, lo),
                label=f"{r.name} (AUC {r.auc():.3f})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, 1)
    ax.set_ylim(lo, 1)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
