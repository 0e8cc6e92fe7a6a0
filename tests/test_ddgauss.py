"""The distributed discrete Gaussian (dpfl.privacy.mechanisms.ddgauss) against independent references:
the discrete Gaussian's pmf summed by hand, tau and Proposition 14 written out, dp-accounting's
own conversion and Gaussian RDP, and the Skellam path at equal variance."""

import math

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from dpfl.client.secure import distributed_share
from dpfl.config import ConfigError
from dpfl.methods import parse_run_config
from dpfl.privacy.accounting.events import history_epsilon, orders_for, rdp_curve
from dpfl.privacy.mechanisms.ddgauss import (
    ddgauss_event,
    discrete_gaussian,
    overflow_bound,
    tau,
    variance_factors,
)
from dpfl.privacy.mechanisms.dgauss_sampler import discrete_gaussian_integer_coins, exp_bounds
from dpfl.privacy.mechanisms.skellam import skellam_event
from dpfl.privacy.trust import share_variance

DELTA = 1e-5


def _pmf(sigma2: float, reach: int = 60) -> dict[int, float]:
    w = {y: math.exp(-y * y / (2.0 * sigma2)) for y in range(-reach, reach + 1)}
    z = math.fsum(w.values())
    return {y: p / z for y, p in w.items()}


@pytest.mark.parametrize("t,v", [(1, 1), (3, 2)])
def test_sampler_matches_the_discrete_gaussian_pmf(t, v):
    """Exact sampler, small variances where the discrete Gaussian differs from a rounded
    continuous one (sigma^2 = 1: P(0) 0.3989 vs 0.3829, variance 0.99999 vs 1.083): the
    empirical frequencies, mean and variance against the pmf summed by hand."""
    n = 60_000
    x = discrete_gaussian((n,), t, v, torch.Generator().manual_seed(7))
    assert x.dtype == torch.int64 and x.shape == (n,)
    pmf = _pmf(t * v)
    var = math.fsum(p * y * y for y, p in pmf.items())
    for y in range(-3, 4):
        freq = (x == y).double().mean().item()
        se = math.sqrt(pmf[y] * (1 - pmf[y]) / n)
        assert abs(freq - pmf[y]) < 5 * se, (y, freq, pmf[y])
    assert abs(x.double().mean().item()) < 5 * math.sqrt(var / n)
    # Var of the sample variance ~ (mu4 - var^2) / n
    mu4 = math.fsum(p * y ** 4 for y, p in pmf.items())
    assert abs(x.double().var().item() - var) < 5 * math.sqrt((mu4 - var * var) / n)


def test_exact_route_matches_the_pmf_and_the_integer_coin_sampler():
    """margin 1/2 sends most coins to the exact route (more lazy bits, decimal bounds of
    exp(-gamma)): the draws still follow the pmf summed by hand, and so do the old
    integer-coin sampler's (an independent exact implementation: Algorithms 1-2)."""
    n = 4000
    pmf = _pmf(1.0)
    for x in (discrete_gaussian((n,), 1, 1, torch.Generator().manual_seed(11), margin=0.5),
              discrete_gaussian_integer_coins((n,), 1, 1, torch.Generator().manual_seed(11))):
        for y in range(-2, 3):
            freq = (x == y).double().mean().item()
            assert abs(freq - pmf[y]) < 5 * math.sqrt(pmf[y] * (1 - pmf[y]) / n), (y, freq)


def test_exp_bounds_and_the_float_filter_assumption():
    """The exact route's bounds bracket exp(-gamma) (checked with 60-digit decimal), and
    torch's float64 exp, on which the fast filter relies, is within 2^-45 relative of the
    truth for gamma in [0, 512] (the module assumes < 2^-37 with the float gamma error)."""
    from decimal import Decimal, localcontext
    from fractions import Fraction

    with localcontext() as ctx:
        ctx.prec = 60
        ref = Fraction((-(Decimal(7) / Decimal(3))).exp())
    lo, hi = exp_bounds(7, 3, 20)
    assert lo <= ref <= hi and hi - lo < Fraction(1, 10 ** 17)
    gen = torch.Generator().manual_seed(2)
    nums = torch.randint(0, 512 * 1000, (400,), generator=gen).tolist()
    worst = 0.0
    with localcontext() as ctx:
        ctx.prec = 40
        for k in nums:
            true = (-(Decimal(k) / Decimal(1000))).exp()
            got = Decimal(torch.exp(torch.tensor(-k / 1000, dtype=torch.float64)).item())
            worst = max(worst, float(abs(got - true) / true))
    assert worst < 2.0 ** -45


