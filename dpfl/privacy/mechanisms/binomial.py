"""The binomial mechanism under secure aggregation, accounted by summing its pmf.

Agarwal, Suresh, Yu, Kumar & McMahan, "cpSGD: Communication-efficient and differentially-
private distributed SGD", NeurIPS 2018: each client adds Bin(m, p) - m p to its quantised
integer vector; the secure sum carries Bin(N, p), N = (clients) m. The paper's Theorem 1
bounds the binomial mechanism's (epsilon, delta) in one closed form with constants
(b_p, c_p, d_p) and a validity condition on N p (1 - p); dpfl does NOT use it (its
constants are not checked here and one (epsilon, delta) point per round composes poorly).
dpfl charges instead what the pmf gives exactly, for p = 1/2:

- Per coordinate, a shift s (1 <= |s| <= Delta_inf) of Bin(N, 1/2) changes the support
  [0, N] to [s, N + s]: the Renyi divergence is infinite. On the common support S, P(S) =
  Q(S) = 1 - eta(s), eta(s) = P(Bin(N, 1/2) <= s - 1) (symmetry of p = 1/2), and the
  conditional distributions have

      f_alpha(s) = D_alpha(P|S || Q|S) = log(sum_{x in S} P(x)^alpha Q(x)^(1-alpha) / P(S))
                   / (alpha - 1),

  summed over the pmf (:func:`restricted_divergence`; both directions are equal by the
  symmetry x -> N + s - x). This is Bun & Steinke's delta-approximate concentrated DP
  ("Concentrated Differential Privacy: Simplifications, Extensions, and Lower Bounds",
  TCC 2016, Definition 8.1: the Renyi bound holds conditionally on events of probability
  >= 1 - delta) with an arbitrary RDP curve in place of xi + rho alpha; their composition
  (the deltas add) and conversion (the delta is added to the conversion's) argue order by
  order, so they hold for any curve.
- Over d coordinates the conditionals factor: the divergence is sum_j f_alpha(s_j) and the
  excluded mass at most sum_j eta(s_j). For an integer shift vector with ||s||_2 <= D2 and
  |s_j| <= Delta_inf, sum_j g(s_j) <= D2^2 max_{1 <= s <= Delta_inf} g(s) / s^2 (each
  non-zero s_j contributes s_j^2 to D2^2) and <= d max_s g(s); dpfl takes the smaller
  (:func:`binomial_curve`, :func:`support_delta`).
- The mixture over the clients' random rounding: dpfl's analysis holds for an adversary
  that even sees the rounding coins (then both datasets use the same coins and the shift is
  a fixed integer vector), and dropping the coins is post-processing. With p = 1/2 the
  conditioning events of x and x' have equal probability for every coin outcome, so the
  conditional divergence of the mixture is at most the worst outcome's.
- More than n_min survivors add independent binomials: post-processing of the N = n_min m
  mechanism (dpfl charges that N, the guaranteed one).

Numerics: the sums run in float64 over the pmf from ``scipy.special.gammaln``, written as
P(S) + sum P(x) expm1((alpha - 1) D(x)) with D(x) = log P(x) / P(x - s) a sum of s exact
log-ratio terms, positive and negative parts separately in log space; negative terms
outside the window N/2 +- r are dropped (an over-estimate) and positive ones below it are
bounded by Hoeffding times exp((alpha - 1) s log N) (added). The result is multiplied by
1 + 10^-2 (:data:`SAFETY`); ``tests/test_cpsgd.py`` checks it against exact rational sums.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy.special import gammaln

from dpfl.privacy.accounting.event_types import BINOMIAL_ORDERS
from dpfl.privacy.accounting.events import PrivacyEvent

# the orders at which the binomial curve is computed (its RDP is infinite at the others)
ORDERS = BINOMIAL_ORDERS
SAFETY = 1.01                 # multiplies every computed divergence (float summation)
TAIL_LOG = -40.0              # log of the Hoeffding-bounded mass left out below the window


def _log_pmf(n: int, x: np.ndarray) -> np.ndarray:
    logs: np.ndarray = gammaln(n + 1) - gammaln(x + 1) - gammaln(n - x + 1) - n * math.log(2.0)
    return logs


def support_mass(n: int, s: int) -> float:
    """eta(s) = P(Bin(n, 1/2) <= s - 1): the mass of P outside the common support."""
    if s <= 0:
        return 0.0
    x = np.arange(0, min(s, n + 1), dtype=np.float64)
    logs = _log_pmf(n, x)
    top = logs.max()
    return float(min(1.0, math.exp(top) * np.exp(logs - top).sum()))


def _window(n: int, s: int, alpha: int) -> tuple[int, int]:
    """[lo, hi]: the x at which :func:`restricted_divergence` sums the pmf for shift ``s``
    at order ``alpha`` (N/2 +- r; below it Hoeffding, above it dropped negative terms)."""
    r = math.sqrt(n * (s * (alpha - 1) * math.log(max(n, 2)) - TAIL_LOG) / 2.0)
    return max(s, math.floor(n / 2 - r)), min(n, math.ceil(n / 2 + r))


def _log_ratio_term(n: int, j: np.ndarray) -> np.ndarray:
    """log((n - j + 1) / j), one term of D(x) = log C(n, x) / C(n, x - s)."""
    terms: np.ndarray = np.log1p((n - 2.0 * j + 1.0) / j)
    return terms


def restricted_divergence(n: int, s: int, alpha: int) -> float:
    """f_alpha(s): the Renyi divergence of order ``alpha`` of Bin(n, 1/2) and its shift by
    ``s`` >= 1, both conditioned on their common support (see module docstring); inf when
    the supports do not meet."""
    if s > n:
        return math.inf
    lo, hi = _window(n, s, alpha)
    x = np.arange(lo, hi + 1, dtype=np.float64)
    # D(x) = log C(n, x) / C(n, x - s) = sum_{j = x-s+1}^{x} log((n - j + 1) / j)
    d = np.zeros_like(x)
    for o in range(s):
        d += _log_ratio_term(n, x - o)
    return _divergence(n, s, alpha, x, d, _log_pmf(n, x), 1.0 - support_mass(n, s))


def _divergence(n: int, s: int, alpha: int, x: np.ndarray, d: np.ndarray,
                logp: np.ndarray, p_s: float) -> float:
    """:func:`restricted_divergence` from its window ``x``, D(x) and log P(x) there, and the
    common support's mass ``p_s``."""
    lo = int(x[0])
    a1 = alpha - 1
    y = a1 * d
    pos = y > 0
    # log(P(x) expm1(y)) for y > 0: logp + y + log1p(-exp(-y)); |terms| for y < 0
    lpos = logp[pos] + y[pos] + np.log(-np.expm1(-y[pos]))
    lneg = logp[~pos & (y < 0)] + np.log(-np.expm1(y[~pos & (y < 0)]))
    positive = _lse(lpos)
    if lo > s:   # the positive terms below the window (Hoeffding x the largest ratio)
        positive = np.logaddexp(positive, -2.0 * (n / 2 - lo) ** 2 / n + a1 * s * math.log(n))
    negative = _lse(lneg)
    excess = math.exp(positive) - math.exp(negative) if positive < 700 else math.inf
    if not math.isfinite(excess):
        return (float(positive) - math.log(p_s)) / a1 * SAFETY
    return max(0.0, math.log1p(excess / p_s) / a1) * SAFETY


