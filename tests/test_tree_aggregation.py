"""Tree aggregation (dpfl.privacy.mechanisms.tree_aggregation) against independent references: the
factorization A = B C, the closed-form variance against B's rows and against draws of the
streaming generator, Honaker's estimator against least squares, the streaming noise against
B z, and the sensitivity DP against brute force over every participation pattern."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpfl.privacy.accounting import correlated_accounting as ca
from dpfl.privacy.accounting.participation import ParticipationSchema
from dpfl.privacy.mechanisms import tree_aggregation as ta

CASES = [(n, est, r) for n in (1, 2, 5, 8, 13, 16) for est in ta.ESTIMATORS
         for r in (None, 1, 3, 4)]


@pytest.mark.parametrize("n, estimator, restart", CASES)
def test_factorization_reproduces_prefix_sums(n, estimator, restart):
    f = ta.tree_factorization(n, estimator, restart)
    np.testing.assert_allclose(f.decoder @ f.encoder, np.tril(np.ones((n, n))), atol=1e-12)
    assert set(np.unique(f.encoder)) <= {0.0, 1.0}
    # every node is a dyadic block of its segment
    period = restart or n
    for row, h, start in zip(f.encoder, f.levels, f.starts):
        assert row.sum() == 2 ** h and (start % period) % 2 ** h == 0
        assert row[start:start + 2 ** h].all()


@pytest.mark.parametrize("n, estimator, restart", CASES)
def test_closed_form_variance_is_the_decoders_row_norms(n, estimator, restart):
    f = ta.tree_factorization(n, estimator, restart)
    np.testing.assert_allclose(ta.tree_noise_variance(n, estimator, restart, noise_std=1.0),
                               (f.decoder ** 2).sum(axis=1), rtol=1e-12)
    np.testing.assert_allclose(ta.tree_noise_variance(n, estimator, restart, noise_std=3.0),
                               9.0 * (f.decoder ** 2).sum(axis=1), rtol=1e-12)


def test_plain_variance_is_popcount_and_efficient_is_smaller():
    n = 37
    plain = ta.tree_noise_variance(n, "plain")
    assert list(plain) == [bin(t + 1).count("1") for t in range(n)]
    eff = ta.tree_noise_variance(n, "efficient")
    assert np.all(eff <= plain + 1e-15)
    assert eff[0] == 1.0 and eff[1] == pytest.approx(2 / 3) and eff[3] == pytest.approx(4 / 7)


@pytest.mark.parametrize("n", [4, 7, 8, 12])
def test_honaker_estimator_is_least_squares_on_the_released_nodes(n):
    """For each round t, the efficient decoder row equals the variance-optimal (least-squares)
    estimate of the prefix sum from the nodes completed by t."""
    f = ta.tree_factorization(n, "efficient")
    done = np.full(len(f.levels), -1)
    for i, (h, s) in enumerate(zip(f.levels, f.starts)):
        done[i] = s + 2 ** h - 1          # the round the node completes
    for t in range(n):
        rows = np.flatnonzero(done <= t)
        c_t = f.encoder[rows][:, :t + 1]
        gls = np.ones(t + 1) @ np.linalg.pinv(c_t)   # a^T (C^T C)^-1 C^T
        expect = np.zeros(len(f.levels))
        expect[rows] = gls
        np.testing.assert_allclose(f.decoder[t], expect, atol=1e-12)


def _dense_reference(n, estimator, restart, shape, seed):
    """B Z with the node noises drawn in completion order, one tensor of ``shape`` each."""
    f = ta.tree_factorization(n, estimator, restart)
    g = torch.Generator().manual_seed(seed)
    z = torch.stack([torch.randn(shape, generator=g, dtype=torch.float64)
                     for _ in range(len(f.levels))])
    b = torch.as_tensor(f.decoder)
    return torch.einsum("tn,n...->t...", b, z)


@pytest.mark.parametrize("n, estimator, restart", [(11, "plain", None), (11, "efficient", None),
                                                   (16, "efficient", None),
                                                   (13, "efficient", 4), (13, "plain", 5)])
def test_streaming_noise_equals_dense_b_z(n, estimator, restart):
    shape = (3, 2)
    expect = _dense_reference(n, estimator, restart, shape, seed=7) * 0.5
    gen = ta.TreeNoise(shape, 0.5, estimator, restart, seed=7, dtype=torch.float64)
    previous = torch.zeros(shape, dtype=torch.float64)
    levels = ta.tree_levels(restart or n)
    for t in range(n):
        step = gen.next()
        torch.testing.assert_close(step.prefix, expect[t], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(step.increment, step.prefix - previous)
        previous = step.prefix
        assert len(gen._stack) <= levels          # O(log n) tensors held
    assert gen.round == n


def test_streaming_is_reproducible_from_a_generator_or_seed():
    a = ta.TreeNoise((5,), 1.0, seed=3)
    b = ta.TreeNoise((5,), 1.0, generator=torch.Generator().manual_seed(3))
    for _ in range(9):
        torch.testing.assert_close(a.next().prefix, b.next().prefix)
    c = ta.TreeNoise((5,), 1.0, seed=4)
    assert not torch.equal(ta.TreeNoise((5,), 1.0, seed=3).next().prefix, c.next().prefix)


@pytest.mark.parametrize("estimator, restart", [("plain", None), ("efficient", None),
                                                ("efficient", 4)])
def test_streaming_variance_matches_closed_form(estimator, restart):
    """60,000 independent coordinates: the per-round sample variance is within 4 standard
    errors (relative se sqrt(2 / N) ~ 0.6 %) of the closed form."""
    n, draws, sigma = 12, 60_000, 2.0
    gen = ta.TreeNoise((draws,), sigma, estimator, restart, seed=11, dtype=torch.float64)
    expect = ta.tree_noise_variance(n, estimator, restart, noise_std=sigma)
    for t in range(n):
        var = float(gen.next().prefix.var())
        assert abs(var / expect[t] - 1.0) < 4.0 * math.sqrt(2.0 / draws), (t, var, expect[t])


SENS_CASES = [(n, k, b, r) for n in (1, 4, 7, 9, 12) for k in (1, 2, 3) for b in (1, 2, 3, 5)
              for r in (None, 3, 4)]


@pytest.mark.parametrize("n, k, b, restart", SENS_CASES)
def test_sensitivity_dp_equals_brute_force(n, k, b, restart):
    schema = ParticipationSchema(n, k, b)
    f = ta.tree_factorization(n, "plain", restart)
    brute = ca.sensitivity_bruteforce(f.encoder, schema)
    assert brute.exact                                      # C is 0/1: C^T C >= 0
    assert ta.tree_sensitivity(schema, restart) == pytest.approx(brute.value, rel=1e-12)


def test_single_participation_sensitivity_is_the_depth():
    for n in (1, 2, 3, 8, 100, 1000):
        assert ta.tree_sensitivity(ParticipationSchema(n, 1, n)) ** 2 == pytest.approx(
            ta.tree_levels(n))
    # restarts every R rounds with separation R: one participation per tree
    s = ParticipationSchema(64, 4, 16)
    assert ta.tree_sensitivity(s, 16) ** 2 == pytest.approx(4 * ta.tree_levels(16))


def test_sensitivity_of_a_larger_tree_is_bounded_by_the_simple_bounds():
    s = ParticipationSchema(256, 8, 32)
    sens2 = ta.tree_sensitivity(s) ** 2
    depth = ta.tree_levels(256)
    assert 8 * depth <= sens2 <= 8 * 8 * depth     # orthogonal ... all in the same nodes
    f = ta.tree_factorization(256, "plain")
    assert sens2 <= ca.sensitivity_upper_bound(f.encoder, s) ** 2 + 1e-9


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        ta.tree_factorization(8, "honaker")          # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ta.tree_noise_variance(8, restart_every=0)
    with pytest.raises(ValueError):
        ta.TreeNoise((2,), -1.0)