def test_sampler_at_dpfl_scale_and_its_factors():
    """sigma^2 = t v with t = floor(sqrt(target)) + 1, v = ceil(target / t) >= target; at a
    large variance the draws have mean 0 and variance t v (a discrete Gaussian that wide
    has the continuous one's variance to 1e-300)."""
    assert variance_factors(6.0) == (3, 2)
    assert variance_factors(2.5e9) == (50_001, 50_000)
    t, v = variance_factors(3.3e7)
    assert t * v >= 3.3e7 and t == math.isqrt(33_000_000) + 1
    n = 40_000
    x = discrete_gaussian((n,), t, v, torch.Generator().manual_seed(3)).double()
    assert abs(x.mean().item()) < 5 * math.sqrt(t * v / n)
    assert x.var().item() == pytest.approx(t * v, rel=5 * math.sqrt(2 / n))


def test_tau_by_hand():
    """n = 3, sigma^2 = 1: tau = 10 (exp(-pi^2) + exp(-4 pi^2 / 3)); one client: 0."""
    assert tau(3, 1.0) == pytest.approx(10 * (math.exp(-math.pi ** 2)
                                              + math.exp(-4 * math.pi ** 2 / 3)), rel=1e-12)
    assert tau(3, 1.0) == pytest.approx(5.3650e-4, rel=1e-4)
    assert tau(1, 1.0) == 0.0
    assert tau(100, 1e4) == 0.0  # exp(-1e5) underflows: the Gaussian bound


def test_event_curve_and_epsilon_by_hand():
    """C = 1, s = 2, d = 4: B = 2 + 2 = 4; sigma = 0.75: mu = 2.25, n = 3 clients of
    variance 0.75. Proposition 14 (add-remove, Delta_2 = B = 4): alpha 16 / 4.5 + tau d with
    tau = 10 (exp(-0.75 pi^2) + exp(-pi^2)). Its epsilon is dp-accounting's conversion of
    that curve, below the closed-form minimum of the classic conversion
    alpha a + c + log(1/delta) / (alpha - 1)."""
    ev = ddgauss_event(1, 0.75, 1.0, 2.0, 4, "add-remove", 3)
    assert ev.mechanism == "ddgauss" and ev.sigma == pytest.approx(1.5 / 4)
    t = 10 * (math.exp(-0.75 * math.pi ** 2) + math.exp(-math.pi ** 2))
    assert ev.epsilon == pytest.approx(4 * t, rel=1e-12)
    orders = orders_for("client")
    a = 16 / 4.5
    hand = orders * a + 4 * t
    np.testing.assert_allclose(rdp_curve(ev.key), hand, rtol=1e-12)
    eps, _ = rdp_lib.compute_epsilon(orders, hand, DELTA)
    assert history_epsilon([ev], DELTA, "rdp") == pytest.approx(eps, rel=1e-12)
    classic = a + 4 * t + 2 * math.sqrt(a * math.log(1 / DELTA))
    assert eps <= classic
    # replace-one doubles Delta_2: 4 a
    rep = ddgauss_event(1, 0.75, 1.0, 2.0, 4, "replace-one", 3)
    np.testing.assert_allclose(rdp_curve(rep.key), orders * 4 * a + 4 * t, rtol=1e-12)


