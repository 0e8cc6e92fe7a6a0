"""cpSGD (dpfl.methods.cpsgd, dpfl.privacy.mechanisms.binomial) against hand computations: the
restricted-support Renyi divergence summed by hand in exact rationals, the binomial tail by
math.comb, the Gaussian limit, dp-accounting's conversion, and the quantiser/rotation."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from dpfl.config import ConfigError
from dpfl.methods import cpsgd as cp
from dpfl.methods import parse_run_config
from dpfl.privacy.accounting.events import history_epsilon, rdp_curve
from dpfl.privacy.mechanisms.binomial import (
    ORDERS,
    SAFETY,
    binomial_curve,
    binomial_event,
    restricted_divergence,
    restricted_divergences,
    support_delta,
    support_mass,
)


def _exact(n: int, s: int, alpha: int) -> float:
    """sum_{x in S} P^alpha Q^(1-alpha) / P(S) in rationals, P = Bin(n, 1/2), Q = P + s."""
    tot, ps = Fraction(0), Fraction(0)
    for x in range(s, n + 1):
        p, q = Fraction(math.comb(n, x), 2 ** n), Fraction(math.comb(n, x - s), 2 ** n)
        tot += p ** alpha / q ** (alpha - 1)
        ps += p
    return math.log(tot / ps) / (alpha - 1)


@pytest.mark.parametrize("n,max_shift", [(3, 5), (333, 9), (12345, 20), (10 ** 6, 4)])
def test_all_shifts_at_once_are_each_shifts_divergence_bit_for_bit(n, max_shift):
    """restricted_divergences (D_s kept on the union of the windows, one term added per
    shift) returns exactly restricted_divergence's float at every order and shift, inf where
    the supports do not meet (s > n)."""
    fast = restricted_divergences(n, max_shift)
    assert set(fast) == {(a, s) for a in ORDERS for s in range(1, max_shift + 1)}
    for (a, s), value in fast.items():
        assert value == restricted_divergence(n, s, a), (a, s)   # ==: inf == inf too


def test_restricted_divergence_by_hand():
    """n = 4, s = 1, alpha = 2: P = (1, 4, 6, 4, 1) / 16, S = {1..4}, P(S) = 15/16:
    (16/1 + 36/4 + 16/6 + 1/4) / 16 / (15/16) = 1.861111, log = 0.621173."""
    hand = math.log((16 + 9 + 16 / 6 + 0.25) / 15)
    assert hand == pytest.approx(0.6211737, abs=1e-6)
    assert restricted_divergence(4, 1, 2) == pytest.approx(SAFETY * hand, rel=1e-12)
    for n, s, a in [(30, 2, 3), (60, 3, 5), (200, 4, 8), (120, 7, 16)]:
        assert restricted_divergence(n, s, a) == pytest.approx(SAFETY * _exact(n, s, a),
                                                               rel=1e-9)
    assert restricted_divergence(3, 4, 2) == math.inf          # supports do not meet


def test_support_mass_and_the_gaussian_limit():
    """eta(s) = P(Bin(n, 1/2) <= s - 1) by math.comb; at large n the divergence is the
    Gaussian's alpha s^2 / (2 n / 4) (within 0.2 %, times the safety factor)."""
    assert support_mass(100, 3) == pytest.approx(
        sum(math.comb(100, x) for x in range(3)) / 2 ** 100, rel=1e-10)
    assert support_mass(100, 0) == 0.0
    for n, s, a in [(10 ** 4, 1, 2), (10 ** 4, 5, 10), (10 ** 6, 3, 20)]:
        assert restricted_divergence(n, s, a) / SAFETY == pytest.approx(2 * a * s * s / n,
                                                                        rel=2e-3)


