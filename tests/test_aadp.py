"""AADP-FL: budget allocation, the Nadam step by hand, and the epsilon schedule firing
exactly when its condition holds (longitudinal clipping: tests/test_longitudinal.py)."""

import pytest
import torch

from dpfl.methods import build_strategy, run_config
from dpfl.methods.aadp import (
    NadamState,
    allocate_budgets,
    moments_stable,
    nadam_step,
    raise_budgets,
    round_epsilon_for,
)


def test_budget_allocation_sums_and_proportions():
    b = allocate_budgets({0: 100, 1: 300, 2: 600}, 4.0)
    assert sum(b.values()) == pytest.approx(3 * 4.0)  # mean allocation = eps
    assert b[2] / b[0] == pytest.approx(6.0)
    assert b[1] == pytest.approx(3 * 300 / 1000 * 4.0)


def test_nadam_step_by_hand():
    w = torch.tensor([1.0, -1.0])
    g = torch.tensor([0.2, 0.4])
    st = NadamState(u=0.9, v=0.999, gamma=1e-8)
    new = nadam_step(w, g, st, lr=0.01)
    # t = 1: g_hat = g / 0.1; m = 0.1 g; m_hat = g; m_bar = 0.1 g/0.1 + 0.9 g = 1.9 g
    # n = 0.001 g^2; n_hat = g^2; step = 0.01 * 1.9 g / sqrt(g^2 + 1e-8)
    expected = w + 0.01 * 1.9 * g / torch.sqrt(g * g + 1e-8)
    assert torch.allclose(new, expected, atol=1e-7)
    g2 = torch.tensor([0.1, 0.0])
    new2 = nadam_step(new, g2, st, lr=0.01)
    m = 0.9 * 0.1 * g + 0.1 * g2
    n = 0.999 * 0.001 * g * g + 0.001 * g2 * g2
    m_bar = 0.1 * g2 / (1 - 0.81) + 0.9 * m / (1 - 0.81)
    n_hat = n / (1 - 0.999 ** 2)
    assert torch.allclose(new2, new + 0.01 * m_bar / torch.sqrt(n_hat + 1e-8), atol=1e-7)


def test_schedule_fires_exactly_when_the_condition_holds():
    st = NadamState()
    w = torch.zeros(3)
    w = nadam_step(w, torch.full((3,), 1e-2), st, 0.01)
    assert not moments_stable(st, 1e-3)  # one step: no previous moments to compare
    w = nadam_step(w, torch.full((3,), 1e-2), st, 0.01)
    # m moved by 0.1 * (g - m_prev) = 0.1 * (0.01 - 0.001) = 9e-4 < 1e-3; n by ~1e-7
    assert moments_stable(st, 1e-3)
    assert not moments_stable(st, 8e-4)  # just under the actual change
    assert raise_budgets({0: 1.0, 1: 25.0}, 0.1, 20.0) == {0: 10.0, 1: 25.0}


def test_strategy_raises_budgets_only_when_stable():
    cfg = run_config(strategy="aadp", trainer="update-dp", aadp_threshold=1e-3)
    s = build_strategy(cfg, {0: 100, 1: 100})
    s.server_step(torch.zeros(3), torch.full((3,), 1e-2))
    assert s.budgets == {0: 4.0, 1: 4.0}
    s.server_step(torch.zeros(3), torch.full((3,), 1e-2))
    assert s.budgets == {0: 40.0, 1: 40.0} and s.raised_at == [2]
    cfg_round = s.round_config(3)
    assert round_epsilon_for(cfg_round, 1) == 40.0
    s.server_step(torch.zeros(3), torch.full((3,), 1e-2))
    assert s.budgets == {0: 40.0, 1: 40.0}  # >= eps_max: no further raise


def test_paper_noise_multiplier_closed_form_and_verdict():
    """AADP-FL's printed variance S^4 l/(|w| eps^2) as a multiplier of S, worked by hand:
    S = 0.5, l = 1e-2, |w| = 10^4, eps = 2: std = 0.25 * 0.1 / (100 * 2) = 1.25e-4 = sigma S,
    sigma = 2.5e-4; and the run that uses it is not called DP."""
    import math

    from dpfl.methods import guarantee as guarantee_for
    from dpfl.methods import parse_run_config
    from dpfl.methods.aadp import paper_noise_multiplier

    sigma = paper_noise_multiplier(0.5, 1e-2, 10_000, 2.0)
    assert math.isclose(sigma, 2.5e-4)
    assert math.isclose(sigma * 0.5, math.sqrt(0.5 ** 4 * 1e-2 / (10_000 * 2.0 ** 2)))
    base = {"strategy": "aadp", "trainer": "update-dp"}
    assert guarantee_for(parse_run_config(base)).verdict == "formal"
    paper = guarantee_for(parse_run_config({**base, "aadp-noise": "paper"}))
    assert paper.verdict.startswith("none:") and "S^4 l" in paper.verdict
    with pytest.raises(Exception, match="aadp-noise"):
        parse_run_config({**base, "aadp-noise": "tiny"})