def test_ddgauss_and_skellam_at_equal_variance_are_near_the_gaussian():
    """d = 80,000, s = 1e5, C = 1, sigma = 4, 20 rounds, replace-one: at equal total
    variance DDGauss's epsilon is the Gaussian mechanism's (tau = 0; dp-accounting's RDP of
    GaussianDpEvent(sigma_eq / 2) composed 20 times) and Skellam's is within 2 % above
    (integer orders only, plus its discreteness surcharge)."""
    d, s = 80_000, 1e5
    dd = ddgauss_event(1, 4.0, 1.0, s, d, "replace-one", 100)
    sk = skellam_event(1, 4.0, 1.0, s, d, "replace-one")
    assert dd.sigma == pytest.approx(sk.sigma, rel=1e-12)
    eps_dd = history_epsilon([dd] * 20, DELTA, "rdp")
    eps_sk = history_epsilon([sk] * 20, DELTA, "rdp")
    acc = rdp_lib.RdpAccountant(orders=list(orders_for("client")))
    acc.compose(dp_event.GaussianDpEvent(dd.sigma / 2), 20)
    eps_gauss = acc.get_epsilon(DELTA)
    assert eps_dd == pytest.approx(eps_gauss, rel=1e-9)
    assert 1.0 < eps_dd <= eps_sk <= 1.02 * eps_dd
    # at a tiny variance the sum of discrete Gaussians costs more than the Gaussian
    small = ddgauss_event(1, 1.0, 1.0, 1.0, 4, "replace-one", 8)
    assert small.epsilon > 0
    assert history_epsilon([small], DELTA, "rdp") > history_epsilon(
        [small.__class__(1, "gaussian", sigma=small.sigma, relation="replace-one")],
        DELTA, "rdp")


def test_aggregate_ddgauss_noise_has_the_planned_variance():
    """8 zero updates, n_min = 8: the dequantised sum has variance 8 t v / s^2 >= (sigma
    C)^2, and at most one unit of rounding above the target per share."""
    from dpfl.config import RunConfig

    cfg = RunConfig(trainer="update-dp", trust="distributed", secure_noise="ddgauss",
                    noise_multiplier=1.5, clip_norm=2.0, secagg_scale=100.0)
    v = share_variance(1.5, cfg, 8)
    g = torch.Generator().manual_seed(5)
    total = sum(distributed_share(torch.zeros(20_000), 2.0, 100.0, v, g, "ddgauss")
                for _ in range(8))
    t_, v_ = variance_factors(v)
    assert t_ * v_ >= v and t_ * v_ - v < t_
    assert (total.double() / 100.0).var().item() == pytest.approx(8 * t_ * v_ / 1e4, rel=0.05)


def test_overflow_bound_by_hand():
    """2 d exp(-(c - C s - 1)^2 / (2 t v)) with the sampled variance t v."""
    t, v = variance_factors(1e6)
    got = overflow_bound(1.0, 1e3, 1e6, 1000, 20_000.0)
    assert got == pytest.approx(2000 * math.exp(-(20_000 - 1001) ** 2 / (2 * t * v)), rel=1e-9)
    assert overflow_bound(1.0, 1e3, 1e6, 1000, 1000.0) == 1.0


def test_ddgauss_shares_below_the_theorems_sigma_are_refused():
    """Proposition 14 needs each share's sigma >= 1/2: (sigma C s)^2 / n_min = 0.16 is
    refused, 0.25 passes."""
    from dpfl.config import RunConfig
    from dpfl.privacy.trust import check_overflow

    cfg = RunConfig(trainer="update-dp", trust="distributed", secure_noise="ddgauss",
                    clip_norm=1.0, secagg_scale=2.0)
    with pytest.raises(ValueError, match="1/4"):
        check_overflow(cfg, 0.4, 10, 4, 4)          # (0.4 * 1 * 2)^2 / 4 = 0.16
    assert check_overflow(cfg, 0.5, 10, 4, 4) >= 0  # (0.5 * 1 * 2)^2 / 4 = 0.25


def test_secure_noise_needs_distributed_trust():
    with pytest.raises(ConfigError, match="secure-noise"):
        parse_run_config({"trainer": "update-dp", "secure-noise": "ddgauss"})
    with pytest.raises(ConfigError, match="secure-noise"):
        parse_run_config({"trainer": "update-dp", "trust": "distributed",
                          "secure-noise": "gauss"})
    cfg = parse_run_config({"trainer": "update-dp", "trust": "distributed",
                            "secure-noise": "ddgauss"})
    assert cfg.secure_noise == "ddgauss"
