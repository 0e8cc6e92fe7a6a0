"""AADP-FL: longitudinal clipping against a naive loop, budget allocation, the Nadam step
by hand, and the epsilon schedule firing exactly when its condition holds."""

import math

import pytest
import torch

from dpfl.config import RunConfig
from dpfl.privacy.longitudinal import longitudinal_clip
from dpfl.strategies import build_strategy
from dpfl.strategies.aadp import (
    NadamState,
    allocate_budgets,
    moments_stable,
    nadam_step,
    raise_budgets,
    round_epsilon_for,
)


def naive_longitudinal(theta, s):
    """Algorithm 2 literally: zero the smallest non-zero |coordinate| while ||theta|| > S."""
    x = theta.clone().double()
    while float(x.norm()) > s:
        nz = torch.nonzero(x).flatten()
        k = nz[torch.argmin(x[nz].abs())]
        x[k] = 0
    return x.float()


@pytest.mark.parametrize("seed", range(6))
def test_matches_the_naive_loop_on_random_vectors(seed):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(300, generator=g) * torch.rand(300, generator=g)
    s = float(theta.norm()) * (0.2 + 0.1 * seed)
    out = longitudinal_clip(theta, s)
    assert torch.equal(longitudinal_clip(theta, s, literal=True), naive_longitudinal(theta, s))
    if float(theta.abs().max()) <= s:  # otherwise the documented edge case applies
        assert torch.equal(out, naive_longitudinal(theta, s))
    assert float(out.norm()) <= s + 1e-6
    kept = out != 0
    if kept.any() and (~kept).any():  # the kept coordinates are the largest ones
        assert float(theta[kept].abs().min()) >= float(theta[~kept].abs().max())
    assert torch.equal(longitudinal_clip(out, s), out)  # idempotent


def test_edge_cases():
    z = torch.zeros(10)
    assert torch.equal(longitudinal_clip(z, 1.0), z)
    small = torch.tensor([0.1, -0.2, 0.3])
    assert torch.equal(longitudinal_clip(small, 1.0), small)  # norm already <= S
    huge = torch.tensor([0.5, -10.0, 0.2])  # the largest alone exceeds S = 1
    assert torch.equal(longitudinal_clip(huge, 1.0), torch.tensor([0.0, -1.0, 0.0]))
    assert torch.equal(longitudinal_clip(huge, 1.0, literal=True), torch.zeros(3))
    assert torch.equal(naive_longitudinal(huge, 1.0), torch.zeros(3))  # the paper's literal result


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
    cfg = RunConfig(strategy="aadp", trainer="update-dp", aadp_threshold=1e-3)
    s = build_strategy(cfg)
    s.bind_partition_sizes({0: 100, 1: 100})
    s.server_step(torch.zeros(3), torch.full((3,), 1e-2))
    assert s.budgets == {0: 4.0, 1: 4.0}
    s.server_step(torch.zeros(3), torch.full((3,), 1e-2))
    assert s.budgets == {0: 40.0, 1: 40.0} and s.raised_at == [2]
    cfg_round = s.round_config(3)
    assert round_epsilon_for(cfg_round, 1) == 40.0
    s.server_step(torch.zeros(3), torch.full((3,), 1e-2))
    assert s.budgets == {0: 40.0, 1: 40.0}  # >= eps_max: no further raise


def test_ties_are_zeroed_in_index_order():
    theta = torch.tensor([0.5, -0.5, 0.5, 2.0, -0.5])
    s = math.sqrt(4.0 + 0.25 * 2) + 1e-9  # keep 2.0 and two of the four 0.5s
    out = longitudinal_clip(theta, s)
    assert torch.equal(out, naive_longitudinal(theta, s))
    assert out.tolist() == [0.0, 0.0, 0.5, 2.0, -0.5]


def test_paper_noise_multiplier_closed_form_and_verdict():
    """AADP-FL's printed variance S^4 l/(|w| eps^2) as a multiplier of S, worked by hand:
    S = 0.5, l = 1e-2, |w| = 10^4, eps = 2: std = 0.25 * 0.1 / (100 * 2) = 1.25e-4 = sigma S,
    sigma = 2.5e-4; and the run that uses it is not called DP."""
    import math

    from dpfl.config import parse_run_config
    from dpfl.privacy.verdict import guarantee_for
    from dpfl.strategies.aadp import paper_noise_multiplier

    sigma = paper_noise_multiplier(0.5, 1e-2, 10_000, 2.0)
    assert math.isclose(sigma, 2.5e-4)
    assert math.isclose(sigma * 0.5, math.sqrt(0.5 ** 4 * 1e-2 / (10_000 * 2.0 ** 2)))
    base = {"strategy": "aadp", "trainer": "update-dp"}
    assert guarantee_for(parse_run_config(base)).verdict == "formal"
    paper = guarantee_for(parse_run_config({**base, "aadp-noise": "paper"}))
    assert paper.verdict.startswith("none:") and "S^4 l" in paper.verdict
    with pytest.raises(Exception, match="aadp-noise"):
        parse_run_config({**base, "aadp-noise": "tiny"})
