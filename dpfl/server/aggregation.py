"""Server math as plain functions on tensors (one row per client)."""

from __future__ import annotations

import torch

# How far a value a client reports (a loss, a score) may raise its client's aggregation
# weight: the odds of its share against the rest of the aggregate, s / (1 - s), at most this
# multiple of the odds its public baseline share b gives it (its size share n_i / n, or
# 1 / M for equal weights): s <= r b / (1 + (r - 1) b). With M clients of equal baseline one
# reply then holds at most 3 / (M + 2) of the aggregate whatever it claims (2 clients: 75 %,
# 5: 43 %, 10: 25 %, 100: 3 %), and an honest spread of up to 3x is left alone.
MAX_WEIGHT_ODDS = 3.0


def weighted_mean(updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_i w_i u_i / sum_i w_i for an M x d matrix of updates (FedAvg, McMahan et al. 2017)."""
    if updates.ndim != 2 or weights.shape != (updates.shape[0],):
        raise ValueError("updates must be M x d and weights length M")
    w = weights.to(updates.dtype)
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError(f"weights must be finite and >= 0, got {weights.tolist()[:8]}")
    total = float(w.sum())
    if not total > 0 or total == float("inf"):
        raise ValueError("weights must sum to a positive value")
    return (w / total) @ updates


def share_caps(baseline: torch.Tensor, odds: float = MAX_WEIGHT_ODDS) -> torch.Tensor:
    """The largest share each client may hold: r b_i / (1 + (r - 1) b_i), b the baseline
    shares (normalised here), r = ``odds`` (its odds against the rest at most r times the
    baseline's; >= b_i for r >= 1, so the caps sum to >= 1)."""
    b = torch.as_tensor(baseline, dtype=torch.float64)
    b = b / b.sum()
    return odds * b / (1.0 + (odds - 1.0) * b)


def capped_shares(weights: torch.Tensor, baseline: torch.Tensor,
                  odds: float = MAX_WEIGHT_ODDS) -> torch.Tensor:
    """The shares w_i / sum_j w_j with every share at most its :func:`share_caps` (the odds
    of its share against the rest at most ``odds`` times those of its baseline share
    b_i / sum_j b_j), the excess given to the others in proportion to their shares
    (water-filling: the result is min(cap_i, lambda w_i) with lambda such that it sums to
    1; float64). ``odds`` >= 1 makes that always possible and leaves the baseline itself
    unchanged.

    A method whose weights use values a client reports bounds each reply's influence with
    it (:data:`MAX_WEIGHT_ODDS`): whatever the reported values, no reply holds more of the
    aggregate than its cap."""
    if not odds >= 1:
        raise ValueError(f"odds must be >= 1, got {odds}")
    w = torch.as_tensor(weights, dtype=torch.float64).clone()
    b = torch.as_tensor(baseline, dtype=torch.float64)
    if w.shape != b.shape or w.ndim != 1:
        raise ValueError("weights and baseline must be vectors of the same length")
    for name, v in (("weights", w), ("baseline", b)):
        if not bool(torch.isfinite(v).all()) or bool((v < 0).any()) or not float(v.sum()) > 0:
            raise ValueError(f"{name} must be finite, >= 0 and not all 0")
    b = b / b.sum()
    w = w / w.sum()
    cap = share_caps(b, odds)
    fixed = torch.zeros_like(w, dtype=torch.bool)
    for _ in range(len(w)):
        over = (w > cap) & ~fixed
        if not bool(over.any()):
            break
        fixed |= over
        w = torch.where(fixed, cap, w)
        free = max(1.0 - float(cap[fixed].sum()), 0.0)
        rest = ~fixed
        total = float(w[rest].sum())
        if total > 0:
            w[rest] = w[rest] * (free / total)
        elif float(b[rest].sum()) > 0:   # the others weigh 0 (e.g. an underflowed softmax)
            w[rest] = b[rest] * (free / float(b[rest].sum()))
    return w / w.sum()


def server_sgd_step(global_flat: torch.Tensor, aggregated_update: torch.Tensor,
                    server_lr: float) -> torch.Tensor:
    """w <- w + eta * Delta (the update is trained - received, so + descends)."""
    return global_flat + server_lr * aggregated_update