def test_curve_composes_by_l2_and_the_event_dominates_it():
    """The curve is min(D2^2 max_s f/s^2, d max_s f) (by hand at n = 200, shifts <= 3); the
    event's linear curve plus slack is >= it plus the delta-share term at every order, and
    dp-accounting's conversion of T events at delta is >= the exact curve's at
    delta (1 - 1e-3)."""
    n, k1, d2, dim = 200, 3, 5.0, 40
    f = {(a, s): restricted_divergence(n, s, a) for a in ORDERS for s in (1, 2, 3)}
    hand = [min(d2 ** 2 * max(f[a, s] / s ** 2 for s in (1, 2, 3)),
                dim * max(f[a, s] for s in (1, 2, 3))) for a in ORDERS]
    np.testing.assert_allclose(binomial_curve(n, k1, d2, dim), hand, rtol=1e-12)
    bound, rounds = 2.5, 10
    ev = binomial_event(1, 4000, k1, bound, dim, "replace-one", rounds, 1e-3)
    assert ev.sigma == pytest.approx(math.sqrt(1000) / bound)
    exact = binomial_curve(4000, k1, 2 * bound, dim)
    curve = rdp_curve(ev.key)
    orders = rdp_lib.DEFAULT_RDP_ORDERS
    known = [orders.index(a) for a in ORDERS]
    extra = -math.log1p(-1e-3) / (rounds * (np.asarray(ORDERS) - 1.0))
    assert np.all(curve[known] >= exact + extra - 1e-12)
    assert np.isinf(np.delete(curve, known)).all()
    eps = history_epsilon([ev] * rounds, 1e-5, "rdp")
    ref, _ = rdp_lib.compute_epsilon(list(ORDERS), rounds * exact, 1e-5 * (1 - 1e-3))
    assert ref <= eps <= 1.1 * ref     # the linear-plus-slack form costs a few per cent


def test_support_delta_by_hand():
    """min(D2^2 max_s eta(s)/s^2, d eta(k - 1)) at n = 50, shifts <= 2."""
    eta1, eta2 = 2 ** -50, (1 + 50) * 2 ** -50
    assert support_delta(50, 2, 3.0, 1000) == pytest.approx(9 * max(eta1, eta2 / 4),
                                                            rel=1e-9)


