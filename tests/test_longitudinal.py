"""AADP-FL's longitudinal clipping (``dpfl.privacy.mechanisms.longitudinal``): the norm bound on
adversarial inputs, the output structure (kept coordinates unchanged, the largest ones,
ties zeroed in index order), agreement with a naive Algorithm-2 loop on small inputs, and
the backstop of the hard check.

Every random case comes from ``numpy.random.default_rng(seed)`` with a fixed seed, in the
test id or printed (pytest shows it with a failure)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from dpfl.privacy.mechanisms import longitudinal
from dpfl.privacy.mechanisms.longitudinal import longitudinal_clip

F32_MAX = float(np.finfo(np.float32).max)


def naive_longitudinal(theta, s):
    """Algorithm 2 literally: zero the smallest non-zero |coordinate| while ||theta|| > S."""
    x = theta.clone().double()
    while float(x.norm()) > s:
        nz = torch.nonzero(x).flatten()
        k = nz[torch.argmin(x[nz].abs())]
        x[k] = 0
    return x.to(theta.dtype)


def exact_sumsq_minus(x: np.ndarray, s: float) -> Fraction | float:
    """A number with the sign of (exact sum of squares of ``x``) - s^2 (exactly)."""
    if x.dtype == np.float64:  # squares would round: exact rationals
        return sum((Fraction(float(v)) ** 2 for v in x.reshape(-1) if v), Fraction(0)) \
            - Fraction(s) ** 2
    x = x.reshape(-1).astype(np.float64)  # float16/32: squares exact in float64
    x = x[x != 0]
    hi = s * s
    lo = float(Fraction(s) ** 2 - Fraction(hi))  # the error of a product is representable
    assert Fraction(hi) + Fraction(lo) == Fraction(s) ** 2
    return math.fsum([*(x * x).tolist(), -hi, -lo])  # correctly rounded: its sign is exact


def float64_norm(x: np.ndarray) -> float:
    """Correctly rounded sum of the float64 squares, then the square root."""
    x = x.reshape(-1).astype(np.float64)
    return math.sqrt(math.fsum((x * x).tolist()))


def largest_at_most(s: float, dtype) -> float:
    """The largest value of ``dtype`` (a numpy float type) that is <= s."""
    v = dtype(s)
    while float(v) > s:
        v = np.nextafter(v, dtype(0))
    return float(v)


def check_properties(theta: torch.Tensor, s: float) -> None:
    """Both readings of ``longitudinal_clip(theta, s)``: the bound, the structure, maximality,
    idempotence."""
    t = theta.reshape(-1).numpy()
    mag = np.abs(t.astype(np.float64))
    edge = float(mag.max()) > s  # the largest coordinate alone exceeds S
    for literal in (False, True):
        out = longitudinal_clip(theta, s, literal=literal)
        assert out.shape == theta.shape and out.dtype == theta.dtype
        o = out.reshape(-1).numpy()
        # the bound: exactly, and as a float64 norm
        assert exact_sumsq_minus(o, s) <= 0, (literal, float64_norm(o), s)
        assert float64_norm(o) <= s
        kept = o != 0
        if edge:
            if literal:
                assert not kept.any()
            else:  # one coordinate, the first largest, at magnitude S (rounded down)
                top = int(np.argmax(mag))
                m = largest_at_most(s, t.dtype.type)
                assert np.flatnonzero(kept).tolist() == ([top] if m > 0 else [])
                assert abs(float(o[top])) == m and (m == 0 or np.sign(o[top]) == np.sign(t[top]))
            continue
        assert np.array_equal(o[kept], t[kept])  # every coordinate is 0 or its input value
        zeroed = ~kept & (t != 0)
        if kept.any() and zeroed.any():
            # the kept coordinates are the largest; of equal magnitudes the lower indices
            # are zeroed first
            kmin, zmax = mag[kept].min(), mag[zeroed].max()
            assert kmin >= zmax
            if kmin == zmax:
                assert np.flatnonzero(zeroed & (mag == kmin)).max() < \
                    np.flatnonzero(kept & (mag == kmin)).min()
        if zeroed.any():  # maximal, up to the documented rounding margins
            nxt = float(mag[zeroed].max())
            kept_sq = float(exact_sumsq_minus(o, 0.0))
            assert kept_sq + nxt * nxt > s * s * (1 - 1e-9)
        assert torch.equal(longitudinal_clip(out, s, literal=literal), out)  # idempotent


def signs(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.choice(np.array([-1.0, 1.0]), size=n)


# ----------------------------------------------------------------- the audit's case


def test_equal_coordinates_small_bound_regression():
    """10^5 equal coordinates, S = 1e-3: the cumulative-sum version zeroed one coordinate
    and released a norm of 1058."""
    theta = torch.full((100_000,), 3.3465347290039062)
    out = longitudinal_clip(theta, 1e-3, literal=True)
    assert not out.any()
    out = longitudinal_clip(theta, 1e-3)
    assert torch.nonzero(out).flatten().tolist() == [0]
    assert float(out[0]) == largest_at_most(1e-3, np.float32)
    out = longitudinal_clip(theta, 10.0)  # 8 of them: sqrt(8) * 3.3465 = 9.47, 9 give 10.04
    assert torch.nonzero(out).flatten().tolist() == list(range(99_992, 100_000))
    check_properties(theta, 10.0)


# ----------------------------------------------------------------- adversarial inputs


EQUAL_VALUES = [3.3465347290039062, 1.0, 1e-30, 1e-40, 1e30, 3.0e38]


@pytest.mark.parametrize("d", [1, 2, 3, 7, 1000, 20_000])
@pytest.mark.parametrize("value", EQUAL_VALUES)
def test_equal_magnitudes(value, d):
    seed = 1000 + d + EQUAL_VALUES.index(value)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    v = float(np.float32(value))
    theta = torch.from_numpy((signs(rng, d) * v).astype(np.float32))
    bounds = [1e-3, v * 0.5, v, v * 1.0000001, v * math.sqrt(d) * 0.999]
    for k in {1, max(1, d // 3), max(1, d - 1)}:
        bounds += [v * math.sqrt(k), v * math.sqrt(k) * (1 - 1e-7), v * math.sqrt(k) * (1 + 1e-7)]
    for s in bounds:
        if not math.isfinite(s) or s <= 0:
            continue
        check_properties(theta, s)
        out = longitudinal_clip(theta, s, literal=True)
        # the exact answer keeps the largest k with k v^2 <= S^2 (the last k indices);
        # within the rounding margin of the boundary one fewer is allowed
        k = min(d, math.floor(Fraction(s) ** 2 / Fraction(v) ** 2))
        kept = torch.nonzero(out).flatten().tolist()
        assert kept == list(range(d - len(kept), d)), seed
        near = abs(k * v * v / (s * s) - 1) < 1e-9
        assert len(kept) == k or (near and len(kept) == k - 1), (seed, s, k, len(kept))


@pytest.mark.parametrize("ratio", [2.0, 1e2, 1e4, 1e8, 1e12, 1e20, 1e30])
@pytest.mark.parametrize("dist", ["normal", "cauchy", "lognormal"])
def test_huge_norm_to_bound_ratios(dist, ratio):
    seed = 2000 + ["normal", "cauchy", "lognormal"].index(dist)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    for d in (10, 1000, 20_000):
        if dist == "normal":
            x = rng.standard_normal(d)
        elif dist == "cauchy":
            x = rng.standard_cauchy(d)
        else:
            x = signs(rng, d) * rng.lognormal(0.0, 8.0, d)
        theta = torch.from_numpy(np.clip(x, -1e30, 1e30).astype(np.float32))
        s = float(theta.double().norm()) / ratio
        check_properties(theta, s)


@pytest.mark.parametrize("seed", [3000, 3001, 3002])
def test_denormals(seed):
    rng = np.random.default_rng(seed)
    for d in (5, 300, 10_000):
        bits = rng.integers(1, 2 ** 23, size=d, dtype=np.uint32)   # float32 denormals
        bits |= (rng.integers(0, 2, size=d, dtype=np.uint32) << 31)  # signs
        theta = torch.from_numpy(bits.view(np.float32).copy())
        norm = float(theta.double().norm())
        for s in (norm / 2, norm / 1e3, 1.4e-45, 3e-45, 1e-40, float(theta.abs().max())):
            check_properties(theta, s)
    mixed = torch.tensor([1e-45, -1e-45, 2e-45, 1e-44, 0.0, 1e-38, -1.2e-38], dtype=torch.float32)
    for s in (1e-45, 1.5e-45, 3e-45, 1e-44, 1.3e-38, 1.6e-38):
        check_properties(mixed, s)


@pytest.mark.parametrize("seed", [4000, 4001, 4002, 4003])
def test_huge_and_tiny_mixtures(seed):
    rng = np.random.default_rng(seed)
    for d in (20, 2000, 20_000):
        x = signs(rng, d) * 10.0 ** rng.uniform(-44, 38, d)
        theta = torch.from_numpy(x.astype(np.float32))
        norm = float(theta.double().norm())
        top = np.sort(np.abs(theta.double().numpy()))[::-1]
        # S exactly the (float64) norm of the top k: the boundary case
        bounds = [norm / 3, norm / 1e10, 1e-30, 1.0]
        bounds += [float(np.sqrt(np.sum(top[:k] ** 2))) for k in (1, 2, 5)]
        for s in bounds:
            check_properties(theta, s)
    # a few huge coordinates on top of many tiny ones, S the huge part's norm: the tiny
    # squares vanish in a float64 sum next to the huge ones
    for tail in (1e-30, 1e-20, 1e-10):
        theta = torch.tensor([1e30] * 3 + [tail] * 100 + [-1e30], dtype=torch.float32)
        for k in (1, 2, 3, 4):
            check_properties(theta, float(np.float32(1e30)) * math.sqrt(k))


@pytest.mark.parametrize("seed", [5000, 5001])
def test_zeros_and_negatives(seed):
    rng = np.random.default_rng(seed)
    check_properties(torch.zeros(10), 1.0)
    assert torch.equal(longitudinal_clip(torch.zeros(10), 1e-30), torch.zeros(10))
    for d in (10, 5000):
        x = np.zeros(d)
        nz = rng.choice(d, size=max(1, d // 50), replace=False)
        x[nz] = rng.standard_normal(nz.size)
        theta = torch.from_numpy(x.astype(np.float32))
        norm = float(theta.double().norm())
        for s in (norm * 0.9, norm * 0.3, norm * 1e-3):
            check_properties(theta, s)
            check_properties(-theta.abs(), s)  # all negative
    theta = torch.tensor([0.0, -2.0, 0.0, 2.0, -2.0, 0.0, 2.0])
    for s in (1.0, 2.0, 3.0, 4.0, 4.5):
        check_properties(theta, s)


@pytest.mark.parametrize("seed", [6000, 6001])
def test_near_float32_overflow(seed):
    rng = np.random.default_rng(seed)
    for d in (3, 1000, 20_000):
        x = signs(rng, d) * F32_MAX * rng.uniform(0.5, 1.0, d)
        theta = torch.from_numpy(x.astype(np.float32))
        for s in (1e38, F32_MAX, 1e39, 1e40, F32_MAX * math.sqrt(d) / 2, 1.0):
            check_properties(theta, s)
    theta = torch.full((1000,), F32_MAX)
    out = longitudinal_clip(theta, 1e39)  # 8 * F32_MAX^2 = (9.6e38)^2 <= 1e78
    assert torch.nonzero(out).flatten().tolist() == list(range(992, 1000))


def test_other_dtypes_and_shapes():
    rng = np.random.default_rng(7000)
    for dtype in (torch.float16, torch.float64):
        theta = torch.from_numpy(rng.standard_normal(500)).to(dtype)
        norm = float(theta.double().norm())
        for s in (norm / 2, norm / 1e3, 1e-6):
            check_properties(theta, s)
    theta = torch.from_numpy(rng.standard_normal((40, 30)).astype(np.float32)).t()  # strided
    s = float(theta.norm()) / 3
    out = longitudinal_clip(theta, s)
    assert out.shape == (30, 40)
    assert torch.equal(out.reshape(-1), longitudinal_clip(theta.reshape(-1), s))
    check_properties(theta, s)


def test_rejects_what_cannot_be_bounded():
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError):
            longitudinal_clip(torch.tensor([1.0, bad]), 1.0)
    for bound in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            longitudinal_clip(torch.ones(3), bound)
    assert torch.equal(longitudinal_clip(torch.ones(3), float("inf")), torch.ones(3))


# ----------------------------------------------------------------- against the naive loop


@pytest.mark.parametrize("seed", range(8000, 8008))
def test_matches_the_naive_loop_on_small_inputs(seed):
    """Dimensions 1..50; magnitudes drawn from a few values (ties), continuous ones and
    zeros; S from fractions of the norm and from the norms of top subsets, nudged."""
    rng = np.random.default_rng(seed)
    for _ in range(20):
        d = int(rng.integers(1, 51))
        kind = rng.integers(0, 3)
        if kind == 0:
            x = rng.choice(np.array([0.0, 0.25, 0.5, 1.0, 3.0]), size=d)
        elif kind == 1:
            x = rng.standard_normal(d) * rng.uniform(0, 1, d)
        else:
            x = rng.choice(np.array([0.0, 0.5, 2.0]), size=d) + (rng.uniform(size=d) < 0.3) * 1e-3
        theta = torch.from_numpy((signs(rng, d) * x).astype(np.float32))
        norm = float(theta.double().norm())
        top = np.sort(np.abs(theta.double().numpy()))[::-1]
        k = int(rng.integers(1, d + 1))
        s_top = float(np.sqrt(np.sum(top[:k] ** 2)))
        bounds = [b for b in (norm * rng.uniform(0.05, 1.2), s_top * (1 + 1e-6),
                              s_top * (1 - 1e-6)) if b > 0]
        for s in bounds:
            naive = naive_longitudinal(theta, s)
            assert torch.equal(longitudinal_clip(theta, s, literal=True), naive), (seed, d, s)
            if float(theta.abs().max()) <= s:  # otherwise the documented edge case applies
                assert torch.equal(longitudinal_clip(theta, s), naive), (seed, d, s)
        if bounds:
            check_properties(theta, bounds[int(rng.integers(len(bounds)))])


@pytest.mark.parametrize("seed", range(6))
def test_matches_the_naive_loop_on_random_vectors(seed):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(300, generator=g) * torch.rand(300, generator=g)
    s = float(theta.norm()) * (0.2 + 0.1 * seed)
    out = longitudinal_clip(theta, s)
    assert torch.equal(longitudinal_clip(theta, s, literal=True), naive_longitudinal(theta, s))
    if float(theta.abs().max()) <= s:  # otherwise the documented edge case applies
        assert torch.equal(out, naive_longitudinal(theta, s))
    check_properties(theta, s)


def test_edge_cases():
    z = torch.zeros(10)
    assert torch.equal(longitudinal_clip(z, 1.0), z)
    small = torch.tensor([0.1, -0.2, 0.3])
    assert torch.equal(longitudinal_clip(small, 1.0), small)  # norm already <= S
    huge = torch.tensor([0.5, -10.0, 0.2])  # the largest alone exceeds S = 1
    assert torch.equal(longitudinal_clip(huge, 1.0), torch.tensor([0.0, -1.0, 0.0]))
    assert torch.equal(longitudinal_clip(huge, 1.0, literal=True), torch.zeros(3))
    assert torch.equal(naive_longitudinal(huge, 1.0), torch.zeros(3))  # the paper's literal result
    # S not representable in float32: the kept magnitude is rounded down, never up
    out = longitudinal_clip(huge, 0.1)
    assert float(out[1]) == -largest_at_most(0.1, np.float32) and float(out[1]) > -0.1
    # exactly at the bound: kept as the loop keeps it
    t = torch.tensor([3.0, 4.0])
    assert torch.equal(longitudinal_clip(t, 4.0, literal=True), torch.tensor([0.0, 4.0]))
    assert torch.equal(longitudinal_clip(t, 5.0), t)


def test_ties_are_zeroed_in_index_order():
    theta = torch.tensor([0.5, -0.5, 0.5, 2.0, -0.5])
    s = math.sqrt(4.0 + 0.25 * 2) + 1e-9  # keep 2.0 and two of the four 0.5s
    out = longitudinal_clip(theta, s)
    assert torch.equal(out, naive_longitudinal(theta, s))
    assert out.tolist() == [0.0, 0.0, 0.5, 2.0, -0.5]


# ----------------------------------------------------------------- the hard check


def test_rounding_at_the_boundary_is_resolved_exactly(monkeypatch):
    """Tiny coordinates whose squares vanish in the float64 sum next to a coordinate of
    magnitude exactly S: the float search keeps them all (exact norm > S); the check
    catches it and the search is redone aiming lower."""
    searches = []
    select = longitudinal._select
    monkeypatch.setattr(longitudinal, "_select",
                        lambda *a: searches.append(a[2]) or select(*a))
    theta = torch.tensor([1e-20] * 50 + [3.0] + [1e-20] * 50)
    out = longitudinal_clip(theta, 3.0)
    assert len(searches) == 2
    assert torch.nonzero(out).flatten().tolist() == [50] and float(out[50]) == 3.0
    assert not longitudinal_clip(theta, 3.0, literal=True).any()  # documented: conservative
    check_properties(theta, 3.0)
    theta = torch.tensor([1e-20] * 50 + [3.0, 4.0] + [1e-20] * 50)
    check_properties(theta, 5.0)
    # without the tiny ones the exact sum 9 + 16 = 25 sits inside the rounding band of the
    # float64 check: decided exactly, both kept, one search
    searches.clear()
    assert torch.equal(longitudinal_clip(torch.tensor([3.0, 4.0]), 5.0), torch.tensor([3.0, 4.0]))
    assert torch.equal(longitudinal_clip(torch.tensor([3.0, 4.0, 1.0]), 5.0),
                       torch.tensor([3.0, 4.0, 0.0]))
    assert len(searches) == 1


def test_hard_check_backstops_a_wrong_search(monkeypatch):
    """Were the search to keep everything, the check still bounds the output: re-search
    (same wrong answer here), then scaling by S / norm (1 - 1e-6)."""
    monkeypatch.setattr(longitudinal, "_keep_largest", lambda flat, sq, budget: flat.copy())
    theta = torch.from_numpy(np.random.default_rng(9000).standard_normal(1000).astype(np.float32))
    for s in (1.0, 1e-3, 1e-30):
        out = longitudinal_clip(theta, s)
        o = out.numpy()
        assert exact_sumsq_minus(o, s) <= 0
        assert float64_norm(o) > s * (1 - 1e-5)  # scaled, not zeroed