def restricted_divergences(n: int, max_shift: int) -> dict[tuple[int, int], float]:
    """{(alpha, s): f_alpha(s)} for every order of :data:`ORDERS` and 1 <= s <= ``max_shift``:
    the values of :func:`restricted_divergence`, bit for bit, in O(max_shift x window)
    instead of O(max_shift^2 x window x orders). D_s(x) does not depend on alpha and is
    D_{s-1}(x) plus one term, added in the same order as there; it is kept on the union of
    every window, and each (alpha, s) reads its own window from it."""
    out = {(a, s): math.inf for a in ORDERS for s in range(n + 1, max_shift + 1)}
    shifts = range(1, min(max_shift, n) + 1)
    windows = {(a, s): _window(n, s, a) for a in ORDERS for s in shifts}
    if not windows:
        return out
    first = min(lo for lo, _ in windows.values())
    x = np.arange(first, max(hi for _, hi in windows.values()) + 1, dtype=np.float64)
    d = np.zeros_like(x)
    logp = _log_pmf(n, x)
    with np.errstate(divide="ignore", invalid="ignore"):   # j <= 0 only left of s's windows
        for s in shifts:
            d += _log_ratio_term(n, x - (s - 1))
            p_s = 1.0 - support_mass(n, s)
            for a in ORDERS:
                lo, hi = windows[a, s]
                w = slice(lo - first, hi - first + 1)
                out[a, s] = _divergence(n, s, a, x[w], d[w], logp[w], p_s)
    return out