def test_rotation_quantiser_and_the_secure_mean():
    """H D / sqrt(d') is orthogonal (inverse recovers x, norm kept); the quantiser's levels
    lie in [0, k - 1] and are unbiased; 6 clients' shares summed and dequantised give the
    mean of the clipped updates up to the planned noise (std sigma C / n per coordinate in
    the rotated basis, as for DP-FedAvg's Gaussian)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, generator=g, dtype=torch.float64)
    signs = cp.rotation_signs(128, 3, 1)
    y = cp.rotate(x, signs)
    assert y.numel() == 128 and y.norm().item() == pytest.approx(x.norm().item(), rel=1e-12)
    torch.testing.assert_close(cp.unrotate(y, signs, 100), x)
    w = torch.full((20_000,), 0.3, dtype=torch.float64)
    q = cp.quantise(w, 1.0, 5, g)                  # (0.3 + 1) * 2 = 2.6 -> 2 or 3
    assert set(q.unique().tolist()) == {2, 3}
    assert q.double().mean().item() == pytest.approx(2.6, abs=0.02)
    cfg = parse_run_config({"strategy": "cpsgd", "trainer": "update-dp",
                            "trust": "distributed", "clip-norm": 1.0,
                            "noise-multiplier": 0.05, "cpsgd-levels": 64})
    params, dim, n = cfg.params, 100, 6
    ups = [torch.randn(dim, generator=g) * 0.05 for _ in range(n)]
    total = sum(params.secure_share(cfg, u, 1.0, 0.05, n, g, 1) for u in ups)
    mean = params.secure_mean(cfg, total, n, n, dim, 0.05, 1)
    want = torch.stack([u.double() * min(1.0, 1.0 / u.norm().item()) for u in ups]).mean(0)
    assert (mean - want).abs().max().item() < 6 * 0.05 / n + 0.05


def test_cpsgd_needs_distributed_trust_and_update_dp():
    with pytest.raises(ConfigError, match="trust"):
        parse_run_config({"strategy": "cpsgd", "trainer": "update-dp"})
    with pytest.raises(ConfigError, match="cpsgd-levels"):
        parse_run_config({"strategy": "cpsgd", "trainer": "update-dp",
                          "trust": "distributed", "cpsgd-levels": 1})
    cfg = parse_run_config({"strategy": "cpsgd", "trainer": "update-dp",
                            "trust": "distributed"})
    assert cfg.params.cpsgd_levels == 16


def test_secure_check_refuses_too_little_noise():
    """Few trials: the excluded support mass exceeds 1e-3 delta and the run is refused."""
    cfg = parse_run_config({"strategy": "cpsgd", "trainer": "update-dp",
                            "trust": "distributed", "noise-multiplier": 0.001})
    with pytest.raises(ValueError, match="support"):
        cfg.params.secure_check(cfg, 64, 0.001, 4, 4, 10 ** 8)
    assert cfg.params.secure_check(cfg, 64, 2.0, 4, 4, 10 ** 8) >= 0


@pytest.mark.parametrize("guess", [0.5, 5.0, 50.0])
def test_bracket_and_bisect_finds_the_smallest_sigma_to_one_percent(guess):
    """eps(sigma) = 10 / sigma, target 2: sigma* = 5, from any starting guess."""
    calls = []

    def eps(sigma):
        calls.append(sigma)
        return 10.0 / sigma

    sigma = cp.bracket_and_bisect(eps, 2.0, guess)
    assert 5.0 <= sigma <= 5.0 * 1.01
    assert len(calls) <= 30 and len(set(calls)) == len(calls)   # no sigma evaluated twice
    with pytest.raises(ValueError, match="unreachable"):
        cp.bracket_and_bisect(lambda s: 1.0, 0.5, 1.0)


def _small_cfg(target):
    return parse_run_config({"strategy": "cpsgd", "trainer": "update-dp",
                             "trust": "distributed", "cpsgd-levels": 4, "num-rounds": 5,
                             "target-epsilon": target, "delta": 1e-5})


def _eps(cfg, dim, sigma):
    return history_epsilon([cfg.params.secure_event(cfg, 1, dim, sigma)] * cfg.num_rounds,
                           cfg.delta, "rdp")


def test_calibration_is_the_smallest_sigma_and_its_memo_is_checked(tmp_path, monkeypatch,
                                                                  caplog):
    """The calibrated sigma meets the target and 1 % less does not; a second process (the
    in-process cache cleared) takes it from the memo without a search; a memo entry below
    the target, or ten times the answer (not the smallest), is refused and the search runs
    again."""
    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path))
    cfg, dim = _small_cfg(8.0), 64
    sigma = cfg.params._calibrate(cfg, dim)
    assert _eps(cfg, dim, sigma) <= 8.0 < _eps(cfg, dim, sigma / 1.01)
    searches = []
    search = cp.bracket_and_bisect
    monkeypatch.setattr(cp, "bracket_and_bisect",
                        lambda *a, **k: searches.append(a) or search(*a, **k))
    assert cfg.params._calibrate(cfg, dim) == sigma and searches == []
    key = cp._memo_key(cfg.params, cfg, dim)
    cp.calibration_cache.store(key, sigma / 2)   # an edited entry: too little noise
    assert cfg.params._calibrate(cfg, dim) == sigma and len(searches) == 1
    assert "above the target epsilon" in caplog.text
    other = _small_cfg(4.0)                       # another question, another entry
    assert other.params._calibrate(other, dim) > sigma and len(searches) == 2
    cp.calibration_cache.store(key, sigma * 10)   # planted: ten times the noise
    assert cfg.params._calibrate(cfg, dim) == sigma and len(searches) == 3
    assert "not the smallest" in caplog.text