def _lse(v: np.ndarray) -> float:
    if v.size == 0:
        return -math.inf
    top = float(v.max())
    return top + math.log(float(np.exp(v - top).sum()))


@lru_cache(maxsize=256)
def per_unit_shift(n: int, max_shift: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(max_s f_alpha(s) / s^2, max_s f_alpha(s)) over 1 <= s <= ``max_shift``, per order of
    :data:`ORDERS`."""
    per_sq, per = [], []
    divergences = restricted_divergences(n, max_shift)
    for alpha in ORDERS:
        f = [divergences[alpha, s] for s in range(1, max_shift + 1)]
        per_sq.append(max(v / s ** 2 for s, v in enumerate(f, start=1)))
        per.append(max(f))
    return tuple(per_sq), tuple(per)


def binomial_curve(n: int, max_shift: int, d2: float, dim: int) -> np.ndarray:
    """The (conditional) RDP at :data:`ORDERS` of Bin(n, 1/2) noise on an integer vector of
    L2 sensitivity ``d2`` and L-inf sensitivity ``max_shift`` in ``dim`` coordinates."""
    per_sq, per = per_unit_shift(n, max_shift)
    curve: np.ndarray = np.minimum(d2 * d2 * np.asarray(per_sq), dim * np.asarray(per))
    return curve


def support_delta(n: int, max_shift: int, d2: float, dim: int) -> float:
    """The excluded mass of one release: <= min(D2^2 max_s eta(s) / s^2, d eta(Delta_inf))."""
    eta = [support_mass(n, s) for s in range(1, max_shift + 1)]
    return min(d2 * d2 * max(e / s ** 2 for s, e in enumerate(eta, start=1)), dim * eta[-1])


def binomial_event(round_: int, n: int, max_shift: int, bound: float, dim: int,
                   relation: str, rounds: int, delta_share: float) -> PrivacyEvent:
    """One round's ``binomial`` event: ``sigma`` = sqrt(n / 4) / B (the Gaussian-equivalent
    multiplier, halved under replace-one like every Gaussian event, so D2 = 2 B there) and
    ``epsilon`` = the slack c with alpha / (2 sigma_eff^2) + c >= the exact curve plus
    log(1 / (1 - delta_share)) / (rounds (alpha - 1)) at every order of :data:`ORDERS`: over
    ``rounds`` such events dp-accounting's conversion at delta then equals the exact
    curve's at delta (1 - delta_share), which leaves ``delta_share`` delta for the excluded
    mass (:func:`support_delta`, checked by the caller)."""
    d2 = 2.0 * bound if relation == "replace-one" else bound
    sigma = math.sqrt(n / 4.0) / bound
    sigma_eff = sigma / 2.0 if relation == "replace-one" else sigma
    orders = np.asarray(ORDERS, dtype=float)
    exact = binomial_curve(n, max_shift, d2, dim)
    extra = -math.log1p(-delta_share) / (rounds * (orders - 1.0))
    slack = float(np.max(exact + extra - orders / (2.0 * sigma_eff ** 2)))
    return PrivacyEvent(round_, "binomial", sigma=sigma, epsilon=max(slack, 0.0),
                        relation=relation)
